//! Stored / removed events per tier, batched by size and time, delivered to an [`EventSink`].
//!
//! A manager emits [`BlockEventKind::Stored`] when a hash becomes registered (matchable) in its
//! tier and [`BlockEventKind::Removed`] when it is evicted. Events are buffered in the order the
//! manager's store lock serialised them and handed to the sink in that order, in batches of at
//! most [`EventBatchConfig::max_batch`] events. A batch is flushed when it is full, when an
//! operation finds the oldest buffered event older than [`EventBatchConfig::max_delay_ms`], on
//! [`BlockManager::flush_events`](crate::BlockManager::flush_events), and when the manager's
//! last handle is dropped. There is no background thread and no clock of its own: an idle tier
//! holds a partial batch until its next operation or until its owner flushes it.
//!
//! # Flushing on a timer
//!
//! An owner that wants the age bound to hold while a tier is idle drives it from its own timer:
//! [`BlockManager::next_event_deadline`](crate::BlockManager::next_event_deadline) says when the
//! buffered partial batch becomes due (`None` when nothing is buffered), and
//! [`BlockManager::flush_due_events`](crate::BlockManager::flush_due_events)`(now)` flushes it if
//! it is due at `now` (pass `Instant::now()` when the timer fires). For example, on a thread
//! of the owner's (an async owner sleeps with its runtime's `sleep_until` instead):
//!
//! ```no_run
//! use std::time::{Duration, Instant};
//! # use kvbm_logical::{BlockManager, G2};
//! # let manager = BlockManager::<G2>::builder().block_count(8).build()?;
//!
//! loop {
//!     let now = Instant::now();
//!     let wait = manager
//!         .next_event_deadline()
//!         .map_or(Duration::from_millis(10), |deadline| deadline.saturating_duration_since(now));
//!     std::thread::sleep(wait);
//!     manager.flush_due_events(Instant::now());
//! }
//! # Ok::<(), kvbm_logical::LogicalError>(())
//! ```
//!
//! # Locking
//!
//! Lock order: manager store → event buffer; publish lock → event buffer. The sink is called
//! with the publish lock held (that is what keeps batches in order), so it must be quick (e.g.
//! a channel send) and must never call back into a block manager.

use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use serde::{Deserialize, Serialize};

use crate::hash::SequenceHash;
use crate::tier::TierId;

/// What happened to a block.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum BlockEventKind {
    /// The hash became registered (matchable) in the tier.
    Stored,
    /// The hash was evicted from the tier.
    Removed,
}

/// One event.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct BlockEvent {
    /// Stored or removed.
    pub kind: BlockEventKind,
    /// The tier of the manager that emitted it.
    pub tier: TierId,
    /// The block's hash.
    pub hash: SequenceHash,
}

/// Receives batches of events (the NATS publisher in `kvbm-engine` implements this).
pub trait EventSink: Send + Sync + 'static {
    /// Takes one batch, in emission order. Must not block for long nor call a block manager.
    fn publish(&self, batch: Vec<BlockEvent>);
}

/// A sink that keeps every batch in memory (for tests and tools).
#[derive(Default, Debug)]
pub struct VecSink {
    batches: Mutex<Vec<Vec<BlockEvent>>>,
}

impl VecSink {
    /// An empty sink.
    pub fn new() -> Self {
        Self::default()
    }

    /// The batches received so far.
    pub fn batches(&self) -> Vec<Vec<BlockEvent>> {
        self.batches.lock().clone()
    }

    /// Every event received so far, flattened in order.
    pub fn events(&self) -> Vec<BlockEvent> {
        self.batches.lock().iter().flatten().copied().collect()
    }
}

impl EventSink for VecSink {
    fn publish(&self, batch: Vec<BlockEvent>) {
        self.batches.lock().push(batch);
    }
}

/// Batching settings (serde, with defaults).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct EventBatchConfig {
    /// Most events per batch. Default: 256. At least 1.
    pub max_batch: usize,
    /// A partial batch older than this is flushed by the next operation, or by the owner's
    /// timer through `BlockManager::flush_due_events`. Default: 10 ms.
    pub max_delay_ms: u64,
}

impl Default for EventBatchConfig {
    fn default() -> Self {
        Self {
            max_batch: 256,
            max_delay_ms: 10,
        }
    }
}

struct Buffer {
    events: Vec<BlockEvent>,
    oldest: Option<Instant>,
}

pub(crate) struct EventBatcher {
    sink: Arc<dyn EventSink>,
    max_batch: usize,
    max_delay: Duration,
    buffer: Mutex<Buffer>,
    publish: Mutex<()>,
}

impl EventBatcher {
    pub(crate) fn new(sink: Arc<dyn EventSink>, config: &EventBatchConfig) -> Self {
        Self {
            sink,
            max_batch: config.max_batch.max(1),
            max_delay: Duration::from_millis(config.max_delay_ms),
            buffer: Mutex::new(Buffer {
                events: Vec::new(),
                oldest: None,
            }),
            publish: Mutex::new(()),
        }
    }

