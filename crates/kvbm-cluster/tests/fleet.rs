//! The fleet tier (`kvbm_cluster::fleet::FleetTier`, vLLM's secondary-tier contract over a
//! cluster instance) between instances in one process, over a real `nats-server`, every
//! instance with its own member credential (the default: security on, loopback too):
//!
//! * A stores chunks of its primary region; B's lookups hit them from the index (source: a
//!   peer), B's load puts A's bytes into B's region, byte for byte, and they are B's own hits
//!   afterwards; C of another model fingerprint and D of another namespace never hit;
//! * A serving altered bytes (the data plane's test hook): B's load fails, nothing of it is
//!   written, the entry leaves B's index;
//! * A gone without a word: B's load fails (never wrong bytes, never a hang) and A's blocks
//!   are misses once its heartbeat window passed.
//!
//! Needs `cargo xtask services start` (or skips under `KVBM_TEST_SKIP_SERVICES=1`).

use std::time::Duration;

use kvbm_tests::wait::eventually;
use kvbm_tiering::{CacheHitSource, LookupResult, OffloadKey, ReqContext, SecondaryTierManager};

#[path = "fleet_kit/mod.rs"]
mod fleet_kit;

use fleet_kit::{Fleet, Member, Shape, job};

const CHUNK: usize = 4096;
const CHUNKS: usize = 16;

use kvbm_tests::unique;

/// Small chunks, fast heartbeats (a silent peer forgotten within 400 ms), pulls bounded at 2 s.
fn join(fleet: &Fleet, id: u64, namespace: &str, model: &str) -> Member {
    join_with(fleet, id, namespace, model, None)
}

/// [`join`], with a disk of `disk.1` chunks at `disk.0`.
fn join_with(
    fleet: &Fleet,
    id: u64,
    namespace: &str,
    model: &str,
    disk: Option<(&std::path::Path, usize)>,
) -> Member {
    join_texts(fleet, id, namespace, model, disk, &[])
}

/// [`join_with`], with text keys set too.
fn join_texts(
    fleet: &Fleet,
    id: u64,
    namespace: &str,
    model: &str,
    disk: Option<(&std::path::Path, usize)>,
    texts: &[(&str, &str)],
) -> Member {
    let sets = [
        ("transport.heartbeat_interval_ms", 50),
        ("transport.heartbeat_timeout_ms", 400),
        ("transport.pull_deadline_ms", 2000),
    ];
    fleet.join(
        id,
        namespace,
        model,
        &Shape {
            chunk: CHUNK,
            chunks: CHUNKS,
            sets: &sets,
            texts,
            disk,
        },
    )
}

/// What a test does with a member's region and tier.
trait Drive {
    fn chunk(&self, i: usize) -> &[u8];
    fn write(&mut self, i: usize, f: impl Fn(usize) -> u8);
    fn lookup(&mut self, key: &OffloadKey) -> (LookupResult, CacheHitSource);
}

impl Drive for Member {
    fn chunk(&self, i: usize) -> &[u8] {
        let (addr, len) = self.primary.memory().unwrap().block_addrs(i, 0..1)[0];
        assert_eq!(len, CHUNK);
        // SAFETY: the region's host memory, chunk `i`, read while no job writes it.
        unsafe { std::slice::from_raw_parts(addr as *const u8, len) }
    }

    fn write(&mut self, i: usize, f: impl Fn(usize) -> u8) {
        let (addr, len) = self.primary.memory().unwrap().block_addrs(i, 0..1)[0];
        // SAFETY: the region's host memory, chunk `i`; the test's only writer while no job
        // runs on it.
        let s = unsafe { std::slice::from_raw_parts_mut(addr as *mut u8, len) };
        for (j, b) in s.iter_mut().enumerate() {
            *b = f(j);
        }
    }

