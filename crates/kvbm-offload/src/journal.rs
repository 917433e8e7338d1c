//! The journal of a G3 disk tier: which block (sequence hash) lives in which slot, with the
//! xxh3-128 of its payload as it was written. Every disk tier keeps one: the engine's tier stack
//! and kvbm-tiering's disk tier (the one vLLM's manager drives) alike.
//!
//! The journal is `kvbm-physical`'s append-only [`JournalFile`] (`<G3 file>.journal`: `g3.bin`
//! → `g3.journal`), bound to the G3 file's geometry and instance id; this module only maps
//! sequence hashes to and from block identities. Its protocol (see
//! [`kvbm_physical::storage::journal`]) is what makes `kill -9` safe: a slot about to be
//! overwritten is unlisted first ([`DiskJournal::will_write`]), and a block is listed only after
//! its write completed ([`DiskJournal::written`]). A later run with the same G3 file replays the
//! journal and starts warm with exactly the blocks that were complete; a torn tail is discarded.
//!
//! A journal opened with a [`ModelFingerprint`] ([`DiskJournal::open_for`]) records it; a later
//! run under another fingerprint (another model, dtype, KV layout, group or rank) starts G3
//! cold: every block of the old run is a miss, never a hit, and its slot is reused (not
//! counted as damage). [`DiskJournal::open`] records none, so it also starts cold over a
//! journal that has one, and the other way round.
//!
//! ```text
//!  allocate slot ─► will_write(slot) ─► write block (O_DIRECT) ─► written(slot, hash, checksum)
//!  restart: open ─► replay ─► Opened::register_listed: every listed block registered at its slot
//! ```
//!
//! On read, a block brought up from G3 is checked by the disk layer (header: slot, length, file
//! id, identity, payload checksum) and, where the caller keeps them, against the checksum
//! recorded here. A block that fails is unlisted ([`DiskJournal::dropped`]).
//!
//! The older end-of-run snapshot (`g3.manifest`) is no longer written; one left by an older
//! version is removed at open (its slots are not trusted).
//!
//! Locks: the journal file's one mutex, inside each call; nothing else.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use kvbm_logical::{BlockManager, G2, G3, ImmutableBlock, MutableBlock, SequenceHash, Tier};
use kvbm_physical::{
    Backing, BlockIdentity, JournalFile, JournalGeometry, JournalRecord, ModelFingerprint,
    PhysicalLayout,
};

use crate::batch::BatchOutcome;
use crate::error::{BlockFailure, BlockFailureKind, OffloadError};
use crate::mover::{BlockMover, MoveSource};

type Result<T> = std::result::Result<T, OffloadError>;

fn journal_error(path: &Path, e: impl std::fmt::Display) -> OffloadError {
    OffloadError::Setup(format!("the disk journal {}: {e}", path.display()))
}

/// One G3 block: its slot and payload checksum.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct JournalEntry {
    /// Slot in the disk file.
    pub slot: usize,
    /// xxh3-128 of the payload written there.
    pub checksum: u128,
}

/// The journal of the G3 file `file`: beside it, extension `journal` (`g3.bin` → `g3.journal`).
pub fn path_for(file: &Path) -> PathBuf {
    file.with_extension("journal")
}

/// The sequence hash named by `identity` (the inverse of `BlockIdentity::from_u128`); `None`
/// for an identity that is not a 128-bit hash.
pub fn hash_of(identity: &BlockIdentity) -> Option<u128> {
    let b = identity.as_bytes();
    b[16..]
        .iter()
        .all(|x| *x == 0)
        .then(|| u128::from_le_bytes(b[..16].try_into().expect("16 bytes")))
}

/// The blocks a journal listed, registered: their payload checksums by sequence hash, and the
/// blocks themselves.
pub type ListedBlocks<T = G3> = (HashMap<u128, u128>, Vec<ImmutableBlock<T>>);

/// An open disk journal (see the [module docs](self)).
#[derive(Debug)]
pub struct DiskJournal {
    file: JournalFile,
}

/// What opening found: the journal, and the blocks it lists (by sequence hash).
pub struct Opened {
    /// The journal, ready for appends.
    pub journal: DiskJournal,
    /// Listed blocks by sequence hash.
    pub entries: HashMap<u128, JournalEntry>,
}

