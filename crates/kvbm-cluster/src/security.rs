//! Who may speak in the cluster: member credentials issued by one trust root, and the sealed
//! envelope every cluster message travels in.
//!
//! # Why
//!
//! NATS delivers any message any connected client publishes, and a TCP port answers anyone
//! who connects. Before this module, a heartbeat naming any instance was believed, any client
//! could drive a worker, and the frame checks used only public values. The threat model and
//! the operator's side (keys, subject permissions, TLS) are in `docs/security.md`.
//!
//! # Mechanism
//!
//! * A **trust root** (an Ed25519 key pair) is made once per cluster by the operator
//!   ([`RootKey::generate`], `kvbm security init`). Its public half ([`TrustRoot`]) is in
//!   every member's config; its secret half never is.
//! * Each member (an instance's leader, or one worker rank) gets a **credential**
//!   ([`Credential`], `kvbm security issue`): its own Ed25519 key and a [`MemberCert`] the
//!   root signed, binding the key to an instance id, a [`Role`], a rank, a namespace (the
//!   tenant) and an expiry.
//! * Every cluster message is **sealed** ([`Signer::seal`]): the sender's certificate, a
//!   sequence number, a timestamp and the payload, signed by the member's key over a
//!   *context* that names the channel (`b"heartbeat"`, a control subject, a request it
//!   answers), so a message cannot be replayed on another channel.
//! * A receiver **opens** it ([`Verifier::open`]): certificate signed by the root and not
//!   expired, the receiver's namespace, signature, timestamp within
//!   `security.max_clock_skew_ms`, sequence not seen before (a sliding window per sender). The
//!   caller then checks that the certificate may say what the payload says (a heartbeat's
//!   instance id is the certificate's; a worker obeys only its own instance's leader). A
//!   message failing any check is dropped and counted by kind ([`SecurityStats`]).
//!
//! * A member is **removed** by the revocation list ([`Revocations`], `security.revoked_file`):
//!   every certificate check consults it, and live data-plane sessions re-check their peer
//!   ([`Verifier::recheck`]) every `security.revocation_check_ms`. Certificates are
//!   short-lived (7 days by default) and a member warns before its own expires
//!   ([`Signer::warn_within`]). A root is **rotated** without downtime by trusting old and new
//!   together for a while ([`Verifier::with_more_roots`], `trust_root = "old,new"`).
//!
//! Per-member keys (not one cluster MAC key) are what make "no instance can speak for
//! another" hold: a member can sign only as itself.
//!
//! ```text
//!  sealed message (all integers little-endian)
//!  ┌────────────┬──────────┬──────┬─────┬────────┬─────────────┬─────────┬───────────┐
//!  │ "KVBMSEL1" │ cert_len │ cert │ seq │ ts_ms  │ payload_len │ payload │ signature │
//!  │     8      │    2     │  n   │  8  │   8    │      4      │    m    │    64     │
//!  └────────────┴──────────┴──────┴─────┴────────┴─────────────┴─────────┴───────────┘
//!  signature = Ed25519(member key, "kvbm-sealed-v1" ‖ len(context) ‖ context ‖ everything
//!              before the signature)
//! ```
//!
//! # Off
//!
//! [`Security::Off`] passes payloads through unsealed. A cluster refuses to start that way unless
//! the operator sets `security.insecure = true` ([`Security::require_for`]), on loopback too:
//! a shared host's other users and containers reach loopback ports. A single-host run
//! (`kvbm replay --instances`) makes its own root and credentials instead.
//!
//! # Locks
//!
//! The verifier has two `parking_lot` mutexes (the verified-certificate cache and the replay
//! windows), each taken only inside one of its methods and never together or across an
//! `.await`. Signing takes none (the sequence is an atomic).

mod dh;
mod revocation;

use std::collections::HashMap;

use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use ed25519_dalek::{Signature, Signer as _, SigningKey, VerifyingKey};
use parking_lot::Mutex;
use serde::{Deserialize, Serialize};

use kvbm_engine::InstanceId;

/// The `[security]` section and the loopback rule are the core's configuration (the core
/// carries no cryptography); its errors are the core's so `EngineError` can carry them.
pub use kvbm_engine::config::{SecurityConfig, is_loopback};
pub use kvbm_engine::error::{Rejection, SecurityError};

pub use dh::{EphemeralKey, SessionKeys};
pub use revocation::Revocations;

/// What a member is.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    /// An instance's leader: heartbeats, events, snapshots, control requests, the data plane.
    Leader,
    /// One worker rank of an instance: answers its own leader's control requests.
    Worker,
}

impl Role {
    fn code(self) -> u8 {
        match self {
            Role::Leader => 0,
            Role::Worker => 1,
        }
    }
    fn from_code(c: u8) -> Option<Self> {
        match c {
            0 => Some(Role::Leader),
            1 => Some(Role::Worker),
            _ => None,
        }
    }
}

impl std::fmt::Display for Role {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Role::Leader => "leader",
            Role::Worker => "worker",
        })
    }
}

impl std::str::FromStr for Role {
    type Err = SecurityError;
    fn from_str(s: &str) -> Result<Self, SecurityError> {
        match s {
            "leader" => Ok(Role::Leader),
            "worker" => Ok(Role::Worker),
            _ => Err(SecurityError::Invalid(format!(
                "role {s:?}: expected \"leader\" or \"worker\""
            ))),
        }
    }
}

