//! `TieringManager`: kvbm-tiering's vLLM-exact [`TieringOffloadingManager`] behind the Python
//! boundary, over a primary tier ([`CpuManager::primary`]) and secondary tiers that are either
//! kvbm's own (moved into Rust whole) or any Python `SecondaryTierManager` (driven through
//! [`PyTier`]).
//!
//! ```text
//!  vLLM scheduler ─► kvbm_vllm TieringOffloadingManager (Python: vLLM's ABC, its lock, the
//!                      │                                  tier-poll thread, vLLM's objects)
//!                      └─► TieringManager (this) ─► kvbm-tiering TieringOffloadingManager
//!                                                     ├─ primary (the CpuManager's Core)
//!                                                     ├─ kvbm_disk / kvbm_object: Rust tiers
//!                                                     └─ PyTier ─► a Python tier's methods,
//!                                                                  vLLM's TransferJob/JobResult
//! ```
//!
//! # Python tiers
//!
//! A Python tier sees exactly what vLLM's manager would show it: its methods are looked up on
//! the object at each call (a test's `monkeypatch.setattr(tier, "submit_store", …)` is seen),
//! jobs are vLLM's `TransferJob` objects (made by a factory the Python side hands in) carrying
//! the caller's own `ReqContext` object, its back-pressure detector is asked and fed through
//! [`Backpressure`] (latency measured from the `TransferJob.submit_time` the tier holds), and
//! `serve_external_requests` gets a [`Parent`] that calls back into the manager.
//!
//! A tier method that raises cannot unwind through kvbm-tiering (its calls return plain
//! values, as vLLM's contract has them): the first exception of a manager call is kept and
//! raised when the call returns (a lookup that raised reads as a miss meanwhile, a store that
//! raised as not submitted). Nothing is swallowed.
//!
//! # The parent handle
//!
//! kvbm-tiering lends a tier `&mut dyn ParentManager` for the duration of
//! `serve_external_requests` (the manager itself, that tier detached). [`Parent`] carries that
//! borrow into Python as a raw pointer that is valid only while the call runs: it is cleared
//! before `serve_external_requests` returns (also on error), and only the thread that lent it
//! may use it, so a tier that keeps the handle and calls it later, or from another thread,
//! gets an error, never a dangling pointer. The handle itself may be dropped on any thread (a
//! traceback that keeps it, freed later elsewhere, is fine).

use std::ptr::NonNull;
use std::sync::Arc;

use kvbm_tiering::tiering::{
    Backpressure, DeferredRelease, JobId, JobResult, ParentManager, ReleaseFlag,
    SecondaryTierManager, TierJob,
};
use kvbm_tiering::{
    CacheHitSource, Locality, LookupResult, Medium, OffloadKey, OffloadScope, OffloadingManager,
    ReqContext, RequestOffloadingContext, ScheduleEndContext, TieringError, UpstreamFixes,
};
use parking_lot::Mutex;
use pyo3::exceptions::{PyRuntimeError, PyTypeError, PyValueError};
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList, PyTuple};
use std::collections::HashMap;

use crate::bridge::{
    CallerKeys, Contexts, chunk_ids, job_chunk_ids, job_keys, key, key_list, keys, origin, to_py,
};
use crate::core::{Inner, StatsTriple, triple};
use crate::cpu::{CpuManager, LookupMembers};
use crate::tiers::StorageTier;

/// What every [`PyTier`] and [`Parent`] of one manager share with it.
pub(crate) struct Shared {
    contexts: Arc<Contexts>,
    /// The objects of the lookup in progress, handed back to a Python tier's `lookup`.
    caller: crate::bridge::CallerSlot,
    results: Arc<LookupMembers>,
    /// The first exception a Python tier raised during the current call.
    error: Mutex<Option<PyErr>>,
    /// Whether `error` may hold one (read without the lock on every call).
    has_error: std::sync::atomic::AtomicBool,
    /// `make_job(job_id, keys, chunk_ids, is_promotion, req_context) -> TransferJob`.
    make_job: Py<PyAny>,
    /// `make_request_context(policy: str) -> RequestOffloadingContext`.
    make_request_context: Py<PyAny>,
    /// vLLM's `OffloadPolicy.CHUNK_LEVEL` and `REQUEST_LEVEL` (see `scope_of`).
    policies: [Py<PyAny>; 2],
    /// The Python `ScheduleEndContext` of the `on_schedule_end` in progress.
    schedule_end: Mutex<Option<Py<PyAny>>>,
    /// Jobs of Python tiers submitted and not yet reported, as the tiers were handed them:
    /// `job_id -> (tier, TransferJob)`. Kept outside the manager's lock so a tier may read
    /// the manager's `_jobs` while one of its own methods runs (vLLM's tests do).
    py_jobs: Mutex<std::collections::BTreeMap<JobId, (usize, Py<PyAny>)>>,
}

impl Shared {
    /// Keeps the first error of a call.
    fn keep(&self, e: PyErr) {
        let mut slot = self.error.lock();
        if slot.is_none() {
            *slot = Some(e);
            self.has_error
                .store(true, std::sync::atomic::Ordering::Release);
        }
    }

    /// The error kept during the call just made, if any.
    fn take_error(&self) -> PyResult<()> {
        if !self.has_error.load(std::sync::atomic::Ordering::Acquire) {
            return Ok(());
        }
        let mut slot = self.error.lock();
        self.has_error
            .store(false, std::sync::atomic::Ordering::Release);
        match slot.take() {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// The Python `ReqContext` of a Rust one (every context the manager sees came from Python).
    fn py_ctx<'py>(&self, py: Python<'py>, ctx: &ReqContext) -> PyResult<Bound<'py, PyAny>> {
        if let Some(c) = self.caller.ctx(py, ctx.uid()) {
            return Ok(c);
        }
        origin(py, ctx).ok_or_else(|| {
            PyRuntimeError::new_err(format!(
                "request {} has no Python context (kvbm-vllm bug)",
                ctx.req_id()
            ))
        })
    }

    /// vLLM's `TransferJob` for a kvbm job.
    fn job<'py>(&self, py: Python<'py>, job: &TierJob) -> PyResult<Bound<'py, PyAny>> {
        let ctx = self.py_ctx(py, &job.req_context)?;
        self.make_job.bind(py).call1((
            job.job_id,
            job_keys(py, &job.keys)?,
            job_chunk_ids(py, &job.chunk_ids),
            job.is_promotion,
            ctx,
        ))
    }

    fn lookup_result(&self, _py: Python<'_>, r: &Bound<'_, PyAny>) -> PyResult<LookupResult> {
        if let Some(member) = self.results.which(r) {
            return Ok(member);
        }
        Err(PyTypeError::new_err(format!(
            "a tier's lookup must return a LookupResult member, got {r}"
        )))
    }
}

