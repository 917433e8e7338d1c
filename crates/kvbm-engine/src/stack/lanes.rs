//! The stack's offload lanes ([`Lanes`]): G1→G2, G2→G3, G2→G4, the write-through that feeds the
//! lower two from the scheduler's stores, every lane's handles and what they settled
//! ([`LaneOutcomes`]); and the pieces the stack adds to `kvbm-offload`'s: the G2→G3 executor
//! that records each block's checksum in the journal, and the hand-off from one lane's
//! completion sink to the next lane. (G1→G2 is `kvbm-offload`'s `BlockMoveExecutor` over an
//! inline `BlockMover`, waiting for G2 room as `offload.g1_to_g2.room_patience_ms` says.)
//!
//! Ownership: a lane holds the blocks it moves (strong for G1→G2 and the write-through, weak
//! and upgraded at the commitment point for the chained lanes). Lock order: `handles` and
//! `handoffs` are leaf locks; the write-through's lanes lock is taken before `handles`.

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use kvbm_logical::{BlockRegistry, G1, G2, G3, ImmutableBlock};
use kvbm_offload::{
    AllOfPolicy, BatchOutcome, BlockFailureKind, BlockMoveExecutor, CheckedDisk, EnqueueError,
    MoveExecutor, ObjectPipeline, OffloadHandle, OffloadPolicy, OffloadResult, Pipeline,
    PipelineConfig, PresenceFilter, ResolvedBatch, create_policy_from_config,
};
use kvbm_physical::PhysicalLayout;
use parking_lot::Mutex;

use super::counters::{Counters, MovePath};
use super::write_through::WriteThrough;
use crate::error::Result;

/// What the lanes' settled handles said, every lane together: what was written, and what
/// never started (nothing moved) or failed.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct LaneOutcomes {
    /// Blocks written to their destination.
    pub transferred: u64,
    /// Blocks whose offload did not complete (every kind below included).
    pub failed: u64,
    /// Blocks the lanes filtered (already present, or by policy).
    pub filtered: u64,
    /// Blocks cancelled before they moved.
    pub cancelled: u64,
    /// Of the failed: queued (weak) blocks evicted from their source tier before their lane
    /// reached them.
    pub evicted_before_offload: u64,
    /// Of the failed: offloads refused because the destination had no evictable block.
    pub no_space: u64,
}

/// The stack's offload lanes, their handles, and what they settled (see the module docs).
pub(crate) struct Lanes {
    pub(crate) g1_to_g2: Option<Pipeline<G1>>,
    pub(crate) g2_to_g3: Option<Arc<Pipeline<G2>>>,
    pub(crate) g2_to_g4: Option<Arc<ObjectPipeline>>,
    /// Where the scheduler's stores go on to G3/G4 (`FrontEnd::Tiering`).
    pub(crate) write_through: Option<WriteThrough>,
    /// Every lane's handles but G1→G2's, settled by [`Lanes::reap`] and [`Lanes::drain`].
    pub(crate) handles: Arc<Mutex<Vec<OffloadHandle>>>,
    /// G1→G2 handles, oldest first: the only offloads whose end frees G1 slots, so waiting for
    /// G1 room waits for these alone ([`Lanes::wait_oldest_g1`]).
    g1_handles: VecDeque<OffloadHandle>,
    /// Hand-offs from a completion sink to a full lane, still waiting for room
    /// ([`enqueue_from_sink`]); drained before the lower lanes are waited for.
    pub(crate) handoffs: Handoffs,
    /// Times a store into G2 found it full and waited for the lower lanes to free a slot.
    pub(crate) g2_space_waits: Arc<AtomicU64>,
    /// Largest G1→G2 batch (the G2 room one batch needs).
    pub(crate) g1_batch: usize,
    counters: Arc<Counters>,
    outcomes: LaneOutcomes,
}

impl Lanes {
    pub(crate) fn new(counters: Arc<Counters>, g1_batch: usize) -> Self {
        Lanes {
            g1_to_g2: None,
            g2_to_g3: None,
            g2_to_g4: None,
            write_through: None,
            handles: Arc::default(),
            g1_handles: VecDeque::new(),
            handoffs: Arc::default(),
            g2_space_waits: Arc::default(),
            g1_batch,
            counters,
            outcomes: LaneOutcomes::default(),
        }
    }

    /// What the lanes settled so far.
    pub(crate) fn outcomes(&self) -> LaneOutcomes {
        self.outcomes
    }

    /// Blocks queued or in flight in the lanes.
    pub(crate) fn pending(&self) -> usize {
        self.g1_to_g2.as_ref().map_or(0, |p| p.pending_blocks())
            + self.g2_to_g3.as_ref().map_or(0, |p| p.pending_blocks())
            + self
                .g2_to_g4
                .as_ref()
                .map_or(0, |p| p.pipeline().pending_blocks())
    }

