//! [`DataPlaneServer`]: serves one instance's G2-resident blocks over TCP.
//!
//! One accept task, one task per connection; a connection serves requests one after another.
//! Per request the task holds the present blocks (`scan_matches`, strong handles) inside a
//! [`Holds`] guard that lives on the task's stack, so the holds end when the response is
//! written, when a write fails or times out, or when the task is cancelled (server shutdown):
//! in every case by the guard's drop. A failing connection never affects the accept loop.
//!
//! Bounds: who gets in, and how many, is the `admission` module's (an accept rate per address
//! prefix; with security on, a pending pool for connections still in their handshake, apart
//! from the members' slots, the oldest dropped for a newcomer; `max_connections` slots in all
//! and `max_connections_per_peer` per peer, a peer being the member the handshake proved, or
//! with security off the address prefix). A connection serves one request at a time, so the
//! per-peer cap also bounds a peer's requests in flight. Each response is written within
//! `response_deadline` or the connection is dropped with its holds (counted in
//! [`ServerStats::responses_timed_out`]).
//!
//! Checksums: a frame header carries the payload's xxh3-128, which costs as much CPU as the
//! kernel's copy of the payload. A registered block's bytes cannot change while its
//! registration lasts, so the server computes each block's checksum once per registration and
//! keeps it in a [`ChecksumMemo`] (one entry per slot, keyed by `(registration, hash)`): a
//! popular prefix served to many peers is hashed once. The client still hashes every payload
//! it receives, so a stale or wrong memo can only make a pull fail, never pass wrong bytes.
//!
//! Locks: the memo's mutex and the admission's mutex are leaves (never both held), each held
//! only for a few map operations (never across an await or a hash).

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

use kvbm_logical::{BlockDigest, BlockManager, G2, ImmutableBlock, SequenceHash};
use kvbm_physical::PhysicalLayout;
use kvbm_physical::identity::scoped_geometry_digest;
use parking_lot::Mutex;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio_util::sync::CancellationToken;

use super::DataPlaneConfig;
use super::admission::{Admission, Limits, PeerKey, Pending, Slot, address_key};
use super::handshake::{self, Party, Refused, Session};
use super::lease::{Leases, LentHold};
use super::wire::{
    self, CLIENT_HELLO_MAGIC, FRAME_HEADER_LEN, HASH_LEN, REQUEST_HEAD_LEN, REQUEST_MAGIC, Status,
    TAG_LEN, VERSION, VERSION_AUTH,
};
use crate::security::{Rejection, Role, Security, Verifier};
use kvbm_engine::InstanceId;
use kvbm_engine::error::{EngineError, Result};

/// Counters of a running server (tests and metrics).
#[derive(Debug, Default)]
pub struct ServerStats {
    held: AtomicUsize,
    pub(super) connections: AtomicUsize,
    requests: AtomicU64,
    blocks_served: AtomicU64,
    refused: AtomicU64,
    pub(super) connections_refused: AtomicU64,
    pub(super) peer_connections_refused: AtomicU64,
    responses_timed_out: AtomicU64,
    handshakes: AtomicU64,
    handshakes_refused: AtomicU64,
    tags_refused: AtomicU64,
    pub(super) pending: AtomicUsize,
    pub(super) pending_evicted: AtomicU64,
    pub(super) accepts_throttled: AtomicU64,
    /// Fault injection (feature `testing`): frames still to be sent with a damaged payload.
    corrupt_next: AtomicU64,
}

