#![doc = include_str!("../README.md")]
//!
//! # Modules
//!
//! * [`storage`]: where bytes live per tier (device, host, disk, objects);
//! * [`adopt`]: an engine's KV tensors (memory kvbm did not allocate) as a layout;
//! * [`io`]: the disk I/O engine seam (io_uring, psync);
//! * [`layout`]: block layouts and the canonical tensor-parallel mapping;
//! * [`transfer`]: the transfer manager;
//! * [`checksum`]: the header and checksum stored with every block leaving the process;
//! * [`identity`]: what a stored block must prove it is (identity, file id, object binding);
//! * [`fingerprint`]: the model fingerprint every stored block's identity is scoped by;
//! * [`cuda`] and [`nixl`]: optional accelerators, probed before use.

pub mod adopt;
pub mod checksum;
pub mod cuda;
mod error;
pub mod fingerprint;
pub mod identity;
pub mod io;
pub mod layout;
pub mod net;
pub mod nixl;
pub mod physical;
pub mod storage;
#[cfg(any(test, feature = "testing"))]
pub mod testing;
pub mod transfer;

pub use adopt::{KvDims, adopt_kv_tensors, kv_layout_of};
pub use error::{ErrorKind, PhysicalError, Result};
pub use fingerprint::{FingerprintBuilder, ModelFingerprint, Parallelism};
pub use identity::{BlockIdentity, ObjectBinding};
pub use io::IoEngine;
pub use layout::canonical::{CanonicalPageMapping, CopyRun, PageOrder};
pub use layout::{BlockDim, BlockLayout, LayoutBuilder, LayoutConfig, LayoutKind, Region};
pub use net::is_loopback;
pub use physical::{Backing, PhysicalLayout};
pub use storage::{
    DeviceMemory, DiskBufferPoolStats, DiskCapabilities, DiskConfig, DiskStorage,
    HostStandInDevice, HostStorage, IoEngineKind, JournalEntry, JournalFile, JournalGeometry,
    JournalRecord, ObjectKey, ObjectPutMode, Owner, PinPolicy, Storage, StorageKind, TensorDesc,
    TensorDevice, parse_hash_key,
};
#[cfg(feature = "object")]
pub use storage::{
    ObjectConfig, ObjectPresence, ObjectStorage, S3Config, SmallObject, StoredIdentity,
    UpdateOutcome,
};
pub use transfer::{
    BlockId, BouncePoolStats, LayoutHandle, MAX_NICE, RangeCopy, TransferCompletion,
    TransferConfig, TransferManager, TransferOptions, TransferOutcome,
};
