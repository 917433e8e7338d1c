//! What crosses the Python boundary: keys, request contexts and errors.
//!
//! # Why a context map
//!
//! vLLM's scheduler hands every manager call its own `ReqContext` object and compares them by
//! identity; kvbm-tiering's managers do the same with their Rust [`ReqContext`] (`uid`). So one
//! Python context must map to one Rust context for as long as the request lives: the map is keyed
//! by the Python object's address and holds a strong reference to it, so the address cannot be
//! reused while the entry exists. The entry goes at `on_request_finished` (and `reset_cache`
//! keeps it: vLLM's contexts outlive a reset).
//!
//! Key positions (`ReqContext.set_offload_key_position`) live in the Python object's
//! `_offload_key_positions` dict; whenever that dict grew since the last call, the new keys'
//! positions are read through the context's own `get_offload_key_position` (a subclass may
//! override it) and copied into the Rust context (one length check per call otherwise).
//!
//! # The caller's key objects, handed back
//!
//! vLLM hands its tiers, and returns to its caller, the very key objects it was handed
//! (`keys_to_store`, a cascade's and a promotion's job keys): a Python tier's set then finds
//! them by identity, without hashing. kvbm's Rust keys are values, so each call keeps the
//! objects it converted ([`Keys`], strong references) and picks from them by key
//! ([`picked_keys`]) while it is in progress ([`CallerKeys`]). A promotion is started by one
//! lookup and submitted by a later `on_schedule_end`, so a tiering manager logs the object of
//! each lookup that answered `HIT_PENDING` ([`Contexts::promoting`]) and `on_schedule_end`
//! picks each job's keys from that log in the order the lookups started them
//! ([`CallerKeys::in_order`]). A key not found where it is looked for is a new `bytes` of the
//! same value: the answer stays right, only slower.
//!
//! # Errors
//!
//! A kvbm-tiering contract error (complete without prepare, unknown request, a key that is not
//! a hit handed to `prepare_load`) is vLLM's `assert` failing: it is raised as
//! [`ContractError`], a subclass of `AssertionError` whose message names the call and the key
//! or request. A key that is not vLLM's `OffloadKey` shape (bytes, 4 to 39 long) is a
//! `TypeError`/`ValueError` naming it.

use std::cell::RefCell;
use std::rc::Rc;
use std::sync::Arc;

use kvbm_tiering::{
    Locality, LookupResult, Medium, OffloadKey, ReqContext, TierFilter, TierMatcher, TieringError,
};
use pyo3::exceptions::{PyAssertionError, PyRuntimeError, PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyByteArray, PyBytes, PyDict, PyList};
use pyo3::{create_exception, intern};

create_exception!(
    _kvbm,
    ContractError,
    PyAssertionError,
    "A call broke vLLM's OffloadingManager contract (vLLM asserts the same)."
);

/// A kvbm-tiering error as the Python exception vLLM's caller expects.
pub(crate) fn to_py(e: TieringError) -> PyErr {
    ContractError::new_err(e.to_string())
}

/// One `OffloadKey` (Python `bytes`).
pub(crate) fn key(obj: &Bound<'_, PyAny>) -> PyResult<OffloadKey> {
    let mut data: *mut std::os::raw::c_char = std::ptr::null_mut();
    let mut len: pyo3::ffi::Py_ssize_t = 0;
    // One call that checks the type and reads the buffer (a key is read per lookup; the
    // stable ABI makes `PyBytes_Check`, `PyBytes_AsString` and `PyBytes_Size` a call each).
    // SAFETY: `obj` is a live object (GIL held); on success `data` points at `len` bytes the
    // object owns and never changes (`bytes` is immutable), read before this frame ends.
    let raw = unsafe {
        if pyo3::ffi::PyBytes_AsStringAndSize(obj.as_ptr(), &mut data, &mut len) != 0 {
            None
        } else {
            Some(std::slice::from_raw_parts(data as *const u8, len as usize))
        }
    };
    let Some(raw) = raw else {
        // Not bytes: the TypeError it set is replaced by one naming what a key is.
        drop(PyErr::take(obj.py()));
        return Err(PyTypeError::new_err(format!(
            "an OffloadKey is bytes (make_offload_key), got {}",
            obj.get_type()
                .name()
                .map(|n| n.to_string())
                .unwrap_or_default()
        )));
    };
    OffloadKey::from_bytes(raw).map_err(|e| PyValueError::new_err(e.to_string()))
}

