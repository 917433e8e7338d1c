//! Worker tests against reference models written here: multi-group direct layouts with
//! `blocks_per_chunk` and unaligned heads (proptest), the canonical layout across TP sizes,
//! writer rotation for replicated bytes, hybrid models (full + sliding-window; attention +
//! Mamba-style state), and the builder's refusals.

use std::sync::Arc;

use kvbm_physical::{
    BlockDim, BlockLayout, CanonicalPageMapping, LayoutHandle, PageOrder, PhysicalLayout,
    PinPolicy, TransferManager,
};
use proptest::prelude::*;

use super::*;
use crate::types::{CanonicalKVCaches, CpuLoadStoreSpec, GpuLoadStoreSpec, LoadStoreSpec};

/// A host layout of `tensors` rows of `row` bytes per block (vLLM's per-tensor
/// `(num_blocks, page)` shape: layer-separate, block-contiguous).
fn layout(tm: &TransferManager, blocks: usize, tensors: usize, row: usize) -> LayoutHandle {
    let l = BlockLayout::builder()
        .num_blocks(blocks)
        .num_layers(tensors)
        .outer_dim(1)
        .page_size(1)
        .inner_dim(row)
        .dtype_bytes(1)
        .layer_separate(BlockDim::BlockContiguous)
        .build()
        .unwrap();
    tm.register_layout(PhysicalLayout::allocate_host(l, PinPolicy::Unpinned).unwrap())
        .unwrap()
}

/// Row `t` of block `b` of a registered host layout, as a mutable byte slice.
///
/// Tests only: called while no job of the test runs on the layout.
#[allow(clippy::mut_from_ref)]
fn row(tm: &TransferManager, h: LayoutHandle, b: usize, t: usize) -> &mut [u8] {
    let l = tm.layout(h).unwrap();
    let (addr, len) = l.block_addrs(b, t..t + 1)[0];
    // SAFETY: a row of a live host layout owned by `tm` (kept registered by the test); no
    // transfer runs while the test holds the slice.
    unsafe { std::slice::from_raw_parts_mut(addr as *mut u8, len) }
}

/// Every byte of a layout, `[block][tensor][row]` flattened.
fn snapshot(tm: &TransferManager, h: LayoutHandle) -> Vec<u8> {
    let c = *tm.layout(h).unwrap().layout().config();
    let mut out = Vec::new();
    for b in 0..c.num_blocks {
        for t in 0..c.num_layers {
            out.extend_from_slice(row(tm, h, b, t));
        }
    }
    out
}

fn fill(tm: &TransferManager, h: LayoutHandle, f: impl Fn(usize, usize, usize) -> u8) {
    let c = *tm.layout(h).unwrap().layout().config();
    for b in 0..c.num_blocks {
        for t in 0..c.num_layers {
            for (i, x) in row(tm, h, b, t).iter_mut().enumerate() {
                *x = f(b, t, i);
            }
        }
    }
}

fn cpu(ids: &[usize]) -> LoadStoreSpec {
    LoadStoreSpec::Cpu(CpuLoadStoreSpec {
        chunk_ids: ids.iter().map(|&i| i as i32).collect(),
    })
}

fn gpu_spec(ids: &[usize], sizes: &[usize], indices: &[usize]) -> GpuLoadStoreSpec {
    GpuLoadStoreSpec::new(
        ids.iter().map(|&i| i as i32).collect(),
        sizes.to_vec(),
        indices.to_vec(),
    )
    .unwrap()
}

fn run_ok(w: &mut PhysicalOffloadingWorker, job: u64) -> WorkerJobResult {
    w.wait(&[job]);
    let done = w.get_finished();
    assert_eq!(done.len(), 1);
    assert!(done[0].success, "job {job} failed");
    done[0].clone()
}

fn direct_ref(t: usize, page: usize) -> CanonicalKVCacheRef {
    CanonicalKVCacheRef {
        tensor_idx: t,
        page_size_bytes: page,
        mapping: None,
    }
}

/// A generated group: refs `(tensor, page)`, blocks in the job, first logical block index.
type GroupCase = (Vec<(usize, usize)>, usize, usize);

/// One generated direct-layout case.
#[derive(Debug, Clone)]
struct Case {
    tensors: usize,
    gpu_row: usize,
    bpc: usize,
    groups: Vec<GroupCase>,
    seed: u64,
}

fn case() -> impl Strategy<Value = Case> {
    (1usize..=3, 4usize..=24, 1usize..=4, any::<u64>()).prop_flat_map(
        |(tensors, gpu_row, bpc, seed)| {
            let group = (
                prop::collection::vec((0..tensors, 1..=gpu_row), 1..=2),
                0usize..=5,
                0usize..=9,
            );
            prop::collection::vec(group, 1..=3).prop_map(move |groups| Case {
                tensors,
                gpu_row,
                bpc,
                groups,
                seed,
            })
        },
    )
}

