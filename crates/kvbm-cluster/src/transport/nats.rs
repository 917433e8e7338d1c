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
//! # Authentication
//!
//! With [`Security::On`] (a credential and the trust root) every request is sealed by the
//! leader for the context `kvbm/ctl/<control subject>`, and every reply by the worker for
//! `kvbm/ctl-reply/` ‖ BLAKE3(the sealed request's bytes), so a reply answers exactly one
//! request ([`reply_context`]). A worker obeys only a request that opens and comes from
//! [`Role::Leader`] of its own instance; anything else is dropped without an answer and
//! counted ([`WorkerServerStats::rejected`], and the verifier's [`SecurityStats`] by kind,
//! [`Rejection::NotAllowed`] for a member that may not drive it). The leader reads its reply
//! inbox until the first reply that opens and comes from [`Role::Worker`] of its own instance
//! at the addressed rank (or the deadline): a forged answer published first is dropped and
//! counted ([`NatsControl::rejected`]), never taken. With [`Security::Off`] the wire is the
//! plain JSON envelope, as before.
//!
//! The server's "no responders" status (a reply header, not a sealed message) still ends a
//! request at once: at worst a client that can publish to the leader's inbox makes a request
//! fail early (denial of service, never a wrong answer); operators deny `_INBOX.>` publishes
//! to non-members (`docs/security.md`).
//!
//! [`SecurityStats`]: crate::security::SecurityStats
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
    PROTOCOL_VERSION, RankTarget, WorkerControl, serve, speaks,
};
use super::membership::Membership;
use crate::security::{MemberCert, Rejection, Role, Security};
use kvbm_engine::config::{NatsAuthConfig, check_nats_url, redact_url};
use kvbm_engine::error::{EngineError, Result};
use kvbm_engine::worker::PhysicalWorker;

/// Default prefix of control subjects.
pub const DEFAULT_CONTROL_PREFIX: &str = "kvbm.ctl";

/// Opens a NATS client named `name` on `url`, returning once it is connected (so what it
/// subscribes next is in place before anything else is published); after a loss it reconnects
/// forever, waiting at most `max_reconnect_delay` between attempts. No credentials: a loopback
/// server without authentication (tests); a cluster connects with [`connect_with`].
///
/// # Errors
/// As [`connect_with`].
pub async fn connect(url: &str, name: &str, max_reconnect_delay: Duration) -> Result<Client> {
    connect_with(url, &NatsAuthConfig::default(), name, max_reconnect_delay).await
}

/// As [`connect`], authenticating with `auth` (`[transport.nats_auth]`: credentials file, nkey
/// seed, token, user and password, CA, client certificate, TLS required). Secret files are
/// read here, at each connect, so a rotated file is picked up by the next process.
///
/// No error names a secret: the url's userinfo is refused ([`check_nats_url`]), the url is
/// printed redacted, and the client library's message is scrubbed of every secret read.
///
/// # Errors
/// [`EngineError::Config`] naming the key when the url carries userinfo, `auth` is invalid or
/// a file it names cannot be read; [`EngineError::Nats`] when the server cannot be reached
/// now or refuses the connection (the message says what is missing: no credentials, which
/// credential the server refused, or the CA to check its certificate with).
pub async fn connect_with(
    url: &str,
    auth: &NatsAuthConfig,
    name: &str,
    max_reconnect_delay: Duration,
) -> Result<Client> {
    let (options, secrets) = client_options(url, auth, name, max_reconnect_delay).await?;
    options
        .connect(url)
        .await
        .map_err(|e| connect_error(url, auth, &secrets, &e))
}

/// As [`connect`], also returning a counter of (re)connections: it is 1 once connected and
/// goes up by one each time the client reconnects after a loss, so a watcher can resync what
/// it may have missed while the server was away.
///
/// # Errors
/// As [`connect_with`].
pub async fn connect_observed(
    url: &str,
    name: &str,
    max_reconnect_delay: Duration,
) -> Result<(Client, tokio::sync::watch::Receiver<u64>)> {
    connect_observed_with(url, &NatsAuthConfig::default(), name, max_reconnect_delay).await
}

