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

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Instant;

use futures::FutureExt;
use kvbm_physical::{BlockId, LayoutHandle, TransferCompletion, TransferManager, TransferOptions};

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
    completion: TransferCompletion,
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

    fn start(
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
        // SAFETY: `src` and `dst` are slot lists the connector reserved for this job (the
        // primary's slots pending a GPU load/store and the GPU blocks of the request); nothing
        // else reads or writes them until the job is reported finished.
        let started = unsafe {
            self.tm
                .execute_transfer(src.0, &src.1, dst.0, &dst.1, TransferOptions::default())
        };
        match started {
            Ok(completion) => {
                self.running.insert(
                    job_id,
                    Running {
                        completion,
                        started: Instant::now(),
                        bytes,
                    },
                );
                true
            }
            Err(e) => {
                tracing::error!(job_id, error = %e, "worker: transfer refused");
                false
            }
        }
    }

    fn record(
        &mut self,
        job_id: u64,
        started: Instant,
        bytes: u64,
        outcome: kvbm_physical::TransferOutcome,
    ) {
        let ok = outcome.is_complete_success();
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
        self.start(job_id, (self.gpu, s), (self.cpu, d))
    }

    fn submit_load(&mut self, job_id: u64, src: &LoadStoreSpec, dst: &GpuLoadStoreSpec) -> bool {
        let Ok(s) = Self::ids(src) else { return false };
        let d = dst.block_ids().iter().map(|&i| i as BlockId).collect();
        self.start(job_id, (self.cpu, s), (self.gpu, d))
    }

    fn get_finished(&mut self) -> Vec<WorkerJobResult> {
        let mut ready = Vec::new();
        for (id, r) in self.running.iter_mut() {
            if let Some(o) = (&mut r.completion).now_or_never() {
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
                let outcome = r.completion.wait();
                self.record(*id, r.started, r.bytes, outcome);
            }
        }
    }

    fn shutdown(&mut self) {
        let ids: Vec<u64> = self.running.keys().copied().collect();
        self.wait(&ids);
    }
}
