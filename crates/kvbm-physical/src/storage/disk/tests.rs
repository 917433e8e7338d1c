//! Tests of [`DiskStorage`]'s pooled I/O buffers over real files in a temporary directory
//! (O_DIRECT where the filesystem allows it, buffered otherwise): reuse across jobs, no buffer
//! shared by two requests in flight under concurrent jobs, exhaustion, and jobs after failures.

use std::os::unix::fs::FileExt;

use super::*;
use crate::storage::{HostStorage, PinPolicy};

/// A staged geometry: 5000-byte payloads (not a multiple of [`DIRECT_ALIGN`]) in two regions.
const STAGED: usize = 5000;
/// A direct geometry: 8 KiB payloads in two aligned 4 KiB regions.
const DIRECT: usize = 2 * DIRECT_ALIGN;

fn id(slot: usize, round: usize) -> BlockIdentity {
    BlockIdentity::from_u128(((round as u128) << 64) | (slot as u128 + 1))
}

fn storage(
    dir: &tempfile::TempDir,
    name: &str,
    slots: usize,
    payload: usize,
    pool_bytes: usize,
    engine: IoEngineKind,
) -> DiskStorage {
    let mut cfg = DiskConfig::new(dir.path().join(name));
    cfg.engine = engine;
    cfg.buffer_pool_bytes = pool_bytes;
    DiskStorage::create(&cfg, slots, payload).unwrap()
}

/// Host memory for `n` blocks of `payload` bytes, page-aligned (so a [`DIRECT`] payload takes
/// the direct path and a [`STAGED`] one is staged).
struct Blocks {
    mem: HostStorage,
    payload: usize,
}

impl Blocks {
    fn new(n: usize, payload: usize) -> Self {
        Blocks {
            mem: HostStorage::new(n * payload, PinPolicy::Unpinned).unwrap(),
            payload,
        }
    }

    #[allow(clippy::mut_from_ref)] // test memory, one user at a time (see the SAFETY note)
    fn bytes(&self, k: usize) -> &mut [u8] {
        // SAFETY: block k's bytes; each test touches them only between its own jobs.
        unsafe { &mut self.mem.as_mut_slice()[k * self.payload..(k + 1) * self.payload] }
    }

    /// Block k as two regions: the first `split` bytes and the rest.
    fn regions(&self, k: usize) -> Vec<(usize, usize)> {
        let base = self.mem.as_ptr() as usize + k * self.payload;
        let split = if self.payload.is_multiple_of(DIRECT_ALIGN) {
            DIRECT_ALIGN
        } else {
            3000
        };
        vec![(base, split), (base + split, self.payload - split)]
    }

    /// Fills block k with bytes that depend on `tag` and every position.
    fn fill(&self, k: usize, tag: u64) {
        for (j, b) in self.bytes(k).iter_mut().enumerate() {
            *b = (tag
                .wrapping_mul(0x9E37_79B9_7F4A_7C15)
                .wrapping_add(j as u64 * 31)
                >> 17) as u8;
        }
    }

    fn jobs(&self, slots: &[usize], round: usize) -> Vec<DiskBlock> {
        slots
            .iter()
            .enumerate()
            .map(|(k, &s)| (s, id(s, round), self.regions(k)))
            .collect()
    }
}

fn write(d: &DiskStorage, b: &Blocks, slots: &[usize], round: usize) -> Vec<Result<()>> {
    let jobs = b.jobs(slots, round);
    // SAFETY: `b`'s memory is alive and unchanged during the call.
    let written = unsafe { d.write_blocks(&jobs) };
    // Each block written reports the checksum of the payload it was given.
    jobs.iter()
        .zip(written)
        .map(|((_, _, regions), r)| {
            r.map(|sum| {
                let parts = regions.iter().map(|&(p, l)| {
                    // SAFETY: `b`'s memory is alive during the call.
                    unsafe { std::slice::from_raw_parts(p as *const u8, l) }
                });
                assert_eq!(sum, crate::checksum::checksum_slices(parts));
            })
        })
        .collect()
}

fn read(d: &DiskStorage, b: &Blocks, slots: &[usize], round: usize) -> Vec<Result<()>> {
    // SAFETY: `b`'s memory is alive and nothing else touches it during the call.
    unsafe { d.read_blocks(&b.jobs(slots, round)) }
}

fn all_ok<T: std::fmt::Debug>(r: &[Result<T>]) {
    for (k, x) in r.iter().enumerate() {
        assert!(x.is_ok(), "block {k}: {x:?}");
    }
}