/// A deterministic shuffle of `0..n` (the ids a scheduler would hand out).
fn shuffled(n: usize, seed: u64) -> Vec<usize> {
    let mut v: Vec<usize> = (0..n).collect();
    let mut s = seed | 1;
    for i in (1..n).rev() {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        v.swap(i, (s % (i as u64 + 1)) as usize);
    }
    v
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    /// Store GPU → CPU then load CPU → fresh GPU memory gives back exactly each group's pages
    /// (reference model: per group, logical block `skip + j` lands in chunk `(skip+j)/bpc`,
    /// sub-block `(skip+j)%bpc`), touching no other byte; specs with a chunk id too many or
    /// too few, or a destination named twice, are refused before anything moves.
    #[test]
    fn groups_chunks_and_unaligned_heads_round_trip(c in case()) {
        let tm = Arc::new(TransferManager::new().unwrap());
        let sizes: Vec<usize> = c.groups.iter().map(|g| g.1).collect();
        let indices: Vec<usize> = c.groups.iter().map(|g| g.2).collect();
        let n_blocks: usize = sizes.iter().sum();
        let n_chunks: usize = c.groups.iter().map(|(_, n, b)| if *n == 0 { 0 } else { (n + b % c.bpc).div_ceil(c.bpc) }).sum();
        let gpu_blocks = n_blocks + 3;
        let cpu_chunks = n_chunks + 2;
        let cpu_row = c.gpu_row * c.bpc;
        let gpu_a = layout(&tm, gpu_blocks, c.tensors, c.gpu_row);
        let gpu_b = layout(&tm, gpu_blocks, c.tensors, c.gpu_row);
        let cpu_h = layout(&tm, cpu_chunks, c.tensors, cpu_row);
        let build = |g: LayoutHandle| {
            let mut b = PhysicalOffloadingWorker::builder(tm.clone(), g, cpu_h).blocks_per_chunk(c.bpc);
            for (refs, _, _) in &c.groups {
                b = b.group(refs.iter().map(|&(t, p)| direct_ref(t, p)).collect());
            }
            b.build().unwrap()
        };
        let (mut wa, mut wb) = (build(gpu_a), build(gpu_b));
        fill(&tm, gpu_a, |b, t, i| (b * 31 + t * 7 + i + 1) as u8 | 1);
        fill(&tm, cpu_h, |_, _, _| 0);
        fill(&tm, gpu_b, |_, _, _| 0xEE);
        let store_ids = shuffled(gpu_blocks, c.seed)[..n_blocks].to_vec();
        let load_ids = shuffled(gpu_blocks, c.seed.rotate_left(17))[..n_blocks].to_vec();
        let chunks = shuffled(cpu_chunks, c.seed.rotate_left(33))[..n_chunks].to_vec();

        // Refused specs move nothing.
        let before = snapshot(&tm, cpu_h);
        let mut extra = chunks.clone();
        extra.push(shuffled(cpu_chunks, c.seed.rotate_left(33))[n_chunks]);
        prop_assert!(!wa.submit_store(1, &gpu_spec(&store_ids, &sizes, &indices), &cpu(&extra)));
        if n_chunks > 0 {
            prop_assert!(!wa.submit_store(2, &gpu_spec(&store_ids, &sizes, &indices), &cpu(&chunks[1..])));
        }
        if n_chunks > 1 {
            let mut twice = chunks.clone();
            twice[1] = twice[0];
            prop_assert!(!wa.submit_store(5, &gpu_spec(&store_ids, &sizes, &indices), &cpu(&twice)));
        }
        prop_assert_eq!(&snapshot(&tm, cpu_h), &before);

        prop_assert!(wa.submit_store(3, &gpu_spec(&store_ids, &sizes, &indices), &cpu(&chunks)));
        let stored = run_ok(&mut wa, 3);
        // Reference model of the CPU side and of the fresh GPU side after the load.
        let mut want_cpu = vec![vec![vec![0u8; cpu_row]; c.tensors]; cpu_chunks];
        let mut want_gpu = vec![vec![vec![0xEEu8; c.gpu_row]; c.tensors]; gpu_blocks];
        let (mut k, mut ch, mut bytes) = (0, 0, 0u64);
        for (refs, n, b) in &c.groups {
            let skip = b % c.bpc;
            for j in 0..*n {
                let (src, dst) = (store_ids[k + j], load_ids[k + j]);
                let (chunk, sub) = (chunks[ch + (skip + j) / c.bpc], (skip + j) % c.bpc);
                for &(t, p) in refs {
                    let page = row(&tm, gpu_a, src, t)[..p].to_vec();
                    want_cpu[chunk][t][sub * c.gpu_row..sub * c.gpu_row + p].copy_from_slice(&page);
                    want_gpu[dst][t][..p].copy_from_slice(&page);
                    bytes += p as u64;
                }
            }
            k += n;
            if *n > 0 { ch += (n + skip).div_ceil(c.bpc); }
        }
        prop_assert_eq!(stored.transfer_size, Some(bytes));
        prop_assert_eq!(snapshot(&tm, cpu_h), want_cpu.concat().concat());

        if n_blocks > 1 {
            let mut twice = load_ids.clone();
            twice[1] = twice[0];
            prop_assert!(!wb.submit_load(6, &cpu(&chunks), &gpu_spec(&twice, &sizes, &indices)));
            prop_assert!(snapshot(&tm, gpu_b).iter().all(|&b| b == 0xEE));
        }
        prop_assert!(wb.submit_load(4, &cpu(&chunks), &gpu_spec(&load_ids, &sizes, &indices)));
        let loaded = run_ok(&mut wb, 4);
        prop_assert_eq!(loaded.transfer_size, Some(bytes));
        prop_assert_eq!(snapshot(&tm, gpu_b), want_gpu.concat().concat());
    }
}

