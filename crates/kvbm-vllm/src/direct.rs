//! `DirectManager` and `DirectWorker`: kvbm-tiering's direct disk path (vLLM 0.34's device ↔
//! file offloading, [`kvbm_tiering::direct`]) behind the Python boundary, for
//! `kvbm_vllm.direct.KvbmDiskDirectSpec`.
//!
//! ```text
//!  vLLM scheduler ─► KvbmDiskDirectManager (Python, vLLM's ABC) ─► DirectManager ─┐
//!  vLLM worker    ─► KvbmDiskDirectWorker  (Python, vLLM's ABC) ─► DirectWorker  ─┴► one DirectDisk
//!                     DevicePointers as lists of ints                                (by path)
//! ```
//!
//! Memory: a worker is built with the address ranges of the KV cache vLLM registered (host
//! tensors: the Python side refuses device tensors), and refuses any page outside them before
//! anything is queued. That is what upholds [`DirectDiskWorker::submit_store`]'s contract: the
//! pages are host memory vLLM keeps alive (the tensors outlive the worker) and reserves for the
//! job until it is reported finished.
//!
//! Locks: each object's one mutex, taken for a call and never across Python code; the two
//! never together.

use std::sync::{Arc, Mutex, MutexGuard};

use kvbm_tiering::{
    CachePolicyKind, CpuManagerConfig, DevicePointers, DirectDisk, DirectDiskConfig,
    DirectDiskManager, DirectDiskWorker,
};
use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList, PyTuple};

use crate::bridge::{Contexts, key, key_list, keys, picked_keys, to_py};
use crate::cpu::{LookupMembers, parse_contract};
use crate::tiers::{disk_config, fingerprint_of};

/// Where and how the direct disk is opened, as the Python spec hands it over:
/// `(path, capacity, chunk_bytes, fingerprint, queue_depth, direct_io, buffer_pool_bytes)`.
#[derive(FromPyObject)]
pub(crate) struct DiskArgs<'py>(
    std::path::PathBuf,
    usize,
    usize,
    Bound<'py, PyDict>,
    u32,
    bool,
    usize,
);

/// The direct disk `args` name, shared by this process's manager and worker.
fn disk(args: DiskArgs<'_>) -> PyResult<Arc<DirectDisk>> {
    let DiskArgs(path, capacity, chunk_bytes, fingerprint, queue_depth, direct_io, pool) = args;
    let fingerprint = fingerprint_of(&fingerprint, chunk_bytes)?;
    DirectDisk::shared(DirectDiskConfig {
        disk: disk_config(&path, queue_depth, direct_io, pool)?,
        capacity,
        chunk_bytes,
        fingerprint: Some(fingerprint),
    })
    .map_err(|e| {
        PyRuntimeError::new_err(format!(
            "cannot open the kvbm direct disk at {}: {e}",
            path.display()
        ))
    })
}

fn locked<T>(m: &Mutex<T>) -> PyResult<MutexGuard<'_, T>> {
    m.lock()
        .map_err(|_| PyRuntimeError::new_err("kvbm direct disk: a call panicked earlier"))
}

