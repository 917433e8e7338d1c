//! One configuration tree for the whole stack, merged by figment and validated at start.
//!
//! # Why one tree
//!
//! Every crate below owns the serde struct of its own section (defaults in code, unknown keys
//! rejected), and none of them reads the environment. This module composes those sections with
//! the engine's own ([`EventsConfig`], [`MetricsConfig`], [`TransportConfig`], ...) into
//! [`KvbmConfig`], so there is exactly one place where configuration enters the process and one
//! place where it is checked. `config/kvbm.toml` documents the whole tree and a workspace test
//! parses it into [`KvbmConfig`] and compares it with [`KvbmConfig::default`].
//!
//! # Sources, lowest to highest priority
//!
//! ```text
//!  built-in defaults        (serde `default` on every struct)
//!        |  overridden by
//!  TOML file                (ConfigBuilder::file, or KVBM_CONFIG_PATH)
//!        |  overridden by
//!  KVBM_* environment       (KVBM_OFFLOAD__G2_TO_G3__QUEUE_CAPACITY=64: `__` nests, names lower-cased)
//!        |  overridden by
//!  explicit overrides       (ConfigBuilder::set("offload.g2_to_g3.queue_capacity", 64))
//!        v
//!  extract (wrong type / unknown key / unknown tier -> error naming the key)
//!        v
//!  KvbmConfig::validate (ranges and cross-field rules -> error naming the key)
//! ```
//!
//! Environment values are parsed like figment's `Env` provider: `64` is a number, `true` a
//! bool, `[G2,G3]` an array, anything else a string; the value of a secret key
//! ([`is_secret_key`]: `token`, `password`) is kept as the text given. A `KVBM_*` variable without `__` cannot
//! name a key (every key lives in a section) and is not configuration: `KVBM_CONFIG_PATH`
//! itself, and the test harness's `KVBM_TEST_*`, are of that kind and are ignored.
//!
//! # Where the environment is read
//!
//! Only in [`ConfigBuilder::from_process_env`] (used by the runtime builder's `from_env_*`).
//! Tests pass an explicit variable list to [`ConfigBuilder::from_env_vars`] instead, so they
//! never race on the process environment.
//!
//! # Secrets
//!
//! A secret (a NATS token or password) is a [`Secret`]: its `Debug`, `Display` and
//! `Serialize` print `"<redacted>"`, so a derived `Debug` of this tree, `kvbm config show` and
//! every error built from it show no secret; only the NATS connect call reads
//! [`Secret::expose`]. A NATS url carrying userinfo (`nats://user:pw@host`) is refused by
//! [`KvbmConfig::validate`] ([`check_nats_url`]) with an error naming the key and not the url:
//! urls are printed in errors, logs and child command lines, so credentials live only in
//! `[transport.nats_auth]`, preferably as files (`token_file`, `password_file`, `nkey_file`,
//! `creds_file`). Off loopback, a NATS server without NATS credentials is refused unless
//! `security.insecure` ([`NatsAuthConfig::require_for`]).
//!
//! # Invariants
//!
//! A [`KvbmConfig`] returned by [`ConfigBuilder::build`] has passed [`KvbmConfig::validate`].
//! Constructing one by hand (it is plain data) skips that; the runtime builder validates again.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use figment::Figment;
use figment::providers::{Format, Serialized, Toml};
use figment::value::Value;
use kvbm_logical::{LogicalConfig, TierId};
use kvbm_offload::{ObjectPipelineConfig, PipelineConfig};
use kvbm_physical::{
    DiskConfig, LayoutConfig, ModelFingerprint, ObjectConfig, Parallelism, S3Config, TransferConfig,
};
use kvbm_tiering::{OffloadingSpec, OffloadingSpecConfig};
use serde::{Deserialize, Serialize};

use crate::error::{EngineError, Result};

mod security;

pub use security::{SecurityConfig, is_loopback};

/// Prefix of the environment variables that set configuration keys.
pub const ENV_PREFIX: &str = "KVBM_";
/// Environment variable naming the TOML configuration file.
pub const CONFIG_PATH_ENV: &str = "KVBM_CONFIG_PATH";

/// The whole configuration: every crate's section plus the engine's.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct KvbmConfig {
    /// Tokio runtime of the engine.
    pub runtime: RuntimeConfig,
    /// `[model]`: what the stored blocks are KV of (part of the model fingerprint).
    pub model: ModelConfig,
    /// Block counts per tier (0: the tier is absent).
    pub tiers: TiersConfig,
    /// The leader's search.
    pub leader: LeaderConfig,
    /// `kvbm-logical`: block size, eviction, duplicates, event batching, registry.
    pub logical: LogicalConfig,
    /// `kvbm-physical`: transfer manager, disk, object store.
    pub physical: PhysicalSection,
    /// `kvbm-offload`: one pipeline per lane.
    pub offload: OffloadSection,
    /// `kvbm-tiering`: the vLLM-style manager's spec; absent unless configured.
    pub tiering: Option<OffloadingSpecConfig>,
    /// Stored/removed block events.
    pub events: EventsConfig,
    /// Prometheus exporter.
    pub metrics: MetricsConfig,
    /// Leader/worker control plane and block data plane.
    pub transport: TransportConfig,
    /// `[workers]`: where an instance's worker ranks run (in its own process, or as
    /// `kvbm-engine-worker` processes it drives over NATS).
    pub workers: WorkersConfig,
    /// `[security]`: the trust root, this member's credential, and the insecure opt-out.
    pub security: SecurityConfig,
    /// `[replay]`: owned by `kvbm-cli` (a layer above this crate), which parses and validates
    /// it; carried here unparsed so one file configures both. Absent by default.
    pub replay: Option<Value>,
}

/// `[runtime]`: the tokio runtime the engine builds when it is not given a handle.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RuntimeConfig {
    /// Worker threads of the multi-threaded runtime. Default: 2. At least 1.
    pub worker_threads: usize,
    /// Grace period for in-flight tasks at shutdown (ms). Default: 5000.
    pub shutdown_timeout_ms: u64,
}

impl Default for RuntimeConfig {
    fn default() -> Self {
        Self {
            worker_threads: 2,
            shutdown_timeout_ms: 5000,
        }
    }
}

/// `[model]`: what the stored blocks are KV of. With the block geometry and the tensor-parallel
/// rank (`physical.object.tp_rank` / `tp_world_size`) it makes the instance's
/// [`ModelFingerprint`] ([`KvbmConfig::fingerprint`]), which scopes every key a block leaves
/// the process under: G4 object paths and bindings, the G3 journal, and the cluster plane's
/// event, heartbeat and snapshot subjects. Instances whose fingerprints differ share a bucket
/// and a NATS server without ever matching each other's blocks. Set `name` and `dtype` for a
/// real model: left at their defaults, instances are told apart only by geometry, KV layout,
/// group and rank.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ModelConfig {
    /// Model id, with its revision where it has one (e.g.
    /// `meta-llama/Llama-3.1-8B-Instruct@0e9e39f`). Default: `unnamed`.
    pub name: String,
    /// KV cache dtype (`bfloat16`, `float16`, `float32`, `fp8_e4m3`, ...); a known name must
    /// agree with the geometry's bytes per element. Default: `auto` (only the element size,
    /// from the geometry, is bound). The tier stack (`kvbm replay`) stores opaque
    /// `tiers.block_bytes` bytes (1-byte elements): there a named dtype must be a 1-byte one.
    pub dtype: String,
    /// Element order within a `[tokens × inner]` region (`NHD`, `HND`, ...). Default: `NHD`.
    pub kv_layout: String,
    /// The KV cache group these blocks belong to (hybrid models have several). Default: 0.
    pub kv_group: u32,
}