/// Canonical-layout geometry of the TP tests: pages `[outer 2, tokens 4, heads, 4 bytes]`.
const OUTER: usize = 2;
const TOKENS: usize = 4;
const HEAD_BYTES: usize = 4;
const TENSORS: usize = 2;
const BPC: usize = 2;
/// GPU rows are padded past the local page (vLLM pads pages).
const PAD: usize = 8;

fn tp_map(order: PageOrder, heads: usize, tp: usize, rank: usize) -> CanonicalPageMapping {
    CanonicalPageMapping::tensor_parallel_in(order, OUTER, TOKENS, heads, HEAD_BYTES, tp, rank)
        .unwrap()
}

/// A rank of a TP config: its GPU layout and worker over the shared canonical CPU layout.
struct Rank {
    gpu: LayoutHandle,
    map: CanonicalPageMapping,
    worker: PhysicalOffloadingWorker,
}

fn rank(
    tm: &Arc<TransferManager>,
    cpu_h: LayoutHandle,
    order: PageOrder,
    heads: usize,
    tp: usize,
    r: usize,
    blocks: usize,
) -> Rank {
    let map = tp_map(order, heads, tp, r);
    let gpu = layout(tm, blocks, TENSORS, map.local_page_size_bytes + PAD);
    let refs = (0..TENSORS)
        .map(|t| CanonicalKVCacheRef {
            tensor_idx: t,
            page_size_bytes: map.local_page_size_bytes,
            mapping: Some(map.clone()),
        })
        .collect();
    let worker = PhysicalOffloadingWorker::builder(tm.clone(), gpu, cpu_h)
        .blocks_per_chunk(BPC)
        .layout(ChunkLayout::Canonical)
        .group(refs)
        .build()
        .unwrap();
    Rank { gpu, map, worker }
}

/// The full, unsharded page of tensor `t` of logical block `k` (never 0xAA, the poison).
fn full_page(heads: usize, t: usize, k: usize) -> Vec<u8> {
    (0..OUTER * TOKENS * heads * HEAD_BYTES)
        .map(|i| ((i * 13 + t * 101 + k * 57) % 170) as u8)
        .collect()
}

/// The job of the canonical tests: 5 logical blocks from index 3 (unaligned: skip 1 of 2),
/// so 3 chunks; GPU blocks 4,0,3,1,2 (a request's scattered blocks).
const FIRST: usize = 3;
const GPU_IDS: [usize; 5] = [4, 0, 3, 1, 2];
const CHUNKS: [usize; 3] = [5, 1, 3];

/// Puts each rank's share of the full pages into its GPU blocks (what its model computed).
fn compute(tm: &TransferManager, r: &Rank, heads: usize) {
    fill(tm, r.gpu, |_, _, _| 0x55);
    for (j, &b) in GPU_IDS.iter().enumerate() {
        for t in 0..TENSORS {
            let local = &mut row(tm, r.gpu, b, t)[..r.map.local_page_size_bytes];
            r.map.from_canonical(&full_page(heads, t, FIRST + j), local);
        }
    }
}

/// Loads the job into a fresh rank of `tp` and checks every byte of its GPU layout: its share
/// of the full pages in the named blocks, the padding and every other block untouched.
fn load_and_check(
    tm: &Arc<TransferManager>,
    cpu_h: LayoutHandle,
    order: PageOrder,
    heads: usize,
    tp: usize,
) {
    for r in 0..tp {
        let mut x = rank(tm, cpu_h, order, heads, tp, r, 6);
        fill(tm, x.gpu, |_, _, _| 0x33);
        let ids = [2, 5, 0, 4, 1];
        assert!(
            x.worker
                .submit_load(10, &cpu(&CHUNKS), &gpu_spec(&ids, &[5], &[FIRST]))
        );
        let done = run_ok(&mut x.worker, 10);
        let local = x.map.local_page_size_bytes;
        assert_eq!(done.transfer_size, Some((5 * TENSORS * local) as u64));
        for b in 0..6 {
            for t in 0..TENSORS {
                let got = row(tm, x.gpu, b, t).to_vec();
                let mut want = vec![0x33u8; local + PAD];
                if let Some(j) = ids.iter().position(|&i| i == b) {
                    x.map
                        .from_canonical(&full_page(heads, t, FIRST + j), &mut want[..local]);
                }
                assert_eq!(got, want, "{order:?} tp {tp} rank {r} block {b} tensor {t}");
            }
        }
    }
}

