//! Logical-only prefix-cache simulation: how many blocks a policy would serve from one tier.
//!
//! A [`PrefixTrace`] is a list of requests, each the chained [`SequenceHash`]es of its prompt
//! blocks. [`simulate`] replays it against one [`BlockManager`] of `capacity` blocks, with no
//! bytes and no I/O, counting hits the way `kvbm replay` does:
//!
//! ```text
//!   per request:  match_blocks (longest cached prefix: hits, revived)
//!              ──▶ allocate the missing blocks (the request's own blocks protected)
//!              ──▶ register them ──▶ (belady: hint each block's next use)
//!              ──▶ release every block, last block first
//! ```
//!
//! A block served is a block of the longest contiguous prefix found, so a block whose parent is
//! gone is a miss. When the missing blocks cannot be allocated (the request is longer than the
//! cache, or a policy keeps too many blocks unevictable), they are counted as misses and not
//! cached. The [`Belady`](crate::eviction::Belady) policy reads each block's next use from the
//! trace, so a table built with it carries its own offline upper bound;
//! [`PrefixTrace::infinite_hit_ratio`] is the bound of an unbounded cache.
//!
//! This is what `examples/hit_ratio.rs` and `kvbm replay --sweep-g2` run: fast enough to
//! replay a Mooncake trace of 300k blocks in well under a second per policy and capacity.

use std::collections::HashMap;

use crate::tier::G2;
use crate::{
    BlockManager, DuplicationPolicy, EvictionBackend, EvictionPolicy, ImmutableBlock, LogicalError,
    SequenceHash,
};

/// Requests as chained block hashes, with each block's next use precomputed.
#[derive(Debug, Clone)]
pub struct PrefixTrace {
    requests: Vec<Vec<SequenceHash>>,
    /// For each request and block: the index of the next request using that block
    /// (`u64::MAX`: never again).
    next_use: Vec<Vec<u64>>,
    blocks: usize,
    unique: usize,
}

impl PrefixTrace {
    /// A trace of `requests`, in arrival order. Every hash must have the same block size.
    pub fn new(requests: Vec<Vec<SequenceHash>>) -> Self {
        let mut next_use = vec![Vec::new(); requests.len()];
        let mut last: HashMap<SequenceHash, u64> = HashMap::new();
        for (i, r) in requests.iter().enumerate().rev() {
            next_use[i] = r
                .iter()
                .map(|h| last.get(h).copied().unwrap_or(u64::MAX))
                .collect();
            for h in r {
                last.insert(*h, i as u64);
            }
        }
        Self {
            blocks: requests.iter().map(Vec::len).sum(),
            unique: last.len(),
            requests,
            next_use,
        }
    }

    /// The requests.
    pub fn requests(&self) -> &[Vec<SequenceHash>] {
        &self.requests
    }

    /// Blocks over all requests.
    pub fn blocks(&self) -> usize {
        self.blocks
    }

    /// Distinct blocks.
    pub fn unique_blocks(&self) -> usize {
        self.unique
    }

    /// The longest request, in blocks.
    pub fn max_request_blocks(&self) -> usize {
        self.requests.iter().map(Vec::len).max().unwrap_or(0)
    }

    /// The hit ratio of an unbounded cache: every block but its first sighting.
    pub fn infinite_hit_ratio(&self) -> f64 {
        if self.blocks == 0 {
            0.0
        } else {
            1.0 - self.unique as f64 / self.blocks as f64
        }
    }
}

/// What one simulation served.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SimOutcome {
    /// Blocks served from the cache (longest-prefix hits).
    pub hit_blocks: u64,
    /// Blocks requested.
    pub blocks: u64,
    /// Requests whose missing blocks could not be allocated (counted as misses, not cached).
    pub failed_allocations: u64,
}

impl SimOutcome {
    /// `hit_blocks / blocks` (0 for an empty trace).
    pub fn hit_ratio(&self) -> f64 {
        if self.blocks == 0 {
            0.0
        } else {
            self.hit_blocks as f64 / self.blocks as f64
        }
    }
}

