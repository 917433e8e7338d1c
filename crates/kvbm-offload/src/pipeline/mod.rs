//! A running pipeline: four stages joined by bounded cancellable queues (`CancellableQueue`).
//!
//! ```text
//!  enqueue ─► [input] ─► PolicyEvaluator ─► [precondition] ─► PreconditionAwaiter ─► [batch]
//!   (waits    queue     (dedupe done at       queue           select!(event, token)   queue
//!   for room;            enqueue; policy                       (P6), at most            │
//!   try_ form            under timeout)                        queue_capacity waiting   ▼
//!   says Full)
//!   sink ◄── settle ◄── executor.execute ◄── upgrade_batch ◄── sweep (P4) ◄── [transfer] ◄── Batcher
//!  (chain)  (report,     (bytes; register   (P3, flat P5)     permit of      queue        (min, max,
//!           release)      on success)                         max_concurrent              flush timer;
//!                                                                                          never splits
//!                                                                                          a container, P1)
//!
//!  CancelSweeper: on every cancel (and each sweep_interval) sweeps input, precondition, batch
//!  and transfer queues; every stage sweeps what it holds (its outbox, its open batch) on the
//!  same signal.
//! ```
//!
//! The builder is in `builder`, the stage loops and their supervision in `stages`.
//!
//! # Invariants
//!
//! * Every stage checks the container's token when it takes it, and every queue is swept, so a
//!   cancelled container is dropped within one sweep of the request wherever it waits — except
//!   after `upgrade_batch`, where cancellation no longer applies (P3).
//! * A stage never blocks on a full downstream queue: what it cannot push waits in its bounded
//!   outbox, and the stage keeps polling its input guards, its in-flight evaluations or
//!   precondition waits (which select on their tokens) and the sweep signal meanwhile. A full
//!   queue never delays a cancellation confirmation.
//! * Everything is bounded: the input queue (`queue_capacity` containers; `enqueue` waits,
//!   `try_enqueue` returns [`EnqueueError::Full`] with the blocks), each inter-stage queue, the
//!   evaluations in flight (`max_concurrent_evaluations`), the containers waiting on a
//!   precondition (`queue_capacity`) and every outbox.
//! * Each stage closes its output queue when its input is closed and drained: shutdown is a
//!   graceful drain front to back.
//! * A panic in any stage fails the lane ([`PipelineFailureKind::StagePanicked`], or
//!   `ExecutorPanicked` for an executor) and tears it down: every queue is closed and drained,
//!   the other stages stop (committed transfers run to their end, P3), every block still held
//!   is reported failed ([`BlockFailureKind::PipelineFailed`](crate::BlockFailureKind)), so every
//!   handle completes and `shutdown_and_wait` returns. Later enqueues are refused with the
//!   failure.
//!
//! # Lock order
//!
//! Queue mutex, pending-set mutex, a transfer's progress mutex and a lane's settlement mutex are
//! all leaves: none is held while taking another or while dropping blocks.

pub(crate) mod builder;
pub(crate) mod stages;

use std::sync::Arc;

use kvbm_logical::{SequenceHash, Tier, TierId};
use tokio::task::JoinSet;

use crate::batch::{OffloadBatch, OffloadContainer};
use crate::error::OffloadError;
use crate::handle::cancel::CancellationToken;
use crate::handle::{OffloadHandle, OffloadShared};
use crate::metrics::{FilterReason, PipelineMetrics};
use crate::pending::PendingTracker;
use crate::queue::{CancellableQueue, Refused, SweepTarget};
use crate::settlement::{
    LaneState, PipelineFailure, PipelineFailureKind, PipelineLane, SettlementError,
    SettlementTarget, SettlementToken,
};
use crate::source::{Precondition, SourceBlocks};
use crate::sweep::SweepSignal;

pub use builder::{PipelineBuilder, PipelineSpec};

