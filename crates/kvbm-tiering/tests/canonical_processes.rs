//! TP-independent storage across real processes (issue 24, item 2): the ranks of a
//! tensor-parallel model are separate processes (as vLLM's workers are), each with its own
//! GPU-side memory and a [`PhysicalOffloadingWorker`] over one shared CPU region (a `MAP_SHARED`
//! file, as vLLM's `SharedOffloadRegion` is). What one TP size stores in the canonical layout,
//! ranks of any other TP size load, each exactly the bytes its own layout needs.
//!
//! ```text
//!   store: TP=2                       shared region (canonical chunks)      load: TP=1, TP=4
//!   ┌ process rank 0 (heads 0,1) ┐    ┌──────────────────────────────┐    ┌ process rank 0 of 1 ┐
//!   │ GPU blocks → worker ───────┼──► │ [h0 h1 h2 h3] per token, all │ ──►│ process r0..r3 of 4 │
//!   └ process rank 1 (heads 2,3) ┘    │ ranks' fragments interleaved │    └ (each checks bytes) ┘
//!      (both at once)                 └──────────────────────────────┘       (all at once)
//! ```
//!
//! Two cases: 4 KV heads stored at TP=2 and read at TP=1 and TP=4; and a replicated layout
//! (MLA's one latent "head" held whole by every rank) stored by TP=2 processes at once, where
//! the ranks take turns per block so the region receives exactly one copy (the bytes the
//! processes report writing sum to one copy, not two), then read at TP=1 and TP=4.
//!
//! The file is its own harness (`harness = false`): started with `--role`, the binary is one
//! rank (it stores its shard, or loads and checks every byte of its GPU memory, and exits
//! non-zero on any difference); started otherwise (by `cargo test`), it runs the cases, starting
//! the ranks as child processes of itself.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;

use kvbm_physical::{
    Backing, BlockDim, BlockLayout, CanonicalPageMapping, HostStorage, LayoutHandle,
    PhysicalLayout, PinPolicy, TransferManager,
};
use kvbm_tiering::*;

const OUTER: usize = 2;
const TOKENS: usize = 4;
const HEAD_BYTES: usize = 8;
const TENSORS: usize = 2;
const BPC: usize = 2;
/// GPU rows are padded past the local page (vLLM pads pages).
const PAD: usize = 8;
/// Chunks in the shared region.
const REGION_CHUNKS: usize = 6;
/// The stored job: 5 logical blocks from index 3 (skip 1 of 2: an unaligned head, 3 chunks),
/// from scattered GPU blocks into scattered chunks.
const FIRST: usize = 3;
const GPU_IDS: [usize; 5] = [4, 0, 3, 1, 2];
const CHUNKS: [usize; 3] = [5, 1, 3];
/// Where a loading rank puts the same 5 blocks in its 6 GPU blocks.
const LOAD_IDS: [usize; 5] = [2, 5, 0, 4, 1];
/// The region's bytes before any store.
const POISON: u8 = 0xAA;

fn canonical_page(heads: usize) -> usize {
    OUTER * TOKENS * heads * HEAD_BYTES
}

/// The full, unsharded page of tensor `t` of logical block `k` (never [`POISON`]).
fn full_page(heads: usize, t: usize, k: usize) -> Vec<u8> {
    (0..canonical_page(heads))
        .map(|i| ((i * 13 + t * 101 + k * 57) % 170) as u8)
        .collect()
}

/// The canonical CPU layout: per tensor a row of `BPC` canonical pages per chunk.
fn cpu_layout(heads: usize) -> BlockLayout {
    BlockLayout::builder()
        .num_blocks(REGION_CHUNKS)
        .num_layers(TENSORS)
        .outer_dim(1)
        .page_size(1)
        .inner_dim(canonical_page(heads) * BPC)
        .dtype_bytes(1)
        .layer_separate(BlockDim::BlockContiguous)
        .build()
        .unwrap()
}

/// Where logical block `FIRST + j` of tensor `t` lives in the region: its byte range.
fn region_range(heads: usize, j: usize, t: usize) -> std::ops::Range<usize> {
    let l = cpu_layout(heads);
    let (page, row) = (canonical_page(heads), canonical_page(heads) * BPC);
    let logical = FIRST % BPC + j;
    let start = t * l.allocation_bytes() + CHUNKS[logical / BPC] * row + (logical % BPC) * page;
    start..start + page
}

