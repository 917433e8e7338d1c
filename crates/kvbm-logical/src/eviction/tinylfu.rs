//! TinyLFU-style admission in front of any policy, with an adaptive probation share.
//!
//! Every registration counts as one sighting in the registry's count-min sketch (matches
//! count too, with `touch_on_match`). A block whose frequency, read at its registration, is
//! below [`ADMIT_FREQUENCY`] (a first sighting) and that is not matched again before its
//! release is *not admitted*: it waits in a probation FIFO, so one-off blocks cannot flush
//! blocks that were reused. Any later hit (a match reviving it, or a match while it is
//! active) admits it: on its next release it enters the base policy. (Reading the sketch at
//! registration, where its word is already in cache, rather than at release keeps the release
//! path free of a random memory access.) Probation victims still respect the base's
//! [`can_remove`](super::Eviction::can_remove) (with `lineage`: leaves only).
//!
//! How much room probation keeps adapts, ARC-style: probation is evicted first while it
//! holds more than a target `p` (initially 0: pure admission), else the base is. Hashes
//! evicted from probation and from the base are remembered in two direct-mapped ghost
//! filters of about `2 × capacity` fingerprints each (one load or store per operation). A registration whose hash is a probation ghost means first
//! sightings were evicted too early: `p` grows by `max(1, |Gbase| / |Gprob|)`; a base ghost
//! shrinks it by `max(1, |Gprob| / |Gbase|)`. Small caches thus filter one-off blocks
//! hard, while large ones, whose first sightings live long enough to be reused, keep them.
//!
//! # `adaptive-<base>`: the LRU duel (the default, `adaptive-lru`)
//!
//! The ghosts do not recover everything once the cache holds most of the reuse (at 32,768
//! blocks on the Mooncake conversation trace `tinylfu-lru` kept 31.7% against LRU's 33.5%).
//! [`TinyLfu::adaptive`] adds a duel: two shadow caches of `capacity / 16` hashes (module
//! `shadow`) see the accesses of one hash in 16, one as plain LRU, one as this filter (with
//! the current `p / 16`). Their hits are counted with decay (halved every 16 shadow
//! capacities of sampled accesses). While the LRU shadow leads by more than 1/64 of the
//! recent hits, victims are taken in release order: the older (by release time) of the
//! probation head and the base's victim, which is exactly LRU's order over an LRU base;
//! otherwise the filter's order above. The duel starts on LRU, so the filter must first
//! prove itself.
//!
//! ```text
//!   register / hit of a sampled hash ──▶ LRU shadow, filter shadow (hits counted, decayed)
//!   pop_victim ──▶ LRU shadow ahead?  yes: older of (probation head, base victim)
//!                                     no:  probation if > p, else base (the filter)
//! ```
//!
//! Cost: a release stamp per release, and for 1 access in 16 two shadow lookups.

use super::ghost::GhostFilter;
use super::list::Lists;
use super::shadow::{SAMPLE, Shadow, sampled};
use super::{Eviction, EvictionCtx, SlotStatus};
use crate::hash::SequenceHash;

/// Sightings a block needs, when released, to enter the base policy.
pub const ADMIT_FREQUENCY: u32 = 2;

/// Not admitted (yet): goes to probation on release.
const COLD: u8 = 1;
/// Released into probation (and not revived or evicted since).
const WAITING: u8 = 2;
/// Last taken from probation (by `pop_victim` or `remove`): `restore` puts it back there.
const FROM_PROBATION: u8 = 4;

/// The LRU duel of `adaptive-<base>`: two sampled shadows and which one is winning.
#[derive(Debug)]
struct Duel {
    lru: Shadow,
    filter: Shadow,
    /// Shadow hits, halved every `window` sampled accesses.
    lru_hits: u32,
    filter_hits: u32,
    accesses: u32,
    window: u32,
    /// Follow LRU's order (oldest release first across probation and the base). Starts
    /// true: the filter has to prove itself.
    lru_mode: bool,
    /// Tests: the mode is fixed.
    pinned: bool,
}

