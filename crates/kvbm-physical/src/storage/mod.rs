//! Where each tier's bytes live.
//!
//! One trait per seam: [`Storage`] is what every backend is; the memory-addressable backends
//! (host memory, device memory) are reached through raw regions, while disk and objects are
//! reached through their own I/O paths. Backends live in sibling files:
//!
//! | tier | type | file |
//! |---|---|---|
//! | G1 | [`DeviceMemory`] ([`HostStandInDevice`] without a GPU; `crate::cuda` with one) | `device.rs` |
//! | G1 an engine owns | described by [`TensorDesc`]: host tensors under [`HostStandInDevice::over`], device ones `crate::cuda`'s `CudaDeviceMemory::adopt` | `external.rs` |
//! | G2 | [`HostStorage`] (page-aligned, mlock-pinned, unpinned fallback) | `host.rs` |
//! | G3 | [`DiskStorage`] (one fallocated O_DIRECT file, io_uring or pread/pwrite) | `disk.rs` |
//! | G3 I/O buffers | the disk's pool of header sectors and staging buffers ([`DiskBufferPoolStats`]) | `disk_buffers.rs` |
//! | G3 index | [`JournalFile`] (append-only, checksummed, replayed at open) | `journal.rs` |
//! | G4 | `ObjectStorage` (object_store: S3, local fs, in-memory; the default `object` feature) | `object.rs`, keys in `object_key.rs` |
//!
//! Invariant shared by all: a storage object owns its allocation for its whole life and never
//! moves it, so regions computed from a layout stay valid while the layout is alive. Callers of
//! a transfer guarantee no one else writes the blocks involved while it runs.

mod device;
mod disk;
mod disk_buffers;
mod external;
mod host;
pub mod journal;
#[cfg(feature = "object")]
mod object;
mod object_key;

pub use device::{DeviceMemory, HostStandInDevice};
pub use disk::{DiskBlock, DiskCapabilities, DiskConfig, DiskStorage, IoEngineKind};
pub use disk_buffers::{DEFAULT_BUFFER_POOL_BYTES, DiskBufferPoolStats};
pub use external::{Owner, TensorDesc, TensorDevice};
pub use host::{HostStorage, PinPolicy};
pub use journal::{
    JournalEntry, JournalFile, JournalGeometry, JournalRecord, Recovery as JournalRecovery,
};
#[cfg(feature = "object")]
pub use object::{
    ObjectConfig, ObjectPresence, ObjectStorage, REDACTED, S3Config, SmallObject, StoredIdentity,
    UpdateOutcome,
};
pub use object_key::{ObjectKey, ObjectPutMode, parse_hash_key};

/// Creates the temporary file `tmp` afresh for a write-then-rename: whatever is at `tmp` (a
/// leftover from a crash, or a symlink someone planted) is unlinked first, which never follows
/// a link, and the file is then created exclusively with `O_NOFOLLOW`, so the write can never
/// land in a file a link points to (a link planted again in between makes the create fail).
pub(crate) fn create_fresh(tmp: &std::path::Path) -> std::io::Result<std::fs::File> {
    use std::os::unix::fs::OpenOptionsExt;
    match std::fs::remove_file(tmp) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(e),
    }
    std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW)
        .open(tmp)
}

/// The kind of a storage backend.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum StorageKind {
    /// GPU memory (G1), or its host stand-in.
    Device,
    /// Host memory (G2).
    Host,
    /// A local file (G3).
    Disk,
    /// An object store (G4).
    Object,
}

/// What every storage backend is.
pub trait Storage: Send + Sync + std::fmt::Debug {
    /// The backend's kind.
    fn kind(&self) -> StorageKind;
    /// Capacity in bytes (for objects: unbounded, reported as `usize::MAX`).
    fn size_bytes(&self) -> usize;
}
