//! `CpuPrimaryTier`: the CPU manager plus the pinned host memory its slots name
//! (vLLM `CPUPrimaryTierOffloadingManager` over `SharedOffloadRegion`).
//!
//! Slot `c` is block `c` of a fully contiguous [`kvbm_physical::PhysicalLayout`] in host memory
//! (page-aligned, `mlock`-pinned when allowed), so secondary tiers and workers can move its bytes
//! with kvbm-physical's transfer manager. Read/write name secondary-tier traffic (primary →
//! secondary is a *read* of the primary, secondary → primary a *write*); load/store name GPU
//! traffic. `prepare_read` pins without recording request recency (a cascade is not an access).

use std::sync::Arc;

use kvbm_physical::{BlockLayout, LayoutHandle, PhysicalLayout, PinPolicy, TransferManager};

use crate::cpu::manager::{CpuManagerConfig, CpuOffloadingManager};
use crate::error::{Result, TieringError};
use crate::key::OffloadKey;
use crate::types::{LoadStoreSpec, PrepareStoreOutput, ReqContext};

/// vLLM's `CPUPrimaryTierOffloadingManager`.
pub struct CpuPrimaryTier {
    manager: CpuOffloadingManager,
    memory: Option<Arc<PhysicalLayout>>,
    chunk_bytes: usize,
    transfer: Option<(Arc<TransferManager>, LayoutHandle)>,
}

impl CpuPrimaryTier {
    /// A primary tier whose `config.num_chunks` slots are `chunk_bytes` each of pinned host memory.
    pub fn new(config: CpuManagerConfig, chunk_bytes: usize) -> Result<Self> {
        let layout = Self::block_layout(config.num_chunks.max(1), chunk_bytes)?;
        let memory = PhysicalLayout::allocate_host(layout, PinPolicy::TryPin)?;
        Ok(Self {
            manager: CpuOffloadingManager::new(config),
            memory: Some(Arc::new(memory)),
            chunk_bytes,
            transfer: None,
        })
    }

    /// A primary tier that keeps the slot table only: its `chunk_bytes` chunks live in memory
    /// the caller owns and its secondary tiers reach on their own (vLLM's region, which
    /// kvbm-vllm's tiers register once and share). [`Self::memory`] is `None`.
    pub fn without_memory(config: CpuManagerConfig, chunk_bytes: usize) -> Self {
        Self {
            manager: CpuOffloadingManager::new(config),
            memory: None,
            chunk_bytes,
            transfer: None,
        }
    }

    /// As [`Self::new`], with the memory registered in `tm` so secondary tiers can move its bytes.
    pub fn with_transfer_manager(
        config: CpuManagerConfig,
        chunk_bytes: usize,
        tm: Arc<TransferManager>,
    ) -> Result<Self> {
        let layout = Self::block_layout(config.num_chunks.max(1), chunk_bytes)?;
        let handle =
            tm.register_layout(PhysicalLayout::allocate_host(layout, PinPolicy::TryPin)?)?;
        let memory = tm.layout(handle)?;
        Ok(Self {
            manager: CpuOffloadingManager::new(config),
            memory: Some(memory),
            chunk_bytes,
            transfer: Some((tm, handle)),
        })
    }

    /// As [`Self::with_transfer_manager`], over host memory the caller provides (e.g. an
    /// inference engine's own offload region, wrapped with
    /// [`HostStorage::external`](kvbm_physical::HostStorage::external)): `memory` must be
    /// `config.num_chunks` chunks of `chunk_bytes`, in one allocation, chunk `i` at
    /// `i * chunk_bytes`.
    ///
    /// # Errors
    /// [`TieringError::Physical`](crate::TieringError) when the memory is too small for the
    /// chunks or cannot be registered.
    pub fn over_memory(
        config: CpuManagerConfig,
        chunk_bytes: usize,
        tm: Arc<TransferManager>,
        memory: Arc<kvbm_physical::HostStorage>,
    ) -> Result<Self> {
        let layout = Self::block_layout(config.num_chunks.max(1), chunk_bytes)?;
        let physical =
            PhysicalLayout::from_backing(layout, kvbm_physical::Backing::Host(vec![memory]))?;
        let handle = tm.register_layout(physical)?;
        let memory = tm.layout(handle)?;
        Ok(Self {
            manager: CpuOffloadingManager::new(config),
            memory: Some(memory),
            chunk_bytes,
            transfer: Some((tm, handle)),
        })
    }

    /// The geometry of `n` chunks of `chunk_bytes` (one layer, one outer slice, bytes).
    pub fn block_layout(n: usize, chunk_bytes: usize) -> Result<BlockLayout> {
        Ok(BlockLayout::builder()
            .num_blocks(n)
            .num_layers(1)
            .outer_dim(1)
            .page_size(1)
            .inner_dim(chunk_bytes)
            .dtype_bytes(1)
            .build()?)
    }

