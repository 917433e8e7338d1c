//! Data that went wrong outside the process is that block's error, never silently accepted.

mod common;

use std::io::{Seek, SeekFrom, Write};
use std::sync::Arc;

use bytes::Bytes;
use common::*;
use kvbm_physical::*;
use object_store::{ObjectStoreExt, PutPayload};

#[tokio::test]
async fn corrupted_disk_block_is_detected_on_read() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("g3.bin");
    let tm = TransferManager::new().unwrap();
    let src = host(&tm, 4, Some(9));
    let disk = PhysicalLayout::create_disk(
        small(4, LayoutKind::FullyContiguous),
        &DiskConfig::new(&path),
    )
    .unwrap();
    let Backing::Disk(d) = disk.backing() else {
        unreachable!()
    };
    let (slot_bytes, off2) = (d.slot_bytes(), d.slot_offset(2));
    let disk_h = tm.register_layout(disk).unwrap();
    let out = transfer(
        &tm,
        src,
        &[0, 1, 2],
        disk_h,
        &[0, 1, 2],
        TransferOptions::default(),
    )
    .await;
    assert!(out.is_complete_success(), "{:?}", out.blocks);

    // Flip one payload byte of slot 2 behind the engine's back.
    let mut f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(&path)
        .unwrap();
    f.seek(SeekFrom::Start(off2 + 1000)).unwrap();
    f.write_all(&[0xEE]).unwrap();
    f.sync_all().unwrap();
    assert!(slot_bytes > 0);

    let dst = host(&tm, 4, None);
    // Slot 3 was never written: not found. Slot 2: checksum mismatch. Slots 0, 1: fine.
    let out = transfer(
        &tm,
        disk_h,
        &[0, 1, 2, 3],
        dst,
        &[0, 1, 2, 3],
        TransferOptions::default(),
    )
    .await;
    assert!(
        out.blocks[0].1.is_ok() && out.blocks[1].1.is_ok(),
        "{:?}",
        out.blocks
    );
    assert!(
        matches!(out.blocks[2].1, Err(PhysicalError::ChecksumMismatch { .. })),
        "{:?}",
        out.blocks[2]
    );
    assert!(
        matches!(out.blocks[3].1, Err(PhysicalError::NotFound { .. })),
        "{:?}",
        out.blocks[3]
    );
    let dstl = tm.layout(dst).unwrap();
    let c = *dstl.layout().config();
    assert_eq!(block_bytes(&dstl, 1, 0..4), expected(&c, 9, 1, 0..4));

    // A block written to the wrong slot (header slot mismatch) is refused too.
    let mut f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(&path)
        .unwrap();
    let mut slot0 = vec![0u8; slot_bytes];
    use std::os::unix::fs::FileExt;
    f.read_exact_at(&mut slot0, 0).unwrap();
    f.write_all_at(&slot0, off2).unwrap();
    f.flush().unwrap();
    let out = transfer(&tm, disk_h, &[2], dst, &[2], TransferOptions::default()).await;
    assert!(
        matches!(out.blocks[0].1, Err(PhysicalError::CorruptHeader { .. })),
        "{:?}",
        out.blocks
    );
}

