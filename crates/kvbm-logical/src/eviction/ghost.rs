//! A bounded FIFO set of evicted hashes ("ghosts"), for ARC's B1/B2 and S3-FIFO's G.
//!
//! A hash map from hash to insertion sequence plus a queue of `(hash, sequence)`; removing a
//! ghost only drops its map entry (its queue entry goes stale and is skipped or compacted).
//! Both are allocated up front for `capacity` entries.

use std::collections::VecDeque;

use hashbrown::HashMap;

use crate::hash::{PassThroughHash, SequenceHash};

#[derive(Clone, Debug)]
pub(crate) struct Ghost {
    map: HashMap<SequenceHash, u64, PassThroughHash>,
    queue: VecDeque<(SequenceHash, u64)>,
    seq: u64,
    capacity: usize,
}

impl Ghost {
    pub(crate) fn new(capacity: usize) -> Self {
        Self {
            map: HashMap::with_capacity_and_hasher(capacity + 1, PassThroughHash),
            queue: VecDeque::with_capacity(2 * capacity + 2),
            seq: 0,
            capacity,
        }
    }

    #[inline]
    pub(crate) fn len(&self) -> usize {
        self.map.len()
    }

    #[inline]
    pub(crate) fn contains(&self, h: &SequenceHash) -> bool {
        self.map.contains_key(h)
    }

    /// Adds `h` as the newest ghost; drops the oldest beyond capacity.
    pub(crate) fn insert(&mut self, h: SequenceHash) {
        if self.capacity == 0 {
            return;
        }
        self.seq += 1;
        self.map.insert(h, self.seq);
        self.queue.push_back((h, self.seq));
        while self.map.len() > self.capacity {
            self.pop_oldest();
        }
        if self.queue.len() > 2 * self.capacity + 1 {
            let map = &self.map;
            self.queue.retain(|(h, s)| map.get(h) == Some(s));
        }
    }

    /// Removes `h`; returns whether it was a ghost.
    #[inline]
    pub(crate) fn remove(&mut self, h: &SequenceHash) -> bool {
        self.map.remove(h).is_some()
    }

    /// Drops the oldest live ghost.
    pub(crate) fn pop_oldest(&mut self) -> Option<SequenceHash> {
        while let Some((h, s)) = self.queue.pop_front() {
            if self.map.get(&h) == Some(&s) {
                self.map.remove(&h);
                return Some(h);
            }
        }
        None
    }
}

/// A direct-mapped set of ghost fingerprints: one `u64` per entry, `2 × capacity` entries
/// (at least 1024, rounded up to a power of two), indexed by the hash. Inserting over another ghost replaces
/// it (random rather than FIFO ageing). Every operation is one load or store, with no hashing
/// and no allocation: the cheap ghost list of the default policy's admission filter.
#[derive(Clone, Debug)]
pub(crate) struct GhostFilter {
    table: Box<[u64]>,
    mask: usize,
    len: usize,
}

impl GhostFilter {
    pub(crate) fn new(capacity: usize) -> Self {
        let n = (2 * capacity).max(1024).next_power_of_two();
        Self {
            table: vec![0; n].into_boxed_slice(),
            mask: n - 1,
            len: 0,
        }
    }

    #[inline]
    fn slot(&self, h: &SequenceHash) -> (usize, u64) {
        let c = h.current() ^ (h.as_u128() as u64);
        ((c >> 7) as usize & self.mask, c | 1)
    }

    /// Live ghosts (approximately: replaced ghosts are not counted twice).
    #[inline]
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    #[inline]
    pub(crate) fn insert(&mut self, h: SequenceHash) {
        let (i, fp) = self.slot(&h);
        if self.table[i] == 0 {
            self.len += 1;
        }
        self.table[i] = fp;
    }

    /// Removes `h`; returns whether it was a ghost.
    #[inline]
    pub(crate) fn remove(&mut self, h: &SequenceHash) -> bool {
        let (i, fp) = self.slot(h);
        if self.table[i] == fp {
            self.table[i] = 0;
            self.len -= 1;
            true
        } else {
            false
        }
    }
}
