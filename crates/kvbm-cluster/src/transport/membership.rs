//! Worker ranks that join, leave and rejoin (feature `nats`): each [`WorkerServer`] announces
//! its rank and **incarnation** (an epoch drawn at start) by heartbeat, and the leader's
//! [`Membership`] follows them, so the leader sends work only to ranks that are there and in
//! step.
//!
//! ```text
//!  WorkerServer (rank r, epoch e) ──RankBeat every heartbeat_interval──► <prefix>.<instance>.members
//!                                 └─departing on stop
//!  Membership (leader) ── per rank: epoch seen, epoch acknowledged, last heard
//!       │  absent ──beat──► Joined(e) ─────────────── calls carry to = (r, e)
//!       │  Joined(e) ──no beat for heartbeat_timeout / departing──► Lost
//!       │  Joined(e) / Lost ──beat of epoch e' ≠ e──► Rejoining(e'): calls refused
//!       │       (ControlError::Rejoining) until the leader declared the rank's G1/G2 state
//!       │       empty and called acknowledge(r) ──► Joined(e')   (keep_in_step does both:
//!       │       InstanceLeader::forget_worker_memory until nothing old is held, then ack)
//!  WorkerServer: a request whose `to` names another rank or another epoch is refused
//! ```
//!
//! # Why an epoch
//!
//! A restarted worker process serves the same control subject with empty memory. Without
//! incarnations, a transfer the leader sent before the restart (or a session that still holds
//! blocks the old process had) would run on the new process and move bytes that are not the
//! blocks' (zeros). With them: every request names the incarnation the leader believes in
//! ([`RankTarget`]), the new process refuses the old one's work (so it fails cleanly), and the
//! leader sends the new one nothing until it declared the rank's state empty
//! ([`Membership::acknowledge`]); only then are blocks placed on it again.
//!
//! # Security
//!
//! Beats are sealed like every cluster message (context `rank-beat:<subject>`); with security
//! on, a beat counts only when a worker credential of the followed instance at the beat's
//! rank sealed it, so no one else can make a rank look present, absent or restarted. Others
//! are dropped and counted ([`MembershipStats::rejected`]).
//!
//! # Locks
//!
//! One `parking_lot` mutex (the rank table), held only to read or update it, never across an
//! `.await` or while sending an event.
//!
//! [`WorkerServer`]: super::nats::WorkerServer

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use async_nats::Client;
use futures::StreamExt;
use parking_lot::Mutex;
use serde::{Deserialize, Serialize};
use tokio::sync::broadcast;
use tokio_util::sync::CancellationToken;

use super::WorkerAddress;
use super::control::RankTarget;
use crate::security::{Rejection, Role, Security};
use kvbm_engine::InstanceId;
use kvbm_engine::error::{ControlError, EngineError, Result};

/// Version of [`RankBeat`] this build writes and reads.
pub const BEAT_VERSION: u32 = 1;

/// The subject an instance's worker ranks announce themselves on.
pub fn members_subject(prefix: &str, instance: InstanceId) -> String {
    format!("{prefix}.{:016x}.members", instance.0)
}

/// The context a beat on `subject` is sealed for.
pub(crate) fn beat_context(subject: &str) -> Vec<u8> {
    format!("rank-beat:{subject}").into_bytes()
}

/// A worker rank's heartbeat.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RankBeat {
    /// [`BEAT_VERSION`].
    pub version: u32,
    /// The rank and its incarnation.
    pub rank: RankTarget,
    /// The worker is stopping: lost at once, without waiting for the timeout.
    pub departing: bool,
}

/// A change in who is there.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MemberEvent {
    /// A rank was heard for the first time (in step: nothing of it was placed before).
    Joined(RankTarget),
    /// A rank stopped (departed, or no beat within the timeout).
    Lost(RankTarget),
    /// A rank came back as another incarnation: its memory is empty. Calls to it are refused
    /// until [`Membership::acknowledge`].
    Restarted {
        /// The incarnation the leader knew.
        was: RankTarget,
        /// The new one.
        now: RankTarget,
    },
}

/// Counters of a [`Membership`].
#[derive(Debug, Default)]
pub struct MembershipStats {
    beats: AtomicU64,
    rejected: AtomicU64,
    restarts: AtomicU64,
}

