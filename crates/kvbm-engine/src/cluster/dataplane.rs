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
//! [`geometry_digest`](kvbm_physical::identity::geometry_digest) (as objects do), `identity` =
//! the sequence hash ([`kvbm_offload::block_identity`], as G3/G4), `binding` = a digest of the
//! serving [`InstanceId`] ([`binding`]). The client checks all of them **before reading the
//! payload** (a hostile or corrupt length is refused before anything is read or allocated;
//! payloads go straight into the caller's destination block), then the checksum. Any frame
//! that fails fails its block and every later block of the request, and the connection is
//! dropped (a stream that lied once is not resynchronised); a failed block's destination is
//! dropped back to its pool, never registered.
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
//!   (`transport.max_connections`, default 256) are served at once; one more is closed as soon
//!   as it is accepted ([`ServerStats::connections_refused`]).
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

mod client;
mod server;
pub(crate) mod wire;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::time::Duration;

use parking_lot::Mutex;

pub use client::{ClientStats, DataPlaneClient};
pub use server::{DataPlaneServer, ServerStats};
pub use wire::binding;

use crate::address::InstanceId;
use crate::config::TransportConfig;
use crate::error::{EngineError, Result};

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
            response_deadline: Duration::from_millis(t.response_deadline_ms),
            pull_deadline: Duration::from_millis(t.pull_deadline_ms),
            max_idle_peers: t.max_idle_peers,
            idle_expiry: Duration::from_millis(t.idle_expiry_ms),
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
            response_deadline: Duration::from_millis(t.response_deadline_ms.max(1)),
            pull_deadline: Duration::from_millis(t.pull_deadline_ms.max(1)),
            max_idle_peers: t.max_idle_peers.max(1),
            idle_expiry: Duration::from_millis(t.idle_expiry_ms.max(1)),
            ..Self::default()
        })
    }
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