#[test]
fn buffers_are_reused_across_jobs() {
    let dir = tempfile::tempdir().unwrap();
    for engine in [IoEngineKind::Uring, IoEngineKind::Psync] {
        let d = storage(
            &dir,
            &format!("{engine:?}.bin"),
            32,
            STAGED,
            1 << 20,
            engine,
        );
        let slots: Vec<usize> = (0..32).collect();
        let src = Blocks::new(32, STAGED);
        let dst = Blocks::new(32, STAGED);
        for k in 0..32 {
            src.fill(k, k as u64);
        }
        all_ok(&write(&d, &src, &slots, 0));
        let first = d.buffer_pool_stats();
        assert_eq!(first.lent, 0, "every buffer is back after the job");
        assert!(first.misses > 0);
        for _ in 0..4 {
            all_ok(&read(&d, &dst, &slots, 0));
            all_ok(&write(&d, &src, &slots, 0));
        }
        let s = d.buffer_pool_stats();
        // 9 jobs x 32 requests, each with a header and a staging buffer.
        assert_eq!(s.hits + s.misses, 9 * 32 * 2, "{s:?}");
        // Whatever one job allocated covers every later job: at most two rounds of the queue
        // are lent at once, and the first job already reached that.
        let qd = d.engine.queue_depth() as u64;
        assert!(s.misses <= 2 * 2 * qd, "{engine:?}: misses {s:?}");
        assert!(s.hits >= 8 * 32 * 2, "{engine:?}: later jobs reuse, {s:?}");
        assert_eq!((s.lent, s.released), (0, 0), "{s:?}");
        assert!(s.idle_bytes > 0 && s.idle_bytes <= s.bound_bytes);
        for k in 0..32 {
            assert_eq!(dst.bytes(k), src.bytes(k), "{engine:?}: block {k}");
        }
    }
}

#[test]
fn no_buffer_is_shared_by_requests_in_flight() {
    // Several threads run write and read jobs at once on one storage, each on its own slots,
    // with a pool bound small enough that buffers are constantly reused, allocated past the
    // bound and freed. A buffer lent to two requests at once would put one block's bytes (or
    // header) into another's slot or read: a read failing its checksum, or returning bytes
    // other than those written.
    const THREADS: usize = 4;
    const PER: usize = 24;
    const ROUNDS: usize = 12;
    let dir = tempfile::tempdir().unwrap();
    for payload in [STAGED, DIRECT] {
        let bound = 3 * (round_up(payload, DIRECT_ALIGN) + DIRECT_ALIGN);
        let d = storage(
            &dir,
            &format!("stress-{payload}.bin"),
            THREADS * PER,
            payload,
            bound,
            IoEngineKind::Auto,
        );
        std::thread::scope(|s| {
            for t in 0..THREADS {
                let d = &d;
                s.spawn(move || {
                    let slots: Vec<usize> = (t * PER..(t + 1) * PER).collect();
                    let src = Blocks::new(PER, payload);
                    let dst = Blocks::new(PER, payload);
                    for round in 0..ROUNDS {
                        for k in 0..PER {
                            src.fill(k, (t * 1_000_000 + round * 1_000 + k) as u64);
                            dst.bytes(k).fill(0xEE);
                        }
                        // Half the rounds write in two jobs of interleaved slots.
                        if round % 2 == 0 {
                            all_ok(&write(d, &src, &slots, round));
                        } else {
                            let (even, odd): (Vec<usize>, Vec<usize>) =
                                (0..PER).partition(|k| k % 2 == 0);
                            for part in [even, odd] {
                                let blocks: Vec<DiskBlock> = part
                                    .iter()
                                    .map(|&k| (slots[k], id(slots[k], round), src.regions(k)))
                                    .collect();
                                // SAFETY: `src` is alive and unchanged during the call.
                                all_ok(&unsafe { d.write_blocks(&blocks) });
                            }
                        }
                        all_ok(&read(d, &dst, &slots, round));
                        for k in 0..PER {
                            assert!(
                                dst.bytes(k) == src.bytes(k),
                                "payload {payload}, thread {t}, round {round}, block {k}: \
                                 bytes differ from those written"
                            );
                            assert_eq!(
                                crate::checksum::checksum_slices([&*dst.bytes(k)]),
                                crate::checksum::checksum_slices([&*src.bytes(k)]),
                            );
                        }
                    }
                });
            }
        });
        let s = d.buffer_pool_stats();
        assert_eq!(s.lent, 0, "{s:?}");
        assert!(s.idle_bytes <= bound, "{s:?}");
        assert!(s.hits > 0, "{s:?}");
    }
}

