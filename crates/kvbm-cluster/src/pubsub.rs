//! Block events between instances: a bounded, never-blocking publisher, an in-process bus,
//! and the cross-instance index a subscriber keeps.
//!
//! # Why
//!
//! `kvbm-logical` hands each tier's stored/removed events, in batches, to an
//! [`EventSink`] whose `publish` runs under the manager's publish lock, so it must be quick and
//! must never wait. [`EventPublisher`] is that sink: it stamps the batch with this instance's
//! [`InstanceId`] and `try_send`s it into a bounded queue (`events.channel_capacity`
//! batches); when the queue is full the batch is **dropped and counted**
//! ([`EventPublisher::dropped_batches`] and the `kvbm_engine_event_batches_dropped_total`
//! metric), never waited for: the data path does not block on the event path.
//!
//! ```text
//!  BlockManager<Gx> --publish(batch)--> EventPublisher --try_send--> bounded queue
//!                                        (full: drop + count)           |
//!                                                         forward task  v
//!                                                     EventBus (in-process broadcast)
//!                                                               |  subscribe
//!                                                               v
//!                                                 CrossInstanceIndex: hash -> {(instance, tier)}
//! ```
//!
//! The [`EventBus`] trait is the seam for the transport; [`InProcessBus`] (a tokio broadcast
//! channel) is the in-process implementation; `nats::NatsBus` (feature `nats`) carries the
//! same messages over a NATS subject between processes.
//!
//! # Ordering and loss
//!
//! Batches of one tier arrive in emission order (one queue, one forwarding task, an ordered
//! broadcast). A dropped batch, or a subscriber that lagged behind the broadcast buffer, loses
//! events: the index is a hint of where blocks probably are, never proof. Whoever acts on it
//! must still verify presence (and checksums, for data leaving the process).
//!
//! # Locks
//!
//! The index has one `parking_lot` mutex, taken only inside its own methods; the publisher
//! takes none (the queue is lock-free for `try_send`).

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use kvbm_logical::{BlockEvent, EventSink};
use tokio::sync::{broadcast, mpsc};

use kvbm_engine::InstanceId;
use kvbm_engine::cross_instance::CrossInstanceIndex;
use kvbm_engine::runtime::RuntimeHandle;

/// One published batch: the instance it came from and its events, in emission order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EventMessage {
    /// The publishing instance.
    pub instance: InstanceId,
    /// The events.
    pub events: Arc<[BlockEvent]>,
}

/// Where published batches go: the transport seam.
pub trait EventBus: Send + Sync + 'static {
    /// Delivers `message` to current subscribers. Must not block.
    fn send(&self, message: EventMessage);
    /// A new subscription, receiving what is sent from now on.
    fn subscribe(&self) -> broadcast::Receiver<EventMessage>;
}

/// An in-process bus (a tokio broadcast channel): unit tests, and several instances in one
/// process.
#[derive(Clone, Debug)]
pub struct InProcessBus {
    tx: broadcast::Sender<EventMessage>,
}

impl InProcessBus {
    /// A bus buffering up to `capacity` messages per lagging subscriber (at least 1).
    pub fn new(capacity: usize) -> Self {
        let (tx, _) = broadcast::channel(capacity.max(1));
        Self { tx }
    }
}

impl EventBus for InProcessBus {
    fn send(&self, message: EventMessage) {
        // No subscriber is not an error: nobody is listening yet.
        let _ = self.tx.send(message);
    }
    fn subscribe(&self) -> broadcast::Receiver<EventMessage> {
        self.tx.subscribe()
    }
}

/// The [`EventSink`] of this instance's block managers: see the [module docs](self).
#[derive(Debug)]
pub struct EventPublisher {
    instance: InstanceId,
    tx: mpsc::Sender<EventMessage>,
    dropped: AtomicU64,
    published: AtomicU64,
}

impl EventPublisher {
    /// A publisher for `instance` forwarding into `bus` through a queue of
    /// `config.events.channel_capacity` batches, drained by a task on `runtime` that ends at
    /// shutdown.
    ///
    /// # Errors
    /// [`EngineError::ShutDown`](kvbm_engine::EngineError::ShutDown) after shutdown.
    pub fn spawn(
        runtime: &RuntimeHandle,
        instance: InstanceId,
        bus: Arc<dyn EventBus>,
    ) -> kvbm_engine::Result<Arc<Self>> {
        Self::spawn_until(runtime, runtime.shutdown_token(), instance, bus)
    }

