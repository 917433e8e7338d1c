//! G2 host memory: page-aligned anonymous mappings, pinned with `mlock` when allowed, or host
//! memory someone else owns ([`HostStorage::external`]).
//!
//! Pinning can be refused (RLIMIT_MEMLOCK without CAP_IPC_LOCK). Then the allocation stays
//! unpinned and one warning is logged per process, never a crash.
//!
//! External memory is how an inference engine's own buffer becomes a layout kvbm moves bytes
//! in and out of without copying through a second buffer: vLLM's shared CPU offload region
//! (a `/dev/shm` mapping its workers fill from the GPU) is the primary tier kvbm's disk and
//! object tiers read and write. kvbm never unmaps it; an owner value kept inside the storage
//! (e.g. the Python buffer export) keeps it alive until the storage is dropped.

use std::sync::atomic::{AtomicBool, Ordering};

use crate::error::{PhysicalError, Result};
use crate::storage::{Storage, StorageKind};

static PIN_WARNED: AtomicBool = AtomicBool::new(false);

/// Whether to pin host memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PinPolicy {
    /// Try `mlock`; fall back to unpinned memory with one warning. Default.
    #[default]
    TryPin,
    /// Never pin (tests, small bounce buffers).
    Unpinned,
}

/// A page-aligned host allocation.
#[derive(Debug)]
pub struct HostStorage {
    ptr: *mut u8,
    len: usize,
    map_len: usize,
    pinned: bool,
    /// Dropped before the mapping is unmapped: e.g. a CUDA host registration (`crate::cuda`).
    attachment: parking_lot::Mutex<Option<Box<dyn std::any::Any + Send + Sync>>>,
    /// External memory: the value keeping it alive (dropped after the attachment); nothing is
    /// unmapped. `None` for a mapping this value made.
    owner: Option<Box<dyn std::any::Any + Send + Sync>>,
}

// SAFETY: the mapping is owned exclusively by this value and is plain memory; synchronisation
// of the bytes is the transfer caller's duty (see the module docs of `crate::storage`).
unsafe impl Send for HostStorage {}
// SAFETY: as above; `&HostStorage` only hands out raw addresses.
unsafe impl Sync for HostStorage {}

