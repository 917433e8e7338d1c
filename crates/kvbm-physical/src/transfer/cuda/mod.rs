//! The transfer manager's strategy for real GPU memory: plan, submit on a copy stream, record
//! an event, and resolve when the completion thread sees it. It lives with the transfer
//! manager (it runs its jobs) and drives `crate::cuda` (the driver: contexts, streams,
//! events, memory), which knows nothing of transfers.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use futures::future::BoxFuture;

use self::copy::{Piece, plan, submit};
use super::{BlockId, CopyJob, Job, TransferCompletion, TransferOutcome};
use crate::cuda::context::{CudaDevice, Direction};
use crate::cuda::event::{Notify, record, watch_notify};
use crate::cuda::memory::{ordinal_of, register_host};
use crate::error::{PhysicalError, Result};
use crate::physical::{Backing, PhysicalLayout};

pub mod copy;

static PIECES: AtomicU64 = AtomicU64::new(0);
static CALLS: AtomicU64 = AtomicU64::new(0);
static TRANSFERS: AtomicU64 = AtomicU64::new(0);

/// Cumulative counters of GPU transfers: `(transfers, copy pieces after coalescing, driver
/// copy calls)`. The benchmark reports deltas.
pub fn copy_stats() -> (u64, u64, u64) {
    (
        TRANSFERS.load(Ordering::Relaxed),
        PIECES.load(Ordering::Relaxed),
        CALLS.load(Ordering::Relaxed),
    )
}

/// The ordinal of a layout backed by real CUDA memory.
fn gpu_ordinal(layout: &PhysicalLayout) -> Option<usize> {
    match layout.backing() {
        Backing::Device(d) => {
            let first = d.first()?;
            if first.is_stand_in() {
                None
            } else {
                ordinal_of(first.device_addr())
            }
        }
        _ => None,
    }
}

/// The device ordinal and copy direction when `job` moves memory to or from real GPU memory;
/// `None` leaves it to the generic strategies (stand-in device memory, no GPU side, disk or
/// object sides).
fn gpu_route(job: &Job) -> Option<(usize, Direction)> {
    route(&job.src, &job.dst)
}

/// [`gpu_route`] for two layouts.
fn route(src: &PhysicalLayout, dst: &PhysicalLayout) -> Option<(usize, Direction)> {
    let (so, dor) = (gpu_ordinal(src), gpu_ordinal(dst));
    let ordinal = dor.or(so)?;
    let memory = |l: &PhysicalLayout| matches!(l.backing(), Backing::Host(_) | Backing::Device(_));
    if !memory(src) || !memory(dst) {
        return None;
    }
    let dir = match (so.is_some(), dor.is_some()) {
        (false, true) => Direction::HostToDevice,
        (true, false) => Direction::DeviceToHost,
        _ => Direction::DeviceToDevice,
    };
    Some((ordinal, dir))
}

fn outcome_blocks(ids: &[BlockId], r: Result<()>) -> Vec<(BlockId, Result<()>)> {
    let msg = r.err().map(|e| e.to_string());
    ids.iter()
        .map(|&id| {
            let r = match &msg {
                None => Ok(()),
                Some(m) => Err(PhysicalError::Cuda {
                    op: "gpu transfer",
                    message: m.clone(),
                }),
            };
            (id, r)
        })
        .collect()
}

/// The transfer manager's fast path: a GPU job is planned and submitted on the calling thread
/// and completed straight from the CUDA event thread into the returned completion (no hop
/// through the manager's runtime). Other jobs come back unchanged.
pub(crate) fn try_direct(job: Job) -> std::result::Result<TransferCompletion, Job> {
    let Some((ordinal, dir)) = gpu_route(&job) else {
        return Err(job);
    };
    let (delivery, completion) = Delivery::new(job.dst_ids.clone());
    if let Err(e) = start(job, ordinal, dir, delivery.notify()) {
        delivery.fail(e);
    }
    Ok(completion)
}

