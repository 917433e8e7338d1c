//! Instances composed from configuration (`kvbm_cluster::instance`), in one process, over a real
//! `nats-server` and the real S3-compatible server:
//!
//! * two instances find each other by heartbeat (each one's `PeerDirectory` gets the other's
//!   data-plane address), B onboards what A offloaded to the shared G4 after A's events, pulls
//!   a G2-only prefix from A over TCP, bytes verified; A leaves, B drops it from the index and
//!   directory and still finds A's G4 objects (presence check);
//! * with a `nats-server` this test restarts itself: after a short outage B resyncs A
//!   (snapshot request) and sees what A stored while the server was away; after an outage
//!   longer than the heartbeat timeout B has expired A, and the snapshot restores blocks whose
//!   events were delivered before the outage and will never be sent again.
//!
//! * an instance's tiers are the tier stack's (one builder): an instance opened on the G3 file
//!   a `TierStack` (driven by the `ReplayDriver`) wrote starts warm from its journal and onboards those blocks from local G3,
//!   bytes verified.
//!
//! * events forged under instance ids that never joined are ignored and counted by both
//!   instances, which keep serving each other.
//!
//! * model fingerprints: four instances, two per model fingerprint, on one bucket, namespace
//!   and NATS subject: zero cross matches (no peer, no index entry, no G4 hit, listed or
//!   probed, across fingerprints), while the same fingerprint matches (G4 and a peer's G2);
//!   and an instance restarted on a G3 file under another fingerprint starts cold.
//!
//! Needs `cargo xtask services start` (or skips under `KVBM_TEST_SKIP_SERVICES=1`).

use std::net::TcpListener;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvbm_cluster::instance::{Instance, synthetic_block};
use kvbm_cluster::pubsub::nats::NatsBus;
use kvbm_cluster::pubsub::{EventBus, EventMessage};
use kvbm_cluster::security::{Credential, Rejection, Role, RootKey, Security, SecurityConfig};
use kvbm_cluster::transport::PeerInfo;
use kvbm_cluster::transport::nats::{connect, reply_context};
use kvbm_engine::InstanceId;
use kvbm_engine::KvbmRuntime;
use kvbm_engine::WorkerAddress;
use kvbm_engine::config::ConfigBuilder;
use kvbm_engine::replay::ReplayDriver;
use kvbm_engine::stack::{Contents, FrontEnd, StackPlan};
use kvbm_logical::{BlockEvent, BlockEventKind, Salt, SequenceHash, TierId, TokenBlockSequence};
use kvbm_tests::wait::eventually_async;

#[path = "../../kvbm-engine/tests/common/mod.rs"]
mod common;

const A: InstanceId = InstanceId(0xa1);
const B: InstanceId = InstanceId(0xb2);

use kvbm_tests::unique;

/// A runtime for one instance: small tiers, fast heartbeats, events flushed at once.
fn runtime(
    nats_url: &str,
    subject: &str,
    s3: Option<(&kvbm_tests::services::S3Service, &str)>,
) -> KvbmRuntime {
    runtime_with(nats_url, subject, s3, 50, &[])
}

/// As [`runtime`], heartbeats every `interval_ms` (timeout 8 intervals), with `sets`.
fn runtime_with(
    nats_url: &str,
    subject: &str,
    s3: Option<(&kvbm_tests::services::S3Service, &str)>,
    interval_ms: u64,
    sets: &[(&str, String)],
) -> KvbmRuntime {
    let mut b = KvbmRuntime::builder()
        .tokio_handle(tokio::runtime::Handle::current())
        // Security is on by default, loopback too: explicitly off here unless a test
        // configures credentials (which turns it on whatever this says).
        .set("security.insecure", true)
        .set("logical.block_size", 4)
        .set("logical.events.max_delay_ms", 1)
        .set("events.idle_tick_ms", 1)
        .set("events.subject", subject)
        .set("tiers.g1_blocks", 16)
        .set("tiers.g2_blocks", 16)
        .set("transport.nats_url", nats_url)
        .set("transport.heartbeat_interval_ms", interval_ms)
        .set("transport.heartbeat_timeout_ms", interval_ms * 8)
        .set("transport.request_timeout_ms", 1000);
    for (k, v) in sets {
        b = b.set(*k, v.as_str());
    }
    if let Some((s3, namespace)) = s3 {
        b = b
            .set("tiers.g4_blocks", 64)
            .set("physical.s3.endpoint", &s3.endpoint)
            .set("physical.s3.bucket", &s3.bucket)
            .set("physical.s3.region", "us-east-1")
            .set("physical.s3.access_key", &s3.access_key)
            .set("physical.s3.secret_key", &s3.secret_key)
            .set("physical.object.namespace", namespace)
            .set("offload.g2_to_g4.use_locks", false);
    }
    b.build().unwrap()
}

/// The subject an instance of these tests (default `[model]`, rank 0 of 1, the geometry of
/// [`instance`]) speaks on: `configured` scoped by its model fingerprint.
fn scoped(configured: &str) -> String {
    let fp = kvbm_engine::config::KvbmConfig::default()
        .fingerprint(common::geometry_with(32).config())
        .unwrap();
    format!("{configured}.{}", fp.key_segment())
}

async fn instance(rt: &KvbmRuntime, id: InstanceId) -> Instance {
    Instance::builder(&rt.handle())
        .id(id)
        .geometry(common::geometry_with(32))
        .build()
        .await
        .unwrap()
}