/// The keys of a caller's collection and the very objects they were read from (strong
/// references: an object is never freed, nor its address reused, while this is alive).
///
/// Derefs to the keys. The objects let a call hand the caller's own key objects back (vLLM's
/// `keys_to_store`, a cascade job's keys) by matching keys in Rust ([`picked_keys`]), without
/// reading a Python object again.
pub(crate) struct Keys {
    keys: Vec<OffloadKey>,
    objs: Vec<Py<PyAny>>,
}

impl std::ops::Deref for Keys {
    type Target = [OffloadKey];
    fn deref(&self) -> &[OffloadKey] {
        &self.keys
    }
}

/// Every key of a collection (list, tuple, set, any iterable), in its order, with its object.
///
/// A list or tuple holding the very objects of the last one converted on this thread is
/// answered from [`LAST_KEYS`] without reading a key object: vLLM hands `complete_load` the
/// keys it handed `prepare_load`, and `complete_store` the `keys_to_store` that
/// `prepare_store` returned (the caller's own objects), and each key object read is a likely
/// cache miss in a step over thousands of keys.
pub(crate) fn keys(obj: &Bound<'_, PyAny>) -> PyResult<Rc<Keys>> {
    keys_with(obj, &mut Vec::new())
}

/// [`keys`], where a key object found in `looked_up` (in its order: see
/// [`Contexts::keys_after_lookups`]) is taken with the key it was read as, not read again.
fn keys_with(obj: &Bound<'_, PyAny>, looked_up: &mut LookedUp) -> PyResult<Rc<Keys>> {
    // Lists and tuples (what vLLM's scheduler passes) by index, without an iterator object.
    if let Ok(list) = obj.cast::<PyList>() {
        // SAFETY: `i < len` of a list the GIL keeps unchanged for this call (converting a key
        // runs no Python code); `PyList_GetItem` returns a borrowed reference, live while the
        // list holds it.
        return remembered(obj.py(), list.len(), looked_up, |i| unsafe {
            pyo3::ffi::PyList_GetItem(obj.as_ptr(), i as pyo3::ffi::Py_ssize_t)
        });
    }
    if let Ok(tuple) = obj.cast::<pyo3::types::PyTuple>() {
        // SAFETY: as for a list (a tuple is immutable).
        return remembered(obj.py(), tuple.len(), looked_up, |i| unsafe {
            pyo3::ffi::PyTuple_GetItem(obj.as_ptr(), i as pyo3::ffi::Py_ssize_t)
        });
    }
    let n = obj.len().unwrap_or(0);
    let mut out = Keys {
        keys: Vec::with_capacity(n),
        objs: Vec::with_capacity(n),
    };
    for k in obj.try_iter()? {
        let k = k?;
        out.keys.push(key(&k)?);
        out.objs.push(k.unbind());
    }
    Ok(Rc::new(out))
}

thread_local! {
    /// The last list or tuple of keys converted on this thread (see [`keys`]).
    static LAST_KEYS: std::cell::RefCell<Option<Rc<Keys>>> = const { std::cell::RefCell::new(None) };
}

/// The keys of the `len` borrowed objects `item(0..len)`: from [`LAST_KEYS`] when they are
/// its objects in its order, else converted (and remembered), each object found in
/// `looked_up` taken from there instead (see [`Contexts::keys_after_lookups`]).
fn remembered(
    py: Python<'_>,
    len: usize,
    looked_up: &mut LookedUp,
    item: impl Fn(usize) -> *mut pyo3::ffi::PyObject,
) -> PyResult<Rc<Keys>> {
    let hit = LAST_KEYS.with_borrow(|last| {
        last.as_ref()
            .filter(|l| l.objs.len() == len && (0..len).all(|i| item(i) == l.objs[i].as_ptr()))
            .cloned()
    });
    if let Some(keys) = hit {
        return Ok(keys);
    }
    let mut fresh = Keys {
        keys: Vec::with_capacity(len),
        objs: Vec::with_capacity(len),
    };
    // The next entry of `looked_up` to compare; a few entries are skipped at most per key
    // (lookups whose keys the caller left out), so the walk stays linear.
    let mut next = 0;
    for i in 0..len {
        let p = item(i);
        let found = looked_up
            .iter_mut()
            .enumerate()
            .skip(next)
            .take(LOOKED_UP_SKIP + 1)
            .find(|(_, (o, _))| o.as_ref().is_some_and(|o| o.as_ptr() == p));
        if let Some((j, (o, k))) = found {
            next = j + 1;
            fresh.keys.push(*k);
            fresh.objs.push(o.take().expect("matched a present object"));
            continue;
        }
        // SAFETY: `item` hands a live borrowed reference (see the callers).
        let obj = unsafe { Bound::from_borrowed_ptr(py, p) };
        fresh.keys.push(key(&obj)?);
        fresh.objs.push(obj.unbind());
    }
    let fresh = Rc::new(fresh);
    // The objects remembered before are released after the borrow ends (dropping one may run
    // Python code, which may convert keys again).
    drop(LAST_KEYS.replace(Some(fresh.clone())));
    Ok(fresh)
}