const CERT_MAGIC: &[u8; 8] = b"KVBMCRT1";
const SEALED_MAGIC: &[u8; 8] = b"KVBMSEL1";
const CREDENTIAL_HEADER: &str = "kvbm-credential-v1";
const ROOT_HEADER: &str = "kvbm-root-key-v1";
/// Longest namespace a certificate may carry, in bytes.
pub const MAX_NAMESPACE: usize = 64;

/// A member certificate: the root's signature over who a member key belongs to.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MemberCert {
    /// The instance the member belongs to.
    pub instance: InstanceId,
    /// Leader or worker.
    pub role: Role,
    /// The worker's rank (0 for a leader).
    pub rank: u32,
    /// The tenant: members of different namespaces never accept each other's messages or
    /// blocks.
    pub namespace: String,
    /// The member's public key.
    pub key: VerifyingKey,
    /// Valid until this time (milliseconds since the Unix epoch).
    pub not_after_ms: u64,
    root_sig: Signature,
}

impl MemberCert {
    fn signed_part(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(96 + self.namespace.len());
        out.extend_from_slice(CERT_MAGIC);
        out.extend_from_slice(&self.instance.0.to_le_bytes());
        out.push(self.role.code());
        out.extend_from_slice(&self.rank.to_le_bytes());
        out.push(self.namespace.len() as u8);
        out.extend_from_slice(self.namespace.as_bytes());
        out.extend_from_slice(self.key.as_bytes());
        out.extend_from_slice(&self.not_after_ms.to_le_bytes());
        out
    }

    /// The certificate's bytes (what a sealed message and a handshake carry).
    pub fn encode(&self) -> Vec<u8> {
        let mut out = self.signed_part();
        out.extend_from_slice(&self.root_sig.to_bytes());
        out
    }

    /// Parses a certificate (without checking its root signature: see
    /// [`Verifier::check_cert`]).
    ///
    /// # Errors
    /// [`Rejection::Malformed`] for anything that is not exactly one certificate.
    pub fn decode(b: &[u8]) -> Result<Self, Rejection> {
        let mut r = Reader(b);
        if r.take(8)? != CERT_MAGIC {
            return Err(Rejection::Malformed);
        }
        let instance = InstanceId(r.u64()?);
        let role = Role::from_code(r.take(1)?[0]).ok_or(Rejection::Malformed)?;
        let rank = r.u32()?;
        let ns_len = r.take(1)?[0] as usize;
        if ns_len > MAX_NAMESPACE {
            return Err(Rejection::Malformed);
        }
        let namespace = std::str::from_utf8(r.take(ns_len)?)
            .map_err(|_| Rejection::Malformed)?
            .to_owned();
        let key = VerifyingKey::from_bytes(r.array::<32>()?).map_err(|_| Rejection::Malformed)?;
        let not_after_ms = r.u64()?;
        let root_sig = Signature::from_bytes(r.array::<64>()?);
        if !r.0.is_empty() {
            return Err(Rejection::Malformed);
        }
        Ok(Self {
            instance,
            role,
            rank,
            namespace,
            key,
            not_after_ms,
            root_sig,
        })
    }

    /// Checks this certificate's signature against `root`.
    pub fn signed_by(&self, root: &TrustRoot) -> bool {
        root.0
            .verify_strict(&self.signed_part(), &self.root_sig)
            .is_ok()
    }

    /// The certificate's fingerprint: BLAKE3 of its bytes, what a revocation list names
    /// (`kvbm security show` prints it in hex).
    pub fn fingerprint(&self) -> [u8; 32] {
        *blake3::Hasher::new_derive_key("kvbm member certificate fingerprint")
            .update(&self.encode())
            .finalize()
            .as_bytes()
    }

    /// [`fingerprint`](Self::fingerprint) in 64 hex digits.
    pub fn fingerprint_hex(&self) -> String {
        self.fingerprint()
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect()
    }

    /// How long until this certificate expires (zero once it has).
    pub fn expires_in(&self) -> Duration {
        Duration::from_millis(self.not_after_ms.saturating_sub(now_ms()))
    }

    /// Checks `sig` over `msg` under this member's key.
    pub fn verifies(&self, msg: &[u8], sig: &[u8; 64]) -> bool {
        self.key
            .verify_strict(msg, &Signature::from_bytes(sig))
            .is_ok()
    }
}

impl std::fmt::Display for MemberCert {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.role {
            Role::Leader => write!(f, "leader of {} ({:?})", self.instance, self.namespace),
            Role::Worker => write!(
                f,
                "worker rank {} of {} ({:?})",
                self.rank, self.instance, self.namespace
            ),
        }
    }
}

/// The public half of the cluster's root key: what every member checks certificates against.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct TrustRoot(VerifyingKey);

impl TrustRoot {
    /// Parses the 64 hex digits `kvbm security init` prints.
    ///
    /// # Errors
    /// [`SecurityError::Invalid`] naming what is wrong.
    pub fn from_hex(s: &str) -> Result<Self, SecurityError> {
        let b = hex_array::<32>(s.trim(), "security.trust_root")?;
        VerifyingKey::from_bytes(&b)
            .map(Self)
            .map_err(|e| SecurityError::Invalid(format!("security.trust_root: {e}")))
    }

    /// The 64 hex digits of the key.
    pub fn to_hex(&self) -> String {
        hex(self.0.as_bytes())
    }
}

/// The cluster's root key: it issues credentials. Only the operator holds it; no member's
/// config names it.
pub struct RootKey(SigningKey);

