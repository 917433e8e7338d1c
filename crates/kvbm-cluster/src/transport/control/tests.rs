//! Unit tests of the control seam in one process: every rank runs a transfer and the bytes
//! arrive (checked by digests), a rank lacking a tier fails the request for all blocks, a
//! worker refuses what it cannot do with a typed error, ranks are validated, and envelopes
//! round-trip through JSON with their version.

use std::sync::Arc;

use kvbm_logical::{Salt, TokenBlockSequence};
use kvbm_physical::{BlockDim, BlockLayout, LayoutKind, PinPolicy, TransferManager};

use super::*;
use crate::transport::InstanceId;

const I: InstanceId = InstanceId(7);

fn geometry() -> BlockLayout {
    BlockLayout::builder()
        .num_blocks(4)
        .num_layers(2)
        .outer_dim(2)
        .page_size(16)
        .inner_dim(16)
        .dtype_bytes(2)
        .kind(LayoutKind::LayerSeparate(BlockDim::OuterContiguous))
        .build()
        .unwrap()
}

fn worker(rank: usize, with_g1: bool) -> Arc<PhysicalWorker> {
    let tm = Arc::new(TransferManager::new().unwrap());
    let host = || {
        tm.register_layout(PhysicalLayout::allocate_host(geometry(), PinPolicy::Unpinned).unwrap())
            .unwrap()
    };
    let mut w = PhysicalWorker::new(rank, tm.clone()).with_layout(TierId::G2, host());
    if with_g1 {
        w = w.with_layout(TierId::G1, host());
    }
    Arc::new(w)
}

fn controlled(ws: &[Arc<PhysicalWorker>]) -> ControlledWorkers {
    ControlledWorkers::new(
        ws.iter()
            .map(|w| Arc::new(InProcessControl::new(I, w.clone())) as Arc<dyn WorkerControl>)
            .collect(),
    )
    .unwrap()
}

fn request() -> TransferRequest {
    let seq =
        TokenBlockSequence::from_tokens(&(0..8).collect::<Vec<u32>>(), 4, Salt::NONE).unwrap();
    let h = seq.hashes();
    TransferRequest {
        src: TierId::G2,
        dst: TierId::G1,
        blocks: vec![(0, 3, h[0]), (1, 2, h[1])],
        layers: None,
        digests: Vec::new(),
    }
}

async fn digests(c: &dyn WorkerControl, tier: TierId, blocks: Vec<BlockId>) -> Vec<u64> {
    // SAFETY: test-owned layouts; no transfer runs while a test reads digests.
    match unsafe { c.call_unchecked(ControlRequest::Digest { tier, blocks }) }
        .await
        .unwrap()
    {
        ControlResponse::Digests(d) => d,
        other => panic!("{other:?}"),
    }
}

#[tokio::test]
async fn every_rank_moves_and_digests_match_per_rank() {
    let ws = [worker(0, true), worker(1, true)];
    let all = controlled(&ws);
    for (r, c) in all.ranks().iter().enumerate() {
        // SAFETY: test-owned layouts; nothing else uses them.
        let filled = unsafe {
            c.call_unchecked(ControlRequest::Fill {
                tier: TierId::G2,
                seed: 0x10 + r as u8,
            })
        }
        .await
        .unwrap();
        assert_eq!(filled, ControlResponse::Done);
    }
    let req = request();
    // SAFETY: test-owned layouts; nothing else reads or writes the slots.
    let out = all
        .transfer(&unsafe { Reserved::vouched(req) })
        .await
        .unwrap();
    assert_eq!(out, vec![Ok(()), Ok(())]);
    let mut per_rank = Vec::new();
    for c in all.ranks() {
        let src = digests(c.as_ref(), TierId::G2, vec![0, 1]).await;
        let dst = digests(c.as_ref(), TierId::G1, vec![3, 2]).await;
        assert_eq!(src, dst, "{}", c.address());
        per_rank.push(src);
    }
    assert_ne!(per_rank[0], per_rank[1], "ranks hold different bytes");
    let info = all.describe_all().await.unwrap();
    assert_eq!(info[1].worker, WorkerAddress::new(I, 1));
    assert_eq!(info[1].tiers, vec![TierId::G1, TierId::G2]);
    assert_eq!(info[1].num_blocks, 4);
}

