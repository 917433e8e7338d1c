//! Tests that run the `kvbm` binary: the default run, exact hit ratios, the JSON schema, bad
//! input, G3 + G4 on the real S3 server, warm restarts, metrics, `config show`, and two
//! instances as processes over the real NATS server.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use serde_json::Value;

fn kvbm() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_kvbm"));
    // Tests must not pick up a developer's AWS or KVBM settings.
    for (k, _) in std::env::vars() {
        if k.starts_with("AWS_") || (k.starts_with("KVBM_") && k.contains("__")) {
            c.env_remove(k);
        }
    }
    c
}

fn run(args: &[&str]) -> Output {
    kvbm().args(args).output().expect("run kvbm")
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

#[track_caller]
fn fails_with(out: Output, needle: &str) {
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(
        out.status.code(),
        Some(1),
        "expected exit 1, stderr: {stderr}"
    );
    assert!(stderr.contains(needle), "stderr lacks {needle:?}: {stderr}");
    assert!(
        !stderr.contains("panicked") && !stderr.contains("RUST_BACKTRACE"),
        "a panic: {stderr}"
    );
    assert_eq!(stderr.trim().lines().count(), 1, "one message: {stderr}");
}

/// A scratch directory under the target directory (not /tmp, which may refuse O_DIRECT).
fn scratch() -> tempfile::TempDir {
    tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap()
}

fn f(v: &Value, k: &str) -> f64 {
    v[k].as_f64().unwrap_or_else(|| panic!("{k} missing: {v}"))
}

fn u(v: &Value, path: &[&str]) -> u64 {
    let mut x = v;
    for p in path {
        x = &x[*p];
    }
    x.as_u64()
        .unwrap_or_else(|| panic!("{path:?} missing: {v}"))
}

/// (total, unique) blocks of a trace file's first lines, counted here independently of the binary.
fn trace_counts(path: &Path, lines: usize) -> (u64, u64) {
    let text = std::fs::read_to_string(path).unwrap();
    let (mut total, mut seen) = (0usize, std::collections::HashSet::new());
    for l in text.lines().filter(|l| !l.trim().is_empty()).take(lines) {
        let v: Value = serde_json::from_str(l).unwrap();
        for id in v["hash_ids"].as_array().unwrap() {
            total += 1;
            seen.insert(id.as_u64().unwrap());
        }
    }
    (total as u64, seen.len() as u64)
}

#[track_caller]
fn assert_healthy(r: &Value) {
    assert_eq!(
        u(r, &["verified_blocks"]) + u(r, &["corrupt_blocks"]),
        u(r, &["onboarded_blocks"])
    );
    assert_eq!(u(r, &["corrupt_blocks"]), 0, "{r}");
    assert_eq!(u(r, &["checksum_failures"]), 0, "{r}");
    assert_eq!(u(r, &["failed_transfers"]), 0, "{r}");
}

fn write_trace(dir: &Path, lines: &[&[u64]]) -> PathBuf {
    let p = dir.join("trace.jsonl");
    let body: String = lines
        .iter()
        .enumerate()
        .map(|(i, ids)| {
            format!(
                "{{\"timestamp\": {}, \"input_length\": {}, \"output_length\": 10, \"hash_ids\": {:?}}}\n",
                i * 10,
                ids.len() * 512,
                ids
            )
        })
        .collect();
    std::fs::write(&p, body).unwrap();
    p
}

#[test]
fn default_run_prints_a_summary() {
    let out = run(&["replay"]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    for needle in [
        "hit ratio",
        "g1_to_g2",
        "g2_to_g3",
        "verified",
        "corrupt 0",
        "blocks/s",
    ] {
        assert!(
            stdout.contains(needle),
            "summary lacks {needle:?}:\n{stdout}"
        );
    }
}

#[test]
fn json_has_the_documented_schema() {
    let r = ok_json(run(&[
        "replay",
        "--requests",
        "300",
        "--json",
        "--g1-blocks",
        "128",
        "--g2-blocks",
        "256",
    ]));
    for k in [
        "requests",
        "blocks",
        "hit_blocks",
        "hit_ratio",
        "onboarded_blocks",
        "verified_blocks",
        "corrupt_blocks",
        "checksum_failures",
        "failed_transfers",
        "wall_seconds",
        "blocks_per_second",
    ] {
        assert!(r[k].is_number(), "{k} is not a number: {r}");
    }
    // The default policy of kvbm-logical (TinyLFU admission over LRU, dueling with LRU).
    assert_eq!(r["eviction_policy"], "adaptive-lru");
    for t in ["g1", "g2", "g3", "g4"] {
        assert!(r["tiers"][t]["capacity_blocks"].is_u64(), "{r}");
        assert!(r["tiers"][t]["hit_blocks"].is_u64(), "{r}");
    }
    for p in [
        "g1_to_g2", "g2_to_g3", "g3_to_g2", "g2_to_g4", "g4_to_g2", "g2_to_g1",
    ] {
        assert!(r["bytes"][p].is_u64(), "bytes.{p}: {r}");
    }
    assert_eq!(u(&r, &["requests"]), 300);
    assert_eq!(u(&r, &["tiers", "g1", "capacity_blocks"]), 128);
    assert_eq!(
        u(&r, &["tiers", "g4", "capacity_blocks"]),
        0,
        "G4 is off by default"
    );
    let hits: u64 = ["g1", "g2", "g3", "g4"]
        .iter()
        .map(|t| u(&r, &["tiers", t, "hit_blocks"]))
        .sum();
    assert_eq!(hits, u(&r, &["hit_blocks"]));
    // Small G1/G2: hits must come from below G1, through real transfers.
    assert!(u(&r, &["onboarded_blocks"]) > 0, "{r}");
    assert!(u(&r, &["bytes", "g2_to_g1"]) > 0, "{r}");
    assert!(u(&r, &["bytes", "g2_to_g3"]) > 0, "{r}");
    assert_healthy(&r);
}

#[test]
fn handmade_trace_has_its_exact_hit_ratio() {
    let dir = scratch();
    // 3 + 3 + 4 + 2 = 12 blocks, 7 distinct: 5 hits.
    let p = write_trace(
        dir.path(),
        &[&[1, 2, 3], &[1, 2, 4], &[1, 2, 3, 5], &[6, 7]],
    );
    let p = p.to_str().unwrap();
    let r = ok_json(run(&["replay", "--trace", p, "--json"]));
    assert_eq!(u(&r, &["blocks"]), 12);
    assert_eq!(u(&r, &["hit_blocks"]), 5, "{r}");
    // [1,2] hit in request 2; [1,2,3] in request 3: 2 + 3 = 5 (6 and 7 are new).
    assert_eq!(f(&r, "hit_ratio"), 5.0 / 12.0);
    assert_eq!(f(&r, "max_hit_ratio"), 1.0 - 7.0 / 12.0);
}

#[test]
fn trace_slice_hit_ratio_is_one_minus_unique_over_total() {
    let trace = Path::new("/work/shared/traces/mooncake_conversation_trace.jsonl");
    let dir = scratch();
    let local;
    let trace = if trace.exists() {
        trace
    } else {
        // A fresh machine without the shared traces: a synthetic prefix-shaped trace.
        local = write_trace(
            dir.path(),
            &[
                &[0, 1, 2],
                &[0, 1, 2, 3, 4],
                &[0, 5],
                &[0, 1, 2, 3, 4, 6],
                &[0, 5, 7],
            ],
        );
        &local
    };
    let (total, unique) = trace_counts(trace, 400);
    // hit_ratio == 1 - unique/total exactly: as integers, hits == total - unique.
    let expected = |r: &Value| {
        assert_eq!(u(r, &["offload_no_space_blocks"]), 0, "{r}");
        assert_eq!(u(r, &["blocks"]), total, "{r}");
        assert_eq!(u(r, &["hit_blocks"]), total - unique, "{r}");
        assert!((f(r, "hit_ratio") - (1.0 - unique as f64 / total as f64)).abs() < 1e-12);
    };
    let t = trace.to_str().unwrap();
    // Every tier large enough to hold everything: G1 alone.
    let r = ok_json(run(&[
        "replay",
        "--trace",
        t,
        "--requests",
        "400",
        "--g1-blocks",
        "65536",
        "--json",
    ]));
    expected(&r);
    // Small G1, G3 holding everything: same ratio, the hits onboarded from G3. G2 is the
    // staging tier of every offload (the lanes hold a G2 block until it is written below), so
    // it must absorb what is in flight: with G2 barely larger than G1 an offload can find no
    // G2 slot (`offload_no_space_blocks`), and the block is then recomputed later, not a hit.
    // Through the default tiering manager, with G3 read ahead and only on demand, and through
    // the leader's onboarding sessions.
    for (scheduler, read_ahead) in [("tiering", "16"), ("tiering", "0"), ("sessions", "16")] {
        let out = kvbm()
            .args([
                "replay",
                "--trace",
                t,
                "--requests",
                "400",
                "--g1-blocks",
                "256",
                "--g2-blocks",
                "1024",
                "--g3-blocks",
                "65536",
                "--scheduler",
                scheduler,
                "--json",
            ])
            .env("KVBM_REPLAY__READ_AHEAD_REQUESTS", read_ahead)
            .output()
            .unwrap();
        let r = ok_json(out);
        expected(&r);
        assert_eq!(r["scheduler"], scheduler, "{r}");
        assert!(u(&r, &["tiers", "g3", "hit_blocks"]) > 0, "{r}");
        assert!(u(&r, &["bytes", "g3_to_g2"]) > 0, "{r}");
        assert_healthy(&r);
        assert_eq!(u(&r, &["verified_blocks"]), u(&r, &["onboarded_blocks"]));
    }
    // The default front end is the tiering manager.
    let r = ok_json(run(&["replay", "--trace", t, "--requests", "50", "--json"]));
    assert_eq!(r["scheduler"], "tiering", "{r}");
}

#[test]
fn g2_as_small_as_g1_drops_no_offload_and_keeps_the_exact_hit_ratio() {
    // G2 stages every offload (a lower lane holds a G2 block until it is written below), so with
    // G2 = G1 a G1→G2 batch often finds every G2 slot held for a moment. It must wait for room
    // (backpressure), not drop the blocks (`offload_no_space_blocks`) and lose their hits: with
    // G3 holding everything the hit ratio is still exactly 1 − unique/total.
    let trace = Path::new("/work/shared/traces/mooncake_conversation_trace.jsonl");
    let dir = scratch();
    let local;
    let (trace, requests) = if trace.exists() {
        (trace, 400)
    } else {
        let lines: Vec<Vec<u64>> = (0..200u64)
            .map(|i| (0..(i % 40 + 1)).map(|k| k + 1000 * (i % 25)).collect())
            .collect();
        let refs: Vec<&[u64]> = lines.iter().map(|l| l.as_slice()).collect();
        local = write_trace(dir.path(), &refs);
        (local.as_path(), 200)
    };
    let (total, unique) = trace_counts(trace, requests);
    let t = trace.to_str().unwrap();
    let n = requests.to_string();
    for read_ahead in ["16", "0"] {
        let out = kvbm()
            .args([
                "replay",
                "--trace",
                t,
                "--requests",
                &n,
                "--g1-blocks",
                "256",
                "--g2-blocks",
                "256",
                "--g3-blocks",
                "65536",
                "--json",
            ])
            .env("KVBM_REPLAY__READ_AHEAD_REQUESTS", read_ahead)
            .output()
            .unwrap();
        let r = ok_json(out);
        assert_eq!(
            u(&r, &["offload_no_space_blocks"]),
            0,
            "read_ahead {read_ahead}: {r}"
        );
        assert_eq!(u(&r, &["blocks"]), total, "{r}");
        assert_eq!(
            u(&r, &["hit_blocks"]),
            total - unique,
            "read_ahead {read_ahead}: every repeated block is a hit: {r}"
        );
        assert!((f(&r, "hit_ratio") - (1.0 - unique as f64 / total as f64)).abs() < 1e-12);
        assert!(u(&r, &["tiers", "g3", "hit_blocks"]) > 0, "{r}");
        assert_healthy(&r);
        assert_eq!(u(&r, &["verified_blocks"]), u(&r, &["onboarded_blocks"]));
    }
}

#[test]
fn eviction_policies_are_selectable_and_bad_names_refused() {
    for p in ["lru", "multi_lru", "lineage", "fifo"] {
        let r = ok_json(run(&[
            "replay",
            "--requests",
            "200",
            "--g1-blocks",
            "128",
            "--g2-blocks",
            "128",
            "--eviction-policy",
            p,
            "--json",
        ]));
        assert_eq!(r["eviction_policy"], p);
        assert_healthy(&r);
    }
    fails_with(run(&["replay", "--eviction-policy", "mru"]), "mru");
}

#[test]
fn bad_input_is_one_clear_error() {
    let dir = scratch();
    let bad = dir.path().join("bad.jsonl");
    std::fs::write(
        &bad,
        "{\"timestamp\": 0, \"input_length\": 1, \"output_length\": 1, \"hash_ids\": [1]}\n{\"timestamp\": 1, \"input_length\": 1}\n",
    )
    .unwrap();
    fails_with(run(&["replay", "--trace", bad.to_str().unwrap()]), "line 2");
    fails_with(
        run(&["replay", "--trace", "/nonexistent/trace.jsonl"]),
        "cannot read trace /nonexistent/trace.jsonl",
    );
    let cfg = dir.path().join("c.toml");
    std::fs::write(&cfg, "[replay]\ng1_blockz = 4\n").unwrap();
    fails_with(
        run(&["replay", "--config", cfg.to_str().unwrap()]),
        "g1_blockz",
    );
    fails_with(
        run(&["config", "show", "--config", "/nonexistent.toml"]),
        "cannot read config file",
    );
    fails_with(
        kvbm()
            .args([
                "replay",
                "--s3-endpoint",
                "http://127.0.0.1:1",
                "--s3-bucket",
                "b",
            ])
            .env("AWS_ACCESS_KEY_ID", "k")
            .env("AWS_SECRET_ACCESS_KEY", "s")
            .output()
            .unwrap(),
        "cannot reach S3 endpoint http://127.0.0.1:1",
    );
    fails_with(
        run(&["replay", "--block-bytes", "1000"]),
        "multiple of 4096",
    );
    fails_with(run(&["replay", "--g1-blocks", "4"]), "raise --g1-blocks");
    fails_with(
        run(&["replay", "--instances", "2"]),
        "--instances needs a NATS server",
    );
}

/// Two instances as processes over the real NATS server, sharing a local G4 directory. The
/// trace has two conversations, one per instance; each is later continued in a new
/// conversation (a fork of the same context: same prefix, new conversation id), which the
/// round-robin assignment puts on the *other* instance. That instance has none of the prefix
/// itself: it finds it through the first instance's G4 events and reads it from the shared G4.
#[test]
fn two_instances_find_each_others_blocks_through_events_and_shared_g4() {
    let Some(nats) = kvbm_tests::services::nats("two_instances_find_each_others_blocks") else {
        return;
    };
    let dir = scratch();
    let g4 = dir.path().join("g4");
    two_instances(&dir, &nats.url, &["--g4-dir", g4.to_str().unwrap()], &[]);
}

/// The same with `security.insecure = true`: the instances run unsealed (and say so).
#[test]
fn two_instances_insecure_run_unsealed() {
    let Some(nats) = kvbm_tests::services::nats("two_instances_insecure_run_unsealed") else {
        return;
    };
    two_instances(
        &scratch(),
        &nats.url,
        &[],
        &[("KVBM_SECURITY__INSECURE", "true")],
    );
}

/// The same with G4 on the real S3 server (s3s-fs), in a namespace of its own.
#[test]
fn two_instances_share_g4_on_the_s3_server() {
    let Some(nats) = kvbm_tests::services::nats("two_instances_share_g4_on_the_s3_server") else {
        return;
    };
    let Some(s3) = kvbm_tests::services::s3("two_instances_share_g4_on_the_s3_server") else {
        return;
    };
    let ns = format!(
        "cli-instances-{}-{}",
        std::process::id(),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos()
    );
    two_instances(
        &scratch(),
        &nats.url,
        &["--s3-endpoint", &s3.endpoint, "--s3-bucket", &s3.bucket],
        &[
            ("AWS_ACCESS_KEY_ID", s3.access_key.as_str()),
            ("AWS_SECRET_ACCESS_KEY", s3.secret_key.as_str()),
            ("KVBM_PHYSICAL__OBJECT__NAMESPACE", ns.as_str()),
        ],
    );
}

/// Runs the two-instance trace with `extra` G4 flags and `envs`, and checks the report.
fn two_instances(dir: &tempfile::TempDir, nats_url: &str, extra: &[&str], envs: &[(&str, &str)]) {
    let trace = dir.path().join("trace.jsonl");
    let line = |t: u64, conv: u64, ids: std::ops::Range<u64>| {
        let ids: Vec<u64> = ids.collect();
        format!(
            "{{\"timestamp\": {t}, \"input_length\": {}, \"output_length\": 1, \"hash_ids\": {ids:?}, \"conversation_id\": {conv}}}\n",
            ids.len() * 512
        )
    };
    // conversation 1 → instance 0, conversation 2 → instance 1 (order of first appearance);
    // conversation 3 (conversation 2's context, continued) → instance 0,
    // conversation 4 (conversation 1's context, continued) → instance 1.
    // The continued conversations come 4 s later (trace time, at time-scale 1): the other
    // instance's G4 writes and their events must have landed by then. 1.5 s was too little
    // once in a CI run with every test binary's tests in parallel on two cores.
    let body = [
        line(0, 1, 0..16),
        line(0, 2, 500..504),
        line(4000, 3, 500..506),
        line(5000, 4, 0..20),
    ]
    .concat();
    std::fs::write(&trace, body).unwrap();
    let out = kvbm()
        .args([
            "replay",
            "--trace",
            trace.to_str().unwrap(),
            "--time-scale",
            "1",
            "--instances",
            "2",
            "--nats-url",
            nats_url,
            "--json",
        ])
        .args(extra)
        .envs(envs.iter().copied())
        .output()
        .unwrap();
    let r = ok_json(out);
    assert_healthy(&r);
    assert_eq!(u(&r, &["instances"]), 2, "{r}");
    assert_eq!(u(&r, &["requests"]), 4, "{r}");
    assert_eq!(u(&r, &["blocks"]), 16 + 4 + 6 + 20, "{r}");
    let per = r["per_instance"].as_array().unwrap();
    assert_eq!(per.len(), 2);
    // Secure by default on one host: without configured credentials the run made its own
    // root and credentials, so every instance sealed its events and announcements (and the
    // cross-instance hits below came through sealed, checked events); only
    // `security.insecure` runs them unsealed.
    let insecure = envs
        .iter()
        .any(|(k, v)| *k == "KVBM_SECURITY__INSECURE" && *v == "true");
    for p in per {
        assert_eq!(p["sealed"], serde_json::Value::Bool(!insecure), "{p}");
        assert_eq!(
            u(p, &["requests"]),
            2,
            "each instance serves its two conversations: {p}"
        );
        assert!(u(p, &["cross_instance_hit_blocks"]) > 0, "{p}");
    }
    let cross = u(&r, &["cross_instance_hit_blocks"]);
    // Every block of the continued prefixes (4 + 16) came from the other instance's G4.
    assert_eq!(cross, 20, "{r}");
    assert!(cross <= u(&r, &["tiers", "g4", "hit_blocks"]), "{r}");
    assert!(u(&r, &["bytes", "g4_to_g2"]) >= cross * 4096, "{r}");
    assert_eq!(
        u(&r, &["hit_blocks"]) + u(&r, &["computed_blocks"]),
        u(&r, &["blocks"]),
        "{r}"
    );
    assert_eq!(
        u(&r, &["verified_blocks"]),
        u(&r, &["onboarded_blocks"]),
        "{r}"
    );
    assert!(u(&r, &["onboarded_blocks"]) >= cross, "{r}");
}

#[test]
fn g3_dir_second_run_starts_warm() {
    let dir = scratch();
    let g3 = dir.path().join("g3");
    let g3 = g3.to_str().unwrap();
    let args = [
        "replay",
        "--requests",
        "400",
        "--g1-blocks",
        "128",
        "--g2-blocks",
        "128",
        "--g3-blocks",
        "16384",
        "--g3-dir",
        g3,
        "--json",
    ];
    let first = ok_json(run(&args));
    assert_eq!(u(&first, &["warm_start_blocks", "g3"]), 0);
    assert!(Path::new(g3).join("g3.journal").exists());
    let second = ok_json(run(&args));
    assert_healthy(&second);
    assert!(u(&second, &["warm_start_blocks", "g3"]) > 0, "{second}");
    // The same workload again: every block is already on disk, so everything hits.
    assert_eq!(
        u(&second, &["hit_blocks"]),
        u(&second, &["blocks"]),
        "{second}"
    );
    assert!(u(&second, &["tiers", "g3", "hit_blocks"]) > u(&first, &["tiers", "g3", "hit_blocks"]));
    assert_eq!(
        u(&second, &["verified_blocks"]),
        u(&second, &["onboarded_blocks"])
    );
}

#[test]
fn damaged_g3_block_is_rejected_and_recomputed_never_served() {
    let dir = scratch();
    let g3 = dir.path().join("g3");
    let g3s = g3.to_str().unwrap();
    let args = [
        "replay",
        "--requests",
        "200",
        "--g1-blocks",
        "128",
        "--g2-blocks",
        "128",
        "--g3-blocks",
        "4096",
        "--g3-dir",
        g3s,
        "--json",
    ];
    let first = ok_json(run(&args));
    assert_healthy(&first);
    // Flip one byte in the payload of every written slot (slot = 4 KiB payload + 4 KiB header).
    let file = g3.join("g3.bin");
    let mut data = std::fs::read(&file).unwrap();
    for slot in data.chunks_mut(8192) {
        slot[100] ^= 0xff;
    }
    std::fs::write(&file, data).unwrap();
    let second = ok_json(run(&args));
    assert!(u(&second, &["checksum_failures"]) > 0, "{second}");
    assert_eq!(
        u(&second, &["corrupt_blocks"]),
        0,
        "a damaged block reached G1: {second}"
    );
    // The rejected blocks are dropped from G3 and recomputed; only their fresh copies, written
    // again in this run, can be G3 hits.
    assert!(
        u(&second, &["tiers", "g3", "hit_blocks"]) <= u(&second, &["bytes", "g2_to_g3"]) / 4096,
        "{second}"
    );
    assert_eq!(
        u(&second, &["verified_blocks"]),
        u(&second, &["onboarded_blocks"])
    );
}

#[test]
fn local_g4_dir_second_run_starts_warm() {
    let dir = scratch();
    let g4 = dir.path().join("g4");
    let g4 = g4.to_str().unwrap();
    let args = [
        "replay",
        "--requests",
        "200",
        "--g1-blocks",
        "128",
        "--g2-blocks",
        "128",
        "--g3-blocks",
        "0",
        "--g4",
        "--g4-dir",
        g4,
        "--json",
    ];
    let first = ok_json(run(&args));
    assert_healthy(&first);
    assert!(u(&first, &["bytes", "g2_to_g4"]) > 0, "{first}");
    let second = ok_json(run(&args));
    assert_healthy(&second);
    assert!(u(&second, &["warm_start_blocks", "g4"]) > 0, "{second}");
    assert_eq!(
        u(&second, &["hit_blocks"]),
        u(&second, &["blocks"]),
        "{second}"
    );
    assert!(u(&second, &["bytes", "g4_to_g2"]) > 0, "{second}");
}

#[test]
fn g3_and_g4_on_the_s3_server() {
    let Some(s3) = kvbm_tests::services::s3("g3_and_g4_on_the_s3_server") else {
        return;
    };
    let ns = format!(
        "cli-test-{}-{}",
        std::process::id(),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos()
    );
    let out = kvbm()
        .args([
            "replay",
            "--requests",
            "300",
            "--g1-blocks",
            "128",
            "--g2-blocks",
            "128",
            "--g3-blocks",
            "256",
            "--g4",
            "--s3-endpoint",
            &s3.endpoint,
            "--s3-bucket",
            &s3.bucket,
            "--json",
        ])
        .env("AWS_ACCESS_KEY_ID", &s3.access_key)
        .env("AWS_SECRET_ACCESS_KEY", &s3.secret_key)
        .env("KVBM_PHYSICAL__OBJECT__NAMESPACE", &ns)
        .output()
        .unwrap();
    let r = ok_json(out);
    assert_healthy(&r);
    assert!(u(&r, &["bytes", "g2_to_g4"]) > 0, "{r}");
    assert!(u(&r, &["bytes", "g2_to_g3"]) > 0, "{r}");
    assert!(
        u(&r, &["tiers", "g4", "hit_blocks"]) > 0,
        "G3 too small: hits must come from G4: {r}"
    );
    assert!(u(&r, &["bytes", "g4_to_g2"]) > 0, "{r}");
    assert_eq!(
        u(&r, &["hit_blocks"]),
        u(&r, &["blocks"]) - u(&r, &["unique_blocks"]),
        "G4 holds everything: {r}"
    );
}

#[test]
fn config_show_names_sources_and_redacts_secrets() {
    let dir = scratch();
    let cfg = dir.path().join("c.toml");
    std::fs::write(&cfg, "[tiers]\ng2_blocks = 77\n").unwrap();
    let out = kvbm()
        .args([
            "config",
            "show",
            "--config",
            cfg.to_str().unwrap(),
            "--g1-blocks",
            "5",
            "--s3-endpoint",
            "http://127.0.0.1:9",
            "--s3-bucket",
            "b",
        ])
        .env("KVBM_TIERS__G3_BLOCKS", "99")
        .env("AWS_ACCESS_KEY_ID", "someone")
        .env("AWS_SECRET_ACCESS_KEY", "supersecret")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let s = String::from_utf8_lossy(&out.stdout);
    let line = |k: &str| {
        s.lines()
            .find(|l| l.starts_with(&format!("{k} ")))
            .unwrap_or_else(|| panic!("no {k} in:\n{s}"))
            .to_string()
    };
    // One tree: the flags and every source write the engine's keys.
    assert!(line("tiers.g1_blocks").contains("= 5") && line("tiers.g1_blocks").ends_with("# flag"));
    assert!(line("tiers.g2_blocks").contains("= 77") && line("tiers.g2_blocks").contains("# file"));
    assert!(line("tiers.g3_blocks").contains("= 99") && line("tiers.g3_blocks").contains("# env"));
    assert!(line("replay.seed").ends_with("# default"));
    assert!(!s.contains("replay.g1_blocks"), "no second tree: {s}");
    assert!(!s.contains("supersecret"), "{s}");
    assert!(line("physical.s3.secret_key").contains("<redacted>"));
}

#[test]
fn metrics_endpoint_serves_prometheus_text() {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let addr = format!("127.0.0.1:{port}");
    // The child is killed below, so it never removes a temporary G3 directory of its own: give
    // it one that this test owns.
    let dir = scratch();
    let g3 = dir.path().join("g3");
    // Stretched in time so the endpoint is up while we scrape.
    let mut child = kvbm()
        .args([
            "replay",
            "--requests",
            "200",
            "--time-scale",
            "1.0",
            "--metrics-addr",
            &addr,
            "--g3-dir",
            g3.to_str().unwrap(),
            "--json",
        ])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let mut body = String::new();
    for _ in 0..100 {
        std::thread::sleep(std::time::Duration::from_millis(100));
        if let Ok(mut s) = std::net::TcpStream::connect(&addr) {
            use std::io::{Read, Write};
            let _ = s.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n");
            body.clear();
            let _ = s.read_to_string(&mut body);
            if body.contains("kvbm_stack_hit_blocks_total")
                && body.contains("kvbm_logical_evicted_blocks_total")
                && body.contains("kvbm_stack_transfer_seconds")
            {
                break;
            }
        }
    }
    let _ = child.kill();
    let _ = child.wait();
    assert!(body.starts_with("HTTP/1.1 200"), "{body}");
    assert!(body.contains("kvbm_stack_hit_blocks_total"), "{body}");
    for m in [
        "kvbm_stack_bytes_moved_total",
        "kvbm_stack_transfer_seconds",
        "kvbm_stack_tier_capacity_blocks",
        "kvbm_logical_evicted_blocks_total",
        "kvbm_logical_active_blocks",
        "kvbm_offload_blocks_transferred_total",
    ] {
        assert!(body.contains(m), "{m} missing: {body}");
    }
}

/// `kvbm bench` measures each path against its raw baseline, in one JSON object: the host copy
/// and the scheduler-facing manager's store, load and promotion (the disk paths in `--dir`).
#[test]
fn bench_reports_each_path_with_its_baseline_and_ratio() {
    let dir = scratch();
    for (which, paths) in [
        ("host", &["host_copy"][..]),
        (
            "tiering",
            &["tiering_store", "tiering_load", "tiering_promote"][..],
        ),
    ] {
        let r = ok_json(run(&[
            "bench",
            which,
            "--json",
            "--dir",
            dir.path().to_str().unwrap(),
        ]));
        let results = r["results"].as_array().expect("a results array");
        let got: Vec<&str> = results
            .iter()
            .map(|e| e["path"].as_str().unwrap())
            .collect();
        assert_eq!(got, paths, "{r}");
        for e in results {
            for k in ["gib_per_s", "baseline_gib_per_s", "ratio"] {
                assert!(f(e, k) > 0.0, "{k} of {e}");
            }
            assert_eq!(u(e, &["block_bytes"]), 2 << 20, "{e}");
            assert!(u(e, &["blocks"]) > 0, "{e}");
            assert!(!e["baseline"].as_str().unwrap().is_empty(), "{e}");
            let ratio = f(e, "ratio");
            assert!(ratio.is_finite(), "{e}");
        }
    }
}

#[test]
fn security_init_issue_show_make_a_credential_and_never_overwrite_or_print_a_key() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("root.key");
    let cred = dir.path().join("a.cred");
    let p = |x: &Path| x.to_str().unwrap().to_owned();

    let out = run(&["security", "init", "--out", &p(&root)]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let printed = String::from_utf8_lossy(&out.stdout).to_string();
    let trust_root = printed
        .lines()
        .find_map(|l| l.strip_prefix("security.trust_root = \""))
        .and_then(|l| l.strip_suffix('"'))
        .expect("prints the trust root")
        .to_owned();
    assert_eq!(trust_root.len(), 64);
    fails_with(run(&["security", "init", "--out", &p(&root)]), "root.key");

    let out = run(&[
        "security",
        "issue",
        "--root",
        &p(&root),
        "--instance",
        "0x2a",
        "--role",
        "worker",
        "--rank",
        "3",
        "--namespace",
        "tenant-a",
        "--out",
        &p(&cred),
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let out = run(&["security", "show", &p(&cred)]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let shown = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(shown.contains("worker rank 3"), "{shown}");
    assert!(shown.contains("instance = 0x2a"), "{shown}");
    assert!(shown.contains("\"tenant-a\""), "{shown}");
    // The secret key (the credential file's last line) is never printed.
    let text = std::fs::read_to_string(&cred).unwrap();
    let secret = text.lines().last().unwrap();
    assert!(!shown.contains(secret));
    // Short-lived by default (7 days), with the fingerprint a revocation list names.
    let issued = kvbm_cluster::security::Credential::load(&cred, None).unwrap();
    let days = issued.cert().expires_in().as_secs_f64() / 86_400.0;
    assert!((6.9..=7.0).contains(&days), "{days}");
    let fp = issued.cert().fingerprint_hex();
    assert!(shown.contains(&format!("fingerprint = {fp}")), "{shown}");

    // Revoking appends the line a member's revocation list reads.
    let list = dir.path().join("revoked.txt");
    for args in [
        vec!["--credential", cred.to_str().unwrap()],
        vec!["--instance", "0x2b"],
    ] {
        let mut a = vec!["security", "revoke", "--list", list.to_str().unwrap()];
        a.extend(args);
        let out = run(&a);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let revoked = std::fs::read_to_string(&list).unwrap();
    assert!(
        revoked.lines().next().unwrap().starts_with(&fp),
        "{revoked}"
    );
    assert!(revoked.contains("instance 000000000000002b"), "{revoked}");
    kvbm_cluster::security::Revocations::load(&list, std::time::Duration::from_secs(1))
        .expect("a list members accept");
    fails_with(
        run(&[
            "security",
            "revoke",
            "--list",
            list.to_str().unwrap(),
            "--fingerprint",
            "xyz",
        ]),
        "64 hex digits",
    );

    // The credential is what the engine accepts under that root, and refuses under another.
    let key = kvbm_cluster::security::Credential::load(
        &cred,
        Some(&kvbm_cluster::security::TrustRoot::from_hex(&trust_root).unwrap()),
    )
    .unwrap();
    assert_eq!(key.cert().rank, 3);
    fails_with(
        run(&[
            "security",
            "issue",
            "--root",
            &p(&root),
            "--instance",
            "7",
            "--role",
            "leader",
            "--rank",
            "1",
            "--namespace",
            "t",
            "--out",
            &p(&dir.path().join("b.cred")),
        ]),
        "a leader has no rank",
    );
    fails_with(
        run(&[
            "security",
            "issue",
            "--root",
            &p(&root),
            "--instance",
            "zz",
            "--role",
            "leader",
            "--namespace",
            "t",
            "--out",
            &p(&dir.path().join("c.cred")),
        ]),
        "--instance \"zz\"",
    );
}
