//! CUDA events as futures: one completion thread polls pending events with `cuEventQuery` and
//! wakes their futures.
//!
//! Why a polling thread rather than `cuEventSynchronize` per transfer or `cuLaunchHostFunc`:
//! one thread serves every outstanding event (no thread per transfer), it adds no work to the
//! copy streams, and its latency is bounded by the poll loop: it spins for
//! [`SPIN_WINDOW`] after the last progress, then yields until [`YIELD_WINDOW`], then sleeps
//! [`SLEEP_STEP`] per round. The thread blocks on its channel (no CPU) when nothing is pending.

use std::future::Future;
use std::pin::Pin;
use std::sync::mpsc;
use std::sync::{Arc, OnceLock};
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};

use cudarc::driver::{result, sys};
use parking_lot::Mutex;

use super::context::{CudaDevice, cuda_err};
use crate::error::{PhysicalError, Result};

/// Spin (busy-poll) this long after the last completion or submission.
pub const SPIN_WINDOW: Duration = Duration::from_micros(200);
/// Then `yield_now` between polls until this long.
pub const YIELD_WINDOW: Duration = Duration::from_millis(5);
/// Then sleep this long between polls.
pub const SLEEP_STEP: Duration = Duration::from_micros(50);

#[derive(Debug, Default)]
pub(crate) struct Slot {
    result: Option<Result<()>>,
    waker: Option<Waker>,
}

pub(crate) type SharedSlot = Arc<Mutex<Slot>>;

/// Whom a completed event notifies.
pub(crate) enum Notify {
    /// A future's slot.
    Slot(SharedSlot),
    /// A callback, run on the event thread (keep it short).
    Callback(Box<dyn FnOnce(Result<()>) + Send>),
}

struct Pending {
    event: usize,
    owned: bool,
    device: Arc<CudaDevice>,
    notify: Notify,
    /// Kept alive until the event completed (e.g. the transfer's layouts).
    keep: Option<Box<dyn Send>>,
}

fn poller() -> &'static Mutex<mpsc::Sender<Pending>> {
    static TX: OnceLock<Mutex<mpsc::Sender<Pending>>> = OnceLock::new();
    TX.get_or_init(|| {
        let (tx, rx) = mpsc::channel::<Pending>();
        std::thread::Builder::new()
            .name("kvbm-cuda-events".into())
            .spawn(move || poll_loop(rx))
            .expect("spawning the CUDA event thread");
        Mutex::new(tx)
    })
}

fn finish(p: Pending, r: Result<()>) {
    if p.owned {
        // SAFETY: the event was created by us and is no longer used after completion.
        let _ = unsafe { result::event::destroy(p.event as sys::CUevent) };
    }
    // The work is complete: release what it held (memory, and a transfer's block claims)
    // before anyone learns of it, so a caller reacting to the completion finds the blocks free.
    drop(p.keep);
    match p.notify {
        Notify::Slot(slot) => {
            let waker = {
                let mut s = slot.lock();
                s.result = Some(r);
                s.waker.take()
            };
            if let Some(w) = waker {
                w.wake();
            }
        }
        Notify::Callback(cb) => cb(r),
    }
}

fn poll_loop(rx: mpsc::Receiver<Pending>) {
    let mut pending: Vec<Pending> = Vec::new();
    let mut bound: Option<usize> = None;
    let mut last_progress = Instant::now();
    loop {
        if pending.is_empty() {
            match rx.recv() {
                Ok(p) => pending.push(p),
                Err(_) => return,
            }
            last_progress = Instant::now();
        }
        while let Ok(p) = rx.try_recv() {
            pending.push(p);
            last_progress = Instant::now();
        }
        let mut i = 0;
        let mut progressed = false;
        while i < pending.len() {
            let p = &pending[i];
            if bound != Some(p.device.ordinal()) && p.device.bind().is_ok() {
                bound = Some(p.device.ordinal());
            }
            // SAFETY: the event is alive until `finish` destroys it.
            let r = unsafe { sys::cuEventQuery(p.event as sys::CUevent) };
            if r == sys::CUresult::CUDA_ERROR_NOT_READY {
                i += 1;
                continue;
            }
            let p = pending.swap_remove(i);
            progressed = true;
            finish(p, r.result().map_err(|e| cuda_err("cuEventQuery", e)));
        }
        if progressed {
            last_progress = Instant::now();
        } else if !pending.is_empty() {
            let idle = last_progress.elapsed();
            if idle < SPIN_WINDOW {
                std::hint::spin_loop();
            } else if idle < YIELD_WINDOW {
                std::thread::yield_now();
            } else {
                std::thread::sleep(SLEEP_STEP);
            }
        }
    }
}

/// Hands `event` to the completion thread, which notifies `notify` once it completed and then
/// drops `keep`. With `owned`, the event is destroyed once complete.
///
/// # Safety
/// `event` must be a valid, recorded event of `device`'s context and (unless `owned`) stay
/// alive until `notify` was notified.
pub(crate) unsafe fn watch_notify(
    event: sys::CUevent,
    owned: bool,
    device: Arc<CudaDevice>,
    keep: Option<Box<dyn Send>>,
    notify: Notify,
) {
    let p = Pending {
        event: event as usize,
        owned,
        device,
        notify,
        keep,
    };
    if let Err(mpsc::SendError(p)) = poller().lock().send(p) {
        finish(
            p,
            Err(PhysicalError::Aborted("CUDA event thread ended".into())),
        );
    }
}

