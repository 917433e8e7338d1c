//! [`DataPlaneClient`]: pulls blocks from other instances' data-plane servers into local G2.
//!
//! Each payload is read straight into the destination block's host memory (the caller
//! allocated it, so the slot is exclusively ours until it is registered or dropped), then
//! checksummed against the frame header; only verified blocks are completed and registered.
//! A payload is read in one vectored read together with the next frame's header (its size is
//! fixed and a response's frame count known), so a frame costs the kernel one receive, not
//! two; that header is still checked, tag first, before any byte of its own payload is read.
//! Connections are reused: one returns to a small per-peer idle pool only after a response
//! was read in full and verified; any failure drops it.
//!
//! Bounds: the pool keeps connections of at most `max_idle_peers` addresses (least recently
//! used evicted, [`ClientStats::pool_evictions`]), `max_idle_per_peer` each, none reused once
//! older than `idle_expiry` (expired ones are closed whenever the pool is touched); one whole
//! request must finish within `pull_deadline` ([`ClientStats::deadlines_exceeded`]). At most
//! `max_connections_per_peer` pulls run at once against one peer address (the server's
//! per-peer cap, so a well-behaved client queues rather than being refused); the rest wait for
//! a permit. The pool's mutex and the permits' mutex are leaves, each taken only briefly and
//! never across an `.await` (a permit is awaited after its mutex is released).

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use futures::FutureExt;
use futures::future::BoxFuture;
use kvbm_logical::{BlockDigest, BlockManager, G2, MutableBlock, SequenceHash};
use kvbm_physical::PhysicalLayout;
use kvbm_physical::checksum::checksum_slices;
use kvbm_physical::identity::scoped_geometry_digest;
use parking_lot::Mutex;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use super::handshake::{self, Party, Session};
use super::wire::{
    self, FRAME_HEADER_LEN, Frame, RESPONSE_HEAD_LEN, RequestHead, TAG_LEN, VERSION, VERSION_AUTH,
};
use super::{DataPlaneConfig, PeerDirectory};
use crate::security::{Rejection, Security};
use kvbm_engine::InstanceId;
use kvbm_engine::cross_instance::{CrossInstanceIndex, RemotePull};
use kvbm_engine::error::{EngineError, Result};
use kvbm_engine::stack::Identities;
use kvbm_offload::{BlockFailure, BlockFailureKind, MoveOutcome};

/// Pulls remote G2 blocks into this instance's G2: see the [module docs](crate::dataplane).
pub struct DataPlaneClient {
    link: Link,
    manager: Arc<BlockManager<G2>>,
    peers: Arc<PeerDirectory>,
    /// The digests this instance knows itself (from its own keys): a peer's frame must name
    /// the same, and the block is registered with this instance's, never the peer's.
    identities: Arc<Identities>,
    digests_refused: AtomicU64,
    /// The index of what peers hold: an entry a pull proved wrong is forgotten.
    index: Option<Arc<CrossInstanceIndex>>,
    entries_forgotten: AtomicU64,
}

/// One verified frame (with the digest the server recorded for the block, if any), or why
/// the block did not come.
pub(crate) type Verified = std::result::Result<Option<BlockDigest>, BlockFailure>;

/// The connections, the protocol and the checks of pulling blocks into slots of a host
/// layout, from servers of one [`Party`] (the instance plane's leaders, or one rank of the
/// rank plane): what [`DataPlaneClient`] and a worker rank's slice puller
/// ([`crate::dataplane::rank`]) share. It writes slots and verifies frames; registering what
/// it verified is its owner's.
pub(crate) struct Link {
    party: Party,
    layout: Arc<PhysicalLayout>,
    config: DataPlaneConfig,
    geometry: u64,
    block_bytes: usize,
    idle: Mutex<Pool>,
    /// Permits for pulls in flight per peer address; an entry nobody holds or awaits is
    /// removed when the map is next touched.
    in_flight: Mutex<HashMap<IpAddr, Arc<Semaphore>>>,
    deadlines_exceeded: AtomicU64,
    pool_evictions: AtomicU64,
    security: Arc<Security>,
    handshakes_refused: AtomicU64,
    tags_refused: AtomicU64,
}

/// A frame header, and its tag when authenticated.
type RawHeader = [u8; FRAME_HEADER_LEN + TAG_LEN];

/// One connection to a peer: authenticated (a session with the leader of the instance it
/// is pooled under) or not.
struct Conn {
    stream: TcpStream,
    session: Option<Session>,
}

/// Idle connections by peer (address and the instance pulled from there: an authenticated
/// connection is reused only for the instance it proved to be): each with when it was given
/// back; per peer, when it was last used (for the least-recently-used eviction).
#[derive(Default)]
struct Pool {
    peers: HashMap<(SocketAddr, InstanceId), PeerIdle>,
}