#[tokio::test]
async fn a_rank_without_the_tier_fails_every_block() {
    let all = controlled(&[worker(0, true), worker(1, false)]);
    // SAFETY: test-owned layouts; nothing else reads or writes the slots.
    let out = ParallelWorkers::execute(&all, unsafe { Reserved::vouched(request()) }).await;
    assert_eq!(out.len(), 2);
    for o in out {
        let m = o.unwrap_err();
        assert!(m.message.starts_with("rank 1: no layout"), "{m}");
        assert_eq!(m.kind, BlockFailureKind::Refused, "{m}");
    }
}

#[tokio::test]
async fn refusals_are_typed_and_name_the_worker() {
    let c = InProcessControl::new(I, worker(0, false));
    // SAFETY: test-owned layouts; nothing else uses them.
    let e = unsafe {
        c.call_unchecked(ControlRequest::Digest {
            tier: TierId::G1,
            blocks: vec![0],
        })
    }
    .await
    .unwrap_err();
    assert!(
        matches!(&e, ControlError::Refused { worker, message }
            if *worker == WorkerAddress::new(I, 0) && message.contains("no G1 layout")),
        "{e:?}"
    );
    // SAFETY: as above.
    let e = unsafe {
        c.call_unchecked(ControlRequest::Digest {
            tier: TierId::G2,
            blocks: vec![4],
        })
    }
    .await
    .unwrap_err();
    assert!(e.to_string().contains("block 4 is out of range"), "{e}");
    assert!(!e.is_unreachable());
}

/// In process, the safe `call` reaches no slot: it answers `Describe` and refuses `Transfer`,
/// `Fill` and `Digest` naming the unsafe way, moving and reading nothing (issue 23).
#[tokio::test]
async fn security_in_process_safe_calls_touch_no_slot() {
    let w = worker(0, true);
    let c = InProcessControl::new(I, w.clone());
    let before = digests(&c, TierId::G1, vec![0, 1, 2, 3]).await;
    for r in [
        ControlRequest::Transfer(request()),
        ControlRequest::Fill {
            tier: TierId::G1,
            seed: 7,
        },
        ControlRequest::Digest {
            tier: TierId::G1,
            blocks: vec![0],
        },
    ] {
        let kind = r.kind();
        let e = c.call(r).await.unwrap_err();
        assert!(
            matches!(&e, ControlError::Refused { message, .. }
                if message.starts_with(kind) && message.contains("call_unchecked")),
            "{e:?}"
        );
    }
    assert_eq!(digests(&c, TierId::G1, vec![0, 1, 2, 3]).await, before);
    // Through the safe `call_all`, every rank refuses a transfer too.
    let all = controlled(&[w]);
    let replies = all.call_all(&ControlRequest::Transfer(request())).await;
    assert!(replies.iter().all(|r| r.is_err()), "{replies:?}");
    assert!(matches!(
        c.call(ControlRequest::Describe).await,
        Ok(ControlResponse::Described(_))
    ));
}

#[test]
fn ranks_are_validated() {
    assert!(ControlledWorkers::new(vec![]).is_err());
    let one = Arc::new(InProcessControl::new(I, worker(1, true))) as Arc<dyn WorkerControl>;
    assert_eq!(
        ControlledWorkers::new(vec![one]).unwrap_err().config_key(),
        Some("workers")
    );
    let a = Arc::new(InProcessControl::new(I, worker(0, true))) as Arc<dyn WorkerControl>;
    let b =
        Arc::new(InProcessControl::new(InstanceId(8), worker(1, true))) as Arc<dyn WorkerControl>;
    assert!(
        ControlledWorkers::new(vec![a, b]).is_err(),
        "one instance only"
    );
}

