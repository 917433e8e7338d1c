//! Who is who in a cluster: an instance ([`InstanceId`]), one of its workers
//! ([`WorkerAddress`]), and a rank within a tensor-parallel world ([`RankAddress`]).
//!
//! Plain data at the bottom of the crate: every plane names peers with these, and this module
//! imports nothing of the crate.

use serde::{Deserialize, Serialize};

/// Identity of one kvbm instance (one leader and its workers).
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(transparent)]
pub struct InstanceId(pub u64);

impl std::fmt::Display for InstanceId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "instance-{:016x}", self.0)
    }
}

/// One worker of one instance: the rank it serves.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct WorkerAddress {
    /// The instance (leader) the worker belongs to.
    pub instance: InstanceId,
    /// Its rank, `0..world_size`.
    pub rank: u32,
}

impl WorkerAddress {
    /// The worker of `instance` at `rank`.
    pub fn new(instance: InstanceId, rank: u32) -> Self {
        Self { instance, rank }
    }

    /// The NATS subject its control requests go to: `{prefix}.{instance:016x}.worker.{rank}`.
    pub fn control_subject(&self, prefix: &str) -> String {
        format!("{prefix}.{:016x}.worker.{}", self.instance.0, self.rank)
    }
}

impl std::fmt::Display for WorkerAddress {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/rank-{}", self.instance, self.rank)
    }
}

/// A rank within a tensor-parallel world of `world_size` ranks.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct RankAddress {
    /// The rank, `0..world_size`.
    pub rank: usize,
    /// Ranks in the world.
    pub world_size: usize,
}

impl std::fmt::Display for RankAddress {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "rank {} of {}", self.rank, self.world_size)
    }
}
