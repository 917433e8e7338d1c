//! Checked tiers: the one place that says how a G3 copy is written so that a restart and every
//! read can check it, and what a copy in a lower tier (G3's file, G4's store) becomes when a read
//! of it fails. The engine's tier set and kvbm-tiering's disk and object tiers (the ones vLLM's
//! manager drives) both use it, so the rule is written once.
//!
//! # The rule
//!
//! A failed read proves the copy bad only when its kind says so
//! ([`BlockFailureKind::drops_copy`]: damaged bytes, another block's bytes, or gone). Such a copy
//! is recorded in its tier's [`BadCopies`]: it is never matched or read again, and it leaves its
//! tier's manager as soon as nothing holds it ([`BadCopies::discard`]). A G3 copy is also
//! unlisted from the journal at once, so a restart does not bring it back. Every other failure
//! (I/O, a timeout, a refusal, a server that went away, no space) says nothing about the copy:
//! it stays listed and in place, and a later read may succeed. Nothing is deleted from a store
//! on a transient failure.
//!
//! # A checked disk
//!
//! ```text
//!  write:  CheckedDisk::write ─► journal.will_write(slots) ─► move ─► sums recorded ─► journal.written
//!  read:   CheckedDisk::check (bytes against the checksum recorded at write; the disk header was
//!          checked already by kvbm-physical) ─► Err ─► CheckedDisk::read_failed (the rule)
//!  start:  CheckedDisk::open ─► journal replayed ─► listed blocks registered at their slots,
//!          their checksums recorded
//! ```
//!
//! # Locks
//!
//! The checksum map and each bad-copy set are leaf mutexes, taken inside one call and never
//! held while a block manager, the journal or a transfer is called.

use std::collections::{HashMap, HashSet};
use std::marker::PhantomData;
use std::path::Path;
use std::sync::Arc;

use kvbm_logical::{BlockManager, G2, G3, ImmutableBlock, MutableBlock, SequenceHash, Tier};
use kvbm_physical::{ModelFingerprint, PhysicalLayout};
use parking_lot::Mutex;

use crate::batch::{BatchOutcome, ResolvedBatch};
use crate::error::{BlockFailure, BlockFailureKind, OffloadError};
use crate::journal::{DiskJournal, move_recorded};
use crate::mover::{BlockMoveExecutor, BlockMover, MoveSource};

/// The copies of one tier `T` proven bad on read, until they have left the tier's manager (see
/// the [module docs](self)).
#[derive(Debug)]
pub struct BadCopies<T: Tier> {
    set: Mutex<HashSet<SequenceHash>>,
    _tier: PhantomData<fn() -> T>,
}

impl<T: Tier> Default for BadCopies<T> {
    fn default() -> Self {
        Self {
            set: Mutex::new(HashSet::new()),
            _tier: PhantomData,
        }
    }
}

impl<T: Tier> BadCopies<T> {
    /// A read of `h` from this tier failed with `failure`: records the copy when the failure
    /// proves it bad, and says whether it did (the rule of the [module docs](self)).
    pub fn read_failed(&self, h: SequenceHash, failure: &BlockFailure) -> bool {
        let bad = failure.kind.drops_copy();
        if bad {
            self.set.lock().insert(h);
        }
        bad
    }

    /// Whether `h`'s copy in this tier was proven bad (and has not left the tier yet).
    pub fn contains(&self, h: SequenceHash) -> bool {
        self.set.lock().contains(&h)
    }

    /// Whether no bad copy is waiting to leave the tier.
    pub fn is_empty(&self) -> bool {
        self.set.lock().is_empty()
    }

    /// Drops every bad copy nothing holds any more from `manager` (then forgets it), so its
    /// slot is free for a fresh copy; one still held stays recorded for a later call.
    pub fn discard(&self, manager: &BlockManager<T>) {
        let pending: Vec<SequenceHash> = {
            let set = self.set.lock();
            if set.is_empty() {
                return;
            }
            set.iter().copied().collect()
        };
        let gone: Vec<SequenceHash> = pending
            .into_iter()
            .filter(|h| {
                manager.discard_inactive(&[*h]) == 1 || !manager.registry().is_present(*h, T::ID)
            })
            .collect();
        if !gone.is_empty() {
            let mut set = self.set.lock();
            for h in gone {
                set.remove(&h);
            }
        }
    }
}

/// A disk tier's checks: its journal, the payload checksum of every block as written, and its
/// bad copies (see the [module docs](self)). The tier is G3 (`T`: kvbm-tiering's tiers are
/// generic over theirs).
#[derive(Debug)]
pub struct CheckedDisk<T: Tier = G3> {
    journal: DiskJournal,
    /// xxh3-128 of each block's payload as written (sequence hash → checksum).
    sums: Mutex<HashMap<u128, u128>>,
    bad: Arc<BadCopies<T>>,
}

