//! Rank-aware workers ([`CoordinatedWorker`]): two ranks of one tensor-parallel world share
//! one object store (a real directory through `object_store`'s local file system), each
//! writes the same block (same sequence hash, its own bytes) to G4 through the SPMD workers
//! and reads back its own bytes, because each rank's keys live under `tp2.r{rank}/`; requests
//! and layout handles addressed to another rank are refused with a typed error; a worker whose
//! G4 storage was built for another rank or world size is refused at construction.

mod common;

use std::sync::Arc;

use common::{bytes, fill, geometry};
use kvbm_engine::EngineError;
use kvbm_engine::RankAddress;
use kvbm_engine::worker::{
    AddressedRequest, CoordinatedWorker, ParallelWorkers, PhysicalWorker, Reserved,
    SpmdParallelWorkers, TransferRequest,
};
use kvbm_logical::{Salt, TierId, TokenBlockSequence};
use kvbm_physical::{ObjectConfig, ObjectStorage, PhysicalLayout, PinPolicy, TransferManager};

/// Rank `rank` with a host G2 filled with `seed` and a G4 over `root` built for
/// `storage_rank` of `storage_world`.
fn rank(
    rank: usize,
    root: &std::path::Path,
    storage_rank: usize,
    storage_world: usize,
) -> PhysicalWorker {
    let tm = Arc::new(TransferManager::new().unwrap());
    let g2 = PhysicalLayout::allocate_host(geometry(), PinPolicy::Unpinned).unwrap();
    fill(&g2, 0x10 + rank as u8);
    let g2 = tm.register_layout(g2).unwrap();
    let config = CoordinatedWorker::object_config(
        RankAddress {
            rank: storage_rank,
            world_size: storage_world,
        },
        &ObjectConfig::default(),
    );
    let storage = Arc::new(ObjectStorage::local(root, config).unwrap());
    let g4 = tm
        .register_layout(PhysicalLayout::object(geometry(), storage))
        .unwrap();
    PhysicalWorker::new(rank, tm)
        .with_layout(TierId::G2, g2)
        .with_layout(TierId::G4, g4)
}