/// One peer's entry: when it was last used, and its idle connections with when each was
/// given back.
type PeerIdle = (Instant, Vec<(Conn, Instant)>);

impl Pool {
    /// Closes the connections idle longer than `expiry`, and forgets peers left with none.
    fn prune(&mut self, now: Instant, expiry: std::time::Duration) {
        self.peers.retain(|_, (_, v)| {
            v.retain(|(_, at)| now.duration_since(*at) < expiry);
            !v.is_empty()
        });
    }
}

/// A copy of a [`DataPlaneClient`]'s counters and pool size.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ClientStats {
    /// Requests that did not finish within the pull deadline (their blocks failed `Timeout`).
    pub deadlines_exceeded: u64,
    /// Peers whose idle connections were closed to make room for another peer's.
    pub pool_evictions: u64,
    /// Peers with idle connections in the pool now.
    pub idle_peers: usize,
    /// Idle connections in the pool now.
    pub idle_connections: usize,
    /// Connections refused during the authenticated handshake (security on): the server is
    /// not a member of this namespace, not the instance asked for, did not prove its key, or
    /// does not speak the authenticated protocol. Nothing was requested from it.
    pub handshakes_refused: u64,
    /// Response heads and frames whose tag did not verify (tampered, replayed or reordered):
    /// the request failed, nothing of it after the bad frame was registered.
    pub tags_refused: u64,
    /// Blocks refused because the peer named a digest other than the one this instance knows
    /// for the block ([`DataPlaneClient::with_identities`]); the stream stayed usable.
    pub digests_refused: u64,
    /// Index entries forgotten because a pull proved them wrong: the peer did not hold the
    /// block, or named another identity for it ([`DataPlaneClient::with_index`]).
    pub entries_forgotten: u64,
}

impl std::fmt::Debug for DataPlaneClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DataPlaneClient")
            .field("block_bytes", &self.link.block_bytes)
            .field("config", &self.link.config)
            .finish_non_exhaustive()
    }
}

/// Why a whole request failed (every block not yet settled fails with it).
struct RequestFailed {
    failure: BlockFailure,
    /// Nothing of the response was read: a stale pooled connection may be the cause.
    before_response: bool,
}

impl DataPlaneClient {
    /// A client pulling into `manager`'s blocks, whose bytes live in the host `layout`
    /// (indexed by block id), finding peers in `peers`.
    ///
    /// # Errors
    /// [`EngineError::Config`] when `layout` is not host memory or has fewer slots than the
    /// manager.
    pub fn new(
        config: DataPlaneConfig,
        manager: Arc<BlockManager<G2>>,
        layout: Arc<PhysicalLayout>,
        peers: Arc<PeerDirectory>,
    ) -> Result<Self> {
        Self::new_secured(config, manager, layout, peers, Arc::new(Security::Off))
    }

    /// [`new`](Self::new) with this member's `security`: when on, each new connection runs
    /// the authenticated handshake first and pulls only from a leader of this namespace that
    /// proves to be the instance asked for; every head and frame is tagged.
    ///
    /// # Errors
    /// As [`new`](Self::new).
    pub fn new_secured(
        config: DataPlaneConfig,
        manager: Arc<BlockManager<G2>>,
        layout: Arc<PhysicalLayout>,
        peers: Arc<PeerDirectory>,
        security: Arc<Security>,
    ) -> Result<Self> {
        let c = *layout.layout().config();
        if c.num_blocks < manager.total_blocks() {
            return Err(EngineError::config(
                "dataplane.layout",
                format!(
                    "layout has {} blocks, the G2 manager {}",
                    c.num_blocks,
                    manager.total_blocks()
                ),
            ));
        }
        Ok(Self {
            link: Link::new(Party::Leader, config, layout, security)?,
            manager,
            peers,
            identities: Arc::default(),
            digests_refused: AtomicU64::new(0),
            index: None,
            entries_forgotten: AtomicU64::new(0),
        })
    }

    /// The index of what peers hold (the one the leader searches): when a pull proves an
    /// entry wrong (the peer answered that it does not hold the block, or named another
    /// identity for it than this instance knows), the entry is forgotten, so lookups stop
    /// routing the block to that peer until it announces the block again. A frame that fails
    /// its checksum or tag leaves the entry (the damage may be in transit).
    #[must_use]
    pub fn with_index(mut self, index: Arc<CrossInstanceIndex>) -> Self {
        self.index = Some(index);
        self
    }

    /// The digests this instance knows itself (from its own keys, e.g. vLLM's block hashes):
    /// a frame naming another digest for one of these blocks is refused
    /// ([`BlockFailureKind::IdentityMismatch`], counted as
    /// [`ClientStats::digests_refused`]), and a pulled block is registered with this
    /// instance's digest, so what G3 and G4 headers record is never a peer's choice. A block
    /// it does not know keeps the digest the peer's frame names (bound to the block's hash:
    /// `wire::check_frame`).
    #[must_use]
    pub fn with_identities(mut self, identities: Arc<Identities>) -> Self {
        self.identities = identities;
        self
    }

