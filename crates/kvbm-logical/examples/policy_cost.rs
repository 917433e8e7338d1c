//! Interleaved cost of eviction policies on the `alloc_register` path of the logical bench
//! (allocate + complete + register 128 blocks into a manager of 128, evicting the previous
//! round's blocks, then drop them), for a machine too loaded for criterion's means.
//!
//! Each round times `ITERS` iterations of every policy in turn; the minimum and the median of
//! the per-round ns/iteration are printed, with each policy's ratio to `lru` (the minimum is the
//! figure least disturbed by other processes).
//!
//! ```text
//! cargo run --release -p kvbm-logical --example policy_cost [-- lru,tinylfu-lru,adaptive-lru]
//! ```

use std::hint::black_box;
use std::time::Instant;

use kvbm_logical::{
    BlockManager, EvictionPolicy, G2, ImmutableBlock, Salt, SequenceHash, TokenBlockSequence,
};

const BLOCK_SIZE: u32 = 4;
const N: usize = 128;
const ROUNDS: usize = 60;
const ITERS: usize = 200;

fn register(m: &BlockManager<G2>, hashes: &[SequenceHash]) -> Vec<ImmutableBlock<G2>> {
    let blocks = m.allocate_blocks(hashes.len()).expect("allocate");
    let complete = blocks
        .into_iter()
        .zip(hashes)
        .map(|(b, h)| b.complete(*h).expect("complete"))
        .collect();
    m.register_blocks(complete)
}

fn main() {
    let names = std::env::args()
        .nth(1)
        .unwrap_or_else(|| "lru,tinylfu-lru,adaptive-lru".into());
    let policies: Vec<EvictionPolicy> = names
        .split(',')
        .map(|p| p.parse().unwrap_or_else(|e| panic!("{e}")))
        .collect();
    let tokens: Vec<u32> = (0..(N as u32 * BLOCK_SIZE)).collect();
    let hashes = TokenBlockSequence::from_tokens(&tokens, BLOCK_SIZE, Salt::new([0x39, 0x05]))
        .unwrap()
        .hashes();
    let managers: Vec<BlockManager<G2>> = policies
        .iter()
        .map(|&p| {
            BlockManager::<G2>::builder()
                .block_count(N)
                .block_size(BLOCK_SIZE)
                .policy(p)
                .build()
                .unwrap()
        })
        .collect();
    let mut samples = vec![Vec::with_capacity(ROUNDS); policies.len()];
    for _ in 0..ROUNDS {
        for (m, s) in managers.iter().zip(&mut samples) {
            let t = Instant::now();
            for _ in 0..ITERS {
                drop(black_box(register(m, black_box(&hashes))));
            }
            s.push(t.elapsed().as_nanos() as f64 / ITERS as f64);
        }
    }
    let stats: Vec<(f64, f64)> = samples
        .iter_mut()
        .map(|s| {
            s.sort_by(f64::total_cmp);
            (s[0], s[s.len() / 2])
        })
        .collect();
    println!("alloc_register/{N}: ns per iteration (min, median over {ROUNDS} rounds of {ITERS})");
    for (p, &(min, med)) in policies.iter().zip(&stats) {
        println!(
            "{:>16}: min {min:>9.0}  median {med:>9.0}  ratio to lru: min {:.2}x  median {:.2}x",
            p.to_string(),
            min / stats[0].0,
            med / stats[0].1
        );
    }
}
