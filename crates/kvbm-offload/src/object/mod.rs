//! Object-storage destinations (G2→G4): presence checks, distributed locks, object pipelines.
//!
//! Several workers may offload the same prefix to one bucket. Two policies keep them from
//! writing the same object twice:
//!
//! ```text
//!  ObjectPresenceFilter:      probe block header ──► this block? filter : pass (absent or foreign)
//!  ObjectLockPresenceFilter:  probe block header ──► this block? filter
//!                               └─► PUT lock (If-None-Match: *) ──► created ─────────────────────┐
//!                                     └─► exists: GET lock ──► unparseable or live? filter        │
//!                                           └─► expired: PUT lock (If-Match: its ETag) ──► lost? filter
//!                                                 └─► replaced ──────────────────────────────────┤
//!                               after lock_verify_delay: GET lock ──► not our token? filter ◄─────┘
//!                                 └─► probe again ──► this block? release + filter : pass (lock held)
//!                             … transfer …  ──► release(): GET lock, DELETE if our acquisition's token
//! ```
//!
//! One concept per file:
//!
//! * [`keys`]: the object key, lock key and header identity of a block;
//! * [`presence`]: presence checks ([`S3PresenceChecker`], [`ObjectPresenceFilter`]);
//! * [`lock`]: the distributed lock protocol ([`ObjectLockPresenceFilter`]);
//! * [`pipeline`]: the G2→G4 pipeline ([`ObjectPipelineBuilder`], [`ObjectPipeline`]).
//!
//! # Presence means "this block", not "some object"
//!
//! A presence check reads the object's header (one ranged GET, the cost of a HEAD) through
//! [`ObjectStorage::probe`](kvbm_physical::ObjectStorage::probe), which verifies the key,
//! namespace, tensor-parallel rank, the block's identity (its sequence hash) and the layout
//! geometry. An object written for another key, namespace, rank or geometry, or whose header is
//! corrupt, is *foreign*: it counts as absent, so the block passes the filter and the offload
//! overwrites it. A foreign object whose header is intact but whose payload is corrupt passes
//! the probe; a verified read of it fails with
//! [`BlockFailureKind::ChecksumMismatch`](crate::BlockFailureKind), and the reader is expected to
//! delete it ([`ObjectStorage::delete`](kvbm_physical::ObjectStorage::delete)) so the next
//! offload rewrites it.
//!
//! Every request goes through [`ObjectStorage`](kvbm_physical::ObjectStorage), which applies the
//! namespace, the rank directory and the request limit; this module never sees the raw store.

pub mod keys;
pub mod lock;
pub mod pipeline;
pub mod presence;

pub use keys::{block_identity, digest_named, identity_of, lock_key, object_key};
pub use lock::{DEFAULT_LOCK_TTL, DEFAULT_LOCK_VERIFY_DELAY, ObjectLockPresenceFilter};
pub use pipeline::{ObjectPipeline, ObjectPipelineBuilder};
pub use presence::{
    EveryChecker, ObjectPresenceFilter, PresenceChecker, S3PresenceChecker, StoredBlock,
};

/// Requests in flight per presence batch.
pub(crate) const CHECK_CONCURRENCY: usize = 64;

#[cfg(test)]
mod tests;
