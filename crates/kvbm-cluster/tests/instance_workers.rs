//! The config-driven [`Instance`] with its worker ranks in separate processes (issue 24, item
//! 4; feature `nats`): `[workers] mode = "processes"`, `ranks = 2`, two `kvbm-engine-worker`
//! processes over a real `nats-server`. The instance waits for the ranks, stores a prefix on
//! their disks and onboards it through them, every rank's G1 holding its own original bytes;
//! a rank killed (SIGKILL) makes every call fail at once with a typed error naming it; once
//! restarted it is brought back in step and the instance serves again, nothing of the lost
//! memory served (also with authentication on). A rank killed in the middle of an onboarding
//! fails that call cleanly (refused, nothing served or held). Building fails, naming the key
//! or the rank, when a rank is missing or does not fit the configuration; peers see the
//! instance live, with no data plane to pull from. With every rank serving the rank plane, two
//! such instances share their G2 rank to rank (authenticated, each rank's bytes checked).

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc;
use std::time::Duration;

use kvbm_cluster::instance::{Instance, synthetic_block};
use kvbm_cluster::transport::control::{ControlError, ControlRequest, ControlResponse};
use kvbm_cluster::transport::membership::MemberEvent;
use kvbm_engine::{EngineError, InstanceId, KvbmRuntime, WorkerAddress};
use kvbm_logical::{G1, ImmutableBlock, PoolCounts, SequenceHash, TierId};
use kvbm_physical::BlockLayout;

#[path = "../../kvbm-engine/tests/common/mod.rs"]
mod common;
mod worker_processes;

use common::N;
use kvbm_cluster::security::Role;
use worker_processes::{Members, WorkerProcess, digests, instance_id};

/// A runtime whose instance drives `ranks` worker processes: tiers of `g2_blocks` (G1 and G3
/// of `N`), the workers' default heartbeat (1 s) and a 3 s timeout, `join_ms` to join.
fn runtime(url: &str, ranks: u32, g2_blocks: usize, join_ms: u64) -> KvbmRuntime {
    runtime_with(url, ranks, g2_blocks, join_ms, 10_000, &[])
}

