//! What the stack counts: bytes per path, failures, what serving a request did, and the wall
//! time per stage. Shared (atomics) with the lanes' sinks and executors.

use std::sync::atomic::{AtomicU64, Ordering};

use kvbm_logical::TierId;

/// A path bytes move along: from one tier to another (a pair of [`TierId`]s). The stack moves
/// along six; [`MovePath::ALL`] is their order in [`Counters::bytes`] and [`PATH_NAMES`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct MovePath {
    /// Where the bytes come from.
    pub from: TierId,
    /// Where they go.
    pub to: TierId,
}

impl MovePath {
    /// G1→G2 offload.
    pub const G1_TO_G2: Self = Self::new(TierId::G1, TierId::G2);
    /// G2→G3 offload.
    pub const G2_TO_G3: Self = Self::new(TierId::G2, TierId::G3);
    /// G3→G2 onboarding.
    pub const G3_TO_G2: Self = Self::new(TierId::G3, TierId::G2);
    /// G2→G4 offload.
    pub const G2_TO_G4: Self = Self::new(TierId::G2, TierId::G4);
    /// G4→G2 onboarding.
    pub const G4_TO_G2: Self = Self::new(TierId::G4, TierId::G2);
    /// G2→G1 onboarding.
    pub const G2_TO_G1: Self = Self::new(TierId::G2, TierId::G1);
    /// Every path the stack moves along, in counter order.
    pub const ALL: [Self; 6] = [
        Self::G1_TO_G2,
        Self::G2_TO_G3,
        Self::G3_TO_G2,
        Self::G2_TO_G4,
        Self::G4_TO_G2,
        Self::G2_TO_G1,
    ];

    const fn new(from: TierId, to: TierId) -> Self {
        Self { from, to }
    }

    /// The path's place in [`MovePath::ALL`] (and [`Counters::bytes`]); `None` for a path the
    /// stack never moves along.
    pub fn index(self) -> Option<usize> {
        Self::ALL.iter().position(|p| *p == self)
    }
}

/// Names of the paths, in [`MovePath::ALL`] order.
pub const PATH_NAMES: [&str; 6] = [
    "g1_to_g2", "g2_to_g3", "g3_to_g2", "g2_to_g4", "g4_to_g2", "g2_to_g1",
];

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

/// Counters shared with the pipelines' sinks and executors.
#[derive(Debug, Default)]
pub struct Counters {
    /// Bytes moved per path ([`MovePath::ALL`] order).
    pub bytes: [AtomicU64; 6],
    /// Blocks whose transfer failed (any lane, any direction), not counting checksum rejections.
    pub failed_transfers: AtomicU64,
    /// Blocks a tier rejected on read (checksum, header or identity).
    pub checksum_failures: AtomicU64,
    /// Blocks the offload lanes accepted (`enqueue` succeeded), every lane.
    pub offload_enqueued: AtomicU64,
}

impl Counters {
    pub(super) fn add_bytes(&self, path: MovePath, blocks: usize, block_bytes: usize) {
        let Some(i) = path.index() else {
            debug_assert!(false, "the stack never moves along {path:?}");
            return;
        };
        let b = (blocks * block_bytes) as u64;
        self.bytes[i].fetch_add(b, Ordering::Relaxed);
        metrics::counter!(
            crate::metrics::STACK_BYTES_MOVED,
            crate::metrics::PATH_LABEL => PATH_NAMES[i]
        )
        .increment(b);
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
    /// Waiting for the offload lanes to catch up (see `TierStack::wait_for_room`).
    pub offload_backpressure: f64,
    /// The end: draining every lane, syncing G3 and its journal.
    pub drain: f64,
}
