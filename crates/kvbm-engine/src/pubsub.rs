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

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use kvbm_logical::{BlockEvent, BlockEventKind, EventSink, SequenceHash, TierId};
use parking_lot::Mutex;
use tokio::sync::{broadcast, mpsc};

pub use crate::address::InstanceId;
use crate::runtime::RuntimeHandle;

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
    /// [`EngineError::ShutDown`](crate::EngineError::ShutDown) after shutdown.
    pub fn spawn(
        runtime: &RuntimeHandle,
        instance: InstanceId,
        bus: Arc<dyn EventBus>,
    ) -> crate::Result<Arc<Self>> {
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
    ) -> crate::Result<Arc<Self>> {
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
                metrics::counter!("kvbm_engine_event_batches_dropped_total").increment(1);
            }
        }
    }
}

/// Where blocks live across instances, as their events say: see the [module docs](self).
#[derive(Debug, Default)]
pub struct CrossInstanceIndex {
    entries: Mutex<HashMap<SequenceHash, HashSet<(InstanceId, TierId)>>>,
}

impl CrossInstanceIndex {
    /// An empty index.
    pub fn new() -> Self {
        Self::default()
    }

    /// Applies one message.
    pub fn apply(&self, message: &EventMessage) {
        self.apply_events(message.instance, &message.events);
    }

    /// Applies `events` published by `instance`.
    pub fn apply_events(&self, instance: InstanceId, events: &[BlockEvent]) {
        let mut entries = self.entries.lock();
        for e in events {
            match e.kind {
                BlockEventKind::Stored => {
                    entries
                        .entry(e.hash)
                        .or_default()
                        .insert((instance, e.tier));
                }
                BlockEventKind::Removed => {
                    if let Some(set) = entries.get_mut(&e.hash) {
                        set.remove(&(instance, e.tier));
                        if set.is_empty() {
                            entries.remove(&e.hash);
                        }
                    }
                }
            }
        }
    }

    /// Everything `instance` is said to hold, sorted (e.g. to answer a snapshot request from
    /// this instance's own record).
    pub fn entries_of(&self, instance: InstanceId) -> Vec<(SequenceHash, TierId)> {
        let mut out: Vec<_> = self
            .entries
            .lock()
            .iter()
            .flat_map(|(h, set)| {
                set.iter()
                    .filter(|(i, _)| *i == instance)
                    .map(|(_, t)| (*h, *t))
                    .collect::<Vec<_>>()
            })
            .collect();
        out.sort();
        out
    }

    /// How many (block, tier) locations `instance` is said to hold.
    pub fn count_of(&self, instance: InstanceId) -> usize {
        self.entries
            .lock()
            .values()
            .map(|set| set.iter().filter(|(i, _)| *i == instance).count())
            .sum()
    }

    /// Forgets everything about `instance` (it left or expired); returns how many locations
    /// were dropped.
    pub fn remove_instance(&self, instance: InstanceId) -> usize {
        let mut entries = self.entries.lock();
        let mut dropped = 0;
        entries.retain(|_, set| {
            let before = set.len();
            set.retain(|(i, _)| *i != instance);
            dropped += before - set.len();
            !set.is_empty()
        });
        dropped
    }

    /// Replaces what is known about `instance` with `entries` (a snapshot it answered), in
    /// one step under the lock.
    pub fn replace_instance(&self, instance: InstanceId, entries: &[(SequenceHash, TierId)]) {
        let mut map = self.entries.lock();
        map.retain(|_, set| {
            set.retain(|(i, _)| *i != instance);
            !set.is_empty()
        });
        for (h, t) in entries {
            map.entry(*h).or_default().insert((instance, *t));
        }
    }

    /// The instances the index knows anything about, sorted.
    pub fn instances(&self) -> Vec<InstanceId> {
        let set: HashSet<InstanceId> = self
            .entries
            .lock()
            .values()
            .flat_map(|s| s.iter().map(|(i, _)| *i))
            .collect();
        let mut out: Vec<_> = set.into_iter().collect();
        out.sort();
        out
    }

    /// Where `hash` is said to be.
    pub fn locations(&self, hash: SequenceHash) -> Vec<(InstanceId, TierId)> {
        let mut out: Vec<_> = self
            .entries
            .lock()
            .get(&hash)
            .map(|s| s.iter().copied().collect())
            .unwrap_or_default();
        out.sort();
        out
    }

    /// For each instance other than `except`, how long a prefix of `hashes` it is said to hold
    /// (in any tier); longest first, instances holding nothing omitted.
    pub fn prefix_by_instance(
        &self,
        hashes: &[SequenceHash],
        except: Option<InstanceId>,
    ) -> Vec<(InstanceId, usize)> {
        let entries = self.entries.lock();
        let mut alive: Option<HashSet<InstanceId>> = None;
        let mut lengths: HashMap<InstanceId, usize> = HashMap::new();
        for (i, h) in hashes.iter().enumerate() {
            let here: HashSet<InstanceId> = entries
                .get(h)
                .map(|s| s.iter().map(|(inst, _)| *inst).collect())
                .unwrap_or_default();
            let next: HashSet<InstanceId> = match &alive {
                None => here,
                Some(a) => a.intersection(&here).copied().collect(),
            };
            for inst in &next {
                lengths.insert(*inst, i + 1);
            }
            if next.is_empty() {
                break;
            }
            alive = Some(next);
        }
        let mut out: Vec<_> = lengths
            .into_iter()
            .filter(|(inst, _)| Some(*inst) != except)
            .collect();
        out.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
        out
    }

    /// Number of hashes with at least one location.
    pub fn len(&self) -> usize {
        self.entries.lock().len()
    }

    /// Whether the index knows nothing.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Keeps `index` up to date from `bus` on `runtime` until shutdown. A lagging subscriber
    /// skips what it missed (logged; the index is a hint).
    ///
    /// # Errors
    /// [`EngineError::ShutDown`](crate::EngineError::ShutDown) after shutdown.
    pub fn follow(
        index: Arc<Self>,
        runtime: &RuntimeHandle,
        bus: &dyn EventBus,
    ) -> crate::Result<()> {
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
