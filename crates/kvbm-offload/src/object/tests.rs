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

/// A checker answering from a table (hash → stored digest): presence logic only.
struct Table(std::collections::HashMap<SequenceHash, Option<kvbm_logical::BlockDigest>>);

impl super::PresenceChecker for Table {
    fn has_blocks(
        &self,
        blocks: Vec<(SequenceHash, Option<kvbm_logical::BlockDigest>)>,
    ) -> crate::policy::BoxFuture<Result<Vec<bool>, crate::error::PolicyError>> {
        let out = blocks
            .iter()
            .map(|(h, d)| self.0.get(h).is_some_and(|s| d.is_none() || s == d))
            .collect();
        Box::pin(async move { Ok(out) })
    }

    fn stored_blocks(
        &self,
        hashes: Vec<SequenceHash>,
    ) -> crate::policy::BoxFuture<Result<Vec<super::StoredBlock>, crate::error::PolicyError>> {
        let out = hashes
            .iter()
            .map(|h| match self.0.get(h) {
                Some(d) => super::StoredBlock::Present(*d),
                None => super::StoredBlock::Absent,
            })
            .collect();
        Box::pin(async move { Ok(out) })
    }
}

#[tokio::test]
async fn every_checker_finds_a_block_only_where_every_rank_holds_it_alike() {
    use super::{EveryChecker, PresenceChecker, StoredBlock};
    let h = |i: u128| SequenceHash::from_u128(i);
    let (d1, d2) = (
        Some(kvbm_logical::BlockDigest([1; 32])),
        Some(kvbm_logical::BlockDigest([2; 32])),
    );
    // Block 1 on both ranks; 2 on rank 0 only; 3 on both with different identities; 4 on
    // both with one digest.
    let r0 = Table([(h(1), None), (h(2), None), (h(3), d1), (h(4), d2)].into());
    let r1 = Table([(h(1), None), (h(3), d2), (h(4), d2)].into());
    let every = EveryChecker::new(vec![Arc::new(r0), Arc::new(r1)]);
    let asked = vec![h(1), h(2), h(3), h(4), h(5)];
    assert_eq!(
        every.stored_blocks(asked.clone()).await.unwrap(),
        vec![
            StoredBlock::Present(None),
            StoredBlock::Absent,
            StoredBlock::Absent,
            StoredBlock::Present(d2),
            StoredBlock::Absent,
        ]
    );
    let by_digest: Vec<_> = asked.iter().map(|x| (*x, None)).collect();
    assert_eq!(
        every.has_blocks(by_digest).await.unwrap(),
        vec![true, false, true, true, false],
        "by name alone, block 3 is on both ranks"
    );
    assert_eq!(
        every.has_blocks(vec![(h(3), d1)]).await.unwrap(),
        vec![false],
        "rank 1's block 3 has another identity"
    );
    // No checker: nothing is present.
    let none = EveryChecker::new(Vec::new());
    assert_eq!(
        none.has_blocks(vec![(h(1), None)]).await.unwrap(),
        vec![false]
    );
    assert_eq!(
        none.stored_blocks(vec![h(1)]).await.unwrap(),
        vec![StoredBlock::Absent]
    );
}
