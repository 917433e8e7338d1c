//! The Prometheus `/metrics` endpoint: one HTTP server, on hyper, for the engine's runtime and
//! the `kvbm` command (`--metrics-addr`), kept answering while strangers hold sockets open.
//!
//! ```text
//!  accept ─► a slot (at most `max_connections`; none left: closed at once, counted)
//!         ─► unless its whole request head is already buffered, the connection joins the
//!            *waiting* set until its head arrives: the set is capped per client (IPv4 address,
//!            IPv6 /64) and overall; a new connection over the client's cap evicts that
//!            client's oldest waiting one, over the overall cap the oldest of the client
//!            holding the most (counted)
//!         ─► hyper reads the head within `head_timeout` ─► leaves the waiting set
//!         ─► `GET /metrics`: the text exposition; anything else: 404; one request per
//!            connection, the whole of it within `request_timeout`
//! ```
//!
//! Why eviction rather than refusal: an idle socket proves nothing, a scraper sends its head at
//! once. Refusing newcomers when the waiting set is full lets whoever holds idle sockets keep
//! the endpoint (the N1/N2 findings of the second security review); evicting the oldest waiting
//! connection means a scraper's request is read before enough later arrivals can push it out,
//! and an idle socket is held at most until the next arrivals, and never past `head_timeout`.
//! The per-client cap keeps one client's idle sockets from evicting everyone else's.
//!
//! Locks: the waiting set's mutex, alone, never held across an await.

use std::collections::{HashMap, VecDeque};
use std::convert::Infallible;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use bytes::Bytes;
use futures::FutureExt;
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::{TokioIo, TokioTimer};
use metrics_exporter_prometheus::PrometheusHandle;
use parking_lot::Mutex;
use tokio::net::TcpListener;
use tokio::sync::OwnedSemaphorePermit;
use tokio_util::sync::CancellationToken;

/// The endpoint's bounds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    /// Connections open at once (waiting or being answered). At least 1.
    pub max_connections: usize,
    /// Connections waiting for their request head at once, per client. At least 1.
    pub max_waiting_per_client: usize,
    /// Time a connection has to send its request head.
    pub head_timeout: Duration,
    /// Time a connection has for its whole request and answer.
    pub request_timeout: Duration,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_connections: 16,
            max_waiting_per_client: 4,
            head_timeout: Duration::from_secs(2),
            request_timeout: Duration::from_secs(5),
        }
    }
}

/// What the endpoint did (a copy: [`Counters::snapshot`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Stats {
    /// Requests answered (`/metrics` or 404).
    pub answered: u64,
    /// Connections closed at once: `max_connections` were open.
    pub refused: u64,
    /// Waiting connections closed to make room for a newer one.
    pub evicted: u64,
    /// Connections closed for not sending their head, or not finishing, in time.
    pub timed_out: u64,
}

/// The endpoint's live counters.
#[derive(Debug, Default)]
pub struct Counters {
    answered: AtomicU64,
    refused: AtomicU64,
    evicted: AtomicU64,
    timed_out: AtomicU64,
}

impl Counters {
    /// A copy of the counters.
    pub fn snapshot(&self) -> Stats {
        Stats {
            answered: self.answered.load(Ordering::Relaxed),
            refused: self.refused.load(Ordering::Relaxed),
            evicted: self.evicted.load(Ordering::Relaxed),
            timed_out: self.timed_out.load(Ordering::Relaxed),
        }
    }
}

/// Who a connection is from, for the per-client cap: an IPv4 address or an IPv6 /64.
fn client_of(ip: IpAddr) -> u128 {
    match ip {
        IpAddr::V4(v4) => u32::from(v4) as u128,
        IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => u32::from(v4) as u128,
            None => (u128::from(v6) >> 64) << 64 | (1 << 63),
        },
    }
}

/// A connection waiting for its request head: its id, client, cancellation and slot (dropped
/// the moment it is evicted, so the slot is free for the newcomer at once).
type Entry = (u64, u128, CancellationToken, Option<OwnedSemaphorePermit>);

