//! `store_into` with a reused output against `store_inner` with a fresh one: two managers
//! given the same calls (stores that fit, that evict, that find keys resident or pending,
//! that cannot be placed, with events) answer the same and keep the same state.

use super::{CpuManagerConfig, CpuOffloadingManager, PrepareStoreOutput};
use crate::cpu::CachePolicyKind;
use crate::error::TieringError;
use crate::key::OffloadKey;
use crate::types::{CpuLoadStoreSpec, LoadStoreSpec, LookupResult, ReqContext};

fn pair(policy: CachePolicyKind) -> (CpuOffloadingManager, CpuOffloadingManager) {
    let mut c = CpuManagerConfig::new(8);
    c.policy = policy;
    c.enable_events = true;
    (
        CpuOffloadingManager::new(c.clone()),
        CpuOffloadingManager::new(c),
    )
}

#[test]
fn a_reused_output_answers_as_a_fresh_one() {
    for policy in [CachePolicyKind::Lru, CachePolicyKind::Arc] {
        let (mut fresh, mut reused) = pair(policy);
        // Left dirty on purpose: every field must be replaced, never appended to.
        let mut out = PrepareStoreOutput {
            keys_to_store: vec![OffloadKey::from_u64(999); 3],
            store_spec: LoadStoreSpec::Cpu(CpuLoadStoreSpec {
                chunk_ids: vec![7; 5],
            }),
            evicted_keys: vec![OffloadKey::from_u64(998)],
        };
        let ctx = ReqContext::new("r");
        for m in [&mut fresh, &mut reused] {
            m.on_new_request(&ctx).unwrap();
        }
        // A deterministic mix: one key at a time (a promotion) and batches, overlapping keys,
        // some left pending (never completed) so a later store cannot be placed.
        let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
        let (mut pending, mut unplaced) = (Vec::new(), 0);
        for step in 0..200u64 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let n = if step % 3 == 0 {
                1
            } else {
                (x % 5) as usize + 1
            };
            let keys: Vec<OffloadKey> = (0..n as u64)
                .map(|i| OffloadKey::from_u64((x >> 8).wrapping_add(i) % 24))
                .collect();
            let a = fresh.store_inner(&keys, &ctx);
            let placed = reused.store_into(&keys, &ctx, &mut out);
            assert_eq!(a.is_some(), placed, "step {step}: placed");
            if let Some(a) = a {
                assert_eq!(a.keys_to_store, out.keys_to_store, "step {step}");
                assert_eq!(a.evicted_keys, out.evicted_keys, "step {step}");
                assert_eq!(
                    a.store_spec.chunk_ids(),
                    out.store_spec.chunk_ids(),
                    "step {step}"
                );
                // Complete most stores at once; leave every fifth pending for a while.
                if step % 5 != 0 {
                    fresh.complete_store(&a.keys_to_store, &ctx, true).unwrap();
                    reused.complete_store(&a.keys_to_store, &ctx, true).unwrap();
                } else {
                    pending.extend_from_slice(&a.keys_to_store);
                }
            } else {
                unplaced += 1;
            }
            if step % 17 == 0 {
                fresh.complete_store(&pending, &ctx, true).unwrap();
                reused.complete_store(&pending, &ctx, true).unwrap();
                pending.clear();
            }
            assert_eq!(fresh.slot_states(), reused.slot_states(), "step {step}");
            assert_eq!(
                fresh.eviction_order(),
                reused.eviction_order(),
                "step {step}"
            );
            reused.check_invariants().unwrap();
        }
        assert!(
            (5..150).contains(&unplaced),
            "{policy:?}: both outcomes are exercised ({unplaced} of 200 not placed)"
        );
        assert_eq!(fresh.take_events(), reused.take_events());
    }
}

/// A 4-slot manager and three started requests, `a`, `b` and `c`.
fn four_slots_three_requests() -> (CpuOffloadingManager, [ReqContext; 3]) {
    let mut m = CpuOffloadingManager::new(CpuManagerConfig::new(4));
    let ctxs = ["a", "b", "c"].map(ReqContext::new);
    for ctx in &ctxs {
        m.on_new_request(ctx).unwrap();
    }
    (m, ctxs)
}