#[test]
fn envelopes_round_trip_with_their_version() {
    let env = Envelope::new(ControlRequest::Transfer(request()));
    let json = serde_json::to_string(&env).unwrap();
    assert!(
        json.starts_with(&format!("{{\"version\":{PROTOCOL_VERSION},")),
        "{json}"
    );
    let back: Envelope<ControlRequest> = serde_json::from_str(&json).unwrap();
    assert_eq!(back, env);
    assert!(!json.contains("digests"), "no digests, no key: {json}");
    // Digests travel when a block has one.
    let mut with = request();
    with.digests = vec![Some(kvbm_logical::BlockDigest([3; 32])), None];
    let env = Envelope::new(ControlRequest::Transfer(with));
    let back: Envelope<ControlRequest> =
        serde_json::from_str(&serde_json::to_string(&env).unwrap()).unwrap();
    assert_eq!(back, env);
    let reply = Envelope::new(ControlResponse::transferred(vec![
        Ok(()),
        Err(BlockFailure::new(BlockFailureKind::Io, "x")),
    ]));
    let back: Envelope<ControlResponse> =
        serde_json::from_str(&serde_json::to_string(&reply).unwrap()).unwrap();
    assert_eq!(back, reply);
    assert_eq!(
        WorkerAddress::new(InstanceId(0xab), 3).control_subject("kvbm.ctl"),
        "kvbm.ctl.00000000000000ab.worker.3"
    );
}

