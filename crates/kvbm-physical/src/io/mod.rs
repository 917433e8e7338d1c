//! The I/O engine seam for the disk tier.
//!
//! [`IoEngine::run`] executes a batch of positioned, vectored reads or writes on one file with up
//! to `queue_depth` requests in flight. It calls `prepare(i)` right before request `i` is
//! submitted and `complete(i, result)` when it finishes, so per-block CPU work (checksumming)
//! overlaps with the I/O of the other requests. Backends live in sibling files:
//!
//! * [`UringEngine`] (`uring.rs`): io_uring, batched submission, a pool of rings;
//! * [`PsyncEngine`] (`psync.rs`): `preadv`/`pwritev`, one request at a time; the fallback.
//!
//! Memory contract: the iovecs of a request must stay valid until its `complete` call; the
//! engine keeps the [`IoRequest`] (and whatever it owns through `keep_alive`) until then. The
//! kernel writes through the iovecs of a read, so [`IoEngine::run`] is `unsafe`: its caller
//! promises the memory is live and exclusively its own. The safe way to disk is a transfer
//! ([`crate::TransferManager`]), whose layouts own their memory.

mod psync;
mod uring;

pub use psync::PsyncEngine;
pub use uring::UringEngine;

use std::os::fd::RawFd;

/// Direction of a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IoDir {
    /// Read from the file into the iovecs.
    Read,
    /// Write the iovecs to the file.
    Write,
}

/// One positioned, vectored request.
pub struct IoRequest {
    /// Direction.
    pub dir: IoDir,
    /// File offset.
    pub offset: u64,
    /// The memory (for O_DIRECT: addresses and lengths aligned to the device's block size).
    pub iovecs: Vec<libc::iovec>,
    /// Anything that must live until completion (a staging buffer).
    pub keep_alive: Option<Box<dyn std::any::Any + Send>>,
}

impl std::fmt::Debug for IoRequest {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IoRequest")
            .field("dir", &self.dir)
            .field("offset", &self.offset)
            .field("iovecs", &self.iovecs.len())
            .finish()
    }
}

impl IoRequest {
    /// Total bytes the request covers.
    pub fn len(&self) -> usize {
        self.iovecs.iter().map(|v| v.iov_len).sum()
    }
    /// Whether the request covers no bytes.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// An engine executing batches of [`IoRequest`]s.
pub trait IoEngine: Send + Sync + std::fmt::Debug {
    /// Short name for logs (`io_uring`, `psync`).
    fn name(&self) -> &'static str;
    /// Maximum requests in flight.
    fn queue_depth(&self) -> usize;
    /// Runs requests `0..n` on `fd`. Returns an error only when the engine itself fails (then
    /// requests without a `complete` call did not finish); per-request errors go to `complete`.
    ///
    /// # Safety
    /// For every request `prepare` returns, each iovec must describe memory that stays valid
    /// until that request's `complete` call (or until `run` returns, when the engine fails):
    /// readable for writes, writable and accessed by no one else for reads. `fd` must be an
    /// open file descriptor for the whole call.
    unsafe fn run(
        &self,
        fd: RawFd,
        n: usize,
        prepare: &mut dyn FnMut(usize) -> IoRequest,
        complete: &mut dyn FnMut(usize, std::io::Result<usize>),
    ) -> std::io::Result<()>;
}
