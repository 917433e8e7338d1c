//! End to end through real storage: a disk tier (G3, a real file with O_DIRECT where the file
//! system allows it) and an object tier (G4, the S3-compatible server `cargo xtask services`
//! starts). Chunks are written into pinned primary slots, cascaded to the tier, evicted from the
//! primary, promoted back, and their bytes compared. Every move goes through kvbm-offload's one
//! move (`BlockMover` into the tier's `BoundTier`, `ExternalMover` out of it); typed per-block
//! failures map to the tier's handling (corrupt or vanished copies are dropped, never served).

use std::sync::Arc;
use std::time::Duration;

use kvbm_logical::{BlockManager, G3, Tier};
use kvbm_offload::{BlockFailureKind, BoundTier};
use kvbm_physical::{
    Backing, DiskConfig, ObjectConfig, ObjectKey, ObjectStorage, PhysicalLayout, S3Config,
    TransferManager,
};
use kvbm_tiering::tiering::{TIER_BLOCK_SIZE, key_digest, key_hash};
use kvbm_tiering::*;

use kvbm_tiering::testing::{chunk_pattern, end_step as end, key as k, settle, store};

const CHUNK: usize = 8192;

fn pattern(i: u64) -> Vec<u8> {
    chunk_pattern(i, CHUNK)
}

fn scratch(name: &str) -> std::path::PathBuf {
    let dir = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("kvbm-tiering-e2e");
    std::fs::create_dir_all(&dir).unwrap();
    dir.join(format!("{name}-{}.bin", std::process::id()))
}

/// Every key the tier holds is a block of its bound manager, registered under the key's hash
/// with the key's digest as its identity (the one move registered it).
fn assert_registered<T: Tier>(tier: &PhysicalTier<T>, keys: &[u64]) {
    let manager = tier.bound().manager();
    for &i in keys {
        let hash = key_hash(&k(i), manager.block_size());
        let found = manager.scan_matches(&[hash]);
        assert_eq!(found.len(), 1, "key {i} registered in the tier's manager");
        assert_eq!(
            found[0].digest(),
            Some(key_digest(&k(i))),
            "identity of {i}"
        );
        assert_eq!(
            tier.block_id(&k(i)),
            Some(found[0].block_id()),
            "the tier holds the registered block of {i}"
        );
    }
}

/// A tiering manager over a CPU primary tier of `chunks` chunks (on its own transfer manager)
/// and the one secondary tier `make` builds over it.
fn manager_over<T: Tier>(
    chunks: usize,
    make: impl FnOnce(&CpuPrimaryTier) -> PhysicalTier<T>,
) -> TieringOffloadingManager {
    let tm = Arc::new(TransferManager::new().unwrap());
    let primary =
        CpuPrimaryTier::with_transfer_manager(CpuManagerConfig::new(chunks), CHUNK, tm).unwrap();
    let tier = make(&primary);
    TieringOffloadingManager::with_primary(
        primary,
        vec![Box::new(tier)],
        UpstreamFixes::default(),
        false,
    )
}

fn round_trip<T: Tier>(make_tier: impl FnOnce(&CpuPrimaryTier) -> PhysicalTier<T>) {
    let mut m = manager_over(4, make_tier);
    let c = ReqContext::new("r");
    m.on_new_request(&c).unwrap();
    store(&mut m, &c, &[0, 1, 2, 3]);
    settle(&mut m);
    let tier = m.tier_mut::<PhysicalTier<T>>(0).unwrap();
    assert_eq!(tier.num_ready(), 4);
    assert_registered(tier, &[0, 1, 2, 3]);
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
    let path = scratch("g3");
    round_trip(|p| {
        let t = PhysicalTier::disk(p, &DiskConfig::new(&path), 16, None).unwrap();
        let tm = t.bound().transfer_manager();
        if let Backing::Disk(d) = tm.layout(t.bound().layout()).unwrap().backing() {
            assert!(
                d.capabilities().direct_io,
                "the G3 file is opened with O_DIRECT"
            );
        }
        t
    });
    let _ = std::fs::remove_file(&path);
}