/// What [`CallerKey`] keeps: the key object, the context object, the Rust context's uid and
/// the key the object was read as.
type Caller = (
    *mut pyo3::ffi::PyObject,
    *mut pyo3::ffi::PyObject,
    u64,
    *const OffloadKey,
);

/// A manager's record of the key and context objects of its lookup in progress, the Rust
/// context's uid, and the key (see [`CallerKey`]).
///
/// # Guarded by the manager's lock
///
/// Set and read only by the thread holding the manager's [`Core`](crate::core::Core) lock:
/// set inside a locked call, read by that call's tier calls (and a tier's calls back through
/// its `ParentManager`, which only the lending thread may make). A per-manager cell rather
/// than a thread-local: a thread-local costs a `__tls_get_addr` call per access from an
/// extension module, and a lookup made four.
#[derive(Default)]
pub(crate) struct CallerSlot(std::cell::Cell<Option<Caller>>);

// SAFETY: only the thread holding the manager's lock touches the cell (see the type's docs),
// so no two threads reach it at once.
unsafe impl Sync for CallerSlot {}
// SAFETY: the pointers are dereferenced only by the thread whose guard set them, while that
// guard lives (it restores the cell before the locked call ends); sending the slot to another
// thread dereferences nothing.
unsafe impl Send for CallerSlot {}

impl CallerSlot {
    /// While the guard is alive, makes `key` and `ctx` (the Python objects a manager call was
    /// handed; `ctx` is the Python side of the Rust context `uid`; `key` was read as `k`) the
    /// ones [`key`](Self::key) and [`ctx`](Self::ctx) hand back: vLLM passes its tiers the
    /// caller's own key object (a Python tier's set then finds it by identity: no hashing, no
    /// compare), and a tier call needs no context-map probe. The guard borrows `k` (kept by
    /// address, not copied, per lookup). Called with the manager's lock held.
    pub(crate) fn set<'a>(
        &'a self,
        key: &Bound<'_, PyAny>,
        k: &'a OffloadKey,
        ctx: &Bound<'_, PyAny>,
        uid: u64,
    ) -> CallerKey<'a> {
        CallerKey {
            slot: self,
            prev: self.0.replace(Some((key.as_ptr(), ctx.as_ptr(), uid, k))),
            _k: std::marker::PhantomData,
        }
    }

    /// `k` as a Python `bytes`: the caller's own object when it was read as `k` (compared in
    /// Rust, the object is not read again), else a new one.
    pub(crate) fn key<'py>(&self, py: Python<'py>, k: &OffloadKey) -> Bound<'py, PyAny> {
        if let Some((p, _, _, read)) = self.0.get()
            // SAFETY: a `CallerKey` guard set `read` (with `p`) from a key it borrows for its
            // whole life, on this thread; a dropped guard restores what was set before it.
            && unsafe { *read == *k }
        {
            // SAFETY: the guard set `p` from a reference the call it guards holds for the
            // guard's whole life, on this thread (the GIL is held: `py`).
            return unsafe { Bound::from_borrowed_ptr(py, p) };
        }
        PyBytes::new(py, k.as_bytes()).into_any()
    }

    /// Whether a lookup is in progress. When it is, the thread asking is attached to the
    /// interpreter (may take its `Python` token with `Python::assume_attached`): only the
    /// holder of the manager's lock reads the slot (the type's docs), and a set slot means that
    /// thread is inside the manager call from Python that set it (CPython returns from a
    /// tier's Python code with the thread attached). Saves a tier call from a manager lookup
    /// pyo3's attach, a thread-local read and write each way.
    pub(crate) fn in_lookup(&self) -> bool {
        self.0.get().is_some()
    }

    /// The Python context of the Rust context `uid` when it is the caller's.
    pub(crate) fn ctx<'py>(&self, py: Python<'py>, uid: u64) -> Option<Bound<'py, PyAny>> {
        let (_, p, _, _) = self.0.get().filter(|c| c.2 == uid)?;
        // SAFETY: as in `key`.
        Some(unsafe { Bound::from_borrowed_ptr(py, p) })
    }
}

