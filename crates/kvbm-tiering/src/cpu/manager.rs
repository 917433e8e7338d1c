//! `CpuOffloadingManager`: vLLM 0.33's CPU tier bookkeeping, call for call.
//!
//! # Slot table (why not kvbm-logical)
//!
//! Chunks live in a flat table of `num_chunks` slots indexed by chunk id. An index
//! `OffloadKey → slot` (`cpu::index::SlotIndex`, slot ids only, compared against the
//! table's `keys`) is the only per-key probe on every call (lookup is one probe and one
//! load). vLLM's semantics are integer reference counts on chunks, not block lifetimes:
//!
//! | `ref_cnt` | state | evictable |
//! |---|---|---|
//! | −1 | write in flight (`prepare_store` … `complete_store`) | no; `lookup` = `HIT_PENDING` |
//! | 0 | stored, idle | yes (unless a key of the same `prepare_store` call) |
//! | > 0 | pinned by that many reads (GPU loads, cascades to secondary tiers) | no |
//!
//! Invariants (checked by the proptest): every slot id `< num_allocated` is either on the free
//! list or resident (in the map) exactly once; `num_evictable` = resident slots with
//! `ref_cnt == 0`; `num_write_pending` = resident slots with `ref_cnt == -1`; a slot with
//! `ref_cnt != 0` is never chosen as a victim. Fresh ids are handed out first, then freed ids
//! LIFO. `prepare_store` either returns `None` having evicted and allocated nothing, or
//! evicts exactly the shortfall.
//!
//! kvbm-logical models blocks with RAII lifetimes and sequence-hash registries; mapping the
//! Python integer ref counts, the −1 "not ready" state, ghost lists of evicted keys and the
//! per-request recency hooks onto it would add a second state machine to every call and miss
//! the ≥ 30 M lookups/s goal, so this crate keeps its own table (see the crate README).
//!
//! # Per-request access state
//!
//! vLLM 0.33 keeps, per request, the keys it saw (first-seen order, by group), which it inserted,
//! which it reused, and which store misses were already reported to the policy; at
//! `on_request_finished` the policy gets them in order (LRU: all become most recent, head of the
//! prefix last; ARC: insert-only keys move to the back of their list, reused keys to T2). The
//! same state lives here in a table by request id (`cpu::requests::Requests`: found by context
//! without a string hash on most calls, recycled once finished), dropped at
//! `on_request_finished` and at `reset_cache` (vLLM's generation counter). A key's flags have a
//! place in the record found by one probe: `prepare_store` finds each key's place once and
//! keeps it through its passes (store misses, accesses, insertions).
//!
//! # One store, two shapes
//!
//! A store of several keys (`prepare_store`) runs its steps as passes over the keys, with
//! per-key scratch vectors (`store_general`). A one-key store (a promotion's, once per
//! promoted chunk, from the tiering manager's lookup) runs the same steps for its key alone
//! (`store_one`), without those vectors. The two must agree on every outcome and every piece
//! of state; `tests.rs` drives both with the same calls and compares them.

mod phases;
#[cfg(test)]
mod tests;
pub use phases::{FinishedAccess, StorePlan};

use crate::cpu::index::SlotIndex;
use crate::cpu::order::LinkedKeySet;
use crate::cpu::policy::{CachePolicyKind, Policy, SlotView};
use crate::cpu::requests::Requests;
use crate::error::{Result, TieringError};
use crate::key::{OffloadKey, get_offload_group_idx};
use crate::stats::{OffloadingConnectorStats, names};
use crate::types::{
    CacheHitSource, Contract, CpuLoadStoreSpec, LoadStoreSpec, LookupResult, Medium,
    OffloadingEvent, PrepareStoreOutput, ReqContext, RequestOffloadingContext,
};

/// Configuration of a CPU tier.
#[derive(Clone, Debug)]
pub struct CpuManagerConfig {
    /// Number of chunk slots.
    pub num_chunks: usize,
    /// Eviction policy.
    pub policy: CachePolicyKind,
    /// Record stored/removed events (inert when false: nobody drains `take_events`).
    pub enable_events: bool,
    /// Store only keys offered at least this many times (≥ 2 enables the filter).
    pub store_threshold: u32,
    /// Capacity of the store-threshold tracker.
    pub max_tracker_size: usize,
    /// The vLLM release line whose contract the manager follows (default 0.33).
    pub contract: Contract,
    /// The medium its events name (`CPU`; `STORAGE` for a manager of disk slots, as the
    /// direct disk path's).
    pub medium: Medium,
}

impl CpuManagerConfig {
    /// `num_chunks` slots, LRU, no events, no threshold.
    pub fn new(num_chunks: usize) -> Self {
        Self {
            num_chunks,
            policy: CachePolicyKind::Lru,
            enable_events: false,
            store_threshold: 1,
            max_tracker_size: 64_000,
            contract: Contract::V0_33,
            medium: Medium::Cpu,
        }
    }
    /// Sets the medium its events name.
    pub fn medium(mut self, m: Medium) -> Self {
        self.medium = m;
        self
    }
    /// Sets the vLLM contract followed.
    pub fn contract(mut self, c: Contract) -> Self {
        self.contract = c;
        self
    }
    /// Sets the policy.
    pub fn policy(mut self, p: CachePolicyKind) -> Self {
        self.policy = p;
        self
    }
    /// Enables events.
    pub fn events(mut self, on: bool) -> Self {
        self.enable_events = on;
        self
    }
    /// Sets the store threshold and tracker size.
    pub fn store_threshold(mut self, threshold: u32, max_tracker_size: usize) -> Self {
        self.store_threshold = threshold;
        self.max_tracker_size = max_tracker_size;
        self
    }
}

const SEEN: u8 = 1;
const INSERTED: u8 = 2;
const REUSED: u8 = 4;
const STORE_MISS: u8 = 8;
/// The key counted toward the store threshold in this request (vLLM 0.34's `counted_keys`).
const COUNTED: u8 = 16;

/// State of one slot as seen from outside (tests, invariants).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SlotState {
    /// Never handed out (id ≥ high-water mark).
    Unallocated,
    /// On the free list.
    Free,
    /// Write in flight (`ref_cnt == -1`).
    WritePending,
    /// Stored and evictable (`ref_cnt == 0`).
    Evictable,
    /// Pinned by reads (`ref_cnt > 0`).
    Pinned(i32),
}

/// vLLM's `CPUOffloadingManager`.
pub struct CpuOffloadingManager {
    num_chunks: usize,
    num_allocated: usize,
    free_list: Vec<u32>,
    index: SlotIndex,
    keys: Vec<OffloadKey>,
    ref_cnt: Vec<i32>,
    protect: Vec<u64>,
    stamp: u64,
    policy: Policy,
    policy_kind: CachePolicyKind,
    events: Option<Vec<OffloadingEvent>>,
    num_evictable: usize,
    num_write_pending: usize,
    store_threshold: u32,
    max_tracker_size: usize,
    counts: Option<LinkedKeySet>,
    stores_skipped: u64,
    contract: Contract,
    /// The medium its events name.
    medium: Medium,
    /// Slots that hold bytes whose keys this manager does not know (a disk's blocks restored
    /// from its journal: [`hold_slots`](Self::hold_slots)): out of the index, the policy and the
    /// free list until adopted by their key or released for room.
    held: hashbrown::HashSet<u32>,
    /// Slots of failed writes whose release waits for their writer (vLLM 0.34
    /// `defer_write_release`): out of the index, the policy and the free list, still counted
    /// as write-pending.
    deferred: hashbrown::HashSet<u32>,
    /// Per key of the offer being stored: whether its request had counted it before
    /// ([`record_offer`](Self::record_offer); empty unless 0.34 counts once per request).
    scratch_counted: Vec<bool>,
    allocation_sizes: Vec<usize>,
    requests: Requests,
    scratch: Vec<u32>,
    scratch_class: Vec<u8>,
    /// Scratch of `store_into`: store misses not yet reported.
    scratch_misses: Vec<OffloadKey>,
    /// `store_into`'s places of the keys in the request's flags (`u32::MAX`: not recorded).
    scratch_places: Vec<u32>,
    /// `on_request_finished`'s per-key facts for the policy, refilled per request.
    scratch_finished: Vec<(OffloadKey, Option<u32>, bool, bool)>,
    /// Scratch of `store_into`: the slots of the keys already resident.
    scratch_resident: Vec<u32>,
    /// Slots handed out by `allocate_slots` and not yet inserted (see `phases`).
    reserved: Vec<u32>,
    /// The slots of the `HIT`s answered since the last `prepare_load` (at most
    /// [`HIT_HINTS_MAX`]): its hints, used only where `keys[slot]` is the key (see
    /// [`slot_of_hit`](Self::slot_of_hit)).
    hit_hints: Vec<u32>,
}