/// The shared region, mapped `MAP_SHARED` in this process; unmapped when the last of its
/// [`HostStorage`]s goes.
struct Mapping {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: the mapping is plain shared memory; who writes it when is ordered by the processes'
// protocol (stores finish before loads start), as for any kvbm host memory.
unsafe impl Send for Mapping {}
// SAFETY: as above.
unsafe impl Sync for Mapping {}

impl Mapping {
    fn open(path: &Path, len: usize) -> Mapping {
        let f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(path)
            .unwrap();
        assert_eq!(f.metadata().unwrap().len() as usize, len, "region size");
        use std::os::fd::AsRawFd;
        // SAFETY: a fresh shared mapping of a file of `len` bytes, nothing else at that address.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                f.as_raw_fd(),
                0,
            )
        };
        assert_ne!(ptr, libc::MAP_FAILED, "mmap {}", path.display());
        Mapping {
            ptr: ptr.cast(),
            len,
        }
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `open`, no longer referenced (its storages are gone).
        unsafe { libc::munmap(self.ptr.cast(), self.len) };
    }
}

/// The shared region registered as the canonical CPU layout of `tm` (one external host
/// allocation per tensor, cut from the one mapping).
fn shared_cpu(tm: &TransferManager, path: &Path, heads: usize) -> LayoutHandle {
    let l = cpu_layout(heads);
    let per = l.allocation_bytes();
    let map = Arc::new(Mapping::open(path, per * l.num_allocations()));
    let parts = (0..l.num_allocations())
        .map(|t| {
            // SAFETY: `[t * per, (t + 1) * per)` lies inside the mapping, which the owner (an
            // `Arc` of it) keeps mapped for as long as the storage lives; this process touches
            // the bytes only through `tm`'s transfers.
            let h =
                unsafe { HostStorage::external(map.ptr.add(t * per), per, Box::new(map.clone())) }
                    .unwrap();
            Arc::new(h)
        })
        .collect();
    tm.register_layout(PhysicalLayout::from_backing(l, Backing::Host(parts)).unwrap())
        .unwrap()
}

/// Row `t` of GPU block `b`, as bytes of this process's own memory.
#[allow(clippy::mut_from_ref)]
fn row(tm: &TransferManager, h: LayoutHandle, b: usize, t: usize) -> &mut [u8] {
    let (addr, len) = tm.layout(h).unwrap().block_addrs(b, t..t + 1)[0];
    // SAFETY: a row of a live host layout registered in `tm`; no transfer runs while the
    // caller holds the slice.
    unsafe { std::slice::from_raw_parts_mut(addr as *mut u8, len) }
}

/// One rank: its GPU memory (private to its process), its mapping, its worker over the region.
struct Rank {
    tm: Arc<TransferManager>,
    gpu: LayoutHandle,
    map: CanonicalPageMapping,
    worker: PhysicalOffloadingWorker,
}

fn rank(region: &Path, heads: usize, tp: usize, r: usize) -> Rank {
    let tm = Arc::new(TransferManager::new().unwrap());
    let map =
        CanonicalPageMapping::tensor_parallel(OUTER, TOKENS, heads, HEAD_BYTES, tp, r).unwrap();
    let gpu = BlockLayout::builder()
        .num_blocks(6)
        .num_layers(TENSORS)
        .outer_dim(1)
        .page_size(1)
        .inner_dim(map.local_page_size_bytes + PAD)
        .dtype_bytes(1)
        .layer_separate(BlockDim::BlockContiguous)
        .build()
        .unwrap();
    let gpu = tm
        .register_layout(PhysicalLayout::allocate_host(gpu, PinPolicy::Unpinned).unwrap())
        .unwrap();
    let cpu = shared_cpu(&tm, region, heads);
    let refs = (0..TENSORS)
        .map(|t| CanonicalKVCacheRef {
            tensor_idx: t,
            page_size_bytes: map.local_page_size_bytes,
            mapping: Some(map.clone()),
        })
        .collect();
    let worker = PhysicalOffloadingWorker::builder(tm.clone(), gpu, cpu)
        .blocks_per_chunk(BPC)
        .layout(ChunkLayout::Canonical)
        .group(refs)
        .build()
        .unwrap();
    Rank {
        tm,
        gpu,
        map,
        worker,
    }
}

