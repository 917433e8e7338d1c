//! Fault tests that drive the `kvbm` binary: `kill -9` during G3 offload and a warm restart,
//! corruption at rest in G3 and G4, the S3 server killed mid-offload or mid-onboard, S3 erroring
//! or slow (queues stay bounded), namespaces sharing a bucket, and credentials kept out of logs.
//!
//! Each test is one fault; each asserts what kvbm did (clear error or recovery), that nothing
//! wrong was served (`corrupt_blocks` 0, `verified == onboarded`), and what was lost.

use std::path::Path;
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use kvbm_physical::checksum::{BlockHeader, checksum_slices};
use kvbm_physical::{BlockIdentity, JournalFile, JournalGeometry};
use serde_json::Value;

fn kvbm() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_kvbm"));
    for (k, _) in std::env::vars() {
        if k.starts_with("AWS_") || (k.starts_with("KVBM_") && k.contains("__")) {
            c.env_remove(k);
        }
    }
    c
}

#[track_caller]
fn ok_json(out: Output) -> Value {
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "kvbm failed: {stderr}");
    assert!(!stderr.contains("panicked"), "a panic: {stderr}");
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "stdout is not one JSON object ({e}): {}",
            String::from_utf8_lossy(&out.stdout)
        )
    })
}

fn u(v: &Value, path: &[&str]) -> u64 {
    let mut x = v;
    for p in path {
        x = &x[*p];
    }
    x.as_u64()
        .unwrap_or_else(|| panic!("{path:?} missing: {v}"))
}

/// Nothing wrong served: every onboarded block verified, none corrupt.
#[track_caller]
fn assert_nothing_wrong_served(r: &Value) {
    assert_eq!(u(r, &["corrupt_blocks"]), 0, "{r}");
    assert_eq!(
        u(r, &["verified_blocks"]),
        u(r, &["onboarded_blocks"]),
        "{r}"
    );
}

/// No leaked hold and every offload settled: after the drain every pool is back to all blocks
/// available, and every block the lanes accepted has an outcome.
#[track_caller]
fn assert_released_and_settled(r: &Value) {
    for t in ["g1", "g2", "g3", "g4"] {
        assert_eq!(
            u(r, &["held_blocks_after_drain", t]),
            0,
            "{t} still holds blocks after the drain: {r}"
        );
    }
    let o = |k: &str| u(r, &["offload_blocks", k]);
    assert_eq!(
        o("enqueued"),
        o("transferred") + o("failed") + o("filtered") + o("cancelled"),
        "an offload did not settle: {r}"
    );
}

/// A scratch directory under the target directory (not /tmp, which may refuse O_DIRECT).
fn scratch() -> tempfile::TempDir {
    tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap()
}

const G3_SLOTS: usize = 16384;
const BLOCK: usize = 4096;
/// Payload (4 KiB) + header sector (4 KiB).
const SLOT_BYTES: usize = 8192;

fn replay_args(g3: &Path, requests: usize, extra: &[&str]) -> Vec<String> {
    let mut v: Vec<String> = [
        "replay",
        "--requests",
        &requests.to_string(),
        "--g1-blocks",
        "128",
        "--g2-blocks",
        "256",
        "--g3-blocks",
        &G3_SLOTS.to_string(),
        "--g3-dir",
        g3.to_str().unwrap(),
        "--json",
    ]
    .into_iter()
    .map(String::from)
    .collect();
    v.extend(extra.iter().map(|s| s.to_string()));
    v
}

/// The G3 file's instance id, from its sidecar (`kvbm-g3-id-v1 <hex> <slot_bytes> <slots>`).
/// The model fingerprint the journal's header records (the replay's own, from its config).
fn journal_fingerprint(journal: &Path) -> u64 {
    let bytes = std::fs::read(journal).unwrap();
    kvbm_physical::storage::journal::decode_header(&bytes)
        .unwrap()
        .fingerprint
}

fn g3_file_id(g3: &Path) -> u128 {
    let text = std::fs::read_to_string(g3.join("g3.bin.id")).unwrap();
    let id = text.split_whitespace().nth(1).unwrap();
    u128::from_str_radix(id, 16).unwrap()
}

/// Slots of the G3 file that hold a complete block written by this file instance: the header
/// decodes, names this slot and file, and the payload matches its checksum. Read independently
/// of kvbm, straight from the file.
fn complete_slots(g3: &Path) -> std::collections::HashMap<u64, (BlockIdentity, u128)> {
    let file_id = g3_file_id(g3);
    let data = std::fs::read(g3.join("g3.bin")).unwrap();
    let mut out = std::collections::HashMap::new();
    for (slot, s) in data.chunks(SLOT_BYTES).enumerate() {
        if s.len() < SLOT_BYTES {
            break;
        }
        let Ok(h) = BlockHeader::decode(&s[BLOCK..], &|| format!("slot {slot}")) else {
            continue;
        };
        let sum = checksum_slices([&s[..BLOCK]]);
        if h.slot == slot as u64 && h.binding == file_id && h.checksum == sum {
            out.insert(slot as u64, (h.identity, sum));
        }
    }
    out
}

/// The poll interval and limit of waits on a running `kvbm`.
const POLL: Duration = Duration::from_millis(20);

fn wait_for(what: &str, limit: Duration, mut ready: impl FnMut() -> bool, child: &mut Child) {
    let t = Instant::now();
    while !ready() {
        if let Ok(Some(status)) = child.try_wait() {
            panic!("kvbm exited ({status}) before {what}");
        }
        assert!(t.elapsed() < limit, "timed out waiting for {what}");
        std::thread::sleep(POLL);
    }
}

