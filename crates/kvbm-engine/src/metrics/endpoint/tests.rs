//! The endpoint under the second security review's attacks (N1, N2): sockets that connect and
//! send nothing, or one byte, held open and reopened, while a scraper scrapes.

use std::time::Instant;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use super::*;

fn prometheus() -> PrometheusHandle {
    metrics_exporter_prometheus::PrometheusBuilder::new()
        .build_recorder()
        .handle()
}

async fn start(limits: Limits) -> (SocketAddr, Arc<Counters>, CancellationToken) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let counters = Arc::new(Counters::default());
    let cancel = CancellationToken::new();
    tokio::spawn(serve(
        listener,
        prometheus(),
        cancel.clone(),
        limits,
        counters.clone(),
    ));
    (addr, counters, cancel)
}

/// One scrape: the status line, or the error, within 3 s.
async fn scrape(addr: SocketAddr, path: &str) -> Result<String, String> {
    let go = async {
        let mut s = TcpStream::connect(addr).await.map_err(|e| e.to_string())?;
        s.write_all(format!("GET {path} HTTP/1.1\r\nhost: kvbm\r\n\r\n").as_bytes())
            .await
            .map_err(|e| e.to_string())?;
        let mut out = Vec::new();
        s.read_to_end(&mut out).await.map_err(|e| e.to_string())?;
        let text = String::from_utf8_lossy(&out).to_string();
        text.lines()
            .next()
            .map(str::to_string)
            .ok_or_else(|| "closed without an answer".to_string())
    };
    tokio::time::timeout(Duration::from_secs(3), go)
        .await
        .map_err(|_| "timed out".to_string())?
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_are_answered_and_other_paths_are_not_found() {
    let (addr, counters, cancel) = start(Limits::default()).await;
    assert_eq!(scrape(addr, "/metrics").await.unwrap(), "HTTP/1.1 200 OK");
    assert_eq!(
        scrape(addr, "/secret").await.unwrap(),
        "HTTP/1.1 404 Not Found"
    );
    assert_eq!(counters.snapshot().answered, 2);
    cancel.cancel();
}

/// Connects to `addr` from the loopback address `from` (another host, as far as the endpoint
/// can tell).
async fn connect_from(from: &str, addr: SocketAddr) -> std::io::Result<TcpStream> {
    let socket = tokio::net::TcpSocket::new_v4()?;
    socket.bind(format!("{from}:0").parse().unwrap())?;
    socket.connect(addr).await
}

/// N2: more idle sockets than the endpoint has slots, from two other addresses, each sending
/// one byte, held open and reopened the moment they are closed; every scrape in the meantime
/// is answered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_sockets_do_not_starve_a_scrape() {
    let (addr, counters, cancel) = start(Limits::default()).await;
    let stop = CancellationToken::new();
    let mut holders = Vec::new();
    for i in 0..24 {
        let stop = stop.clone();
        let from = if i % 2 == 0 { "127.0.0.2" } else { "127.0.0.3" };
        holders.push(tokio::spawn(async move {
            while !stop.is_cancelled() {
                let Ok(mut s) = connect_from(from, addr).await else {
                    continue;
                };
                let _ = s.write_all(b"G").await;
                let mut b = [0u8; 64];
                // Held until the server closes it (evicted or timed out), then reopened.
                tokio::select! {
                    _ = s.read(&mut b) => {}
                    () = stop.cancelled() => {}
                }
            }
        }));
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    let mut ok = 0;
    for _ in 0..10 {
        match scrape(addr, "/metrics").await {
            Ok(line) if line == "HTTP/1.1 200 OK" => ok += 1,
            other => panic!(
                "a scrape failed while idle sockets were held: {other:?}; {:?}",
                counters.snapshot()
            ),
        }
    }
    assert_eq!(ok, 10);
    assert!(counters.snapshot().evicted > 0, "{:?}", counters.snapshot());
    stop.cancel();
    for h in holders {
        let _ = h.await;
    }
    cancel.cancel();
}

/// N1: a socket that sends nothing is closed after the head timeout, not held.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_socket_is_closed_after_the_head_timeout() {
    let limits = Limits {
        head_timeout: Duration::from_millis(300),
        ..Limits::default()
    };
    let (addr, counters, cancel) = start(limits).await;
    let mut s = TcpStream::connect(addr).await.unwrap();
    let t = Instant::now();
    let mut b = [0u8; 64];
    let n = tokio::time::timeout(Duration::from_secs(3), s.read(&mut b))
        .await
        .expect("closed by the server")
        .unwrap_or(0);
    assert_eq!(n, 0, "no answer to no request");
    assert!(
        t.elapsed() >= Duration::from_millis(250),
        "{:?}",
        t.elapsed()
    );
    assert_eq!(scrape(addr, "/metrics").await.unwrap(), "HTTP/1.1 200 OK");
    assert!(
        counters.snapshot().timed_out >= 1,
        "{:?}",
        counters.snapshot()
    );
    cancel.cancel();
}

#[test]
fn clients_are_addresses_and_ipv6_prefixes() {
    let a: IpAddr = "10.0.0.1".parse().unwrap();
    let b: IpAddr = "10.0.0.2".parse().unwrap();
    assert_ne!(client_of(a), client_of(b));
    let x: IpAddr = "2001:db8::1".parse().unwrap();
    let y: IpAddr = "2001:db8::ffff:2".parse().unwrap();
    let z: IpAddr = "2001:db8:0:1::1".parse().unwrap();
    assert_eq!(client_of(x), client_of(y), "one /64");
    assert_ne!(client_of(x), client_of(z));
    let mapped: IpAddr = "::ffff:10.0.0.1".parse().unwrap();
    assert_eq!(client_of(mapped), client_of(a));
}

#[test]
fn the_waiting_set_evicts_the_oldest_of_a_client_then_overall() {
    let limits = Limits {
        max_connections: 3,
        max_waiting_per_client: 2,
        ..Limits::default()
    };
    let mut w = Waiting::default();
    let t: Vec<CancellationToken> = (0..5).map(|_| CancellationToken::new()).collect();
    assert_eq!(w.admit(0, 1, t[0].clone(), None, &limits), 0);
    assert_eq!(w.admit(1, 1, t[1].clone(), None, &limits), 0);
    // A third from client 1: its oldest goes.
    assert_eq!(w.admit(2, 1, t[2].clone(), None, &limits), 1);
    assert!(t[0].is_cancelled() && !t[1].is_cancelled());
    // Client 2 fills the set; then client 3's arrival evicts the oldest of the client holding
    // the most (client 1: two), not client 2's one.
    assert_eq!(w.admit(3, 2, t[3].clone(), None, &limits), 0);
    assert_eq!(w.admit(4, 3, t[4].clone(), None, &limits), 1);
    assert!(t[1].is_cancelled() && !t[2].is_cancelled() && !t[3].is_cancelled());
    assert!(w.remove(3).is_none(), "admitted without a slot");
    assert_eq!(w.queue.len(), 2);
    assert_eq!(w.per_client.get(&2), None);
}
