//! What the stack counts: bytes per path, failures, what serving a request did, and the wall
//! time per stage. Shared (atomics) with the lanes' sinks and executors.

use std::sync::atomic::{AtomicU64, Ordering};

/// Indexes into [`Counters::bytes`].
#[derive(Debug, Clone, Copy)]
pub enum MovePath {
    /// G1→G2 offload.
    G1ToG2 = 0,
    /// G2→G3 offload.
    G2ToG3 = 1,
    /// G3→G2 onboarding.
    G3ToG2 = 2,
    /// G2→G4 offload.
    G2ToG4 = 3,
    /// G4→G2 onboarding.
    G4ToG2 = 4,
    /// G2→G1 onboarding.
    G2ToG1 = 5,
}

/// Names of the paths, in [`MovePath`] order.
pub const PATH_NAMES: [&str; 6] = [
    "g1_to_g2", "g2_to_g3", "g3_to_g2", "g2_to_g4", "g4_to_g2", "g2_to_g1",
];

/// Counters shared with the pipelines' sinks and executors.
#[derive(Debug, Default)]
pub struct Counters {
    /// Bytes moved per path ([`MovePath`] order).
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
        let b = (blocks * block_bytes) as u64;
        self.bytes[path as usize].fetch_add(b, Ordering::Relaxed);
        metrics::counter!("kvbm_replay_bytes_moved_total", "path" => PATH_NAMES[path as usize])
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
    /// Counts the prefix's hits by the tier each block came from (0..=3 for G1..G4, 4 for a G4
    /// block another instance wrote: a G4 hit and a cross-instance one).
    pub(super) fn count_hits(&mut self, sources: &[u8]) {
        for s in sources {
            self.hits[(*s as usize).min(3)] += 1;
            self.cross_instance += u64::from(*s == 4);
        }
    }

    /// Adds the request's hits per tier and computed blocks to the stack's metrics.
    pub(super) fn publish(&self) {
        for (tier, h) in self.hits.iter().enumerate() {
            if *h > 0 {
                metrics::counter!("kvbm_replay_hit_blocks_total", "tier" => ["g1", "g2", "g3", "g4"][tier])
                    .increment(*h);
            }
        }
        metrics::counter!("kvbm_replay_computed_blocks_total").increment(self.computed);
    }
}

/// Wall time per stage, summed over requests.
#[derive(Debug, Default, Clone, Copy, serde::Serialize)]
pub struct StageTimes {
    /// Lookups over the tiers.
    pub lookup: f64,
    /// G3→G2 onboarding (transfer + journal checksum check; waiting for prefetched reads).
    pub g3_to_g2: f64,
    /// Starting G3→G2 reads ahead of their request (presence checks, allocation, submission).
    pub prefetch: f64,
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
    /// Waiting for the offload lanes to catch up (see `TierStack::backpressure`).
    pub offload_backpressure: f64,
    /// The end: draining every lane, syncing G3 and its journal.
    pub drain: f64,
}
