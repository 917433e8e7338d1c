//! The scheduler-facing manager over the engine's tiers, with real bytes: a vLLM-style
//! scheduler stores blocks from "GPU" memory (host memory standing in for G1) into the leader's
//! G2 (`prepare_store` → worker copy → `complete_store`), the engine offloads them to G3 (an
//! O_DIRECT file) and evicts them from G2; the scheduler then looks them up (`HIT_PENDING`
//! while the engine promotes G3→G2, then `HIT`), loads them (`prepare_load` → worker copy into
//! other GPU slots → `complete_load`) and the bytes are verified. A G3 block whose slot holds
//! another block's bytes is never a hit; misuse is refused before anything changes.

use std::sync::Arc;

use kvbm_engine::leader::InstanceLeader;
use kvbm_engine::mover::BlockMove;
use kvbm_engine::scheduler::{EngineTieringManager, PromotionMovers, key_hash};
use kvbm_logical::{BlockId, BlockManager, BlockRegistry, G2, G3};
use kvbm_offload::{BlockMover, BoundTier};
use kvbm_physical::{
    DiskConfig, LayoutHandle, PhysicalLayout, PinPolicy, TransferManager, TransferOptions,
};
use kvbm_tiering::{
    CacheHitSource, LookupResult, OffloadKey, OffloadingManager, ReqContext, ScheduleEndContext,
    TieringError,
};

mod common;

use common::{N, bytes, fill, geometry, manager};

struct Rig {
    _dir: tempfile::TempDir,
    tm: Arc<TransferManager>,
    g2: Arc<BlockManager<G2>>,
    g3: Arc<BlockManager<G3>>,
    g2_bound: BoundTier<G2>,
    g3_bound: BoundTier<G3>,
    /// The "GPU": G1 memory the inference engine manages (not a kvbm tier).
    gpu: LayoutHandle,
    leader: InstanceLeader,
    mgr: EngineTieringManager,
}

fn rig() -> Rig {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let tm = Arc::new(TransferManager::new().unwrap());
    let registry = BlockRegistry::new();
    let g2 = manager::<G2>(&registry);
    let g3 = manager::<G3>(&registry);
    let g2_h = tm
        .register_layout(PhysicalLayout::allocate_host(geometry(), PinPolicy::Unpinned).unwrap())
        .unwrap();
    let g3_h = tm
        .register_layout(
            PhysicalLayout::create_disk(geometry(), &DiskConfig::new(dir.path().join("g3.bin")))
                .unwrap(),
        )
        .unwrap();
    let gpu_layout = PhysicalLayout::allocate_host(geometry(), PinPolicy::Unpinned).unwrap();
    fill(&gpu_layout, 0x5a);
    let gpu = tm.register_layout(gpu_layout).unwrap();
    let g2_bound = BoundTier::new(tm.clone(), g2_h, g2.clone()).unwrap();
    let g3_bound = BoundTier::new(tm.clone(), g3_h, g3.clone()).unwrap();
    let leader = InstanceLeader::builder()
        .g2(g2.clone())
        .g3(g3.clone())
        .build()
        .unwrap();
    let up: Arc<dyn BlockMove<G3, G2>> = Arc::new(BlockMover::new(&g3_bound, &g2_bound).unwrap());
    let mgr = leader
        .tiering_manager(
            PromotionMovers {
                g3_to_g2: Some(up),
                g4_to_g2: None,
            },
            tokio::runtime::Handle::current(),
        )
        .unwrap();
    Rig {
        _dir: dir,
        tm,
        g2,
        g3,
        g2_bound,
        g3_bound,
        gpu,
        leader,
        mgr,
    }
}

impl Rig {
    /// The worker's copy between GPU slots and G2 chunks (as vLLM's offloading worker does).
    async fn copy(
        &self,
        src: LayoutHandle,
        src_ids: &[BlockId],
        dst: LayoutHandle,
        dst_ids: &[BlockId],
    ) {
        let out = self
            .tm
            .execute_transfer(src, src_ids, dst, dst_ids, TransferOptions::default())
            .unwrap()
            .await;
        assert!(out.is_complete_success(), "{out:?}");
    }

    fn gpu_bytes(&self, b: BlockId) -> Vec<u8> {
        bytes(&self.tm.layout(self.gpu).unwrap(), b)
    }
}

