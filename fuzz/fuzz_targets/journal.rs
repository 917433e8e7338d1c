//! Fuzzes the G3 journal decoders: header, record, and whole-image replay.
#![no_main]

use kvbm_physical::JournalGeometry;
use kvbm_physical::storage::journal::{
    JOURNAL_RECORD_LEN, decode_header, decode_record, encode_record, replay,
};

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    if let Ok(r) = decode_record(data) {
        let mut again = [0u8; JOURNAL_RECORD_LEN];
        encode_record(&r, &mut again);
        assert_eq!(&again[..], &data[..JOURNAL_RECORD_LEN], "a record decodes to what encodes it");
    }
    let _ = decode_header(data);
    let g = JournalGeometry { payload_bytes: 4096, num_slots: 64, file_id: 7, fingerprint: 9 };
    if let Ok(r) = replay(data, &g) {
        assert!(r.good_len as usize <= data.len());
        assert!(r.live.keys().all(|s| *s < 64));
    }
});
