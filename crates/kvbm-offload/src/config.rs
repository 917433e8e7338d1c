//! Configuration: one serde struct per pipeline, every knob settable, defaults in one place.
//!
//! | key | default | meaning |
//! |---|---|---|
//! | `batch_config.max_batch_size` | 64 | maximum blocks per batch (a larger container is a batch of its own, never split) |
//! | `batch_config.min_batch_size` | 8 | blocks needed before a batch is flushed without waiting |
//! | `batch_config.flush_interval_ms` | 10 | time before a partial batch is flushed anyway |
//! | `policy_timeout_ms` | 100 | timeout for one policy evaluation (blocks are filtered on timeout); at least 1 |
//! | `sweep_interval_ms` | 10 | backstop interval of the cancel sweeper |
//! | `max_concurrent_transfers` | 1 | transfer batches in flight at once (1 ..= 2^20) |
//! | `queue_capacity` | 1024 | capacity of the input queue and of each inter-stage queue (containers or batches), and most containers waiting on their precondition: the backpressure bound (`enqueue` waits, `try_enqueue` says `Full`) |
//! | `max_concurrent_evaluations` | 64 | asynchronous policy evaluations in flight |
//! | `record_timing` | true | record a [`TimingTrace`](crate::handle::TimingTrace) per block |
//! | `sweep_on_cancel` | true | sweep at once on every cancellation, not only periodically |
//! | `policies` | `[]` (pass all) | policies, combined with AND, see [`PolicyConfig`] |
//!
//! Durations are written in milliseconds in files (`*_ms`), so the TOML stays plain integers.

use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::error::OffloadError;

mod ms {
    use serde::{Deserialize, Deserializer, Serializer};
    use std::time::Duration;

    pub(super) fn serialize<S: Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_u64(d.as_millis() as u64)
    }
    pub(super) fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
        Ok(Duration::from_millis(u64::deserialize(d)?))
    }
}

/// Configuration for batch collection.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct BatchConfig {
    /// Maximum blocks per batch. A container is never split (P1): one larger than this is a
    /// batch of its own. Default: 64.
    pub max_batch_size: usize,
    /// Blocks needed before a batch is flushed as soon as no more are immediately available.
    /// Default: 8.
    pub min_batch_size: usize,
    /// Time, from the first block of a batch, after which a partial batch is flushed anyway.
    /// Default: 10 ms.
    #[serde(with = "ms", rename = "flush_interval_ms")]
    pub flush_interval: Duration,
}

impl Default for BatchConfig {
    fn default() -> Self {
        Self {
            max_batch_size: 64,
            min_batch_size: 8,
            flush_interval: Duration::from_millis(10),
        }
    }
}

/// Policy selection in configuration; see [`create_policy_from_config`](crate::create_policy_from_config).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum PolicyConfig {
    /// Pass everything.
    PassAll,
    /// Skip blocks already present in the destination tier.
    Presence,
    /// Skip blocks already present, and blocks seen fewer than `min_lfu_count` times.
    PresenceLfu {
        /// Frequency threshold. Default: 1.
        #[serde(default = "default_min_lfu")]
        min_lfu_count: u32,
    },
}

/// Default frequency threshold of the G2→G3 LFU filter
/// ([`PresenceAndLFUFilter`](crate::policy::PresenceAndLFUFilter)).
pub const DEFAULT_MIN_LFU_COUNT: u32 = 1;

/// Default lifetime of a G4 lock object; see [`ObjectPipelineConfig::lock_ttl`].
pub const DEFAULT_LOCK_TTL: Duration = Duration::from_secs(60);

fn default_min_lfu() -> u32 {
    DEFAULT_MIN_LFU_COUNT
}

/// Configuration for a pipeline.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct PipelineConfig {
    /// Batching. Default: see [`BatchConfig`].
    pub batch_config: BatchConfig,
    /// Timeout for one policy evaluation; blocks whose evaluation times out are filtered. Must
    /// be at least 1 ms. Default: 100 ms.
    #[serde(with = "ms", rename = "policy_timeout_ms")]
    pub policy_timeout: Duration,
    /// Backstop interval of the cancel sweeper (it also runs on every cancellation).
    /// Default: 10 ms.
    #[serde(with = "ms", rename = "sweep_interval_ms")]
    pub sweep_interval: Duration,
    /// Transfer batches in flight at once. Default: 1.
    pub max_concurrent_transfers: usize,
    /// Capacity of the input queue and of each inter-stage queue (containers or batches), and
    /// the most containers waiting on their precondition at once. When the input queue is full,
    /// `enqueue` waits and `try_enqueue` returns `Full` with the blocks. Default: 1024.
    pub queue_capacity: usize,
    /// Asynchronous policy evaluations in flight at once. Default: 64.
    pub max_concurrent_evaluations: usize,
    /// Record a timing trace per block. Default: true.
    pub record_timing: bool,
    /// Sweep at once when a token is cancelled (otherwise only every `sweep_interval`).
    /// Turning it off trades confirmation latency for less sweeping under heavy cancellation.
    /// Default: true.
    pub sweep_on_cancel: bool,
    /// Policies, combined with AND; empty passes all. Default: empty.
    pub policies: Vec<PolicyConfig>,
    /// How long a batch waits for room in its destination tier (every slot held, e.g. by
    /// lanes below still writing) before its blocks fail `NoSpace`: 0 drops them at once (the
    /// lane is best effort), more waits, retrying with a short backoff (backpressure instead of
    /// lost blocks). A batch larger than the whole destination fails at once. Applied by
    /// executors that allocate destinations ([`BlockMoveExecutor`](crate::BlockMoveExecutor)).
    /// Default: 0.
    #[serde(with = "ms", rename = "room_patience_ms")]
    pub room_patience: Duration,
}

