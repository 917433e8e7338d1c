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
use kvbm_physical::{BlockLayout, LayoutKind, PhysicalLayout, PinPolicy};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

use super::wire::{self, REQUEST_HEAD_LEN, RESPONSE_HEAD_LEN, RequestHead, Status};
use super::*;
use crate::cross_instance::RemotePull;

const N: usize = 8;
const A: InstanceId = InstanceId(0xa);

fn geometry() -> BlockLayout {
    BlockLayout::builder()
        .num_blocks(N)
        .num_layers(2)
        .outer_dim(2)
        .page_size(16)
        .inner_dim(64)
        .dtype_bytes(2)
        .kind(LayoutKind::FullyContiguous)
        .build()
        .unwrap()
}

fn hashes(n: usize) -> Vec<SequenceHash> {
    let tokens: Vec<u32> = (0..(n as u32 * 4)).collect();
    TokenBlockSequence::from_tokens(&tokens, 4, Salt::NONE)
        .unwrap()
        .hashes()
}

fn bytes(layout: &PhysicalLayout, b: usize) -> Vec<u8> {
    let mut out = Vec::new();
    for (p, l) in layout.block_addrs(b, 0..2) {
        // SAFETY: host memory owned by the test; no transfer targets it meanwhile.
        out.extend_from_slice(unsafe { std::slice::from_raw_parts(p as *const u8, l) });
    }
    out
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

async fn eventually(what: &str, f: impl Fn() -> bool) {
    for _ in 0..200 {
        if f() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("never: {what}");
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
    eventually("holds released", || srv.stats().held() == 0).await;
    assert_eq!(srv.stats().blocks_served(), 4);

    // The connection was pooled and is reused for a second pull.
    let dests = local.manager.allocate_blocks(1).unwrap();
    let out = c.pull(A, &hs[4..5], dests).await;
    assert!(out[0].is_ok(), "{:?}", out[0].as_ref().err());
    assert_eq!(srv.stats().connections(), 1);
    assert!(local.manager.check_invariants().is_ok());
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
    // SAFETY: `payload` is readable for the call.
    let header =
        unsafe { wire::frame_header(hash, A, g, &[(payload.as_ptr() as usize, payload.len())]) };
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
    eventually("holds released after the client died", || {
        srv.stats().held() == 0
    })
    .await;
    eventually("connections closed", || srv.stats().connections() == 0).await;

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
    let t = crate::config::TransportConfig {
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
    let bad = crate::config::TransportConfig {
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

async fn eventually_for(limit: Duration, what: &str, f: impl Fn() -> bool) {
    let start = std::time::Instant::now();
    while start.elapsed() < limit {
        if f() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(f(), "never within {limit:?}: {what}");
}

/// A pull of every hash of `hs` from `srv` into a fresh side: all must arrive.
async fn assert_serves(srv: &DataPlaneServer, hs: &[SequenceHash]) {
    let local = side();
    let c = client(&local);
    let dests = local.manager.allocate_blocks(hs.len()).unwrap();
    let out = c.pull_from(srv.local_addr(), A, hs, dests).await;
    assert!(out.iter().all(Result::is_ok), "{out:?}");
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
    let idle1 = TcpStream::connect(srv.local_addr()).await.unwrap();
    let idle2 = TcpStream::connect(srv.local_addr()).await.unwrap();
    eventually("two connections served", || srv.stats().connections() == 2).await;
    let mut extra = TcpStream::connect(srv.local_addr()).await.unwrap();
    let mut buf = [0u8; 1];
    let r = tokio::time::timeout(Duration::from_secs(3), extra.read(&mut buf))
        .await
        .expect("the connection over the cap is closed at once");
    assert!(matches!(r, Ok(0) | Err(_)), "{r:?}");
    assert_eq!(srv.stats().connections_refused(), 1);
    assert_eq!(srv.stats().connections(), 2);
    drop(idle1);
    eventually("a slot freed", || srv.stats().connections() == 1).await;
    assert_serves(&srv, &hs).await;
    drop(idle2);
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
    eventually("the blocks are held", || srv.stats().held() == N).await;
    eventually_for(
        Duration::from_secs(10),
        "holds released at the deadline",
        || srv.stats().held() == 0,
    )
    .await;
    assert!(started.elapsed() < Duration::from_secs(8));
    assert_eq!(srv.stats().responses_timed_out(), 1);
    // The server dropped its end (what the kernel buffered may still trickle to the reader).
    eventually("connection gone", || srv.stats().connections() == 0).await;
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
    eventually("the server saw them close", || {
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
