//! `CpuManager`: kvbm-tiering's vLLM-exact CPU manager ([`CpuOffloadingManager`]) behind the
//! Python boundary.
//!
//! The Python class vLLM sees is `kvbm_vllm.upstream_compat.CPUOffloadingManager`, a subclass
//! of vLLM's own `OffloadingManager` ABC that forwards each call here and wraps the answers in
//! vLLM's objects (`PrepareStoreOutput`, `CPULoadStoreSpec`, `OffloadingEvent`, the stats
//! object). What must be vLLM's *identical* objects (the `LookupResult` members, compared with
//! `is`) are handed in at construction and returned as they are, so a lookup allocates nothing.
//!
//! ```text
//!  vLLM scheduler ─► CPUOffloadingManager (Python, vLLM's ABC) ─► CpuManager (this) ─► kvbm-tiering
//!                      builds vLLM's return objects                keys, contexts         slot table,
//!                                                                  (bridge)               LRU / ARC
//! ```
//!
//! Concurrency: vLLM calls a CPU manager from the scheduler thread only (its `lock` is a
//! no-op), but a primary tier is also reached from a tiering manager's poll thread: the state
//! sits in a [`Core`] (one mutex; a waiting caller releases the GIL), see [`crate::core`].

use std::sync::Arc;

use kvbm_tiering::{
    CachePolicyKind, Contract, CpuManagerConfig, CpuOffloadingManager, CpuPrimaryTier,
    LookupResult, OffloadKey,
};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList, PySet, PyTuple};

use crate::bridge::{Contexts, chunk_ids, key, key_list, keys, picked_keys, to_py};
use crate::core::{Core, Inner};

/// The four `LookupResult` members in kvbm-tiering's order (miss, hit, hit pending, retry).
pub(crate) struct LookupMembers([Py<PyAny>; 4]);

impl LookupMembers {
    pub(crate) fn from_tuple(t: &Bound<'_, PyTuple>) -> PyResult<Self> {
        if t.len() != 4 {
            return Err(PyValueError::new_err(
                "lookup_results: (LookupResult.MISS, HIT, HIT_PENDING, RETRY)",
            ));
        }
        Ok(Self([
            t.get_item(0)?.unbind(),
            t.get_item(1)?.unbind(),
            t.get_item(2)?.unbind(),
            t.get_item(3)?.unbind(),
        ]))
    }

    /// Which member `obj` is (by identity, as vLLM's callers compare).
    pub(crate) fn which(&self, obj: &Bound<'_, PyAny>) -> Option<LookupResult> {
        let p = obj.as_ptr();
        [
            LookupResult::Miss,
            LookupResult::Hit,
            LookupResult::HitPending,
            LookupResult::Retry,
        ]
        .into_iter()
        .zip(&self.0)
        .find_map(|(r, m)| (m.as_ptr() == p).then_some(r))
    }

    pub(crate) fn get(&self, py: Python<'_>, r: LookupResult) -> Py<PyAny> {
        let i = match r {
            LookupResult::Miss => 0,
            LookupResult::Hit => 1,
            LookupResult::HitPending => 2,
            LookupResult::Retry => 3,
        };
        self.0[i].clone_ref(py)
    }
}

/// kvbm-tiering's CPU manager for Python: see the [module docs](self).
///
/// The same class is a primary tier ([`CpuManager::primary`]): then the CPU manager lives in a
/// [`Core`] that a tiering manager built over it takes over, and this object keeps reaching it
/// there.
#[pyclass(module = "kvbm_vllm._kvbm", frozen)]
pub(crate) struct CpuManager {
    pub(crate) core: Arc<Core>,
    pub(crate) contexts: Arc<Contexts>,
    pub(crate) results: Arc<LookupMembers>,
}

/// kvbm-tiering's [`Contract`] of a vLLM release line named `"0.33"` or `"0.34"`
/// (`kvbm_vllm.contract.Contract.name`).
pub(crate) fn parse_contract(line: &str) -> PyResult<Contract> {
    line.split_once('.')
        .and_then(|(a, b)| Contract::of_line(a.parse().ok()?, b.parse().ok()?))
        .ok_or_else(|| {
            PyValueError::new_err(format!(
                "kvbm follows vLLM 0.33's and 0.34's offloading contracts; got {line:?}"
            ))
        })
}

