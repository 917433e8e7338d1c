//! Unit tests of the lock bookkeeping over an in-memory store (logic only; the protocol against
//! a real S3 server is tested in `tests/e2e_s3.rs`).
//!
//! On a current-thread runtime the in-memory store answers without yielding, so a spawned
//! release runs exactly when the test awaits it: the interleavings below are deterministic.

use std::sync::Arc;

use kvbm_logical::{SequenceHash, TierId};
use kvbm_physical::{ObjectConfig, ObjectStorage};

use super::keys::lock_key;
use super::lock::ObjectLockPresenceFilter;
use crate::policy::{EvalContext, OffloadPolicy};

fn filter(storage: &Arc<ObjectStorage>) -> ObjectLockPresenceFilter {
    ObjectLockPresenceFilter::new(storage.clone(), "unit")
        .with_verify_delay(std::time::Duration::ZERO)
}

async fn eval(f: &ObjectLockPresenceFilter, h: SequenceHash) -> bool {
    let ctx = EvalContext {
        sequence_hash: h,
        digest: None,
        block_id: None,
        source: TierId::G2,
        destination: TierId::G4,
    };
    match f.evaluate_batch(&[ctx]) {
        either::Either::Left(r) => r.await.unwrap()[0],
        either::Either::Right(f) => f.await.unwrap()[0],
    }
}

/// A release from an old acquisition, delayed until the same filter re-acquired the block,
/// must leave the newer lock alone (each release is tied to its own acquisition's token).
#[tokio::test(flavor = "current_thread")]
async fn fail_closed_delayed_release_keeps_newer_lock() {
    let storage = Arc::new(ObjectStorage::in_memory(ObjectConfig::default()));
    let f = filter(&storage);
    let h = SequenceHash::from_u128(7);
    assert!(eval(&f, h).await, "first acquisition");
    // The block leaves the pipeline: the release is spawned but has not run yet.
    f.release(&[h]);
    // Meanwhile the lock disappears (expired and broken, say) and the filter takes it again.
    storage.delete(&lock_key(h)).await.unwrap();
    assert!(eval(&f, h).await, "second acquisition");
    // Now the first release runs.
    f.flush_releases().await;
    assert!(
        storage.exists(&lock_key(h)).await.unwrap(),
        "the delayed release deleted the newer acquisition's lock"
    );
    assert_eq!(f.held_locks(), vec![h]);
    // The newer acquisition's own release does delete it.
    f.release(&[h]);
    f.flush_releases().await;
    assert!(!storage.exists(&lock_key(h)).await.unwrap());
}

/// A lock object larger than any lock record is refused unread: held, never broken.
#[tokio::test(flavor = "current_thread")]
async fn fail_closed_oversized_lock_is_not_read() {
    let storage = Arc::new(ObjectStorage::in_memory(ObjectConfig::default()));
    let h = SequenceHash::from_u128(9);
    assert!(
        storage
            .try_create(&lock_key(h), bytes::Bytes::from(vec![b' '; 1 << 20]))
            .await
            .unwrap()
    );
    let got = storage.get_small(&lock_key(h), 4096).await;
    assert!(
        matches!(got, Err(kvbm_physical::PhysicalError::TooLarge { size, .. }) if size == 1 << 20),
        "{got:?}"
    );
    let f = filter(&storage);
    assert!(!eval(&f, h).await, "an oversized lock is held");
    assert!(f.held_locks().is_empty());
}

/// The runtime seam: from a thread with no tokio runtime, `spawn` is refused with `NoRuntime`
/// (no panic) and `spawn_on` a caller-owned runtime starts the object pipeline.
#[test]
fn object_pipeline_spawns_from_a_synchronous_caller() {
    let storage = Arc::new(ObjectStorage::in_memory(ObjectConfig::default()));
    let refused =
        super::ObjectPipelineBuilder::new(storage.clone()).spawn(crate::executor::NoopExecutor);
    assert!(matches!(refused, Err(crate::OffloadError::NoRuntime)));
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let pipeline = super::ObjectPipelineBuilder::new(storage)
        .spawn_on(rt.handle(), crate::executor::NoopExecutor)
        .expect("spawned on the caller's runtime");
    rt.block_on(pipeline.shutdown_and_wait());
}
