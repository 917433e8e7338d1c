//! What an embedder needs to build and drive one instance's tier stack, in one `use`:
//!
//! ```no_run
//! use kvbm_engine::prelude::*;
//! # fn demo(contents: std::sync::Arc<dyn Contents>) -> Result<()> {
//! let config = ConfigBuilder::new().file("kvbm.toml")?.build()?;
//! let stack = TierStack::build(&StackPlan::new(config, contents)?)?;
//! # let _ = stack; Ok(())
//! # }
//! ```
//!
//! The rest of the core is reached by module (`leader`, `manager`, `mover`, `worker`,
//! `stack`), the cluster plane by `cluster`.

pub use crate::address::{InstanceId, RankAddress, WorkerAddress};
pub use crate::config::{ConfigBuilder, KvbmConfig};
pub use crate::error::{EngineError, Result};
pub use crate::leader::{
    BlockHolder, InstanceLeader, MatchedPrefix, OnboardingSession, Phase, SessionError,
    SessionFailure,
};
pub use crate::manager::EngineTieringManager;
pub use crate::replay::{ReplayDriver, Served};
pub use crate::runtime::{KvbmRuntime, KvbmRuntimeBuilder, RuntimeHandle};
pub use crate::stack::{Contents, FrontEnd, Identities, StackPlan, TierStack};
pub use kvbm_logical::TierId;
pub use kvbm_offload::{BlockFailure, BlockFailureKind};