impl std::fmt::Debug for RootKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "RootKey({}, secret redacted)",
            self.trust_root().to_hex()
        )
    }
}

impl RootKey {
    /// A new root key from the operating system's random source.
    ///
    /// # Errors
    /// [`SecurityError::Random`] if the random source fails.
    pub fn generate() -> Result<Self, SecurityError> {
        Ok(Self(SigningKey::from_bytes(&random32()?)))
    }

    /// The public half, for every member's `security.trust_root`.
    pub fn trust_root(&self) -> TrustRoot {
        TrustRoot(self.0.verifying_key())
    }

    /// Issues a credential for one member, valid for `validity`.
    ///
    /// # Errors
    /// [`SecurityError::Invalid`] for a namespace longer than [`MAX_NAMESPACE`] bytes or a
    /// leader with a rank; [`SecurityError::Random`] if the random source fails.
    pub fn issue(
        &self,
        instance: InstanceId,
        role: Role,
        rank: u32,
        namespace: &str,
        validity: Duration,
    ) -> Result<Credential, SecurityError> {
        if namespace.len() > MAX_NAMESPACE {
            return Err(SecurityError::Invalid(format!(
                "namespace {namespace:?} is {} bytes, at most {MAX_NAMESPACE}",
                namespace.len()
            )));
        }
        if role == Role::Leader && rank != 0 {
            return Err(SecurityError::Invalid(format!(
                "a leader has no rank (got {rank})"
            )));
        }
        let key = SigningKey::from_bytes(&random32()?);
        let mut cert = MemberCert {
            instance,
            role,
            rank,
            namespace: namespace.to_owned(),
            key: key.verifying_key(),
            not_after_ms: now_ms().saturating_add(validity.as_millis() as u64),
            root_sig: Signature::from_bytes(&[0; 64]),
        };
        cert.root_sig = self.0.sign(&cert.signed_part());
        Ok(Credential { cert, key })
    }

    /// Writes the key (hex, mode 0600) to `path`, refusing to overwrite a file.
    ///
    /// # Errors
    /// [`SecurityError::Io`] naming the file.
    pub fn save(&self, path: &Path) -> Result<(), SecurityError> {
        write_secret(
            path,
            &format!("{ROOT_HEADER}\n{}\n", hex(&self.0.to_bytes())),
        )
    }

    /// Reads a key [`save`](Self::save) wrote.
    ///
    /// # Errors
    /// [`SecurityError::Io`] or [`SecurityError::Invalid`] naming the file.
    pub fn load(path: &Path) -> Result<Self, SecurityError> {
        let text = read_secret(path)?;
        let mut lines = text.lines();
        if lines.next() != Some(ROOT_HEADER) {
            return Err(SecurityError::Invalid(format!(
                "{}: not a kvbm root key (first line is not {ROOT_HEADER:?})",
                path.display()
            )));
        }
        let key = hex_array::<32>(lines.next().unwrap_or(""), &path.display().to_string())?;
        Ok(Self(SigningKey::from_bytes(&key)))
    }
}

/// One member's certificate and secret key.
pub struct Credential {
    cert: MemberCert,
    key: SigningKey,
}

impl std::fmt::Debug for Credential {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Credential({}, secret redacted)", self.cert)
    }
}

impl Credential {
    /// The certificate.
    pub fn cert(&self) -> &MemberCert {
        &self.cert
    }

    /// Signs `msg` with the member's key.
    pub fn sign(&self, msg: &[u8]) -> [u8; 64] {
        self.key.sign(msg).to_bytes()
    }

    /// Writes the credential (mode 0600) to `path`, refusing to overwrite a file.
    ///
    /// # Errors
    /// [`SecurityError::Io`] naming the file.
    pub fn save(&self, path: &Path) -> Result<(), SecurityError> {
        write_secret(
            path,
            &format!(
                "{CREDENTIAL_HEADER}\n# {}\n{}\n{}\n",
                self.cert,
                hex(&self.cert.encode()),
                hex(&self.key.to_bytes())
            ),
        )
    }

    /// Reads a credential [`save`](Self::save) wrote, checking that the key matches the
    /// certificate and, if `root` is given, that the root signed it and it has not expired.
    ///
    /// # Errors
    /// [`SecurityError::Io`] or [`SecurityError::Invalid`] naming the file and the problem.
    pub fn load(path: &Path, root: Option<&TrustRoot>) -> Result<Self, SecurityError> {
        match root {
            Some(r) => Self::load_trusted(path, std::slice::from_ref(r)),
            None => Self::load_trusted(path, &[]),
        }
    }