#[test]
fn disk_tier_evicts_oldest_when_full() {
    let path = scratch("g3-small");
    let mut m = disk_manager(&path, 4, 2);
    let c = ReqContext::new("r");
    m.on_new_request(&c).unwrap();
    store(&mut m, &c, &[0, 1]);
    settle(&mut m);
    store(&mut m, &c, &[2]);
    settle(&mut m);
    let t = m.tier_mut::<DiskTier>(0).unwrap();
    assert_eq!(t.num_ready(), 2);
    assert_eq!(t.lookup(&k(0), &c), LookupResult::Miss, "oldest evicted");
    assert_eq!(t.lookup(&k(2), &c), LookupResult::Hit);
    let _ = std::fs::remove_file(&path);
}

/// A step's cascaded stores are booked when submitted and start together at the step's end
/// (`on_schedule_end`), one move for the step's jobs: nothing of them is written before, every
/// job is reported after, and each key ends up with its own bytes.
#[test]
fn a_steps_stores_start_at_its_end_as_one_move() {
    let path = scratch("g3-step-end");
    let mut m = disk_manager(&path, 8, 16);
    let a = ReqContext::new("a");
    m.on_new_request(&a).unwrap();
    let b = ReqContext::new("b");
    m.on_new_request(&b).unwrap();
    store(&mut m, &a, &[0, 1, 2]);
    store(&mut m, &b, &[3, 4]);
    std::thread::sleep(Duration::from_millis(50));
    {
        let t = m.tier_mut::<DiskTier>(0).unwrap();
        assert!(t.has_pending_work(), "two store jobs booked");
        let mut out = Vec::new();
        t.get_finished_jobs(&mut out);
        assert!(
            out.is_empty(),
            "no store ran before the step's end: {out:?}"
        );
        assert_eq!(t.num_ready(), 0);
        assert_eq!(t.num_inflight(), 2);
    }
    settle(&mut m);
    let keys = [0, 1, 2, 3, 4];
    let t = m.tier_mut::<DiskTier>(0).unwrap();
    assert_eq!(t.num_ready(), 5);
    assert_registered(t, &keys);
    // Each key's own bytes come back: evict them from the primary, promote them.
    let c = ReqContext::new("c");
    m.on_new_request(&c).unwrap();
    store(&mut m, &c, &[10, 11, 12, 13, 14, 15, 16, 17]);
    settle(&mut m);
    for &i in &keys {
        assert_eq!(
            m.lookup(&k(i), &c),
            LookupResult::HitPending,
            "{i} in the tier"
        );
    }
    settle(&mut m);
    for &i in &keys {
        assert_eq!(m.lookup(&k(i), &c), LookupResult::Hit);
        assert_eq!(
            m.primary().chunk(&k(i)).unwrap(),
            pattern(i).as_slice(),
            "bytes of {i}"
        );
    }
    m.shutdown().unwrap();
    let _ = std::fs::remove_file(&path);
}

/// A tier that owns its manager books its room itself and lets the move's task free the
/// victims and allocate: with steps whose moves overlap (each started before the last ones
/// finished) on a full tier, every booked key still finds its block.
///
/// How many of the overlapping rounds are stored depends on the machine: a round booked while
/// the tier is full of keys still being written is not stored (by design: see `submit_store`).
/// The last round is booked once the others settled, so the tier has room for it whatever
/// the timing, and its keys must be readable.
#[test]
fn an_owned_tier_finds_a_block_for_every_key_it_booked_across_overlapping_steps() {
    let path = scratch("g3-overlap");
    let mut m = disk_manager(&path, 64, 24);
    let c = ReqContext::new("r");
    m.on_new_request(&c).unwrap();
    let rounds = 60u64;
    let round = |r: u64| [r * 4, r * 4 + 1, r * 4 + 2, r * 4 + 3];
    for r in 0..rounds - 1 {
        store(&mut m, &c, &round(r));
        end(&mut m); // starts this step's move; the last ones may still be running
    }
    settle(&mut m);
    {
        let t = m.tier_mut::<DiskTier>(0).unwrap();
        assert_eq!(t.num_inflight(), 0, "settled");
        assert!(t.num_ready() <= 24, "{} ready in 24 slots", t.num_ready());
    }
    store(&mut m, &c, &round(rounds - 1));
    settle(&mut m);
    let t = m.tier_mut::<DiskTier>(0).unwrap();
    assert_eq!(
        t.failures(BlockFailureKind::NoSpace),
        0,
        "a booked key found no block"
    );
    assert!(t.num_ready() <= 24, "{} ready in 24 slots", t.num_ready());
    let newest: Vec<u64> = ((rounds - 1) * 4..rounds * 4).collect();
    for &i in &newest {
        assert_eq!(t.lookup(&k(i), &c), LookupResult::Hit, "newest key {i}");
    }
    assert_registered(t, &newest);
    m.shutdown().unwrap();
    let _ = std::fs::remove_file(&path);
}