impl MembershipStats {
    /// Beats taken.
    pub fn beats(&self) -> u64 {
        self.beats.load(Ordering::Relaxed)
    }
    /// Beats dropped: malformed, of another instance, or (security on) not sealed by the
    /// rank's own worker credential.
    pub fn rejected(&self) -> u64 {
        self.rejected.load(Ordering::Relaxed)
    }
    /// Restarts seen (a beat of a new incarnation).
    pub fn restarts(&self) -> u64 {
        self.restarts.load(Ordering::Relaxed)
    }
}

/// What the leader knows of one rank.
#[derive(Clone, Copy, Debug)]
struct Seen {
    /// The incarnation last heard.
    heard: u64,
    /// The incarnation the leader is in step with (calls go to it); `None` until the first
    /// beat was taken as a join, or after a restart until acknowledged.
    in_step: Option<u64>,
    last: Instant,
    lost: bool,
}

/// The leader's view of its worker ranks: see the [module docs](self).
#[derive(Clone)]
pub struct Membership {
    instance: InstanceId,
    ranks: Arc<Mutex<HashMap<u32, Seen>>>,
    events: broadcast::Sender<MemberEvent>,
    timeout: Duration,
    stats: Arc<MembershipStats>,
}

impl std::fmt::Debug for Membership {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Membership")
            .field("instance", &self.instance)
            .field("timeout", &self.timeout)
            .finish_non_exhaustive()
    }
}

