//! The way up (issue 9): a G3→G2 onboarding lane on the same P1–P6 machinery, with
//! destinations allocated by the caller before the transfer; the G2→G3→G2 round trip on a real
//! O_DIRECT file with bytes verified; the one block move's typed per-block outcome; the runtime
//! seam for synchronous callers.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::*;
use kvbm_logical::{
    BlockDigest, BlockManager, BlockRegistry, G2, G3, HashAlgorithm, ImmutableBlock, MutableBlock,
    Salt, TierId, TokenBlockSequence,
};
use kvbm_offload::engine::{LaneSpec, OffloadEngine};
use kvbm_offload::handle::OffloadStatus;
use kvbm_offload::mover::CallerAllocated;
use kvbm_offload::settlement::PipelineLane;
use kvbm_offload::source::Precondition;
use kvbm_offload::*;
use kvbm_physical::testing::{bytes, fill};
use kvbm_physical::{PhysicalLayout, PinPolicy, TransferManager};
use parking_lot::Mutex;

/// `n` destinations from `m`.
fn dests(m: &BlockManager<G2>, n: usize) -> Vec<MutableBlock<G2>> {
    m.allocate_blocks(n).expect("destinations")
}

const DST: usize = 64;

#[tokio::test(start_paused = true)]
async fn up_p1_container_is_unit_of_cancellation() {
    let g2 = manager::<G2>(DST, None);
    let exec = TestExecutor::gated();
    let p = spawn_g3_to_g2(exec.clone(), |b| b.batch_size(4).min_batch_size(1));
    let first = p
        .enqueue_into(external(50, 2), dests(&g2, 2), None)
        .await
        .unwrap();
    exec.wait_started(1).await;
    let a = p
        .enqueue_into(external(0, 10), dests(&g2, 10), None)
        .await
        .unwrap();
    let b = p
        .enqueue_into(external(100, 2), dests(&g2, 2), None)
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(1)).await;
    assert_eq!(g2.available_blocks(), DST - 14);
    within(1000, a.cancel()).await.expect("confirmed");
    assert_eq!(
        g2.available_blocks(),
        DST - 4,
        "all ten caller-allocated destinations went back with the container"
    );
    exec.release(100);
    let ra = a.wait().await.unwrap();
    assert_eq!(ra.cancelled_blocks.len(), 10);
    assert!(ra.completed_blocks.is_empty());
    first.wait().await.unwrap();
    assert_eq!(b.wait().await.unwrap().completed_blocks, hashes(100, 2));
    assert_eq!(p.lane(), PipelineLane::G3_TO_G2);
    assert!(p.lane().is_upward());
}

#[tokio::test(start_paused = true)]
async fn up_p2_token_travels_with_container() {
    let g2 = manager::<G2>(DST, None);
    let exec = TestExecutor::gated();
    let p = spawn_g3_to_g2(exec.clone(), |b| b.batch_size(2).min_batch_size(1));
    let first = p
        .enqueue_into(external(0, 2), dests(&g2, 2), None)
        .await
        .unwrap();
    exec.wait_started(1).await;
    let second = p
        .enqueue_into(external(10, 2), dests(&g2, 2), None)
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(1)).await;
    second.token().cancel();
    within(100, second.wait()).await.expect("seen").unwrap();
    assert_eq!(second.status(), OffloadStatus::Cancelled);
    assert_eq!(g2.available_blocks(), DST - 2);
    exec.release(10);
    first.wait().await.unwrap();
    assert_eq!(exec.batches().len(), 1);
}

#[tokio::test(start_paused = true)]
async fn up_p3_upgrade_is_point_of_no_return() {
    let g2 = manager::<G2>(DST, None);
    let exec = TestExecutor::gated();
    let p = spawn_g3_to_g2(exec.clone(), |b| b.min_batch_size(1));
    let h = p
        .enqueue_into(external(0, 4), dests(&g2, 4), None)
        .await
        .unwrap();
    exec.wait_started(1).await;
    let mut confirm = std::pin::pin!(h.cancel().into_future());
    assert!(within(50, &mut confirm).await.is_none());
    assert_eq!(g2.available_blocks(), DST - 4, "the executor holds them");
    exec.release(1);
    within(100, confirm).await.expect("confirmed at the end");
    let r = h.wait().await.unwrap();
    assert_eq!(r.completed_blocks, hashes(0, 4));
    assert_eq!(r.status, OffloadStatus::Complete);
}

#[tokio::test(start_paused = true)]
async fn up_p4_sweep_before_upgrade() {
    let g2 = manager::<G2>(DST, None);
    let exec = TestExecutor::gated();
    let mut cfg = PipelineConfig {
        sweep_on_cancel: false,
        sweep_interval: Duration::from_secs(3600),
        ..Default::default()
    };
    cfg.batch_config.min_batch_size = 1;
    let p = spawn_g3_to_g2(exec.clone(), |b| b.config(cfg));
    let a = p
        .enqueue_into(external(0, 2), dests(&g2, 2), None)
        .await
        .unwrap();
    exec.wait_started(1).await;
    let b = p
        .enqueue_into(external(10, 2), dests(&g2, 2), None)
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(5)).await;
    b.token().cancel();
    exec.release(10);
    a.wait().await.unwrap();
    assert_eq!(b.wait().await.unwrap().cancelled_blocks, hashes(10, 2));
    assert_eq!(exec.batches().len(), 1, "swept before upgrade");
    assert_eq!(g2.available_blocks(), DST);
}