    fn lookup(&mut self, key: &OffloadKey) -> (LookupResult, CacheHitSource) {
        let r = self.tier.lookup(key, &ReqContext::new("r"));
        (r, self.tier.cache_hit_source())
    }
}

fn keys(seed: u64, n: usize) -> Vec<OffloadKey> {
    (0..n as u64)
        .map(|i| OffloadKey::from_u64(seed * 1000 + i))
        .collect()
}

fn fill(m: &mut Member, chunks: std::ops::Range<usize>, seed: u8) {
    for i in chunks {
        m.write(i, |j| {
            (j as u8)
                .wrapping_mul(31)
                .wrapping_add(seed)
                .wrapping_add(i as u8)
        });
    }
}

#[test]
fn fleet_a_peer_s_chunks_load_into_another_instance_byte_for_byte() {
    let Some(nats) = kvbm_tests::services::nats("fleet_share") else {
        return;
    };
    let fleet = Fleet::new(&nats.url);
    let ns = unique("fleet");
    let mut a = join(&fleet, 0xa1, &ns, "m");
    let mut b = join(&fleet, 0xb2, &ns, "m");
    let mut c = join(&fleet, 0xc3, &ns, "another-model");
    let mut d = join(&fleet, 0xd4, &unique("other-namespace"), "m");
    let ks = keys(1, 8);

    fill(&mut a, 0..8, 7);
    let stored = a.run(job(1, &ks, 0..8, false));
    assert!(stored.success, "{stored:?}");
    assert_eq!(a.tier.stats().stored, 8);
    // A's stored events reach B's index: every key hits, from a peer.
    eventually("the index to follow", || {
        ks.iter()
            .all(|k| b.lookup(k) == (LookupResult::Hit, CacheHitSource::P2p))
    });
    // Another fingerprint or namespace never hears of them.
    std::thread::sleep(Duration::from_millis(300));
    for k in &ks {
        assert_eq!(c.lookup(k).0, LookupResult::Miss);
        assert_eq!(d.lookup(k).0, LookupResult::Miss);
    }

    fill(&mut b, 0..CHUNKS, 200);
    let loaded = b.run(job(2, &ks, 8..16, true));
    assert!(loaded.success, "{loaded:?}");
    for i in 0..8 {
        assert_eq!(b.chunk(8 + i), a.chunk(i), "chunk {i} differs");
    }
    let s = b.tier.stats();
    assert_eq!((s.loaded_remote, s.loaded_local, s.load_failed), (8, 0, 0));
    // Now B's own: hits from its own share (the fleet's source still), and B serves them in
    // turn.
    let before = b.tier.stats();
    for k in &ks {
        assert_eq!(b.lookup(k), (LookupResult::Hit, CacheHitSource::P2p));
    }
    let after = b.tier.stats();
    assert_eq!(after.local_hits - before.local_hits, 8);
    assert_eq!(after.remote_hits, before.remote_hits);
    let dp = b.tier.instance().data_plane_client_stats().unwrap();
    assert_eq!(dp.digests_refused, 0);
    drop((a, b, c, d));
}

