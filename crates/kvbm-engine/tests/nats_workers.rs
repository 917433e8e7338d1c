//! A leader (this test) and two worker processes (`kvbm-engine-worker`) over a real
//! `nats-server` (feature `nats`): the leader finds and holds a prefix, stages it G3→G2 and
//! onboards it to G1 through the workers, and every rank's G1 holds exactly its own original
//! bytes (checked by digests the workers compute, and against digests computed here). Then a
//! worker killed (SIGKILL) in the middle of a transfer: the session fails with a typed error,
//! the leader releases everything it held (pool counts back to where they were), a call to the
//! dead worker fails as unreachable, and the remaining worker keeps serving.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::mpsc;
use std::time::Duration;

use kvbm_engine::leader::{FinishOutcome, InstanceLeader, Phase, SessionError, StagingMovers};
use kvbm_engine::transport::control::{
    ControlError, ControlRequest, ControlResponse, ControlledWorkers, WorkerControl, block_digest,
    fill_pattern,
};
use kvbm_engine::transport::nats::{DEFAULT_CONTROL_PREFIX, NatsControl, connect};
use kvbm_engine::transport::{InstanceId, WorkerAddress};
use kvbm_engine::worker::{ParallelWorkers, SpmdMover};
use kvbm_logical::{
    BlockManager, BlockRegistry, G1, G2, G3, ImmutableBlock, PoolCounts, Salt, TierId,
    TokenBlockSequence,
};
use kvbm_physical::{PhysicalLayout, PinPolicy};

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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leader_and_two_worker_processes_onboard_a_disk_prefix_bytes_verified_per_rank() {
    let Some(nats) = kvbm_tests::services::nats("leader_and_two_worker_processes") else {
        return;
    };
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let instance = instance_id(1);
    let _w: Vec<WorkerProcess> = (0..2)
        .map(|r| WorkerProcess::spawn(&nats.url, instance, r, dir.path(), &[]))
        .collect();
    let i = set_up(&nats.url, instance, Duration::from_secs(30)).await;
    let pw: Arc<dyn ParallelWorkers> = i.workers.clone();

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
            g4_to_g2: None,
            remote_g2: None,
        })
        .await
        .unwrap();
    assert_eq!(session.phase(), Phase::Staged);
    session
        .onboard(
            Arc::new(SpmdMover::<G2, G1>::new(pw, i.g1.clone())),
            i.g1.allocate_blocks(6).unwrap(),
        )
        .await
        .unwrap();
    let FinishOutcome::Finished(on_g1) = session.finish() else {
        panic!("complete");
    };
    let ids: Vec<usize> = on_g1.iter().map(|b| b.block_id()).collect();
    for (b, h) in on_g1.iter().zip(&i.hashes) {
        assert_eq!(b.sequence_hash(), *h);
    }
    for (r, c) in i.controls.iter().enumerate() {
        assert_eq!(
            digests(c.as_ref(), TierId::G1, ids.clone()).await,
            i.expected[r],
            "rank {r}: G1 holds its own original bytes"
        );
    }
}

