//! The offload lanes' executors and hand-offs: G1→G2 that waits for G2 room, G2→G3 that
//! records each block's checksum in the journal, and the hand-off from one lane's completion
//! sink to the next lane.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use kvbm_logical::{BlockManager, BlockRegistry, G1, G2, G3, ImmutableBlock};
use kvbm_offload::{
    AllOfPolicy, BatchOutcome, BlockFailure, BlockFailureKind, BlockMover, BlockTransferExecutor,
    EnqueueError, MoveSource, OffloadPolicy, Pipeline, PipelineConfig, PresenceFilter,
    ResolvedBatch, TransferExecutor, TransferHandle, create_policy_from_config,
};
use kvbm_physical::PhysicalLayout;
use parking_lot::Mutex;

use super::journal::G3Index;

use super::counters::{Counters, MovePath};

/// How long a G1→G2 batch waits for G2 space before it fails `NoSpace` (see
/// [`G1ToG2Executor`]).
pub(super) const G2_SPACE_PATIENCE: Duration = Duration::from_secs(30);

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

/// G2→G3 executor: records each block's payload checksum (for the journal) before the
/// `kvbm-offload` executor writes it, and counts bytes.
pub(super) struct RecordingG3Executor {
    pub(super) inner: BlockTransferExecutor<G2, G3>,
    pub(super) g2_layout: Arc<PhysicalLayout>,
    pub(super) checksums: Arc<Mutex<std::collections::HashMap<u128, u128>>>,
    pub(super) counters: Arc<Counters>,
    pub(super) block_bytes: usize,
    pub(super) index: Arc<G3Index>,
}

impl TransferExecutor<G2> for RecordingG3Executor {
    type Output = ImmutableBlock<G3>;

    async fn execute(&self, batch: &ResolvedBatch<G2>) -> BatchOutcome<ImmutableBlock<G3>> {
        // The batch holds its source blocks (upgraded), so their bytes are stable here.
        let sums: Vec<(u128, u128)> = batch
            .block_ids()
            .into_iter()
            .zip(batch.sequence_hashes())
            .map(|(id, h)| {
                let (addr, len) = self.g2_layout.block_addrs(id, 0..1)[0];
                // SAFETY: host memory of the G2 layout; the source block is held by the batch
                // and nothing writes a registered block.
                let bytes = unsafe { std::slice::from_raw_parts(addr as *const u8, len) };
                (h.as_u128(), xxhash_rust::xxh3::xxh3_128(bytes))
            })
            .collect();
        self.checksums.lock().extend(sums.iter().copied());
        let t = Instant::now();
        let out = super::journal::write_recorded(&self.inner, &self.index, batch, &sums).await;
        metrics::histogram!("kvbm_replay_transfer_seconds", "path" => "g2_to_g3")
            .record(t.elapsed().as_secs_f64());
        let ok = out.iter().filter(|r| r.is_ok()).count();
        self.counters
            .add_bytes(MovePath::G2ToG3, ok, self.block_bytes);
        out
    }
}

/// The G1→G2 executor: waits for G2 space instead of failing `NoSpace`, and copies on the
/// lane's own thread.
///
/// G2 stages every offload: the lower lanes hold a G2 block (strongly) until it is written to
/// G3/G4, so with G2 barely larger than G1 a G1→G2 batch can find every G2 slot held for a
/// moment. `kvbm-offload`'s allocate-then-move executor fails such a batch (`NoSpace`) and the
/// blocks are recomputed later: lost hits. This one retries the allocation, with a short
/// backoff, until G2 has room — the lower lanes free slots as they finish — so no block is
/// dropped for lack of space; the wait is backpressure on the G1→G2 lane (and so on G1, where
/// the stack waits for it). Only a batch larger than G2, or one still without room after
/// `patience` (something holds G2 for good: a bug, reported, never a hang), fails `NoSpace`.
///
/// The move itself is `kvbm-offload`'s [`BlockMover`], inline: G1 here is host memory (the
/// GPU's stand-in), so the copy is host to host, a `memcpy` of at most one batch on this task
/// with the transfer manager's claims and checks, instead of a round trip through the manager's
/// runtime. Destinations are registered only after their bytes arrived.
pub(super) struct G1ToG2Executor {
    /// kvbm-offload's move, inline: G1 slots into G2 destinations, registered once arrived.
    pub(super) mover: BlockMover<G1, G2>,
    pub(super) patience: Duration,
    /// Allocation retries that found G2 full (each one backoff sleep).
    pub(super) waits: Arc<AtomicU64>,
}

impl G1ToG2Executor {
    fn g2(&self) -> &Arc<BlockManager<G2>> {
        self.mover.destination()
    }
}

impl TransferExecutor<G1> for G1ToG2Executor {
    type Output = ImmutableBlock<G2>;

    async fn execute(&self, batch: &ResolvedBatch<G1>) -> BatchOutcome<ImmutableBlock<G2>> {
        let n = batch.len();
        let sources: Vec<MoveSource> = batch.blocks().iter().map(MoveSource::from).collect();
        let no_space = |why: String| -> BatchOutcome<ImmutableBlock<G2>> {
            (0..n)
                .map(|_| Err(BlockFailure::new(BlockFailureKind::NoSpace, why.clone())))
                .collect()
        };
        let g2 = self.g2();
        if n > g2.total_blocks() {
            return no_space(format!(
                "a batch of {n} blocks exceeds G2 ({} blocks)",
                g2.total_blocks()
            ));
        }
        let deadline = Instant::now() + self.patience;
        let mut backoff = Duration::from_micros(50);
        loop {
            match g2.allocate_blocks(n) {
                // Inline: the copy is done when `move_blocks` returns.
                Ok(dst) => return self.mover.move_blocks(&sources, dst).await,
                Err(e) if Instant::now() >= deadline => {
                    tracing::warn!(error = %e, "G2 stayed full for {:?}", self.patience);
                    return no_space(format!("G2 stayed full for {:?}: {e}", self.patience));
                }
                Err(_) => {
                    self.waits.fetch_add(1, Ordering::Relaxed);
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(Duration::from_millis(2));
                }
            }
        }
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
    handles: &Arc<Mutex<Vec<TransferHandle>>>,
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