    /// As [`load`](Self::load), checking that one of `roots` signed it (none: no check).
    ///
    /// # Errors
    /// As [`load`](Self::load).
    pub fn load_trusted(path: &Path, roots: &[TrustRoot]) -> Result<Self, SecurityError> {
        let name = path.display().to_string();
        let text = read_secret(path)?;
        let mut lines = text.lines().filter(|l| !l.starts_with('#'));
        if lines.next() != Some(CREDENTIAL_HEADER) {
            return Err(SecurityError::Invalid(format!(
                "{name}: not a kvbm credential (first line is not {CREDENTIAL_HEADER:?})"
            )));
        }
        let cert_hex = lines.next().unwrap_or("");
        let cert_bytes = unhex(cert_hex)
            .ok_or_else(|| SecurityError::Invalid(format!("{name}: certificate is not hex")))?;
        let cert = MemberCert::decode(&cert_bytes)
            .map_err(|_| SecurityError::Invalid(format!("{name}: malformed certificate")))?;
        let key = SigningKey::from_bytes(&hex_array::<32>(lines.next().unwrap_or(""), &name)?);
        if key.verifying_key() != cert.key {
            return Err(SecurityError::Invalid(format!(
                "{name}: the secret key does not belong to the certificate"
            )));
        }
        if !roots.is_empty() {
            if !roots.iter().any(|r| cert.signed_by(r)) {
                let named: Vec<String> = roots.iter().map(TrustRoot::to_hex).collect();
                return Err(SecurityError::Invalid(format!(
                    "{name}: the certificate ({}) is not signed by security.trust_root {}",
                    cert,
                    named.join(",")
                )));
            }
            if cert.not_after_ms < now_ms() {
                return Err(SecurityError::Invalid(format!(
                    "{name}: the certificate ({cert}) has expired"
                )));
            }
        }
        Ok(Self { cert, key })
    }
}

/// Dropped messages by kind, and accepted ones.
#[derive(Debug, Default)]
pub struct SecurityStats {
    accepted: AtomicU64,
    counts: [AtomicU64; 9],
}

impl SecurityStats {
    fn index(r: Rejection) -> usize {
        match r {
            Rejection::Malformed => 0,
            Rejection::NotMember => 1,
            Rejection::Expired => 2,
            Rejection::OtherNamespace => 3,
            Rejection::BadSignature => 4,
            Rejection::Stale => 5,
            Rejection::Replayed => 6,
            Rejection::NotAllowed => 7,
            Rejection::Revoked => 8,
        }
    }

    /// Counts one dropped message of kind `r` (the verifier counts its own; callers count
    /// [`Rejection::NotAllowed`]).
    pub fn count(&self, r: Rejection) {
        self.counts[Self::index(r)].fetch_add(1, Ordering::Relaxed);
        metrics::counter!(
            kvbm_engine::metrics::SECURITY_REJECTED,
            kvbm_engine::metrics::REASON_LABEL => rejection_label(r)
        )
        .increment(1);
    }

    /// Messages dropped for reason `r`.
    pub fn rejected(&self, r: Rejection) -> u64 {
        self.counts[Self::index(r)].load(Ordering::Relaxed)
    }

    /// Messages dropped for any reason.
    pub fn rejected_total(&self) -> u64 {
        self.counts.iter().map(|c| c.load(Ordering::Relaxed)).sum()
    }

    /// Messages that passed every check.
    pub fn accepted(&self) -> u64 {
        self.accepted.load(Ordering::Relaxed)
    }
}

fn rejection_label(r: Rejection) -> &'static str {
    match r {
        Rejection::Malformed => "malformed",
        Rejection::NotMember => "not_member",
        Rejection::Expired => "expired",
        Rejection::OtherNamespace => "other_namespace",
        Rejection::BadSignature => "bad_signature",
        Rejection::Stale => "stale",
        Rejection::Replayed => "replayed",
        Rejection::NotAllowed => "not_allowed",
        Rejection::Revoked => "revoked",
    }
}

/// Seals messages as one member.
#[derive(Debug)]
pub struct Signer {
    credential: Arc<Credential>,
    cert_bytes: Vec<u8>,
    seq: AtomicU64,
    /// Warn when the certificate expires within this many ms (0: never).
    warn_within_ms: AtomicU64,
    /// When the expiry was last warned of (ms since the epoch; 0: never).
    warned_at_ms: AtomicU64,
}

impl Signer {
    /// A signer for `credential`. Sequence numbers start at the current time in microseconds,
    /// so a restarted member is never below what receivers saw from it before.
    pub fn new(credential: Arc<Credential>) -> Self {
        let cert_bytes = credential.cert.encode();
        Self {
            credential,
            cert_bytes,
            seq: AtomicU64::new(now_us()),
            warn_within_ms: AtomicU64::new(0),
            warned_at_ms: AtomicU64::new(0),
        }
    }

    /// Warns (now, then at most once an hour while it seals) when this member's certificate
    /// expires within `within`: a member whose credential lapses drops out of the cluster, so
    /// its operator should issue the next one first (`security.expiry_warning_ms`).
    pub fn warn_within(&self, within: Duration) {
        self.warn_within_ms
            .store(within.as_millis() as u64, Ordering::Relaxed);
        self.warn_expiry(now_ms());
    }

    /// Whether the expiry is due a warning at `now` (and records it).
    fn warn_expiry(&self, now: u64) -> bool {
        let within = self.warn_within_ms.load(Ordering::Relaxed);
        let left = self.credential.cert.not_after_ms.saturating_sub(now);
        if within == 0 || left > within {
            return false;
        }
        let last = self.warned_at_ms.load(Ordering::Relaxed);
        if last != 0 && now.saturating_sub(last) < 3_600_000 {
            return false;
        }
        if self
            .warned_at_ms
            .compare_exchange(last, now, Ordering::Relaxed, Ordering::Relaxed)
            .is_err()
        {
            return false;
        }
        tracing::warn!(
            member = %self.credential.cert,
            expires_in_s = left / 1000,
            "this member's certificate expires soon: issue its next credential \
             (kvbm security issue) and restart it with that one before then"
        );
        true
    }

    /// The member this signer speaks as.
    pub fn cert(&self) -> &MemberCert {
        &self.credential.cert
    }

    /// The credential.
    pub fn credential(&self) -> &Arc<Credential> {
        &self.credential
    }

