//! A minimal model of vLLM's scheduler-side offloading connector, the caller of the manager:
//! the prefix scan, transfer-job tracking per request, deferred `on_request_finished`, and
//! `reset_cache` with a stale-job threshold (vLLM #48102's fix). Engines embedding kvbm use it
//! as the reference for how to drive an [`OffloadingManager`].
//!
//! * `get_num_new_matched_chunks`: a request with a tracked job is not looked up (`None`, try
//!   next step); otherwise keys are scanned in order: `HIT` counts, `HIT_PENDING` counts but
//!   defers, `RETRY` defers and keeps scanning (so asynchronous lookups start), the first `MISS`
//!   stops; any deferral answers `None`.
//! * `request_finished`: deferred while the request has in-flight store jobs.
//! * `reset_cache`: one manager reset; in-flight load jobs are queued to flush; job maps cleared;
//!   completions of jobs below the stale threshold are ignored; every request's stored-chunk
//!   cursor returns to 0; finished requests still waiting for stores are finalised once.

use std::collections::{BTreeMap, BTreeSet};

use crate::error::Result;
use crate::key::OffloadKey;
use crate::manager::OffloadingManager;
use crate::types::{LookupResult, ReqContext};

/// Kind of a tracked transfer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum JobKind {
    /// Offloaded → GPU.
    Load,
    /// GPU → offloaded.
    Store,
}

struct ReqInfo {
    ctx: ReqContext,
    next_stored_chunk_idx: usize,
    finished: bool,
    finish_sent: bool,
    jobs: BTreeSet<u64>,
}

/// Scheduler-side connector over a manager.
pub struct SchedulerConnector<M: OffloadingManager> {
    /// The manager.
    pub manager: M,
    reqs: BTreeMap<String, ReqInfo>,
    jobs: BTreeMap<u64, (String, JobKind, Vec<OffloadKey>)>,
    job_counter: u64,
    stale_job_threshold: u64,
    /// Load jobs in flight at the last `reset_cache`, to be flushed by the worker.
    pub loads_to_flush: Vec<u64>,
}

impl<M: OffloadingManager> SchedulerConnector<M> {
    /// Wraps a manager.
    pub fn new(manager: M) -> Self {
        Self {
            manager,
            reqs: BTreeMap::new(),
            jobs: BTreeMap::new(),
            job_counter: 0,
            stale_job_threshold: 0,
            loads_to_flush: Vec::new(),
        }
    }

    /// Registers a request.
    pub fn add_request(&mut self, ctx: ReqContext) -> Result<()> {
        self.manager.on_new_request(&ctx)?;
        self.reqs.insert(
            ctx.req_id().to_string(),
            ReqInfo {
                ctx,
                next_stored_chunk_idx: 0,
                finished: false,
                finish_sent: false,
                jobs: BTreeSet::new(),
            },
        );
        Ok(())
    }

    /// Leading loadable chunks, or `None` to try again next step.
    pub fn get_num_new_matched_chunks(&mut self, req: &str, keys: &[OffloadKey]) -> Option<usize> {
        let info = self.reqs.get(req)?;
        if !info.jobs.is_empty() {
            return None;
        }
        let ctx = info.ctx.clone();
        let mut hits = 0;
        let mut defer = false;
        for k in keys {
            match self.manager.lookup(k, &ctx) {
                LookupResult::Hit => hits += 1,
                LookupResult::HitPending => {
                    hits += 1;
                    defer = true;
                }
                LookupResult::Retry => defer = true,
                LookupResult::Miss => break,
            }
        }
        (!defer).then_some(hits)
    }

    /// Starts a load job (after `prepare_load`); returns its id.
    pub fn start_load(&mut self, req: &str, keys: &[OffloadKey]) -> Result<u64> {
        let ctx = self.reqs[req].ctx.clone();
        self.manager.prepare_load(keys, &ctx)?;
        Ok(self.track(req, JobKind::Load, keys.to_vec()))
    }

