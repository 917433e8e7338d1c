//! Tests of the data plane over loopback TCP: verified pulls, refused frames (corrupt payload,
//! wrong identity, wrong binding, hostile length, truncated stream) registering nothing,
//! refused requests, and holds released when a client dies. The `security_*` tests attack the
//! bounds: connections over the cap, a slow reader past the response deadline, a trickling
//! server past the pull deadline, and a client pool filled from many addresses.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use kvbm_logical::{BlockManager, BlockRegistry, G2, Salt, SequenceHash, TokenBlockSequence};
use kvbm_offload::{BlockFailureKind, MoveOutcome};
use kvbm_physical::checksum::BlockHeader;
use kvbm_physical::identity::geometry_digest;
use kvbm_physical::{BlockLayout, PhysicalLayout, PinPolicy};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

use super::handshake;
use super::wire::{
    self, FRAME_HEADER_LEN, REQUEST_HEAD_LEN, RESPONSE_HEAD_LEN, RequestHead, Status,
};
use super::*;
use kvbm_engine::cross_instance::RemotePull;

const N: usize = 8;
const A: InstanceId = InstanceId(0xa);

fn geometry() -> BlockLayout {
    kvbm_physical::testing::geometry(N, 2, 64)
}

fn hashes(n: usize) -> Vec<SequenceHash> {
    let tokens: Vec<u32> = (0..(n as u32 * 4)).collect();
    TokenBlockSequence::from_tokens(&tokens, 4, Salt::NONE)
        .unwrap()
        .hashes()
}

struct Side {
    manager: Arc<BlockManager<G2>>,
    layout: Arc<PhysicalLayout>,
}

fn side() -> Side {
    Side {
        manager: Arc::new(
            BlockManager::<G2>::builder()
                .block_count(N)
                .block_size(4)
                .registry(BlockRegistry::new())
                .build()
                .unwrap(),
        ),
        layout: Arc::new(PhysicalLayout::allocate_host(geometry(), PinPolicy::Unpinned).unwrap()),
    }
}

/// A serving side holding `hashes` in G2, each block filled with its own pattern.
fn serving(hashes: &[SequenceHash]) -> Side {
    let s = side();
    let blocks = s.manager.allocate_blocks(hashes.len()).unwrap();
    for (b, h) in blocks.iter().zip(hashes) {
        for (p, l) in s.layout.block_addrs(b.block_id(), 0..2) {
            // SAFETY: as in `bytes`; the block is ours (mutable).
            let m = unsafe { std::slice::from_raw_parts_mut(p as *mut u8, l) };
            for (k, x) in m.iter_mut().enumerate() {
                *x = (k as u8).wrapping_mul(7) ^ (h.as_u128() as u8);
            }
        }
    }
    let complete = blocks
        .into_iter()
        .zip(hashes)
        .map(|(b, h)| b.complete(*h).unwrap())
        .collect();
    drop(s.manager.register_blocks(complete));
    s
}

fn expected(s: &Side, h: SequenceHash) -> Vec<u8> {
    let b = s.manager.match_blocks(&[h]);
    bytes(&s.layout, b[0].block_id())
}

fn client(s: &Side) -> DataPlaneClient {
    let config = DataPlaneConfig {
        io_timeout: Duration::from_secs(2),
        ..DataPlaneConfig::default()
    };
    DataPlaneClient::new(
        config,
        s.manager.clone(),
        s.layout.clone(),
        Arc::new(PeerDirectory::new()),
    )
    .unwrap()
}