    /// Hands computed G1 blocks to the G1→G2 lane (a plain blocking enqueue: no trip through
    /// the runtime unless the queue is full). Nothing happens without that lane.
    ///
    /// # Errors
    /// The lane refused the blocks (it is shutting down).
    pub(crate) fn enqueue_g1(&mut self, blocks: Vec<ImmutableBlock<G1>>) -> Result<()> {
        let Some(p) = &self.g1_to_g2 else {
            return Ok(());
        };
        let n = blocks.len() as u64;
        match p.enqueue_blocking(blocks, None) {
            Ok(h) => {
                self.counters
                    .offload_enqueued
                    .fetch_add(n, Ordering::Relaxed);
                self.g1_handles.push_back(h);
                Ok(())
            }
            Err(e) => Err(crate::error::EngineError::stack(format!(
                "the G1→G2 pipeline refused blocks: {e}"
            ))),
        }
    }

    /// Waits for the oldest G1→G2 offload to settle (its G1 blocks are then released);
    /// `false` when none is left.
    pub(crate) fn wait_oldest_g1(&mut self, rt: &tokio::runtime::Handle) -> bool {
        let Some(h) = self.g1_handles.pop_front() else {
            return false;
        };
        match rt.block_on(h.wait()) {
            Ok(r) => self.tally(&r),
            Err(e) => tracing::warn!(error = %e, "an offload did not finish"),
        }
        true
    }

    /// Counts one finished lane transfer: evicted-before-offload, filtered and no-space blocks
    /// are offloads that never started (nothing moved); every other failure is a failed
    /// transfer.
    fn tally(&mut self, r: &OffloadResult) {
        let o = &mut self.outcomes;
        for (h, f) in &r.failed_blocks {
            match f.kind {
                BlockFailureKind::Evicted => o.evicted_before_offload += 1,
                BlockFailureKind::NoSpace => o.no_space += 1,
                _ => {
                    self.counters
                        .failed_transfers
                        .fetch_add(1, Ordering::Relaxed);
                    tracing::debug!(hash = %h, kind = f.kind.as_str(), reason = %f.message, "offload failed");
                }
            }
        }
        o.transferred += r.completed_blocks.len() as u64;
        o.failed += r.failed_blocks.len() as u64;
        o.filtered += r.filtered_blocks.len() as u64;
        o.cancelled += r.cancelled_blocks.len() as u64;
    }

    /// Collects finished handles.
    pub(crate) fn reap(&mut self) {
        let done: Vec<OffloadResult> = {
            let mut hs = self.handles.lock();
            let mut done = Vec::new();
            hs.retain(|h| match h.try_result() {
                Some(r) => {
                    done.push(r);
                    false
                }
                None => true,
            });
            done
        };
        for r in &done {
            self.tally(r);
        }
        while let Some(r) = self.g1_handles.front().and_then(|h| h.try_result()) {
            self.g1_handles.pop_front();
            self.tally(&r);
        }
    }

    /// Waits until every lane is quiescent (G1→G2 first, so its chained blocks are enqueued
    /// before the lower lanes are waited for): every handle settled and every sink hand-off
    /// enqueued. A finishing G1→G2 batch hands its blocks on to G2→G3/G2→G4 from its sink,
    /// which adds handles (or hand-offs) while this waits, so it loops until a round finds none.
    pub(crate) fn drain(&mut self, rt: &tokio::runtime::Handle) {
        if let Some(w) = &self.write_through {
            w.flush(true);
        }
        while self.wait_oldest_g1(rt) {}
        loop {
            let waiting: Vec<_> = std::mem::take(&mut *self.handoffs.lock());
            let pending: Vec<OffloadHandle> = std::mem::take(&mut *self.handles.lock());
            if waiting.is_empty() && pending.is_empty() {
                break;
            }
            for j in waiting {
                let _ = rt.block_on(j);
            }
            for h in pending {
                match rt.block_on(h.wait()) {
                    Ok(r) => self.tally(&r),
                    Err(e) => tracing::warn!(error = %e, "an offload did not finish"),
                }
            }
        }
    }

    /// Stops the pipelines (after [`Lanes::drain`]); flushes G2→G4's lock releases too.
    pub(crate) fn shut_down(&self, rt: &tokio::runtime::Handle) {
        let (a, b, c) = (
            self.g1_to_g2.as_ref(),
            self.g2_to_g3.clone(),
            self.g2_to_g4.clone(),
        );
        rt.block_on(async {
            if let Some(p) = a {
                p.shutdown_and_wait().await;
            }
            if let Some(p) = b {
                p.shutdown_and_wait().await;
            }
            if let Some(p) = c {
                p.shutdown_and_wait().await;
            }
        });
    }
}

