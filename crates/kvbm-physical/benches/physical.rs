//! Throughput of the transfer manager against raw baselines measured in the same run.
//!
//! Prints one JSON object: per path, our GiB/s, the raw baseline's GiB/s and the ratio, with
//! the goal. 2 MiB blocks. Run through `cargo xtask bench physical` (it provides the S3 server
//! through `KVBM_TEST_S3_*`); without those variables the object figures are skipped.
//!
//! Measurements alternate ours/raw and report the median of several rounds to damp the noise of
//! a shared VM disk.

use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;
use futures::StreamExt;
use kvbm_physical::*;
use object_store::{ObjectStore, ObjectStoreExt, PutPayload, path::Path as OPath};

const MIB: usize = 1 << 20;
const BLOCK: usize = 2 * MIB;

fn layout(n: usize) -> BlockLayout {
    // 4 layers × K/V × 16 tokens × 8192 × 2 B = 2 MiB.
    BlockLayout::builder()
        .num_blocks(n)
        .num_layers(4)
        .outer_dim(2)
        .page_size(16)
        .inner_dim(8192)
        .dtype_bytes(2)
        .build()
        .unwrap()
}

fn gib_s(bytes: usize, secs: f64) -> f64 {
    bytes as f64 / secs / (1u64 << 30) as f64
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[v.len() / 2]
}

struct Figure {
    name: &'static str,
    ours: f64,
    raw: f64,
    /// Median of the per-round ours/raw ratios (more robust than a ratio of medians).
    ratio: f64,
    goal: f64,
    note: String,
}

/// Runs `n` paired rounds, alternating which side goes first (so drift within a round favours
/// neither), and returns (median ours, median raw, median of the per-round ratios).
fn rounds(
    n: usize,
    mut ours: impl FnMut() -> f64,
    mut raw: impl FnMut() -> f64,
) -> (f64, f64, f64) {
    let (mut o, mut r, mut q) = (Vec::new(), Vec::new(), Vec::new());
    for i in 0..n {
        let (a, b) = if i % 2 == 0 {
            let b = raw();
            (ours(), b)
        } else {
            let a = ours();
            (a, raw())
        };
        o.push(a);
        r.push(b);
        q.push(a / b);
    }
    (median(o), median(r), median(q))
}

fn host_to_host(tm: &TransferManager, figures: &mut Vec<Figure>) {
    let n = 64;
    let a = PhysicalLayout::allocate_host(layout(n), PinPolicy::TryPin).unwrap();
    let b = PhysicalLayout::allocate_host(layout(n), PinPolicy::TryPin).unwrap();
    let (pa, pb) = (a.block_addrs(0, 0..4)[0].0, b.block_addrs(0, 0..4)[0].0);
    // Touch both so page faults are out of the picture.
    // SAFETY: both ranges lie inside the freshly allocated, not yet registered layouts.
    unsafe {
        std::ptr::write_bytes(pa as *mut u8, 1, n * BLOCK);
        std::ptr::write_bytes(pb as *mut u8, 2, n * BLOCK);
    }
    let ha = tm.register_layout(a).unwrap();
    let hb = tm.register_layout(b).unwrap();
    let ids: Vec<usize> = (0..n).collect();
    let (ours, raw, ratio) = rounds(
        15,
        || {
            let t = Instant::now();
            let out =
                // SAFETY: bench-owned layouts; nothing outside the manager reads or writes their blocks while the transfer runs.
                unsafe { tm.execute_transfer(ha, &ids, hb, &ids, TransferOptions::default()) }
                    .unwrap()
                    .wait();
            assert!(out.is_complete_success());
            gib_s(n * BLOCK, t.elapsed().as_secs_f64())
        },
        || {
            let t = Instant::now();
            for i in 0..n {
                // SAFETY: both buffers are n blocks long and distinct.
                unsafe {
                    std::ptr::copy_nonoverlapping(
                        (pa + i * BLOCK) as *const u8,
                        (pb + i * BLOCK) as *mut u8,
                        BLOCK,
                    )
                };
            }
            gib_s(n * BLOCK, t.elapsed().as_secs_f64())
        },
    );
    figures.push(Figure {
        name: "host_to_host_copy",
        ours,
        raw,
        ratio,
        goal: 0.95,
        note: format!("{n} x 2 MiB blocks vs ptr::copy_nonoverlapping"),
    });
}

