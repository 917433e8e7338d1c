//! The engine's metrics, in one table: every series it reports through the [`metrics`] facade,
//! with its kind, labels and help text ([`describe`]), as kvbm-offload keeps its pipelines'
//! (`kvbm_offload::metrics`). Code names a series by its constant here, never by a string.
//!
//! The library installs no exporter; a process that installs a recorder calls [`describe`]
//! after it, so a scrape carries each series' help text (the engine's runtime does, for its
//! Prometheus endpoint; so does `kvbm --metrics-addr`).
//!
//! | name | kind | labels | what |
//! |---|---|---|---|
//! | [`STACK_TRANSFER_SECONDS`] | histogram | `path` | seconds per move batch on a path (`g2_to_g3`, `g3_to_g2`, `g4_to_g2`, `g2_to_g1`) |
//! | [`STACK_BYTES_MOVED`] | counter | `path` | bytes moved on a path |
//! | [`STACK_HIT_BLOCKS`] | counter | `tier` | prefix blocks a request found in a tier (`g1`..`g4`) |
//! | [`STACK_COMPUTED_BLOCKS`] | counter | | prefix blocks a request had to compute |
//! | [`STACK_TIER_CAPACITY_BLOCKS`] | gauge | `tier` | a tier's capacity in blocks |
//! | [`SECURITY_REJECTED`] | counter | `reason` | control-plane messages dropped by the verifier, by reason |
//! | [`REFUSED_BLOCKS`] | counter | | blocks an onboarding refused (their bytes failed a check) |
//! | [`EVENT_BATCHES_DROPPED`] | counter | | event batches dropped by a full in-process bus |
//! | [`NATS_EVENT_BATCHES_DROPPED`] | counter | | event batches dropped by a full NATS outbox |
//! | [`PRESENCE_SNAPSHOTS_THROTTLED`] | counter | | snapshot requests refused for coming too often |
//! | [`PRESENCE_MESSAGES_REJECTED`] | counter | | presence messages dropped (malformed, unsigned, foreign) |
//! | [`INDEX_DRIFT_DETECTED`] | counter | | peers whose index summary disagreed with ours |
//! | [`INDEX_RESYNCS`] | counter | | peers resynced from a snapshot |
//! | [`INDEX_ENTRIES_OVER_CAP`] | counter | | index locations dropped: their instance was at its cap |
//! | [`INDEX_RESYNC_FAILURES`] | counter | | snapshot fetches that failed (retried next tick) |
//! | [`DEPARTED_EVENT_BATCHES_IGNORED`] | counter | | event batches of a departed peer, ignored |
//! | [`UNJOINED_EVENT_BATCHES_IGNORED`] | counter | | event batches of a peer never heard by heartbeat, ignored |
//! | [`PEERS_EXPIRED`] | counter | | peers expired from the index and directory |
//! | [`SNAPSHOTS_OVER_LIMIT`] | counter | | snapshots refused for exceeding the size limits |
//! | [`WORKER_REQUESTS_REFUSED_BUSY`] | counter | | control requests a worker refused at its in-flight bound |
//! | [`DATAPLANE_CONNECTIONS_REFUSED`] | counter | | data-plane connections refused at the connection cap |
//! | [`DATAPLANE_PEER_CONNECTIONS_REFUSED`] | counter | | data-plane connections refused at the per-peer cap |
//! | [`DATAPLANE_ACCEPTS_THROTTLED`] | counter | | data-plane connections closed over their address's accept rate |
//! | [`DATAPLANE_PENDING_EVICTED`] | counter | | unauthenticated data-plane connections dropped for newer ones |
//! | [`DATAPLANE_HANDSHAKES_REFUSED`] | counter | | data-plane handshakes refused (either side) |
//! | [`DATAPLANE_TAGS_REFUSED`] | counter | | data-plane heads or frames whose tag did not verify |
//! | [`DATAPLANE_RESPONSES_TIMED_OUT`] | counter | | data-plane responses not written within the deadline |
//! | [`DATAPLANE_PULL_DEADLINES_EXCEEDED`] | counter | | pulls that missed their deadline |
//! | [`DATAPLANE_POOL_EVICTIONS`] | counter | | pooled peer connections evicted (least recently used) |
//! | [`DATAPLANE_PULLED_BLOCKS`] | counter | | blocks pulled from peers, verified and registered (remote hits) |
//! | [`DATAPLANE_PULLED_BYTES`] | counter | | bytes of those blocks |
//! | [`DATAPLANE_PULL_SECONDS`] | histogram | | seconds per pull from one peer (every block of it settled) |
//! | [`DATAPLANE_PULL_FAILED_BLOCKS`] | counter | `reason` | blocks a pull did not bring, by failure kind (`checksum_mismatch`, `not_found`, `timeout`, …) |
//! | [`INDEX_PEER_ENTRIES`] | gauge | `peer` | locations the index holds of one peer (at most `transport.snapshot_max_entries`) |
//! | [`FLEET_LOOKUPS`] | counter | `result` | a fleet tier's lookups: `local` (its own share), `remote` (a peer's, by the index), `miss` |
//! | [`FLEET_CHUNKS`] | counter | `outcome` | a fleet tier's chunks: `stored`, `store_failed`, `loaded_local`, `loaded_remote`, `load_failed` |
//!
//! The first six are the core's (one instance's tiers and its verifier); the rest are the
//! cluster plane's.

