//! A leader (this test) and two worker processes (`kvbm-engine-worker`) over a real
//! `nats-server` (feature `nats`): the leader finds and holds a prefix, stages it G3→G2 and
//! onboards it to G1 through the workers, and every rank's G1 holds exactly its own original
//! bytes (checked by digests the workers compute, and against digests computed here). Then a
//! worker killed (SIGKILL) in the middle of a transfer: the session fails with a typed error,
//! the leader releases everything it held (pool counts back to where they were), a call to the
//! dead worker fails as unreachable, and the remaining worker keeps serving. And a worker killed
//! and restarted rejoins through the leader's membership, nothing of its lost memory served.

use std::sync::Arc;
use std::sync::mpsc;
use std::time::Duration;

use kvbm_cluster::transport::control::{
    ControlError, ControlRequest, ControlResponse, ControlledWorkers, WorkerControl,
};
use kvbm_cluster::transport::nats::{DEFAULT_CONTROL_PREFIX, NatsControl, connect};
use kvbm_engine::WorkerAddress;
use kvbm_engine::leader::{FinishOutcome, InstanceLeader, MoversToG2, Phase, SessionError};
use kvbm_engine::worker::{ParallelWorkers, SpmdMover};
use kvbm_logical::{G1, G2, G3, ImmutableBlock, PoolCounts, TierId};

#[path = "../../kvbm-engine/tests/common/mod.rs"]
mod common;

use common::N;

mod worker_processes;

use kvbm_cluster::security::{Role, Security};
use worker_processes::{Members, WorkerProcess, digests, instance_id, set_up, set_up_secured};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leader_and_two_worker_processes_onboard_a_disk_prefix_bytes_verified_per_rank() {
    onboard_a_disk_prefix_through_two_workers(false).await;
}

/// The same with authentication on: each worker process loads its own worker credential
/// (`--trust-root`, `--credential`, a file written by `Credential::save`) and obeys only the
/// leader's sealed requests; the leader takes only their sealed replies.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leader_and_two_worker_processes_onboard_a_disk_prefix_authenticated() {
    onboard_a_disk_prefix_through_two_workers(true).await;
}

