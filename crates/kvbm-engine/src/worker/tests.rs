//! Unit tests of the SPMD workers on host memory: every rank moves, results merge per block,
//! one rank's failure fails the block for all and returns the destination after all settled.

use std::sync::Arc;

use kvbm_logical::{BlockManager, G1, G2, Salt, TokenBlockSequence};
use kvbm_physical::{BlockLayout, PhysicalLayout, PinPolicy, TransferManager};

use super::*;

fn geometry(n: usize) -> BlockLayout {
    kvbm_physical::testing::geometry(n, 2, 16)
}

fn host(tm: &TransferManager, n: usize) -> kvbm_physical::LayoutHandle {
    tm.register_layout(PhysicalLayout::allocate_host(geometry(n), PinPolicy::Unpinned).unwrap())
        .unwrap()
}

fn worker(rank: usize, with_g1: bool) -> PhysicalWorker {
    let tm = Arc::new(TransferManager::new().unwrap());
    let g2 = host(&tm, 4);
    let mut w = PhysicalWorker::new(rank, tm.clone()).with_layout(TierId::G2, g2);
    if with_g1 {
        w = w.with_layout(TierId::G1, host(&tm, 4));
    }
    w
}

#[test]
fn ranks_must_be_in_order() {
    assert!(SpmdParallelWorkers::new(vec![]).is_err());
    let err = SpmdParallelWorkers::new(vec![worker(1, true)]).unwrap_err();
    assert_eq!(err.config_key(), Some("workers"));
    assert_eq!(
        SpmdParallelWorkers::new(vec![worker(0, true), worker(1, true)])
            .unwrap()
            .world_size(),
        2
    );
}

/// A G2 manager with two registered (held) blocks, and an empty G1 manager.
type Fixture = (
    Arc<BlockManager<G2>>,
    Arc<BlockManager<G1>>,
    Vec<ImmutableBlock<G2>>,
);

/// A 4-block manager of block size 4.
fn small<T: Tier>() -> Arc<BlockManager<T>> {
    Arc::new(
        BlockManager::<T>::builder()
            .block_count(4)
            .block_size(4)
            .build()
            .unwrap(),
    )
}

