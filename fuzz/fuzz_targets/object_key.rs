//! Fuzzes the block object key parser: what it accepts renders back to itself.
#![no_main]

use kvbm_physical::{ObjectKey, parse_hash_key};

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    if let Ok(s) = std::str::from_utf8(data) {
        if let Ok(v) = parse_hash_key(s) {
            assert_eq!(ObjectKey::from_u128(v).as_str(), s);
        }
    }
});