impl HostStorage {
    /// Allocates `len` zeroed bytes, page-aligned, pinned according to `pin`.
    pub fn new(len: usize, pin: PinPolicy) -> Result<Self> {
        let page = page_size();
        let map_len = len.max(1).div_ceil(page) * page;
        // SAFETY: anonymous private mapping, no file, checked for MAP_FAILED below.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                map_len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(PhysicalError::io(
                "mmap host memory",
                None,
                std::io::Error::last_os_error(),
            ));
        }
        let mut pinned = false;
        if pin == PinPolicy::TryPin {
            // SAFETY: the range is the mapping just created.
            if unsafe { libc::mlock(ptr, map_len) } == 0 {
                pinned = true;
            } else {
                let err = std::io::Error::last_os_error();
                if !PIN_WARNED.swap(true, Ordering::Relaxed) {
                    tracing::warn!(
                        bytes = map_len,
                        error = %err,
                        "mlock refused; host memory stays unpinned (raise RLIMIT_MEMLOCK or grant CAP_IPC_LOCK); warned once"
                    );
                }
            }
        }
        Ok(HostStorage {
            ptr: ptr.cast(),
            len,
            map_len,
            pinned,
            attachment: parking_lot::Mutex::new(None),
            owner: None,
        })
    }

    /// The first byte's address.
    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr
    }

    /// Length requested at allocation.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the allocation is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Whether `mlock` succeeded.
    pub fn is_pinned(&self) -> bool {
        self.pinned
    }

    /// Attaches the value `make` returns unless one is attached already (returns `false` then,
    /// without calling `make`). The attachment lives until just before the memory is unmapped;
    /// `crate::cuda` uses it for the CUDA registration of this allocation.
    pub fn attach_once(
        &self,
        make: impl FnOnce() -> Result<Box<dyn std::any::Any + Send + Sync>>,
    ) -> Result<bool> {
        let mut slot = self.attachment.lock();
        if slot.is_some() {
            return Ok(false);
        }
        *slot = Some(make()?);
        Ok(true)
    }

    /// `len` bytes at `ptr` that `owner` keeps alive: memory kvbm reads and writes but neither
    /// allocated nor unmaps (an inference engine's own buffer, e.g. vLLM's CPU offload region,
    /// used in place). It counts as unpinned.
    ///
    /// # Errors
    /// [`PhysicalError::InvalidLayout`] for a null pointer or zero length.
    ///
    /// # Safety
    /// `ptr..ptr + len` must be valid, writable host memory for as long as `owner` lives, no
    /// other code may free or remap it meanwhile, and whoever else accesses the bytes must
    /// synchronise with kvbm's transfers (as for any storage: the transfer caller's duty).
    pub unsafe fn external(
        ptr: *mut u8,
        len: usize,
        owner: Box<dyn std::any::Any + Send + Sync>,
    ) -> Result<Self> {
        if ptr.is_null() || len == 0 {
            return Err(PhysicalError::InvalidLayout(format!(
                "external host memory at {ptr:?} of {len} bytes: need a non-null pointer and a \
                 non-zero length"
            )));
        }
        Ok(Self {
            ptr,
            len,
            map_len: 0,
            pinned: false,
            attachment: parking_lot::Mutex::new(None),
            owner: Some(owner),
        })
    }

    /// Whether this is someone else's memory ([`HostStorage::external`]).
    pub fn is_external(&self) -> bool {
        self.owner.is_some()
    }

    /// The bytes, shared.
    ///
    /// # Safety
    /// No one may write the memory while the slice is alive.
    pub unsafe fn as_slice(&self) -> &[u8] {
        // SAFETY: the mapping is valid for `len` bytes; the caller excludes writers.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }

    /// The bytes, exclusively.
    ///
    /// # Safety
    /// No one else may access the memory while the slice is alive.
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn as_mut_slice(&self) -> &mut [u8] {
        // SAFETY: the mapping is valid for `len` bytes; the caller excludes other access.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

impl Drop for HostStorage {
    fn drop(&mut self) {
        // The attachment (a CUDA registration) must go before the mapping does.
        drop(self.attachment.get_mut().take());
        if self.owner.take().is_some() {
            // External memory: its owner (just dropped) decides its fate; nothing to unmap.
            return;
        }
        // SAFETY: unmapping the mapping this value owns; munmap also drops the lock.
        unsafe {
            libc::munmap(self.ptr.cast(), self.map_len);
        }
    }
}

impl Storage for HostStorage {
    fn kind(&self) -> StorageKind {
        StorageKind::Host
    }
    fn size_bytes(&self) -> usize {
        self.len
    }
}

pub(crate) fn page_size() -> usize {
    // SAFETY: sysconf has no preconditions.
    let p = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    if p > 0 { p as usize } else { 4096 }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn external_memory_is_used_in_place_and_never_unmapped() {
        let buf = std::sync::Arc::new(parking_lot::Mutex::new(vec![3u8; 8192]));
        let ptr = buf.lock().as_mut_ptr();
        // SAFETY: the Vec lives in `buf`, which the storage keeps alive; nothing resizes it.
        let h = unsafe { HostStorage::external(ptr, 8192, Box::new(buf.clone())) }.unwrap();
        assert!(h.is_external() && !h.is_pinned());
        assert_eq!(h.as_ptr(), ptr);
        // SAFETY: the test is the only user of the bytes here.
        unsafe { h.as_mut_slice()[5] = 9 };
        assert_eq!(buf.lock()[5], 9, "the caller's memory, written in place");
        assert_eq!(
            std::sync::Arc::strong_count(&buf),
            2,
            "the storage holds the owner"
        );
        drop(h);
        assert_eq!(
            std::sync::Arc::strong_count(&buf),
            1,
            "dropping it releases the owner"
        );
        assert_eq!(buf.lock()[5], 9, "and leaves the memory alone");
        // SAFETY: a null pointer is refused before anything is touched.
        let bad = unsafe { HostStorage::external(std::ptr::null_mut(), 8, Box::new(())) };
        assert!(matches!(bad, Err(PhysicalError::InvalidLayout(_))));
    }

    #[test]
    fn aligned_zeroed_and_writable() {
        for pin in [PinPolicy::TryPin, PinPolicy::Unpinned] {
            let h = HostStorage::new(10_000, pin).unwrap();
            assert_eq!(h.as_ptr() as usize % page_size(), 0);
            // SAFETY: test owns the allocation exclusively.
            let s = unsafe { h.as_mut_slice() };
            assert!(s.iter().all(|b| *b == 0));
            s[9_999] = 7;
            // SAFETY: as above; the mutable view `s` is no longer used.
            let read = unsafe { h.as_slice() };
            assert_eq!(read[9_999], 7);
            if pin == PinPolicy::Unpinned {
                assert!(!h.is_pinned());
            }
        }
    }
}
