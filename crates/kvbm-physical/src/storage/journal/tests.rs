//! Tests of the disk-tier journal: replay, torn tails, damage, resets, compaction, and
//! proptests that the decoders never panic and round-trip.

use super::*;
use proptest::prelude::*;

fn geo() -> JournalGeometry {
    JournalGeometry {
        payload_bytes: 4096,
        num_slots: 64,
        file_id: 0xfeed,
        fingerprint: 0x5eed,
    }
}

fn stored(slot: u64, id: u128) -> JournalRecord {
    JournalRecord::Stored {
        slot,
        identity: BlockIdentity::from_u128(id),
        checksum: id * 7 + 1,
    }
}

#[test]
fn records_survive_reopen_and_later_records_win() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("g3.journal");
    let (m, r) = JournalFile::open(&p, geo()).unwrap();
    assert!(r.created);
    m.record(&[stored(1, 10), stored(2, 20), stored(3, 30)])
        .unwrap();
    m.record(&[JournalRecord::Removed { slot: 2 }, stored(3, 31)])
        .unwrap();
    // Removing a slot that is not listed is recorded (a no-op at replay).
    let before = m.records_in_file();
    m.record(&[JournalRecord::Removed { slot: 9 }]).unwrap();
    assert_eq!(m.records_in_file(), before + 1);
    // Listed and unlisted in one call: the unlisting is written too.
    m.record(&[stored(7, 70), JournalRecord::Removed { slot: 7 }])
        .unwrap();
    drop(m);
    let (m, r) = JournalFile::open(&p, geo()).unwrap();
    assert!(!r.created && r.reset.is_none());
    assert_eq!(r.discarded_bytes, 0);
    assert_eq!(r.records, 8);
    let e = m.entries();
    assert_eq!(e.len(), 2);
    assert_eq!(e[0].slot, 1);
    assert_eq!(e[0].identity, BlockIdentity::from_u128(10));
    assert_eq!(e[1].slot, 3);
    assert_eq!(e[1].identity, BlockIdentity::from_u128(31));
    assert_eq!(e[1].checksum, 31 * 7 + 1);
}

#[test]
fn torn_tail_is_discarded_and_appends_continue_after_the_good_prefix() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("g3.journal");
    let (m, _) = JournalFile::open(&p, geo()).unwrap();
    m.record(&[stored(1, 10), stored(2, 20)]).unwrap();
    drop(m);
    // A torn append: half a record.
    let mut rec = [0u8; JOURNAL_RECORD_LEN];
    encode_record(&stored(4, 40), &mut rec);
    let mut data = std::fs::read(&p).unwrap();
    let good = data.len();
    data.extend_from_slice(&rec[..30]);
    std::fs::write(&p, &data).unwrap();
    let (m, r) = JournalFile::open(&p, geo()).unwrap();
    assert_eq!(r.discarded_bytes, 30);
    assert_eq!(std::fs::metadata(&p).unwrap().len() as usize, good);
    assert_eq!(m.len(), 2);
    m.record(&[stored(5, 50)]).unwrap();
    drop(m);
    let (m, r) = JournalFile::open(&p, geo()).unwrap();
    assert_eq!(r.discarded_bytes, 0);
    assert_eq!(
        m.entries().iter().map(|e| e.slot).collect::<Vec<_>>(),
        [1, 2, 5]
    );
}

#[test]
fn a_damaged_record_cuts_the_replay_there() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("g3.journal");
    let (m, _) = JournalFile::open(&p, geo()).unwrap();
    m.record(&[stored(1, 10), stored(2, 20), stored(3, 30)])
        .unwrap();
    drop(m);
    let mut data = std::fs::read(&p).unwrap();
    data[JOURNAL_HEADER_LEN + JOURNAL_RECORD_LEN + 20] ^= 1; // inside record 2
    std::fs::write(&p, &data).unwrap();
    let (m, r) = JournalFile::open(&p, geo()).unwrap();
    assert_eq!(r.records, 1);
    assert_eq!(r.discarded_bytes, 2 * JOURNAL_RECORD_LEN as u64);
    assert_eq!(m.entries().len(), 1);
}

