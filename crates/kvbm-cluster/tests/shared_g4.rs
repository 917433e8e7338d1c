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
use kvbm_cluster::pubsub::{EventPublisher, InProcessBus, IndexEvents};
use kvbm_engine::InstanceId;
use kvbm_engine::KvbmRuntime;
use kvbm_engine::cross_instance::CrossInstanceIndex;
use kvbm_engine::leader::{InstanceLeader, MoversToG2, Phase, RemoteSearch, SessionError};
use kvbm_logical::{
    BlockManager, BlockRegistry, G1, G2, G4, Salt, SequenceHash, TierId, TokenBlockSequence,
};
use kvbm_offload::{
    ExternalBlock, ObjectMoveExecutor, ObjectPipelineBuilder, S3PresenceChecker, block_identity,
    identity_of, object_key,
};
use kvbm_physical::{
    ObjectConfig, ObjectPutMode, ObjectStorage, PhysicalLayout, PinPolicy, S3Config,
    TransferManager,
};
use object_store::ObjectStoreExt;

#[path = "../../kvbm-engine/tests/common/mod.rs"]
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
            allow_http: false,
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
    kvbm_tests::faults::flip_last_byte(&*raw, &path, 0xff).await;
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
            remote_g2: true,
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
    let movers = || MoversToG2 {
        g4_to_g2: Some(Arc::new(
            common::mover(&tm_b, obj_b_h, g2_h, &g2_b).keyed_source(),
        )),
        ..MoversToG2::default()
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
        .prepare(MoversToG2 {
            g4_to_g2: Some(Arc::new(
                common::mover(&tm_b, obj_c_h, g2_c_h, &g2_c).keyed_source(),
            )),
            ..MoversToG2::default()
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

// --- Security (issue 23, item 6): digests travel, nothing valid is deleted ----------------------

/// A BLAKE3 sequence of 8 blocks (each with its 256-bit digest).
fn digested() -> TokenBlockSequence {
    let seq = TokenBlockSequence::from_tokens_with(
        &(100..132).collect::<Vec<u32>>(),
        4,
        Salt::NONE,
        kvbm_logical::HashAlgorithm::Blake3,
    )
    .unwrap();
    assert!(seq.blocks().iter().all(|b| b.digest().is_some()));
    seq
}

/// Instance A's side: a host layout filled with a pattern, its blocks `0..n` offloaded to the
/// shared bucket *with their digests* (what a BLAKE3 deployment writes). Returns the source
/// layout (the bytes every reader must get).
async fn offload_with_digests(
    storage_a: &Arc<ObjectStorage>,
    seq: &TokenBlockSequence,
    n: usize,
) -> Arc<PhysicalLayout> {
    let tm_a = Arc::new(TransferManager::new().unwrap());
    let src = PhysicalLayout::allocate_host(geometry(), PinPolicy::Unpinned).unwrap();
    fill(&src, 0x5d);
    let src_h = tm_a.register_layout(src).unwrap();
    let obj_a_h = tm_a
        .register_layout(PhysicalLayout::object(geometry(), storage_a.clone()))
        .unwrap();
    let up = ObjectPipelineBuilder::new(storage_a.clone())
        .spawn(ObjectMoveExecutor::<G2>::new(tm_a.clone(), src_h, obj_a_h))
        .unwrap();
    let written: Vec<ExternalBlock> = seq.blocks()[..n]
        .iter()
        .enumerate()
        .map(|(i, b)| ExternalBlock::new(i, b.sequence_hash()).with_digest(b.digest()))
        .collect();
    let r = up
        .enqueue(written, None)
        .await
        .unwrap()
        .wait()
        .await
        .unwrap();
    assert_eq!(r.completed_blocks.len(), n, "{r:?}");
    up.pipeline().shutdown_and_wait().await;
    tm_a.layout(src_h).unwrap()
}

/// Asserts every block `0..n` of `seq` is still stored whole under its digest.
async fn all_present(storage: &ObjectStorage, seq: &TokenBlockSequence, n: usize) {
    for (i, b) in seq.blocks()[..n].iter().enumerate() {
        let h = b.sequence_hash();
        assert_eq!(
            storage
                .probe(&object_key(h), &identity_of(h, b.digest()))
                .await
                .unwrap(),
            kvbm_physical::ObjectPresence::Present,
            "object {i} was deleted"
        );
    }
}

/// A reader (B) with its own G2, G4 bookkeeping and G1 over `storage`, following `index`.
struct Reader {
    leader: InstanceLeader,
    tm: Arc<TransferManager>,
    g2: Arc<BlockManager<G2>>,
    g4: Arc<BlockManager<G4>>,
    g1: Arc<BlockManager<G1>>,
    g2_h: kvbm_physical::LayoutHandle,
    obj_h: kvbm_physical::LayoutHandle,
    g1_h: kvbm_physical::LayoutHandle,
}

impl Reader {
    fn new(storage: Arc<ObjectStorage>, index: Option<Arc<CrossInstanceIndex>>) -> Self {
        let registry = BlockRegistry::new();
        let g2 = manager::<G2>(&registry, None);
        let g4 = manager::<G4>(&registry, None);
        let g1 = manager::<G1>(&BlockRegistry::new(), None);
        let tm = Arc::new(TransferManager::new().unwrap());
        let host = || PhysicalLayout::allocate_host(geometry(), PinPolicy::Unpinned).unwrap();
        let g2_h = tm.register_layout(host()).unwrap();
        let obj_h = tm
            .register_layout(PhysicalLayout::object(geometry(), storage))
            .unwrap();
        let g1_h = tm.register_layout(host()).unwrap();
        let mut b = InstanceLeader::builder().g2(g2.clone()).g4(g4.clone());
        if let Some(index) = index {
            b = b.remote(RemoteSearch {
                index,
                this: B,
                shared_g4: true,
                remote_g2: true,
            });
        }
        Reader {
            leader: b.build().unwrap(),
            tm,
            g2,
            g4,
            g1,
            g2_h,
            obj_h,
            g1_h,
        }
    }

    /// The engine's default G4→G2 mover (kvbm-offload's `BlockMover`, keyed source).
    fn movers(&self) -> MoversToG2 {
        MoversToG2 {
            g4_to_g2: Some(Arc::new(
                common::mover(&self.tm, self.obj_h, self.g2_h, &self.g2).keyed_source(),
            )),
            ..MoversToG2::default()
        }
    }

    /// Stages and onboards `seq`'s blocks `0..n` found in G4: bytes as A wrote them, and
    /// every staged G2 block carries its block's digest.
    async fn onboard(&self, seq: &TokenBlockSequence, n: usize, src: &PhysicalLayout) {
        let hashes = seq.hashes();
        let session = self.leader.begin_onboarding(&hashes[..n]);
        assert_eq!(session.prefix_len(), n);
        session.prepare(self.movers()).await.unwrap();
        assert_eq!(session.phase(), Phase::Staged);
        for (i, b) in session.staged().iter().enumerate() {
            assert_eq!(b.sequence_hash(), hashes[i]);
            assert_eq!(
                b.digest(),
                seq.blocks()[i].digest(),
                "G2 block {i}'s digest"
            );
        }
        let expected: Vec<Vec<u8>> = (0..n).map(|i| bytes(src, i)).collect();
        common::onboard_and_verify(
            &session, &self.tm, self.g2_h, self.g1_h, &self.g1, &hashes, &expected,
        )
        .await;
    }
}

/// B adopts A's BLAKE3 objects by name — some from A's events, some from a forged event (a
/// NATS-only attacker naming hashes under an instance id of its own) — and C adopts them by a
/// presence check: each registers what the object's header says, onboards the bytes
/// verified, and no object is deleted. Before the fix the adopted blocks carried no digest,
/// the read expected the bare hash, and every object was deleted as an identity mismatch.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn security_shared_g4_adopted_by_name_onboards_with_its_digest_nothing_deleted() {
    let Some((cfg, namespace)) = s3_config("security_adopt") else {
        return;
    };
    let runtime = KvbmRuntime::builder()
        .tokio_handle(tokio::runtime::Handle::current())
        .build()
        .unwrap();
    let rt = runtime.handle();
    let bus = Arc::new(InProcessBus::new(64));
    let seq = digested();
    let hashes = seq.hashes();
    let index_b = Arc::new(CrossInstanceIndex::new());
    CrossInstanceIndex::follow(index_b.clone(), &rt, &*bus).unwrap();

    let storage_a = storage(&cfg, &namespace);
    let src = offload_with_digests(&storage_a, &seq, 8).await;
    // A announces 0..4; a forger announces 4..8 under its own id.
    let pub_a = EventPublisher::spawn(&rt, A, bus.clone()).unwrap();
    let g4_a = manager::<G4>(&BlockRegistry::new(), Some(pub_a));
    track(&g4_a, &hashes[..4]);
    g4_a.flush_events();
    let forger = EventPublisher::spawn(&rt, InstanceId(0xf0f0), bus.clone()).unwrap();
    let g4_x = manager::<G4>(&BlockRegistry::new(), Some(forger));
    track(&g4_x, &hashes[4..8]);
    g4_x.flush_events();
    for _ in 0..500 {
        if index_b.len() == 8 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(index_b.len(), 8);

    let storage_b = storage(&cfg, &namespace);
    let b = Reader::new(storage_b.clone(), Some(index_b));
    b.onboard(&seq, 8, &src).await;
    assert_eq!(storage_b.evicted_objects(), 0, "nothing was damaged");
    all_present(&storage_a, &seq, 8).await;

    // C heard no events: its presence check registers each block with its header's digest.
    let storage_c = storage(&cfg, &namespace);
    let c = Reader::new(storage_c.clone(), None);
    let checker = S3PresenceChecker::new(storage_c.clone());
    assert_eq!(
        c.leader
            .adopt_present_g4(&hashes[..8], &checker)
            .await
            .unwrap(),
        8
    );
    for (i, blk) in c.g4.match_blocks(&hashes[..8]).iter().enumerate() {
        assert_eq!(blk.digest(), seq.blocks()[i].digest(), "G4 block {i}");
    }
    c.onboard(&seq, 8, &src).await;
    assert_eq!(storage_c.evicted_objects(), 0);
    all_present(&storage_a, &seq, 8).await;
    // B still serves from its staged copies; the bucket is intact for everyone.
    assert_eq!(b.g2.match_blocks(&hashes[..8]).len(), 8);
    runtime.shutdown();
}

/// An object store in front of the real S3 client whose whole-object reads end early while
/// `cut` is set (a connection dropped mid-body): a transient short read.
#[derive(Debug)]
struct ShortReads {
    inner: Arc<dyn object_store::ObjectStore>,
    cut: std::sync::atomic::AtomicBool,
}

impl std::fmt::Display for ShortReads {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ShortReads")
    }
}

#[async_trait::async_trait]
impl object_store::ObjectStore for ShortReads {
    async fn put_opts(
        &self,
        location: &object_store::path::Path,
        payload: object_store::PutPayload,
        opts: object_store::PutOptions,
    ) -> object_store::Result<object_store::PutResult> {
        self.inner.put_opts(location, payload, opts).await
    }
    async fn put_multipart_opts(
        &self,
        location: &object_store::path::Path,
        opts: object_store::PutMultipartOptions,
    ) -> object_store::Result<Box<dyn object_store::MultipartUpload>> {
        self.inner.put_multipart_opts(location, opts).await
    }
    async fn get_opts(
        &self,
        location: &object_store::path::Path,
        options: object_store::GetOptions,
    ) -> object_store::Result<object_store::GetResult> {
        use futures::StreamExt;
        let whole = options.range.is_none();
        let mut got = self.inner.get_opts(location, options).await?;
        if whole && self.cut.load(std::sync::atomic::Ordering::SeqCst) {
            // The first 200 bytes arrive (the header and a little payload), then the body ends.
            let body = self.inner.get(location).await?.bytes().await?;
            let part = body.slice(..200.min(body.len()));
            got.payload = object_store::GetResultPayload::Stream(
                futures::stream::once(async move { Ok(part) }).boxed(),
            );
        }
        Ok(got)
    }
    fn delete_stream(
        &self,
        locations: futures::stream::BoxStream<
            'static,
            object_store::Result<object_store::path::Path>,
        >,
    ) -> futures::stream::BoxStream<'static, object_store::Result<object_store::path::Path>> {
        self.inner.delete_stream(locations)
    }
    fn list(
        &self,
        prefix: Option<&object_store::path::Path>,
    ) -> futures::stream::BoxStream<'static, object_store::Result<object_store::ObjectMeta>> {
        self.inner.list(prefix)
    }
    async fn list_with_delimiter(
        &self,
        prefix: Option<&object_store::path::Path>,
    ) -> object_store::Result<object_store::ListResult> {
        self.inner.list_with_delimiter(prefix).await
    }
    async fn copy_opts(
        &self,
        from: &object_store::path::Path,
        to: &object_store::path::Path,
        options: object_store::CopyOptions,
    ) -> object_store::Result<()> {
        self.inner.copy_opts(from, to, options).await
    }
}

