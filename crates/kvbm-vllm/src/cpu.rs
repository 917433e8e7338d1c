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
//! no-op); the class is `Sync` for PyO3, every method takes `&mut self` through PyO3's borrow
//! check, so a second thread calling at the same time gets a `RuntimeError` (already borrowed),
//! never a data race.

use kvbm_tiering::{
    CachePolicyKind, CpuManagerConfig, CpuOffloadingManager, LookupResult, OffloadKey,
    OffloadScope, OffloadingManager,
};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyList, PyTuple};

use crate::bridge::{Contexts, key, key_list, keys, to_py};

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
#[pyclass(module = "kvbm_vllm._kvbm")]
pub(crate) struct CpuManager {
    inner: CpuOffloadingManager,
    contexts: Contexts,
    results: LookupMembers,
}

impl CpuManager {
    fn entry<'py>(&self, py: Python<'py>, k: &OffloadKey) -> PyResult<Bound<'py, PyTuple>> {
        let (slot, refs) = self.inner.chunk(k).unwrap_or((0, 0));
        PyTuple::new(
            py,
            [
                pyo3::types::PyBytes::new(py, k.as_bytes()).into_any(),
                slot.into_pyobject(py)?.into_any(),
                refs.into_pyobject(py)?.into_any(),
            ],
        )
    }
}

#[pymethods]
impl CpuManager {
    /// `policy` is `"lru"` or `"arc"`; `lookup_results` is vLLM's `(LookupResult.MISS, HIT,
    /// HIT_PENDING, RETRY)`.
    #[new]
    #[pyo3(signature = (num_chunks, policy, enable_events, store_threshold, max_tracker_size, lookup_results))]
    fn new(
        num_chunks: usize,
        policy: &str,
        enable_events: bool,
        store_threshold: u32,
        max_tracker_size: usize,
        lookup_results: &Bound<'_, PyTuple>,
    ) -> PyResult<Self> {
        let kind = match policy {
            "lru" => CachePolicyKind::Lru,
            "arc" => CachePolicyKind::Arc,
            other => {
                return Err(PyValueError::new_err(format!(
                    "kvbm's CPU manager runs the lru and arc policies; got {other:?}"
                )));
            }
        };
        let config = CpuManagerConfig::new(num_chunks)
            .policy(kind)
            .events(enable_events)
            .store_threshold(store_threshold, max_tracker_size);
        Ok(Self {
            inner: CpuOffloadingManager::new(config),
            contexts: Contexts::default(),
            results: LookupMembers::from_tuple(lookup_results)?,
        })
    }

    fn lookup(&mut self, key_: &Bound<'_, PyAny>, ctx: &Bound<'_, PyAny>) -> PyResult<Py<PyAny>> {
        let k = key(key_)?;
        let c = self.contexts.get(ctx)?;
        let r = self.inner.lookup(&k, &c);
        Ok(self.results.get(key_.py(), r))
    }

    /// The chunk ids to read, co-indexed with `keys`.
    fn prepare_load(
        &mut self,
        keys_: &Bound<'_, PyAny>,
        ctx: &Bound<'_, PyAny>,
    ) -> PyResult<Vec<i32>> {
        let ks = keys(keys_)?;
        let c = self.contexts.get(ctx)?;
        let spec = self.inner.prepare_load(&ks, &c).map_err(to_py)?;
        Ok(spec.chunk_ids().unwrap_or_default().to_vec())
    }

    fn touch(&mut self, keys_: &Bound<'_, PyAny>, ctx: &Bound<'_, PyAny>) -> PyResult<()> {
        let ks = keys(keys_)?;
        let c = self.contexts.get(ctx)?;
        self.inner.touch(&ks, &c).map_err(to_py)
    }

    fn complete_load(&mut self, keys_: &Bound<'_, PyAny>, ctx: &Bound<'_, PyAny>) -> PyResult<()> {
        let ks = keys(keys_)?;
        let c = self.contexts.get(ctx)?;
        self.inner.complete_load(&ks, &c).map_err(to_py)
    }

