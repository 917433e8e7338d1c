//! The G4 get side (issue 9): G2→G4 through the object pipeline, then G4→G2 through an
//! onboarding lane with caller-allocated destinations, against the real S3-compatible server;
//! bytes verified. Skipped without the server (`cargo xtask services start`).

mod common;

use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use common::{external, hash, hashes, manager};
use kvbm_logical::{G2, G4, ImmutableBlock};
use kvbm_offload::mover::CallerAllocated;
use kvbm_offload::settlement::PipelineLane;
use kvbm_offload::*;
use kvbm_physical::{
    ObjectConfig, ObjectStorage, PhysicalLayout, PinPolicy, S3Config, TransferManager,
};
use parking_lot::Mutex;

fn storage(test: &str) -> Option<Arc<ObjectStorage>> {
    let s3 = kvbm_tests::services::s3(test)?;
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    let config = ObjectConfig {
        namespace: format!("upward-{test}-{}-{nanos}", std::process::id()),
        ..Default::default()
    };
    let cfg = S3Config {
        endpoint: Some(s3.endpoint),
        bucket: s3.bucket,
        region: "us-east-1".into(),
        access_key: s3.access_key,
        secret_key: s3.secret_key,
        allow_http: false,
    };
    Some(Arc::new(
        ObjectStorage::s3(&cfg, config).expect("s3 client"),
    ))
}

fn block_bytes(layout: &PhysicalLayout, b: usize) -> Vec<u8> {
    let c = *layout.layout().config();
    let mut out = Vec::new();
    for (addr, len) in layout.block_addrs(b, 0..c.num_layers) {
        // SAFETY: host memory owned by the test; no transfer targets it while it is read.
        out.extend_from_slice(unsafe { std::slice::from_raw_parts(addr as *const u8, len) });
    }
    out
}