impl ServerStats {
    /// Blocks held right now on behalf of in-flight requests.
    pub fn held(&self) -> usize {
        self.held.load(Ordering::Acquire)
    }
    /// Connections served: with security on, those whose peer proved to be a member (not
    /// those still in their handshake, see [`pending`](Self::pending)).
    pub fn connections(&self) -> usize {
        self.connections.load(Ordering::Acquire)
    }
    /// Connections still in their handshake (security on), each holding a pending place,
    /// not a member's slot.
    pub fn pending(&self) -> usize {
        self.pending.load(Ordering::Acquire)
    }
    /// Pending connections dropped to make room for a newer one (`transport.max_pending`
    /// were waiting).
    pub fn pending_evicted(&self) -> u64 {
        self.pending_evicted.load(Ordering::Relaxed)
    }
    /// Connections closed as soon as accepted: their address prefix opened more than
    /// `transport.accepts_per_second_per_peer` in the last second.
    pub fn accepts_throttled(&self) -> u64 {
        self.accepts_throttled.load(Ordering::Relaxed)
    }
    /// Requests answered (including refused ones).
    pub fn requests(&self) -> u64 {
        self.requests.load(Ordering::Relaxed)
    }
    /// Block frames written in full.
    pub fn blocks_served(&self) -> u64 {
        self.blocks_served.load(Ordering::Relaxed)
    }
    /// Requests refused (bad head, too many blocks, wrong geometry).
    pub fn refused(&self) -> u64 {
        self.refused.load(Ordering::Relaxed)
    }
    /// Connections refused a slot because `max_connections` were already served: closed as
    /// soon as accepted (security off), or answered "busy" once the member proved itself.
    pub fn connections_refused(&self) -> u64 {
        self.connections_refused.load(Ordering::Relaxed)
    }
    /// Connections refused a slot because their peer already had `max_connections_per_peer`
    /// served: the member its handshake proved (security on, answered "busy"), or its
    /// address prefix (security off, closed as soon as accepted).
    pub fn peer_connections_refused(&self) -> u64 {
        self.peer_connections_refused.load(Ordering::Relaxed)
    }
    /// Responses not written within the response deadline (their connection was dropped with
    /// every hold).
    pub fn responses_timed_out(&self) -> u64 {
        self.responses_timed_out.load(Ordering::Relaxed)
    }
    /// Authenticated handshakes completed (security on).
    pub fn handshakes(&self) -> u64 {
        self.handshakes.load(Ordering::Relaxed)
    }
    /// Connections refused before any request was served (security on): a client that is
    /// not a member of this namespace, offered no or a broken handshake, spoke the
    /// unauthenticated protocol, or did not finish within the deadline. It got nothing.
    pub fn handshakes_refused(&self) -> u64 {
        self.handshakes_refused.load(Ordering::Relaxed)
    }
    /// Requests whose tag did not verify (tampered, replayed or reordered): the connection
    /// was dropped unanswered.
    pub fn tags_refused(&self) -> u64 {
        self.tags_refused.load(Ordering::Relaxed)
    }
}

/// The payload checksums of served blocks, one entry per G2 slot, valid for the registration
/// (and hash) it was computed under: see the [module docs](self).
struct ChecksumMemo {
    slots: Mutex<Vec<Option<Memo>>>,
}

#[derive(Clone, Copy)]
struct Memo {
    registration: u32,
    hash: SequenceHash,
    checksum: u128,
    /// The payload's BLAKE3 digest ([`wire::payload_digest`]), once a connection with the
    /// payload MAC asked for it.
    digest: Option<[u8; 32]>,
}

impl ChecksumMemo {
    fn new(slots: usize) -> Self {
        Self {
            slots: Mutex::new(vec![None; slots]),
        }
    }

    /// The memo of `block`'s slot, if it was made for this registration and hash.
    fn known(&self, block: &Held) -> Option<Memo> {
        self.slots
            .lock()
            .get(block.slot)
            .copied()
            .flatten()
            .filter(|m| m.registration == block.registration && m.hash == block.hash)
    }

    /// The checksum of `block`'s payload (its bytes, `slices`): the memoised one when this
    /// registration was hashed before, else computed now and kept.
    fn checksum(&self, block: &Held, slices: &[&[u8]]) -> u128 {
        if let Some(m) = self.known(block) {
            return m.checksum;
        }
        let checksum = wire::payload_checksum(slices);
        if let Some(entry) = self.slots.lock().get_mut(block.slot) {
            *entry = Some(Memo {
                registration: block.registration,
                hash: block.hash,
                checksum,
                digest: None,
            });
        }
        checksum
    }

    /// The BLAKE3 digest of `block`'s payload (`slices`), memoised like its checksum (call
    /// [`checksum`](Self::checksum) first: the digest is kept in that registration's entry).
    fn digest(&self, block: &Held, slices: &[&[u8]]) -> [u8; 32] {
        if let Some(d) = self.known(block).and_then(|m| m.digest) {
            return d;
        }
        let digest = wire::payload_digest(slices.iter().copied());
        if let Some(Some(m)) = self.slots.lock().get_mut(block.slot)
            && m.registration == block.registration
            && m.hash == block.hash
        {
            m.digest = Some(digest);
        }
        digest
    }
}