impl Opened {
    /// Registers the listed blocks in G3's (fresh) `manager` at their slots: every slot is
    /// claimed, the listed ones are completed with their hash, the rest go back to the free
    /// pool. Returns the checksums by hash and how many blocks were registered.
    ///
    /// # Errors
    /// The manager cannot hand out all its slots (it is not fresh).
    pub fn register_listed(
        &self,
        manager: &BlockManager<G3>,
    ) -> Result<(HashMap<u128, u128>, usize)> {
        let (checksums, blocks) = self.listed_blocks(manager)?;
        Ok((checksums, blocks.len()))
    }

    /// As [`register_listed`](Self::register_listed), handing back the registered blocks (the
    /// caller holds them strongly, e.g. a tier that adopts each one when its key is asked for).
    ///
    /// # Errors
    /// The manager cannot hand out all its slots (it is not fresh).
    pub fn listed_blocks<T: Tier>(&self, manager: &BlockManager<T>) -> Result<ListedBlocks<T>> {
        let total = manager.total_blocks();
        let mut all: Vec<Option<MutableBlock<T>>> = (0..total).map(|_| None).collect();
        let fresh = manager.allocate_blocks(total).map_err(|e| {
            OffloadError::Setup(format!(
                "the G3 manager cannot be filled from its journal: {e}"
            ))
        })?;
        for blk in fresh {
            let id = blk.block_id();
            all[id] = Some(blk);
        }
        let mut checksums = HashMap::with_capacity(self.entries.len());
        let mut complete = Vec::with_capacity(self.entries.len());
        for (hash, e) in &self.entries {
            if let Some(blk) = all.get_mut(e.slot).and_then(Option::take)
                && let Ok(c) = blk.complete(SequenceHash::from_u128(*hash))
            {
                complete.push(c);
                checksums.insert(*hash, e.checksum);
            }
        }
        drop(all);
        Ok((checksums, manager.register_blocks(complete)))
    }
}

impl DiskJournal {
    /// Opens (or creates) the journal of the G3 file `file`, whose layout is `layout`.
    ///
    /// # Errors
    /// [`OffloadError::Setup`] naming the journal: the layout is not a disk file, or the
    /// journal cannot be read, created or repaired.
    pub fn open(file: &Path, layout: &PhysicalLayout) -> Result<Opened> {
        Self::open_for(file, layout, None)
    }

    /// [`open`](Self::open), the journal bound to `fingerprint`: one written under another
    /// fingerprint (or none) is reset, and G3 starts cold (see the [module docs](self)).
    ///
    /// # Errors
    /// As [`open`](Self::open).
    pub fn open_for(
        file: &Path,
        layout: &PhysicalLayout,
        fingerprint: Option<&ModelFingerprint>,
    ) -> Result<Opened> {
        let Backing::Disk(disk) = layout.backing() else {
            return Err(OffloadError::Setup(format!(
                "{}: the G3 layout is not a disk file",
                file.display()
            )));
        };
        let legacy = file.with_extension("manifest");
        if legacy.exists() {
            std::fs::remove_file(&legacy).map_err(|e| journal_error(&legacy, e))?;
        }
        let geometry = JournalGeometry {
            payload_bytes: disk.payload_bytes() as u64,
            num_slots: disk.num_slots() as u64,
            file_id: disk.file_id(),
            fingerprint: fingerprint.map_or(0, ModelFingerprint::short),
        };
        Self::open_apart(&path_for(file), geometry)
    }