async fn server(s: &Side) -> DataPlaneServer {
    DataPlaneServer::start(
        DataPlaneConfig::default(),
        A,
        s.manager.clone(),
        s.layout.clone(),
    )
    .await
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pull_verifies_bytes_registers_and_releases_holds() {
    let hs = hashes(6);
    let remote = serving(&hs);
    let srv = server(&remote).await;
    let local = side();
    let c = client(&local);
    c.peers().insert(A, srv.local_addr());

    // Blocks 0..5 held remotely; ask for 0..4 and one hash it does not have.
    let missing = hashes(7)[6];
    let ask = [hs[0], hs[1], hs[2], hs[3], missing];
    let dests = local.manager.allocate_blocks(ask.len()).unwrap();
    let out = c.pull(A, &ask, dests).await;
    for (i, o) in out[..4].iter().enumerate() {
        let b = o.as_ref().unwrap();
        assert_eq!(b.sequence_hash(), ask[i]);
        assert_eq!(
            bytes(&local.layout, b.block_id()),
            expected(&remote, ask[i])
        );
    }
    let err = out[4].as_ref().unwrap_err();
    assert!(err.message.contains("not held"), "{err}");
    assert_eq!(err.kind, BlockFailureKind::NotFound, "{err}");
    assert_eq!(local.manager.match_blocks(&ask).len(), 4);
    assert!(local.manager.match_blocks(&[missing]).is_empty());
    drop(out);
    eventually_async("holds released", || srv.stats().held() == 0).await;
    assert_eq!(srv.stats().blocks_served(), 4);

    // The connection was pooled and is reused for a second pull.
    let dests = local.manager.allocate_blocks(1).unwrap();
    let out = c.pull(A, &hs[4..5], dests).await;
    assert!(out[0].is_ok(), "{:?}", out[0].as_ref().err());
    assert_eq!(srv.stats().connections(), 1);
    assert!(local.manager.check_invariants().is_ok());
}

/// The server memoises a block's checksum per registration: after the slot is evicted and
/// registered again (same hash, other bytes), the next pull is served with the new bytes'
/// checksum, not the remembered one, and verifies.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_registration_served_again_after_reuse_is_checksummed_afresh() {
    let hs = hashes(1);
    let remote = serving(&hs);
    let srv = server(&remote).await;
    let slot = remote.manager.match_blocks(&hs)[0].block_id();
    let addr = srv.local_addr();
    let pull = |local: Side| {
        let c = client(&local);
        c.peers().insert(A, addr);
        let hs = hs.clone();
        async move {
            let dests = local.manager.allocate_blocks(1).unwrap();
            let out = c.pull(A, &hs, dests).await;
            let b = out[0].as_ref().expect("pulled and verified");
            bytes(&local.layout, b.block_id())
        }
    };
    assert_eq!(pull(side()).await, expected(&remote, hs[0]));
    assert_eq!(
        pull(side()).await,
        expected(&remote, hs[0]),
        "served from the memo"
    );

    // Evict, then register the same hash in the same slot with other bytes.
    remote.manager.reset_inactive_pool();
    let all = remote.manager.allocate_blocks(N).unwrap();
    let mut again = None;
    for b in all {
        if b.block_id() == slot {
            for (p, l) in remote.layout.block_addrs(slot, 0..2) {
                // SAFETY: as in `serving`; the block is ours (mutable).
                unsafe { std::slice::from_raw_parts_mut(p as *mut u8, l) }.fill(0xa5);
            }
            again = Some(b.complete(hs[0]).unwrap());
        }
    }
    let again = remote
        .manager
        .register_blocks(vec![again.expect("the slot")]);
    assert_eq!(again[0].block_id(), slot);
    drop(again);
    let fresh = pull(side()).await;
    assert!(fresh.iter().all(|&x| x == 0xa5), "the new bytes, verified");
    assert_eq!(srv.stats().blocks_served(), 3);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wrong_instance_and_unknown_peer_are_refused() {
    let hs = hashes(2);
    let remote = serving(&hs);
    let srv = server(&remote).await;
    let local = side();
    let c = client(&local);
    // The server is A; asking it as B fails the binding check: nothing registered.
    let dests = local.manager.allocate_blocks(2).unwrap();
    let out = c
        .pull_from(srv.local_addr(), InstanceId(0xb), &hs, dests)
        .await;
    for o in &out {
        let e = o.as_ref().unwrap_err();
        assert!(e.message.contains("serving instance"), "{e}");
    }
    drop(out);
    assert!(local.manager.match_blocks(&hs).is_empty());
    assert_eq!(local.manager.available_blocks(), N);
    let dests = local.manager.allocate_blocks(1).unwrap();
    let out = c.pull(InstanceId(0xc), &hs[..1], dests).await;
    assert!(
        out[0]
            .as_ref()
            .unwrap_err()
            .message
            .contains("no data plane address")
    );
}

/// A one-connection server that reads a request and answers with what `answer` writes.
async fn hostile<F>(answer: F) -> SocketAddr
where
    F: FnOnce(Vec<SequenceHash>) -> Vec<u8> + Send + 'static,
{
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    tokio::spawn(async move {
        let (mut s, _) = l.accept().await.unwrap();
        let mut head = [0u8; REQUEST_HEAD_LEN];
        s.read_exact(&mut head).await.unwrap();
        let h = wire::decode_request(&head).unwrap();
        let mut raw = vec![0u8; h.count as usize * 16];
        s.read_exact(&mut raw).await.unwrap();
        let reply = answer(wire::decode_hashes(&raw));
        let _ = s.write_all(&reply).await;
        let _ = s.shutdown().await;
    });
    addr
}

fn block_bytes() -> usize {
    geometry().config().block_bytes()
}

/// A correct frame for `hash` from `A` with `payload`.
fn frame(hash: SequenceHash, payload: &[u8]) -> Vec<u8> {
    let g = geometry_digest(geometry().config());
    let header = wire::frame_header(hash, A, g, payload);
    let mut out = header.to_vec();
    out.extend_from_slice(payload);
    out
}

async fn pull_hostile<F>(answer: F) -> (Vec<MoveOutcome<G2>>, Side, Vec<SequenceHash>)
where
    F: FnOnce(Vec<SequenceHash>) -> Vec<u8> + Send + 'static,
{
    let addr = hostile(answer).await;
    let local = side();
    let c = client(&local);
    let hs = hashes(2);
    let dests = local.manager.allocate_blocks(2).unwrap();
    let out = c.pull_from(addr, A, &hs, dests).await;
    (out, local, hs)
}

fn assert_refused(out: Vec<MoveOutcome<G2>>, local: &Side, hs: &[SequenceHash], needle: &str) {
    for o in &out[1..] {
        let e = o.as_ref().unwrap_err();
        assert!(e.message.contains(needle), "{e} (wanted {needle})");
    }
    drop(out);
    assert!(local.manager.match_blocks(&hs[1..]).is_empty());
    assert!(local.manager.available_blocks() >= N - 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn corrupt_payload_is_refused() {
    let (out, local, hs) = pull_hostile(|h| {
        let mut r = wire::encode_response(Status::Ok, 2).to_vec();
        r.extend(frame(h[0], &vec![1u8; block_bytes()]));
        let mut f = frame(h[1], &vec![2u8; block_bytes()]);
        let last = f.len() - 1;
        f[last] ^= 0xff; // payload no longer matches its checksum
        r.extend(f);
        r
    })
    .await;
    // The first frame was fine and registers; the corrupt one does not.
    assert!(out[0].is_ok());
    assert_refused(out, &local, &hs, "checksum");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wrong_identity_is_refused() {
    let (out, local, hs) = pull_hostile(|h| {
        let mut r = wire::encode_response(Status::Ok, 2).to_vec();
        r.extend(frame(h[0], &vec![1u8; block_bytes()]));
        // A valid frame of another block where h[1] was asked for.
        r.extend(frame(h[0], &vec![1u8; block_bytes()]));
        r
    })
    .await;
    assert!(out[0].is_ok());
    assert_refused(out, &local, &hs, "block identity");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_length_is_refused_before_reading() {
    let (out, local, hs) = pull_hostile(|h| {
        let mut r = wire::encode_response(Status::Ok, 2).to_vec();
        r.extend(frame(h[0], &vec![1u8; block_bytes()]));
        let g = geometry_digest(geometry().config());
        let header = BlockHeader {
            len: u64::MAX,
            slot: g,
            checksum: 0,
            identity: kvbm_offload::block_identity(h[1]),
            binding: binding(A),
        };
        r.extend(header.to_bytes());
        r
    })
    .await;
    assert!(out[0].is_ok());
    assert_refused(out, &local, &hs, "header says len");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn truncated_stream_is_refused() {
    let (out, local, hs) = pull_hostile(|h| {
        let mut r = wire::encode_response(Status::Ok, 2).to_vec();
        r.extend(frame(h[0], &vec![1u8; block_bytes()]));
        let f = frame(h[1], &vec![2u8; block_bytes()]);
        r.extend(&f[..f.len() / 2]);
        r
    })
    .await;
    assert!(out[0].is_ok());
    assert_refused(out, &local, &hs, "truncated");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn garbage_response_fails_every_block() {
    let (out, local, hs) = pull_hostile(|_| vec![0x55; 200]).await;
    assert!(out[0].is_err());
    assert_refused(out, &local, &hs, "bad response magic");
}

async fn raw_request(addr: SocketAddr, head: RequestHead, hashes: &[SequenceHash]) -> TcpStream {
    let mut s = TcpStream::connect(addr).await.unwrap();
    s.write_all(&wire::encode_request(head, hashes))
        .await
        .unwrap();
    s
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn server_refuses_bad_requests_and_survives_dead_clients() {
    let hs = hashes(N);
    let remote = serving(&hs);
    let srv = server(&remote).await;
    let addr = srv.local_addr();
    let c = geometry();
    let good = RequestHead {
        count: N as u32,
        geometry: geometry_digest(c.config()),
        block_bytes: c.config().block_bytes() as u64,
    };

    // A hostile count is refused before the hash list is read (nothing was sent after it).
    let mut s = raw_request(
        addr,
        RequestHead {
            count: u32::MAX,
            ..good
        },
        &[],
    )
    .await;
    let mut head = [0u8; RESPONSE_HEAD_LEN];
    s.read_exact(&mut head).await.unwrap();
    assert_eq!(
        wire::decode_response(&head).unwrap().0,
        Status::TooMany as u32
    );
    // A geometry the server does not have.
    let mut s = raw_request(
        addr,
        RequestHead {
            geometry: good.geometry ^ 1,
            ..good
        },
        &hs,
    )
    .await;
    s.read_exact(&mut head).await.unwrap();
    assert_eq!(
        wire::decode_response(&head).unwrap().0,
        Status::Geometry as u32
    );
    assert_eq!(srv.stats().refused(), 2);

    // A client that asks for everything, reads the head and one byte, and dies: the server
    // was holding all N blocks for it and must release them.
    let mut s = raw_request(addr, good, &hs).await;
    s.read_exact(&mut head).await.unwrap();
    let mut one = [0u8; 1];
    s.read_exact(&mut one).await.unwrap();
    drop(s);
    eventually_async("holds released after the client died", || {
        srv.stats().held() == 0
    })
    .await;
    eventually_async("connections closed", || srv.stats().connections() == 0).await;

    // ... and it keeps serving.
    let local = side();
    let cl = client(&local);
    let dests = local.manager.allocate_blocks(N).unwrap();
    let out = cl.pull_from(addr, A, &hs, dests).await;
    for (i, o) in out.iter().enumerate() {
        let b = o.as_ref().unwrap();
        assert_eq!(bytes(&local.layout, b.block_id()), expected(&remote, hs[i]));
    }
    srv.shutdown();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pulls_larger_than_one_request_are_split() {
    let hs = hashes(N);
    let remote = serving(&hs);
    let srv = server(&remote).await;
    let local = side();
    let c = DataPlaneClient::new(
        DataPlaneConfig {
            max_blocks_per_request: 3,
            ..DataPlaneConfig::default()
        },
        local.manager.clone(),
        local.layout.clone(),
        Arc::new(PeerDirectory::new()),
    )
    .unwrap();
    let dests = local.manager.allocate_blocks(N).unwrap();
    let out = c.pull_from(srv.local_addr(), A, &hs, dests).await;
    assert!(out.iter().all(Result::is_ok));
    assert_eq!(srv.stats().requests(), 3);
}

#[test]
fn config_from_transport() {
    let t = kvbm_engine::config::TransportConfig {
        data_plane_bind: "127.0.0.1:7000".into(),
        request_timeout_ms: 250,
        ..Default::default()
    };
    let c = DataPlaneConfig::from_transport(&t).unwrap();
    assert_eq!(c.bind.port(), 7000);
    assert_eq!(c.io_timeout, Duration::from_millis(250));
    // The bounds come from `[transport]`, and the defaults agree with it.
    let d = DataPlaneConfig::default();
    assert_eq!(
        (c.max_connections, c.max_idle_peers),
        (t.max_connections, t.max_idle_peers)
    );
    assert_eq!(
        c.response_deadline,
        Duration::from_millis(t.response_deadline_ms)
    );
    assert_eq!(c.pull_deadline, Duration::from_millis(t.pull_deadline_ms));
    assert_eq!(c.idle_expiry, Duration::from_millis(t.idle_expiry_ms));
    assert_eq!(
        (
            d.max_connections,
            d.response_deadline,
            d.pull_deadline,
            d.max_idle_peers,
            d.idle_expiry
        ),
        (
            c.max_connections,
            c.response_deadline,
            c.pull_deadline,
            c.max_idle_peers,
            c.idle_expiry
        )
    );
    let bad = kvbm_engine::config::TransportConfig {
        data_plane_bind: "nowhere".into(),
        ..Default::default()
    };
    let e = DataPlaneConfig::from_transport(&bad).unwrap_err();
    assert_eq!(e.config_key(), Some("transport.data_plane_bind"));
}

/// A destination from another G2 manager (its slot ids name another layout) is refused before
/// a byte is written: `pull_from` is safe to call with any blocks.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn destinations_of_another_manager_are_refused_before_any_write() {
    let hs = hashes(2);
    let remote = serving(&hs);
    let srv = server(&remote).await;
    let local = side();
    let c = client(&local);
    c.peers().insert(A, srv.local_addr());
    let stranger = side();
    let mut dests = local.manager.allocate_blocks(1).unwrap();
    dests.extend(stranger.manager.allocate_blocks(1).unwrap());
    let before = bytes(&local.layout, 0);
    let out = c.pull(A, &hs, dests).await;
    assert_eq!(out.len(), 2);
    for o in &out {
        let e = o.as_ref().unwrap_err();
        assert_eq!(e.kind, BlockFailureKind::Refused, "{e}");
        assert!(
            e.message
                .contains("not a block of this client's G2 manager"),
            "{e}"
        );
    }
    assert_eq!(
        srv.stats().blocks_served(),
        0,
        "nothing was asked of the server"
    );
    assert_eq!(bytes(&local.layout, 0), before, "nothing was written");
    assert!(local.manager.match_blocks(&hs).is_empty());
}

/// A pull of every hash of `hs` from `srv` into a fresh side: all must arrive.
async fn assert_serves(srv: &DataPlaneServer, hs: &[SequenceHash]) {
    let local = side();
    let c = client(&local);
    let dests = local.manager.allocate_blocks(hs.len()).unwrap();
    let out = c.pull_from(srv.local_addr(), A, hs, dests).await;
    assert!(out.iter().all(Result::is_ok), "{out:?}");
}

/// Two idle connections to `srv`, once it serves both.
async fn hold_two(srv: &DataPlaneServer) -> (TcpStream, TcpStream) {
    let idle1 = TcpStream::connect(srv.local_addr()).await.unwrap();
    let idle2 = TcpStream::connect(srv.local_addr()).await.unwrap();
    eventually_async("two connections served", || srv.stats().connections() == 2).await;
    (idle1, idle2)
}

/// Opens one more connection to `srv` and asserts the server closes it at once.
async fn assert_closed_at_once(srv: &DataPlaneServer, what: &str) {
    let mut extra = TcpStream::connect(srv.local_addr()).await.unwrap();
    let mut buf = [0u8; 1];
    let r = tokio::time::timeout(Duration::from_secs(3), extra.read(&mut buf))
        .await
        .unwrap_or_else(|_| panic!("{what}"));
    assert!(matches!(r, Ok(0) | Err(_)), "{r:?}");
}

/// Attack: more connections than the cap, held idle. The one over the cap is closed at once
/// and counted; members are still served once a slot frees.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn security_connections_over_the_cap_are_refused_and_counted() {
    let hs = hashes(4);
    let remote = serving(&hs);
    let config = DataPlaneConfig {
        max_connections: 2,
        ..DataPlaneConfig::default()
    };
    let srv = DataPlaneServer::start(config, A, remote.manager.clone(), remote.layout.clone())
        .await
        .unwrap();
    let (idle1, idle2) = hold_two(&srv).await;
    assert_closed_at_once(&srv, "the connection over the cap is closed at once").await;
    assert_eq!(srv.stats().connections_refused(), 1);
    assert_eq!(srv.stats().connections(), 2);
    drop(idle1);
    eventually_async("a slot freed", || srv.stats().connections() == 1).await;
    assert_serves(&srv, &hs).await;
    drop(idle2);
}

/// Attack: one peer opens connections up to the per-peer cap and holds them idle. Its next
/// connection is closed at once and counted (not as the global cap); another peer address is
/// still served, and the first peer is served again once it frees a connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn security_one_peer_cannot_take_every_connection() {
    let hs = hashes(4);
    let remote = serving(&hs);
    let config = DataPlaneConfig {
        max_connections: 8,
        max_connections_per_peer: 2,
        ..DataPlaneConfig::default()
    };
    let srv = DataPlaneServer::start(config, A, remote.manager.clone(), remote.layout.clone())
        .await
        .unwrap();
    let (idle1, idle2) = hold_two(&srv).await;
    assert_closed_at_once(
        &srv,
        "the connection over the per-peer cap is closed at once",
    )
    .await;
    assert_eq!(srv.stats().peer_connections_refused(), 1);
    assert_eq!(srv.stats().connections_refused(), 0);

    // Another address (127.0.0.2 is loopback too) is its own peer: served.
    let other = tokio::net::TcpSocket::new_v4().unwrap();
    other.bind("127.0.0.2:0".parse().unwrap()).unwrap();
    let other = other.connect(srv.local_addr()).await.unwrap();
    eventually_async("the other peer's connection served", || {
        srv.stats().connections() == 3
    })
    .await;
    assert_eq!(srv.stats().peer_connections_refused(), 1);

    drop(idle1);
    eventually_async("a slot of the first peer freed", || {
        srv.stats().connections() == 2
    })
    .await;
    assert_serves(&srv, &hs).await;
    drop((idle2, other));
}

/// A client keeps at most `max_connections_per_peer` pulls in flight to one peer: many
/// concurrent pulls against a server with the same per-peer cap all arrive, none refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_pulls_queue_at_the_per_peer_cap_instead_of_being_refused() {
    let hs = hashes(8);
    let remote = serving(&hs);
    let config = DataPlaneConfig {
        max_connections_per_peer: 2,
        ..DataPlaneConfig::default()
    };
    let srv = DataPlaneServer::start(
        config.clone(),
        A,
        remote.manager.clone(),
        remote.layout.clone(),
    )
    .await
    .unwrap();
    let local = side();
    let c = Arc::new(
        DataPlaneClient::new(
            config,
            local.manager.clone(),
            local.layout.clone(),
            Arc::new(PeerDirectory::new()),
        )
        .unwrap(),
    );
    let addr = srv.local_addr();
    let pulls = (0..8).map(|i| {
        let (c, m, h) = (c.clone(), local.manager.clone(), hs[i]);
        tokio::spawn(async move {
            let dests = m.allocate_blocks(1).unwrap();
            c.pull_from(addr, A, &[h], dests).await
        })
    });
    for p in futures::future::join_all(pulls).await {
        let out = p.unwrap();
        assert!(out.iter().all(Result::is_ok), "{out:?}");
    }
    assert_eq!(srv.stats().peer_connections_refused(), 0);
    assert!(srv.stats().connections() <= 2);
}

/// Attack: a reader that takes each write just in time (so no per-write timeout fires) asks
/// for 4,096 frames of held blocks. Past the response deadline the server drops the
/// connection and every hold, counted; it keeps serving others.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn security_slow_reader_loses_its_holds_at_the_response_deadline() {
    let hs = hashes(N);
    let remote = serving(&hs);
    let config = DataPlaneConfig {
        response_deadline: Duration::from_millis(1500),
        io_timeout: Duration::from_secs(5),
        ..DataPlaneConfig::default()
    };
    let srv = DataPlaneServer::start(config, A, remote.manager.clone(), remote.layout.clone())
        .await
        .unwrap();
    // 4,096 frames naming the 8 held blocks over and over: 32 MiB of response.
    let asked: Vec<SequenceHash> = (0..4096).map(|i| hs[i % N]).collect();
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.set_recv_buffer_size(4096).unwrap();
    let mut slow = socket.connect(srv.local_addr()).await.unwrap();
    let head = RequestHead {
        count: asked.len() as u32,
        geometry: geometry_digest(geometry().config()),
        block_bytes: block_bytes() as u64,
    };
    slow.write_all(&wire::encode_request(head, &asked))
        .await
        .unwrap();
    let started = std::time::Instant::now();
    let reader = tokio::spawn(async move {
        // 4 KiB every 50 ms: every write of the server progresses well within its timeout.
        let mut buf = vec![0u8; 4096];
        loop {
            match slow.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(_) => tokio::time::sleep(Duration::from_millis(50)).await,
            }
        }
    });
    eventually_async("the blocks are held", || srv.stats().held() == N).await;
    eventually_async_within(
        Duration::from_secs(10),
        "holds released at the deadline",
        || srv.stats().held() == 0,
    )
    .await;
    assert!(started.elapsed() < Duration::from_secs(8));
    assert_eq!(srv.stats().responses_timed_out(), 1);
    // The server dropped its end (what the kernel buffered may still trickle to the reader).
    eventually_async("connection gone", || srv.stats().connections() == 0).await;
    reader.abort();
    assert_serves(&srv, &hs).await;
}

/// Attack: a server that answers every frame correctly, but each payload only just before
/// the client's per-read timeout (so none fires): 8 blocks take 12 s. The client gives
/// up at its pull deadline, fails the blocks `Timeout` (registering nothing), counts it, and
/// still pulls from a real server.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn security_trickling_server_is_cut_off_at_the_pull_deadline() {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    tokio::spawn(async move {
        let (mut s, _) = l.accept().await.unwrap();
        let mut head = [0u8; REQUEST_HEAD_LEN];
        s.read_exact(&mut head).await.unwrap();
        let h = wire::decode_request(&head).unwrap();
        let mut raw = vec![0u8; h.count as usize * 16];
        s.read_exact(&mut raw).await.unwrap();
        let hs = wire::decode_hashes(&raw);
        let head = wire::encode_response(Status::Ok, h.count);
        if s.write_all(&head).await.is_err() {
            return;
        }
        for hash in hs {
            let f = frame(hash, &vec![1u8; block_bytes()]);
            let (header, payload) = f.split_at(wire::FRAME_HEADER_LEN);
            if s.write_all(header).await.is_err() {
                return;
            }
            tokio::time::sleep(Duration::from_millis(1500)).await;
            if s.write_all(payload).await.is_err() {
                return;
            }
        }
    });
    let local = side();
    let config = DataPlaneConfig {
        io_timeout: Duration::from_secs(2),
        pull_deadline: Duration::from_secs(1),
        ..DataPlaneConfig::default()
    };
    let c = DataPlaneClient::new(
        config,
        local.manager.clone(),
        local.layout.clone(),
        Arc::new(PeerDirectory::new()),
    )
    .unwrap();
    let hs = hashes(N);
    let dests = local.manager.allocate_blocks(N).unwrap();
    let started = std::time::Instant::now();
    let out = tokio::time::timeout(Duration::from_secs(15), c.pull_from(addr, A, &hs, dests))
        .await
        .expect("the pull ends at its deadline");
    assert!(started.elapsed() < Duration::from_secs(5));
    for o in &out {
        let e = o.as_ref().unwrap_err();
        assert_eq!(e.kind, BlockFailureKind::Timeout, "{e}");
        assert!(e.message.contains("pull_deadline_ms"), "{e}");
    }
    drop(out);
    assert_eq!(c.stats().deadlines_exceeded, 1);
    assert!(local.manager.match_blocks(&hs).is_empty());
    assert_eq!(local.manager.available_blocks(), N);
    assert_eq!(c.stats().idle_connections, 0);

    // The same client still pulls from a member.
    let remote = serving(&hs);
    let srv = server(&remote).await;
    let dests = local.manager.allocate_blocks(N).unwrap();
    let out = c.pull_from(srv.local_addr(), A, &hs, dests).await;
    assert!(out.iter().all(Result::is_ok), "{out:?}");
}