#[tokio::test]
async fn two_hop_device_disk_object_round_trip() {
    let dir = tempfile::tempdir().unwrap();
    let tm = TransferManager::new().unwrap();
    let dev = PhysicalLayout::allocate_device(
        small(3, LayoutKind::LayerSeparate(BlockDim::BlockContiguous)),
        0,
    )
    .unwrap();
    fill(&dev, 5);
    let dev = tm.register_layout(dev).unwrap();
    let disk = tm
        .register_layout(
            PhysicalLayout::create_disk(
                small(3, LayoutKind::FullyContiguous),
                &DiskConfig::new(dir.path().join("d")),
            )
            .unwrap(),
        )
        .unwrap();
    let store = Arc::new(ObjectStorage::in_memory(ObjectConfig::default()));
    let obj = tm
        .register_layout(PhysicalLayout::object(
            small(3, LayoutKind::FullyContiguous),
            store,
        ))
        .unwrap();
    let keys: Vec<ObjectKey> = (0..3u128).map(ObjectKey::from_u128).collect();
    // device → disk → object → device (fresh) : every hop without a direct path goes through a bounce.
    assert!(
        transfer(
            &tm,
            dev,
            &[0, 1, 2],
            disk,
            &[2, 1, 0],
            TransferOptions::default()
        )
        .await
        .is_complete_success()
    );
    assert!(
        transfer(
            &tm,
            disk,
            &[2, 1, 0],
            obj,
            &[0, 1, 2],
            TransferOptions::with_object_keys(keys.clone())
        )
        .await
        .is_complete_success()
    );
    let dev2l = PhysicalLayout::allocate_device(small(3, LayoutKind::FullyContiguous), 0).unwrap();
    let dev2 = tm.register_layout(dev2l).unwrap();
    assert!(
        transfer(
            &tm,
            obj,
            &[0, 1, 2],
            dev2,
            &[0, 1, 2],
            TransferOptions::with_object_keys(keys)
        )
        .await
        .is_complete_success()
    );
    let d2 = tm.layout(dev2).unwrap();
    let c = *d2.layout().config();
    for b in 0..3 {
        assert_eq!(block_bytes(&d2, b, 0..4), expected(&c, 5, b, 0..4));
    }
    // disk → device with a layer range (two hops, partial second hop).
    let dev3 = tm
        .register_layout(
            PhysicalLayout::allocate_device(small(3, LayoutKind::FullyContiguous), 0).unwrap(),
        )
        .unwrap();
    assert!(
        transfer(&tm, disk, &[1], dev3, &[0], TransferOptions::layers(2..4))
            .await
            .is_complete_success()
    );
    let d3 = tm.layout(dev3).unwrap();
    assert_eq!(block_bytes(&d3, 0, 2..4), expected(&c, 5, 1, 2..4));
    assert!(block_bytes(&d3, 0, 0..2).iter().all(|b| *b == 0));
}

#[tokio::test]
async fn s3_overwritten_truncated_and_deleted_objects_are_block_errors() {
    let ns = unique("integrity");
    let Some(store) = s3_storage(
        "s3_overwritten_truncated_and_deleted_objects_are_block_errors",
        &ns,
    ) else {
        return;
    };
    let tm = TransferManager::new().unwrap();
    let src = host(&tm, 4, Some(1));
    let obj = tm
        .register_layout(PhysicalLayout::object(
            small(4, LayoutKind::FullyContiguous),
            Arc::clone(&store),
        ))
        .unwrap();
    let keys: Vec<ObjectKey> = (0..4u128)
        .map(|i| ObjectKey::from_u128(0xabc0 + i))
        .collect();
    let out = transfer(
        &tm,
        src,
        &[0, 1, 2, 3],
        obj,
        &[0, 1, 2, 3],
        TransferOptions::with_object_keys(keys.clone()),
    )
    .await;
    assert!(out.is_complete_success(), "{:?}", out.blocks);

    // Behind our back: overwrite key 1 with same-length different bytes (header kept), truncate
    // key 2, delete key 3.
    let raw = s3_raw("s3_overwritten_truncated_and_deleted_objects_are_block_errors").unwrap();
    let p1 = store.path(&keys[1]);
    kvbm_tests::faults::flip_last_byte(&*raw, &p1, 0x5a).await;
    let p2 = store.path(&keys[2]);
    let body = raw.get(&p2).await.unwrap().bytes().await.unwrap();
    raw.put(&p2, PutPayload::from(body.slice(..body.len() / 2)))
        .await
        .unwrap();
    raw.delete(&store.path(&keys[3])).await.unwrap();

    let dst = host(&tm, 4, None);
    let out = transfer(
        &tm,
        obj,
        &[0, 1, 2, 3],
        dst,
        &[0, 1, 2, 3],
        TransferOptions::with_object_keys(keys.clone()),
    )
    .await;
    assert!(out.blocks[0].1.is_ok(), "{:?}", out.blocks[0]);
    assert!(
        matches!(out.blocks[1].1, Err(PhysicalError::ChecksumMismatch { .. })),
        "{:?}",
        out.blocks[1]
    );
    assert!(
        matches!(out.blocks[2].1, Err(PhysicalError::ShortRead { .. })),
        "{:?}",
        out.blocks[2]
    );
    assert!(
        matches!(out.blocks[3].1, Err(PhysicalError::NotFound { .. })),
        "{:?}",
        out.blocks[3]
    );
    assert!(!out.is_complete_success());
    let d = tm.layout(dst).unwrap();
    let c = *d.layout().config();
    assert_eq!(block_bytes(&d, 0, 0..4), expected(&c, 1, 0, 0..4));

    // Conditional create: a put in Create mode onto an existing key fails; a lock is exclusive.
    let mut o = TransferOptions::with_object_keys(vec![keys[0].clone()]);
    o.object_put_mode = ObjectPutMode::Create;
    let out = transfer(&tm, src, &[0], obj, &[0], o).await;
    assert!(
        matches!(out.blocks[0].1, Err(PhysicalError::AlreadyExists { .. })),
        "{:?}",
        out.blocks
    );
    let lock = ObjectKey::new("locks/a");
    assert!(
        store
            .try_create(&lock, Bytes::from_static(b"me"))
            .await
            .unwrap()
    );
    assert!(
        !store
            .try_create(&lock, Bytes::from_static(b"you"))
            .await
            .unwrap()
    );
    assert!(store.exists(&lock).await.unwrap());
    store.delete(&lock).await.unwrap();
    assert!(!store.exists(&lock).await.unwrap());
}

