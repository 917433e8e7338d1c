//! The fleet tier's two costs (issue 48), each against its baseline in the same run:
//!
//! - **peer load**: instance B's fleet tier loads 64 chunks of 2 MiB that instance A stored:
//!   pulled from A's data plane on loopback (authenticated: both members hold credentials of
//!   one root; every frame's checksum and identity checked), registered in B's share, copied
//!   into B's region, the job reported. Baseline: one raw TCP stream moving the same 128 MiB
//!   (a 1-byte request, the bytes written from one buffer and read into one). Timed round by
//!   round, alternating, the median of the per-round ratios printed (a load change on a shared
//!   machine moves both sides of a round alike). Goal ≥ 0.8.
//! - **lookup**: what a scheduler step's lookups cost through the fleet tier (256 requests ×
//!   64 chunks, every one a miss: the cold step), with 10,000 peer blocks in its index, against
//!   the same tier with an empty index. Goal: within 10%.
//!
//! Run: `cargo xtask bench cluster` (starts NATS), or `cargo bench -p kvbm-cluster --features
//! nats --bench fleet` with `KVBM_TEST_NATS_URL` set.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvbm_cluster::fleet::FleetTier;
use kvbm_cluster::instance::Instance;
use kvbm_cluster::security::{Role, RootKey};
use kvbm_engine::stack::Identities;
use kvbm_engine::{InstanceId, KvbmRuntime};
use kvbm_logical::{BlockEvent, BlockEventKind, SequenceHash, TierId};
use kvbm_physical::{LayoutConfig, ModelFingerprint, Parallelism};
use kvbm_tiering::{
    CpuManagerConfig, CpuPrimaryTier, JobResult, LookupResult, OffloadKey, ReqContext,
    SecondaryTierManager, TierJob,
};

const CHUNK: usize = 2 << 20;
const BLOCKS: usize = 64;
const ROUNDS: usize = 9;

fn fingerprint() -> ModelFingerprint {
    ModelFingerprint::builder()
        .model("bench")
        .dtype("bfloat16")
        .kv_layout("NHD")
        .geometry(LayoutConfig {
            num_blocks: 1,
            num_layers: 1,
            outer_dim: 1,
            page_size: CHUNK / 2,
            inner_dim: 1,
            dtype_bytes: 2,
        })
        .parallelism(Parallelism::Canonical)
        .build()
        .unwrap()
}

struct Member {
    _primary: CpuPrimaryTier,
    tier: FleetTier,
}

fn member(
    root: &RootKey,
    dir: &std::path::Path,
    id: u64,
    nats: &str,
    subject: &str,
    chunks: usize,
) -> Member {
    let id = InstanceId(id);
    let cred = dir.join(format!("{:x}.cred", id.0));
    root.issue(id, Role::Leader, 0, "bench", Duration::from_secs(3600))
        .unwrap()
        .save(&cred)
        .unwrap();
    let rt = KvbmRuntime::builder()
        .set("logical.events.max_delay_ms", 1)
        .set("events.idle_tick_ms", 1)
        .set("events.subject", subject)
        .set("tiers.g1_blocks", 1)
        .set("tiers.g2_blocks", BLOCKS)
        .set("transport.nats_url", nats)
        .set("transport.heartbeat_interval_ms", 100)
        .set("transport.heartbeat_timeout_ms", 5000)
        .set("transport.snapshot_max_entries", 20_000)
        .set("security.trust_root", root.trust_root().to_hex())
        .set("security.credential_file", cred.display().to_string())
        .build()
        .unwrap();
    let identities = Arc::new(Identities::default());
    let instance = rt
        .handle()
        .tokio()
        .block_on(
            Instance::builder(&rt.handle())
                .id(id)
                .geometry(CpuPrimaryTier::block_layout(1, CHUNK).unwrap())
                .fingerprint(fingerprint())
                .identities(identities.clone())
                .build(),
        )
        .unwrap();
    let primary = CpuPrimaryTier::new(CpuManagerConfig::new(chunks), CHUNK).unwrap();
    let tier = FleetTier::new(Arc::new(instance), identities, &primary, "kvbm_fleet")
        .unwrap()
        .owning(rt);
    Member {
        _primary: primary,
        tier,
    }
}

fn run(m: &mut Member, job: TierJob) -> JobResult {
    if job.is_promotion {
        m.tier.submit_load(Arc::new(job));
    } else {
        m.tier.submit_store(Arc::new(job));
    }
    m.tier.drain_jobs().unwrap();
    let mut out = Vec::new();
    m.tier.get_finished_jobs(&mut out);
    out.pop().unwrap()
}

fn job(id: u64, keys: &[OffloadKey], promotion: bool) -> TierJob {
    TierJob {
        job_id: id,
        keys: keys.to_vec(),
        chunk_ids: (0..keys.len() as i32).collect(),
        is_promotion: promotion,
        req_context: ReqContext::new("bench"),
        submit_time: Instant::now(),
    }
}

