//! S3-FIFO (Yang et al., SOSP 2023): a small FIFO queue filters one-hit wonders, a main FIFO
//! queue with reinsertion keeps the rest, and a ghost queue remembers what the small queue
//! evicted.
//!
//! Every registered slot is in S (small, target 10% of capacity) or M (main), in insertion
//! order, active or not. A registration whose hash is a ghost enters M, any other enters S.
//! Each revival (match) raises the slot's frequency (0..=3). To evict: while S holds at least
//! its target (or M is empty), S's head is examined: accessed or in use, it moves to M's tail
//! (frequency reset); otherwise it is evicted and becomes a ghost. Else M's head is examined:
//! in use, it goes to M's tail; accessed, its frequency drops by one and it goes to M's tail;
//! otherwise it is evicted. Protected slots are passed over (moved to their queue's tail); a
//! queue passed over entirely (every entry in use or protected) yields to the other. A
//! recency touch changes nothing (S3-FIFO keeps no recency order).

use super::ghost::Ghost;
use super::list::{Lists, NIL};
use super::{Eviction, EvictionCtx, SlotStatus};

const S: usize = 0;
const M: usize = 1;

/// S3-FIFO.
#[derive(Clone, Debug)]
pub struct S3Fifo {
    lists: Lists<2>,
    freq: Vec<u8>,
    inactive: Vec<bool>,
    queue: Vec<u8>,
    ghost: Ghost,
    small_target: usize,
    evictable: usize,
    capacity: usize,
}

impl S3Fifo {
    /// An empty S3-FIFO for slots `0..capacity` (small queue: 10%, at least one).
    pub fn new(capacity: usize) -> Self {
        Self {
            lists: Lists::new(capacity),
            freq: vec![0; capacity],
            inactive: vec![false; capacity],
            queue: vec![S as u8; capacity],
            ghost: Ghost::new(capacity),
            small_target: (capacity / 10).max(1),
            evictable: 0,
            capacity,
        }
    }

    /// Slots in the small and main queues.
    pub fn queue_lens(&self) -> (usize, usize) {
        (self.lists.len(S), self.lists.len(M))
    }

    fn evict(&mut self, s: u32, ctx: &EvictionCtx<'_>) {
        let q = self
            .lists
            .unlink(s)
            .unwrap_or(self.queue[s as usize] as usize);
        self.queue[s as usize] = q as u8;
        if self.inactive[s as usize] {
            self.evictable -= 1;
        }
        if q == S {
            self.ghost.insert(ctx.hash(s));
        }
    }

    fn requeue(&mut self, s: u32, q: usize) {
        self.lists.unlink(s);
        self.queue[s as usize] = q as u8;
        self.lists.push_back(s, q);
    }
}

impl Eviction for S3Fifo {
    fn on_register(&mut self, slot: u32, ctx: &EvictionCtx<'_>) {
        let q = if self.ghost.remove(&ctx.hash(slot)) {
            M
        } else {
            S
        };
        self.freq[slot as usize] = 0;
        self.inactive[slot as usize] = false;
        self.queue[slot as usize] = q as u8;
        self.lists.push_back(slot, q);
    }

    #[inline]
    fn on_release(&mut self, slot: u32, _ctx: &EvictionCtx<'_>) {
        self.inactive[slot as usize] = true;
        self.evictable += 1;
    }

    #[inline]
    fn on_acquire(&mut self, slot: u32, _ctx: &EvictionCtx<'_>) {
        self.inactive[slot as usize] = false;
        self.evictable -= 1;
        let f = &mut self.freq[slot as usize];
        *f = (*f + 1).min(3);
    }

    fn pop_victim(
        &mut self,
        ctx: &EvictionCtx<'_>,
        protected: &impl Fn(u32) -> bool,
    ) -> Option<u32> {
        if self.evictable == 0 {
            return None;
        }
        // Every pass over both queues lowers some frequency or evicts; four passes suffice
        // unless every evictable slot is protected. A queue whose whole length was passed
        // over (in use or protected) yields to the other one.
        let mut budget = 5 * (self.lists.len(S) + self.lists.len(M)) + 8;
        let (mut s_stalled, mut m_stalled) = (0, 0);
        while budget > 0 {
            budget -= 1;
            let (ls, lm) = (self.lists.len(S), self.lists.len(M));
            let from_small =
                ls > 0 && s_stalled < ls && (ls >= self.small_target || lm == 0 || m_stalled >= lm);
            let q = if from_small { S } else { M };
            let s = self.lists.head(q);
            if s == NIL {
                return None;
            }
            let i = s as usize;
            let evictable = self.inactive[i] && !protected(s);
            if q == S {
                if !self.inactive[i] || self.freq[i] > 0 {
                    self.freq[i] = 0;
                    self.requeue(s, M);
                } else if !evictable {
                    s_stalled += 1;
                    self.requeue(s, S);
                } else {
                    self.evict(s, ctx);
                    return Some(s);
                }
            } else if !evictable {
                m_stalled += 1;
                self.requeue(s, M);
            } else if self.freq[i] > 0 {
                m_stalled = 0;
                self.freq[i] -= 1;
                self.requeue(s, M);
            } else {
                self.evict(s, ctx);
                return Some(s);
            }
        }
        None
    }

    fn remove(&mut self, slot: u32, ctx: &EvictionCtx<'_>) {
        self.evict(slot, ctx);
    }

    fn restore(&mut self, slot: u32, ctx: &EvictionCtx<'_>) {
        let q = self.queue[slot as usize] as usize;
        if q == S {
            self.ghost.remove(&ctx.hash(slot));
        }
        if self.inactive[slot as usize] {
            self.evictable += 1;
        }
        self.lists.push_front(slot, q);
    }

    fn check(&self, status: &dyn Fn(u32) -> SlotStatus) -> Result<(), String> {
        self.lists.check()?;
        let mut evictable = 0;
        for s in 0..self.capacity as u32 {
            let st = status(s);
            let listed = self.lists.list_of(s);
            if (st == SlotStatus::Unregistered) == listed.is_some() {
                return Err(format!("s3fifo slot {s}: {st:?} but listed = {listed:?}"));
            }
            if let Some(q) = listed
                && q != self.queue[s as usize] as usize
            {
                return Err(format!("s3fifo slot {s} in the wrong queue"));
            }
            if listed.is_some() && self.inactive[s as usize] {
                if st != SlotStatus::Evictable {
                    return Err(format!("s3fifo slot {s} inactive while {st:?}"));
                }
                evictable += 1;
            }
        }
        if evictable != self.evictable {
            return Err(format!(
                "s3fifo counts {} evictable, {evictable} flagged",
                self.evictable
            ));
        }
        Ok(())
    }
}
