//! Fuzzes the presence messages (heartbeats, snapshot requests and pages) as decoded from NATS.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    kvbm_cluster::fuzzing::presence(data);
});
