//! Random call sequences against the tiering manager (two in-memory tiers, one slow) and the
//! plain CPU manager, checking after every call: every slot is in exactly one state
//! (`check_invariants`), no pinned or pending slot and no key of the same call is ever evicted,
//! and after `drain_jobs` (inside `reset_cache`) every job is settled.

use std::collections::HashMap;

use kvbm_tiering::*;
use proptest::prelude::*;

#[derive(Clone, Debug)]
enum Op {
    Lookup(u8, Vec<u8>),
    Load(u8),
    CompleteLoad(u8),
    Store(u8, Vec<u8>),
    CompleteStore(u8, bool),
    Touch(u8, Vec<u8>),
    Finish(u8),
    StepEnd,
    Release,
    Reset,
}

fn op() -> impl Strategy<Value = Op> {
    let keys = prop::collection::vec(0u8..24, 1..6);
    prop_oneof![
        4 => (0u8..4, keys.clone()).prop_map(|(r, k)| Op::Lookup(r, k)),
        2 => (0u8..4).prop_map(Op::Load),
        2 => (0u8..4).prop_map(Op::CompleteLoad),
        4 => (0u8..4, keys.clone()).prop_map(|(r, k)| Op::Store(r, dedup(k))),
        3 => (0u8..4, prop::bool::weighted(0.85)).prop_map(|(r, s)| Op::CompleteStore(r, s)),
        1 => (0u8..4, keys).prop_map(|(r, k)| Op::Touch(r, k)),
        1 => (0u8..4).prop_map(Op::Finish),
        3 => Just(Op::StepEnd),
        1 => Just(Op::Release),
        1 => Just(Op::Reset),
    ]
}

fn dedup(mut v: Vec<u8>) -> Vec<u8> {
    let mut seen = std::collections::HashSet::new();
    v.retain(|x| seen.insert(*x));
    v
}

fn k(i: u8) -> OffloadKey {
    OffloadKey::from_u64(i as u64)
}

#[derive(Default)]
struct Req {
    ctx: Option<ReqContext>,
    hits: Vec<OffloadKey>,
    loads: Vec<Vec<OffloadKey>>,
    stores: Vec<Vec<OffloadKey>>,
}

fn ctx_of<M: OffloadingManager>(m: &mut M, reqs: &mut HashMap<u8, Req>, r: u8) -> ReqContext {
    let e = reqs.entry(r).or_default();
    if e.ctx.is_none() {
        let c = ReqContext::new(format!("r{r}"));
        m.on_new_request(&c).unwrap();
        e.ctx = Some(c);
    }
    e.ctx.clone().unwrap()
}

