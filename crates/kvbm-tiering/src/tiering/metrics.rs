//! Tiering metrics (vLLM `tiering/metrics.py`), labelled `0:primary` and `<idx+1>:<tier_type>`.
//!
//! Counters live in per-label arrays so the lookup path only bumps integers; they are turned
//! into an [`OffloadingConnectorStats`] at `get_stats`.
//!
//! Lookups are counted as vLLM's `TieringMetricsTracker.on_lookup` counts them, so a dashboard
//! built on vLLM's series means the same over kvbm ([`Observed`]): per request, tier and key,
//! once, when it resolves (`HIT` or `MISS`), and only until the request is allocated (the step
//! that first schedules it); a `RETRY` starts the key's asynchronous wait, and its resolution
//! is counted even after an earlier one. `HIT_PENDING` is never counted. The one difference:
//! lookup latency histograms are recorded only when enabled (two clock reads per tier per
//! lookup).
//!
//! The clock is [`quanta`]'s: the CPU's invariant time-stamp counter, calibrated against the
//! monotonic clock once per process (and that clock itself where the CPU has no invariant
//! counter). A primary lookup is a hash probe of about 100 ns, and vLLM times every one: two
//! `clock_gettime` calls cost half as much again here, two counter reads a tenth.

use std::sync::Arc;

use hashbrown::{HashMap, HashTable};

use crate::key::{KeyHasher, OffloadKey};

use crate::stats::{OffloadingConnectorStats, names};
use crate::tiering::base::{JobResult, TierJob};
use crate::types::{LookupResult, ReqContext};

/// What vLLM's tracker remembers of a request's lookups (`observed_lookups`): per key, a bit
/// per label whose lookup of it was counted; the `RETRY` waits not yet resolved, rare, apart.
///
/// A (label, key) is counted at its first resolution (`HIT` or `MISS`); a later one is not,
/// whatever came between. A `RETRY` before the first resolution starts the key's wait at that
/// label (its first `RETRY` only), which the resolution observes.
///
/// One probe per key, not per label: a lookup asks the primary and then each tier about the
/// same key, so the entry last used is checked first (a 40-byte compare), and only a new key
/// is hashed (with the crate's [`KeyHasher`]; keys are digests already). The table holds
/// 4-byte entry indices (as the primary's `SlotIndex` does), the entries a dense vector, so a
/// request's whole record stays a few cache lines per dozen keys.
#[derive(Default)]
struct Seen {
    /// `(key, labels counted)`: bit `label` of the mask, in first-lookup order.
    entries: Vec<(OffloadKey, u128)>,
    /// Indices into `entries`, by key.
    index: HashTable<u32>,
    /// The entry last returned by [`mask`](Self::mask) (an index into `entries`, or past its
    /// end when there is none).
    last: u32,
    hasher: KeyHasher,
    /// `(label, key)` → when its first `RETRY` started (when latency is recorded).
    waiting: HashMap<(u8, OffloadKey), Option<u64>>,
}

impl Seen {
    /// `key`'s mask of counted labels, made empty when it has none (at most one probe).
    #[inline]
    fn mask(&mut self, key: &OffloadKey) -> &mut u128 {
        let last = self.last as usize;
        if last < self.entries.len() && self.entries[last].0 == *key {
            return &mut self.entries[last].1;
        }
        let (h, entries) = (&self.hasher, &self.entries);
        let i = match self.index.entry(
            h.hash(key),
            |&i| entries[i as usize].0 == *key,
            |&i| h.hash(&entries[i as usize].0),
        ) {
            hashbrown::hash_table::Entry::Occupied(e) => *e.get(),
            hashbrown::hash_table::Entry::Vacant(v) => {
                let i = entries.len() as u32;
                v.insert(i);
                self.entries.push((*key, 0));
                i
            }
        };
        self.last = i;
        &mut self.entries[i as usize].1
    }

    /// Forgets every key (the capacity stays).
    fn clear(&mut self) {
        self.entries.clear();
        self.index.clear();
        self.last = 0;
        self.waiting.clear();
    }

    /// Keys it has room for without growing.
    fn capacity(&self) -> usize {
        self.index.capacity()
    }
}