    /// `payload` sealed for the channel `context` (see the [module docs](self)).
    pub fn seal(&self, context: &[u8], payload: &[u8]) -> Vec<u8> {
        let seq = self.seq.fetch_add(1, Ordering::Relaxed);
        self.warn_expiry(now_ms());
        let mut out = Vec::with_capacity(8 + 2 + self.cert_bytes.len() + 20 + payload.len() + 64);
        out.extend_from_slice(SEALED_MAGIC);
        out.extend_from_slice(&(self.cert_bytes.len() as u16).to_le_bytes());
        out.extend_from_slice(&self.cert_bytes);
        out.extend_from_slice(&seq.to_le_bytes());
        out.extend_from_slice(&now_ms().to_le_bytes());
        out.extend_from_slice(&(payload.len() as u32).to_le_bytes());
        out.extend_from_slice(payload);
        let sig = self.credential.sign(&signed_message(context, &out));
        out.extend_from_slice(&sig);
        out
    }
}

fn signed_message(context: &[u8], body: &[u8]) -> Vec<u8> {
    let mut m = Vec::with_capacity(16 + 4 + context.len() + body.len());
    m.extend_from_slice(b"kvbm-sealed-v1");
    m.extend_from_slice(&(context.len() as u32).to_le_bytes());
    m.extend_from_slice(context);
    m.extend_from_slice(body);
    m
}

/// A message that passed every check of [`Verifier::open`].
#[derive(Debug)]
pub struct Opened<'a> {
    /// Who sent it (its certificate was checked against the root).
    pub sender: Arc<MemberCert>,
    /// Its sequence number.
    pub seq: u64,
    /// The payload.
    pub payload: &'a [u8],
}

/// Verification settings.
#[derive(Clone, Debug)]
pub struct VerifierConfig {
    /// The namespace (tenant) messages must come from.
    pub namespace: String,
    /// Largest accepted distance between a message's timestamp and the receiver's clock.
    pub max_clock_skew: Duration,
    /// Sequence numbers tracked per sender (out-of-order delivery tolerated within it).
    pub replay_window: u32,
    /// Senders tracked at once (least recently heard from forgotten first).
    pub max_senders: usize,
}

/// How often a live session is checked again without a revocation list (for expiry).
const DEFAULT_RECHECK: Duration = Duration::from_secs(5);

/// Opens sealed messages: see the [module docs](self).
#[derive(Debug)]
pub struct Verifier {
    /// Every root a certificate may be signed by (more than one while a root is rotated).
    roots: Vec<TrustRoot>,
    revocations: Option<Revocations>,
    /// How often a live session's peer is checked again ([`recheck`](Self::recheck)).
    recheck_every: Duration,
    config: VerifierConfig,
    certs: Mutex<Lru<Vec<u8>, Arc<MemberCert>>>,
    windows: Mutex<Lru<[u8; 32], ReplayWindow>>,
    stats: Arc<SecurityStats>,
}

impl Verifier {
    /// A verifier trusting `root`.
    pub fn new(root: TrustRoot, config: VerifierConfig) -> Self {
        let cap = config.max_senders.max(1);
        Self {
            roots: vec![root],
            revocations: None,
            recheck_every: DEFAULT_RECHECK,
            config,
            certs: Mutex::new(Lru::new(cap)),
            windows: Mutex::new(Lru::new(cap)),
            stats: Arc::default(),
        }
    }

    /// The counters.
    pub fn stats(&self) -> &Arc<SecurityStats> {
        &self.stats
    }

    /// The namespace this verifier accepts.
    pub fn namespace(&self) -> &str {
        &self.config.namespace
    }

    /// The (first) trust root.
    pub fn root(&self) -> &TrustRoot {
        &self.roots[0]
    }

    /// This verifier also trusting `more` roots (a root being rotated in or out).
    pub fn with_more_roots(mut self, more: impl IntoIterator<Item = TrustRoot>) -> Self {
        for r in more {
            if !self.roots.contains(&r) {
                self.roots.push(r);
            }
        }
        self
    }

    /// This verifier refusing the certificates `revocations` lists (and re-checking live
    /// sessions as often as the list is looked at).
    pub fn with_revocations(mut self, revocations: Revocations) -> Self {
        self.recheck_every = revocations.every();
        self.revocations = Some(revocations);
        self
    }

    /// How often a live session's peer should be checked again ([`recheck`](Self::recheck)):
    /// `security.revocation_check_ms` with a revocation list, else 5 s (expiry).
    pub fn recheck_every(&self) -> Duration {
        self.recheck_every
    }

    /// Checks a certificate already accepted (a live session's peer) again: expiry and the
    /// revocation list.
    ///
    /// # Errors
    /// [`Rejection::Expired`] or [`Rejection::Revoked`] (not counted).
    pub fn recheck(&self, cert: &MemberCert) -> Result<(), Rejection> {
        if cert.not_after_ms < now_ms() {
            return Err(Rejection::Expired);
        }
        if self
            .revocations
            .as_ref()
            .is_some_and(|r| r.is_revoked(cert))
        {
            return Err(Rejection::Revoked);
        }
        Ok(())
    }