/// A request's slot hints (`RequestAccess::known`) whose slots were freed and given to other
/// keys are not used: a second `complete_load` of an evicted key is refused as a probe would
/// refuse it (the key now in its old slot keeps its pin), and `on_request_finished` moves none
/// of the keys now in those slots.
#[test]
fn stale_slot_hints_fall_back_to_the_index() {
    let k = OffloadKey::from_u64;
    let (mut m, [a, b, c]) = four_slots_three_requests();
    let store = |m: &mut CpuOffloadingManager, keys: &[OffloadKey], ctx: &ReqContext| {
        let out = m.prepare_store(keys, ctx).unwrap().expect("room");
        m.complete_store(&out.keys_to_store, ctx, true).unwrap();
        out
    };
    store(&mut m, &[k(1), k(2)], &a);
    m.prepare_load(&[k(1)], &a).unwrap();
    m.complete_load(&[k(1)], &a).unwrap();
    let (slot1, slot2) = (m.chunk(&k(1)).unwrap().0, m.chunk(&k(2)).unwrap().0);
    store(&mut m, &[k(3), k(4)], &b);
    // Keys 1 and 2 are the least recent: keys 5 and 6 take their slots.
    let out = store(&mut m, &[k(5), k(6)], &c);
    assert_eq!(out.evicted_keys, vec![k(1), k(2)]);
    let now_in = |m: &CpuOffloadingManager, slot| {
        [k(5), k(6)]
            .into_iter()
            .find(|x| m.chunk(x).unwrap().0 == slot)
            .expect("a new key took the slot")
    };
    let in_slot1 = now_in(&m, slot1);
    m.prepare_load(&[in_slot1], &c).unwrap();
    // Request a's hint for key 1 names the slot of the key just pinned.
    assert!(m.complete_load(&[k(1)], &a).is_err());
    assert_eq!(
        m.chunk(&in_slot1).unwrap().1,
        1,
        "the pin in key 1's old slot is untouched"
    );
    m.on_request_finished(&c).unwrap();
    m.on_request_finished(&b).unwrap();
    let order = m.eviction_order();
    assert_eq!(
        order.last(),
        Some(&k(3)),
        "b's finish made its head the most recent"
    );
    // a's hints name slot1 and slot2, now keys 5 and 6: neither moves.
    assert_eq!(
        now_in(&m, slot2),
        [k(5), k(6)].into_iter().find(|x| *x != in_slot1).unwrap()
    );
    m.on_request_finished(&a).unwrap();
    assert_eq!(
        m.eviction_order(),
        order,
        "a's finish moved none of the keys now resident"
    );
    m.complete_load(&[in_slot1], &c).unwrap();
    m.check_invariants().unwrap();
}

#[test]
fn resident_slots_take_a_request_s_store_hints_only_where_they_hold() {
    let k = OffloadKey::from_u64;
    let (mut m, [a, b, c]) = four_slots_three_requests();
    for (keys, ctx) in [([k(1), k(2)], &a), ([k(3), k(4)], &b), ([k(5), k(6)], &c)] {
        let out = m.prepare_store(&keys, ctx).unwrap().expect("room");
        m.complete_store(&out.keys_to_store, ctx, true).unwrap();
    }
    let slot = |m: &CpuOffloadingManager, key| m.chunk(&key).unwrap().0;
    let mut out = Vec::new();
    // Keys 5 and 6 took the slots of keys 1 and 2, which request a's hints still name.
    assert_eq!(m.resident_slots(&[k(1), k(2)], &a, &mut out), Err(k(1)));
    // a's hints are for other keys: the index answers.
    m.resident_slots(&[k(6), k(5)], &a, &mut out).unwrap();
    assert_eq!(out, vec![slot(&m, k(6)), slot(&m, k(5))]);
    // c's own hints, and a request with none.
    m.resident_slots(&[k(5), k(6)], &c, &mut out).unwrap();
    assert_eq!(out, vec![slot(&m, k(5)), slot(&m, k(6))]);
    m.resident_slots(&[k(3)], &ReqContext::new("unknown"), &mut out)
        .unwrap();
    assert_eq!(out, vec![slot(&m, k(3))]);
    m.check_invariants().unwrap();
}

