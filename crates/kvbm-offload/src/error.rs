//! Errors: why a block failed, why an operation was refused.
//!
//! A transfer failure keeps the [`PhysicalError`] it came from ([`BlockFailure::source`]) and
//! sorts it into a [`BlockFailureKind`] an upper layer acts on: drop the copy on a checksum
//! mismatch, treat the block as absent (clear presence, rewrite) on an identity mismatch or
//! not-found, retry on I/O.

use std::sync::Arc;

use kvbm_physical::{ErrorKind, PhysicalError};

/// Stable categories of a block failure.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum BlockFailureKind {
    /// A weak source block had been evicted when it was upgraded; nothing was transferred.
    Evicted,
    /// The precondition (forward pass) reported failure.
    PreconditionFailed,
    /// No destination block could be allocated.
    NoSpace,
    /// The transfer of this block's bytes failed for another reason (refused arguments,
    /// registration in the destination failed).
    Transfer,
    /// The transfer executor stopped (panicked or was aborted) with the block in flight.
    ExecutorAborted,
    /// The pipeline failed (a stage panicked) before the block was transferred.
    PipelineFailed,
    /// The bytes read are not the bytes stored (checksum mismatch, short read, corrupt
    /// header): drop that copy.
    ChecksumMismatch,
    /// The stored block is intact but another one (another identity, file instance, key,
    /// namespace, geometry or rank): treat it as absent and rewrite it.
    IdentityMismatch,
    /// Nothing is stored for the block: clear its presence.
    NotFound,
    /// An operating-system or object-store error: a retry may succeed.
    Io,
    /// The operation exceeded its time limit.
    Timeout,
    /// The operation was cancelled before it finished.
    Cancelled,
    /// The request was refused as a whole before anything moved (a worker without the tier,
    /// a request addressed to another rank, a peer that answered with a refusal): the copy is
    /// intact; a retry elsewhere may succeed.
    Refused,
}

impl BlockFailureKind {
    /// Snake-case name, e.g. `precondition_failed` (the `reason` label of
    /// [`BLOCKS_FAILED`](crate::metrics::BLOCKS_FAILED)).
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::Evicted => "evicted",
            Self::PreconditionFailed => "precondition_failed",
            Self::NoSpace => "no_space",
            Self::Transfer => "transfer",
            Self::ExecutorAborted => "executor_aborted",
            Self::PipelineFailed => "pipeline_failed",
            Self::ChecksumMismatch => "checksum_mismatch",
            Self::IdentityMismatch => "identity_mismatch",
            Self::NotFound => "not_found",
            Self::Io => "io",
            Self::Timeout => "timeout",
            Self::Cancelled => "cancelled",
            Self::Refused => "refused",
        }
    }

    /// Every kind, in a fixed order (see [`index`](Self::index)).
    pub const ALL: [Self; 13] = [
        Self::Evicted,
        Self::PreconditionFailed,
        Self::NoSpace,
        Self::Transfer,
        Self::ExecutorAborted,
        Self::PipelineFailed,
        Self::ChecksumMismatch,
        Self::IdentityMismatch,
        Self::NotFound,
        Self::Io,
        Self::Timeout,
        Self::Cancelled,
        Self::Refused,
    ];

    /// This kind's position in [`ALL`](Self::ALL) (a dense index for per-kind counters).
    pub const fn index(self) -> usize {
        self as usize
    }

    /// The kind named `name` ([`as_str`](Self::as_str)), if this build knows it: how a kind
    /// that crossed a wire is read back.
    pub fn from_name(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|k| k.as_str() == name)
    }

    /// Whether a failed read proves that the tier's copy must go: its bytes are damaged
    /// ([`ChecksumMismatch`](Self::ChecksumMismatch)), it is another block's
    /// ([`IdentityMismatch`](Self::IdentityMismatch)) or it is gone
    /// ([`NotFound`](Self::NotFound)). Every other kind (I/O, timeout, cancellation, a refusal…)
    /// says nothing about the copy, which is kept: a later read may succeed.
    pub const fn drops_copy(self) -> bool {
        matches!(
            self,
            Self::ChecksumMismatch | Self::IdentityMismatch | Self::NotFound
        )
    }

    /// The kind of a block whose transfer failed with `e`.
    pub fn of_physical(e: &PhysicalError) -> Self {
        match e.kind() {
            ErrorKind::Corrupt => Self::ChecksumMismatch,
            ErrorKind::IdentityMismatch => Self::IdentityMismatch,
            ErrorKind::NotFound => Self::NotFound,
            ErrorKind::Io => Self::Io,
            ErrorKind::Aborted => Self::ExecutorAborted,
            _ => Self::Transfer,
        }
    }
}

/// Why one block failed. Failed blocks are never registered in the destination.
///
/// Equality compares the kind and the message (the source error has no equality of its own).
#[derive(Debug, Clone, thiserror::Error)]
#[error("{kind:?}: {message}")]
pub struct BlockFailure {
    /// Category.
    pub kind: BlockFailureKind,
    /// Human-readable detail (e.g. the physical error's message).
    pub message: String,
    /// The bytes layer's error, when the failure came from a transfer (shared: a batch-wide
    /// error is one allocation for all its blocks).
    #[source]
    pub source: Option<Arc<PhysicalError>>,
}

impl PartialEq for BlockFailure {
    fn eq(&self, other: &Self) -> bool {
        self.kind == other.kind && self.message == other.message
    }
}
impl Eq for BlockFailure {}

impl BlockFailure {
    /// A failure of `kind` with `message`.
    pub fn new(kind: BlockFailureKind, message: impl Into<String>) -> Self {
        Self {
            kind,
            message: message.into(),
            source: None,
        }
    }

