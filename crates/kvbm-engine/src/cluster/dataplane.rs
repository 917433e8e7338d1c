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
//!
//! # Locks
//!
//! The [`PeerDirectory`] and the client's idle-connection pool each have one `parking_lot`
//! mutex, taken only inside their own methods and never across an `.await`. The server takes
//! none of its own (holds are taken through the block manager's own locks).

mod client;
mod server;
mod wire;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::time::Duration;

use parking_lot::Mutex;

pub use client::DataPlaneClient;
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
}

impl Default for DataPlaneConfig {
    fn default() -> Self {
        Self {
            bind: SocketAddr::from(([127, 0, 0, 1], 0)),
            max_blocks_per_request: 4096,
            io_timeout: Duration::from_secs(5),
            idle_timeout: Duration::from_secs(60),
            max_idle_per_peer: 4,
        }
    }
}

impl DataPlaneConfig {
    /// From `[transport]`: `data_plane_bind` and `request_timeout_ms` (as the I/O timeout);
    /// the rest default.
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
