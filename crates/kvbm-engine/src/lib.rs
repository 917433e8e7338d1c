#![doc = include_str!("../README.md")]

pub mod config;
pub mod dataplane;
mod error;
pub mod leader;
pub mod mover;
pub mod pubsub;
pub mod runtime;
pub mod worker;

pub use config::{ConfigBuilder, KvbmConfig};
pub use error::{EngineError, Result};
pub use leader::{BlockHolder, InstanceLeader, MatchedPrefix};
pub use runtime::{EventSource, KvbmRuntime, KvbmRuntimeBuilder, Role, RuntimeHandle};
