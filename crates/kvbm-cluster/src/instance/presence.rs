//! [`Presence`]: who is alive, where their data plane listens, and how the cross-instance index
//! recovers what it missed (feature `nats`).
//!
//! # Protocol
//!
//! ```text
//!  every heartbeat_interval_ms          {subject}.peers
//!    announce task ──publish Heartbeat { peer: PeerInfo, epoch, departing }──► all instances
//!                                                         |
//!    listen task  ◄───────────────────────────────────────┘
//!      new peer / epoch changed: table += peer (synced = false), PeerDirectory += data plane
//!        (a heartbeat naming no data plane: a live peer that serves no G2, e.g. an instance
//!        whose worker ranks are processes; never in the directory, so never pulled from)
//!      departing: expire now
//!
//!  every heartbeat_interval_ms
//!    maintenance task
//!      own client reconnected (epoch went up): every peer synced = false
//!      peer silent > heartbeat_timeout_ms: table -= peer, PeerDirectory -= peer,
//!                                          CrossInstanceIndex -= everything of peer
//!      peer not synced: request {subject}.snapshot.{peer:016x} page by page ──► peer
//!                       answer: the peer's own stored set ──► index.replace_instance(peer, set)
//!
//!    snapshot task ◄── {subject}.snapshot.{this:016x}: answers from this instance's own record
//! ```
//!
//! The `epoch` of a heartbeat is the sender's count of (re)connections to NATS: when it goes up,
//! the sender's client was away and its events of that time may be lost, so receivers resync it;
//! when the receiver's own client reconnects, it resyncs every peer. A peer first seen is
//! resynced too, so a late joiner learns what was stored before it came. The index stays a hint
//! (what moves is verified by its reader), so a snapshot racing an event costs at most a stale or
//! missed entry until the next resync or event.
//!
//! The pages of one fetch are cut from one copy of the set taken at its first page (at most
//! [`SNAPSHOT_COPIES`] copies kept, each for 4 request timeouts; a fetch whose copy is gone
//! fails and is retried). Snapshot answers are pages of at most [`SNAPSHOT_PAGE`] entries, each far below NATS' default
//! payload limit. Heartbeats and answers are published from their own tasks; nothing on the
//! data path waits for them.
//!
//! Heartbeats also carry how many locations the sender stores. Events dropped while both sides
//! stay connected (a full outbox) change no epoch; they show as a difference between that
//! count and what the index holds for the peer. Checked only once the count held still for
//! [`DRIFT_REPEATS`] heartbeats (so events in flight are not mistaken for loss; a peer that
//! never pauses is checked when it does), a difference resyncs the peer.
//!
//! A snapshot may be older than events that arrive while it is fetched: those events are
//! logged (at most [`FETCH_LOG_CAP`] batches; beyond, the peer is resynced again) and replayed
//! over the snapshot in one step with it, so neither an event nor the snapshot undoes the other.
//!
//! A peer that expired (or said it leaves) is *departed*: its event batches still in flight are
//! ignored (counted) until it is heard from again, when it is resynced like a new peer; so a
//! late event cannot put a dead peer back into the index. A subscriber that lagged behind the
//! bus marks every peer for resync.
//!
//! # Bounds
//!
//! * A snapshot fetch reads at most [`PresenceConfig::max_pages`] pages
//!   (`transport.snapshot_max_pages`, default 4096) and accepts at most
//!   [`PresenceConfig::max_entries`] entries (`transport.snapshot_max_entries`, default
//!   4 Mi); a peer answering more is refused, nothing of its answer applied
//!   ([`PresenceStats::snapshots_over_limit`]), and retried at the next tick.
//! * A snapshot request whose `offset` would overflow the page's end is rejected
//!   ([`PresenceStats::rejected`]); the answering task keeps serving.
//! * Event batches of an instance that is not live (never heard by heartbeat, or expired) are
//!   not applied ([`PresenceStats::unjoined_event_batches`]), so the index holds entries only of
//!   live peers (and of this instance); a peer that joins later is resynced from its snapshot.
//! * The departed set forgets entries after [`DEPARTED_HORIZON`] timeouts; the fetch log keeps
//!   at most [`FETCH_LOG_CAP`] batches per peer; the answerer at most [`SNAPSHOT_COPIES`] copies.
//! * The answerer makes at most [`SNAPSHOT_COPIES`] full copies (a series' first page copies
//!   this instance's whole set) per `request_timeout`, and at most one of them for each sealed
//!   requester (the instance its certificate names): a first-page request past either is not
//!   answered ([`PresenceStats::snapshots_throttled`]), so a flood of them costs one decode
//!   each, not a copy of the set each, and one member cannot take the copies everyone's resync
//!   needs. (Unsealed requests, where security is off, name nobody that can be told apart:
//!   they share the overall limit.) The requester's fetch times out and is retried at its next
//!   tick, which also spreads a cluster-wide resync (after a NATS outage) over time.
//!
//! Metrics: `kvbm_engine_index_drift_detected_total`, `kvbm_engine_peers_expired_total`, `kvbm_engine_index_resyncs_total`,
//! `kvbm_engine_index_resync_failures_total`, `kvbm_engine_departed_event_batches_ignored_total`,
//! `kvbm_engine_presence_messages_rejected_total`, `kvbm_engine_snapshots_over_limit_total`,
//! `kvbm_engine_unjoined_event_batches_ignored_total` (and the same counts in
//! [`PresenceStats`]).
//!
//! # Authentication
//!
//! With [`Security::On`] every heartbeat (the `departing` one included) is sealed by the
//! leader for `kvbm/heartbeat/<subject>` and believed only if it opens and its sender is the
//! leader of the instance it names; every snapshot request is sealed for
//! `kvbm/snapshot/<subject>` and answered only to a member's leader; every page is sealed for
//! `kvbm/snapshot-reply/` ‖ BLAKE3(the sealed request) and accepted only from the leader of
//! the instance whose snapshot was asked (a forged page is dropped and the fetch keeps reading
//! its inbox until the real one, or the deadline). What does not open is counted by kind in
//! the verifier's [`SecurityStats`](crate::security::SecurityStats) (a replayed heartbeat as
//! `Replayed`), a member speaking for another as [`Rejection::NotAllowed`], and every drop in
//! [`PresenceStats::unauthenticated`]. So no one can move another instance's data-plane
//! address, make it depart, or answer for its snapshot. Off: plain JSON as before.
//!
//! # Locks
//!
//! Three `parking_lot` mutexes: the peer table, the departed set and the fetch log. The table
//! and the departed set are each taken alone (the follower checks membership in the table,
//! then in the departed set, releasing each before the next). The fetch log is held while the index is
//! updated from events or a snapshot (order: fetch log → index), never together with the
//! table or the departed set. None is held across an `.await`; the directory's mutex is never
//! taken while one is held.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use async_nats::Client;
use futures::StreamExt;
use kvbm_logical::{SequenceHash, TierId};
use parking_lot::Mutex;
use serde::{Deserialize, Serialize};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use crate::dataplane::PeerDirectory;
use crate::pubsub::IndexEvents;
use crate::security::{MemberCert, Rejection, Role, Security};
use crate::transport::PeerInfo;
use kvbm_engine::InstanceId;
use kvbm_engine::cross_instance::CrossInstanceIndex;
use kvbm_engine::error::{EngineError, Result};
use kvbm_engine::runtime::RuntimeHandle;

