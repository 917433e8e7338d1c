//! The presence protocol over a real `nats-server`, without instances around it: a snapshot
//! answered in several pages restores everything a peer stores, the peer's data-plane address
//! reaches the directory, garbage on the heartbeat subject is skipped and counted, and a peer
//! that falls silent (no departure message) expires from the index and the directory. The
//! `security_*` tests attack the bounds: endless and oversized snapshots, a hostile snapshot
//! offset, and events of instances that never joined.

use kvbm_logical::{BlockEvent, BlockEventKind, Salt, TokenBlockSequence};

use super::*;
use crate::transport::nats::connect_observed;
use kvbm_engine::WorkerAddress;
use kvbm_engine::runtime::KvbmRuntime;
use kvbm_tests::wait::eventually_async;

const A: InstanceId = InstanceId(0xa);
const B: InstanceId = InstanceId(0xb);

fn info(id: InstanceId, addr: &str) -> PeerInfo {
    PeerInfo {
        worker: WorkerAddress::new(id, 0),
        tiers: vec![TierId::G2],
        num_blocks: 16,
        block_bytes: 4096,
        data_plane: Some(addr.to_string()),
    }
}

/// G2 events of `kind` for `hashes`.
fn g2_events(hashes: &[SequenceHash], kind: BlockEventKind) -> Vec<BlockEvent> {
    hashes
        .iter()
        .map(|h| BlockEvent {
            kind,
            tier: TierId::G2,
            hash: *h,
        })
        .collect()
}