impl Duel {
    fn new(capacity: usize) -> Self {
        let shadow = (capacity / SAMPLE as usize).max(8);
        Self {
            lru: Shadow::new(shadow),
            filter: Shadow::new(shadow),
            lru_hits: 0,
            filter_hits: 0,
            accesses: 0,
            window: (WINDOW * shadow) as u32,
            lru_mode: true,
            pinned: false,
        }
    }

    fn access(&mut self, h: SequenceHash, admit: bool, p: usize) {
        self.lru_hits += u32::from(self.lru.access(h, true, 0));
        self.filter_hits += u32::from(self.filter.access(h, admit, p / SAMPLE as usize));
        self.accesses += 1;
        if self.accesses >= self.window {
            self.accesses = 0;
            self.lru_hits /= 2;
            self.filter_hits /= 2;
        }
        if self.pinned {
            return;
        }
        let margin = (self.lru_hits + self.filter_hits) / MARGIN + 2;
        self.lru_mode = if self.lru_mode {
            self.filter_hits <= self.lru_hits + margin
        } else {
            self.lru_hits > self.filter_hits + margin
        };
    }
}

/// Decay window of the duel, in shadow capacities of sampled accesses (both hit counts are
/// halved after each). 4, 16 and 64 measured alike on the Mooncake traces; 16 is the middle.
const WINDOW: usize = 16;
/// Hysteresis of the duel: a switch needs a lead of `1/MARGIN` of the recent hits (plus 2).
/// 32 flapped (below the old filter at 8,192–16,384 blocks), 128 was slightly worse at 8,192.
const MARGIN: u32 = 64;

/// The admission filter over a base policy `B`.
#[derive(Debug)]
pub struct TinyLfu<B> {
    base: B,
    probation: Lists<1>,
    /// Per slot: [`COLD`], [`WAITING`], [`FROM_PROBATION`] (one byte, one cache line for
    /// all three).
    flags: Vec<u8>,
    probation_ghosts: GhostFilter,
    base_ghosts: GhostFilter,
    /// Target size of probation: above it, probation is evicted first.
    p: usize,
    capacity: usize,
    /// `adaptive-`: the LRU duel, and each slot's release time (for the age comparison).
    duel: Option<Box<Duel>>,
    /// The duel's current mode, mirrored here (read by every `pop_victim`).
    lru_mode: bool,
    released_at: Vec<u64>,
    clock: u64,
}

impl<B: Eviction> TinyLfu<B> {
    /// Wraps `base` (for slots `0..capacity`).
    pub fn new(base: B, capacity: usize) -> Self {
        Self {
            base,
            probation: Lists::new(capacity),
            flags: vec![0; capacity],
            probation_ghosts: GhostFilter::new(capacity),
            base_ghosts: GhostFilter::new(capacity),
            p: 0,
            capacity,
            duel: None,
            lru_mode: false,
            released_at: Vec::new(),
            clock: 0,
        }
    }

    /// Wraps `base` behind the filter and the LRU duel (`adaptive-<base>`): two sampled
    /// shadow caches (see `shadow.rs`) estimate the hit ratios of LRU and of the filter;
    /// while LRU's is ahead, victims are taken in release order across probation and the
    /// base (the older of the probation head and the base's victim), which is LRU's order
    /// when the base is LRU.
    pub fn adaptive(base: B, capacity: usize) -> Self {
        Self {
            duel: Some(Box::new(Duel::new(capacity))),
            lru_mode: true,
            released_at: vec![0; capacity],
            ..Self::new(base, capacity)
        }
    }

    /// Fixes the duel's mode (tests): `true` takes victims in release order, `false` is the
    /// plain filter. No effect without the duel.
    #[cfg(test)]
    pub(crate) fn pin_lru_mode(&mut self, lru: bool) {
        if let Some(d) = &mut self.duel {
            d.lru_mode = lru;
            d.pinned = true;
            self.lru_mode = lru;
        }
    }