/// Attack: peers announcing many addresses (here: one real server reached through five
/// loopback addresses) fill the client's idle pool. It keeps at most `max_idle_peers`
/// peers (evictions counted) and closes connections idle past `idle_expiry`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn security_client_pool_is_bounded_and_expires() {
    let hs = hashes(5);
    let remote = serving(&hs);
    let config = DataPlaneConfig {
        bind: "0.0.0.0:0".parse().unwrap(),
        ..DataPlaneConfig::default()
    };
    let srv = DataPlaneServer::start(config, A, remote.manager.clone(), remote.layout.clone())
        .await
        .unwrap();
    let port = srv.local_addr().port();
    let local = side();
    let config = DataPlaneConfig {
        io_timeout: Duration::from_secs(2),
        max_idle_peers: 2,
        idle_expiry: Duration::from_millis(500),
        ..DataPlaneConfig::default()
    };
    let c = DataPlaneClient::new(
        config,
        local.manager.clone(),
        local.layout.clone(),
        Arc::new(PeerDirectory::new()),
    )
    .unwrap();
    for (i, h) in hs.iter().enumerate() {
        let addr: SocketAddr = format!("127.0.0.{}:{port}", i + 1).parse().unwrap();
        let dests = local.manager.allocate_blocks(1).unwrap();
        let out = c.pull_from(addr, A, &[*h], dests).await;
        assert!(out.iter().all(Result::is_ok), "{addr}: {out:?}");
        let s = c.stats();
        assert!(s.idle_peers <= 2, "{s:?}");
    }
    let s = c.stats();
    assert_eq!((s.idle_peers, s.idle_connections), (2, 2), "{s:?}");
    assert_eq!(s.pool_evictions, 3);
    tokio::time::sleep(Duration::from_millis(700)).await;
    assert_eq!(c.stats().idle_connections, 0, "expired connections closed");
    eventually_async("the server saw them close", || {
        srv.stats().connections() == 0
    })
    .await;
    // Still pulls (on a fresh connection).
    let fresh = side();
    let c2 = client(&fresh);
    let dests = fresh.manager.allocate_blocks(1).unwrap();
    let out = c2.pull_from(srv.local_addr(), A, &hs[..1], dests).await;
    assert!(out.iter().all(Result::is_ok), "{out:?}");
}

