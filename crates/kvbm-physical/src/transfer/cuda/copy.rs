//! Copy planning (pure, tested without a GPU) and batched submission onto a stream.
//!
//! Planning: every `(src block, dst block)` pair is expanded into its region pairs for the
//! requested layers (walking both sides' region lists in the largest common chunks, so a
//! fully contiguous block against a layer-separate one yields one piece per layer region),
//! the pieces are sorted by destination address, and pieces contiguous on *both* sides are
//! merged. Runs of consecutive block ids in fully contiguous layouts become one copy; in
//! layer-separate layouts each layer's run becomes one copy when both sides are laid out
//! block-contiguously per layer.
//!
//! Submission: all pieces of a transfer go to one stream, through one `cuMemcpyBatchAsync`
//! call per [`MAX_BATCH`] pieces where the driver exports it (CUDA ≥ 12.8, probed by symbol:
//! `cuMemcpyBatchAsync_v2` on 13.x drivers, else the 12.8 `cuMemcpyBatchAsync`), otherwise
//! one `cuMemcpyAsync` per piece. A single piece always uses `cuMemcpyAsync`. Should a batched
//! call fail, the batched API is turned off for the process (logged once) and the remaining
//! pieces go one by one, so an unexpected driver ABI cannot break transfers.

use std::sync::OnceLock;
use std::sync::atomic::{AtomicU8, Ordering};

use cudarc::driver::sys;

use crate::cuda::context::cuda_err;
use crate::error::Result;
use crate::layout::region_pairs;
use crate::physical::PhysicalLayout;
use crate::transfer::BlockId;

/// Most pieces handed to one batched-copy call.
pub const MAX_BATCH: usize = 4096;

/// One contiguous copy: UVA addresses (device pointers or host pointers).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Piece {
    /// Source address.
    pub src: u64,
    /// Destination address.
    pub dst: u64,
    /// Bytes.
    pub len: usize,
}

/// Expands block pairs into coalesced copy pieces (see the module docs).
pub fn plan(
    src: &PhysicalLayout,
    dst: &PhysicalLayout,
    src_ids: &[BlockId],
    dst_ids: &[BlockId],
    layers: std::ops::Range<usize>,
) -> Vec<Piece> {
    let mut pieces = Vec::new();
    for (&s, &d) in src_ids.iter().zip(dst_ids) {
        let sr = src.block_addrs(s, layers.clone());
        let dr = dst.block_addrs(d, layers.clone());
        pieces.extend(region_pairs(&sr, &dr).map(|(s, d, len)| Piece {
            src: s as u64,
            dst: d as u64,
            len,
        }));
    }
    coalesce(pieces)
}

/// Sorts by destination and merges pieces contiguous on both sides.
pub fn coalesce(mut pieces: Vec<Piece>) -> Vec<Piece> {
    pieces.sort_unstable_by_key(|p| p.dst);
    let mut out: Vec<Piece> = Vec::with_capacity(pieces.len());
    for p in pieces {
        match out.last_mut() {
            Some(l) if l.dst + l.len as u64 == p.dst && l.src + l.len as u64 == p.src => {
                l.len += p.len
            }
            _ => out.push(p),
        }
    }
    out
}

/// How pieces are submitted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CopyMode {
    /// The batched copy API when the driver has it, else per-piece copies. Default.
    Auto,
    /// Always one `cuMemcpyAsync` per piece (for comparison in the benchmark).
    PerPiece,
}

static MODE: AtomicU8 = AtomicU8::new(0);

/// Sets the process-wide copy mode (the benchmark compares both).
pub fn set_copy_mode(mode: CopyMode) {
    MODE.store(mode as u8, Ordering::Relaxed);
}

fn mode() -> CopyMode {
    if MODE.load(Ordering::Relaxed) == CopyMode::PerPiece as u8 {
        CopyMode::PerPiece
    } else {
        CopyMode::Auto
    }
}

type BatchV2 = unsafe extern "C" fn(
    *mut sys::CUdeviceptr,
    *mut sys::CUdeviceptr,
    *mut usize,
    usize,
    *mut sys::CUmemcpyAttributes,
    *mut usize,
    usize,
    sys::CUstream,
) -> sys::CUresult;
type BatchV1 = unsafe extern "C" fn(
    *mut sys::CUdeviceptr,
    *mut sys::CUdeviceptr,
    *mut usize,
    usize,
    *mut sys::CUmemcpyAttributes,
    *mut usize,
    usize,
    *mut usize,
    sys::CUstream,
) -> sys::CUresult;

#[derive(Clone, Copy)]
enum BatchFn {
    V2(BatchV2),
    V1(BatchV1),
}