/// Replays `trace` against one manager of `capacity` blocks under `policy` (see the
/// [module docs](self)).
///
/// # Errors
/// An invalid capacity (0 or too large) from the manager's builder.
pub fn simulate(
    trace: &PrefixTrace,
    capacity: usize,
    policy: EvictionPolicy,
) -> Result<SimOutcome, LogicalError> {
    let block_size = trace
        .requests
        .iter()
        .find_map(|r| r.first())
        .map_or(1, SequenceHash::block_size);
    let m = BlockManager::<G2>::builder()
        .block_count(capacity)
        .block_size(block_size)
        .policy(policy)
        .duplication_policy(DuplicationPolicy::Reject)
        .build()?;
    let belady = policy.backend == EvictionBackend::Belady;
    let mut out = SimOutcome {
        hit_blocks: 0,
        blocks: trace.blocks as u64,
        failed_allocations: 0,
    };
    let mut hints = Vec::new();
    for (i, hashes) in trace.requests.iter().enumerate() {
        let mut held: Vec<ImmutableBlock<G2>> = m.match_blocks(hashes);
        out.hit_blocks += held.len() as u64;
        let missing = &hashes[held.len()..];
        if !missing.is_empty() {
            match m.allocate_blocks_with(missing.len(), hashes.as_slice()) {
                Ok(alloc) => {
                    let mut complete = Vec::with_capacity(missing.len());
                    for (b, h) in alloc.blocks.into_iter().zip(missing) {
                        // same block size as the manager, so completing cannot fail
                        if let Ok(c) = b.complete(*h) {
                            complete.push(c);
                        }
                    }
                    held.extend(m.register_blocks(complete));
                }
                Err(_) => out.failed_allocations += 1,
            }
        }
        if belady {
            hints.clear();
            hints.extend(
                hashes
                    .iter()
                    .copied()
                    .zip(trace.next_use[i].iter().copied()),
            );
            m.hint_next_use(&hints);
        }
        // release the last block first, so recency orders fall back to the tail
        while held.pop().is_some() {}
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Salt;

    fn chain(ids: &[u32]) -> Vec<SequenceHash> {
        let mut v: Vec<SequenceHash> = Vec::new();
        for &id in ids {
            let h = match v.last() {
                None => SequenceHash::root(Salt::NONE, &[id]),
                Some(p) => p.child(&[id]),
            };
            v.push(h);
        }
        v
    }

    #[test]
    fn counts_prefix_hits_and_the_infinite_bound() {
        let trace = PrefixTrace::new(vec![
            chain(&[1, 2, 3]),
            chain(&[1, 2, 4]),
            chain(&[1, 2, 3]),
        ]);
        assert_eq!(trace.blocks(), 9);
        assert_eq!(trace.unique_blocks(), 4);
        assert!((trace.infinite_hit_ratio() - 5.0 / 9.0).abs() < 1e-12);
        let big = simulate(&trace, 64, EvictionPolicy::plain(EvictionBackend::Lru)).unwrap();
        assert_eq!(big.hit_blocks, 5, "2 + 3 hits with room for everything");
        assert_eq!(big.failed_allocations, 0);
        // three blocks: request 2 evicts block 3 (the LRU tail), request 3 misses it
        let small = simulate(&trace, 3, EvictionPolicy::plain(EvictionBackend::Lru)).unwrap();
        assert_eq!(small.hit_blocks, 4);
    }

    #[test]
    fn a_request_longer_than_the_cache_is_a_miss() {
        let trace = PrefixTrace::new(vec![chain(&[1, 2, 3, 4]), chain(&[1, 2, 3, 4])]);
        let o = simulate(&trace, 2, EvictionPolicy::default()).unwrap();
        assert_eq!(o.hit_blocks, 0);
        assert_eq!(o.failed_allocations, 2);
        assert!(simulate(&trace, 0, EvictionPolicy::default()).is_err());
    }

    #[test]
    fn belady_is_an_upper_bound_of_lru_here() {
        let mut reqs = Vec::new();
        for i in 0..200u32 {
            reqs.push(chain(&[i % 7, i % 5, i % 11]));
        }
        let trace = PrefixTrace::new(reqs);
        let b = simulate(&trace, 8, EvictionPolicy::plain(EvictionBackend::Belady)).unwrap();
        let l = simulate(&trace, 8, EvictionPolicy::plain(EvictionBackend::Lru)).unwrap();
        assert!(b.hit_blocks >= l.hit_blocks, "{b:?} vs {l:?}");
    }
}
