//! Fuzzes the data plane's response head and frame header (what a client reads).
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    kvbm_cluster::fuzzing::dataplane_response(data);
});
