//! The persistent index of a disk tier: an append-only journal of which block lives in which
//! slot, replayed at open, so a restart (even after `kill -9`) finds every completed block.
//!
//! The disk file ([`DiskStorage`](crate::DiskStorage)) holds bytes and a per-slot header, but
//! it cannot say which slots a crashed writer had finished: a slot being overwritten when the
//! process died holds a torn mix. The journal says it. Its writer follows one rule:
//!
//! * a slot is listed ([`JournalRecord::Stored`]) only **after** the write of its block
//!   completed, and
//! * a listed slot is unlisted ([`JournalRecord::Removed`]) **before** anything writes it again.
//!
//! So a slot listed in the journal never holds a partial block, whenever the process dies.
//!
//! ```text
//!  allocate slot ─► record Removed(slot) ─► write block (O_DIRECT) ─► record Stored(slot, id, sum)
//!                   (if it was listed)         ▲ kill -9 here: slot unlisted, never served
//! ```
//!
//! # Format (little-endian)
//!
//! ```text
//!  header  [0..64):  "KVBMG3J1" | version u32 (1) | reserved u32 | payload_bytes u64
//!                    | num_slots u64 | file_id u128 | fingerprint u64 | xxh3-64 of [0..56)
//!  record  [0..72):  tag u32 (1 stored, 2 removed) | reserved u32 | slot u64
//!                    | identity [32] | payload xxh3-128 u128 | xxh3-64 of [0..64)
//! ```
//!
//! Records are fixed-size and each carries its own checksum. Replay at [`JournalFile::open`]
//! applies records in order (a later record for a slot replaces the earlier one) and stops at
//! the first record that is short (a torn append) or fails its checksum; the file is truncated
//! there, and what was cut is reported in [`Recovery::discarded_bytes`]. A header for another
//! geometry or another disk file instance (its `file_id`) resets the journal: those slots are
//! foreign to this file ([`Recovery::reset`] says why).
//!
//! The header's `fingerprint` is the 64-bit [`ModelFingerprint::short`](crate::ModelFingerprint::short)
//! of the model the blocks were written for (0: none given; the field was reserved, zero,
//! before fingerprints). A journal written under another fingerprint resets too: the disk
//! tier starts cold, so a block written for another model, dtype, layout or rank is a miss,
//! never a hit. Its slots are not counted as damage (nothing in them is proven damaged) and
//! are simply free again: the file belongs to one opener (`flock`), and its next writes
//! reuse them.
//!
//! Records are written with one positioned `write(2)` per call at the end of the last good
//! record; a failed (e.g. `ENOSPC`) or short write is cut off again, so later records never sit
//! behind a torn one. A write is durable against process death as soon as it returns;
//! [`JournalFile::sync`] makes it durable against power loss (sync the disk file first). A
//! record that reaches stable storage before its slot's bytes can only list a slot whose header
//! then fails its checksum on read: rejected, never served.
//!
//! Compaction: once the file holds more than `max(compact_min, 2 × live)` records, the live
//! set is written to `<path>.tmp`, synced and renamed over the journal (a crash leaves the old
//! file or the new one). An append that crosses the threshold does not do that work: it notes
//! where the file ends and hands a second descriptor of it to a compaction thread, so the
//! caller (a scheduler's thread, for kvbm's vLLM disk tier) waits for neither the snapshot
//! nor its `fsync`s. The file up to that end never changes again, so the thread replays it
//! into the live set, writes the snapshot, and copies what was appended since (records in
//! order: replayed after the snapshot they give the same live set), most of it without the
//! lock; under the lock it copies the last few records, renames the new file over the old
//! one and swaps it in. The old file is closed after the lock is released.
//!
//! ```text
//!  record ─► threshold ─► note the end E, dup the fd ─► spawn ──┐      (record returns)
//!  record, record … (appended to the old file past E)            │
//!  compaction thread: replay old[..E] ─► snapshot ─► <path>.tmp ─► fsync
//!                     ─► copy old[E..] to the tmp while appends go on (unlocked, a few rounds)
//!                     ─► lock ─► copy the rest ─► (fsync if a sync() covered records past E)
//!                     ─► rename ─► swap ─► unlock ─► close the old file ─► fsync the directory
//! ```
//!
//! At most one runs at a time, and no other compaction with it: an explicit
//! [`JournalFile::compact`] and dropping the journal wait for it
//! ([`JournalFile::wait_for_compaction`]), so the file it swaps out is the one it copied. One
//! that fails (a full disk) is retried after `compact_min` more records.
//!
//! Lock order: one mutex ([`JournalFile`]'s state) held across each append, each swap and each
//! explicit compaction; no other lock is taken while holding it, and a compaction thread is
//! joined only with it released.

