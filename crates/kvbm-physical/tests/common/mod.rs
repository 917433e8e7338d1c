//! Shared helpers and the storage-backend conformance suite.
#![allow(dead_code)]

use std::sync::Arc;

use kvbm_physical::*;

/// Small geometry: 4 layers × K/V × 16 tokens × 64 × 2 B = 16 KiB per block (4 KiB regions).
pub(crate) fn small(num_blocks: usize, kind: LayoutKind) -> BlockLayout {
    BlockLayout::builder()
        .num_blocks(num_blocks)
        .num_layers(4)
        .outer_dim(2)
        .page_size(16)
        .inner_dim(64)
        .dtype_bytes(2)
        .kind(kind)
        .build()
        .unwrap()
}

/// A registered host layout of `small(n)` blocks (unpinned), filled with `seed` when given.
pub(crate) fn host(tm: &TransferManager, n: usize, seed: Option<u8>) -> LayoutHandle {
    let l =
        PhysicalLayout::allocate_host(small(n, LayoutKind::FullyContiguous), PinPolicy::Unpinned)
            .unwrap();
    if let Some(s) = seed {
        fill(&l, s);
    }
    tm.register_layout(l).unwrap()
}

/// Starts a transfer that must pass validation and awaits its outcome.
pub(crate) async fn transfer(
    tm: &TransferManager,
    src: LayoutHandle,
    src_ids: &[BlockId],
    dst: LayoutHandle,
    dst_ids: &[BlockId],
    options: TransferOptions,
) -> TransferOutcome {
    // SAFETY: test-owned layouts; nothing outside the manager reads or writes their blocks while the transfer runs.
    unsafe { tm.execute_transfer(src, src_ids, dst, dst_ids, options) }
        .unwrap()
        .await
}

/// A disk layout at `path` with the given engine and O_DIRECT choice.
pub(crate) fn disk(
    layout: BlockLayout,
    path: &std::path::Path,
    engine: IoEngineKind,
    direct_io: bool,
) -> PhysicalLayout {
    let mut cfg = DiskConfig::new(path);
    cfg.engine = engine;
    cfg.direct_io = direct_io;
    PhysicalLayout::create_disk(layout, &cfg).unwrap()
}

/// Fills every block of a host/device layout with a pattern derived from (seed, block, byte).
pub(crate) fn fill(layout: &PhysicalLayout, seed: u8) {
    let c = *layout.layout().config();
    for b in 0..c.num_blocks {
        let mut k = 0usize;
        for (addr, len) in layout.block_addrs(b, 0..c.num_layers) {
            // SAFETY: test owns the layout exclusively; addresses are host (or stand-in) memory.
            let s = unsafe { std::slice::from_raw_parts_mut(addr as *mut u8, len) };
            for x in s.iter_mut() {
                *x = pattern(seed, b, k);
                k += 1;
            }
        }
    }
}

/// The fill pattern byte.
pub(crate) fn pattern(seed: u8, block: usize, k: usize) -> u8 {
    (k.wrapping_mul(31) ^ block.wrapping_mul(131) ^ (seed as usize * 7) ^ (k >> 8)) as u8
}

/// The serialized bytes of a block (for layers), read from host/stand-in memory.
pub(crate) fn block_bytes(
    layout: &PhysicalLayout,
    b: usize,
    layers: std::ops::Range<usize>,
) -> Vec<u8> {
    let mut out = Vec::new();
    for (addr, len) in layout.block_addrs(b, layers) {
        // SAFETY: as in `fill`.
        out.extend_from_slice(unsafe { std::slice::from_raw_parts(addr as *const u8, len) });
    }
    out
}

/// What `fill(seed)` put in block `b` for `layers`, serialized.
pub(crate) fn expected(
    c: &LayoutConfig,
    seed: u8,
    b: usize,
    layers: std::ops::Range<usize>,
) -> Vec<u8> {
    let lb = c.layer_bytes();
    (layers.start * lb..layers.end * lb)
        .map(|k| pattern(seed, b, k))
        .collect()
}

