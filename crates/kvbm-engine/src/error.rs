//! The crate's errors: [`EngineError`], which every fallible call returns, and the two errors it
//! wraps whole, a control call's ([`ControlError`]) and an onboarding session's
//! ([`SessionError`], with the [`Phase`] and [`SessionFailure`] it reports).
//!
//! This module is at the bottom of the crate: it imports only the lower crates and
//! `crate::address`, so every module can return these errors without an import cycle.
//!
//! Configuration errors carry the dotted key they are about (`offload.g2_to_g3.queue_capacity`)
//! so an operator can find the line to fix; errors of the crates below are wrapped, not
//! flattened into strings, so callers can still match on them.

use std::path::PathBuf;

use kvbm_logical::{LogicalError, TierId};
use kvbm_offload::{BlockFailure, BlockFailureKind};

use crate::address::{RankAddress, WorkerAddress};

/// Result alias of this crate.
pub type Result<T, E = EngineError> = std::result::Result<T, E>;

/// Attaches the step that failed to an error for a step of the stack or of a composition over it: on error, an
/// [`EngineError::Stack`] naming the step, the original error kept as its source.
pub trait Context<T> {
    /// On error, a [`EngineError::Stack`] for `what` caused by the error.
    fn context(self, what: impl Into<String>) -> Result<T>;
    /// As [`context`](Self::context), with the step's text made only on error.
    fn with_context<S: Into<String>>(self, what: impl FnOnce() -> S) -> Result<T>;
}

impl<T, E: std::error::Error + Send + Sync + 'static> Context<T> for std::result::Result<T, E> {
    fn context(self, what: impl Into<String>) -> Result<T> {
        self.map_err(|e| EngineError::stack_caused(what, e))
    }

    fn with_context<S: Into<String>>(self, what: impl FnOnce() -> S) -> Result<T> {
        self.map_err(|e| EngineError::stack_caused(what(), e))
    }
}

impl<T> Context<T> for Option<T> {
    fn context(self, what: impl Into<String>) -> Result<T> {
        self.ok_or_else(|| EngineError::stack(what))
    }

    fn with_context<S: Into<String>>(self, what: impl FnOnce() -> S) -> Result<T> {
        self.ok_or_else(|| EngineError::stack(what()))
    }
}

