//! The soak: `kvbm replay` with every tier on (G3 on disk, G4 on a private S3 server behind the
//! fault proxy answering 5xx at random) for a bounded time, then checks that nothing wrong was
//! served, every transfer settled, and resident memory stayed flat after warm-up.
//!
//! Ignored by default; `cargo xtask soak [secs]` runs it (`KVBM_SOAK_SECS`, default 600).

use std::process::{Command, Stdio};
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

#[test]
#[ignore = "long: run by `cargo xtask soak`"]
fn soak_all_tiers_with_random_s3_errors() {
    let secs: u64 = std::env::var("KVBM_SOAK_SECS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(600);
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let Some(s3) = OwnS3::start(
        "soak_all_tiers_with_random_s3_errors",
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
    let g3 = dir.path().join("g3");
    let mut child = Command::new(env!("CARGO_BIN_EXE_kvbm"))
        .args([
            "replay",
            "--requests",
            &requests.to_string(),
            "--time-scale",
            "1",
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
            &proxy.endpoint(),
            "--s3-bucket",
            OWN_BUCKET,
            "--json",
        ])
        .env("AWS_ACCESS_KEY_ID", OWN_ACCESS_KEY)
        .env("AWS_SECRET_ACCESS_KEY", OWN_SECRET_KEY)
        .env("KVBM_PHYSICAL__OBJECT__MAX_RETRIES", "4")
        .env("KVBM_PHYSICAL__OBJECT__RETRY_TIMEOUT_MS", "3000")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let pid = child.id();
    let started = Instant::now();
    let mut samples: Vec<(f64, u64)> = Vec::new();
    while child.try_wait().unwrap().is_none() {
        if let Some(r) = rss_kib(pid) {
            samples.push((started.elapsed().as_secs_f64(), r));
        }
        std::thread::sleep(Duration::from_millis(500));
    }
    let out = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "kvbm failed: {stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
    let r: Value = serde_json::from_slice(&out.stdout).unwrap();
    let n = |k: &str| r[k].as_u64().unwrap_or_else(|| panic!("{k}: {r}"));
    assert_eq!(n("corrupt_blocks"), 0, "{r}");
    assert_eq!(n("verified_blocks"), n("onboarded_blocks"), "{r}");
    // Every transfer settled: the drain waited for every lane (nothing reported unfinished).
    assert!(!stderr.contains("did not finish"), "{stderr}");
    assert!(r["tiers"]["g3"]["hit_blocks"].as_u64().unwrap() > 0, "{r}");
    assert!(r["tiers"]["g4"]["hit_blocks"].as_u64().unwrap() > 0, "{r}");
    // RSS flat after warm-up: the last third's peak within 10 % (+16 MiB) of the peak at the
    // end of the first third.
    let total = samples.last().map_or(0.0, |s| s.0);
    let peak = |from: f64, to: f64| {
        samples
            .iter()
            .filter(|(t, _)| *t >= from && *t <= to)
            .map(|(_, r)| *r)
            .max()
            .unwrap_or(0)
    };
    let warm = peak(0.0, total / 3.0);
    let late = peak(2.0 * total / 3.0, total);
    let stats = proxy.stats();
    eprintln!(
        "soak {secs} s: {} blocks, hit ratio {:.3}, {} failed transfers, {} injected 5xx of {} requests; RSS warm {warm} KiB, late {late} KiB",
        n("blocks"),
        r["hit_ratio"].as_f64().unwrap(),
        n("failed_transfers"),
        stats
            .injected_errors
            .load(std::sync::atomic::Ordering::Relaxed),
        stats.requests.load(std::sync::atomic::Ordering::Relaxed),
    );
    assert!(
        late <= warm + warm / 10 + 16 * 1024,
        "resident memory grew after warm-up: {warm} KiB → {late} KiB"
    );
}
