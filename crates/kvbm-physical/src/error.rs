//! The one error type of this crate.
//!
//! Every fallible operation returns [`PhysicalError`]. Argument errors (a bad handle, mismatched id
//! lists, a block id out of range) are returned by [`crate::TransferManager::execute_transfer`]
//! before anything starts; data errors (a checksum mismatch, a short read, a missing object) are
//! reported per block in [`crate::TransferOutcome`].

use std::path::PathBuf;

/// Errors of the bytes layer. Variants carry the numbers needed to act on them.
#[derive(Debug, thiserror::Error)]
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
        source: std::io::Error,
    },
    /// An object-store error other than not-found / already-exists.
    #[error("object store error during {op} on {key}: {source}")]
    ObjectStore {
        /// What we were doing (`put`, `get`, …).
        op: &'static str,
        /// The object's full path.
        key: String,
        /// The underlying error.
        #[source]
        source: object_store::Error,
    },
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
    pub(crate) fn io(
        op: &'static str,
        path: Option<&std::path::Path>,
        source: std::io::Error,
    ) -> Self {
        PhysicalError::Io {
            op,
            path: path.map(|p| p.to_path_buf()),
            source,
        }
    }

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
                source,
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
}