/// `drain_jobs` starts the stores still waiting for the step's end before it waits, so a
/// caller that drains (a cache reset, a shutdown) never waits for a move that was not started.
#[test]
fn drain_starts_booked_stores() {
    let path = scratch("g3-drain");
    let mut m = disk_manager(&path, 8, 16);
    let c = ReqContext::new("r");
    m.on_new_request(&c).unwrap();
    store(&mut m, &c, &[0, 1, 2]);
    let t = m.tier_mut::<DiskTier>(0).unwrap();
    t.drain_jobs().unwrap();
    assert!(!t.has_pending_work());
    let mut out = Vec::new();
    t.get_finished_jobs(&mut out);
    assert_eq!(out.len(), 1, "{out:?}");
    assert!(out[0].success);
    assert_eq!(t.num_ready(), 3);
    assert_registered(t, &[0, 1, 2]);
    let _ = std::fs::remove_file(&path);
}

/// The client configuration for the test S3 server.
fn s3_config(s3: &kvbm_tests::services::S3Service) -> S3Config {
    S3Config {
        endpoint: Some(s3.endpoint.clone()),
        bucket: s3.bucket.clone(),
        region: "us-east-1".into(),
        access_key: s3.access_key.clone(),
        secret_key: s3.secret_key.clone(),
        allow_http: false,
    }
}

#[test]
fn object_tier_round_trip_bytes_verified() {
    let Some(s3) = kvbm_tests::services::s3("object_tier_round_trip_bytes_verified") else {
        return;
    };
    let cfg = s3_config(&s3);
    let oc = ObjectConfig {
        namespace: format!("tiering-e2e-{}", std::process::id()),
        ..ObjectConfig::default()
    };
    let storage = Arc::new(ObjectStorage::s3(&cfg, oc).unwrap());
    round_trip(|p| PhysicalTier::object(p, storage, 64).unwrap());
}

#[test]
fn corrupted_disk_chunk_is_never_served() {
    let path = scratch("g3-corrupt");
    let mut m = manager_over(2, |primary| {
        PhysicalTier::disk(primary, &DiskConfig::new(&path), 8, None).unwrap()
    });
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
    let t = m.tier_mut::<DiskTier>(0).unwrap();
    assert_eq!(t.lookup(&k(0), &c), LookupResult::Miss);
    assert!(t.failures(BlockFailureKind::ChecksumMismatch) >= 1);
    m.primary().manager().check_invariants().unwrap();
    let _ = std::fs::remove_file(&path);
}

/// A tiering manager over a primary of `chunks` chunks and one disk tier of `slots` slots in
/// `path`.
fn disk_manager(path: &std::path::Path, chunks: usize, slots: usize) -> TieringOffloadingManager {
    manager_over(chunks, |primary| {
        PhysicalTier::disk(primary, &DiskConfig::new(path), slots, None).unwrap()
    })
}