impl Default for ModelConfig {
    fn default() -> Self {
        Self {
            name: "unnamed".into(),
            dtype: "auto".into(),
            kv_layout: "NHD".into(),
            kv_group: 0,
        }
    }
}

/// `[tiers]`: how many blocks each tier holds. A tier with 0 blocks is not built.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TiersConfig {
    /// G1 (device) blocks; 0 when the inference engine owns G1 itself. Default: 0.
    pub g1_blocks: usize,
    /// G2 (pinned host) blocks. Default: 1024.
    pub g2_blocks: usize,
    /// G3 (disk) blocks; needs `[physical.disk]`. Default: 0.
    pub g3_blocks: usize,
    /// G4 (object) blocks tracked; needs `[physical.s3]` or `physical.object_dir`. Default: 0.
    pub g4_blocks: usize,
    /// Bytes of one block, the same in every tier (a positive multiple of 4096: G3 is read
    /// with O_DIRECT). Default: 4096.
    pub block_bytes: usize,
}

impl Default for TiersConfig {
    fn default() -> Self {
        Self {
            g1_blocks: 0,
            g2_blocks: 1024,
            g3_blocks: 0,
            g4_blocks: 0,
            block_bytes: 4096,
        }
    }
}

impl TiersConfig {
    /// Blocks configured for `tier`.
    pub fn blocks(&self, tier: TierId) -> usize {
        match tier {
            TierId::G1 => self.g1_blocks,
            TierId::G2 => self.g2_blocks,
            TierId::G3 => self.g3_blocks,
            TierId::G4 => self.g4_blocks,
        }
    }
}

/// `[leader]`: what `find_matches` searches.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct LeaderConfig {
    /// Tiers searched, in order (`"G2"`, `"G3"`, `"G4"`); a tier with 0 blocks is skipped.
    /// G1 is the inference engine's own cache and cannot be listed. Default: G2, G3, G4.
    pub search: Vec<TierId>,
}

impl Default for LeaderConfig {
    fn default() -> Self {
        Self {
            search: vec![TierId::G2, TierId::G3, TierId::G4],
        }
    }
}

/// Where an instance's worker ranks (the memory its G1/G2/G3 blocks live in) run.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum WorkersMode {
    /// One rank: the instance's own process holds G1/G2 (host memory) and G3 (its
    /// `[physical.disk]` file). Today's behaviour, the default.
    #[default]
    InProcess,
    /// `workers.ranks` ranks, each a `kvbm-engine-worker` process started by the operator
    /// (or a test), driven over NATS control: the instance holds only the block managers and
    /// waits for the ranks to join (`workers.join_timeout_ms`).
    Processes,
}

/// The control prefix `kvbm-engine-worker` serves on by default (its `--prefix`).
pub const DEFAULT_WORKER_CONTROL_PREFIX: &str = "kvbm.ctl";

/// `[workers]`: where an instance's worker ranks run. The instance binary and
/// `cluster::instance::InstanceBuilder::build` (feature `nats`) read it; the tier stack
/// (`stack::TierStack`) has no worker ranks of its own and ignores it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct WorkersConfig {
    /// `"in_process"` (default) or `"processes"` (see [`WorkersMode`]).
    pub mode: WorkersMode,
    /// Number of ranks (tensor-parallel world size). Exactly 1 in process; at least 1 as
    /// processes, whose ranks are `0..ranks`. Default: 1.
    pub ranks: u32,
    /// Processes: how long building the instance waits for every rank to join (heartbeat)
    /// before it fails naming the missing ones (ms). Default: 60000. At least 1.
    pub join_timeout_ms: u64,
    /// Processes: the NATS subject prefix the ranks serve control on and heartbeat under (the
    /// workers' `--prefix`). Default: `kvbm.ctl`.
    pub control_prefix: String,
    /// Processes, with G3: the journal of which block each G3 slot holds (every rank keeps its
    /// slice of the slot in its own `--g3-file`). A restarted instance lists it and starts G3
    /// warm; every rank's read still checks its slot's header (checksum, identity), so a slot
    /// a rank lost or rewrote is refused, never served. Default: none (G3 starts cold).
    pub g3_journal: Option<std::path::PathBuf>,
}

impl Default for WorkersConfig {
    fn default() -> Self {
        Self {
            mode: WorkersMode::InProcess,
            ranks: 1,
            join_timeout_ms: 60_000,
            control_prefix: DEFAULT_WORKER_CONTROL_PREFIX.into(),
            g3_journal: None,
        }
    }
}

impl WorkersConfig {
    /// Checks the section against itself and the tiers (called by [`KvbmConfig::validate`]).
    fn validate(&self, config: &KvbmConfig) -> Result<()> {
        positive("workers.ranks", u64::from(self.ranks))?;
        positive("workers.join_timeout_ms", self.join_timeout_ms)?;
        let p = &self.control_prefix;
        if p.is_empty()
            || p.starts_with('.')
            || p.ends_with('.')
            || p.contains("..")
            || p.chars().any(|c| c.is_whitespace() || c == '*' || c == '>')
        {
            return Err(EngineError::config(
                "workers.control_prefix",
                format!(
                    "{p:?} is not a NATS subject prefix (dot-separated tokens, no wildcards or spaces)"
                ),
            ));
        }
        match self.mode {
            WorkersMode::InProcess if self.ranks != 1 => Err(EngineError::config(
                "workers.ranks",
                format!(
                    "an in-process instance has exactly one rank (its own memory), got {}; set workers.mode = \"processes\" for more",
                    self.ranks
                ),
            )),
            WorkersMode::InProcess => Ok(()),
            WorkersMode::Processes => {
                if config.transport.nats_url.is_none() {
                    return Err(EngineError::config(
                        "transport.nats_url",
                        "must be set with workers.mode = \"processes\": the ranks are driven over NATS",
                    ));
                }
                // Several ranks are the instance's own tensor-parallel group: their number is
                // `workers.ranks`, and `physical.object.tp_rank` / `tp_world_size` (one rank of
                // a group whose other ranks are other instances) cannot also say it.
                let o = &config.physical.object;
                if self.ranks > 1 && (o.tp_world_size != 1 || o.tp_rank != 0) {
                    return Err(EngineError::config(
                        "physical.object.tp_world_size",
                        format!(
                            "must stay 1 (tp_rank 0) with workers.ranks = {}: the instance's worker processes are its whole tensor-parallel group, got rank {} of {}",
                            self.ranks, o.tp_rank, o.tp_world_size
                        ),
                    ));
                }
                Ok(())
            }
        }
    }
}

