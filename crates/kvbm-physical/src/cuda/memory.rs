//! G1 device allocations (`cuMemAlloc` in the device's primary context) and pinned host memory
//! (registration of an existing [`HostStorage`], or a fresh `cuMemHostAlloc` buffer).

use std::collections::BTreeMap;
use std::sync::{Arc, OnceLock};

use cudarc::driver::{result, sys};
use parking_lot::RwLock;

use super::context::{CudaDevice, cuda_err};
use crate::error::{PhysicalError, Result};
use crate::storage::{DeviceMemory, HostStorage, Storage, StorageKind};

/// Live device allocations: start address → (length, ordinal). Lets the transfer strategy
/// find the device behind a `dyn DeviceMemory` without a downcast.
static ALLOCS: OnceLock<RwLock<BTreeMap<u64, (usize, usize)>>> = OnceLock::new();

fn allocs() -> &'static RwLock<BTreeMap<u64, (usize, usize)>> {
    ALLOCS.get_or_init(Default::default)
}

/// The device ordinal of a live [`CudaDeviceMemory`] containing `addr`, if any.
pub(crate) fn ordinal_of(addr: u64) -> Option<usize> {
    let map = allocs().read();
    let (start, (len, ordinal)) = map.range(..=addr).next_back()?;
    (addr < start + (*len).max(1) as u64).then_some(*ordinal)
}

/// `cuMemAlloc`ed memory in the primary context of one device.
#[derive(Debug)]
pub struct CudaDeviceMemory {
    ptr: sys::CUdeviceptr,
    len: usize,
    device: Arc<CudaDevice>,
}

impl CudaDeviceMemory {
    /// Allocates `len` bytes on device `ordinal`. Fails with `NotSupported` (never panics)
    /// without a driver.
    pub fn new(len: usize, ordinal: usize) -> Result<Self> {
        let device = CudaDevice::get(ordinal)?;
        device.bind()?;
        // SAFETY: the device's context is current.
        let ptr =
            unsafe { result::malloc_sync(len.max(1)) }.map_err(|e| cuda_err("cuMemAlloc", e))?;
        allocs().write().insert(ptr, (len, ordinal));
        Ok(CudaDeviceMemory { ptr, len, device })
    }

    /// The device this memory lives on.
    pub fn device(&self) -> &Arc<CudaDevice> {
        &self.device
    }
}

impl Drop for CudaDeviceMemory {
    fn drop(&mut self) {
        allocs().write().remove(&self.ptr);
        if self.device.bind().is_ok() {
            // SAFETY: ptr was allocated by cuMemAlloc in this context; transfers keep their
            // layouts (and so this allocation) alive until their copies completed.
            let _ = unsafe { result::free_sync(self.ptr) };
        }
    }
}

impl Storage for CudaDeviceMemory {
    fn kind(&self) -> StorageKind {
        StorageKind::Device
    }
    fn size_bytes(&self) -> usize {
        self.len
    }
}

impl DeviceMemory for CudaDeviceMemory {
    fn device_addr(&self) -> u64 {
        self.ptr
    }
    fn is_stand_in(&self) -> bool {
        false
    }
    unsafe fn copy_h2d(&self, dst: u64, src: *const u8, len: usize) -> Result<()> {
        self.device.bind()?;
        // SAFETY: caller's contract: src readable, dst inside device memory.
        unsafe { result::memcpy_htod_sync(dst, std::slice::from_raw_parts(src, len)) }
            .map_err(|e| cuda_err("cuMemcpyHtoD", e))
    }
    unsafe fn copy_d2h(&self, dst: *mut u8, src: u64, len: usize) -> Result<()> {
        self.device.bind()?;
        // SAFETY: caller's contract.
        unsafe { result::memcpy_dtoh_sync(std::slice::from_raw_parts_mut(dst, len), src) }
            .map_err(|e| cuda_err("cuMemcpyDtoH", e))
    }
    unsafe fn copy_d2d(&self, dst: u64, src: u64, len: usize) -> Result<()> {
        self.device.bind()?;
        // SAFETY: caller's contract.
        unsafe { result::memcpy_dtod_sync(dst, src, len) }.map_err(|e| cuda_err("cuMemcpyDtoD", e))
    }
}

/// A `cuMemHostRegister` registration, undone on drop (attached to its [`HostStorage`], which
/// drops it before unmapping).
#[derive(Debug)]
struct HostRegistration {
    ptr: usize,
    device: Arc<CudaDevice>,
}

impl Drop for HostRegistration {
    fn drop(&mut self) {
        if self.device.bind().is_ok() {
            // SAFETY: ptr was registered by `register_host` and is still mapped.
            let _ = unsafe { sys::cuMemHostUnregister(self.ptr as *mut std::ffi::c_void) }.result();
        }
    }
}

/// Page-locks an existing host allocation for DMA (`cuMemHostRegister`, portable to every
/// context), once; later calls return `Ok(false)`. The registration lives as long as `host`.
/// Transfers call this lazily on first use of a G2 layout; call it up front to keep the cost
/// (milliseconds per GiB) off the first transfer.
pub fn register_host(host: &HostStorage, device: &Arc<CudaDevice>) -> Result<bool> {
    if host.is_empty() {
        return Ok(false);
    }
    host.attach_once(|| {
        device.bind()?;
        // SAFETY: the range is host's live mapping; it stays mapped until the registration
        // (attached to `host`) is dropped.
        unsafe {
            sys::cuMemHostRegister_v2(
                host.as_ptr().cast(),
                host.len(),
                sys::CU_MEMHOSTREGISTER_PORTABLE,
            )
        }
        .result()
        .map_err(|e| cuda_err("cuMemHostRegister", e))?;
        Ok(Box::new(HostRegistration {
            ptr: host.as_ptr() as usize,
            device: Arc::clone(device),
        }))
    })
}

/// Pinned host memory from `cuMemHostAlloc` (portable). Used by the benchmark for the raw
/// reference copy; G2 layouts use registered [`HostStorage`] instead.
#[derive(Debug)]
pub struct CudaPinnedBuffer {
    ptr: usize,
    len: usize,
    device: Arc<CudaDevice>,
}

// SAFETY: owned pinned memory; access synchronisation is the user's duty, as for HostStorage.
unsafe impl Send for CudaPinnedBuffer {}
// SAFETY: as above.
unsafe impl Sync for CudaPinnedBuffer {}

impl CudaPinnedBuffer {
    /// Allocates `len` pinned bytes.
    pub fn new(len: usize, device: &Arc<CudaDevice>) -> Result<Self> {
        device.bind()?;
        // SAFETY: a context is current.
        let ptr = unsafe { result::malloc_host(len.max(1), sys::CU_MEMHOSTALLOC_PORTABLE) }
            .map_err(|e| cuda_err("cuMemHostAlloc", e))?;
        if ptr.is_null() {
            return Err(PhysicalError::Cuda {
                op: "cuMemHostAlloc",
                message: "null pointer".into(),
            });
        }
        Ok(CudaPinnedBuffer {
            ptr: ptr as usize,
            len,
            device: Arc::clone(device),
        })
    }
    /// First byte.
    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr as *mut u8
    }
    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }
    /// Whether empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl Drop for CudaPinnedBuffer {
    fn drop(&mut self) {
        if self.device.bind().is_ok() {
            // SAFETY: allocated by cuMemHostAlloc above.
            let _ = unsafe { result::free_host(self.ptr as *mut std::ffi::c_void) };
        }
    }
}