impl Membership {
    /// Follows `instance`'s ranks on `client` under `prefix` until `cancel`: a rank heard from
    /// nothing for `timeout` is lost. Returns once subscribed.
    ///
    /// # Errors
    /// [`EngineError::Nats`] when the subscription fails.
    pub async fn follow(
        client: &Client,
        prefix: &str,
        instance: InstanceId,
        timeout: Duration,
        security: Arc<Security>,
        cancel: CancellationToken,
    ) -> Result<Self> {
        let subject = members_subject(prefix, instance);
        let mut sub = client
            .subscribe(subject.clone())
            .await
            .map_err(|e| EngineError::Nats {
                url: subject.clone(),
                message: e.to_string(),
            })?;
        client.flush().await.map_err(|e| EngineError::Nats {
            url: subject.clone(),
            message: e.to_string(),
        })?;
        let (events, _) = broadcast::channel(256);
        let me = Self {
            instance,
            ranks: Arc::default(),
            events,
            timeout,
            stats: Arc::default(),
        };
        let task = me.clone();
        let context = beat_context(&subject);
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(tick_of(timeout));
            loop {
                tokio::select! {
                    () = cancel.cancelled() => return,
                    _ = tick.tick() => task.expire(),
                    m = sub.next() => match m {
                        None => return,
                        Some(m) => task.take(&security, &context, &m.payload),
                    },
                }
            }
        });
        Ok(me)
    }

    /// A view fed only by [`take`](Self::take) (the fuzz target's; nothing follows NATS).
    fn detached(instance: InstanceId, timeout: Duration) -> Self {
        Self {
            instance,
            ranks: Arc::default(),
            events: broadcast::channel(16).0,
            timeout,
            stats: Arc::default(),
        }
    }

    /// The incarnation `address` is in step with: what a call to it carries. A rank not
    /// joined, lost, or restarted and not yet acknowledged is an error naming why.
    ///
    /// # Errors
    /// [`ControlError::NotJoined`] or [`ControlError::Rejoining`].
    pub fn target(&self, address: WorkerAddress) -> std::result::Result<RankTarget, ControlError> {
        let not_joined = ControlError::NotJoined { worker: address };
        if address.instance != self.instance {
            return Err(not_joined);
        }
        let ranks = self.ranks.lock();
        let Some(s) = ranks.get(&address.rank) else {
            return Err(not_joined);
        };
        match s.in_step {
            _ if s.lost => Err(not_joined),
            Some(epoch) if epoch == s.heard => Ok(RankTarget { address, epoch }),
            _ => Err(ControlError::Rejoining {
                worker: address,
                epoch: s.heard,
            }),
        }
    }

    /// The leader declared `address`'s state empty (its G1/G2 blocks dropped, its sessions
    /// failed): calls go to its current incarnation again. Returns that incarnation, or `None`
    /// when the rank is not there.
    pub fn acknowledge(&self, address: WorkerAddress) -> Option<RankTarget> {
        let mut ranks = self.ranks.lock();
        let s = ranks.get_mut(&address.rank).filter(|s| !s.lost)?;
        s.in_step = Some(s.heard);
        Some(RankTarget {
            address,
            epoch: s.heard,
        })
    }

    /// Waits until every rank of `0..world` is in step, or `deadline` passes.
    ///
    /// # Errors
    /// The first rank's [`ControlError`] at the deadline.
    pub async fn wait_for(
        &self,
        world: u32,
        deadline: Duration,
    ) -> std::result::Result<(), ControlError> {
        let until = Instant::now() + deadline;
        loop {
            let missing = (0..world)
                .map(|r| self.target(WorkerAddress::new(self.instance, r)))
                .find_map(|t| t.err());
            match missing {
                None => return Ok(()),
                Some(e) if Instant::now() >= until => return Err(e),
                Some(_) => tokio::time::sleep(Duration::from_millis(10)).await,
            }
        }
    }

    /// Brings restarted ranks back in step until `cancel`: while a rank is rejoining, calls
    /// `declare_empty` (the leader drops what it placed on the rank's lost memory, e.g.
    /// [`InstanceLeader::forget_worker_memory`](kvbm_engine::InstanceLeader::forget_worker_memory))
    /// at each restart and then every `timeout / 4`; once it answers `true` (nothing of the
    /// old incarnation is held any more), [`acknowledge`](Self::acknowledge)s the rank, and
    /// work goes to it again.
    pub fn keep_in_step(
        &self,
        mut declare_empty: impl FnMut(RankTarget) -> bool + Send + 'static,
        cancel: CancellationToken,
    ) -> tokio::task::JoinHandle<()> {
        let me = self.clone();
        let mut events = self.events();
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(tick_of(me.timeout));
            loop {
                tokio::select! {
                    () = cancel.cancelled() => return,
                    _ = tick.tick() => {}
                    e = events.recv() => {
                        if let Err(broadcast::error::RecvError::Closed) = e {
                            return;
                        }
                    }
                }
                let rejoining: Vec<RankTarget> = me
                    .ranks
                    .lock()
                    .iter()
                    .filter(|(_, s)| !s.lost && s.in_step != Some(s.heard))
                    .map(|(&rank, s)| RankTarget {
                        address: WorkerAddress::new(me.instance, rank),
                        epoch: s.heard,
                    })
                    .collect();
                for t in rejoining {
                    if declare_empty(t) && me.acknowledge(t.address) == Some(t) {
                        tracing::info!(worker = %t.address, epoch = t.epoch, "worker rank back in step");
                    }
                }
            }
        })
    }

    /// Changes from now on (a receiver that falls behind misses the oldest; the rank table
    /// stays the source of truth).
    pub fn events(&self) -> broadcast::Receiver<MemberEvent> {
        self.events.subscribe()
    }

    /// Its counters.
    pub fn stats(&self) -> &Arc<MembershipStats> {
        &self.stats
    }

    /// Takes one beat (see the module docs for what counts).
    fn take(&self, security: &Security, context: &[u8], bytes: &[u8]) {
        let reject = || {
            self.stats.rejected.fetch_add(1, Ordering::Relaxed);
        };
        let Ok((sender, payload)) = security.open(context, bytes) else {
            return reject();
        };
        let beat: RankBeat = match serde_json::from_slice(payload) {
            Ok(b) => b,
            Err(_) => return reject(),
        };
        let a = beat.rank.address;
        if beat.version != BEAT_VERSION || a.instance != self.instance {
            return reject();
        }
        if let Some(cert) = sender
            && (cert.role != Role::Worker || cert.instance != a.instance || cert.rank != a.rank)
        {
            security.count(Rejection::NotAllowed);
            return reject();
        }
        self.stats.beats.fetch_add(1, Ordering::Relaxed);
        let event = {
            let mut ranks = self.ranks.lock();
            let epoch = beat.rank.epoch;
            match ranks.get_mut(&a.rank) {
                None if beat.departing => None,
                None => {
                    ranks.insert(
                        a.rank,
                        Seen {
                            heard: epoch,
                            in_step: Some(epoch),
                            last: Instant::now(),
                            lost: false,
                        },
                    );
                    Some(MemberEvent::Joined(beat.rank))
                }
                Some(s) if s.heard == epoch => {
                    s.last = Instant::now();
                    if beat.departing && !s.lost {
                        s.lost = true;
                        Some(MemberEvent::Lost(beat.rank))
                    } else if !beat.departing && s.lost {
                        // Back after a silence, the same incarnation: its memory is intact.
                        s.lost = false;
                        Some(MemberEvent::Joined(beat.rank))
                    } else {
                        None
                    }
                }
                Some(_) if beat.departing => None,
                Some(s) => {
                    let was = RankTarget {
                        address: a,
                        epoch: s.heard,
                    };
                    s.heard = epoch;
                    s.last = Instant::now();
                    s.lost = false;
                    self.stats.restarts.fetch_add(1, Ordering::Relaxed);
                    tracing::warn!(worker = %a, was = was.epoch, now = epoch, "worker rank restarted: not sent work until brought back in step");
                    Some(MemberEvent::Restarted {
                        was,
                        now: beat.rank,
                    })
                }
            }
        };
        if let Some(e) = event {
            let _ = self.events.send(e);
        }
    }

    /// Marks ranks silent for longer than the timeout lost.
    fn expire(&self) {
        let mut lost = Vec::new();
        {
            let mut ranks = self.ranks.lock();
            for (&rank, s) in ranks.iter_mut() {
                if !s.lost && s.last.elapsed() > self.timeout {
                    s.lost = true;
                    lost.push(RankTarget {
                        address: WorkerAddress::new(self.instance, rank),
                        epoch: s.heard,
                    });
                }
            }
        }
        for t in lost {
            tracing::warn!(worker = %t.address, "worker rank lost: no heartbeat within the timeout");
            let _ = self.events.send(MemberEvent::Lost(t));
        }
    }
}

