//! End to end over `kvbm-physical`: G2→G3 onto a real O_DIRECT file, and G1→G2→G3 through the
//! engine with `auto_chain`.

mod common;

use std::sync::Arc;

use common::{disk_layout, hash, host_layout, manager, registered, scratch};
use kvbm_logical::{BlockRegistry, G1, G2, G3, TierId};

use kvbm_offload::engine::{LaneSpec, OffloadEngine};
use kvbm_offload::handle::OffloadStatus;
use kvbm_offload::policy::PresenceAndLFUFilter;
use kvbm_offload::settlement::PipelineLane;
use kvbm_offload::source::Precondition;
use kvbm_offload::*;
use kvbm_physical::testing::{bytes, fill};
use kvbm_physical::{
    Backing, BlockLayout, DiskConfig, PhysicalLayout, PinPolicy, TransferManager, TransferOptions,
};

fn geometry(n: usize) -> BlockLayout {
    common::geometry(n, 2, 64)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn g2_to_g3_on_o_direct_file_registers_only_transferred_blocks() {
    let dir = scratch();
    let n = 8;
    let registry = BlockRegistry::new();
    let g2 = manager::<G2>(n, Some(&registry));
    let g3 = Arc::new(manager::<G3>(n, Some(&registry)));
    let tm = Arc::new(TransferManager::new().unwrap());
    let host = PhysicalLayout::allocate_host(geometry(n), PinPolicy::Unpinned).unwrap();
    fill(&host, 5);
    let g2_h = tm.register_layout(host).unwrap();
    let disk =
        PhysicalLayout::create_disk(geometry(n), &DiskConfig::new(dir.path().join("g3.bin")))
            .unwrap();
    if let Backing::Disk(d) = disk.backing() {
        assert!(
            d.capabilities().direct_io,
            "the G3 file is opened with O_DIRECT"
        );
    }
    let g3_h = tm.register_layout(disk).unwrap();

    let pipeline = PipelineBuilder::<G2, G3>::new()
        .policy(Arc::new(PresenceFilter::new(registry.clone())))
        .build()
        .spawn(BlockMoveExecutor::<G2, G3>::from_mover(
            BlockMover::from_layout(
                g2_h,
                &BoundTier::new(tm.clone(), g3_h, g3.clone()).expect("bound G3"),
            )
            .expect("G2→G3 mover"),
        ))
        .unwrap();

    let blocks = registered(&g2, 0, n as u32);
    let src_ids: Vec<usize> = blocks.iter().map(|b| b.block_id()).collect();
    let r = pipeline
        .enqueue(blocks.clone(), None)
        .await
        .unwrap()
        .wait()
        .await
        .unwrap();
    assert_eq!(r.status, OffloadStatus::Complete, "{r:?}");
    assert_eq!(r.completed_blocks.len(), n);
    for i in 0..n as u32 {
        assert!(
            registry.is_present(hash(i), TierId::G3),
            "block {i} registered in G3"
        );
    }

    // The bytes on disk are the bytes of G2: read them back into fresh host memory.
    let on_g3 = g3.match_blocks(&(0..n as u32).map(hash).collect::<Vec<_>>());
    assert_eq!(on_g3.len(), n);
    let back_h = host_layout(&tm, geometry(n), PinPolicy::Unpinned);
    let g3_ids: Vec<usize> = on_g3.iter().map(|b| b.block_id()).collect();
    // Slots are bound to their blocks' sequence hashes: an anonymous read is refused…
    let out =
        // SAFETY: test-owned layouts; nothing outside the manager reads or writes their blocks while the transfer runs.
        unsafe { tm.execute_transfer(g3_h, &g3_ids, back_h, &src_ids, TransferOptions::default()) }
            .unwrap()
            .await;
    assert!(
        out.blocks.iter().all(|(_, r)| matches!(
            r,
            Err(kvbm_physical::PhysicalError::IdentityMismatch { .. })
        )),
        "{out:?}"
    );
    // …and a read naming them returns the bytes.
    let identities = on_g3
        .iter()
        .map(|b| block_identity(b.sequence_hash()))
        .collect();
    // SAFETY: test-owned layouts; nothing outside the manager reads or writes their blocks while the transfer runs.
    let out = unsafe {
        tm.execute_transfer(
            g3_h,
            &g3_ids,
            back_h,
            &src_ids,
            TransferOptions::default().identities(identities),
        )
    }
    .unwrap()
    .await;
    assert!(out.is_complete_success(), "{out:?}");
    let src_layout = tm.layout(g2_h).unwrap();
    let back_layout = tm.layout(back_h).unwrap();
    for &id in &src_ids {
        assert_eq!(
            bytes(&src_layout, id),
            bytes(&back_layout, id),
            "block slot {id}"
        );
    }
    drop(on_g3);

    // Already present: the presence policy filters every block.
    let again = pipeline
        .enqueue(blocks, None)
        .await
        .unwrap()
        .wait()
        .await
        .unwrap();
    assert_eq!(again.filtered_blocks.len(), n);
    assert!(again.completed_blocks.is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failed_transfer_reports_why_and_registers_nothing() {
    let dir = scratch();
    let registry = BlockRegistry::new();
    let g3 = Arc::new(manager::<G3>(4, Some(&registry)));
    let tm = Arc::new(TransferManager::new().unwrap());
    let g2_h = host_layout(&tm, geometry(4), PinPolicy::Unpinned);
    let g3_h = disk_layout(&tm, geometry(4), &dir.path().join("g3.bin"));
    let pipeline = PipelineBuilder::<G2, G3>::new()
        .min_batch_size(1)
        .build()
        .spawn(BlockMoveExecutor::<G2, G3>::from_mover(
            BlockMover::from_layout(
                g2_h,
                &BoundTier::new(tm, g3_h, g3.clone()).expect("bound G3"),
            )
            .expect("G2→G3 mover"),
        ))
        .unwrap();
    // Slot 99 does not exist in the source layout: the transfer manager refuses the batch.
    let r = pipeline
        .enqueue(
            vec![
                ExternalBlock::new(0, hash(0)),
                ExternalBlock::new(99, hash(1)),
            ],
            None,
        )
        .await
        .unwrap()
        .wait()
        .await
        .unwrap();
    assert_eq!(r.status, OffloadStatus::Failed);
    assert_eq!(r.failed_blocks.len(), 2);
    assert!(
        r.failed_blocks
            .iter()
            .all(|(_, f)| f.kind == BlockFailureKind::Transfer && !f.message.is_empty())
    );
    assert!(!registry.is_present(hash(0), TierId::G3));
    assert!(!registry.is_present(hash(1), TierId::G3));
    assert_eq!(g3.available_blocks(), 4, "destination slots returned");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn engine_auto_chain_moves_g1_completions_to_g3() {
    let dir = scratch();
    let n = 4;
    let registry = BlockRegistry::new();
    let g2 = Arc::new(manager::<G2>(n, Some(&registry)));
    let g3 = Arc::new(manager::<G3>(n, Some(&registry)));
    let tm = Arc::new(TransferManager::new().unwrap());
    let dev = PhysicalLayout::allocate_device(geometry(n), 0).unwrap();
    fill(&dev, 9);
    let g1_h = tm.register_layout(dev).unwrap();
    let g2_h = host_layout(&tm, geometry(n), PinPolicy::Unpinned);
    let g3_h = disk_layout(&tm, geometry(n), &dir.path().join("g3.bin"));
    let engine = OffloadEngine::builder(registry.clone())
        .with_transfer_manager(tm.clone())
        .external_tier::<G1>(g1_h)
        .tier(BoundTier::new(tm.clone(), g2_h, g2.clone()).unwrap())
        .tier(BoundTier::new(tm, g3_h, g3.clone()).unwrap())
        .lane(LaneSpec::over_tiers(
            PipelineBuilder::<G1, G2>::new().min_batch_size(1).build(),
        ))
        .lane(LaneSpec::over_tiers(
            PipelineBuilder::<G2, G3>::new()
                .policy(Arc::new(PresenceAndLFUFilter::new(registry.clone(), 0)))
                .min_batch_size(1)
                .build(),
        ))
        .chain(PipelineLane::G1_TO_G2, PipelineLane::G2_TO_G3)
        .build()
        .unwrap();
    let (trigger, event) = Precondition::pair();
    let h = engine
        .enqueue::<G1>(
            PipelineLane::G1_TO_G2,
            common::external(0, n as u32),
            Some(event),
        )
        .await
        .unwrap();
    trigger.complete();
    let r = h.wait().await.unwrap();
    assert_eq!(r.completed_blocks.len(), n);
    assert_eq!(
        engine.chained_blocks(),
        n as u64,
        "completions were handed on before wait returned"
    );
    let token = engine.settlement_token();
    engine.wait_for_settlement(&token).await.unwrap();
    assert!(matches!(
        engine
            .enqueue::<G2>(PipelineLane::G2_TO_G4, Vec::<ExternalBlock>::new(), None)
            .await,
        Err(OffloadError::NoPipeline(PipelineLane::G2_TO_G4))
    ));
    // Shutdown drains the lanes in order: what G1→G2 handed on is through G2→G3 after it.
    engine.shutdown().await;
    for i in 0..n as u32 {
        assert!(registry.is_present(hash(i), TierId::G2));
        assert!(
            registry.is_present(hash(i), TierId::G3),
            "block {i} chained to G3"
        );
    }
}