/// As [`connect_observed`], authenticating with `auth` (see [`connect_with`]).
///
/// # Errors
/// As [`connect_with`].
pub async fn connect_observed_with(
    url: &str,
    auth: &NatsAuthConfig,
    name: &str,
    max_reconnect_delay: Duration,
) -> Result<(Client, tokio::sync::watch::Receiver<u64>)> {
    let (tx, rx) = tokio::sync::watch::channel(0u64);
    let tx = Arc::new(tx);
    let (options, secrets) = client_options(url, auth, name, max_reconnect_delay).await?;
    let client = options
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
        .map_err(|e| connect_error(url, auth, &secrets, &e))?;
    Ok((client, rx))
}

/// The client's options for `auth`, and every secret it read (to scrub from messages).
async fn client_options(
    url: &str,
    auth: &NatsAuthConfig,
    name: &str,
    max_reconnect_delay: Duration,
) -> Result<(async_nats::ConnectOptions, Vec<String>)> {
    const P: &str = "transport.nats_auth";
    check_nats_url("transport.nats_url", url)?;
    auth.validate()?;
    let private = |key: &str, path: &std::path::Path| -> Result<()> {
        crate::security::check_private(path)
            .map_err(|e| EngineError::config(format!("{P}.{key}"), e.to_string()))
    };
    let read = |key: &str, path: &std::path::Path| -> Result<String> {
        private(key, path)?;
        let text = std::fs::read_to_string(path).map_err(|e| {
            EngineError::config(format!("{P}.{key}"), format!("{}: {e}", path.display()))
        })?;
        let text = text.trim_end_matches(['\r', '\n']).to_string();
        if text.is_empty() {
            return Err(EngineError::config(
                format!("{P}.{key}"),
                format!("{} is empty", path.display()),
            ));
        }
        Ok(text)
    };
    let exists = |key: &str, path: &std::path::Path| -> Result<()> {
        if path.is_file() {
            Ok(())
        } else {
            Err(EngineError::config(
                format!("{P}.{key}"),
                format!("{} is not a readable file", path.display()),
            ))
        }
    };
    // Two rustls providers are linked (ring for async-nats, aws-lc-rs for the S3 client), so
    // rustls cannot pick one itself and would panic at the first TLS handshake: pick ring,
    // unless the process already chose.
    if rustls::crypto::CryptoProvider::get_default().is_none() {
        let _ = rustls::crypto::ring::default_provider().install_default();
    }
    let cap = max_reconnect_delay.max(Duration::from_millis(10));
    let mut options = async_nats::ConnectOptions::new()
        .name(name)
        .max_reconnects(None)
        .reconnect_delay_callback(move |attempts| {
            (Duration::from_millis(20) * attempts.min(50) as u32).min(cap)
        });
    let mut secrets = Vec::new();
    if let Some(path) = &auth.creds_file {
        let creds = read("creds_file", path)?;
        options = options.credentials(&creds).map_err(|e| {
            EngineError::config(
                format!("{P}.creds_file"),
                format!(
                    "{}: not a NATS credentials file ({})",
                    path.display(),
                    e.kind()
                ),
            )
        })?;
        secrets.extend(creds.lines().map(str::trim).map(str::to_string));
    }
    if let Some(path) = &auth.nkey_file {
        let seed = read("nkey_file", path)?;
        secrets.push(seed.clone());
        options = options.nkey(seed);
    }
    let token = match (&auth.token, &auth.token_file) {
        (Some(t), _) => Some(t.expose().to_string()),
        (None, Some(path)) => Some(read("token_file", path)?),
        (None, None) => None,
    };
    if let Some(token) = token {
        secrets.push(token.clone());
        options = options.token(token);
    }
    if let Some(user) = &auth.user {
        let password = match (&auth.password, &auth.password_file) {
            (Some(p), _) => p.expose().to_string(),
            (None, Some(path)) => read("password_file", path)?,
            (None, None) => unreachable!("validate: a user has a password"),
        };
        secrets.push(password.clone());
        options = options.user_and_password(user.clone(), password);
    }
    if let Some(ca) = &auth.ca_file {
        exists("ca_file", ca)?;
        options = options.add_root_certificates(ca.clone());
    }
    if let (Some(cert), Some(key)) = (&auth.cert_file, &auth.key_file) {
        exists("cert_file", cert)?;
        exists("key_file", key)?;
        private("key_file", key)?;
        options = options.add_client_certificate(cert.clone(), key.clone());
    }
    if auth.require_tls {
        options = options.require_tls(true);
    }
    // Short secrets would scrub ordinary words from messages; they are not echoed anyway.
    secrets.retain(|s| s.len() >= 4);
    Ok((options, secrets))
}