/// vLLM's `OffloadPolicy` member `policy` as kvbm's scope: by identity with the members the
/// manager was built with (`members`: `CHUNK_LEVEL`, `REQUEST_LEVEL`), else by its `.value`
/// (an enum member's `value` is a Python-level property: a call, once per tier per request).
fn scope_of(policy: &Bound<'_, PyAny>, members: &[Py<PyAny>; 2]) -> PyResult<OffloadScope> {
    if policy.is(&members[0]) {
        return Ok(OffloadScope::ChunkLevel);
    }
    if policy.is(&members[1]) {
        return Ok(OffloadScope::RequestLevel);
    }
    let value: String = policy.getattr(intern!(policy.py(), "value"))?.extract()?;
    match value.as_str() {
        "chunk_level" => Ok(OffloadScope::ChunkLevel),
        "request_level" => Ok(OffloadScope::RequestLevel),
        other => Err(PyValueError::new_err(format!(
            "unknown OffloadPolicy {other:?}"
        ))),
    }
}

/// Runs `f` attached to the interpreter: a Python tier's method and a back-pressure detector's
/// are called this way. With the token of the manager lookup in progress when there is one
/// (`in_lookup`: [`CallerSlot::in_lookup`](crate::bridge::CallerSlot::in_lookup), which says
/// the thread is attached), else through `Python::attach`. A lookup that came in through its C
/// entry (`crate::entry`) has not raised pyo3's attach count, so `Python::attach` there would
/// take CPython's `PyGILState_Ensure` route: a tier's `lookup`, and a promotion's read of its
/// `cache_hit_source`, once per chunk.
fn attached<R>(in_lookup: bool, f: impl for<'py> FnOnce(Python<'py>) -> R) -> R {
    if in_lookup {
        // SAFETY: the thread is attached while a lookup is in progress (`in_lookup`).
        f(unsafe { Python::assume_attached() })
    } else {
        Python::attach(f)
    }
}

/// A Python tier's `JobResult.deferred_release` (vLLM 0.34, a `threading.Event`), read by the
/// manager on its polling path. An event whose `is_set` raises is taken as not set (its chunks
/// stay held: never released under a writer), and logged.
struct PyReleaseFlag(Py<PyAny>);

impl ReleaseFlag for PyReleaseFlag {
    fn is_set(&self) -> bool {
        Python::attach(
            |py| match self.0.bind(py).call_method0(intern!(py, "is_set")) {
                Ok(v) => v.is_truthy().unwrap_or(false),
                Err(e) => {
                    let msg = format!(
                        "a tier's deferred_release.is_set() raised ({e}); its chunks stay held"
                    );
                    let _ = py
                        .import("logging")
                        .and_then(|l| l.call_method1("getLogger", ("vllm.kvbm_vllm",)))
                        .and_then(|lg| lg.call_method1("error", (msg,)));
                    false
                }
            },
        )
    }
}

pub(crate) fn hit_source_name(s: CacheHitSource) -> &'static str {
    match s {
        CacheHitSource::Host => "host",
        CacheHitSource::P2p => "p2p",
        CacheHitSource::Disk => "disk",
        CacheHitSource::ExternalUnspecified => "external_unspecified",
    }
}

/// An optional enum attribute's `.value` as a string.
fn enum_value(obj: &Bound<'_, PyAny>, name: &str) -> PyResult<Option<String>> {
    let v = obj.getattr(name)?;
    if v.is_none() {
        return Ok(None);
    }
    Ok(Some(v.getattr("value")?.extract()?))
}

/// A Python tier's back-pressure detector, fed as vLLM's manager feeds it.
struct PyBackpressure {
    detector: Option<Py<PyAny>>,
    /// Store jobs reported finished in the last poll, by id: their `submit_time` is the
    /// latency's start (the tier, or a test, may have changed it).
    finished: HashMap<JobId, Py<PyAny>>,
    shared: Arc<Shared>,
}

impl PyBackpressure {
    fn call<'py>(
        &self,
        py: Python<'py>,
        name: &Bound<'py, pyo3::types::PyString>,
        args: impl pyo3::call::PyCallArgs<'py>,
    ) -> Option<Bound<'py, PyAny>> {
        let d = self.detector.as_ref()?.bind(py);
        match d.call_method1(name, args) {
            Ok(v) => Some(v),
            Err(e) => {
                self.shared.keep(e);
                None
            }
        }
    }
}

impl Backpressure for PyBackpressure {
    fn should_store(&mut self, num_blocks: usize) -> bool {
        attached(self.shared.caller.in_lookup(), |py| {
            self.call(py, intern!(py, "should_store"), (num_blocks,))
                .is_none_or(|v| v.is_truthy().unwrap_or(true))
        })
    }

    fn on_store_completed(&mut self, job: &TierJob, num_bytes: u64) {
        attached(self.shared.caller.in_lookup(), |py| {
            let submit_time = match self.finished.remove(&job.job_id) {
                Some(j) => j.bind(py).getattr(intern!(py, "submit_time")),
                None => {
                    // Not a job this tier was handed as an object (cannot happen for a Python
                    // tier): measure from the Rust job's submit instant.
                    let now = py
                        .import("time")
                        .and_then(|t| t.call_method0("monotonic"))
                        .and_then(|t| t.extract::<f64>());
                    now.map(|n| (n - job.submit_time.elapsed().as_secs_f64()).into_pyobject(py))
                        .and_then(|r| r.map(|b| b.into_any()).map_err(Into::into))
                }
            };
            match submit_time {
                Ok(t) => {
                    self.call(py, intern!(py, "update"), (t, num_bytes));
                }
                Err(e) => self.shared.keep(e),
            }
        });
    }

    fn on_store_failed(&mut self) {
        attached(self.shared.caller.in_lookup(), |py| {
            self.call(py, intern!(py, "on_store_failed"), ());
        });
    }

    fn is_under_pressure(&mut self) -> bool {
        attached(self.shared.caller.in_lookup(), |py| {
            self.call(py, intern!(py, "is_under_pressure"), ())
                .is_some_and(|v| v.is_truthy().unwrap_or(false))
        })
    }

    fn store_latency_ema(&mut self) -> Option<f64> {
        attached(self.shared.caller.in_lookup(), |py| {
            let d = self.detector.as_ref()?.bind(py);
            let v = d
                .getattr("stats")
                .and_then(|s| s.call_method1("get", ("store_latency_ema",)));
            match v {
                Ok(v) if v.is_none() => None,
                Ok(v) => v.extract::<f64>().ok(),
                Err(e) => {
                    self.shared.keep(e);
                    None
                }
            }
        })
    }

