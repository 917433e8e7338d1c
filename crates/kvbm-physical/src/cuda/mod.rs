//! CUDA support (feature `cuda`): driver detection and device allocations.
//!
//! cudarc 0.19 is built with `dynamic-loading`, so the crate builds without a toolkit. Its safe
//! API panics when `libcuda` is missing, therefore every entry point here first checks
//! [`cuda_available`], which calls `cudarc::driver::sys::is_culib_present()`.
//!
//! Copies are synchronous driver copies for now; stream-based async copies and kernels are the
//! next step (they belong in this module).

#[cfg(feature = "cuda")]
mod memory;
#[cfg(feature = "cuda")]
pub use memory::CudaDeviceMemory;

/// Whether a CUDA driver can be used: feature `cuda` on and `libcuda` loadable.
pub fn cuda_available() -> bool {
    #[cfg(feature = "cuda")]
    {
        // SAFETY: only probes whether the shared library can be loaded; never panics.
        unsafe { cudarc::driver::sys::is_culib_present() }
    }
    #[cfg(not(feature = "cuda"))]
    {
        false
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn detection_never_panics() {
        let _ = super::cuda_available();
    }
}