    /// Whether the LRU duel currently has victims taken in release order (`adaptive-` only).
    #[inline]
    pub fn follows_lru(&self) -> bool {
        self.lru_mode
    }

    #[inline]
    fn duel_access(&mut self, h: SequenceHash, admit: bool) {
        if let Some(d) = &mut self.duel
            && sampled(&h)
        {
            d.access(h, admit, self.p);
            self.lru_mode = d.lru_mode;
        }
    }

    /// The adaptive probation target.
    pub fn probation_target(&self) -> usize {
        self.p
    }

    fn pop_probation(
        &mut self,
        ctx: &EvictionCtx<'_>,
        protected: &impl Fn(u32) -> bool,
    ) -> Option<u32> {
        let base = &self.base;
        let s = self
            .probation
            .first_unskipped(0, &|s| protected(s) || !base.can_remove(s))?;
        self.probation.unlink(s);
        let f = &mut self.flags[s as usize];
        *f = (*f & !WAITING) | FROM_PROBATION;
        self.base.remove(s, ctx);
        self.probation_ghosts.insert(ctx.hash(s));
        Some(s)
    }

    /// LRU's choice: the older (by release) of the probation head and the base's victim.
    fn pop_oldest(
        &mut self,
        ctx: &EvictionCtx<'_>,
        protected: &impl Fn(u32) -> bool,
    ) -> Option<u32> {
        let base = &self.base;
        let candidate = self
            .probation
            .first_unskipped(0, &|s| protected(s) || !base.can_remove(s));
        if let Some(b) = self.base.pop_victim(ctx, protected) {
            match candidate {
                Some(c) if self.released_at[c as usize] < self.released_at[b as usize] => {
                    self.base.restore(b, ctx);
                }
                _ => {
                    self.flags[b as usize] &= !FROM_PROBATION;
                    self.base_ghosts.insert(ctx.hash(b));
                    return Some(b);
                }
            }
        }
        self.pop_probation(ctx, protected)
    }

    /// The base policy.
    pub fn base(&self) -> &B {
        &self.base
    }

    /// Blocks waiting in probation (evictable, not admitted).
    pub fn probation_len(&self) -> usize {
        self.probation.len(0)
    }
}

impl<B: Eviction> Eviction for TinyLfu<B> {
    fn on_register(&mut self, slot: u32, ctx: &EvictionCtx<'_>) {
        let h = ctx.hash(slot);
        let registry = ctx.registry();
        registry.touch(h);
        if self.probation_ghosts.remove(&h) {
            let delta = (self.base_ghosts.len() / (self.probation_ghosts.len() + 1)).max(1);
            self.p = (self.p + delta).min(self.capacity);
        } else if self.base_ghosts.remove(&h) {
            let delta = (self.probation_ghosts.len() / (self.base_ghosts.len() + 1)).max(1);
            self.p = self.p.saturating_sub(delta);
        }
        // decided now (the sketch word is hot); a hit before the release admits it
        let admit = registry.frequency(h) >= ADMIT_FREQUENCY;
        self.flags[slot as usize] = if admit { 0 } else { COLD };
        self.duel_access(h, admit);
        self.base.on_register(slot, ctx);
    }

    #[inline]
    fn on_hit(&mut self, slot: u32, ctx: &EvictionCtx<'_>) {
        self.flags[slot as usize] &= !COLD;
        self.duel_access(ctx.hash(slot), true);
        self.base.on_hit(slot, ctx);
    }

    #[inline]
    fn on_release(&mut self, slot: u32, ctx: &EvictionCtx<'_>) {
        if self.duel.is_some() {
            self.clock += 1;
            self.released_at[slot as usize] = self.clock;
        }
        let f = &mut self.flags[slot as usize];
        if *f & COLD != 0 {
            *f |= WAITING;
            self.probation.push_back(slot, 0);
        } else {
            self.base.on_release(slot, ctx);
        }
    }

