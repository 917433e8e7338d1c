//! Metrics through the [`metrics`] facade. The library installs no exporter: a binary installs a
//! recorder (Prometheus, statsd, …) and the pipelines report to it.
//!
//! Every series carries the label [`PIPELINE_LABEL`] (`pipeline`) with the pipeline's
//! [`PipelineLane`] name, its (source, destination) pair: `g1_to_g2`, `g2_to_g3`, `g2_to_g4`,
//! `g3_to_g2`, `g4_to_g2`, `g2_to_g1`, ….
//!
//! | name | kind | extra label | what |
//! |---|---|---|---|
//! | [`BLOCKS_ENQUEUED`] | counter | | blocks given to `enqueue` |
//! | [`BLOCKS_FILTERED`] | counter | `reason` = `policy`, `policy_error`, `duplicate` | blocks left out: the policy said no; its evaluation failed, timed out or returned a mis-sized verdict; or the block was already in flight in this pipeline |
//! | [`BLOCKS_CANCELLED`] | counter | | blocks dropped by cancellation before their upgrade |
//! | [`BLOCKS_TRANSFERRED`] | counter | | blocks the executor transferred (and registered) |
//! | [`BLOCKS_FAILED`] | counter | `reason` = [`BlockFailureKind`] in snake case | blocks that failed |
//! | [`BATCHES_SUBMITTED`] | counter | | batches handed to the transfer executor |
//! | [`BATCH_SIZE`] | histogram | | blocks per submitted batch |
//! | [`POLICY_TIMEOUTS`] | counter | | policy evaluations (one per enqueued container) that exceeded `policy_timeout` |
//! | [`TRANSFERS_IN_FLIGHT`] | gauge | | batches being executed (upgraded, not yet settled) |
//! | [`CANCEL_CONFIRMATION_SECONDS`] | histogram | | seconds from the first cancel request of a transfer to its confirmation (every piece released) |
//! | [`TRANSFERS_IN_FLIGHT_MAX`] | gauge | | the most batches ever in flight at once (high-water mark of [`TRANSFERS_IN_FLIGHT`]) |
//! | [`MAX_CONCURRENT_TRANSFERS`] | gauge | | the configured bound on batches in flight (`max_concurrent_transfers`) |
//! | [`QUEUE_HIGH_WATER`] | gauge | `queue` = `input`, `precondition`, `batch`, `transfer` | the most items ever waiting in that queue at once |
//! | [`QUEUE_CAPACITY`] | gauge | `queue` | that queue's configured bound |
//!
//! The bounds are exported beside their high-water marks so a scrape alone shows that
//! backpressure held: `*_high_water <= *_capacity` and `in_flight_max <= max_concurrent`.
//!
//! Every block given to `enqueue` ends in exactly one of filtered, cancelled, transferred or
//! failed, so once the pipeline is idle
//! `enqueued = filtered + cancelled + transferred + failed`.
//!
//! # Cost
//!
//! The handles are resolved once per pipeline, when it is spawned, and shared (one `Arc`) by its
//! stages and transfers: the hot path only bumps counters, never looks a series up or allocates.
//! A consequence: **install the recorder before spawning pipelines** (or building the
//! [`OffloadEngine`](crate::engine::OffloadEngine)); a pipeline spawned before keeps reporting to the
//! recorder that was current then (the no-op one, if none).

use metrics::{Counter, Gauge, Histogram, Unit, counter, gauge, histogram};

use crate::error::BlockFailureKind;
use crate::settlement::PipelineLane;

/// Label carrying the pipeline's lane name (`g2_to_g3`, …) on every series.
pub const PIPELINE_LABEL: &str = "pipeline";
/// Label carrying why a block was filtered or failed.
pub const REASON_LABEL: &str = "reason";

