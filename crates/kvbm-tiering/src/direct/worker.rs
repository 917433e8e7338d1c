//! `DirectDiskWorker`: the worker half of the direct disk path (see [`direct`](super)): vLLM's
//! `OffloadingWorker` moving chunks between the pages `DevicePointers` name and the disk's
//! slots, on one I/O thread.
//!
//! ```text
//!  submit_store / submit_load (the caller's thread: plan only, never I/O)
//!    └► queue (an expedited load goes first) ─► I/O thread: the queued jobs of one direction
//!       as one DiskStorage call ─► stores: journal Removed(slot) for the batch, the write,
//!       journal Stored(slot, identity, checksum)
//!       ─► finished (job id, success, bytes, seconds) ─► get_finished / wait
//! ```
//!
//! Memory: the pages are the caller's (vLLM's KV cache; host memory, see the safety contract
//! of [`submit_store`](DirectDiskWorker::submit_store)), reserved for the job by vLLM's
//! connector until the job is reported finished, which happens after its I/O completed. Zero
//! padding is one buffer shared by every store (read only); each load chunk with gaps has its
//! own scratch buffer (concurrent reads never share bytes a checksum is computed over).
//!
//! Locks: the queue's mutex and the finished list's mutex are never held together, nor across
//! I/O.

use std::collections::{HashSet, VecDeque};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::Instant;

use kvbm_offload::BlockFailureKind;
use kvbm_physical::storage::DiskBlock;
use kvbm_physical::storage::journal::JournalRecord;

use super::{DirectDisk, key_identity};
use crate::error::{Result, TieringError};
use crate::key::OffloadKey;
use crate::types::WorkerJobResult;

/// vLLM 0.34's `DevicePointers`: the pages of a transfer, flat in canonical order (per group,
/// per data ref, per block: `ptrs[i]`, `sizes[i]`), with each group's block count, data-ref
/// count and first logical block.
#[derive(Clone, Debug, Default)]
pub struct DevicePointers {
    /// Page addresses.
    pub ptrs: Vec<u64>,
    /// Page sizes in bytes.
    pub sizes: Vec<u64>,
    /// Blocks per group.
    pub group_block_counts: Vec<usize>,
    /// Data refs per group.
    pub group_data_ref_counts: Vec<usize>,
    /// Each group's first logical block (its offset within a chunk: `% blocks_per_chunk`).
    pub block_indices: Vec<usize>,
}

/// One chunk's pages: (offset in the chunk, address, length), in file order.
type Pages = Vec<(usize, usize, usize)>;

/// The chunks `p` covers, each its pages in file order (module docs of [`direct`](super)).
fn plan(p: &DevicePointers, blocks_per_chunk: usize, chunk_bytes: usize) -> Result<Vec<Pages>> {
    let bad = |what: String| TieringError::Contract {
        call: "direct disk transfer",
        what,
    };
    let groups = p.group_block_counts.len();
    if p.group_data_ref_counts.len() != groups || p.block_indices.len() != groups {
        return Err(bad(format!(
            "{groups} group block counts, {} data-ref counts, {} block indices",
            p.group_data_ref_counts.len(),
            p.block_indices.len()
        )));
    }
    if p.ptrs.len() != p.sizes.len() {
        return Err(bad(format!(
            "{} pointers, {} sizes",
            p.ptrs.len(),
            p.sizes.len()
        )));
    }
    let mut chunks = Vec::new();
    let mut first = 0usize;
    for g in 0..groups {
        let (size, refs) = (p.group_block_counts[g], p.group_data_ref_counts[g]);
        if size == 0 {
            continue;
        }
        let skip = p.block_indices[g] % blocks_per_chunk;
        let n_chunks = (size + skip).div_ceil(blocks_per_chunk);
        let mut dev_blk = 0;
        for c in 0..n_chunks {
            let start = if c == 0 { skip } else { 0 };
            let n = (blocks_per_chunk - start).min(size - dev_blk);
            let mut pages = Vec::with_capacity(n * refs);
            for d in 0..refs {
                let base = first + d * size + dev_blk;
                let Some(&page) = p.sizes.get(base) else {
                    return Err(bad(format!("page {base} of {} pointers", p.ptrs.len())));
                };
                for b in 0..n {
                    let i = base + b;
                    let (Some(&ptr), Some(&len)) = (p.ptrs.get(i), p.sizes.get(i)) else {
                        return Err(bad(format!("page {i} of {} pointers", p.ptrs.len())));
                    };
                    let off = (d * blocks_per_chunk + start + b) * page as usize;
                    if off + len as usize > chunk_bytes {
                        return Err(bad(format!(
                            "a page at byte {off} of {len} bytes does not fit a chunk of \
                             {chunk_bytes} bytes"
                        )));
                    }
                    pages.push((off, ptr as usize, len as usize));
                }
            }
            pages.sort_unstable_by_key(|&(off, _, _)| off);
            if pages.windows(2).any(|w| w[0].0 + w[0].2 > w[1].0) {
                return Err(bad("two pages of one chunk overlap".into()));
            }
            chunks.push(pages);
            dev_blk += n;
        }
        first += size * refs;
    }
    if first != p.ptrs.len() {
        return Err(bad(format!(
            "the groups name {first} pages, the pointers {}",
            p.ptrs.len()
        )));
    }
    Ok(chunks)
}

