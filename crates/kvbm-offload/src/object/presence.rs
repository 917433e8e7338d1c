//! Presence checks against the object tier: is *this* block stored there?
//!
//! [`S3PresenceChecker`] reads each block object's header
//! ([`ObjectStorage::probe`](kvbm_physical::ObjectStorage::probe)); a foreign object (another
//! key's, namespace's, rank's or geometry's, or a corrupt header) counts as absent, so the block
//! is offloaded again and overwrites it. [`EveryChecker`] combines checkers (one per
//! tensor-parallel rank): present only where all of them agree. [`ObjectPresenceFilter`] turns
//! any checker into a policy that passes absent blocks.

use std::sync::Arc;

use futures::StreamExt;
use kvbm_logical::{BlockDigest, SequenceHash};
use kvbm_physical::{ObjectPresence, ObjectStorage, StoredIdentity};

use super::CHECK_CONCURRENCY;
use super::keys::{digest_named, identity_of, object_key};
use crate::error::PolicyError;
use crate::policy::{
    BoxFuture, EvalContext, OffloadPolicy, PolicyBatchFuture, PolicyFuture, async_batch_result,
    async_result,
};

/// What a presence check by name found of one block.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StoredBlock {
    /// Nothing there, or an object that is not this block (foreign, corrupt header).
    Absent,
    /// An object whose header names this block, with its digest (`None`: the identity is the
    /// sequence hash): what a reader that knows the block only by name registers it with.
    Present(Option<BlockDigest>),
}

/// Async presence checker for object storage or other external destinations.
pub trait PresenceChecker: Send + Sync + 'static {
    /// Whether each block (its sequence hash and, for BLAKE3 sequences, its digest: the
    /// identity its object must carry) is present, in order.
    fn has_blocks(
        &self,
        blocks: Vec<(SequenceHash, Option<BlockDigest>)>,
    ) -> BoxFuture<Result<Vec<bool>, PolicyError>>;

    /// For blocks known only by name: whether each is present and the digest its stored copy
    /// records ([`digest_named`]), in order. The default asks
    /// [`has_blocks`](Self::has_blocks) with no digest (blocks without one).
    fn stored_blocks(
        &self,
        hashes: Vec<SequenceHash>,
    ) -> BoxFuture<Result<Vec<StoredBlock>, PolicyError>> {
        let asked = self.has_blocks(hashes.into_iter().map(|h| (h, None)).collect());
        Box::pin(async move {
            Ok(asked
                .await?
                .into_iter()
                .map(|p| {
                    if p {
                        StoredBlock::Present(None)
                    } else {
                        StoredBlock::Absent
                    }
                })
                .collect())
        })
    }
}

/// What the object at `h`'s key says of the block `h` (see [`StoredBlock`]): its header read
/// and bound to the key, its identity checked to name `h` ([`digest_named`]).
pub(crate) async fn stored_block(
    storage: &ObjectStorage,
    h: SequenceHash,
) -> Result<StoredBlock, PolicyError> {
    let key = object_key(h);
    Ok(match storage.stored_identity(&key).await? {
        StoredIdentity::Bound(identity) => match digest_named(h, &identity) {
            Some(digest) => StoredBlock::Present(digest),
            None => {
                tracing::warn!(key = %storage.path(&key), identity = %identity.to_hex(), "an object whose header names another block counts as absent");
                StoredBlock::Absent
            }
        },
        StoredIdentity::Foreign(why) => {
            tracing::warn!(key = %storage.path(&key), error = %why, "foreign object counts as absent; it will be rewritten");
            StoredBlock::Absent
        }
        _ => StoredBlock::Absent,
    })
}

/// Whether the block `h` (with `digest`, if any) is stored in `storage`: its header verified
/// against [`identity_of`], a foreign object (another block's, e.g. one whose 64-bit hash
/// collides) absent.
pub(crate) async fn block_present(
    storage: &ObjectStorage,
    h: SequenceHash,
    digest: Option<BlockDigest>,
) -> Result<bool, PolicyError> {
    let key = object_key(h);
    match storage.probe(&key, &identity_of(h, digest)).await? {
        ObjectPresence::Present => Ok(true),
        ObjectPresence::Absent => Ok(false),
        ObjectPresence::Foreign(why) => {
            tracing::warn!(key = %storage.path(&key), error = %why, "foreign object counts as absent; it will be rewritten");
            Ok(false)
        }
        _ => Ok(false),
    }
}

/// S3/Object storage presence checker: one header read per block object.
#[derive(Debug, Clone)]
pub struct S3PresenceChecker {
    storage: Arc<ObjectStorage>,
}

impl S3PresenceChecker {
    /// A checker over `storage` (its namespace prefixes every key).
    pub fn new(storage: Arc<ObjectStorage>) -> Self {
        Self { storage }
    }
}

