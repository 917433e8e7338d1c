//! Misuse of the contract is a typed error naming the call and the key (or request), returned
//! before any state changes.

use kvbm_tiering::*;

fn k(i: u64) -> OffloadKey {
    OffloadKey::from_u64(i)
}

fn snapshot(m: &CpuOffloadingManager) -> (Vec<SlotState>, Vec<OffloadKey>, Vec<u32>, usize, usize) {
    (
        m.slot_states(),
        m.eviction_order(),
        m.free_list().to_vec(),
        m.num_evictable(),
        m.num_write_pending(),
    )
}

fn cpu() -> (CpuOffloadingManager, ReqContext) {
    let mut m = CpuOffloadingManager::new(CpuManagerConfig::new(4));
    let c = ReqContext::new("r");
    let o = m.prepare_store(&[k(1), k(2)], &c).unwrap().unwrap();
    m.complete_store(&o.keys_to_store, &c, true).unwrap();
    m.prepare_store(&[k(3)], &c).unwrap().unwrap(); // 3 stays pending
    (m, c)
}

#[test]
fn prepare_load_of_a_missing_key_names_call_and_key() {
    let (mut m, c) = cpu();
    let before = snapshot(&m);
    let e = m.prepare_load(&[k(1), k(9)], &c).unwrap_err();
    assert!(
        matches!(e, TieringError::UnknownKey { call: "prepare_load", key } if key == k(9)),
        "{e}"
    );
    assert!(
        e.to_string().contains("prepare_load") && e.to_string().contains('9'),
        "{e}"
    );
    assert_eq!(before, snapshot(&m), "key 1 was not pinned");
}

#[test]
fn prepare_load_of_a_pending_key_is_refused() {
    let (mut m, c) = cpu();
    let before = snapshot(&m);
    let e = m.prepare_load(&[k(1), k(3)], &c).unwrap_err();
    assert!(
        matches!(e, TieringError::KeyState { call: "prepare_load", key, .. } if key == k(3)),
        "{e}"
    );
    assert_eq!(before, snapshot(&m));
}

#[test]
fn complete_load_without_prepare_is_refused() {
    let (mut m, c) = cpu();
    m.prepare_load(&[k(1)], &c).unwrap();
    let before = snapshot(&m);
    let e = m.complete_load(&[k(1), k(2)], &c).unwrap_err();
    assert!(
        matches!(e, TieringError::KeyState { call: "complete_load", key, .. } if key == k(2)),
        "{e}"
    );
    assert_eq!(before, snapshot(&m), "key 1 still pinned");
    let e = m.complete_load(&[k(7)], &c).unwrap_err();
    assert!(
        matches!(
            e,
            TieringError::UnknownKey {
                call: "complete_load",
                ..
            }
        ),
        "{e}"
    );
}

fn tiering() -> (TieringOffloadingManager, ReqContext) {
    let mut cfg = TieringConfig::new(4, 64);
    cfg.fixes = UpstreamFixes::upstream();
    let m = TieringOffloadingManager::new(cfg, vec![Box::new(InMemoryTier::new(64))]).unwrap();
    (m, ReqContext::new("r"))
}

#[test]
fn tiering_calls_for_unknown_requests_are_refused() {
    let (mut m, c) = tiering();
    let e = m.prepare_store(&[k(1)], &c).unwrap_err();
    assert!(
        matches!(&e, TieringError::UnknownRequest { call: "prepare_store", req_id } if req_id == "r"),
        "{e}"
    );
    assert_eq!(m.primary().manager().len(), 0, "nothing allocated");
    let e = m.complete_store(&[k(1)], &c, true).unwrap_err();
    assert!(
        matches!(
            e,
            TieringError::UnknownRequest {
                call: "complete_store",
                ..
            }
        ),
        "{e}"
    );
    let e = m.on_request_finished(&c).unwrap_err();
    assert!(
        matches!(
            e,
            TieringError::UnknownRequest {
                call: "on_request_finished",
                ..
            }
        ),
        "{e}"
    );
}

#[test]
fn complete_store_without_prepare_is_refused() {
    let (mut m, c) = tiering();
    m.on_new_request(&c).unwrap();
    let e = m.complete_store(&[k(1)], &c, true).unwrap_err();
    assert!(
        matches!(
            e,
            TieringError::NoPendingStore {
                call: "complete_store",
                ..
            }
        ),
        "{e}"
    );
    let o = m.prepare_store(&[k(1)], &c).unwrap().unwrap();
    // a key that was never prepared: refused, and nothing cascaded or completed
    let e = m.complete_store(&[k(1), k(5)], &c, true).unwrap_err();
    assert!(
        matches!(e, TieringError::UnknownKey { call: "complete_store", key } if key == k(5)),
        "{e}"
    );
    assert_eq!(m.primary().manager().num_write_pending(), 1);
    assert_eq!(m.num_jobs(), 0);
    m.complete_store(&o.keys_to_store, &c, true).unwrap();
    assert_eq!(m.num_jobs(), 1);
}

#[test]
fn keys_longer_than_supported_are_refused() {
    let e = make_offload_key(&[7u8; 36], 0).unwrap_err();
    assert_eq!((e.len, e.max), (40, OffloadKey::MAX_LEN), "{e}");
    // The crate's error carries it, with the same message.
    let t = TieringError::from(e);
    assert!(matches!(t, TieringError::InvalidKey { len: 40, .. }), "{t}");
    assert_eq!(t.to_string(), e.to_string());
    assert!(
        make_offload_key(&[7u8; 32], 3).is_ok(),
        "sha-256 hashes fit"
    );
}

#[test]
fn calls_after_shutdown_are_refused() {
    let (mut m, c) = tiering();
    m.on_new_request(&c).unwrap();
    m.shutdown().unwrap();
    assert!(matches!(
        m.prepare_store(&[k(1)], &c),
        Err(TieringError::Shutdown { .. })
    ));
    assert!(m.primary().memory().is_none());
}

#[test]
fn failed_tier_shutdown_keeps_primary_memory() {
    let (mut m, c) = tiering();
    m.on_new_request(&c).unwrap();
    m.tier_mut::<InMemoryTier>(0).unwrap().fail_shutdown = true;
    assert!(matches!(
        m.shutdown(),
        Err(TieringError::Tier { tier: 0, .. })
    ));
    assert!(
        m.primary().memory().is_some(),
        "a failed tier may still use primary memory"
    );
}