/// The raw baseline: O_DIRECT io_uring loop, one `len`-byte request per block (block `i` at
/// `base + i * len` in memory, at `i * file_stride` in the file), `qd` in flight.
#[allow(clippy::too_many_arguments)]
fn raw_uring(
    fd: i32,
    base: usize,
    n: usize,
    qd: u32,
    write: bool,
    len: usize,
    file_stride: usize,
) -> f64 {
    use io_uring::{IoUring, opcode, types};
    let mut ring = IoUring::new(qd.next_power_of_two()).unwrap();
    let t = Instant::now();
    let (mut next, mut pending, mut done) = (0usize, 0u32, 0usize);
    while done < n {
        while next < n && pending < qd {
            let ptr = (base + next * len) as *mut u8;
            let off = (next * file_stride) as u64;
            let sqe = if write {
                opcode::Write::new(types::Fd(fd), ptr, len as u32)
                    .offset(off)
                    .build()
            } else {
                opcode::Read::new(types::Fd(fd), ptr, len as u32)
                    .offset(off)
                    .build()
            };
            // SAFETY: the buffer `ptr` (inside the baseline's own host buffer) and the fd
            // outlive the request, reaped below.
            unsafe { ring.submission().push(&sqe).unwrap() };
            ring.submit().unwrap();
            next += 1;
            pending += 1;
        }
        ring.submit_and_wait(1).unwrap();
        for cqe in ring.completion() {
            assert_eq!(cqe.result(), len as i32, "raw io failed");
            pending -= 1;
            done += 1;
        }
    }
    gib_s(n * len, t.elapsed().as_secs_f64())
}

/// 2 KiB blocks in 256-byte regions: 4 layers × K/V × 16 tokens × 8 × 2 B. Not a multiple of
/// the O_DIRECT alignment, so every block goes through a staging buffer (as vLLM's small CPU
/// chunks do).
fn small_layout(n: usize) -> BlockLayout {
    BlockLayout::builder()
        .num_blocks(n)
        .num_layers(4)
        .outer_dim(2)
        .page_size(16)
        .inner_dim(8)
        .dtype_bytes(2)
        .build()
        .unwrap()
}

fn disk(tm: &TransferManager, figures: &mut Vec<Figure>) {
    disk_case(tm, figures, ("g2_to_g3_write", "g3_to_g2_read"), layout(64));
    disk_case(
        tm,
        figures,
        ("g2_to_g3_write_small_staged", "g3_to_g2_read_small_staged"),
        small_layout(1024),
    );
}

