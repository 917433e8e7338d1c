//! Helpers for other crates' tests (feature `testing`; the workspace's test kit, `kvbm-tests`,
//! may not depend on a kvbm crate, which uses it as a dev-dependency): host layouts for tests: one block geometry, a per-block byte pattern to fill a layout with,
//! and a block's bytes read back. Tests compare bytes read after a move with bytes read from the
//! layout they filled, so the pattern is arbitrary; it differs per block, layer position and
//! `seed`, so a block landing in the wrong slot or a second run's bytes never compare equal.

use crate::{BlockLayout, LayoutKind, PhysicalLayout};

/// `num_blocks` blocks of `layers` layers × 2 × 16 tokens × `inner_dim` × 2 bytes, fully
/// contiguous.
pub fn geometry(num_blocks: usize, layers: usize, inner_dim: usize) -> BlockLayout {
    BlockLayout::builder()
        .num_blocks(num_blocks)
        .num_layers(layers)
        .outer_dim(2)
        .page_size(16)
        .inner_dim(inner_dim)
        .dtype_bytes(2)
        .kind(LayoutKind::FullyContiguous)
        .build()
        .expect("a valid test geometry")
}

/// The pattern byte `k` of block `b` holds after [`fill`] with `seed`.
pub fn pattern(seed: u8, b: usize, k: usize) -> u8 {
    (k as u8).wrapping_mul(31) ^ (b as u8).wrapping_mul(131) ^ seed
}

/// Fills every block of a host `layout` with [`pattern`]s of its index and `seed` (each layer
/// region from its own offset 0).
///
/// The layout must be host memory the caller owns, with no transfer touching it meanwhile.
pub fn fill(layout: &PhysicalLayout, seed: u8) {
    let c = *layout.layout().config();
    for b in 0..c.num_blocks {
        for (addr, len) in layout.block_addrs(b, 0..c.num_layers) {
            // SAFETY: host memory the test allocated and alone uses (this function's contract).
            let s = unsafe { std::slice::from_raw_parts_mut(addr as *mut u8, len) };
            for (k, x) in s.iter_mut().enumerate() {
                *x = pattern(seed, b, k);
            }
        }
    }
}

/// The bytes of block `b` of a host `layout`, in layer order (no transfer may write it
/// meanwhile).
pub fn bytes(layout: &PhysicalLayout, b: usize) -> Vec<u8> {
    let c = *layout.layout().config();
    let mut out = Vec::new();
    for (addr, len) in layout.block_addrs(b, 0..c.num_layers) {
        // SAFETY: as in `fill`; nothing writes the block while it is read.
        out.extend_from_slice(unsafe { std::slice::from_raw_parts(addr as *const u8, len) });
    }
    out
}

/// The GPU tests' gate (kvbm-physical's and the crates' above, feature `cuda`): `true` when
/// device 0 is usable; otherwise prints why `test` is skipped, or panics when
/// `KVBM_REQUIRE_GPU` is set (as `cargo xtask gpu-check` sets it), so no GPU test passes by
/// skipping there.
#[cfg(feature = "cuda")]
pub fn gpu_or_skip(test: &str) -> bool {
    let why = if !crate::cuda::cuda_available() {
        "no CUDA driver (libcuda.so could not be loaded)".to_string()
    } else {
        match crate::cuda::CudaDevice::get(0) {
            Ok(_) => return true,
            Err(e) => format!("CUDA driver present but device 0 unusable: {e}"),
        }
    };
    if std::env::var_os("KVBM_REQUIRE_GPU").is_some() {
        panic!("{test}: KVBM_REQUIRE_GPU is set but {why}");
    }
    eprintln!(
        "SKIPPED {test}: {why}; GPU tests run on a GPU machine via `cargo xtask gpu-check --out DIR`"
    );
    false
}
