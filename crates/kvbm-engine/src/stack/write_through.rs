//! The write-through from the scheduler-facing manager's stores to the G2→G3 and G2→G4 lanes
//! ([`WriteThrough`]): what [`FrontEnd::Tiering`](super::FrontEnd::Tiering) adds to the lanes.
//! The manager's store sink buffers what `complete_store` registered (held strong: a G2 block
//! is not evicted before it reached the lower tiers); a flush enqueues the buffer on the lanes,
//! each lane with vLLM's back-pressure detector when `offload.write_through.backpressure` is
//! set.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use crate::config::WriteThroughConfig;
use crate::error::Result;
use crate::manager::{LaneStats, StoreSink};
use kvbm_logical::{G2, ImmutableBlock, TierId};
use kvbm_offload::{ObjectPipeline, OffloadError, OffloadHandle, Pipeline};
use kvbm_tiering::tiering::{BackpressureDetector, EmaConfig};

use parking_lot::Mutex;

use super::Counters;

/// The longest a stored block waits in the write-through buffer ([`WriteThrough`]).
const WRITE_THROUGH_DELAY: Duration = Duration::from_millis(2);

/// The buffered blocks (each with whether only request-level lanes take it), and when the
/// oldest of them was buffered.
type Buffered = (Vec<(ImmutableBlock<G2>, bool)>, Option<Instant>);

/// The pipeline a lower lane enqueues on.
enum LaneTarget {
    G3(Arc<Pipeline<G2>>),
    G4(Arc<ObjectPipeline>),
}

/// One lower lane as the write-through feeds it: its pipeline, whether it is request level,
/// its back-pressure detector, and its enqueues in flight with their counters.
struct Lane {
    tier: TierId,
    target: LaneTarget,
    request_level: bool,
    detector: Option<BackpressureDetector>,
    /// Enqueues not finished: the handle and when it was enqueued.
    in_flight: Vec<(OffloadHandle, Instant)>,
    stats: LaneStats,
}

impl Lane {
    fn name(&self) -> &'static str {
        match self.target {
            LaneTarget::G3(_) => "G2→G3",
            LaneTarget::G4(_) => "G2→G4",
        }
    }

    fn enqueue(&self, blocks: Vec<ImmutableBlock<G2>>) -> Result<OffloadHandle, OffloadError> {
        match &self.target {
            LaneTarget::G3(p) => p.enqueue_blocking(blocks, None),
            LaneTarget::G4(p) => p.pipeline().enqueue_blocking(blocks, None),
        }
    }

    /// Settles the finished enqueues: their written blocks, time and failures into the
    /// counters, and (with back-pressure) into the detector: a write's latency is from its
    /// enqueue to its last block's outcome (the lane's timing trace; the time it is seen
    /// finished when the lane records none).
    fn settle(&mut self, block_bytes: u64) {
        let now = Instant::now();
        let mut done = Vec::new();
        self.in_flight.retain(|(h, at)| match h.try_result() {
            Some(r) => {
                done.push((h.clone(), *at, r));
                false
            }
            None => true,
        });
        for (h, at, r) in done {
            let end = h
                .timings()
                .iter()
                .filter_map(|(_, t)| t.finished)
                .max()
                .unwrap_or(now);
            let elapsed = end.saturating_duration_since(at);
            let written = r.completed_blocks.len() as u64;
            let failed = !r.failed_blocks.is_empty();
            self.stats.written_blocks += written;
            self.stats.write_seconds += elapsed.as_secs_f64();
            if failed {
                self.stats.failed_enqueues += 1;
            }
            if let Some(d) = &mut self.detector {
                if failed {
                    d.on_store_failed();
                }
                if written > 0 {
                    d.on_store_completed(elapsed, written * block_bytes);
                }
            }
        }
    }

    /// The counters since the last call.
    fn take_stats(&mut self) -> LaneStats {
        let mut s = std::mem::take(&mut self.stats);
        s.in_flight = self.in_flight.len();
        if let Some(d) = &mut self.detector {
            s.latency_ema = Some(d.store_latency_ema());
            (s.stores_dropped, s.blocks_dropped) = d.pop_stores_dropped();
        }
        s
    }
}