/// One raw TCP stream of `BLOCKS × CHUNK` bytes on loopback: seconds from the request to the
/// last byte read.
fn raw_round(addr: std::net::SocketAddr, into: &mut [u8]) -> f64 {
    let t = Instant::now();
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_nodelay(true).unwrap();
    s.write_all(&[1]).unwrap();
    s.read_exact(into).unwrap();
    t.elapsed().as_secs_f64()
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() {
    let Some(nats) = kvbm_tests::services::nats("bench_fleet") else {
        eprintln!("fleet bench skipped: no NATS server");
        return;
    };
    let root = RootKey::generate().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let subject = format!("bench-fleet-{}", std::process::id());
    let mut a = member(&root, dir.path(), 0xa, &nats.url, &subject, BLOCKS);
    let mut b = member(&root, dir.path(), 0xb, &nats.url, &subject, BLOCKS);

    // The raw baseline's server: one buffer of the same bytes, written whole per request.
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    std::thread::spawn(move || {
        let payload = vec![7u8; BLOCKS * CHUNK];
        for s in listener.incoming() {
            let mut s = s.unwrap();
            s.set_nodelay(true).unwrap();
            let mut one = [0u8; 1];
            if s.read_exact(&mut one).is_err() {
                continue;
            }
            let _ = s.write_all(&payload);
        }
    });
    let mut sink = vec![0u8; BLOCKS * CHUNK];

    let (mut fleet_s, mut raw_s, mut ratios) = (Vec::new(), Vec::new(), Vec::new());
    let bytes = (BLOCKS * CHUNK) as f64;
    for round in 0..ROUNDS as u64 + 1 {
        // Fresh keys each round: B pulls them (its share evicts the last round's).
        let keys: Vec<OffloadKey> = (0..BLOCKS as u64)
            .map(|i| OffloadKey::from_u64((round + 1) * 1_000_000 + i))
            .collect();
        assert!(run(&mut a, job(round * 2, &keys, false)).success);
        let ctx = ReqContext::new("bench");
        let t = Instant::now();
        while !keys
            .iter()
            .all(|k| b.tier.lookup(k, &ctx) == LookupResult::Hit)
        {
            assert!(t.elapsed() < Duration::from_secs(20), "B never indexed A");
            std::thread::sleep(Duration::from_millis(1));
        }
        let raw = raw_round(addr, &mut sink);
        let t = Instant::now();
        let r = run(&mut b, job(round * 2 + 1, &keys, true));
        let fleet = t.elapsed().as_secs_f64();
        assert!(r.success, "{r:?}");
        if round == 0 {
            continue; // warm-up: connections, first-touch of the buffers
        }
        fleet_s.push(fleet);
        raw_s.push(raw);
        ratios.push(raw / fleet);
    }
    let s = b.tier.stats();
    assert_eq!(s.load_failed, 0);
    println!(
        "fleet/peer_load_64x2MiB      median {:.1} ms ({:.2} GB/s); raw TCP {:.1} ms ({:.2} GB/s); \
         ratio to raw (median of {ROUNDS} alternating rounds) {:.2} (goal >= 0.8)",
        median(fleet_s.clone()) * 1e3,
        bytes / median(fleet_s) / 1e9,
        median(raw_s.clone()) * 1e3,
        bytes / median(raw_s) / 1e9,
        median(ratios),
    );

    // Lookups of a cold step through B's fleet tier: with 10,000 peer blocks indexed, then
    // without them. Every key is a miss (none of them stored anywhere).
    let step: Vec<OffloadKey> = (0..256u64 * 64)
        .map(|i| OffloadKey::from_u64(0xC01D_0000_0000 + i))
        .collect();
    let ctx = ReqContext::new("step");
    let time_step = |tier: &mut FleetTier| -> f64 {
        let mut best = f64::MAX;
        for _ in 0..15 {
            let t = Instant::now();
            for k in &step {
                std::hint::black_box(tier.lookup(k, &ctx));
            }
            best = best.min(t.elapsed().as_secs_f64());
        }
        best
    };
    let peer = InstanceId(0xfeed);
    let entries: Vec<BlockEvent> = (0..10_000u128)
        .map(|i| BlockEvent {
            kind: BlockEventKind::Stored,
            tier: TierId::G2,
            hash: SequenceHash::from_u128((0xABCD_u128 << 64) | (i << 4) | 4),
        })
        .collect();
    let (mut with, mut without) = (Vec::new(), Vec::new());
    for _ in 0..3 {
        b.tier.instance().index().apply_events(peer, &entries);
        assert!(b.tier.instance().index().count_of(peer) >= 10_000);
        with.push(time_step(&mut b.tier));
        b.tier.instance().index().remove_instance(peer);
        without.push(time_step(&mut b.tier));
    }
    let (with, without) = (median(with), median(without));
    println!(
        "fleet/cold_step_lookups      {} lookups: {:.2} ms with 10,000 peer blocks indexed, \
         {:.2} ms with none ({:.0} ns/lookup); ratio {:.3} (goal <= 1.10)",
        step.len(),
        with * 1e3,
        without * 1e3,
        without / step.len() as f64 * 1e9,
        with / without,
    );
    drop((a, b));
}
