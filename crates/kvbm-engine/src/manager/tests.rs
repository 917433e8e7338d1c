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
            .tiering_manager(MoversToG2::default(), rt.handle().clone())
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

// ---------------------------------------------------------------------------------------------
// Evicted keys, touch across tiers, stats.

use kvbm_logical::{EvictionBackend, G3, G4};
use kvbm_tiering::stats::names;

fn lru<T: kvbm_logical::Tier>(blocks: usize, registry: &BlockRegistry) -> Arc<BlockManager<T>> {
    Arc::new(
        BlockManager::<T>::builder()
            .block_count(blocks)
            .block_size(4)
            .eviction(EvictionBackend::Lru)
            .registry(registry.clone())
            .build()
            .unwrap(),
    )
}

/// Registers `hashes` (in order) as inactive blocks of `m`.
fn register<T: kvbm_logical::Tier>(m: &BlockManager<T>, hashes: &[SequenceHash]) {
    let blocks = m.allocate_blocks(hashes.len()).unwrap();
    let complete = blocks
        .into_iter()
        .zip(hashes)
        .map(|(b, h)| b.complete(*h).unwrap())
        .collect();
    drop(m.register_blocks(complete));
}

/// Stores `keys` for `ctx` (prepare + complete with success); the evicted keys.
fn store(m: &mut EngineTieringManager, keys: &[OffloadKey], ctx: &ReqContext) -> Vec<OffloadKey> {
    let out = m.prepare_store(keys, ctx).unwrap().expect("room to store");
    m.complete_store(&out.keys_to_store, ctx, true).unwrap();
    out.evicted_keys
}

fn in_g2(m: &EngineTieringManager, key: &OffloadKey) -> bool {
    m.leader().accessor().is_present(m.hash_of(key), TierId::G2)
}

#[test]
fn prepare_store_on_a_full_g2_returns_exactly_the_evicted_keys_never_its_own() {
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    let reg = BlockRegistry::new();
    let g2 = lru::<G2>(4, &reg);
    let leader = InstanceLeader::builder().g2(g2.clone()).build().unwrap();
    let mut m = leader
        .tiering_manager(MoversToG2::default(), rt.handle().clone())
        .unwrap();
    let ctx = ReqContext::new("r");
    m.on_new_request(&ctx).unwrap();
    assert!(store(&mut m, &[k(0), k(1), k(2), k(3)], &ctx).is_empty());
    assert_eq!(g2.available_blocks(), 4, "all four inactive: G2 is full");
    // k0 is the least recently used, but it is one of this call's keys: never evicted for it.
    let out = m
        .prepare_store(&[k(0), k(4), k(5)], &ctx)
        .unwrap()
        .expect("two evictable blocks");
    assert_eq!(out.keys_to_store, vec![k(4), k(5)]);
    assert_eq!(
        out.evicted_keys,
        vec![k(1), k(2)],
        "LRU order, k0 protected"
    );
    assert!(in_g2(&m, &k(0)) && in_g2(&m, &k(3)));
    assert!(!in_g2(&m, &k(1)) && !in_g2(&m, &k(2)));
    // The removal went out as an event too.
    let events = m.take_events();
    assert!(
        events
            .iter()
            .any(|e| e.removed && e.keys == vec![k(1), k(2)]),
        "{events:?}"
    );
    m.complete_store(&out.keys_to_store, &ctx, true).unwrap();
    // Every block is a protected key of the call or reserved: nothing can be stored.
    let all: Vec<OffloadKey> = (0..6).map(k).collect();
    // G2 holds k0 k3 k4 k5; storing k1 k2 beside k0 k3 k4 would need k5 and one of them.
    assert!(m.prepare_store(&all[..5], &ctx).unwrap().is_none());
    assert!(in_g2(&m, &k(5)), "a refused store evicts nothing");
    let out = m
        .prepare_store(&[k(0), k(1), k(3), k(4)], &ctx)
        .unwrap()
        .unwrap();
    assert_eq!(
        (out.keys_to_store, out.evicted_keys),
        (vec![k(1)], vec![k(5)])
    );
}

