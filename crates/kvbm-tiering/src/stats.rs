//! Metrics collected since the last `get_stats` (vLLM `OffloadingConnectorStats`): gauges,
//! counters and histogram observations, each keyed by metric name and label values
//! (tier labels like `0:primary`, `1:disk`). A metric with several label values (the
//! promotion latency's tier and outcome) joins them with [`LABEL_SEP`] in its one label.

use std::collections::BTreeMap;

/// Separates the values of a metric with several labels (`1:disk` + `success`).
pub const LABEL_SEP: char = '\u{1f}';

/// Metric names (vLLM's Prometheus names).
pub mod names {
    /// CPU cache usage (pinned or pending / capacity).
    pub const CPU_CACHE_USAGE_PERC: &str = "vllm:kv_offload_cpu_cache_usage_perc";
    /// Pending writes / capacity.
    pub const CPU_CACHE_WRITE_USAGE_PERC: &str = "vllm:kv_offload_cpu_cache_write_usage_perc";
    /// usage - write usage.
    pub const CPU_CACHE_READ_USAGE_PERC: &str = "vllm:kv_offload_cpu_cache_read_usage_perc";
    /// Chunks per prepare_store (histogram).
    pub const CPU_ALLOCATION_SIZE: &str = "vllm:kv_offload_cpu_allocation_size";
    /// Stores skipped by the threshold filter.
    pub const STORES_SKIPPED: &str = "vllm:kv_offload_stores_skipped";
    /// Lookup delay per tier (histogram, seconds).
    pub const LOOKUP_SYNC_DELAY: &str = "vllm:kv_offload_tiering_lookup_sync_delay_seconds";
    /// First RETRY to resolution (histogram, seconds).
    pub const LOOKUP_ASYNC_DELAY: &str = "vllm:kv_offload_tiering_lookup_async_delay_seconds";
    /// Bytes read from a tier (promotions).
    pub const READ_BYTES: &str = "vllm:kv_offload_tiering_read_bytes";
    /// Seconds reading.
    pub const READ_TIME: &str = "vllm:kv_offload_tiering_read_time";
    /// Bytes written to a tier (cascades).
    pub const WRITE_BYTES: &str = "vllm:kv_offload_tiering_write_bytes";
    /// Seconds writing.
    pub const WRITE_TIME: &str = "vllm:kv_offload_tiering_write_time";
    /// Failed promotion jobs.
    pub const PROMOTION_JOB_FAILURES: &str = "vllm:kv_offload_tiering_promotion_job_failures";
    /// Failed cascade jobs.
    pub const CASCADE_JOB_FAILURES: &str = "vllm:kv_offload_tiering_cascade_job_failures";
    /// Chunk lookups per tier.
    pub const CHUNK_QUERIES: &str = "vllm:kv_offload_tiering_chunk_queries";
    /// Chunk hits per tier.
    pub const CHUNK_HITS: &str = "vllm:kv_offload_tiering_chunk_hits";
    /// Primary slots reserved by promotions / capacity.
    pub const PRIMARY_WRITE_USAGE_PERC: &str = "vllm:kv_offload_tiering_primary_write_usage_perc";
    /// Primary slots pinned by cascades / capacity.
    pub const PRIMARY_READ_USAGE_PERC: &str = "vllm:kv_offload_tiering_primary_read_usage_perc";
    /// Promotions refused for lack of primary room.
    pub const PROMOTION_ALLOCATION_FAILURES: &str =
        "vllm:kv_offload_tiering_promotion_allocation_failures";
    /// In-flight promotion jobs.
    pub const ACTIVE_PROMOTION_JOBS: &str = "vllm:kv_offload_tiering_active_promotion_jobs";
    /// Submission to completion of a promotion job (histogram, seconds; labels: tier and
    /// `success` / `failure`).
    pub const PROMOTION_LATENCY: &str = "vllm:kv_offload_tiering_promotion_latency_seconds";
    /// Primary chunks held by failed promotions' deferred releases (vLLM 0.34).
    pub const DEFERRED_RELEASE_CHUNKS: &str = "vllm:kv_offload_tiering_deferred_release_chunks";
    /// How long a deferred release held its chunks, seconds (vLLM 0.34).
    pub const DEFERRED_RELEASE_HOLD: &str = "vllm:kv_offload_tiering_deferred_release_hold_seconds";
    /// In-flight cascade jobs.
    pub const ACTIVE_CASCADE_JOBS: &str = "vllm:kv_offload_tiering_active_cascade_jobs";
    /// Backpressure EMA (s/MiB).
    pub const BACKPRESSURE_STORE_LATENCY_EMA: &str =
        "vllm:kv_offload_tiering_backpressure_store_latency_ema";
    /// Cascades dropped by backpressure.
    pub const BACKPRESSURE_STORES_DROPPED: &str =
        "vllm:kv_offload_tiering_backpressure_stores_dropped";
    /// Blocks of dropped cascades.
    pub const BACKPRESSURE_BLOCKS_DROPPED: &str =
        "vllm:kv_offload_tiering_backpressure_blocks_dropped";
    /// HIT_PENDING promotions cancelled by the deadline (kvbm fix for vLLM #49829).
    pub const HIT_PENDING_DEADLINE_EXPIRED: &str = "vllm:kv_offload_hit_pending_deadline_expired";
}

