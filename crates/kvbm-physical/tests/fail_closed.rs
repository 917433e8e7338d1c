//! Issue 10, "fail closed": each test names a way today's code served the wrong bytes or allowed
//! a race, and asserts it is refused. Real O_DIRECT files for G3, the real S3 server for G4
//! (in-memory stores only where a test needs to inject a failure the server cannot produce).

mod common;

use std::os::unix::fs::PermissionsExt;
use std::sync::Arc;

use bytes::Bytes;
use common::{block_bytes, expected, fill, small, unique};
use kvbm_physical::*;
use object_store::ObjectStoreExt;

fn id(v: u128) -> BlockIdentity {
    BlockIdentity::from_u128(v)
}

fn host(n: usize, seed: Option<u8>) -> PhysicalLayout {
    let l =
        PhysicalLayout::allocate_host(small(n, LayoutKind::FullyContiguous), PinPolicy::Unpinned)
            .unwrap();
    if let Some(s) = seed {
        fill(&l, s);
    }
    l
}

fn disk_config(path: &std::path::Path) -> DiskConfig {
    let mut cfg = DiskConfig::new(path);
    cfg.engine = IoEngineKind::Uring;
    cfg
}

// --- Item 1: G3 slots bind identity and file -------------------------------------------------

#[test]
fn fail_closed_second_disk_opener_refused() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("g3.bin");
    let first =
        PhysicalLayout::create_disk(small(4, LayoutKind::FullyContiguous), &disk_config(&path))
            .unwrap();
    let second =
        PhysicalLayout::create_disk(small(4, LayoutKind::FullyContiguous), &disk_config(&path));
    let err = second.expect_err("a second opener of one G3 file must be refused");
    assert!(matches!(err, PhysicalError::FileLocked { .. }), "{err:?}");
    assert!(
        err.to_string().contains(&path.display().to_string()),
        "the error names the path: {err}"
    );
    // The file holds KV: owner-only.
    let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o600, "G3 file mode {mode:o}");
    // Released with its storage.
    drop(first);
    PhysicalLayout::create_disk(small(4, LayoutKind::FullyContiguous), &disk_config(&path))
        .expect("reopen after the first storage is gone");
}

#[tokio::test]
async fn fail_closed_disk_slot_identity_and_file_id() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("g3.bin");
    let tm = TransferManager::new().unwrap();
    let src = tm.register_layout(host(2, Some(1))).unwrap();
    let d = tm
        .register_layout(
            PhysicalLayout::create_disk(small(2, LayoutKind::FullyContiguous), &disk_config(&path))
                .unwrap(),
        )
        .unwrap();
    let direct = match tm.layout(d).unwrap().backing() {
        Backing::Disk(disk) => disk.capabilities().direct_io,
        _ => unreachable!(),
    };
    eprintln!("O_DIRECT: {direct}");
    // Block X (identity 10) goes to slot 0.
    let out = common::transfer(
        &tm,
        src,
        &[0],
        d,
        &[0],
        TransferOptions::default().identities(vec![id(10)]),
    )
    .await;
    assert!(out.is_complete_success(), "{:?}", out.blocks);
    let dst = tm.register_layout(host(2, None)).unwrap();
    // A read of slot 0 for block Y (identity 11) must not return X's bytes.
    let out = common::transfer(
        &tm,
        d,
        &[0],
        dst,
        &[0],
        TransferOptions::default().identities(vec![id(11)]),
    )
    .await;
    match &out.blocks[0].1 {
        Err(e @ PhysicalError::IdentityMismatch { what, .. }) => {
            assert_eq!(*what, "block identity");
            assert_eq!(e.kind(), ErrorKind::IdentityMismatch);
        }
        other => panic!("slot 0 served for the wrong identity: {other:?}"),
    }
    // Anonymous reads never accept an identified block.
    let out = common::transfer(&tm, d, &[0], dst, &[0], TransferOptions::default()).await;
    assert!(matches!(
        out.blocks[0].1,
        Err(PhysicalError::IdentityMismatch { .. })
    ));
    // The right identity reads back the right bytes.
    let out = common::transfer(
        &tm,
        d,
        &[0],
        dst,
        &[1],
        TransferOptions::default().identities(vec![id(10)]),
    )
    .await;
    assert!(out.is_complete_success(), "{:?}", out.blocks);
    let c = *small(2, LayoutKind::FullyContiguous).config();
    assert_eq!(
        block_bytes(&tm.layout(dst).unwrap(), 1, 0..4),
        expected(&c, 1, 0, 0..4)
    );

    // The same file reopened (a restart): its id is kept, slot 0 is X again.
    tm.unregister_layout(d).unwrap();
    let reopen = || loop {
        // The old storage is dropped once its last transfer released it.
        match PhysicalLayout::create_disk(
            small(2, LayoutKind::FullyContiguous),
            &disk_config(&path),
        ) {
            Ok(l) => break tm.register_layout(l).unwrap(),
            Err(PhysicalError::FileLocked { .. }) => {
                std::thread::sleep(std::time::Duration::from_millis(5))
            }
            Err(e) => panic!("{e}"),
        }
    };
    let d1 = reopen();
    let out = common::transfer(
        &tm,
        d1,
        &[0],
        dst,
        &[1],
        TransferOptions::default().identities(vec![id(10)]),
    )
    .await;
    assert!(out.is_complete_success(), "reopened file: {:?}", out.blocks);

    // Another file instance on the same path (its id record is gone, as for a file replaced
    // behind our back): slot 0 is foreign, not X.
    tm.unregister_layout(d1).unwrap();
    let mut side = path.clone().into_os_string();
    side.push(".id");
    std::fs::remove_file(&side).unwrap();
    let d2 = reopen();
    let out = common::transfer(
        &tm,
        d2,
        &[0],
        dst,
        &[0],
        TransferOptions::default().identities(vec![id(10)]),
    )
    .await;
    match &out.blocks[0].1 {
        Err(PhysicalError::IdentityMismatch { what, .. }) => assert_eq!(*what, "file id"),
        other => panic!("a slot of an earlier file instance was served: {other:?}"),
    }
    // A never-written slot is not found.
    let out = common::transfer(
        &tm,
        d2,
        &[1],
        dst,
        &[0],
        TransferOptions::default().identities(vec![id(12)]),
    )
    .await;
    assert!(
        matches!(out.blocks[0].1, Err(PhysicalError::NotFound { .. })),
        "{:?}",
        out.blocks
    );
}

