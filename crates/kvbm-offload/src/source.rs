//! What enters the pipeline: source blocks and the precondition they wait on.

use std::future::Future;
use std::pin::Pin;

use kvbm_logical::{BlockDigest, BlockId, ImmutableBlock, SequenceHash, Tier, WeakBlock};
use tokio::sync::oneshot;

/// External block reference with sequence hash for registration.
///
/// For blocks whose lifetime the caller manages outside `kvbm-logical` (e.g. G1 slots owned by
/// the inference engine): the pipeline only reads `block_id` and registers `sequence_hash` in
/// the destination. The caller must keep the slot intact until the transfer settles.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ExternalBlock {
    /// Slot in the source tier.
    pub block_id: BlockId,
    /// The content's sequence hash.
    pub sequence_hash: SequenceHash,
    /// The content's 256-bit digest, for BLAKE3 sequences (registered with the destination
    /// and bound as the identity of copies that leave the process).
    pub digest: Option<BlockDigest>,
}

impl ExternalBlock {
    /// A reference to slot `block_id` holding `sequence_hash` (no digest).
    pub fn new(block_id: BlockId, sequence_hash: SequenceHash) -> Self {
        Self {
            block_id,
            sequence_hash,
            digest: None,
        }
    }

    /// The same reference, with the content's digest.
    pub fn with_digest(mut self, digest: Option<BlockDigest>) -> Self {
        self.digest = digest;
        self
    }
}

/// Represents a single block source for offloading.
pub enum SourceBlock<T: Tier> {
    /// A slot the caller manages (no reference is held).
    External(ExternalBlock),
    /// A strong reference: the block cannot be evicted while queued.
    Strong(ImmutableBlock<T>),
    /// A weak reference: the block may be evicted while queued; it is upgraded at the
    /// commitment point and reported as failed ([`Evicted`](crate::BlockFailureKind::Evicted))
    /// if it is gone by then.
    Weak(WeakBlock<T>),
}

impl<T: Tier> SourceBlock<T> {
    /// The content's sequence hash.
    #[inline]
    pub fn sequence_hash(&self) -> SequenceHash {
        match self {
            Self::External(e) => e.sequence_hash,
            Self::Strong(b) => b.sequence_hash(),
            Self::Weak(w) => w.sequence_hash(),
        }
    }

    /// The content's 256-bit digest, if it has one.
    #[inline]
    pub fn digest(&self) -> Option<BlockDigest> {
        match self {
            Self::External(e) => e.digest,
            Self::Strong(b) => b.digest(),
            Self::Weak(w) => w.digest(),
        }
    }

    /// The source slot id.
    #[inline]
    pub fn block_id(&self) -> BlockId {
        match self {
            Self::External(e) => e.block_id,
            Self::Strong(b) => b.block_id(),
            Self::Weak(w) => w.block_id(),
        }
    }
}

impl<T: Tier> std::fmt::Debug for SourceBlock<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let kind = match self {
            Self::External(_) => "External",
            Self::Strong(_) => "Strong",
            Self::Weak(_) => "Weak",
        };
        f.debug_struct(kind)
            .field("block_id", &self.block_id())
            .field("sequence_hash", &self.sequence_hash())
            .finish()
    }
}

impl<T: Tier> From<ExternalBlock> for SourceBlock<T> {
    fn from(b: ExternalBlock) -> Self {
        Self::External(b)
    }
}
impl<T: Tier> From<ImmutableBlock<T>> for SourceBlock<T> {
    fn from(b: ImmutableBlock<T>) -> Self {
        Self::Strong(b)
    }
}
impl<T: Tier> From<WeakBlock<T>> for SourceBlock<T> {
    fn from(b: WeakBlock<T>) -> Self {
        Self::Weak(b)
    }
}

/// Collection of source blocks for batch operations.
#[derive(Debug)]
pub enum SourceBlocks<T: Tier> {
    /// Caller-managed slots.
    External(Vec<ExternalBlock>),
    /// Strong references.
    Strong(Vec<ImmutableBlock<T>>),
    /// Weak references.
    Weak(Vec<WeakBlock<T>>),
    /// A mix.
    Mixed(Vec<SourceBlock<T>>),
}

