//! Tiering metrics (vLLM `tiering/metrics.py`), labelled `0:primary` and `<idx+1>:<tier_type>`.
//!
//! Counters live in per-label arrays so the lookup path only bumps integers; they are turned
//! into an [`OffloadingConnectorStats`] at `get_stats`. Simplification against vLLM: a key looked
//! up again by the same request is counted again (vLLM counts it once until the request is
//! allocated), and lookup latency histograms are recorded only when enabled (two clock reads per
//! tier per lookup).
//!
//! The clock is [`quanta`]'s: the CPU's invariant time-stamp counter, calibrated against the
//! monotonic clock once per process (and that clock itself where the CPU has no invariant
//! counter). A primary lookup is a hash probe of about 100 ns, and vLLM times every one: two
//! `clock_gettime` calls cost half as much again here, two counter reads a tenth.

use hashbrown::HashMap;

use crate::key::OffloadKey;

use crate::stats::{OffloadingConnectorStats, names};
use crate::tiering::base::{JobResult, TierJob};
use crate::types::LookupResult;

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
    /// When a `RETRY` started, in `clock`'s raw ticks.
    retry_started: HashMap<(usize, u64, OffloadKey), u64>,
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
            retry_started: HashMap::new(),
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

    /// A lookup answered by `label`; `start` is set when latency is recorded. A `RETRY`
    /// starts the asynchronous delay of (request, key) at that tier; the resolving `HIT`/`MISS`
    /// observes it.
    ///
    /// Returns the clock reading that ended the lookup, if one was made: the start of the next
    /// tier's lookup asked right after (one reading between two timed lookups, not two).
    #[inline]
    pub(crate) fn on_lookup(
        &mut self,
        label: usize,
        result: LookupResult,
        start: Option<u64>,
        ctx_uid: u64,
        key: &OffloadKey,
    ) -> Option<u64> {
        if matches!(result, LookupResult::Hit | LookupResult::Miss) {
            self.queries[label] += 1;
            if result == LookupResult::Hit {
                self.hits[label] += 1;
            }
            if let Some(s) = start {
                let now = self.clock.raw();
                let d = self.seconds(s, now);
                self.delays[label].push(d);
                if !self.retry_started.is_empty()
                    && let Some(t) = self.retry_started.remove(&(label, ctx_uid, *key))
                {
                    let d = self.seconds(t, now);
                    self.async_delays[label].push(d);
                }
                return Some(now);
            }
        } else if result == LookupResult::Retry
            && let Some(s) = start
        {
            self.retry_started
                .entry((label, ctx_uid, *key))
                .or_insert(s);
        }
        None
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