#[test]
fn fleet_altered_bytes_fail_the_load_and_leave_the_index() {
    let Some(nats) = kvbm_tests::services::nats("fleet_altered") else {
        return;
    };
    let fleet = Fleet::new(&nats.url);
    let ns = unique("fleet-altered");
    let mut a = join(&fleet, 0xa1, &ns, "m");
    let mut b = join(&fleet, 0xb2, &ns, "m");
    let ks = keys(2, 4);
    fill(&mut a, 0..4, 3);
    assert!(a.run(job(1, &ks, 0..4, false)).success);
    eventually("the index to follow", || {
        ks.iter().all(|k| b.lookup(k).0 == LookupResult::Hit)
    });

    fill(&mut b, 0..CHUNKS, 99);
    let before: Vec<Vec<u8>> = (8..12).map(|i| b.chunk(i).to_vec()).collect();
    a.tier
        .instance()
        .data_plane()
        .unwrap()
        .corrupt_next_frames(1);
    let loaded = b.run(job(2, &ks, 8..12, true));
    assert!(
        !loaded.success,
        "altered bytes must fail the load: {loaded:?}"
    );
    // The frame that failed and those after it on the broken stream were written nowhere.
    let moved = loaded.successful_keys.clone().unwrap_or_default();
    for (i, k) in ks.iter().enumerate() {
        if !moved.contains(k) {
            assert_eq!(b.chunk(8 + i), &before[i][..], "chunk {i} was written");
        } else {
            assert_eq!(b.chunk(8 + i), a.chunk(i));
        }
    }
    assert!(b.tier.stats().load_failed >= 1);
    // The copy that failed its check left B's index: a miss, not a retry of the same peer.
    let first_bad = ks.iter().find(|k| !moved.contains(k)).unwrap();
    assert_eq!(b.lookup(first_bad).0, LookupResult::Miss);
    drop((a, b));
}

#[test]
fn fleet_a_peer_that_dies_fails_the_load_and_is_forgotten() {
    let Some(nats) = kvbm_tests::services::nats("fleet_dies") else {
        return;
    };
    let fleet = Fleet::new(&nats.url);
    let ns = unique("fleet-dies");
    let mut a = join(&fleet, 0xa1, &ns, "m");
    let mut b = join(&fleet, 0xb2, &ns, "m");
    let ks = keys(3, 4);
    fill(&mut a, 0..4, 5);
    assert!(a.run(job(1, &ks, 0..4, false)).success);
    eventually("the index to follow", || {
        ks.iter().all(|k| b.lookup(k).0 == LookupResult::Hit)
    });
    // A goes away without a word (no departure): its data plane closes with it.
    drop(a);
    fill(&mut b, 0..CHUNKS, 42);
    let before: Vec<Vec<u8>> = (8..12).map(|i| b.chunk(i).to_vec()).collect();
    let loaded = b.run(job(2, &ks, 8..12, true));
    assert!(!loaded.success, "{loaded:?}");
    assert!(loaded.successful_keys.is_none());
    for (i, was) in before.iter().enumerate() {
        assert_eq!(b.chunk(8 + i), &was[..]);
    }
    assert_eq!(b.tier.stats().load_failed, 4);
    // Unreachable: lookups skip A at once (a miss, not another failed load) ...
    for k in &ks {
        assert_eq!(b.lookup(k).0, LookupResult::Miss);
    }
    // ... and within its heartbeat window A is forgotten.
    eventually("the index to follow", || {
        ks.iter().all(|k| b.lookup(k).0 == LookupResult::Miss)
    });
    drop(b);
}

/// The fleet tier's counters reach the metrics table by result and outcome, added when jobs
/// are reported and at a step's end (on the thread driving the tier).
#[test]
fn fleet_a_scrape_counts_lookups_by_result_and_chunks_by_outcome() {
    let Some(nats) = kvbm_tests::services::nats("fleet_metrics") else {
        return;
    };
    let fleet = Fleet::new(&nats.url);
    let ns = unique("fleet-metrics");
    let mut a = join(&fleet, 0xa1, &ns, "m");
    let mut b = join(&fleet, 0xb2, &ns, "m");
    let ks = keys(4, 4);
    fill(&mut a, 0..4, 1);
    assert!(a.run(job(1, &ks, 0..4, false)).success);
    eventually("the index to follow", || {
        ks.iter().all(|k| b.lookup(k).0 == LookupResult::Hit)
    });
    let recorder = metrics_exporter_prometheus::PrometheusBuilder::new().build_recorder();
    let handle = recorder.handle();
    metrics::with_local_recorder(&recorder, || {
        // What the tier counted before is not this scrape's: published at the first step.
        b.tier.on_schedule_end(&Default::default());
    });
    let start = handle.render();
    metrics::with_local_recorder(&recorder, || {
        for k in &ks {
            assert_eq!(b.lookup(k).0, LookupResult::Hit);
        }
        assert_eq!(b.lookup(&OffloadKey::from_u64(99)).0, LookupResult::Miss);
        assert!(b.run(job(2, &ks, 8..12, true)).success);
        b.tier.on_schedule_end(&Default::default());
    });
    let value = |text: &str, series: &str| -> u64 {
        text.lines()
            .find(|l| l.starts_with(series))
            .and_then(|l| l.rsplit(' ').next())
            .map_or(0, |v| v.parse().unwrap())
    };
    let scrape = handle.render();
    let grew = |series: &str| value(&scrape, series) - value(&start, series);
    assert_eq!(
        grew("kvbm_engine_fleet_lookups_total{result=\"remote\"}"),
        4,
        "{scrape}"
    );
    assert_eq!(grew("kvbm_engine_fleet_lookups_total{result=\"miss\"}"), 1);
    assert_eq!(
        grew("kvbm_engine_fleet_chunks_total{outcome=\"loaded_remote\"}"),
        4
    );
    drop((a, b));
}

