//! The whole tier stack from a configuration file alone, without the CLI: blocks stored through
//! the scheduler-facing manager reach G3 and G4, a second stack built from the same file starts
//! warm (the G3 journal, the G4 listing), and every block it serves comes back from G3 (the
//! half it still holds) or G4 (the rest) with its bytes verified at G1.
//!
//! ```text
//!  kvbm.toml ─► ConfigBuilder ─► StackPlan::new ─► TierStack::build (ReplayDriver::build)
//!     serve (compute in G1 ─► prepare_store ─► G1→G2 ─► complete_store ─► write-through ─► G3, G4)
//!     finish (lanes drained, G3 synced, journal synced)
//!  drop; build again from the same file ─► warm G3 (journal) and G4 (listing)
//!     serve the same requests ─► lookup ─► promote G3/G4 → G2 ─► G2 → G1, every block verified
//! ```
//!
//! Run once with G4 in a local directory (always) and once on the S3-compatible server the
//! project's test services provide (skipped, saying so, under `KVBM_TEST_SKIP_SERVICES=1`).
//!
//! The write-through's own keys (`[offload.write_through]`), from the same kind of file: a
//! request-level G4 lane added to a warm G3 gets the prefixes G3 serves back (a chunk-level one
//! only what is computed), and a G3 lane under back-pressure drops stores, reports what it
//! wrote and dropped in vLLM's metric names, and restarts warm with exactly what it wrote.

use std::path::Path;
use std::sync::Arc;

use kvbm_engine::config::ConfigBuilder;
use kvbm_engine::replay::ReplayDriver;
use kvbm_engine::stack::{Contents, Identities, StackPlan, TierStack};
use kvbm_logical::SequenceHash;
use kvbm_tiering::stats::names;
use kvbm_tiering::tiering::{digest_hash, key_digest};
use kvbm_tiering::{OffloadKey, OffloadingConnectorStats};

/// Every block's bytes: a pure function of its hash, so a block from the wrong place, or
/// damaged, fails at G1.
#[derive(Debug)]
struct Pattern;

