//! kvbm's fixes of upstream bugs, each behind one `UpstreamFixes` switch: every test shows the
//! upstream behaviour with the switch off and the fixed behaviour with it on.

use std::time::Duration;

use kvbm_tiering::stats::names;
use kvbm_tiering::*;

fn k(i: u64) -> OffloadKey {
    OffloadKey::from_u64(i)
}
fn manager(fixes: UpstreamFixes) -> TieringOffloadingManager {
    let mut cfg = TieringConfig::new(8, 64);
    cfg.fixes = fixes;
    TieringOffloadingManager::new(cfg, vec![Box::new(InMemoryTier::new(64))]).unwrap()
}
fn tier(m: &mut TieringOffloadingManager) -> &mut InMemoryTier {
    m.tier_mut::<InMemoryTier>(0).unwrap()
}
fn end(m: &mut TieringOffloadingManager) {
    m.on_schedule_end(&ScheduleEndContext::default()).unwrap();
}

/// vLLM #49176: a tier that says HIT but whose loads fail. Upstream re-promotes forever.
#[test]
fn failed_load_releases_slots_and_reads_miss() {
    for fixed in [false, true] {
        let fixes = UpstreamFixes {
            failed_load_reads_miss: fixed,
            ..UpstreamFixes::upstream()
        };
        let mut m = manager(fixes);
        let c = ReqContext::new("r");
        m.on_new_request(&c).unwrap();
        tier(&mut m).insert(k(1));
        tier(&mut m).fail_loads = true;
        for step in 0..3 {
            let r = m.lookup(&k(1), &c);
            if fixed && step > 0 {
                assert_eq!(r, LookupResult::Miss, "step {step}");
            } else {
                assert_eq!(r, LookupResult::HitPending, "fixed={fixed} step {step}");
            }
            end(&mut m);
            end(&mut m);
            let p = m.primary().manager();
            assert_eq!(p.num_write_pending(), 0, "slot released after the failure");
            assert_eq!(p.len(), 0);
            p.check_invariants().unwrap();
        }
        assert_eq!(tier(&mut m).loads, if fixed { 1 } else { 3 });
        if fixed {
            // cascading the key to the tier again clears the mark
            tier(&mut m).fail_loads = false;
            let o = m.prepare_store(&[k(1)], &c).unwrap().unwrap();
            m.complete_store(&o.keys_to_store, &c, true).unwrap();
            end(&mut m);
            end(&mut m);
            m.primary_mut().manager_mut().reset_cache().unwrap();
            assert_eq!(m.lookup(&k(1), &c), LookupResult::HitPending);
        }
    }
}

/// vLLM #49829: a promotion that never finishes defers its request forever upstream.
#[test]
fn hit_pending_deadline_cancels_to_miss() {
    for fixed in [false, true] {
        let fixes = UpstreamFixes {
            hit_pending_deadline: fixed.then_some(Duration::ZERO),
            ..UpstreamFixes::upstream()
        };
        let mut m = manager(fixes);
        let c = ReqContext::new("r");
        m.on_new_request(&c).unwrap();
        tier(&mut m).insert(k(1));
        tier(&mut m).hold_jobs = true;
        assert_eq!(m.lookup(&k(1), &c), LookupResult::HitPending);
        end(&mut m); // submits the load
        end(&mut m); // past the deadline
        let want = if fixed {
            LookupResult::Miss
        } else {
            LookupResult::HitPending
        };
        assert_eq!(m.lookup(&k(1), &c), want);
        // slots stay reserved while the tier may still write them
        assert_eq!(m.primary().manager().num_write_pending(), 1);
        if fixed {
            let s = m.get_stats().unwrap();
            assert_eq!(
                s.counter(names::HIT_PENDING_DEADLINE_EXPIRED, None),
                Some(1.0)
            );
            // a late prepare_store of the key does not double-allocate it
            let o = m.prepare_store(&[k(1)], &c).unwrap().unwrap();
            assert!(o.keys_to_store.is_empty());
        }
        tier(&mut m).release_held();
        end(&mut m);
        end(&mut m);
        assert_eq!(m.lookup(&k(1), &c), LookupResult::Hit);
        assert_eq!(m.num_jobs(), 0);
        m.primary().manager().check_invariants().unwrap();
    }
}

