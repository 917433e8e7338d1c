//! RAII holders of matched blocks: [`BlockHolder`] for one tier, [`MatchedPrefix`] for a
//! prefix matched across tiers.
//!
//! # Why
//!
//! A block found by a search is only useful if it is still there when the leader acts on it.
//! `kvbm-logical` makes that a matter of ownership: a block with a live [`ImmutableBlock`] is
//! active and never evicted; once the last handle drops it becomes inactive (still matchable,
//! evictable). A holder owns those handles, so "held" means exactly "this value is alive", and
//! dropping it (or any early return or panic) releases every block it held, once.
//!
//! # Invariants
//!
//! * `MatchedPrefix` holds the blocks of the searched `hashes[..len()]`, in order: a run from
//!   the first searched tier, then a run from the next, and so on ([`MatchedPrefix::runs`]);
//!   each tier contributes at most one run.
//! * Every held block is active in its tier for the holder's whole life.

use kvbm_logical::{G2, G3, G4, ImmutableBlock, SequenceHash, Tier, TierId};

/// Strong handles to blocks of one tier; dropping it releases them all.
#[derive(Debug)]
pub struct BlockHolder<T: Tier> {
    blocks: Vec<ImmutableBlock<T>>,
}

impl<T: Tier> Default for BlockHolder<T> {
    fn default() -> Self {
        Self { blocks: Vec::new() }
    }
}

impl<T: Tier> BlockHolder<T> {
    /// Holds `blocks`.
    pub fn new(blocks: Vec<ImmutableBlock<T>>) -> Self {
        Self { blocks }
    }

    /// The tier of the held blocks.
    pub fn tier(&self) -> TierId {
        T::ID
    }

    /// Held blocks, in match order.
    pub fn blocks(&self) -> &[ImmutableBlock<T>] {
        &self.blocks
    }

    /// How many blocks are held.
    pub fn len(&self) -> usize {
        self.blocks.len()
    }

    /// Whether nothing is held.
    pub fn is_empty(&self) -> bool {
        self.blocks.is_empty()
    }

    /// Releases the blocks after the first `len` (e.g. those a policy declined), keeping the
    /// prefix held.
    pub fn truncate(&mut self, len: usize) {
        self.blocks.truncate(len);
    }

    /// Holds `more` after the blocks already held.
    pub(crate) fn extend(&mut self, more: Vec<ImmutableBlock<T>>) {
        self.blocks.extend(more);
    }

    /// Hands the handles over (the caller now holds them).
    pub fn into_blocks(self) -> Vec<ImmutableBlock<T>> {
        self.blocks
    }
}

/// A run of consecutive matched blocks from one tier.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct TierRun {
    /// The tier.
    pub tier: TierId,
    /// Index of the run's first block in the searched hashes.
    pub start: usize,
    /// Blocks in the run.
    pub len: usize,
}

/// The matched prefix of a search, held in place: see [`BlockHolder`] and [`InstanceLeader::find_matches`](crate::leader::InstanceLeader::find_matches).
#[derive(Debug, Default)]
pub struct MatchedPrefix {
    pub(crate) g2: BlockHolder<G2>,
    pub(crate) g3: BlockHolder<G3>,
    pub(crate) g4: BlockHolder<G4>,
    pub(crate) runs: Vec<TierRun>,
    pub(crate) requested: usize,
    /// The part held by another instance's G2 (after every local run), if any.
    pub(crate) remote: Option<super::remote::RemoteRun>,
}

impl MatchedPrefix {
    /// Blocks matched (the prefix length).
    pub fn len(&self) -> usize {
        self.runs.iter().map(|r| r.len).sum::<usize>() + self.remote_len()
    }

    /// Blocks of the prefix in another instance's G2 (pulled, not held here).
    pub fn remote_len(&self) -> usize {
        self.remote.as_ref().map_or(0, |r| r.hashes.len())
    }

    /// The part of the prefix in another instance's G2, after every local run.
    pub fn remote(&self) -> Option<&super::remote::RemoteRun> {
        self.remote.as_ref()
    }

    /// Whether nothing matched.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// How many hashes were searched.
    pub fn requested(&self) -> usize {
        self.requested
    }

    /// Whether every searched hash matched.
    pub fn is_complete(&self) -> bool {
        self.len() == self.requested
    }

    /// The runs, in prefix order (one per tier that contributed, in search order).
    pub fn runs(&self) -> &[TierRun] {
        &self.runs
    }

    /// Blocks matched in `tier`.
    pub fn count(&self, tier: TierId) -> usize {
        match tier {
            TierId::G1 => 0,
            TierId::G2 => self.g2.len(),
            TierId::G3 => self.g3.len(),
            TierId::G4 => self.g4.len(),
        }
    }

    /// The tier holding block `i` of the prefix (local runs only; see [`remote`](Self::remote)).
    pub fn tier_of(&self, i: usize) -> Option<TierId> {
        self.runs
            .iter()
            .find(|r| (r.start..r.start + r.len).contains(&i))
            .map(|r| r.tier)
    }

    /// Held G2 blocks (already in host memory).
    pub fn g2(&self) -> &BlockHolder<G2> {
        &self.g2
    }

    /// Held G3 blocks (need staging G3→G2 before onboarding).
    pub fn g3(&self) -> &BlockHolder<G3> {
        &self.g3
    }

    /// Held G4 blocks (need staging G4→G2 before onboarding).
    pub fn g4(&self) -> &BlockHolder<G4> {
        &self.g4
    }

    /// The hashes of the matched prefix, in order.
    pub fn hashes(&self) -> Vec<SequenceHash> {
        let mut out = Vec::with_capacity(self.len());
        // Each tier contributes at most one run (the search visits a tier once).
        for run in &self.runs {
            match run.tier {
                TierId::G2 => out.extend(self.g2.blocks().iter().map(|b| b.sequence_hash())),
                TierId::G3 => out.extend(self.g3.blocks().iter().map(|b| b.sequence_hash())),
                TierId::G4 => out.extend(self.g4.blocks().iter().map(|b| b.sequence_hash())),
                TierId::G1 => {}
            }
        }
        if let Some(r) = &self.remote {
            out.extend_from_slice(&r.hashes);
        }
        out
    }

    /// Keeps the first `len` blocks of the prefix held and releases the rest, e.g. blocks the
    /// caller knows it must not use (a damaged copy it already rejected). No-op when `len` is
    /// at least [`len`](Self::len).
    pub fn truncate(&mut self, len: usize) {
        if len >= self.len() {
            return;
        }
        for run in &mut self.runs {
            let keep = len.saturating_sub(run.start).min(run.len);
            match run.tier {
                TierId::G2 => self.g2.truncate(keep),
                TierId::G3 => self.g3.truncate(keep),
                TierId::G4 => self.g4.truncate(keep),
                TierId::G1 => {}
            }
            run.len = keep;
        }
        self.runs.retain(|r| r.len > 0);
        let local: usize = self.runs.iter().map(|r| r.len).sum();
        match &mut self.remote {
            Some(r) if len > local => r.hashes.truncate(len - local),
            _ => self.remote = None,
        }
    }

    /// Splits into the per-tier holders (each still releasing on drop); a remote run is
    /// dropped (it holds nothing here).
    pub fn into_parts(self) -> (BlockHolder<G2>, BlockHolder<G3>, BlockHolder<G4>) {
        (self.g2, self.g3, self.g4)
    }
}
