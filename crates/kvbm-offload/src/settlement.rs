//! Causal settlement: "has everything I submitted before this point finished?"
//!
//! A caller (typically the tiering layer finishing a request) sometimes must not fire an external
//! completion — "request done, its blocks may be reused" — until every offload it started earlier
//! has settled. It captures a [`SettlementToken`] first, fires, and later waits on the token:
//!
//! ```text
//!   batches #0 #1 #2 dispatched ─► token = capture()   (target: lane → 3)
//!   batch #3 dispatched ...                               (not waited for)
//!   wait(token) ── resolves when #0, #1, #2 have settled, in any order
//!               └─ or errs with the PipelineFailure that makes it impossible
//! ```
//!
//! What is counted is what seed 000 names: **transfer batches**. Each lane numbers the batches its
//! transfer stage dispatches to the executor (after the upgrade, P3); a batch settles when its
//! outcome has been reported (every block completed or failed, registered or not). A token
//! captures how many batches were dispatched, so waiting on it answers "has every transfer
//! committed before this point finished?". Work still before its commitment point (evaluating,
//! waiting on a precondition, queued, batched) is not in the token: it is still cancellable, and
//! its own handle (or a cancel confirmation) says when it is done. The lane keeps the longest
//! settled prefix, so a target `n` is met when batches `0..n` all settled; a target once met stays
//! met, whatever fails afterwards.
//!
//! Lock order: `LaneState::inner` is a leaf lock.

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicU64, Ordering};

use kvbm_logical::TierId;
use parking_lot::Mutex;
use tokio::sync::watch;

/// A lane: the (source tier, destination tier) pair a pipeline moves blocks along, in either
/// direction (G1→G2, G2→G3 and G2→G4 down; G3→G2, G4→G2 and G2→G1 up). Settlement and metrics
/// label each pipeline by its lane.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize, serde::Deserialize,
)]
pub struct PipelineLane {
    /// Where the blocks are read.
    pub source: TierId,
    /// Where they are written.
    pub destination: TierId,
}

const fn lane_name(source: TierId, destination: TierId) -> &'static str {
    use TierId::*;
    match (source, destination) {
        (G1, G1) => "g1_to_g1",
        (G1, G2) => "g1_to_g2",
        (G1, G3) => "g1_to_g3",
        (G1, G4) => "g1_to_g4",
        (G2, G1) => "g2_to_g1",
        (G2, G2) => "g2_to_g2",
        (G2, G3) => "g2_to_g3",
        (G2, G4) => "g2_to_g4",
        (G3, G1) => "g3_to_g1",
        (G3, G2) => "g3_to_g2",
        (G3, G3) => "g3_to_g3",
        (G3, G4) => "g3_to_g4",
        (G4, G1) => "g4_to_g1",
        (G4, G2) => "g4_to_g2",
        (G4, G3) => "g4_to_g3",
        (G4, G4) => "g4_to_g4",
    }
}

#[allow(non_upper_case_globals)]
impl PipelineLane {
    /// Device → host (offload).
    pub const G1_TO_G2: Self = Self::new(TierId::G1, TierId::G2);
    /// Host → disk (offload).
    pub const G2_TO_G3: Self = Self::new(TierId::G2, TierId::G3);
    /// Host → object storage (offload).
    pub const G2_TO_G4: Self = Self::new(TierId::G2, TierId::G4);
    /// Disk → host (onboarding).
    pub const G3_TO_G2: Self = Self::new(TierId::G3, TierId::G2);
    /// Object storage → host (onboarding).
    pub const G4_TO_G2: Self = Self::new(TierId::G4, TierId::G2);
    /// Host → device (onboarding, promotion).
    pub const G2_TO_G1: Self = Self::new(TierId::G2, TierId::G1);

    /// Former spelling of [`G1_TO_G2`](Self::G1_TO_G2), kept while callers migrate.
    pub const G1ToG2: Self = Self::G1_TO_G2;
    /// Former spelling of [`G2_TO_G3`](Self::G2_TO_G3), kept while callers migrate.
    pub const G2ToG3: Self = Self::G2_TO_G3;
    /// Former spelling of [`G2_TO_G4`](Self::G2_TO_G4), kept while callers migrate.
    pub const G2ToG4: Self = Self::G2_TO_G4;

    /// The lane from `source` to `destination`.
    pub const fn new(source: TierId, destination: TierId) -> Self {
        Self {
            source,
            destination,
        }
    }

    /// Whether blocks move toward faster tiers (onboarding).
    pub const fn is_upward(self) -> bool {
        self.destination.index() < self.source.index()
    }