// --- Item 2: objects bind key, namespace and geometry ----------------------------------------

/// An in-memory store the test can reach around the storage (to copy objects like an operator
/// or a bug would).
fn raw_and_storage(namespace: &str) -> (Arc<dyn object_store::ObjectStore>, Arc<ObjectStorage>) {
    let raw: Arc<dyn object_store::ObjectStore> = Arc::new(object_store::memory::InMemory::new());
    let storage = Arc::new(ObjectStorage::new(
        raw.clone(),
        ObjectConfig {
            namespace: namespace.into(),
            ..Default::default()
        },
    ));
    (raw, storage)
}

fn geometry(layers: usize, inner: usize) -> LayoutConfig {
    *BlockLayout::builder()
        .num_blocks(1)
        .num_layers(layers)
        .outer_dim(2)
        .page_size(16)
        .inner_dim(inner)
        .dtype_bytes(2)
        .build()
        .unwrap()
        .config()
}

#[tokio::test]
async fn fail_closed_object_copied_to_another_key() {
    let (raw, storage) = raw_and_storage("ns");
    let g = geometry(2, 2048);
    let payload = Bytes::from(vec![7u8; g.block_bytes()]);
    let (a, b) = (ObjectKey::from_u128(1), ObjectKey::from_u128(2));
    storage
        .put_block(
            &a,
            &id(1),
            &g,
            vec![payload.clone()],
            ObjectPutMode::Overwrite,
        )
        .await
        .unwrap();
    raw.copy(&storage.path(&a), &storage.path(&b))
        .await
        .unwrap();
    let got = storage.get_block(&b, &id(1), &g).await;
    assert!(
        matches!(got, Err(PhysicalError::IdentityMismatch { .. })),
        "{got:?}"
    );
    // Even naming the copied block's identity: the key is bound too.
    let got = storage.get_block(&b, &id(2), &g).await;
    assert!(
        matches!(got, Err(PhysicalError::IdentityMismatch { .. })),
        "{got:?}"
    );
    assert_eq!(storage.get_block(&a, &id(1), &g).await.unwrap(), payload);
    // Presence does not count the copy as block 2.
    assert_eq!(
        storage.probe(&a, &id(1)).await.unwrap(),
        ObjectPresence::Present
    );
    assert!(matches!(
        storage.probe(&b, &id(2)).await.unwrap(),
        ObjectPresence::Foreign(_)
    ));
    assert_eq!(
        storage
            .probe(&ObjectKey::from_u128(3), &id(3))
            .await
            .unwrap(),
        ObjectPresence::Absent
    );

    // Another namespace over the same bucket: foreign.
    let other = ObjectStorage::new(
        raw.clone(),
        ObjectConfig {
            namespace: "other".into(),
            ..Default::default()
        },
    );
    raw.copy(&storage.path(&a), &other.path(&a)).await.unwrap();
    let got = other.get_block(&a, &id(1), &g).await;
    assert!(
        matches!(got, Err(PhysicalError::IdentityMismatch { .. })),
        "{got:?}"
    );
}