#[test]
fn failures_keep_their_kind_on_the_wire_and_version_one_still_reads() {
    let sent = ControlResponse::transferred(vec![
        Ok(()),
        Err(BlockFailure::new(
            BlockFailureKind::ChecksumMismatch,
            "bad bytes",
        )),
        Err(BlockFailure::new(BlockFailureKind::Io, "disk hiccup")),
    ]);
    let json = serde_json::to_string(&Envelope::new(sent.clone())).unwrap();
    assert!(json.contains(r#""kind":"checksum_mismatch""#), "{json}");
    let back: Envelope<ControlResponse> = serde_json::from_str(&json).unwrap();
    assert_eq!(back.version, PROTOCOL_VERSION);
    let ControlResponse::Transferred(outcomes) = back.body else {
        panic!("a Transferred reply")
    };
    let kinds: Vec<Option<BlockFailureKind>> = outcomes
        .into_iter()
        .map(|o| o.err().map(|f| f.into_failure().kind))
        .collect();
    assert_eq!(
        kinds,
        [
            None,
            Some(BlockFailureKind::ChecksumMismatch),
            Some(BlockFailureKind::Io)
        ]
    );

    // What a version-1 worker sends: failures as bare text. They read as kind `transfer`,
    // which drops no copy, with the text kept.
    let v1 = r#"{"version":1,"body":{"Transferred":[{"Ok":null},{"Err":"rank 0: short read"}]}}"#;
    let old: Envelope<ControlResponse> = serde_json::from_str(v1).unwrap();
    let ControlResponse::Transferred(outcomes) = old.body else {
        panic!("a Transferred reply")
    };
    let f = outcomes[1].clone().unwrap_err().into_failure();
    assert_eq!(f.kind, BlockFailureKind::Transfer);
    assert!(!f.kind.drops_copy());
    assert_eq!(f.message, "rank 0: short read");

    // A kind a newer peer knows and this build does not: kept as text, never a dropped copy.
    let newer: WireFailure =
        serde_json::from_str(r#"{"kind":"quantum_flux","message":"m"}"#).unwrap();
    let f = newer.into_failure();
    assert_eq!(f.kind, BlockFailureKind::Transfer);
    assert!(f.message.contains("quantum_flux"), "{}", f.message);

    // Answering a version-1 leader: failures go back as text it can decode.
    let for_v1 = serde_json::to_string(&Envelope::in_version(1, sent.for_version(1))).unwrap();
    assert!(!for_v1.contains("\"kind\""), "{for_v1}");
    /// Version 1's per-block outcome: `{"Ok": null}` or `{"Err": "message"}`.
    #[derive(serde::Deserialize, Debug, PartialEq)]
    enum V1Outcome {
        Ok(()),
        Err(String),
    }
    #[derive(serde::Deserialize)]
    enum V1Response {
        Transferred(Vec<V1Outcome>),
    }
    #[derive(serde::Deserialize)]
    struct V1Envelope {
        version: u32,
        body: V1Response,
    }
    let read: V1Envelope = serde_json::from_str(&for_v1).unwrap();
    assert_eq!(read.version, 1);
    let V1Response::Transferred(v) = read.body;
    assert_eq!(v[0], V1Outcome::Ok(()));
    assert_eq!(
        v[1],
        V1Outcome::Err("checksum_mismatch: bad bytes".to_string())
    );
}

#[test]
fn control_errors_fail_blocks_with_a_kind_that_keeps_the_copy() {
    let worker = WorkerAddress::new(I, 0);
    for e in [
        ControlError::Timeout {
            worker,
            timeout_ms: 5,
        },
        ControlError::NoResponders { worker },
        ControlError::Refused {
            worker,
            message: "no".into(),
        },
    ] {
        assert!(!e.failure_kind().drops_copy(), "{e}");
    }
    assert_eq!(
        ControlError::Timeout {
            worker,
            timeout_ms: 5
        }
        .failure_kind(),
        BlockFailureKind::Timeout
    );
}

/// A plain worker (rank 0 of `I`, no security) served over NATS under a fresh subject prefix,
/// its server built by `configure`, and a leader's control of it with `deadline`.
#[cfg(feature = "nats")]
struct Served {
    control: crate::transport::nats::NatsControl,
    stats: Arc<crate::transport::nats::WorkerServerStats>,
    cancel: tokio_util::sync::CancellationToken,
    _task: tokio::task::JoinHandle<()>,
}

#[cfg(feature = "nats")]
async fn served_worker(
    url: &str,
    tag: &str,
    configure: impl FnOnce(crate::transport::nats::WorkerServer) -> crate::transport::nats::WorkerServer,
    deadline: std::time::Duration,
) -> Served {
    use crate::transport::nats::{NatsControl, WorkerServer, connect};
    use std::time::Duration;
    let client = connect(url, "worker", Duration::from_millis(50))
        .await
        .unwrap();
    let prefix = format!("kvbm.test.{tag}.{}", std::process::id());
    let address = WorkerAddress::new(I, 0);
    let server = configure(WorkerServer::new(client, &prefix, address, worker(0, true)));
    let stats = server.stats();
    let cancel = tokio_util::sync::CancellationToken::new();
    let _task = server.start(cancel.clone()).await.unwrap();
    let leader = connect(url, "leader", Duration::from_millis(50))
        .await
        .unwrap();
    Served {
        control: NatsControl::new(leader, &prefix, address, deadline),
        stats,
        cancel,
        _task,
    }
}

/// Attack: a flood of control requests, each of which would get a task of its own. At most
/// `max_in_flight` are served at once; the rest are answered `Refused` at once and counted,
/// and the worker serves again once the flood has passed.
#[cfg(feature = "nats")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn security_worker_requests_beyond_the_cap_are_refused_and_counted() {
    use std::time::Duration;
    let Some(nats) = kvbm_tests::services::nats("security_worker_in_flight") else {
        return;
    };
    let Served {
        control,
        stats,
        cancel,
        _task,
    } = served_worker(
        &nats.url,
        "security_worker",
        |s| {
            s.max_in_flight(2)
                .delay_transfers_from(TierId::G2, Duration::from_millis(1500))
        },
        Duration::from_secs(10),
    )
    .await;
    let calls = (0..8).map(|_| control.call(ControlRequest::Transfer(request())));
    let answers = futures::future::join_all(calls).await;
    let busy = answers
        .iter()
        .filter(|a| matches!(a, Err(ControlError::Refused { message, .. }) if message.contains("worker busy")))
        .count();
    assert_eq!(busy, 6, "{answers:?}");
    assert_eq!(
        answers.iter().filter(|a| a.is_ok()).count(),
        2,
        "{answers:?}"
    );
    assert_eq!(stats.refused_busy(), 6);
    assert_eq!(stats.served(), 2);
    assert_eq!(stats.in_flight(), 0);
    // The flood has passed: the worker serves again.
    assert!(matches!(
        control.call(ControlRequest::Describe).await.unwrap(),
        ControlResponse::Described(_)
    ));
    cancel.cancel();
}

/// A serving task that panics (here: the request hook, which runs inside it) answers nothing,
/// but leaves neither its permit nor its count behind: `in_flight` falls back to 0 and the
/// worker serves the next request.
#[cfg(feature = "nats")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_serving_task_that_panics_is_not_left_counted_in_flight() {
    use std::time::Duration;
    let Some(nats) = kvbm_tests::services::nats("worker_task_panics") else {
        return;
    };
    let Served {
        control,
        stats,
        cancel,
        _task,
    } = served_worker(
        &nats.url,
        "worker_panics",
        |s| {
            s.max_in_flight(1)
                .on_request(Arc::new(|r: &ControlRequest| {
                    if matches!(r, ControlRequest::Transfer(_)) {
                        panic!("a serving task panics");
                    }
                }))
        },
        Duration::from_millis(500),
    )
    .await;
    for _ in 0..2 {
        let answer = control.call(ControlRequest::Transfer(request())).await;
        assert!(answer.is_err(), "{answer:?}");
    }
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while stats.in_flight() != 0 && std::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(stats.in_flight(), 0);
    // The one permit came back too: the next request is served, not refused as busy.
    assert!(matches!(
        control.call(ControlRequest::Describe).await.unwrap(),
        ControlResponse::Described(_)
    ));
    assert_eq!(stats.refused_busy(), 0);
    cancel.cancel();
}

#[cfg(feature = "nats")]
/// Security for `instance`'s `role` at `rank`, issued by `root` in namespace `ns`.
fn member(
    root: &crate::security::RootKey,
    instance: InstanceId,
    role: crate::security::Role,
    rank: u32,
) -> Arc<crate::security::Security> {
    let cred = root
        .issue(
            instance,
            role,
            rank,
            "ns",
            std::time::Duration::from_secs(3600),
        )
        .unwrap();
    Arc::new(crate::security::Security::with_credential(
        root.trust_root(),
        Arc::new(cred),
        &crate::security::SecurityConfig::default(),
    ))
}

#[cfg(feature = "nats")]
fn plain(request: ControlRequest) -> bytes::Bytes {
    serde_json::to_vec(&Envelope::new(request)).unwrap().into()
}

/// Attack (issue 23, item 1): a client on the NATS server without a credential sends
/// `Transfer`, `Fill` and `Digest` to a worker's control subject, and the leader of another
/// instance (same trust root) sends a `Fill`. The worker answers none of them, counts each,
/// its blocks are unchanged, and its own leader still drives it.
#[cfg(feature = "nats")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn security_a_worker_obeys_only_its_own_leader() {
    use crate::security::{Rejection, Role, RootKey};
    use crate::transport::nats::{NatsControl, WorkerServer, connect};
    use std::time::Duration;
    let Some(nats) = kvbm_tests::services::nats("security_worker_own_leader") else {
        return;
    };
    let root = RootKey::generate().unwrap();
    let other = InstanceId(8);
    let worker_sec = member(&root, I, Role::Worker, 0);
    let prefix = format!("kvbm.test.security_own_leader.{}", std::process::id());
    let address = WorkerAddress::new(I, 0);
    let subject = address.control_subject(&prefix);
    let client = connect(&nats.url, "worker", Duration::from_millis(50))
        .await
        .unwrap();
    let server =
        WorkerServer::new(client, &prefix, address, worker(0, true)).security(worker_sec.clone());
    let stats = server.stats();
    let cancel = tokio_util::sync::CancellationToken::new();
    let _task = server.start(cancel.clone()).await.unwrap();

    let leader_client = connect(&nats.url, "leader", Duration::from_millis(50))
        .await
        .unwrap();
    let leader = NatsControl::new(
        leader_client.clone(),
        &prefix,
        address,
        Duration::from_secs(5),
    )
    .with_security(member(&root, I, Role::Leader, 0));
    // The leader fills G2 and G1 and reads their digests: the worker as it must stay.
    for tier in [TierId::G2, TierId::G1] {
        let r = leader
            .call(ControlRequest::Fill { tier, seed: 3 })
            .await
            .unwrap();
        assert_eq!(r, ControlResponse::Done);
    }
    let all: Vec<BlockId> = (0..4).collect();
    let before = (
        digests(&leader, TierId::G2, all.clone()).await,
        digests(&leader, TierId::G1, all.clone()).await,
    );

    // A non-member: plain requests, as anyone on the server could send them.
    let attacker = connect(&nats.url, "attacker", Duration::from_millis(50))
        .await
        .unwrap();
    let forged = [
        ControlRequest::Transfer(TransferRequest {
            src: TierId::G2,
            dst: TierId::G1,
            blocks: vec![(0, 1, request().blocks[0].2)],
            layers: None,
            digests: Vec::new(),
        }),
        ControlRequest::Fill {
            tier: TierId::G1,
            seed: 9,
        },
        ControlRequest::Digest {
            tier: TierId::G2,
            blocks: all.clone(),
        },
    ];
    for r in forged {
        let answer = tokio::time::timeout(
            Duration::from_millis(500),
            attacker.request(subject.clone(), plain(r)),
        )
        .await;
        assert!(answer.is_err(), "a non-member got an answer: {answer:?}");
    }
    // A member of the cluster, but another instance's leader.
    let intruder = NatsControl::new(
        attacker.clone(),
        &prefix,
        address,
        Duration::from_millis(500),
    )
    .with_security(member(&root, other, Role::Leader, 0));
    let r = intruder
        .call(ControlRequest::Fill {
            tier: TierId::G2,
            seed: 9,
        })
        .await;
    assert!(matches!(r, Err(ControlError::Timeout { .. })), "{r:?}");

    let s = worker_sec.stats().unwrap();
    assert_eq!(stats.rejected(), 4);
    assert_eq!(s.rejected(Rejection::Malformed), 3);
    assert_eq!(s.rejected(Rejection::NotAllowed), 1);
    // Unchanged, and still driven by its own leader.
    let after = (
        digests(&leader, TierId::G2, all.clone()).await,
        digests(&leader, TierId::G1, all.clone()).await,
    );
    assert_eq!(before, after);
    let r = leader
        .call(ControlRequest::Transfer(request()))
        .await
        .unwrap();
    assert!(
        matches!(&r, ControlResponse::Transferred(v) if v.iter().all(Result::is_ok)),
        "{r:?}"
    );
    assert!(matches!(
        leader.call(ControlRequest::Describe).await.unwrap(),
        ControlResponse::Described(_)
    ));
    assert_eq!(leader.rejected(), 0);
    cancel.cancel();
}