#[test]
fn prepare_load_takes_the_lookups_slots_only_where_they_hold() {
    let k = OffloadKey::from_u64;
    let mut m = CpuOffloadingManager::new(CpuManagerConfig::new(4));
    let (a, b) = (ReqContext::new("a"), ReqContext::new("b"));
    m.on_new_request(&a).unwrap();
    m.on_new_request(&b).unwrap();
    let out = m
        .prepare_store(&[k(1), k(2), k(3), k(4)], &a)
        .unwrap()
        .expect("room");
    m.complete_store(&out.keys_to_store, &a, true).unwrap();
    let slot = |m: &CpuOffloadingManager, key| m.chunk(&key).unwrap().0;
    let ids = |spec: LoadStoreSpec| spec.chunk_ids().unwrap().to_vec();
    assert_eq!(m.lookup(&k(1), &a), LookupResult::Hit);
    assert_eq!(m.lookup(&k(2), &a), LookupResult::Hit);
    // Key 5 takes key 1's slot (the least recent), which the first lookup's hint names.
    let slot1 = slot(&m, k(1));
    let out = m.prepare_store(&[k(5)], &b).unwrap().expect("room");
    assert_eq!(out.evicted_keys, vec![k(1)]);
    m.complete_store(&out.keys_to_store, &b, true).unwrap();
    assert_eq!(slot(&m, k(5)), slot1);
    assert!(matches!(
        m.prepare_load(&[k(1)], &a),
        Err(TieringError::UnknownKey { .. })
    ));
    assert_eq!(
        m.chunk(&k(5)).unwrap().1,
        0,
        "key 5 was not pinned for key 1"
    );
    // Hints in another order than the load's, and a key never looked up.
    for key in [k(4), k(3), k(5)] {
        assert_eq!(m.lookup(&key, &a), LookupResult::Hit);
    }
    let got = ids(m.prepare_load(&[k(3), k(4), k(2), k(5)], &a).unwrap());
    let want: Vec<i32> = [k(3), k(4), k(2), k(5)]
        .into_iter()
        .map(|key| slot(&m, key) as i32)
        .collect();
    assert_eq!(got, want);
    for key in [k(2), k(3), k(4), k(5)] {
        assert_eq!(m.chunk(&key).unwrap().1, 1, "each key pinned once");
    }
    m.complete_load(&[k(3), k(4), k(2), k(5)], &a).unwrap();
    m.check_invariants().unwrap();
}

/// Everything a store can change, for comparing two managers.
#[allow(clippy::type_complexity)]
fn observable(
    m: &CpuOffloadingManager,
) -> (
    Vec<super::SlotState>,
    Vec<OffloadKey>,
    Vec<OffloadKey>,
    Option<(
        Vec<OffloadKey>,
        Vec<OffloadKey>,
        Vec<OffloadKey>,
        Vec<OffloadKey>,
        f64,
    )>,
    [u64; 4],
    Option<usize>,
) {
    (
        m.slot_states(),
        m.eviction_order(),
        m.evictable_order(),
        m.arc_state(),
        [
            m.stores_skipped(),
            m.num_write_pending() as u64,
            m.num_evictable() as u64,
            m.requests.len() as u64,
        ],
        m.tracker_len(),
    )
}