use std::fs::{File, OpenOptions};
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use std::sync::Arc;
use std::thread::JoinHandle;

use parking_lot::Mutex;

use crate::error::{PhysicalError, Result};
use crate::identity::{BlockIdentity, IDENTITY_LEN};

/// A journal's live entries by slot: the block identity and payload checksum each slot holds.
///
/// hashbrown's default hasher, not std's SipHash: a slot number is nothing an attacker
/// chooses, and an append probes the map once per record (a store appends a `Removed` before
/// its write and a `Stored` after), where SipHash cost about a third of the append besides
/// the write itself.
pub type LiveEntries = hashbrown::HashMap<u64, (BlockIdentity, u128)>;

/// Most live entries an open journal reserves room for up front (a full tier of up to a
/// million slots grows no map on the scheduler thread; a larger one grows past it).
const LIVE_RESERVE_MAX: u64 = 1 << 20;

/// Bytes of the journal header.
pub const JOURNAL_HEADER_LEN: usize = 64;
/// Bytes of one journal record.
pub const JOURNAL_RECORD_LEN: usize = 72;
const MAGIC: &[u8; 8] = b"KVBMG3J1";
const VERSION: u32 = 1;
const TAG_STORED: u32 = 1;
const TAG_REMOVED: u32 = 2;
/// Default minimum record count before compaction is considered.
pub const DEFAULT_COMPACT_MIN: u64 = 4096;

/// What a journal is bound to: the disk file's geometry and instance.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct JournalGeometry {
    /// Payload bytes per slot.
    pub payload_bytes: u64,
    /// Slots in the disk file.
    pub num_slots: u64,
    /// The disk file instance's id ([`DiskStorage::file_id`](crate::DiskStorage::file_id)).
    pub file_id: u128,
    /// [`ModelFingerprint::short`](crate::ModelFingerprint::short) of the model the blocks
    /// belong to; 0 for none.
    pub fingerprint: u64,
}

/// One journal record.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum JournalRecord {
    /// `slot` holds the complete block `identity`, whose payload has xxh3-128 `checksum`.
    Stored {
        /// The slot.
        slot: u64,
        /// The block's identity (as in its disk header).
        identity: BlockIdentity,
        /// xxh3-128 of its payload.
        checksum: u128,
    },
    /// `slot` no longer holds a listed block (it is about to be overwritten, or was dropped).
    Removed {
        /// The slot.
        slot: u64,
    },
}

/// A live entry: a slot and the block it holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct JournalEntry {
    /// The slot.
    pub slot: u64,
    /// The block's identity.
    pub identity: BlockIdentity,
    /// xxh3-128 of its payload.
    pub checksum: u128,
}

/// What [`JournalFile::open`] found.
#[derive(Debug, Clone, Default)]
pub struct Recovery {
    /// Good records replayed.
    pub records: u64,
    /// Live entries after replay.
    pub live: usize,
    /// Bytes cut from the end (a torn or damaged tail).
    pub discarded_bytes: u64,
    /// Why the journal was started afresh (missing file: `None` and `created`).
    pub reset: Option<String>,
    /// The file did not exist (first run).
    pub created: bool,
    /// Time spent reading and replaying.
    pub elapsed: Duration,
}

fn corrupt(location: &dyn Fn() -> String, reason: String) -> PhysicalError {
    PhysicalError::CorruptHeader {
        location: location(),
        reason,
    }
}

fn xxh64(b: &[u8]) -> u64 {
    xxhash_rust::xxh3::xxh3_64(b)
}

