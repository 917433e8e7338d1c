//! Logical-only hit-ratio harness: replays a Mooncake-style trace (JSONL with `hash_ids`, the
//! prefix-block ids of each request) as prefix lookups against one [`BlockManager`] of N
//! blocks per policy, and prints the block hit ratio per policy and capacity.
//!
//! Per request: the hit is the longest prefix of its blocks present (`match_blocks`, which
//! revives them); the missing blocks are allocated (protecting the request's own blocks, as a
//! store call does) and registered; then every block is released, last block first. The
//! `belady` row is fed each block's next use from the trace (`hint_next_use`), so the table
//! carries its own offline bound; `infinite` is the hit ratio with unbounded capacity.
//!
//! ```text
//! cargo run --release -p kvbm-logical --example hit_ratio -- \
//!     --trace ../shared/traces/mooncake_conversation_trace.jsonl \
//!     --capacity 1024,4096,16384 [--policy lru,arc,...]
//! ```

use std::collections::HashMap;

use kvbm_logical::{
    BlockManager, DuplicationPolicy, EvictionBackend, EvictionPolicy, G2, ImmutableBlock, Salt,
    SequenceHash,
};

struct Trace {
    requests: Vec<Vec<SequenceHash>>,
    /// For each request and block: the index of the next request using that block.
    next_use: Vec<Vec<u64>>,
    unique: usize,
    blocks: usize,
}

fn load(path: &str) -> Trace {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{path}: {e}"));
    let mut requests = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let v: serde_json::Value =
            serde_json::from_str(line).unwrap_or_else(|e| panic!("{path}:{}: {e}", i + 1));
        let ids: Vec<u32> = v["hash_ids"]
            .as_array()
            .unwrap_or_else(|| panic!("{path}:{}: no hash_ids", i + 1))
            .iter()
            .map(|x| x.as_u64().expect("hash id") as u32)
            .collect();
        // one token per block: each id chains from its prefix, as the trace's ids do
        let mut hashes: Vec<SequenceHash> = Vec::with_capacity(ids.len());
        for (k, id) in ids.iter().enumerate() {
            let h = if k == 0 {
                SequenceHash::root(Salt::NONE, &[*id])
            } else {
                hashes[k - 1].child(&[*id])
            };
            hashes.push(h);
        }
        requests.push(hashes);
    }
    let mut next_use = vec![Vec::new(); requests.len()];
    let mut last: HashMap<SequenceHash, u64> = HashMap::new();
    for (i, r) in requests.iter().enumerate().rev() {
        next_use[i] = r
            .iter()
            .map(|h| last.get(h).copied().unwrap_or(u64::MAX))
            .collect();
        for h in r {
            last.insert(*h, i as u64);
        }
    }
    let blocks = requests.iter().map(Vec::len).sum();
    Trace {
        unique: last.len(),
        requests,
        next_use,
        blocks,
    }
}

/// Replays `trace` against a manager of `capacity` blocks; returns the block hit ratio.
fn replay(trace: &Trace, capacity: usize, policy: EvictionPolicy) -> f64 {
    let m = BlockManager::<G2>::builder()
        .block_count(capacity)
        .block_size(1)
        .policy(policy)
        .duplication_policy(DuplicationPolicy::Reject)
        .build()
        .expect("manager");
    let belady = policy.backend == EvictionBackend::Belady;
    let mut hits = 0usize;
    let mut hints = Vec::new();
    for (i, hashes) in trace.requests.iter().enumerate() {
        let mut held: Vec<ImmutableBlock<G2>> = m.match_blocks(hashes);
        hits += held.len();
        let missing = &hashes[held.len()..];
        if !missing.is_empty()
            && let Ok(alloc) = m.allocate_blocks_with(missing.len(), hashes.as_slice())
        {
            let complete = alloc
                .blocks
                .into_iter()
                .zip(missing)
                .map(|(b, h)| b.complete(*h).expect("block size 1"))
                .collect();
            held.extend(m.register_blocks(complete));
        }
        if belady {
            hints.clear();
            hints.extend(
                hashes
                    .iter()
                    .copied()
                    .zip(trace.next_use[i].iter().copied()),
            );
            m.hint_next_use(&hints);
        }
        // release the last block first, so recency orders fall back to the tail
        while held.pop().is_some() {}
    }
    hits as f64 / trace.blocks as f64
}

fn main() {
    let mut traces = Vec::new();
    let mut capacities = vec![1024, 4096, 16384];
    let mut policies: Vec<EvictionPolicy> = [
        "lru",
        "multi_lru",
        "lineage",
        "fifo",
        "arc",
        "s3fifo",
        "tinylfu-lru",
        "tinylfu-lineage",
        "tinylfu-arc",
        "tinylfu-s3fifo",
        "belady",
    ]
    .iter()
    .map(|p| p.parse().expect("policy"))
    .collect();
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let mut value = || args.next().unwrap_or_else(|| panic!("{a} needs a value"));
        match a.as_str() {
            "--trace" => traces.push(value()),
            "--capacity" => {
                capacities = value()
                    .split(',')
                    .map(|c| c.parse().expect("capacity"))
                    .collect()
            }
            "--policy" => {
                policies = value()
                    .split(',')
                    .map(|p| p.parse().unwrap_or_else(|e| panic!("{e}")))
                    .collect()
            }
            other => panic!("unknown argument {other}"),
        }
    }
    if traces.is_empty() {
        traces.push("../shared/traces/mooncake_conversation_trace.jsonl".into());
    }
    for path in &traces {
        let trace = load(path);
        println!(
            "\n{path}: {} requests, {} blocks, {} unique\n",
            trace.requests.len(),
            trace.blocks,
            trace.unique
        );
        print!("| policy |");
        for c in &capacities {
            print!(" {c} |");
        }
        println!();
        print!("|---|");
        for _ in &capacities {
            print!("---:|");
        }
        println!();
        for &p in &policies {
            print!("| {p} |");
            for &c in &capacities {
                let r = replay(&trace, c, p);
                print!(" {:.1}% |", 100.0 * r);
            }
            println!();
        }
        let infinite = 1.0 - trace.unique as f64 / trace.blocks as f64;
        print!("| infinite |");
        for _ in &capacities {
            print!(" {:.1}% |", 100.0 * infinite);
        }
        println!();
    }
}