use metrics::Unit;

pub mod endpoint;

/// Label naming a move's path (`g2_to_g3`, …).
pub const PATH_LABEL: &str = "path";
/// Label naming a tier (`g1`..`g4`).
pub const TIER_LABEL: &str = "tier";
/// Label naming why something was refused.
pub const REASON_LABEL: &str = "reason";
/// Label naming a peer instance (`instance-` and its id in 16 hex digits).
pub const PEER_LABEL: &str = "peer";

/// Seconds per move batch, by `path` (histogram).
pub const STACK_TRANSFER_SECONDS: &str = "kvbm_stack_transfer_seconds";
/// Bytes moved, by `path` (counter).
pub const STACK_BYTES_MOVED: &str = "kvbm_stack_bytes_moved_total";
/// Prefix blocks found, by `tier` (counter).
pub const STACK_HIT_BLOCKS: &str = "kvbm_stack_hit_blocks_total";
/// Prefix blocks computed (counter).
pub const STACK_COMPUTED_BLOCKS: &str = "kvbm_stack_computed_blocks_total";
/// A tier's capacity in blocks, by `tier` (gauge).
pub const STACK_TIER_CAPACITY_BLOCKS: &str = "kvbm_stack_tier_capacity_blocks";
/// Control messages dropped by the verifier, by `reason` (counter).
pub const SECURITY_REJECTED: &str = "kvbm_engine_security_rejected_total";
/// Blocks an onboarding refused (counter).
pub const REFUSED_BLOCKS: &str = "kvbm_engine_refused_blocks_total";
/// Event batches dropped by a full in-process bus (counter).
pub const EVENT_BATCHES_DROPPED: &str = "kvbm_engine_event_batches_dropped_total";
/// Event batches dropped by a full NATS outbox (counter).
pub const NATS_EVENT_BATCHES_DROPPED: &str = "kvbm_engine_nats_event_batches_dropped_total";
/// Snapshot requests refused for coming too often (counter).
pub const PRESENCE_SNAPSHOTS_THROTTLED: &str = "kvbm_engine_presence_snapshots_throttled_total";
/// Presence messages dropped (counter).
pub const PRESENCE_MESSAGES_REJECTED: &str = "kvbm_engine_presence_messages_rejected_total";
/// Peers whose index summary disagreed (counter).
pub const INDEX_DRIFT_DETECTED: &str = "kvbm_engine_index_drift_detected_total";
/// Peers resynced from a snapshot (counter).
pub const INDEX_RESYNCS: &str = "kvbm_engine_index_resyncs_total";
/// Index locations dropped because their instance was at its cap (counter).
pub const INDEX_ENTRIES_OVER_CAP: &str = "kvbm_engine_index_entries_over_cap_total";
/// Snapshot fetches that failed (counter).
pub const INDEX_RESYNC_FAILURES: &str = "kvbm_engine_index_resync_failures_total";
/// Event batches of a departed peer, ignored (counter).
pub const DEPARTED_EVENT_BATCHES_IGNORED: &str = "kvbm_engine_departed_event_batches_ignored_total";
/// Event batches of a peer never heard by heartbeat, ignored (counter).
pub const UNJOINED_EVENT_BATCHES_IGNORED: &str = "kvbm_engine_unjoined_event_batches_ignored_total";
/// Peers expired from the index and directory (counter).
pub const PEERS_EXPIRED: &str = "kvbm_engine_peers_expired_total";
/// Snapshots refused for exceeding the size limits (counter).
pub const SNAPSHOTS_OVER_LIMIT: &str = "kvbm_engine_snapshots_over_limit_total";
/// Control requests a worker refused at its in-flight bound (counter).
pub const WORKER_REQUESTS_REFUSED_BUSY: &str = "kvbm_engine_worker_requests_refused_busy_total";
/// Data-plane connections refused at the connection cap (counter).
pub const DATAPLANE_CONNECTIONS_REFUSED: &str = "kvbm_engine_dataplane_connections_refused_total";
/// Data-plane connections refused at the per-peer cap (counter).
pub const DATAPLANE_PEER_CONNECTIONS_REFUSED: &str =
    "kvbm_engine_dataplane_peer_connections_refused_total";
