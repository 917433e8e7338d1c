//! `kvbm bench tiering`: the scheduler-facing manager (`kvbm-engine`'s `EngineTieringManager`,
//! `kvbm-tiering`'s contract) over real tiers, each path against the raw copy or read it wraps.
//!
//! | path | ours: one scheduler request of `n` blocks | raw baseline |
//! |---|---|---|
//! | `tiering_store` | `prepare_store` → GPU stand-in → G2 copy → `complete_store` | `ptr::copy_nonoverlapping` of the same bytes |
//! | `tiering_load` | `lookup` (HIT) → `prepare_load` → G2 → GPU copy → `complete_load` | `ptr::copy_nonoverlapping` |
//! | `tiering_promote` | `lookup` (HIT_PENDING: the engine promotes G3 → G2) → settle → `lookup` (HIT) → `prepare_load` → G2 → GPU → `complete_load` | raw O_DIRECT io_uring reads of the same blocks |
//!
//! The GPU is a host layout standing in for it (as in `kvbm replay`); G2 is host memory, G3 an
//! O_DIRECT file in `--dir`. Every load's bytes are checked against what was stored (after
//! the timed part; the baselines check nothing). The
//! figures are the manager's overhead over the copy or read itself: key hashing, allocation,
//! registration, holds, and for a promotion the engine's verified move and its task.

use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{Context, bail};
use kvbm_engine::InstanceLeader;
use kvbm_engine::leader::MoversToG2;
use kvbm_engine::manager::EngineTieringManager;
use kvbm_engine::mover::BlockMove;
use kvbm_logical::{BlockManager, BlockRegistry, G1, G2, G3, Tier};
use kvbm_offload::{BlockMover, BoundTier, ExternalMover};
use kvbm_physical::{DiskConfig, LayoutHandle, PhysicalLayout, PinPolicy, TransferManager};
use kvbm_tiering::{LookupResult, OffloadKey, OffloadingManager, ReqContext};

use super::{BLOCK, BenchOutput, BenchResult, base_addr, gib_s, layout, memcpy, raw_uring, rounds};

/// Blocks per request.
const N: usize = 32;
/// The G3 file's queue depth (and the raw baseline's).
const QD: u32 = 8;

fn manager<T: Tier>(registry: &BlockRegistry) -> anyhow::Result<Arc<BlockManager<T>>> {
    Ok(Arc::new(
        BlockManager::<T>::builder()
            .block_count(N)
            .block_size(16)
            .registry(registry.clone())
            .build()?,
    ))
}

struct Rig {
    tm: Arc<TransferManager>,
    rt: tokio::runtime::Runtime,
    mgr: EngineTieringManager,
    g2: Arc<BlockManager<G2>>,
    g2_bound: BoundTier<G2>,
    g3_bound: BoundTier<G3>,
    gpu: LayoutHandle,
    gpu_base: usize,
    /// The bytes block `i` of the GPU stand-in had when it was stored.
    stored: Vec<u8>,
    requests: u64,
}

impl Rig {
    /// One timed copy between the GPU stand-in and G2 slots, through the one mover
    /// (`ExternalMover::copy_slots`: slots the caller manages on both sides, as vLLM's worker).
    fn copy<Src: Tier>(
        &self,
        src: LayoutHandle,
        src_ids: &[usize],
        dst: LayoutHandle,
        dst_ids: &[usize],
    ) -> anyhow::Result<()> {
        let mover = ExternalMover::<Src>::from_layout(&self.tm, src, dst)?;
        // SAFETY: the manager reserved (store) or pinned (load) the G2 slots for this request
        // and nothing else touches the bench's GPU stand-in while the copy runs.
        let started = unsafe { mover.copy_slots(src_ids, dst_ids) };
        let out = futures::executor::block_on(started.map_err(|f| anyhow::anyhow!("{f}"))?);
        if let Some((id, e)) = out
            .iter()
            .enumerate()
            .find_map(|(i, r)| r.as_ref().err().map(|e| (i, e)))
        {
            bail!("block {id} failed: {e}");
        }
        Ok(())
    }

    fn context(&mut self) -> anyhow::Result<ReqContext> {
        self.requests += 1;
        let ctx = ReqContext::new(format!("bench-{}", self.requests));
        self.mgr.on_new_request(&ctx)?;
        Ok(ctx)
    }

