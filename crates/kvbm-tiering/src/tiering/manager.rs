//! `TieringOffloadingManager` (vLLM 0.33 `tiering/manager.py`): a CPU primary tier, the only
//! gateway to the GPU, and secondary tiers below it.
//!
//! ```text
//!  GPU ──prepare_store/complete_store──► primary (CPU slots) ──cascade (one pin per tier)──► tier 1..n
//!  GPU ◄──prepare_load/complete_load──── primary ◄──promotion (slot reserved at lookup,
//!                                                    one batched load per (tier, request)
//!                                                    submitted at on_schedule_end)──── tier i
//! ```
//!
//! * Finished jobs are polled at most once per step (first `lookup`, or `on_schedule_end`),
//!   and unconditionally by `prepare_store` (so finished cascades/promotions are evictable
//!   before it evicts). A cascade completion unpins (`complete_read`); a promotion completion
//!   makes the slots loadable (`complete_write(true)`) or frees them (`false`).
//! * `lookup`: primary `HIT`/`HIT_PENDING` short-circuit; otherwise tiers in order, skipping the
//!   calling tier and tiers the request's `TierFilter` rejects; the first `HIT` reserves a primary
//!   slot (`HIT_PENDING`, or `MISS` when the primary is full); any `RETRY` → `RETRY`.
//!   After `reset_cache` promotions are held (tier hits read `MISS`) until `on_reset_flushed`.
//! * Request state: pending primary stores, finished flag, request-level tiers, parked cascade
//!   keys; secondary tiers see `on_request_finished` only when no more cascades can be submitted.
//! * Shutdown stops tiers first and keeps primary memory when one failed.
//!
//! # Fixes of upstream bugs ([`UpstreamFixes`], all off under `upstream()`)
//! * vLLM #49176: a failed promotion marks the key missing in that tier, so it reads `MISS`
//!   instead of being promoted (and failing) forever.
//! * vLLM #49829: a promotion not finished within the deadline is cancelled: its keys read
//!   `MISS`; its slots stay reserved until the tier reports the job (never reused mid-copy).
//! * vLLM #49902: at most N chunks are promoted per step; further tier hits read `MISS`.
//! * vLLM #48102: `reset_cache` drops jobs a tier failed to report after `drain_jobs` and ignores
//!   their late results instead of failing the reset (upstream asserts).
//!
//! Single-threaded by design: every method takes `&mut self`; an engine shares the manager
//! behind one lock (vLLM's `manager.lock`).

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::{Duration, Instant};

use hashbrown::{HashMap, HashSet};

use crate::cpu::{CpuManagerConfig, CpuOffloadingManager, CpuPrimaryTier};
use crate::error::{Result, TieringError};
use crate::key::OffloadKey;
use crate::manager::OffloadingManager;
use crate::stats::OffloadingConnectorStats;
use crate::tiering::base::{
    DeferredRelease, Detached, JobId, JobResult, ParentManager, SecondaryTierManager, TierJob,
};
use crate::tiering::metrics::Metrics;
use crate::types::{
    CacheHitSource, Contract, LoadStoreSpec, LookupResult, OffloadScope, OffloadingEvent,
    PrepareStoreOutput, ReqContext, RequestOffloadingContext, ScheduleEndContext,
};

/// Finished requests' load-source maps kept for reuse, at most.
const MAX_SPARE_SOURCES: usize = 64;
/// A load-source map grown past this many keys is dropped rather than kept.
const MAX_SPARE_SOURCE_KEYS: usize = 4096;

/// Switches for kvbm's fixes of upstream bugs. [`UpstreamFixes::upstream`] turns all off.
#[derive(Clone, Debug, PartialEq)]
pub struct UpstreamFixes {
    /// vLLM #49176: a failed promotion makes the key read `MISS` in that tier until it is
    /// cascaded there again.
    pub failed_load_reads_miss: bool,
    /// vLLM #49829: promotions not finished within this deadline are cancelled (keys read `MISS`).
    pub hit_pending_deadline: Option<Duration>,
    /// vLLM #49902: at most this many chunks promoted per scheduler step.
    pub max_promotions_per_step: Option<usize>,
    /// vLLM #48102: `reset_cache` drops unreported jobs and ignores their late results.
    pub reset_drops_stale_jobs: bool,
}

impl UpstreamFixes {
    /// vLLM's behaviour, bugs included.
    pub fn upstream() -> Self {
        Self {
            failed_load_reads_miss: false,
            hit_pending_deadline: None,
            max_promotions_per_step: None,
            reset_drops_stale_jobs: false,
        }
    }
}

impl Default for UpstreamFixes {
    /// Every fix on: 60 s deadline (#49850's proposal), 4096 promotions per step.
    fn default() -> Self {
        Self {
            failed_load_reads_miss: true,
            hit_pending_deadline: Some(Duration::from_secs(60)),
            max_promotions_per_step: Some(4096),
            reset_drops_stale_jobs: true,
        }
    }
}

/// Configuration of a tiering manager.
#[derive(Clone, Debug)]
pub struct TieringConfig {
    /// The primary CPU tier.
    pub primary: CpuManagerConfig,
    /// Bytes per primary chunk.
    pub chunk_bytes: usize,
    /// Upstream-bug fixes.
    pub fixes: UpstreamFixes,
    /// Record lookup latency histograms (two clock reads per tier per lookup).
    pub record_lookup_latency: bool,
}

impl TieringConfig {
    /// `num_chunks` primary slots of `chunk_bytes`, LRU, fixes on, latency histograms off.
    pub fn new(num_chunks: usize, chunk_bytes: usize) -> Self {
        Self {
            primary: CpuManagerConfig::new(num_chunks),
            chunk_bytes,
            fixes: UpstreamFixes::default(),
            record_lookup_latency: false,
        }
    }
}

struct JobMeta {
    job: Arc<TierJob>,
    tier: usize,
}

struct PendingPromotion {
    req_context: ReqContext,
    keys: Vec<OffloadKey>,
    chunk_ids: Vec<i32>,
}

struct RequestState {
    seq: u64,
    req_context: ReqContext,
    pending_primary_stores: u32,
    is_finished: bool,
    request_level_tiers: Vec<usize>,
    pending_cascade_keys: Vec<OffloadKey>,
}