/// An instance's own index holding `hashes` as stored in its G2 (what its snapshot answers).
fn own_index(id: InstanceId, hashes: &[SequenceHash]) -> Arc<CrossInstanceIndex> {
    let own = Arc::new(CrossInstanceIndex::new());
    own.apply_events(id, &g2_events(hashes, BlockEventKind::Stored));
    own
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paged_snapshot_restores_a_peer_and_a_silent_peer_expires() {
    let Some(nats) = kvbm_tests::services::nats("presence_pages") else {
        return;
    };
    let runtime = KvbmRuntime::builder()
        .tokio_handle(tokio::runtime::Handle::current())
        .build()
        .unwrap();
    let rt = runtime.handle();
    let subject = format!("kvbm.test.presence.{}", std::process::id());
    let config = PresenceConfig {
        interval: Duration::from_millis(30),
        timeout: Duration::from_millis(300),
        request_timeout: Duration::from_secs(2),
        snapshot_page: 3,
        max_pages: 1024,
        max_entries: 1 << 20,
    };
    let hashes = TokenBlockSequence::from_tokens(&(0..40).collect::<Vec<u32>>(), 4, Salt::NONE)
        .unwrap()
        .hashes();
    let own_a = own_index(A, &hashes);
    assert_eq!(own_a.entries_of(A).len(), 10);

    let (ca, ea) = connect_observed(&nats.url, "a", Duration::from_millis(50))
        .await
        .unwrap();
    let (cb, eb) = connect_observed(&nats.url, "b", Duration::from_millis(50))
        .await
        .unwrap();
    let stop_a = CancellationToken::new();
    let a = Presence::start(
        &rt,
        stop_a.clone(),
        ca.clone(),
        ea,
        &subject,
        config,
        info(A, "127.0.0.1:7001"),
        Arc::new(CrossInstanceIndex::new()),
        own_a.clone(),
        Arc::new(PeerDirectory::new()),
    )
    .await
    .unwrap();
    let (index_b, dir_b) = (
        Arc::new(CrossInstanceIndex::new()),
        Arc::new(PeerDirectory::new()),
    );
    let b = Presence::start(
        &rt,
        CancellationToken::new(),
        cb,
        eb,
        &subject,
        config,
        info(B, "127.0.0.1:7002"),
        index_b.clone(),
        Arc::new(CrossInstanceIndex::new()),
        dir_b.clone(),
    )
    .await
    .unwrap();

    eventually_async("B synced A", || b.is_synced(A)).await;
    assert_eq!(index_b.entries_of(A), own_a.entries_of(A));
    // 10 entries in pages of 3: 4 answers, cut from one copy.
    assert_eq!(a.stats().snapshots_served, 4);
    assert_eq!(b.stats().resyncs, 1);
    assert_eq!(dir_b.get(A), Some("127.0.0.1:7001".parse().unwrap()));
    assert_eq!(b.peer(A).unwrap().worker.instance, A);

    // Pages of one series come from one copy: removing blocks between pages shifts nothing.
    let before = own_a.entries_of(A);
    let ask = |series: u64, offset: usize| {
        let cb = ca.clone();
        let subject = snapshot_subject(&subject, A);
        async move {
            let req = SnapshotRequest {
                version: PRESENCE_WIRE_VERSION,
                series,
                offset,
            };
            let answer = cb
                .request(subject, serde_json::to_vec(&req).unwrap().into())
                .await
                .unwrap();
            serde_json::from_slice::<SnapshotPage>(&answer.payload).unwrap()
        }
    };
    let first = ask(7, 0).await;
    assert_eq!(
        (first.entries.as_slice(), first.next),
        (&before[..3], Some(3))
    );
    let removed: Vec<BlockEvent> = before[..2]
        .iter()
        .map(|(h, t)| BlockEvent {
            kind: BlockEventKind::Removed,
            tier: *t,
            hash: *h,
        })
        .collect();
    own_a.apply_events(A, &removed);
    let second = ask(7, 3).await;
    assert_eq!(
        (second.entries.as_slice(), second.next),
        (&before[3..6], Some(6))
    );
    // A series the answerer has no copy of starts over (the fetch fails and is retried).
    let unknown = ask(8, 3).await;
    assert_eq!((unknown.entries.len(), unknown.next), (0, Some(0)));
    own_a.apply_events(A, &g2_events(&hashes[..2], BlockEventKind::Stored));

    // Garbage and another version on the heartbeat subject are skipped and counted.
    ca.publish(format!("{subject}.peers"), "garbage".into())
        .await
        .unwrap();
    let other_version = Heartbeat {
        version: 99,
        peer: info(InstanceId(0xc), "127.0.0.1:7003"),
        epoch: 1,
        departing: false,
        stored: 0,
    };
    ca.publish(
        format!("{subject}.peers"),
        serde_json::to_vec(&other_version).unwrap().into(),
    )
    .await
    .unwrap();
    eventually_async("B rejected both", || b.stats().rejected == 2).await;
    assert_eq!(b.live_peers(), vec![A]);

    // A falls silent without a departure message: B expires it after the timeout.
    stop_a.cancel();
    eventually_async("B expires A", || {
        b.live_peers().is_empty() && index_b.is_empty() && dir_b.get(A).is_none()
    })
    .await;
    assert!(b.is_departed(A));
    assert_eq!(b.stats().expired, 1);
    runtime.shutdown();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_event_that_arrives_while_a_snapshot_is_fetched_survives_the_older_snapshot() {
    let Some(nats) = kvbm_tests::services::nats("presence_race") else {
        return;
    };
    let runtime = KvbmRuntime::builder()
        .tokio_handle(tokio::runtime::Handle::current())
        .build()
        .unwrap();
    let rt = runtime.handle();
    let subject = format!("kvbm.test.presence_race.{}", std::process::id());
    let config = PresenceConfig {
        interval: Duration::from_millis(30),
        timeout: Duration::from_secs(5),
        request_timeout: Duration::from_secs(5),
        snapshot_page: SNAPSHOT_PAGE,
        max_pages: 1024,
        max_entries: 1 << 20,
    };
    let hashes = TokenBlockSequence::from_tokens(&(0..8).collect::<Vec<u32>>(), 4, Salt::NONE)
        .unwrap()
        .hashes();
    let (x, y) = (hashes[0], hashes[1]);

    // B, following events we hand it directly.
    let (cb, eb) = connect_observed(&nats.url, "b", Duration::from_millis(50))
        .await
        .unwrap();
    let index_b = Arc::new(CrossInstanceIndex::new());
    let b = Presence::start(
        &rt,
        CancellationToken::new(),
        cb,
        eb,
        &subject,
        config,
        info(B, "127.0.0.1:7002"),
        index_b.clone(),
        Arc::new(CrossInstanceIndex::new()),
        Arc::new(PeerDirectory::new()),
    )
    .await
    .unwrap();
    let (events, rx) = tokio::sync::broadcast::channel(16);
    b.follow(&rt, CancellationToken::new(), rx).unwrap();

    // "A" by hand: heartbeats, and a snapshot answer that is older than an event B receives
    // while it waits for the answer.
    let ca = crate::transport::nats::connect(&nats.url, "a", Duration::from_millis(50))
        .await
        .unwrap();
    let mut requests = ca.subscribe(snapshot_subject(&subject, A)).await.unwrap();
    ca.flush().await.unwrap();
    let hb = Heartbeat {
        version: PRESENCE_WIRE_VERSION,
        peer: info(A, "127.0.0.1:7001"),
        epoch: 1,
        departing: false,
        stored: 1,
    };
    ca.publish(
        heartbeat_subject(&subject),
        serde_json::to_vec(&hb).unwrap().into(),
    )
    .await
    .unwrap();
    let request = tokio::time::timeout(Duration::from_secs(10), requests.next())
        .await
        .unwrap()
        .unwrap();
    events
        .send(crate::pubsub::EventMessage {
            instance: A,
            events: vec![BlockEvent {
                kind: BlockEventKind::Stored,
                tier: TierId::G2,
                hash: x,
            }]
            .into(),
        })
        .unwrap();
    eventually_async("B applied the event", || {
        index_b.locations(x) == vec![(A, TierId::G2)]
    })
    .await;
    let page = SnapshotPage {
        version: PRESENCE_WIRE_VERSION,
        instance: A,
        entries: vec![(y, TierId::G2)],
        next: None,
    };
    ca.publish(
        request.reply.unwrap(),
        serde_json::to_vec(&page).unwrap().into(),
    )
    .await
    .unwrap();
    eventually_async("B synced A", || b.is_synced(A)).await;
    let mut want = vec![(x, TierId::G2), (y, TierId::G2)];
    want.sort();
    assert_eq!(index_b.entries_of(A), want);
    runtime.shutdown();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn events_lost_while_connected_are_repaired_once_the_peer_is_quiet() {
    let Some(nats) = kvbm_tests::services::nats("presence_drift") else {
        return;
    };
    let runtime = KvbmRuntime::builder()
        .tokio_handle(tokio::runtime::Handle::current())
        .build()
        .unwrap();
    let rt = runtime.handle();
    let subject = format!("kvbm.test.presence_drift.{}", std::process::id());
    let config = PresenceConfig {
        interval: Duration::from_millis(30),
        timeout: Duration::from_secs(5),
        request_timeout: Duration::from_secs(2),
        snapshot_page: SNAPSHOT_PAGE,
        max_pages: 1024,
        max_entries: 1 << 20,
    };
    let hashes = TokenBlockSequence::from_tokens(&(0..48).collect::<Vec<u32>>(), 4, Salt::NONE)
        .unwrap()
        .hashes();
    let own_a = own_index(A, &hashes[..10]);
    let start = |name: &'static str, id, own: Arc<CrossInstanceIndex>, index| {
        let rt = rt.clone();
        let (url, subject) = (nats.url.clone(), subject.clone());
        async move {
            let (c, e) = connect_observed(&url, name, Duration::from_millis(50))
                .await
                .unwrap();
            Presence::start(
                &rt,
                CancellationToken::new(),
                c,
                e,
                &subject,
                config,
                info(id, "127.0.0.1:7001"),
                index,
                own,
                Arc::new(PeerDirectory::new()),
            )
            .await
            .unwrap()
        }
    };
    let _a = start("a", A, own_a.clone(), Arc::new(CrossInstanceIndex::new())).await;
    let index_b = Arc::new(CrossInstanceIndex::new());
    let b = start("b", B, Arc::new(CrossInstanceIndex::new()), index_b.clone()).await;
    eventually_async("B synced A", || b.is_synced(A)).await;
    assert_eq!(index_b.count_of(A), 10);
    assert_eq!(b.stats().drift_detected, 0);

    // Lost Stored events: A stores 2 blocks B never hears of; B's index also lost 3 of the
    // blocks it knew (as if their events never came). No reconnect, no new epoch.
    own_a.apply_events(A, &g2_events(&hashes[10..12], BlockEventKind::Stored));
    index_b.apply_events(A, &g2_events(&hashes[..3], BlockEventKind::Removed));
    eventually_async("B repaired its index", || {
        index_b.entries_of(A) == own_a.entries_of(A)
    })
    .await;
    assert!(b.stats().drift_detected >= 1);
    assert!(b.stats().resyncs >= 2);
    runtime.shutdown();
}

fn bounded_config() -> PresenceConfig {
    PresenceConfig {
        interval: Duration::from_millis(30),
        timeout: Duration::from_secs(10),
        request_timeout: Duration::from_secs(2),
        snapshot_page: SNAPSHOT_PAGE,
        max_pages: 4,
        max_entries: 20,
    }
}

fn heartbeat_of(id: InstanceId) -> bytes::Bytes {
    let hb = Heartbeat {
        version: PRESENCE_WIRE_VERSION,
        peer: info(id, "127.0.0.1:7009"),
        epoch: 1,
        departing: false,
        stored: 0,
    };
    serde_json::to_vec(&hb).unwrap().into()
}

/// A fake peer `id` (heartbeats by hand) answering every snapshot request with what `page`
/// makes of the request's offset.
async fn fake_peer(
    nats: &str,
    subject: &str,
    id: InstanceId,
    page: impl Fn(usize) -> SnapshotPage + Send + 'static,
) -> CancellationToken {
    let c = crate::transport::nats::connect(nats, "fake", Duration::from_millis(50))
        .await
        .unwrap();
    let mut requests = c.subscribe(snapshot_subject(subject, id)).await.unwrap();
    c.flush().await.unwrap();
    let stop = CancellationToken::new();
    let (s, hb_subject) = (stop.clone(), heartbeat_subject(subject));
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(Duration::from_millis(30));
        loop {
            tokio::select! {
                () = s.cancelled() => return,
                _ = tick.tick() => {
                    let _ = c.publish(hb_subject.clone(), heartbeat_of(id)).await;
                }
                r = requests.next() => {
                    let Some(r) = r else { return };
                    let req: SnapshotRequest = serde_json::from_slice(&r.payload).unwrap();
                    let answer = serde_json::to_vec(&page(req.offset)).unwrap();
                    let _ = c.publish(r.reply.unwrap(), answer.into()).await;
                }
            }
        }
    });
    stop
}

