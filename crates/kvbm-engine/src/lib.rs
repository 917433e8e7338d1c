#![doc = include_str!("../README.md")]

#[cfg(all(feature = "collectives", not(feature = "cuda")))]
compile_error!(
    "kvbm-engine: the `collectives` feature needs the `cuda` feature (and is a documented stub; \
     see the crate docs)"
);

// One instance's tiers, leader, sessions, manager and moves. The cluster plane (control, NATS,
// the data plane, pub/sub, presence, security, the binaries) is the kvbm-cluster crate above.
mod address;
#[cfg(feature = "collectives")]
pub mod collectives;
pub mod config;
pub mod cross_instance;
pub mod error;
pub mod leader;
pub mod manager;
pub mod metrics;
pub mod mover;
pub mod replay;
pub mod runtime;
pub mod stack;
pub mod worker;

#[cfg(feature = "testing")]
pub mod testing;

pub mod prelude;

pub use address::{InstanceId, RankAddress, WorkerAddress};
pub use config::{ConfigBuilder, KvbmConfig};
pub use error::{EngineError, Result};
pub use leader::{BlockHolder, InstanceLeader, MatchedPrefix};
pub use runtime::{
    EventSource, KvbmRuntime, KvbmRuntimeBuilder, MetricsEndpointStats, Role, RuntimeHandle,
};

/// The seed's `LogicalLayoutHandle` (`shared/seeds/003_*`: the layout ID every rank resolves to
/// its own layout): now the tier's [`TierId`](kvbm_logical::TierId), which
/// [`PhysicalWorker::resolve`](worker::PhysicalWorker::resolve) maps to the rank's
/// `LayoutHandle` (the glossary's "Layout of a tier on a rank").
///
/// ```
/// assert_eq!(kvbm_engine::LogicalLayoutHandle::G2, kvbm_logical::TierId::G2);
/// ```
pub type LogicalLayoutHandle = kvbm_logical::TierId;
