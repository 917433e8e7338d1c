//! SPMD workers on real storage: two ranks, each with its own transfer manager, host memory
//! and O_DIRECT file, move every block on both ranks (bytes verified per rank); a block only
//! rank 0 ever wrote fails for the whole group on the way back and is never registered; and a
//! leader with two workers in one process finds, holds, stages G3→G2 and onboards to G1
//! through an onboarding session, bytes verified on each rank.

use std::sync::Arc;

use kvbm_engine::leader::{FinishOutcome, InstanceLeader, MoversToG2, Phase};
use kvbm_engine::worker::{ParallelWorkers, PhysicalWorker, SpmdMover, SpmdParallelWorkers};
use kvbm_logical::{BlockRegistry, G1, G2, G3, Salt, TierId, TokenBlockSequence};
use kvbm_physical::{DiskConfig, PhysicalLayout, PinPolicy, TransferManager};

mod common;

use common::{N, bytes, fill, geometry, manager};

/// Rank `rank`: G2 host memory filled with a per-rank pattern, G3 an O_DIRECT file, G1 empty
/// host memory.
fn rank(rank: usize, dir: &std::path::Path) -> PhysicalWorker {
    let tm = Arc::new(TransferManager::new().unwrap());
    let g2 = PhysicalLayout::allocate_host(geometry(), PinPolicy::Unpinned).unwrap();
    fill(&g2, 0x40 + rank as u8);
    let g2 = tm.register_layout(g2).unwrap();
    let g3 = tm
        .register_layout(
            PhysicalLayout::create_disk(
                geometry(),
                &DiskConfig::new(dir.join(format!("rank{rank}.bin"))),
            )
            .unwrap(),
        )
        .unwrap();
    let g1 = tm
        .register_layout(PhysicalLayout::allocate_host(geometry(), PinPolicy::Unpinned).unwrap())
        .unwrap();
    PhysicalWorker::new(rank, tm)
        .with_layout(TierId::G2, g2)
        .with_layout(TierId::G3, g3)
        .with_layout(TierId::G1, g1)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_ranks_down_to_disk_and_back_bytes_verified_per_rank() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let (w0, w1) = (rank(0, dir.path()), rank(1, dir.path()));
    let both: Arc<dyn ParallelWorkers> =
        Arc::new(SpmdParallelWorkers::new(vec![w0.clone(), w1.clone()]).unwrap());
    let only_rank0: Arc<dyn ParallelWorkers> =
        Arc::new(SpmdParallelWorkers::new(vec![w0.clone()]).unwrap());

    let registry = BlockRegistry::new();
    let g2 = manager::<G2>(&registry);
    let g3 = manager::<G3>(&registry);
    let g1 = manager::<G1>(&BlockRegistry::new());
    let seq =
        TokenBlockSequence::from_tokens(&(0..20).collect::<Vec<u32>>(), 4, Salt::NONE).unwrap();
    let hashes = seq.hashes();
    let complete = g2
        .allocate_blocks(5)
        .unwrap()
        .into_iter()
        .zip(seq.blocks())
        .map(|(b, tb)| b.complete_token_block(tb).unwrap())
        .collect();
    let on_g2 = g2.register_blocks(complete);

    // Blocks 0..4 down on both ranks; block 4 on rank 0 only.
    // SAFETY: the test's ranks have layouts of this manager's blocks; nothing else writes them.
    let down = unsafe { SpmdMover::<G2, G3>::new(both.clone(), g3.clone()) };
    let out = down
        .move_from(&on_g2[..4], g3.allocate_blocks(4).unwrap())
        .await;
    assert!(out.iter().all(Result::is_ok), "{out:?}");
    drop(out);
    // SAFETY: the test's ranks have layouts of this manager's blocks; nothing else writes them.
    let partial = unsafe { SpmdMover::<G2, G3>::new(only_rank0, g3.clone()) };
    let out = partial
        .move_from(&on_g2[4..], g3.allocate_blocks(1).unwrap())
        .await;
    assert!(out[0].is_ok());
    drop(out);

    // Back up to G1 on both ranks.
    let on_g3 = g3.match_blocks(&hashes);
    assert_eq!(on_g3.len(), 5);
    // SAFETY: the test's ranks have layouts of this manager's blocks; nothing else writes them.
    let up = unsafe { SpmdMover::<G3, G1>::new(both, g1.clone()) };
    let out = up.move_from(&on_g3, g1.allocate_blocks(5).unwrap()).await;
    for o in &out[..4] {
        assert!(o.is_ok(), "{o:?}");
    }
    let failure = out[4].as_ref().unwrap_err();
    assert!(failure.message.starts_with("rank 1:"), "{failure}");
    assert!(
        g1.match_blocks(&hashes[4..5]).is_empty(),
        "a block one rank lacks is never registered"
    );

    // Each rank's G1 holds exactly its own G2 bytes.
    for w in [&w0, &w1] {
        let tm = w.transfer_manager();
        let src = tm.layout(w.layout(TierId::G2).unwrap()).unwrap();
        let dst = tm.layout(w.layout(TierId::G1).unwrap()).unwrap();
        for (i, o) in out[..4].iter().enumerate() {
            let b = o.as_ref().unwrap();
            assert_eq!(
                bytes(&dst, b.block_id()),
                bytes(&src, on_g2[i].block_id()),
                "rank {} block {i}",
                w.rank()
            );
        }
    }
    drop(out);
    assert_eq!(
        g1.available_blocks(),
        N,
        "the failed destination went back too"
    );
}