    /// A failure carrying the physical error `e`, its kind derived from it
    /// ([`BlockFailureKind::of_physical`]).
    pub fn physical(e: PhysicalError) -> Self {
        Self {
            kind: BlockFailureKind::of_physical(&e),
            message: e.to_string(),
            source: Some(Arc::new(e)),
        }
    }

    /// A failure sharing the physical error `e` (one error for many blocks).
    pub fn physical_shared(e: &Arc<PhysicalError>) -> Self {
        Self {
            kind: BlockFailureKind::of_physical(e),
            message: e.to_string(),
            source: Some(Arc::clone(e)),
        }
    }

    /// The physical error behind this failure, if any.
    pub fn physical_error(&self) -> Option<&PhysicalError> {
        self.source.as_deref()
    }
}

/// Errors returned by the offload API.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum OffloadError {
    /// The pipeline was shut down; nothing was enqueued.
    #[error("the offload pipeline is closed")]
    PipelineClosed,
    /// The pipeline failed (a stage panicked); nothing was enqueued.
    #[error(transparent)]
    PipelineFailed(#[from] crate::settlement::PipelineFailure),
    /// The engine has no pipeline of the requested kind for this lane.
    #[error("no {0} pipeline of this kind is configured")]
    NoPipeline(crate::settlement::PipelineLane),
    /// Two lanes of an engine are the same (source, destination) pair.
    #[error("lane {0} is configured twice")]
    DuplicateLane(crate::settlement::PipelineLane),
    /// A lane needs a tier (layout or block manager) that was not bound.
    #[error("tier {0:?} is not bound (layout or block manager missing)")]
    MissingTier(kvbm_logical::TierId),
    /// A required component was not given to a builder.
    #[error("missing {0}")]
    Missing(&'static str),
    /// No tokio runtime is current: start pipelines with an explicit runtime handle
    /// (`PipelineSpec::spawn_on`, `OffloadEngineBuilder::runtime`).
    #[error("no tokio runtime: pass a runtime handle")]
    NoRuntime,
    /// The input queue is full (`try_enqueue`; the blocks were handed back).
    #[error("the offload pipeline's input queue is full")]
    QueueFull,
    /// A pipeline was asked to carry a lane other than its (source, destination) pair.
    #[error("lane {requested} requested for a {pipeline} pipeline")]
    LaneMismatch {
        /// The lane named.
        requested: crate::settlement::PipelineLane,
        /// The pipeline's own pair.
        pipeline: crate::settlement::PipelineLane,
    },
    /// `enqueue_into` was given a different number of sources and destinations.
    #[error("{sources} sources but {destinations} destinations")]
    Mismatched {
        /// Sources given.
        sources: usize,
        /// Destinations given.
        destinations: usize,
    },
    /// A configuration value is invalid.
    #[error("invalid configuration: {0}")]
    InvalidConfig(String),
    /// A tier's block manager and its layout disagree on the number of blocks, so their ids
    /// would not be one space ([`BoundTier::new`](crate::BoundTier::new)).
    #[error(
        "tier {tier:?}: the block manager has {manager_blocks} blocks but the layout has {layout_blocks} slots"
    )]
    TierSizeMismatch {
        /// The tier.
        tier: kvbm_logical::TierId,
        /// Blocks in the manager.
        manager_blocks: usize,
        /// Slots in the layout.
        layout_blocks: usize,
    },
    /// A layout or object store could not be set up.
    #[error("setup failed: {0}")]
    Setup(String),
}

/// Errors from policy evaluation. A block whose evaluation errs or times out is filtered.
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum PolicyError {
    /// Evaluation exceeded `policy_timeout`.
    #[error("policy evaluation timed out")]
    Timeout,
    /// The backing service (e.g. S3) failed.
    #[error("policy backend error: {0}")]
    Backend(#[source] PhysicalError),
    /// A policy answered with the wrong number of verdicts.
    #[error("policy {policy} returned {got} verdicts for {expected} blocks")]
    Verdicts {
        /// The policy's name.
        policy: &'static str,
        /// Blocks asked about.
        expected: usize,
        /// Verdicts returned.
        got: usize,
    },
}

impl PartialEq for PolicyError {
    /// Same variant and, for backends, the same message.
    fn eq(&self, other: &Self) -> bool {
        match (self, other) {
            (Self::Timeout, Self::Timeout) => true,
            (
                Self::Verdicts {
                    policy: p,
                    expected: e,
                    got: g,
                },
                Self::Verdicts {
                    policy: q,
                    expected: f,
                    got: h,
                },
            ) => p == q && e == f && g == h,
            (Self::Backend(a), Self::Backend(b)) => a.to_string() == b.to_string(),
            _ => false,
        }
    }
}
impl Eq for PolicyError {}

impl From<PhysicalError> for PolicyError {
    fn from(e: PhysicalError) -> Self {
        Self::Backend(e)
    }
}

#[cfg(test)]
mod tests {
    use super::BlockFailureKind;

    #[test]
    fn every_kind_has_its_index_and_reads_back_by_name() {
        for (i, k) in BlockFailureKind::ALL.into_iter().enumerate() {
            assert_eq!(k.index(), i, "{k:?}");
            assert_eq!(BlockFailureKind::from_name(k.as_str()), Some(k));
        }
        assert_eq!(BlockFailureKind::from_name("no_such_kind"), None);
    }

    #[test]
    fn only_proof_of_a_bad_copy_drops_it() {
        let dropped: Vec<_> = BlockFailureKind::ALL
            .into_iter()
            .filter(|k| k.drops_copy())
            .collect();
        assert_eq!(
            dropped,
            [
                BlockFailureKind::ChecksumMismatch,
                BlockFailureKind::IdentityMismatch,
                BlockFailureKind::NotFound
            ]
        );
    }
}
