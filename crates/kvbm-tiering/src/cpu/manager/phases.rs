//! `prepare_store`, `prepare_load` and `on_request_finished` step by step, for a driver that
//! interposes its own hooks between the steps.
//!
//! vLLM's `CPUOffloadingManager` is Python: its callers may replace a hook of its policy
//! (`touch`, `on_store_miss`, `evict`, `on_request_finished`) or of the manager itself
//! (`_allocate_chunks`, `_record_request_cache_access`) and expect the manager to call the
//! replacement at the point vLLM calls it, with vLLM's arguments. kvbm's Python package runs
//! [`CpuOffloadingManager::prepare_store`] in one Rust call while nothing is replaced; when
//! something is, it drives the same call through the steps below and calls the replacement
//! (or the step's default) in between:
//!
//! ```text
//!  store_plan ─► on_store_miss (policy hook) ─► mark_store_misses ─► record_request_access
//!     ─► record_allocation ─► [num_free < n: num_evictable, evict_now (policy hook), eviction event]
//!     ─► allocate_slots (manager hook) ─► insert_allocated
//! ```
//!
//! Each step keeps the slot table consistent on its own: [`CpuOffloadingManager::evict_now`]
//! removes its victims from the policy *and* frees their slots (vLLM's `policy.evict` leaves
//! that to the manager, so a direct call there leaks the chunks); slots handed out by
//! [`CpuOffloadingManager::allocate_slots`] and never inserted (a hook raised in between) go
//! back to the free list at the next [`CpuOffloadingManager::store_plan`].

use hashbrown::HashSet;

use super::{CpuOffloadingManager, INSERTED, REUSED, STORE_MISS};
use crate::error::{Result, TieringError};
use crate::key::OffloadKey;
use crate::types::{OffloadingEvent, ReqContext};

/// What `prepare_store` decides before it touches the policy ([`CpuOffloadingManager::store_plan`]).
#[derive(Clone, Debug, Default)]
pub struct StorePlan {
    /// Keys to store (absent and past the store threshold), in offer order.
    pub keys_to_store: Vec<OffloadKey>,
    /// Offered keys that are resident and ready (reuses).
    pub ready_existing: Vec<OffloadKey>,
    /// Offered keys the request's access record takes (to store or ready), in offer order.
    pub recorded: Vec<OffloadKey>,
    /// Keys to store not yet reported to the policy as store misses for this request.
    pub new_store_misses: Vec<OffloadKey>,
}

/// One finished request's accesses, as vLLM hands them to `policy.on_request_finished`.
#[derive(Clone, Debug, Default)]
pub struct FinishedAccess {
    /// Keys per KV-cache group, groups by index, each head to tail.
    pub key_groups: Vec<Vec<OffloadKey>>,
    /// Keys only inserted by the request (inserted, never reused).
    pub insertion_only: Vec<OffloadKey>,
    /// Ready keys the request reused.
    pub reused: Vec<OffloadKey>,
}

impl CpuOffloadingManager {
    /// `prepare_store`'s first step: the store-threshold tracker, the classification of the
    /// offer, the skipped-store count, and the store misses still to report. Nothing else
    /// changes (the policy is not told; the request's record is not written).
    pub fn store_plan(&mut self, keys: &[OffloadKey], ctx: &ReqContext) -> StorePlan {
        let reserved = std::mem::take(&mut self.reserved);
        self.free_list.extend(reserved);
        if self.counts.is_some() {
            self.record_offer(keys, ctx);
        }
        let mut plan = StorePlan::default();
        let mut skipped = 0u64;
        for (i, k) in keys.iter().enumerate() {
            match self.index.get(&self.keys, k) {
                None => {
                    let pass = self.passes_store_threshold(k);
                    if pass {
                        plan.keys_to_store.push(*k);
                        plan.recorded.push(*k);
                    } else {
                        skipped += u64::from(self.skip_counts(i));
                    }
                }
                Some(s) if self.ref_cnt[s as usize] >= 0 => {
                    plan.ready_existing.push(*k);
                    plan.recorded.push(*k);
                }
                Some(_) => {}
            }
        }
        if self.counts.is_some() {
            self.stores_skipped += skipped;
            self.mark_counted(keys, ctx);
        }
        let state = self.requests.access(ctx);
        for k in &plan.keys_to_store {
            if state.flags_of(k) & STORE_MISS == 0 {
                plan.new_store_misses.push(*k);
            }
        }
        plan
    }

