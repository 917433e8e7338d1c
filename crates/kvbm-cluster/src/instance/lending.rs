//! Leases, leader to leader: how an instance whose ranks are processes serves its G2 to a peer
//! and pulls a peer's (the rank plane, [`crate::dataplane::rank`], moves the bytes).
//!
//! ```text
//!  puller B (RankPull::pull)                         holder A (Lender)
//!   Take{lessee B, hashes} sealed ─► <subject>.lease.<A>   hold the present G2 blocks
//!                                                          Lend to every rank (all Lent, or
//!                                                          EndLease everywhere, refused)
//!   ◄─ Lent{lease, (hash, digest)…, every rank's address}  sealed for this request
//!   PullSlices to every own rank (rank r from A's rank r), join
//!   register the blocks every rank verified (digest: own identity, else the lease's)
//!   Release{lease} sealed (spawned) ─►                     EndLease on every rank (each waits
//!                                                          for its reads), then drop the holds
//! ```
//!
//! # Invariants
//!
//! * A holder drops a lease's block holds only after every rank answered its `EndLease` (or
//!   the call failed: a rank lost or timed out is treated as gone, as for transfers), so no
//!   slot is rewritten while a rank reads it. A lease nobody releases ends at its expiry
//!   (`transport.pull_deadline_ms` after it was lent, plus the request timeout).
//! * With security on, a take or release opens only from a leader of the namespace, for
//!   itself (a take names its own instance as lessee; a release ends only its own lease);
//!   the answer is sealed for the request and accepted only from the holder's leader.
//! * A block is registered on the puller only when every rank verified its slice (frame
//!   checksums, identity, the lease's digest), and with the digest this instance derives
//!   itself when it knows one (a lease naming another fails the block).
//! * At most [`MAX_LEASES`] leases are out at once per holder, [`MAX_LEASES_PER_LESSEE`] to one
//!   puller, and leases hold at most three quarters of the holder's G2 blocks in all: more
//!   takes are refused (a member taking leases it never releases cannot pin the holder's whole
//!   G2; a quarter stays evictable for its own work).
//!
//! # Locks
//!
//! The lender's lease map: one `parking_lot` mutex, held for a map operation, never across an
//! `.await` (holds are moved out before the ranks are told).

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use async_nats::Client;
use futures::FutureExt;
use futures::StreamExt;
use futures::future::{BoxFuture, join_all};
use kvbm_logical::{BlockDigest, BlockManager, G2, ImmutableBlock, MutableBlock, SequenceHash};
use kvbm_offload::{BlockFailure, BlockFailureKind, MoveOutcome};
use parking_lot::Mutex;
use serde::{Deserialize, Serialize};
use tokio_util::sync::CancellationToken;

use crate::dataplane::lease::LentBlock;
use crate::security::{Role, Security};
use crate::transport::control::{ControlRequest, ControlResponse, ControlledWorkers, WireFailure};
use crate::transport::nats::{InboxReply, reply_context, request_first_valid};
use kvbm_engine::InstanceId;
use kvbm_engine::cross_instance::{CrossInstanceIndex, RemotePull};
use kvbm_engine::error::{EngineError, Result};
use kvbm_engine::runtime::RuntimeHandle;
use kvbm_engine::stack::Identities;

/// Most leases one holder has out at once.
pub const MAX_LEASES: usize = 256;

/// Most leases one holder has out to one puller at once: a member that takes leases and never
/// releases them holds at most this many until they expire.
pub const MAX_LEASES_PER_LESSEE: usize = 8;

/// Version of the lease messages.
const LEASE_WIRE_VERSION: u32 = 1;

/// The subject `instance` answers lease requests on, under its events subject.
pub(crate) fn lease_subject(prefix: &str, instance: InstanceId) -> String {
    format!("{prefix}.lease.{:016x}", instance.0)
}

fn lease_context(subject: &str) -> Vec<u8> {
    format!("kvbm/lease/{subject}").into_bytes()
}

#[derive(Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct LeaseWire<T> {
    version: u32,
    body: T,
}

