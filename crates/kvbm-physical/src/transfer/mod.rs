//! The transfer manager: registered layouts and block transfers between them.
//!
//! [`TransferManager::execute_transfer`] validates its arguments synchronously (an error there
//! means nothing started), then runs the transfer on the manager's own tokio runtime and returns
//! a [`TransferCompletion`] future resolving to per-block [`TransferOutcome`]s. It works from
//! sync or async callers alike.
//!
//! # Why transfers cannot race each other
//!
//! A transfer writes raw memory (`copy_nonoverlapping`, the kernel through O_DIRECT iovecs), so
//! two transfers touching one block at once would be a data race. The manager rules that out
//! itself instead of trusting its callers:
//!
//! * **No aliasing layouts.** [`register_layout`](TransferManager::register_layout) reserves a
//!   layout's memory (host and device address ranges, the disk storage) process-wide, across
//!   managers; a layout overlapping one still registered (a clone, a second layout over the same
//!   allocation) is refused with [`PhysicalError::AliasedLayout`]. So `(layout, block)` names
//!   memory no other registered layout can reach. The reservation lives until the layout is
//!   unregistered (or its manager dropped) **and** its last transfer finished.
//! * **No chained copies.** Within one transfer, a block may not be both read and written
//!   (`src [0,1] → dst [1,2]` within one layout is refused up front).
//! * **Claims.** A transfer claims its blocks before it starts: shared for sources, exclusive
//!   for destinations (disk slots included; object-store sides are keyed puts and gets and
//!   claim nothing). A transfer that would write a block another in-flight transfer reads or
//!   writes, or read one another writes, is refused with [`PhysicalError::BlockBusy`]; nothing
//!   started. Claims are released when the transfer's work ends, before its completion resolves.
//!
//! The only other ways to layout memory are `unsafe` (raw addresses from
//! [`PhysicalLayout::block_addrs`](crate::PhysicalLayout::block_addrs), `HostStorage::as_slice`,
//! [`crate::IoEngine::run`], `DiskStorage::read_blocks`), whose callers take on the contract.
//!
//! What the manager cannot see is who else holds a block: a reference made through those
//! accessors (a slot table's chunk view), or an owner that expects the block's content to stay
//! (a `kvbm-logical` manager's registered block, a G1 slot the inference engine is using). That
//! exclusivity is the caller's, so the raw calls
//! [`execute_transfer`](TransferManager::execute_transfer) and
//! [`execute_transfer_inline`](TransferManager::execute_transfer_inline) are `unsafe`; the
//! one move above them (`kvbm_offload::BlockMover`, `ExternalMover`) discharges the contract
//! with handles: each destination is a `MutableBlock` the move owns, or a slot its caller
//! reserved.
//!
//! Lock order: `layouts` → `claims` → the global reservation table; each is a leaf
//! `parking_lot` lock held for a lookup or insert only, never across I/O or an `.await`.
//!
//! **Range copies.** [`TransferManager::execute_copies`] (and its inline twin) is the same copy
//! below whole blocks: a list of [`RangeCopy`]s, each a strided run of byte fragments from one
//! block of the source to one block of the destination, offsets counted in the block's
//! serialized bytes (its regions concatenated, as everywhere). Vetted the same way (both layouts
//! registered and memory, every fragment inside its block, claims on every block touched, all
//! or nothing) and run through the same region copy as whole blocks; it serves vLLM's worker,
//! which moves pages of KV groups, sub-blocks of chunks and canonical-page fragments.
//!
//! Strategies (`strategy.rs`), chosen by the storage kinds of the two sides:
//!
//! | src → dst | strategy |
//! |---|---|
//! | host/device ↔ host/device | region copies (memcpy; device copies through [`crate::DeviceMemory`]); host ↔ host also on the caller's thread ([`TransferManager::execute_transfer_inline`]) |
//! | host → disk, disk → host | vectored O_DIRECT I/O through the disk's [`crate::IoEngine`], checksummed |
//! | host → object, object → host/device | one checksummed object per block, bounded concurrency |
//! | anything else (device ↔ disk/object, disk ↔ object, disk → disk, partial-layer disk reads) | two hops through a pinned host bounce buffer from the manager's pool (`bounce.rs`) |
//!
//! Locking: the layout table is a `parking_lot::RwLock` held only to look up or insert a handle,
//! never across I/O (see above for the claim table); storage-level locks (the io_uring ring pool, the object semaphore) are
//! leaves taken inside a transfer. No lock is held across an `.await` except the object
//! semaphore permit and a bounce-pool lease (its idle list is a leaf `parking_lot::Mutex`
//! held only to push or pop a buffer).

