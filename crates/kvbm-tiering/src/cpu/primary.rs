//! `CpuPrimaryTier`: the CPU manager plus the pinned host memory its slots name
//! (vLLM `CPUPrimaryTierOffloadingManager` over `SharedOffloadRegion`).
//!
//! Slot `c` is block `c` of a fully contiguous [`kvbm_physical::PhysicalLayout`] in host memory
//! (page-aligned, `mlock`-pinned when allowed), so secondary tiers and workers can move its bytes
//! with kvbm-physical's transfer manager. Read/write name secondary-tier traffic (primary →
//! secondary is a *read* of the primary, secondary → primary a *write*); load/store name GPU
//! traffic. `prepare_read` pins without recording request recency (a cascade is not an access).

use std::sync::Arc;

use kvbm_physical::{BlockLayout, PhysicalLayout, PinPolicy};

use crate::cpu::manager::{CpuManagerConfig, CpuOffloadingManager};
use crate::error::Result;
use crate::key::OffloadKey;
use crate::types::{LoadStoreSpec, PrepareStoreOutput, ReqContext};

/// vLLM's `CPUPrimaryTierOffloadingManager`.
pub struct CpuPrimaryTier {
    manager: CpuOffloadingManager,
    memory: Option<Arc<PhysicalLayout>>,
    chunk_bytes: usize,
}

impl CpuPrimaryTier {
    /// A primary tier whose `config.num_chunks` slots are `chunk_bytes` each of pinned host memory.
    pub fn new(config: CpuManagerConfig, chunk_bytes: usize) -> Result<Self> {
        let layout = BlockLayout::builder()
            .num_blocks(config.num_chunks.max(1))
            .num_layers(1)
            .outer_dim(1)
            .page_size(1)
            .inner_dim(chunk_bytes)
            .dtype_bytes(1)
            .build()?;
        let memory = PhysicalLayout::allocate_host(layout, PinPolicy::TryPin)?;
        Ok(Self {
            manager: CpuOffloadingManager::new(config),
            memory: Some(Arc::new(memory)),
            chunk_bytes,
        })
    }

    /// The bookkeeping half.
    pub fn manager(&self) -> &CpuOffloadingManager {
        &self.manager
    }

    /// The bookkeeping half, mutably (GPU-facing `OffloadingManager` calls).
    pub fn manager_mut(&mut self) -> &mut CpuOffloadingManager {
        &mut self.manager
    }

    /// The host memory backing the slots (`None` after shutdown).
    pub fn memory(&self) -> Option<&Arc<PhysicalLayout>> {
        self.memory.as_ref()
    }

    /// Bytes per slot (the row stride secondary tiers address).
    pub fn chunk_bytes(&self) -> usize {
        self.chunk_bytes
    }

    /// Pins chunks for a primary → secondary copy, without recording request recency.
    pub fn prepare_read(&mut self, keys: &[OffloadKey], ctx: &ReqContext) -> Result<LoadStoreSpec> {
        self.manager
            .prepare_load_inner("prepare_read", keys, ctx, false)
    }

    /// `prepare_read` of keys already checked resident and ready (one probe per key).
    pub(crate) fn prepare_read_ready(&mut self, keys: &[OffloadKey]) -> Vec<i32> {
        self.manager.pin_ready(keys)
    }

    /// Unpins chunks after a primary → secondary copy.
    pub fn complete_read(&mut self, keys: &[OffloadKey]) -> Result<()> {
        self.manager.complete_load_inner("complete_read", keys)
    }

    /// Reserves slots for a secondary → primary copy (promotion); `None` when full.
    pub fn prepare_write(
        &mut self,
        keys: &[OffloadKey],
        ctx: &ReqContext,
    ) -> Option<PrepareStoreOutput> {
        self.manager.store_inner(keys, ctx)
    }

    /// Completes a promotion write (success makes the keys loadable, failure frees the slots).
    pub fn complete_write(&mut self, keys: &[OffloadKey], success: bool) {
        self.manager.complete_store_inner(keys, success)
    }

    /// Releases the memory (after every secondary tier stopped touching it).
    pub fn shutdown(&mut self) {
        self.memory = None;
    }
}