    fn pop_stores_dropped(&mut self) -> (u64, u64) {
        attached(self.shared.caller.in_lookup(), |py| {
            let Some(d) = self.detector.as_ref() else {
                return (0, 0);
            };
            match d
                .bind(py)
                .getattr("policy")
                .and_then(|p| p.call_method0("pop_stores_dropped"))
                .and_then(|r| r.extract::<(u64, u64)>())
            {
                Ok(r) => r,
                Err(e) => {
                    self.shared.keep(e);
                    (0, 0)
                }
            }
        })
    }

    fn reset(&mut self) {
        attached(self.shared.caller.in_lookup(), |py| {
            self.call(py, intern!(py, "reset"), ());
        });
    }
}

/// A Python `SecondaryTierManager` under kvbm's tiering manager: see the [module docs](self).
pub(crate) struct PyTier {
    obj: Py<PyAny>,
    /// This tier's index in the manager.
    index: usize,
    tier_type: String,
    medium: Option<Medium>,
    locality: Option<Locality>,
    block_size_bytes: usize,
    bp: PyBackpressure,
    shared: Arc<Shared>,
    /// The last `cache_hit_source` enum member read and what it names: the attribute is read
    /// at every promotion (as vLLM does), its `.value` only when it is another object.
    hit_source: Mutex<Option<(Py<PyAny>, CacheHitSource)>>,
}

impl PyTier {
    fn new(obj: &Bound<'_, PyAny>, index: usize, shared: Arc<Shared>) -> PyResult<Self> {
        let tier_type: String = obj.getattr("tier_type")?.extract()?;
        let medium = enum_value(obj, "medium")?.and_then(|m| Medium::parse(&m));
        let locality = enum_value(obj, "locality")?.and_then(|l| Locality::parse(&l));
        let block_size_bytes: usize = obj.getattr("block_size_bytes")?.extract()?;
        Ok(Self {
            obj: obj.clone().unbind(),
            index,
            tier_type,
            medium,
            locality,
            block_size_bytes,
            hit_source: Mutex::new(None),
            bp: PyBackpressure {
                detector: None,
                finished: HashMap::new(),
                shared: shared.clone(),
            },
            shared,
        })
    }

    /// Calls a method of the tier (by an interned name); an exception is kept for the caller
    /// (module docs).
    fn call<'py>(
        &self,
        py: Python<'py>,
        name: &Bound<'py, pyo3::types::PyString>,
        args: impl pyo3::call::PyCallArgs<'py>,
    ) -> Option<Bound<'py, PyAny>> {
        match self.obj.bind(py).call_method1(name, args) {
            Ok(v) => Some(v),
            Err(e) => {
                self.shared.keep(e);
                None
            }
        }
    }

    /// A tier method whose failure kvbm-tiering sees as a tier error (the exception itself
    /// is kept for the caller).
    fn fallible(&self, method: &str) -> kvbm_tiering::Result<()> {
        attached(self.shared.caller.in_lookup(), |py| {
            match self.obj.bind(py).call_method0(method) {
                Ok(_) => Ok(()),
                Err(e) => {
                    let message = format!("{method}: {e}");
                    self.shared.keep(e);
                    Err(TieringError::Tier {
                        tier: self.index,
                        tier_type: self.tier_type.clone(),
                        message,
                    })
                }
            }
        })
    }

    /// Hands `job` to the tier's `submit_load` (`load`) or `submit_store`.
    fn submit(&mut self, load: bool, job: Arc<TierJob>) {
        attached(self.shared.caller.in_lookup(), |py| {
            let method = if load {
                intern!(py, "submit_load")
            } else {
                intern!(py, "submit_store")
            };
            let pj = match self.shared.job(py, &job) {
                Ok(j) => j,
                Err(e) => return self.shared.keep(e),
            };
            self.track(job.job_id, pj.clone().unbind());
            self.call(py, method, (pj,));
        });
    }

    /// Tracks a job handed to this tier (by `submit_*` or made by `create_store_job`).
    pub(crate) fn track(&mut self, id: JobId, job: Py<PyAny>) {
        self.shared.py_jobs.lock().insert(id, (self.index, job));
    }

    fn finished(&mut self, py: Python<'_>, r: &Bound<'_, PyAny>) -> PyResult<JobResult> {
        let job_id: JobId = r.getattr(intern!(py, "job_id"))?.extract()?;
        let success: bool = r.getattr(intern!(py, "success"))?.is_truthy()?;
        let sk = r.getattr(intern!(py, "successful_keys"))?;
        let successful_keys = if sk.is_none() {
            None
        } else {
            Some(keys(&sk)?.to_vec())
        };
        let transfer_time: Option<f64> = r.getattr(intern!(py, "transfer_time"))?.extract()?;
        let transfer_bytes: Option<u64> = r.getattr(intern!(py, "transfer_bytes"))?.extract()?;
        // vLLM 0.34's field; a 0.33 result has none.
        let deferred_release = match r.getattr_opt(intern!(py, "deferred_release"))? {
            Some(ev) if !ev.is_none() => {
                Some(DeferredRelease(Arc::new(PyReleaseFlag(ev.unbind()))))
            }
            _ => None,
        };
        let tracked = self.shared.py_jobs.lock().remove(&job_id);
        if let Some((_, j)) = tracked {
            let is_promotion: bool = j
                .bind(py)
                .getattr(intern!(py, "is_promotion"))?
                .is_truthy()?;
            if !is_promotion {
                self.bp.finished.insert(job_id, j);
            }
        }
        Ok(JobResult {
            job_id,
            success,
            successful_keys,
            transfer_time,
            transfer_bytes,
            deferred_release,
        })
    }

    /// The tier's Python `lookup` of `key` (see `SecondaryTierManager::lookup`).
    fn lookup_in(
        &mut self,
        py: Python<'_>,
        key: &OffloadKey,
        req_context: &ReqContext,
    ) -> LookupResult {
        let ctx = match self.shared.py_ctx(py, req_context) {
            Ok(c) => c,
            Err(e) => {
                self.shared.keep(e);
                return LookupResult::Miss;
            }
        };
        // The caller's own key object when this lookup comes from one (vLLM hands its
        // tiers the key it was asked about; a set of keys then matches it by identity).
        let k = self.shared.caller.key(py, key);
        // `obj.lookup(k, ctx)`, the method looked up on the object at each call (a patched
        // one is seen), without a bound method or an argument list (`vectorcall_method`).
        let r = crate::bridge::vectorcall_method(
            py,
            intern!(py, "lookup"),
            &[self.obj.bind(py).as_any(), &k, &ctx],
        );
        match r {
            Err(e) => {
                self.shared.keep(e);
                LookupResult::Miss
            }
            Ok(r) => self.shared.lookup_result(py, &r).unwrap_or_else(|e| {
                self.shared.keep(e);
                LookupResult::Miss
            }),
        }
    }
}

