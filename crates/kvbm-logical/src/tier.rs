//! Storage tiers: a runtime tag ([`TierId`]) and zero-sized type-level markers ([`G1`]..[`G4`]).
//!
//! Blocks carry their tier as a type parameter, so a `ImmutableBlock<G2>` cannot be passed
//! where a `ImmutableBlock<G3>` is expected.

use serde::{Deserialize, Serialize};

/// Runtime tag of a storage tier.
#[derive(Copy, Clone, Eq, PartialEq, Hash, Ord, PartialOrd, Debug, Serialize, Deserialize)]
pub enum TierId {
    /// GPU memory (the attention kernels' KV cache).
    G1,
    /// Pinned host memory.
    G2,
    /// Local disk.
    G3,
    /// Object storage.
    G4,
}

impl TierId {
    /// All tiers, top to bottom.
    pub const ALL: [TierId; 4] = [TierId::G1, TierId::G2, TierId::G3, TierId::G4];

    /// 0 for G1 .. 3 for G4.
    pub const fn index(self) -> usize {
        self as usize
    }

    /// The tier's name ("G1".."G4").
    pub const fn as_str(self) -> &'static str {
        match self {
            TierId::G1 => "G1",
            TierId::G2 => "G2",
            TierId::G3 => "G3",
            TierId::G4 => "G4",
        }
    }

    pub(crate) const fn bit(self) -> u8 {
        1 << (self as u8)
    }
}

impl std::fmt::Display for TierId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A type-level tier marker.
pub trait Tier: Send + Sync + 'static {
    /// The runtime tag of this tier.
    const ID: TierId;
}

macro_rules! tier_marker {
    ($(#[$doc:meta] $name:ident),* $(,)?) => {$(
        #[$doc]
        #[derive(Copy, Clone, Eq, PartialEq, Hash, Debug, Default)]
        pub struct $name;
        impl Tier for $name {
            const ID: TierId = TierId::$name;
        }
    )*};
}

tier_marker!(
    /// Tier marker: GPU memory.
    G1,
    /// Tier marker: pinned host memory.
    G2,
    /// Tier marker: local disk.
    G3,
    /// Tier marker: object storage.
    G4,
);