#[test]
fn fault_kill9_mid_g3_offload_restarts_warm_with_only_complete_blocks() {
    let dir = scratch();
    let g3 = dir.path().join("g3");
    let journal = g3.join("g3.journal");
    // A run far longer than the test waits (paced at a tenth of the synthetic timestamps:
    // ~400 requests/s), killed while its G2→G3 lane is writing.
    let mut child = kvbm()
        .args(replay_args(&g3, 50_000, &["--time-scale", "0.1"]))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    // ~2000 blocks (a Removed and a Stored record each); the lane writes at most 64 at a time.
    let min_len = (64 + 72 * 4000) as u64;
    wait_for(
        "4000 G3 journal records",
        Duration::from_secs(120),
        || std::fs::metadata(&journal).is_ok_and(|m| m.len() >= min_len),
        &mut child,
    );
    child.kill().unwrap(); // SIGKILL
    child.wait().unwrap();

    // What was on disk at the kill, read independently of kvbm.
    let complete = complete_slots(&g3);
    let geometry = JournalGeometry {
        payload_bytes: BLOCK as u64,
        num_slots: G3_SLOTS as u64,
        file_id: g3_file_id(&g3),
        fingerprint: journal_fingerprint(&journal),
    };
    let listed = JournalFile::read_entries(&journal, &geometry).unwrap();
    assert!(!listed.is_empty());
    // Every listed slot holds exactly the complete block the journal names: no partial block
    // is listed.
    for e in &listed {
        assert_eq!(
            complete.get(&e.slot),
            Some(&(e.identity, e.checksum)),
            "journal lists slot {} but the disk does not hold that complete block",
            e.slot
        );
    }
    let recovered = listed.len() as f64 / complete.len() as f64;
    eprintln!(
        "kill -9: {} complete blocks on disk, {} listed (recovered fraction {recovered:.4})",
        complete.len(),
        listed.len()
    );
    // Only the blocks whose write finished but whose record was not yet appended (one lane's
    // batches in flight) are lost.
    assert!(recovered >= 0.95, "recovered fraction {recovered}");

    // Restart with the same directory: the listed blocks are found and served, byte-correct.
    let t = Instant::now();
    let r = ok_json(kvbm().args(replay_args(&g3, 600, &[])).output().unwrap());
    eprintln!("restart run (600 requests) took {:?}", t.elapsed());
    assert_nothing_wrong_served(&r);
    assert_eq!(u(&r, &["checksum_failures"]), 0, "{r}");
    assert_eq!(u(&r, &["failed_transfers"]), 0, "{r}");
    assert_eq!(
        u(&r, &["warm_start_blocks", "g3"]),
        listed.len() as u64,
        "every listed block is found again: {r}"
    );
    assert!(u(&r, &["tiers", "g3", "hit_blocks"]) > 0, "{r}");
}

/// How a stored block is damaged behind kvbm's back.
#[derive(Debug, Clone, Copy)]
enum Damage {
    /// One byte of the payload flipped.
    FlipPayload,
    /// One byte of the header's identity flipped.
    FlipHeader,
    /// Cut short (G3: the file truncated to before the slot; G4: the body halved).
    Truncate,
    /// Replaced with another block's bytes (G3: two slots swapped; G4: another object copied over).
    Replace,
}

const DAMAGES: [Damage; 4] = [
    Damage::FlipPayload,
    Damage::FlipHeader,
    Damage::Truncate,
    Damage::Replace,
];

fn g3_small_args(g3: &Path) -> Vec<String> {
    [
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
        g3.to_str().unwrap(),
        "--json",
    ]
    .into_iter()
    .map(String::from)
    .collect()
}

/// Damages every slot the G3 journal lists (so the next run's G3 reads all meet it); returns
/// how many blocks were damaged.
fn damage_g3(g3: &Path, how: Damage) -> usize {
    let geometry = JournalGeometry {
        payload_bytes: BLOCK as u64,
        num_slots: 4096,
        file_id: g3_file_id(g3),
        fingerprint: journal_fingerprint(&g3.join("g3.journal")),
    };
    let listed = JournalFile::read_entries(&g3.join("g3.journal"), &geometry).unwrap();
    assert!(listed.len() >= 4, "{} blocks listed", listed.len());
    let file = g3.join("g3.bin");
    let mut data = std::fs::read(&file).unwrap();
    let at = |slot: u64| slot as usize * SLOT_BYTES;
    match how {
        Damage::FlipPayload => listed.iter().for_each(|e| data[at(e.slot) + 100] ^= 0xff),
        // Identity bytes start at header offset 48.
        Damage::FlipHeader => listed
            .iter()
            .for_each(|e| data[at(e.slot) + BLOCK + 50] ^= 0x01),
        Damage::Truncate => {
            // Cut the file at the lowest listed slot: every listed slot is gone (the next open
            // re-extends the file with zeros).
            data.truncate(at(listed[0].slot) + BLOCK / 2);
        }
        Damage::Replace => {
            // Rotate the listed slots' contents: each slot now holds another (valid) block.
            let first: Vec<u8> = data[at(listed[0].slot)..at(listed[0].slot) + SLOT_BYTES].to_vec();
            for w in listed.windows(2) {
                let src = data[at(w[1].slot)..at(w[1].slot) + SLOT_BYTES].to_vec();
                data[at(w[0].slot)..at(w[0].slot) + SLOT_BYTES].copy_from_slice(&src);
            }
            let last = listed.last().unwrap().slot;
            data[at(last)..at(last) + SLOT_BYTES].copy_from_slice(&first);
        }
    }
    std::fs::write(&file, data).unwrap();
    listed.len()
}