/// A failed promotion's primary chunks, held until its tier's flag is set.
struct DeferredHold {
    job_id: JobId,
    tier: usize,
    flag: DeferredRelease,
    slots: Vec<u32>,
    since: Instant,
}

/// vLLM's `TieringOffloadingManager`.
pub struct TieringOffloadingManager {
    primary: CpuPrimaryTier,
    tiers: Vec<Box<dyn SecondaryTierManager>>,
    job_counter: JobId,
    jobs: HashMap<JobId, JobMeta>,
    promotions_held: bool,
    pending: Vec<(usize, Vec<PendingPromotion>)>,
    pending_index: HashMap<(usize, Arc<str>), usize>,
    /// Fast path: (tier, context uid) → (position in `pending`, entry) of the last promotion.
    last_pending: Option<(usize, u64, usize, usize)>,
    /// The one-key store of the promotion in progress, its buffers kept between promotions.
    promotion_out: PrepareStoreOutput,
    processed_this_step: bool,
    req_state: HashMap<Arc<str>, RequestState>,
    req_seq: u64,
    load_sources: HashMap<Arc<str>, HashMap<OffloadKey, CacheHitSource>>,
    /// Finished requests' load-source maps, cleared, for the next requests that promote (a
    /// request's map would otherwise grow from empty, a rehash at a time, one promotion at a
    /// time).
    spare_sources: Vec<HashMap<OffloadKey, CacheHitSource>>,
    /// `complete_store`'s slots of the keys it completes (kept between calls).
    scratch_slots: Vec<u32>,
    metrics: Metrics,
    finished: Vec<JobResult>,
    fixes: UpstreamFixes,
    failed_marks: HashMap<OffloadKey, u64>,
    deadlines: VecDeque<(Instant, JobId)>,
    expired_keys: HashSet<OffloadKey>,
    expired_jobs: HashSet<JobId>,
    promotions_this_step: usize,
    stale_below: JobId,
    /// Failed promotions whose primary chunks wait for their tier's flag (vLLM 0.34
    /// `_deferred_releases`), in the order they were deferred.
    deferred: Vec<DeferredHold>,
    shut_down: bool,
    /// The primary answers alone: vLLM's CPU-only manager ([`Self::cpu`]).
    alone: bool,
}

impl TieringOffloadingManager {
    /// A manager over a primary tier and secondary tiers (consulted in order).
    pub fn new(config: TieringConfig, tiers: Vec<Box<dyn SecondaryTierManager>>) -> Result<Self> {
        if tiers.len() > 64 {
            return Err(TieringError::Config(format!(
                "{} secondary tiers: at most 64 supported",
                tiers.len()
            )));
        }
        let primary = CpuPrimaryTier::new(config.primary.clone(), config.chunk_bytes)?;
        Ok(Self::with_primary(
            primary,
            tiers,
            config.fixes,
            config.record_lookup_latency,
        ))
    }

    /// A manager over an existing primary tier.
    pub fn with_primary(
        primary: CpuPrimaryTier,
        tiers: Vec<Box<dyn SecondaryTierManager>>,
        fixes: UpstreamFixes,
        record_lookup_latency: bool,
    ) -> Self {
        let types: Vec<String> = tiers.iter().map(|t| t.tier_type().to_string()).collect();
        let mut metrics = Metrics::new(
            &types,
            primary.manager().num_chunks(),
            primary.chunk_bytes(),
        );
        metrics.record_latency = record_lookup_latency;
        metrics.deferred_release = primary.manager().contract() >= Contract::V0_34;
        Self {
            primary,
            tiers,
            job_counter: 0,
            jobs: HashMap::new(),
            promotions_held: false,
            pending: Vec::new(),
            pending_index: HashMap::new(),
            last_pending: None,
            promotion_out: PrepareStoreOutput::default(),
            processed_this_step: false,
            req_state: HashMap::new(),
            req_seq: 0,
            load_sources: HashMap::new(),
            spare_sources: Vec::new(),
            scratch_slots: Vec::new(),
            metrics,
            finished: Vec::new(),
            fixes,
            failed_marks: HashMap::new(),
            deadlines: VecDeque::new(),
            expired_keys: HashSet::new(),
            expired_jobs: HashSet::new(),
            promotions_this_step: 0,
            stale_below: 0,
            deferred: Vec::new(),
            shut_down: false,
            alone: false,
        }
    }

    /// vLLM's CPU-only manager (`CPUOffloadingSpec.get_manager()`, vLLM's
    /// `CPUOffloadingManager`): the primary's slot table with no secondary tier, answering every
    /// call alone, exactly as vLLM's CPU manager does (no request bookkeeping of the tiering
    /// layer: `prepare_store` needs no `on_new_request`, stats are the CPU table's). The slots'
    /// bytes live where the caller's workers put them (no memory is allocated here).
    pub fn cpu(config: CpuManagerConfig) -> Self {
        let mut m = Self::with_primary(
            CpuPrimaryTier::without_memory(config, 0),
            Vec::new(),
            UpstreamFixes::upstream(),
            false,
        );
        m.alone = true;
        m
    }

    /// The primary's table when it answers alone ([`Self::cpu`]).
    #[inline]
    fn alone(&mut self) -> Option<&mut CpuOffloadingManager> {
        if self.alone {
            Some(self.primary.manager_mut())
        } else {
            None
        }
    }

