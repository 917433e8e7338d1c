//! The per-manager block store: every slot, the reset pool, the hash index and the inactive
//! pool with its eviction order, behind **one** mutex.
//!
//! # Slot states
//!
//! ```text
//!             allocate                 complete               register
//!   Reset ─────────────────▶ Held ───────────────▶ Held ─────────────────▶ Active
//!     ▲    (MutableBlock)      │    (CompleteBlock)  │     (ImmutableBlock)   │  ▲
//!     │                        │ drop                │ drop          last drop │  │ match / upgrade
//!     ├────────────────────────┘                     │                         ▼  │
//!     ├──────────────────────────────────────────────┘                      Inactive
//!     └──────────────────────────── evict (allocate / reset_inactive_pool) ───┘
//! ```
//!
//! Every slot is in exactly one state; `free.len() + held + active + inactive == slots.len()`.
//! Duplicates (registered under a hash that already has a primary slot, policy `Allow`) go
//! straight back to Reset on their last drop.
//!
//! # Reference counts
//!
//! Strong handles ([`ImmutableBlock`](crate::ImmutableBlock)) count themselves in
//! `Core::refs[slot]`, an atomic outside the mutex, so cloning and dropping a non-last handle
//! never locks. The handle whose decrement reaches zero locks the store and moves the slot to
//! Inactive **only if** the count is still zero and the slot still Active: a `match_blocks` may
//! have revived it (0 → 1) in between, and two releasers may race; the check under the lock
//! makes release idempotent.
//!
//! # Lock order
//!
//! 1. `Core::store` (this mutex)
//! 2. then, while holding it, a registry presence shard or the event buffer (both leaves).
//!
//! The event publish lock is taken only without the store lock. Nothing takes the store lock
//! while holding a registry or event lock.

use std::ptr::NonNull;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use hashbrown::{DefaultHashBuilder, HashMap};

use crate::config::{DuplicationPolicy, EvictionBackend};
use crate::events::{BlockEvent, BlockEventKind, EventBatcher};
use crate::hash::{PassThroughHash, SequenceHash};
use crate::metrics::Metrics;
use crate::registry::BlockRegistry;
use crate::sync::{AtomicU32, Mutex, ghost};
use crate::tier::TierId;

pub(crate) const NIL: u32 = u32::MAX;
const UNLISTED: u8 = u8::MAX;
const LEVELS: usize = 4;

/// The state of one slot.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub(crate) enum SlotState {
    Reset,
    Held,
    Active,
    Inactive,
}

#[derive(Clone, Debug)]
pub(crate) struct Slot {
    pub(crate) hash: SequenceHash,
    pub(crate) state: SlotState,
    /// Registered under `hash` in `map` (false for duplicates).
    pub(crate) primary: bool,
    /// Eviction list level, or `UNLISTED` (FIFO lists active primaries too, see `pop_victim`).
    level: u8,
    /// Bumped at each registration; lets a `WeakBlock` detect slot reuse.
    pub(crate) generation: u32,
    prev: u32,
    next: u32,
    /// Lineage: the parent's slot (or NIL) and the number of cached children.
    parent: u32,
    children: u32,
    /// FIFO: registration order (the FIFO list is sorted by it).
    seq: u64,
}

/// Counts of the pools (a consistent snapshot).
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub struct PoolCounts {
    /// Slots in the reset pool.
    pub reset: usize,
    /// Slots held by a `MutableBlock` or `CompleteBlock`.
    pub held: usize,
    /// Registered slots with at least one strong reference (or a release in flight).
    pub active: usize,
    /// Registered slots with no strong reference, matchable until evicted.
    pub inactive: usize,
}

pub(crate) struct Store {
    pub(crate) slots: Vec<Slot>,
    free: Vec<u32>,
    map: HashMap<SequenceHash, u32, PassThroughHash>,
    lineage: HashMap<u64, u32, DefaultHashBuilder>,
    backend: EvictionBackend,
    heads: [u32; LEVELS],
    tails: [u32; LEVELS],
    next_seq: u64,
    held: usize,
    active: usize,
    inactive: usize,
    /// Events emitted under this lock, drained into the batcher before unlocking.
    pending_events: Vec<BlockEvent>,
}

/// Everything a manager and its blocks share.
pub(crate) struct Core {
    pub(crate) tier: TierId,
    pub(crate) block_size: u32,
    pub(crate) refs: Box<[AtomicU32]>,
    pub(crate) store: Mutex<Store>,
    pub(crate) registry: BlockRegistry,
    pub(crate) events: Option<EventBatcher>,
    pub(crate) metrics: Metrics,
    pub(crate) duplication: DuplicationPolicy,
    pub(crate) touch_on_match: bool,
}

