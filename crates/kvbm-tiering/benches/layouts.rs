//! Worker store + load through the canonical (TP-independent) chunk layout against the direct
//! (per-rank) layout, host memory, in the same run: rank 0 of TP=2, 64 blocks × 8 layers of
//! 16 tokens × 8 kv heads × 128 bf16 per K/V half (32 KiB locally, 64 KiB canonical), 2 blocks
//! per chunk, in both page orders vLLM uses ([`PageOrder`]): token-major `NHD` (the canonical
//! layout moves 1 KiB fragments, one per token) and head-major `HND` (one 16 KiB fragment per
//! K/V half). Each iteration stores the 64 blocks GPU → CPU and loads them back CPU → GPU
//! through [`PhysicalOffloadingWorker`] (the same bytes either way; the direct layout moves
//! whole pages). Criterion reports each; the end prints one JSON line per order with the
//! medians (interleaved variants, each warmed) and `canonical / direct` throughput (goal
//! ≥ 0.9), and the same two copy patterns run raw (a `copy_nonoverlapping` loop over the same
//! memory, on this thread): the floor each layout's memory access pattern sets, so the
//! worker's overhead and the layout's own cost can be told apart.

use std::sync::Arc;
use std::time::{Duration, Instant};

use criterion::Criterion;
use kvbm_physical::{
    BlockDim, BlockLayout, CanonicalPageMapping, LayoutHandle, PageOrder, PhysicalLayout,
    PinPolicy, TransferManager,
};
use kvbm_tiering::*;

/// Blocks per rig: 64 (16 MiB of local pages: the working set fits this machine's L3, so the
/// canonical layout's twice-as-large CPU pages cost cache room) and 1024 (256 MiB: far out of
/// cache, as a deployment's KV is; DRAM bandwidth alone).
const SIZES: [usize; 2] = [64, 1024];
const LAYERS: usize = 8;
const BPC: usize = 2;
const HEAD_BYTES: usize = 128 * 2;

fn layout(tm: &TransferManager, blocks: usize, row: usize) -> LayoutHandle {
    let l = BlockLayout::builder()
        .num_blocks(blocks)
        .num_layers(LAYERS)
        .outer_dim(1)
        .page_size(1)
        .inner_dim(row)
        .dtype_bytes(1)
        .layer_separate(BlockDim::BlockContiguous)
        .build()
        .unwrap();
    tm.register_layout(PhysicalLayout::allocate_host(l, PinPolicy::TryPin).unwrap())
        .unwrap()
}

/// A worker of rank 0 of TP=2 over fresh memory, canonical or direct, and its memory.
struct Rig {
    worker: PhysicalOffloadingWorker,
    tm: Arc<TransferManager>,
    gpu: LayoutHandle,
    cpu: LayoutHandle,
    map: CanonicalPageMapping,
    canonical: bool,
    blocks: usize,
}

fn worker(tm: &Arc<TransferManager>, canonical: bool, order: PageOrder, blocks: usize) -> Rig {
    let m = CanonicalPageMapping::tensor_parallel_in(order, 2, 16, 8, HEAD_BYTES, 2, 0).unwrap();
    let local = m.local_page_size_bytes;
    let gpu = layout(tm, blocks, local);
    let sub = if canonical {
        m.canonical_page_size_bytes
    } else {
        local
    };
    let cpu = layout(tm, blocks / BPC, sub * BPC);
    let refs = (0..LAYERS)
        .map(|t| CanonicalKVCacheRef {
            tensor_idx: t,
            page_size_bytes: local,
            mapping: Some(m.clone()),
        })
        .collect();
    let l = if canonical {
        ChunkLayout::Canonical
    } else {
        ChunkLayout::Direct
    };
    let worker = PhysicalOffloadingWorker::builder(tm.clone(), gpu, cpu)
        .blocks_per_chunk(BPC)
        .layout(l)
        .group(refs)
        .build()
        .unwrap();
    Rig {
        worker,
        tm: tm.clone(),
        gpu,
        cpu,
        map: m,
        canonical,
        blocks,
    }
}

/// The worker's round as a raw `copy_nonoverlapping` loop over the same memory and fragments.
fn raw_round(r: &Rig) {
    let (g, c) = (r.tm.layout(r.gpu).unwrap(), r.tm.layout(r.cpu).unwrap());
    let sub = if r.canonical {
        r.map.canonical_page_size_bytes
    } else {
        r.map.local_page_size_bytes
    };
    for store in [true, false] {
        for j in 0..r.blocks {
            let gb = r.blocks - 1 - j;
            let (chunk, s) = (j / BPC, j % BPC);
            for t in 0..LAYERS {
                let ga = g.block_addrs(gb, t..t + 1)[0].0;
                let ca = c.block_addrs(chunk, t..t + 1)[0].0 + s * sub;
                let frags: Vec<(usize, usize, usize)> = if r.canonical {
                    r.map
                        .runs
                        .iter()
                        .flat_map(|run| {
                            (0..run.num_fragments).map(move |i| {
                                (
                                    run.local_offset + i * run.local_stride,
                                    run.canonical_offset + i * run.canonical_stride,
                                    run.fragment_size,
                                )
                            })
                        })
                        .collect()
                } else {
                    vec![(0, 0, r.map.local_page_size_bytes)]
                };
                for (lo, co, len) in frags {
                    let (src, dst) = if store {
                        (ga + lo, ca + co)
                    } else {
                        (ca + co, ga + lo)
                    };
                    // SAFETY: both ranges lie inside rows of the rig's live host layouts, which
                    // no job touches while the bench runs this loop.
                    unsafe { std::ptr::copy_nonoverlapping(src as *const u8, dst as *mut u8, len) };
                }
            }
        }
    }
}

