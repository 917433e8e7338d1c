//! FIFO: first registered, first evicted, regardless of reuse.
//!
//! The list holds every registered slot that has not been *parked*, in registration order,
//! active or not: appended at registration, never moved by a release or a revival. An active
//! slot met at the head by an eviction is parked (unlisted) until its release puts it back in
//! registration order (parked slots are older than every slot never parked, so the walk is
//! short). Each registration is skipped at most once per parking.

use super::list::{Lists, NIL};
use super::{Eviction, EvictionCtx, SlotStatus};

/// Registration order.
#[derive(Clone, Debug)]
pub struct Fifo {
    lists: Lists<1>,
    seq: Vec<u64>,
    inactive: Vec<bool>,
    next_seq: u64,
}

impl Fifo {
    /// An empty order for slots `0..capacity`.
    pub fn new(capacity: usize) -> Self {
        Self {
            lists: Lists::new(capacity),
            seq: vec![0; capacity],
            inactive: vec![false; capacity],
            next_seq: 0,
        }
    }

    /// Puts a slot back into the registration-ordered list.
    fn insert_ordered(&mut self, s: u32) {
        let seq = self.seq[s as usize];
        let mut next = self.lists.head(0);
        while next != NIL && self.seq[next as usize] < seq {
            next = self.lists.next(next);
        }
        if next == NIL {
            self.lists.push_back(s, 0);
        } else {
            self.lists.insert_before(s, next, 0);
        }
    }
}

impl Eviction for Fifo {
    #[inline]
    fn on_register(&mut self, slot: u32, _ctx: &EvictionCtx<'_>) {
        self.seq[slot as usize] = self.next_seq;
        self.next_seq += 1;
        self.inactive[slot as usize] = false;
        self.lists.push_back(slot, 0);
    }

    #[inline]
    fn on_release(&mut self, slot: u32, _ctx: &EvictionCtx<'_>) {
        self.inactive[slot as usize] = true;
        if !self.lists.is_listed(slot) {
            self.insert_ordered(slot);
        }
    }

    #[inline]
    fn on_acquire(&mut self, slot: u32, _ctx: &EvictionCtx<'_>) {
        // a revived slot keeps its place (reuse does not reorder)
        self.inactive[slot as usize] = false;
    }

    fn pop_victim(
        &mut self,
        _ctx: &EvictionCtx<'_>,
        protected: &impl Fn(u32) -> bool,
    ) -> Option<u32> {
        let mut s = self.lists.head(0);
        while s != NIL {
            let next = self.lists.next(s);
            if !self.inactive[s as usize] {
                // park: its release puts it back in order
                self.lists.unlink(s);
            } else if !protected(s) {
                self.lists.unlink(s);
                return Some(s);
            }
            s = next;
        }
        None
    }

    fn remove(&mut self, slot: u32, _ctx: &EvictionCtx<'_>) {
        self.lists.unlink(slot);
    }

    fn restore(&mut self, slot: u32, _ctx: &EvictionCtx<'_>) {
        if self.inactive[slot as usize] {
            self.insert_ordered(slot);
        }
    }

    fn check(&self, status: &dyn Fn(u32) -> SlotStatus) -> Result<(), String> {
        self.lists.check()?;
        let mut prev: Option<u64> = None;
        let mut s = self.lists.head(0);
        while s != NIL {
            let seq = self.seq[s as usize];
            if prev.is_some_and(|p| p >= seq) {
                return Err(format!("fifo list out of registration order at slot {s}"));
            }
            prev = Some(seq);
            s = self.lists.next(s);
        }
        for s in 0..self.seq.len() as u32 {
            let st = status(s);
            if self.lists.is_listed(s) && st == SlotStatus::Unregistered {
                return Err(format!("fifo slot {s} listed while unregistered"));
            }
            if st == SlotStatus::Evictable && self.inactive[s as usize] && !self.lists.is_listed(s)
            {
                return Err(format!("fifo: evictable slot {s} is not listed"));
            }
            if self.inactive[s as usize] && st == SlotStatus::Active {
                return Err(format!("fifo slot {s} inactive flag while active"));
            }
        }
        Ok(())
    }
}
