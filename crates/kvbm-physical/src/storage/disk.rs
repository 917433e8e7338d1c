//! G3 disk: one pre-allocated file of fixed-size slots, O_DIRECT, driven by an [`IoEngine`].
//!
//! Slot `s` starts at `s * slot_bytes`. It holds the block's serialized payload (rounded up to
//! [`DIRECT_ALIGN`]) followed by one [`DIRECT_ALIGN`] sector whose first bytes are the
//! [`BlockHeader`] (length, slot index, xxh3-128, the block's [`BlockIdentity`] and this file's
//! id). A write is one vectored request (payload regions + header sector); a read verifies
//! magic, length, slot, file id, identity and checksum, so a corrupted, misdirected, foreign
//! (another block's, another file instance's) or never-written slot is that block's error.
//!
//! Ownership of the file: it is created with mode `0600` (KV can reveal prompts; an existing
//! file is narrowed to `0600` too) and held under an exclusive, non-blocking `flock` for the
//! storage's whole life, so a second opener — another process, or a second storage in this one
//! — is refused with [`PhysicalError::FileLocked`] naming the path instead of sharing slots.
//! Each file instance has a random 128-bit file id, written into every header and required of
//! every slot read. It is drawn when the file is created and kept in a sidecar (`<path>.id`,
//! mode `0600`, with the slot geometry), so reopening the same file — a restart — finds its
//! slots again (G3 is persistent). A file created anew, a file whose sidecar is missing or
//! unreadable, or one reopened with another geometry gets a fresh id: every slot written before
//! is then foreign ([`PhysicalError::IdentityMismatch`]), never served.
//!
//! Capabilities are probed at creation and degrade in stages, one log line each:
//! O_DIRECT refused → buffered I/O; `fallocate` unsupported → `ftruncate`; io_uring unavailable
//! → `preadv`/`pwritev`.
//!
//! When the memory regions of a block are not [`DIRECT_ALIGN`]-aligned (or too many for one
//! request), the block goes through an aligned staging buffer instead. Header sectors and
//! staging buffers come from the storage's buffer pool (`disk_buffers.rs`): lent to one request,
//! kept alive by it until it completes, then returned for the next job, so steady-state jobs
//! map and unmap no memory.

use std::cell::{Cell, RefCell};
use std::fs::{File, OpenOptions};
use std::os::fd::AsRawFd;
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::checksum::{BlockHeader, HEADER_LEN, checksum_regions};
use crate::error::{PhysicalError, Result};
use crate::identity::BlockIdentity;
use crate::io::{IoDir, IoEngine, IoRequest, PsyncEngine, UringEngine};
use crate::storage::disk_buffers::{
    BufClass, BufferPool, DEFAULT_BUFFER_POOL_BYTES, DiskBufferPoolStats, PooledBuf,
};
use crate::storage::{Storage, StorageKind};

/// Alignment of O_DIRECT addresses, lengths and offsets used here.
pub(super) const DIRECT_ALIGN: usize = 4096;
const MAX_IOVECS: usize = 1000;

/// Which I/O engine to use.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum IoEngineKind {
    /// io_uring when available, else psync. Default.
    #[default]
    Auto,
    /// io_uring (falls back to psync with a log line when unavailable).
    Uring,
    /// `preadv`/`pwritev`.
    Psync,
}

/// Configuration of a disk tier file.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DiskConfig {
    /// The file (created or reused, resized to fit).
    pub path: PathBuf,
    /// Engine choice. Default: auto.
    #[serde(default)]
    pub engine: IoEngineKind,
    /// Requests in flight per transfer. Default: 8.
    #[serde(default = "default_qd")]
    pub queue_depth: u32,
    /// Try O_DIRECT. Default: true.
    #[serde(default = "default_true")]
    pub direct_io: bool,
    /// Most bytes of I/O buffers (header sectors, staging buffers) the storage keeps idle for
    /// reuse across jobs; past it, returned buffers are freed. Never a limit on I/O: a job that
    /// finds no idle buffer allocates one. 0 keeps none. Default: 64 MiB.
    #[serde(default = "default_buffer_pool_bytes")]
    pub buffer_pool_bytes: usize,
}