    /// Stores `keys` from GPU blocks 0..N.
    fn store(&mut self, keys: &[OffloadKey]) -> anyhow::Result<()> {
        let ctx = self.context()?;
        let out = self
            .mgr
            .prepare_store(keys, &ctx)?
            .context("prepare_store found no room in G2")?;
        if out.keys_to_store.len() != keys.len() {
            bail!("prepare_store skipped keys it never stored");
        }
        let chunks = slots(out.store_spec.chunk_ids())?;
        let ids: Vec<usize> = (0..keys.len()).collect();
        self.copy::<G1>(self.gpu, &ids, self.g2_bound.layout(), &chunks)?;
        self.mgr.complete_store(keys, &ctx, true)?;
        self.mgr.on_request_finished(&ctx)?;
        Ok(())
    }

    /// Looks `keys` up (waiting out promotions), loads them into GPU blocks N..2N and checks
    /// the bytes; returns the seconds the scheduler's calls and copies took (the check after
    /// them is not timed).
    fn load(&mut self, keys: &[OffloadKey], expect_pending: bool) -> anyhow::Result<f64> {
        let t = Instant::now();
        let ctx = self.context()?;
        let first: Vec<LookupResult> = keys.iter().map(|k| self.mgr.lookup(k, &ctx)).collect();
        let want = if expect_pending {
            LookupResult::HitPending
        } else {
            LookupResult::Hit
        };
        if let Some(r) = first.iter().find(|r| **r != want) {
            bail!(
                "lookup returned {} where {} was expected",
                r.name(),
                want.name()
            );
        }
        if expect_pending {
            self.rt.block_on(self.mgr.settle());
            if let Some(k) = keys
                .iter()
                .find(|k| self.mgr.lookup(k, &ctx) != LookupResult::Hit)
            {
                bail!("{k} is not a HIT after its promotion");
            }
        }
        let spec = self.mgr.prepare_load(keys, &ctx)?;
        let chunks = slots(spec.chunk_ids())?;
        let ids: Vec<usize> = (N..N + keys.len()).collect();
        self.copy::<G2>(self.g2_bound.layout(), &chunks, self.gpu, &ids)?;
        self.mgr.complete_load(keys, &ctx)?;
        self.mgr.on_request_finished(&ctx)?;
        let secs = t.elapsed().as_secs_f64();
        // SAFETY: blocks N..2N of the GPU stand-in, just written; nothing writes them now.
        let got = unsafe {
            std::slice::from_raw_parts((self.gpu_base + N * BLOCK) as *const u8, keys.len() * BLOCK)
        };
        if got != &self.stored[..keys.len() * BLOCK] {
            bail!("a loaded block does not hold the bytes that were stored");
        }
        Ok(secs)
    }
}

fn slots(ids: Option<&[i32]>) -> anyhow::Result<Vec<usize>> {
    Ok(ids
        .context("the manager returned a spec that is not G2 slots")?
        .iter()
        .map(|&i| i as usize)
        .collect())
}

const HOST_NOTE: &str = "EngineTieringManager over a host G2; GPU = a host layout";

/// One path's entry: `(ours, baseline, ratio)` medians over `rounds` requests of `N` blocks.
fn result(
    path: &'static str,
    (ours, raw, ratio): (f64, f64, f64),
    rounds: usize,
    baseline: &str,
    note: String,
) -> BenchResult {
    BenchResult {
        path,
        block_bytes: BLOCK,
        blocks: N,
        gib_per_s: ours,
        baseline: baseline.into(),
        baseline_gib_per_s: raw,
        ratio,
        rounds,
        note,
    }
}

fn keys(round: u64) -> Vec<OffloadKey> {
    (0..N as u64)
        .map(|i| OffloadKey::from_u64(round << 32 | i))
        .collect()
}