/// The slot `hints[i]` names for `k` (from [`CpuOffloadingManager::tail_hints`]), if it is
/// `k`'s hint: still to be checked against the slot table (`hinted_slot`).
#[inline]
fn tail_hint(hints: &[(OffloadKey, u32)], i: usize, k: &OffloadKey) -> Option<u32> {
    hints.get(i).filter(|(h, _)| h == k).map(|&(_, s)| s)
}

/// Most `HIT` slots kept between two `prepare_load`s (a caller that looks keys up and loads
/// none makes the list start over).
const HIT_HINTS_MAX: usize = 1024;

/// Most hints skipped to find one key's (vLLM loads a subsequence of its lookups: the hits).
const HIT_HINTS_SKIP: usize = 4;

impl CpuOffloadingManager {
    /// Whether a key not yet stored has been requested often enough to store
    /// (`store_threshold`; always, without a tracker). One rule for the one-call store and
    /// the step-by-step one ([`phases`]).
    #[inline]
    fn passes_store_threshold(&self, k: &OffloadKey) -> bool {
        match &self.counts {
            Some(c) => c.get(k).unwrap_or(0) >= self.store_threshold,
            None => true,
        }
    }

    /// A manager of `config.num_chunks` slots.
    pub fn new(config: CpuManagerConfig) -> Self {
        let n = config.num_chunks;
        Self {
            num_chunks: n,
            num_allocated: 0,
            free_list: Vec::with_capacity(n),
            index: SlotIndex::with_capacity(n),
            keys: vec![OffloadKey::VACANT; n],
            ref_cnt: vec![0; n],
            protect: vec![0; n],
            stamp: 0,
            policy: Policy::new(config.policy, n),
            policy_kind: config.policy,
            events: config.enable_events.then(Vec::new),
            num_evictable: 0,
            num_write_pending: 0,
            store_threshold: config.store_threshold,
            max_tracker_size: config.max_tracker_size,
            counts: (config.store_threshold >= 2).then(LinkedKeySet::new),
            stores_skipped: 0,
            contract: config.contract,
            medium: config.medium,
            held: hashbrown::HashSet::new(),
            deferred: hashbrown::HashSet::new(),
            scratch_counted: Vec::new(),
            allocation_sizes: Vec::new(),
            requests: Requests::default(),
            scratch: Vec::new(),
            scratch_class: Vec::new(),
            scratch_misses: Vec::new(),
            scratch_places: Vec::new(),
            scratch_finished: Vec::new(),
            scratch_resident: Vec::new(),
            reserved: Vec::new(),
            hit_hints: Vec::new(),
        }
    }

    /// Capacity in chunks.
    pub fn num_chunks(&self) -> usize {
        self.num_chunks
    }
    /// The policy in use.
    pub fn policy_kind(&self) -> CachePolicyKind {
        self.policy_kind
    }
    /// Fresh-id high-water mark.
    pub fn num_allocated(&self) -> usize {
        self.num_allocated
    }
    /// The free list (LIFO: last is reused first).
    pub fn free_list(&self) -> &[u32] {
        &self.free_list
    }
    /// Resident chunks with `ref_cnt == 0`.
    pub fn num_evictable(&self) -> usize {
        self.num_evictable
    }
    /// Resident chunks with a write in flight.
    pub fn num_write_pending(&self) -> usize {
        self.num_write_pending
    }
    /// Number of resident keys.
    pub fn len(&self) -> usize {
        self.index.len()
    }
    /// Whether nothing is resident.
    pub fn is_empty(&self) -> bool {
        self.index.is_empty()
    }
    /// Slot and ref count of a key.
    pub fn chunk(&self, key: &OffloadKey) -> Option<(u32, i32)> {
        self.index
            .get(&self.keys, key)
            .map(|s| (s, self.ref_cnt[s as usize]))
    }
    /// Resident keys in eviction order (LRU: least recent first; ARC: T1 then T2).
    pub fn eviction_order(&self) -> Vec<OffloadKey> {
        self.policy
            .order()
            .into_iter()
            .map(|s| self.keys[s as usize])
            .collect()
    }
    /// Evictable resident keys in eviction order.
    pub fn evictable_order(&self) -> Vec<OffloadKey> {
        self.policy
            .order()
            .into_iter()
            .filter(|&s| self.ref_cnt[s as usize] == 0)
            .map(|s| self.keys[s as usize])
            .collect()
    }
    /// ARC state: (T1 keys, T2 keys, B1 keys, B2 keys, target_t1_size); `None` for LRU.
    #[allow(clippy::type_complexity)]
    pub fn arc_state(
        &self,
    ) -> Option<(
        Vec<OffloadKey>,
        Vec<OffloadKey>,
        Vec<OffloadKey>,
        Vec<OffloadKey>,
        f64,
    )> {
        let (t1, t2, b1, b2, t) = self.policy.arc_state()?;
        let k = |v: Vec<u32>| v.into_iter().map(|s| self.keys[s as usize]).collect();
        Some((k(t1), k(t2), b1, b2, t))
    }
    /// Sets ARC's `target_t1_size` (test setup); no-op for LRU.
    #[doc(hidden)]
    pub fn set_arc_target(&mut self, t: f64) {
        self.policy.set_arc_target(t);
    }
    /// Store-threshold tracker count of a key.
    pub fn tracker_count(&self, key: &OffloadKey) -> Option<u32> {
        self.counts.as_ref().and_then(|c| c.get(key))
    }

    /// How many keys the store-threshold tracker holds (`None` when the threshold is below 2
    /// and there is no tracker: vLLM's `counts is None`).
    pub fn tracker_len(&self) -> Option<usize> {
        self.counts.as_ref().map(|c| c.len())
    }

    /// Stores the threshold filter skipped since the last `stats` (vLLM's
    /// `stores_skipped_in_current_batch`).
    pub fn stores_skipped(&self) -> u64 {
        self.stores_skipped
    }

    /// The state of every slot id (invariant checks).
    pub fn slot_states(&self) -> Vec<SlotState> {
        let mut st = vec![SlotState::Unallocated; self.num_chunks];
        for &s in &self.free_list {
            st[s as usize] = SlotState::Free;
        }
        for s in self.index.slots() {
            st[s as usize] = match self.ref_cnt[s as usize] {
                -1 => SlotState::WritePending,
                0 => SlotState::Evictable,
                n => SlotState::Pinned(n),
            };
        }
        st
    }