/// The canonical CPU layout: `TENSORS` rows of `BPC` canonical pages per chunk.
fn canonical_cpu(tm: &TransferManager, heads: usize) -> LayoutHandle {
    layout(tm, 6, TENSORS, OUTER * TOKENS * heads * HEAD_BYTES * BPC)
}

/// Where logical block `FIRST + j` of tensor `t` lives in the CPU layout.
fn canonical_slot(j: usize, page: usize) -> (usize, std::ops::Range<usize>) {
    let logical = FIRST % BPC + j;
    let sub = logical % BPC;
    (CHUNKS[logical / BPC], sub * page..(sub + 1) * page)
}

#[test]
fn canonical_layout_is_tp_independent() {
    for order in [PageOrder::Nhd, PageOrder::Hnd] {
        canonical_layout_is_tp_independent_in(order);
    }
}

/// Token-major pages move one small fragment per token, head-major ones one large fragment
/// per K/V half: the worker follows the mapping's runs either way.
fn canonical_layout_is_tp_independent_in(order: PageOrder) {
    let heads = 4;
    let tm = Arc::new(TransferManager::new().unwrap());
    let cpu_h = canonical_cpu(&tm, heads);
    fill(&tm, cpu_h, |_, _, _| 0xAA);
    // TP=2 ranks each store their half into the one canonical buffer…
    for r in 0..2 {
        let mut x = rank(&tm, cpu_h, order, heads, 2, r, 5);
        compute(&tm, &x, heads);
        assert!(
            x.worker
                .submit_store(1, &gpu_spec(&GPU_IDS, &[5], &[FIRST]), &cpu(&CHUNKS))
        );
        run_ok(&mut x.worker, 1);
    }
    // …which then holds the full pages (and poison in the skipped sub-block)…
    let page = OUTER * TOKENS * heads * HEAD_BYTES;
    for j in 0..5 {
        for t in 0..TENSORS {
            let (chunk, range) = canonical_slot(j, page);
            assert_eq!(
                &row(&tm, cpu_h, chunk, t)[range],
                &full_page(heads, t, FIRST + j)[..]
            );
        }
    }
    assert!(
        row(&tm, cpu_h, CHUNKS[0], 0)[..page]
            .iter()
            .all(|&b| b == 0xAA)
    );
    // …and TP=1 and TP=4 ranks each load exactly what their layout needs.
    load_and_check(&tm, cpu_h, order, heads, 1);
    load_and_check(&tm, cpu_h, order, heads, 4);
    load_and_check(&tm, cpu_h, order, heads, 2);
}

#[test]
fn replicated_bytes_are_written_by_one_rank_each() {
    // 2 KV heads over TP=4: ranks {0,1} hold head 0, ranks {2,3} head 1 (2 writers each).
    let heads = 2;
    let tm = Arc::new(TransferManager::new().unwrap());
    let cpu_h = canonical_cpu(&tm, heads);
    let page = OUTER * TOKENS * heads * HEAD_BYTES;
    let mut writes = vec![vec![vec![0u32; page]; TENSORS]; 5];
    let mut ranks: Vec<Rank> = (0..4)
        .map(|r| rank(&tm, cpu_h, PageOrder::Nhd, heads, 4, r, 5))
        .collect();
    assert!(ranks.iter().all(|r| r.map.num_writers == 2));
    for x in &mut ranks {
        compute(&tm, x, heads);
        // Poison, store this rank alone, count the canonical bytes it wrote.
        fill(&tm, cpu_h, |_, _, _| 0xAA);
        assert!(
            x.worker
                .submit_store(1, &gpu_spec(&GPU_IDS, &[5], &[FIRST]), &cpu(&CHUNKS))
        );
        let done = run_ok(&mut x.worker, 1);
        let mut wrote = 0;
        for (j, w) in writes.iter_mut().enumerate() {
            for (t, w) in w.iter_mut().enumerate() {
                let (chunk, range) = canonical_slot(j, page);
                for (i, &b) in row(&tm, cpu_h, chunk, t)[range].iter().enumerate() {
                    if b != 0xAA {
                        w[i] += 1;
                        wrote += 1;
                    }
                }
            }
        }
        assert_eq!(done.transfer_size, Some(wrote));
    }
    // Every byte of every stored canonical page written by exactly one rank.
    assert!(
        writes.iter().flatten().flatten().all(|&w| w == 1),
        "{writes:?}"
    );
    // All four stores together complete the pages; TP=4 and TP=1 loads read them whole.
    fill(&tm, cpu_h, |_, _, _| 0xAA);
    for x in &mut ranks {
        assert!(
            x.worker
                .submit_store(2, &gpu_spec(&GPU_IDS, &[5], &[FIRST]), &cpu(&CHUNKS))
        );
        run_ok(&mut x.worker, 2);
    }
    load_and_check(&tm, cpu_h, PageOrder::Nhd, heads, 4);
    load_and_check(&tm, cpu_h, PageOrder::Nhd, heads, 1);
}