/// See [`CallerSlot::set`]; restores what was set before it when dropped.
pub(crate) struct CallerKey<'a> {
    slot: &'a CallerSlot,
    prev: Option<Caller>,
    _k: std::marker::PhantomData<&'a OffloadKey>,
}

impl Drop for CallerKey<'_> {
    fn drop(&mut self) {
        self.slot.0.set(self.prev);
    }
}

unsafe extern "C" {
    /// CPython's `PyObject_VectorcallMethod` (`Objects/call.c`): exported by every CPython
    /// since 3.9 and part of the stable ABI since 3.12. pyo3 declares it for abi3 builds only
    /// from 3.12; this wheel's oldest interpreter, 3.11, exports it too (`nm -D
    /// libpython3.11.so`), so it is declared here.
    pub(crate) fn PyObject_VectorcallMethod(
        name: *mut pyo3::ffi::PyObject,
        args: *const *mut pyo3::ffi::PyObject,
        nargsf: usize,
        kwnames: *mut pyo3::ffi::PyObject,
    ) -> *mut pyo3::ffi::PyObject;
}

/// `args[0].name(*args[1..])`: the method is looked up on the object at each call, as
/// Python's own `obj.name(...)` does (an attribute set on the instance or its class is seen),
/// and called without a bound-method object or an argument tuple. A Python tier's `lookup` is
/// called once per key the primary misses, where the varargs call it replaces
/// (`PyObject_CallMethodObjArgs`) first collected its arguments into an array: about 150
/// instructions a call.
pub(crate) fn vectorcall_method<'py>(
    py: Python<'py>,
    name: &Bound<'py, pyo3::types::PyString>,
    args: &[&Bound<'py, PyAny>],
) -> PyResult<Bound<'py, PyAny>> {
    const MAX: usize = 4;
    assert!(
        !args.is_empty() && args.len() <= MAX,
        "self and at most three arguments"
    );
    let mut raw = [std::ptr::null_mut(); MAX];
    for (r, a) in raw.iter_mut().zip(args) {
        *r = a.as_ptr();
    }
    // SAFETY: every pointer is a live object the caller borrows for this call (GIL held:
    // `py`); `nargsf` is the count of `raw`'s leading entries set, without
    // `PY_VECTORCALL_ARGUMENTS_OFFSET` (so the callee writes nothing before `raw[0]`); the
    // result is a new reference or NULL with an exception set, which `from_owned_ptr_or_err`
    // takes.
    unsafe {
        Bound::from_owned_ptr_or_err(
            py,
            PyObject_VectorcallMethod(
                name.as_ptr(),
                raw.as_ptr(),
                args.len(),
                std::ptr::null_mut(),
            ),
        )
    }
}

/// Chunk ids as the bytes of a native-order `int32` array: the Python side views them with
/// `numpy.frombuffer` and vLLM's spec copies that view (`np.array(ids, dtype=np.int32)`), the
/// same array as from a list, without a Python `int` per id.
pub(crate) fn chunk_ids<'py>(py: Python<'py>, ids: &[i32]) -> Bound<'py, PyBytes> {
    let mut raw = Vec::with_capacity(std::mem::size_of_val(ids));
    for id in ids {
        raw.extend_from_slice(&id.to_ne_bytes());
    }
    PyBytes::new(py, &raw)
}

/// A job's chunk ids as a `bytearray` of native-endian `i32`s: `np.frombuffer` over it is the
/// job's writable `int32` array, as vLLM's own job arrays are (`upstream_compat._make_job`: one
/// numpy call, where copying a read-only view of [`chunk_ids`]' bytes took two).
pub(crate) fn job_chunk_ids<'py>(py: Python<'py>, ids: &[i32]) -> Bound<'py, PyByteArray> {
    let mut raw = Vec::with_capacity(std::mem::size_of_val(ids));
    for id in ids {
        raw.extend_from_slice(&id.to_ne_bytes());
    }
    PyByteArray::new(py, &raw)
}

