//! Policy-based scanning: each built-in policy on hand-made scans, the leader cutting a held
//! match to the policy's answer (and releasing the rest), the accessor's non-holding scan
//! agreeing with a search, and a proptest of `MatchedPrefix::truncate` and the policies'
//! invariants over random tier placements.

use std::sync::Arc;

use kvbm_logical::{
    BlockManager, BlockRegistry, G2, G3, G4, Salt, SequenceHash, Tier, TierId, TokenBlockSequence,
};
use proptest::prelude::*;

use super::*;
use crate::address::InstanceId;
use crate::leader::InstanceLeader;

fn run(source: RunSource, start: usize, len: usize) -> ScanRun {
    ScanRun { source, start, len }
}

fn local(t: TierId) -> RunSource {
    RunSource::Local(t)
}

/// G2:2, G3:3, G4:1, remote:2.
fn runs() -> Vec<ScanRun> {
    vec![
        run(local(TierId::G2), 0, 2),
        run(local(TierId::G3), 2, 3),
        run(local(TierId::G4), 5, 1),
        run(RunSource::Remote(InstanceId(9)), 6, 2),
    ]
}

fn scan(runs: &[ScanRun]) -> PrefixScan<'_> {
    PrefixScan {
        runs,
        requested: 10,
    }
}

#[test]
fn min_run_cuts_before_the_first_short_run_of_its_kind() {
    let r = runs();
    let g4 = MinRun {
        kind: RunKind::Tier(TierId::G4),
        min_blocks: 2,
    };
    assert_eq!(
        g4.select(&scan(&r)),
        5,
        "the 1-block G4 run and all after it"
    );
    let g3 = MinRun {
        kind: RunKind::Tier(TierId::G3),
        min_blocks: 3,
    };
    assert_eq!(g3.select(&scan(&r)), 8, "a 3-block G3 run is long enough");
    let remote = MinRun {
        kind: RunKind::Remote,
        min_blocks: 4,
    };
    assert_eq!(remote.select(&scan(&r)), 6);
    assert_eq!(OnboardAll.select(&scan(&r)), 8);
    let all = AllOf(vec![Arc::new(g3), Arc::new(remote), Arc::new(g4)]);
    assert_eq!(all.select(&scan(&r)), 5, "the shortest answer");
    assert_eq!(AllOf(Vec::new()).select(&scan(&r)), 8);
}

fn cost(per_run: f64, per_block: f64) -> SourceCost {
    SourceCost { per_run, per_block }
}

