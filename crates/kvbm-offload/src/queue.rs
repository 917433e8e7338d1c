//! [`CancellableQueue`]: the bounded queue between stages, with active cancellation by sweeping.
//!
//! # Why sweeping
//!
//! A queued container holds resources: strong block references (which keep the source tier from
//! evicting them), pending-set entries (which suppress re-enqueues) and the outstanding guard that
//! a [`CancelConfirmation`](crate::handle::cancel::CancelConfirmation) waits on. Letting a
//! cancelled container sit in a queue until a stage happens to pop it would delay confirmation
//! by however long the queue takes to drain (seconds, behind a slow transfer). The [`CancelSweeper`](crate::CancelSweeper)
//! instead calls [`CancellableQueue::sweep`] as soon as any token is cancelled (and every
//! `sweep_interval` as a backstop), which removes and drops cancelled items at once.
//!
//! # Invariants and lock order
//!
//! * The internal mutex is held only for O(1) pushes and pops and for the O(n) retain of a sweep.
//!   It is a leaf lock: items removed by a sweep are dropped **after** it is released, because
//!   dropping an item runs guard code (pending set, transfer accounting).
//! * Not lock-free: a short `parking_lot` critical section measured faster than a lock-free
//!   queue that would have to be drained and refilled to remove from the middle.
//! * Capacity bounds the queue (backpressure between stages); `close` wakes every waiter, after
//!   which pushes fail and pops drain what is left.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicUsize, Ordering};

use parking_lot::Mutex;
use tokio::sync::Notify;

/// An item that may hold cancelled work.
pub(crate) trait Sweep {
    /// Removes cancelled parts; returns `true` when nothing is left and the item should be removed.
    fn sweep_cancelled(&mut self) -> bool;
}

/// A bounded multi-producer multi-consumer queue that supports active cancellation via sweeping.
pub(crate) struct CancellableQueue<T> {
    state: Mutex<State<T>>,
    not_empty: Notify,
    not_full: Notify,
    capacity: usize,
    name: &'static str,
    /// The most items ever queued at once (never above `capacity`).
    high_water: AtomicUsize,
    /// Where [`Self::high_water`] is exported, when it is.
    high_water_gauge: Option<metrics::Gauge>,
}

struct State<T> {
    items: VecDeque<T>,
    /// Slots promised to [`Reservation`]s not yet used: they count against the capacity.
    reserved: usize,
    closed: bool,
}

impl<T> std::fmt::Debug for CancellableQueue<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CancellableQueue")
            .field("name", &self.name)
            .field("len", &self.len())
            .field("capacity", &self.capacity)
            .finish()
    }
}

impl<T> CancellableQueue<T> {
    /// A queue holding at most `capacity` items (at least 1).
    pub(crate) fn new(name: &'static str, capacity: usize) -> Self {
        Self {
            state: Mutex::new(State {
                items: VecDeque::new(),
                reserved: 0,
                closed: false,
            }),
            not_empty: Notify::new(),
            not_full: Notify::new(),
            capacity: capacity.max(1),
            name,
            high_water: AtomicUsize::new(0),
            high_water_gauge: None,
        }
    }

    /// Exports the queue's high-water mark to `gauge` (set whenever it rises).
    pub(crate) fn with_high_water_gauge(mut self, gauge: metrics::Gauge) -> Self {
        self.high_water_gauge = Some(gauge);
        self
    }

    /// The most items it ever held at once (exported through the gauge; read here by tests).
    #[cfg(test)]
    pub(crate) fn high_water(&self) -> usize {
        self.high_water.load(Ordering::Relaxed)
    }

    /// Records that `n` items are queued (called after the lock is released: the gauge is
    /// recorder code).
    fn note_len(&self, n: usize) {
        if n > self.high_water.fetch_max(n, Ordering::Relaxed)
            && let Some(g) = &self.high_water_gauge
        {
            g.set(n as f64);
        }
    }

    /// Items queued now.
    pub(crate) fn len(&self) -> usize {
        self.state.lock().items.len()
    }

    /// Pushes without waiting. Errors give the item back: `Full` or `Closed`.
    pub(crate) fn try_push(&self, item: T) -> Result<(), PushError<T>> {
        let mut s = self.state.lock();
        if s.closed {
            return Err(PushError::Closed(item));
        }
        if s.items.len() + s.reserved >= self.capacity {
            return Err(PushError::Full(item));
        }
        s.items.push_back(item);
        let n = s.items.len();
        drop(s);
        self.note_len(n);
        self.not_empty.notify_one();
        Ok(())
    }