/// Encodes a journal header.
pub fn encode_header(g: &JournalGeometry) -> [u8; JOURNAL_HEADER_LEN] {
    let mut out = [0u8; JOURNAL_HEADER_LEN];
    out[0..8].copy_from_slice(MAGIC);
    out[8..12].copy_from_slice(&VERSION.to_le_bytes());
    out[16..24].copy_from_slice(&g.payload_bytes.to_le_bytes());
    out[24..32].copy_from_slice(&g.num_slots.to_le_bytes());
    out[32..48].copy_from_slice(&g.file_id.to_le_bytes());
    out[48..56].copy_from_slice(&g.fingerprint.to_le_bytes());
    let sum = xxh64(&out[..56]);
    out[56..64].copy_from_slice(&sum.to_le_bytes());
    out
}

/// Decodes a journal header (the first [`JOURNAL_HEADER_LEN`] bytes of `bytes`).
///
/// # Errors
/// [`PhysicalError::ShortRead`] when `bytes` is shorter than a header,
/// [`PhysicalError::CorruptHeader`] for a bad magic, version or checksum.
pub fn decode_header(bytes: &[u8]) -> Result<JournalGeometry> {
    let loc = || "journal header".to_string();
    if bytes.len() < JOURNAL_HEADER_LEN {
        return Err(PhysicalError::ShortRead {
            location: loc(),
            expected: JOURNAL_HEADER_LEN,
            actual: bytes.len(),
        });
    }
    let h = &bytes[..JOURNAL_HEADER_LEN];
    if &h[0..8] != MAGIC {
        return Err(corrupt(&loc, "not a kvbm G3 journal (bad magic)".into()));
    }
    let sum = u64::from_le_bytes(h[56..64].try_into().expect("8 bytes"));
    if xxh64(&h[..56]) != sum {
        return Err(corrupt(&loc, "header checksum mismatch".into()));
    }
    let version = u32::from_le_bytes(h[8..12].try_into().expect("4 bytes"));
    if version != VERSION {
        return Err(corrupt(&loc, format!("unknown version {version}")));
    }
    Ok(JournalGeometry {
        payload_bytes: u64::from_le_bytes(h[16..24].try_into().expect("8 bytes")),
        num_slots: u64::from_le_bytes(h[24..32].try_into().expect("8 bytes")),
        file_id: u128::from_le_bytes(h[32..48].try_into().expect("16 bytes")),
        fingerprint: u64::from_le_bytes(h[48..56].try_into().expect("8 bytes")),
    })
}

/// Encodes one record into `out` (at least [`JOURNAL_RECORD_LEN`] bytes).
pub fn encode_record(r: &JournalRecord, out: &mut [u8]) {
    let out = &mut out[..JOURNAL_RECORD_LEN];
    out.fill(0);
    let (tag, slot, identity, checksum) = match *r {
        JournalRecord::Stored {
            slot,
            identity,
            checksum,
        } => (TAG_STORED, slot, identity, checksum),
        JournalRecord::Removed { slot } => (TAG_REMOVED, slot, BlockIdentity::ANONYMOUS, 0),
    };
    out[0..4].copy_from_slice(&tag.to_le_bytes());
    out[8..16].copy_from_slice(&slot.to_le_bytes());
    out[16..16 + IDENTITY_LEN].copy_from_slice(identity.as_bytes());
    out[48..64].copy_from_slice(&checksum.to_le_bytes());
    let sum = xxh64(&out[..64]);
    out[64..72].copy_from_slice(&sum.to_le_bytes());
}

/// Decodes one record (the first [`JOURNAL_RECORD_LEN`] bytes of `bytes`).
///
/// # Errors
/// [`PhysicalError::ShortRead`] for a short (torn) record, [`PhysicalError::CorruptHeader`] for
/// a checksum mismatch, an unknown tag or non-zero reserved bytes.
pub fn decode_record(bytes: &[u8]) -> Result<JournalRecord> {
    let loc = || "journal record".to_string();
    if bytes.len() < JOURNAL_RECORD_LEN {
        return Err(PhysicalError::ShortRead {
            location: loc(),
            expected: JOURNAL_RECORD_LEN,
            actual: bytes.len(),
        });
    }
    let r = &bytes[..JOURNAL_RECORD_LEN];
    let sum = u64::from_le_bytes(r[64..72].try_into().expect("8 bytes"));
    if xxh64(&r[..64]) != sum {
        return Err(corrupt(&loc, "record checksum mismatch".into()));
    }
    if r[4..8] != [0; 4] {
        return Err(corrupt(&loc, "reserved bytes are not zero".into()));
    }
    let tag = u32::from_le_bytes(r[0..4].try_into().expect("4 bytes"));
    let slot = u64::from_le_bytes(r[8..16].try_into().expect("8 bytes"));
    match tag {
        TAG_STORED => Ok(JournalRecord::Stored {
            slot,
            identity: BlockIdentity::from_bytes(
                r[16..16 + IDENTITY_LEN].try_into().expect("32 bytes"),
            ),
            checksum: u128::from_le_bytes(r[48..64].try_into().expect("16 bytes")),
        }),
        TAG_REMOVED => {
            if r[16..64].iter().any(|b| *b != 0) {
                return Err(corrupt(&loc, "removed record carries a block".into()));
            }
            Ok(JournalRecord::Removed { slot })
        }
        t => Err(corrupt(&loc, format!("unknown record tag {t}"))),
    }
}

