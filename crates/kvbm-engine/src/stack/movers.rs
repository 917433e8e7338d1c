//! The stack's movers: the real transfer paths an [`OnboardingSession`](crate::leader::OnboardingSession)
//! and the scheduler-facing manager's promotions move blocks through, with the stack's checks on
//! every block.
//!
//! ```text
//!  InstanceLeader::find_matches ──► OnboardingSession ── prepare ──► G3ToG2 (disk header + recorded checksum)
//!                                                    │            └─► G4ToG2 (object header checksum)
//!                                                    └── onboard ──► G2ToG1 (bytes checked against the block id)
//! ```
//!
//! Each mover implements the engine's [`BlockMove`] seam: it moves registered source blocks
//! into caller-allocated destinations and registers a destination only when its bytes arrived
//! and passed the check. A block that fails is reported (an `Err` outcome with its
//! [`BlockFailureKind`], which fails the session: a failed transfer never counts as a hit) and
//! its hash is recorded in
//! [`OnboardShared::failed`], so the caller can cut the request's prefix at the first failed
//! block and recompute from there. G3 and G4 blocks that the tier rejected (their failure
//! [`drops_copy`](kvbm_offload::BlockFailureKind::drops_copy)) are poisoned (never
//! matched again) and counted as checksum failures; other errors count as failed transfers and
//! keep the copy, which a later request may read.
//!
//! The stack drives a session on the serving thread (a current-thread runtime), as a scheduler
//! waits for its blocks before the forward pass, so a session's task needs no hop to another
//! thread. G3→G2 and G4→G2 go through the shared `TransferManager` (its runtime does the I/O;
//! the mover awaits the completion); G2→G1 is host to host, one inline copy inside the future.
//!
//! Locks: the poisoned sets and [`OnboardShared::failed`] are leaf locks, taken briefly and
//! never while a block manager or the transfer manager is called.

use std::collections::HashSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use crate::mover::BlockMove;
use futures::FutureExt;
use futures::future::BoxFuture;
use kvbm_logical::{
    BlockDigest, BlockManager, CompleteBlock, G1, G2, G3, G4, ImmutableBlock, MutableBlock,
    SequenceHash, Tier,
};
use kvbm_offload::{
    ArrivalCheck, BlockFailure, BlockFailureKind, BlockMover, BoundTier, MoveOutcome, MoveSource,
    block_identity, identity_of, object_key,
};
use kvbm_physical::{LayoutHandle, PhysicalLayout, TransferManager, TransferOptions};
use parking_lot::Mutex;

use super::hooks::{Contents, Identities};
use super::{Counters, G3Check, MovePath, check_g3_read, count_failure};

/// What the movers report back to the stack.
#[derive(Debug, Default)]
pub(super) struct OnboardShared {
    /// Hashes of blocks whose move failed since the stack last drained it.
    pub failed: Mutex<Vec<SequenceHash>>,
    /// Blocks that reached G1 from G2.
    pub onboarded: AtomicU64,
    /// Of those, the ones whose bytes were right.
    pub verified: AtomicU64,
    /// Of those, the ones whose bytes were wrong (never served).
    pub corrupt: AtomicU64,
    /// Nanoseconds spent in G3→G2 moves.
    pub g3_nanos: AtomicU64,
}

impl OnboardShared {
    fn fail(&self, h: SequenceHash) {
        self.failed.lock().push(h);
    }
}

/// Registers the destinations that arrived, in one call, and returns one outcome per block in
/// order.
fn settle<T: Tier>(
    manager: &BlockManager<T>,
    parts: Vec<Result<CompleteBlock<T>, BlockFailure>>,
) -> Vec<MoveOutcome<T>> {
    let mut complete = Vec::with_capacity(parts.len());
    let mut errors = Vec::with_capacity(parts.len());
    for p in parts {
        match p {
            Ok(c) => {
                complete.push(c);
                errors.push(None);
            }
            Err(e) => errors.push(Some(e)),
        }
    }
    let mut registered = manager.register_blocks(complete).into_iter();
    errors
        .into_iter()
        .map(|e| match e {
            None => registered.next().ok_or_else(|| {
                BlockFailure::new(
                    BlockFailureKind::Transfer,
                    "the block manager did not register the block",
                )
            }),
            Some(e) => Err(e),
        })
        .collect()
}

