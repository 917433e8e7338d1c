//! The whole tier stack from a configuration file alone, without the CLI: blocks stored through
//! the scheduler-facing manager reach G3 and G4, a second stack built from the same file starts
//! warm (the G3 journal, the G4 listing), and every block it serves comes back from G3 (the
//! half it still holds) or G4 (the rest) with its bytes verified at G1.
//!
//! ```text
//!  kvbm.toml ─► ConfigBuilder ─► StackPlan::new ─► TierStack::build
//!     serve (compute in G1 ─► prepare_store ─► G1→G2 ─► complete_store ─► write-through ─► G3, G4)
//!     finish (lanes drained, G3 synced, journal synced)
//!  drop; build again from the same file ─► warm G3 (journal) and G4 (listing)
//!     serve the same requests ─► lookup ─► promote G3/G4 → G2 ─► G2 → G1, every block verified
//! ```
//!
//! Run once with G4 in a local directory (always) and once on the S3-compatible server the
//! project's test services provide (skipped, saying so, under `KVBM_TEST_SKIP_SERVICES=1`).

use std::path::Path;
use std::sync::Arc;

use kvbm_engine::config::ConfigBuilder;
use kvbm_engine::stack::{Contents, Identities, StackPlan, TierStack};
use kvbm_logical::SequenceHash;
use kvbm_tiering::OffloadKey;
use kvbm_tiering::tiering::{digest_hash, key_digest};

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

/// The requests' scheduler keys and the hashes the tiers register them under.
fn requests(block_size: u32) -> Vec<(Vec<OffloadKey>, Vec<SequenceHash>)> {
    (0..REQUESTS)
        .map(|r| {
            let keys: Vec<OffloadKey> = (0..BLOCKS_PER_REQUEST)
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
    let config = ConfigBuilder::new()
        .file(file)
        .expect("the file is read")
        .build()
        .expect("the file is a valid configuration");
    let block_size = config.logical.block_size;
    let reqs = requests(block_size);
    let mut plan = StackPlan::new(config, Arc::new(Pattern)).expect("a valid plan");
    // G4 lists its objects by name at a warm start: their identities are the keys' digests.
    plan.identities = Arc::new(Identities::new(reqs.iter().flat_map(|(keys, hashes)| {
        keys.iter()
            .zip(hashes)
            .map(|(k, h)| (*h, key_digest(k)))
            .collect::<Vec<_>>()
    })));
    let mut stack = TierStack::build(&plan).expect("the stack builds from the file");
    let warm = stack.warm_blocks();
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
    let bytes =
        std::array::from_fn(|i| stack.counters.bytes[i].load(std::sync::atomic::Ordering::Relaxed));
    let checksum_failures = stack
        .counters
        .checksum_failures
        .load(std::sync::atomic::Ordering::Relaxed);
    (t, warm, bytes, checksum_failures)
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