/// Runs the three paths (see the module docs).
///
/// # Errors
/// Storage that cannot be set up, a refused manager call, a failed or wrong transfer.
pub(super) fn run(
    tm: &Arc<TransferManager>,
    dir: &Path,
    out: &mut BenchOutput,
) -> anyhow::Result<()> {
    let scratch = tempfile::Builder::new()
        .prefix("kvbm-bench-tiering-")
        .tempdir_in(dir)
        .with_context(|| format!("cannot create a scratch directory in {}", dir.display()))?;
    let registry = BlockRegistry::new();
    let (g2, g3) = (manager::<G2>(&registry)?, manager::<G3>(&registry)?);
    // The GPU stand-in: blocks 0..N are stored from, N..2N loaded into.
    let gpu_layout = PhysicalLayout::allocate_host(layout(2 * N)?, PinPolicy::TryPin)?;
    let gpu_base = base_addr(&gpu_layout);
    for i in (0..2 * N * BLOCK).step_by(8) {
        // SAFETY: inside the 2N-block allocation.
        unsafe { *((gpu_base + i) as *mut u64) = (i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) };
    }
    // SAFETY: blocks 0..N, written above; read-only from here on.
    let stored = unsafe { std::slice::from_raw_parts(gpu_base as *const u8, N * BLOCK) }.to_vec();
    let g2_layout = PhysicalLayout::allocate_host(layout(N)?, PinPolicy::TryPin)?;
    let g2_base = base_addr(&g2_layout);
    let mut disk = DiskConfig::new(scratch.path().join("g3.bin"));
    disk.queue_depth = QD;
    let g3_layout = PhysicalLayout::create_disk(layout(N)?, &disk)?;
    let caps = match g3_layout.backing() {
        kvbm_physical::Backing::Disk(d) => format!("{:?}", d.capabilities()),
        _ => bail!("a disk layout without disk backing"),
    };
    let gpu = tm.register_layout(gpu_layout)?;
    let g2_bound = BoundTier::new(tm.clone(), tm.register_layout(g2_layout)?, g2.clone())?;
    let g3_bound = BoundTier::new(tm.clone(), tm.register_layout(g3_layout)?, g3.clone())?;
    let leader = InstanceLeader::builder()
        .g2(g2.clone())
        .g3(g3.clone())
        .build()?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let up: Arc<dyn BlockMove<G3, G2>> = Arc::new(BlockMover::new(&g3_bound, &g2_bound)?);
    let mgr = leader.tiering_manager(
        MoversToG2 {
            g3_to_g2: Some(up),
            ..MoversToG2::default()
        },
        rt.handle().clone(),
    )?;
    let mut rig = Rig {
        tm: tm.clone(),
        rt,
        mgr,
        g2,
        g2_bound,
        g3_bound,
        gpu,
        gpu_base,
        stored,
        requests: 0,
    };
    let r = 9;

    // Store: a fresh request of N new keys per round (each evicts the previous round's).
    let mut round = 0u64;
    let (o, w, q) = rounds(
        r,
        || {
            round += 1;
            let k = keys(round);
            let t = Instant::now();
            rig.store(&k)?;
            Ok(gib_s(N * BLOCK, t.elapsed().as_secs_f64()))
        },
        // SAFETY: the GPU stand-in's and G2's allocations, N blocks each at least.
        || Ok(unsafe { memcpy(gpu_base, g2_base, N) }),
    )?;
    out.results.push(result(
        "tiering_store",
        (o, w, q),
        r,
        "ptr::copy_nonoverlapping",
        format!("{HOST_NOTE}; prepare_store → copy → complete_store"),
    ));

    // Load: the last stored keys, HITs in G2.
    let last = keys(round);
    let (o, w, q) = rounds(
        r,
        || Ok(gib_s(N * BLOCK, rig.load(&last, false)?)),
        // SAFETY: G2's allocation and blocks N..2N of the GPU stand-in's.
        || Ok(unsafe { memcpy(g2_base, gpu_base + N * BLOCK, N) }),
    )?;
    out.results.push(result(
        "tiering_load",
        (o, w, q),
        r,
        "ptr::copy_nonoverlapping",
        format!("{HOST_NOTE}; lookup → prepare_load → copy → complete_load, bytes checked"),
    ));

    // Promote: the engine offloads the stored keys to G3; each round G2 drops them first.
    let on_g2 = rig
        .g2
        .match_blocks(&last.iter().map(|k| rig.mgr.hash_of(k)).collect::<Vec<_>>());
    let down = BlockMover::new(&rig.g2_bound, &rig.g3_bound)?;
    let moved = rig
        .rt
        .block_on(down.move_from(&on_g2, rig.g3_bound.manager().allocate_blocks(N)?));
    if moved.iter().any(Result::is_err) || moved.len() != N {
        bail!("offloading the benchmark's blocks to G3 failed");
    }
    drop((moved, on_g2));
    // The raw baseline reads a file of the same blocks, written once.
    let raw_file = super::open_raw(&scratch.path().join("raw.bin"), true, N)?;
    let fd = std::os::fd::AsRawFd::as_raw_fd(&raw_file);
    raw_uring(fd, gpu_base, N, QD, true)?;
    let (o, w, q) = rounds(
        r,
        || {
            rig.g2.reset_inactive_pool();
            Ok(gib_s(N * BLOCK, rig.load(&last, true)?))
        },
        || raw_uring(fd, gpu_base + N * BLOCK, N, QD, false),
    )?;
    out.results.push(result(
        "tiering_promote",
        (o, w, q),
        r,
        "raw io_uring reads",
        format!(
            "{caps}, queue depth {QD} per transfer; ours: {N} one-block G3 → G2 promotions in flight at once (header + xxh3-128 verified), then G2 → GPU, bytes checked"
        ),
    ));
    Ok(())
}
