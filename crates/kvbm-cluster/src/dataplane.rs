//! The TCP block data plane: one instance serves its G2-resident blocks, another pulls a list
//! of them into G2 blocks it allocated itself.
//!
//! # Why TCP here
//!
//! Block data never goes through NATS (its default payload limit is below one block). Where the
//! NIXL library is present a remote G2 pull would be an RDMA read; this is the plain path every
//! machine has, on tokio, and the one that is tested. It uses the **same checksummed,
//! identity-bound framing as G3/G4**: every block travels behind a
//! [`kvbm_physical::checksum::BlockHeader`] (xxh3-128 of the payload, the block's identity,
//! a binding), so a pulled block is registered only if its bytes are the ones the server held
//! for the hash asked for.
//!
//! # Protocol (one connection, requests one after another)
//!
//! ```text
//!  client                                                   server
//!    |-- request: "KVBMPUL1" v1 count geometry block_bytes ---->|  count > max: refused before
//!    |            count × sequence hash (u128 LE)               |  reading the hashes
//!    |                                                          |  hold every present block
//!    |<-- response: "KVBMRSP1" v1 status count ---------------- |  (RAII, this request only)
//!    |<-- per block, in request order:                          |
//!    |      BlockHeader (96 B) + payload (block_bytes)          |  present
//!    |      96 zero bytes                                       |  not present here
//!    |                                                          |  holds released
//! ```
//!
//! Header fields on this path: `len` = block bytes, `slot` = the layout's
//! [`geometry_digest`](kvbm_physical::identity::geometry_digest) (as objects do), scoped by the
//! model fingerprint ([`DataPlaneConfig::scope`]; so is the request's geometry), `identity` =
//! the sequence hash ([`kvbm_offload::block_identity`], as G3/G4), `binding` = a digest of the
//! serving [`InstanceId`] ([`binding`]). The client checks all of them **before reading the
//! payload** (a hostile or corrupt length is refused before anything is read or allocated;
//! payloads go straight into the caller's destination block), then the checksum. Any frame
//! that fails fails its block and every later block of the request, and the connection is
//! dropped (a stream that lied once is not resynchronised); a failed block's destination is
//! dropped back to its pool, never registered.
//!
//! Where the server recorded a 256-bit digest for the block (a BLAKE3 sequence completed
//! with [`complete_with_digest`](kvbm_logical::MutableBlock::complete_with_digest)), the
//! header's `identity` is that digest ([`kvbm_offload::identity_of`], as G3/G4 headers), else
//! the hash's. The client accepts a digest only if the requested hash was derived from it
//! (its first 8 bytes are the hash's chain value) and registers the pulled block **with** it,
//! so the digest travels on (to G3/G4 headers, to the next pull). A pull names blocks by hash
//! only, so the client cannot ask for one digest: two blocks whose 64-bit chain values
//! collide are told apart at the next tier that checks the full identity.
//!
//! # Authentication and tenants (security on: protocol version 3)
//!
//! With [`Security::On`](crate::security::Security) (an instance with credentials:
//! [`DataPlaneServer::start_secured`], [`DataPlaneClient::new_secured`]) every connection
//! starts with a handshake before any request, and everything after it is tagged. The client
//! proves its key before the server does any work of its own:
//!
//! ```text
//!  client (leader of C, namespace N)                       server (leader of A, namespace N)
//!    |-- hello: "KVBMHLC3" v3 flags cert_C X25519_c nonce_c -->|  bounded read, nothing else
//!    |<-- challenge: "KVBMCHL3" 32 random bytes ---------------|  (no key, no signature)
//!    |-- proof: Ed25519_C(proof label | hello_c | challenge) ->|  check cert_C: root, expiry,
//!    |                                                         |  namespace N, role leader;
//!    |                                                         |  the proof; a member slot
//!    |                                                         |  (else refused or "busy")
//!    |<-- hello: "KVBMHLS3" v3 flags cert_A X25519_s nonce_s --|
//!    |    + Ed25519_A(server label | transcript)               |
//!    |  check cert_A: root, expiry, namespace N, role leader,  |
//!    |  instance = A (the one pulled from); the signature      |
//!    |  both: SessionKeys = X25519 agree + BLAKE3(transcript), one key per direction
//!    |-- request head (v3) + tag(c2s #0), hashes + tag(#1) --->|  tag checked before any
//!    |                                                         |  length or field is believed
//!    |<-- response head + tag(s2c #0) -------------------------|
//!    |<-- per block: header (96 B) + tag(s2c #k), payload -----|  [+ payload tag]
//! ```
//!
//! * transcript = the client's hello, the challenge, the proof and the server's hello, as
//!   sent. The proof binds the client's certificate and ephemeral key to a challenge fresh
//!   for this connection (a proof copied from another connection fails); the server's
//!   signature covers everything; the session keys are derived from the transcript, so the
//!   client's first tagged request confirms it holds them. A party in the middle can neither
//!   substitute a key nor replay an old handshake, and the keys are fresh per connection.
//! * A stranger holding a copied certificate (certificates travel in every hello) gets 40
//!   random bytes: the server makes no X25519 key and no signature until the proof verifies.
//! * Every tag is keyed BLAKE3 ([`SessionKeys::tag_send`](crate::security::SessionKeys)) over
//!   a per-direction counter and the bytes, so a tampered, replayed, dropped or reordered head
//!   or frame fails its tag (counted in [`ServerStats::tags_refused`] /
//!   [`ClientStats::tags_refused`] and as `BadSignature` in the
//!   [`SecurityStats`](crate::security::SecurityStats)); the request fails from there on and
//!   the connection is dropped. The payload is checked, as in version 1, against the header's
//!   xxh3-128 checksum, which the header's tag authenticates. With
//!   the payload MAC ([`DataPlaneConfig::payload_mac`], `security.dataplane_payload_mac`;
//!   by default on for every connection whose other end is off the loopback interface,
//!   either end asking) the payload carries its own tag too: the session's keyed tag over the
//!   payload's BLAKE3 digest (`wire::payload_digest`). The server keeps that digest with the
//!   block's checksum for the registration, so a block served to many peers is hashed once;
//!   the client hashes what it received. xxh3 is not a cryptographic hash: an on-path party
//!   able to craft a payload with a given xxh3-128 is what the MAC stops. Cost, measured by
//!   `cargo bench -p kvbm-cluster --bench remote` (2-core development machine, 64 × 256 KiB,
//!   interleaved rounds): 0.69× one raw TCP stream with the MAC, 0.79× without (about 120 ms
//!   of CPU per GiB more, one BLAKE3 pass on the receiver).
//! * **Tenants**: the server serves only a leader of its own namespace, the client pulls only
//!   from a leader of its own namespace that is the instance it asked for. A refused peer gets
//!   nothing but a refusal status; no request of it is read. Every refusal is counted
//!   ([`ServerStats::handshakes_refused`], [`ClientStats::handshakes_refused`], and by
//!   [`Rejection`](crate::security::Rejection) kind).
//! * **Mismatch**: a client with security off talking to a server with it on gets status
//!   "requires an authenticated member"; a client with security on talking to a server with it
//!   off gets "server's data plane is not authenticated (security off)". Both are counted.
//! * **Bounds** (the `admission` module): a hello's certificate is at most 256 bytes (checked
//!   before it is read); each address prefix opens at most
//!   [`DataPlaneConfig::accepts_per_second_per_peer`] connections a second; a connection still
//!   in its handshake holds one of [`DataPlaneConfig::max_pending`] pending places (the oldest
//!   dropped for a newcomer), never a member's slot, for at most
//!   [`DataPlaneConfig::handshake_deadline`] (2 s); `max_connections` and
//!   `max_connections_per_peer` count proven members, a peer being the member (its
//!   certificate's instance), not its address.
//!
//! With security off the wire is version 1 above, unchanged (its `binding` is public, so it
//! only guards against mistakes, not attackers: that is why an instance off loopback refuses
//! to run without credentials unless `security.insecure`).
//!
//! # Holds, limits, timeouts
//!
//! * The server holds the requested blocks (strong `ImmutableBlock` handles) from before it
//!   answers until the last byte of the response is written, then drops them. A client that
//!   disconnects or stalls ends its connection task, which drops the holds with it.
//! * Requests of more than [`DataPlaneConfig::max_blocks_per_request`] blocks are refused
//!   before their hash list is read; a geometry or block size the server's layout does not
//!   have is refused.
//! * Every read and write of a frame must progress within [`DataPlaneConfig::io_timeout`];
//!   an idle server connection is closed after [`DataPlaneConfig::idle_timeout`].
//! * **Server connections**: at most [`DataPlaneConfig::max_connections`]
//!   (`transport.max_connections`, default 256) are served at once, and at most
//!   [`DataPlaneConfig::max_connections_per_peer`] (32) of one peer's; one more is refused
//!   ([`ServerStats::connections_refused`], [`ServerStats::peer_connections_refused`]): closed
//!   as soon as it is accepted with security off (a peer is then its address prefix: an IPv4
//!   address, an IPv6 /64), answered "busy" after the handshake with security on (a peer is
//!   then the member it proved to be).
//! * **Server response deadline**: writing one whole response (every frame of one request)
//!   must finish within [`DataPlaneConfig::response_deadline`]
//!   (`transport.response_deadline_ms`, default 60 s), so a reader that takes each write just
//!   in time cannot keep blocks held for hours: past it the connection is dropped and every
//!   hold released ([`ServerStats::responses_timed_out`]).
//! * **Client request deadline**: one whole request (connect, request, every frame) must finish
//!   within [`DataPlaneConfig::pull_deadline`] (`transport.pull_deadline_ms`, default 60 s);
//!   past it the request's unsettled blocks fail `Timeout`, their destinations are dropped, and
//!   the connection with them ([`ClientStats::deadlines_exceeded`]).
//! * **Client pool**: idle connections are kept for at most [`DataPlaneConfig::max_idle_peers`]
//!   addresses (`transport.max_idle_peers`, default 64; the least recently used peer's are
//!   evicted, [`ClientStats::pool_evictions`]), at most
//!   [`DataPlaneConfig::max_idle_per_peer`] each, and none older than
//!   [`DataPlaneConfig::idle_expiry`] (`transport.idle_expiry_ms`, default 30 s) is reused.
//!
//! # Locks
//!
//! The [`PeerDirectory`] and the client's idle-connection pool each have one `parking_lot`
//! mutex, taken only inside their own methods and never across an `.await`. The server takes
//! none of its own (holds are taken through the block manager's own locks).