    /// The primary tier.
    pub fn primary(&self) -> &CpuPrimaryTier {
        &self.primary
    }
    /// The primary tier, mutably.
    pub fn primary_mut(&mut self) -> &mut CpuPrimaryTier {
        &mut self.primary
    }
    /// Number of secondary tiers.
    pub fn num_tiers(&self) -> usize {
        self.tiers.len()
    }
    /// A secondary tier as its concrete type.
    pub fn tier_mut<T: 'static>(&mut self, idx: usize) -> Option<&mut T> {
        self.tiers.get_mut(idx)?.as_any_mut().downcast_mut::<T>()
    }
    /// A secondary tier behind its trait (a foreign-language front end reaches its own tiers
    /// through this, e.g. to take their events in the manager's order).
    pub fn tier_dyn_mut(&mut self, idx: usize) -> Option<&mut dyn SecondaryTierManager> {
        Some(self.tiers.get_mut(idx)?.as_mut())
    }
    /// Tracked (unfinished) jobs.
    pub fn num_jobs(&self) -> usize {
        self.jobs.len()
    }
    /// Every tracked job with its tier, in job-id order (vLLM's `_jobs`, for read-only views).
    pub fn jobs(&self) -> Vec<(usize, Arc<TierJob>)> {
        let mut v: Vec<(usize, Arc<TierJob>)> = self
            .jobs
            .values()
            .map(|m| (m.tier, m.job.clone()))
            .collect();
        v.sort_by_key(|(_, j)| j.job_id);
        v
    }
    /// Promotions staged this step, as `(tier, request context, keys, primary slots)` in
    /// staging order (vLLM's `_pending_load_submissions`, for read-only views).
    pub fn pending_promotions(&self) -> Vec<(usize, ReqContext, Vec<OffloadKey>, Vec<i32>)> {
        self.pending
            .iter()
            .flat_map(|(tier, entries)| {
                entries.iter().map(move |p| {
                    (
                        *tier,
                        p.req_context.clone(),
                        p.keys.clone(),
                        p.chunk_ids.clone(),
                    )
                })
            })
            .collect()
    }
    /// Where each promoted key of each request was loaded from (vLLM's
    /// `_request_load_sources`, for read-only views).
    pub fn load_sources(&self) -> Vec<(String, Vec<(OffloadKey, CacheHitSource)>)> {
        self.load_sources
            .iter()
            .map(|(req, m)| (req.to_string(), m.iter().map(|(k, s)| (*k, *s)).collect()))
            .collect()
    }
    /// Promotions staged this step, not yet submitted.
    pub fn num_pending_promotions(&self) -> usize {
        self.pending.iter().map(|(_, v)| v.len()).sum()
    }
    /// Whether the per-step poll already ran.
    pub fn processed_this_step(&self) -> bool {
        self.processed_this_step
    }
    /// Marks the per-step poll as done (tests of the gate).
    pub fn set_processed_this_step(&mut self, v: bool) {
        self.processed_this_step = v;
    }
    /// Whether tier hits are held after `reset_cache`.
    pub fn promotions_held(&self) -> bool {
        self.promotions_held
    }
    /// Holds (or releases) tier hits as `reset_cache` (or `on_reset_flushed`) does (tests of
    /// the hold).
    pub fn set_promotions_held(&mut self, v: bool) {
        self.promotions_held = v;
    }
    /// Requests with state.
    pub fn request_ids(&self) -> Vec<String> {
        let mut v: Vec<(&u64, &Arc<str>)> =
            self.req_state.iter().map(|(k, s)| (&s.seq, k)).collect();
        v.sort();
        v.into_iter().map(|(_, k)| k.to_string()).collect()
    }
    /// `(pending_primary_stores, is_finished, request_level_tiers, parked keys)` of a request.
    pub fn request_state(&self, req_id: &str) -> Option<(u32, bool, Vec<usize>, Vec<OffloadKey>)> {
        self.req_state.get(req_id).map(|s| {
            (
                s.pending_primary_stores,
                s.is_finished,
                s.request_level_tiers.clone(),
                s.pending_cascade_keys.clone(),
            )
        })
    }
    /// Stats labels: `0:primary`, then `<idx+1>:<tier_type>`.
    pub fn labels(&self) -> &[String] {
        &self.metrics.labels
    }
    /// The fixes in effect.
    pub fn fixes(&self) -> &UpstreamFixes {
        &self.fixes
    }

    /// Processes every tier's finished jobs now, without touching the once-per-step gate
    /// (vLLM 0.33 `poll_tiers`, which its control-plane thread calls between steps).
    pub fn poll_tiers(&mut self) {
        self.process_finished_jobs();
    }

    /// One round of vLLM 0.33's tier-poll thread (`poll_tiers`) over the tiers that opted in
    /// (`tolerates_off_thread_polling`): their finished jobs, then their external requests,
    /// with the once-per-step gate held shut for the round and put back untouched (a parent
    /// lookup from the round must not poll every tier, nor make the next step skip its poll).
    /// Pending promotions and cascades are left to the step (`on_schedule_end`).
    pub fn poll_round(&mut self, tiers: &[usize]) {
        let gate = self.processed_this_step;
        self.processed_this_step = true;
        self.process_finished_jobs_in(tiers.iter().copied());
        for &i in tiers {
            if i >= self.tiers.len() {
                continue;
            }
            let mut tier = std::mem::replace(&mut self.tiers[i], Box::new(Detached));
            tier.serve_external_requests(&mut TierParent { m: self, origin: i });
            self.tiers[i] = tier;
        }
        self.processed_this_step = gate;
    }

    fn next_job_id(&mut self) -> JobId {
        let id = self.job_counter;
        self.job_counter += 1;
        id
    }

    fn register(&mut self, job: Arc<TierJob>, tier: usize) {
        self.metrics.on_job_registered(tier, &job);
        self.jobs.insert(job.job_id, JobMeta { job, tier });
    }

    fn maybe_process_finished_jobs(&mut self) {
        if self.processed_this_step {
            return;
        }
        self.processed_this_step = true;
        self.process_finished_jobs();
    }

    /// Polls every tier (vLLM `_process_finished_jobs`). A result for an unknown job or from
    /// the wrong tier is logged and dropped (vLLM asserts).
    fn process_finished_jobs(&mut self) {
        self.process_finished_jobs_in(0..self.tiers.len());
    }

    /// [`Self::process_finished_jobs`] over some tiers only.
    fn process_finished_jobs_in(&mut self, tiers: impl IntoIterator<Item = usize>) {
        let mut buf = std::mem::take(&mut self.finished);
        for i in tiers {
            if i >= self.tiers.len() {
                continue;
            }
            buf.clear();
            self.tiers[i].get_finished_jobs(&mut buf);
            for r in buf.drain(..) {
                let Some(meta) = self.jobs.remove(&r.job_id) else {
                    if r.job_id < self.stale_below {
                        tracing::debug!(
                            job_id = r.job_id,
                            tier = i,
                            "late result of a job dropped at reset_cache"
                        );
                    } else {
                        tracing::error!(job_id = r.job_id, tier = i, "finished job not tracked");
                    }
                    continue;
                };
                if meta.tier != i {
                    tracing::error!(
                        job_id = r.job_id,
                        tier = i,
                        owner = meta.tier,
                        "job reported by the wrong tier"
                    );
                    continue;
                }
                self.metrics.on_job_finished(i, &meta.job, &r);
                if meta.job.is_promotion {
                    self.complete_promotion(&meta, &r);
                } else {
                    let skipped = self
                        .primary
                        .complete_read_pinned(&meta.job.keys, &meta.job.chunk_ids);
                    if skipped > 0 {
                        tracing::error!(
                            job_id = r.job_id,
                            skipped,
                            "cascade completion of unpinned keys"
                        );
                    }
                    if r.deferred_release.is_some() {
                        tracing::error!(
                            job_id = r.job_id,
                            tier = i,
                            "a cascade's result defers a release (only failed promotions may)"
                        );
                    }
                    self.update_backpressure(i, &meta.job, &r);
                    if r.success && !self.failed_marks.is_empty() {
                        let bit = 1u64 << i;
                        for k in &meta.job.keys {
                            if let Some(m) = self.failed_marks.get_mut(k) {
                                *m &= !bit;
                                if *m == 0 {
                                    self.failed_marks.remove(k);
                                }
                            }
                        }
                    }
                }
            }
            if !self.deferred.is_empty() {
                self.complete_deferred_releases(i);
            }
        }
        self.finished = buf;
    }

    /// The deferred releases of `tier` whose flag is set: their chunks go back to the primary's
    /// free pool (vLLM 0.34 `_complete_deferred_releases`).
    fn complete_deferred_releases(&mut self, tier: usize) {
        let now = Instant::now();
        let mut i = 0;
        while i < self.deferred.len() {
            let d = &self.deferred[i];
            if d.tier != tier || !d.flag.is_set() {
                i += 1;
                continue;
            }
            let d = self.deferred.remove(i);
            if let Err(e) = self.primary.manager_mut().release_deferred_write(&d.slots) {
                tracing::error!(job_id = d.job_id, "deferred release: {e}");
            }
            self.metrics.on_deferred_release_done(
                tier,
                d.slots.len(),
                now.duration_since(d.since).as_secs_f64(),
            );
        }
    }

    /// Failed promotions holding primary chunks (vLLM 0.34 `_deferred_releases`): `(job id,
    /// tier, chunk ids)`, in the order they were deferred.
    pub fn deferred_releases(&self) -> Vec<(JobId, usize, Vec<u32>)> {
        self.deferred
            .iter()
            .map(|d| (d.job_id, d.tier, d.slots.clone()))
            .collect()
    }

    fn complete_promotion(&mut self, meta: &JobMeta, r: &JobResult) {
        let job = &meta.job;
        if r.success {
            // Every key landed (the usual case): the job's own keys, not a copy of them, in
            // the slots the job holds.
            self.primary
                .complete_write_job(&job.keys, &job.chunk_ids, &job.req_context, true);
        } else {
            self.complete_failed_promotion(meta, r);
        }
        if self.expired_jobs.remove(&job.job_id) {
            for k in &job.keys {
                self.expired_keys.remove(k);
            }
        }
    }

    /// A promotion that failed in part or whole: the keys that landed complete, the others are
    /// released (their load source forgotten, and marked when the fix is on).
    fn complete_failed_promotion(&mut self, meta: &JobMeta, r: &JobResult) {
        let job = &meta.job;
        let (ok, failed): (Vec<OffloadKey>, Vec<OffloadKey>) = match &r.successful_keys {
            Some(s) if !s.is_empty() => {
                let sset: HashSet<OffloadKey> = s.iter().copied().collect();
                if !s.iter().all(|k| job.keys.contains(k)) {
                    tracing::error!(
                        job_id = r.job_id,
                        "promotion reported unknown successful keys"
                    );
                }
                let failed = job
                    .keys
                    .iter()
                    .copied()
                    .filter(|k| !sset.contains(k))
                    .collect();
                let ok = job
                    .keys
                    .iter()
                    .copied()
                    .filter(|k| sset.contains(k))
                    .collect();
                (ok, failed)
            }
            _ => (Vec::new(), job.keys.clone()),
        };
        if let Some(ls) = self.load_sources.get_mut(job.req_context.req_id()) {
            let src = self.tiers[meta.tier].cache_hit_source();
            for k in &failed {
                if ls.get(k) == Some(&src) {
                    ls.remove(k);
                }
            }
        }
        if !ok.is_empty() {
            self.primary.complete_write(&ok, &job.req_context, true);
        }
        if !failed.is_empty() {
            let deferred = r.deferred_release.as_ref().and_then(|flag| {
                match self.primary.manager_mut().defer_write_release(&failed) {
                    Ok(slots) => Some((flag.clone(), slots)),
                    Err(e) => {
                        tracing::error!(job_id = r.job_id, "deferred release refused: {e}");
                        None
                    }
                }
            });
            match deferred {
                Some((flag, slots)) => {
                    self.metrics.on_release_deferred(meta.tier, slots.len());
                    self.deferred.push(DeferredHold {
                        job_id: r.job_id,
                        tier: meta.tier,
                        flag,
                        slots,
                        since: Instant::now(),
                    });
                }
                None => self
                    .primary
                    .complete_write(&failed, &job.req_context, false),
            }
            if self.fixes.failed_load_reads_miss {
                let bit = 1u64 << meta.tier;
                for k in &failed {
                    *self.failed_marks.entry(*k).or_insert(0) |= bit;
                }
            }
        }
    }

    fn should_store_to_tier(&mut self, tier: usize, n: usize) -> bool {
        match self.tiers[tier].bp_detector() {
            None => true,
            Some(d) => d.should_store(n),
        }
    }

    fn update_backpressure(&mut self, tier: usize, job: &TierJob, r: &JobResult) {
        let bs = self.tiers[tier].block_size_bytes();
        let t = &mut self.tiers[tier];
        let Some(d) = t.bp_detector() else { return };
        let was = d.is_under_pressure();
        if r.success {
            let bytes = r.transfer_bytes.unwrap_or((job.keys.len() * bs) as u64);
            d.on_store_completed(job, bytes);
        } else {
            d.on_store_failed();
        }
        let now = d.is_under_pressure();
        if now != was {
            let ema = d.store_latency_ema();
            tracing::info!(tier, tier_type = %t.tier_type(), ema = ?ema,
                "back-pressure {}", if now { "activated" } else { "cleared" });
        }
    }

    /// Lookup that skips tier `exclude` (the parent-callback path).
    pub fn lookup_excluding(
        &mut self,
        key: &OffloadKey,
        ctx: &ReqContext,
        exclude: Option<usize>,
    ) -> LookupResult {
        self.maybe_process_finished_jobs();
        let t0 = self.metrics.start();
        let primary = self.primary.manager_mut().lookup(key, ctx);
        // The reading that ended one timed lookup starts the next (see `Metrics::on_lookup`).
        let mut ended = self.metrics.on_lookup(0, primary, t0, ctx, key);
        match primary {
            LookupResult::Hit => return LookupResult::Hit,
            LookupResult::HitPending => {
                if !self.expired_keys.is_empty() && self.expired_keys.contains(key) {
                    return LookupResult::Miss;
                }
                return LookupResult::HitPending;
            }
            _ => {}
        }
        if self.promotions_held {
            return LookupResult::Miss;
        }
        let mut any_retry = false;
        let filter = ctx.load_tier_filter();
        for i in 0..self.tiers.len() {
            if Some(i) == exclude {
                continue;
            }
            let tier = &mut self.tiers[i];
            if !filter.is_all() && !filter.allows(tier.medium(), tier.locality()) {
                continue;
            }
            if !self.failed_marks.is_empty()
                && self
                    .failed_marks
                    .get(key)
                    .is_some_and(|m| m & (1 << i) != 0)
            {
                continue;
            }
            let t0 = match ended.take() {
                Some(t) => Some(t),
                None => self.metrics.start(),
            };
            let r = tier.lookup(key, ctx);
            if r == LookupResult::Hit {
                self.metrics.on_lookup(i + 1, r, t0, ctx, key);
                if let Some(cap) = self.fixes.max_promotions_per_step
                    && self.promotions_this_step >= cap
                {
                    return LookupResult::Miss;
                }
                return if self.initiate_promotion(i, key, ctx) {
                    LookupResult::HitPending
                } else {
                    LookupResult::Miss
                };
            }
            if r == LookupResult::Retry {
                any_retry = true;
            }
            ended = self.metrics.on_lookup(i + 1, r, t0, ctx, key);
        }
        if any_retry {
            LookupResult::Retry
        } else {
            LookupResult::Miss
        }
    }

    fn initiate_promotion(&mut self, tier: usize, key: &OffloadKey, ctx: &ReqContext) -> bool {
        // One key at a time (as vLLM does), into buffers kept between promotions.
        let placed = self.primary.prepare_write_into(
            std::slice::from_ref(key),
            ctx,
            &mut self.promotion_out,
        );
        if placed {
            self.pend_promotion(tier, ctx);
        } else {
            self.metrics.on_promotion_allocation_failure();
        }
        placed
    }

    /// Records a placed promotion (its one-key store, in `promotion_out`) as pending for `tier`.
    fn pend_promotion(&mut self, tier: usize, ctx: &ReqContext) {
        let out = &self.promotion_out;
        let src = self.tiers[tier].cache_hit_source();
        let spare = &mut self.spare_sources;
        let ls = self
            .load_sources
            .entry_ref(ctx.req_id())
            .or_insert_with(|| spare.pop().unwrap_or_default());
        for k in &out.keys_to_store {
            ls.insert(*k, src);
        }
        self.promotions_this_step += out.keys_to_store.len();
        let ids = out.store_spec.chunk_ids().unwrap_or(&[]);
        let (t, slot) = match self.last_pending {
            Some((lt, uid, t, j)) if lt == tier && uid == ctx.uid() => (t, j),
            _ => {
                let t = match self.pending.iter().position(|(t, _)| *t == tier) {
                    Some(t) => t,
                    None => {
                        self.pending.push((tier, Vec::new()));
                        self.pending.len() - 1
                    }
                };
                let j = match self.pending_index.get(&(tier, ctx.req_id_arc().clone())) {
                    Some(&j) => j,
                    None => {
                        let v = &mut self.pending[t].1;
                        // Room for a few promotions: a request promotes its chunks one
                        // lookup at a time.
                        v.push(PendingPromotion {
                            req_context: ctx.clone(),
                            keys: Vec::with_capacity(16),
                            chunk_ids: Vec::with_capacity(16),
                        });
                        let j = v.len() - 1;
                        self.pending_index
                            .insert((tier, ctx.req_id_arc().clone()), j);
                        j
                    }
                };
                self.last_pending = Some((tier, ctx.uid(), t, j));
                (t, j)
            }
        };
        let e = &mut self.pending[t].1[slot];
        e.keys.extend_from_slice(&out.keys_to_store);
        e.chunk_ids.extend_from_slice(ids);
    }

    fn flush_pending_promotions(&mut self) {
        if self.pending.is_empty() {
            return;
        }
        let pending = std::mem::take(&mut self.pending);
        self.pending_index.clear();
        self.last_pending = None;
        let now = Instant::now();
        for (tier, entries) in pending {
            for e in entries {
                let job_id = self.next_job_id();
                let job = Arc::new(TierJob {
                    job_id,
                    keys: e.keys,
                    chunk_ids: e.chunk_ids,
                    is_promotion: true,
                    req_context: e.req_context,
                    submit_time: now,
                });
                self.register(job.clone(), tier);
                if let Some(d) = self.fixes.hit_pending_deadline {
                    self.deadlines.push_back((now + d, job_id));
                }
                self.tiers[tier].submit_load(job);
            }
        }
    }

    /// Cancels promotions past their deadline (fix for vLLM #49829): their keys read `MISS`.
    fn expire_promotions(&mut self) {
        if self.deadlines.is_empty() {
            return;
        }
        let now = Instant::now();
        let mut n = 0;
        while let Some(&(d, id)) = self.deadlines.front() {
            if d > now {
                break;
            }
            self.deadlines.pop_front();
            if let Some(meta) = self.jobs.get(&id) {
                self.expired_jobs.insert(id);
                for k in &meta.job.keys {
                    self.expired_keys.insert(*k);
                }
                n += meta.job.keys.len();
            }
        }
        if n > 0 {
            tracing::warn!(
                chunks = n,
                "HIT_PENDING promotions past their deadline read MISS"
            );
            self.metrics.on_deadline_expired(n);
        }
    }

    /// Pins primary chunks and registers a store job for `tier` (vLLM `create_store_job`).
    pub fn create_store_job(
        &mut self,
        keys: &[OffloadKey],
        ctx: &ReqContext,
        tier: usize,
    ) -> Result<Arc<TierJob>> {
        let spec = self.primary.prepare_read(keys, ctx)?;
        let chunk_ids = match spec {
            LoadStoreSpec::Cpu(c) => c.chunk_ids,
            _ => unreachable!("the primary tier returns CPU specs"),
        };
        let job_id = self.next_job_id();
        let job = Arc::new(TierJob {
            job_id,
            keys: keys.to_vec(),
            chunk_ids,
            is_promotion: false,
            req_context: ctx.clone(),
            submit_time: Instant::now(),
        });
        self.register(job.clone(), tier);
        Ok(job)
    }

    fn cascade_existing(&mut self, keys: &[OffloadKey], ctx: &ReqContext) -> Result<()> {
        let req = ctx.req_id();
        let mut ready = Vec::new();
        let mut parked = Vec::new();
        for k in keys {
            match self.primary.manager_mut().lookup(k, ctx) {
                LookupResult::Hit => ready.push(*k),
                LookupResult::HitPending => parked.push(*k),
                _ => {}
            }
        }
        let Some(state) = self.req_state.get_mut(req) else {
            return Err(TieringError::UnknownRequest {
                call: "prepare_store",
                req_id: req.to_string(),
            });
        };
        state.pending_cascade_keys.extend(parked);
        if ready.is_empty() {
            return Ok(());
        }
        let tiers = state.request_level_tiers.clone();
        for t in tiers {
            if !self.should_store_to_tier(t, ready.len()) {
                continue;
            }
            let job = self.create_store_job(&ready, ctx, t)?;
            self.tiers[t].submit_store(job);
        }
        Ok(())
    }

    fn flush_pending_cascades(&mut self) {
        let mut reqs: Vec<(u64, Arc<str>)> = self
            .req_state
            .iter()
            .filter(|(_, s)| !s.pending_cascade_keys.is_empty())
            .map(|(k, s)| (s.seq, k.clone()))
            .collect();
        if reqs.is_empty() {
            return;
        }
        reqs.sort();
        for (_, req) in reqs {
            let Some(state) = self.req_state.get_mut(&req) else {
                continue;
            };
            let keys = std::mem::take(&mut state.pending_cascade_keys);
            let ctx = state.req_context.clone();
            if let Err(e) = self.cascade_existing(&keys, &ctx) {
                tracing::error!(error = %e, "parked cascade");
            }
            self.maybe_finalize(&req, None);
        }
    }

    /// `on_new_request` skipping tier `exclude`.
    pub fn on_new_request_excluding(
        &mut self,
        ctx: &ReqContext,
        exclude: Option<usize>,
    ) -> RequestOffloadingContext {
        let mut rl = Vec::new();
        for (i, t) in self.tiers.iter_mut().enumerate() {
            if Some(i) == exclude {
                continue;
            }
            if t.on_new_request(ctx).policy == OffloadScope::RequestLevel {
                rl.push(i);
            }
        }
        let policy = if rl.is_empty() {
            OffloadScope::ChunkLevel
        } else {
            OffloadScope::RequestLevel
        };
        self.metrics.on_new_request(ctx);
        let seq = match self.req_state.get(ctx.req_id()) {
            Some(s) => s.seq,
            None => {
                self.req_seq += 1;
                self.req_seq
            }
        };
        self.req_state.insert(
            ctx.req_id_arc().clone(),
            RequestState {
                seq,
                req_context: ctx.clone(),
                pending_primary_stores: 0,
                is_finished: false,
                request_level_tiers: rl,
                pending_cascade_keys: Vec::new(),
            },
        );
        RequestOffloadingContext { policy }
    }

    /// `on_request_finished` skipping tier `exclude`.
    pub fn on_request_finished_excluding(
        &mut self,
        ctx: &ReqContext,
        exclude: Option<usize>,
    ) -> Result<()> {
        if !self.req_state.contains_key(ctx.req_id()) {
            return Err(TieringError::UnknownRequest {
                call: "on_request_finished",
                req_id: ctx.req_id().to_string(),
            });
        }
        self.primary.manager_mut().on_request_finished(ctx)?;
        let s = self.req_state.get_mut(ctx.req_id()).expect("checked");
        s.is_finished = true;
        let req = ctx.req_id_arc().clone();
        self.maybe_finalize(&req, exclude);
        Ok(())
    }

    fn maybe_finalize(&mut self, req: &Arc<str>, exclude: Option<usize>) {
        let Some(s) = self.req_state.get(req) else {
            return;
        };
        if !s.is_finished || s.pending_primary_stores != 0 || !s.pending_cascade_keys.is_empty() {
            return;
        }
        let s = self.req_state.remove(req).expect("present");
        for (i, t) in self.tiers.iter_mut().enumerate() {
            if Some(i) == exclude {
                continue;
            }
            t.on_request_finished(&s.req_context);
        }
        self.metrics.on_request_finished(req);
        if let Some(mut sources) = self.load_sources.remove(req)
            && self.spare_sources.len() < MAX_SPARE_SOURCES
            && sources.capacity() <= MAX_SPARE_SOURCE_KEYS
        {
            sources.clear();
            self.spare_sources.push(sources);
        }
    }

    fn check_live(&self, call: &'static str) -> Result<()> {
        if self.shut_down {
            return Err(TieringError::Shutdown { call });
        }
        Ok(())
    }
}