impl<T: Tier> CheckedDisk<T> {
    /// Opens the checks of the G3 file `file` laid out as `layout`: its journal (bound to
    /// `fingerprint`; one written under another is reset and G3 starts cold), every block the
    /// journal lists registered in the fresh `manager` at its slot, its checksum recorded.
    /// Returns the checks and the registered blocks (a caller that adopts each when its key is
    /// asked for holds them; one that lets the manager keep them drops them).
    ///
    /// # Errors
    /// [`OffloadError::Setup`] naming the journal (see [`DiskJournal::open_for`]), or when the
    /// manager is not fresh.
    pub fn open(
        file: &Path,
        layout: &PhysicalLayout,
        fingerprint: Option<&ModelFingerprint>,
        manager: &BlockManager<T>,
    ) -> Result<(Self, Vec<ImmutableBlock<T>>), OffloadError> {
        let opened = DiskJournal::open_for(file, layout, fingerprint)?;
        let (sums, blocks) = opened.listed_blocks(manager)?;
        Ok((
            Self {
                journal: opened.journal,
                sums: Mutex::new(sums),
                bad: Arc::default(),
            },
            blocks,
        ))
    }

    /// The journaled write of `sources` into `destinations` (G3 slots of `mover`'s
    /// destination): the journal's protocol around the move
    /// ([`move_recorded`]), each written block's checksum recorded
    /// for the check on read. `sums` is `(sequence hash, payload xxh3-128)` per source,
    /// co-indexed, computed by the caller beside the move.
    pub async fn write<S: Into<MoveSource> + Copy>(
        &self,
        mover: &BlockMover<G2, T>,
        sources: &[S],
        destinations: Vec<MutableBlock<T>>,
        sums: impl Future<Output = Vec<(u128, u128)>>,
    ) -> BatchOutcome<ImmutableBlock<T>> {
        let sums = async {
            let sums = sums.await;
            self.sums.lock().extend(sums.iter().copied());
            sums
        };
        move_recorded(mover, &self.journal, sources, destinations, sums).await
    }

    /// A lane's batch written into G3 through `executor` (the G2→G3 lane's): its G3 room
    /// allocated (at once, or waiting as the lane's `room_patience_ms` says), then
    /// [`write`](Self::write). `sums[i]` is `(sequence hash, payload xxh3-128)` of block `i`.
    pub async fn write_batch(
        &self,
        executor: &BlockMoveExecutor<G2, T>,
        batch: &ResolvedBatch<G2>,
        sums: Vec<(u128, u128)>,
    ) -> BatchOutcome<ImmutableBlock<T>> {
        let n = batch.len();
        let sources: Vec<(usize, SequenceHash)> = batch
            .blocks()
            .iter()
            .map(|b| (b.block_id, b.sequence_hash))
            .collect();
        let destinations = match executor.allocate(n).await {
            Ok(b) => b,
            Err(f) => return (0..n).map(|_| Err(f.clone())).collect(),
        };
        self.write(executor.mover(), &sources, destinations, async { sums })
            .await
    }

    /// The check on read: `regions` (a block's payload, in layer order) against the checksum
    /// recorded when `h` was written. A block whose write has not reported its checksum yet
    /// passes on the disk header's check alone (kvbm-physical verified the header's checksum
    /// before this is called).
    ///
    /// # Errors
    /// [`BlockFailureKind::ChecksumMismatch`] when the bytes differ from the recorded checksum.
    pub fn check(&self, h: SequenceHash, regions: &[&[u8]]) -> Result<(), BlockFailure> {
        let Some(expected) = self.sums.lock().get(&h.as_u128()).copied() else {
            return Ok(());
        };
        if kvbm_physical::checksum::checksum_slices(regions.iter().copied()) == expected {
            Ok(())
        } else {
            Err(BlockFailure::new(
                BlockFailureKind::ChecksumMismatch,
                format!(
                    "{:?} block {h} differs from the checksum recorded at write",
                    T::ID
                ),
            ))
        }
    }

    /// A read of `h` (in `slot`, where known) failed with `failure`: when the failure proves the
    /// copy bad, the copy is recorded bad, its checksum forgotten and its slot unlisted from
    /// the journal; a transient failure keeps everything. Returns whether the copy was dropped.
    pub fn read_failed(
        &self,
        h: SequenceHash,
        slot: Option<usize>,
        failure: &BlockFailure,
    ) -> bool {
        if !self.bad.read_failed(h, failure) {
            return false;
        }
        self.sums.lock().remove(&h.as_u128());
        if let Some(slot) = slot {
            self.journal.dropped(slot);
        }
        true
    }

    /// This tier's bad copies (shared with whoever else reads the tier: the engine's
    /// scheduler-facing manager records its failed promotions in the same set).
    pub fn bad(&self) -> &Arc<BadCopies<T>> {
        &self.bad
    }

    /// The journal (to sync it after the G3 file was synced).
    pub fn journal(&self) -> &DiskJournal {
        &self.journal
    }
}
