//! Onboarding from G4 on the real S3-compatible server: a prefix split across G2 (host memory)
//! and G4 (objects written through the offload crate's object pipeline) is found, held,
//! staged G4→G2 and onboarded G2→G1, bytes verified; an object that does not exist fails the
//! session and releases everything. Needs `cargo xtask services start` (or skips under
//! `KVBM_TEST_SKIP_SERVICES=1`).

use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use kvbm_engine::leader::{InstanceLeader, MoversToG2, Phase, SessionError};
use kvbm_logical::{
    BlockManager, BlockRegistry, G1, G2, G4, Salt, SequenceHash, Tier, TokenBlockSequence,
};
use kvbm_offload::{ExternalBlock, ObjectMoveExecutor, ObjectPipelineBuilder};
use kvbm_physical::{
    LayoutHandle, ObjectConfig, ObjectStorage, PhysicalLayout, PinPolicy, S3Config, TransferManager,
};

mod common;

use common::{bytes, fill, manager};

fn geometry() -> kvbm_physical::BlockLayout {
    common::geometry_with(32)
}

fn storage(test: &str) -> Option<Arc<ObjectStorage>> {
    let s3 = kvbm_tests::services::s3(test)?;
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    let config = ObjectConfig {
        namespace: format!("engine-{test}-{}-{nanos}", std::process::id()),
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

/// Registers `hashes` in `m` without moving bytes (G4 presence is bookkeeping of what the
/// object store holds).
fn track<T: Tier>(m: &BlockManager<T>, hashes: &[SequenceHash]) {
    let complete = m
        .allocate_blocks(hashes.len())
        .unwrap()
        .into_iter()
        .zip(hashes)
        .map(|(b, h)| b.complete(*h).unwrap())
        .collect();
    drop(m.register_blocks(complete));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn g2_and_g4_prefix_staged_and_onboarded_bytes_verified() {
    let Some(storage) = storage("stage_g4") else {
        return;
    };
    let tm = Arc::new(TransferManager::new().unwrap());
    let registry = BlockRegistry::new();
    let seq =
        TokenBlockSequence::from_tokens(&(0..32).collect::<Vec<u32>>(), 4, Salt::NONE).unwrap();
    let hashes = seq.hashes();
    let g2 = manager::<G2>(&registry);
    let g4 = manager::<G4>(&registry);
    let g1 = manager::<G1>(&BlockRegistry::new());

    let g2_h = tm
        .register_layout(PhysicalLayout::allocate_host(geometry(), PinPolicy::Unpinned).unwrap())
        .unwrap();
    let obj_h = tm
        .register_layout(PhysicalLayout::object(geometry(), storage.clone()))
        .unwrap();
    let g1_h = tm
        .register_layout(PhysicalLayout::allocate_host(geometry(), PinPolicy::Unpinned).unwrap())
        .unwrap();
    // The writer: its own host memory; slots 2..6 hold blocks 2..6, uploaded as objects.
    let src = PhysicalLayout::allocate_host(geometry(), PinPolicy::Unpinned).unwrap();
    fill(&src, 0x5a);
    let src_h: LayoutHandle = tm.register_layout(src).unwrap();
    let up = ObjectPipelineBuilder::new(storage.clone())
        .spawn(ObjectMoveExecutor::<G2>::new(tm.clone(), src_h, obj_h))
        .unwrap();
    let written: Vec<ExternalBlock> = (2..6).map(|i| ExternalBlock::new(i, hashes[i])).collect();
    let r = up
        .enqueue(written, None)
        .await
        .unwrap()
        .wait()
        .await
        .unwrap();
    assert_eq!(r.completed_blocks.len(), 4, "{r:?}");
    up.pipeline().shutdown_and_wait().await;
    // Blocks 0,1 in G2 (slots whatever the manager gives, bytes filled below); 2..6 in G4.
    {
        let complete = g2
            .allocate_blocks(2)
            .unwrap()
            .into_iter()
            .zip(&hashes[..2])
            .map(|(b, h)| b.complete(*h).unwrap())
            .collect();
        drop(g2.register_blocks(complete));
    }
    fill(&tm.layout(g2_h).unwrap(), 0x11);
    track(&g4, &hashes[2..7]); // hash 6 tracked, but its object was never written

    let g2_layout = tm.layout(g2_h).unwrap();
    let src_layout = tm.layout(src_h).unwrap();
    let mut expected: Vec<Vec<u8>> = g2
        .match_blocks(&hashes[..2])
        .iter()
        .map(|b| bytes(&g2_layout, b.block_id()))
        .collect();
    expected.extend((2..6).map(|i| bytes(&src_layout, i)));

    let leader = InstanceLeader::builder()
        .g2(g2.clone())
        .g4(g4.clone())
        .build()
        .unwrap();
    let movers = || MoversToG2 {
        g3_to_g2: None,
        g4_to_g2: Some(Arc::new(
            common::mover(&tm, obj_h, g2_h, &g2).keyed_source(),
        )),
        remote_g2: None,
    };

    // 0..6: G2 0,1 + G4 2..6, every object present.
    let session = leader.begin_onboarding(&hashes[..6]);
    assert_eq!(session.prefix_len(), 6);
    session.prepare(movers()).await.unwrap();
    assert_eq!(session.phase(), Phase::Staged);
    common::onboard_and_verify(&session, &tm, g2_h, g1_h, &g1, &hashes, &expected).await;
    drop(session);

    // 0..7: hash 6 is tracked in G4 but its object does not exist: the session fails and
    // nothing of it is served.
    let session = leader.begin_onboarding(&hashes[..7]);
    assert_eq!(session.prefix_len(), 7);
    let err = session.prepare(movers()).await.unwrap_err();
    let SessionError::Failed(f) = err else {
        panic!("{err}");
    };
    assert_eq!(f.phase, Phase::Staging);
    assert_eq!(f.failed_blocks, 1, "{f:?}");
    assert!(g2.match_blocks(&hashes[6..7]).is_empty());
}