/// Records a fresh (timing-free) event on `stream` and hands it to the completion thread.
///
/// # Safety
/// `stream` must be a live stream of `device`'s context, which must be current.
pub(crate) unsafe fn record_notify(
    stream: sys::CUstream,
    device: Arc<CudaDevice>,
    keep: Option<Box<dyn Send>>,
    notify: Notify,
) -> Result<()> {
    // SAFETY: per this function's contract.
    let ev = unsafe { record(stream) }?;
    // SAFETY: ev is recorded and owned.
    unsafe { watch_notify(ev, true, device, keep, notify) };
    Ok(())
}

/// Records a fresh (timing-free) event on `stream`; the caller owns it (hand it to
/// [`watch_notify`] with `owned`, which destroys it once it completed).
///
/// # Safety
/// `stream` must be a live stream of the current context.
pub(crate) unsafe fn record(stream: sys::CUstream) -> Result<sys::CUevent> {
    let ev = result::event::create(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING)
        .map_err(|e| cuda_err("cuEventCreate", e))?;
    // SAFETY: ev just created, stream live per the caller.
    if let Err(e) = unsafe { result::event::record(ev, stream) } {
        // SAFETY: ev is ours and unused.
        let _ = unsafe { result::event::destroy(ev) };
        return Err(cuda_err("cuEventRecord", e));
    }
    Ok(ev)
}

/// A future resolving when a CUDA event completes (`Ok`) or reports an error.
#[must_use = "futures do nothing unless awaited"]
pub struct EventFuture {
    slot: SharedSlot,
}

impl std::fmt::Debug for EventFuture {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("EventFuture")
    }
}

impl EventFuture {
    /// Watches `event` (already recorded). With `owned`, the event is destroyed once complete.
    /// `keep` is dropped only after completion (hold the memory the work touches in it).
    ///
    /// # Safety
    /// As [`watch_notify`].
    pub(crate) unsafe fn watch(
        event: sys::CUevent,
        owned: bool,
        device: Arc<CudaDevice>,
        keep: Option<Box<dyn Send>>,
    ) -> Self {
        let slot: SharedSlot = Arc::default();
        // SAFETY: per the caller.
        unsafe { watch_notify(event, owned, device, keep, Notify::Slot(Arc::clone(&slot))) };
        EventFuture { slot }
    }

    /// Records a fresh event on `stream` and watches it.
    ///
    /// # Safety
    /// As [`record_notify`].
    pub(crate) unsafe fn record(
        stream: sys::CUstream,
        device: Arc<CudaDevice>,
        keep: Option<Box<dyn Send>>,
    ) -> Result<Self> {
        let slot: SharedSlot = Arc::default();
        // SAFETY: per the caller.
        unsafe { record_notify(stream, device, keep, Notify::Slot(Arc::clone(&slot)))? };
        Ok(EventFuture { slot })
    }

    /// Whether it has resolved.
    pub fn is_done(&self) -> bool {
        self.slot.lock().result.is_some()
    }
}

impl Future for EventFuture {
    type Output = Result<()>;
    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Result<()>> {
        let mut s = self.slot.lock();
        match s.result.take() {
            Some(r) => Poll::Ready(r),
            None => {
                match &s.waker {
                    Some(w) if w.will_wake(cx.waker()) => {}
                    _ => s.waker = Some(cx.waker().clone()),
                }
                Poll::Pending
            }
        }
    }
}

/// The offload pipeline's precondition ("the forward pass that wrote these blocks finished"),
/// backed by a CUDA event.
///
/// Make it from the engine's compute stream right after it enqueued the forward pass
/// ([`CudaEventPrecondition::record`]), or from an event the engine recorded itself
/// ([`CudaEventPrecondition::from_event`]). Await it (it resolves on the completion thread, no
/// host-side stream synchronisation), or hand it to a batch of kvbm-offload's pipeline as its
/// precondition (`Precondition::from(pre)`, kvbm-offload's feature `cuda`).
#[derive(Debug)]
#[must_use = "futures do nothing unless awaited"]
pub struct CudaEventPrecondition {
    inner: EventFuture,
}

impl CudaEventPrecondition {
    /// Records a new event on `stream` (a stream of device `ordinal`, e.g. the engine's compute
    /// stream) and resolves when all work enqueued on it so far has completed.
    ///
    /// # Safety
    /// `stream` must be a live stream of device `ordinal`'s primary context (or the null
    /// stream).
    pub unsafe fn record(stream: sys::CUstream, ordinal: usize) -> Result<Self> {
        let device = CudaDevice::get(ordinal)?;
        device.bind()?;
        Ok(CudaEventPrecondition {
            // SAFETY: per the caller.
            inner: unsafe { EventFuture::record(stream, device, None)? },
        })
    }

    /// Watches an event the caller recorded; the caller keeps it alive until this resolves
    /// and destroys it afterwards.
    ///
    /// # Safety
    /// `event` must be a valid, recorded event of device `ordinal`'s primary context.
    pub unsafe fn from_event(event: sys::CUevent, ordinal: usize) -> Result<Self> {
        let device = CudaDevice::get(ordinal)?;
        Ok(CudaEventPrecondition {
            // SAFETY: per the caller.
            inner: unsafe { EventFuture::watch(event, false, device, None) },
        })
    }
}

impl Future for CudaEventPrecondition {
    type Output = Result<()>;
    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Result<()>> {
        Pin::new(&mut self.inner).poll(cx)
    }
}
