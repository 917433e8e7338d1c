//! The block registry, shared by every tier's [`BlockManager`](crate::BlockManager).
//!
//! It holds **one entry per sequence hash** with a presence bit per tier (set while the hash is
//! registered, active or inactive, in that tier's manager; cleared on eviction), and a
//! **frequency sketch**: a decaying count-min sketch (TinyLFU-style) of 4-bit counters.
//!
//! # Frequency sketch
//!
//! Counters live 16 to a 64-bit word; a hash selects one word and four counters in it (one per
//! 4-counter group), so a touch is a single compare-and-swap. [`BlockRegistry::frequency`] is
//! the minimum of the four (an over-estimate, never an under-estimate, until decay), saturating
//! at 15. Updates are *conservative*: only counters equal to the minimum are incremented. After
//! `decay_factor × counters` touches every counter is halved, so old popularity fades. Touches
//! racing with a decay may be lost; the sketch is an estimate by design.
//!
//! # Locking
//!
//! Presence is sharded (16 `parking_lot` mutexes by hash). A registry lock is always the **last**
//! lock taken: managers call into the registry while holding their store lock, and the
//! registry never calls back out.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use hashbrown::HashMap;
use parking_lot::Mutex;
use serde::{Deserialize, Serialize};

use crate::hash::{PassThroughHash, SequenceHash};
use crate::tier::TierId;

const SHARDS: usize = 16;
const NIBBLE_HALF_MASK: u64 = 0x7777_7777_7777_7777;

/// Registry settings (serde, with defaults).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RegistryConfig {
    /// log2 of the number of 4-bit sketch counters. Default: 21 (2 Mi counters, 1 MiB).
    /// Clamped to `4..=30`.
    pub frequency_counters_log2: u32,
    /// Counters are halved after `decay_factor × counters` touches. Default: 10. `0` disables
    /// decay.
    pub decay_factor: u32,
}

impl Default for RegistryConfig {
    fn default() -> Self {
        Self {
            frequency_counters_log2: 21,
            decay_factor: 10,
        }
    }
}

/// Presence per tier and access frequency per sequence hash. `Clone` shares the same registry.
#[derive(Clone)]
pub struct BlockRegistry {
    inner: Arc<Inner>,
}

struct Inner {
    presence: Box<[Mutex<HashMap<SequenceHash, u8, PassThroughHash>>]>,
    sketch: Sketch,
}

impl Default for BlockRegistry {
    fn default() -> Self {
        Self::new()
    }
}

impl std::fmt::Debug for BlockRegistry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BlockRegistry")
            .field("entries", &self.len())
            .finish_non_exhaustive()
    }
}

impl BlockRegistry {
    /// A registry with the default [`RegistryConfig`].
    pub fn new() -> Self {
        Self::with_config(&RegistryConfig::default())
    }

    /// A registry with the given settings.
    pub fn with_config(config: &RegistryConfig) -> Self {
        let presence = (0..SHARDS)
            .map(|_| Mutex::new(HashMap::with_hasher(PassThroughHash)))
            .collect();
        Self {
            inner: Arc::new(Inner {
                presence,
                sketch: Sketch::new(config.frequency_counters_log2, config.decay_factor),
            }),
        }
    }

    #[inline]
    fn shard(&self, hash: SequenceHash) -> &Mutex<HashMap<SequenceHash, u8, PassThroughHash>> {
        &self.inner.presence[((hash.current() >> 32) as usize) & (SHARDS - 1)]
    }

    /// Whether `hash` is registered (active or inactive) in `tier`.
    pub fn is_present(&self, hash: SequenceHash, tier: TierId) -> bool {
        self.tiers_mask(hash) & tier.bit() != 0
    }

    /// The tiers holding `hash`, top to bottom.
    pub fn tiers(&self, hash: SequenceHash) -> Vec<TierId> {
        let mask = self.tiers_mask(hash);
        TierId::ALL
            .into_iter()
            .filter(|t| mask & t.bit() != 0)
            .collect()
    }

    fn tiers_mask(&self, hash: SequenceHash) -> u8 {
        self.shard(hash).lock().get(&hash).copied().unwrap_or(0)
    }

    /// Number of hashes present in at least one tier.
    pub fn len(&self) -> usize {
        self.inner.presence.iter().map(|s| s.lock().len()).sum()
    }

    /// Whether no hash is present in any tier.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The decaying estimate of how often `hash` was touched (0..=15).
    pub fn frequency(&self, hash: SequenceHash) -> u32 {
        self.inner.sketch.estimate(hash.current())
    }

    /// Records one access of `hash`.
    pub fn touch(&self, hash: SequenceHash) {
        self.inner.sketch.increment(hash.current());
        self.inner.sketch.count_additions(1);
    }

    /// Records one access of each hash.
    pub fn touch_all(&self, hashes: &[SequenceHash]) {
        for h in hashes {
            self.inner.sketch.increment(h.current());
        }
        self.inner.sketch.count_additions(hashes.len() as u64);
    }

    pub(crate) fn set_present(&self, hash: SequenceHash, tier: TierId) {
        *self.shard(hash).lock().entry(hash).or_insert(0) |= tier.bit();
    }

    pub(crate) fn clear_present(&self, hash: SequenceHash, tier: TierId) {
        let mut shard = self.shard(hash).lock();
        if let Some(mask) = shard.get_mut(&hash) {
            *mask &= !tier.bit();
            if *mask == 0 {
                shard.remove(&hash);
            }
        }
    }
}

