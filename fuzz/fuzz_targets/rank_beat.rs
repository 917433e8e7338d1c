//! Fuzzes worker rank heartbeats as a leader's membership takes them from NATS.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    kvbm_cluster::fuzzing::rank_beat(data);
});