/// One load job whose chunks two peers hold: each group pulled from its holder, every byte its
/// own.
#[test]
fn fleet_one_load_gathers_chunks_from_two_peers() {
    let Some(nats) = kvbm_tests::services::nats("fleet_two_peers") else {
        return;
    };
    let fleet = Fleet::new(&nats.url);
    let ns = unique("fleet-two");
    let mut a = join(&fleet, 0xa1, &ns, "m");
    let mut c = join(&fleet, 0xc3, &ns, "m");
    let mut b = join(&fleet, 0xb2, &ns, "m");
    let ks = keys(5, 8);
    fill(&mut a, 0..4, 11);
    fill(&mut c, 0..4, 22);
    assert!(a.run(job(1, &ks[..4], 0..4, false)).success);
    assert!(c.run(job(1, &ks[4..], 0..4, false)).success);
    eventually("the index to follow both", || {
        ks.iter().all(|k| b.lookup(k).0 == LookupResult::Hit)
    });
    let loaded = b.run(job(2, &ks, 0..8, true));
    assert!(loaded.success, "{loaded:?}");
    for i in 0..4 {
        assert_eq!(b.chunk(i), a.chunk(i), "chunk {i} (A's)");
        assert_eq!(b.chunk(4 + i), c.chunk(i), "chunk {} (C's)", 4 + i);
    }
    assert_eq!(b.tier.stats().loaded_remote, 8);
    drop((a, b, c));
}

/// A full share evicts its least recently used chunks for new ones, and the peers' index
/// follows: an evicted chunk is a miss for them, a kept one still a hit.
#[test]
fn fleet_a_full_share_evicts_and_the_peers_index_follows() {
    let Some(nats) = kvbm_tests::services::nats("fleet_evicts") else {
        return;
    };
    let fleet = Fleet::new(&nats.url);
    let ns = unique("fleet-evicts");
    let mut a = join(&fleet, 0xa1, &ns, "m");
    let mut b = join(&fleet, 0xb2, &ns, "m");
    let (old, new) = (keys(6, CHUNKS), keys(7, CHUNKS / 2));
    fill(&mut a, 0..CHUNKS, 3);
    assert!(a.run(job(1, &old, 0..CHUNKS as i32, false)).success);
    eventually("B indexes the first fill", || {
        old.iter().all(|k| b.lookup(k).0 == LookupResult::Hit)
    });
    // Half the share again: the oldest half gives way.
    assert!(a.run(job(2, &new, 0..(CHUNKS / 2) as i32, false)).success);
    assert_eq!(a.tier.stats().stored, (CHUNKS + CHUNKS / 2) as u64);
    eventually("B sees the evictions", || {
        let hits = old
            .iter()
            .filter(|k| b.lookup(k).0 == LookupResult::Hit)
            .count();
        hits == CHUNKS / 2 && new.iter().all(|k| b.lookup(k).0 == LookupResult::Hit)
    });
    drop((a, b));
}