fn prefix(seed: u32, n: usize) -> Vec<SequenceHash> {
    let tokens: Vec<u32> = (0..(n as u32 * 4)).map(|t| seed * 100_000 + t).collect();
    TokenBlockSequence::from_tokens(&tokens, 4, Salt::NONE)
        .unwrap()
        .hashes()
}

/// Every onboarded block holds exactly the synthetic bytes of its hash.
fn verified(i: &Instance, hashes: &[SequenceHash], got: &kvbm_cluster::instance::Onboarded) {
    assert_eq!(got.blocks.len(), hashes.len(), "{got:?}");
    let mut want = vec![0u8; i.block_bytes()];
    for (b, h) in got.blocks.iter().zip(hashes) {
        assert_eq!(b.sequence_hash(), *h);
        synthetic_block(*h, &mut want);
        assert_eq!(i.read_g1(b).as_ref(), Some(&want), "bytes of {h:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_instances_from_config_share_g4_and_g2_and_drop_a_peer_that_left() {
    two_instances_share_g4_and_g2(false).await;
}

/// The same with authentication on: each instance's `[security]` names the trust root and its
/// own leader credential (a file written by `Credential::save`); every heartbeat, event batch
/// and snapshot page is sealed, and none of the genuine ones is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_instances_from_config_share_g4_and_g2_authenticated() {
    two_instances_share_g4_and_g2(true).await;
}

async fn two_instances_share_g4_and_g2(secure: bool) {
    let test = "two_instances_from_config";
    let (Some(nats), Some(s3)) = (
        kvbm_tests::services::nats(test),
        kvbm_tests::services::s3(test),
    ) else {
        return;
    };
    share_g4_and_g2_and_drop_a_peer_that_left(&nats.url, &s3, &[], secure).await;
}

/// The same two instances on the NATS server with accounts, each logged in as tenant A's
/// `instance_a` user (password file): events, heartbeats, snapshots and the G2 pull all work
/// within the instance role's permissions.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn security_two_instances_on_an_authenticated_nats_server() {
    let test = "two_instances_authenticated";
    let (Some(auth), Some(s3)) = (
        kvbm_tests::services::nats_auth(test),
        kvbm_tests::services::s3(test),
    ) else {
        return;
    };
    let creds = [
        ("transport.nats_auth.user", "instance_a".to_string()),
        (
            "transport.nats_auth.password_file",
            auth.password_file("instance_a").display().to_string(),
        ),
    ];
    share_g4_and_g2_and_drop_a_peer_that_left(&auth.url, &s3, &creds, false).await;
}

async fn share_g4_and_g2_and_drop_a_peer_that_left(
    nats_url: &str,
    s3: &kvbm_tests::services::S3Service,
    extra: &[(&str, String)],
    secure: bool,
) {
    let subject = format!("kvbm.test.{}", unique("inst").replace('-', "_"));
    let namespace = unique("engine-instances");
    let members = Members::new();
    let (rt_a, rt_b) = if secure {
        (
            members.runtime(A, nats_url, &subject, Some((s3, &namespace)), 50),
            members.runtime(B, nats_url, &subject, Some((s3, &namespace)), 50),
        )
    } else {
        (
            runtime_with(nats_url, &subject, Some((s3, &namespace)), 50, extra),
            runtime_with(nats_url, &subject, Some((s3, &namespace)), 50, extra),
        )
    };
    let a = instance(&rt_a, A).await;
    let b = instance(&rt_b, B).await;
    assert_eq!(a.security().is_on(), secure);

    // Heartbeats fill each one's directory with the other's data-plane address.
    eventually_async("peers see each other", || {
        b.peers().get(A) == Some(a.data_plane().unwrap().local_addr())
            && a.peers().get(B) == Some(b.data_plane().unwrap().local_addr())
    })
    .await;
    assert_eq!(b.presence().live_peers(), vec![A]);
    assert_eq!(
        b.presence().peer(A).unwrap().data_plane,
        Some(a.data_plane().unwrap().local_addr().to_string())
    );

    // A computes P1 and offloads it to the shared bucket; P2 stays in A's G2 only.
    let (p1, p2, p3) = (prefix(1, 6), prefix(2, 4), prefix(3, 3));
    assert_eq!(a.compute(&p1, &synthetic_block).unwrap(), 6);
    assert_eq!(a.offload_g4(&p1).await.unwrap(), 6);
    assert_eq!(a.compute(&p2, &synthetic_block).unwrap(), 4);
    eventually_async("B's index has A's G4 and G2 blocks", || {
        p1.iter()
            .all(|h| b.index().locations(*h).contains(&(A, TierId::G4)))
            && p2
                .iter()
                .all(|h| b.index().locations(*h) == vec![(A, TierId::G2)])
    })
    .await;

    // P1 from the shared G4 (learnt from A's events), bytes verified.
    let got = b.onboard(&p1).await.unwrap();
    assert_eq!(
        (got.g4, got.local_g2, got.remote_g2),
        (6, 0, None),
        "{got:?}"
    );
    verified(&b, &p1, &got);
    drop(got);
    // A lookup moves nothing: P1 is now in B's G2, P2 in A's G2.
    let l = b.lookup(&[p1.clone(), p2.clone()].concat());
    assert_eq!(
        (l.local_g2, l.g4, l.remote_g2),
        (6, 0, Some((A, 4))),
        "{l:?}"
    );
    assert!(l.blocks.is_empty());
    // P2 pulled from A's G2 over TCP, bytes verified.
    let got = b.onboard(&p2).await.unwrap();
    assert_eq!(got.remote_g2, Some((A, 4)), "{got:?}");
    verified(&b, &p2, &got);
    drop(got);
    let s = b.stats();
    assert_eq!(
        (s.g4_blocks, s.remote_g2_blocks, s.refused_blocks),
        (6, 4, 0)
    );
    eventually_async("A counted 4 served", || {
        a.data_plane().unwrap().stats().blocks_served() == 4
    })
    .await;

    // A offloads P3 and leaves; B drops A from its index and directory ...
    assert_eq!(a.compute(&p3, &synthetic_block).unwrap(), 3);
    assert_eq!(a.offload_g4(&p3).await.unwrap(), 3);
    a.shutdown().await;
    drop(a);
    eventually_async("B drops A", || {
        b.presence().live_peers().is_empty()
            && b.peers().get(A).is_none()
            && !b.index().instances().contains(&A)
    })
    .await;
    assert!(b.presence().stats().expired >= 1);
    // ... and still serves P3 from the bucket, found by a presence check.
    let got = b.onboard(&p3).await.unwrap();
    assert_eq!((got.g4, got.remote_g2), (3, None), "{got:?}");
    verified(&b, &p3, &got);
    assert_eq!(b.stats().presence_adopted_blocks, 3);
    drop(got);
    if secure {
        let s = b.security().stats().unwrap();
        assert!(s.accepted() > 0);
        assert_eq!(s.rejected_total(), 0, "no genuine message was refused");
        assert_eq!(b.presence().stats().unauthenticated, 0);
    }
    b.shutdown().await;
    rt_a.shutdown();
    rt_b.shutdown();
}

