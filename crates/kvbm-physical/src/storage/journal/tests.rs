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
        let mut live = HashMap::new();
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