/// Every block of a move whose transfer the manager refused as a whole: counted as failed
/// transfers, marked failed for the session, one error each.
fn refused<D: Tier>(
    counters: &Counters,
    shared: &OnboardShared,
    src: impl ExactSizeIterator<Item = SequenceHash>,
    path: &str,
    e: kvbm_physical::PhysicalError,
) -> Vec<MoveOutcome<D>> {
    tracing::warn!(error = %e, "{path} transfer refused");
    counters
        .failed_transfers
        .fetch_add(src.len() as u64, Ordering::Relaxed);
    let mut f = BlockFailure::physical(e);
    f.message = format!("{path} transfer refused: {}", f.message);
    src.map(|h| {
        shared.fail(h);
        Err(f.clone())
    })
    .collect()
}

/// Runs `transfer` on the sources not already rejected (poisoned) and fails the others
/// without reading them again (their destinations go back to the pool): a copy a tier
/// rejected once, by a read ahead or an earlier move, is never read twice. Outcomes stay in
/// source order.
async fn skipping_rejected<S: Tier, F, Fut>(
    poisoned: &Mutex<HashSet<SequenceHash>>,
    shared: &OnboardShared,
    src: &[ImmutableBlock<S>],
    dst: Vec<MutableBlock<G2>>,
    transfer: F,
) -> Vec<MoveOutcome<G2>>
where
    F: FnOnce(Vec<ImmutableBlock<S>>, Vec<MutableBlock<G2>>) -> Fut,
    Fut: std::future::Future<Output = Vec<MoveOutcome<G2>>>,
{
    let bad: Vec<bool> = {
        let p = poisoned.lock();
        if p.is_empty() {
            Vec::new()
        } else {
            src.iter().map(|b| p.contains(&b.sequence_hash())).collect()
        }
    };
    if !bad.iter().any(|b| *b) {
        return transfer(src.to_vec(), dst).await;
    }
    let (mut good_src, mut good_dst) = (Vec::new(), Vec::new());
    for ((b, d), is_bad) in src.iter().zip(dst).zip(&bad) {
        if !*is_bad {
            good_src.push(b.clone());
            good_dst.push(d);
        }
    }
    let mut moved = transfer(good_src, good_dst).await.into_iter();
    src.iter()
        .zip(bad)
        .map(|(b, is_bad)| {
            if is_bad {
                shared.fail(b.sequence_hash());
                Err(BlockFailure::new(
                    BlockFailureKind::Refused,
                    format!(
                        "block {} was already rejected by its tier",
                        b.sequence_hash()
                    ),
                ))
            } else {
                moved.next().unwrap_or_else(|| {
                    Err(BlockFailure::new(
                        BlockFailureKind::ExecutorAborted,
                        "the move reported too few outcomes",
                    ))
                })
            }
        })
        .collect()
}

/// The hashes of `blocks`, for [`refused`].
fn hashes_of<T: Tier>(
    blocks: &[ImmutableBlock<T>],
) -> impl ExactSizeIterator<Item = SequenceHash> + '_ {
    blocks.iter().map(|b| b.sequence_hash())
}

fn complete<T: Tier>(
    m: MutableBlock<T>,
    h: SequenceHash,
    digest: Option<BlockDigest>,
) -> Result<CompleteBlock<T>, BlockFailure> {
    m.complete_with_digest(h, digest)
        .map_err(|e| BlockFailure::new(BlockFailureKind::Transfer, e.error.to_string()))
}

