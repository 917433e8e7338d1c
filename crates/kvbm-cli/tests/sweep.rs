//! Tests that run `kvbm replay --sweep-g2`: the JSON schema, the bounds (Belady ≥ every policy,
//! infinite ≥ Belady, an unbounded cache hits exactly `total - unique`), the plot, bad input.

use std::process::{Command, Output};

use serde_json::Value;

fn kvbm(args: &[&str]) -> Output {
    let mut c = Command::new(env!("CARGO_BIN_EXE_kvbm"));
    for (k, _) in std::env::vars() {
        if k.starts_with("AWS_") || (k.starts_with("KVBM_") && k.contains("__")) {
            c.env_remove(k);
        }
    }
    c.args(args).output().expect("run kvbm")
}

#[track_caller]
fn ok_json(out: Output) -> Value {
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "kvbm failed: {stderr}");
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "stdout is not one JSON object ({e}): {}",
            String::from_utf8_lossy(&out.stdout)
        )
    })
}

fn floats(v: &Value) -> Vec<f64> {
    v.as_array()
        .unwrap_or_else(|| panic!("not an array: {v}"))
        .iter()
        .map(|x| x.as_f64().unwrap())
        .collect()
}

#[test]
fn sweep_json_schema_bounds_and_plot() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let svg = dir.path().join("sweep.svg");
    let policies = [
        "lru",
        "arc",
        "s3fifo",
        "tinylfu-lru",
        "adaptive-lru",
        "orphan-tinylfu-lru",
    ];
    let r = ok_json(kvbm(&[
        "replay",
        "--requests",
        "1500",
        "--sweep-g2",
        "128,512,2048,1000000",
        "--sweep-policies",
        &policies.join(","),
        "--json",
        "--plot",
        svg.to_str().unwrap(),
    ]));
    for k in [
        "simulation",
        "workload",
        "requests",
        "blocks",
        "unique_blocks",
        "capacities",
        "default_policy",
        "infinite_hit_ratio",
        "rows",
    ] {
        assert!(r.get(k).is_some(), "{k} missing: {r}");
    }
    assert!(r["simulation"].as_str().unwrap().contains("logical-only"));
    assert_eq!(r["requests"], 1500);
    let caps: Vec<u64> = r["capacities"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c.as_u64().unwrap())
        .collect();
    assert_eq!(caps, [128, 512, 2048, 1_000_000]);
    let blocks = r["blocks"].as_u64().unwrap();
    let unique = r["unique_blocks"].as_u64().unwrap();
    assert!(
        unique < blocks,
        "the synthetic workload repeats prefixes: {r}"
    );
    let infinite = r["infinite_hit_ratio"].as_f64().unwrap();
    assert!((infinite - (1.0 - unique as f64 / blocks as f64)).abs() < 1e-12);

    let rows = r["rows"].as_array().unwrap();
    let names: Vec<&str> = rows.iter().map(|x| x["policy"].as_str().unwrap()).collect();
    let mut expected = policies.to_vec();
    expected.push("belady");
    assert_eq!(names, expected, "the policies asked for, Belady last");
    let default = r["default_policy"].as_str().unwrap();
    for row in rows {
        assert_eq!(
            row["default"].as_bool().unwrap(),
            row["policy"] == default,
            "{row}"
        );
    }
    let belady = floats(&rows.last().unwrap()["hit_ratios"]);
    for row in rows {
        let hr = floats(&row["hit_ratios"]);
        let hb: Vec<u64> = row["hit_blocks"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_u64().unwrap())
            .collect();
        assert_eq!(hr.len(), caps.len());
        for i in 0..caps.len() {
            assert!(
                (hr[i] - hb[i] as f64 / blocks as f64).abs() < 1e-12,
                "{row}"
            );
            assert!(
                belady[i] >= hr[i],
                "belady {} below {} {} at {} blocks",
                belady[i],
                row["policy"],
                hr[i],
                caps[i]
            );
            // (equal when Belady keeps every re-use: compare as integers' ratios, not bits)
            assert!(
                infinite + 1e-12 >= belady[i],
                "infinite below belady at {}",
                caps[i]
            );
        }
        // a cache larger than the workload keeps everything: every re-use is a hit
        assert_eq!(hb[3], blocks - unique, "{} unbounded", row["policy"]);
        // the small caches really are bounded
        assert!(hr[0] < infinite, "{row}");
    }
    // the default policy (adaptive-lru) duels with LRU: never below it
    assert_eq!(default, "adaptive-lru");
    let hits = |name: &str| -> Vec<u64> {
        let row = rows.iter().find(|x| x["policy"] == name).unwrap();
        row["hit_blocks"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_u64().unwrap())
            .collect()
    };
    let (lru, adaptive) = (hits("lru"), hits("adaptive-lru"));
    for i in 0..caps.len() {
        assert!(
            adaptive[i] >= lru[i],
            "adaptive-lru {} below lru {} at {} blocks",
            adaptive[i],
            lru[i],
            caps[i]
        );
    }
    let plot = std::fs::read_to_string(&svg).expect("the plot was written");
    assert!(plot.contains("<svg"), "not an SVG");
    for p in expected {
        assert!(plot.contains(p), "the plot has no line labelled {p}");
    }
}

#[test]
fn sweep_table_and_bad_lists() {
    let out = kvbm(&[
        "replay",
        "--requests",
        "300",
        "--sweep-g2",
        "64,256",
        "--sweep-policies",
        "lru",
    ]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    for needle in [
        "| policy | 64 | 256 |",
        "| lru |",
        "| belady |",
        "| infinite |",
    ] {
        assert!(stdout.contains(needle), "{needle:?} missing:\n{stdout}");
    }
    for (args, needle) in [
        (&["--sweep-g2", "64,x"][..], "\"x\" is not a number"),
        (&["--sweep-g2", "0"][..], "at least 1 block"),
        (
            &["--sweep-g2", "64", "--sweep-policies", "lru,nope"][..],
            "nope",
        ),
    ] {
        let mut a = vec!["replay", "--requests", "10"];
        a.extend_from_slice(args);
        let out = kvbm(&a);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{args:?}: {stderr}");
        assert!(stderr.contains(needle), "{args:?}: {stderr}");
    }
    // --plot without --sweep-g2 is a usage error
    let out = kvbm(&["replay", "--plot", "x.svg"]);
    assert_eq!(out.status.code(), Some(2));
}
