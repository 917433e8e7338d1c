//! [`CoordinatedWorker`]: one rank that knows its place in the tensor-parallel world.
//!
//! # Why
//!
//! A [`PhysicalWorker`] is one rank's transfer manager and layouts; nothing in it says how
//! many ranks there are, so nothing stops a request meant for rank 1 from being run by rank 0
//! (which would write rank 0's heads where rank 1's belong), and nothing checks that the
//! rank's G4 storage writes under its own key directory. A `CoordinatedWorker` is a worker
//! plus its [`RankAddress`] (rank and world size):
//!
//! * **Requests are addressed.** [`execute_addressed`](CoordinatedWorker::execute_addressed)
//!   runs a request sent to an address (an [`AddressedRequest`]'s) only when that address is
//!   this rank in this world, and otherwise refuses it with [`EngineError::WrongRank`], moving
//!   nothing.
//! * **Layouts resolve per rank.** [`resolve_for`](CoordinatedWorker::resolve_for) maps a
//!   [`TierId`] to this rank's physical layout, refusing a handle addressed to
//!   another rank ([`EngineError::WrongRank`]) or a tier the rank lacks
//!   ([`EngineError::TierMissing`]).
//! * **G4 keys carry the rank.** With more than one rank, every object key must live under
//!   `tp{world}.r{rank}/` so ranks never read each other's heads. `kvbm-physical`'s
//!   [`ObjectStorage`](kvbm_physical::ObjectStorage) adds that directory from its
//!   [`ObjectConfig`] (`tp_rank`, `tp_world_size`); [`object_config`](CoordinatedWorker::object_config)
//!   gives the rank's config to build its storage with, and [`CoordinatedWorker::new`] refuses
//!   a worker whose G4 layout's storage was built for another rank or world size.
//!
//! [`SpmdParallelWorkers::from_coordinated`](super::SpmdParallelWorkers::from_coordinated)
//! builds the SPMD set from coordinated ranks, checking they are ranks `0..n` of one world of
//! `n`.
//!
//! # Locks
//!
//! None: immutable once built.

use std::sync::Arc;

use kvbm_physical::{Backing, LayoutHandle, ObjectConfig};

use super::{PhysicalWorker, Reserved, TransferRequest};
use crate::address::RankAddress;
use crate::error::{EngineError, Result};
use crate::mover::BlockOutcome;
use kvbm_logical::TierId;

/// A [`TransferRequest`] for one rank.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct AddressedRequest {
    /// The rank it is for.
    pub to: RankAddress,
    /// What to move.
    pub request: TransferRequest,
}

/// A rank-aware worker: see the [module docs](self).
#[derive(Clone, Debug)]
pub struct CoordinatedWorker {
    worker: Arc<PhysicalWorker>,
    address: RankAddress,
}

impl CoordinatedWorker {
    /// `worker` as rank `worker.rank()` of `world_size` ranks.
    ///
    /// # Errors
    /// [`EngineError::Config`] with key `workers.world_size` when `world_size` is 0 or the
    /// worker's rank is not below it; with key `physical.object.tp_rank` /
    /// `physical.object.tp_world_size` when the worker's G4 layout is backed by an object
    /// storage built for another rank or world size (its keys would not be this rank's).
    pub fn new(worker: PhysicalWorker, world_size: usize) -> Result<Self> {
        let rank = worker.rank();
        if world_size == 0 || rank >= world_size {
            return Err(EngineError::config(
                "workers.world_size",
                format!("rank {rank} is not a rank of a world of {world_size}"),
            ));
        }
        if let Some(h) = worker.layout(kvbm_logical::TierId::G4) {
            let layout = worker.transfer_manager().layout(h).map_err(|e| {
                EngineError::config("workers", format!("rank {rank}: G4 layout: {e}"))
            })?;
            if let Backing::Object(storage) = layout.backing() {
                let c = storage.config();
                if c.tp_world_size.max(1) != world_size {
                    return Err(EngineError::config(
                        "physical.object.tp_world_size",
                        format!(
                            "rank {rank}: its G4 storage is for a world of {}, the workers are {world_size}",
                            c.tp_world_size
                        ),
                    ));
                }
                if c.tp_rank != rank {
                    return Err(EngineError::config(
                        "physical.object.tp_rank",
                        format!(
                            "rank {rank}: its G4 storage writes rank {}'s keys",
                            c.tp_rank
                        ),
                    ));
                }
            }
        }
        Ok(Self {
            worker: Arc::new(worker),
            address: RankAddress { rank, world_size },
        })
    }

    /// `base` with this rank's tensor-parallel settings: the config to build this rank's G4
    /// [`ObjectStorage`](kvbm_physical::ObjectStorage) with.
    pub fn object_config(address: RankAddress, base: &ObjectConfig) -> ObjectConfig {
        ObjectConfig {
            tp_rank: address.rank,
            tp_world_size: address.world_size,
            ..base.clone()
        }
    }

    /// This rank's address.
    pub fn address(&self) -> RankAddress {
        self.address
    }

    /// This worker's rank.
    pub fn rank(&self) -> usize {
        self.address.rank
    }

    /// Ranks in the world.
    pub fn world_size(&self) -> usize {
        self.address.world_size
    }

    /// The wrapped worker.
    pub fn worker(&self) -> &Arc<PhysicalWorker> {
        &self.worker
    }

    /// A request for this rank.
    pub fn address_request(&self, request: TransferRequest) -> AddressedRequest {
        AddressedRequest {
            to: self.address,
            request,
        }
    }

    fn check(&self, to: RankAddress) -> Result<()> {
        if to == self.address {
            Ok(())
        } else {
            Err(EngineError::WrongRank {
                this: self.address,
                to,
            })
        }
    }

    /// This rank's physical layout for `handle`, asked for by `to`.
    ///
    /// # Errors
    /// [`EngineError::WrongRank`] when `to` is not this rank in this world;
    /// [`EngineError::TierMissing`] when this rank has no layout for the handle's tier.
    pub fn resolve_for(&self, to: RankAddress, handle: TierId) -> Result<LayoutHandle> {
        self.check(to)?;
        self.worker
            .resolve(handle)
            .ok_or(EngineError::TierMissing(handle))
    }

    /// Runs `reserved` on this rank (see [`PhysicalWorker::execute`]).
    pub async fn execute(&self, reserved: &Reserved<'_>) -> Vec<BlockOutcome> {
        // SAFETY: `reserved` proves the request's slots reserved for it (see `Reserved`), held
        // by the caller until this resolves.
        unsafe { self.worker.execute(reserved.request()) }.await
    }

    /// Runs `reserved` when `to` (the address it was sent to) is this rank in this world; one
    /// result per block.
    ///
    /// # Errors
    /// [`EngineError::WrongRank`] (nothing moved) when it is addressed to another rank or
    /// another world size.
    pub async fn execute_addressed(
        &self,
        to: RankAddress,
        reserved: &Reserved<'_>,
    ) -> Result<Vec<BlockOutcome>> {
        self.check(to)?;
        Ok(self.execute(reserved).await)
    }
}