    /// `None` when the store cannot be placed, else `(keys_to_store, chunk_ids, evicted_keys)`.
    fn prepare_store<'py>(
        &mut self,
        keys_: &Bound<'py, PyAny>,
        ctx: &Bound<'py, PyAny>,
    ) -> PyResult<Option<Bound<'py, PyTuple>>> {
        let py = keys_.py();
        let ks = keys(keys_)?;
        let c = self.contexts.get(ctx)?;
        let Some(out) = self.inner.prepare_store(&ks, &c).map_err(to_py)? else {
            return Ok(None);
        };
        let ids = out.store_spec.chunk_ids().unwrap_or_default().to_vec();
        Ok(Some(PyTuple::new(
            py,
            [
                key_list(py, &out.keys_to_store)?.into_any(),
                PyList::new(py, ids)?.into_any(),
                key_list(py, &out.evicted_keys)?.into_any(),
            ],
        )?))
    }

    #[pyo3(signature = (keys_, ctx, success = true))]
    fn complete_store(
        &mut self,
        keys_: &Bound<'_, PyAny>,
        ctx: &Bound<'_, PyAny>,
        success: bool,
    ) -> PyResult<()> {
        let ks = keys(keys_)?;
        let c = self.contexts.get(ctx)?;
        self.inner.complete_store(&ks, &c, success).map_err(to_py)
    }

    /// `"chunk_level"` or `"request_level"` (vLLM's `OffloadPolicy` values).
    fn on_new_request(&mut self, ctx: &Bound<'_, PyAny>) -> PyResult<&'static str> {
        let c = self.contexts.get(ctx)?;
        let r = self.inner.on_new_request(&c).map_err(to_py)?;
        Ok(match r.policy {
            OffloadScope::ChunkLevel => "chunk_level",
            OffloadScope::RequestLevel => "request_level",
        })
    }

    fn on_request_finished(&mut self, ctx: &Bound<'_, PyAny>) -> PyResult<()> {
        let c = self.contexts.get(ctx)?;
        let r = self.inner.on_request_finished(&c).map_err(to_py);
        self.contexts.forget(ctx);
        r
    }

    /// Every event since the last call, as `(keys, removed, removal_expected, metadata_only)`.
    fn take_events<'py>(&mut self, py: Python<'py>) -> PyResult<Vec<Bound<'py, PyTuple>>> {
        self.inner
            .take_events()
            .into_iter()
            .map(|e| {
                PyTuple::new(
                    py,
                    [
                        key_list(py, &e.keys)?.into_any(),
                        e.removed.into_pyobject(py)?.to_owned().into_any(),
                        e.removal_expected.into_pyobject(py)?.to_owned().into_any(),
                        e.metadata_only.into_pyobject(py)?.to_owned().into_any(),
                    ],
                )
            })
            .collect()
    }

    fn reset_cache(&mut self) -> PyResult<()> {
        self.inner.reset_cache().map_err(to_py)
    }

    fn has_pending_work(&self) -> bool {
        self.inner.has_pending_work()
    }

    /// Metrics since the last call: `(gauges, counters, histograms)`, each a list of
    /// `(name, label or None, value)` (a histogram's value is its list of observations).
    #[allow(clippy::type_complexity)]
    fn stats(
        &mut self,
    ) -> (
        Vec<(&'static str, Option<String>, f64)>,
        Vec<(&'static str, Option<String>, f64)>,
        Vec<(&'static str, Option<String>, Vec<f64>)>,
    ) {
        let s = self.inner.stats();
        (
            s.gauges.into_iter().map(|((n, l), v)| (n, l, v)).collect(),
            s.counters
                .into_iter()
                .map(|((n, l), v)| (n, l, v))
                .collect(),
            s.histograms
                .into_iter()
                .map(|((n, l), v)| (n, l, v))
                .collect(),
        )
    }

    /// The store-threshold tracker's count of `key` (`None`: not tracked).
    fn tracker_count(&self, key_: &Bound<'_, PyAny>) -> PyResult<Option<u32>> {
        Ok(self.inner.tracker_count(&key(key_)?))
    }

    /// Keys in the store-threshold tracker (`None`: no tracker, threshold below 2).
    fn tracker_len(&self) -> Option<usize> {
        self.inner.tracker_len()
    }

    /// vLLM's `stores_skipped_in_current_batch`.
    #[getter]
    fn stores_skipped(&self) -> u64 {
        self.inner.stores_skipped()
    }

    /// Resident keys in eviction order, each `(key, chunk_id, ref_cnt)` (LRU: least recent
    /// first; ARC: T1 then T2). For the read-only policy view.
    fn entries<'py>(&self, py: Python<'py>) -> PyResult<Vec<Bound<'py, PyTuple>>> {
        self.inner
            .eviction_order()
            .iter()
            .map(|k| self.entry(py, k))
            .collect()
    }

    /// `(key, chunk_id, ref_cnt)` of a resident key, else `None`.
    fn chunk<'py>(&self, key_: &Bound<'py, PyAny>) -> PyResult<Option<Bound<'py, PyTuple>>> {
        let k = key(key_)?;
        match self.inner.chunk(&k) {
            Some(_) => Ok(Some(self.entry(key_.py(), &k)?)),
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
        let Some((t1, t2, b1, b2, target)) = self.inner.arc_state() else {
            return Ok(None);
        };
        let entries = |ks: Vec<OffloadKey>| -> PyResult<Vec<Bound<'py, PyTuple>>> {
            ks.iter().map(|k| self.entry(py, k)).collect()
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
    fn set_arc_target(&mut self, target: f64) {
        self.inner.set_arc_target(target);
    }

    /// Slots in use (neither free nor evictable), pending writes, capacity: the usage facts.
    fn usage(&self) -> (usize, usize, usize) {
        let used =
            self.inner.num_allocated() - self.inner.free_list().len() - self.inner.num_evictable();
        (
            used,
            self.inner.num_write_pending(),
            self.inner.num_chunks(),
        )
    }
}
