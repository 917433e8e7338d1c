//! The kvbm `block_manager` bench groups, run against Dynamo's `kvbm-logical` 1.6.1.
//!
//! Mirrors the groups of Dynamo's own `benches/block_manager.rs` (same 4-token blocks, a
//! manager of exactly `n` blocks, one lineage chain, frequency tracking on) and adds
//! `alloc_register` (allocate + complete + register 128 blocks, then drop them).
//!
//! Run: `cargo bench` in this directory.

use criterion::{BenchmarkId, Criterion, black_box, criterion_group, criterion_main};

use kvbm_logical::BlockManager;
use kvbm_logical::KvbmSequenceHashProvider;
use kvbm_logical::SequenceHash;
use kvbm_logical::blocks::ImmutableBlock;
use kvbm_logical::manager::{BlockManagerConfigBuilder, LineageEviction};
use kvbm_logical::testing::{TestMeta, create_test_manager_with_backend};

const BLOCK_SIZE: u32 = 4;
const SIZES: [usize; 3] = [8, 32, 128];

type BackendConfig = fn(BlockManagerConfigBuilder<TestMeta>) -> BlockManagerConfigBuilder<TestMeta>;

const BACKENDS: &[(&str, BackendConfig)] = &[
    ("lru", |b| b.with_lru_backend()),
    ("multi_lru", |b| b.with_multi_lru_backend()),
    ("lineage", |b| b.with_lineage_backend_eviction(LineageEviction::Tick)),
    ("lineage_fifo", |b| b.with_lineage_backend_eviction(LineageEviction::Fifo)),
];

fn token_blocks(n: usize) -> Vec<dynamo_tokens::TokenBlock> {
    let tokens: Vec<u32> = (0..(n as u32 * BLOCK_SIZE)).collect();
    let seq = dynamo_tokens::TokenBlockSequence::from_slice(&tokens, BLOCK_SIZE, Some(1337));
    seq.blocks().to_vec()
}

fn build_chain(
    n: usize,
    backend: BackendConfig,
) -> (BlockManager<TestMeta>, Vec<SequenceHash>, Vec<ImmutableBlock<TestMeta>>) {
    let manager = create_test_manager_with_backend::<TestMeta>(n, backend);
    let tbs = token_blocks(n);
    let mut hashes = Vec::with_capacity(n);
    let mut complete = Vec::with_capacity(n);
    for tb in tbs.iter() {
        hashes.push(tb.kvbm_sequence_hash());
        let mutable = manager.allocate_blocks(1).expect("allocate").into_iter().next().unwrap();
        complete.push(mutable.complete(tb).expect("complete"));
    }
    let immutables = manager.register_blocks(complete);
    assert_eq!(immutables.len(), n);
    (manager, hashes, immutables)
}

fn bench_match_blocks_active_hit(c: &mut Criterion) {
    let mut group = c.benchmark_group("match_blocks_active_hit");
    for &(name, backend) in BACKENDS {
        for &n in &SIZES {
            let (manager, hashes, _immutables) = build_chain(n, backend);
            group.bench_with_input(BenchmarkId::new(name, n), &n, |b, _| {
                b.iter(|| manager.match_blocks(black_box(&hashes)));
            });
        }
    }
    group.finish();
}

fn bench_match_blocks_inactive_hit(c: &mut Criterion) {
    let mut group = c.benchmark_group("match_blocks_inactive_hit");
    for &(name, backend) in BACKENDS {
        for &n in &SIZES {
            let (manager, hashes, immutables) = build_chain(n, backend);
            drop(immutables);
            group.bench_with_input(BenchmarkId::new(name, n), &n, |b, _| {
                b.iter(|| manager.match_blocks(black_box(&hashes)));
            });
        }
    }
    group.finish();
}

fn bench_bulk_drop(c: &mut Criterion) {
    let mut group = c.benchmark_group("bulk_drop");
    for &(name, backend) in BACKENDS {
        for &n in &SIZES {
            group.bench_with_input(BenchmarkId::new(name, n), &n, |b, _| {
                b.iter_batched(
                    || build_chain(n, backend),
                    |(manager, _hashes, immutables)| {
                        drop(black_box(immutables));
                        manager
                    },
                    criterion::BatchSize::SmallInput,
                );
            });
        }
    }
    group.finish();
}

fn bench_alloc_register(c: &mut Criterion) {
    let mut group = c.benchmark_group("alloc_register");
    let n = 128;
    let tbs = token_blocks(n);
    for &(name, backend) in BACKENDS {
        let manager = create_test_manager_with_backend::<TestMeta>(n, backend);
        group.bench_with_input(BenchmarkId::new(name, n), &n, |b, _| {
            b.iter(|| {
                let blocks = manager.allocate_blocks(n).expect("allocate");
                let complete: Vec<_> = blocks
                    .into_iter()
                    .zip(tbs.iter())
                    .map(|(m, tb)| m.complete(tb).expect("complete"))
                    .collect();
                manager.register_blocks(complete)
            });
        });
    }
    group.finish();
}

criterion_group!(
    benches,
    bench_match_blocks_active_hit,
    bench_match_blocks_inactive_hit,
    bench_bulk_drop,
    bench_alloc_register
);
criterion_main!(benches);
