//! G2→G4 against the real S3-compatible server: two pipelines (two workers) race for the same
//! blocks; the object locks let exactly one of them write each object.

mod common;

use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use common::{external, hash, host_layout};
use kvbm_logical::SequenceHash;
use kvbm_offload::*;
use kvbm_physical::{
    BlockLayout, ObjectConfig, ObjectStorage, PhysicalLayout, PinPolicy, S3Config, TransferManager,
};

fn geometry(n: usize) -> BlockLayout {
    common::geometry(n, 2, 32)
}

fn storage(test: &str) -> Option<Arc<ObjectStorage>> {
    let s3 = kvbm_tests::services::s3(test)?;
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    let config = ObjectConfig {
        namespace: format!("offload-{test}-{}-{nanos}", std::process::id()),
        ..Default::default()
    };
    let cfg = S3Config {
        endpoint: Some(s3.endpoint),
        bucket: s3.bucket,
        region: "us-east-1".into(),
        access_key: s3.access_key,
        secret_key: s3.secret_key,
    };
    Some(Arc::new(
        ObjectStorage::s3(&cfg, config).expect("s3 client"),
    ))
}

/// One worker: its own transfer manager and G2 layout, writing into the shared bucket.
fn worker(storage: &Arc<ObjectStorage>, n: usize, owner: &str) -> ObjectPipeline {
    let tm = Arc::new(TransferManager::new().unwrap());
    let g2_h = host_layout(&tm, geometry(n), PinPolicy::Unpinned);
    let obj_h = tm
        .register_layout(PhysicalLayout::object(geometry(n), storage.clone()))
        .unwrap();
    ObjectPipelineBuilder::new(storage.clone())
        .owner(owner)
        .spawn(ObjectTransferExecutor::<kvbm_logical::G2>::new(
            tm, g2_h, obj_h,
        ))
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn g2_to_g4_two_pipelines_race_for_the_same_object_lock() {
    let Some(storage) = storage("g2_to_g4_lock_race") else {
        return;
    };
    let n = 32;
    let a = worker(&storage, n, "worker-a");
    let b = worker(&storage, n, "worker-b");

    let ha = a.enqueue(external(0, n as u32), None).unwrap();
    let hb = b.enqueue(external(0, n as u32), None).unwrap();
    let (ra, rb) = tokio::join!(ha.wait(), hb.wait());
    let (ra, rb) = (ra.unwrap(), rb.unwrap());
    assert!(
        ra.failed_blocks.is_empty() && rb.failed_blocks.is_empty(),
        "{ra:?} {rb:?}"
    );
    for i in 0..n as u32 {
        let h = hash(i);
        let wrote_a = ra.completed_blocks.contains(&h);
        let wrote_b = rb.completed_blocks.contains(&h);
        assert!(
            wrote_a ^ wrote_b,
            "block {i} written exactly once (a: {wrote_a}, b: {wrote_b})"
        );
        assert!(
            ra.filtered_blocks.contains(&h) == wrote_b
                && rb.filtered_blocks.contains(&h) == wrote_a,
            "the loser filtered block {i}"
        );
        assert!(
            storage.exists(&object_key(h)).await.unwrap(),
            "object {i} exists"
        );
    }

    // Every lock was released: nothing held, no lock object left.
    for p in [&a, &b] {
        let f = p.lock_filter().expect("locks on by default");
        f.flush_releases().await;
        assert!(f.held_locks().is_empty());
    }
    for i in 0..n as u32 {
        assert!(
            !storage.exists(&lock_key(hash(i))).await.unwrap(),
            "lock {i} released"
        );
    }

    // Present now: a later offload of the same blocks is filtered by the presence check.
    let again = a
        .enqueue(external(0, n as u32), None)
        .unwrap()
        .wait()
        .await
        .unwrap();
    assert_eq!(again.filtered_blocks.len(), n);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn object_lock_is_exclusive_and_released() {
    let Some(storage) = storage("object_lock_exclusive") else {
        return;
    };
    let one = ObjectLockPresenceFilter::new(storage.clone(), "one");
    let two = ObjectLockPresenceFilter::new(storage.clone(), "two");
    let ctx = |h: SequenceHash| EvalContext {
        sequence_hash: h,
        block_id: None,
        source: kvbm_logical::TierId::G2,
        destination: kvbm_logical::TierId::G4,
    };
    let eval = |f: &ObjectLockPresenceFilter, h| {
        let fut = f.evaluate_batch(&[ctx(h)]);
        async move {
            match fut {
                either::Either::Left(r) => r.await,
                either::Either::Right(f) => f.await,
            }
        }
    };
    assert_eq!(
        eval(&one, hash(1)).await.unwrap(),
        vec![true],
        "first taker wins"
    );
    assert_eq!(
        eval(&two, hash(1)).await.unwrap(),
        vec![false],
        "lock taken"
    );
    assert_eq!(one.held_locks(), vec![hash(1)]);
    one.release(&[hash(1)]);
    one.flush_releases().await;
    assert!(one.held_locks().is_empty());
    assert_eq!(
        eval(&two, hash(1)).await.unwrap(),
        vec![true],
        "free again after release"
    );
    two.release(&[hash(1)]);
    two.flush_releases().await;

    let checker = S3PresenceChecker::new(storage.clone());
    assert_eq!(
        checker.has_blocks(vec![hash(1), hash(2)]).await.unwrap(),
        vec![false, false]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn locks_interrupted_by_timeout_are_released() {
    // Evaluations dropped at assorted points — before, during and after the conditional create —
    // as the policy timeout or a cancellation drops them: every lock they may have created is
    // still deleted by the release, none is left to block the block forever.
    let Some(storage) = storage("object_lock_interrupted") else {
        return;
    };
    let f = ObjectLockPresenceFilter::new(storage.clone(), "interrupted")
        .with_verify_delay(std::time::Duration::from_millis(100));
    let mut all = Vec::new();
    for (round, ms) in [0u64, 1, 2, 3, 5, 8, 13, 200].into_iter().enumerate() {
        let hs: Vec<SequenceHash> = (0..16)
            .map(|i| hash(1000 + round as u32 * 16 + i))
            .collect();
        let ctxs: Vec<EvalContext> = hs
            .iter()
            .map(|&h| EvalContext {
                sequence_hash: h,
                block_id: None,
                source: kvbm_logical::TierId::G2,
                destination: kvbm_logical::TierId::G4,
            })
            .collect();
        let fut = match f.evaluate_batch(&ctxs) {
            either::Either::Left(_) => panic!("the lock filter is asynchronous"),
            either::Either::Right(fut) => fut,
        };
        let _ = tokio::time::timeout(std::time::Duration::from_millis(ms), fut).await;
        f.release(&hs);
        all.extend(hs);
    }
    f.flush_releases().await;
    assert!(f.held_locks().is_empty());
    for h in all {
        assert!(
            !storage.exists(&lock_key(h)).await.unwrap(),
            "lock of {h:?} left behind"
        );
    }
}