#[test]
fn an_exhausted_pool_allocates_and_keeps_nothing_past_its_bound() {
    let dir = tempfile::tempdir().unwrap();
    // Bound 0: every lease is an allocation, every return a release; the I/O is unaffected.
    let d = storage(&dir, "zero.bin", 8, STAGED, 0, IoEngineKind::Auto);
    let slots: Vec<usize> = (0..8).collect();
    let src = Blocks::new(8, STAGED);
    let dst = Blocks::new(8, STAGED);
    for k in 0..8 {
        src.fill(k, 100 + k as u64);
    }
    for _ in 0..3 {
        all_ok(&write(&d, &src, &slots, 7));
        all_ok(&read(&d, &dst, &slots, 7));
    }
    let s = d.buffer_pool_stats();
    assert_eq!(
        (s.hits, s.misses, s.released, s.idle_bytes, s.lent),
        (0, 6 * 8 * 2, 6 * 8 * 2, 0, 0),
        "{s:?}"
    );
    for k in 0..8 {
        assert_eq!(dst.bytes(k), src.bytes(k), "block {k}");
    }
    // A bound of one header sector and one staging buffer keeps exactly those.
    let one = DIRECT_ALIGN + round_up(STAGED, DIRECT_ALIGN);
    let d = storage(&dir, "one.bin", 8, STAGED, one, IoEngineKind::Auto);
    all_ok(&write(&d, &src, &slots, 7));
    all_ok(&write(&d, &src, &slots, 7));
    let s = d.buffer_pool_stats();
    assert_eq!((s.idle_bytes, s.lent), (one, 0), "{s:?}");
    assert_eq!(s.hits + s.misses, 2 * 8 * 2);
    assert_eq!(
        s.released,
        s.misses - 2,
        "all but the two kept are freed: {s:?}"
    );
}

#[test]
fn jobs_after_failed_ones_still_work() {
    let dir = tempfile::tempdir().unwrap();
    let d = storage(&dir, "fail.bin", 8, STAGED, 1 << 20, IoEngineKind::Auto);
    let slots: Vec<usize> = (0..8).collect();
    let src = Blocks::new(8, STAGED);
    let dst = Blocks::new(8, STAGED);
    for k in 0..8 {
        src.fill(k, 7 * k as u64);
    }
    all_ok(&write(&d, &src, &slots, 1));
    let good = |d: &DiskStorage| {
        for k in 0..8 {
            dst.bytes(k).fill(0);
        }
        all_ok(&read(d, &dst, &slots, 1));
        for k in 0..8 {
            assert_eq!(dst.bytes(k), src.bytes(k), "block {k}");
        }
    };
    // 1. Verification fails for one block: its slot is overwritten behind the storage's back.
    let other = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(d.path())
        .unwrap();
    let saved = {
        let mut v = vec![0u8; d.slot_bytes()];
        other.read_exact_at(&mut v, d.slot_offset(3)).unwrap();
        v
    };
    other
        .write_all_at(&[0x5A; 100], d.slot_offset(3) + 10)
        .unwrap();
    other.sync_all().unwrap();
    let r = read(&d, &dst, &slots, 1);
    assert!(r[3].is_err(), "the overwritten slot fails: {:?}", r[3]);
    assert!(r.iter().enumerate().all(|(k, x)| k == 3 || x.is_ok()));
    assert_eq!(
        d.buffer_pool_stats().lent,
        0,
        "the failed request's buffers came back"
    );
    other.write_all_at(&saved, d.slot_offset(3)).unwrap();
    other.sync_all().unwrap();
    good(&d);
    // 2. A read naming the wrong identities fails every block.
    let r = read(&d, &dst, &slots, 2);
    assert!(
        r.iter()
            .all(|x| matches!(x, Err(PhysicalError::IdentityMismatch { .. })))
    );
    good(&d);
    // 3. The I/O itself comes up short: the file is cut to half its length.
    let full = std::fs::metadata(d.path()).unwrap().len();
    other.set_len(d.slot_offset(4)).unwrap();
    let r = read(&d, &dst, &slots, 1);
    assert!(r[..4].iter().all(|x| x.is_ok()), "{r:?}");
    assert!(
        r[4..]
            .iter()
            .all(|x| matches!(x, Err(PhysicalError::ShortRead { .. }))),
        "{r:?}"
    );
    assert_eq!(d.buffer_pool_stats().lent, 0);
    other.set_len(full).unwrap();
    all_ok(&write(&d, &src, &slots, 1));
    good(&d);
    // 4. A job whose blocks fail validation before any I/O.
    let mut bad = src.jobs(&slots, 1);
    bad[0].0 = 99;
    // SAFETY: `src` is alive and unchanged during the call.
    let r = unsafe { d.write_blocks(&bad) };
    assert!(matches!(r[0], Err(PhysicalError::InvalidArgument(_))));
    good(&d);
    let s = d.buffer_pool_stats();
    assert_eq!(s.lent, 0, "{s:?}");
    assert!(
        s.hits > s.misses,
        "reuse went on through the failures: {s:?}"
    );
}
