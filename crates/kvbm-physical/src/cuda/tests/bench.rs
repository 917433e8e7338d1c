//! The GPU benchmark, run by `cargo xtask gpu-check` as the ignored test `cuda::tests::bench::gpu_bench`
//! (one binary for tests and bench keeps the GPU machine's build short). Writes its results as
//! one JSON object to the file named by `KVBM_GPU_BENCH_OUT` (and prints it).
//!
//! Measured, in this order:
//! 1. raw peak: one 1 GiB `cuMemcpyAsync` between device memory and registered (pinned)
//!    `HostStorage`, each direction, timed with CUDA events (best of 5); also the same from a
//!    `cuMemHostAlloc` buffer, for reference;
//! 2. 2 MiB blocks through the transfer manager (submit → completion resolved, wall clock,
//!    best of 5): 256 blocks with scattered ids (256 pieces) and consecutive ids (1 piece), H2D
//!    and D2H, as a ratio of the raw peak (goal ≥ 0.9);
//! 3. 64 KiB layer-separate pieces: 256 blocks × 32 layers from a block-contiguous
//!    layer-separate G1 layout to fully contiguous G2 (8192 pieces), batched and per-piece;
//! 4. fixed overhead of a 64-block offload: 64 scattered 4 KiB blocks D2H, 300 timed runs:
//!    median wall time minus the bytes at raw peak (goal < 50 µs); and the same for 64 × 2 MiB.

use std::time::Instant;

use cudarc::driver::{result, sys};

use super::{gpu_or_skip, permutation};
use crate::cuda::{CudaDevice, CudaPinnedBuffer, Direction, register_host};
use crate::layout::{BlockDim, BlockLayout, LayoutKind};
use crate::physical::PhysicalLayout;
use crate::storage::{DeviceMemory, HostStorage, PinPolicy};
use crate::transfer::cuda::copy::{CopyMode, batch_api, set_copy_mode};
use crate::transfer::{LayoutHandle, TransferManager, TransferOptions};

const GIB: usize = 1 << 30;

struct Json(Vec<String>);

impl Json {
    fn num(&mut self, k: &str, v: f64) {
        self.0.push(format!(
            "\"{k}\": {}",
            if v.is_finite() {
                format!("{v:.4}")
            } else {
                "null".into()
            }
        ));
    }
    fn int(&mut self, k: &str, v: u64) {
        self.0.push(format!("\"{k}\": {v}"));
    }
    fn str(&mut self, k: &str, v: &str) {
        self.0.push(format!(
            "\"{k}\": \"{}\"",
            v.replace('\\', "\\\\").replace('"', "\\\"")
        ));
    }
    fn bool(&mut self, k: &str, v: bool) {
        self.0.push(format!("\"{k}\": {v}"));
    }
    fn finish(&self) -> String {
        format!("{{\n  {}\n}}\n", self.0.join(",\n  "))
    }
}

/// Best-of-`reps` GB/s of one `len`-byte copy `dst ← src` on `stream`, timed with events.
fn raw_copy_gbps(dst: u64, src: u64, len: usize, stream: sys::CUstream, reps: usize) -> f64 {
    let start = result::event::create(sys::CUevent_flags::CU_EVENT_DEFAULT).unwrap();
    let stop = result::event::create(sys::CUevent_flags::CU_EVENT_DEFAULT).unwrap();
    let mut best: f64 = 0.0;
    for i in 0..=reps {
        // SAFETY: dst/src are live allocations of at least `len` bytes owned by the caller.
        let ms = unsafe {
            result::event::record(start, stream).unwrap();
            sys::cuMemcpyAsync(dst, src, len, stream).result().unwrap();
            result::event::record(stop, stream).unwrap();
            result::event::synchronize(stop).unwrap();
            result::event::elapsed(start, stop).unwrap()
        };
        if i > 0 {
            best = best.max(len as f64 / (ms as f64 * 1e-3) / 1e9);
        }
    }
    // SAFETY: events are ours and idle.
    unsafe {
        result::event::destroy(start).unwrap();
        result::event::destroy(stop).unwrap();
    }
    best
}