/// G3 → G2: a disk read checked against the disk header and the checksum recorded at write.
pub(super) struct G3ToG2 {
    pub(super) tm: Arc<TransferManager>,
    pub(super) g3: LayoutHandle,
    pub(super) g2: LayoutHandle,
    pub(super) g2_manager: Arc<BlockManager<G2>>,
    pub(super) g2_layout: Arc<PhysicalLayout>,
    pub(super) check: G3Check,
    pub(super) counters: Arc<Counters>,
    pub(super) block_bytes: usize,
    pub(super) shared: Arc<OnboardShared>,
    /// Identities of the workload's keyed blocks (G2 blocks are registered with them).
    pub(super) identities: Arc<Identities>,
}

impl G3ToG2 {
    async fn run(
        &self,
        src: &[ImmutableBlock<G3>],
        dst: Vec<MutableBlock<G2>>,
    ) -> Vec<MoveOutcome<G2>> {
        let t = Instant::now();
        let out = skipping_rejected(
            &self.check.poisoned,
            &self.shared,
            src,
            dst,
            |s, d| async move { self.transfer(&s, d).await },
        )
        .await;
        self.shared
            .g3_nanos
            .fetch_add(t.elapsed().as_nanos() as u64, Ordering::Relaxed);
        out
    }

    async fn transfer(
        &self,
        src: &[ImmutableBlock<G3>],
        dst: Vec<MutableBlock<G2>>,
    ) -> Vec<MoveOutcome<G2>> {
        let src_ids: Vec<usize> = src.iter().map(|b| b.block_id()).collect();
        let dst_ids: Vec<usize> = dst.iter().map(|b| b.block_id()).collect();
        let t = Instant::now();
        // SAFETY: the destinations are staging `MutableBlock`s owned by this move (nothing
        // reads them before the outcome); the G3 sources are registered blocks held for the read.
        let issued = unsafe {
            self.tm.execute_transfer(
                self.g3,
                &src_ids,
                self.g2,
                &dst_ids,
                TransferOptions::default().identities(
                    src.iter()
                        .map(|b| block_identity(b.sequence_hash()))
                        .collect(),
                ),
            )
        };
        let outcome = match issued {
            Ok(c) => c.await,
            Err(e) => return refused(&self.counters, &self.shared, hashes_of(src), "G3→G2", e),
        };
        metrics::histogram!("kvbm_replay_transfer_seconds", "path" => "g3_to_g2")
            .record(t.elapsed().as_secs_f64());
        let mut ok = 0;
        let mut parts = Vec::with_capacity(src.len());
        for ((blk, mblk), (_, r)) in src.iter().zip(dst).zip(outcome.blocks) {
            let h = blk.sequence_hash();
            ok += usize::from(r.is_ok());
            match check_g3_read(&self.g2_layout, &self.check, &self.counters, &mblk, h, r) {
                Ok(()) => parts.push(complete(mblk, h, self.identities.get(h))),
                Err(f) => {
                    self.shared.fail(h);
                    parts.push(Err(f));
                }
            }
        }
        self.counters
            .add_bytes(MovePath::G3ToG2, ok, self.block_bytes);
        settle(&self.g2_manager, parts)
    }
}

impl BlockMove<G3, G2> for G3ToG2 {
    fn destination(&self) -> &Arc<BlockManager<G2>> {
        &self.g2_manager
    }

    fn move_blocks<'a>(
        &'a self,
        sources: &'a [ImmutableBlock<G3>],
        destinations: Vec<MutableBlock<G2>>,
    ) -> BoxFuture<'a, Vec<MoveOutcome<G2>>> {
        Box::pin(self.run(sources, destinations))
    }
}

/// G4 → G2: object reads, checked against the object header (checksum and identity).
pub(super) struct G4ToG2 {
    pub(super) tm: Arc<TransferManager>,
    pub(super) g4: LayoutHandle,
    pub(super) g2: LayoutHandle,
    pub(super) g2_manager: Arc<BlockManager<G2>>,
    pub(super) poisoned: Arc<Mutex<HashSet<SequenceHash>>>,
    pub(super) counters: Arc<Counters>,
    pub(super) block_bytes: usize,
    pub(super) shared: Arc<OnboardShared>,
    /// Identities of the workload's keyed blocks: what an object is checked against when its
    /// G4 entry was registered without one (warm start, adopted from another instance).
    pub(super) identities: Arc<Identities>,
}