#[test]
fn hybrid_full_and_sliding_window_groups() {
    // Two tensors shared by both groups (vLLM's hybrid allocator); the sliding-window group's
    // pages are smaller than the padded row. 2 blocks per chunk.
    let tm = Arc::new(TransferManager::new().unwrap());
    let (row_b, full_p, swa_p) = (64, 64, 40);
    let gpu_h = layout(&tm, 10, 2, row_b);
    let cpu_h = layout(&tm, 8, 2, row_b * 2);
    let mut w = PhysicalOffloadingWorker::builder(tm.clone(), gpu_h, cpu_h)
        .blocks_per_chunk(2)
        .group(vec![direct_ref(0, full_p), direct_ref(1, full_p)])
        .group(vec![direct_ref(0, swa_p), direct_ref(1, swa_p)])
        .build()
        .unwrap();
    fill(&tm, gpu_h, |b, t, i| (b * 17 + t * 5 + i) as u8 | 0x80);
    fill(&tm, cpu_h, |_, _, _| 0);
    // A 6-block request: full attention holds all 6 (blocks 0..6 → GPU 0..6); the window
    // holds only logical blocks 3..6 (GPU 7,8,9), unaligned (skip 1).
    let ids = [0, 1, 2, 3, 4, 5, 7, 8, 9];
    let spec = gpu_spec(&ids, &[6, 3], &[0, 3]);
    let chunks = [0, 1, 2, 4, 5];
    assert!(w.submit_store(1, &spec, &cpu(&chunks)));
    assert_eq!(
        run_ok(&mut w, 1).transfer_size,
        Some((6 * 2 * full_p + 3 * 2 * swa_p) as u64)
    );
    let gpu_page = |b: usize, t: usize, p: usize| row(&tm, gpu_h, b, t)[..p].to_vec();
    for t in 0..2 {
        for k in 0..6 {
            let c = row(&tm, cpu_h, chunks[k / 2], t);
            assert_eq!(c[(k % 2) * row_b..][..full_p], gpu_page(k, t, full_p)[..]);
        }
        // Window chunk 4: sub-block 0 (logical 2, not named) untouched, sub-block 1 = logical 3.
        let c4 = row(&tm, cpu_h, 4, t).to_vec();
        assert!(c4[..row_b].iter().all(|&b| b == 0));
        assert_eq!(c4[row_b..row_b + swa_p], gpu_page(7, t, swa_p)[..]);
        assert!(c4[row_b + swa_p..].iter().all(|&b| b == 0));
        let c5 = row(&tm, cpu_h, 5, t).to_vec();
        assert_eq!(c5[..swa_p], gpu_page(8, t, swa_p)[..]);
        assert_eq!(c5[row_b..row_b + swa_p], gpu_page(9, t, swa_p)[..]);
        // Chunks no spec named stay empty.
        for ch in [3, 6, 7] {
            assert!(row(&tm, cpu_h, ch, t).iter().all(|&b| b == 0));
        }
    }
    // Load the window's last two blocks only (logical 4, 5: chunk 5) into fresh GPU blocks 0, 1
    // of a poisoned GPU layout; an empty full-attention group moves nothing.
    let before: Vec<Vec<u8>> = (0..2).map(|t| gpu_page(8, t, swa_p)).collect();
    let after: Vec<Vec<u8>> = (0..2).map(|t| gpu_page(9, t, swa_p)).collect();
    fill(&tm, gpu_h, |_, _, _| 0x11);
    assert!(w.submit_load(2, &cpu(&[5]), &gpu_spec(&[0, 1], &[0, 2], &[0, 4])));
    assert_eq!(
        run_ok(&mut w, 2).transfer_size,
        Some((2 * 2 * swa_p) as u64)
    );
    for b in 0..10 {
        for t in 0..2 {
            let got = row(&tm, gpu_h, b, t).to_vec();
            let mut want = vec![0x11u8; row_b];
            match b {
                0 => want[..swa_p].copy_from_slice(&before[t]),
                1 => want[..swa_p].copy_from_slice(&after[t]),
                _ => {}
            }
            assert_eq!(got, want, "block {b} tensor {t}");
        }
    }
    // The wrong number of groups is refused.
    assert!(!w.submit_load(3, &cpu(&[5]), &gpu_spec(&[0, 1], &[2], &[4])));
}

