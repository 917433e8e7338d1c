//! Tests of the CUDA path. The planner tests run everywhere; every `gpu_*` test needs a driver
//! and a device and otherwise skips with a message (or fails, when `KVBM_REQUIRE_GPU` is set,
//! as `cargo xtask gpu-check` does).

use std::sync::Arc;

use xxhash_rust::xxh3::xxh3_64;

use super::{CudaDevice, CudaEventPrecondition, CudaPinnedBuffer, Direction, register_host};
use crate::layout::{BlockDim, BlockLayout, LayoutKind};
use crate::physical::{Backing, PhysicalLayout};
use crate::storage::{DiskConfig, HostStorage, PinPolicy};
use crate::transfer::cuda::copy::{Piece, coalesce, plan};
use crate::transfer::{BlockId, LayoutHandle, TransferManager, TransferOptions};

pub(super) use crate::testing::gpu_or_skip;

fn layout(
    blocks: usize,
    layers: usize,
    page: usize,
    inner: usize,
    kind: LayoutKind,
) -> BlockLayout {
    BlockLayout::builder()
        .num_blocks(blocks)
        .num_layers(layers)
        .outer_dim(2)
        .page_size(page)
        .inner_dim(inner)
        .dtype_bytes(2)
        .kind(kind)
        .build()
        .unwrap()
}

const FC: LayoutKind = LayoutKind::FullyContiguous;
const LS_BLOCK: LayoutKind = LayoutKind::LayerSeparate(BlockDim::BlockContiguous);
const LS_OUTER: LayoutKind = LayoutKind::LayerSeparate(BlockDim::OuterContiguous);

fn host_allocs(l: &PhysicalLayout) -> &[Arc<HostStorage>] {
    match l.backing() {
        Backing::Host(a) => a,
        _ => panic!("not a host layout"),
    }
}

/// Fills a host layout with deterministic pseudo-random bytes.
fn fill_random(l: &PhysicalLayout, seed: u64) {
    let mut x = seed | 1;
    for h in host_allocs(l) {
        // SAFETY: the test owns the layout exclusively.
        for chunk in unsafe { h.as_mut_slice() }.chunks_mut(8) {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let b = x.to_le_bytes();
            chunk.copy_from_slice(&b[..chunk.len()]);
        }
    }
}

/// The serialized bytes of `block`'s `layers` in a host layout.
fn block_bytes(l: &PhysicalLayout, block: BlockId, layers: std::ops::Range<usize>) -> Vec<u8> {
    let mut out = Vec::new();
    for (addr, len) in l.block_addrs(block, layers) {
        // SAFETY: inside a live host allocation; no transfer is running.
        out.extend_from_slice(unsafe { std::slice::from_raw_parts(addr as *const u8, len) });
    }
    out
}

fn checksum(l: &PhysicalLayout, block: BlockId) -> u64 {
    let n = l.layout().config().num_layers;
    xxh3_64(&block_bytes(l, block, 0..n))
}

fn xfer(
    tm: &TransferManager,
    src: LayoutHandle,
    s: &[BlockId],
    dst: LayoutHandle,
    d: &[BlockId],
    opts: TransferOptions,
) {
    // SAFETY: test-owned layouts; nothing outside the manager reads or writes their blocks while the transfer runs.
    let out = unsafe { tm.execute_transfer(src, s, dst, d, opts) }
        .unwrap()
        .wait();
    if let Some((id, e)) = out.failures().next() {
        panic!("block {id} failed: {e}");
    }
}

/// A deterministic permutation of `0..n` (also used by the GPU benchmark).
pub(super) fn permutation(n: usize, seed: u64) -> Vec<usize> {
    let mut v: Vec<usize> = (0..n).collect();
    let mut x = seed | 1;
    for i in (1..n).rev() {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        v.swap(i, (x % (i as u64 + 1)) as usize);
    }
    v
}

// ---- planner (no GPU needed) ----