#[test]
fn another_geometry_or_file_instance_resets() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("g3.journal");
    let (m, _) = JournalFile::open(&p, geo()).unwrap();
    m.record(&[stored(1, 10)]).unwrap();
    drop(m);
    let other = JournalGeometry {
        file_id: 0xbeef,
        ..geo()
    };
    let (m, r) = JournalFile::open(&p, other).unwrap();
    assert!(r.reset.as_deref().unwrap().contains("written for"), "{r:?}");
    assert!(m.is_empty());
    // Garbage is reset too, with a reason.
    std::fs::write(
        &p,
        b"not a journal at all, but long enough to hold a header......",
    )
    .unwrap();
    let (m, r) = JournalFile::open(&p, geo()).unwrap();
    assert!(r.reset.is_some());
    assert!(m.is_empty());
}

#[test]
fn another_fingerprint_starts_cold_and_the_same_one_warm() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("g3.journal");
    let (m, _) = JournalFile::open(&p, geo()).unwrap();
    m.record(&[stored(1, 10), stored(2, 20)]).unwrap();
    drop(m);
    // The same fingerprint: warm.
    let (m, r) = JournalFile::open(&p, geo()).unwrap();
    assert!(r.reset.is_none(), "{r:?}");
    assert_eq!(m.entries().len(), 2);
    drop(m);
    // Another fingerprint (same file, same geometry): cold, with the reason.
    let other = JournalGeometry {
        fingerprint: 0xbad,
        ..geo()
    };
    let (m, r) = JournalFile::open(&p, other).unwrap();
    let why = r.reset.as_deref().unwrap();
    assert!(why.contains("model fingerprint"), "{why}");
    assert!(m.is_empty());
    drop(m);
    // ... and a journal from before fingerprints (field 0) is another fingerprint too.
    let (m, _) = JournalFile::open(
        &p,
        JournalGeometry {
            fingerprint: 0,
            ..geo()
        },
    )
    .unwrap();
    m.record(&[stored(3, 30)]).unwrap();
    drop(m);
    let (m, r) = JournalFile::open(&p, geo()).unwrap();
    assert!(r.reset.is_some());
    assert!(m.is_empty());
}

#[test]
fn out_of_range_slots_are_refused_and_nothing_is_written() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("g3.journal");
    let (m, _) = JournalFile::open(&p, geo()).unwrap();
    let err = m.record(&[stored(1, 10), stored(64, 20)]).unwrap_err();
    assert!(
        matches!(err, PhysicalError::BlockOutOfRange { .. }),
        "{err}"
    );
    assert_eq!(m.records_in_file(), 0);
    assert!(m.is_empty());
}

#[test]
fn compaction_keeps_the_live_set_and_bounds_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("g3.journal");
    let (m, _) = JournalFile::open_with(&p, geo(), 32).unwrap();
    for round in 0..100u128 {
        let slot = (round % 8) as u64;
        m.record(&[JournalRecord::Removed { slot }, stored(slot, round)])
            .unwrap();
    }
    // Compactions run beside the appends: wait for the last, then let one more append start
    // one if the file is due (nothing is appended while it runs).
    m.wait_for_compaction();
    m.record(&[JournalRecord::Removed { slot: 63 }]).unwrap();
    m.wait_for_compaction();
    assert!(m.records_in_file() <= 40, "{}", m.records_in_file());
    let len = std::fs::metadata(&p).unwrap().len();
    assert!(len <= (JOURNAL_HEADER_LEN + 40 * JOURNAL_RECORD_LEN) as u64);
    let live = m.entries();
    drop(m);
    let (m, r) = JournalFile::open_with(&p, geo(), 32).unwrap();
    assert_eq!(r.discarded_bytes, 0);
    assert_eq!(m.entries(), live);
    assert_eq!(live.len(), 8);
    assert_eq!(live[3].identity, BlockIdentity::from_u128(99));
}

#[test]
fn read_entries_does_not_change_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("g3.journal");
    let (m, _) = JournalFile::open(&p, geo()).unwrap();
    m.record(&[stored(1, 10)]).unwrap();
    drop(m);
    let mut data = std::fs::read(&p).unwrap();
    data.extend_from_slice(&[1, 2, 3]);
    std::fs::write(&p, &data).unwrap();
    let e = JournalFile::read_entries(&p, &geo()).unwrap();
    assert_eq!(e.len(), 1);
    assert_eq!(std::fs::read(&p).unwrap(), data);
}

