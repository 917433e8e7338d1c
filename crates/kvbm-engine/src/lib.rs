#![doc = include_str!("../README.md")]

#[cfg(all(feature = "collectives", not(feature = "cuda")))]
compile_error!(
    "kvbm-engine: the `collectives` feature needs the `cuda` feature (and is a documented stub; \
     see the crate docs)"
);

pub mod address;
#[cfg(feature = "collectives")]
pub mod collectives;
pub mod config;
pub mod dataplane;
mod error;
#[cfg(feature = "nats")]
pub mod instance;
pub mod layout;
pub mod leader;
pub mod mover;
pub mod pubsub;
pub mod runtime;
pub mod scheduler;
pub mod stack;
#[cfg(feature = "testing")]
pub mod testing;
pub mod transport;
pub mod worker;

pub use config::{ConfigBuilder, KvbmConfig};
pub use error::{EngineError, Result};
pub use layout::LogicalLayoutHandle;
pub use leader::{BlockHolder, InstanceLeader, MatchedPrefix};
pub use runtime::{EventSource, KvbmRuntime, KvbmRuntimeBuilder, Role, RuntimeHandle};