/// As [`runtime`], each control request timing out after `request_ms`, with `sets` on top.
fn runtime_with(
    url: &str,
    ranks: u32,
    g2_blocks: usize,
    join_ms: u64,
    request_ms: u64,
    sets: &[(&str, String)],
) -> KvbmRuntime {
    // Each instance its own events subject: the tests of this binary run at once on one
    // server, and an instance counts another's unsealed heartbeats as rejected.
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let subject = format!(
        "kvbm.test.workers.{}-{}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    );
    let mut b = KvbmRuntime::builder()
        .tokio_handle(tokio::runtime::Handle::current())
        .set("events.subject", subject)
        // Security is on by default, loopback too: these ranks run without credentials
        // unless a test configures them (which turns it on whatever this says).
        .set("security.insecure", true)
        .set("logical.block_size", 4)
        .set("logical.events.max_delay_ms", 1)
        .set("events.idle_tick_ms", 1)
        .set("tiers.g1_blocks", N as i64)
        .set("tiers.g2_blocks", g2_blocks as i64)
        .set("tiers.g3_blocks", N as i64)
        .set("transport.nats_url", url)
        .set("transport.heartbeat_timeout_ms", 3000)
        .set("transport.request_timeout_ms", request_ms as i64)
        .set("workers.mode", "processes")
        .set("workers.ranks", i64::from(ranks))
        .set("workers.join_timeout_ms", join_ms as i64);
    for (k, v) in sets {
        b = b.set(*k, v.as_str());
    }
    b.build().unwrap()
}

/// Builds instance `id` of `geometry` on `rt`, which must fail: its error.
async fn refused(rt: &KvbmRuntime, id: InstanceId, geometry: BlockLayout) -> EngineError {
    Instance::builder(&rt.handle())
        .id(id)
        .geometry(geometry)
        .build()
        .await
        .unwrap_err()
}

fn idle(c: PoolCounts) -> bool {
    c.held == 0 && c.active == 0
}

/// Waits (30 s at most) for a membership event about `rank` that `is` accepts.
async fn event_about(
    events: &mut tokio::sync::broadcast::Receiver<MemberEvent>,
    rank: WorkerAddress,
    is: impl Fn(&MemberEvent) -> bool,
) {
    loop {
        let e = tokio::time::timeout(Duration::from_secs(30), events.recv())
            .await
            .expect("a membership event within 30 s")
            .unwrap();
        let about = match e {
            MemberEvent::Joined(t) | MemberEvent::Lost(t) => t.address,
            MemberEvent::Restarted { now, .. } => now.address,
        };
        if about == rank && is(&e) {
            return;
        }
    }
}

/// The ranks computed a prefix of 6 blocks into their G2 (their fill pattern at the slots the
/// instance's G2 allocated), checked by digest; the instance stores it on the ranks' disks;
/// G2 is then evicted and every rank's G2 overwritten, so what reaches G1 later can only come
/// from the disks. Returns the prefix and, per rank, the digests of its original bytes.
async fn store_prefix(inst: &Instance) -> (Vec<SequenceHash>, Vec<Vec<u64>>) {
    let workers = inst.workers().unwrap();
    let g2 = inst.leader().g2().unwrap();
    let (on_g2, hashes) = worker_processes::compute_prefix(g2);
    let ids: Vec<usize> = on_g2.iter().map(|b| b.block_id()).collect();
    let expected = worker_processes::pattern_digests(&ids);
    for (r, c) in workers.ranks().iter().enumerate() {
        assert_eq!(
            digests(c.as_ref(), TierId::G2, ids.clone()).await,
            expected[r]
        );
    }
    drop(on_g2);
    assert_eq!(inst.offload_g3(&hashes).await.unwrap(), 6);
    assert_eq!(inst.offload_g3(&hashes).await.unwrap(), 0, "already in G3");
    assert_eq!(g2.reset_inactive_pool(), 6);
    fill_g2(inst, 0xEE).await;
    (hashes, expected)
}

/// Every rank's G1 at `blocks` holds `expected` (per rank).
async fn assert_g1_holds(inst: &Instance, blocks: &[ImmutableBlock<G1>], expected: &[Vec<u64>]) {
    let ids: Vec<usize> = blocks.iter().map(|b| b.block_id()).collect();
    for (r, c) in inst.workers().unwrap().ranks().iter().enumerate() {
        assert_eq!(
            digests(c.as_ref(), TierId::G1, ids.clone()).await,
            expected[r],
            "rank {r}: G1 holds its own original bytes"
        );
    }
}

async fn fill_g2(inst: &Instance, seed: u8) {
    for c in inst.workers().unwrap().ranks() {
        let r = c
            .call(ControlRequest::Fill {
                tier: TierId::G2,
                seed,
            })
            .await
            .unwrap();
        assert_eq!(r, ControlResponse::Done);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_instance_with_two_worker_process_ranks_serves_and_a_restarted_rank_rejoins_clean() {
    serve_and_rejoin(false).await;
}

/// The same with authentication on, all of it from configuration: the instance's leader
/// credential and the trust root are `[security]` keys; each worker process loads its own
/// worker credential; heartbeats, requests and replies are sealed, none refused. And with
/// `logical.duplication = "reject"`: a G1 block of the old incarnation still registered would
/// be handed out in place of a newly onboarded one (its slot on the restarted rank holds none
/// of the prefix), so this also proves the restart dropped them from G1.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_authenticated_instance_with_worker_process_ranks_serves_and_rejoins() {
    serve_and_rejoin(true).await;
}

async fn serve_and_rejoin(secure: bool) {
    let Some(nats) = kvbm_tests::services::nats("instance_with_worker_processes") else {
        return;
    };
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let instance = instance_id(if secure { 9 } else { 7 });
    let members = Members::new();
    // Each rank's credential, saved once (a restarted rank loads the same file).
    let credentials: Vec<Vec<String>> = (0..2)
        .map(|r| {
            if secure {
                members.worker_flags(instance, r)
            } else {
                Vec::new()
            }
        })
        .collect();
    let flags = |rank: u32, extra: &[&str]| -> Vec<String> {
        let mut f: Vec<String> = extra.iter().map(|s| s.to_string()).collect();
        f.extend(credentials[rank as usize].iter().cloned());
        f
    };
    let spawn = |rank: u32, extra: &[&str]| {
        let f = flags(rank, extra);
        let f: Vec<&str> = f.iter().map(String::as_str).collect();
        WorkerProcess::spawn(&nats.url, instance, rank, dir.path(), &f)
    };
    let w0 = spawn(0, &[]);
    let mut w1 = spawn(1, &[]);
    let sets = if secure {
        vec![
            ("logical.duplication", "reject".to_string()),
            ("security.trust_root", members.trust_root()),
            (
                "security.credential_file",
                members
                    .save(instance, Role::Leader, 0)
                    .display()
                    .to_string(),
            ),
        ]
    } else {
        Vec::new()
    };
    let rt = runtime_with(&nats.url, 2, N, 30_000, 10_000, &sets);
    let inst = Instance::builder(&rt.handle())
        .id(instance)
        .geometry(common::geometry())
        .build()
        .await
        .unwrap();
    assert!(inst.data_plane().is_none(), "the ranks' G2 is not served");
    assert_eq!(inst.workers().unwrap().ranks().len(), 2);
    let membership = inst.membership().unwrap().clone();
    let mut events = membership.events();

    // The ranks computed a prefix into their G2 (their fill pattern at the slots the
    // instance's G2 allocated); the instance itself refuses to write G2 bytes.
    let e = inst.compute(&[], &synthetic_block).unwrap_err();
    assert_eq!(e.config_key(), Some("workers.mode"), "{e}");
    let g2 = inst.leader().g2().unwrap().clone();
    let (hashes, expected) = store_prefix(&inst).await;

    let on = inst.onboard(&hashes).await.unwrap();
    assert_eq!((on.local_g2, on.local_g3), (0, 6));
    assert!(on.refused.is_none(), "{:?}", on.refused);
    assert_eq!(on.blocks.len(), 6);
    assert_g1_holds(&inst, &on.blocks, &expected).await;
    assert!(
        inst.read_g1(&on.blocks[0]).is_none(),
        "bytes are the ranks'"
    );
    // The caller keeps these G1 blocks (of the ranks' memory) across what follows.
    let held = on;
    assert_eq!(
        inst.lookup(&hashes).local_g2,
        6,
        "staged into the ranks' G2"
    );

    // Rank 1 dies without a goodbye; once it is lost, every call fails at once naming it,
    // holding nothing.
    let dead = WorkerAddress::new(instance, 1);
    w1.kill();
    event_about(&mut events, dead, |e| matches!(e, MemberEvent::Lost(_))).await;
    let not_joined = EngineError::Control(ControlError::NotJoined { worker: dead });
    let e = inst.onboard(&hashes).await.unwrap_err();
    assert_eq!(e.to_string(), not_joined.to_string());
    assert!(
        matches!(e, EngineError::Control(ControlError::NotJoined { worker }) if worker == dead)
    );
    let e = inst.offload_g3(&hashes).await.unwrap_err();
    assert!(
        matches!(e, EngineError::Control(ControlError::NotJoined { .. })),
        "{e}"
    );
    assert!(idle(g2.pool_counts()), "{:?}", g2.pool_counts());

    // Rank 1 restarts: a new process on the same disk, its memory other bytes. The instance
    // declares what it placed on the old process empty and brings it back in step.
    let _w1 = spawn(1, &["--fill-seed", "153"]);
    event_about(&mut events, dead, |e| {
        matches!(e, MemberEvent::Restarted { .. })
    })
    .await;
    // While the caller still holds G1 blocks placed on the old process, the rank is not
    // brought back: calls fail naming it as rejoining.
    let e = inst.onboard(&hashes).await.unwrap_err();
    assert!(
        matches!(e, EngineError::Control(ControlError::Rejoining { worker, .. }) if worker == dead),
        "{e}"
    );
    let e = membership
        .wait_for(2, Duration::from_millis(1500))
        .await
        .unwrap_err();
    assert!(matches!(e, ControlError::Rejoining { .. }), "{e}");
    drop(held);
    membership
        .wait_for(2, Duration::from_secs(30))
        .await
        .unwrap();
    let after = inst.lookup(&hashes);
    assert_eq!(
        (after.local_g2, after.local_g3),
        (0, 6),
        "nothing of the lost G2 is matched; the disks still hold the prefix"
    );

    // The instance serves again: the prefix from the disks, every rank its own original bytes.
    let on = inst.onboard(&hashes).await.unwrap();
    assert!(on.refused.is_none(), "{:?}", on.refused);
    assert_eq!((on.local_g2, on.local_g3, on.blocks.len()), (0, 6, 6));
    assert_g1_holds(&inst, &on.blocks, &expected).await;
    assert_eq!(inst.stats().onboarded_blocks, 12);
    assert_eq!(membership.stats().rejected(), 0, "no genuine beat refused");
    if secure {
        let s = inst.security().stats().unwrap();
        assert!(s.accepted() > 0);
        assert_eq!(s.rejected_total(), 0, "no genuine reply refused: {s:?}");
    } else {
        assert!(!inst.security().is_on());
    }
    drop(on);
    inst.shutdown().await;
    drop(w0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn building_fails_naming_the_missing_rank_or_the_key_a_rank_does_not_fit() {
    let Some(nats) = kvbm_tests::services::nats("instance_with_a_missing_rank") else {
        return;
    };
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let instance = instance_id(8);
    // Its id given as `kvbm-engine-instance` prints one (hex), overriding the decimal.
    let hex = format!("0x{:x}", instance.0);
    let _w0 = WorkerProcess::spawn(&nats.url, instance, 0, dir.path(), &["--instance", &hex]);

    // Two ranks configured, one running: the build waits its bound, then names rank 1.
    let rt = runtime(&nats.url, 2, N, 2500);
    let e = refused(&rt, instance, common::geometry()).await;
    let EngineError::RanksMissing {
        instance: i,
        missing,
        waited_ms,
        why,
    } = &e
    else {
        panic!("expected RanksMissing, got {e}");
    };
    assert_eq!(
        (*i, missing.as_slice(), *waited_ms),
        (instance, &[1][..], 2500)
    );
    assert_eq!(
        *why,
        ControlError::NotJoined {
            worker: WorkerAddress::new(instance, 1)
        }
    );
    assert!(e.to_string().contains("--rank R"), "{e}");

    // One rank, but more G2 blocks than the rank registered: the key and the rank are named.
    let rt = runtime(&nats.url, 1, 2 * N, 10_000);
    let e = refused(&rt, instance, common::geometry()).await;
    assert_eq!(e.config_key(), Some("tiers.g2_blocks"), "{e}");
    assert!(e.to_string().contains("rank"), "{e}");

    // Another geometry than the rank's: refused, naming it.
    let rt = runtime(&nats.url, 1, N, 10_000);
    let e = refused(&rt, instance, common::geometry_with(32)).await;
    assert_eq!(e.config_key(), Some("instance.geometry"), "{e}");

    // G4 here but not in the rank's configuration (it opened none): refused, naming the key
    // and the rank, before anything is listed or moved.
    let mut with_g4 = runtime(&nats.url, 1, N, 10_000).config().as_ref().clone();
    with_g4.tiers.g4_blocks = 8;
    with_g4.physical.object_dir = Some(dir.path().join("g4"));
    let rt = KvbmRuntime::builder()
        .tokio_handle(tokio::runtime::Handle::current())
        .config(with_g4)
        .build()
        .unwrap();
    let e = refused(&rt, instance, common::geometry()).await;
    assert_eq!(e.config_key(), Some("tiers.g4_blocks"), "{e}");
    assert!(e.to_string().contains("rank-0 registered no G4"), "{e}");

    // Ranks of another instance do not count.
    let rt = runtime(&nats.url, 1, N, 1500);
    let e = refused(&rt, InstanceId(instance.0 ^ 0xff), common::geometry()).await;
    assert!(matches!(e, EngineError::RanksMissing { .. }), "{e}");

    // And it fits: built. An in-process peer on the same subject sees it live, without a
    // data plane to pull from, and refuses none of its heartbeats.
    let subject = format!("kvbm.test.workers.peer-{}", std::process::id());
    let rt = runtime_with(
        &nats.url,
        1,
        N,
        10_000,
        10_000,
        &[("events.subject", subject.clone())],
    );
    let inst = Instance::builder(&rt.handle())
        .id(instance)
        .geometry(common::geometry())
        .build()
        .await
        .unwrap();
    assert_eq!(inst.workers().unwrap().ranks().len(), 1);
    let peer_rt = KvbmRuntime::builder()
        .tokio_handle(tokio::runtime::Handle::current())
        .set("security.insecure", true)
        .set("logical.block_size", 4)
        .set("tiers.g1_blocks", N as i64)
        .set("tiers.g2_blocks", N as i64)
        .set("transport.nats_url", nats.url.as_str())
        .set("events.subject", subject)
        .build()
        .unwrap();
    let peer = Instance::builder(&peer_rt.handle())
        .id(InstanceId(instance.0 ^ 0xee))
        .geometry(common::geometry())
        .build()
        .await
        .unwrap();
    let start = std::time::Instant::now();
    while !peer.presence().live_peers().contains(&instance) {
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "the peer never saw the instance: {:?}",
            peer.presence().stats()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(
        peer.peers().get(instance),
        None,
        "no data plane to pull from"
    );
    assert_eq!(peer.presence().stats().rejected, 0);
    peer.shutdown().await;
    inst.shutdown().await;
}

/// A rank killed while it moves a session's blocks (its G3→G2 reads sit on a delay): the
/// instance's call fails cleanly, as a refusal naming the rank (its request timed out), nothing
/// served or left held; once the rank is restarted (without the delay) and brought back in
/// step, the instance serves the prefix from the disks, every rank its own original bytes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rank_killed_mid_onboarding_fails_the_call_cleanly_and_serves_again_restarted() {
    let Some(nats) = kvbm_tests::services::nats("instance_rank_killed_mid_onboarding") else {
        return;
    };
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let instance = instance_id(10);
    let _w0 = WorkerProcess::spawn(&nats.url, instance, 0, dir.path(), &[]);
    let mut w1 = WorkerProcess::spawn(
        &nats.url,
        instance,
        1,
        dir.path(),
        &["--delay-from", "G3", "--delay-ms", "60000"],
    );
    let rt = runtime_with(&nats.url, 2, N, 30_000, 3000, &[]);
    let inst = Arc::new(
        Instance::builder(&rt.handle())
            .id(instance)
            .geometry(common::geometry())
            .build()
            .await
            .unwrap(),
    );
    let membership = inst.membership().unwrap().clone();
    let mut events = membership.events();
    let (hashes, expected) = store_prefix(&inst).await;
    let g2 = inst.leader().g2().unwrap().clone();
    let g3 = inst.leader().g3().unwrap().clone();

    let onboarding = {
        let (inst, hashes) = (inst.clone(), hashes.clone());
        tokio::spawn(async move { inst.onboard(&hashes).await })
    };
    // Rank 1 has its part of the staging (and sits on it): kill it now.
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
    w1.kill();
    let dead = WorkerAddress::new(instance, 1);
    let on = onboarding.await.unwrap().unwrap();
    assert!(on.blocks.is_empty(), "nothing served");
    let (failed, why) = on.refused.expect("the call failed");
    assert_eq!(failed, 6);
    assert_eq!(
        why,
        ControlError::Timeout {
            worker: dead,
            timeout_ms: 3000
        }
        .to_string()
    );
    assert_eq!(inst.stats().refused_blocks, 6);
    assert!(idle(g2.pool_counts()), "{:?}", g2.pool_counts());
    assert!(idle(g3.pool_counts()), "{:?}", g3.pool_counts());
    assert!(g2.match_blocks(&hashes).is_empty(), "nothing half-staged");

    // Restarted without the delay, brought back in step: served again from the disks.
    event_about(&mut events, dead, |e| matches!(e, MemberEvent::Lost(_))).await;
    let _w1 = WorkerProcess::spawn(&nats.url, instance, 1, dir.path(), &["--fill-seed", "153"]);
    membership
        .wait_for(2, Duration::from_secs(30))
        .await
        .unwrap();
    let on = inst.onboard(&hashes).await.unwrap();
    assert!(on.refused.is_none(), "{:?}", on.refused);
    assert_eq!((on.local_g3, on.blocks.len()), (6, 6));
    assert_g1_holds(&inst, &on.blocks, &expected).await;
    drop(on);
    inst.shutdown().await;
}

/// G4 with worker-process ranks: one configuration file for the instance and both of its
/// `kvbm-engine-worker` ranks (the real S3 server, a fresh namespace), each rank opening its own
/// directory of the bucket from it. The instance writes a prefix to G4 through the ranks, every
/// rank its own slice; a second instance of the same file (a restart: another id, new rank
/// processes whose memory holds other bytes) finds the prefix at start by listing every rank's
/// directory, and serves it from G4, every rank's G1 holding its own original bytes. A block
/// one rank's slice of is missing is not found (never half a block), and a damaged slice is
/// refused, never served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn worker_process_ranks_keep_their_g4_slices_and_a_restarted_instance_serves_them() {
    let Some(nats) = kvbm_tests::services::nats("instance_workers_g4") else {
        return;
    };
    let Some(s3) = kvbm_tests::services::s3("instance_workers_g4") else {
        return;
    };
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    let file = dir.path().join("kvbm.toml");
    std::fs::write(
        &file,
        format!(
            r#"
[logical]
block_size = 4
[security]
insecure = true
[tiers]
g1_blocks = {N}
g2_blocks = {N}
g4_blocks = 64
[workers]
mode = "processes"
ranks = 2
join_timeout_ms = 30000
[transport]
nats_url = "{url}"
heartbeat_timeout_ms = 3000
request_timeout_ms = 10000
[physical.s3]
endpoint = "{endpoint}"
bucket = "{bucket}"
region = "us-east-1"
access_key = "{access}"
secret_key = "{secret}"
[physical.object]
namespace = "instance-workers-g4-{pid}-{nanos}"
"#,
            url = nats.url,
            endpoint = s3.endpoint,
            bucket = s3.bucket,
            access = s3.access_key,
            secret = s3.secret_key,
            pid = std::process::id(),
        ),
    )
    .unwrap();
    let env = [("KVBM_CONFIG_PATH", file.as_os_str())];
    let spawn = |instance: InstanceId, rank: u32, extra: &[&str]| {
        WorkerProcess::spawn_with_env(&nats.url, instance, rank, dir.path(), extra, &env)
    };
    let build = |instance: InstanceId| {
        let rt = KvbmRuntime::builder()
            .tokio_handle(tokio::runtime::Handle::current())
            .config_builder(kvbm_engine::ConfigBuilder::new().file(&file).unwrap())
            .set(
                "events.subject",
                format!("kvbm.test.workers.g4-{}-{}", std::process::id(), instance.0),
            )
            .set("logical.events.max_delay_ms", 1)
            .set("events.idle_tick_ms", 1)
            .build()
            .unwrap();
        async move {
            let inst = Instance::builder(&rt.handle())
                .id(instance)
                .geometry(common::geometry())
                .build()
                .await
                .unwrap();
            (rt, inst)
        }
    };

    // The first instance: the ranks computed a prefix into their G2; it goes to G4 through
    // them, each rank's slice under its own directory of the bucket.
    let a = instance_id(11);
    let (w0, w1) = (spawn(a, 0, &[]), spawn(a, 1, &[]));
    let (rt_a, inst) = build(a).await;
    let g2 = inst.leader().g2().unwrap().clone();
    let (on_g2, hashes) = worker_processes::compute_prefix(&g2);
    let ids: Vec<usize> = on_g2.iter().map(|b| b.block_id()).collect();
    let expected = worker_processes::pattern_digests(&ids);
    drop(on_g2);
    assert_eq!(inst.offload_g4(&hashes).await.unwrap(), 6);
    assert_eq!(inst.offload_g4(&hashes).await.unwrap(), 0, "already in G4");
    assert_eq!(inst.stats().offloaded_g4_blocks, 6);
    let config = rt_a.config().clone();
    let fingerprint = inst.fingerprint();
    let mut storages = Vec::new();
    for r in 0..2 {
        let (storage, _) = kvbm_engine::stack::open_g4_storage(
            &config,
            fingerprint,
            config.rank_object_config(r).unwrap(),
        )
        .await
        .unwrap();
        let keys = storage.list_keys().await.unwrap();
        assert_eq!(keys.len(), 6, "rank {r} wrote its slice of every block");
        let path = storage.path(&keys[0]).to_string();
        assert!(path.contains(&format!("/tp2.r{r}/")), "{path}");
        storages.push(storage);
    }
    // Served from G4 (G2 evicted and every rank's G2 overwritten meanwhile).
    assert_eq!(g2.reset_inactive_pool(), 6);
    fill_g2(&inst, 0xEE).await;
    let on = inst.onboard(&hashes).await.unwrap();
    assert!(on.refused.is_none(), "{:?}", on.refused);
    assert_eq!((on.local_g2, on.g4, on.blocks.len()), (0, 6, 6));
    assert_g1_holds(&inst, &on.blocks, &expected).await;
    drop(on);
    inst.shutdown().await;
    drop((inst, w0, w1));

    // A restart: another instance of the same file, new rank processes (their G2 other bytes).
    // Every rank's directory lists the prefix: found at start, served from G4.
    let b = instance_id(12);
    let (w0, w1) = (
        spawn(b, 0, &["--fill-seed", "7"]),
        spawn(b, 1, &["--fill-seed", "8"]),
    );
    let (_rt_b, inst) = build(b).await;
    assert_eq!(
        inst.lookup(&hashes).g4,
        6,
        "warm: every rank holds every slice"
    );
    let on = inst.onboard(&hashes).await.unwrap();
    assert!(on.refused.is_none(), "{:?}", on.refused);
    assert_eq!((on.g4, on.blocks.len()), (6, 6));
    assert_g1_holds(&inst, &on.blocks, &expected).await;
    drop(on);
    inst.shutdown().await;
    drop((inst, w0, w1));

    // Rank 1's slice of the last block is gone, and rank 0's slice of block 2 is damaged at
    // rest (one payload byte flipped). The next instance finds blocks 0..5 (the last is no
    // block without rank 1's slice), and its onboarding of them is refused as a whole at the
    // damaged slice: nothing served.
    storages[1]
        .delete(&kvbm_offload::object_key(hashes[5]))
        .await
        .unwrap();
    let raw =
        kvbm_physical::ObjectStorage::s3_client(config.physical.s3.as_ref().unwrap()).unwrap();
    let path = storages[0].path(&kvbm_offload::object_key(hashes[2]));
    kvbm_tests::faults::flip_last_byte(&*raw, &path, 0x01).await;
    let c = instance_id(13);
    let (_w0, _w1) = (spawn(c, 0, &[]), spawn(c, 1, &[]));
    let (_rt_c, inst) = build(c).await;
    assert_eq!(inst.lookup(&hashes).g4, 5, "never half a block");
    let on = inst.onboard(&hashes).await.unwrap();
    assert_eq!(
        on.g4, 5,
        "the presence check finds no more: rank 1 lacks the last slice"
    );
    assert_eq!(inst.stats().presence_adopted_blocks, 0);
    assert!(on.blocks.is_empty(), "nothing served");
    let (failed, why) = on.refused.expect("the damaged slice is refused");
    assert!(failed >= 1, "{failed}: {why}");
    assert!(why.contains("checksum"), "{why}");
    // A block reaches G2 only when every rank moved its slice: the damaged one never does.
    let g2 = inst.leader().g2().unwrap();
    assert!(g2.match_blocks(&hashes[2..3]).is_empty(), "never staged");
    // The whole blocks before it are served on their own, every rank its original bytes.
    let on = inst.onboard(&hashes[..2]).await.unwrap();
    assert!(on.refused.is_none(), "{:?}", on.refused);
    assert_eq!(on.blocks.len(), 2);
    let first_two: Vec<Vec<u64>> = expected.iter().map(|e| e[..2].to_vec()).collect();
    assert_g1_holds(&inst, &on.blocks, &first_two).await;
    drop(on);
    // The rejected copy left G4 (the rank deleted its slice; the instance dropped the block
    // when this onboarding began): it is not matched or read again.
    let g4 = inst.leader().g4().unwrap();
    assert!(g4.match_blocks(&hashes[2..3]).is_empty(), "dropped from G4");
    assert_eq!(
        g4.match_blocks(&hashes[3..5]).len(),
        2,
        "the whole ones stay"
    );
    inst.shutdown().await;
}

/// An instance whose ranks are processes keeps the journal of which block each G3 slot holds
/// (`workers.g3_journal`): restarted with new rank processes on the same files it starts G3
/// warm and onboards the prefix from the ranks' disks, every rank its own original bytes; a
/// rank whose file was lost fails its reads (the slot header), so the journal's listing is
/// refused, never served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn worker_process_ranks_restart_g3_warm_from_the_instances_journal() {
    let Some(nats) = kvbm_tests::services::nats("instance_workers_g3_warm") else {
        return;
    };
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let instance = instance_id(14);
    let journal = dir.path().join("leader").join("g3.journal");
    let sets = [("workers.g3_journal", journal.display().to_string())];
    let spawn = |rank: u32| WorkerProcess::spawn(&nats.url, instance, rank, dir.path(), &[]);
    let start = || async {
        let rt = runtime_with(&nats.url, 2, N, 30_000, 10_000, &sets);
        let inst = Instance::builder(&rt.handle())
            .id(instance)
            .geometry(common::geometry())
            .build()
            .await
            .unwrap();
        (rt, inst)
    };

    let (hashes, expected) = {
        let (_w0, _w1) = (spawn(0), spawn(1));
        let (_rt, inst) = start().await;
        let out = store_prefix(&inst).await;
        inst.shutdown().await;
        out // the rank processes are killed here; their files stay
    };
    assert!(journal.exists(), "the instance's G3 journal");

    // New rank processes on the same files, a new instance on the journal: warm.
    {
        let (_w0, _w1) = (spawn(0), spawn(1));
        let (_rt, inst) = start().await;
        let found = inst.lookup(&hashes);
        assert_eq!(
            (found.local_g2, found.local_g3),
            (0, 6),
            "listed by the journal"
        );
        // Nothing of G2 can stand in for the disks: every rank's G2 overwritten first.
        fill_g2(&inst, 0xEE).await;
        let on = inst.onboard(&hashes).await.unwrap();
        assert!(on.refused.is_none(), "{:?}", on.refused);
        assert_eq!((on.local_g3, on.blocks.len()), (6, 6));
        assert_g1_holds(&inst, &on.blocks, &expected).await;
        drop(on);
        inst.shutdown().await;
    }

    // Rank 1's file is lost: the journal still lists the slots, rank 1's reads fail their
    // header, and nothing is served.
    std::fs::remove_file(dir.path().join("rank1.bin")).unwrap();
    let (_w0, _w1) = (spawn(0), spawn(1));
    let (_rt, inst) = start().await;
    assert_eq!(inst.lookup(&hashes).local_g3, 6);
    fill_g2(&inst, 0xEE).await;
    let on = inst.onboard(&hashes).await.unwrap();
    assert!(on.refused.is_some(), "a lost slot must be refused: {on:?}");
    assert!(on.blocks.is_empty());
    assert!(inst.stats().refused_blocks > 0);
    inst.shutdown().await;
}

/// Issue 48, must-have 5: two instances whose ranks are processes, each rank serving the rank
/// plane (`--data-plane`), authenticated: B onboards A's G2 prefix, every rank of B pulling its
/// own slice from the same rank of A (each rank's bytes checked by digest), the blocks
/// registered in B's G2 once every rank verified them, A's lease ended after. A third
/// instance's rank is refused what was not lent to it, and a rank of another number is refused
/// at the handshake.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn worker_process_instances_share_their_g2_rank_to_rank() {
    let Some(nats) = kvbm_tests::services::nats("instance_workers_rank_plane") else {
        return;
    };
    let members = Members::new();
    let (a, b, c) = (instance_id(15), instance_id(16), instance_id(17));
    let subject = format!("kvbm.test.rankplane.{}", std::process::id());
    let dirs: Vec<tempfile::TempDir> = (0..3)
        .map(|_| tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap())
        .collect();
    let spawn = |instance: InstanceId, rank: u32, dir: &tempfile::TempDir| {
        let mut f = members.worker_flags(instance, rank);
        f.extend(["--data-plane".to_string(), "127.0.0.1:0".to_string()]);
        let f: Vec<&str> = f.iter().map(String::as_str).collect();
        WorkerProcess::spawn(&nats.url, instance, rank, dir.path(), &f)
    };
    let mut ranks = [
        spawn(a, 0, &dirs[0]),
        spawn(a, 1, &dirs[0]),
        spawn(b, 0, &dirs[1]),
        spawn(b, 1, &dirs[1]),
    ];
    let url = nats.url.clone();
    let start = |id: InstanceId| {
        let url = url.clone();
        let sets = vec![
            ("events.subject", subject.clone()),
            ("security.trust_root", members.trust_root()),
            (
                "security.credential_file",
                members.save(id, Role::Leader, 0).display().to_string(),
            ),
        ];
        async move {
            let rt = runtime_with(&url, 2, N, 30_000, 10_000, &sets);
            let inst = Instance::builder(&rt.handle())
                .id(id)
                .geometry(common::geometry())
                .build()
                .await
                .unwrap();
            (rt, inst)
        }
    };
    let (_rt_a, inst_a) = start(a).await;
    let (_rt_b, inst_b) = start(b).await;
    assert!(
        inst_a.lender_stats().is_some(),
        "every rank serves the rank plane"
    );

    // A's ranks computed a prefix into their G2; B's G2 holds other bytes.
    let (on_g2, hashes) = worker_processes::compute_prefix(inst_a.leader().g2().unwrap());
    let ids: Vec<usize> = on_g2.iter().map(|x| x.block_id()).collect();
    let expected = worker_processes::pattern_digests(&ids);
    drop(on_g2);
    fill_g2(&inst_b, 0xEE).await;

    // B learns of A's G2 from A's events, then onboards the prefix from it.
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while inst_b.lookup(&hashes).remote_g2 != Some((a, 6)) {
        assert!(
            std::time::Instant::now() < deadline,
            "B never indexed A's G2: {:?}",
            inst_b.lookup(&hashes)
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let on = inst_b.onboard(&hashes).await.unwrap();
    assert!(on.refused.is_none(), "{:?}", on.refused);
    assert_eq!((on.remote_g2, on.blocks.len()), (Some((a, 6)), 6));
    assert_g1_holds(&inst_b, &on.blocks, &expected).await;
    drop(on);
    assert_eq!(inst_b.stats().remote_g2_blocks, 6);
    assert_eq!(
        inst_b.lookup(&hashes).local_g2,
        6,
        "registered in B's own G2"
    );
    // A's lease ends once B released it.
    let lender = inst_a.lender_stats().unwrap().clone();
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while lender.ended.load(Ordering::Relaxed) < lender.lent.load(Ordering::Relaxed) {
        assert!(std::time::Instant::now() < deadline, "{lender:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(lender.lent.load(Ordering::Relaxed), 1);
    assert_eq!(lender.refused.load(Ordering::Relaxed), 0);

    // A rank of a third instance, driven by its own leader, asks A's rank 0 for the prefix:
    // nothing was lent to C, so nothing comes (and its G2 is untouched). Its rank 1 dialing
    // A's rank 0 is refused at the handshake.
    let _c0 = spawn(c, 0, &dirs[2]);
    let _c1 = spawn(c, 1, &dirs[2]);
    let client = kvbm_cluster::transport::nats::connect(&nats.url, "c", Duration::from_millis(100))
        .await
        .unwrap();
    let leader_c = members.security(c, Role::Leader, 0);
    let controls = worker_processes::nats_controls(&client, c, Duration::from_secs(10), |x| {
        x.with_security(leader_c.clone())
    });
    let a_ranks = inst_a.workers().unwrap().describe_all().await.unwrap();
    let from = |r: usize| a_ranks[r].data_plane.clone().unwrap();
    let ask = |at: usize| ControlRequest::PullSlices {
        from: from(at),
        holder: a,
        hashes: hashes.clone(),
        digests: vec![None; hashes.len()],
        slots: (0..hashes.len()).collect(),
    };
    for (caller, at, kind) in [(0, 0, "not_found"), (1, 0, "refused")] {
        // SAFETY: C's ranks hold nothing of any instance: no leader owns their slots here.
        let r = unsafe { controls[caller].call_unchecked(ask(at)) }
            .await
            .unwrap();
        let ControlResponse::Transferred(out) = r else {
            panic!("{r:?}")
        };
        assert_eq!(out.len(), hashes.len());
        for o in out {
            let f = o.unwrap_err().into_failure();
            assert_eq!(
                f.kind.as_str(),
                kind,
                "rank {caller} from A's rank {at}: {f}"
            );
        }
    }

    for inst in [&inst_a, &inst_b] {
        let s = inst.security().stats().unwrap();
        assert_eq!(s.rejected_total(), 0, "no genuine message refused: {s:?}");
    }

    // C's leader takes leases and never releases them (the lease wire, by hand): after
    // MAX_LEASES_PER_LESSEE, A refuses it more, so it cannot pin A's G2.
    let lease_subject = format!("{}.lease.{:016x}", inst_a.events_subject(), a.0);
    // (JSON by hand: a 128-bit hash is a plain JSON number.)
    let take = |lessee: InstanceId| {
        format!(
            r#"{{"version":1,"body":{{"Take":{{"lessee":{},"hashes":[{}]}}}}}}"#,
            lessee.0,
            hashes[0].as_u128()
        )
    };
    let seal = |lessee: InstanceId| {
        leader_c.seal(
            format!("kvbm/lease/{lease_subject}").as_bytes(),
            take(lessee).as_bytes(),
        )
    };
    let before = lender.refused.load(Ordering::Relaxed);
    let first = seal(c);
    for _ in 0..kvbm_cluster::instance::MAX_LEASES_PER_LESSEE + 1 {
        client
            .request(lease_subject.clone(), seal(c).into())
            .await
            .unwrap();
    }
    assert_eq!(
        lender.lent.load(Ordering::Relaxed),
        1 + kvbm_cluster::instance::MAX_LEASES_PER_LESSEE as u64
    );
    assert_eq!(lender.refused.load(Ordering::Relaxed), before + 1);
    // Another member claiming to take for B, and a sealed take replayed, are dropped
    // unanswered (and counted).
    let unanswered = |sealed: Vec<u8>| {
        let (client, subject) = (client.clone(), lease_subject.clone());
        async move {
            let r = tokio::time::timeout(
                Duration::from_millis(500),
                client.request(subject, sealed.into()),
            )
            .await;
            assert!(r.is_err(), "answered: {r:?}");
        }
    };
    unanswered(seal(b)).await;
    // Answered (refused: over the cap), then the same sealed take again.
    client
        .request(lease_subject.clone(), first.clone().into())
        .await
        .unwrap();
    unanswered(first).await;
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while lender.refused.load(Ordering::Relaxed) < before + 4 {
        assert!(std::time::Instant::now() < deadline, "{lender:?}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }

    // B forgets its copy; A's rank 1 dies: A cannot lend on every rank, so B's load fails
    // (refused), nothing registered, and A holds nothing for it.
    assert_eq!(inst_b.leader().g2().unwrap().reset_inactive_pool(), 6);
    assert_eq!(inst_b.lookup(&hashes).remote_g2, Some((a, 6)));
    ranks[1].kill();
    let on = inst_b.onboard(&hashes).await.unwrap();
    assert!(on.refused.is_some(), "{on:?}");
    assert!(on.blocks.is_empty());
    assert_eq!(inst_b.lookup(&hashes).local_g2, 0, "nothing registered");
    assert!(idle(inst_b.leader().g2().unwrap().pool_counts()));
    assert_eq!(
        lender.lent.load(Ordering::Relaxed),
        1 + kvbm_cluster::instance::MAX_LEASES_PER_LESSEE as u64
    );
    assert!(
        lender.refused.load(Ordering::Relaxed) >= before + 5,
        "{lender:?}"
    );
    inst_b.shutdown().await;
    inst_a.shutdown().await;
}
