//! Tests of the block manager: lifecycle, matching, duplication, eviction order per backend,
//! events and errors.

use std::sync::Arc;

use super::*;
use crate::events::{BlockEvent, BlockEventKind, VecSink};
use crate::hash::{Salt, TokenBlockSequence};
use crate::tier::{G1, G2, G3, G4};
use crate::{EvictionPolicy, FreeSlotReuse, TierId};

const BS: u32 = 4;

fn manager(n: usize, backend: EvictionBackend) -> BlockManager<G2> {
    BlockManager::<G2>::builder()
        .block_count(n)
        .block_size(BS)
        .eviction(backend)
        .build()
        .unwrap()
}

/// `n` chained hashes of one sequence, distinguished by `seed`.
fn chain(seed: u32, n: usize) -> Vec<SequenceHash> {
    let tokens: Vec<u32> = (0..(n as u32 * BS)).map(|t| t + seed * 1_000_000).collect();
    TokenBlockSequence::from_tokens(&tokens, BS, Salt::NONE)
        .unwrap()
        .hashes()
}

/// Allocates, completes and registers one block per hash (shared with the loom models).
pub(crate) fn register<T: Tier>(
    m: &BlockManager<T>,
    hashes: &[SequenceHash],
) -> Vec<ImmutableBlock<T>> {
    let blocks = m.allocate_blocks(hashes.len()).unwrap();
    let complete = blocks
        .into_iter()
        .zip(hashes)
        .map(|(b, h)| b.complete(*h).unwrap())
        .collect();
    m.register_blocks(complete)
}

fn ids<T: Tier>(blocks: &[ImmutableBlock<T>]) -> Vec<usize> {
    blocks.iter().map(|b| b.block_id()).collect()
}

fn counts(m: &BlockManager<G2>) -> (usize, usize, usize, usize) {
    let c = m.check_invariants().unwrap();
    (c.reset, c.held, c.active, c.inactive)
}

#[test]
fn builder_validates() {
    assert!(matches!(
        BlockManager::<G1>::builder().build(),
        Err(LogicalError::InvalidConfig(_))
    ));
    assert!(matches!(
        BlockManager::<G1>::builder().block_count(0).build(),
        Err(LogicalError::InvalidConfig(_))
    ));
    assert_eq!(
        BlockManager::<G1>::builder()
            .block_count(4)
            .block_size(12)
            .build()
            .unwrap_err(),
        LogicalError::InvalidBlockSize { block_size: 12 }
    );
    let m = BlockManager::<G1>::builder()
        .block_count(4)
        .build()
        .unwrap();
    assert_eq!(m.block_size(), 16, "default block size");
    assert_eq!(m.total_blocks(), 4);
    assert_eq!(m.available_blocks(), 4);
    assert_eq!(m.tier(), TierId::G1);
}

#[test]
fn lifecycle_moves_slots_between_pools() {
    let m = manager(4, EvictionBackend::Lru);
    let h = chain(1, 2);
    let mut blocks = m.allocate_blocks(3).unwrap();
    assert_eq!(
        blocks.iter().map(|b| b.block_id()).collect::<Vec<_>>(),
        vec![0, 1, 2]
    );
    assert_eq!(counts(&m), (1, 3, 0, 0));
    drop(blocks.pop()); // mutable drop -> reset
    assert_eq!(counts(&m), (2, 2, 0, 0));
    let complete: Vec<_> = blocks
        .into_iter()
        .zip(&h)
        .map(|(b, h)| b.complete(*h).unwrap())
        .collect();
    assert_eq!(complete[1].sequence_hash(), h[1]);
    assert_eq!(counts(&m), (2, 2, 0, 0));
    let immutables = m.register_blocks(complete);
    assert_eq!(counts(&m), (2, 0, 2, 0));
    assert_eq!(immutables[0].sequence_hash(), h[0]);
    let extra = immutables[0].clone();
    assert_eq!(extra.strong_count(), 2);
    drop(immutables);
    // block 0 still held by `extra`
    assert_eq!(counts(&m), (2, 0, 1, 1));
    drop(extra);
    assert_eq!(counts(&m), (2, 0, 0, 2));
    assert_eq!(m.available_blocks(), 4);
    // inactive blocks are still matchable and get revived
    let matched = m.match_blocks(&h);
    assert_eq!(ids(&matched), vec![0, 1]);
    assert_eq!(counts(&m), (2, 0, 2, 0));
    drop(matched);
    assert_eq!(m.reset_inactive_pool(), 2);
    assert_eq!(counts(&m), (4, 0, 0, 0));
    assert!(m.match_blocks(&h).is_empty());
}

