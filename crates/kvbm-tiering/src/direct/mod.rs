//! The direct disk path (vLLM 0.34's device ↔ file offloading, `DevicePointers` into an fs
//! worker): KV chunks move between the engine's KV cache and one kvbm G3 file, with no CPU tier
//! between them, and keep kvbm's disk guarantees: bounded (`capacity` slots, the policy's victim
//! given up for a new chunk), journaled (a `kill -9` loses no listed chunk and lists no torn
//! one), checksummed (every slot carries kvbm-physical's header: a read whose identity or bytes
//! do not match is a failed load, never wrong bytes) and warm across restarts.
//!
//! ```text
//!  scheduler thread                               worker (same process)
//!  DirectDiskManager (vLLM OffloadingManager)     DirectDiskWorker (vLLM OffloadingWorker)
//!   CpuOffloadingManager: slot table, policy,      submit_store(job, DevicePointers, spec)
//!   requests, events (slots = disk slots)           └ plan: per chunk its pages, file order
//!   prepare_store ─► spec (no I/O) ───────────────► I/O thread: journal Removed(slots),
//!                                                     DiskStorage::write_blocks,
//!   complete_store(ok) ◄── TransferResult ◄────────    journal Stored(slot, id, checksum)
//!   lookup MISS ─► restored digest? adopt          submit_load ─► read_blocks (verified)
//!   complete_load ─► discard keys that failed  ◄── DirectDisk::bad (identity/checksum failures)
//!                 └──────────── Arc<DirectDisk>: DiskStorage + JournalFile ─┘
//! ```
//!
//! # Why one process
//!
//! The manager decides which slot a chunk goes to and the worker writes it there; both use one
//! [`DirectDisk`] (the file, its `flock`, its journal), found by path in this process
//! ([`DirectDisk::shared`]). vLLM runs its worker in the scheduler's process with one worker
//! (its `uni` executor, the default for one GPU); with several (tensor parallelism), each rank
//! would need its own file and journal, which this path does not offer: the spec refuses it.
//!
//! # Slots and keys
//!
//! The manager is kvbm-tiering's [`CpuOffloadingManager`](crate::CpuOffloadingManager) over `capacity` slots (the one vLLM
//! manager contract kvbm keeps: the same policies, request hooks, events and stats), its chunk
//! ids the disk's slots, its events naming the `STORAGE` medium. The journal's rule (a slot is
//! unlisted before it is written again) is kept by the worker, on its I/O thread: each batch of
//! stores unlists its slots in one append, writes them, and lists the ones written with the
//! checksums it wrote; a journal that cannot record fails the batch before anything is written.
//! `prepare_store`, on the scheduler's thread, does no I/O: a slot it hands out (a victim's,
//! a restored chunk nobody asked for) stays listed under its old chunk, whose bytes are intact,
//! until the worker unlists it (a restart in between restores that old chunk, correctly). A
//! store reported failed is unlisted again.
//!
//! A chunk is identified in its slot's header and in the journal by the key's digest
//! ([`key_identity`]), which does not give the key back. So a restart holds the journal's slots
//! ([`CpuOffloadingManager::hold_slots`](crate::CpuOffloadingManager::hold_slots)) until a lookup of a key whose digest one of them
//! carries adopts it (a `HIT`, the chunk ready at the policy's most recent end). Restored slots
//! nobody asked for are the first given up when a store needs room. The journal's header binds
//! the file to the [`ModelFingerprint`]: a file written for another model, dtype, layout or
//! chunk size starts cold.
//!
//! # What a job's bytes are
//!
//! A chunk's slot holds its pages in vLLM's file order (data ref major, then block:
//! `(d * blocks_per_chunk + b) * page`), padded with zeros to the slot's payload (a chunk of a
//! group with fewer data refs, or entered mid-chunk, fills less of it). A load reads the whole
//! slot, verifies it, and scatters the pages it needs; the rest lands in a scratch buffer.
//!
//! # Lock order
//!
//! The manager is the scheduler thread's (`&mut self`). The worker's queue mutex, then nothing;
//! its finished-jobs mutex, then nothing; [`DirectDisk`]'s `bad` mutex, then nothing; the
//! journal's own mutex inside each call. No lock is held across I/O.

mod manager;
#[cfg(test)]
mod tests;
mod worker;

pub use manager::DirectDiskManager;
pub use worker::{DevicePointers, DirectDiskWorker};

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, Weak};

use kvbm_physical::storage::journal::{JournalFile, JournalGeometry};
use kvbm_physical::{BlockIdentity, DiskCapabilities, DiskConfig, DiskStorage, ModelFingerprint};

use crate::error::{Result, TieringError};
use crate::key::OffloadKey;

pub use crate::tiering::physical::key_identity;

/// What a direct disk is.
#[derive(Clone, Debug)]
pub struct DirectDiskConfig {
    /// The file, its I/O engine, O_DIRECT.
    pub disk: DiskConfig,
    /// Chunk slots in the file.
    pub capacity: usize,
    /// Bytes of one chunk (one worker's pages of `blocks_per_chunk` blocks): a slot's payload.
    pub chunk_bytes: usize,
    /// The model the chunks belong to; a file journaled under another starts cold.
    pub fingerprint: Option<ModelFingerprint>,
}

/// What opening found.
#[derive(Clone, Debug, Default)]
pub struct Opened {
    /// Chunks restored from the journal.
    pub restored: usize,
    /// Why the journal started afresh (another model or geometry), if it did.
    pub reset: Option<String>,
    /// Bytes cut from a torn journal tail.
    pub discarded_bytes: u64,
}