impl G4ToG2 {
    async fn run(
        &self,
        src: &[ImmutableBlock<G4>],
        dst: Vec<MutableBlock<G2>>,
    ) -> Vec<MoveOutcome<G2>> {
        let poisoned = self.poisoned.clone();
        skipping_rejected(&poisoned, &self.shared, src, dst, |s, d| async move {
            self.transfer(&s, d).await
        })
        .await
    }

    async fn transfer(
        &self,
        src: &[ImmutableBlock<G4>],
        dst: Vec<MutableBlock<G2>>,
    ) -> Vec<MoveOutcome<G2>> {
        let positions: Vec<usize> = (0..src.len()).collect();
        let keys = src.iter().map(|b| object_key(b.sequence_hash())).collect();
        let dst_ids: Vec<usize> = dst.iter().map(|b| b.block_id()).collect();
        let t = Instant::now();
        // SAFETY: the destinations are staging `MutableBlock`s owned by this move (nothing
        // reads them before the outcome); the G4 side is keyed gets of whole objects.
        let issued = unsafe {
            self.tm.execute_transfer(
                self.g4,
                &positions,
                self.g2,
                &dst_ids,
                TransferOptions::with_object_keys(keys).identities(
                    src.iter()
                        .map(|b| {
                            let h = b.sequence_hash();
                            identity_of(h, self.identities.expected(h, b.digest()))
                        })
                        .collect(),
                ),
            )
        };
        let outcome = match issued {
            Ok(c) => c.await,
            Err(e) => return refused(&self.counters, &self.shared, hashes_of(src), "G4→G2", e),
        };
        metrics::histogram!("kvbm_replay_transfer_seconds", "path" => "g4_to_g2")
            .record(t.elapsed().as_secs_f64());
        let mut ok = 0;
        let mut parts = Vec::with_capacity(src.len());
        for ((blk, mblk), (_, r)) in src.iter().zip(dst).zip(outcome.blocks) {
            let h = blk.sequence_hash();
            match r {
                Ok(()) => {
                    ok += 1;
                    parts.push(complete(mblk, h, self.identities.expected(h, blk.digest())));
                }
                Err(e) => {
                    let mut f = BlockFailure::physical(e);
                    count_failure(&self.counters, "G4", &f);
                    f.message = format!("G4→G2 block {h}: {}", f.message);
                    // Only a copy proven bad is never read again.
                    if f.kind.drops_copy() {
                        self.poisoned.lock().insert(h);
                    }
                    self.shared.fail(h);
                    parts.push(Err(f));
                }
            }
        }
        self.counters
            .add_bytes(MovePath::G4ToG2, ok, self.block_bytes);
        settle(&self.g2_manager, parts)
    }
}

impl BlockMove<G4, G2> for G4ToG2 {
    fn destination(&self) -> &Arc<BlockManager<G2>> {
        &self.g2_manager
    }

    fn move_blocks<'a>(
        &'a self,
        sources: &'a [ImmutableBlock<G4>],
        destinations: Vec<MutableBlock<G2>>,
    ) -> BoxFuture<'a, Vec<MoveOutcome<G2>>> {
        Box::pin(self.run(sources, destinations))
    }
}

/// G2 → G1: kvbm-offload's [`BlockMover`], inline (one host copy per call on the serving
/// thread, with the transfer manager's claims and aliasing checks) and checked: every block's
/// bytes are verified by the [`Contents`] hook before it is registered in G1, so a block with
/// wrong bytes is never served.
pub(super) struct G2ToG1 {
    mover: BlockMover<G2, G1>,
    counters: Arc<Counters>,
    block_bytes: usize,
    shared: Arc<OnboardShared>,
}