#[test]
fn complete_block_drop_and_reset_return_slots() {
    let m = manager(2, EvictionBackend::Lru);
    let h = chain(1, 1);
    let b = m.allocate_blocks(1).unwrap().pop().unwrap();
    let c = b.complete(h[0]).unwrap();
    let b = c.reset();
    assert_eq!(counts(&m), (1, 1, 0, 0));
    let c = b.complete(h[0]).unwrap();
    drop(c);
    assert_eq!(counts(&m), (2, 0, 0, 0));
    assert!(
        m.match_blocks(&h).is_empty(),
        "an unregistered block is never matchable"
    );
}

#[test]
fn complete_with_wrong_block_size_hands_the_block_back() {
    let m = manager(2, EvictionBackend::Lru);
    let wrong = SequenceHash::root(Salt::NONE, &[1, 2, 3, 4, 5, 6, 7, 8]);
    let b = m.allocate_blocks(1).unwrap().pop().unwrap();
    let id = b.block_id();
    let err = b.complete(wrong).unwrap_err();
    assert!(matches!(
        err.error,
        LogicalError::BlockSizeMismatch {
            expected: 4,
            actual: 8,
            ..
        }
    ));
    let back = err.into_block();
    assert_eq!(back.block_id(), id);
    assert_eq!(counts(&m), (1, 1, 0, 0));
    drop(back);
    assert_eq!(counts(&m), (2, 0, 0, 0));
}

#[test]
fn allocate_is_all_or_nothing_with_a_clear_error() {
    let m = manager(4, EvictionBackend::Lru);
    let held = m.allocate_blocks(3).unwrap();
    let err = m.allocate_blocks(2).unwrap_err();
    assert_eq!(
        err,
        LogicalError::InsufficientBlocks {
            tier: TierId::G2,
            requested: 2,
            available: 1,
            total: 4
        }
    );
    assert!(err.to_string().contains("cannot allocate 2 blocks"));
    assert_eq!(counts(&m), (1, 3, 0, 0), "nothing was handed out");
    drop(held);
    assert_eq!(m.allocate_blocks(4).unwrap().len(), 4);
    assert_eq!(m.allocate_blocks(0).unwrap().len(), 0);
}

#[test]
fn allocate_evicts_inactive_blocks_and_clears_presence() {
    let m = manager(4, EvictionBackend::Lru);
    let h = chain(1, 4);
    drop(register(&m, &h));
    assert!(h.iter().all(|x| m.registry().is_present(*x, TierId::G2)));
    let got = m.allocate_blocks(3).unwrap();
    assert_eq!(got.len(), 3);
    // LRU: released in order 0,1,2,3 -> evicts 0,1,2
    assert_eq!(ids(&m.match_blocks(&h[3..])), vec![3]);
    assert!(m.match_blocks(&h).is_empty(), "prefix broken at block 0");
    assert!(!m.registry().is_present(h[0], TierId::G2));
    assert!(m.registry().is_present(h[3], TierId::G2));
    assert!(
        m.registry().is_present(h[3], TierId::G2) && !m.registry().is_present(h[3], TierId::G3)
    );
}

#[test]
fn match_is_longest_contiguous_prefix_and_scan_is_not() {
    let m = manager(8, EvictionBackend::Lru);
    let h = chain(1, 5);
    let regs = register(&m, &[h[0], h[1], h[3], h[4]]);
    assert_eq!(ids(&m.match_blocks(&h)), vec![0, 1]);
    let scanned = m.scan_matches(&h);
    assert_eq!(
        scanned
            .iter()
            .map(|b| b.sequence_hash())
            .collect::<Vec<_>>(),
        vec![h[0], h[1], h[3], h[4]]
    );
    assert!(m.match_blocks(&h[2..]).is_empty());
    assert!(m.match_blocks(&[]).is_empty());
    drop(regs);
}

#[test]
fn matching_touches_the_registry() {
    let m = manager(4, EvictionBackend::Lru);
    let h = chain(1, 2);
    let _r = register(&m, &h);
    for _ in 0..3 {
        drop(m.match_blocks(&h));
    }
    assert_eq!(m.registry().frequency(h[0]), 3);
    let quiet = BlockManager::<G3>::builder()
        .block_count(2)
        .block_size(BS)
        .eviction(EvictionBackend::Lru)
        .touch_on_match(false)
        .build()
        .unwrap();
    let _r = register(&quiet, &h);
    drop(quiet.match_blocks(&h));
    assert_eq!(quiet.registry().frequency(h[0]), 0);
}