/// One direct disk: the file and its journal, shared by the manager and the worker of one
/// process (module docs).
pub struct DirectDisk {
    config: DirectDiskConfig,
    storage: DiskStorage,
    journal: JournalFile,
    opened: Opened,
    /// The journal's entries at open, for the manager (taken once).
    restored: Mutex<Option<Vec<(u32, BlockIdentity)>>>,
    /// Keys whose read failed verification (another chunk's bytes, corrupt bytes or header):
    /// the manager forgets them at its next `complete_load`.
    bad: Mutex<Vec<OffloadKey>>,
}

impl std::fmt::Debug for DirectDisk {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DirectDisk")
            .field("path", &self.storage.path())
            .field("capacity", &self.config.capacity)
            .field("chunk_bytes", &self.config.chunk_bytes)
            .finish()
    }
}

/// The direct disks open in this process, by absolute path.
static OPEN: Mutex<Option<HashMap<PathBuf, Weak<DirectDisk>>>> = Mutex::new(None);

fn absolute(path: &Path) -> Result<PathBuf> {
    std::path::absolute(path)
        .map_err(|e| TieringError::Config(format!("direct disk path {}: {e}", path.display())))
}

impl DirectDisk {
    /// Opens (or creates) the file and its journal (`<file>.journal`), restoring what the
    /// journal lists unless it was written for another model or geometry.
    pub fn open(config: DirectDiskConfig) -> Result<Arc<Self>> {
        if config.capacity == 0 || config.capacity > u32::MAX as usize {
            return Err(TieringError::Config(format!(
                "direct disk {}: capacity {} (1..={} chunks)",
                config.disk.path.display(),
                config.capacity,
                u32::MAX
            )));
        }
        if config.chunk_bytes == 0 {
            return Err(TieringError::Config(format!(
                "direct disk {}: a chunk of 0 bytes",
                config.disk.path.display()
            )));
        }
        let storage = DiskStorage::create(&config.disk, config.capacity, config.chunk_bytes)?;
        let geometry = JournalGeometry {
            payload_bytes: config.chunk_bytes as u64,
            num_slots: config.capacity as u64,
            file_id: storage.file_id(),
            fingerprint: config.fingerprint.map_or(0, |f| f.short()),
        };
        let journal_path = config.disk.path.with_extension("journal");
        let (journal, recovery) = JournalFile::open(&journal_path, geometry)?;
        let restored: Vec<(u32, BlockIdentity)> = journal
            .entries()
            .into_iter()
            .map(|e| (e.slot as u32, e.identity))
            .collect();
        let opened = Opened {
            restored: restored.len(),
            reset: recovery.reset.clone(),
            discarded_bytes: recovery.discarded_bytes,
        };
        Ok(Arc::new(DirectDisk {
            config,
            storage,
            journal,
            opened,
            restored: Mutex::new(Some(restored)),
            bad: Mutex::new(Vec::new()),
        }))
    }

    /// The direct disk at `config`'s path open in this process, or a new one: the manager and
    /// the worker of one vLLM instance meet here, in whichever order they are built. One open
    /// with another capacity or chunk size is refused, naming both.
    pub fn shared(config: DirectDiskConfig) -> Result<Arc<Self>> {
        let key = absolute(&config.disk.path)?;
        let mut open = OPEN.lock().expect("direct disk registry poisoned");
        let open = open.get_or_insert_with(HashMap::new);
        open.retain(|_, d| d.strong_count() > 0);
        if let Some(d) = open.get(&key).and_then(Weak::upgrade) {
            if d.config.capacity != config.capacity || d.config.chunk_bytes != config.chunk_bytes {
                return Err(TieringError::Config(format!(
                    "direct disk {} is open in this process with {} chunks of {} bytes, asked \
                     for {} of {}",
                    key.display(),
                    d.config.capacity,
                    d.config.chunk_bytes,
                    config.capacity,
                    config.chunk_bytes
                )));
            }
            return Ok(d);
        }
        let d = Self::open(config)?;
        open.insert(key, Arc::downgrade(&d));
        Ok(d)
    }

    /// The configuration it was opened with.
    pub fn config(&self) -> &DirectDiskConfig {
        &self.config
    }

    /// What opening found.
    pub fn opened(&self) -> &Opened {
        &self.opened
    }

    /// O_DIRECT, fallocate and the I/O engine in use.
    pub fn capabilities(&self) -> DiskCapabilities {
        self.storage.capabilities()
    }

    /// Chunks the journal lists now.
    pub fn listed(&self) -> usize {
        self.journal.len()
    }

    pub(crate) fn storage(&self) -> &DiskStorage {
        &self.storage
    }

    pub(crate) fn journal(&self) -> &JournalFile {
        &self.journal
    }

    pub(crate) fn take_restored(&self) -> Vec<(u32, BlockIdentity)> {
        self.restored
            .lock()
            .expect("restored poisoned")
            .take()
            .unwrap_or_default()
    }

    pub(crate) fn report_bad(&self, keys: impl IntoIterator<Item = OffloadKey>) {
        self.bad.lock().expect("bad poisoned").extend(keys);
    }

    pub(crate) fn take_bad(&self) -> Vec<OffloadKey> {
        std::mem::take(&mut *self.bad.lock().expect("bad poisoned"))
    }

    /// Flushes the file, then the journal, to stable storage.
    pub fn sync(&self) -> Result<()> {
        self.storage.sync()?;
        self.journal.sync()?;
        Ok(())
    }
}
