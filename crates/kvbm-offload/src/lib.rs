#![doc = include_str!("../README.md")]

// What a user composes is re-exported at the root; stage internals (queues, the sweeper,
// outstanding guards, containers and `upgrade_batch`) stay crate-private.
mod batch;
mod bound;
mod cancel;
pub mod config;
mod engine;
mod error;
mod executor;
mod handle;
pub mod metrics;
pub mod object;
mod pending;
mod pipeline;
mod policy;
mod queue;
mod settlement;
mod source;
mod sweep;
mod transfer;

pub use batch::{BatchOutcome, ResolvedBatch, ResolvedBlock};
pub use bound::BoundTier;
pub use cancel::{CancelConfirmation, CancelState, CancellationToken};
pub use config::{
    BatchConfig, DEFAULT_OBJECT_POLICY_TIMEOUT, MAX_CONCURRENT_TRANSFERS, ObjectPipelineConfig,
    PipelineConfig, PolicyConfig,
};
pub use engine::{LaneSpec, OffloadEngine, OffloadEngineBuilder};
pub use error::{BlockFailure, BlockFailureKind, OffloadError, PolicyError};
pub use executor::{ArcExecutor, DynTransferExecutor, NoopExecutor, TransferExecutor};
pub use handle::{
    TimingTrace, TransferHandle, TransferId, TransferProgressCounts, TransferProgressCursor,
    TransferProgressDelta, TransferResult, TransferStatus,
};
pub use object::{
    DEFAULT_LOCK_TTL, DEFAULT_LOCK_VERIFY_DELAY, ObjectLockPresenceFilter, ObjectPipeline,
    ObjectPipelineBuilder, ObjectPresenceFilter, PresenceChecker, S3PresenceChecker,
    block_identity, identity_of, lock_key, object_key,
};
pub use pending::{PendingGuard, PendingTracker};
pub use pipeline::{
    CompletionSink, EnqueueError, Pipeline, PipelineBuilder, PipelineSpec, Rejected,
};
pub use policy::{
    AllOfPolicy, AnyOfPolicy, BoxFuture, DEFAULT_MIN_LFU_COUNT, EvalContext, OffloadPolicy,
    PassAllPolicy, PolicyBatchFuture, PolicyFuture, PresenceAndLFUFilter, PresenceFilter,
    async_batch_result, async_result, create_policy_from_config, sync_batch_result, sync_result,
};
pub use settlement::{
    PipelineFailure, PipelineFailureKind, PipelineLane, PipelineStage, SettlementError,
    SettlementTarget, SettlementToken,
};
pub use source::{
    ExternalBlock, Precondition, PreconditionError, PreconditionTrigger, SourceBlock, SourceBlocks,
};
pub use transfer::{
    ArrivalCheck, BlockMover, BlockTransferExecutor, CallerAllocated, ExternalMover, MoveOutcome,
    MoveSource, ObjectTransferExecutor,
};
