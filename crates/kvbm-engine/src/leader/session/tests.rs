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
    session.prepare(MoversToG2::default()).await.unwrap();
    assert_eq!(session.phase(), Phase::Staged);
    assert_eq!(session.staged().len(), 2);
    let again = session.prepare(MoversToG2::default()).await.unwrap_err();
    assert_eq!(
        again,
        SessionError::WrongPhase {
            expected: Phase::Holding,
            actual: Phase::Staged
        }
    );
    assert_eq!(session.abort(), Phase::Aborted);
    assert_eq!(
        session.prepare(MoversToG2::default()).await.unwrap_err(),
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
                        let r = rt.block_on(session.prepare(MoversToG2::default()));
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

mod layerwise_model {
    //! A proptest of layer-wise onboarding against a model: a scripted in-memory layer mover
    //! fails at layer `f` and/or aborts the session while layer `a` moves (`None`: never). The
    //! session ends `Failed` (failure first), `Aborted` (abort first; the layer in flight
    //! settles, no later layer starts) or `Complete`; `layer_ready` agrees with how it ended;
    //! every hold is released unless it completed; finish/abort afterwards are idempotent.

    use std::ops::Range;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::{Arc, Weak};

    use futures::future::BoxFuture;
    use kvbm_logical::{BlockManager, G1, G2, ImmutableBlock, MutableBlock};
    use proptest::prelude::*;

    use super::super::*;
    use super::leader_with_two_g2_blocks;
    use crate::mover::{BlockOutcome, LayerMove};

    struct Scripted {
        g1: Arc<BlockManager<G1>>,
        layers: usize,
        fail_at: Option<usize>,
        abort_at: Option<usize>,
        session: Weak<OnboardingSession>,
        calls: AtomicUsize,
    }

    impl LayerMove<G2, G1> for Scripted {
        fn destination(&self) -> &Arc<BlockManager<G1>> {
            &self.g1
        }
        fn num_layers(&self) -> usize {
            self.layers
        }
        fn move_layers<'a>(
            &'a self,
            sources: &'a [ImmutableBlock<G2>],
            destinations: &'a [MutableBlock<G1>],
            layers: Range<usize>,
        ) -> BoxFuture<'a, Vec<BlockOutcome>> {
            Box::pin(async move {
                assert_eq!(layers.len(), 1, "one layer per call");
                assert_eq!(
                    layers.start,
                    self.calls.fetch_add(1, Ordering::SeqCst),
                    "in order"
                );
                assert_eq!(sources.len(), destinations.len());
                if Some(layers.start) == self.abort_at
                    && let Some(s) = self.session.upgrade()
                {
                    assert_eq!(s.abort(), Phase::Aborting);
                }
                tokio::task::yield_now().await;
                sources
                    .iter()
                    .enumerate()
                    .map(|(i, _)| {
                        if Some(layers.start) == self.fail_at && i == 0 {
                            Err(kvbm_offload::BlockFailure::new(
                                kvbm_offload::BlockFailureKind::Io,
                                "scripted",
                            ))
                        } else {
                            Ok(())
                        }
                    })
                    .collect()
            })
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(96))]
        #[test]
        fn layerwise_onboards_follow_the_model(
            layers in 1usize..6,
            fail_at in proptest::option::of(0usize..6),
            abort_at in proptest::option::of(0usize..6),
            after in proptest::collection::vec(any::<bool>(), 0..4),
        ) {
            let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
            let (leader, g2, hashes) = leader_with_two_g2_blocks();
            let g1 = Arc::new(BlockManager::<G1>::builder().block_count(2).block_size(4).build().unwrap());
            let session = Arc::new(leader.begin_onboarding(&hashes));
            rt.block_on(session.prepare(MoversToG2::default())).unwrap();
            let mover = Arc::new(Scripted {
                g1: g1.clone(),
                layers,
                fail_at,
                abort_at,
                session: Arc::downgrade(&session),
                calls: AtomicUsize::new(0),
            });
            let onboard = rt
                .block_on(session.onboard_layerwise(mover.clone(), g1.allocate_blocks(2).unwrap()))
                .unwrap();
            let end = rt.block_on(onboard.wait());
            let f = fail_at.filter(|&f| f < layers);
            let a = abort_at.filter(|&a| a < layers);
            let (phase, done) = match (f, a) {
                (Some(f), a) if a.is_none_or(|a| f < a) => (Phase::Failed, f),
                (f, Some(a)) => (Phase::Aborted, if f == Some(a) { a } else { a + 1 }),
                (None, None) => (Phase::Complete, layers),
                (Some(_), None) => unreachable!(),
            };
            prop_assert_eq!(session.phase(), phase);
            prop_assert_eq!(onboard.layers_done(), done);
            prop_assert_eq!(mover.calls.load(Ordering::SeqCst), match phase {
                Phase::Failed => f.unwrap() + 1,
                Phase::Aborted => a.unwrap() + 1,
                _ => layers,
            }, "no layer starts after a failure or an abort");
            match phase {
                Phase::Complete => prop_assert_eq!(&end, &Ok(())),
                Phase::Aborted => prop_assert_eq!(&end, &Err(SessionError::Aborted)),
                _ => prop_assert!(matches!(end, Err(SessionError::Failed(_))), "{:?}", end),
            }
            for l in 0..layers {
                let r = rt.block_on(onboard.layer_ready(l));
                prop_assert_eq!(r.is_ok(), phase == Phase::Complete, "layer {}: {:?}", l, r);
            }
            let complete = phase == Phase::Complete;
            prop_assert_eq!(g1.available_blocks(), if complete { 0 } else { 2 });
            prop_assert_eq!(g2.available_blocks(), if complete { 0 } else { 2 });
            let mut model = phase;
            let mut handed = Vec::new();
            for finish in after {
                if finish {
                    match (model, session.finish()) {
                        (Phase::Complete, FinishOutcome::Finished(b)) => {
                            prop_assert_eq!(b.iter().map(|b| b.sequence_hash()).collect::<Vec<_>>(), hashes.clone());
                            handed = b;
                            model = Phase::Finished;
                        }
                        (Phase::Finished, FinishOutcome::AlreadyFinished)
                        | (Phase::Aborted, FinishOutcome::Aborted)
                        | (Phase::Failed, FinishOutcome::Failed(_)) => {}
                        (m, o) => prop_assert!(false, "{:?} then finish gave {:?}", m, o),
                    }
                } else {
                    if model == Phase::Complete {
                        model = Phase::Aborted;
                    }
                    prop_assert_eq!(session.abort(), model);
                }
                prop_assert_eq!(session.phase(), model);
                let g1_held = model == Phase::Complete || !handed.is_empty();
                prop_assert_eq!(g1.available_blocks(), if g1_held { 0 } else { 2 });
            }
        }
    }
}