/// Where a server's blocks are registered: an instance's G2 manager (its leader serves), or
/// the slots a worker rank's leader lent it (the rank plane, [`crate::dataplane::rank`]).
pub(crate) enum Source {
    /// The instance's G2: any present block, to a leader of the namespace.
    G2(Arc<BlockManager<G2>>),
    /// A rank's lent slots: each to the lease's puller instance only, at this rank.
    Lent { leases: Arc<Leases>, rank: u32 },
}

impl Source {
    /// Who may connect.
    fn party(&self) -> Party {
        match self {
            Source::G2(_) => Party::Leader,
            Source::Lent { rank, .. } => Party::Rank(*rank),
        }
    }

    /// The blocks of `hashes` present for `peer` (the member the handshake proved; `None`
    /// unauthenticated), each held until the returned map is dropped.
    fn hold(
        &self,
        peer: Option<InstanceId>,
        hashes: &[SequenceHash],
    ) -> HashMap<SequenceHash, Held> {
        match self {
            Source::G2(manager) => manager
                .scan_matches(hashes)
                .into_iter()
                .map(|b| {
                    let held = Held {
                        slot: b.block_id(),
                        registration: b.registration(),
                        hash: b.sequence_hash(),
                        digest: b.digest(),
                        _hold: Hold::Block { _block: b },
                    };
                    (held.hash, held)
                })
                .collect(),
            Source::Lent { leases, .. } => leases
                .hold(peer, hashes)
                .into_iter()
                .map(|(h, lent)| {
                    let b = lent.block;
                    let held = Held {
                        slot: b.slot,
                        registration: b.registration,
                        hash: b.hash,
                        digest: b.digest,
                        _hold: Hold::Lent { _lent: lent },
                    };
                    (h, held)
                })
                .collect(),
        }
    }
}

/// One block held for one response: its slot cannot be rewritten while this lives.
struct Held {
    slot: usize,
    registration: u32,
    hash: SequenceHash,
    digest: Option<BlockDigest>,
    _hold: Hold,
}

/// What keeps a served slot from being rewritten (held for its drop alone).
enum Hold {
    /// A registered block of the instance's G2.
    Block { _block: ImmutableBlock<G2> },
    /// A lent slot, under its lease's read gate.
    Lent { _lent: LentHold },
}

/// What the server serves from.
struct Served {
    instance: InstanceId,
    source: Source,
    layout: Arc<PhysicalLayout>,
    checksums: ChecksumMemo,
    /// The accept rate, the pending pool and the member slots.
    admission: Arc<Admission>,
    geometry: u64,
    block_bytes: usize,
    config: DataPlaneConfig,
    stats: Arc<ServerStats>,
    security: Arc<Security>,
}

/// A running data-plane server: see the [module docs](crate::dataplane). Stops (and drops every hold) on
/// [`shutdown`](Self::shutdown) or drop.
#[derive(Debug)]
pub struct DataPlaneServer {
    addr: SocketAddr,
    instance: InstanceId,
    cancel: CancellationToken,
    stats: Arc<ServerStats>,
}

/// The holds of one request; dropping it releases them and updates the stats.
struct Holds<'a> {
    blocks: HashMap<SequenceHash, Held>,
    stats: &'a ServerStats,
}

impl Drop for Holds<'_> {
    fn drop(&mut self) {
        let n = self.blocks.len();
        self.blocks.clear();
        self.stats.held.fetch_sub(n, Ordering::AcqRel);
    }
}

impl DataPlaneServer {
    /// Binds `config.bind` and serves `instance`'s G2 blocks (registered in `manager`, bytes in
    /// the host `layout`, indexed by block id) on the current tokio runtime.
    ///
    /// # Errors
    /// [`EngineError::Config`] when `layout` is not host memory or has fewer slots than the
    /// manager; [`EngineError::DataPlane`] when the address cannot be bound.
    pub async fn start(
        config: DataPlaneConfig,
        instance: InstanceId,
        manager: Arc<BlockManager<G2>>,
        layout: Arc<PhysicalLayout>,
    ) -> Result<Self> {
        Self::start_secured(config, instance, manager, layout, Arc::new(Security::Off)).await
    }