/// Blocks given to `enqueue` (counter).
pub const BLOCKS_ENQUEUED: &str = "kvbm_offload_blocks_enqueued_total";
/// Blocks filtered out, by `reason`: `policy`, `policy_error`, `duplicate` (counter).
pub const BLOCKS_FILTERED: &str = "kvbm_offload_blocks_filtered_total";
/// Blocks dropped by cancellation before their upgrade (counter).
pub const BLOCKS_CANCELLED: &str = "kvbm_offload_blocks_cancelled_total";
/// Blocks transferred and registered in the destination (counter).
pub const BLOCKS_TRANSFERRED: &str = "kvbm_offload_blocks_transferred_total";
/// Blocks that failed, by `reason` ([`BlockFailureKind::as_str`]) (counter).
pub const BLOCKS_FAILED: &str = "kvbm_offload_blocks_failed_total";
/// Batches handed to the transfer executor (counter).
pub const BATCHES_SUBMITTED: &str = "kvbm_offload_batches_submitted_total";
/// Blocks per submitted batch (histogram).
pub const BATCH_SIZE: &str = "kvbm_offload_batch_size_blocks";
/// Policy evaluations that exceeded `policy_timeout` (counter).
pub const POLICY_TIMEOUTS: &str = "kvbm_offload_policy_timeouts_total";
/// Batches being executed: upgraded and not yet settled (gauge).
pub const TRANSFERS_IN_FLIGHT: &str = "kvbm_offload_transfers_in_flight";
/// Seconds from a transfer's first cancel request to its confirmation (histogram).
pub const CANCEL_CONFIRMATION_SECONDS: &str = "kvbm_offload_cancel_confirmation_seconds";

/// The most batches ever in flight at once (gauge).
pub const TRANSFERS_IN_FLIGHT_MAX: &str = "kvbm_offload_transfers_in_flight_max";
/// The configured bound on batches in flight (gauge).
pub const MAX_CONCURRENT_TRANSFERS: &str = "kvbm_offload_max_concurrent_transfers";
/// The most items ever waiting in one stage queue, by `queue` (gauge).
pub const QUEUE_HIGH_WATER: &str = "kvbm_offload_queue_high_water";
/// A stage queue's configured bound, by `queue` (gauge).
pub const QUEUE_CAPACITY: &str = "kvbm_offload_queue_capacity";
/// Label carrying a stage queue's name.
pub const QUEUE_LABEL: &str = "queue";

/// Every metric name, for exporters that want to pre-register or allow-list them.
pub const ALL: [&str; 14] = [
    BLOCKS_ENQUEUED,
    BLOCKS_FILTERED,
    BLOCKS_CANCELLED,
    BLOCKS_TRANSFERRED,
    BLOCKS_FAILED,
    BATCHES_SUBMITTED,
    BATCH_SIZE,
    POLICY_TIMEOUTS,
    TRANSFERS_IN_FLIGHT,
    CANCEL_CONFIRMATION_SECONDS,
    TRANSFERS_IN_FLIGHT_MAX,
    MAX_CONCURRENT_TRANSFERS,
    QUEUE_HIGH_WATER,
    QUEUE_CAPACITY,
];

const FAILURE_KINDS: [BlockFailureKind; BlockFailureKind::ALL.len()] = BlockFailureKind::ALL;