fn fill(layout: &PhysicalLayout, seed: u8) {
    let c = *layout.layout().config();
    for b in 0..c.num_blocks {
        for (addr, len) in layout.block_addrs(b, 0..c.num_layers) {
            // SAFETY: as in `block_bytes`; the test is the only writer.
            let s = unsafe { std::slice::from_raw_parts_mut(addr as *mut u8, len) };
            for (k, x) in s.iter_mut().enumerate() {
                *x = (k as u8).wrapping_mul(7) ^ (b as u8).wrapping_mul(57) ^ seed;
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn g2_g4_g2_round_trip_through_the_upward_object_lane() {
    let Some(storage) = storage("g2_g4_g2") else {
        return;
    };
    let n = 6;
    let geometry = || common::geometry(n, 2, 32);
    let tm = Arc::new(TransferManager::new().unwrap());
    let host = PhysicalLayout::allocate_host(geometry(), PinPolicy::Unpinned).unwrap();
    fill(&host, 0x5a);
    let g2_h = tm.register_layout(host).unwrap();
    let obj_h = tm
        .register_layout(PhysicalLayout::object(geometry(), storage.clone()))
        .unwrap();
    let back_h = common::host_layout(&tm, common::geometry(n + 1, 2, 32), PinPolicy::Unpinned);

    let down = ObjectPipelineBuilder::new(storage.clone())
        .spawn(ObjectMoveExecutor::<G2>::new(tm.clone(), g2_h, obj_h))
        .unwrap();
    let r = down
        .enqueue(external(0, n as u32), None)
        .await
        .unwrap()
        .wait()
        .await
        .unwrap();
    assert_eq!(r.completed_blocks.len(), n, "{r:?}");

    // Onboard into a fresh G2 (its own memory), destinations allocated beforehand.
    let g2_back = Arc::new(manager::<G2>(n + 1, None));
    let arrived: Arc<Mutex<Vec<ImmutableBlock<G2>>>> = Arc::default();
    let sink = arrived.clone();
    let up = PipelineBuilder::<G4, G2>::new()
        .caller_allocated()
        .min_batch_size(1)
        .build()
        .spawn_with_sink(
            CallerAllocated::new(
                BlockMover::<G4, G2>::from_layout(
                    obj_h,
                    &BoundTier::new(tm.clone(), back_h, g2_back.clone()).unwrap(),
                )
                .unwrap()
                .keyed_source(),
            ),
            Some(Arc::new(move |b: Vec<ImmutableBlock<G2>>| {
                sink.lock().extend(b)
            })),
        )
        .unwrap();
    assert_eq!(up.lane(), PipelineLane::G4_TO_G2);
    // One more block than was written: its object does not exist.
    let sources: Vec<ExternalBlock> = (0..=n as u32)
        .map(|i| ExternalBlock::new(0, hash(i)))
        .collect();
    let destinations = g2_back.allocate_blocks(n + 1).unwrap();
    let r = up
        .enqueue_into(sources, destinations, None)
        .await
        .unwrap()
        .wait()
        .await
        .unwrap();
    assert_eq!(r.completed_blocks.len(), n, "{r:?}");
    assert_eq!(r.failed_blocks.len(), 1);
    assert_eq!(r.failed_blocks[0].0, hash(n as u32));
    assert_eq!(
        r.failed_blocks[0].1.kind,
        BlockFailureKind::NotFound,
        "{r:?}"
    );
    assert_eq!(
        g2_back.available_blocks(),
        1,
        "the failed destination went back, the others are registered and held"
    );

    let src = tm.layout(g2_h).unwrap();
    let back = tm.layout(back_h).unwrap();
    let arrived = std::mem::take(&mut *arrived.lock());
    assert_eq!(arrived.len(), n);
    for b in &arrived {
        let i = hashes(0, n as u32)
            .iter()
            .position(|h| *h == b.sequence_hash())
            .expect("one of ours");
        assert_eq!(
            block_bytes(&src, i),
            block_bytes(&back, b.block_id()),
            "block {i}"
        );
    }
    down.pipeline().shutdown_and_wait().await;
    up.shutdown_and_wait().await;
}

/// Issue 10 item 4 on G4: an object binds its block's full 256-bit BLAKE3 digest. Tenant A's
/// block is written with its digest (and a second offload finds it present by that digest);
/// A reads it back through a mover between bound tiers (the G4 tier is keyed); tenant B asking
/// for the same sequence hash (so the same object key) with its own digest is refused as an
/// identity mismatch. With the hash as the identity (today's code), B was served A's bytes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fail_closed_g4_identity_is_the_full_digest() {
    let Some(storage) = storage("digest") else {
        return;
    };
    let n = 2;
    let geometry = || common::geometry(n, 2, 32);
    let tm = Arc::new(TransferManager::new().unwrap());
    let host = PhysicalLayout::allocate_host(geometry(), PinPolicy::Unpinned).unwrap();
    fill(&host, 0x6b);
    let g2_h = tm.register_layout(host).unwrap();
    let obj_h = tm
        .register_layout(PhysicalLayout::object(geometry(), storage.clone()))
        .unwrap();
    let g4 = Arc::new(manager::<G4>(n, None));
    let g4b = BoundTier::new(tm.clone(), obj_h, g4.clone()).unwrap();
    assert!(g4b.is_keyed());
    let block = |salt: &str, t: u32| {
        let s = kvbm_logical::TokenBlockSequence::from_tokens_with(
            &[t, t + 1, t + 2, t + 3],
            4,
            kvbm_logical::Salt::new(salt),
            kvbm_logical::HashAlgorithm::Blake3,
        )
        .unwrap();
        (
            s.blocks()[0].sequence_hash(),
            s.blocks()[0].digest().unwrap(),
        )
    };
    let (h, da) = block("tenant-a", 1);
    let (_, db) = block("tenant-b", 900);

    let down = ObjectPipelineBuilder::new(storage.clone())
        .spawn(ObjectMoveExecutor::<G2>::new(tm.clone(), g2_h, obj_h).with_g4_manager(g4.clone()))
        .unwrap();
    let a = ExternalBlock::new(0, h).with_digest(Some(da));
    let r = down
        .enqueue(vec![a], None)
        .await
        .unwrap()
        .wait()
        .await
        .unwrap();
    assert_eq!(r.completed_blocks, vec![h], "{r:?}");
    assert_eq!(g4.match_blocks(&[h])[0].digest(), Some(da));
    // Present by its digest: a second offload writes nothing.
    let r = down
        .enqueue(vec![a], None)
        .await
        .unwrap()
        .wait()
        .await
        .unwrap();
    assert_eq!(r.filtered_blocks, vec![h], "{r:?}");
    assert!(
        r.completed_blocks.is_empty() && r.failed_blocks.is_empty(),
        "{r:?}"
    );

    let back_h = common::host_layout(&tm, geometry(), PinPolicy::Unpinned);
    let g2 = Arc::new(manager::<G2>(n, None));
    let g2b = BoundTier::new(tm.clone(), back_h, g2.clone()).unwrap();
    let up = BlockMover::new(&g4b, &g2b).unwrap();
    let out = up
        .move_blocks(&[(0, h, Some(da))], g2b.allocate(1).unwrap())
        .await;
    let got = out[0].as_ref().expect("A reads its own block");
    assert_eq!(got.digest(), Some(da));
    assert_eq!(
        block_bytes(&tm.layout(g2_h).unwrap(), 0),
        block_bytes(&tm.layout(back_h).unwrap(), got.block_id())
    );
    let before = g2.pool_counts();
    let out = up
        .move_blocks(&[(0, h, Some(db))], g2b.allocate(1).unwrap())
        .await;
    let err = out[0]
        .as_ref()
        .expect_err("a colliding hash must not be served");
    assert_eq!(err.kind, BlockFailureKind::IdentityMismatch, "{err}");
    assert_eq!(g2.pool_counts(), before, "nothing registered for B");
    down.pipeline().shutdown_and_wait().await;
}
