//! Executors over `kvbm-physical`: tier destinations ([`BlockTransferExecutor`]) and object
//! destinations ([`ObjectTransferExecutor`]).
//!
//! ```text
//!  ResolvedBatch ──► allocate dst blocks ──► TransferManager::execute_transfer ──► per-block outcome
//!                    (BlockManager<Dst>)      (src ids → dst ids)                   │
//!                                                                ok: complete(hash) + register_blocks
//!                                                                err: drop the MutableBlock (slot back
//!                                                                     to the reset pool, never registered)
//! ```
//!
//! The destination block is registered only after its bytes arrived, so the registry never
//! claims a block is present in a tier that does not hold it. Object keys are derived from the
//! sequence hash ([`object_key`]), the same mapping the presence checks and locks use, and every
//! transfer passes the blocks' sequence hashes as their identities ([`block_identity`]), so a
//! disk slot or object holding another block is an identity mismatch, never served.

use std::future::Future;
use std::sync::Arc;

use kvbm_logical::{BlockId, BlockManager, G4, ImmutableBlock, MutableBlock, SequenceHash, Tier};
use kvbm_physical::{LayoutHandle, ObjectPutMode, PhysicalError, TransferManager, TransferOptions};

use crate::batch::{BatchOutcome, ResolvedBatch};
use crate::error::{BlockFailure, BlockFailureKind};
use crate::executor::TransferExecutor;

pub use crate::object::keys::{block_identity, object_key};

fn fail_all<R>(n: usize, kind: BlockFailureKind, message: &str) -> BatchOutcome<R> {
    (0..n)
        .map(|_| Err(BlockFailure::new(kind, message)))
        .collect()
}

fn physical_failure(e: PhysicalError) -> BlockFailure {
    BlockFailure::physical(e)
}

fn fail_all_physical<R>(n: usize, e: PhysicalError) -> BatchOutcome<R> {
    let e = Arc::new(e);
    (0..n)
        .map(|_| Err(BlockFailure::physical_shared(&e)))
        .collect()
}

/// What one block move yields: the destination block, registered, or why not.
pub type MoveOutcome<Dst> = Result<ImmutableBlock<Dst>, BlockFailure>;

/// The one block move, for every direction (G1↔G2, G2↔G3, …): copies source slots of `Src`
/// into **caller-allocated** destination blocks of `Dst` and registers each destination whose
/// bytes arrived.
///
/// ```text
///  sources (slot ids + hashes) ─┐
///  destinations: MutableBlock<Dst> (allocated by the caller) ─► TransferManager::execute_transfer
///                                                                   │ per block
///                         ok: complete(hash) + register ─► ImmutableBlock<Dst>
///                         err: the MutableBlock drops (slot back to the reset pool), typed failure
/// ```
///
/// The handles make exclusivity a type fact: a `MutableBlock` is owned by this move, so no other
/// writer can target the slot; the caller keeps the sources alive (an [`ImmutableBlock`], or an
/// external slot it manages) until the future resolves.
pub struct BlockMover<Src: Tier, Dst: Tier> {
    manager: Arc<TransferManager>,
    src_layout: LayoutHandle,
    dst_layout: LayoutHandle,
    dst: Arc<BlockManager<Dst>>,
    keyed: bool,
    _src: std::marker::PhantomData<fn() -> Src>,
}

impl<Src: Tier, Dst: Tier> Clone for BlockMover<Src, Dst> {
    fn clone(&self) -> Self {
        Self {
            manager: self.manager.clone(),
            src_layout: self.src_layout,
            dst_layout: self.dst_layout,
            dst: self.dst.clone(),
            keyed: self.keyed,
            _src: std::marker::PhantomData,
        }
    }
}

impl<Src: Tier, Dst: Tier> std::fmt::Debug for BlockMover<Src, Dst> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BlockMover")
            .field("src", &Src::ID)
            .field("dst", &Dst::ID)
            .field("src_layout", &self.src_layout)
            .field("dst_layout", &self.dst_layout)
            .finish()
    }
}

