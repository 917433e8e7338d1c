//! `kvbm bench`: each data path against its raw baseline, measured in the same run.
//!
//! | path | ours | raw baseline |
//! |---|---|---|
//! | `host_copy` | `TransferManager` host → host | `ptr::copy_nonoverlapping` |
//! | `g2_to_g3`, `g3_to_g2` | `TransferManager` host ↔ `DiskStorage` (header + xxh3-128) | an O_DIRECT io_uring loop, one request per block, same queue depth |
//! | `g2_to_g4`, `g4_to_g2` | `TransferManager` host ↔ `ObjectStorage` (header + verified get) | `object_store` put/get, same concurrency |
//! | `tiering_store`, `tiering_load`, `tiering_promote` | a scheduler request through the engine's tiering manager ([`tiering`]) | `memcpy`; raw io_uring reads |
//!
//! Rounds alternate which side runs first (drift within a round favours neither); each figure
//! is the median over rounds and the ratio is the median of the per-round ratios. The ideas
//! follow `crates/kvbm-physical/benches/physical.rs`; this is a separate, user-facing
//! implementation (the CLI does not depend on bench files). `object` uses the configured S3
//! endpoint (`--s3-endpoint`/`--s3-bucket` or `[physical.s3]`, AWS credentials from the
//! environment), else a local-filesystem store under `--dir`.

use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{Context, bail};
use bytes::Bytes;
use futures::StreamExt;
use kvbm_physical::{
    Backing, BlockLayout, DiskConfig, IoEngineKind, LayoutHandle, ObjectConfig, ObjectKey,
    ObjectStorage, PhysicalLayout, PinPolicy, TransferManager, TransferOptions,
};
use object_store::{ObjectStoreExt, PutPayload, path::Path as OPath};
use serde::Serialize;

use crate::config::CliConfig;

mod tiering;

const MIB: usize = 1 << 20;
const BLOCK: usize = 2 * MIB;

/// Which benchmark to run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum Which {
    /// Host-to-host copies.
    Host,
    /// G2 ↔ G3 (disk).
    Disk,
    /// G2 ↔ G4 (objects).
    Object,
    /// The scheduler-facing tiering manager over real tiers (store, load, promotion).
    Tiering,
    /// Everything.
    All,
}

/// One measured path.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct BenchResult {
    /// The path (`host_copy`, `g2_to_g3`, ...).
    pub path: &'static str,
    /// Bytes per block.
    pub block_bytes: usize,
    /// Blocks per round.
    pub blocks: usize,
    /// Ours, median GiB/s.
    pub gib_per_s: f64,
    /// What the baseline is.
    pub baseline: String,
    /// Baseline, median GiB/s.
    pub baseline_gib_per_s: f64,
    /// Median of the per-round ours/baseline ratios.
    pub ratio: f64,
    /// Rounds run.
    pub rounds: usize,
    /// Conditions (I/O mode, store).
    pub note: String,
}

/// The whole output.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct BenchOutput {
    /// Measured paths.
    pub results: Vec<BenchResult>,
}

impl BenchOutput {
    /// A readable table.
    pub(crate) fn table(&self) -> String {
        let mut s = String::from(
            "path             block     blocks  ours GiB/s  baseline GiB/s  ratio  baseline\n",
        );
        for r in &self.results {
            s.push_str(&format!(
                "{:<15}  {:>5} KiB  {:>6}  {:>10.3}  {:>14.3}  {:>5.3}  {}\n",
                r.path,
                r.block_bytes / 1024,
                r.blocks,
                r.gib_per_s,
                r.baseline_gib_per_s,
                r.ratio,
                r.baseline
            ));
            s.push_str(&format!("                 ({})\n", r.note));
        }
        s
    }
}

