//! ARC (Megiddo & Modha, FAST 2003): adaptive replacement between recency and frequency.
//!
//! Registered slots belong to T1 (seen once since they entered) or T2 (hit at least once).
//! Evicted hashes are remembered in ghost lists B1 (from T1) and B2 (from T2). A registration
//! whose hash is a B1 ghost means T1 was too small: the target size `p` of T1 grows by
//! `max(1, |B2| / |B1|)`; a B2 ghost shrinks it by `max(1, |B1| / |B2|)`; either way the block
//! enters T2. A victim comes from T1 when `|T1| > p` (or T2 has no evictable slot), else from
//! T2, least recently released first within the list.
//!
//! Differences from the paper, forced by pinned blocks: `|T1|` and `|T2|` count registered
//! slots, active or not, but only evictable slots are listed and chosen; ghost lists are
//! trimmed so that `|T1| + |B1| <= c` and `|T1| + |T2| + |B1| + |B2| <= 2c` after each change.
//! A recency touch moves a block to the most recent end of its own list (it does not promote
//! T1 to T2).

use super::ghost::Ghost;
use super::list::Lists;
use super::{Eviction, EvictionCtx, SlotStatus, check_listed_evictable};

const T1: usize = 0;
const T2: usize = 1;

/// Adaptive replacement cache.
#[derive(Clone, Debug)]
pub struct ArcPolicy {
    lists: Lists<2>,
    class: Vec<u8>,
    /// Listed (evictable) when last removed: restore lists it again.
    was_listed: Vec<bool>,
    sizes: [usize; 2],
    b1: Ghost,
    b2: Ghost,
    p: usize,
    capacity: usize,
}

impl ArcPolicy {
    /// An empty ARC for slots `0..capacity`.
    pub fn new(capacity: usize) -> Self {
        Self {
            lists: Lists::new(capacity),
            class: vec![T1 as u8; capacity],
            was_listed: vec![false; capacity],
            sizes: [0; 2],
            b1: Ghost::new(capacity),
            b2: Ghost::new(2 * capacity),
            p: 0,
            capacity,
        }
    }

    /// The adaptive target size of T1.
    pub fn target_t1(&self) -> usize {
        self.p
    }

    /// Registered slots in T1 and T2.
    pub fn sizes(&self) -> (usize, usize) {
        (self.sizes[T1], self.sizes[T2])
    }

    /// Ghost hashes in B1 and B2.
    pub fn ghost_sizes(&self) -> (usize, usize) {
        (self.b1.len(), self.b2.len())
    }

    fn trim(&mut self) {
        let c = self.capacity;
        while self.sizes[T1] + self.b1.len() > c && self.b1.pop_oldest().is_some() {}
        while self.sizes[T1] + self.sizes[T2] + self.b1.len() + self.b2.len() > 2 * c
            && self.b2.pop_oldest().is_some()
        {}
    }

    fn take(&mut self, s: u32, ctx: &EvictionCtx<'_>) {
        self.was_listed[s as usize] = self.lists.unlink(s).is_some();
        let class = self.class[s as usize] as usize;
        self.sizes[class] -= 1;
        let h = ctx.hash(s);
        if class == T1 {
            self.b1.insert(h);
        } else {
            self.b2.insert(h);
        }
        self.trim();
    }
}

impl Eviction for ArcPolicy {
    fn on_register(&mut self, slot: u32, ctx: &EvictionCtx<'_>) {
        let h = ctx.hash(slot);
        let class = if self.b1.contains(&h) {
            let delta = (self.b2.len() / self.b1.len()).max(1);
            self.p = (self.p + delta).min(self.capacity);
            self.b1.remove(&h);
            T2
        } else if self.b2.contains(&h) {
            let delta = (self.b1.len() / self.b2.len()).max(1);
            self.p = self.p.saturating_sub(delta);
            self.b2.remove(&h);
            T2
        } else {
            T1
        };
        self.class[slot as usize] = class as u8;
        self.sizes[class] += 1;
        self.trim();
    }

    #[inline]
    fn on_release(&mut self, slot: u32, _ctx: &EvictionCtx<'_>) {
        self.lists
            .push_back(slot, self.class[slot as usize] as usize);
    }

    #[inline]
    fn on_acquire(&mut self, slot: u32, _ctx: &EvictionCtx<'_>) {
        self.lists.unlink(slot);
        if self.class[slot as usize] as usize == T1 {
            self.class[slot as usize] = T2 as u8;
            self.sizes[T1] -= 1;
            self.sizes[T2] += 1;
        }
    }

    fn on_touch(&mut self, slot: u32, _ctx: &EvictionCtx<'_>) {
        if let Some(l) = self.lists.unlink(slot) {
            self.lists.push_back(slot, l);
        }
    }

    fn pop_victim(
        &mut self,
        ctx: &EvictionCtx<'_>,
        protected: &impl Fn(u32) -> bool,
    ) -> Option<u32> {
        let first = if self.sizes[T1] > 0 && self.sizes[T1] > self.p {
            T1
        } else {
            T2
        };
        let s = self
            .lists
            .first_unskipped(first, protected)
            .or_else(|| self.lists.first_unskipped(1 - first, protected))?;
        self.take(s, ctx);
        Some(s)
    }

    fn remove(&mut self, slot: u32, ctx: &EvictionCtx<'_>) {
        self.take(slot, ctx);
    }

    fn restore(&mut self, slot: u32, ctx: &EvictionCtx<'_>) {
        let class = self.class[slot as usize] as usize;
        let h = ctx.hash(slot);
        if class == T1 {
            self.b1.remove(&h);
        } else {
            self.b2.remove(&h);
        }
        self.sizes[class] += 1;
        if self.was_listed[slot as usize] {
            self.lists.push_front(slot, class);
        }
    }

    fn check(&self, status: &dyn Fn(u32) -> SlotStatus) -> Result<(), String> {
        check_listed_evictable(&self.lists, self.capacity, status)?;
        let registered = (0..self.capacity as u32)
            .filter(|&s| status(s) != SlotStatus::Unregistered)
            .count();
        if registered != self.sizes[T1] + self.sizes[T2] {
            return Err(format!(
                "arc: {registered} registered but |T1| + |T2| = {:?}",
                self.sizes
            ));
        }
        for s in 0..self.capacity as u32 {
            if let Some(l) = self.lists.list_of(s)
                && l != self.class[s as usize] as usize
            {
                return Err(format!("arc slot {s} listed in the wrong list"));
            }
        }
        if self.p > self.capacity {
            return Err(format!("arc p = {} > c = {}", self.p, self.capacity));
        }
        Ok(())
    }
}
