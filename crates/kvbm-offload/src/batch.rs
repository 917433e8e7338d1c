//! Containers, batches, and the commitment boundary (`upgrade_batch`).
//!
//! ```text
//!  OffloadContainer (one per enqueue, never split)           OffloadBatch
//!  ┌───────────────────────────────────────────┐             ┌────────────────────────┐
//!  │ blocks: Vec<SourceBlock<T>>               │  Batcher    │ containers: [c0,c1,..] │
//!  │ precondition: Option<Precondition>        │ ──────────► │ each still cancellable │
//!  │ cancel_token: CancellationToken  (P2)     │             └───────────┬────────────┘
//!  │ pending guards, policy release hook       │                         │ sweep_cancelled (P4)
//!  │ outstanding guard            (last field) │                         ▼ upgrade_batch (P3)
//!  └───────────────────────────────────────────┘             ┌────────────────────────┐
//!                                                            │ ResolvedBatch: one flat │
//!                                                            │ Vec<ResolvedBlock> (P5) │
//!                                                            └────────────────────────┘
//! ```
//!
//! * **P1** – a container is cancelled as a whole: it has one token, the sweep removes whole
//!   containers, and the batcher never splits one (a container larger than `max_batch_size` is
//!   a batch of its own).
//! * **P3/P5** – `upgrade_batch` consumes the batch. From then on no token is consulted; the
//!   blocks of all containers form one flat vector handed to the executor. The per-container
//!   bookkeeping kept beside it is only used to report outcomes.
//! * Dropping a container that still holds blocks reports them **cancelled** (the only ways a
//!   container is dropped without being consumed are a sweep, a cancelled precondition wait, or
//!   pipeline shutdown). The outstanding guard is the last field, so confirmation follows the
//!   release of the blocks and pending-set entries.

use std::sync::Arc;
use std::time::Instant;

use kvbm_logical::{BlockId, ImmutableBlock, SequenceHash, Tier};

use crate::error::{BlockFailure, BlockFailureKind};
use crate::handle::cancel::{CancellationToken, OutstandingGuard};
use crate::handle::{OffloadStatus, TimingTrace};
use crate::metrics::FailureTally;
use crate::pending::PendingGuard;
use crate::policy::OffloadPolicy;
use crate::queue::Sweep;
use crate::settlement::{LaneState, PipelineFailureKind};
use crate::source::{Precondition, SourceBlock};

/// The unit of cancellation flowing through the pipeline: blocks, their precondition and the
/// token of the transfer they belong to.
pub(crate) struct OffloadContainer<T: Tier, A = ()> {
    blocks: Vec<SourceBlock<T>>,
    /// Per-block destination attachment, aligned with `blocks` (`()` when the executor
    /// allocates destinations, a caller-allocated `MutableBlock` otherwise).
    dests: Vec<A>,
    precondition: Option<Precondition>,
    cancel_token: CancellationToken,
    pending: Vec<Option<PendingGuard>>,
    release_to: Option<Arc<dyn OffloadPolicy>>,
    pub(crate) timing: TimingTrace,
    guard: OutstandingGuard,
}

impl<T: Tier, A> std::fmt::Debug for OffloadContainer<T, A> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OffloadContainer")
            .field("transfer", &self.cancel_token.offload_id())
            .field("blocks", &self.blocks.len())
            .field("cancelled", &self.is_cancelled())
            .finish()
    }
}

impl<T: Tier, A> OffloadContainer<T, A> {
    /// A container for `blocks` of the transfer owning `cancel_token`. `pending` is aligned with
    /// `blocks` (the pending-set entry each block holds, if any).
    pub(crate) fn new(
        blocks: Vec<SourceBlock<T>>,
        dests: Vec<A>,
        pending: Vec<Option<PendingGuard>>,
        precondition: Option<Precondition>,
        cancel_token: CancellationToken,
    ) -> Self {
        assert_eq!(
            blocks.len(),
            pending.len(),
            "pending guards must align with blocks"
        );
        assert_eq!(
            blocks.len(),
            dests.len(),
            "destinations must align with blocks"
        );
        let guard = cancel_token.hold();
        Self {
            blocks,
            dests,
            precondition,
            pending,
            release_to: None,
            timing: TimingTrace::start(Instant::now()),
            cancel_token,
            guard,
        }
    }

    /// The blocks.
    pub(crate) fn blocks(&self) -> &[SourceBlock<T>] {
        &self.blocks
    }