fn default_buffer_pool_bytes() -> usize {
    DEFAULT_BUFFER_POOL_BYTES
}

fn default_qd() -> u32 {
    8
}
fn default_true() -> bool {
    true
}

impl DiskConfig {
    /// Defaults for `path`.
    pub fn new(path: impl Into<PathBuf>) -> Self {
        DiskConfig {
            path: path.into(),
            engine: IoEngineKind::Auto,
            queue_depth: default_qd(),
            direct_io: true,
            buffer_pool_bytes: default_buffer_pool_bytes(),
        }
    }
}

/// What the probe found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DiskCapabilities {
    /// The file is open with O_DIRECT.
    pub direct_io: bool,
    /// Space was reserved with `fallocate`.
    pub fallocated: bool,
    /// The engine in use (`Uring` or `Psync`).
    pub engine: IoEngineKind,
}

/// A disk tier file.
#[derive(Debug)]
pub struct DiskStorage {
    file: File,
    path: PathBuf,
    num_slots: usize,
    payload_bytes: usize,
    slot_bytes: usize,
    caps: DiskCapabilities,
    engine: Box<dyn IoEngine>,
    file_id: u128,
    buffers: BufferPool,
}

/// The pooled buffers one request uses: its header sector and, for a staged block, its staging
/// buffer. Held by the request's `keep_alive` (until the engine is done with the request) and
/// by the job's table (until the request's completion is handled); returned to the pool when
/// both are gone.
#[derive(Debug)]
struct RequestBuffers {
    header: PooledBuf,
    staging: Option<PooledBuf>,
}

/// One block of a disk read or write: its slot, its identity and its host memory regions (in
/// serialized order).
pub type DiskBlock = (usize, BlockIdentity, Vec<(usize, usize)>);

/// 128 random bits from the kernel (never zero, so an all-zero header never matches).
fn random_file_id(path: &Path) -> Result<u128> {
    let mut b = [0u8; 16];
    let mut filled = 0;
    while filled < b.len() {
        // SAFETY: writes at most `b.len() - filled` bytes into the live local buffer `b`.
        let r = unsafe { libc::getrandom(b[filled..].as_mut_ptr().cast(), b.len() - filled, 0) };
        if r < 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            return Err(PhysicalError::io("getrandom", Some(path), e));
        }
        filled += r as usize;
    }
    Ok(u128::from_le_bytes(b).max(1))
}

/// The sidecar that keeps a file instance's id across opens.
fn id_sidecar(path: &Path) -> PathBuf {
    let mut p = path.as_os_str().to_owned();
    p.push(".id");
    PathBuf::from(p)
}

/// The id recorded for the file at `path`, if its sidecar names exactly this geometry.
fn recorded_file_id(path: &Path, slot_bytes: usize, num_slots: usize) -> Option<u128> {
    let text = std::fs::read_to_string(id_sidecar(path)).ok()?;
    let mut parts = text.split_whitespace();
    let (Some("kvbm-g3-id-v1"), Some(id), Some(sb), Some(ns), None) = (
        parts.next(),
        parts.next(),
        parts.next(),
        parts.next(),
        parts.next(),
    ) else {
        return None;
    };
    let id = u128::from_str_radix(id, 16).ok().filter(|&v| v != 0)?;
    (sb.parse::<usize>().ok()? == slot_bytes && ns.parse::<usize>().ok()? == num_slots)
        .then_some(id)
}

/// Records `file_id` for the file at `path` (write to a temporary, fsync, rename: a crash leaves
/// the old sidecar or the new one, never a torn one).
fn record_file_id(path: &Path, file_id: u128, slot_bytes: usize, num_slots: usize) -> Result<()> {
    use std::io::Write;
    let side = id_sidecar(path);
    let tmp = {
        let mut t = side.as_os_str().to_owned();
        t.push(".tmp");
        PathBuf::from(t)
    };
    let write = || -> std::io::Result<()> {
        let mut f = super::create_fresh(&tmp)?;
        writeln!(f, "kvbm-g3-id-v1 {file_id:032x} {slot_bytes} {num_slots}")?;
        f.sync_all()?;
        std::fs::rename(&tmp, &side)
    };
    write().map_err(|e| PhysicalError::io("record the file id", Some(&side), e))
}