/// `pages` as the regions of a whole chunk, gaps filled from `fill` (at the gap's offset).
fn regions(pages: &Pages, chunk_bytes: usize, fill: usize) -> Vec<(usize, usize)> {
    let mut out = Vec::with_capacity(pages.len() * 2 + 1);
    let mut at = 0;
    for &(off, ptr, len) in pages {
        if off > at {
            out.push((fill + at, off - at));
        }
        out.push((ptr, len));
        at = off + len;
    }
    if at < chunk_bytes {
        out.push((fill + at, chunk_bytes - at));
    }
    out
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Dir {
    Store,
    Load,
}

struct Task {
    job_id: u64,
    dir: Dir,
    keys: Vec<OffloadKey>,
    blocks: Vec<DiskBlock>,
    /// Load scratch buffers the regions point into (kept alive until the read is done).
    _scratch: Vec<Vec<u8>>,
    bytes: u64,
    start: Instant,
}

#[derive(Default)]
struct Queue {
    tasks: VecDeque<Task>,
    stop: bool,
}

struct Shared {
    disk: Arc<DirectDisk>,
    queue: Mutex<Queue>,
    work: Condvar,
    finished: Mutex<Vec<WorkerJobResult>>,
    settled: Condvar,
}

/// Most jobs of one direction one I/O call takes.
const BATCH: usize = 64;

impl Shared {
    fn run(&self) {
        loop {
            let batch: Vec<Task> = {
                let mut q = self.queue.lock().expect("queue poisoned");
                while q.tasks.is_empty() && !q.stop {
                    q = self.work.wait(q).expect("queue poisoned");
                }
                let Some(first) = q.tasks.pop_front() else {
                    return; // stopped and drained
                };
                let dir = first.dir;
                let mut batch = vec![first];
                while batch.len() < BATCH && q.tasks.front().is_some_and(|t| t.dir == dir) {
                    batch.extend(q.tasks.pop_front());
                }
                batch
            };
            let results = self.execute(&batch);
            self.finished
                .lock()
                .expect("finished poisoned")
                .extend(results);
            self.settled.notify_all();
        }
    }

    fn execute(&self, batch: &[Task]) -> Vec<WorkerJobResult> {
        let dir = batch[0].dir;
        let blocks: Vec<_> = batch
            .iter()
            .flat_map(|t| t.blocks.iter().cloned())
            .collect();
        let storage = self.disk.storage();
        let mut ok: Vec<bool> = Vec::with_capacity(blocks.len());
        match dir {
            Dir::Store => {
                // The journal's rule: a slot is unlisted before it is written again. The
                // manager handed these slots out (a victim's, a restored chunk's) still listed
                // under their old chunks, whose bytes are intact until here; one append for the
                // batch. A journal that cannot record (a full disk) fails the batch unwritten.
                let unlist: Vec<JournalRecord> = blocks
                    .iter()
                    .map(|(slot, _, _)| JournalRecord::Removed { slot: *slot as u64 })
                    .collect();
                if let Err(e) = self.disk.journal().record(&unlist) {
                    tracing::warn!(error = %e, "direct disk: journal append failed, nothing written");
                    ok.resize(blocks.len(), false);
                } else {
                    self.write(&blocks, &mut ok);
                }
            }
            Dir::Load => {
                // SAFETY: every region is the caller's host memory reserved for its job until
                // the job is reported finished (submit_load's contract), or the job's own
                // scratch buffer; the tasks are alive until this returns.
                let read = unsafe { storage.read_blocks(&blocks) };
                let keys = batch.iter().flat_map(|t| t.keys.iter());
                let mut bad = Vec::new();
                for (r, k) in read.into_iter().zip(keys) {
                    if let Err(e) = &r {
                        tracing::warn!(key = %k, error = %e, "direct disk: chunk read failed");
                        if BlockFailureKind::of_physical(e).drops_copy() {
                            bad.push(*k);
                        }
                    }
                    ok.push(r.is_ok());
                }
                if !bad.is_empty() {
                    self.disk.report_bad(bad);
                }
            }
        }
        let mut at = 0;
        batch
            .iter()
            .map(|t| {
                let n = t.blocks.len();
                let success = ok[at..at + n].iter().all(|&o| o);
                at += n;
                WorkerJobResult {
                    job_id: t.job_id,
                    success,
                    transfer_size: Some(t.bytes),
                    transfer_time: Some(t.start.elapsed().as_secs_f64()),
                }
            })
            .collect()
    }

    /// Writes `blocks` (their slots unlisted already) and lists the ones written; `ok` gets one
    /// outcome per block.
    fn write(&self, blocks: &[DiskBlock], ok: &mut Vec<bool>) {
        let storage = self.disk.storage();
        // SAFETY: every region is the caller's host memory reserved for its job until
        // the job is reported finished (submit_store's contract), or the shared zero
        // buffer; the tasks are alive until this returns.
        let written = unsafe { storage.write_blocks(blocks) };
        let mut listed = Vec::new();
        for ((slot, identity, _), r) in blocks.iter().zip(written) {
            match r {
                Ok(checksum) => {
                    listed.push(JournalRecord::Stored {
                        slot: *slot as u64,
                        identity: *identity,
                        checksum,
                    });
                    ok.push(true);
                }
                Err(e) => {
                    tracing::warn!(slot, error = %e, "direct disk: chunk write failed");
                    ok.push(false);
                }
            }
        }
        if !listed.is_empty()
            && let Err(e) = self.disk.journal().record(&listed)
        {
            // Written but not listed: not durable, so not stored.
            tracing::warn!(error = %e, "direct disk: journal append failed");
            ok.iter_mut().for_each(|o| *o = false);
        }
    }
}

/// vLLM's `OffloadingWorker` for the direct disk path (module docs).
pub struct DirectDiskWorker {
    shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
    blocks_per_chunk: usize,
    zeros: Arc<Vec<u8>>,
    /// Jobs submitted and not yet reported by `get_finished`.
    pending: HashSet<u64>,
}

impl std::fmt::Debug for DirectDiskWorker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DirectDiskWorker")
            .field("disk", &self.shared.disk)
            .field("pending", &self.pending.len())
            .finish()
    }
}

