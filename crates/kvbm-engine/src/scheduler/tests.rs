//! A proptest of the scheduler contract's bookkeeping over a G2-only leader (no bytes move:
//! the worker's copies are not what is checked here). Random calls from two requests against a
//! model of holds: a key `prepare_load` pinned stays a `HIT` until its `complete_load`; G2's
//! free blocks are exactly the total minus the distinct pinned keys and the reserved stores;
//! misuse (completing what was not prepared, loading a non-hit) fails and changes nothing; and
//! once every request finished and completed, every block is free again.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use kvbm_logical::{BlockManager, BlockRegistry, G2};
use kvbm_tiering::{LookupResult, OffloadKey, OffloadingManager, ReqContext};
use proptest::prelude::*;

use super::*;
use crate::leader::InstanceLeader;

const BLOCKS: usize = 4;

#[derive(Clone, Debug)]
enum Op {
    Lookup(usize, u64),
    Load(usize, Vec<u64>),
    CompleteLoad(usize, Vec<u64>),
    Store(usize, Vec<u64>),
    CompleteStore(usize, bool),
}

fn keys() -> impl Strategy<Value = Vec<u64>> {
    proptest::collection::vec(0u64..6, 1..3)
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        (0usize..2, 0u64..6).prop_map(|(r, k)| Op::Lookup(r, k)),
        (0usize..2, keys()).prop_map(|(r, k)| Op::Load(r, k)),
        (0usize..2, keys()).prop_map(|(r, k)| Op::CompleteLoad(r, k)),
        (0usize..2, keys()).prop_map(|(r, k)| Op::Store(r, k)),
        (0usize..2, any::<bool>()).prop_map(|(r, ok)| Op::CompleteStore(r, ok)),
    ]
}

fn k(i: u64) -> OffloadKey {
    OffloadKey::from_u64(i)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(128))]
    #[test]
    fn scheduler_calls_keep_holds_and_free_blocks_consistent(ops in proptest::collection::vec(op(), 1..40)) {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        let g2 = Arc::new(
            BlockManager::<G2>::builder().block_count(BLOCKS).block_size(4)
                .registry(BlockRegistry::new()).build().unwrap(),
        );
        let leader = InstanceLeader::builder().g2(g2.clone()).build().unwrap();
        let mut m = leader
            .tiering_manager(PromotionMovers::default(), rt.handle().clone())
            .unwrap();
        let ctx = [ReqContext::new("r0"), ReqContext::new("r1")];
        for c in &ctx {
            m.on_new_request(c).unwrap();
        }
        // Model: outstanding loads per (request, key); reserved stores per request.
        let mut pins: HashMap<(usize, u64), usize> = HashMap::new();
        let mut reserved: Vec<Vec<u64>> = vec![Vec::new(), Vec::new()];
        for op in ops {
            match op {
                Op::Lookup(r, key) => {
                    let got = m.lookup(&k(key), &ctx[r]);
                    let pinned = pins.iter().any(|((_, kk), n)| *kk == key && *n > 0);
                    if pinned {
                        prop_assert_eq!(got, LookupResult::Hit, "a pinned key stays a hit");
                    } else {
                        prop_assert!(matches!(got, LookupResult::Hit | LookupResult::Miss));
                    }
                }
                Op::Load(r, ks) => {
                    let hits: Vec<bool> = ks.iter().map(|x| m.lookup(&k(*x), &ctx[r]) == LookupResult::Hit).collect();
                    let keys: Vec<OffloadKey> = ks.iter().map(|x| k(*x)).collect();
                    let res = m.prepare_load(&keys, &ctx[r]);
                    prop_assert_eq!(res.is_ok(), hits.iter().all(|h| *h), "{:?}", res);
                    if let Ok(spec) = res {
                        prop_assert_eq!(spec.chunk_ids().map(<[i32]>::len), Some(ks.len()));
                        for x in ks {
                            *pins.entry((r, x)).or_default() += 1;
                        }
                    }
                }
                Op::CompleteLoad(r, ks) => {
                    let keys: Vec<OffloadKey> = ks.iter().map(|x| k(*x)).collect();
                    let mut need: HashMap<u64, usize> = HashMap::new();
                    for x in &ks {
                        *need.entry(*x).or_default() += 1;
                    }
                    let ok = need.iter().all(|(x, n)| pins.get(&(r, *x)).copied().unwrap_or(0) >= *n);
                    let res = m.complete_load(&keys, &ctx[r]);
                    prop_assert_eq!(res.is_ok(), ok, "{:?}", res);
                    if ok {
                        for x in ks {
                            *pins.get_mut(&(r, x)).unwrap() -= 1;
                        }
                    }
                }
                Op::Store(r, ks) => {
                    let keys: Vec<OffloadKey> = ks.iter().map(|x| k(*x)).collect();
                    if let Some(out) = m.prepare_store(&keys, &ctx[r]).unwrap() {
                        let stored: HashSet<u64> = out.keys_to_store.iter()
                            .map(|key| (0..6).find(|x| k(*x) == *key).unwrap()).collect();
                        for x in &stored {
                            prop_assert!(!reserved.iter().flatten().any(|y| y == x), "a key reserved twice");
                        }
                        reserved[r].extend(stored);
                    }
                }
                Op::CompleteStore(r, ok) => {
                    let keys: Vec<OffloadKey> = reserved[r].iter().map(|x| k(*x)).collect();
                    m.complete_store(&keys, &ctx[r], ok).unwrap();
                    reserved[r].clear();
                    // Completing again is misuse (nothing reserved any more), unless empty.
                    if !keys.is_empty() {
                        prop_assert!(m.complete_store(&keys, &ctx[r], ok).is_err());
                    }
                }
            }
            let pinned: HashSet<u64> = pins.iter().filter(|(_, n)| **n > 0).map(|((_, x), _)| *x).collect();
            let active = pinned.len() + reserved.iter().map(Vec::len).sum::<usize>();
            prop_assert_eq!(g2.available_blocks(), BLOCKS - active);
        }
        // Drain everything, finish both requests: every block is free.
        for (r, c) in ctx.iter().enumerate() {
            let outstanding: Vec<OffloadKey> = pins.iter()
                .filter(|((rr, _), _)| *rr == r)
                .flat_map(|((_, x), n)| std::iter::repeat_n(k(*x), *n))
                .collect();
            m.complete_load(&outstanding, c).unwrap();
            let keys: Vec<OffloadKey> = reserved[r].iter().map(|x| k(*x)).collect();
            m.complete_store(&keys, c, false).unwrap();
            m.on_request_finished(c).unwrap();
        }
        prop_assert_eq!(g2.available_blocks(), BLOCKS);
        prop_assert!(!m.has_pending_work());
    }
}