/// Where a fast-path transfer's outcome goes: the completion handed to the caller, fed once,
/// by the event thread ([`notify`](Self::notify)) or by a submission that failed
/// ([`fail`](Self::fail)), whichever comes first.
struct Delivery {
    slot: Arc<parking_lot::Mutex<Option<tokio::sync::oneshot::Sender<TransferOutcome>>>>,
    ids: Vec<BlockId>,
}

impl Delivery {
    /// A delivery for destination blocks `ids`, and the completion it feeds.
    fn new(ids: Vec<BlockId>) -> (Self, TransferCompletion) {
        let (tx, rx) = tokio::sync::oneshot::channel();
        let completion = TransferCompletion::from_parts(rx, ids.clone());
        let slot = Arc::new(parking_lot::Mutex::new(Some(tx)));
        (Delivery { slot, ids }, completion)
    }

    /// The event thread's callback: every block's outcome is the event's.
    fn notify(&self) -> Notify {
        let slot = Arc::clone(&self.slot);
        let ids = self.ids.clone();
        Notify::Callback(Box::new(move |r: Result<()>| send(&slot, &ids, r)))
    }

    /// The submission failed (the event thread will not call): every block fails with `e`.
    fn fail(&self, e: PhysicalError) {
        send(&self.slot, &self.ids, Err(e));
    }
}

/// Sends the outcome of blocks `ids` through `slot` unless it was sent already.
fn send(
    slot: &parking_lot::Mutex<Option<tokio::sync::oneshot::Sender<TransferOutcome>>>,
    ids: &[BlockId],
    r: Result<()>,
) {
    if let Some(tx) = slot.lock().take() {
        let _ = tx.send(TransferOutcome {
            blocks: outcome_blocks(ids, r),
        });
    }
}

/// Range copies (strided fragments, `TransferManager::execute_copies`: the canonical
/// worker's `NHD` fragments) with real GPU memory on a side: every fragment cut into pieces
/// along both blocks' regions, coalesced, submitted in as few calls as the driver allows and
/// completed from the CUDA event thread, as a block transfer is. Jobs without a GPU side, and
/// jobs two of whose fragments write overlapping bytes (their order would matter: the ordered
/// path keeps "the later wins"), come back unchanged.
pub(crate) fn try_direct_copies(job: CopyJob) -> std::result::Result<TransferCompletion, CopyJob> {
    let Some((ordinal, dir)) = route(&job.src, &job.dst) else {
        return Err(job);
    };
    let mut pieces = Vec::new();
    let walked = super::ranges::walk(&job, |_, sr, dr| {
        pieces.extend(
            crate::layout::region_pairs(sr, dr).map(|(s, d, len)| Piece {
                src: s as u64,
                dst: d as u64,
                len,
            }),
        );
        Ok(())
    });
    debug_assert!(walked.iter().all(Result::is_ok), "collecting never fails");
    let pieces = copy::coalesce(pieces);
    if pieces
        .windows(2)
        .any(|w| w[0].dst + w[0].len as u64 > w[1].dst)
    {
        return Err(job);
    }
    let (delivery, completion) = Delivery::new(job.copies.iter().map(|c| c.dst_block).collect());
    let (src, dst) = (Arc::clone(&job.src), Arc::clone(&job.dst));
    let keep: Box<dyn Send> = Box::new(job);
    if let Err(e) = submit_pieces(&pieces, [&src, &dst], keep, ordinal, dir, delivery.notify()) {
        delivery.fail(e);
    }
    Ok(completion)
}