impl PresenceChecker for S3PresenceChecker {
    fn has_blocks(
        &self,
        blocks: Vec<(SequenceHash, Option<BlockDigest>)>,
    ) -> BoxFuture<Result<Vec<bool>, PolicyError>> {
        let storage = self.storage.clone();
        Box::pin(async move {
            futures::stream::iter(blocks)
                .map(|(h, d)| {
                    let storage = storage.clone();
                    async move { block_present(&storage, h, d).await }
                })
                .buffered(CHECK_CONCURRENCY)
                .collect::<Vec<_>>()
                .await
                .into_iter()
                .collect()
        })
    }

    fn stored_blocks(
        &self,
        hashes: Vec<SequenceHash>,
    ) -> BoxFuture<Result<Vec<StoredBlock>, PolicyError>> {
        let storage = self.storage.clone();
        Box::pin(async move {
            futures::stream::iter(hashes)
                .map(|h| {
                    let storage = storage.clone();
                    async move { stored_block(&storage, h).await }
                })
                .buffered(CHECK_CONCURRENCY)
                .collect::<Vec<_>>()
                .await
                .into_iter()
                .collect()
        })
    }
}

/// Presence across several checkers: a block is present only where **every** one finds it,
/// with the same digest. Tensor-parallel ranks keep their slices of a block in their own
/// directories of one bucket (`tp{world}.r{rank}/`), so a block can be read back only when
/// every rank's slice is there: one checker per rank, combined with this. A block some rank
/// lacks, or whose slices record different identities, is absent (offloaded again, never
/// served half).
pub struct EveryChecker {
    checkers: Vec<Arc<dyn PresenceChecker>>,
}

impl std::fmt::Debug for EveryChecker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EveryChecker")
            .field("checkers", &self.checkers.len())
            .finish()
    }
}

impl EveryChecker {
    /// Present where every one of `checkers` finds the block. With none, nothing is present.
    pub fn new(checkers: Vec<Arc<dyn PresenceChecker>>) -> Self {
        Self { checkers }
    }
}

impl PresenceChecker for EveryChecker {
    fn has_blocks(
        &self,
        blocks: Vec<(SequenceHash, Option<BlockDigest>)>,
    ) -> BoxFuture<Result<Vec<bool>, PolicyError>> {
        let n = blocks.len();
        let asked: Vec<_> = self
            .checkers
            .iter()
            .map(|c| c.has_blocks(blocks.clone()))
            .collect();
        Box::pin(async move {
            let mut all = vec![!asked.is_empty(); n];
            for answer in futures::future::join_all(asked).await {
                for (a, p) in all.iter_mut().zip(answer?) {
                    *a &= p;
                }
            }
            Ok(all)
        })
    }

    fn stored_blocks(
        &self,
        hashes: Vec<SequenceHash>,
    ) -> BoxFuture<Result<Vec<StoredBlock>, PolicyError>> {
        let n = hashes.len();
        let asked: Vec<_> = self
            .checkers
            .iter()
            .map(|c| c.stored_blocks(hashes.clone()))
            .collect();
        Box::pin(async move {
            let mut answers = futures::future::join_all(asked).await.into_iter();
            let Some(first) = answers.next() else {
                return Ok(vec![StoredBlock::Absent; n]);
            };
            let mut all = first?;
            for answer in answers {
                for (a, s) in all.iter_mut().zip(answer?) {
                    if *a != s {
                        *a = StoredBlock::Absent;
                    }
                }
            }
            Ok(all)
        })
    }
}

/// G2→G4 filter: async presence check for object storage destinations.
pub struct ObjectPresenceFilter<C: PresenceChecker> {
    checker: Arc<C>,
}

impl<C: PresenceChecker> std::fmt::Debug for ObjectPresenceFilter<C> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ObjectPresenceFilter")
    }
}

impl<C: PresenceChecker> ObjectPresenceFilter<C> {
    /// A filter passing blocks `checker` reports absent.
    pub fn new(checker: Arc<C>) -> Self {
        Self { checker }
    }
}

impl<C: PresenceChecker> OffloadPolicy for ObjectPresenceFilter<C> {
    fn name(&self) -> &'static str {
        "object_presence"
    }
    fn evaluate(&self, ctx: &EvalContext) -> PolicyFuture {
        let fut = self
            .checker
            .has_blocks(vec![(ctx.sequence_hash, ctx.digest)]);
        async_result(async move { Ok(!fut.await?[0]) })
    }
    fn evaluate_batch(&self, ctxs: &[EvalContext]) -> PolicyBatchFuture {
        let fut = self
            .checker
            .has_blocks(ctxs.iter().map(|c| (c.sequence_hash, c.digest)).collect());
        async_batch_result(async move { Ok(fut.await?.into_iter().map(|p| !p).collect()) })
    }
}
