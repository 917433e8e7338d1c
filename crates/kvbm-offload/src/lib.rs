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
pub mod cancel;
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
pub use cancel::CancellationToken;
pub use config::{ObjectPipelineConfig, PipelineConfig};
pub use error::{BlockFailure, BlockFailureKind, OffloadError, PolicyError};
pub use executor::MoveExecutor;
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
