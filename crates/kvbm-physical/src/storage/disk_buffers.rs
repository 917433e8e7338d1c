//! The pool of [`DIRECT_ALIGN`]-aligned buffers behind G3 disk I/O (header sectors and
//! staging buffers), owned by one [`DiskStorage`](super::DiskStorage).
//!
//! **Why.** Every disk request needs a header sector ([`DIRECT_ALIGN`] bytes) and, for a block
//! whose memory regions are not O_DIRECT-aligned (vLLM's small CPU chunks, a payload that is
//! not a multiple of [`DIRECT_ALIGN`]), a staging buffer of the payload rounded up. Mapping
//! those afresh for every job and unmapping them at its end (an `mmap`/`munmap` pair, a TLB
//! shootdown, page faults on first touch) dominated small-block disk jobs. The pool keeps them
//! instead: steady-state jobs take buffers that were returned by earlier ones.
//!
//! **Two size classes.** Header sectors ([`DIRECT_ALIGN`] bytes) and staging buffers (the
//! storage's padded payload, fixed per storage). Both are aligned to [`DIRECT_ALIGN`] and
//! zeroed when first allocated; a reused buffer holds whatever its last user left, so writers
//! fill every byte they submit (the disk code zeroes a header sector's tail and a staging
//! buffer's padding before a write).
//!
//! **Lending and returning.** [`BufferPool::lease`] hands out a [`PooledBuf`] that is owned
//! by exactly one request: it is never in the idle list while lent, so no two in-flight
//! requests can share it. It goes back to the pool only when the [`PooledBuf`] is dropped. The
//! disk code puts each request's buffers into the request's `keep_alive` (see
//! [`IoRequest`](crate::io::IoRequest)), which the I/O engine drops only after the request
//! completed — or never, when the engine cannot wait for the kernel and leaks the request:
//! then the buffer is leaked too and never handed out again. A buffer the kernel may still
//! write is therefore never lent a second time.
//!
//! **Bound and exhaustion.** The bound
//! ([`DiskConfig::buffer_pool_bytes`](super::DiskConfig::buffer_pool_bytes), default
//! [`DEFAULT_BUFFER_POOL_BYTES`]) caps the bytes the pool *keeps idle*. A lease finding no
//! idle buffer of its class never waits: it allocates a fresh one (a *miss*). A returned
//! buffer that would take the idle bytes past the bound is freed instead of kept (*released*).
//! Waiting was rejected: a job takes its buffers one request at a time while its earlier
//! requests are still in flight, and the engine reaps those only between prepares, so jobs
//! waiting for each other's buffers could deadlock. The memory lent out at once is bounded by
//! the jobs in flight: a job lends buffers to at most twice its `queue_depth` requests at once
//! (those in flight plus those reaped whose completion is being handled), each one header and
//! at most one staging buffer — less than before the pool, when a job mapped every block's
//! header at once. The pool adds at most the bound.
//!
//! **Locking.** One `parking_lot::Mutex` over the idle lists, held only to push or pop a
//! buffer and update the idle byte count: never while allocating, freeing, copying or doing
//! I/O, and no other lock is taken while it is held, so there is no lock order to break.
//! Counters are relaxed atomics read by [`BufferPool::stats`].

use std::alloc::Layout;
use std::ptr::NonNull;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

use parking_lot::Mutex;

use super::disk::DIRECT_ALIGN;
use crate::error::{PhysicalError, Result};

/// Default of [`DiskConfig::buffer_pool_bytes`](super::DiskConfig::buffer_pool_bytes): 64 MiB
/// of idle buffers kept per disk storage.
pub const DEFAULT_BUFFER_POOL_BYTES: usize = 64 << 20;

/// Counters of a disk storage's buffer pool (cumulative since the storage was created, except
/// `idle_bytes` and `lent`, which are the state now).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct DiskBufferPoolStats {
    /// Most bytes the pool keeps idle
    /// ([`DiskConfig::buffer_pool_bytes`](super::DiskConfig::buffer_pool_bytes)).
    pub bound_bytes: usize,
    /// Bytes of a staging buffer (the payload rounded up to 4 KiB, the O_DIRECT alignment).
    pub staging_bytes: usize,
    /// Leases served by an idle buffer (no allocation).
    pub hits: u64,
    /// Leases that allocated a buffer (no idle buffer of the class).
    pub misses: u64,
    /// Returned buffers freed because keeping them would pass the bound.
    pub released: u64,
    /// Bytes idle in the pool now.
    pub idle_bytes: usize,
    /// Buffers lent out now (held by requests in flight, or leaked with a failed engine's
    /// requests).
    pub lent: usize,
}

/// A size class.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum BufClass {
    /// One header sector, [`DIRECT_ALIGN`] bytes.
    Header,
    /// One staging buffer, the storage's padded payload.
    Staging,
}

