//! The CPU tier: slot table, cache policies (LRU, ARC), the plain CPU manager and the primary
//! tier with its pinned host memory.

pub(crate) mod index;
pub mod manager;
pub(crate) mod order;
pub mod policy;
pub mod primary;
pub(crate) mod requests;

pub use manager::{CpuManagerConfig, CpuOffloadingManager, FinishedAccess, SlotState, StorePlan};
pub use policy::CachePolicyKind;
pub use primary::CpuPrimaryTier;