/// How often a membership of `timeout` looks for silent and rejoining ranks: a quarter of it
/// (at least a millisecond).
fn tick_of(timeout: Duration) -> Duration {
    (timeout / 4).max(Duration::from_millis(1))
}

/// Feeds `data`, split at newlines, to a membership view as beats off the wire, then asks
/// it about every rank (the `rank_beat` fuzz target; see
/// [`fuzzing`](crate::fuzzing)): no input may panic, and a restart is only
/// ever counted for a beat taken.
#[doc(hidden)]
pub(crate) fn fuzz_beats(data: &[u8]) {
    let instance = InstanceId(1);
    let m = Membership::detached(instance, Duration::from_secs(5));
    for beat in data.split(|&b| b == b'\n') {
        m.take(&Security::Off, b"fuzz", beat);
    }
    for rank in 0..8 {
        let _ = m.target(WorkerAddress::new(instance, rank));
        let _ = m.acknowledge(WorkerAddress::new(instance, rank));
    }
    let s = m.stats();
    assert!(s.restarts() <= s.beats());
}

/// A worker's heartbeat task: announces `rank` on `subject` every `interval` until `cancel`,
/// then once as departing.
pub(crate) fn spawn_beats(
    client: Client,
    subject: String,
    rank: RankTarget,
    interval: Duration,
    security: Arc<Security>,
    cancel: CancellationToken,
) -> tokio::task::JoinHandle<()> {
    let context = beat_context(&subject);
    tokio::spawn(async move {
        let beat = |departing: bool| {
            let body = serde_json::to_vec(&RankBeat {
                version: BEAT_VERSION,
                rank,
                departing,
            })
            .expect("a beat serializes");
            security.seal(&context, &body)
        };
        let mut tick = tokio::time::interval(interval);
        loop {
            tokio::select! {
                () = cancel.cancelled() => break,
                _ = tick.tick() => {
                    if let Err(e) = client.publish(subject.clone(), beat(false).into()).await {
                        tracing::warn!(worker = %rank.address, error = %e, "heartbeat not sent");
                    }
                }
            }
        }
        let _ = client.publish(subject.clone(), beat(true).into()).await;
        let _ = client.flush().await;
    })
}

#[cfg(test)]
mod tests;