struct TierParent<'a> {
    m: &'a mut TieringOffloadingManager,
    origin: usize,
}

impl ParentManager for TierParent<'_> {
    fn on_new_request(&mut self, ctx: &ReqContext) -> Result<RequestOffloadingContext> {
        Ok(self.m.on_new_request_excluding(ctx, Some(self.origin)))
    }
    fn lookup(&mut self, key: &OffloadKey, ctx: &ReqContext) -> LookupResult {
        self.m.lookup_excluding(key, ctx, Some(self.origin))
    }
    fn create_store_job(&mut self, keys: &[OffloadKey], ctx: &ReqContext) -> Result<Arc<TierJob>> {
        self.m.create_store_job(keys, ctx, self.origin)
    }
    fn on_request_finished(&mut self, ctx: &ReqContext) -> Result<()> {
        self.m.on_request_finished_excluding(ctx, Some(self.origin))
    }
}

impl OffloadingManager for TieringOffloadingManager {
    #[inline]
    fn lookup(&mut self, key: &OffloadKey, ctx: &ReqContext) -> LookupResult {
        if let Some(cpu) = self.alone() {
            return cpu.lookup(key, ctx);
        }
        self.lookup_excluding(key, ctx, None)
    }

    fn prepare_load(&mut self, keys: &[OffloadKey], ctx: &ReqContext) -> Result<LoadStoreSpec> {
        if let Some(cpu) = self.alone() {
            return cpu.prepare_load(keys, ctx);
        }
        self.check_live("prepare_load")?;
        self.primary.manager_mut().prepare_load(keys, ctx)
    }