#[tokio::test]
async fn fail_closed_object_read_under_another_geometry() {
    let (_raw, storage) = raw_and_storage("ns");
    let (g, g2) = (geometry(2, 2048), geometry(4, 1024));
    assert_eq!(g.block_bytes(), g2.block_bytes());
    let k = ObjectKey::from_u128(5);
    storage
        .put_block(
            &k,
            &id(5),
            &g,
            vec![Bytes::from(vec![1u8; g.block_bytes()])],
            ObjectPutMode::Overwrite,
        )
        .await
        .unwrap();
    let got = storage.get_block(&k, &id(5), &g2).await;
    match got {
        Err(PhysicalError::IdentityMismatch { what, .. }) => assert_eq!(what, "layout geometry"),
        other => panic!("2 × 2048 read as 4 × 1024: {other:?}"),
    }
    // A storage bound to the 4 × 1024 layout does not count it as present.
    let layout = BlockLayout::builder()
        .num_blocks(1)
        .num_layers(4)
        .page_size(16)
        .inner_dim(1024)
        .build()
        .unwrap();
    let _bound = PhysicalLayout::object(layout, storage.clone());
    assert!(matches!(
        storage.probe(&k, &id(5)).await.unwrap(),
        ObjectPresence::Foreign(_)
    ));
}

/// Two storages of different model fingerprints on one bucket and namespace: each lists,
/// probes and reads only its own blocks; an object copied into the other's scope is foreign
/// (its binding names the writer's fingerprint); the same fingerprint finds it.
#[tokio::test]
async fn fail_closed_object_under_another_fingerprint_is_never_served() {
    let raw: Arc<dyn object_store::ObjectStore> = Arc::new(object_store::memory::InMemory::new());
    let g = geometry(2, 2048);
    let fp = |model: &str| {
        ModelFingerprint::builder()
            .model(model)
            .dtype("bfloat16")
            .kv_layout("NHD")
            .geometry(g)
            .parallelism(Parallelism::Rank { rank: 0, world: 1 })
            .build()
            .unwrap()
    };
    let storage = |f: Option<ModelFingerprint>| {
        let s = ObjectStorage::new(raw.clone(), ObjectConfig::default());
        match f {
            Some(f) => s.with_fingerprint(f),
            None => s,
        }
    };
    let (a, b, a2, plain) = (
        storage(Some(fp("model-a"))),
        storage(Some(fp("model-b"))),
        storage(Some(fp("model-a"))),
        storage(None),
    );
    assert!(
        a.path(&ObjectKey::from_u128(1))
            .as_ref()
            .contains(&fp("model-a").key_segment())
    );
    let payload = Bytes::from(vec![3u8; g.block_bytes()]);
    let k = ObjectKey::from_u128(1);
    a.put_block(
        &k,
        &id(1),
        &g,
        vec![payload.clone()],
        ObjectPutMode::Overwrite,
    )
    .await
    .unwrap();
    // Another fingerprint (or none): not listed, absent, not found.
    for other in [&b, &plain] {
        assert!(other.list_keys().await.unwrap().is_empty());
        assert_eq!(
            other.probe(&k, &id(1)).await.unwrap(),
            ObjectPresence::Absent
        );
        let got = other.get_block(&k, &id(1), &g).await;
        assert!(
            matches!(got, Err(PhysicalError::NotFound { .. })),
            "{got:?}"
        );
    }
    // The same fingerprint: listed, present, read.
    assert_eq!(a2.list_keys().await.unwrap(), vec![k.clone()]);
    assert_eq!(a2.probe(&k, &id(1)).await.unwrap(), ObjectPresence::Present);
    assert_eq!(a2.get_block(&k, &id(1), &g).await.unwrap(), payload);
    // Copied into the other fingerprint's scope, it is foreign there, never served.
    raw.copy(&a.path(&k), &b.path(&k)).await.unwrap();
    assert!(matches!(
        b.probe(&k, &id(1)).await.unwrap(),
        ObjectPresence::Foreign(_)
    ));
    let got = b.get_block(&k, &id(1), &g).await;
    assert!(
        matches!(got, Err(PhysicalError::IdentityMismatch { .. })),
        "{got:?}"
    );
}

/// Bodies are size-checked before they are read.
#[tokio::test]
async fn fail_closed_oversized_object_body_refused() {
    let (raw, storage) = raw_and_storage("ns");
    let g = geometry(2, 64);
    let k = ObjectKey::from_u128(6);
    raw.put(&storage.path(&k), Bytes::from(vec![0u8; 8 << 20]).into())
        .await
        .unwrap();
    let got = storage.get_block(&k, &id(6), &g).await;
    assert!(
        matches!(got, Err(PhysicalError::TooLarge { size, .. }) if size == 8 << 20),
        "{got:?}"
    );
}