/// Called with the results of successfully transferred blocks (used by `auto_chain`).
pub type CompletionSink<R> = Arc<dyn Fn(Vec<R>) + Send + Sync>;

/// Why [`Pipeline::try_enqueue`] refused blocks; the blocks and the precondition are handed
/// back untouched in every case.
#[derive(thiserror::Error)]
pub enum EnqueueError<T: Tier, A = ()> {
    /// The input queue is at `queue_capacity`: retry later, or use the waiting
    /// [`Pipeline::enqueue`].
    #[error("the offload pipeline's input queue is full")]
    Full(Rejected<T, A>),
    /// The pipeline was shut down.
    #[error("the offload pipeline is closed")]
    Closed(Rejected<T, A>),
    /// Sources and destinations differ in number.
    #[error("sources and destinations differ in number")]
    Mismatched(Rejected<T, A>),
    /// The pipeline failed.
    #[error("{failure}")]
    Failed {
        /// Why it failed.
        failure: PipelineFailure,
        /// The refused work.
        rejected: Rejected<T, A>,
    },
}

impl<T: Tier, A> EnqueueError<T, A> {
    /// The refused blocks and precondition.
    pub fn into_rejected(self) -> Rejected<T, A> {
        match self {
            Self::Full(r)
            | Self::Closed(r)
            | Self::Mismatched(r)
            | Self::Failed { rejected: r, .. } => r,
        }
    }
}

impl<T: Tier, A> std::fmt::Debug for EnqueueError<T, A> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Full(r) => f.debug_tuple("Full").field(r).finish(),
            Self::Closed(r) => f.debug_tuple("Closed").field(r).finish(),
            Self::Mismatched(r) => f.debug_tuple("Mismatched").field(r).finish(),
            Self::Failed { failure, rejected } => f
                .debug_struct("Failed")
                .field("failure", failure)
                .field("rejected", rejected)
                .finish(),
        }
    }
}

impl<T: Tier, A> std::fmt::Debug for Rejected<T, A> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Rejected")
            .field("blocks", &self.blocks.len())
            .field("destinations", &self.destinations.len())
            .field("precondition", &self.precondition.is_some())
            .finish()
    }
}

impl<T: Tier, A> From<EnqueueError<T, A>> for OffloadError {
    fn from(e: EnqueueError<T, A>) -> Self {
        match e {
            EnqueueError::Full(_) => OffloadError::QueueFull,
            EnqueueError::Closed(_) => OffloadError::PipelineClosed,
            EnqueueError::Mismatched(r) => OffloadError::Mismatched {
                sources: r.blocks.len(),
                destinations: r.destinations.len(),
            },
            EnqueueError::Failed { failure, .. } => OffloadError::PipelineFailed(failure),
        }
    }
}

/// Work refused by [`Pipeline::try_enqueue`], handed back.
pub struct Rejected<T: Tier, A = ()> {
    /// The blocks, as given.
    pub blocks: SourceBlocks<T>,
    /// Their destinations, as given (empty for `()`).
    pub destinations: Vec<A>,
    /// The precondition, as given.
    pub precondition: Option<Precondition>,
}

pub(crate) struct Inner<Src: Tier, A> {
    pub(crate) input: Arc<CancellableQueue<OffloadContainer<Src, A>>>,
    pub(crate) precondition_q: Arc<CancellableQueue<OffloadContainer<Src, A>>>,
    pub(crate) batch_q: Arc<CancellableQueue<OffloadContainer<Src, A>>>,
    pub(crate) transfer_q: Arc<CancellableQueue<OffloadBatch<Src, A>>>,
    pub(crate) pending: PendingTracker,
    pub(crate) sweep: SweepSignal,
    pub(crate) lane: Arc<LaneState>,
    pub(crate) metrics: Arc<PipelineMetrics>,
    pub(crate) record_timing: bool,
    pub(crate) sweep_on_cancel: bool,
    /// Fired when the lane fails: stages stop taking work and drop what they hold.
    pub(crate) abort: tokio_util::sync::CancellationToken,
}

