//! Logical-only hit-ratio harness: replays a Mooncake-style trace (JSONL with `hash_ids`, the
//! prefix-block ids of each request) as prefix lookups against one [`BlockManager`] of N
//! blocks per policy, and prints the block hit ratio per policy and capacity.
//!
//! The replay itself is [`kvbm_logical::sim::simulate`] (the same code `kvbm replay
//! --sweep-g2` runs): per request, the hit is the longest cached prefix; the missing blocks are
//! allocated (protecting the request's own blocks) and registered; then every block is
//! released, last block first. The `belady` row is fed each block's next use from the trace, so
//! the table carries its own offline bound; `infinite` is the hit ratio with unbounded capacity.
//!
//! ```text
//! cargo run --release -p kvbm-logical --example hit_ratio -- \
//!     --trace ../shared/traces/mooncake_conversation_trace.jsonl \
//!     --capacity 1024,4096,16384 [--policy lru,arc,...]
//! ```
//!
//! [`BlockManager`]: kvbm_logical::BlockManager

use kvbm_logical::sim::{PrefixTrace, simulate};
use kvbm_logical::{EvictionPolicy, Salt, SequenceHash};

fn load(path: &str) -> PrefixTrace {
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
    PrefixTrace::new(requests)
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
        "adaptive-lru",
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
            trace.requests().len(),
            trace.blocks(),
            trace.unique_blocks()
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
                let r = simulate(&trace, c, p).expect("capacity").hit_ratio();
                print!(" {:.2}% |", 100.0 * r);
            }
            println!();
        }
        print!("| infinite |");
        for _ in &capacities {
            print!(" {:.1}% |", 100.0 * trace.infinite_hit_ratio());
        }
        println!();
    }
}