#[test]
fn duplicates_allowed_by_default() {
    let m = manager(4, EvictionBackend::Lru);
    let h = chain(1, 1);
    let a = register(&m, &h);
    let b = register(&m, &h);
    assert_ne!(a[0].block_id(), b[0].block_id());
    assert_eq!(b[0].sequence_hash(), h[0]);
    assert_eq!(counts(&m), (2, 0, 2, 0));
    // a match returns the primary
    assert_eq!(ids(&m.match_blocks(&h)), vec![a[0].block_id()]);
    drop(b); // a duplicate goes straight back to reset
    assert_eq!(counts(&m), (3, 0, 1, 0));
    drop(a);
    assert_eq!(counts(&m), (3, 0, 0, 1));
}

#[test]
fn duplicates_rejected_return_the_existing_block() {
    let m = BlockManager::<G2>::builder()
        .block_count(4)
        .block_size(BS)
        .duplication_policy(DuplicationPolicy::Reject)
        .build()
        .unwrap();
    let h = chain(1, 1);
    let a = register(&m, &h);
    drop(a); // inactive now: a rejected duplicate must revive it
    let b = register(&m, &h);
    assert_eq!(ids(&b), vec![0]);
    assert_eq!(counts(&m), (3, 0, 1, 0));
}

#[test]
fn weak_blocks_upgrade_until_evicted() {
    let m = manager(2, EvictionBackend::Lru);
    let h = chain(1, 2);
    let strong = register(&m, &h);
    let weak = strong[0].downgrade();
    let weak2 = weak.clone();
    assert_eq!(weak.sequence_hash(), h[0]);
    let up = weak.upgrade().expect("active");
    assert_eq!(up.block_id(), strong[0].block_id());
    drop(up);
    drop(strong);
    // inactive: upgrade revives
    let up = weak2.upgrade().expect("inactive but cached");
    assert_eq!(counts(&m), (0, 0, 1, 1));
    drop(up);
    // evict everything
    let held = m.allocate_blocks(2).unwrap();
    assert!(weak.upgrade().is_none(), "evicted");
    drop(held);
    // the same hash registered again (other slot) is found by hash
    let again = register(&m, &h[..1]);
    assert_eq!(
        weak.upgrade().map(|b| b.block_id()),
        Some(again[0].block_id())
    );
    drop(again);
    drop(m);
    // the manager lives on while blocks exist; once both are gone, upgrade fails cleanly
    assert!(weak.upgrade().is_none());
}

/// A registration lasts while the block is active or inactive (a match keeps it); the slot's
/// next registration, after eviction, is another.
#[test]
fn registration_survives_matches_and_changes_after_eviction() {
    let m = manager(1, EvictionBackend::Lru);
    let h = chain(3, 1);
    let first = register(&m, &h);
    let (slot, reg) = (first[0].block_id(), first[0].registration());
    assert_eq!(first[0].clone().registration(), reg);
    drop(first);
    let matched = m.match_blocks(&h);
    assert_eq!(
        (matched[0].block_id(), matched[0].registration()),
        (slot, reg)
    );
    drop(matched);
    // evicted and registered again under the same hash, in the same (only) slot
    let again = register(&m, &h);
    assert_eq!(again[0].block_id(), slot);
    assert_ne!(again[0].registration(), reg);
}

#[test]
fn blocks_keep_the_manager_alive() {
    let m = manager(2, EvictionBackend::Lru);
    let h = chain(1, 1);
    let strong = register(&m, &h);
    let weak = strong[0].downgrade();
    drop(m);
    assert_eq!(strong[0].sequence_hash(), h[0]);
    drop(strong);
    assert!(weak.upgrade().is_none());
}

/// Releases `hashes` in the given order (each registered as its own 1-block batch), then
/// allocates one block at a time and records which hashes disappear.
fn eviction_order(m: &BlockManager<G2>, hashes: &[SequenceHash], release: &[usize]) -> Vec<usize> {
    let mut handles: Vec<Option<ImmutableBlock<G2>>> =
        register(m, hashes).into_iter().map(Some).collect();
    for &i in release {
        handles[i] = None;
    }
    let mut order = Vec::new();
    let mut held = Vec::new();
    while m.available_blocks() > 0 {
        let Ok(mut b) = m.allocate_blocks(1) else {
            break;
        };
        held.push(b.pop().unwrap());
        let gone: Vec<usize> = (0..hashes.len())
            .filter(|&i| !order.contains(&i) && !m.registry().is_present(hashes[i], TierId::G2))
            .collect();
        order.extend(gone);
    }
    order
}

fn independent(n: usize) -> Vec<SequenceHash> {
    (0..n as u32).map(|i| chain(i + 1, 1)[0]).collect()
}

