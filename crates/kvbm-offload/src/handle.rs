//! Offload handles: status, results, incremental progress and per-block timing.
//!
//! A [`OffloadHandle`] is returned by every `enqueue`. It shares one state object with the
//! [`CancellationToken`] that travels with the offload's containers (P2), so a handle, its token
//! and the pipeline's accounting always agree.
//!
//! ```text
//!   Evaluating ──► Queued ──► Transferring ──► Complete | Failed | Cancelled
//!       │            │                              ▲
//!       └────────────┴── cancel() before upgrade ───┘ (Cancelled)
//! ```
//!
//! The terminal status is decided once, when the last piece of the offload leaves the
//! pipeline (see [`crate::cancel`]): `Cancelled` if any block was cancelled, else `Failed` if any
//! block failed, else `Complete` (filtered blocks do not make an offload fail).

pub mod cancel;

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Instant;

use kvbm_logical::SequenceHash;
use parking_lot::Mutex;
use tokio::sync::Notify;

use self::cancel::{AtomicStatus, CancelConfirmation, CancelState, CancellationToken};
use crate::error::{BlockFailure, OffloadError};
use crate::metrics::{FailureTally, PipelineMetrics};
use crate::settlement::LaneState;
use crate::sweep::SweepSignal;

/// Unique identifier for an offload (process-wide, monotonically increasing).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct OffloadId(u64);

impl OffloadId {
    /// A fresh id.
    pub fn next() -> Self {
        static NEXT: AtomicU64 = AtomicU64::new(1);
        OffloadId(NEXT.fetch_add(1, Ordering::Relaxed))
    }

    /// The raw value.
    pub fn as_u64(self) -> u64 {
        self.0
    }
}

impl std::fmt::Display for OffloadId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "transfer-{}", self.0)
    }
}

/// Status of an offload.
///
/// The discriminants are ordered: an offload only moves forward.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
#[repr(u8)]
pub enum OffloadStatus {
    /// Blocks are being evaluated by the policy.
    Evaluating = 0,
    /// Some blocks passed the policy and wait for their precondition, a batch or a transfer slot.
    Queued = 1,
    /// Some blocks were upgraded (committed, P3) and are being transferred.
    Transferring = 2,
    /// Every block completed or was filtered.
    Complete = 3,
    /// At least one block failed (and none was cancelled).
    Failed = 4,
    /// Cancellation was requested and applied to at least one block.
    Cancelled = 5,
}

impl OffloadStatus {
    pub(crate) fn from_u8(v: u8) -> Self {
        match v {
            0 => Self::Evaluating,
            1 => Self::Queued,
            2 => Self::Transferring,
            3 => Self::Complete,
            4 => Self::Failed,
            _ => Self::Cancelled,
        }
    }

    /// Whether the status is final.
    pub fn is_terminal(self) -> bool {
        self >= Self::Complete
    }
}

/// Timing trace for tracking block progression through pipeline stages.
///
/// Recorded once per container piece (cheap) and reported for each of its blocks. A stage the
/// block never reached stays `None`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TimingTrace {
    /// When `enqueue` accepted the blocks.
    pub enqueued: Instant,
    /// When the policy verdict was known.
    pub evaluated: Option<Instant>,
    /// When the precondition resolved (or was found absent).
    pub precondition_met: Option<Instant>,
    /// When the piece was placed into a batch handed to the transfer stage.
    pub batched: Option<Instant>,
    /// When the blocks were upgraded (the commitment point).
    pub upgraded: Option<Instant>,
    /// When the offload finished.
    pub finished: Option<Instant>,
}

impl TimingTrace {
    pub(crate) fn start(at: Instant) -> Self {
        Self {
            enqueued: at,
            evaluated: None,
            precondition_met: None,
            batched: None,
            upgraded: None,
            finished: None,
        }
    }

    /// Time from enqueue to the end of the offload, once finished.
    pub fn total(&self) -> Option<std::time::Duration> {
        self.finished.map(|f| f.duration_since(self.enqueued))
    }
}

