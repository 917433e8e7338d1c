//! The secondary-tier seam (vLLM `tiering/base.py`): jobs, results, the parent callback and the
//! `SecondaryTierManager` trait.
//!
//! A secondary tier never touches GPU memory: a *store* job copies pinned primary slots
//! (`chunk_ids`) out to the tier (a cascade), a *load* job fills reserved primary slots from the
//! tier (a promotion). Jobs are submitted without blocking and reported exactly once through
//! `get_finished_jobs`; `drain_jobs` blocks until every submitted job is reported (never aborting
//! a copy mid-way).

use std::sync::Arc;
use std::time::Instant;

use crate::error::Result;
use crate::key::OffloadKey;
use crate::stats::OffloadingConnectorStats;
use crate::tiering::backpressure::Backpressure;
use crate::types::{
    CacheHitSource, Locality, LookupResult, Medium, OffloadingEvent, ReqContext,
    RequestOffloadingContext, ScheduleEndContext,
};

/// Job identifier, unique per manager (monotonic).
pub type JobId = u64;

/// One primary ↔ secondary transfer.
#[derive(Clone, Debug)]
pub struct TierJob {
    /// Id.
    pub job_id: JobId,
    /// Keys moved.
    pub keys: Vec<OffloadKey>,
    /// Primary slots, co-indexed with `keys`.
    pub chunk_ids: Vec<i32>,
    /// Secondary → primary (true) or primary → secondary (false).
    pub is_promotion: bool,
    /// The request it serves.
    pub req_context: ReqContext,
    /// When it was created.
    pub submit_time: Instant,
}

/// What a tier's I/O can still touch: set once the primary chunks of a failed promotion are
/// out of the writer's reach (vLLM 0.34 `JobResult.deferred_release`, a `threading.Event`).
/// The tier may set it from any thread; the manager reads it on its own polling path.
pub trait ReleaseFlag: Send + Sync {
    /// Whether the chunks may be released now.
    fn is_set(&self) -> bool;
}

impl ReleaseFlag for std::sync::atomic::AtomicBool {
    fn is_set(&self) -> bool {
        self.load(std::sync::atomic::Ordering::Acquire)
    }
}

/// A failed promotion's deferred release ([`ReleaseFlag`]): the manager fails the keys at once
/// and keeps their primary chunks out of the free pool until the flag is set. Two are equal
/// when they are the same flag.
#[derive(Clone)]
pub struct DeferredRelease(pub Arc<dyn ReleaseFlag>);

impl DeferredRelease {
    /// Whether the chunks may be released now.
    pub fn is_set(&self) -> bool {
        self.0.is_set()
    }
}

impl std::fmt::Debug for DeferredRelease {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("DeferredRelease")
            .field(&self.is_set())
            .finish()
    }
}

impl PartialEq for DeferredRelease {
    fn eq(&self, o: &Self) -> bool {
        Arc::ptr_eq(&self.0, &o.0)
    }
}

/// Outcome of a job.
#[derive(Clone, Debug, PartialEq)]
pub struct JobResult {
    /// Id.
    pub job_id: JobId,
    /// Whether every key moved.
    pub success: bool,
    /// Promotions only: the keys that did move when `success` is false (`None`: none did).
    pub successful_keys: Option<Vec<OffloadKey>>,
    /// Seconds taken.
    pub transfer_time: Option<f64>,
    /// Bytes moved.
    pub transfer_bytes: Option<u64>,
    /// Failed promotions only (vLLM 0.34): the tier's I/O may still write into the failed
    /// keys' primary chunks until this is set ([`DeferredRelease`]).
    pub deferred_release: Option<DeferredRelease>,
}

impl JobResult {
    /// A result with only id and success.
    pub fn new(job_id: JobId, success: bool) -> Self {
        Self {
            job_id,
            success,
            successful_keys: None,
            transfer_time: None,
            transfer_bytes: None,
            deferred_release: None,
        }
    }
}

/// Callbacks a tier may make into the manager for remotely originated work (P2P); the wrapper
/// excludes the calling tier from fan-out.
pub trait ParentManager {
    /// A remote request.
    fn on_new_request(&mut self, req_context: &ReqContext) -> Result<RequestOffloadingContext>;
    /// Lookup across the other tiers.
    fn lookup(&mut self, key: &OffloadKey, req_context: &ReqContext) -> LookupResult;
    /// Pins primary chunks and registers a store job for the calling tier.
    fn create_store_job(
        &mut self,
        keys: &[OffloadKey],
        req_context: &ReqContext,
    ) -> Result<Arc<TierJob>>;
    /// The remote request finished.
    fn on_request_finished(&mut self, req_context: &ReqContext) -> Result<()>;
}

