//! Serde configuration for one tier's logical block manager, with defaults.
//!
//! `kvbm-engine` merges this (TOML file, then `KVBM_*` environment) under its `[logical]`
//! section; this crate never reads the environment.

use serde::{Deserialize, Serialize};

use crate::events::EventBatchConfig;
use crate::hash::DEFAULT_BLOCK_SIZE;
use crate::registry::RegistryConfig;

/// Which eviction order the inactive pool uses.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum EvictionBackend {
    /// Least recently released first.
    #[default]
    Lru,
    /// Four LRU levels by registry frequency (thresholds 3, 8, 15): the lowest non-empty level
    /// is evicted first, least recently released first within a level.
    MultiLru,
    /// Leaves first: never a block whose child is still cached in this tier (a prefix match
    /// stops at the first missing block, so evicting a parent would strand its children).
    /// Least recently released leaf first; a parent freed by evicting its last child is queued
    /// as the next victim, so stale chains are consumed from the tail.
    Lineage,
    /// First registered, first evicted, regardless of reuse.
    Fifo,
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
    /// Inactive-pool eviction order. Default: `lru`.
    pub eviction: EvictionBackend,
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
            eviction: EvictionBackend::default(),
            duplication: DuplicationPolicy::default(),
            touch_on_match: true,
            events: EventBatchConfig::default(),
            registry: RegistryConfig::default(),
        }
    }
}
