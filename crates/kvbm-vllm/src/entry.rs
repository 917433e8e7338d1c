//! C entry points for the per-chunk calls: `lookup` reached from Python without pyo3's method
//! trampoline.
//!
//! # Why
//!
//! vLLM's scheduler calls `lookup` once per chunk it schedules (16384 times in the bench's
//! step), and every other manager call once per request. A pyo3 method call goes through a
//! trampoline that raises pyo3's attach count (a thread-local: a `__tls_get_addr` call each
//! way from an extension module), checks its deferred-release pool, parses the arguments
//! against the method's signature (positional, keyword, keyword-only) and checks `self`'s
//! type. For a two-argument positional call most of that is spent for nothing. An entry made
//! here is a CPython function object (`PyCFunction_NewEx`, `METH_FASTCALL | METH_KEYWORDS`)
//! bound to the manager's Rust object, whose C function takes the two positional arguments
//! as they are:
//!
//! ```text
//!   manager.lookup(key, ctx)     (the entry, bound on the Python manager: `_bind_direct`)
//!       │ two positional arguments ──► the body, with `Python::assume_attached`
//!       └ anything else (keywords, another count) ──► the pyo3 method of the same name,
//!                                                     which parses and reports as before
//! ```
//!
//! # Soundness
//!
//! * CPython calls a function object's C entry with the calling thread attached (holding the
//!   GIL), so the body's `Python` token is real for the call's length.
//! * The entry is made only by its manager's own method, bound to that manager's object
//!   (`self` is never another type: the cast is unchecked).
//! * pyo3's attach count is not raised. Where pyo3 reads it the outcome is still correct,
//!   only slower: a `Py<T>` dropped in the body is released at pyo3's next entry instead of
//!   at once, and a `Python::attach` in the body takes CPython's `PyGILState_Ensure` route.
//!   The lookup path does neither where it is hot: it holds `Bound`s, and a Python tier's
//!   method called during a lookup takes the token of that lookup (`tiering.rs`'s `attached`,
//!   through `CallerSlot::in_lookup`).
//! * A panic in the body is caught (unwinding into CPython is undefined behaviour) and raised
//!   as pyo3's `PanicException`, as pyo3's trampoline does.

use std::ffi::CStr;
use std::panic::{AssertUnwindSafe, catch_unwind};

use pyo3::Borrowed;
use pyo3::ffi;
use pyo3::panic::PanicException;
use pyo3::prelude::*;
use pyo3::types::PyString;

/// A `PyMethodDef` CPython may point at for the life of the process (it only reads it).
pub(crate) struct MethodDef(ffi::PyMethodDef);

// SAFETY: the definition is never written after it is built, and its pointers are to static
// data (the name, the docs) and a function.
unsafe impl Sync for MethodDef {}

impl MethodDef {
    /// A fast-call definition named `name` (also the pyo3 method its fallback calls). `doc`
    /// starts with CPython's text signature, `name($self, ...)\n--\n\n`, from which
    /// `inspect.signature` reads the bound function's parameters.
    pub(crate) const fn new(
        name: &'static CStr,
        doc: &'static CStr,
        entry: ffi::PyCFunctionFastWithKeywords,
    ) -> Self {
        Self(ffi::PyMethodDef {
            ml_name: name.as_ptr(),
            ml_meth: ffi::PyMethodDefPointer {
                PyCFunctionFastWithKeywords: entry,
            },
            ml_flags: ffi::METH_FASTCALL | ffi::METH_KEYWORDS,
            ml_doc: doc.as_ptr(),
        })
    }

    /// The function object of this definition bound to `slf` (its C entry's first argument).
    pub(crate) fn bind<'py>(&'static self, slf: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyAny>> {
        // SAFETY: `self` is static (CPython keeps the pointer in the function object); `slf`
        // is a live object (GIL held), which the function object takes a reference to; the
        // result is a new reference or NULL with an exception set.
        unsafe {
            Bound::from_owned_ptr_or_err(
                slf.py(),
                ffi::PyCFunction_NewEx(
                    &self.0 as *const ffi::PyMethodDef as *mut ffi::PyMethodDef,
                    slf.as_ptr(),
                    std::ptr::null_mut(),
                ),
            )
        }
    }
}

/// The body of a two-argument entry: `(py, self, first, second)` to the call's result.
pub(crate) type Body = for<'py> fn(
    Python<'py>,
    &Bound<'py, PyAny>,
    &Bound<'py, PyAny>,
    &Bound<'py, PyAny>,
) -> PyResult<Py<PyAny>>;