fn finish(w: &mut PhysicalOffloadingWorker, job: u64) -> u64 {
    w.wait(&[job]);
    let done = w.get_finished();
    assert_eq!(done.len(), 1);
    assert!(done[0].success, "job {job} failed");
    done[0]
        .transfer_size
        .expect("a finished job reports its bytes")
}

fn cpu_spec(ids: &[usize]) -> LoadStoreSpec {
    LoadStoreSpec::Cpu(CpuLoadStoreSpec {
        chunk_ids: ids.iter().map(|&i| i as i32).collect(),
    })
}

fn gpu_spec(ids: &[usize]) -> GpuLoadStoreSpec {
    GpuLoadStoreSpec::new(
        ids.iter().map(|&i| i as i32).collect(),
        vec![5],
        vec![FIRST],
    )
    .unwrap()
}

/// A rank's process: `store` puts its shard of the full pages in its GPU blocks and stores
/// them; `load` loads them into fresh GPU memory and checks every byte (its shard in the named
/// blocks, padding and the other block untouched). Prints the bytes its job moved.
fn rank_main(role: &str, region: &Path, heads: usize, tp: usize, r: usize) {
    let mut x = rank(region, heads, tp, r);
    let local = x.map.local_page_size_bytes;
    let fill = |x: &Rank, v: u8| {
        for b in 0..6 {
            for t in 0..TENSORS {
                row(&x.tm, x.gpu, b, t).fill(v);
            }
        }
    };
    let moved = match role {
        "store" => {
            fill(&x, 0x55);
            for (j, &b) in GPU_IDS.iter().enumerate() {
                for t in 0..TENSORS {
                    let page = full_page(heads, t, FIRST + j);
                    x.map
                        .from_canonical(&page, &mut row(&x.tm, x.gpu, b, t)[..local]);
                }
            }
            assert!(
                x.worker
                    .submit_store(1, &gpu_spec(&GPU_IDS), &cpu_spec(&CHUNKS))
            );
            finish(&mut x.worker, 1)
        }
        "load" => {
            fill(&x, 0x33);
            assert!(
                x.worker
                    .submit_load(1, &cpu_spec(&CHUNKS), &gpu_spec(&LOAD_IDS))
            );
            let moved = finish(&mut x.worker, 1);
            assert_eq!(
                moved,
                (5 * TENSORS * local) as u64,
                "a load reads whole pages"
            );
            for b in 0..6 {
                for t in 0..TENSORS {
                    let mut want = vec![0x33u8; local + PAD];
                    if let Some(j) = LOAD_IDS.iter().position(|&i| i == b) {
                        x.map
                            .from_canonical(&full_page(heads, t, FIRST + j), &mut want[..local]);
                    }
                    assert_eq!(
                        row(&x.tm, x.gpu, b, t),
                        &want[..],
                        "tp {tp} rank {r}: GPU block {b} tensor {t}"
                    );
                }
            }
            moved
        }
        other => panic!("unknown role {other:?}"),
    };
    println!("moved={moved}");
}