#[tokio::test(start_paused = true)]
async fn up_p5_flat_map_after_upgrade() {
    let g2 = manager::<G2>(DST, None);
    let exec = TestExecutor::open();
    let p = spawn_g3_to_g2(exec.clone(), |b| b.batch_size(64).min_batch_size(9));
    let mut hs = Vec::new();
    for i in 0..3 {
        hs.push(
            p.enqueue_into(external(i * 10, 3), dests(&g2, 3), None)
                .await
                .unwrap(),
        );
    }
    for h in &hs {
        h.wait().await.unwrap();
    }
    let batches = exec.batches();
    assert_eq!(batches.len(), 1);
    let expect: Vec<_> = (0..3).flat_map(|i| hashes(i * 10, 3)).collect();
    assert_eq!(batches[0], expect);
}

#[tokio::test(start_paused = true)]
async fn up_p6_precondition_wait_selects_on_cancel() {
    let g2 = manager::<G2>(DST, None);
    let exec = TestExecutor::open();
    let p = spawn_g3_to_g2(exec.clone(), |b| b.min_batch_size(1));
    let (trigger, event) = Precondition::pair();
    let h = p
        .enqueue_into(external(0, 3), dests(&g2, 3), Some(event))
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(1)).await;
    within(50, h.cancel()).await.expect("interrupts the wait");
    assert_eq!(h.wait().await.unwrap().cancelled_blocks, hashes(0, 3));
    assert_eq!(g2.available_blocks(), DST);
    trigger.complete();
    tokio::time::sleep(Duration::from_millis(20)).await;
    assert!(exec.batches().is_empty());
}

#[tokio::test(start_paused = true)]
async fn up_mismatched_destinations_are_refused() {
    let g2 = manager::<G2>(DST, None);
    let p = spawn_g3_to_g2(TestExecutor::open(), |b| b);
    let err = p
        .enqueue_into(external(0, 3), dests(&g2, 2), None)
        .await
        .unwrap_err();
    assert_eq!(
        err,
        OffloadError::Mismatched {
            sources: 3,
            destinations: 2
        }
    );
    match p.try_enqueue_into(external(0, 3), dests(&g2, 1), None) {
        Err(EnqueueError::Mismatched(r)) => assert_eq!(r.destinations.len(), 1),
        other => panic!("{other:?}"),
    }
}

#[test]
fn builder_refuses_a_lane_that_is_not_its_pair() {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let err = PipelineBuilder::<G3, G2>::new()
        .lane(PipelineLane::G2_TO_G3)
        .build()
        .spawn_on(rt.handle(), TestExecutor::open())
        .unwrap_err();
    assert_eq!(
        err,
        OffloadError::LaneMismatch {
            requested: PipelineLane::G2_TO_G3,
            pipeline: PipelineLane::G3_TO_G2
        }
    );
}

#[test]
fn pipelines_serve_synchronous_callers_through_a_runtime_handle() {
    // No runtime on this thread: spawn refuses (no panic); spawn_on a caller-owned runtime,
    // enqueue_blocking and wait_blocking work from plain threads.
    assert_eq!(
        PipelineBuilder::<G3, G2>::new()
            .build()
            .spawn(TestExecutor::open())
            .unwrap_err(),
        OffloadError::NoRuntime
    );
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let exec = TestExecutor::open();
    let p = PipelineBuilder::<G3, G2>::new()
        .min_batch_size(1)
        .build()
        .spawn_on(rt.handle(), exec.clone())
        .unwrap();
    let h = p.enqueue_blocking(external(0, 4), None).unwrap();
    let r = h.wait_blocking().unwrap();
    assert_eq!(r.completed_blocks, hashes(0, 4));
    let from_thread = std::thread::scope(|s| {
        s.spawn(|| {
            p.enqueue_blocking(external(10, 2), None)
                .unwrap()
                .wait_blocking()
                .unwrap()
        })
        .join()
        .unwrap()
    });
    assert_eq!(from_thread.completed_blocks, hashes(10, 2));
    drop(p);
}