#[test]
fn lru_evicts_least_recently_released_and_revival_refreshes() {
    let m = manager(4, EvictionBackend::Lru);
    let h = independent(4);
    // release order 2, 0, 3, 1
    let order = eviction_order(&m, &h, &[2, 0, 3, 1]);
    assert_eq!(order, vec![2, 0, 3, 1]);

    let m = manager(3, EvictionBackend::Lru);
    let h = independent(3);
    drop(register(&m, &h)); // released 0, 1, 2
    drop(m.match_blocks(&h[..1])); // 0 is used again -> most recent
    let _b = m.allocate_blocks(2).unwrap();
    assert!(m.registry().is_present(h[0], TierId::G2));
    assert!(!m.registry().is_present(h[1], TierId::G2));
    assert!(!m.registry().is_present(h[2], TierId::G2));
}

#[test]
fn fifo_evicts_in_registration_order_regardless_of_reuse() {
    let m = manager(4, EvictionBackend::Fifo);
    let h = independent(4);
    let order = eviction_order(&m, &h, &[2, 0, 3, 1]);
    assert_eq!(order, vec![0, 1, 2, 3]);

    let m = manager(3, EvictionBackend::Fifo);
    let h = independent(3);
    drop(register(&m, &h));
    drop(m.match_blocks(&h[..1])); // reuse does not save block 0
    let _b = m.allocate_blocks(1).unwrap();
    assert!(!m.registry().is_present(h[0], TierId::G2));
    assert!(m.registry().is_present(h[1], TierId::G2));
}

#[test]
fn fifo_order_survives_eviction_skipping_active_blocks() {
    let m = manager(5, EvictionBackend::Fifo);
    let h = independent(4);
    let mut regs = register(&m, &h);
    let b3 = regs.pop().unwrap();
    let b2 = regs.pop().unwrap();
    let b1 = regs.pop().unwrap();
    let b0 = regs.pop().unwrap();
    drop((b2, b3));
    // 1 reset + 2 inactive; the eviction skips (parks) active 0 and 1, evicts 2
    let first = m.allocate_blocks(2).unwrap();
    assert!(!m.registry().is_present(h[2], TierId::G2));
    assert_eq!(counts(&m), (0, 2, 2, 1));
    // released in reverse registration order: both go back ahead of 3, oldest first
    drop(b1);
    drop(b0);
    assert_eq!(counts(&m), (0, 2, 0, 3));
    drop(first);
    assert_eq!(counts(&m), (2, 0, 0, 3));
    let mut held = m.allocate_blocks(2).unwrap(); // the reset pool first
    let mut order = Vec::new();
    while let Ok(mut b) = m.allocate_blocks(1) {
        held.push(b.pop().unwrap());
        let gone: Vec<usize> = (0..h.len())
            .filter(|&i| i != 2 && !order.contains(&i))
            .filter(|&i| !m.registry().is_present(h[i], TierId::G2))
            .collect();
        order.extend(gone);
    }
    assert_eq!(order, vec![0, 1, 3]);
    assert_eq!(counts(&m), (0, 5, 0, 0));
}

#[test]
fn multi_lru_evicts_low_frequency_first() {
    let m = manager(4, EvictionBackend::MultiLru);
    let h = independent(4);
    // frequencies: h0 -> 9 (level 2), h1 -> 0, h2 -> 4 (level 1), h3 -> 15 (level 3)
    for (i, f) in [(0, 9), (2, 4), (3, 15)] {
        for _ in 0..f {
            m.registry().touch(h[i]);
        }
    }
    // release the hot ones first so plain LRU would evict them first
    let order = eviction_order(&m, &h, &[3, 0, 2, 1]);
    assert_eq!(order, vec![1, 2, 0, 3]);
}

#[test]
fn lineage_evicts_leaves_first() {
    let m = manager(6, EvictionBackend::Lineage);
    let h = chain(1, 4); // one chain 0 -> 1 -> 2 -> 3
    let other = independent(2); // two roots
    let mut all = h.clone();
    all.extend(&other);
    // release parents first: an LRU would evict h[0] first and strand the chain
    let order = eviction_order(&m, &all, &[0, 1, 2, 3, 4, 5]);
    assert_eq!(
        &order[..4],
        &[3, 2, 1, 0],
        "the chain goes tail first: {order:?}"
    );
    // and never a parent before its child
    for (i, x) in order.iter().enumerate() {
        if *x < 3 {
            let child_pos = order.iter().position(|&c| c == x + 1).unwrap();
            assert!(
                child_pos < i,
                "parent {x} evicted before its child: {order:?}"
            );
        }
    }
}