/// Attack: fake peers whose snapshot never ends (a page of one entry, `next` always one further)
/// or holds far more entries than allowed. Each fetch is refused at the cap and counted, nothing
/// of it reaches the index, and a real peer is still synced by the same instance.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn security_endless_or_oversized_snapshots_are_refused_and_counted() {
    let Some(nats) = kvbm_tests::services::nats("security_snapshot_caps") else {
        return;
    };
    let runtime = KvbmRuntime::builder()
        .tokio_handle(tokio::runtime::Handle::current())
        .build()
        .unwrap();
    let rt = runtime.handle();
    let subject = format!("kvbm.test.security_snap.{}", std::process::id());
    let hs = TokenBlockSequence::from_tokens(&(0..400).collect::<Vec<u32>>(), 4, Salt::NONE)
        .unwrap()
        .hashes();
    let (endless, huge) = (InstanceId(0xe1), InstanceId(0xe2));
    let h1 = hs.clone();
    let stop_endless = fake_peer(&nats.url, &subject, endless, move |offset| SnapshotPage {
        version: PRESENCE_WIRE_VERSION,
        instance: endless,
        entries: vec![(h1[offset % h1.len()], TierId::G2)],
        next: Some(offset + 1),
    })
    .await;
    let h2 = hs.clone();
    let stop_huge = fake_peer(&nats.url, &subject, huge, move |_| SnapshotPage {
        version: PRESENCE_WIRE_VERSION,
        instance: huge,
        entries: h2.iter().map(|h| (*h, TierId::G2)).collect(),
        next: None,
    })
    .await;

    let (cb, eb) = connect_observed(&nats.url, "b", Duration::from_millis(50))
        .await
        .unwrap();
    let index_b = Arc::new(CrossInstanceIndex::new());
    let b = Presence::start(
        &rt,
        CancellationToken::new(),
        cb,
        eb,
        &subject,
        bounded_config(),
        info(B, "127.0.0.1:7002"),
        index_b.clone(),
        Arc::new(CrossInstanceIndex::new()),
        Arc::new(PeerDirectory::new()),
    )
    .await
    .unwrap();
    eventually_async("both fetches refused at the caps", || {
        b.stats().snapshots_over_limit >= 2
    })
    .await;
    assert!(!b.is_synced(endless) && !b.is_synced(huge));
    assert_eq!(index_b.count_of(endless), 0);
    assert_eq!(index_b.count_of(huge), 0);

    // B keeps serving its members: a real peer with a snapshot within the caps is synced.
    let own_a = own_index(A, &hs[..10]);
    let (ca, ea) = connect_observed(&nats.url, "a", Duration::from_millis(50))
        .await
        .unwrap();
    let _a = Presence::start(
        &rt,
        CancellationToken::new(),
        ca,
        ea,
        &subject,
        bounded_config(),
        info(A, "127.0.0.1:7001"),
        Arc::new(CrossInstanceIndex::new()),
        own_a.clone(),
        Arc::new(PeerDirectory::new()),
    )
    .await
    .unwrap();
    eventually_async("B synced the real peer", || b.is_synced(A)).await;
    assert_eq!(index_b.entries_of(A), own_a.entries_of(A));
    stop_endless.cancel();
    stop_huge.cancel();
    runtime.shutdown();
}