fn arb_record() -> impl Strategy<Value = JournalRecord> {
    prop_oneof![
        (0u64..64, any::<u128>(), any::<u128>()).prop_map(|(slot, id, checksum)| {
            JournalRecord::Stored {
                slot,
                identity: BlockIdentity::from_u128(id),
                checksum,
            }
        }),
        (0u64..64).prop_map(|slot| JournalRecord::Removed { slot }),
    ]
}

proptest! {
    #[test]
    fn record_round_trips(r in arb_record()) {
        let mut b = [0u8; JOURNAL_RECORD_LEN];
        encode_record(&r, &mut b);
        prop_assert_eq!(decode_record(&b).unwrap(), r);
    }

    #[test]
    fn any_single_bit_flip_in_a_record_is_detected(r in arb_record(), bit in 0usize..JOURNAL_RECORD_LEN * 8) {
        let mut b = [0u8; JOURNAL_RECORD_LEN];
        encode_record(&r, &mut b);
        b[bit / 8] ^= 1 << (bit % 8);
        prop_assert!(decode_record(&b).is_err());
    }

    #[test]
    fn decoders_never_panic_on_arbitrary_bytes(bytes in proptest::collection::vec(any::<u8>(), 0..400)) {
        let _ = decode_record(&bytes);
        let _ = decode_header(&bytes);
        let _ = replay(&bytes, &geo());
    }

    #[test]
    fn replay_of_any_prefix_is_a_prefix_of_the_history(
        recs in proptest::collection::vec(arb_record(), 0..40),
        cut in 0usize..4000,
    ) {
        let mut img = encode_header(&geo()).to_vec();
        let mut b = [0u8; JOURNAL_RECORD_LEN];
        for r in &recs {
            encode_record(r, &mut b);
            img.extend_from_slice(&b);
        }
        let cut = (JOURNAL_HEADER_LEN + cut).min(img.len());
        let got = replay(&img[..cut], &geo()).unwrap();
        let whole = (cut - JOURNAL_HEADER_LEN) / JOURNAL_RECORD_LEN;
        prop_assert_eq!(got.records as usize, whole);
        let mut live = LiveEntries::new();
        for r in &recs[..whole] {
            match *r {
                JournalRecord::Stored { slot, identity, checksum } => { live.insert(slot, (identity, checksum)); }
                JournalRecord::Removed { slot } => { live.remove(&slot); }
            }
        }
        prop_assert_eq!(got.live, live);
    }
}

/// A symlink planted at `<journal>.tmp` is never written through: compaction replaces it and
/// the file it pointed to is untouched (issue 23, item 9).
#[test]
fn compaction_never_writes_through_a_planted_tmp_symlink() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("g3.journal");
    let victim = dir.path().join("victim");
    std::fs::write(&victim, b"precious").unwrap();
    std::os::unix::fs::symlink(&victim, dir.path().join("g3.journal.tmp")).unwrap();
    let (m, _) = JournalFile::open(&p, geo()).unwrap();
    m.record(&[stored(1, 10), stored(2, 20)]).unwrap();
    m.compact().unwrap();
    assert_eq!(std::fs::read(&victim).unwrap(), b"precious");
    drop(m);
    let (m, _) = JournalFile::open(&p, geo()).unwrap();
    assert_eq!(
        m.entries().len(),
        2,
        "the compacted journal is the real one"
    );
}

/// Expected live set after `records` applied in order.
fn apply(live: &mut std::collections::BTreeMap<u64, u128>, records: &[JournalRecord]) {
    for r in records {
        match *r {
            JournalRecord::Stored { slot, identity, .. } => {
                live.insert(
                    slot,
                    u128::from_le_bytes(identity.as_bytes()[..16].try_into().unwrap()),
                );
            }
            JournalRecord::Removed { slot } => {
                live.remove(&slot);
            }
        }
    }
}

fn live_of(m: &JournalFile) -> std::collections::BTreeMap<u64, u128> {
    m.entries()
        .into_iter()
        .map(|e| {
            (
                e.slot,
                u128::from_le_bytes(e.identity.as_bytes()[..16].try_into().unwrap()),
            )
        })
        .collect()
}

