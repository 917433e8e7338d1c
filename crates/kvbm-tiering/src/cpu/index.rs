//! [`SlotIndex`]: the primary's `OffloadKey → slot` index, holding slot ids only.
//!
//! # Why not a `HashMap<OffloadKey, u32>`
//!
//! The slot table already keeps every resident key in `keys[slot]` (40 bytes each). A map
//! that kept a second copy beside each slot id had 48-byte buckets: about 1.5 MB for a
//! 16384-chunk primary at its load factor, more than this machine's 1 MB L2, so nearly every
//! probe of a scheduler step (a `lookup` per chunk, an eviction and an insertion per
//! promotion) missed the cache on the bucket. Here the table holds the 4-byte slot id and
//! compares against `keys[slot]`:
//!
//! ```text
//!   hash(key) ─► ctrl bytes (1 B/bucket) ─► slot id (4 B/bucket) ─► keys[slot] == key ?
//!                └────────── ~160 KB for 16384 chunks ─────────┘   └─ the slot table ─┘
//! ```
//!
//! An absent key (a cold step's lookups, a promotion's insertion) reads only the first two;
//! removing a victim whose `keys[slot]` the policy just read touches no other line.
//!
//! # Invariant
//!
//! For every slot `s` in the index, `keys[s]` is the key it was inserted under, so the caller
//! passes the same `keys` to every call and writes `keys[s]` before [`SlotIndex::insert`]
//! (a removed slot's `keys[s]` may go stale: it is no longer in the index). A key is inserted
//! only while absent ([`SlotIndex::insert`] checks it in debug builds).

use hashbrown::HashTable;

use crate::key::{KeyHasher, OffloadKey};

/// `OffloadKey → slot` over the slot table's `keys`: see the [module docs](self).
#[derive(Default)]
pub(crate) struct SlotIndex {
    table: HashTable<u32>,
    hasher: KeyHasher,
}

impl SlotIndex {
    /// An index with room for `n` keys (a primary never holds more than its chunk count).
    pub(crate) fn with_capacity(n: usize) -> Self {
        Self {
            table: HashTable::with_capacity(n),
            hasher: KeyHasher::default(),
        }
    }

    #[inline]
    fn hash(&self, k: &OffloadKey) -> u64 {
        self.hasher.hash(k)
    }

    /// The slot of `k`.
    #[inline]
    pub(crate) fn get(&self, keys: &[OffloadKey], k: &OffloadKey) -> Option<u32> {
        self.table
            .find(self.hash(k), |&s| keys[s as usize] == *k)
            .copied()
    }

    /// Whether `k` is resident.
    #[inline]
    pub(crate) fn contains(&self, keys: &[OffloadKey], k: &OffloadKey) -> bool {
        self.get(keys, k).is_some()
    }

    /// Adds `k` at slot `s`; `keys[s]` must already be `k`, and `k` absent.
    #[inline]
    pub(crate) fn insert(&mut self, keys: &[OffloadKey], k: &OffloadKey, s: u32) {
        debug_assert!(keys[s as usize] == *k, "keys[{s}] is written before insert");
        debug_assert!(
            self.get(keys, k).is_none(),
            "a key is inserted only while absent"
        );
        let hasher = &self.hasher;
        self.table
            .insert_unique(self.hasher.hash(k), s, |&t| hasher.hash(&keys[t as usize]));
    }

    /// Removes `k`; its slot, if it was resident.
    #[inline]
    pub(crate) fn remove(&mut self, keys: &[OffloadKey], k: &OffloadKey) -> Option<u32> {
        match self
            .table
            .find_entry(self.hash(k), |&s| keys[s as usize] == *k)
        {
            Ok(e) => Some(e.remove().0),
            Err(_) => None,
        }
    }

    /// Removes slot `s`, whose key `keys[s]` is resident there (an eviction's victim: its slot
    /// is known, so the probe compares slot ids, not keys).
    #[inline]
    pub(crate) fn remove_slot(&mut self, keys: &[OffloadKey], s: u32) {
        let k = &keys[s as usize];
        match self.table.find_entry(self.hash(k), |&t| t == s) {
            Ok(e) => {
                e.remove();
            }
            Err(_) => debug_assert!(false, "slot {s} is resident"),
        }
    }

    /// Number of resident keys.
    pub(crate) fn len(&self) -> usize {
        self.table.len()
    }

    /// Whether nothing is resident.
    pub(crate) fn is_empty(&self) -> bool {
        self.table.is_empty()
    }

    /// Forgets every key (the capacity stays).
    pub(crate) fn clear(&mut self) {
        self.table.clear();
    }

    /// Every resident slot, in no particular order.
    pub(crate) fn slots(&self) -> impl Iterator<Item = u32> + '_ {
        self.table.iter().copied()
    }
}

#[cfg(test)]
mod tests;