    fn touch(&mut self, keys: &[OffloadKey], ctx: &ReqContext) -> Result<()> {
        if let Some(cpu) = self.alone() {
            return cpu.touch(keys, ctx);
        }
        self.primary.manager_mut().touch(keys, ctx)?;
        for t in &mut self.tiers {
            t.touch(keys, ctx);
        }
        Ok(())
    }

    fn complete_load(&mut self, keys: &[OffloadKey], ctx: &ReqContext) -> Result<()> {
        if let Some(cpu) = self.alone() {
            return cpu.complete_load(keys, ctx);
        }
        self.primary.manager_mut().complete_load(keys, ctx)
    }

    fn prepare_store(
        &mut self,
        keys: &[OffloadKey],
        ctx: &ReqContext,
    ) -> Result<Option<PrepareStoreOutput>> {
        if let Some(cpu) = self.alone() {
            return cpu.prepare_store(keys, ctx);
        }
        self.check_live("prepare_store")?;
        if !self.req_state.contains_key(ctx.req_id()) {
            return Err(TieringError::UnknownRequest {
                call: "prepare_store",
                req_id: ctx.req_id().to_string(),
            });
        }
        self.processed_this_step = true;
        self.process_finished_jobs();
        let Some(out) = self.primary.manager_mut().prepare_store(keys, ctx)? else {
            return Ok(None);
        };
        let state = self.req_state.get_mut(ctx.req_id()).expect("checked");
        if !out.keys_to_store.is_empty() {
            state.pending_primary_stores += 1;
        }
        if !state.request_level_tiers.is_empty() {
            let to_store: HashSet<OffloadKey> = out.keys_to_store.iter().copied().collect();
            let existing: Vec<OffloadKey> = keys
                .iter()
                .copied()
                .filter(|k| !to_store.contains(k))
                .collect();
            if !existing.is_empty() {
                self.cascade_existing(&existing, ctx)?;
            }
        }
        Ok(Some(out))
    }