    /// Checks the slot-table invariants; returns a description of the first violation.
    pub fn check_invariants(&self) -> std::result::Result<(), String> {
        let mut seen = vec![0u8; self.num_chunks];
        for &s in &self.free_list {
            if s as usize >= self.num_allocated {
                return Err(format!(
                    "free slot {s} above high-water {}",
                    self.num_allocated
                ));
            }
            seen[s as usize] += 1;
        }
        for &s in self.reserved.iter().chain(&self.held) {
            seen[s as usize] += 1;
        }
        // A slot holds a key exactly when it is resident (the slot hints rely on it).
        for (s, k) in self.keys.iter().enumerate() {
            if seen[s] > 0 && *k != OffloadKey::VACANT {
                return Err(format!("free, reserved or held slot {s} still holds {k}"));
            }
            if s >= self.num_allocated && *k != OffloadKey::VACANT {
                return Err(format!("unallocated slot {s} holds {k}"));
            }
        }
        for s in self.index.slots() {
            if self.keys[s as usize] == OffloadKey::VACANT {
                return Err(format!("resident slot {s} holds no key"));
            }
        }
        let (mut ev, mut wp) = (0, 0);
        for s in self.index.slots() {
            if s as usize >= self.num_allocated {
                return Err(format!("resident slot {s} above high-water"));
            }
            // The slot's key finds the slot (not a stale key, not a second slot of the key).
            if self.index.get(&self.keys, &self.keys[s as usize]) != Some(s) {
                return Err(format!("slot {s} key mismatch"));
            }
            seen[s as usize] += 1;
            match self.ref_cnt[s as usize] {
                -1 => wp += 1,
                0 => ev += 1,
                n if n > 0 => {}
                n => return Err(format!("slot {s} ref_cnt {n}")),
            }
        }
        for (s, &c) in seen.iter().enumerate().take(self.num_allocated) {
            if c != 1 {
                return Err(format!("slot {s} is in {c} states"));
            }
        }
        if ev != self.num_evictable || wp != self.num_write_pending {
            return Err(format!(
                "counters evictable {} (actual {ev}) write_pending {} (actual {wp})",
                self.num_evictable, self.num_write_pending
            ));
        }
        let order = self.policy.order();
        if order.len() != self.index.len() {
            return Err(format!(
                "policy holds {} slots, map {}",
                order.len(),
                self.index.len()
            ));
        }
        Ok(())
    }

    #[inline]
    fn num_free(&self) -> usize {
        self.free_list.len() + self.num_chunks - self.num_allocated
    }

    fn spec(ids: impl Iterator<Item = u32>) -> LoadStoreSpec {
        LoadStoreSpec::Cpu(CpuLoadStoreSpec {
            chunk_ids: ids.map(|s| s as i32).collect(),
        })
    }

    /// vLLM `_record_request_cache_access(keys, reused_keys=...)`: each key with whether it is
    /// also one of the reused keys (vLLM passes those as a second list; every caller here has
    /// them among `keys`, in the same order, so each key takes one flags probe, not two).
    ///
    /// Same flags as vLLM's two passes: a first access (no `SEEN` yet) is recorded in order and
    /// told to the policy; a reused key the request did not insert is `REUSED`. The policy call
    /// reads no flags, so setting `REUSED` in the first pass changes nothing it sees.
    fn record_access(&mut self, keys: impl Iterator<Item = (OffloadKey, bool)>, ctx: &ReqContext) {
        self.record_access_at(keys.map(|(k, reused)| (k, None, reused)), ctx);
    }

    /// As [`record_access`](Self::record_access), each key with its place in the request's
    /// flags when the caller found it already (`None`: found here). Returns the request's
    /// rank as it leaves it: a store inserting its keys next hands it to
    /// [`insert_new`](Self::insert_new) without finding the record again.
    fn record_access_at(
        &mut self,
        keys: impl Iterator<Item = (OffloadKey, Option<usize>, bool)>,
        ctx: &ReqContext,
    ) -> Option<u64> {
        let state = self.requests.access(ctx);
        let positional = ctx.has_positions();
        let mut new_keys: Vec<(OffloadKey, Option<u32>, Option<u64>)> = Vec::new();
        let mut any_new = false;
        for (k, place, reused) in keys {
            let f = match place {
                Some(p) => state.at(p),
                None => state.flags_mut(k),
            };
            if reused && *f & INSERTED == 0 {
                *f |= REUSED;
            }
            if *f & SEEN != 0 {
                continue;
            }
            *f |= SEEN;
            state.order.push(k);
            any_new = true;
            if positional {
                new_keys.push((
                    k,
                    self.index.get(&self.keys, &k),
                    ctx.get_offload_key_position(&k),
                ));
            }
        }
        if any_new {
            // Without positions only the request rank is allocated (LRU); no key moves.
            self.policy
                .on_request_access(&self.keys, &new_keys, &mut state.req_rank);
        }
        state.req_rank
    }

    /// vLLM's `on_request_finished` grouping: keys by KV-cache group (groups by index), each
    /// group sorted by position when every key of it has one, else in first-seen order.
    /// The KV-cache group of every key of `order`, when they all share one (the usual case).
    fn single_group(order: &[OffloadKey]) -> Option<u32> {
        order
            .first()
            .map(get_offload_group_idx)
            .filter(|&g| order.iter().all(|k| get_offload_group_idx(k) == g))
    }

    fn key_groups(order: &[OffloadKey], ctx: &ReqContext) -> Vec<Vec<OffloadKey>> {
        let positional = ctx.has_positions();
        // One KV-cache group (the usual case): the order as it is, without a push per key.
        let single = Self::single_group(order);
        let mut groups: Vec<(u32, Vec<OffloadKey>)> = match single {
            Some(g) => vec![(g, order.to_vec())],
            None => {
                let mut groups: Vec<(u32, Vec<OffloadKey>)> = Vec::new();
                for k in order {
                    let g = get_offload_group_idx(k);
                    match groups.iter_mut().find(|(gg, _)| *gg == g) {
                        Some((_, v)) => v.push(*k),
                        None => groups.push((g, vec![*k])),
                    }
                }
                groups
            }
        };
        groups.sort_by_key(|(g, _)| *g);
        groups
            .into_iter()
            .map(|(_, mut v)| {
                if positional {
                    let pos: Vec<Option<u64>> =
                        v.iter().map(|k| ctx.get_offload_key_position(k)).collect();
                    if pos.iter().all(Option::is_some) {
                        let mut z: Vec<(u64, OffloadKey)> =
                            pos.into_iter().flatten().zip(v.iter().copied()).collect();
                        z.sort_by_key(|(p, _)| *p);
                        v = z.into_iter().map(|(_, k)| k).collect();
                    }
                }
                v
            })
            .collect()
    }

    /// vLLM's `order_request_keys`: the groups concatenated, sorted again by position when
    /// every key has one.
    fn order_request_keys(groups: &[Vec<OffloadKey>], ctx: &ReqContext) -> Vec<OffloadKey> {
        let mut ordered: Vec<OffloadKey> = Vec::with_capacity(groups.iter().map(Vec::len).sum());
        for g in groups {
            ordered.extend_from_slice(g);
        }
        if ctx.has_positions() {
            let all: Option<Vec<u64>> = ordered
                .iter()
                .map(|k| ctx.get_offload_key_position(k))
                .collect();
            if let Some(p) = all {
                let mut z: Vec<(u64, OffloadKey)> = p.into_iter().zip(ordered).collect();
                z.sort_by_key(|(p, _)| *p);
                ordered = z.into_iter().map(|(_, k)| k).collect();
            }
        }
        ordered
    }

    /// The store-threshold pass of an offer (vLLM `_record_accesses`), with a tracker. Under
    /// 0.34 a key its request already counted moves to the back without counting again, and
    /// [`scratch_counted`](Self::scratch_counted) is left holding, per key, whether it had
    /// been counted before this offer (read by [`skip_counts`](Self::skip_counts));
    /// [`mark_counted`](Self::mark_counted) then counts the offer's keys for the request.
    fn record_offer(&mut self, keys: &[OffloadKey], ctx: &ReqContext) {
        let mut counted = std::mem::take(&mut self.scratch_counted);
        counted.clear();
        if self.contract.counts_once_per_request() {
            let state = self.requests.access(ctx);
            counted.extend(keys.iter().map(|k| state.flags_of(k) & COUNTED != 0));
        }
        self.record_tracker(keys, &counted);
        self.scratch_counted = counted;
    }