/// An owned, zero-initialised, [`DIRECT_ALIGN`]-aligned heap allocation.
#[derive(Debug)]
struct AlignedBuf {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: the allocation is owned exclusively by this value and is plain memory; it only hands
// out raw addresses, whose users synchronise (one request owns a lent buffer).
unsafe impl Send for AlignedBuf {}
// SAFETY: as above; `&AlignedBuf` exposes nothing but the address and length.
unsafe impl Sync for AlignedBuf {}

impl AlignedBuf {
    fn layout(len: usize) -> Layout {
        Layout::from_size_align(len.max(1), DIRECT_ALIGN).expect("DIRECT_ALIGN is a power of two")
    }

    fn new(len: usize) -> Result<Self> {
        // SAFETY: the layout has a non-zero size.
        let ptr = unsafe { std::alloc::alloc_zeroed(Self::layout(len)) };
        let ptr = NonNull::new(ptr).ok_or_else(|| {
            PhysicalError::io(
                "allocate a disk I/O buffer",
                None,
                std::io::Error::from(std::io::ErrorKind::OutOfMemory),
            )
        })?;
        Ok(AlignedBuf { ptr, len })
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        // SAFETY: allocated in `new` with this very layout, freed once.
        unsafe { std::alloc::dealloc(self.ptr.as_ptr(), Self::layout(self.len)) };
    }
}

#[derive(Debug, Default)]
struct Idle {
    headers: Vec<AlignedBuf>,
    staging: Vec<AlignedBuf>,
    bytes: usize,
}

#[derive(Debug)]
struct Inner {
    bound_bytes: usize,
    staging_bytes: usize,
    idle: Mutex<Idle>,
    hits: AtomicU64,
    misses: AtomicU64,
    released: AtomicU64,
    lent: AtomicUsize,
}

/// The pool (cheap to clone: a handle to shared state, so lent buffers can outlive a job).
#[derive(Debug, Clone)]
pub(crate) struct BufferPool {
    inner: Arc<Inner>,
}

/// A buffer lent to one request; back to the pool (or freed) when dropped.
#[derive(Debug)]
pub(crate) struct PooledBuf {
    /// `Some` until dropped.
    buf: Option<AlignedBuf>,
    class: BufClass,
    pool: Arc<Inner>,
}

impl PooledBuf {
    /// The first byte (aligned to [`DIRECT_ALIGN`]).
    pub(crate) fn as_ptr(&self) -> *mut u8 {
        self.buf.as_ref().expect("present until drop").ptr.as_ptr()
    }

    /// Its length in bytes.
    pub(crate) fn len(&self) -> usize {
        self.buf.as_ref().expect("present until drop").len
    }
}

impl Drop for PooledBuf {
    fn drop(&mut self) {
        let Some(buf) = self.buf.take() else { return };
        self.pool.lent.fetch_sub(1, Ordering::Relaxed);
        let len = buf.len;
        let surplus = {
            let mut idle = self.pool.idle.lock();
            if idle.bytes + len <= self.pool.bound_bytes {
                idle.bytes += len;
                match self.class {
                    BufClass::Header => idle.headers.push(buf),
                    BufClass::Staging => idle.staging.push(buf),
                }
                None
            } else {
                Some(buf)
            }
        };
        if let Some(buf) = surplus {
            self.pool.released.fetch_add(1, Ordering::Relaxed);
            drop(buf); // freed outside the lock
        }
    }
}

impl BufferPool {
    /// A pool keeping at most `bound_bytes` idle, lending header sectors and staging buffers
    /// of `staging_bytes` (rounded up to [`DIRECT_ALIGN`]).
    pub(crate) fn new(bound_bytes: usize, staging_bytes: usize) -> Self {
        BufferPool {
            inner: Arc::new(Inner {
                bound_bytes,
                staging_bytes: staging_bytes.max(1).div_ceil(DIRECT_ALIGN) * DIRECT_ALIGN,
                idle: Mutex::new(Idle::default()),
                hits: AtomicU64::new(0),
                misses: AtomicU64::new(0),
                released: AtomicU64::new(0),
                lent: AtomicUsize::new(0),
            }),
        }
    }

    /// Lends a buffer of `class`: an idle one when there is one, else a fresh allocation
    /// (never waits). Fails only when the allocation does.
    pub(crate) fn lease(&self, class: BufClass) -> Result<PooledBuf> {
        let inner = &self.inner;
        let reused = {
            let mut idle = inner.idle.lock();
            let buf = match class {
                BufClass::Header => idle.headers.pop(),
                BufClass::Staging => idle.staging.pop(),
            };
            if let Some(b) = &buf {
                idle.bytes -= b.len;
            }
            buf
        };
        let buf = match reused {
            Some(b) => {
                inner.hits.fetch_add(1, Ordering::Relaxed);
                b
            }
            None => {
                let b = AlignedBuf::new(match class {
                    BufClass::Header => DIRECT_ALIGN,
                    BufClass::Staging => inner.staging_bytes,
                })?;
                inner.misses.fetch_add(1, Ordering::Relaxed);
                b
            }
        };
        inner.lent.fetch_add(1, Ordering::Relaxed);
        Ok(PooledBuf {
            buf: Some(buf),
            class,
            pool: Arc::clone(inner),
        })
    }