    /// Checks a certificate's bytes: the root's signature, the expiry and the namespace.
    /// Certificates already checked are remembered (bounded), so each is verified once.
    ///
    /// # Errors
    /// The [`Rejection`] (not counted: callers that drop a message count it).
    pub fn check_cert(&self, bytes: &[u8]) -> Result<Arc<MemberCert>, Rejection> {
        let cached = self.certs.lock().get(bytes).cloned();
        let cert = match cached {
            Some(c) => c,
            None => {
                let cert = MemberCert::decode(bytes)?;
                if !self.roots.iter().any(|r| cert.signed_by(r)) {
                    return Err(Rejection::NotMember);
                }
                let cert = Arc::new(cert);
                self.certs.lock().put(bytes.to_vec(), cert.clone());
                cert
            }
        };
        if cert.namespace != self.config.namespace {
            return Err(Rejection::OtherNamespace);
        }
        self.recheck(&cert)?;
        Ok(cert)
    }

    /// Opens `sealed` for the channel `context`; a refusal is counted.
    ///
    /// # Errors
    /// The [`Rejection`].
    pub fn open<'a>(&self, context: &[u8], sealed: &'a [u8]) -> Result<Opened<'a>, Rejection> {
        let r = self.open_uncounted(context, sealed);
        match &r {
            Ok(_) => {
                self.stats.accepted.fetch_add(1, Ordering::Relaxed);
            }
            Err(e) => self.stats.count(*e),
        }
        r
    }

    fn open_uncounted<'a>(
        &self,
        context: &[u8],
        sealed: &'a [u8],
    ) -> Result<Opened<'a>, Rejection> {
        if sealed.len() < 64 {
            return Err(Rejection::Malformed);
        }
        let (body, sig) = sealed.split_at(sealed.len() - 64);
        let mut r = Reader(body);
        if r.take(8)? != SEALED_MAGIC {
            return Err(Rejection::Malformed);
        }
        let cert_len = r.u16()? as usize;
        let cert_bytes = r.take(cert_len)?;
        let seq = r.u64()?;
        let ts = r.u64()?;
        let len = r.u32()? as usize;
        let payload = r.take(len)?;
        if !r.0.is_empty() {
            return Err(Rejection::Malformed);
        }
        let sender = self.check_cert(cert_bytes)?;
        let sig: &[u8; 64] = sig.try_into().map_err(|_| Rejection::Malformed)?;
        if !sender.verifies(&signed_message(context, body), sig) {
            return Err(Rejection::BadSignature);
        }
        let now = now_ms();
        if now.abs_diff(ts) > self.config.max_clock_skew.as_millis() as u64 {
            return Err(Rejection::Stale);
        }
        let window = self.config.replay_window.max(1);
        let fresh = self
            .windows
            .lock()
            .get_or_insert_with(*sender.key.as_bytes(), || ReplayWindow::new(window))
            .accept(seq);
        if !fresh {
            return Err(Rejection::Replayed);
        }
        Ok(Opened {
            sender,
            seq,
            payload,
        })
    }
}

/// A sliding window of accepted sequence numbers (as IPsec's): anything above the highest is
/// accepted, anything within `size` below it once, anything older never.
#[derive(Debug)]
struct ReplayWindow {
    highest: Option<u64>,
    size: u64,
    seen: Vec<u64>,
}

impl ReplayWindow {
    fn new(size: u32) -> Self {
        let words = (size as usize).div_ceil(64);
        Self {
            highest: None,
            size: words as u64 * 64,
            seen: vec![0; words],
        }
    }

    fn bit(&mut self, seq: u64) -> (&mut u64, u64) {
        let i = (seq % self.size) as usize;
        (&mut self.seen[i / 64], 1u64 << (i % 64))
    }

    fn accept(&mut self, seq: u64) -> bool {
        let Some(high) = self.highest else {
            self.highest = Some(seq);
            let (w, m) = self.bit(seq);
            *w |= m;
            return true;
        };
        if seq > high {
            // Clear the bits of the numbers the window slides past.
            let gap = seq - high;
            if gap >= self.size {
                self.seen.iter_mut().for_each(|w| *w = 0);
            } else {
                for s in high + 1..=seq {
                    let (w, m) = self.bit(s);
                    *w &= !m;
                }
            }
            self.highest = Some(seq);
            let (w, m) = self.bit(seq);
            *w |= m;
            return true;
        }
        if high - seq >= self.size {
            return false;
        }
        let (w, m) = self.bit(seq);
        if *w & m != 0 {
            return false;
        }
        *w |= m;
        true
    }
}

/// A small least-recently-used map (linear eviction scan; sizes are member counts).
#[derive(Debug)]
struct Lru<K, V> {
    cap: usize,
    tick: u64,
    map: HashMap<K, (u64, V)>,
}

impl<K: std::hash::Hash + Eq + Clone, V> Lru<K, V> {
    fn new(cap: usize) -> Self {
        Self {
            cap,
            tick: 0,
            map: HashMap::new(),
        }
    }
    fn get<Q>(&mut self, k: &Q) -> Option<&V>
    where
        K: std::borrow::Borrow<Q>,
        Q: std::hash::Hash + Eq + ?Sized,
    {
        self.tick += 1;
        let t = self.tick;
        self.map.get_mut(k).map(|(used, v)| {
            *used = t;
            &*v
        })
    }
    fn evict_if_full(&mut self) {
        if self.map.len() >= self.cap
            && let Some(old) = self
                .map
                .iter()
                .min_by_key(|(_, (used, _))| *used)
                .map(|(k, _)| k.clone())
        {
            self.map.remove(&old);
        }
    }
    fn put(&mut self, k: K, v: V) {
        if !self.map.contains_key(&k) {
            self.evict_if_full();
        }
        self.tick += 1;
        self.map.insert(k, (self.tick, v));
    }
    fn get_or_insert_with(&mut self, k: K, f: impl FnOnce() -> V) -> &mut V {
        if !self.map.contains_key(&k) {
            self.evict_if_full();
        }
        self.tick += 1;
        let t = self.tick;
        let e = self.map.entry(k).or_insert_with(|| (t, f()));
        e.0 = t;
        &mut e.1
    }
}