    /// The policy's own `on_store_miss` (ARC adapts its target to ghost hits; LRU ignores).
    pub fn policy_store_miss(&mut self, keys: &[OffloadKey]) {
        for k in keys.iter().rev() {
            self.policy.on_store_miss_one(k);
        }
    }

    /// Notes `keys` as store misses already reported for the request.
    pub fn mark_store_misses(&mut self, keys: &[OffloadKey], ctx: &ReqContext) {
        let state = self.requests.access(ctx);
        for k in keys {
            state.set(*k, STORE_MISS);
        }
    }

    /// vLLM's `_record_request_cache_access(keys, req_context, inserted_keys, reused_keys)`:
    /// first accesses (in order, told to the policy), then the inserted keys, then the reused
    /// ones (those the request did not insert itself).
    pub fn record_request_access(
        &mut self,
        keys: &[OffloadKey],
        ctx: &ReqContext,
        inserted: &[OffloadKey],
        reused: &[OffloadKey],
    ) {
        self.record_access(keys.iter().map(|k| (*k, false)), ctx);
        let state = self.requests.access(ctx);
        for k in inserted {
            state.set(*k, INSERTED);
        }
        for k in reused {
            let f = state.flags_mut(*k);
            if *f & INSERTED == 0 {
                *f |= REUSED;
            }
        }
    }

    /// Records an allocation of `n` chunks for the allocation-size histogram.
    pub fn record_allocation(&mut self, n: usize) {
        self.allocation_sizes.push(n);
    }

    /// Slots free without eviction (never handed out, or on the free list).
    pub fn num_free_slots(&self) -> usize {
        self.num_free()
    }

    /// The policy's `evict(n, protected)`: `n` idle, unprotected victims in the policy's order,
    /// each `(key, chunk id)`, removed from the cache and their slots freed; `None` (and nothing
    /// changed) when fewer than `n` can go. No event is recorded (the caller records one).
    pub fn evict_now(
        &mut self,
        n: usize,
        protected: &[OffloadKey],
    ) -> Option<Vec<(OffloadKey, u32)>> {
        self.stamp += 1;
        for k in protected {
            if let Some(s) = self.index.get(&self.keys, k) {
                self.protect[s as usize] = self.stamp;
            }
        }
        let mut out = Vec::with_capacity(n);
        self.evict_unprotected(n, |k, s| out.push((k, s)))
            .then_some(out)
    }

    /// Records the removal event of evicted keys (when events are on).
    pub fn record_eviction_event(&mut self, keys: Vec<OffloadKey>) {
        if let Some(ev) = self.events.as_mut()
            && !keys.is_empty()
        {
            ev.push(OffloadingEvent::new(keys, self.medium, true));
        }
    }

    /// vLLM's `_allocate_chunks`: `n` slots, fresh ids first, then the free list LIFO.
    ///
    /// # Errors
    /// [`TieringError::Contract`] when fewer than `n` are free (vLLM asserts the same).
    pub fn allocate_slots(&mut self, n: usize) -> Result<Vec<u32>> {
        if n > self.num_free() {
            return Err(TieringError::Contract {
                call: "_allocate_chunks",
                what: format!("{n} chunks asked, {} free", self.num_free()),
            });
        }
        let mut ids = Vec::with_capacity(n);
        for _ in 0..n {
            let s = if self.num_allocated < self.num_chunks {
                self.num_allocated += 1;
                (self.num_allocated - 1) as u32
            } else {
                self.free_list.pop().expect("counted above")
            };
            ids.push(s);
        }
        self.reserved.extend_from_slice(&ids);
        Ok(ids)
    }