/// Attack: anyone on the NATS server publishes event batches under instance ids that never
/// sent a heartbeat, each naming a block (without the bound every one adds index entries for
/// good). Both instances ignore and count them, their indexes hold only each other, and B still
/// pulls A's G2 blocks over TCP, bytes verified.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn security_forged_events_of_unjoined_instances_do_not_grow_the_index() {
    let test = "security_forged_events";
    let Some(nats) = kvbm_tests::services::nats(test) else {
        return;
    };
    let subject = format!("kvbm.test.{}", unique("forged").replace('-', "_"));
    let (rt_a, rt_b) = (
        runtime(&nats.url, &subject, None),
        runtime(&nats.url, &subject, None),
    );
    let a = instance(&rt_a, A).await;
    let b = instance(&rt_b, B).await;
    eventually_async("peers see each other", || {
        b.presence().is_synced(A) && a.presence().is_synced(B)
    })
    .await;

    let attacker =
        kvbm_cluster::transport::nats::connect(&nats.url, "attacker", Duration::from_millis(100))
            .await
            .unwrap();
    // On the subject the instances speak on (the configured one scoped by their fingerprint).
    let bus = NatsBus::start(
        &rt_a.handle(),
        attacker,
        a.events_subject().to_string(),
        1024,
    )
    .await
    .unwrap();
    let forged = prefix(9, 500);
    for (i, h) in forged.iter().enumerate() {
        bus.send(EventMessage {
            instance: InstanceId(0x5000 + i as u64),
            events: vec![BlockEvent {
                kind: BlockEventKind::Stored,
                tier: TierId::G2,
                hash: *h,
            }]
            .into(),
        });
        if i % 64 == 63 {
            // The bus never waits: pace the attack so none of it is dropped before it is sent.
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }
    eventually_async("both instances ignored every forged batch", || {
        a.presence().stats().unjoined_event_batches == 500
            && b.presence().stats().unjoined_event_batches == 500
    })
    .await;
    assert!(forged.iter().all(|h| b.index().locations(*h).is_empty()));
    let known = b.index().instances();
    assert!(known.iter().all(|i| *i == A || *i == B), "{known:?}");

    // B still serves its members: A's G2 blocks are indexed and pulled over TCP.
    let p = prefix(10, 4);
    assert_eq!(a.compute(&p, &synthetic_block).unwrap(), 4);
    eventually_async("B's index has A's G2 blocks", || {
        p.iter()
            .all(|h| b.index().locations(*h) == vec![(A, TierId::G2)])
    })
    .await;
    let got = b.onboard(&p).await.unwrap();
    assert_eq!(got.remote_g2, Some((A, 4)), "{got:?}");
    verified(&b, &p, &got);
    drop(got);
    assert_eq!(b.stats().refused_blocks, 0);
    b.shutdown().await;
    a.shutdown().await;
    rt_a.shutdown();
    rt_b.shutdown();
}

/// A trust root and leader credentials written to files (`Credential::save`), as an operator
/// issues them.
struct Members {
    root: RootKey,
    dir: tempfile::TempDir,
}

impl Members {
    fn new() -> Self {
        Self {
            root: RootKey::generate().unwrap(),
            dir: tempfile::tempdir().unwrap(),
        }
    }

    fn issue(&self, id: InstanceId, role: Role) -> Credential {
        self.root
            .issue(id, role, 0, "ns", Duration::from_secs(3600))
            .unwrap()
    }

    /// Security of another key for `id`'s `role` (a second credential the root issued).
    fn security(&self, id: InstanceId, role: Role) -> Arc<Security> {
        Arc::new(Security::with_credential(
            self.root.trust_root(),
            Arc::new(self.issue(id, role)),
            &SecurityConfig::default(),
        ))
    }

    /// A runtime whose `[security]` names the root and `id`'s leader credential file.
    fn runtime(
        &self,
        id: InstanceId,
        nats_url: &str,
        subject: &str,
        s3: Option<(&kvbm_tests::services::S3Service, &str)>,
        interval_ms: u64,
    ) -> KvbmRuntime {
        let path = self.dir.path().join(format!("{:x}.cred", id.0));
        self.issue(id, Role::Leader).save(&path).unwrap();
        runtime_with(
            nats_url,
            subject,
            s3,
            interval_ms,
            &[
                ("security.trust_root", self.root.trust_root().to_hex()),
                ("security.credential_file", path.display().to_string()),
            ],
        )
    }
}

