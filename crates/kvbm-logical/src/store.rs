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
//! The eviction order of inactive slots is not kept here: the store tells its
//! [`Eviction`](crate::eviction::Eviction) policy (see the `eviction` module) about each
//! registered slot and asks it for victims, so policies are added without touching the store.
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
use std::sync::atomic::{AtomicU64, Ordering};

use hashbrown::HashMap;

use crate::config::{DuplicationPolicy, FreeSlotReuse};
use crate::events::{BlockEvent, BlockEventKind, EventBatcher};
use crate::eviction::{AnyEviction, Eviction, EvictionCtx, EvictionPolicy, SlotStatus};
use crate::hash::{BlockDigest, PassThroughHash, SequenceHash};
use crate::metrics::Metrics;
use crate::registry::BlockRegistry;
use crate::sync::{AtomicU32, Mutex, ghost};
use crate::tier::TierId;

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
    pub(crate) state: SlotState,
    /// Registered under its hash in `map` (false for duplicates).
    pub(crate) primary: bool,
    /// Bumped at each registration; lets a `WeakBlock` detect slot reuse.
    pub(crate) generation: u32,
    /// Matched (or upgraded) while already active since its last release: reported to the
    /// policy as one `on_hit` before its next release.
    hit: bool,
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

/// Hashes an allocation must not evict (see
/// [`BlockManager::allocate_blocks_with`](crate::BlockManager::allocate_blocks_with)).
pub trait ProtectSet {
    /// Whether `hash` must not be evicted.
    fn is_protected(&self, hash: &SequenceHash) -> bool;
    /// Whether nothing is protected (lets the store take the unchecked path).
    fn is_empty(&self) -> bool;
}

impl ProtectSet for [SequenceHash] {
    #[inline]
    fn is_protected(&self, hash: &SequenceHash) -> bool {
        self.contains(hash)
    }
    #[inline]
    fn is_empty(&self) -> bool {
        <[SequenceHash]>::is_empty(self)
    }
}

impl<const N: usize> ProtectSet for [SequenceHash; N] {
    #[inline]
    fn is_protected(&self, hash: &SequenceHash) -> bool {
        self.contains(hash)
    }
    #[inline]
    fn is_empty(&self) -> bool {
        N == 0
    }
}

impl ProtectSet for Vec<SequenceHash> {
    #[inline]
    fn is_protected(&self, hash: &SequenceHash) -> bool {
        self.contains(hash)
    }
    #[inline]
    fn is_empty(&self) -> bool {
        Vec::is_empty(self)
    }
}

impl<S: std::hash::BuildHasher> ProtectSet for std::collections::HashSet<SequenceHash, S> {
    #[inline]
    fn is_protected(&self, hash: &SequenceHash) -> bool {
        self.contains(hash)
    }
    #[inline]
    fn is_empty(&self) -> bool {
        std::collections::HashSet::is_empty(self)
    }
}

impl<S: std::hash::BuildHasher> ProtectSet for hashbrown::HashSet<SequenceHash, S> {
    #[inline]
    fn is_protected(&self, hash: &SequenceHash) -> bool {
        self.contains(hash)
    }
    #[inline]
    fn is_empty(&self) -> bool {
        hashbrown::HashSet::is_empty(self)
    }
}

impl ProtectSet for std::collections::BTreeSet<SequenceHash> {
    #[inline]
    fn is_protected(&self, hash: &SequenceHash) -> bool {
        self.contains(hash)
    }
    #[inline]
    fn is_empty(&self) -> bool {
        std::collections::BTreeSet::is_empty(self)
    }
}

pub(crate) struct Store {
    pub(crate) slots: Vec<Slot>,
    /// The hash each slot was last registered under (read by eviction policies).
    pub(crate) hashes: Vec<SequenceHash>,
    free: Vec<u32>,
    map: HashMap<SequenceHash, u32, PassThroughHash>,
    policy: AnyEviction,
    reuse: FreeSlotReuse,
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
    /// The [`BlockDigest`] each registered slot carries (all zero: none), allocated at the
    /// first registration that has one. See [`Core::set_digest`].
    pub(crate) digests: std::sync::OnceLock<Box<[[AtomicU64; 4]]>>,
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

impl Core {
    /// Records the digest of slot `s`, which the caller is registering (under the store lock,
    /// before any strong handle to the slot exists).
    ///
    /// Ordering: the words are written with `Relaxed` stores while the store lock is held and
    /// before the slot's first strong handle is made; every handle is obtained either by the
    /// registering thread or through a lookup under the same lock (an acquire), and handles
    /// move between threads only through synchronising operations, so a holder's `Relaxed`
    /// loads see these words. A slot's digest changes only at its next registration, which
    /// needs the slot back in the reset pool, i.e. no strong handle left.
    pub(crate) fn set_digest(&self, s: u32, digest: Option<&BlockDigest>) {
        let cells = match (self.digests.get(), digest) {
            (Some(c), _) => c,
            (None, None) => return,
            (None, Some(_)) => self.digests.get_or_init(|| {
                (0..self.refs.len())
                    .map(|_| std::array::from_fn(|_| AtomicU64::new(0)))
                    .collect()
            }),
        };
        let bytes = digest.map_or([0u8; 32], |d| d.0);
        for (i, cell) in cells[s as usize].iter().enumerate() {
            let word = u64::from_le_bytes(bytes[i * 8..i * 8 + 8].try_into().expect("8 bytes"));
            cell.store(word, Ordering::Relaxed);
        }
    }

