//! NIXL (feature `nixl`): probed with `dlopen` before any call, and a transport over it.
//!
//! The `nixl-sys` stub aborts the process (SIGABRT) when `libnixl_capi.so` is missing, which
//! cannot be caught; so nothing here touches `nixl-sys` unless [`nixl_available`] found the
//! library first. Off by default. `transport` (feature `nixl`) holds `NixlAgent`: blocks of host
//! layouts written to or read from another agent's layouts over UCX, tested over loopback with
//! the library of the `nixl-cu12` wheel from the package index (`cargo xtask nixl`); the
//! cluster's data plane still moves its blocks over TCP.

#[cfg(feature = "nixl")]
pub mod transport;
#[cfg(feature = "nixl")]
pub use transport::{NixlAgent, NixlOp, NixlTransfer, RemoteLayout};

/// The shared library the NIXL C API lives in.
pub const NIXL_LIBRARY: &str = "libnixl_capi.so";

/// Whether feature `nixl` is on and `libnixl_capi.so` can be loaded.
pub fn nixl_available() -> bool {
    #[cfg(feature = "nixl")]
    {
        let name = std::ffi::CString::new(NIXL_LIBRARY).expect("no NUL");
        // SAFETY: dlopen with a valid C string; the handle is closed right away.
        unsafe {
            let h = libc::dlopen(name.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL);
            if h.is_null() {
                return false;
            }
            libc::dlclose(h);
        }
        true
    }
    #[cfg(not(feature = "nixl"))]
    {
        false
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn probe_never_aborts() {
        let _ = super::nixl_available();
    }
}
