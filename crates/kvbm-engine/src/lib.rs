#![doc = include_str!("../README.md")]

pub mod config;
mod error;
pub mod runtime;

pub use config::{ConfigBuilder, KvbmConfig};
pub use error::{EngineError, Result};
pub use runtime::{EventSource, KvbmRuntime, KvbmRuntimeBuilder, Role, RuntimeHandle};
