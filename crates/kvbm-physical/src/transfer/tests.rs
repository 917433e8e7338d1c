//! The manager's own settings (moves are tested in `tests/`).

use super::*;

/// The calling thread's nice value.
fn nice_here() -> i32 {
    own_nice().unwrap()
}

/// Builds a manager with `worker_nice` on a fresh thread (so the test thread keeps its
/// priority) and returns the builder's nice and what a worker, a blocking-pool thread started
/// from outside and one started from a worker, and a thread a worker starts each run at.
fn nice_seen(worker_nice: u8) -> (i32, [i32; 4]) {
    std::thread::spawn(move || {
        let tm = TransferManager::with_config(TransferConfig {
            worker_nice,
            ..TransferConfig::default()
        })
        .unwrap();
        let worker = tm.spawn_io(async { nice_here() });
        // The two blocking tasks meet, so they run on two threads (neither reuses the other's).
        let meet = Arc::new(std::sync::Barrier::new(2));
        let m = meet.clone();
        let blocking = tm.spawn_blocking(move || {
            m.wait();
            nice_here()
        });
        let inner = tm.spawn_io(async move {
            tokio::task::spawn_blocking(move || {
                meet.wait();
                nice_here()
            })
            .await
            .unwrap()
        });
        let started = tm.spawn_io(async { std::thread::spawn(nice_here).join().unwrap() });
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        let seen = rt.block_on(async {
            [
                worker.await.unwrap(),
                blocking.await.unwrap(),
                inner.await.unwrap(),
                started.await.unwrap(),
            ]
        });
        (nice_here(), seen)
    })
    .join()
    .unwrap()
}

#[test]
fn worker_nice_lowers_every_runtime_thread_and_what_it_starts() {
    let (builder, seen) = nice_seen(3);
    let want = (builder + 3).min(i32::from(MAX_NICE));
    assert_eq!(seen, [want; 4], "builder at nice {builder}");
}

#[test]
fn worker_nice_zero_keeps_the_builders_priority() {
    let (builder, seen) = nice_seen(0);
    assert_eq!(seen, [builder; 4]);
}

#[test]
fn worker_nice_stops_at_the_highest_niceness() {
    let (_, seen) = nice_seen(MAX_NICE);
    assert_eq!(seen, [i32::from(MAX_NICE); 4]);
}

#[test]
fn worker_nice_above_19_is_refused_naming_it() {
    let e = TransferManager::with_config(TransferConfig {
        worker_nice: 20,
        ..TransferConfig::default()
    })
    .unwrap_err();
    assert!(matches!(e, PhysicalError::InvalidArgument(_)), "{e}");
    assert!(e.to_string().contains("worker_nice"), "{e}");
}
