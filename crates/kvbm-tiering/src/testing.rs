//! Helpers for tests that drive a [`TieringOffloadingManager`] over real tiers (feature
//! `testing`, turned on by dev-dependencies only): kvbm-tiering's own end-to-end tests and the
//! engine's tests of the tier set's faces for vLLM (`secondary_disk`, `secondary_object`).

use std::time::{Duration, Instant};

use crate::{
    OffloadKey, OffloadingManager, ReqContext, ScheduleEndContext, TieringOffloadingManager,
};

/// How long [`settle`] waits for the tiers' jobs before it fails the test.
pub const SETTLE_TIMEOUT: Duration = Duration::from_secs(60);

/// The key of chunk `i`.
pub fn key(i: u64) -> OffloadKey {
    OffloadKey::from_u64(i)
}

/// The bytes chunk `i` holds: `len` bytes that differ per chunk, so a chunk read back into
/// another's slot never compares equal.
pub fn chunk_pattern(i: u64, len: usize) -> Vec<u8> {
    (0..len).map(|j| (j as u64 * 31 + i * 7919) as u8).collect()
}

/// Ends one scheduler step (`on_schedule_end`).
///
/// # Panics
/// When the manager refuses the step end.
pub fn end_step(m: &mut TieringOffloadingManager) {
    m.on_schedule_end(&ScheduleEndContext::default())
        .expect("the step ends");
}

/// Steps until no job is pending (the first step end submits staged promotions).
///
/// # Panics
/// When jobs are still pending after [`SETTLE_TIMEOUT`].
pub fn settle(m: &mut TieringOffloadingManager) {
    end_step(m);
    let t = Instant::now();
    while m.has_pending_work() {
        assert!(t.elapsed() < SETTLE_TIMEOUT, "tier jobs did not finish");
        std::thread::sleep(Duration::from_millis(2));
        end_step(m);
    }
    end_step(m);
}

/// Stores the chunks `keys` for request `c`: `prepare_store`, each chunk's
/// [`chunk_pattern`] written into its primary slot, `complete_store`.
///
/// # Panics
/// When the primary has no room or refuses a call.
pub fn store(m: &mut TieringOffloadingManager, c: &ReqContext, keys: &[u64]) {
    let ks: Vec<OffloadKey> = keys.iter().map(|&i| key(i)).collect();
    let o = m
        .prepare_store(&ks, c)
        .expect("prepare_store")
        .expect("room");
    for (k, &i) in ks.iter().zip(keys) {
        let chunk = m.primary_mut().chunk_mut(k).expect("a stored chunk's slot");
        let len = chunk.len();
        chunk.copy_from_slice(&chunk_pattern(i, len));
    }
    m.complete_store(&o.keys_to_store, c, true)
        .expect("complete_store");
}