/// Attack (issue 23, item 1): subscribers of a worker's control subject answer every request
/// at once with `Transferred(Ok…)`, one unsealed, one sealed by another worker of the same
/// instance and bound to the very request. The leader drops both (counted) and takes the real
/// worker's later answer: the transfer failed, so nothing would be registered.
#[cfg(feature = "nats")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn security_a_forged_early_reply_does_not_win() {
    use crate::security::{Rejection, Role, RootKey};
    use crate::transport::nats::{NatsControl, WorkerServer, connect, reply_context};
    use futures::StreamExt;
    use std::time::Duration;
    let Some(nats) = kvbm_tests::services::nats("security_forged_reply") else {
        return;
    };
    let root = RootKey::generate().unwrap();
    let prefix = format!("kvbm.test.security_forged_reply.{}", std::process::id());
    let address = WorkerAddress::new(I, 0);
    let subject = address.control_subject(&prefix);
    let client = connect(&nats.url, "worker", Duration::from_millis(50))
        .await
        .unwrap();
    // No G1: the real transfer fails for every block, after a delay the forgers beat.
    let server = WorkerServer::new(client, &prefix, address, worker(0, false))
        .security(member(&root, I, Role::Worker, 0))
        .delay_transfers_from(TierId::G2, Duration::from_millis(300));
    let cancel = tokio_util::sync::CancellationToken::new();
    let _task = server.start(cancel.clone()).await.unwrap();
    let forger_sec = member(&root, I, Role::Worker, 1);
    let forger = connect(&nats.url, "forger", Duration::from_millis(50))
        .await
        .unwrap();
    let mut sub = forger.subscribe(subject.clone()).await.unwrap();
    forger.flush().await.unwrap();
    let lie: bytes::Bytes =
        plain_response(ControlResponse::Transferred(vec![Ok(()), Ok(())])).into();
    let (f, fs) = (forger.clone(), forger_sec.clone());
    let forging = tokio::spawn(async move {
        let mut n = 0;
        while let Some(m) = sub.next().await {
            let reply = m.reply.clone().unwrap();
            f.publish(reply.clone(), lie.clone()).await.unwrap();
            let sealed = fs.seal(&reply_context("ctl-reply", &m.payload), &lie);
            f.publish(reply, sealed.into()).await.unwrap();
            f.flush().await.unwrap();
            n += 1;
            if n == 1 {
                return n;
            }
        }
        n
    });

    let leader_sec = member(&root, I, Role::Leader, 0);
    let leader = NatsControl::new(
        connect(&nats.url, "leader", Duration::from_millis(50))
            .await
            .unwrap(),
        &prefix,
        address,
        Duration::from_secs(5),
    )
    .with_security(leader_sec.clone());
    // The real answer: every block failed (no G1), whichever way the worker says it.
    let r = leader.call(ControlRequest::Transfer(request())).await;
    assert!(
        matches!(&r, Ok(ControlResponse::Transferred(v)) if v.len() == 2 && v.iter().all(Result::is_err))
            || matches!(&r, Err(ControlError::Refused { .. })),
        "the forged answer won: {r:?}"
    );
    assert_eq!(forging.await.unwrap(), 1);
    cancel.cancel();
    assert_eq!(leader.rejected(), 2);
    let s = leader_sec.stats().unwrap();
    assert_eq!(s.rejected(Rejection::Malformed), 1);
    assert_eq!(s.rejected(Rejection::NotAllowed), 1);
}