// --- Item 3: tensor-parallel ranks -----------------------------------------------------------

#[tokio::test]
async fn fail_closed_tp_ranks_keep_their_own_bytes() {
    let test = "fail_closed_tp_ranks_keep_their_own_bytes";
    let Some(s) = kvbm_tests::services::s3(test) else {
        return;
    };
    let ns = unique(test);
    let s3 = S3Config {
        endpoint: Some(s.endpoint),
        bucket: s.bucket,
        region: "us-east-1".into(),
        access_key: s.access_key,
        secret_key: s.secret_key,
        allow_http: false,
    };
    let tm = TransferManager::new().unwrap();
    let key = vec![ObjectKey::from_u128(0xfeed)];
    let mut ranks = Vec::new();
    for rank in 0..2 {
        let storage = Arc::new(
            ObjectStorage::s3(
                &s3,
                ObjectConfig {
                    namespace: ns.clone(),
                    tp_rank: rank,
                    tp_world_size: 2,
                    ..Default::default()
                },
            )
            .unwrap(),
        );
        let obj = tm
            .register_layout(PhysicalLayout::object(
                small(1, LayoutKind::FullyContiguous),
                storage,
            ))
            .unwrap();
        // Different heads under one sequence hash.
        let src = tm.register_layout(host(1, Some(40 + rank as u8))).unwrap();
        let opts = || TransferOptions::with_object_keys(key.clone()).identities(vec![id(0xfeed)]);
        let out = common::transfer(&tm, src, &[0], obj, &[0], opts()).await;
        assert!(
            out.is_complete_success(),
            "rank {rank} put: {:?}",
            out.blocks
        );
        ranks.push((obj, opts));
    }
    let c = *small(1, LayoutKind::FullyContiguous).config();
    for (rank, (obj, opts)) in ranks.into_iter().enumerate() {
        let dst = tm.register_layout(host(1, None)).unwrap();
        let out = common::transfer(&tm, obj, &[0], dst, &[0], opts()).await;
        assert!(
            out.is_complete_success(),
            "rank {rank} get: {:?}",
            out.blocks
        );
        assert_eq!(
            block_bytes(&tm.layout(dst).unwrap(), 0, 0..4),
            expected(&c, 40 + rank as u8, 0, 0..4),
            "rank {rank} got another rank's heads"
        );
    }
}

/// A rank outside its world (or a world of 0) is refused up front, naming the key: with
/// `tp_rank >= tp_world_size` a rank would share another rank's key directory (or, with world 1,
/// the rank-less one) instead of its own.
#[tokio::test]
async fn fail_closed_tp_rank_out_of_range() {
    let dir = tempfile::tempdir().unwrap();
    let bad = |rank, world| ObjectConfig {
        tp_rank: rank,
        tp_world_size: world,
        ..ObjectConfig::default()
    };
    for (rank, world, key) in [
        (1, 1, "tp_rank"),
        (2, 2, "tp_rank"),
        (0, 0, "tp_world_size"),
    ] {
        let err = bad(rank, world).validate().expect_err("out of range");
        assert!(
            err.to_string().contains(&format!("physical.object.{key}")),
            "{err}"
        );
        assert!(ObjectStorage::local(dir.path(), bad(rank, world)).is_err());
        let raw: Arc<dyn object_store::ObjectStore> =
            Arc::new(object_store::memory::InMemory::new());
        assert!(ObjectStorage::try_new(raw.clone(), bad(rank, world)).is_err());
        // A storage built without the check refuses every request with the same error.
        let s = ObjectStorage::new(raw, bad(rank, world));
        let e = s.exists(&ObjectKey::new("k")).await.expect_err("refused");
        assert!(e.to_string().contains(key), "{e}");
    }
    assert!(bad(1, 2).validate().is_ok());
    assert!(ObjectConfig::default().validate().is_ok());
}

// --- Item 5: copies refused up front ---------------------------------------------------------

#[test]
fn fail_closed_chained_copy_rejected() {
    let tm = TransferManager::new().unwrap();
    let h = tm.register_layout(host(4, Some(1))).unwrap();
    // SAFETY: test-owned layouts; nothing outside the manager reads or writes their blocks while the transfer runs.
    let r = unsafe { tm.execute_transfer(h, &[0, 1], h, &[1, 2], TransferOptions::default()) };
    assert!(
        matches!(&r, Err(PhysicalError::InvalidArgument(m)) if m.contains("chained")),
        "{r:?}"
    );
    // Disjoint blocks of one layout are fine.
    // SAFETY: test-owned layouts; nothing outside the manager reads or writes their blocks while the transfer runs.
    let out = unsafe { tm.execute_transfer(h, &[0, 1], h, &[2, 3], TransferOptions::default()) }
        .unwrap()
        .wait();
    assert!(out.is_complete_success());
}