    /// Buffers events (called under the store lock); returns whether a flush is due.
    pub(crate) fn push(&self, events: impl IntoIterator<Item = BlockEvent>) -> bool {
        let mut b = self.buffer.lock();
        let before = b.events.len();
        b.events.extend(events);
        let now = Instant::now();
        if b.events.len() > before && b.oldest.is_none() {
            b.oldest = Some(now);
        }
        self.due(&b, now)
    }

    fn due(&self, b: &Buffer, now: Instant) -> bool {
        b.events.len() >= self.max_batch
            || b.oldest
                .is_some_and(|t| now.saturating_duration_since(t) >= self.max_delay)
    }

    /// Flushes if a batch is due (size or age).
    pub(crate) fn maybe_flush(&self) {
        self.flush_due(Instant::now());
    }

    /// When the buffered partial batch becomes due by age; `None` when nothing is buffered.
    pub(crate) fn next_deadline(&self) -> Option<Instant> {
        let b = self.buffer.lock();
        b.oldest.map(|t| t + self.max_delay)
    }

    /// Flushes if a batch is due at `now` (size or age); returns whether it flushed.
    pub(crate) fn flush_due(&self, now: Instant) -> bool {
        let due = self.due(&self.buffer.lock(), now);
        if due {
            self.flush();
        }
        due
    }

    /// Hands every buffered event to the sink, in batches of at most `max_batch`.
    pub(crate) fn flush(&self) {
        let _order = self.publish.lock();
        let events = {
            let mut b = self.buffer.lock();
            b.oldest = None;
            std::mem::take(&mut b.events)
        };
        if events.is_empty() {
            return;
        }
        if events.len() <= self.max_batch {
            self.sink.publish(events);
        } else {
            for chunk in events.chunks(self.max_batch) {
                self.sink.publish(chunk.to_vec());
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::hash::Salt;

    fn ev(i: u32) -> BlockEvent {
        BlockEvent {
            kind: BlockEventKind::Stored,
            tier: TierId::G2,
            hash: SequenceHash::root(Salt::NONE, &[i]),
        }
    }

    #[test]
    fn batches_by_size_in_order() {
        let sink = Arc::new(VecSink::new());
        let b = EventBatcher::new(
            sink.clone(),
            &EventBatchConfig {
                max_batch: 3,
                max_delay_ms: 60_000,
            },
        );
        assert!(!b.push([ev(0), ev(1)]));
        b.maybe_flush();
        assert!(sink.batches().is_empty(), "not due yet");
        assert!(b.push([ev(2), ev(3), ev(4), ev(5), ev(6)]));
        b.flush();
        let batches = sink.batches();
        assert_eq!(
            batches.iter().map(Vec::len).collect::<Vec<_>>(),
            vec![3, 3, 1]
        );
        assert_eq!(sink.events(), (0..7).map(ev).collect::<Vec<_>>());
    }

    #[test]
    fn batches_by_time() {
        let sink = Arc::new(VecSink::new());
        let b = EventBatcher::new(
            sink.clone(),
            &EventBatchConfig {
                max_batch: 1000,
                max_delay_ms: 1,
            },
        );
        b.push([ev(0)]);
        std::thread::sleep(Duration::from_millis(5));
        b.maybe_flush();
        assert_eq!(sink.events(), vec![ev(0)]);
        // nothing buffered: no empty batch
        b.flush();
        assert_eq!(sink.batches().len(), 1);
    }

    #[test]
    fn deadline_and_flush_due_follow_the_owners_clock() {
        let sink = Arc::new(VecSink::new());
        let b = EventBatcher::new(
            sink.clone(),
            &EventBatchConfig {
                max_batch: 1000,
                max_delay_ms: 60_000,
            },
        );
        assert_eq!(b.next_deadline(), None);
        assert!(!b.flush_due(Instant::now()), "nothing buffered");
        let before = Instant::now();
        b.push([ev(0)]);
        let deadline = b.next_deadline().expect("a partial batch is buffered");
        assert!(deadline >= before + Duration::from_secs(60));
        // a later push does not move the deadline: it is the oldest event's
        b.push([ev(1)]);
        assert_eq!(b.next_deadline(), Some(deadline));
        assert!(!b.flush_due(deadline - Duration::from_millis(1)));
        assert!(sink.batches().is_empty());
        assert!(b.flush_due(deadline));
        assert_eq!(sink.batches(), vec![vec![ev(0), ev(1)]]);
        assert_eq!(b.next_deadline(), None);
        // size-due batches are flushed regardless of `now`
        let b = EventBatcher::new(
            sink.clone(),
            &EventBatchConfig {
                max_batch: 1,
                max_delay_ms: 60_000,
            },
        );
        b.push([ev(2)]);
        assert!(b.flush_due(before));
        assert_eq!(sink.events().last(), Some(&ev(2)));
    }
}