/// One request's lookups as vLLM's tracker sees them (`_RequestMetricsState`); `seen: None`
/// once the request was allocated (nothing more is counted for it).
struct RequestLookups {
    uid: u64,
    seen: Option<Seen>,
}

/// The requests' [`RequestLookups`] by request id, in a slab, with the last one used
/// remembered by its context's uid: nearly every lookup is the same request's as the one
/// before, and then finds its record without hashing the request id.
///
/// Invariant: `by_id[id] = i` exactly when `slab[i]` is live for `id`; `last = (uid, i)` is
/// used only while `slab[i].uid == uid` (context uids are unique and never [`FREE`]).
#[derive(Default)]
struct Observed {
    by_id: HashMap<Arc<str>, u32>,
    slab: Vec<RequestLookups>,
    free: Vec<u32>,
    last: (u64, u32),
    /// Cleared [`Seen`] tables of allocated or finished requests, kept for new ones (their
    /// capacity with them: a new request's table would otherwise grow from empty, a rehash at
    /// a time, on the lookup path).
    spare: Vec<Seen>,
}

/// Cleared tables kept, at most, and the largest kept.
const MAX_SPARE_SEEN: usize = 64;
const MAX_SPARE_SEEN_KEYS: usize = 4096;

/// The uid of a free slab slot.
const FREE: u64 = u64::MAX;

impl Observed {
    fn fresh(&mut self, uid: u64) -> RequestLookups {
        RequestLookups {
            uid,
            seen: Some(self.spare.pop().unwrap_or_default()),
        }
    }

    /// Keeps a request's table for a later request, cleared, within the bounds above.
    fn recycle(&mut self, seen: Option<Seen>) {
        if let Some(mut seen) = seen
            && self.spare.len() < MAX_SPARE_SEEN
            && seen.capacity() <= MAX_SPARE_SEEN_KEYS
        {
            seen.clear();
            self.spare.push(seen);
        }
    }

    /// Starts slot `i` afresh for a context `uid`, its old table recycled.
    fn restart(&mut self, i: u32, uid: u64) {
        let fresh = self.fresh(uid);
        let old = std::mem::replace(&mut self.slab[i as usize], fresh);
        self.recycle(old.seen);
    }

    /// `ctx`'s record, started when it has none (vLLM's `on_lookup` does the same), or
    /// restarted when the record is another context's of the same id.
    #[inline]
    fn of(&mut self, ctx: &ReqContext) -> &mut RequestLookups {
        let uid = ctx.uid();
        let (last_uid, i) = self.last;
        if last_uid == uid && self.slab.get(i as usize).is_some_and(|r| r.uid == uid) {
            return &mut self.slab[i as usize];
        }
        let i = match self.by_id.get(ctx.req_id()) {
            Some(&i) => {
                if self.slab[i as usize].uid != uid {
                    self.restart(i, uid);
                }
                i
            }
            None => self.insert(ctx),
        };
        self.last = (uid, i);
        &mut self.slab[i as usize]
    }

    fn insert(&mut self, ctx: &ReqContext) -> u32 {
        let r = self.fresh(ctx.uid());
        let i = match self.free.pop() {
            Some(i) => {
                self.slab[i as usize] = r;
                i
            }
            None => {
                self.slab.push(r);
                (self.slab.len() - 1) as u32
            }
        };
        self.by_id.insert(ctx.req_id_arc().clone(), i);
        i
    }

    /// A new request: its record starts afresh.
    fn start(&mut self, ctx: &ReqContext) {
        match self.by_id.get(ctx.req_id()) {
            Some(&i) => self.restart(i, ctx.uid()),
            None => {
                self.insert(ctx);
            }
        }
    }

    fn allocated(&mut self, req_id: &str) {
        if let Some(&i) = self.by_id.get(req_id) {
            let seen = self.slab[i as usize].seen.take();
            self.recycle(seen);
        }
    }

    fn finished(&mut self, req_id: &str) {
        if let Some(i) = self.by_id.remove(req_id) {
            let old = std::mem::replace(
                &mut self.slab[i as usize],
                RequestLookups {
                    uid: FREE,
                    seen: None,
                },
            );
            self.recycle(old.seen);
            self.free.push(i);
        }
    }
}