#[test]
fn hybrid_attention_and_mamba_state_groups() {
    // vLLM 0.33's hybrid (Mamba + attention) model as its offloading config describes it: a
    // Mamba group is a group whose window is one chunk ("Mamba depends on a single state":
    // `get_sliding_window_size_in_chunks(MambaSpec) == 1`), each of its GPU blocks the state
    // after that block's tokens, and its ref page the *un-padded* state size
    // (`replace(spec, page_size_padded=None).page_size_bytes`), smaller than the padded row.
    // Tensors 0, 1: attention layers (full group); tensor 2: a Mamba layer (state group).
    let tm = Arc::new(TransferManager::new().unwrap());
    let (row_b, state_p) = (64, 44);
    let gpu_h = layout(&tm, 12, 3, row_b);
    let cpu_h = layout(&tm, 8, 3, row_b * 2);
    let mut w = PhysicalOffloadingWorker::builder(tm.clone(), gpu_h, cpu_h)
        .blocks_per_chunk(2)
        .group(vec![direct_ref(0, row_b), direct_ref(1, row_b)])
        .group(vec![direct_ref(2, state_p)])
        .build()
        .unwrap();
    // The state after logical block k, and attention page (k, tensor t).
    let state = |k: usize, i: usize| (k * 31 + i) as u8 | 0x80;
    let attn = |k: usize, t: usize, i: usize| (k * 13 + t * 7 + i) as u8 & 0x7f;
    fill(&tm, cpu_h, |_, _, _| 0);
    fill(&tm, gpu_h, |b, t, i| match t {
        2 => 0x55,
        _ => attn(b, t, i),
    });
    // A 6-block request computed in three steps; each step stores its newly complete chunk:
    // the full group's two pages (GPU blocks 2s, 2s+1 → chunk s) and the state group's window
    // of one chunk. The request's two Mamba GPU blocks (10, 11) are reused step after step, so
    // each step's states are only in GPU memory until the next step: the store is what keeps
    // them, at block boundaries (chunk 3 + s).
    for s in 0..3 {
        for (j, b) in [10, 11].into_iter().enumerate() {
            for (i, x) in row(&tm, gpu_h, b, 2).iter_mut().enumerate() {
                *x = if i < state_p {
                    state(2 * s + j, i)
                } else {
                    0xEE
                };
            }
        }
        let spec = gpu_spec(&[2 * s, 2 * s + 1, 10, 11], &[2, 2], &[2 * s, 2 * s]);
        assert!(w.submit_store(s as u64, &spec, &cpu(&[s, 3 + s])));
        assert_eq!(
            run_ok(&mut w, s as u64).transfer_size,
            Some((2 * 2 * row_b + 2 * state_p) as u64),
            "step {s}: padding is never copied"
        );
    }
    for s in 0..3 {
        let c = row(&tm, cpu_h, 3 + s, 2).to_vec();
        for j in 0..2 {
            let page = &c[j * row_b..][..row_b];
            assert!(
                page[..state_p]
                    .iter()
                    .enumerate()
                    .all(|(i, &x)| x == state(2 * s + j, i))
            );
            assert!(page[state_p..].iter().all(|&x| x == 0), "padding stored");
        }
        // The state chunk holds no attention rows, the attention chunk no state row.
        assert!(row(&tm, cpu_h, 3 + s, 0).iter().all(|&x| x == 0));
        assert!(row(&tm, cpu_h, s, 2).iter().all(|&x| x == 0));
    }
    // A later request shares the first 4 blocks (a hit of 2 chunks). Attention loads the whole
    // prefix (chunks 0, 1 → GPU 0..4); the state group loads the single state at the hit's
    // boundary: logical block 3, the second sub-block of state chunk 4 (entered at index 3),
    // into the new request's Mamba block 9. Nothing else moves: not the state after block 2,
    // not the padding, not the states past the hit.
    fill(&tm, gpu_h, |_, _, _| 0x11);
    let spec = gpu_spec(&[0, 1, 2, 3, 9], &[4, 1], &[0, 3]);
    assert!(w.submit_load(7, &cpu(&[0, 1, 4]), &spec));
    assert_eq!(
        run_ok(&mut w, 7).transfer_size,
        Some((4 * 2 * row_b + state_p) as u64)
    );
    for b in 0..12 {
        for t in 0..3 {
            let got = row(&tm, gpu_h, b, t).to_vec();
            let want: Vec<u8> = (0..row_b)
                .map(|i| match (b, t) {
                    (0..4, 0 | 1) => attn(b, t, i),
                    (9, 2) if i < state_p => state(3, i),
                    _ => 0x11,
                })
                .collect();
            assert_eq!(got, want, "GPU block {b} tensor {t}");
        }
    }
}

fn refusal(b: WorkerLayoutBuilder) -> String {
    match b.build() {
        Ok(_) => panic!("layout accepted"),
        Err(e) => e.to_string(),
    }
}