impl<T: Tier> SourceBlocks<T> {
    /// Number of blocks.
    pub fn len(&self) -> usize {
        match self {
            Self::External(v) => v.len(),
            Self::Strong(v) => v.len(),
            Self::Weak(v) => v.len(),
            Self::Mixed(v) => v.len(),
        }
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Flattens into individual sources.
    pub fn into_vec(self) -> Vec<SourceBlock<T>> {
        match self {
            Self::External(v) => v.into_iter().map(SourceBlock::External).collect(),
            Self::Strong(v) => v.into_iter().map(SourceBlock::Strong).collect(),
            Self::Weak(v) => v.into_iter().map(SourceBlock::Weak).collect(),
            Self::Mixed(v) => v,
        }
    }
}

impl<T: Tier> From<Vec<ExternalBlock>> for SourceBlocks<T> {
    fn from(v: Vec<ExternalBlock>) -> Self {
        Self::External(v)
    }
}
impl<T: Tier> From<Vec<ImmutableBlock<T>>> for SourceBlocks<T> {
    fn from(v: Vec<ImmutableBlock<T>>) -> Self {
        Self::Strong(v)
    }
}
impl<T: Tier> From<Vec<WeakBlock<T>>> for SourceBlocks<T> {
    fn from(v: Vec<WeakBlock<T>>) -> Self {
        Self::Weak(v)
    }
}
impl<T: Tier> From<Vec<SourceBlock<T>>> for SourceBlocks<T> {
    fn from(v: Vec<SourceBlock<T>>) -> Self {
        Self::Mixed(v)
    }
}

/// The precondition event a container waits on before it may be batched (typically "the
/// forward pass that wrote these blocks has finished").
///
/// Resolves to `Ok(())` when the blocks may be read, or `Err(`[`PreconditionError`]`)`: the
/// blocks are then reported failed
/// ([`PreconditionFailed`](crate::BlockFailureKind::PreconditionFailed)).
pub struct Precondition {
    fut: Pin<Box<dyn Future<Output = Result<(), PreconditionError>> + Send + 'static>>,
}

/// Why a [`Precondition`] failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum PreconditionError {
    /// The [`PreconditionTrigger`] was dropped without completing.
    #[error("precondition trigger dropped")]
    TriggerDropped,
    /// The event failed; the producer said why (e.g. the forward pass failed).
    #[error("{0}")]
    Failed(String),
}

impl From<String> for PreconditionError {
    fn from(reason: String) -> Self {
        Self::Failed(reason)
    }
}

impl From<&str> for PreconditionError {
    fn from(reason: &str) -> Self {
        Self::Failed(reason.to_string())
    }
}

impl std::fmt::Debug for Precondition {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Precondition")
    }
}

impl Precondition {
    /// From any future whose error converts into a [`PreconditionError`] (a `String` reason
    /// does).
    pub fn new<E: Into<PreconditionError>>(
        fut: impl Future<Output = Result<(), E>> + Send + 'static,
    ) -> Self {
        Self {
            fut: Box::pin(async move { fut.await.map_err(Into::into) }),
        }
    }

    /// A precondition and the trigger that completes it. Dropping the trigger without
    /// completing it fails the precondition.
    pub fn pair() -> (PreconditionTrigger, Precondition) {
        let (tx, rx) = oneshot::channel();
        (
            PreconditionTrigger { tx },
            Precondition::new(async move {
                match rx.await {
                    Ok(r) => r,
                    Err(_) => Err(PreconditionError::TriggerDropped),
                }
            }),
        )
    }

    /// Waits for the event.
    pub async fn wait(self) -> Result<(), PreconditionError> {
        self.fut.await
    }
}

/// The forward pass's CUDA event as a batch's precondition (feature `cuda`): resolved by
/// kvbm-physical's completion thread when the event completed, failed with the driver's error
/// when it failed (the batch's blocks are then reported `PreconditionFailed`, never read).
#[cfg(feature = "cuda")]
impl From<kvbm_physical::cuda::CudaEventPrecondition> for Precondition {
    fn from(event: kvbm_physical::cuda::CudaEventPrecondition) -> Self {
        Precondition::new(async move { event.await.map_err(|e| e.to_string()) })
    }
}

/// Completes a [`Precondition`] made by [`Precondition::pair`].
#[derive(Debug)]
pub struct PreconditionTrigger {
    tx: oneshot::Sender<Result<(), PreconditionError>>,
}

impl PreconditionTrigger {
    /// Signals that the blocks may be read.
    pub fn complete(self) {
        let _ = self.tx.send(Ok(()));
    }

    /// Signals failure; the blocks will be reported failed with `reason`.
    pub fn fail(self, reason: impl Into<String>) {
        let _ = self.tx.send(Err(PreconditionError::Failed(reason.into())));
    }
}