// ---- The authenticated data plane (security on) ----

use crate::security::{Rejection, Role, RootKey, Security, SecurityConfig, TrustRoot};
use kvbm_logical::{HashAlgorithm, TokenBlock};
use kvbm_physical::testing::bytes;
use kvbm_tests::wait::{eventually_async, eventually_async_within};

const B: InstanceId = InstanceId(0xb);

/// `id`'s leader credential in namespace `ns` under `root`.
fn credential(root: &RootKey, id: InstanceId, ns: &str) -> Arc<crate::security::Credential> {
    Arc::new(
        root.issue(id, Role::Leader, 0, ns, Duration::from_secs(3600))
            .unwrap(),
    )
}

/// Security for `id`'s leader in `ns`, trusting `trust`.
fn member_of(trust: TrustRoot, root: &RootKey, id: InstanceId, ns: &str) -> Arc<Security> {
    Arc::new(Security::with_credential(
        trust,
        credential(root, id, ns),
        &SecurityConfig::default(),
    ))
}

fn member(root: &RootKey, id: InstanceId, ns: &str) -> Arc<Security> {
    member_of(root.trust_root(), root, id, ns)
}

fn stats(sec: &Security) -> &crate::security::SecurityStats {
    sec.stats().unwrap()
}

/// BLAKE3 blocks (each with its 256-bit digest).
fn digest_blocks(n: usize) -> Vec<TokenBlock> {
    let tokens: Vec<u32> = (0..(n as u32 * 4)).map(|t| t + 1000).collect();
    TokenBlockSequence::from_tokens_with(&tokens, 4, Salt::NONE, HashAlgorithm::Blake3)
        .unwrap()
        .blocks()
        .to_vec()
}

/// A serving side holding `blocks` in G2, registered with their digests.
fn serving_digests(blocks: &[TokenBlock]) -> Side {
    let hs: Vec<SequenceHash> = blocks.iter().map(TokenBlock::sequence_hash).collect();
    let s = serving(&[]);
    let dests = s.manager.allocate_blocks(blocks.len()).unwrap();
    for (b, h) in dests.iter().zip(&hs) {
        for (p, l) in s.layout.block_addrs(b.block_id(), 0..2) {
            // SAFETY: as in `bytes`; the block is ours (mutable).
            let m = unsafe { std::slice::from_raw_parts_mut(p as *mut u8, l) };
            for (k, x) in m.iter_mut().enumerate() {
                *x = (k as u8).wrapping_mul(13) ^ (h.as_u128() as u8);
            }
        }
    }
    let complete = dests
        .into_iter()
        .zip(blocks)
        .map(|(d, b)| d.complete_token_block(b).unwrap())
        .collect();
    drop(s.manager.register_blocks(complete));
    s
}

async fn secured_server(s: &Side, id: InstanceId, sec: Arc<Security>) -> DataPlaneServer {
    DataPlaneServer::start_secured(
        DataPlaneConfig::default(),
        id,
        s.manager.clone(),
        s.layout.clone(),
        sec,
    )
    .await
    .unwrap()
}

fn secured_client(s: &Side, sec: Arc<Security>, payload_mac: bool) -> DataPlaneClient {
    let config = DataPlaneConfig {
        io_timeout: Duration::from_secs(2),
        payload_mac: Some(payload_mac),
        ..DataPlaneConfig::default()
    };
    DataPlaneClient::new_secured(
        config,
        s.manager.clone(),
        s.layout.clone(),
        Arc::new(PeerDirectory::new()),
        sec,
    )
    .unwrap()
}

/// Pulls `hs` from `addr` as `instance` into fresh blocks of `local`.
async fn pull_into(
    c: &DataPlaneClient,
    local: &Side,
    addr: SocketAddr,
    instance: InstanceId,
    hs: &[SequenceHash],
) -> Vec<MoveOutcome<G2>> {
    let dests = local.manager.allocate_blocks(hs.len()).unwrap();
    c.pull_from(addr, instance, hs, dests).await
}

/// Asserts every outcome failed (with `needle` in the message) and nothing was registered.
fn assert_none_registered(
    out: Vec<MoveOutcome<G2>>,
    local: &Side,
    hs: &[SequenceHash],
    needle: &str,
) {
    for o in &out {
        let e = o.as_ref().unwrap_err();
        assert!(e.message.contains(needle), "{e} (wanted {needle:?})");
    }
    drop(out);
    assert!(local.manager.match_blocks(hs).is_empty());
    assert_eq!(local.manager.available_blocks(), N);
}

/// A member of the namespace pulls `hs` from `srv` (the server still serves members).
async fn assert_member_pulls(
    root: &RootKey,
    srv: &DataPlaneServer,
    remote: &Side,
    hs: &[SequenceHash],
) {
    assert_member_pulls_as(root, B, srv, remote, hs).await;
}

/// Members pull verified bytes over the authenticated protocol, and the digest the server
/// recorded travels with each block (both protocols); with `payload_mac` too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn security_authenticated_pull_verifies_and_carries_the_digest() {
    let root = RootKey::generate().unwrap();
    let blocks = digest_blocks(4);
    let hs: Vec<SequenceHash> = blocks.iter().map(TokenBlock::sequence_hash).collect();
    let remote = serving_digests(&blocks);
    let srv_sec = member(&root, A, "ns");
    let srv = secured_server(&remote, A, srv_sec.clone()).await;
    for payload_mac in [false, true] {
        let local = side();
        let sec = member(&root, B, "ns");
        let c = secured_client(&local, sec.clone(), payload_mac);
        let out = pull_into(&c, &local, srv.local_addr(), A, &hs[..3]).await;
        for (i, o) in out.iter().enumerate() {
            let b = o.as_ref().unwrap();
            assert_eq!(bytes(&local.layout, b.block_id()), expected(&remote, hs[i]));
            assert_eq!(b.digest(), blocks[i].digest(), "the digest travelled");
        }
        drop(out);
        // The connection was pooled and is reused (one handshake for both requests).
        let out = pull_into(&c, &local, srv.local_addr(), A, &hs[3..]).await;
        assert_eq!(out[0].as_ref().unwrap().digest(), blocks[3].digest());
        assert_eq!(stats(&sec).rejected_total(), 0);
        assert_eq!(c.stats().handshakes_refused, 0);
    }
    assert_eq!(srv.stats().handshakes(), 2);
    assert_eq!(srv.stats().handshakes_refused(), 0);
    assert_eq!(stats(&srv_sec).rejected_total(), 0);

    // Security off: the plain protocol carries the digest too.
    let plain = DataPlaneServer::start(
        DataPlaneConfig::default(),
        A,
        remote.manager.clone(),
        remote.layout.clone(),
    )
    .await
    .unwrap();
    let local = side();
    let c = client(&local);
    let out = pull_into(&c, &local, plain.local_addr(), A, &hs).await;
    for (o, b) in out.iter().zip(&blocks) {
        assert_eq!(o.as_ref().unwrap().digest(), b.digest());
    }
}

/// A frame whose identity is a digest the requested hash was not derived from is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_digest_that_does_not_match_the_hash_is_refused() {
    let (out, local, hs) = pull_hostile(|hs| {
        let payload = vec![3u8; block_bytes()];
        let g = geometry_digest(geometry().config());
        let mut reply = wire::encode_response(Status::Ok, 2).to_vec();
        // A well-formed header naming a made-up digest for hs[0].
        let bogus = kvbm_logical::BlockDigest([0x77; 32]);
        let region = [(payload.as_ptr() as usize, payload.len())];
        let checksum = wire::payload_checksum(&[&payload]);
        let header = wire::frame_header_with(hs[0], Some(bogus), A, g, &region, checksum);
        reply.extend_from_slice(&header);
        reply.extend_from_slice(&payload);
        reply
    })
    .await;
    let e = out[0].as_ref().unwrap_err();
    assert!(e.message.contains("block identity"), "{e}");
    drop(out);
    assert!(local.manager.match_blocks(&hs).is_empty());
}