/// A tier below the CPU primary.
pub trait SecondaryTierManager: Send {
    /// Type label (`disk`, `obj`, `mem`, …), used in stats labels `"<idx+1>:<type>"`.
    fn tier_type(&self) -> &str;
    /// Medium, for tier filters (`None` = wildcard).
    fn medium(&self) -> Option<Medium> {
        None
    }
    /// Locality, for tier filters (`None` = wildcard).
    fn locality(&self) -> Option<Locality> {
        None
    }
    /// Where hits of this tier load from.
    fn cache_hit_source(&self) -> CacheHitSource {
        match self.medium() {
            Some(Medium::Cpu) => CacheHitSource::Host,
            Some(Medium::Storage) => CacheHitSource::Disk,
            None => CacheHitSource::ExternalUnspecified,
        }
    }
    /// Bytes per primary chunk (for backpressure byte counts).
    fn block_size_bytes(&self) -> usize;
    /// The tier's back-pressure detector, if any.
    fn bp_detector(&mut self) -> Option<&mut dyn Backpressure> {
        None
    }
    /// `Hit` present and ready, `Miss` absent, `Retry` not known yet.
    fn lookup(&mut self, key: &OffloadKey, req_context: &ReqContext) -> LookupResult;
    /// Starts copying pinned primary slots to the tier (non-blocking).
    fn submit_store(&mut self, job: Arc<TierJob>);
    /// Starts filling reserved primary slots from the tier (non-blocking).
    fn submit_load(&mut self, job: Arc<TierJob>);
    /// Appends every job finished since the last call.
    fn get_finished_jobs(&mut self, out: &mut Vec<JobResult>);
    /// Blocks until every submitted job is finished and queued for `get_finished_jobs`.
    fn drain_jobs(&mut self) -> Result<()>;
    /// The tier's policy for a new request.
    fn on_new_request(&mut self, req_context: &ReqContext) -> RequestOffloadingContext;
    /// No more submits for this request.
    fn on_request_finished(&mut self, req_context: &ReqContext) {
        let _ = req_context;
    }
    /// Recency hint.
    fn touch(&mut self, keys: &[OffloadKey], req_context: &ReqContext) {
        let _ = (keys, req_context);
    }
    /// Events of state this tier owns.
    fn take_events(&mut self) -> Vec<OffloadingEvent> {
        Vec::new()
    }
    /// Whether the tier has outstanding work.
    fn has_pending_work(&self) -> bool {
        false
    }
    /// End of a scheduler step.
    fn on_schedule_end(&mut self, context: &ScheduleEndContext) {
        let _ = context;
    }
    /// Serves remotely originated requests through the parent.
    fn serve_external_requests(&mut self, parent: &mut dyn ParentManager) {
        let _ = parent;
    }
    /// Stops the tier; after `Ok` it no longer touches primary memory.
    fn shutdown(&mut self) -> Result<()> {
        Ok(())
    }
    /// Tier metrics since the last call.
    fn get_stats(&mut self) -> Option<OffloadingConnectorStats> {
        None
    }
    /// For downcasting to the concrete tier (tests, operators).
    fn as_any_mut(&mut self) -> &mut dyn std::any::Any;
}

/// Placeholder occupying a tier's place while the tier itself is lent to
/// `serve_external_requests` (the parent callbacks exclude that tier anyway).
pub(crate) struct Detached;

impl SecondaryTierManager for Detached {
    fn tier_type(&self) -> &str {
        "detached"
    }
    fn block_size_bytes(&self) -> usize {
        0
    }
    fn lookup(&mut self, _: &OffloadKey, _: &ReqContext) -> LookupResult {
        LookupResult::Miss
    }
    fn submit_store(&mut self, _: Arc<TierJob>) {}
    fn submit_load(&mut self, _: Arc<TierJob>) {}
    fn get_finished_jobs(&mut self, _: &mut Vec<JobResult>) {}
    fn drain_jobs(&mut self) -> Result<()> {
        Ok(())
    }
    fn on_new_request(&mut self, _: &ReqContext) -> RequestOffloadingContext {
        RequestOffloadingContext::default()
    }
    fn as_any_mut(&mut self) -> &mut dyn std::any::Any {
        self
    }
}