    /// Number of blocks.
    pub(crate) fn len(&self) -> usize {
        self.blocks.len()
    }

    /// Whether it holds no blocks.
    pub(crate) fn is_empty(&self) -> bool {
        self.blocks.is_empty()
    }

    /// The token it carries (P2).
    pub(crate) fn cancel_token(&self) -> &CancellationToken {
        &self.cancel_token
    }

    /// Whether its transfer was cancelled.
    #[inline]
    pub(crate) fn is_cancelled(&self) -> bool {
        self.cancel_token.is_cancelled()
    }

    pub(crate) fn take_precondition(&mut self) -> Option<Precondition> {
        self.precondition.take()
    }

    pub(crate) fn set_release(&mut self, policy: Arc<dyn OffloadPolicy>) {
        self.release_to = Some(policy);
    }

    pub(crate) fn hashes(&self) -> impl Iterator<Item = SequenceHash> + '_ {
        self.blocks.iter().map(|b| b.sequence_hash())
    }

    /// Keeps the blocks whose verdict is `true`; returns the hashes of the others (their pending
    /// entries are released).
    pub(crate) fn retain_verdicts(&mut self, verdicts: &[bool]) -> Vec<SequenceHash> {
        debug_assert_eq!(verdicts.len(), self.blocks.len());
        if verdicts.iter().all(|&v| v) {
            return Vec::new();
        }
        let mut dropped = Vec::new();
        let blocks = std::mem::take(&mut self.blocks);
        let pending = std::mem::take(&mut self.pending);
        let dests = std::mem::take(&mut self.dests);
        for (((b, p), d), &keep) in blocks.into_iter().zip(pending).zip(dests).zip(verdicts) {
            if keep {
                self.blocks.push(b);
                self.pending.push(p);
                self.dests.push(d);
            } else {
                dropped.push(b.sequence_hash());
            }
        }
        dropped
    }

    /// Removes every block, reporting them failed with `failure` (e.g. the precondition failed).
    pub(crate) fn fail_all(mut self, failure: BlockFailure) {
        let blocks = std::mem::take(&mut self.blocks);
        let hashes: Vec<SequenceHash> = blocks.iter().map(|b| b.sequence_hash()).collect();
        self.cancel_token
            .shared
            .report_failed(hashes.iter().map(|h| (*h, failure.clone())));
        if let Some(p) = &self.release_to {
            p.release(&hashes);
        }
        drop(blocks);
    }
}

impl<T: Tier, A> Drop for OffloadContainer<T, A> {
    fn drop(&mut self) {
        if self.blocks.is_empty() {
            return;
        }
        let hashes: Vec<SequenceHash> = self.hashes().collect();
        let shared = &self.cancel_token.shared;
        // Dropped by a stage that is unwinding, or by the teardown of a failed lane: the blocks
        // failed, they were not cancelled.
        let lane_failed = shared.lane.as_ref().is_some_and(|l| l.is_failed());
        if std::thread::panicking() || lane_failed {
            let message = shared.lane.as_ref().and_then(|l| l.failure()).map_or_else(
                || "a pipeline stage panicked".to_string(),
                |f| f.to_string(),
            );
            let failure = BlockFailure::new(BlockFailureKind::PipelineFailed, message);
            shared.report_failed(hashes.iter().map(|h| (*h, failure.clone())));
        } else {
            shared.report_cancelled(hashes.iter().copied());
        }
        // Reported before the policy's release: a release that panics (policy code) cannot
        // leave the blocks without an outcome. While already unwinding, a second panic would
        // abort the process: it is contained and logged instead.
        if let Some(p) = &self.release_to {
            if std::thread::panicking() {
                let p = p.clone();
                let r =
                    std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| p.release(&hashes)));
                if r.is_err() {
                    tracing::error!(
                        policy = p.name(),
                        "policy release panicked during unwinding"
                    );
                }
            } else {
                p.release(&hashes);
            }
        }
        // Fields drop after this: blocks, pending entries, then the outstanding guard.
    }
}

impl<T: Tier, A> Sweep for OffloadContainer<T, A> {
    fn sweep_cancelled(&mut self) -> bool {
        self.is_cancelled()
    }
}

/// Multiple containers, each independently cancellable until [`upgrade_batch`].
pub(crate) struct OffloadBatch<T: Tier, A = ()> {
    containers: Vec<OffloadContainer<T, A>>,
    total: usize,
}

