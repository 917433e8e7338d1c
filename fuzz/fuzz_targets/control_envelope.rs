//! Fuzzes the control envelopes (requests and responses) as decoded from NATS.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    kvbm_cluster::fuzzing::control_envelope(data);
});
