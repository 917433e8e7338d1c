//! Onboarding sessions on real storage: a prefix split across G2 (host memory) and G3 (an
//! O_DIRECT file) is found, held, staged G3→G2 and onboarded G2→G1 (host memory standing in
//! for the device), with every byte verified; a block that fails to stage fails the session
//! and releases everything; abort racing prepare/finish, and a dropped `prepare` future, are
//! harmless.

use std::sync::Arc;
use std::time::Duration;

use kvbm_engine::leader::{
    FinishOutcome, InstanceLeader, MoversToG2, OnboardingSession, Phase, SessionError,
};
use kvbm_engine::mover::BlockMove;
use kvbm_logical::{
    BlockManager, BlockRegistry, G1, G2, G3, ImmutableBlock, Salt, SequenceHash, Tier,
    TokenBlockSequence,
};
use kvbm_physical::{DiskConfig, LayoutHandle, PhysicalLayout, PinPolicy, TransferManager};

mod common;

use common::{N, bytes, fill, geometry, manager};

fn register<T: Tier>(
    m: &BlockManager<T>,
    seq: &TokenBlockSequence,
    idx: &[usize],
) -> Vec<ImmutableBlock<T>> {
    let complete = m
        .allocate_blocks(idx.len())
        .unwrap()
        .into_iter()
        .zip(idx)
        .map(|(b, &i)| b.complete_token_block(&seq.blocks()[i]).unwrap())
        .collect();
    m.register_blocks(complete)
}

struct Rig {
    _dir: tempfile::TempDir,
    tm: Arc<TransferManager>,
    leader: InstanceLeader,
    g2: Arc<BlockManager<G2>>,
    g3: Arc<BlockManager<G3>>,
    g1: Arc<BlockManager<G1>>,
    g2_h: LayoutHandle,
    g3_h: LayoutHandle,
    g1_h: LayoutHandle,
    hashes: Vec<SequenceHash>,
    /// Expected bytes of prefix block i.
    expected: Vec<Vec<u8>>,
}

/// Blocks 0,1 in G2; 2..6 written to G3 (the O_DIRECT file) from a separate host buffer and
/// registered there; block 6 nowhere.
async fn rig() -> Rig {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let tm = Arc::new(TransferManager::new().unwrap());
    let registry = BlockRegistry::new();
    let seq =
        TokenBlockSequence::from_tokens(&(0..32).collect::<Vec<u32>>(), 4, Salt::NONE).unwrap();
    let g2 = manager::<G2>(&registry);
    let g3 = manager::<G3>(&registry);
    let g1 = manager::<G1>(&BlockRegistry::new());

    let host = PhysicalLayout::allocate_host(geometry(), PinPolicy::Unpinned).unwrap();
    fill(&host, 5);
    let g2_h = tm.register_layout(host).unwrap();
    let g3_h = tm
        .register_layout(
            PhysicalLayout::create_disk(geometry(), &DiskConfig::new(dir.path().join("g3.bin")))
                .unwrap(),
        )
        .unwrap();
    let g1_h = tm
        .register_layout(PhysicalLayout::allocate_host(geometry(), PinPolicy::Unpinned).unwrap())
        .unwrap();
    // The writer of the disk tier: its own manager and host memory with other contents.
    let src = manager::<G2>(&BlockRegistry::new());
    let src_host = PhysicalLayout::allocate_host(geometry(), PinPolicy::Unpinned).unwrap();
    fill(&src_host, 9);
    let src_h = tm.register_layout(src_host).unwrap();

    let in_g2 = register(&g2, &seq, &[0, 1]);
    let in_src = register(&src, &seq, &[2, 3, 4, 5]);
    let down = common::mover(&tm, src_h, g3_h, &g3);
    let written = down
        .move_from(&in_src, g3.allocate_blocks(4).unwrap())
        .await;
    assert!(written.iter().all(Result::is_ok), "{written:?}");
    drop(written);

    let g2_layout = tm.layout(g2_h).unwrap();
    let src_layout = tm.layout(src_h).unwrap();
    let mut expected: Vec<Vec<u8>> = in_g2
        .iter()
        .map(|b| bytes(&g2_layout, b.block_id()))
        .collect();
    expected.extend(in_src.iter().map(|b| bytes(&src_layout, b.block_id())));
    drop((in_g2, in_src));

    let leader = InstanceLeader::builder()
        .g2(g2.clone())
        .g3(g3.clone())
        .build()
        .unwrap();
    Rig {
        _dir: dir,
        tm,
        leader,
        g2,
        g3,
        g1,
        g2_h,
        g3_h,
        g1_h,
        hashes: seq.hashes(),
        expected,
    }
}

impl Rig {
    fn movers(&self) -> MoversToG2 {
        MoversToG2 {
            g3_to_g2: Some(Arc::new(common::mover(
                &self.tm, self.g3_h, self.g2_h, &self.g2,
            ))),
            g4_to_g2: None,
            remote_g2: None,
        }
    }

