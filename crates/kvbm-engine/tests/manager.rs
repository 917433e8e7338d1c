//! The scheduler-facing manager over the engine's tiers, with real bytes: a vLLM-style
//! scheduler stores blocks from "GPU" memory (host memory standing in for G1) into the leader's
//! G2 (`prepare_store` → worker copy → `complete_store`), the engine offloads them to G3 (an
//! O_DIRECT file) and evicts them from G2; the scheduler then looks them up (`HIT_PENDING`
//! while the engine promotes G3→G2, then `HIT`), loads them (`prepare_load` → worker copy into
//! other GPU slots → `complete_load`) and the bytes are verified. A G3 block whose slot holds
//! another block's bytes is never a hit; misuse is refused before anything changes.
//!
//! And `kvbm-tiering`'s own manager over the leader's G3: what the scheduler cascades to disk
//! is found by the leader and staged by an onboarding session, bytes verified, and the
//! scheduler's lookup → prepare_load → load → complete_load reads it back from the same G3.

use std::sync::Arc;

use kvbm_engine::leader::InstanceLeader;
use kvbm_engine::leader::MoversToG2;
use kvbm_engine::manager::{EngineTieringManager, key_digest, key_hash};
use kvbm_engine::mover::BlockMove;
use kvbm_logical::{BlockId, BlockManager, BlockRegistry, G1, G2, G3, ImmutableBlock, Tier};
use kvbm_offload::{BlockMover, BoundTier, ExternalMover};
use kvbm_physical::{DiskConfig, LayoutHandle, PhysicalLayout, PinPolicy, TransferManager};
use kvbm_tiering::stats::names;
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
            MoversToG2 {
                g3_to_g2: Some(up),
                ..MoversToG2::default()
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
    /// The worker's copy between GPU slots and G2 chunks (as vLLM's offloading worker does),
    /// through kvbm-offload's `ExternalMover` (`Src`: the tier of the source slots).
    async fn copy<Src: Tier>(
        &self,
        src: LayoutHandle,
        src_ids: &[BlockId],
        dst: LayoutHandle,
        dst_ids: &[BlockId],
    ) {
        let mover = ExternalMover::<Src>::from_layout(&self.tm, src, dst).unwrap();
        // SAFETY: test-owned layouts; the scheduler reserved these slots for this copy and
        // nothing outside the manager touches them while it runs.
        let out = unsafe { mover.copy_slots(src_ids, dst_ids) }.unwrap().await;
        assert!(out.iter().all(|r| r.is_ok()), "{out:?}");
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

// A current-thread runtime: the manager spawns its promotions on it, so they run only when
// this test awaits, and a key is still pending (deterministically) when the test asks
// `prepare_load` for it right after the lookup that started its promotion. On worker threads
// the promotion could finish first (a few hundred microseconds), and the refusal be skipped.
#[tokio::test(flavor = "current_thread")]
async fn a_scheduler_stores_then_loads_through_the_engines_tiers_bytes_verified() {
    let mut r = rig();
    let keys: Vec<OffloadKey> = (100..103).map(OffloadKey::from_u64).collect();
    let hashes: Vec<_> = keys.iter().map(|k| key_hash(k, 4)).collect();
    let ctx = ReqContext::new("r1");
    r.mgr.on_new_request(&ctx).unwrap();
    for k in &keys {
        assert_eq!(r.mgr.lookup(k, &ctx), LookupResult::Miss);
    }

    // Store: GPU slots 0..3 → G2 chunks → registered in the leader's G2, and handed to the
    // engine's write-through (the sink).
    let sunk: Arc<std::sync::Mutex<Vec<ImmutableBlock<G2>>>> = Arc::default();
    let into = sunk.clone();
    r.mgr
        .set_store_sink(Box::new(move |b| into.lock().unwrap().extend(b)));
    let out = r.mgr.prepare_store(&keys, &ctx).unwrap().expect("room");
    assert_eq!(out.keys_to_store, keys);
    let chunks = ids(&out.store_spec);
    r.copy::<G1>(r.gpu, &[0, 1, 2], r.g2_bound.layout(), &chunks)
        .await;
    r.mgr.complete_store(&keys, &ctx, true).unwrap();
    let on_g2: Vec<ImmutableBlock<G2>> = std::mem::take(&mut *sunk.lock().unwrap());
    assert_eq!(
        on_g2.iter().map(|b| b.sequence_hash()).collect::<Vec<_>>(),
        hashes,
        "the sink gets exactly what the store registered, in key order"
    );
    assert!(
        on_g2
            .iter()
            .zip(&keys)
            .all(|(b, k)| b.digest() == Some(key_digest(k))),
        "each with its key's digest as identity"
    );
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
    let _ = r.mgr.get_stats(); // counters from here on
    r.mgr.set_block_bytes(4096);
    r.mgr.set_record_lookup_latency(true);
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
    // Stats: 3 G2 misses found in G3 (promoted), then 3 G2 hits; nothing failed or active.
    let stats = r.mgr.get_stats().expect("stats");
    assert_eq!(
        stats.counter(names::CHUNK_QUERIES, Some("0:primary")),
        Some(6.0)
    );
    assert_eq!(
        stats.counter(names::CHUNK_HITS, Some("0:primary")),
        Some(3.0)
    );
    assert_eq!(
        stats.counter(names::CHUNK_QUERIES, Some("1:disk")),
        Some(3.0)
    );
    assert_eq!(stats.counter(names::CHUNK_HITS, Some("1:disk")), Some(3.0));
    assert_eq!(
        stats.gauge(names::ACTIVE_PROMOTION_JOBS, Some("1:disk")),
        Some(0.0)
    );
    assert_eq!(
        stats.counter(names::PROMOTION_JOB_FAILURES, Some("1:disk")),
        None
    );
    // The three promotions' bytes and read time; every lookup's time per searched tier.
    assert_eq!(
        stats.counter(names::READ_BYTES, Some("1:disk")),
        Some(3.0 * 4096.0)
    );
    assert!(
        stats
            .counter(names::READ_TIME, Some("1:disk"))
            .is_some_and(|t| t > 0.0)
    );
    assert_eq!(
        stats
            .histogram(names::LOOKUP_SYNC_DELAY, Some("0:primary"))
            .map(<[f64]>::len),
        Some(6)
    );
    assert_eq!(
        stats
            .histogram(names::LOOKUP_SYNC_DELAY, Some("1:disk"))
            .map(<[f64]>::len),
        Some(3)
    );

    // Load: G2 chunks → other GPU slots (3..6), bytes verified.
    let spec = r.mgr.prepare_load(&keys, &ctx2).unwrap();
    let chunks = ids(&spec);
    assert_eq!(
        r.g2.allocate_blocks(N).map(|v| v.len()).ok(),
        None,
        "loading blocks are held"
    );
    r.copy::<G2>(r.g2_bound.layout(), &chunks, r.gpu, &[3, 4, 5])
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
    let stats = r.mgr.get_stats().expect("stats");
    assert_eq!(
        stats.counter(names::PROMOTION_JOB_FAILURES, Some("1:disk")),
        Some(1.0)
    );
    assert_eq!(r.mgr.lookup(&key, &ctx), LookupResult::Miss, "never a hit");
    assert!(
        r.g3.match_blocks(&[key_hash(&key, 4)]).is_empty(),
        "the bad copy is dropped from G3"
    );
    assert_eq!(r.g3.available_blocks(), N, "its slot is free again");
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
    assert_eq!(
        r.mgr.lookup(&key, &ctx),
        LookupResult::Miss,
        "still never a hit"
    );

    // The scheduler recomputes the block and stores it: the fresh bytes in G2 are a HIT (the
    // failed promotion was of the bad G3 copy), and load back exactly.
    let out = r.mgr.prepare_store(&[key], &ctx).unwrap().unwrap();
    r.copy::<G1>(r.gpu, &[5], r.g2_bound.layout(), &ids(&out.store_spec))
        .await;
    r.mgr.complete_store(&[key], &ctx, true).unwrap();
    assert_eq!(r.mgr.lookup(&key, &ctx), LookupResult::Hit);
    let spec = r.mgr.prepare_load(&[key], &ctx).unwrap();
    r.copy::<G2>(r.g2_bound.layout(), &ids(&spec), r.gpu, &[6])
        .await;
    r.mgr.complete_load(&[key], &ctx).unwrap();
    assert_eq!(r.gpu_bytes(6), r.gpu_bytes(5));
    // Once G2 drops the fresh copy, the bad G3 copy is not read again: MISS, no promotion.
    assert_eq!(r.g2.reset_inactive_pool(), 1);
    assert_eq!(r.mgr.lookup(&key, &ctx), LookupResult::Miss);
    assert_eq!(r.mgr.promotions_in_flight(), 0);
    assert_eq!(r.mgr.promotion_failures(), 1);
    r.mgr.on_request_finished(&ctx).unwrap();
}

mod vllm_manager {
    //! `kvbm-tiering`'s `TieringOffloadingManager` with the leader's bound G3 as its tier.

    use std::time::{Duration, Instant};

    use kvbm_engine::leader::{FinishOutcome, MoversToG2, Phase};
    use kvbm_engine::manager::SchedulerTiers;
    use kvbm_logical::{G1, TierId};
    use kvbm_tiering::{CpuManagerConfig, CpuPrimaryTier, TieringOffloadingManager, UpstreamFixes};

    use super::*;

    const CHUNK: usize = 8192;
    const SLOTS: usize = 8;

    fn pattern(i: u64) -> Vec<u8> {
        (0..CHUNK)
            .map(|j| (j as u64 * 31 + i * 7919) as u8)
            .collect()
    }

    fn settle(m: &mut TieringOffloadingManager) {
        let end = |m: &mut TieringOffloadingManager| {
            m.on_schedule_end(&ScheduleEndContext::default()).unwrap()
        };
        end(m);
        let t = Instant::now();
        while m.has_pending_work() {
            assert!(
                t.elapsed() < Duration::from_secs(60),
                "tier jobs did not finish"
            );
            std::thread::sleep(Duration::from_millis(2));
            end(m);
        }
        end(m);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_tiering_manager_over_the_leaders_g3_shares_its_blocks_with_the_engine() {
        let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
        let tm = Arc::new(TransferManager::new().unwrap());
        let geometry = CpuPrimaryTier::block_layout(SLOTS, CHUNK).unwrap();
        let registry = BlockRegistry::new();
        let (g2, g3) = (manager::<G2>(&registry), manager::<G3>(&registry));
        let g1 = manager::<G1>(&BlockRegistry::new());
        let host = |tm: &TransferManager| {
            tm.register_layout(
                PhysicalLayout::allocate_host(geometry, PinPolicy::Unpinned).unwrap(),
            )
            .unwrap()
        };
        let (g2_h, g1_h) = (host(&tm), host(&tm));
        let g3_h = tm
            .register_layout(
                PhysicalLayout::create_disk(geometry, &DiskConfig::new(dir.path().join("g3.bin")))
                    .unwrap(),
            )
            .unwrap();
        let g2_bound = BoundTier::new(tm.clone(), g2_h, g2.clone()).unwrap();
        let g3_bound = BoundTier::new(tm.clone(), g3_h, g3.clone()).unwrap();
        let g1_bound = BoundTier::new(tm.clone(), g1_h, g1.clone()).unwrap();
        let leader = InstanceLeader::builder()
            .g2(g2.clone())
            .g3(g3.clone())
            .build()
            .unwrap();

        // A tier bound to another manager than the leader's is refused, naming the key.
        let primary =
            CpuPrimaryTier::with_transfer_manager(CpuManagerConfig::new(2), CHUNK, tm.clone())
                .unwrap();
        let stranger =
            BoundTier::new(tm.clone(), g3_h, manager::<G3>(&BlockRegistry::new())).unwrap();
        let Err(err) = leader.vllm_tiering_manager(
            primary,
            SchedulerTiers {
                g3: Some(stranger),
                g4: None,
            },
            UpstreamFixes::default(),
        ) else {
            panic!("a stranger's G3 is refused");
        };
        assert_eq!(err.config_key(), Some("scheduler.tiers"));

        let primary =
            CpuPrimaryTier::with_transfer_manager(CpuManagerConfig::new(2), CHUNK, tm.clone())
                .unwrap();
        let mut m = leader
            .vllm_tiering_manager(
                primary,
                SchedulerTiers {
                    g3: Some(g3_bound.clone()),
                    g4: None,
                },
                UpstreamFixes::default(),
            )
            .unwrap();
        let c = ReqContext::new("r");
        m.on_new_request(&c).unwrap();
        let store = |m: &mut TieringOffloadingManager, ids: &[u64]| {
            let ks: Vec<OffloadKey> = ids.iter().map(|&i| OffloadKey::from_u64(i)).collect();
            let o = m.prepare_store(&ks, &c).unwrap().expect("room");
            for (k, &i) in ks.iter().zip(ids) {
                m.primary_mut()
                    .chunk_mut(k)
                    .unwrap()
                    .copy_from_slice(&pattern(i));
            }
            m.complete_store(&o.keys_to_store, &c, true).unwrap();
        };
        store(&mut m, &[0, 1]);
        settle(&mut m);

        // The leader finds what the scheduler cascaded to disk, and stages it G3→G2 then
        // onboards it to G1, bytes verified.
        let hashes: Vec<_> = (0..2)
            .map(|i| key_hash(&OffloadKey::from_u64(i), 4))
            .collect();
        let found = leader.find_matches(&hashes);
        assert_eq!((found.len(), found.count(TierId::G3)), (2, 2));
        drop(found);
        let session = leader.begin_onboarding(&hashes);
        session
            .prepare(MoversToG2 {
                g3_to_g2: Some(Arc::new(BlockMover::new(&g3_bound, &g2_bound).unwrap())),
                ..MoversToG2::default()
            })
            .await
            .unwrap();
        assert_eq!(session.phase(), Phase::Staged);
        let onboard = session
            .onboard_layerwise(
                Arc::new(kvbm_engine::mover::LayerMover::new(&g2_bound, &g1_bound).unwrap()),
                g1.allocate_blocks(2).unwrap(),
            )
            .await
            .unwrap();
        onboard.wait().await.unwrap();
        let FinishOutcome::Finished(on_g1) = session.finish() else {
            panic!("complete");
        };
        let g1_mem = tm.layout(g1_h).unwrap();
        for (i, b) in on_g1.iter().enumerate() {
            assert_eq!(bytes(&g1_mem, b.block_id()), pattern(i as u64), "block {i}");
        }
        drop(on_g1);

        // The scheduler's own read path over the same G3: push 0 and 1 out of the primary,
        // then look 0 up (promoted from the leader's G3), load it and complete.
        store(&mut m, &[2, 3]);
        settle(&mut m);
        let k0 = OffloadKey::from_u64(0);
        assert_eq!(m.lookup(&k0, &c), LookupResult::HitPending);
        settle(&mut m);
        assert_eq!(m.lookup(&k0, &c), LookupResult::Hit);
        let spec = m.prepare_load(&[k0], &c).unwrap();
        assert_eq!(spec.chunk_ids().map(<[i32]>::len), Some(1));
        assert_eq!(m.primary().chunk(&k0).unwrap(), pattern(0).as_slice());
        m.complete_load(&[k0], &c).unwrap();
        m.on_request_finished(&c).unwrap();
        m.shutdown().unwrap();
    }
}