/// B reads A's objects while its connection to the S3 server drops every body early: the
/// staging fails, nothing is deleted or counted as damaged, and once the connection is whole
/// again the same objects onboard, bytes verified. Before the fix a short read counted as
/// corrupt and deleted every object it touched.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn security_shared_g4_transient_short_read_deletes_nothing() {
    let Some((cfg, namespace)) = s3_config("security_short") else {
        return;
    };
    let runtime = KvbmRuntime::builder()
        .tokio_handle(tokio::runtime::Handle::current())
        .build()
        .unwrap();
    let rt = runtime.handle();
    let bus = Arc::new(InProcessBus::new(64));
    let seq = digested();
    let hashes = seq.hashes();
    let index_b = Arc::new(CrossInstanceIndex::new());
    CrossInstanceIndex::follow(index_b.clone(), &rt, &*bus).unwrap();
    let storage_a = storage(&cfg, &namespace);
    let src = offload_with_digests(&storage_a, &seq, 4).await;
    let pub_a = EventPublisher::spawn(&rt, A, bus.clone()).unwrap();
    let g4_a = manager::<G4>(&BlockRegistry::new(), Some(pub_a));
    track(&g4_a, &hashes[..4]);
    g4_a.flush_events();
    for _ in 0..500 {
        if index_b.len() == 4 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }

    let flaky = Arc::new(ShortReads {
        inner: ObjectStorage::s3_client(&cfg).unwrap(),
        cut: std::sync::atomic::AtomicBool::new(true),
    });
    let storage_b = Arc::new(ObjectStorage::new(
        flaky.clone(),
        ObjectConfig {
            namespace: namespace.clone(),
            ..Default::default()
        },
    ));
    let b = Reader::new(storage_b.clone(), Some(index_b));
    let session = b.leader.begin_onboarding(&hashes[..4]);
    assert_eq!(session.prefix_len(), 4);
    let err = session.prepare(b.movers()).await.unwrap_err();
    let SessionError::Failed(f) = err else {
        panic!("{err}");
    };
    assert_eq!(f.failed_blocks, 4, "{}", f.message);
    drop(session);
    assert!(b.g2.match_blocks(&hashes[..4]).is_empty(), "nothing served");
    assert_eq!(storage_b.evicted_objects(), 0);
    all_present(&storage_a, &seq, 4).await;

    // The connection heals: the same objects onboard.
    flaky.cut.store(false, std::sync::atomic::Ordering::SeqCst);
    b.onboard(&seq, 4, &src).await;
    assert_eq!(storage_b.evicted_objects(), 0);
    all_present(&storage_a, &seq, 4).await;
    runtime.shutdown();
}