/// Monotonic block counts for an offload.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct OffloadProgressCounts {
    /// Blocks given to `enqueue`.
    pub total: usize,
    /// Blocks that passed the policy.
    pub passed: usize,
    /// Blocks the policy (or duplicate suppression) filtered out.
    pub filtered: usize,
    /// Blocks transferred and registered in the destination.
    pub completed: usize,
    /// Blocks that failed.
    pub failed: usize,
    /// Blocks dropped by cancellation before their upgrade.
    pub cancelled: usize,
}

impl OffloadProgressCounts {
    /// Blocks with no outcome yet.
    pub fn remaining(&self) -> usize {
        self.total
            .saturating_sub(self.filtered + self.completed + self.failed + self.cancelled)
    }
}

/// Per-consumer cursor for incrementally reading offload progress.
///
/// Start from `OffloadProgressCursor::default()` and pass it to
/// [`OffloadHandle::progress_since`] repeatedly; each call returns only what was appended since.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct OffloadProgressCursor {
    completed: usize,
    failed: usize,
    filtered: usize,
    cancelled: usize,
}

/// Blocks appended since a [`OffloadProgressCursor`] was last consumed.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct OffloadProgressDelta {
    /// Newly completed blocks.
    pub completed: Vec<SequenceHash>,
    /// Newly failed blocks, with why.
    pub failed: Vec<(SequenceHash, BlockFailure)>,
    /// Newly filtered blocks.
    pub filtered: Vec<SequenceHash>,
    /// Newly cancelled blocks.
    pub cancelled: Vec<SequenceHash>,
}

impl OffloadProgressDelta {
    /// Whether nothing was appended.
    pub fn is_empty(&self) -> bool {
        self.completed.is_empty()
            && self.failed.is_empty()
            && self.filtered.is_empty()
            && self.cancelled.is_empty()
    }
}

/// Result of a completed offload.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OffloadResult {
    /// The transfer.
    pub id: OffloadId,
    /// Final status.
    pub status: OffloadStatus,
    /// Blocks transferred and registered in the destination, in completion order.
    pub completed_blocks: Vec<SequenceHash>,
    /// Blocks that failed, with why. Never registered in the destination.
    pub failed_blocks: Vec<(SequenceHash, BlockFailure)>,
    /// Blocks filtered by the policy or as duplicates of blocks already in flight.
    pub filtered_blocks: Vec<SequenceHash>,
    /// Blocks cancelled before their upgrade.
    pub cancelled_blocks: Vec<SequenceHash>,
}

#[derive(Default)]
pub(crate) struct Progress {
    pub(crate) passed: usize,
    pub(crate) completed: Vec<SequenceHash>,
    pub(crate) failed: Vec<(SequenceHash, BlockFailure)>,
    pub(crate) filtered: Vec<SequenceHash>,
    pub(crate) cancelled: Vec<SequenceHash>,
    /// `(first index into completed/failed order, count, trace)` per finished piece.
    pub(crate) timings: Vec<(SequenceHash, TimingTrace)>,
}

/// The state shared by a handle, its tokens and the pipeline's containers.
pub(crate) struct OffloadShared {
    pub(crate) id: OffloadId,
    pub(crate) total: AtomicUsize,
    pub(crate) cancel: tokio_util::sync::CancellationToken,
    pub(crate) outstanding: AtomicUsize,
    pub(crate) status: AtomicStatus,
    pub(crate) progress: Mutex<Progress>,
    drained_notify: Notify,
    sweep: Option<SweepSignal>,
    /// The lane the offload runs in (`None` for a detached token): a container dropped after
    /// its lane failed reports its blocks failed, not cancelled.
    pub(crate) lane: Option<Arc<LaneState>>,
    record_timing: bool,
    /// The pipeline's metric handles (`None` for a detached token).
    pub(crate) metrics: Option<Arc<PipelineMetrics>>,
    /// When cancellation was first requested (for the cancel-to-confirmation histogram).
    cancel_requested_at: OnceLock<Instant>,
}