/// Version of the heartbeat and snapshot messages.
pub const PRESENCE_WIRE_VERSION: u32 = 1;

/// A departed peer is remembered (its late events ignored) for this many heartbeat timeouts.
pub const DEPARTED_HORIZON: u32 = 60;

/// Heartbeats in a row with the same stored count after which a difference from the index is
/// taken as lost events (see the module docs).
pub const DRIFT_REPEATS: u32 = 2;

/// Point-in-time copies a snapshot answerer keeps for fetches in progress (oldest dropped).
pub const SNAPSHOT_COPIES: usize = 16;

/// Most event batches of one peer kept while its snapshot is fetched (see the module docs).
pub const FETCH_LOG_CAP: usize = 4096;

/// Most entries in one snapshot answer, by default: JSON of this many entries is far below
/// NATS' default payload limit (1 MiB).
pub const SNAPSHOT_PAGE: usize = 4096;

#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct Heartbeat {
    version: u32,
    peer: PeerInfo,
    epoch: u64,
    departing: bool,
    /// How many (block, tier) locations the sender stores, per its own record.
    stored: u64,
}

#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct SnapshotRequest {
    version: u32,
    /// One fetch's pages share a series: they are cut from one point-in-time copy.
    series: u64,
    offset: usize,
}

#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct SnapshotPage {
    version: u32,
    instance: InstanceId,
    entries: Vec<(SequenceHash, TierId)>,
    next: Option<usize>,
}

/// Timing of the presence protocol (from `[transport]`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PresenceConfig {
    /// How often this instance announces itself.
    pub interval: Duration,
    /// A peer silent this long is dropped.
    pub timeout: Duration,
    /// Deadline of one snapshot request.
    pub request_timeout: Duration,
    /// Most entries in one snapshot answer (at least 1). Default: [`SNAPSHOT_PAGE`].
    pub snapshot_page: usize,
    /// Most pages one snapshot fetch reads; a peer whose snapshot needs more is refused
    /// (`transport.snapshot_max_pages`).
    pub max_pages: usize,
    /// Most entries one snapshot fetch accepts; a peer whose snapshot holds more is refused
    /// (`transport.snapshot_max_entries`).
    pub max_entries: usize,
}

impl PresenceConfig {
    /// From `[transport]`'s `heartbeat_interval_ms`, `heartbeat_timeout_ms`,
    /// `request_timeout_ms`, `snapshot_max_pages` and `snapshot_max_entries`.
    pub fn from_transport(t: &kvbm_engine::config::TransportConfig) -> Self {
        Self {
            interval: Duration::from_millis(t.heartbeat_interval_ms.max(1)),
            timeout: Duration::from_millis(t.heartbeat_timeout_ms.max(2)),
            request_timeout: Duration::from_millis(t.request_timeout_ms.max(1)),
            snapshot_page: SNAPSHOT_PAGE,
            max_pages: t.snapshot_max_pages.max(1),
            max_entries: t.snapshot_max_entries.max(1),
        }
    }
}

struct PeerState {
    info: PeerInfo,
    last_seen: Instant,
    epoch: u64,
    synced: bool,
    /// The `stored` of its last heartbeat, and how many heartbeats in a row said the same.
    stored: u64,
    stored_repeats: u32,
}

