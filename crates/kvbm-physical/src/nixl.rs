//! NIXL (feature `nixl`): probed with `dlopen` before any call.
//!
//! The `nixl-sys` stub aborts the process (SIGABRT) when `libnixl_capi.so` is missing, which
//! cannot be caught; so nothing here touches `nixl-sys` unless [`nixl_available`] found the
//! library first. Off by default; transfers do not use NIXL yet.

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
