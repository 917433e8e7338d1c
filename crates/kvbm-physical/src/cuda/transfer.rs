//! The transfer manager's strategy for real GPU memory: plan, submit on a copy stream, record
//! an event, and resolve when the completion thread sees it.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use futures::future::BoxFuture;

use super::context::{CudaDevice, Direction};
use super::copy::{plan, submit};
use super::event::EventFuture;
use super::memory::{ordinal_of, register_host};
use crate::error::{PhysicalError, Result};
use crate::layout::{Backing, PhysicalLayout};
use crate::transfer::Job;

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

/// Takes over memory-to-memory transfers with real GPU memory on either side; `None` leaves
/// the job to the generic strategies (stand-in device memory, no GPU side).
pub(crate) fn dispatch(job: &Job) -> Option<BoxFuture<'static, Vec<Result<()>>>> {
    let (so, dor) = (gpu_ordinal(&job.src), gpu_ordinal(&job.dst));
    let ordinal = dor.or(so)?;
    let memory = |l: &PhysicalLayout| matches!(l.backing(), Backing::Host(_) | Backing::Device(_));
    if !memory(&job.src) || !memory(&job.dst) {
        return None;
    }
    let dir = match (so.is_some(), dor.is_some()) {
        (false, true) => Direction::HostToDevice,
        (true, false) => Direction::DeviceToHost,
        _ => Direction::DeviceToDevice,
    };
    let job = job.clone();
    Some(Box::pin(async move {
        let n = job.src_ids.len();
        let r = match start(job, ordinal, dir) {
            Ok(fut) => fut.await,
            Err(e) => Err(e),
        };
        match r {
            Ok(()) => (0..n).map(|_| Ok(())).collect(),
            Err(e) => {
                let msg = e.to_string();
                (0..n)
                    .map(|_| {
                        Err(PhysicalError::Cuda {
                            op: "gpu transfer",
                            message: msg.clone(),
                        })
                    })
                    .collect()
            }
        }
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

/// Plans and enqueues the copies, returning the completion future. If submission fails
/// after some copies were enqueued, waits for the stream before returning the error, so no
/// copy outlives the call's view of the memory.
fn start(job: Job, ordinal: usize, dir: Direction) -> Result<EventFuture> {
    let device = CudaDevice::get(ordinal)?;
    register_layout(&job.src, &device)?;
    register_layout(&job.dst, &device)?;
    let pieces = plan(
        &job.src,
        &job.dst,
        &job.src_ids,
        &job.dst_ids,
        job.layers.clone(),
    );
    device.bind()?;
    let stream = device.stream(dir);
    // SAFETY: the pieces lie in the job's live allocations (kept alive by the job, which the
    // event future holds until completion); the caller of the transfer excludes other access.
    let submitted = unsafe { submit(&pieces, stream) };
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
    let keep: Box<dyn Send> = Box::new(job.clone());
    let fut = unsafe { EventFuture::record(stream, Arc::clone(&device), Some(keep)) };
    match fut {
        Ok(f) => Ok(f),
        Err(e) => {
            // SAFETY: as above; `job` keeps the memory alive until the stream drained.
            let _ = unsafe { cudarc::driver::result::stream::synchronize(stream) };
            drop(job);
            Err(e)
        }
    }
}