impl<T: Tier, A> std::fmt::Debug for OffloadBatch<T, A> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OffloadBatch")
            .field("containers", &self.containers.len())
            .field("blocks", &self.total)
            .finish()
    }
}

impl<T: Tier, A> Default for OffloadBatch<T, A> {
    fn default() -> Self {
        Self::new()
    }
}

impl<T: Tier, A> OffloadBatch<T, A> {
    /// An empty batch.
    pub(crate) fn new() -> Self {
        Self {
            containers: Vec::new(),
            total: 0,
        }
    }

    /// Adds a container.
    pub(crate) fn push(&mut self, c: OffloadContainer<T, A>) {
        self.total += c.len();
        self.containers.push(c);
    }

    /// Total blocks.
    pub(crate) fn total_blocks(&self) -> usize {
        self.total
    }

    /// Whether it has no containers.
    pub(crate) fn is_empty(&self) -> bool {
        self.containers.is_empty()
    }

    pub(crate) fn mark_batched(&mut self, at: Instant) {
        for c in &mut self.containers {
            c.timing.batched = Some(at);
        }
    }

    /// Removes (and drops, releasing their blocks) every cancelled container; returns how many.
    pub(crate) fn remove_cancelled(&mut self) -> usize {
        let before = self.containers.len();
        if !self.containers.iter().any(|c| c.is_cancelled()) {
            return 0;
        }
        let mut removed = Vec::new();
        let mut kept = Vec::with_capacity(before);
        for c in self.containers.drain(..) {
            if c.is_cancelled() {
                removed.push(c);
            } else {
                kept.push(c);
            }
        }
        self.containers = kept;
        self.total = self.containers.iter().map(|c| c.len()).sum();
        removed.len()
    }
}

impl<T: Tier, A> Sweep for OffloadBatch<T, A> {
    fn sweep_cancelled(&mut self) -> bool {
        self.remove_cancelled();
        self.containers.is_empty()
    }
}

/// A resolved block ready for transfer execution.
pub struct ResolvedBlock<T: Tier> {
    /// Slot in the source tier.
    pub block_id: BlockId,
    /// The content's sequence hash.
    pub sequence_hash: SequenceHash,
    /// The content's 256-bit digest, for BLAKE3 sequences (its identity in tiers that leave
    /// the process).
    pub digest: Option<kvbm_logical::BlockDigest>,
    holder: Option<ImmutableBlock<T>>,
    _pending: Option<PendingGuard>,
}

impl<T: Tier> ResolvedBlock<T> {
    /// The strong reference keeping the source alive during the transfer (`None` for external
    /// blocks).
    pub fn block(&self) -> Option<&ImmutableBlock<T>> {
        self.holder.as_ref()
    }
}

impl<T: Tier> std::fmt::Debug for ResolvedBlock<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ResolvedBlock")
            .field("block_id", &self.block_id)
            .field("sequence_hash", &self.sequence_hash)
            .finish()
    }
}

struct Owner {
    token: CancellationToken,
    len: usize,
    timing: TimingTrace,
    release_to: Option<Arc<dyn OffloadPolicy>>,
    _guard: OutstandingGuard,
}

/// A batch of resolved blocks ready for transfer: one flat vector (P5).
///
/// `A` is the per-block destination attachment: `()` when the executor allocates destinations
/// itself, the caller-allocated `MutableBlock<Dst>` of each block otherwise
/// ([`take_destinations`](Self::take_destinations)).
pub struct ResolvedBatch<T: Tier, A = ()> {
    blocks: Vec<ResolvedBlock<T>>,
    dests: parking_lot::Mutex<Vec<A>>,
    owners: Vec<Owner>,
    /// The lane and this batch's settlement number, once dispatched.
    lane: Option<(Arc<LaneState>, u64)>,
}

impl<T: Tier, A> std::fmt::Debug for ResolvedBatch<T, A> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ResolvedBatch")
            .field("blocks", &self.blocks.len())
            .field("transfers", &self.owners.len())
            .finish()
    }
}

/// Per-block outcome of an executed batch, aligned with [`ResolvedBatch::blocks`]. `R` is what a
/// successful block yields (the registered destination block, or `()`).
pub type BatchOutcome<R> = Vec<Result<R, BlockFailure>>;

impl<T: Tier, A> ResolvedBatch<T, A> {
    /// The blocks, flat, in batch order.
    pub fn blocks(&self) -> &[ResolvedBlock<T>] {
        &self.blocks
    }