/// The result of replaying a journal image: live entries by slot, good records, and where the
/// good prefix ends.
#[derive(Debug, Clone, Default)]
pub struct Replayed {
    /// Live entries by slot.
    pub live: LiveEntries,
    /// Good records applied.
    pub records: u64,
    /// Length of the good prefix (header + good records).
    pub good_len: u64,
}

/// Replays a whole journal image `bytes` for `expected` (pure: no file access). Stops at the
/// first bad record, as [`JournalFile::open`] does.
///
/// # Errors
/// A header that fails to decode or names another geometry or file instance.
pub fn replay(bytes: &[u8], expected: &JournalGeometry) -> Result<Replayed> {
    let g = decode_header(bytes)?;
    if g.fingerprint != expected.fingerprint {
        return Err(corrupt(
            &|| "journal header".to_string(),
            format!(
                "written under model fingerprint {:016x}, this tier's is {:016x}: its blocks \
                 are another model's (or dtype's, layout's, rank's), never served here",
                g.fingerprint, expected.fingerprint
            ),
        ));
    }
    if g != *expected {
        return Err(corrupt(
            &|| "journal header".to_string(),
            format!(
                "written for {} slots of {} bytes of disk file {:032x}, this file has {} slots of {} bytes, id {:032x}",
                g.num_slots,
                g.payload_bytes,
                g.file_id,
                expected.num_slots,
                expected.payload_bytes,
                expected.file_id
            ),
        ));
    }
    let mut out = Replayed {
        good_len: JOURNAL_HEADER_LEN as u64,
        ..Replayed::default()
    };
    for rec in bytes[JOURNAL_HEADER_LEN..].chunks(JOURNAL_RECORD_LEN) {
        let Ok(r) = decode_record(rec) else { break };
        match r {
            JournalRecord::Stored {
                slot,
                identity,
                checksum,
            } if slot < g.num_slots => {
                out.live.insert(slot, (identity, checksum));
            }
            JournalRecord::Removed { slot } if slot < g.num_slots => {
                out.live.remove(&slot);
            }
            _ => break, // a slot out of range: not this file's record
        }
        out.records += 1;
        out.good_len += JOURNAL_RECORD_LEN as u64;
    }
    Ok(out)
}

struct State {
    file: File,
    /// End of the last good record: the next append goes here.
    good_len: u64,
    records: u64,
    live: LiveEntries,
    buf: Vec<u8>,
    /// The compaction thread, while one runs (or has run and not been joined).
    compacting: Option<JoinHandle<()>>,
    /// No compaction starts before the file holds this many records (after a failed one).
    retry_at: u64,
    /// The end of what the last [`JournalFile::sync`] made durable.
    synced_len: u64,
    /// A file was renamed over the journal since the directory was last synced.
    dir_dirty: bool,
}

/// An open, append-only disk-tier journal (see the module docs).
pub struct JournalFile {
    path: PathBuf,
    geometry: JournalGeometry,
    compact_min: u64,
    state: Arc<Mutex<State>>,
    /// Tests hold a compaction thread between its snapshot and its swap here.
    #[cfg(test)]
    gate: Option<Arc<std::sync::Barrier>>,
}

/// What a compaction thread starts from: a descriptor of the journal file and where the file
/// ended then (nothing before it changes again).
struct CompactionStart {
    file: File,
    base: u64,
}

/// Under the lock, a compaction copies at most this much of what was appended beside it; the
/// rest it copies in rounds without the lock first.
const LOCKED_TAIL_BYTES: u64 = 64 * JOURNAL_RECORD_LEN as u64;
/// Unlocked copy rounds before a compaction copies the rest under the lock anyway.
const TAIL_ROUNDS: usize = 8;