/// The strategy hook (used for GPU steps inside multi-hop transfers): `None` leaves the job
/// to the generic strategies.
pub(crate) fn dispatch(job: &Job) -> Option<BoxFuture<'static, Vec<Result<()>>>> {
    let (ordinal, dir) = gpu_route(job)?;
    let job = job.clone();
    Some(Box::pin(async move {
        let n = job.src_ids.len();
        let (tx, rx) = tokio::sync::oneshot::channel::<Result<()>>();
        let tx = parking_lot::Mutex::new(Some(tx));
        let notify = Notify::Callback(Box::new(move |r| {
            if let Some(tx) = tx.lock().take() {
                let _ = tx.send(r);
            }
        }));
        let r = match start(job, ordinal, dir, notify) {
            Ok(()) => rx
                .await
                .unwrap_or_else(|_| Err(PhysicalError::Aborted("CUDA event thread ended".into()))),
            Err(e) => Err(e),
        };
        let ids: Vec<BlockId> = (0..n).collect();
        outcome_blocks(&ids, r)
            .into_iter()
            .map(|(_, r)| r)
            .collect()
    }))
}

fn register_layout(layout: &PhysicalLayout, device: &Arc<CudaDevice>) -> Result<()> {
    if let Backing::Host(allocs) = layout.backing() {
        for h in allocs {
            register_host(h, device)?;
        }
    }
    Ok(())
}

/// Plans and enqueues the copies of a block transfer and hands the completion event to the
/// event thread, which notifies `notify` (unless this returns an error, in which case `notify`
/// is dropped unnotified).
fn start(job: Job, ordinal: usize, dir: Direction, notify: Notify) -> Result<()> {
    let pieces = plan(
        &job.src,
        &job.dst,
        &job.src_ids,
        &job.dst_ids,
        job.layers.clone(),
    );
    let (src, dst) = (Arc::clone(&job.src), Arc::clone(&job.dst));
    submit_pieces(&pieces, [&src, &dst], Box::new(job), ordinal, dir, notify)
}

/// Enqueues `pieces` (in the memory of `layouts`, registered for DMA first where they are host
/// memory) on device `ordinal`'s stream for `dir`, and hands the completion event to the event
/// thread with `keep` (the job: it holds the layouts, so the memory, and its claims) until the
/// event completed; `notify` hears the outcome. If submission fails after some copies were
/// enqueued, waits for the stream before returning the error (and dropping `keep`), so no copy
/// outlives the job.
fn submit_pieces(
    pieces: &[Piece],
    layouts: [&PhysicalLayout; 2],
    keep: Box<dyn Send>,
    ordinal: usize,
    dir: Direction,
    notify: Notify,
) -> Result<()> {
    let device = CudaDevice::get(ordinal)?;
    for l in layouts {
        register_layout(l, &device)?;
    }
    device.bind()?;
    let stream = device.stream(dir);
    // SAFETY: the pieces lie in the job's live allocations (kept alive by `keep`, which the
    // event thread holds until completion); the caller of the transfer excludes other access.
    let submitted = unsafe { submit(pieces, stream) };
    let calls = match submitted {
        Ok(c) => c,
        Err(e) => {
            // SAFETY: live stream of the current context.
            let _ = unsafe { cudarc::driver::result::stream::synchronize(stream) };
            return Err(e);
        }
    };
    TRANSFERS.fetch_add(1, Ordering::Relaxed);
    PIECES.fetch_add(pieces.len() as u64, Ordering::Relaxed);
    CALLS.fetch_add(calls as u64, Ordering::Relaxed);
    // SAFETY: stream belongs to the current context.
    match unsafe { record(stream) } {
        Ok(ev) => {
            // SAFETY: ev was just recorded and is handed over with the job it guards.
            unsafe { watch_notify(ev, true, device, Some(keep), notify) };
            Ok(())
        }
        Err(e) => {
            // No event to wait on: drain the stream before the job (its memory, its claims)
            // goes, so no copy outlives it.
            // SAFETY: live stream of the current context.
            let _ = unsafe { cudarc::driver::result::stream::synchronize(stream) };
            drop(keep);
            Err(e)
        }
    }
}
