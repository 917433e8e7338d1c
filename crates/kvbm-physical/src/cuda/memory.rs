//! Device allocations through the CUDA driver API (synchronous copies).

use cudarc::driver::{result, sys};

use crate::error::{PhysicalError, Result};
use crate::storage::{DeviceMemory, Storage, StorageKind};

fn cuda_err(op: &'static str, e: impl std::fmt::Debug) -> PhysicalError {
    PhysicalError::Cuda {
        op,
        message: format!("{e:?}"),
    }
}

/// `cuMemAlloc`ed memory in the primary context of one device.
#[derive(Debug)]
pub struct CudaDeviceMemory {
    ptr: sys::CUdeviceptr,
    len: usize,
    ctx: usize,
}

// SAFETY: a device pointer and a context handle are plain values usable from any thread once
// the context is made current there (done before every call).
unsafe impl Send for CudaDeviceMemory {}
// SAFETY: as above; no interior host state.
unsafe impl Sync for CudaDeviceMemory {}

impl CudaDeviceMemory {
    /// Allocates `len` bytes on device `ordinal`. Call only when
    /// [`crate::cuda::cuda_available`] is true.
    pub fn new(len: usize, ordinal: usize) -> Result<Self> {
        if !super::cuda_available() {
            return Err(PhysicalError::NotSupported("no CUDA driver".into()));
        }
        result::init().map_err(|e| cuda_err("cuInit", e))?;
        let dev = result::device::get(ordinal as i32).map_err(|e| cuda_err("cuDeviceGet", e))?;
        // SAFETY: dev is a valid device handle; the primary context is retained for our life.
        let ctx = unsafe { result::primary_ctx::retain(dev) }
            .map_err(|e| cuda_err("cuDevicePrimaryCtxRetain", e))?;
        // SAFETY: ctx was just retained.
        unsafe { result::ctx::set_current(ctx) }.map_err(|e| cuda_err("cuCtxSetCurrent", e))?;
        // SAFETY: a context is current.
        let ptr =
            unsafe { result::malloc_sync(len.max(1)) }.map_err(|e| cuda_err("cuMemAlloc", e))?;
        Ok(CudaDeviceMemory {
            ptr,
            len,
            ctx: ctx as usize,
        })
    }

    fn bind(&self) -> Result<()> {
        // SAFETY: the context stays retained while self lives.
        unsafe { result::ctx::set_current(self.ctx as sys::CUcontext) }
            .map_err(|e| cuda_err("cuCtxSetCurrent", e))
    }
}

impl Drop for CudaDeviceMemory {
    fn drop(&mut self) {
        if self.bind().is_ok() {
            // SAFETY: ptr was allocated by cuMemAlloc in this context.
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
        self.bind()?;
        // SAFETY: caller's contract: src readable, dst inside device memory.
        unsafe { result::memcpy_htod_sync(dst, std::slice::from_raw_parts(src, len)) }
            .map_err(|e| cuda_err("cuMemcpyHtoD", e))
    }
    unsafe fn copy_d2h(&self, dst: *mut u8, src: u64, len: usize) -> Result<()> {
        self.bind()?;
        // SAFETY: caller's contract.
        unsafe { result::memcpy_dtoh_sync(std::slice::from_raw_parts_mut(dst, len), src) }
            .map_err(|e| cuda_err("cuMemcpyDtoH", e))
    }
    unsafe fn copy_d2d(&self, dst: u64, src: u64, len: usize) -> Result<()> {
        self.bind()?;
        // SAFETY: caller's contract.
        unsafe { result::memcpy_dtod_sync(dst, src, len) }.map_err(|e| cuda_err("cuMemcpyDtoD", e))
    }
}