    /// [`start`](Self::start) with this member's `security`: when on, every connection must
    /// complete the authenticated handshake as a leader of this namespace before any request
    /// is read, and every head and frame is tagged (protocol version 3); when off, the
    /// unauthenticated protocol (version 1) as [`start`](Self::start).
    ///
    /// # Errors
    /// As [`start`](Self::start); also [`EngineError::Config`] when the credential is not the
    /// leader of `instance`.
    pub async fn start_secured(
        config: DataPlaneConfig,
        instance: InstanceId,
        manager: Arc<BlockManager<G2>>,
        layout: Arc<PhysicalLayout>,
        security: Arc<Security>,
    ) -> Result<Self> {
        if let Some(signer) = security.signer()
            && (signer.cert().instance != instance || signer.cert().role != Role::Leader)
        {
            return Err(EngineError::config(
                "security.credential_file",
                format!(
                    "the data plane of {instance} needs that instance's leader credential, not \
                     {}",
                    signer.cert()
                ),
            ));
        }
        wire::check_host(&layout)?;
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
        Self::serve(config, instance, Source::G2(manager), layout, security).await
    }

    /// Binds `config.bind` and serves the slots `leases` lends (bytes in the host `layout`,
    /// rank `address.rank`'s G2) to workers at the same rank of each lease's puller instance:
    /// the rank plane (see [`crate::dataplane::rank`]). Frames are bound to `address.instance`,
    /// the instance whose blocks they are.
    ///
    /// # Errors
    /// [`EngineError::Config`] when `layout` is not host memory, or the credential is not this
    /// rank's worker credential; [`EngineError::DataPlane`] when the address cannot be bound.
    pub async fn start_lent(
        config: DataPlaneConfig,
        address: kvbm_engine::WorkerAddress,
        leases: Arc<Leases>,
        layout: Arc<PhysicalLayout>,
        security: Arc<Security>,
    ) -> Result<Self> {
        if let Some(signer) = security.signer() {
            let cert = signer.cert();
            if cert.instance != address.instance
                || cert.role != Role::Worker
                || cert.rank != address.rank
            {
                return Err(EngineError::config(
                    "security.credential_file",
                    format!(
                        "the rank plane of {address} needs that rank's worker credential, not {cert}"
                    ),
                ));
            }
        }
        wire::check_host(&layout)?;
        let source = Source::Lent {
            leases,
            rank: address.rank,
        };
        Self::serve(config, address.instance, source, layout, security).await
    }

    async fn serve(
        config: DataPlaneConfig,
        instance: InstanceId,
        source: Source,
        layout: Arc<PhysicalLayout>,
        security: Arc<Security>,
    ) -> Result<Self> {
        let c = *layout.layout().config();
        let listener = TcpListener::bind(config.bind)
            .await
            .map_err(|e| EngineError::data_plane(config.bind.to_string(), e.to_string()))?;
        let addr = listener
            .local_addr()
            .map_err(|e| EngineError::data_plane(config.bind.to_string(), e.to_string()))?;
        let stats = Arc::new(ServerStats::default());
        let served = Arc::new(Served {
            instance,
            source,
            geometry: scoped_geometry_digest(&c, config.scope),
            block_bytes: c.block_bytes(),
            checksums: ChecksumMemo::new(c.num_blocks),
            admission: Arc::new(Admission::new(
                Limits {
                    max_connections: config.max_connections,
                    max_per_peer: config.max_connections_per_peer,
                    max_pending: config.max_pending,
                    accept_rate: config.accepts_per_second_per_peer,
                },
                stats.clone(),
            )),
            layout,
            config,
            stats: stats.clone(),
            security,
        });
        let cancel = CancellationToken::new();
        let accept_cancel = cancel.clone();
        tokio::spawn(async move {
            loop {
                let (stream, peer) = tokio::select! {
                    () = accept_cancel.cancelled() => return,
                    r = listener.accept() => match r {
                        Ok(s) => s,
                        Err(e) => {
                            tracing::warn!(error = %e, "data plane accept failed");
                            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
                            continue;
                        }
                    },
                };
                if !served
                    .admission
                    .accept(peer.ip(), std::time::Instant::now())
                {
                    drop(stream);
                    continue;
                }
                // Security on: a pending place until the handshake proves a member (the
                // member's slot is taken then). Off: there is nothing to prove, so the
                // address's slot is taken now, or the connection closed at once.
                let entry = if served.security.is_on() {
                    Entry::Pending(served.admission.pending())
                } else {
                    match served
                        .admission
                        .admit(PeerKey::Address(address_key(peer.ip())))
                    {
                        Ok(slot) => Entry::Served(slot),
                        Err(_) => {
                            drop(stream);
                            continue;
                        }
                    }
                };
                let served = served.clone();
                let cancel = accept_cancel.child_token();
                tokio::spawn(async move {
                    tokio::select! {
                        () = cancel.cancelled() => {}
                        r = serve_connection(&served, stream, entry) => {
                            if let Err(e) = r {
                                tracing::debug!(%peer, error = %e, "data plane connection ended");
                            }
                        }
                    }
                });
            }
        });
        Ok(Self {
            addr,
            instance,
            cancel,
            stats,
        })
    }