    /// As [`spawn`](Self::spawn), the forward task ending when `cancel` is cancelled (after
    /// forwarding what is already queued).
    ///
    /// # Errors
    /// As [`spawn`](Self::spawn).
    pub fn spawn_until(
        runtime: &RuntimeHandle,
        cancel: tokio_util::sync::CancellationToken,
        instance: InstanceId,
        bus: Arc<dyn EventBus>,
    ) -> kvbm_engine::Result<Arc<Self>> {
        let (publisher, mut rx) =
            Self::with_queue(instance, runtime.config().events.channel_capacity);
        runtime.spawn(async move {
            loop {
                tokio::select! {
                    biased;
                    message = rx.recv() => match message {
                        Some(m) => bus.send(m),
                        None => return,
                    },
                    () = cancel.cancelled() => {
                        // Forward what is already queued, then stop.
                        while let Ok(m) = rx.try_recv() {
                            bus.send(m);
                        }
                        return;
                    }
                }
            }
        })?;
        Ok(publisher)
    }

    /// A publisher and the receiving end of its queue (for a caller that drains it itself).
    pub fn with_queue(
        instance: InstanceId,
        capacity: usize,
    ) -> (Arc<Self>, mpsc::Receiver<EventMessage>) {
        let (tx, rx) = mpsc::channel(capacity.max(1));
        (
            Arc::new(Self {
                instance,
                tx,
                dropped: AtomicU64::new(0),
                published: AtomicU64::new(0),
            }),
            rx,
        )
    }

    /// This instance.
    pub fn instance(&self) -> InstanceId {
        self.instance
    }

    /// Batches dropped because the queue was full (or its consumer gone).
    pub fn dropped_batches(&self) -> u64 {
        self.dropped.load(Ordering::Relaxed)
    }

    /// Batches queued.
    pub fn published_batches(&self) -> u64 {
        self.published.load(Ordering::Relaxed)
    }
}

impl EventSink for EventPublisher {
    fn publish(&self, batch: Vec<BlockEvent>) {
        let message = EventMessage {
            instance: self.instance,
            events: batch.into(),
        };
        match self.tx.try_send(message) {
            Ok(()) => {
                self.published.fetch_add(1, Ordering::Relaxed);
            }
            Err(_) => {
                self.dropped.fetch_add(1, Ordering::Relaxed);
                metrics::counter!(kvbm_engine::metrics::EVENT_BATCHES_DROPPED).increment(1);
            }
        }
    }
}

/// How the core's [`CrossInstanceIndex`] is kept from the cluster's event messages (the index
/// is the core's seam; the messages and the bus are this plane's).
pub trait IndexEvents {
    /// Applies one message.
    fn apply(&self, message: &EventMessage);

    /// Keeps `index` up to date from `bus` on `runtime` until shutdown. A lagging subscriber
    /// skips what it missed (logged; the index is a hint).
    ///
    /// # Errors
    /// [`EngineError::ShutDown`](kvbm_engine::EngineError::ShutDown) after shutdown.
    fn follow(
        index: Arc<Self>,
        runtime: &RuntimeHandle,
        bus: &dyn EventBus,
    ) -> kvbm_engine::Result<()>;
}

impl IndexEvents for CrossInstanceIndex {
    fn apply(&self, message: &EventMessage) {
        self.apply_events(message.instance, &message.events);
    }

    fn follow(
        index: Arc<Self>,
        runtime: &RuntimeHandle,
        bus: &dyn EventBus,
    ) -> kvbm_engine::Result<()> {
        let mut rx = bus.subscribe();
        let cancel = runtime.shutdown_token();
        runtime.spawn(async move {
            loop {
                tokio::select! {
                    () = cancel.cancelled() => return,
                    message = rx.recv() => match message {
                        Ok(m) => index.apply(&m),
                        Err(broadcast::error::RecvError::Lagged(n)) => {
                            tracing::warn!(missed = n, "cross-instance index lagged; events lost");
                        }
                        Err(broadcast::error::RecvError::Closed) => return,
                    },
                }
            }
        })?;
        Ok(())
    }
}

#[cfg(feature = "nats")]
pub mod nats;

#[cfg(test)]
mod tests;