#[test]
fn fault_g3_damage_at_rest_is_rejected_dropped_and_recomputed() {
    for how in DAMAGES {
        let dir = scratch();
        let g3 = dir.path().join("g3");
        let args = g3_small_args(&g3);
        let first = ok_json(kvbm().args(&args).output().unwrap());
        assert_nothing_wrong_served(&first);
        let damaged = damage_g3(&g3, how) as u64;
        let second = ok_json(kvbm().args(&args).output().unwrap());
        assert_nothing_wrong_served(&second);
        let rejected = u(&second, &["checksum_failures"]);
        assert!(rejected > 0, "{how:?}: nothing detected: {second}");
        // A rejected block is dropped from G3 and recomputed; its fresh copy, written to G3
        // again during this run, may be a hit later. Every G3 hit is such a fresh copy.
        assert!(
            u(&second, &["tiers", "g3", "hit_blocks"])
                <= u(&second, &["bytes", "g2_to_g3"]) / BLOCK as u64,
            "{how:?}: more G3 hits than blocks written to G3 in this run: {second}"
        );
        // Recomputed: every block of the run was computed or hit elsewhere.
        assert_eq!(
            u(&second, &["hit_blocks"]) + u(&second, &["computed_blocks"]),
            u(&second, &["blocks"]),
            "{second}"
        );
        // Dropped from the tier: a rejected block is unlisted, so no block is rejected twice.
        let third = ok_json(kvbm().args(&args).output().unwrap());
        assert_nothing_wrong_served(&third);
        assert!(
            rejected + u(&third, &["checksum_failures"]) <= damaged,
            "{how:?}: a damaged block was read again after its rejection: {rejected} + {third}"
        );
        assert!(u(&third, &["tiers", "g3", "hit_blocks"]) > 0, "{third}");
    }
}

/// Object files under `root` (recursively), sorted.
fn object_files(root: &Path) -> Vec<std::path::PathBuf> {
    let mut out = Vec::new();
    let mut stack = vec![root.to_path_buf()];
    while let Some(d) = stack.pop() {
        let Ok(rd) = std::fs::read_dir(&d) else {
            continue;
        };
        for e in rd {
            let p = e.unwrap().path();
            if p.is_dir() {
                stack.push(p);
            } else if p
                .file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.len() == 32 && n.bytes().all(|b| b.is_ascii_hexdigit()))
            {
                out.push(p);
            }
        }
    }
    out.sort();
    out
}

/// Damages every block object under `root`; returns the damaged files and their new bytes.
fn damage_objects(root: &Path, how: Damage) -> Vec<(std::path::PathBuf, Vec<u8>)> {
    let files = object_files(root);
    assert!(
        files.len() >= 4,
        "{} objects under {}",
        files.len(),
        root.display()
    );
    let bodies: Vec<Vec<u8>> = files.iter().map(|f| std::fs::read(f).unwrap()).collect();
    let mut out = Vec::new();
    for (i, f) in files.iter().enumerate() {
        let mut b = bodies[i].clone();
        match how {
            Damage::FlipPayload => {
                let n = b.len();
                b[n - 100] ^= 0xff;
            }
            // Identity bytes of the header (the first 96 bytes of the body).
            Damage::FlipHeader => b[50] ^= 0x01,
            Damage::Truncate => b.truncate(b.len() / 2),
            Damage::Replace => b = bodies[(i + 1) % bodies.len()].clone(),
        }
        std::fs::write(f, &b).unwrap();
        out.push((f.clone(), b));
    }
    out
}

/// Runs the G4 corruption scenario for every damage kind: `run` replays against the store
/// whose object files lie under `root`.
fn g4_damage_scenario(root: &Path, run: &dyn Fn() -> Output, clear: &dyn Fn()) {
    for how in DAMAGES {
        clear();
        let first = ok_json(run());
        assert_nothing_wrong_served(&first);
        assert!(u(&first, &["bytes", "g2_to_g4"]) > 0, "{first}");
        let damaged = damage_objects(root, how);
        let second = ok_json(run());
        assert_nothing_wrong_served(&second);
        let rejected = u(&second, &["checksum_failures"]);
        assert!(rejected > 0, "{how:?}: nothing detected: {second}");
        // Every G4 hit is a fresh copy the recompute's offload wrote in this run.
        assert!(
            u(&second, &["tiers", "g4", "hit_blocks"])
                <= u(&second, &["bytes", "g2_to_g4"]) / BLOCK as u64,
            "{how:?}: more G4 hits than objects written in this run: {second}"
        );
        assert_eq!(
            u(&second, &["hit_blocks"]) + u(&second, &["computed_blocks"]),
            u(&second, &["blocks"]),
            "{second}"
        );
        // Dropped: every rejected object was deleted (or rewritten by the recompute's offload).
        let still = damaged
            .iter()
            .filter(|(f, b)| std::fs::read(f).is_ok_and(|now| now == *b))
            .count() as u64;
        assert!(
            still + rejected <= damaged.len() as u64,
            "{how:?}: {still} damaged objects still in place after {rejected} rejections"
        );
        let third = ok_json(run());
        assert_nothing_wrong_served(&third);
        assert!(
            rejected + u(&third, &["checksum_failures"]) <= damaged.len() as u64,
            "{how:?}: a damaged object was read again: {third}"
        );
        assert!(u(&third, &["tiers", "g4", "hit_blocks"]) > 0, "{third}");
    }
}

fn g4_args(requests: usize, extra: &[&str]) -> Vec<String> {
    let mut v: Vec<String> = [
        "replay",
        "--requests",
        &requests.to_string(),
        "--g1-blocks",
        "128",
        "--g2-blocks",
        "128",
        "--g3-blocks",
        "0",
        "--g4",
        "--json",
    ]
    .into_iter()
    .map(String::from)
    .collect();
    v.extend(extra.iter().map(|s| s.to_string()));
    v
}