/// What opening the disk found, for the start line: `(restored, reset reason or None,
/// O_DIRECT, io engine name)`.
type Opened = (usize, Option<String>, bool, &'static str);

fn opened(d: &DirectDisk) -> Opened {
    let caps = d.capabilities();
    (
        d.opened().restored,
        d.opened().reset.clone(),
        caps.direct_io,
        match caps.engine {
            kvbm_physical::IoEngineKind::Uring => "io_uring",
            _ => "preadv/pwritev",
        },
    )
}

/// The scheduler half (module docs).
#[pyclass(module = "kvbm_vllm._kvbm", frozen)]
pub(crate) struct DirectManager {
    inner: Mutex<DirectDiskManager>,
    contexts: Contexts,
    results: LookupMembers,
}

#[pymethods]
impl DirectManager {
    /// `disk`: [`DiskArgs`]; `policy` `"lru"` or `"arc"`; `lookup_results` vLLM's `(MISS, HIT,
    /// HIT_PENDING, RETRY)`.
    #[new]
    #[pyo3(signature = (disk, policy, enable_events, lookup_results, contract = "0.34"))]
    fn new(
        disk: DiskArgs<'_>,
        policy: &str,
        enable_events: bool,
        lookup_results: &Bound<'_, PyTuple>,
        contract: &str,
    ) -> PyResult<Self> {
        let kind = CachePolicyKind::parse(policy).ok_or_else(|| {
            PyValueError::new_err(format!(
                "eviction_policy: kvbm's direct disk runs lru and arc; got {policy:?}"
            ))
        })?;
        let capacity = disk.1;
        let d = self::disk(disk)?;
        let config = CpuManagerConfig::new(capacity)
            .policy(kind)
            .events(enable_events)
            .contract(parse_contract(contract)?);
        Ok(Self {
            inner: Mutex::new(DirectDiskManager::new(d, config).map_err(to_py)?),
            contexts: Contexts::default(),
            results: LookupMembers::from_tuple(lookup_results)?,
        })
    }

    /// `(restored, reset reason or None, O_DIRECT, io engine)`.
    fn opened(&self) -> PyResult<Opened> {
        Ok(opened(locked(&self.inner)?.disk()))
    }

    fn lookup(&self, key_: &Bound<'_, PyAny>, ctx: &Bound<'_, PyAny>) -> PyResult<Py<PyAny>> {
        let k = key(key_)?;
        let c = self.contexts.get(ctx)?;
        let r = locked(&self.inner)?.lookup(&k, &c);
        Ok(self.results.get(key_.py(), r))
    }

    /// The keys' slots, co-indexed.
    fn prepare_load(&self, keys_: &Bound<'_, PyAny>, ctx: &Bound<'_, PyAny>) -> PyResult<Vec<u32>> {
        let ks = keys(keys_)?;
        let c = self.contexts.get(ctx)?;
        locked(&self.inner)?.prepare_load(&ks, &c).map_err(to_py)
    }

    fn complete_load(&self, keys_: &Bound<'_, PyAny>, ctx: &Bound<'_, PyAny>) -> PyResult<()> {
        let ks = keys(keys_)?;
        let c = self.contexts.get(ctx)?;
        locked(&self.inner)?.complete_load(&ks, &c).map_err(to_py)
    }

    /// `None` when there is no room, else `(keys_to_store, slots, evicted_keys)`.
    fn prepare_store<'py>(
        &self,
        keys_: &Bound<'py, PyAny>,
        ctx: &Bound<'py, PyAny>,
    ) -> PyResult<Option<Bound<'py, PyTuple>>> {
        let py = keys_.py();
        let ks = keys(keys_)?;
        let c = self.contexts.get(ctx)?;
        let out = locked(&self.inner)?.prepare_store(&ks, &c).map_err(to_py)?;
        out.map(|(o, slots)| {
            PyTuple::new(
                py,
                [
                    picked_keys(py, &ks, &o.keys_to_store)?.into_any(),
                    PyList::new(py, slots)?.into_any(),
                    key_list(py, &o.evicted_keys)?.into_any(),
                ],
            )
        })
        .transpose()
    }

    #[pyo3(signature = (keys_, ctx, success = true))]
    fn complete_store(
        &self,
        keys_: &Bound<'_, PyAny>,
        ctx: &Bound<'_, PyAny>,
        success: bool,
    ) -> PyResult<()> {
        let ks = keys(keys_)?;
        let c = self.contexts.get(ctx)?;
        locked(&self.inner)?
            .complete_store(&ks, &c, success)
            .map_err(to_py)
    }

    fn on_new_request(&self, ctx: &Bound<'_, PyAny>) -> PyResult<&'static str> {
        let c = self.contexts.get(ctx)?;
        let r = locked(&self.inner)?.on_new_request(&c).map_err(to_py)?;
        Ok(crate::bridge::scope_name(r.policy))
    }

    fn on_request_finished(&self, ctx: &Bound<'_, PyAny>) -> PyResult<()> {
        let c = self.contexts.get(ctx)?;
        let r = locked(&self.inner)?.on_request_finished(&c).map_err(to_py);
        self.contexts.forget(ctx)?;
        r
    }

    /// Every event since the last call, as `(keys, removed, removal_expected, metadata_only,
    /// req_context)` (the caller's own `ReqContext` of a stored event under 0.34, else None).
    fn take_events<'py>(&self, py: Python<'py>) -> PyResult<Vec<Bound<'py, PyTuple>>> {
        let events = locked(&self.inner)?.take_events();
        crate::cpu::events_py(py, events)
    }

    fn has_pending_work(&self) -> PyResult<bool> {
        Ok(locked(&self.inner)?.has_pending_work())
    }

    fn reset_cache(&self) -> PyResult<()> {
        locked(&self.inner)?.reset_cache().map_err(to_py)
    }

    /// `(resident, restored not yet adopted, listed in the journal, write pending)`.
    fn usage(&self) -> PyResult<(usize, usize, usize, usize)> {
        let m = locked(&self.inner)?;
        Ok((
            m.slots().len(),
            m.num_restored(),
            m.disk().listed(),
            m.slots().num_write_pending(),
        ))
    }

    /// The slot of `key` and its reference count (−1: being written), if resident.
    fn chunk(&self, key_: &Bound<'_, PyAny>) -> PyResult<Option<(u32, i32)>> {
        let k = key(key_)?;
        Ok(locked(&self.inner)?.slots().chunk(&k))
    }

    fn shutdown(&self) -> PyResult<()> {
        locked(&self.inner)?.shutdown().map_err(to_py)
    }
}