fn zero_all(layout: &PhysicalLayout) {
    let c = *layout.layout().config();
    for b in 0..c.num_blocks {
        for (addr, len) in layout.block_addrs(b, 0..c.num_layers) {
            // SAFETY: host memory the test allocated; no transfer targets it now.
            unsafe { std::ptr::write_bytes(addr as *mut u8, 0, len) };
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leader_and_two_workers_onboard_a_disk_prefix_bytes_verified_per_rank() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let ranks = [rank(0, dir.path()), rank(1, dir.path())];
    let workers: Arc<dyn ParallelWorkers> =
        Arc::new(SpmdParallelWorkers::new(ranks.to_vec()).unwrap());
    let registry = BlockRegistry::new();
    let g2 = manager::<G2>(&registry);
    let g3 = manager::<G3>(&registry);
    let g1 = manager::<G1>(&BlockRegistry::new());
    let seq =
        TokenBlockSequence::from_tokens(&(0..24).collect::<Vec<u32>>(), 4, Salt::NONE).unwrap();
    let hashes = seq.hashes();

    // Blocks 0..6 computed in G2 on both ranks, offloaded to G3 on both ranks.
    let complete = g2
        .allocate_blocks(6)
        .unwrap()
        .into_iter()
        .zip(seq.blocks())
        .map(|(b, tb)| b.complete_token_block(tb).unwrap())
        .collect();
    let on_g2 = g2.register_blocks(complete);
    let expected: Vec<Vec<Vec<u8>>> = ranks
        .iter()
        .map(|w| {
            let l = w
                .transfer_manager()
                .layout(w.layout(TierId::G2).unwrap())
                .unwrap();
            on_g2.iter().map(|b| bytes(&l, b.block_id())).collect()
        })
        .collect();
    // SAFETY: the test's ranks have layouts of this manager's blocks; nothing else writes them.
    let down = unsafe { SpmdMover::<G2, G3>::new(workers.clone(), g3.clone()) };
    let out = down.move_from(&on_g2, g3.allocate_blocks(6).unwrap()).await;
    assert!(out.iter().all(Result::is_ok), "{out:?}");
    drop((out, on_g2));
    // Evict from G2 and wipe every rank's host memory: what arrives in G1 can only come from
    // the disks.
    assert_eq!(g2.reset_inactive_pool(), 6);
    for w in &ranks {
        let l = w
            .transfer_manager()
            .layout(w.layout(TierId::G2).unwrap())
            .unwrap();
        zero_all(&l);
    }

    let leader = InstanceLeader::builder()
        .g2(g2.clone())
        .g3(g3.clone())
        .build()
        .unwrap();
    let session = leader.begin_onboarding(&hashes);
    assert_eq!(session.prefix_len(), 6);
    session
        .prepare(MoversToG2 {
            // SAFETY: the test's ranks have layouts of this manager's blocks; nothing else writes them.
            g3_to_g2: Some(Arc::new(unsafe {
                SpmdMover::<G3, G2>::new(workers.clone(), g2.clone())
            })),
            g4_to_g2: None,
            remote_g2: None,
        })
        .await
        .unwrap();
    assert_eq!(session.phase(), Phase::Staged);
    session
        .onboard(
            // SAFETY: the test's ranks have layouts of this manager's blocks; nothing else writes them.
            Arc::new(unsafe { SpmdMover::<G2, G1>::new(workers, g1.clone()) }),
            g1.allocate_blocks(6).unwrap(),
        )
        .await
        .unwrap();
    let FinishOutcome::Finished(on_g1) = session.finish() else {
        panic!("complete");
    };
    for (r, w) in ranks.iter().enumerate() {
        let l = w
            .transfer_manager()
            .layout(w.layout(TierId::G1).unwrap())
            .unwrap();
        for (i, b) in on_g1.iter().enumerate() {
            assert_eq!(b.sequence_hash(), hashes[i]);
            assert_eq!(
                bytes(&l, b.block_id()),
                expected[r][i],
                "rank {r} block {i}"
            );
        }
    }
    assert_ne!(expected[0], expected[1], "the ranks hold different bytes");
}