/// Attack: a snapshot request whose offset overflows `offset + snapshot_page`. It is rejected
/// and counted, and the answering task keeps answering.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn security_hostile_snapshot_offset_is_rejected_and_the_answerer_keeps_serving() {
    let Some(nats) = kvbm_tests::services::nats("security_snapshot_offset") else {
        return;
    };
    let runtime = KvbmRuntime::builder()
        .tokio_handle(tokio::runtime::Handle::current())
        .build()
        .unwrap();
    let rt = runtime.handle();
    let subject = format!("kvbm.test.security_offset.{}", std::process::id());
    let hs = TokenBlockSequence::from_tokens(&(0..20).collect::<Vec<u32>>(), 4, Salt::NONE)
        .unwrap()
        .hashes();
    let own_a = own_index(A, &hs);
    let (ca, ea) = connect_observed(&nats.url, "a", Duration::from_millis(50))
        .await
        .unwrap();
    let a = Presence::start(
        &rt,
        CancellationToken::new(),
        ca,
        ea,
        &subject,
        bounded_config(),
        info(A, "127.0.0.1:7001"),
        Arc::new(CrossInstanceIndex::new()),
        own_a.clone(),
        Arc::new(PeerDirectory::new()),
    )
    .await
    .unwrap();
    let attacker = crate::transport::nats::connect(&nats.url, "x", Duration::from_millis(50))
        .await
        .unwrap();
    let ask = |series: u64, offset: usize| {
        let c = attacker.clone();
        let subject = snapshot_subject(&subject, A);
        async move {
            let req = SnapshotRequest {
                version: PRESENCE_WIRE_VERSION,
                series,
                offset,
            };
            tokio::time::timeout(
                Duration::from_secs(3),
                c.request(subject, serde_json::to_vec(&req).unwrap().into()),
            )
            .await
        }
    };
    // A series with a copy, so the hostile offset reaches the page arithmetic.
    let first = ask(5, 0).await.unwrap().unwrap();
    let first: SnapshotPage = serde_json::from_slice(&first.payload).unwrap();
    assert_eq!(first.entries.len(), 5);
    let rejected = a.stats().rejected;
    assert!(
        ask(5, usize::MAX).await.is_err(),
        "no answer to a hostile offset"
    );
    assert_eq!(a.stats().rejected, rejected + 1);
    // The answerer still serves.
    let again = ask(6, 0)
        .await
        .expect("the answerer still answers")
        .unwrap();
    let again: SnapshotPage = serde_json::from_slice(&again.payload).unwrap();
    assert_eq!(again.entries, own_a.entries_of(A));
    runtime.shutdown();
}