#[derive(Debug, Serialize, Deserialize)]
enum LeaseRequest {
    /// Lend the present blocks of `hashes` to `lessee`'s ranks.
    Take {
        lessee: InstanceId,
        hashes: Vec<SequenceHash>,
    },
    /// End `lease` (the lessee's own).
    Release { lessee: InstanceId, lease: u128 },
}

#[derive(Debug, Serialize, Deserialize)]
enum LeaseAnswer {
    /// Lent: the present blocks with their digests, every rank's rank-plane address.
    Lent {
        lease: u128,
        blocks: Vec<(SequenceHash, Option<BlockDigest>)>,
        ranks: Vec<String>,
    },
    /// None of the blocks is held.
    NoneHeld,
    /// Released.
    Released,
    /// Refused, and why.
    Refused(String),
}

struct Held {
    lessee: InstanceId,
    expires: Instant,
    blocks: Vec<ImmutableBlock<G2>>,
}

/// Counters of a lender (tests and logs).
#[derive(Debug, Default)]
pub struct LenderStats {
    /// Leases lent.
    pub lent: AtomicU64,
    /// Leases ended (released or expired).
    pub ended: AtomicU64,
    /// Requests refused (not a leader for itself, undecodable, too many, a rank failed).
    pub refused: AtomicU64,
}

/// The holder's side: answers lease requests on its subject until cancelled. See the
/// [module docs](self).
pub(crate) struct Lender {
    workers: Arc<ControlledWorkers>,
    held: Mutex<HashMap<u128, Held>>,
    ttl: Duration,
    stats: Arc<LenderStats>,
}