#[tokio::test]
async fn s3_multipart_for_large_blocks() {
    let ns = unique("multipart");
    let Some(s3) = s3_storage("s3_multipart_for_large_blocks", &ns) else {
        return;
    };
    // Re-wrap the same store with a low multipart threshold: 1 block of 12 MiB → 2+ parts.
    drop(s3);
    let raw = s3_raw("s3_multipart_for_large_blocks").unwrap();
    let store = Arc::new(ObjectStorage::new(
        raw,
        ObjectConfig {
            namespace: ns,
            multipart_threshold: 6 << 20,
            part_size: 5 << 20,
            ..Default::default()
        },
    ));
    let layout = BlockLayout::builder()
        .num_blocks(1)
        .num_layers(3)
        .page_size(64)
        .inner_dim(16 * 1024)
        .dtype_bytes(2)
        .build()
        .unwrap();
    assert_eq!(layout.config().block_bytes(), 12 << 20);
    let tm = TransferManager::new().unwrap();
    let src = PhysicalLayout::allocate_host(layout, PinPolicy::Unpinned).unwrap();
    fill(&src, 2);
    let src = tm.register_layout(src).unwrap();
    let obj = tm
        .register_layout(PhysicalLayout::object(layout, store))
        .unwrap();
    let keys = vec![ObjectKey::new("big")];
    assert!(
        transfer(
            &tm,
            src,
            &[0],
            obj,
            &[0],
            TransferOptions::with_object_keys(keys.clone())
        )
        .await
        .is_complete_success()
    );
    let dst = tm
        .register_layout(PhysicalLayout::allocate_host(layout, PinPolicy::Unpinned).unwrap())
        .unwrap();
    let out = transfer(
        &tm,
        obj,
        &[0],
        dst,
        &[0],
        TransferOptions::with_object_keys(keys),
    )
    .await;
    assert!(out.is_complete_success(), "{:?}", out.blocks);
    let d = tm.layout(dst).unwrap();
    assert_eq!(
        block_bytes(&d, 0, 0..3),
        expected(layout.config(), 2, 0, 0..3)
    );
}