fn layout(n: usize) -> anyhow::Result<BlockLayout> {
    // 4 layers × K/V × 16 tokens × 8192 × 2 B = 2 MiB, as in the physical crate's benchmark.
    Ok(BlockLayout::builder()
        .num_blocks(n)
        .num_layers(4)
        .outer_dim(2)
        .page_size(16)
        .inner_dim(8192)
        .dtype_bytes(2)
        .build()?)
}

fn gib_s(bytes: usize, secs: f64) -> f64 {
    bytes as f64 / secs / (1u64 << 30) as f64
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

/// `n` alternating rounds: (median ours, median raw, median ratio).
fn rounds(
    n: usize,
    mut ours: impl FnMut() -> anyhow::Result<f64>,
    mut raw: impl FnMut() -> anyhow::Result<f64>,
) -> anyhow::Result<(f64, f64, f64)> {
    let (mut o, mut r, mut q) = (Vec::new(), Vec::new(), Vec::new());
    for i in 0..n {
        let (a, b) = if i % 2 == 0 {
            let b = raw()?;
            (ours()?, b)
        } else {
            let a = ours()?;
            (a, raw()?)
        };
        o.push(a);
        r.push(b);
        q.push(a / b);
    }
    Ok((median(o), median(r), median(q)))
}

/// The raw copy baseline: `n` blocks from `src` to `dst`, block by block; GiB/s.
///
/// # Safety
/// `src` and `dst` are the starts of distinct allocations of at least `n` blocks each.
unsafe fn memcpy(src: usize, dst: usize, n: usize) -> f64 {
    let t = Instant::now();
    for i in 0..n {
        // SAFETY: per this function's contract.
        unsafe {
            std::ptr::copy_nonoverlapping(
                (src + i * BLOCK) as *const u8,
                (dst + i * BLOCK) as *mut u8,
                BLOCK,
            )
        };
    }
    gib_s(n * BLOCK, t.elapsed().as_secs_f64())
}

fn base_addr(l: &PhysicalLayout) -> usize {
    l.block_addrs(0, 0..1)[0].0
}

fn transfer(
    tm: &TransferManager,
    src: LayoutHandle,
    dst: LayoutHandle,
    ids: &[usize],
    options: TransferOptions,
) -> anyhow::Result<f64> {
    let t = Instant::now();
    // SAFETY: bench-owned layouts; nothing outside the manager touches them during the copy.
    let out = unsafe { tm.execute_transfer(src, ids, dst, ids, options) }?.wait();
    if let Some((id, e)) = out.failures().next() {
        bail!("block {id} failed: {e}");
    }
    Ok(gib_s(ids.len() * BLOCK, t.elapsed().as_secs_f64()))
}

fn host(tm: &TransferManager, out: &mut BenchOutput) -> anyhow::Result<()> {
    let n = 64;
    let a = PhysicalLayout::allocate_host(layout(n)?, PinPolicy::TryPin)?;
    let b = PhysicalLayout::allocate_host(layout(n)?, PinPolicy::TryPin)?;
    let (pa, pb) = (base_addr(&a), base_addr(&b));
    // SAFETY: both allocations are n blocks long; touching them takes page faults out.
    unsafe {
        std::ptr::write_bytes(pa as *mut u8, 1, n * BLOCK);
        std::ptr::write_bytes(pb as *mut u8, 2, n * BLOCK);
    }
    let (ha, hb) = (tm.register_layout(a)?, tm.register_layout(b)?);
    let ids: Vec<usize> = (0..n).collect();
    let r = 9;
    let (ours, raw, ratio) = rounds(
        r,
        || transfer(tm, ha, hb, &ids, TransferOptions::default()),
        || {
            // SAFETY: distinct allocations of n blocks each.
            Ok(unsafe { memcpy(pa, pb, n) })
        },
    )?;
    out.results.push(BenchResult {
        path: "host_copy",
        block_bytes: BLOCK,
        blocks: n,
        gib_per_s: ours,
        baseline: "ptr::copy_nonoverlapping".into(),
        baseline_gib_per_s: raw,
        ratio,
        rounds: r,
        note: "TransferManager host → host memcpy".into(),
    });
    tm.unregister_layout(ha)?;
    tm.unregister_layout(hb)?;
    Ok(())
}

/// The raw baseline's file for `n` blocks (each followed by a 4 KiB sector, as ours), with
/// O_DIRECT when `direct` and the file system allows it.
fn open_raw(path: &Path, direct: bool, n: usize) -> anyhow::Result<std::fs::File> {
    let open = |direct: bool| {
        let mut o = std::fs::OpenOptions::new();
        o.read(true).write(true).create(true).truncate(false);
        if direct {
            o.custom_flags(libc::O_DIRECT);
        }
        o.open(path)
    };
    let f = open(direct).or_else(|_| open(false))?;
    // SAFETY: a valid fd; fallocate has no memory preconditions.
    unsafe { libc::fallocate(f.as_raw_fd(), 0, 0, (n * (BLOCK + 4096)) as i64) };
    Ok(f)
}

/// The raw baseline: an io_uring loop, one request per block, `qd` in flight.
fn raw_uring(fd: i32, base: usize, n: usize, qd: u32, write: bool) -> anyhow::Result<f64> {
    use io_uring::{IoUring, opcode, types};
    let mut ring = IoUring::new(qd.next_power_of_two())?;
    let t = Instant::now();
    let (mut next, mut pending, mut done) = (0usize, 0u32, 0usize);
    while done < n {
        while next < n && pending < qd {
            let ptr = (base + next * BLOCK) as *mut u8;
            // Same file footprint as ours: each block followed by a 4 KiB sector.
            let off = (next * (BLOCK + 4096)) as u64;
            let sqe = if write {
                opcode::Write::new(types::Fd(fd), ptr, BLOCK as u32)
                    .offset(off)
                    .build()
            } else {
                opcode::Read::new(types::Fd(fd), ptr, BLOCK as u32)
                    .offset(off)
                    .build()
            };
            // SAFETY: the buffer outlives the request (we wait for every completion below).
            unsafe { ring.submission().push(&sqe) }
                .map_err(|_| anyhow::anyhow!("io_uring submission queue full"))?;
            next += 1;
            pending += 1;
        }
        ring.submit_and_wait(1)?;
        for cqe in ring.completion() {
            if cqe.result() != BLOCK as i32 {
                bail!("raw io_uring request returned {}", cqe.result());
            }
            pending -= 1;
            done += 1;
        }
    }
    Ok(gib_s(n * BLOCK, t.elapsed().as_secs_f64()))
}

fn disk(tm: &TransferManager, dir: &Path, out: &mut BenchOutput) -> anyhow::Result<()> {
    let n = 64;
    let qd = 8;
    let scratch = tempfile::Builder::new()
        .prefix("kvbm-bench-")
        .tempdir_in(dir)
        .with_context(|| format!("cannot create a scratch directory in {}", dir.display()))?;
    let mut cfg = DiskConfig::new(scratch.path().join("ours.bin"));
    cfg.queue_depth = qd;
    cfg.engine = IoEngineKind::Uring;
    let d = PhysicalLayout::create_disk(layout(n)?, &cfg)?;
    let Backing::Disk(storage) = d.backing() else {
        bail!("a disk layout without disk backing");
    };
    let caps = storage.capabilities();
    let raw_file = open_raw(&scratch.path().join("raw.bin"), caps.direct_io, n)?;
    let h = PhysicalLayout::allocate_host(layout(n)?, PinPolicy::TryPin)?;
    let base = base_addr(&h);
    for i in (0..n * BLOCK).step_by(8) {
        // SAFETY: inside the n-block allocation.
        unsafe { *((base + i) as *mut u64) = (i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) };
    }
    let hh = tm.register_layout(h)?;
    let hd = tm.register_layout(d)?;
    let ids: Vec<usize> = (0..n).collect();
    let fd = raw_file.as_raw_fd();
    let r = 5;
    let note = format!("{caps:?}, queue depth {qd}; ours adds a 4 KiB header sector + xxh3-128");
    let (o, w, q) = rounds(
        r,
        || transfer(tm, hh, hd, &ids, TransferOptions::default()),
        || raw_uring(fd, base, n, qd, true),
    )?;
    out.results.push(BenchResult {
        path: "g2_to_g3",
        block_bytes: BLOCK,
        blocks: n,
        gib_per_s: o,
        baseline: "raw io_uring writes".into(),
        baseline_gib_per_s: w,
        ratio: q,
        rounds: r,
        note: note.clone(),
    });
    let (o, w, q) = rounds(
        r,
        || transfer(tm, hd, hh, &ids, TransferOptions::default()),
        || raw_uring(fd, base, n, qd, false),
    )?;
    out.results.push(BenchResult {
        path: "g3_to_g2",
        block_bytes: BLOCK,
        blocks: n,
        gib_per_s: o,
        baseline: "raw io_uring reads".into(),
        baseline_gib_per_s: w,
        ratio: q,
        rounds: r,
        note: format!("{note}; ours verifies header + checksum"),
    });
    tm.unregister_layout(hh)?;
    tm.unregister_layout(hd)?;
    Ok(())
}

fn object(
    tm: &TransferManager,
    cfg: &CliConfig,
    dir: &Path,
    out: &mut BenchOutput,
) -> anyhow::Result<()> {
    let n = 32;
    let conc = 8;
    let ns = format!("kvbm-bench/{}", std::process::id());
    let ocfg = ObjectConfig {
        namespace: ns.clone(),
        max_concurrency: conc,
        ..ObjectConfig::default()
    };
    let _scratch;
    // The baseline is a bare client of the same store, outside the storage's namespace and
    // request limit (its own concurrency bound is the same `conc`).
    let s3 = cfg.engine.physical.s3.as_ref();
    let (store, raw, where_) = match s3.and_then(|s| s.endpoint.as_ref().map(|ep| (s, ep))) {
        Some((s3, ep)) => {
            kvbm_engine::stack::probe_endpoint(ep)?;
            let raw = ObjectStorage::s3_client(s3)?;
            (
                ObjectStorage::new(Arc::clone(&raw), ocfg),
                raw,
                format!("S3 {ep} bucket {}", s3.bucket),
            )
        }
        None => {
            let t = tempfile::Builder::new()
                .prefix("kvbm-bench-g4-")
                .tempdir_in(dir)?;
            let raw: Arc<dyn object_store::ObjectStore> = Arc::new(
                object_store::local::LocalFileSystem::new_with_prefix(t.path())?,
            );
            let s = ObjectStorage::new(Arc::clone(&raw), ocfg);
            let w = format!(
                "local filesystem {} (no S3 endpoint configured)",
                t.path().display()
            );
            _scratch = t;
            (s, raw, w)
        }
    };
    let store = Arc::new(store);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let h = PhysicalLayout::allocate_host(layout(n)?, PinPolicy::TryPin)?;
    let base = base_addr(&h);
    for i in (0..n * BLOCK).step_by(8) {
        // SAFETY: inside the n-block allocation.
        unsafe { *((base + i) as *mut u64) = (i as u64).wrapping_mul(0xBF58_476D_1CE4_E5B9) };
    }
    let bodies: Vec<Bytes> = (0..n)
        .map(|i| {
            // SAFETY: block i of the allocation.
            Bytes::copy_from_slice(unsafe {
                std::slice::from_raw_parts((base + i * BLOCK) as *const u8, BLOCK)
            })
        })
        .collect();
    let hh = tm.register_layout(h)?;
    let ho = tm.register_layout(PhysicalLayout::object(layout(n)?, Arc::clone(&store)))?;
    let ids: Vec<usize> = (0..n).collect();
    let keys: Vec<ObjectKey> = (0..n)
        .map(|i| ObjectKey::new(format!("ours/{i}")))
        .collect();
    let raw_path = |i: usize| OPath::from(format!("{ns}/raw/{i}"));
    let raw_put = || -> anyhow::Result<f64> {
        let t = Instant::now();
        let results: Vec<_> = rt.block_on(
            futures::stream::iter(0..n)
                .map(|i| {
                    let raw = Arc::clone(&raw);
                    let body = bodies[i].clone();
                    async move { raw.put(&raw_path(i), PutPayload::from(body)).await }
                })
                .buffer_unordered(conc)
                .collect(),
        );
        for r in results {
            r?;
        }
        Ok(gib_s(n * BLOCK, t.elapsed().as_secs_f64()))
    };
    let raw_get = || -> anyhow::Result<f64> {
        let t = Instant::now();
        let results: Vec<Result<Bytes, object_store::Error>> = rt.block_on(
            futures::stream::iter(0..n)
                .map(|i| {
                    let raw = Arc::clone(&raw);
                    async move { raw.get(&raw_path(i)).await?.bytes().await }
                })
                .buffer_unordered(conc)
                .collect(),
        );
        for r in results {
            if r?.len() != BLOCK {
                bail!("raw get returned a short body");
            }
        }
        Ok(gib_s(n * BLOCK, t.elapsed().as_secs_f64()))
    };
    let r = 5;
    let opts = || TransferOptions::with_object_keys(keys.clone());
    let (o, w, q) = rounds(r, || transfer(tm, hh, ho, &ids, opts()), raw_put)?;
    out.results.push(BenchResult {
        path: "g2_to_g4",
        block_bytes: BLOCK,
        blocks: n,
        gib_per_s: o,
        baseline: "object_store put".into(),
        baseline_gib_per_s: w,
        ratio: q,
        rounds: r,
        note: format!("{where_}, concurrency {conc}; ours adds a 48 B header + xxh3-128"),
    });
    let (o, w, q) = rounds(r, || transfer(tm, ho, hh, &ids, opts()), raw_get)?;
    out.results.push(BenchResult {
        path: "g4_to_g2",
        block_bytes: BLOCK,
        blocks: n,
        gib_per_s: o,
        baseline: "object_store get".into(),
        baseline_gib_per_s: w,
        ratio: q,
        rounds: r,
        note: format!("{where_}, concurrency {conc}; ours verifies while copying into the layout"),
    });
    rt.block_on(async {
        for (i, key) in keys.iter().enumerate() {
            let _ = raw.delete(&raw_path(i)).await;
            let _ = store.delete(key).await;
        }
    });
    tm.unregister_layout(hh)?;
    tm.unregister_layout(ho)?;
    Ok(())
}

/// Runs the chosen benchmarks.
///
/// # Errors
/// Storage that cannot be set up, a failed transfer, an unreachable S3 endpoint.
pub(crate) fn run(
    which: Which,
    dir: Option<&Path>,
    cfg: &CliConfig,
) -> anyhow::Result<BenchOutput> {
    let tm = Arc::new(TransferManager::new().context("cannot start the transfer manager")?);
    let tmp = std::env::temp_dir();
    let dir = dir.unwrap_or(&tmp);
    let mut out = BenchOutput {
        results: Vec::new(),
    };
    let all = which == Which::All;
    if all || which == Which::Host {
        host(&tm, &mut out).context("host benchmark")?;
    }
    if all || which == Which::Disk {
        disk(&tm, dir, &mut out).context("disk benchmark")?;
    }
    if all || which == Which::Object {
        object(&tm, cfg, dir, &mut out).context("object benchmark")?;
    }
    if all || which == Which::Tiering {
        tiering::run(&tm, dir, &mut out).context("tiering benchmark")?;
    }
    Ok(out)
}
