//! LRU: the least recently released evictable block goes first.
//!
//! One intrusive list of evictable slots: a release appends (most recent at the tail), a
//! revival unlinks, a victim is the head. A recency touch moves an evictable slot to the tail.

use super::list::Lists;
use super::{Eviction, EvictionCtx, SlotStatus, check_listed_evictable};

/// Least recently released first.
#[derive(Clone, Debug)]
pub struct Lru {
    lists: Lists<1>,
    capacity: usize,
    /// Whether `remove` found the slot listed (restore lists it again only then).
    was_listed: Vec<bool>,
}

impl Lru {
    /// An empty LRU order for slots `0..capacity`.
    pub fn new(capacity: usize) -> Self {
        Self {
            lists: Lists::new(capacity),
            capacity,
            was_listed: vec![false; capacity],
        }
    }
}

impl Eviction for Lru {
    #[inline]
    fn on_register(&mut self, _slot: u32, _ctx: &EvictionCtx<'_>) {}

    #[inline]
    fn on_release(&mut self, slot: u32, _ctx: &EvictionCtx<'_>) {
        self.lists.push_back(slot, 0);
    }

    #[inline]
    fn on_acquire(&mut self, slot: u32, _ctx: &EvictionCtx<'_>) {
        self.lists.unlink(slot);
    }

    fn on_touch(&mut self, slot: u32, _ctx: &EvictionCtx<'_>) {
        if self.lists.unlink(slot).is_some() {
            self.lists.push_back(slot, 0);
        }
    }

    #[inline]
    fn pop_victim(
        &mut self,
        _ctx: &EvictionCtx<'_>,
        protected: &impl Fn(u32) -> bool,
    ) -> Option<u32> {
        let s = self.lists.first_unskipped(0, protected)?;
        self.lists.unlink(s);
        self.was_listed[s as usize] = true;
        Some(s)
    }

    fn remove(&mut self, slot: u32, _ctx: &EvictionCtx<'_>) {
        self.was_listed[slot as usize] = self.lists.unlink(slot).is_some();
    }

    fn restore(&mut self, slot: u32, _ctx: &EvictionCtx<'_>) {
        if self.was_listed[slot as usize] {
            self.lists.push_front(slot, 0);
        }
    }

    fn check(&self, status: &dyn Fn(u32) -> SlotStatus) -> Result<(), String> {
        check_listed_evictable(&self.lists, self.capacity, status)?;
        let evictable = (0..self.capacity as u32)
            .filter(|&s| status(s) == SlotStatus::Evictable)
            .count();
        if evictable != self.lists.len(0) {
            return Err(format!(
                "lru lists {} of {evictable} evictable",
                self.lists.len(0)
            ));
        }
        Ok(())
    }
}
