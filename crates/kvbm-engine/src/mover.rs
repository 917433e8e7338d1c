//! [`BlockMove`]: the one seam sessions move blocks through, in-process or across ranks.
//!
//! An onboarding session does not care whether a G3→G2 stage runs in the leader's own process
//! (`kvbm-offload`'s [`BlockMover`]) or on every tensor-parallel rank
//! (the engine's `SpmdMover`, in `worker`); it needs the destination manager (to allocate
//! destinations up front) and a per-block outcome that registers a destination only when its
//! bytes arrived. Both implement this trait. Every failed block carries its typed
//! [`BlockFailure`] (kind, message, the physical error behind it), so a caller tells a corrupt
//! copy ([`BlockFailureKind::drops_copy`]) from a transient I/O failure without reading text.
//!
//! [`LayerMove`] is the layer-wise variant the onboard phase uses (G2→G1, one layer of every
//! block of the prefix at a time): it copies a layer range into destination slots the *caller*
//! owns and registers nothing, because a block is only whole once its last layer arrived; the
//! session completes and registers the destinations itself after the last layer. In-process it
//! is [`LayerMover`] (one transfer manager, two bound tiers), whose copy is kvbm-offload's
//! [`ExternalMover::move_layers`]: this module issues no raw transfer; the destinations'
//! exclusivity is proven by their types (the session's unregistered `MutableBlock`s, checked
//! to be the mover's destination manager's), so `move_layers` is a safe call. Across ranks it
//! is the engine's `SpmdLayerMover` (in `worker`), whose per-rank copy is
//! `PhysicalWorker::execute`, reached through a `worker::Reserved`.
//!
//! ```text
//!  layer 0: move_layers(sources, destinations, 0..1) ── all ranks settled ──► layer 0 ready
//!  layer 1: move_layers(sources, destinations, 1..2) ── ...               ──► layer 1 ready
//!  ...
//!  last layer ready ─► session: complete(hash, digest) + register every destination
//! ```

use std::ops::Range;
use std::sync::Arc;

use futures::FutureExt;
use futures::future::BoxFuture;
use kvbm_logical::{BlockId, BlockManager, ImmutableBlock, MutableBlock, Tier};
use kvbm_offload::{
    BlockFailure, BlockFailureKind, BlockMover, BoundTier, ExternalMover, MoveOutcome, MoveSource,
};
use kvbm_physical::LayoutHandle;

use crate::error::{EngineError, Result};

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
    ) -> BoxFuture<'a, Vec<MoveOutcome<Dst>>>;
}

impl<Src: Tier, Dst: Tier> BlockMove<Src, Dst> for BlockMover<Src, Dst> {
    fn destination(&self) -> &Arc<BlockManager<Dst>> {
        BlockMover::destination(self)
    }

    fn move_blocks<'a>(
        &'a self,
        sources: &'a [ImmutableBlock<Src>],
        destinations: Vec<MutableBlock<Dst>>,
    ) -> BoxFuture<'a, Vec<MoveOutcome<Dst>>> {
        self.move_from(sources, destinations).boxed()
    }
}

/// One block's outcome of a move that registers nothing (a layer range, one rank's part of a
/// transfer): `Ok` when its bytes arrived.
pub type BlockOutcome = std::result::Result<(), BlockFailure>;

/// Copies layer ranges of registered `Src` blocks into destination slots the caller owns
/// (unregistered [`MutableBlock`]s); see the [module docs](self).
pub trait LayerMove<Src: Tier, Dst: Tier>: Send + Sync + 'static {
    /// The manager destinations are allocated from (and registered in, after the last layer).
    fn destination(&self) -> &Arc<BlockManager<Dst>>;
    /// Layers of one block (the same on both sides).
    fn num_layers(&self) -> usize;
    /// Copies `layers` of `sources[i]` into `destinations[i]` (the caller's unregistered
    /// blocks of [`destination`](Self::destination), which it keeps until the future resolved
    /// and registers after the last layer); one outcome per block, in order; resolves only
    /// after every block (on every rank) settled. A length mismatch, an empty or out-of-range
    /// `layers`, or a destination of another manager fails every block without moving
    /// anything.
    fn move_layers<'a>(
        &'a self,
        sources: &'a [ImmutableBlock<Src>],
        destinations: &'a [MutableBlock<Dst>],
        layers: Range<usize>,
    ) -> BoxFuture<'a, Vec<BlockOutcome>>;
}

/// Refuses a move whose destinations are not all `manager`'s blocks (their slot ids would name
/// another owner's slots in the layout the move writes): `Some(outcomes)` to return at once.
pub(crate) fn foreign_destinations<T, Dst: Tier>(
    manager: &BlockManager<Dst>,
    destinations: &[MutableBlock<Dst>],
) -> Option<Vec<std::result::Result<T, BlockFailure>>> {
    destinations.iter().any(|d| !manager.owns(d)).then(|| {
        fail_all(
            destinations.len(),
            BlockFailureKind::Refused,
            &format!(
                "a destination is not a block of the mover's {} manager",
                Dst::ID
            ),
        )
    })
}

