//! Memory kvbm did not allocate: an inference engine's KV tensors, described as their owner
//! describes them, and kept alive by it.
//!
//! # Why
//!
//! An engine that brings its own KV cache (vLLM's `kv_caches`, handed to the offloading
//! worker by `get_worker(kv_caches)`) owns G1: kvbm must move blocks in and out of those
//! tensors, not of memory it allocated itself. A [`TensorDesc`] is what such an owner can say
//! about a tensor (PyTorch's `data_ptr()`, `shape`, `stride()`, `element_size()`, `device`);
//! `crate::adopt` turns a set of them into a [`PhysicalLayout`](crate::PhysicalLayout) over
//! that memory.
//!
//! # Lifetime
//!
//! Every adopted span holds an [`Owner`] (any `Arc` the caller chooses: the tensors
//! themselves, a Python reference, the engine's allocator) and drops it only when the span is
//! dropped. A layout keeps its spans while it is registered, and a transfer keeps its layouts
//! until its copies completed, so the owner's memory outlives every copy that touches it. The
//! owner promises the memory is not freed or moved while it is held (PyTorch frees a tensor's
//! storage only when its last reference goes).
//!
//! # Where the memory is
//!
//! [`TensorDevice::Host`] spans are ordinary host memory
//! ([`HostStorage::external`](crate::HostStorage::external)) under the host stand-in of device
//! memory ([`HostStandInDevice::over`](crate::HostStandInDevice::over)): what a CPU-only
//! engine, and every test without a GPU, adopts.
//! [`TensorDevice::Cuda`] spans are adopted by `crate::cuda` (feature `cuda`, a driver
//! present), which checks with the driver that the range is device memory of that ordinal
//! inside one allocation before anything uses it; this module knows nothing of CUDA.

use std::any::Any;
use std::sync::Arc;

use crate::error::{PhysicalError, Result};

/// What keeps adopted memory alive: held by every span cut from it, dropped with the last.
pub type Owner = Arc<dyn Any + Send + Sync>;

/// Where a tensor's memory is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TensorDevice {
    /// Host memory (a CPU tensor).
    Host,
    /// Memory of CUDA device `ordinal`.
    Cuda(usize),
}

/// One tensor as its owner describes it: the address of element 0, the shape and strides in
/// elements (PyTorch's `stride()`), the bytes per element and the device.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorDesc {
    /// Address of the first element (a device address for [`TensorDevice::Cuda`]).
    pub addr: u64,
    /// Size of each dimension.
    pub shape: Vec<usize>,
    /// Stride of each dimension, in elements.
    pub strides: Vec<usize>,
    /// Bytes per element.
    pub elem_bytes: usize,
    /// Where the memory is.
    pub device: TensorDevice,
}

impl TensorDesc {
    /// A C-contiguous (row-major, dense) tensor of `shape` at `addr`.
    pub fn contiguous(addr: u64, shape: &[usize], elem_bytes: usize, device: TensorDevice) -> Self {
        let mut strides = vec![1; shape.len()];
        for d in (0..shape.len().saturating_sub(1)).rev() {
            strides[d] = strides[d + 1] * shape[d + 1].max(1);
        }
        TensorDesc {
            addr,
            shape: shape.to_vec(),
            strides,
            elem_bytes,
            device,
        }
    }

    /// Checks what holds for any tensor: as many strides as dimensions, no empty dimension, a
    /// non-zero element size, an aligned non-null address, and a span that fits the address
    /// space. Returns the span's length in bytes (from `addr` to one past the last element).
    pub fn span_bytes(&self) -> Result<usize> {
        let bad = |why: String| Err(PhysicalError::InvalidArgument(format!("tensor: {why}")));
        if self.shape.len() != self.strides.len() {
            return bad(format!(
                "{} dimensions but {} strides",
                self.shape.len(),
                self.strides.len()
            ));
        }
        if self.elem_bytes == 0 {
            return bad("element size 0".into());
        }
        if self.addr == 0 {
            return bad("null address".into());
        }
        if !self.addr.is_multiple_of(self.elem_bytes as u64) {
            return bad(format!(
                "address {:#x} is not aligned to its {}-byte elements",
                self.addr, self.elem_bytes
            ));
        }
        if let Some(d) = self.shape.iter().position(|&s| s == 0) {
            return bad(format!("dimension {d} is empty"));
        }
        let mut last = 0usize;
        for (&n, &s) in self.shape.iter().zip(&self.strides) {
            last = (n - 1)
                .checked_mul(s)
                .and_then(|x| x.checked_add(last))
                .ok_or_else(|| PhysicalError::InvalidArgument("tensor: span overflows".into()))?;
        }
        let len = (last + 1)
            .checked_mul(self.elem_bytes)
            .filter(|len| self.addr.checked_add(*len as u64).is_some())
            .ok_or_else(|| PhysicalError::InvalidArgument("tensor: span overflows".into()))?;
        Ok(len)
    }
}