    fn complete_store(
        &mut self,
        keys: &[OffloadKey],
        ctx: &ReqContext,
        success: bool,
    ) -> Result<()> {
        if let Some(cpu) = self.alone() {
            return cpu.complete_store(keys, ctx, success);
        }
        let call = "complete_store";
        match self.req_state.get(ctx.req_id()) {
            None => {
                return Err(TieringError::UnknownRequest {
                    call,
                    req_id: ctx.req_id().to_string(),
                });
            }
            Some(s) if s.pending_primary_stores == 0 => {
                return Err(TieringError::NoPendingStore {
                    call,
                    req_id: ctx.req_id().to_string(),
                });
            }
            _ => {}
        }
        if success {
            // The slots found here (the request's hints from its `prepare_store`, else one
            // probe per key) are completed, then pinned for each tier's cascade (every key is
            // resident, checked here, and ready once completed).
            let mut slots = std::mem::take(&mut self.scratch_slots);
            if let Err(key) = self.primary.manager().resident_slots(keys, ctx, &mut slots) {
                self.scratch_slots = slots;
                return Err(TieringError::UnknownKey { call, key });
            }
            self.primary
                .manager_mut()
                .complete_store_at(keys, &slots, ctx);
            for i in 0..self.tiers.len() {
                if !self.should_store_to_tier(i, keys.len()) {
                    continue;
                }
                let chunk_ids = self.primary.prepare_read_slots(&slots);
                let job_id = self.next_job_id();
                let job = Arc::new(TierJob {
                    job_id,
                    keys: keys.to_vec(),
                    chunk_ids,
                    is_promotion: false,
                    req_context: ctx.clone(),
                    submit_time: Instant::now(),
                });
                self.register(job.clone(), i);
                self.tiers[i].submit_store(job);
            }
            self.scratch_slots = slots;
        } else {
            self.primary
                .manager_mut()
                .complete_store(keys, ctx, success)?;
        }
        let req = ctx.req_id_arc().clone();
        let s = self.req_state.get_mut(&req).expect("checked");
        s.pending_primary_stores -= 1;
        self.maybe_finalize(&req, None);
        Ok(())
    }

