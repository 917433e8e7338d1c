//! Control messages over NATS request/reply (feature `nats`): [`WorkerServer`] answers a
//! worker's control subject, [`NatsControl`] is the leader's [`WorkerControl`] for one remote
//! worker, and [`connect`] opens a client that reconnects on its own.
//!
//! # Wire
//!
//! Subject: [`WorkerAddress::control_subject`] (`kvbm.ctl.{instance}.worker.{rank}` with the
//! default prefix). Payload: an [`Envelope`] encoded as JSON, request and reply alike. A
//! request is answered in its own version (see [`control`](super::control) for what each
//! version carries); one that cannot be decoded, or is of a version this build does not speak,
//! is answered with [`ControlResponse::Refused`] in this build's version, so the leader learns
//! why.
//!
//! # Failure
//!
//! Each request has its own deadline ([`NatsControl::with_timeout`], default
//! `transport.request_timeout_ms`). A worker that died before the request was sent is reported
//! at once as [`ControlError::NoResponders`] (the server knows nobody subscribes); one that
//! died after receiving it is reported as [`ControlError::Timeout`] when the deadline passes.
//!
//! # Concurrency
//!
//! A worker handles each request in its own task, so a long transfer does not hold up a
//! `Describe`. At most [`WorkerServer::max_in_flight`] requests are served at once
//! (`transport.worker_max_in_flight`, default 256; a semaphore): one more is answered
//! [`ControlResponse::Refused`] at once, without a task, and counted in
//! [`WorkerServerStats::refused_busy`]. No lock is taken here.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use async_nats::{Client, RequestErrorKind};
use futures::StreamExt;
use futures::future::BoxFuture;
use kvbm_logical::TierId;

use super::WorkerAddress;
use super::control::{
    ControlError, ControlRequest, ControlResponse, Envelope, OLDEST_PROTOCOL_VERSION,
    PROTOCOL_VERSION, WorkerControl, serve, speaks,
};
use crate::error::{EngineError, Result};
use crate::worker::PhysicalWorker;

/// Default prefix of control subjects.
pub const DEFAULT_CONTROL_PREFIX: &str = "kvbm.ctl";

/// Opens a NATS client named `name` on `url`, returning once it is connected (so what it
/// subscribes next is in place before anything else is published); after a loss it reconnects
/// forever, waiting at most `max_reconnect_delay` between attempts.
///
/// # Errors
/// [`EngineError::Nats`] when the url is malformed or the server cannot be reached now.
pub async fn connect(url: &str, name: &str, max_reconnect_delay: Duration) -> Result<Client> {
    let cap = max_reconnect_delay.max(Duration::from_millis(10));
    async_nats::ConnectOptions::new()
        .name(name)
        .max_reconnects(None)
        .reconnect_delay_callback(move |attempts| {
            (Duration::from_millis(20) * attempts.min(50) as u32).min(cap)
        })
        .connect(url)
        .await
        .map_err(|e| EngineError::Nats {
            url: url.to_string(),
            message: e.to_string(),
        })
}

/// As [`connect`], also returning a counter of (re)connections: it is 1 once connected and
/// goes up by one each time the client reconnects after a loss, so a watcher can resync what
/// it may have missed while the server was away.
///
/// # Errors
/// As [`connect`].
pub async fn connect_observed(
    url: &str,
    name: &str,
    max_reconnect_delay: Duration,
) -> Result<(Client, tokio::sync::watch::Receiver<u64>)> {
    let cap = max_reconnect_delay.max(Duration::from_millis(10));
    let (tx, rx) = tokio::sync::watch::channel(0u64);
    let tx = Arc::new(tx);
    let client = async_nats::ConnectOptions::new()
        .name(name)
        .max_reconnects(None)
        .reconnect_delay_callback(move |attempts| {
            (Duration::from_millis(20) * attempts.min(50) as u32).min(cap)
        })
        .event_callback(move |event| {
            let tx = tx.clone();
            async move {
                if matches!(event, async_nats::Event::Connected) {
                    tx.send_modify(|n| *n += 1);
                }
            }
        })
        .connect(url)
        .await
        .map_err(|e| EngineError::Nats {
            url: url.to_string(),
            message: e.to_string(),
        })?;
    Ok((client, rx))
}

/// The version of an envelope, read before its body: a body of another version may not
/// decode at all. (Decoding through `serde_json::Value` would lose the 128-bit hashes.)
#[derive(serde::Deserialize)]
struct VersionOnly {
    version: u32,
}

/// Why an envelope was not decoded.
enum Undecoded {
    /// Of a version this build does not speak.
    Version(u32),
    /// Not an envelope of its version (the decoder's complaint).
    Malformed(String),
}

