//! Replay regression: kvbm's managers answer recorded call sequences exactly as vLLM's Python
//! managers did, 0.33's and 0.34's (outputs in `tests/data/`, produced by
//! `vllm-manager-replay.py`; 0.34's sequences are 0.33's without `touch`, which 0.34 dropped).

use std::path::Path;

use kvbm_tiering::replay::{ReplayManager, ReplayOptions, replay};
use kvbm_tiering::{CachePolicyKind, Contract};

fn data() -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data")
}

#[test]
fn replay_matches_vllm_line_for_line() {
    let mut checked = 0;
    for entry in std::fs::read_dir(data()).unwrap() {
        let path = entry.unwrap().path();
        let name = path.file_name().unwrap().to_str().unwrap().to_string();
        // vLLM 0.33's outputs replay `seedN.jsonl`; 0.34's replay `seedN.no-touch.jsonl`.
        let (stem, contract, calls_suffix) = if let Some(s) = name.strip_suffix(".vllm.jsonl") {
            (s, Contract::V0_33, "jsonl")
        } else if let Some(s) = name.strip_suffix(".vllm-0.34.jsonl") {
            (s, Contract::V0_34, "no-touch.jsonl")
        } else {
            continue;
        };
        let parts: Vec<&str> = stem.split('.').collect();
        let [seed, manager, policy, capacity] = parts[..] else {
            panic!("unexpected data file {name}");
        };
        let opts = ReplayOptions {
            manager: match manager {
                "cpu" => ReplayManager::Cpu,
                "tiering" => ReplayManager::Tiering,
                other => panic!("manager {other}"),
            },
            capacity: capacity.parse().unwrap(),
            policy: CachePolicyKind::parse(policy).unwrap(),
            upstream_compatible: true,
            follow_prepare: false,
            contract,
        };
        let calls = std::fs::read_to_string(data().join(format!("{seed}.{calls_suffix}"))).unwrap();
        let want = std::fs::read_to_string(&path).unwrap();
        let (got, sum) = replay(&calls, &opts).unwrap();
        assert_eq!(sum.errors, 0, "{name}: {:?}", sum.first_errors);
        for (i, (g, w)) in got.lines().zip(want.lines()).enumerate() {
            assert_eq!(g, w, "{name}: first difference at output line {}", i + 1);
        }
        assert_eq!(got.lines().count(), want.lines().count(), "{name}");
        checked += 1;
    }
    assert_eq!(
        checked, 16,
        "every recorded output (8 per vLLM release) was checked"
    );
}

#[test]
fn replay_with_fixes_on_runs_clean() {
    let calls = std::fs::read_to_string(data().join("seed11.jsonl")).unwrap();
    for manager in [ReplayManager::Cpu, ReplayManager::Tiering] {
        let opts = ReplayOptions {
            manager,
            capacity: 16,
            policy: CachePolicyKind::Lru,
            upstream_compatible: false,
            follow_prepare: false,
            contract: Default::default(),
        };
        let (out, sum) = replay(&calls, &opts).unwrap();
        assert_eq!(sum.errors, 0, "{:?}", sum.first_errors);
        assert_eq!(out.lines().count(), sum.calls);
    }
}