/// Runs `ops`; `primary` gives the CPU manager to check after each call.
fn run<M: OffloadingManager>(
    m: &mut M,
    ops: &[Op],
    primary: impl Fn(&M) -> &CpuOffloadingManager,
    mut release: impl FnMut(&mut M),
    mut poll: impl FnMut(&mut M),
) {
    let mut reqs: HashMap<u8, Req> = HashMap::new();
    for op in ops {
        // states before the call, to check evictions (after the poll `prepare_store` makes)
        if matches!(op, Op::Store(..)) {
            poll(m);
        }
        let before: HashMap<OffloadKey, i32> = {
            let p = primary(m);
            (0u8..24)
                .filter_map(|i| p.chunk(&k(i)).map(|c| (k(i), c.1)))
                .collect()
        };
        match op {
            Op::Lookup(r, keys) => {
                let c = ctx_of(m, &mut reqs, *r);
                let mut hits = Vec::new();
                for &i in keys {
                    match m.lookup(&k(i), &c) {
                        LookupResult::Hit => hits.push(k(i)),
                        LookupResult::Miss => break,
                        _ => {}
                    }
                }
                reqs.get_mut(r).unwrap().hits = hits;
            }
            Op::Load(r) => {
                let c = ctx_of(m, &mut reqs, *r);
                let hits = std::mem::take(&mut reqs.get_mut(r).unwrap().hits);
                if !hits.is_empty() && m.prepare_load(&hits, &c).is_ok() {
                    reqs.get_mut(r).unwrap().loads.push(hits);
                }
            }
            Op::CompleteLoad(r) => {
                if let Some(e) = reqs.get_mut(r)
                    && !e.loads.is_empty()
                {
                    let keys = e.loads.remove(0);
                    let c = e.ctx.clone().unwrap();
                    m.complete_load(&keys, &c).unwrap();
                }
            }
            Op::Store(r, keys) => {
                let c = ctx_of(m, &mut reqs, *r);
                let keys: Vec<OffloadKey> = keys.iter().map(|&i| k(i)).collect();
                if let Ok(Some(o)) = m.prepare_store(&keys, &c) {
                    for ev in &o.evicted_keys {
                        assert_eq!(before.get(ev), Some(&0), "evicted {ev} was not evictable");
                        assert!(!keys.contains(ev), "evicted a key of the same call");
                    }
                    if !o.keys_to_store.is_empty() {
                        reqs.get_mut(r).unwrap().stores.push(o.keys_to_store);
                    }
                }
            }
            Op::CompleteStore(r, ok) => {
                if let Some(e) = reqs.get_mut(r)
                    && !e.stores.is_empty()
                {
                    let keys = e.stores.remove(0);
                    let c = e.ctx.clone().unwrap();
                    m.complete_store(&keys, &c, *ok).unwrap();
                }
            }
            Op::Touch(r, keys) => {
                let c = ctx_of(m, &mut reqs, *r);
                let keys: Vec<OffloadKey> = keys.iter().map(|&i| k(i)).collect();
                m.touch(&keys, &c).unwrap();
            }
            Op::Finish(r) => {
                if let Some(e) = reqs.remove(r) {
                    let c = e.ctx.clone().unwrap();
                    m.on_request_finished(&c).unwrap();
                    // completions may still arrive after finish
                    for l in e.loads {
                        m.complete_load(&l, &c).unwrap();
                    }
                    for s in e.stores {
                        m.complete_store(&s, &c, true).unwrap();
                    }
                }
            }
            Op::StepEnd => m.on_schedule_end(&ScheduleEndContext::default()).unwrap(),
            Op::Release => release(m),
            Op::Reset => {
                // the connector finishes in-flight GPU transfers before a reset
                for e in reqs.values_mut() {
                    let c = e.ctx.clone().unwrap();
                    for l in e.loads.drain(..) {
                        m.complete_load(&l, &c).unwrap();
                    }
                    e.stores.clear();
                    e.hits.clear();
                }
                m.reset_cache().unwrap();
                m.on_reset_flushed();
                assert!(!m.has_pending_work(), "every job settled after drain_jobs");
            }
        }
        let p = primary(m);
        p.check_invariants().unwrap();
        for s in p.slot_states() {
            if let SlotState::Pinned(n) = s {
                assert!(n > 0);
            }
        }
    }
}

fn tiering(policy: CachePolicyKind, fixes: bool) -> TieringOffloadingManager {
    let mut cfg = TieringConfig::new(8, 64);
    cfg.primary = cfg.primary.policy(policy).events(true);
    cfg.fixes = if fixes {
        UpstreamFixes::default()
    } else {
        UpstreamFixes::upstream()
    };
    let mut slow = InMemoryTier::new(64);
    slow.hold_jobs = true;
    TieringOffloadingManager::new(cfg, vec![Box::new(InMemoryTier::new(64)), Box::new(slow)])
        .unwrap()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 128, ..ProptestConfig::default() })]

    #[test]
    fn tiering_invariants(ops in prop::collection::vec(op(), 1..120), arc in any::<bool>(), fixes in any::<bool>()) {
        let policy = if arc { CachePolicyKind::Arc } else { CachePolicyKind::Lru };
        let mut m = tiering(policy, fixes);
        run(
            &mut m,
            &ops,
            |m: &TieringOffloadingManager| m.primary().manager(),
            |m: &mut TieringOffloadingManager| m.tier_mut::<InMemoryTier>(1).unwrap().release_held(),
            |m: &mut TieringOffloadingManager| m.poll_tiers(),
        );
        m.reset_cache().unwrap();
        prop_assert_eq!(m.num_jobs(), 0);
        prop_assert!(!m.has_pending_work());
    }

    #[test]
    fn cpu_invariants(ops in prop::collection::vec(op(), 1..120), arc in any::<bool>()) {
        let policy = if arc { CachePolicyKind::Arc } else { CachePolicyKind::Lru };
        // vLLM's CPU-only manager: the scheduler-facing manager whose primary answers alone.
        let mut m = TieringOffloadingManager::cpu(CpuManagerConfig::new(8).policy(policy).events(true));
        run(&mut m, &ops, |m: &TieringOffloadingManager| m.primary().manager(), |_: &mut TieringOffloadingManager| {}, |_: &mut TieringOffloadingManager| {});
    }
}
