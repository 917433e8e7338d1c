//! `store_into` with a reused output against `store_inner` with a fresh one: two managers
//! given the same calls (stores that fit, that evict, that find keys resident or pending,
//! that cannot be placed, with events) answer the same and keep the same state.

use super::{CpuManagerConfig, CpuOffloadingManager, PrepareStoreOutput};
use crate::cpu::CachePolicyKind;
use crate::key::OffloadKey;
use crate::types::{CpuLoadStoreSpec, LoadStoreSpec, ReqContext};

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