/// The driver's batched-copy entry point, probed once by symbol (a missing symbol would make
/// cudarc's own wrapper panic).
fn batch_fn() -> Option<BatchFn> {
    static F: OnceLock<Option<BatchFn>> = OnceLock::new();
    *F.get_or_init(|| {
        if !crate::cuda::cuda_available() {
            return None;
        }
        // SAFETY: the library is present (checked above); the symbols' C signatures are the
        // CUDA 13.0 (`_v2`) and 12.8 ones declared above.
        unsafe {
            let lib = sys::culib();
            if let Ok(f) = lib.get::<BatchV2>(b"cuMemcpyBatchAsync_v2") {
                return Some(BatchFn::V2(*f));
            }
            if let Ok(f) = lib.get::<BatchV1>(b"cuMemcpyBatchAsync") {
                return Some(BatchFn::V1(*f));
            }
        }
        None
    })
}

/// Which batched API this driver offers: `"cuMemcpyBatchAsync_v2"`, `"cuMemcpyBatchAsync"`
/// or `"none"` (per-piece copies).
pub fn batch_api() -> &'static str {
    match batch_fn() {
        Some(BatchFn::V2(_)) => "cuMemcpyBatchAsync_v2",
        Some(BatchFn::V1(_)) => "cuMemcpyBatchAsync",
        None => "none",
    }
}

/// Enqueues `pieces` on `stream`; returns the number of driver calls made.
///
/// # Safety
/// The stream's context must be current; every piece must name live, UVA-addressable memory
/// that stays alive and unaccessed by others until the stream passes this point.
pub unsafe fn submit(pieces: &[Piece], stream: sys::CUstream) -> Result<usize> {
    let batch = match (mode(), pieces.len()) {
        (CopyMode::Auto, 2..) if !batch_disabled() => batch_fn(),
        _ => None,
    };
    let Some(f) = batch else {
        // SAFETY: per the caller.
        return unsafe { submit_each(pieces, stream) };
    };
    let mut calls = 0;
    for (ci, chunk) in pieces.chunks(MAX_BATCH).enumerate() {
        let mut dsts: Vec<sys::CUdeviceptr> = chunk.iter().map(|p| p.dst).collect();
        let mut srcs: Vec<sys::CUdeviceptr> = chunk.iter().map(|p| p.src).collect();
        let mut sizes: Vec<usize> = chunk.iter().map(|p| p.len).collect();
        // SAFETY: an all-zero attribute struct is valid (invalid location hints, which are
        // ignored for non-managed memory); the fields that matter are set below.
        let mut attr: sys::CUmemcpyAttributes = unsafe { std::mem::zeroed() };
        attr.srcAccessOrder = sys::CUmemcpySrcAccessOrder::CU_MEMCPY_SRC_ACCESS_ORDER_STREAM;
        attr.flags = sys::CUmemcpyFlags::CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE as u32;
        let mut idx: usize = 0;
        let mut fail: usize = usize::MAX;
        // SAFETY: arrays of `chunk.len()` entries, one attribute applying from index 0; the
        // pointers are valid per the caller.
        let r = unsafe {
            match f {
                BatchFn::V2(f) => f(
                    dsts.as_mut_ptr(),
                    srcs.as_mut_ptr(),
                    sizes.as_mut_ptr(),
                    chunk.len(),
                    &mut attr,
                    &mut idx,
                    1,
                    stream,
                ),
                BatchFn::V1(f) => f(
                    dsts.as_mut_ptr(),
                    srcs.as_mut_ptr(),
                    sizes.as_mut_ptr(),
                    chunk.len(),
                    &mut attr,
                    &mut idx,
                    1,
                    &mut fail,
                    stream,
                ),
            }
        };
        if let Err(e) = r.result() {
            // The batched API refused (an ABI or driver surprise): turn it off for the process
            // and copy this chunk and the rest one piece at a time. Re-copying pieces the
            // failed call may already have done is harmless (same bytes, same place).
            BATCH_DISABLED.store(true, Ordering::Relaxed);
            tracing::warn!(
                error = ?e,
                fail_index = fail,
                "cuMemcpyBatchAsync failed; falling back to one cuMemcpyAsync per piece"
            );
            let rest = &pieces[ci * MAX_BATCH..];
            // SAFETY: per the caller.
            return unsafe { submit_each(rest, stream) }.map(|n| calls + n);
        }
        calls += 1;
    }
    Ok(calls)
}

/// Set when a batched call failed; later submissions go piece by piece.
static BATCH_DISABLED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Whether the batched API was turned off after a failure.
pub fn batch_disabled() -> bool {
    BATCH_DISABLED.load(Ordering::Relaxed)
}

/// # Safety
/// As [`submit`].
unsafe fn submit_each(pieces: &[Piece], stream: sys::CUstream) -> Result<usize> {
    for p in pieces {
        // SAFETY: per the caller.
        unsafe { sys::cuMemcpyAsync(p.dst, p.src, p.len, stream) }
            .result()
            .map_err(|e| cuda_err("cuMemcpyAsync", e))?;
    }
    Ok(pieces.len())
}