/// The conformance suite every storage backend must pass: a layout of `backend` is written
/// from host memory and read back into fresh host memory (of every host arrangement), with
/// scrambled block ids, and argument errors are refused before anything starts.
pub(crate) async fn conformance(
    name: &str,
    make: &dyn Fn(BlockLayout) -> PhysicalLayout,
    keys_prefix: &str,
) {
    let tm = TransferManager::new().unwrap();
    let n = 6;
    let src =
        PhysicalLayout::allocate_host(small(n, LayoutKind::FullyContiguous), PinPolicy::TryPin)
            .unwrap();
    fill(&src, 3);
    let src_h = tm.register_layout(src).unwrap();
    let under = make(small(n, LayoutKind::FullyContiguous));
    let is_object = under.storage_kind() == StorageKind::Object;
    let mid_h = tm.register_layout(under).unwrap();
    let src_ids = [0, 1, 2, 3, 4, 5];
    let mid_ids = [5, 3, 1, 0, 2, 4];
    let keys: Vec<ObjectKey> = mid_ids
        .iter()
        .map(|i| ObjectKey::new(format!("{keys_prefix}/blk{i}")))
        .collect();
    let opts = || {
        if is_object {
            TransferOptions::with_object_keys(keys.clone())
        } else {
            TransferOptions::default()
        }
    };
    let out = transfer(&tm, src_h, &src_ids, mid_h, &mid_ids, opts()).await;
    assert!(out.is_complete_success(), "{name}: write: {:?}", out.blocks);
    for kind in [
        LayoutKind::FullyContiguous,
        LayoutKind::LayerSeparate(BlockDim::BlockContiguous),
        LayoutKind::LayerSeparate(BlockDim::OuterContiguous),
    ] {
        let dst = PhysicalLayout::allocate_host(small(n, kind), PinPolicy::Unpinned).unwrap();
        let dst_h = tm.register_layout(dst).unwrap();
        let back_ids = [2, 0, 1, 5, 4, 3];
        let out = transfer(&tm, mid_h, &mid_ids, dst_h, &back_ids, opts()).await;
        assert!(
            out.is_complete_success(),
            "{name}/{kind:?}: read: {:?}",
            out.blocks
        );
        assert_eq!(out.blocks.iter().map(|b| b.0).collect::<Vec<_>>(), back_ids);
        let dst = tm.layout(dst_h).unwrap();
        let c = *dst.layout().config();
        for (i, &b) in back_ids.iter().enumerate() {
            assert_eq!(
                block_bytes(&dst, b, 0..4),
                expected(&c, 3, src_ids[i], 0..4),
                "{name}/{kind:?}: block {b}"
            );
        }
        // Layer-wise onboarding: only layers 1..3 arrive.
        let part = PhysicalLayout::allocate_host(small(n, kind), PinPolicy::Unpinned).unwrap();
        let part_h = tm.register_layout(part).unwrap();
        let mut o = opts();
        o.layer_range = Some(1..3);
        if let Some(k) = o.object_keys.as_mut() {
            k.truncate(2);
        }
        let out = transfer(&tm, mid_h, &mid_ids[..2], part_h, &[0, 1], o).await;
        assert!(
            out.is_complete_success(),
            "{name}: partial: {:?}",
            out.blocks
        );
        let part = tm.layout(part_h).unwrap();
        assert_eq!(
            block_bytes(&part, 0, 1..3),
            expected(&c, 3, src_ids[0], 1..3)
        );
        assert!(
            block_bytes(&part, 0, 0..1).iter().all(|b| *b == 0),
            "{name}: layer 0 untouched"
        );
    }
    // Argument errors: nothing starts.
    assert!(matches!(
        // SAFETY: test-owned layouts; nothing outside the manager reads or writes their blocks while the transfer runs.
        unsafe { tm.execute_transfer(src_h, &[0, 1], mid_h, &[0], opts()) },
        Err(PhysicalError::InvalidArgument(_))
    ));
    if !is_object {
        assert!(matches!(
            // SAFETY: test-owned layouts; nothing outside the manager reads or writes their blocks while the transfer runs.
            unsafe { tm.execute_transfer(src_h, &[0], mid_h, &[n], opts()) },
            Err(PhysicalError::BlockOutOfRange { .. })
        ));
    } else {
        assert!(matches!(
            // SAFETY: test-owned layouts; nothing outside the manager reads or writes their blocks while the transfer runs.
            unsafe { tm.execute_transfer(src_h, &[0], mid_h, &[0], TransferOptions::default()) },
            Err(PhysicalError::InvalidArgument(_))
        ));
    }
    let other = PhysicalLayout::allocate_host(
        BlockLayout::builder()
            .num_blocks(2)
            .num_layers(3)
            .page_size(16)
            .inner_dim(64)
            .build()
            .unwrap(),
        PinPolicy::Unpinned,
    )
    .unwrap();
    let other_h = tm.register_layout(other).unwrap();
    assert!(matches!(
        // SAFETY: test-owned layouts; nothing outside the manager reads or writes their blocks while the transfer runs.
        unsafe { tm.execute_transfer(other_h, &[0], mid_h, &[0], opts()) },
        Err(PhysicalError::IncompatibleLayouts(_))
    ));
}

/// The provisioned S3 server as an object tier under `namespace` (None under the opt-out).
pub(crate) fn s3_storage(test: &str, namespace: &str) -> Option<Arc<ObjectStorage>> {
    let s = kvbm_tests::services::s3(test)?;
    let cfg = S3Config {
        endpoint: Some(s.endpoint),
        bucket: s.bucket,
        region: "us-east-1".into(),
        access_key: s.access_key,
        secret_key: s.secret_key,
        allow_http: false,
    };
    Some(Arc::new(
        ObjectStorage::s3(
            &cfg,
            ObjectConfig {
                namespace: namespace.into(),
                ..Default::default()
            },
        )
        .unwrap(),
    ))
}

/// A client of the provisioned S3 server for the test itself (to tamper with objects behind
/// the storage's back; the storage keeps its own store private).
pub(crate) fn s3_raw(test: &str) -> Option<Arc<dyn object_store::ObjectStore>> {
    let s = kvbm_tests::services::s3(test)?;
    Some(Arc::new(
        object_store::aws::AmazonS3Builder::new()
            .with_bucket_name(s.bucket)
            .with_region("us-east-1")
            .with_access_key_id(s.access_key)
            .with_secret_access_key(s.secret_key)
            .with_virtual_hosted_style_request(false)
            .with_allow_http(s.endpoint.starts_with("http://"))
            .with_endpoint(s.endpoint)
            .build()
            .unwrap(),
    ))
}

/// A namespace unique to this test run.
pub(crate) fn unique(test: &str) -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    format!("kvbm-physical-tests/{test}-{}-{nanos}", std::process::id())
}