mod bounce;
mod claims;
#[cfg(feature = "cuda")]
pub mod cuda;
mod ranges;
mod strategy;
#[cfg(test)]
mod tests;

pub use bounce::{BouncePoolStats, ONE_OFF_BLOCKS};

use std::collections::HashMap;
use std::future::Future;
use std::ops::Range;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll};

use parking_lot::RwLock;
use tokio::sync::oneshot;

use crate::error::{PhysicalError, Result};
use crate::identity::BlockIdentity;
use crate::physical::PhysicalLayout;
use crate::storage::{ObjectKey, ObjectPutMode, StorageKind};
use claims::{Claims, JobGuard, Reservation};

/// Index of a block within one layout (same meaning as `kvbm-logical`'s, without depending on
/// it).
pub type BlockId = usize;

/// Names a layout registered with a [`TransferManager`]. Ids are unique in the process (one
/// counter for every manager), so a handle of one manager never names a layout of another: it
/// is [`PhysicalError::UnknownLayout`] there.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct LayoutHandle(u64);

/// The next layout id, shared by every manager of the process.
static NEXT_LAYOUT_ID: AtomicU64 = AtomicU64::new(1);

impl LayoutHandle {
    /// The raw id.
    pub fn as_u64(&self) -> u64 {
        self.0
    }
}

/// Per-transfer options.
#[derive(Debug, Clone, Default)]
pub struct TransferOptions {
    /// Only these layers (layer-wise onboarding). `None`: all layers. Destinations on disk or in
    /// an object store need whole blocks.
    pub layer_range: Option<Range<usize>>,
    /// For a transfer whose source or destination is an object store: one key per block, in
    /// the order of the block id lists (the object side's ids are then just positions).
    pub object_keys: Option<Vec<ObjectKey>>,
    /// How puts treat existing objects. Default: overwrite.
    pub object_put_mode: ObjectPutMode,
    /// One identity per block, in the order of the block id lists: written into the header of
    /// every disk slot and object this transfer writes, and required of every one it reads
    /// (normally the blocks' sequence hashes). `None`: [`BlockIdentity::ANONYMOUS`] for all,
    /// which never matches a block written with an identity.
    pub identities: Option<Vec<BlockIdentity>>,
}

impl TransferOptions {
    /// Options with a layer range.
    pub fn layers(range: Range<usize>) -> Self {
        TransferOptions {
            layer_range: Some(range),
            ..Default::default()
        }
    }
    /// Options with object keys.
    pub fn with_object_keys(keys: Vec<ObjectKey>) -> Self {
        TransferOptions {
            object_keys: Some(keys),
            ..Default::default()
        }
    }
    /// These options with one identity per block.
    pub fn identities(mut self, identities: Vec<BlockIdentity>) -> Self {
        self.identities = Some(identities);
        self
    }
}

/// A strided run of byte copies from one block of a source layout to one block of a
/// destination layout: fragment `i` copies `len` bytes from serialized offset
/// `src_offset + i * src_stride` of `src_block` to `dst_offset + i * dst_stride` of `dst_block`,
/// for `i` in `0..count`. Offsets count the block's serialized bytes (its regions concatenated
/// in `(layer, outer)` order, [`PhysicalLayout::block_addrs`](crate::PhysicalLayout::block_addrs)).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct RangeCopy {
    /// Source block.
    pub src_block: BlockId,
    /// First source byte within the block.
    pub src_offset: usize,
    /// Destination block.
    pub dst_block: BlockId,
    /// First destination byte within the block.
    pub dst_offset: usize,
    /// Bytes per fragment.
    pub len: usize,
    /// Number of fragments.
    pub count: usize,
    /// Source distance between fragments.
    pub src_stride: usize,
    /// Destination distance between fragments.
    pub dst_stride: usize,
}

impl RangeCopy {
    /// One contiguous fragment of `len` bytes.
    pub fn contiguous(
        (src_block, src_offset): (BlockId, usize),
        (dst_block, dst_offset): (BlockId, usize),
        len: usize,
    ) -> Self {
        RangeCopy {
            src_block,
            src_offset,
            dst_block,
            dst_offset,
            len,
            count: 1,
            src_stride: len,
            dst_stride: len,
        }
    }

    /// Bytes this copy moves.
    pub fn bytes(&self) -> u64 {
        self.len as u64 * self.count as u64
    }

