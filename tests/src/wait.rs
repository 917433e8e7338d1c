//! Waiting for a condition in a test: [`eventually`] (a thread) and [`eventually_async`] (a
//! tokio task) poll a condition until it holds or the patience runs out, and then **fail the
//! test**, naming what was awaited. A wait that returned quietly on timeout would let a test
//! go on as if the condition held.
//!
//! One patience for every wait ([`PATIENCE`]): a condition that holds at all holds in well under
//! a second on an idle machine; the margin is for a loaded CI machine, and a test that passes
//! never waits it out.

use std::time::{Duration, Instant};

/// How long a wait polls before it fails the test.
pub const PATIENCE: Duration = Duration::from_secs(20);

/// Polls `f` every few milliseconds on this thread until it returns true; panics naming `what`
/// after [`PATIENCE`].
#[track_caller]
pub fn eventually(what: &str, f: impl FnMut() -> bool) {
    eventually_within(PATIENCE, what, f)
}

/// [`eventually`] with an explicit patience.
#[track_caller]
pub fn eventually_within(limit: Duration, what: &str, mut f: impl FnMut() -> bool) {
    let start = Instant::now();
    while start.elapsed() < limit {
        if f() {
            return;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    assert!(f(), "timed out after {limit:?} waiting for: {what}");
}

/// [`eventually`] from a tokio task (sleeps yield to the runtime).
pub async fn eventually_async(what: &str, f: impl FnMut() -> bool) {
    eventually_async_within(PATIENCE, what, f).await
}

/// [`eventually_async`] with an explicit patience.
pub async fn eventually_async_within(limit: Duration, what: &str, mut f: impl FnMut() -> bool) {
    let start = Instant::now();
    while start.elapsed() < limit {
        if f() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(f(), "timed out after {limit:?} waiting for: {what}");
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_condition_that_comes_true_ends_the_wait() {
        let mut n = 0;
        eventually("the third poll", || {
            n += 1;
            n >= 3
        });
        assert_eq!(n, 3);
    }

    #[test]
    #[should_panic(expected = "timed out after 50ms waiting for: never")]
    fn a_condition_that_never_holds_fails_the_test() {
        eventually_within(Duration::from_millis(50), "never", || false);
    }

    #[tokio::test]
    #[should_panic(expected = "waiting for: never (async)")]
    async fn an_async_wait_fails_too() {
        eventually_async_within(Duration::from_millis(50), "never (async)", || false).await;
    }
}