#[derive(Default, Clone)]
struct TierState {
    active_promotions: u64,
    active_cascades: u64,
    write_chunks: u64,
    read_chunks: u64,
    deferred_chunks: u64,
}

pub(crate) struct Metrics {
    pub labels: Vec<String>,
    tiers: Vec<TierState>,
    num_primary_chunks: usize,
    chunk_bytes: usize,
    pub record_latency: bool,
    clock: quanta::Clock,
    queries: Vec<u64>,
    hits: Vec<u64>,
    delays: Vec<Vec<f64>>,
    async_delays: Vec<Vec<f64>>,
    /// Each request's lookups, counted as vLLM counts them (module docs).
    observed: Observed,
    stats: OffloadingConnectorStats,
    /// Report the deferred-release gauge (vLLM 0.34's tracker has it, 0.33's does not).
    pub deferred_release: bool,
}

impl Metrics {
    pub(crate) fn new(
        tier_types: &[String],
        num_primary_chunks: usize,
        chunk_bytes: usize,
    ) -> Self {
        let mut labels = vec!["0:primary".to_string()];
        labels.extend(
            tier_types
                .iter()
                .enumerate()
                .map(|(i, t)| format!("{}:{t}", i + 1)),
        );
        let n = labels.len();
        Self {
            labels,
            tiers: vec![TierState::default(); tier_types.len()],
            num_primary_chunks,
            chunk_bytes,
            record_latency: false,
            clock: quanta::Clock::new(),
            queries: vec![0; n],
            hits: vec![0; n],
            delays: vec![Vec::new(); n],
            async_delays: vec![Vec::new(); n],
            observed: Observed::default(),
            stats: OffloadingConnectorStats::default(),
            deferred_release: false,
        }
    }

    /// The start of a timed lookup (`None` when latency is not recorded), for [`on_lookup`](Self::on_lookup).
    #[inline]
    pub(crate) fn start(&self) -> Option<u64> {
        self.record_latency.then(|| self.clock.raw())
    }

    /// Seconds between two raw readings of `clock`.
    #[inline]
    fn seconds(&self, start: u64, end: u64) -> f64 {
        self.clock.delta_as_nanos(start, end) as f64 * 1e-9
    }

    /// A new request (vLLM `on_new_request`): its lookups start being counted afresh.
    pub(crate) fn on_new_request(&mut self, ctx: &ReqContext) {
        self.observed.start(ctx);
    }

    /// The request was scheduled (vLLM `on_request_allocated`): its lookups count no more.
    pub(crate) fn on_request_allocated(&mut self, req_id: &str) {
        self.observed.allocated(req_id);
    }

    /// The request is gone (vLLM `on_request_finished`).
    pub(crate) fn on_request_finished(&mut self, req_id: &str) {
        self.observed.finished(req_id);
    }

    /// A lookup answered by `label` for `ctx` (vLLM `on_lookup`, see the module docs); `start`
    /// is set when latency is recorded.
    ///
    /// Returns the clock reading that ended the lookup, if one was made: the start of the next
    /// tier's lookup asked right after (one reading between two timed lookups, not two).
    #[inline]
    pub(crate) fn on_lookup(
        &mut self,
        label: usize,
        result: LookupResult,
        start: Option<u64>,
        ctx: &ReqContext,
        key: &OffloadKey,
    ) -> Option<u64> {
        let resolved = matches!(result, LookupResult::Hit | LookupResult::Miss);
        if !resolved && result != LookupResult::Retry {
            return None;
        }
        let Some(seen) = self.observed.of(ctx).seen.as_mut() else {
            return None; // allocated: vLLM counts nothing more for the request
        };
        let bit = 1u128 << label;
        let mask = seen.mask(key);
        if *mask & bit != 0 {
            return None; // counted already (a later RETRY or resolution changes nothing)
        }
        if !resolved {
            // RETRY: the wait starts at the first one (vLLM's `setdefault`).
            seen.waiting.entry((label as u8, *key)).or_insert(start);
            return None;
        }
        *mask |= bit;
        let waited = if seen.waiting.is_empty() {
            None
        } else {
            seen.waiting.remove(&(label as u8, *key))
        };
        self.queries[label] += 1;
        if result == LookupResult::Hit {
            self.hits[label] += 1;
        }
        let s = start?;
        let now = self.clock.raw();
        let d = self.seconds(s, now);
        self.delays[label].push(d);
        if let Some(Some(t)) = waited {
            let d = self.seconds(t, now);
            self.async_delays[label].push(d);
        }
        Some(now)
    }

