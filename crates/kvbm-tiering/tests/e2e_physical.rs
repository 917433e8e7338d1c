//! End to end through real storage: a disk tier (G3, a real file with O_DIRECT where the file
//! system allows it) and an object tier (G4, the S3-compatible server `cargo xtask services`
//! starts). Chunks are written into pinned primary slots, cascaded to the tier, evicted from the
//! primary, promoted back, and their bytes compared.

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvbm_physical::{DiskConfig, ObjectConfig, ObjectStorage, S3Config, TransferManager};
use kvbm_tiering::*;

const CHUNK: usize = 8192;

fn k(i: u64) -> OffloadKey {
    OffloadKey::from_u64(i)
}

fn pattern(i: u64) -> Vec<u8> {
    (0..CHUNK)
        .map(|j| (j as u64 * 31 + i * 7919) as u8)
        .collect()
}

fn end(m: &mut TieringOffloadingManager) {
    m.on_schedule_end(&ScheduleEndContext::default()).unwrap();
}

/// Steps until no job is pending (the first step end submits staged promotions).
fn settle(m: &mut TieringOffloadingManager) {
    end(m);
    let t = Instant::now();
    while m.has_pending_work() {
        assert!(
            t.elapsed() < Duration::from_secs(60),
            "tier jobs did not finish"
        );
        std::thread::sleep(Duration::from_millis(2));
        end(m);
    }
    end(m);
}

fn store(m: &mut TieringOffloadingManager, c: &ReqContext, keys: &[u64]) {
    let ks: Vec<OffloadKey> = keys.iter().map(|&i| k(i)).collect();
    let o = m.prepare_store(&ks, c).unwrap().expect("room");
    for (key, &i) in ks.iter().zip(keys) {
        m.primary_mut()
            .chunk_mut(key)
            .unwrap()
            .copy_from_slice(&pattern(i));
    }
    m.complete_store(&o.keys_to_store, c, true).unwrap();
}

fn round_trip(make_tier: impl FnOnce(&CpuPrimaryTier) -> PhysicalTier) {
    let tm = Arc::new(TransferManager::new().unwrap());
    let primary =
        CpuPrimaryTier::with_transfer_manager(CpuManagerConfig::new(4), CHUNK, tm).unwrap();
    let tier = make_tier(&primary);
    let mut m = TieringOffloadingManager::with_primary(
        primary,
        vec![Box::new(tier)],
        UpstreamFixes::default(),
        false,
    );
    let c = ReqContext::new("r");
    m.on_new_request(&c).unwrap();
    store(&mut m, &c, &[0, 1, 2, 3]);
    settle(&mut m);
    assert_eq!(m.tier_mut::<PhysicalTier>(0).unwrap().num_ready(), 4);
    // evict 0..3 from the primary
    store(&mut m, &c, &[10, 11, 12, 13]);
    settle(&mut m);
    for i in 0..4 {
        assert!(m.primary().manager().chunk(&k(i)).is_none(), "{i} evicted");
    }
    // promote 1 and 2 back
    for i in [1, 2] {
        assert_eq!(m.lookup(&k(i), &c), LookupResult::HitPending);
    }
    settle(&mut m);
    for i in [1, 2] {
        assert_eq!(m.lookup(&k(i), &c), LookupResult::Hit);
        assert_eq!(
            m.primary().chunk(&k(i)).unwrap(),
            pattern(i).as_slice(),
            "bytes of {i}"
        );
    }
    // and load them as the GPU would
    let spec = m.prepare_load(&[k(1), k(2)], &c).unwrap();
    assert_eq!(spec.chunk_ids().unwrap().len(), 2);
    m.complete_load(&[k(1), k(2)], &c).unwrap();
    m.on_request_finished(&c).unwrap();
    m.primary().manager().check_invariants().unwrap();
    m.shutdown().unwrap();
}