/// A settled job: `(job_id, success, bytes, seconds)`.
type Finished = (u64, bool, Option<u64>, Option<f64>);

/// The worker half (module docs).
#[pyclass(module = "kvbm_vllm._kvbm", frozen)]
pub(crate) struct DirectWorker {
    inner: Mutex<DirectDiskWorker>,
    /// The KV cache's host address ranges `[start, end)`, sorted: every page must lie in one.
    memory: Vec<(u64, u64)>,
}

impl DirectWorker {
    fn pointers(
        &self,
        ptrs: Vec<u64>,
        sizes: Vec<u64>,
        shape: (Vec<usize>, Vec<usize>, Vec<usize>),
    ) -> PyResult<DevicePointers> {
        if ptrs.len() != sizes.len() {
            return Err(PyValueError::new_err(format!(
                "DevicePointers: {} pointers, {} sizes",
                ptrs.len(),
                sizes.len()
            )));
        }
        for (&p, &n) in ptrs.iter().zip(&sizes) {
            let end = p.checked_add(n);
            let i = self.memory.partition_point(|&(s, _)| s <= p);
            let inside = i > 0 && end.is_some_and(|e| e <= self.memory[i - 1].1);
            if !inside {
                return Err(PyValueError::new_err(format!(
                    "DevicePointers: a page at {p:#x} of {n} bytes is outside the KV cache this \
                     worker was given"
                )));
            }
        }
        Ok(DevicePointers {
            ptrs,
            sizes,
            group_block_counts: shape.0,
            group_data_ref_counts: shape.1,
            block_indices: shape.2,
        })
    }
}

