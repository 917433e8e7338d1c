//! G4 shared between two instances on the real S3-compatible server: instance A offloads a
//! prefix to the bucket through the offload crate's object pipeline and publishes its G4
//! events; instance B, with its own S3 client on the same bucket and namespace, learns of the
//! objects from A's events (its cross-instance index), finds them with `find_matches`
//! (adopted into its own G4), stages them G4→G2 and onboards them to G1, bytes verified.
//! An object whose identity or checksum is wrong is never served: the session fails and
//! nothing of it is registered in B's G2. A third instance that heard no events finds the
//! same prefix through a G4 presence check (`adopt_present_g4`). Needs `cargo xtask services start` (or skips under
//! `KVBM_TEST_SKIP_SERVICES=1`).

use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use kvbm_engine::InstanceId;
use kvbm_engine::KvbmRuntime;
use kvbm_engine::cluster::pubsub::{EventPublisher, InProcessBus};
use kvbm_engine::cross_instance::CrossInstanceIndex;
use kvbm_engine::leader::{InstanceLeader, Phase, RemoteSearch, SessionError, StagingMovers};
use kvbm_logical::{
    BlockManager, BlockRegistry, G1, G2, G4, Salt, SequenceHash, TierId, TokenBlockSequence,
};
use kvbm_offload::{
    ExternalBlock, ObjectMoveExecutor, ObjectPipelineBuilder, S3PresenceChecker, block_identity,
    object_key,
};
use kvbm_physical::{
    ObjectConfig, ObjectPutMode, ObjectStorage, PhysicalLayout, PinPolicy, S3Config,
    TransferManager,
};
use object_store::ObjectStoreExt;

mod common;

use common::{N, bytes, fill};

const A: InstanceId = InstanceId(0xa);
const B: InstanceId = InstanceId(0xb);

fn geometry() -> kvbm_physical::BlockLayout {
    common::geometry_with(32)
}

fn s3_config(test: &str) -> Option<(S3Config, String)> {
    let s3 = kvbm_tests::services::s3(test)?;
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    Some((
        S3Config {
            endpoint: Some(s3.endpoint),
            bucket: s3.bucket,
            region: "us-east-1".into(),
            access_key: s3.access_key,
            secret_key: s3.secret_key,
        },
        format!("engine-{test}-{}-{nanos}", std::process::id()),
    ))
}

/// One instance's client of the shared bucket and namespace.
fn storage(cfg: &S3Config, namespace: &str) -> Arc<ObjectStorage> {
    let config = ObjectConfig {
        namespace: namespace.to_string(),
        ..Default::default()
    };
    Arc::new(ObjectStorage::s3(cfg, config).expect("s3 client"))
}

fn manager<T: kvbm_logical::Tier>(
    registry: &BlockRegistry,
    sink: Option<Arc<EventPublisher>>,
) -> Arc<BlockManager<T>> {
    let mut b = BlockManager::<T>::builder()
        .block_count(N)
        .block_size(4)
        .registry(registry.clone());
    if let Some(s) = sink {
        b = b.event_sink(s);
    }
    Arc::new(b.build().unwrap())
}

