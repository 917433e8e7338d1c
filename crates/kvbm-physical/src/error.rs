//! The one error type of this crate.
//!
//! Every fallible operation returns [`PhysicalError`]. Argument errors (a bad handle, mismatched id
//! lists, a block id out of range) are returned by [`crate::TransferManager::execute_transfer`]
//! before anything starts; data errors (a checksum mismatch, a short read, a missing object) are
//! reported per block in [`crate::TransferOutcome`].
//!
//! The error is `Clone` (operating-system and object-store errors are shared behind an
//! [`Arc`]), so a layer above can carry it inside a per-block failure instead of a string, and
//! [`PhysicalError::kind`] sorts every variant into the few [`ErrorKind`]s a caller acts on.

use std::path::PathBuf;
use std::sync::Arc;

/// What a caller does about a failed block, by category.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ErrorKind {
    /// The bytes read are not the bytes stored: drop the copy (checksum mismatch, short read,
    /// corrupt header).
    Corrupt,
    /// The stored block is intact but is not the one asked for (another block's identity,
    /// another file instance, another key, namespace, geometry or rank): treat it as absent and
    /// rewrite it.
    IdentityMismatch,
    /// Nothing is stored there: clear presence.
    NotFound,
    /// An operating-system or object-store error: retry may help.
    Io,
    /// The call was refused before anything started (bad arguments, busy blocks).
    Rejected,
    /// The transfer was aborted (manager shut down, worker died).
    Aborted,
}

/// Errors of the bytes layer. Variants carry the numbers needed to act on them.
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum PhysicalError {
    /// The bytes read do not hash to the checksum stored with them.
    #[error("checksum mismatch at {location}: stored {expected:032x}, computed {actual:032x}")]
    ChecksumMismatch {
        /// Where the block came from (`disk:/path@offset`, `object:key`).
        location: String,
        /// The checksum stored with the block.
        expected: u128,
        /// The checksum of the bytes actually read.
        actual: u128,
    },
    /// The object (or disk slot) holds no block.
    #[error("not found: {location}")]
    NotFound {
        /// Where we looked.
        location: String,
    },
    /// Fewer bytes came back than the block needs (a truncated object or file).
    #[error("short read at {location}: expected {expected} bytes, got {actual}")]
    ShortRead {
        /// Where the block came from.
        location: String,
        /// Bytes expected.
        expected: usize,
        /// Bytes actually read.
        actual: usize,
    },
    /// A stored block header is malformed (wrong magic, version, length or slot).
    #[error("corrupt block header at {location}: {reason}")]
    CorruptHeader {
        /// Where the block came from.
        location: String,
        /// What was wrong.
        reason: String,
    },
    /// An operating-system I/O error.
    #[error("I/O error during {op}{}: {source}", path.as_ref().map(|p| format!(" on {}", p.display())).unwrap_or_default())]
    Io {
        /// What we were doing (`pwrite`, `io_uring read`, `fallocate`, …).
        op: &'static str,
        /// The file involved, when there is one.
        path: Option<PathBuf>,
        /// The underlying error.
        #[source]
        source: Arc<std::io::Error>,
    },
    /// An object-store error other than not-found / already-exists.
    #[cfg(feature = "object")]
    #[error("object store error during {op} on {key}: {source}")]
    ObjectStore {
        /// What we were doing (`put`, `get`, …).
        op: &'static str,
        /// The object's full path.
        key: String,
        /// The underlying error.
        #[source]
        source: Arc<object_store::Error>,
    },
    /// A stored block is intact but was written for something else: another block identity,
    /// another file instance (disk), or another key, namespace, layout geometry or
    /// tensor-parallel rank (objects). Reported instead of serving the wrong KV.
    #[error("identity mismatch at {location}: {what} is {found}, expected {expected}")]
    IdentityMismatch {
        /// Where the block came from.
        location: String,
        /// Which binding differs (`block identity`, `file id`, `object binding`).
        what: &'static str,
        /// What the reader expected (hex).
        expected: String,
        /// What the header holds (hex).
        found: String,
    },
    /// An object body is larger than the reader accepts (checked before reading it).
    #[error("object too large at {location}: {size} bytes, at most {limit} accepted")]
    TooLarge {
        /// Where the object is.
        location: String,
        /// Its size per the store's metadata.
        size: u64,
        /// The most the reader accepts.
        limit: u64,
    },
    /// The disk file is locked by another opener (another process or another storage in this
    /// one).
    #[error("disk file {} is already open by another storage (exclusive flock held)", path.display())]
    FileLocked {
        /// The file.
        path: PathBuf,
    },
    /// A transfer would touch a block another in-flight transfer of the same manager is
    /// writing (or would write a block one is reading). Nothing started.
    #[error("block {block_id} of layout {layout:?} is busy in another transfer")]
    BlockBusy {
        /// The layout.
        layout: crate::LayoutHandle,
        /// The block.
        block_id: usize,
    },
    /// A layout's memory (or disk file) overlaps a layout already registered.
    #[error("layout memory overlaps a registered layout: {0}")]
    AliasedLayout(String),
    /// A conditional create found the object already present.
    #[error("object already exists: {key}")]
    AlreadyExists {
        /// The object's full path.
        key: String,
    },
    /// A layout handle not registered with this transfer manager.
    #[error("unknown layout handle {0:?}")]
    UnknownLayout(crate::LayoutHandle),
    /// A block id beyond the layout's block count.
    #[error("block id {block_id} out of range (layout has {num_blocks} blocks)")]
    BlockOutOfRange {
        /// The offending id.
        block_id: usize,
        /// Blocks in the layout.
        num_blocks: usize,
    },
    /// The arguments of a call do not fit together.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// A layout builder was given an impossible configuration.
    #[error("invalid layout: {0}")]
    InvalidLayout(String),
    /// Two layouts whose block geometry differs cannot exchange blocks.
    #[error("incompatible layouts: {0}")]
    IncompatibleLayouts(String),
    /// The operation is not available here (no CUDA driver, no NIXL library, …).
    #[error("not supported: {0}")]
    NotSupported(String),
    /// A CUDA driver error.
    #[error("cuda error during {op}: {message}")]
    Cuda {
        /// What we were doing.
        op: &'static str,
        /// The driver's message.
        message: String,
    },
    /// The transfer could not finish because the manager shut down or a worker died.
    #[error("transfer aborted: {0}")]
    Aborted(String),
}