#[test]
fn fail_closed_aliased_layouts_rejected() {
    let tm = TransferManager::new().unwrap();
    let layout = small(4, LayoutKind::FullyContiguous);
    let mem = Arc::new(HostStorage::new(layout.allocation_bytes(), PinPolicy::Unpinned).unwrap());
    let a = PhysicalLayout::from_backing(layout, Backing::Host(vec![mem.clone()])).unwrap();
    let b = PhysicalLayout::from_backing(layout, Backing::Host(vec![mem.clone()])).unwrap();
    let a_h = tm.register_layout(a.clone()).unwrap();
    for (what, l) in [("second layout over one allocation", b), ("clone", a)] {
        let r = tm.register_layout(l);
        assert!(
            matches!(r, Err(PhysicalError::AliasedLayout(_))),
            "{what}: {r:?}"
        );
    }
    // Across managers too.
    let tm2 = TransferManager::new().unwrap();
    let c = PhysicalLayout::from_backing(layout, Backing::Host(vec![mem.clone()])).unwrap();
    assert!(matches!(
        tm2.register_layout(c),
        Err(PhysicalError::AliasedLayout(_))
    ));
    // Free again once unregistered.
    tm.unregister_layout(a_h).unwrap();
    let d = PhysicalLayout::from_backing(layout, Backing::Host(vec![mem])).unwrap();
    tm2.register_layout(d)
        .expect("memory released by unregister");
}

// --- Item 12: two transfers cannot write one block at once ------------------------------------

#[test]
fn fail_closed_concurrent_writes_to_one_block_refused() {
    // Transfers that stay in flight until the manager is dropped: an object get and an object
    // put against a store whose gets and parts never answer.
    let tm = TransferManager::new().unwrap();
    let store = multipart::FaultyParts::new(multipart::PartBehaviour::Hang).hang_gets();
    let storage = Arc::new(ObjectStorage::new(
        Arc::new(store),
        ObjectConfig {
            multipart_threshold: 1024,
            ..Default::default()
        },
    ));
    let obj = tm
        .register_layout(PhysicalLayout::object(
            small(4, LayoutKind::FullyContiguous),
            storage,
        ))
        .unwrap();
    let a = tm.register_layout(host(4, Some(2))).unwrap();
    let b = tm.register_layout(host(4, Some(3))).unwrap();
    let keys = || TransferOptions::with_object_keys(vec![ObjectKey::from_u128(1)]);
    // In flight: a get writing b[0], a put reading a[1].
    // SAFETY: test-owned layouts; nothing outside the manager reads or writes their blocks while the transfer runs.
    let _get = unsafe { tm.execute_transfer(obj, &[0], b, &[0], keys()) }.unwrap();
    // SAFETY: test-owned layouts; nothing outside the manager reads or writes their blocks while the transfer runs.
    let _put = unsafe { tm.execute_transfer(a, &[1], obj, &[0], keys()) }.unwrap();
    let busy = |r: Result<TransferCompletion>, block: usize, what: &str| {
        assert!(
            matches!(r, Err(PhysicalError::BlockBusy { block_id, .. }) if block_id == block),
            "{what}: {r:?}"
        );
    };
    busy(
        // SAFETY: test-owned layouts; nothing outside the manager reads or writes their blocks while the transfer runs.
        unsafe { tm.execute_transfer(a, &[0], b, &[0], TransferOptions::default()) },
        0,
        "a second write of a block being written",
    );
    busy(
        // SAFETY: test-owned layouts; nothing outside the manager reads or writes their blocks while the transfer runs.
        unsafe { tm.execute_transfer(b, &[0], a, &[2], TransferOptions::default()) },
        0,
        "a read of a block being written",
    );
    busy(
        // SAFETY: test-owned layouts; nothing outside the manager reads or writes their blocks while the transfer runs.
        unsafe { tm.execute_transfer(b, &[3], a, &[1], TransferOptions::default()) },
        1,
        "a write of a block being read",
    );
    // A refused call claimed nothing: block 2 of `a` and block 3 of `b` are still free.
    // Reading a block others read, and untouched blocks, are fine.
    // SAFETY: test-owned layouts; nothing outside the manager reads or writes their blocks while the transfer runs.
    let out = unsafe { tm.execute_transfer(a, &[1], b, &[2], TransferOptions::default()) }
        .unwrap()
        .wait();
    assert!(out.is_complete_success(), "{:?}", out.blocks);
    // SAFETY: test-owned layouts; nothing outside the manager reads or writes their blocks while the transfer runs.
    let out = unsafe { tm.execute_transfer(b, &[3], a, &[2], TransferOptions::default()) }
        .unwrap()
        .wait();
    assert!(out.is_complete_success(), "{:?}", out.blocks);
    // Claims end with their transfer: once done, the same write is accepted again.
    // SAFETY: test-owned layouts; nothing outside the manager reads or writes their blocks while the transfer runs.
    let out = unsafe { tm.execute_transfer(a, &[2], b, &[3], TransferOptions::default()) }
        .unwrap()
        .wait();
    assert!(out.is_complete_success(), "{:?}", out.blocks);
    // SAFETY: test-owned layouts; nothing outside the manager reads or writes their blocks while the transfer runs.
    let out = unsafe { tm.execute_transfer(a, &[2], b, &[3], TransferOptions::default()) }
        .unwrap()
        .wait();
    assert!(out.is_complete_success(), "{:?}", out.blocks);
}

