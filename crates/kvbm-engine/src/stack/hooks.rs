//! The stack's hooks: what a block's bytes must be ([`Contents`]) and which identity a block
//! carries when a tier knows it only by name ([`Identities`]).
//!
//! The stack moves and checks bytes it did not produce. Headers and checksums prove that a
//! tier returned what was written under a block's identity; [`Contents`] goes one step further
//! and proves, at G1, that the bytes are the block's own (the replay's byte check plugs in
//! here; a test can plug in any pattern). [`Identities`] answers for blocks registered without
//! a digest (a G4 object listed at a warm start or adopted from another instance's events),
//! so such a read is still checked against the full identity.

use std::collections::HashMap;

use kvbm_logical::{BlockDigest, SequenceHash};

/// What each block's bytes are: filled when a block is computed, verified when one reaches G1
/// from a lower tier (see [`crate::stack`]).
pub trait Contents: std::fmt::Debug + Send + Sync + 'static {
    /// Writes block `hash`'s bytes into `out` (the stand-in for the forward pass that computes
    /// a missed block in G1).
    fn fill(&self, hash: SequenceHash, out: &mut [u8]);

    /// Whether `bytes` are block `hash`'s. Called on every block that reaches G1 from a lower
    /// tier; a block that fails is counted corrupt and never served.
    fn verify(&self, hash: SequenceHash, bytes: &[u8]) -> bool;
}

/// The identity (digest) of blocks by the hash every tier registers them under: what a read of
/// a block registered without its digest is checked against. Empty: every identity is the
/// sequence hash.
#[derive(Default)]
pub struct Identities(HashMap<SequenceHash, BlockDigest>);

impl std::fmt::Debug for Identities {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Identities({} blocks)", self.0.len())
    }
}

impl Identities {
    /// The identities of `blocks` (hash, digest).
    pub fn new(blocks: impl IntoIterator<Item = (SequenceHash, BlockDigest)>) -> Self {
        Identities(blocks.into_iter().collect())
    }

    /// The digest of the block registered under `h`, when one is known.
    pub fn get(&self, h: SequenceHash) -> Option<BlockDigest> {
        self.0.get(&h).copied()
    }

    /// The identity expected of `h`: the registered block's own digest, else the known one.
    pub fn expected(
        &self,
        h: SequenceHash,
        registered: Option<BlockDigest>,
    ) -> Option<BlockDigest> {
        registered.or_else(|| self.get(h))
    }

    /// Blocks with a known identity.
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// Whether no identity is known.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}