/// The keys `out` picked from the caller's keys `caller` (same order, a subsequence: vLLM's
/// `keys_to_store`, a cascade's keys) as a Python list of the caller's own key objects, as
/// vLLM's manager hands them on. Keys are matched in Rust; a key not found in order is a new
/// `bytes` of the same value, and the search gives up (new `bytes` for the rest) after a few
/// comparisons per key, so it stays linear whatever the caller passed.
pub(crate) fn picked_keys<'py>(
    py: Python<'py>,
    caller: &Keys,
    out: &[OffloadKey],
) -> PyResult<Bound<'py, PyList>> {
    // Every key picked (a cold store, a whole request's cascade): the objects as they are.
    if out == caller.keys.as_slice() {
        return PyList::new(py, caller.objs.iter().map(|o| o.bind(py)));
    }
    let mut budget = 4 * (caller.keys.len() + out.len());
    let mut next = 0;
    let mut objs = Vec::with_capacity(out.len());
    for k in out {
        let mut found = None;
        let mut i = next;
        while i < caller.keys.len() && budget > 0 {
            budget -= 1;
            if caller.keys[i] == *k {
                found = Some(i);
                break;
            }
            i += 1;
        }
        match found {
            Some(at) => {
                next = at + 1;
                objs.push(caller.objs[at].bind(py).clone());
            }
            None => objs.push(PyBytes::new(py, k.as_bytes()).into_any()),
        }
    }
    PyList::new(py, objs)
}

/// What [`job_keys`] picks from on this thread: the caller's keys, and where picking is in
/// order across jobs (see [`CallerKeys::in_order`]), the place the last job's keys ended.
type Picking = Option<(Rc<Keys>, Option<usize>)>;

thread_local! {
    /// The keys of the manager call in progress on this thread (see [`CallerKeys`]).
    static CALLER_KEYS: std::cell::RefCell<Picking> = const { std::cell::RefCell::new(None) };
}

/// While alive, makes `keys` (the collection a manager call was handed, converted) the one
/// [`job_keys`] picks from: a job made during the call (a cascade from `complete_store`)
/// carries the caller's key objects, as vLLM's does.
pub(crate) struct CallerKeys(Picking);

impl CallerKeys {
    pub(crate) fn set(keys: &Rc<Keys>) -> Self {
        Self(CALLER_KEYS.replace(Some((keys.clone(), None))))
    }

    /// [`set`](Self::set) for jobs whose keys follow `keys`' order from one job to the next
    /// (the promotions of a step, in the order their lookups started them: see
    /// [`Contexts::promoting`]): each job's keys are looked for from where the last job's
    /// ended ([`picked_in_order`]).
    pub(crate) fn in_order(keys: &Rc<Keys>) -> Self {
        Self(CALLER_KEYS.replace(Some((keys.clone(), Some(0)))))
    }
}

impl Drop for CallerKeys {
    fn drop(&mut self) {
        // The keys of this call are dropped after the borrow ends (as in `remembered`).
        drop(CALLER_KEYS.replace(self.0.take()));
    }
}

/// `keys` as a Python list, the caller's own objects where the call in progress was handed
/// them (see [`CallerKeys`]), else new `bytes`.
pub(crate) fn job_keys<'py>(py: Python<'py>, keys: &[OffloadKey]) -> PyResult<Bound<'py, PyList>> {
    match CALLER_KEYS.with_borrow(|c| c.clone()) {
        Some((caller, None)) => picked_keys(py, &caller, keys),
        Some((caller, Some(mut cursor))) => {
            let list = picked_in_order(py, &caller, keys, &mut cursor);
            // Making the list ran no Python code: the picking set is the one read above.
            CALLER_KEYS.with_borrow_mut(|c| {
                if let Some((_, at)) = c {
                    *at = Some(cursor);
                }
            });
            list
        }
        None => key_list(py, keys),
    }
}

/// How far past the cursor [`picked_in_order`] looks for a key: a lookup of a key whose
/// promotion was already pending is logged too, and sits between the keys of the jobs.
const PICK_AHEAD: usize = 8;

