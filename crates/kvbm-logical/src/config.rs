//! Serde configuration for one tier's logical block manager, with defaults.
//!
//! `kvbm-engine` merges this (TOML file, then `KVBM_*` environment) under its `[logical]`
//! section; this crate never reads the environment.

use serde::{Deserialize, Serialize};

use crate::events::EventBatchConfig;
use crate::hash::{DEFAULT_BLOCK_SIZE, HashAlgorithm};
use crate::registry::RegistryConfig;

pub use crate::eviction::{Admission, EvictionBackend, EvictionPolicy};

/// In which order an allocation hands out the slots it freed by eviction.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FreeSlotReuse {
    /// In eviction order (first evicted, first handed out).
    #[default]
    EvictionOrder,
    /// Last in, first out: as if each evicted slot were pushed on the free stack and popped
    /// back, so the last evicted slot is handed out first (vLLM's CPU offloading manager).
    /// Released unregistered slots are always reused LIFO.
    Lifo,
}

/// What `register_blocks` does when a block with the same hash is already registered.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DuplicationPolicy {
    /// Keep both: the new block is registered as a duplicate (matchable through its handle only;
    /// its slot returns to the reset pool when released).
    #[default]
    Allow,
    /// Return the existing block instead; the new block's slot returns to the reset pool.
    Reject,
}

/// Settings of one tier's logical block manager.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct LogicalConfig {
    /// Tokens per block: a power of two in `1..=1024`. Default: 16.
    pub block_size: u32,
    /// Inactive-pool eviction policy by name (`lru`, `multi_lru`, `lineage`, `fifo`, `arc`,
    /// `s3fifo`, `belady`, or `tinylfu-<one of those>`, `adaptive-<one of those>`). Default: `adaptive-lru`.
    pub eviction: EvictionPolicy,
    /// Block identity algorithm for sequences built for this tier: `blake3` (256-bit
    /// cryptographic digest, carried with registered blocks and bound as the identity of
    /// blocks in G3/G4) or `xxh3` (fast, 64-bit; only when every tier is private to one
    /// process and inputs are trusted). Default: `blake3`.
    pub hash_algorithm: HashAlgorithm,
    /// Order in which slots freed by eviction are handed out. Default: `eviction_order`.
    pub free_slot_reuse: FreeSlotReuse,
    /// Duplicate registration policy. Default: `allow`.
    pub duplication: DuplicationPolicy,
    /// Whether `match_blocks`/`scan_matches` record a registry touch per matched block.
    /// Default: `true`.
    pub touch_on_match: bool,
    /// Event batching. Default: see [`EventBatchConfig`].
    pub events: EventBatchConfig,
    /// Registry (frequency sketch) settings, used when the manager creates its own registry.
    pub registry: RegistryConfig,
}

impl Default for LogicalConfig {
    fn default() -> Self {
        Self {
            block_size: DEFAULT_BLOCK_SIZE,
            eviction: EvictionPolicy::default(),
            hash_algorithm: HashAlgorithm::default(),
            free_slot_reuse: FreeSlotReuse::default(),
            duplication: DuplicationPolicy::default(),
            touch_on_match: true,
            events: EventBatchConfig::default(),
            registry: RegistryConfig::default(),
        }
    }
}