impl DirectDiskWorker {
    /// A worker writing `disk`'s slots, `blocks_per_chunk` engine blocks per chunk.
    pub fn new(disk: Arc<DirectDisk>, blocks_per_chunk: usize) -> Result<Self> {
        if blocks_per_chunk == 0 {
            return Err(TieringError::Config("blocks_per_chunk is 0".into()));
        }
        let zeros = Arc::new(vec![0u8; disk.config().chunk_bytes]);
        let shared = Arc::new(Shared {
            disk,
            queue: Mutex::new(Queue::default()),
            work: Condvar::new(),
            finished: Mutex::new(Vec::new()),
            settled: Condvar::new(),
        });
        let s = Arc::clone(&shared);
        let thread = std::thread::Builder::new()
            .name("kvbm-direct-io".into())
            .spawn(move || s.run())
            .map_err(|e| {
                TieringError::Config(format!("starting the direct disk I/O thread: {e}"))
            })?;
        Ok(Self {
            shared,
            thread: Some(thread),
            blocks_per_chunk,
            zeros,
            pending: HashSet::new(),
        })
    }

    /// The disk it writes.
    pub fn disk(&self) -> &Arc<DirectDisk> {
        &self.shared.disk
    }

    fn submit(
        &mut self,
        job_id: u64,
        dir: Dir,
        pointers: &DevicePointers,
        keys: &[OffloadKey],
        slots: &[u32],
        expedited: bool,
    ) -> Result<()> {
        let refuse = |what: String| TieringError::Contract {
            call: if dir == Dir::Store {
                "submit_store"
            } else {
                "submit_load"
            },
            what,
        };
        if self.thread.is_none() {
            return Err(refuse("the worker is shut down".into()));
        }
        if !self.pending.insert(job_id) {
            return Err(refuse(format!("job {job_id} is already in flight")));
        }
        let chunk_bytes = self.shared.disk.config().chunk_bytes;
        let planned = plan(pointers, self.blocks_per_chunk, chunk_bytes).and_then(|chunks| {
            if chunks.len() == keys.len() && keys.len() == slots.len() {
                Ok(chunks)
            } else {
                Err(refuse(format!(
                    "the pointers cover {} chunks, the spec names {} keys and {} slots",
                    chunks.len(),
                    keys.len(),
                    slots.len()
                )))
            }
        });
        let chunks = match planned {
            Ok(c) => c,
            Err(e) => {
                self.pending.remove(&job_id);
                return Err(e);
            }
        };
        let mut scratch = Vec::new();
        let mut bytes = 0u64;
        let blocks = chunks
            .iter()
            .zip(keys.iter().zip(slots))
            .map(|(pages, (k, &slot))| {
                bytes += pages.iter().map(|p| p.2 as u64).sum::<u64>();
                let covered: usize = pages.iter().map(|p| p.2).sum();
                let fill = if covered == chunk_bytes {
                    0
                } else if dir == Dir::Store {
                    self.zeros.as_ptr() as usize
                } else {
                    scratch.push(vec![0u8; chunk_bytes]);
                    scratch.last().expect("pushed").as_ptr() as usize
                };
                (
                    slot as usize,
                    key_identity(k),
                    regions(pages, chunk_bytes, fill),
                )
            })
            .collect();
        let task = Task {
            job_id,
            dir,
            keys: keys.to_vec(),
            blocks,
            _scratch: scratch,
            bytes,
            start: Instant::now(),
        };
        let mut q = self.shared.queue.lock().expect("queue poisoned");
        if expedited {
            q.tasks.push_front(task);
        } else {
            q.tasks.push_back(task);
        }
        drop(q);
        self.shared.work.notify_one();
        Ok(())
    }