/// [`picked_keys`] for a run of jobs whose keys follow `caller`'s order across calls: each
/// key is looked for in the [`PICK_AHEAD`] places from `*cursor` on, the cursor moving past
/// each key found; a key not found there is a new `bytes` (linear whatever the jobs hold).
fn picked_in_order<'py>(
    py: Python<'py>,
    caller: &Keys,
    out: &[OffloadKey],
    cursor: &mut usize,
) -> PyResult<Bound<'py, PyList>> {
    let mut objs = Vec::with_capacity(out.len());
    for k in out {
        let from = (*cursor).min(caller.keys.len());
        let to = (from + PICK_AHEAD).min(caller.keys.len());
        match caller.keys[from..to].iter().position(|c| c == k) {
            Some(at) => {
                *cursor = from + at + 1;
                objs.push(caller.objs[from + at].bind(py).clone());
            }
            None => objs.push(PyBytes::new(py, k.as_bytes()).into_any()),
        }
    }
    PyList::new(py, objs)
}

/// `keys` as a Python list of `bytes`.
pub(crate) fn key_list<'py>(py: Python<'py>, keys: &[OffloadKey]) -> PyResult<Bound<'py, PyList>> {
    PyList::new(py, keys.iter().map(|k| PyBytes::new(py, k.as_bytes())))
}

/// The Python `ReqContext` a Rust context was made for, kept in the Rust context's state: a
/// Python tier is handed the caller's own object back (vLLM's tests compare it by identity),
/// for as long as the manager holds the Rust context.
#[derive(Clone)]
struct PyOrigin(Arc<Py<PyAny>>);

/// The Python `ReqContext` of `ctx`, if it was made from one.
pub(crate) fn origin<'py>(py: Python<'py>, ctx: &ReqContext) -> Option<Bound<'py, PyAny>> {
    ctx.get_state::<PyOrigin>().map(|o| o.0.bind(py).clone())
}

/// vLLM's `TierFilter` (`load_tier_filter`) as kvbm-tiering's.
fn tier_filter(f: &Bound<'_, PyAny>) -> PyResult<TierFilter> {
    let py = f.py();
    if f.is(f.get_type().getattr(intern!(py, "ALL"))?) {
        return Ok(TierFilter::ALL);
    }
    let value = |obj: &Bound<'_, PyAny>, name: &str| -> PyResult<Option<String>> {
        let v = obj.getattr(name)?;
        if v.is_none() {
            return Ok(None);
        }
        Ok(Some(v.getattr(intern!(py, "value"))?.extract()?))
    };
    let mut matchers = Vec::new();
    for m in f.getattr(intern!(py, "matchers"))?.try_iter()? {
        let m = m?;
        matchers.push(TierMatcher {
            medium: value(&m, "medium")?.and_then(|v| Medium::parse(&v)),
            locality: value(&m, "locality")?.and_then(|v| Locality::parse(&v)),
        });
    }
    Ok(TierFilter::new(matchers))
}

/// Key objects a manager's lookups read, each with the key it was read as (`None` once taken):
/// see [`Contexts::keys_after_lookups`].
type LookedUp = Vec<(Option<Py<PyAny>>, OffloadKey)>;

/// Most lookups kept between two calls that take them (a caller that looks keys up and never
/// loads or stores them makes the log start over).
const LOOKED_UP_MAX: usize = 4096;

/// Most promotion lookups kept between two `on_schedule_end` calls (a step of vLLM's promotes
/// at most its lookups' worth: 16384 in the bench).
const PROMOTED_MAX: usize = 1 << 17;

/// Most logged lookups skipped to find one key (the caller's list is a subsequence of its
/// lookups: vLLM's hits, or its misses).
const LOOKED_UP_SKIP: usize = 4;

struct Entry {
    /// Keeps the Python object (and so its address) alive while the entry exists.
    _py: Py<PyAny>,
    rust: ReqContext,
    /// The context's `_offload_key_positions` dict (vLLM never rebinds it), read once.
    positions: Option<Py<PyDict>>,
    /// How many positions were copied from `_offload_key_positions`.
    synced: usize,
}

