#![doc = include_str!("../README.md")]

// The root names what other crates use: tiers and moves (`BoundTier`, `BlockMover`,
// `ExternalMover`, `MoveSource`, `MoveOutcome`, `ArrivalCheck`), lanes (`Pipeline`,
// `PipelineBuilder`, `ObjectPipeline`, their configs, `OffloadHandle`, `OffloadResult`),
// executors, policies and failures. Everything else public is named by its module
// (`handle::OffloadStatus`, `settlement::SettlementToken`, `source::Precondition`, ...); stage
// internals (queues, the sweeper, outstanding guards, containers, `upgrade_batch`) stay
// crate-private.
pub mod batch;
mod bound;
pub mod checked;
pub mod config;
pub mod engine;
mod error;
pub mod executor;
pub mod handle;
pub mod journal;
pub mod metrics;
pub mod mover;
pub mod object;
pub mod pending;
pub mod pipeline;
pub mod policy;
mod queue;
pub mod settlement;
pub mod source;
mod sweep;

pub use batch::{BatchOutcome, ResolvedBatch};
pub use bound::BoundTier;
pub use checked::{BadCopies, CheckedDisk};
pub use config::{ObjectPipelineConfig, PipelineConfig};
pub use error::{BlockFailure, BlockFailureKind, OffloadError, PolicyError};
pub use executor::MoveExecutor;
/// The cancellation of an offload (its token, confirmation and queue), part of the handle.
pub use handle::cancel;
pub use handle::cancel::CancellationToken;
pub use handle::{OffloadHandle, OffloadResult};
pub use mover::{
    ArrivalCheck, BlockMoveExecutor, BlockMover, ExternalMover, MoveOutcome, MoveSource,
    ObjectMoveExecutor,
};
pub use object::{
    EveryChecker, ObjectPipeline, ObjectPipelineBuilder, PresenceChecker, S3PresenceChecker,
    StoredBlock, block_identity, digest_named, identity_of, object_key,
};
pub use pipeline::{CompletionSink, EnqueueError, Pipeline, PipelineBuilder};
pub use policy::{
    AllOfPolicy, BoxFuture, OffloadPolicy, PresenceFilter, create_policy_from_config,
};
pub use source::ExternalBlock;

// The seed's names (`shared/seeds/000_*`) for what the glossary now calls an offload
// (`docs/architecture.md`, "Offload"), importable where the seed put them. Each is the type
// it names now; new code uses the new name.

/// The seed's `TransferHandle`: now [`OffloadHandle`].
pub type TransferHandle = OffloadHandle;
/// The seed's `TransferId`: now [`OffloadId`](handle::OffloadId).
pub type TransferId = handle::OffloadId;
/// The seed's `TransferStatus`: now [`OffloadStatus`](handle::OffloadStatus).
pub type TransferStatus = handle::OffloadStatus;
/// The seed's `TransferResult`: now [`OffloadResult`].
pub type TransferResult = OffloadResult;
/// The seed's `TransferProgressCounts`: now
/// [`OffloadProgressCounts`](handle::OffloadProgressCounts).
pub type TransferProgressCounts = handle::OffloadProgressCounts;
/// The seed's `TransferProgressCursor`: now
/// [`OffloadProgressCursor`](handle::OffloadProgressCursor).
pub type TransferProgressCursor = handle::OffloadProgressCursor;
/// The seed's `TransferProgressDelta`: now
/// [`OffloadProgressDelta`](handle::OffloadProgressDelta).
pub type TransferProgressDelta = handle::OffloadProgressDelta;
/// The seed's `TransferExecutor` (a pipeline's last stage): now the [`MoveExecutor`] trait.
pub use executor::MoveExecutor as TransferExecutor;
