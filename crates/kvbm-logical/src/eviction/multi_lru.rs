//! Multi-level LRU: four LRU lists by registry frequency at release (thresholds 3, 8, 15).
//! The lowest non-empty level is evicted first, least recently released first within it.

use super::list::Lists;
use super::{Eviction, EvictionCtx, SlotStatus, check_listed_evictable};

const LEVELS: usize = 4;

fn level(frequency: u32) -> usize {
    match frequency {
        0..3 => 0,
        3..8 => 1,
        8..15 => 2,
        _ => 3,
    }
}

/// Frequency levels, LRU within a level.
#[derive(Clone, Debug)]
pub struct MultiLru {
    lists: Lists<LEVELS>,
    capacity: usize,
    /// Whether `remove` found the slot listed (restore lists it again only then).
    was_listed: Vec<bool>,
}

impl MultiLru {
    /// An empty order for slots `0..capacity`.
    pub fn new(capacity: usize) -> Self {
        Self {
            lists: Lists::new(capacity),
            capacity,
            was_listed: vec![false; capacity],
        }
    }
}

impl Eviction for MultiLru {
    #[inline]
    fn on_register(&mut self, _slot: u32, _ctx: &EvictionCtx<'_>) {}

    #[inline]
    fn on_release(&mut self, slot: u32, ctx: &EvictionCtx<'_>) {
        let l = level(ctx.registry().frequency(ctx.hash(slot)));
        self.lists.push_back(slot, l);
    }

    #[inline]
    fn on_acquire(&mut self, slot: u32, _ctx: &EvictionCtx<'_>) {
        self.lists.unlink(slot);
    }

    fn on_touch(&mut self, slot: u32, _ctx: &EvictionCtx<'_>) {
        if let Some(l) = self.lists.unlink(slot) {
            self.lists.push_back(slot, l);
        }
    }

    #[inline]
    fn pop_victim(
        &mut self,
        _ctx: &EvictionCtx<'_>,
        protected: &impl Fn(u32) -> bool,
    ) -> Option<u32> {
        for l in 0..LEVELS {
            if let Some(s) = self.lists.first_unskipped(l, protected) {
                self.lists.unlink(s);
                self.was_listed[s as usize] = true;
                return Some(s);
            }
        }
        None
    }

    fn remove(&mut self, slot: u32, _ctx: &EvictionCtx<'_>) {
        self.was_listed[slot as usize] = self.lists.unlink(slot).is_some();
    }

    fn restore(&mut self, slot: u32, ctx: &EvictionCtx<'_>) {
        if !self.was_listed[slot as usize] {
            return;
        }
        let l = level(ctx.registry().frequency(ctx.hash(slot)));
        self.lists.push_front(slot, l);
    }

    fn check(&self, status: &dyn Fn(u32) -> SlotStatus) -> Result<(), String> {
        check_listed_evictable(&self.lists, self.capacity, status)
    }
}