    /// Where it listens.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// The instance it serves.
    pub fn instance(&self) -> InstanceId {
        self.instance
    }

    /// Its counters.
    pub fn stats(&self) -> &Arc<ServerStats> {
        &self.stats
    }

    /// Fault injection (feature `testing`): the next `n` block frames are sent with one
    /// payload byte flipped after their header (and checksum) was computed, as a corrupting
    /// link or a bad serving host would; a verifying client must refuse them.
    #[cfg(feature = "testing")]
    pub fn corrupt_next_frames(&self, n: u64) {
        self.stats.corrupt_next.store(n, Ordering::Release);
    }

    /// Stops accepting and ends every connection (dropping their holds). Idempotent.
    pub fn shutdown(&self) {
        self.cancel.cancel();
    }
}

impl Drop for DataPlaneServer {
    fn drop(&mut self) {
        self.cancel.cancel();
    }
}

async fn timed<T>(
    what: &str,
    limit: std::time::Duration,
    f: impl std::future::Future<Output = std::io::Result<T>>,
) -> std::io::Result<T> {
    match tokio::time::timeout(limit, f).await {
        Ok(r) => r,
        Err(_) => Err(std::io::Error::new(
            std::io::ErrorKind::TimedOut,
            format!("{what} timed out after {limit:?}"),
        )),
    }
}

/// How a connection came in: still to prove a member (security on), or already holding its
/// slot (security off).
enum Entry {
    Pending(Pending),
    Served(Slot),
}

/// The connection's first bytes under security: the authenticated handshake within
/// `handshake_deadline` (or until a newer stranger takes this one's pending place), then the
/// proven member's slot. `Ok(None)`: refused (counted; the client got nothing but a refusal
/// status), turned away at a cap (answered "busy"), or the client left before saying
/// anything.
async fn authenticate(
    s: &Served,
    stream: &mut TcpStream,
    pending: Pending,
) -> std::io::Result<Option<(Session, Slot)>> {
    let Security::On(sealing) = &*s.security else {
        return Ok(None);
    };
    let deadline = s.config.handshake_deadline;
    let refused = |rejection: Option<Rejection>, message: &str| {
        s.stats.handshakes_refused.fetch_add(1, Ordering::Relaxed);
        metrics::counter!(kvbm_engine::metrics::DATAPLANE_HANDSHAKES_REFUSED).increment(1);
        if let Some(r) = rejection {
            sealing.verifier.stats().count(r);
        }
        tracing::debug!(error = message, "data plane handshake refused");
    };
    let handshake = async {
        let mut first = [0u8; 8];
        match stream.read_exact(&mut first).await {
            Ok(_) => {}
            // Connected and left (a health check, a port scan): nothing to count.
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(Err(None)),
            Err(e) => return Err(e),
        }
        let magic = u64::from_le_bytes(first);
        if magic == REQUEST_MAGIC {
            // A client with security off: drain its (bounded) request so the refusal is not
            // lost to a reset, and tell it why.
            let mut rest = [0u8; REQUEST_HEAD_LEN - 8];
            stream.read_exact(&mut rest).await?;
            let count = u32::from_le_bytes(rest[4..8].try_into().expect("4 bytes")) as usize;
            if count <= s.config.max_blocks_per_request {
                let mut raw = vec![0u8; count * HASH_LEN];
                stream.read_exact(&mut raw).await?;
            }
            let r = wire::encode_response(Status::AuthRequired, 0);
            stream.write_all(&r).await?;
            return Ok(Err(Some(Refused {
                rejection: Some(Rejection::NotMember),
                status: Status::AuthRequired,
                message: "a client without credentials (security off) asked for blocks".to_owned(),
            })));
        }
        if magic != CLIENT_HELLO_MAGIC {
            return Ok(Err(Some(Refused {
                rejection: Some(Rejection::Malformed),
                status: Status::AuthRequired,
                message: format!("not a data plane hello (version 3): {magic:#018x}"),
            })));
        }
        let admit = |cert: &crate::security::MemberCert| {
            s.admission
                .admit(PeerKey::Member(cert.instance))
                .map_err(|full| Refused::busy(format!("{cert}: {full}")))
        };
        let payload_mac = super::payload_mac_for(
            s.config.payload_mac,
            stream
                .peer_addr()
                .map_or(std::net::Ipv4Addr::UNSPECIFIED.into(), |a| a.ip()),
        );
        match handshake::server(stream, sealing, s.source.party(), payload_mac, first, admit).await
        {
            Ok(done) => Ok(Ok(done)),
            Err(refused) => {
                // Best effort: tell the client it was refused, or that it must wait (nothing
                // else).
                let r = wire::encode_response(refused.status, 0);
                let _ = stream.write_all(&r).await;
                Ok(Err(Some(refused)))
            }
        }
    };
    let r = tokio::select! {
        r = tokio::time::timeout(deadline, handshake) => r,
        () = pending.evicted() => {
            // Counted as an eviction by the pool.
            return Err(std::io::Error::new(
                std::io::ErrorKind::ConnectionAborted,
                "unauthenticated connection dropped for a newer one (transport.max_pending)",
            ));
        }
    };
    drop(pending);
    match r {
        Ok(Ok(Ok(done))) => {
            s.stats.handshakes.fetch_add(1, Ordering::Relaxed);
            Ok(Some(done))
        }
        Ok(Ok(Err(None))) => Ok(None),
        // A proven member turned away at a cap: counted there, not as a security refusal.
        Ok(Ok(Err(Some(r)))) if r.status == Status::Busy => Ok(None),
        Ok(Ok(Err(Some(r)))) => {
            refused(r.rejection, &r.message);
            Ok(None)
        }
        Ok(Err(e)) => {
            refused(None, &e.to_string());
            Err(e)
        }
        Err(_) => {
            refused(None, "handshake not finished within the handshake deadline");
            Err(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                format!("handshake not finished within {deadline:?}"),
            ))
        }
    }
}