    /// Reserves a slot without waiting: refused when the queue is full or closed. The slot is
    /// returned when the reservation is used or dropped.
    pub(crate) fn try_reserve(&self) -> Result<Reservation<'_, T>, Refused> {
        let mut s = self.state.lock();
        if s.closed {
            return Err(Refused::Closed);
        }
        if s.items.len() + s.reserved >= self.capacity {
            return Err(Refused::Full);
        }
        s.reserved += 1;
        Ok(Reservation { queue: self })
    }

    /// Reserves a slot, waiting for room; `Err` once the queue is closed.
    pub(crate) async fn reserve(&self) -> Result<Reservation<'_, T>, Refused> {
        loop {
            let notified = self.not_full.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            match self.try_reserve() {
                Err(Refused::Full) => {}
                r => return r,
            }
            notified.await;
        }
    }

    /// Resolves when the queue may have room (or is closed).
    pub(crate) async fn space_available(&self) {
        loop {
            let notified = self.not_full.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            {
                let s = self.state.lock();
                if s.closed || s.items.len() + s.reserved < self.capacity {
                    return;
                }
            }
            notified.await;
        }
    }

    /// Pops without waiting.
    pub(crate) fn try_pop(&self) -> Option<T> {
        let item = self.state.lock().items.pop_front();
        if item.is_some() {
            self.not_full.notify_waiters();
        }
        item
    }

    /// Pops, waiting for an item. `None` once the queue is closed and empty.
    pub(crate) async fn pop(&self) -> Option<T> {
        loop {
            let notified = self.not_empty.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            {
                let mut s = self.state.lock();
                if let Some(item) = s.items.pop_front() {
                    let more = !s.items.is_empty();
                    drop(s);
                    // Every waiter re-checks: a stage's outbox and enqueuers wait on the same
                    // signal, and a wake-up given to one that no longer needs room must not be lost.
                    self.not_full.notify_waiters();
                    if more {
                        // Another consumer may be waiting; pass the wake-up on.
                        self.not_empty.notify_one();
                    }
                    return Some(item);
                }
                if s.closed {
                    return None;
                }
            }
            notified.await;
        }
    }

    /// Closes the queue: pushes fail from now on, pops drain what is left and then return `None`.
    pub(crate) fn close(&self) {
        self.state.lock().closed = true;
        self.not_empty.notify_waiters();
        self.not_full.notify_waiters();
        // Wake a consumer that has not yet registered.
        self.not_empty.notify_one();
    }
}

impl<T> CancellableQueue<T> {
    /// Closes the queue and drops everything in it (after releasing the lock): the teardown of a
    /// failed pipeline. Returns how many items were dropped.
    pub(crate) fn close_and_drain(&self) -> usize {
        let items = {
            let mut s = self.state.lock();
            s.closed = true;
            std::mem::take(&mut s.items)
        };
        let n = items.len();
        self.not_empty.notify_waiters();
        self.not_full.notify_waiters();
        self.not_empty.notify_one();
        drop(items);
        n
    }
}

/// A slot reserved in a [`CancellableQueue`]: pushing into it cannot fail for lack of room.
pub(crate) struct Reservation<'a, T> {
    queue: &'a CancellableQueue<T>,
}

impl<T> Reservation<'_, T> {
    /// Pushes into the reserved slot; gives the item back if the queue was closed meanwhile.
    pub(crate) fn push(self, item: T) -> Result<(), T> {
        let q = self.queue;
        let mut s = q.state.lock();
        s.reserved -= 1;
        std::mem::forget(self);
        if s.closed {
            drop(s);
            q.not_full.notify_waiters();
            return Err(item);
        }
        s.items.push_back(item);
        let n = s.items.len();
        drop(s);
        q.note_len(n);
        q.not_empty.notify_one();
        Ok(())
    }
}

impl<T> Drop for Reservation<'_, T> {
    fn drop(&mut self) {
        self.queue.state.lock().reserved -= 1;
        self.queue.not_full.notify_waiters();
    }
}

/// Why a reservation was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Refused {
    /// At capacity.
    Full,
    /// Closed.
    Closed,
}