/// Attack: a flood of first-page snapshot requests (each would copy the whole set). At most
/// `SNAPSHOT_COPIES` are answered per request timeout, the rest are dropped and counted; once
/// the window has passed the answerer serves again. (Unsealed: security off; a sealed member
/// gets one: `security_one_requester_cannot_starve_anothers_snapshot`.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn security_a_flood_of_snapshot_requests_is_throttled_and_counted() {
    let Some(nats) = kvbm_tests::services::nats("security_snapshot_flood") else {
        return;
    };
    let runtime = KvbmRuntime::builder()
        .tokio_handle(tokio::runtime::Handle::current())
        .build()
        .unwrap();
    let rt = runtime.handle();
    let subject = format!("kvbm.test.security_flood.{}", std::process::id());
    let hs = TokenBlockSequence::from_tokens(&(0..20).collect::<Vec<u32>>(), 4, Salt::NONE)
        .unwrap()
        .hashes();
    let own_a = own_index(A, &hs);
    let (ca, ea) = connect_observed(&nats.url, "a", Duration::from_millis(50))
        .await
        .unwrap();
    let config = bounded_config();
    let window = config.request_timeout;
    let a = Presence::start(
        &rt,
        CancellationToken::new(),
        ca,
        ea,
        &subject,
        config,
        info(A, "127.0.0.1:7001"),
        Arc::new(CrossInstanceIndex::new()),
        own_a.clone(),
        Arc::new(PeerDirectory::new()),
    )
    .await
    .unwrap();
    let attacker = crate::transport::nats::connect(&nats.url, "x", Duration::from_millis(50))
        .await
        .unwrap();
    let ask = |series: u64| {
        let c = attacker.clone();
        let subject = snapshot_subject(&subject, A);
        async move {
            let req = SnapshotRequest {
                version: PRESENCE_WIRE_VERSION,
                series,
                offset: 0,
            };
            tokio::time::timeout(
                Duration::from_millis(1500),
                c.request(subject, serde_json::to_vec(&req).unwrap().into()),
            )
            .await
            .ok()
            .and_then(Result::ok)
        }
    };
    let flood = 3 * SNAPSHOT_COPIES;
    let answers = futures::future::join_all((0..flood as u64).map(ask)).await;
    let answered = answers.iter().filter(|a| a.is_some()).count();
    assert!(answered >= 1, "the answerer serves within the limit");
    assert!(
        answered <= SNAPSHOT_COPIES,
        "{answered} full copies answered"
    );
    let s = a.stats();
    assert_eq!(s.snapshots_throttled as usize, flood - answered);
    assert_eq!(s.snapshots_served as usize, answered);
    // Past the window, a first page is answered again, whole.
    tokio::time::sleep(window).await;
    let page = ask(1000)
        .await
        .expect("answered once the window has passed");
    let page: SnapshotPage = serde_json::from_slice(&page.payload).unwrap();
    assert_eq!(page.entries, own_a.entries_of(A));
    runtime.shutdown();
}