/// Registers the units and descriptions of every metric with the current recorder.
///
/// Called when a pipeline is spawned; a binary may call it itself right after installing its
/// recorder so the descriptions exist before the first pipeline does.
pub fn describe() {
    use metrics::{describe_counter, describe_gauge, describe_histogram};
    describe_counter!(BLOCKS_ENQUEUED, Unit::Count, "Blocks given to enqueue.");
    describe_counter!(
        BLOCKS_FILTERED,
        Unit::Count,
        "Blocks filtered out (reason: policy, policy_error, duplicate)."
    );
    describe_counter!(
        BLOCKS_CANCELLED,
        Unit::Count,
        "Blocks dropped by cancellation before their upgrade."
    );
    describe_counter!(
        BLOCKS_TRANSFERRED,
        Unit::Count,
        "Blocks transferred and registered in the destination."
    );
    describe_counter!(
        BLOCKS_FAILED,
        Unit::Count,
        "Blocks that failed (reason: the failure kind)."
    );
    describe_counter!(
        BATCHES_SUBMITTED,
        Unit::Count,
        "Batches handed to the transfer executor."
    );
    describe_histogram!(BATCH_SIZE, Unit::Count, "Blocks per submitted batch.");
    describe_counter!(
        POLICY_TIMEOUTS,
        Unit::Count,
        "Policy evaluations that exceeded policy_timeout."
    );
    describe_gauge!(
        TRANSFERS_IN_FLIGHT,
        Unit::Count,
        "Batches being executed (upgraded, not yet settled)."
    );
    describe_histogram!(
        CANCEL_CONFIRMATION_SECONDS,
        Unit::Seconds,
        "Seconds from a transfer's first cancel request to its confirmation."
    );
    describe_gauge!(
        TRANSFERS_IN_FLIGHT_MAX,
        Unit::Count,
        "The most batches ever in flight at once."
    );
    describe_gauge!(
        MAX_CONCURRENT_TRANSFERS,
        Unit::Count,
        "The configured bound on batches in flight."
    );
    describe_gauge!(
        QUEUE_HIGH_WATER,
        Unit::Count,
        "The most items ever waiting in a stage queue (queue: its name)."
    );
    describe_gauge!(
        QUEUE_CAPACITY,
        Unit::Count,
        "A stage queue's configured bound (queue: its name)."
    );
}

/// Why blocks were filtered (the `reason` label of [`BLOCKS_FILTERED`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum FilterReason {
    /// The policy's verdict was `false`.
    Policy,
    /// The evaluation failed, timed out or returned a mis-sized verdict.
    PolicyError,
    /// Already in flight in this pipeline.
    Duplicate,
}

/// One pipeline's metric handles, resolved once when it is spawned.
pub(crate) struct PipelineMetrics {
    enqueued: Counter,
    filtered_policy: Counter,
    filtered_policy_error: Counter,
    filtered_duplicate: Counter,
    cancelled: Counter,
    transferred: Counter,
    failed: [Counter; FAILURE_KINDS.len()],
    batches: Counter,
    batch_size: Histogram,
    policy_timeouts: Counter,
    in_flight: Gauge,
    cancel_confirmation: Histogram,
    /// Batches in flight now, and the most ever (exported to `in_flight_max`).
    in_flight_now: std::sync::atomic::AtomicU64,
    in_flight_high: std::sync::atomic::AtomicU64,
    in_flight_max: Gauge,
    lane: &'static str,
}

fn failure_index(kind: BlockFailureKind) -> usize {
    kind.index()
}

impl PipelineMetrics {
    /// Resolves every handle for `lane` with the current recorder.
    pub(crate) fn new(lane: PipelineLane) -> Self {
        describe();
        let p = lane.as_str();
        let filtered = |reason: &'static str| counter!(BLOCKS_FILTERED, PIPELINE_LABEL => p, REASON_LABEL => reason);
        Self {
            enqueued: counter!(BLOCKS_ENQUEUED, PIPELINE_LABEL => p),
            filtered_policy: filtered("policy"),
            filtered_policy_error: filtered("policy_error"),
            filtered_duplicate: filtered("duplicate"),
            cancelled: counter!(BLOCKS_CANCELLED, PIPELINE_LABEL => p),
            transferred: counter!(BLOCKS_TRANSFERRED, PIPELINE_LABEL => p),
            failed: FAILURE_KINDS
                .map(|k| counter!(BLOCKS_FAILED, PIPELINE_LABEL => p, REASON_LABEL => k.as_str())),
            batches: counter!(BATCHES_SUBMITTED, PIPELINE_LABEL => p),
            batch_size: histogram!(BATCH_SIZE, PIPELINE_LABEL => p),
            policy_timeouts: counter!(POLICY_TIMEOUTS, PIPELINE_LABEL => p),
            in_flight: gauge!(TRANSFERS_IN_FLIGHT, PIPELINE_LABEL => p),
            cancel_confirmation: histogram!(CANCEL_CONFIRMATION_SECONDS, PIPELINE_LABEL => p),
            in_flight_now: std::sync::atomic::AtomicU64::new(0),
            in_flight_high: std::sync::atomic::AtomicU64::new(0),
            in_flight_max: gauge!(TRANSFERS_IN_FLIGHT_MAX, PIPELINE_LABEL => p),
            lane: p,
        }
    }