    /// Whether the skipped store of the offer's `i`th key counts (0.34: once per request).
    #[inline]
    fn skip_counts(&self, i: usize) -> bool {
        !self.scratch_counted.get(i).copied().unwrap_or(false)
    }

    /// 0.34: the offer's keys are counted for the request (vLLM `counted_keys.update`).
    fn mark_counted(&mut self, keys: &[OffloadKey], ctx: &ReqContext) {
        if self.counts.is_some() && self.contract.counts_once_per_request() {
            let state = self.requests.access(ctx);
            for k in keys {
                state.set(*k, COUNTED);
            }
        }
    }

    /// vLLM `_record_accesses` (store-threshold tracker); `counted[i]`: the `i`th key was
    /// counted by its request before (it moves to the back without a count; empty: none was).
    fn record_tracker(&mut self, keys: &[OffloadKey], counted: &[bool]) {
        let Some(counts) = self.counts.as_mut() else {
            return;
        };
        let mut protected: hashbrown::HashSet<OffloadKey> = hashbrown::HashSet::new();
        for (i, k) in keys.iter().enumerate() {
            if let Some(c) = counts.get(k) {
                counts.move_to_back(k);
                if !counted.get(i).copied().unwrap_or(false) {
                    counts.set(k, c + 1);
                }
                protected.insert(*k);
            }
        }
        let mut num_unprotected = counts.len() - protected.len();
        for k in keys {
            if counts.contains(k) {
                continue;
            }
            if counts.len() >= self.max_tracker_size {
                if num_unprotected == 0 {
                    continue;
                }
                counts.pop_front();
                num_unprotected -= 1;
            }
            counts.insert(*k, 1);
        }
    }

    /// Pins chunks for reading; `record_access` false for cascade reads (no request recency).
    pub(crate) fn prepare_load_inner(
        &mut self,
        call: &'static str,
        keys: &[OffloadKey],
        ctx: &ReqContext,
        record_access: bool,
    ) -> Result<LoadStoreSpec> {
        // The slots found while validating are the ones pinned: the lookups' hints where they
        // hold, else one probe per key.
        let hints = std::mem::take(&mut self.hit_hints);
        let mut next = 0;
        let mut ids = Vec::with_capacity(keys.len());
        for k in keys {
            match self.slot_of_hit(k, &hints, &mut next) {
                None => return Err(TieringError::UnknownKey { call, key: *k }),
                Some(s) if self.ref_cnt[s as usize] < 0 => {
                    return Err(TieringError::KeyState {
                        call,
                        key: *k,
                        state: "not ready (write in flight)",
                    });
                }
                Some(s) => ids.push(s as i32),
            }
        }
        self.recycle_hit_hints(hints);
        for &s in &ids {
            let rc = &mut self.ref_cnt[s as usize];
            if *rc == 0 {
                self.num_evictable -= 1;
            }
            *rc += 1;
        }
        if record_access {
            self.record_access(keys.iter().map(|k| (*k, true)), ctx);
            let known = &mut self.requests.access(ctx).known;
            known.extend(keys.iter().zip(&ids).map(|(k, &s)| (*k, s as u32)));
        }
        Ok(LoadStoreSpec::Cpu(CpuLoadStoreSpec { chunk_ids: ids }))
    }

    /// The slots of `keys`, co-indexed, into `out` (cleared first): one probe per key, for a
    /// caller that then completes and pins them by slot ([`complete_store_at`](Self::complete_store_at),
    /// [`pin_slots`](Self::pin_slots)) without probing again. `Err` names the first key that is
    /// not resident (`out` then holds the slots before it).
    pub(crate) fn resident_slots(
        &self,
        keys: &[OffloadKey],
        ctx: &ReqContext,
        out: &mut Vec<u32>,
    ) -> std::result::Result<(), OffloadKey> {
        out.clear();
        out.reserve(keys.len());
        // The slots the request's last `prepare_store` assigned these very keys (the usual
        // `complete_store` of its `keys_to_store`) are the hints, as for `complete_load`.
        let hints = self.tail_hints(ctx, keys.len());
        for (i, k) in keys.iter().enumerate() {
            out.push(self.hinted_slot(k, tail_hint(hints, i, k)).ok_or(*k)?);
        }
        Ok(())
    }

    /// The last `n` slot hints of `ctx`'s request (`RequestAccess::known`), empty where it
    /// has fewer: the slots its last call of `n` keys pinned or assigned, in that call's order.
    fn tail_hints(&self, ctx: &ReqContext, n: usize) -> &[(OffloadKey, u32)] {
        let known = self.requests.get(ctx).map_or(&[][..], |r| &r.known[..]);
        known
            .len()
            .checked_sub(n)
            .map_or(&[][..], |from| &known[from..])
    }

    /// Pins resident, ready chunks by slot (the cascade of keys `complete_store_at` just made
    /// ready). Returns the chunk ids, co-indexed with `slots`.
    pub(crate) fn pin_slots(&mut self, slots: &[u32]) -> Vec<i32> {
        let mut ids = Vec::with_capacity(slots.len());
        for &s in slots {
            let rc = &mut self.ref_cnt[s as usize];
            debug_assert!(*rc >= 0, "pin_slots of a chunk still being written");
            if *rc == 0 {
                self.num_evictable -= 1;
            }
            *rc += 1;
            ids.push(s as i32);
        }
        ids
    }

    /// Unpins cascade reads in one pass (the manager pinned them itself); a key that is not
    /// pinned (only possible after a misreported job) is skipped and counted. `hints`: the
    /// slot each key was pinned in (the job's chunk ids, co-indexed with `keys`; empty for
    /// none), taken where it still holds its key, so the usual completion probes nothing.
    pub(crate) fn unpin_reads(&mut self, keys: &[OffloadKey], hints: &[i32]) -> usize {
        let mut skipped = 0;
        for (i, k) in keys.iter().enumerate() {
            match self.hinted_slot(k, slot_hint(hints, i)) {
                Some(s) if self.ref_cnt[s as usize] > 0 => {
                    let rc = &mut self.ref_cnt[s as usize];
                    *rc -= 1;
                    if *rc == 0 {
                        self.num_evictable += 1;
                    }
                }
                _ => skipped += 1,
            }
        }
        skipped
    }

    /// Unpins `keys`, each found once (validated first: an error changes nothing). With the
    /// request's context, the slots its last `prepare_load` of these very keys pinned are
    /// the hints (`RequestAccess::known`), so the usual completion probes nothing.
    pub(crate) fn complete_load_inner(
        &mut self,
        call: &'static str,
        keys: &[OffloadKey],
        ctx: Option<&ReqContext>,
    ) -> Result<()> {
        let hints = ctx.map_or(&[][..], |c| self.tail_hints(c, keys.len()));
        let mut slots: Vec<u32> = Vec::with_capacity(keys.len());
        for (i, k) in keys.iter().enumerate() {
            match self.hinted_slot(k, tail_hint(hints, i, k)) {
                None => return Err(TieringError::UnknownKey { call, key: *k }),
                Some(s) if self.ref_cnt[s as usize] <= 0 => {
                    return Err(TieringError::KeyState {
                        call,
                        key: *k,
                        state: "not being read (ref_cnt is already 0)",
                    });
                }
                Some(s) => slots.push(s),
            }
        }
        for s in slots {
            let rc = &mut self.ref_cnt[s as usize];
            *rc -= 1;
            if *rc == 0 {
                self.num_evictable += 1;
            }
        }
        Ok(())
    }

    /// Releases every key of a failed write without validation (used by the tiering manager for
    /// promotion outcomes).
    pub(crate) fn store_inner(
        &mut self,
        keys: &[OffloadKey],
        ctx: &ReqContext,
    ) -> Option<PrepareStoreOutput> {
        let mut out = PrepareStoreOutput::default();
        self.store_into(keys, ctx, &mut out).then_some(out)
    }