/// Attack: event batches under instance ids that never sent a heartbeat (each would add index
/// entries forever). They are ignored and counted; a joined peer's events are applied.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn security_events_of_instances_that_never_joined_are_ignored_and_counted() {
    let Some(nats) = kvbm_tests::services::nats("security_unjoined_events") else {
        return;
    };
    let runtime = KvbmRuntime::builder()
        .tokio_handle(tokio::runtime::Handle::current())
        .build()
        .unwrap();
    let rt = runtime.handle();
    let subject = format!("kvbm.test.security_unjoined.{}", std::process::id());
    let hs = TokenBlockSequence::from_tokens(&(0..8).collect::<Vec<u32>>(), 4, Salt::NONE)
        .unwrap()
        .hashes();
    let (cb, eb) = connect_observed(&nats.url, "b", Duration::from_millis(50))
        .await
        .unwrap();
    let index_b = Arc::new(CrossInstanceIndex::new());
    let b = Presence::start(
        &rt,
        CancellationToken::new(),
        cb,
        eb,
        &subject,
        bounded_config(),
        info(B, "127.0.0.1:7002"),
        index_b.clone(),
        Arc::new(CrossInstanceIndex::new()),
        Arc::new(PeerDirectory::new()),
    )
    .await
    .unwrap();
    let (events, rx) = tokio::sync::broadcast::channel(1024);
    b.follow(&rt, CancellationToken::new(), rx).unwrap();
    let stored = |instance: InstanceId| crate::pubsub::EventMessage {
        instance,
        events: vec![BlockEvent {
            kind: BlockEventKind::Stored,
            tier: TierId::G2,
            hash: hs[0],
        }]
        .into(),
    };
    for i in 0..200u64 {
        events.send(stored(InstanceId(0x1000 + i))).unwrap();
    }
    eventually_async("every forged batch ignored", || {
        b.stats().unjoined_event_batches == 200
    })
    .await;
    assert!(
        index_b.is_empty(),
        "nothing of an unjoined instance indexed"
    );

    // A joined peer (a real one, heard by heartbeat) still has its events applied.
    let (ca, ea) = connect_observed(&nats.url, "a", Duration::from_millis(50))
        .await
        .unwrap();
    let _a = Presence::start(
        &rt,
        CancellationToken::new(),
        ca,
        ea,
        &subject,
        bounded_config(),
        info(A, "127.0.0.1:7001"),
        Arc::new(CrossInstanceIndex::new()),
        Arc::new(CrossInstanceIndex::new()),
        Arc::new(PeerDirectory::new()),
    )
    .await
    .unwrap();
    eventually_async("B synced A", || b.is_synced(A)).await;
    events.send(stored(A)).unwrap();
    eventually_async("A's event applied", || {
        index_b.locations(hs[0]) == vec![(A, TierId::G2)]
    })
    .await;
    assert_eq!(b.stats().unjoined_event_batches, 200);
    runtime.shutdown();
}

fn member(root: &crate::security::RootKey, id: InstanceId) -> Arc<Security> {
    let cred = root
        .issue(id, Role::Leader, 0, "ns", Duration::from_secs(3600))
        .unwrap();
    Arc::new(Security::with_credential(
        root.trust_root(),
        Arc::new(cred),
        &crate::security::SecurityConfig::default(),
    ))
}