#[test]
fn corrupt_slot_is_a_checksum_failure_that_drops_only_that_copy() {
    let path = scratch("g3-one-corrupt");
    let mut m = disk_manager(&path, 2, 8);
    let c = ReqContext::new("r");
    m.on_new_request(&c).unwrap();
    store(&mut m, &c, &[0, 1]);
    settle(&mut m);
    store(&mut m, &c, &[2, 3]); // 0 and 1 leave the primary
    settle(&mut m);
    // Damage key 0's slot only (the payload's first sector).
    let t = m.tier_mut::<DiskTier>(0).unwrap();
    let slot = t.block_id(&k(0)).expect("key 0 is in the tier");
    let layout = t
        .bound()
        .transfer_manager()
        .layout(t.bound().layout())
        .unwrap();
    let Backing::Disk(d) = layout.backing() else {
        panic!("a disk layout")
    };
    let offset = d.slot_offset(slot) as usize;
    let mut bytes = std::fs::read(&path).unwrap();
    for b in &mut bytes[offset..offset + 512] {
        *b ^= 0xFF;
    }
    std::fs::write(&path, bytes).unwrap();

    assert_eq!(m.lookup(&k(0), &c), LookupResult::HitPending);
    settle(&mut m);
    assert_eq!(
        m.lookup(&k(0), &c),
        LookupResult::Miss,
        "a corrupt copy is not a hit"
    );
    let t = m.tier_mut::<DiskTier>(0).unwrap();
    assert_eq!(t.failures(BlockFailureKind::ChecksumMismatch), 1);
    assert_eq!(
        t.lookup(&k(0), &c),
        LookupResult::Miss,
        "the copy was dropped"
    );
    assert_eq!(t.block_id(&k(0)), None);
    assert_eq!(
        t.lookup(&k(1), &c),
        LookupResult::Hit,
        "the other copy stays"
    );
    // The intact neighbour still promotes with its own bytes.
    assert_eq!(m.lookup(&k(1), &c), LookupResult::HitPending);
    settle(&mut m);
    assert_eq!(m.lookup(&k(1), &c), LookupResult::Hit);
    assert_eq!(m.primary().chunk(&k(1)).unwrap(), pattern(1).as_slice());
    // Key 0 can be stored again, and then reads its new bytes.
    store(&mut m, &c, &[0]);
    settle(&mut m);
    let t = m.tier_mut::<DiskTier>(0).unwrap();
    assert_eq!(t.lookup(&k(0), &c), LookupResult::Hit, "stored again");
    assert_registered(t, &[0]);
    m.on_request_finished(&c).unwrap();
    m.primary().manager().check_invariants().unwrap();
    m.shutdown().unwrap();
    let _ = std::fs::remove_file(&path);
}

#[test]
fn tier_over_a_caller_owned_bound_tier() {
    let path = scratch("g3-bound");
    let tm = Arc::new(TransferManager::new().unwrap());
    let primary =
        CpuPrimaryTier::with_transfer_manager(CpuManagerConfig::new(2), CHUNK, tm.clone()).unwrap();
    let layout = CpuPrimaryTier::block_layout(4, CHUNK).unwrap();
    let g3_h = tm
        .register_layout(PhysicalLayout::create_disk(layout, &DiskConfig::new(&path)).unwrap())
        .unwrap();
    // The caller's manager: 16 tokens per block (its own geometry), four slots.
    let manager = Arc::new(
        BlockManager::<G3>::builder()
            .block_count(4)
            .block_size(16)
            .build()
            .unwrap(),
    );
    let bound = BoundTier::new(tm.clone(), g3_h, manager.clone()).unwrap();
    // A transfer manager other than the primary's is refused, naming why.
    let other = Arc::new(TransferManager::new().unwrap());
    let other_h = other
        .register_layout(
            PhysicalLayout::allocate_host(
                CpuPrimaryTier::block_layout(4, CHUNK).unwrap(),
                kvbm_physical::PinPolicy::Unpinned,
            )
            .unwrap(),
        )
        .unwrap();
    let foreign = BoundTier::new(other, other_h, manager.clone()).unwrap();
    assert!(matches!(
        PhysicalTier::over(&primary, foreign),
        Err(TieringError::Config(_))
    ));

    let tier = PhysicalTier::over(&primary, bound).unwrap();
    assert_eq!(tier.tier_type(), "disk");
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
    assert_registered(m.tier_mut::<DiskTier>(0).unwrap(), &[0, 1]);
    assert_eq!(
        manager.pool_counts().active,
        2,
        "the tier holds its two blocks"
    );
    store(&mut m, &c, &[2, 3]);
    settle(&mut m);
    assert_eq!(m.lookup(&k(0), &c), LookupResult::HitPending);
    settle(&mut m);
    assert_eq!(m.primary().chunk(&k(0)).unwrap(), pattern(0).as_slice());
    m.on_request_finished(&c).unwrap();
    m.shutdown().unwrap();
    // The caller's layout stays registered (the tier does not own it).
    assert!(tm.layout(g3_h).is_ok());
    let _ = std::fs::remove_file(&path);
}

