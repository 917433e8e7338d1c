//! [`Core`]: the one Rust manager behind a CPU manager, a primary tier and the tiering manager
//! built over that primary, shared by their Python objects, and the lock that guards it.
//!
//! vLLM builds a `CPUPrimaryTierOffloadingManager`, hands it to a `TieringOffloadingManager`,
//! and then keeps calling both: the scheduler calls the tiering manager, vLLM's tests also call
//! the primary directly (`count_hits(manager.primary_tier, …)`). In kvbm the primary's state
//! moves into kvbm-tiering's `TieringOffloadingManager` when the tiering manager is built
//! ([`Inner::Primary`] → [`Inner::Tiering`]), and the primary's Python object reaches it there
//! through the same [`Core`]: one state, never two copies to keep in step.
//!
//! # Locking
//!
//! vLLM's tiering manager is entered from two threads (the scheduler's and the tier-poll
//! thread), and its tiers are Python objects that run while a call is in progress. The
//! state sits behind one mutex ([`Core::lock`]):
//!
//! * A caller that finds it taken waits **with the GIL released**: the holder may be running
//!   Python (a tier's method) and needs the GIL to finish.
//! * A call made from inside a call on the same thread (a tier's Python code calling the
//!   manager back other than through its `ParentManager`) would deadlock; it is refused with a
//!   `RuntimeError` naming it instead.
//!
//! vLLM's Python `lock` (a `threading.Lock` the connector and the poll thread take around
//! whole operations) is kept as well, above this one: lock order is Python lock, then this
//! mutex. The request-context map takes no lock: the GIL guards it, and it is borrowed only
//! where no Python code runs (`bridge::Contexts`).

use std::sync::atomic::{AtomicU64, Ordering};

use kvbm_tiering::{CpuOffloadingManager, CpuPrimaryTier, TieringOffloadingManager};
use parking_lot::{Mutex, MutexGuard};
use pyo3::exceptions::{PyRuntimeError, PyTypeError};
use pyo3::prelude::*;
use pyo3::types::{PyFloat, PyList};

/// What a [`Core`] holds.
pub(crate) enum Inner {
    /// A CPU manager on its own (vLLM's `CPUOffloadingManager`).
    Cpu(Box<CpuOffloadingManager>),
    /// A primary tier over vLLM's region, not yet under a tiering manager.
    Primary(Box<CpuPrimaryTier>),
    /// A tiering manager, the primary inside it.
    Tiering(Box<TieringOffloadingManager>),
    /// Between moves (only seen if building a tiering manager failed half-way).
    Moved,
}

impl Inner {
    /// The CPU manager, wherever it lives.
    pub(crate) fn cpu(&mut self) -> PyResult<&mut CpuOffloadingManager> {
        match self {
            Inner::Cpu(m) => Ok(m),
            Inner::Primary(p) => Ok(p.manager_mut()),
            Inner::Tiering(t) => Ok(t.primary_mut().manager_mut()),
            Inner::Moved => Err(moved()),
        }
    }

    /// The CPU manager, read-only.
    pub(crate) fn cpu_ref(&self) -> PyResult<&CpuOffloadingManager> {
        match self {
            Inner::Cpu(m) => Ok(m),
            Inner::Primary(p) => Ok(p.manager()),
            Inner::Tiering(t) => Ok(t.primary().manager()),
            Inner::Moved => Err(moved()),
        }
    }

    /// The primary tier (a primary, or the one inside a tiering manager).
    pub(crate) fn primary(&mut self) -> PyResult<&mut CpuPrimaryTier> {
        match self {
            Inner::Primary(p) => Ok(p),
            Inner::Tiering(t) => Ok(t.primary_mut()),
            Inner::Cpu(_) => Err(PyTypeError::new_err(
                "a CPUOffloadingManager has no primary region: build a \
                 CPUPrimaryTierOffloadingManager (with mmap_region) for a tiering manager",
            )),
            Inner::Moved => Err(moved()),
        }
    }

    /// The tiering manager.
    pub(crate) fn tiering(&mut self) -> PyResult<&mut TieringOffloadingManager> {
        match self {
            Inner::Tiering(t) => Ok(t),
            _ => Err(PyRuntimeError::new_err(
                "no tiering manager is built over this primary tier",
            )),
        }
    }
}

