//! Test support for users of this crate (feature `testing`): workers whose every tier is host
//! memory. (kvbm-cluster's `testing` wraps them in a `MockWorker` that fails on command.)
//!
//! # Why
//!
//! A scheduler or connector built on the engine wants to test its own failure handling
//! without GPUs, disks or a NATS server. Everything here moves real bytes through a real
//! `TransferManager` in host memory, so a test still sees transfers succeed or fail for real.

use std::sync::Arc;

use kvbm_logical::TierId;
use kvbm_physical::{BlockLayout, LayoutKind, PhysicalLayout, PinPolicy, TransferManager};

use crate::error::{EngineError, Result};
use crate::worker::PhysicalWorker;

/// A small fully contiguous geometry: `num_blocks` blocks of 2 layers × 2 × 16 tokens × 64 ×
/// 2 bytes (8 KiB a block).
///
/// # Errors
/// [`EngineError::Config`] (key `layout`) for zero blocks.
pub fn small_geometry(num_blocks: usize) -> Result<BlockLayout> {
    BlockLayout::builder()
        .num_blocks(num_blocks)
        .num_layers(2)
        .outer_dim(2)
        .page_size(16)
        .inner_dim(64)
        .dtype_bytes(2)
        .kind(LayoutKind::FullyContiguous)
        .build()
        .map_err(|e| EngineError::config("layout", e.to_string()))
}

/// Rank `rank` with a host-memory layout of `geometry` for each of `tiers` (in-memory tiers:
/// G1, G2, even G3/G4 stand-ins), on its own transfer manager.
///
/// # Errors
/// [`EngineError::Config`] (key `layout`) when memory cannot be allocated or registered.
pub fn host_worker(rank: usize, geometry: BlockLayout, tiers: &[TierId]) -> Result<PhysicalWorker> {
    let err = |e: &dyn std::fmt::Display| EngineError::config("layout", e.to_string());
    let tm = Arc::new(TransferManager::new().map_err(|e| err(&e))?);
    let mut w = PhysicalWorker::new(rank, tm.clone());
    for &t in tiers {
        let layout =
            PhysicalLayout::allocate_host(geometry, PinPolicy::Unpinned).map_err(|e| err(&e))?;
        w = w.with_layout(t, tm.register_layout(layout).map_err(|e| err(&e))?);
    }
    Ok(w)
}