impl Lender {
    /// Starts answering on `<prefix>.lease.<this>`: lends `g2`'s blocks through `workers`.
    ///
    /// # Errors
    /// [`EngineError::Nats`] when the subject cannot be subscribed.
    #[allow(clippy::too_many_arguments)]
    pub(crate) async fn start(
        rt: &RuntimeHandle,
        cancel: CancellationToken,
        client: Client,
        prefix: &str,
        this: InstanceId,
        security: Arc<Security>,
        g2: Arc<BlockManager<G2>>,
        workers: Arc<ControlledWorkers>,
        ttl: Duration,
        max_blocks: usize,
    ) -> Result<Arc<LenderStats>> {
        let subject = lease_subject(prefix, this);
        let sub = {
            let (client, to) = (client.clone(), subject.clone());
            rt.spawn(async move {
                let s = client.subscribe(to).await;
                let _ = client.flush().await;
                s
            })?
            .await
            .map_err(|e| EngineError::Nats {
                url: subject.clone(),
                message: format!("lease task: {e}"),
            })?
            .map_err(|e| EngineError::Nats {
                url: subject.clone(),
                message: e.to_string(),
            })?
        };
        let lender = Arc::new(Lender {
            workers,
            held: Mutex::new(HashMap::new()),
            ttl,
            stats: Arc::new(LenderStats::default()),
        });
        let stats = lender.stats.clone();
        // Expiry: a lease nobody released ends at its deadline.
        {
            let (lender, cancel) = (lender.clone(), cancel.clone());
            rt.spawn(async move {
                let mut tick = tokio::time::interval((ttl / 4).max(Duration::from_millis(100)));
                loop {
                    tokio::select! {
                        () = cancel.cancelled() => return,
                        _ = tick.tick() => {}
                    }
                    let now = Instant::now();
                    let expired: Vec<u128> = lender
                        .held
                        .lock()
                        .iter()
                        .filter(|(_, h)| h.expires <= now)
                        .map(|(id, _)| *id)
                        .collect();
                    for id in expired {
                        lender.end(id, None).await;
                    }
                }
            })?;
        }
        rt.spawn(async move {
            let ctx = lease_context(&subject);
            let mut sub = sub;
            loop {
                let message = tokio::select! {
                    () = cancel.cancelled() => return,
                    m = sub.next() => match m { Some(m) => m, None => return },
                };
                let Some(reply) = message.reply.clone() else {
                    lender.stats.refused.fetch_add(1, Ordering::Relaxed);
                    continue;
                };
                // A message that does not open (forged, replayed, another namespace) is dropped
                // unanswered and counted.
                let Ok((sender, payload)) = security.open(&ctx, &message.payload) else {
                    lender.stats.refused.fetch_add(1, Ordering::Relaxed);
                    continue;
                };
                let request = match serde_json::from_slice::<LeaseWire<LeaseRequest>>(payload) {
                    Ok(w) if w.version == LEASE_WIRE_VERSION => w.body,
                    _ => {
                        lender.stats.refused.fetch_add(1, Ordering::Relaxed);
                        continue;
                    }
                };
                // A leader of the namespace, asking for itself (security on).
                let lessee = match &request {
                    LeaseRequest::Take { lessee, .. } | LeaseRequest::Release { lessee, .. } => {
                        *lessee
                    }
                };
                if let Some(s) = sender.as_deref()
                    && (s.role != Role::Leader || s.instance != lessee || lessee == this)
                {
                    security.count(crate::security::Rejection::NotAllowed);
                    lender.stats.refused.fetch_add(1, Ordering::Relaxed);
                    tracing::warn!(sender = %s, "lease request from a member that may not make it dropped");
                    continue;
                }
                let reply_ctx = reply_context("lease-reply", &message.payload);
                let (lender, g2, client, security) =
                    (lender.clone(), g2.clone(), client.clone(), security.clone());
                tokio::spawn(async move {
                    let answer = match request {
                        LeaseRequest::Take { hashes, .. } if hashes.len() > max_blocks => {
                            lender.stats.refused.fetch_add(1, Ordering::Relaxed);
                            LeaseAnswer::Refused(format!(
                                "{} blocks asked, at most {max_blocks}",
                                hashes.len()
                            ))
                        }
                        LeaseRequest::Take { lessee, hashes } => {
                            lender.take(&g2, lessee, &hashes).await
                        }
                        LeaseRequest::Release { lessee, lease } => {
                            lender.end(lease, Some(lessee)).await;
                            LeaseAnswer::Released
                        }
                    };
                    let body = LeaseWire {
                        version: LEASE_WIRE_VERSION,
                        body: answer,
                    };
                    let bytes = serde_json::to_vec(&body).expect("lease answers serialize");
                    let sealed = security.seal(&reply_ctx, &bytes);
                    if let Err(e) = client.publish(reply, sealed.into()).await {
                        tracing::debug!(error = %e, "lease answer not sent");
                    }
                });
            }
        })?;
        Ok(stats)
    }