impl Default for PipelineConfig {
    fn default() -> Self {
        Self {
            batch_config: BatchConfig::default(),
            policy_timeout: Duration::from_millis(100),
            sweep_interval: Duration::from_millis(10),
            max_concurrent_transfers: 1,
            queue_capacity: 1024,
            max_concurrent_evaluations: 64,
            record_timing: true,
            sweep_on_cancel: true,
            policies: Vec::new(),
            room_patience: Duration::ZERO,
        }
    }
}

impl PipelineConfig {
    /// Checks the values fit together.
    ///
    /// # Errors
    /// [`OffloadError::InvalidConfig`] naming the offending key.
    pub fn validate(&self) -> Result<(), OffloadError> {
        let b = &self.batch_config;
        let bad = |m: &str| Err(OffloadError::InvalidConfig(m.to_string()));
        if b.max_batch_size == 0 {
            return bad("batch_config.max_batch_size must be at least 1");
        }
        if b.min_batch_size > b.max_batch_size {
            return bad("batch_config.min_batch_size must not exceed max_batch_size");
        }
        if self.policy_timeout.is_zero() {
            return bad(
                "policy_timeout_ms must be at least 1 (0 would filter every asynchronous policy)",
            );
        }
        if self.max_concurrent_transfers == 0 {
            return bad("max_concurrent_transfers must be at least 1");
        }
        if self.max_concurrent_transfers > MAX_CONCURRENT_TRANSFERS {
            return Err(OffloadError::InvalidConfig(format!(
                "max_concurrent_transfers must be at most {MAX_CONCURRENT_TRANSFERS}"
            )));
        }
        if self.queue_capacity == 0 {
            return bad("queue_capacity must be at least 1");
        }
        if self.max_concurrent_evaluations == 0 {
            return bad("max_concurrent_evaluations must be at least 1");
        }
        Ok(())
    }
}

/// The largest accepted `max_concurrent_transfers` (far above any useful value; a semaphore
/// cannot hold more permits).
pub const MAX_CONCURRENT_TRANSFERS: usize = 1 << 20;

/// Default policy timeout of object pipelines: their policies make remote requests.
pub const DEFAULT_OBJECT_POLICY_TIMEOUT: Duration = Duration::from_secs(2);

/// Configuration for an object storage pipeline (G2→G4).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ObjectPipelineConfig {
    /// The pipeline proper. Default: [`PipelineConfig::default`] except `policy_timeout`,
    /// which is [`DEFAULT_OBJECT_POLICY_TIMEOUT`] (presence checks and locks are remote).
    pub pipeline: PipelineConfig,
    /// Delay before a freshly created lock is read back to confirm ownership (see
    /// [`ObjectLockPresenceFilter`](crate::object::ObjectLockPresenceFilter)). Default: 20 ms.
    #[serde(with = "ms", rename = "lock_verify_delay_ms")]
    pub lock_verify_delay: Duration,
    /// Take a per-object lock (S3 conditional create) before offloading, so several workers
    /// racing for the same block write it once. Default: true.
    pub use_locks: bool,
    /// Lifetime of a lock object, recorded in it with its creation time: once
    /// `created + ttl` is past (by the clock of the worker reading it), another worker may break
    /// the lock, so a worker that crashed holding it does not block the block forever.
    ///
    /// Assumes loosely synchronized clocks between workers, and must exceed the longest time a
    /// lock is held: policy evaluation, queueing, batching and the transfer itself. A lock that
    /// outlives its TTL is not lost, but another worker may then upload the same block again
    /// (identical bytes; see [`ObjectLockPresenceFilter`](crate::object::ObjectLockPresenceFilter)).
    /// Must exceed `lock_verify_delay` and `pipeline.policy_timeout`. Default: 60 s
    /// ([`DEFAULT_LOCK_TTL`]).
    #[serde(with = "ms", rename = "lock_ttl_ms")]
    pub lock_ttl: Duration,
}

impl Default for ObjectPipelineConfig {
    fn default() -> Self {
        Self {
            pipeline: PipelineConfig {
                policy_timeout: DEFAULT_OBJECT_POLICY_TIMEOUT,
                ..PipelineConfig::default()
            },
            lock_verify_delay: Duration::from_millis(20),
            use_locks: true,
            lock_ttl: DEFAULT_LOCK_TTL,
        }
    }
}

impl ObjectPipelineConfig {
    /// Checks the values fit together: the pipeline's, and `lock_ttl` longer than both
    /// `lock_verify_delay` and `pipeline.policy_timeout` (a lock must not expire while it is
    /// still being taken).
    ///
    /// # Errors
    /// [`OffloadError::InvalidConfig`] naming the offending key.
    pub fn validate(&self) -> Result<(), OffloadError> {
        self.pipeline.validate()?;
        let bad = |m: &str| Err(OffloadError::InvalidConfig(m.to_string()));
        if self.lock_ttl <= self.lock_verify_delay {
            return bad("lock_ttl_ms must exceed lock_verify_delay_ms");
        }
        if self.lock_ttl <= self.pipeline.policy_timeout {
            return bad("lock_ttl_ms must exceed pipeline.policy_timeout_ms");
        }
        if !self.pipeline.room_patience.is_zero() {
            return bad(
                "pipeline.room_patience_ms must be 0: the object lane writes objects, it has no slots to wait for",
            );
        }
        Ok(())
    }
}