/// Writes `bytes` (one head or frame header), followed by its tag when authenticated.
async fn write_tagged(
    stream: &mut TcpStream,
    session: &mut Option<Session>,
    io: std::time::Duration,
    bytes: &[u8],
) -> std::io::Result<()> {
    match session {
        None => timed("write", io, stream.write_all(bytes)).await,
        Some(sess) => {
            let tag = sess.tag(&[bytes]);
            let mut out = Vec::with_capacity(bytes.len() + TAG_LEN);
            out.extend_from_slice(bytes);
            out.extend_from_slice(&tag);
            timed("write", io, stream.write_all(&out)).await
        }
    }
}

/// Ends an authenticated session whose peer was revoked or expired since its handshake
/// (counted by kind).
fn recheck_peer(s: &Served, session: Option<&Session>) -> std::io::Result<()> {
    let (Some(sess), Some(v)) = (session, s.security.verifier()) else {
        return Ok(());
    };
    v.recheck(&sess.peer).map_err(|r| {
        s.security.count(r);
        tracing::warn!(peer = %sess.peer, reason = %r, "data plane session ended");
        std::io::Error::new(
            std::io::ErrorKind::PermissionDenied,
            format!("{}: {r}", sess.peer),
        )
    })
}

fn tag_refused(s: &Served, session: &Session) -> std::io::Error {
    s.stats.tags_refused.fetch_add(1, Ordering::Relaxed);
    metrics::counter!(kvbm_engine::metrics::DATAPLANE_TAGS_REFUSED).increment(1);
    s.security.count(Rejection::BadSignature);
    std::io::Error::new(
        std::io::ErrorKind::InvalidData,
        format!(
            "request from {} failed its tag (tampered, replayed or reordered)",
            session.peer
        ),
    )
}

