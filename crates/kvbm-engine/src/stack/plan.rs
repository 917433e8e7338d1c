//! [`StackPlan`]: everything a [`TierStack`] is built from, and where its G4 lives.

use std::sync::Arc;
use std::time::Duration;

use crate::KvbmConfig;
use crate::error::Result;

use super::context::{Context, stack_error};

use super::hooks::{Contents, Identities, ShareG4};

/// How an inference engine drives the stack.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum FrontEnd {
    /// The scheduler-facing manager
    /// ([`EngineTieringManager`](crate::manager::EngineTieringManager)), vLLM's call sequence:
    /// lookup → prepare_load → load → complete_load, prepare_store → store → complete_store.
    #[default]
    Tiering,
    /// The leader's `find_matches` and onboarding sessions, block runs per tier; computed
    /// blocks go down the G1→G2 lane.
    Sessions,
}

/// Everything a [`TierStack`](super::TierStack) is built from: the configuration tree and
/// what is not configuration (the hooks, the front end, sharing).
///
/// From the tree the stack reads:
///
/// ```text
///  [tiers]            g1_blocks (> 0: host memory standing in for the device), g2_blocks,
///                     g3_blocks, g4_blocks (G4's presence index), block_bytes
///  [physical.disk]    G3's file (its journal beside it: g3.bin → g3.journal), I/O engine,
///                     queue depth, O_DIRECT
///  [physical.s3] | physical.object_dir     where G4 lives
///  [physical.object]  G4's namespace and request settings
///  [physical.transfer], [logical], [offload.*], [leader], [runtime], [events], [metrics]
/// ```
///
/// A location is never invented: G3 needs `[physical.disk]` and G4 `[physical.s3]` or
/// `physical.object_dir` ([`KvbmConfig::validate`] says which key is missing). A caller that
/// wants scratch tiers (a replay, a test) makes the directories and names them.
#[derive(Debug, Clone)]
pub struct StackPlan {
    /// The configuration tree (see above).
    pub config: KvbmConfig,
    /// Set when this stack is one of several instances sharing G4 (over NATS:
    /// `cluster::shared_g4::Sharing`, feature `nats`).
    pub sharing: Option<Arc<dyn ShareG4>>,
    /// How the stack is driven: through the scheduler-facing manager or onboarding sessions.
    pub front_end: FrontEnd,
    /// Identities of blocks a tier may know only by name (see [`Identities`]).
    pub identities: Arc<Identities>,
    /// What each block's bytes are: filled when computed, verified on arrival in G1.
    pub contents: Arc<dyn Contents>,
}

impl StackPlan {
    /// A plan over `config`, driven through the scheduler-facing manager
    /// ([`FrontEnd::Tiering`]), with no identities known beyond the blocks' own, sharing
    /// nothing.
    ///
    /// # Errors
    /// [`EngineError::Config`](crate::EngineError::Config) naming the first offending key
    /// ([`KvbmConfig::validate`]; and `tiers.g1_blocks`, which the stack needs > 0).
    pub fn new(config: KvbmConfig, contents: Arc<dyn Contents>) -> Result<Self> {
        config.validate()?;
        if config.tiers.g1_blocks == 0 {
            return Err(crate::EngineError::config(
                "tiers.g1_blocks",
                "the stack serves every block in G1 (host memory standing in for the device): \
                 must be > 0",
            ));
        }
        Ok(StackPlan {
            config,
            sharing: None,
            front_end: FrontEnd::Tiering,
            identities: Arc::default(),
            contents,
        })
    }
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