impl<Src: Tier, Dst: Tier> BlockMover<Src, Dst> {
    /// A mover from `src_layout` (whose slot ids are the source blocks' ids) into `dst_layout`
    /// (whose slot ids are `dst`'s block ids).
    pub fn new(
        manager: Arc<TransferManager>,
        src_layout: LayoutHandle,
        dst_layout: LayoutHandle,
        dst: Arc<BlockManager<Dst>>,
    ) -> Self {
        Self {
            manager,
            src_layout,
            dst_layout,
            dst,
            keyed: false,
            _src: std::marker::PhantomData,
        }
    }

    /// The source is an object layout (the G4 get side): each block is read from the object
    /// keyed by its sequence hash ([`object_key`]); source slot ids are ignored.
    pub fn keyed_source(mut self) -> Self {
        self.keyed = true;
        self
    }

    /// The destination manager (allocate destinations from it).
    pub fn destination(&self) -> &Arc<BlockManager<Dst>> {
        &self.dst
    }

    /// Moves `sources[i]` (source slot id and the hash its content has) into
    /// `destinations[i]`; one outcome per block, in order. A length mismatch fails every block
    /// (nothing is moved).
    pub async fn move_blocks(
        &self,
        sources: &[(BlockId, SequenceHash)],
        destinations: Vec<MutableBlock<Dst>>,
    ) -> Vec<MoveOutcome<Dst>> {
        let n = sources.len();
        if destinations.len() != n {
            let m = format!("{} sources but {} destinations", n, destinations.len());
            return fail_all(n, BlockFailureKind::Transfer, &m);
        }
        let dst_ids: Vec<BlockId> = destinations.iter().map(|b| b.block_id()).collect();
        let (src_ids, options): (Vec<BlockId>, _) = if self.keyed {
            let keys = sources.iter().map(|(_, h)| object_key(*h)).collect();
            ((0..n).collect(), TransferOptions::with_object_keys(keys))
        } else {
            (
                sources.iter().map(|(id, _)| *id).collect(),
                TransferOptions::default(),
            )
        };
        // Every block carries its sequence hash as its identity: a disk slot or object holding
        // another block is an identity mismatch, never served.
        let options = options.identities(sources.iter().map(|(_, h)| block_identity(*h)).collect());
        let completion = match self.manager.execute_transfer(
            self.src_layout,
            &src_ids,
            self.dst_layout,
            &dst_ids,
            options,
        ) {
            Ok(c) => c,
            Err(e) => return fail_all_physical(n, e),
        };
        let outcome = completion.await;
        let mut results: Vec<Option<MoveOutcome<Dst>>> = (0..n).map(|_| None).collect();
        let mut complete = Vec::with_capacity(n);
        let mut complete_idx = Vec::with_capacity(n);
        for (i, ((mutable, (_, hash)), (_, r))) in destinations
            .into_iter()
            .zip(sources)
            .zip(outcome.blocks)
            .enumerate()
        {
            match r {
                Ok(()) => match mutable.complete(*hash) {
                    Ok(c) => {
                        complete.push(c);
                        complete_idx.push(i);
                    }
                    Err(e) => {
                        results[i] = Some(Err(BlockFailure::new(
                            BlockFailureKind::Transfer,
                            format!("cannot register in destination: {}", e.error),
                        )))
                    }
                },
                // The slot goes back to the reset pool; nothing is registered.
                Err(e) => results[i] = Some(Err(physical_failure(e))),
            }
        }
        for (i, registered) in complete_idx
            .into_iter()
            .zip(self.dst.register_blocks(complete))
        {
            results[i] = Some(Ok(registered));
        }
        results
            .into_iter()
            .map(|r| {
                r.unwrap_or_else(|| {
                    Err(BlockFailure::new(
                        BlockFailureKind::Transfer,
                        "transfer manager reported no outcome",
                    ))
                })
            })
            .collect()
    }

