//! Layer-wise onboarding with the workers in separate processes: a leader (this test) and two
//! `kvbm-engine-worker` processes over a real `nats-server` (feature `nats`). The leader finds
//! and holds a prefix, stages it G3→G2 through the workers, then onboards it G2→G1 one layer
//! per request (`TransferRequest::layers` over NATS). A gate lets one layer through at a time:
//! after layer 0 every rank's G1 blocks differ from their original bytes (layer 1 has not
//! arrived), after the last layer they equal them (digests computed by each worker); nothing
//! is registered in G1 before the last layer. The harness is `tests/nats_workers.rs`'s.

use std::sync::Arc;
use std::time::Duration;

use kvbm_cluster::transport::control::{ControlRequest, ControlResponse};
use kvbm_engine::leader::{FinishOutcome, InstanceLeader, MoversToG2, Phase};
use kvbm_engine::worker::{ParallelWorkers, SpmdLayerMover, SpmdMover};
use kvbm_logical::{G2, G3, TierId};
use tokio::sync::Semaphore;

#[path = "../../kvbm-engine/tests/common/mod.rs"]
mod common;

use common::{Gated, geometry};

mod worker_processes;

use worker_processes::{WorkerProcess, digests, instance_id, set_up};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_worker_processes_onboard_a_disk_prefix_layer_by_layer_bytes_verified() {
    let Some(nats) = kvbm_tests::services::nats("two_worker_processes_layer_by_layer") else {
        return;
    };
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let instance = instance_id(3);
    let _w: Vec<WorkerProcess> = (0..2)
        .map(|r| WorkerProcess::spawn(&nats.url, instance, r, dir.path(), &[]))
        .collect();
    let i = set_up(&nats.url, instance, Duration::from_secs(30)).await;
    let pw: Arc<dyn ParallelWorkers> = i.workers.clone();
    let layers = geometry().config().num_layers;
    assert!(layers >= 2);

    let leader = InstanceLeader::builder()
        .g2(i.g2.clone())
        .g3(i.g3.clone())
        .build()
        .unwrap();
    let session = leader.begin_onboarding(&i.hashes);
    assert_eq!(session.prefix_len(), 6);
    session
        .prepare(MoversToG2 {
            // SAFETY: the test's ranks have layouts of this manager's blocks; nothing else writes them.
            g3_to_g2: Some(Arc::new(unsafe {
                SpmdMover::<G3, G2>::new(pw.clone(), i.g2.clone())
            })),
            ..MoversToG2::default()
        })
        .await
        .unwrap();
    assert_eq!(session.phase(), Phase::Staged);
    // Every rank's G1 starts from a pattern unlike its G2 bytes.
    for c in &i.controls {
        let r = c
            .call(ControlRequest::Fill {
                tier: TierId::G1,
                seed: 0x11,
            })
            .await
            .unwrap();
        assert_eq!(r, ControlResponse::Done);
    }
    let gate = Arc::new(Semaphore::new(1));
    let onboard = session
        .onboard_layerwise(
            Arc::new(Gated {
                // SAFETY: the test's ranks have layouts of this manager's blocks; nothing else writes them.
                inner: Arc::new(unsafe { SpmdLayerMover::new(pw, i.g1.clone(), layers) }.unwrap()),
                gate: gate.clone(),
            }),
            i.g1.allocate_blocks(6).unwrap(),
        )
        .await
        .unwrap();
    onboard.layer_ready(0).await.unwrap();
    let ids = onboard.g1_block_ids().to_vec();
    for (r, c) in i.controls.iter().enumerate() {
        let d = digests(c.as_ref(), TierId::G1, ids.clone()).await;
        for (b, (got, want)) in d.iter().zip(&i.expected[r]).enumerate() {
            assert_ne!(got, want, "rank {r} block {b}: only layer 0 has arrived");
        }
    }
    assert!(
        i.g1.match_blocks(&i.hashes[..1]).is_empty(),
        "nothing is registered in G1 before the last layer"
    );
    gate.add_permits(layers - 1);
    onboard.wait().await.unwrap();
    let FinishOutcome::Finished(on_g1) = session.finish() else {
        panic!("complete");
    };
    assert_eq!(on_g1.iter().map(|b| b.block_id()).collect::<Vec<_>>(), ids);
    for (r, c) in i.controls.iter().enumerate() {
        assert_eq!(
            digests(c.as_ref(), TierId::G1, ids.clone()).await,
            i.expected[r],
            "rank {r}: G1 holds its own original bytes, every layer"
        );
    }
}
