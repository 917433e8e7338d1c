//! [`StackPlan`]: everything a [`TierStack`] is built from, and where its G4 lives.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use kvbm_logical::LogicalConfig;
use kvbm_offload::{ObjectPipelineConfig, PipelineConfig};
use kvbm_physical::{IoEngineKind, ObjectConfig, S3Config};

use crate::KvbmConfig;
use crate::error::Result;

use super::context::{Context, stack_error};

use super::hooks::{Contents, Identities};
#[cfg(feature = "nats")]
use super::sharing::Sharing;

/// Where G4 lives.
#[derive(Debug, Clone)]
pub enum G4Location {
    /// A local-filesystem object store: in `dir` (persistent), or in a temporary directory.
    Local(Option<PathBuf>),
    /// An S3-compatible store.
    S3(S3Config),
}

/// How an inference engine drives the stack.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum FrontEnd {
    /// The scheduler-facing manager ([`EngineTieringManager`]), vLLM's call sequence:
    /// lookup → prepare_load → load → complete_load, prepare_store → store → complete_store.
    #[default]
    Tiering,
    /// The leader's `find_matches` and onboarding sessions, block runs per tier; computed
    /// blocks go down the G1→G2 lane.
    Sessions,
}

/// Everything the tiers are built from.
#[derive(Debug, Clone)]
pub struct StackPlan {
    /// Bytes per block (a multiple of 4096).
    pub block_bytes: usize,
    /// G1 capacity (must hold the longest request).
    pub g1_blocks: usize,
    /// G2 capacity; 0 disables G2 (and so G3 and G4, which are staged through it).
    pub g2_blocks: usize,
    /// G3 capacity; 0 disables G3.
    pub g3_blocks: usize,
    /// Where G3's file and manifest live (persistent); a temporary directory when `None`.
    pub g3_dir: Option<PathBuf>,
    /// G3 I/O settings.
    pub g3_engine: IoEngineKind,
    /// G3 requests in flight per transfer.
    pub g3_queue_depth: u32,
    /// G3 O_DIRECT.
    pub g3_direct_io: bool,
    /// G4, when enabled.
    pub g4: Option<G4Location>,
    /// Key prefix of G4 objects.
    pub g4_namespace: String,
    /// Blocks the G4 presence index can hold.
    pub g4_capacity: usize,
    /// Block managers' settings (eviction policy etc.).
    pub logical: LogicalConfig,
    /// G1→G2 lane.
    pub g1_to_g2: PipelineConfig,
    /// G2→G3 lane.
    pub g2_to_g3: PipelineConfig,
    /// G2→G4 lane.
    pub g2_to_g4: ObjectPipelineConfig,
    /// The transfer managers' settings.
    pub transfer: kvbm_physical::TransferConfig,
    /// G4's settings (its namespace is replaced by `g4_namespace`).
    pub object: ObjectConfig,
    /// The merged engine configuration the replay's `KvbmRuntime` is built from (its runtime,
    /// events and metrics sections, and the leader's search order).
    pub engine: KvbmConfig,
    /// Set when this stack is one of several instances sharing G4 (feature `nats`).
    #[cfg(feature = "nats")]
    pub sharing: Option<Sharing>,
    /// How the stack is driven: through the scheduler-facing manager or onboarding sessions.
    pub front_end: FrontEnd,
    /// Identities of blocks a tier may know only by name (see [`Identities`]).
    pub identities: Arc<Identities>,
    /// What each block's bytes are: filled when computed, verified on arrival in G1.
    pub contents: Arc<dyn Contents>,
}

/// Fails fast, with a clear message, when nothing listens at an S3 endpoint (the object store
/// client would otherwise retry for minutes).
pub fn probe_endpoint(endpoint: &str) -> Result<()> {
    use std::net::ToSocketAddrs;
    let rest = endpoint
        .strip_prefix("http://")
        .or_else(|| endpoint.strip_prefix("https://"))
        .ok_or_else(|| {
            stack_error!("S3 endpoint {endpoint:?} must start with http:// or https://")
        })?;
    let hostport = rest.split('/').next().unwrap_or(rest);
    let hostport = if hostport.contains(':') {
        hostport.to_string()
    } else if endpoint.starts_with("https://") {
        format!("{hostport}:443")
    } else {
        format!("{hostport}:80")
    };
    let addrs: Vec<_> = hostport
        .to_socket_addrs()
        .with_context(|| format!("cannot resolve S3 endpoint {endpoint}"))?
        .collect();
    let mut last = None;
    for a in addrs {
        match std::net::TcpStream::connect_timeout(&a, Duration::from_secs(3)) {
            Ok(_) => return Ok(()),
            Err(e) => last = Some(e),
        }
    }
    Err(stack_error!(
        "cannot reach S3 endpoint {endpoint}: {}",
        last.map_or("no address".to_string(), |e| e.to_string())
    ))
}
