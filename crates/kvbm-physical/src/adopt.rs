//! Adopting an engine's KV tensors as a [`PhysicalLayout`]: the geometry read from the
//! tensors' shapes and strides, the memory kept alive by its owner.
//!
//! # What an engine hands over
//!
//! One tensor per layer of one KV-cache group (vLLM's `kv_caches`, per layer and per group:
//! adopt each group as its own layout), or one tensor holding every layer (a cross-layer
//! layout). The caller names which dimension counts blocks, which (if any) separates K from V,
//! which counts layers (one tensor for all of them) and which counts tokens; every other
//! dimension is a page's inner extent. [`KvDims`] says so; [`adopt_kv_tensors`] checks the
//! rest:
//!
//! * every tensor has the same shape, strides, element size and device, and no two overlap;
//! * a page (the tokens and inner dimensions) is dense in some order: its bytes are one
//!   contiguous run (PyTorch permutations such as vLLM's `HND` stride order are fine; a
//!   padded or sliced page is refused);
//! * blocks and K/V stack pages densely, in one of the orders kvbm's layouts have:
//!   `[blocks, kv, page]` (block-contiguous), `[kv, blocks, page]` (outer-contiguous, vLLM's
//!   FlashAttention `(2, num_blocks, ...)`), or with a layers dimension
//!   `[blocks, layers, kv, page]` (fully contiguous).
//!
//! Each refusal names the tensor and the rule. The result is an ordinary `PhysicalLayout`
//! (`Backing::Device`): registered with a transfer manager, it moves blocks to and from G2
//! like memory kvbm allocated, with no copy of the engine's cache.

use std::sync::Arc;

use crate::error::{PhysicalError, Result};
use crate::layout::{BlockDim, BlockLayout, LayoutKind};
use crate::physical::{Backing, PhysicalLayout};
use crate::storage::{
    DeviceMemory, HostStandInDevice, HostStorage, Owner, TensorDesc, TensorDevice,
};

/// Which dimension of the tensors means what (indices into [`TensorDesc::shape`]); every
/// dimension not named is part of a page's inner extent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvDims {
    /// Counts blocks.
    pub blocks: usize,
    /// Separates K from V (size 2); `None` for MLA's single latent.
    pub kv: Option<usize>,
    /// Counts layers, when one tensor holds every layer; `None` for one tensor per layer.
    pub layers: Option<usize>,
    /// Counts tokens in a block.
    pub tokens: usize,
}

impl KvDims {
    /// vLLM's FlashAttention cache, `(2, num_blocks, block_size, num_kv_heads, head_size)`.
    pub const FLASH_ATTN: KvDims = KvDims {
        blocks: 1,
        kv: Some(0),
        layers: None,
        tokens: 2,
    };
    /// vLLM's FlashInfer cache, `(num_blocks, 2, block_size, num_kv_heads, head_size)`.
    pub const FLASH_INFER: KvDims = KvDims {
        blocks: 0,
        kv: Some(1),
        layers: None,
        tokens: 2,
    };
    /// An MLA cache, `(num_blocks, block_size, head_size)`.
    pub const MLA: KvDims = KvDims {
        blocks: 0,
        kv: None,
        layers: None,
        tokens: 1,
    };
}

fn refuse<T>(tensor: usize, why: impl std::fmt::Display) -> Result<T> {
    Err(PhysicalError::InvalidLayout(format!(
        "adopted KV tensor {tensor}: {why}"
    )))
}

