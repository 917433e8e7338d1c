//! The rank plane: worker ranks of instances whose ranks are processes move their own slices
//! of a block rank to rank.
//!
//! An instance whose ranks are `kvbm-engine-worker` processes keeps its blocks' bookkeeping in
//! its leader and their bytes in the ranks, each rank a slice of every block. A peer of the
//! same fingerprint has the same rank count (the fingerprint binds it), so rank `r` of the
//! puller wants exactly rank `r`'s slice of the holder:
//!
//! ```text
//!  puller leader B                  holder leader A                A rank r        B rank r
//!   |-- lease request (sealed, NATS) -->|                               |               |
//!   |                                   | hold the G2 blocks            |               |
//!   |                                   |-- Lend{lease, B, slots} ----->| (every rank)  |
//!   |                                   |<- Lent{rank plane address} ---|               |
//!   |<- lease answer (sealed): digests, every rank's address           |               |
//!   |-- PullSlices{A rank r address, hashes, digests, B's slots} ---------------------->|
//!   |                                   |                               |<- handshake --|
//!   |                                   |                               |   worker A/r  |
//!   |                                   |                               |   ↔ worker B/r|
//!   |                                   |                               |-- frames ---->|
//!   |<- Transferred (per block, every frame checked) ----------------------------------|
//!   | register the blocks every rank verified; release the lease       |               |
//!   |-- release (sealed) -------------->|-- EndLease (waits for reads) ->|               |
//!   |                                   | drop the holds                |               |
//! ```
//!
//! The rank's [`RankPlane`] is both ends: a [`DataPlaneServer`] over the slots its leader lent
//! ([`Leases`]; the same wire, frames and checks as the instance plane, see
//! [`crate::dataplane`]), and a `Link` (the client core) that pulls into its own G2 slots. With security on,
//! the handshake admits only a worker at the same rank (`Party::Rank`) of the namespace, a
//! lease serves only workers of the instance it was lent to, and the puller's link accepts only
//! a worker at its rank of the holder instance. A rank never decides which block a slot holds:
//! its leader says so, over the sealed control channel, for lending and for pulling alike.
//!
//! # Deadline
//!
//! A rank's whole pull ([`RankPlane::pull`]) ends within the plane's `pull_deadline` (then its
//! unsettled blocks fail `Timeout` and nothing more is written), and a whole response of its
//! server within `response_deadline`; the worker sets both below its leader's control request
//! timeout. So the leader's `PullSlices` call is answered before the leader gives up on it (its
//! destination slots are never handed to another block while a rank still writes them), and an
//! `EndLease`, which waits for the lease's responses, before the holder's leader gives up on it
//! and drops its holds. (Were a read still running after that, the slot rewritten under it, the
//! puller's frame checksum would refuse the bytes: never wrong bytes, a failed pull.)

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use kvbm_logical::{BlockDigest, SequenceHash};
use kvbm_offload::{BlockFailure, BlockFailureKind};
use kvbm_physical::PhysicalLayout;

use super::client::{Link, fail_all};
use super::handshake::Party;
use super::lease::{Leases, LentBlock};
use super::{DataPlaneConfig, DataPlaneServer};
use crate::security::Security;
use kvbm_engine::error::Result;
use kvbm_engine::{InstanceId, WorkerAddress};

/// One worker rank's end of the rank plane: see the [module docs](self).
pub struct RankPlane {
    address: WorkerAddress,
    leases: Arc<Leases>,
    server: DataPlaneServer,
    link: Link,
    advertised: String,
    num_blocks: usize,
    deadline: Duration,
}

impl std::fmt::Debug for RankPlane {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RankPlane")
            .field("address", &self.address)
            .field("serves", &self.server.local_addr())
            .field("advertised", &self.advertised)
            .finish_non_exhaustive()
    }
}

