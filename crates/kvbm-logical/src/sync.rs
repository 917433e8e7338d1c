//! The synchronisation primitives of the handle-lifetime protocol (the per-slot strong counts,
//! their fence and the store mutex), swapped for [loom](https://docs.rs/loom)'s model-checked
//! ones when the crate's unit tests are built with `RUSTFLAGS="--cfg loom"` (see
//! `loom_tests.rs`). Everything else (registry shards, event buffers, `Arc`) stays `std` /
//! `parking_lot`: those are leaf locks that never wait on a loom primitive while held.
//!
//! Under loom a small ghost ledger also records which cores are alive, so the model can assert
//! that no strong handle ever touches a core whose last `Arc` count (its pin) is gone.

#[cfg(not(all(loom, test)))]
pub(crate) use parking_lot::Mutex;
#[cfg(not(all(loom, test)))]
pub(crate) use std::sync::atomic::{AtomicU32, fence};

#[cfg(all(loom, test))]
pub(crate) use loom::sync::atomic::{AtomicU32, fence};

/// `loom::sync::Mutex` with `parking_lot`'s infallible `lock`.
#[cfg(all(loom, test))]
#[derive(Debug)]
pub(crate) struct Mutex<T>(loom::sync::Mutex<T>);

#[cfg(all(loom, test))]
impl<T> Mutex<T> {
    pub(crate) fn new(value: T) -> Self {
        Self(loom::sync::Mutex::new(value))
    }

    pub(crate) fn lock(&self) -> loom::sync::MutexGuard<'_, T> {
        self.0.lock().expect("a loom model thread panicked")
    }
}

/// Ghost state for the loom model: the addresses of the cores that are alive. No-ops outside
/// `cfg(all(loom, test))`.
pub(crate) mod ghost {
    #[cfg(all(loom, test))]
    static LIVE: std::sync::Mutex<Vec<usize>> = std::sync::Mutex::new(Vec::new());

    /// A core was created at `core`.
    #[inline(always)]
    pub(crate) fn born<T>(core: *const T) {
        #[cfg(all(loom, test))]
        LIVE.lock().unwrap().push(core as usize);
        let _ = core;
    }

    /// The core at `core` is being dropped.
    #[inline(always)]
    pub(crate) fn died<T>(core: *const T) {
        #[cfg(all(loom, test))]
        {
            let mut live = LIVE.lock().unwrap();
            let i = live
                .iter()
                .position(|&p| p == core as usize)
                .expect("a core was dropped twice");
            live.swap_remove(i);
        }
        let _ = core;
    }

    /// Panics if the core at `core` has been dropped.
    #[inline(always)]
    pub(crate) fn assert_alive<T>(core: *const T) {
        #[cfg(all(loom, test))]
        assert!(
            LIVE.lock().unwrap().contains(&(core as usize)),
            "a strong handle touched a dropped core (use after free)"
        );
        let _ = core;
    }

    /// Whether the core at `core` is alive.
    #[cfg(all(loom, test))]
    pub(crate) fn is_alive<T>(core: *const T) -> bool {
        LIVE.lock().unwrap().contains(&(core as usize))
    }
}
