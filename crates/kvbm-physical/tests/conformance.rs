//! The shared conformance suite run against every storage backend.

mod common;

use std::sync::Arc;

use common::*;
use kvbm_physical::*;

#[tokio::test]
async fn host_memory() {
    conformance(
        "host",
        &|l| PhysicalLayout::allocate_host(l, PinPolicy::TryPin).unwrap(),
        "",
    )
    .await;
}

#[tokio::test]
async fn host_memory_layer_separate() {
    conformance(
        "host-ls",
        &|l| {
            let l = BlockLayout::builder()
                .config(*l.config())
                .layer_separate(BlockDim::OuterContiguous)
                .build()
                .unwrap();
            PhysicalLayout::allocate_host(l, PinPolicy::Unpinned).unwrap()
        },
        "",
    )
    .await;
}

#[tokio::test]
async fn device_memory() {
    conformance(
        "device",
        &|l| PhysicalLayout::allocate_device(l, 0).unwrap(),
        "",
    )
    .await;
}

#[tokio::test]
async fn disk_io_uring() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("g3.bin");
    conformance(
        "disk-uring",
        &|l| {
            let p = disk(l, &path, IoEngineKind::Uring, true);
            let Backing::Disk(d) = p.backing() else {
                unreachable!()
            };
            assert_eq!(d.capabilities().engine, IoEngineKind::Uring);
            assert!(
                d.capabilities().direct_io,
                "O_DIRECT works on this filesystem"
            );
            p
        },
        "",
    )
    .await;
}

#[tokio::test]
async fn disk_psync_buffered() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("g3.bin");
    conformance(
        "disk-psync",
        &|l| disk(l, &path, IoEngineKind::Psync, false),
        "",
    )
    .await;
}

#[tokio::test]
async fn object_in_memory() {
    let store = Arc::new(ObjectStorage::in_memory(ObjectConfig::default()));
    conformance(
        "object-mem",
        &|l| PhysicalLayout::object(l, Arc::clone(&store)),
        "t",
    )
    .await;
}

#[tokio::test]
async fn object_local_fs() {
    let dir = tempfile::tempdir().unwrap();
    let store = Arc::new(ObjectStorage::local(dir.path(), ObjectConfig::default()).unwrap());
    conformance(
        "object-fs",
        &|l| PhysicalLayout::object(l, Arc::clone(&store)),
        "t",
    )
    .await;
}

#[tokio::test]
async fn object_s3() {
    let Some(store) = s3_storage("object_s3", &unique("conformance")) else {
        return;
    };
    conformance(
        "object-s3",
        &|l| PhysicalLayout::object(l, Arc::clone(&store)),
        "t",
    )
    .await;
}
