//! Two instances in one process, over loopback TCP: instance A holds a prefix in G2 and
//! publishes its events on the in-process bus; instance B's leader learns of it through its
//! cross-instance index, `find_matches` continues past B's own G2 into A, and the onboarding
//! session pulls A's blocks over the data plane into B's G2 and onboards everything to G1,
//! bytes verified. A pull answered by the wrong instance fails the session and registers
//! nothing.

use std::sync::Arc;
use std::time::Duration;

use kvbm_cluster::dataplane::{DataPlaneClient, DataPlaneConfig, DataPlaneServer, PeerDirectory};
use kvbm_cluster::pubsub::{EventPublisher, InProcessBus, IndexEvents};
use kvbm_engine::InstanceId;
use kvbm_engine::KvbmRuntime;
use kvbm_engine::cross_instance::CrossInstanceIndex;
use kvbm_engine::leader::{InstanceLeader, MoversToG2, Phase, RemoteSearch, SessionError};
use kvbm_logical::{
    BlockManager, BlockRegistry, EventSink, G1, G2, Salt, SequenceHash, TokenBlockSequence,
};
use kvbm_physical::{PhysicalLayout, PinPolicy, TransferManager};

#[path = "../../kvbm-engine/tests/common/mod.rs"]
mod common;

use common::{N, bytes, fill, geometry};
use kvbm_tests::wait::eventually_async;

const A: InstanceId = InstanceId(0xa);
const B: InstanceId = InstanceId(0xb);

fn g2_with_sink(sink: Arc<dyn EventSink>) -> Arc<BlockManager<G2>> {
    Arc::new(
        BlockManager::<G2>::builder()
            .block_count(N)
            .block_size(4)
            .registry(BlockRegistry::new())
            .event_sink(sink)
            .build()
            .unwrap(),
    )
}

fn store(m: &BlockManager<G2>, hashes: &[SequenceHash]) {
    let complete = m
        .allocate_blocks(hashes.len())
        .unwrap()
        .into_iter()
        .zip(hashes)
        .map(|(b, h)| b.complete(*h).unwrap())
        .collect();
    drop(m.register_blocks(complete));
}