// --- Item 14: secrets never printed ----------------------------------------------------------

#[derive(Clone, Default)]
struct Captured(Arc<std::sync::Mutex<Vec<u8>>>);

impl std::io::Write for Captured {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(b);
        Ok(b.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

#[test]
fn fail_closed_s3_secret_never_logged() {
    let test = "fail_closed_s3_secret_never_logged";
    let Some(s) = kvbm_tests::services::s3(test) else {
        return;
    };
    let secret = s.secret_key.clone();
    assert!(secret.len() >= 8, "the test needs a recognisable secret");
    let s3 = S3Config {
        endpoint: Some(s.endpoint),
        bucket: s.bucket,
        region: "us-east-1".into(),
        access_key: s.access_key,
        secret_key: s.secret_key,
        allow_http: false,
    };
    let captured = Captured::default();
    let writer = captured.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_max_level(tracing::Level::TRACE)
        .with_writer(move || writer.clone())
        .with_ansi(false)
        .finish();
    tracing::subscriber::with_default(subscriber, || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async {
            tracing::info!(config = ?s3, "s3 config");
            tracing::info!(config = %serde_json::to_string(&s3).unwrap(), "s3 config json");
            let storage = ObjectStorage::s3(
                &s3,
                ObjectConfig {
                    namespace: unique(test),
                    ..Default::default()
                },
            )
            .unwrap();
            tracing::trace!(?storage, "storage");
            let g = geometry(2, 64);
            let k = ObjectKey::from_u128(1);
            storage
                .put_block(
                    &k,
                    &id(1),
                    &g,
                    vec![Bytes::from(vec![3u8; g.block_bytes()])],
                    ObjectPutMode::Overwrite,
                )
                .await
                .unwrap();
            storage.get_block(&k, &id(1), &g).await.unwrap();
            let _ = storage
                .get_block(&ObjectKey::from_u128(2), &id(2), &g)
                .await;
        });
    });
    let log = String::from_utf8(captured.0.lock().unwrap().clone()).unwrap();
    assert!(
        log.contains("s3 config") && log.contains(REDACTED_TEXT),
        "capture works: {log}"
    );
    assert!(
        !log.contains(&secret),
        "the secret key appears in the trace log"
    );
    assert!(!format!("{s3:?}").contains(&secret));
}

const REDACTED_TEXT: &str = kvbm_physical::storage::REDACTED;

// --- Item 11: no orphaned multipart uploads --------------------------------------------------

mod multipart {
    //! An in-memory store whose multipart parts fail (or hang) and whose gets hang on demand,
    //! counting aborts: the real server cannot be told to fail a part or to hold a request, and
    //! object_store cannot list incomplete uploads.

    use std::sync::atomic::{AtomicUsize, Ordering};

    use futures::stream::BoxStream;
    use object_store::memory::InMemory;
    use object_store::path::Path;
    use object_store::{
        CopyOptions, GetOptions, GetResult, ListResult, MultipartUpload, ObjectMeta, ObjectStore,
        PutMultipartOptions, PutOptions, PutPayload, PutResult, UploadPart,
    };

    use super::*;

    #[derive(Debug, Clone, Copy)]
    pub(super) enum PartBehaviour {
        Fail,
        Hang,
    }

    #[derive(Debug)]
    pub(super) struct FaultyParts {
        inner: InMemory,
        behaviour: PartBehaviour,
        hang_gets: bool,
        pub(super) aborts: Arc<AtomicUsize>,
    }

    impl FaultyParts {
        pub(super) fn new(behaviour: PartBehaviour) -> Self {
            FaultyParts {
                inner: InMemory::new(),
                behaviour,
                hang_gets: false,
                aborts: Arc::default(),
            }
        }

        /// Gets never answer either.
        pub(super) fn hang_gets(mut self) -> Self {
            self.hang_gets = true;
            self
        }
    }