impl SecondaryTierManager for PyTier {
    fn tier_type(&self) -> &str {
        &self.tier_type
    }
    fn medium(&self) -> Option<Medium> {
        self.medium
    }
    fn locality(&self) -> Option<Locality> {
        self.locality
    }
    /// Read at each promotion, as vLLM does (a class attribute may change meanwhile).
    fn cache_hit_source(&self) -> CacheHitSource {
        attached(self.shared.caller.in_lookup(), |py| {
            let named = |v: Option<&str>| match v {
                Some("host") => CacheHitSource::Host,
                Some("p2p") => CacheHitSource::P2p,
                Some("disk") => CacheHitSource::Disk,
                _ => CacheHitSource::ExternalUnspecified,
            };
            let read = self
                .obj
                .bind(py)
                .getattr(intern!(py, "cache_hit_source"))
                .and_then(|obj| {
                    let mut last = self.hit_source.lock();
                    if let Some((o, s)) = &*last
                        && o.is(&obj)
                    {
                        return Ok(*s);
                    }
                    let s = if obj.is_none() {
                        named(None)
                    } else {
                        let v: String = obj.getattr(intern!(py, "value"))?.extract()?;
                        named(Some(&v))
                    };
                    // Only an enum member is known to keep its value.
                    let member = py.import("enum")?.getattr("Enum")?;
                    *last = obj.is_instance(&member)?.then(|| (obj.unbind(), s));
                    Ok(s)
                });
            read.unwrap_or_else(|e| {
                self.shared.keep(e);
                CacheHitSource::ExternalUnspecified
            })
        })
    }
    fn block_size_bytes(&self) -> usize {
        self.block_size_bytes
    }

    fn bp_detector(&mut self) -> Option<&mut dyn Backpressure> {
        let d = attached(self.shared.caller.in_lookup(), |py| {
            match self.obj.bind(py).getattr(intern!(py, "bp_detector")) {
                Ok(d) if d.is_none() => None,
                Ok(d) => Some(d.unbind()),
                Err(e) => {
                    self.shared.keep(e);
                    None
                }
            }
        });
        self.bp.detector = d;
        self.bp
            .detector
            .is_some()
            .then_some(&mut self.bp as &mut dyn Backpressure)
    }

    fn lookup(&mut self, key: &OffloadKey, req_context: &ReqContext) -> LookupResult {
        // Inside a manager lookup (the usual case) the thread is attached already: its token,
        // without pyo3's attach (a thread-local read and write each way).
        attached(self.shared.caller.in_lookup(), |py| {
            self.lookup_in(py, key, req_context)
        })
    }

    fn submit_store(&mut self, job: Arc<TierJob>) {
        self.submit(false, job);
    }

    fn submit_load(&mut self, job: Arc<TierJob>) {
        self.submit(true, job);
    }

    fn get_finished_jobs(&mut self, out: &mut Vec<JobResult>) {
        attached(self.shared.caller.in_lookup(), |py| {
            self.bp.finished.clear();
            let Some(results) = self.call(py, intern!(py, "get_finished_jobs"), ()) else {
                return;
            };
            let iter = match results.try_iter() {
                Ok(i) => i,
                Err(e) => return self.shared.keep(e),
            };
            for r in iter {
                match r.and_then(|r| self.finished(py, &r)) {
                    Ok(r) => out.push(r),
                    Err(e) => self.shared.keep(e),
                }
            }
        });
    }

    fn drain_jobs(&mut self) -> kvbm_tiering::Result<()> {
        self.fallible("drain_jobs")
    }

    fn on_new_request(&mut self, req_context: &ReqContext) -> RequestOffloadingContext {
        attached(self.shared.caller.in_lookup(), |py| {
            let policy = self
                .shared
                .py_ctx(py, req_context)
                .and_then(|ctx| {
                    self.obj
                        .bind(py)
                        .call_method1(intern!(py, "on_new_request"), (ctx,))
                })
                .and_then(|r| r.getattr(intern!(py, "policy")))
                .and_then(|p| scope_of(&p, &self.shared.policies));
            match policy {
                Ok(policy) => RequestOffloadingContext { policy },
                Err(e) => {
                    self.shared.keep(e);
                    RequestOffloadingContext::default()
                }
            }
        })
    }

    fn on_request_finished(&mut self, req_context: &ReqContext) {
        attached(self.shared.caller.in_lookup(), |py| {
            match self.shared.py_ctx(py, req_context) {
                Ok(ctx) => {
                    self.call(py, intern!(py, "on_request_finished"), (ctx,));
                }
                Err(e) => self.shared.keep(e),
            }
        });
    }

    fn touch(&mut self, keys: &[OffloadKey], req_context: &ReqContext) {
        attached(self.shared.caller.in_lookup(), |py| {
            // vLLM 0.34's tiers have no `touch` (its contract dropped it): nothing to tell.
            if !self
                .obj
                .bind(py)
                .hasattr(intern!(py, "touch"))
                .unwrap_or(false)
            {
                return;
            }
            let args =
                key_list(py, keys).and_then(|k| Ok((k, self.shared.py_ctx(py, req_context)?)));
            match args {
                Ok(args) => {
                    self.call(py, intern!(py, "touch"), args);
                }
                Err(e) => self.shared.keep(e),
            }
        });
    }

    fn has_pending_work(&self) -> bool {
        attached(self.shared.caller.in_lookup(), |py| {
            self.call(py, intern!(py, "has_pending_work"), ())
                .is_some_and(|v| v.is_truthy().unwrap_or(false))
        })
    }

    fn on_schedule_end(&mut self, _context: &ScheduleEndContext) {
        attached(self.shared.caller.in_lookup(), |py| {
            let ctx = self
                .shared
                .schedule_end
                .lock()
                .as_ref()
                .map(|c| c.clone_ref(py));
            if let Some(ctx) = ctx {
                self.call(py, intern!(py, "on_schedule_end"), (ctx,));
            }
        });
    }