/// Metrics as `(gauges, counters, histograms)`, each `(name, label or None, value)` (a
/// histogram's value is its observations, as [`F64s`]).
pub(crate) type StatsTriple = (
    Vec<(&'static str, Option<String>, f64)>,
    Vec<(&'static str, Option<String>, f64)>,
    Vec<(&'static str, Option<String>, F64s)>,
);

/// A histogram's observations, handed to Python as a `list` of `float`s in which equal values
/// are one object.
///
/// vLLM observes every lookup's latency (16384 values a step in the bench), and the values
/// repeat: each is a whole number of nanoseconds, most within a few hundred of each other. A
/// `float` per distinct value, each placed in the list as often as it was observed, makes the
/// same list for every reader (a `float` is immutable, and equal values compare equal) for a
/// fraction of the allocations, and of the frees when the stats are dropped.
pub(crate) struct F64s(pub(crate) Vec<f64>);

impl<'py> IntoPyObject<'py> for F64s {
    type Target = PyList;
    type Output = Bound<'py, PyList>;
    type Error = PyErr;

    fn into_pyobject(self, py: Python<'py>) -> PyResult<Self::Output> {
        // The objects made so far: a direct-mapped table in front of a map (a few dozen to a
        // few hundred distinct values a step is usual: the bench's cold step observes about
        // 50 at the primary and 180 at a Python tier, 16384 times each).
        let mut recent: [Option<(u64, Bound<'py, PyFloat>)>; 1024] = std::array::from_fn(|_| None);
        let mut made: hashbrown::HashMap<u64, Bound<'py, PyFloat>> = hashbrown::HashMap::new();
        PyList::new(
            py,
            self.0.iter().map(|&v| {
                let bits = v.to_bits();
                let slot = &mut recent[(bits.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 54) as usize];
                if let Some((b, f)) = slot
                    && *b == bits
                {
                    return f.clone();
                }
                let f = made
                    .entry(bits)
                    .or_insert_with(|| PyFloat::new(py, v))
                    .clone();
                *slot = Some((bits, f.clone()));
                f
            }),
        )
    }
}

/// kvbm-tiering's stats as a [`StatsTriple`].
pub(crate) fn triple(s: kvbm_tiering::OffloadingConnectorStats) -> StatsTriple {
    (
        s.gauges.into_iter().map(|((n, l), v)| (n, l, v)).collect(),
        s.counters
            .into_iter()
            .map(|((n, l), v)| (n, l, v))
            .collect(),
        s.histograms
            .into_iter()
            .map(|((n, l), v)| (n, l, F64s(v)))
            .collect(),
    )
}

fn moved() -> PyErr {
    PyRuntimeError::new_err(
        "the kvbm manager's state was lost when building a tiering manager failed",
    )
}

/// This thread's identity for [`Core`]'s re-entrancy check: its `pthread_t` (unique among
/// live threads, and a thread holding the lock is live), read without the `__tls_get_addr`
/// call a thread-local costs an extension module on every manager call.
fn this_thread() -> u64 {
    // SAFETY: `pthread_self` has no preconditions and cannot fail.
    let t = unsafe { libc::pthread_self() } as u64;
    // 0 means "no holder" in `Core::owner`. glibc's `pthread_t` is the address of the
    // thread's descriptor, never 0; `max` keeps that true on any other libc.
    t.max(1)
}

/// One manager's state and its lock: see the [module docs](self).
pub(crate) struct Core {
    inner: Mutex<Inner>,
    /// The thread holding `inner` (0: none), for the re-entrancy check.
    owner: AtomicU64,
}

/// The held lock; clears the owner when dropped.
pub(crate) struct CoreGuard<'a> {
    guard: MutexGuard<'a, Inner>,
    owner: &'a AtomicU64,
}

impl std::ops::Deref for CoreGuard<'_> {
    type Target = Inner;
    fn deref(&self) -> &Inner {
        &self.guard
    }
}

impl std::ops::DerefMut for CoreGuard<'_> {
    fn deref_mut(&mut self) -> &mut Inner {
        &mut self.guard
    }
}

impl Drop for CoreGuard<'_> {
    fn drop(&mut self) {
        self.owner.store(0, Ordering::Release);
    }
}

impl Core {
    pub(crate) fn new(inner: Inner) -> Self {
        Self {
            inner: Mutex::new(inner),
            owner: AtomicU64::new(0),
        }
    }

    /// Whether this thread holds the lock (a call made from inside one of the manager's calls).
    pub(crate) fn held_by_this_thread(&self) -> bool {
        self.owner.load(Ordering::Acquire) == this_thread()
    }

    /// Takes the lock: at once when free; else, unless this thread holds it (refused), waits
    /// with the GIL released.
    pub(crate) fn lock(&self, py: Python<'_>) -> PyResult<CoreGuard<'_>> {
        let me = this_thread();
        loop {
            if let Some(guard) = self.inner.try_lock() {
                self.owner.store(me, Ordering::Release);
                return Ok(CoreGuard {
                    guard,
                    owner: &self.owner,
                });
            }
            if self.owner.load(Ordering::Acquire) == me {
                return Err(PyRuntimeError::new_err(
                    "re-entrant call into a kvbm manager from inside one of its calls (a tier \
                     may call the manager back only through the ParentManager it is handed)",
                ));
            }
            // Wait for the holder without the GIL (it may need it to finish), then race for the
            // lock again with it.
            py.detach(|| drop(self.inner.lock()));
        }
    }
}