#[test]
fn builder_refuses_layouts_it_cannot_serve() {
    let tm = Arc::new(TransferManager::new().unwrap());
    let gpu_h = layout(&tm, 4, 2, 64);
    let cpu_h = layout(&tm, 4, 2, 96);
    let cpu_big = layout(&tm, 4, 2, 128);
    let b = || PhysicalOffloadingWorker::builder(tm.clone(), gpu_h, cpu_h);
    let big = || PhysicalOffloadingWorker::builder(tm.clone(), gpu_h, cpu_big);
    let m = tp_map(PageOrder::Nhd, 4, 2, 0); // local page 64, canonical 128
    let canon = |t: usize, mapping: Option<CanonicalPageMapping>| CanonicalKVCacheRef {
        tensor_idx: t,
        page_size_bytes: 64,
        mapping,
    };
    // 96-byte rows do not split into 5 sub-pages.
    let e = refusal(b().blocks_per_chunk(5).group(vec![direct_ref(0, 8)]));
    assert!(e.contains("does not split into 5"), "{e}");
    // Direct: 2 blocks per chunk leave 48-byte sub-pages, too small for 64-byte pages.
    let e = refusal(
        b().blocks_per_chunk(2)
            .group(vec![direct_ref(0, 8)])
            .group(vec![direct_ref(1, 64)]),
    );
    assert!(
        e.contains("group 1 ref 0 (tensor 1)") && e.contains("CPU rows too small"),
        "{e}"
    );
    // Canonical with an uncertified ref.
    let e = refusal(
        big()
            .layout(ChunkLayout::Canonical)
            .group(vec![canon(0, Some(m.clone()))])
            .group(vec![canon(1, Some(m.clone())), canon(0, None)]),
    );
    assert!(
        e.contains("group 1 ref 1 (tensor 0)") && e.contains("uncertified"),
        "{e}"
    );
    // Canonical pages (128 bytes) do not fit 96-byte rows.
    let e = refusal(
        b().layout(ChunkLayout::Canonical)
            .group(vec![canon(0, Some(m.clone()))]),
    );
    assert!(
        e.contains("CPU rows too small") && e.contains("canonical page of 128"),
        "{e}"
    );
    // A mapping for another page size, a tensor that does not exist, a page past the row.
    let e = refusal(
        big()
            .layout(ChunkLayout::Canonical)
            .group(vec![CanonicalKVCacheRef {
                page_size_bytes: 32,
                ..canon(0, Some(m.clone()))
            }]),
    );
    assert!(
        e.contains("local page is 64 bytes, the ref's page 32"),
        "{e}"
    );
    let e = refusal(b().group(vec![direct_ref(2, 8)]));
    assert!(
        e.contains("group 0 ref 0 (tensor 2): no such tensor"),
        "{e}"
    );
    let e = refusal(b().group(vec![direct_ref(0, 65)]));
    assert!(e.contains("page of 65 bytes"), "{e}");
    let e = refusal(b());
    assert!(e.contains("no KV group"), "{e}");
    // The same canonical layout with rows that fit is served.
    assert!(
        big()
            .layout(ChunkLayout::Canonical)
            .group(vec![canon(0, Some(m.clone()))])
            .build()
            .is_ok()
    );
    // The simple constructor checks its block size.
    assert!(PhysicalOffloadingWorker::new(tm.clone(), gpu_h, cpu_h, 100).is_err());
}

#[test]
fn caches_description_must_match_the_gpu_layout() {
    let tm = Arc::new(TransferManager::new().unwrap());
    let gpu_h = layout(&tm, 4, 2, 64);
    let cpu_h = layout(&tm, 4, 2, 64);
    let g = tm.layout(gpu_h).unwrap();
    let tensors: Vec<crate::types::CanonicalKVCacheTensor> = (0..2)
        .map(|t| crate::types::CanonicalKVCacheTensor {
            ptr: g.block_addrs(0, t..t + 1)[0].0,
            num_blocks: 4,
            page_size_bytes: 64,
        })
        .collect();
    let caches = |tensors: Vec<crate::types::CanonicalKVCacheTensor>| CanonicalKVCaches {
        tensors,
        group_data_refs: vec![vec![direct_ref(0, 64), direct_ref(1, 48)]],
    };
    let b = || PhysicalOffloadingWorker::builder(tm.clone(), gpu_h, cpu_h);
    let mut w = b()
        .caches(&caches(tensors.clone()))
        .unwrap()
        .build()
        .unwrap();
    fill(&tm, gpu_h, |b, t, i| (b + t + i) as u8);
    assert!(w.submit_store(1, &gpu_spec(&[2], &[1], &[0]), &cpu(&[3])));
    assert_eq!(run_ok(&mut w, 1).transfer_size, Some(64 + 48));
    assert_eq!(row(&tm, cpu_h, 3, 1)[..48], row(&tm, gpu_h, 2, 1)[..48]);
    // Another tensor address, block count or page size is refused.
    let mut moved = tensors.clone();
    moved[1].ptr += 64;
    let e = b().caches(&caches(moved)).unwrap_err().to_string();
    assert!(e.contains("tensor 1: at"), "{e}");
    let mut fewer = tensors.clone();
    fewer[0].num_blocks = 3;
    assert!(b().caches(&caches(fewer)).is_err());
    assert!(b().caches(&caches(tensors[..1].to_vec())).is_err());
}

