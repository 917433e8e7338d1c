//! Property tests of every decoder that reads bytes from outside the process: the block header
//! (disk slots and object bodies), the G3 journal header and records, and the block object key.
//!
//! These run in `cargo xtask ci` in place of the `fuzz/` targets (which `cargo xtask fuzz`
//! runs): same functions, bounded time. Each decoder must never panic, must round-trip what
//! its encoder writes, and must refuse what it did not write with a typed error.

use kvbm_physical::checksum::{BlockHeader, HEADER_LEN};
use kvbm_physical::storage::journal::{
    JOURNAL_HEADER_LEN, JOURNAL_RECORD_LEN, decode_header, decode_record, encode_header,
    encode_record, replay,
};
use kvbm_physical::{
    BlockIdentity, JournalGeometry, JournalRecord, ObjectKey, PhysicalError, parse_hash_key,
};
use proptest::prelude::*;

fn loc() -> String {
    "test".into()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2048))]

    #[test]
    fn block_header_decode_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..200)) {
        match BlockHeader::decode(&bytes, &loc) {
            Ok(h) => prop_assert_eq!(&h.to_bytes()[..], &bytes[..HEADER_LEN]),
            Err(e) => prop_assert!(matches!(
                e,
                PhysicalError::ShortRead { .. }
                    | PhysicalError::CorruptHeader { .. }
                    | PhysicalError::NotFound { .. }
            ), "{e}"),
        }
    }

    #[test]
    fn block_header_round_trips(len: u64, slot: u64, checksum: u128, id: u128, binding: u128) {
        let h = BlockHeader { len, slot, checksum, identity: BlockIdentity::from_u128(id), binding };
        prop_assert_eq!(BlockHeader::decode(&h.to_bytes(), &loc).unwrap(), h);
    }

    #[test]
    fn journal_decoders_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..600)) {
        let g = JournalGeometry { payload_bytes: 4096, num_slots: 16, file_id: 1, fingerprint: 7 };
        if let Ok(r) = decode_record(&bytes) {
            let mut again = [0u8; JOURNAL_RECORD_LEN];
            encode_record(&r, &mut again);
            prop_assert_eq!(&again[..], &bytes[..JOURNAL_RECORD_LEN]);
        }
        if let Ok(h) = decode_header(&bytes) {
            prop_assert_eq!(&encode_header(&h)[..], &bytes[..JOURNAL_HEADER_LEN]);
        }
        if let Ok(r) = replay(&bytes, &g) {
            prop_assert!(r.good_len as usize <= bytes.len());
            prop_assert!(r.live.keys().all(|s| *s < 16));
        }
    }

    #[test]
    fn journal_records_on_a_valid_header_replay_or_stop(
        tail in proptest::collection::vec(any::<u8>(), 0..400),
        slot in 0u64..32,
    ) {
        let g = JournalGeometry { payload_bytes: 4096, num_slots: 16, file_id: 1, fingerprint: 7 };
        let mut img = encode_header(&g).to_vec();
        let mut rec = [0u8; JOURNAL_RECORD_LEN];
        encode_record(&JournalRecord::Removed { slot }, &mut rec);
        img.extend_from_slice(&rec);
        img.extend_from_slice(&tail);
        let r = replay(&img, &g).unwrap();
        // A record naming a slot beyond the file ends the replay there.
        prop_assert_eq!(r.records >= 1, slot < 16);
    }

    #[test]
    fn object_keys_parse_only_their_canonical_form(s in "\\PC{0,40}") {
        if let Ok(v) = parse_hash_key(&s) {
            let key = ObjectKey::from_u128(v);
            prop_assert_eq!(key.as_str(), s.as_str());
        }
    }

    #[test]
    fn object_keys_round_trip(v: u128) {
        prop_assert_eq!(ObjectKey::from_u128(v).parse_hash().unwrap(), v);
    }
}

#[test]
fn object_key_parser_refuses_signs_case_and_lengths() {
    for bad in [
        "+0000000000000000000000000000000",
        "0000000000000000000000000000000A",
        "000",
        "00000000000000000000000000000000.lock",
        "",
    ] {
        let e = parse_hash_key(bad).unwrap_err();
        assert!(e.to_string().contains("not a block key"), "{bad}: {e}");
    }
}

/// Found by `cargo xtask fuzz` (target `block_header`): a header whose reserved bytes were not
/// zero decoded as if they were, so two byte strings read as one header. Any nonzero reserved
/// byte is now refused as a corrupt header.
#[test]
fn block_header_with_nonzero_reserved_bytes_is_corrupt() {
    let h = BlockHeader {
        len: 4096,
        slot: 7,
        checksum: 0xfeed,
        identity: BlockIdentity::from_u128(42),
        binding: 9,
    };
    for i in 12..16 {
        let mut bytes = h.to_bytes();
        bytes[i] = 39;
        let e = BlockHeader::decode(&bytes, &loc).unwrap_err();
        assert!(
            matches!(e, PhysicalError::CorruptHeader { ref reason, .. } if reason.contains("reserved")),
            "byte {i}: {e}"
        );
    }
}
