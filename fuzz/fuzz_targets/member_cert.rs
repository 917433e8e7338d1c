//! Fuzzes the member certificate decoder and the trust-root check.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    kvbm_cluster::fuzzing::member_cert(data);
});