    /// vLLM's `submit_store`: the chunks `pointers` covers (in order: `keys[i]` into
    /// `slots[i]`, as the manager's spec says) written to their slots, without blocking.
    /// Refused, with nothing queued, where the pointers and the spec disagree.
    ///
    /// # Safety
    /// Every page `pointers` names is host-readable memory that stays valid and unchanged
    /// until the job is reported by [`get_finished`](Self::get_finished) (vLLM's connector
    /// reserves a store's blocks until then).
    pub unsafe fn submit_store(
        &mut self,
        job_id: u64,
        pointers: &DevicePointers,
        keys: &[OffloadKey],
        slots: &[u32],
    ) -> Result<()> {
        self.submit(job_id, Dir::Store, pointers, keys, slots, false)
    }

    /// vLLM's `submit_load`: the chunks in `slots` (holding `keys`) read, verified and
    /// scattered into the pages `pointers` names, without blocking; an `expedited` load goes
    /// ahead of every queued job. A chunk whose slot fails verification fails the job and is
    /// forgotten by the manager at its next `complete_load`.
    ///
    /// # Safety
    /// Every page `pointers` names is host-writable memory that nobody else reads or writes
    /// until the job is reported by [`get_finished`](Self::get_finished).
    pub unsafe fn submit_load(
        &mut self,
        job_id: u64,
        keys: &[OffloadKey],
        slots: &[u32],
        pointers: &DevicePointers,
        expedited: bool,
    ) -> Result<()> {
        self.submit(job_id, Dir::Load, pointers, keys, slots, expedited)
    }

    /// vLLM's `get_finished`: the jobs settled since the last call, each once.
    pub fn get_finished(&mut self) -> Vec<WorkerJobResult> {
        let done = std::mem::take(&mut *self.shared.finished.lock().expect("finished poisoned"));
        for r in &done {
            self.pending.remove(&r.job_id);
        }
        done
    }

    /// vLLM's `wait`: blocks until every job of `job_ids` still in flight settled (reported by
    /// the next `get_finished`).
    pub fn wait(&self, job_ids: &[u64]) {
        let wanted: Vec<u64> = job_ids
            .iter()
            .copied()
            .filter(|j| self.pending.contains(j))
            .collect();
        let mut done = self.shared.finished.lock().expect("finished poisoned");
        while !wanted.iter().all(|j| done.iter().any(|r| r.job_id == *j)) {
            done = self.shared.settled.wait(done).expect("finished poisoned");
        }
    }

    /// Jobs submitted and not yet reported.
    pub fn num_pending(&self) -> usize {
        self.pending.len()
    }

    /// Finishes every queued job, stops the I/O thread and syncs the disk.
    pub fn shutdown(&mut self) -> Result<()> {
        if let Some(t) = self.thread.take() {
            self.shared.queue.lock().expect("queue poisoned").stop = true;
            self.shared.work.notify_all();
            let _ = t.join();
        }
        self.shared.disk.sync()
    }
}

impl Drop for DirectDiskWorker {
    fn drop(&mut self) {
        let _ = self.shutdown();
    }
}