/// This member's signer and verifier, or nothing (a cluster run without credentials).
#[derive(Debug)]
pub enum Security {
    /// No credentials: messages travel unsealed and are believed (loopback, or
    /// `security.insecure = true`).
    Off,
    /// Every message sealed and verified.
    On(Box<Sealing>),
}

/// A member's two halves: what seals its own messages and what opens everyone else's.
#[derive(Debug)]
pub struct Sealing {
    /// Seals this member's messages.
    pub signer: Signer,
    /// Opens everyone else's.
    pub verifier: Verifier,
}

impl Security {
    /// Builds this member's security from config: [`Security::Off`] without credentials,
    /// otherwise the credential is loaded and checked against the root.
    ///
    /// # Errors
    /// [`SecurityError`] naming the key or file.
    pub fn from_config(config: &SecurityConfig) -> Result<Self, SecurityError> {
        config
            .validate()
            .map_err(|(k, m)| SecurityError::Invalid(format!("{k}: {m}")))?;
        let (Some(_), Some(file)) = (&config.trust_root, &config.credential_file) else {
            return Ok(Security::Off);
        };
        let roots = config
            .trust_roots()
            .into_iter()
            .map(TrustRoot::from_hex)
            .collect::<Result<Vec<_>, _>>()?;
        let credential = Arc::new(Credential::load_trusted(file, &roots)?);
        let mut verifier =
            verifier_for(roots[0], &credential, config).with_more_roots(roots[1..].iter().copied());
        if let Some(list) = &config.revoked_file {
            let revocations = Revocations::load(
                list,
                Duration::from_millis(config.revocation_check_ms.max(1)),
            )?;
            if revocations.is_revoked(credential.cert()) {
                return Err(SecurityError::Invalid(format!(
                    "security.credential_file {}: this member's own certificate ({}) is on the \
                     revocation list (security.revoked_file {})",
                    file.display(),
                    credential.cert(),
                    list.display()
                )));
            }
            verifier = verifier.with_revocations(revocations);
        }
        let signer = Signer::new(credential);
        signer.warn_within(Duration::from_millis(config.expiry_warning_ms));
        Ok(Security::On(Box::new(Sealing { signer, verifier })))
    }

    /// Security for `credential`, trusting `root`, with `config`'s limits.
    pub fn with_credential(
        root: TrustRoot,
        credential: Arc<Credential>,
        config: &SecurityConfig,
    ) -> Self {
        let verifier = verifier_for(root, &credential, config);
        Security::On(Box::new(Sealing {
            signer: Signer::new(credential),
            verifier,
        }))
    }

    /// Whether messages are sealed.
    pub fn is_on(&self) -> bool {
        matches!(self, Security::On(_))
    }

    /// This member's signer (none when off).
    pub fn signer(&self) -> Option<&Signer> {
        match self {
            Security::Off => None,
            Security::On(s) => Some(&s.signer),
        }
    }

    /// The verifier of everyone else's messages (none when off).
    pub fn verifier(&self) -> Option<&Verifier> {
        match self {
            Security::Off => None,
            Security::On(s) => Some(&s.verifier),
        }
    }

    /// Seals `payload` for `context`, or returns it as is when off.
    pub fn seal(&self, context: &[u8], payload: &[u8]) -> Vec<u8> {
        match self {
            Security::Off => payload.to_vec(),
            Security::On(s) => s.signer.seal(context, payload),
        }
    }

    /// Opens `bytes` sealed for `context`: the sender and the payload, or (off) no sender and
    /// the bytes as they came.
    ///
    /// # Errors
    /// The [`Rejection`], already counted.
    pub fn open<'a>(
        &self,
        context: &[u8],
        bytes: &'a [u8],
    ) -> Result<(Option<Arc<MemberCert>>, &'a [u8]), Rejection> {
        match self {
            Security::Off => Ok((None, bytes)),
            Security::On(s) => s
                .verifier
                .open(context, bytes)
                .map(|o| (Some(o.sender), o.payload)),
        }
    }

    /// The counters (none when off).
    pub fn stats(&self) -> Option<&Arc<SecurityStats>> {
        match self {
            Security::Off => None,
            Security::On(s) => Some(s.verifier.stats()),
        }
    }

    /// Counts a message a caller dropped after opening it ([`Rejection::NotAllowed`]).
    pub fn count(&self, r: Rejection) {
        if let Some(s) = self.stats() {
            s.count(r);
        }
    }

    /// Refuses to run a cluster without credentials unless the operator asked for it
    /// (`insecure`): security is on by default everywhere, loopback too (a shared host's other
    /// users and containers, or a loopback NATS that is a leaf node, reach loopback ports).
    /// `endpoints` (a data-plane bind, NATS server addresses) are named in the error and in the
    /// warning `insecure` logs at every start.
    ///
    /// # Errors
    /// [`SecurityError::Invalid`] naming the first endpoint off loopback (or the first one).
    pub fn require_for<'a>(
        &self,
        insecure: bool,
        endpoints: impl IntoIterator<Item = &'a str>,
    ) -> Result<(), SecurityError> {
        if self.is_on() {
            return Ok(());
        }
        let endpoints: Vec<&str> = endpoints.into_iter().collect();
        let open = endpoints.iter().copied().find(|e| !is_loopback(e));
        if insecure {
            match open {
                Some(open) => tracing::warn!(
                    endpoint = open,
                    "SECURITY OFF: security.insecure = true; cluster messages and blocks to and \
                     from {open} are neither authenticated nor tenant-checked"
                ),
                None => tracing::warn!(
                    endpoints = ?endpoints,
                    "SECURITY OFF: security.insecure = true; cluster messages and blocks are \
                     neither authenticated nor tenant-checked (anyone on this host can reach \
                     loopback ports)"
                ),
            }
            return Ok(());
        }
        let (at, reach) = match open {
            Some(open) => (open, "is not on the loopback interface"),
            None => (
                endpoints.first().copied().unwrap_or("this cluster"),
                "is reachable by every user and container of this host",
            ),
        };
        Err(SecurityError::Invalid(format!(
            "{at} {reach} and no credentials are configured: set security.trust_root and \
             security.credential_file (kvbm security init / issue), or security.insecure = true \
             to run unauthenticated"
        )))
    }
}