    /// One past the last byte touched at `offset` with `stride`, or `None` on overflow.
    fn end(&self, offset: usize, stride: usize) -> Option<usize> {
        (self.count - 1)
            .checked_mul(stride)?
            .checked_add(offset)?
            .checked_add(self.len)
    }
}

/// A validated batch of [`RangeCopy`]s, ready to run.
#[derive(Debug)]
pub(crate) struct CopyJob {
    pub(crate) src: Arc<PhysicalLayout>,
    pub(crate) dst: Arc<PhysicalLayout>,
    pub(crate) copies: Vec<RangeCopy>,
    /// Claims and layout reservations, released when the job is dropped.
    pub(crate) _guard: JobGuard,
}

/// Per-block results of a transfer.
///
/// A failed block's destination bytes are unspecified: a disk read or an object get may have
/// landed some or all of the bytes before verification failed.
#[derive(Debug)]
pub struct TransferOutcome {
    /// `(destination block id, result)` in the order of the request.
    pub blocks: Vec<(BlockId, Result<(), PhysicalError>)>,
}

impl TransferOutcome {
    /// Whether every block arrived.
    pub fn is_complete_success(&self) -> bool {
        self.blocks.iter().all(|(_, r)| r.is_ok())
    }
    /// The failed blocks.
    pub fn failures(&self) -> impl Iterator<Item = (BlockId, &PhysicalError)> {
        self.blocks
            .iter()
            .filter_map(|(id, r)| r.as_ref().err().map(|e| (*id, e)))
    }
}

/// A future resolving to a transfer's [`TransferOutcome`].
///
/// Dropping it does not cancel the transfer.
#[derive(Debug)]
pub struct TransferCompletion {
    rx: oneshot::Receiver<TransferOutcome>,
    dst_ids: Vec<BlockId>,
}

impl TransferCompletion {
    /// A completion fed by `rx` (used by `crate::cuda`'s direct path).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) fn from_parts(
        rx: oneshot::Receiver<TransferOutcome>,
        dst_ids: Vec<BlockId>,
    ) -> Self {
        TransferCompletion { rx, dst_ids }
    }

    /// Blocks the current thread until done. Do not call from async code (await instead).
    pub fn wait(self) -> TransferOutcome {
        let ids = self.dst_ids;
        self.rx.blocking_recv().unwrap_or_else(|_| aborted(&ids))
    }
}

fn aborted(ids: &[BlockId]) -> TransferOutcome {
    TransferOutcome {
        blocks: ids
            .iter()
            .map(|id| {
                (
                    *id,
                    Err(PhysicalError::Aborted(
                        "transfer worker ended without reporting".into(),
                    )),
                )
            })
            .collect(),
    }
}

impl Future for TransferCompletion {
    type Output = TransferOutcome;
    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<TransferOutcome> {
        match Pin::new(&mut self.rx).poll(cx) {
            Poll::Ready(Ok(o)) => Poll::Ready(o),
            Poll::Ready(Err(_)) => Poll::Ready(aborted(&self.dst_ids)),
            Poll::Pending => Poll::Pending,
        }
    }
}

/// Transfer manager settings.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TransferConfig {
    /// Worker threads of the manager's runtime (object I/O). Default: 2.
    #[serde(default = "default_worker_threads")]
    pub worker_threads: usize,
    /// Pinned host bounce buffers the manager keeps for two-hop transfers (at least 1). A
    /// two-hop transfer holds one for its whole run; when all are lent out, further two-hop
    /// transfers wait for one. Allocated on first demand, kept until the manager is dropped.
    /// Default: 4.
    #[serde(default = "default_bounce_buffers")]
    pub bounce_buffers: usize,
    /// Bytes per bounce buffer; a two-hop round stages as many whole blocks as fit. A block
    /// larger than this takes a one-off allocation (logged at debug level). Default: 64 MiB
    /// (32 blocks of 2 MiB).
    #[serde(default = "default_bounce_buffer_bytes")]
    pub bounce_buffer_bytes: usize,
    /// How much nicer than the thread that builds the manager its runtime's threads run (each
    /// lowers its own CPU priority as it starts; threads they start inherit it: io_uring's
    /// kernel workers, a G3 journal compaction a move starts). Moves are background work: at a
    /// positive value they give way to the process's latency-critical threads (an inference
    /// engine's scheduler step) when cores are short, and still run in every idle moment.
    /// 0..=19 (a thread never goes past 19); default 0 (the builder's own priority).
    #[serde(default)]
    pub worker_nice: u8,
}