#[test]
fn fault_g4_local_damage_at_rest_is_rejected_dropped_and_recomputed() {
    let dir = scratch();
    let g4 = dir.path().join("g4");
    let args = g4_args(200, &["--g4-dir", g4.to_str().unwrap()]);
    g4_damage_scenario(&g4, &|| kvbm().args(&args).output().unwrap(), &|| {
        let _ = std::fs::remove_dir_all(&g4);
    });
}

/// `kvbm replay` of `requests` requests with G4 on an [`OwnS3`](kvbm_tests::faults::OwnS3)
/// reached at `endpoint` (the server itself or a proxy in front of it).
fn own_s3_cmd(endpoint: &str, requests: usize, extra: &[&str]) -> Command {
    let mut args = g4_args(
        requests,
        &[
            "--s3-endpoint",
            endpoint,
            "--s3-bucket",
            kvbm_tests::faults::OWN_BUCKET,
        ],
    );
    args.extend(extra.iter().map(|s| s.to_string()));
    let mut c = kvbm();
    c.args(args)
        .env("AWS_ACCESS_KEY_ID", kvbm_tests::faults::OWN_ACCESS_KEY)
        .env("AWS_SECRET_ACCESS_KEY", kvbm_tests::faults::OWN_SECRET_KEY);
    c
}

#[test]
fn fault_g4_s3_damage_at_rest_is_rejected_dropped_and_recomputed() {
    let dir = scratch();
    let Some(s3) = kvbm_tests::faults::OwnS3::start(
        "fault_g4_s3_damage_at_rest_is_rejected_dropped_and_recomputed",
        &dir.path().join("s3"),
    ) else {
        return;
    };
    let bucket = s3.bucket_dir();
    let ep = s3.endpoint();
    g4_damage_scenario(
        &bucket,
        &|| own_s3_cmd(&ep, 200, &[]).output().unwrap(),
        &|| {
            for f in object_files(&bucket) {
                std::fs::remove_file(f).unwrap();
            }
        },
    );
}

/// Object files of `root` modified at or after `since`.
fn objects_written_since(root: &Path, since: std::time::SystemTime) -> usize {
    object_files(root)
        .iter()
        .filter(|f| {
            std::fs::metadata(f)
                .and_then(|m| m.modified())
                .is_ok_and(|t| t >= since)
        })
        .count()
}

/// Short S3 timeouts and retries, so an outage costs seconds, not minutes.
const FAST_S3: [(&str, &str); 4] = [
    ("KVBM_PHYSICAL__OBJECT__CONNECT_TIMEOUT_MS", "500"),
    ("KVBM_PHYSICAL__OBJECT__REQUEST_TIMEOUT_MS", "3000"),
    ("KVBM_PHYSICAL__OBJECT__MAX_RETRIES", "2"),
    ("KVBM_PHYSICAL__OBJECT__RETRY_TIMEOUT_MS", "2000"),
];

#[test]
fn fault_s3_killed_mid_offload_fails_blocks_cleanly_and_recovers_without_restart() {
    let dir = scratch();
    let Some(mut s3) = kvbm_tests::faults::OwnS3::start(
        "fault_s3_killed_mid_offload_fails_blocks_cleanly_and_recovers_without_restart",
        &dir.path().join("s3"),
    ) else {
        return;
    };
    let bucket = s3.bucket_dir();
    let ep = s3.endpoint();
    // ~8 s of paced requests (a tenth of the synthetic timestamps), G4 on our own server.
    let mut child = own_s3_cmd(&ep, 3000, &["--time-scale", "0.1"])
        .envs(FAST_S3)
        .stdout(Stdio::piped())
        .stderr(std::fs::File::create(dir.path().join("stderr.log")).unwrap())
        .spawn()
        .unwrap();
    wait_for(
        "100 G4 objects",
        Duration::from_secs(60),
        || object_files(&bucket).len() >= 100,
        &mut child,
    );
    s3.kill();
    let killed_at = Instant::now();
    std::thread::sleep(Duration::from_secs(2));
    let back = std::time::SystemTime::now();
    s3.restart();
    eprintln!(
        "S3 down for {:?}; restarted on the same port",
        killed_at.elapsed()
    );
    let out = child.wait_with_output().unwrap();
    let r = ok_json(out);
    assert_nothing_wrong_served(&r);
    assert!(
        u(&r, &["failed_transfers"]) > 0,
        "the outage failed no transfer: {r}"
    );
    // A G4 hit is counted only for a block whose bytes arrived in G2. Not every block whose
    // bytes arrived is a hit: a block read in the same batch after one that failed moved its
    // bytes, but the prefix broke before it, so it is recomputed rather than served.
    assert!(
        u(&r, &["tiers", "g4", "hit_blocks"]) * BLOCK as u64 <= u(&r, &["bytes", "g4_to_g2"]),
        "{r}"
    );
    assert_eq!(
        u(&r, &["verified_blocks"]),
        u(&r, &["onboarded_blocks"]),
        "{r}"
    );
    let after = objects_written_since(&bucket, back);
    eprintln!(
        "S3 outage: {} failed transfers; {after} objects written after the restart; {} G4 hits",
        u(&r, &["failed_transfers"]),
        u(&r, &["tiers", "g4", "hit_blocks"])
    );
    assert!(
        after > 0,
        "no offload succeeded after S3 came back (kvbm was not restarted): {r}"
    );
}