async fn serve_connection(s: &Served, mut stream: TcpStream, entry: Entry) -> std::io::Result<()> {
    stream.set_nodelay(true)?;
    let io = s.config.io_timeout;
    // The slot is held until the connection ends.
    let (mut session, _slot) = match entry {
        Entry::Pending(pending) => match authenticate(s, &mut stream, pending).await? {
            Some((session, slot)) => (Some(session), slot),
            None => return Ok(()),
        },
        Entry::Served(slot) => (None, slot),
    };
    let version = if session.is_some() {
        VERSION_AUTH
    } else {
        VERSION
    };
    let recheck = s
        .security
        .verifier()
        .map_or(s.config.idle_timeout, Verifier::recheck_every);
    loop {
        let mut head = [0u8; REQUEST_HEAD_LEN];
        // Waiting for the next request: the idle timeout ends it; meanwhile, authenticated, the
        // peer is checked again every `recheck` (revoked or expired since its handshake: the
        // session ends). A peek consumes nothing, so no byte of a head is lost to a tick (and,
        // unlike readiness, it does not report data that was already read).
        let idle_until = std::time::Instant::now() + s.config.idle_timeout;
        loop {
            recheck_peer(s, session.as_ref())?;
            let left = idle_until.saturating_duration_since(std::time::Instant::now());
            if left.is_zero() {
                return Ok(());
            }
            let mut one = [0u8; 1];
            match tokio::time::timeout(left.min(recheck), stream.peek(&mut one)).await {
                Err(_) => {}
                // The peer closed between requests.
                Ok(Ok(0)) => return Ok(()),
                Ok(Ok(_)) => break,
                Ok(Err(e)) => return Err(e),
            }
        }
        match timed("read", io, stream.read_exact(&mut head)).await {
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(()),
            Err(e) => return Err(e),
        }
        // Authenticated: the head's tag is checked before any of its fields is believed.
        if let Some(sess) = &mut session {
            let mut tag = [0u8; TAG_LEN];
            timed("read", io, stream.read_exact(&mut tag)).await?;
            if !sess.check(&[&head], &tag) {
                return Err(tag_refused(s, sess));
            }
        }
        s.stats.requests.fetch_add(1, Ordering::Relaxed);
        let refuse = |status: Status| {
            s.stats.refused.fetch_add(1, Ordering::Relaxed);
            wire::encode_response_version(status, 0, version)
        };
        let head = match wire::decode_request_version(&head, version) {
            Ok(h) => h,
            Err(Status::AuthUnavailable) => {
                // An authenticated client's hello to this unauthenticated server: drain the
                // (bounded) rest of it so the refusal is not lost to a reset, and name the
                // mismatch.
                let cert_len = u16::from_le_bytes([head[14], head[15]]) as usize;
                let rest = (wire::HELLO_HEAD_LEN + cert_len.min(wire::MAX_CERT_LEN) + 64)
                    .saturating_sub(REQUEST_HEAD_LEN);
                let mut sink = vec![0u8; rest];
                let _ = timed("read", io, stream.read_exact(&mut sink)).await;
                s.stats.handshakes_refused.fetch_add(1, Ordering::Relaxed);
                metrics::counter!(kvbm_engine::metrics::DATAPLANE_HANDSHAKES_REFUSED).increment(1);
                let r = refuse(Status::AuthUnavailable);
                timed("write", io, stream.write_all(&r)).await?;
                return Ok(());
            }
            Err(status) => {
                let r = refuse(status);
                write_tagged(&mut stream, &mut session, io, &r).await?;
                return Ok(());
            }
        };
        // Refused before the hash list is read or any buffer sized by it is allocated.
        if head.count as usize > s.config.max_blocks_per_request {
            let r = refuse(Status::TooMany);
            write_tagged(&mut stream, &mut session, io, &r).await?;
            return Ok(());
        }
        // Bounded by the check above; read before answering so a refusal is not lost to a
        // reset caused by unread data.
        let tag_len = if session.is_some() { TAG_LEN } else { 0 };
        let mut raw = vec![0u8; head.count as usize * HASH_LEN + tag_len];
        timed("read", io, stream.read_exact(&mut raw)).await?;
        if let Some(sess) = &mut session {
            let (hashes, tag) = raw.split_at(raw.len() - TAG_LEN);
            if !sess.check(&[hashes], tag.try_into().expect("16 bytes")) {
                return Err(tag_refused(s, sess));
            }
            raw.truncate(raw.len() - TAG_LEN);
        }
        if head.geometry != s.geometry || head.block_bytes != s.block_bytes as u64 {
            let r = refuse(Status::Geometry);
            write_tagged(&mut stream, &mut session, io, &r).await?;
            return Ok(());
        }
        let hashes = wire::decode_hashes(&raw);

        let blocks = s
            .source
            .hold(session.as_ref().map(|sess| sess.peer.instance), &hashes);
        s.stats.held.fetch_add(blocks.len(), Ordering::AcqRel);
        let holds = Holds {
            blocks,
            stats: &s.stats,
        };
        // The whole response within the deadline: a reader that takes each write just in time
        // cannot keep the holds for longer (they drop with this function's frame).
        match tokio::time::timeout(
            s.config.response_deadline,
            write_response(
                s,
                &mut stream,
                &mut session,
                version,
                head.count,
                &hashes,
                &holds,
            ),
        )
        .await
        {
            Ok(r) => r?,
            Err(_) => {
                s.stats.responses_timed_out.fetch_add(1, Ordering::Relaxed);
                metrics::counter!(kvbm_engine::metrics::DATAPLANE_RESPONSES_TIMED_OUT).increment(1);
                return Err(std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    format!(
                        "response not written within {:?} (transport.response_deadline_ms)",
                        s.config.response_deadline
                    ),
                ));
            }
        }
        drop(holds);
    }
}