impl<T: Sweep> CancellableQueue<T> {
    /// Removes cancelled work from every queued item; returns how many items were removed.
    ///
    /// Removed items are dropped after the lock is released.
    pub(crate) fn sweep(&self) -> usize {
        let mut removed = Vec::new();
        {
            let mut s = self.state.lock();
            if s.items.is_empty() {
                return 0;
            }
            let mut kept = VecDeque::with_capacity(s.items.len());
            for mut item in s.items.drain(..) {
                if item.sweep_cancelled() {
                    removed.push(item);
                } else {
                    kept.push_back(item);
                }
            }
            s.items = kept;
        }
        let n = removed.len();
        drop(removed);
        if n > 0 {
            self.not_full.notify_waiters();
        }
        n
    }
}

/// Why a [`CancellableQueue::try_push`] failed; carries the item back.
#[derive(Debug)]
pub(crate) enum PushError<T> {
    /// The queue is at capacity.
    Full(T),
    /// The queue is closed.
    Closed(T),
}

/// Anything the [`CancelSweeper`](crate::sweep::CancelSweeper) can sweep.
pub(crate) trait SweepTarget: Send + Sync {
    /// Sweeps once; returns how many items were removed.
    fn sweep(&self) -> usize;
    /// Closes and drops everything held (teardown of a failed pipeline).
    fn close_and_drain(&self) -> usize;
}

impl<T: Sweep + Send> SweepTarget for CancellableQueue<T> {
    fn sweep(&self) -> usize {
        CancellableQueue::sweep(self)
    }
    fn close_and_drain(&self) -> usize {
        CancellableQueue::close_and_drain(self)
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::time::Duration;

    use super::*;
    use crate::sweep::{CancelSweeper, SweepSignal};

    #[derive(Debug)]
    struct Flag(bool);
    impl Sweep for Flag {
        fn sweep_cancelled(&mut self) -> bool {
            self.0
        }
    }

    #[tokio::test]
    async fn queue_is_bounded_fifo_and_sweeps_cancelled_items() {
        let q = Arc::new(CancellableQueue::new("t", 3));
        q.try_push(Flag(false)).unwrap();
        q.try_push(Flag(true)).unwrap();
        q.try_push(Flag(false)).unwrap();
        assert!(matches!(q.try_push(Flag(false)), Err(PushError::Full(_))));
        assert!(matches!(q.try_reserve(), Err(Refused::Full)));
        // A pusher waiting for room is woken by a sweep that frees a slot.
        let q2 = q.clone();
        let pusher = tokio::spawn(async move {
            let r = q2.reserve().await.expect("room");
            r.push(Flag(false)).is_ok()
        });
        tokio::task::yield_now().await;
        assert_eq!(q.sweep(), 1);
        assert!(pusher.await.unwrap());
        assert_eq!(q.len(), 3);
        // The high-water mark saw the queue full and never above its bound.
        assert_eq!(q.high_water(), 3);
        q.close();
        assert!(matches!(q.try_push(Flag(false)), Err(PushError::Closed(_))));
        let mut n = 0;
        while q.pop().await.is_some() {
            n += 1;
        }
        assert_eq!(n, 3, "close drains what is left, then pop returns None");
    }

    #[tokio::test]
    async fn a_reservation_holds_its_slot_and_returns_it_when_dropped() {
        let q = CancellableQueue::<Flag>::new("t", 1);
        let r = q.try_reserve().expect("room");
        assert!(matches!(q.try_push(Flag(false)), Err(PushError::Full(_))));
        drop(r);
        q.try_push(Flag(false)).expect("the slot came back");
        assert_eq!(q.close_and_drain(), 1);
        assert!(matches!(q.try_reserve(), Err(Refused::Closed)));
    }

    #[tokio::test(start_paused = true)]
    async fn sweeper_runs_on_signal_and_on_interval() {
        let q = Arc::new(CancellableQueue::new("t", 16));
        let signal = SweepSignal::new();
        let sweeper = CancelSweeper::new(
            vec![q.clone() as Arc<dyn SweepTarget>],
            signal.clone(),
            Duration::from_secs(60),
        );
        let stop = tokio_util::sync::CancellationToken::new();
        let task = tokio::spawn(sweeper.run(stop.clone()));
        tokio::task::yield_now().await;
        q.try_push(Flag(true)).unwrap();
        signal.signal();
        tokio::time::sleep(Duration::from_millis(1)).await;
        assert_eq!(q.len(), 0, "swept on the signal, long before the interval");
        q.try_push(Flag(true)).unwrap();
        tokio::time::sleep(Duration::from_secs(61)).await;
        assert_eq!(q.len(), 0, "swept by the periodic backstop");
        stop.cancel();
        task.await.unwrap();
    }
}