fn ids(spec: &kvbm_tiering::LoadStoreSpec) -> Vec<BlockId> {
    spec.chunk_ids()
        .expect("a CPU spec")
        .iter()
        .map(|&i| i as BlockId)
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_scheduler_stores_then_loads_through_the_engines_tiers_bytes_verified() {
    let mut r = rig();
    let keys: Vec<OffloadKey> = (100..103).map(OffloadKey::from_u64).collect();
    let hashes: Vec<_> = keys.iter().map(|k| key_hash(k, 4)).collect();
    let ctx = ReqContext::new("r1");
    r.mgr.on_new_request(&ctx).unwrap();
    for k in &keys {
        assert_eq!(r.mgr.lookup(k, &ctx), LookupResult::Miss);
    }

    // Store: GPU slots 0..3 → G2 chunks → registered in the leader's G2.
    let out = r.mgr.prepare_store(&keys, &ctx).unwrap().expect("room");
    assert_eq!(out.keys_to_store, keys);
    let chunks = ids(&out.store_spec);
    r.copy(r.gpu, &[0, 1, 2], r.g2_bound.layout(), &chunks)
        .await;
    r.mgr.complete_store(&keys, &ctx, true).unwrap();
    let events = r.mgr.take_events();
    assert_eq!(events.len(), 1);
    assert_eq!(events[0].keys, keys);
    for k in &keys {
        assert_eq!(r.mgr.lookup(k, &ctx), LookupResult::Hit);
        assert_eq!(r.mgr.get_load_source(k, &ctx), CacheHitSource::Host);
    }
    assert_eq!(
        r.leader.find_matches(&hashes).len(),
        3,
        "what the scheduler stored is what the leader finds"
    );
    let expected: Vec<Vec<u8>> = (0..3).map(|b| r.gpu_bytes(b)).collect();

    // The engine offloads them to G3 and evicts them from G2, wiping G2's memory.
    let on_g2 = r.g2.match_blocks(&hashes);
    let down = BlockMover::new(&r.g2_bound, &r.g3_bound).unwrap();
    let moved = down
        .move_from(&on_g2, r.g3.allocate_blocks(3).unwrap())
        .await;
    assert!(moved.iter().all(Result::is_ok), "{moved:?}");
    drop((moved, on_g2));
    assert_eq!(r.g2.reset_inactive_pool(), 3);
    let g2_mem = r.tm.layout(r.g2_bound.layout()).unwrap();
    fill(&g2_mem, 0);
    r.mgr.on_request_finished(&ctx).unwrap();

    // A new request: G3-resident keys are pending while the engine promotes them to G2.
    let ctx2 = ReqContext::new("r2");
    r.mgr.on_new_request(&ctx2).unwrap();
    for k in &keys {
        assert_eq!(r.mgr.get_load_source(k, &ctx2), CacheHitSource::Disk);
        assert_eq!(r.mgr.lookup(k, &ctx2), LookupResult::HitPending);
    }
    assert!(r.mgr.has_pending_work());
    assert!(matches!(
        r.mgr.prepare_load(&keys, &ctx2),
        Err(TieringError::KeyState {
            call: "prepare_load",
            ..
        })
    ));
    r.mgr.settle().await;
    r.mgr
        .on_schedule_end(&ScheduleEndContext::default())
        .unwrap();
    assert!(!r.mgr.has_pending_work());
    for k in &keys {
        assert_eq!(r.mgr.lookup(k, &ctx2), LookupResult::Hit);
    }

    // Load: G2 chunks → other GPU slots (3..6), bytes verified.
    let spec = r.mgr.prepare_load(&keys, &ctx2).unwrap();
    let chunks = ids(&spec);
    assert_eq!(
        r.g2.allocate_blocks(N).map(|v| v.len()).ok(),
        None,
        "loading blocks are held"
    );
    r.copy(r.g2_bound.layout(), &chunks, r.gpu, &[3, 4, 5])
        .await;
    for (i, want) in expected.iter().enumerate() {
        assert_eq!(&r.gpu_bytes(3 + i), want, "block {i}");
    }
    r.mgr.complete_load(&keys, &ctx2).unwrap();
    assert!(matches!(
        r.mgr.complete_load(&keys[..1], &ctx2),
        Err(TieringError::KeyState {
            call: "complete_load",
            ..
        })
    ));
    r.mgr.on_request_finished(&ctx2).unwrap();
    assert_eq!(
        r.g2.allocate_blocks(N).map(|v| v.len()).ok(),
        Some(N),
        "every hold released"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_g3_block_holding_other_bytes_is_never_a_hit_and_misuse_changes_nothing() {
    let mut r = rig();
    let key = OffloadKey::from_u64(7);
    // Registered in G3, but its slot was never written for it.
    let bogus = r.g3.allocate_blocks(1).unwrap().pop().unwrap();
    drop(r.g3.register_blocks(vec![bogus.complete(key_hash(&key, 4)).unwrap()]));
    let ctx = ReqContext::new("r");
    assert!(matches!(
        r.mgr.prepare_load(&[key], &ctx),
        Err(TieringError::UnknownRequest { .. })
    ));
    r.mgr.on_new_request(&ctx).unwrap();
    assert_eq!(r.mgr.lookup(&key, &ctx), LookupResult::HitPending);
    r.mgr.settle().await;
    assert_eq!(r.mgr.promotion_failures(), 1);
    assert_eq!(r.mgr.lookup(&key, &ctx), LookupResult::Miss, "never a hit");
    assert!(
        r.g2.match_blocks(&[key_hash(&key, 4)]).is_empty(),
        "nothing registered in G2"
    );
    assert!(r.mgr.prepare_load(&[key], &ctx).is_err());
    assert!(matches!(
        r.mgr.complete_store(&[key], &ctx, true),
        Err(TieringError::NoPendingStore { .. })
    ));
    // A failed store registers nothing and frees its chunks.
    let out = r.mgr.prepare_store(&[key], &ctx).unwrap().unwrap();
    assert_eq!(out.keys_to_store, vec![key]);
    assert!(
        r.mgr
            .prepare_store(&[key], &ctx)
            .unwrap()
            .unwrap()
            .keys_to_store
            .is_empty(),
        "a key being stored is not stored twice"
    );
    r.mgr.complete_store(&[key], &ctx, false).unwrap();
    assert!(r.mgr.take_events().is_empty());
    assert_eq!(r.g2.available_blocks(), N);
    r.mgr.on_request_finished(&ctx).unwrap();
}