/// vLLM #49902: every waiting request's lookup promotes, filling the primary.
#[test]
fn promotions_capped_per_step() {
    for fixed in [false, true] {
        let fixes = UpstreamFixes {
            max_promotions_per_step: fixed.then_some(2),
            ..UpstreamFixes::upstream()
        };
        let mut m = manager(fixes);
        let c = ReqContext::new("r");
        m.on_new_request(&c).unwrap();
        for i in 0..5 {
            tier(&mut m).insert(k(i));
        }
        let r: Vec<_> = (0..5).map(|i| m.lookup(&k(i), &c)).collect();
        let pending = r.iter().filter(|x| **x == LookupResult::HitPending).count();
        assert_eq!(pending, if fixed { 2 } else { 5 });
        end(&mut m);
        // the cap is per step: last step's promotions landed (HIT), two more start
        let r: Vec<_> = (0..5).map(|i| m.lookup(&k(i), &c)).collect();
        let count = |w| r.iter().filter(|x| **x == w).count();
        if fixed {
            assert_eq!(
                (count(LookupResult::Hit), count(LookupResult::HitPending)),
                (2, 2)
            );
        } else {
            assert_eq!(count(LookupResult::Hit), 5);
        }
    }
}

/// vLLM #48102: a job the tier never reports leaves stale state after `reset_cache`.
#[test]
fn reset_cache_leaves_no_stale_job() {
    for fixed in [false, true] {
        let fixes = UpstreamFixes {
            reset_drops_stale_jobs: fixed,
            ..UpstreamFixes::upstream()
        };
        let mut m = manager(fixes);
        let c = ReqContext::new("r");
        m.on_new_request(&c).unwrap();
        tier(&mut m).hold_jobs = true;
        tier(&mut m).lose_jobs_on_drain = true;
        tier(&mut m).insert(k(9));
        let o = m.prepare_store(&[k(1)], &c).unwrap().unwrap();
        m.complete_store(&o.keys_to_store, &c, true).unwrap();
        assert_eq!(m.lookup(&k(9), &c), LookupResult::HitPending);
        end(&mut m);
        assert_eq!(m.num_jobs(), 2);
        let r = m.reset_cache();
        if !fixed {
            assert!(matches!(r, Err(TieringError::Tier { .. })), "{r:?}");
            assert!(m.has_pending_work(), "upstream keeps the stale jobs");
            continue;
        }
        r.unwrap();
        assert_eq!(m.num_jobs(), 0);
        assert!(!m.has_pending_work());
        // late reports of the dropped jobs are ignored
        tier(&mut m).push_result(JobResult::new(0, true));
        tier(&mut m).push_result(JobResult::new(1, true));
        end(&mut m);
        assert_eq!(m.lookup(&k(9), &c), LookupResult::Miss);
        m.on_reset_flushed();
        tier(&mut m).hold_jobs = false;
        assert_eq!(m.lookup(&k(9), &c), LookupResult::HitPending);
        end(&mut m);
        end(&mut m);
        assert_eq!(m.lookup(&k(9), &c), LookupResult::Hit);
        m.primary().manager().check_invariants().unwrap();
    }
}

/// Every fix off reproduces upstream; `default()` has every fix on.
#[test]
fn fixes_switches() {
    let up = UpstreamFixes::upstream();
    assert!(!up.failed_load_reads_miss && up.hit_pending_deadline.is_none());
    assert!(up.max_promotions_per_step.is_none() && !up.reset_drops_stale_jobs);
    let on = UpstreamFixes::default();
    assert!(on.failed_load_reads_miss && on.hit_pending_deadline.is_some());
    assert!(on.max_promotions_per_step.is_some() && on.reset_drops_stale_jobs);
}