/// State shared by the manager's sink and the stack's flushes. Lock order: `buffer` is taken
/// and released before `lanes`; `lanes` is held while the stack's `handles` is pushed to
/// (lanes → handles); each is a leaf otherwise.
struct Shared {
    buffer: Mutex<Buffered>,
    lanes: Mutex<Vec<Lane>>,
    /// Whether some lane is request level (fixed at build).
    request_level: bool,
}

/// The write-through from the scheduler-facing manager's stores to the G2→G3 and G2→G4 lanes.
///
/// The manager's sink ([`WriteThrough::sink`]) only buffers what a `complete_store`
/// registered, and for request-level lanes what a request already had in G2 when it stored
/// (strong handles: a G2 block is not evicted before it reached the lower tiers);
/// [`WriteThrough::flush`] enqueues the buffer once it holds a batch or its oldest block has
/// waited [`WRITE_THROUGH_DELAY`], so one enqueue (a wake-up of the lane) carries many
/// requests' blocks while a stored block still reaches G3/G4 (and other instances, through G4)
/// promptly; it is flushed whole before the caller idles. Buffered blocks are at most a batch
/// plus one request; a caller about to wait for G2 room flushes it first (the replay's
/// `wait_for_room`), and [`TierStack::finish`](super::TierStack::finish) before it drains.
///
/// With back-pressure (`offload.write_through.backpressure`), each lane has vLLM's EMA
/// detector: before an enqueue the detector may drop it (counted; the blocks stay in G2,
/// where the next store of a request reusing them can offer them again), and each finished
/// enqueue feeds it the write's latency per MiB. Promotions are never gated.
pub(crate) struct WriteThrough {
    shared: Arc<Shared>,
    handles: Arc<Mutex<Vec<OffloadHandle>>>,
    counters: Arc<Counters>,
    /// Blocks per enqueue.
    batch: usize,
    block_bytes: u64,
}

/// The manager's end of the write-through: buffers, never waits.
struct Sink(Arc<Shared>);

impl Sink {
    fn buffer(&self, blocks: Vec<ImmutableBlock<G2>>, request_level_only: bool) {
        let mut b = self.0.buffer.lock();
        b.1.get_or_insert_with(Instant::now);
        b.0.extend(blocks.into_iter().map(|x| (x, request_level_only)));
    }
}

impl StoreSink for Sink {
    fn stored(&mut self, blocks: Vec<ImmutableBlock<G2>>) {
        self.buffer(blocks, false);
    }

    fn request_level(&mut self, blocks: Vec<ImmutableBlock<G2>>) {
        if self.0.request_level {
            self.buffer(blocks, true);
        }
    }

    fn has_request_level(&self) -> bool {
        self.0.request_level
    }

    fn lane_stats(&mut self) -> Vec<(TierId, LaneStats)> {
        self.0
            .lanes
            .lock()
            .iter_mut()
            .map(|l| (l.tier, l.take_stats()))
            .collect()
    }
}

