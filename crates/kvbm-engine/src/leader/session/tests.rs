//! Unit tests of the session state machine that need no transfer: holding, abort, finish,
//! drop, wrong-phase calls. Transfers on real files are in `tests/onboarding.rs`.

use std::sync::Arc;

use kvbm_logical::{BlockManager, BlockRegistry, G2, Salt, TokenBlockSequence};

use super::*;
use crate::leader::InstanceLeader;

fn leader_with_two_g2_blocks() -> (
    InstanceLeader,
    Arc<BlockManager<G2>>,
    Vec<kvbm_logical::SequenceHash>,
) {
    let registry = BlockRegistry::new();
    let g2 = Arc::new(
        BlockManager::<G2>::builder()
            .block_count(2)
            .block_size(4)
            .registry(registry)
            .build()
            .unwrap(),
    );
    let seq =
        TokenBlockSequence::from_tokens(&(0..8).collect::<Vec<u32>>(), 4, Salt::NONE).unwrap();
    let complete = g2
        .allocate_blocks(2)
        .unwrap()
        .into_iter()
        .zip(seq.blocks())
        .map(|(b, tb)| b.complete_token_block(tb).unwrap())
        .collect();
    drop(g2.register_blocks(complete));
    let leader = InstanceLeader::builder().g2(g2.clone()).build().unwrap();
    (leader, g2, seq.hashes())
}

#[test]
fn abort_while_holding_releases_at_once_and_is_idempotent() {
    let (leader, g2, hashes) = leader_with_two_g2_blocks();
    let session = leader.begin_onboarding(&hashes);
    assert_eq!(session.phase(), Phase::Holding);
    assert_eq!(session.prefix_len(), 2);
    assert!(g2.allocate_blocks(1).is_err(), "held: not evictable");
    assert_eq!(session.abort(), Phase::Aborted);
    assert!(g2.allocate_blocks(1).is_ok(), "released by the abort");
    assert_eq!(session.abort(), Phase::Aborted, "second abort: no-op");
    assert!(matches!(session.finish(), FinishOutcome::Aborted));
    assert!(matches!(session.finish(), FinishOutcome::Aborted));
}

#[test]
fn finish_before_complete_changes_nothing() {
    let (leader, g2, hashes) = leader_with_two_g2_blocks();
    let session = leader.begin_onboarding(&hashes);
    assert!(matches!(
        session.finish(),
        FinishOutcome::NotReady(Phase::Holding)
    ));
    assert_eq!(session.phase(), Phase::Holding);
    assert!(g2.allocate_blocks(1).is_err(), "still held");
}

#[test]
fn dropping_a_session_releases_its_holds() {
    let (leader, g2, hashes) = leader_with_two_g2_blocks();
    let session = leader.begin_onboarding(&hashes);
    drop(session);
    assert_eq!(g2.allocate_blocks(2).map(|v| v.len()).ok(), Some(2));
}

#[tokio::test]
async fn calls_in_the_wrong_phase_are_refused() {
    let (leader, _g2, hashes) = leader_with_two_g2_blocks();
    let session = leader.begin_onboarding(&hashes);
    // A G2-only prefix needs no mover: staging is immediate.
    session.prepare(StagingMovers::default()).await.unwrap();
    assert_eq!(session.phase(), Phase::Staged);
    assert_eq!(session.staged().len(), 2);
    let again = session.prepare(StagingMovers::default()).await.unwrap_err();
    assert_eq!(
        again,
        SessionError::WrongPhase {
            expected: Phase::Holding,
            actual: Phase::Staged
        }
    );
    assert_eq!(session.abort(), Phase::Aborted);
    assert_eq!(
        session.prepare(StagingMovers::default()).await.unwrap_err(),
        SessionError::Aborted
    );
    assert_eq!(session.settled().await, Phase::Aborted);
}

mod model {
    //! A proptest of random call sequences against a model of the phase machine: terminal
    //! phases absorb, holds are released exactly when the session ends, the G1 blocks are
    //! handed over at most once.

    use std::sync::Arc;

    use kvbm_logical::{BlockManager, G1, G2, ImmutableBlock};
    use kvbm_offload::{BlockMover, BoundTier};
    use kvbm_physical::{BlockLayout, LayoutKind, PhysicalLayout, PinPolicy, TransferManager};
    use proptest::prelude::*;