/// A really damaged object (one payload byte flipped at rest: a complete read whose checksum
/// differs from its header's) is refused, deleted and counted; its neighbours are untouched.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn security_shared_g4_damaged_object_deleted_and_counted() {
    let Some((cfg, namespace)) = s3_config("security_damaged") else {
        return;
    };
    let runtime = KvbmRuntime::builder()
        .tokio_handle(tokio::runtime::Handle::current())
        .build()
        .unwrap();
    let seq = digested();
    let hashes = seq.hashes();
    let storage_a = storage(&cfg, &namespace);
    let src = offload_with_digests(&storage_a, &seq, 3).await;
    let raw = ObjectStorage::s3_client(&cfg).unwrap();
    let path = storage_a.path(&object_key(hashes[2]));
    kvbm_tests::faults::flip_last_byte(&*raw, &path, 0x01).await;

    let storage_b = storage(&cfg, &namespace);
    let b = Reader::new(storage_b.clone(), None);
    let checker = S3PresenceChecker::new(storage_b.clone());
    // The header is intact, so the presence check adopts all three.
    assert_eq!(
        b.leader
            .adopt_present_g4(&hashes[..3], &checker)
            .await
            .unwrap(),
        3
    );
    let session = b.leader.begin_onboarding(&hashes[2..3]);
    let err = session.prepare(b.movers()).await.unwrap_err();
    let SessionError::Failed(f) = err else {
        panic!("{err}");
    };
    assert!(f.message.contains("checksum"), "{}", f.message);
    drop(session);
    assert!(b.g2.match_blocks(&hashes[2..3]).is_empty(), "never served");
    assert_eq!(storage_b.evicted_objects(), 1);
    let h = hashes[2];
    assert_eq!(
        storage_a
            .probe(&object_key(h), &identity_of(h, seq.blocks()[2].digest()))
            .await
            .unwrap(),
        kvbm_physical::ObjectPresence::Absent,
        "the damaged object is gone"
    );
    all_present(&storage_a, &seq, 2).await;
    b.onboard(&seq, 2, &src).await;
    runtime.shutdown();
}