fn blocks() -> Fixture {
    let g2 = small::<G2>();
    let g1 = small::<G1>();
    let seq =
        TokenBlockSequence::from_tokens(&(0..8).collect::<Vec<u32>>(), 4, Salt::NONE).unwrap();
    let complete = g2
        .allocate_blocks(2)
        .unwrap()
        .into_iter()
        .zip(seq.blocks())
        .map(|(b, tb)| b.complete_token_block(tb).unwrap())
        .collect();
    let held = g2.register_blocks(complete);
    (g2, g1, held)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_rank_moves_and_blocks_register_once() {
    let (_g2, g1, held) = blocks();
    let workers: Arc<dyn ParallelWorkers> =
        Arc::new(SpmdParallelWorkers::new(vec![worker(0, true), worker(1, true)]).unwrap());
    // SAFETY: the test's ranks have G1 layouts of `g1`'s blocks; nothing else writes them.
    let mover = unsafe { SpmdMover::<G2, G1>::new(workers, g1.clone()) };
    let out = mover.move_from(&held, g1.allocate_blocks(2).unwrap()).await;
    assert!(out.iter().all(Result::is_ok), "{out:?}");
    let hashes: Vec<_> = held.iter().map(|b| b.sequence_hash()).collect();
    assert_eq!(g1.match_blocks(&hashes).len(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_failing_rank_fails_the_block_and_returns_the_destination() {
    let (_g2, g1, held) = blocks();
    // Rank 1 has no G1 layout: every block fails there, though rank 0 moves it.
    let workers: Arc<dyn ParallelWorkers> =
        Arc::new(SpmdParallelWorkers::new(vec![worker(0, true), worker(1, false)]).unwrap());
    // SAFETY: the test's ranks have G1 layouts of `g1`'s blocks; nothing else writes them.
    let mover = unsafe { SpmdMover::<G2, G1>::new(workers, g1.clone()) };
    let out = mover.move_from(&held, g1.allocate_blocks(2).unwrap()).await;
    assert_eq!(out.len(), 2);
    for o in &out {
        let m = o.as_ref().unwrap_err();
        assert!(m.message.starts_with("rank 1:"), "{m}");
        assert_eq!(m.kind, BlockFailureKind::Refused, "{m}");
    }
    drop(out);
    assert_eq!(g1.available_blocks(), 4, "destinations went back");
    let hashes: Vec<_> = held.iter().map(|b| b.sequence_hash()).collect();
    assert!(g1.match_blocks(&hashes).is_empty(), "nothing registered");
}

/// Rank `rank` with G1 and G2 bound to `g1` / `g2` (4 blocks each).
fn bound_worker(
    rank: usize,
    g1: &Arc<BlockManager<G1>>,
    g2: &Arc<BlockManager<G2>>,
) -> PhysicalWorker {
    let tm = Arc::new(TransferManager::new().unwrap());
    PhysicalWorker::from_tiers(
        rank,
        BoundTiers {
            transfer_manager: tm.clone(),
            g1: Some(BoundTier::new(tm.clone(), host(&tm, 4), g1.clone()).unwrap()),
            g2: Some(BoundTier::new(tm.clone(), host(&tm, 4), g2.clone()).unwrap()),
            g3: None,
            g4: None,
        },
    )
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bound_tiers_are_checked_per_rank_and_give_the_layer_count() {
    let (g2, g1, held) = blocks();
    // A tier bound to another rank's transfer manager is refused.
    let other = Arc::new(TransferManager::new().unwrap());
    let foreign = BoundTier::new(other.clone(), host(&other, 4), g1.clone()).unwrap();
    let tm = Arc::new(TransferManager::new().unwrap());
    let err = PhysicalWorker::new(0, tm).with_tier(foreign).unwrap_err();
    assert_eq!(err.config_key(), Some("workers"));
    assert!(err.to_string().contains("G1"), "{err}");

    let w0 = bound_worker(0, &g1, &g2);
    assert!(w0.bound::<G1>().is_some() && w0.bound::<kvbm_logical::G3>().is_none());
    assert_eq!(
        w0.resolve(kvbm_logical::TierId::G2),
        Some(w0.bound::<G2>().unwrap().layout())
    );
    let spmd = Arc::new(SpmdParallelWorkers::new(vec![w0, bound_worker(1, &g1, &g2)]).unwrap());
    spmd.check_bound(&g1).unwrap();
    let another_g1 = small::<G1>();
    let err = spmd.check_bound(&another_g1).unwrap_err();
    assert!(err.to_string().contains("rank 0"), "{err}");
    assert!(SpmdMover::<G2, G1>::bound(spmd.clone(), another_g1.clone()).is_err());
    // A mover proven over `g1` refuses destinations of another G1 manager (their ids would be
    // another owner's slots in the ranks' layouts), whole or layer by layer; nothing moves.
    let mover = SpmdMover::<G2, G1>::bound(spmd.clone(), g1.clone()).unwrap();
    let layers = SpmdLayerMover::<G2, G1>::bound(spmd.clone(), g1.clone()).unwrap();
    let foreign = another_g1.allocate_blocks(2).unwrap();
    let out = layers.move_layers(&held, &foreign, 0..1).await;
    assert!(
        out.iter().all(|o| o
            .as_ref()
            .unwrap_err()
            .message
            .contains("not a block of the mover's G1")),
        "{out:?}"
    );
    let out = mover.move_from(&held, foreign).await;
    assert!(
        out.iter()
            .all(|o| o.as_ref().unwrap_err().kind == BlockFailureKind::Refused),
        "{out:?}"
    );
    assert!(g1.match_blocks(&[held[0].sequence_hash()]).is_empty());
    // A rank with an unbound layout is named.
    let mixed = Arc::new(
        SpmdParallelWorkers::new(vec![bound_worker(0, &g1, &g2), worker(1, true)]).unwrap(),
    );
    let err = mixed.check_bound(&g1).unwrap_err();
    assert!(err.to_string().contains("rank 1: no bound G1"), "{err}");

    // Layer-wise over the bound ranks: the layer count comes from their layouts.
    let layer_mover = SpmdLayerMover::<G2, G1>::bound(spmd.clone(), g1.clone()).unwrap();
    assert_eq!(layer_mover.num_layers(), 2);
    let dst = g1.allocate_blocks(2).unwrap();
    for l in 0..2 {
        let out = layer_mover.move_layers(&held, &dst, l..l + 1).await;
        assert_eq!(out, vec![Ok(()), Ok(())]);
    }
    let out = layer_mover.move_layers(&held, &dst, 2..3).await;
    assert!(
        out.iter()
            .all(|o| o.as_ref().unwrap_err().message.contains("outside")),
        "{out:?}"
    );
    assert!(
        g1.match_blocks(&held.iter().map(|b| b.sequence_hash()).collect::<Vec<_>>())
            .is_empty(),
        "a layer move registers nothing"
    );
    drop(dst);
    assert_eq!(g1.available_blocks(), 4);
}

/// A G2 block registered with a digest goes to G3 through the offload lanes' mover (the disk
/// header carries the digest) and comes back through the workers: the request carries the
/// digest, the read checks it, and the G2 destination keeps it. The same slot asked for under
/// another digest is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn digests_travel_with_worker_transfers_and_are_checked() {
    let dir = tempfile::tempdir().unwrap();
    let tm = Arc::new(TransferManager::new().unwrap());
    let g2 = small::<G2>();
    let g3 = small::<kvbm_logical::G3>();
    let disk = PhysicalLayout::create_disk(
        geometry(4),
        &kvbm_physical::DiskConfig::new(dir.path().join("g3.bin")),
    )
    .unwrap();
    let g2_bound = BoundTier::new(tm.clone(), host(&tm, 4), g2.clone()).unwrap();
    let g3_bound =
        BoundTier::new(tm.clone(), tm.register_layout(disk).unwrap(), g3.clone()).unwrap();
    let h = TokenBlockSequence::from_tokens(&[1, 2, 3, 4], 4, Salt::NONE)
        .unwrap()
        .hashes()[0];
    let digest = kvbm_logical::BlockDigest([7; 32]);
    let first = g2.allocate_blocks(1).unwrap().pop().unwrap();
    let src = g2.register_blocks(vec![first.complete_with_digest(h, Some(digest)).unwrap()]);
    let down = kvbm_offload::BlockMover::new(&g2_bound, &g3_bound).unwrap();
    let on_g3: Vec<_> = down
        .move_from(&src, g3.allocate_blocks(1).unwrap())
        .await
        .into_iter()
        .map(Result::unwrap)
        .collect();
    assert_eq!(on_g3[0].digest(), Some(digest));
    drop(src);
    assert_eq!(g2.reset_inactive_pool(), 1);

    let worker = PhysicalWorker::from_tiers(
        0,
        BoundTiers {
            transfer_manager: tm.clone(),
            g1: None,
            g2: Some(g2_bound),
            g3: Some(g3_bound),
            g4: None,
        },
    )
    .unwrap();
    let workers: Arc<dyn ParallelWorkers> =
        Arc::new(SpmdParallelWorkers::new(vec![worker]).unwrap());
    // SAFETY: the rank's G2 tier is bound to `g2`; nothing else writes it.
    let up = unsafe { SpmdMover::<kvbm_logical::G3, G2>::new(workers.clone(), g2.clone()) };
    let back = up.move_from(&on_g3, g2.allocate_blocks(1).unwrap()).await;
    let b = back[0]
        .as_ref()
        .expect("the digest travelled and the read passed");
    assert_eq!(
        b.digest(),
        Some(digest),
        "the destination keeps the identity"
    );
    drop(back);

    // The same slot under another digest fails the identity check.
    let dst = g2.allocate_blocks(1).unwrap();
    let mut wrong =
        TransferRequest::from_sources(TierId::G2, &on_g3, dst.iter().map(|d| d.block_id()));
    assert_eq!(wrong.digests, vec![Some(digest)]);
    wrong.digests = vec![Some(kvbm_logical::BlockDigest([8; 32]))];
    // SAFETY: test-owned layouts; `dst` holds the destination, nothing else touches the slots.
    let out = workers.execute(unsafe { Reserved::vouched(wrong) }).await;
    assert!(out[0].is_err(), "{out:?}");
}