#[test]
fn plan_coalesces_contiguous_runs_fully_contiguous() {
    let l = layout(16, 4, 4, 8, FC);
    let a = PhysicalLayout::allocate_host(l, PinPolicy::Unpinned).unwrap();
    let b = PhysicalLayout::allocate_host(l, PinPolicy::Unpinned).unwrap();
    let ids: Vec<usize> = (3..11).collect();
    let p = plan(&a, &b, &ids, &ids, 0..4);
    assert_eq!(p.len(), 1, "a run of 8 consecutive blocks is one copy");
    assert_eq!(p[0].len, 8 * l.config().block_bytes());
    // Shuffled ids still coalesce (sorted by destination).
    let mut shuffled = ids.clone();
    shuffled.reverse();
    assert_eq!(plan(&a, &b, &shuffled, &shuffled, 0..4).len(), 1);
    // Scattered ids: one copy per block; a layer range: one (shorter) copy per block.
    let s = [0, 2, 4, 6];
    assert_eq!(plan(&a, &b, &s, &s, 0..4).len(), 4);
    let p = plan(&a, &b, &s, &s, 1..3);
    assert_eq!(p.len(), 4);
    assert!(p.iter().all(|x| x.len == 2 * l.config().layer_bytes()));
}

#[test]
fn plan_layer_separate_pieces() {
    let l = layout(16, 4, 4, 8, FC);
    let ls = layout(16, 4, 4, 8, LS_BLOCK);
    let lo = layout(16, 4, 4, 8, LS_OUTER);
    let fc = PhysicalLayout::allocate_host(l, PinPolicy::Unpinned).unwrap();
    let bc = PhysicalLayout::allocate_host(ls, PinPolicy::Unpinned).unwrap();
    let bc2 = PhysicalLayout::allocate_host(ls, PinPolicy::Unpinned).unwrap();
    let oc = PhysicalLayout::allocate_host(lo, PinPolicy::Unpinned).unwrap();
    let ids: Vec<usize> = (0..8).collect();
    // Block-contiguous per layer vs fully contiguous: one piece per (block, layer).
    assert_eq!(plan(&bc, &fc, &ids, &ids, 0..4).len(), 8 * 4);
    // Outer-contiguous (vLLM): one piece per (block, layer, outer).
    assert_eq!(plan(&oc, &fc, &ids, &ids, 0..4).len(), 8 * 4 * 2);
    // Layer-separate on both sides with consecutive ids: one piece per layer.
    assert_eq!(plan(&bc, &bc2, &ids, &ids, 0..4).len(), 4);
    // Total bytes always equal the blocks' bytes for the layers.
    let total: usize = plan(&oc, &fc, &ids, &ids, 1..3).iter().map(|p| p.len).sum();
    assert_eq!(total, 8 * 2 * l.config().layer_bytes());
}

#[test]
fn coalesce_needs_both_sides_contiguous() {
    let p = |src, dst, len| Piece { src, dst, len };
    let out = coalesce(vec![p(100, 0, 10), p(110, 10, 10), p(500, 20, 10)]);
    assert_eq!(out, vec![p(100, 0, 20), p(500, 20, 10)]);
}

// ---- GPU tests (skip without a driver) ----

#[test]
fn gpu_allocation() {
    if !gpu_or_skip("gpu_allocation") {
        return;
    }
    let dev = CudaDevice::get(0).unwrap();
    eprintln!("device 0: {}", dev.name().unwrap_or_default());
    for kind in [FC, LS_BLOCK, LS_OUTER] {
        let l = layout(8, 4, 16, 128, kind);
        let g1 = PhysicalLayout::allocate_device(l, 0).unwrap();
        let Backing::Device(allocs) = g1.backing() else {
            panic!("device layout expected")
        };
        assert_eq!(allocs.len(), l.num_allocations());
        for a in allocs {
            assert!(
                !a.is_stand_in(),
                "real device memory expected with a driver present"
            );
            assert!(a.size_bytes() >= l.allocation_bytes());
            let src: Vec<u8> = (0..4096u32).map(|i| (i * 7) as u8).collect();
            let mut back = vec![0u8; 4096];
            // SAFETY: inside the allocation; exclusive in this test.
            unsafe {
                a.copy_h2d(a.device_addr() + 64, src.as_ptr(), src.len())
                    .unwrap();
                a.copy_d2h(back.as_mut_ptr(), a.device_addr() + 64, back.len())
                    .unwrap();
            }
            assert_eq!(src, back);
        }
    }
    let h = HostStorage::new(1 << 20, PinPolicy::TryPin).unwrap();
    assert!(register_host(&h, &dev).unwrap(), "first registration");
    assert!(!register_host(&h, &dev).unwrap(), "registered once");
    drop(h); // unregisters, then unmaps
    let p = CudaPinnedBuffer::new(1 << 20, &dev).unwrap();
    assert_eq!(p.len(), 1 << 20);
}