impl Core {
    /// Pins the core for a slot whose refcount just went from `previous` to `previous + 1`.
    ///
    /// Strong handles do not each hold an `Arc`: a slot's *non-zero epoch* (refcount 0 → 1
    /// until the handle whose decrement reaches 0 has finished its locked release) holds one
    /// `Arc` count, its pin. The 0 → 1 transition takes the pin (always under the store lock);
    /// the handle that brings the count back to 0 owns that pin and drops it after releasing
    /// the store lock. A match that revives a slot whose release is still pending starts a new
    /// epoch with its own pin, so each pending releaser always holds a pin while it locks.
    #[inline]
    pub(crate) fn pin_if_first(self: &Arc<Self>, previous: u32) -> NonNull<Core> {
        let ptr = Arc::as_ptr(self);
        if previous == 0 {
            // SAFETY: `ptr` comes from a live `Arc`.
            unsafe { Arc::increment_strong_count(ptr) };
        }
        NonNull::from(&**self)
    }

    /// Drops one epoch's pin.
    ///
    /// # Safety
    /// `ptr` must come from [`pin_if_first`](Self::pin_if_first) and the caller must own the
    /// pin (it ended the epoch); it must not touch the core afterwards.
    #[inline]
    pub(crate) unsafe fn unpin(ptr: NonNull<Core>) {
        // SAFETY: guaranteed by the caller: one count taken by `pin_if_first` is released.
        unsafe { Arc::decrement_strong_count(ptr.as_ptr().cast_const()) };
    }
}

impl Drop for Core {
    fn drop(&mut self) {
        ghost::died(self as *const Core);
        if let Some(events) = &self.events {
            events.flush();
        }
    }
}

fn multi_lru_level(frequency: u32) -> u8 {
    match frequency {
        0..3 => 0,
        3..8 => 1,
        8..15 => 2,
        _ => 3,
    }
}

impl Store {
    pub(crate) fn new(block_count: usize, backend: EvictionBackend) -> Self {
        let slots = (0..block_count)
            .map(|_| Slot {
                hash: SequenceHash::from_u128(0),
                state: SlotState::Reset,
                primary: false,
                level: UNLISTED,
                generation: 0,
                prev: NIL,
                next: NIL,
                parent: NIL,
                children: 0,
                seq: 0,
            })
            .collect();
        Self {
            slots,
            // popped from the end: hands out 0, 1, 2, ... first
            free: (0..block_count as u32).rev().collect(),
            map: HashMap::with_capacity_and_hasher(block_count, PassThroughHash),
            lineage: HashMap::default(),
            backend,
            heads: [NIL; LEVELS],
            tails: [NIL; LEVELS],
            next_seq: 0,
            held: 0,
            active: 0,
            inactive: 0,
            pending_events: Vec::new(),
        }
    }

    pub(crate) fn counts(&self) -> PoolCounts {
        PoolCounts {
            reset: self.free.len(),
            held: self.held,
            active: self.active,
            inactive: self.inactive,
        }
    }

    pub(crate) fn lookup(&self, hash: &SequenceHash) -> Option<u32> {
        self.map.get(hash).copied()
    }

    // ---- intrusive lists -------------------------------------------------------------

    #[inline]
    fn push_back(&mut self, s: u32, level: u8) {
        let l = level as usize;
        let tail = self.tails[l];
        let slot = &mut self.slots[s as usize];
        slot.level = level;
        slot.prev = tail;
        slot.next = NIL;
        if tail == NIL {
            self.heads[l] = s;
        } else {
            self.slots[tail as usize].next = s;
        }
        self.tails[l] = s;
    }

    #[inline]
    fn push_front(&mut self, s: u32, level: u8) {
        let l = level as usize;
        let head = self.heads[l];
        let slot = &mut self.slots[s as usize];
        slot.level = level;
        slot.prev = NIL;
        slot.next = head;
        if head == NIL {
            self.tails[l] = s;
        } else {
            self.slots[head as usize].prev = s;
        }
        self.heads[l] = s;
    }

    #[inline]
    fn unlink(&mut self, s: u32) {
        let slot = &mut self.slots[s as usize];
        let (level, prev, next) = (slot.level, slot.prev, slot.next);
        if level == UNLISTED {
            return;
        }
        slot.level = UNLISTED;
        slot.prev = NIL;
        slot.next = NIL;
        let l = level as usize;
        if prev == NIL {
            self.heads[l] = next;
        } else {
            self.slots[prev as usize].next = next;
        }
        if next == NIL {
            self.tails[l] = prev;
        } else {
            self.slots[next as usize].prev = prev;
        }
    }