#[test]
fn touch_reaches_g2_g3_and_g4_recency() {
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    // G2: k0 then k1 stored; touching k0 makes k1 the one a store evicts.
    for touch in [false, true] {
        let reg = BlockRegistry::new();
        let g2 = lru::<G2>(2, &reg);
        let g3 = lru::<G3>(2, &reg);
        let g4 = lru::<G4>(2, &reg);
        let leader = InstanceLeader::builder()
            .g2(g2.clone())
            .g3(g3.clone())
            .g4(g4.clone())
            .build()
            .unwrap();
        let mut m = leader
            .tiering_manager(MoversToG2::default(), rt.handle().clone())
            .unwrap();
        let ctx = ReqContext::new("r");
        m.on_new_request(&ctx).unwrap();
        store(&mut m, &[k(0)], &ctx);
        store(&mut m, &[k(1)], &ctx);
        register(&g3, &[m.hash_of(&k(10)), m.hash_of(&k(11))]);
        register(&g4, &[m.hash_of(&k(20)), m.hash_of(&k(21))]);
        if touch {
            m.touch(&[k(0), k(10), k(20)], &ctx).unwrap();
        }
        let evicted = store(&mut m, &[k(2)], &ctx);
        let g3_evicted = g3
            .allocate_blocks_with(1, &[] as &[SequenceHash])
            .unwrap()
            .evicted;
        let g4_evicted = g4
            .allocate_blocks_with(1, &[] as &[SequenceHash])
            .unwrap()
            .evicted;
        if touch {
            assert_eq!(
                g4_evicted,
                vec![m.hash_of(&k(21))],
                "touched k20 is recent in G4"
            );
            assert_eq!(evicted, vec![k(1)], "touched k0 is recent in G2");
            assert_eq!(
                g3_evicted,
                vec![m.hash_of(&k(11))],
                "touched k10 is recent in G3"
            );
        } else {
            assert_eq!(evicted, vec![k(0)]);
            assert_eq!(g3_evicted, vec![m.hash_of(&k(10))]);
            assert_eq!(g4_evicted, vec![m.hash_of(&k(20))]);
        }
    }
}

#[test]
fn get_stats_reports_g2_usage_allocations_and_per_tier_queries() {
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    let reg = BlockRegistry::new();
    let g2 = lru::<G2>(4, &reg);
    let g3 = lru::<G3>(4, &reg);
    let leader = InstanceLeader::builder()
        .g2(g2.clone())
        .g3(g3.clone())
        .build()
        .unwrap();
    // No promotion movers: a G3 hit reads MISS (it cannot be promoted) but is counted.
    let mut m = leader
        .tiering_manager(MoversToG2::default(), rt.handle().clone())
        .unwrap();
    let ctx = ReqContext::new("r");
    m.on_new_request(&ctx).unwrap();
    register(&g3, &[m.hash_of(&k(5))]);
    let out = m.prepare_store(&[k(0), k(1)], &ctx).unwrap().unwrap();
    let s = m.get_stats().expect("stats");
    assert_eq!(s.gauge(names::CPU_CACHE_USAGE_PERC, None), Some(0.5));
    assert_eq!(s.gauge(names::CPU_CACHE_WRITE_USAGE_PERC, None), Some(0.5));
    assert_eq!(s.gauge(names::CPU_CACHE_READ_USAGE_PERC, None), Some(0.0));
    assert_eq!(
        s.histogram(names::CPU_ALLOCATION_SIZE, None),
        Some(&[2.0][..])
    );
    m.complete_store(&out.keys_to_store, &ctx, true).unwrap();
    assert_eq!(m.lookup(&k(0), &ctx), LookupResult::Hit);
    assert_eq!(m.lookup(&k(5), &ctx), LookupResult::Miss);
    assert_eq!(m.lookup(&k(6), &ctx), LookupResult::Miss);
    m.prepare_load(&[k(0)], &ctx).unwrap();
    let s = m.get_stats().expect("stats");
    assert_eq!(
        s.counter(names::CHUNK_QUERIES, Some("0:primary")),
        Some(3.0)
    );
    assert_eq!(s.counter(names::CHUNK_HITS, Some("0:primary")), Some(1.0));
    assert_eq!(s.counter(names::CHUNK_QUERIES, Some("1:disk")), Some(2.0));
    assert_eq!(s.counter(names::CHUNK_HITS, Some("1:disk")), Some(1.0));
    assert_eq!(
        s.gauge(names::ACTIVE_PROMOTION_JOBS, Some("1:disk")),
        Some(0.0)
    );
    assert_eq!(
        s.gauge(names::CPU_CACHE_USAGE_PERC, None),
        Some(0.25),
        "k0 pinned"
    );
    assert_eq!(s.gauge(names::CPU_CACHE_READ_USAGE_PERC, None), Some(0.25));
    assert_eq!(
        s.histogram(names::CPU_ALLOCATION_SIZE, None),
        None,
        "drained"
    );
    // Counters are since the last call.
    let s = m.get_stats().expect("stats");
    assert_eq!(s.counter(names::CHUNK_QUERIES, Some("0:primary")), None);
}

