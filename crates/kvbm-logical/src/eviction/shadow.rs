//! Sampled shadow caches for [`TinyLfu`](super::TinyLfu)'s LRU duel (`adaptive-<base>`).
//!
//! A [`Shadow`] is a tiny cache of hashes only (no slots, no bytes) that sees the accesses of
//! a fixed sample of the hash space (1 in [`SAMPLE`]) with `1/SAMPLE` of the real capacity:
//! by the usual set-sampling argument its hit ratio estimates that of a full-size cache of
//! the same policy. Two of them run side by side: plain LRU, and the admission filter (first
//! sightings in a probation FIFO evicted first while it holds more than a target). The filter
//! follows LRU's order whenever the LRU shadow has recently hit more than the filter shadow;
//! so, up to sampling noise, the default policy is never below LRU.
//!
//! Each shadow is a hash map from hash to node plus two intrusive lists over its nodes
//! (probation, main), all allocated up front; an access is one map lookup and O(1) list work.

use hashbrown::HashMap;

use super::list::{Lists, NIL};
use crate::hash::{PassThroughHash, SequenceHash};

/// One hash in `SAMPLE` is simulated by the shadows (a power of two).
pub(crate) const SAMPLE: u64 = 16;

const PROBATION: usize = 0;
const MAIN: usize = 1;

/// Whether `h` is in the sampled part of the hash space.
#[inline]
pub(crate) fn sampled(h: &SequenceHash) -> bool {
    // the ghost filters index by bits 7.. of the same mix; use the top bits here
    let c = h.current() ^ (h.as_u128() as u64);
    (c.wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 60) & (SAMPLE - 1) == 0
}

/// A hash-only cache of `capacity` entries: LRU when every access is admitted, the admission
/// filter's order when first sightings go to probation.
#[derive(Clone, Debug)]
pub(crate) struct Shadow {
    map: HashMap<SequenceHash, u32, PassThroughHash>,
    keys: Vec<SequenceHash>,
    lists: Lists<2>,
    free: Vec<u32>,
}

impl Shadow {
    pub(crate) fn new(capacity: usize) -> Self {
        let capacity = capacity.max(1);
        Self {
            map: HashMap::with_capacity_and_hasher(capacity + 1, PassThroughHash),
            keys: vec![SequenceHash::from_u128(0); capacity],
            lists: Lists::new(capacity),
            free: (0..capacity as u32).rev().collect(),
        }
    }

    /// Entries cached.
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.map.len()
    }

    /// Accesses `h`; returns whether it was a hit. A hit moves `h` to the most recent end of
    /// the main list. A miss inserts it there when `admit`, else at the tail of probation,
    /// evicting first, when full, the probation head if probation holds more than
    /// `probation_target` entries (or main is empty), else the main head.
    pub(crate) fn access(&mut self, h: SequenceHash, admit: bool, probation_target: usize) -> bool {
        if let Some(&n) = self.map.get(&h) {
            self.lists.unlink(n);
            self.lists.push_back(n, MAIN);
            return true;
        }
        let n = match self.free.pop() {
            Some(n) => n,
            None => {
                let from =
                    if self.lists.len(PROBATION) > probation_target || self.lists.len(MAIN) == 0 {
                        PROBATION
                    } else {
                        MAIN
                    };
                let n = self.lists.head(from);
                debug_assert_ne!(n, NIL);
                self.lists.unlink(n);
                self.map.remove(&self.keys[n as usize]);
                n
            }
        };
        self.keys[n as usize] = h;
        self.map.insert(h, n);
        self.lists
            .push_back(n, if admit { MAIN } else { PROBATION });
        false
    }
}