    // ---- inactive pool ---------------------------------------------------------------

    /// Active (refs == 0) primary → Inactive.
    fn inactive_insert(&mut self, s: u32, registry: &BlockRegistry) {
        let slot = &mut self.slots[s as usize];
        debug_assert_eq!(slot.state, SlotState::Active);
        slot.state = SlotState::Inactive;
        self.active -= 1;
        self.inactive += 1;
        match self.backend {
            EvictionBackend::Lru => self.push_back(s, 0),
            EvictionBackend::MultiLru => {
                let level = multi_lru_level(registry.frequency(self.slots[s as usize].hash));
                self.push_back(s, level)
            }
            EvictionBackend::Lineage => {
                if self.slots[s as usize].children == 0 {
                    self.push_back(s, 0)
                }
            }
            EvictionBackend::Fifo => {
                // Still listed since its registration: nothing to do. Parked (skipped by an
                // eviction while active): older than every listed slot that was never parked,
                // so its place is near the head.
                if self.slots[s as usize].level == UNLISTED {
                    self.fifo_insert_parked(s)
                }
            }
        }
    }

    /// FIFO: puts a parked slot back into the registration-ordered list. Only parked slots
    /// with an older registration are walked past (they are all at the head: a parked slot
    /// was the head when it was skipped).
    fn fifo_insert_parked(&mut self, s: u32) {
        let seq = self.slots[s as usize].seq;
        let mut next = self.heads[0];
        while next != NIL && self.slots[next as usize].seq < seq {
            next = self.slots[next as usize].next;
        }
        if next == NIL {
            return self.push_back(s, 0);
        }
        let prev = self.slots[next as usize].prev;
        let slot = &mut self.slots[s as usize];
        slot.level = 0;
        slot.prev = prev;
        slot.next = next;
        self.slots[next as usize].prev = s;
        if prev == NIL {
            self.heads[0] = s;
        } else {
            self.slots[prev as usize].next = s;
        }
    }

    /// Inactive → Active (the caller bumps the refcount).
    #[inline]
    fn inactive_remove(&mut self, s: u32) {
        let slot = &mut self.slots[s as usize];
        debug_assert_eq!(slot.state, SlotState::Inactive);
        slot.state = SlotState::Active;
        self.inactive -= 1;
        self.active += 1;
        // FIFO: a revived slot keeps its place (reuse does not reorder); see `pop_victim`.
        if self.backend != EvictionBackend::Fifo {
            self.unlink(s);
        }
    }

    fn pop_victim(&mut self) -> Option<u32> {
        if self.backend == EvictionBackend::Fifo {
            // The FIFO list holds every registered primary that has not been *parked*, in
            // registration order, active or not: appended at registration, never moved by a
            // release or a revival. An active slot met at the head is parked (unlisted) until
            // its release puts it back, so each registration is skipped at most once here.
            loop {
                let s = self.heads[0];
                if s == NIL {
                    return None;
                }
                self.unlink(s);
                if self.slots[s as usize].state == SlotState::Inactive {
                    return Some(s);
                }
            }
        }
        let s = *self.heads.iter().find(|&&h| h != NIL)?;
        self.unlink(s);
        Some(s)
    }

    /// Removes an inactive slot's registration (it becomes Held, owned by the caller).
    fn evict(&mut self, s: u32, tier: TierId, registry: &BlockRegistry, emit: bool) {
        let slot = &mut self.slots[s as usize];
        debug_assert_eq!(slot.state, SlotState::Inactive);
        debug_assert!(slot.primary);
        let hash = slot.hash;
        slot.state = SlotState::Held;
        slot.primary = false;
        let parent = std::mem::replace(&mut slot.parent, NIL);
        self.inactive -= 1;
        self.held += 1;
        self.map.remove(&hash);
        if self.backend == EvictionBackend::Lineage {
            let key = hash.lineage_key();
            if self.lineage.get(&key) == Some(&s) {
                self.lineage.remove(&key);
            }
            if parent != NIL {
                let p = &mut self.slots[parent as usize];
                p.children -= 1;
                if p.children == 0 && p.state == SlotState::Inactive {
                    // the freed parent is the next victim: stale chains go tail first
                    self.push_front(parent, 0);
                }
            }
        }
        registry.clear_present(hash, tier);
        if emit {
            self.pending_events.push(BlockEvent {
                kind: BlockEventKind::Removed,
                tier,
                hash,
            });
        }
    }

