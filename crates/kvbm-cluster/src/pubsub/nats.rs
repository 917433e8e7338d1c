//! [`NatsBus`]: the [`EventBus`] over a NATS subject (feature `nats`), so instances in other
//! processes learn where blocks are.
//!
//! # Flow
//!
//! ```text
//!  EventPublisher (bounded, never blocks; drops counted)
//!     | forward task: bus.send(message)
//!     v
//!  NatsBus::send ──try_send──► bounded outbox (full: drop + count,
//!                                 |            kvbm_engine_nats_event_batches_dropped_total)
//!                                 v publish task (may wait while NATS is away)
//!                              NATS subject `events.subject`
//!                                 |
//!                                 v subscribe task (decode, version check)
//!                              local broadcast ──► subscribers (CrossInstanceIndex::follow)
//! ```
//!
//! Publishing never blocks the data path: a block manager only `try_send`s into the
//! [`EventPublisher`](super::EventPublisher)'s queue, and the forward task only `try_send`s
//! into this bus's outbox. Only the publish task waits (on the NATS client), and while it
//! waits, what does not fit is dropped and counted.
//!
//! # Reconnect
//!
//! The client ([`crate::transport::nats::connect`]) reconnects on its own and re-subscribes
//! the subject; batches published while the server is away are either buffered by the client
//! and sent after the reconnect or dropped and counted. The index is a hint, never proof, so a
//! lost batch costs a missed remote match (or a stale one, which the puller must verify), not
//! correctness. The bus itself does not resync after a reconnect; an
//! `instance::Instance` does, by snapshot
//! (`instance::presence`).
//!
//! # Wire
//!
//! JSON of `{ "version": 1, "instance": u64, "events": [BlockEvent...] }`. A message of
//! another version, or one that cannot be decoded, is skipped and counted
//! ([`NatsBus::rejected`]).
//!
//! # Authentication
//!
//! With [`Security::On`] each batch is sealed by the instance's leader credential for the
//! context `kvbm/events/<subject>`. A received batch is applied only if it opens (a member of
//! this namespace, fresh, not replayed; refusals counted by kind in the verifier's
//! [`SecurityStats`](crate::security::SecurityStats)) and its sender is the leader of the
//! instance the batch names ([`Rejection::NotAllowed`] otherwise): no member can publish
//! events under another instance's id, and a non-member none at all. Dropped batches are
//! also counted in [`NatsBus::rejected`]. Off: plain JSON as before.
//!
//! # Locks
//!
//! None; counters are atomics.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use async_nats::Client;
use futures::StreamExt;
use kvbm_logical::BlockEvent;
use serde::{Deserialize, Serialize};
use tokio::sync::{broadcast, mpsc};

use super::{EventBus, EventMessage, InstanceId};
use crate::security::{Rejection, Role, Security};
use kvbm_engine::error::{EngineError, Result};
use kvbm_engine::runtime::RuntimeHandle;

/// Version of the event wire format.
pub const EVENT_WIRE_VERSION: u32 = 1;

#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct WireBatch {
    version: u32,
    instance: u64,
    events: Vec<BlockEvent>,
}

#[derive(Debug, Default)]
struct Counters {
    dropped: AtomicU64,
    sent: AtomicU64,
    send_failed: AtomicU64,
    received: AtomicU64,
    rejected: AtomicU64,
}

/// Block events over NATS: see the [module docs](self).
#[derive(Debug)]
pub struct NatsBus {
    outbox: mpsc::Sender<EventMessage>,
    local: broadcast::Sender<EventMessage>,
    counters: Arc<Counters>,
    subject: String,
}

impl NatsBus {
    /// Publishes on and subscribes to `subject` over `client`, with an outbox of `capacity`
    /// batches (at least 1); the local broadcast to subscribers keeps `capacity` batches per
    /// lagging subscriber. Returns once the subscription is in place, so every message
    /// published after this returns reaches this bus's subscribers. Its tasks run on `runtime`
    /// until shutdown.
    ///
    /// # Errors
    /// [`EngineError::Nats`] when the subscription fails; [`EngineError::ShutDown`] after
    /// shutdown.
    pub async fn start(
        runtime: &RuntimeHandle,
        client: Client,
        subject: impl Into<String>,
        capacity: usize,
    ) -> Result<Arc<Self>> {
        Self::start_until(runtime, runtime.shutdown_token(), client, subject, capacity).await
    }

    /// As [`start_secured`](Self::start_secured) with security off.
    ///
    /// # Errors
    /// As [`start`](Self::start).
    pub async fn start_until(
        runtime: &RuntimeHandle,
        cancel: tokio_util::sync::CancellationToken,
        client: Client,
        subject: impl Into<String>,
        capacity: usize,
    ) -> Result<Arc<Self>> {
        Self::start_secured(
            runtime,
            cancel,
            client,
            subject,
            capacity,
            Arc::new(Security::Off),
        )
        .await
    }

