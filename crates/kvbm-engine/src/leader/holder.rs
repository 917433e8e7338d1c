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

use crate::address::InstanceId;

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
    pub(crate) remote: Option<RemoteRun>,
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
    pub fn remote(&self) -> Option<&RemoteRun> {
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

    /// The runs, in prefix order. A tier contributes one run per search pass that found some
    /// of the prefix there (usually one).
    pub fn runs(&self) -> &[TierRun] {
        &self.runs
    }

    /// The prefix position of each block `tier`'s holder holds, in the holder's order.
    pub fn positions(&self, tier: TierId) -> Vec<usize> {
        self.runs
            .iter()
            .filter(|r| r.tier == tier)
            .flat_map(|r| r.start..r.start + r.len)
            .collect()
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
        // A tier may contribute several runs: walk each holder once, in prefix order.
        let (mut i2, mut i3, mut i4) = (
            self.g2.blocks().iter(),
            self.g3.blocks().iter(),
            self.g4.blocks().iter(),
        );
        for run in &self.runs {
            let it: &mut dyn Iterator<Item = SequenceHash> = match run.tier {
                TierId::G2 => &mut i2.by_ref().map(|b| b.sequence_hash()),
                TierId::G3 => &mut i3.by_ref().map(|b| b.sequence_hash()),
                TierId::G4 => &mut i4.by_ref().map(|b| b.sequence_hash()),
                TierId::G1 => continue,
            };
            out.extend(it.take(run.len));
        }
        if let Some(r) = &self.remote {
            out.extend_from_slice(&r.hashes);
        }
        out
    }

    /// The prefix's runs as a policy sees them ([`ScanRun`](super::ScanRun)): the local runs,
    /// then the remote run, if any.
    pub fn scan_runs(&self) -> Vec<super::ScanRun> {
        let mut out: Vec<super::ScanRun> = self
            .runs
            .iter()
            .map(|r| super::ScanRun {
                source: super::RunSource::Local(r.tier),
                start: r.start,
                len: r.len,
            })
            .collect();
        if let Some(r) = &self.remote {
            out.push(super::ScanRun {
                source: super::RunSource::Remote(r.instance),
                start: r.start,
                len: r.hashes.len(),
            });
        }
        out
    }

    /// Keeps the first `len` blocks of the prefix held and releases the rest at once (a run
    /// past `len` is dropped, the run across it is shortened). `len` past the prefix changes
    /// nothing. The searched length ([`requested`](Self::requested)) is unchanged.
    pub fn truncate(&mut self, len: usize) {
        // A tier may contribute several runs; its holder keeps its blocks in prefix order, so
        // it keeps as many as its runs keep in all.
        let mut kept = Vec::with_capacity(self.runs.len());
        let (mut k2, mut k3, mut k4) = (0, 0, 0);
        for mut r in std::mem::take(&mut self.runs) {
            let keep = len.saturating_sub(r.start).min(r.len);
            match r.tier {
                TierId::G2 => k2 += keep,
                TierId::G3 => k3 += keep,
                TierId::G4 => k4 += keep,
                TierId::G1 => {}
            }
            if keep > 0 {
                r.len = keep;
                kept.push(r);
            }
        }
        self.g2.truncate(k2);
        self.g3.truncate(k3);
        self.g4.truncate(k4);
        self.runs = kept;
        if let Some(r) = &mut self.remote {
            let keep = len.saturating_sub(r.start).min(r.hashes.len());
            if keep == 0 {
                self.remote = None;
            } else {
                r.hashes.truncate(keep);
            }
        }
    }

    /// Splits into the per-tier holders (each still releasing on drop); a remote run is
    /// dropped (it holds nothing here).
    pub fn into_parts(self) -> (BlockHolder<G2>, BlockHolder<G3>, BlockHolder<G4>) {
        (self.g2, self.g3, self.g4)
    }
}

/// A run of the prefix held in another instance's G2, to be pulled over the data plane.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RemoteRun {
    /// The instance holding it.
    pub instance: InstanceId,
    /// Index of the run's first block in the searched hashes.
    pub start: usize,
    /// The run's hashes, in order.
    pub hashes: Vec<SequenceHash>,
}
