//! Block events over a real `nats-server` (feature `nats`): two instances, each with its own
//! client and bus, learn of each other's stored and removed blocks and a leader's
//! `find_matches` reports the remote run; and with a server this test starts and stops itself
//! on a fixed port, sending never blocks while the server is away (what does not fit is
//! dropped and counted), and after the restart the clients reconnect and new events reach the
//! index again.

use std::net::TcpListener;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvbm_cluster::pubsub::nats::NatsBus;
use kvbm_cluster::pubsub::{EventBus, EventMessage, EventPublisher, IndexEvents};
use kvbm_cluster::transport::nats::connect;
use kvbm_engine::InstanceId;
use kvbm_engine::cross_instance::CrossInstanceIndex;
use kvbm_engine::{InstanceLeader, KvbmRuntime, RuntimeHandle};
use kvbm_logical::{
    BlockEvent, BlockEventKind, BlockManager, G2, Salt, TierId, TokenBlockSequence,
};
use kvbm_tests::wait::eventually;

fn runtime() -> KvbmRuntime {
    KvbmRuntime::builder()
        .set("events.idle_tick_ms", 1)
        .set("logical.block_size", 4)
        .set("logical.events.max_delay_ms", 1)
        .set("tiers.g2_blocks", 8)
        .build()
        .unwrap()
}

fn bus(rt: &RuntimeHandle, url: &str, name: &str, subject: &str, cap: usize) -> Arc<NatsBus> {
    rt.tokio().block_on(async {
        let client = connect(url, name, Duration::from_millis(50)).await.unwrap();
        NatsBus::start(rt, client, subject, cap).await.unwrap()
    })
}

fn store(m: &BlockManager<G2>, seq: &TokenBlockSequence, n: usize) {
    let complete = m
        .allocate_blocks(n)
        .unwrap()
        .into_iter()
        .zip(seq.blocks())
        .map(|(b, tb)| b.complete_token_block(tb).unwrap())
        .collect();
    drop(m.register_blocks(complete));
}

fn subject(test: &str) -> String {
    format!("kvbm.test.{test}.{}", std::process::id())
}

#[test]
fn two_instances_learn_of_each_others_blocks_over_nats() {
    let Some(nats) =
        kvbm_tests::services::nats("two_instances_learn_of_each_others_blocks_over_nats")
    else {
        return;
    };
    let subject = subject("events");
    let (rt_a, rt_b) = (runtime(), runtime());
    let (ha, hb) = (rt_a.handle(), rt_b.handle());
    let (a, b) = (InstanceId(0xa), InstanceId(0xb));

    // A publishes its tiers' events; B follows the subject into its index.
    let bus_a = bus(&ha, &nats.url, "a", &subject, 64);
    let publisher = EventPublisher::spawn(&ha, a, bus_a.clone()).unwrap();
    let leader_a = InstanceLeader::from_runtime_with_sink(&ha, Some(publisher.clone())).unwrap();
    let bus_b = bus(&hb, &nats.url, "b", &subject, 64);
    let index = Arc::new(CrossInstanceIndex::new());
    CrossInstanceIndex::follow(index.clone(), &hb, bus_b.as_ref()).unwrap();
    let leader_b = InstanceLeader::builder()
        .g2(own_g2(&hb))
        .remote_index(index.clone(), b)
        .build()
        .unwrap();

    let seq =
        TokenBlockSequence::from_tokens(&(0..24).collect::<Vec<u32>>(), 4, Salt::NONE).unwrap();
    let hashes = seq.hashes();
    store(leader_a.g2().unwrap(), &seq, 5);
    eventually("B's index holds A's 5 blocks", || {
        index.prefix_by_instance(&hashes, Some(b)) == vec![(a, 5)]
    });
    assert_eq!(index.locations(hashes[0]), vec![(a, TierId::G2)]);
    let found = leader_b.find_matches(&hashes);
    assert!(found.runs().is_empty(), "B holds nothing itself");
    let remote = found.remote().expect("a remote run");
    assert_eq!((remote.instance, remote.start), (a, 0));
    assert_eq!(remote.hashes, hashes[..5].to_vec());

    // B stores the first two itself: the local prefix comes first, the remote run after it.
    store(leader_b.g2().unwrap(), &seq, 2);
    let found = leader_b.find_matches(&hashes);
    assert_eq!(found.len() - found.remote_len(), 2);
    let remote = found.remote().unwrap();
    assert_eq!((remote.instance, remote.start), (a, 2));
    assert_eq!(remote.hashes, hashes[2..5].to_vec());
    drop(found);

    // A evicts: its Removed events take it out of B's index.
    assert_eq!(leader_a.g2().unwrap().reset_inactive_pool(), 5);
    eventually("A's blocks leave B's index", || {
        index.prefix_by_instance(&hashes, Some(b)).is_empty()
    });
    assert!(leader_b.find_matches(&hashes).remote().is_none());
    assert_eq!(publisher.dropped_batches(), 0);
    assert_eq!(bus_a.dropped(), 0);
    assert_eq!(bus_b.rejected(), 0);
    assert!(bus_a.sent() >= 2, "stored and removed batches were sent");
    rt_a.shutdown();
    rt_b.shutdown();
}

