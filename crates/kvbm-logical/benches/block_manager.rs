//! Criterion benchmarks of the `kvbm-logical` hot paths, mirroring the groups of Dynamo's
//! `kvbm-logical` 1.6.1 `benches/block_manager.rs` (same 4-token blocks, a manager of exactly
//! `n` blocks, one registered lineage chain, frequency tracking on), so that
//! `benches/dynamo-compare` can run the same groups against Dynamo side by side:
//!
//! - `match_blocks_active_hit`: the n-block prefix is held (active); per backend.
//! - `match_blocks_inactive_hit`: the prefix is inactive; each iteration revives it and the
//!   returned `Vec` drops it straight back.
//! - `bulk_drop`: dropping a `Vec<ImmutableBlock>` of n (each block goes inactive).
//! - `alloc_register`: allocate + complete + register 128 blocks (evicting the previous
//!   iteration's inactive blocks), then drop them.
//! - `sequence_hash`: hashing a 128-block token sequence (16 tokens per block) with xxh3 and
//!   with BLAKE3 (the cryptographic identity for shared tiers); reported per block.
//!
//! Besides Dynamo's four backends, the rows cover `arc`, `s3fifo`, `tinylfu_lru`
//! (`tinylfu-lru`), the default policy `adaptive_lru` (`adaptive-lru`: the filter dueling
//! with LRU), and `orphan_tinylfu_lru` (`tinylfu-lru` behind orphan-first).
//!
//! Run: `cargo bench -p kvbm-logical` (or `cargo xtask bench logical`).

use std::hint::black_box;

use criterion::Throughput;
use criterion::{BatchSize, BenchmarkId, Criterion, criterion_group, criterion_main};
use kvbm_logical::{
    BlockManager, EvictionBackend, EvictionPolicy, G2, HashAlgorithm, ImmutableBlock, Salt,
    SequenceHash, TokenBlockSequence,
};

const BLOCK_SIZE: u32 = 4;
const SIZES: [usize; 3] = [8, 32, 128];

const BACKENDS: &[(&str, EvictionPolicy)] = &[
    ("lru", EvictionPolicy::plain(EvictionBackend::Lru)),
    (
        "multi_lru",
        EvictionPolicy::plain(EvictionBackend::MultiLru),
    ),
    ("lineage", EvictionPolicy::plain(EvictionBackend::Lineage)),
    ("fifo", EvictionPolicy::plain(EvictionBackend::Fifo)),
    ("arc", EvictionPolicy::plain(EvictionBackend::Arc)),
    ("s3fifo", EvictionPolicy::plain(EvictionBackend::S3Fifo)),
    ("tinylfu_lru", EvictionPolicy::tinylfu(EvictionBackend::Lru)),
    (
        "adaptive_lru",
        EvictionPolicy::adaptive(EvictionBackend::Lru),
    ),
    (
        "orphan_tinylfu_lru",
        EvictionPolicy::tinylfu(EvictionBackend::Lru).orphan_first(),
    ),
];

fn hashes(n: usize) -> Vec<SequenceHash> {
    let tokens: Vec<u32> = (0..(n as u32 * BLOCK_SIZE)).collect();
    TokenBlockSequence::from_tokens(&tokens, BLOCK_SIZE, Salt::new([0x39, 0x05]))
        .unwrap()
        .hashes()
}

fn manager(n: usize, backend: EvictionPolicy) -> BlockManager<G2> {
    BlockManager::<G2>::builder()
        .block_count(n)
        .block_size(BLOCK_SIZE)
        .policy(backend)
        .build()
        .unwrap()
}

fn register(m: &BlockManager<G2>, hashes: &[SequenceHash]) -> Vec<ImmutableBlock<G2>> {
    let blocks = m.allocate_blocks(hashes.len()).expect("allocate");
    let complete = blocks
        .into_iter()
        .zip(hashes)
        .map(|(b, h)| b.complete(*h).expect("complete"))
        .collect();
    m.register_blocks(complete)
}

fn build_chain(
    n: usize,
    backend: EvictionPolicy,
) -> (BlockManager<G2>, Vec<SequenceHash>, Vec<ImmutableBlock<G2>>) {
    let m = manager(n, backend);
    let h = hashes(n);
    let regs = register(&m, &h);
    assert_eq!(regs.len(), n);
    (m, h, regs)
}

fn bench_match_blocks_active_hit(c: &mut Criterion) {
    let mut group = c.benchmark_group("match_blocks_active_hit");
    for &(name, backend) in BACKENDS {
        for &n in &SIZES {
            let (m, h, _held) = build_chain(n, backend);
            group.bench_with_input(BenchmarkId::new(name, n), &n, |b, _| {
                b.iter(|| m.match_blocks(black_box(&h)));
            });
        }
    }
    group.finish();
}

fn bench_match_blocks_inactive_hit(c: &mut Criterion) {
    let mut group = c.benchmark_group("match_blocks_inactive_hit");
    for &(name, backend) in BACKENDS {
        for &n in &SIZES {
            let (m, h, held) = build_chain(n, backend);
            drop(held);
            group.bench_with_input(BenchmarkId::new(name, n), &n, |b, _| {
                b.iter(|| m.match_blocks(black_box(&h)));
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
                    |(m, _h, held)| {
                        drop(black_box(held));
                        m
                    },
                    BatchSize::SmallInput,
                );
            });
        }
    }
    group.finish();
}

fn bench_alloc_register(c: &mut Criterion) {
    let mut group = c.benchmark_group("alloc_register");
    let n = 128;
    let h = hashes(n);
    for &(name, backend) in BACKENDS {
        let m = manager(n, backend);
        group.bench_with_input(BenchmarkId::new(name, n), &n, |b, _| {
            b.iter(|| register(&m, black_box(&h)));
        });
    }
    group.finish();
}

fn bench_sequence_hash(c: &mut Criterion) {
    let mut group = c.benchmark_group("sequence_hash");
    let blocks = 128u32;
    let bs = 16u32;
    let tokens: Vec<u32> = (0..blocks * bs)
        .map(|t| t.wrapping_mul(2_654_435_761))
        .collect();
    group.throughput(Throughput::Elements(blocks as u64));
    for (name, alg) in [
        ("xxh3", HashAlgorithm::Xxh3),
        ("blake3", HashAlgorithm::Blake3),
    ] {
        group.bench_with_input(BenchmarkId::new(name, bs), &bs, |b, _| {
            b.iter(|| {
                TokenBlockSequence::from_tokens_with(black_box(&tokens), bs, Salt::NONE, alg)
                    .unwrap()
            });
        });
    }
    group.finish();
}

criterion_group!(
    benches,
    bench_sequence_hash,
    bench_match_blocks_active_hit,
    bench_match_blocks_inactive_hit,
    bench_bulk_drop,
    bench_alloc_register
);
criterion_main!(benches);
