//! Criterion benchmarks of the engine's hot paths.
//!
//! - `find_matches/g2_128`: `InstanceLeader::find_matches` over a 128-block prefix resident
//!   (inactive) in G2; each iteration revives the prefix into a `MatchedPrefix` and drops it.
//!   Issue 12's target: under 5 µs.
//! - `find_matches/raw_match_blocks_128`: the same prefix through `BlockManager::match_blocks`
//!   directly, the baseline for the leader's own overhead.
//! - `find_matches/g2_64_g3_64`: the prefix split across G2 and G3 (two managers searched).
//! - `find_matches/policy_cut_g2_64_g3_64`: the same search through `find_matches_with` and a
//!   `MinRun` policy that declines the G3 run (held, then released): the cost of policy-based
//!   scanning on top of `g2_64_g3_64`.
//! - `find_matches/accessor_scan_g2_64_g3_64`: the non-holding `BlockAccessor::scan` of the
//!   same prefix (registry presence only).
//!
//! Run: `cargo bench -p kvbm-engine` (or `cargo xtask bench engine`).

use std::hint::black_box;
use std::sync::Arc;

use criterion::{Criterion, criterion_group, criterion_main};
use kvbm_engine::InstanceLeader;
use kvbm_engine::leader::{MinRun, RunKind};
use kvbm_logical::{BlockManager, BlockRegistry, G2, G3, Salt, Tier, TierId, TokenBlockSequence};

const BLOCK_SIZE: u32 = 4;

fn sequence(n: usize) -> TokenBlockSequence {
    let tokens: Vec<u32> = (0..(n as u32 * BLOCK_SIZE)).collect();
    TokenBlockSequence::from_tokens(&tokens, BLOCK_SIZE, Salt::new([0x39, 0x05])).unwrap()
}

fn manager<T: Tier>(n: usize, registry: &BlockRegistry) -> Arc<BlockManager<T>> {
    Arc::new(
        BlockManager::<T>::builder()
            .block_count(n)
            .block_size(BLOCK_SIZE)
            .registry(registry.clone())
            .build()
            .unwrap(),
    )
}

fn store<T: Tier>(m: &BlockManager<T>, seq: &TokenBlockSequence, range: std::ops::Range<usize>) {
    let complete = m
        .allocate_blocks(range.len())
        .unwrap()
        .into_iter()
        .zip(&seq.blocks()[range])
        .map(|(b, tb)| b.complete_token_block(tb).unwrap())
        .collect();
    drop(m.register_blocks(complete));
}

fn find_matches(c: &mut Criterion) {
    let mut group = c.benchmark_group("find_matches");
    let seq = sequence(128);
    let hashes = seq.hashes();

    let registry = BlockRegistry::new();
    let g2 = manager::<G2>(128, &registry);
    store(&g2, &seq, 0..128);
    let leader = InstanceLeader::builder().g2(g2.clone()).build().unwrap();
    assert_eq!(leader.find_matches(&hashes).len(), 128);
    group.bench_function("g2_128", |b| {
        b.iter(|| black_box(leader.find_matches(black_box(&hashes))))
    });
    group.bench_function("raw_match_blocks_128", |b| {
        b.iter(|| black_box(g2.match_blocks(black_box(&hashes))))
    });

    let registry = BlockRegistry::new();
    let g2 = manager::<G2>(64, &registry);
    let g3 = manager::<G3>(64, &registry);
    store(&g2, &seq, 0..64);
    store(&g3, &seq, 64..128);
    let split = InstanceLeader::builder().g2(g2).g3(g3).build().unwrap();
    assert_eq!(split.find_matches(&hashes).len(), 128);
    group.bench_function("g2_64_g3_64", |b| {
        b.iter(|| black_box(split.find_matches(black_box(&hashes))))
    });
    let cut = MinRun {
        kind: RunKind::Tier(TierId::G3),
        min_blocks: 65,
    };
    assert_eq!(split.find_matches_with(&hashes, &cut).len(), 64);
    group.bench_function("policy_cut_g2_64_g3_64", |b| {
        b.iter(|| black_box(split.find_matches_with(black_box(&hashes), &cut)))
    });
    assert_eq!(split.accessor().scan(&hashes).len(), 2);
    group.bench_function("accessor_scan_g2_64_g3_64", |b| {
        b.iter(|| black_box(split.accessor().scan(black_box(&hashes))))
    });
    group.finish();
}

criterion_group!(benches, find_matches);
criterion_main!(benches);