fn stored(instance: InstanceId, hashes: &[SequenceHash]) -> EventMessage {
    EventMessage {
        instance,
        events: hashes
            .iter()
            .map(|h| BlockEvent {
                kind: BlockEventKind::Stored,
                tier: TierId::G2,
                hash: *h,
            })
            .collect::<Vec<_>>()
            .into(),
    }
}

/// Attack (issue 23, items 2 and 4), authenticated instances A and B (heartbeats every 500 ms,
/// so a forgery that was believed would still show): a client without a credential, and a
/// member holding another leader credential of B, each
/// * answer A's snapshot requests first with a page claiming A stores forged blocks;
/// * publish a heartbeat naming A with another data-plane address, and one saying A departs;
/// * publish `Stored` events under A's id;
/// and a genuine heartbeat of A is replayed. B drops and counts every one (a replay as
/// `Replayed`): A's entry and address are unchanged, A never expired, no forged block is in
/// B's index or steers its lookup, and B still pulls A's G2 blocks, bytes verified.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn security_forged_heartbeats_departures_events_and_pages_are_dropped() {
    use futures::StreamExt;
    let Some(nats) = kvbm_tests::services::nats("security_forged_presence") else {
        return;
    };
    let configured = format!("kvbm.test.{}", unique("forgedhb").replace('-', "_"));
    // What the instances speak on: the configured subject scoped by their fingerprint.
    let subject = scoped(&configured);
    let members = Members::new();
    let forged = prefix(9, 4);
    let plain = connect(&nats.url, "attacker", Duration::from_millis(100))
        .await
        .unwrap();
    let forger = members.security(B, Role::Leader);

    // Forged snapshot pages, in place before the instances start (so B's first fetch of A
    // meets them): one unsealed, one sealed by the other B key and bound to the request.
    // The page's wire shape (128-bit hashes do not fit a `serde_json::Value`).
    #[derive(serde::Serialize)]
    struct Page {
        version: u32,
        instance: InstanceId,
        entries: Vec<(SequenceHash, TierId)>,
        next: Option<usize>,
    }
    let page = serde_json::to_vec(&Page {
        version: 1,
        instance: A,
        entries: forged.iter().map(|h| (*h, TierId::G2)).collect(),
        next: None,
    })
    .unwrap();
    let mut snap = plain
        .subscribe(format!("{subject}.snapshot.{:016x}", A.0))
        .await
        .unwrap();
    plain.flush().await.unwrap();
    let (p2, f2, page2) = (plain.clone(), forger.clone(), page.clone());
    let answered = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let n = answered.clone();
    let pages = tokio::spawn(async move {
        while let Some(m) = snap.next().await {
            let Some(reply) = m.reply else { continue };
            let sealed = f2.seal(&reply_context("snapshot-reply", &m.payload), &page2);
            let _ = p2.publish(reply.clone(), page2.clone().into()).await;
            let _ = p2.publish(reply, sealed.into()).await;
            let _ = p2.flush().await;
            n.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
    });

    let (rt_a, rt_b) = (
        members.runtime(A, &nats.url, &configured, None, 500),
        members.runtime(B, &nats.url, &configured, None, 500),
    );
    let a = instance(&rt_a, A).await;
    let b = instance(&rt_b, B).await;
    assert_eq!(a.events_subject(), subject);
    let a_addr = a.data_plane().unwrap().local_addr();
    eventually_async("B synced A", || {
        b.presence().is_synced(A) && b.peers().get(A) == Some(a_addr)
    })
    .await;
    // A genuine heartbeat of A that B received too, captured for a replay.
    let mut hbs = plain.subscribe(format!("{subject}.peers")).await.unwrap();
    plain.flush().await.unwrap();
    let observer = members.security(InstanceId(0xc3), Role::Leader);
    let genuine = tokio::time::timeout(Duration::from_secs(5), async {
        loop {
            let m = hbs.next().await.unwrap();
            if let Ok((Some(sender), _)) = observer.open(
                format!("kvbm/heartbeat/{subject}.peers").as_bytes(),
                &m.payload,
            ) && sender.instance == A
            {
                break m.payload;
            }
        }
    })
    .await
    .expect("a sealed heartbeat of A");
    drop(hbs);
    // B's copy was delivered when this one was.
    tokio::time::sleep(Duration::from_millis(50)).await;
    let bs = b.security().stats().unwrap().clone();
    let before = (
        bs.rejected(Rejection::Malformed),
        bs.rejected(Rejection::NotAllowed),
    );
    let presence_before = b.presence().stats();

    // Heartbeats naming A: another address, and a departure.
    let hb = |departing: bool| {
        serde_json::to_vec(&serde_json::json!({
            "version": 1,
            "peer": PeerInfo {
                worker: WorkerAddress::new(A, 0),
                tiers: vec![TierId::G2],
                num_blocks: 16,
                block_bytes: 4096,
                data_plane: Some("127.0.0.1:9".into()),
            },
            "epoch": 1,
            "departing": departing,
            "stored": 0,
        }))
        .unwrap()
    };
    let hb_subject = format!("{subject}.peers");
    let hb_ctx = format!("kvbm/heartbeat/{hb_subject}");
    for departing in [false, true] {
        plain
            .publish(hb_subject.clone(), hb(departing).into())
            .await
            .unwrap();
        plain
            .publish(
                hb_subject.clone(),
                forger.seal(hb_ctx.as_bytes(), &hb(departing)).into(),
            )
            .await
            .unwrap();
    }
    // The replay.
    plain.publish(hb_subject.clone(), genuine).await.unwrap();
    // Stored events under A's id: unsealed, and sealed by the other B key.
    let open_bus = NatsBus::start(&rt_a.handle(), plain.clone(), subject.clone(), 16)
        .await
        .unwrap();
    let member_bus = NatsBus::start_secured(
        &rt_a.handle(),
        rt_a.handle().shutdown_token(),
        plain.clone(),
        subject.clone(),
        16,
        forger.clone(),
    )
    .await
    .unwrap();
    open_bus.send(stored(A, &forged));
    member_bus.send(stored(A, &forged));
    plain.flush().await.unwrap();

    // Every forgery has reached B (the unsealed ones and the replay are counted as they come).
    eventually_async("B has seen every forgery", || {
        bs.rejected(Rejection::Malformed) >= before.0 + 3 && bs.rejected(Rejection::Replayed) >= 1
    })
    .await;
    // Well within A's next heartbeat (500 ms): a believed forgery would still show.
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(b.peers().get(A), Some(a_addr), "A's address unchanged");
    assert_eq!(b.presence().live_peers(), vec![A]);
    assert_eq!(
        b.presence().peer(A).unwrap().data_plane,
        Some(a_addr.to_string())
    );
    let p = b.presence().stats();
    assert_eq!(p.expired, 0, "A was never removed");
    assert!(!b.presence().is_departed(A));
    assert!(
        p.unauthenticated >= presence_before.unauthenticated + 5,
        "{p:?}"
    );
    // The forgers answered B's fetch of A (whether before or after A's real page, which
    // alone was taken: the page race is pinned down in `presence::tests`).
    assert!(answered.load(std::sync::atomic::Ordering::Relaxed) >= 1);
    for h in &forged {
        assert!(b.index().locations(*h).is_empty(), "forged {h:?} indexed");
    }
    let l = b.lookup(&forged);
    assert_eq!((l.remote_g2, l.matched()), (None, 0), "{l:?}");
    assert_eq!(a.presence().stats().expired, 0);
    // The member's forgeries (two heartbeats, one event batch) were refused as not allowed.
    eventually_async("B refused the member's forgeries", || {
        bs.rejected(Rejection::NotAllowed) >= before.1 + 3
    })
    .await;

    // B still serves its members: A's G2 blocks are indexed and pulled, bytes verified.
    let real = prefix(10, 4);
    assert_eq!(a.compute(&real, &synthetic_block).unwrap(), 4);
    eventually_async("B's index has A's G2 blocks", || {
        real.iter()
            .all(|h| b.index().locations(*h) == vec![(A, TierId::G2)])
    })
    .await;
    let got = b.onboard(&real).await.unwrap();
    assert_eq!(got.remote_g2, Some((A, 4)), "{got:?}");
    verified(&b, &real, &got);
    drop(got);
    assert_eq!(b.stats().refused_blocks, 0);
    pages.abort();
    b.shutdown().await;
    a.shutdown().await;
    rt_a.shutdown();
    rt_b.shutdown();
}