impl<Src: Tier, A: Send + 'static> Inner<Src, A> {
    /// Fails the lane and tears it down: the failure is recorded first (so every block dropped
    /// from here on reports failed), then stages are told to stop and every queue is closed and
    /// drained.
    pub(crate) fn fail(&self, kind: PipelineFailureKind, message: String) {
        tracing::error!(lane = %self.lane.lane(), ?kind, %message, "offload pipeline failed");
        self.lane.fail(kind, message);
        self.abort.cancel();
        let queues: [&dyn SweepTarget; 4] = [
            &*self.input,
            &*self.precondition_q,
            &*self.batch_q,
            &*self.transfer_q,
        ];
        for q in queues {
            q.close_and_drain();
        }
    }

    fn refusal(&self) -> Option<PipelineFailure> {
        if self.lane.is_failed() {
            self.lane.failure()
        } else {
            None
        }
    }
}

/// A running pipeline instance.
///
/// Dropping it closes its input: what is queued is still drained in the background.
///
/// `A` is the per-block destination attachment (see [`MoveExecutor`](crate::MoveExecutor)):
/// `()` for lanes whose executor allocates destinations ([`enqueue`](Self::enqueue)), a
/// caller-allocated `MutableBlock<Dst>` for lanes whose caller chose them
/// ([`enqueue_into`](Self::enqueue_into)).
pub struct Pipeline<Src: Tier, A = ()> {
    inner: Arc<Inner<Src, A>>,
    tasks: parking_lot::Mutex<Option<JoinSet<()>>>,
    stop: tokio_util::sync::CancellationToken,
    runtime: tokio::runtime::Handle,
}

impl<Src: Tier, A> std::fmt::Debug for Pipeline<Src, A> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pipeline")
            .field("lane", &self.inner.lane.lane())
            .field("pending", &self.inner.pending.len())
            .finish()
    }
}

impl<Src: Tier> Pipeline<Src, ()> {
    /// Enqueues blocks; they wait for `precondition` (if any) before being batched. Waits while
    /// the input queue is full (backpressure).
    ///
    /// Blocks already in flight in this pipeline are reported filtered at once (duplicate
    /// suppression).
    ///
    /// # Errors
    /// [`OffloadError::PipelineClosed`] after [`shutdown`](Self::shutdown);
    /// [`OffloadError::PipelineFailed`] once the pipeline failed.
    pub async fn enqueue(
        &self,
        blocks: impl Into<SourceBlocks<Src>>,
        precondition: Option<Precondition>,
    ) -> Result<OffloadHandle, OffloadError> {
        let blocks = blocks.into();
        let n = blocks.len();
        self.enqueue_into(blocks, vec![(); n], precondition).await
    }

    /// Enqueues without waiting.
    ///
    /// # Errors
    /// [`EnqueueError::Full`] when the input queue is at `queue_capacity`,
    /// [`EnqueueError::Closed`] after shutdown, [`EnqueueError::Failed`] once the pipeline
    /// failed; each hands the blocks and the precondition back untouched.
    pub fn try_enqueue(
        &self,
        blocks: impl Into<SourceBlocks<Src>>,
        precondition: Option<Precondition>,
    ) -> Result<OffloadHandle, EnqueueError<Src>> {
        let blocks = blocks.into();
        let n = blocks.len();
        self.try_enqueue_into(blocks, vec![(); n], precondition)
    }

    /// [`enqueue`](Self::enqueue) for synchronous callers: blocks the calling thread while the
    /// input queue is full. Must not be called from a thread driving an async runtime (it
    /// would stall that thread); the pipeline's own runtime keeps running meanwhile.
    ///
    /// # Errors
    /// As [`enqueue`](Self::enqueue).
    pub fn enqueue_blocking(
        &self,
        blocks: impl Into<SourceBlocks<Src>>,
        precondition: Option<Precondition>,
    ) -> Result<OffloadHandle, OffloadError> {
        futures::executor::block_on(self.enqueue(blocks, precondition))
    }
}

