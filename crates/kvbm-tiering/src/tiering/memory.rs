//! `InMemoryTier`: an unbounded secondary tier for tests and replays. It holds keys (no bytes);
//! every submitted job is reported finished at the next `get_finished_jobs()`; a load succeeds
//! iff the tier holds every key of the job. Knobs let tests hold jobs back, fail loads, lose a
//! job at drain, request REQUEST_LEVEL policy, or report RETRY.

use std::sync::Arc;

use hashbrown::HashSet;
use parking_lot::Mutex;

use crate::error::{Result, TieringError};
use crate::key::OffloadKey;
use crate::stats::OffloadingConnectorStats;
use crate::tiering::backpressure::{Backpressure, BackpressureDetector};
use crate::tiering::base::{JobResult, SecondaryTierManager, TierJob};
use crate::types::{
    Locality, LookupResult, Medium, OffloadScope, OffloadingEvent, ReqContext,
    RequestOffloadingContext,
};

/// Unbounded in-memory tier holding keys.
pub struct InMemoryTier {
    tier_type: String,
    medium: Option<Medium>,
    locality: Option<Locality>,
    block_size_bytes: usize,
    keys: HashSet<OffloadKey>,
    done: Vec<JobResult>,
    held: Vec<JobResult>,
    /// Submitted store jobs (count).
    pub stores: usize,
    /// Submitted load jobs (count).
    pub loads: usize,
    /// Keep finished jobs back until `release_held` (simulates slow I/O).
    pub hold_jobs: bool,
    /// Fail every load while holding its keys (simulates a stale existence cache, vLLM #49176).
    pub fail_loads: bool,
    /// `drain_jobs` drops held jobs instead of reporting them (a lost job, vLLM #48102).
    pub lose_jobs_on_drain: bool,
    /// Policy answered by `on_new_request`.
    pub policy: OffloadScope,
    /// Keys answered with `Retry`.
    pub retry_keys: HashSet<OffloadKey>,
    /// Fail `shutdown`.
    pub fail_shutdown: bool,
    /// Whether `shutdown` was called.
    pub shut_down: bool,
    detector: Option<BackpressureDetector>,
    /// Every call made on the tier, in order (shareable between tiers for ordering tests).
    pub log: Arc<Mutex<Vec<String>>>,
    /// Keep the call log and submitted jobs.
    pub record_log: bool,
    /// Submitted jobs (when `record_log`).
    pub jobs: Vec<Arc<TierJob>>,
    /// Number of `lookup` calls.
    pub lookups: usize,
    /// Events handed out by the next `take_events`.
    pub events: Vec<OffloadingEvent>,
    /// Number of `take_events` calls.
    pub take_events_calls: usize,
    /// Stats handed out by the next `get_stats`.
    pub next_stats: Option<OffloadingConnectorStats>,
    /// Number of `drain_jobs` calls.
    pub drains: usize,
}

impl InMemoryTier {
    /// A `mem` tier of medium CPU.
    pub fn new(block_size_bytes: usize) -> Self {
        Self {
            tier_type: "mem".into(),
            medium: Some(Medium::Cpu),
            locality: None,
            block_size_bytes,
            keys: HashSet::new(),
            done: Vec::new(),
            held: Vec::new(),
            stores: 0,
            loads: 0,
            hold_jobs: false,
            fail_loads: false,
            lose_jobs_on_drain: false,
            policy: OffloadScope::ChunkLevel,
            retry_keys: HashSet::new(),
            fail_shutdown: false,
            shut_down: false,
            detector: None,
            log: Arc::new(Mutex::new(Vec::new())),
            record_log: false,
            jobs: Vec::new(),
            lookups: 0,
            events: Vec::new(),
            take_events_calls: 0,
            next_stats: None,
            drains: 0,
        }
    }
    /// Sets type label, medium and locality.
    pub fn with_identity(
        mut self,
        tier_type: &str,
        medium: Option<Medium>,
        locality: Option<Locality>,
    ) -> Self {
        self.tier_type = tier_type.into();
        self.medium = medium;
        self.locality = locality;
        self
    }
    /// Records calls into `log` (shared with other tiers when given) and keeps submitted jobs.
    pub fn with_log(mut self, log: Option<Arc<Mutex<Vec<String>>>>) -> Self {
        self.record_log = true;
        if let Some(l) = log {
            self.log = l;
        }
        self
    }
    /// Takes the results held back by `hold_jobs` (tests that report custom results).
    pub fn take_held(&mut self) -> Vec<JobResult> {
        std::mem::take(&mut self.held)
    }
    /// Attaches a backpressure detector.
    pub fn with_backpressure(mut self, d: BackpressureDetector) -> Self {
        self.detector = Some(d);
        self
    }
    /// Whether the tier holds a key.
    pub fn contains(&self, k: &OffloadKey) -> bool {
        self.keys.contains(k)
    }
    /// Adds a key directly (test setup).
    pub fn insert(&mut self, k: OffloadKey) {
        self.keys.insert(k);
    }
    /// Number of keys held.
    pub fn len(&self) -> usize {
        self.keys.len()
    }
    /// Whether empty.
    pub fn is_empty(&self) -> bool {
        self.keys.is_empty()
    }
    /// Jobs held back by `hold_jobs`.
    pub fn held_jobs(&self) -> usize {
        self.held.len()
    }
    /// Releases held jobs to the next `get_finished_jobs`.
    pub fn release_held(&mut self) {
        self.done.append(&mut self.held);
    }
    /// Queues a result directly (tests of partial failures).
    pub fn push_result(&mut self, r: JobResult) {
        self.done.push(r);
    }
    /// The detector, if any.
    pub fn detector(&mut self) -> Option<&mut BackpressureDetector> {
        self.detector.as_mut()
    }
    fn finish(&mut self, r: JobResult) {
        if self.hold_jobs {
            self.held.push(r);
        } else {
            self.done.push(r);
        }
    }
    fn note(&mut self, s: impl FnOnce() -> String) {
        if self.record_log {
            let line = format!("{}: {}", self.tier_type, s());
            self.log.lock().push(line);
        }
    }
}