/// Everything that can go wrong in the engine.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum EngineError {
    /// A configuration value is missing, malformed, unknown or out of range. `key` is the
    /// dotted path (`logical.block_size`), `message` what is wrong and where the value came from.
    #[error("{key}: {message}")]
    Config {
        /// Dotted configuration key.
        key: String,
        /// What is wrong with it.
        message: String,
    },
    /// The tokio runtime could not be built.
    #[error("runtime: {0}")]
    Runtime(#[source] std::io::Error),
    /// The Prometheus exporter could not start (e.g. its address is taken).
    #[error("metrics exporter on {addr}: {source}")]
    Metrics {
        /// The address it tried to bind.
        addr: String,
        /// Why it failed.
        #[source]
        source: std::io::Error,
    },
    /// The runtime was shut down; nothing new can be started on it.
    #[error("the kvbm runtime is shut down")]
    ShutDown,
    /// A tier the operation needs is not configured on this leader.
    #[error("tier {0} is not configured")]
    TierMissing(TierId),
    /// A NATS client could not connect or subscribe (`url` is the server or the subject).
    #[error("nats {url}: {message}")]
    Nats {
        /// The server url or subject concerned.
        url: String,
        /// What failed.
        message: String,
    },
    /// A leader↔worker control call failed.
    #[error(transparent)]
    Control(#[from] ControlError),
    /// An error from `kvbm-logical`.
    #[error(transparent)]
    Logical(#[from] LogicalError),
    /// `kvbm-tiering` refused something (e.g. a tier handed to its manager).
    #[error(transparent)]
    Tiering(#[from] kvbm_tiering::TieringError),
    /// A G4 presence check failed.
    #[error("G4 presence check: {0}")]
    Presence(#[source] kvbm_offload::PolicyError),
    /// A physical layout or storage could not be set up.
    #[error(transparent)]
    Physical(#[from] kvbm_physical::PhysicalError),
    /// A mover or offload pipeline could not be set up or failed.
    #[error(transparent)]
    Offload(#[from] kvbm_offload::OffloadError),
    /// An onboarding session call failed.
    #[error(transparent)]
    Session(#[from] SessionError),
    /// A credential, key or security setting was refused, or a cluster without credentials
    /// was asked to run off loopback.
    #[error("security: {0}")]
    Security(#[from] SecurityError),
    /// A peer's snapshot request could not be answered or its answer read.
    #[error("snapshot of {peer}: {message}")]
    Snapshot {
        /// The peer asked.
        peer: String,
        /// What went wrong.
        message: String,
    },
    /// A request addressed to another rank (or another world size) reached this rank; nothing
    /// was moved.
    #[error("{this} refused a request addressed to {to}")]
    WrongRank {
        /// The rank that refused it.
        this: RankAddress,
        /// The address the request carried.
        to: RankAddress,
    },
    /// The tier stack (`stack::TierStack`) could not be built or could not go on: `what` names
    /// the step (with the file, tier or server concerned), `source` the cause when there is one.
    #[error("{what}{}", cause_suffix(.source))]
    Stack {
        /// The step that failed.
        what: String,
        /// Why, when another error says it.
        #[source]
        source: Option<Box<dyn std::error::Error + Send + Sync + 'static>>,
    },
    /// Worker ranks an instance drives as processes (`workers.mode = "processes"`) did not
    /// all join (heartbeat, in step) within `workers.join_timeout_ms`; `missing` are their
    /// ranks, `why` the first one's [`ControlError`].
    #[error(
        "worker ranks {missing:?} of {instance} did not join within {waited_ms} ms \
         (is a kvbm-engine-worker --instance {id} --rank R running for each, on the same \
         NATS server and prefix?): {why}",
        id = instance.0
    )]
    RanksMissing {
        /// The instance whose ranks were awaited.
        instance: crate::address::InstanceId,
        /// The ranks not in step at the deadline.
        missing: Vec<u32>,
        /// How long it waited.
        waited_ms: u64,
        /// The first missing rank's reason (not joined, or rejoining).
        why: ControlError,
    },
    /// The TCP block data plane could not serve or reach `peer`.
    #[error("data plane {peer}: {message}")]
    DataPlane {
        /// The address or instance concerned.
        peer: String,
        /// What went wrong.
        message: String,
    },
}

/// `": cause"`, or nothing without a cause.
fn cause_suffix(source: &Option<Box<dyn std::error::Error + Send + Sync + 'static>>) -> String {
    source
        .as_ref()
        .map(|s| format!(": {s}"))
        .unwrap_or_default()
}

impl EngineError {
    /// A [`EngineError::Stack`] for the step `what`, without a further cause.
    pub fn stack(what: impl Into<String>) -> Self {
        EngineError::Stack {
            what: what.into(),
            source: None,
        }
    }

    /// A [`EngineError::Stack`] for the step `what`, caused by `source`.
    pub fn stack_caused(
        what: impl Into<String>,
        source: impl std::error::Error + Send + Sync + 'static,
    ) -> Self {
        EngineError::Stack {
            what: what.into(),
            source: Some(Box::new(source)),
        }
    }

    /// A [`EngineError::Config`] for `key`.
    pub fn config(key: impl Into<String>, message: impl Into<String>) -> Self {
        EngineError::Config {
            key: key.into(),
            message: message.into(),
        }
    }

    /// A [`EngineError::DataPlane`] about `peer`.
    pub fn data_plane(peer: impl Into<String>, message: impl Into<String>) -> Self {
        EngineError::DataPlane {
            peer: peer.into(),
            message: message.into(),
        }
    }

    /// The configuration key this error is about, if it is a configuration error.
    pub fn config_key(&self) -> Option<&str> {
        match self {
            EngineError::Config { key, .. } => Some(key),
            _ => None,
        }
    }
}

/// Why a control call failed; every variant names the worker.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ControlError {
    /// No reply within the request's deadline (the worker is gone, hung, or too slow).
    #[error("{worker}: no reply within {timeout_ms} ms")]
    Timeout {
        /// The worker.
        worker: WorkerAddress,
        /// The deadline.
        timeout_ms: u64,
    },
    /// Nobody serves the worker's control subject (not started, or exited).
    #[error("{worker}: no worker serves its control subject")]
    NoResponders {
        /// The worker.
        worker: WorkerAddress,
    },
    /// The reply is of another protocol version.
    #[error("{worker}: replied in protocol version {got}, this leader speaks {expected}")]
    Version {
        /// The worker.
        worker: WorkerAddress,
        /// This build's control protocol version (`transport::control::PROTOCOL_VERSION`).
        expected: u32,
        /// What came back.
        got: u32,
    },
    /// The reply could not be decoded.
    #[error("{worker}: undecodable reply: {message}")]
    Decode {
        /// The worker.
        worker: WorkerAddress,
        /// The decoder's complaint.
        message: String,
    },
    /// The worker refused the request.
    #[error("{worker}: refused: {message}")]
    Refused {
        /// The worker.
        worker: WorkerAddress,
        /// Its reason.
        message: String,
    },
    /// The worker answered with a reply of the wrong kind.
    #[error("{worker}: expected a {expected} reply, got {got}")]
    Unexpected {
        /// The worker.
        worker: WorkerAddress,
        /// Expected reply kind.
        expected: &'static str,
        /// Received reply kind.
        got: &'static str,
    },
    /// The transport failed (connection lost, payload too large…).
    #[error("{worker}: transport: {message}")]
    Transport {
        /// The worker.
        worker: WorkerAddress,
        /// What failed.
        message: String,
    },
    /// The rank has not joined (no heartbeat yet) or was lost (its heartbeats stopped): the
    /// leader sends it nothing.
    #[error("{worker}: not joined (no live heartbeat)")]
    NotJoined {
        /// The worker.
        worker: WorkerAddress,
    },
    /// The rank the call was addressed to was lost while the call was in flight (it departed,
    /// its heartbeats stopped, or it came back as another incarnation): the call ends then,
    /// not at its deadline. What it did is unknown; the leader treats its memory as lost.
    #[error("{worker}: lost while the call to incarnation {epoch:016x} was in flight")]
    Lost {
        /// The worker.
        worker: WorkerAddress,
        /// The incarnation the call was addressed to.
        epoch: u64,
    },
    /// The rank restarted (a heartbeat of a new incarnation) and has not been brought back in
    /// step yet: its memory is empty, so nothing is sent to it until the leader declared its
    /// state empty and acknowledged it (`Membership::acknowledge`).
    #[error("{worker}: restarted as incarnation {epoch:016x}; not yet brought back in step")]
    Rejoining {
        /// The worker.
        worker: WorkerAddress,
        /// Its new incarnation.
        epoch: u64,
    },
}

impl ControlError {
    /// The worker the error is about.
    pub fn worker(&self) -> WorkerAddress {
        match self {
            ControlError::Timeout { worker, .. }
            | ControlError::NoResponders { worker }
            | ControlError::Version { worker, .. }
            | ControlError::Decode { worker, .. }
            | ControlError::Refused { worker, .. }
            | ControlError::Unexpected { worker, .. }
            | ControlError::Transport { worker, .. }
            | ControlError::NotJoined { worker }
            | ControlError::Lost { worker, .. }
            | ControlError::Rejoining { worker, .. } => *worker,
        }
    }

    /// Whether the worker should be considered gone (timed out or not served).
    pub fn is_unreachable(&self) -> bool {
        matches!(
            self,
            ControlError::Timeout { .. }
                | ControlError::NoResponders { .. }
                | ControlError::NotJoined { .. }
                | ControlError::Lost { .. }
                | ControlError::Rejoining { .. }
        )
    }

    /// The kind every block of a call that failed this way fails with: a timeout is
    /// [`Timeout`](BlockFailureKind::Timeout), a lost transport
    /// [`Io`](BlockFailureKind::Io), anything else a refusal. None says a copy is bad.
    pub fn failure_kind(&self) -> BlockFailureKind {
        match self {
            ControlError::Timeout { .. } => BlockFailureKind::Timeout,
            ControlError::NoResponders { .. }
            | ControlError::Transport { .. }
            | ControlError::NotJoined { .. }
            | ControlError::Lost { .. }
            | ControlError::Rejoining { .. } => BlockFailureKind::Io,
            ControlError::Version { .. }
            | ControlError::Decode { .. }
            | ControlError::Refused { .. }
            | ControlError::Unexpected { .. } => BlockFailureKind::Refused,
        }
    }
}

/// Where a session is.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub enum Phase {
    /// The matched prefix is held; nothing moved yet.
    Holding,
    /// G3→G2 / G4→G2 staging in flight.
    Staging,
    /// The whole prefix is held in G2.
    Staged,
    /// G2→G1 in flight.
    Onboarding,
    /// The prefix is in G1 (held by the session until `finish`).
    Complete,
    /// `finish` handed the G1 blocks over (terminal).
    Finished,
    /// An abort arrived while an operation was in flight; it settles into `Aborted`.
    Aborting,
    /// Aborted; everything released (terminal).
    Aborted,
    /// An operation failed; everything released (terminal).
    Failed,
}

impl Phase {
    /// Whether no further transition can happen.
    pub fn is_terminal(self) -> bool {
        matches!(self, Phase::Finished | Phase::Aborted | Phase::Failed)
    }

    pub(crate) fn in_flight(self) -> bool {
        matches!(self, Phase::Staging | Phase::Onboarding | Phase::Aborting)
    }
}

/// Why a session failed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SessionFailure {
    /// The phase that failed (`Staging` or `Onboarding`).
    pub phase: Phase,
    /// Blocks that failed in that phase.
    pub failed_blocks: usize,
    /// The first failure's kind: whether the copy it read is proven bad
    /// ([`BlockFailureKind::drops_copy`]) or the failure was transient.
    pub kind: BlockFailureKind,
    /// The first failure's description.
    pub message: String,
}

impl SessionFailure {
    pub(crate) fn new(phase: Phase, failed_blocks: usize, first: BlockFailure) -> Self {
        Self {
            phase,
            failed_blocks,
            kind: first.kind,
            message: first.message,
        }
    }
}

/// Errors of session calls made in the wrong state.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum SessionError {
    /// The call needs another phase.
    #[error("onboarding session is {actual:?}, expected {expected:?}")]
    WrongPhase {
        /// What the call needs.
        expected: Phase,
        /// Where the session is.
        actual: Phase,
    },
    /// A mover the matched prefix needs was not given.
    #[error("no {0}→G2 mover for the {0} part of the prefix")]
    NoMover(TierId),
    /// The prefix has a remote part and no remote puller (`cross_instance::RemotePull`) was given.
    #[error("no remote G2 puller for the remote part of the prefix")]
    NoPuller,
    /// Destinations could not be allocated, or do not match the prefix length.
    #[error("destinations: {0}")]
    Destinations(String),
    /// The operation failed; the session is `Failed`.
    #[error("{:?} failed for {} block(s): {}", .0.phase, .0.failed_blocks, .0.message)]
    Failed(SessionFailure),
    /// The session was aborted before or while the operation ran.
    #[error("onboarding session aborted")]
    Aborted,
}

/// Why a credential, key or sealed message was refused.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SecurityError {
    /// A key, certificate or credential file could not be read or written.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// A key, certificate or credential is malformed or inconsistent; the text says what.
    #[error("{0}")]
    Invalid(String),
    /// A message was refused; the kind is also counted in `kvbm_cluster::security::SecurityStats`.
    #[error("message refused: {0}")]
    Rejected(Rejection),
    /// The operating system's random source failed.
    #[error("random source: {0}")]
    Random(String),
}

/// Why a sealed message was dropped (each kind has a counter in `kvbm_cluster::security::SecurityStats`).
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub enum Rejection {
    /// Not a sealed message, or cut short, or trailing bytes.
    Malformed,
    /// The certificate is not signed by this cluster's trust root.
    NotMember,
    /// The certificate has expired.
    Expired,
    /// The sender belongs to another namespace (tenant).
    OtherNamespace,
    /// The signature does not match the message under the sender's key and this context.
    BadSignature,
    /// The timestamp is further from this receiver's clock than the allowed skew.
    Stale,
    /// This sequence number from this sender was already accepted, or is older than the window.
    Replayed,
    /// The sender is a member but may not say this (wrong role, or speaking for another
    /// instance or rank). Counted by the caller through kvbm-cluster's
    /// `SecurityStats::count`.
    NotAllowed,
    /// The certificate is on the revocation list (`security.revoked_file`): by its
    /// fingerprint, or every certificate of its instance.
    Revoked,
}

impl std::fmt::Display for Rejection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Rejection::Malformed => "malformed sealed message",
            Rejection::NotMember => "certificate not signed by the trust root",
            Rejection::Expired => "certificate expired",
            Rejection::OtherNamespace => "sender is in another namespace",
            Rejection::BadSignature => "bad signature",
            Rejection::Stale => "timestamp outside the allowed clock skew",
            Rejection::Replayed => "sequence number replayed",
            Rejection::NotAllowed => "sender may not say this",
            Rejection::Revoked => "certificate revoked",
        })
    }
}
