//! Cancellation: tokens, outstanding-work accounting and confirmation.
//!
//! # Why a token of our own
//!
//! A plain `tokio_util` token says "stop"; it cannot say "everything you asked me to stop has
//! stopped". The offload pipeline has to answer the second question: a caller that cancels a
//! transfer usually wants to free or reuse the source blocks, so [`CancelConfirmation`] resolves
//! only once **every piece of the offload has left the pipeline** — every container dropped, every
//! block reference released, every pending-set entry removed, and any transfer that had already
//! committed (P3) finished.
//!
//! # Invariants
//!
//! * The token is the offload's shared state. A container carries a clone (P2) plus an
//!   `OutstandingGuard`; the guard is the **last** field of everything that holds blocks, so
//!   it is dropped after the blocks it accounts for.
//! * `outstanding` counts live guards. It reaches zero exactly once: no guard is created for a
//!   transfer after its last guard dropped (a guard is only ever cloned from another live one).
//! * When it reaches zero the offload is *drained*: its status becomes terminal, its
//!   settlement slot is released and every waiter (`wait`, confirmation) is woken.
//!
//! # Lock order
//!
//! `progress` (a `parking_lot` mutex inside the shared state) is a leaf lock: nothing else is
//! locked while it is held, and no user code runs under it.

use std::future::{Future, IntoFuture};
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU8, Ordering};

use super::{OffloadId, OffloadShared, OffloadStatus};

/// Token for requesting and tracking cancellation of one transfer.
///
/// Cloning is cheap (one `Arc`). Every clone observes the same request. Containers carry a clone
/// from the [`OffloadHandle`](crate::OffloadHandle) that created them (P2).
#[derive(Clone)]
pub struct CancellationToken {
    pub(crate) shared: Arc<OffloadShared>,
}

impl std::fmt::Debug for CancellationToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CancellationToken")
            .field("id", &self.shared.id)
            .field("cancelled", &self.is_cancelled())
            .field("outstanding", &self.outstanding())
            .finish()
    }
}

impl Default for CancellationToken {
    fn default() -> Self {
        Self::new()
    }
}

impl CancellationToken {
    /// A token not attached to any pipeline (useful for tests and for queues used on their own).
    pub fn new() -> Self {
        Self {
            shared: Arc::new(OffloadShared::detached()),
        }
    }

    /// The transfer this token belongs to.
    pub fn offload_id(&self) -> OffloadId {
        self.shared.id
    }

    /// Requests cancellation. Idempotent. Wakes the pipeline's sweeper so queued containers are
    /// removed at once rather than at the next periodic sweep.
    pub fn cancel(&self) {
        self.shared.request_cancel();
    }

    /// Whether cancellation has been requested.
    #[inline]
    pub fn is_cancelled(&self) -> bool {
        self.shared.cancel.is_cancelled()
    }

    /// Resolves once cancellation is requested (used in `select!`, see P6).
    pub async fn cancelled(&self) {
        self.shared.cancel.cancelled().await
    }

    /// Number of pieces of the offload still inside the pipeline (outstanding guards).
    pub fn outstanding(&self) -> usize {
        self.shared.outstanding.load(Ordering::Acquire)
    }

    /// The state of the cancellation request, `None` while none was made.
    pub fn state(&self) -> Option<CancelState> {
        if !self.is_cancelled() {
            return None;
        }
        Some(match self.outstanding() {
            0 => CancelState::Confirmed,
            n => CancelState::Draining(n),
        })
    }

    /// A guard that keeps the offload from being considered drained while it lives.
    ///
    /// Pipeline-internal; public so custom stages built on [`CancellableQueue`](crate::CancellableQueue)
    /// can account for their own work.
    pub(crate) fn hold(&self) -> OutstandingGuard {
        self.shared.outstanding.fetch_add(1, Ordering::AcqRel);
        OutstandingGuard {
            shared: self.shared.clone(),
        }
    }

    /// Requests cancellation and returns the confirmation future.
    pub fn cancel_and_confirm(&self) -> CancelConfirmation {
        self.cancel();
        CancelConfirmation {
            token: self.clone(),
        }
    }

    /// Resolves once nothing of the offload is outstanding.
    pub(crate) async fn drained(&self) {
        self.shared.drained().await
    }
}

/// Keeps one piece of an offload accounted as outstanding; dropping the last one drains it.
///
/// Held as the last field of containers and resolved batches so that it is released only after
/// the blocks and pending-set entries it accounts for.
pub(crate) struct OutstandingGuard {
    shared: Arc<OffloadShared>,
}

impl OutstandingGuard {
    /// Another guard for the same transfer (a container being split keeps both halves counted).
    pub(crate) fn split(&self) -> OutstandingGuard {
        self.shared.outstanding.fetch_add(1, Ordering::AcqRel);
        OutstandingGuard {
            shared: self.shared.clone(),
        }
    }
}

impl std::fmt::Debug for OutstandingGuard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OutstandingGuard")
            .field("id", &self.shared.id)
            .finish()
    }
}

impl Drop for OutstandingGuard {
    fn drop(&mut self) {
        if self.shared.outstanding.fetch_sub(1, Ordering::AcqRel) == 1 {
            self.shared.on_drained();
        }
    }
}

/// State of a cancellation request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CancelState {
    /// Requested and being drained: this many pieces are still inside the pipeline (queued
    /// containers not yet swept, or an offload that had committed before the request).
    Draining(usize),
    /// Every block is released and nothing is outstanding.
    Confirmed,
}

/// Future that resolves when cancellation is fully confirmed.
///
/// Await it directly (`handle.cancel().await`) or through [`CancelConfirmation::wait`]. It
/// resolves only when every block of the offload is released and no operation on it is
/// outstanding; an offload that had already committed (upgraded, P3) runs to its end first.
#[must_use = "cancellation is requested at once; await this to know it is confirmed"]
pub struct CancelConfirmation {
    token: CancellationToken,
}

impl std::fmt::Debug for CancelConfirmation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CancelConfirmation")
            .field("state", &self.state())
            .finish()
    }
}

impl CancelConfirmation {
    /// Current state of the request (never `None`: cancellation was requested).
    pub fn state(&self) -> CancelState {
        self.token
            .state()
            .unwrap_or(CancelState::Draining(self.token.outstanding()))
    }

    /// Whether it is already confirmed.
    pub fn is_confirmed(&self) -> bool {
        self.state() == CancelState::Confirmed
    }

    /// Waits for confirmation.
    pub async fn wait(self) {
        self.token.drained().await
    }
}

impl IntoFuture for CancelConfirmation {
    type Output = ();
    type IntoFuture = Pin<Box<dyn Future<Output = ()> + Send + 'static>>;

    fn into_future(self) -> Self::IntoFuture {
        Box::pin(self.wait())
    }
}

/// Encodes [`OffloadStatus`] into an atomic.
pub(crate) struct AtomicStatus(AtomicU8);

impl AtomicStatus {
    pub(crate) fn new(s: OffloadStatus) -> Self {
        Self(AtomicU8::new(s as u8))
    }
    pub(crate) fn load(&self) -> OffloadStatus {
        OffloadStatus::from_u8(self.0.load(Ordering::Acquire))
    }
    /// Moves forward only (Evaluating < Queued < Transferring < terminal).
    pub(crate) fn advance(&self, s: OffloadStatus) {
        self.0.fetch_max(s as u8, Ordering::AcqRel);
    }
    pub(crate) fn store(&self, s: OffloadStatus) {
        self.0.store(s as u8, Ordering::Release);
    }
}
