//! The offload lanes' executors and hand-offs: G1→G2 that waits for G2 room, G2→G3 that
//! records each block's checksum in the journal, and the hand-off from one lane's completion
//! sink to the next lane.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use kvbm_logical::{
    BlockManager, BlockRegistry, G1, G2, G3, ImmutableBlock, MutableBlock, SequenceHash,
};
use kvbm_offload::{
    AllOfPolicy, BatchOutcome, BlockFailure, BlockFailureKind, BlockTransferExecutor, EnqueueError,
    OffloadPolicy, Pipeline, PipelineConfig, PresenceFilter, ResolvedBatch, TransferExecutor,
    TransferHandle, create_policy_from_config,
};
use kvbm_physical::{LayoutHandle, PhysicalLayout, TransferManager, TransferOptions};
use parking_lot::Mutex;

use crate::error::Result;

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

/// G2→G3 executor: records each block's payload checksum (for the manifest) before the
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
/// the replay waits for it). Only a batch larger than G2, or one still without room after
/// `patience` (something holds G2 for good: a bug, reported, never a hang), fails `NoSpace`.
///
/// G1 here is host memory (the GPU's stand-in), so the copy is host to host: one
/// [`TransferManager::execute_transfer_inline`] (the manager's claims and checks, a `memcpy` of
/// at most one batch on this task) instead of a round trip through the manager's runtime.
/// Destinations are registered only after their bytes arrived, as `kvbm-offload`'s
/// `BlockMover` does.
pub(super) struct G1ToG2Executor {
    pub(super) tm: Arc<TransferManager>,
    pub(super) src: LayoutHandle,
    pub(super) dst: LayoutHandle,
    pub(super) g2: Arc<BlockManager<G2>>,
    pub(super) patience: Duration,
    /// Allocation retries that found G2 full (each one backoff sleep).
    pub(super) waits: Arc<AtomicU64>,
}

impl G1ToG2Executor {
    /// Copies `sources` into `dst` and registers the destinations whose bytes arrived.
    pub(super) fn copy(
        &self,
        sources: &[(usize, SequenceHash)],
        dst: Vec<MutableBlock<G2>>,
    ) -> BatchOutcome<ImmutableBlock<G2>> {
        let n = sources.len();
        let src_ids: Vec<usize> = sources.iter().map(|(id, _)| *id).collect();
        let dst_ids: Vec<usize> = dst.iter().map(|b| b.block_id()).collect();
        // SAFETY: the destinations are `MutableBlock`s this executor owns (freshly allocated,
        // registered only after the copy); the G1 sources are slots the batch holds, read only.
        let issued = unsafe {
            self.tm.execute_transfer_inline(
                self.src,
                &src_ids,
                self.dst,
                &dst_ids,
                TransferOptions::default(),
            )
        };
        let outcome = match issued {
            Ok(o) => o,
            Err(e) => {
                let e = Arc::new(e);
                return (0..n)
                    .map(|_| Err(BlockFailure::physical_shared(&e)))
                    .collect();
            }
        };
        let mut results: Vec<Option<Result<ImmutableBlock<G2>, BlockFailure>>> =
            (0..n).map(|_| None).collect();
        let (mut complete, mut at) = (Vec::with_capacity(n), Vec::with_capacity(n));
        for (i, ((m, (_, h)), (_, r))) in
            dst.into_iter().zip(sources).zip(outcome.blocks).enumerate()
        {
            match r {
                Ok(()) => match m.complete(*h) {
                    Ok(c) => {
                        complete.push(c);
                        at.push(i);
                    }
                    Err(e) => {
                        results[i] = Some(Err(BlockFailure::new(
                            BlockFailureKind::Transfer,
                            format!("cannot register in G2: {}", e.error),
                        )))
                    }
                },
                // The slot goes back to G2's reset pool; nothing is registered.
                Err(e) => results[i] = Some(Err(BlockFailure::physical(e))),
            }
        }
        for (i, b) in at.into_iter().zip(self.g2.register_blocks(complete)) {
            results[i] = Some(Ok(b));
        }
        results
            .into_iter()
            .map(|r| {
                r.unwrap_or_else(|| {
                    Err(BlockFailure::new(
                        BlockFailureKind::Transfer,
                        "G2 registered fewer blocks than it was given",
                    ))
                })
            })
            .collect()
    }
}

impl TransferExecutor<G1> for G1ToG2Executor {
    type Output = ImmutableBlock<G2>;

    async fn execute(&self, batch: &ResolvedBatch<G1>) -> BatchOutcome<ImmutableBlock<G2>> {
        let n = batch.len();
        let sources: Vec<(usize, SequenceHash)> = batch
            .blocks()
            .iter()
            .map(|b| (b.block_id, b.sequence_hash))
            .collect();
        let no_space = |why: String| -> BatchOutcome<ImmutableBlock<G2>> {
            (0..n)
                .map(|_| Err(BlockFailure::new(BlockFailureKind::NoSpace, why.clone())))
                .collect()
        };
        if n > self.g2.total_blocks() {
            return no_space(format!(
                "a batch of {n} blocks exceeds G2 ({} blocks)",
                self.g2.total_blocks()
            ));
        }
        let deadline = Instant::now() + self.patience;
        let mut backoff = Duration::from_micros(50);
        loop {
            match self.g2.allocate_blocks(n) {
                Ok(dst) => return self.copy(&sources, dst),
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
/// the blocks, it never drops them. A closed or failed lane is logged (the replay's drain
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