/// The error of a failed connect: the url without userinfo, the client's message without any
/// secret, and what to do about it.
fn connect_error(
    url: &str,
    auth: &NatsAuthConfig,
    secrets: &[String],
    e: &async_nats::ConnectError,
) -> EngineError {
    use async_nats::ConnectErrorKind as K;
    let mut message = e.to_string();
    for s in secrets {
        message = message.replace(s.as_str(), kvbm_engine::config::REDACTED);
    }
    // A refused certificate comes as an IO error of the handshake.
    let lower = message.to_ascii_lowercase();
    let tls = matches!(e.kind(), K::Tls) || lower.contains("certificate") || lower.contains("tls");
    let hint = match (e.kind(), auth.method()) {
        (K::AuthorizationViolation | K::Authentication, None) => {
            " (the server requires credentials and none are configured: set \
             transport.nats_auth.creds_file, nkey_file, token_file, user with password_file, \
             or cert_file with key_file)"
                .to_string()
        }
        (K::AuthorizationViolation | K::Authentication, Some(method)) => format!(
            " (the server refused the credentials of transport.nats_auth.{method}, or this \
             user may not connect)"
        ),
        _ if tls && auth.ca_file.is_none() => " (TLS: set transport.nats_auth.ca_file to \
             the CA that signed the server's certificate, and cert_file with key_file when the \
             server verifies clients)"
            .to_string(),
        _ if tls => " (TLS: check transport.nats_auth.ca_file, and cert_file with \
             key_file when the server verifies clients)"
            .to_string(),
        _ => String::new(),
    };
    EngineError::Nats {
        url: redact_url(url),
        message: format!("{message}{hint}"),
    }
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

/// Decodes an envelope of a version this build speaks ([`speaks`]).
fn decode_envelope<T: serde::de::DeserializeOwned>(
    payload: &[u8],
) -> std::result::Result<Envelope<T>, Undecoded> {
    let malformed = |e: serde_json::Error| Undecoded::Malformed(e.to_string());
    let v: VersionOnly = serde_json::from_slice(payload).map_err(malformed)?;
    if !speaks(v.version) {
        return Err(Undecoded::Version(v.version));
    }
    serde_json::from_slice(payload).map_err(malformed)
}

fn encode<T: serde::Serialize>(version: u32, body: T) -> bytes::Bytes {
    encode_envelope(&Envelope::in_version(version, body))
}

fn encode_envelope<T: serde::Serialize>(envelope: &Envelope<T>) -> bytes::Bytes {
    // Serializing these plain data types to JSON cannot fail (no maps with non-string keys,
    // no foreign Serialize impls).
    serde_json::to_vec(envelope)
        .expect("control messages serialize")
        .into()
}

/// A fresh incarnation number (never 0).
fn new_epoch() -> u64 {
    let bytes = crate::security::random32().unwrap_or_else(|_| {
        // No random source: the clock still tells incarnations of one machine apart.
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(1, |d| d.as_nanos());
        let mut b = [0u8; 32];
        b[..16].copy_from_slice(&nanos.to_le_bytes());
        b
    });
    u64::from_le_bytes(bytes[..8].try_into().expect("8 bytes")).max(1)
}

/// The context a control request to `subject` is sealed for.
pub fn control_context(subject: &str) -> Vec<u8> {
    format!("kvbm/ctl/{subject}").into_bytes()
}

/// The context of an answer to the sealed request `request`: `kvbm/<kind>/` followed by the
/// BLAKE3 hash of the request's bytes, so an answer opens only for the request it answers
/// (`kind`: `ctl-reply` for control, `snapshot-reply` for snapshot pages).
pub fn reply_context(kind: &str, request: &[u8]) -> Vec<u8> {
    let mut c = format!("kvbm/{kind}/").into_bytes();
    c.extend_from_slice(blake3::hash(request).as_bytes());
    c
}

/// How a request read on its own inbox ended ([`request_first_valid`]).
#[derive(Debug)]
pub(crate) enum InboxReply<T> {
    /// The first answer `accept` took.
    Valid(T),
    /// The server said nobody subscribes the subject.
    NoResponders,
    /// No acceptable answer before the deadline.
    TimedOut,
    /// The client failed (subscribe or publish).
    Transport(String),
}

/// Publishes `payload` on `subject` with a fresh inbox as its reply subject and reads that
/// inbox until `accept` takes an answer (it returns `None` for one it drops, and counts it), or
/// `timeout` passes. Unlike a plain request, a forged answer published first does not win.
pub(crate) async fn request_first_valid<T>(
    client: &Client,
    subject: String,
    payload: bytes::Bytes,
    timeout: Duration,
    mut accept: impl FnMut(&[u8]) -> Option<T>,
) -> InboxReply<T> {
    let deadline = tokio::time::Instant::now() + timeout;
    let inbox = client.new_inbox();
    let mut sub = match client.subscribe(inbox.clone()).await {
        Ok(s) => s,
        Err(e) => return InboxReply::Transport(e.to_string()),
    };
    if let Err(e) = client.publish_with_reply(subject, inbox, payload).await {
        return InboxReply::Transport(e.to_string());
    }
    loop {
        let m = match tokio::time::timeout_at(deadline, sub.next()).await {
            Err(_) => return InboxReply::TimedOut,
            Ok(None) => return InboxReply::Transport("reply subscription closed".into()),
            Ok(Some(m)) => m,
        };
        if m.status == Some(async_nats::StatusCode::NO_RESPONDERS) {
            return InboxReply::NoResponders;
        }
        if let Some(t) = accept(&m.payload) {
            return InboxReply::Valid(t);
        }
    }
}

/// Whether `sender` may drive the worker at `address`: its own instance's leader.
fn may_drive(sender: &MemberCert, address: WorkerAddress) -> bool {
    sender.role == Role::Leader && sender.instance == address.instance
}

/// Whether `sender` may answer for the worker at `address`: that very worker.
fn may_answer(sender: &MemberCert, address: WorkerAddress) -> bool {
    sender.role == Role::Worker
        && sender.instance == address.instance
        && sender.rank == address.rank
}

/// Called with each request a [`WorkerServer`] receives, before it is served.
pub type RequestHook = Arc<dyn Fn(&ControlRequest) + Send + Sync>;

/// Counters of a [`WorkerServer`].
#[derive(Debug, Default)]
pub struct WorkerServerStats {
    served: AtomicU64,
    refused_busy: AtomicU64,
    in_flight: AtomicU64,
    rejected: AtomicU64,
}

/// One request counted in [`WorkerServerStats::in_flight`] for as long as this lives: the
/// serving task holds it, so the count falls when the task ends however it ends (a panic
/// included), never leaving a request counted that nothing serves.
struct InFlight(Arc<WorkerServerStats>);

impl InFlight {
    fn enter(stats: &Arc<WorkerServerStats>) -> Self {
        stats.in_flight.fetch_add(1, Ordering::AcqRel);
        InFlight(stats.clone())
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Ordering::AcqRel);
    }
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
    /// Requests dropped unanswered because they did not open (security on) or came from a
    /// member that may not drive this worker (see the [module docs](self)).
    pub fn rejected(&self) -> u64 {
        self.rejected.load(Ordering::Relaxed)
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
    security: Arc<Security>,
    /// This process's incarnation of the rank (drawn at construction).
    epoch: u64,
    heartbeat: Duration,
    plane: Option<Arc<crate::dataplane::rank::RankPlane>>,
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
            max_in_flight: kvbm_engine::config::TransportConfig::default().worker_max_in_flight,
            stats: Arc::new(WorkerServerStats::default()),
            security: Arc::new(Security::Off),
            epoch: new_epoch(),
            heartbeat: Duration::from_millis(
                kvbm_engine::config::TransportConfig::default().heartbeat_interval_ms,
            ),
            plane: None,
        }
    }

    /// Serves the rank plane's requests (`Lend`, `EndLease`, `PullSlices`) on `plane`; without
    /// one they are refused. Default: none.
    pub fn rank_plane(mut self, plane: Arc<crate::dataplane::rank::RankPlane>) -> Self {
        self.plane = Some(plane);
        self
    }

    /// This process's incarnation of the rank: drawn at construction, so a restarted worker
    /// process is a new one (see [`membership`](super::membership)).
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// Announces the rank every `interval` (`transport.heartbeat_interval_ms`; default its
    /// default, 1 s).
    pub fn heartbeat(mut self, interval: Duration) -> Self {
        self.heartbeat = interval.max(Duration::from_millis(1));
        self
    }

    /// This worker's security (its worker credential and the trust root): requests must then
    /// be sealed by its own instance's leader, and replies are sealed (see the
    /// [module docs](self)). Default: off.
    pub fn security(mut self, security: Arc<Security>) -> Self {
        self.security = security;
        self
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
            security,
            epoch,
            heartbeat,
            plane,
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
        let control_ctx = control_context(&subject);
        // Subscribed: announce the rank (a leader that hears it can reach it).
        let _beats = super::membership::spawn_beats(
            client.clone(),
            super::membership::members_subject(&prefix, address.instance),
            RankTarget { address, epoch },
            heartbeat,
            security.clone(),
            cancel.clone(),
        );
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
                // Security on: only this instance's leader is obeyed; anything else is
                // dropped unanswered (before it takes a permit) and counted.
                let (payload, reply_ctx) = match security.open(&control_ctx, &message.payload) {
                    Err(_) => {
                        stats.rejected.fetch_add(1, Ordering::Relaxed);
                        tracing::debug!(%address, "control request that does not open dropped");
                        continue;
                    }
                    Ok((Some(sender), _)) if !may_drive(&sender, address) => {
                        security.count(Rejection::NotAllowed);
                        stats.rejected.fetch_add(1, Ordering::Relaxed);
                        tracing::warn!(%address, sender = %sender, "control request from a member that may not drive this worker dropped");
                        continue;
                    }
                    Ok((Some(_), p)) => (
                        bytes::Bytes::copy_from_slice(p),
                        reply_context("ctl-reply", &message.payload),
                    ),
                    Ok((None, _)) => (message.payload.clone(), Vec::new()),
                };
                // The bound: a request beyond it is refused here, without a task of its own.
                let Ok(permit) = permits.clone().try_acquire_owned() else {
                    stats.refused_busy.fetch_add(1, Ordering::Relaxed);
                    metrics::counter!(kvbm_engine::metrics::WORKER_REQUESTS_REFUSED_BUSY)
                        .increment(1);
                    let version = decode_envelope::<serde::de::IgnoredAny>(&payload)
                        .map_or(PROTOCOL_VERSION, |e| e.version);
                    let response = ControlResponse::Refused(format!(
                        "worker busy: {max_in_flight} requests in flight \
                         (transport.worker_max_in_flight)"
                    ));
                    let answer = security.seal(&reply_ctx, &encode(version, response));
                    if let Err(e) = client.publish(reply, answer.into()).await {
                        tracing::warn!(%address, error = %e, "control reply not sent");
                    }
                    continue;
                };
                let (client, worker, hook) = (client.clone(), worker.clone(), on_request.clone());
                let plane = plane.clone();
                let (stats, security) = (stats.clone(), security.clone());
                let counted = InFlight::enter(&stats);
                tokio::spawn(async move {
                    let (_permit, _counted) = (permit, counted);
                    let (version, response) = match decode_envelope::<ControlRequest>(&payload) {
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
                        Ok(Envelope {
                            version,
                            to: Some(to),
                            ..
                        }) if to.address != address || to.epoch != epoch => (
                            version,
                            ControlResponse::Refused(if to.address != address {
                                format!(
                                    "misrouted: the request is for {}, this is {address}",
                                    to.address
                                )
                            } else {
                                format!(
                                    "stale: the request is for incarnation {:016x} of {address}, \
                                     this is {epoch:016x} (the rank restarted)",
                                    to.epoch
                                )
                            }),
                        ),
                        Ok(Envelope {
                            version,
                            body: request,
                            ..
                        }) => {
                            if let Some(hook) = &hook {
                                hook(&request);
                            }
                            if let (ControlRequest::Transfer(t), Some((src, d))) = (&request, delay)
                                && t.src == src
                            {
                                tokio::time::sleep(d).await;
                            }
                            // SAFETY: the trust boundary of the control plane. A worker's slots
                            // are owned by its leader's block managers, in another process: no
                            // check here can prove a slot free, so a request is executed for the
                            // leader alone. It arrived on this worker's control subject, which
                            // only its leader may publish to (with `[security]` on, it was sealed
                            // by the leader's credential and opened, sender checked, above; the
                            // operator's NATS permissions say the same); the leader's movers
                            // reserved the slots it names (`ParallelWorkers::execute`, and the
                            // rank pull's destinations), holds the slots it lends until every
                            // rank ended the lease, and `Fill`/`Digest` are its test requests,
                            // sent while nothing moves.
                            let response =
                                unsafe { serve(&worker, address, plane.as_deref(), request) }.await;
                            (version, response.for_version(version))
                        }
                    };
                    let answer = security.seal(&reply_ctx, &encode(version, response));
                    if let Err(e) = client.publish(reply, answer.into()).await {
                        tracing::warn!(%address, error = %e, "control reply not sent");
                    }
                    stats.served.fetch_add(1, Ordering::Relaxed);
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
    security: Arc<Security>,
    rejected: Arc<AtomicU64>,
    membership: Option<Membership>,
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
            security: Arc::new(Security::Off),
            rejected: Arc::default(),
            membership: None,
        }
    }

    /// Sends only to the incarnation of the worker `membership` says is in step, and names it
    /// in every request ([`Envelope::to`]): a rank not joined, lost or restarted (and not yet
    /// acknowledged) fails the call at once ([`ControlError::NotJoined`],
    /// [`ControlError::Rejoining`]); a request that reaches another incarnation is refused by
    /// it; a call in flight when its rank is lost or restarts ends then
    /// ([`ControlError::Lost`]), not at its deadline. Default: none (any incarnation, no
    /// address in the request).
    pub fn with_membership(mut self, membership: Membership) -> Self {
        self.membership = Some(membership);
        self
    }

    /// The leader's security (its leader credential and the trust root): requests are then
    /// sealed, and only the addressed worker's sealed reply is taken (see the
    /// [module docs](self)). Default: off.
    pub fn with_security(mut self, security: Arc<Security>) -> Self {
        self.security = security;
        self
    }

    /// Replies dropped (security on) because they did not open, or came from another member
    /// than the addressed worker; shared by clones.
    pub fn rejected(&self) -> u64 {
        self.rejected.load(Ordering::Relaxed)
    }

    /// The same worker with another per-request deadline.
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    async fn request(&self, request: ControlRequest) -> Result<ControlResponse, ControlError> {
        let worker = self.address;
        let Some(m) = &self.membership else {
            return self.send(encode(PROTOCOL_VERSION, request)).await;
        };
        // Subscribed before the target is read: a loss after it is seen.
        let mut events = m.events();
        let target = m.target(worker)?;
        let call = self.send(encode_envelope(&Envelope::addressed(request, target)));
        tokio::select! {
            r = call => r,
            () = lost(m, &mut events, target) => Err(ControlError::Lost {
                worker,
                epoch: target.epoch,
            }),
        }
    }

    /// Sends one encoded request and waits for its reply (see [`Self::request`]).
    async fn send(&self, encoded: bytes::Bytes) -> Result<ControlResponse, ControlError> {
        let worker = self.address;
        let timeout_ms = self.timeout.as_millis() as u64;
        if self.security.is_on() {
            let sealed = self
                .security
                .seal(&control_context(&self.subject), &encoded);
            let ctx = reply_context("ctl-reply", &sealed);
            let got = request_first_valid(
                &self.client,
                self.subject.clone(),
                sealed.into(),
                self.timeout,
                |bytes| match self.security.open(&ctx, bytes) {
                    Ok((Some(sender), payload)) if may_answer(&sender, worker) => {
                        Some(payload.to_vec())
                    }
                    Ok((sender, _)) => {
                        self.security.count(Rejection::NotAllowed);
                        self.rejected.fetch_add(1, Ordering::Relaxed);
                        tracing::warn!(%worker, sender = ?sender.map(|s| s.to_string()), "control reply from another member dropped");
                        None
                    }
                    Err(_) => {
                        self.rejected.fetch_add(1, Ordering::Relaxed);
                        tracing::warn!(%worker, "control reply that does not open dropped");
                        None
                    }
                },
            )
            .await;
            return match got {
                InboxReply::Valid(payload) => Self::decode_reply(worker, &payload),
                InboxReply::NoResponders => Err(ControlError::NoResponders { worker }),
                InboxReply::TimedOut => Err(ControlError::Timeout { worker, timeout_ms }),
                InboxReply::Transport(message) => Err(ControlError::Transport { worker, message }),
            };
        }
        let sent = self.client.request(self.subject.clone(), encoded);
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
        Self::decode_reply(worker, &message.payload)
    }

    fn decode_reply(
        worker: WorkerAddress,
        payload: &[u8],
    ) -> Result<ControlResponse, ControlError> {
        match decode_envelope::<ControlResponse>(payload) {
            Err(Undecoded::Malformed(message)) => Err(ControlError::Decode { worker, message }),
            Err(Undecoded::Version(got)) => Err(ControlError::Version {
                worker,
                expected: PROTOCOL_VERSION,
                got,
            }),
            Ok(Envelope {
                body: ControlResponse::Refused(message),
                ..
            }) => Err(ControlError::Refused { worker, message }),
            Ok(e) => Ok(e.body),
        }
    }
}