    /// Exports the lane's bounds: `max_concurrent_transfers` and each queue's capacity.
    pub(crate) fn bounds(&self, max_concurrent: usize, queues: &[(&'static str, usize)]) {
        gauge!(MAX_CONCURRENT_TRANSFERS, PIPELINE_LABEL => self.lane).set(max_concurrent as f64);
        for &(q, cap) in queues {
            gauge!(QUEUE_CAPACITY, PIPELINE_LABEL => self.lane, QUEUE_LABEL => q).set(cap as f64);
        }
    }

    /// The gauge of `queue`'s high-water mark.
    pub(crate) fn queue_high_water(&self, queue: &'static str) -> Gauge {
        gauge!(QUEUE_HIGH_WATER, PIPELINE_LABEL => self.lane, QUEUE_LABEL => queue)
    }

    #[inline]
    pub(crate) fn enqueued(&self, n: usize) {
        self.enqueued.increment(n as u64);
    }

    #[inline]
    pub(crate) fn filtered(&self, reason: FilterReason, n: usize) {
        if n == 0 {
            return;
        }
        match reason {
            FilterReason::Policy => &self.filtered_policy,
            FilterReason::PolicyError => &self.filtered_policy_error,
            FilterReason::Duplicate => &self.filtered_duplicate,
        }
        .increment(n as u64);
    }

    #[inline]
    pub(crate) fn cancelled(&self, n: usize) {
        if n > 0 {
            self.cancelled.increment(n as u64);
        }
    }

    #[inline]
    pub(crate) fn transferred(&self, n: usize) {
        if n > 0 {
            self.transferred.increment(n as u64);
        }
    }

    #[inline]
    pub(crate) fn failed(&self, tally: &FailureTally) {
        for (c, &n) in self.failed.iter().zip(&tally.0) {
            if n > 0 {
                c.increment(n);
            }
        }
    }

    #[inline]
    pub(crate) fn policy_timeout(&self) {
        self.policy_timeouts.increment(1);
    }

    /// A batch of `n` blocks handed to the executor; the returned guard keeps it counted in
    /// [`TRANSFERS_IN_FLIGHT`] until dropped (also on panic).
    #[inline]
    pub(crate) fn submitted(&self, n: usize) -> InFlight<'_> {
        self.batches.increment(1);
        self.batch_size.record(n as f64);
        self.in_flight.increment(1.0);
        let now = self
            .in_flight_now
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed)
            + 1;
        if now
            > self
                .in_flight_high
                .fetch_max(now, std::sync::atomic::Ordering::Relaxed)
        {
            self.in_flight_max.set(now as f64);
        }
        InFlight(self)
    }

    #[inline]
    pub(crate) fn cancel_confirmed(&self, after: std::time::Duration) {
        self.cancel_confirmation.record(after.as_secs_f64());
    }
}

/// Failed blocks counted by kind under a lock, reported to the recorder after it is released
/// (no recorder code runs under the pipeline's leaf locks).
#[derive(Default)]
pub(crate) struct FailureTally([u64; FAILURE_KINDS.len()]);

impl FailureTally {
    #[inline]
    pub(crate) fn add(&mut self, kind: BlockFailureKind) {
        self.0[failure_index(kind)] += 1;
    }
}

/// Keeps one batch counted in [`TRANSFERS_IN_FLIGHT`].
pub(crate) struct InFlight<'a>(&'a PipelineMetrics);

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.0.in_flight.decrement(1.0);
        self.0
            .in_flight_now
            .fetch_sub(1, std::sync::atomic::Ordering::Relaxed);
    }
}