/// Attack: clients that are not members of the server's namespace — no credential (security
/// off), a certificate of another root, a member of another namespace under the same root —
/// connect to an authenticated server. Each gets nothing, is counted, and the server keeps
/// serving members.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn security_non_members_and_other_tenants_get_nothing() {
    let root = RootKey::generate().unwrap();
    let hs = hashes(3);
    let remote = serving(&hs);
    let srv_sec = member(&root, A, "ns");
    let srv = secured_server(&remote, A, srv_sec.clone()).await;
    let addr = srv.local_addr();

    // No credential: the plain protocol is refused, and the mismatch is named.
    let local = side();
    let out = pull_into(&client(&local), &local, addr, A, &hs).await;
    assert_none_registered(out, &local, &hs, "requires an authenticated member");
    assert_eq!(srv.stats().handshakes_refused(), 1);
    assert_eq!(stats(&srv_sec).rejected(Rejection::NotMember), 1);

    // A certificate of another root (same instance id and namespace).
    let other_root = RootKey::generate().unwrap();
    let outsider = member(&other_root, B, "ns");
    let c = secured_client(&local, outsider.clone(), false);
    let out = pull_into(&c, &local, addr, A, &hs).await;
    assert_none_registered(out, &local, &hs, "refused");
    assert_eq!(srv.stats().handshakes_refused(), 2);
    assert_eq!(stats(&srv_sec).rejected(Rejection::NotMember), 2);
    assert_eq!(c.stats().handshakes_refused, 1);

    // Another tenant: a member of namespace "other" under the same root.
    let tenant = member(&root, B, "other");
    let c = secured_client(&local, tenant, false);
    let out = pull_into(&c, &local, addr, A, &hs).await;
    assert_none_registered(out, &local, &hs, "refused");
    assert_eq!(srv.stats().handshakes_refused(), 3);
    assert_eq!(stats(&srv_sec).rejected(Rejection::OtherNamespace), 1);

    // A worker's credential of the right namespace is not a data-plane peer either.
    let worker = Arc::new(Security::with_credential(
        root.trust_root(),
        Arc::new(
            root.issue(B, Role::Worker, 0, "ns", Duration::from_secs(3600))
                .unwrap(),
        ),
        &SecurityConfig::default(),
    ));
    let c = secured_client(&local, worker, false);
    let out = pull_into(&c, &local, addr, A, &hs).await;
    assert_none_registered(out, &local, &hs, "refused");
    assert_eq!(stats(&srv_sec).rejected(Rejection::NotAllowed), 1);

    // Nothing was served or held for any of them.
    assert_eq!(srv.stats().requests(), 0);
    assert_eq!(srv.stats().blocks_served(), 0);
    assert_eq!(srv.stats().held(), 0);
    assert_member_pulls(&root, &srv, &remote, &hs).await;
    assert_eq!(srv.stats().handshakes(), 1);
}

/// Attack: a server at the address the client means to pull instance A from is not A — a
/// member B answering (a forged heartbeat), a server of another root claiming to be A, or a
/// server with security off. The client refuses each before asking for anything; nothing is
/// registered and each refusal is counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn security_a_server_impersonating_another_instance_is_refused() {
    let root = RootKey::generate().unwrap();
    let hs = hashes(3);
    let remote = serving(&hs);
    let local = side();
    let sec = member(&root, InstanceId(0xc), "ns");
    let c = secured_client(&local, sec.clone(), false);

    // Member B's server, pulled from as A.
    let b = secured_server(&remote, B, member(&root, B, "ns")).await;
    let out = pull_into(&c, &local, b.local_addr(), A, &hs).await;
    assert_none_registered(out, &local, &hs, "not the instance asked for");
    assert_eq!(stats(&sec).rejected(Rejection::NotAllowed), 1);
    assert_eq!(b.stats().requests(), 0);

    // A server of another root whose credential claims A.
    let other = RootKey::generate().unwrap();
    let forged = secured_server(&remote, A, member(&other, A, "ns")).await;
    let out = pull_into(&c, &local, forged.local_addr(), A, &hs).await;
    assert_none_registered(out, &local, &hs, "refused");
    assert_eq!(forged.stats().requests(), 0);

    // A server with no credential (security off): the mismatch is named and counted.
    let off = server(&remote).await;
    let out = pull_into(&c, &local, off.local_addr(), A, &hs).await;
    assert_none_registered(out, &local, &hs, "not authenticated (security off)");
    assert_eq!(off.stats().blocks_served(), 0);
    assert_eq!(c.stats().handshakes_refused, 3);
    assert_eq!(c.stats().idle_connections, 0);

    // A real A still serves this client.
    let a = secured_server(&remote, A, member(&root, A, "ns")).await;
    let out = pull_into(&c, &local, a.local_addr(), A, &hs).await;
    assert!(out.iter().all(Result::is_ok), "{out:?}");
}

/// A proxy for one connection to `server`: forwards both directions, but hands the `hold`
/// bytes after the first `pass` bytes of the direction `to_client` (or to the server) to
/// `mutate` before forwarding them.
async fn proxy(
    server: SocketAddr,
    to_client: bool,
    pass: usize,
    hold: usize,
    mutate: impl FnOnce(&mut Vec<u8>) + Send + 'static,
) -> SocketAddr {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    tokio::spawn(async move {
        let (c, _) = l.accept().await.unwrap();
        let s = TcpStream::connect(server).await.unwrap();
        c.set_nodelay(true).unwrap();
        s.set_nodelay(true).unwrap();
        let (cr, cw) = c.into_split();
        let (sr, sw) = s.into_split();
        let (mut from, mut to, mut other_from, mut other_to) = if to_client {
            (sr, cw, cr, sw)
        } else {
            (cr, sw, sr, cw)
        };
        tokio::spawn(async move {
            let _ = tokio::io::copy(&mut other_from, &mut other_to).await;
            let _ = other_to.shutdown().await;
        });
        // The first `pass` bytes as they come (the handshake needs its round trips).
        let mut first = (&mut from).take(pass as u64);
        match tokio::io::copy(&mut first, &mut to).await {
            Ok(n) if n == pass as u64 => {}
            _ => return,
        }
        let mut held = vec![0u8; hold];
        if from.read_exact(&mut held).await.is_err() {
            return;
        }
        mutate(&mut held);
        let _ = to.write_all(&held).await;
        let _ = tokio::io::copy(&mut from, &mut to).await;
        let _ = to.shutdown().await;
    });
    addr
}

/// Attack: an on-path party changes the server's frames — a header field (the checksum the
/// tag covers), a tag, a replayed frame in place of the next one, two frames swapped — or
/// changes the client's request. Each fails the request from that frame on: nothing of it
/// after the bad frame is registered, the tag failure is counted, and the server keeps
/// serving members.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn security_tampered_replayed_and_reordered_frames_are_refused() {
    let root = RootKey::generate().unwrap();
    let hs = hashes(3);
    let remote = serving(&hs);
    let (srv_sec, server_hello) = server_member(&root);
    let srv = secured_server(&remote, A, srv_sec.clone()).await;
    // Server → client: its challenge and hello (`server_hello` bytes), the response head and
    // its tag, then frames of header + tag + payload.
    let head = RESPONSE_HEAD_LEN + wire::TAG_LEN;
    let frame = FRAME_HEADER_LEN + wire::TAG_LEN + block_bytes();
    type Mutation = Box<dyn FnOnce(&mut Vec<u8>) + Send>;
    let attacks: Vec<(&str, usize, Mutation)> = vec![
        (
            "a flipped checksum bit in the second frame's header",
            1,
            Box::new(move |b| b[frame + 32] ^= 1),
        ),
        (
            "a flipped bit in the second frame's tag",
            1,
            Box::new(move |b| b[frame + FRAME_HEADER_LEN] ^= 0x80),
        ),
        (
            "the first frame replayed in place of the second",
            1,
            Box::new(move |b| {
                let first = b[..frame].to_vec();
                b[frame..2 * frame].copy_from_slice(&first);
            }),
        ),
        (
            "the first two frames swapped",
            0,
            Box::new(move |b| {
                let first = b[..frame].to_vec();
                b.copy_within(frame..2 * frame, 0);
                b[frame..].copy_from_slice(&first);
            }),
        ),
    ];
    let mut refused = 0;
    for (what, good, mutate) in attacks {
        let addr = proxy(
            srv.local_addr(),
            true,
            server_hello + head,
            2 * frame,
            mutate,
        )
        .await;
        let local = side();
        let sec = member(&root, B, "ns");
        let c = secured_client(&local, sec.clone(), false);
        let out = pull_into(&c, &local, addr, A, &hs).await;
        for (i, o) in out.iter().enumerate() {
            if i < good {
                assert!(o.is_ok(), "{what}: block {i} came before the attack: {o:?}");
            } else {
                let e = o.as_ref().unwrap_err();
                assert!(e.message.contains("failed its tag"), "{what}: {e}");
            }
        }
        drop(out);
        assert_eq!(local.manager.match_blocks(&hs).len(), good, "{what}");
        assert_eq!(c.stats().tags_refused, 1, "{what}");
        assert_eq!(stats(&sec).rejected(Rejection::BadSignature), 1, "{what}");
        assert_eq!(
            c.stats().idle_connections,
            0,
            "{what}: the connection was dropped"
        );
        refused += 1;
    }
    assert_eq!(refused, 4);

    // Client → server: a flipped bit in the request's hash list. The server drops the
    // connection unanswered and counts it; the client's blocks fail and nothing registers.
    // The client's hello is as long as the server's (one namespace: certificates of one length).
    let client_hello = server_hello - wire::CHALLENGE_LEN - wire::SIG_LEN;
    let before_list = client_hello + wire::SIG_LEN + REQUEST_HEAD_LEN + wire::TAG_LEN;
    let addr = proxy(srv.local_addr(), false, before_list, 1, |b| b[0] ^= 1).await;
    let local = side();
    let c = secured_client(&local, member(&root, B, "ns"), false);
    let out = pull_into(&c, &local, addr, A, &hs).await;
    assert_none_registered(out, &local, &hs, "");
    eventually_async("the server counted the bad request tag", || {
        srv.stats().tags_refused() == 1
    })
    .await;
    assert_eq!(stats(&srv_sec).rejected(Rejection::BadSignature), 1);

    // A corrupt payload (the tagged header's checksum no longer matches) is refused too.
    #[cfg(feature = "testing")]
    {
        srv.corrupt_next_frames(1);
        let local = side();
        let c = secured_client(&local, member(&root, B, "ns"), false);
        let out = pull_into(&c, &local, srv.local_addr(), A, &hs).await;
        assert!(out.iter().all(Result::is_err), "{out:?}");
        drop(out);
        assert!(local.manager.match_blocks(&hs).is_empty());
    }

    eventually_async("holds released", || srv.stats().held() == 0).await;
    assert_member_pulls(&root, &srv, &remote, &hs).await;
}

