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

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use crate::mover::BlockMove;
use futures::FutureExt;
use futures::future::BoxFuture;
use kvbm_logical::{
    BlockManager, G1, G2, G3, G4, ImmutableBlock, MutableBlock, SequenceHash, Tier,
};
use kvbm_offload::{
    ArrivalCheck, BadCopies, BlockFailure, BlockFailureKind, BlockMover, BoundTier, MoveOutcome,
    MoveSource,
};
use kvbm_physical::LayoutHandle;
use parking_lot::Mutex;

use super::hooks::{Contents, Identities};
use super::{Counters, G3Check, MovePath, count_failure, g3_arrival_check, g3_read_failed};

/// What the movers report back to the stack.
#[derive(Debug, Default)]
pub(crate) struct OnboardShared {
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

/// Runs `transfer` on the sources not already rejected (poisoned) and fails the others
/// without reading them again (their destinations go back to the pool): a copy a tier
/// rejected once, by a read ahead or an earlier move, is never read twice. Outcomes stay in
/// source order.
async fn skipping_rejected<S: Tier, F, Fut>(
    rejected: &BadCopies<S>,
    shared: &OnboardShared,
    src: &[ImmutableBlock<S>],
    dst: Vec<MutableBlock<G2>>,
    transfer: F,
) -> Vec<MoveOutcome<G2>>
where
    F: FnOnce(Vec<ImmutableBlock<S>>, Vec<MutableBlock<G2>>) -> Fut,
    Fut: std::future::Future<Output = Vec<MoveOutcome<G2>>>,
{
    let bad: Vec<bool> = if rejected.is_empty() {
        Vec::new()
    } else {
        src.iter()
            .map(|b| rejected.contains(b.sequence_hash()))
            .collect()
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

/// G3 → G2: kvbm-offload's [`BlockMover`] over the bound tiers, each read checked by the disk
/// layer (header: slot, length, file id, identity, payload checksum) and then, before the
/// block is registered, against the payload checksum the journal recorded at write
/// ([`g3_arrival_check`]). The disk headers name the sequence hash (the G2→G3 lane writes them
/// so); the G2 copy is registered under the block's digest when [`Identities`] knows one.
pub(crate) struct G3ToG2 {
    mover: BlockMover<G3, G2>,
    check: G3Check,
    counters: Arc<Counters>,
    block_bytes: usize,
    shared: Arc<OnboardShared>,
    identities: Arc<Identities>,
}

impl G3ToG2 {
    /// The move from the bound `g3` into the bound `g2`.
    ///
    /// # Errors
    /// The tiers are on different transfer managers, or G2 is not host memory.
    pub(super) fn new(
        g3: &BoundTier<G3>,
        g2: &BoundTier<G2>,
        check: G3Check,
        counters: Arc<Counters>,
        block_bytes: usize,
        shared: Arc<OnboardShared>,
        identities: Arc<Identities>,
    ) -> crate::Result<Self> {
        let mover = BlockMover::new(g3, g2)?.with_arrival_check(g3_arrival_check(check.clone()))?;
        Ok(G3ToG2 {
            mover,
            check,
            counters,
            block_bytes,
            shared,
            identities,
        })
    }

    /// The sources of a read of `src`: their slots, read under their sequence hash, registered
    /// in G2 under the digest the workload gives them.
    pub(crate) fn sources(&self, src: &[ImmutableBlock<G3>]) -> Vec<MoveSource> {
        src.iter()
            .map(|b| {
                let h = b.sequence_hash();
                MoveSource::from((b.block_id(), h)).registered_as(self.identities.get(h))
            })
            .collect()
    }

    /// The move itself (the read-ahead issues its reads through it too).
    pub(crate) fn mover(&self) -> &BlockMover<G3, G2> {
        &self.mover
    }

    /// Accounts a finished read of `hashes`: bytes for the blocks that arrived, and for each
    /// failure its count, the session's report (`report`: a session waits on these blocks),
    /// and, when it proves the copy bad, the copy poisoned and unlisted from the journal
    /// ([`g3_read_failed`]).
    pub(crate) fn settle_read(
        &self,
        hashes: impl Iterator<Item = SequenceHash>,
        out: &[MoveOutcome<G2>],
        report: bool,
    ) {
        let mut ok = 0;
        for (h, o) in hashes.zip(out) {
            match o {
                Ok(_) => ok += 1,
                Err(f) => {
                    g3_read_failed(&self.check, &self.counters, h, f);
                    if report {
                        self.shared.fail(h);
                    }
                }
            }
        }
        self.counters
            .add_bytes(MovePath::G3_TO_G2, ok, self.block_bytes);
    }

    async fn run(
        &self,
        src: &[ImmutableBlock<G3>],
        dst: Vec<MutableBlock<G2>>,
    ) -> Vec<MoveOutcome<G2>> {
        let t = Instant::now();
        let out = skipping_rejected(
            self.check.checked.bad(),
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
        let t = Instant::now();
        let out = self.mover.move_blocks(&self.sources(src), dst).await;
        metrics::histogram!(
            crate::metrics::STACK_TRANSFER_SECONDS,
            crate::metrics::PATH_LABEL => "g3_to_g2"
        )
        .record(t.elapsed().as_secs_f64());
        self.settle_read(src.iter().map(|b| b.sequence_hash()), &out, true);
        out
    }
}

impl BlockMove<G3, G2> for G3ToG2 {
    fn destination(&self) -> &Arc<BlockManager<G2>> {
        self.mover.destination()
    }

    fn move_blocks<'a>(
        &'a self,
        sources: &'a [ImmutableBlock<G3>],
        destinations: Vec<MutableBlock<G2>>,
    ) -> BoxFuture<'a, Vec<MoveOutcome<G2>>> {
        Box::pin(self.run(sources, destinations))
    }
}

/// G4 → G2: kvbm-offload's [`BlockMover`] from the keyed object tier, each object checked
/// against its header (checksum and identity: the block's digest, or, for a block G4 knows
/// only by name, the one [`Identities`] gives it).
pub(crate) struct G4ToG2 {
    mover: BlockMover<G4, G2>,
    bad: Arc<BadCopies<G4>>,
    counters: Arc<Counters>,
    block_bytes: usize,
    shared: Arc<OnboardShared>,
    identities: Arc<Identities>,
}

impl G4ToG2 {
    /// The move from the bound (keyed) `g4` into the bound `g2`.
    ///
    /// # Errors
    /// The tiers are on different transfer managers.
    pub(super) fn new(
        g4: &BoundTier<G4>,
        g2: &BoundTier<G2>,
        bad: Arc<BadCopies<G4>>,
        counters: Arc<Counters>,
        block_bytes: usize,
        shared: Arc<OnboardShared>,
        identities: Arc<Identities>,
    ) -> crate::Result<Self> {
        Ok(G4ToG2 {
            mover: BlockMover::new(g4, g2)?,
            bad,
            counters,
            block_bytes,
            shared,
            identities,
        })
    }

    async fn run(
        &self,
        src: &[ImmutableBlock<G4>],
        dst: Vec<MutableBlock<G2>>,
    ) -> Vec<MoveOutcome<G2>> {
        skipping_rejected(&self.bad, &self.shared, src, dst, |s, d| async move {
            self.transfer(&s, d).await
        })
        .await
    }

    async fn transfer(
        &self,
        src: &[ImmutableBlock<G4>],
        dst: Vec<MutableBlock<G2>>,
    ) -> Vec<MoveOutcome<G2>> {
        let sources: Vec<MoveSource> = src
            .iter()
            .map(|b| {
                let h = b.sequence_hash();
                MoveSource::from((b.block_id(), h, self.identities.expected(h, b.digest())))
            })
            .collect();
        let t = Instant::now();
        let out = self.mover.move_blocks(&sources, dst).await;
        metrics::histogram!(
            crate::metrics::STACK_TRANSFER_SECONDS,
            crate::metrics::PATH_LABEL => "g4_to_g2"
        )
        .record(t.elapsed().as_secs_f64());
        let mut ok = 0;
        let out = out
            .into_iter()
            .zip(src)
            .map(|(o, blk)| {
                let h = blk.sequence_hash();
                o.inspect(|_| ok += 1).map_err(|mut f| {
                    count_failure(&self.counters, "G4", &f);
                    f.message = format!("G4→G2 block {h}: {}", f.message);
                    // Only a copy proven bad is never read again (kvbm-offload's rule).
                    self.bad.read_failed(h, &f);
                    self.shared.fail(h);
                    f
                })
            })
            .collect();
        self.counters
            .add_bytes(MovePath::G4_TO_G2, ok, self.block_bytes);
        out
    }
}

impl BlockMove<G4, G2> for G4ToG2 {
    fn destination(&self) -> &Arc<BlockManager<G2>> {
        self.mover.destination()
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
pub(crate) struct G2ToG1 {
    mover: BlockMover<G2, G1>,
    /// G1 is host memory: the copy is done when the call returns. Otherwise (G1 on a GPU,
    /// `physical.g1 = "device"`) the transfer manager submits it to the copy engine and the
    /// move resolves when the device finished it; no contents check then (it reads G1's bytes
    /// from the host).
    inline: bool,
    counters: Arc<Counters>,
    block_bytes: usize,
    shared: Arc<OnboardShared>,
}

impl G2ToG1 {
    /// The move from the G2 layout `g2` into the bound `g1`. With `contents`, every block is
    /// checked by it before it is registered, and what arrives is counted in `shared`
    /// (onboarded, verified, corrupt); without, blocks are copied unchecked (the tiers below
    /// checked their reads) and not counted there.
    ///
    /// G1 in device memory is copied asynchronously (see [`G2ToG1::inline`]) and cannot take
    /// a contents check.
    ///
    /// # Errors
    /// G2 is not host memory, `g2` is not on `g1`'s transfer manager, or `contents` is given
    /// for a G1 that is not host memory (key `physical.g1`).
    pub(super) fn new(
        g2: LayoutHandle,
        g1: &BoundTier<G1>,
        contents: Option<Arc<dyn Contents>>,
        counters: Arc<Counters>,
        block_bytes: usize,
        shared: Arc<OnboardShared>,
    ) -> crate::Result<Self> {
        let g1_kind = g1.transfer_manager().layout(g1.layout())?.storage_kind();
        let inline = g1_kind == kvbm_physical::StorageKind::Host;
        let mover = BlockMover::from_layout(g2, g1)?;
        let mover = if inline { mover.inline()? } else { mover };
        let Some(contents) = contents else {
            return Ok(G2ToG1 {
                mover,
                inline,
                counters,
                block_bytes,
                shared,
            });
        };
        if !inline {
            return Err(crate::EngineError::config(
                "physical.g1",
                format!(
                    "G1 is {g1_kind:?} memory: the contents check (the replay's byte check) reads \
                     G1's bytes on the host, so it needs g1 = \"host\""
                ),
            ));
        }
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
        let mover = mover.with_arrival_check(check)?;
        Ok(G2ToG1 {
            mover,
            inline,
            counters,
            block_bytes,
            shared,
        })
    }

    fn sources(src: &[ImmutableBlock<G2>]) -> Vec<MoveSource> {
        src.iter()
            .map(|b| MoveSource::from((b.block_id(), b.sequence_hash())))
            .collect()
    }

    /// Copies the G2 slots of `src` into the G1 destinations, checks each block's bytes
    /// against its hash ([`Contents::verify`]) and registers the good ones in G1; one outcome
    /// per block. The scheduler's load path calls it with the slots `prepare_load` pinned; a
    /// slot that held anything else would fail the check, never be served.
    pub(crate) fn copy_slots(
        &self,
        src: &[MoveSource],
        dst: Vec<MutableBlock<G1>>,
    ) -> Vec<MoveOutcome<G1>> {
        let started = Instant::now();
        let out = if self.inline {
            self.mover
                .move_blocks(src, dst)
                .now_or_never()
                .expect("an inline move is done when it returns")
        } else {
            // A device copy completes on the CUDA event thread, not on any runtime: waiting
            // for it here blocks no task it needs.
            futures::executor::block_on(self.mover.move_blocks(src, dst))
        };
        self.tally(src, started, out)
    }

    /// Counts a settled move of `src` begun at `started` (metrics, bytes, failures noted).
    fn tally(
        &self,
        src: &[MoveSource],
        started: Instant,
        out: Vec<MoveOutcome<G1>>,
    ) -> Vec<MoveOutcome<G1>> {
        metrics::histogram!(
            crate::metrics::STACK_TRANSFER_SECONDS,
            crate::metrics::PATH_LABEL => "g2_to_g1"
        )
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
            .add_bytes(MovePath::G2_TO_G1, arrived, self.block_bytes);
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
        Box::pin(async move {
            let src = Self::sources(sources);
            if self.inline {
                return self.copy_slots(&src, destinations);
            }
            let started = Instant::now();
            let out = self.mover.move_blocks(&src, destinations).await;
            self.tally(&src, started, out)
        })
    }
}