    fn on_new_request(&mut self, ctx: &ReqContext) -> Result<RequestOffloadingContext> {
        if let Some(cpu) = self.alone() {
            return cpu.on_new_request(ctx);
        }
        self.check_live("on_new_request")?;
        Ok(self.on_new_request_excluding(ctx, None))
    }

    fn on_request_finished(&mut self, ctx: &ReqContext) -> Result<()> {
        if let Some(cpu) = self.alone() {
            return cpu.on_request_finished(ctx);
        }
        self.on_request_finished_excluding(ctx, None)
    }

    fn take_events(&mut self) -> Vec<OffloadingEvent> {
        if let Some(cpu) = self.alone() {
            return cpu.take_events();
        }
        let mut v = self.primary.manager_mut().take_events();
        for t in &mut self.tiers {
            v.extend(t.take_events());
        }
        v
    }

    fn on_schedule_end(&mut self, context: &ScheduleEndContext) -> Result<()> {
        if self.alone {
            return Ok(());
        }
        self.maybe_process_finished_jobs();
        for i in 0..self.tiers.len() {
            let mut tier = std::mem::replace(&mut self.tiers[i], Box::new(Detached));
            tier.serve_external_requests(&mut TierParent { m: self, origin: i });
            self.tiers[i] = tier;
        }
        self.processed_this_step = false;
        self.expire_promotions();
        self.flush_pending_promotions();
        self.flush_pending_cascades();
        for t in &mut self.tiers {
            t.on_schedule_end(context);
        }
        for req in &context.new_req_ids {
            if self.req_state.contains_key(req.as_str()) {
                self.metrics.on_request_allocated(req);
            }
        }
        self.promotions_this_step = 0;
        Ok(())
    }