#[pymethods]
impl DirectWorker {
    /// `disk`: [`DiskArgs`]; `memory`: the `(address, bytes)` of every KV cache tensor (host
    /// memory) the pages may lie in.
    #[new]
    fn new(disk: DiskArgs<'_>, blocks_per_chunk: usize, memory: Vec<(u64, u64)>) -> PyResult<Self> {
        let d = self::disk(disk)?;
        let mut ranges: Vec<(u64, u64)> = memory
            .into_iter()
            .map(|(p, n)| {
                p.checked_add(n)
                    .map(|e| (p, e))
                    .ok_or_else(|| PyValueError::new_err(format!("memory: {p:#x} + {n} overflows")))
            })
            .collect::<PyResult<_>>()?;
        ranges.sort_unstable();
        if ranges.windows(2).any(|w| w[0].1 > w[1].0) {
            return Err(PyValueError::new_err(
                "memory: two KV cache tensors overlap",
            ));
        }
        Ok(Self {
            inner: Mutex::new(DirectDiskWorker::new(d, blocks_per_chunk).map_err(to_py)?),
            memory: ranges,
        })
    }

    /// `(restored, reset reason or None, O_DIRECT, io engine)`.
    fn opened(&self) -> PyResult<Opened> {
        Ok(opened(locked(&self.inner)?.disk()))
    }

    /// vLLM's `submit_store` with its `DevicePointers` as lists and the spec's keys and slots.
    #[allow(clippy::too_many_arguments)]
    fn submit_store(
        &self,
        job_id: u64,
        ptrs: Vec<u64>,
        sizes: Vec<u64>,
        group_block_counts: Vec<usize>,
        group_data_ref_counts: Vec<usize>,
        block_indices: Vec<usize>,
        keys_: &Bound<'_, PyAny>,
        slots: Vec<u32>,
    ) -> PyResult<()> {
        let ks = keys(keys_)?;
        let p = self.pointers(
            ptrs,
            sizes,
            (group_block_counts, group_data_ref_counts, block_indices),
        )?;
        // SAFETY: every page lies in the KV cache tensors this worker was given (checked just
        // above), host memory vLLM keeps alive and reserves for the job until it is reported.
        unsafe { locked(&self.inner)?.submit_store(job_id, &p, &ks, &slots) }.map_err(to_py)
    }

    /// vLLM's `submit_load` (as `submit_store`).
    #[pyo3(signature = (job_id, keys_, slots, ptrs, sizes, group_block_counts, group_data_ref_counts, block_indices, expedited = false))]
    #[allow(clippy::too_many_arguments)]
    fn submit_load(
        &self,
        job_id: u64,
        keys_: &Bound<'_, PyAny>,
        slots: Vec<u32>,
        ptrs: Vec<u64>,
        sizes: Vec<u64>,
        group_block_counts: Vec<usize>,
        group_data_ref_counts: Vec<usize>,
        block_indices: Vec<usize>,
        expedited: bool,
    ) -> PyResult<()> {
        let ks = keys(keys_)?;
        let p = self.pointers(
            ptrs,
            sizes,
            (group_block_counts, group_data_ref_counts, block_indices),
        )?;
        // SAFETY: as in submit_store; vLLM reserves a load's blocks for it until reported.
        unsafe { locked(&self.inner)?.submit_load(job_id, &ks, &slots, &p, expedited) }
            .map_err(to_py)
    }

    /// `(job_id, success, bytes, seconds)` of each job settled since the last call.
    fn get_finished(&self) -> PyResult<Vec<Finished>> {
        Ok(locked(&self.inner)?
            .get_finished()
            .into_iter()
            .map(|r| (r.job_id, r.success, r.transfer_size, r.transfer_time))
            .collect())
    }

    /// Blocks (the GIL released) until the given jobs settled.
    fn wait(&self, py: Python<'_>, job_ids: Vec<u64>) -> PyResult<()> {
        let guard = locked(&self.inner)?;
        let w: &DirectDiskWorker = &guard;
        py.detach(|| w.wait(&job_ids));
        Ok(())
    }

    fn shutdown(&self, py: Python<'_>) -> PyResult<()> {
        let mut guard = locked(&self.inner)?;
        let w: &mut DirectDiskWorker = &mut guard;
        py.detach(|| w.shutdown()).map_err(to_py)
    }
}