    fn serve_external_requests(&mut self, parent: &mut dyn ParentManager) {
        attached(self.shared.caller.in_lookup(), |py| {
            let raw: *mut (dyn ParentManager + '_) = parent;
            // SAFETY: only the trait object's lifetime bound is erased. The pointer is
            // dereferenced only by `Parent::with` while `ptr` is set: from here until it is
            // cleared below, before this call returns, while `parent` is borrowed mutably by us
            // and used by nothing else; `with` refuses every thread but this one.
            let raw: *mut (dyn ParentManager + 'static) = unsafe { std::mem::transmute(raw) };
            let handle = Parent {
                ptr: Mutex::new(NonNull::new(raw).map(Lent)),
                owner: std::thread::current().id(),
                created: Mutex::new(Vec::new()),
                shared: self.shared.clone(),
            };
            let handle = match Bound::new(py, handle) {
                Ok(h) => h,
                Err(e) => return self.shared.keep(e),
            };
            self.call(
                py,
                intern!(py, "serve_external_requests"),
                (handle.clone(),),
            );
            let h = handle.get();
            *h.ptr.lock() = None;
            let created = std::mem::take(&mut *h.created.lock());
            for (id, job) in created {
                self.track(id, job);
            }
        });
    }

    fn shutdown(&mut self) -> kvbm_tiering::Result<()> {
        self.fallible("shutdown")
    }

    fn as_any_mut(&mut self) -> &mut dyn std::any::Any {
        self
    }
}

/// The `&mut dyn ParentManager` a `serve_external_requests` call lends, as a raw pointer.
struct Lent(NonNull<dyn ParentManager>);

// SAFETY: moving the pointer between threads dereferences nothing; it is dereferenced only by
// `Parent::with`, on the thread that lent it, while the call that lent it runs.
unsafe impl Send for Lent {}

/// vLLM's `ParentManager` handed to a Python tier's `serve_external_requests`: valid only
/// during that call, on its thread (module docs).
#[pyclass(module = "kvbm_vllm._kvbm", frozen)]
pub(crate) struct Parent {
    /// The lent manager while the call runs; `with` takes it out for the length of one
    /// manager call (a re-entrant call finds none).
    ptr: Mutex<Option<Lent>>,
    /// The thread that lent it: the only one that may use it.
    owner: std::thread::ThreadId,
    /// Store jobs made through `create_store_job`, tracked by the tier after the call.
    created: Mutex<Vec<(JobId, Py<PyAny>)>>,
    shared: Arc<Shared>,
}

impl Parent {
    fn with<R>(&self, f: impl FnOnce(&mut dyn ParentManager) -> R) -> PyResult<R> {
        if std::thread::current().id() != self.owner {
            return Err(PyRuntimeError::new_err(
                "a ParentManager may be used only on the thread whose serve_external_requests \
                 call it was handed to",
            ));
        }
        let Some(mut p) = self.ptr.lock().take() else {
            return Err(PyRuntimeError::new_err(
                "a ParentManager is valid only during the serve_external_requests call it was \
                 handed to",
            ));
        };
        // SAFETY: `ptr` is set only while the borrow it came from is live
        // (`PyTier::serve_external_requests`, which clears it before returning), on this
        // thread (checked above), and taken out for this call, so no other `with` reaches it
        // meanwhile.
        let r = f(unsafe { p.0.as_mut() });
        *self.ptr.lock() = Some(p);
        Ok(r)
    }
}

#[pymethods]
impl Parent {
    fn on_new_request<'py>(&self, ctx: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyAny>> {
        let c = self.shared.contexts.get(ctx)?;
        let r = self.with(|p| p.on_new_request(&c))?;
        self.shared.take_error()?;
        let r = r.map_err(to_py)?;
        self.shared
            .make_request_context
            .bind(ctx.py())
            .call1((crate::bridge::scope_name(r.policy),))
    }

    fn lookup(&self, key_: &Bound<'_, PyAny>, ctx: &Bound<'_, PyAny>) -> PyResult<Py<PyAny>> {
        let k = key(key_)?;
        let c = self.shared.contexts.get(ctx)?;
        let r = self.with(|p| p.lookup(&k, &c))?;
        self.shared.take_error()?;
        Ok(self.shared.results.get(key_.py(), r))
    }

    fn create_store_job<'py>(
        &self,
        keys_: &Bound<'py, PyAny>,
        ctx: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let py = keys_.py();
        let ks = keys(keys_)?;
        let c = self.shared.contexts.get(ctx)?;
        let job = self.with(|p| p.create_store_job(&ks, &c))?;
        self.shared.take_error()?;
        let job = job.map_err(to_py)?;
        let _caller = CallerKeys::set(&ks);
        let pj = self.shared.job(py, &job)?;
        self.created.lock().push((job.job_id, pj.clone().unbind()));
        Ok(pj)
    }

    fn on_request_finished(&self, ctx: &Bound<'_, PyAny>) -> PyResult<()> {
        let c = self.shared.contexts.get(ctx)?;
        let r = self.with(|p| p.on_request_finished(&c));
        // The remote request is over: its Python context is not kept (the manager's Rust
        // context keeps the object for as long as it needs it).
        self.shared.contexts.forget(ctx)?;
        let r = r?;
        self.shared.take_error()?;
        r.map_err(to_py)
    }
}

/// kvbm-tiering's tiering manager for Python: see the [module docs](self).
#[pyclass(module = "kvbm_vllm._kvbm", frozen)]
pub(crate) struct TieringManager {
    core: Arc<crate::core::Core>,
    shared: Arc<Shared>,
    /// Per tier: whether it is a Python tier (else kvbm's own, in Rust).
    python: Vec<bool>,
}

impl TieringManager {
    /// Runs `f` on the manager, then raises the first exception a Python tier raised in it.
    fn run<R>(
        &self,
        py: Python<'_>,
        f: impl FnOnce(&mut kvbm_tiering::TieringOffloadingManager) -> PyResult<R>,
    ) -> PyResult<R> {
        let r = {
            let mut g = self.core.lock(py)?;
            f(g.tiering()?)
        };
        self.shared.take_error()?;
        r
    }

    fn ctx(&self, ctx: &Bound<'_, PyAny>) -> PyResult<ReqContext> {
        self.shared.contexts.get(ctx)
    }
}

crate::entry::two_argument_entry!(
    LOOKUP_ENTRY,
    TieringManager,
    c"lookup",
    c"lookup($self, key, req_context, *, exclude_tier_idx=None)\n--\n\nvLLM's lookup: HIT, MISS, HIT_PENDING or RETRY.",
    |m: &TieringManager, key, ctx| m.lookup(key, ctx, None)
);

