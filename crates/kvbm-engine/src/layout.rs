//! [`LogicalLayoutHandle`]: the name of a tier's layout that means the same on every rank
//! (the why is on the type, which the crate root exports).

use kvbm_logical::TierId;

/// A tier's layout, named the same on every rank.
///
/// # Why
///
/// The leader owns one logical block-id space per tier; every rank has its own physical
/// layout for that tier, registered with its own transfer manager under a
/// [`LayoutHandle`](kvbm_physical::LayoutHandle) that only that rank's manager understands. The
/// leader therefore never names a physical handle: it names the *logical* layout (G1..G4) and
/// each rank resolves it (`PhysicalWorker::resolve`, in `worker`).
/// The handle encodes the layout id as one byte (`0` = G1 .. `3` = G4), so it travels in
/// control messages as is.
#[derive(
    Copy, Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize, serde::Deserialize,
)]
#[repr(u8)]
pub enum LogicalLayoutHandle {
    /// The inference engine's KV cache (device memory).
    G1 = 0,
    /// Pinned host memory.
    G2 = 1,
    /// Local disk.
    G3 = 2,
    /// Object storage.
    G4 = 3,
}

impl LogicalLayoutHandle {
    /// Every handle, top tier first.
    pub const ALL: [LogicalLayoutHandle; 4] = [Self::G1, Self::G2, Self::G3, Self::G4];

    /// The encoded layout id (`0` = G1 .. `3` = G4).
    pub const fn id(self) -> u8 {
        self as u8
    }

    /// The handle of layout id `id`, if it names one.
    pub const fn from_id(id: u8) -> Option<Self> {
        match id {
            0 => Some(Self::G1),
            1 => Some(Self::G2),
            2 => Some(Self::G3),
            3 => Some(Self::G4),
            _ => None,
        }
    }

    /// The tier whose layout this is.
    pub const fn tier(self) -> TierId {
        match self {
            Self::G1 => TierId::G1,
            Self::G2 => TierId::G2,
            Self::G3 => TierId::G3,
            Self::G4 => TierId::G4,
        }
    }
}

impl From<TierId> for LogicalLayoutHandle {
    fn from(tier: TierId) -> Self {
        match tier {
            TierId::G1 => Self::G1,
            TierId::G2 => Self::G2,
            TierId::G3 => Self::G3,
            TierId::G4 => Self::G4,
        }
    }
}

impl std::fmt::Display for LogicalLayoutHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.tier().as_str())
    }
}

#[cfg(test)]
mod tests {
    //! The id encoding round-trips and agrees with the tier order.

    use super::*;

    #[test]
    fn ids_round_trip_and_follow_the_tiers() {
        for h in LogicalLayoutHandle::ALL {
            assert_eq!(LogicalLayoutHandle::from_id(h.id()), Some(h));
            assert_eq!(LogicalLayoutHandle::from(h.tier()), h);
            assert_eq!(h.id() as usize, h.tier().index());
            assert_eq!(h.to_string(), h.tier().as_str());
        }
        assert_eq!(LogicalLayoutHandle::from_id(4), None);
        assert_eq!(LogicalLayoutHandle::from_id(u8::MAX), None);
    }
}