#[derive(Clone, Debug)]
enum StoreOp {
    Store(Vec<u64>, bool),
    Touch(u64),
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(128))]
    /// Against a model of which keys G2 holds: `keys_to_store` is the call's new keys,
    /// `evicted_keys` is exactly what left G2, never one of the call's keys.
    #[test]
    fn prepare_store_evicted_keys_match_a_model(ops in proptest::collection::vec(prop_oneof![
        3 => (proptest::collection::vec(0u64..10, 1..6), any::<bool>()).prop_map(|(k, ok)| StoreOp::Store(k, ok)),
        1 => (0u64..10).prop_map(StoreOp::Touch),
    ], 1..40)) {
        let rt = tokio::runtime::Builder::new_current_thread().build().unwrap();
        let g2 = lru::<G2>(BLOCKS, &BlockRegistry::new());
        let leader = InstanceLeader::builder().g2(g2).build().unwrap();
        let mut m = leader.tiering_manager(MoversToG2::default(), rt.handle().clone()).unwrap();
        let ctx = ReqContext::new("r");
        m.on_new_request(&ctx).unwrap();
        let mut present: HashSet<u64> = HashSet::new();
        let id = |key: &OffloadKey| (0..10).find(|x| k(*x) == *key).unwrap();
        for op in ops {
            match op {
                StoreOp::Touch(x) => m.touch(&[k(x)], &ctx).unwrap(),
                StoreOp::Store(xs, ok) => {
                    let keys: Vec<OffloadKey> = xs.iter().map(|x| k(*x)).collect();
                    let mut seen = HashSet::new();
                    let new: Vec<u64> = xs.iter().copied()
                        .filter(|x| seen.insert(*x) && !present.contains(x)).collect();
                    match m.prepare_store(&keys, &ctx).unwrap() {
                        None => prop_assert!(new.len() > BLOCKS - (xs.iter().filter(|x| present.contains(x)).collect::<HashSet<_>>().len()).min(BLOCKS)),
                        Some(out) => {
                            let stored: Vec<u64> = out.keys_to_store.iter().map(id).collect();
                            prop_assert_eq!(&stored, &new);
                            let evicted: HashSet<u64> = out.evicted_keys.iter().map(id).collect();
                            prop_assert_eq!(evicted.len(), out.evicted_keys.len(), "an evicted key twice");
                            for x in &evicted {
                                prop_assert!(present.contains(x), "evicted {} was not in G2", x);
                                prop_assert!(!xs.contains(x), "evicted {} is one of the call's keys", x);
                            }
                            m.complete_store(&out.keys_to_store, &ctx, ok).unwrap();
                            present.retain(|x| !evicted.contains(x));
                            if ok {
                                present.extend(stored);
                            }
                        }
                    }
                }
            }
            let actual: HashSet<u64> = (0..10).filter(|x| in_g2(&m, &k(*x))).collect();
            prop_assert_eq!(&actual, &present);
        }
    }
}

/// A sink recording, by hash, what the manager handed on: for every lane, and for the
/// request-level lanes only.
#[derive(Clone, Default)]
struct Recording {
    request_level: bool,
    stored: Arc<parking_lot::Mutex<Vec<SequenceHash>>>,
    resident: Arc<parking_lot::Mutex<Vec<SequenceHash>>>,
}

impl StoreSink for Recording {
    fn stored(&mut self, blocks: Vec<ImmutableBlock<G2>>) {
        self.stored
            .lock()
            .extend(blocks.iter().map(|b| b.sequence_hash()));
    }
    fn request_level(&mut self, blocks: Vec<ImmutableBlock<G2>>) {
        self.resident
            .lock()
            .extend(blocks.iter().map(|b| b.sequence_hash()));
    }
    fn has_request_level(&self) -> bool {
        self.request_level
    }
}