impl SecondaryTierManager for InMemoryTier {
    fn tier_type(&self) -> &str {
        &self.tier_type
    }
    fn medium(&self) -> Option<Medium> {
        self.medium
    }
    fn locality(&self) -> Option<Locality> {
        self.locality
    }
    fn block_size_bytes(&self) -> usize {
        self.block_size_bytes
    }
    fn bp_detector(&mut self) -> Option<&mut dyn Backpressure> {
        self.detector.as_mut().map(|d| d as &mut dyn Backpressure)
    }
    #[inline]
    fn lookup(&mut self, key: &OffloadKey, _: &ReqContext) -> LookupResult {
        self.lookups += 1;
        if !self.retry_keys.is_empty() && self.retry_keys.contains(key) {
            return LookupResult::Retry;
        }
        if self.keys.contains(key) {
            LookupResult::Hit
        } else {
            LookupResult::Miss
        }
    }
    fn submit_store(&mut self, job: Arc<TierJob>) {
        self.note(|| format!("submit_store {} {}", job.job_id, job.req_context.req_id()));
        self.keys.extend(job.keys.iter().copied());
        self.stores += 1;
        if self.record_log {
            self.jobs.push(job.clone());
        }
        let mut r = JobResult::new(job.job_id, true);
        r.transfer_time = Some(0.0);
        self.finish(r);
    }
    fn submit_load(&mut self, job: Arc<TierJob>) {
        self.note(|| format!("submit_load {} {}", job.job_id, job.req_context.req_id()));
        self.loads += 1;
        if self.record_log {
            self.jobs.push(job.clone());
        }
        let ok = !self.fail_loads && job.keys.iter().all(|k| self.keys.contains(k));
        let mut r = JobResult::new(job.job_id, ok);
        r.transfer_time = Some(0.0);
        self.finish(r);
    }
    fn get_finished_jobs(&mut self, out: &mut Vec<JobResult>) {
        out.append(&mut self.done);
    }
    fn drain_jobs(&mut self) -> Result<()> {
        self.note(|| "drain_jobs".into());
        self.drains += 1;
        if self.lose_jobs_on_drain {
            self.held.clear();
        } else {
            self.done.append(&mut self.held);
        }
        Ok(())
    }
    fn on_new_request(&mut self, ctx: &ReqContext) -> RequestOffloadingContext {
        self.note(|| format!("on_new_request {}", ctx.req_id()));
        RequestOffloadingContext {
            policy: self.policy,
        }
    }
    fn on_request_finished(&mut self, ctx: &ReqContext) {
        self.note(|| format!("on_request_finished {}", ctx.req_id()));
    }
    fn touch(&mut self, keys: &[OffloadKey], _: &ReqContext) {
        self.note(|| format!("touch {keys:?}"));
    }
    fn take_events(&mut self) -> Vec<OffloadingEvent> {
        self.take_events_calls += 1;
        std::mem::take(&mut self.events)
    }
    fn get_stats(&mut self) -> Option<OffloadingConnectorStats> {
        self.next_stats.take()
    }
    fn has_pending_work(&self) -> bool {
        !self.held.is_empty()
    }
    fn as_any_mut(&mut self) -> &mut dyn std::any::Any {
        self
    }
    fn shutdown(&mut self) -> Result<()> {
        self.note(|| "shutdown".into());
        if self.fail_shutdown {
            return Err(TieringError::Tier {
                tier: 0,
                tier_type: self.tier_type.clone(),
                message: "shutdown failed".into(),
            });
        }
        self.shut_down = true;
        Ok(())
    }
}
