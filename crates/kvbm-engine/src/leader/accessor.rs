//! [`BlockAccessor`]: the leader's read view of where blocks live, by
//! [`TierId`], without holding anything.
//!
//! # Why
//!
//! [`find_matches`](super::InstanceLeader::find_matches) holds what it finds, which is right
//! for onboarding but wrong for questions ("where is this block?", "how much of this prefix
//! would a search find, and in which tiers?") asked by a router, a policy or a scheduler's
//! lookup. The accessor answers those from the shared registry's presence markers: no block is
//! held, nothing is touched (frequency and recency stay as they were), and no manager's store
//! lock is taken. Its answers are a snapshot: a block present now may be evicted before it is
//! held; only a holder ([`MatchedPrefix`]) guarantees presence.
//!
//! It also maps a held prefix to the block ids a worker addresses in each logical layout
//! ([`BlockAccessor::block_ids`]), which is how the leader turns "these blocks" into a
//! [`TransferRequest`](crate::worker::TransferRequest) for every rank.
//!
//! # Scan
//!
//! [`BlockAccessor::scan`] follows the leader's search order the way `find_matches` does (each
//! tier extends the prefix from where the previous one stopped, one run per tier) and returns
//! the runs as [`ScanRun`]s, the same shape a policy sees for a held prefix
//! ([`MatchedPrefix::scan_runs`]).
//!
//! # Locks
//!
//! Only the registry's shard locks, one lookup at a time (`BlockRegistry::is_present`).

use kvbm_logical::{BlockId, SequenceHash, TierId};

use super::InstanceLeader;
use super::holder::MatchedPrefix;
use crate::address::InstanceId;

/// Where a run of a prefix comes from.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub enum RunSource {
    /// One of this instance's layouts (G2, G3 or G4).
    Local(TierId),
    /// Another instance's G2, pulled over the data plane.
    Remote(InstanceId),
}

impl RunSource {
    /// The tier the run is read from (a remote run is another instance's G2).
    pub fn tier(self) -> TierId {
        match self {
            RunSource::Local(h) => h,
            RunSource::Remote(_) => TierId::G2,
        }
    }

    /// Whether the run lives in another instance.
    pub fn is_remote(self) -> bool {
        matches!(self, RunSource::Remote(_))
    }
}

/// A run of consecutive prefix blocks from one source.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct ScanRun {
    /// Where the run's blocks are.
    pub source: RunSource,
    /// Index of the run's first block in the searched hashes.
    pub start: usize,
    /// Blocks in the run.
    pub len: usize,
}

impl ScanRun {
    /// One past the run's last block.
    pub fn end(&self) -> usize {
        self.start + self.len
    }
}

/// The leader's read view: see the [module docs](self).
#[derive(Copy, Clone, Debug)]
pub struct BlockAccessor<'a> {
    leader: &'a InstanceLeader,
}

impl<'a> BlockAccessor<'a> {
    pub(super) fn new(leader: &'a InstanceLeader) -> Self {
        Self { leader }
    }

    /// Whether `hash` is registered in `layout`'s tier (G1 is the inference engine's and is
    /// never reported present here).
    pub fn is_present(&self, hash: SequenceHash, layout: TierId) -> bool {
        layout != TierId::G1
            && self.leader.has_tier(layout)
            && self.leader.registry().is_present(hash, layout)
    }

    /// The first tier, in search order, where `hash` is present.
    pub fn locate(&self, hash: SequenceHash) -> Option<TierId> {
        self.leader
            .search_order()
            .iter()
            .copied()
            .find(|t| self.is_present(hash, *t))
    }

    /// The runs a search of `hashes` would find in the local tiers now, without holding them
    /// (see the [module docs](self#scan)).
    pub fn scan(&self, hashes: &[SequenceHash]) -> Vec<ScanRun> {
        let mut runs = Vec::new();
        let mut at = 0;
        // Passes over the search order until one adds nothing, as `find_matches` does.
        loop {
            let pass_start = at;
            for &tier in self.leader.search_order() {
                if at == hashes.len() {
                    break;
                }
                let layout = tier;
                let n = hashes[at..]
                    .iter()
                    .take_while(|h| self.is_present(**h, layout))
                    .count();
                if n > 0 {
                    runs.push(ScanRun {
                        source: RunSource::Local(layout),
                        start: at,
                        len: n,
                    });
                    at += n;
                }
            }
            if at == pass_start || at == hashes.len() {
                break;
            }
        }
        runs
    }

    /// The `(block id, hash)` of every block `matched` holds in `layout`'s tier, in prefix
    /// order: the ids every rank's layout for `layout` addresses (block ids are slots, see
    /// `kvbm_offload::BoundTier`). Empty for G1 and for a tier not in the prefix.
    pub fn block_ids(
        &self,
        matched: &MatchedPrefix,
        layout: TierId,
    ) -> Vec<(BlockId, SequenceHash)> {
        fn ids<T: kvbm_logical::Tier>(h: &super::BlockHolder<T>) -> Vec<(BlockId, SequenceHash)> {
            h.blocks()
                .iter()
                .map(|b| (b.block_id(), b.sequence_hash()))
                .collect()
        }
        match layout {
            TierId::G1 => Vec::new(),
            TierId::G2 => ids(matched.g2()),
            TierId::G3 => ids(matched.g3()),
            TierId::G4 => ids(matched.g4()),
        }
    }
}
