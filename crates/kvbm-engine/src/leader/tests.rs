//! Tests of the leader's search: tier cascade, holding against eviction, search order.

use std::sync::Arc;

use kvbm_logical::{
    BlockManager, BlockRegistry, G2, G3, G4, ImmutableBlock, Salt, SequenceHash, Tier, TierId,
    TokenBlockSequence,
};

use super::*;

fn sequence(blocks: usize) -> TokenBlockSequence {
    let tokens: Vec<u32> = (0..(blocks as u32 * 4)).collect();
    TokenBlockSequence::from_tokens(&tokens, 4, Salt::NONE).unwrap()
}

fn manager<T: Tier>(blocks: usize, registry: &BlockRegistry) -> Arc<BlockManager<T>> {
    Arc::new(
        BlockManager::<T>::builder()
            .block_count(blocks)
            .block_size(4)
            .registry(registry.clone())
            .build()
            .unwrap(),
    )
}

/// Registers the blocks of `seq` at `indices` in `manager`, then releases them (inactive,
/// matchable, evictable).
fn store<T: Tier>(manager: &BlockManager<T>, seq: &TokenBlockSequence, indices: &[usize]) {
    let blocks = manager.allocate_blocks(indices.len()).unwrap();
    let complete = blocks
        .into_iter()
        .zip(indices)
        .map(|(b, &i)| b.complete_token_block(&seq.blocks()[i]).unwrap())
        .collect();
    let registered: Vec<ImmutableBlock<T>> = manager.register_blocks(complete);
    drop(registered);
}

struct Setup {
    leader: InstanceLeader,
    g2: Arc<BlockManager<G2>>,
    hashes: Vec<SequenceHash>,
}

/// h0 h1 in G2, h2 h3 in G3, h4 and h6 in G4, h5 nowhere.
fn setup() -> Setup {
    let registry = BlockRegistry::new();
    let seq = sequence(8);
    let g2 = manager::<G2>(2, &registry);
    let g3 = manager::<G3>(8, &registry);
    let g4 = manager::<G4>(8, &registry);
    store(&g2, &seq, &[0, 1]);
    store(&g3, &seq, &[2, 3]);
    store(&g4, &seq, &[4, 6]);
    let leader = InstanceLeader::builder()
        .g2(g2.clone())
        .g3(g3)
        .g4(g4)
        .build()
        .unwrap();
    Setup {
        leader,
        g2,
        hashes: seq.hashes(),
    }
}

#[test]
fn cascades_g2_then_g3_then_g4_and_stops_at_the_first_miss() {
    let s = setup();
    let found = s.leader.find_matches(&s.hashes);
    assert_eq!(found.len(), 5);
    assert_eq!(found.requested(), 8);
    assert!(!found.is_complete());
    assert_eq!(
        found.runs(),
        &[
            TierRun {
                tier: TierId::G2,
                start: 0,
                len: 2
            },
            TierRun {
                tier: TierId::G3,
                start: 2,
                len: 2
            },
            TierRun {
                tier: TierId::G4,
                start: 4,
                len: 1
            },
        ]
    );
    assert_eq!(found.hashes(), s.hashes[..5].to_vec());
    assert_eq!(found.tier_of(3), Some(TierId::G3));
    assert_eq!(found.tier_of(5), None);
    assert_eq!(
        (
            found.count(TierId::G2),
            found.count(TierId::G3),
            found.count(TierId::G4)
        ),
        (2, 2, 1)
    );
}

#[test]
fn held_blocks_cannot_be_evicted() {
    let s = setup();
    // G2 has 2 slots, both holding inactive (evictable) blocks: an allocation evicts one.
    let found = s.leader.find_matches(&s.hashes[..2]);
    assert_eq!(found.len(), 2);
    assert!(
        s.g2.allocate_blocks(1).is_err(),
        "every G2 slot is held by the match: nothing may be evicted"
    );
    // Still matchable while held, by anyone.
    assert_eq!(s.leader.find_matches(&s.hashes[..2]).len(), 2);
    drop(found);
    let fresh = s.g2.allocate_blocks(1).expect("released: now evictable");
    drop(fresh);
    assert!(
        s.leader.find_matches(&s.hashes[..2]).count(TierId::G2) < 2,
        "the allocation evicted a released block"
    );
}

#[test]
fn a_truncated_holder_releases_the_tail_only() {
    let s = setup();
    let found = s.leader.find_matches(&s.hashes[..2]);
    let (mut g2, _g3, _g4) = found.into_parts();
    g2.truncate(1);
    // One slot released (evictable), one still held.
    let one =
        s.g2.allocate_blocks(1)
            .expect("the released block is evictable");
    assert!(s.g2.allocate_blocks(1).is_err(), "the held one is not");
    drop(one);
    assert_eq!(g2.blocks()[0].sequence_hash(), s.hashes[0]);
}

#[test]
fn a_truncated_prefix_keeps_its_head_and_releases_the_rest() {
    let s = setup();
    let mut found = s.leader.find_matches(&s.hashes);
    found.truncate(3);
    assert_eq!(found.len(), 3);
    assert_eq!(found.hashes(), s.hashes[..3].to_vec());
    assert_eq!(
        found.runs(),
        &[
            TierRun {
                tier: TierId::G2,
                start: 0,
                len: 2
            },
            TierRun {
                tier: TierId::G3,
                start: 2,
                len: 1
            },
        ]
    );
    assert_eq!((found.count(TierId::G3), found.count(TierId::G4)), (1, 0));
    // Cutting inside G2 drops the later runs whole and releases the G2 tail.
    found.truncate(1);
    assert_eq!(found.runs().len(), 1);
    assert_eq!(found.count(TierId::G2), 1);
    let one =
        s.g2.allocate_blocks(1)
            .expect("the released G2 block is evictable");
    assert!(
        s.g2.allocate_blocks(1).is_err(),
        "the kept one is still held"
    );
    drop(one);
    // Longer than the prefix: nothing changes.
    found.truncate(10);
    assert_eq!(found.len(), 1);
    found.truncate(0);
    assert!(found.is_empty() && found.runs().is_empty());
}