/// The verifier of `credential`'s namespace, trusting `root`, with `config`'s limits.
fn verifier_for(root: TrustRoot, credential: &Credential, config: &SecurityConfig) -> Verifier {
    Verifier::new(
        root,
        VerifierConfig {
            namespace: credential.cert.namespace.clone(),
            max_clock_skew: Duration::from_millis(config.max_clock_skew_ms),
            replay_window: config.replay_window,
            max_senders: config.max_senders,
        },
    )
}

struct Reader<'a>(&'a [u8]);

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], Rejection> {
        if self.0.len() < n {
            return Err(Rejection::Malformed);
        }
        let (a, b) = self.0.split_at(n);
        self.0 = b;
        Ok(a)
    }
    fn array<const N: usize>(&mut self) -> Result<&'a [u8; N], Rejection> {
        self.take(N)?.try_into().map_err(|_| Rejection::Malformed)
    }
    fn u16(&mut self) -> Result<u16, Rejection> {
        Ok(u16::from_le_bytes(*self.array::<2>()?))
    }
    fn u32(&mut self) -> Result<u32, Rejection> {
        Ok(u32::from_le_bytes(*self.array::<4>()?))
    }
    fn u64(&mut self) -> Result<u64, Rejection> {
        Ok(u64::from_le_bytes(*self.array::<8>()?))
    }
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

fn now_us() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_micros() as u64)
        .unwrap_or(0)
}

pub(crate) fn random32() -> Result<[u8; 32], SecurityError> {
    let mut b = [0u8; 32];
    getrandom::fill(&mut b).map_err(|e| SecurityError::Random(e.to_string()))?;
    Ok(b)
}

fn hex(b: &[u8]) -> String {
    use std::fmt::Write;
    b.iter()
        .fold(String::with_capacity(b.len() * 2), |mut s, x| {
            let _ = write!(s, "{x:02x}");
            s
        })
}

fn unhex(s: &str) -> Option<Vec<u8>> {
    let s = s.trim();
    if !s.len().is_multiple_of(2) {
        return None;
    }
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(s.get(i..i + 2)?, 16).ok())
        .collect()
}

fn hex_array<const N: usize>(s: &str, what: &str) -> Result<[u8; N], SecurityError> {
    unhex(s)
        .and_then(|v| v.try_into().ok())
        .ok_or_else(|| SecurityError::Invalid(format!("{what}: expected {} hex digits", N * 2)))
}

fn write_secret(path: &Path, text: &str) -> Result<(), SecurityError> {
    use std::io::Write;
    #[cfg(unix)]
    use std::os::unix::fs::OpenOptionsExt;
    let io = |source| SecurityError::Io {
        path: path.to_owned(),
        source,
    };
    // `create_new` refuses any existing path, a symlink included.
    let mut opts = std::fs::OpenOptions::new();
    opts.write(true).create_new(true);
    #[cfg(unix)]
    opts.mode(0o600);
    let mut f = opts.open(path).map_err(io)?;
    f.write_all(text.as_bytes()).map_err(io)?;
    f.sync_all().map_err(io)
}

fn read_secret(path: &Path) -> Result<String, SecurityError> {
    check_private(path)?;
    std::fs::read_to_string(path).map_err(|source| SecurityError::Io {
        path: path.to_owned(),
        source,
    })
}

/// Refuses a secret file (a member key, a NATS password, token, nkey seed, `.creds` or TLS
/// client key) that anyone but its owner may read: on a shared host another user would hold
/// the secret. One rule for every secret file kvbm reads.
///
/// # Errors
/// [`SecurityError::Invalid`] naming the file and its mode when the group or others have any
/// permission on it; [`SecurityError::Io`] when it cannot be inspected.
pub fn check_private(path: &Path) -> Result<(), SecurityError> {
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        let meta = std::fs::metadata(path).map_err(|source| SecurityError::Io {
            path: path.to_owned(),
            source,
        })?;
        let mode = meta.permissions().mode();
        if mode & 0o077 != 0 {
            return Err(SecurityError::Invalid(format!(
                "{}: readable by group or others (mode {:o}); chmod 600 it",
                path.display(),
                mode & 0o777
            )));
        }
    }
    #[cfg(not(unix))]
    let _ = path;
    Ok(())
}

#[cfg(test)]
mod tests;
