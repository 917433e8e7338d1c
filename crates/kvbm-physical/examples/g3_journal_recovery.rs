//! Restart cost and recovered fraction of the G3 journal ([`JournalFile`]) for 100 k blocks.
//!
//! Writes 100 000 blocks' records the way the G2→G3 lane does (`Removed` before each write,
//! `Stored` after it, in batches of 64), then simulates `kill -9` in the middle of an append (a
//! torn half record at the end) and reopens: the replay time is the restart cost, and the
//! recovered fraction is the share of completed blocks found again. Two shapes are measured: a
//! file that was never compacted (200 k records to replay) and the compacted steady state. The
//! slowest single append is printed too: what a caller (a scheduler's thread) waits at worst,
//! compactions included. The full tier is also run paced at 200 k blocks a second (faster than
//! a disk tier admits blocks), where the appends' 99th percentile and worst case are what a
//! scheduler's step would feel.
//!
//! `cargo run --release -p kvbm-physical --example g3_journal_recovery [blocks]`

use std::time::Instant;

use kvbm_physical::storage::journal::{JOURNAL_RECORD_LEN, encode_record};
use kvbm_physical::{BlockIdentity, JournalFile, JournalGeometry, JournalRecord};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let blocks: u64 = std::env::args()
        .nth(1)
        .map(|a| a.parse())
        .transpose()?
        .unwrap_or(100_000);
    // The third shape is a full tier's steady state: a quarter as many slots as blocks, each
    // new block overwriting the slot of an old one, so the live set stays the same size and
    // the file is compacted again and again.
    for (label, compact_min, num_slots, rate) in [
        ("never compacted", u64::MAX, blocks, None),
        ("compacting", 4096, blocks, None),
        ("full tier, overwriting", 4096, (blocks / 4).max(1), None),
        (
            "full tier, 200k blocks/s",
            4096,
            (blocks / 4).max(1),
            Some(200_000.0),
        ),
    ] {
        let geometry = JournalGeometry {
            payload_bytes: 131_072,
            num_slots,
            file_id: 0x1234_5678_9abc_def0,
            fingerprint: 1,
        };
        let dir = tempfile::tempdir()?;
        let path = dir.path().join("g3.journal");
        let (m, _) = JournalFile::open_with(&path, geometry, compact_min)?;
        let t = Instant::now();
        let mut calls = Vec::with_capacity(blocks as usize / 32 + 2);
        let mut timed = |f: &mut dyn FnMut() -> kvbm_physical::Result<()>| {
            let t = Instant::now();
            let r = f();
            calls.push(t.elapsed());
            r
        };
        for start in (0..blocks).step_by(64) {
            if let Some(rate) = rate {
                let due = t + std::time::Duration::from_secs_f64(start as f64 / rate);
                if let Some(wait) = due.checked_duration_since(Instant::now()) {
                    std::thread::sleep(wait);
                }
            }
            let end = (start + 64).min(blocks);
            let removed: Vec<_> = (start..end)
                .map(|b| JournalRecord::Removed {
                    slot: b % num_slots,
                })
                .collect();
            timed(&mut || m.record(&removed))?;
            let stored: Vec<_> = (start..end)
                .map(|b| JournalRecord::Stored {
                    slot: b % num_slots,
                    identity: BlockIdentity::from_u128(u128::from(b) * 0x9e37_79b9 + 1),
                    checksum: u128::from(b),
                })
                .collect();
            timed(&mut || m.record(&stored))?;
        }
        let append = t.elapsed();
        calls.sort();
        let slowest = calls.last().copied().unwrap_or_default();
        let p99 = calls[calls.len() * 99 / 100];
        let before = m.len();
        let records = m.records_in_file();
        drop(m);
        // kill -9 mid-append: half a record at the end.
        let mut torn = [0u8; JOURNAL_RECORD_LEN];
        encode_record(&JournalRecord::Removed { slot: 0 }, &mut torn);
        let mut data = std::fs::read(&path)?;
        let size = data.len();
        data.extend_from_slice(&torn[..JOURNAL_RECORD_LEN / 2]);
        std::fs::write(&path, &data)?;
        let t = Instant::now();
        let (m, r) = JournalFile::open_with(&path, geometry, compact_min)?;
        let reopen = t.elapsed();
        println!(
            "{label}: {blocks} blocks, {records} records ({:.1} MiB); append {:.0} ms ({:.2} µs/block, calls p99 {:.3} ms, slowest {:.2} ms); \
             restart (replay + torn-tail cut) {:.1} ms; recovered {}/{} = {:.4}; discarded {} bytes",
            size as f64 / (1 << 20) as f64,
            append.as_secs_f64() * 1e3,
            append.as_secs_f64() * 1e6 / blocks as f64,
            p99.as_secs_f64() * 1e3,
            slowest.as_secs_f64() * 1e3,
            reopen.as_secs_f64() * 1e3,
            m.len(),
            before,
            m.len() as f64 / before as f64,
            r.discarded_bytes
        );
    }
    Ok(())
}