    pub(crate) fn on_job_registered(&mut self, tier: usize, job: &TierJob) {
        let st = &mut self.tiers[tier];
        let n = job.chunk_ids.len() as u64;
        if job.is_promotion {
            st.active_promotions += 1;
            st.write_chunks += n;
        } else {
            st.active_cascades += 1;
            st.read_chunks += n;
        }
    }

    pub(crate) fn on_job_finished(&mut self, tier: usize, job: &TierJob, r: &JobResult) {
        let label = self.labels[tier + 1].clone();
        if job.is_promotion {
            // vLLM 0.33: from submission (so tier queueing counts), failures included.
            let outcome = if r.success { "success" } else { "failure" };
            self.stats.observe_histogram(
                names::PROMOTION_LATENCY,
                Some(&format!("{label}{}{outcome}", crate::stats::LABEL_SEP)),
                job.submit_time.elapsed().as_secs_f64(),
            );
        }
        let mut count = job.keys.len();
        let mut record = true;
        if !r.success {
            let m = if job.is_promotion {
                names::PROMOTION_JOB_FAILURES
            } else {
                names::CASCADE_JOB_FAILURES
            };
            self.stats.increase_counter(m, Some(&label), 1.0);
            match &r.successful_keys {
                Some(k) if job.is_promotion && !k.is_empty() => count = k.len(),
                _ => record = false,
            }
        }
        if record {
            let (b, t) = if job.is_promotion {
                (names::READ_BYTES, names::READ_TIME)
            } else {
                (names::WRITE_BYTES, names::WRITE_TIME)
            };
            self.stats
                .increase_counter(b, Some(&label), (count * self.chunk_bytes) as f64);
            if let Some(tt) = r.transfer_time {
                self.stats.increase_counter(t, Some(&label), tt);
            }
        }
        self.release(tier, job);
    }

    /// Forgets a job without an outcome (dropped as stale at reset).
    pub(crate) fn release(&mut self, tier: usize, job: &TierJob) {
        let st = &mut self.tiers[tier];
        let n = job.chunk_ids.len() as u64;
        if job.is_promotion {
            st.active_promotions = st.active_promotions.saturating_sub(1);
            st.write_chunks = st.write_chunks.saturating_sub(n);
        } else {
            st.active_cascades = st.active_cascades.saturating_sub(1);
            st.read_chunks = st.read_chunks.saturating_sub(n);
        }
    }

    /// A failed promotion of `tier` holds `chunks` primary chunks (vLLM `on_release_deferred`).
    pub(crate) fn on_release_deferred(&mut self, tier: usize, chunks: usize) {
        self.tiers[tier].deferred_chunks += chunks as u64;
    }

    /// A deferred release of `chunks` ended after `held` seconds (vLLM
    /// `on_deferred_release_done`).
    pub(crate) fn on_deferred_release_done(&mut self, tier: usize, chunks: usize, held: f64) {
        let st = &mut self.tiers[tier];
        st.deferred_chunks = st.deferred_chunks.saturating_sub(chunks as u64);
        let label = self.labels[tier + 1].clone();
        self.stats
            .observe_histogram(names::DEFERRED_RELEASE_HOLD, Some(&label), held);
    }

    pub(crate) fn on_promotion_allocation_failure(&mut self) {
        self.stats
            .increase_counter(names::PROMOTION_ALLOCATION_FAILURES, None, 1.0);
    }

    pub(crate) fn on_deadline_expired(&mut self, n: usize) {
        self.stats
            .increase_counter(names::HIT_PENDING_DEADLINE_EXPIRED, None, n as f64);
    }

