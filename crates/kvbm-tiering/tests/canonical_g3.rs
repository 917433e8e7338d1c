//! TP-independent storage end to end (issue 24, item 2): two tensor-parallel ranks (TP=2) store
//! their head shards through kvbm's worker into canonical CPU chunks, which cascade to a G3
//! disk tier bound to a canonical model fingerprint. A new process's managers (fresh primary
//! memory, the same file) start warm, promote the chunks back, and ranks of TP=1 and TP=4 each
//! load exactly the bytes their own layout needs. The same file opened under a per-rank
//! fingerprint starts cold.

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvbm_physical::{
    BlockLayout, CanonicalPageMapping, DiskConfig, LayoutConfig, LayoutHandle, ModelFingerprint,
    Parallelism, PhysicalLayout, PinPolicy, TransferManager,
};
use kvbm_tiering::*;

const OUTER: usize = 2;
const TOKENS: usize = 4;
const HEADS: usize = 4;
const HEAD_BYTES: usize = 64;
/// The canonical page: `[outer][tokens][all heads][head bytes]`; one page per chunk.
const PAGE: usize = OUTER * TOKENS * HEADS * HEAD_BYTES;
const KEYS: u64 = 4;

fn k(i: u64) -> OffloadKey {
    OffloadKey::from_u64(0xca40_0000 + i)
}

/// The whole (unsharded) page of key `i`: the reference every rank's bytes are cut from.
fn full(i: u64) -> Vec<u8> {
    (0..PAGE)
        .map(|j| (j as u64 * 131 + i * 7919 + (j as u64 >> 7)) as u8)
        .collect()
}

/// What rank `rank` of `tp` holds of a page: its heads of every (outer, token), in order.
fn shard(page: &[u8], tp: usize, rank: usize) -> Vec<u8> {
    let heads = HEADS / tp;
    let mut out = Vec::with_capacity(PAGE / tp);
    for o in 0..OUTER {
        for t in 0..TOKENS {
            let at = (o * TOKENS + t) * HEADS * HEAD_BYTES + rank * heads * HEAD_BYTES;
            out.extend_from_slice(&page[at..at + heads * HEAD_BYTES]);
        }
    }
    out
}

/// The fingerprint of the canonical chunks (what makes them shareable across TP sizes).
fn fingerprint(p: Parallelism) -> ModelFingerprint {
    ModelFingerprint::builder()
        .model("test/canonical-model")
        .dtype("int8")
        .kv_layout("NHD")
        .geometry(LayoutConfig {
            num_blocks: 1,
            num_layers: 1,
            outer_dim: OUTER,
            page_size: TOKENS,
            inner_dim: HEADS * HEAD_BYTES,
            dtype_bytes: 1,
        })
        .parallelism(p)
        .build()
        .unwrap()
}

/// One rank: its GPU stand-in (host memory, one page per block) and its worker, canonical.
struct Rank {
    tm: Arc<TransferManager>,
    gpu: LayoutHandle,
    worker: PhysicalOffloadingWorker,
}

impl Rank {
    fn new(tm: &Arc<TransferManager>, cpu: LayoutHandle, tp: usize, rank: usize) -> Self {
        let local = PAGE / tp;
        let layout = BlockLayout::builder()
            .num_blocks(KEYS as usize)
            .num_layers(1)
            .outer_dim(1)
            .page_size(1)
            .inner_dim(local)
            .dtype_bytes(1)
            .build()
            .unwrap();
        let gpu = tm
            .register_layout(PhysicalLayout::allocate_host(layout, PinPolicy::Unpinned).unwrap())
            .unwrap();
        let mapping =
            CanonicalPageMapping::tensor_parallel(OUTER, TOKENS, HEADS, HEAD_BYTES, tp, rank)
                .unwrap();
        let worker = PhysicalOffloadingWorker::builder(tm.clone(), gpu, cpu)
            .group(vec![CanonicalKVCacheRef {
                tensor_idx: 0,
                page_size_bytes: local,
                mapping: Some(mapping),
            }])
            .layout(ChunkLayout::Canonical)
            .build()
            .unwrap();
        Self {
            tm: tm.clone(),
            gpu,
            worker,
        }
    }

    /// GPU block `b` as bytes. Tests only: no job of this rank runs meanwhile.
    #[allow(clippy::mut_from_ref)]
    fn block(&self, b: usize) -> &mut [u8] {
        let l = self.tm.layout(self.gpu).unwrap();
        let (addr, len) = l.block_addrs(b, 0..1)[0];
        // SAFETY: a block of a live host layout this rank registered; no transfer runs while
        // the test holds the slice.
        unsafe { std::slice::from_raw_parts_mut(addr as *mut u8, len) }
    }

    fn run(&mut self, job: u64) {
        self.worker.wait(&[job]);
        let done = self.worker.get_finished();
        assert_eq!(done.len(), 1);
        assert!(done[0].success, "job {job} failed");
    }
}

/// GPU blocks `0..n` as one group starting at logical block 0.
fn gpu_spec(n: usize) -> GpuLoadStoreSpec {
    GpuLoadStoreSpec::new((0..n as i32).collect(), vec![n], vec![0]).unwrap()
}

