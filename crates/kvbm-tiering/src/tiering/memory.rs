//! `InMemoryTier`: an unbounded secondary tier for tests and replays. It holds keys (no bytes);
//! every submitted job is reported finished at the next `get_finished_jobs()`; a load succeeds
//! iff the tier holds every key of the job. Knobs let tests hold jobs back, fail loads, lose a
//! job at drain, request REQUEST_LEVEL policy, or report RETRY.
//!
//! The keys it holds are a `Held` set: the keys in arrival order and a table of 8-byte
//! entries over them, not a `HashSet<OffloadKey>` of 40-byte buckets. The tier only grows
//! (a cold scheduler step of the bench hands it 16384 new keys), and a probe of a key it does
//! not hold, the usual answer, then reads the table's control bytes and entries (a fifth of
//! the set's memory) instead of a table that long outgrew the cache.

use std::sync::Arc;

use hashbrown::hash_table::Entry;
use hashbrown::{HashSet, HashTable};
use parking_lot::Mutex;

use crate::error::{Result, TieringError};
use crate::key::{KeyHasher, OffloadKey};
use crate::stats::OffloadingConnectorStats;
use crate::tiering::backpressure::{Backpressure, BackpressureDetector};
use crate::tiering::base::{JobResult, SecondaryTierManager, TierJob};
use crate::types::{
    Locality, LookupResult, Medium, OffloadScope, OffloadingEvent, ReqContext,
    RequestOffloadingContext,
};

/// An append-only key set: every key held, in arrival order, and a table of one `u64` per
/// key (the key's id in the low half, the upper half of its hash in the high half).
///
/// A probe compares the stored hash half before it reads a key, so a key the tier does not
/// hold reads no key; growing the table rehashes from the entries alone (the hash a table
/// slot is placed by is rebuilt from the stored half), never from the keys.
#[derive(Default)]
struct Held {
    keys: Vec<OffloadKey>,
    table: HashTable<u64>,
    hasher: KeyHasher,
}

impl Held {
    /// The table's hash of a key's 32-bit hash half (the half twice: its low bits place the
    /// entry, its top bits are hashbrown's tag).
    #[inline(always)]
    fn spread(half: u32) -> u64 {
        (u64::from(half) << 32) | u64::from(half)
    }

    #[inline(always)]
    fn half(&self, k: &OffloadKey) -> u32 {
        (self.hasher.hash(k) >> 32) as u32
    }

    #[inline]
    fn contains(&self, k: &OffloadKey) -> bool {
        let h = self.half(k);
        let keys = &self.keys;
        self.table
            .find(Self::spread(h), |&e| {
                (e >> 32) as u32 == h && keys[(e as u32) as usize] == *k
            })
            .is_some()
    }

    /// Adds `k` unless held.
    #[inline]
    fn insert(&mut self, k: OffloadKey) {
        let h = self.half(&k);
        let keys = &self.keys;
        match self.table.entry(
            Self::spread(h),
            |&e| (e >> 32) as u32 == h && keys[(e as u32) as usize] == k,
            |&e| Self::spread((e >> 32) as u32),
        ) {
            Entry::Occupied(_) => {}
            Entry::Vacant(v) => {
                let id =
                    u32::try_from(self.keys.len()).expect("an in-memory tier holds < 2^32 keys");
                v.insert((u64::from(h) << 32) | u64::from(id));
                self.keys.push(k);
            }
        }
    }

    fn len(&self) -> usize {
        self.keys.len()
    }
}

/// Unbounded in-memory tier holding keys.
pub struct InMemoryTier {
    tier_type: String,
    medium: Option<Medium>,
    locality: Option<Locality>,
    block_size_bytes: usize,
    keys: Held,
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
            keys: Held::default(),
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
        self.keys.len() == 0
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
        for &k in job.keys.iter() {
            self.keys.insert(k);
        }
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

#[cfg(test)]
mod tests;