    /// Holds the present blocks of `hashes` and lends them on every rank.
    async fn take(
        &self,
        g2: &BlockManager<G2>,
        lessee: InstanceId,
        hashes: &[SequenceHash],
    ) -> LeaseAnswer {
        let refused = |why: String| {
            self.stats.refused.fetch_add(1, Ordering::Relaxed);
            LeaseAnswer::Refused(why)
        };
        let blocks = g2.scan_matches(hashes);
        if blocks.is_empty() {
            return LeaseAnswer::NoneHeld;
        }
        let Ok(random) = crate::security::random32() else {
            return refused("no randomness for a lease id".to_owned());
        };
        let lease = u128::from_le_bytes(random[..16].try_into().expect("16 bytes"));
        let lent: Vec<LentBlock> = blocks
            .iter()
            .map(|b| LentBlock {
                hash: b.sequence_hash(),
                slot: b.block_id(),
                registration: b.registration(),
                digest: b.digest(),
            })
            .collect();
        // The caps checked and the lease recorded under one lock (concurrent takes cannot
        // overshoot them), before the ranks serve it (so an expiry or a release finds it).
        {
            let mut held = self.held.lock();
            let to_lessee = held.values().filter(|h| h.lessee == lessee).count();
            // Pinned blocks: one held by several leases counts once.
            let pinned: std::collections::HashSet<usize> = held
                .values()
                .flat_map(|h| h.blocks.iter().map(|b| b.block_id()))
                .chain(blocks.iter().map(|b| b.block_id()))
                .collect();
            let why = if held.len() >= MAX_LEASES {
                Some(format!("{MAX_LEASES} leases are out already"))
            } else if to_lessee >= MAX_LEASES_PER_LESSEE {
                Some(format!(
                    "{MAX_LEASES_PER_LESSEE} leases are out to {lessee} already"
                ))
            } else if pinned.len() > g2.total_blocks() * 3 / 4 {
                Some(format!(
                    "leases would hold {} of {} G2 blocks (at most three quarters)",
                    pinned.len(),
                    g2.total_blocks()
                ))
            } else {
                None
            };
            if let Some(why) = why {
                drop(held);
                return refused(why);
            }
            held.insert(
                lease,
                Held {
                    lessee,
                    expires: Instant::now() + self.ttl,
                    blocks,
                },
            );
        }
        let request = ControlRequest::Lend {
            lease,
            lessee,
            ttl_ms: self.ttl.as_millis() as u64,
            blocks: lent.clone(),
        };
        let mut ranks = Vec::new();
        let mut failed = None;
        for (r, reply) in self
            .workers
            .ranks()
            .iter()
            .zip(self.workers.call_all(&request).await)
        {
            match reply {
                Ok(ControlResponse::Lent { data_plane }) => ranks.push(data_plane),
                Ok(other) => {
                    failed.get_or_insert(format!("{}: answered {other:?}", r.address()));
                }
                Err(e) => {
                    failed.get_or_insert(e.to_string());
                }
            }
        }
        if let Some(why) = failed {
            self.end(lease, None).await;
            self.stats.refused.fetch_add(1, Ordering::Relaxed);
            return LeaseAnswer::Refused(format!("a rank could not lend: {why}"));
        }
        self.stats.lent.fetch_add(1, Ordering::Relaxed);
        LeaseAnswer::Lent {
            lease,
            blocks: lent.iter().map(|b| (b.hash, b.digest)).collect(),
            ranks,
        }
    }

    /// Ends `lease` (only `lessee`'s, when given): every rank stops serving it (each waits for
    /// its reads), then the holds drop.
    async fn end(&self, lease: u128, lessee: Option<InstanceId>) {
        let held = {
            let mut held = self.held.lock();
            match held.get(&lease) {
                Some(h) if lessee.is_none_or(|l| l == h.lessee) => held.remove(&lease),
                _ => None,
            }
        };
        let Some(held) = held else {
            return;
        };
        // A rank that does not answer is treated as gone (as for transfers): its reads end
        // with its process.
        for (r, reply) in self.workers.ranks().iter().zip(
            self.workers
                .call_all(&ControlRequest::EndLease { lease })
                .await,
        ) {
            if let Err(e) = reply {
                tracing::warn!(worker = %r.address(), error = %e, "a rank did not end a lease");
            }
        }
        drop(held);
        self.stats.ended.fetch_add(1, Ordering::Relaxed);
    }
}

/// How a puller reaches holders' lease subjects.
#[derive(Clone)]
pub(crate) struct Asker {
    pub(crate) client: Client,
    /// The events subject (lease subjects are under it).
    pub(crate) prefix: String,
    pub(crate) security: Arc<Security>,
    pub(crate) timeout: Duration,
}