/// Counters of the presence protocol.
#[derive(Debug, Default)]
struct Counters {
    heartbeats_sent: AtomicU64,
    heartbeats_received: AtomicU64,
    rejected: AtomicU64,
    expired: AtomicU64,
    resyncs: AtomicU64,
    resync_failed: AtomicU64,
    snapshots_served: AtomicU64,
    snapshots_throttled: AtomicU64,
    ignored: AtomicU64,
    drift: AtomicU64,
    over_limit: AtomicU64,
    unjoined: AtomicU64,
    unauthenticated: AtomicU64,
}

/// A copy of [`Presence`]'s counters.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PresenceStats {
    /// Heartbeats published by this instance.
    pub heartbeats_sent: u64,
    /// Heartbeats received from other instances.
    pub heartbeats_received: u64,
    /// Messages skipped as undecodable, of another version, or with a bad address.
    pub rejected: u64,
    /// Peers dropped after their heartbeats stopped (or they said they were leaving).
    pub expired: u64,
    /// Snapshots of peers applied to the index.
    pub resyncs: u64,
    /// Snapshot requests that failed (retried at the next tick).
    pub resync_failed: u64,
    /// Snapshot pages this instance answered.
    pub snapshots_served: u64,
    /// First-page snapshot requests left unanswered: [`SNAPSHOT_COPIES`] full copies were
    /// already made within the last `request_timeout` (see the module docs).
    pub snapshots_throttled: u64,
    /// Event batches of departed peers not applied.
    pub ignored_batches: u64,
    /// Times a quiet peer's stored count differed from the index (lost events) and it was
    /// resynced.
    pub drift_detected: u64,
    /// Snapshot fetches refused for needing more than `max_pages` pages or holding more than
    /// `max_entries` entries (nothing of them applied).
    pub snapshots_over_limit: u64,
    /// Event batches of instances that have not joined by heartbeat (not live) not applied.
    pub unjoined_event_batches: u64,
    /// Heartbeats, snapshot requests and snapshot pages dropped (security on) because they
    /// did not open or their sender may not say what they say (see the module docs).
    pub unauthenticated: u64,
}

struct Inner {
    this: PeerInfo,
    client: Client,
    prefix: String,
    config: PresenceConfig,
    index: Arc<CrossInstanceIndex>,
    own: Arc<CrossInstanceIndex>,
    directory: Arc<PeerDirectory>,
    table: Mutex<HashMap<InstanceId, PeerState>>,
    /// Peers expired and not heard from since: their events are ignored until they are.
    departed: Mutex<HashMap<InstanceId, Instant>>,
    /// Events of peers whose snapshot is being fetched, to replay over the snapshot (`None`:
    /// more than [`FETCH_LOG_CAP`] batches came meanwhile; the peer is resynced again).
    during_fetch: Mutex<HashMap<InstanceId, Option<Vec<crate::pubsub::EventMessage>>>>,
    epoch: watch::Receiver<u64>,
    series: AtomicU64,
    counters: Counters,
    security: Arc<Security>,
}

/// The presence protocol of one instance: see the [module docs](self). Its tasks end when
/// `cancel` (given to [`start`](Self::start)) is cancelled. Clones share one state.
#[derive(Clone)]
pub struct Presence {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for Presence {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Presence")
            .field("this", &self.inner.this.worker.instance)
            .field("live_peers", &self.live_peers())
            .finish()
    }
}

pub(crate) fn heartbeat_subject(prefix: &str) -> String {
    format!("{prefix}.peers")
}

pub(crate) fn snapshot_subject(prefix: &str, instance: InstanceId) -> String {
    format!("{prefix}.snapshot.{:016x}", instance.0)
}

fn heartbeat_context(prefix: &str) -> Vec<u8> {
    format!("kvbm/heartbeat/{}", heartbeat_subject(prefix)).into_bytes()
}

fn snapshot_context(subject: &str) -> Vec<u8> {
    format!("kvbm/snapshot/{subject}").into_bytes()
}

/// Whether `sender` (none: security off) may speak for `instance`: its leader.
fn speaks_for(sender: Option<&MemberCert>, instance: InstanceId) -> bool {
    sender.is_none_or(|s| s.role == Role::Leader && s.instance == instance)
}

impl Presence {
    /// Starts announcing `this` on `{prefix}.peers`, listening to peers, answering snapshot
    /// requests from `own` (this instance's record of what it stores) and keeping `index` and
    /// `directory` in step with live peers. `epoch` counts the client's (re)connections
    /// ([`crate::transport::nats::connect_observed`]). Returns once its subscriptions are in
    /// place.
    ///
    /// # Errors
    /// [`EngineError::Nats`] when a subscription fails; [`EngineError::ShutDown`] after
    /// shutdown.
    #[allow(clippy::too_many_arguments)]
    pub async fn start(
        runtime: &RuntimeHandle,
        cancel: CancellationToken,
        client: Client,
        epoch: watch::Receiver<u64>,
        prefix: &str,
        config: PresenceConfig,
        this: PeerInfo,
        index: Arc<CrossInstanceIndex>,
        own: Arc<CrossInstanceIndex>,
        directory: Arc<PeerDirectory>,
    ) -> Result<Self> {
        Self::start_secured(
            runtime,
            cancel,
            client,
            epoch,
            prefix,
            config,
            this,
            index,
            own,
            directory,
            Arc::new(Security::Off),
        )
        .await
    }

