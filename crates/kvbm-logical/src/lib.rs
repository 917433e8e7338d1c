#![doc = include_str!("../README.md")]

mod blocks;
pub mod config;
mod error;
pub mod events;
pub mod eviction;
pub mod hash;
mod manager;
pub mod metrics;
pub mod registry;
pub mod sim;
mod store;
mod sync;
mod tier;

/// Index of a slot within one tier's manager.
pub type BlockId = usize;

pub use blocks::{CompleteBlock, ImmutableBlock, MutableBlock, WeakBlock};
pub use config::{DuplicationPolicy, FreeSlotReuse, LogicalConfig};
pub use error::{BlockError, LogicalError};
pub use events::{BlockEvent, BlockEventKind, EventBatchConfig, EventSink};
pub use eviction::{Admission, EvictionBackend, EvictionPolicy};
pub use hash::{
    BlockDigest, HashAlgorithm, Salt, SequenceHash, Token, TokenBlock, TokenBlockSequence,
};
pub use manager::{Allocation, BlockManager, BlockManagerBuilder};
pub use registry::{BlockRegistry, RegistryConfig};
pub use store::{PoolCounts, ProtectSet};
pub use tier::{G1, G2, G3, G4, Tier, TierId};

#[cfg(all(test, loom))]
mod loom_tests;
#[cfg(test)]
mod tests;