/// A one-key store (`store_one`, a promotion's path) against the general path given the same
/// one key: two managers given the same calls (stores that fit, evict, cannot be placed, find
/// the key ready, pending or pinned, are filtered by the store threshold; lookups, loads,
/// completions that succeed and fail, requests with and without positions that finish and
/// start again) answer the same and keep the same state, for either policy.
#[test]
fn one_key_stores_match_the_general_path() {
    for policy in [CachePolicyKind::Lru, CachePolicyKind::Arc] {
        for threshold in [1u32, 2] {
            let mut c = CpuManagerConfig::new(6).policy(policy).events(true);
            if threshold > 1 {
                c = c.store_threshold(threshold, 16);
            }
            let (mut one, mut general) = (
                CpuOffloadingManager::new(c.clone()),
                CpuOffloadingManager::new(c),
            );
            let fresh_ctx = |i: usize, epoch: u64| {
                let ctx = ReqContext::new(format!("r{i}"));
                if i == 2 {
                    for k in 0..20u64 {
                        ctx.set_offload_key_position(OffloadKey::from_u64(k), 1000 + epoch * 7 - k);
                    }
                }
                ctx
            };
            let mut ctxs: Vec<ReqContext> = (0..3).map(|i| fresh_ctx(i, 0)).collect();
            for ctx in &ctxs {
                one.on_new_request(ctx).unwrap();
                general.on_new_request(ctx).unwrap();
            }
            let (mut out_one, mut out_general) =
                (PrepareStoreOutput::default(), PrepareStoreOutput::default());
            let mut x: u64 = 0x2545_f491_4f6c_dd1d;
            let mut pending: Vec<(OffloadKey, usize)> = Vec::new();
            let mut pinned: Vec<(OffloadKey, usize)> = Vec::new();
            let (mut placed, mut unplaced, mut evicting) = (0, 0, 0);
            for step in 0..600u64 {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                let r = (x >> 3) as usize % 3;
                let k = OffloadKey::from_u64((x >> 16) % 20);
                match x % 16 {
                    0..=7 => {
                        let a = one.store_into(&[k], &ctxs[r], &mut out_one);
                        let b = general.store_general(&[k], &ctxs[r], &mut out_general);
                        assert_eq!(a, b, "step {step}: placed");
                        assert_eq!(
                            out_one.keys_to_store, out_general.keys_to_store,
                            "step {step}"
                        );
                        assert_eq!(
                            out_one.evicted_keys, out_general.evicted_keys,
                            "step {step}"
                        );
                        assert_eq!(
                            out_one.store_spec.chunk_ids(),
                            out_general.store_spec.chunk_ids(),
                            "step {step}"
                        );
                        if a {
                            placed += 1;
                            evicting += usize::from(!out_one.evicted_keys.is_empty());
                            pending.extend(out_one.keys_to_store.iter().map(|k| (*k, r)));
                        } else {
                            unplaced += 1;
                        }
                    }
                    8 | 9 => {
                        assert_eq!(one.lookup(&k, &ctxs[r]), general.lookup(&k, &ctxs[r]));
                    }
                    10 | 11 if !pending.is_empty() => {
                        let (k, r) = pending.remove((x >> 24) as usize % pending.len());
                        let ok = !x.is_multiple_of(7);
                        one.complete_store(&[k], &ctxs[r], ok).unwrap();
                        general.complete_store(&[k], &ctxs[r], ok).unwrap();
                    }
                    12 => {
                        let hit = one.lookup(&k, &ctxs[r]);
                        assert_eq!(hit, general.lookup(&k, &ctxs[r]), "step {step}");
                        if hit == LookupResult::Hit {
                            let a = one.prepare_load(&[k], &ctxs[r]).unwrap();
                            let b = general.prepare_load(&[k], &ctxs[r]).unwrap();
                            assert_eq!(a.chunk_ids(), b.chunk_ids(), "step {step}");
                            pinned.push((k, r));
                        }
                    }
                    13 if !pinned.is_empty() => {
                        let (k, r) = pinned.remove(0);
                        one.complete_load(&[k], &ctxs[r]).unwrap();
                        general.complete_load(&[k], &ctxs[r]).unwrap();
                    }
                    14 => {
                        // The request finishes and starts again with a new context (its
                        // pinned and pending keys completed first, as vLLM's scheduler does).
                        for (k, _) in pinned.iter().filter(|(_, q)| *q == r) {
                            one.complete_load(&[*k], &ctxs[r]).unwrap();
                            general.complete_load(&[*k], &ctxs[r]).unwrap();
                        }
                        pinned.retain(|(_, q)| *q != r);
                        one.on_request_finished(&ctxs[r]).unwrap();
                        general.on_request_finished(&ctxs[r]).unwrap();
                        ctxs[r] = fresh_ctx(r, step);
                        // Now and then the new context is not announced: its first store
                        // starts its record.
                        if !x.is_multiple_of(3) {
                            one.on_new_request(&ctxs[r]).unwrap();
                            general.on_new_request(&ctxs[r]).unwrap();
                        }
                    }
                    _ => {}
                }
                assert_eq!(observable(&one), observable(&general), "step {step}");
                one.check_invariants().unwrap();
            }
            assert!(
                placed > 50 && unplaced > 5 && evicting > 20,
                "{policy:?}/{threshold}: every outcome is exercised \
                 ({placed} placed, {evicting} of them evicting, {unplaced} not placed)"
            );
            assert_eq!(one.take_events(), general.take_events());
            assert_eq!(one.stats(), general.stats());
        }
    }
}