impl RankPlane {
    /// Serves rank `address`'s lent slots of its G2 (`g2`, host memory) on `config.bind`, and
    /// pulls into them; peers are told `advertise` (its port 0 the bound port), else the bound
    /// address. `config.scope` must be the instance's fingerprint (as the holder's and the
    /// puller's ranks compute it); `config.pull_deadline` bounds a whole pull and must be below
    /// the leader's control request timeout (see the [module docs](self)).
    ///
    /// # Errors
    /// As [`DataPlaneServer::start_lent`]; [`EngineError::Config`](kvbm_engine::EngineError)
    /// for an `advertise` that is not `host:port`.
    pub async fn start(
        config: DataPlaneConfig,
        address: WorkerAddress,
        g2: Arc<PhysicalLayout>,
        security: Arc<Security>,
        advertise: Option<&str>,
    ) -> Result<Self> {
        let leases = Arc::new(Leases::new());
        let server = DataPlaneServer::start_lent(
            config.clone(),
            address,
            leases.clone(),
            g2.clone(),
            security.clone(),
        )
        .await?;
        let advertised = super::advertised(advertise, server.local_addr())?;
        let num_blocks = g2.layout().config().num_blocks;
        let deadline = config.pull_deadline;
        let link = Link::new(Party::Rank(address.rank), config, g2, security)?;
        Ok(Self {
            address,
            leases,
            server,
            link,
            advertised,
            num_blocks,
            deadline,
        })
    }

    /// The address the leader hands to pullers.
    pub fn advertised(&self) -> &str {
        &self.advertised
    }

    /// The slice server (address, counters).
    pub fn server(&self) -> &DataPlaneServer {
        &self.server
    }

    /// The leases lent now.
    pub fn leases(&self) -> &Arc<Leases> {
        &self.leases
    }

    /// Lends `blocks` (slots of this rank's G2) to workers of `lessee` for `ttl`.
    ///
    /// # Errors
    /// A message when a slot is out of the layout, or the lease cannot be recorded.
    pub fn lend(
        &self,
        lease: u128,
        lessee: InstanceId,
        ttl: Duration,
        blocks: &[LentBlock],
    ) -> std::result::Result<(), String> {
        if let Some(b) = blocks.iter().find(|b| b.slot >= self.num_blocks) {
            return Err(format!(
                "slot {} is out of {}'s {} G2 blocks",
                b.slot, self.address, self.num_blocks
            ));
        }
        self.leases.lend(lease, lessee, ttl, blocks)
    }

    /// Ends `lease` once no read of it is in flight (see [`Leases::end`]).
    pub async fn end(&self, lease: u128) -> bool {
        self.leases.end(lease).await
    }

    /// Pulls this rank's slice of `hashes[i]` from the same rank of `holder`, serving at
    /// `from`, into G2 slot `slots[i]`; a frame naming a digest other than `digests[i]` fails
    /// its block. One outcome per block, in order.
    ///
    /// # Safety
    /// The slots are reserved for this call by this rank's leader (it holds them as mutable
    /// blocks until the call returns), as for a transfer into them.
    pub async unsafe fn pull(
        &self,
        from: SocketAddr,
        holder: InstanceId,
        hashes: &[SequenceHash],
        digests: &[Option<BlockDigest>],
        slots: &[usize],
    ) -> Vec<std::result::Result<(), BlockFailure>> {
        if digests.len() != hashes.len() {
            let m = format!("{} digests for {} blocks", digests.len(), hashes.len());
            return fail_all(
                hashes.len(),
                &BlockFailure::new(BlockFailureKind::Refused, m),
            );
        }
        // SAFETY: forwarded (this function's contract; `pull_slots` checks the range). Past the
        // deadline the pull's future is dropped: nothing more is written to the slots.
        let pulled = tokio::time::timeout(self.deadline, unsafe {
            self.link.pull_slots(from, holder, hashes, slots)
        })
        .await;
        let Ok(verified) = pulled else {
            let m = format!(
                "{} rank {}: pull from {holder} not done within {:?}",
                self.address.instance, self.address.rank, self.deadline
            );
            return fail_all(
                hashes.len(),
                &BlockFailure::new(BlockFailureKind::Timeout, m),
            );
        };
        verified
            .into_iter()
            .zip(hashes.iter().zip(digests))
            .map(|(v, (h, want))| match v {
                Ok(got) if got == *want => Ok(()),
                Ok(_) => Err(BlockFailure::new(
                    BlockFailureKind::IdentityMismatch,
                    format!(
                        "{holder} rank {} named another identity for {:032x} than its leader lent",
                        self.address.rank,
                        h.as_u128()
                    ),
                )),
                Err(f) => Err(f),
            })
            .collect()
    }
}