#[test]
fn sync_callers_can_wait() {
    let tm = TransferManager::new().unwrap();
    let a = host(&tm, 2, Some(4));
    let b = host(&tm, 2, None);
    // SAFETY: test-owned layouts; nothing outside the manager reads or writes their blocks while the transfer runs.
    let out = unsafe { tm.execute_transfer(a, &[0, 1], b, &[1, 0], TransferOptions::default()) }
        .unwrap()
        .wait();
    assert!(out.is_complete_success());
    let bl = tm.layout(b).unwrap();
    assert_eq!(
        block_bytes(&bl, 1, 0..4),
        expected(bl.layout().config(), 4, 0, 0..4)
    );
    // Dropping the manager inside or outside async code never panics.
    drop(tm);
}

#[tokio::test]
async fn streamed_gets_report_short_and_overlong_bodies() {
    // In-memory objects arrive as a stream, the path that hashes and scatters while receiving.
    let raw: Arc<dyn object_store::ObjectStore> = Arc::new(object_store::memory::InMemory::new());
    let store = Arc::new(ObjectStorage::new(raw.clone(), ObjectConfig::default()));
    let tm = TransferManager::new().unwrap();
    let src = host(&tm, 3, Some(6));
    let obj = tm
        .register_layout(PhysicalLayout::object(
            small(3, LayoutKind::FullyContiguous),
            Arc::clone(&store),
        ))
        .unwrap();
    let keys: Vec<ObjectKey> = ["a", "b", "c"].into_iter().map(ObjectKey::new).collect();
    let out = transfer(
        &tm,
        src,
        &[0, 1, 2],
        obj,
        &[0, 1, 2],
        TransferOptions::with_object_keys(keys.clone()),
    )
    .await;
    assert!(out.is_complete_success(), "{:?}", out.blocks);
    // "a": shorter than a header; "b": one byte too many (refused by size, unread); "c": intact.
    let pa = store.path(&keys[0]);
    let body = raw.get(&pa).await.unwrap().bytes().await.unwrap();
    raw.put(&pa, PutPayload::from(body.slice(..10)))
        .await
        .unwrap();
    let pb = store.path(&keys[1]);
    let mut body = raw.get(&pb).await.unwrap().bytes().await.unwrap().to_vec();
    body.push(0);
    raw.put(&pb, PutPayload::from(body)).await.unwrap();
    let dst = host(&tm, 3, None);
    let out = transfer(
        &tm,
        obj,
        &[0, 1, 2],
        dst,
        &[0, 1, 2],
        TransferOptions::with_object_keys(keys),
    )
    .await;
    assert!(
        matches!(
            out.blocks[0].1,
            Err(PhysicalError::ShortRead { actual: 10, .. })
        ),
        "{:?}",
        out.blocks[0]
    );
    assert!(
        matches!(out.blocks[1].1, Err(PhysicalError::TooLarge { .. })),
        "{:?}",
        out.blocks[1]
    );
    assert!(out.blocks[2].1.is_ok(), "{:?}", out.blocks[2]);
    let d = tm.layout(dst).unwrap();
    let c = *d.layout().config();
    assert_eq!(block_bytes(&d, 2, 0..4), expected(&c, 6, 2, 0..4));
}

/// A symlink planted at the disk file's `<file>.id.tmp` is never written through: recording
/// the file id replaces it and the file it pointed to is untouched (issue 23, item 9).
#[test]
fn the_file_id_is_never_written_through_a_planted_tmp_symlink() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("g3.bin");
    let victim = dir.path().join("victim");
    std::fs::write(&victim, b"precious").unwrap();
    std::os::unix::fs::symlink(&victim, dir.path().join("g3.bin.id.tmp")).unwrap();
    let disk = PhysicalLayout::create_disk(
        small(4, LayoutKind::FullyContiguous),
        &DiskConfig::new(&path),
    )
    .unwrap();
    assert_eq!(std::fs::read(&victim).unwrap(), b"precious");
    assert!(dir.path().join("g3.bin.id").exists(), "the id was recorded");
    drop(disk);
}
