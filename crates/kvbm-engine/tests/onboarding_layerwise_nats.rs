//! Layer-wise onboarding with the workers in separate processes: a leader (this test) and two
//! `kvbm-engine-worker` processes over a real `nats-server` (feature `nats`). The leader finds
//! and holds a prefix, stages it G3→G2 through the workers, then onboards it G2→G1 one layer
//! per request (`TransferRequest::layers` over NATS). A gate lets one layer through at a time:
//! after layer 0 every rank's G1 blocks differ from their original bytes (layer 1 has not
//! arrived), after the last layer they equal them (digests computed by each worker); nothing
//! is registered in G1 before the last layer. The harness is `tests/nats_workers.rs`'s.

use std::io::{BufRead, BufReader};
use std::ops::Range;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::mpsc;
use std::time::Duration;

use futures::future::BoxFuture;
use kvbm_engine::leader::{FinishOutcome, InstanceLeader, Phase, StagingMovers};
use kvbm_engine::mover::{LayerMove, LayerMoved};
use kvbm_engine::transport::control::{
    ControlRequest, ControlResponse, ControlledWorkers, WorkerControl, block_digest, fill_pattern,
};
use kvbm_engine::transport::nats::{DEFAULT_CONTROL_PREFIX, NatsControl, connect};
use kvbm_engine::transport::{InstanceId, WorkerAddress};
use kvbm_engine::worker::{ParallelWorkers, SpmdLayerMover, SpmdMover};
use kvbm_logical::{
    BlockId, BlockManager, BlockRegistry, G1, G2, G3, ImmutableBlock, Salt, TierId,
    TokenBlockSequence,
};
use kvbm_physical::{PhysicalLayout, PinPolicy};
use tokio::sync::Semaphore;

mod common;

use common::{N, geometry, manager};

const SEED: u8 = 0x40;

/// One worker process; killed (and reaped) on drop.
struct WorkerProcess {
    child: Child,
    lines: mpsc::Receiver<String>,
}

impl WorkerProcess {
    fn spawn(
        url: &str,
        instance: InstanceId,
        rank: u32,
        dir: &std::path::Path,
        extra: &[&str],
    ) -> Self {
        let mut child = Command::new(env!("CARGO_BIN_EXE_kvbm-engine-worker"))
            .args(["--nats", url, "--instance", &instance.0.to_string()])
            .args(["--rank", &rank.to_string(), "--blocks", &N.to_string()])
            .args(["--inner-dim", "64", "--announce"])
            .args(["--fill-seed", &(SEED + rank as u8).to_string()])
            .arg("--g3-file")
            .arg(dir.join(format!("rank{rank}.bin")))
            .args(extra)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawn kvbm-engine-worker");
        let out = BufReader::new(child.stdout.take().unwrap());
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in out.lines().map_while(Result::ok) {
                if tx.send(line).is_err() {
                    return;
                }
            }
        });
        let w = Self { child, lines };
        w.expect_line("ready ");
        w
    }

    /// Waits for a line starting with `prefix` (skipping others).
    fn expect_line(&self, prefix: &str) -> String {
        loop {
            match self.lines.recv_timeout(Duration::from_secs(30)) {
                Ok(l) if l.starts_with(prefix) => return l,
                Ok(_) => continue,
                Err(e) => panic!("worker: no `{prefix}` line: {e}"),
            }
        }
    }

    fn kill(&mut self) {
        let _ = self.child.kill(); // SIGKILL
        let _ = self.child.wait();
    }
}

impl Drop for WorkerProcess {
    fn drop(&mut self) {
        self.kill();
    }
}

struct Instance {
    workers: Arc<ControlledWorkers>,
    controls: Vec<Arc<dyn WorkerControl>>,
    g1: Arc<BlockManager<G1>>,
    g2: Arc<BlockManager<G2>>,
    g3: Arc<BlockManager<G3>>,
    hashes: Vec<kvbm_logical::SequenceHash>,
    /// Per rank, per prefix block: the digest of its original bytes.
    expected: Vec<Vec<u64>>,
}

async fn digests(c: &dyn WorkerControl, tier: TierId, blocks: Vec<usize>) -> Vec<u64> {
    match c
        .call(ControlRequest::Digest { tier, blocks })
        .await
        .unwrap()
    {
        ControlResponse::Digests(d) => d,
        other => panic!("{other:?}"),
    }
}