/// With `payload_mac`, a payload changed on the way (checksum fixed up by the attacker in
/// the header is impossible without the key, so here only the payload changes) fails its
/// payload tag before the checksum would be trusted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn security_payload_mac_refuses_a_changed_payload() {
    let root = RootKey::generate().unwrap();
    let hs = hashes(2);
    let remote = serving(&hs);
    let (srv_sec, server_hello) = server_member(&root);
    let srv = secured_server(&remote, A, srv_sec).await;
    let head = RESPONSE_HEAD_LEN + wire::TAG_LEN;
    let frame = FRAME_HEADER_LEN + wire::TAG_LEN + block_bytes() + wire::TAG_LEN;
    // The payload tag of the first frame is flipped.
    let addr = proxy(
        srv.local_addr(),
        true,
        server_hello + head,
        frame,
        move |b| b[frame - 1] ^= 1,
    )
    .await;
    let local = side();
    let c = secured_client(&local, member(&root, B, "ns"), true);
    let out = pull_into(&c, &local, addr, A, &hs).await;
    assert_none_registered(out, &local, &hs, "failed its tag");
    assert_eq!(c.stats().tags_refused, 1);
}

/// This machine's address off the loopback interface (the one its default route leaves by:
/// a UDP socket's `connect` sends nothing).
fn off_loopback_ip() -> std::net::IpAddr {
    let udp = std::net::UdpSocket::bind("0.0.0.0:0").unwrap();
    udp.connect("8.8.8.8:53")
        .expect("this test needs an address off the loopback interface (a default route)");
    let ip = udp.local_addr().unwrap().ip();
    assert!(!ip.is_loopback() && !ip.is_unspecified(), "{ip}");
    ip
}

/// Attack (N10): an on-path party changes a payload. With the defaults
/// (`security.dataplane_payload_mac` absent) a connection whose other end is off the loopback
/// interface carries payload tags: the change fails the tag. Over loopback it does not (the
/// frame's xxh3-128 checksum, under the header's tag, still refuses it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn security_the_payload_mac_is_on_by_default_off_loopback() {
    let root = RootKey::generate().unwrap();
    let hs = hashes(2);
    let remote = serving(&hs);
    let (srv_sec, server_hello) = server_member(&root);
    let config = DataPlaneConfig {
        bind: "0.0.0.0:0".parse().unwrap(),
        ..DataPlaneConfig::default()
    };
    assert_eq!(config.payload_mac, None, "the default");
    let srv = secured_server_with(&remote, srv_sec, config).await;
    let port = srv.local_addr().port();
    let head = RESPONSE_HEAD_LEN + wire::TAG_LEN;
    // The first frame with a payload tag. Its last byte is that tag's; without the MAC it is
    // inside the second frame's header, and the first block arrives intact.
    let frame = FRAME_HEADER_LEN + wire::TAG_LEN + block_bytes() + wire::TAG_LEN;
    for (server_ip, mac) in [
        (off_loopback_ip(), true),
        ("127.0.0.1".parse().unwrap(), false),
    ] {
        let addr = proxy(
            SocketAddr::new(server_ip, port),
            true,
            server_hello + head,
            frame,
            move |b| b[frame - 1] ^= 1,
        )
        .await;
        let local = side();
        let config = DataPlaneConfig {
            io_timeout: Duration::from_secs(2),
            ..DataPlaneConfig::default()
        };
        let c = DataPlaneClient::new_secured(
            config,
            local.manager.clone(),
            local.layout.clone(),
            Arc::new(PeerDirectory::new()),
            member(&root, B, "ns"),
        )
        .unwrap();
        let out = pull_into(&c, &local, addr, A, &hs).await;
        if mac {
            let e = out[0].as_ref().unwrap_err();
            assert!(
                e.message.contains("payload of block"),
                "via {server_ip}: {e}"
            );
        } else {
            let b = out[0].as_ref().expect("no payload tag over loopback");
            assert_eq!(bytes(&local.layout, b.block_id()), expected(&remote, hs[0]));
            let e = out[1].as_ref().unwrap_err();
            assert!(e.message.contains("frame of block"), "via {server_ip}: {e}");
        }
    }
}

/// `A`'s leader in namespace "ns" under `root`, and how many bytes the server sends before
/// its response head: its challenge, then its hello (head, certificate, key, nonce) and
/// signature.
fn server_member(root: &RootKey) -> (Arc<Security>, usize) {
    let cred = credential(root, A, "ns");
    let cert_len = cred.cert().encode().len();
    let sec = Arc::new(Security::with_credential(
        root.trust_root(),
        cred,
        &SecurityConfig::default(),
    ));
    let sent = wire::CHALLENGE_LEN + wire::HELLO_HEAD_LEN + cert_len + 64 + wire::SIG_LEN;
    (sec, sent)
}

/// A secured server for `A` over `remote` with `config`.
async fn secured_server_with(
    remote: &Side,
    sec: Arc<Security>,
    config: DataPlaneConfig,
) -> DataPlaneServer {
    DataPlaneServer::start_secured(
        config,
        A,
        remote.manager.clone(),
        remote.layout.clone(),
        sec,
    )
    .await
    .unwrap()
}

/// A TCP connection to `addr` from the loopback address `127.0.0.<last>`.
async fn connect_from(last: u8, addr: SocketAddr) -> TcpStream {
    let sock = tokio::net::TcpSocket::new_v4().unwrap();
    sock.bind(SocketAddr::from(([127, 0, 0, last], 0))).unwrap();
    sock.connect(addr).await.unwrap()
}

/// Completes the authenticated handshake with `addr` as `sec`, from `127.0.0.<last>`, and
/// keeps the connection (idle).
async fn handshake_from(
    last: u8,
    addr: SocketAddr,
    sec: &Security,
) -> Result<TcpStream, handshake::Refused> {
    let Security::On(sealing) = sec else {
        panic!("a member")
    };
    let mut s = connect_from(last, addr).await;
    handshake::client(&mut s, sealing, false, A, handshake::Party::Leader).await?;
    Ok(s)
}

/// Attack (N3): strangers from eight loopback addresses open four connections each, half
/// silent, half stalled inside a hello, and hold them. They wait in the pending pool (the
/// oldest dropped for each newcomer), never in a member's slot; a member pulls while they
/// hold their sockets.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn security_strangers_holding_sockets_leave_members_their_slots() {
    let root = RootKey::generate().unwrap();
    let hs = hashes(3);
    let remote = serving(&hs);
    let config = DataPlaneConfig {
        max_connections: 4,
        max_connections_per_peer: 4,
        max_pending: 8,
        handshake_deadline: Duration::from_secs(30),
        ..DataPlaneConfig::default()
    };
    let srv = secured_server_with(&remote, member(&root, A, "ns"), config).await;
    let mut strangers = Vec::new();
    for last in 2..10u8 {
        for k in 0..4 {
            let mut s = connect_from(last, srv.local_addr()).await;
            if k % 2 == 1 {
                s.write_all(&wire::CLIENT_HELLO_MAGIC.to_le_bytes())
                    .await
                    .unwrap();
            }
            strangers.push(s);
        }
    }
    eventually_async("the strangers fill the pending pool", || {
        srv.stats().pending() == 8 && srv.stats().pending_evicted() == 24
    })
    .await;
    assert_eq!(
        srv.stats().connections(),
        0,
        "no stranger holds a member's slot"
    );
    assert_member_pulls(&root, &srv, &remote, &hs).await;
    assert_eq!(srv.stats().handshakes(), 1);
    assert_eq!(srv.stats().connections_refused(), 0);
    drop(strangers);
}

/// Attack (N3): a stranger that connects and says nothing is dropped at the (short) handshake
/// deadline, counted as a refused handshake, and its pending place is freed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn security_a_silent_stranger_is_dropped_at_the_handshake_deadline() {
    let root = RootKey::generate().unwrap();
    let remote = serving(&hashes(1));
    let config = DataPlaneConfig {
        handshake_deadline: Duration::from_millis(300),
        io_timeout: Duration::from_secs(30),
        ..DataPlaneConfig::default()
    };
    let srv = secured_server_with(&remote, member(&root, A, "ns"), config).await;
    let mut silent = TcpStream::connect(srv.local_addr()).await.unwrap();
    let mut buf = [0u8; 1];
    let r = tokio::time::timeout(Duration::from_secs(5), silent.read(&mut buf))
        .await
        .expect("closed at the handshake deadline, not the I/O timeout");
    assert!(matches!(r, Ok(0) | Err(_)), "{r:?}");
    eventually_async("counted, and the place freed", || {
        srv.stats().handshakes_refused() == 1 && srv.stats().pending() == 0
    })
    .await;
}