    /// As [`start`](Self::start), every message sealed and checked with `security` (see the
    /// [module docs](self)).
    ///
    /// # Errors
    /// As [`start`](Self::start).
    #[allow(clippy::too_many_arguments)]
    pub async fn start_secured(
        runtime: &RuntimeHandle,
        cancel: CancellationToken,
        client: Client,
        epoch: watch::Receiver<u64>,
        prefix: &str,
        config: PresenceConfig,
        this: PeerInfo,
        index: Arc<CrossInstanceIndex>,
        own: Arc<CrossInstanceIndex>,
        directory: Arc<PeerDirectory>,
        security: Arc<Security>,
    ) -> Result<Self> {
        let nats_err = |subject: &str, e: &dyn std::fmt::Display| EngineError::Nats {
            url: subject.to_string(),
            message: e.to_string(),
        };
        let hb_subject = heartbeat_subject(prefix);
        let snap_subject = snapshot_subject(prefix, this.worker.instance);
        let heartbeats = client
            .subscribe(hb_subject.clone())
            .await
            .map_err(|e| nats_err(&hb_subject, &e))?;
        let requests = client
            .subscribe(snap_subject.clone())
            .await
            .map_err(|e| nats_err(&snap_subject, &e))?;
        client
            .flush()
            .await
            .map_err(|e| nats_err(&hb_subject, &e))?;
        let inner = Arc::new(Inner {
            this,
            client,
            prefix: prefix.to_string(),
            config,
            index,
            own,
            directory,
            table: Mutex::new(HashMap::new()),
            departed: Mutex::new(HashMap::new()),
            during_fetch: Mutex::new(HashMap::new()),
            epoch,
            series: AtomicU64::new(0),
            counters: Counters::default(),
            security,
        });
        let presence = Self { inner };
        presence.spawn_announce(runtime, cancel.clone())?;
        presence.spawn_listen(runtime, cancel.clone(), heartbeats)?;
        presence.spawn_snapshots(runtime, cancel.clone(), requests)?;
        presence.spawn_maintenance(runtime, cancel)?;
        Ok(presence)
    }

    fn heartbeat(&self, departing: bool) -> bytes::Bytes {
        let hb = Heartbeat {
            version: PRESENCE_WIRE_VERSION,
            peer: self.inner.this.clone(),
            epoch: *self.inner.epoch.borrow(),
            departing,
            stored: self.inner.own.count_of(self.inner.this.worker.instance) as u64,
        };
        let json = serde_json::to_vec(&hb).expect("heartbeats serialize");
        self.inner
            .security
            .seal(&heartbeat_context(&self.inner.prefix), &json)
            .into()
    }

