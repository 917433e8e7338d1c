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

use super::ghost::GhostFilter;
use super::list::Lists;
use super::{Eviction, EvictionCtx, SlotStatus};

/// Sightings a block needs, when released, to enter the base policy.
pub const ADMIT_FREQUENCY: u32 = 2;

/// Not admitted (yet): goes to probation on release.
const COLD: u8 = 1;
/// Released into probation (and not revived or evicted since).
const WAITING: u8 = 2;
/// Last taken from probation (by `pop_victim` or `remove`): `restore` puts it back there.
const FROM_PROBATION: u8 = 4;

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
        self.flags[slot as usize] = if registry.frequency(h) < ADMIT_FREQUENCY {
            COLD
        } else {
            0
        };
        self.base.on_register(slot, ctx);
    }

    #[inline]
    fn on_hit(&mut self, slot: u32, ctx: &EvictionCtx<'_>) {
        self.flags[slot as usize] &= !COLD;
        self.base.on_hit(slot, ctx);
    }

    #[inline]
    fn on_release(&mut self, slot: u32, ctx: &EvictionCtx<'_>) {
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