    fn onboard_mover(&self) -> Arc<dyn BlockMove<G2, G1>> {
        Arc::new(common::mover(&self.tm, self.g2_h, self.g1_h, &self.g1))
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn g2_and_g3_prefix_staged_and_onboarded_bytes_verified() {
    let r = rig().await;
    let session = r.leader.begin_onboarding(&r.hashes[..7]);
    assert_eq!(session.prefix_len(), 6, "block 6 is nowhere");

    session.prepare(r.movers()).await.unwrap();
    assert_eq!(session.phase(), Phase::Staged);
    let staged = session.staged();
    assert_eq!(
        staged.iter().map(|b| b.sequence_hash()).collect::<Vec<_>>(),
        r.hashes[..6].to_vec()
    );
    drop(staged);
    // Staged blocks are now matchable in G2 (registered only once their bytes arrived).
    assert_eq!(r.g2.match_blocks(&r.hashes[..6]).len(), 6);

    session
        .onboard(r.onboard_mover(), r.g1.allocate_blocks(6).unwrap())
        .await
        .unwrap();
    assert_eq!(session.phase(), Phase::Complete);

    let FinishOutcome::Finished(on_g1) = session.finish() else {
        panic!("first finish hands the blocks over");
    };
    assert!(matches!(session.finish(), FinishOutcome::AlreadyFinished));
    assert_eq!(
        session.abort(),
        Phase::Finished,
        "abort after finish: no-op"
    );

    let g1_layout = r.tm.layout(r.g1_h).unwrap();
    assert_eq!(on_g1.len(), 6);
    for (i, b) in on_g1.iter().enumerate() {
        assert_eq!(b.sequence_hash(), r.hashes[i]);
        assert_eq!(bytes(&g1_layout, b.block_id()), r.expected[i], "block {i}");
    }
    // The G2 holds are released: every G2 slot can be taken again.
    assert_eq!(r.g2.allocate_blocks(N).map(|v| v.len()).ok(), Some(N));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_block_that_fails_to_stage_fails_the_session_and_releases_everything() {
    let r = rig().await;
    // Block 6 registered in G3 but never written: its disk slot holds no such block.
    let seq_hash = r.hashes[6];
    let bogus = r.g3.allocate_blocks(1).unwrap().pop().unwrap();
    drop(r.g3.register_blocks(vec![bogus.complete(seq_hash).unwrap()]));
    let available = r.g2.available_blocks();

    let session = r.leader.begin_onboarding(&r.hashes[..7]);
    assert_eq!(session.prefix_len(), 7);
    let err = session.prepare(r.movers()).await.unwrap_err();
    let SessionError::Failed(failure) = err else {
        panic!("not a failure: {err}");
    };
    assert_eq!(failure.phase, Phase::Staging);
    assert_eq!(failure.failed_blocks, 1);
    assert_eq!(session.phase(), Phase::Failed);
    assert!(
        session.staged().is_empty(),
        "nothing served from a failed staging"
    );
    assert_eq!(r.g2.available_blocks(), available, "destinations went back");
    assert!(
        r.g2.match_blocks(&r.hashes[6..7]).is_empty(),
        "the failed block was never registered in G2"
    );
    assert!(matches!(session.finish(), FinishOutcome::Failed(_)));
    assert_eq!(session.abort(), Phase::Failed);
    assert!(matches!(
        session
            .onboard(r.onboard_mover(), r.g1.allocate_blocks(1).unwrap())
            .await,
        Err(SessionError::Failed(_))
    ));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn abort_racing_prepare_and_finish_is_harmless() {
    let r = rig().await;
    let baseline = r.g2.available_blocks();
    for round in 0..16 {
        let session = Arc::new(r.leader.begin_onboarding(&r.hashes[..6]));
        let s1 = session.clone();
        let movers = r.movers();
        let prepare = tokio::spawn(async move { s1.prepare(movers).await });
        if round % 2 == 0 {
            tokio::task::yield_now().await;
        }
        let s2 = session.clone();
        let aborter = tokio::spawn(async move { s2.abort() });
        let s3 = session.clone();
        let finisher = tokio::spawn(async move { s3.finish() });
        let _ = aborter.await.unwrap();
        let finished = finisher.await.unwrap();
        assert!(
            !matches!(finished, FinishOutcome::Finished(_)),
            "never complete without onboarding"
        );
        let prepared = prepare.await.unwrap();
        let phase = session.settled().await;
        // Either the abort came first (prepare refused or its transfer settled into Aborted),
        // or prepare finished first and the abort released the staged prefix.
        assert_eq!(phase, Phase::Aborted, "round {round}: {prepared:?}");
        assert_eq!(session.abort(), Phase::Aborted);
        assert!(matches!(session.finish(), FinishOutcome::Aborted));
        assert_eq!(
            r.g2.available_blocks(),
            baseline,
            "round {round}: every hold and destination released"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_prepare_future_still_settles_its_transfer() {
    let r = rig().await;
    let session: OnboardingSession = r.leader.begin_onboarding(&r.hashes[..6]);
    // Drop the future right after it started the transfer.
    let _ = tokio::time::timeout(Duration::ZERO, session.prepare(r.movers())).await;
    let phase = session.settled().await;
    assert_eq!(
        phase,
        Phase::Staged,
        "the transfer ran to its end without the caller"
    );
    assert_eq!(session.staged().len(), 6);
    drop(session);
    assert_eq!(r.g2.allocate_blocks(N).map(|v| v.len()).ok(), Some(N));
}