    /// Number of blocks.
    pub fn len(&self) -> usize {
        self.blocks.len()
    }

    /// Whether it is empty (every block had been evicted).
    pub fn is_empty(&self) -> bool {
        self.blocks.is_empty()
    }

    /// Source ids, in batch order.
    pub fn block_ids(&self) -> Vec<BlockId> {
        self.blocks.iter().map(|b| b.block_id).collect()
    }

    /// Sequence hashes, in batch order.
    pub fn sequence_hashes(&self) -> Vec<SequenceHash> {
        self.blocks.iter().map(|b| b.sequence_hash).collect()
    }

    /// The destinations attached to the blocks, aligned with [`blocks`](Self::blocks); empty
    /// when taken before. The executor takes them to move into (for `()` they carry nothing).
    pub fn take_destinations(&self) -> Vec<A> {
        std::mem::take(&mut *self.dests.lock())
    }

    /// Numbers the batch in `lane`'s settlement order (the transfer stage, at dispatch).
    pub(crate) fn dispatch_in(&mut self, lane: Arc<LaneState>) {
        let seq = lane.dispatch();
        self.lane = Some((lane, seq));
    }

    /// Reports `outcome` to the transfers, then releases everything the batch holds: source
    /// references, pending entries and policy resources; hands the successful results to `sink`
    /// (chaining), and last drops the outstanding guards — so a caller woken by `wait` sees the
    /// chained work already enqueued.
    pub(crate) fn settle<R>(mut self, outcome: BatchOutcome<R>, sink: Option<&dyn Fn(Vec<R>)>) {
        // Everything moves out first: `self` is inert from here, so a panic in policy or sink
        // code below cannot make its `Drop` settle the batch a second time.
        let blocks = std::mem::take(&mut self.blocks);
        let mut owners = std::mem::take(&mut self.owners);
        let lane = self.lane.take();
        drop(self);
        let mut outcome = outcome;
        if outcome.len() != blocks.len() {
            tracing::error!(
                expected = blocks.len(),
                got = outcome.len(),
                "executor returned a mis-sized outcome; failing the batch"
            );
            outcome = (0..blocks.len())
                .map(|_| {
                    Err(BlockFailure::new(
                        BlockFailureKind::Transfer,
                        "executor returned a mis-sized outcome",
                    ))
                })
                .collect();
        }
        let now = Instant::now();
        let mut ok = Vec::new();
        let mut results = outcome.into_iter();
        let mut block_iter = blocks.iter();
        let mut released: Vec<(Arc<dyn OffloadPolicy>, Vec<SequenceHash>)> = Vec::new();
        // 1. Outcomes (no foreign code runs here).
        for owner in &mut owners {
            owner.timing.finished = Some(now);
            let shared = &owner.token.shared;
            let mut hashes = Vec::with_capacity(owner.len);
            let mut completed = 0;
            let mut failed = FailureTally::default();
            let mut p = shared.progress.lock();
            for _ in 0..owner.len {
                let b = block_iter
                    .next()
                    .expect("owner lengths sum to the batch length");
                let r = results.next().expect("outcome is aligned with blocks");
                hashes.push(b.sequence_hash);
                match r {
                    Ok(v) => {
                        p.completed.push(b.sequence_hash);
                        ok.push(v);
                        completed += 1;
                    }
                    Err(e) => {
                        failed.add(e.kind);
                        p.failed.push((b.sequence_hash, e));
                    }
                }
                if shared.record_timing() {
                    p.timings.push((b.sequence_hash, owner.timing));
                }
            }
            drop(p);
            if let Some(m) = &shared.metrics {
                m.transferred(completed);
                m.failed(&failed);
            }
            if let Some(pol) = &owner.release_to {
                released.push((pol.clone(), hashes));
            }
        }
        drop(blocks);
        // 2. Policy releases and the sink (foreign code): a panic there abandons the batch
        //    (its outcomes are reported, but the lane fails) and is re-raised to the caller.
        let foreign = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            for (pol, hashes) in &released {
                pol.release(hashes);
            }
            if let Some(sink) = sink
                && !ok.is_empty()
            {
                sink(ok);
            }
        }));
        // 3. Settled before the owners' guards drop, so a caller woken by `wait` finds the
        //    batch settled.
        match foreign {
            Ok(()) => {
                if let Some((lane, seq)) = lane {
                    lane.settle(seq);
                }
                drop(owners);
            }
            Err(panic) => {
                if let Some((lane, seq)) = lane {
                    lane.abandon(
                        seq,
                        PipelineFailureKind::ExecutorPanicked,
                        "a policy release or completion sink panicked while settling a batch"
                            .into(),
                    );
                }
                drop(owners);
                if !std::thread::panicking() {
                    std::panic::resume_unwind(panic);
                }
            }
        }
    }
}