/// The count-min sketch (see the module docs).
struct Sketch {
    words: Box<[AtomicU64]>,
    mask: usize,
    additions: AtomicU64,
    period: u64,
}

impl Sketch {
    fn new(counters_log2: u32, decay_factor: u32) -> Self {
        let counters_log2 = counters_log2.clamp(4, 30);
        let words = 1usize << (counters_log2 - 4);
        Self {
            words: (0..words).map(|_| AtomicU64::new(0)).collect(),
            mask: words - 1,
            additions: AtomicU64::new(0),
            period: if decay_factor == 0 {
                u64::MAX
            } else {
                (decay_factor as u64) << counters_log2
            },
        }
    }

    /// Word index and the four nibble shifts for `h`.
    #[inline]
    fn locate(&self, h: u64) -> (usize, [u32; 4]) {
        let idx = (h as usize) & self.mask;
        let sel = h >> 48;
        let mut shifts = [0u32; 4];
        for (i, s) in shifts.iter_mut().enumerate() {
            let counter = (i as u64) * 4 + ((sel >> (2 * i)) & 3);
            *s = (counter * 4) as u32;
        }
        (idx, shifts)
    }

    #[inline]
    fn min_of(word: u64, shifts: &[u32; 4]) -> u64 {
        shifts.iter().map(|&s| (word >> s) & 15).min().unwrap_or(0)
    }

    fn estimate(&self, h: u64) -> u32 {
        let (idx, shifts) = self.locate(h);
        Self::min_of(self.words[idx].load(Ordering::Relaxed), &shifts) as u32
    }

    #[inline]
    fn increment(&self, h: u64) {
        let (idx, shifts) = self.locate(h);
        let word = &self.words[idx];
        let _ = word.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |w| {
            let min = Self::min_of(w, &shifts);
            if min >= 15 {
                return None;
            }
            let mut next = w;
            for &s in &shifts {
                if (w >> s) & 15 == min {
                    next += 1 << s;
                }
            }
            Some(next)
        });
    }

    #[inline]
    fn count_additions(&self, n: u64) {
        if self.period == u64::MAX || n == 0 {
            return;
        }
        let before = self.additions.fetch_add(n, Ordering::Relaxed);
        if before / self.period != (before + n) / self.period {
            self.decay();
        }
    }

    fn decay(&self) {
        for w in self.words.iter() {
            let _ = w.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |v| {
                Some((v >> 1) & NIBBLE_HALF_MASK)
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::hash::{Salt, SequenceHash};

    fn h(i: u32) -> SequenceHash {
        SequenceHash::root(Salt::NONE, &[i, i + 1, i + 2, i + 3])
    }

    #[test]
    fn presence_is_per_tier_and_one_entry_per_hash() {
        let r = BlockRegistry::new();
        let a = h(1);
        assert!(!r.is_present(a, TierId::G1));
        r.set_present(a, TierId::G1);
        r.set_present(a, TierId::G3);
        assert!(r.is_present(a, TierId::G1));
        assert!(!r.is_present(a, TierId::G2));
        assert!(r.is_present(a, TierId::G3));
        assert_eq!(r.tiers(a), vec![TierId::G1, TierId::G3]);
        assert_eq!(r.len(), 1);
        r.clear_present(a, TierId::G1);
        assert!(!r.is_present(a, TierId::G1));
        assert_eq!(r.len(), 1);
        r.clear_present(a, TierId::G3);
        assert!(r.is_empty());
        // a clone shares state
        let r2 = r.clone();
        r2.set_present(a, TierId::G4);
        assert!(r.is_present(a, TierId::G4));
    }

    #[test]
    fn frequency_counts_touches_and_saturates() {
        let r = BlockRegistry::new();
        let a = h(10);
        let b = h(20);
        assert_eq!(r.frequency(a), 0);
        for _ in 0..5 {
            r.touch(a);
        }
        r.touch(b);
        assert_eq!(r.frequency(a), 5);
        assert_eq!(r.frequency(b), 1);
        for _ in 0..100 {
            r.touch(a);
        }
        assert_eq!(r.frequency(a), 15);
    }

    #[test]
    fn frequency_decays() {
        // 16 counters, decay after 2 × 16 = 32 touches.
        let r = BlockRegistry::with_config(&RegistryConfig {
            frequency_counters_log2: 4,
            decay_factor: 2,
        });
        let a = h(1);
        for _ in 0..8 {
            r.touch(a);
        }
        assert_eq!(r.frequency(a), 8);
        // 24 more touches of a (saturating at 15) cross the period: halved once.
        for _ in 0..24 {
            r.touch(a);
        }
        let f = r.frequency(a);
        assert!((7..=8).contains(&f), "expected a halved count, got {f}");
    }

    #[test]
    fn sketch_estimates_never_undercount_without_decay() {
        let r = BlockRegistry::with_config(&RegistryConfig {
            frequency_counters_log2: 8,
            decay_factor: 0,
        });
        let hashes: Vec<_> = (0..200).map(h).collect();
        for (i, x) in hashes.iter().enumerate() {
            for _ in 0..(i % 7) {
                r.touch(*x);
            }
        }
        for (i, x) in hashes.iter().enumerate() {
            assert!(r.frequency(*x) >= (i % 7) as u32);
        }
    }
}