/// Fails each of `n` blocks with a failure of `kind` saying `message`.
pub(crate) fn fail_all<T>(
    n: usize,
    kind: BlockFailureKind,
    message: &str,
) -> Vec<std::result::Result<T, BlockFailure>> {
    let f = BlockFailure::new(kind, message);
    (0..n).map(|_| Err(f.clone())).collect()
}

/// The in-process [`LayerMove`]: one transfer manager, a source layout and a bound
/// destination tier (its block ids are the layout's slots, checked by [`BoundTier::new`]).
/// The copy is kvbm-offload's ([`ExternalMover::move_layers`] into the destination layout);
/// this type checks the configuration once and keeps the destination manager the session
/// allocates from and registers in.
pub struct LayerMover<Src: Tier, Dst: Tier> {
    mover: ExternalMover<Src>,
    dst: Arc<BlockManager<Dst>>,
    num_layers: usize,
}

impl<Src: Tier, Dst: Tier> std::fmt::Debug for LayerMover<Src, Dst> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LayerMover")
            .field("src", &Src::ID)
            .field("dst", &Dst::ID)
            .field("num_layers", &self.num_layers)
            .finish()
    }
}

impl<Src: Tier, Dst: Tier> LayerMover<Src, Dst> {
    /// A layer mover between two bound tiers.
    ///
    /// # Errors
    /// [`EngineError::Config`] (key `onboard.layerwise`) when the tiers are bound to different
    /// transfer managers, either is keyed (objects hold whole blocks), or their block
    /// geometries differ.
    pub fn new(src: &BoundTier<Src>, dst: &BoundTier<Dst>) -> Result<Self> {
        if !Arc::ptr_eq(src.transfer_manager(), dst.transfer_manager()) {
            return Err(EngineError::config(
                "onboard.layerwise",
                format!(
                    "{} and {} are bound to different transfer managers",
                    Src::ID,
                    Dst::ID
                ),
            ));
        }
        if src.is_keyed() {
            return Err(EngineError::config(
                "onboard.layerwise",
                format!(
                    "{} is an object tier: it is read whole, not by layer",
                    Src::ID
                ),
            ));
        }
        Self::from_layout(src.layout(), dst)
    }

    /// A layer mover from a source layout registered with `dst`'s transfer manager (one the
    /// caller manages outside `kvbm-logical`) into the bound tier `dst`.
    ///
    /// # Errors
    /// As [`new`](Self::new).
    pub fn from_layout(src_layout: LayoutHandle, dst: &BoundTier<Dst>) -> Result<Self> {
        let key = "onboard.layerwise";
        if dst.is_keyed() {
            return Err(EngineError::config(
                key,
                format!("{} is an object tier: it is written whole", Dst::ID),
            ));
        }
        let tm = dst.transfer_manager();
        let src = tm
            .layout(src_layout)
            .map_err(|e| EngineError::config(key, format!("{}: {e}", Src::ID)))?;
        let dstl = tm
            .layout(dst.layout())
            .map_err(|e| EngineError::config(key, format!("{}: {e}", Dst::ID)))?;
        let (sc, dc) = (src.layout().config(), dstl.layout().config());
        if !sc.same_block_geometry(dc) {
            return Err(EngineError::config(
                key,
                format!(
                    "{} and {} block geometries differ ({} vs {} layers)",
                    Src::ID,
                    Dst::ID,
                    sc.num_layers,
                    dc.num_layers
                ),
            ));
        }
        let mover = ExternalMover::from_layout(tm, src_layout, dst.layout())
            .map_err(|e| EngineError::config(key, e.to_string()))?;
        Ok(Self {
            mover,
            dst: dst.manager().clone(),
            num_layers: sc.num_layers,
        })
    }
}

impl<Src: Tier, Dst: Tier> LayerMove<Src, Dst> for LayerMover<Src, Dst> {
    fn destination(&self) -> &Arc<BlockManager<Dst>> {
        &self.dst
    }

    fn num_layers(&self) -> usize {
        self.num_layers
    }

    fn move_layers<'a>(
        &'a self,
        sources: &'a [ImmutableBlock<Src>],
        destinations: &'a [MutableBlock<Dst>],
        layers: Range<usize>,
    ) -> BoxFuture<'a, Vec<BlockOutcome>> {
        Box::pin(async move {
            let n = sources.len();
            if destinations.len() != n {
                return fail_all(
                    n,
                    BlockFailureKind::Refused,
                    &format!("{n} sources but {} destinations", destinations.len()),
                );
            }
            if let Some(refused) = foreign_destinations(&self.dst, destinations) {
                return refused;
            }
            let ids: Vec<BlockId> = destinations.iter().map(MutableBlock::block_id).collect();
            let sources: Vec<MoveSource> = sources.iter().map(MoveSource::of).collect();
            // SAFETY: every destination is an unregistered `MutableBlock` of `self.dst` (checked
            // above), whose slots are the bound layout's (`BoundTier`), borrowed by this future
            // and written only by these layer moves until the caller registers it after the
            // last layer; the sources are registered and held.
            unsafe { self.mover.move_layers(&sources, &ids, layers) }.await
        })
    }
}