    // ---- transitions used by the manager -----------------------------------------------

    /// Held → Reset.
    pub(crate) fn release_held(&mut self, s: u32) {
        let slot = &mut self.slots[s as usize];
        debug_assert_eq!(slot.state, SlotState::Held);
        slot.state = SlotState::Reset;
        self.held -= 1;
        self.free.push(s);
    }

    /// Takes `n` slots (reset first, then evicting), all-or-nothing. Returns the slots (now
    /// Held) and how many were evicted, or the number that could have been provided.
    pub(crate) fn allocate(
        &mut self,
        n: usize,
        tier: TierId,
        registry: &BlockRegistry,
        emit: bool,
    ) -> Result<(Vec<u32>, usize), usize> {
        if self.free.len() + self.inactive < n {
            return Err(self.free.len() + self.inactive);
        }
        let from_free = n.min(self.free.len());
        let mut out: Vec<u32> = Vec::with_capacity(n);
        for _ in 0..from_free {
            let s = self.free.pop().expect("counted above");
            self.slots[s as usize].state = SlotState::Held;
            out.push(s);
        }
        self.held += from_free;
        let mut evicted = 0;
        while out.len() < n {
            match self.pop_victim() {
                Some(s) => {
                    self.evict(s, tier, registry, emit);
                    out.push(s);
                    evicted += 1;
                }
                None => {
                    // Lineage only: the remaining inactive blocks are parents of active
                    // blocks. Give everything back (evicted slots go to the reset pool).
                    let available = out.len();
                    for s in out {
                        self.release_held(s);
                    }
                    return Err(available);
                }
            }
        }
        Ok((out, evicted))
    }

    /// Evicts every evictable inactive block to the reset pool; returns how many.
    pub(crate) fn reset_inactive(
        &mut self,
        tier: TierId,
        registry: &BlockRegistry,
        emit: bool,
    ) -> usize {
        let mut n = 0;
        while let Some(s) = self.pop_victim() {
            self.evict(s, tier, registry, emit);
            self.release_held(s);
            n += 1;
        }
        n
    }

    /// Held → Active primary under `hash` (caller checked the hash is not in the map).
    pub(crate) fn register_primary(
        &mut self,
        s: u32,
        hash: SequenceHash,
        tier: TierId,
        registry: &BlockRegistry,
        emit: bool,
    ) {
        let seq = self.next_seq;
        self.next_seq += 1;
        let slot = &mut self.slots[s as usize];
        debug_assert_eq!(slot.state, SlotState::Held);
        slot.state = SlotState::Active;
        slot.hash = hash;
        slot.primary = true;
        slot.generation = slot.generation.wrapping_add(1);
        slot.seq = seq;
        slot.children = 0;
        slot.parent = NIL;
        self.held -= 1;
        self.active += 1;
        self.map.insert(hash, s);
        if self.backend == EvictionBackend::Fifo {
            self.push_back(s, 0);
        }
        if self.backend == EvictionBackend::Lineage {
            if let Some(pk) = hash.parent_lineage_key()
                && let Some(&p) = self.lineage.get(&pk)
                && p != s
            {
                self.slots[s as usize].parent = p;
                let ps = &mut self.slots[p as usize];
                ps.children += 1;
                if ps.children == 1 && ps.state == SlotState::Inactive {
                    // no longer a leaf
                    self.unlink(p);
                }
            }
            self.lineage.insert(hash.lineage_key(), s);
        }
        registry.set_present(hash, tier);
        if emit {
            self.pending_events.push(BlockEvent {
                kind: BlockEventKind::Stored,
                tier,
                hash,
            });
        }
    }

    /// Held → Active duplicate (not in the map).
    pub(crate) fn register_duplicate(&mut self, s: u32, hash: SequenceHash) {
        let slot = &mut self.slots[s as usize];
        slot.state = SlotState::Active;
        slot.hash = hash;
        slot.primary = false;
        slot.generation = slot.generation.wrapping_add(1);
        self.held -= 1;
        self.active += 1;
    }

    /// Makes a registered slot Active for one more strong reference (revives an inactive
    /// one); the caller increments `refs[s]`.
    #[inline]
    pub(crate) fn acquire(&mut self, s: u32) {
        if self.slots[s as usize].state == SlotState::Inactive {
            self.inactive_remove(s);
        }
    }

