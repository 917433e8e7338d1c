//! Belady's MIN (offline optimum): evict the block whose next use is farthest away.
//!
//! The policy cannot know the future: the caller gives it, per registered block, through
//! [`BlockManager::hint_next_use`](crate::BlockManager::hint_next_use) (any monotonic clock,
//! e.g. the index of the next request that needs the block in a replayed trace; `u64::MAX`
//! for never). A block without a hint counts as never used again. This is the reference
//! upper bound a replay reports next to the online policies; it keeps a B-tree (one node
//! allocation per insert), so it is not meant for the hot path.

use std::collections::BTreeSet;

use super::{Eviction, EvictionCtx, SlotStatus};

/// Farthest next use first.
#[derive(Clone, Debug)]
pub struct Belady {
    next_use: Vec<u64>,
    evictable: BTreeSet<(u64, u32)>,
    inactive: Vec<bool>,
}

impl Belady {
    /// An empty order for slots `0..capacity`.
    pub fn new(capacity: usize) -> Self {
        Self {
            next_use: vec![u64::MAX; capacity],
            evictable: BTreeSet::new(),
            inactive: vec![false; capacity],
        }
    }
}

impl Eviction for Belady {
    fn on_register(&mut self, slot: u32, _ctx: &EvictionCtx<'_>) {
        self.next_use[slot as usize] = u64::MAX;
        self.inactive[slot as usize] = false;
    }

    fn on_release(&mut self, slot: u32, _ctx: &EvictionCtx<'_>) {
        self.inactive[slot as usize] = true;
        self.evictable.insert((self.next_use[slot as usize], slot));
    }

    fn on_acquire(&mut self, slot: u32, _ctx: &EvictionCtx<'_>) {
        self.inactive[slot as usize] = false;
        self.evictable.remove(&(self.next_use[slot as usize], slot));
    }

    fn on_hint(&mut self, slot: u32, next_use: u64, _ctx: &EvictionCtx<'_>) {
        let old = std::mem::replace(&mut self.next_use[slot as usize], next_use);
        if self.evictable.remove(&(old, slot)) {
            self.evictable.insert((next_use, slot));
        }
    }

    fn pop_victim(
        &mut self,
        _ctx: &EvictionCtx<'_>,
        protected: &impl Fn(u32) -> bool,
    ) -> Option<u32> {
        let victim = *self.evictable.iter().rev().find(|(_, s)| !protected(*s))?;
        self.evictable.remove(&victim);
        Some(victim.1)
    }

    fn remove(&mut self, slot: u32, _ctx: &EvictionCtx<'_>) {
        self.evictable.remove(&(self.next_use[slot as usize], slot));
    }

    fn restore(&mut self, slot: u32, _ctx: &EvictionCtx<'_>) {
        if self.inactive[slot as usize] {
            self.evictable.insert((self.next_use[slot as usize], slot));
        }
    }

    fn check(&self, status: &dyn Fn(u32) -> SlotStatus) -> Result<(), String> {
        for &(t, s) in &self.evictable {
            if status(s) != SlotStatus::Evictable || self.next_use[s as usize] != t {
                return Err(format!("belady lists slot {s} while {:?}", status(s)));
            }
        }
        Ok(())
    }
}
