//! Layer-wise onboarding over the cluster plane's control seam: a rank (a `MockWorker`, a real
//! in-process worker whose calls fail on command) that fails one layer fails the session, and
//! nothing reaches G1: the G1 destinations and the G2 holds are released.

use std::sync::Arc;

use kvbm_cluster::testing::{MockFailure, mock_workers};
use kvbm_engine::InstanceId;
use kvbm_engine::leader::{FinishOutcome, InstanceLeader, MoversToG2, Phase, SessionError};
use kvbm_engine::worker::{ParallelWorkers, SpmdLayerMover};
use kvbm_logical::{BlockRegistry, G1, G2, Salt, TierId, TokenBlockSequence};
use kvbm_physical::BlockLayout;
use tokio::sync::Semaphore;

#[path = "../../kvbm-engine/tests/common/mod.rs"]
mod common;

use common::{Gated, N, manager};

const LAYERS: usize = 4;

fn geometry() -> BlockLayout {
    kvbm_physical::testing::geometry(N, LAYERS, 32)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rank_failing_a_layer_fails_the_session_and_releases_everything() {
    let registry = BlockRegistry::new();
    let g2 = manager::<G2>(&registry);
    let g1 = manager::<G1>(&BlockRegistry::new());
    let (workers, mocks) =
        mock_workers(InstanceId(7), 2, geometry(), &[TierId::G1, TierId::G2]).unwrap();
    let workers: Arc<dyn ParallelWorkers> = Arc::new(workers);
    let seq =
        TokenBlockSequence::from_tokens(&(0..12).collect::<Vec<u32>>(), 4, Salt::NONE).unwrap();
    let complete = g2
        .allocate_blocks(3)
        .unwrap()
        .into_iter()
        .zip(seq.blocks())
        .map(|(b, tb)| b.complete_token_block(tb).unwrap())
        .collect();
    drop(g2.register_blocks(complete));
    let leader = InstanceLeader::builder().g2(g2.clone()).build().unwrap();
    let session = leader.begin_onboarding(&seq.hashes());
    session.prepare(MoversToG2::default()).await.unwrap();
    let gate = Arc::new(Semaphore::new(1));
    let mover = Arc::new(Gated {
        // SAFETY: the test's ranks have layouts of this manager's blocks; nothing else writes them.
        inner: Arc::new(
            unsafe { SpmdLayerMover::<G2, G1>::new(workers, g1.clone(), LAYERS) }.unwrap(),
        ),
        gate: gate.clone(),
    });
    let onboard = session
        .onboard_layerwise(mover, g1.allocate_blocks(3).unwrap())
        .await
        .unwrap();
    onboard.layer_ready(0).await.unwrap();
    mocks[1].fail_next(MockFailure::Gone);
    gate.add_permits(LAYERS);
    let err = onboard.layer_ready(1).await.unwrap_err();
    let SessionError::Failed(f) = err else {
        panic!("not a failure: {err}");
    };
    assert_eq!(f.phase, Phase::Onboarding);
    assert_eq!(f.failed_blocks, 3);
    assert!(f.message.starts_with("layer 1:"), "{}", f.message);
    assert_eq!(onboard.layers_done(), 1);
    assert_eq!(session.phase(), Phase::Failed);
    assert!(matches!(session.finish(), FinishOutcome::Failed(_)));
    assert_eq!(session.abort(), Phase::Failed);
    assert_eq!(g1.available_blocks(), N, "G1 destinations released");
    assert_eq!(g2.allocate_blocks(N).map(|v| v.len()).ok(), Some(N));
}