/// Resolves once `target` is no longer the incarnation `membership` is in step with: the rank
/// was lost or came back as another incarnation. Never resolves while it stays in step (nor
/// once the membership view stopped: the call's deadline then ends it).
async fn lost(
    membership: &Membership,
    events: &mut tokio::sync::broadcast::Receiver<super::membership::MemberEvent>,
    target: RankTarget,
) {
    use super::membership::MemberEvent;
    use tokio::sync::broadcast::error::RecvError;
    loop {
        match events.recv().await {
            Ok(MemberEvent::Lost(t)) if t.address == target.address => return,
            Ok(MemberEvent::Restarted { now, .. }) if now.address == target.address => return,
            Ok(_) => {}
            // Events were missed: ask the view itself.
            Err(RecvError::Lagged(_)) => {
                if membership.target(target.address) != Ok(target) {
                    return;
                }
            }
            Err(RecvError::Closed) => std::future::pending::<()>().await,
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

/// [`decode_envelope`] for the fuzz target (see [`fuzzing`](crate::fuzzing)):
/// whether `payload` decoded.
#[doc(hidden)]
pub(crate) fn fuzz_decode_envelope<T: serde::de::DeserializeOwned>(payload: &[u8]) -> bool {
    decode_envelope::<T>(payload).is_ok()
}