    fn spawn_announce(&self, runtime: &RuntimeHandle, cancel: CancellationToken) -> Result<()> {
        let me = Self {
            inner: self.inner.clone(),
        };
        runtime.spawn(async move {
            let subject = heartbeat_subject(&me.inner.prefix);
            let mut tick = tokio::time::interval(me.inner.config.interval);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tokio::select! {
                    () = cancel.cancelled() => return,
                    _ = tick.tick() => {}
                }
                let payload = me.heartbeat(false);
                // May wait while the server is away; only this task waits.
                tokio::select! {
                    () = cancel.cancelled() => return,
                    r = me.inner.client.publish(subject.clone(), payload) => match r {
                        Ok(()) => {
                            me.inner.counters.heartbeats_sent.fetch_add(1, Ordering::Relaxed);
                        }
                        Err(e) => tracing::debug!(error = %e, "heartbeat not published"),
                    },
                }
            }
        })?;
        Ok(())
    }

    fn spawn_listen(
        &self,
        runtime: &RuntimeHandle,
        cancel: CancellationToken,
        mut sub: async_nats::Subscriber,
    ) -> Result<()> {
        let inner = self.inner.clone();
        runtime.spawn(async move {
            let context = heartbeat_context(&inner.prefix);
            loop {
                let message = tokio::select! {
                    () = cancel.cancelled() => return,
                    m = sub.next() => match m { Some(m) => m, None => return },
                };
                let Some((sender, payload)) = inner.open(&context, &message.payload) else {
                    continue;
                };
                let hb = match serde_json::from_slice::<Heartbeat>(payload) {
                    Ok(hb) if hb.version == PRESENCE_WIRE_VERSION => hb,
                    Ok(_) | Err(_) => {
                        inner.reject();
                        continue;
                    }
                };
                let id = hb.peer.worker.instance;
                if !speaks_for(sender.as_deref(), id) {
                    // A member speaking for another instance (its address, its departure).
                    inner.not_allowed(sender.as_deref(), id, "heartbeat");
                    continue;
                }
                if id == inner.this.worker.instance {
                    continue;
                }
                inner
                    .counters
                    .heartbeats_received
                    .fetch_add(1, Ordering::Relaxed);
                if hb.departing {
                    inner.expire(&[id]);
                    continue;
                }
                // No data plane: a live peer that serves no G2 (its worker ranks are
                // processes), kept out of the directory. An unreadable one is refused.
                let addr = match hb.peer.data_plane.as_deref() {
                    None => None,
                    Some(a) => match a.parse::<SocketAddr>() {
                        Ok(addr) => Some(addr),
                        Err(_) => {
                            inner.reject();
                            continue;
                        }
                    },
                };
                inner.departed.lock().remove(&id);
                {
                    let mut table = inner.table.lock();
                    let entry = table.entry(id).or_insert_with(|| PeerState {
                        info: hb.peer.clone(),
                        last_seen: Instant::now(),
                        epoch: hb.epoch,
                        synced: false,
                        stored: hb.stored,
                        stored_repeats: 0,
                    });
                    entry.last_seen = Instant::now();
                    if entry.stored == hb.stored {
                        entry.stored_repeats = entry.stored_repeats.saturating_add(1);
                    } else {
                        entry.stored = hb.stored;
                        entry.stored_repeats = 0;
                    }
                    if entry.epoch != hb.epoch {
                        // The peer's client was away: its events of that time may be lost.
                        entry.epoch = hb.epoch;
                        entry.synced = false;
                    }
                    entry.info = hb.peer;
                }
                if let Some(addr) = addr {
                    inner.directory.insert(id, addr);
                }
            }
        })?;
        Ok(())
    }

    fn spawn_snapshots(
        &self,
        runtime: &RuntimeHandle,
        cancel: CancellationToken,
        mut sub: async_nats::Subscriber,
    ) -> Result<()> {
        let inner = self.inner.clone();
        runtime.spawn(async move {
            let request_ctx =
                snapshot_context(&snapshot_subject(&inner.prefix, inner.this.worker.instance));
            let mut copies: std::collections::VecDeque<(u64, Instant, Arc<Vec<_>>)> =
                std::collections::VecDeque::with_capacity(SNAPSHOT_COPIES);
            // When each of the latest full copies was made (at most SNAPSHOT_COPIES).
            let mut made: std::collections::VecDeque<Instant> =
                std::collections::VecDeque::with_capacity(SNAPSHOT_COPIES);
            // When each sealed requester (the instance its certificate names) last had a full
            // copy: one per `request_timeout` each.
            let mut made_for: std::collections::HashMap<InstanceId, Instant> =
                std::collections::HashMap::new();
            loop {
                let message = tokio::select! {
                    () = cancel.cancelled() => return,
                    m = sub.next() => match m { Some(m) => m, None => return },
                };
                let Some(reply) = message.reply else {
                    inner.reject();
                    continue;
                };
                // Answered only to a member's leader; the page is bound to this request.
                let Some((sender, payload)) = inner.open(&request_ctx, &message.payload) else {
                    continue;
                };
                if let Some(s) = sender.as_deref()
                    && s.role != Role::Leader
                {
                    inner.not_allowed(Some(s), s.instance, "snapshot request");
                    continue;
                }
                let page_ctx =
                    crate::transport::nats::reply_context("snapshot-reply", &message.payload);
                let (series, offset) = match serde_json::from_slice::<SnapshotRequest>(payload) {
                    Ok(r) if r.version == PRESENCE_WIRE_VERSION => (r.series, r.offset),
                    _ => {
                        inner.reject();
                        continue;
                    }
                };
                // A hostile offset must not overflow the page's end (checked below too).
                let Some(page_end) = offset.checked_add(inner.config.snapshot_page.max(1)) else {
                    inner.reject();
                    continue;
                };
                let me = inner.this.worker.instance;
                // The first page copies the set once; later pages of the series are cut from
                // that copy (so a block removed meanwhile cannot shift another out of reach).
                let now = Instant::now();
                let keep = inner.config.request_timeout * 4;
                copies.retain(|(_, at, _)| now.duration_since(*at) < keep);
                let all = if offset == 0 {
                    // The rate limits on full copies (see the module docs): one per requester,
                    // SNAPSHOT_COPIES in all, per request timeout.
                    let window = inner.config.request_timeout;
                    made.retain(|at| now.duration_since(*at) < window);
                    made_for.retain(|_, at| now.duration_since(*at) < window);
                    let requester = sender.as_deref().map(|s| s.instance);
                    if made.len() >= SNAPSHOT_COPIES
                        || requester.is_some_and(|r| made_for.contains_key(&r))
                    {
                        inner
                            .counters
                            .snapshots_throttled
                            .fetch_add(1, Ordering::Relaxed);
                        metrics::counter!(kvbm_engine::metrics::PRESENCE_SNAPSHOTS_THROTTLED)
                            .increment(1);
                        continue;
                    }
                    made.push_back(now);
                    if let Some(r) = requester {
                        made_for.insert(r, now);
                    }
                    let all = Arc::new(inner.own.entries_of(me));
                    copies.retain(|(s, _, _)| *s != series);
                    if copies.len() == SNAPSHOT_COPIES {
                        copies.pop_front();
                    }
                    copies.push_back((series, now, all.clone()));
                    Some(all)
                } else {
                    copies
                        .iter()
                        .find(|(s, _, _)| *s == series)
                        .map(|(_, _, a)| a.clone())
                };
                let page = match all {
                    Some(all) => {
                        let end = page_end.min(all.len());
                        SnapshotPage {
                            version: PRESENCE_WIRE_VERSION,
                            instance: me,
                            entries: all.get(offset..end).map(<[_]>::to_vec).unwrap_or_default(),
                            next: (end < all.len()).then_some(end),
                        }
                    }
                    // The copy is gone (too old, or pushed out): the requester starts over.
                    None => SnapshotPage {
                        version: PRESENCE_WIRE_VERSION,
                        instance: me,
                        entries: Vec::new(),
                        next: Some(0),
                    },
                };
                let payload = serde_json::to_vec(&page).expect("snapshots serialize");
                let payload = inner.security.seal(&page_ctx, &payload);
                match inner.client.publish(reply, payload.into()).await {
                    Ok(()) => {
                        inner
                            .counters
                            .snapshots_served
                            .fetch_add(1, Ordering::Relaxed);
                    }
                    Err(e) => tracing::debug!(error = %e, "snapshot page not sent"),
                }
            }
        })?;
        Ok(())
    }

    fn spawn_maintenance(&self, runtime: &RuntimeHandle, cancel: CancellationToken) -> Result<()> {
        let inner = self.inner.clone();
        runtime.spawn(async move {
            let mut epoch = inner.epoch.clone();
            epoch.borrow_and_update();
            let mut tick = tokio::time::interval(inner.config.interval);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tokio::select! {
                    () = cancel.cancelled() => return,
                    _ = tick.tick() => {}
                }
                if epoch.has_changed().unwrap_or(false) {
                    epoch.borrow_and_update();
                    // Our own client was away: every peer's events of that time may be lost.
                    for p in inner.table.lock().values_mut() {
                        p.synced = false;
                    }
                }
                let now = Instant::now();
                // Drift: a synced peer whose stored count held still for DRIFT_REPEATS
                // heartbeats (nothing in flight) but differs from what the index holds for it
                // lost events while connected (a full outbox): resync it.
                let quiet: Vec<(InstanceId, u64)> = inner
                    .table
                    .lock()
                    .iter()
                    .filter(|(_, p)| p.synced && p.stored_repeats >= DRIFT_REPEATS)
                    .map(|(i, p)| (*i, p.stored))
                    .collect();
                for (peer, stored) in quiet {
                    // A peer past the index's cap is held at the cap: that is no drift.
                    let expected = stored.min(inner.index.cap() as u64);
                    if inner.index.count_of(peer) as u64 != expected {
                        if let Some(p) = inner.table.lock().get_mut(&peer) {
                            p.synced = false;
                        }
                        inner.counters.drift.fetch_add(1, Ordering::Relaxed);
                        metrics::counter!(kvbm_engine::metrics::INDEX_DRIFT_DETECTED).increment(1);
                    }
                }
                let (stale, unsynced): (Vec<InstanceId>, Vec<InstanceId>) = {
                    let table = inner.table.lock();
                    let stale = table
                        .iter()
                        .filter(|(_, p)| now.duration_since(p.last_seen) > inner.config.timeout)
                        .map(|(i, _)| *i)
                        .collect();
                    let unsynced = table
                        .iter()
                        .filter(|(_, p)| !p.synced)
                        .map(|(i, _)| *i)
                        .collect();
                    (stale, unsynced)
                };
                inner.expire(&stale);
                for peer in unsynced {
                    if stale.contains(&peer) {
                        continue;
                    }
                    // From now on the peer's events are also logged, to be replayed over the
                    // snapshot (which may be older than some of them).
                    inner.during_fetch.lock().insert(peer, Some(Vec::new()));
                    let r = tokio::select! {
                        () = cancel.cancelled() => return,
                        r = inner.fetch_snapshot(peer) => r,
                    };
                    match r {
                        Ok(entries) => {
                            let live = inner.table.lock().contains_key(&peer);
                            let complete = {
                                let mut log = inner.during_fetch.lock();
                                match log.remove(&peer) {
                                    // Still a peer (not expired meanwhile)? Then apply; under
                                    // the log's lock, so no event is applied in between.
                                    Some(Some(events)) if live => {
                                        inner.index.replace_instance(peer, &entries);
                                        for m in &events {
                                            inner.index.apply(m);
                                        }
                                        true
                                    }
                                    _ => false,
                                }
                            };
                            let mut table = inner.table.lock();
                            if let (Some(p), true) = (table.get_mut(&peer), complete) {
                                p.synced = true;
                                drop(table);
                                inner.counters.resyncs.fetch_add(1, Ordering::Relaxed);
                                metrics::counter!(kvbm_engine::metrics::INDEX_RESYNCS).increment(1);
                            }
                        }
                        Err(e) => {
                            inner.during_fetch.lock().remove(&peer);
                            tracing::debug!(%peer, error = %e, "snapshot failed; retried next tick");
                            inner.counters.resync_failed.fetch_add(1, Ordering::Relaxed);
                            metrics::counter!(kvbm_engine::metrics::INDEX_RESYNC_FAILURES)
                                .increment(1);
                        }
                    }
                }
            }
        })?;
        Ok(())
    }

    /// The peers heard from within the timeout, sorted.
    pub fn live_peers(&self) -> Vec<InstanceId> {
        let mut out: Vec<_> = self.inner.table.lock().keys().copied().collect();
        out.sort();
        out
    }

    /// What `peer` last said about itself, if it is live.
    pub fn peer(&self, peer: InstanceId) -> Option<PeerInfo> {
        self.inner.table.lock().get(&peer).map(|p| p.info.clone())
    }

    /// Whether `peer` is live and its snapshot has been applied since it was (re)seen.
    pub fn is_synced(&self, peer: InstanceId) -> bool {
        self.inner.table.lock().get(&peer).is_some_and(|p| p.synced)
    }

    /// Whether `peer` expired (or left) and has not been heard from since; its events are then
    /// not applied to the index (see [`follow`](Self::follow)).
    pub fn is_departed(&self, peer: InstanceId) -> bool {
        self.inner.departed.lock().contains_key(&peer)
    }

    /// Keeps the index up to date from `events` (a subscription of the event bus) until
    /// `cancel`, skipping events of departed peers (counted in
    /// [`PresenceStats::ignored_batches`]). A lagging subscriber skips what it missed (the
    /// next resync restores it).
    ///
    /// # Errors
    /// [`EngineError::ShutDown`] after shutdown.
    pub fn follow(
        &self,
        runtime: &RuntimeHandle,
        cancel: CancellationToken,
        mut events: tokio::sync::broadcast::Receiver<crate::pubsub::EventMessage>,
    ) -> Result<()> {
        let inner = self.inner.clone();
        runtime.spawn(async move {
            use tokio::sync::broadcast::error::RecvError;
            loop {
                let m = tokio::select! {
                    () = cancel.cancelled() => return,
                    m = events.recv() => m,
                };
                match m {
                    Ok(m) => {
                        let joined = m.instance == inner.this.worker.instance
                            || inner.table.lock().contains_key(&m.instance);
                        if inner.departed.lock().contains_key(&m.instance) {
                            inner.counters.ignored.fetch_add(1, Ordering::Relaxed);
                            metrics::counter!(kvbm_engine::metrics::DEPARTED_EVENT_BATCHES_IGNORED)
                                .increment(1);
                        } else if !joined {
                            // Never heard by heartbeat (or expired): its events could grow the
                            // index without bound. A peer that joins later is resynced from
                            // its snapshot, so nothing of a real peer is lost.
                            inner.counters.unjoined.fetch_add(1, Ordering::Relaxed);
                            metrics::counter!(kvbm_engine::metrics::UNJOINED_EVENT_BATCHES_IGNORED)
                                .increment(1);
                        } else {
                            // Applied and logged under the log's lock: a snapshot replacing
                            // this peer's entries either sees this batch in its log or
                            // happens before it is applied.
                            let mut log = inner.during_fetch.lock();
                            inner.index.apply(&m);
                            if let Some(slot) = log.get_mut(&m.instance) {
                                match slot {
                                    Some(v) if v.len() < FETCH_LOG_CAP => v.push(m),
                                    Some(_) => *slot = None,
                                    None => {}
                                }
                            }
                        }
                    }
                    Err(RecvError::Lagged(n)) => {
                        tracing::warn!(missed = n, "cross-instance index lagged; resyncing");
                        for p in inner.table.lock().values_mut() {
                            p.synced = false;
                        }
                    }
                    Err(RecvError::Closed) => return,
                }
            }
        })?;
        Ok(())
    }

    /// The counters.
    pub fn stats(&self) -> PresenceStats {
        let c = &self.inner.counters;
        PresenceStats {
            heartbeats_sent: c.heartbeats_sent.load(Ordering::Relaxed),
            heartbeats_received: c.heartbeats_received.load(Ordering::Relaxed),
            rejected: c.rejected.load(Ordering::Relaxed),
            expired: c.expired.load(Ordering::Relaxed),
            resyncs: c.resyncs.load(Ordering::Relaxed),
            resync_failed: c.resync_failed.load(Ordering::Relaxed),
            snapshots_served: c.snapshots_served.load(Ordering::Relaxed),
            snapshots_throttled: c.snapshots_throttled.load(Ordering::Relaxed),
            ignored_batches: c.ignored.load(Ordering::Relaxed),
            drift_detected: c.drift.load(Ordering::Relaxed),
            snapshots_over_limit: c.over_limit.load(Ordering::Relaxed),
            unjoined_event_batches: c.unjoined.load(Ordering::Relaxed),
            unauthenticated: c.unauthenticated.load(Ordering::Relaxed),
        }
    }

    /// Tells peers this instance is leaving (they drop it at once instead of after the
    /// timeout). Best effort: waits at most the request timeout.
    pub async fn depart(&self) {
        let subject = heartbeat_subject(&self.inner.prefix);
        let t = self.inner.config.request_timeout;
        let payload = self.heartbeat(true);
        let _ = tokio::time::timeout(t, async {
            let _ = self.inner.client.publish(subject, payload).await;
            let _ = self.inner.client.flush().await;
        })
        .await;
    }
}