impl Asker {
    /// Sends `request` to `holder`'s lease subject and reads its leader's answer (a forged
    /// answer published first is dropped and counted, never taken).
    async fn ask(
        &self,
        holder: InstanceId,
        request: LeaseRequest,
    ) -> std::result::Result<LeaseAnswer, String> {
        let subject = lease_subject(&self.prefix, holder);
        let bytes = serde_json::to_vec(&LeaseWire {
            version: LEASE_WIRE_VERSION,
            body: request,
        })
        .expect("lease requests serialize");
        let sealed = self.security.seal(&lease_context(&subject), &bytes);
        let ctx = reply_context("lease-reply", &sealed);
        let security = &self.security;
        let got = request_first_valid(
            &self.client,
            subject,
            sealed.into(),
            self.timeout,
            |bytes| {
                let (sender, payload) = security.open(&ctx, bytes).ok()?;
                if sender
                    .as_deref()
                    .is_some_and(|s| s.role != Role::Leader || s.instance != holder)
                {
                    security.count(crate::security::Rejection::NotAllowed);
                    return None;
                }
                serde_json::from_slice::<LeaseWire<LeaseAnswer>>(payload)
                    .ok()
                    .filter(|w| w.version == LEASE_WIRE_VERSION)
                    .map(|w| w.body)
            },
        )
        .await;
        match got {
            InboxReply::Valid(a) => Ok(a),
            InboxReply::TimedOut => Err(format!("no lease answer within {:?}", self.timeout)),
            InboxReply::NoResponders => Err("no lease responder (the peer lends nothing)".into()),
            InboxReply::Transport(m) => Err(m),
        }
    }
}

/// The puller's side: a [`RemotePull`] through a peer's lease and this instance's ranks. See
/// the [module docs](self).
pub(crate) struct RankPull {
    pub(crate) asker: Asker,
    pub(crate) this: InstanceId,
    pub(crate) g2: Arc<BlockManager<G2>>,
    pub(crate) workers: Arc<ControlledWorkers>,
    pub(crate) identities: Arc<Identities>,
    pub(crate) index: Arc<CrossInstanceIndex>,
    /// Bytes of a whole block (every rank's slice): what the metrics count per block.
    pub(crate) block_bytes: usize,
}

impl RankPull {
    async fn pull_leased(
        &self,
        holder: InstanceId,
        hashes: &[SequenceHash],
        destinations: Vec<MutableBlock<G2>>,
    ) -> Vec<MoveOutcome<G2>> {
        let n = hashes.len();
        let fail = |kind: BlockFailureKind, m: String| -> Vec<MoveOutcome<G2>> {
            crate::dataplane::fail_all(n, &BlockFailure::new(kind, m))
        };
        if destinations.len() != n {
            return fail(
                BlockFailureKind::Refused,
                format!("{} destinations for {n} blocks", destinations.len()),
            );
        }
        if let Some(d) = destinations.iter().find(|d| !self.g2.owns(d)) {
            return fail(
                BlockFailureKind::Refused,
                format!("slot {} is not a block of this instance's G2", d.block_id()),
            );
        }
        let take = LeaseRequest::Take {
            lessee: self.this,
            hashes: hashes.to_vec(),
        };
        let (lease, lent, ranks) = match self.asker.ask(holder, take).await {
            Ok(LeaseAnswer::Lent {
                lease,
                blocks,
                ranks,
            }) => (lease, blocks, ranks),
            Ok(LeaseAnswer::NoneHeld) => {
                for h in hashes {
                    self.index.forget(holder, *h, kvbm_logical::TierId::G2);
                }
                return fail(
                    BlockFailureKind::NotFound,
                    format!("{holder} holds none of the blocks"),
                );
            }
            Ok(other) => {
                return fail(
                    BlockFailureKind::Refused,
                    format!("{holder} did not lend: {other:?}"),
                );
            }
            Err(m) => return fail(BlockFailureKind::Io, format!("lease from {holder}: {m}")),
        };
        let out = self
            .pull_lent(holder, hashes, destinations, &lent, &ranks)
            .await;
        // Released in the background: the holder's holds end with it (or at its expiry).
        let (asker, this) = (self.asker.clone(), self.this);
        tokio::spawn(async move {
            let release = LeaseRequest::Release {
                lessee: this,
                lease,
            };
            if let Err(m) = asker.ask(holder, release).await {
                tracing::debug!(%holder, error = m, "lease release not answered (it expires)");
            }
        });
        out
    }