#[test]
fn vanished_or_swapped_object_is_a_typed_failure_and_never_served() {
    let Some(s3) =
        kvbm_tests::services::s3("vanished_or_swapped_object_is_a_typed_failure_and_never_served")
    else {
        return;
    };
    let cfg = s3_config(&s3);
    let oc = ObjectConfig {
        namespace: format!("tiering-e2e-gone-{}", std::process::id()),
        ..ObjectConfig::default()
    };
    let storage = Arc::new(ObjectStorage::s3(&cfg, oc).unwrap());
    let mut m = manager_over(2, |primary| {
        PhysicalTier::object(primary, storage.clone(), 64).unwrap()
    });
    let c = ReqContext::new("r");
    m.on_new_request(&c).unwrap();
    store(&mut m, &c, &[0, 1]);
    settle(&mut m);
    store(&mut m, &c, &[2, 3]);
    settle(&mut m);
    // Behind the tier's back: delete key 0's object, and overwrite key 1's with key 2's (intact
    // bytes and checksum, another chunk's identity).
    let name = |i: u64| ObjectKey::from_u128(key_hash(&k(i), TIER_BLOCK_SIZE).as_u128());
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(storage.delete(&name(0))).unwrap();
    let raw = ObjectStorage::s3_client(&cfg).unwrap();
    rt.block_on(async {
        use object_store::ObjectStoreExt;
        let body = raw
            .get(&storage.path(&name(2)))
            .await
            .unwrap()
            .bytes()
            .await
            .unwrap();
        raw.put(&storage.path(&name(1)), body.into()).await.unwrap();
    });
    assert_eq!(m.lookup(&k(0), &c), LookupResult::HitPending);
    settle(&mut m);
    assert_eq!(m.lookup(&k(0), &c), LookupResult::Miss, "not a hit");
    let t = m.tier_mut::<ObjectTier>(0).unwrap();
    assert_eq!(t.failures(BlockFailureKind::NotFound), 1);
    assert_eq!(t.lookup(&k(0), &c), LookupResult::Miss, "presence cleared");
    assert_eq!(t.lookup(&k(1), &c), LookupResult::Hit, "not read yet");
    assert_eq!(m.lookup(&k(1), &c), LookupResult::HitPending);
    settle(&mut m);
    assert_eq!(
        m.lookup(&k(1), &c),
        LookupResult::Miss,
        "another chunk's bytes: not a hit"
    );
    let t = m.tier_mut::<ObjectTier>(0).unwrap();
    assert_eq!(t.failures(BlockFailureKind::IdentityMismatch), 1);
    assert_eq!(
        t.lookup(&k(1), &c),
        LookupResult::Miss,
        "the copy was dropped"
    );
    assert_eq!(t.lookup(&k(2), &c), LookupResult::Hit, "the original stays");
    m.on_request_finished(&c).unwrap();
    m.shutdown().unwrap();
}

