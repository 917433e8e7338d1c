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
use crate::cpu::policy::SlotView;
use crate::error::{Result, TieringError};
use crate::key::OffloadKey;
use crate::types::{Medium, OffloadingEvent, ReqContext};

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
            self.record_tracker(keys);
        }
        let mut plan = StorePlan::default();
        let mut candidates = 0usize;
        for k in keys {
            match self.index.get(k) {
                None => {
                    candidates += 1;
                    let pass = match &self.counts {
                        Some(c) => c.get(k).unwrap_or(0) >= self.store_threshold,
                        None => true,
                    };
                    if pass {
                        plan.keys_to_store.push(*k);
                        plan.recorded.push(*k);
                    }
                }
                Some(&s) if self.ref_cnt[s as usize] >= 0 => {
                    plan.ready_existing.push(*k);
                    plan.recorded.push(*k);
                }
                Some(_) => {}
            }
        }
        if self.counts.is_some() {
            self.stores_skipped += (candidates - plan.keys_to_store.len()) as u64;
        }
        let state = Self::access(&mut self.requests, ctx);
        for k in &plan.keys_to_store {
            if !state.flags.get(k).is_some_and(|f| f & STORE_MISS != 0) {
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
        let state = Self::access(&mut self.requests, ctx);
        for k in keys {
            *state.flags.entry(*k).or_insert(0) |= STORE_MISS;
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
        self.record_access(keys.iter().copied(), ctx, &[]);
        let state = Self::access(&mut self.requests, ctx);
        for k in inserted {
            *state.flags.entry(*k).or_insert(0) |= INSERTED;
        }
        for k in reused {
            let f = state.flags.entry(*k).or_insert(0);
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
            if let Some(&s) = self.index.get(k) {
                self.protect[s as usize] = self.stamp;
            }
        }
        let mut victims = Vec::new();
        let view = SlotView {
            keys: &self.keys,
            ref_cnt: &self.ref_cnt,
            protect: &self.protect,
            stamp: self.stamp,
        };
        if !self.policy.evict(n, &view, &mut victims) {
            return None;
        }
        self.num_evictable -= victims.len();
        let mut out = Vec::with_capacity(victims.len());
        for s in victims {
            let k = self.keys[s as usize];
            self.index.remove(&k);
            self.free_list.push(s);
            out.push((k, s));
        }
        Some(out)
    }

    /// Records the removal event of evicted keys (when events are on).
    pub fn record_eviction_event(&mut self, keys: Vec<OffloadKey>) {
        if let Some(ev) = self.events.as_mut()
            && !keys.is_empty()
        {
            ev.push(OffloadingEvent::new(keys, Medium::Cpu, true));
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
            if self.index.contains_key(k) || !fresh.insert(*k) {
                return Err(TieringError::KeyState {
                    call,
                    key: *k,
                    state: "already cached",
                });
            }
        }
        self.reserved.retain(|s| !taken.contains(s));
        let positional = ctx.has_positions();
        let state = Self::access(&mut self.requests, ctx);
        for (k, &s) in keys.iter().zip(slots) {
            self.index.insert(*k, s);
            self.keys[s as usize] = *k;
            self.ref_cnt[s as usize] = -1;
            let pos = if positional {
                ctx.get_offload_key_position(k)
            } else {
                None
            };
            self.policy.insert(&self.keys, s, pos, &mut state.req_rank);
            *state.flags.entry(*k).or_insert(0) |= INSERTED;
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
        let state = self.requests.get(ctx.req_id())?;
        if state.ctx_uid != ctx.uid() {
            return None;
        }
        let state = self.requests.remove(ctx.req_id()).expect("present");
        let key_groups = Self::key_groups(&state.order, ctx);
        let mut insertion_only = Vec::new();
        let mut reused = Vec::new();
        for k in &state.order {
            let f = state.flags.get(k).copied().unwrap_or(0);
            if f & REUSED != 0 {
                reused.push(*k);
            } else if f & INSERTED != 0 {
                insertion_only.push(*k);
            }
        }
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
                    self.index.get(k).copied(),
                    insertion_only.contains(k),
                    reused.contains(k),
                )
            })
            .collect();
        self.policy.on_request_finished(&info);
    }
}