    impl std::fmt::Display for FaultyParts {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("FaultyParts")
        }
    }

    #[derive(Debug)]
    struct Upload {
        behaviour: PartBehaviour,
        aborts: Arc<AtomicUsize>,
    }

    #[async_trait::async_trait]
    impl MultipartUpload for Upload {
        fn put_part(&mut self, _data: PutPayload) -> UploadPart {
            match self.behaviour {
                PartBehaviour::Fail => Box::pin(async {
                    Err(object_store::Error::Generic {
                        store: "FaultyParts",
                        source: "injected part failure".into(),
                    })
                }),
                PartBehaviour::Hang => Box::pin(futures::future::pending()),
            }
        }
        async fn complete(&mut self) -> object_store::Result<PutResult> {
            unreachable!("no part ever succeeds")
        }
        async fn abort(&mut self) -> object_store::Result<()> {
            self.aborts.fetch_add(1, Ordering::SeqCst);
            Ok(())
        }
    }

    #[async_trait::async_trait]
    impl ObjectStore for FaultyParts {
        async fn put_opts(
            &self,
            location: &Path,
            payload: PutPayload,
            opts: PutOptions,
        ) -> object_store::Result<PutResult> {
            self.inner.put_opts(location, payload, opts).await
        }
        async fn put_multipart_opts(
            &self,
            _location: &Path,
            _opts: PutMultipartOptions,
        ) -> object_store::Result<Box<dyn MultipartUpload>> {
            Ok(Box::new(Upload {
                behaviour: self.behaviour,
                aborts: self.aborts.clone(),
            }))
        }
        async fn get_opts(
            &self,
            location: &Path,
            options: GetOptions,
        ) -> object_store::Result<GetResult> {
            if self.hang_gets {
                futures::future::pending::<()>().await;
            }
            self.inner.get_opts(location, options).await
        }
        fn delete_stream(
            &self,
            locations: BoxStream<'static, object_store::Result<Path>>,
        ) -> BoxStream<'static, object_store::Result<Path>> {
            self.inner.delete_stream(locations)
        }
        fn list(
            &self,
            prefix: Option<&Path>,
        ) -> BoxStream<'static, object_store::Result<ObjectMeta>> {
            self.inner.list(prefix)
        }
        async fn list_with_delimiter(
            &self,
            prefix: Option<&Path>,
        ) -> object_store::Result<ListResult> {
            self.inner.list_with_delimiter(prefix).await
        }
        async fn copy_opts(
            &self,
            from: &Path,
            to: &Path,
            options: CopyOptions,
        ) -> object_store::Result<()> {
            self.inner.copy_opts(from, to, options).await
        }
    }
}

fn multipart_storage(
    behaviour: multipart::PartBehaviour,
) -> (ObjectStorage, Arc<std::sync::atomic::AtomicUsize>) {
    let store = multipart::FaultyParts::new(behaviour);
    let aborts = store.aborts.clone();
    let storage = ObjectStorage::new(
        Arc::new(store),
        ObjectConfig {
            multipart_threshold: 1 << 20,
            ..Default::default()
        },
    );
    (storage, aborts)
}

#[tokio::test]
async fn fail_closed_failed_multipart_upload_aborted() {
    use std::sync::atomic::Ordering;
    let (storage, aborts) = multipart_storage(multipart::PartBehaviour::Fail);
    let g = geometry(16, 2048); // 2 MiB > the 1 MiB threshold
    let r = storage
        .put_block(
            &ObjectKey::from_u128(1),
            &id(1),
            &g,
            vec![Bytes::from(vec![0u8; g.block_bytes()])],
            ObjectPutMode::Overwrite,
        )
        .await;
    assert!(r.is_err());
    assert_eq!(
        aborts.load(Ordering::SeqCst),
        1,
        "a failed multipart upload must be aborted"
    );
}

#[tokio::test]
async fn fail_closed_dropped_multipart_upload_aborted() {
    use std::sync::atomic::Ordering;
    let (storage, aborts) = multipart_storage(multipart::PartBehaviour::Hang);
    let g = geometry(16, 2048);
    let (key, ident) = (ObjectKey::from_u128(1), id(1));
    let put = storage.put_block(
        &key,
        &ident,
        &g,
        vec![Bytes::from(vec![0u8; g.block_bytes()])],
        ObjectPutMode::Overwrite,
    );
    assert!(
        tokio::time::timeout(std::time::Duration::from_millis(50), put)
            .await
            .is_err()
    );
    for _ in 0..100 {
        if aborts.load(Ordering::SeqCst) == 1 {
            return;
        }
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    }
    panic!("a dropped multipart upload was not aborted");
}

// --- Item 2: a corrupt object leaves presence and is rewritten ----------------------------------