impl std::fmt::Debug for JournalFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("JournalFile")
            .field("path", &self.path)
            .field("geometry", &self.geometry)
            .finish()
    }
}

fn tmp_path(path: &Path) -> PathBuf {
    let mut p = path.as_os_str().to_owned();
    p.push(".tmp");
    PathBuf::from(p)
}

fn open_rw(path: &Path) -> std::io::Result<File> {
    OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .mode(0o600)
        .open(path)
}

/// Fsyncs the directory holding `path` (so a rename in it is durable).
fn sync_parent(path: &Path) {
    if let Some(parent) = path.parent().filter(|p| !p.as_os_str().is_empty())
        && let Ok(d) = File::open(parent)
    {
        let _ = d.sync_all();
    }
}

/// Writes `header` + `live` as Stored records to `<path>.tmp`, syncs it and renames it over
/// `path`. Returns the new file, its length and record count.
fn write_snapshot(
    path: &Path,
    geometry: &JournalGeometry,
    live: &LiveEntries,
) -> Result<(File, u64, u64)> {
    let (tmp_file, len, n) = write_tmp(path, geometry, live)?;
    drop(tmp_file);
    let tmp = tmp_path(path);
    let install = || -> std::io::Result<File> {
        std::fs::rename(&tmp, path)?;
        sync_parent(path);
        open_rw(path)
    };
    match install() {
        Ok(f) => Ok((f, len, n)),
        Err(e) => {
            let _ = std::fs::remove_file(&tmp);
            Err(PhysicalError::io("write journal snapshot", Some(path), e))
        }
    }
}

/// Writes `header` + `live` as Stored records to a fresh `<path>.tmp` and syncs it. Returns the
/// open tmp file, its length and record count; on an error the tmp file is gone.
fn write_tmp(
    path: &Path,
    geometry: &JournalGeometry,
    live: &LiveEntries,
) -> Result<(File, u64, u64)> {
    use std::io::Write;
    let tmp = tmp_path(path);
    let mut body = Vec::with_capacity(JOURNAL_HEADER_LEN + live.len() * JOURNAL_RECORD_LEN);
    body.extend_from_slice(&encode_header(geometry));
    let mut slots: Vec<_> = live.iter().collect();
    slots.sort_unstable_by_key(|(s, _)| **s);
    let mut rec = [0u8; JOURNAL_RECORD_LEN];
    for (slot, (identity, checksum)) in slots {
        encode_record(
            &JournalRecord::Stored {
                slot: *slot,
                identity: *identity,
                checksum: *checksum,
            },
            &mut rec,
        );
        body.extend_from_slice(&rec);
    }
    let write = || -> std::io::Result<File> {
        let mut f = super::create_fresh(&tmp)?;
        f.write_all(&body)?;
        f.sync_all()?;
        Ok(f)
    };
    match write() {
        Ok(f) => Ok((f, body.len() as u64, live.len() as u64)),
        Err(e) => {
            let _ = std::fs::remove_file(&tmp);
            Err(PhysicalError::io("write journal snapshot", Some(path), e))
        }
    }
}

impl JournalFile {
    /// Opens (or creates) the journal at `path` for a disk file of `geometry`, replaying it as
    /// the module docs describe.
    ///
    /// # Errors
    /// The file cannot be read, created or truncated.
    pub fn open(path: &Path, geometry: JournalGeometry) -> Result<(Self, Recovery)> {
        Self::open_with(path, geometry, DEFAULT_COMPACT_MIN)
    }

