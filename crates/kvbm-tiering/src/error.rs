//! The crate's one error type. Every misuse of the manager contract names the call and the key
//! (or request) and is returned before any state changes.

use crate::key::{InvalidKey, OffloadKey};

/// Errors of `kvbm-tiering`.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TieringError {
    /// Key bytes of an unsupported length.
    #[error("offload key of {len} bytes: keys are 4..={max} bytes (hash + 4-byte group index)")]
    InvalidKey {
        /// Length given.
        len: usize,
        /// Longest supported key.
        max: usize,
    },
    /// A key that is not held by the manager was handed to a call that needs it.
    #[error("{call}: key {key} is not held by the manager")]
    UnknownKey {
        /// The call that was misused.
        call: &'static str,
        /// The offending key.
        key: OffloadKey,
    },
    /// A key in the wrong state for the call (e.g. `prepare_load` of a key still being written,
    /// `complete_load` of a key with no outstanding load).
    #[error("{call}: key {key} is {state}")]
    KeyState {
        /// The call that was misused.
        call: &'static str,
        /// The offending key.
        key: OffloadKey,
        /// What was wrong with the key.
        state: &'static str,
    },
    /// A step of a call driven phase by phase (a host language honouring overridden hooks)
    /// was handed something the manager did not give out, e.g. a chunk id the pool did not
    /// allocate.
    #[error("{call}: {what}")]
    Contract {
        /// The call that was misused.
        call: &'static str,
        /// What was wrong.
        what: String,
    },
    /// A request the manager has no state for (no `on_new_request`, or already finalised).
    #[error("{call}: unknown request {req_id:?} (on_new_request not called, or already finalised)")]
    UnknownRequest {
        /// The call that was misused.
        call: &'static str,
        /// The request id.
        req_id: String,
    },
    /// `complete_store` without a matching `prepare_store` that returned keys to store.
    #[error("{call}: request {req_id:?} has no pending primary store")]
    NoPendingStore {
        /// The call that was misused.
        call: &'static str,
        /// The request id.
        req_id: String,
    },
    /// A secondary tier reported a job the manager does not track, or under the wrong tier.
    #[error("tier #{tier} reported job {job_id}: {what}")]
    UnknownJob {
        /// Reporting tier index.
        tier: usize,
        /// Job id reported.
        job_id: u64,
        /// What was wrong.
        what: &'static str,
    },
    /// A secondary tier failed (shutdown, I/O).
    #[error("secondary tier #{tier} ({tier_type}): {message}")]
    Tier {
        /// Tier index.
        tier: usize,
        /// Tier type label.
        tier_type: String,
        /// What failed.
        message: String,
    },
    /// Invalid configuration.
    #[error("invalid configuration: {0}")]
    Config(String),
    /// Bytes layer error (allocating or moving primary memory).
    #[error(transparent)]
    Physical(#[from] kvbm_physical::PhysicalError),
    /// A seam of kvbm-offload refused (binding a tier, building a mover).
    #[error(transparent)]
    Offload(#[from] kvbm_offload::OffloadError),
    /// The manager was shut down.
    #[error("{call}: manager is shut down")]
    Shutdown {
        /// The call made after shutdown.
        call: &'static str,
    },
}

/// Result alias.
pub type Result<T, E = TieringError> = std::result::Result<T, E>;

impl From<InvalidKey> for TieringError {
    fn from(e: InvalidKey) -> Self {
        TieringError::InvalidKey {
            len: e.len,
            max: e.max,
        }
    }
}
