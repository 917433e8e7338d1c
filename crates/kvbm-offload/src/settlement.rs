//! Causal settlement: "has everything I submitted before this point finished?"
//!
//! A caller (typically the tiering layer finishing a request) sometimes must not fire an external
//! completion — "request done, its blocks may be reused" — until every offload it started earlier
//! has settled. It captures a [`SettlementToken`] first, fires, and later waits on the token:
//!
//! ```text
//!   enqueue #0 #1 #2 ─► token = capture()   (target: lane → 3)
//!   enqueue #3 ...                           (not waited for)
//!   wait(token) ── resolves when #0, #1, #2 have settled, in any order
//!               └─ or errs with the PipelineFailure that makes it impossible
//! ```
//!
//! Each lane numbers its submissions (one per `enqueue`); a submission settles when its transfer
//! drains (every block completed, failed, filtered or cancelled, nothing outstanding). The lane
//! keeps the longest settled prefix, so a target `n` is met when submissions `0..n` all settled.
//!
//! Lock order: `LaneState::inner` is a leaf lock.

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicU64, Ordering};

use parking_lot::Mutex;
use tokio::sync::watch;

/// An offload pipeline whose executor can participate in causal settlement.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize, serde::Deserialize,
)]
pub enum PipelineLane {
    /// Device → host.
    G1ToG2,
    /// Host → disk.
    G2ToG3,
    /// Host → object storage.
    G2ToG4,
}

impl PipelineLane {
    /// Every lane.
    pub const ALL: [PipelineLane; 3] = [Self::G1ToG2, Self::G2ToG3, Self::G2ToG4];

    /// Short name, e.g. `g2_to_g3`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::G1ToG2 => "g1_to_g2",
            Self::G2ToG3 => "g2_to_g3",
            Self::G2ToG4 => "g2_to_g4",
        }
    }
}

impl std::fmt::Display for PipelineLane {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Stable failure categories for pipeline settlement.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum PipelineFailureKind {
    /// The transfer executor panicked with a batch in flight.
    ExecutorPanicked,
    /// The pipeline was shut down before the target settled.
    Shutdown,
}

/// Terminal executor failure observed while waiting for causal settlement.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{lane} pipeline failed ({kind:?}): {message}")]
pub struct PipelineFailure {
    /// The lane that failed.
    pub lane: PipelineLane,
    /// Category.
    pub kind: PipelineFailureKind,
    /// Detail.
    pub message: String,
}

/// Error returned when a causal settlement boundary cannot be established.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum SettlementError {
    /// A lane in the target failed; its submissions may never settle cleanly.
    #[error(transparent)]
    Failed(#[from] PipelineFailure),
    /// The token names a lane this engine or pipeline does not run.
    #[error("lane {0} is not configured here")]
    UnknownLane(PipelineLane),
}

/// Expected completed transfer batches (submissions) for each pipeline lane.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SettlementTarget {
    lanes: Vec<(PipelineLane, u64)>,
}

impl SettlementTarget {
    /// An empty target (trivially met).
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds (or raises) the expectation for `lane`.
    pub fn with(mut self, lane: PipelineLane, submissions: u64) -> Self {
        match self.lanes.iter_mut().find(|(l, _)| *l == lane) {
            Some((_, n)) => *n = (*n).max(submissions),
            None => self.lanes.push((lane, submissions)),
        }
        self
    }

    /// The expectation for `lane` (0 when absent).
    pub fn get(&self, lane: PipelineLane) -> u64 {
        self.lanes
            .iter()
            .find(|(l, _)| *l == lane)
            .map_or(0, |(_, n)| *n)
    }

    /// Every `(lane, submissions)` pair.
    pub fn lanes(&self) -> &[(PipelineLane, u64)] {
        &self.lanes
    }
}

/// Opaque checkpoint captured before an external completion source is fired.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SettlementToken {
    target: SettlementTarget,
}

impl SettlementToken {
    pub(crate) fn new(target: SettlementTarget) -> Self {
        Self { target }
    }

    /// What must settle for the token to be satisfied.
    pub fn target(&self) -> &SettlementTarget {
        &self.target
    }
}

/// One lane's submission numbering and settled prefix.
pub(crate) struct LaneState {
    lane: PipelineLane,
    next: AtomicU64,
    inner: Mutex<LaneInner>,
    prefix_tx: watch::Sender<u64>,
}

struct LaneInner {
    prefix: u64,
    settled_above: BTreeSet<u64>,
    failure: Option<PipelineFailure>,
}

impl LaneState {
    pub(crate) fn new(lane: PipelineLane) -> Self {
        Self {
            lane,
            next: AtomicU64::new(0),
            inner: Mutex::new(LaneInner {
                prefix: 0,
                settled_above: BTreeSet::new(),
                failure: None,
            }),
            prefix_tx: watch::Sender::new(0),
        }
    }

    pub(crate) fn lane(&self) -> PipelineLane {
        self.lane
    }

    /// Numbers a new submission.
    pub(crate) fn submit(&self) -> u64 {
        self.next.fetch_add(1, Ordering::AcqRel)
    }

    /// Submissions numbered so far.
    pub(crate) fn submitted(&self) -> u64 {
        self.next.load(Ordering::Acquire)
    }

    pub(crate) fn settled_prefix(&self) -> u64 {
        self.inner.lock().prefix
    }

    pub(crate) fn settle(&self, seq: u64) {
        let mut g = self.inner.lock();
        if seq == g.prefix {
            g.prefix += 1;
            loop {
                let p = g.prefix;
                if !g.settled_above.remove(&p) {
                    break;
                }
                g.prefix += 1;
            }
            let p = g.prefix;
            drop(g);
            self.prefix_tx.send_replace(p);
        } else if seq > g.prefix {
            g.settled_above.insert(seq);
        }
    }

    pub(crate) fn fail(&self, kind: PipelineFailureKind, message: String) {
        let mut g = self.inner.lock();
        if g.failure.is_none() {
            g.failure = Some(PipelineFailure {
                lane: self.lane,
                kind,
                message,
            });
        }
        drop(g);
        self.prefix_tx.send_modify(|_| {});
    }

    /// Waits until submissions `0..target` settled, or the lane failed.
    pub(crate) async fn wait_for(&self, target: u64) -> Result<(), SettlementError> {
        let mut rx = self.prefix_tx.subscribe();
        loop {
            {
                let g = self.inner.lock();
                if let Some(f) = &g.failure {
                    return Err(f.clone().into());
                }
                if g.prefix >= target {
                    return Ok(());
                }
            }
            if rx.changed().await.is_err() {
                return Err(PipelineFailure {
                    lane: self.lane,
                    kind: PipelineFailureKind::Shutdown,
                    message: "pipeline dropped".into(),
                }
                .into());
            }
        }
    }
}