fn idle(c: PoolCounts) -> bool {
    c.held == 0 && c.active == 0
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_killed_mid_transfer_fails_cleanly_and_the_other_keeps_serving() {
    let Some(nats) = kvbm_tests::services::nats("a_worker_killed_mid_transfer") else {
        return;
    };
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let instance = instance_id(2);
    let w0 = WorkerProcess::spawn(&nats.url, instance, 0, dir.path(), &[]);
    // Rank 1 sits on every G3→G2 transfer long enough to be killed in the middle of it.
    let mut w1 = WorkerProcess::spawn(
        &nats.url,
        instance,
        1,
        dir.path(),
        &["--delay-from", "G3", "--delay-ms", "60000"],
    );
    let timeout = Duration::from_secs(3);
    let i = set_up(&nats.url, instance, timeout).await;
    let pw: Arc<dyn ParallelWorkers> = i.workers.clone();
    let (g2_before, g3_before) = (i.g2.pool_counts(), i.g3.pool_counts());
    assert!(idle(g2_before) && idle(g3_before));

    let leader = InstanceLeader::builder()
        .g2(i.g2.clone())
        .g3(i.g3.clone())
        .build()
        .unwrap();
    let session = Arc::new(leader.begin_onboarding(&i.hashes));
    assert_eq!(session.prefix_len(), 6);
    assert_eq!(
        i.g3.pool_counts().active,
        6,
        "the session holds the G3 prefix"
    );
    let staging = {
        let (session, pw, g2) = (session.clone(), pw.clone(), i.g2.clone());
        tokio::spawn(async move {
            session
                .prepare(StagingMovers {
                    g3_to_g2: Some(Arc::new(SpmdMover::<G3, G2>::new(pw, g2))),
                    g4_to_g2: None,
                    remote_g2: None,
                })
                .await
        })
    };
    // Rank 1 has the request (and sits on it); rank 0 got it too. Kill rank 1 now.
    let w1_lines = std::mem::replace(&mut w1.lines, mpsc::channel().1);
    tokio::task::spawn_blocking(move || {
        loop {
            let l = w1_lines.recv_timeout(Duration::from_secs(30)).unwrap();
            if l.starts_with("request transfer G3->G2") {
                return;
            }
        }
    })
    .await
    .unwrap();
    assert_eq!(session.phase(), Phase::Staging);
    w1.kill();

    let err = staging.await.unwrap().unwrap_err();
    let SessionError::Failed(failure) = err else {
        panic!("expected a failed session, got {err:?}");
    };
    assert_eq!(failure.phase, Phase::Staging);
    assert_eq!(failure.failed_blocks, 6);
    let dead = WorkerAddress::new(instance, 1);
    assert_eq!(
        failure.message,
        ControlError::Timeout {
            worker: dead,
            timeout_ms: timeout.as_millis() as u64
        }
        .to_string()
    );
    assert_eq!(session.phase(), Phase::Failed);

    // Everything the leader held is released: no G2 destination, no G3 hold.
    assert!(idle(i.g2.pool_counts()), "{:?}", i.g2.pool_counts());
    assert!(idle(i.g3.pool_counts()), "{:?}", i.g3.pool_counts());
    assert_eq!(i.g2.available_blocks(), N);
    assert!(
        i.g2.match_blocks(&i.hashes).is_empty(),
        "nothing half-staged is registered"
    );

    // The dead worker is unreachable, with a typed error naming it.
    let e = i.controls[1]
        .call(ControlRequest::Describe)
        .await
        .unwrap_err();
    assert!(e.is_unreachable(), "{e:?}");
    assert_eq!(e.worker(), dead);

    // Rank 0 keeps serving: alone, it stages the prefix from its disk, bytes verified.
    let alone: Arc<dyn ParallelWorkers> =
        Arc::new(ControlledWorkers::new(vec![i.controls[0].clone()]).unwrap());
    let on_g3 = i.g3.match_blocks(&i.hashes);
    assert_eq!(on_g3.len(), 6);
    let up = SpmdMover::<G3, G2>::new(alone, i.g2.clone());
    let out = up.move_from(&on_g3, i.g2.allocate_blocks(6).unwrap()).await;
    let staged: Vec<ImmutableBlock<G2>> = out.into_iter().map(Result::unwrap).collect();
    let ids: Vec<usize> = staged.iter().map(|b| b.block_id()).collect();
    assert_eq!(
        digests(i.controls[0].as_ref(), TierId::G2, ids).await,
        i.expected[0]
    );
    drop(w0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_of_another_protocol_version_is_refused_with_the_reason() {
    let Some(nats) = kvbm_tests::services::nats("a_request_of_another_protocol_version") else {
        return;
    };
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let instance = instance_id(3);
    let _w = WorkerProcess::spawn(&nats.url, instance, 0, dir.path(), &[]);
    let client = connect(&nats.url, "raw", Duration::from_millis(100))
        .await
        .unwrap();
    let subject = WorkerAddress::new(instance, 0).control_subject(DEFAULT_CONTROL_PREFIX);
    let reply = client
        .request(
            subject.clone(),
            r#"{"version":99,"body":"Describe"}"#.into(),
        )
        .await
        .unwrap();
    let text = String::from_utf8(reply.payload.to_vec()).unwrap();
    assert!(
        text.contains("Refused") && text.contains("protocol version 99 not spoken"),
        "{text}"
    );
    let reply = client
        .request(subject, r#"{"version":1,"body":"Nonsense"}"#.into())
        .await
        .unwrap();
    let text = String::from_utf8(reply.payload.to_vec()).unwrap();
    assert!(text.contains("undecodable request"), "{text}");
    // Through the typed client the same worker answers normally.
    let c = NatsControl::new(
        client,
        DEFAULT_CONTROL_PREFIX,
        WorkerAddress::new(instance, 0),
        Duration::from_secs(10),
    );
    assert!(matches!(
        c.call(ControlRequest::Describe).await.unwrap(),
        ControlResponse::Described(_)
    ));
}
