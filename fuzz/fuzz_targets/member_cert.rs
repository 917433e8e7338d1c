//! Fuzzes the member certificate decoder and the trust-root check.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    kvbm_engine::cluster::fuzzing::member_cert(data);
});