    /// `prepare_store`'s last step: `keys` enter the cache in `slots` (from
    /// [`Self::allocate_slots`]), write pending, inserted by the request.
    ///
    /// # Errors
    /// [`TieringError::Contract`] when the counts differ, a slot was not handed out by
    /// [`Self::allocate_slots`] (or twice), or a key is already resident; nothing changes then.
    pub fn insert_allocated(
        &mut self,
        keys: &[OffloadKey],
        slots: &[u32],
        ctx: &ReqContext,
    ) -> Result<()> {
        let call = "prepare_store";
        if keys.len() != slots.len() {
            return Err(TieringError::Contract {
                call,
                what: format!("{} chunks allocated for {} keys", slots.len(), keys.len()),
            });
        }
        let mut taken: HashSet<u32> = HashSet::with_capacity(slots.len());
        for &s in slots {
            if !self.reserved.contains(&s) || !taken.insert(s) {
                return Err(TieringError::Contract {
                    call,
                    what: format!("chunk {s} was not handed out by the chunk pool"),
                });
            }
        }
        let mut fresh: HashSet<OffloadKey> = HashSet::with_capacity(keys.len());
        for k in keys {
            if self.index.contains(&self.keys, k) || !fresh.insert(*k) {
                return Err(TieringError::KeyState {
                    call,
                    key: *k,
                    state: "already cached",
                });
            }
        }
        self.reserved.retain(|s| !taken.contains(s));
        let positional = ctx.has_positions();
        let mut rank = self.requests.access(ctx).req_rank;
        for (k, &s) in keys.iter().zip(slots) {
            self.insert_new(k, s, ctx, positional, &mut rank);
        }
        let state = self.requests.access(ctx);
        state.req_rank = rank;
        for k in keys {
            state.set(*k, INSERTED);
        }
        self.num_write_pending += keys.len();
        Ok(())
    }

    /// `prepare_load` without recording the request's access (the caller records it).
    ///
    /// # Errors
    /// As [`crate::OffloadingManager::prepare_load`].
    pub fn pin_for_load(&mut self, keys: &[OffloadKey], ctx: &ReqContext) -> Result<Vec<i32>> {
        let spec = self.prepare_load_inner("prepare_load", keys, ctx, false)?;
        Ok(spec.chunk_ids().unwrap_or_default().to_vec())
    }

    /// `on_request_finished`'s first step: the request's accesses, its record dropped; `None`
    /// when there is none (never seen, already finished, or from before a `reset_cache`).
    pub fn finish_request_access(&mut self, ctx: &ReqContext) -> Option<FinishedAccess> {
        let state = self.requests.take(ctx)?;
        let key_groups = Self::key_groups(&state.order, ctx);
        let mut insertion_only = Vec::new();
        let mut reused = Vec::new();
        for k in &state.order {
            let f = state.flags_of(k);
            if f & REUSED != 0 {
                reused.push(*k);
            } else if f & INSERTED != 0 {
                insertion_only.push(*k);
            }
        }
        self.requests.recycle(state);
        Some(FinishedAccess {
            key_groups,
            insertion_only,
            reused,
        })
    }

