//! Loom model checks of the strong-handle lifetime protocol (see `store.rs`, "Reference
//! counts", and [`Core::pin_if_first`](crate::store::Core::pin_if_first)).
//!
//! These run the **real** code: under `cfg(all(loom, test))` the per-slot strong counts, their
//! fence and the store mutex come from loom (`crate::sync`), so loom explores every
//! interleaving of `ImmutableBlock::drop` (decrement → lock → release → unpin) with matches,
//! weak upgrades, clones, evictions and the manager's own drop. A ghost ledger
//! (`crate::sync::ghost`) asserts that no handle touches a dropped core, and each model
//! checks at the end that exactly the expected `Arc` counts remain (no pin leaked, none
//! dropped twice), plus every pool invariant.
//!
//! ```text
//! RUSTFLAGS="--cfg loom" CARGO_TARGET_DIR=target/loom \
//!     cargo test -p kvbm-logical --release --lib loom
//! ```
//!
//! (`--lib`: the doc tests build the library without its dev-dependencies, loom included.
//! The `loom` filter matters too: the other unit tests use the loom primitives outside a
//! model, which loom forbids.) Each model was checked to fail when the protocol is broken on
//! purpose: dropping the `refs != 0` check in `Store::release_registered` (a stale release
//! parks a revived block in the inactive pool) or unpinning before the locked release (use
//! after free when the manager is dropped concurrently).

use std::sync::{Arc, Weak};

use loom::thread;

use crate::config::{DuplicationPolicy, LogicalConfig};
use crate::hash::{Salt, SequenceHash};
use crate::manager::tests::register;
use crate::registry::RegistryConfig;
use crate::store::Core;
use crate::sync::ghost;
use crate::{BlockManager, EvictionBackend, G2};

const BS: u32 = 4;

/// Exhaustive (no preemption bound unless `LOOM_MAX_PREEMPTIONS` sets one): the models are
/// small enough that every interleaving runs in well under a second in release mode.
fn model(f: impl Fn() + Sync + Send + 'static) {
    loom::model::Builder::new().check(f);
}

fn manager(n: usize, backend: EvictionBackend) -> BlockManager<G2> {
    BlockManager::<G2>::builder()
        .block_count(n)
        .config(LogicalConfig {
            block_size: BS,
            eviction: backend.into(),
            duplication: DuplicationPolicy::Allow,
            touch_on_match: true,
            registry: RegistryConfig {
                frequency_counters_log2: 4,
                decay_factor: 0,
            },
            ..LogicalConfig::default()
        })
        .build()
        .unwrap()
}

fn hash(i: u32) -> SequenceHash {
    SequenceHash::root(Salt::NONE, &[i, i + 1, i + 2, i + 3])
}

/// Only the manager's own count is left: every epoch's pin was dropped exactly once.
fn assert_only_manager_holds(witness: &Weak<Core>) {
    assert_eq!(
        witness.strong_count(),
        1,
        "a slot epoch's pin leaked or was lost"
    );
}

/// The manager and every handle are gone: the core was freed, exactly once.
fn assert_freed(witness: &Weak<Core>) {
    assert_eq!(
        witness.strong_count(),
        0,
        "a pin leaked: the core outlived every handle"
    );
    assert!(!ghost::is_alive(witness.as_ptr()));
}

/// Thread A drops the last handle while thread B revives the block through a weak upgrade,
/// and the manager itself is dropped concurrently on the main thread: whichever of A's
/// release, B's new epoch and the manager's drop comes last frees the core, and nobody
/// touches it afterwards.
#[test]
fn loom_revive_during_release_with_manager_dropped() {
    model(|| {
        let m = manager(1, EvictionBackend::Lru);
        let witness = m.core_witness();
        let mut h = register(&m, &[hash(0)]);
        let h = h.pop().unwrap();
        let w = h.downgrade();
        let a = thread::spawn(move || drop(h));
        let b = thread::spawn(move || {
            if let Some(x) = w.upgrade() {
                let y = x.clone();
                drop(x);
                drop(y);
            }
        });
        drop(m);
        a.join().unwrap();
        b.join().unwrap();
        assert_freed(&witness);
    });
}

/// The revive-during-release race with the manager alive: A's decrement reaches zero, B's
/// match revives the slot (a new epoch, a new pin) before or after A's locked release.
/// A stale release must not park the revived block in the inactive pool: while B's handle
/// lives the block is active; afterwards it is inactive and one count is left.
#[test]
fn loom_revive_during_release() {
    model(|| {
        let m = Arc::new(manager(1, EvictionBackend::Lru));
        let witness = m.core_witness();
        let h = register(&m, &[hash(0)]).pop().unwrap();
        let a = thread::spawn(move || drop(h));
        let m2 = m.clone();
        let b = thread::spawn(move || {
            let hit = m2.match_blocks(&[hash(0)]);
            assert_eq!(hit.len(), 1, "a registered block is always matchable");
            hit
        });
        a.join().unwrap();
        let hit = b.join().unwrap();
        let c = m.check_invariants().unwrap();
        assert_eq!((c.reset, c.held, c.active, c.inactive), (0, 0, 1, 0));
        assert_eq!(hit[0].strong_count(), 1);
        drop(hit);
        let c = m.check_invariants().unwrap();
        assert_eq!((c.reset, c.held, c.active, c.inactive), (0, 0, 0, 1));
        assert_only_manager_holds(&witness);
        drop(m);
        assert_freed(&witness);
    });
}