/// Connections still waiting for their request head, oldest first.
#[derive(Default)]
struct Waiting {
    queue: VecDeque<Entry>,
    per_client: HashMap<u128, usize>,
}

impl Waiting {
    /// Takes connection `id` out (its head arrived, or it ended), handing back its slot.
    fn remove(&mut self, id: u64) -> Option<OwnedSemaphorePermit> {
        let i = self.queue.iter().position(|e| e.0 == id)?;
        let (_, client, _, permit) = self.queue.remove(i).expect("found");
        self.forget(client);
        permit
    }

    /// Evicts the oldest waiting connection of the client holding the most (none waiting:
    /// false). One client's sockets never push out another's while it holds more.
    fn evict_one(&mut self) -> bool {
        let Some(most) = self.per_client.values().copied().max() else {
            return false;
        };
        let i = self
            .queue
            .iter()
            .position(|e| self.per_client.get(&e.1).copied() == Some(most))
            .expect("a client holds the most");
        let (_, c, token, permit) = self.queue.remove(i).expect("found");
        self.forget(c);
        token.cancel();
        drop(permit);
        true
    }

    fn forget(&mut self, client: u128) {
        if let Some(n) = self.per_client.get_mut(&client) {
            *n -= 1;
            if *n == 0 {
                self.per_client.remove(&client);
            }
        }
    }

    /// Admits connection `id` of `client` holding `permit`, evicting the oldest waiting
    /// connections over the caps (returns how many).
    fn admit(
        &mut self,
        id: u64,
        client: u128,
        cancel: CancellationToken,
        permit: Option<OwnedSemaphorePermit>,
        limits: &Limits,
    ) -> u64 {
        let mut evicted = 0;
        while self.per_client.get(&client).copied().unwrap_or(0) >= limits.max_waiting_per_client {
            let i = self
                .queue
                .iter()
                .position(|e| e.1 == client)
                .expect("counted");
            let (_, c, token, _permit) = self.queue.remove(i).expect("found");
            self.forget(c);
            token.cancel();
            evicted += 1;
        }
        while self.queue.len() >= limits.max_connections && self.evict_one() {
            evicted += 1;
        }
        self.queue.push_back((id, client, cancel, permit));
        *self.per_client.entry(client).or_default() += 1;
        evicted
    }
}

async fn answer(
    req: Request<Incoming>,
    prometheus: &PrometheusHandle,
) -> Result<Response<Full<Bytes>>, Infallible> {
    let r = if req.method() == Method::GET && req.uri().path() == "/metrics" {
        prometheus.run_upkeep();
        Response::builder()
            .header("content-type", "text/plain; version=0.0.4")
            .body(Full::new(Bytes::from(prometheus.render())))
    } else {
        Response::builder()
            .status(StatusCode::NOT_FOUND)
            .body(Full::new(Bytes::from_static(b"not found\n")))
    };
    Ok(r.expect("a valid response"))
}