/// Decodes an envelope of a version this build speaks ([`speaks`]): its version and body.
fn decode_envelope<T: serde::de::DeserializeOwned>(
    payload: &[u8],
) -> std::result::Result<(u32, T), Undecoded> {
    let malformed = |e: serde_json::Error| Undecoded::Malformed(e.to_string());
    let v: VersionOnly = serde_json::from_slice(payload).map_err(malformed)?;
    if !speaks(v.version) {
        return Err(Undecoded::Version(v.version));
    }
    let env: Envelope<T> = serde_json::from_slice(payload).map_err(malformed)?;
    Ok((env.version, env.body))
}

fn encode<T: serde::Serialize>(version: u32, body: T) -> bytes::Bytes {
    // Serializing these plain data types to JSON cannot fail (no maps with non-string keys,
    // no foreign Serialize impls).
    serde_json::to_vec(&Envelope::in_version(version, body))
        .expect("control messages serialize")
        .into()
}

/// Called with each request a [`WorkerServer`] receives, before it is served.
pub type RequestHook = Arc<dyn Fn(&ControlRequest) + Send + Sync>;

/// Counters of a [`WorkerServer`].
#[derive(Debug, Default)]
pub struct WorkerServerStats {
    served: AtomicU64,
    refused_busy: AtomicU64,
    in_flight: AtomicU64,
}

impl WorkerServerStats {
    /// Requests answered by serving them (including undecodable ones, answered `Refused`).
    pub fn served(&self) -> u64 {
        self.served.load(Ordering::Relaxed)
    }
    /// Requests answered `Refused` without being served: `max_in_flight` were in flight.
    pub fn refused_busy(&self) -> u64 {
        self.refused_busy.load(Ordering::Relaxed)
    }
    /// Requests being served now.
    pub fn in_flight(&self) -> u64 {
        self.in_flight.load(Ordering::Acquire)
    }
}

/// Answers control requests for one worker: see the [module docs](self).
pub struct WorkerServer {
    client: Client,
    prefix: String,
    address: WorkerAddress,
    worker: Arc<PhysicalWorker>,
    on_request: Option<RequestHook>,
    delay: Option<(TierId, Duration)>,
    max_in_flight: usize,
    stats: Arc<WorkerServerStats>,
}

impl std::fmt::Debug for WorkerServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WorkerServer")
            .field("address", &self.address)
            .field("prefix", &self.prefix)
            .field("delay", &self.delay)
            .finish()
    }
}

impl WorkerServer {
    /// Serves `worker` as `address` on `client`, under `prefix`.
    pub fn new(
        client: Client,
        prefix: &str,
        address: WorkerAddress,
        worker: Arc<PhysicalWorker>,
    ) -> Self {
        Self {
            client,
            prefix: prefix.to_string(),
            address,
            worker,
            on_request: None,
            delay: None,
            max_in_flight: crate::config::TransportConfig::default().worker_max_in_flight,
            stats: Arc::new(WorkerServerStats::default()),
        }
    }

    /// Serves at most `n` requests at once (at least 1); one more is answered `Refused` and
    /// counted. Default: `transport.worker_max_in_flight`'s default (256).
    pub fn max_in_flight(mut self, n: usize) -> Self {
        self.max_in_flight = n.max(1);
        self
    }

    /// Its counters (shared with the serving task once started).
    pub fn stats(&self) -> Arc<WorkerServerStats> {
        self.stats.clone()
    }

    /// Calls `hook` with each decoded request before serving it (logging, tests).
    pub fn on_request(mut self, hook: RequestHook) -> Self {
        self.on_request = Some(hook);
        self
    }

    /// Fault injection for tests: waits `delay` before running any transfer out of `src`, so a
    /// test can kill the process while a transfer is in flight.
    pub fn delay_transfers_from(mut self, src: TierId, delay: Duration) -> Self {
        self.delay = Some((src, delay));
        self
    }

