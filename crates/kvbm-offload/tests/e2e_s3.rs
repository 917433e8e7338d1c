//! G2→G4 against the real S3-compatible server: two pipelines (two workers) race for the same
//! blocks; the object locks let exactly one of them write each object.

mod common;

use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use common::{external, hash, host_layout};
use kvbm_logical::SequenceHash;
use kvbm_offload::object::{ObjectLockPresenceFilter, lock_key};
use kvbm_offload::policy::EvalContext;
use kvbm_offload::*;
use kvbm_physical::{
    BlockLayout, ObjectConfig, ObjectStorage, PhysicalLayout, PinPolicy, TransferManager,
};

fn geometry(n: usize) -> BlockLayout {
    common::geometry(n, 2, 32)
}

fn storage(test: &str) -> Option<Arc<ObjectStorage>> {
    let raw = raw_store(test)?;
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    let config = ObjectConfig {
        namespace: format!("offload-{test}-{}-{nanos}", std::process::id()),
        ..Default::default()
    };
    Some(Arc::new(ObjectStorage::new(raw, config)))
}

/// A client of the provisioned server for the test itself, to write and inspect objects the way
/// another worker (or an operator) would; the storage under test keeps its own store private.
fn raw_store(test: &str) -> Option<Arc<dyn object_store::ObjectStore>> {
    let s3 = kvbm_tests::services::s3(test)?;
    Some(Arc::new(
        object_store::aws::AmazonS3Builder::new()
            .with_bucket_name(s3.bucket)
            .with_region("us-east-1")
            .with_access_key_id(s3.access_key)
            .with_secret_access_key(s3.secret_key)
            .with_virtual_hosted_style_request(false)
            .with_allow_http(s3.endpoint.starts_with("http://"))
            .with_endpoint(s3.endpoint)
            .build()
            .expect("s3 client"),
    ))
}

/// One worker: its own transfer manager and G2 layout, writing into the shared bucket.
fn worker(storage: &Arc<ObjectStorage>, n: usize, owner: &str) -> ObjectPipeline {
    let tm = Arc::new(TransferManager::new().unwrap());
    let g2_h = host_layout(&tm, geometry(n), PinPolicy::Unpinned);
    let obj_h = tm
        .register_layout(PhysicalLayout::object(geometry(n), storage.clone()))
        .unwrap();
    // The lock's read-back waits long enough for a racing create to land even on a loaded CI
    // machine (s3s-fs does not make creates exclusive; the default 20 ms assumes a quiet one).
    let config = ObjectPipelineConfig {
        lock_verify_delay: std::time::Duration::from_millis(200),
        ..ObjectPipelineConfig::default()
    };
    ObjectPipelineBuilder::new(storage.clone())
        .owner(owner)
        .config(config)
        .spawn(ObjectMoveExecutor::<kvbm_logical::G2>::new(tm, g2_h, obj_h))
        .unwrap()
}

/// Two workers offload the same `n` blocks at once. Asserts that nothing failed, that each
/// block was written by exactly one of them and that its object exists; returns both pipelines
/// and their results.
async fn race_two_workers(
    storage: &Arc<ObjectStorage>,
    n: usize,
) -> (ObjectPipeline, ObjectPipeline, OffloadResult, OffloadResult) {
    let a = worker(storage, n, "worker-a");
    let b = worker(storage, n, "worker-b");
    let ha = a.enqueue(external(0, n as u32), None).await.unwrap();
    let hb = b.enqueue(external(0, n as u32), None).await.unwrap();
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
            storage.exists(&object_key(h)).await.unwrap(),
            "object {i} exists"
        );
    }
    (a, b, ra, rb)
}