    /// [`open`](Self::open) with a compaction threshold (records before compaction is
    /// considered; at least 1).
    ///
    /// # Errors
    /// As [`open`](Self::open).
    pub fn open_with(
        path: &Path,
        geometry: JournalGeometry,
        compact_min: u64,
    ) -> Result<(Self, Recovery)> {
        let started = Instant::now();
        let mut recovery = Recovery::default();
        let data = match std::fs::read(path) {
            Ok(d) => Some(d),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
            Err(e) => return Err(PhysicalError::io("read journal", Some(path), e)),
        };
        let (file, good_len, records, live) = match data {
            None => {
                recovery.created = true;
                let (f, len, n) = write_snapshot(path, &geometry, &LiveEntries::new())?;
                (f, len, n, LiveEntries::new())
            }
            Some(data) => match replay(&data, &geometry) {
                Err(e) => {
                    recovery.reset = Some(e.to_string());
                    tracing::warn!(path = %path.display(), error = %e, "G3 journal reset: its slots are not trusted");
                    let (f, len, n) = write_snapshot(path, &geometry, &LiveEntries::new())?;
                    (f, len, n, LiveEntries::new())
                }
                Ok(r) => {
                    let file =
                        open_rw(path).map_err(|e| PhysicalError::io("open", Some(path), e))?;
                    recovery.discarded_bytes = data.len() as u64 - r.good_len;
                    if recovery.discarded_bytes > 0 {
                        tracing::warn!(
                            path = %path.display(),
                            bytes = recovery.discarded_bytes,
                            "G3 journal: torn or damaged tail discarded"
                        );
                        file.set_len(r.good_len)
                            .map_err(|e| PhysicalError::io("truncate journal", Some(path), e))?;
                    }
                    (file, r.good_len, r.records, r.live)
                }
            },
        };
        recovery.records = records;
        recovery.live = live.len();
        let mut live = live;
        let room = geometry.num_slots.min(LIVE_RESERVE_MAX) as usize;
        live.reserve(room.saturating_sub(live.len()));
        let m = JournalFile {
            path: path.to_path_buf(),
            geometry,
            compact_min: compact_min.max(1),
            state: Arc::new(Mutex::new(State {
                file,
                good_len,
                records,
                live,
                buf: Vec::new(),
                compacting: None,
                retry_at: 0,
                synced_len: 0,
                dir_dirty: false,
            })),
            #[cfg(test)]
            gate: None,
        };
        {
            // At open, in place: nothing is waiting on the journal yet.
            let mut st = m.state.lock();
            if m.due(&st) {
                m.compact_locked(&mut st)?;
            }
        }
        recovery.elapsed = started.elapsed();
        Ok((m, recovery))
    }

    /// The live entries of the journal at `path` for `geometry`, read without changing the
    /// file (inspection, tests).
    ///
    /// # Errors
    /// The file cannot be read, or its header fails to decode or names another geometry.
    pub fn read_entries(path: &Path, geometry: &JournalGeometry) -> Result<Vec<JournalEntry>> {
        let data = std::fs::read(path).map_err(|e| PhysicalError::io("read", Some(path), e))?;
        let r = replay(&data, geometry)?;
        Ok(to_entries(&r.live))
    }

    /// The journal's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The geometry it is bound to.
    pub fn geometry(&self) -> JournalGeometry {
        self.geometry
    }

    /// Live entries, by slot order.
    pub fn entries(&self) -> Vec<JournalEntry> {
        to_entries(&self.state.lock().live)
    }

    /// Live entry count.
    pub fn len(&self) -> usize {
        self.state.lock().live.len()
    }

    /// Whether no slot is listed.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Records in the file (live + superseded, until the next compaction).
    pub fn records_in_file(&self) -> u64 {
        self.state.lock().records
    }

    /// Appends `records` in one write, in order. Every record is written, a `Removed` of a slot
    /// not listed too: a writer that records before each block write thus learns of a full
    /// disk before it writes (and can stop admitting). Durable against process death when
    /// this returns.
    ///
    /// # Errors
    /// A slot out of range ([`PhysicalError::BlockOutOfRange`], nothing written), or the write
    /// failed (e.g. the disk is full): nothing of this call is recorded and the file is cut back
    /// to its last good record.
    pub fn record(&self, records: &[JournalRecord]) -> Result<()> {
        for r in records {
            let slot = match r {
                JournalRecord::Stored { slot, .. } | JournalRecord::Removed { slot } => *slot,
            };
            if slot >= self.geometry.num_slots {
                return Err(PhysicalError::BlockOutOfRange {
                    block_id: slot as usize,
                    num_blocks: self.geometry.num_slots as usize,
                });
            }
        }
        let mut st = self.state.lock();
        let st = &mut *st;
        st.buf.clear();
        let mut n = 0u64;
        let mut rec = [0u8; JOURNAL_RECORD_LEN];
        for r in records {
            encode_record(r, &mut rec);
            st.buf.extend_from_slice(&rec);
            n += 1;
        }
        if n == 0 {
            return Ok(());
        }
        if let Err(e) = st.file.write_all_at(&st.buf, st.good_len) {
            // Cut a partial write off so later records never sit behind a torn one.
            let _ = st.file.set_len(st.good_len);
            return Err(PhysicalError::io("append journal", Some(&self.path), e));
        }
        st.good_len += st.buf.len() as u64;
        st.records += n;
        for r in records {
            match *r {
                JournalRecord::Stored {
                    slot,
                    identity,
                    checksum,
                } => {
                    st.live.insert(slot, (identity, checksum));
                }
                JournalRecord::Removed { slot } => {
                    st.live.remove(&slot);
                }
            }
        }
        if self.due(st) {
            self.start_compaction(st);
        }
        Ok(())
    }

