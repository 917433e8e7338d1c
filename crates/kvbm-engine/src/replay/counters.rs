//! What the replay counts per request ([`Served`], by [`HitSource`]) and the wall time per stage
//! ([`StageTimes`]).

use kvbm_logical::TierId;

/// Where a hit block came from, as the stack counts hits: the tier it was found in (a block
/// read ahead from G3 counts for G3), or G4 written by another instance.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HitSource {
    /// Found in this tier.
    Tier(TierId),
    /// In the shared G4, written by another instance (a G4 hit and a cross-instance one).
    OtherInstance,
}

impl HitSource {
    /// Whether the block comes from G4 (this instance's or another's).
    pub fn is_g4(self) -> bool {
        matches!(self, Self::Tier(TierId::G4) | Self::OtherInstance)
    }
}

/// What serving one request did.
#[derive(Debug, Default, Clone, Copy)]
pub struct Served {
    /// Blocks of the hit prefix, per tier they were found in.
    pub hits: [u64; 4],
    /// Blocks that reached G1 from G2 (staged from G3/G4 or found in G2).
    pub onboarded: u64,
    /// Of those, the ones whose bytes were right.
    pub verified: u64,
    /// Of those, the ones whose bytes were wrong (never served).
    pub corrupt: u64,
    /// Blocks computed in G1.
    pub computed: u64,
    /// Of the hits, G4 blocks another instance wrote.
    pub cross_instance: u64,
}

impl Served {
    /// Counts the prefix's hits by where each block came from (a G4 block another instance
    /// wrote is a G4 hit and a cross-instance one).
    pub(super) fn count_hits(&mut self, sources: &[HitSource]) {
        for s in sources {
            match s {
                HitSource::Tier(t) => self.hits[t.index()] += 1,
                HitSource::OtherInstance => {
                    self.hits[TierId::G4.index()] += 1;
                    self.cross_instance += 1;
                }
            }
        }
    }

    /// Adds the request's hits per tier and computed blocks to the stack's metrics.
    pub(super) fn publish(&self) {
        for (tier, h) in self.hits.iter().enumerate() {
            if *h > 0 {
                metrics::counter!(
                    crate::metrics::STACK_HIT_BLOCKS,
                    crate::metrics::TIER_LABEL => ["g1", "g2", "g3", "g4"][tier]
                )
                .increment(*h);
            }
        }
        metrics::counter!(crate::metrics::STACK_COMPUTED_BLOCKS).increment(self.computed);
    }
}

/// Wall time per stage, summed over requests.
#[derive(Debug, Default, Clone, Copy, serde::Serialize)]
pub struct StageTimes {
    /// Lookups over the tiers.
    pub lookup: f64,
    /// G3→G2 onboarding (transfer + journal checksum check; waiting for read_ahead_staged reads).
    pub g3_to_g2: f64,
    /// Starting G3→G2 reads ahead of their request (presence checks, allocation, submission).
    pub read_ahead: f64,
    /// G4→G2 onboarding.
    pub g4_to_g2: f64,
    /// G2→G1 onboarding, with the byte check.
    pub g2_to_g1: f64,
    /// Computing missed blocks in G1 and registering them.
    pub compute: f64,
    /// Handing computed blocks to G2: the G1→G2 lane's enqueue (`--scheduler sessions`), or
    /// the scheduler's store (`tiering`: prepare_store → G1→G2 copy → complete_store → the
    /// lower lanes' enqueue).
    pub offload_enqueue: f64,
    /// Waiting for G1 space while offloads drained.
    pub g1_backpressure: f64,
    /// Waiting for the offload lanes to catch up (see `ReplayDriver::wait_for_room`).
    pub offload_backpressure: f64,
    /// The end: draining every lane, syncing G3 and its journal.
    pub drain: f64,
}
