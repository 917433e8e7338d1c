//! The soak: two `kvbm replay` processes at once with every tier on (G1, G2, each its own G3 on
//! disk, one shared G4 bucket on a private S3 server behind the fault proxy answering 5xx at
//! random), for a bounded time. At the end it checks, for each process:
//!
//! * zero corrupt blocks served (`corrupt_blocks` 0, `verified == onboarded`);
//! * no leaked block in any pool (`held_blocks_after_drain` 0 per tier: every pool is back to
//!   all blocks available);
//! * every transfer settled (`offload_blocks`: enqueued = transferred + failed + filtered +
//!   cancelled; the drain reported nothing unfinished);
//! * resident memory flat after warm-up (the peak over the last tenth of the run within 10 %
//!   + 16 MiB of the peak around its middle).
//!
//! The two processes share the bucket and the namespace, so each onboards blocks the other
//! wrote (the G2→G4 lanes take the object locks, as separate writers must). The replay does not
//! use NATS (one process per instance, no cross-instance events yet), so no NATS server is
//! restarted here.
//!
//! Ignored by default; `cargo xtask soak [secs]` runs it (`KVBM_SOAK_SECS`, default 600), and
//! `cargo xtask ci` runs 60 s.

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use kvbm_tests::faults::{
    FaultConfig, FaultProxy, OWN_ACCESS_KEY, OWN_BUCKET, OWN_SECRET_KEY, OwnS3,
};
use serde_json::Value;

/// Resident set of `pid` in KiB.
fn rss_kib(pid: u32) -> Option<u64> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    s.lines()
        .find(|l| l.starts_with("VmRSS:"))?
        .split_whitespace()
        .nth(1)?
        .parse()
        .ok()
}

/// One replay process of the soak.
fn replay(requests: u64, g3: &Path, endpoint: &str, seed: u64, log: &Path) -> Child {
    let mut c = Command::new(env!("CARGO_BIN_EXE_kvbm"));
    for (k, _) in std::env::vars() {
        if k.starts_with("AWS_") || (k.starts_with("KVBM_") && k.contains("__")) {
            c.env_remove(k);
        }
    }
    c.args([
        "replay",
        "--requests",
        &requests.to_string(),
        "--time-scale",
        "1",
        "--seed",
        &seed.to_string(),
    ])
    .args([
        "--g1-blocks",
        "128",
        "--g2-blocks",
        "512",
        "--g3-blocks",
        "2048",
    ])
    .args(["--g3-dir", g3.to_str().unwrap(), "--g4"])
    .args([
        "--s3-endpoint",
        endpoint,
        "--s3-bucket",
        OWN_BUCKET,
        "--json",
    ])
    .env("AWS_ACCESS_KEY_ID", OWN_ACCESS_KEY)
    .env("AWS_SECRET_ACCESS_KEY", OWN_SECRET_KEY)
    .env("KVBM_PHYSICAL__OBJECT__MAX_RETRIES", "4")
    .env("KVBM_PHYSICAL__OBJECT__RETRY_TIMEOUT_MS", "3000")
    // Two writers share the bucket: take the object locks.
    .env("KVBM_OFFLOAD__G2_TO_G4__USE_LOCKS", "true")
    .stdout(Stdio::piped())
    .stderr(std::fs::File::create(log).unwrap())
    .spawn()
    .unwrap()
}

