//! `OffloadingSpec`: configuration → manager (vLLM `OffloadingSpec` / `CPUOffloadingSpec`).
//!
//! One serde struct with defaults (unknown fields rejected), validated at construction. Event
//! capture stays inert unless `enable_kv_cache_events` is on, since nobody drains `take_events`
//! otherwise.

use serde::{Deserialize, Serialize};

use crate::cpu::{CachePolicyKind, CpuManagerConfig};
use crate::error::{Result, TieringError};
use crate::manager::OffloadingManager;
use crate::tiering::TieringOffloadingManager;
use crate::types::OffloadingKVEventsConfig;

fn default_policy() -> String {
    "lru".into()
}
fn default_tracker() -> usize {
    64_000
}
fn default_true() -> bool {
    true
}
fn default_one() -> usize {
    1
}

/// The `kv_connector_extra_config` keys this crate understands.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct OffloadingSpecConfig {
    /// Primary capacity in chunks (or give `cpu_bytes_to_use` and `chunk_bytes`).
    #[serde(default)]
    pub num_chunks: Option<usize>,
    /// Host bytes for the primary tier.
    #[serde(default)]
    pub cpu_bytes_to_use: Option<u64>,
    /// Bytes per chunk (with `cpu_bytes_to_use`).
    #[serde(default)]
    pub chunk_bytes: Option<u64>,
    /// `lru` or `arc`.
    #[serde(default = "default_policy")]
    pub eviction_policy: String,
    /// Store a chunk only when offered this many times (≥ 2 enables).
    #[serde(default)]
    pub store_threshold: u32,
    /// Tracker capacity of the store threshold.
    #[serde(default = "default_tracker")]
    pub max_tracker_size: usize,
    /// Offload only prompt (prefill) chunks.
    #[serde(default = "default_true")]
    pub offload_prompt_only: bool,
    /// GPU blocks per offloaded chunk.
    #[serde(default = "default_one")]
    pub blocks_per_chunk: usize,
    /// Global KV event publishing.
    #[serde(default)]
    pub enable_kv_cache_events: bool,
    /// Self-describing BlockStored payloads.
    #[serde(default)]
    pub self_describing_kv_events: bool,
}

/// A validated spec.
#[derive(Clone, Debug)]
pub struct OffloadingSpec {
    /// The configuration.
    pub config: OffloadingSpecConfig,
    /// Primary capacity in chunks.
    pub num_chunks: usize,
    /// Cache policy.
    pub policy: CachePolicyKind,
    /// Event capture.
    pub kv_events_config: OffloadingKVEventsConfig,
}

impl OffloadingSpec {
    /// Parses and validates a JSON `extra_config`.
    pub fn from_json(v: &serde_json::Value) -> Result<Self> {
        let c: OffloadingSpecConfig = serde_json::from_value(v.clone())
            .map_err(|e| TieringError::Config(format!("offloading spec: {e}")))?;
        Self::new(c)
    }

    /// Validates a configuration.
    pub fn new(config: OffloadingSpecConfig) -> Result<Self> {
        let num_chunks = match (
            config.num_chunks,
            config.cpu_bytes_to_use,
            config.chunk_bytes,
        ) {
            (Some(n), None, _) => n,
            (None, Some(b), Some(c)) if c > 0 => (b / c) as usize,
            _ => {
                return Err(TieringError::Config(
                    "offloading spec: give num_chunks, or cpu_bytes_to_use with chunk_bytes > 0"
                        .into(),
                ));
            }
        };
        let policy = CachePolicyKind::parse(&config.eviction_policy).ok_or_else(|| {
            TieringError::Config(format!(
                "offloading spec: unknown eviction_policy {:?} (lru, arc)",
                config.eviction_policy
            ))
        })?;
        if config.blocks_per_chunk == 0 {
            return Err(TieringError::Config(
                "offloading spec: blocks_per_chunk must be > 0".into(),
            ));
        }
        let kv_events_config = OffloadingKVEventsConfig {
            enable_kv_cache_events: config.enable_kv_cache_events,
            self_describing_kv_events: config.enable_kv_cache_events
                && config.self_describing_kv_events,
        };
        Ok(Self {
            config,
            num_chunks,
            policy,
            kv_events_config,
        })
    }

    /// The scheduler-side manager.
    pub fn get_manager(&self) -> Box<dyn OffloadingManager> {
        Box::new(TieringOffloadingManager::cpu(
            CpuManagerConfig::new(self.num_chunks)
                .policy(self.policy)
                .events(self.kv_events_config.capture())
                .store_threshold(self.config.store_threshold, self.config.max_tracker_size),
        ))
    }

    /// Chunks of a request the scheduler may offer to `prepare_store`: with
    /// `offload_prompt_only`, only chunks fully inside the prompt.
    pub fn storable_chunks(&self, prompt_chunks: usize, total_chunks: usize) -> usize {
        if self.config.offload_prompt_only {
            prompt_chunks.min(total_chunks)
        } else {
            total_chunks
        }
    }
}