/// Data-plane connections closed as soon as accepted: their address prefix was over its
/// accept rate (counter).
pub const DATAPLANE_ACCEPTS_THROTTLED: &str = "kvbm_engine_dataplane_accepts_throttled_total";
/// Unauthenticated data-plane connections dropped to make room for newer ones (counter).
pub const DATAPLANE_PENDING_EVICTED: &str = "kvbm_engine_dataplane_pending_evicted_total";
/// Data-plane handshakes refused (counter).
pub const DATAPLANE_HANDSHAKES_REFUSED: &str = "kvbm_engine_dataplane_handshakes_refused_total";
/// Data-plane heads or frames whose tag did not verify (counter).
pub const DATAPLANE_TAGS_REFUSED: &str = "kvbm_engine_dataplane_tags_refused_total";
/// Data-plane responses not written within the deadline (counter).
pub const DATAPLANE_RESPONSES_TIMED_OUT: &str = "kvbm_engine_dataplane_responses_timed_out_total";
/// Pulls that missed their deadline (counter).
pub const DATAPLANE_PULL_DEADLINES_EXCEEDED: &str =
    "kvbm_engine_dataplane_pull_deadlines_exceeded_total";
/// Pooled peer connections evicted (counter).
pub const DATAPLANE_POOL_EVICTIONS: &str = "kvbm_engine_dataplane_pool_evictions_total";
/// Blocks pulled from peers, verified and registered (counter).
pub const DATAPLANE_PULLED_BLOCKS: &str = "kvbm_engine_dataplane_pulled_blocks_total";
/// Bytes of the blocks pulled from peers (counter).
pub const DATAPLANE_PULLED_BYTES: &str = "kvbm_engine_dataplane_pulled_bytes_total";
/// Seconds per pull from one peer (histogram).
pub const DATAPLANE_PULL_SECONDS: &str = "kvbm_engine_dataplane_pull_seconds";
/// Blocks a pull did not bring, by `reason` (counter).
pub const DATAPLANE_PULL_FAILED_BLOCKS: &str = "kvbm_engine_dataplane_pull_failed_blocks_total";
/// Locations the cross-instance index holds of one `peer` (gauge).
pub const INDEX_PEER_ENTRIES: &str = "kvbm_engine_index_peer_entries";

/// A fleet tier's lookups, by `result` (counter; added once per scheduler step).
pub const FLEET_LOOKUPS: &str = "kvbm_engine_fleet_lookups_total";
/// A fleet tier's chunks, by `outcome` (counter; added as jobs finish).
pub const FLEET_CHUNKS: &str = "kvbm_engine_fleet_chunks_total";