impl<T: Tier, A> Drop for ResolvedBatch<T, A> {
    fn drop(&mut self) {
        if self.owners.is_empty() {
            return;
        }
        // Not settled: the executor panicked or its task was aborted with the batch in flight.
        if let Some((lane, seq)) = self.lane.take() {
            lane.abandon(
                seq,
                PipelineFailureKind::ExecutorPanicked,
                "transfer executor stopped with a batch in flight".into(),
            );
        }
        let n = self.blocks.len();
        let outcome: BatchOutcome<()> = (0..n)
            .map(|_| {
                Err(BlockFailure::new(
                    BlockFailureKind::ExecutorAborted,
                    "transfer executor stopped with the block in flight",
                ))
            })
            .collect();
        let blocks = std::mem::take(&mut self.blocks);
        let owners = std::mem::take(&mut self.owners);
        let tmp = ResolvedBatch::<T, A> {
            blocks,
            dests: parking_lot::Mutex::new(Vec::new()),
            owners,
            lane: None,
        };
        tmp.settle(outcome, None);
    }
}

/// Upgrade a batch of queued blocks by resolving weak references: the commitment boundary (P3).
///
/// Consumes the batch; from here on cancellation no longer applies to these blocks. Strong and
/// external blocks resolve as they are; weak blocks are upgraded, and a block evicted in the
/// meantime is reported failed ([`BlockFailureKind::Evicted`]) and left out. The blocks of all
/// containers are flattened into one vector (P5). Callers sweep first (P4).
pub(crate) fn upgrade_batch<T: Tier, A>(batch: OffloadBatch<T, A>) -> ResolvedBatch<T, A> {
    let now = Instant::now();
    let mut blocks = Vec::with_capacity(batch.total);
    let mut dests = Vec::with_capacity(batch.total);
    let mut owners = Vec::with_capacity(batch.containers.len());
    for mut c in batch.containers {
        let shared = c.cancel_token.shared.clone();
        shared.status.advance(OffloadStatus::Transferring);
        let sources = std::mem::take(&mut c.blocks);
        let pending = std::mem::take(&mut c.pending);
        let attached = std::mem::take(&mut c.dests);
        let mut evicted = Vec::new();
        let start = blocks.len();
        for ((src, pend), dest) in sources.into_iter().zip(pending).zip(attached) {
            let resolved = match src {
                SourceBlock::External(e) => Some((e.block_id, e.sequence_hash, e.digest, None)),
                SourceBlock::Strong(b) => {
                    Some((b.block_id(), b.sequence_hash(), b.digest(), Some(b)))
                }
                SourceBlock::Weak(w) => match w.upgrade() {
                    Some(b) => Some((b.block_id(), b.sequence_hash(), b.digest(), Some(b))),
                    None => {
                        evicted.push(w.sequence_hash());
                        None
                    }
                },
            };
            if let Some((block_id, sequence_hash, digest, holder)) = resolved {
                blocks.push(ResolvedBlock {
                    block_id,
                    sequence_hash,
                    digest,
                    holder,
                    _pending: pend,
                });
                dests.push(dest);
            }
            // An evicted block's destination drops here (a caller-allocated slot goes back to
            // its pool).
        }
        if !evicted.is_empty() {
            shared.report_failed(evicted.iter().map(|h| {
                (
                    *h,
                    BlockFailure::new(BlockFailureKind::Evicted, "evicted before upgrade"),
                )
            }));
            if let Some(p) = &c.release_to {
                p.release(&evicted);
            }
        }
        let mut timing = c.timing;
        timing.upgraded = Some(now);
        owners.push(Owner {
            token: c.cancel_token.clone(),
            len: blocks.len() - start,
            timing,
            release_to: c.release_to.clone(),
            _guard: c.guard.split(),
        });
        // `c` drops here holding no blocks: nothing is reported cancelled.
    }
    ResolvedBatch {
        blocks,
        dests: parking_lot::Mutex::new(dests),
        owners,
        lane: None,
    }
}