    /// [`move_blocks`](Self::move_blocks) from registered source blocks, held for the move.
    pub async fn move_from(
        &self,
        sources: &[ImmutableBlock<Src>],
        destinations: Vec<MutableBlock<Dst>>,
    ) -> Vec<MoveOutcome<Dst>> {
        let ids: Vec<(BlockId, SequenceHash)> = sources
            .iter()
            .map(|b| (b.block_id(), b.sequence_hash()))
            .collect();
        self.move_blocks(&ids, destinations).await
    }
}

/// Moves blocks between two tiers through a [`BlockMover`], allocating the destination blocks
/// in `BlockManager<Dst>` right before the move (the offload lanes, where the pipeline decides
/// what moves). For destinations allocated by the caller before the transfer, use
/// [`CallerAllocated`].
pub struct BlockTransferExecutor<Src: Tier, Dst: Tier> {
    mover: BlockMover<Src, Dst>,
}

impl<Src: Tier, Dst: Tier> std::fmt::Debug for BlockTransferExecutor<Src, Dst> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BlockTransferExecutor")
            .field("mover", &self.mover)
            .finish()
    }
}

impl<Src: Tier, Dst: Tier> BlockTransferExecutor<Src, Dst> {
    /// An executor copying from `src_layout` (whose slot ids are the source blocks' ids) into
    /// `dst_layout` (whose slot ids are `dst`'s block ids).
    pub fn new(
        manager: Arc<TransferManager>,
        src_layout: LayoutHandle,
        dst_layout: LayoutHandle,
        dst: Arc<BlockManager<Dst>>,
    ) -> Self {
        Self::from_mover(BlockMover::new(manager, src_layout, dst_layout, dst))
    }

    /// An executor over `mover`.
    pub fn from_mover(mover: BlockMover<Src, Dst>) -> Self {
        Self { mover }
    }

    /// The mover.
    pub fn mover(&self) -> &BlockMover<Src, Dst> {
        &self.mover
    }
}

impl<Src: Tier, Dst: Tier> TransferExecutor<Src> for BlockTransferExecutor<Src, Dst> {
    type Output = ImmutableBlock<Dst>;

    fn execute(
        &self,
        batch: &ResolvedBatch<Src>,
    ) -> impl Future<Output = BatchOutcome<ImmutableBlock<Dst>>> + Send {
        let n = batch.len();
        let sources: Vec<(BlockId, SequenceHash)> = batch
            .blocks()
            .iter()
            .map(|b| (b.block_id, b.sequence_hash))
            .collect();
        async move {
            let dst_blocks = match self.mover.destination().allocate_blocks(n) {
                Ok(b) => b,
                Err(e) => return fail_all(n, BlockFailureKind::NoSpace, &e.to_string()),
            };
            self.mover.move_blocks(&sources, dst_blocks).await
        }
    }
}

/// A [`BlockMover`] as the executor of a lane whose destinations the caller allocated before
/// the transfer (onboarding G3→G2, G2→G1, promotion): each block moves into the
/// `MutableBlock<Dst>` enqueued with it ([`Pipeline::enqueue_into`](crate::Pipeline::enqueue_into)).
pub struct CallerAllocated<Src: Tier, Dst: Tier> {
    mover: BlockMover<Src, Dst>,
}

impl<Src: Tier, Dst: Tier> std::fmt::Debug for CallerAllocated<Src, Dst> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CallerAllocated")
            .field("mover", &self.mover)
            .finish()
    }
}

impl<Src: Tier, Dst: Tier> CallerAllocated<Src, Dst> {
    /// An executor moving into caller-allocated destinations through `mover`.
    pub fn new(mover: BlockMover<Src, Dst>) -> Self {
        Self { mover }
    }

    /// The mover.
    pub fn mover(&self) -> &BlockMover<Src, Dst> {
        &self.mover
    }
}

impl<Src: Tier, Dst: Tier> TransferExecutor<Src, MutableBlock<Dst>> for CallerAllocated<Src, Dst> {
    type Output = ImmutableBlock<Dst>;

    fn execute(
        &self,
        batch: &ResolvedBatch<Src, MutableBlock<Dst>>,
    ) -> impl Future<Output = BatchOutcome<ImmutableBlock<Dst>>> + Send {
        let sources: Vec<(BlockId, SequenceHash)> = batch
            .blocks()
            .iter()
            .map(|b| (b.block_id, b.sequence_hash))
            .collect();
        let destinations = batch.take_destinations();
        async move { self.mover.move_blocks(&sources, destinations).await }
    }
}