#[test]
fn lineage_never_evicts_a_parent_of_an_active_block() {
    let m = manager(3, EvictionBackend::Lineage);
    let h = chain(1, 3);
    let mut regs = register(&m, &h);
    let leaf = regs.pop().unwrap(); // keep block 2 active
    drop(regs); // 0 and 1 inactive, but both are ancestors of an active block
    assert_eq!(m.available_blocks(), 2);
    let err = m.allocate_blocks(1).unwrap_err();
    assert!(matches!(
        err,
        LogicalError::InsufficientBlocks { available: 0, .. }
    ));
    assert!(h.iter().all(|x| m.registry().is_present(*x, TierId::G2)));
    assert_eq!(m.reset_inactive_pool(), 0);
    drop(leaf);
    // now the whole chain is evictable, leaf first
    let b = m.allocate_blocks(1).unwrap();
    assert!(!m.registry().is_present(h[2], TierId::G2));
    assert!(m.registry().is_present(h[1], TierId::G2));
    drop(b);
    assert_eq!(m.reset_inactive_pool(), 2);
    m.check_invariants().unwrap();
}

#[test]
fn lineage_revival_and_reregistration_keep_invariants() {
    let m = manager(4, EvictionBackend::Lineage);
    let h = chain(1, 4);
    drop(register(&m, &h));
    let mid = m.match_blocks(&h[..2]);
    m.check_invariants().unwrap();
    // only block 3 (a leaf) and then 2 are evictable while 0,1 are active
    let b = m.allocate_blocks(2).unwrap();
    assert!(!m.registry().is_present(h[3], TierId::G2));
    assert!(!m.registry().is_present(h[2], TierId::G2));
    drop(b);
    drop(mid);
    // re-register the tail: links to the cached parent again
    let tail = register(&m, &h[2..]);
    m.check_invariants().unwrap();
    drop(tail);
    assert_eq!(m.reset_inactive_pool(), 4);
    m.check_invariants().unwrap();
}

#[test]
fn every_backend_reaches_the_same_totals() {
    for backend in [
        EvictionBackend::Lru,
        EvictionBackend::MultiLru,
        EvictionBackend::Lineage,
        EvictionBackend::Fifo,
    ] {
        let m = manager(16, backend);
        for seed in 0..10 {
            let h = chain(seed, 4);
            let got = m.match_blocks(&h);
            if got.len() < 4 {
                drop(got);
                drop(register(&m, &h));
            }
            m.check_invariants()
                .unwrap_or_else(|e| panic!("{backend:?}: {e}"));
        }
        let c = m.check_invariants().unwrap();
        assert_eq!(c.reset + c.inactive, 16, "{backend:?}");
    }
}

#[test]
fn registry_is_shared_across_tiers() {
    let registry = BlockRegistry::new();
    let g2 = BlockManager::<G2>::builder()
        .block_count(2)
        .block_size(BS)
        .registry(registry.clone())
        .build()
        .unwrap();
    let g3 = BlockManager::<G3>::builder()
        .block_count(2)
        .block_size(BS)
        .registry(registry.clone())
        .build()
        .unwrap();
    let h = chain(1, 1);
    let a = register(&g2, &h);
    assert!(registry.is_present(h[0], TierId::G2));
    assert!(!registry.is_present(h[0], TierId::G3));
    let b = register(&g3, &h);
    assert_eq!(registry.tiers(h[0]), vec![TierId::G2, TierId::G3]);
    assert_eq!(registry.len(), 1, "one entry per hash");
    drop((a, b));
    g2.reset_inactive_pool();
    assert_eq!(registry.tiers(h[0]), vec![TierId::G3]);
}

#[test]
fn events_are_stored_then_removed_in_batches() {
    let sink = Arc::new(VecSink::new());
    let m = BlockManager::<G1>::builder()
        .block_count(2)
        .block_size(BS)
        .event_sink(sink.clone())
        .event_batching(EventBatchConfig {
            max_batch: 2,
            max_delay_ms: 60_000,
        })
        .build()
        .unwrap();
    let h = chain(1, 2);
    drop(register(&m, &h)); // 2 stored -> a full batch
    assert_eq!(sink.batches().len(), 1);
    let b = m.allocate_blocks(1).unwrap(); // 1 removed, buffered
    assert_eq!(sink.events().len(), 2);
    m.flush_events();
    let ev = |kind, hash| BlockEvent {
        kind,
        tier: TierId::G1,
        hash,
    };
    assert_eq!(
        sink.events(),
        vec![
            ev(BlockEventKind::Stored, h[0]),
            ev(BlockEventKind::Stored, h[1]),
            ev(BlockEventKind::Removed, h[0]),
        ]
    );
    drop(b);
    m.reset_inactive_pool();
    drop(m); // the last handle flushes
    assert_eq!(
        sink.events().last(),
        Some(&ev(BlockEventKind::Removed, h[1]))
    );
}