#[test]
fn fault_s3_latency_and_5xx_are_retried_and_nothing_wrong_is_served() {
    use kvbm_tests::faults::{FaultConfig, FaultProxy, OwnS3};
    let dir = scratch();
    let Some(s3) = OwnS3::start(
        "fault_s3_latency_and_5xx_are_retried_and_nothing_wrong_is_served",
        &dir.path().join("s3"),
    ) else {
        return;
    };
    let proxy = FaultProxy::start(
        ([127, 0, 0, 1], s3.port).into(),
        FaultConfig {
            error_fraction: 0.2,
            latency_ms: (0, 20),
            seed: 7,
        },
    );
    let ep = proxy.endpoint();
    let run = || {
        own_s3_cmd(&ep, 200, &[])
            .envs(FAST_S3)
            .env("KVBM_PHYSICAL__OBJECT__MAX_RETRIES", "4")
            .output()
            .unwrap()
    };
    let first = ok_json(run());
    let second = ok_json(run());
    let stats = proxy.stats();
    let injected = stats
        .injected_errors
        .load(std::sync::atomic::Ordering::Relaxed);
    let requests = stats.requests.load(std::sync::atomic::Ordering::Relaxed);
    eprintln!(
        "fault proxy: {requests} requests, {injected} injected 5xx; failed transfers {} + {}",
        u(&first, &["failed_transfers"]),
        u(&second, &["failed_transfers"])
    );
    assert!(injected > 20, "the proxy injected only {injected} errors");
    for r in [&first, &second] {
        assert_nothing_wrong_served(r);
        // With 4 retries a block fails only if 5 attempts in a row draw an error (0.2^5).
        assert!(
            u(r, &["failed_transfers"]) * 50 <= u(r, &["blocks"]),
            "retries did not absorb the 5xx: {r}"
        );
    }
    assert!(u(&first, &["bytes", "g2_to_g4"]) > 0, "{first}");
    assert!(u(&second, &["tiers", "g4", "hit_blocks"]) > 0, "{second}");
}

/// `kvbm_stack_bytes_moved_total{path}` of a running kvbm (0 before the first move).
fn moved(port: u16, path: &str) -> Option<f64> {
    let text = kvbm_tests::scrape::scrape(port)?;
    Some(
        kvbm_tests::scrape::sample(&text, "kvbm_stack_bytes_moved_total", &[("path", path)])
            .unwrap_or(0.0),
    )
}

#[test]
fn fault_s3_killed_mid_onboard_fails_blocks_cleanly_releases_holds_and_recovers_without_restart() {
    let dir = scratch();
    let Some(mut s3) = kvbm_tests::faults::OwnS3::start(
        "fault_s3_killed_mid_onboard_fails_blocks_cleanly_releases_holds_and_recovers_without_restart",
        &dir.path().join("s3"),
    ) else {
        return;
    };
    let bucket = s3.bucket_dir();
    let ep = s3.endpoint();
    // A warm G4: the first run offloads every block it computes (the paced run below covers
    // these requests first, then goes on computing).
    let warm = ok_json(own_s3_cmd(&ep, 2000, &[]).envs(FAST_S3).output().unwrap());
    assert_nothing_wrong_served(&warm);
    assert_released_and_settled(&warm);
    let stored = object_files(&bucket).len();
    assert!(stored > 1000, "{stored} objects after the warm-up: {warm}");
    // The same workload again, paced (a tenth of the synthetic timestamps), onboarding from G4.
    let port = kvbm_tests::faults::free_port();
    let log = dir.path().join("stderr.log");
    let mut child = own_s3_cmd(
        &ep,
        3000,
        &[
            "--time-scale",
            "0.1",
            "--metrics-addr",
            &format!("127.0.0.1:{port}"),
        ],
    )
    .envs(FAST_S3)
    .stdout(Stdio::piped())
    .stderr(std::fs::File::create(&log).unwrap())
    .spawn()
    .unwrap();
    wait_for(
        "G4 onboards",
        Duration::from_secs(60),
        || moved(port, "g4_to_g2").is_some_and(|b| b >= (50 * BLOCK) as f64),
        &mut child,
    );
    s3.kill();
    let killed_at = Instant::now();
    std::thread::sleep(Duration::from_secs(2));
    s3.restart();
    let down = killed_at.elapsed();
    let back = Instant::now();
    let at_restart = moved(port, "g4_to_g2").expect("kvbm's metrics endpoint");
    // Recovery: the first G4 onboard that lands after the server is back.
    wait_for(
        "a G4 onboard after the restart",
        Duration::from_secs(60),
        || moved(port, "g4_to_g2").is_some_and(|b| b > at_restart),
        &mut child,
    );
    let recovered_in = back.elapsed();
    let out = child.wait_with_output().unwrap();
    let stderr = std::fs::read_to_string(&log).unwrap();
    assert!(!stderr.contains("panicked"), "{stderr}");
    let r = ok_json(out);
    assert_nothing_wrong_served(&r);
    // The affected blocks failed with an error naming the path and the cause.
    let failed_lines = stderr
        .lines()
        .filter(|l| l.contains("G4→G2 transfer failed") || l.contains("G4→G2 transfer refused"))
        .count();
    assert!(
        failed_lines > 0 && u(&r, &["failed_transfers"]) > 0,
        "the outage failed no onboard: {r}\n{stderr}"
    );
    // Not counted as hits: a G4 hit needs its bytes in G2, and every block was served or
    // computed.
    assert!(
        u(&r, &["tiers", "g4", "hit_blocks"]) * BLOCK as u64 <= u(&r, &["bytes", "g4_to_g2"]),
        "{r}"
    );
    assert_eq!(
        u(&r, &["hit_blocks"]) + u(&r, &["computed_blocks"]),
        u(&r, &["blocks"]),
        "{r}"
    );
    // Holds released: every pool is back to all blocks available; every offload settled.
    assert_released_and_settled(&r);
    // Onboards succeeded again without restarting kvbm.
    assert!(
        u(&r, &["bytes", "g4_to_g2"]) as f64 > at_restart,
        "no G4 onboard after the server returned: {r}"
    );
    eprintln!(
        "S3 killed mid-onboard: down {down:?}; {failed_lines} onboards failed ({} failed transfers); G4 hits {} of {} blocks; first onboard {recovered_in:?} after the restart; {} of {} G4→G2 bytes moved after it",
        u(&r, &["failed_transfers"]),
        u(&r, &["tiers", "g4", "hit_blocks"]),
        u(&r, &["blocks"]),
        u(&r, &["bytes", "g4_to_g2"]) as f64 - at_restart,
        u(&r, &["bytes", "g4_to_g2"]),
    );
}