    /// Offers the request's chunks from its cursor on; returns the store job, if any.
    pub fn start_store(&mut self, req: &str, chunk_keys: &[OffloadKey]) -> Result<Option<u64>> {
        let info = &self.reqs[req];
        let from = info.next_stored_chunk_idx.min(chunk_keys.len());
        let ctx = info.ctx.clone();
        let new = &chunk_keys[from..];
        if new.is_empty() {
            return Ok(None);
        }
        let Some(out) = self.manager.prepare_store(new, &ctx)? else {
            return Ok(None);
        };
        self.reqs
            .get_mut(req)
            .expect("present")
            .next_stored_chunk_idx = chunk_keys.len();
        if out.keys_to_store.is_empty() {
            return Ok(None);
        }
        Ok(Some(self.track(req, JobKind::Store, out.keys_to_store)))
    }

    fn track(&mut self, req: &str, kind: JobKind, keys: Vec<OffloadKey>) -> u64 {
        let id = self.job_counter;
        self.job_counter += 1;
        self.jobs.insert(id, (req.to_string(), kind, keys));
        self.reqs.get_mut(req).expect("present").jobs.insert(id);
        id
    }

    /// A worker finished a job. Stale jobs (started before a reset) are ignored.
    pub fn job_finished(&mut self, job_id: u64, success: bool) -> Result<()> {
        if job_id < self.stale_job_threshold {
            return Ok(());
        }
        let Some((req, kind, keys)) = self.jobs.remove(&job_id) else {
            return Ok(());
        };
        let ctx = self.reqs[&req].ctx.clone();
        match kind {
            JobKind::Load => self.manager.complete_load(&keys, &ctx)?,
            JobKind::Store => self.manager.complete_store(&keys, &ctx, success)?,
        }
        let info = self.reqs.get_mut(&req).expect("present");
        info.jobs.remove(&job_id);
        if info.finished && info.jobs.is_empty() {
            self.finalize(&req)?;
        }
        Ok(())
    }

    fn finalize(&mut self, req: &str) -> Result<()> {
        let info = self.reqs.remove(req).expect("present");
        if !info.finish_sent {
            self.manager.on_request_finished(&info.ctx)?;
        }
        Ok(())
    }

    /// The request finished; the manager hears of it once its store jobs are done.
    pub fn request_finished(&mut self, req: &str) -> Result<()> {
        let Some(info) = self.reqs.get_mut(req) else {
            return Ok(());
        };
        info.finished = true;
        let stores = info.jobs.iter().any(|j| {
            self.jobs
                .get(j)
                .is_some_and(|(_, k, _)| *k == JobKind::Store)
        });
        if !stores {
            self.finalize(req)?;
        }
        Ok(())
    }

    /// Resets the manager and the connector's job bookkeeping.
    pub fn reset_cache(&mut self) -> Result<()> {
        self.manager.reset_cache()?;
        self.loads_to_flush = self
            .jobs
            .iter()
            .filter(|(_, (_, k, _))| *k == JobKind::Load)
            .map(|(id, _)| *id)
            .collect();
        self.jobs.clear();
        self.stale_job_threshold = self.job_counter;
        let mut done = Vec::new();
        for (id, info) in self.reqs.iter_mut() {
            info.next_stored_chunk_idx = 0;
            info.jobs.clear();
            if info.finished {
                done.push(id.clone());
            }
        }
        for r in done {
            self.finalize(&r)?;
        }
        Ok(())
    }

    /// Stale-job threshold (job counter at the last reset).
    pub fn stale_job_threshold(&self) -> u64 {
        self.stale_job_threshold
    }
    /// Tracked jobs.
    pub fn num_jobs(&self) -> usize {
        self.jobs.len()
    }
    /// The stored-chunk cursor of a request.
    pub fn next_stored_chunk_idx(&self, req: &str) -> Option<usize> {
        self.reqs.get(req).map(|r| r.next_stored_chunk_idx)
    }
}