#[test]
fn gpu_round_trip_g1_g2_g3_g2_g1() {
    if !gpu_or_skip("gpu_round_trip_g1_g2_g3_g2_g1") {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let tm = TransferManager::new().unwrap();
    let n = 48;
    let fc = layout(n, 6, 16, 256, FC); // 96 KiB blocks
    let lsb = layout(n, 6, 16, 256, LS_BLOCK);
    let lso = layout(n, 6, 16, 256, LS_OUTER);
    let input = PhysicalLayout::allocate_host(fc, PinPolicy::TryPin).unwrap();
    fill_random(&input, 0x5eed);
    let sums: Vec<u64> = (0..n).map(|b| checksum(&input, b)).collect();
    let h_in = tm.register_layout(input).unwrap();
    let g1a = tm
        .register_layout(PhysicalLayout::allocate_device(lso, 0).unwrap())
        .unwrap();
    let g2a = tm
        .register_layout(PhysicalLayout::allocate_host(fc, PinPolicy::TryPin).unwrap())
        .unwrap();
    let disk = PhysicalLayout::create_disk(fc, &DiskConfig::new(tmp.path().join("g3.kv"))).unwrap();
    let g3 = tm.register_layout(disk).unwrap();
    let g2b = tm
        .register_layout(PhysicalLayout::allocate_host(fc, PinPolicy::TryPin).unwrap())
        .unwrap();
    let g1b = tm
        .register_layout(PhysicalLayout::allocate_device(lsb, 0).unwrap())
        .unwrap();
    let out = tm
        .register_layout(PhysicalLayout::allocate_host(fc, PinPolicy::TryPin).unwrap())
        .unwrap();
    let all: Vec<usize> = (0..n).collect();
    let (p1, p2, p3, p4, p5, p6) = (
        permutation(n, 1),
        permutation(n, 2),
        permutation(n, 3),
        permutation(n, 4),
        permutation(n, 5),
        permutation(n, 6),
    );
    let o = TransferOptions::default;
    // Stage the input into G1 (scattered), then G1→G2→G3→G2→G1, then back out for checking.
    xfer(&tm, h_in, &all, g1a, &p1, o());
    xfer(&tm, g1a, &p1, g2a, &p2, o());
    xfer(&tm, g2a, &p2, g3, &p3, o());
    xfer(&tm, g3, &p3, g2b, &p4, o());
    xfer(&tm, g2b, &p4, g1b, &p5, o());
    xfer(&tm, g1b, &p5, out, &p6, o());
    let out_l = tm.layout(out).unwrap();
    for b in 0..n {
        assert_eq!(
            checksum(&out_l, p6[b]),
            sums[b],
            "block {b} changed on the round trip"
        );
    }
}

#[test]
fn gpu_layerwise_onboarding() {
    if !gpu_or_skip("gpu_layerwise_onboarding") {
        return;
    }
    let tm = TransferManager::new().unwrap();
    let (n, layers) = (16, 8);
    let fc = layout(n, layers, 16, 128, FC);
    let lso = layout(n, layers, 16, 128, LS_OUTER); // vLLM-style per-layer K/V tensors
    let g2 = PhysicalLayout::allocate_host(fc, PinPolicy::TryPin).unwrap();
    fill_random(&g2, 42);
    let g2 = tm.register_layout(g2).unwrap();
    let g1 = tm
        .register_layout(PhysicalLayout::allocate_device(lso, 0).unwrap())
        .unwrap();
    let back = tm
        .register_layout(PhysicalLayout::allocate_host(fc, PinPolicy::TryPin).unwrap())
        .unwrap();
    let src: Vec<usize> = (0..n).collect();
    let dst = permutation(n, 9);
    // First only layers 0..2: the rest of G1 must stay untouched (zero).
    xfer(&tm, g2, &src, g1, &dst, TransferOptions::layers(0..2));
    xfer(&tm, g1, &dst, back, &src, TransferOptions::default());
    let (g2l, backl) = (tm.layout(g2).unwrap(), tm.layout(back).unwrap());
    for b in 0..n {
        assert_eq!(block_bytes(&backl, b, 0..2), block_bytes(&g2l, b, 0..2));
        assert!(block_bytes(&backl, b, 2..layers).iter().all(|x| *x == 0));
    }
    // Then every remaining layer as its own transfer, all submitted before any is awaited.
    // GPU transfers reach the (single) H2D stream inside `execute_transfer`, so layers
    // complete in submission order: once the last layer resolved, every earlier one has too
    // (give the event thread a moment to finish delivering the same polling pass).
    let mut pending: Vec<_> = (2..layers)
        .map(|l| {
            // SAFETY: test-owned layouts; nothing outside the manager reads or writes their blocks while the transfer runs.
            unsafe { tm.execute_transfer(g2, &src, g1, &dst, TransferOptions::layers(l..l + 1)) }
                .unwrap()
        })
        .collect();
    let last = pending.pop().unwrap().wait();
    assert!(last.is_complete_success(), "last layer failed");
    for (i, mut c) in pending.into_iter().enumerate() {
        use futures::FutureExt;
        let mut got = (&mut c).now_or_never();
        if got.is_none() {
            std::thread::sleep(std::time::Duration::from_millis(50));
            got = (&mut c).now_or_never();
        }
        let o = got.unwrap_or_else(|| panic!("layer {} not complete after a later layer", i + 2));
        assert!(o.is_complete_success(), "layer {} failed", i + 2);
    }
    xfer(&tm, g1, &dst, back, &src, TransferOptions::default());
    for b in 0..n {
        assert_eq!(checksum(&backl, b), checksum(&g2l, b), "block {b}");
    }
}

#[test]
fn gpu_many_small_scattered_blocks() {
    if !gpu_or_skip("gpu_many_small_scattered_blocks") {
        return;
    }
    let tm = TransferManager::new().unwrap();
    let n = 1024;
    let lsb = layout(n, 8, 4, 64, LS_BLOCK); // 512 B regions, 1 KiB per (block, layer)
    let fc = layout(n, 8, 4, 64, FC);
    let src = PhysicalLayout::allocate_host(fc, PinPolicy::TryPin).unwrap();
    fill_random(&src, 7);
    let src = tm.register_layout(src).unwrap();
    let g1 = tm
        .register_layout(PhysicalLayout::allocate_device(lsb, 0).unwrap())
        .unwrap();
    let g2 = tm
        .register_layout(PhysicalLayout::allocate_host(fc, PinPolicy::TryPin).unwrap())
        .unwrap();
    let count = 700;
    let s: Vec<usize> = permutation(n, 11)[..count].to_vec();
    let d: Vec<usize> = permutation(n, 12)[..count].to_vec();
    let e: Vec<usize> = permutation(n, 13)[..count].to_vec();
    let before = crate::transfer::cuda::copy_stats();
    xfer(&tm, src, &s, g1, &d, TransferOptions::default());
    xfer(&tm, g1, &d, g2, &e, TransferOptions::default());
    let after = crate::transfer::cuda::copy_stats();
    let (sl, gl) = (tm.layout(src).unwrap(), tm.layout(g2).unwrap());
    for i in 0..count {
        assert_eq!(checksum(&gl, e[i]), checksum(&sl, s[i]), "block {}", s[i]);
    }
    let (pieces, calls) = (after.1 - before.1, after.2 - before.2);
    eprintln!(
        "scattered: {count} blocks × 8 layers, 2 transfers: {pieces} pieces in {calls} driver calls (batch API: {})",
        crate::transfer::cuda::copy::batch_api()
    );
    if crate::transfer::cuda::copy::batch_api() != "none" {
        assert!(calls <= 2 * pieces.div_ceil(crate::transfer::cuda::copy::MAX_BATCH as u64));
    }
}

#[test]
fn gpu_event_precondition() {
    if !gpu_or_skip("gpu_event_precondition") {
        return;
    }
    let dev = CudaDevice::get(0).unwrap();
    let len = 256 << 20;
    let a = super::CudaDeviceMemory::new(len, 0).unwrap();
    let b = super::CudaDeviceMemory::new(len, 0).unwrap();
    use crate::storage::DeviceMemory;
    dev.bind().unwrap();
    let stream = dev.stream(Direction::DeviceToDevice);
    let rt = tokio::runtime::Runtime::new().unwrap();
    for _ in 0..3 {
        // SAFETY: both allocations live past the stream's completion (awaited below).
        unsafe {
            cudarc::driver::sys::cuMemcpyAsync(b.device_addr(), a.device_addr(), len, stream)
                .result()
                .unwrap();
        }
        // SAFETY: a live stream of device 0's primary context.
        let pre = unsafe { CudaEventPrecondition::record(stream, 0) }.unwrap();
        rt.block_on(pre).unwrap();
        // The stream has drained: its work is complete.
        // SAFETY: live stream.
        let status = unsafe { cudarc::driver::sys::cuStreamQuery(stream) };
        assert!(status == cudarc::driver::sys::CUresult::CUDA_SUCCESS);
    }
}

/// An engine's device tensors (here `cuMemAlloc`ed memory standing for vLLM's `kv_caches`,
/// shaped `(2, blocks, tokens, heads, head)`) adopted, offloaded to G2 and onboarded back
/// into other blocks with checksums; the driver's refusals of a host pointer, another
/// device's ordinal and a range past its allocation; the owner kept until the layout is gone.
#[test]
fn gpu_adopted_tensors() {
    if !gpu_or_skip("gpu_adopted_tensors") {
        return;
    }
    use crate::adopt::{KvDims, adopt_kv_tensors};
    use crate::storage::{DeviceMemory, Owner, TensorDesc, TensorDevice};
    let (nb, t, h, d, layers) = (16usize, 16usize, 8usize, 128usize, 4usize);
    let page = t * h * d * 2;
    let engine: Vec<Arc<super::CudaDeviceMemory>> = (0..layers)
        .map(|_| Arc::new(super::CudaDeviceMemory::new(2 * nb * page, 0).unwrap()))
        .collect();
    let desc =
        |addr: u64| TensorDesc::contiguous(addr, &[2, nb, t, h, d], 2, TensorDevice::Cuda(0));
    let descs: Vec<TensorDesc> = engine.iter().map(|m| desc(m.device_addr())).collect();
    let weak = Arc::downgrade(&engine[0]);
    let owner: Owner = Arc::new(engine.clone());
    // SAFETY: the allocations live as long as `owner`; nothing else touches them.
    let g1 = unsafe { adopt_kv_tensors(&descs, KvDims::FLASH_ATTN, owner) }.unwrap();
    assert_eq!(g1.layout().kind(), LS_OUTER);
    let tm = TransferManager::new().unwrap();
    let fc = BlockLayout::builder()
        .config(crate::layout::LayoutConfig {
            num_blocks: nb,
            ..*g1.layout().config()
        })
        .fully_contiguous()
        .build()
        .unwrap();
    let input = PhysicalLayout::allocate_host(fc, PinPolicy::TryPin).unwrap();
    fill_random(&input, 0xada9);
    let sums: Vec<u64> = (0..nb).map(|b| checksum(&input, b)).collect();
    let h_in = tm.register_layout(input).unwrap();
    let g1h = tm.register_layout(g1).unwrap();
    let g2 = tm
        .register_layout(PhysicalLayout::allocate_host(fc, PinPolicy::TryPin).unwrap())
        .unwrap();
    let out = tm
        .register_layout(PhysicalLayout::allocate_host(fc, PinPolicy::TryPin).unwrap())
        .unwrap();
    let all: Vec<usize> = (0..nb).collect();
    let (p1, p2, p3) = (
        permutation(nb, 11),
        permutation(nb, 12),
        permutation(nb, 13),
    );
    let o = TransferOptions::default;
    xfer(&tm, h_in, &all, g1h, &p1, o()); // the engine's blocks written
    xfer(&tm, g1h, &p1, g2, &p2, o()); // offloaded from the adopted tensors
    xfer(&tm, g2, &p2, g1h, &p3, o()); // onboarded into other blocks
    xfer(&tm, g1h, &p3, out, &all, o());
    let out_l = tm.layout(out).unwrap();
    for (b, sum) in sums.iter().enumerate() {
        assert_eq!(checksum(&out_l, b), *sum, "block {b} changed on the way");
    }

    // The driver refuses what is not this device's memory, or leaves the allocation.
    let host = HostStorage::new(2 * nb * page, PinPolicy::Unpinned).unwrap();
    let refuse = |descs: Vec<TensorDesc>| {
        // SAFETY: refused before anything is touched.
        unsafe { adopt_kv_tensors(&descs, KvDims::FLASH_ATTN, Arc::new(())) }.unwrap_err()
    };
    let e = refuse(vec![desc(host.as_ptr() as u64)]);
    eprintln!("host pointer refused: {e}");
    let mut wrong = desc(engine[0].device_addr());
    wrong.device = TensorDevice::Cuda(1);
    let e = refuse(vec![wrong]);
    eprintln!("other ordinal refused: {e}");
    let e = refuse(vec![desc(engine[0].device_addr() + page as u64)]);
    assert!(e.to_string().contains("leaves its allocation"), "{e}");

    // The owner (and so the engine's memory) is held until the layout is gone.
    drop(engine);
    assert!(weak.upgrade().is_some(), "held while registered");
    tm.unregister_layout(g1h).unwrap();
    drop(tm);
    assert!(weak.upgrade().is_none(), "released with the layout");
}

/// Range copies (the canonical worker's strided `NHD` fragments) to and from the GPU are
/// batched and land exactly where the ordered host path puts them: host → device and
/// device → host, each against the same copies run host → host; copies whose destinations
/// overlap keep "the later wins" (the ordered path).
#[test]
fn gpu_range_copies_batched_match_the_host_path() {
    if !gpu_or_skip("gpu_range_copies_batched_match_the_host_path") {
        return;
    }
    use crate::transfer::RangeCopy;
    let n = 8;
    let l = layout(n, 4, 16, 128, LS_OUTER); // 4 KiB regions, 64 KiB blocks
    let host = |fill: Option<u64>| {
        let h = PhysicalLayout::allocate_host(l, PinPolicy::TryPin).unwrap();
        if let Some(seed) = fill {
            fill_random(&h, seed);
        }
        h
    };
    let tm = TransferManager::new().unwrap();
    let src = tm.register_layout(host(Some(0xf00d))).unwrap();
    let zero = tm.register_layout(host(None)).unwrap();
    let gpu = tm
        .register_layout(PhysicalLayout::allocate_device(l, 0).unwrap())
        .unwrap();
    let all: Vec<usize> = (0..n).collect();
    let block = l.config().block_bytes();
    // Token-major fragments: 256 bytes of each of 24 1 KiB token rows, gathered densely, from
    // block b to block (b + 3) % n; and a tail copy per block (32 KiB blocks).
    let copies: Vec<RangeCopy> = (0..n)
        .flat_map(|b| {
            [
                RangeCopy {
                    src_block: b,
                    src_offset: 512,
                    dst_block: (b + 3) % n,
                    dst_offset: 0,
                    len: 256,
                    count: 24,
                    src_stride: 1024,
                    dst_stride: 256,
                },
                RangeCopy::contiguous((b, block - 8192), ((b + 3) % n, block - 8192), 8192),
            ]
        })
        .collect();
    let run = |s: LayoutHandle, d: LayoutHandle, c: Vec<RangeCopy>| {
        // SAFETY: test-owned layouts; nothing else touches them meanwhile.
        let out = unsafe { tm.execute_copies(s, d, c) }.unwrap().wait();
        assert_eq!(out.failures().count(), 0);
    };
    let sums = |h: LayoutHandle| -> Vec<u64> {
        let lay = tm.layout(h).unwrap();
        (0..n).map(|b| checksum(&lay, b)).collect()
    };
    // Reference: the host path.
    let want = tm.register_layout(host(None)).unwrap();
    run(src, want, copies.clone());
    // Host → device (the device zeroed first), read back whole.
    xfer(&tm, zero, &all, gpu, &all, TransferOptions::default());
    let before = crate::transfer::cuda::copy_stats();
    run(src, gpu, copies.clone());
    let after = crate::transfer::cuda::copy_stats();
    eprintln!(
        "range copies: {} fragments -> {} pieces in {} driver calls",
        n * 25,
        after.1 - before.1,
        after.2 - before.2
    );
    assert_eq!(after.0 - before.0, 1, "one batched transfer");
    let back = tm.register_layout(host(None)).unwrap();
    xfer(&tm, gpu, &all, back, &all, TransferOptions::default());
    assert_eq!(sums(back), sums(want), "host -> device fragments");
    // Device → host: the device holds the source's bytes, fragments gathered to the host.
    xfer(&tm, src, &all, gpu, &all, TransferOptions::default());
    let out = tm.register_layout(host(None)).unwrap();
    run(gpu, out, copies.clone());
    assert_eq!(sums(out), sums(want), "device -> host fragments");
    // Overlapping destinations: the later copy wins, on the GPU as on the host.
    let overlap = vec![
        RangeCopy::contiguous((0, 0), (1, 0), 4096),
        RangeCopy::contiguous((2, 1024), (1, 1024), 1024),
    ];
    let want2 = tm.register_layout(host(None)).unwrap();
    run(src, want2, overlap.clone());
    xfer(&tm, zero, &all, gpu, &all, TransferOptions::default());
    run(src, gpu, overlap);
    let back2 = tm.register_layout(host(None)).unwrap();
    xfer(&tm, gpu, &all, back2, &all, TransferOptions::default());
    assert_eq!(sums(back2), sums(want2), "overlapping fragments in order");
}

mod bench;
