//! G1 device allocations (`cuMemAlloc` in the device's primary context) and pinned host memory
//! (registration of an existing [`HostStorage`], or a fresh `cuMemHostAlloc` buffer).

use std::collections::BTreeMap;
use std::sync::{Arc, OnceLock};

use cudarc::driver::{result, sys};
use parking_lot::RwLock;

use super::context::{CudaDevice, cuda_err};
use crate::error::{PhysicalError, Result};
use crate::storage::{DeviceMemory, HostStorage, Owner, Storage, StorageKind};

/// Live device memory kvbm copies to or from: start address → (length, ordinal, spans
/// starting there). Lets the transfer strategy find the device behind a `dyn DeviceMemory`
/// without a downcast. Its own allocations and adopted spans ([`CudaDeviceMemory`]) are both
/// listed; two adopted spans may start at one address (one tensor adopted twice), so each
/// start counts its spans and is unlisted with the last.
static ALLOCS: OnceLock<RwLock<Listed>> = OnceLock::new();

/// Start address → (length, ordinal, spans starting there).
type Listed = BTreeMap<u64, (usize, usize, usize)>;

fn allocs() -> &'static RwLock<Listed> {
    ALLOCS.get_or_init(Default::default)
}

fn list(start: u64, len: usize, ordinal: usize) {
    let mut map = allocs().write();
    let e = map.entry(start).or_insert((len, ordinal, 0));
    e.0 = e.0.max(len);
    e.2 += 1;
}

fn unlist(start: u64) {
    let mut map = allocs().write();
    if let Some(e) = map.get_mut(&start) {
        e.2 -= 1;
        if e.2 == 0 {
            map.remove(&start);
        }
    }
}

/// The device ordinal of live device memory containing `addr`, if any.
pub(crate) fn ordinal_of(addr: u64) -> Option<usize> {
    let map = allocs().read();
    let (start, (len, ordinal, _)) = map.range(..=addr).next_back()?;
    (addr < start + (*len).max(1) as u64).then_some(*ordinal)
}

/// Device memory in the primary context of one device: `cuMemAlloc`ed here
/// ([`new`](Self::new)), or an engine's own allocation adopted ([`adopt`](Self::adopt): an
/// engine's KV tensor, after the driver confirmed the range), kept alive by its owner and
/// never freed here. Copies to and from either go through the same device paths.
pub struct CudaDeviceMemory {
    ptr: sys::CUdeviceptr,
    len: usize,
    device: Arc<CudaDevice>,
    held: Held,
}

/// Who frees a [`CudaDeviceMemory`]'s range.
enum Held {
    /// This value: `cuMemFree` on drop.
    Allocated,
    /// The owner, once every holder of it let go (see `crate::storage`'s `Owner`).
    Adopted(Owner),
}

impl std::fmt::Debug for CudaDeviceMemory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaDeviceMemory")
            .field("ptr", &format_args!("{:#x}", self.ptr))
            .field("len", &self.len)
            .field("ordinal", &self.device.ordinal())
            .field("adopted", &matches!(self.held, Held::Adopted(_)))
            .finish()
    }
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
        list(ptr, len, ordinal);
        Ok(CudaDeviceMemory {
            ptr,
            len,
            device,
            held: Held::Allocated,
        })
    }

    /// Adopts `len` bytes at device address `ptr` of device `ordinal`, kept alive by `owner`.
    ///
    /// # Errors
    /// `NotSupported` without a driver; `InvalidArgument` when the driver does not know the
    /// address, says it is not device memory, or of another device, or when the range leaves
    /// the allocation that holds `ptr`.
    ///
    /// # Safety
    /// The range must stay allocated, and not be reused, while `owner` is alive; nothing but
    /// kvbm's transfers may write it while a transfer that involves it runs.
    pub unsafe fn adopt(ptr: u64, len: usize, ordinal: usize, owner: Owner) -> Result<Self> {
        let device = CudaDevice::get(ordinal)?;
        device.bind()?;
        let refuse = |why: String| {
            Err(PhysicalError::InvalidArgument(format!(
                "adopting {len} bytes at {ptr:#x} on CUDA device {ordinal}: {why}"
            )))
        };
        // SAFETY: the memory type attribute is a 32-bit CUmemorytype.
        let kind: u32 = match unsafe { pointer_attribute(ptr, MEMORY_TYPE) } {
            Ok(k) => k,
            Err(e) => return refuse(format!("the driver does not know the address ({e:?})")),
        };
        if kind != sys::CUmemorytype::CU_MEMORYTYPE_DEVICE as u32 {
            return refuse(format!("memory type {kind}, not device memory"));
        }
        // SAFETY: the device ordinal attribute is an int.
        let dev: i32 = match unsafe { pointer_attribute(ptr, DEVICE_ORDINAL) } {
            Ok(d) => d,
            Err(e) => return refuse(format!("its device is unknown ({e:?})")),
        };
        if usize::try_from(dev).ok() != Some(ordinal) {
            return refuse(format!("it is memory of device {dev}"));
        }
        let (mut base, mut size): (sys::CUdeviceptr, usize) = (0, 0);
        // SAFETY: valid out-pointers; the driver reads `ptr`'s allocation.
        let r = unsafe { sys::cuMemGetAddressRange_v2(&mut base, &mut size, ptr) };
        if let Err(e) = r.result() {
            return refuse(format!("its allocation is unknown ({e:?})"));
        }
        if ptr
            .checked_add(len as u64)
            .is_none_or(|end| end > base + size as u64)
        {
            return refuse(format!(
                "the range leaves its allocation ({size} bytes at {base:#x})"
            ));
        }
        list(ptr, len, ordinal);
        Ok(CudaDeviceMemory {
            ptr,
            len,
            device,
            held: Held::Adopted(owner),
        })
    }

    /// The device this memory lives on.
    pub fn device(&self) -> &Arc<CudaDevice> {
        &self.device
    }

    /// What keeps adopted memory alive (`None`: allocated here).
    pub fn owner(&self) -> Option<&Owner> {
        match &self.held {
            Held::Allocated => None,
            Held::Adopted(o) => Some(o),
        }
    }
}

const MEMORY_TYPE: sys::CUpointer_attribute =
    sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_MEMORY_TYPE;
const DEVICE_ORDINAL: sys::CUpointer_attribute =
    sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL;

/// The driver's `attribute` of the pointer `ptr` (`cuPointerGetAttribute`).
///
/// # Safety
/// `T` must be the attribute's C type.
unsafe fn pointer_attribute<T: Default>(
    ptr: u64,
    attribute: sys::CUpointer_attribute,
) -> std::result::Result<T, sys::CUresult> {
    let mut value = T::default();
    // SAFETY: `value` is a valid out-pointer of the attribute's type (the caller's contract);
    // the driver only reads `ptr`'s attribute.
    let r = unsafe { sys::cuPointerGetAttribute((&mut value as *mut T).cast(), attribute, ptr) };
    match r {
        sys::CUresult::CUDA_SUCCESS => Ok(value),
        e => Err(e),
    }
}

impl Drop for CudaDeviceMemory {
    fn drop(&mut self) {
        unlist(self.ptr);
        // Adopted memory is the owner's to free, after this span lets go of it.
        if matches!(self.held, Held::Allocated) && self.device.bind().is_ok() {
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