fn track<T: kvbm_logical::Tier>(m: &BlockManager<T>, hashes: &[SequenceHash]) {
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
async fn b_onboards_what_a_offloaded_to_g4_and_never_serves_a_bad_object() {
    let Some((cfg, namespace)) = s3_config("shared_g4") else {
        return;
    };
    let runtime = KvbmRuntime::builder()
        .tokio_handle(tokio::runtime::Handle::current())
        .build()
        .unwrap();
    let rt = runtime.handle();
    let bus = Arc::new(InProcessBus::new(64));
    let seq =
        TokenBlockSequence::from_tokens(&(0..32).collect::<Vec<u32>>(), 4, Salt::NONE).unwrap();
    let hashes = seq.hashes();
    // B follows the bus from the start (a broadcast reaches current subscribers only).
    let index_b = Arc::new(CrossInstanceIndex::new());
    CrossInstanceIndex::follow(index_b.clone(), &rt, &*bus).unwrap();

    // Instance A: computes 8 blocks in its host memory and offloads 0..6 to G4, plus two bad
    // objects: at hash 6 a valid object of block 5 (wrong identity), at hash 7 a block whose
    // bytes were damaged at rest (wrong checksum).
    let storage_a = storage(&cfg, &namespace);
    let tm_a = Arc::new(TransferManager::new().unwrap());
    let src = PhysicalLayout::allocate_host(geometry(), PinPolicy::Unpinned).unwrap();
    fill(&src, 0x3c);
    let src_h = tm_a.register_layout(src).unwrap();
    let obj_a_h = tm_a
        .register_layout(PhysicalLayout::object(geometry(), storage_a.clone()))
        .unwrap();
    let up = ObjectPipelineBuilder::new(storage_a.clone())
        .spawn(ObjectMoveExecutor::<G2>::new(tm_a.clone(), src_h, obj_a_h))
        .unwrap();
    let written: Vec<ExternalBlock> = (0..6)
        .chain([7])
        .map(|i| ExternalBlock::new(i, hashes[i]))
        .collect();
    let r = up
        .enqueue(written, None)
        .await
        .unwrap()
        .wait()
        .await
        .unwrap();
    assert_eq!(r.completed_blocks.len(), 7, "{r:?}");
    up.pipeline().shutdown_and_wait().await;
    let src_layout = tm_a.layout(src_h).unwrap();
    storage_a
        .put_block(
            &object_key(hashes[6]),
            &block_identity(hashes[5]),
            geometry().config(),
            vec![Bytes::from(bytes(&src_layout, 5))],
            ObjectPutMode::Overwrite,
        )
        .await
        .unwrap();
    let raw = ObjectStorage::s3_client(&cfg).unwrap();
    let path = storage_a.path(&object_key(hashes[7]));
    let mut body = raw
        .get(&path)
        .await
        .unwrap()
        .bytes()
        .await
        .unwrap()
        .to_vec();
    let last = body.len() - 1;
    body[last] ^= 0xff;
    raw.put(&path, body.into()).await.unwrap();
    // A's G4 bookkeeping, published on the bus.
    let pub_a = EventPublisher::spawn(&rt, A, bus.clone()).unwrap();
    let g4_a = manager::<G4>(&BlockRegistry::new(), Some(pub_a));
    track(&g4_a, &hashes[..8]);
    g4_a.flush_events();

    // Instance B: its own S3 client, G2, G4 bookkeeping and G1, following the bus.
    let storage_b = storage(&cfg, &namespace);
    let registry_b = BlockRegistry::new();
    let g2_b = manager::<G2>(&registry_b, None);
    let g4_b = manager::<G4>(&registry_b, None);
    let g1_b = manager::<G1>(&BlockRegistry::new(), None);
    let tm_b = Arc::new(TransferManager::new().unwrap());
    let g2_h = tm_b
        .register_layout(PhysicalLayout::allocate_host(geometry(), PinPolicy::Unpinned).unwrap())
        .unwrap();
    let obj_b_h = tm_b
        .register_layout(PhysicalLayout::object(geometry(), storage_b.clone()))
        .unwrap();
    let g1_h = tm_b
        .register_layout(PhysicalLayout::allocate_host(geometry(), PinPolicy::Unpinned).unwrap())
        .unwrap();
    let leader_b = InstanceLeader::builder()
        .g2(g2_b.clone())
        .g4(g4_b.clone())
        .remote(RemoteSearch {
            index: index_b.clone(),
            this: B,
            shared_g4: true,
        })
        .build()
        .unwrap();
    for _ in 0..500 {
        if index_b.len() == 8 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(index_b.locations(hashes[0]), vec![(A, TierId::G4)]);
    let movers = || StagingMovers {
        g4_to_g2: Some(Arc::new(
            common::mover(&tm_b, obj_b_h, g2_h, &g2_b).keyed_source(),
        )),
        ..StagingMovers::default()
    };

    // B has nothing locally; the search adopts A's G4 run.
    let session = leader_b.begin_onboarding(&hashes[..6]);
    assert_eq!(session.prefix_len(), 6);
    session.prepare(movers()).await.unwrap();
    assert_eq!(session.phase(), Phase::Staged);
    let expected: Vec<Vec<u8>> = (0..6).map(|i| bytes(&src_layout, i)).collect();
    common::onboard_and_verify(&session, &tm_b, g2_h, g1_h, &g1_b, &hashes, &expected).await;
    drop(session);
    assert_eq!(
        g4_b.match_blocks(&hashes[..6]).len(),
        6,
        "adopted into B's G4"
    );

    // Hash 6's object is block 5's (identity mismatch), hash 7's is damaged (checksum): the
    // search offers them (the events say they exist), staging refuses both, and neither is
    // ever registered in B's G2.
    for (want, needle) in [(6, "identity"), (7, "checksum")] {
        let session = leader_b.begin_onboarding(&hashes[want..want + 1]);
        assert_eq!(session.prefix_len(), 1, "hash {want}");
        let err = session.prepare(movers()).await.unwrap_err();
        let SessionError::Failed(f) = err else {
            panic!("{err}");
        };
        assert_eq!(f.failed_blocks, 1);
        assert!(f.message.contains(needle), "hash {want}: {}", f.message);
        assert!(g2_b.match_blocks(&hashes[want..want + 1]).is_empty());
    }

    // Instance C heard no events: a G4 presence check (one verified header read per object)
    // finds 0..6 present and hash 6 foreign (block 5's object), so it adopts exactly 0..6.
    let storage_c = storage(&cfg, &namespace);
    let registry_c = BlockRegistry::new();
    let g2_c = manager::<G2>(&registry_c, None);
    let g4_c = manager::<G4>(&registry_c, None);
    let g2_c_h = tm_b
        .register_layout(PhysicalLayout::allocate_host(geometry(), PinPolicy::Unpinned).unwrap())
        .unwrap();
    let obj_c_h = tm_b
        .register_layout(PhysicalLayout::object(geometry(), storage_c.clone()))
        .unwrap();
    let leader_c = InstanceLeader::builder()
        .g2(g2_c.clone())
        .g4(g4_c.clone())
        .build()
        .unwrap();
    assert!(leader_c.find_matches(&hashes[..8]).is_empty());
    let checker = S3PresenceChecker::new(storage_c);
    assert_eq!(
        leader_c
            .adopt_present_g4(&hashes[..8], &checker)
            .await
            .unwrap(),
        6
    );
    let session = leader_c.begin_onboarding(&hashes[..8]);
    assert_eq!(session.prefix_len(), 6);
    session
        .prepare(StagingMovers {
            g4_to_g2: Some(Arc::new(
                common::mover(&tm_b, obj_c_h, g2_c_h, &g2_c).keyed_source(),
            )),
            ..StagingMovers::default()
        })
        .await
        .unwrap();
    let g2_c_layout = tm_b.layout(g2_c_h).unwrap();
    for (i, b) in session.staged().iter().enumerate() {
        assert_eq!(b.sequence_hash(), hashes[i]);
        assert_eq!(
            bytes(&g2_c_layout, b.block_id()),
            bytes(&src_layout, i),
            "block {i}"
        );
    }
    runtime.shutdown();
}