/// Python `ReqContext` objects to Rust ones: see the [module docs](self). Shared by a
/// manager's Python objects (`&self`: any of them, any thread).
///
/// # Guarded by the GIL, not a lock
///
/// Every call holds the GIL (each takes a `Bound`, which proves it), and the map is borrowed
/// only for stretches that run no Python code: a context's own Python (its attributes on first
/// sight, `get_offload_key_position` for new positions) runs between borrows. Python code may
/// hand the GIL to another thread mid-call (the interpreter's switch interval); that thread
/// then finds the map free, where a lock held across the call would have blocked it while it
/// held the GIL: a deadlock. The GIL exists: the extension is built for the stable ABI, which
/// free-threaded interpreters do not load. A borrow found taken anyway (a bug) is a
/// `RuntimeError`, never a wait.
#[derive(Default)]
pub(crate) struct Contexts {
    by_addr: RefCell<hashbrown::HashMap<usize, Entry>>,
    /// The key objects of the lookups since the last `prepare_load` or `prepare_store`
    /// ([`Contexts::keys_after_lookups`]), strong references: guarded by the GIL as `by_addr`.
    looked_up: RefCell<LookedUp>,
    /// The key objects of the lookups that answered `HIT_PENDING` since the last
    /// `on_schedule_end` ([`Contexts::promoting`]), strong references, and their keys:
    /// guarded by the GIL as `by_addr`.
    promoted: RefCell<(Vec<OffloadKey>, Vec<Py<PyAny>>)>,
}

// SAFETY: the map is touched only with the GIL held, which serialises the threads that reach
// it, and no borrow outlives a method or spans Python code (see the type's docs).
unsafe impl Sync for Contexts {}

fn busy() -> PyErr {
    PyRuntimeError::new_err("kvbm's request-context map was re-entered (kvbm-vllm bug)")
}

impl Contexts {
    /// Notes that a lookup read `obj` as `k` and answered `r`
    /// ([`keys_after_lookups`](Self::keys_after_lookups)): kept for a `HIT` (vLLM loads it) or a
    /// `MISS` (it stores it); a key still pending is asked again, not loaded or stored.
    pub(crate) fn looked_up(&self, obj: &Bound<'_, PyAny>, k: &OffloadKey, r: LookupResult) {
        if !matches!(r, LookupResult::Hit | LookupResult::Miss) {
            return;
        }
        // Only an optimisation: a busy log (a bug) is passed by.
        let Ok(mut log) = self.looked_up.try_borrow_mut() else {
            return;
        };
        if log.len() >= LOOKED_UP_MAX {
            // Released after the borrow ends (a key object's release may run Python code).
            let old = std::mem::take(&mut *log);
            drop(log);
            drop(old);
            return;
        }
        log.push((Some(obj.clone().unbind()), *k));
    }

    /// Notes that a tiering manager's lookup read `obj` as `k` and answered `HIT_PENDING`: a
    /// promotion the lookup started (or one already pending). vLLM's promotion jobs carry the
    /// key objects its lookups were handed; `on_schedule_end`, which submits them, takes this
    /// log ([`take_promoted`](Self::take_promoted)) for [`CallerKeys::in_order`].
    pub(crate) fn promoting(&self, obj: &Bound<'_, PyAny>, k: &OffloadKey) {
        // Only an optimisation: a busy log (a bug) or a full one (no `on_schedule_end` for a
        // long while) is passed by.
        let Ok(mut log) = self.promoted.try_borrow_mut() else {
            return;
        };
        if log.0.len() < PROMOTED_MAX {
            log.0.push(*k);
            log.1.push(obj.clone().unbind());
        }
    }

    /// The promotion log since the last call (see [`promoting`](Self::promoting)), as
    /// [`Keys`]; `None` when it is empty.
    pub(crate) fn take_promoted(&self) -> Option<Rc<Keys>> {
        let (keys, objs) = std::mem::take(&mut *self.promoted.try_borrow_mut().ok()?);
        (!keys.is_empty()).then(|| Rc::new(Keys { keys, objs }))
    }

    /// [`keys`] of the collection a `prepare_load` or `prepare_store` was handed, where each
    /// object the lookups since the last such call read is taken with the key it was read as
    /// (vLLM loads a request's hits and stores its misses, the very objects it looked up:
    /// reading each again was a likely cache miss and a conversion per key). The log starts
    /// over. Sound because the log holds each object (its address cannot be reused) and a
    /// key object is immutable `bytes`.
    pub(crate) fn keys_after_lookups(&self, obj: &Bound<'_, PyAny>) -> PyResult<Rc<Keys>> {
        let mut log = self
            .looked_up
            .try_borrow_mut()
            .map(|mut l| std::mem::take(&mut *l))
            .unwrap_or_default();
        let out = keys_with(obj, &mut log);
        // What was not taken is released with no borrow held; the emptied buffer goes back.
        log.clear();
        if let Ok(mut l) = self.looked_up.try_borrow_mut()
            && l.capacity() == 0
        {
            *l = log;
        }
        out
    }