impl Inner {
    /// Opens a message sealed for `context` (as is when security is off); `None` when it does
    /// not open (counted by the verifier and in `unauthenticated`).
    fn open<'a>(
        &self,
        context: &[u8],
        bytes: &'a [u8],
    ) -> Option<(Option<Arc<MemberCert>>, &'a [u8])> {
        match self.security.open(context, bytes) {
            Ok(o) => Some(o),
            Err(why) => {
                self.counters
                    .unauthenticated
                    .fetch_add(1, Ordering::Relaxed);
                tracing::debug!(%why, "presence message that does not open dropped");
                None
            }
        }
    }

    /// Counts a message whose sender may not say it (for `claimed`).
    fn not_allowed(&self, sender: Option<&MemberCert>, claimed: InstanceId, what: &str) {
        self.security.count(Rejection::NotAllowed);
        self.counters
            .unauthenticated
            .fetch_add(1, Ordering::Relaxed);
        tracing::warn!(
            sender = ?sender.map(ToString::to_string),
            claimed = %claimed,
            "{what} from a member that may not say it dropped"
        );
    }

    fn reject(&self) {
        self.counters.rejected.fetch_add(1, Ordering::Relaxed);
        metrics::counter!(kvbm_engine::metrics::PRESENCE_MESSAGES_REJECTED).increment(1);
    }

    fn expire(&self, peers: &[InstanceId]) {
        if peers.is_empty() {
            return;
        }
        let removed: Vec<InstanceId> = {
            let mut table = self.table.lock();
            peers
                .iter()
                .filter(|p| table.remove(p).is_some())
                .copied()
                .collect()
        };
        // Events still in flight from them are ignored from now on (until they are heard
        // again, and then resynced), so they cannot re-enter the index.
        let now = Instant::now();
        {
            let mut departed = self.departed.lock();
            // Bounded: entries older than DEPARTED_HORIZON timeouts are forgotten (no event of
            // theirs can still be in flight).
            let horizon = self.config.timeout * DEPARTED_HORIZON;
            departed.retain(|_, at| now.duration_since(*at) < horizon);
            departed.extend(peers.iter().map(|p| (*p, now)));
        }
        for p in peers {
            // Drop index entries even of a peer only known from events.
            self.index.remove_instance(*p);
        }
        for p in &removed {
            self.directory.remove(*p);
            self.counters.expired.fetch_add(1, Ordering::Relaxed);
            metrics::counter!(kvbm_engine::metrics::PEERS_EXPIRED).increment(1);
            tracing::info!(peer = %p, "peer expired from the index and directory");
        }
    }

    async fn fetch_snapshot(&self, peer: InstanceId) -> Result<Vec<(SequenceHash, TierId)>> {
        let subject = snapshot_subject(&self.prefix, peer);
        let fail = |m: String| EngineError::Snapshot {
            peer: peer.to_string(),
            message: m,
        };
        let mut out = Vec::new();
        let mut offset = 0;
        let mut pages = 0usize;
        let over = |m: String| {
            self.counters.over_limit.fetch_add(1, Ordering::Relaxed);
            metrics::counter!(kvbm_engine::metrics::SNAPSHOTS_OVER_LIMIT).increment(1);
            fail(m)
        };
        let n = self.series.fetch_add(1, Ordering::Relaxed);
        let series = xxhash_rust::xxh3::xxh3_64(
            &[self.this.worker.instance.0.to_le_bytes(), n.to_le_bytes()].concat(),
        );
        loop {
            let req = SnapshotRequest {
                version: PRESENCE_WIRE_VERSION,
                series,
                offset,
            };
            let payload = serde_json::to_vec(&req).expect("requests serialize");
            let answer: Vec<u8> = if self.security.is_on() {
                let sealed = self.security.seal(&snapshot_context(&subject), &payload);
                let ctx = crate::transport::nats::reply_context("snapshot-reply", &sealed);
                // Read until the asked instance's leader answers: a forged page published
                // first is dropped and counted, never taken.
                let got = crate::transport::nats::request_first_valid(
                    &self.client,
                    subject.clone(),
                    sealed.into(),
                    self.config.request_timeout,
                    |bytes| {
                        let (sender, payload) = self.open(&ctx, bytes)?;
                        if speaks_for(sender.as_deref(), peer) {
                            Some(payload.to_vec())
                        } else {
                            self.not_allowed(sender.as_deref(), peer, "snapshot page");
                            None
                        }
                    },
                )
                .await;
                use crate::transport::nats::InboxReply;
                match got {
                    InboxReply::Valid(p) => p,
                    InboxReply::TimedOut => {
                        return Err(fail(format!(
                            "no answer in {:?}",
                            self.config.request_timeout
                        )));
                    }
                    InboxReply::NoResponders => return Err(fail("no responders".into())),
                    InboxReply::Transport(m) => return Err(fail(m)),
                }
            } else {
                tokio::time::timeout(
                    self.config.request_timeout,
                    self.client.request(subject.clone(), payload.into()),
                )
                .await
                .map_err(|_| fail(format!("no answer in {:?}", self.config.request_timeout)))?
                .map_err(|e| fail(e.to_string()))?
                .payload
                .to_vec()
            };
            let page: SnapshotPage =
                serde_json::from_slice(&answer).map_err(|e| fail(e.to_string()))?;
            if page.version != PRESENCE_WIRE_VERSION || page.instance != peer {
                return Err(fail(format!(
                    "answer of version {} from {} refused",
                    page.version, page.instance
                )));
            }
            pages += 1;
            if out.len().saturating_add(page.entries.len()) > self.config.max_entries {
                return Err(over(format!(
                    "snapshot holds more than {} entries (transport.snapshot_max_entries)",
                    self.config.max_entries
                )));
            }
            out.extend(page.entries);
            if page.next.is_some() && pages >= self.config.max_pages {
                return Err(over(format!(
                    "snapshot needs more than {} pages (transport.snapshot_max_pages)",
                    self.config.max_pages
                )));
            }
            match page.next {
                Some(n) if n > offset => offset = n,
                Some(_) => return Err(fail("snapshot page does not advance".into())),
                None => return Ok(out),
            }
        }
    }
}

#[cfg(test)]
mod tests;

/// Decodes `data` as each presence message (the fuzz target's entry, see
/// [`fuzzing`](crate::fuzzing)), with the arithmetic a receiver does on it.
#[doc(hidden)]
pub(crate) fn fuzz_decode(data: &[u8]) {
    let _ = serde_json::from_slice::<Heartbeat>(data);
    if let Ok(r) = serde_json::from_slice::<SnapshotRequest>(data) {
        let _ = r.offset.checked_add(SNAPSHOT_PAGE);
    }
    if let Ok(p) = serde_json::from_slice::<SnapshotPage>(data) {
        let _ = p.next.map(|n| n.checked_add(p.entries.len()));
    }
}