    /// Opens (or creates) the journal at `path` of slots laid out as `geometry`, kept apart
    /// from the files its slots are in: an instance whose worker ranks each hold their slice
    /// of every G3 slot in their own file keeps one journal of which block each slot holds
    /// (each rank's read still checks its slot's header). A journal of another geometry or
    /// fingerprint is reset, as [`open_for`](Self::open_for)'s.
    ///
    /// # Errors
    /// [`OffloadError::Setup`] naming the journal when it cannot be read, created or repaired.
    pub fn open_apart(path: &Path, geometry: JournalGeometry) -> Result<Opened> {
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir).map_err(|e| journal_error(path, e))?;
        }
        let path = path.to_path_buf();
        let (file, recovery) =
            JournalFile::open(&path, geometry).map_err(|e| journal_error(&path, e))?;
        if let Some(why) = &recovery.reset {
            tracing::warn!("G3 starts cold: journal reset ({why})");
        }
        tracing::info!(
            records = recovery.records,
            live = recovery.live,
            discarded_bytes = recovery.discarded_bytes,
            ms = recovery.elapsed.as_secs_f64() * 1e3,
            "G3 journal replayed"
        );
        let mut entries = HashMap::with_capacity(recovery.live);
        for e in file.entries() {
            if let Some(h) = hash_of(&e.identity) {
                entries.insert(
                    h,
                    JournalEntry {
                        slot: e.slot as usize,
                        checksum: e.checksum,
                    },
                );
            }
        }
        Ok(Opened {
            journal: DiskJournal { file },
            entries,
        })
    }

    /// Unlists `slots` before they are written (a write interrupted by a crash then leaves
    /// nothing listed there).
    ///
    /// # Errors
    /// The journal could not be appended (e.g. the disk is full).
    pub fn will_write(&self, slots: impl IntoIterator<Item = usize>) -> kvbm_physical::Result<()> {
        let recs: Vec<JournalRecord> = slots
            .into_iter()
            .map(|s| JournalRecord::Removed { slot: s as u64 })
            .collect();
        self.file.record(&recs)
    }

    /// Lists `(slot, hash, checksum)` blocks whose writes completed.
    ///
    /// # Errors
    /// The journal could not be appended (the blocks are then not persistent).
    pub fn written(&self, blocks: &[(usize, u128, u128)]) -> kvbm_physical::Result<()> {
        let recs: Vec<JournalRecord> = blocks
            .iter()
            .map(|&(slot, h, checksum)| JournalRecord::Stored {
                slot: slot as u64,
                identity: BlockIdentity::from_u128(h),
                checksum,
            })
            .collect();
        self.file.record(&recs)
    }

    /// Unlists `slot` (its block failed verification).
    pub fn dropped(&self, slot: usize) {
        if let Err(e) = self.will_write([slot]) {
            tracing::warn!(error = %e, slot, "cannot unlist a rejected G3 block");
        }
    }

    /// Flushes the journal to stable storage (after the G3 file was synced).
    ///
    /// # Errors
    /// The sync failed.
    pub fn sync(&self) -> kvbm_physical::Result<()> {
        self.file.sync()
    }
}

/// A move into journaled slots, the journal's protocol around it: unlist the destination
/// slots ([`DiskJournal::will_write`]), move, list the blocks whose write completed
/// ([`DiskJournal::written`]) with `sums`: `(sequence hash, payload xxh3-128)` per source,
/// co-indexed, awaited once the move settled (a caller computes them beside the move), and
/// awaited whatever happens: the outcome is returned only after they are done.
///
/// A journal that cannot unlist the slots (disk full) fails the batch with `NoSpace` before any
/// slot is written (the destinations go back to their manager): a listed slot is never
/// overwritten behind the journal's back. A journal that cannot list the written blocks leaves
/// them in the tier for this run only (logged); so do sums that did not come (an empty list).
///
/// The journal calls are short appends to a buffered file; a caller that must not wait on
/// them runs this on the transfer manager's runtime, off its own thread.
pub async fn move_recorded<T: Tier, S: Into<MoveSource> + Copy>(
    mover: &BlockMover<G2, T>,
    index: &DiskJournal,
    sources: &[S],
    dst: Vec<MutableBlock<T>>,
    sums: impl Future<Output = Vec<(u128, u128)>>,
) -> BatchOutcome<ImmutableBlock<T>> {
    let n = sources.len();
    if let Err(e) = index.will_write(dst.iter().map(|b| b.block_id())) {
        tracing::warn!(error = %e, "G3 journal full or failing: G3 admits nothing");
        metrics::counter!("kvbm_g3_journal_errors_total").increment(1);
        let msg = format!("the G3 journal cannot record the write: {e}");
        // The sums may be reading the sources (a caller's task beside the move): the batch is
        // reported, and its sources released, only once they are done.
        drop(sums.await);
        return (0..n)
            .map(|_| Err(BlockFailure::new(BlockFailureKind::NoSpace, msg.clone())))
            .collect();
    }
    let out = mover.move_blocks(sources, dst).await;
    let sums = sums.await;
    let written: Vec<(usize, u128, u128)> = out
        .iter()
        .zip(&sums)
        .filter_map(|(r, (h, c))| r.as_ref().ok().map(|b| (b.block_id(), *h, *c)))
        .collect();
    if let Err(e) = index.written(&written) {
        tracing::warn!(error = %e, blocks = written.len(), "G3 journal cannot list written blocks: they are not persistent");
        metrics::counter!("kvbm_g3_journal_errors_total").increment(1);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hashes_round_trip_through_identities_and_wide_ones_are_refused() {
        let h = 0x0123_4567_89ab_cdef_fedc_ba98_7654_3210u128;
        assert_eq!(hash_of(&BlockIdentity::from_u128(h)), Some(h));
        assert_eq!(hash_of(&BlockIdentity::from_bytes([1; 32])), None);
    }
}