/// The instance's synthetic bytes as the stack's [`Contents`]: what the stack computes is what
/// an instance expects to read.
#[derive(Debug)]
struct Synthetic;

impl Contents for Synthetic {
    fn fill(&self, hash: SequenceHash, out: &mut [u8]) {
        synthetic_block(hash, out);
    }

    fn verify(&self, hash: SequenceHash, bytes: &[u8]) -> bool {
        let mut want = vec![0u8; bytes.len()];
        synthetic_block(hash, &mut want);
        want == bytes
    }
}

/// An instance of model `model` (`model.name`) sharing `subject` and the bucket namespace.
async fn of_model(
    nats_url: &str,
    subject: &str,
    s3: &kvbm_tests::services::S3Service,
    namespace: &str,
    model: &str,
    id: InstanceId,
) -> (KvbmRuntime, Instance) {
    let rt = runtime_with(
        nats_url,
        subject,
        Some((s3, namespace)),
        50,
        &[("model.name", model.to_string())],
    );
    let i = instance(&rt, id).await;
    (rt, i)
}

/// Issue 24, item 3: two instances per model fingerprint (models X and Y) on one bucket, one
/// namespace, one configured subject and one NATS server. Within a fingerprint, blocks match:
/// from the shared G4 (by event, and by a late joiner's listing) and from a peer's G2 over TCP,
/// bytes verified. Across fingerprints, zero matches: no peer, no index entry, no G4 hit (by
/// event, listing or presence check), although both models store the very same sequence
/// hashes in the same bucket.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn instances_of_different_model_fingerprints_never_match_on_one_bucket_and_server() {
    let test = "fingerprints";
    let (Some(nats), Some(s3)) = (
        kvbm_tests::services::nats(test),
        kvbm_tests::services::s3(test),
    ) else {
        return;
    };
    let subject = format!("kvbm.test.{}", unique("fp").replace('-', "_"));
    let namespace = unique("engine-fingerprints");
    let (x1, x2, y1, y2) = (
        InstanceId(0x11),
        InstanceId(0x12),
        InstanceId(0x21),
        InstanceId(0x22),
    );
    let (rt_x1, a) = of_model(&nats.url, &subject, &s3, &namespace, "model-x", x1).await;
    let (rt_x2, b) = of_model(&nats.url, &subject, &s3, &namespace, "model-x", x2).await;
    let (rt_y1, c) = of_model(&nats.url, &subject, &s3, &namespace, "model-y", y1).await;
    let (rt_y2, d) = of_model(&nats.url, &subject, &s3, &namespace, "model-y", y2).await;
    assert_eq!(a.fingerprint(), b.fingerprint());
    assert_eq!(c.fingerprint(), d.fingerprint());
    assert_ne!(a.fingerprint(), c.fingerprint());
    assert_ne!(a.events_subject(), c.events_subject());
    assert!(a.events_subject().starts_with(&subject));

    // Each sees only the peer of its own fingerprint.
    eventually_async("peers of one fingerprint see each other", || {
        a.peers().get(x2).is_some()
            && b.peers().get(x1).is_some()
            && c.peers().get(y2).is_some()
            && d.peers().get(y1).is_some()
    })
    .await;

    // Both models store the same prefixes: P1 to the shared bucket, P2 in G2 only.
    let (p1, p2) = (prefix(11, 6), prefix(12, 4));
    for w in [&a, &c] {
        assert_eq!(w.compute(&p1, &synthetic_block).unwrap(), 6);
        assert_eq!(w.offload_g4(&p1).await.unwrap(), 6);
        assert_eq!(w.compute(&p2, &synthetic_block).unwrap(), 4);
    }
    // The reader of each fingerprint learns of its writer's blocks (the positive control:
    // every writer's events went out) ...
    for (reader, writer) in [(&b, x1), (&d, y1)] {
        eventually_async("the same fingerprint's events arrive", || {
            p1.iter()
                .all(|h| reader.index().locations(*h).contains(&(writer, TierId::G4)))
                && p2
                    .iter()
                    .all(|h| reader.index().locations(*h) == vec![(writer, TierId::G2)])
        })
        .await;
    }
    // ... and of nothing else: no peer, no index entry of the other fingerprint.
    for (i, others) in [
        (&a, [y1, y2]),
        (&b, [y1, y2]),
        (&c, [x1, x2]),
        (&d, [x1, x2]),
    ] {
        for o in others {
            assert!(
                i.peers().get(o).is_none(),
                "{o} is a peer across fingerprints"
            );
            assert!(
                !i.index().instances().contains(&o),
                "{o} indexed across fingerprints"
            );
            assert!(!i.presence().live_peers().contains(&o));
        }
    }

    // The same fingerprint matches: P1 from G4, P2 from the writer's G2, bytes verified.
    for (reader, writer) in [(&b, x1), (&d, y1)] {
        let got = reader.onboard(&p1).await.unwrap();
        assert_eq!((got.g4, got.remote_g2), (6, None), "{got:?}");
        verified(reader, &p1, &got);
        drop(got);
        let got = reader.onboard(&p2).await.unwrap();
        assert_eq!(got.remote_g2, Some((writer, 4)), "{got:?}");
        verified(reader, &p2, &got);
        drop(got);
        let s = reader.stats();
        assert_eq!(
            (s.g4_blocks, s.remote_g2_blocks, s.refused_blocks),
            (6, 4, 0)
        );
    }

    // A late joiner of each fingerprint lists the bucket at start: it finds its own
    // fingerprint's P1 and only that (both models wrote the same hashes).
    let (rt_y3, e) = of_model(
        &nats.url,
        &subject,
        &s3,
        &namespace,
        "model-y",
        InstanceId(0x23),
    )
    .await;
    let (rt_z, f) = of_model(
        &nats.url,
        &subject,
        &s3,
        &namespace,
        "model-z",
        InstanceId(0x31),
    )
    .await;
    assert_eq!(
        e.lookup(&p1).g4,
        6,
        "the same fingerprint's objects are listed"
    );
    let l = f.lookup(&[p1.clone(), p2.clone()].concat());
    assert_eq!((l.matched(), l.blocks.len()), (0, 0), "{l:?}");
    // Asking the bucket itself (presence check) finds nothing of another fingerprint either,
    // and nothing is refused or deleted: the other model's objects are simply not there.
    let got = f.onboard(&p1).await.unwrap();
    assert_eq!(
        (got.matched(), got.blocks.len(), got.refused.as_ref()),
        (0, 0, None),
        "{got:?}"
    );
    let s = f.stats();
    assert_eq!(
        (
            s.g4_blocks,
            s.remote_g2_blocks,
            s.presence_adopted_blocks,
            s.refused_blocks
        ),
        (0, 0, 0, 0)
    );
    assert!(f.peers().get(x1).is_none() && f.peers().get(y1).is_none());
    // The other fingerprints' objects are still there for their own readers.
    let got = e.onboard(&p1).await.unwrap();
    assert_eq!(got.g4, 6, "{got:?}");
    verified(&e, &p1, &got);
    drop(got);

    for i in [a, b, c, d, e, f] {
        i.shutdown().await;
    }
    for rt in [rt_x1, rt_x2, rt_y1, rt_y2, rt_y3, rt_z] {
        rt.shutdown();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_instance_starts_warm_from_the_g3_a_tier_stack_wrote() {
    let Some(nats) = kvbm_tests::services::nats("instance_g3_warm") else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let disk = dir.path().join("g3").join("g3.bin");
    let block_bytes = common::geometry_with(32).config().block_bytes();
    // A block's fingerprint binds its geometry: the instance takes the stack's (the stack's
    // blocks are `tiers.block_bytes` opaque bytes: 1 layer × 1 token × block_bytes bytes).
    let stack_geometry = kvbm_physical::BlockLayout::builder()
        .num_blocks(1)
        .num_layers(1)
        .outer_dim(1)
        .page_size(1)
        .inner_dim(block_bytes)
        .dtype_bytes(1)
        .build()
        .unwrap();
    let p = prefix(7, 6);

    // A tier stack computes P and writes it down to G3 (slots and journal), then finishes and
    // closes the file. It runs its own runtimes: off this test's async context.
    let (file, hashes) = (disk.clone(), p.clone());
    std::thread::spawn(move || {
        let config = ConfigBuilder::new()
            .set("logical.block_size", 4)
            .set("tiers.g1_blocks", 16)
            .set("tiers.g2_blocks", 8)
            .set("tiers.g3_blocks", 16)
            .set("tiers.block_bytes", block_bytes)
            .set("physical.disk.path", file.display().to_string())
            .build()
            .unwrap();
        let mut plan = StackPlan::new(config, Arc::new(Synthetic)).unwrap();
        plan.front_end = FrontEnd::Sessions;
        let mut stack = ReplayDriver::build(&plan).unwrap();
        assert_eq!(stack.serve(&hashes).unwrap().computed, 6);
        stack.finish().unwrap();
    })
    .join()
    .unwrap();

    // An instance on the same file: the journal lists P, so it is in the instance's G3 at
    // start and onboards from there, every block with the bytes the stack computed.
    let runtime = |model: &str| {
        KvbmRuntime::builder()
            .tokio_handle(tokio::runtime::Handle::current())
            .set("security.insecure", true) // explicitly off: no credentials here
            .set("logical.block_size", 4)
            .set(
                "events.subject",
                format!("kvbm.test.{}", unique("g3warm").replace('-', "_")),
            )
            .set("model.name", model)
            .set("tiers.g1_blocks", 16)
            .set("tiers.g2_blocks", 16)
            .set("tiers.g3_blocks", 16)
            .set("physical.disk.path", disk.display().to_string())
            .set("transport.nats_url", &nats.url)
            .build()
            .unwrap()
    };
    let on_stack_geometry = |rt: &KvbmRuntime| {
        Instance::builder(&rt.handle())
            .id(A)
            .geometry(stack_geometry)
            .build()
    };
    let rt = runtime("unnamed");
    let i = on_stack_geometry(&rt).await.unwrap();
    assert_eq!(i.lookup(&p).local_g3, 6, "G3 is warm from the journal");
    let got = i.onboard(&p).await.unwrap();
    assert_eq!(
        (got.local_g3, got.local_g2, got.refused.as_ref()),
        (6, 0, None),
        "{got:?}"
    );
    verified(&i, &p, &got);
    drop(got);
    assert_eq!(i.stats().local_g3_blocks, 6);
    i.shutdown().await;
    drop(i);
    rt.shutdown();

    // Restarted on the same file under another model fingerprint: G3 starts cold. The blocks
    // written for the other model are a miss, never a hit (nothing served, nothing refused).
    let rt = runtime("another-model");
    let i = on_stack_geometry(&rt).await.unwrap();
    assert_eq!(
        i.lookup(&p).matched(),
        0,
        "G3 is cold under another fingerprint"
    );
    let got = i.onboard(&p).await.unwrap();
    assert_eq!(
        (got.matched(), got.blocks.len(), got.refused.as_ref()),
        (0, 0, None),
        "{got:?}"
    );
    assert_eq!(i.stats().local_g3_blocks, 0);
    i.shutdown().await;
    rt.shutdown();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_instance_writes_g3_through_its_lane_and_restarts_warm_from_it() {
    let Some(nats) = kvbm_tests::services::nats("instance_g3_lane") else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let disk = dir.path().join("g3").join("g3.bin");
    let subject = format!("kvbm.test.{}", unique("g3lane").replace('-', "_"));
    let runtime = || {
        KvbmRuntime::builder()
            .tokio_handle(tokio::runtime::Handle::current())
            .set("security.insecure", true) // explicitly off: no credentials here
            .set("logical.block_size", 4)
            .set("events.subject", &subject)
            .set("tiers.g1_blocks", 16)
            .set("tiers.g2_blocks", 8)
            .set("tiers.g3_blocks", 16)
            .set("physical.disk.path", disk.display().to_string())
            .set("transport.nats_url", &nats.url)
            .build()
            .unwrap()
    };
    let p = prefix(11, 6);

    // The instance computes P into G2 and writes it to its own G3 through the G2→G3 lane.
    let rt = runtime();
    let i = instance(&rt, A).await;
    assert_eq!(i.compute(&p, &synthetic_block).unwrap(), 6);
    assert_eq!(i.offload_g3(&p).await.unwrap(), 6);
    assert_eq!(i.stats().offloaded_g3_blocks, 6);
    let l = i.lookup(&p);
    assert_eq!((l.local_g2, l.local_g3), (6, 0), "G2 is searched first");
    // Asked again, the lane filters out what G3 already holds: nothing is written twice.
    assert_eq!(i.offload_g3(&p).await.unwrap(), 0);
    i.shutdown().await;
    drop(i);
    rt.shutdown();

    // The next instance on the same file: G2 starts empty, G3 warm from the journal the lane
    // wrote; P onboards from G3 with the bytes the first instance computed.
    let rt = runtime();
    let i = instance(&rt, A).await;
    let l = i.lookup(&p);
    assert_eq!((l.local_g2, l.local_g3), (0, 6), "{l:?}");
    let got = i.onboard(&p).await.unwrap();
    assert_eq!((got.local_g3, got.refused.as_ref()), (6, None), "{got:?}");
    verified(&i, &p, &got);
    drop(got);
    assert_eq!(i.stats().local_g3_blocks, 6);
    i.shutdown().await;
    rt.shutdown();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_instance_refuses_a_config_it_cannot_run_naming_the_key() {
    // Checked before anything connects: no servers needed. (G3 without a disk and G4 without
    // S3 are refused by the configuration's own validation.)
    let rt = |sets: &[(&str, serde_json::Value)]| {
        let mut b = KvbmRuntime::builder()
            .tokio_handle(tokio::runtime::Handle::current())
            .set("tiers.g1_blocks", 8)
            .set("transport.nats_url", "nats://127.0.0.1:1");
        for (k, v) in sets {
            b = b.set(*k, v.clone());
        }
        b.build().unwrap()
    };
    let key = |r: kvbm_engine::Result<Instance>| match r {
        Err(e) => e.config_key().map(str::to_string),
        Ok(_) => panic!("must fail"),
    };
    let geometry = common::geometry_with(32);
    let r = rt(&[]);
    assert_eq!(
        key(Instance::builder(&r.handle()).build().await).as_deref(),
        Some("instance.geometry")
    );
    for (sets, want) in [
        (vec![("tiers.g1_blocks", 0.into())], "tiers.g1_blocks"),
        (vec![("tiers.g2_blocks", 0.into())], "tiers.g2_blocks"),
    ] {
        let r = rt(&sets);
        let got = key(Instance::builder(&r.handle())
            .geometry(geometry)
            .build()
            .await);
        assert_eq!(got.as_deref(), Some(want));
        r.shutdown();
    }
    // No NATS url at all.
    let r = KvbmRuntime::builder()
        .tokio_handle(tokio::runtime::Handle::current())
        .set("tiers.g1_blocks", 8)
        .build()
        .unwrap();
    assert_eq!(
        key(Instance::builder(&r.handle())
            .geometry(geometry)
            .build()
            .await)
        .as_deref(),
        Some("transport.nats_url")
    );
}

/// A `nats-server` this test owns, on a fixed port so it can be restarted at the same address.
struct OwnServer {
    port: u16,
    child: Option<Child>,
}

impl OwnServer {
    fn start(port: u16) -> Self {
        let mut s = Self { port, child: None };
        s.restart();
        s
    }
    fn restart(&mut self) {
        assert!(self.child.is_none());
        let child = Command::new("nats-server")
            .args(["-a", "127.0.0.1", "-p", &self.port.to_string()])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("nats-server is on PATH (cargo xtask services installs it)");
        self.child = Some(child);
        let start = Instant::now();
        while std::net::TcpStream::connect(("127.0.0.1", self.port)).is_err() {
            assert!(
                start.elapsed() < Duration::from_secs(10),
                "nats-server starts"
            );
            std::thread::sleep(Duration::from_millis(10));
        }
    }
    fn stop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
    fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }
}

impl Drop for OwnServer {
    fn drop(&mut self) {
        self.stop();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cross_instance_index_recovers_after_the_nats_server_restarts() {
    if kvbm_tests::services::nats("index_recovers").is_none() {
        return;
    }
    let port = {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let mut server = OwnServer::start(port);
    let subject = "kvbm.test.recover";
    let (rt_a, rt_b) = (
        runtime(&server.url(), subject, None),
        runtime(&server.url(), subject, None),
    );
    let a = instance(&rt_a, A).await;
    let b = instance(&rt_b, B).await;
    eventually_async("B synced A", || b.presence().is_synced(A)).await;
    let (p1, p2, p3) = (prefix(1, 4), prefix(2, 4), prefix(3, 4));
    a.compute(&p1, &synthetic_block).unwrap();
    eventually_async("B learns P1 from events", || {
        b.index().prefix_by_instance(&p1, Some(B)) == vec![(A, 4)]
    })
    .await;

    // Short outage (below the heartbeat timeout): both clients reconnect; B resyncs A.
    let resyncs = b.presence().stats().resyncs;
    server.stop();
    a.compute(&p2, &synthetic_block).unwrap();
    tokio::time::sleep(Duration::from_millis(100)).await;
    server.restart();
    eventually_async("B resynced A after the reconnect", || {
        b.presence().stats().resyncs > resyncs && b.presence().is_synced(A)
    })
    .await;
    eventually_async("B has P1 and P2", || {
        b.index()
            .prefix_by_instance(&[p1.clone(), p2.clone()].concat(), Some(B))
            == vec![(A, 8)]
    })
    .await;

    // Long outage: B hears no heartbeat and expires A (P1 and P2 leave its index) ...
    server.stop();
    eventually_async("B expires A", || {
        b.presence().live_peers().is_empty() && b.index().is_empty() && b.peers().get(A).is_none()
    })
    .await;
    a.compute(&p3, &synthetic_block).unwrap();
    server.restart();
    // ... and when the server is back, A's heartbeat makes B ask for a snapshot: P1's and
    // P2's events were delivered before the outage and are never sent again, so only the
    // snapshot can bring them back.
    eventually_async("B has P1, P2 and P3 again", || {
        b.index()
            .prefix_by_instance(&[p1.clone(), p2.clone(), p3.clone()].concat(), Some(B))
            == vec![(A, 12)]
    })
    .await;
    assert_eq!(b.peers().get(A), Some(a.data_plane().unwrap().local_addr()));
    // B pulls the whole of it from A over TCP, bytes verified.
    let all = [p1, p2, p3].concat();
    let got = b.onboard(&all).await.unwrap();
    assert_eq!(got.remote_g2, Some((A, 12)), "{got:?}");
    verified(&b, &all, &got);
    drop(got);
    assert!(a.presence().stats().snapshots_served >= 2);
    a.shutdown().await;
    b.shutdown().await;
    rt_a.shutdown();
    rt_b.shutdown();
}