    /// The policy's own `on_request_finished(key_groups, insertion_only_keys, reused_keys)`.
    pub fn policy_request_finished(
        &mut self,
        key_groups: &[Vec<OffloadKey>],
        insertion_only: &HashSet<OffloadKey>,
        reused: &HashSet<OffloadKey>,
        ctx: &ReqContext,
    ) {
        let ordered = Self::order_request_keys(key_groups, ctx);
        let info: Vec<(OffloadKey, Option<u32>, bool, bool)> = ordered
            .iter()
            .map(|k| {
                (
                    *k,
                    self.index.get(&self.keys, k),
                    insertion_only.contains(k),
                    reused.contains(k),
                )
            })
            .collect();
        self.policy.on_request_finished(&info);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::{CachePolicyKind, CpuManagerConfig};

    fn keys(r: std::ops::Range<u64>) -> Vec<OffloadKey> {
        r.map(OffloadKey::from_u64).collect()
    }

    fn manager(n: usize, policy: CachePolicyKind) -> CpuOffloadingManager {
        CpuOffloadingManager::new(CpuManagerConfig::new(n).policy(policy).events(true))
    }

    /// A store's `(keys_to_store, chunk ids, evicted keys)`.
    type Stored = (Vec<OffloadKey>, Vec<u32>, Vec<OffloadKey>);

    /// Drives `prepare_store` through the steps with every default hook, as kvbm-vllm's
    /// Python driver does.
    fn phased_store(
        m: &mut CpuOffloadingManager,
        offer: &[OffloadKey],
        ctx: &ReqContext,
    ) -> Result<Option<Stored>> {
        let plan = m.store_plan(offer, ctx);
        m.policy_store_miss(&plan.new_store_misses);
        m.mark_store_misses(&plan.new_store_misses, ctx);
        m.record_request_access(&plan.recorded, ctx, &[], &plan.ready_existing);
        if plan.keys_to_store.is_empty() {
            return Ok(Some(Default::default()));
        }
        m.record_allocation(plan.keys_to_store.len());
        let need = plan.keys_to_store.len().saturating_sub(m.num_free_slots());
        let mut evicted = Vec::new();
        if need > 0 {
            if need > m.num_evictable() {
                return Ok(None);
            }
            let Some(v) = m.evict_now(need, offer) else {
                return Ok(None);
            };
            evicted = v.into_iter().map(|(k, _)| k).collect();
            m.record_eviction_event(evicted.clone());
        }
        let slots = m.allocate_slots(plan.keys_to_store.len())?;
        m.insert_allocated(&plan.keys_to_store, &slots, ctx)?;
        Ok(Some((plan.keys_to_store, slots, evicted)))
    }

    #[test]
    fn phased_store_matches_the_one_call() {
        for policy in [CachePolicyKind::Lru, CachePolicyKind::Arc] {
            let (mut a, mut b) = (manager(6, policy), manager(6, policy));
            for (i, offer) in [0..4, 2..7, 7..9, 0..3, 9..16, 3..6]
                .into_iter()
                .enumerate()
            {
                let offer = keys(offer);
                let ctx = ReqContext::new(format!("r{i}"));
                let fast = a.prepare_store(&offer, &ctx).unwrap();
                let phased = phased_store(&mut b, &offer, &ctx).unwrap();
                match (fast, phased) {
                    (None, None) => {}
                    (Some(f), Some(p)) => {
                        let ids: Vec<u32> = f
                            .store_spec
                            .chunk_ids()
                            .unwrap_or_default()
                            .iter()
                            .map(|&s| s as u32)
                            .collect();
                        assert_eq!((f.keys_to_store, ids, f.evicted_keys), p, "{policy:?} {i}");
                        a.complete_store(&p.0, &ctx, true).unwrap();
                        b.complete_store(&p.0, &ctx, true).unwrap();
                    }
                    (f, p) => panic!("{policy:?} {i}: {:?} vs {:?}", f.is_some(), p.is_some()),
                }
                a.on_request_finished(&ctx).unwrap();
                let acc = b.finish_request_access(&ctx).expect("recorded");
                let ins: HashSet<_> = acc.insertion_only.iter().copied().collect();
                let re: HashSet<_> = acc.reused.iter().copied().collect();
                b.policy_request_finished(&acc.key_groups, &ins, &re, &ctx);
                assert_eq!(a.eviction_order(), b.eviction_order(), "{policy:?} {i}");
                assert_eq!(a.take_events(), b.take_events(), "{policy:?} {i}");
                b.check_invariants().unwrap();
            }
        }
    }

    #[test]
    fn evict_now_is_atomic_and_frees_its_victims() {
        let mut m = manager(4, CachePolicyKind::Lru);
        let ctx = ReqContext::new("r");
        let ks = keys(0..4);
        m.prepare_store(&ks, &ctx).unwrap();
        m.complete_store(&ks, &ctx, true).unwrap();
        assert!(m.evict_now(2, &ks[1..]).is_none());
        assert_eq!(m.len(), 4);
        m.check_invariants().unwrap();
        let v = m.evict_now(1, &ks[1..]).unwrap();
        assert_eq!(v.iter().map(|(k, _)| *k).collect::<Vec<_>>(), vec![ks[0]]);
        assert_eq!((m.len(), m.num_free_slots(), m.num_evictable()), (3, 1, 3));
        m.check_invariants().unwrap();
    }

    #[test]
    fn insert_allocated_takes_only_slots_the_pool_handed_out() {
        let mut m = manager(4, CachePolicyKind::Arc);
        let ctx = ReqContext::new("r");
        let ks = keys(0..2);
        assert!(matches!(
            m.insert_allocated(&ks, &[0, 1], &ctx),
            Err(TieringError::Contract { .. })
        ));
        let slots = m.allocate_slots(2).unwrap();
        assert!(
            m.insert_allocated(&ks, &[slots[0], slots[0]], &ctx)
                .is_err()
        );
        assert!(m.allocate_slots(3).is_err());
        m.check_invariants().unwrap();
        // A hook that raised between allocation and insertion: the next store takes them back.
        m.store_plan(&ks, &ctx);
        assert_eq!(m.num_free_slots(), 4);
        m.check_invariants().unwrap();
        let slots = m.allocate_slots(2).unwrap();
        m.insert_allocated(&ks, &slots, &ctx).unwrap();
        assert_eq!(m.num_write_pending(), 2);
        m.check_invariants().unwrap();
    }
}