impl OffloadShared {
    pub(crate) fn detached() -> Self {
        Self::new(None, None, false, None)
    }

    pub(crate) fn new(
        sweep: Option<SweepSignal>,
        lane: Option<Arc<LaneState>>,
        record_timing: bool,
        metrics: Option<Arc<PipelineMetrics>>,
    ) -> Self {
        Self {
            id: OffloadId::next(),
            total: AtomicUsize::new(0),
            cancel: tokio_util::sync::CancellationToken::new(),
            outstanding: AtomicUsize::new(0),
            status: AtomicStatus::new(OffloadStatus::Evaluating),
            progress: Mutex::new(Progress::default()),
            drained_notify: Notify::new(),
            sweep,
            lane,
            record_timing,
            metrics,
            cancel_requested_at: OnceLock::new(),
        }
    }

    pub(crate) fn record_timing(&self) -> bool {
        self.record_timing
    }

    pub(crate) fn request_cancel(&self) {
        if self.cancel.is_cancelled() {
            return;
        }
        if self.metrics.is_some() {
            // Before the token fires, so a drain it causes always finds the start time.
            let _ = self.cancel_requested_at.set(Instant::now());
        }
        self.cancel.cancel();
        if let Some(s) = &self.sweep {
            s.signal();
        }
    }

    pub(crate) fn on_drained(&self) {
        let p = self.progress.lock();
        let status = if !p.cancelled.is_empty() {
            OffloadStatus::Cancelled
        } else if !p.failed.is_empty() {
            OffloadStatus::Failed
        } else {
            OffloadStatus::Complete
        };
        drop(p);
        self.status.store(status);
        if let (Some(m), Some(at)) = (&self.metrics, self.cancel_requested_at.get()) {
            m.cancel_confirmed(at.elapsed());
        }
        self.drained_notify.notify_waiters();
    }

    pub(crate) async fn drained(&self) {
        loop {
            let notified = self.drained_notify.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if self.outstanding.load(Ordering::Acquire) == 0 {
                return;
            }
            notified.await;
        }
    }

    pub(crate) fn report_filtered(&self, hashes: impl IntoIterator<Item = SequenceHash>) {
        self.progress.lock().filtered.extend(hashes);
    }

    pub(crate) fn report_passed(&self, n: usize) {
        self.progress.lock().passed += n;
        self.status.advance(OffloadStatus::Queued);
    }

    pub(crate) fn report_cancelled(&self, hashes: impl IntoIterator<Item = SequenceHash>) {
        let mut p = self.progress.lock();
        let before = p.cancelled.len();
        p.cancelled.extend(hashes);
        let n = p.cancelled.len() - before;
        drop(p);
        if let Some(m) = &self.metrics {
            m.cancelled(n);
        }
    }

    pub(crate) fn report_failed(
        &self,
        failed: impl IntoIterator<Item = (SequenceHash, BlockFailure)>,
    ) {
        let mut p = self.progress.lock();
        let before = p.failed.len();
        p.failed.extend(failed);
        if let Some(m) = &self.metrics {
            let mut tally = FailureTally::default();
            for (_, f) in &p.failed[before..] {
                tally.add(f.kind);
            }
            drop(p);
            m.failed(&tally);
        }
    }

    pub(crate) fn counts(&self) -> OffloadProgressCounts {
        let p = self.progress.lock();
        OffloadProgressCounts {
            total: self.total.load(Ordering::Acquire),
            passed: p.passed,
            filtered: p.filtered.len(),
            completed: p.completed.len(),
            failed: p.failed.len(),
            cancelled: p.cancelled.len(),
        }
    }
}

/// Handle for tracking and controlling an offload.
///
/// Dropping the handle does **not** cancel the offload; call [`OffloadHandle::cancel`].
#[derive(Clone)]
pub struct OffloadHandle {
    token: CancellationToken,
}