    fn has_pending_work(&self) -> bool {
        if self.alone {
            return false;
        }
        !self.jobs.is_empty()
            || !self.deferred.is_empty()
            || self
                .req_state
                .values()
                .any(|s| !s.pending_cascade_keys.is_empty())
            || self.tiers.iter().any(|t| t.has_pending_work())
    }

    fn reset_cache(&mut self) -> Result<()> {
        if let Some(cpu) = self.alone() {
            return cpu.reset_cache();
        }
        for (i, t) in self.tiers.iter_mut().enumerate() {
            t.drain_jobs().map_err(|e| TieringError::Tier {
                tier: i,
                tier_type: t.tier_type().to_string(),
                message: format!("drain_jobs: {e}"),
            })?;
        }
        self.process_finished_jobs();
        if !self.deferred.is_empty() {
            // A tier's drain_jobs must set every deferred-release flag before it returns.
            let d = &self.deferred[0];
            return Err(TieringError::Tier {
                tier: d.tier,
                tier_type: self.tiers[d.tier].tier_type().to_string(),
                message: format!(
                    "reset_cache: {} deferred releases still pending after drain_jobs (a tier \
                     must set each deferred_release before drain_jobs returns)",
                    self.deferred.len()
                ),
            });
        }
        if !self.jobs.is_empty() {
            if !self.fixes.reset_drops_stale_jobs {
                return Err(TieringError::Tier {
                    tier: self.jobs.values().next().map_or(0, |m| m.tier),
                    tier_type: "?".into(),
                    message: format!(
                        "reset_cache: {} jobs still unreported after drain_jobs",
                        self.jobs.len()
                    ),
                });
            }
            tracing::warn!(
                jobs = self.jobs.len(),
                "reset_cache drops jobs unreported after drain_jobs"
            );
            for (_, m) in self.jobs.drain() {
                self.metrics.release(m.tier, &m.job);
            }
            self.stale_below = self.job_counter;
        }
        self.pending.clear();
        self.pending_index.clear();
        self.last_pending = None;
        self.load_sources.clear();
        self.deadlines.clear();
        self.expired_jobs.clear();
        self.expired_keys.clear();
        debug_assert!(self.metrics.is_idle());
        let mut states: Vec<(u64, Arc<str>)> = self
            .req_state
            .iter()
            .map(|(k, s)| (s.seq, k.clone()))
            .collect();
        states.sort();
        let mut finished = Vec::new();
        for (_, req) in states {
            let s = self.req_state.get_mut(&req).expect("present");
            s.pending_primary_stores = 0;
            s.pending_cascade_keys.clear();
            if !s.is_finished {
                continue;
            }
            let ctx = s.req_context.clone();
            for t in &mut self.tiers {
                t.on_request_finished(&ctx);
            }
            self.metrics.on_request_finished(ctx.req_id());
            finished.push(req);
        }
        self.primary.manager_mut().reset_cache()?;
        for r in finished {
            self.req_state.remove(&r);
        }
        self.processed_this_step = false;
        for t in &mut self.tiers {
            if let Some(d) = t.bp_detector() {
                d.reset();
            }
        }
        self.promotions_held = !self.tiers.is_empty();
        self.promotions_this_step = 0;
        Ok(())
    }

    fn on_reset_flushed(&mut self) {
        self.promotions_held = false;
    }

    fn get_stats(&mut self) -> Option<OffloadingConnectorStats> {
        if let Some(cpu) = self.alone() {
            return cpu.get_stats();
        }
        let mut stats = Some(self.primary.manager_mut().stats()).filter(|s| !s.is_empty());
        for i in 0..self.tiers.len() {
            if let Some(d) = self.tiers[i].bp_detector() {
                let ema = d.store_latency_ema();
                let dropped = d.pop_stores_dropped();
                self.metrics.record_backpressure(i, ema, dropped);
            }
        }
        if let Some(m) = self.metrics.take_stats() {
            match &mut stats {
                None => stats = Some(m),
                Some(s) => s.aggregate(m),
            }
        }
        for t in &mut self.tiers {
            if let Some(ts) = t.get_stats().filter(|s| !s.is_empty()) {
                match &mut stats {
                    None => stats = Some(ts),
                    Some(s) => s.aggregate(ts),
                }
            }
        }
        stats
    }

    fn shutdown(&mut self) -> Result<()> {
        if self.alone {
            return Ok(());
        }
        let mut err = None;
        for (i, t) in self.tiers.iter_mut().enumerate() {
            if let Err(e) = t.shutdown() {
                tracing::error!(tier = i, tier_type = t.tier_type(), error = %e, "secondary tier shutdown failed");
                err = Some(TieringError::Tier {
                    tier: i,
                    tier_type: t.tier_type().to_string(),
                    message: format!("shutdown: {e}"),
                });
            }
        }
        if let Some(e) = err {
            return Err(e);
        }
        self.primary.shutdown();
        self.shut_down = true;
        Ok(())
    }

    fn get_load_source(&self, key: &OffloadKey, ctx: &ReqContext) -> CacheHitSource {
        if self.alone {
            return CacheHitSource::Host;
        }
        if let Some(src) = self.load_sources.get(ctx.req_id()).and_then(|m| m.get(key)) {
            return *src;
        }
        CacheHitSource::Host
    }
}