    pub(crate) fn record_backpressure(
        &mut self,
        tier: usize,
        ema: Option<f64>,
        dropped: (u64, u64),
    ) {
        let label = self.labels[tier + 1].clone();
        if let Some(ema) = ema {
            self.stats
                .set_gauge(names::BACKPRESSURE_STORE_LATENCY_EMA, Some(&label), ema);
        }
        if dropped.0 > 0 {
            self.stats.increase_counter(
                names::BACKPRESSURE_STORES_DROPPED,
                Some(&label),
                dropped.0 as f64,
            );
        }
        if dropped.1 > 0 {
            self.stats.increase_counter(
                names::BACKPRESSURE_BLOCKS_DROPPED,
                Some(&label),
                dropped.1 as f64,
            );
        }
    }

    pub(crate) fn is_idle(&self) -> bool {
        self.tiers.iter().all(|t| {
            t.active_cascades == 0
                && t.active_promotions == 0
                && t.read_chunks == 0
                && t.write_chunks == 0
                && t.deferred_chunks == 0
        })
    }

    pub(crate) fn take_stats(&mut self) -> Option<OffloadingConnectorStats> {
        let mut out = OffloadingConnectorStats::default();
        let n = self.num_primary_chunks as f64;
        for (i, t) in self.tiers.iter().enumerate() {
            let l = Some(self.labels[i + 1].as_str());
            let (w, r) = if self.num_primary_chunks > 0 {
                (t.write_chunks as f64 / n, t.read_chunks as f64 / n)
            } else {
                (0.0, 0.0)
            };
            out.set_gauge(names::PRIMARY_WRITE_USAGE_PERC, l, w);
            out.set_gauge(names::PRIMARY_READ_USAGE_PERC, l, r);
            out.set_gauge(names::ACTIVE_PROMOTION_JOBS, l, t.active_promotions as f64);
            out.set_gauge(names::ACTIVE_CASCADE_JOBS, l, t.active_cascades as f64);
            if self.deferred_release {
                out.set_gauge(names::DEFERRED_RELEASE_CHUNKS, l, t.deferred_chunks as f64);
            }
        }
        for i in 0..self.labels.len() {
            let l = Some(self.labels[i].as_str());
            if self.queries[i] > 0 {
                out.increase_counter(names::CHUNK_QUERIES, l, self.queries[i] as f64);
                self.queries[i] = 0;
            }
            if self.hits[i] > 0 {
                out.increase_counter(names::CHUNK_HITS, l, self.hits[i] as f64);
                self.hits[i] = 0;
            }
            // One series lookup per metric, not one per lookup of the step.
            out.observe_histogram_all(names::LOOKUP_SYNC_DELAY, l, self.delays[i].drain(..));
            out.observe_histogram_all(names::LOOKUP_ASYNC_DELAY, l, self.async_delays[i].drain(..));
        }
        out.aggregate(std::mem::take(&mut self.stats));
        (!out.is_empty()).then_some(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `mask` finds a key's entry whoever was asked last (the shortcut is only a shortcut),
    /// keeps each key's bits apart, and a cleared table (recycled for a new request) knows
    /// nothing, its shortcut included.
    #[test]
    fn a_requests_masks_are_per_key_whatever_order_they_are_asked_in() {
        let mut seen = Seen::default();
        let (a, b, c) = (
            OffloadKey::from_u64(1),
            OffloadKey::from_u64(2),
            OffloadKey::from_u64(3),
        );
        *seen.mask(&a) |= 1;
        *seen.mask(&a) |= 2; // the shortcut
        *seen.mask(&b) |= 4;
        assert_eq!(*seen.mask(&a), 3, "found again after another key");
        assert_eq!(*seen.mask(&b), 4);
        assert_eq!(*seen.mask(&c), 0, "a new key starts empty");
        // Many keys (the table grows, indices stay valid).
        for i in 10..2000u64 {
            *seen.mask(&OffloadKey::from_u64(i)) |= u128::from(i as u8);
        }
        for i in (10..2000u64).rev() {
            assert_eq!(*seen.mask(&OffloadKey::from_u64(i)), u128::from(i as u8));
        }
        assert_eq!(*seen.mask(&a), 3);
        seen.clear();
        assert_eq!(*seen.mask(&a), 0, "cleared, the last entry too");
        assert_eq!(seen.entries.len(), 1);
    }
}