#[pymethods]
impl TieringManager {
    /// A tiering manager over `primary` (a [`CpuManager::primary`]; its state moves in here)
    /// and `tiers`, each a Python tier object or, for kvbm's own tiers, the `StorageTier`
    /// to take over. `upstream`: vLLM's behaviour exactly (else kvbm's fixes of vLLM's bugs).
    /// `make_job`, `make_request_context` and `policies` (`OffloadPolicy.CHUNK_LEVEL`,
    /// `REQUEST_LEVEL`) are vLLM's Python objects the manager makes or compares against.
    #[new]
    #[pyo3(signature = (primary, tiers, upstream, record_lookup_latency, make_job, make_request_context, policies))]
    #[allow(clippy::too_many_arguments)] // Python's positional constructor, called in one place
    fn new(
        py: Python<'_>,
        primary: &Bound<'_, CpuManager>,
        tiers: &Bound<'_, PyList>,
        upstream: bool,
        record_lookup_latency: bool,
        make_job: Py<PyAny>,
        make_request_context: Py<PyAny>,
        policies: (Py<PyAny>, Py<PyAny>),
    ) -> PyResult<Self> {
        let primary = primary.get();
        let shared = Arc::new(Shared {
            contexts: primary.contexts.clone(),
            caller: Default::default(),
            results: primary.results.clone(),
            error: Mutex::new(None),
            has_error: std::sync::atomic::AtomicBool::new(false),
            make_job,
            make_request_context,
            policies: [policies.0, policies.1],
            schedule_end: Mutex::new(None),
            py_jobs: Mutex::new(Default::default()),
        });
        let mut boxed: Vec<Box<dyn SecondaryTierManager>> = Vec::with_capacity(tiers.len());
        let mut python = Vec::with_capacity(tiers.len());
        for (i, t) in tiers.iter().enumerate() {
            if let Ok(st) = t.cast::<StorageTier>() {
                boxed.push(Box::new(StorageTier::share(st)?));
                python.push(false);
            } else if let Ok((st, detector)) =
                t.extract::<(Bound<'_, StorageTier>, Bound<'_, PyAny>)>()
            {
                // A kvbm tier driven in Rust with the detector vLLM's factory gave its object.
                let bp = PyBackpressure {
                    detector: Some(detector.unbind()),
                    finished: HashMap::new(),
                    shared: shared.clone(),
                };
                boxed.push(Box::new(
                    StorageTier::share(&st)?.with_detector(Box::new(bp)),
                ));
                python.push(false);
            } else {
                boxed.push(Box::new(PyTier::new(&t, i, shared.clone())?));
                python.push(true);
            }
        }
        let fixes = if upstream {
            UpstreamFixes::upstream()
        } else {
            UpstreamFixes::default()
        };
        {
            let mut g = primary.core.lock(py)?;
            let Inner::Primary(_) = &*g else {
                return Err(PyTypeError::new_err(
                    "a tiering manager is built over a primary tier that no other tiering \
                     manager holds (CPUPrimaryTierOffloadingManager)",
                ));
            };
            let Inner::Primary(p) = std::mem::replace(&mut *g, Inner::Moved) else {
                unreachable!("checked above")
            };
            *g = Inner::Tiering(Box::new(
                kvbm_tiering::TieringOffloadingManager::with_primary(
                    *p,
                    boxed,
                    fixes,
                    record_lookup_latency,
                ),
            ));
        }
        Ok(Self {
            core: primary.core.clone(),
            shared,
            python,
        })
    }

    /// vLLM's `lookup(key, req_context, *, exclude_tier_idx=None)`, its argument names and
    /// all: the Python manager binds this method on the instance, where vLLM's caller reaches
    /// it directly.
    #[pyo3(signature = (key, req_context, *, exclude_tier_idx = None))]
    fn lookup(
        &self,
        key: &Bound<'_, PyAny>,
        req_context: &Bound<'_, PyAny>,
        exclude_tier_idx: Option<usize>,
    ) -> PyResult<Py<PyAny>> {
        let k = crate::bridge::key(key)?;
        let c = self.ctx(req_context)?;
        let r = self.run(key.py(), |m| {
            // Set under the lock, which the slot needs (`CallerSlot`).
            let _caller = self.shared.caller.set(key, &k, req_context, c.uid());
            Ok(match exclude_tier_idx {
                None => m.lookup(&k, &c),
                Some(i) => m.lookup_excluding(&k, &c, Some(i)),
            })
        })?;
        if r == LookupResult::HitPending {
            self.shared.contexts.promoting(key, &k);
        } else {
            self.shared.contexts.looked_up(key, &k, r);
        }
        Ok(self.shared.results.get(key.py(), r))
    }

