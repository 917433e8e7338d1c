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