/// The layout `tensors` describe under `dims` (see the [module docs](self)), and each tensor's
/// span in bytes. Needs no memory: the rules alone.
pub fn kv_layout_of(tensors: &[TensorDesc], dims: KvDims) -> Result<(BlockLayout, usize)> {
    let Some(t0) = tensors.first() else {
        return Err(PhysicalError::InvalidLayout(
            "adopted KV tensors: none given".into(),
        ));
    };
    let rank = t0.shape.len();
    let named = [Some(dims.blocks), dims.kv, dims.layers, Some(dims.tokens)];
    for d in named.iter().flatten() {
        if *d >= rank {
            return refuse(0, format!("dimension {d} named, but it has {rank}"));
        }
    }
    let mut seen = vec![false; rank];
    for d in named.iter().flatten() {
        if std::mem::replace(&mut seen[*d], true) {
            return refuse(0, format!("dimension {d} named twice"));
        }
    }
    let span = t0.span_bytes().or_else(|e| refuse(0, e))?;
    for (i, t) in tensors.iter().enumerate().skip(1) {
        if t.shape != t0.shape || t.strides != t0.strides {
            return refuse(
                i,
                format!(
                    "shape {:?} strides {:?}, tensor 0 has {:?} {:?}",
                    t.shape, t.strides, t0.shape, t0.strides
                ),
            );
        }
        if t.elem_bytes != t0.elem_bytes || t.device != t0.device {
            return refuse(
                i,
                format!(
                    "{}-byte elements on {:?}, tensor 0 has {}-byte elements on {:?}",
                    t.elem_bytes, t.device, t0.elem_bytes, t0.device
                ),
            );
        }
        t.span_bytes().or_else(|e| refuse(i, e))?;
    }
    let mut by_addr: Vec<(u64, usize)> = tensors.iter().map(|t| t.addr).zip(0..).collect();
    by_addr.sort_unstable();
    for w in by_addr.windows(2) {
        if w[0].0 + span as u64 > w[1].0 {
            return refuse(w[1].1, format!("it overlaps tensor {}", w[0].1));
        }
    }
    if dims.layers.is_some() && tensors.len() != 1 {
        return refuse(
            1,
            "a layers dimension was named, so one tensor holds every layer",
        );
    }

    // The page: every unnamed dimension and the tokens, dense in stride order.
    let (shape, strides) = (&t0.shape, &t0.strides);
    let mut page: Vec<usize> = (0..rank)
        .filter(|&d| d == dims.tokens || !seen[d])
        .filter(|&d| shape[d] > 1)
        .collect();
    page.sort_by_key(|&d| std::cmp::Reverse(strides[d]));
    let mut elems = 1usize;
    for &d in page.iter().rev() {
        if strides[d] != elems {
            return refuse(
                0,
                format!(
                    "its page is not dense: dimension {d} has stride {}, {elems} expected \
                     (padded or sliced pages cannot be adopted)",
                    strides[d]
                ),
            );
        }
        elems *= shape[d];
    }
    let tokens = shape[dims.tokens];
    let inner = elems / tokens;

    // Blocks, K/V and layers stacked densely above the page.
    let size = |d: Option<usize>| d.map_or(1, |d| shape[d]);
    let stride = |d: Option<usize>| d.filter(|&d| shape[d] > 1).map(|d| strides[d]);
    let (nb, nkv, nl) = (shape[dims.blocks], size(dims.kv), size(dims.layers));
    let blocks = if nb > 1 {
        Some(strides[dims.blocks])
    } else {
        None
    };
    let (kv, layers) = (stride(dims.kv), stride(dims.layers));
    let dense = |s: Option<usize>, want: usize| s.is_none_or(|s| s == want);
    let kind = if dims.layers.is_some() {
        // [blocks, layers, kv, page]
        if !(dense(kv, elems) && dense(layers, nkv * elems) && dense(blocks, nl * nkv * elems)) {
            return refuse(
                0,
                format!(
                    "strides {strides:?} are not [blocks, layers, kv, page] with dense pages \
                     of {elems} elements"
                ),
            );
        }
        LayoutKind::FullyContiguous
    } else if dense(kv, elems) && dense(blocks, nkv * elems) {
        LayoutKind::LayerSeparate(BlockDim::BlockContiguous)
    } else if dense(blocks, elems) && dense(kv, nb * elems) {
        LayoutKind::LayerSeparate(BlockDim::OuterContiguous)
    } else {
        return refuse(
            0,
            format!(
                "strides {strides:?} stack blocks and K/V neither as [blocks, kv, page] nor as \
                 [kv, blocks, page] with dense pages of {elems} elements"
            ),
        );
    };
    let layout = BlockLayout::builder()
        .num_blocks(nb)
        .num_layers(if dims.layers.is_some() {
            nl
        } else {
            tensors.len()
        })
        .outer_dim(nkv)
        .page_size(tokens)
        .inner_dim(inner)
        .dtype_bytes(t0.elem_bytes)
        .kind(kind)
        .build()?;
    debug_assert_eq!(layout.allocation_bytes(), span);
    Ok((layout, span))
}

/// Adopts `tensors` (see the [module docs](self)) as a layout over their memory, kept alive by
/// `owner` until the layout and every transfer using it are gone.
///
/// # Errors
/// `InvalidLayout` naming the tensor and the rule it breaks; for device tensors,
/// `NotSupported` without feature `cuda` or a driver, and `InvalidArgument` when the driver
/// does not confirm a tensor's range is memory of its device.
///
/// # Safety
/// Each tensor's span must be memory that stays allocated, unmoved, while `owner` lives (host
/// memory for [`TensorDevice::Host`], memory of that device for [`TensorDevice::Cuda`]), and
/// the engine must not write the blocks a transfer reads, nor touch the blocks it writes,
/// while it runs (what every layout's memory promises).
pub unsafe fn adopt_kv_tensors(
    tensors: &[TensorDesc],
    dims: KvDims,
    owner: Owner,
) -> Result<PhysicalLayout> {
    let (layout, span) = kv_layout_of(tensors, dims)?;
    let allocs = tensors
        .iter()
        .map(|t| -> Result<Arc<dyn DeviceMemory>> {
            match t.device {
                TensorDevice::Host => {
                    // SAFETY: the caller's contract, per tensor.
                    let mem = unsafe {
                        HostStorage::external(t.addr as *mut u8, span, Box::new(owner.clone()))
                    }?;
                    Ok(Arc::new(HostStandInDevice::over(mem)))
                }
                TensorDevice::Cuda(ordinal) => adopt_cuda(t.addr, span, ordinal, owner.clone()),
            }
        })
        .collect::<Result<Vec<_>>>()?;
    PhysicalLayout::from_backing(layout, Backing::Device(allocs))
}

#[cfg(feature = "cuda")]
fn adopt_cuda(
    addr: u64,
    len: usize,
    ordinal: usize,
    owner: Owner,
) -> Result<Arc<dyn DeviceMemory>> {
    if !crate::cuda::cuda_available() {
        return Err(no_driver(ordinal));
    }
    // SAFETY: `adopt_kv_tensors`' caller's contract.
    Ok(Arc::new(unsafe {
        crate::cuda::CudaDeviceMemory::adopt(addr, len, ordinal, owner)
    }?))
}

#[cfg(not(feature = "cuda"))]
fn adopt_cuda(_: u64, _: usize, ordinal: usize, _: Owner) -> Result<Arc<dyn DeviceMemory>> {
    Err(no_driver(ordinal))
}

fn no_driver(ordinal: usize) -> PhysicalError {
    PhysicalError::NotSupported(format!(
        "adopting memory of CUDA device {ordinal} needs kvbm built with feature `cuda` and a \
         CUDA driver (libcuda) on this machine{}",
        if cfg!(feature = "cuda") {
            ": no driver could be loaded"
        } else {
            ": this build has no `cuda` feature"
        }
    ))
}

#[cfg(test)]
mod tests;