/// Every lock the pipelines took was released: none held, no lock object left for `0..n`.
async fn assert_locks_released(storage: &ObjectStorage, pipelines: [&ObjectPipeline; 2], n: usize) {
    for p in pipelines {
        let f = p.lock_filter().expect("locks on by default");
        f.flush_releases().await;
        assert!(f.held_locks().is_empty());
    }
    for i in 0..n as u32 {
        assert_eq!(lock_body(storage, hash(i)).await, None, "lock {i} released");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn g2_to_g4_two_pipelines_race_for_the_same_object_lock() {
    let Some(storage) = storage("g2_to_g4_lock_race") else {
        return;
    };
    let n = 32;
    let (a, b, ra, rb) = race_two_workers(&storage, n).await;
    for i in 0..n as u32 {
        let h = hash(i);
        let (wrote_a, wrote_b) = (
            ra.completed_blocks.contains(&h),
            rb.completed_blocks.contains(&h),
        );
        assert!(
            ra.filtered_blocks.contains(&h) == wrote_b
                && rb.filtered_blocks.contains(&h) == wrote_a,
            "the loser filtered block {i}"
        );
    }
    assert_locks_released(&storage, [&a, &b], n).await;

    // Present now: a later offload of the same blocks is filtered by the presence check.
    let again = a
        .enqueue(external(0, n as u32), None)
        .await
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
        digest: None,
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
        checker
            .has_blocks(vec![(hash(1), None), (hash(2), None)])
            .await
            .unwrap(),
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
                digest: None,
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

// --- Lock expiry -------------------------------------------------------------------------------

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64
}

/// Writes a lock object by hand, as another worker would have: `{token, created_ms, ttl_ms}`.
async fn put_lock(storage: &ObjectStorage, h: SequenceHash, body: impl Into<bytes::Bytes>) {
    use object_store::ObjectStoreExt;
    raw_store("put_lock")
        .expect("S3 tests only")
        .put(&storage.path(&lock_key(h)), body.into().into())
        .await
        .unwrap();
}

fn lock_record(token: &str, created_ms: u64, ttl_ms: u64) -> String {
    format!(r#"{{"token":"{token}","created_ms":{created_ms},"ttl_ms":{ttl_ms}}}"#)
}

async fn lock_body(storage: &ObjectStorage, h: SequenceHash) -> Option<bytes::Bytes> {
    storage
        .get_small(&lock_key(h), 1 << 20)
        .await
        .expect("get lock")
        .map(|o| o.body)
}

async fn eval_one(f: &ObjectLockPresenceFilter, h: SequenceHash) -> bool {
    let ctx = EvalContext {
        sequence_hash: h,
        digest: None,
        block_id: None,
        source: kvbm_logical::TierId::G2,
        destination: kvbm_logical::TierId::G4,
    };
    match f.evaluate_batch(&[ctx]) {
        either::Either::Left(r) => r.await.unwrap()[0],
        either::Either::Right(f) => f.await.unwrap()[0],
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stale_lock_of_a_crashed_worker_is_broken_and_the_block_offloaded_once() {
    let Some(storage) = storage("object_lock_stale") else {
        return;
    };
    let n = 16;
    // A worker crashed an hour ago holding every lock (60 s TTL): long expired.
    let created = now_ms() - 3_600_000;
    for i in 0..n as u32 {
        put_lock(
            &storage,
            hash(i),
            lock_record("crashed-worker", created, 60_000),
        )
        .await;
    }
    // Two live workers race for the blocks: each stale lock is broken once, each block
    // written exactly once.
    let (a, b, _, _) = race_two_workers(&storage, n).await;
    assert_locks_released(&storage, [&a, &b], n).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn live_and_unparseable_locks_are_respected() {
    let Some(storage) = storage("object_lock_live") else {
        return;
    };
    // Block 0: held by a live worker (created now, 60 s TTL). Block 1: a lock whose body is not
    // a lock record (here, the bare token of an older format). Block 2: garbage bytes.
    let live = lock_record("live-worker", now_ms(), 60_000);
    put_lock(&storage, hash(0), live.clone()).await;
    put_lock(&storage, hash(1), "old-worker/123/456/0").await;
    put_lock(&storage, hash(2), vec![0xffu8, 0, 1, 2]).await;
    let before = [
        lock_body(&storage, hash(0)).await.unwrap(),
        lock_body(&storage, hash(1)).await.unwrap(),
        lock_body(&storage, hash(2)).await.unwrap(),
    ];

    let a = worker(&storage, 3, "worker-a");
    let r = a
        .enqueue(external(0, 3), None)
        .await
        .unwrap()
        .wait()
        .await
        .unwrap();
    assert!(
        r.completed_blocks.is_empty() && r.failed_blocks.is_empty(),
        "{r:?}"
    );
    assert_eq!(r.filtered_blocks.len(), 3, "{r:?}");
    let f = a.lock_filter().unwrap();
    f.flush_releases().await;
    assert!(f.held_locks().is_empty());
    for i in 0..3u32 {
        assert!(!storage.exists(&object_key(hash(i))).await.unwrap());
        assert_eq!(
            lock_body(&storage, hash(i)).await.as_ref(),
            Some(&before[i as usize]),
            "lock {i} untouched"
        );
    }
    // Even long after, an unparseable lock is never broken; the live one only past its TTL.
    assert!(!eval_one(f, hash(2)).await);
}

/// A holder that never releases (crashed) with a short TTL: its lock is taken over once
/// expired, and its late release (a holder that outlived its TTL) leaves the new lock alone.
async fn expired_lock_is_taken_over(storage: Arc<ObjectStorage>) {
    let ttl = std::time::Duration::from_millis(300);
    let crashed = ObjectLockPresenceFilter::new(storage.clone(), "crashed").with_lock_ttl(ttl);
    let live = ObjectLockPresenceFilter::new(storage.clone(), "live").with_lock_ttl(ttl);
    let h = hash(7);
    assert!(eval_one(&crashed, h).await, "first taker wins");
    assert!(!eval_one(&live, h).await, "live lock respected");
    tokio::time::sleep(ttl + std::time::Duration::from_millis(100)).await;
    assert!(eval_one(&live, h).await, "expired lock broken");
    let body = lock_body(&storage, h).await.unwrap();
    assert!(
        std::str::from_utf8(&body).unwrap().contains(live.token()),
        "the lock is now the live worker's"
    );
    crashed.release(&[h]);
    crashed.flush_releases().await;
    assert_eq!(
        lock_body(&storage, h).await,
        Some(body),
        "a late release leaves the new owner's lock"
    );
    live.release(&[h]);
    live.flush_releases().await;
    assert_eq!(lock_body(&storage, h).await, None);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn expired_lock_is_replaced_by_conditional_update_on_s3() {
    let Some(storage) = storage("object_lock_expiry") else {
        return;
    };
    expired_lock_is_taken_over(storage).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn expired_lock_is_deleted_and_recreated_without_conditional_update() {
    // The local filesystem store has no `PutMode::Update`: the token-checked delete fallback.
    let dir = tempfile::tempdir().unwrap();
    let storage = Arc::new(ObjectStorage::local(dir.path(), ObjectConfig::default()).unwrap());
    expired_lock_is_taken_over(storage).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s3_server_enforces_if_match_on_lock_replacement() {
    // What the expiry takeover relies on: the server returns an ETag for a lock, and a
    // `PutMode::Update` with an ETag that no longer matches (the stale lock was replaced in
    // between) is refused, while one that matches replaces it.
    use object_store::{ObjectStoreExt, PutMode, PutOptions, UpdateVersion};
    let Some(storage) = storage("object_lock_if_match") else {
        return;
    };
    let raw = raw_store("object_lock_if_match").unwrap();
    let path = storage.path(&lock_key(hash(1)));
    put_lock(&storage, hash(1), lock_record("crashed", 1, 1)).await;
    let stale = raw.head(&path).await.unwrap();
    assert!(stale.e_tag.is_some(), "the server returns ETags");
    let update = |meta: &object_store::ObjectMeta| PutOptions {
        mode: PutMode::Update(UpdateVersion {
            e_tag: meta.e_tag.clone(),
            version: meta.version.clone(),
        }),
        ..Default::default()
    };
    // Someone else broke it first: our update, conditioned on the stale ETag, must fail.
    put_lock(&storage, hash(1), lock_record("other", now_ms(), 60_000)).await;
    let err = raw
        .put_opts(&path, bytes::Bytes::from("mine").into(), update(&stale))
        .await
        .unwrap_err();
    assert!(
        matches!(err, object_store::Error::Precondition { .. }),
        "{err}"
    );
    assert!(
        std::str::from_utf8(&lock_body(&storage, hash(1)).await.unwrap())
            .unwrap()
            .contains("other")
    );
    // Conditioned on the current ETag, it replaces the lock.
    let current = raw.head(&path).await.unwrap();
    raw.put_opts(&path, bytes::Bytes::from("mine").into(), update(&current))
        .await
        .unwrap();
    assert_eq!(
        lock_body(&storage, hash(1)).await.as_deref(),
        Some(&b"mine"[..])
    );
}

// --- Issue 10: fail closed -------------------------------------------------------------------

/// An object copied under another block's key (by a bug or an operator) is not that block: the
/// presence check counts it as absent, the next offload rewrites it, and the rewritten object
/// is the block's own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fail_closed_foreign_object_is_rewritten() {
    use object_store::ObjectStoreExt;
    let test = "fail_closed_foreign_object";
    let Some(storage) = storage(test) else {
        return;
    };
    let raw = raw_store(test).unwrap();
    let a = worker(&storage, 2, "worker-a");
    let r = a
        .enqueue(external(0, 1), None)
        .await
        .unwrap()
        .wait()
        .await
        .unwrap();
    assert_eq!(r.completed_blocks, vec![hash(0)], "{r:?}");
    // Block 0's object copied to block 1's key.
    raw.copy(
        &storage.path(&object_key(hash(0))),
        &storage.path(&object_key(hash(1))),
    )
    .await
    .unwrap();
    let checker = S3PresenceChecker::new(storage.clone());
    assert_eq!(
        checker
            .has_blocks(vec![(hash(0), None), (hash(1), None)])
            .await
            .unwrap(),
        vec![true, false],
        "a foreign object is not present"
    );
    let r = a
        .enqueue(external(1, 1), None)
        .await
        .unwrap()
        .wait()
        .await
        .unwrap();
    assert_eq!(
        r.completed_blocks,
        vec![hash(1)],
        "the foreign object is rewritten: {r:?}"
    );
    assert_eq!(
        checker.has_blocks(vec![(hash(1), None)]).await.unwrap(),
        vec![true]
    );
    a.shutdown_and_wait().await;
}

/// Shutdown waits for the lock deletions its releases started: nothing is left behind. The
/// evaluations time out while verifying their locks, so each release first waits
/// `lock_verify_delay` for a create that may still be landing: without the flush, shutdown
/// returns while every lock still exists.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fail_closed_shutdown_flushes_lock_releases() {
    let Some(storage) = storage("fail_closed_shutdown_flush") else {
        return;
    };
    let n = 8;
    let tm = Arc::new(TransferManager::new().unwrap());
    let g2_h = host_layout(&tm, geometry(n), PinPolicy::Unpinned);
    let obj_h = tm
        .register_layout(PhysicalLayout::object(geometry(n), storage.clone()))
        .unwrap();
    let mut config = ObjectPipelineConfig {
        lock_verify_delay: std::time::Duration::from_millis(800),
        ..Default::default()
    };
    config.pipeline.policy_timeout = std::time::Duration::from_millis(200);
    let a = ObjectPipelineBuilder::new(storage.clone())
        .config(config)
        .owner("slow-verifier")
        .spawn(ObjectMoveExecutor::<kvbm_logical::G2>::new(tm, g2_h, obj_h))
        .unwrap();
    let r = a
        .enqueue(external(0, n as u32), None)
        .await
        .unwrap()
        .wait()
        .await
        .unwrap();
    assert_eq!(
        r.filtered_blocks.len(),
        n,
        "every evaluation timed out: {r:?}"
    );
    let f = a.lock_filter().unwrap();
    assert!(f.held_locks().is_empty(), "released (deletes pending)");
    assert!(
        lock_body(&storage, hash(0)).await.is_some(),
        "the interrupted create landed; its delete waits for lock_verify_delay"
    );
    // No flush_releases here: shutdown alone must leave no lock behind.
    a.shutdown_and_wait().await;
    for i in 0..n as u32 {
        assert_eq!(
            lock_body(&storage, hash(i)).await,
            None,
            "lock {i} left behind"
        );
    }
}