    /// [`store_inner`](Self::store_inner) into `out`, whose vectors are cleared and refilled
    /// (their capacity kept: a caller storing one key at a time, as a promotion does, then
    /// allocates nothing); `false` where `store_inner` answers `None`.
    pub(crate) fn store_into(
        &mut self,
        keys: &[OffloadKey],
        ctx: &ReqContext,
        out: &mut PrepareStoreOutput,
    ) -> bool {
        // One key (a promotion's store, once per promoted chunk): the same steps without the
        // per-key passes.
        if let [k] = keys {
            return self.store_one(k, ctx, out);
        }
        self.store_general(keys, ctx, out)
    }

    /// [`store_into`](Self::store_into) for any number of keys (the one-key case included:
    /// the tests hold [`store_one`](Self::store_one) to it).
    fn store_general(
        &mut self,
        keys: &[OffloadKey],
        ctx: &ReqContext,
        out: &mut PrepareStoreOutput,
    ) -> bool {
        // The per-key scratches are taken out of `self` for the call (so passes over them
        // borrow no part of the manager) and put back once, whatever the outcome.
        let mut class = std::mem::take(&mut self.scratch_class);
        let mut places = std::mem::take(&mut self.scratch_places);
        let stored = self.store_with(keys, ctx, out, &mut class, &mut places);
        self.scratch_class = class;
        self.scratch_places = places;
        stored
    }

    /// [`store_with`](Self::store_with) for the one key `k`, step for step: the same
    /// classification, request flags, policy calls, eviction, event and slot, and the same
    /// `out` on either outcome, without the scratch vectors of its per-key passes (a one-key
    /// store is a promotion's, once per promoted chunk). `tests.rs` holds the two together.
    fn store_one(
        &mut self,
        k: &OffloadKey,
        ctx: &ReqContext,
        out: &mut PrepareStoreOutput,
    ) -> bool {
        let mut ids = Self::reset_store_output(out);
        if self.counts.is_some() {
            self.record_offer(std::slice::from_ref(k), ctx);
        }
        // Classify: to store, ready existing (reused), or neither (pending, or filtered out).
        let (to_store, reused) = match self.index.get(&self.keys, k) {
            None => {
                let pass = self.passes_store_threshold(k);
                if !pass && self.counts.is_some() && self.skip_counts(0) {
                    self.stores_skipped += 1;
                }
                (pass, false)
            }
            Some(s) => (false, self.ref_cnt[s as usize] >= 0),
        };
        self.mark_counted(std::slice::from_ref(k), ctx);
        if !to_store && !reused {
            // Neither recorded nor stored (`store_with`'s class 0); the request's record is
            // started all the same, as there.
            self.requests.access(ctx);
            out.store_spec = LoadStoreSpec::Cpu(CpuLoadStoreSpec { chunk_ids: ids });
            return true;
        }
        let place = {
            let arc = matches!(self.policy, Policy::Arc(_));
            let state = self.requests.access(ctx);
            state.reserve(1);
            let p = state.place(*k);
            if to_store {
                let flags = state.at(p);
                let first_miss = *flags & STORE_MISS == 0;
                *flags |= STORE_MISS;
                if arc && first_miss {
                    self.policy.on_store_miss_one(k);
                }
            }
            p
        };
        let mut rank = self.record_access_at(std::iter::once((*k, Some(place), reused)), ctx);
        if !to_store {
            out.store_spec = LoadStoreSpec::Cpu(CpuLoadStoreSpec { chunk_ids: ids });
            return true;
        }
        out.keys_to_store.push(*k);
        self.allocation_sizes.push(1);
        if self.num_free() == 0 {
            // The key is not resident: nothing of this call is protected.
            self.scratch_resident.clear();
            if !self.make_room(1, &mut out.evicted_keys) {
                return false;
            }
        }
        let s = self.next_free_slot();
        self.insert_new(k, s, ctx, ctx.has_positions(), &mut rank);
        let state = self.requests.access(ctx);
        state.req_rank = rank;
        *state.at(place) |= INSERTED;
        state.known.push((*k, s));
        ids.push(s as i32);
        self.num_write_pending += 1;
        out.store_spec = LoadStoreSpec::Cpu(CpuLoadStoreSpec { chunk_ids: ids });
        true
    }

    /// [`store_general`](Self::store_general)'s body. `class`: each key's class (1 = to store,
    /// 2 = ready existing, 0 = pending existing / filtered); `places`: each recorded key's
    /// place in the request's flags (`u32::MAX`: not recorded). Both are refilled here.
    fn store_with(
        &mut self,
        keys: &[OffloadKey],
        ctx: &ReqContext,
        out: &mut PrepareStoreOutput,
        class: &mut Vec<u8>,
        places: &mut Vec<u32>,
    ) -> bool {
        let mut ids = Self::reset_store_output(out);
        if self.counts.is_some() {
            self.record_offer(keys, ctx);
        }
        // Classify: 1 = to store, 2 = ready existing, 0 = pending existing / filtered.
        class.clear();
        class.reserve(keys.len());
        let keys_to_store = &mut out.keys_to_store;
        keys_to_store.reserve(keys.len());
        // The slots of the keys already resident: protected from this call's eviction below
        // (nothing between here and there changes the index).
        self.scratch_resident.clear();
        let mut skipped = 0u64;
        for (i, k) in keys.iter().enumerate() {
            match self.index.get(&self.keys, k) {
                None => {
                    let pass = self.passes_store_threshold(k);
                    if pass {
                        keys_to_store.push(*k);
                        class.push(1);
                    } else {
                        skipped += u64::from(self.skip_counts(i));
                        class.push(0);
                    }
                }
                Some(s) if self.ref_cnt[s as usize] >= 0 => {
                    self.scratch_resident.push(s);
                    class.push(2);
                }
                Some(s) => {
                    self.scratch_resident.push(s);
                    class.push(0);
                }
            }
        }
        if self.counts.is_some() {
            self.stores_skipped += skipped;
            self.mark_counted(keys, ctx);
        }
        // Each recorded key's place in the request's flags, found once for the passes below
        // (after the `reserve`, no key of this call grows the table, so the places stay
        // valid: `RequestAccess`).
        places.clear();
        {
            let state = self.requests.access(ctx);
            state.reserve(keys.len());
            places.extend(keys.iter().zip(class.iter()).map(|(k, &c)| {
                if c == 0 {
                    u32::MAX
                } else {
                    state.place(*k) as u32
                }
            }));
            // Store misses not yet reported for this request (all read before any is
            // marked: a key given twice is a miss twice, as in vLLM), reported in reverse.
            // Only ARC's policy hears them; the flags are kept for either.
            if matches!(self.policy, Policy::Arc(_)) {
                let mut misses = std::mem::take(&mut self.scratch_misses);
                misses.clear();
                for ((k, &c), &p) in keys.iter().zip(class.iter()).zip(places.iter()) {
                    if c == 1 && *state.at(p as usize) & STORE_MISS == 0 {
                        misses.push(*k);
                    }
                }
                for k in misses.iter().rev() {
                    self.policy.on_store_miss_one(k);
                }
                self.scratch_misses = misses;
            }
            for (&c, &p) in class.iter().zip(places.iter()) {
                if c == 1 {
                    *state.at(p as usize) |= STORE_MISS;
                }
            }
        }
        // The ready existing keys (class 2) are the reused ones, in the same order.
        let recorded = keys
            .iter()
            .zip(class.iter())
            .zip(places.iter())
            .filter(|((_, c), _)| **c != 0)
            .map(|((k, c), &p)| (*k, Some(p as usize), *c == 2));
        let mut rank = self.record_access_at(recorded, ctx);

        if keys_to_store.is_empty() {
            out.store_spec = LoadStoreSpec::Cpu(CpuLoadStoreSpec { chunk_ids: ids });
            return true;
        }
        self.allocation_sizes.push(keys_to_store.len());
        let n = keys_to_store.len();
        let free = self.num_free();
        if n > free && !self.make_room(n - free, &mut out.evicted_keys) {
            return false;
        }
        ids.reserve(n);
        let positional = ctx.has_positions();
        for k in &out.keys_to_store {
            let s = self.next_free_slot();
            self.insert_new(k, s, ctx, positional, &mut rank);
            ids.push(s as i32);
        }
        // The request's record (the places found above stay valid: no key was added to it).
        let state = self.requests.access(ctx);
        state.req_rank = rank;
        // The keys to store are the class-1 keys, in order: their places come the same way.
        let store_places = class
            .iter()
            .zip(places.iter())
            .filter(|(c, _)| **c == 1)
            .map(|(_, &p)| p);
        for ((k, p), &s) in out.keys_to_store.iter().zip(store_places).zip(&ids) {
            *state.at(p as usize) |= INSERTED;
            state.known.push((*k, s as u32));
        }
        self.num_write_pending += n;
        out.store_spec = LoadStoreSpec::Cpu(CpuLoadStoreSpec { chunk_ids: ids });
        true
    }

