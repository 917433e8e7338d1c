//! Fuzzes the block header decoder (disk slots and object bodies).
#![no_main]

use kvbm_physical::checksum::{BlockHeader, HEADER_LEN};

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    if let Ok(h) = BlockHeader::decode(data, &|| "fuzz".to_string()) {
        assert_eq!(&h.to_bytes()[..], &data[..HEADER_LEN]);
    }
});