    /// The counters now.
    pub(crate) fn stats(&self) -> DiskBufferPoolStats {
        let inner = &self.inner;
        DiskBufferPoolStats {
            bound_bytes: inner.bound_bytes,
            staging_bytes: inner.staging_bytes,
            hits: inner.hits.load(Ordering::Relaxed),
            misses: inner.misses.load(Ordering::Relaxed),
            released: inner.released.load(Ordering::Relaxed),
            idle_bytes: inner.idle.lock().bytes,
            lent: inner.lent.load(Ordering::Relaxed),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lent_buffers_are_aligned_distinct_and_reused_after_return() {
        let pool = BufferPool::new(1 << 20, 5000);
        let a = pool.lease(BufClass::Staging).unwrap();
        let b = pool.lease(BufClass::Staging).unwrap();
        let h = pool.lease(BufClass::Header).unwrap();
        assert_eq!(
            a.len(),
            2 * DIRECT_ALIGN,
            "staging is the payload rounded up"
        );
        assert_eq!(h.len(), DIRECT_ALIGN);
        for p in [a.as_ptr(), b.as_ptr(), h.as_ptr()] {
            assert_eq!(p as usize % DIRECT_ALIGN, 0);
        }
        assert_ne!(a.as_ptr(), b.as_ptr(), "two leases never share a buffer");
        let s = pool.stats();
        assert_eq!((s.hits, s.misses, s.lent), (0, 3, 3));
        let a_ptr = a.as_ptr();
        drop(a);
        let s = pool.stats();
        assert_eq!((s.lent, s.idle_bytes), (2, 2 * DIRECT_ALIGN));
        // The staging class gets the returned buffer back; the header class does not.
        let c = pool.lease(BufClass::Staging).unwrap();
        assert_eq!(c.as_ptr(), a_ptr, "the returned buffer is lent again");
        assert_ne!(c.as_ptr(), b.as_ptr());
        let h2 = pool.lease(BufClass::Header).unwrap();
        assert_ne!(h2.as_ptr(), h.as_ptr(), "a lent header is not lent twice");
        let s = pool.stats();
        assert_eq!((s.hits, s.misses, s.idle_bytes), (1, 4, 0));
    }

    #[test]
    fn exhaustion_allocates_beyond_the_bound_and_frees_the_surplus_on_return() {
        // Room for two idle staging buffers of 4 KiB.
        let pool = BufferPool::new(2 * DIRECT_ALIGN, DIRECT_ALIGN);
        let lent: Vec<_> = (0..5)
            .map(|_| pool.lease(BufClass::Staging).unwrap())
            .collect();
        let mut ptrs: Vec<usize> = lent.iter().map(|b| b.as_ptr() as usize).collect();
        ptrs.sort_unstable();
        ptrs.dedup();
        assert_eq!(
            ptrs.len(),
            5,
            "leases past the bound are served, never shared"
        );
        assert_eq!(pool.stats().misses, 5);
        drop(lent);
        let s = pool.stats();
        assert_eq!(
            (s.lent, s.idle_bytes, s.released),
            (0, 2 * DIRECT_ALIGN, 3),
            "two kept (the bound), three freed"
        );
        let again: Vec<_> = (0..5)
            .map(|_| pool.lease(BufClass::Staging).unwrap())
            .collect();
        let s = pool.stats();
        assert_eq!((s.hits, s.misses), (2, 8), "two reused, three allocated");
        drop(again);
        // A bound of zero keeps nothing: every lease allocates.
        let none = BufferPool::new(0, DIRECT_ALIGN);
        drop(none.lease(BufClass::Header).unwrap());
        drop(none.lease(BufClass::Header).unwrap());
        let s = none.stats();
        assert_eq!((s.hits, s.misses, s.released, s.idle_bytes), (0, 2, 2, 0));
    }

    #[test]
    fn a_buffer_outliving_its_pool_handle_is_freed_or_kept_safely() {
        let pool = BufferPool::new(1 << 20, DIRECT_ALIGN);
        let b = pool.lease(BufClass::Header).unwrap();
        // SAFETY: the test owns the lent buffer.
        unsafe { b.as_ptr().write_bytes(0xAB, b.len()) };
        let stats_view = pool.clone();
        drop(pool);
        drop(b); // returned into the shared state the clone still sees
        assert_eq!(stats_view.stats().idle_bytes, DIRECT_ALIGN);
        assert_eq!(stats_view.stats().lent, 0);
    }
}
