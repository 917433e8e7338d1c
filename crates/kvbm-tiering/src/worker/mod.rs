//! `PhysicalOffloadingWorker`: the worker half (vLLM `OffloadingWorker`) over kvbm-physical's
//! transfer manager, moving KV pages between the GPU (G1) layout and the primary tier's pinned
//! host chunks (G2).
//!
//! The scheduler half decides *what* moves (`prepare_store` / `prepare_load` hand out CPU chunk
//! ids); the worker moves the bytes: `submit_store` GPU → CPU, `submit_load` CPU → GPU, both
//! non-blocking; `get_finished` reports each job once; `wait` blocks on given jobs.
//!
//! What moves where is the worker's layout (`worker/layout.rs`, built and validated once by
//! [`PhysicalOffloadingWorker::builder`]): KV groups, each with its data refs (a tensor, i.e. a
//! layer of both layouts, and an un-padded page size), `blocks_per_chunk` GPU blocks per chunk
//! (a group's first chunk may be entered at sub-block `block_indices[g] % blocks_per_chunk`),
//! and the chunks' layout: per-rank pages ([`ChunkLayout::Direct`]) or canonical pages
//! ([`ChunkLayout::Canonical`], TP-independent: each rank copies its fragments in and out, and
//! ranks holding identical bytes take turns storing them). A job's specs are planned into
//! range copies up front; specs that do not fit (ids left over or missing, out of range, a
//! group count that differs) are refused and nothing moves. [`PhysicalOffloadingWorker::new`]
//! is the simple case: one group, every layer a whole-page ref, one block per chunk.
//! [`PhysicalOffloadingWorker::adopting`] is vLLM's `get_worker(kv_caches)`: the engine's own
//! tensors (`CanonicalKVCaches`) adopted as the GPU layout (`kvbm_physical::adopt`, no copy of
//! the cache, the memory kept alive by the owner the caller hands over).
//!
//! ```text
//!  submit_*  ─► plan (WorkerLayout::plan) ─► ExternalMover::copy_ranges (issued now) ─► Running { future }
//!             (or `false`: refused, nothing moved)
//!  get_finished: poll each future once (never blocks) ─► WorkerJobResult per settled job
//!  wait / shutdown: block on the given futures
//! ```
//!
//! Why kvbm-offload's [`ExternalMover`]: it is the one move into slots a caller manages, and
//! vLLM hands this worker slots, not blocks (no identities: both sides are memory, so
//! `copy_ranges`). Safety: the connector reserved both slot lists for the job (the primary's
//! chunks pending the store or load, the request's GPU blocks) until the job is reported
//! finished, which happens only after its move settled. No lock: the worker is driven from one
//! thread (`&mut self`).

mod layout;
#[cfg(test)]
mod tests;

pub use layout::{ChunkLayout, WorkerLayoutBuilder};

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Instant;

use futures::FutureExt;
use futures::future::BoxFuture;
use kvbm_logical::{G1, G2};
use kvbm_offload::{BlockFailure, ExternalMover};
use kvbm_physical::{
    KvDims, LayoutHandle, Owner, TensorDesc, TensorDevice, TransferManager, adopt_kv_tensors,
};

use crate::error::{Result, TieringError};
use crate::types::{
    CanonicalKVCacheRef, CanonicalKVCaches, GpuLoadStoreSpec, LoadStoreSpec, WorkerJobResult,
};
use layout::{Direction, WorkerLayout};

/// The worker-side contract (vLLM `OffloadingWorker`).
pub trait OffloadingWorker {
    /// Starts a GPU → offloaded-medium copy. `false` when it could not start.
    fn submit_store(&mut self, job_id: u64, src: &GpuLoadStoreSpec, dst: &LoadStoreSpec) -> bool;
    /// Starts an offloaded-medium → GPU copy. `false` when it could not start.
    fn submit_load(&mut self, job_id: u64, src: &LoadStoreSpec, dst: &GpuLoadStoreSpec) -> bool;
    /// Jobs finished since the last call.
    fn get_finished(&mut self) -> Vec<WorkerJobResult>;
    /// Blocks until the given jobs finished (they are then reported by `get_finished`).
    fn wait(&mut self, job_ids: &[u64]);
    /// Releases resources.
    fn shutdown(&mut self) {}
}