    /// The Rust context of `ctx` (made on first sight), its positions up to date.
    pub(crate) fn get(&self, ctx: &Bound<'_, PyAny>) -> PyResult<ReqContext> {
        let addr = ctx.as_ptr() as usize;
        let py = ctx.py();
        // Known, and no position added since: the common case, one probe.
        let known = {
            let map = self.by_addr.try_borrow().map_err(|_| busy())?;
            match map.get(&addr) {
                Some(e) => match &e.positions {
                    Some(p) if p.bind(py).len() != e.synced => {
                        Some((e.rust.clone(), Some(p.clone_ref(py)), e.synced))
                    }
                    _ => return Ok(e.rust.clone()),
                },
                None => None,
            }
        };
        let (rust, positions, synced) = match known {
            Some(k) => k,
            None => {
                let made = Self::make(ctx)?;
                let mut map = self.by_addr.try_borrow_mut().map_err(|_| busy())?;
                // Another thread may have made it while this one ran the context's Python.
                let e = map.entry(addr).or_insert(made);
                let known = (
                    e.rust.clone(),
                    e.positions.as_ref().map(|p| p.clone_ref(py)),
                    e.synced,
                );
                drop(map);
                known
            }
        };
        if let Some(positions) = positions
            && let positions = positions.bind(py)
            && positions.len() != synced
        {
            // Only the keys added since the last call (a dict keeps insertion order), each read
            // through the context's own method, so a subclass that overrides it is honoured.
            let getter = intern!(py, "get_offload_key_position");
            let n = positions.len();
            for k in positions.keys().iter().skip(synced) {
                let v = ctx.call_method1(getter, (&k,))?;
                if !v.is_none() {
                    rust.set_offload_key_position(key(&k)?, v.extract::<u64>()?);
                }
            }
            let mut map = self.by_addr.try_borrow_mut().map_err(|_| busy())?;
            if let Some(e) = map.get_mut(&addr) {
                e.synced = e.synced.max(n);
            }
        }
        Ok(rust)
    }

    /// A new entry for `ctx`, from its attributes (Python code: called with no borrow).
    fn make(ctx: &Bound<'_, PyAny>) -> PyResult<Entry> {
        let py = ctx.py();
        let req_id: String = ctx
            .getattr(intern!(py, "req_id"))
            .and_then(|r| r.extract())
            .map_err(|_| {
                PyTypeError::new_err("a request context is vLLM's ReqContext (with req_id: str)")
            })?;
        let mut builder = ReqContext::builder(req_id);
        if let Ok(f) = ctx.getattr(intern!(py, "load_tier_filter")) {
            builder = builder.load_tier_filter(tier_filter(&f)?);
        }
        let rust = builder.build();
        rust.set_state(PyOrigin(Arc::new(ctx.clone().unbind())));
        let positions = ctx
            .getattr(intern!(py, "_offload_key_positions"))
            .ok()
            .and_then(|p| p.cast_into::<PyDict>().ok())
            .map(Bound::unbind);
        Ok(Entry {
            _py: ctx.clone().unbind(),
            rust,
            positions,
            synced: 0,
        })
    }

    /// Forgets `ctx` (its request finished). The entry is dropped after the borrow ends.
    pub(crate) fn forget(&self, ctx: &Bound<'_, PyAny>) -> PyResult<()> {
        let gone = self
            .by_addr
            .try_borrow_mut()
            .map_err(|_| busy())?
            .remove(&(ctx.as_ptr() as usize));
        drop(gone);
        Ok(())
    }
}

/// vLLM's `OffloadPolicy` value of a scope (`"chunk_level"` or `"request_level"`).
pub(crate) fn scope_name(s: kvbm_tiering::OffloadScope) -> &'static str {
    match s {
        kvbm_tiering::OffloadScope::ChunkLevel => "chunk_level",
        kvbm_tiering::OffloadScope::RequestLevel => "request_level",
    }
}