mod admission;
mod client;
mod handshake;
pub mod lease;
pub mod rank;
mod server;
pub(crate) mod wire;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::time::Duration;

use parking_lot::Mutex;

pub use client::{ClientStats, DataPlaneClient};
#[cfg(feature = "nats")]
pub(crate) use client::{fail_all, own_digest, publish_pull, register_verified};
pub use server::{DataPlaneServer, ServerStats};
pub use wire::binding;

use kvbm_engine::InstanceId;
use kvbm_engine::config::TransportConfig;
use kvbm_engine::error::{EngineError, Result};

/// Settings of the data plane (server and client).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DataPlaneConfig {
    /// Where the server listens (port 0: any free port).
    pub bind: SocketAddr,
    /// Most blocks one request may name. Default: 4096.
    pub max_blocks_per_request: usize,
    /// Longest wait for one frame's read or write to progress. Default: 5 s.
    pub io_timeout: Duration,
    /// An idle server connection is closed after this long. Default: 60 s.
    pub idle_timeout: Duration,
    /// Idle connections the client keeps per peer. Default: 4.
    pub max_idle_per_peer: usize,
    /// Connections the server serves at once; one more is closed at once (counted in
    /// [`ServerStats::connections_refused`]). Default: 256 (`transport.max_connections`).
    pub max_connections: usize,
    /// Connections the server serves at once from one peer address, and requests the client
    /// has in flight to one peer (more wait for one to finish); one more connection from the
    /// same address is closed at once (counted in [`ServerStats::peer_connections_refused`]).
    /// Default: 32 (`transport.max_connections_per_peer`).
    pub max_connections_per_peer: usize,
    /// Security on: connections still in their handshake, apart from the members'
    /// `max_connections`; the oldest is dropped for a newcomer when all are taken (counted in
    /// [`ServerStats::pending_evicted`]). Default: 64 (`transport.max_pending_connections`).
    pub max_pending: usize,
    /// Security on: the whole handshake must finish within this long. Default: 2 s
    /// (`transport.handshake_deadline_ms`).
    pub handshake_deadline: Duration,
    /// New connections accepted per second from one address prefix; more are closed at once
    /// (counted in [`ServerStats::accepts_throttled`]). Default: 64
    /// (`transport.accepts_per_second_per_peer`).
    pub accepts_per_second_per_peer: u32,
    /// Longest time the server spends writing one whole response; then the connection is
    /// dropped with every hold (counted in [`ServerStats::responses_timed_out`]). Default:
    /// 60 s (`transport.response_deadline_ms`).
    pub response_deadline: Duration,
    /// Longest time the client spends on one whole request (connect, request, every frame);
    /// then its blocks fail `Timeout` (counted in [`ClientStats::deadlines_exceeded`]).
    /// Default: 60 s (`transport.pull_deadline_ms`).
    pub pull_deadline: Duration,
    /// Peers (addresses) the client keeps idle connections for; a connection to one more
    /// evicts the least recently used peer's (counted in [`ClientStats::pool_evictions`]).
    /// Default: 64 (`transport.max_idle_peers`).
    pub max_idle_peers: usize,
    /// A pooled idle connection older than this is closed, not reused. Default: 30 s
    /// (`transport.idle_expiry_ms`).
    pub idle_expiry: Duration,
    /// With security on, also tag every payload with keyed BLAKE3 (the frame header, which
    /// carries the payload's xxh3-128 checksum, is always tagged): `Some(true)` on every
    /// connection, `Some(false)` never, `None` (the default, `security.dataplane_payload_mac`
    /// absent) on each connection whose other end is off the loopback interface. Either end
    /// asking turns it on for the connection.
    pub payload_mac: Option<bool>,
    /// The model fingerprint's 64-bit form ([`ModelFingerprint::short`](kvbm_physical::ModelFingerprint::short)),
    /// folded into the geometry value every request and frame carries
    /// ([`scoped_geometry_digest`](kvbm_physical::identity::scoped_geometry_digest)): a
    /// client and a server of different fingerprints refuse each other's blocks as a
    /// geometry mismatch. 0: unscoped. Default: 0 (an `Instance` sets its own).
    pub scope: u64,
}