impl WriteThrough {
    /// A write-through to the given lanes, enqueueing `batch` blocks at a time, configured by
    /// `[offload.write_through]`.
    ///
    /// # Errors
    /// [`EngineError::Config`](crate::error::EngineError) (key
    /// `offload.write_through.request_level`) when a request-level lane is not built.
    pub(super) fn new(
        g2_to_g3: Option<Arc<Pipeline<G2>>>,
        g2_to_g4: Option<Arc<ObjectPipeline>>,
        config: &WriteThroughConfig,
        handles: Arc<Mutex<Vec<OffloadHandle>>>,
        counters: Arc<Counters>,
        batch: usize,
        block_bytes: usize,
    ) -> Result<Self> {
        let mut lanes = Vec::new();
        let targets = [
            (
                TierId::G3,
                "local",
                config.g3_watermarks,
                g2_to_g3.map(LaneTarget::G3),
            ),
            (
                TierId::G4,
                "obj",
                config.g4_watermarks,
                g2_to_g4.map(LaneTarget::G4),
            ),
        ];
        for (tier, kind, watermarks, target) in targets {
            let request_level = config.request_level.contains(&tier);
            let Some(target) = target else {
                if request_level {
                    return Err(crate::error::EngineError::config(
                        "offload.write_through.request_level",
                        format!(
                            "{tier:?} is request level, but this stack has no G2→{tier:?} lane"
                        ),
                    ));
                }
                continue;
            };
            let detector = if config.backpressure {
                let mut preset = EmaConfig::default_for(kind, None);
                if let Some([high, low]) = watermarks {
                    (preset.high_water_s, preset.low_water_s) = (high, low);
                }
                Some(BackpressureDetector::new(preset).map_err(|e| {
                    crate::error::EngineError::config(
                        "offload.write_through.backpressure",
                        e.to_string(),
                    )
                })?)
            } else {
                None
            };
            lanes.push(Lane {
                tier,
                target,
                request_level,
                detector,
                in_flight: Vec::new(),
                stats: LaneStats::default(),
            });
        }
        let request_level = lanes.iter().any(|l| l.request_level);
        Ok(WriteThrough {
            shared: Arc::new(Shared {
                buffer: Mutex::default(),
                lanes: Mutex::new(lanes),
                request_level,
            }),
            handles,
            counters,
            batch: batch.max(1),
            block_bytes: block_bytes as u64,
        })
    }

    /// The manager's store sink (nothing to buffer without a lower lane).
    pub(super) fn sink(&self) -> Box<dyn StoreSink> {
        Box::new(Sink(self.shared.clone()))
    }

    /// Enqueues the buffer on the lower lanes once it holds a batch or has waited long
    /// enough (`all`: whatever it holds): every block on every lane, a request-level block on
    /// the request-level lanes only; a lane under back-pressure may drop its share. Settles the
    /// lanes' finished enqueues first.
    pub(crate) fn flush(&self, all: bool) {
        let blocks = {
            let mut b = self.shared.buffer.lock();
            let due =
                b.0.len() >= self.batch || b.1.is_some_and(|t| t.elapsed() >= WRITE_THROUGH_DELAY);
            if b.0.is_empty() || !(all || due) {
                drop(b);
                Vec::new()
            } else {
                b.1 = None;
                std::mem::take(&mut b.0)
            }
        };
        let mut lanes = self.shared.lanes.lock();
        for lane in lanes.iter_mut() {
            lane.settle(self.block_bytes);
        }
        if blocks.is_empty() {
            return;
        }
        for lane in lanes.iter_mut() {
            let mine: Vec<ImmutableBlock<G2>> = blocks
                .iter()
                .filter(|(_, only_request_level)| !only_request_level || lane.request_level)
                .map(|(b, _)| b.clone())
                .collect();
            if mine.is_empty() {
                continue;
            }
            if let Some(d) = &mut lane.detector
                && !d.should_store(mine.len())
            {
                continue; // dropped under back-pressure (the detector counts it)
            }
            let n = mine.len();
            match lane.enqueue(mine) {
                Ok(h) => {
                    self.counters
                        .offload_enqueued
                        .fetch_add(n as u64, Ordering::Relaxed);
                    self.handles.lock().push(h.clone());
                    lane.in_flight.push((h, Instant::now()));
                }
                // Only a lane that is shutting down refuses; the blocks stay in G2.
                Err(e) => {
                    tracing::warn!(error = %e, "the {} lane refused stored blocks", lane.name())
                }
            }
        }
    }
}
