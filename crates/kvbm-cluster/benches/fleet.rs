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
use std::time::{Duration, Instant};

use kvbm_cluster::fleet::FleetTier;
use kvbm_engine::InstanceId;
use kvbm_logical::{BlockEvent, BlockEventKind, SequenceHash, TierId};
use kvbm_tiering::{LookupResult, OffloadKey, ReqContext, SecondaryTierManager};

#[path = "../tests/fleet_kit/mod.rs"]
mod fleet_kit;

use fleet_kit::{Fleet, Member, Shape, job};

const CHUNK: usize = 2 << 20;
const BLOCKS: usize = 64;
const ROUNDS: usize = 9;

/// A member holding `BLOCKS` chunks of 2 MiB (its region and its share), its index room for
/// the lookup bench's 10,000 peer blocks.
fn member(fleet: &Fleet, id: u64, subject: &str) -> Member {
    let sets = [
        ("transport.heartbeat_interval_ms", 100),
        ("transport.snapshot_max_entries", 20000),
    ];
    fleet.join(
        id,
        subject,
        "bench",
        &Shape {
            chunk: CHUNK,
            chunks: BLOCKS,
            sets: &sets,
            texts: &[],
            disk: None,
        },
    )
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
    let fleet = Fleet::new(&nats.url);
    let subject = format!("bench-fleet-{}", std::process::id());
    let mut a = member(&fleet, 0xa, &subject);
    let mut b = member(&fleet, 0xb, &subject);

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
        assert!(
            a.run(job(round * 2, &keys, 0..BLOCKS as i32, false))
                .success
        );
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
        let r = b.run(job(round * 2 + 1, &keys, 0..BLOCKS as i32, true));
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