fn round_up(v: usize, a: usize) -> usize {
    v.div_ceil(a) * a
}

impl DiskStorage {
    /// Creates (or reuses) the file for `num_slots` blocks of `payload_bytes`, probing
    /// capabilities as described in the module docs.
    pub fn create(config: &DiskConfig, num_slots: usize, payload_bytes: usize) -> Result<Self> {
        if payload_bytes == 0 {
            return Err(PhysicalError::InvalidLayout("empty disk block".into()));
        }
        let path = config.path.clone();
        let slot_bytes = round_up(payload_bytes, DIRECT_ALIGN) + DIRECT_ALIGN;
        let total = slot_bytes
            .checked_mul(num_slots)
            .ok_or_else(|| PhysicalError::InvalidLayout("disk size overflows".into()))?;
        let open = |direct: bool| {
            let mut o = OpenOptions::new();
            o.read(true)
                .write(true)
                .create(true)
                .truncate(false)
                .mode(0o600);
            if direct {
                o.custom_flags(libc::O_DIRECT);
            }
            o.open(&path)
        };
        let mut direct_io = config.direct_io;
        let file = if direct_io {
            match open(true) {
                Ok(f) => f,
                Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {
                    tracing::warn!(path = %path.display(), "O_DIRECT refused by the filesystem; using buffered I/O");
                    direct_io = false;
                    open(false).map_err(|e| PhysicalError::io("open", Some(&path), e))?
                }
                Err(e) => return Err(PhysicalError::io("open", Some(&path), e)),
            }
        } else {
            open(false).map_err(|e| PhysicalError::io("open", Some(&path), e))?
        };
        // SAFETY: `file` is an open descriptor we own; flock has no memory preconditions.
        if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
            let e = std::io::Error::last_os_error();
            return Err(if e.raw_os_error() == Some(libc::EWOULDBLOCK) {
                PhysicalError::FileLocked { path }
            } else {
                PhysicalError::io("flock", Some(&path), e)
            });
        }
        file.set_permissions(std::fs::Permissions::from_mode(0o600))
            .map_err(|e| PhysicalError::io("chmod 0600", Some(&path), e))?;
        // A file that already held slots keeps its recorded id (a restart finds them again);
        // a new, resized or unrecorded file gets a fresh one (its old slots are foreign).
        let existing_len = file
            .metadata()
            .map_err(|e| PhysicalError::io("stat", Some(&path), e))?
            .len();
        let file_id = match (existing_len > 0)
            .then(|| recorded_file_id(&path, slot_bytes, num_slots))
            .flatten()
        {
            Some(id) => id,
            None => {
                let id = random_file_id(&path)?;
                record_file_id(&path, id, slot_bytes, num_slots)?;
                id
            }
        };
        // SAFETY: valid fd; fallocate has no memory preconditions.
        let rc = unsafe { libc::fallocate(file.as_raw_fd(), 0, 0, total as libc::off_t) };
        let fallocated = if rc == 0 {
            true
        } else {
            let e = std::io::Error::last_os_error();
            if matches!(
                e.raw_os_error(),
                Some(libc::EOPNOTSUPP) | Some(libc::ENOSYS)
            ) {
                tracing::warn!(path = %path.display(), "fallocate unsupported; sizing the file with ftruncate (space not reserved)");
                file.set_len(total as u64)
                    .map_err(|e| PhysicalError::io("ftruncate", Some(&path), e))?;
                false
            } else {
                return Err(PhysicalError::io("fallocate", Some(&path), e));
            }
        };
        let engine: Box<dyn IoEngine> = match config.engine {
            IoEngineKind::Psync => Box::new(PsyncEngine),
            IoEngineKind::Auto | IoEngineKind::Uring => {
                match UringEngine::new(config.queue_depth) {
                    Ok(e) => Box::new(e),
                    Err(e) => {
                        tracing::warn!(error = %e, "io_uring unavailable; using preadv/pwritev");
                        Box::new(PsyncEngine)
                    }
                }
            }
        };
        let caps = DiskCapabilities {
            direct_io,
            fallocated,
            engine: if engine.name() == "io_uring" {
                IoEngineKind::Uring
            } else {
                IoEngineKind::Psync
            },
        };
        tracing::debug!(path = %path.display(), ?caps, num_slots, slot_bytes, "disk tier ready");
        Ok(DiskStorage {
            file,
            path,
            num_slots,
            payload_bytes,
            slot_bytes,
            caps,
            engine,
            file_id,
            buffers: BufferPool::new(
                config.buffer_pool_bytes,
                round_up(payload_bytes, DIRECT_ALIGN),
            ),
        })
    }

    /// This file instance's id (drawn at creation, kept in `<path>.id` across opens), written
    /// into every header this storage writes and required of every slot it reads.
    pub fn file_id(&self) -> u128 {
        self.file_id
    }

    /// The file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }
    /// What the probe found.
    pub fn capabilities(&self) -> DiskCapabilities {
        self.caps
    }
    /// Slots in the file.
    pub fn num_slots(&self) -> usize {
        self.num_slots
    }
    /// Payload bytes per slot.
    pub fn payload_bytes(&self) -> usize {
        self.payload_bytes
    }
    /// Bytes per slot on disk (payload rounded up plus the header sector).
    pub fn slot_bytes(&self) -> usize {
        self.slot_bytes
    }
    /// File offset of `slot`.
    pub fn slot_offset(&self, slot: usize) -> u64 {
        (slot * self.slot_bytes) as u64
    }
    /// The name of the I/O engine in use (`io_uring`, `psync`).
    pub fn engine_name(&self) -> &'static str {
        self.engine.name()
    }
    /// The counters of the I/O buffer pool (reuse across jobs, allocations, buffers lent now).
    pub fn buffer_pool_stats(&self) -> DiskBufferPoolStats {
        self.buffers.stats()
    }

    fn location(&self, slot: usize) -> String {
        format!("disk:{}@slot{}", self.path.display(), slot)
    }

    fn direct_ok(&self, regions: &[(usize, usize)]) -> bool {
        regions.len() < MAX_IOVECS
            && regions
                .iter()
                .all(|&(p, l)| p % DIRECT_ALIGN == 0 && l % DIRECT_ALIGN == 0)
    }

    /// Writes each block's payload (given as host memory regions, in serialized order) to its
    /// slot with a header binding its identity and this file's id. Returns one result per block:
    /// the xxh3-128 of the payload written (the checksum in its header), for a caller that
    /// journals it.
    ///
    /// # Safety
    /// Every region must be readable host memory, unchanged until this returns.
    pub unsafe fn write_blocks(&self, blocks: &[DiskBlock]) -> Vec<Result<u128>> {
        let sums: Vec<Cell<u128>> = (0..blocks.len()).map(|_| Cell::new(0)).collect();
        // SAFETY: forwarded from the caller.
        let results = unsafe { self.run(IoDir::Write, blocks, &sums) };
        results
            .into_iter()
            .zip(sums)
            .map(|(r, sum)| r.map(|()| sum.get()))
            .collect()
    }

    /// Reads each block's slot into its regions and verifies it (length, slot, file id, the
    /// given identity, checksum). Returns one result per block; on error the regions hold
    /// unspecified bytes.
    ///
    /// # Safety
    /// Every region must be writable host memory no one else touches until this returns.
    pub unsafe fn read_blocks(&self, blocks: &[DiskBlock]) -> Vec<Result<()>> {
        // SAFETY: forwarded from the caller.
        unsafe { self.run(IoDir::Read, blocks, &[]) }
    }

    /// `sums`: for writes, one cell per block, given the checksum written into its header.
    ///
    /// # Safety
    /// As [`write_blocks`](Self::write_blocks) for writes, [`read_blocks`](Self::read_blocks)
    /// for reads.
    unsafe fn run(&self, dir: IoDir, blocks: &[DiskBlock], sums: &[Cell<u128>]) -> Vec<Result<()>> {
        let n = blocks.len();
        let mut results: Vec<Result<()>> = (0..n)
            .map(|_| Err(PhysicalError::Aborted("not executed".into())))
            .collect();
        for (i, (slot, _, regions)) in blocks.iter().enumerate() {
            let len: usize = regions.iter().map(|r| r.1).sum();
            if *slot >= self.num_slots || len != self.payload_bytes {
                results[i] = Err(PhysicalError::InvalidArgument(format!(
                    "slot {slot} / {len} bytes does not fit a file of {} slots of {} bytes",
                    self.num_slots, self.payload_bytes
                )));
            }
        }
        let valid: Vec<usize> = (0..n)
            .filter(|&i| matches!(&results[i], Err(PhysicalError::Aborted(_))))
            .collect();
        let padded = round_up(self.payload_bytes, DIRECT_ALIGN);
        // Request k's pooled buffers, from its prepare to its completion. The request's
        // `keep_alive` holds them too, so they stay lent until the engine is done with it.
        let lent: RefCell<Vec<Option<Arc<RequestBuffers>>>> = RefCell::new(vec![None; valid.len()]);
        let results = RefCell::new(results);
        let engine_result = {
            let results = &results;
            let lent = &lent;
            let lease = |direct: bool| -> Result<RequestBuffers> {
                Ok(RequestBuffers {
                    header: self.buffers.lease(BufClass::Header)?,
                    staging: if direct {
                        None
                    } else {
                        Some(self.buffers.lease(BufClass::Staging)?)
                    },
                })
            };
            let mut prepare = |k: usize| -> IoRequest {
                let i = valid[k];
                let (slot, identity, regions) = &blocks[i];
                let direct = self.direct_ok(regions) && padded == self.payload_bytes;
                let bufs = match lease(direct) {
                    Ok(b) => Arc::new(b),
                    Err(e) => {
                        results.borrow_mut()[i] = Err(e);
                        // Submit a zero-length read of nothing; completion is ignored.
                        return IoRequest {
                            dir: IoDir::Read,
                            offset: 0,
                            iovecs: Vec::new(),
                            keep_alive: None,
                        };
                    }
                };
                let header_ptr = bufs.header.as_ptr();
                let mut iovecs: Vec<libc::iovec> = Vec::with_capacity(regions.len() + 1);
                if let Some(staging) = &bufs.staging {
                    // Aligned staging buffer for payload (+ padding).
                    debug_assert_eq!(staging.len(), padded, "the pool's staging class");
                    if dir == IoDir::Write {
                        let mut off = 0;
                        for &(p, l) in regions {
                            // SAFETY: caller guarantees regions readable; the staging buffer is
                            // lent to this request alone and `padded` bytes long.
                            unsafe {
                                std::ptr::copy_nonoverlapping(
                                    p as *const u8,
                                    staging.as_ptr().add(off),
                                    l,
                                )
                            };
                            off += l;
                        }
                        // A reused buffer holds an earlier block's bytes: zero the padding.
                        // SAFETY: `off == payload_bytes <= padded`, inside the buffer.
                        unsafe { staging.as_ptr().add(off).write_bytes(0, padded - off) };
                    }
                    iovecs.push(libc::iovec {
                        iov_base: staging.as_ptr().cast(),
                        iov_len: padded,
                    });
                } else {
                    iovecs.extend(regions.iter().map(|&(p, l)| libc::iovec {
                        iov_base: p as *mut libc::c_void,
                        iov_len: l,
                    }));
                }
                if dir == IoDir::Write {
                    // SAFETY: caller guarantees the regions are readable.
                    let checksum = unsafe { checksum_regions(regions) };
                    if let Some(sum) = sums.get(i) {
                        sum.set(checksum);
                    }
                    let h = BlockHeader {
                        len: self.payload_bytes as u64,
                        slot: *slot as u64,
                        checksum,
                        identity: *identity,
                        binding: self.file_id,
                    };
                    // SAFETY: the header sector is lent to this request alone, DIRECT_ALIGN long.
                    let sector =
                        unsafe { std::slice::from_raw_parts_mut(header_ptr, DIRECT_ALIGN) };
                    // A reused sector holds an earlier header: the whole sector is rewritten.
                    sector.fill(0);
                    h.encode(&mut sector[..HEADER_LEN]);
                }
                iovecs.push(libc::iovec {
                    iov_base: header_ptr.cast(),
                    iov_len: DIRECT_ALIGN,
                });
                lent.borrow_mut()[k] = Some(Arc::clone(&bufs));
                IoRequest {
                    dir,
                    offset: self.slot_offset(*slot),
                    iovecs,
                    keep_alive: Some(Box::new(bufs)),
                }
            };
            let mut complete = |k: usize, res: std::io::Result<usize>| {
                let i = valid[k];
                // This job's hold on the request's buffers ends with this call.
                let bufs = lent.borrow_mut()[k].take();
                if !matches!(&results.borrow()[i], Err(PhysicalError::Aborted(_))) {
                    return; // failed in prepare
                }
                let Some(bufs) = bufs else {
                    return; // unreachable: prepare lent buffers to every request it did not fail
                };
                let (slot, identity, regions) = &blocks[i];
                let loc = || self.location(*slot);
                let outcome = (|| {
                    let got = res.map_err(|e| {
                        PhysicalError::io(
                            if dir == IoDir::Read {
                                "disk read"
                            } else {
                                "disk write"
                            },
                            Some(&self.path),
                            e,
                        )
                    })?;
                    if got != self.slot_bytes {
                        return Err(PhysicalError::ShortRead {
                            location: loc(),
                            expected: self.slot_bytes,
                            actual: got,
                        });
                    }
                    if dir == IoDir::Write {
                        return Ok(());
                    }
                    // SAFETY: the read into the header sector completed.
                    let sector =
                        unsafe { std::slice::from_raw_parts(bufs.header.as_ptr(), HEADER_LEN) };
                    let h = BlockHeader::decode(sector, &loc)?;
                    h.expect_bound(
                        self.payload_bytes,
                        *slot as u64,
                        ("file id", self.file_id),
                        identity,
                        &loc,
                    )?;
                    if let Some(staging) = &bufs.staging {
                        // SAFETY: the read into the staging buffer completed.
                        let data = unsafe {
                            std::slice::from_raw_parts(staging.as_ptr(), self.payload_bytes)
                        };
                        h.verify(crate::checksum::checksum_slices([data]), &loc)?;
                        let mut off = 0;
                        for &(p, l) in regions {
                            // SAFETY: caller guarantees regions writable.
                            unsafe {
                                std::ptr::copy_nonoverlapping(
                                    data.as_ptr().add(off),
                                    p as *mut u8,
                                    l,
                                )
                            };
                            off += l;
                        }
                    } else {
                        // SAFETY: the read into the regions completed.
                        h.verify(unsafe { checksum_regions(regions) }, &loc)?;
                    }
                    Ok(())
                })();
                results.borrow_mut()[i] = outcome;
            };
            // SAFETY: every request's iovecs point at the caller's regions (valid per this
            // function's contract) or at pooled buffers lent to that request alone and held by
            // its `keep_alive`, so they live until the engine is done with it (and are never
            // lent again if the engine leaks the request); `run` returns only after every
            // request completed (or, on an engine failure, after waiting for or leaking them).
            unsafe {
                self.engine.run(
                    self.file.as_raw_fd(),
                    valid.len(),
                    &mut prepare,
                    &mut complete,
                )
            }
        };
        let mut results = results.into_inner();
        if let Err(e) = engine_result {
            let msg = format!("{} engine failed: {e}", self.engine.name());
            for &i in &valid {
                if matches!(&results[i], Err(PhysicalError::Aborted(_))) {
                    results[i] = Err(PhysicalError::Aborted(msg.clone()));
                }
            }
        }
        results
    }

    /// Flushes written data to stable storage (`fdatasync`).
    pub fn sync(&self) -> Result<()> {
        self.file
            .sync_data()
            .map_err(|e| PhysicalError::io("fdatasync", Some(&self.path), e))
    }
}

impl Storage for DiskStorage {
    fn kind(&self) -> StorageKind {
        StorageKind::Disk
    }
    fn size_bytes(&self) -> usize {
        self.num_slots * self.slot_bytes
    }
}

#[cfg(test)]
mod tests;
