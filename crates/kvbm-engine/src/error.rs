//! [`EngineError`]: the one error enum of this crate.
//!
//! Configuration errors carry the dotted key they are about (`offload.g2_to_g3.queue_capacity`)
//! so an operator can find the line to fix; errors of the crates below are wrapped, not
//! flattened into strings, so callers can still match on them.

use kvbm_logical::{LogicalError, TierId};

/// Result alias of this crate.
pub type Result<T, E = EngineError> = std::result::Result<T, E>;

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
    Control(#[from] crate::transport::control::ControlError),
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
    Session(#[from] crate::leader::SessionError),
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
        this: crate::worker::RankAddress,
        /// The address the request carried.
        to: crate::worker::RankAddress,
    },
    /// The tier stack ([`crate::stack`]) could not be built or could not go on: `what` names
    /// the step (with the file, tier or server concerned), `source` the cause when there is one.
    #[error("{what}{}", cause_suffix(.source))]
    Stack {
        /// The step that failed.
        what: String,
        /// Why, when another error says it.
        #[source]
        source: Option<Box<dyn std::error::Error + Send + Sync + 'static>>,
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
