//! `PhysicalOffloadingWorker`: the worker half (vLLM `OffloadingWorker`) over kvbm-physical's
//! transfer manager, moving chunks between the GPU (G1) layout and the primary tier's pinned host
//! slots (G2).
//!
//! The scheduler half decides *what* moves (`prepare_store` / `prepare_load` hand out CPU chunk
//! ids); the worker moves the bytes: `submit_store` GPU → CPU, `submit_load` CPU → GPU, both
//! non-blocking; `get_finished` reports each job once; `wait` blocks on given jobs. GPU block
//! `i` of a spec pairs with CPU chunk `i` of the other spec (one GPU block per chunk, same block
//! geometry: kvbm-physical validates it); specs of different lengths are refused before anything
//! starts.
//!
//! ```text
//!  submit_*  ─► ExternalMover::copy_slots (issued now) ─► Running { future }   (or `false`: not started)
//!  get_finished: poll each future once (never blocks) ─► WorkerJobResult per settled job
//!  wait / shutdown: block on the given futures
//! ```
//!
//! Why kvbm-offload's [`ExternalMover`]: it is the one move into slots a caller manages, and
//! vLLM hands this worker slots, not blocks (no identities: both sides are memory, so
//! `copy_slots`). Safety: the connector reserved both slot lists for the job (the primary's
//! chunks pending the store or load, the request's GPU blocks) until the job is reported
//! finished, which happens only after its move settled. No lock: the worker is driven from one
//! thread (`&mut self`).

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Instant;

use futures::FutureExt;
use futures::future::BoxFuture;
use kvbm_logical::{G1, G2, Tier};
use kvbm_offload::{BlockFailure, ExternalMover};
use kvbm_physical::{BlockId, LayoutHandle, TransferManager};

use crate::error::{Result, TieringError};
use crate::types::{GpuLoadStoreSpec, LoadStoreSpec, WorkerJobResult};

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
    tm: Arc<TransferManager>,
    gpu: LayoutHandle,
    cpu: LayoutHandle,
    block_bytes: u64,
    running: BTreeMap<u64, Running>,
    finished: Vec<WorkerJobResult>,
}

impl PhysicalOffloadingWorker {
    /// A worker moving whole blocks of `block_bytes` between `gpu` and `cpu` (both registered in `tm`).
    pub fn new(
        tm: Arc<TransferManager>,
        gpu: LayoutHandle,
        cpu: LayoutHandle,
        block_bytes: usize,
    ) -> Self {
        Self {
            tm,
            gpu,
            cpu,
            block_bytes: block_bytes as u64,
            running: BTreeMap::new(),
            finished: Vec::new(),
        }
    }

    fn ids(spec: &LoadStoreSpec) -> Result<Vec<BlockId>> {
        match spec {
            LoadStoreSpec::Cpu(c) => Ok(c.chunk_ids.iter().map(|&i| i as BlockId).collect()),
            LoadStoreSpec::BlockIds(b) => Ok(b.block_ids.iter().map(|&i| i as BlockId).collect()),
            LoadStoreSpec::Gpu(_) => Err(TieringError::Config(
                "worker: the offloaded side of a transfer cannot be a GPU spec".into(),
            )),
        }
    }

    /// Starts the copy of `src`'s slots into `dst`'s (`Src`: the tier of the source slots).
    /// `false` when it could not start (nothing moved).
    fn start<Src: Tier>(
        &mut self,
        job_id: u64,
        src: (LayoutHandle, Vec<BlockId>),
        dst: (LayoutHandle, Vec<BlockId>),
    ) -> bool {
        if src.1.len() != dst.1.len() || self.running.contains_key(&job_id) {
            tracing::error!(job_id, "worker: mismatched specs or duplicate job id");
            return false;
        }
        let bytes = src.1.len() as u64 * self.block_bytes;
        let mover = match ExternalMover::<Src>::from_layout(&self.tm, src.0, dst.0) {
            Ok(m) => m,
            Err(e) => {
                tracing::error!(job_id, error = %e, "worker: transfer refused");
                return false;
            }
        };
        // SAFETY: `src` and `dst` are slot lists the connector reserved for this job (the
        // primary's slots pending a GPU load/store and the GPU blocks of the request); nothing
        // else reads or writes them until the job is reported finished, after its move settled.
        let started = unsafe { mover.copy_slots(&src.1, &dst.1) };
        match started {
            Ok(moving) => {
                self.running.insert(
                    job_id,
                    Running {
                        moving: moving.boxed(),
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
        let Ok(d) = Self::ids(dst) else { return false };
        let s = src.block_ids().iter().map(|&i| i as BlockId).collect();
        self.start::<G1>(job_id, (self.gpu, s), (self.cpu, d))
    }

    fn submit_load(&mut self, job_id: u64, src: &LoadStoreSpec, dst: &GpuLoadStoreSpec) -> bool {
        let Ok(s) = Self::ids(src) else { return false };
        let d = dst.block_ids().iter().map(|&i| i as BlockId).collect();
        self.start::<G2>(job_id, (self.cpu, s), (self.gpu, d))
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