#[test]
fn an_idle_partial_batch_is_flushed_by_the_owners_timer() {
    let sink = Arc::new(VecSink::new());
    let m = BlockManager::<G2>::builder()
        .block_count(2)
        .block_size(BS)
        .event_sink(sink.clone())
        .event_batching(EventBatchConfig {
            max_batch: 100,
            max_delay_ms: 5_000,
        })
        .build()
        .unwrap();
    assert_eq!(m.next_event_deadline(), None);
    let start = std::time::Instant::now();
    let h = chain(1, 1);
    let held = register(&m, &h); // 1 stored event, a partial batch
    let deadline = m
        .next_event_deadline()
        .expect("a partial batch is buffered");
    assert!(deadline >= start + std::time::Duration::from_secs(5));
    // the tier is idle: nothing publishes until the owner's timer fires at the deadline
    assert!(!m.flush_due_events(start));
    assert!(sink.batches().is_empty());
    assert!(m.flush_due_events(deadline));
    assert_eq!(
        sink.events(),
        vec![BlockEvent {
            kind: BlockEventKind::Stored,
            tier: TierId::G2,
            hash: h[0],
        }]
    );
    assert_eq!(m.next_event_deadline(), None);
    assert!(!m.flush_due_events(deadline));
    drop(held);

    // without a sink there is never a deadline
    let quiet = manager(1, EvictionBackend::Lru);
    drop(register(&quiet, &h));
    assert_eq!(quiet.next_event_deadline(), None);
    assert!(!quiet.flush_due_events(std::time::Instant::now()));
}

#[test]
fn blocks_from_another_manager_register_there() {
    let a = manager(2, EvictionBackend::Lru);
    let b = manager(2, EvictionBackend::Lru);
    let h = chain(1, 1);
    let c = b
        .allocate_blocks(1)
        .unwrap()
        .pop()
        .unwrap()
        .complete(h[0])
        .unwrap();
    let r = a.register_blocks(vec![c]);
    assert_eq!(r.len(), 1);
    assert_eq!(counts(&a), (2, 0, 0, 0));
    assert_eq!(counts(&b), (1, 0, 1, 0));
}