    /// Called by the handle whose decrement reached zero; idempotent (see module docs).
    pub(crate) fn release_registered(
        &mut self,
        s: u32,
        refs: &AtomicU32,
        registry: &BlockRegistry,
    ) {
        if refs.load(Ordering::Acquire) != 0 || self.slots[s as usize].state != SlotState::Active {
            return;
        }
        if self.slots[s as usize].primary {
            self.inactive_insert(s, registry);
        } else {
            self.slots[s as usize].state = SlotState::Reset;
            self.active -= 1;
            self.free.push(s);
        }
    }

    pub(crate) fn take_events(&mut self) -> Option<Vec<BlockEvent>> {
        (!self.pending_events.is_empty()).then(|| std::mem::take(&mut self.pending_events))
    }

    /// Checks every structural invariant; returns a description of the first violation.
    pub(crate) fn check(&self, refs: &[AtomicU32]) -> Result<PoolCounts, String> {
        let mut c = PoolCounts::default();
        let mut listed = 0usize;
        for (i, slot) in self.slots.iter().enumerate() {
            let r = refs[i].load(Ordering::Acquire);
            match slot.state {
                SlotState::Reset => c.reset += 1,
                SlotState::Held => c.held += 1,
                SlotState::Active => c.active += 1,
                SlotState::Inactive => c.inactive += 1,
            }
            if matches!(
                slot.state,
                SlotState::Reset | SlotState::Held | SlotState::Inactive
            ) && r != 0
            {
                return Err(format!("slot {i} is {:?} with {r} strong refs", slot.state));
            }
            let registered = matches!(slot.state, SlotState::Active | SlotState::Inactive);
            if slot.primary {
                if !registered {
                    return Err(format!("slot {i} is primary but {:?}", slot.state));
                }
                if self.map.get(&slot.hash) != Some(&(i as u32)) {
                    return Err(format!("primary slot {i} missing from the hash map"));
                }
            } else if slot.state == SlotState::Inactive {
                return Err(format!("duplicate slot {i} is inactive"));
            }
            if slot.level != UNLISTED {
                listed += 1;
                let allowed = match self.backend {
                    // FIFO lists registered primaries, active or not
                    EvictionBackend::Fifo => registered && slot.primary,
                    _ => slot.state == SlotState::Inactive,
                };
                if !allowed {
                    return Err(format!("slot {i} listed while {:?}", slot.state));
                }
            } else if self.backend == EvictionBackend::Fifo && slot.state == SlotState::Inactive {
                return Err(format!("fifo: inactive slot {i} is not listed"));
            }
            if self.backend == EvictionBackend::Lineage && slot.state == SlotState::Inactive {
                let should_list = slot.children == 0;
                if should_list != (slot.level != UNLISTED) {
                    return Err(format!(
                        "lineage slot {i}: {} children but listed = {}",
                        slot.children,
                        slot.level != UNLISTED
                    ));
                }
            }
        }
        if self.free.len() != c.reset {
            return Err(format!(
                "free list {} vs {} reset slots",
                self.free.len(),
                c.reset
            ));
        }
        for &s in &self.free {
            if self.slots[s as usize].state != SlotState::Reset {
                return Err(format!("free list holds non-reset slot {s}"));
            }
        }
        if (c.held, c.active, c.inactive) != (self.held, self.active, self.inactive) {
            return Err(format!("counters {:?} vs scanned {c:?}", self.counts()));
        }
        if self.map.len() != self.slots.iter().filter(|s| s.primary).count() {
            return Err("hash map has entries for non-primary slots".into());
        }
        match self.backend {
            EvictionBackend::Fifo | EvictionBackend::Lineage => {}
            _ => {
                if listed != c.inactive {
                    return Err(format!("lists hold {listed} of {} inactive", c.inactive));
                }
            }
        }
        // walk the lists: lengths must match the listed count
        let mut walked = 0;
        for l in 0..LEVELS {
            let mut s = self.heads[l];
            let mut prev = NIL;
            while s != NIL {
                let slot = &self.slots[s as usize];
                if slot.prev != prev || slot.level as usize != l {
                    return Err(format!("list {l} is corrupt at slot {s}"));
                }
                if self.backend == EvictionBackend::Fifo
                    && prev != NIL
                    && self.slots[prev as usize].seq >= slot.seq
                {
                    return Err(format!("fifo list out of registration order at slot {s}"));
                }
                walked += 1;
                if walked > self.slots.len() {
                    return Err("list cycle".into());
                }
                prev = s;
                s = slot.next;
            }
            if self.tails[l] != prev {
                return Err(format!("list {l} tail is wrong"));
            }
        }
        if walked != listed {
            return Err(format!("walked {walked} listed slots, flagged {listed}"));
        }
        Ok(c)
    }
}