/// `[physical]`: `kvbm-physical`'s sections.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct PhysicalSection {
    /// The transfer manager.
    pub transfer: TransferConfig,
    /// The object tier's layout of keys and requests.
    pub object: ObjectConfig,
    /// The disk tier's file; absent when there is no G3.
    pub disk: Option<DiskConfig>,
    /// The object tier's server; absent when there is no G4 or G4 is `object_dir`.
    pub s3: Option<S3Config>,
    /// G4 in a local directory (a filesystem object store) instead of `s3`: one machine,
    /// tests. Absent by default.
    pub object_dir: Option<PathBuf>,
    /// Where G1 lives: `"host"` (the default: host memory, what the replay and every
    /// CPU-only deployment use) or `"device"` (GPU memory of [`g1_device`](Self::g1_device),
    /// allocated through the CUDA driver; a build without feature `cuda`, or a machine without
    /// a driver, refuses it by name instead of falling back).
    pub g1: G1Memory,
    /// The CUDA device ordinal of G1 when `g1 = "device"` (default 0).
    pub g1_device: usize,
}

/// `physical.g1`: where G1's blocks live.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum G1Memory {
    /// Host memory (the default).
    #[default]
    Host,
    /// GPU memory of `physical.g1_device`.
    Device,
}

impl PartialEq for PhysicalSection {
    fn eq(&self, other: &Self) -> bool {
        // DiskConfig has no PartialEq of its own; compare its fields.
        let disk = |d: &Option<DiskConfig>| {
            d.as_ref().map(|d| {
                (
                    d.path.clone(),
                    d.engine,
                    d.queue_depth,
                    d.direct_io,
                    d.buffer_pool_bytes,
                )
            })
        };
        self.transfer == other.transfer
            && self.object == other.object
            && disk(&self.disk) == disk(&other.disk)
            && self.s3 == other.s3
            && self.object_dir == other.object_dir
            && self.g1 == other.g1
            && self.g1_device == other.g1_device
    }
}

/// `[offload]`: `kvbm-offload`'s pipelines, one per lane.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct OffloadSection {
    /// G1 → G2.
    pub g1_to_g2: PipelineConfig,
    /// G2 → G3.
    pub g2_to_g3: PipelineConfig,
    /// G2 → G4.
    pub g2_to_g4: ObjectPipelineConfig,
    /// How what the scheduler stores goes on from G2 to the G2→G3 and G2→G4 lanes.
    pub write_through: WriteThroughConfig,
}

/// `[offload.write_through]`: how the blocks the scheduler-facing manager stores in G2 go on to
/// the lower lanes (the `Tiering` front end; see the manager's "Write-through").
///
/// Every lane takes what each `complete_store` registered (chunk level). A request-level lane
/// also takes, when a request stores, that request's blocks already in G2 (its prefix hits,
/// blocks other requests stored, blocks promoted for it): vLLM's `REQUEST_LEVEL` tiers. With
/// back-pressure, a lane whose writes slow down drops stores instead of queueing them (vLLM's
/// `EMABackpressureDetector` and throttled drop policy, with vLLM's watermarks: G3 local
/// 0.005 / 0.001 s per MiB, G4 network 0.020 / 0.005); promotions are never gated.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct WriteThroughConfig {
    /// Request-level lanes: any of `"G3"`, `"G4"`. Default: none.
    pub request_level: Vec<TierId>,
    /// Back-pressure on each lower lane. Default: false.
    pub backpressure: bool,
    /// The G3 lane's watermarks `[high, low]`, seconds per MiB written: pressured above
    /// `high`, clear below `low` (`0 < low <= high`). Default: vLLM's local preset,
    /// `[0.005, 0.001]`.
    pub g3_watermarks: Option<[f64; 2]>,
    /// The G4 lane's watermarks, as `g3_watermarks`. Default: vLLM's network preset,
    /// `[0.020, 0.005]`.
    pub g4_watermarks: Option<[f64; 2]>,
}

/// `[events]`: publishing of stored/removed block events.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct EventsConfig {
    /// Publish events at all. Default: true.
    pub enabled: bool,
    /// Subject (NATS) / topic events are published on. Default: `kvbm.events`. Not empty.
    pub subject: String,
    /// Bound of the publish buffer, in batches; when full, batches are dropped and counted,
    /// never waited for. Default: 1024. At least 1.
    pub channel_capacity: usize,
    /// Longest sleep of the runtime's event-flush timer while no tier has a partial batch (ms);
    /// with one buffered, the timer wakes at its deadline. Default: 10. At least 1.
    pub idle_tick_ms: u64,
}

impl Default for EventsConfig {
    fn default() -> Self {
        Self {
            enabled: true,
            subject: "kvbm.events".into(),
            channel_capacity: 1024,
            idle_tick_ms: 10,
        }
    }
}

/// `[metrics]`: the Prometheus exporter.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct MetricsConfig {
    /// Install the exporter (a process-wide `metrics` recorder). Default: false.
    pub enabled: bool,
    /// Address the exporter serves `/metrics` on. Default: `127.0.0.1:6880`.
    pub bind: String,
    /// A scrape connection must send its whole request, and take the whole answer, within this
    /// long (ms); then it is closed (counted). Default: 5000. At least 1.
    pub read_timeout_ms: u64,
    /// Scrape connections open at once; past it a connection still waiting for its request
    /// head gives way, else the newcomer is closed (counted). Default: 16. At least 1.
    pub max_connections: usize,
    /// Connections one client (an IPv4 address, an IPv6 /64) may hold waiting for their request
    /// head; a newer one evicts its oldest. Default: 4. At least 1.
    pub max_waiting_per_client: usize,
    /// Time a connection has to send its request head (ms). Default: 2000. At least 1.
    pub head_timeout_ms: u64,
}

impl Default for MetricsConfig {
    fn default() -> Self {
        Self {
            enabled: false,
            bind: "127.0.0.1:6880".into(),
            read_timeout_ms: 5000,
            max_connections: 16,
            max_waiting_per_client: 4,
            head_timeout_ms: 2000,
        }
    }
}