/// One disk geometry: our transfers host ↔ disk against the raw baseline writing and reading
/// the same bytes (each block's payload rounded up to 4 KiB, O_DIRECT) at the same slot stride.
fn disk_case(
    tm: &TransferManager,
    figures: &mut Vec<Figure>,
    (write_name, read_name): (&'static str, &'static str),
    geometry: BlockLayout,
) {
    let n = geometry.config().num_blocks;
    let block = geometry.config().block_bytes();
    let qd = 8;
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let mut cfg = DiskConfig::new(dir.path().join("ours.bin"));
    cfg.queue_depth = qd;
    cfg.engine = IoEngineKind::Uring;
    let disk = PhysicalLayout::create_disk(geometry, &cfg).unwrap();
    let Backing::Disk(d) = disk.backing() else {
        unreachable!()
    };
    let d = Arc::clone(d);
    let caps = d.capabilities();
    let slot_bytes = d.slot_bytes();
    let raw_len = block.div_ceil(4096) * 4096;
    let raw_file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .custom_flags(libc::O_DIRECT)
        .open(dir.path().join("raw.bin"))
        .unwrap();
    // SAFETY: a valid fd; fallocate has no memory preconditions.
    unsafe { libc::fallocate(raw_file.as_raw_fd(), 0, 0, (n * slot_bytes) as i64) };
    let raw_mem = HostStorage::new(n * raw_len, PinPolicy::TryPin).unwrap();
    let host = PhysicalLayout::allocate_host(geometry, PinPolicy::TryPin).unwrap();
    let base = host.block_addrs(0, 0..1)[0].0;
    for i in 0..n * block {
        // SAFETY: inside the host layout, not registered yet.
        unsafe { *((base + i) as *mut u8) = (i * 7 + i / 4096) as u8 };
    }
    // SAFETY: the baseline's own buffer, not shared.
    unsafe { raw_mem.as_mut_slice().fill(3) };
    let raw_base = raw_mem.as_ptr() as usize;
    let hh = tm.register_layout(host).unwrap();
    let hd = tm.register_layout(disk).unwrap();
    let ids: Vec<usize> = (0..n).collect();
    let fd = raw_file.as_raw_fd();
    let transfer = |src, dst| {
        let t = Instant::now();
        // SAFETY: bench-owned layouts; nothing outside the manager reads or writes their blocks while the transfer runs.
        let out = unsafe { tm.execute_transfer(src, &ids, dst, &ids, TransferOptions::default()) }
            .unwrap()
            .wait();
        assert!(out.is_complete_success(), "{:?}", out.failures().next());
        gib_s(n * block, t.elapsed().as_secs_f64())
    };
    // Figured on the payload bytes, as ours is (the raw side moves `raw_len` per block).
    let raw = |write: bool| {
        raw_uring(fd, raw_base, n, qd, write, raw_len, slot_bytes) * block as f64 / raw_len as f64
    };
    let size = if block >= MIB {
        format!("{} MiB", block / MIB)
    } else {
        format!("{} KiB", block / 1024)
    };
    let (ours, raw_w, ratio) = rounds(7, || transfer(hh, hd), || raw(true));
    figures.push(Figure {
        name: write_name,
        ours,
        raw: raw_w,
        ratio,
        goal: 0.95,
        note: format!(
            "{n} x {size}, qd {qd}, {caps:?}; ours adds a 4 KiB header sector + xxh3-128 per block"
        ),
    });
    let (ours, raw_r, ratio) = rounds(7, || transfer(hd, hh), || raw(false));
    figures.push(Figure {
        name: read_name,
        ours,
        raw: raw_r,
        ratio,
        goal: 0.95,
        note: format!("{n} x {size}, qd {qd}; ours verifies header + xxh3-128 per block"),
    });
    let s = d.buffer_pool_stats();
    eprintln!("{write_name}: disk buffer pool {s:?}");
}

