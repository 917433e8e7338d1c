//! [`CancelSweeper`]: removes cancelled containers from every queue of a pipeline.
//!
//! ```text
//!   token.cancel() ──► SweepSignal (epoch += 1) ──┬──► CancelSweeper ──► queue.sweep() for each queue
//!                                                 └──► Batcher (sweeps its open batch)
//!   every sweep_interval ─────────────────────────────► CancelSweeper (backstop)
//! ```
//!
//! The signal is a `watch` channel carrying an epoch counter: any number of cancellations between
//! two sweeps collapse into one sweep, and a subscriber never misses the latest one.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;

use crate::queue::SweepTarget;

/// Wakes everything that sweeps when a token is cancelled.
#[derive(Clone, Debug)]
pub(crate) struct SweepSignal {
    tx: Arc<watch::Sender<u64>>,
}

impl Default for SweepSignal {
    fn default() -> Self {
        Self::new()
    }
}

impl SweepSignal {
    /// A new signal.
    pub(crate) fn new() -> Self {
        Self {
            tx: Arc::new(watch::Sender::new(0)),
        }
    }

    /// Announces a cancellation.
    pub(crate) fn signal(&self) {
        self.tx.send_modify(|e| *e = e.wrapping_add(1));
    }

    /// A receiver that sees every later signal (at least the latest).
    pub(crate) fn subscribe(&self) -> watch::Receiver<u64> {
        self.tx.subscribe()
    }
}

/// Periodically, and immediately on any cancellation, sweeps a set of queues.
pub(crate) struct CancelSweeper {
    targets: Vec<Arc<dyn SweepTarget>>,
    signal: SweepSignal,
    interval: Duration,
}

impl std::fmt::Debug for CancelSweeper {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CancelSweeper")
            .field("targets", &self.targets.len())
            .field("interval", &self.interval)
            .finish()
    }
}

impl CancelSweeper {
    /// A sweeper over `targets`, woken by `signal` and every `interval`.
    pub(crate) fn new(
        targets: Vec<Arc<dyn SweepTarget>>,
        signal: SweepSignal,
        interval: Duration,
    ) -> Self {
        Self {
            targets,
            signal,
            interval: interval.max(Duration::from_micros(100)),
        }
    }

    /// Sweeps every target once; returns how many items were removed.
    pub(crate) fn sweep_once(&self) -> usize {
        self.targets.iter().map(|t| t.sweep()).sum()
    }

    /// Runs until `stop` is cancelled.
    pub(crate) async fn run(self, stop: tokio_util::sync::CancellationToken) {
        let mut rx = self.signal.subscribe();
        let mut tick = tokio::time::interval(self.interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                biased;
                _ = stop.cancelled() => break,
                r = rx.changed() => if r.is_err() { break },
                _ = tick.tick() => {}
            }
            let removed = self.sweep_once();
            if removed > 0 {
                tracing::trace!(removed, "cancel sweep");
            }
        }
    }
}