/// `[transport]`: leader↔worker control plane and the block data plane.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TransportConfig {
    /// NATS server for control messages and events across processes; absent: in-process only.
    pub nats_url: Option<String>,
    /// Timeout of one control request (ms). Default: 5000. At least 1.
    pub request_timeout_ms: u64,
    /// Address of the TCP block data plane (port 0: any free port). Default: `127.0.0.1:0`.
    pub data_plane_bind: String,
    /// The data-plane address announced to peers, when it is not the bound one: a host bound
    /// to `0.0.0.0` announces its routable address, an instance behind a NAT or a proxy the
    /// address peers reach it at (`host:port`). Port 0: the bound port (with `data_plane_bind`
    /// on port 0, each instance on a host gets its own). Default: none (the bound address, its
    /// port resolved).
    pub data_plane_advertise: Option<String>,
    /// How often an instance announces itself (instance id, data-plane address) to its peers
    /// over NATS, and a worker rank its incarnation to its leader (ms). Default: 1000. At
    /// least 1.
    pub heartbeat_interval_ms: u64,
    /// A peer not heard from for this long is dropped from the cross-instance index and the
    /// peer directory, and a worker rank counts as lost to its leader's `Membership` (ms).
    /// Default: 5000. More than `heartbeat_interval_ms`.
    pub heartbeat_timeout_ms: u64,
    /// Data-plane server: connections served at once; one more is closed at once (counted in
    /// `ServerStats::connections_refused`). Default: 256. At least 1.
    pub max_connections: usize,
    /// Data-plane server: connections served at once from one peer address (one more is closed
    /// at once, counted in `ServerStats::peer_connections_refused`); the client keeps at most
    /// this many requests in flight to one peer, the rest wait. Default: 32. At least 1.
    pub max_connections_per_peer: usize,
    /// Data-plane server (security on): connections still in their handshake, each holding a
    /// place apart from the members' `max_connections`; when all are taken the oldest is
    /// dropped for the newcomer (counted). Default: 64. At least 1.
    pub max_pending_connections: usize,
    /// Data-plane server (security on): a new connection must complete its handshake within
    /// this long (ms), or it is dropped (counted as a refused handshake). Default: 2000. At
    /// least 1.
    pub handshake_deadline_ms: u64,
    /// Data-plane server: new connections accepted per second from one address prefix (an
    /// IPv4 address, an IPv6 /64); more are closed at once (counted). Default: 64. At least 1.
    pub accepts_per_second_per_peer: u32,
    /// Data-plane server: the whole of one response (every frame of one request) must be
    /// written within this long (ms), or the connection is dropped with every block it held
    /// (counted in `ServerStats::responses_timed_out`). Default: 60000. At least 1.
    pub response_deadline_ms: u64,
    /// Data-plane client: the whole of one pull request (connect, request, every frame) must
    /// complete within this long (ms), or its blocks fail `Timeout` and the connection is
    /// dropped (counted in `ClientStats::deadlines_exceeded`). Default: 60000. At least 1.
    pub pull_deadline_ms: u64,
    /// Data-plane client: peers (addresses) with idle connections kept; a connection to one
    /// more evicts the least recently used peer's (counted). Default: 64. At least 1.
    pub max_idle_peers: usize,
    /// Data-plane client: an idle pooled connection older than this is closed (ms).
    /// Default: 30000. At least 1.
    pub idle_expiry_ms: u64,
    /// Presence: most pages one snapshot fetch reads before it is refused (counted in
    /// `PresenceStats::snapshots_over_limit`). Default: 4096. At least 1.
    pub snapshot_max_pages: usize,
    /// Presence: most entries one snapshot fetch accepts before it is refused (counted).
    /// Default: 4194304. At least 1.
    pub snapshot_max_entries: usize,
    /// Worker control server: requests served at once; one more is answered `Refused`
    /// (counted in `WorkerServerStats::refused_busy`). Default: 256. At least 1.
    pub worker_max_in_flight: usize,
    /// `[transport.nats_auth]`: how this process authenticates to the NATS server (credentials
    /// file, nkey seed, token, user and password, TLS). Default: none (a loopback server
    /// without authentication).
    pub nats_auth: NatsAuthConfig,
}

impl Default for TransportConfig {
    fn default() -> Self {
        Self {
            nats_url: None,
            request_timeout_ms: 5000,
            data_plane_bind: "127.0.0.1:0".into(),
            data_plane_advertise: None,
            heartbeat_interval_ms: 1000,
            heartbeat_timeout_ms: 5000,
            max_connections: 256,
            max_connections_per_peer: 32,
            max_pending_connections: 64,
            handshake_deadline_ms: 2000,
            accepts_per_second_per_peer: 64,
            response_deadline_ms: 60_000,
            pull_deadline_ms: 60_000,
            max_idle_peers: 64,
            idle_expiry_ms: 30_000,
            snapshot_max_pages: 4096,
            snapshot_max_entries: 4 << 20,
            worker_max_in_flight: 256,
            nats_auth: NatsAuthConfig::default(),
        }
    }
}

/// What a [`Secret`] (and every other secret kvbm holds) prints instead of its value.
pub const REDACTED: &str = "<redacted>";

/// A secret configuration value (a NATS token or password): `Debug`, `Display` and
/// `Serialize` print [`REDACTED`]; only [`Secret::expose`] gives the value, to the one call
/// that hands it to the client library. Deserializes from a string (a number or a bool, as an
/// environment variable may be parsed, is taken as its text); a value of any other type is
/// refused without being echoed.
#[derive(Clone, PartialEq, Eq, Default)]
pub struct Secret(String);

impl Secret {
    /// Wraps `value`.
    pub fn new(value: impl Into<String>) -> Self {
        Secret(value.into())
    }

    /// The value itself. Never log or format it.
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(REDACTED)
    }
}

impl std::fmt::Display for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(REDACTED)
    }
}

impl Serialize for Secret {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        s.serialize_str(REDACTED)
    }
}

impl<'de> Deserialize<'de> for Secret {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        struct Visitor;
        impl serde::de::Visitor<'_> for Visitor {
            type Value = Secret;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a string (a secret; its value is not shown)")
            }
            fn visit_str<E: serde::de::Error>(self, v: &str) -> std::result::Result<Secret, E> {
                Ok(Secret(v.to_string()))
            }
            fn visit_string<E: serde::de::Error>(
                self,
                v: String,
            ) -> std::result::Result<Secret, E> {
                Ok(Secret(v))
            }
            fn visit_i64<E: serde::de::Error>(self, v: i64) -> std::result::Result<Secret, E> {
                Ok(Secret(v.to_string()))
            }
            fn visit_u64<E: serde::de::Error>(self, v: u64) -> std::result::Result<Secret, E> {
                Ok(Secret(v.to_string()))
            }
            fn visit_f64<E: serde::de::Error>(self, v: f64) -> std::result::Result<Secret, E> {
                Ok(Secret(v.to_string()))
            }
            fn visit_bool<E: serde::de::Error>(self, v: bool) -> std::result::Result<Secret, E> {
                Ok(Secret(v.to_string()))
            }
        }
        d.deserialize_any(Visitor)
    }
}

/// The keys whose values are secrets: read from the environment as raw text (never parsed as
/// a number, which would drop a leading zero) and never printed. Each is the last segment of
/// a dotted key.
pub const SECRET_KEYS: [&str; 2] = ["token", "password"];

/// Whether the dotted `key` holds a secret ([`SECRET_KEYS`], and S3's `secret_key`).
pub fn is_secret_key(key: &str) -> bool {
    let last = key.rsplit('.').next().unwrap_or(key);
    SECRET_KEYS.contains(&last) || last == "secret_key"
}

/// `[transport.nats_auth]`: how this process authenticates to the NATS server and checks the
/// server's certificate. Every key maps onto one `async_nats::ConnectOptions` call (see
/// `docs/security.md`).
///
/// At most one way to authenticate: `creds_file` (a `.creds` file: user JWT and nkey seed),
/// `nkey_file` (an nkey seed), `token`/`token_file`, or `user` with `password`/
/// `password_file`; a client certificate (`cert_file` + `key_file`) may come with any of them.
/// Prefer the `*_file` keys: a file (mode 0600) keeps the secret out of the configuration,
/// the environment and `ps`. Secrets are [`Secret`]s, never printed.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct NatsAuthConfig {
    /// A NATS credentials file (`.creds`: a user JWT and its nkey seed; `nsc` writes them).
    pub creds_file: Option<PathBuf>,
    /// A file holding an nkey seed (`SU...`) of a user the server lists by public key.
    pub nkey_file: Option<PathBuf>,
    /// An authorization token. Prefer `token_file`.
    pub token: Option<Secret>,
    /// A file holding the authorization token (trailing newline ignored).
    pub token_file: Option<PathBuf>,
    /// A user name; needs `password` or `password_file`.
    pub user: Option<String>,
    /// The user's password. Prefer `password_file`.
    pub password: Option<Secret>,
    /// A file holding the user's password (trailing newline ignored).
    pub password_file: Option<PathBuf>,
    /// PEM file of the CA(s) that signed the server's certificate (added to the trusted roots).
    pub ca_file: Option<PathBuf>,
    /// PEM client certificate, for a server that verifies clients (mutual TLS); needs
    /// `key_file`.
    pub cert_file: Option<PathBuf>,
    /// PEM private key of `cert_file`.
    pub key_file: Option<PathBuf>,
    /// Refuse a connection that is not TLS. Default: false (TLS when the server asks for it or
    /// the url is `tls://`).
    pub require_tls: bool,
}