/// A job's chunk ids as slot hints (`unpin_reads`, `complete_store_hinted`): taken where the
/// slot holds the key, and otherwise (another key's slot, a slot out of range, a negative id,
/// too few ids) the key is found through the index, so every hint list gives the answer no
/// hints give.
#[test]
fn job_slot_hints_are_checked_against_the_slot_s_key() {
    let k = OffloadKey::from_u64;
    let keys = [k(1), k(2), k(3)];
    let bad_hints: [&[i32]; 5] = [&[], &[2, 0, 1], &[99, -1, 4], &[0], &[-7, -7, -7]];
    for hints in bad_hints {
        let (mut m, [a, _, _]) = four_slots_three_requests();
        let out = m.prepare_store(&keys, &a).unwrap().expect("room");
        let slots: Vec<i32> = out.store_spec.chunk_ids().unwrap().to_vec();
        // A failed write of key 2 frees its slot; 1 and 3 land (hinted by `hints`).
        m.complete_store_hinted(&[k(2)], hints.get(1..2).unwrap_or(&[]), &a, false);
        m.complete_store_hinted(&[k(1), k(3)], &[slots[0], slots[2]], &a, true);
        assert_eq!(m.chunk(&k(2)), None, "{hints:?}: the failed key is gone");
        assert_eq!(m.num_write_pending(), 0, "{hints:?}");
        // Pin 1 and 3 twice each (two cascades), then unpin them with the hints under test:
        // each unpin finds its key's own slot.
        let (s1, s3) = (m.chunk(&k(1)).unwrap().0, m.chunk(&k(3)).unwrap().0);
        m.pin_slots(&[s1, s3, s1, s3]);
        let skipped = m.unpin_reads(&[k(1), k(3)], hints);
        assert_eq!(skipped, 0, "{hints:?}");
        assert_eq!(m.chunk(&k(1)).unwrap().1, 1, "{hints:?}");
        assert_eq!(m.chunk(&k(3)).unwrap().1, 1, "{hints:?}");
        // A key not resident is skipped whatever its hint says.
        assert_eq!(m.unpin_reads(&[k(2)], &[s1 as i32]), 1, "{hints:?}");
        assert_eq!(
            m.chunk(&k(1)).unwrap().1,
            1,
            "{hints:?}: key 1 kept its pin"
        );
        m.check_invariants().unwrap();
    }
}

/// vLLM 0.34's store threshold, on both store shapes (a batch, and the one-key store):
/// a request that offers the same keys again (a retry of a failed offer, a re-offer after
/// preemption) counts each key once and its skip once; another request's offer counts.
/// Under 0.33 every offer counts.
#[test]
fn under_0_34_the_store_threshold_counts_a_key_once_per_request() {
    use crate::types::Contract;
    let k = OffloadKey::from_u64;
    for contract in [Contract::V0_33, Contract::V0_34] {
        for keys in [vec![k(1), k(2)], vec![k(2)]] {
            let mut m = CpuOffloadingManager::new(
                CpuManagerConfig::new(4)
                    .store_threshold(3, 64)
                    .contract(contract),
            );
            let a = ReqContext::new("a");
            let mut out = PrepareStoreOutput::default();
            for _ in 0..3 {
                assert!(m.store_into(&keys, &a, &mut out));
            }
            let once = contract == Contract::V0_34;
            assert_eq!(
                m.tracker_count(&k(2)),
                Some(if once { 1 } else { 3 }),
                "{contract:?}"
            );
            assert_eq!(
                m.stores_skipped(),
                if once {
                    keys.len() as u64
                } else {
                    2 * keys.len() as u64
                },
                "{contract:?} {keys:?}: the third offer passes under 0.33 only"
            );
            assert_eq!(out.keys_to_store.is_empty(), once, "{contract:?}");
            let b = ReqContext::new("b");
            assert!(m.store_into(&keys, &b, &mut out));
            assert_eq!(m.tracker_count(&k(2)), Some(if once { 2 } else { 4 }));
        }
    }
}

