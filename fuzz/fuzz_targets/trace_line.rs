//! Fuzzes the Mooncake trace line parser of `kvbm replay` (the very file, included as is).
#![no_main]

#[path = "../../crates/kvbm-cli/src/replay/trace_line.rs"]
#[allow(dead_code)]
mod trace_line;

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    if let Ok(text) = std::str::from_utf8(data) {
        if let Ok(Some(l)) = trace_line::parse_trace_line(text) {
            // What parses names whole milliseconds and ids, nothing else.
            let _ = (l.timestamp_ms, l.hash_ids.len());
        }
    }
});