    /// A store's `out` emptied for refilling (its vectors' capacity kept), and its chunk-id
    /// vector taken out of it to be filled and put back.
    #[inline]
    fn reset_store_output(out: &mut PrepareStoreOutput) -> Vec<i32> {
        let mut ids = match std::mem::replace(&mut out.store_spec, Self::spec(std::iter::empty())) {
            LoadStoreSpec::Cpu(c) => c.chunk_ids,
            _ => Vec::new(),
        };
        ids.clear();
        out.keys_to_store.clear();
        out.evicted_keys.clear();
        ids
    }

    /// Evicts `need` chunks for a store, none of the slots in `scratch_resident` (the store's
    /// own resident keys): each victim leaves the index, its slot is freed and its key pushed
    /// to `evicted`, with one eviction event for them all. `false`, with nothing evicted,
    /// where the policy cannot find that many.
    #[inline]
    fn make_room(&mut self, need: usize, evicted: &mut Vec<OffloadKey>) -> bool {
        if need > self.num_evictable {
            return false;
        }
        self.stamp += 1;
        for &s in &self.scratch_resident {
            self.protect[s as usize] = self.stamp;
        }
        evicted.reserve(need);
        if !self.evict_unprotected(need, |k, _| evicted.push(k)) {
            return false;
        }
        if !evicted.is_empty()
            && let Some(ev) = self.events.as_mut()
        {
            ev.push(OffloadingEvent::new(evicted.clone(), self.medium, true));
        }
        true
    }

    /// Evicts the `n` victims the policy chooses among idle slots not stamped with the current
    /// `stamp` (the caller stamps the slots it protects first): each leaves the index, its slot
    /// is freed, and `each` hears its key and slot. `false`, with nothing changed, when fewer
    /// than `n` can go. The one eviction of every store shape and of `evict_now`.
    fn evict_unprotected(&mut self, n: usize, mut each: impl FnMut(OffloadKey, u32)) -> bool {
        let mut victims = std::mem::take(&mut self.scratch);
        let view = SlotView {
            keys: &self.keys,
            ref_cnt: &self.ref_cnt,
            protect: &self.protect,
            stamp: self.stamp,
        };
        let evicted = self.policy.evict(n, &view, &mut victims);
        if evicted {
            self.num_evictable -= victims.len();
            for &s in &victims {
                let k = self.keys[s as usize];
                self.index.remove_slot(&self.keys, s);
                self.vacate(s);
                each(k, s);
            }
        }
        self.scratch = victims;
        evicted
    }

    /// A free slot for a new key: fresh ids first, then the free list LIFO (the caller made
    /// room).
    #[inline]
    fn next_free_slot(&mut self) -> u32 {
        if self.num_allocated < self.num_chunks {
            self.num_allocated += 1;
            (self.num_allocated - 1) as u32
        } else {
            self.free_list.pop().expect("room was made above")
        }
    }

    /// Key `k` into the free slot `s`: indexed, its write in flight, handed to the policy at
    /// its position in `ctx` (when `positional`) with the request's rank `rank`, which the
    /// caller reads from the request's record and writes back (a store holds the record's
    /// places across its insertions). The one insertion of every store shape; the caller
    /// sets the key's `INSERTED` flag and counts the write.
    #[inline(always)]
    fn insert_new(
        &mut self,
        k: &OffloadKey,
        s: u32,
        ctx: &ReqContext,
        positional: bool,
        rank: &mut Option<u64>,
    ) {
        self.keys[s as usize] = *k;
        self.index.insert(&self.keys, k, s);
        self.ref_cnt[s as usize] = -1;
        let pos = if positional {
            ctx.get_offload_key_position(k)
        } else {
            None
        };
        self.policy.insert(&self.keys, s, pos, rank);
    }

    pub(crate) fn complete_store_inner(
        &mut self,
        keys: &[OffloadKey],
        ctx: &ReqContext,
        success: bool,
    ) {
        self.complete_store_hinted(keys, &[], ctx, success);
    }

    /// [`complete_store_inner`](Self::complete_store_inner) with `hints`: the slot each key
    /// was placed in (a promotion job's chunk ids, co-indexed with `keys`; empty for none),
    /// taken where it still holds its key.
    pub(crate) fn complete_store_hinted(
        &mut self,
        keys: &[OffloadKey],
        hints: &[i32],
        ctx: &ReqContext,
        success: bool,
    ) {
        let mut done: Vec<OffloadKey> = Vec::new();
        for (i, k) in keys.iter().enumerate() {
            if let Some(s) = self.hinted_slot(k, slot_hint(hints, i)) {
                self.complete_slot(k, s, success, &mut done);
            }
        }
        self.completed_event(done, ctx, success);
    }

    /// A successful `complete_store` of `keys` whose slots the caller holds (co-indexed,
    /// [`resident_slots`](Self::resident_slots) just before): no probe.
    pub(crate) fn complete_store_at(
        &mut self,
        keys: &[OffloadKey],
        slots: &[u32],
        ctx: &ReqContext,
    ) {
        debug_assert_eq!(keys.len(), slots.len());
        let mut done: Vec<OffloadKey> = Vec::new();
        for (k, &s) in keys.iter().zip(slots) {
            self.complete_slot(k, s, true, &mut done);
        }
        self.completed_event(done, ctx, true);
    }

    /// One key of `complete_store`, resident in slot `s`: a write in flight becomes ready
    /// (`success`) or is dropped; anything else (already ready, a key given twice) is left.
    #[inline]
    fn complete_slot(&mut self, k: &OffloadKey, s: u32, success: bool, done: &mut Vec<OffloadKey>) {
        if self.ref_cnt[s as usize] >= 0 {
            return;
        }
        self.num_write_pending -= 1;
        if success {
            self.ref_cnt[s as usize] = 0;
            self.num_evictable += 1;
        } else {
            self.policy.remove(s);
            self.index.remove(&self.keys, k);
            self.vacate(s);
        }
        if self.events.is_some() {
            done.push(*k);
        }
    }

    /// The event of a completed store: stored keys (under 0.34 with the completing request's
    /// context, a removal expected), or the failed ones' bookkeeping removal.
    fn completed_event(&mut self, done: Vec<OffloadKey>, ctx: &ReqContext, success: bool) {
        if let Some(ev) = self.events.as_mut()
            && !done.is_empty()
        {
            let mut e = OffloadingEvent::new(done, self.medium, !success);
            e.metadata_only = !success;
            if success && self.contract.stored_event_context() {
                e.removal_expected = true;
                e.req_context = Some(ctx.clone());
            }
            ev.push(e);
        }
    }