struct Running {
    /// The job's move, issued at submit: one outcome per slot.
    moving: BoxFuture<'static, Vec<std::result::Result<(), BlockFailure>>>,
    started: Instant,
    bytes: u64,
}

/// A worker over a [`TransferManager`] with the GPU layout and the primary tier's layout.
pub struct PhysicalOffloadingWorker {
    layout: WorkerLayout,
    store: ExternalMover<G1>,
    load: ExternalMover<G2>,
    running: BTreeMap<u64, Running>,
    finished: Vec<WorkerJobResult>,
}

impl PhysicalOffloadingWorker {
    /// The simple worker: one KV group whose refs are the GPU layout's layers, whole, one block
    /// per chunk, direct layout: GPU block `i` of a spec goes to chunk `i` of the other.
    /// `block_bytes` must be the GPU layout's block size.
    ///
    /// # Errors
    /// As [`WorkerLayoutBuilder::build`], and when `block_bytes` is not the block size.
    pub fn new(
        tm: Arc<TransferManager>,
        gpu: LayoutHandle,
        cpu: LayoutHandle,
        block_bytes: usize,
    ) -> Result<Self> {
        let c = *tm.layout(gpu)?.layout().config();
        if c.block_bytes() != block_bytes {
            return Err(TieringError::Config(format!(
                "worker layout: blocks of {block_bytes} bytes given, the GPU layout's are {}",
                c.block_bytes()
            )));
        }
        let refs = (0..c.num_layers)
            .map(|t| CanonicalKVCacheRef {
                tensor_idx: t,
                page_size_bytes: c.layer_bytes(),
                mapping: None,
            })
            .collect();
        Self::builder(tm, gpu, cpu).group(refs).build()
    }

    /// A builder over the GPU layout `gpu` and the CPU (primary) layout `cpu`, both registered
    /// in `tm`; add groups (or [`caches`](WorkerLayoutBuilder::caches)), then
    /// [`build`](WorkerLayoutBuilder::build).
    pub fn builder(
        tm: Arc<TransferManager>,
        gpu: LayoutHandle,
        cpu: LayoutHandle,
    ) -> WorkerLayoutBuilder {
        WorkerLayoutBuilder::new(tm, gpu, cpu)
    }

    /// A builder over the engine's own KV caches (vLLM's `get_worker(kv_caches)`): `caches`'
    /// tensors, each `num_blocks` rows of `page_size_bytes` at `ptr` on `device`, adopted as the
    /// GPU layout ([`kvbm_physical::adopt_kv_tensors`]: one layer per tensor, no copy of the
    /// cache; their memory kept alive by `owner` until the layout and every move are gone),
    /// registered in `tm`, with `caches`' groups added as [`caches`](WorkerLayoutBuilder::caches)
    /// adds them. Set `blocks_per_chunk` and the chunk layout, then build.
    ///
    /// # Errors
    /// The adoption's refusals (tensors of different block counts or page sizes, overlapping
    /// ones; device memory without feature `cuda` and a driver, or that the driver does not
    /// confirm), as [`TieringError::Physical`](crate::TieringError).
    ///
    /// # Safety
    /// As [`kvbm_physical::adopt_kv_tensors`]: each tensor's rows stay allocated while `owner`
    /// lives, and the engine does not touch a job's GPU blocks until the job is reported
    /// finished (vLLM's contract with its offloading worker).
    pub unsafe fn adopting(
        tm: Arc<TransferManager>,
        caches: &CanonicalKVCaches,
        device: TensorDevice,
        owner: Owner,
        cpu: LayoutHandle,
    ) -> Result<WorkerLayoutBuilder> {
        let rows: Vec<TensorDesc> = caches
            .tensors
            .iter()
            .map(|t| {
                TensorDesc::contiguous(t.ptr as u64, &[t.num_blocks, t.page_size_bytes], 1, device)
            })
            .collect();
        let rows_of_pages = KvDims {
            blocks: 0,
            kv: None,
            layers: None,
            tokens: 1,
        };
        // SAFETY: the caller's contract.
        let gpu = unsafe { adopt_kv_tensors(&rows, rows_of_pages, owner) }?;
        let gpu = tm.register_layout(gpu)?;
        WorkerLayoutBuilder::new(tm, gpu, cpu).caches(caches)
    }