    #[inline]
    fn on_acquire(&mut self, slot: u32, ctx: &EvictionCtx<'_>) {
        // a revival is a hit: admitted on its next release
        self.duel_access(ctx.hash(slot), true);
        let f = &mut self.flags[slot as usize];
        let waiting = *f & WAITING != 0;
        *f &= !(COLD | WAITING);
        if waiting {
            self.probation.unlink(slot);
        } else {
            self.base.on_acquire(slot, ctx);
        }
    }

    fn on_touch(&mut self, slot: u32, ctx: &EvictionCtx<'_>) {
        // a touch moves an evictable slot to the recent end of its list: its age restarts
        // (an active slot's stamp is set again on release)
        if self.duel.is_some() {
            self.clock += 1;
            self.released_at[slot as usize] = self.clock;
        }
        if self.flags[slot as usize] & WAITING != 0 {
            if self.probation.unlink(slot).is_some() {
                self.probation.push_back(slot, 0);
            }
        } else {
            self.base.on_touch(slot, ctx);
        }
    }

    fn on_hint(&mut self, slot: u32, next_use: u64, ctx: &EvictionCtx<'_>) {
        self.base.on_hint(slot, next_use, ctx);
    }

    fn can_remove(&self, slot: u32) -> bool {
        self.base.can_remove(slot)
    }

    #[inline]
    fn pop_victim(
        &mut self,
        ctx: &EvictionCtx<'_>,
        protected: &impl Fn(u32) -> bool,
    ) -> Option<u32> {
        if self.follows_lru() {
            return self.pop_oldest(ctx, protected);
        }
        if self.probation.len(0) > self.p
            && let Some(s) = self.pop_probation(ctx, protected)
        {
            return Some(s);
        }
        if let Some(s) = self.base.pop_victim(ctx, protected) {
            self.flags[s as usize] &= !FROM_PROBATION;
            self.base_ghosts.insert(ctx.hash(s));
            return Some(s);
        }
        self.pop_probation(ctx, protected)
    }

    fn remove(&mut self, slot: u32, ctx: &EvictionCtx<'_>) {
        let f = &mut self.flags[slot as usize];
        let waiting = *f & WAITING != 0;
        *f &= !(WAITING | FROM_PROBATION);
        if waiting {
            *f |= FROM_PROBATION;
            self.probation.unlink(slot);
        }
        self.base.remove(slot, ctx);
    }

    fn restore(&mut self, slot: u32, ctx: &EvictionCtx<'_>) {
        self.base.restore(slot, ctx);
        let h = ctx.hash(slot);
        if self.flags[slot as usize] & FROM_PROBATION != 0 {
            self.probation_ghosts.remove(&h);
            self.flags[slot as usize] |= WAITING;
            self.probation.push_front(slot, 0);
        } else {
            self.base_ghosts.remove(&h);
        }
    }

    fn check(&self, status: &dyn Fn(u32) -> SlotStatus) -> Result<(), String> {
        self.probation.check()?;
        for s in 0..self.flags.len() as u32 {
            if self.probation.is_listed(s)
                && !((self.flags[s as usize] & WAITING != 0) && status(s) == SlotStatus::Evictable)
            {
                return Err(format!(
                    "tinylfu: slot {s} in probation while {:?}",
                    status(s)
                ));
            }
            if (self.flags[s as usize] & WAITING != 0)
                && status(s) == SlotStatus::Evictable
                && !self.probation.is_listed(s)
            {
                return Err(format!("tinylfu: waiting slot {s} is not in probation"));
            }
        }
        // the base never saw probation blocks released: to it they are active
        let flags = &self.flags;
        self.base.check(&|s| match status(s) {
            SlotStatus::Evictable if flags[s as usize] & WAITING != 0 => SlotStatus::Active,
            st => st,
        })
    }
}