#[test]
fn search_order_is_configurable_and_skips_missing_tiers() {
    let registry = BlockRegistry::new();
    let seq = sequence(4);
    let g2 = manager::<G2>(4, &registry);
    let g3 = manager::<G3>(4, &registry);
    store(&g2, &seq, &[0, 1, 2, 3]);
    store(&g3, &seq, &[0, 1]);
    let leader = InstanceLeader::builder()
        .g2(g2)
        .g3(g3)
        .search(vec![TierId::G3, TierId::G4, TierId::G2])
        .build()
        .unwrap();
    assert_eq!(leader.search_order(), &[TierId::G3, TierId::G2]);
    let found = leader.find_matches(&seq.hashes());
    assert!(found.is_complete());
    assert_eq!(found.count(TierId::G3), 2);
    assert_eq!(found.count(TierId::G2), 2);
    assert_eq!(found.runs()[0].tier, TierId::G3);
}

#[test]
fn empty_and_unmatched_searches() {
    let s = setup();
    assert!(s.leader.find_matches(&[]).is_empty());
    let other = sequence(9).hashes();
    // Block 8 of a longer sequence was never stored anywhere.
    assert!(s.leader.find_matches(&other[8..]).is_empty());
}

#[test]
fn builder_rejects_bad_search_orders() {
    let registry = BlockRegistry::new();
    let g2 = manager::<G2>(2, &registry);
    let err = InstanceLeader::builder()
        .g2(g2.clone())
        .search(vec![TierId::G1])
        .build()
        .unwrap_err();
    assert_eq!(err.config_key(), Some("leader.search"));
    let err = InstanceLeader::builder()
        .g2(g2)
        .search(vec![TierId::G2, TierId::G2])
        .build()
        .unwrap_err();
    assert_eq!(err.config_key(), Some("leader.search"));
    assert!(matches!(
        InstanceLeader::builder().build(),
        Err(EngineError::TierMissing(_))
    ));
}

#[test]
fn from_runtime_builds_configured_tiers_under_the_flush_timer() {
    let runtime = crate::KvbmRuntime::builder()
        .set("tiers.g2_blocks", 8)
        .set("logical.block_size", 4)
        .build()
        .unwrap();
    let leader = InstanceLeader::from_runtime(&runtime.handle()).unwrap();
    assert_eq!(leader.search_order(), &[TierId::G2]);
    assert!(leader.has_tier(TierId::G2) && !leader.has_tier(TierId::G3));
    assert_eq!(runtime.handle().event_source_count(), 1);
    let seq = sequence(3);
    store(leader.g2().unwrap(), &seq, &[0, 1, 2]);
    assert!(leader.find_matches(&seq.hashes()).is_complete());
}

/// A prefix whose tiers interleave (G4, G3, G4, G2: an offload to G4 still in flight leaves a
/// block only in G3 between two G4 blocks) is found whole, as several runs per tier, each
/// tier's holder in prefix order; truncating inside the second G4 run keeps exactly the blocks
/// before the cut in every holder.
#[test]
fn interleaved_tiers_are_found_whole_and_truncate_per_tier() {
    let registry = BlockRegistry::new();
    let seq = sequence(6);
    let g2 = manager::<G2>(4, &registry);
    let g3 = manager::<G3>(4, &registry);
    let g4 = manager::<G4>(4, &registry);
    store(&g4, &seq, &[0, 2, 3]);
    store(&g3, &seq, &[1]);
    store(&g2, &seq, &[4]);
    let leader = InstanceLeader::builder()
        .g2(g2)
        .g3(g3)
        .g4(g4)
        .build()
        .unwrap();
    let hashes = seq.hashes();
    let mut found = leader.find_matches(&hashes);
    assert_eq!(found.len(), 5, "h5 is nowhere");
    let run = |tier, start, len| TierRun { tier, start, len };
    assert_eq!(
        found.runs(),
        &[
            run(TierId::G4, 0, 1),
            run(TierId::G3, 1, 1),
            run(TierId::G4, 2, 2),
            run(TierId::G2, 4, 1),
        ]
    );
    assert_eq!(found.hashes(), hashes[..5].to_vec());
    assert_eq!(found.positions(TierId::G4), vec![0, 2, 3]);
    let g4_held: Vec<_> = found
        .g4()
        .blocks()
        .iter()
        .map(|b| b.sequence_hash())
        .collect();
    assert_eq!(g4_held, vec![hashes[0], hashes[2], hashes[3]]);

    found.truncate(3);
    assert_eq!(found.len(), 3);
    assert_eq!(
        (
            found.count(TierId::G2),
            found.count(TierId::G3),
            found.count(TierId::G4)
        ),
        (0, 1, 2)
    );
    let g4_held: Vec<_> = found
        .g4()
        .blocks()
        .iter()
        .map(|b| b.sequence_hash())
        .collect();
    assert_eq!(g4_held, vec![hashes[0], hashes[2]]);
    assert_eq!(found.hashes(), hashes[..3].to_vec());
}