    /// `lookup` as a function object bound to this manager whose positional calls skip pyo3's
    /// trampoline (`crate::entry`); the Python manager binds it in `lookup`'s place.
    fn lookup_entry<'py>(slf: &Bound<'py, Self>) -> PyResult<Bound<'py, PyAny>> {
        LOOKUP_ENTRY.bind(slf.as_any())
    }

    fn prepare_load<'py>(
        &self,
        keys_: &Bound<'py, PyAny>,
        ctx: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyBytes>> {
        let ks = self.shared.contexts.keys_after_lookups(keys_)?;
        let c = self.ctx(ctx)?;
        let spec = self.run(keys_.py(), |m| m.prepare_load(&ks, &c).map_err(to_py))?;
        Ok(chunk_ids(keys_.py(), spec.chunk_ids().unwrap_or_default()))
    }

    fn touch(&self, keys_: &Bound<'_, PyAny>, ctx: &Bound<'_, PyAny>) -> PyResult<()> {
        let ks = keys(keys_)?;
        let c = self.ctx(ctx)?;
        self.run(keys_.py(), |m| m.touch(&ks, &c).map_err(to_py))
    }

    /// vLLM's `complete_load(keys, req_context)` (its argument names: bound on the instance,
    /// as `lookup`).
    fn complete_load(
        &self,
        keys: &Bound<'_, PyAny>,
        req_context: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let ks = crate::bridge::keys(keys)?;
        let c = self.ctx(req_context)?;
        self.run(keys.py(), |m| m.complete_load(&ks, &c).map_err(to_py))
    }

    /// `None` when the store cannot be placed, else `(keys_to_store, chunk_ids, evicted_keys)`.
    fn prepare_store<'py>(
        &self,
        keys_: &Bound<'py, PyAny>,
        ctx: &Bound<'py, PyAny>,
    ) -> PyResult<Option<Bound<'py, PyTuple>>> {
        let py = keys_.py();
        let ks = self.shared.contexts.keys_after_lookups(keys_)?;
        let c = self.ctx(ctx)?;
        // A request-level tier's cascade of keys already stored carries the caller's objects.
        let _caller = CallerKeys::set(&ks);
        let out = self.run(py, |m| m.prepare_store(&ks, &c).map_err(to_py))?;
        out.map(|o| crate::cpu::store_output(py, &ks, &o))
            .transpose()
    }

    /// vLLM's `complete_store(keys, req_context, success=True)` (its argument names: bound on
    /// the instance, as `lookup`).
    #[pyo3(signature = (keys, req_context, success = true))]
    fn complete_store(
        &self,
        keys: &Bound<'_, PyAny>,
        req_context: &Bound<'_, PyAny>,
        success: bool,
    ) -> PyResult<()> {
        let ks = crate::bridge::keys(keys)?;
        let c = self.ctx(req_context)?;
        // The cascades' jobs carry the caller's key objects.
        let _caller = CallerKeys::set(&ks);
        self.run(keys.py(), |m| {
            m.complete_store(&ks, &c, success).map_err(to_py)
        })
    }

    /// vLLM's `create_store_job(keys, req_context, tier_idx)`: pins the chunks and registers a
    /// store job for tier `tier`; the job (vLLM's `TransferJob`) is the caller's to run.
    fn create_store_job<'py>(
        &self,
        keys_: &Bound<'py, PyAny>,
        ctx: &Bound<'py, PyAny>,
        tier: usize,
    ) -> PyResult<Bound<'py, PyAny>> {
        let py = keys_.py();
        let ks = keys(keys_)?;
        let c = self.ctx(ctx)?;
        self.run(py, |m| {
            if tier >= m.num_tiers() {
                return Err(PyValueError::new_err(format!(
                    "tier_idx {tier}: the manager has {} secondary tiers",
                    m.num_tiers()
                )));
            }
            let job = m.create_store_job(&ks, &c, tier).map_err(to_py)?;
            let _caller = CallerKeys::set(&ks);
            let pj = self.shared.job(py, &job)?;
            if self.python.get(tier).copied().unwrap_or(false) {
                self.shared
                    .py_jobs
                    .lock()
                    .insert(job.job_id, (tier, pj.clone().unbind()));
            }
            Ok(pj)
        })
    }

    /// `"chunk_level"` or `"request_level"`.
    #[pyo3(signature = (ctx, exclude = None))]
    fn on_new_request(
        &self,
        ctx: &Bound<'_, PyAny>,
        exclude: Option<usize>,
    ) -> PyResult<&'static str> {
        let c = self.ctx(ctx)?;
        let r = self.run(ctx.py(), |m| Ok(m.on_new_request_excluding(&c, exclude)))?;
        Ok(crate::bridge::scope_name(r.policy))
    }

    #[pyo3(signature = (ctx, exclude = None))]
    fn on_request_finished(&self, ctx: &Bound<'_, PyAny>, exclude: Option<usize>) -> PyResult<()> {
        let c = self.ctx(ctx)?;
        let r = self.run(ctx.py(), |m| {
            m.on_request_finished_excluding(&c, exclude).map_err(to_py)
        });
        self.shared.contexts.forget(ctx)?;
        r
    }

    /// `context`: vLLM's `ScheduleEndContext` (handed to Python tiers as it is).
    fn on_schedule_end(&self, context: &Bound<'_, PyAny>) -> PyResult<()> {
        let new_req_ids: Vec<String> = context
            .getattr("new_req_ids")?
            .try_iter()?
            .map(|r| r?.extract())
            .collect::<PyResult<_>>()?;
        let preempted_req_ids: Vec<String> = context
            .getattr("preempted_req_ids")?
            .try_iter()?
            .map(|r| r?.extract())
            .collect::<PyResult<_>>()?;
        let rust = ScheduleEndContext {
            new_req_ids,
            preempted_req_ids,
        };
        *self.shared.schedule_end.lock() = Some(context.clone().unbind());
        // The promotion jobs submitted here carry the key objects the lookups that started
        // them were handed (vLLM's do), picked in the order they were started.
        let promoted = self.shared.contexts.take_promoted();
        let _picking = promoted.as_ref().map(CallerKeys::in_order);
        let r = self.run(context.py(), |m| m.on_schedule_end(&rust).map_err(to_py));
        *self.shared.schedule_end.lock() = None;
        r
    }

    /// One tier-poll round over tiers `tiers` (vLLM's `poll_tiers`).
    fn poll_round(&self, py: Python<'_>, tiers: Vec<usize>) -> PyResult<()> {
        self.run(py, |m| {
            m.poll_round(&tiers);
            Ok(())
        })
    }

    fn has_pending_work(&self, py: Python<'_>) -> PyResult<bool> {
        self.run(py, |m| Ok(m.has_pending_work()))
    }

    fn reset_cache(&self, py: Python<'_>) -> PyResult<()> {
        self.run(py, |m| {
            let r = m.reset_cache().map_err(to_py);
            // Jobs the reset dropped unreported (kvbm's fix of vLLM #48102) are forgotten here
            // too, so the Python jobs map holds only jobs the manager still tracks.
            let live: std::collections::HashSet<JobId> =
                m.jobs().iter().map(|(_, j)| j.job_id).collect();
            self.shared.py_jobs.lock().retain(|id, _| live.contains(id));
            r
        })
    }

    fn on_reset_flushed(&self, py: Python<'_>) -> PyResult<()> {
        self.run(py, |m| {
            m.on_reset_flushed();
            Ok(())
        })
    }

    /// Where `key`'s hit loads from, as vLLM's `CacheHitSource` value.
    fn get_load_source(
        &self,
        key_: &Bound<'_, PyAny>,
        ctx: &Bound<'_, PyAny>,
    ) -> PyResult<&'static str> {
        let k = key(key_)?;
        let c = self.ctx(ctx)?;
        self.run(key_.py(), |m| {
            Ok(hit_source_name(m.get_load_source(&k, &c)))
        })
    }

    /// Events of tier `tier` (a kvbm tier's; Python tiers answer their own), as
    /// `(keys, removed, removal_expected, metadata_only, medium, locality)`.
    #[allow(clippy::type_complexity)]
    fn take_tier_events<'py>(
        &self,
        py: Python<'py>,
        tier: usize,
    ) -> PyResult<
        Vec<(
            Bound<'py, PyList>,
            bool,
            bool,
            bool,
            &'static str,
            Option<&'static str>,
            Option<Bound<'py, PyAny>>,
        )>,
    > {
        let events = self.run(py, |m| {
            Ok(m.tier_dyn_mut(tier)
                .map(|t| t.take_events())
                .unwrap_or_default())
        })?;
        events
            .into_iter()
            .map(|e| {
                Ok((
                    key_list(py, &e.keys)?,
                    e.removed,
                    e.removal_expected,
                    e.metadata_only,
                    e.medium.name(),
                    e.locality.map(|l| match l {
                        Locality::Local => "LOCAL",
                        Locality::Remote => "REMOTE",
                    }),
                    e.req_context
                        .as_ref()
                        .and_then(|c| crate::bridge::origin(py, c)),
                ))
            })
            .collect()
    }

    /// The manager's metrics since the last call (the primary's, the manager's own, kvbm
    /// tiers'; Python tiers' are the caller's to add), as [`CpuManager`]'s `stats`.
    fn stats(&self, py: Python<'_>) -> PyResult<Option<StatsTriple>> {
        self.run(py, |m| Ok(m.get_stats().map(triple)))
    }

    /// Stats labels: `0:primary`, then `<idx+1>:<tier_type>`.
    fn labels(&self, py: Python<'_>) -> PyResult<Vec<String>> {
        self.run(py, |m| Ok(m.labels().to_vec()))
    }

    /// Whether tier `i` is a Python tier.
    fn is_python_tier(&self, i: usize) -> bool {
        self.python.get(i).copied().unwrap_or(false)
    }

    /// Stops the tiers, then releases the primary; the first failure is raised after every
    /// tier had its attempt.
    fn shutdown(&self, py: Python<'_>) -> PyResult<()> {
        self.run(py, |m| m.shutdown().map_err(to_py))
    }

    // ---- read-only views of vLLM's private state (its tests inspect it) ----

    /// The once-per-step gate (`_processed_jobs_this_step`).
    #[getter]
    fn processed_this_step(&self, py: Python<'_>) -> PyResult<bool> {
        self.run(py, |m| Ok(m.processed_this_step()))
    }

    #[setter]
    fn set_processed_this_step(&self, py: Python<'_>, v: bool) -> PyResult<()> {
        self.run(py, |m| {
            m.set_processed_this_step(v);
            Ok(())
        })
    }

    #[getter]
    fn promotions_held(&self, py: Python<'_>) -> PyResult<bool> {
        self.run(py, |m| Ok(m.promotions_held()))
    }

    #[setter]
    fn set_promotions_held(&self, py: Python<'_>, v: bool) -> PyResult<()> {
        self.run(py, |m| {
            m.set_promotions_held(v);
            Ok(())
        })
    }

    /// Polls every tier's finished jobs now (vLLM's `_process_finished_jobs`).
    fn process_finished_jobs(&self, py: Python<'_>) -> PyResult<()> {
        self.run(py, |m| {
            m.poll_tiers();
            Ok(())
        })
    }

    /// `[(req_id, pending_primary_stores, is_finished, request_level_tiers, parked keys)]`.
    #[allow(clippy::type_complexity)]
    fn request_states<'py>(
        &self,
        py: Python<'py>,
    ) -> PyResult<Vec<(String, u32, bool, Vec<usize>, Bound<'py, PyList>)>> {
        let states = self.run(py, |m| {
            Ok(m.request_ids()
                .into_iter()
                .filter_map(|r| m.request_state(&r).map(|s| (r, s)))
                .collect::<Vec<_>>())
        })?;
        states
            .into_iter()
            .map(|(r, (pending, finished, tiers, parked))| {
                Ok((r, pending, finished, tiers, key_list(py, &parked)?))
            })
            .collect()
    }

    /// `[(job_id, tier, job)]`: a Python tier's jobs as the objects it was handed, a kvbm
    /// tier's as new `TransferJob` copies. Called from inside a call of this manager (a tier's
    /// method reading `_jobs`), it answers the Python tiers' jobs, which is all a tier can see.
    fn jobs<'py>(&self, py: Python<'py>) -> PyResult<Vec<(JobId, usize, Py<PyAny>)>> {
        if self.core.held_by_this_thread() {
            return Ok(self
                .shared
                .py_jobs
                .lock()
                .iter()
                .map(|(id, (tier, j))| (*id, *tier, j.clone_ref(py)))
                .collect());
        }
        self.run(py, |m| {
            let mut out = Vec::new();
            for (tier, job) in m.jobs() {
                let tracked = self
                    .shared
                    .py_jobs
                    .lock()
                    .get(&job.job_id)
                    .map(|(_, j)| j.clone_ref(py));
                let obj = match tracked {
                    Some(o) => o,
                    None => self.shared.job(py, &job)?.unbind(),
                };
                out.push((job.job_id, tier, obj));
            }
            Ok(out)
        })
    }

    /// `[(job_id, tier, chunk_ids)]` of failed promotions whose chunks await their tier's
    /// `deferred_release` (vLLM 0.34 `_deferred_releases`).
    fn deferred_releases(&self, py: Python<'_>) -> PyResult<Vec<(JobId, usize, Vec<u32>)>> {
        self.run(py, |m| Ok(m.deferred_releases()))
    }

    /// `[(tier, req_id, req_context, keys, chunk_ids)]` of promotions staged this step.
    #[allow(clippy::type_complexity)]
    fn pending_promotions<'py>(
        &self,
        py: Python<'py>,
    ) -> PyResult<
        Vec<(
            usize,
            String,
            Bound<'py, PyAny>,
            Bound<'py, PyList>,
            Vec<i32>,
        )>,
    > {
        let pending = self.run(py, |m| Ok(m.pending_promotions()))?;
        pending
            .into_iter()
            .map(|(tier, ctx, ks, ids)| {
                Ok((
                    tier,
                    ctx.req_id().to_string(),
                    self.shared.py_ctx(py, &ctx)?,
                    key_list(py, &ks)?,
                    ids,
                ))
            })
            .collect()
    }

    /// `[(req_id, [(key, CacheHitSource value)])]`.
    #[allow(clippy::type_complexity)]
    fn load_sources<'py>(
        &self,
        py: Python<'py>,
    ) -> PyResult<
        Vec<(
            String,
            Vec<(Bound<'py, pyo3::types::PyBytes>, &'static str)>,
        )>,
    > {
        let sources = self.run(py, |m| Ok(m.load_sources()))?;
        Ok(sources
            .into_iter()
            .map(|(r, ks)| {
                (
                    r,
                    ks.into_iter()
                        .map(|(k, s)| {
                            (
                                pyo3::types::PyBytes::new(py, k.as_bytes()),
                                hit_source_name(s),
                            )
                        })
                        .collect(),
                )
            })
            .collect())
    }
}