    /// The counters, and the pool's size (after closing expired connections).
    pub fn stats(&self) -> ClientStats {
        ClientStats {
            digests_refused: self.digests_refused.load(Ordering::Relaxed),
            entries_forgotten: self.entries_forgotten.load(Ordering::Relaxed),
            ..self.link.stats()
        }
    }

    /// The peer directory it resolves instances in.
    pub fn peers(&self) -> &Arc<PeerDirectory> {
        &self.peers
    }
    /// Pulls `hashes[i]` from `instance`'s server at `addr` into `destinations[i]`. One
    /// outcome per block, in order; a block is registered in the local G2 manager only if its
    /// frame verified (identity, binding, geometry, length, checksum).
    pub async fn pull_from(
        &self,
        addr: SocketAddr,
        instance: InstanceId,
        hashes: &[SequenceHash],
        destinations: Vec<MutableBlock<G2>>,
    ) -> Vec<MoveOutcome<G2>> {
        if destinations.len() != hashes.len() {
            let m = format!(
                "{} destinations for {} blocks",
                destinations.len(),
                hashes.len()
            );
            return fail_all(
                hashes.len(),
                &BlockFailure::new(BlockFailureKind::Refused, m),
            );
        }
        // A destination of another manager may name a slot outside this client's layout, or
        // one lent to someone else: every destination is checked before a byte is written.
        if let Some((i, d)) = destinations
            .iter()
            .enumerate()
            .find(|(_, d)| !self.manager.owns(d))
        {
            let m = format!(
                "destination {i} (slot {}) is not a block of this client's G2 manager",
                d.block_id()
            );
            return fail_all(
                hashes.len(),
                &BlockFailure::new(BlockFailureKind::Refused, m),
            );
        }
        let started = Instant::now();
        let slots: Vec<usize> = destinations.iter().map(|d| d.block_id()).collect();
        // SAFETY: every slot is a mutable block of the manager this layout covers (checked
        // above), owned by `destinations` until this returns: nothing else reads or writes it.
        let verified = unsafe { self.link.pull_slots(addr, instance, hashes, &slots) }.await;
        let peer = format!("{instance} at {addr}");
        // Per block: the digest to register it with (this instance's own when it knows the
        // block, else the one the server recorded, bound to the hash by the frame: it travels
        // on to G3/G4 headers and the next pull), or why not.
        let plan: Vec<Verified> = hashes
            .iter()
            .zip(verified)
            .map(|(&hash, v)| {
                let digest = v.and_then(|announced| self.own_digest(hash, announced, &peer));
                if let Err(f) = &digest
                    // The peer said it does not hold the block, or its bytes failed their
                    // checksum or identity: the index stops sending pulls there (a broken
                    // stream says nothing of the copy).
                    && (f.kind == BlockFailureKind::NotFound || f.kind.drops_copy())
                {
                    self.forget(instance, hash);
                }
                digest
            })
            .collect();
        let out = register_verified(&self.manager, hashes, destinations, plan);
        self.publish(&out, started);
        out
    }

    /// What a pull brought, into the metrics: the blocks pulled and their bytes, the blocks
    /// it did not bring by failure kind, and its time.
    fn publish(&self, out: &[MoveOutcome<G2>], started: Instant) {
        publish_pull(out, self.link.block_bytes, started);
    }

