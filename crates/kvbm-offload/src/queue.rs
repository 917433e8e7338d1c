//! [`CancellableQueue`]: the bounded queue between stages, with active cancellation by sweeping.
//!
//! # Why sweeping
//!
//! A queued container holds resources: strong block references (which keep the source tier from
//! evicting them), pending-set entries (which suppress re-enqueues) and the outstanding guard that
//! a [`CancelConfirmation`](crate::CancelConfirmation) waits on. Letting a cancelled container sit
//! in a queue until a stage happens to pop it would delay confirmation by however long the
//! queue takes to drain (seconds, behind a slow transfer). The [`CancelSweeper`](crate::CancelSweeper)
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

use parking_lot::Mutex;
use tokio::sync::Notify;

/// An item that may hold cancelled work.
pub trait Sweep {
    /// Removes cancelled parts; returns `true` when nothing is left and the item should be removed.
    fn sweep_cancelled(&mut self) -> bool;
}

/// A bounded multi-producer multi-consumer queue that supports active cancellation via sweeping.
pub struct CancellableQueue<T> {
    state: Mutex<State<T>>,
    not_empty: Notify,
    not_full: Notify,
    capacity: usize,
    name: &'static str,
}

struct State<T> {
    items: VecDeque<T>,
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
    pub fn new(name: &'static str, capacity: usize) -> Self {
        Self {
            state: Mutex::new(State {
                items: VecDeque::new(),
                closed: false,
            }),
            not_empty: Notify::new(),
            not_full: Notify::new(),
            capacity: capacity.max(1),
            name,
        }
    }

    /// The queue's name (for logs).
    pub fn name(&self) -> &'static str {
        self.name
    }

    /// Items queued now.
    pub fn len(&self) -> usize {
        self.state.lock().items.len()
    }

    /// Whether nothing is queued.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Maximum items.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Whether the queue is closed.
    pub fn is_closed(&self) -> bool {
        self.state.lock().closed
    }

    /// Pushes without waiting. Errors give the item back: `Full` or `Closed`.
    pub fn try_push(&self, item: T) -> Result<(), PushError<T>> {
        let mut s = self.state.lock();
        if s.closed {
            return Err(PushError::Closed(item));
        }
        if s.items.len() >= self.capacity {
            return Err(PushError::Full(item));
        }
        s.items.push_back(item);
        drop(s);
        self.not_empty.notify_one();
        Ok(())
    }

    /// Pushes, waiting for room. Returns the item if the queue is closed.
    pub async fn push(&self, mut item: T) -> Result<(), T> {
        loop {
            let notified = self.not_full.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            match self.try_push(item) {
                Ok(()) => return Ok(()),
                Err(PushError::Closed(i)) => return Err(i),
                Err(PushError::Full(i)) => item = i,
            }
            notified.await;
        }
    }

    /// Resolves when the queue may have room (or is closed).
    pub async fn space_available(&self) {
        loop {
            let notified = self.not_full.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            {
                let s = self.state.lock();
                if s.closed || s.items.len() < self.capacity {
                    return;
                }
            }
            notified.await;
        }
    }

    /// Pops without waiting.
    pub fn try_pop(&self) -> Option<T> {
        let item = self.state.lock().items.pop_front();
        if item.is_some() {
            self.not_full.notify_one();
        }
        item
    }

    /// Pops, waiting for an item. `None` once the queue is closed and empty.
    pub async fn pop(&self) -> Option<T> {
        loop {
            let notified = self.not_empty.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            {
                let mut s = self.state.lock();
                if let Some(item) = s.items.pop_front() {
                    let more = !s.items.is_empty();
                    drop(s);
                    self.not_full.notify_one();
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
    pub fn close(&self) {
        self.state.lock().closed = true;
        self.not_empty.notify_waiters();
        self.not_full.notify_waiters();
        // Wake a consumer that has not yet registered.
        self.not_empty.notify_one();
    }
}

impl<T: Sweep> CancellableQueue<T> {
    /// Removes cancelled work from every queued item; returns how many items were removed.
    ///
    /// Removed items are dropped after the lock is released.
    pub fn sweep(&self) -> usize {
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
pub enum PushError<T> {
    /// The queue is at capacity.
    Full(T),
    /// The queue is closed.
    Closed(T),
}

/// Anything the [`CancelSweeper`](crate::CancelSweeper) can sweep.
pub trait SweepTarget: Send + Sync {
    /// Sweeps once; returns how many items were removed.
    fn sweep(&self) -> usize;
}

impl<T: Sweep + Send> SweepTarget for CancellableQueue<T> {
    fn sweep(&self) -> usize {
        CancellableQueue::sweep(self)
    }
}
