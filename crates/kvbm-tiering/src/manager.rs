//! The scheduler-side contract (vLLM `OffloadingManager`), one method per upstream method, with
//! upstream's defaults as default bodies. Every call that can be misused returns a
//! [`TieringError`](crate::TieringError) naming the call and key and leaves the manager unchanged.
//!
//! Call order per request (scheduler thread, one step at a time):
//!
//! ```text
//! on_new_request ─► lookup* ─► prepare_load ─► complete_load      (GPU ◄─ offload)
//!                          └─► prepare_store ─► complete_store    (GPU ─► offload)
//!                 ─► touch* ─► on_request_finished
//! every step:  on_schedule_end ─► get_stats
//! ```

use crate::error::Result;
use crate::key::OffloadKey;
use crate::stats::OffloadingConnectorStats;
use crate::types::{
    CacheHitSource, LoadStoreSpec, LookupResult, OffloadingEvent, PrepareStoreOutput, ReqContext,
    RequestOffloadingContext, ScheduleEndContext,
};

/// The scheduler-facing offloading manager.
pub trait OffloadingManager {
    /// Whether one block is offloaded and ready (`Hit`), absent (`Miss`), found but not yet
    /// readable (`HitPending`) or unknown for now (`Retry`).
    fn lookup(&mut self, key: &OffloadKey, req_context: &ReqContext) -> LookupResult;

    /// Pins the given blocks (all must be `Hit`) for a read and returns where they are,
    /// co-indexed with `keys`.
    fn prepare_load(
        &mut self,
        keys: &[OffloadKey],
        req_context: &ReqContext,
    ) -> Result<LoadStoreSpec>;

    /// Marks blocks as recently used. Default: no-op.
    fn touch(&mut self, keys: &[OffloadKey], req_context: &ReqContext) -> Result<()> {
        let _ = (keys, req_context);
        Ok(())
    }

    /// Releases blocks pinned by `prepare_load`. Default: no-op.
    fn complete_load(&mut self, keys: &[OffloadKey], req_context: &ReqContext) -> Result<()> {
        let _ = (keys, req_context);
        Ok(())
    }

    /// Reserves room for the blocks not yet offloaded; `None` when they cannot be stored
    /// (and then nothing was evicted or allocated).
    fn prepare_store(
        &mut self,
        keys: &[OffloadKey],
        req_context: &ReqContext,
    ) -> Result<Option<PrepareStoreOutput>>;

    /// Marks prepared blocks stored (loadable), or drops them when `success` is false.
    /// Default: no-op.
    fn complete_store(
        &mut self,
        keys: &[OffloadKey],
        req_context: &ReqContext,
        success: bool,
    ) -> Result<()> {
        let _ = (keys, req_context, success);
        Ok(())
    }

    /// A new request; returns how its blocks should be offloaded.
    fn on_new_request(&mut self, req_context: &ReqContext) -> Result<RequestOffloadingContext>;

    /// No more submit-side calls follow for this request (completions may). Default: no-op.
    fn on_request_finished(&mut self, req_context: &ReqContext) -> Result<()> {
        let _ = req_context;
        Ok(())
    }

    /// Events since the last call. Default: none.
    fn take_events(&mut self) -> Vec<OffloadingEvent> {
        Vec::new()
    }

    /// End of a scheduler step. Default: no-op.
    fn on_schedule_end(&mut self, context: &ScheduleEndContext) -> Result<()> {
        let _ = context;
        Ok(())
    }

    /// Whether the engine must keep stepping. Default: false.
    fn has_pending_work(&self) -> bool {
        false
    }

    /// Evicts everything tracked and resets state. Default: no-op.
    fn reset_cache(&mut self) -> Result<()> {
        Ok(())
    }

    /// Metrics since the last call, or `None` when disabled. Default: `None`.
    fn get_stats(&mut self) -> Option<OffloadingConnectorStats> {
        None
    }

    /// Releases resources. Default: no-op.
    fn shutdown(&mut self) -> Result<()> {
        Ok(())
    }

    /// Where a `Hit` will be loaded from. Default: unspecified external source.
    fn get_load_source(&self, key: &OffloadKey, req_context: &ReqContext) -> CacheHitSource {
        let _ = (key, req_context);
        CacheHitSource::ExternalUnspecified
    }

    /// The connector flushed the loads that were in flight at `reset_cache`. Default: no-op.
    fn on_reset_flushed(&mut self) {}
}