fn zero(layout: &PhysicalLayout, b: usize) {
    let c = *layout.layout().config();
    for (addr, len) in layout.block_addrs(b, 0..c.num_layers) {
        // SAFETY: as in `fill`; the slot is owned by a `MutableBlock` of this test.
        unsafe { std::ptr::write_bytes(addr as *mut u8, 0, len) };
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn g2_g3_g2_round_trip_on_o_direct_through_the_upward_lane() {
    let dir = scratch();
    let n = 8;
    let geometry = || common::geometry(n, 2, 64);
    let registry = BlockRegistry::new();
    let g2 = manager::<G2>(n, Some(&registry));
    let g3 = Arc::new(manager::<G3>(n, Some(&registry)));
    // The onboarding destination: a second, empty G2 (its own registry and host memory), so
    // the bytes that arrive can only have come from the disk.
    let g2_back = Arc::new(manager::<G2>(n, None));
    let tm = Arc::new(TransferManager::new().unwrap());
    let host = PhysicalLayout::allocate_host(geometry(), PinPolicy::Unpinned).unwrap();
    fill(&host, 9);
    let g2_h = tm.register_layout(host).unwrap();
    let g3_h = disk_layout(&tm, geometry(), &dir.path().join("g3.bin"));
    let back_h = host_layout(&tm, geometry(), PinPolicy::Unpinned);

    let down = PipelineBuilder::<G2, G3>::new()
        .build()
        .spawn(BlockMoveExecutor::<G2, G3>::from_mover(
            BlockMover::from_layout(
                g2_h,
                &BoundTier::new(tm.clone(), g3_h, g3.clone()).expect("bound G3"),
            )
            .expect("G2→G3 mover"),
        ))
        .unwrap();
    let arrived: Arc<Mutex<Vec<ImmutableBlock<G2>>>> = Arc::default();
    let sink_arrived = arrived.clone();
    let up = PipelineBuilder::<G3, G2>::new()
        .caller_allocated()
        .min_batch_size(1)
        .build()
        .spawn_with_sink(
            CallerAllocated::new(
                BlockMover::from_layout(
                    g3_h,
                    &BoundTier::new(tm.clone(), back_h, g2_back.clone()).unwrap(),
                )
                .unwrap(),
            ),
            Some(Arc::new(move |blocks: Vec<ImmutableBlock<G2>>| {
                sink_arrived.lock().extend(blocks)
            })),
        )
        .unwrap();

    let blocks = registered(&g2, 0, n as u32);
    let r = down
        .enqueue(blocks.clone(), None)
        .await
        .unwrap()
        .wait()
        .await
        .unwrap();
    assert_eq!(r.completed_blocks.len(), n, "{r:?}");
    for i in 0..n as u32 {
        assert!(registry.is_present(hash(i), TierId::G3));
    }

    // Onboard: sources are the G3 blocks, destinations allocated by the caller beforehand.
    let on_g3 = g3.match_blocks(&hashes(0, n as u32));
    assert_eq!(on_g3.len(), n);
    let destinations = g2_back.allocate_blocks(n).unwrap();
    let dst_ids: Vec<usize> = destinations.iter().map(|b| b.block_id()).collect();
    let r = up
        .enqueue_into(on_g3, destinations, None)
        .await
        .unwrap()
        .wait()
        .await
        .unwrap();
    assert_eq!(r.status, OffloadStatus::Complete, "{r:?}");
    assert_eq!(r.completed_blocks.len(), n);

    // Per-block outcome: each registered ImmutableBlock<G2> sits in the slot the caller chose
    // and holds exactly the bytes the source G2 block had.
    let arrived = std::mem::take(&mut *arrived.lock());
    assert_eq!(arrived.len(), n);
    let src_layout = tm.layout(g2_h).unwrap();
    let back_layout = tm.layout(back_h).unwrap();
    for b in &arrived {
        assert!(dst_ids.contains(&b.block_id()));
        let src = blocks
            .iter()
            .find(|s| s.sequence_hash() == b.sequence_hash())
            .expect("a source with this hash");
        assert_eq!(
            bytes(&src_layout, src.block_id()),
            bytes(&back_layout, b.block_id()),
            "block {:?}",
            b.sequence_hash()
        );
    }
    assert_eq!(g2_back.match_blocks(&hashes(0, n as u32)).len(), n);
    down.shutdown_and_wait().await;
    up.shutdown_and_wait().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn block_mover_reports_typed_failure_and_returns_the_destination() {
    // A G3 slot never written holds no block: the move fails NotFound, the caller-allocated
    // destination goes back to its pool, nothing is registered.
    let dir = scratch();
    let n = 4;
    let geometry = || common::geometry(n, 2, 64);
    let g2 = Arc::new(manager::<G2>(n, None));
    let tm = Arc::new(TransferManager::new().unwrap());
    let g3_h = disk_layout(&tm, geometry(), &dir.path().join("g3.bin"));
    let g2_h = host_layout(&tm, geometry(), PinPolicy::Unpinned);
    let mover = BlockMover::<G3, G2>::from_layout(
        g3_h,
        &BoundTier::new(tm.clone(), g2_h, g2.clone()).unwrap(),
    )
    .unwrap();
    let out = mover
        .move_blocks(
            &[(1, hash(1)), (2, hash(2))],
            g2.allocate_blocks(2).unwrap(),
        )
        .await;
    assert_eq!(out.len(), 2);
    for o in &out {
        let f = o.as_ref().unwrap_err();
        assert_eq!(f.kind, BlockFailureKind::NotFound, "{f}");
    }
    drop(out);
    assert_eq!(g2.available_blocks(), n, "the destinations went back");
    assert!(
        g2.match_blocks(&hashes(1, 2)).is_empty(),
        "nothing registered"
    );
    // Mismatched lengths fail every block without moving anything.
    let out = mover
        .move_blocks(&[(1, hash(1))], g2.allocate_blocks(2).unwrap())
        .await;
    assert!(out[0].is_err());
    assert_eq!(g2.available_blocks(), n);
}

#[test]
fn engine_built_from_a_list_of_lanes_moves_blocks_both_ways() {
    // Built and driven from a plain thread on a caller-owned runtime: G2→G3 down (executor
    // allocates), G3→G2 up (caller allocates), on a real O_DIRECT file.
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let dir = scratch();
    let n = 4;
    let geometry = || common::geometry(n, 2, 64);
    let registry = BlockRegistry::new();
    let g2 = Arc::new(manager::<G2>(2 * n, Some(&registry)));
    let g3 = Arc::new(manager::<G3>(n, Some(&registry)));
    let tm = Arc::new(TransferManager::new().unwrap());
    let host =
        PhysicalLayout::allocate_host(common::geometry(2 * n, 2, 64), PinPolicy::Unpinned).unwrap();
    fill(&host, 3);
    let g2_h = tm.register_layout(host).unwrap();
    let g3_h = disk_layout(&tm, geometry(), &dir.path().join("g3.bin"));
    let engine = OffloadEngine::builder(registry.clone())
        .runtime(rt.handle().clone())
        .with_transfer_manager(tm.clone())
        .tier(BoundTier::new(tm.clone(), g2_h, g2.clone()).unwrap())
        .tier(BoundTier::new(tm.clone(), g3_h, g3.clone()).unwrap())
        .lane(LaneSpec::over_tiers(
            PipelineBuilder::<G2, G3>::new().min_batch_size(1).build(),
        ))
        .lane(LaneSpec::onboarding(
            PipelineBuilder::<G3, G2>::new()
                .caller_allocated()
                .min_batch_size(1)
                .build(),
        ))
        .build()
        .unwrap();
    assert_eq!(
        engine.lanes(),
        vec![PipelineLane::G2_TO_G3, PipelineLane::G3_TO_G2]
    );
    // Source blocks in G2 slots 0..n.
    let blocks = registered(&*g2, 0, n as u32);
    let src_bytes: Vec<Vec<u8>> = {
        let l = tm.layout(g2_h).unwrap();
        blocks.iter().map(|b| bytes(&l, b.block_id())).collect()
    };
    let r = rt
        .block_on(engine.enqueue::<G2>(PipelineLane::G2_TO_G3, blocks.clone(), None))
        .unwrap()
        .wait_blocking()
        .unwrap();
    assert_eq!(r.completed_blocks.len(), n, "{r:?}");
    // Evict the G2 copies: drop them, then take every free slot so they are reused.
    drop(blocks);
    let hog = g2.allocate_blocks(2 * n).unwrap();
    assert!(
        g2.match_blocks(&hashes(0, n as u32)).is_empty(),
        "evicted from G2"
    );
    // Zero the host memory of the slots we will onboard into, then hand n of them back as
    // caller-allocated destinations.
    let mut hog = hog;
    let destinations: Vec<MutableBlock<G2>> = hog.drain(..n).collect();
    drop(hog);
    {
        let l = tm.layout(g2_h).unwrap();
        for d in &destinations {
            zero(&l, d.block_id());
        }
    }
    let on_g3 = g3.match_blocks(&hashes(0, n as u32));
    let r = rt
        .block_on(engine.enqueue_into::<G3, G2>(PipelineLane::G3_TO_G2, on_g3, destinations, None))
        .unwrap()
        .wait_blocking()
        .unwrap();
    assert_eq!(r.status, OffloadStatus::Complete, "{r:?}");
    let back = g2.match_blocks(&hashes(0, n as u32));
    assert_eq!(back.len(), n, "registered in G2 again");
    let l = tm.layout(g2_h).unwrap();
    for (b, expect) in back.iter().zip(&src_bytes) {
        assert_ne!(expect.iter().filter(|x| **x != 0).count(), 0);
        assert_eq!(&bytes(&l, b.block_id()), expect, "came back from the disk");
    }
    // The wrong kind of enqueue for a lane is refused, not mis-routed.
    assert!(matches!(
        rt.block_on(engine.enqueue::<G3>(PipelineLane::G3_TO_G2, external(0, 1), None)),
        Err(OffloadError::NoPipeline(PipelineLane::G3_TO_G2))
    ));
    drop(back);
    rt.block_on(engine.shutdown());
}

#[test]
fn engine_refuses_duplicate_lanes_and_broken_chains() {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let spec = || PipelineBuilder::<G3, G2>::new().build();
    let err = OffloadEngine::builder(BlockRegistry::new())
        .runtime(rt.handle().clone())
        .lane(LaneSpec::with_executor(spec(), TestExecutor::open()))
        .lane(LaneSpec::with_executor(spec(), TestExecutor::open()))
        .build()
        .unwrap_err();
    assert_eq!(err, OffloadError::DuplicateLane(PipelineLane::G3_TO_G2));
    let err = OffloadEngine::builder(BlockRegistry::new())
        .runtime(rt.handle().clone())
        .lane(LaneSpec::with_executor(spec(), TestExecutor::open()))
        .chain(PipelineLane::G3_TO_G2, PipelineLane::G2_TO_G3)
        .build()
        .unwrap_err();
    assert!(matches!(err, OffloadError::InvalidConfig(_)), "{err:?}");
    let err = OffloadEngine::builder(BlockRegistry::new())
        .runtime(rt.handle().clone())
        .lane(LaneSpec::over_tiers(
            PipelineBuilder::<G3, G2>::new().build(),
        ))
        .build()
        .unwrap_err();
    assert_eq!(err, OffloadError::Missing("transfer manager"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn g2_to_g1_onboarding_lane_moves_bytes_into_caller_allocated_g1_blocks() {
    let n = 4;
    let geometry = || common::geometry(n, 2, 64);
    let tm = Arc::new(TransferManager::new().unwrap());
    let host = PhysicalLayout::allocate_host(geometry(), PinPolicy::Unpinned).unwrap();
    fill(&host, 0x33);
    let g2_h = tm.register_layout(host).unwrap();
    let g1_h = tm
        .register_layout(PhysicalLayout::allocate_device(geometry(), 0).unwrap())
        .unwrap();
    let g1 = Arc::new(manager::<kvbm_logical::G1>(n, None));
    let up = PipelineBuilder::<G2, kvbm_logical::G1>::new()
        .caller_allocated()
        .min_batch_size(1)
        .build()
        .spawn(CallerAllocated::new(
            BlockMover::from_layout(g2_h, &BoundTier::new(tm.clone(), g1_h, g1.clone()).unwrap())
                .unwrap(),
        ))
        .unwrap();
    assert_eq!(up.lane(), PipelineLane::G2_TO_G1);
    let g2 = manager::<G2>(n, None);
    let sources = registered(&g2, 0, n as u32);
    let destinations = g1.allocate_blocks(n).unwrap();
    let r = up
        .enqueue_into(sources.clone(), destinations, None)
        .await
        .unwrap()
        .wait()
        .await
        .unwrap();
    assert_eq!(r.status, OffloadStatus::Complete, "{r:?}");
    let on_g1 = g1.match_blocks(&hashes(0, n as u32));
    assert_eq!(on_g1.len(), n);
    let (src, dst) = (tm.layout(g2_h).unwrap(), tm.layout(g1_h).unwrap());
    for (s, d) in sources.iter().zip(&on_g1) {
        assert_eq!(bytes(&src, s.block_id()), bytes(&dst, d.block_id()));
    }
    up.shutdown_and_wait().await;
}

/// Two blocks of BLAKE3 sequences that share one sequence hash (a 64-bit chain collision,
/// constructed by giving tenant B tenant A's hash) but have different digests.
fn colliding_blocks() -> (kvbm_logical::SequenceHash, BlockDigest, BlockDigest) {
    let block = |salt: &str, t: u32| {
        let s = TokenBlockSequence::from_tokens_with(
            &[t, t + 1, t + 2, t + 3],
            4,
            Salt::new(salt),
            HashAlgorithm::Blake3,
        )
        .unwrap();
        (
            s.blocks()[0].sequence_hash(),
            s.blocks()[0].digest().unwrap(),
        )
    };
    let (h, da) = block("tenant-a", 1);
    let (_, db) = block("tenant-b", 900);
    assert_ne!(da, db);
    (h, da, db)
}

/// Issue 10 item 4: G3 binds a block's full 256-bit BLAKE3 digest as its identity, not the
/// 64-bit chain value its sequence hash packs. Tenant A's block goes G2→G3 through the one move
/// (bound tiers) and reads back verified; tenant B asking for the same sequence hash with its own
/// digest is refused as an identity mismatch and gets nothing registered. With the hash as the
/// identity (today's code), B was served A's bytes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fail_closed_g3_identity_is_the_full_digest() {
    let dir = scratch();
    let n = 4;
    let geometry = || common::geometry(n, 2, 64);
    let tm = Arc::new(TransferManager::new().unwrap());
    let host = PhysicalLayout::allocate_host(geometry(), PinPolicy::Unpinned).unwrap();
    fill(&host, 0x21);
    let g2 = Arc::new(manager::<G2>(n, None));
    let g3 = Arc::new(manager::<G3>(n, None));
    let g2b = BoundTier::new(tm.clone(), tm.register_layout(host).unwrap(), g2.clone()).unwrap();
    let g3_h = disk_layout(&tm, geometry(), &dir.path().join("g3.bin"));
    let g3b = BoundTier::new(tm.clone(), g3_h, g3.clone()).unwrap();
    let (h, da, db) = colliding_blocks();

    let a_g2 = g2.register_blocks(vec![
        g2b.allocate(1)
            .unwrap()
            .pop()
            .unwrap()
            .complete_with_digest(h, Some(da))
            .unwrap(),
    ]);
    let down = BlockMover::new(&g2b, &g3b).unwrap();
    let on_g3: Vec<ImmutableBlock<G3>> = down
        .move_from(&a_g2, g3b.allocate(1).unwrap())
        .await
        .into_iter()
        .map(|r| r.expect("A offloaded"))
        .collect();
    assert_eq!(
        on_g3[0].digest(),
        Some(da),
        "the digest travels with the block"
    );
    let slot = on_g3[0].block_id();

    let up = BlockMover::new(&g3b, &g2b).unwrap();
    // A's own read verifies.
    let back = up.move_from(&on_g3, g2b.allocate(1).unwrap()).await;
    assert_eq!(
        back[0].as_ref().expect("A reads its block").digest(),
        Some(da)
    );
    drop(back);
    let before = g2.pool_counts();

    // B: same sequence hash, another digest.
    let b = MoveSource {
        block_id: slot,
        sequence_hash: h,
        digest: Some(db),
        registered_digest: None,
    };
    let out = up.move_blocks(&[b], g2b.allocate(1).unwrap()).await;
    let err = out[0]
        .as_ref()
        .expect_err("a colliding hash must not be served");
    assert_eq!(err.kind, BlockFailureKind::IdentityMismatch, "{err}");
    // The hash alone (the identity today's code bound) is refused as well.
    let out = up.move_blocks(&[(slot, h)], g2b.allocate(1).unwrap()).await;
    let err = out[0].as_ref().expect_err("hash-only identity refused");
    assert_eq!(err.kind, BlockFailureKind::IdentityMismatch, "{err}");
    assert_eq!(g2.pool_counts(), before, "nothing registered for B");
}

/// A manager that already holds a hash under another digest (duplication `reject`) hands back
/// its own block: the move reports an identity mismatch instead of passing it off as B's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fail_closed_destination_holding_another_digest_is_a_mismatch() {
    let n = 4;
    let geometry = || common::geometry(n, 2, 64);
    let tm = Arc::new(TransferManager::new().unwrap());
    let src = PhysicalLayout::allocate_host(geometry(), PinPolicy::Unpinned).unwrap();
    fill(&src, 0x44);
    let src_h = tm.register_layout(src).unwrap();
    let g2 = Arc::new(
        BlockManager::<G2>::builder()
            .block_count(n)
            .block_size(4)
            .duplication_policy(kvbm_logical::DuplicationPolicy::Reject)
            .build()
            .unwrap(),
    );
    let g2b = BoundTier::new(
        tm.clone(),
        host_layout(&tm, geometry(), PinPolicy::Unpinned),
        g2.clone(),
    )
    .unwrap();
    let (h, da, db) = colliding_blocks();
    let _held = g2.register_blocks(vec![
        g2b.allocate(1)
            .unwrap()
            .pop()
            .unwrap()
            .complete_with_digest(h, Some(da))
            .unwrap(),
    ]);
    let mover = BlockMover::<kvbm_logical::G1, G2>::from_layout(src_h, &g2b).unwrap();
    let out = mover
        .move_blocks(&[(0, h, Some(db))], g2b.allocate(1).unwrap())
        .await;
    let err = out[0].as_ref().expect_err("another block's registration");
    assert_eq!(err.kind, BlockFailureKind::IdentityMismatch, "{err}");
    // Same digest: the existing block is the one asked for.
    let out = mover
        .move_blocks(&[(0, h, Some(da))], g2b.allocate(1).unwrap())
        .await;
    assert!(out[0].is_ok());
}

#[test]
fn external_mover_reads_a_bound_tier_into_caller_slots_from_a_sync_caller() {
    // G2 (host) → G3 (O_DIRECT file) through BlockMover, then G3 → a host layout the caller
    // manages through ExternalMover, polled from a plain thread with no runtime: bytes verified,
    // and a read expecting another identity is a typed IdentityMismatch.
    let dir = scratch();
    let n = 4;
    let geometry = || common::geometry(n, 2, 64);
    let g2 = Arc::new(manager::<G2>(n, None));
    let g3 = Arc::new(manager::<G3>(n, None));
    let tm = Arc::new(TransferManager::new().unwrap());
    let host = PhysicalLayout::allocate_host(geometry(), PinPolicy::Unpinned).unwrap();
    fill(&host, 5);
    let g2_h = tm.register_layout(host).unwrap();
    let g3_h = disk_layout(&tm, geometry(), &dir.path().join("g3.bin"));
    let out_h = host_layout(&tm, geometry(), PinPolicy::Unpinned);
    let g2b = BoundTier::new(tm.clone(), g2_h, g2.clone()).unwrap();
    let g3b = BoundTier::new(tm.clone(), g3_h, g3.clone()).unwrap();
    let sources = registered(&g2, 0, 2);
    let down = BlockMover::new(&g2b, &g3b).unwrap();
    let stored: Vec<ImmutableBlock<G3>> =
        futures::executor::block_on(down.move_from(&sources, g3.allocate_blocks(2).unwrap()))
            .into_iter()
            .map(|r| r.expect("stored"))
            .collect();
    let up = ExternalMover::new(&g3b, out_h).unwrap();
    // SAFETY: `out_h` is this test's layout; nothing else touches slots 3 and 1.
    let out = futures::executor::block_on(unsafe { up.move_from(stored.clone(), &[3, 1]) });
    assert!(out.iter().all(|r| r.is_ok()), "{out:?}");
    let src = tm.layout(g2_h).unwrap();
    let dst = tm.layout(out_h).unwrap();
    assert_eq!(bytes(&dst, 3), bytes(&src, sources[0].block_id()));
    assert_eq!(bytes(&dst, 1), bytes(&src, sources[1].block_id()));
    // Expecting block 1's identity from block 0's slot: refused, typed.
    let wrong = MoveSource {
        block_id: stored[0].block_id(),
        sequence_hash: stored[1].sequence_hash(),
        digest: None,
        registered_digest: None,
    };
    // SAFETY: as above, slot 0.
    let out = futures::executor::block_on(unsafe { up.move_blocks(&[wrong], &[0]) });
    assert_eq!(
        out[0].as_ref().unwrap_err().kind,
        BlockFailureKind::IdentityMismatch
    );
    // A layout of another transfer manager, or one no longer registered, is refused up front.
    let other = TransferManager::new().unwrap();
    let foreign = host_layout(&other, geometry(), PinPolicy::Unpinned);
    assert!(matches!(
        ExternalMover::new(&g3b, foreign),
        Err(OffloadError::Setup(_))
    ));
    let gone = host_layout(&tm, geometry(), PinPolicy::Unpinned);
    tm.unregister_layout(gone).unwrap();
    assert!(matches!(
        ExternalMover::new(&g3b, gone),
        Err(OffloadError::Setup(_))
    ));
}

/// `ExternalMover` between caller-managed slots: a layer range of identified blocks (layer-wise
/// onboarding: only those layers arrive, nothing is registered), anonymous slots between memory
/// layouts (vLLM's worker; a transfer that cannot start is returned, not folded), both inline
/// too; each refusal typed.
#[test]
fn external_mover_copies_layers_and_anonymous_slots_between_caller_slots() {
    use futures::FutureExt;
    use futures::executor::block_on;
    let n = 4;
    let geometry = || common::geometry(n, 2, 64);
    let tm = Arc::new(TransferManager::new().unwrap());
    let src_layout = PhysicalLayout::allocate_host(geometry(), PinPolicy::Unpinned).unwrap();
    fill(&src_layout, 9);
    let src_h = tm.register_layout(src_layout).unwrap();
    let dst_h = host_layout(&tm, geometry(), PinPolicy::Unpinned);
    let (src, dst) = (tm.layout(src_h).unwrap(), tm.layout(dst_h).unwrap());
    let layer = |l: &PhysicalLayout, b: usize, k: usize| -> Vec<u8> {
        let (addr, len) = l.block_addrs(b, k..k + 1)[0];
        // SAFETY: test-owned host layout; no transfer targets it while it is read.
        unsafe { std::slice::from_raw_parts(addr as *const u8, len).to_vec() }
    };
    let g2 = manager::<G2>(n, None);
    let sources = registered(&g2, 0, 2);
    let ids: Vec<MoveSource> = sources.iter().map(MoveSource::of).collect();
    let m = ExternalMover::<G2>::from_layout(&tm, src_h, dst_h).unwrap();

    // Layer 1 of blocks 0, 1 into slots 3, 2: that layer arrives, layer 0 stays zero.
    zero(&dst, 2);
    zero(&dst, 3);
    // SAFETY: `dst_h` is this test's layout; nothing else touches slots 3 and 2.
    let out = block_on(unsafe { m.move_layers(&ids, &[3, 2], 1..2) });
    assert!(out.iter().all(|r| r.is_ok()), "{out:?}");
    for (s, d) in [(sources[0].block_id(), 3), (sources[1].block_id(), 2)] {
        assert_eq!(layer(&dst, d, 1), layer(&src, s, 1), "layer 1 of slot {d}");
        assert!(
            layer(&dst, d, 0).iter().all(|&x| x == 0),
            "layer 0 of slot {d}"
        );
    }
    // An empty or out-of-range layer range, or a length mismatch, fails every block.
    for bad in [1..1, 1..3] {
        // SAFETY: as above.
        let out = block_on(unsafe { m.move_layers(&ids, &[3, 2], bad.clone()) });
        assert!(out.iter().all(|r| r.is_err()), "{bad:?}: {out:?}");
    }
    // SAFETY: as above.
    let out = block_on(unsafe { m.move_layers(&ids, &[3], 0..1) });
    assert!(
        out.iter()
            .all(|r| r.as_ref().unwrap_err().kind == BlockFailureKind::Transfer)
    );

    // Anonymous slots, inline: copied when the call returns.
    let inline = ExternalMover::<G2>::from_layout(&tm, src_h, dst_h)
        .unwrap()
        .inline()
        .unwrap();
    // SAFETY: as above, slots 0 and 1.
    let moving = unsafe { inline.copy_slots(&[3, 2], &[0, 1]) }.expect("started");
    let out = moving
        .now_or_never()
        .expect("an inline copy is done at the call");
    assert!(out.iter().all(|r| r.is_ok()), "{out:?}");
    assert_eq!(bytes(&dst, 0), bytes(&src, 3));
    assert_eq!(bytes(&dst, 1), bytes(&src, 2));
    // Not started, typed: lists of different lengths, a slot out of range.
    // SAFETY: as above (nothing starts).
    let e = unsafe { m.copy_slots(&[0, 1], &[0]) }
        .err()
        .expect("refused");
    assert_eq!(e.kind, BlockFailureKind::Transfer, "{e}");
    // SAFETY: as above (nothing starts).
    let e = unsafe { m.copy_slots(&[0], &[n]) }.err().expect("refused");
    assert!(
        matches!(
            e.physical_error(),
            Some(kvbm_physical::PhysicalError::BlockOutOfRange { .. })
        ),
        "{e}"
    );

    // A disk side binds an identity in its header: no anonymous copy there, and no inline.
    let dir = scratch();
    let disk_h = disk_layout(&tm, geometry(), &dir.path().join("g3.bin"));
    let to_disk = ExternalMover::<G2>::from_layout(&tm, src_h, disk_h).unwrap();
    // SAFETY: nothing starts.
    let e = unsafe { to_disk.copy_slots(&[0], &[0]) }
        .err()
        .expect("refused");
    assert_eq!(e.kind, BlockFailureKind::Refused, "{e}");
    assert!(matches!(
        to_disk.inline(),
        Err(OffloadError::InvalidConfig(_))
    ));
    // A layout this manager does not know is refused up front.
    let other = TransferManager::new().unwrap();
    let foreign = host_layout(&other, geometry(), PinPolicy::Unpinned);
    assert!(matches!(
        ExternalMover::<G2>::from_layout(&tm, src_h, foreign),
        Err(OffloadError::Setup(_))
    ));
}

/// The inline mover copies host to host on the caller's thread (its future is ready at once),
/// and an arrival check sees each destination's bytes before registration: a refused block is
/// never registered and its slot goes back to the pool.
#[test]
fn inline_mover_with_an_arrival_check_registers_only_accepted_blocks() {
    use futures::FutureExt;
    let n = 4;
    let geometry = || common::geometry(n, 2, 64);
    let tm = Arc::new(TransferManager::new().unwrap());
    let src_layout = PhysicalLayout::allocate_host(geometry(), PinPolicy::Unpinned).unwrap();
    fill(&src_layout, 0x5a);
    let g2_h = tm.register_layout(src_layout).unwrap();
    let g1_h = host_layout(&tm, geometry(), PinPolicy::Unpinned);
    let g1 = Arc::new(manager::<kvbm_logical::G1>(n, None));
    let g2 = manager::<G2>(n, None);
    let sources = registered(&g2, 0, n as u32);
    let src_bytes = tm.layout(g2_h).unwrap();
    let expected: Vec<Vec<u8>> = sources
        .iter()
        .map(|s| bytes(&src_bytes, s.block_id()))
        .collect();
    // Accept a block only when its bytes are its source's (as read here) and it is not the
    // third one; record every call.
    let seen = Arc::new(Mutex::new(Vec::new()));
    let (seen2, refused) = (seen.clone(), hash(2));
    let check: ArrivalCheck = Arc::new(move |src: &MoveSource, regions: &[&[u8]]| {
        let got: Vec<u8> = regions.concat();
        seen2.lock().push((src.sequence_hash, got));
        if src.sequence_hash == refused {
            Err(BlockFailure::new(
                BlockFailureKind::ChecksumMismatch,
                "refused by the check",
            ))
        } else {
            Ok(())
        }
    });
    let mover =
        BlockMover::from_layout(g2_h, &BoundTier::new(tm.clone(), g1_h, g1.clone()).unwrap())
            .unwrap()
            .inline()
            .unwrap()
            .with_arrival_check(check)
            .unwrap();
    let out = mover
        .move_from(&sources, g1.allocate_blocks(n).unwrap())
        .now_or_never()
        .expect("an inline move is done when it returns");
    let kinds: Vec<Option<BlockFailureKind>> = out
        .iter()
        .map(|o| o.as_ref().err().map(|f| f.kind))
        .collect();
    assert_eq!(
        kinds,
        [None, None, Some(BlockFailureKind::ChecksumMismatch), None]
    );
    // The check saw every block's arrived bytes, equal to its source's.
    let seen = seen.lock();
    assert_eq!(seen.len(), n);
    for (i, (h, got)) in seen.iter().enumerate() {
        assert_eq!(*h, hash(i as u32));
        assert_eq!(got, &expected[i], "block {i}");
    }
    drop(out);
    assert!(
        g1.match_blocks(&[hash(2)]).is_empty(),
        "the refused block is not registered"
    );
    assert_eq!(g1.match_blocks(&hashes(0, 2)).len(), 2);
    assert_eq!(
        g1.available_blocks(),
        n,
        "every slot back in a pool once nothing holds them"
    );

    // A device destination (a layout that is not host memory) can be neither inline nor checked.
    let dev = tm
        .register_layout(PhysicalLayout::allocate_device(geometry(), 0).unwrap())
        .unwrap();
    let to_dev = || {
        BlockMover::<G2, kvbm_logical::G1>::from_layout(
            g2_h,
            &BoundTier::new(tm.clone(), dev, g1.clone()).unwrap(),
        )
        .unwrap()
    };
    assert!(matches!(
        to_dev().inline(),
        Err(OffloadError::InvalidConfig(_))
    ));
    let any: ArrivalCheck = Arc::new(|_: &MoveSource, _: &[&[u8]]| Ok(()));
    assert!(matches!(
        to_dev().with_arrival_check(any),
        Err(OffloadError::InvalidConfig(_))
    ));
}

/// A lane's executor waits for destination room as configured (`room_patience_ms`): with
/// patience it gets its blocks once the tier frees slots, counting each retry; without, or for
/// a batch larger than the whole tier, it fails `NoSpace` at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn block_transfer_executor_waits_for_room_as_configured() {
    let n = 4;
    let tm = Arc::new(TransferManager::new().unwrap());
    let g1_h = host_layout(&tm, common::geometry(n, 1, 64), PinPolicy::Unpinned);
    let g2_h = host_layout(&tm, common::geometry(n, 1, 64), PinPolicy::Unpinned);
    let g2 = Arc::new(manager::<G2>(n, None));
    let mover = || {
        BlockMover::<kvbm_logical::G1, G2>::from_layout(
            g1_h,
            &BoundTier::new(tm.clone(), g2_h, g2.clone()).unwrap(),
        )
        .unwrap()
    };
    let waits = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let patient = BlockMoveExecutor::from_mover(mover())
        .waiting_for_room(Duration::from_secs(10), waits.clone());
    let impatient = BlockMoveExecutor::from_mover(mover());

    // Every G2 slot taken (held by someone else).
    let taken = g2.allocate_blocks(n).unwrap();
    let refused = impatient.allocate(2).await.unwrap_err();
    assert_eq!(refused.kind, BlockFailureKind::NoSpace, "{refused}");
    let too_big = patient.allocate(n + 1).await.unwrap_err();
    assert_eq!(
        too_big.kind,
        BlockFailureKind::NoSpace,
        "no wait can make room: {too_big}"
    );
    assert_eq!(waits.load(std::sync::atomic::Ordering::Relaxed), 0);

    // The holder frees the slots a little later: the patient executor gets them.
    let freed_at = std::time::Instant::now() + Duration::from_millis(50);
    let release = tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(50)).await;
        drop(taken);
    });
    let got = patient
        .allocate(2)
        .await
        .expect("room once the slots are freed");
    assert!(
        std::time::Instant::now() >= freed_at,
        "it waited for the release"
    );
    assert_eq!(got.len(), 2);
    assert!(
        waits.load(std::sync::atomic::Ordering::Relaxed) > 0,
        "its retries are counted"
    );
    release.await.unwrap();
}