/// Two handles of one block dropped concurrently (only one decrement reaches zero) while the
/// main thread allocates, which evicts the block once it is inactive.
#[test]
fn loom_last_drops_race_with_eviction() {
    model(|| {
        let m = Arc::new(manager(1, EvictionBackend::Lineage));
        let witness = m.core_witness();
        let h = register(&m, &[hash(0)]).pop().unwrap();
        let h2 = h.clone();
        let w = h.downgrade();
        let a = thread::spawn(move || drop(h));
        let b = thread::spawn(move || drop(h2));
        let allocated = m.allocate_blocks(1);
        a.join().unwrap();
        b.join().unwrap();
        let c = m.check_invariants().unwrap();
        match allocated {
            Ok(blocks) => {
                // evicted: the weak handle must fail, the slot is held
                assert!(w.upgrade().is_none());
                assert_eq!((c.reset, c.held, c.active, c.inactive), (0, 1, 0, 0));
                drop(blocks);
            }
            Err(_) => {
                // still active when allocation looked: it is inactive now and revivable
                assert_eq!((c.reset, c.held, c.active, c.inactive), (0, 0, 0, 1));
                assert!(w.upgrade().is_some());
            }
        }
        assert_only_manager_holds(&witness);
        drop(m);
        assert_freed(&witness);
    });
}

/// A weak upgrade races the last drop and an eviction: the upgrade either revives the block
/// (so the allocation cannot evict it) or fails because it was evicted.
#[test]
fn loom_upgrade_races_release_and_eviction() {
    model(|| {
        let m = Arc::new(manager(1, EvictionBackend::Fifo));
        let witness = m.core_witness();
        let h = register(&m, &[hash(0)]).pop().unwrap();
        let w = h.downgrade();
        let a = thread::spawn(move || drop(h));
        let b = thread::spawn(move || w.upgrade());
        let allocated = m.allocate_blocks(1).ok();
        a.join().unwrap();
        let upgraded = b.join().unwrap();
        let c = m.check_invariants().unwrap();
        match (allocated, upgraded) {
            (Some(_), Some(_)) => panic!("an upgraded block was evicted"),
            (Some(blocks), None) => {
                assert_eq!((c.reset, c.held, c.active, c.inactive), (0, 1, 0, 0));
                drop(blocks);
            }
            (None, Some(up)) => {
                assert_eq!((c.reset, c.held, c.active, c.inactive), (0, 0, 1, 0));
                drop(up);
                let c = m.check_invariants().unwrap();
                assert_eq!((c.reset, c.held, c.active, c.inactive), (0, 0, 0, 1));
            }
            // allocation looked while `h` was alive, the upgrade came after it was released
            // (then it would have revived it) or before (then it held it): impossible either way
            (None, None) => panic!("neither the allocation nor the upgrade got the block"),
        }
        assert_only_manager_holds(&witness);
        drop(m);
        assert_freed(&witness);
    });
}

/// A duplicate's last drop (slot back to the reset pool) and the primary's last drop race a
/// match, which must find the primary and hold it active.
#[test]
fn loom_duplicate_and_primary_release_race_match() {
    model(|| {
        let m = Arc::new(manager(2, EvictionBackend::MultiLru));
        let witness = m.core_witness();
        let primary = register(&m, &[hash(0)]).pop().unwrap();
        let duplicate = register(&m, &[hash(0)]).pop().unwrap();
        assert_ne!(primary.block_id(), duplicate.block_id());
        let primary_id = primary.block_id();
        let a = thread::spawn(move || drop(duplicate));
        let b = thread::spawn(move || drop(primary));
        let hit = m.match_blocks(&[hash(0)]);
        assert_eq!(hit.len(), 1);
        assert_eq!(hit[0].block_id(), primary_id);
        a.join().unwrap();
        b.join().unwrap();
        let c = m.check_invariants().unwrap();
        assert_eq!((c.reset, c.held, c.active, c.inactive), (1, 0, 1, 0));
        drop(hit);
        let c = m.check_invariants().unwrap();
        assert_eq!((c.reset, c.held, c.active, c.inactive), (1, 0, 0, 1));
        assert_only_manager_holds(&witness);
        drop(m);
        assert_freed(&witness);
    });
}