#[cfg(feature = "nats")]
fn plain_response(r: ControlResponse) -> Vec<u8> {
    serde_json::to_vec(&Envelope::new(r)).unwrap()
}

/// What a worker can check of a control request itself is refused with an error, never
/// reaches memory (issue 23, item 7): a transfer naming slots beyond the layout fails every
/// block and moves nothing; a digest of a slot beyond the layout is a refusal.
#[tokio::test]
async fn security_serve_refuses_slots_out_of_range() {
    let w = worker(0, true);
    let address = WorkerAddress::new(I, 0);
    let before = digests(
        &InProcessControl::new(I, w.clone()),
        TierId::G1,
        vec![0, 1, 2, 3],
    )
    .await;
    let mut bad = request();
    bad.blocks[0].1 = 4; // one past the last G1 slot
    bad.blocks[1].0 = usize::MAX; // a source far out of range
    // SAFETY: test-owned layouts; nothing else uses them (the request's slots are out of
    // range, which `serve` refuses).
    let ControlResponse::Transferred(out) =
        unsafe { serve(&w, address, None, ControlRequest::Transfer(bad)) }.await
    else {
        panic!("a transfer is answered with outcomes");
    };
    assert_eq!(out.len(), 2);
    assert!(out.iter().all(|o| o.is_err()), "{out:?}");
    let after = digests(
        &InProcessControl::new(I, w.clone()),
        TierId::G1,
        vec![0, 1, 2, 3],
    )
    .await;
    assert_eq!(before, after, "nothing moved");
    // SAFETY: as above.
    let r = unsafe {
        serve(
            &w,
            address,
            None,
            ControlRequest::Digest {
                tier: TierId::G1,
                blocks: vec![4],
            },
        )
    }
    .await;
    assert!(matches!(r, ControlResponse::Refused(_)), "{r:?}");
}
