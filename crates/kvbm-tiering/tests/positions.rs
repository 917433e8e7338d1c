//! Positional recency (end-token positions recorded on the request context, vLLM 0.33): expected
//! victims computed with vLLM 0.33.0's own `CPUOffloadingManager` on the same calls (the replay
//! format cannot express positions, so these were run once through the script's loader).

use kvbm_tiering::*;

fn k(i: u64) -> OffloadKey {
    OffloadKey::from_u64(i)
}

/// `reversed`: the keys stored first end latest in the prompt (positions opposite to the
/// order of the calls), so only a manager that orders by position gets vLLM's victims.
fn victims(policy: CachePolicyKind, finish_a: bool, reversed: bool) -> Vec<OffloadKey> {
    let mut m = CpuOffloadingManager::new(CpuManagerConfig::new(8).policy(policy));
    let a = ReqContext::new("a");
    let ka = [k(1), k(2), k(3), k(4)];
    for (i, key) in ka.iter().enumerate() {
        let rank = if reversed { 4 - i as u64 } else { i as u64 + 1 };
        a.set_offload_key_position(*key, rank * 16);
    }
    m.on_new_request(&a).unwrap();
    let o = m.prepare_store(&ka, &a).unwrap().unwrap();
    m.complete_store(&o.keys_to_store, &a, true).unwrap();
    let b = ReqContext::new("b");
    m.on_new_request(&b).unwrap();
    let o = m.prepare_store(&[k(10), k(11)], &b).unwrap().unwrap();
    m.complete_store(&o.keys_to_store, &b, true).unwrap();
    m.prepare_load(&[k(2)], &b).unwrap();
    m.complete_load(&[k(2)], &b).unwrap();
    if finish_a {
        m.on_request_finished(&a).unwrap();
    }
    m.on_request_finished(&b).unwrap();
    let c = ReqContext::new("c");
    m.on_new_request(&c).unwrap();
    let keys: Vec<OffloadKey> = (20..26).map(k).collect();
    m.prepare_store(&keys, &c).unwrap().unwrap().evicted_keys
}

/// Checks each `(policy, finish_a, expected victims)` case with positions in call order or
/// `reversed`.
fn check(reversed: bool, cases: [(CachePolicyKind, bool, [u64; 4]); 4]) {
    for (policy, finish_a, want) in cases {
        let want: Vec<OffloadKey> = want.iter().map(|&i| k(i)).collect();
        assert_eq!(
            victims(policy, finish_a, reversed),
            want,
            "{policy:?}, finish_a {finish_a}, reversed {reversed}"
        );
    }
}

#[test]
fn positional_recency_matches_vllm_0_33() {
    use CachePolicyKind::{Arc, Lru};
    check(
        false,
        [
            (Lru, false, [4, 3, 1, 2]),
            (Lru, true, [4, 3, 1, 2]),
            (Arc, false, [1, 3, 4, 11]),
            (Arc, true, [4, 3, 1, 11]),
        ],
    );
}

/// Positions opposite to the order of the calls: a finished request's keys are ranked by
/// position, not by when they were stored (vLLM 0.33.0's victims on the same calls).
#[test]
fn positions_against_call_order_match_vllm_0_33() {
    use CachePolicyKind::{Arc, Lru};
    check(
        true,
        [
            (Lru, false, [1, 3, 4, 2]),
            (Lru, true, [1, 3, 4, 2]),
            (Arc, false, [1, 3, 4, 11]),
            (Arc, true, [1, 3, 4, 11]),
        ],
    );
}