    /// As [`start`](Self::start), its tasks ending when `cancel` is cancelled (e.g. a child
    /// of the runtime's shutdown token owned by one instance), batches sealed and checked
    /// with `security` (see the [module docs](self)).
    ///
    /// # Errors
    /// As [`start`](Self::start).
    pub async fn start_secured(
        runtime: &RuntimeHandle,
        cancel: tokio_util::sync::CancellationToken,
        client: Client,
        subject: impl Into<String>,
        capacity: usize,
        security: Arc<Security>,
    ) -> Result<Arc<Self>> {
        let subject = subject.into();
        let context = format!("kvbm/events/{subject}").into_bytes();
        let stop = cancel;
        let capacity = capacity.max(1);
        let nats_err = |e: &dyn std::fmt::Display| EngineError::Nats {
            url: subject.clone(),
            message: e.to_string(),
        };
        let mut sub = client
            .subscribe(subject.clone())
            .await
            .map_err(|e| nats_err(&e))?;
        client.flush().await.map_err(|e| nats_err(&e))?;
        let (outbox, mut rx) = mpsc::channel::<EventMessage>(capacity);
        let (local, _) = broadcast::channel(capacity);
        let counters = Arc::new(Counters::default());
        let bus = Arc::new(Self {
            outbox,
            local: local.clone(),
            counters: counters.clone(),
            subject: subject.clone(),
        });

        let cancel = stop.clone();
        let (c, pub_subject, pub_counters) = (client.clone(), subject.clone(), counters.clone());
        let (pub_security, pub_context) = (security.clone(), context.clone());
        runtime.spawn(async move {
            loop {
                let m = tokio::select! {
                    () = cancel.cancelled() => return,
                    m = rx.recv() => match m { Some(m) => m, None => return },
                };
                let wire = WireBatch {
                    version: EVENT_WIRE_VERSION,
                    instance: m.instance.0,
                    events: m.events.to_vec(),
                };
                let payload = serde_json::to_vec(&wire).expect("block events serialize");
                let payload = pub_security.seal(&pub_context, &payload);
                // Waits while the client's own buffer is full (e.g. during a reconnect); the
                // outbox in front of it then fills and drops, the data path never waits.
                match c.publish(pub_subject.clone(), payload.into()).await {
                    Ok(()) => pub_counters.sent.fetch_add(1, Ordering::Relaxed),
                    Err(e) => {
                        tracing::warn!(error = %e, "event batch not published");
                        pub_counters.send_failed.fetch_add(1, Ordering::Relaxed)
                    }
                };
            }
        })?;

        let cancel = stop.clone();
        runtime.spawn(async move {
            loop {
                let message = tokio::select! {
                    () = cancel.cancelled() => return,
                    m = sub.next() => match m { Some(m) => m, None => return },
                };
                let (sender, payload) = match security.open(&context, &message.payload) {
                    Ok(o) => o,
                    Err(why) => {
                        tracing::debug!(%why, "event batch that does not open dropped");
                        counters.rejected.fetch_add(1, Ordering::Relaxed);
                        continue;
                    }
                };
                match serde_json::from_slice::<WireBatch>(payload) {
                    Ok(w)
                        if sender.as_ref().is_some_and(|s| {
                            s.role != Role::Leader || s.instance != InstanceId(w.instance)
                        }) =>
                    {
                        // A member speaking for another instance.
                        security.count(Rejection::NotAllowed);
                        tracing::warn!(
                            claimed = %InstanceId(w.instance),
                            sender = ?sender.map(|s| s.to_string()),
                            "event batch under another instance's id dropped"
                        );
                        counters.rejected.fetch_add(1, Ordering::Relaxed);
                    }
                    Ok(w) if w.version == EVENT_WIRE_VERSION => {
                        counters.received.fetch_add(1, Ordering::Relaxed);
                        // No subscriber is not an error.
                        let _ = local.send(EventMessage {
                            instance: InstanceId(w.instance),
                            events: w.events.into(),
                        });
                    }
                    Ok(w) => {
                        tracing::warn!(
                            version = w.version,
                            "event batch of another version skipped"
                        );
                        counters.rejected.fetch_add(1, Ordering::Relaxed);
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "undecodable event batch skipped");
                        counters.rejected.fetch_add(1, Ordering::Relaxed);
                    }
                }
            }
        })?;
        Ok(bus)
    }

    /// The subject.
    pub fn subject(&self) -> &str {
        &self.subject
    }

    /// Batches dropped because the outbox was full.
    pub fn dropped(&self) -> u64 {
        self.counters.dropped.load(Ordering::Relaxed)
    }

    /// Batches handed to the NATS client.
    pub fn sent(&self) -> u64 {
        self.counters.sent.load(Ordering::Relaxed)
    }

    /// Batches the client refused (connection closed, payload over the server's limit).
    pub fn send_failed(&self) -> u64 {
        self.counters.send_failed.load(Ordering::Relaxed)
    }

    /// Batches received from the subject (any instance, this one included).
    pub fn received(&self) -> u64 {
        self.counters.received.load(Ordering::Relaxed)
    }

    /// Received messages skipped as undecodable or of another version, or (security on) that
    /// did not open or came from a member other than the named instance's leader.
    pub fn rejected(&self) -> u64 {
        self.counters.rejected.load(Ordering::Relaxed)
    }
}

impl EventBus for NatsBus {
    fn send(&self, message: EventMessage) {
        if self.outbox.try_send(message).is_err() {
            self.counters.dropped.fetch_add(1, Ordering::Relaxed);
            metrics::counter!(kvbm_engine::metrics::NATS_EVENT_BATCHES_DROPPED).increment(1);
        }
    }

    fn subscribe(&self) -> broadcast::Receiver<EventMessage> {
        self.local.subscribe()
    }
}

/// Decodes `data` as an event batch (the fuzz target's entry, see
/// [`fuzzing`](crate::fuzzing)).
#[doc(hidden)]
pub(crate) fn fuzz_decode(data: &[u8]) {
    let _ = serde_json::from_slice::<WireBatch>(data);
}
