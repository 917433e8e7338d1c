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