    /// Collected metrics (usage gauges, allocation sizes, stores skipped); vLLM 0.33 `get_stats`.
    pub fn stats(&mut self) -> OffloadingConnectorStats {
        let mut stats = OffloadingConnectorStats::default();
        let n = self.num_chunks as f64;
        let used = self.num_allocated - self.free_list.len() - self.num_evictable;
        let usage = if self.num_chunks > 0 {
            used as f64 / n
        } else {
            0.0
        };
        stats.set_gauge(names::CPU_CACHE_USAGE_PERC, None, usage);
        stats.observe_histogram_all(
            names::CPU_ALLOCATION_SIZE,
            None,
            self.allocation_sizes.drain(..).map(|a| a as f64),
        );
        let write = if self.num_chunks > 0 {
            self.num_write_pending as f64 / n
        } else {
            0.0
        };
        stats.set_gauge(names::CPU_CACHE_WRITE_USAGE_PERC, None, write);
        stats.set_gauge(
            names::CPU_CACHE_READ_USAGE_PERC,
            None,
            f64::max(usage - write, 0.0),
        );
        if self.store_threshold >= 2 {
            stats.increase_counter(names::STORES_SKIPPED, None, self.stores_skipped as f64);
            self.stores_skipped = 0;
        }
        stats
    }
}

/// vLLM's `CPUOffloadingManager` calls, one method per upstream method. The scheduler reaches
/// them through [`TieringOffloadingManager`](crate::TieringOffloadingManager), the one
/// scheduler-facing manager of this crate: with no secondary tier
/// ([`TieringOffloadingManager::cpu`](crate::TieringOffloadingManager::cpu)) each call is this
/// table's alone, exactly as vLLM's CPU-only spec answers; with tiers, this table is its primary.
impl CpuOffloadingManager {
    /// As vLLM's `lookup`: `Hit`, `HitPending` (write in flight) or `Miss`.
    #[inline]
    pub fn lookup(&mut self, key: &OffloadKey, _req_context: &ReqContext) -> LookupResult {
        match self.index.get(&self.keys, key) {
            None => LookupResult::Miss,
            Some(s) if self.ref_cnt[s as usize] < 0 => LookupResult::HitPending,
            Some(s) => {
                // A hint for the `prepare_load` of the hits that usually follows.
                if self.hit_hints.len() >= HIT_HINTS_MAX {
                    self.hit_hints.clear();
                }
                self.hit_hints.push(s);
                LookupResult::Hit
            }
        }
    }

    /// The slot of `k` for a `prepare_load`: the first of the next few `hints` (the `HIT`
    /// lookups' slots, in their order; `next` is where to look, moved past a hint taken) whose
    /// slot holds `k` now, else a probe of the index. A hint is a slot, never trusted: a slot
    /// holds a key exactly while the index maps the key to it (`check_invariants`), so a slot
    /// whose key is `k` is `k`'s slot, whatever happened since the lookup.
    #[inline]
    fn slot_of_hit(&self, k: &OffloadKey, hints: &[u32], next: &mut usize) -> Option<u32> {
        let window = hints.get(*next..).unwrap_or_default();
        if let Some(i) = window
            .iter()
            .take(HIT_HINTS_SKIP + 1)
            .position(|&s| self.keys[s as usize] == *k)
        {
            *next += i + 1;
            return Some(window[i]);
        }
        self.index.get(&self.keys, k)
    }

    /// Puts the emptied hint buffer back (its capacity kept), unless lookups refilled it.
    fn recycle_hit_hints(&mut self, mut hints: Vec<u32>) {
        if self.hit_hints.is_empty() {
            hints.clear();
            self.hit_hints = hints;
        }
    }

    /// As vLLM's `prepare_load`: pins every key (all must be ready) for a GPU read.
    pub fn prepare_load(&mut self, keys: &[OffloadKey], ctx: &ReqContext) -> Result<LoadStoreSpec> {
        self.prepare_load_inner("prepare_load", keys, ctx, true)
    }

    /// As vLLM's `touch`: the keys become most recent (the head of the prefix last).
    pub fn touch(&mut self, keys: &[OffloadKey], _ctx: &ReqContext) -> Result<()> {
        for k in keys.iter().rev() {
            let slot = self.index.get(&self.keys, k);
            let ready = slot.is_some_and(|s| self.ref_cnt[s as usize] >= 0);
            self.policy.touch_one(k, slot, ready);
        }
        Ok(())
    }

    /// As vLLM's `complete_load`: unpins what `prepare_load` pinned.
    pub fn complete_load(&mut self, keys: &[OffloadKey], ctx: &ReqContext) -> Result<()> {
        self.complete_load_inner("complete_load", keys, Some(ctx))
    }

    /// As vLLM's `prepare_store`: slots for the keys not yet stored, evicting exactly the shortfall, or `None` having changed nothing.
    pub fn prepare_store(
        &mut self,
        keys: &[OffloadKey],
        ctx: &ReqContext,
    ) -> Result<Option<PrepareStoreOutput>> {
        Ok(self.store_inner(keys, ctx))
    }

    /// As vLLM's `complete_store`: the prepared keys become loadable, or are dropped on failure.
    pub fn complete_store(
        &mut self,
        keys: &[OffloadKey],
        ctx: &ReqContext,
        success: bool,
    ) -> Result<()> {
        self.complete_store_inner(keys, ctx, success);
        Ok(())
    }

    /// As vLLM's `on_new_request`: starts the request's access record (chunk-level).
    pub fn on_new_request(&mut self, ctx: &ReqContext) -> Result<RequestOffloadingContext> {
        self.requests.access(ctx);
        Ok(RequestOffloadingContext::default())
    }

    /// As vLLM's `on_request_finished`: hands the request's accesses to the policy in order.
    pub fn on_request_finished(&mut self, ctx: &ReqContext) -> Result<()> {
        let Some(state) = self.requests.take(ctx) else {
            return Ok(());
        };
        // One KV-cache group without positions (the usual case): vLLM's grouping and ordering
        // give the request's order as it is, so it is read in place instead of copied twice.
        let regrouped;
        let ordered: &[OffloadKey] =
            if !ctx.has_positions() && Self::single_group(&state.order).is_some() {
                &state.order
            } else {
                regrouped = Self::order_request_keys(&Self::key_groups(&state.order, ctx), ctx);
                &regrouped
            };
        // LRU reads only each key's slot; ARC also its insertion and reuse flags.
        let flags_read = matches!(self.policy, Policy::Arc(_));
        let mut info = std::mem::take(&mut self.scratch_finished);
        info.clear();
        // The request's pins and stores came in its keys' order (the usual case): walking
        // both, each key's slot is the hint its call left, where it still holds the key.
        let mut next = 0;
        info.extend(ordered.iter().map(|k| {
            let f = if flags_read { state.flags_of(k) } else { 0 };
            let inserted = f & INSERTED != 0;
            let reused = f & REUSED != 0;
            let hint = match state.known.get(next) {
                Some(&(h, s)) if h == *k => {
                    next += 1;
                    Some(s)
                }
                _ => None,
            };
            (*k, self.hinted_slot(k, hint), inserted && !reused, reused)
        }));
        self.policy.on_request_finished(&info);
        self.scratch_finished = info;
        self.requests.recycle(state);
        Ok(())
    }

    /// The slot of `k`: `hint` when that slot still holds `k` (a freed slot holds
    /// [`OffloadKey::VACANT`], and a key is in one slot at most, so that is the slot the index
    /// would answer), else the index's answer.
    #[inline]
    fn hinted_slot(&self, k: &OffloadKey, hint: Option<u32>) -> Option<u32> {
        match hint {
            Some(s) if self.keys.get(s as usize) == Some(k) => Some(s),
            _ => self.index.get(&self.keys, k),
        }
    }

    /// The vLLM contract followed.
    pub fn contract(&self) -> Contract {
        self.contract
    }