    /// Short name, e.g. `g2_to_g3`: the `pipeline` label of every metric.
    pub const fn as_str(self) -> &'static str {
        lane_name(self.source, self.destination)
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
    /// A stage before the transfers (policy, precondition, batcher, or the transfer stage's own
    /// loop) panicked: the lane stopped and every block it still held failed.
    StagePanicked(PipelineStage),
    /// The pipeline was shut down before the target settled.
    Shutdown,
}

/// The stages of a pipeline, for failure reports.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PipelineStage {
    /// The policy evaluator.
    Policy,
    /// The precondition awaiter.
    Precondition,
    /// The batcher.
    Batcher,
    /// The transfer stage (its loop; an executor panic is
    /// [`ExecutorPanicked`](PipelineFailureKind::ExecutorPanicked)).
    Transfer,
    /// The cancel sweeper.
    Sweeper,
}

impl PipelineStage {
    /// Snake-case name.
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::Policy => "policy",
            Self::Precondition => "precondition",
            Self::Batcher => "batcher",
            Self::Transfer => "transfer",
            Self::Sweeper => "sweeper",
        }
    }
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

/// Expected completed transfer batches for each pipeline lane.
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

/// One lane's transfer-batch numbering and settled prefix.
///
/// Every batch the transfer stage dispatches (after its upgrade, P3) gets the next number; it
/// settles when its outcome has been reported, or is *abandoned* when the executor stopped with it
/// in flight. A target `n` is met once batches `0..n` all settled; it is unreachable once one of
/// them was abandoned. A lane failure therefore never poisons a target that had already been met,
/// nor one whose batches all still settle (a stage failing upstream of the transfers).
pub(crate) struct LaneState {
    lane: PipelineLane,
    next: AtomicU64,
    failed: std::sync::atomic::AtomicBool,
    inner: Mutex<LaneInner>,
    prefix_tx: watch::Sender<u64>,
}

struct LaneInner {
    prefix: u64,
    settled_above: BTreeSet<u64>,
    /// The lowest abandoned batch: targets above it are unreachable.
    abandoned: Option<u64>,
    failure: Option<PipelineFailure>,
}

impl LaneState {
    pub(crate) fn new(lane: PipelineLane) -> Self {
        Self {
            lane,
            next: AtomicU64::new(0),
            failed: std::sync::atomic::AtomicBool::new(false),
            inner: Mutex::new(LaneInner {
                prefix: 0,
                settled_above: BTreeSet::new(),
                abandoned: None,
                failure: None,
            }),
            prefix_tx: watch::Sender::new(0),
        }
    }

    pub(crate) fn lane(&self) -> PipelineLane {
        self.lane
    }

    /// Numbers a transfer batch being dispatched to the executor.
    pub(crate) fn dispatch(&self) -> u64 {
        self.next.fetch_add(1, Ordering::AcqRel)
    }

    /// Transfer batches dispatched so far.
    pub(crate) fn dispatched(&self) -> u64 {
        self.next.load(Ordering::Acquire)
    }

    pub(crate) fn settled_prefix(&self) -> u64 {
        self.inner.lock().prefix
    }

    /// Whether the lane failed (cheap: one atomic load).
    #[inline]
    pub(crate) fn is_failed(&self) -> bool {
        self.failed.load(Ordering::Acquire)
    }

    /// The failure, once the lane failed.
    pub(crate) fn failure(&self) -> Option<PipelineFailure> {
        self.inner.lock().failure.clone()
    }

    /// Batch `seq` has its outcome reported.
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

    /// Batch `seq` will never settle: the executor stopped with it in flight. Fails the lane.
    pub(crate) fn abandon(&self, seq: u64, kind: PipelineFailureKind, message: String) {
        {
            let mut g = self.inner.lock();
            g.abandoned = Some(g.abandoned.map_or(seq, |a| a.min(seq)));
        }
        self.fail(kind, message);
    }

    /// Records the lane's failure (the first one wins) and wakes every waiter.
    pub(crate) fn fail(&self, kind: PipelineFailureKind, message: String) {
        let mut g = self.inner.lock();
        if g.failure.is_none() {
            g.failure = Some(PipelineFailure {
                lane: self.lane,
                kind,
                message,
            });
        }
        self.failed.store(true, Ordering::Release);
        drop(g);
        self.prefix_tx.send_modify(|_| {});
    }

    /// Waits until batches `0..target` settled; errs once one of them was abandoned.
    pub(crate) async fn wait_for(&self, target: u64) -> Result<(), SettlementError> {
        let mut rx = self.prefix_tx.subscribe();
        loop {
            {
                let g = self.inner.lock();
                // Met targets stay met, whatever failed afterwards.
                if g.prefix >= target {
                    return Ok(());
                }
                if let (Some(a), Some(f)) = (g.abandoned, &g.failure)
                    && a < target
                {
                    return Err(f.clone().into());
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