#[test]
fn cost_model_keeps_the_prefix_that_saves_most() {
    let r = runs();
    let cheap = cost(0.0, 1.0);
    let mut m = CostModel {
        recompute_per_block: 10.0,
        g2: cheap,
        g3: cheap,
        g4: cheap,
        remote: cheap,
    };
    assert_eq!(m.select(&scan(&r)), 8, "everything saves");
    // A G4 round trip of 50 against one block's recompute of 10: cut before it, unless what
    // follows pays for it.
    m.g4 = cost(50.0, 1.0);
    assert_eq!(m.select(&scan(&r)), 5);
    m.remote = cost(0.0, -40.0);
    assert_eq!(
        m.select(&scan(&r)),
        8,
        "the remote run pays for the G4 round trip"
    );
    // Nothing saves: onboard nothing.
    let dear = cost(100.0, 100.0);
    let none = CostModel {
        recompute_per_block: 1.0,
        g2: dear,
        g3: dear,
        g4: dear,
        remote: dear,
    };
    assert_eq!(none.select(&scan(&r)), 0);
    // A tie keeps the shorter prefix.
    let tie = CostModel {
        recompute_per_block: 1.0,
        g2: cost(0.0, 0.0),
        g3: cost(0.0, 1.0),
        g4: cost(0.0, 1.0),
        remote: cost(0.0, 1.0),
    };
    assert_eq!(tie.select(&scan(&r)), 2);
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

fn store<T: Tier>(m: &BlockManager<T>, seq: &TokenBlockSequence, idx: &[usize]) {
    let complete = m
        .allocate_blocks(idx.len())
        .unwrap()
        .into_iter()
        .zip(idx)
        .map(|(b, &i)| b.complete_token_block(&seq.blocks()[i]).unwrap())
        .collect();
    drop(m.register_blocks(complete));
}

struct Tiers {
    g2: Arc<BlockManager<G2>>,
    g3: Arc<BlockManager<G3>>,
    g4: Arc<BlockManager<G4>>,
    hashes: Vec<SequenceHash>,
}

/// Each block `i` of a `place.len()`-block sequence stored in tier `place[i]` (G2, G3 or G4;
/// `None`: nowhere). Managers of `cap` blocks each.
fn tiers(place: &[Option<TierId>], cap: usize) -> Tiers {
    let registry = BlockRegistry::new();
    let tokens: Vec<u32> = (0..(place.len() as u32 * 4)).collect();
    let seq = TokenBlockSequence::from_tokens(&tokens, 4, Salt::NONE).unwrap();
    let t = Tiers {
        g2: manager(cap, &registry),
        g3: manager(cap, &registry),
        g4: manager(cap, &registry),
        hashes: seq.hashes(),
    };
    let at = |tier| {
        place
            .iter()
            .enumerate()
            .filter(|(_, p)| **p == Some(tier))
            .map(|(i, _)| i)
            .collect::<Vec<_>>()
    };
    store(&t.g2, &seq, &at(TierId::G2));
    store(&t.g3, &seq, &at(TierId::G3));
    store(&t.g4, &seq, &at(TierId::G4));
    t
}

fn leader(t: &Tiers, policy: Arc<dyn OnboardPolicy>) -> InstanceLeader {
    InstanceLeader::builder()
        .g2(t.g2.clone())
        .g3(t.g3.clone())
        .g4(t.g4.clone())
        .policy(policy)
        .build()
        .unwrap()
}

#[test]
fn the_leader_onboards_what_its_policy_selects_and_releases_the_rest() {
    use TierId::*;
    // G2:2, G3:2, G4:1, then a miss.
    let t = tiers(&[Some(G2), Some(G2), Some(G3), Some(G3), Some(G4), None], 4);
    let l = leader(
        &t,
        Arc::new(MinRun {
            kind: RunKind::Tier(G4),
            min_blocks: 2,
        }),
    );
    let session = l.begin_onboarding(&t.hashes);
    assert_eq!(
        session.prefix_len(),
        4,
        "the 1-block G4 run is not worth a round trip"
    );
    assert_eq!(t.g4.available_blocks(), 4, "the G4 block is not held");
    assert_eq!(t.g3.available_blocks(), 2, "the G3 run is held");
    drop(session);
    assert_eq!(t.g3.available_blocks(), 4);

    // Without a policy everything is onboarded; find_matches itself never applies one.
    let all = leader(&t, Arc::new(OnboardAll));
    assert_eq!(all.begin_onboarding(&t.hashes).prefix_len(), 5);
    assert_eq!(l.find_matches(&t.hashes).len(), 5);
}

#[test]
fn the_accessor_scans_like_a_search_without_holding_anything() {
    use TierId::*;
    let t = tiers(&[Some(G2), Some(G3), Some(G3), Some(G4), None, Some(G2)], 4);
    let l = leader(&t, Arc::new(OnboardAll));
    let a = l.accessor();
    let scanned = a.scan(&t.hashes);
    assert_eq!(
        scanned,
        vec![
            run(local(G2), 0, 1),
            run(local(G3), 1, 2),
            run(local(G4), 3, 1)
        ]
    );
    assert_eq!(
        (
            t.g2.available_blocks(),
            t.g3.available_blocks(),
            t.g4.available_blocks()
        ),
        (4, 4, 4),
        "nothing held by a scan"
    );
    let matched = l.find_matches(&t.hashes);
    assert_eq!(matched.scan_runs(), scanned, "the same runs a search holds");
    assert_eq!(a.locate(t.hashes[2]), Some(TierId::G3));
    assert_eq!(a.locate(t.hashes[4]), None);
    assert_eq!(a.locate(t.hashes[5]), Some(TierId::G2));
    assert!(!a.is_present(t.hashes[0], TierId::G1));
    let g3_ids = a.block_ids(&matched, TierId::G3);
    assert_eq!(
        g3_ids,
        matched
            .g3()
            .blocks()
            .iter()
            .map(|b| (b.block_id(), b.sequence_hash()))
            .collect::<Vec<_>>()
    );
    assert_eq!(
        g3_ids.iter().map(|x| x.1).collect::<Vec<_>>(),
        t.hashes[1..3].to_vec()
    );
    assert!(a.block_ids(&matched, TierId::G1).is_empty());
}

fn placement() -> impl Strategy<Value = Vec<Option<TierId>>> {
    proptest::collection::vec(
        prop_oneof![
            3 => Just(Some(TierId::G2)),
            3 => Just(Some(TierId::G3)),
            3 => Just(Some(TierId::G4)),
            1 => Just(None),
        ],
        1..12,
    )
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(96))]

    /// Truncating a held match keeps exactly the first `k` blocks held, in order, and
    /// releases the rest; the policies answer at run boundaries within the prefix.
    #[test]
    fn truncation_and_policies_keep_a_held_prefix(place in placement(), k in 0usize..14, min in 1usize..4) {
        let t = tiers(&place, 12);
        let l = leader(&t, Arc::new(OnboardAll));
        let mut m = l.find_matches(&t.hashes);
        let full = m.len();
        let hashes = m.hashes();
        let runs = m.scan_runs();
        prop_assert_eq!(&runs, &l.accessor().scan(&t.hashes));
        let boundaries: Vec<usize> = std::iter::once(0).chain(runs.iter().map(ScanRun::end)).collect();
        let s = PrefixScan { runs: &runs, requested: t.hashes.len() };
        for p in [
            &MinRun { kind: RunKind::Tier(TierId::G4), min_blocks: min } as &dyn OnboardPolicy,
            &MinRun { kind: RunKind::Tier(TierId::G3), min_blocks: min },
            &CostModel {
                recompute_per_block: 2.0,
                g2: SourceCost { per_run: 0.0, per_block: 0.1 },
                g3: SourceCost { per_run: min as f64, per_block: 0.5 },
                g4: SourceCost { per_run: 3.0 * min as f64, per_block: 1.0 },
                remote: SourceCost { per_run: 1.0, per_block: 1.0 },
            },
        ] {
            let sel = p.select(&s);
            prop_assert!(sel <= full);
            prop_assert!(boundaries.contains(&sel), "{:?} selected {} not at a boundary {:?}", p, sel, boundaries);
        }

        m.truncate(k);
        let kept = k.min(full);
        prop_assert_eq!(m.len(), kept);
        prop_assert_eq!(m.hashes(), hashes[..kept].to_vec());
        prop_assert_eq!(m.runs().iter().map(|r| r.len).sum::<usize>(), kept);
        prop_assert!(m.runs().iter().all(|r| r.len > 0));
        for tier in [TierId::G2, TierId::G3, TierId::G4] {
            // A tier may hold several runs of the prefix (the search makes passes).
            let run: usize = m.runs().iter().filter(|r| r.tier == tier).map(|r| r.len).sum();
            prop_assert_eq!(m.count(tier), run);
        }
        // Held blocks are exactly the kept ones: the others are evictable again.
        let held = |tier| m.count(tier);
        prop_assert_eq!(t.g2.available_blocks(), 12 - held(TierId::G2));
        prop_assert_eq!(t.g3.available_blocks(), 12 - held(TierId::G3));
        prop_assert_eq!(t.g4.available_blocks(), 12 - held(TierId::G4));
        drop(m);
        prop_assert_eq!(t.g2.available_blocks() + t.g3.available_blocks() + t.g4.available_blocks(), 36);
    }
}
