//! The stack's hooks: what a block's bytes must be ([`Contents`]) and which identity a block
//! carries when a tier knows it only by name ([`Identities`]).
//!
//! The stack moves and checks bytes it did not produce. Headers and checksums prove that a
//! tier returned what was written under a block's identity; [`Contents`] goes one step further
//! and proves, at G1, that the bytes are the block's own (the replay's byte check plugs in
//! here; a test can plug in any pattern). [`Identities`] answers for blocks registered without
//! a digest (a G4 object listed at a warm start or adopted from another instance's events),
//! so such a read is still checked against the full identity.
//!
//! [`ShareG4`] is the seam to the cluster plane: a stack that is one of several instances
//! sharing G4 joins them through it (`cluster::shared_g4::Sharing`, feature `nats`, over
//! NATS); the stack itself knows nothing of the network.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use kvbm_logical::{BlockDigest, EventSink, SequenceHash};
use parking_lot::Mutex;

use crate::error::Result;
use crate::leader::RemoteSearch;
use crate::runtime::KvbmRuntime;

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
///
/// Most are known up front ([`new`](Self::new): the replay's trace). An engine that learns its
/// keys as requests arrive (kvbm-vllm's fleet tier) adds each before it asks a peer for the
/// block ([`learn`](Self::learn)) and drops it once the block is registered with its digest
/// ([`forget`](Self::forget)), so the map holds only what is in flight.
///
/// Lock: one `RwLock` over the map, held for one map operation, never across another lock.
#[derive(Default)]
pub struct Identities(parking_lot::RwLock<HashMap<SequenceHash, BlockDigest>>);

impl std::fmt::Debug for Identities {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Identities({} blocks)", self.len())
    }
}

impl Identities {
    /// The identities of `blocks` (hash, digest).
    pub fn new(blocks: impl IntoIterator<Item = (SequenceHash, BlockDigest)>) -> Self {
        Identities(parking_lot::RwLock::new(blocks.into_iter().collect()))
    }

    /// The digest of the block registered under `h`, when one is known.
    pub fn get(&self, h: SequenceHash) -> Option<BlockDigest> {
        self.0.read().get(&h).copied()
    }

    /// Records `digest` as the identity of `h` (replacing any earlier one).
    pub fn learn(&self, h: SequenceHash, digest: BlockDigest) {
        self.0.write().insert(h, digest);
    }

    /// Drops what is known of `h`; returns whether anything was.
    pub fn forget(&self, h: SequenceHash) -> bool {
        self.0.write().remove(&h).is_some()
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
        self.0.read().len()
    }

    /// Whether no identity is known.
    pub fn is_empty(&self) -> bool {
        self.0.read().is_empty()
    }
}

/// How a stack joins the other instances it shares G4 with: set in
/// [`StackPlan::sharing`](super::StackPlan::sharing), called once by
/// [`TierStack::build`](super::TierStack::build) after the engine runtime started.
pub trait ShareG4: std::fmt::Debug + Send + Sync + 'static {
    /// Connects to the others and starts following their G4 events, scoped by the stack's
    /// model `fingerprint` (only instances of the same fingerprint are heard; see
    /// [`KvbmConfig::fingerprint`](crate::config::KvbmConfig::fingerprint)).
    ///
    /// # Errors
    /// The cluster plane cannot be reached or started (the error names what).
    fn join(
        &self,
        runtime: &KvbmRuntime,
        fingerprint: &kvbm_physical::ModelFingerprint,
    ) -> Result<Box<dyn SharedG4>>;
}

/// G4 shared with other instances, once joined: what the stack needs of it.
pub trait SharedG4: Send + Sync + 'static {
    /// Hashes this instance wrote to G4 (or found there at start): a G4 hit on any other hash
    /// is a block another instance wrote.
    fn own(&self) -> &Arc<Mutex<HashSet<SequenceHash>>>;
    /// How the leader searches the other instances' G4 blocks.
    fn remote(&self) -> RemoteSearch;
    /// Where G4's manager publishes its stored/removed events.
    fn sink(&self) -> Arc<dyn EventSink>;
    /// Waits until every other instance is ready (called when the stack is built, before it
    /// serves).
    ///
    /// # Errors
    /// Not every instance was heard in time, or the plane went away.
    fn wait_for_all(&self, rt: &tokio::runtime::Handle) -> Result<()>;
}
