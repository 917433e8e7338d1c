//! Set-up shared by the engine's integration tests and kvbm-cluster's (which include this file
//! by path: one test kit, not a copy): one small block geometry, a per-block byte
//! pattern to fill host layouts with, reading a block's bytes back, and block managers of `N`
//! blocks on a shared registry. Each test reads expected bytes back from the layouts it filled,
//! so the pattern itself is arbitrary.

#![allow(dead_code)] // each test binary uses its own subset

use std::sync::Arc;

use kvbm_logical::{BlockManager, BlockRegistry, Tier};
use kvbm_physical::BlockLayout;
/// The workspace's test kit: fill a host layout with a pattern, read a block's bytes back.
#[allow(unused_imports)] // each test binary uses its own subset
pub(crate) use kvbm_physical::testing::{bytes, fill};

/// Blocks per layout and per block manager.
pub(crate) const N: usize = 8;

/// `N` blocks of 2 layers × 2 × 16 × `inner_dim` × 2 bytes, fully contiguous.
pub(crate) fn geometry_with(inner_dim: usize) -> BlockLayout {
    kvbm_physical::testing::geometry(N, 2, inner_dim)
}

/// [`geometry_with`] an inner dimension of 64.
pub(crate) fn geometry() -> BlockLayout {
    geometry_with(64)
}

/// A block manager of `N` blocks of 4 tokens on `registry`.
pub(crate) fn manager<T: Tier>(registry: &BlockRegistry) -> Arc<BlockManager<T>> {
    Arc::new(
        BlockManager::<T>::builder()
            .block_count(N)
            .block_size(4)
            .registry(registry.clone())
            .build()
            .unwrap(),
    )
}

/// A mover from `src` (any layout `tm` knows; an object layout too, then call
/// `keyed_source()`) into the bound tier `(dst, manager)`.
pub(crate) fn mover<S: Tier, D: Tier>(
    tm: &Arc<kvbm_physical::TransferManager>,
    src: kvbm_physical::LayoutHandle,
    dst: kvbm_physical::LayoutHandle,
    manager: &Arc<BlockManager<D>>,
) -> kvbm_offload::BlockMover<S, D> {
    let bound = kvbm_offload::BoundTier::new(tm.clone(), dst, manager.clone()).unwrap();
    kvbm_offload::BlockMover::from_layout(src, &bound).unwrap()
}

/// Onboards the staged `session` (6 or any number of blocks: one G1 block each) from `tm`'s
/// `g2` layout into fresh blocks of `g1`, finishes it, and checks that G1 block `i` holds
/// `hashes[i]` with the bytes `expected[i]`.
pub(crate) async fn onboard_and_verify(
    session: &kvbm_engine::leader::OnboardingSession,
    tm: &Arc<kvbm_physical::TransferManager>,
    g2: kvbm_physical::LayoutHandle,
    g1: kvbm_physical::LayoutHandle,
    g1_manager: &Arc<BlockManager<kvbm_logical::G1>>,
    hashes: &[kvbm_logical::SequenceHash],
    expected: &[Vec<u8>],
) {
    session
        .onboard(
            Arc::new(mover(tm, g2, g1, g1_manager)),
            g1_manager.allocate_blocks(session.prefix_len()).unwrap(),
        )
        .await
        .unwrap();
    let kvbm_engine::leader::FinishOutcome::Finished(on_g1) = session.finish() else {
        panic!("complete");
    };
    let g1_layout = tm.layout(g1).unwrap();
    for (i, b) in on_g1.iter().enumerate() {
        assert_eq!(b.sequence_hash(), hashes[i]);
        assert_eq!(bytes(&g1_layout, b.block_id()), expected[i], "block {i}");
    }
}

/// A layer mover that lets one layer through per permit of `gate` (a test steps a layer-wise
/// onboarding layer by layer).
pub(crate) struct Gated {
    /// The mover that does the work.
    pub inner: Arc<dyn kvbm_engine::mover::LayerMove<kvbm_logical::G2, kvbm_logical::G1>>,
    /// One permit per layer allowed through.
    pub gate: Arc<tokio::sync::Semaphore>,
}

impl kvbm_engine::mover::LayerMove<kvbm_logical::G2, kvbm_logical::G1> for Gated {
    fn destination(&self) -> &Arc<BlockManager<kvbm_logical::G1>> {
        self.inner.destination()
    }

    fn num_layers(&self) -> usize {
        self.inner.num_layers()
    }

    fn move_layers<'a>(
        &'a self,
        sources: &'a [kvbm_logical::ImmutableBlock<kvbm_logical::G2>],
        destinations: &'a [kvbm_logical::MutableBlock<kvbm_logical::G1>],
        layers: std::ops::Range<usize>,
    ) -> futures::future::BoxFuture<'a, Vec<kvbm_engine::mover::BlockOutcome>> {
        Box::pin(async move {
            self.gate.acquire().await.unwrap().forget();
            self.inner.move_layers(sources, destinations, layers).await
        })
    }
}