impl NatsAuthConfig {
    /// The key of the way this configuration authenticates, if any: `creds_file`,
    /// `nkey_file`, `token`/`token_file`, `user`, or (only a client certificate) `cert_file`.
    pub fn method(&self) -> Option<&'static str> {
        if self.creds_file.is_some() {
            Some("creds_file")
        } else if self.nkey_file.is_some() {
            Some("nkey_file")
        } else if self.token_file.is_some() {
            Some("token_file")
        } else if self.token.is_some() {
            Some("token")
        } else if self.user.is_some() {
            Some("user")
        } else if self.cert_file.is_some() {
            Some("cert_file")
        } else {
            None
        }
    }

    /// Whether any credential is configured (a client certificate counts).
    pub fn has_credentials(&self) -> bool {
        self.method().is_some()
    }

    /// Checks the section: at most one way to authenticate, a user with a password (and a
    /// password with a user), a certificate with its key.
    ///
    /// # Errors
    /// [`EngineError::Config`] naming the key (never a value).
    pub fn validate(&self) -> Result<()> {
        const P: &str = "transport.nats_auth";
        let ways: Vec<&str> = [
            ("creds_file", self.creds_file.is_some()),
            ("nkey_file", self.nkey_file.is_some()),
            ("token", self.token.is_some() || self.token_file.is_some()),
            ("user", self.user.is_some()),
        ]
        .into_iter()
        .filter_map(|(k, on)| on.then_some(k))
        .collect();
        if ways.len() > 1 {
            return Err(EngineError::config(
                format!("{P}.{}", ways[1]),
                format!(
                    "one way to authenticate at a time, got {}",
                    ways.iter()
                        .map(|k| format!("{P}.{k}"))
                        .collect::<Vec<_>>()
                        .join(" and ")
                ),
            ));
        }
        if self.token.is_some() && self.token_file.is_some() {
            return Err(EngineError::config(
                format!("{P}.token_file"),
                format!("{P}.token and {P}.token_file are both set; keep one (the file)"),
            ));
        }
        if self.password.is_some() && self.password_file.is_some() {
            return Err(EngineError::config(
                format!("{P}.password_file"),
                format!("{P}.password and {P}.password_file are both set; keep one (the file)"),
            ));
        }
        let has_password = self.password.is_some() || self.password_file.is_some();
        match (&self.user, has_password) {
            (Some(u), _) if u.is_empty() => {
                return Err(EngineError::config(
                    format!("{P}.user"),
                    "must not be empty",
                ));
            }
            (Some(_), false) => {
                return Err(EngineError::config(
                    format!("{P}.password_file"),
                    format!("{P}.user is set but no {P}.password_file (or password)"),
                ));
            }
            (None, true) => {
                return Err(EngineError::config(
                    format!("{P}.user"),
                    format!("a password is set but no {P}.user"),
                ));
            }
            _ => {}
        }
        match (&self.cert_file, &self.key_file) {
            (Some(_), None) => Err(EngineError::config(
                format!("{P}.key_file"),
                format!("{P}.cert_file is set but no key_file"),
            )),
            (None, Some(_)) => Err(EngineError::config(
                format!("{P}.cert_file"),
                format!("{P}.key_file is set but no cert_file"),
            )),
            _ => Ok(()),
        }
    }

    /// Refuses to use a NATS server off the loopback interface without NATS credentials
    /// (anyone who reaches it could read and publish every subject), unless `insecure`
    /// (`security.insecure`), which is logged loudly instead. `urls` may list several servers
    /// separated by commas. Also warns when a token or password would cross the network
    /// without TLS being required.
    ///
    /// # Errors
    /// [`EngineError::Config`] naming `transport.nats_auth` and the server (never a secret).
    pub fn require_for(&self, urls: &str, insecure: bool) -> Result<()> {
        let servers = || urls.split(',').map(str::trim).filter(|u| !u.is_empty());
        let Some(open) = servers().find(|u| !is_loopback(u)) else {
            return Ok(());
        };
        let open = redact_url(open);
        if self.has_credentials() {
            let in_clear = matches!(self.method(), Some("token" | "token_file" | "user"));
            let tls = self.require_tls
                || self.ca_file.is_some()
                || servers().all(|u| u.starts_with("tls://"));
            if in_clear && !tls {
                tracing::warn!(
                    server = %open,
                    "transport.nats_auth: a token or password goes to {open} without \
                     transport.nats_auth.require_tls; it crosses the network in clear unless \
                     the server itself demands TLS"
                );
            }
            return Ok(());
        }
        if insecure {
            tracing::warn!(
                server = %open,
                "SECURITY OFF: security.insecure = true; NATS server {open} is used without \
                 credentials: whoever reaches it can read and publish every kvbm subject"
            );
            return Ok(());
        }
        Err(EngineError::config(
            "transport.nats_auth",
            format!(
                "NATS server {open} is not on the loopback interface and no NATS credentials \
                 are configured: set transport.nats_auth.creds_file (or nkey_file, token_file, \
                 user with password_file, or cert_file with key_file), or security.insecure = \
                 true to run unauthenticated"
            ),
        ))
    }
}

/// Whether any server of `urls` (comma-separated) carries userinfo (`nats://user:pw@host`).
pub fn url_has_userinfo(urls: &str) -> bool {
    urls.split(',').any(|u| {
        let rest = u.trim().split_once("://").map_or(u.trim(), |(_, r)| r);
        let authority = rest.split(['/', '?', '#']).next().unwrap_or(rest);
        authority.contains('@')
    })
}

/// `urls` with any userinfo replaced by [`REDACTED`], for messages and logs.
pub fn redact_url(urls: &str) -> String {
    urls.split(',')
        .map(|u| {
            let (scheme, rest) = match u.split_once("://") {
                Some((s, r)) => (format!("{s}://"), r),
                None => (String::new(), u),
            };
            let end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
            match rest[..end].rfind('@') {
                Some(at) => format!("{scheme}{REDACTED}@{}", &rest[at + 1..]),
                None => u.to_string(),
            }
        })
        .collect::<Vec<_>>()
        .join(",")
}

/// Refuses a NATS url (the value of `key`) that carries credentials in its userinfo: they
/// would be printed wherever the url is (errors, logs, a child's command line). The message
/// names `key` and never echoes the url.
///
/// # Errors
/// [`EngineError::Config`] naming `key`.
pub fn check_nats_url(key: &str, urls: &str) -> Result<()> {
    if urls.trim().is_empty() {
        return Err(EngineError::config(key, "must not be empty"));
    }
    if url_has_userinfo(urls) {
        return Err(EngineError::config(
            key,
            "carries credentials in its userinfo (user:password@ or token@); the url is \
             printed in logs and errors, so credentials go in [transport.nats_auth] \
             (user with password_file, token_file, nkey_file or creds_file)",
        ));
    }
    Ok(())
}