/// One store of all blocks and one load back; returns the bytes moved.
fn round(r: &mut Rig, job: &mut u64) -> u64 {
    let (w, blocks) = (&mut r.worker, r.blocks);
    let ids: Vec<i32> = (0..blocks as i32).rev().collect();
    let gpu = GpuLoadStoreSpec::new(ids, vec![blocks], vec![0]).unwrap();
    let cpu = LoadStoreSpec::Cpu(CpuLoadStoreSpec {
        chunk_ids: (0..(blocks / BPC) as i32).collect(),
    });
    let mut bytes = 0;
    for store in [true, false] {
        *job += 1;
        let ok = if store {
            w.submit_store(*job, &gpu, &cpu)
        } else {
            w.submit_load(*job, &cpu, &gpu)
        };
        assert!(ok);
        w.wait(&[*job]);
        let r = w.get_finished().pop().unwrap();
        assert!(r.success);
        bytes += r.transfer_size.unwrap();
    }
    bytes
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[v.len() / 2]
}

fn main() {
    let tm = Arc::new(TransferManager::new().unwrap());
    let mut c = Criterion::default()
        .configure_from_args()
        .measurement_time(Duration::from_secs(3))
        .warm_up_time(Duration::from_secs(1));
    let mut job = 0u64;
    for blocks in SIZES {
        for order in [PageOrder::Nhd, PageOrder::Hnd] {
            compare(&tm, &mut c, &mut job, order, blocks);
        }
    }
}

/// Criterion's figures for one page order and size, then its JSON line.
fn compare(
    tm: &Arc<TransferManager>,
    c: &mut Criterion,
    job: &mut u64,
    order: PageOrder,
    blocks: usize,
) {
    let mut direct = worker(tm, false, order, blocks);
    let mut canon = worker(tm, true, order, blocks);
    let name = format!("{order:?}").to_uppercase();
    let mut g = c.benchmark_group(format!("worker_store_load_{name}_{blocks}"));
    g.bench_function("direct", |b| b.iter(|| round(&mut direct, job)));
    g.bench_function("canonical", |b| b.iter(|| round(&mut canon, job)));
    g.finish();

    // Alternating rounds in one process for the ratio (a shared machine: medians).
    let (mut td, mut tc, mut rd, mut rc) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let mut bytes = 0;
    let time = |f: &mut dyn FnMut()| {
        let t = Instant::now();
        f();
        t.elapsed().as_secs_f64()
    };
    // Each variant: one warm-up round, then the mean of 3 (its buffers back in cache as far
    // as they fit), variants interleaved; medians over the repetitions.
    let warm3 = |f: &mut dyn FnMut()| {
        f();
        time(&mut || (0..3).for_each(|_| f())) / 3.0
    };
    for _ in 0..21 {
        td.push(warm3(&mut || bytes = round(&mut direct, job)));
        tc.push(warm3(&mut || assert_eq!(round(&mut canon, job), bytes)));
        rd.push(warm3(&mut || raw_round(&direct)));
        rc.push(warm3(&mut || raw_round(&canon)));
    }
    let (d, cn, rd, rc) = (median(td), median(tc), median(rd), median(rc));
    let gib = |s: f64| bytes as f64 / s / (1u64 << 30) as f64;
    let fragment = canon.map.runs[0].fragment_size;
    println!(
        "{{\"bench\":\"worker_layouts\",\"page_order\":\"{name}\",\"canonical_fragment_bytes\":{fragment},\"blocks\":{blocks},\"layers\":{LAYERS},\"bytes_per_round\":{bytes},\"direct_ms\":{:.3},\"canonical_ms\":{:.3},\"direct_gib_s\":{:.2},\"canonical_gib_s\":{:.2},\"ratio\":{:.3},\"goal\":0.9,\"raw_direct_ms\":{:.3},\"raw_canonical_ms\":{:.3},\"raw_ratio\":{:.3},\"canonical_vs_raw\":{:.3}}}",
        d * 1e3,
        cn * 1e3,
        gib(d),
        gib(cn),
        d / cn,
        rd * 1e3,
        rc * 1e3,
        rd / rc,
        rc / cn
    );
}
