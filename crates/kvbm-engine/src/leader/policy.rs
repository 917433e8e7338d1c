//! Policy-based scanning: which part of a matched prefix is worth onboarding.
//!
//! # Why
//!
//! A match is not always worth its transfer. Reading a two-block run from S3 costs a round
//! trip of tens of milliseconds, while recomputing two blocks on the GPU may cost less; a
//! remote pull has a connection cost of its own. The leader therefore asks its
//! [`OnboardPolicy`] how much of the matched prefix to keep, and releases the rest at once
//! (it is not held for nothing). Because the KV cache is only useful as a **prefix**, a policy
//! answers with a length: everything after it is recomputed by the engine.
//!
//! ```text
//!  find_matches ──► MatchedPrefix (held) ──► scan_runs ──► policy.select ──► truncate(len)
//!                    G2:3 | G3:4 | G4:2                     e.g. MinRun{G4, 4} → 7
//!                                                           released: the G4 run
//! ```
//!
//! Built-in policies: [`OnboardAll`] (the default), [`MinRun`] (skip a run from one source
//! shorter than N blocks), [`CostModel`] (keep the prefix that saves the most, from per-tier
//! costs and the recompute cost), and [`AllOf`] (the shortest of several answers).
//!
//! # Invariants
//!
//! * `select` returns at most the prefix length (larger answers are clamped).
//! * A policy never extends a prefix: it can only cut it.

use std::fmt::Debug;
use std::sync::Arc;

use kvbm_logical::TierId;

use super::accessor::{RunSource, ScanRun};

/// What a policy sees: the runs of a matched prefix, in order.
#[derive(Copy, Clone, Debug)]
pub struct PrefixScan<'a> {
    /// The runs, contiguous from block 0.
    pub runs: &'a [ScanRun],
    /// How many hashes were searched.
    pub requested: usize,
}

impl PrefixScan<'_> {
    /// Blocks matched.
    pub fn len(&self) -> usize {
        self.runs.last().map_or(0, ScanRun::end)
    }

    /// Whether nothing matched.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Decides how much of a matched prefix to onboard: see the [module docs](self).
pub trait OnboardPolicy: Send + Sync + Debug {
    /// Blocks to keep from the start of the prefix (at most `scan.len()`).
    fn select(&self, scan: &PrefixScan<'_>) -> usize;
}

/// Onboards everything matched.
#[derive(Copy, Clone, Debug, Default)]
pub struct OnboardAll;

impl OnboardPolicy for OnboardAll {
    fn select(&self, scan: &PrefixScan<'_>) -> usize {
        scan.len()
    }
}

/// Which runs a [`MinRun`] applies to.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum RunKind {
    /// Runs read from this local tier.
    Tier(TierId),
    /// Runs pulled from another instance.
    Remote,
}

impl RunKind {
    fn matches(self, source: RunSource) -> bool {
        match (self, source) {
            (RunKind::Remote, RunSource::Remote(_)) => true,
            (RunKind::Tier(t), RunSource::Local(h)) => h == t,
            _ => false,
        }
    }
}

/// Cuts the prefix before the first run of `kind` shorter than `min_blocks` (e.g. skip a G4
/// run of fewer than 4 blocks: its round trip costs more than recomputing it).
#[derive(Copy, Clone, Debug)]
pub struct MinRun {
    /// The runs the rule applies to.
    pub kind: RunKind,
    /// The shortest run of that kind worth onboarding.
    pub min_blocks: usize,
}

impl OnboardPolicy for MinRun {
    fn select(&self, scan: &PrefixScan<'_>) -> usize {
        scan.runs
            .iter()
            .find(|r| self.kind.matches(r.source) && r.len < self.min_blocks)
            .map_or(scan.len(), |r| r.start)
    }
}

/// Costs of one source, in any unit shared with [`CostModel::recompute_per_block`] (e.g.
/// microseconds).
#[derive(Copy, Clone, Debug, PartialEq)]
pub struct SourceCost {
    /// Paid once per run (a round trip, a connection, a batch submission).
    pub per_run: f64,
    /// Paid per block moved.
    pub per_block: f64,
}

/// Keeps the prefix, cut at a run boundary, that saves the most against recomputing it: a
/// run of `n` blocks saves `n × recompute_per_block − (per_run + n × per_block)`, and the
/// kept prefix is the one with the largest total saving (ties: the shorter).
#[derive(Copy, Clone, Debug, PartialEq)]
pub struct CostModel {
    /// Cost of recomputing one block.
    pub recompute_per_block: f64,
    /// G2 (already in host memory: only G2→G1).
    pub g2: SourceCost,
    /// G3 (staged from disk first).
    pub g3: SourceCost,
    /// G4 (staged from the object store first).
    pub g4: SourceCost,
    /// Another instance's G2 (pulled over the data plane first).
    pub remote: SourceCost,
}

impl CostModel {
    fn cost(&self, source: RunSource) -> SourceCost {
        match source {
            RunSource::Remote(_) => self.remote,
            RunSource::Local(h) => match h {
                TierId::G1 | TierId::G2 => self.g2,
                TierId::G3 => self.g3,
                TierId::G4 => self.g4,
            },
        }
    }
}

impl OnboardPolicy for CostModel {
    fn select(&self, scan: &PrefixScan<'_>) -> usize {
        let (mut best, mut best_saving, mut saving) = (0, 0.0_f64, 0.0_f64);
        for r in scan.runs {
            let c = self.cost(r.source);
            let n = r.len as f64;
            saving += n * self.recompute_per_block - (c.per_run + n * c.per_block);
            if saving > best_saving {
                best_saving = saving;
                best = r.end();
            }
        }
        best
    }
}

/// The shortest answer of several policies (every one must agree a block is worth it).
#[derive(Clone, Debug, Default)]
pub struct AllOf(pub Vec<Arc<dyn OnboardPolicy>>);

impl OnboardPolicy for AllOf {
    fn select(&self, scan: &PrefixScan<'_>) -> usize {
        self.0
            .iter()
            .map(|p| p.select(scan))
            .fold(scan.len(), usize::min)
    }
}

#[cfg(test)]
mod tests;