fn parse_config(
    num_chunks: usize,
    policy: &str,
    enable_events: bool,
    store_threshold: u32,
    max_tracker_size: usize,
    contract: &str,
) -> PyResult<CpuManagerConfig> {
    let kind = match policy {
        "lru" => CachePolicyKind::Lru,
        "arc" => CachePolicyKind::Arc,
        other => {
            return Err(PyValueError::new_err(format!(
                "kvbm's CPU manager runs the lru and arc policies; got {other:?}"
            )));
        }
    };
    Ok(CpuManagerConfig::new(num_chunks)
        .policy(kind)
        .events(enable_events)
        .store_threshold(store_threshold, max_tracker_size)
        .contract(parse_contract(contract)?))
}

/// A `prepare_store` answer as `(keys_to_store, chunk_ids, evicted_keys)`.
pub(crate) fn store_output<'py>(
    py: Python<'py>,
    caller: &crate::bridge::Keys,
    out: &kvbm_tiering::PrepareStoreOutput,
) -> PyResult<Bound<'py, PyTuple>> {
    let ids = out.store_spec.chunk_ids().unwrap_or_default();
    PyTuple::new(
        py,
        [
            picked_keys(py, caller, &out.keys_to_store)?.into_any(),
            chunk_ids(py, ids).into_any(),
            key_list(py, &out.evicted_keys)?.into_any(),
        ],
    )
}

/// Events as `(keys, removed, removal_expected, metadata_only, req_context)`: the caller's own
/// `ReqContext` object of a stored event (vLLM 0.34), else `None`.
pub(crate) fn events_py<'py>(
    py: Python<'py>,
    events: Vec<kvbm_tiering::OffloadingEvent>,
) -> PyResult<Vec<Bound<'py, PyTuple>>> {
    events
        .into_iter()
        .map(|e| {
            let origin = e
                .req_context
                .as_ref()
                .and_then(|c| crate::bridge::origin(py, c))
                .unwrap_or_else(|| py.None().into_bound(py));
            PyTuple::new(
                py,
                [
                    key_list(py, &e.keys)?.into_any(),
                    e.removed.into_pyobject(py)?.to_owned().into_any(),
                    e.removal_expected.into_pyobject(py)?.to_owned().into_any(),
                    e.metadata_only.into_pyobject(py)?.to_owned().into_any(),
                    origin,
                ],
            )
        })
        .collect()
}

fn entry<'py>(
    m: &CpuOffloadingManager,
    py: Python<'py>,
    k: &OffloadKey,
) -> PyResult<Bound<'py, PyTuple>> {
    let (slot, refs) = m.chunk(k).unwrap_or((0, 0));
    PyTuple::new(
        py,
        [
            pyo3::types::PyBytes::new(py, k.as_bytes()).into_any(),
            slot.into_pyobject(py)?.into_any(),
            refs.into_pyobject(py)?.into_any(),
        ],
    )
}

crate::entry::two_argument_entry!(
    LOOKUP_ENTRY,
    CpuManager,
    c"lookup",
    c"lookup($self, key, req_context)\n--\n\nvLLM's lookup: HIT, MISS or HIT_PENDING.",
    |m: &CpuManager, key, ctx| m.lookup(key, ctx)
);

#[pymethods]
impl CpuManager {
    /// `policy` is `"lru"` or `"arc"`; `lookup_results` is vLLM's `(LookupResult.MISS, HIT,
    /// HIT_PENDING, RETRY)`; `contract` the vLLM line followed (`"0.33"` or `"0.34"`).
    #[new]
    #[pyo3(signature = (num_chunks, policy, enable_events, store_threshold, max_tracker_size, lookup_results, contract = "0.33"))]
    fn new(
        num_chunks: usize,
        policy: &str,
        enable_events: bool,
        store_threshold: u32,
        max_tracker_size: usize,
        lookup_results: &Bound<'_, PyTuple>,
        contract: &str,
    ) -> PyResult<Self> {
        let config = parse_config(
            num_chunks,
            policy,
            enable_events,
            store_threshold,
            max_tracker_size,
            contract,
        )?;
        Ok(Self {
            core: Arc::new(Core::new(Inner::Cpu(Box::new(CpuOffloadingManager::new(
                config,
            ))))),
            contexts: Arc::default(),
            results: Arc::new(LookupMembers::from_tuple(lookup_results)?),
        })
    }