/// Connects to both workers, computes 6 blocks in G2 on both ranks, offloads them to G3
/// through the workers, evicts them from G2 and overwrites every rank's G2 memory, so what
/// reaches G1 later can only come from the disks.
async fn set_up(url: &str, instance: InstanceId, timeout: Duration) -> Instance {
    let client = connect(url, "leader", Duration::from_millis(100))
        .await
        .unwrap();
    let controls: Vec<Arc<dyn WorkerControl>> = (0..2)
        .map(|r| {
            Arc::new(NatsControl::new(
                client.clone(),
                DEFAULT_CONTROL_PREFIX,
                WorkerAddress::new(instance, r),
                timeout,
            )) as Arc<dyn WorkerControl>
        })
        .collect();
    let workers = Arc::new(ControlledWorkers::new(controls.clone()).unwrap());
    let peers = workers.describe_all().await.unwrap();
    assert_eq!(peers.len(), 2);
    for (r, p) in peers.iter().enumerate() {
        assert_eq!(p.worker, WorkerAddress::new(instance, r as u32));
        assert_eq!(p.tiers, vec![TierId::G1, TierId::G2, TierId::G3]);
        assert_eq!(p.num_blocks, N);
    }

    let registry = BlockRegistry::new();
    let (g2, g3) = (manager::<G2>(&registry), manager::<G3>(&registry));
    let g1 = manager::<G1>(&BlockRegistry::new());
    let seq =
        TokenBlockSequence::from_tokens(&(0..24).collect::<Vec<u32>>(), 4, Salt::NONE).unwrap();
    let complete = g2
        .allocate_blocks(6)
        .unwrap()
        .into_iter()
        .zip(seq.blocks())
        .map(|(b, tb)| b.complete_token_block(tb).unwrap())
        .collect();
    let on_g2: Vec<ImmutableBlock<G2>> = g2.register_blocks(complete);
    let ids: Vec<usize> = on_g2.iter().map(|b| b.block_id()).collect();

    // What each rank's G2 holds, by the worker's digest and by one computed here from the
    // same pattern: they must agree, and the ranks must differ.
    let mut expected = Vec::new();
    for (r, c) in controls.iter().enumerate() {
        let d = digests(c.as_ref(), TierId::G2, ids.clone()).await;
        let local = PhysicalLayout::allocate_host(geometry(), PinPolicy::Unpinned).unwrap();
        fill_pattern(&local, SEED + r as u8);
        let here: Vec<u64> = ids
            .iter()
            .map(|&b| block_digest(&local, b).unwrap())
            .collect();
        assert_eq!(d, here, "rank {r}: the worker's bytes are the pattern");
        expected.push(d);
    }
    assert_ne!(expected[0], expected[1]);

    let pw: Arc<dyn ParallelWorkers> = workers.clone();
    let down = SpmdMover::<G2, G3>::new(pw, g3.clone());
    let out = down.move_from(&on_g2, g3.allocate_blocks(6).unwrap()).await;
    assert!(out.iter().all(Result::is_ok), "{out:?}");
    drop((out, on_g2));
    assert_eq!(g2.reset_inactive_pool(), 6);
    for c in &controls {
        let r = c
            .call(ControlRequest::Fill {
                tier: TierId::G2,
                seed: 0xEE,
            })
            .await
            .unwrap();
        assert_eq!(r, ControlResponse::Done);
    }
    Instance {
        workers,
        controls,
        g1,
        g2,
        g3,
        hashes: seq.hashes(),
        expected,
    }
}

fn instance_id(tag: u64) -> InstanceId {
    InstanceId((u64::from(std::process::id()) << 8) | tag)
}

/// A layer mover that lets one layer through per permit.
struct Gated {
    inner: SpmdLayerMover<G2, G1>,
    gate: Arc<Semaphore>,
}

impl LayerMove<G2, G1> for Gated {
    fn destination(&self) -> &Arc<BlockManager<G1>> {
        self.inner.destination()
    }

    fn num_layers(&self) -> usize {
        self.inner.num_layers()
    }

    fn move_layers<'a>(
        &'a self,
        sources: &'a [ImmutableBlock<G2>],
        destinations: &'a [BlockId],
        layers: Range<usize>,
    ) -> BoxFuture<'a, Vec<LayerMoved>> {
        Box::pin(async move {
            self.gate.acquire().await.unwrap().forget();
            self.inner.move_layers(sources, destinations, layers).await
        })
    }
}

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
        .prepare(StagingMovers {
            g3_to_g2: Some(Arc::new(SpmdMover::<G3, G2>::new(pw.clone(), i.g2.clone()))),
            ..StagingMovers::default()
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
                inner: SpmdLayerMover::new(pw, i.g1.clone(), layers).unwrap(),
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