fn prefixed(prefix: &str, message: &str) -> EngineError {
    // The lower crates' messages start with their own key ("batch_config.max_batch_size must
    // be at least 1"); put the section in front so the key is the full dotted path.
    match message.split_once(' ') {
        Some((key, rest))
            if !key.is_empty()
                && key.chars().all(|c| {
                    c.is_ascii_lowercase() || c == '_' || c == '.' || c.is_ascii_digit()
                }) =>
        {
            EngineError::config(format!("{prefix}.{key}"), rest)
        }
        _ => EngineError::config(prefix, message),
    }
}

fn positive(key: &str, value: u64) -> Result<()> {
    if value == 0 {
        return Err(EngineError::config(key, "must be > 0"));
    }
    Ok(())
}

fn socket_addr(key: &str, value: &str) -> Result<SocketAddr> {
    value.parse().map_err(|e| {
        EngineError::config(key, format!("{value:?} is not a host:port address ({e})"))
    })
}

impl KvbmConfig {
    /// The model fingerprint of blocks of `geometry` under this tree: `[model]`, the geometry
    /// (its block count aside) and whose bytes a block holds ([`KvbmConfig::parallelism`]:
    /// this process's tensor-parallel rank, `physical.object.tp_rank` of `tp_world_size`, or
    /// the whole group of `workers.ranks` worker processes). See [`ModelConfig`].
    ///
    /// # Errors
    /// [`EngineError::Config`] naming `model` when a part is invalid (e.g. `model.dtype` is a
    /// known dtype of another size than the geometry's elements).
    pub fn fingerprint(&self, geometry: &LayoutConfig) -> Result<ModelFingerprint> {
        let m = &self.model;
        ModelFingerprint::builder()
            .model(&m.name)
            .dtype(&m.dtype)
            .kv_layout(&m.kv_layout)
            .kv_group(m.kv_group)
            .geometry(*geometry)
            .parallelism(self.parallelism())
            .build()
            .map_err(|e| EngineError::config("model", e.to_string()))
    }

    /// Whose bytes a block of this instance holds, for its [`ModelFingerprint`]: one rank's
    /// (`physical.object.tp_rank` of `tp_world_size`) when the instance has one rank, in its
    /// own process or as one worker process; with `workers.ranks` > 1 worker processes, every
    /// rank's bytes of an engine of that tensor-parallel size ([`Parallelism::Engine`]), so
    /// instances of other rank counts never match its blocks.
    pub fn parallelism(&self) -> Parallelism {
        let o = &self.physical.object;
        match self.workers.mode {
            WorkersMode::Processes if self.workers.ranks > 1 => Parallelism::Engine {
                tp: self.workers.ranks as usize,
                pp: 1,
                pcp: 1,
                dcp: 1,
            },
            _ => Parallelism::Rank {
                rank: o.tp_rank,
                world: o.tp_world_size,
            },
        }
    }

    /// The object-tier settings (`physical.object`) of worker rank `rank`: with
    /// `workers.ranks` > 1 worker processes, each rank's objects live under its own
    /// `tp{ranks}.r{rank}/` (`tp_rank = rank`, `tp_world_size = ranks`), since each holds only
    /// its slice of every block; with one rank, `physical.object` as configured.
    ///
    /// # Errors
    /// [`EngineError::Config`] naming `workers.ranks` when `rank` is not below it.
    pub fn rank_object_config(&self, rank: u32) -> Result<ObjectConfig> {
        let ranks = self.workers.ranks;
        if rank >= ranks {
            return Err(EngineError::config(
                "workers.ranks",
                format!("rank {rank} is not below workers.ranks = {ranks}"),
            ));
        }
        let mut o = self.physical.object.clone();
        if self.workers.mode == WorkersMode::Processes && ranks > 1 {
            o.tp_rank = rank as usize;
            o.tp_world_size = ranks as usize;
        }
        Ok(o)
    }

