#![doc = include_str!("../README.md")]
//!
//! # Modules
//!
//! * [`storage`]: where bytes live per tier (device, host, disk, objects);
//! * [`io`]: the disk I/O engine seam (io_uring, psync);
//! * [`layout`]: block layouts and the canonical tensor-parallel mapping;
//! * [`transfer`]: the transfer manager;
//! * [`checksum`]: the header and checksum stored with every block leaving the process;
//! * [`cuda`] and [`nixl`]: optional accelerators, probed before use.

pub mod checksum;
pub mod cuda;
mod error;
pub mod io;
pub mod layout;
pub mod nixl;
pub mod storage;
pub mod transfer;

pub use error::{PhysicalError, Result};
pub use io::IoEngine;
pub use layout::canonical::{CanonicalPageMapping, CopyRun};
pub use layout::{
    Backing, BlockDim, BlockLayout, LayoutBuilder, LayoutConfig, LayoutKind, PhysicalLayout, Region,
};
pub use storage::{
    DeviceMemory, DiskCapabilities, DiskConfig, DiskStorage, HostStandInDevice, HostStorage,
    IoEngineKind, ObjectConfig, ObjectKey, ObjectPutMode, ObjectStorage, PinPolicy, S3Config,
    Storage, StorageKind,
};
pub use transfer::{
    BlockId, BouncePoolStats, LayoutHandle, TransferCompletion, TransferConfig, TransferManager,
    TransferOptions, TransferOutcome,
};