pub(super) fn lane_policy(
    registry: &BlockRegistry,
    cfg: &PipelineConfig,
) -> Arc<dyn OffloadPolicy> {
    let presence: Arc<dyn OffloadPolicy> = Arc::new(PresenceFilter::new(registry.clone()));
    if cfg.policies.is_empty() {
        presence
    } else {
        Arc::new(AllOfPolicy::new(vec![
            presence,
            create_policy_from_config(&cfg.policies, registry),
        ]))
    }
}

/// G2→G3 executor: each block's payload checksum computed from G2, the write made through
/// kvbm-offload's checked disk (journal protocol, checksum recorded for the check on read),
/// bytes counted.
pub(super) struct RecordingG3Executor {
    pub(super) inner: BlockMoveExecutor<G2, G3>,
    pub(super) g2_layout: Arc<PhysicalLayout>,
    pub(super) checked: Arc<CheckedDisk>,
    pub(super) counters: Arc<Counters>,
    pub(super) block_bytes: usize,
}

impl MoveExecutor<G2> for RecordingG3Executor {
    type Output = ImmutableBlock<G3>;

    async fn execute(&self, batch: &ResolvedBatch<G2>) -> BatchOutcome<ImmutableBlock<G3>> {
        // The batch holds its source blocks (upgraded), so their bytes are stable here.
        let sums: Vec<(u128, u128)> = batch
            .block_ids()
            .into_iter()
            .zip(batch.sequence_hashes())
            .map(|(id, h)| {
                // Every layer's regions, in (layer, outer) order: the bytes the arrival check
                // hashes when the block is read back (a block has several regions unless its
                // layout is one layer of one region).
                let layers = self.g2_layout.layout().config().num_layers;
                let regions = self.g2_layout.block_addrs(id, 0..layers);
                // SAFETY: host memory of the G2 layout; the source block is held by the batch
                // and nothing writes a registered block.
                let slices = regions.iter().map(|&(addr, len)| unsafe {
                    std::slice::from_raw_parts(addr as *const u8, len)
                });
                (
                    h.as_u128(),
                    kvbm_physical::checksum::checksum_slices(slices),
                )
            })
            .collect();
        let t = Instant::now();
        let out = self.checked.write_batch(&self.inner, batch, sums).await;
        metrics::histogram!(
            crate::metrics::STACK_TRANSFER_SECONDS,
            crate::metrics::PATH_LABEL => "g2_to_g3"
        )
        .record(t.elapsed().as_secs_f64());
        let ok = out.iter().filter(|r| r.is_ok()).count();
        self.counters
            .add_bytes(MovePath::G2_TO_G3, ok, self.block_bytes);
        out
    }
}

/// Sink hand-offs still waiting for room in a full lane.
pub(super) type Handoffs = Arc<Mutex<Vec<tokio::task::JoinHandle<()>>>>;

/// Hands blocks from a completion sink to the next lane. A sink runs on a pipeline's runtime
/// thread and must not block, so this tries first and, when the next lane's input queue is full,
/// finishes the hand-off with an awaited enqueue on a task of that runtime: backpressure delays
/// the blocks, it never drops them. A closed or failed lane is logged (the stack's drain
/// reports what did not settle).
pub(super) fn enqueue_from_sink<P: Send + Sync + 'static>(
    p: &Arc<P>,
    pipeline: fn(&P) -> &Pipeline<G2>,
    blocks: Vec<ImmutableBlock<G2>>,
    handles: &Arc<Mutex<Vec<OffloadHandle>>>,
    handoffs: &Handoffs,
    counters: &Arc<Counters>,
    lane: &'static str,
) {
    let n = blocks.len() as u64;
    match pipeline(p).try_enqueue(blocks, None) {
        Ok(h) => {
            counters.offload_enqueued.fetch_add(n, Ordering::Relaxed);
            handles.lock().push(h);
        }
        Err(EnqueueError::Full(rejected)) => {
            let (p, handles, counters) = (Arc::clone(p), Arc::clone(handles), Arc::clone(counters));
            handoffs.lock().push(tokio::spawn(async move {
                match pipeline(&p).enqueue(rejected.blocks, None).await {
                    Ok(h) => {
                        counters.offload_enqueued.fetch_add(n, Ordering::Relaxed);
                        handles.lock().push(h);
                    }
                    Err(e) => tracing::debug!(error = %e, "{lane} enqueue refused"),
                }
            }));
        }
        Err(e) => tracing::debug!(error = %e, "{lane} enqueue refused"),
    }
}