/// Attack (N3): a hello with a copied certificate (certificates travel in every hello) and no
/// key. The server answers with a fresh challenge and nothing else (no key agreement, no
/// signature of its own); a made-up proof, and a real proof the member made for another
/// connection's challenge, are refused and counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn security_a_copied_certificate_gets_a_challenge_and_no_server_work() {
    let root = RootKey::generate().unwrap();
    let remote = serving(&hashes(1));
    let srv_sec = member(&root, A, "ns");
    let srv = secured_server(&remote, A, srv_sec.clone()).await;
    let b = credential(&root, B, "ns");
    let hello = wire::Hello {
        flags: 0,
        cert: b.cert().encode(),
        ephemeral: [7; 32],
        nonce: [9; 32],
    }
    .encode(wire::CLIENT_HELLO_MAGIC);
    async fn challenge_of(s: &mut TcpStream, hello: &[u8]) -> [u8; wire::CHALLENGE_LEN] {
        s.write_all(hello).await.unwrap();
        let mut c = [0u8; wire::CHALLENGE_LEN];
        s.read_exact(&mut c).await.unwrap();
        assert_eq!(
            u64::from_le_bytes(c[..8].try_into().unwrap()),
            wire::CHALLENGE_MAGIC,
            "a challenge, not the server's hello"
        );
        // Nothing more before a proof.
        let mut more = [0u8; 1];
        assert!(
            tokio::time::timeout(Duration::from_millis(300), s.read(&mut more))
                .await
                .is_err(),
            "the server waits for the proof"
        );
        c
    }
    async fn refused(s: &mut TcpStream) {
        let mut r = [0u8; RESPONSE_HEAD_LEN];
        s.read_exact(&mut r).await.unwrap();
        assert_eq!(
            wire::decode_response(&r).unwrap().0,
            Status::AuthRequired as u32
        );
        let mut rest = Vec::new();
        let _ = s.read_to_end(&mut rest).await;
        assert!(rest.is_empty(), "nothing after the refusal");
    }

    // A made-up proof.
    let mut s = TcpStream::connect(srv.local_addr()).await.unwrap();
    let first = challenge_of(&mut s, &hello).await;
    s.write_all(&[0x55; wire::SIG_LEN]).await.unwrap();
    refused(&mut s).await;

    // A real proof, for another connection's challenge.
    let mut s = TcpStream::connect(srv.local_addr()).await.unwrap();
    let second = challenge_of(&mut s, &hello).await;
    assert_ne!(first, second, "each connection gets a fresh challenge");
    let stale = b.sign(&wire::client_proof(&hello, &first));
    s.write_all(&stale).await.unwrap();
    refused(&mut s).await;

    eventually_async("both refusals counted", || {
        srv.stats().handshakes_refused() == 2
    })
    .await;
    assert_eq!(stats(&srv_sec).rejected(Rejection::BadSignature), 2);
    assert_eq!(srv.stats().handshakes(), 0);
    assert_eq!(srv.stats().connections(), 0);
}

/// Attack (N3): one member opens connections up to the per-peer cap and holds them. The cap
/// is the member's, not its address's: its next connection is answered "busy" from any
/// address, while another member behind the same address is served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn security_the_per_peer_cap_counts_members_not_addresses() {
    let root = RootKey::generate().unwrap();
    let hs = hashes(2);
    let remote = serving(&hs);
    let config = DataPlaneConfig {
        max_connections: 8,
        max_connections_per_peer: 2,
        ..DataPlaneConfig::default()
    };
    let srv = secured_server_with(&remote, member(&root, A, "ns"), config).await;
    let addr = srv.local_addr();
    let b = member(&root, B, "ns");
    let held = (
        handshake_from(1, addr, &b).await.unwrap(),
        handshake_from(1, addr, &b).await.unwrap(),
    );
    assert_eq!(srv.stats().connections(), 2);
    for last in [1, 5] {
        let e = handshake_from(last, addr, &b).await.unwrap_err();
        assert_eq!(e.status, Status::Busy, "{}", e.message);
        assert!(
            e.message.contains("max_connections_per_peer"),
            "{}",
            e.message
        );
    }
    assert_eq!(srv.stats().peer_connections_refused(), 2);
    assert_eq!(
        srv.stats().handshakes_refused(),
        0,
        "a cap is not a refused handshake"
    );

    // Another member, from the very same address.
    let local = side();
    let c = secured_client(&local, member(&root, InstanceId(0xc), "ns"), false);
    let out = pull_into(&c, &local, addr, A, &hs).await;
    for (o, h) in out.iter().zip(&hs) {
        assert_eq!(
            bytes(&local.layout, o.as_ref().unwrap().block_id()),
            expected(&remote, *h)
        );
    }
    drop(held);
}

/// Attack (N3): one address opens connections as fast as it can. Past its accept rate each is
/// closed at once and counted; a member from another address still pulls.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn security_a_connection_flood_from_one_address_is_throttled() {
    let root = RootKey::generate().unwrap();
    let hs = hashes(2);
    let remote = serving(&hs);
    let config = DataPlaneConfig {
        accepts_per_second_per_peer: 5,
        ..DataPlaneConfig::default()
    };
    let srv = secured_server_with(&remote, member(&root, A, "ns"), config).await;
    let mut flood = Vec::new();
    for _ in 0..40 {
        flood.push(connect_from(7, srv.local_addr()).await);
    }
    eventually_async("the flood is throttled", || {
        srv.stats().accepts_throttled() >= 30
    })
    .await;
    assert!(srv.stats().pending() <= 10, "{}", srv.stats().pending());
    assert_member_pulls(&root, &srv, &remote, &hs).await;
    drop(flood);
}

/// Attack (N4): a member is revoked while it holds a live, pooled session. The server ends
/// the session at its next check (every `security.revocation_check_ms`), the member's next
/// pull fails (its new handshake refused as revoked, counted), and other members are served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn security_a_revoked_member_loses_its_live_session() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    let root = RootKey::generate().unwrap();
    let hs = hashes(2);
    let remote = serving(&hs);
    let cred_file = dir.path().join("a.cred");
    credential(&root, A, "ns").save(&cred_file).unwrap();
    let list = dir.path().join("revoked");
    std::fs::write(&list, "").unwrap();
    std::fs::set_permissions(&list, std::fs::Permissions::from_mode(0o644)).unwrap();
    let srv_sec = Arc::new(
        Security::from_config(&SecurityConfig {
            trust_root: Some(root.trust_root().to_hex()),
            credential_file: Some(cred_file),
            revoked_file: Some(list.clone()),
            revocation_check_ms: 50,
            ..SecurityConfig::default()
        })
        .unwrap(),
    );
    let srv = secured_server(&remote, A, srv_sec.clone()).await;
    let b = member(&root, B, "ns");
    let local = side();
    let c = secured_client(&local, b.clone(), false);
    let out = pull_into(&c, &local, srv.local_addr(), A, &hs).await;
    assert!(out.iter().all(Result::is_ok), "{out:?}");
    drop(out);
    assert_eq!(srv.stats().connections(), 1, "B's session is live (pooled)");

    let fingerprint = b.signer().unwrap().cert().fingerprint_hex();
    std::fs::write(&list, format!("{fingerprint}\n")).unwrap();
    eventually_async("the live session ended", || srv.stats().connections() == 0).await;
    assert!(stats(&srv_sec).rejected(Rejection::Revoked) >= 1);

    let out = pull_into(&c, &local, srv.local_addr(), A, &hs).await;
    let e = out[0].as_ref().unwrap_err();
    assert!(e.message.contains("refused"), "{e}");
    drop(out);
    assert!(
        stats(&srv_sec).rejected(Rejection::Revoked) >= 2,
        "the new handshake too"
    );
    assert_member_pulls_as(&root, InstanceId(0xc), &srv, &remote, &hs).await;
}

/// A member `id` of the namespace pulls `hs` from `srv` (the server still serves members).
async fn assert_member_pulls_as(
    root: &RootKey,
    id: InstanceId,
    srv: &DataPlaneServer,
    remote: &Side,
    hs: &[SequenceHash],
) {
    let local = side();
    let c = secured_client(&local, member(root, id, "ns"), false);
    let out = pull_into(&c, &local, srv.local_addr(), srv.instance(), hs).await;
    for (o, h) in out.iter().zip(hs) {
        let b = o.as_ref().unwrap();
        assert_eq!(bytes(&local.layout, b.block_id()), expected(remote, *h));
    }
}

/// A server whose credential is not its instance's leader refuses to start.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_needs_its_own_leader_credential() {
    let root = RootKey::generate().unwrap();
    let s = side();
    let err = DataPlaneServer::start_secured(
        DataPlaneConfig::default(),
        A,
        s.manager.clone(),
        s.layout.clone(),
        member(&root, B, "ns"),
    )
    .await
    .unwrap_err();
    assert!(err.to_string().contains("leader credential"), "{err}");
}

mod decoders {
    use super::super::wire::{self, HELLO_HEAD_LEN, Hello, RESPONSE_HEAD_LEN};
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn hello_round_trips_and_bounds_its_lengths() {
        let h = Hello {
            flags: wire::FLAG_PAYLOAD_MAC,
            cert: vec![7; 190],
            ephemeral: [1; 32],
            nonce: [2; 32],
        };
        let b = h.encode(wire::CLIENT_HELLO_MAGIC);
        let head: [u8; HELLO_HEAD_LEN] = b[..HELLO_HEAD_LEN].try_into().unwrap();
        let (flags, len) = Hello::decode_head(&head, wire::CLIENT_HELLO_MAGIC).unwrap();
        assert_eq!(len, b.len() - HELLO_HEAD_LEN);
        assert_eq!(Hello::decode_body(flags, &b[HELLO_HEAD_LEN..]).unwrap(), h);
        // The other side's magic, an unknown version, flag or a long certificate.
        assert!(Hello::decode_head(&head, wire::SERVER_HELLO_MAGIC).is_err());
        let mut bad = head;
        bad[8] = 9;
        assert!(matches!(
            Hello::decode_head(&bad, wire::CLIENT_HELLO_MAGIC),
            Err(wire::HelloError::Version(9))
        ));
        let mut bad = head;
        bad[12] = 0x02;
        assert!(Hello::decode_head(&bad, wire::CLIENT_HELLO_MAGIC).is_err());
        let mut bad = head;
        bad[14..16].copy_from_slice(&(wire::MAX_CERT_LEN as u16 + 1).to_le_bytes());
        assert!(matches!(
            Hello::decode_head(&bad, wire::CLIENT_HELLO_MAGIC),
            Err(wire::HelloError::CertLen(_))
        ));
    }