/// Attack (issue 23, items 2 and 4): B fetches the snapshot of A (played by this test, with
/// A's credential), and before A's real page a client without a credential and a member with
/// another instance's key answer with pages claiming A stores forged blocks (the member's bound
/// to the very request). B drops both (counted) and takes A's page; nothing forged is indexed.
/// And a snapshot request from a non-member is not answered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn security_forged_snapshot_pages_do_not_win_and_non_members_get_none() {
    use crate::transport::nats::reply_context;
    let Some(nats) = kvbm_tests::services::nats("security_forged_pages") else {
        return;
    };
    let runtime = KvbmRuntime::builder()
        .tokio_handle(tokio::runtime::Handle::current())
        .build()
        .unwrap();
    let rt = runtime.handle();
    let subject = format!("kvbm.test.security_pages.{}", std::process::id());
    let config = PresenceConfig {
        interval: Duration::from_millis(30),
        timeout: Duration::from_millis(3000),
        request_timeout: Duration::from_secs(2),
        snapshot_page: 64,
        max_pages: 16,
        max_entries: 1024,
    };
    let root = crate::security::RootKey::generate().unwrap();
    let (sec_a, sec_b, forger) = (
        member(&root, A),
        member(&root, B),
        member(&root, InstanceId(0xc)),
    );
    let hashes = |seed: u32| {
        TokenBlockSequence::from_tokens(
            &(seed * 1000..seed * 1000 + 16).collect::<Vec<u32>>(),
            4,
            Salt::NONE,
        )
        .unwrap()
        .hashes()
    };
    let (real, forged) = (hashes(1), hashes(2));
    let page = |hs: &[SequenceHash]| {
        serde_json::to_vec(&SnapshotPage {
            version: PRESENCE_WIRE_VERSION,
            instance: A,
            entries: hs.iter().map(|h| (*h, TierId::G2)).collect(),
            next: None,
        })
        .unwrap()
    };
    let (true_page, false_page) = (page(&real), page(&forged));

    // "A": answers its snapshot requests, forgers first, itself 100 ms later.
    let ca = crate::transport::nats::connect(&nats.url, "a", Duration::from_millis(50))
        .await
        .unwrap();
    let mut requests = ca.subscribe(snapshot_subject(&subject, A)).await.unwrap();
    ca.flush().await.unwrap();
    let (c, sa, f) = (ca.clone(), sec_a.clone(), forger.clone());
    tokio::spawn(async move {
        while let Some(m) = requests.next().await {
            let reply = m.reply.clone().unwrap();
            let ctx = reply_context("snapshot-reply", &m.payload);
            let _ = c.publish(reply.clone(), false_page.clone().into()).await;
            let _ = c
                .publish(reply.clone(), f.seal(&ctx, &false_page).into())
                .await;
            let _ = c.flush().await;
            tokio::time::sleep(Duration::from_millis(100)).await;
            let _ = c.publish(reply, sa.seal(&ctx, &true_page).into()).await;
            let _ = c.flush().await;
        }
    });
    // "A"'s heartbeats, sealed with its credential.
    let (c, sa, s) = (ca.clone(), sec_a.clone(), subject.clone());
    let beat = tokio::spawn(async move {
        loop {
            let hb = Heartbeat {
                version: PRESENCE_WIRE_VERSION,
                peer: info(A, "127.0.0.1:7001"),
                epoch: 1,
                departing: false,
                stored: 4,
            };
            let json = serde_json::to_vec(&hb).unwrap();
            let _ = c
                .publish(
                    heartbeat_subject(&s),
                    sa.seal(&heartbeat_context(&s), &json).into(),
                )
                .await;
            tokio::time::sleep(Duration::from_millis(30)).await;
        }
    });

    let (cb, eb) = connect_observed(&nats.url, "b", Duration::from_millis(50))
        .await
        .unwrap();
    let index_b = Arc::new(CrossInstanceIndex::new());
    let b = Presence::start_secured(
        &rt,
        CancellationToken::new(),
        cb,
        eb,
        &subject,
        config,
        info(B, "127.0.0.1:7002"),
        index_b.clone(),
        Arc::new(CrossInstanceIndex::new()),
        Arc::new(PeerDirectory::new()),
        sec_b.clone(),
    )
    .await
    .unwrap();
    eventually_async("B synced A", || b.is_synced(A)).await;
    let mut got: Vec<SequenceHash> = index_b.entries_of(A).into_iter().map(|e| e.0).collect();
    got.sort();
    let mut want = real.clone();
    want.sort();
    assert_eq!(got, want, "B holds A's real snapshot");
    assert!(forged.iter().all(|h| index_b.locations(*h).is_empty()));
    let s = sec_b.stats().unwrap();
    assert!(s.rejected(crate::security::Rejection::Malformed) >= 1);
    assert!(s.rejected(crate::security::Rejection::NotAllowed) >= 1);
    assert!(b.stats().unauthenticated >= 2, "{:?}", b.stats());
    assert_eq!(
        b.stats().resync_failed,
        0,
        "the forged pages did not fail the fetch"
    );

    // A non-member asks B for its snapshot: no answer, counted.
    let before = b.stats().unauthenticated;
    let req = SnapshotRequest {
        version: PRESENCE_WIRE_VERSION,
        series: 1,
        offset: 0,
    };
    let answer = tokio::time::timeout(
        Duration::from_millis(300),
        ca.request(
            snapshot_subject(&subject, B),
            serde_json::to_vec(&req).unwrap().into(),
        ),
    )
    .await;
    assert!(answer.is_err(), "a non-member got a snapshot: {answer:?}");
    assert_eq!(b.stats().unauthenticated, before + 1);
    assert_eq!(b.stats().snapshots_served, 0);
    beat.abort();
}