/// A disk tier reopened on its file starts warm from its journal: the chunks the previous
/// tier completed are promoted with their bytes, checked against each key's identity.
#[test]
fn disk_tier_restarts_warm_from_its_journal() {
    let path = scratch("g3-warm");
    let journal = path.with_extension("journal");
    let _ = std::fs::remove_file(&journal);
    {
        let mut m = disk_manager(&path, 2, 8);
        let c = ReqContext::new("first run");
        m.on_new_request(&c).unwrap();
        store(&mut m, &c, &[0, 1]); // the primary holds two chunks
        settle(&mut m);
        store(&mut m, &c, &[2, 3]);
        settle(&mut m);
        assert_eq!(m.tier_mut::<DiskTier>(0).unwrap().num_ready(), 4);
        m.on_request_finished(&c).unwrap();
        m.shutdown().unwrap();
    }
    assert!(journal.exists(), "the journal sits beside the file");
    {
        // Each listed chunk's checksum is its payload's (computed off the scheduler thread,
        // beside the move, from the primary's bytes).
        let layout = CpuPrimaryTier::block_layout(8, CHUNK).unwrap();
        let disk = PhysicalLayout::create_disk(layout, &DiskConfig::new(&path)).unwrap();
        let opened = kvbm_offload::journal::DiskJournal::open(&path, &disk).unwrap();
        assert_eq!(opened.entries.len(), 4);
        for i in 0..4 {
            let e = opened.entries[&key_hash(&k(i), TIER_BLOCK_SIZE).as_u128()];
            assert_eq!(
                e.checksum,
                kvbm_physical::checksum::checksum(&pattern(i)),
                "chunk {i}'s listed checksum"
            );
        }
    }

    let mut m = disk_manager(&path, 2, 8);
    let t = m.tier_mut::<DiskTier>(0).unwrap();
    assert_eq!(t.num_restored(), 4, "every completed chunk is listed");
    assert_eq!(
        t.num_ready(),
        0,
        "and claimed only when its key is asked for"
    );
    let c = ReqContext::new("second run");
    m.on_new_request(&c).unwrap();
    assert_eq!(m.lookup(&k(9), &c), LookupResult::Miss, "never stored");
    for i in [0, 3] {
        assert_eq!(
            m.lookup(&k(i), &c),
            LookupResult::HitPending,
            "{i} found on disk"
        );
    }
    settle(&mut m);
    for i in [0, 3] {
        assert_eq!(m.lookup(&k(i), &c), LookupResult::Hit);
        assert_eq!(
            m.primary().chunk(&k(i)).unwrap(),
            pattern(i).as_slice(),
            "bytes of {i}"
        );
    }
    m.on_request_finished(&c).unwrap();
    m.shutdown().unwrap();

    // A third run after the file was damaged: the listed chunks fail their header check and are
    // never served (the journal unlists them).
    let len = std::fs::metadata(&path).unwrap().len() as usize;
    std::fs::write(&path, vec![0x5Au8; len]).unwrap();
    let mut m = disk_manager(&path, 2, 8);
    let c = ReqContext::new("third run");
    m.on_new_request(&c).unwrap();
    assert_eq!(m.lookup(&k(1), &c), LookupResult::HitPending);
    settle(&mut m);
    assert_eq!(
        m.lookup(&k(1), &c),
        LookupResult::Miss,
        "a damaged chunk is never served"
    );
    m.on_request_finished(&c).unwrap();
    m.shutdown().unwrap();
    let _ = std::fs::remove_file(&path);
    let _ = std::fs::remove_file(&journal);
}

/// Two instances share an object store: the second finds the first's chunk with an
/// [`ObjectProbe`], adopts it, and promotes it with the writer's bytes (checked against the
/// key's identity); a key nobody wrote probes absent.
#[test]
fn object_tier_adopts_what_another_instance_wrote() {
    let dir = scratch("objects-shared").with_extension("d");
    let oc = || ObjectConfig {
        namespace: "shared".into(),
        ..ObjectConfig::default()
    };
    let open = |d: &std::path::Path| Arc::new(ObjectStorage::local(d, oc()).unwrap());
    {
        let mut writer = manager_over(4, |p| PhysicalTier::object(p, open(&dir), 64).unwrap());
        let c = ReqContext::new("writer");
        writer.on_new_request(&c).unwrap();
        store(&mut writer, &c, &[7]);
        settle(&mut writer);
        writer.on_request_finished(&c).unwrap();
        writer.shutdown().unwrap();
    }
    let mut reader = manager_over(4, |p| PhysicalTier::object(p, open(&dir), 64).unwrap());
    let c = ReqContext::new("reader");
    reader.on_new_request(&c).unwrap();
    assert_eq!(
        reader.lookup(&k(7), &c),
        LookupResult::Miss,
        "unknown before the probe"
    );
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let tier = reader.tier_mut::<ObjectTier>(0).unwrap();
    let probe = tier.probe().unwrap();
    assert!(
        rt.block_on(probe.present(&k(7))).unwrap(),
        "the writer's object"
    );
    assert!(
        !rt.block_on(probe.present(&k(8))).unwrap(),
        "nobody wrote 8"
    );
    assert!(tier.adopt(&k(7)));
    assert_eq!(
        reader.lookup(&k(7), &c),
        LookupResult::HitPending,
        "promoted from the store"
    );
    settle(&mut reader);
    assert_eq!(reader.lookup(&k(7), &c), LookupResult::Hit);
    assert_eq!(
        reader.primary().chunk(&k(7)).unwrap(),
        pattern(7).as_slice()
    );
    reader.on_request_finished(&c).unwrap();
    reader.shutdown().unwrap();
    let _ = std::fs::remove_dir_all(&dir);
}