    /// Checks ranges and cross-field rules of every section.
    ///
    /// # Errors
    /// [`EngineError::Config`] naming the first offending key.
    pub fn validate(&self) -> Result<()> {
        positive("runtime.worker_threads", self.runtime.worker_threads as u64)?;
        for (key, what, v) in [
            ("model.name", "model id", &self.model.name),
            ("model.dtype", "dtype", &self.model.dtype),
            ("model.kv_layout", "KV layout", &self.model.kv_layout),
        ] {
            kvbm_physical::fingerprint::check_name(what, v)
                .map_err(|e| EngineError::config(key, e.to_string()))?;
        }

        let mut seen = Vec::with_capacity(self.leader.search.len());
        for tier in &self.leader.search {
            if *tier == TierId::G1 {
                return Err(EngineError::config(
                    "leader.search",
                    "G1 is the inference engine's cache and cannot be searched",
                ));
            }
            if seen.contains(tier) {
                return Err(EngineError::config(
                    "leader.search",
                    format!("{tier} is listed twice"),
                ));
            }
            seen.push(*tier);
        }
        // With worker processes, G3 is each rank's own file (`kvbm-engine-worker --g3-file`).
        if self.tiers.g3_blocks > 0
            && self.physical.disk.is_none()
            && self.workers.mode == WorkersMode::InProcess
        {
            return Err(EngineError::config(
                "physical.disk",
                "tiers.g3_blocks > 0 needs a [physical.disk] section",
            ));
        }
        if self.tiers.g4_blocks > 0
            && self.physical.s3.is_none()
            && self.physical.object_dir.is_none()
        {
            return Err(EngineError::config(
                "physical.s3",
                "tiers.g4_blocks > 0 needs a [physical.s3] section (or physical.object_dir)",
            ));
        }
        if self.physical.s3.is_some() && self.physical.object_dir.is_some() {
            return Err(EngineError::config(
                "physical.object_dir",
                "G4 is either [physical.s3] or physical.object_dir, not both",
            ));
        }
        let bytes = self.tiers.block_bytes;
        if bytes == 0 || !bytes.is_multiple_of(4096) {
            return Err(EngineError::config(
                "tiers.block_bytes",
                format!("must be a positive multiple of 4096 (O_DIRECT alignment), got {bytes}"),
            ));
        }

        let l = &self.logical;
        if !(1..=1024).contains(&l.block_size) || !l.block_size.is_power_of_two() {
            return Err(EngineError::config(
                "logical.block_size",
                format!("must be a power of two in 1..=1024, got {}", l.block_size),
            ));
        }
        positive("logical.events.max_batch", l.events.max_batch as u64)?;
        self.security
            .validate()
            .map_err(|(key, message)| EngineError::config(key, message))?;

        let p = &self.physical;
        positive(
            "physical.transfer.worker_threads",
            p.transfer.worker_threads as u64,
        )?;
        positive(
            "physical.transfer.bounce_buffers",
            p.transfer.bounce_buffers as u64,
        )?;
        positive(
            "physical.transfer.bounce_buffer_bytes",
            p.transfer.bounce_buffer_bytes as u64,
        )?;
        if p.transfer.worker_nice > kvbm_physical::MAX_NICE {
            return Err(EngineError::config(
                "physical.transfer.worker_nice",
                format!(
                    "must be in 0..={} (Linux's niceness range), got {}",
                    kvbm_physical::MAX_NICE,
                    p.transfer.worker_nice
                ),
            ));
        }
        positive(
            "physical.object.max_concurrency",
            p.object.max_concurrency as u64,
        )?;
        if p.object.part_size < 5 << 20 {
            return Err(EngineError::config(
                "physical.object.part_size",
                "must be at least 5 MiB (S3's smallest multipart part)",
            ));
        }
        positive(
            "physical.object.tp_world_size",
            p.object.tp_world_size as u64,
        )?;
        if p.object.tp_rank >= p.object.tp_world_size {
            return Err(EngineError::config(
                "physical.object.tp_rank",
                format!(
                    "must be < tp_world_size ({}), got {}",
                    p.object.tp_world_size, p.object.tp_rank
                ),
            ));
        }
        if p.object.namespace.is_empty() {
            return Err(EngineError::config(
                "physical.object.namespace",
                "must not be empty",
            ));
        }
        if let Some(disk) = &p.disk {
            positive("physical.disk.queue_depth", u64::from(disk.queue_depth))?;
            if disk.path.as_os_str().is_empty() {
                return Err(EngineError::config(
                    "physical.disk.path",
                    "must not be empty",
                ));
            }
        }
        if let Some(s3) = &p.s3
            && s3.bucket.is_empty()
        {
            return Err(EngineError::config(
                "physical.s3.bucket",
                "must not be empty",
            ));
        }

        let o = &self.offload;
        o.g1_to_g2
            .validate()
            .map_err(|e| prefixed("offload.g1_to_g2", &invalid_message(e)))?;
        o.g2_to_g3
            .validate()
            .map_err(|e| prefixed("offload.g2_to_g3", &invalid_message(e)))?;
        // The object pipeline's own validate checks its inner pipeline without naming it; check
        // that first so the key says `pipeline.`.
        o.g2_to_g4
            .pipeline
            .validate()
            .map_err(|e| prefixed("offload.g2_to_g4.pipeline", &invalid_message(e)))?;
        o.g2_to_g4
            .validate()
            .map_err(|e| prefixed("offload.g2_to_g4", &invalid_message(e)))?;
        for (key, w) in [
            (
                "offload.write_through.g3_watermarks",
                o.write_through.g3_watermarks,
            ),
            (
                "offload.write_through.g4_watermarks",
                o.write_through.g4_watermarks,
            ),
        ] {
            if let Some([high, low]) = w
                && !(low.is_finite() && high.is_finite() && 0.0 < low && low <= high)
            {
                return Err(EngineError::config(
                    key,
                    format!("[{high}, {low}]: must be [high, low] with 0 < low <= high"),
                ));
            }
        }
        let mut lanes = std::collections::HashSet::new();
        for t in &o.write_through.request_level {
            if !matches!(t, TierId::G3 | TierId::G4) {
                return Err(EngineError::config(
                    "offload.write_through.request_level",
                    format!("{t:?} has no lane from G2: only G3 and G4 can be request level"),
                ));
            }
            if !lanes.insert(*t) {
                return Err(EngineError::config(
                    "offload.write_through.request_level",
                    format!("{t:?} listed twice"),
                ));
            }
            let blocks = if *t == TierId::G3 {
                self.tiers.g3_blocks
            } else {
                self.tiers.g4_blocks
            };
            if blocks == 0 {
                return Err(EngineError::config(
                    "offload.write_through.request_level",
                    format!(
                        "{t:?} is request level, but tiers.{}_blocks is 0 (no such tier)",
                        if *t == TierId::G3 { "g3" } else { "g4" }
                    ),
                ));
            }
        }

        if let Some(spec) = &self.tiering {
            OffloadingSpec::new(spec.clone()).map_err(|e| {
                let message = e.to_string();
                let message = message
                    .split_once("offloading spec: ")
                    .map_or(message.as_str(), |(_, m)| m)
                    .to_string();
                prefixed("tiering", &message)
            })?;
        }

        let e = &self.events;
        if e.subject.is_empty() {
            return Err(EngineError::config("events.subject", "must not be empty"));
        }
        positive("events.channel_capacity", e.channel_capacity as u64)?;
        positive("events.idle_tick_ms", e.idle_tick_ms)?;

        socket_addr("metrics.bind", &self.metrics.bind)?;
        positive("metrics.read_timeout_ms", self.metrics.read_timeout_ms)?;
        positive("metrics.head_timeout_ms", self.metrics.head_timeout_ms)?;
        positive(
            "metrics.max_connections",
            self.metrics.max_connections as u64,
        )?;
        positive(
            "metrics.max_waiting_per_client",
            self.metrics.max_waiting_per_client as u64,
        )?;

        let t = &self.transport;
        positive("transport.request_timeout_ms", t.request_timeout_ms)?;
        socket_addr("transport.data_plane_bind", &t.data_plane_bind)?;
        if let Some(a) = &t.data_plane_advertise {
            let addr = socket_addr("transport.data_plane_advertise", a)?;
            if addr.ip().is_unspecified() {
                return Err(EngineError::config(
                    "transport.data_plane_advertise",
                    format!("{a:?}: peers cannot reach an unspecified address"),
                ));
            }
        }
        positive("transport.heartbeat_interval_ms", t.heartbeat_interval_ms)?;
        if t.heartbeat_timeout_ms <= t.heartbeat_interval_ms {
            return Err(EngineError::config(
                "transport.heartbeat_timeout_ms",
                format!(
                    "must be > transport.heartbeat_interval_ms ({})",
                    t.heartbeat_interval_ms
                ),
            ));
        }
        positive("transport.max_connections", t.max_connections as u64)?;
        positive(
            "transport.max_connections_per_peer",
            t.max_connections_per_peer as u64,
        )?;
        positive(
            "transport.max_pending_connections",
            t.max_pending_connections as u64,
        )?;
        positive("transport.handshake_deadline_ms", t.handshake_deadline_ms)?;
        positive(
            "transport.accepts_per_second_per_peer",
            u64::from(t.accepts_per_second_per_peer),
        )?;
        positive("transport.response_deadline_ms", t.response_deadline_ms)?;
        positive("transport.pull_deadline_ms", t.pull_deadline_ms)?;
        positive("transport.max_idle_peers", t.max_idle_peers as u64)?;
        positive("transport.idle_expiry_ms", t.idle_expiry_ms)?;
        positive("transport.snapshot_max_pages", t.snapshot_max_pages as u64)?;
        positive(
            "transport.snapshot_max_entries",
            t.snapshot_max_entries as u64,
        )?;
        positive(
            "transport.worker_max_in_flight",
            t.worker_max_in_flight as u64,
        )?;
        if let Some(url) = &t.nats_url {
            check_nats_url("transport.nats_url", url)?;
        }
        t.nats_auth.validate()?;
        self.workers.validate(self)?;
        Ok(())
    }

    /// The tiers the leader searches, in order, without those configured with 0 blocks.
    pub fn search_order(&self) -> Vec<TierId> {
        self.leader
            .search
            .iter()
            .copied()
            .filter(|t| self.tiers.blocks(*t) > 0)
            .collect()
    }
}

/// The offload crate's `InvalidConfig` message without its "invalid configuration: " frame.
fn invalid_message(e: kvbm_offload::OffloadError) -> String {
    match e {
        kvbm_offload::OffloadError::InvalidConfig(m) => m,
        other => other.to_string(),
    }
}