    /// A primary tier (vLLM's `CPUPrimaryTierOffloadingManager`): the same manager, whose
    /// `chunk_bytes`-byte chunks are vLLM's region (moved by the tiers, never by this object).
    #[staticmethod]
    #[pyo3(signature = (num_chunks, chunk_bytes, policy, enable_events, lookup_results, contract = "0.33"))]
    fn primary(
        num_chunks: usize,
        chunk_bytes: usize,
        policy: &str,
        enable_events: bool,
        lookup_results: &Bound<'_, PyTuple>,
        contract: &str,
    ) -> PyResult<Self> {
        let config = parse_config(num_chunks, policy, enable_events, 1, 64_000, contract)?;
        Ok(Self {
            core: Arc::new(Core::new(Inner::Primary(Box::new(
                CpuPrimaryTier::without_memory(config, chunk_bytes),
            )))),
            contexts: Arc::default(),
            results: Arc::new(LookupMembers::from_tuple(lookup_results)?),
        })
    }

    /// Pins chunks for a primary → secondary copy without counting a request access
    /// (vLLM's `prepare_read`); the chunk ids, co-indexed with `keys`.
    fn prepare_read<'py>(
        &self,
        keys_: &Bound<'py, PyAny>,
        ctx: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyBytes>> {
        let ks = keys(keys_)?;
        let c = self.contexts.get(ctx)?;
        let mut g = self.core.lock(keys_.py())?;
        let spec = g.primary()?.prepare_read(&ks, &c).map_err(to_py)?;
        Ok(chunk_ids(keys_.py(), spec.chunk_ids().unwrap_or_default()))
    }

    /// Unpins chunks after a primary → secondary copy (vLLM's `complete_read`).
    fn complete_read(&self, keys_: &Bound<'_, PyAny>) -> PyResult<()> {
        let ks = keys(keys_)?;
        let mut g = self.core.lock(keys_.py())?;
        g.primary()?.complete_read(&ks).map_err(to_py)
    }

    /// vLLM's `lookup(key, req_context)`, its argument names: bound on the Python manager's
    /// instance (`upstream_compat._bind_direct`).
    fn lookup(
        &self,
        key: &Bound<'_, PyAny>,
        req_context: &Bound<'_, PyAny>,
    ) -> PyResult<Py<PyAny>> {
        let k = crate::bridge::key(key)?;
        let c = self.contexts.get(req_context)?;
        let r = self.core.lock(key.py())?.cpu()?.lookup(&k, &c);
        self.contexts.looked_up(key, &k, r);
        Ok(self.results.get(key.py(), r))
    }