    use super::super::*;
    use super::leader_with_two_g2_blocks;

    #[derive(Copy, Clone, Debug)]
    enum Op {
        Prepare,
        Onboard,
        Finish,
        Abort,
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            Just(Op::Prepare),
            Just(Op::Onboard),
            Just(Op::Finish),
            Just(Op::Abort)
        ]
    }

    fn geometry() -> BlockLayout {
        BlockLayout::builder()
            .num_blocks(2)
            .num_layers(1)
            .outer_dim(1)
            .page_size(4)
            .inner_dim(8)
            .dtype_bytes(2)
            .kind(LayoutKind::FullyContiguous)
            .build()
            .unwrap()
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]
        #[test]
        fn random_call_sequences_follow_the_model(ops in proptest::collection::vec(op(), 1..10)) {
            let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
            let tm = Arc::new(TransferManager::new().unwrap());
            let host = |tm: &TransferManager| tm
                .register_layout(PhysicalLayout::allocate_host(geometry(), PinPolicy::Unpinned).unwrap())
                .unwrap();
            let (g2_h, g1_h) = (host(&tm), host(&tm));
            let (leader, g2, hashes) = leader_with_two_g2_blocks();
            let g1 = Arc::new(BlockManager::<G1>::builder().block_count(2).block_size(4).build().unwrap());
            let session = leader.begin_onboarding(&hashes);
            let mut model = Phase::Holding;
            let mut handed: Vec<ImmutableBlock<G1>> = Vec::new();
            let mut handovers = 0;
            for op in ops {
                match op {
                    Op::Prepare => {
                        let r = rt.block_on(session.prepare(StagingMovers::default()));
                        match model {
                            Phase::Holding => { prop_assert!(r.is_ok()); model = Phase::Staged; }
                            Phase::Aborted => prop_assert_eq!(r, Err(SessionError::Aborted)),
                            _ => prop_assert!(matches!(r, Err(SessionError::WrongPhase { .. })), "{:?}", r),
                        }
                    }
                    Op::Onboard => {
                        let mover: Arc<dyn crate::mover::BlockMove<G2, G1>> =
                            Arc::new(BlockMover::from_layout(g2_h, &BoundTier::new(tm.clone(), g1_h, g1.clone()).unwrap()).unwrap());
                        let dst = if model == Phase::Staged || g1.available_blocks() == 2 {
                            g1.allocate_blocks(2).unwrap()
                        } else {
                            Vec::new()
                        };
                        let r = rt.block_on(session.onboard(mover, dst));
                        match model {
                            Phase::Staged => { prop_assert!(r.is_ok(), "{:?}", r); model = Phase::Complete; }
                            Phase::Aborted => prop_assert_eq!(r, Err(SessionError::Aborted)),
                            _ => prop_assert!(matches!(r, Err(SessionError::WrongPhase { .. })), "{:?}", r),
                        }
                    }
                    Op::Finish => {
                        let r = session.finish();
                        match (model, r) {
                            (Phase::Complete, FinishOutcome::Finished(b)) => {
                                prop_assert_eq!(b.len(), 2);
                                handed = b;
                                handovers += 1;
                                model = Phase::Finished;
                            }
                            (Phase::Finished, FinishOutcome::AlreadyFinished) => {}
                            (Phase::Aborted, FinishOutcome::Aborted) => {}
                            (m, FinishOutcome::NotReady(p)) => prop_assert_eq!(m, p),
                            (m, other) => prop_assert!(false, "{:?} then finish gave {:?}", m, other),
                        }
                    }
                    Op::Abort => {
                        let p = session.abort();
                        if model != Phase::Finished {
                            model = Phase::Aborted;
                        }
                        prop_assert_eq!(p, model);
                    }
                }
                prop_assert_eq!(session.phase(), model);
                // Holds: G2 prefix held until the session ends; G1 held by the session while
                // Complete, by the caller once handed over, by nobody after an abort.
                let g2_held = matches!(model, Phase::Holding | Phase::Staged | Phase::Complete);
                prop_assert_eq!(g2.available_blocks(), if g2_held { 0 } else { 2 });
                let g1_held = model == Phase::Complete || !handed.is_empty();
                prop_assert_eq!(g1.available_blocks(), if g1_held { 0 } else { 2 });
            }
            prop_assert!(handovers <= 1);
        }
    }
}
