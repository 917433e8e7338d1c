#![doc = include_str!("../README.md")]

pub mod batch;
pub mod cancel;
pub mod config;
pub mod engine;
pub mod error;
pub mod executor;
pub mod handle;
pub mod metrics;
pub mod object;
pub mod pending;
pub mod pipeline;
pub mod policy;
pub mod queue;
pub mod settlement;
pub mod source;
pub mod sweep;
pub mod transfer;

pub use batch::{
    BatchOutcome, OffloadBatch, OffloadContainer, ResolvedBatch, ResolvedBlock, upgrade_batch,
};
pub use cancel::{CancelConfirmation, CancelState, CancellationToken, OutstandingGuard};
pub use config::{
    BatchConfig, DEFAULT_OBJECT_POLICY_TIMEOUT, ObjectPipelineConfig, PipelineConfig, PolicyConfig,
};
pub use engine::{OffloadEngine, OffloadEngineBuilder};
pub use error::{BlockFailure, BlockFailureKind, OffloadError, PolicyError};
pub use executor::{ArcExecutor, DynTransferExecutor, NoopExecutor, TransferExecutor};
pub use handle::{
    TimingTrace, TransferHandle, TransferId, TransferProgressCounts, TransferProgressCursor,
    TransferProgressDelta, TransferResult, TransferStatus,
};
pub use object::{
    DEFAULT_LOCK_TTL, DEFAULT_LOCK_VERIFY_DELAY, ObjectLockPresenceFilter, ObjectPipeline,
    ObjectPipelineBuilder, ObjectPresenceFilter, PresenceChecker, S3PresenceChecker,
    block_identity, lock_key, object_key,
};
pub use pending::{PendingGuard, PendingTracker};
pub use pipeline::{CompletionSink, Pipeline, PipelineBuilder, PipelineSpec};
pub use policy::{
    AllOfPolicy, AnyOfPolicy, BoxFuture, EvalContext, OffloadPolicy, PassAllPolicy,
    PolicyBatchFuture, PolicyFuture, PresenceAndLFUFilter, PresenceFilter, async_batch_result,
    async_result, create_policy_from_config, sync_batch_result, sync_result,
};
pub use queue::{CancellableQueue, PushError, Sweep, SweepTarget};
pub use settlement::{
    PipelineFailure, PipelineFailureKind, PipelineLane, SettlementError, SettlementTarget,
    SettlementToken,
};
pub use source::{ExternalBlock, Precondition, PreconditionTrigger, SourceBlock, SourceBlocks};
pub use sweep::{CancelSweeper, SweepSignal};
pub use transfer::{BlockTransferExecutor, ObjectTransferExecutor};