/// Every series of the table: (name, kind, unit, help).
pub const TABLE: &[(&str, Kind, Unit, &str)] = &[
    (
        STACK_TRANSFER_SECONDS,
        Kind::Histogram,
        Unit::Seconds,
        "Seconds per move batch, by path.",
    ),
    (
        STACK_BYTES_MOVED,
        Kind::Counter,
        Unit::Bytes,
        "Bytes moved, by path.",
    ),
    (
        STACK_HIT_BLOCKS,
        Kind::Counter,
        Unit::Count,
        "Prefix blocks a request found, by tier.",
    ),
    (
        STACK_COMPUTED_BLOCKS,
        Kind::Counter,
        Unit::Count,
        "Prefix blocks a request had to compute.",
    ),
    (
        STACK_TIER_CAPACITY_BLOCKS,
        Kind::Gauge,
        Unit::Count,
        "A tier's capacity in blocks, by tier.",
    ),
    (
        SECURITY_REJECTED,
        Kind::Counter,
        Unit::Count,
        "Control messages dropped by the verifier, by reason.",
    ),
    (
        REFUSED_BLOCKS,
        Kind::Counter,
        Unit::Count,
        "Blocks an onboarding refused because their bytes failed a check.",
    ),
    (
        EVENT_BATCHES_DROPPED,
        Kind::Counter,
        Unit::Count,
        "Event batches dropped by a full in-process bus.",
    ),
    (
        NATS_EVENT_BATCHES_DROPPED,
        Kind::Counter,
        Unit::Count,
        "Event batches dropped by a full NATS outbox.",
    ),
    (
        PRESENCE_SNAPSHOTS_THROTTLED,
        Kind::Counter,
        Unit::Count,
        "Snapshot requests refused for coming too often.",
    ),
    (
        PRESENCE_MESSAGES_REJECTED,
        Kind::Counter,
        Unit::Count,
        "Presence messages dropped (malformed, unsigned or foreign).",
    ),
    (
        INDEX_DRIFT_DETECTED,
        Kind::Counter,
        Unit::Count,
        "Peers whose index summary disagreed with this instance's.",
    ),
    (
        INDEX_RESYNCS,
        Kind::Counter,
        Unit::Count,
        "Peers resynced from a snapshot.",
    ),
    (
        INDEX_ENTRIES_OVER_CAP,
        Kind::Counter,
        Unit::Count,
        "Cross-instance index locations dropped because their instance was at its cap.",
    ),
    (
        INDEX_RESYNC_FAILURES,
        Kind::Counter,
        Unit::Count,
        "Snapshot fetches that failed (retried next tick).",
    ),
    (
        DEPARTED_EVENT_BATCHES_IGNORED,
        Kind::Counter,
        Unit::Count,
        "Event batches of a departed peer, ignored.",
    ),
    (
        UNJOINED_EVENT_BATCHES_IGNORED,
        Kind::Counter,
        Unit::Count,
        "Event batches of a peer never heard by heartbeat, ignored.",
    ),
    (
        PEERS_EXPIRED,
        Kind::Counter,
        Unit::Count,
        "Peers expired from the index and directory.",
    ),
    (
        SNAPSHOTS_OVER_LIMIT,
        Kind::Counter,
        Unit::Count,
        "Snapshots refused for exceeding the size limits.",
    ),
    (
        WORKER_REQUESTS_REFUSED_BUSY,
        Kind::Counter,
        Unit::Count,
        "Control requests a worker refused at its in-flight bound.",
    ),
    (
        DATAPLANE_CONNECTIONS_REFUSED,
        Kind::Counter,
        Unit::Count,
        "Data-plane connections refused at the connection cap.",
    ),
    (
        DATAPLANE_PEER_CONNECTIONS_REFUSED,
        Kind::Counter,
        Unit::Count,
        "Data-plane connections refused at the per-peer cap.",
    ),
    (
        DATAPLANE_ACCEPTS_THROTTLED,
        Kind::Counter,
        Unit::Count,
        "Data-plane connections closed over their address's accept rate.",
    ),
    (
        DATAPLANE_PENDING_EVICTED,
        Kind::Counter,
        Unit::Count,
        "Unauthenticated data-plane connections dropped to make room for newer ones.",
    ),
    (
        DATAPLANE_HANDSHAKES_REFUSED,
        Kind::Counter,
        Unit::Count,
        "Data-plane handshakes refused.",
    ),
    (
        DATAPLANE_TAGS_REFUSED,
        Kind::Counter,
        Unit::Count,
        "Data-plane heads or frames whose tag did not verify.",
    ),
    (
        DATAPLANE_RESPONSES_TIMED_OUT,
        Kind::Counter,
        Unit::Count,
        "Data-plane responses not written within the deadline.",
    ),
    (
        DATAPLANE_PULL_DEADLINES_EXCEEDED,
        Kind::Counter,
        Unit::Count,
        "Pulls that missed their deadline.",
    ),
    (
        DATAPLANE_POOL_EVICTIONS,
        Kind::Counter,
        Unit::Count,
        "Pooled peer connections evicted, least recently used first.",
    ),
    (
        DATAPLANE_PULLED_BLOCKS,
        Kind::Counter,
        Unit::Count,
        "Blocks pulled from peers, verified and registered (remote hits).",
    ),
    (
        DATAPLANE_PULLED_BYTES,
        Kind::Counter,
        Unit::Bytes,
        "Bytes of the blocks pulled from peers.",
    ),
    (
        DATAPLANE_PULL_SECONDS,
        Kind::Histogram,
        Unit::Seconds,
        "Seconds per pull from one peer, every block of it settled.",
    ),
    (
        DATAPLANE_PULL_FAILED_BLOCKS,
        Kind::Counter,
        Unit::Count,
        "Blocks a pull did not bring, by failure kind.",
    ),
    (
        INDEX_PEER_ENTRIES,
        Kind::Gauge,
        Unit::Count,
        "Locations the cross-instance index holds of one peer.",
    ),
    (
        FLEET_LOOKUPS,
        Kind::Counter,
        Unit::Count,
        "A fleet tier's lookups: local (its share), remote (a peer's, by the index), miss.",
    ),
    (
        FLEET_CHUNKS,
        Kind::Counter,
        Unit::Count,
        "A fleet tier's chunks: stored, store_failed, loaded_local, loaded_remote, load_failed.",
    ),
];