    /// Rewrites the journal with only its live entries now, on this thread (see the module
    /// docs); a compaction running in the background is waited for first.
    ///
    /// # Errors
    /// The snapshot could not be written; the old file is left as it was.
    pub fn compact(&self) -> Result<()> {
        loop {
            self.wait_for_compaction();
            let mut st = self.state.lock();
            // Checked under the lock: no compaction thread exists (only an append under this
            // lock starts one), so none writes `<path>.tmp` beside this one.
            if st.compacting.is_none() {
                return self.compact_locked(&mut st);
            }
        }
    }

    /// Waits for the compaction running in the background, if any, to finish (its swap done,
    /// or dropped).
    pub fn wait_for_compaction(&self) {
        let running = self.state.lock().compacting.take();
        if let Some(thread) = running {
            // A panic in it left the old file in place: nothing to recover here.
            let _ = thread.join();
        }
    }

    /// Whether the file holds enough superseded records to compact.
    fn due(&self, st: &State) -> bool {
        st.records > 0
            && st.records >= self.compact_min.max(2 * st.live.len() as u64)
            && st.records >= st.retry_at
    }

    fn compact_locked(&self, st: &mut State) -> Result<()> {
        let (file, len, n) = write_snapshot(&self.path, &self.geometry, &st.live)?;
        st.file = file;
        st.good_len = len;
        st.records = n;
        Ok(())
    }

    /// Hands the file as it is now to a compaction thread, unless one is still running.
    fn start_compaction(&self, st: &mut State) {
        if let Some(thread) = &st.compacting {
            if !thread.is_finished() {
                return;
            }
            if let Some(done) = st.compacting.take() {
                let _ = done.join();
            }
        }
        let file = match st.file.try_clone() {
            Ok(f) => f,
            Err(e) => {
                st.retry_at = st.records + self.compact_min;
                tracing::warn!(error = %e, "G3 journal: cannot start a compaction");
                return;
            }
        };
        let start = CompactionStart {
            file,
            base: st.good_len,
        };
        let (state, path, geometry, retry) = (
            self.state.clone(),
            self.path.clone(),
            self.geometry,
            self.compact_min,
        );
        #[cfg(test)]
        let gate = self.gate.clone();
        let spawned = std::thread::Builder::new()
            .name("kvbm-journal-compact".into())
            .spawn(move || {
                let written = snapshot_of(&path, &geometry, &start);
                #[cfg(test)]
                if let Some(gate) = gate {
                    gate.wait();
                }
                match finish_compaction(&state, &path, start, written) {
                    // The old file is closed here, after the lock is released (closing the
                    // last descriptor of a replaced file frees its blocks: not on anyone's
                    // time), then the rename made durable against power loss (`sync` does it
                    // too, if it comes first).
                    Ok(old) => {
                        drop(old);
                        sync_parent(&path);
                    }
                    Err(e) => {
                        let mut st = state.lock();
                        st.retry_at = st.records + retry;
                        tracing::warn!(error = %e, "G3 journal compaction failed; the old file is kept");
                    }
                }
            });
        match spawned {
            Ok(thread) => st.compacting = Some(thread),
            Err(e) => {
                st.retry_at = st.records + self.compact_min;
                tracing::warn!(error = %e, "G3 journal: cannot start a compaction thread");
            }
        }
    }

