//! Metrics through the [`metrics`] facade (no exporter here; install a recorder in the binary).
//!
//! Every series carries a `tier` label (`G1`..`G4`). Counters are updated once per batch
//! operation; the pool gauges are refreshed by `allocate_blocks`, `register_blocks`,
//! `match_blocks`, `scan_matches` and `reset_inactive_pool` (not by each drop, which stays
//! lock-light).

use metrics::{Counter, Gauge, counter, gauge};

use crate::tier::TierId;

/// Blocks handed out by `allocate_blocks` (counter).
pub const ALLOCATIONS: &str = "kvbm_logical_allocated_blocks_total";
/// Inactive blocks evicted to satisfy allocations or by `reset_inactive_pool` (counter).
pub const EVICTIONS: &str = "kvbm_logical_evicted_blocks_total";
/// Calls to `match_blocks` and `scan_matches` (counter).
pub const MATCH_REQUESTS: &str = "kvbm_logical_match_requests_total";
/// Blocks returned by `match_blocks` and `scan_matches` (counter).
pub const MATCHED_BLOCKS: &str = "kvbm_logical_matched_blocks_total";
/// Blocks registered (counter).
pub const REGISTRATIONS: &str = "kvbm_logical_registered_blocks_total";
/// Blocks in the reset pool (gauge).
pub const RESET_BLOCKS: &str = "kvbm_logical_reset_blocks";
/// Registered blocks with a strong reference (gauge).
pub const ACTIVE_BLOCKS: &str = "kvbm_logical_active_blocks";
/// Registered blocks without a strong reference, still matchable (gauge).
pub const INACTIVE_BLOCKS: &str = "kvbm_logical_inactive_blocks";

pub(crate) struct Metrics {
    pub(crate) allocations: Counter,
    pub(crate) evictions: Counter,
    pub(crate) match_requests: Counter,
    pub(crate) matched_blocks: Counter,
    pub(crate) registrations: Counter,
    pub(crate) reset: Gauge,
    pub(crate) active: Gauge,
    pub(crate) inactive: Gauge,
}

impl Metrics {
    pub(crate) fn new(tier: TierId) -> Self {
        let t = tier.as_str();
        Self {
            allocations: counter!(ALLOCATIONS, "tier" => t),
            evictions: counter!(EVICTIONS, "tier" => t),
            match_requests: counter!(MATCH_REQUESTS, "tier" => t),
            matched_blocks: counter!(MATCHED_BLOCKS, "tier" => t),
            registrations: counter!(REGISTRATIONS, "tier" => t),
            reset: gauge!(RESET_BLOCKS, "tier" => t),
            active: gauge!(ACTIVE_BLOCKS, "tier" => t),
            inactive: gauge!(INACTIVE_BLOCKS, "tier" => t),
        }
    }
}