impl Default for DataPlaneConfig {
    fn default() -> Self {
        // The `[transport]` defaults are the one source of the bounds' defaults.
        let t = TransportConfig::default();
        Self {
            bind: SocketAddr::from(([127, 0, 0, 1], 0)),
            max_blocks_per_request: 4096,
            io_timeout: Duration::from_secs(5),
            idle_timeout: Duration::from_secs(60),
            max_idle_per_peer: 4,
            max_connections: t.max_connections,
            max_connections_per_peer: t.max_connections_per_peer,
            max_pending: t.max_pending_connections,
            handshake_deadline: Duration::from_millis(t.handshake_deadline_ms),
            accepts_per_second_per_peer: t.accepts_per_second_per_peer,
            response_deadline: Duration::from_millis(t.response_deadline_ms),
            pull_deadline: Duration::from_millis(t.pull_deadline_ms),
            max_idle_peers: t.max_idle_peers,
            idle_expiry: Duration::from_millis(t.idle_expiry_ms),
            payload_mac: None,
            scope: 0,
        }
    }
}

impl DataPlaneConfig {
    /// From `[transport]`: `data_plane_bind`, `request_timeout_ms` (as the I/O timeout),
    /// `max_connections`, `response_deadline_ms`, `pull_deadline_ms`, `max_idle_peers` and
    /// `idle_expiry_ms`; the rest default.
    ///
    /// # Errors
    /// [`EngineError::Config`] (key `transport.data_plane_bind`) for an address that does not
    /// parse.
    pub fn from_transport(t: &TransportConfig) -> Result<Self> {
        let bind = t.data_plane_bind.parse().map_err(|e| {
            EngineError::config(
                "transport.data_plane_bind",
                format!("{:?} is not a host:port address ({e})", t.data_plane_bind),
            )
        })?;
        Ok(Self {
            bind,
            io_timeout: Duration::from_millis(t.request_timeout_ms.max(1)),
            max_connections: t.max_connections.max(1),
            max_connections_per_peer: t.max_connections_per_peer.max(1),
            max_pending: t.max_pending_connections.max(1),
            handshake_deadline: Duration::from_millis(t.handshake_deadline_ms.max(1)),
            accepts_per_second_per_peer: t.accepts_per_second_per_peer.max(1),
            response_deadline: Duration::from_millis(t.response_deadline_ms.max(1)),
            pull_deadline: Duration::from_millis(t.pull_deadline_ms.max(1)),
            max_idle_peers: t.max_idle_peers.max(1),
            idle_expiry: Duration::from_millis(t.idle_expiry_ms.max(1)),
            ..Self::default()
        })
    }
}

