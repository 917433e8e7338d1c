//! Who is where, and how a leader talks to its workers: [`InstanceId`], [`WorkerAddress`],
//! [`PeerInfo`], the versioned [`control`] messages, and (feature `nats`) the NATS
//! request/reply carrier in `nats`.
//!
//! # Why
//!
//! A leader drives one worker per rank. In one process it calls them directly
//! ([`control::InProcessControl`]); across processes it sends the same serde-encoded,
//! versioned [`control::ControlRequest`]s over NATS request/reply (`nats::NatsControl`,
//! answered by `nats::WorkerServer`). Both sit behind one seam, [`control::WorkerControl`],
//! and [`control::ControlledWorkers`] runs an operation on every rank through it, so the
//! leader-side code is the same in both cases.
//!
//! ```text
//!  leader (SpmdMover / session)
//!     |  ParallelWorkers::execute(TransferRequest)
//!     v
//!  ControlledWorkers ──WorkerControl::call──► InProcessControl ─► PhysicalWorker (same process)
//!                                       └───► NatsControl ──request/reply──► WorkerServer
//!                                               (timeout per request)          └► PhysicalWorker
//! ```
//!
//! Block **data** never travels over the control plane: NATS' default payload limit is below
//! one block. Control messages carry block ids, hashes, tiers and per-block outcomes only.

pub mod control;
pub mod grants;
#[cfg(feature = "nats")]
pub mod membership;
#[cfg(feature = "nats")]
pub mod nats;

use kvbm_logical::TierId;
use serde::{Deserialize, Serialize};

use kvbm_engine::{InstanceId, WorkerAddress};

/// What a worker says about itself when asked ([`control::ControlRequest::Describe`]).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PeerInfo {
    /// Who it is.
    pub worker: WorkerAddress,
    /// The tiers it has a layout for.
    pub tiers: Vec<TierId>,
    /// Blocks per layout.
    pub num_blocks: usize,
    /// Bytes of one block (this rank's slice).
    pub block_bytes: usize,
    /// Where its block data plane listens, if it has one (`host:port`).
    pub data_plane: Option<String>,
}