    proptest! {
        #[test]
        fn any_bytes_decode_without_panic(b in proptest::collection::vec(any::<u8>(), 0..400)) {
            let mut head = [0u8; HELLO_HEAD_LEN];
            let n = b.len().min(HELLO_HEAD_LEN);
            head[..n].copy_from_slice(&b[..n]);
            for magic in [wire::CLIENT_HELLO_MAGIC, wire::SERVER_HELLO_MAGIC] {
                if let Ok((flags, len)) = Hello::decode_head(&head, magic) {
                    prop_assert!(len <= wire::MAX_CERT_LEN + 64);
                    let _ = Hello::decode_body(flags, &b[n..]);
                }
            }
            let _ = Hello::decode_body(0, &b);
            let mut req = [0u8; REQUEST_HEAD_LEN];
            let n = b.len().min(REQUEST_HEAD_LEN);
            req[..n].copy_from_slice(&b[..n]);
            let _ = wire::decode_request_version(&req, wire::VERSION);
            let _ = wire::decode_request_version(&req, wire::VERSION_AUTH);
            let mut resp = [0u8; RESPONSE_HEAD_LEN];
            let n = b.len().min(RESPONSE_HEAD_LEN);
            resp[..n].copy_from_slice(&b[..n]);
            let _ = wire::decode_response_version(&resp, wire::VERSION);
            let _ = wire::decode_response_version(&resp, wire::VERSION_AUTH);
            let mut frame = [0u8; FRAME_HEADER_LEN];
            let n = b.len().min(FRAME_HEADER_LEN);
            frame[..n].copy_from_slice(&b[..n]);
            let h = hashes(1)[0];
            let _ = wire::check_frame(&frame, h, A, 1, block_bytes());
            let _ = wire::decode_hashes(&b);
        }

        #[test]
        fn a_frame_header_binds_its_digest(raw in any::<[u8; 32]>()) {
            let h = hashes(1)[0];
            let d = kvbm_logical::BlockDigest(raw);
            let id = kvbm_physical::identity::BlockIdentity::from_bytes(raw);
            // Only a digest the hash was derived from is accepted as the block's.
            let consistent = u64::from_be_bytes(raw[..8].try_into().unwrap()) == h.current();
            match wire::digest_of(&id, h) {
                Some(Some(got)) => prop_assert!(consistent && got == d),
                Some(None) => prop_assert!(id == kvbm_offload::block_identity(h)),
                None => prop_assert!(!consistent),
            }
        }
    }
}

/// N5 of the second review, where the design allows it: a block's digest comes from its
/// tokens, not from its KV bytes, so no puller can check it against the bytes; but a puller
/// that knows the block by its own key (an inference engine's block hashes) derives the digest
/// itself. Attack: a member serves a block under a digest of its choosing (bound to the hash's
/// first 8 bytes, so the frame check passes). A puller that knows the block refuses it
/// (counted; the stream stays usable for the next block) and registers every block it knows
/// with its own digest, so what its G3/G4 headers record is never the peer's choice. A puller
/// that does not know the block keeps the announced digest (what the threat model says). An
/// index entry a pull proved wrong (a refused identity, a block the peer does not hold) is
/// forgotten.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn security_a_peer_cannot_choose_the_digest_of_a_block_the_puller_knows() {
    let blocks = digest_blocks(4);
    let hs: Vec<SequenceHash> = blocks.iter().map(TokenBlock::sequence_hash).collect();
    let truth: Vec<_> = blocks.iter().map(|b| b.digest().unwrap()).collect();
    // Block 1 is served under a forged digest: the hash's first 8 bytes, other bytes after.
    let mut forged = truth[1];
    forged.0[31] ^= 0xff;
    let remote = serving(&[]);
    let dests = remote.manager.allocate_blocks(hs.len()).unwrap();
    let mut complete = Vec::new();
    for (i, (b, h)) in dests.into_iter().zip(&hs).enumerate() {
        for (p, l) in remote.layout.block_addrs(b.block_id(), 0..2) {
            // SAFETY: as in `serving_digests`; the block is ours (mutable).
            let m = unsafe { std::slice::from_raw_parts_mut(p as *mut u8, l) };
            m.fill(i as u8 + 1);
        }
        let digest = match i {
            1 => Some(forged),
            3 => None, // recorded without a digest: the puller's own is used
            _ => Some(truth[i]),
        };
        complete.push(b.complete_with_digest(*h, digest).unwrap());
    }
    drop(remote.manager.register_blocks(complete));
    let srv = DataPlaneServer::start(
        DataPlaneConfig::default(),
        A,
        remote.manager.clone(),
        remote.layout.clone(),
    )
    .await
    .unwrap();

    let known = Arc::new(kvbm_engine::stack::Identities::new(
        hs.iter().copied().zip(truth.iter().copied()),
    ));
    // The index says A holds every block, and a fifth one A does not hold.
    let index = Arc::new(kvbm_engine::cross_instance::CrossInstanceIndex::new());
    let gone = hashes(5)[4];
    let stored = |h: SequenceHash| kvbm_logical::BlockEvent {
        kind: kvbm_logical::BlockEventKind::Stored,
        hash: h,
        tier: kvbm_logical::TierId::G2,
    };
    let events: Vec<_> = hs.iter().chain([&gone]).map(|h| stored(*h)).collect();
    index.apply_events(A, &events);
    let local = side();
    let c = client(&local)
        .with_identities(known)
        .with_index(index.clone());
    let out = pull_into(&c, &local, srv.local_addr(), A, &hs).await;
    let e = out[1].as_ref().unwrap_err();
    assert_eq!(e.kind, BlockFailureKind::IdentityMismatch, "{e}");
    assert!(e.message.contains("block identity"), "{e}");
    for i in [0, 2, 3] {
        let b = out[i].as_ref().unwrap();
        assert_eq!(
            b.digest(),
            Some(truth[i]),
            "block {i} carries the puller's own digest"
        );
        assert_eq!(bytes(&local.layout, b.block_id()), expected(&remote, hs[i]));
    }
    assert_eq!(c.stats().digests_refused, 1);
    drop(out);
    assert!(
        local.manager.match_blocks(&hs[1..2]).is_empty(),
        "never registered"
    );
    // The refused block's entry is forgotten (lookups stop routing it to A); the others stay.
    assert!(index.locations(hs[1]).is_empty());
    for i in [0, 2, 3] {
        assert_eq!(index.locations(hs[i]), vec![(A, kvbm_logical::TierId::G2)]);
    }
    // A block A answers it does not hold is forgotten too.
    let out = pull_into(&c, &local, srv.local_addr(), A, &[gone]).await;
    assert_eq!(
        out[0].as_ref().unwrap_err().kind,
        BlockFailureKind::NotFound
    );
    assert!(index.locations(gone).is_empty());
    assert_eq!(c.stats().entries_forgotten, 2);
    drop(out);

    // A puller that does not know the blocks keeps what the frames name.
    let other = side();
    let c = client(&other);
    let out = pull_into(&c, &other, srv.local_addr(), A, &hs[1..2]).await;
    assert_eq!(out[0].as_ref().unwrap().digest(), Some(forged));
    assert_eq!(c.stats().digests_refused, 0);
}

/// Issue 48's fleet metrics, pull side: a scrape after pulls carries the blocks and bytes
/// pulled (remote hits), the pull's time, the blocks it did not bring by reason, and the
/// index's size per peer (a forgotten entry lowers it).
#[test]
fn a_scrape_shows_what_pulls_brought_and_what_the_index_holds_per_peer() {
    let recorder = metrics_exporter_prometheus::PrometheusBuilder::new().build_recorder();
    let handle = recorder.handle();
    metrics::with_local_recorder(&recorder, || {
        // One thread: the server's tasks and the client report to this thread's recorder.
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async {
            let hs = hashes(4);
            let remote = serving(&hs[..3]);
            let srv = DataPlaneServer::start(
                DataPlaneConfig::default(),
                A,
                remote.manager.clone(),
                remote.layout.clone(),
            )
            .await
            .unwrap();
            let index = Arc::new(kvbm_engine::cross_instance::CrossInstanceIndex::new());
            let events: Vec<_> = hs
                .iter()
                .map(|h| kvbm_logical::BlockEvent {
                    kind: kvbm_logical::BlockEventKind::Stored,
                    hash: *h,
                    tier: kvbm_logical::TierId::G2,
                })
                .collect();
            index.apply_events(A, &events);
            let local = side();
            let c = client(&local).with_index(index.clone());
            // Three held, the fourth not: 3 pulled, 1 not_found (and forgotten).
            let out = pull_into(&c, &local, srv.local_addr(), A, &hs).await;
            assert_eq!(out.iter().filter(|o| o.is_ok()).count(), 3);
        });
    });
    let text = handle.render();
    let value = |series: &str| -> f64 {
        text.lines()
            .find(|l| l.starts_with(series))
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("{series} in\n{text}"))
    };
    assert_eq!(value("kvbm_engine_dataplane_pulled_blocks_total"), 3.0);
    assert_eq!(
        value("kvbm_engine_dataplane_pulled_bytes_total"),
        (3 * block_bytes()) as f64
    );
    assert_eq!(
        value("kvbm_engine_dataplane_pull_failed_blocks_total{reason=\"not_found\"}"),
        1.0
    );
    assert_eq!(value("kvbm_engine_dataplane_pull_seconds_count"), 1.0);
    let peer = format!("kvbm_engine_index_peer_entries{{peer=\"{A}\"}}");
    assert_eq!(value(&peer), 3.0, "4 announced, 1 forgotten");
}
