//! Fuzzes opening sealed messages: arbitrary bytes, and valid ones with bytes overwritten (refused unless unchanged).
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    kvbm_cluster::fuzzing::sealed(data);
});