/// Whether this end asks for the payload MAC on a connection whose other end is `peer`:
/// `setting` when given, else whenever `peer` is off the loopback interface (an IPv4-mapped
/// IPv6 loopback counts as loopback).
pub(crate) fn payload_mac_for(setting: Option<bool>, peer: std::net::IpAddr) -> bool {
    setting.unwrap_or_else(|| {
        let ip = match peer {
            std::net::IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(peer, std::net::IpAddr::V4),
            v4 => v4,
        };
        !ip.is_loopback()
    })
}

/// The data-plane address peers are told: `advertise` (validated `host:port`; port 0 takes
/// the bound port), else the bound address.
pub(crate) fn advertised(advertise: Option<&str>, bound: std::net::SocketAddr) -> Result<String> {
    let Some(a) = advertise else {
        return Ok(bound.to_string());
    };
    let mut addr: std::net::SocketAddr = a.parse().map_err(|e| {
        EngineError::config(
            "transport.data_plane_advertise",
            format!("{a:?} is not a host:port address ({e})"),
        )
    })?;
    if addr.port() == 0 {
        addr.set_port(bound.port());
    }
    Ok(addr.to_string())
}

/// Where each instance's data plane listens. Filled by whoever learns of peers: an
/// `instance::Instance` fills it from peers' heartbeats (feature `nats`), tests and embedding
/// programs may fill it by hand.
#[derive(Debug, Default)]
pub struct PeerDirectory {
    peers: Mutex<HashMap<InstanceId, SocketAddr>>,
}

impl PeerDirectory {
    /// An empty directory.
    pub fn new() -> Self {
        Self::default()
    }

    /// Records (or replaces) where `instance` serves.
    pub fn insert(&self, instance: InstanceId, addr: SocketAddr) {
        self.peers.lock().insert(instance, addr);
    }

    /// Forgets `instance`.
    pub fn remove(&self, instance: InstanceId) {
        self.peers.lock().remove(&instance);
    }

    /// Where `instance` serves, if known.
    pub fn get(&self, instance: InstanceId) -> Option<SocketAddr> {
        self.peers.lock().get(&instance).copied()
    }
}

#[cfg(test)]
mod tests;