/// Instance B's leader: its G2, then other instances' G2 through `index`.
fn leader_b(g2: &Arc<BlockManager<G2>>, index: &Arc<CrossInstanceIndex>) -> InstanceLeader {
    InstanceLeader::builder()
        .g2(g2.clone())
        .remote(RemoteSearch {
            index: index.clone(),
            this: B,
            shared_g4: false,
            remote_g2: true,
        })
        .build()
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn b_pulls_a_g2_prefix_over_tcp_and_onboards_it() {
    let runtime = KvbmRuntime::builder()
        .tokio_handle(tokio::runtime::Handle::current())
        .build()
        .unwrap();
    let rt = runtime.handle();
    let bus = Arc::new(InProcessBus::new(64));
    let seq =
        TokenBlockSequence::from_tokens(&(0..32).collect::<Vec<u32>>(), 4, Salt::NONE).unwrap();
    let hashes = seq.hashes();

    // Instance A: 6 blocks in G2, served over TCP, events published.
    let pub_a = EventPublisher::spawn(&rt, A, bus.clone()).unwrap();
    let g2_a = g2_with_sink(pub_a.clone());
    let layout_a =
        Arc::new(PhysicalLayout::allocate_host(geometry(), PinPolicy::Unpinned).unwrap());
    fill(&layout_a, 0xa0);
    let server_a = DataPlaneServer::start(
        DataPlaneConfig::default(),
        A,
        g2_a.clone(),
        layout_a.clone(),
    )
    .await
    .unwrap();

    // Instance B: its own G2 (blocks 0,1 computed locally), G1, the index following the bus.
    let index_b = Arc::new(CrossInstanceIndex::new());
    CrossInstanceIndex::follow(index_b.clone(), &rt, &*bus).unwrap();
    let pub_b = EventPublisher::spawn(&rt, B, bus.clone()).unwrap();
    let g2_b = g2_with_sink(pub_b.clone());
    let g1_b = common::manager::<G1>(&BlockRegistry::new());
    let tm = Arc::new(TransferManager::new().unwrap());
    let g2_h = tm
        .register_layout(PhysicalLayout::allocate_host(geometry(), PinPolicy::Unpinned).unwrap())
        .unwrap();
    let g1_h = tm
        .register_layout(PhysicalLayout::allocate_host(geometry(), PinPolicy::Unpinned).unwrap())
        .unwrap();
    let layout_b = tm.layout(g2_h).unwrap();
    fill(&layout_b, 0xb0);
    let peers = Arc::new(PeerDirectory::new());
    peers.insert(A, server_a.local_addr());
    let client_b = Arc::new(
        DataPlaneClient::new(
            DataPlaneConfig::default(),
            g2_b.clone(),
            layout_b.clone(),
            peers.clone(),
        )
        .unwrap(),
    );
    let leader_b = leader_b(&g2_b, &index_b);

    store(&g2_b, &hashes[..2]);
    store(&g2_a, &hashes[..6]);
    g2_a.flush_events();
    g2_b.flush_events();
    eventually_async("B's index: A holds the 6-block prefix", || {
        index_b.prefix_by_instance(&hashes[..6], Some(B)) == vec![(A, 6)]
    })
    .await;
    assert_eq!(
        index_b.prefix_by_instance(&hashes[..6], Some(B)),
        vec![(A, 6)]
    );

    // Expected bytes: B's own for 0,1; A's for 2..6.
    let mut expected: Vec<Vec<u8>> = g2_b
        .match_blocks(&hashes[..2])
        .iter()
        .map(|b| bytes(&layout_b, b.block_id()))
        .collect();
    expected.extend(
        g2_a.match_blocks(&hashes[2..6])
            .iter()
            .map(|b| bytes(&layout_a, b.block_id())),
    );

    // find_matches: 2 local G2, then 4 in A's G2 (hash 6 is nowhere).
    let matched = leader_b.find_matches(&hashes[..7]);
    assert_eq!(matched.len(), 6);
    assert_eq!(matched.count(kvbm_logical::TierId::G2), 2);
    let remote = matched.remote().unwrap();
    assert_eq!((remote.instance, remote.start), (A, 2));
    assert_eq!(remote.hashes, hashes[2..6].to_vec());
    assert_eq!(matched.hashes(), hashes[..6].to_vec());
    drop(matched);

    // Without a puller the session refuses to prepare and stays Holding.
    let session = leader_b.begin_onboarding(&hashes[..6]);
    assert!(matches!(
        session.prepare(MoversToG2::default()).await,
        Err(SessionError::NoPuller)
    ));
    assert_eq!(session.phase(), Phase::Holding);
    session
        .prepare(MoversToG2 {
            remote_g2: Some(client_b.clone()),
            ..MoversToG2::default()
        })
        .await
        .unwrap();
    assert_eq!(session.phase(), Phase::Staged);
    common::onboard_and_verify(&session, &tm, g2_h, g1_h, &g1_b, &hashes, &expected).await;
    drop(session);
    // The pulled blocks are B's own now: the next search finds all 6 locally.
    let again = leader_b.find_matches(&hashes[..6]);
    assert_eq!(again.count(kvbm_logical::TierId::G2), 6);
    assert!(again.remote().is_none());
    drop(again);
    for _ in 0..200 {
        if server_a.stats().held() == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(server_a.stats().held(), 0);
    assert_eq!(server_a.stats().blocks_served(), 4);
    runtime.shutdown();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pull_answered_by_another_instance_fails_and_registers_nothing() {
    let runtime = KvbmRuntime::builder()
        .tokio_handle(tokio::runtime::Handle::current())
        .build()
        .unwrap();
    let rt = runtime.handle();
    let bus = Arc::new(InProcessBus::new(64));
    let seq =
        TokenBlockSequence::from_tokens(&(0..32).collect::<Vec<u32>>(), 4, Salt::NONE).unwrap();
    let hashes = seq.hashes();
    let pub_a = EventPublisher::spawn(&rt, A, bus.clone()).unwrap();
    let g2_a = g2_with_sink(pub_a);
    let layout_a =
        Arc::new(PhysicalLayout::allocate_host(geometry(), PinPolicy::Unpinned).unwrap());
    fill(&layout_a, 0xa0);
    // The server at the address B believes is A's claims to be instance C: its frames carry
    // C's binding, so none of them passes B's identity check.
    let server_c = DataPlaneServer::start(
        DataPlaneConfig::default(),
        InstanceId(0xc),
        g2_a.clone(),
        layout_a.clone(),
    )
    .await
    .unwrap();
    let index_b = Arc::new(CrossInstanceIndex::new());
    CrossInstanceIndex::follow(index_b.clone(), &rt, &*bus).unwrap();
    let g2_b = common::manager::<G2>(&BlockRegistry::new());
    let layout_b =
        Arc::new(PhysicalLayout::allocate_host(geometry(), PinPolicy::Unpinned).unwrap());
    let peers = Arc::new(PeerDirectory::new());
    peers.insert(A, server_c.local_addr());
    let client_b = Arc::new(
        DataPlaneClient::new(DataPlaneConfig::default(), g2_b.clone(), layout_b, peers).unwrap(),
    );
    let leader_b = leader_b(&g2_b, &index_b);
    store(&g2_a, &hashes[..4]);
    g2_a.flush_events();
    eventually_async("B's index holds A's 4 blocks", || index_b.len() == 4).await;
    let session = leader_b.begin_onboarding(&hashes[..4]);
    assert_eq!(session.prefix_len(), 4);
    let err = session
        .prepare(MoversToG2 {
            remote_g2: Some(client_b),
            ..MoversToG2::default()
        })
        .await
        .unwrap_err();
    let SessionError::Failed(f) = err else {
        panic!("{err}");
    };
    assert_eq!(f.failed_blocks, 4);
    assert!(f.message.contains("serving instance"), "{}", f.message);
    assert_eq!(session.phase(), Phase::Failed);
    assert!(g2_b.match_blocks(&hashes[..1]).is_empty());
    assert_eq!(g2_b.available_blocks(), N);
    runtime.shutdown();
}

/// B pulls A's first four G2 blocks with the data plane scoped by `server_scope` (A) and
/// `client_scope` (B): `Ok` with the blocks staged in B's G2, or the session's failure
/// message (nothing registered in B's G2).
async fn pull_scoped(server_scope: u64, client_scope: u64) -> Result<(), String> {
    let runtime = KvbmRuntime::builder()
        .tokio_handle(tokio::runtime::Handle::current())
        .build()
        .unwrap();
    let rt = runtime.handle();
    let bus = Arc::new(InProcessBus::new(64));
    let seq =
        TokenBlockSequence::from_tokens(&(0..32).collect::<Vec<u32>>(), 4, Salt::NONE).unwrap();
    let hashes = seq.hashes();
    let pub_a = EventPublisher::spawn(&rt, A, bus.clone()).unwrap();
    let g2_a = g2_with_sink(pub_a);
    let layout_a =
        Arc::new(PhysicalLayout::allocate_host(geometry(), PinPolicy::Unpinned).unwrap());
    fill(&layout_a, 0xa0);
    let server_a = DataPlaneServer::start(
        DataPlaneConfig {
            scope: server_scope,
            ..DataPlaneConfig::default()
        },
        A,
        g2_a.clone(),
        layout_a.clone(),
    )
    .await
    .unwrap();
    let index_b = Arc::new(CrossInstanceIndex::new());
    CrossInstanceIndex::follow(index_b.clone(), &rt, &*bus).unwrap();
    let g2_b = common::manager::<G2>(&BlockRegistry::new());
    let layout_b =
        Arc::new(PhysicalLayout::allocate_host(geometry(), PinPolicy::Unpinned).unwrap());
    let peers = Arc::new(PeerDirectory::new());
    peers.insert(A, server_a.local_addr());
    let client_b = Arc::new(
        DataPlaneClient::new(
            DataPlaneConfig {
                scope: client_scope,
                ..DataPlaneConfig::default()
            },
            g2_b.clone(),
            layout_b,
            peers,
        )
        .unwrap(),
    );
    let leader_b = leader_b(&g2_b, &index_b);
    store(&g2_a, &hashes[..4]);
    g2_a.flush_events();
    eventually_async("B's index holds A's 4 blocks", || index_b.len() == 4).await;
    let session = leader_b.begin_onboarding(&hashes[..4]);
    assert_eq!(session.prefix_len(), 4);
    let out = session
        .prepare(MoversToG2 {
            remote_g2: Some(client_b),
            ..MoversToG2::default()
        })
        .await;
    let result = match out {
        Ok(_) => {
            assert_eq!(session.phase(), Phase::Staged);
            assert_eq!(g2_b.match_blocks(&hashes[..4]).len(), 4);
            Ok(())
        }
        Err(SessionError::Failed(f)) => {
            assert_eq!(f.failed_blocks, 4);
            assert_eq!(session.phase(), Phase::Failed);
            assert!(g2_b.match_blocks(&hashes[..1]).is_empty());
            assert_eq!(g2_b.available_blocks(), N);
            Err(f.message)
        }
        Err(e) => panic!("{e}"),
    };
    drop(session);
    runtime.shutdown();
    result
}

/// The data plane folds the model fingerprint (`DataPlaneConfig::scope`) into the geometry
/// value of every request and frame: a client of another fingerprint is refused before any
/// block moves, and registers nothing; the same fingerprint pulls.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pull_across_model_fingerprints_is_refused_and_the_same_fingerprint_pulls() {
    let fp = |model: &str| {
        kvbm_physical::ModelFingerprint::builder()
            .model(model)
            .dtype("auto")
            .kv_layout("NHD")
            .geometry(*geometry().config())
            .parallelism(kvbm_physical::Parallelism::Rank { rank: 0, world: 1 })
            .build()
            .unwrap()
            .short()
    };
    let (x, y) = (fp("model-x"), fp("model-y"));
    pull_scoped(x, x).await.unwrap();
    for (server, client) in [(x, y), (x, 0), (0, y)] {
        let why = pull_scoped(server, client).await.unwrap_err();
        assert!(why.contains("geometry"), "{why}");
    }
}