impl G2ToG1 {
    /// The move from the G2 layout `g2` into the bound `g1`; what arrives is counted in
    /// `shared` (onboarded, verified, corrupt).
    ///
    /// # Errors
    /// Either side is not host memory, or `g2` is not on `g1`'s transfer manager.
    pub(super) fn new(
        g2: LayoutHandle,
        g1: &BoundTier<G1>,
        contents: Arc<dyn Contents>,
        counters: Arc<Counters>,
        block_bytes: usize,
        shared: Arc<OnboardShared>,
    ) -> crate::Result<Self> {
        let tally = shared.clone();
        let check: ArrivalCheck = Arc::new(move |src: &MoveSource, regions: &[&[u8]]| {
            tally.onboarded.fetch_add(1, Ordering::Relaxed);
            let h = src.sequence_hash;
            let right = match regions {
                [one] => contents.verify(h, one),
                many => contents.verify(h, &many.concat()),
            };
            if right {
                tally.verified.fetch_add(1, Ordering::Relaxed);
                Ok(())
            } else {
                // Never served: the slot returns to the pool and the block is recomputed.
                tally.corrupt.fetch_add(1, Ordering::Relaxed);
                tracing::error!(hash = %h, "a block reached G1 with wrong bytes");
                Err(BlockFailure::new(
                    BlockFailureKind::ChecksumMismatch,
                    format!("block {h} reached G1 with wrong bytes"),
                ))
            }
        });
        let mover = BlockMover::from_layout(g2, g1)?
            .inline()?
            .with_arrival_check(check)?;
        Ok(G2ToG1 {
            mover,
            counters,
            block_bytes,
            shared,
        })
    }

    fn run(&self, src: &[ImmutableBlock<G2>], dst: Vec<MutableBlock<G1>>) -> Vec<MoveOutcome<G1>> {
        let src: Vec<MoveSource> = src
            .iter()
            .map(|b| MoveSource::from((b.block_id(), b.sequence_hash())))
            .collect();
        self.copy_slots(&src, dst)
    }

    /// Copies the G2 slots of `src` into the G1 destinations, checks each block's bytes
    /// against its hash ([`Contents::verify`]) and registers the good ones in G1; one outcome
    /// per block. The scheduler's load path calls it with the slots `prepare_load` pinned; a
    /// slot that held anything else would fail the check, never be served.
    pub(super) fn copy_slots(
        &self,
        src: &[MoveSource],
        dst: Vec<MutableBlock<G1>>,
    ) -> Vec<MoveOutcome<G1>> {
        let started = Instant::now();
        let out = self
            .mover
            .move_blocks(src, dst)
            .now_or_never()
            .expect("an inline move is done when it returns");
        metrics::histogram!("kvbm_replay_transfer_seconds", "path" => "g2_to_g1")
            .record(started.elapsed().as_secs_f64());
        let mut arrived = 0;
        for (s, o) in src.iter().zip(&out) {
            match o {
                Ok(_) => arrived += 1,
                Err(f) => {
                    self.shared.fail(s.sequence_hash);
                    if f.kind == BlockFailureKind::ChecksumMismatch {
                        // Arrived, refused by the check (counted there).
                        arrived += 1;
                    } else {
                        tracing::warn!(kind = f.kind.as_str(), error = %f.message, "G2→G1 transfer failed");
                        self.counters
                            .failed_transfers
                            .fetch_add(1, Ordering::Relaxed);
                    }
                }
            }
        }
        self.counters
            .add_bytes(MovePath::G2ToG1, arrived, self.block_bytes);
        out
    }
}

impl BlockMove<G2, G1> for G2ToG1 {
    fn destination(&self) -> &Arc<BlockManager<G1>> {
        self.mover.destination()
    }

    fn move_blocks<'a>(
        &'a self,
        sources: &'a [ImmutableBlock<G2>],
        destinations: Vec<MutableBlock<G1>>,
    ) -> BoxFuture<'a, Vec<MoveOutcome<G1>>> {
        Box::pin(async move { self.run(sources, destinations) })
    }
}