/// A member with a disk writes what it shares down (journaled): restarted on the same file it
/// is warm, its chunks hit and load from its disk with their bytes; a peer still finds them in
/// the restarted member's share once loaded there.
#[test]
fn fleet_a_member_with_a_disk_restarts_warm() {
    let Some(nats) = kvbm_tests::services::nats("fleet_disk") else {
        return;
    };
    let fleet = Fleet::new(&nats.url);
    let ns = unique("fleet-disk");
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("a").join("g3.bin");
    let ks = keys(8, 4);
    let stored: Vec<Vec<u8>> = {
        let mut a = join_with(&fleet, 0xa1, &ns, "m", Some((&file, 32)));
        fill(&mut a, 0..4, 9);
        assert!(a.run(job(1, &ks, 0..4, false)).success);
        assert_eq!(a.tier.stats().stored_disk, 4);
        (0..4).map(|i| a.chunk(i).to_vec()).collect()
    };
    // The same member again, on the same file: its share is empty, its disk is not.
    let mut a = join_with(&fleet, 0xa1, &ns, "m", Some((&file, 32)));
    for k in &ks {
        assert_eq!(a.lookup(k).0, LookupResult::Hit, "warm from the disk");
    }
    let loaded = a.run(job(2, &ks, 8..12, true));
    assert!(loaded.success, "{loaded:?}");
    for (i, want) in stored.iter().enumerate() {
        assert_eq!(
            a.chunk(8 + i),
            &want[..],
            "chunk {i} read back from the disk"
        );
    }
    let s = a.tier.stats();
    assert_eq!((s.loaded_disk, s.loaded_local, s.loaded_remote), (4, 0, 0));
    // Staged into the share on the way: a peer pulls them from there.
    let mut b = join(&fleet, 0xb2, &ns, "m");
    eventually("B indexes the staged chunks", || {
        ks.iter().all(|k| b.lookup(k).0 == LookupResult::Hit)
    });
    let pulled = b.run(job(3, &ks, 0..4, true));
    assert!(pulled.success, "{pulled:?}");
    for (i, want) in stored.iter().enumerate() {
        assert_eq!(b.chunk(i), &want[..]);
    }
    drop((a, b));
}

/// A member bound to every interface announces the address its `data_plane_advertise` names,
/// with the port it was given (port 0 there): peers pull from it.
#[test]
fn fleet_a_member_bound_to_every_interface_advertises_a_reachable_address() {
    let Some(nats) = kvbm_tests::services::nats("fleet_advertise") else {
        return;
    };
    let fleet = Fleet::new(&nats.url);
    let ns = unique("fleet-advertise");
    let mut a = join_texts(
        &fleet,
        0xa1,
        &ns,
        "m",
        None,
        &[
            ("transport.data_plane_bind", "0.0.0.0:0"),
            ("transport.data_plane_advertise", "127.0.0.1:0"),
        ],
    );
    let mut b = join(&fleet, 0xb2, &ns, "m");
    let bound = a.tier.instance().data_plane().unwrap().local_addr();
    assert!(bound.ip().is_unspecified());
    eventually("B learns A's address", || {
        b.tier.instance().peers().get(kvbm_engine::InstanceId(0xa1))
            == Some(std::net::SocketAddr::from(([127, 0, 0, 1], bound.port())))
    });
    let ks = keys(9, 2);
    fill(&mut a, 0..2, 4);
    assert!(a.run(job(1, &ks, 0..2, false)).success);
    eventually("the index to follow", || {
        ks.iter().all(|k| b.lookup(k).0 == LookupResult::Hit)
    });
    assert!(b.run(job(2, &ks, 0..2, true)).success);
    assert_eq!(b.chunk(0), a.chunk(0));
    drop((a, b));
}