/// Wall seconds of each of `reps` transfers (after one warm-up, which also registers memory).
fn time_transfers(
    tm: &TransferManager,
    src: LayoutHandle,
    s: &[usize],
    dst: LayoutHandle,
    d: &[usize],
    reps: usize,
) -> Vec<f64> {
    let mut out = Vec::with_capacity(reps);
    for i in 0..=reps {
        let t = Instant::now();
        // SAFETY: bench-owned layouts; nothing outside the manager reads or writes their blocks while the transfer runs.
        let o = unsafe { tm.execute_transfer(src, s, dst, d, TransferOptions::default()) }
            .unwrap()
            .wait();
        let dt = t.elapsed().as_secs_f64();
        assert!(
            o.is_complete_success(),
            "benchmark transfer failed: {:?}",
            o.failures().next()
        );
        if i > 0 {
            out.push(dt);
        }
    }
    out
}

fn pct(v: &[f64], p: f64) -> f64 {
    let mut s = v.to_vec();
    s.sort_by(|a, b| a.partial_cmp(b).unwrap());
    s[((s.len() - 1) as f64 * p).round() as usize]
}

fn layout(
    n: usize,
    layers: usize,
    outer: usize,
    page: usize,
    inner: usize,
    kind: LayoutKind,
) -> BlockLayout {
    BlockLayout::builder()
        .num_blocks(n)
        .num_layers(layers)
        .outer_dim(outer)
        .page_size(page)
        .inner_dim(inner)
        .dtype_bytes(2)
        .kind(kind)
        .build()
        .unwrap()
}