fn default_worker_threads() -> usize {
    2
}
fn default_bounce_buffers() -> usize {
    4
}
fn default_bounce_buffer_bytes() -> usize {
    64 << 20
}

impl Default for TransferConfig {
    fn default() -> Self {
        TransferConfig {
            worker_threads: default_worker_threads(),
            bounce_buffers: default_bounce_buffers(),
            bounce_buffer_bytes: default_bounce_buffer_bytes(),
            worker_nice: 0,
        }
    }
}

/// The highest niceness Linux gives a thread.
pub const MAX_NICE: u8 = 19;

/// The calling thread's nice value.
fn own_nice() -> std::io::Result<i32> {
    // SAFETY: errno is this thread's; getpriority names the calling thread (0).
    unsafe {
        *libc::__errno_location() = 0;
        let now = libc::getpriority(libc::PRIO_PROCESS, 0);
        if now == -1 && *libc::__errno_location() != 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(now)
    }
}

/// Sets the calling thread's nice value. On Linux the nice value is the thread's own
/// (`setpriority(PRIO_PROCESS, 0, ..)` changes the caller only) and threads it starts inherit
/// it; raising one's own niceness needs no privilege.
fn set_own_nice(nice: i32) -> std::io::Result<()> {
    // SAFETY: setpriority names the calling thread (0).
    if unsafe { libc::setpriority(libc::PRIO_PROCESS, 0, nice) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// A registered layout and the reservation of its memory.
type Registered = (Arc<PhysicalLayout>, Arc<Reservation>);

/// Registers layouts and moves blocks between them. `Send + Sync`; share it as `Arc`.
#[derive(Debug)]
pub struct TransferManager {
    layouts: RwLock<HashMap<u64, Registered>>,
    claims: Arc<Claims>,
    bounce: Arc<bounce::BouncePool>,
    runtime: Option<tokio::runtime::Runtime>,
}

/// A validated transfer, ready to run.
#[derive(Debug, Clone)]
pub(crate) struct Job {
    pub(crate) src: Arc<PhysicalLayout>,
    pub(crate) dst: Arc<PhysicalLayout>,
    pub(crate) src_ids: Vec<BlockId>,
    pub(crate) dst_ids: Vec<BlockId>,
    pub(crate) layers: Range<usize>,
    pub(crate) keys: Option<Arc<Vec<ObjectKey>>>,
    pub(crate) put_mode: ObjectPutMode,
    pub(crate) identities: Option<Arc<Vec<BlockIdentity>>>,
    /// Claims and layout reservations, released when the last clone of the job is dropped.
    pub(crate) _guard: Option<Arc<JobGuard>>,
}

impl Job {
    /// The identity of the block at `pos` in the id lists.
    pub(crate) fn identity(&self, pos: usize) -> BlockIdentity {
        self.identities
            .as_ref()
            .map_or(BlockIdentity::ANONYMOUS, |v| v[pos])
    }
}

impl TransferManager {
    /// A manager with default settings.
    pub fn new() -> Result<Self> {
        Self::with_config(TransferConfig::default())
    }

    /// A manager with `config`.
    ///
    /// # Errors
    /// [`PhysicalError::InvalidArgument`] naming `worker_nice` when it is above [`MAX_NICE`];
    /// [`PhysicalError::Io`] when the runtime cannot start.
    pub fn with_config(config: TransferConfig) -> Result<Self> {
        let by = config.worker_nice;
        if by > MAX_NICE {
            return Err(PhysicalError::InvalidArgument(format!(
                "worker_nice must be in 0..={MAX_NICE}, got {by}"
            )));
        }
        // One absolute value for every runtime thread, whichever thread starts it (tokio starts
        // blocking-pool threads from its workers, which would otherwise add `by` twice).
        let nice = match by {
            0 => None,
            _ => Some(
                (own_nice()
                    .map_err(|e| PhysicalError::io("read the thread's priority", None, e))?
                    + i32::from(by))
                .min(i32::from(MAX_NICE)),
            ),
        };
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(config.worker_threads.max(1))
            .thread_name("kvbm-transfer")
            .on_thread_start(move || {
                if let Some(nice) = nice
                    && let Err(e) = set_own_nice(nice)
                {
                    // The thread still works, at its starter's priority: worth a line, not a
                    // failed move.
                    tracing::warn!(error = %e, nice, "transfer thread keeps its priority");
                }
            })
            .enable_all()
            .build()
            .map_err(|e| PhysicalError::io("start transfer runtime", None, e))?;
        Ok(TransferManager {
            layouts: RwLock::new(HashMap::new()),
            claims: Arc::default(),
            bounce: Arc::new(bounce::BouncePool::new(
                config.bounce_buffers,
                config.bounce_buffer_bytes,
            )),
            runtime: Some(runtime),
        })
    }

    /// Registers a layout; the handle names it in transfers.
    ///
    /// # Errors
    /// [`PhysicalError::AliasedLayout`] when its memory (or disk storage) overlaps a layout
    /// still registered with any manager of this process.
    pub fn register_layout(&self, layout: PhysicalLayout) -> Result<LayoutHandle, PhysicalError> {
        let layout = Arc::new(layout);
        let reservation = Reservation::reserve(&layout)?;
        let id = NEXT_LAYOUT_ID.fetch_add(1, Ordering::Relaxed);
        self.layouts
            .write()
            .insert(id, (layout, Arc::new(reservation)));
        Ok(LayoutHandle(id))
    }

    /// The layout behind `handle`.
    pub fn layout(&self, handle: LayoutHandle) -> Result<Arc<PhysicalLayout>> {
        self.entry(handle).map(|(l, _)| l)
    }

    fn entry(&self, handle: LayoutHandle) -> Result<Registered> {
        self.layouts
            .read()
            .get(&handle.0)
            .cloned()
            .ok_or(PhysicalError::UnknownLayout(handle))
    }

    /// Runs `io` on the manager's runtime (where object I/O has its reactor) and returns its
    /// handle, which any executor may await: for the small reads a mover makes before it
    /// issues a transfer (e.g. an object's header), from a future that may be polled anywhere.
    pub fn spawn_io<F>(&self, io: F) -> tokio::task::JoinHandle<F::Output>
    where
        F: std::future::Future + Send + 'static,
        F::Output: Send + 'static,
    {
        self.runtime
            .as_ref()
            .expect("runtime lives until drop")
            .spawn(io)
    }

    /// Runs `work`, CPU-bound work that belongs with a transfer (e.g. checksumming what a move
    /// writes), on the manager's runtime's blocking pool, off the runtime's I/O workers and off
    /// the caller's thread; returns its handle, which any executor may await.
    pub fn spawn_blocking<F, R>(&self, work: F) -> tokio::task::JoinHandle<R>
    where
        F: FnOnce() -> R + Send + 'static,
        R: Send + 'static,
    {
        self.runtime
            .as_ref()
            .expect("runtime lives until drop")
            .spawn_blocking(work)
    }

    /// Counters of the bounce-buffer pool behind two-hop transfers (allocations, reuses,
    /// waits, one-off allocations).
    pub fn bounce_stats(&self) -> BouncePoolStats {
        self.bounce.stats()
    }

    /// Forgets a layout; transfers already started keep it alive until they finish.
    pub fn unregister_layout(&self, handle: LayoutHandle) -> Result<()> {
        self.layouts
            .write()
            .remove(&handle.0)
            .map(|_| ())
            .ok_or(PhysicalError::UnknownLayout(handle))
    }

    /// Copies `src_block_ids[i]` of `src` into `dst_block_ids[i]` of `dst` for every `i`.
    ///
    /// Errors returned here are argument errors and nothing started: mismatched lists, a block
    /// out of range, a destination listed twice, a chained copy (a block both read and written),
    /// or a block busy in another in-flight transfer ([`PhysicalError::BlockBusy`]; see the
    /// [module docs](self#why-transfers-cannot-race-each-other)). Per-block failures come back
    /// in the [`TransferOutcome`].
    ///
    /// # Safety
    ///
    /// Transfers are checked against each other (aliasing, chained copies, claims), not against
    /// memory reached outside the manager. For the whole transfer (until its outcome is
    /// delivered) the caller guarantees that:
    /// * no reference or pointer obtained outside the manager (through
    ///   [`PhysicalLayout::block_addrs`](crate::PhysicalLayout::block_addrs),
    ///   `HostStorage::as_slice`, or a safe view built on them, such as a slot table's chunk
    ///   accessor) reads or writes a destination block, or writes a source block;
    /// * every destination block is exclusively this transfer's to write: no owner (a block
    ///   registered in a `kvbm-logical` manager, a G1 slot in use) expects its content to stay.
    pub unsafe fn execute_transfer(
        &self,
        src: LayoutHandle,
        src_block_ids: &[BlockId],
        dst: LayoutHandle,
        dst_block_ids: &[BlockId],
        options: TransferOptions,
    ) -> Result<TransferCompletion, PhysicalError> {
        let job = self.validate(src, src_block_ids, dst, dst_block_ids, options)?;
        // Real GPU memory: submitted here, completed by the CUDA event thread (`cuda`).
        #[cfg(feature = "cuda")]
        let job = match cuda::try_direct(job) {
            Ok(completion) => return Ok(completion),
            Err(job) => job,
        };
        let (tx, rx) = oneshot::channel();
        let dst_ids = dst_block_ids.to_vec();
        let runtime = self.runtime.as_ref().expect("runtime lives until drop");
        let bounce = Arc::clone(&self.bounce);
        runtime.spawn(async move {
            let blocks = strategy::run(job, bounce).await;
            let _ = tx.send(TransferOutcome { blocks });
        });
        Ok(TransferCompletion { rx, dst_ids })
    }

    /// Runs a host-to-host transfer on the calling thread and returns its outcome: the same
    /// validation and claims as [`execute_transfer`](Self::execute_transfer) (no aliasing, no
    /// chained copy, [`PhysicalError::BlockBusy`] against transfers in flight), then a `memcpy`
    /// per region here, without the round trip through the manager's runtime. The claims are
    /// released before it returns.
    ///
    /// Meant for small batches between host layouts (onboarding a request's blocks into a host
    /// G1 stand-in, G2 → G1), where the hop to a runtime thread and back costs more than the
    /// copy. It blocks the caller for the copy, so prefer [`execute_transfer`](Self::execute_transfer)
    /// for large batches inside async code.
    ///
    /// # Errors
    /// As [`execute_transfer`](Self::execute_transfer), and [`PhysicalError::NotSupported`]
    /// (nothing claimed) when either side is not host memory.
    ///
    /// # Safety
    ///
    /// As [`execute_transfer`](Self::execute_transfer) (for the duration of the call).
    pub unsafe fn execute_transfer_inline(
        &self,
        src: LayoutHandle,
        src_block_ids: &[BlockId],
        dst: LayoutHandle,
        dst_block_ids: &[BlockId],
        options: TransferOptions,
    ) -> Result<TransferOutcome, PhysicalError> {
        for h in [src, dst] {
            let kind = self.entry(h)?.0.storage_kind();
            if kind != StorageKind::Host {
                return Err(PhysicalError::NotSupported(format!(
                    "inline transfers are host to host; layout {} is {kind:?}",
                    h.as_u64()
                )));
            }
        }
        let job = self.validate(src, src_block_ids, dst, dst_block_ids, options)?;
        let results = strategy::copy_memory(&job);
        // Dropping the job releases its claims and reservations.
        let blocks = job.dst_ids.iter().copied().zip(results).collect();
        drop(job);
        Ok(TransferOutcome { blocks })
    }

    /// Runs `copies` (each a strided run of fragments from a block of `src` to a block of `dst`,
    /// see [`RangeCopy`]) on the manager's runtime, in order; the outcome has one entry per copy
    /// (its destination block). Both layouts must be memory (host or device).
    ///
    /// Errors returned here are argument errors and nothing started: an unknown layout, a side
    /// that is not memory ([`PhysicalError::NotSupported`]), `src == dst`, an empty copy, a block
    /// out of range, a fragment outside its block, or a block busy in another in-flight transfer
    /// ([`PhysicalError::BlockBusy`]: every source block is claimed shared, every destination
    /// block exclusive, all or none). Copies whose destinations overlap run in order (the later
    /// wins).
    ///
    /// # Safety
    ///
    /// As [`execute_transfer`](Self::execute_transfer), for every block a copy reads or writes.
    pub unsafe fn execute_copies(
        &self,
        src: LayoutHandle,
        dst: LayoutHandle,
        copies: Vec<RangeCopy>,
    ) -> Result<TransferCompletion, PhysicalError> {
        let job = self.validate_copies(src, dst, copies)?;
        // Real GPU memory: batched, submitted here, completed by the CUDA event thread.
        #[cfg(feature = "cuda")]
        let job = match cuda::try_direct_copies(job) {
            Ok(completion) => return Ok(completion),
            Err(job) => job,
        };
        let (tx, rx) = oneshot::channel();
        let dst_ids: Vec<BlockId> = job.copies.iter().map(|c| c.dst_block).collect();
        let runtime = self.runtime.as_ref().expect("runtime lives until drop");
        let ids = dst_ids.clone();
        runtime.spawn(async move {
            let results =
                match tokio::task::spawn_blocking(move || strategy::copy_ranges(&job)).await {
                    Ok(r) => r,
                    Err(e) => {
                        let msg = format!("copy task failed: {e}");
                        (0..ids.len())
                            .map(|_| Err(PhysicalError::Aborted(msg.clone())))
                            .collect()
                    }
                };
            let blocks = ids.into_iter().zip(results).collect();
            let _ = tx.send(TransferOutcome { blocks });
        });
        Ok(TransferCompletion { rx, dst_ids })
    }

    /// [`execute_copies`](Self::execute_copies) on the calling thread (as
    /// [`execute_transfer_inline`](Self::execute_transfer_inline) is to
    /// [`execute_transfer`](Self::execute_transfer)); the claims are released before it returns.
    ///
    /// # Errors
    /// As [`execute_copies`](Self::execute_copies).
    ///
    /// # Safety
    ///
    /// As [`execute_copies`](Self::execute_copies) (for the duration of the call).
    pub unsafe fn execute_copies_inline(
        &self,
        src: LayoutHandle,
        dst: LayoutHandle,
        copies: Vec<RangeCopy>,
    ) -> Result<TransferOutcome, PhysicalError> {
        let job = self.validate_copies(src, dst, copies)?;
        let results = strategy::copy_ranges(&job);
        let blocks = job
            .copies
            .iter()
            .map(|c| c.dst_block)
            .zip(results)
            .collect();
        drop(job);
        Ok(TransferOutcome { blocks })
    }

    fn validate_copies(
        &self,
        src_h: LayoutHandle,
        dst_h: LayoutHandle,
        copies: Vec<RangeCopy>,
    ) -> Result<CopyJob> {
        let (src, src_res) = self.entry(src_h)?;
        let (dst, dst_res) = self.entry(dst_h)?;
        if src_h == dst_h {
            return Err(PhysicalError::InvalidArgument(
                "range copies run between two layouts (source and destination are one)".into(),
            ));
        }
        for (side, l) in [("source", &src), ("destination", &dst)] {
            if !l.is_memory() {
                return Err(PhysicalError::NotSupported(format!(
                    "range copies need memory on both sides; the {side} is {:?}",
                    l.storage_kind()
                )));
            }
        }
        let (sc, dc) = (*src.layout().config(), *dst.layout().config());
        let (mut src_ids, mut dst_ids) = (Vec::new(), Vec::new());
        for (i, c) in copies.iter().enumerate() {
            if c.len == 0 || c.count == 0 {
                return Err(PhysicalError::InvalidArgument(format!(
                    "range copy {i} is empty ({} fragments of {} bytes)",
                    c.count, c.len
                )));
            }
            for (side, block, offset, stride, cfg, ids) in [
                (
                    "source",
                    c.src_block,
                    c.src_offset,
                    c.src_stride,
                    &sc,
                    &mut src_ids,
                ),
                (
                    "destination",
                    c.dst_block,
                    c.dst_offset,
                    c.dst_stride,
                    &dc,
                    &mut dst_ids,
                ),
            ] {
                if block >= cfg.num_blocks {
                    return Err(PhysicalError::BlockOutOfRange {
                        block_id: block,
                        num_blocks: cfg.num_blocks,
                    });
                }
                match c.end(offset, stride) {
                    Some(end) if end <= cfg.block_bytes() => {}
                    _ => {
                        return Err(PhysicalError::InvalidArgument(format!(
                            "range copy {i}: {side} fragments (offset {offset}, stride {stride}, {} x {} bytes) leave block {block} of {} bytes",
                            c.count,
                            c.len,
                            cfg.block_bytes()
                        )));
                    }
                }
                ids.push(block);
            }
        }
        for ids in [&mut src_ids, &mut dst_ids] {
            ids.sort_unstable();
            ids.dedup();
        }
        let claims = self.claims.claim([
            (src_h, &src_ids, false, false),
            (dst_h, &dst_ids, true, false),
        ])?;
        Ok(CopyJob {
            src,
            dst,
            copies,
            _guard: JobGuard::new(claims, [src_res, dst_res]),
        })
    }

    fn validate(
        &self,
        src_h: LayoutHandle,
        src_ids: &[BlockId],
        dst_h: LayoutHandle,
        dst_ids: &[BlockId],
        options: TransferOptions,
    ) -> Result<Job> {
        let (src, src_res) = self.entry(src_h)?;
        let (dst, dst_res) = self.entry(dst_h)?;
        if src_ids.len() != dst_ids.len() {
            return Err(PhysicalError::InvalidArgument(format!(
                "{} source ids but {} destination ids",
                src_ids.len(),
                dst_ids.len()
            )));
        }
        let (sc, dc) = (src.layout().config(), dst.layout().config());
        if !sc.same_block_geometry(dc) {
            return Err(PhysicalError::IncompatibleLayouts(format!(
                "source {sc:?} vs destination {dc:?}"
            )));
        }
        let (sk, dk) = (src.storage_kind(), dst.storage_kind());
        for (ids, layout, kind) in [(src_ids, &src, sk), (dst_ids, &dst, dk)] {
            if kind == StorageKind::Object {
                continue; // positions into the key list
            }
            let n = layout.layout().config().num_blocks;
            if let Some(&bad) = ids.iter().find(|&&id| id >= n) {
                return Err(PhysicalError::BlockOutOfRange {
                    block_id: bad,
                    num_blocks: n,
                });
            }
        }
        // hashbrown's hasher, not std's SipHash: block ids are ours, and this runs once per
        // block of every transfer.
        let mut seen = hashbrown::HashSet::with_capacity(dst_ids.len());
        if dk != StorageKind::Object {
            if let Some(dup) = dst_ids.iter().find(|id| !seen.insert(**id)) {
                return Err(PhysicalError::InvalidArgument(format!(
                    "destination block {dup} appears twice"
                )));
            }
            if src_h == dst_h
                && let Some(both) = src_ids.iter().find(|s| seen.contains(*s))
            {
                return Err(PhysicalError::InvalidArgument(format!(
                    "chained copy: block {both} is both read and written by one transfer"
                )));
            }
        }
        let all = 0..sc.num_layers;
        let layers = options.layer_range.clone().unwrap_or(all.clone());
        if layers.start >= layers.end || layers.end > sc.num_layers {
            return Err(PhysicalError::InvalidArgument(format!(
                "layer range {layers:?} outside 0..{}",
                sc.num_layers
            )));
        }
        if layers != all && matches!(dk, StorageKind::Disk | StorageKind::Object) {
            return Err(PhysicalError::InvalidArgument(
                "a partial layer range needs a memory destination (disk slots and objects hold whole blocks)".into(),
            ));
        }
        let object_sides = [sk, dk]
            .iter()
            .filter(|k| **k == StorageKind::Object)
            .count();
        if object_sides == 2 {
            return Err(PhysicalError::NotSupported(
                "object-to-object transfers (copy the objects instead)".into(),
            ));
        }
        let keys = match (object_sides, options.object_keys) {
            (1, Some(keys)) if keys.len() == src_ids.len() => Some(Arc::new(keys)),
            (1, Some(keys)) => {
                return Err(PhysicalError::InvalidArgument(format!(
                    "{} object keys for {} blocks",
                    keys.len(),
                    src_ids.len()
                )));
            }
            (1, None) => {
                return Err(PhysicalError::InvalidArgument(
                    "an object-store side needs options.object_keys".into(),
                ));
            }
            (_, Some(_)) => {
                return Err(PhysicalError::InvalidArgument(
                    "object_keys given but neither side is an object store".into(),
                ));
            }
            (_, None) => None,
        };
        let identities = match options.identities {
            Some(ids) if ids.len() != src_ids.len() => {
                return Err(PhysicalError::InvalidArgument(format!(
                    "{} identities for {} blocks",
                    ids.len(),
                    src_ids.len()
                )));
            }
            ids => ids.map(Arc::new),
        };
        let claims = self.claims.claim([
            (src_h, src_ids, false, sk == StorageKind::Object),
            (dst_h, dst_ids, true, dk == StorageKind::Object),
        ])?;
        Ok(Job {
            src,
            dst,
            src_ids: src_ids.to_vec(),
            dst_ids: dst_ids.to_vec(),
            layers,
            keys,
            put_mode: options.object_put_mode,
            identities,
            _guard: Some(Arc::new(JobGuard::new(claims, [src_res, dst_res]))),
        })
    }
}

impl Drop for TransferManager {
    fn drop(&mut self) {
        // May run inside an async context, where a blocking runtime drop would panic.
        if let Some(rt) = self.runtime.take() {
            rt.shutdown_background();
        }
    }
}