/// Attack (N8 of the second review): a member floods A with first-page snapshot requests,
/// sealed with its own credential, to take every full copy A makes per window. It gets one;
/// another member's request in the same window is answered: one requester cannot starve the
/// others' resync. (With a single limit for all requesters the flood took them all.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn security_one_requester_cannot_starve_anothers_snapshot() {
    let Some(nats) = kvbm_tests::services::nats("security_snapshot_starve") else {
        return;
    };
    let runtime = KvbmRuntime::builder()
        .tokio_handle(tokio::runtime::Handle::current())
        .build()
        .unwrap();
    let rt = runtime.handle();
    let subject = format!("kvbm.test.security_starve.{}", std::process::id());
    let hs = TokenBlockSequence::from_tokens(&(0..20).collect::<Vec<u32>>(), 4, Salt::NONE)
        .unwrap()
        .hashes();
    let root = crate::security::RootKey::generate().unwrap();
    let (sec_a, sec_b, sec_x) = (
        member(&root, A),
        member(&root, B),
        member(&root, InstanceId(0xbad)),
    );
    let (ca, ea) = connect_observed(&nats.url, "a", Duration::from_millis(50))
        .await
        .unwrap();
    let a = Presence::start_secured(
        &rt,
        CancellationToken::new(),
        ca,
        ea,
        &subject,
        PresenceConfig {
            request_timeout: Duration::from_secs(30),
            ..bounded_config()
        },
        info(A, "127.0.0.1:7001"),
        Arc::new(CrossInstanceIndex::new()),
        own_index(A, &hs),
        Arc::new(PeerDirectory::new()),
        sec_a,
    )
    .await
    .unwrap();
    let client = crate::transport::nats::connect(&nats.url, "x", Duration::from_millis(50))
        .await
        .unwrap();
    let ctx = snapshot_context(&snapshot_subject(&subject, A));
    let ask = |who: Arc<Security>, series: u64| {
        let (c, subject, ctx) = (client.clone(), snapshot_subject(&subject, A), ctx.clone());
        async move {
            let req = serde_json::to_vec(&SnapshotRequest {
                version: PRESENCE_WIRE_VERSION,
                series,
                offset: 0,
            })
            .unwrap();
            tokio::time::timeout(
                Duration::from_millis(1500),
                c.request(subject, who.seal(&ctx, &req).into()),
            )
            .await
            .ok()
            .and_then(Result::ok)
        }
    };
    let flood = 3 * SNAPSHOT_COPIES;
    let answers = futures::future::join_all((0..flood as u64).map(|i| ask(sec_x.clone(), i))).await;
    let answered = answers.iter().filter(|a| a.is_some()).count();
    assert_eq!(
        answered, 1,
        "the flooding member gets one full copy per window"
    );
    assert_eq!(a.stats().snapshots_throttled as usize, flood - 1);
    // Within the same window, another member is answered.
    assert!(
        ask(sec_b, 1_000).await.is_some(),
        "another member's resync is not starved"
    );
    assert_eq!(a.stats().snapshots_served, 2);
    runtime.shutdown();
}

/// Attack (N5 of the second review): a member announces far more blocks than anyone should
/// keep for it. B's index keeps at most its cap of that member's locations (the rest dropped
/// and counted), settles there (no resync storm: a peer held at the cap is not drift), and
/// another member's locations are still all indexed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn security_a_peers_share_of_the_index_is_capped() {
    let Some(nats) = kvbm_tests::services::nats("security_index_cap") else {
        return;
    };
    let runtime = KvbmRuntime::builder()
        .tokio_handle(tokio::runtime::Handle::current())
        .build()
        .unwrap();
    let rt = runtime.handle();
    let subject = format!("kvbm.test.security_index_cap.{}", std::process::id());
    let hashes = |seed: u32, n: u32| {
        TokenBlockSequence::from_tokens(
            &(seed * 10_000..seed * 10_000 + 4 * n).collect::<Vec<u32>>(),
            4,
            Salt::NONE,
        )
        .unwrap()
        .hashes()
    };
    const CAP: usize = 16;
    let config = PresenceConfig {
        max_pages: 64,
        max_entries: 1000,
        ..bounded_config()
    };
    let peer = |id: InstanceId, addr: &'static str, own: Arc<CrossInstanceIndex>| {
        let (nats, rt, subject, config) = (nats.url.clone(), rt.clone(), subject.clone(), config);
        async move {
            let (c, e) = connect_observed(&nats, "peer", Duration::from_millis(50))
                .await
                .unwrap();
            Presence::start(
                &rt,
                CancellationToken::new(),
                c,
                e,
                &subject,
                config,
                info(id, addr),
                Arc::new(CrossInstanceIndex::new()),
                own,
                Arc::new(PeerDirectory::new()),
            )
            .await
            .unwrap()
        }
    };
    // A claims 200 blocks; C, 5.
    let _a = peer(A, "127.0.0.1:7001", own_index(A, &hashes(1, 200))).await;
    let c_id = InstanceId(0xc);
    let _c = peer(c_id, "127.0.0.1:7003", own_index(c_id, &hashes(2, 5))).await;
    let index_b = Arc::new(CrossInstanceIndex::with_cap(CAP));
    let (cb, eb) = connect_observed(&nats.url, "b", Duration::from_millis(50))
        .await
        .unwrap();
    let b = Presence::start(
        &rt,
        CancellationToken::new(),
        cb,
        eb,
        &subject,
        config,
        info(B, "127.0.0.1:7002"),
        index_b.clone(),
        Arc::new(CrossInstanceIndex::new()),
        Arc::new(PeerDirectory::new()),
    )
    .await
    .unwrap();
    eventually_async("B synced A and C", || b.is_synced(A) && b.is_synced(c_id)).await;
    assert_eq!(index_b.count_of(A), CAP, "A's share held at the cap");
    assert_eq!(index_b.count_of(c_id), 5, "C's locations all indexed");
    assert_eq!(index_b.over_cap(), 200 - CAP as u64);
    // Many heartbeats later: still synced once each, no drift (A stays past the cap).
    tokio::time::sleep(config.interval * 20).await;
    assert_eq!(b.stats().drift_detected, 0, "{:?}", b.stats());
    assert_eq!(b.stats().resyncs, 2, "{:?}", b.stats());
    assert_eq!(index_b.count_of(A), CAP);
    runtime.shutdown();
}
