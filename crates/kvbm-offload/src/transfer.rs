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

use kvbm_logical::{BlockManager, G4, ImmutableBlock, SequenceHash, Tier};
use kvbm_physical::{LayoutHandle, ObjectPutMode, TransferManager, TransferOptions};

use crate::batch::{BatchOutcome, ResolvedBatch};
use crate::error::{BlockFailure, BlockFailureKind};
use crate::executor::TransferExecutor;
pub use crate::object::keys::{block_identity, lock_key, object_key};

fn fail_all<R>(n: usize, kind: BlockFailureKind, message: &str) -> BatchOutcome<R> {
    (0..n)
        .map(|_| Err(BlockFailure::new(kind, message)))
        .collect()
}

fn fail_all_physical<R>(n: usize, e: kvbm_physical::PhysicalError) -> BatchOutcome<R> {
    let e = Arc::new(e);
    (0..n)
        .map(|_| Err(BlockFailure::physical_shared(&e)))
        .collect()
}

/// Moves blocks between two tiers with layouts registered in a [`TransferManager`], allocating
/// and registering the destination blocks in `BlockManager<Dst>`.
pub struct BlockTransferExecutor<Src: Tier, Dst: Tier> {
    manager: Arc<TransferManager>,
    src_layout: LayoutHandle,
    dst_layout: LayoutHandle,
    dst: Arc<BlockManager<Dst>>,
    _src: std::marker::PhantomData<fn() -> Src>,
}

impl<Src: Tier, Dst: Tier> std::fmt::Debug for BlockTransferExecutor<Src, Dst> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BlockTransferExecutor")
            .field("src", &Src::ID)
            .field("dst", &Dst::ID)
            .field("src_layout", &self.src_layout)
            .field("dst_layout", &self.dst_layout)
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
        Self {
            manager,
            src_layout,
            dst_layout,
            dst,
            _src: std::marker::PhantomData,
        }
    }
}

impl<Src: Tier, Dst: Tier> TransferExecutor<Src> for BlockTransferExecutor<Src, Dst> {
    type Output = ImmutableBlock<Dst>;

    fn execute(
        &self,
        batch: &ResolvedBatch<Src>,
    ) -> impl Future<Output = BatchOutcome<ImmutableBlock<Dst>>> + Send {
        let n = batch.len();
        let src_ids = batch.block_ids();
        let hashes = batch.sequence_hashes();
        async move {
            let dst_blocks = match self.dst.allocate_blocks(n) {
                Ok(b) => b,
                Err(e) => return fail_all(n, BlockFailureKind::NoSpace, &e.to_string()),
            };
            let dst_ids: Vec<usize> = dst_blocks.iter().map(|b| b.block_id()).collect();
            let options = TransferOptions::default()
                .identities(hashes.iter().map(|h| block_identity(*h)).collect());
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
            let mut failures: Vec<Option<BlockFailure>> = vec![None; n];
            let mut complete = Vec::with_capacity(n);
            let mut complete_idx = Vec::with_capacity(n);
            let mut reported = 0;
            for (i, ((mutable, hash), (_, r))) in dst_blocks
                .into_iter()
                .zip(&hashes)
                .zip(outcome.blocks)
                .enumerate()
            {
                reported += 1;
                match r {
                    Ok(()) => match mutable.complete(*hash) {
                        Ok(c) => {
                            complete.push(c);
                            complete_idx.push(i);
                        }
                        Err(e) => {
                            failures[i] = Some(BlockFailure::new(
                                BlockFailureKind::Transfer,
                                format!("cannot register in destination: {}", e.error),
                            ))
                        }
                    },
                    // The slot goes back to the reset pool; nothing is registered.
                    Err(e) => failures[i] = Some(BlockFailure::physical(e)),
                }
            }
            for f in failures.iter_mut().skip(reported) {
                *f = Some(BlockFailure::new(
                    BlockFailureKind::Transfer,
                    "transfer manager reported no outcome",
                ));
            }
            let mut registered = self.dst.register_blocks(complete).into_iter();
            let mut next_ok = complete_idx.into_iter().peekable();
            (0..n)
                .map(|i| {
                    if next_ok.peek() == Some(&i) {
                        next_ok.next();
                        registered.next().ok_or_else(|| {
                            BlockFailure::new(
                                BlockFailureKind::Transfer,
                                "destination did not register the block",
                            )
                        })
                    } else {
                        Err(failures[i].take().unwrap_or_else(|| {
                            BlockFailure::new(BlockFailureKind::Transfer, "unknown failure")
                        }))
                    }
                })
                .collect()
        }
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
                    Err(e) => out.push(Err(BlockFailure::physical(e))),
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