/// vLLM 0.34: a stored event names the request that completed the store and expects a
/// removal; under 0.33 it carries neither.
#[test]
fn under_0_34_a_stored_event_carries_its_request() {
    use crate::types::Contract;
    let k = OffloadKey::from_u64;
    for contract in [Contract::V0_33, Contract::V0_34] {
        let mut m =
            CpuOffloadingManager::new(CpuManagerConfig::new(2).events(true).contract(contract));
        let w = ReqContext::new("writer");
        m.prepare_store(&[k(1)], &w).unwrap().expect("room");
        m.complete_store(&[k(1)], &w, true).unwrap();
        let ev = m.take_events();
        assert_eq!(ev.len(), 1);
        let v34 = contract == Contract::V0_34;
        assert_eq!(ev[0].removal_expected, v34);
        assert_eq!(
            ev[0].req_context.as_ref().map(|c| c.uid()),
            v34.then(|| w.uid())
        );
    }
}

/// A deferred release (vLLM 0.34): the failed keys miss at once, their slots stay out of
/// the free pool (still write-pending) until released; a key stored again gets a fresh slot;
/// a key that is not a pending write is refused before anything changes; reset_cache refuses
/// while slots are held.
#[test]
fn a_deferred_release_holds_its_slots_until_released() {
    let k = OffloadKey::from_u64;
    let mut m = CpuOffloadingManager::new(CpuManagerConfig::new(4).events(true));
    let a = ReqContext::new("a");
    m.prepare_store(&[k(1), k(2), k(3)], &a)
        .unwrap()
        .expect("room");
    m.complete_store(&[k(3)], &a, true).unwrap();
    let free_before = m.num_free();
    assert!(matches!(
        m.defer_write_release(&[k(1), k(3)]),
        Err(TieringError::KeyState {
            state: "not a pending write",
            ..
        })
    ));
    assert!(matches!(
        m.defer_write_release(&[k(9)]),
        Err(TieringError::KeyState { .. })
    ));
    assert_eq!(
        m.chunk(&k(1)).map(|c| c.1),
        Some(-1),
        "a refused call changes nothing"
    );
    let held = m.defer_write_release(&[k(1), k(2)]).unwrap();
    assert_eq!(held.len(), 2);
    assert_eq!(m.num_deferred_release_chunks(), 2);
    assert_eq!(m.lookup(&k(1), &a), LookupResult::Miss);
    assert_eq!(m.num_free(), free_before, "held slots are not free");
    assert_eq!(m.num_write_pending(), 2);
    let again = m.prepare_store(&[k(1)], &a).unwrap().expect("room");
    let slot = again.store_spec.chunk_ids().unwrap()[0] as u32;
    assert!(
        !held.contains(&slot),
        "a fresh slot, out of the late writer's reach"
    );
    m.complete_store(&[k(1)], &a, true).unwrap();
    assert!(
        m.reset_cache().is_err(),
        "reset_cache while a tier may still write"
    );
    assert!(m.release_deferred_write(&[99]).is_err());
    m.release_deferred_write(&held).unwrap();
    assert_eq!(m.num_deferred_release_chunks(), 0);
    assert_eq!(m.num_write_pending(), 0);
    assert_eq!(m.lookup(&k(1), &a), LookupResult::Hit);
    m.reset_cache().unwrap();
}