fn object(tm: &TransferManager, rt: &tokio::runtime::Runtime, figures: &mut Vec<Figure>) {
    let env = |k: &str| std::env::var(k).ok();
    let (Some(endpoint), Some(bucket), Some(access_key), Some(secret_key)) = (
        env("KVBM_TEST_S3_ENDPOINT"),
        env("KVBM_TEST_S3_BUCKET"),
        env("KVBM_TEST_S3_ACCESS_KEY"),
        env("KVBM_TEST_S3_SECRET_KEY"),
    ) else {
        eprintln!(
            "object figures skipped: KVBM_TEST_S3_* not set (run `cargo xtask bench physical`)"
        );
        return;
    };
    let n = 32;
    let conc = 8;
    let ns = format!("kvbm-physical-bench/{}", std::process::id());
    let s3 = S3Config {
        endpoint: Some(endpoint),
        bucket,
        region: "us-east-1".into(),
        access_key,
        secret_key,
        allow_http: false,
    };
    // The baseline's own client (the storage keeps its store private).
    let raw: Arc<dyn ObjectStore> = Arc::new(
        object_store::aws::AmazonS3Builder::new()
            .with_bucket_name(&s3.bucket)
            .with_region(&s3.region)
            .with_access_key_id(&s3.access_key)
            .with_secret_access_key(&s3.secret_key)
            .with_virtual_hosted_style_request(false)
            .with_endpoint(s3.endpoint.as_deref().unwrap_or_default())
            .with_allow_http(true)
            .build()
            .unwrap(),
    );
    let store = Arc::new(ObjectStorage::new(
        Arc::clone(&raw),
        ObjectConfig {
            namespace: ns.clone(),
            max_concurrency: conc,
            ..Default::default()
        },
    ));
    let host = PhysicalLayout::allocate_host(layout(n), PinPolicy::TryPin).unwrap();
    let base = host.block_addrs(0, 0..4)[0].0;
    for i in 0..n * BLOCK {
        // SAFETY: inside the host layout, not registered yet.
        unsafe { *((base + i) as *mut u8) = (i * 13) as u8 };
    }
    let bodies: Vec<Bytes> = (0..n)
        .map(|i| {
            // SAFETY: block `i` of the host layout, filled above and not written meanwhile.
            Bytes::copy_from_slice(unsafe {
                std::slice::from_raw_parts((base + i * BLOCK) as *const u8, BLOCK)
            })
        })
        .collect();
    let hh = tm.register_layout(host).unwrap();
    let ho = tm
        .register_layout(PhysicalLayout::object(layout(n), Arc::clone(&store)))
        .unwrap();
    let ids: Vec<usize> = (0..n).collect();
    let keys: Vec<ObjectKey> = (0..n)
        .map(|i| ObjectKey::new(format!("ours/{i}")))
        .collect();
    let raw_path = |i: usize| OPath::from(format!("{ns}/raw/{i}"));
    let transfer = |src, dst| {
        let t = Instant::now();
        // SAFETY: bench-owned layouts; nothing outside the manager reads or writes their blocks while the transfer runs.
        let out = unsafe {
            tm.execute_transfer(
                src,
                &ids,
                dst,
                &ids,
                TransferOptions::with_object_keys(keys.clone()),
            )
        }
        .unwrap()
        .wait();
        assert!(out.is_complete_success(), "{:?}", out.failures().next());
        gib_s(n * BLOCK, t.elapsed().as_secs_f64())
    };
    let raw_put = || {
        let t = Instant::now();
        rt.block_on(
            futures::stream::iter(0..n)
                .map(|i| {
                    let raw = Arc::clone(&raw);
                    let body = bodies[i].clone();
                    async move { raw.put(&raw_path(i), PutPayload::from(body)).await.unwrap() }
                })
                .buffer_unordered(conc)
                .collect::<Vec<_>>(),
        );
        gib_s(n * BLOCK, t.elapsed().as_secs_f64())
    };
    let raw_get = || {
        let t = Instant::now();
        rt.block_on(
            futures::stream::iter(0..n)
                .map(|i| {
                    let raw = Arc::clone(&raw);
                    async move {
                        raw.get(&raw_path(i))
                            .await
                            .unwrap()
                            .bytes()
                            .await
                            .unwrap()
                            .len()
                    }
                })
                .buffer_unordered(conc)
                .collect::<Vec<_>>(),
        );
        gib_s(n * BLOCK, t.elapsed().as_secs_f64())
    };
    let (ours, raw_v, ratio) = rounds(5, || transfer(hh, ho), raw_put);
    figures.push(Figure {
        name: "g2_to_g4_put",
        ours,
        raw: raw_v,
        ratio,
        goal: 0.9,
        note: format!("{n} x 2 MiB, concurrency {conc}, s3s-fs on loopback; ours adds a 96 B header + xxh3-128"),
    });
    let (ours, raw_v, ratio) = rounds(5, || transfer(ho, hh), raw_get);
    figures.push(Figure {
        name: "g4_to_g2_get",
        ours,
        raw: raw_v,
        ratio,
        goal: 0.9,
        note: format!("{n} x 2 MiB, concurrency {conc}; ours verifies + copies into the layout"),
    });
    rt.block_on(async {
        for (i, key) in keys.iter().enumerate() {
            let _ = raw.delete(&raw_path(i)).await;
            let _ = store.delete(key).await;
        }
    });
}

fn main() {
    // `cargo bench` passes `--bench`; a filter argument selects groups by substring.
    let filter: Option<String> = std::env::args().skip(1).find(|a| !a.starts_with('-'));
    let want = |name: &str| filter.as_deref().is_none_or(|f| name.contains(f));
    let tm = TransferManager::new().unwrap();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let mut figures = Vec::new();
    if want("host") {
        host_to_host(&tm, &mut figures);
    }
    if want("disk") {
        disk(&tm, &mut figures);
    }
    if want("object") {
        object(&tm, &rt, &mut figures);
    }
    let items: Vec<String> = figures
        .iter()
        .map(|f| {
            format!(
                "    {{\"name\": \"{}\", \"ours_gib_s\": {:.3}, \"raw_gib_s\": {:.3}, \"ratio\": {:.3}, \"goal\": {}, \"meets_goal\": {}, \"note\": \"{}\"}}",
                f.name,
                f.ours,
                f.raw,
                f.ratio,
                f.goal,
                f.ratio >= f.goal,
                f.note.replace('"', "'")
            )
        })
        .collect();
    println!(
        "{{\n  \"bench\": \"kvbm-physical\",\n  \"block_bytes\": {BLOCK},\n  \"figures\": [\n{}\n  ]\n}}",
        items.join(",\n")
    );
}