    /// The digest slot `s` was registered with (`None` for blocks registered without one). The
    /// caller holds a strong handle to the slot.
    pub(crate) fn digest(&self, s: u32) -> Option<BlockDigest> {
        let cells = self.digests.get()?;
        let mut bytes = [0u8; 32];
        for (i, cell) in cells[s as usize].iter().enumerate() {
            bytes[i * 8..i * 8 + 8].copy_from_slice(&cell.load(Ordering::Relaxed).to_le_bytes());
        }
        (bytes != [0u8; 32]).then_some(BlockDigest(bytes))
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

impl Store {
    pub(crate) fn new(block_count: usize, policy: EvictionPolicy, reuse: FreeSlotReuse) -> Self {
        let slots = (0..block_count)
            .map(|_| Slot {
                state: SlotState::Reset,
                primary: false,
                generation: 0,
                hit: false,
            })
            .collect();
        Self {
            slots,
            hashes: vec![SequenceHash::from_u128(0); block_count],
            // popped from the end: hands out 0, 1, 2, ... first
            free: (0..block_count as u32).rev().collect(),
            map: HashMap::with_capacity_and_hasher(block_count, PassThroughHash),
            policy: AnyEviction::new(policy, block_count),
            reuse,
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

    // ---- inactive pool ---------------------------------------------------------------

    /// Inactive → Active (the caller bumps the refcount).
    #[inline]
    fn inactive_remove(&mut self, s: u32, registry: &BlockRegistry) {
        let slot = &mut self.slots[s as usize];
        debug_assert_eq!(slot.state, SlotState::Inactive);
        slot.state = SlotState::Active;
        self.inactive -= 1;
        self.active += 1;
        let ctx = EvictionCtx::new(&self.hashes, registry);
        self.policy.on_acquire(s, &ctx);
    }

    /// Asks the policy for one victim (not protected).
    #[inline]
    fn pop_victim<P: ProtectSet + ?Sized>(
        &mut self,
        registry: &BlockRegistry,
        protect: &P,
    ) -> Option<u32> {
        let ctx = EvictionCtx::new(&self.hashes, registry);
        if protect.is_empty() {
            self.policy.pop_victim(&ctx, &|_| false)
        } else {
            let hashes = &self.hashes;
            self.policy
                .pop_victim(&ctx, &|s| protect.is_protected(&hashes[s as usize]))
        }
    }

    /// Removes a victim's registration (it becomes Held, owned by the caller). The policy has
    /// already forgotten it.
    fn evict(&mut self, s: u32, tier: TierId, registry: &BlockRegistry, emit: bool) {
        let slot = &mut self.slots[s as usize];
        debug_assert_eq!(slot.state, SlotState::Inactive);
        debug_assert!(slot.primary);
        let hash = self.hashes[s as usize];
        slot.state = SlotState::Held;
        slot.primary = false;
        self.inactive -= 1;
        self.held += 1;
        self.map.remove(&hash);
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

    /// Takes `n` slots (reset first, then evicting victims the policy picks, never one whose
    /// hash is in `protect`), all-or-nothing: on failure nothing changed (victims already
    /// taken from the policy are restored) and the number that could have been provided is
    /// returned. On success the slots are Held; the evicted hashes are appended to `evicted`.
    pub(crate) fn allocate<P: ProtectSet + ?Sized>(
        &mut self,
        n: usize,
        protect: &P,
        tier: TierId,
        registry: &BlockRegistry,
        emit: bool,
        mut evicted: Option<&mut Vec<SequenceHash>>,
    ) -> Result<(Vec<u32>, usize), usize> {
        if self.free.len() + self.inactive < n {
            return Err(self.free.len() + self.inactive);
        }
        let from_free = n.min(self.free.len());
        let mut out: Vec<u32> = Vec::with_capacity(n);
        for _ in 0..from_free {
            let s = self.free.pop().expect("counted above");
            out.push(s);
        }
        while out.len() < n {
            match self.pop_victim(registry, protect) {
                Some(s) => out.push(s),
                None => {
                    // Protected or (lineage) pinned parents: undo, newest first.
                    let available = out.len();
                    let ctx = EvictionCtx::new(&self.hashes, registry);
                    for &s in out[from_free..].iter().rev() {
                        self.policy.restore(s, &ctx);
                    }
                    for &s in out[..from_free].iter().rev() {
                        self.free.push(s);
                    }
                    return Err(available);
                }
            }
        }
        for &s in &out[..from_free] {
            self.slots[s as usize].state = SlotState::Held;
        }
        self.held += from_free;
        for &s in &out[from_free..] {
            self.evict(s, tier, registry, emit);
            if let Some(ev) = evicted.as_deref_mut() {
                ev.push(self.hashes[s as usize]);
            }
        }
        if self.reuse == FreeSlotReuse::Lifo {
            // as if each victim went to the free list and was popped back: last evicted first
            out[from_free..].reverse();
        }
        Ok((out, n - from_free))
    }

    /// Evicts every evictable inactive block to the reset pool; returns how many.
    pub(crate) fn reset_inactive(
        &mut self,
        tier: TierId,
        registry: &BlockRegistry,
        emit: bool,
    ) -> usize {
        let mut n = 0;
        while let Some(s) = self.pop_victim(registry, &[] as &[SequenceHash]) {
            self.evict(s, tier, registry, emit);
            self.release_held(s);
            n += 1;
        }
        n
    }

    /// Drops the inactive primary block `hash` from this tier, as if the eviction policy had
    /// chosen it (a copy found bad: it must never be matched again): out of the policy,
    /// unregistered (a `Removed` event), its slot back to the reset pool. `false`, changing
    /// nothing, when `hash` is not registered here, its block is held (active), or the policy
    /// cannot remove it now (lineage: a parent of registered blocks).
    pub(crate) fn discard_inactive(
        &mut self,
        hash: &SequenceHash,
        tier: TierId,
        registry: &BlockRegistry,
        emit: bool,
    ) -> bool {
        let Some(s) = self.lookup(hash) else {
            return false;
        };
        let slot = &self.slots[s as usize];
        if slot.state != SlotState::Inactive || !slot.primary || !self.policy.can_remove(s) {
            return false;
        }
        let ctx = EvictionCtx::new(&self.hashes, registry);
        self.policy.remove(s, &ctx);
        self.evict(s, tier, registry, emit);
        self.release_held(s);
        true
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
        let slot = &mut self.slots[s as usize];
        debug_assert_eq!(slot.state, SlotState::Held);
        slot.state = SlotState::Active;
        slot.primary = true;
        slot.hit = false;
        slot.generation = slot.generation.wrapping_add(1);
        self.hashes[s as usize] = hash;
        self.held -= 1;
        self.active += 1;
        self.map.insert(hash, s);
        let ctx = EvictionCtx::new(&self.hashes, registry);
        self.policy.on_register(s, &ctx);
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
        slot.primary = false;
        slot.generation = slot.generation.wrapping_add(1);
        self.hashes[s as usize] = hash;
        self.held -= 1;
        self.active += 1;
    }

    /// Makes a registered slot Active for one more strong reference (revives an inactive
    /// one); the caller increments `refs[s]`.
    #[inline]
    pub(crate) fn acquire(&mut self, s: u32, registry: &BlockRegistry) {
        let slot = &mut self.slots[s as usize];
        if slot.state == SlotState::Inactive {
            self.inactive_remove(s, registry);
        } else {
            slot.hit = true;
        }
    }

    /// A recency touch of a registered hash (not a frequency hit); returns whether it is
    /// registered.
    pub(crate) fn touch(&mut self, hash: &SequenceHash, registry: &BlockRegistry) -> bool {
        match self.lookup(hash) {
            Some(s) => {
                let ctx = EvictionCtx::new(&self.hashes, registry);
                self.policy.on_touch(s, &ctx);
                true
            }
            None => false,
        }
    }

    /// Gives the policy a next-use hint for a registered hash; returns whether it is
    /// registered.
    pub(crate) fn hint(
        &mut self,
        hash: &SequenceHash,
        next_use: u64,
        registry: &BlockRegistry,
    ) -> bool {
        match self.lookup(hash) {
            Some(s) => {
                let ctx = EvictionCtx::new(&self.hashes, registry);
                self.policy.on_hint(s, next_use, &ctx);
                true
            }
            None => false,
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
            let slot = &mut self.slots[s as usize];
            slot.state = SlotState::Inactive;
            let hit = std::mem::take(&mut slot.hit);
            self.active -= 1;
            self.inactive += 1;
            let ctx = EvictionCtx::new(&self.hashes, registry);
            if hit {
                self.policy.on_hit(s, &ctx);
            }
            self.policy.on_release(s, &ctx);
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
                if self.map.get(&self.hashes[i]) != Some(&(i as u32)) {
                    return Err(format!("primary slot {i} missing from the hash map"));
                }
            } else if slot.state == SlotState::Inactive {
                return Err(format!("duplicate slot {i} is inactive"));
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
        let slots = &self.slots;
        self.policy.check(&|s| {
            let slot = &slots[s as usize];
            match (slot.primary, slot.state) {
                (true, SlotState::Inactive) => SlotStatus::Evictable,
                (true, SlotState::Active) => SlotStatus::Active,
                _ => SlotStatus::Unregistered,
            }
        })?;
        Ok(c)
    }
}