    /// Forgets the index entry saying `instance` holds `hash` in G2 (a pull proved it wrong).
    fn forget(&self, instance: InstanceId, hash: SequenceHash) {
        if let Some(index) = &self.index
            && index.forget(instance, hash, kvbm_logical::TierId::G2)
        {
            self.entries_forgotten.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// The digest a pulled block is registered with: this instance's own when it knows the
    /// block (the peer's must then be the same, or absent), else the one the peer announced.
    fn own_digest(
        &self,
        hash: SequenceHash,
        announced: Option<BlockDigest>,
        peer: impl std::fmt::Display,
    ) -> std::result::Result<Option<BlockDigest>, BlockFailure> {
        own_digest(&self.identities, hash, announced, peer).inspect_err(|_| {
            self.digests_refused.fetch_add(1, Ordering::Relaxed);
        })
    }
}

impl Link {
    /// Pulls from servers of `party` into the host `layout`.
    ///
    /// # Errors
    /// [`EngineError::Config`] when `layout` is not host memory.
    pub(crate) fn new(
        party: Party,
        config: DataPlaneConfig,
        layout: Arc<PhysicalLayout>,
        security: Arc<Security>,
    ) -> Result<Self> {
        wire::check_host(&layout)?;
        let c = *layout.layout().config();
        Ok(Self {
            party,
            geometry: scoped_geometry_digest(&c, config.scope),
            block_bytes: c.block_bytes(),
            layout,
            config,
            idle: Mutex::new(Pool::default()),
            in_flight: Mutex::new(HashMap::new()),
            deadlines_exceeded: AtomicU64::new(0),
            pool_evictions: AtomicU64::new(0),
            security,
            handshakes_refused: AtomicU64::new(0),
            tags_refused: AtomicU64::new(0),
        })
    }

    /// Its counters and the pool's size (after closing expired connections).
    pub(crate) fn stats(&self) -> ClientStats {
        let (idle_peers, idle_connections) = {
            let mut pool = self.idle.lock();
            pool.prune(Instant::now(), self.config.idle_expiry);
            (
                pool.peers.len(),
                pool.peers.values().map(|(_, v)| v.len()).sum(),
            )
        };
        ClientStats {
            deadlines_exceeded: self.deadlines_exceeded.load(Ordering::Relaxed),
            pool_evictions: self.pool_evictions.load(Ordering::Relaxed),
            idle_peers,
            idle_connections,
            handshakes_refused: self.handshakes_refused.load(Ordering::Relaxed),
            tags_refused: self.tags_refused.load(Ordering::Relaxed),
            ..ClientStats::default()
        }
    }

    /// Pulls `hashes[i]` from `instance`'s server at `addr` into slot `slots[i]` of the layout:
    /// one verified frame or failure per block, in order. A failed block's slot may hold any
    /// bytes (part of a payload); nothing is written once this returns.
    ///
    /// # Safety
    /// Every slot is in range of the layout and exclusively the caller's until this returns
    /// (nothing else reads or writes it), even when the returned future is dropped early.
    pub(crate) async unsafe fn pull_slots(
        &self,
        addr: SocketAddr,
        instance: InstanceId,
        hashes: &[SequenceHash],
        slots: &[usize],
    ) -> Vec<Verified> {
        let n = hashes.len();
        if slots.len() != n {
            let m = format!("{} slots for {n} blocks", slots.len());
            return fail_all(n, &BlockFailure::new(BlockFailureKind::Refused, m));
        }
        let num_blocks = self.layout.layout().config().num_blocks;
        if let Some(s) = slots.iter().find(|s| **s >= num_blocks) {
            let m = format!("slot {s} is out of the layout's {num_blocks} blocks");
            return fail_all(n, &BlockFailure::new(BlockFailureKind::Refused, m));
        }
        // Held until every part is settled: at most `max_connections_per_peer` pulls per peer.
        let _permit = self.permit(addr.ip()).await;
        let mut out: Vec<Verified> = Vec::with_capacity(n);
        let per = self.config.max_blocks_per_request.max(1);
        for (chunk, part) in hashes.chunks(per).zip(slots.chunks(per)) {
            // A pooled connection may have been closed by the server meanwhile: when nothing
            // of the response was read, try once more on a fresh one.
            let mut settled = Vec::new();
            for attempt in 0..2 {
                let (stream, pooled) = match self.connection(addr, instance, attempt == 0).await {
                    Ok(s) => s,
                    Err(e) => {
                        settled = fail_all(part.len(), &e);
                        break;
                    }
                };
                // The whole request within the deadline; past it the future is dropped with
                // the connection, so nothing more is written to the slots.
                let r = tokio::time::timeout(
                    self.config.pull_deadline,
                    self.request(stream, addr, instance, chunk, part),
                )
                .await;
                let Ok(r) = r else {
                    self.deadlines_exceeded.fetch_add(1, Ordering::Relaxed);
                    metrics::counter!(kvbm_engine::metrics::DATAPLANE_PULL_DEADLINES_EXCEEDED)
                        .increment(1);
                    let f = BlockFailure::new(
                        BlockFailureKind::Timeout,
                        format!(
                            "data plane pull from {instance} at {addr}: not done within {:?} \
                             (transport.pull_deadline_ms)",
                            self.config.pull_deadline
                        ),
                    );
                    settled = fail_all(part.len(), &f);
                    break;
                };
                match r {
                    Ok(done) => {
                        settled = done;
                        break;
                    }
                    Err(failed) => {
                        if failed.before_response && pooled && attempt == 0 {
                            continue;
                        }
                        settled = fail_all(part.len(), &failed.failure);
                        break;
                    }
                }
            }
            out.extend(settled);
        }
        out
    }

    /// A permit to pull from `peer` (waits while `max_connections_per_peer` pulls run there).
    async fn permit(&self, peer: IpAddr) -> OwnedSemaphorePermit {
        let sem = {
            let mut m = self.in_flight.lock();
            // Entries only this map refers to are neither held nor awaited.
            m.retain(|_, s| Arc::strong_count(s) > 1);
            m.entry(peer)
                .or_insert_with(|| {
                    Arc::new(Semaphore::new(self.config.max_connections_per_peer.max(1)))
                })
                .clone()
        };
        sem.acquire_owned()
            .await
            .expect("the semaphore is never closed")
    }

    async fn connection(
        &self,
        addr: SocketAddr,
        instance: InstanceId,
        pooled_ok: bool,
    ) -> std::result::Result<(Conn, bool), BlockFailure> {
        if pooled_ok {
            let pooled = {
                let mut pool = self.idle.lock();
                pool.prune(Instant::now(), self.config.idle_expiry);
                match pool.peers.get_mut(&(addr, instance)) {
                    Some((used, v)) => v.pop().map(|(s, _)| {
                        *used = Instant::now();
                        s
                    }),
                    None => None,
                }
            };
            // A pooled session's server is checked again (revoked or expired since its
            // handshake: the connection is dropped, and a new handshake names why).
            match (pooled, self.security.verifier()) {
                (Some(conn), Some(v))
                    if conn
                        .session
                        .as_ref()
                        .is_some_and(|s| v.recheck(&s.peer).is_err()) => {}
                (Some(conn), _) => return Ok((conn, true)),
                (None, _) => {}
            }
        }
        let io = |e: std::io::Error| {
            BlockFailure::new(BlockFailureKind::Io, format!("connect to {addr}: {e}"))
        };
        let s = tokio::time::timeout(self.config.io_timeout, TcpStream::connect(addr))
            .await
            .map_err(|_| {
                BlockFailure::new(
                    BlockFailureKind::Timeout,
                    format!("connect to {addr} timed out"),
                )
            })?
            .map_err(io)?;
        s.set_nodelay(true).map_err(io)?;
        let Security::On(sealing) = &*self.security else {
            return Ok((
                Conn {
                    stream: s,
                    session: None,
                },
                false,
            ));
        };
        let mut s = s;
        let r = tokio::time::timeout(
            self.config.io_timeout,
            handshake::client(
                &mut s,
                sealing,
                super::payload_mac_for(self.config.payload_mac, addr.ip()),
                instance,
                self.party,
            ),
        )
        .await;
        let refused = |m: String, rejection: Option<Rejection>| {
            self.handshakes_refused.fetch_add(1, Ordering::Relaxed);
            metrics::counter!(kvbm_engine::metrics::DATAPLANE_HANDSHAKES_REFUSED).increment(1);
            if let Some(r) = rejection {
                sealing.verifier.stats().count(r);
            }
            BlockFailure::new(
                BlockFailureKind::Refused,
                format!("authenticated handshake with {addr} (pulling from {instance}): {m}"),
            )
        };
        match r {
            Ok(Ok(session)) => Ok((
                Conn {
                    stream: s,
                    session: Some(session),
                },
                false,
            )),
            // A server at its connection caps is not a refused handshake: it proved nothing
            // wrong of either side.
            Ok(Err(e)) if e.status == wire::Status::Busy => Err(BlockFailure::new(
                BlockFailureKind::Refused,
                format!("pulling from {instance} at {addr}: {}", e.message),
            )),
            Ok(Err(e)) => Err(refused(e.message, e.rejection)),
            Err(_) => Err(refused(
                format!("not finished within {:?}", self.config.io_timeout),
                None,
            )),
        }
    }

    fn give_back(&self, addr: SocketAddr, instance: InstanceId, stream: Conn) {
        let addr = (addr, instance);
        let now = Instant::now();
        let mut pool = self.idle.lock();
        pool.prune(now, self.config.idle_expiry);
        if !pool.peers.contains_key(&addr) && pool.peers.len() >= self.config.max_idle_peers {
            // Full of other peers: the least recently used one's connections are closed.
            let lru = pool
                .peers
                .iter()
                .min_by_key(|(_, (used, _))| *used)
                .map(|(a, _)| *a);
            if let Some(lru) = lru {
                pool.peers.remove(&lru);
                self.pool_evictions.fetch_add(1, Ordering::Relaxed);
                metrics::counter!(kvbm_engine::metrics::DATAPLANE_POOL_EVICTIONS).increment(1);
            }
        }
        let (used, v) = pool.peers.entry(addr).or_insert_with(|| (now, Vec::new()));
        *used = now;
        if v.len() < self.config.max_idle_per_peer {
            v.push((stream, now));
        }
    }

    /// One request into `slots` (the caller's, see [`pull_slots`](Self::pull_slots)). `Err`
    /// when nothing settled (so the caller can retry); after a failure mid-response, the
    /// unsettled rest is failed here.
    async fn request(
        &self,
        mut conn: Conn,
        addr: SocketAddr,
        instance: InstanceId,
        hashes: &[SequenceHash],
        slots: &[usize],
    ) -> std::result::Result<Vec<Verified>, RequestFailed> {
        let io = self.config.io_timeout;
        let peer = format!("{instance} at {addr}");
        let from_peer = |mut f: BlockFailure| {
            f.message = format!("data plane pull from {peer}: {}", f.message);
            f
        };
        let fail = |f: BlockFailure, before_response: bool| RequestFailed {
            failure: from_peer(f),
            before_response,
        };
        let refused = |m: String| BlockFailure::new(BlockFailureKind::Refused, m);
        let version = if conn.session.is_some() {
            VERSION_AUTH
        } else {
            VERSION
        };
        let mut request = wire::encode_request_version(
            RequestHead {
                count: hashes.len() as u32,
                geometry: self.geometry,
                block_bytes: self.block_bytes as u64,
            },
            hashes,
            version,
        );
        if let Some(sess) = &mut conn.session {
            // Authenticated: the head and the hash list each carry their tag.
            let hash_list = request.split_off(wire::REQUEST_HEAD_LEN);
            let head_tag = sess.tag(&[&request]);
            let list_tag = sess.tag(&[&hash_list]);
            request.extend_from_slice(&head_tag);
            request.extend_from_slice(&hash_list);
            request.extend_from_slice(&list_tag);
        }
        let stream = &mut conn.stream;
        if let Err(e) = timed(io, stream.write_all(&request)).await {
            return Err(fail(e, true));
        }
        let mut head = [0u8; RESPONSE_HEAD_LEN];
        if let Err(e) = timed(io, stream.read_exact(&mut head)).await {
            return Err(fail(e, true));
        }
        if let Some(sess) = &mut conn.session {
            // The head's tag before any of its fields is believed.
            let mut tag = [0u8; TAG_LEN];
            if let Err(e) = timed(io, conn.stream.read_exact(&mut tag)).await {
                return Err(fail(e, false));
            }
            if !sess.check(&[&head], &tag) {
                let f = self.tag_refused("response head");
                return Err(fail(f, false));
            }
        }
        let (status, count) = match wire::decode_response_version(&head, version) {
            Ok(v) => v,
            Err(e) => return Err(fail(e, false)),
        };
        if status != 0 {
            let m = format!("refused: {}", wire::Status::describe(status));
            return Err(fail(refused(m), false));
        }
        if count as usize != hashes.len() {
            let m = format!("answered {count} frames for {} blocks", hashes.len());
            let f = BlockFailure::new(BlockFailureKind::Transfer, m);
            return Err(fail(f, false));
        }

        let layers = self.layout.layout().config().num_layers;
        let mut settled: Vec<Verified> = Vec::with_capacity(hashes.len());
        let mut broken: Option<BlockFailure> = None;
        // The next frame's header, read with the previous payload.
        let mut ahead: Option<RawHeader> = None;
        let n = hashes.len();
        for (i, (&slot, &hash)) in slots.iter().zip(hashes).enumerate() {
            if let Some(m) = &broken {
                settled.push(Err(m.clone()));
                continue;
            }
            let more = i + 1 < n;
            match self
                .read_frame(&mut conn, instance, hash, slot, layers, &mut ahead, more)
                .await
            {
                Ok(Some(announced)) => settled.push(Ok(announced)),
                Ok(None) => settled.push(Err(BlockFailure::new(
                    BlockFailureKind::NotFound,
                    format!("block {:032x} is not held by {peer}", hash.as_u128()),
                ))),
                Err(e) => {
                    let f = from_peer(e);
                    settled.push(Err(f.clone()));
                    broken = Some(f);
                }
            }
        }
        if broken.is_none() {
            self.give_back(addr, instance, conn);
        }
        Ok(settled)
    }

    /// Counts a head or frame whose tag did not verify, and says so.
    fn tag_refused(&self, what: &str) -> BlockFailure {
        self.tags_refused.fetch_add(1, Ordering::Relaxed);
        metrics::counter!(kvbm_engine::metrics::DATAPLANE_TAGS_REFUSED).increment(1);
        self.security.count(Rejection::BadSignature);
        BlockFailure::new(
            BlockFailureKind::IdentityMismatch,
            format!("{what} failed its tag (tampered, replayed or reordered)"),
        )
    }

    /// Reads one frame into `slot`: `Ok(Some(digest))` verified (with the digest the server
    /// recorded for the block, if any), `Ok(None)` absent on the server, `Err` a frame that
    /// must not be trusted (the stream is then unusable). Its header is `ahead`'s when the
    /// previous frame read it; with `more` (another frame follows), the next header is read
    /// with this payload into `ahead`.
    #[allow(clippy::too_many_arguments)]
    async fn read_frame(
        &self,
        conn: &mut Conn,
        instance: InstanceId,
        hash: SequenceHash,
        slot: usize,
        layers: usize,
        ahead: &mut Option<RawHeader>,
        more: bool,
    ) -> std::result::Result<Option<Option<BlockDigest>>, BlockFailure> {
        let io = self.config.io_timeout;
        let header_len = if conn.session.is_some() {
            FRAME_HEADER_LEN + TAG_LEN
        } else {
            FRAME_HEADER_LEN
        };
        let raw = match ahead.take() {
            Some(raw) => raw,
            None => {
                let mut raw = [0u8; FRAME_HEADER_LEN + TAG_LEN];
                timed(io, conn.stream.read_exact(&mut raw[..header_len])).await?;
                raw
            }
        };
        let (raw, tag) = raw.split_at(FRAME_HEADER_LEN);
        let raw: &[u8; FRAME_HEADER_LEN] = raw.try_into().expect("header length");
        if let Some(sess) = &mut conn.session
            && !sess.check(&[raw], tag.try_into().expect("16 bytes"))
        {
            // Authenticated: nothing in the header is believed before its tag verifies.
            return Err(self.tag_refused(&format!("frame of block {:032x}", hash.as_u128())));
        }
        // Length, geometry, identity and binding are checked before any payload byte is read.
        let (header, digest) =
            match wire::check_frame(raw, hash, instance, self.geometry, self.block_bytes)
                .map_err(BlockFailure::physical)?
            {
                Frame::Absent => return Ok(None),
                Frame::Payload(h, d) => (h, d),
            };
        let regions = self.layout.block_addrs(slot, 0..layers);
        let payload_mac = conn.session.as_ref().is_some_and(|s| s.payload_mac);
        let mut payload_tag = [0u8; TAG_LEN];
        let mut next = [0u8; FRAME_HEADER_LEN + TAG_LEN];
        {
            let mut bufs: Vec<&mut [u8]> = regions
                .iter()
                // SAFETY: host memory of our layout (kept alive by `self`); `slot` is in range
                // and exclusively the caller's (`pull_slots`' contract): nothing else reads or
                // writes it meanwhile.
                .map(|&(p, l)| unsafe { std::slice::from_raw_parts_mut(p as *mut u8, l) })
                .collect();
            if payload_mac {
                bufs.push(&mut payload_tag);
            }
            if more {
                bufs.push(&mut next[..header_len]);
            }
            read_exact_vectored(&conn.stream, &mut bufs, io).await?;
        }
        if more {
            *ahead = Some(next);
        }
        // The payload, just written.
        let slices = || {
            regions.iter().map(|&(p, l)| {
                // SAFETY: as above: host memory of our layout, in a slot that is the caller's.
                unsafe { std::slice::from_raw_parts(p as *const u8, l) }
            })
        };
        match &mut conn.session {
            // With the payload MAC, the tag over the payload's BLAKE3 digest proves the bytes
            // are the ones the server served, and the server's header checksum is of those same
            // bytes (a registered block is immutable): one pass over the payload, not two.
            Some(sess) if payload_mac => {
                if !sess.check(&[&wire::payload_digest(slices())], &payload_tag) {
                    return Err(
                        self.tag_refused(&format!("payload of block {:032x}", hash.as_u128()))
                    );
                }
            }
            _ => {
                let location = || format!("{instance} block {:032x}", hash.as_u128());
                header
                    .verify(checksum_slices(slices()), &location)
                    .map_err(BlockFailure::physical)?;
            }
        }
        Ok(Some(digest))
    }
}

/// Completes each destination whose block verified (`plan[i]`: the digest to register it
/// with) and registers them in `manager` in one batch; one outcome per block, in request
/// order. A failed block's destination is dropped (back to its pool, never registered).
pub(crate) fn register_verified(
    manager: &BlockManager<G2>,
    hashes: &[SequenceHash],
    destinations: Vec<MutableBlock<G2>>,
    plan: Vec<Verified>,
) -> Vec<MoveOutcome<G2>> {
    let mut out: Vec<Option<MoveOutcome<G2>>> = Vec::with_capacity(hashes.len());
    let (mut ok, mut positions) = (Vec::new(), Vec::new());
    for (i, ((dest, &hash), p)) in destinations.into_iter().zip(hashes).zip(plan).enumerate() {
        let done = p.and_then(|digest| {
            dest.complete_with_digest(hash, digest).map_err(|e| {
                BlockFailure::new(
                    BlockFailureKind::Transfer,
                    format!("completing {:032x}: {}", hash.as_u128(), e.error),
                )
            })
        });
        match done {
            Ok(b) => {
                ok.push(b);
                positions.push(i);
                out.push(None);
            }
            Err(f) => out.push(Some(Err(f))),
        }
    }
    for (b, i) in manager.register_blocks(ok).into_iter().zip(positions) {
        out[i] = Some(Ok(b));
    }
    out.into_iter()
        .map(|o| o.expect("every block settled"))
        .collect()
}

/// What a pull brought, into the metrics: the blocks pulled and their bytes (`block_bytes`
/// each), the blocks it did not bring by failure kind, and its time.
pub(crate) fn publish_pull<T>(
    out: &[std::result::Result<T, BlockFailure>],
    block_bytes: usize,
    started: Instant,
) {
    use kvbm_engine::metrics as m;
    let pulled = out.iter().filter(|o| o.is_ok()).count() as u64;
    if pulled > 0 {
        metrics::counter!(m::DATAPLANE_PULLED_BLOCKS).increment(pulled);
        metrics::counter!(m::DATAPLANE_PULLED_BYTES).increment(pulled * block_bytes as u64);
    }
    for f in out.iter().filter_map(|o| o.as_ref().err()) {
        metrics::counter!(m::DATAPLANE_PULL_FAILED_BLOCKS, m::REASON_LABEL => f.kind.as_str())
            .increment(1);
    }
    metrics::histogram!(m::DATAPLANE_PULL_SECONDS).record(started.elapsed().as_secs_f64());
}

/// The digest a pulled block is registered with: the one `identities` (this instance's own,
/// from its keys) knows for it, when it knows the block (the peer's must then be the same, or
/// absent), else the one the peer announced.
pub(crate) fn own_digest(
    identities: &Identities,
    hash: SequenceHash,
    announced: Option<BlockDigest>,
    peer: impl std::fmt::Display,
) -> std::result::Result<Option<BlockDigest>, BlockFailure> {
    let Some(known) = identities.get(hash) else {
        return Ok(announced);
    };
    match announced {
        Some(d) if d != known => Err(BlockFailure::new(
            BlockFailureKind::IdentityMismatch,
            format!(
                "{peer} named another block identity for {:032x} than this instance derives \
                 from its own key",
                hash.as_u128()
            ),
        )),
        _ => Ok(Some(known)),
    }
}

/// `n` outcomes, each `failure`.
pub(crate) fn fail_all<T>(
    n: usize,
    failure: &BlockFailure,
) -> Vec<std::result::Result<T, BlockFailure>> {
    (0..n).map(|_| Err(failure.clone())).collect()
}

/// Fills `bufs` in order from `stream` with as few receives as the kernel allows (one, when
/// the bytes are there), each wait for data bounded by `limit`; failures as [`timed`]'s.
async fn read_exact_vectored(
    stream: &TcpStream,
    bufs: &mut [&mut [u8]],
    limit: std::time::Duration,
) -> std::result::Result<(), BlockFailure> {
    let mut slices: Vec<std::io::IoSliceMut<'_>> = bufs
        .iter_mut()
        .filter(|b| !b.is_empty())
        .map(|b| std::io::IoSliceMut::new(b))
        .collect();
    let mut rest = &mut slices[..];
    while !rest.is_empty() {
        let n = timed(limit, async {
            loop {
                stream.readable().await?;
                match stream.try_read_vectored(rest) {
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => continue,
                    Ok(0) => return Err(std::io::ErrorKind::UnexpectedEof.into()),
                    r => return r,
                }
            }
        })
        .await?;
        std::io::IoSliceMut::advance_slices(&mut rest, n);
    }
    Ok(())
}

/// `f` within `limit`: a stream that ends early or errs is an I/O failure (the peer's copy is
/// not proven bad), one that makes no progress a timeout.
async fn timed<T>(
    limit: std::time::Duration,
    f: impl std::future::Future<Output = std::io::Result<T>>,
) -> std::result::Result<T, BlockFailure> {
    match tokio::time::timeout(limit, f).await {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(e)) if e.kind() == std::io::ErrorKind::UnexpectedEof => Err(BlockFailure::new(
            BlockFailureKind::Io,
            "stream ended early (truncated)",
        )),
        Ok(Err(e)) => Err(BlockFailure::new(BlockFailureKind::Io, e.to_string())),
        Err(_) => Err(BlockFailure::new(
            BlockFailureKind::Timeout,
            format!("no progress within {limit:?}"),
        )),
    }
}

impl RemotePull for DataPlaneClient {
    fn destination(&self) -> &Arc<BlockManager<G2>> {
        &self.manager
    }

    fn pull<'a>(
        &'a self,
        instance: InstanceId,
        hashes: &'a [SequenceHash],
        destinations: Vec<MutableBlock<G2>>,
    ) -> BoxFuture<'a, Vec<MoveOutcome<G2>>> {
        async move {
            match self.peers.get(instance) {
                Some(addr) => self.pull_from(addr, instance, hashes, destinations).await,
                None => fail_all(
                    hashes.len(),
                    &BlockFailure::new(
                        BlockFailureKind::Refused,
                        format!("no data plane address known for {instance}"),
                    ),
                ),
            }
        }
        .boxed()
    }
}