#[tokio::test]
async fn fail_closed_corrupt_object_evicted_by_a_verified_read() {
    let (raw, storage) = raw_and_storage("ns");
    let tm = TransferManager::new().unwrap();
    let src = tm.register_layout(host(1, Some(8))).unwrap();
    let obj = tm
        .register_layout(PhysicalLayout::object(
            small(1, LayoutKind::FullyContiguous),
            storage.clone(),
        ))
        .unwrap();
    let key = ObjectKey::from_u128(0x77);
    let opts = || TransferOptions::with_object_keys(vec![key.clone()]).identities(vec![id(0x77)]);
    let out = common::transfer(&tm, src, &[0], obj, &[0], opts()).await;
    assert!(out.is_complete_success(), "{:?}", out.blocks);
    // One payload byte flipped behind our back: the header (and so presence) still looks right.
    let path = storage.path(&key);
    kvbm_tests::faults::flip_last_byte(&*raw, &path, 1).await;
    assert_eq!(
        storage.probe(&key, &id(0x77)).await.unwrap(),
        ObjectPresence::Present
    );
    // The verified read refuses it and evicts it: no longer present, so it gets rewritten.
    let dst = tm.register_layout(host(1, None)).unwrap();
    let out = common::transfer(&tm, obj, &[0], dst, &[0], opts()).await;
    assert!(
        matches!(out.blocks[0].1, Err(PhysicalError::ChecksumMismatch { .. })),
        "{:?}",
        out.blocks
    );
    assert_eq!(
        storage.probe(&key, &id(0x77)).await.unwrap(),
        ObjectPresence::Absent
    );
    assert_eq!(storage.evicted_objects(), 1);
    let out = common::transfer(&tm, src, &[0], obj, &[0], opts()).await;
    assert!(out.is_complete_success(), "{:?}", out.blocks);
    let out = common::transfer(&tm, obj, &[0], dst, &[0], opts()).await;
    assert!(out.is_complete_success(), "{:?}", out.blocks);
}

#[test]
fn fail_closed_a_handle_of_another_manager_names_nothing_here() {
    // Handle ids are process-unique: a handle from manager A is unknown to manager B, even when
    // B has registered as many layouts (per-manager counters would have made it name B's own).
    let a = TransferManager::new().unwrap();
    let b = TransferManager::new().unwrap();
    let ha = a.register_layout(host(2, Some(1))).unwrap();
    let hb = b.register_layout(host(2, Some(2))).unwrap();
    assert_ne!(ha, hb);
    assert!(matches!(b.layout(ha), Err(PhysicalError::UnknownLayout(h)) if h == ha));
    // SAFETY: test-owned layouts; nothing outside the managers touches them.
    let r = unsafe { b.execute_transfer(ha, &[0], hb, &[1], TransferOptions::default()) };
    assert!(matches!(r, Err(PhysicalError::UnknownLayout(_))));
}

/// N10 of the second review: an S3 endpoint over plain `http` off the loopback interface is
/// refused unless `allow_http` says so (an on-path party could read every object and change
/// any), naming the key; `https` and loopback `http` are accepted; and a storage over plain
/// `http` off loopback never deletes an object a read refused (the damage may have been made
/// in transit), while one over `https`, loopback (no path to be on), a directory or memory
/// does.
#[test]
fn security_plain_http_s3_off_loopback_is_refused_unless_allowed() {
    let cfg = |endpoint: &str, allow_http: bool| S3Config {
        endpoint: Some(endpoint.into()),
        bucket: "b".into(),
        region: "us-east-1".into(),
        access_key: "k".into(),
        secret_key: "s".into(),
        allow_http,
    };
    // No request is made here: building the client checks the endpoint.
    let open = |endpoint: &str, allow_http: bool| {
        ObjectStorage::s3(&cfg(endpoint, allow_http), ObjectConfig::default())
    };
    let e = open("http://192.0.2.7:9000", false)
        .unwrap_err()
        .to_string();
    assert!(e.contains("physical.s3.allow_http"), "{e}");
    assert!(e.contains("http://192.0.2.7:9000"), "{e}");
    let allowed = open("http://192.0.2.7:9000", true).unwrap();
    assert!(
        !allowed.evicts_damaged(),
        "plain http never deletes on a failed check"
    );
    for loopback in [
        "http://127.0.0.1:9000",
        "http://[::1]:9000",
        "http://localhost:9000",
    ] {
        let s = open(loopback, false).unwrap_or_else(|e| panic!("{loopback}: {e}"));
        assert!(s.evicts_damaged(), "{loopback}: no path to be on");
    }
    let tls = open("https://192.0.2.7:9000", false).unwrap();
    assert!(
        tls.evicts_damaged(),
        "https: a proven-damaged object is deleted"
    );
    assert!(ObjectStorage::in_memory(ObjectConfig::default()).evicts_damaged());
}
