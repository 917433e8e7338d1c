//! A quick figure for the real-byte disk tier behind the tiering manager: chunks cascaded from
//! the primary to a G3 file (O_DIRECT) and promoted back, MiB/s each way, and the time the
//! cascade's submission takes on the caller's (the scheduler's) thread, best of several rounds.
//! Uses only the manager-level API, so the same file measures any version of `PhysicalTier`.
//!
//! `cargo run --release -p kvbm-tiering --example physical_tier_bench` (`KVBM_TIER_BENCH_ROUNDS`).

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvbm_physical::{DiskConfig, TransferManager};
use kvbm_tiering::*;

const CHUNK: usize = 1 << 20;
const PRIMARY: usize = 32;
const BATCH: usize = 16;

fn end(m: &mut TieringOffloadingManager) {
    m.on_schedule_end(&ScheduleEndContext::default()).unwrap();
}

fn settle(m: &mut TieringOffloadingManager) {
    end(m);
    let t = Instant::now();
    while m.has_pending_work() {
        assert!(
            t.elapsed() < Duration::from_secs(120),
            "jobs did not finish"
        );
        std::thread::yield_now();
        end(m);
    }
    end(m);
}

fn main() {
    let rounds: usize = std::env::var("KVBM_TIER_BENCH_ROUNDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(8);
    // Under target/ (a real file system: /tmp may be tmpfs, which has no O_DIRECT).
    let dir = std::path::PathBuf::from(
        std::env::var("KVBM_TIER_BENCH_DIR").unwrap_or_else(|_| "target".into()),
    )
    .join(format!("kvbm-tier-bench-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("g3.bin");
    let tm = Arc::new(TransferManager::new().unwrap());
    let primary =
        CpuPrimaryTier::with_transfer_manager(CpuManagerConfig::new(PRIMARY), CHUNK, tm).unwrap();
    let tier = PhysicalTier::disk(&primary, &DiskConfig::new(&path), 4 * PRIMARY, None).unwrap();
    let mut m = TieringOffloadingManager::with_primary(
        primary,
        vec![Box::new(tier)],
        UpstreamFixes::default(),
        false,
    );
    let c = ReqContext::new("bench");
    m.on_new_request(&c).unwrap();
    let k = |i: usize| OffloadKey::from_u64(i as u64);
    let mut next = 0usize;
    let (mut best_store, mut best_promote) = (0.0f64, 0.0f64);
    let mut best_submit = f64::MAX;
    for _ in 0..rounds {
        // Store a batch: it cascades to the disk tier.
        let keys: Vec<OffloadKey> = (next..next + BATCH).map(k).collect();
        next += BATCH;
        let o = m.prepare_store(&keys, &c).unwrap().expect("room");
        for key in &o.keys_to_store {
            m.primary_mut()
                .chunk_mut(key)
                .unwrap()
                .fill(key.as_bytes()[0]);
        }
        let t = Instant::now();
        m.complete_store(&o.keys_to_store, &c, true).unwrap();
        // The caller's (scheduler thread's) share: the cascade's submission, not its I/O.
        best_submit = best_submit.min(t.elapsed().as_secs_f64());
        settle(&mut m);
        best_store = best_store.max((BATCH * CHUNK) as f64 / t.elapsed().as_secs_f64());
        // Push them out of the primary, then promote them back.
        let filler: Vec<OffloadKey> = (next..next + PRIMARY).map(k).collect();
        next += PRIMARY;
        let o = m.prepare_store(&filler, &c).unwrap().expect("room");
        m.complete_store(&o.keys_to_store, &c, true).unwrap();
        settle(&mut m);
        let t = Instant::now();
        let pending = keys
            .iter()
            .filter(|key| m.lookup(key, &c) == LookupResult::HitPending)
            .count();
        settle(&mut m);
        let hits = keys
            .iter()
            .filter(|key| m.lookup(key, &c) == LookupResult::Hit)
            .count();
        assert_eq!(hits, pending, "every promotion landed");
        if pending > 0 {
            best_promote = best_promote.max((pending * CHUNK) as f64 / t.elapsed().as_secs_f64());
        }
    }
    m.on_request_finished(&c).unwrap();
    m.shutdown().unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    println!(
        "disk tier, {} KiB chunks, batches of {BATCH}, best of {rounds}: cascade {:.0} MiB/s, promotion {:.0} MiB/s, \
         the cascade's submission on the caller's thread {:.0} us per batch",
        CHUNK / 1024,
        best_store / (1 << 20) as f64,
        best_promote / (1 << 20) as f64,
        best_submit * 1e6
    );
}
