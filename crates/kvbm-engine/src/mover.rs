//! [`BlockMove`]: the one seam sessions move blocks through, in-process or across ranks.
//!
//! An onboarding session does not care whether a G3→G2 stage runs in the leader's own process
//! (`kvbm-offload`'s [`BlockMover`]) or on every tensor-parallel rank
//! ([`SpmdMover`](crate::worker::SpmdMover)); it needs the destination manager (to allocate
//! destinations up front) and a per-block outcome that registers a destination only when its
//! bytes arrived. Both implement this trait; failures are carried as their description.

use std::sync::Arc;

use futures::FutureExt;
use futures::future::BoxFuture;
use kvbm_logical::{BlockManager, ImmutableBlock, MutableBlock, Tier};
use kvbm_offload::BlockMover;

/// One block move's outcome: the registered destination, or why not.
pub type Moved<Dst> = Result<ImmutableBlock<Dst>, String>;

/// Moves registered `Src` blocks into caller-allocated `Dst` blocks.
pub trait BlockMove<Src: Tier, Dst: Tier>: Send + Sync + 'static {
    /// The manager destinations are allocated from.
    fn destination(&self) -> &Arc<BlockManager<Dst>>;
    /// Moves `sources[i]` into `destinations[i]`; one outcome per block, in order; resolves
    /// only after every block settled.
    fn move_blocks<'a>(
        &'a self,
        sources: &'a [ImmutableBlock<Src>],
        destinations: Vec<MutableBlock<Dst>>,
    ) -> BoxFuture<'a, Vec<Moved<Dst>>>;
}

impl<Src: Tier, Dst: Tier> BlockMove<Src, Dst> for BlockMover<Src, Dst> {
    fn destination(&self) -> &Arc<BlockManager<Dst>> {
        BlockMover::destination(self)
    }

    fn move_blocks<'a>(
        &'a self,
        sources: &'a [ImmutableBlock<Src>],
        destinations: Vec<MutableBlock<Dst>>,
    ) -> BoxFuture<'a, Vec<Moved<Dst>>> {
        self.move_from(sources, destinations)
            .map(|out| {
                out.into_iter()
                    .map(|r| r.map_err(|f| f.to_string()))
                    .collect()
            })
            .boxed()
    }
}

impl<Src: Tier, Dst: Tier> BlockMove<Src, Dst> for crate::worker::SpmdMover<Src, Dst> {
    fn destination(&self) -> &Arc<BlockManager<Dst>> {
        crate::worker::SpmdMover::destination(self)
    }

    fn move_blocks<'a>(
        &'a self,
        sources: &'a [ImmutableBlock<Src>],
        destinations: Vec<MutableBlock<Dst>>,
    ) -> BoxFuture<'a, Vec<Moved<Dst>>> {
        self.move_from(sources, destinations).boxed()
    }
}
