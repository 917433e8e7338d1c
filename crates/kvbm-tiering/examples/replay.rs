//! Replays a recorded call sequence against kvbm's manager and writes one JSON line per call,
//! diffable against `vllm-manager-replay.py --replay-out` for vLLM's Python managers.
//!
//! ```text
//! cargo run --release -p kvbm-tiering --example replay -- --calls FILE \
//!     --manager cpu|tiering --capacity N --policy lru|arc --out FILE [--upstream-compatible]
//!     [--follow-prepare]
//! ```

use std::process::ExitCode;
use std::time::Instant;

use kvbm_tiering::replay::{ReplayManager, ReplayOptions, replay};
use kvbm_tiering::{CachePolicyKind, Contract};

fn usage() -> ExitCode {
    eprintln!(
        "usage: replay --calls FILE --manager cpu|tiering --capacity N --policy lru|arc \
         --out FILE [--upstream-compatible] [--follow-prepare] [--vllm 0.33|0.34]"
    );
    ExitCode::from(2)
}

fn main() -> ExitCode {
    let mut args = std::env::args().skip(1);
    let (mut calls, mut out) = (None, None);
    let mut opts = ReplayOptions {
        manager: ReplayManager::Cpu,
        capacity: 16384,
        policy: CachePolicyKind::Lru,
        upstream_compatible: false,
        follow_prepare: false,
        contract: Contract::V0_33,
    };
    while let Some(a) = args.next() {
        match a.as_str() {
            "--calls" => calls = args.next(),
            "--out" => out = args.next(),
            "--manager" => {
                opts.manager = match args.next().as_deref() {
                    Some("cpu") => ReplayManager::Cpu,
                    Some("tiering") => ReplayManager::Tiering,
                    _ => return usage(),
                }
            }
            "--capacity" => match args.next().and_then(|s| s.parse().ok()) {
                Some(n) => opts.capacity = n,
                None => return usage(),
            },
            "--policy" => match args.next().as_deref().and_then(CachePolicyKind::parse) {
                Some(p) => opts.policy = p,
                None => return usage(),
            },
            "--upstream-compatible" => opts.upstream_compatible = true,
            "--follow-prepare" => opts.follow_prepare = true,
            "--vllm" => match args.next().as_deref() {
                Some("0.33") => opts.contract = Contract::V0_33,
                Some("0.34") => opts.contract = Contract::V0_34,
                _ => return usage(),
            },
            _ => return usage(),
        }
    }
    let Some(calls) = calls else { return usage() };
    let text = match std::fs::read_to_string(&calls) {
        Ok(t) => t,
        Err(e) => {
            eprintln!("cannot read {calls}: {e}");
            return ExitCode::FAILURE;
        }
    };
    let t0 = Instant::now();
    let (lines, sum) = match replay(&text, &opts) {
        Ok(r) => r,
        Err(e) => {
            eprintln!("replay failed: {e}");
            return ExitCode::FAILURE;
        }
    };
    let dt = t0.elapsed();
    if let Some(out) = out
        && let Err(e) = std::fs::write(&out, lines)
    {
        eprintln!("cannot write {out}: {e}");
        return ExitCode::FAILURE;
    }
    println!(
        "replay {calls} on {:?} manager: {} calls in {:.1} ms, errors {}, implicit on_new_request {}, \
         lookups {:?}, rejected stores {}, complete_store skipped {}",
        opts.manager,
        sum.calls,
        dt.as_secs_f64() * 1e3,
        sum.errors,
        sum.implicit_new_requests,
        sum.lookup_results,
        sum.prepare_store_rejected,
        sum.complete_store_skipped
    );
    for e in &sum.first_errors {
        println!("  error: {e}");
    }
    ExitCode::SUCCESS
}