    /// `lookup` as a function object bound to this manager whose positional calls skip pyo3's
    /// trampoline (`crate::entry`); the Python manager binds it in `lookup`'s place.
    fn lookup_entry<'py>(slf: &Bound<'py, Self>) -> PyResult<Bound<'py, PyAny>> {
        LOOKUP_ENTRY.bind(slf.as_any())
    }

    /// The chunk ids to read, co-indexed with `keys`.
    fn prepare_load<'py>(
        &self,
        keys_: &Bound<'py, PyAny>,
        ctx: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyBytes>> {
        let ks = self.contexts.keys_after_lookups(keys_)?;
        let c = self.contexts.get(ctx)?;
        let spec = self
            .core
            .lock(keys_.py())?
            .cpu()?
            .prepare_load(&ks, &c)
            .map_err(to_py)?;
        Ok(chunk_ids(keys_.py(), spec.chunk_ids().unwrap_or_default()))
    }

    fn touch(&self, keys_: &Bound<'_, PyAny>, ctx: &Bound<'_, PyAny>) -> PyResult<()> {
        let ks = keys(keys_)?;
        let c = self.contexts.get(ctx)?;
        self.core
            .lock(keys_.py())?
            .cpu()?
            .touch(&ks, &c)
            .map_err(to_py)
    }

    /// vLLM's `complete_load(keys, req_context)`, its argument names (bound as `lookup`).
    fn complete_load(
        &self,
        keys: &Bound<'_, PyAny>,
        req_context: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let ks = crate::bridge::keys(keys)?;
        let c = self.contexts.get(req_context)?;
        self.core
            .lock(keys.py())?
            .cpu()?
            .complete_load(&ks, &c)
            .map_err(to_py)
    }

    /// `None` when the store cannot be placed, else `(keys_to_store, chunk_ids, evicted_keys)`.
    fn prepare_store<'py>(
        &self,
        keys_: &Bound<'py, PyAny>,
        ctx: &Bound<'py, PyAny>,
    ) -> PyResult<Option<Bound<'py, PyTuple>>> {
        let py = keys_.py();
        let ks = self.contexts.keys_after_lookups(keys_)?;
        let c = self.contexts.get(ctx)?;
        let out = self
            .core
            .lock(py)?
            .cpu()?
            .prepare_store(&ks, &c)
            .map_err(to_py)?;
        out.map(|o| store_output(py, &ks, &o)).transpose()
    }

    /// vLLM's `complete_store(keys, req_context, success=True)`, its argument names (bound as
    /// `lookup`).
    #[pyo3(signature = (keys, req_context, success = true))]
    fn complete_store(
        &self,
        keys: &Bound<'_, PyAny>,
        req_context: &Bound<'_, PyAny>,
        success: bool,
    ) -> PyResult<()> {
        let ks = crate::bridge::keys(keys)?;
        let c = self.contexts.get(req_context)?;
        self.core
            .lock(keys.py())?
            .cpu()?
            .complete_store(&ks, &c, success)
            .map_err(to_py)
    }

    /// `"chunk_level"` or `"request_level"` (vLLM's `OffloadPolicy` values).
    fn on_new_request(&self, ctx: &Bound<'_, PyAny>) -> PyResult<&'static str> {
        let c = self.contexts.get(ctx)?;
        let r = self
            .core
            .lock(ctx.py())?
            .cpu()?
            .on_new_request(&c)
            .map_err(to_py)?;
        Ok(crate::bridge::scope_name(r.policy))
    }

    fn on_request_finished(&self, ctx: &Bound<'_, PyAny>) -> PyResult<()> {
        let c = self.contexts.get(ctx)?;
        let r = self
            .core
            .lock(ctx.py())?
            .cpu()?
            .on_request_finished(&c)
            .map_err(to_py);
        self.contexts.forget(ctx)?;
        r
    }

    /// Every event since the last call, as `(keys, removed, removal_expected, metadata_only,
    /// req_context)`: the caller's own `ReqContext` object of a stored event (vLLM 0.34),
    /// else `None`.
    fn take_events<'py>(&self, py: Python<'py>) -> PyResult<Vec<Bound<'py, PyTuple>>> {
        let events = self.core.lock(py)?.cpu()?.take_events();
        events_py(py, events)
    }

    fn reset_cache(&self, py: Python<'_>) -> PyResult<()> {
        self.core.lock(py)?.cpu()?.reset_cache().map_err(to_py)
    }

    /// vLLM's CPU manager never has work of its own in flight (its copies are the workers').
    fn has_pending_work(&self, py: Python<'_>) -> PyResult<bool> {
        self.core.lock(py)?.cpu()?;
        Ok(false)
    }

    /// Metrics since the last call: `(gauges, counters, histograms)`, each a list of
    /// `(name, label or None, value)` (a histogram's value is the list of its observations,
    /// `core::F64s`).
    fn stats(&self, py: Python<'_>) -> PyResult<crate::core::StatsTriple> {
        let s = self.core.lock(py)?.cpu()?.stats();
        Ok(crate::core::triple(s))
    }

    /// The store-threshold tracker's count of `key` (`None`: not tracked).
    fn tracker_count(&self, key_: &Bound<'_, PyAny>) -> PyResult<Option<u32>> {
        let k = key(key_)?;
        Ok(self.core.lock(key_.py())?.cpu_ref()?.tracker_count(&k))
    }

    /// Keys in the store-threshold tracker (`None`: no tracker, threshold below 2).
    fn tracker_len(&self, py: Python<'_>) -> PyResult<Option<usize>> {
        Ok(self.core.lock(py)?.cpu_ref()?.tracker_len())
    }

    /// vLLM's `stores_skipped_in_current_batch`.
    #[getter]
    fn stores_skipped(&self, py: Python<'_>) -> PyResult<u64> {
        Ok(self.core.lock(py)?.cpu_ref()?.stores_skipped())
    }

    /// Resident keys in eviction order, each `(key, chunk_id, ref_cnt)` (LRU: least recent
    /// first; ARC: T1 then T2). For the read-only policy view.
    fn entries<'py>(&self, py: Python<'py>) -> PyResult<Vec<Bound<'py, PyTuple>>> {
        let g = self.core.lock(py)?;
        let m = g.cpu_ref()?;
        m.eviction_order().iter().map(|k| entry(m, py, k)).collect()
    }

    /// `(key, chunk_id, ref_cnt)` of a resident key, else `None`.
    fn chunk<'py>(&self, key_: &Bound<'py, PyAny>) -> PyResult<Option<Bound<'py, PyTuple>>> {
        let k = key(key_)?;
        let g = self.core.lock(key_.py())?;
        let m = g.cpu_ref()?;
        match m.chunk(&k) {
            Some(_) => Ok(Some(entry(m, key_.py(), &k)?)),
            None => Ok(None),
        }
    }

    /// ARC's lists as `(t1, t2, b1, b2, target_t1_size)`: T1/T2 as `(key, chunk_id, ref_cnt)`
    /// in order, the ghost lists B1/B2 as keys; `None` under LRU. For the read-only view.
    #[allow(clippy::type_complexity)]
    fn arc_state<'py>(
        &self,
        py: Python<'py>,
    ) -> PyResult<
        Option<(
            Vec<Bound<'py, PyTuple>>,
            Vec<Bound<'py, PyTuple>>,
            Bound<'py, PyList>,
            Bound<'py, PyList>,
            f64,
        )>,
    > {
        let g = self.core.lock(py)?;
        let m = g.cpu_ref()?;
        let Some((t1, t2, b1, b2, target)) = m.arc_state() else {
            return Ok(None);
        };
        let entries = |ks: Vec<OffloadKey>| -> PyResult<Vec<Bound<'py, PyTuple>>> {
            ks.iter().map(|k| entry(m, py, k)).collect()
        };
        Ok(Some((
            entries(t1)?,
            entries(t2)?,
            key_list(py, &b1)?,
            key_list(py, &b2)?,
            target,
        )))
    }

    /// Sets ARC's `target_t1_size` (vLLM's tests set it on the policy); no-op under LRU.
    fn set_arc_target(&self, py: Python<'_>, target: f64) -> PyResult<()> {
        self.core.lock(py)?.cpu()?.set_arc_target(target);
        Ok(())
    }

    // --- The steps of a call, for the Python hooks (see kvbm_tiering's `cpu::manager::phases`).

    /// vLLM's `_num_evictable_cache_chunks`: resident chunks with `ref_cnt == 0`.
    #[getter]
    fn num_evictable(&self, py: Python<'_>) -> PyResult<usize> {
        Ok(self.core.lock(py)?.cpu_ref()?.num_evictable())
    }

    /// The policy's `evict(n, protected)`: `[(key, chunk_id)]` removed from the cache (their
    /// slots freed, no event), or `None` with nothing changed.
    #[allow(clippy::type_complexity)]
    fn evict<'py>(
        &self,
        n: usize,
        protected: &Bound<'py, PyAny>,
    ) -> PyResult<Option<Vec<(Bound<'py, PyBytes>, u32)>>> {
        let py = protected.py();
        let ps = keys(protected)?;
        let out = self.core.lock(py)?.cpu()?.evict_now(n, &ps);
        Ok(out.map(|v| {
            v.into_iter()
                .map(|(k, s)| (PyBytes::new(py, k.as_bytes()), s))
                .collect()
        }))
    }

    /// `prepare_store`'s first step: `(keys_to_store, ready_existing, recorded,
    /// new_store_misses)`.
    #[allow(clippy::type_complexity)]
    fn store_plan<'py>(
        &self,
        keys_: &Bound<'py, PyAny>,
        ctx: &Bound<'py, PyAny>,
    ) -> PyResult<(
        Bound<'py, PyList>,
        Bound<'py, PyList>,
        Bound<'py, PyList>,
        Bound<'py, PyList>,
    )> {
        let py = keys_.py();
        let ks = keys(keys_)?;
        let c = self.contexts.get(ctx)?;
        let plan = self.core.lock(py)?.cpu()?.store_plan(&ks, &c);
        Ok((
            key_list(py, &plan.keys_to_store)?,
            key_list(py, &plan.ready_existing)?,
            key_list(py, &plan.recorded)?,
            key_list(py, &plan.new_store_misses)?,
        ))
    }

    /// The policy's own `on_store_miss(keys)`.
    fn policy_store_miss(&self, keys_: &Bound<'_, PyAny>) -> PyResult<()> {
        let ks = keys(keys_)?;
        self.core.lock(keys_.py())?.cpu()?.policy_store_miss(&ks);
        Ok(())
    }

    /// Notes store misses as reported for the request.
    fn mark_store_misses(&self, keys_: &Bound<'_, PyAny>, ctx: &Bound<'_, PyAny>) -> PyResult<()> {
        let ks = keys(keys_)?;
        let c = self.contexts.get(ctx)?;
        self.core
            .lock(keys_.py())?
            .cpu()?
            .mark_store_misses(&ks, &c);
        Ok(())
    }

    /// vLLM's `_record_request_cache_access(keys, req_context, inserted_keys, reused_keys)`.
    fn record_access(
        &self,
        keys_: &Bound<'_, PyAny>,
        ctx: &Bound<'_, PyAny>,
        inserted: &Bound<'_, PyAny>,
        reused: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let (ks, ins, re) = (keys(keys_)?, keys(inserted)?, keys(reused)?);
        let c = self.contexts.get(ctx)?;
        self.core
            .lock(keys_.py())?
            .cpu()?
            .record_request_access(&ks, &c, &ins, &re);
        Ok(())
    }

    /// Records an allocation size for the histogram.
    fn record_allocation(&self, py: Python<'_>, n: usize) -> PyResult<()> {
        self.core.lock(py)?.cpu()?.record_allocation(n);
        Ok(())
    }

    /// vLLM 0.34's `defer_write_release`: the held chunk ids (a `ContractError`, an
    /// `AssertionError`, naming a key that is not a pending write).
    fn defer_write_release(&self, keys_: &Bound<'_, PyAny>) -> PyResult<Vec<u32>> {
        let ks = keys(keys_)?;
        self.core
            .lock(keys_.py())?
            .cpu()?
            .defer_write_release(&ks)
            .map_err(to_py)
    }

    /// vLLM 0.34's `release_deferred_write`.
    fn release_deferred_write(&self, py: Python<'_>, chunk_ids: Vec<u32>) -> PyResult<()> {
        self.core
            .lock(py)?
            .cpu()?
            .release_deferred_write(&chunk_ids)
            .map_err(to_py)
    }

    /// Chunks held by deferred releases.
    #[getter]
    fn num_deferred_release_chunks(&self, py: Python<'_>) -> PyResult<usize> {
        Ok(self.core.lock(py)?.cpu_ref()?.num_deferred_release_chunks())
    }

    /// Slots free without eviction.
    fn num_free(&self, py: Python<'_>) -> PyResult<usize> {
        Ok(self.core.lock(py)?.cpu_ref()?.num_free_slots())
    }

    /// Records the removal event of evicted keys.
    fn record_eviction_event(&self, keys_: &Bound<'_, PyAny>) -> PyResult<()> {
        let ks = keys(keys_)?;
        self.core
            .lock(keys_.py())?
            .cpu()?
            .record_eviction_event(ks.to_vec());
        Ok(())
    }

    /// vLLM's `_allocate_chunks`: `n` chunk ids.
    fn allocate_slots(&self, py: Python<'_>, n: usize) -> PyResult<Vec<u32>> {
        self.core.lock(py)?.cpu()?.allocate_slots(n).map_err(to_py)
    }

    /// `prepare_store`'s last step: `keys` enter the cache in `slots`.
    fn insert_allocated(
        &self,
        keys_: &Bound<'_, PyAny>,
        slots: Vec<u32>,
        ctx: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let ks = keys(keys_)?;
        let c = self.contexts.get(ctx)?;
        self.core
            .lock(keys_.py())?
            .cpu()?
            .insert_allocated(&ks, &slots, &c)
            .map_err(to_py)
    }

    /// `prepare_load` without recording the request's access; the chunk ids.
    fn pin_for_load<'py>(
        &self,
        keys_: &Bound<'py, PyAny>,
        ctx: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyBytes>> {
        let ks = keys(keys_)?;
        let c = self.contexts.get(ctx)?;
        let ids = self
            .core
            .lock(keys_.py())?
            .cpu()?
            .pin_for_load(&ks, &c)
            .map_err(to_py)?;
        Ok(chunk_ids(keys_.py(), &ids))
    }

    /// `on_request_finished`'s first step: `(key_groups, insertion_only_keys, reused_keys)` as
    /// vLLM hands them to the policy (a tuple of tuples, two sets), or `None`. The context is
    /// kept (see [`CpuManager::forget`]).
    #[allow(clippy::type_complexity)]
    fn finish_request<'py>(
        &self,
        ctx: &Bound<'py, PyAny>,
    ) -> PyResult<Option<(Bound<'py, PyTuple>, Bound<'py, PySet>, Bound<'py, PySet>)>> {
        let py = ctx.py();
        let c = self.contexts.get(ctx)?;
        let Some(f) = self.core.lock(py)?.cpu()?.finish_request_access(&c) else {
            return Ok(None);
        };
        let groups = f
            .key_groups
            .iter()
            .map(|g| PyTuple::new(py, g.iter().map(|k| PyBytes::new(py, k.as_bytes()))))
            .collect::<PyResult<Vec<_>>>()?;
        let set =
            |ks: &[OffloadKey]| PySet::new(py, ks.iter().map(|k| PyBytes::new(py, k.as_bytes())));
        Ok(Some((
            PyTuple::new(py, groups)?,
            set(&f.insertion_only)?,
            set(&f.reused)?,
        )))
    }

    /// Forgets a finished request's context.
    fn forget(&self, ctx: &Bound<'_, PyAny>) -> PyResult<()> {
        self.contexts.forget(ctx)
    }

    /// The policy's own `on_request_finished(key_groups, insertion_only_keys, reused_keys,
    /// req_context)`.
    fn policy_request_finished(
        &self,
        key_groups: &Bound<'_, PyAny>,
        insertion_only: &Bound<'_, PyAny>,
        reused: &Bound<'_, PyAny>,
        ctx: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let groups = key_groups
            .try_iter()?
            .map(|g| keys(&g?).map(|k| k.to_vec()))
            .collect::<PyResult<Vec<_>>>()?;
        let ins: hashbrown::HashSet<OffloadKey> = keys(insertion_only)?.iter().copied().collect();
        let re: hashbrown::HashSet<OffloadKey> = keys(reused)?.iter().copied().collect();
        let c = self.contexts.get(ctx)?;
        self.core
            .lock(ctx.py())?
            .cpu()?
            .policy_request_finished(&groups, &ins, &re, &c);
        Ok(())
    }

    /// Slots in use (neither free nor evictable), pending writes, capacity: the usage facts.
    fn usage(&self, py: Python<'_>) -> PyResult<(usize, usize, usize)> {
        let g = self.core.lock(py)?;
        let m = g.cpu_ref()?;
        let used = m.num_allocated() - m.free_list().len() - m.num_evictable();
        Ok((used, m.num_write_pending(), m.num_chunks()))
    }

    /// The primary's free slots, in allocation order, and slots ever allocated (vLLM's
    /// `_free_list` and `_num_allocated_chunks`, for read-only views).
    fn slots(&self, py: Python<'_>) -> PyResult<(Vec<u32>, usize)> {
        let g = self.core.lock(py)?;
        let m = g.cpu_ref()?;
        Ok((m.free_list().to_vec(), m.num_allocated()))
    }
}