    /// Every rank pulls its slice of the lent blocks; a block is registered when every rank
    /// verified it.
    async fn pull_lent(
        &self,
        holder: InstanceId,
        hashes: &[SequenceHash],
        destinations: Vec<MutableBlock<G2>>,
        lent: &[(SequenceHash, Option<BlockDigest>)],
        ranks: &[String],
    ) -> Vec<MoveOutcome<G2>> {
        let n = hashes.len();
        let world = self.workers.ranks().len();
        let lent: HashMap<SequenceHash, Option<BlockDigest>> = lent.iter().copied().collect();
        // Per block: the digest to register with, or why it will not be pulled.
        let mut plan: Vec<std::result::Result<Option<BlockDigest>, BlockFailure>> = hashes
            .iter()
            .map(|h| match lent.get(h) {
                None => {
                    self.index.forget(holder, *h, kvbm_logical::TierId::G2);
                    Err(BlockFailure::new(
                        BlockFailureKind::NotFound,
                        format!("block {:032x} is not held by {holder}", h.as_u128()),
                    ))
                }
                Some(d) => crate::dataplane::own_digest(&self.identities, *h, *d, holder),
            })
            .collect();
        if ranks.len() != world {
            let m = format!(
                "{holder} lent on {} ranks, this instance has {world}",
                ranks.len()
            );
            for p in plan.iter_mut().filter(|p| p.is_ok()) {
                *p = Err(BlockFailure::new(BlockFailureKind::Refused, m.clone()));
            }
        }
        let wanted: Vec<usize> = (0..n).filter(|i| plan[*i].is_ok()).collect();
        if !wanted.is_empty() {
            let request = |r: usize| ControlRequest::PullSlices {
                from: ranks[r].clone(),
                holder,
                hashes: wanted.iter().map(|i| hashes[*i]).collect(),
                digests: wanted
                    .iter()
                    .map(|i| lent.get(&hashes[*i]).copied().flatten())
                    .collect(),
                slots: wanted.iter().map(|i| destinations[*i].block_id()).collect(),
            };
            let replies = join_all(self.workers.ranks().iter().enumerate().map(|(r, c)| {
                // SAFETY: the destination slots are mutable blocks of this instance's G2
                // (checked by the caller), held by `destinations` until every rank settled
                // (`join_all`): reserved for this request on every rank, as for a transfer.
                unsafe { c.call_unchecked(request(r)) }
            }))
            .await;
            for (c, reply) in self.workers.ranks().iter().zip(replies) {
                let outcomes: Vec<std::result::Result<(), BlockFailure>> = match reply {
                    Ok(ControlResponse::Transferred(v)) if v.len() == wanted.len() => v
                        .into_iter()
                        .map(|o| o.map_err(WireFailure::into_failure))
                        .collect(),
                    Ok(other) => {
                        let m = format!("{}: answered {other:?}", c.address());
                        vec![Err(BlockFailure::new(BlockFailureKind::Transfer, m)); wanted.len()]
                    }
                    Err(e) => {
                        let f = BlockFailure::new(e.failure_kind(), e.to_string());
                        vec![Err(f); wanted.len()]
                    }
                };
                for (i, o) in wanted.iter().zip(outcomes) {
                    if let (Ok(_), Err(f)) = (&plan[*i], o) {
                        // Bytes that failed their checksum or identity prove the copy bad.
                        if f.kind.drops_copy() {
                            self.index
                                .forget(holder, hashes[*i], kvbm_logical::TierId::G2);
                        }
                        plan[*i] = Err(f);
                    }
                }
            }
        }
        crate::dataplane::register_verified(&self.g2, hashes, destinations, plan)
    }
}

impl RemotePull for RankPull {
    fn destination(&self) -> &Arc<BlockManager<G2>> {
        &self.g2
    }

    fn pull<'a>(
        &'a self,
        instance: InstanceId,
        hashes: &'a [SequenceHash],
        destinations: Vec<MutableBlock<G2>>,
    ) -> BoxFuture<'a, Vec<MoveOutcome<G2>>> {
        async move {
            let started = Instant::now();
            let out = self.pull_leased(instance, hashes, destinations).await;
            crate::dataplane::publish_pull(&out, self.block_bytes, started);
            out
        }
        .boxed()
    }
}