/// Runs a [`MethodDef`]'s C entry: `body` for a call with exactly two positional arguments,
/// else the pyo3 method `name` of `slf` with the call's arguments as given. Returns a new
/// reference, or NULL with the exception set.
///
/// # Safety
///
/// Called only as a `METH_FASTCALL | METH_KEYWORDS` entry by CPython: the thread is attached,
/// `slf` is the object the function was bound to, `args` holds `nargs` positional arguments
/// followed by one value per name in `kwnames` (a tuple, or NULL).
pub(crate) unsafe fn call_two(
    name: &'static CStr,
    body: Body,
    slf: *mut ffi::PyObject,
    args: *const *mut ffi::PyObject,
    nargs: ffi::Py_ssize_t,
    kwnames: *mut ffi::PyObject,
) -> *mut ffi::PyObject {
    // SAFETY: CPython runs a C entry with the thread attached (see the module docs).
    let py = unsafe { Python::assume_attached() };
    let run = AssertUnwindSafe(|| -> PyResult<Py<PyAny>> {
        // SAFETY: `slf` and each argument are live objects the caller holds for the call
        // (borrowed: no reference count is touched).
        let slf = unsafe { Borrowed::from_ptr(py, slf) };
        if nargs == 2 && kwnames.is_null() {
            // SAFETY: `args` holds two live positional arguments (the protocol, above).
            let (a, b) = unsafe {
                (
                    Borrowed::from_ptr(py, *args),
                    Borrowed::from_ptr(py, *args.add(1)),
                )
            };
            return body(py, &slf, &a, &b);
        }
        // Any other shape of call: the pyo3 method, which parses it and names what is wrong.
        let nkw = if kwnames.is_null() {
            0
        } else {
            // SAFETY: `kwnames` is a tuple of strings (CPython's vectorcall protocol).
            unsafe { ffi::PyTuple_Size(kwnames) }
        };
        let mut all = Vec::with_capacity(1 + (nargs + nkw) as usize);
        all.push(slf.as_ptr());
        // SAFETY: `args` holds `nargs + nkw` values (the protocol, above).
        all.extend_from_slice(unsafe { std::slice::from_raw_parts(args, (nargs + nkw) as usize) });
        let method = PyString::intern(py, name.to_str().expect("a method name is ASCII"));
        // SAFETY: every pointer is live for the call; the result is a new reference or NULL
        // with an exception set.
        unsafe {
            Bound::from_owned_ptr_or_err(
                py,
                crate::bridge::PyObject_VectorcallMethod(
                    method.as_ptr(),
                    all.as_ptr(),
                    1 + nargs as usize,
                    kwnames,
                ),
            )
        }
        .map(Bound::unbind)
    });
    let err = match catch_unwind(run) {
        Ok(Ok(obj)) => return obj.into_ptr(),
        Ok(Err(e)) => e,
        Err(payload) => {
            let msg = payload
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| payload.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "panic in kvbm".to_string());
            PanicException::new_err(msg)
        }
    };
    err.restore(py);
    std::ptr::null_mut()
}

/// `static $def: MethodDef`: a fast-call definition named `$name` (a C string literal, also
/// the pyo3 method the other shapes of call go to) for the frozen pyclass `$ty`, whose
/// two-argument positional calls run `$body(&$ty, first, second)`. Bind it with
/// [`MethodDef::bind`] to a `$ty` object only (its entry casts `self` unchecked).
macro_rules! two_argument_entry {
    ($def:ident, $ty:ty, $name:literal, $doc:literal, $body:expr) => {
        static $def: $crate::entry::MethodDef = {
            unsafe extern "C" fn entry(
                slf: *mut pyo3::ffi::PyObject,
                args: *const *mut pyo3::ffi::PyObject,
                nargs: pyo3::ffi::Py_ssize_t,
                kwnames: *mut pyo3::ffi::PyObject,
            ) -> *mut pyo3::ffi::PyObject {
                // SAFETY: CPython's fast-call entry (`call_two`'s contract); the definition is
                // bound only to a `$ty` (the macro's contract), so `slf` is one.
                unsafe {
                    $crate::entry::call_two(
                        $name,
                        |_, slf, a, b| ($body)(slf.cast_unchecked::<$ty>().get(), a, b),
                        slf,
                        args,
                        nargs,
                        kwnames,
                    )
                }
            }
            $crate::entry::MethodDef::new($name, $doc, entry)
        };
    };
}
pub(crate) use two_argument_entry;
