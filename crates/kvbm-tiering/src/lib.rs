#![doc = include_str!("../README.md")]

pub mod connector;
pub mod cpu;
pub mod direct;
pub mod error;
pub mod key;
pub mod manager;
pub mod replay;
pub mod spec;
pub mod stats;
#[cfg(feature = "testing")]
pub mod testing;
pub mod types;
pub mod worker;

pub use cpu::{
    CachePolicyKind, CpuManagerConfig, CpuOffloadingManager, CpuPrimaryTier, FinishedAccess,
    SlotState, StorePlan,
};
pub use direct::{
    DevicePointers, DirectDisk, DirectDiskConfig, DirectDiskManager, DirectDiskWorker,
};
pub use error::{Result, TieringError};
pub use key::{
    InvalidKey, OffloadKey, get_offload_block_hash, get_offload_group_idx, make_offload_key,
};
pub use manager::OffloadingManager;
pub use spec::{OffloadingSpec, OffloadingSpecConfig};
pub use stats::OffloadingConnectorStats;
pub use types::*;
pub use worker::{ChunkLayout, OffloadingWorker, PhysicalOffloadingWorker, WorkerLayoutBuilder};
pub mod tiering;

pub use tiering::{
    AsyncLookup, BackpressureDetector, DeferredRelease, DiskTier, DropPolicy, EmaConfig,
    InMemoryTier, JobId, JobResult, ObjectProbe, ObjectTier, ParentManager, PhysicalTier,
    ReleaseFlag, SecondaryTierManager, TierJob, TieringConfig, TieringOffloadingManager,
    UpstreamFixes,
};