/// Where a value of the merged tree came from, for error messages.
#[derive(Clone, Debug)]
enum Origin {
    Env(String),
    Override,
}

/// Gathers the configuration sources in priority order and builds a validated [`KvbmConfig`].
///
/// ```
/// use kvbm_engine::config::ConfigBuilder;
///
/// let config = ConfigBuilder::from_env_vars([("KVBM_LOGICAL__BLOCK_SIZE", "32")])?
///     .set("tiers.g2_blocks", 64)
///     .build()?;
/// assert_eq!(config.logical.block_size, 32);
/// assert_eq!(config.tiers.g2_blocks, 64);
/// # Ok::<(), kvbm_engine::EngineError>(())
/// ```
#[derive(Debug, Default)]
pub struct ConfigBuilder {
    file: Option<PathBuf>,
    env: Vec<(String, String, Value)>,
    overrides: Vec<(String, Value)>,
}

impl ConfigBuilder {
    /// Built-in defaults only.
    pub fn new() -> Self {
        Self::default()
    }

    /// Reads `KVBM_CONFIG_PATH` and every `KVBM_*__*` variable of this process. The only place
    /// in kvbm that reads the environment for configuration.
    ///
    /// # Errors
    /// As [`from_env_vars`](Self::from_env_vars).
    pub fn from_process_env() -> Result<Self> {
        Self::from_env_vars(std::env::vars())
    }

    /// As [`from_process_env`](Self::from_process_env), from an explicit variable list.
    ///
    /// # Errors
    /// [`EngineError::Config`] when `KVBM_CONFIG_PATH` names a file that does not exist, or a
    /// variable's name has an empty segment (`KVBM_OFFLOAD____X`).
    pub fn from_env_vars<K, V>(vars: impl IntoIterator<Item = (K, V)>) -> Result<Self>
    where
        K: AsRef<str>,
        V: AsRef<str>,
    {
        let mut builder = Self::new();
        for (name, value) in vars {
            let (name, value) = (name.as_ref(), value.as_ref());
            if name == CONFIG_PATH_ENV {
                builder = builder.file(value)?;
                continue;
            }
            let Some(rest) = name.strip_prefix(ENV_PREFIX) else {
                continue;
            };
            if !rest.contains("__") {
                // Not a key (every key is in a section): KVBM_CONFIG_PATH, KVBM_TEST_*, ...
                continue;
            }
            let segments: Vec<String> = rest.split("__").map(str::to_ascii_lowercase).collect();
            if segments.iter().any(String::is_empty) {
                return Err(EngineError::config(
                    segments.join("."),
                    format!("environment variable {name} has an empty key segment"),
                ));
            }
            let key = segments.join(".");
            // A secret is text as given: parsing "0123" as a number would change it.
            let parsed: Value = if is_secret_key(&key) {
                Value::from(value)
            } else {
                value.parse().unwrap_or_else(|_| Value::from(value))
            };
            builder.env.push((key, name.to_string(), parsed));
        }
        // Deterministic order regardless of the process environment's.
        builder.env.sort_by(|a, b| a.1.cmp(&b.1));
        Ok(builder)
    }

    /// Reads this TOML file over the defaults (replacing a file named by `KVBM_CONFIG_PATH`).
    ///
    /// # Errors
    /// [`EngineError::Config`] (key `KVBM_CONFIG_PATH`) when the file does not exist: a named
    /// but missing file is a mistake, not an empty configuration.
    pub fn file(mut self, path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        if !path.is_file() {
            return Err(EngineError::config(
                CONFIG_PATH_ENV,
                format!("{} is not a readable file", path.display()),
            ));
        }
        self.file = Some(path.to_path_buf());
        Ok(self)
    }

    /// Sets `key` (dotted path, e.g. `offload.g2_to_g3.queue_capacity`) over every other
    /// source. A value that does not serialize is ignored with a log line.
    pub fn set(mut self, key: impl Into<String>, value: impl Serialize) -> Self {
        let key = key.into();
        match Value::serialize(value) {
            Ok(v) => self.overrides.push((key, v)),
            Err(e) => tracing::warn!(%key, error = %e, "configuration override does not serialize"),
        }
        self
    }

    /// The file this builder reads, if any.
    pub fn file_path(&self) -> Option<&Path> {
        self.file.as_deref()
    }

    /// Merges the sources, extracts the tree and validates it.
    ///
    /// # Errors
    /// [`EngineError::Config`] naming the key: a wrong type, an unknown key, an unknown tier,
    /// a malformed file, or a value [`KvbmConfig::validate`] rejects.
    pub fn build(self) -> Result<KvbmConfig> {
        let mut figment = Figment::new();
        if let Some(path) = &self.file {
            figment = figment.merge(Toml::file(path));
        }
        for (key, _, value) in &self.env {
            figment = figment.merge(Serialized::default(key, value));
        }
        for (key, value) in &self.overrides {
            figment = figment.merge(Serialized::default(key, value));
        }
        let config: KvbmConfig = figment.extract().map_err(|e| self.describe(e))?;
        config.validate()?;
        Ok(config)
    }

    fn origin(&self, key: &str) -> Option<Origin> {
        let covers = |k: &str| {
            key == k || key.starts_with(&format!("{k}.")) || k.starts_with(&format!("{key}."))
        };
        if self.overrides.iter().any(|(k, _)| covers(k)) {
            return Some(Origin::Override);
        }
        self.env
            .iter()
            .rev()
            .find(|(k, _, _)| covers(k))
            .map(|(_, name, _)| Origin::Env(name.clone()))
    }

    fn describe(&self, error: figment::Error) -> EngineError {
        use figment::error::Kind;
        // Report the first error; figment may chain several.
        let error = error
            .into_iter()
            .next()
            .expect("a figment error has one entry");
        let mut path = error.path.clone();
        // figment's path may or may not already end with the field; never name it twice.
        let field = match &error.kind {
            Kind::UnknownField(field, _) => Some(field.clone()),
            Kind::MissingField(field) => Some(field.to_string()),
            _ => None,
        };
        if let Some(field) = field
            && path.last() != Some(&field)
        {
            path.push(field);
        }
        let key = if path.is_empty() {
            "<root>".to_string()
        } else {
            path.join(".")
        };
        let mut message = match &error.kind {
            Kind::UnknownField(field, expected) => {
                format!(
                    "unknown key `{field}` (expected one of: {})",
                    expected.join(", ")
                )
            }
            Kind::UnknownVariant(v, expected) => {
                let tierish = expected.contains(&"G2");
                format!(
                    "unknown {} `{v}` (expected one of: {})",
                    if tierish { "tier" } else { "value" },
                    expected.join(", ")
                )
            }
            kind => kind.to_string(),
        };
        match self.origin(&key) {
            Some(Origin::Override) => message.push_str(" (set by an explicit override)"),
            Some(Origin::Env(name)) => {
                message.push_str(&format!(" (from environment variable {name})"))
            }
            None => match (&error.metadata, &self.file) {
                (Some(meta), _) if meta.name.contains("TOML") => {
                    let file = self
                        .file
                        .as_ref()
                        .map(|p| p.display().to_string())
                        .unwrap_or_default();
                    message.push_str(&format!(" (in {file})"));
                }
                (_, Some(file)) => message.push_str(&format!(" (in {})", file.display())),
                _ => {}
            },
        }
        EngineError::config(key, message)
    }
}

#[cfg(test)]
mod tests;