    /// Flushes appended records to stable storage (`fdatasync`). Sync the disk file first.
    ///
    /// # Errors
    /// The sync failed.
    pub fn sync(&self) -> Result<()> {
        let mut st = self.state.lock();
        st.file
            .sync_data()
            .map_err(|e| PhysicalError::io("fdatasync journal", Some(&self.path), e))?;
        st.synced_len = st.good_len;
        if std::mem::take(&mut st.dir_dirty) {
            sync_parent(&self.path);
        }
        Ok(())
    }

    /// Holds every compaction thread between its snapshot and its swap at `gate` (tests).
    #[cfg(test)]
    pub(crate) fn gate_compactions(&mut self, gate: Arc<std::sync::Barrier>) {
        self.gate = Some(gate);
    }
}

impl Drop for JournalFile {
    fn drop(&mut self) {
        self.wait_for_compaction();
    }
}

/// The compaction thread's snapshot: the journal file up to `start.base` replayed into its live
/// set (that part never changes again), written to `<path>.tmp` and synced.
fn snapshot_of(
    path: &Path,
    geometry: &JournalGeometry,
    start: &CompactionStart,
) -> Result<(File, u64, u64)> {
    let mut image = vec![0u8; start.base as usize];
    start
        .file
        .read_exact_at(&mut image, 0)
        .map_err(|e| PhysicalError::io("read journal for compaction", Some(path), e))?;
    let replayed = replay(&image, geometry)?;
    if replayed.good_len != start.base {
        return Err(corrupt(
            &|| path.display().to_string(),
            format!(
                "its first {} bytes replay to {} good bytes while compacting",
                start.base, replayed.good_len
            ),
        ));
    }
    write_tmp(path, geometry, &replayed.live)
}

/// Copies `file[from..to]` to `tmp` at `at`.
fn copy_range(file: &File, tmp: &File, from: u64, to: u64, at: u64) -> std::io::Result<()> {
    let mut buf = vec![0u8; (to - from) as usize];
    file.read_exact_at(&mut buf, from)?;
    tmp.write_all_at(&buf, at)
}

/// The compaction thread's swap: what was appended since `start` copied behind the snapshot
/// (in rounds without the lock, the rest under it), then, under the lock, the tmp file renamed
/// over the journal and swapped in. Returns the old file for the caller to close once the
/// lock is released. On an error the tmp file is removed and the old file kept.
fn finish_compaction(
    state: &Mutex<State>,
    path: &Path,
    start: CompactionStart,
    written: Result<(File, u64, u64)>,
) -> Result<File> {
    let tmp = tmp_path(path);
    let fail = |e: std::io::Error| {
        let _ = std::fs::remove_file(&tmp);
        PhysicalError::io("compact journal", Some(path), e)
    };
    let (tmp_file, len, n) = written?;
    // Catch up with the appends without the lock, a few rounds at most.
    let mut copied = start.base;
    for _ in 0..TAIL_ROUNDS {
        let end = state.lock().good_len;
        if end - copied <= LOCKED_TAIL_BYTES {
            break;
        }
        copy_range(
            &start.file,
            &tmp_file,
            copied,
            end,
            len + (copied - start.base),
        )
        .map_err(fail)?;
        copied = end;
    }
    let mut st = state.lock();
    let tail = st.good_len - start.base;
    // A `sync` promised records past the snapshot's end: they stay durable in the new file.
    let resync = st.synced_len > start.base;
    let swap = || -> std::io::Result<File> {
        copy_range(
            &start.file,
            &tmp_file,
            copied,
            st.good_len,
            len + (copied - start.base),
        )?;
        if resync {
            tmp_file.sync_data()?;
        }
        std::fs::rename(&tmp, path)?;
        open_rw(path)
    };
    let file = swap().map_err(fail)?;
    let old = std::mem::replace(&mut st.file, file);
    st.good_len = len + tail;
    st.records = n + tail / JOURNAL_RECORD_LEN as u64;
    // The snapshot was synced by `write_tmp`; the tail too when a sync covered it.
    st.synced_len = if resync { len + tail } else { len };
    st.dir_dirty = true;
    Ok(old)
}

fn to_entries(live: &LiveEntries) -> Vec<JournalEntry> {
    let mut v: Vec<JournalEntry> = live
        .iter()
        .map(|(slot, (identity, checksum))| JournalEntry {
            slot: *slot,
            identity: *identity,
            checksum: *checksum,
        })
        .collect();
    v.sort_unstable_by_key(|e| e.slot);
    v
}

#[cfg(test)]
mod tests;
