#![doc = include_str!("../README.md")]

pub mod config;
mod error;

pub use config::{ConfigBuilder, KvbmConfig};
pub use error::{EngineError, Result};