#[test]
fn disk_tier_round_trip_bytes_verified() {
    let dir = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("kvbm-tiering-e2e");
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join(format!("g3-{}.bin", std::process::id()));
    round_trip(|p| PhysicalTier::disk(p, &DiskConfig::new(&path), 16).unwrap());
    let _ = std::fs::remove_file(&path);
}

#[test]
fn disk_tier_evicts_oldest_when_full() {
    let dir = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("kvbm-tiering-e2e");
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join(format!("g3-small-{}.bin", std::process::id()));
    let tm = Arc::new(TransferManager::new().unwrap());
    let primary =
        CpuPrimaryTier::with_transfer_manager(CpuManagerConfig::new(4), CHUNK, tm).unwrap();
    let tier = PhysicalTier::disk(&primary, &DiskConfig::new(&path), 2).unwrap();
    let mut m = TieringOffloadingManager::with_primary(
        primary,
        vec![Box::new(tier)],
        UpstreamFixes::default(),
        false,
    );
    let c = ReqContext::new("r");
    m.on_new_request(&c).unwrap();
    store(&mut m, &c, &[0, 1]);
    settle(&mut m);
    store(&mut m, &c, &[2]);
    settle(&mut m);
    let t = m.tier_mut::<PhysicalTier>(0).unwrap();
    assert_eq!(t.num_ready(), 2);
    assert_eq!(t.lookup(&k(0), &c), LookupResult::Miss, "oldest evicted");
    assert_eq!(t.lookup(&k(2), &c), LookupResult::Hit);
    let _ = std::fs::remove_file(&path);
}

#[test]
fn object_tier_round_trip_bytes_verified() {
    let Some(s3) = kvbm_tests::services::s3("object_tier_round_trip_bytes_verified") else {
        return;
    };
    let cfg = S3Config {
        endpoint: Some(s3.endpoint.clone()),
        bucket: s3.bucket.clone(),
        region: "us-east-1".into(),
        access_key: s3.access_key.clone(),
        secret_key: s3.secret_key.clone(),
    };
    let oc = ObjectConfig {
        namespace: format!("tiering-e2e-{}", std::process::id()),
        ..ObjectConfig::default()
    };
    let storage = Arc::new(ObjectStorage::s3(&cfg, oc).unwrap());
    round_trip(|p| PhysicalTier::object(p, storage, "chunk-").unwrap());
}

#[test]
fn corrupted_disk_chunk_is_never_served() {
    let dir = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("kvbm-tiering-e2e");
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join(format!("g3-corrupt-{}.bin", std::process::id()));
    let tm = Arc::new(TransferManager::new().unwrap());
    let primary =
        CpuPrimaryTier::with_transfer_manager(CpuManagerConfig::new(2), CHUNK, tm).unwrap();
    let tier = PhysicalTier::disk(&primary, &DiskConfig::new(&path), 8).unwrap();
    let mut m = TieringOffloadingManager::with_primary(
        primary,
        vec![Box::new(tier)],
        UpstreamFixes::default(),
        false,
    );
    let c = ReqContext::new("r");
    m.on_new_request(&c).unwrap();
    store(&mut m, &c, &[0, 1]);
    settle(&mut m);
    store(&mut m, &c, &[2, 3]);
    settle(&mut m);
    // flip every byte of the file (payloads and headers)
    let len = std::fs::metadata(&path).unwrap().len() as usize;
    std::fs::write(&path, vec![0xA5u8; len]).unwrap();
    assert_eq!(m.lookup(&k(0), &c), LookupResult::HitPending);
    settle(&mut m);
    assert_eq!(
        m.lookup(&k(0), &c),
        LookupResult::Miss,
        "a chunk that failed verification reads MISS"
    );
    assert_eq!(
        m.tier_mut::<PhysicalTier>(0).unwrap().lookup(&k(0), &c),
        LookupResult::Miss
    );
    m.primary().manager().check_invariants().unwrap();
    let _ = std::fs::remove_file(&path);
}