    /// vLLM 0.34's `defer_write_release`: fails pending writes as `complete_store(false)` does
    /// (the keys leave the cache: lookups miss, a later store gets a fresh slot) but keeps
    /// their slots out of the free pool, still write-pending, until
    /// [`release_deferred_write`](Self::release_deferred_write). Returns the held slots.
    ///
    /// # Errors
    /// [`TieringError::KeyState`] when a key is not a pending write (a ready or missing key
    /// would leave a slot its writer may still fill unheld), before anything changes.
    pub fn defer_write_release(&mut self, keys: &[OffloadKey]) -> Result<Vec<u32>> {
        const CALL: &str = "defer_write_release";
        for k in keys {
            match self.index.get(&self.keys, k) {
                Some(s) if self.ref_cnt[s as usize] < 0 => {}
                _ => {
                    return Err(TieringError::KeyState {
                        call: CALL,
                        key: *k,
                        state: "not a pending write",
                    });
                }
            }
        }
        let mut held = Vec::with_capacity(keys.len());
        for k in keys {
            let Some(s) = self.index.get(&self.keys, k) else {
                continue; // the same key twice: held once
            };
            self.policy.remove(s);
            self.index.remove(&self.keys, k);
            self.keys[s as usize] = OffloadKey::VACANT;
            self.deferred.insert(s);
            held.push(s);
        }
        if !held.is_empty()
            && let Some(ev) = self.events.as_mut()
        {
            let mut e = OffloadingEvent::new(keys.to_vec(), self.medium, true);
            e.metadata_only = true;
            ev.push(e);
        }
        Ok(held)
    }

    /// Ends a deferred release: the slots go back to the free pool.
    ///
    /// # Errors
    /// [`TieringError::Contract`] naming a slot that is not held, before anything changes.
    pub fn release_deferred_write(&mut self, slots: &[u32]) -> Result<()> {
        if let Some(s) = slots.iter().find(|s| !self.deferred.contains(*s)) {
            return Err(TieringError::Contract {
                call: "release_deferred_write",
                what: format!("chunk {s} is not held by a deferred release"),
            });
        }
        for &s in slots {
            if self.deferred.remove(&s) {
                self.num_write_pending -= 1;
                self.free_list.push(s);
            }
        }
        Ok(())
    }

    /// Slots held by deferred releases.
    pub fn num_deferred_release_chunks(&self) -> usize {
        self.deferred.len()
    }

    /// Frees slot `s` (already out of the index and the policy): it holds no key from now on.
    #[inline]
    fn vacate(&mut self, s: u32) {
        self.keys[s as usize] = OffloadKey::VACANT;
        self.free_list.push(s);
    }

    /// As vLLM's `take_events`: stored/removed events since the last call (metadata-only removals of keys stored again are dropped).
    pub fn take_events(&mut self) -> Vec<OffloadingEvent> {
        let Some(ev) = self.events.as_mut() else {
            return Vec::new();
        };
        let evs = std::mem::take(ev);
        let mut out = Vec::with_capacity(evs.len());
        for mut e in evs {
            if e.metadata_only {
                e.keys.retain(|k| !self.index.contains(&self.keys, k));
                if e.keys.is_empty() {
                    continue;
                }
            }
            out.push(e);
        }
        out
    }

    /// Marks `slots` as holding bytes whose keys this manager does not know yet (a disk's
    /// blocks restored from its journal, known there by a digest of the key): they are neither
    /// free nor resident until [`adopt_held`](Self::adopt_held) names the key of one or
    /// [`release_held`](Self::release_held) gives it back for room. Only on a manager that has
    /// handed out no slot; a slot out of range or given twice is refused and nothing changes.
    pub fn hold_slots(&mut self, slots: &[u32]) -> Result<()> {
        let refuse = |what: String| TieringError::Contract {
            call: "hold_slots",
            what,
        };
        if self.num_allocated != 0 || !self.held.is_empty() {
            return Err(refuse("the manager already hands out slots".into()));
        }
        let mut held = hashbrown::HashSet::with_capacity(slots.len());
        for &s in slots {
            if s as usize >= self.num_chunks || !held.insert(s) {
                return Err(refuse(format!(
                    "slot {s} is out of range (0..{}) or given twice",
                    self.num_chunks
                )));
            }
        }
        if held.is_empty() {
            return Ok(());
        }
        // Every slot counts as handed out; the free list holds the others, lowest popped first
        // (the order fresh ids would have come in).
        self.num_allocated = self.num_chunks;
        self.free_list = (0..self.num_chunks as u32)
            .rev()
            .filter(|s| !held.contains(s))
            .collect();
        self.held = held;
        Ok(())
    }

    /// Slots held (restored, not yet adopted or released).
    pub fn num_held(&self) -> usize {
        self.held.len()
    }

    /// Gives up to `n` held slots back to the free list (their bytes are no longer wanted: a
    /// store needs the room); returns them.
    pub fn release_held(&mut self, n: usize) -> Vec<u32> {
        let out: Vec<u32> = self.held.iter().copied().take(n).collect();
        for s in &out {
            self.held.remove(s);
            self.free_list.push(*s);
        }
        out
    }

    /// The held slot `slot` holds `key`'s bytes (its caller matched the key's digest): the key
    /// becomes resident and ready there, the most recent in the policy, with a stored event.
    /// `false`, with nothing changed, where the slot is not held or the key is already known.
    pub fn adopt_held(&mut self, key: &OffloadKey, slot: u32) -> bool {
        if !self.held.contains(&slot) || self.index.get(&self.keys, key).is_some() {
            return false;
        }
        self.held.remove(&slot);
        self.keys[slot as usize] = *key;
        self.index.insert(&self.keys, key, slot);
        self.ref_cnt[slot as usize] = 0;
        self.num_evictable += 1;
        self.policy.insert(&self.keys, slot, None, &mut None);
        if let Some(ev) = self.events.as_mut() {
            ev.push(OffloadingEvent::new(vec![*key], self.medium, false));
        }
        true
    }

    /// Forgets the ready, unpinned `key` (its bytes proved bad): out of the index and the
    /// policy, its slot freed, with a removed event. `None`, with nothing changed, where the
    /// key is absent, being written or pinned by a read.
    pub fn discard(&mut self, key: &OffloadKey) -> Option<u32> {
        let s = self.index.get(&self.keys, key)?;
        if self.ref_cnt[s as usize] != 0 {
            return None;
        }
        self.policy.remove(s);
        self.index.remove(&self.keys, key);
        self.vacate(s);
        self.num_evictable -= 1;
        if let Some(ev) = self.events.as_mut() {
            ev.push(OffloadingEvent::new(vec![*key], self.medium, true));
        }
        Some(s)
    }

    /// As vLLM's `reset_cache`: forgets every chunk and request.
    pub fn reset_cache(&mut self) -> Result<()> {
        if !self.deferred.is_empty() {
            return Err(TieringError::Contract {
                call: "reset_cache",
                what: format!(
                    "{} chunks await a deferred release: a tier may still write to them",
                    self.deferred.len()
                ),
            });
        }
        self.policy.clear();
        self.index.clear();
        self.requests.clear();
        self.num_evictable = 0;
        self.num_write_pending = 0;
        self.free_list.clear();
        self.reserved.clear();
        self.held.clear();
        self.hit_hints.clear();
        self.keys[..self.num_allocated].fill(OffloadKey::VACANT);
        self.num_allocated = 0;
        Ok(())
    }

    /// As vLLM's `get_stats`: the CPU gauges and counters since the last call.
    pub fn get_stats(&mut self) -> Option<OffloadingConnectorStats> {
        Some(self.stats())
    }

    /// Where a hit loads from: host memory.
    pub fn get_load_source(&self, _key: &OffloadKey, _ctx: &ReqContext) -> CacheHitSource {
        CacheHitSource::Host
    }
}

/// The `i`th slot hint of `hints` (a job's chunk ids), if it has one that can be a slot.
#[inline]
fn slot_hint(hints: &[i32], i: usize) -> Option<u32> {
    hints.get(i).and_then(|&h| u32::try_from(h).ok())
}
