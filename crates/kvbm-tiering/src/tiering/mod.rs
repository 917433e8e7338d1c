//! Multi-tier management: the tiering manager, the secondary-tier seam, backpressure, metrics
//! and the in-memory tier.

pub mod async_lookup;
pub mod backpressure;
pub mod base;
pub mod manager;
pub mod memory;
pub(crate) mod metrics;
pub mod physical;

pub use async_lookup::AsyncLookup;
pub use backpressure::{Backpressure, BackpressureDetector, DropPolicy, EmaConfig};
pub use base::{
    DeferredRelease, JobId, JobResult, ParentManager, ReleaseFlag, SecondaryTierManager, TierJob,
};
pub use manager::{TieringConfig, TieringOffloadingManager, UpstreamFixes};
pub use memory::InMemoryTier;
pub use physical::{
    DiskTier, ObjectProbe, ObjectTier, PhysicalTier, TIER_BLOCK_SIZE, digest_hash, key_digest,
    key_hash, key_identity,
};
