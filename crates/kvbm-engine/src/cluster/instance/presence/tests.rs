//! The presence protocol over a real `nats-server`, without instances around it: a snapshot
//! answered in several pages restores everything a peer stores, the peer's data-plane address
//! reaches the directory, garbage on the heartbeat subject is skipped and counted, and a peer
//! that falls silent (no departure message) expires from the index and the directory.

use std::time::Instant;

use kvbm_logical::{BlockEvent, BlockEventKind, Salt, TokenBlockSequence};

use super::*;
use crate::address::WorkerAddress;
use crate::cluster::transport::nats::connect_observed;
use crate::runtime::KvbmRuntime;

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

async fn eventually(what: &str, mut f: impl FnMut() -> bool) {
    let start = Instant::now();
    while start.elapsed() < Duration::from_secs(15) {
        if f() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(f(), "timed out waiting for: {what}");
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
    };
    let hashes = TokenBlockSequence::from_tokens(&(0..40).collect::<Vec<u32>>(), 4, Salt::NONE)
        .unwrap()
        .hashes();
    let own_a = Arc::new(CrossInstanceIndex::new());
    let events: Vec<BlockEvent> = hashes
        .iter()
        .map(|h| BlockEvent {
            kind: BlockEventKind::Stored,
            tier: TierId::G2,
            hash: *h,
        })
        .collect();
    own_a.apply_events(A, &events);
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

    eventually("B synced A", || b.is_synced(A)).await;
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
    own_a.apply_events(A, &events[..2]);

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
    eventually("B rejected both", || b.stats().rejected == 2).await;
    assert_eq!(b.live_peers(), vec![A]);

    // A falls silent without a departure message: B expires it after the timeout.
    stop_a.cancel();
    eventually("B expires A", || {
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
    let ca = crate::cluster::transport::nats::connect(&nats.url, "a", Duration::from_millis(50))
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
        .send(crate::cluster::pubsub::EventMessage {
            instance: A,
            events: vec![BlockEvent {
                kind: BlockEventKind::Stored,
                tier: TierId::G2,
                hash: x,
            }]
            .into(),
        })
        .unwrap();
    eventually("B applied the event", || {
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
    eventually("B synced A", || b.is_synced(A)).await;
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
    };
    let hashes = TokenBlockSequence::from_tokens(&(0..48).collect::<Vec<u32>>(), 4, Salt::NONE)
        .unwrap()
        .hashes();
    let stored = |hs: &[SequenceHash], kind| -> Vec<BlockEvent> {
        hs.iter()
            .map(|h| BlockEvent {
                kind,
                tier: TierId::G2,
                hash: *h,
            })
            .collect()
    };
    let own_a = Arc::new(CrossInstanceIndex::new());
    own_a.apply_events(A, &stored(&hashes[..10], BlockEventKind::Stored));
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
    eventually("B synced A", || b.is_synced(A)).await;
    assert_eq!(index_b.count_of(A), 10);
    assert_eq!(b.stats().drift_detected, 0);

    // Lost Stored events: A stores 2 blocks B never hears of; B's index also lost 3 of the
    // blocks it knew (as if their events never came). No reconnect, no new epoch.
    own_a.apply_events(A, &stored(&hashes[10..12], BlockEventKind::Stored));
    index_b.apply_events(A, &stored(&hashes[..3], BlockEventKind::Removed));
    eventually("B repaired its index", || {
        index_b.entries_of(A) == own_a.entries_of(A)
    })
    .await;
    assert!(b.stats().drift_detected >= 1);
    assert!(b.stats().resyncs >= 2);
    runtime.shutdown();
}