    /// The transfer manager and handle the memory is registered under, if any.
    pub fn transfer(&self) -> Option<(&Arc<TransferManager>, LayoutHandle)> {
        self.transfer.as_ref().map(|(t, h)| (t, *h))
    }

    fn slot_ptr(
        &self,
        call: &'static str,
        key: &OffloadKey,
        want_pending: bool,
    ) -> Result<*mut u8> {
        let (slot, rc) = self
            .manager
            .chunk(key)
            .ok_or(TieringError::UnknownKey { call, key: *key })?;
        if want_pending != (rc < 0) {
            return Err(TieringError::KeyState {
                call,
                key: *key,
                state: if want_pending {
                    "not being written (no prepare_store outstanding)"
                } else {
                    "not ready (write in flight)"
                },
            });
        }
        let mem = self
            .memory
            .as_ref()
            .ok_or(TieringError::Shutdown { call })?;
        let addrs = mem.block_addrs(slot as usize, 0..1);
        debug_assert_eq!(addrs.len(), 1);
        Ok(addrs[0].0 as *mut u8)
    }

    /// The bytes of a chunk being written (between `prepare_store` and `complete_store`): the
    /// GPU → primary copy lands here.
    pub fn chunk_mut(&mut self, key: &OffloadKey) -> Result<&mut [u8]> {
        let p = self.slot_ptr("chunk_mut", key, true)?;
        // SAFETY: the slot is `chunk_bytes` of live host memory owned by `self.memory`; a
        // pending slot is written only by the caller that prepared it, and `&mut self` keeps
        // every other borrow of the manager out for the slice's lifetime.
        Ok(unsafe { std::slice::from_raw_parts_mut(p, self.chunk_bytes) })
    }

    /// The bytes of a ready chunk.
    pub fn chunk(&self, key: &OffloadKey) -> Result<&[u8]> {
        let p = self.slot_ptr("chunk", key, false)?;
        // SAFETY: as above; a ready slot is only read (by cascades) until it is evicted, which
        // needs `&mut self`.
        Ok(unsafe { std::slice::from_raw_parts(p, self.chunk_bytes) })
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

    /// `prepare_read` of chunks already known resident and ready, by slot (no probe).
    pub(crate) fn prepare_read_slots(&mut self, slots: &[u32]) -> Vec<i32> {
        self.manager.pin_slots(slots)
    }

    /// Unpins chunks after a primary → secondary copy.
    pub fn complete_read(&mut self, keys: &[OffloadKey]) -> Result<()> {
        self.manager
            .complete_load_inner("complete_read", keys, None)
    }

    /// Unpins cascade reads the tiering manager pinned itself (`chunk_ids`: the job's, each
    /// key's slot, checked before use); returns how many keys were not pinned.
    pub(crate) fn complete_read_pinned(&mut self, keys: &[OffloadKey], chunk_ids: &[i32]) -> usize {
        self.manager.unpin_reads(keys, chunk_ids)
    }

    /// Reserves slots for a secondary → primary copy (promotion); `None` when full.
    pub fn prepare_write(
        &mut self,
        keys: &[OffloadKey],
        ctx: &ReqContext,
    ) -> Option<PrepareStoreOutput> {
        self.manager.store_inner(keys, ctx)
    }

    /// [`prepare_write`](Self::prepare_write) into `out` (its vectors cleared and refilled,
    /// their capacity kept); `false` where `prepare_write` answers `None`.
    pub fn prepare_write_into(
        &mut self,
        keys: &[OffloadKey],
        ctx: &ReqContext,
        out: &mut PrepareStoreOutput,
    ) -> bool {
        self.manager.store_into(keys, ctx, out)
    }

    /// Completes a promotion write (success makes the keys loadable, failure frees the slots).
    pub fn complete_write(&mut self, keys: &[OffloadKey], ctx: &ReqContext, success: bool) {
        self.manager.complete_store_inner(keys, ctx, success)
    }

    /// [`complete_write`](Self::complete_write) of a whole promotion job (`chunk_ids`: its
    /// slots, each checked before use, so the usual completion probes nothing).
    pub(crate) fn complete_write_job(
        &mut self,
        keys: &[OffloadKey],
        chunk_ids: &[i32],
        ctx: &ReqContext,
        success: bool,
    ) {
        self.manager
            .complete_store_hinted(keys, chunk_ids, ctx, success)
    }

    /// Releases the memory (after every secondary tier stopped touching it).
    pub fn shutdown(&mut self) {
        if let Some((tm, h)) = self.transfer.take() {
            let _ = tm.unregister_layout(h);
        }
        self.memory = None;
    }
}