#[test]
#[ignore = "long: run by `cargo xtask soak`"]
fn soak_all_tiers_two_instances_with_random_s3_errors() {
    let secs: u64 = std::env::var("KVBM_SOAK_SECS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(600);
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let Some(s3) = OwnS3::start(
        "soak_all_tiers_two_instances_with_random_s3_errors",
        &dir.path().join("s3"),
    ) else {
        return;
    };
    let proxy = FaultProxy::start(
        ([127, 0, 0, 1], s3.port).into(),
        FaultConfig {
            error_fraction: 0.05,
            latency_ms: (0, 10),
            seed: 11,
        },
    );
    // The synthetic workload arrives ~40 requests/s at time scale 1: enough for `secs`.
    let requests = (secs * 40).max(400);
    // The same seed: the two instances serve the same conversations, so blocks one offloads
    // are hits for the other.
    let mut children: Vec<(Child, std::path::PathBuf)> = (0..2)
        .map(|i| {
            let log = dir.path().join(format!("instance{i}.log"));
            let c = replay(
                requests,
                &dir.path().join(format!("g3-{i}")),
                &proxy.endpoint(),
                42,
                &log,
            );
            (c, log)
        })
        .collect();
    let started = Instant::now();
    let mut samples: Vec<Vec<(f64, u64)>> = vec![Vec::new(); 2];
    while children
        .iter_mut()
        .any(|(c, _)| c.try_wait().unwrap().is_none())
    {
        for (i, (c, _)) in children.iter().enumerate() {
            if let Some(r) = rss_kib(c.id()) {
                samples[i].push((started.elapsed().as_secs_f64(), r));
            }
        }
        std::thread::sleep(Duration::from_millis(250));
    }
    let stats = proxy.stats();
    let injected = stats
        .injected_errors
        .load(std::sync::atomic::Ordering::Relaxed);
    let total_requests = stats.requests.load(std::sync::atomic::Ordering::Relaxed);
    assert!(injected > 0, "the proxy injected no error");
    for (i, ((child, log), samples)) in children.into_iter().zip(samples).enumerate() {
        let out = child.wait_with_output().unwrap();
        let stderr = std::fs::read_to_string(&log).unwrap();
        assert!(out.status.success(), "instance {i} failed: {stderr}");
        assert!(!stderr.contains("panicked"), "instance {i}: {stderr}");
        let r: Value = serde_json::from_slice(&out.stdout).unwrap();
        let n = |p: &[&str]| {
            let mut x = &r;
            for k in p {
                x = &x[*k];
            }
            x.as_u64()
                .unwrap_or_else(|| panic!("instance {i}: {p:?}: {r}"))
        };
        // Zero corrupt blocks served.
        assert_eq!(n(&["corrupt_blocks"]), 0, "instance {i}: {r}");
        assert_eq!(
            n(&["verified_blocks"]),
            n(&["onboarded_blocks"]),
            "instance {i}: {r}"
        );
        // No leaked block in any pool.
        for t in ["g1", "g2", "g3", "g4"] {
            assert_eq!(
                n(&["held_blocks_after_drain", t]),
                0,
                "instance {i}: {t} leaked blocks: {r}"
            );
        }
        // Every transfer settled.
        assert!(!stderr.contains("did not finish"), "instance {i}: {stderr}");
        let o = |k: &str| n(&["offload_blocks", k]);
        assert_eq!(
            o("enqueued"),
            o("transferred") + o("failed") + o("filtered") + o("cancelled"),
            "instance {i}: an offload did not settle: {r}"
        );
        assert!(n(&["tiers", "g3", "hit_blocks"]) > 0, "instance {i}: {r}");
        assert!(n(&["tiers", "g4", "hit_blocks"]) > 0, "instance {i}: {r}");
        // Resident memory flat after warm-up: the last tenth's peak against the peak around
        // the middle (40-60 % of the run).
        let total = samples.last().map_or(0.0, |s| s.0);
        let peak = |from: f64, to: f64| {
            samples
                .iter()
                .filter(|(t, _)| *t >= from * total && *t <= to * total)
                .map(|(_, r)| *r)
                .max()
                .unwrap_or(0)
        };
        let (mid, late) = (peak(0.4, 0.6), peak(0.9, 1.0));
        eprintln!(
            "soak {secs} s, instance {i}: {} blocks, hit ratio {:.3} (G3 {} G4 {}), {} failed transfers, {} checksum failures, offloads {}, RSS at 50 % {mid} KiB, at the end {late} KiB",
            n(&["blocks"]),
            r["hit_ratio"].as_f64().unwrap(),
            n(&["tiers", "g3", "hit_blocks"]),
            n(&["tiers", "g4", "hit_blocks"]),
            n(&["failed_transfers"]),
            n(&["checksum_failures"]),
            r["offload_blocks"],
        );
        assert!(
            mid > 0 && late <= mid + mid / 10 + 16 * 1024,
            "instance {i}: resident memory grew after warm-up: {mid} KiB → {late} KiB"
        );
    }
    eprintln!("soak: {injected} injected 5xx of {total_requests} S3 requests");
}
