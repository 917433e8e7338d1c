//! The offload lanes' pieces the stack adds to `kvbm-offload`'s: the G2→G3 executor that
//! records each block's checksum in the journal, and the hand-off from one lane's completion
//! sink to the next lane. (G1→G2 is `kvbm-offload`'s `BlockMoveExecutor` over an inline
//! `BlockMover`, waiting for G2 room as `offload.g1_to_g2.room_patience_ms` says.)

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Instant;

use kvbm_logical::{BlockRegistry, G2, G3, ImmutableBlock};
use kvbm_offload::{
    AllOfPolicy, BatchOutcome, BlockMoveExecutor, CheckedDisk, EnqueueError, MoveExecutor,
    OffloadHandle, OffloadPolicy, Pipeline, PipelineConfig, PresenceFilter, ResolvedBatch,
    create_policy_from_config,
};
use kvbm_physical::PhysicalLayout;
use parking_lot::Mutex;

use super::counters::{Counters, MovePath};

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
