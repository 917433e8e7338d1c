//! TinyLFU-style admission in front of any policy, with an adaptive probation share.
//!
//! Every registration counts as one sighting in the registry's count-min sketch (matches
//! count too, with `touch_on_match`). A block released while its frequency is below
//! [`ADMIT_FREQUENCY`] (seen once: a first sighting) is *not admitted*: it waits in a
//! probation FIFO, so one-off blocks cannot flush blocks that were reused. A probation block
//! that is matched again is acquired, and on its next release (now seen twice) enters the
//! base policy. Probation victims still respect the base's
//! [`can_remove`](super::Eviction::can_remove) (with `lineage`: leaves only).
//!
//! How much room probation keeps adapts, ARC-style: probation is evicted first while it
//! holds more than a target `p` (initially 0: pure admission), else the base is. Hashes
//! evicted from probation and from the base are remembered in two ghost queues of
//! `capacity` entries each. A registration whose hash is a probation ghost means first
//! sightings were evicted too early: `p` grows by `max(1, |Gbase| / |Gprob|)`; a base ghost
//! shrinks it by `max(1, |Gprob| / |Gbase|)`. Small caches thus filter one-off blocks
//! hard, while large ones, whose first sightings live long enough to be reused, keep them.

use super::ghost::Ghost;
use super::list::Lists;
use super::{Eviction, EvictionCtx, SlotStatus};

/// Sightings a block needs, when released, to enter the base policy.
pub const ADMIT_FREQUENCY: u32 = 2;

/// The admission filter over a base policy `B`.
#[derive(Debug)]
pub struct TinyLfu<B> {
    base: B,
    probation: Lists<1>,
    cold: Vec<bool>,
    from_probation: Vec<bool>,
    probation_ghosts: Ghost,
    base_ghosts: Ghost,
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
            cold: vec![false; capacity],
            from_probation: vec![false; capacity],
            probation_ghosts: Ghost::new(capacity),
            base_ghosts: Ghost::new(capacity),
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
        self.from_probation[s as usize] = true;
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
        ctx.registry().touch(h);
        if self.probation_ghosts.contains(&h) {
            let delta = (self.base_ghosts.len() / self.probation_ghosts.len()).max(1);
            self.p = (self.p + delta).min(self.capacity);
            self.probation_ghosts.remove(&h);
        } else if self.base_ghosts.contains(&h) {
            let delta = (self.probation_ghosts.len() / self.base_ghosts.len()).max(1);
            self.p = self.p.saturating_sub(delta);
            self.base_ghosts.remove(&h);
        }
        self.cold[slot as usize] = false;
        self.base.on_register(slot, ctx);
    }

    #[inline]
    fn on_release(&mut self, slot: u32, ctx: &EvictionCtx<'_>) {
        if ctx.registry().frequency(ctx.hash(slot)) < ADMIT_FREQUENCY {
            self.cold[slot as usize] = true;
            self.probation.push_back(slot, 0);
        } else {
            self.base.on_release(slot, ctx);
        }
    }

    #[inline]
    fn on_acquire(&mut self, slot: u32, ctx: &EvictionCtx<'_>) {
        if self.cold[slot as usize] {
            self.cold[slot as usize] = false;
            self.probation.unlink(slot);
        } else {
            self.base.on_acquire(slot, ctx);
        }
    }

    fn on_touch(&mut self, slot: u32, ctx: &EvictionCtx<'_>) {
        if self.cold[slot as usize] {
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
            self.from_probation[s as usize] = false;
            self.base_ghosts.insert(ctx.hash(s));
            return Some(s);
        }
        self.pop_probation(ctx, protected)
    }

    fn remove(&mut self, slot: u32, ctx: &EvictionCtx<'_>) {
        let cold = self.cold[slot as usize];
        if cold {
            self.probation.unlink(slot);
        }
        self.from_probation[slot as usize] = cold;
        self.base.remove(slot, ctx);
    }

    fn restore(&mut self, slot: u32, ctx: &EvictionCtx<'_>) {
        self.base.restore(slot, ctx);
        let h = ctx.hash(slot);
        if self.from_probation[slot as usize] {
            self.probation_ghosts.remove(&h);
            self.probation.push_front(slot, 0);
        } else {
            self.base_ghosts.remove(&h);
        }
    }

    fn check(&self, status: &dyn Fn(u32) -> SlotStatus) -> Result<(), String> {
        self.probation.check()?;
        for s in 0..self.cold.len() as u32 {
            if self.probation.is_listed(s)
                && !(self.cold[s as usize] && status(s) == SlotStatus::Evictable)
            {
                return Err(format!(
                    "tinylfu: slot {s} in probation while {:?}",
                    status(s)
                ));
            }
            if self.cold[s as usize]
                && status(s) == SlotStatus::Evictable
                && !self.probation.is_listed(s)
            {
                return Err(format!("tinylfu: cold slot {s} is not in probation"));
            }
        }
        // the base never saw cold blocks released: to it they are active
        let cold = &self.cold;
        self.base.check(&|s| match status(s) {
            SlotStatus::Evictable if cold[s as usize] => SlotStatus::Active,
            st => st,
        })
    }
}