#[test]
fn config_serde_defaults() {
    let c: LogicalConfig = serde_json::from_str("{}").unwrap();
    assert_eq!(c, LogicalConfig::default());
    assert_eq!(c.block_size, 16);
    assert_eq!(
        c.eviction,
        crate::EvictionPolicy::adaptive(EvictionBackend::Lru)
    );
    let c: LogicalConfig =
        serde_json::from_str(r#"{"eviction":"multi_lru","duplication":"reject"}"#).unwrap();
    assert_eq!(c.eviction, EvictionBackend::MultiLru.into());
    assert_eq!(c.duplication, DuplicationPolicy::Reject);
    let t: LogicalConfig = serde_json::from_str(r#"{"eviction":"tinylfu-s3fifo"}"#).unwrap();
    assert_eq!(
        t.eviction,
        crate::EvictionPolicy::tinylfu(EvictionBackend::S3Fifo)
    );
    assert_eq!(t.eviction.to_string(), "tinylfu-s3fifo");
    let err = serde_json::from_str::<LogicalConfig>(r#"{"eviction":"lfru"}"#).unwrap_err();
    assert!(
        err.to_string().contains("unknown eviction backend"),
        "{err}"
    );
    for p in crate::EvictionPolicy::all() {
        assert_eq!(p.to_string().parse::<crate::EvictionPolicy>(), Ok(p));
    }
    assert_eq!(c.duplication, DuplicationPolicy::Reject);
    assert!(serde_json::from_str::<LogicalConfig>(r#"{"evction":"lru"}"#).is_err());
    let m = BlockManager::<G4>::builder()
        .block_count(2)
        .config(LogicalConfig {
            block_size: 8,
            eviction: EvictionBackend::Lineage.into(),
            ..LogicalConfig::default()
        })
        .build()
        .unwrap();
    assert_eq!(m.block_size(), 8);
}

#[test]
fn public_types_are_send_and_sync() {
    fn check<X: Send + Sync>() {}
    check::<BlockManager<G1>>();
    check::<MutableBlock<G1>>();
    check::<CompleteBlock<G1>>();
    check::<ImmutableBlock<G1>>();
    check::<crate::WeakBlock<G1>>();
    check::<BlockRegistry>();
}

/// vLLM's CPU offloading manager scenario 7: evicted [2, 3, 4] are handed back as ids [3, 2, 1].
#[test]
fn freed_slots_are_reused_lifo_when_asked() {
    for (reuse, expect) in [
        (FreeSlotReuse::Lifo, vec![3, 2, 1]),
        (FreeSlotReuse::EvictionOrder, vec![1, 2, 3]),
    ] {
        let m = BlockManager::<G2>::builder()
            .block_count(4)
            .block_size(BS)
            .free_slot_reuse(reuse)
            .build()
            .unwrap();
        let h = chain(7, 8);
        let held = register(&m, &h[..4]);
        assert_eq!(ids(&held), [0, 1, 2, 3]);
        let keep = held[0].clone();
        drop(held); // LRU order: 1, 2, 3 (0 is still held)
        let a = m.allocate_blocks_with(3, &h[4..7]).unwrap();
        let got: Vec<usize> = a.blocks.iter().map(|b| b.block_id()).collect();
        assert_eq!(got, expect, "{reuse:?}");
        assert_eq!(a.evicted, h[1..4].to_vec(), "evicted in eviction order");
        drop(keep);
    }
}

#[test]
fn allocation_reports_evictions_and_never_evicts_protected_hashes() {
    for policy in EvictionPolicy::all() {
        let m = BlockManager::<G2>::builder()
            .block_count(4)
            .block_size(BS)
            .policy(policy)
            .build()
            .unwrap();
        let h = chain(3, 4);
        let other = chain(4, 2);
        drop(register(&m, &h));
        // protect the LRU end (and, for lineage, leaves): the victims must be others
        let protect = [h[3], h[0]];
        match m.allocate_blocks_with(2, &protect) {
            Ok(a) => {
                assert_eq!(a.evicted.len(), 2, "{policy}");
                for e in &a.evicted {
                    assert!(!protect.contains(e), "{policy}: evicted protected {e:?}");
                    assert!(!m.registry().is_present(*e, TierId::G2));
                }
                for p in protect {
                    assert!(m.registry().is_present(p, TierId::G2), "{policy}");
                }
            }
            Err(LogicalError::InsufficientBlocks { .. }) => {
                // lineage: h[3] is the only leaf and it is protected; nothing changed
                assert_eq!(policy.backend, EvictionBackend::Lineage, "{policy}");
                assert_eq!(counts(&m), (0, 0, 0, 4));
                for x in &h {
                    assert!(m.registry().is_present(*x, TierId::G2));
                }
            }
            Err(e) => panic!("{policy}: {e}"),
        }
        m.check_invariants().unwrap();
        // protecting everything evictable fails cleanly, evicting nothing
        let before = m.pool_counts();
        let all: Vec<SequenceHash> = h.iter().chain(&other).copied().collect();
        let needed = before.reset + before.inactive;
        assert!(m.allocate_blocks_with(needed, &all).is_err() || before.inactive == 0);
        assert_eq!(m.pool_counts(), before, "{policy}");
        m.check_invariants().unwrap();
    }
}

#[test]
fn touch_is_recency_without_frequency() {
    let m = manager(3, EvictionBackend::Lru);
    let h = chain(5, 3);
    drop(register(&m, &h));
    let f = m.registry().frequency(h[0]);
    assert_eq!(m.touch_blocks(&h[..1]), 1);
    assert_eq!(
        m.registry().frequency(h[0]),
        f,
        "a touch is not a frequency hit"
    );
    let a = m.allocate_blocks_with(2, &[] as &[SequenceHash]).unwrap();
    assert_eq!(
        a.evicted,
        vec![h[1], h[2]],
        "the touched block is most recent"
    );
    // a match is a frequency hit
    drop(m.match_blocks(&h[..1]));
    assert_eq!(m.registry().frequency(h[0]), f + 1);
}

#[test]
fn lineage_allocation_failure_evicts_nothing() {
    let m = manager(4, EvictionBackend::Lineage);
    let h = chain(9, 4);
    let held = register(&m, &h);
    let leaf = held[3].clone();
    drop(held);
    // only 0, 1, 2 are inactive, and they are all ancestors of the active leaf
    assert!(m.allocate_blocks(1).is_err());
    assert_eq!(counts(&m), (0, 0, 1, 3));
    assert_eq!(m.match_blocks(&h).len(), 4);
    drop(leaf);
}

#[test]
fn tinylfu_admits_a_block_matched_while_active() {
    let m = BlockManager::<G2>::builder()
        .block_count(3)
        .block_size(BS)
        .policy("tinylfu-lru".parse().unwrap())
        .build()
        .unwrap();
    assert_eq!(m.eviction_policy().to_string(), "tinylfu-lru");
    let h = chain(11, 3);
    let held = register(&m, &h); // three first sightings
    drop(m.match_blocks(&h[..1])); // h[0] is hit while active
    drop(held); // released h[0], h[1], h[2]: plain LRU would evict h[0] first
    let a = m.allocate_blocks_with(2, &[] as &[SequenceHash]).unwrap();
    assert_eq!(a.evicted, vec![h[1], h[2]], "first sightings go first");
    m.check_invariants().unwrap();
}

/// A block completed with its BLAKE3 digest carries it once registered, through matches and
/// upgrades; a slot reused for a hash-only block carries none; with `Reject`, the existing
/// block keeps its own digest, so a caller can see the collision.
#[test]
fn registered_blocks_carry_their_digest() {
    let tokens: Vec<u32> = (0..2 * BS).collect();
    let seq = TokenBlockSequence::from_tokens_with(
        &tokens,
        BS,
        Salt::new("t"),
        crate::HashAlgorithm::Blake3,
    )
    .unwrap();
    let m = BlockManager::<G2>::builder()
        .block_count(2)
        .block_size(BS)
        .duplication_policy(crate::DuplicationPolicy::Reject)
        .build()
        .unwrap();
    let b0 = m.allocate_blocks(1).unwrap().pop().unwrap();
    let c0 = b0.complete_token_block(&seq.blocks()[0]).unwrap();
    assert_eq!(c0.digest(), seq.blocks()[0].digest());
    let r0 = m.register_blocks(vec![c0]).pop().unwrap();
    assert_eq!(r0.digest(), seq.blocks()[0].digest());
    let h0 = seq.blocks()[0].sequence_hash();
    drop(r0);
    let again = m.match_blocks(&[h0]).pop().unwrap();
    assert_eq!(again.digest(), seq.blocks()[0].digest());
    assert_eq!(
        again.downgrade().upgrade().unwrap().digest(),
        again.digest()
    );
    // Same 64-bit hash, another digest: the registry hands back the existing block, whose
    // digest differs from the one asked for.
    let other = crate::BlockDigest([7; 32]);
    let dup = m.allocate_blocks(1).unwrap().pop().unwrap();
    let r = m
        .register_blocks(vec![dup.complete_with_digest(h0, Some(other)).unwrap()])
        .pop()
        .unwrap();
    assert_eq!(r.block_id(), again.block_id());
    assert_ne!(r.digest(), Some(other));
    drop((r, again));
    // Evict both and reuse the slots for hash-only blocks: no stale digest survives.
    assert_eq!(m.reset_inactive_pool(), 1);
    let plain = register(&m, &chain(9, 2));
    assert!(plain.iter().all(|b| b.digest().is_none()));
}

#[test]
fn discard_drops_only_inactive_blocks_unregisters_them_and_frees_their_slots() {
    let sink = Arc::new(VecSink::new());
    let registry = BlockRegistry::new();
    let m = BlockManager::<G3>::builder()
        .block_count(3)
        .block_size(BS)
        .registry(registry.clone())
        .event_sink(sink.clone())
        .build()
        .unwrap();
    let h = chain(1, 3);
    let mut held = register(&m, &h);
    let kept = held.remove(0); // h[0] stays held (active)
    drop(held); // h[1], h[2] inactive
    let before = m.pool_counts();
    assert_eq!(
        m.discard_inactive(&[h[0], h[1]]),
        1,
        "only the inactive h[1]"
    );
    let after = m.pool_counts();
    assert_eq!(
        (after.inactive, after.reset),
        (before.inactive - 1, before.reset + 1)
    );
    assert!(
        !registry.is_present(h[1], TierId::G3),
        "never matched again"
    );
    assert!(m.match_blocks(&h[1..2]).is_empty());
    assert!(registry.is_present(h[0], TierId::G3) && registry.is_present(h[2], TierId::G3));
    assert_eq!(m.discard_inactive(&[h[1]]), 0, "already gone");
    m.flush_events();
    assert_eq!(
        sink.events().last(),
        Some(&BlockEvent {
            kind: BlockEventKind::Removed,
            tier: TierId::G3,
            hash: h[1],
        })
    );
    // Once released, the held one can be dropped too.
    drop(kept);
    assert_eq!(m.discard_inactive(&[h[0]]), 1);
    m.check_invariants().unwrap();
}

#[test]
fn a_manager_owns_and_holds_only_its_own_blocks() {
    let (a, b) = (
        manager(2, EvictionBackend::Lru),
        manager(2, EvictionBackend::Lru),
    );
    let mut mine = a.allocate_blocks(1).unwrap();
    let theirs = b.allocate_blocks(1).unwrap();
    assert!(a.owns(&mine[0]));
    assert!(!a.owns(&theirs[0]), "same slot id, another manager");
    assert_eq!(mine[0].block_id(), theirs[0].block_id());
    let h = chain(1, 1)[0];
    let done = mine.pop().unwrap().complete(h).unwrap();
    let registered = a.register_blocks(vec![done]).pop().unwrap();
    assert!(a.holds(&registered));
    assert!(!b.holds(&registered));
}
