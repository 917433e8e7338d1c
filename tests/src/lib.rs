//! Workspace-wide integration tests for kvbm.
//!
//! The tests live in `tests/tests/*.rs`, named by area (`offload_*`, `tiering_*`, ...). This
//! library holds shared helpers for them, most importantly how a test finds the real servers that
//! `cargo xtask ci` starts (see [`services`]), and the fault injectors of the reliability tests
//! (see [`faults`]), a reader of kvbm's Prometheus endpoint (see [`scrape`]), and waiting for
//! a condition in a way that fails the test on timeout (see [`wait`]). Host layouts filled with
//! a pattern are `kvbm_physical::testing` (this crate may not depend on a kvbm crate).

/// A name no other test run uses: `test`, this process's id and the time (for NATS subjects,
/// namespaces and buckets shared by tests running at once).
pub fn unique(test: &str) -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    format!("{test}-{}-{nanos}", std::process::id())
}

pub mod faults;
pub mod scrape;
pub mod services;
pub mod wait;