/// A compaction runs off the appending thread: held between its snapshot and its swap, the
/// appends go on into the old file, and the swap keeps them (copied behind the snapshot), so
/// the compacted file, and a reopen of it, hold exactly what was recorded.
#[test]
fn compaction_runs_beside_appends_and_keeps_what_they_wrote() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("g3.journal");
    let (mut m, _) = JournalFile::open_with(&p, geo(), 16).unwrap();
    let gate = Arc::new(std::sync::Barrier::new(2));
    m.gate_compactions(gate.clone());
    let mut want = std::collections::BTreeMap::new();
    // 8 slots listed, two records each: the 16th record makes the file due.
    for round in 0..8u64 {
        let recs = [
            JournalRecord::Removed { slot: round },
            stored(round, round.into()),
        ];
        m.record(&recs).unwrap();
        apply(&mut want, &recs);
    }
    let len = |p: &Path| std::fs::metadata(p).unwrap().len();
    // The compaction holds at the gate; these appends neither wait for it nor get lost.
    let tail = [
        JournalRecord::Removed { slot: 3 },
        stored(3, 1000),
        JournalRecord::Removed { slot: 5 },
        stored(9, 900),
    ];
    m.record(&tail[..2]).unwrap();
    m.record(&tail[2..]).unwrap();
    apply(&mut want, &tail);
    assert_eq!(m.records_in_file(), 20, "the old file is still the journal");
    assert_eq!(
        len(&p),
        (JOURNAL_HEADER_LEN + 20 * JOURNAL_RECORD_LEN) as u64
    );
    assert_eq!(live_of(&m), want);
    gate.wait();
    m.wait_for_compaction();
    // The snapshot's 8 entries, then the 4 records appended while it was written.
    assert_eq!(m.records_in_file(), 12);
    assert_eq!(
        len(&p),
        (JOURNAL_HEADER_LEN + 12 * JOURNAL_RECORD_LEN) as u64
    );
    assert_eq!(live_of(&m), want);
    // Appends after the swap go to the new file.
    m.record(&[stored(10, 1010)]).unwrap();
    apply(&mut want, &[stored(10, 1010)]);
    drop(m);
    let (m, r) = JournalFile::open_with(&p, geo(), 1 << 20).unwrap();
    assert_eq!(r.discarded_bytes, 0);
    assert!(r.reset.is_none(), "{:?}", r.reset);
    assert_eq!(r.records, 13);
    assert_eq!(live_of(&m), want);
    assert!(!tmp_path(&p).exists());
}

/// Threads append at once while compactions come and go: nothing recorded is lost, in the
/// journal or after a reopen.
#[test]
fn concurrent_appends_and_background_compactions_lose_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("g3.journal");
    let (m, _) = JournalFile::open_with(&p, geo(), 24).unwrap();
    let threads = 4u64;
    // Each thread owns 16 slots, so its own order decides them (records of one call are
    // applied in order; calls of different threads touch different slots).
    let wants: Vec<_> = std::thread::scope(|s| {
        let m = &m;
        let handles: Vec<_> = (0..threads)
            .map(|t| {
                s.spawn(move || {
                    let mut want = std::collections::BTreeMap::new();
                    let mut x = 0x9e37_79b9_7f4a_7c15u64 ^ t;
                    for i in 0..1500u64 {
                        x ^= x << 13;
                        x ^= x >> 7;
                        x ^= x << 17;
                        let slot = t * 16 + x % 16;
                        let recs = if x.is_multiple_of(5) {
                            vec![JournalRecord::Removed { slot }]
                        } else {
                            vec![
                                JournalRecord::Removed { slot },
                                stored(slot, (t << 32 | i).into()),
                            ]
                        };
                        m.record(&recs).unwrap();
                        apply(&mut want, &recs);
                    }
                    want
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let want: std::collections::BTreeMap<u64, u128> = wants.into_iter().flatten().collect();
    m.wait_for_compaction();
    assert_eq!(live_of(&m), want);
    // One more append starts a compaction if the file is due; with nothing appended beside
    // it, the file is then at most the live set and that append.
    m.record(&[JournalRecord::Removed { slot: 63 }]).unwrap();
    let mut want = want;
    want.remove(&63);
    m.wait_for_compaction();
    let max = want.len() as u64 + 1;
    assert!(
        m.records_in_file() <= max.max(128),
        "{}",
        m.records_in_file()
    );
    drop(m);
    let (m, r) = JournalFile::open(&p, geo()).unwrap();
    assert_eq!(r.discarded_bytes, 0);
    assert_eq!(live_of(&m), want);
}