#[test]
fn fault_s3_slow_keeps_offload_queues_bounded_and_g2_g3_serving() {
    use kvbm_tests::faults::{FaultConfig, FaultProxy, OwnS3};
    use kvbm_tests::scrape::{sample, samples, scrape};
    let dir = scratch();
    let Some(s3) = OwnS3::start(
        "fault_s3_slow_keeps_offload_queues_bounded_and_g2_g3_serving",
        &dir.path().join("s3"),
    ) else {
        return;
    };
    // Every S3 request waits 100-200 ms: G4 is far slower than the workload offloads.
    let proxy = FaultProxy::start(
        ([127, 0, 0, 1], s3.port).into(),
        FaultConfig {
            error_fraction: 0.0,
            latency_ms: (100, 200),
            seed: 5,
        },
    );
    let g3 = dir.path().join("g3");
    let port = kvbm_tests::faults::free_port();
    let mut child = kvbm()
        .args(replay_args(&g3, 400, &[]))
        .args([
            "--g4",
            "--s3-endpoint",
            &proxy.endpoint(),
            "--s3-bucket",
            kvbm_tests::faults::OWN_BUCKET,
            "--metrics-addr",
            &format!("127.0.0.1:{port}"),
        ])
        .env("AWS_ACCESS_KEY_ID", kvbm_tests::faults::OWN_ACCESS_KEY)
        .env("AWS_SECRET_ACCESS_KEY", kvbm_tests::faults::OWN_SECRET_KEY)
        .envs(FAST_S3)
        .stdout(Stdio::piped())
        .stderr(std::fs::File::create(dir.path().join("stderr.log")).unwrap())
        .spawn()
        .unwrap();
    // Scrape while it runs: the in-flight gauge directly, and the high-water marks (which only
    // rise, so the last scrape holds the run's maxima).
    let mut last = String::new();
    let mut in_flight_seen: std::collections::BTreeMap<String, f64> = Default::default();
    let mut scrapes = 0;
    while child.try_wait().unwrap().is_none() {
        if let Some(t) = scrape(port) {
            for (l, v) in samples(&t, "kvbm_offload_transfers_in_flight") {
                let e = in_flight_seen.entry(l["pipeline"].clone()).or_default();
                *e = e.max(v);
            }
            last = t;
            scrapes += 1;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let out = child.wait_with_output().unwrap();
    let r = ok_json(out);
    assert_nothing_wrong_served(&r);
    assert_released_and_settled(&r);
    assert!(scrapes > 5, "only {scrapes} scrapes");
    // Every lane's queues and transfers stayed within their configured bounds, as exported.
    // (With the default tiering scheduler G1→G2 is the scheduler's own store, not a lane.)
    let mut report = Vec::new();
    for lane in ["g2_to_g3", "g2_to_g4"] {
        let bound = sample(
            &last,
            "kvbm_offload_max_concurrent_transfers",
            &[("pipeline", lane)],
        )
        .unwrap_or_else(|| panic!("{lane}: no max_concurrent_transfers gauge:\n{last}"));
        let high = sample(
            &last,
            "kvbm_offload_transfers_in_flight_max",
            &[("pipeline", lane)],
        )
        .unwrap_or(0.0);
        let seen = in_flight_seen.get(lane).copied().unwrap_or(0.0);
        assert!(
            high <= bound && seen <= bound,
            "{lane}: {high} batches in flight (scraped {seen}), bound {bound}"
        );
        let mut queues = Vec::new();
        for (labels, cap) in samples(&last, "kvbm_offload_queue_capacity")
            .into_iter()
            .filter(|(l, _)| l["pipeline"] == lane)
        {
            let q = labels["queue"].clone();
            let hw = sample(
                &last,
                "kvbm_offload_queue_high_water",
                &[("pipeline", lane), ("queue", &q)],
            )
            .unwrap_or(0.0);
            assert!(hw <= cap, "{lane}: queue {q} held {hw} items, bound {cap}");
            queues.push(format!("{q} {hw}/{cap}"));
        }
        assert_eq!(queues.len(), 4, "{lane}: queue gauges missing:\n{last}");
        report.push(format!(
            "{lane}: in flight max {high}/{bound}; {}",
            queues.join(", ")
        ));
    }
    // The slow lane was really busy (its transfers were in flight while we looked).
    let g4_high = sample(
        &last,
        "kvbm_offload_transfers_in_flight_max",
        &[("pipeline", "g2_to_g4")],
    )
    .unwrap_or(0.0);
    assert!(g4_high >= 1.0, "the G2→G4 lane never ran:\n{last}");
    assert!(u(&r, &["bytes", "g2_to_g4"]) > 0, "{r}");
    // G2 and G3 kept serving while G4 was slow.
    let (h2, h3) = (
        u(&r, &["tiers", "g2", "hit_blocks"]),
        u(&r, &["tiers", "g3", "hit_blocks"]),
    );
    assert!(h2 + h3 > 0, "no hit from G2/G3 while G4 was slow: {r}");
    eprintln!(
        "S3 slow (100-200 ms per request, {} requests): G2 hits {h2}, G3 hits {h3}, G4 hits {}, {} blocks in {:.1} s; G1→G2 waits for G2 room {}\n  {}",
        proxy
            .stats()
            .requests
            .load(std::sync::atomic::Ordering::Relaxed),
        u(&r, &["tiers", "g4", "hit_blocks"]),
        u(&r, &["blocks"]),
        r["wall_seconds"].as_f64().unwrap_or(0.0),
        u(&r, &["offload_g2_space_waits"]),
        report.join("\n  ")
    );
}

/// A size-limited tmpfs mounted for one test, unmounted on drop.
struct SmallFs {
    dir: std::path::PathBuf,
}

impl SmallFs {
    /// Mounts a tmpfs of `bytes` at `dir`; `None` (with the reason printed) where mounting is not
    /// permitted (not root, no CAP_SYS_ADMIN).
    fn mount(dir: &Path, bytes: usize) -> Option<SmallFs> {
        std::fs::create_dir_all(dir).unwrap();
        let out = Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={bytes}")])
            .arg("tmpfs")
            .arg(dir)
            .output()
            .ok()?;
        if !out.status.success() {
            eprintln!(
                "cannot mount a tmpfs here: {}",
                String::from_utf8_lossy(&out.stderr)
            );
            return None;
        }
        Some(SmallFs {
            dir: dir.to_path_buf(),
        })
    }
}

impl Drop for SmallFs {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(&self.dir).status();
    }
}

/// Fills the filesystem holding `path` with one ballast file until it is full (`ENOSPC`).
fn fill(path: &Path) -> u64 {
    use std::io::Write;
    let mut f = std::fs::File::create(path).unwrap();
    let chunk = vec![0xa5u8; 4096];
    let mut n = 0u64;
    loop {
        match f.write(&chunk) {
            Ok(0) => break,
            Ok(k) => n += k as u64,
            Err(e) if e.raw_os_error() == Some(libc::ENOSPC) => break,
            Err(e) => panic!("filling {}: {e}", path.display()),
        }
    }
    let _ = f.sync_all();
    n
}

#[test]
fn fault_g3_disk_full_stops_admitting_keeps_serving_and_resumes() {
    let dir = scratch();
    let mnt = dir.path().join("small");
    // The G3 file (2048 slots × 8 KiB = 16 MiB, reserved with fallocate) plus 1 MiB for the
    // journal and the ballast.
    let Some(_fs) = SmallFs::mount(&mnt, (16 << 20) + (1 << 20)) else {
        if std::env::var("KVBM_TEST_SKIP_SERVICES").as_deref() == Ok("1") {
            return;
        }
        panic!("this test needs to mount a tmpfs (run as root), or KVBM_TEST_SKIP_SERVICES=1");
    };
    let g3 = mnt.join("g3");
    let journal = g3.join("g3.journal");
    let args: Vec<String> = [
        "replay",
        "--requests",
        "4000",
        "--time-scale",
        "0.1",
        "--g1-blocks",
        "128",
        "--g2-blocks",
        "256",
        "--g3-blocks",
        "2048",
        "--g3-dir",
        g3.to_str().unwrap(),
        "--json",
    ]
    .into_iter()
    .map(String::from)
    .collect();
    // stderr to a file: a pipe nobody reads while the disk is full would fill with warnings
    // and block kvbm.
    let log = dir.path().join("stderr.log");
    let mut child = kvbm()
        .args(&args)
        .stdout(Stdio::piped())
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .unwrap();
    let len = || std::fs::metadata(&journal).map_or(0, |m| m.len());
    wait_for(
        "200 journal records",
        Duration::from_secs(60),
        || len() >= 64 + 72 * 200,
        &mut child,
    );
    let ballast = mnt.join("ballast");
    let filled = fill(&ballast);
    let full_at = len();
    // Full: the journal cannot grow, so G3 admits nothing more (its page fills, then stops).
    std::thread::sleep(Duration::from_millis(1500));
    let during = len();
    assert!(
        during <= full_at.div_ceil(4096) * 4096,
        "the journal grew past the full filesystem: {full_at} → {during}"
    );
    std::fs::remove_file(&ballast).unwrap();
    let freed = Instant::now();
    wait_for(
        "G3 admitting again",
        Duration::from_secs(30),
        || len() > during + 72 * 20,
        &mut child,
    );
    eprintln!(
        "disk full: ballast {filled} bytes; journal {full_at} → {during} while full; admitting again {:?} after space returned",
        freed.elapsed()
    );
    let out = child.wait_with_output().unwrap();
    let stderr = std::fs::read_to_string(&log).unwrap();
    assert!(!stderr.contains("panicked"), "{stderr}");
    let r = ok_json(out);
    assert_nothing_wrong_served(&r);
    assert!(
        u(&r, &["offload_no_space_blocks"]) > 0,
        "the full disk was not reported: {r}"
    );
    assert!(
        stderr.contains("G3 journal"),
        "no log line names the full G3 journal: {stderr}"
    );
    assert!(u(&r, &["hit_blocks"]) > 0, "{r}");
    // The journal is intact: a restart replays it and serves what it lists, byte-correct.
    let args2: Vec<String> = args
        .iter()
        .map(|a| if a == "4000" { "300".into() } else { a.clone() })
        .filter(|a| a != "--time-scale" && a != "0.1")
        .collect();
    let again = ok_json(kvbm().args(&args2).output().unwrap());
    assert_nothing_wrong_served(&again);
    assert_eq!(u(&again, &["checksum_failures"]), 0, "{again}");
    assert!(u(&again, &["warm_start_blocks", "g3"]) > 0, "{again}");
}

/// Copies every file under `from` to the same relative path under `to`.
fn copy_tree(from: &Path, to: &Path) -> usize {
    let mut n = 0;
    for e in std::fs::read_dir(from).unwrap() {
        let p = e.unwrap().path();
        let dst = to.join(p.file_name().unwrap());
        if p.is_dir() {
            std::fs::create_dir_all(&dst).unwrap();
            n += copy_tree(&p, &dst);
        } else {
            std::fs::copy(&p, &dst).unwrap();
            n += 1;
        }
    }
    n
}

#[test]
fn namespaces_sharing_a_bucket_never_match_each_other() {
    let dir = scratch();
    let Some(s3) = kvbm_tests::faults::OwnS3::start(
        "namespaces_sharing_a_bucket_never_match_each_other",
        &dir.path().join("s3"),
    ) else {
        return;
    };
    let ep = s3.endpoint();
    let run = |ns: &str| {
        ok_json(
            own_s3_cmd(&ep, 200, &[])
                .env("KVBM_PHYSICAL__OBJECT__NAMESPACE", ns)
                .output()
                .unwrap(),
        )
    };
    // Tenant A fills the bucket; tenant B, same workload (same block hashes), same bucket.
    let a = run("tenant-a");
    assert_nothing_wrong_served(&a);
    assert!(u(&a, &["bytes", "g2_to_g4"]) > 0, "{a}");
    let b = run("tenant-b");
    assert_nothing_wrong_served(&b);
    assert_eq!(
        u(&b, &["warm_start_blocks", "g4"]),
        0,
        "B saw A's blocks: {b}"
    );
    // B's G4 hits are its own offloads of this run, never A's: it onboards no more than it wrote.
    assert!(
        u(&b, &["bytes", "g4_to_g2"]) <= u(&b, &["bytes", "g2_to_g4"]),
        "{b}"
    );
    // A's objects planted under B's prefix (the same keys) are foreign to B: rejected on read.
    let bucket = s3.bucket_dir();
    let planted = copy_tree(&bucket.join("tenant-a"), &bucket.join("tenant-b"));
    assert!(planted > 0);
    let b2 = run("tenant-b");
    assert_nothing_wrong_served(&b2);
    assert!(
        u(&b2, &["checksum_failures"]) > 0,
        "A's planted objects were not rejected: {b2}"
    );
    // A rejected object is dropped from G4 and recomputed; only B's fresh uploads of this run
    // can be G4 hits.
    assert!(
        u(&b2, &["tiers", "g4", "hit_blocks"]) <= u(&b2, &["bytes", "g2_to_g4"]) / BLOCK as u64,
        "{b2}"
    );
    // A still reads its own.
    let a2 = run("tenant-a");
    assert_nothing_wrong_served(&a2);
    assert_eq!(u(&a2, &["checksum_failures"]), 0, "{a2}");
    assert!(u(&a2, &["tiers", "g4", "hit_blocks"]) > 0, "{a2}");
}

#[test]
fn credentials_never_appear_in_logs_config_show_or_errors() {
    use kvbm_tests::faults::{OWN_ACCESS_KEY, OWN_SECRET_KEY, OwnS3};
    let dir = scratch();
    let Some(s3) = OwnS3::start(
        "credentials_never_appear_in_logs_config_show_or_errors",
        &dir.path().join("s3"),
    ) else {
        return;
    };
    let ep = s3.endpoint();
    let leaks = |what: &str, out: &Output, secret: &str| {
        for (name, text) in [("stdout", &out.stdout), ("stderr", &out.stderr)] {
            let t = String::from_utf8_lossy(text);
            assert!(!t.contains(secret), "{what}: the secret is in {name}:\n{t}");
        }
    };
    // A full run at the most verbose log level.
    let ok = own_s3_cmd(&ep, 50, &[])
        .env("KVBM_LOG", "trace")
        .output()
        .unwrap();
    assert!(
        ok.status.success(),
        "{}",
        String::from_utf8_lossy(&ok.stderr)
    );
    leaks("trace-level run", &ok, OWN_SECRET_KEY);
    // A wrong secret: the server refuses; the error must not echo the secret given.
    let wrong = "wrong-secret-9d1e2f";
    let bad = kvbm()
        .args(g4_args(
            50,
            &[
                "--s3-endpoint",
                &ep,
                "--s3-bucket",
                kvbm_tests::faults::OWN_BUCKET,
            ],
        ))
        .env("AWS_ACCESS_KEY_ID", OWN_ACCESS_KEY)
        .env("AWS_SECRET_ACCESS_KEY", wrong)
        .env("KVBM_LOG", "debug")
        .envs(FAST_S3)
        .output()
        .unwrap();
    assert!(!bad.status.success(), "a wrong secret was accepted");
    assert!(
        !String::from_utf8_lossy(&bad.stderr).contains("panicked"),
        "{}",
        String::from_utf8_lossy(&bad.stderr)
    );
    leaks("wrong-secret error", &bad, wrong);
    // `config show` with the secret in a config file and in the environment.
    let cfg = dir.path().join("c.toml");
    std::fs::write(
        &cfg,
        format!(
            "[physical.s3]\nendpoint = \"{ep}\"\nbucket = \"b\"\naccess_key = \"k\"\nsecret_key = \"{OWN_SECRET_KEY}\"\n"
        ),
    )
    .unwrap();
    for (label, c) in [
        (
            "config file",
            kvbm()
                .args(["config", "show", "--config", cfg.to_str().unwrap()])
                .output()
                .unwrap(),
        ),
        (
            "environment",
            kvbm()
                .args(["config", "show", "--s3-endpoint", &ep, "--s3-bucket", "b"])
                .env("AWS_ACCESS_KEY_ID", OWN_ACCESS_KEY)
                .env("AWS_SECRET_ACCESS_KEY", OWN_SECRET_KEY)
                .output()
                .unwrap(),
        ),
    ] {
        assert!(
            c.status.success(),
            "{label}: {}",
            String::from_utf8_lossy(&c.stderr)
        );
        leaks(&format!("config show ({label})"), &c, OWN_SECRET_KEY);
    }
}