/// Starts `tp` rank processes at once and waits for all; the bytes each reports moving.
fn ranks(role: &str, region: &Path, heads: usize, tp: usize) -> Vec<u64> {
    let exe = std::env::current_exe().unwrap();
    let children: Vec<_> = (0..tp)
        .map(|r| {
            Command::new(&exe)
                .args(["--role", role, "--region"])
                .arg(region)
                .args(["--heads", &heads.to_string()])
                .args(["--tp", &tp.to_string(), "--rank", &r.to_string()])
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    children
        .into_iter()
        .enumerate()
        .map(|(r, c)| {
            let out = c.wait_with_output().unwrap();
            let (stdout, stderr) = (
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr),
            );
            assert!(
                out.status.success(),
                "{role} rank {r} of tp {tp} failed ({}):\n{stdout}{stderr}",
                out.status
            );
            stdout
                .lines()
                .find_map(|l| l.strip_prefix("moved="))
                .unwrap_or_else(|| panic!("rank {r} printed no byte count: {stdout}"))
                .parse()
                .unwrap()
        })
        .collect()
}

/// A fresh region file, poisoned.
fn region(dir: &Path, name: &str, heads: usize) -> PathBuf {
    let l = cpu_layout(heads);
    let path = dir.join(name);
    std::fs::write(
        &path,
        vec![POISON; l.allocation_bytes() * l.num_allocations()],
    )
    .unwrap();
    path
}

/// The region holds each stored block's full canonical page in its slot, and poison in every
/// byte no block owns.
fn check_region(path: &Path, heads: usize) {
    let bytes = std::fs::read(path).unwrap();
    let mut owned = vec![false; bytes.len()];
    for j in 0..5 {
        for t in 0..TENSORS {
            let r = region_range(heads, j, t);
            assert_eq!(
                &bytes[r.clone()],
                &full_page(heads, t, FIRST + j)[..],
                "block {j} tensor {t}"
            );
            owned[r].fill(true);
        }
    }
    let stray = (0..bytes.len()).find(|&i| !owned[i] && bytes[i] != POISON);
    assert_eq!(stray, None, "a byte outside the stored pages was written");
}

/// 4 KV heads: TP=2 processes store, TP=1 and TP=4 processes load.
fn heads_sharded(dir: &Path) {
    let heads = 4;
    let path = region(dir, "sharded.region", heads);
    let stored = ranks("store", &path, heads, 2);
    // Each rank wrote its half of every page: together one copy.
    assert_eq!(
        stored.iter().sum::<u64>(),
        (5 * TENSORS * canonical_page(heads)) as u64
    );
    check_region(&path, heads);
    for tp in [1, 4, 2] {
        ranks("load", &path, heads, tp);
    }
}

/// A replicated layout (one head held whole by every rank, as MLA's latent KV): TP=2
/// processes store at once, taking turns per block, so the region gets one copy.
fn replicated(dir: &Path) {
    let heads = 1;
    let path = region(dir, "replicated.region", heads);
    let m = CanonicalPageMapping::tensor_parallel(OUTER, TOKENS, heads, HEAD_BYTES, 2, 0).unwrap();
    assert_eq!(
        (m.num_writers, m.local_page_size_bytes),
        (2, canonical_page(heads))
    );
    let stored = ranks("store", &path, heads, 2);
    let one_copy = (5 * TENSORS * canonical_page(heads)) as u64;
    assert_eq!(stored.iter().sum::<u64>(), one_copy, "per rank: {stored:?}");
    assert!(
        stored.iter().all(|&s| s > 0),
        "both ranks take turns: {stored:?}"
    );
    check_region(&path, heads);
    for tp in [1, 4] {
        ranks("load", &path, heads, tp);
    }
}

fn arg(args: &[String], name: &str) -> String {
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1))
        .unwrap_or_else(|| panic!("{name} missing"))
        .clone()
}

/// A named case of this file.
type Case = (&'static str, fn(&Path));

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if args.iter().any(|a| a == "--role") {
        let num = |n: &str| arg(&args, n).parse::<usize>().unwrap();
        let region = PathBuf::from(arg(&args, "--region"));
        rank_main(
            &arg(&args, "--role"),
            &region,
            num("--heads"),
            num("--tp"),
            num("--rank"),
        );
        return;
    }
    let cases: [Case; 2] = [
        (
            "heads_sharded_tp2_processes_read_at_tp1_tp2_tp4",
            heads_sharded,
        ),
        ("replicated_layout_stored_once_by_two_processes", replicated),
    ];
    // `cargo test -- --list` (what libtest would print).
    if args.iter().any(|a| a == "--list") {
        for (name, _) in &cases {
            println!("{name}: test");
        }
        return;
    }
    let dir = tempdir();
    println!("\nrunning {} tests", cases.len());
    let mut failed = Vec::new();
    for (name, case) in cases {
        let ok = std::panic::catch_unwind(|| case(&dir)).is_ok();
        println!("test {name} ... {}", if ok { "ok" } else { "FAILED" });
        if !ok {
            failed.push(name);
        }
    }
    std::fs::remove_dir_all(&dir).unwrap();
    // libtest's summary line, which `cargo xtask ci` counts.
    println!(
        "\ntest result: {}. {} passed; {} failed; 0 ignored; 0 measured; 0 filtered out\n",
        if failed.is_empty() { "ok" } else { "FAILED" },
        cases.len() - failed.len(),
        failed.len()
    );
    if !failed.is_empty() {
        eprintln!("failed: {failed:?}");
        std::process::exit(101);
    }
}

fn tempdir() -> PathBuf {
    let base = if Path::new("/dev/shm").is_dir() {
        PathBuf::from("/dev/shm")
    } else {
        std::env::temp_dir()
    };
    let dir = base.join(format!("kvbm-canonical-processes-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}
