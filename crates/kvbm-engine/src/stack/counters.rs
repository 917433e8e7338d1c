//! What the stack counts: bytes per path and failures. Shared (atomics) with the lanes' sinks
//! and executors. (What a request hit and the stage timings are the replay driver's:
//! `crate::replay`.)

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
    pub(crate) fn add_bytes(&self, path: MovePath, blocks: usize, block_bytes: usize) {
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