/// vLLM's own KV caches adopted (`get_worker(kv_caches)`): host buffers standing for its
/// tensors, rows read and written by the engine's indexing (`ptr + block * page`), blocks
/// stored to chunks and loaded back into other blocks; the buffers held until the worker and
/// its transfer manager are gone; tensors of two page sizes refused.
#[test]
fn a_worker_over_the_engines_own_caches() {
    use std::sync::atomic::{AtomicBool, Ordering};
    struct Engine(Vec<kvbm_physical::HostStorage>, Arc<AtomicBool>);
    impl Drop for Engine {
        fn drop(&mut self) {
            self.1.store(true, Ordering::SeqCst);
        }
    }
    let (blocks, page, tensors) = (6usize, 64usize, 3usize);
    let freed = Arc::new(AtomicBool::new(false));
    let engine = Arc::new(Engine(
        (0..tensors)
            .map(|_| kvbm_physical::HostStorage::new(blocks * page, PinPolicy::Unpinned).unwrap())
            .collect(),
        freed.clone(),
    ));
    #[allow(clippy::mut_from_ref)]
    fn engine_row(e: &Engine, t: usize, b: usize, page: usize) -> &mut [u8] {
        // SAFETY: inside tensor t's buffer; touched only while no job runs.
        unsafe { &mut e.0[t].as_mut_slice()[b * page..(b + 1) * page] }
    }
    let caches = CanonicalKVCaches {
        tensors: engine
            .0
            .iter()
            .map(|h| crate::types::CanonicalKVCacheTensor {
                ptr: h.as_ptr() as usize,
                num_blocks: blocks,
                page_size_bytes: page,
            })
            .collect(),
        group_data_refs: vec![(0..tensors).map(|t| direct_ref(t, page)).collect()],
    };
    for t in 0..tensors {
        for b in 0..blocks {
            for (i, x) in engine_row(&engine, t, b, page).iter_mut().enumerate() {
                *x = (t * 50 + b * 7 + i) as u8;
            }
        }
    }
    let tm = Arc::new(TransferManager::new().unwrap());
    let cpu_h = layout(&tm, 4, tensors, page);
    let owner: kvbm_physical::Owner = engine.clone();
    // SAFETY: the buffers live as long as `owner`; the test touches rows only between jobs.
    let mut w = unsafe {
        PhysicalOffloadingWorker::adopting(
            tm.clone(),
            &caches,
            kvbm_physical::TensorDevice::Host,
            owner,
            cpu_h,
        )
    }
    .unwrap()
    .build()
    .unwrap();
    assert!(w.submit_store(1, &gpu_spec(&[4, 1], &[2], &[0]), &cpu(&[0, 2])));
    assert_eq!(
        run_ok(&mut w, 1).transfer_size,
        Some((2 * tensors * page) as u64)
    );
    for (chunk, block) in [(0, 4), (2, 1)] {
        for t in 0..tensors {
            assert_eq!(
                row(&tm, cpu_h, chunk, t),
                engine_row(&engine, t, block, page),
                "chunk {chunk} tensor {t}"
            );
        }
    }
    let before: Vec<Vec<u8>> = (0..tensors)
        .map(|t| engine_row(&engine, t, 4, page).to_vec())
        .collect();
    for t in 0..tensors {
        engine_row(&engine, t, 3, page).fill(0);
        engine_row(&engine, t, 5, page).fill(0);
    }
    assert!(w.submit_load(2, &cpu(&[0, 2]), &gpu_spec(&[3, 5], &[2], &[0])));
    run_ok(&mut w, 2);
    for (t, row4) in before.iter().enumerate() {
        assert_eq!(engine_row(&engine, t, 3, page), row4.as_slice());
        assert_eq!(
            engine_row(&engine, t, 5, page)[0],
            (t * 50 + 7) as u8,
            "block 1's row, loaded into block 5"
        );
    }
    // Tensors of two page sizes are not one layout.
    let mut mixed = caches.clone();
    mixed.tensors[2].page_size_bytes = 32;
    // SAFETY: refused before any memory is touched.
    let e = unsafe {
        PhysicalOffloadingWorker::adopting(
            tm.clone(),
            &mixed,
            kvbm_physical::TensorDevice::Host,
            Arc::new(()),
            cpu_h,
        )
    }
    .unwrap_err()
    .to_string();
    assert!(e.contains("adopted KV tensor 2"), "{e}");
    drop(engine);
    assert!(!freed.load(Ordering::SeqCst), "held by the worker's layout");
    drop(w);
    drop(tm);
    assert!(freed.load(Ordering::SeqCst), "freed with the last holder");
}