fn g2_manager(rt: &tokio::runtime::Runtime, blocks: usize) -> EngineTieringManager {
    let g2 = Arc::new(
        BlockManager::<G2>::builder()
            .block_count(blocks)
            .block_size(4)
            .registry(BlockRegistry::new())
            .build()
            .unwrap(),
    );
    InstanceLeader::builder()
        .g2(g2)
        .build()
        .unwrap()
        .tiering_manager(MoversToG2::default(), rt.handle().clone())
        .unwrap()
}

fn stored(m: &mut EngineTieringManager, ctx: &ReqContext, ks: &[u64]) {
    let keys: Vec<OffloadKey> = ks.iter().map(|x| k(*x)).collect();
    let out = m.prepare_store(&keys, ctx).unwrap().expect("room");
    m.complete_store(&out.keys_to_store, ctx, true).unwrap();
}

/// A request-level request's store hands its resident blocks to the request-level lanes (not
/// what it stores itself: that goes to every lane); a key whose G2 block another request is
/// still writing waits, keeping the manager's work pending, and goes on at the first step end
/// after it was written; a chunk-level sink makes every request chunk level.
#[test]
fn request_level_lanes_get_a_requests_resident_blocks_and_written_ones_once_settled() {
    use kvbm_tiering::{OffloadScope, ScheduleEndContext};
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let mut m = g2_manager(&rt, 16);
    let rec = Recording {
        request_level: true,
        ..Recording::default()
    };
    m.set_store_sink(Box::new(rec.clone()));
    let h = |m: &EngineTieringManager, ks: &[u64]| -> Vec<SequenceHash> {
        ks.iter().map(|x| m.hash_of(&k(*x))).collect()
    };
    let end = ScheduleEndContext::default();

    let r1 = ReqContext::new("r1");
    assert_eq!(
        m.on_new_request(&r1).unwrap().policy,
        OffloadScope::RequestLevel
    );
    stored(&mut m, &r1, &[0, 1, 2, 3]);
    assert_eq!(*rec.stored.lock(), h(&m, &[0, 1, 2, 3]));
    assert!(rec.resident.lock().is_empty(), "nothing was resident");

    // r2 is writing k4 (prepared, not completed).
    let r2 = ReqContext::new("r2");
    m.on_new_request(&r2).unwrap();
    let w = m.prepare_store(&[k(4)], &r2).unwrap().expect("room");
    assert_eq!(w.keys_to_store, vec![k(4)]);

    // r3 offers its whole request: k0, k1 resident; k4 being written; k5 new.
    let r3 = ReqContext::new("r3");
    m.on_new_request(&r3).unwrap();
    let out = m
        .prepare_store(&[k(0), k(1), k(4), k(5)], &r3)
        .unwrap()
        .expect("room");
    assert_eq!(out.keys_to_store, vec![k(5)]);
    assert_eq!(*rec.resident.lock(), h(&m, &[0, 1]));
    assert!(m.has_pending_work(), "k4 waits for its write");
    m.on_schedule_end(&end).unwrap();
    assert_eq!(
        *rec.resident.lock(),
        h(&m, &[0, 1]),
        "still being written: k4 waits"
    );
    m.complete_store(&out.keys_to_store, &r3, true).unwrap();
    m.on_request_finished(&r3).unwrap();

    m.complete_store(&[k(4)], &r2, true).unwrap();
    m.on_schedule_end(&end).unwrap();
    assert_eq!(*rec.resident.lock(), h(&m, &[0, 1, 4]));
    assert!(!m.has_pending_work());
    assert_eq!(*rec.stored.lock(), h(&m, &[0, 1, 2, 3, 5, 4]));

    // A chunk-level sink: requests are chunk level and hand nothing resident on.
    let mut m = g2_manager(&rt, 16);
    let chunk = Recording::default();
    m.set_store_sink(Box::new(chunk.clone()));
    let r = ReqContext::new("r");
    assert_eq!(
        m.on_new_request(&r).unwrap().policy,
        OffloadScope::ChunkLevel
    );
    stored(&mut m, &r, &[0, 1]);
    let out = m.prepare_store(&[k(0), k(1), k(2)], &r).unwrap().unwrap();
    assert_eq!(out.keys_to_store, vec![k(2)]);
    assert!(chunk.resident.lock().is_empty());
}