/// A metric identity: name and one optional label value (the tier label).
pub type MetricKey = (&'static str, Option<String>);

/// Metrics since the last drain.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct OffloadingConnectorStats {
    /// Last value of each gauge.
    pub gauges: BTreeMap<MetricKey, f64>,
    /// Increments of each counter.
    pub counters: BTreeMap<MetricKey, f64>,
    /// Observations of each histogram.
    pub histograms: BTreeMap<MetricKey, Vec<f64>>,
}

impl OffloadingConnectorStats {
    /// Sets a gauge.
    pub fn set_gauge(&mut self, name: &'static str, label: Option<&str>, v: f64) {
        self.gauges.insert((name, label.map(str::to_owned)), v);
    }
    /// Increases a counter.
    pub fn increase_counter(&mut self, name: &'static str, label: Option<&str>, v: f64) {
        *self
            .counters
            .entry((name, label.map(str::to_owned)))
            .or_insert(0.0) += v;
    }
    /// Records a histogram observation.
    pub fn observe_histogram(&mut self, name: &'static str, label: Option<&str>, v: f64) {
        self.histograms
            .entry((name, label.map(str::to_owned)))
            .or_default()
            .push(v);
    }
    /// Records histogram observations in order, as many [`Self::observe_histogram`] calls
    /// would (no series is made when there are none), looking the series up once.
    pub fn observe_histogram_all(
        &mut self,
        name: &'static str,
        label: Option<&str>,
        values: impl IntoIterator<Item = f64>,
    ) {
        let mut values = values.into_iter().peekable();
        if values.peek().is_none() {
            return;
        }
        self.histograms
            .entry((name, label.map(str::to_owned)))
            .or_default()
            .extend(values);
    }
    /// Whether nothing was recorded.
    pub fn is_empty(&self) -> bool {
        self.gauges.is_empty() && self.counters.is_empty() && self.histograms.is_empty()
    }
    /// Merges another stats object into this one (gauges overwrite, counters add, histograms append).
    pub fn aggregate(&mut self, other: OffloadingConnectorStats) {
        self.gauges.extend(other.gauges);
        for (k, v) in other.counters {
            *self.counters.entry(k).or_insert(0.0) += v;
        }
        for (k, mut v) in other.histograms {
            self.histograms.entry(k).or_default().append(&mut v);
        }
    }
    /// A gauge value.
    pub fn gauge(&self, name: &str, label: Option<&str>) -> Option<f64> {
        self.gauges
            .iter()
            .find(|((n, l), _)| *n == name && l.as_deref() == label)
            .map(|(_, v)| *v)
    }
    /// A counter value.
    pub fn counter(&self, name: &str, label: Option<&str>) -> Option<f64> {
        self.counters
            .iter()
            .find(|((n, l), _)| *n == name && l.as_deref() == label)
            .map(|(_, v)| *v)
    }
    /// Histogram observations.
    pub fn histogram(&self, name: &str, label: Option<&str>) -> Option<&[f64]> {
        self.histograms
            .iter()
            .find(|((n, l), _)| *n == name && l.as_deref() == label)
            .map(|(_, v)| v.as_slice())
    }
}