async fn onboard_a_disk_prefix_through_two_workers(secure: bool) {
    let Some(nats) = kvbm_tests::services::nats("leader_and_two_worker_processes") else {
        return;
    };
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let instance = instance_id(if secure { 5 } else { 1 });
    let members = Members::new();
    let _w: Vec<WorkerProcess> = (0..2)
        .map(|r| {
            let flags = if secure {
                members.worker_flags(instance, r)
            } else {
                Vec::new()
            };
            let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
            WorkerProcess::spawn(&nats.url, instance, r, dir.path(), &flags)
        })
        .collect();
    let security = if secure {
        members.security(instance, Role::Leader, 0)
    } else {
        Arc::new(Security::Off)
    };
    let i = set_up_secured(
        &nats.url,
        instance,
        Duration::from_secs(30),
        security.clone(),
    )
    .await;
    let pw: Arc<dyn ParallelWorkers> = i.workers.clone();

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
            g4_to_g2: None,
            remote_g2: None,
        })
        .await
        .unwrap();
    assert_eq!(session.phase(), Phase::Staged);
    session
        .onboard(
            // SAFETY: the test's ranks have layouts of this manager's blocks; nothing else writes them.
            Arc::new(unsafe { SpmdMover::<G2, G1>::new(pw, i.g1.clone()) }),
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
    if secure {
        let s = security.stats().unwrap();
        assert!(s.accepted() > 0);
        assert_eq!(s.rejected_total(), 0, "no genuine reply was refused");
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
                .prepare(MoversToG2 {
                    // SAFETY: the test's ranks have layouts of this manager's blocks; nothing else writes them.
                    g3_to_g2: Some(Arc::new(unsafe { SpmdMover::<G3, G2>::new(pw, g2) })),
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
    // SAFETY: the test's ranks have layouts of this manager's blocks; nothing else writes them.
    let up = unsafe { SpmdMover::<G3, G2>::new(alone, i.g2.clone()) };
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

/// Issue 24, item 4, with real processes: rank 1 is killed (SIGKILL, no goodbye) and restarted
/// as a new process on the same disk, its memory refilled with other bytes. During the gap a
/// session fails at once with a typed error (the leader sends the lost rank nothing) and
/// releases what it held; when the rank comes back, the leader declares its G2 empty (the
/// blocks placed on the old process are never matched again) and brings it back in step; the
/// next session finds the prefix on the disks and onboards it, every rank's G1 holding its own
/// original bytes, none of the restarted process's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_process_killed_and_restarted_rejoins_and_nothing_of_its_lost_memory_is_served() {
    use kvbm_cluster::transport::membership::MemberEvent;
    use kvbm_logical::BlockRegistry;

    let Some(nats) = kvbm_tests::services::nats("a_worker_process_restarted_rejoins") else {
        return;
    };
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let instance = instance_id(6);
    let (client, members, cancel) = worker_processes::follow_ranks(&nats.url, instance).await;
    let mut events = members.events();
    let w0 = WorkerProcess::spawn(&nats.url, instance, 0, dir.path(), &[]);
    let mut w1 = WorkerProcess::spawn(&nats.url, instance, 1, dir.path(), &[]);
    members.wait_for(2, Duration::from_secs(30)).await.unwrap();
    let controls =
        worker_processes::nats_controls(&client, instance, Duration::from_secs(10), |c| {
            c.with_membership(members.clone())
        });
    let workers = Arc::new(ControlledWorkers::new(controls.clone()).unwrap());
    let pw: Arc<dyn ParallelWorkers> = workers.clone();

    // Six blocks computed in G2 on both ranks (their fill pattern), written to both disks, and
    // kept in G2 (inactive, matchable).
    let registry = BlockRegistry::new();
    let (g2, g3) = (
        common::manager::<G2>(&registry),
        common::manager::<G3>(&registry),
    );
    let g1 = common::manager::<G1>(&BlockRegistry::new());
    let (on_g2, hashes) = worker_processes::compute_prefix(&g2);
    let ids: Vec<usize> = on_g2.iter().map(|b| b.block_id()).collect();
    let expected = worker_processes::pattern_digests(&ids);
    // SAFETY: the test's ranks have layouts of this manager's blocks; nothing else writes them.
    let down = unsafe { SpmdMover::<G2, G3>::new(pw.clone(), g3.clone()) };
    let out = down.move_from(&on_g2, g3.allocate_blocks(6).unwrap()).await;
    assert!(out.iter().all(Result::is_ok), "{out:?}");
    drop((out, on_g2));
    let leader = Arc::new(
        InstanceLeader::builder()
            .g2(g2.clone())
            .g3(g3.clone())
            .build()
            .unwrap(),
    );
    let _keeper = {
        let leader = leader.clone();
        members.keep_in_step(move |_| leader.forget_worker_memory(), cancel.clone())
    };
    assert_eq!(leader.find_matches(&hashes).count(TierId::G2), 6);

    // Rank 1 dies without a goodbye: lost when its heartbeats stop.
    w1.kill();
    let dead = WorkerAddress::new(instance, 1);
    loop {
        match tokio::time::timeout(Duration::from_secs(15), events.recv())
            .await
            .expect("rank 1 lost within 15 s")
            .unwrap()
        {
            MemberEvent::Lost(t) if t.address == dead => break,
            _ => continue,
        }
    }
    // A session in the gap: it matches G2, fails at once naming the rank, releases everything.
    let session = leader.begin_onboarding(&hashes);
    assert_eq!(session.prefix_len(), 6);
    session
        .prepare(MoversToG2 {
            g3_to_g2: None,
            g4_to_g2: None,
            remote_g2: None,
        })
        .await
        .unwrap();
    let err = session
        .onboard(
            // SAFETY: the test's ranks have layouts of this manager's blocks; nothing else writes them.
            Arc::new(unsafe { SpmdMover::<G2, G1>::new(pw.clone(), g1.clone()) }),
            g1.allocate_blocks(6).unwrap(),
        )
        .await
        .unwrap_err();
    let SessionError::Failed(failure) = err else {
        panic!("expected a failed session, got {err:?}");
    };
    assert_eq!(
        failure.message,
        ControlError::NotJoined { worker: dead }.to_string()
    );
    drop(session);
    assert!(idle(g1.pool_counts()), "{:?}", g1.pool_counts());

    // Rank 1 restarts: a new process on the same disk, its memory other bytes.
    let _w1 = WorkerProcess::spawn(&nats.url, instance, 1, dir.path(), &["--fill-seed", "153"]);
    loop {
        match tokio::time::timeout(Duration::from_secs(30), events.recv())
            .await
            .expect("rank 1 back within 30 s")
            .unwrap()
        {
            MemberEvent::Restarted { now, .. } if now.address == dead => break,
            _ => continue,
        }
    }
    // Brought back in step once the leader declared G2 empty: nothing of the old process's
    // memory is matched again.
    members.wait_for(2, Duration::from_secs(30)).await.unwrap();
    assert_eq!(leader.find_matches(&hashes).count(TierId::G2), 0);

    // The next session finds the prefix on the disks, stages and onboards it: every rank's G1
    // holds its own original bytes.
    let session = leader.begin_onboarding(&hashes);
    assert_eq!(session.prefix_len(), 6);
    session
        .prepare(MoversToG2 {
            // SAFETY: the test's ranks have layouts of this manager's blocks; nothing else writes them.
            g3_to_g2: Some(Arc::new(unsafe {
                SpmdMover::<G3, G2>::new(pw.clone(), g2.clone())
            })),
            g4_to_g2: None,
            remote_g2: None,
        })
        .await
        .unwrap();
    session
        .onboard(
            // SAFETY: the test's ranks have layouts of this manager's blocks; nothing else writes them.
            Arc::new(unsafe { SpmdMover::<G2, G1>::new(pw, g1.clone()) }),
            g1.allocate_blocks(6).unwrap(),
        )
        .await
        .unwrap();
    let FinishOutcome::Finished(on_g1) = session.finish() else {
        panic!("complete");
    };
    let ids: Vec<usize> = on_g1.iter().map(|b| b.block_id()).collect();
    for (r, c) in controls.iter().enumerate() {
        assert_eq!(
            digests(c.as_ref(), TierId::G1, ids.clone()).await,
            expected[r],
            "rank {r}: G1 holds its own original bytes"
        );
    }
    cancel.cancel();
    drop(w0);
}

/// A rank lost while a call to it is in flight ends that call then, typed `Lost` naming the
/// rank and the incarnation it was for, not at the call's deadline (two minutes here): the
/// leader learns of the loss from the rank's heartbeats. The blocks fail, nothing is
/// registered, and every destination goes back to its pool.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rank_lost_mid_call_fails_the_call_then_not_at_its_deadline() {
    use kvbm_logical::BlockRegistry;

    let Some(nats) = kvbm_tests::services::nats("a_rank_lost_mid_call") else {
        return;
    };
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let instance = instance_id(11);
    let (client, members, cancel) = worker_processes::follow_ranks(&nats.url, instance).await;
    let _w0 = WorkerProcess::spawn(&nats.url, instance, 0, dir.path(), &[]);
    // Rank 1 sits on every transfer out of G2, long past the call's deadline.
    let mut w1 = WorkerProcess::spawn(
        &nats.url,
        instance,
        1,
        dir.path(),
        &["--delay-from", "G2", "--delay-ms", "600000"],
    );
    members.wait_for(2, Duration::from_secs(30)).await.unwrap();
    let dead = WorkerAddress::new(instance, 1);
    let epoch = members.target(dead).unwrap().epoch;
    let controls =
        worker_processes::nats_controls(&client, instance, Duration::from_secs(120), |c| {
            c.with_membership(members.clone())
        });
    let pw: Arc<dyn ParallelWorkers> = Arc::new(ControlledWorkers::new(controls).unwrap());

    let registry = BlockRegistry::new();
    let g2 = common::manager::<G2>(&registry);
    let g1 = common::manager::<G1>(&BlockRegistry::new());
    let (on_g2, hashes) = worker_processes::compute_prefix(&g2);
    let moving = {
        // SAFETY: the test's ranks have layouts of this manager's blocks; nothing else writes them.
        let up = unsafe { SpmdMover::<G2, G1>::new(pw.clone(), g1.clone()) };
        let dst = g1.allocate_blocks(6).unwrap();
        tokio::spawn(async move { up.move_from(&on_g2, dst).await })
    };
    // Rank 1 has the request and sits on it: kill it.
    let w1_lines = std::mem::replace(&mut w1.lines, mpsc::channel().1);
    tokio::task::spawn_blocking(move || {
        loop {
            let l = w1_lines.recv_timeout(Duration::from_secs(30)).unwrap();
            if l.starts_with("request transfer G2->G1") {
                return;
            }
        }
    })
    .await
    .unwrap();
    w1.kill();

    let out = moving.await.unwrap();
    let lost = ControlError::Lost {
        worker: dead,
        epoch,
    }
    .to_string();
    assert_eq!(out.len(), 6);
    for r in &out {
        let f = r
            .as_ref()
            .expect_err("no block moved by a lost rank counts");
        assert_eq!(f.message, lost, "the call ends when the rank is lost");
    }
    drop(out);
    assert!(g1.match_blocks(&hashes).is_empty(), "nothing registered");
    assert!(idle(g1.pool_counts()), "{:?}", g1.pool_counts());
    assert_eq!(g1.available_blocks(), N);
    cancel.cancel();
}

/// A worker process configured with G1 on a device (`KVBM_PHYSICAL__G1=device`) where there
/// is none (this build has no `cuda` feature, or the machine no driver) exits at once naming
/// the key and the reason, before it connects anywhere: never a host stand-in in its place.
#[test]
fn a_worker_with_g1_on_a_device_it_does_not_have_exits_naming_the_key() {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_kvbm-engine-worker"))
        .args([
            "--nats",
            "nats://127.0.0.1:1",
            "--instance",
            "7",
            "--rank",
            "0",
            "--insecure",
        ])
        .env("KVBM_PHYSICAL__G1", "device")
        .env("KVBM_PHYSICAL__G1_DEVICE", "2")
        .stdin(std::process::Stdio::null())
        .output()
        .expect("the worker runs");
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains("physical.g1 = \"device\"") && err.contains("CUDA device 2"),
        "{err}"
    );
}