fn settle(m: &mut TieringOffloadingManager) {
    let t = Instant::now();
    loop {
        m.on_schedule_end(&ScheduleEndContext::default()).unwrap();
        if !m.has_pending_work() {
            m.on_schedule_end(&ScheduleEndContext::default()).unwrap();
            return;
        }
        assert!(
            t.elapsed() < Duration::from_secs(60),
            "tier jobs did not finish"
        );
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// A manager over a fresh primary of 8 canonical chunks and a G3 tier on `path` bound to
/// `fp`; also the primary's transfer manager and layout (the workers' CPU side).
fn managers(
    path: &std::path::Path,
    fp: &ModelFingerprint,
) -> (TieringOffloadingManager, Arc<TransferManager>, LayoutHandle) {
    let tm = Arc::new(TransferManager::new().unwrap());
    let primary =
        CpuPrimaryTier::with_transfer_manager(CpuManagerConfig::new(8), PAGE, tm.clone()).unwrap();
    let cpu = primary.transfer().unwrap().1;
    let tier = PhysicalTier::disk(&primary, &DiskConfig::new(path), 16, Some(fp)).unwrap();
    let m = TieringOffloadingManager::with_primary(
        primary,
        vec![Box::new(tier)],
        UpstreamFixes::default(),
        false,
    );
    (m, tm, cpu)
}

#[test]
fn written_at_tp2_stored_in_g3_read_at_tp1_and_tp4_after_a_restart() {
    let dir = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("kvbm-tiering-canonical");
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join(format!("g3-{}.bin", std::process::id()));
    let canonical = fingerprint(Parallelism::Canonical);
    let keys: Vec<OffloadKey> = (0..KEYS).map(k).collect();

    // Writer process: both TP=2 ranks store their shards into the canonical chunks the
    // manager hands out; the chunks cascade to G3.
    {
        let (mut m, tm, cpu) = managers(&path, &canonical);
        let c = ReqContext::new("writer");
        m.on_new_request(&c).unwrap();
        let out = m.prepare_store(&keys, &c).unwrap().expect("room");
        assert_eq!(out.keys_to_store, keys);
        for r in 0..2 {
            let mut rank = Rank::new(&tm, cpu, 2, r);
            for (b, i) in (0..KEYS).enumerate() {
                rank.block(b).copy_from_slice(&shard(&full(i), 2, r));
            }
            assert!(
                rank.worker
                    .submit_store(1, &gpu_spec(KEYS as usize), &out.store_spec)
            );
            rank.run(1);
        }
        m.complete_store(&out.keys_to_store, &c, true).unwrap();
        settle(&mut m);
        let tier = m.tier_mut::<PhysicalTier<kvbm_logical::G3>>(0).unwrap();
        assert_eq!(tier.num_ready(), KEYS as usize, "every chunk is on disk");
        m.on_request_finished(&c).unwrap();
        m.shutdown().unwrap();
    }

    // A new process: fresh primary memory, the same file, warm from its journal. The chunks
    // are promoted back, and ranks of TP=1 and TP=4 load exactly their own bytes.
    {
        let (mut m, tm, cpu) = managers(&path, &canonical);
        let c = ReqContext::new("reader");
        m.on_new_request(&c).unwrap();
        for key in &keys {
            assert_eq!(m.lookup(key, &c), LookupResult::HitPending, "on disk");
        }
        settle(&mut m);
        for key in &keys {
            assert_eq!(m.lookup(key, &c), LookupResult::Hit, "promoted");
        }
        let spec = m.prepare_load(&keys, &c).unwrap();
        let mut job = 10;
        for tp in [1, 4] {
            for r in 0..tp {
                let mut rank = Rank::new(&tm, cpu, tp, r);
                for b in 0..KEYS as usize {
                    rank.block(b).fill(0xAA);
                }
                job += 1;
                assert!(
                    rank.worker
                        .submit_load(job, &spec, &gpu_spec(KEYS as usize))
                );
                rank.run(job);
                for (b, i) in (0..KEYS).enumerate() {
                    assert_eq!(
                        rank.block(b),
                        shard(&full(i), tp, r).as_slice(),
                        "TP={tp} rank {r}: block of key {i}"
                    );
                }
            }
        }
        m.complete_load(&keys, &c).unwrap();
        m.on_request_finished(&c).unwrap();
        m.shutdown().unwrap();
    }

    // Under a per-rank fingerprint the same file is another model's: cold, nothing served.
    {
        let (mut m, _tm, _cpu) =
            managers(&path, &fingerprint(Parallelism::Rank { rank: 0, world: 2 }));
        let c = ReqContext::new("other");
        m.on_new_request(&c).unwrap();
        for key in &keys {
            assert_eq!(m.lookup(key, &c), LookupResult::Miss);
        }
        m.shutdown().unwrap();
    }
    let _ = std::fs::remove_file(&path);
    let _ = std::fs::remove_file(path.with_extension("journal"));
}