/// Serves `/metrics` from `prometheus` on `listener` until `cancel` (see the module docs).
pub async fn serve(
    listener: TcpListener,
    prometheus: PrometheusHandle,
    cancel: CancellationToken,
    limits: Limits,
    counters: Arc<Counters>,
) {
    let limits = Limits {
        max_connections: limits.max_connections.max(1),
        max_waiting_per_client: limits.max_waiting_per_client.max(1),
        ..limits
    };
    let permits = Arc::new(tokio::sync::Semaphore::new(limits.max_connections));
    let waiting = Arc::new(Mutex::new(Waiting::default()));
    let mut next_id = 0u64;
    loop {
        let (stream, peer) = tokio::select! {
            () = cancel.cancelled() => return,
            accepted = listener.accept() => match accepted {
                Ok(a) => a,
                Err(e) => {
                    tracing::warn!(error = %e, "metrics endpoint: accept failed");
                    tokio::time::sleep(Duration::from_millis(10)).await;
                    continue;
                }
            },
        };
        let id = next_id;
        next_id += 1;
        let conn_cancel = cancel.child_token();
        // A connection whose whole request head is already buffered (a scraper writes it as
        // soon as it connects) is not waiting: nobody can evict it.
        let mut peeked = [0u8; 2048];
        let head_buffered = matches!(
            stream.peek(&mut peeked).now_or_never(),
            Some(Ok(n)) if peeked[..n].windows(4).any(|w| w == b"\r\n\r\n")
        );
        // A slot: free, or the one of a waiting connection evicted for it (a connection whose
        // head is here beats one that has sent nothing yet).
        let permit = {
            let mut w = waiting.lock();
            match permits.clone().try_acquire_owned() {
                Ok(p) => Some(p),
                Err(_) if w.evict_one() => {
                    counters.evicted.fetch_add(1, Ordering::Relaxed);
                    permits.clone().try_acquire_owned().ok()
                }
                Err(_) => None,
            }
        };
        let Some(permit) = permit else {
            counters.refused.fetch_add(1, Ordering::Relaxed);
            continue;
        };
        // Until its head arrives the connection's slot sits with it in the waiting set.
        let held = Arc::new(Mutex::new(None));
        if head_buffered {
            *held.lock() = Some(permit);
        } else {
            let evicted = waiting.lock().admit(
                id,
                client_of(peer.ip()),
                conn_cancel.clone(),
                Some(permit),
                &limits,
            );
            counters.evicted.fetch_add(evicted, Ordering::Relaxed);
        }
        let prometheus = prometheus.clone();
        let counters = counters.clone();
        let waiting = waiting.clone();
        tokio::spawn(async move {
            let svc = {
                let waiting = waiting.clone();
                let counters = counters.clone();
                let held = held.clone();
                hyper::service::service_fn(move |req| {
                    // The head arrived: no longer waiting, so never evicted; the slot is ours.
                    if let Some(p) = waiting.lock().remove(id) {
                        *held.lock() = Some(p);
                    }
                    counters.answered.fetch_add(1, Ordering::Relaxed);
                    let prometheus = prometheus.clone();
                    async move { answer(req, &prometheus).await }
                })
            };
            let conn = hyper::server::conn::http1::Builder::new()
                .timer(TokioTimer::new())
                .header_read_timeout(limits.head_timeout)
                .keep_alive(false)
                .serve_connection(TokioIo::new(stream), svc);
            tokio::select! {
                () = conn_cancel.cancelled() => {}
                r = tokio::time::timeout(limits.request_timeout, conn) => match r {
                    Ok(Ok(())) => {}
                    Ok(Err(e)) => {
                        if e.is_timeout() {
                            counters.timed_out.fetch_add(1, Ordering::Relaxed);
                        }
                        tracing::debug!(error = %e, "metrics endpoint: connection failed");
                    }
                    Err(_) => {
                        counters.timed_out.fetch_add(1, Ordering::Relaxed);
                    }
                },
            }
            drop(waiting.lock().remove(id));
            drop(held);
        });
    }
}

/// Binds `addr` and serves `/metrics` from `prometheus` on a thread of its own (with its own
/// single-threaded runtime) until the process ends: for a process without a tokio runtime, as
/// the `kvbm` command. Returns the bound address and the counters.
pub fn serve_on_thread(
    addr: &str,
    prometheus: PrometheusHandle,
    limits: Limits,
) -> std::io::Result<(SocketAddr, Arc<Counters>)> {
    let std_listener = std::net::TcpListener::bind(addr)?;
    std_listener.set_nonblocking(true)?;
    let local = std_listener.local_addr()?;
    let counters = Arc::new(Counters::default());
    let c = counters.clone();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    std::thread::Builder::new()
        .name("kvbm-metrics".into())
        .spawn(move || {
            runtime.block_on(async move {
                match TcpListener::from_std(std_listener) {
                    Ok(listener) => {
                        serve(listener, prometheus, CancellationToken::new(), limits, c).await
                    }
                    Err(e) => tracing::error!(error = %e, "metrics endpoint: cannot listen"),
                }
            })
        })?;
    Ok((local, counters))
}

#[cfg(test)]
mod tests;