fn word(hash: SequenceHash, i: usize) -> u64 {
    let v = hash.as_u128();
    let mut x = (v as u64)
        ^ ((v >> 64) as u64).rotate_left(23)
        ^ (i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    x ^= x >> 29;
    x.wrapping_mul(0xBF58_476D_1CE4_E5B9)
}

impl Contents for Pattern {
    fn fill(&self, hash: SequenceHash, out: &mut [u8]) {
        for (i, c) in out.chunks_exact_mut(8).enumerate() {
            c.copy_from_slice(&word(hash, i).to_le_bytes());
        }
    }

    fn verify(&self, hash: SequenceHash, bytes: &[u8]) -> bool {
        bytes
            .chunks_exact(8)
            .enumerate()
            .all(|(i, c)| c == word(hash, i).to_le_bytes())
    }
}

const REQUESTS: usize = 40;
const BLOCKS_PER_REQUEST: usize = 8;
/// G3 holds half the blocks: the older half is read back from G4.
const G3_BLOCKS: usize = REQUESTS * BLOCKS_PER_REQUEST / 2;

/// The requests' scheduler keys and the hashes the tiers register them under, each `len`
/// blocks long (the first blocks of each are the same for every `len`: a longer request
/// extends the shorter one's prefix).
fn requests_of(block_size: u32, len: usize) -> Vec<(Vec<OffloadKey>, Vec<SequenceHash>)> {
    (0..REQUESTS)
        .map(|r| {
            let keys: Vec<OffloadKey> = (0..len)
                .map(|j| {
                    let mut raw = [0u8; 20];
                    raw[..8].copy_from_slice(&(r as u64).to_le_bytes());
                    raw[8..16].copy_from_slice(&(j as u64).to_le_bytes());
                    raw[16] = 0x5a;
                    OffloadKey::from_bytes(&raw).expect("a 20-byte key")
                })
                .collect();
            let hashes = keys
                .iter()
                .map(|k| digest_hash(&key_digest(k), block_size))
                .collect();
            (keys, hashes)
        })
        .collect()
}

/// What serving every request did: hits per tier, onboarded, verified, corrupt, computed.
#[derive(Debug, Default, PartialEq)]
struct Totals {
    hits: [u64; 4],
    onboarded: u64,
    verified: u64,
    corrupt: u64,
    computed: u64,
}

/// Builds the stack from `file` alone, serves every request, drains it.
fn run(file: &Path) -> (Totals, (usize, usize), [u64; 6], u64) {
    let r = run_of(file, BLOCKS_PER_REQUEST);
    (r.totals, r.warm, r.bytes, r.checksum_failures)
}

/// What one run of the stack did.
struct Run {
    totals: Totals,
    /// G3 and G4 blocks at start.
    warm: (usize, usize),
    /// Bytes per path: g1_to_g2, g2_to_g3, g3_to_g2, g2_to_g4, g4_to_g2, g2_to_g1.
    bytes: [u64; 6],
    checksum_failures: u64,
    /// The scheduler-facing manager's stats after the drain.
    stats: OffloadingConnectorStats,
}

/// As [`run`], with requests `len` blocks long, and the manager's stats.
fn run_of(file: &Path, len: usize) -> Run {
    let config = ConfigBuilder::new()
        .file(file)
        .expect("the file is read")
        .build()
        .expect("the file is a valid configuration");
    let block_size = config.logical.block_size;
    let reqs = requests_of(block_size, len);
    let mut plan = StackPlan::new(config, Arc::new(Pattern)).expect("a valid plan");
    // G4 lists its objects by name at a warm start: their identities are the keys' digests.
    plan.identities = Arc::new(Identities::new(reqs.iter().flat_map(|(keys, hashes)| {
        keys.iter()
            .zip(hashes)
            .map(|(k, h)| (*h, key_digest(k)))
            .collect::<Vec<_>>()
    })));
    let mut stack = ReplayDriver::build(&plan).expect("the stack builds from the file");
    let warm = stack.stack().warm_blocks();
    let mut t = Totals::default();
    for (keys, hashes) in &reqs {
        let s = stack
            .serve_scheduled(hashes, keys)
            .expect("every request is served");
        for (a, b) in t.hits.iter_mut().zip(s.hits) {
            *a += b;
        }
        t.onboarded += s.onboarded;
        t.verified += s.verified;
        t.corrupt += s.corrupt;
        t.computed += s.computed;
    }
    stack.finish().expect("the lanes drain and G3 syncs");
    let bytes = std::array::from_fn(|i| {
        stack.stack().counters().bytes[i].load(std::sync::atomic::Ordering::Relaxed)
    });
    let checksum_failures = stack
        .stack()
        .counters()
        .checksum_failures
        .load(std::sync::atomic::Ordering::Relaxed);
    let stats = stack
        .stack_mut()
        .scheduler_stats()
        .expect("the Tiering front end reports stats");
    Run {
        totals: t,
        warm,
        bytes,
        checksum_failures,
        stats,
    }
}

/// The configuration file: small G1/G2, G3 for half the blocks, G4 for all of them.
fn write_config(dir: &Path, g4: &str) -> std::path::PathBuf {
    let path = dir.join("kvbm.toml");
    let text = format!(
        r#"
[tiers]
g1_blocks = 64
g2_blocks = 24
g3_blocks = {g3}
g4_blocks = {g4_blocks}
block_bytes = 8192

[physical.disk]
path = "{disk}"

# A store waits for G2 room (the lanes below free it) rather than skip its blocks.
[offload.g1_to_g2]
room_patience_ms = 30000

{g4}
"#,
        g3 = G3_BLOCKS,
        g4_blocks = REQUESTS * BLOCKS_PER_REQUEST,
        disk = dir.join("g3").join("g3.bin").display(),
    );
    std::fs::write(&path, text).expect("the config file is written");
    path
}

fn store_restart_onboard(file: &Path) {
    let total = (REQUESTS * BLOCKS_PER_REQUEST) as u64;

    // Cold: every block is computed, stored, and written below G2.
    let (cold, warm, bytes, bad) = run(file);
    assert_eq!(warm, (0, 0), "a fresh stack starts cold");
    assert_eq!(cold.computed, total, "{cold:?}");
    assert_eq!(cold.corrupt, 0);
    assert_eq!(bad, 0);
    let block_bytes = 8192u64;
    // Paths: g1_to_g2, g2_to_g3, g3_to_g2, g2_to_g4, g4_to_g2, g2_to_g1.
    assert_eq!(bytes[0], total * block_bytes, "every block stored in G2");
    assert_eq!(bytes[1], total * block_bytes, "every block written to G3");
    assert_eq!(bytes[3], total * block_bytes, "every block written to G4");

    // Warm: a new stack from the same file finds every block below, and serves each one back
    // with the bytes it was stored with.
    let (again, warm, bytes, bad) = run(file);
    assert_eq!(
        warm,
        (G3_BLOCKS, total as usize),
        "G3's journal lists a full G3, G4's listing every block"
    );
    assert_eq!(again.computed, 0, "nothing is computed again: {again:?}");
    assert_eq!(again.hits[0] + again.hits[1], 0, "G1 and G2 start empty");
    assert_eq!(
        again.hits[2] + again.hits[3],
        total,
        "every block from G3 or G4"
    );
    assert!(
        again.hits[2] > 0 && again.hits[3] > 0,
        "both G3 and G4 serve: {again:?}"
    );
    assert_eq!(again.onboarded, total);
    assert_eq!(
        again.verified, total,
        "every onboarded block verified at G1"
    );
    assert_eq!(again.corrupt, 0);
    assert_eq!(bad, 0);
    assert!(
        bytes[2] + bytes[4] >= total * block_bytes,
        "promoted from G3/G4"
    );
}

#[test]
fn the_stack_from_a_config_file_stores_restarts_warm_and_onboards_verified() {
    let dir = tempfile::tempdir().expect("a temporary directory");
    let g4 = format!(
        "[physical]\nobject_dir = \"{}\"",
        dir.path().join("g4").display()
    );
    std::fs::create_dir_all(dir.path().join("g4")).expect("the G4 directory");
    let file = write_config(dir.path(), &g4);
    store_restart_onboard(&file);
}

#[test]
fn the_stack_from_a_config_file_on_s3_restarts_warm() {
    let Some(s3) = kvbm_tests::services::s3("the_stack_from_a_config_file_on_s3_restarts_warm")
    else {
        return;
    };
    let dir = tempfile::tempdir().expect("a temporary directory");
    let namespace = format!(
        "stack-from-config-{}-{}",
        std::process::id(),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .expect("after 1970")
            .as_nanos()
    );
    let g4 = format!(
        "[physical.s3]\nendpoint = \"{}\"\nbucket = \"{}\"\naccess_key = \"{}\"\nsecret_key = \"{}\"\n\n[physical.object]\nnamespace = \"{namespace}\"",
        s3.endpoint, s3.bucket, s3.access_key, s3.secret_key
    );
    let file = write_config(dir.path(), &g4);
    store_restart_onboard(&file);
}

/// A configuration file with G3 for every block (`len` per request) and the given extra keys.
fn write_through_config(dir: &Path, len: usize, extra: &str) -> std::path::PathBuf {
    let path = dir.join("kvbm.toml");
    let text = format!(
        r#"
[tiers]
g1_blocks = 64
g2_blocks = 24
g3_blocks = {g3}
block_bytes = 8192

[physical.disk]
path = "{disk}"

[offload.g1_to_g2]
room_patience_ms = 30000

{extra}
"#,
        g3 = REQUESTS * len,
        disk = dir.join("g3").join("g3.bin").display(),
    );
    std::fs::write(&path, text).expect("the config file is written");
    path
}

/// G4 added under a warm G3: requests that extend the stored prefixes by two blocks are served
/// their prefix from G3 and compute the rest; a request-level G4 lane gets every block of each
/// request (the prefix handed on from G2 when the request stores), a chunk-level one only the
/// computed blocks.
#[test]
fn a_request_level_g4_lane_gets_the_prefixes_a_warm_g3_serves() {
    const LONGER: usize = BLOCKS_PER_REQUEST + 2;
    let block_bytes = 8192u64;
    let g4_written = |request_level: &str| -> Run {
        let dir = tempfile::tempdir().expect("a temporary directory");
        let cold = write_through_config(dir.path(), LONGER, "");
        let first = run_of(&cold, BLOCKS_PER_REQUEST);
        assert_eq!(
            first.totals.computed,
            (REQUESTS * BLOCKS_PER_REQUEST) as u64
        );
        let g4 = dir.path().join("g4");
        std::fs::create_dir_all(&g4).expect("the G4 directory");
        let warm = write_through_config(
            dir.path(),
            LONGER,
            &format!(
                "[physical]\nobject_dir = \"{}\"\n\n[offload.write_through]\nrequest_level = {request_level}\n",
                g4.display()
            ),
        );
        // G4's size is a [tiers] key: append it to that table.
        let text = std::fs::read_to_string(&warm).expect("the file");
        let text = text.replacen(
            "block_bytes = 8192",
            &format!("block_bytes = 8192\ng4_blocks = {}", REQUESTS * LONGER),
            1,
        );
        std::fs::write(&warm, text).expect("the file");
        run_of(&warm, LONGER)
    };

    let with = g4_written(r#"["G4"]"#);
    let prefix = (REQUESTS * BLOCKS_PER_REQUEST) as u64;
    let suffix = (REQUESTS * (LONGER - BLOCKS_PER_REQUEST)) as u64;
    assert_eq!(with.warm.0, prefix as usize, "G3 is warm from its journal");
    assert_eq!(with.totals.computed, suffix, "{:?}", with.totals);
    assert_eq!(with.totals.hits[2], prefix, "every prefix block from G3");
    assert_eq!(with.totals.verified, with.totals.onboarded);
    assert_eq!(with.totals.corrupt, 0);
    assert_eq!(with.checksum_failures, 0);
    assert_eq!(
        with.bytes[3],
        (prefix + suffix) * block_bytes,
        "the request-level G4 lane wrote every block of every request"
    );

    let without = g4_written("[]");
    assert_eq!(without.totals.computed, suffix);
    assert_eq!(
        without.bytes[3],
        suffix * block_bytes,
        "a chunk-level G4 lane writes only what was stored"
    );
}

/// A G3 lane whose watermarks no real write can stay under is pressured after its warm-up:
/// it drops stores, and says so in vLLM's metric names. What it wrote is exactly what G3 then
/// holds: a restart finds those blocks warm, and serves them verified.
#[test]
fn a_g3_lane_under_back_pressure_drops_stores_and_restarts_warm_with_what_it_wrote() {
    let dir = tempfile::tempdir().expect("a temporary directory");
    let file = write_through_config(
        dir.path(),
        BLOCKS_PER_REQUEST,
        "[offload.write_through]\nbackpressure = true\ng3_watermarks = [1e-9, 1e-10]\n",
    );
    let total = (REQUESTS * BLOCKS_PER_REQUEST) as u64;
    let block_bytes = 8192u64;
    let cold = run_of(&file, BLOCKS_PER_REQUEST);
    let disk = Some("1:disk");
    let s = &cold.stats;
    let written = s.counter(names::WRITE_BYTES, disk).unwrap_or(0.0) as u64 / block_bytes;
    let dropped = s
        .counter(names::BACKPRESSURE_BLOCKS_DROPPED, disk)
        .unwrap_or(0.0) as u64;
    assert!(
        s.counter(names::BACKPRESSURE_STORES_DROPPED, disk)
            .is_some_and(|n| n > 0.0),
        "the pressured lane dropped stores"
    );
    assert!(
        s.gauge(names::BACKPRESSURE_STORE_LATENCY_EMA, disk)
            .is_some_and(|ema| ema > 1e-9),
        "the EMA is above the high watermark"
    );
    assert!(written >= 3, "the warm-up's writes went through: {written}");
    assert_eq!(
        written + dropped,
        total,
        "every stored block was written or dropped"
    );
    assert_eq!(
        cold.bytes[1],
        written * block_bytes,
        "G3's byte counter agrees"
    );
    assert_eq!(s.gauge(names::ACTIVE_CASCADE_JOBS, disk), Some(0.0));

    let warm = run_of(&file, BLOCKS_PER_REQUEST);
    assert_eq!(
        warm.warm.0 as u64, written,
        "G3 restarts with exactly what the lane wrote"
    );
    assert_eq!(
        warm.totals.hits[2], written,
        "each written block is served from G3"
    );
    assert_eq!(warm.totals.computed, total - written);
    assert_eq!(warm.totals.verified, warm.totals.onboarded);
    assert_eq!(warm.totals.corrupt, 0);
}

/// The configuration of a write-through file with `extra` appended, checked by `check`, and
/// the tier stack's refusal of it (`what`: what was built instead, for the panic).
fn stack_refusal(
    extra: &str,
    check: impl FnOnce(&kvbm_engine::KvbmConfig),
    what: &str,
) -> kvbm_engine::EngineError {
    let dir = tempfile::tempdir().expect("a temporary directory");
    let file = write_through_config(dir.path(), BLOCKS_PER_REQUEST, extra);
    let config = ConfigBuilder::new()
        .file(&file)
        .expect("the file is read")
        .build()
        .expect("a valid configuration");
    check(&config);
    let plan = StackPlan::new(config, Arc::new(Pattern)).expect("a plan");
    match TierStack::build(&plan) {
        Err(e) => e,
        Ok(_) => panic!("{what} was built"),
    }
}

/// The tier stack serves from its own process's memory: a file that puts the ranks in worker
/// processes is refused naming the key, not served from memory no rank has.
#[test]
fn the_stack_refuses_worker_process_ranks_naming_the_key() {
    let e = stack_refusal(
        "[workers]\nmode = \"processes\"\nranks = 2\n\n[transport]\nnats_url = \"nats://127.0.0.1:4222\"\n",
        |_| {},
        "a stack with worker-process ranks",
    );
    assert_eq!(e.config_key(), Some("workers.mode"), "{e}");
}

/// `physical.g1 = "device"` is read, and the tier stack (whose G1 stands in for the device:
/// it computes and checks blocks there on the host) refuses it naming the key, never putting G1
/// somewhere else or writing device memory from the host.
#[test]
fn the_stack_refuses_g1_on_a_device_naming_the_key() {
    let e = stack_refusal(
        "[physical]\ng1 = \"device\"\ng1_device = 1\n",
        |config| {
            assert_eq!(config.physical.g1, kvbm_engine::config::G1Memory::Device);
            assert_eq!(config.physical.g1_device, 1);
        },
        "a stack over G1 in device memory",
    );
    assert_eq!(e.config_key(), Some("physical.g1"), "{e}");
    assert!(e.to_string().contains("on the host"), "{e}");
}