    fn from_builder(b: &WorkerLayoutBuilder) -> Result<Self> {
        let layout = b.validate()?;
        Ok(Self {
            layout,
            store: ExternalMover::from_layout(&b.tm, b.gpu, b.cpu)?,
            load: ExternalMover::from_layout(&b.tm, b.cpu, b.gpu)?,
            running: BTreeMap::new(),
            finished: Vec::new(),
        })
    }

    fn chunk_ids(spec: &LoadStoreSpec) -> Option<&[i32]> {
        match spec {
            LoadStoreSpec::Cpu(c) => Some(&c.chunk_ids),
            LoadStoreSpec::BlockIds(b) => Some(&b.block_ids),
            LoadStoreSpec::Gpu(_) => None,
        }
    }

    /// Plans and starts a job; `false` when it could not start (nothing moved).
    fn start(
        &mut self,
        job_id: u64,
        gpu: &GpuLoadStoreSpec,
        other: &LoadStoreSpec,
        dir: Direction,
    ) -> bool {
        if self.running.contains_key(&job_id) {
            tracing::error!(job_id, "worker: duplicate job id");
            return false;
        }
        let Some(chunks) = Self::chunk_ids(other) else {
            tracing::error!(
                job_id,
                "worker: the offloaded side of a transfer cannot be a GPU spec"
            );
            return false;
        };
        let copies = match self.layout.plan(gpu, chunks, dir) {
            Ok(c) => c,
            Err(why) => {
                tracing::error!(job_id, %why, "worker: specs refused");
                return false;
            }
        };
        let bytes = copies.iter().map(|c| c.bytes()).sum();
        // SAFETY: the copies touch only the GPU blocks and chunks of this job's specs, which
        // the connector reserved for it (the primary's chunks pending a store or load, the
        // request's GPU blocks): nothing else reads or writes them until the job is reported
        // finished, after its move settled.
        let started = unsafe {
            match dir {
                Direction::Store => self.store.copy_ranges(copies).map(|f| f.boxed()),
                Direction::Load => self.load.copy_ranges(copies).map(|f| f.boxed()),
            }
        };
        match started {
            Ok(moving) => {
                self.running.insert(
                    job_id,
                    Running {
                        moving,
                        started: Instant::now(),
                        bytes,
                    },
                );
                true
            }
            Err(e) => {
                tracing::error!(job_id, kind = e.kind.as_str(), error = %e.message, "worker: transfer refused");
                false
            }
        }
    }

    fn record(
        &mut self,
        job_id: u64,
        started: Instant,
        bytes: u64,
        outcome: Vec<std::result::Result<(), BlockFailure>>,
    ) {
        let ok = outcome.iter().all(|r| r.is_ok());
        self.finished.push(WorkerJobResult {
            job_id,
            success: ok,
            transfer_size: ok.then_some(bytes),
            transfer_time: Some(started.elapsed().as_secs_f64()),
        });
    }
}

impl OffloadingWorker for PhysicalOffloadingWorker {
    fn submit_store(&mut self, job_id: u64, src: &GpuLoadStoreSpec, dst: &LoadStoreSpec) -> bool {
        self.start(job_id, src, dst, Direction::Store)
    }

    fn submit_load(&mut self, job_id: u64, src: &LoadStoreSpec, dst: &GpuLoadStoreSpec) -> bool {
        self.start(job_id, dst, src, Direction::Load)
    }

    fn get_finished(&mut self) -> Vec<WorkerJobResult> {
        let mut ready = Vec::new();
        for (id, r) in self.running.iter_mut() {
            if let Some(o) = (&mut r.moving).now_or_never() {
                ready.push((*id, o));
            }
        }
        for (id, o) in ready {
            let r = self.running.remove(&id).expect("present");
            self.record(id, r.started, r.bytes, o);
        }
        std::mem::take(&mut self.finished)
    }

    fn wait(&mut self, job_ids: &[u64]) {
        for id in job_ids {
            if let Some(r) = self.running.remove(id) {
                let outcome = futures::executor::block_on(r.moving);
                self.record(*id, r.started, r.bytes, outcome);
            }
        }
    }

    fn shutdown(&mut self) {
        let ids: Vec<u64> = self.running.keys().copied().collect();
        self.wait(&ids);
    }
}