    /// Subscribes the worker's control subject and answers every request, each in its own
    /// task, until `cancel` fires (or the client closes). Returns once subscribed, so a leader
    /// can reach the worker as soon as this returns.
    ///
    /// # Errors
    /// [`EngineError::Nats`] when the subscription fails.
    pub async fn start(
        self,
        cancel: tokio_util::sync::CancellationToken,
    ) -> Result<tokio::task::JoinHandle<()>> {
        let Self {
            client,
            prefix,
            address,
            worker,
            on_request,
            delay,
            max_in_flight,
            stats,
        } = self;
        let permits = Arc::new(tokio::sync::Semaphore::new(max_in_flight));
        let subject = address.control_subject(&prefix);
        let nats_err = |e: &dyn std::fmt::Display| EngineError::Nats {
            url: subject.clone(),
            message: e.to_string(),
        };
        let mut sub = client
            .subscribe(subject.clone())
            .await
            .map_err(|e| nats_err(&e))?;
        client.flush().await.map_err(|e| nats_err(&e))?;
        Ok(tokio::spawn(async move {
            loop {
                let message = tokio::select! {
                    () = cancel.cancelled() => return,
                    m = sub.next() => match m {
                        Some(m) => m,
                        None => return,
                    },
                };
                let Some(reply) = message.reply.clone() else {
                    tracing::warn!(%address, "control message without a reply subject ignored");
                    continue;
                };
                // The bound: a request beyond it is refused here, without a task of its own.
                let Ok(permit) = permits.clone().try_acquire_owned() else {
                    stats.refused_busy.fetch_add(1, Ordering::Relaxed);
                    metrics::counter!("kvbm_engine_worker_requests_refused_busy_total")
                        .increment(1);
                    let version = decode_envelope::<serde::de::IgnoredAny>(&message.payload)
                        .map_or(PROTOCOL_VERSION, |(v, _)| v);
                    let response = ControlResponse::Refused(format!(
                        "worker busy: {max_in_flight} requests in flight \
                         (transport.worker_max_in_flight)"
                    ));
                    if let Err(e) = client.publish(reply, encode(version, response)).await {
                        tracing::warn!(%address, error = %e, "control reply not sent");
                    }
                    continue;
                };
                let (client, worker, hook) = (client.clone(), worker.clone(), on_request.clone());
                let stats = stats.clone();
                stats.in_flight.fetch_add(1, Ordering::AcqRel);
                tokio::spawn(async move {
                    let _permit = permit;
                    let (version, response) = match decode_envelope::<ControlRequest>(
                        &message.payload,
                    ) {
                        Err(Undecoded::Malformed(e)) => (
                            PROTOCOL_VERSION,
                            ControlResponse::Refused(format!("undecodable request: {e}")),
                        ),
                        Err(Undecoded::Version(v)) => (
                            PROTOCOL_VERSION,
                            ControlResponse::Refused(format!(
                                "protocol version {v} not spoken (this worker speaks {OLDEST_PROTOCOL_VERSION} to {PROTOCOL_VERSION})"
                            )),
                        ),
                        Ok((version, request)) => {
                            if let Some(hook) = &hook {
                                hook(&request);
                            }
                            if let (ControlRequest::Transfer(t), Some((src, d))) = (&request, delay)
                                && t.src == src
                            {
                                tokio::time::sleep(d).await;
                            }
                            let response = serve(&worker, address, request).await;
                            (version, response.for_version(version))
                        }
                    };
                    if let Err(e) = client.publish(reply, encode(version, response)).await {
                        tracing::warn!(%address, error = %e, "control reply not sent");
                    }
                    stats.served.fetch_add(1, Ordering::Relaxed);
                    stats.in_flight.fetch_sub(1, Ordering::AcqRel);
                });
            }
        }))
    }
}

/// The leader's handle on one worker in another process: see the [module docs](self).
#[derive(Clone, Debug)]
pub struct NatsControl {
    address: WorkerAddress,
    client: Client,
    subject: String,
    timeout: Duration,
}

impl NatsControl {
    /// The worker at `address`, reached on `client` under `prefix`, each request timing out
    /// after `timeout`.
    pub fn new(client: Client, prefix: &str, address: WorkerAddress, timeout: Duration) -> Self {
        Self {
            subject: address.control_subject(prefix),
            address,
            client,
            timeout,
        }
    }

    /// The same worker with another per-request deadline.
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    async fn request(&self, request: ControlRequest) -> Result<ControlResponse, ControlError> {
        let worker = self.address;
        let timeout_ms = self.timeout.as_millis() as u64;
        let sent = self
            .client
            .request(self.subject.clone(), encode(PROTOCOL_VERSION, request));
        let message = match tokio::time::timeout(self.timeout, sent).await {
            Err(_) => return Err(ControlError::Timeout { worker, timeout_ms }),
            Ok(Err(e)) => {
                return Err(match e.kind() {
                    RequestErrorKind::TimedOut => ControlError::Timeout { worker, timeout_ms },
                    RequestErrorKind::NoResponders => ControlError::NoResponders { worker },
                    _ => ControlError::Transport {
                        worker,
                        message: e.to_string(),
                    },
                });
            }
            Ok(Ok(m)) => m,
        };
        match decode_envelope::<ControlResponse>(&message.payload) {
            Err(Undecoded::Malformed(message)) => Err(ControlError::Decode { worker, message }),
            Err(Undecoded::Version(got)) => Err(ControlError::Version {
                worker,
                expected: PROTOCOL_VERSION,
                got,
            }),
            Ok((_, ControlResponse::Refused(message))) => {
                Err(ControlError::Refused { worker, message })
            }
            Ok((_, r)) => Ok(r),
        }
    }
}

impl WorkerControl for NatsControl {
    fn address(&self) -> WorkerAddress {
        self.address
    }

    fn call(
        &self,
        request: ControlRequest,
    ) -> BoxFuture<'_, Result<ControlResponse, ControlError>> {
        Box::pin(self.request(request))
    }
}

/// [`decode_envelope`] for the fuzz target (see [`cluster::fuzzing`](crate::cluster::fuzzing)):
/// whether `payload` decoded.
#[doc(hidden)]
pub(crate) fn fuzz_decode_envelope<T: serde::de::DeserializeOwned>(payload: &[u8]) -> bool {
    decode_envelope::<T>(payload).is_ok()
}