/// Writes blocks to an object-store layout, one object per block keyed by [`object_key`].
///
/// Optionally records presence in a `BlockManager<G4>` (the registry's view of the object
/// tier) for successfully written blocks only.
pub struct ObjectTransferExecutor<Src: Tier> {
    manager: Arc<TransferManager>,
    src_layout: LayoutHandle,
    object_layout: LayoutHandle,
    g4: Option<Arc<BlockManager<G4>>>,
    put_mode: ObjectPutMode,
    _src: std::marker::PhantomData<fn() -> Src>,
}

impl<Src: Tier> std::fmt::Debug for ObjectTransferExecutor<Src> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ObjectTransferExecutor")
            .field("src_layout", &self.src_layout)
            .field("object_layout", &self.object_layout)
            .finish()
    }
}

impl<Src: Tier> ObjectTransferExecutor<Src> {
    /// An executor writing from `src_layout` into the object layout `object_layout`.
    pub fn new(
        manager: Arc<TransferManager>,
        src_layout: LayoutHandle,
        object_layout: LayoutHandle,
    ) -> Self {
        Self {
            manager,
            src_layout,
            object_layout,
            g4: None,
            put_mode: ObjectPutMode::Overwrite,
            _src: std::marker::PhantomData,
        }
    }

    /// Records presence of written blocks in `g4`. Default: not recorded.
    pub fn with_g4_manager(mut self, g4: Arc<BlockManager<G4>>) -> Self {
        self.g4 = Some(g4);
        self
    }

    /// How puts treat an existing object. Default: overwrite.
    pub fn with_put_mode(mut self, mode: ObjectPutMode) -> Self {
        self.put_mode = mode;
        self
    }

    fn record_presence(&self, hashes: &[SequenceHash]) {
        let Some(g4) = &self.g4 else { return };
        match g4.allocate_blocks(hashes.len()) {
            Ok(blocks) => {
                let complete: Vec<_> = blocks
                    .into_iter()
                    .zip(hashes)
                    .filter_map(|(b, h)| b.complete(*h).ok())
                    .collect();
                drop(g4.register_blocks(complete));
            }
            Err(e) => tracing::warn!(error = %e, "cannot record G4 presence"),
        }
    }
}

impl<Src: Tier> TransferExecutor<Src> for ObjectTransferExecutor<Src> {
    type Output = SequenceHash;

    fn execute(
        &self,
        batch: &ResolvedBatch<Src>,
    ) -> impl Future<Output = BatchOutcome<SequenceHash>> + Send {
        let n = batch.len();
        let src_ids = batch.block_ids();
        let hashes = batch.sequence_hashes();
        async move {
            let positions: Vec<usize> = (0..n).collect();
            let options = TransferOptions {
                object_keys: Some(hashes.iter().map(|h| object_key(*h)).collect()),
                object_put_mode: self.put_mode,
                identities: Some(hashes.iter().map(|h| block_identity(*h)).collect()),
                ..Default::default()
            };
            let completion = match self.manager.execute_transfer(
                self.src_layout,
                &src_ids,
                self.object_layout,
                &positions,
                options,
            ) {
                Ok(c) => c,
                Err(e) => return fail_all_physical(n, e),
            };
            let outcome = completion.await;
            let mut out = Vec::with_capacity(n);
            let mut written = Vec::with_capacity(n);
            for (h, (_, r)) in hashes.iter().zip(outcome.blocks) {
                match r {
                    Ok(()) => {
                        written.push(*h);
                        out.push(Ok(*h));
                    }
                    Err(e) => out.push(Err(physical_failure(e))),
                }
            }
            out.resize_with(n, || {
                Err(BlockFailure::new(
                    BlockFailureKind::Transfer,
                    "transfer manager reported no outcome",
                ))
            });
            self.record_presence(&written);
            out
        }
    }
}
