//! Fuzzes the block event batches as decoded from NATS.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    kvbm_cluster::fuzzing::event_batch(data);
});