/// A series' kind.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// Only goes up.
    Counter,
    /// Set to the current value.
    Gauge,
    /// Observations.
    Histogram,
}

/// Describes every series of the table, and kvbm-offload's, to the installed recorder.
pub fn describe() {
    for &(name, kind, unit, help) in TABLE {
        match kind {
            Kind::Counter => metrics::describe_counter!(name, unit, help),
            Kind::Gauge => metrics::describe_gauge!(name, unit, help),
            Kind::Histogram => metrics::describe_histogram!(name, unit, help),
        }
    }
    kvbm_offload::metrics::describe();
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_unique_and_kvbm_prefixed() {
        let mut seen = std::collections::HashSet::new();
        for (name, _, _, help) in TABLE {
            assert!(name.starts_with("kvbm_"), "{name}");
            assert!(seen.insert(*name), "{name} twice");
            assert!(!help.is_empty(), "{name} has no help");
        }
        assert_eq!(TABLE.len(), 36);
    }

    #[test]
    fn a_scrape_carries_the_help_and_kind_of_each_series() {
        let recorder = metrics_exporter_prometheus::PrometheusBuilder::new().build_recorder();
        let handle = recorder.handle();
        metrics::with_local_recorder(&recorder, || {
            describe();
            for &(name, kind, _, _) in TABLE {
                match kind {
                    Kind::Counter => metrics::counter!(name).increment(1),
                    Kind::Gauge => metrics::gauge!(name).set(1.0),
                    Kind::Histogram => metrics::histogram!(name).record(1.0),
                }
            }
        });
        let text = handle.render();
        for &(name, kind, _, help) in TABLE {
            assert!(
                text.contains(&format!("# HELP {name} {help}")),
                "{name}: {text}"
            );
            let ty = match kind {
                Kind::Counter => "counter",
                Kind::Gauge => "gauge",
                Kind::Histogram => "summary",
            };
            assert!(text.contains(&format!("# TYPE {name} {ty}")), "{name}");
        }
    }
}