fn g2_bytes(w: &PhysicalWorker, block: usize) -> Vec<u8> {
    let l = w
        .transfer_manager()
        .layout(w.layout(TierId::G2).unwrap())
        .unwrap();
    bytes(&l, block)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_rank_writes_and_reads_its_own_g4_keys_and_refuses_other_ranks_requests() {
    let dir = tempfile::tempdir().unwrap();
    let c0 = CoordinatedWorker::new(rank(0, dir.path(), 0, 2), 2).unwrap();
    let c1 = CoordinatedWorker::new(rank(1, dir.path(), 1, 2), 2).unwrap();
    let written = [g2_bytes(c0.worker(), 0), g2_bytes(c1.worker(), 0)];
    assert_ne!(written[0], written[1], "each rank holds its own heads");
    let spmd = SpmdParallelWorkers::from_coordinated(vec![c0.clone(), c1.clone()]).unwrap();
    assert_eq!(spmd.world_size(), 2);

    let seq =
        TokenBlockSequence::from_tokens(&(0..4).collect::<Vec<u32>>(), 4, Salt::NONE).unwrap();
    let h = seq.hashes()[0];
    // G2 slot 0 → G4 on both ranks (same hash, same relative key).
    // SAFETY: test-owned layouts; nothing else reads or writes the slots.
    let out = spmd
        .execute(unsafe {
            Reserved::vouched(TransferRequest::new(
                TierId::G2,
                TierId::G4,
                vec![(0, 0, h)],
            ))
        })
        .await;
    assert_eq!(out, vec![Ok(())]);
    let key = format!("{:032x}", h.as_u128());
    for r in 0..2 {
        let path = dir.path().join(format!("kvbm/tp2.r{r}/{key}"));
        assert!(path.exists(), "rank {r}'s object at {}", path.display());
    }
    // G4 → G2 slot 1: every rank reads back its own bytes, not the other rank's.
    // SAFETY: as above.
    let out = spmd
        .execute(unsafe {
            Reserved::vouched(TransferRequest::new(
                TierId::G4,
                TierId::G2,
                vec![(0, 1, h)],
            ))
        })
        .await;
    assert_eq!(out, vec![Ok(())]);
    assert_eq!(g2_bytes(c0.worker(), 1), written[0]);
    assert_eq!(g2_bytes(c1.worker(), 1), written[1]);

    // A request addressed to rank 1 reaching rank 0 is refused and moves nothing.
    let before = g2_bytes(c0.worker(), 2);
    let to_rank1 = c1.address_request(TransferRequest::new(
        TierId::G4,
        TierId::G2,
        vec![(0, 2, h)],
    ));
    // SAFETY: as above.
    let reserved = unsafe { Reserved::vouched(to_rank1.request.clone()) };
    match c0.execute_addressed(to_rank1.to, &reserved).await {
        Err(EngineError::WrongRank { this, to }) => {
            assert_eq!(this, c0.address());
            assert_eq!(to, c1.address());
        }
        other => panic!("expected WrongRank, got {other:?}"),
    }
    assert_eq!(g2_bytes(c0.worker(), 2), before, "nothing moved");
    // Another world size is another address too.
    let other_world = AddressedRequest {
        to: RankAddress {
            rank: 0,
            world_size: 4,
        },
        request: to_rank1.request.clone(),
    };
    assert!(matches!(
        c0.execute_addressed(other_world.to, &reserved).await,
        Err(EngineError::WrongRank { .. })
    ));
    // Addressed to itself it runs.
    let mine = c1.execute_addressed(to_rank1.to, &reserved).await.unwrap();
    assert_eq!(mine, vec![Ok(())]);
    assert_eq!(g2_bytes(c1.worker(), 2), written[1]);

    // Layout handles resolve to the rank's own layouts, only for that rank.
    assert_eq!(
        c1.resolve_for(c1.address(), TierId::G4).unwrap(),
        c1.worker().layout(TierId::G4).unwrap()
    );
    assert!(matches!(
        c0.resolve_for(c1.address(), TierId::G2),
        Err(EngineError::WrongRank { .. })
    ));
    assert!(matches!(
        c0.resolve_for(c0.address(), TierId::G3),
        Err(EngineError::TierMissing(TierId::G3))
    ));
}

#[test]
fn ranks_and_g4_storage_are_checked_against_the_world() {
    let dir = tempfile::tempdir().unwrap();
    // A rank outside its world.
    let err = CoordinatedWorker::new(rank(2, dir.path(), 0, 2), 2).unwrap_err();
    assert_eq!(err.config_key(), Some("workers.world_size"));
    assert!(CoordinatedWorker::new(rank(0, dir.path(), 0, 1), 0).is_err());
    // G4 storage built for rank 0 given to rank 1: it would write rank 0's keys.
    let err = CoordinatedWorker::new(rank(1, dir.path(), 0, 2), 2).unwrap_err();
    assert_eq!(err.config_key(), Some("physical.object.tp_rank"), "{err}");
    // G4 storage built for a single rank (no rank directory) in a world of two.
    let err = CoordinatedWorker::new(rank(0, dir.path(), 0, 1), 2).unwrap_err();
    assert_eq!(
        err.config_key(),
        Some("physical.object.tp_world_size"),
        "{err}"
    );
    // SpmdParallelWorkers::new applies the same check to plain workers.
    let err = SpmdParallelWorkers::new(vec![rank(0, dir.path(), 0, 2), rank(1, dir.path(), 0, 2)])
        .unwrap_err();
    assert_eq!(err.config_key(), Some("physical.object.tp_rank"));
    // Coordinated ranks must be 0..n of a world of n.
    let c0 = CoordinatedWorker::new(rank(0, dir.path(), 0, 3), 3).unwrap();
    let c1 = CoordinatedWorker::new(rank(1, dir.path(), 1, 3), 3).unwrap();
    let err = SpmdParallelWorkers::from_coordinated(vec![c0.clone(), c1]).unwrap_err();
    assert!(err.to_string().contains("world size"), "{err}");
    assert!(SpmdParallelWorkers::from_coordinated(vec![]).is_err());
    let c1_of_2 = CoordinatedWorker::new(rank(1, dir.path(), 1, 2), 2).unwrap();
    assert!(SpmdParallelWorkers::from_coordinated(vec![c1_of_2]).is_err());
    // One rank of one: fine, with or without a rank directory.
    let solo = CoordinatedWorker::new(rank(0, dir.path(), 0, 1), 1).unwrap();
    assert_eq!(
        SpmdParallelWorkers::from_coordinated(vec![solo])
            .unwrap()
            .world_size(),
        1
    );
}
