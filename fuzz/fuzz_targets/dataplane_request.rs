//! Fuzzes the data plane's request head and hashes (what a server reads).
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    kvbm_cluster::fuzzing::dataplane_request(data);
});
