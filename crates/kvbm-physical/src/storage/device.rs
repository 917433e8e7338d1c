//! G1 device memory behind one trait, with a host-memory stand-in.
//!
//! [`DeviceMemory`] is what the transfer manager needs from a GPU allocation: its device address
//! range and three synchronous copy primitives. Under feature `cuda`, with a driver present
//! (checked with `cudarc::driver::sys::is_culib_present()` before any call: cudarc panics
//! rather than erroring without one), `PhysicalLayout::allocate_device` gets real device memory
//! from `crate::cuda`; otherwise a [`HostStandInDevice`], so every layer above can run and be
//! tested on a CPU-only machine. This module defines what device memory is and knows nothing of
//! CUDA (`cuda` depends on it, not the other way).

use crate::error::Result;
use crate::storage::{HostStorage, PinPolicy, Storage, StorageKind};

/// A device allocation.
///
/// Addresses are device addresses (`CUdeviceptr`); for the stand-in they are host addresses.
pub trait DeviceMemory: Storage {
    /// Device address of the first byte.
    fn device_addr(&self) -> u64;
    /// `true` for the host-memory stand-in.
    fn is_stand_in(&self) -> bool;
    /// Copies `len` host bytes at `src` to device address `dst`.
    ///
    /// # Safety
    /// `src..src+len` must be readable host memory; `dst..dst+len` must lie inside this
    /// allocation and not be accessed by anyone else during the copy.
    unsafe fn copy_h2d(&self, dst: u64, src: *const u8, len: usize) -> Result<()>;
    /// Copies `len` bytes at device address `src` to host memory at `dst`.
    ///
    /// # Safety
    /// As [`DeviceMemory::copy_h2d`], mirrored.
    unsafe fn copy_d2h(&self, dst: *mut u8, src: u64, len: usize) -> Result<()>;
    /// Copies `len` bytes between device addresses on this device.
    ///
    /// # Safety
    /// Both ranges must be valid device memory on this device and not overlap.
    unsafe fn copy_d2d(&self, dst: u64, src: u64, len: usize) -> Result<()>;
}

/// Host memory standing in for a GPU allocation.
#[derive(Debug)]
pub struct HostStandInDevice {
    mem: HostStorage,
}

impl HostStandInDevice {
    /// Allocates `len` bytes of (unpinned) host memory.
    pub fn new(len: usize) -> Result<Self> {
        Ok(HostStandInDevice {
            mem: HostStorage::new(len, PinPolicy::Unpinned)?,
        })
    }

    /// Host memory that already exists (an engine's CPU KV tensor adopted with
    /// [`HostStorage::external`]) as the stand-in.
    pub fn over(mem: HostStorage) -> Self {
        HostStandInDevice { mem }
    }
}

impl Storage for HostStandInDevice {
    fn kind(&self) -> StorageKind {
        StorageKind::Device
    }
    fn size_bytes(&self) -> usize {
        self.mem.len()
    }
}

impl DeviceMemory for HostStandInDevice {
    fn device_addr(&self) -> u64 {
        self.mem.as_ptr() as u64
    }
    fn is_stand_in(&self) -> bool {
        true
    }
    unsafe fn copy_h2d(&self, dst: u64, src: *const u8, len: usize) -> Result<()> {
        // SAFETY: forwarded from the caller's contract.
        unsafe { std::ptr::copy_nonoverlapping(src, dst as *mut u8, len) };
        Ok(())
    }
    unsafe fn copy_d2h(&self, dst: *mut u8, src: u64, len: usize) -> Result<()> {
        // SAFETY: forwarded from the caller's contract.
        unsafe { std::ptr::copy_nonoverlapping(src as *const u8, dst, len) };
        Ok(())
    }
    unsafe fn copy_d2d(&self, dst: u64, src: u64, len: usize) -> Result<()> {
        // SAFETY: forwarded from the caller's contract.
        unsafe { std::ptr::copy_nonoverlapping(src as *const u8, dst as *mut u8, len) };
        Ok(())
    }
}