/// A G2 manager of 8 blocks of 4 tokens on its own registry (instance B's own tier).
fn own_g2(_rt: &RuntimeHandle) -> Arc<BlockManager<G2>> {
    Arc::new(
        BlockManager::<G2>::builder()
            .block_count(8)
            .block_size(4)
            .build()
            .unwrap(),
    )
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
        eventually("nats-server accepts connections", || {
            std::net::TcpStream::connect(("127.0.0.1", self.port)).is_ok()
        });
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

fn stored(hash: kvbm_logical::SequenceHash) -> BlockEvent {
    BlockEvent {
        kind: BlockEventKind::Stored,
        tier: TierId::G2,
        hash,
    }
}

#[test]
fn sending_never_blocks_while_the_server_is_away_and_events_flow_after_it_returns() {
    if kvbm_tests::services::nats("sending_never_blocks_while_the_server_is_away").is_none() {
        return;
    }
    let port = {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let mut server = OwnServer::start(port);
    let rt = runtime();
    let h = rt.handle();
    let subject = "kvbm.test.reconnect";
    let bus_a = bus(&h, &server.url(), "a", subject, 16);
    let bus_b = bus(&h, &server.url(), "b", subject, 16);
    let index = Arc::new(CrossInstanceIndex::new());
    CrossInstanceIndex::follow(index.clone(), &h, bus_b.as_ref()).unwrap();
    let (a, b) = (InstanceId(1), InstanceId(2));
    let seq = TokenBlockSequence::from_tokens(&(0..4200 * 4).collect::<Vec<u32>>(), 4, Salt::NONE)
        .unwrap();
    let hashes = seq.hashes();
    let send = |i: usize| {
        bus_a.send(EventMessage {
            instance: a,
            events: vec![stored(hashes[i])].into(),
        })
    };

    // Resend until the first event arrives (robust to any start-up ordering).
    eventually("the first event arrives", || {
        send(0);
        std::thread::sleep(Duration::from_millis(20));
        index.locations(hashes[0]) == vec![(a, TierId::G2)]
    });

    // Server gone: thousands of sends return at once; what the client and the outbox cannot
    // buffer is dropped and counted.
    server.stop();
    std::thread::sleep(Duration::from_millis(100));
    for i in 1..1000 {
        send(i);
    }
    let started = Instant::now();
    for i in 1000..4000 {
        send(i);
    }
    let elapsed = started.elapsed();
    eventually("the outbox fills and drops", || bus_a.dropped() > 0);
    assert!(
        elapsed < Duration::from_secs(5),
        "3000 sends took {elapsed:?}: sending must not wait for the server"
    );

    // Server back on the same port: both clients reconnect and re-subscribe on their own.
    server.restart();
    // The index is a hint: new events must flow again. Keep sending fresh ones until one
    // arrives (the clients reconnect with a short backoff).
    let mut next = 4000;
    eventually("events flow again after the restart", || {
        if next < hashes.len() {
            send(next);
            next += 1;
        }
        std::thread::sleep(Duration::from_millis(20));
        (4000..next).any(|i| index.locations(hashes[i]) == vec![(a, TierId::G2)])
    });
    assert!(bus_b.received() >= 2);
    assert_eq!(bus_b.rejected(), 0);
    assert!(index.prefix_by_instance(&hashes[..1], Some(b)) == vec![(a, 1)]);
    rt.shutdown();
}