impl std::fmt::Debug for OffloadHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OffloadHandle")
            .field("id", &self.id())
            .field("status", &self.status())
            .field("counts", &self.counts())
            .finish()
    }
}

impl OffloadHandle {
    pub(crate) fn new(token: CancellationToken) -> Self {
        Self { token }
    }

    /// The transfer's id.
    pub fn id(&self) -> OffloadId {
        self.token.offload_id()
    }

    /// Current status.
    pub fn status(&self) -> OffloadStatus {
        self.token.shared.status.load()
    }

    /// Whether the offload reached a terminal status.
    pub fn is_done(&self) -> bool {
        self.status().is_terminal()
    }

    /// A clone of the offload's cancellation token.
    pub fn token(&self) -> CancellationToken {
        self.token.clone()
    }

    /// Current monotonic counts.
    pub fn counts(&self) -> OffloadProgressCounts {
        self.token.shared.counts()
    }

    /// Outcomes appended since `cursor`; advances the cursor.
    pub fn progress_since(&self, cursor: &mut OffloadProgressCursor) -> OffloadProgressDelta {
        let p = self.token.shared.progress.lock();
        let delta = OffloadProgressDelta {
            completed: p.completed[cursor.completed..].to_vec(),
            failed: p.failed[cursor.failed..].to_vec(),
            filtered: p.filtered[cursor.filtered..].to_vec(),
            cancelled: p.cancelled[cursor.cancelled..].to_vec(),
        };
        *cursor = OffloadProgressCursor {
            completed: p.completed.len(),
            failed: p.failed.len(),
            filtered: p.filtered.len(),
            cancelled: p.cancelled.len(),
        };
        delta
    }

    /// The timing trace of a finished block (completed or failed after upgrade), if timing is
    /// recorded (`PipelineConfig::record_timing`).
    pub fn timing(&self, hash: SequenceHash) -> Option<TimingTrace> {
        let p = self.token.shared.progress.lock();
        p.timings.iter().find(|(h, _)| *h == hash).map(|(_, t)| *t)
    }

    /// Every recorded timing trace, in completion order.
    pub fn timings(&self) -> Vec<(SequenceHash, TimingTrace)> {
        self.token.shared.progress.lock().timings.clone()
    }

    /// Waits until every block has an outcome and nothing of the offload is outstanding.
    ///
    /// # Errors
    /// [`OffloadError::PipelineClosed`] is never returned once the offload was accepted; the
    /// `Result` exists so callers can use `?` uniformly with `enqueue`.
    pub async fn wait(&self) -> Result<OffloadResult, OffloadError> {
        self.token.drained().await;
        Ok(self.result_now())
    }

    /// [`wait`](Self::wait) for synchronous callers: blocks the calling thread (which must not
    /// be driving an async runtime) until the offload is done. Needs no runtime of its own.
    ///
    /// # Errors
    /// As [`wait`](Self::wait).
    pub fn wait_blocking(&self) -> Result<OffloadResult, OffloadError> {
        futures::executor::block_on(self.wait())
    }

    fn result_now(&self) -> OffloadResult {
        let p = self.token.shared.progress.lock();
        OffloadResult {
            id: self.id(),
            status: self.status(),
            completed_blocks: p.completed.clone(),
            failed_blocks: p.failed.clone(),
            filtered_blocks: p.filtered.clone(),
            cancelled_blocks: p.cancelled.clone(),
        }
    }

    /// The result so far, `None` until the offload is done.
    pub fn try_result(&self) -> Option<OffloadResult> {
        (self.token.outstanding() == 0 && self.is_done()).then(|| self.result_now())
    }

    /// Requests cancellation and returns a future that resolves once it is confirmed: every block
    /// released, nothing outstanding. Blocks already upgraded (P3) finish their transfer first.
    pub fn cancel(&self) -> CancelConfirmation {
        self.token.cancel_and_confirm()
    }

    /// The state of the cancellation request, `None` while none was made.
    pub fn cancel_state(&self) -> Option<CancelState> {
        self.token.state()
    }
}