/// Writes every byte of `parts`, each write within `io`.
async fn write_all_vectored(
    stream: &mut TcpStream,
    io: std::time::Duration,
    mut parts: &mut [std::io::IoSlice<'_>],
) -> std::io::Result<()> {
    while !parts.is_empty() {
        let n = timed("write", io, stream.write_vectored(parts)).await?;
        if n == 0 {
            return Err(std::io::ErrorKind::WriteZero.into());
        }
        std::io::IoSlice::advance_slices(&mut parts, n);
    }
    Ok(())
}

/// Writes one response: its head, then one frame per hash (the held block, or an absent frame).
/// Authenticated, the head and every frame header carry their tag, and with `payload_mac`
/// every payload is followed by one.
async fn write_response(
    s: &Served,
    stream: &mut TcpStream,
    session: &mut Option<Session>,
    version: u32,
    count: u32,
    hashes: &[SequenceHash],
    holds: &Holds<'_>,
) -> std::io::Result<()> {
    let io = s.config.io_timeout;
    let r = wire::encode_response_version(Status::Ok, count, version);
    write_tagged(stream, session, io, &r).await?;
    let layers = s.layout.layout().config().num_layers;
    for h in hashes {
        let Some(block) = holds.blocks.get(h) else {
            write_tagged(stream, session, io, &[0u8; FRAME_HEADER_LEN]).await?;
            continue;
        };
        let regions = s.layout.block_addrs(block.slot, 0..layers);
        // SAFETY: host memory of the served layout (kept alive by `s`), the slot in range
        // (checked when it was lent, or a block of the manager the layout covers); the block
        // is held (registered and immutable, or lent: its leader holds it until the lease
        // ends, which waits for this read), so nothing writes its slot while it is read.
        let slices: Vec<&[u8]> = regions
            .iter()
            .map(|&(p, l)| unsafe { std::slice::from_raw_parts(p as *const u8, l) })
            .collect();
        let checksum = s.checksums.checksum(block, &slices);
        let header =
            wire::frame_header_with(*h, block.digest, s.instance, s.geometry, &regions, checksum);
        // The header (and its tag, authenticated) goes out with the payload in one vectored
        // write: a separate small write is pushed on its own (TCP_NODELAY) and costs the
        // loopback stack a segment and an ACK per frame.
        let mut head = Vec::with_capacity(FRAME_HEADER_LEN + TAG_LEN);
        head.extend_from_slice(&header);
        if let Some(sess) = session.as_mut() {
            head.extend_from_slice(&sess.tag(&[&header]));
        }
        let payload_tag = match session {
            Some(sess) if sess.payload_mac => {
                Some(sess.tag(&[&s.checksums.digest(block, &slices)]))
            }
            _ => None,
        };
        let corrupt = s
            .stats
            .corrupt_next
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| n.checked_sub(1))
            .is_ok();
        // A damaged copy (after its checksum and tags were computed), never the served block.
        let bad: Option<Vec<u8>> = (corrupt && !slices.is_empty()).then(|| {
            let mut bad = slices[0].to_vec();
            if let Some(b) = bad.first_mut() {
                *b ^= 0xff;
            }
            bad
        });
        let mut parts: Vec<std::io::IoSlice<'_>> = Vec::with_capacity(slices.len() + 2);
        parts.push(std::io::IoSlice::new(&head));
        for (i, bytes) in slices.iter().enumerate() {
            match (&bad, i) {
                (Some(bad), 0) => parts.push(std::io::IoSlice::new(bad)),
                _ => parts.push(std::io::IoSlice::new(bytes)),
            }
        }
        if let Some(tag) = &payload_tag {
            parts.push(std::io::IoSlice::new(tag));
        }
        write_all_vectored(stream, io, &mut parts).await?;
        s.stats.blocks_served.fetch_add(1, Ordering::Relaxed);
    }
    timed("flush", io, stream.flush()).await?;
    Ok(())
}