impl<Src: Tier, A: Send + 'static> Pipeline<Src, A> {
    /// Enqueues blocks with their destinations (`destinations[i]` receives `blocks[i]`), waiting
    /// while the input queue is full. A destination whose block is filtered, cancelled,
    /// evicted or fails is dropped (a caller-allocated slot goes back to its pool).
    ///
    /// # Errors
    /// [`OffloadError::Mismatched`] when the lengths differ (nothing is enqueued);
    /// [`OffloadError::PipelineClosed`] after shutdown; [`OffloadError::PipelineFailed`] once
    /// the pipeline failed.
    pub async fn enqueue_into(
        &self,
        blocks: impl Into<SourceBlocks<Src>>,
        destinations: Vec<A>,
        precondition: Option<Precondition>,
    ) -> Result<OffloadHandle, OffloadError> {
        let blocks = blocks.into();
        if blocks.len() != destinations.len() {
            return Err(OffloadError::Mismatched {
                sources: blocks.len(),
                destinations: destinations.len(),
            });
        }
        let reservation = match self.inner.input.reserve().await {
            Ok(r) => r,
            Err(_) => return Err(self.closed_error()),
        };
        let (handle, container) = self.admit(blocks, destinations, precondition);
        if let Some(c) = container
            && let Err(c) = reservation.push(c)
        {
            drop(c);
            return Err(self.closed_error());
        }
        Ok(handle)
    }

    /// [`enqueue_into`](Self::enqueue_into) without waiting.
    ///
    /// # Errors
    /// [`EnqueueError`], handing the blocks, destinations and precondition back.
    pub fn try_enqueue_into(
        &self,
        blocks: impl Into<SourceBlocks<Src>>,
        destinations: Vec<A>,
        precondition: Option<Precondition>,
    ) -> Result<OffloadHandle, EnqueueError<Src, A>> {
        let blocks = blocks.into();
        if blocks.len() != destinations.len() {
            return Err(EnqueueError::Mismatched(Rejected {
                blocks,
                destinations,
                precondition,
            }));
        }
        let reservation = match self.inner.input.try_reserve() {
            Ok(r) => r,
            Err(why) => {
                let rejected = Rejected {
                    blocks,
                    destinations,
                    precondition,
                };
                return Err(match (self.inner.refusal(), why) {
                    (Some(failure), _) => EnqueueError::Failed { failure, rejected },
                    (None, Refused::Full) => EnqueueError::Full(rejected),
                    (None, Refused::Closed) => EnqueueError::Closed(rejected),
                });
            }
        };
        let (handle, container) = self.admit(blocks, destinations, precondition);
        if let Some(c) = container
            && let Err(c) = reservation.push(c)
        {
            // Closed between the reservation and the push: the blocks are already accounted
            // to the handle, which reports them.
            drop(c);
        }
        Ok(handle)
    }

    fn closed_error(&self) -> OffloadError {
        match self.inner.refusal() {
            Some(f) => OffloadError::PipelineFailed(f),
            None => OffloadError::PipelineClosed,
        }
    }

    /// Makes the handle and (unless every block was a duplicate) the container.
    fn admit(
        &self,
        blocks: SourceBlocks<Src>,
        destinations: Vec<A>,
        precondition: Option<Precondition>,
    ) -> (OffloadHandle, Option<OffloadContainer<Src, A>>) {
        let inner = &self.inner;
        let blocks = blocks.into_vec();
        let shared = Arc::new(OffloadShared::new(
            inner.sweep_on_cancel.then(|| inner.sweep.clone()),
            Some(inner.lane.clone()),
            inner.record_timing,
            Some(inner.metrics.clone()),
        ));
        inner.metrics.enqueued(blocks.len());
        shared
            .total
            .store(blocks.len(), std::sync::atomic::Ordering::Release);
        let token = CancellationToken { shared };
        let handle = OffloadHandle::new(token.clone());

        let mut guards = inner
            .pending
            .try_insert_batch(blocks.iter().map(|b| b.sequence_hash()));
        let (blocks, dests, pending) = if guards.iter().all(Option::is_some) {
            (blocks, destinations, guards)
        } else {
            let mut kept = Vec::with_capacity(blocks.len());
            let mut kept_dests = Vec::with_capacity(blocks.len());
            let mut kept_guards = Vec::with_capacity(blocks.len());
            let mut dups = Vec::new();
            for ((b, d), g) in blocks.into_iter().zip(destinations).zip(guards.drain(..)) {
                if g.is_some() {
                    kept.push(b);
                    kept_dests.push(d);
                    kept_guards.push(g);
                } else {
                    dups.push(b.sequence_hash());
                }
            }
            inner.metrics.filtered(FilterReason::Duplicate, dups.len());
            token.shared.report_filtered(dups);
            (kept, kept_dests, kept_guards)
        };
        let container = OffloadContainer::new(blocks, dests, pending, precondition, token);
        if container.is_empty() {
            return (handle, None);
        }
        (handle, Some(container))
    }

    /// The lane: this pipeline's (source, destination) pair.
    pub fn lane(&self) -> PipelineLane {
        self.inner.lane.lane()
    }

    /// Source tier.
    pub fn source(&self) -> TierId {
        self.lane().source
    }

    /// Destination tier.
    pub fn destination(&self) -> TierId {
        self.lane().destination
    }

    /// The runtime the pipeline's tasks run on.
    pub fn runtime(&self) -> &tokio::runtime::Handle {
        &self.runtime
    }

    /// Blocks currently in flight (pending-set size).
    pub fn pending_blocks(&self) -> usize {
        self.inner.pending.len()
    }

    /// Whether `hash` is in flight in this pipeline.
    pub fn is_pending(&self, hash: SequenceHash) -> bool {
        self.inner.pending.contains(hash)
    }

    /// The failure that stopped this pipeline, if it failed.
    pub fn failure(&self) -> Option<PipelineFailure> {
        self.inner.refusal()
    }

    /// Captures a settlement checkpoint: every transfer batch dispatched so far.
    pub fn settlement_token(&self) -> SettlementToken {
        SettlementToken::new(
            SettlementTarget::new().with(self.lane(), self.inner.lane.dispatched()),
        )
    }

    /// Transfer batches settled so far (the longest settled prefix).
    pub fn settled(&self) -> u64 {
        self.inner.lane.settled_prefix()
    }

    /// Waits until every transfer batch captured by `token` (for this pipeline's lane) settled.
    ///
    /// # Errors
    /// [`SettlementError::Failed`] if one of those batches can no longer settle.
    pub async fn wait_settled(&self, token: &SettlementToken) -> Result<(), SettlementError> {
        self.inner
            .lane
            .wait_for(token.target().get(self.lane()))
            .await
    }

    pub(crate) fn lane_state(&self) -> &Arc<LaneState> {
        &self.inner.lane
    }

    /// Stops accepting work; what is queued drains through the stages.
    pub fn shutdown(&self) {
        self.inner.input.close();
    }

    /// Shuts down and waits until every stage has finished.
    pub async fn shutdown_and_wait(&self) {
        self.shutdown();
        let tasks = self.tasks.lock().take();
        if let Some(mut tasks) = tasks {
            while tasks.join_next().await.is_some() {}
        }
        self.stop.cancel();
    }
}

impl<Src: Tier, A> Drop for Pipeline<Src, A> {
    fn drop(&mut self) {
        self.inner.input.close();
        if let Some(mut tasks) = self.tasks.get_mut().take() {
            tasks.detach_all();
        }
    }
}