#[test]
#[ignore = "GPU benchmark: run by `cargo xtask gpu-check`"]
fn gpu_bench() {
    if !gpu_or_skip("gpu_bench") {
        return;
    }
    let mut j = Json(Vec::new());
    let dev = CudaDevice::get(0).unwrap();
    j.str("device", &dev.name().unwrap_or_default());
    let mut ver: i32 = 0;
    // SAFETY: writes one int.
    unsafe { sys::cuDriverGetVersion(&mut ver) };
    j.int("driver_version", ver as u64);
    j.str("batch_api", batch_api());

    // 1. Raw peak.
    let dmem = crate::cuda::CudaDeviceMemory::new(GIB, 0).unwrap();
    let host = HostStorage::new(GIB, PinPolicy::TryPin).unwrap();
    let t = Instant::now();
    register_host(&host, &dev).unwrap();
    j.num("register_1gib_ms", t.elapsed().as_secs_f64() * 1e3);
    dev.bind().unwrap();
    let h2d_stream = dev.stream(Direction::HostToDevice);
    let d2h_stream = dev.stream(Direction::DeviceToHost);
    let (d, h) = (dmem.device_addr(), host.as_ptr() as u64);
    let raw_h2d = raw_copy_gbps(d, h, GIB, h2d_stream, 5);
    let raw_d2h = raw_copy_gbps(h, d, GIB, d2h_stream, 5);
    j.num("raw_h2d_gbps", raw_h2d);
    j.num("raw_d2h_gbps", raw_d2h);
    {
        let pinned = CudaPinnedBuffer::new(GIB / 2, &dev).unwrap();
        let p = pinned.as_ptr() as u64;
        j.num(
            "raw_hostalloc_h2d_gbps",
            raw_copy_gbps(d, p, GIB / 2, h2d_stream, 3),
        );
        j.num(
            "raw_hostalloc_d2h_gbps",
            raw_copy_gbps(p, d, GIB / 2, d2h_stream, 3),
        );
    }
    drop(host);
    drop(dmem);

    let tm = TransferManager::new().unwrap();
    // 2. 2 MiB blocks (32 layers × 2 × 32 KiB), fully contiguous both sides.
    let n = 256;
    let fc = layout(n, 32, 2, 16, 1024, LayoutKind::FullyContiguous);
    let block = fc.config().block_bytes();
    j.int("block_bytes", block as u64);
    let g1 = tm
        .register_layout(PhysicalLayout::allocate_device(fc, 0).unwrap())
        .unwrap();
    let g2 = tm
        .register_layout(PhysicalLayout::allocate_host(fc, PinPolicy::TryPin).unwrap())
        .unwrap();
    let ids: Vec<usize> = (0..n).collect();
    let scat = permutation(n, 3);
    let bytes = (n * block) as f64;
    let best = |v: Vec<f64>| bytes / v.iter().cloned().fold(f64::MAX, f64::min) / 1e9;
    let h2d_scat = best(time_transfers(&tm, g2, &ids, g1, &scat, 5));
    let d2h_scat = best(time_transfers(&tm, g1, &scat, g2, &ids, 5));
    let h2d_cont = best(time_transfers(&tm, g2, &ids, g1, &ids, 5));
    let d2h_cont = best(time_transfers(&tm, g1, &ids, g2, &ids, 5));
    j.num("blocks_2mib_scattered_h2d_gbps", h2d_scat);
    j.num("blocks_2mib_scattered_d2h_gbps", d2h_scat);
    j.num("blocks_2mib_scattered_h2d_ratio", h2d_scat / raw_h2d);
    j.num("blocks_2mib_scattered_d2h_ratio", d2h_scat / raw_d2h);
    j.num("blocks_2mib_contiguous_h2d_ratio", h2d_cont / raw_h2d);
    j.num("blocks_2mib_contiguous_d2h_ratio", d2h_cont / raw_d2h);
    let ratio_2mib = (h2d_scat / raw_h2d).min(d2h_scat / raw_d2h);
    j.bool("goal_2mib_ratio_ge_0_9", ratio_2mib >= 0.9);

    // 3. 64 KiB layer-separate pieces (block-contiguous per layer on G1).
    let ls = layout(
        n,
        32,
        2,
        16,
        1024,
        LayoutKind::LayerSeparate(BlockDim::BlockContiguous),
    );
    let g1ls = tm
        .register_layout(PhysicalLayout::allocate_device(ls, 0).unwrap())
        .unwrap();
    for (mode, name) in [
        (CopyMode::Auto, "batched"),
        (CopyMode::PerPiece, "per_piece"),
    ] {
        set_copy_mode(mode);
        let before = crate::transfer::cuda::copy_stats();
        let h2d = best(time_transfers(&tm, g2, &ids, g1ls, &scat, 3));
        let d2h = best(time_transfers(&tm, g1ls, &scat, g2, &ids, 3));
        let after = crate::transfer::cuda::copy_stats();
        let xfers = (after.0 - before.0).max(1);
        j.num(&format!("pieces_64kib_{name}_h2d_gbps"), h2d);
        j.num(&format!("pieces_64kib_{name}_d2h_gbps"), d2h);
        j.num(&format!("pieces_64kib_{name}_h2d_ratio"), h2d / raw_h2d);
        j.num(&format!("pieces_64kib_{name}_d2h_ratio"), d2h / raw_d2h);
        j.int(
            &format!("pieces_64kib_{name}_pieces_per_transfer"),
            (after.1 - before.1) / xfers,
        );
        j.int(
            &format!("pieces_64kib_{name}_calls_per_transfer"),
            (after.2 - before.2) / xfers,
        );
    }
    set_copy_mode(CopyMode::Auto);

    // 3b. NHD canonical fragments (range copies, as the canonical worker issues them): each
    // of 64 blocks' 32 layers × 2 regions of 16 tokens × 2 KiB rows, half of each token row
    // (this rank's heads, 1 KiB) gathered into a dense canonical page and scattered back.
    {
        use crate::transfer::RangeCopy;
        let region = fc.config().region_bytes(); // 16 tokens × 2 KiB
        let frag = region / 16 / 2;
        let blocks = 64;
        let copies = |to_host: bool| -> Vec<RangeCopy> {
            (0..blocks)
                .flat_map(|b| {
                    let src_block = scat[b];
                    (0..32 * 2).map(move |r| {
                        let (row_side, dense_side) = (r * region, r * region / 2);
                        let (so, ss, d_o, ds) = if to_host {
                            (row_side, 2 * frag, dense_side, frag)
                        } else {
                            (dense_side, frag, row_side, 2 * frag)
                        };
                        RangeCopy {
                            src_block,
                            src_offset: so,
                            dst_block: b,
                            dst_offset: d_o,
                            len: frag,
                            count: 16,
                            src_stride: ss,
                            dst_stride: ds,
                        }
                    })
                })
                .collect()
        };
        let time_copies = |src: LayoutHandle, dst: LayoutHandle, c: Vec<RangeCopy>| {
            let mut best = f64::MAX;
            for i in 0..=5 {
                let t = Instant::now();
                // SAFETY: bench-owned layouts; nothing else touches them meanwhile.
                let o = unsafe { tm.execute_copies(src, dst, c.clone()) }
                    .unwrap()
                    .wait();
                let dt = t.elapsed().as_secs_f64();
                assert!(o.is_complete_success(), "NHD copies failed");
                if i > 0 {
                    best = best.min(dt);
                }
            }
            best
        };
        let frag_bytes = (blocks * 64 * 16 * frag) as f64;
        let before = crate::transfer::cuda::copy_stats();
        let d2h = frag_bytes / time_copies(g1, g2, copies(true)) / 1e9;
        // Scatter back: the dense pages from G2's first blocks into G1's rows.
        let h2d = frag_bytes
            / time_copies(
                g2,
                g1,
                copies(false)
                    .into_iter()
                    .map(|c| RangeCopy {
                        src_block: c.dst_block,
                        dst_block: c.src_block,
                        ..c
                    })
                    .collect(),
            )
            / 1e9;
        let after = crate::transfer::cuda::copy_stats();
        let xfers = (after.0 - before.0).max(1);
        j.int("nhd_fragment_bytes", frag as u64);
        j.num("nhd_fragments_d2h_gbps", d2h);
        j.num("nhd_fragments_h2d_gbps", h2d);
        j.num("nhd_fragments_d2h_ratio", d2h / raw_d2h);
        j.num("nhd_fragments_h2d_ratio", h2d / raw_h2d);
        j.int("nhd_pieces_per_transfer", (after.1 - before.1) / xfers);
        j.int("nhd_calls_per_transfer", (after.2 - before.2) / xfers);
    }

    // 4. Fixed overhead of a 64-block offload.
    let small = layout(1024, 1, 1, 1, 2048, LayoutKind::FullyContiguous); // 4 KiB blocks
    let sg1 = tm
        .register_layout(PhysicalLayout::allocate_device(small, 0).unwrap())
        .unwrap();
    let sg2 = tm
        .register_layout(PhysicalLayout::allocate_host(small, PinPolicy::TryPin).unwrap())
        .unwrap();
    let s64: Vec<usize> = permutation(1024, 5)[..64].to_vec();
    let d64: Vec<usize> = permutation(1024, 6)[..64].to_vec();
    for _ in 0..20 {
        time_transfers(&tm, sg1, &s64, sg2, &d64, 1);
    }
    let lat = time_transfers(&tm, sg1, &s64, sg2, &d64, 300);
    let copy_s = (64 * small.config().block_bytes()) as f64 / (raw_d2h * 1e9);
    let med = pct(&lat, 0.5);
    j.num("offload_64x4kib_wall_us_min", pct(&lat, 0.0) * 1e6);
    j.num("offload_64x4kib_wall_us_median", med * 1e6);
    j.num("offload_64x4kib_wall_us_p90", pct(&lat, 0.9) * 1e6);
    j.num("offload_64x4kib_wall_us_p99", pct(&lat, 0.99) * 1e6);
    j.num("offload_64x4kib_copy_us_at_raw_peak", copy_s * 1e6);
    let overhead = (med - copy_s) * 1e6;
    j.num("offload_64_block_overhead_us", overhead);
    j.bool("goal_overhead_lt_50us", overhead < 50.0);
    let big64: Vec<usize> = scat[..64].to_vec();
    let lat = time_transfers(&tm, g1, &big64, g2, &ids[..64], 20);
    let copy_s = (64 * block) as f64 / (raw_d2h * 1e9);
    j.num("offload_64x2mib_wall_us_median", pct(&lat, 0.5) * 1e6);
    j.num(
        "offload_64x2mib_overhead_us",
        (pct(&lat, 0.5) - copy_s) * 1e6,
    );

    j.bool(
        "batch_api_disabled_after_error",
        crate::transfer::cuda::copy::batch_disabled(),
    );
    let text = j.finish();
    println!("{text}");
    if let Some(path) = std::env::var_os("KVBM_GPU_BENCH_OUT") {
        std::fs::write(&path, &text).unwrap();
    }
}