impl PhysicalError {
    /// The category a caller acts on.
    pub fn kind(&self) -> ErrorKind {
        match self {
            PhysicalError::ChecksumMismatch { .. }
            | PhysicalError::ShortRead { .. }
            | PhysicalError::CorruptHeader { .. }
            | PhysicalError::TooLarge { .. } => ErrorKind::Corrupt,
            PhysicalError::IdentityMismatch { .. } => ErrorKind::IdentityMismatch,
            PhysicalError::NotFound { .. } => ErrorKind::NotFound,
            #[cfg(feature = "object")]
            PhysicalError::ObjectStore { .. } => ErrorKind::Io,
            PhysicalError::Io { .. }
            | PhysicalError::Cuda { .. }
            | PhysicalError::FileLocked { .. } => ErrorKind::Io,
            PhysicalError::Aborted(_) => ErrorKind::Aborted,
            PhysicalError::AlreadyExists { .. }
            | PhysicalError::UnknownLayout(_)
            | PhysicalError::BlockOutOfRange { .. }
            | PhysicalError::InvalidArgument(_)
            | PhysicalError::InvalidLayout(_)
            | PhysicalError::IncompatibleLayouts(_)
            | PhysicalError::NotSupported(_)
            | PhysicalError::BlockBusy { .. }
            | PhysicalError::AliasedLayout(_) => ErrorKind::Rejected,
        }
    }

    pub(crate) fn io(
        op: &'static str,
        path: Option<&std::path::Path>,
        source: std::io::Error,
    ) -> Self {
        PhysicalError::Io {
            op,
            path: path.map(|p| p.to_path_buf()),
            source: Arc::new(source),
        }
    }

    #[cfg(feature = "object")]
    pub(crate) fn object(op: &'static str, key: &str, source: object_store::Error) -> Self {
        match source {
            object_store::Error::NotFound { .. } => PhysicalError::NotFound {
                location: format!("object:{key}"),
            },
            object_store::Error::AlreadyExists { .. }
            | object_store::Error::Precondition { .. } => PhysicalError::AlreadyExists {
                key: key.to_string(),
            },
            source => PhysicalError::ObjectStore {
                op,
                key: key.to_string(),
                source: Arc::new(source),
            },
        }
    }
}

/// Result alias for this crate.
pub type Result<T, E = PhysicalError> = std::result::Result<T, E>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn error_is_send_sync_static() {
        fn check<T: Send + Sync + 'static>() {}
        check::<PhysicalError>();
    }

    #[test]
    fn error_clones_and_sorts_into_kinds() {
        let e = PhysicalError::io("pread", None, std::io::Error::other("boom"));
        let c = e.clone();
        assert_eq!(c.to_string(), e.to_string());
        assert_eq!(c.kind(), ErrorKind::Io);
        let m = PhysicalError::IdentityMismatch {
            location: "disk:x@slot0".into(),
            what: "file id",
            expected: "1".into(),
            found: "2".into(),
        };
        assert_eq!(m.kind(), ErrorKind::IdentityMismatch);
        assert_eq!(
            PhysicalError::NotFound {
                location: "x".into()
            }
            .kind(),
            ErrorKind::NotFound
        );
    }
}
