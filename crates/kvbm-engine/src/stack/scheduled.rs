//! [`FrontEnd::Tiering`](super::FrontEnd::Tiering): the stack is driven as vLLM's scheduler drives its
//! offloading manager, through `kvbm-tiering`'s contract served over the engine's tiers
//! ([`EngineTieringManager`](crate::manager::EngineTieringManager)).
//!
//! ```text
//!  on_new_request
//!  G1 match (the inference engine's own prefix cache)
//!  lookup(k) for the blocks after it, until a MISS:
//!     HIT          in G2 (a block read ahead from G3 counts as a G3 hit)
//!     HIT_PENDING  in G3/G4 (or another instance's shared G4): the engine promotes it to G2
//!                  ──► the request waits for the step (settle) and looks up again
//!  prepare_load(hits) ──► the worker copies the G2 slots to G1, every block checked against its
//!                         bytes ──► complete_load     (a failed block: the prefix ends before it)
//!  compute the rest in G1
//!  prepare_store(computed) ──► the worker copies them G1 → the G2 slots ──► complete_store
//!     └─► the manager's store sink: the registered G2 blocks go to the G2→G3 and G2→G4 lanes
//!         (write-through, held strong until written below; enqueued in batches)
//!  on_request_finished
//! ```
//!
//! What a failed promotion leaves is the manager's business: the key reads MISS (never a hit)
//! until the block is stored again; the caller recomputes it. A G1 copy that fails or brings
//! wrong bytes cuts the prefix there; what follows is recomputed (never served).
//!
//! Ownership: the manager pins the loaded G2 blocks between `prepare_load` and
//! `complete_load`, and owns the store's G2 slots between `prepare_store` and
//! `complete_store`, so nothing else touches those slots while the copies run. Both copies are
//! kvbm-offload moves, inline on this thread (host to host: G1 is a host stand-in): the load an
//! inline, checked `BlockMover` (`G2ToG1`), the store an inline `ExternalMover` into the G2
//! slots `prepare_store` reserved (the manager, not the move, registers them at
//! `complete_store`; that reservation is the store's safety argument). Started asynchronously
//! on the transfer manager's threads, the store measured slower here (the issue, the wait and
//! the completion cost more than the copy they overlap, on two cores). The request holds its G1
//! blocks until the end of [`TierStack::serve_scheduled`].

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use super::context::{Context, stack_error};
use crate::config::WriteThroughConfig;
use crate::error::Result;
use crate::manager::{LaneStats, StoreSink};
use futures::FutureExt;
use kvbm_logical::{G1, G2, ImmutableBlock, SequenceHash, TierId};
use kvbm_offload::{MoveSource, ObjectPipeline, OffloadError, OffloadHandle, Pipeline};
use kvbm_tiering::tiering::{BackpressureDetector, EmaConfig};
use kvbm_tiering::{LookupResult, OffloadKey, OffloadScope, OffloadingManager, ReqContext};

use parking_lot::Mutex;

use super::{Counters, HitSource, MovePath, Served, TierStack};

/// Lookup passes a request may wait through before it takes the prefix that is ready.
const MAX_PASSES: usize = 4;

/// The longest a stored block waits in the write-through buffer ([`WriteThrough`]).
const WRITE_THROUGH_DELAY: Duration = Duration::from_millis(2);

impl TierStack {
    /// Serves one request through the scheduler-facing manager: lookups until a miss (waiting
    /// for promotions), the load of the hits, the store of the rest.
    /// `keys[i]` is the key of the block registered under `hashes[i]`.
    ///
    /// # Errors
    /// Only when the request cannot be served at all (G1 too small) or the manager refused a
    /// call it must accept (a bug); failed or rejected transfers are counted and their blocks
    /// recomputed.
    pub fn serve_scheduled(
        &mut self,
        hashes: &[SequenceHash],
        keys: &[OffloadKey],
    ) -> Result<Served> {
        debug_assert_eq!(hashes.len(), keys.len());
        self.admit(hashes);
        let n = hashes.len();
        let mut served = Served::default();
        let before = self.onboard_tally();
        let ctx = ReqContext::new(format!("replay-{}", self.served_requests));
        // A request-level request offers every block it has to the store (its prefix hits
        // too), as vLLM's connector does for a REQUEST_LEVEL answer.
        let request_level = self
            .sched_mut()?
            .on_new_request(&ctx)
            .context("on_new_request")?
            .policy
            == OffloadScope::RequestLevel;

        // 1. The inference engine's own prefix cache, then the manager's lookups.
        let t = Instant::now();
        let mut held: Vec<ImmutableBlock<G1>> = self.g1.manager.match_blocks(hashes);
        let at = held.len();
        served.hits[0] = at as u64;
        self.times.lookup += t.elapsed().as_secs_f64();
        let (ready, sources) = self.look_up(&ctx, &hashes[at..], &keys[at..])?;

        // 2. Load the hits: G2 → G1, every block checked.
        let mut end = at;
        if ready > 0 {
            let t = Instant::now();
            let loaded = self.load(&ctx, &hashes[at..at + ready], &keys[at..at + ready])?;
            end = at + loaded.len();
            held.extend(loaded);
            self.times.g2_to_g1 += t.elapsed().as_secs_f64();
        }
        let after = self.onboard_tally();
        served.onboarded = after[0] - before[0];
        served.verified = after[1] - before[1];
        served.corrupt = after[2] - before[2];
        served.count_hits(&sources[..end - at]);

        // 3. Compute the rest in G1, then store it through the manager (a request-level
        //    request: every block, so the manager hands its resident ones to the
        //    request-level lanes).
        if end < n || request_level {
            let t = Instant::now();
            let computed = self.compute(&hashes[end..])?;
            served.computed = computed.len() as u64;
            self.times.compute += t.elapsed().as_secs_f64();
            held.extend(computed);
            let t = Instant::now();
            let from = if request_level { 0 } else { end };
            self.store(&ctx, &keys[from..], &held[from..])?;
            if let Some(w) = &self.write_through {
                w.flush(false);
            }
            self.times.offload_enqueue += t.elapsed().as_secs_f64();
        }
        let sched = self.sched_mut()?;
        sched
            .on_request_finished(&ctx)
            .context("on_request_finished")?;
        // The stack keeps no event consumer: the engine's own events (G2's event sink) are
        // what other instances follow.
        drop(sched.take_events());
        served.publish();
        // End of the "forward pass": the request's G1 blocks become inactive (evictable).
        drop(held);
        Ok(served)
    }

    fn sched_mut(&mut self) -> Result<&mut crate::manager::EngineTieringManager> {
        self.sched
            .as_mut()
            .ok_or_else(|| stack_error!("the tiering scheduler needs G2 (--g2-blocks > 0)"))
    }

    /// Where the block `h` is before the lookup (the tier its hit counts for; a block read
    /// ahead from G3 into G2 counts for G3).
    fn source_of(&mut self, h: SequenceHash) -> HitSource {
        let registry = self.g1.manager.registry();
        if registry.is_present(h, TierId::G2) {
            return HitSource::Tier(if self.read_ahead_staged.remove(&h) {
                TierId::G3
            } else {
                TierId::G2
            });
        }
        if registry.is_present(h, TierId::G3) {
            return HitSource::Tier(TierId::G3);
        }
        let own_g4 = registry.is_present(h, TierId::G4);
        match &self.shared_g4 {
            // Written by another instance (or adopted from its events by this lookup).
            Some(s) if !own_g4 || !s.own().lock().contains(&h) => HitSource::OtherInstance,
            _ => HitSource::Tier(TierId::G4),
        }
    }

    /// The scheduler's lookups over `keys` until the first MISS, waiting (as a request waits
    /// for the next step) while promotions are pending. Returns how many blocks are HITs now
    /// and the tier each came from.
    fn look_up(
        &mut self,
        ctx: &ReqContext,
        hashes: &[SequenceHash],
        keys: &[OffloadKey],
    ) -> Result<(usize, Vec<HitSource>)> {
        let mut sources: Vec<HitSource> = Vec::with_capacity(keys.len());
        let mut pass = 0;
        loop {
            let t = Instant::now();
            let (mut ready, mut first_pending) = (0, None);
            for (i, (k, h)) in keys.iter().zip(hashes).enumerate() {
                if i == sources.len() {
                    let s = self.source_of(*h);
                    sources.push(s);
                }
                match self.sched_mut()?.lookup(k, ctx) {
                    LookupResult::Hit => ready = i + 1,
                    LookupResult::HitPending => {
                        first_pending.get_or_insert(i);
                        ready = i + 1;
                    }
                    LookupResult::Miss | LookupResult::Retry => break,
                }
            }
            self.times.lookup += t.elapsed().as_secs_f64();
            pass += 1;
            let Some(p) = first_pending else {
                sources.truncate(ready);
                return Ok((ready, sources));
            };
            if pass == MAX_PASSES {
                sources.truncate(p);
                return Ok((p, sources));
            }
            // The step ends; the promotions settle before the request is scheduled again.
            let t = Instant::now();
            let from_g4 = sources[p..ready].iter().any(|s| s.is_g4());
            let sched = self.sched.as_mut().expect("checked by sched_mut");
            self.session_rt.block_on(sched.settle());
            let waited = t.elapsed().as_secs_f64();
            if from_g4 {
                self.times.g4_to_g2 += waited;
            } else {
                self.times.g3_to_g2 += waited;
            }
        }
    }

    /// `prepare_load` → the G2 → G1 copy (bytes checked) → `complete_load`. Returns the G1
    /// blocks of the longest prefix that arrived whole and right.
    fn load(
        &mut self,
        ctx: &ReqContext,
        hashes: &[SequenceHash],
        keys: &[OffloadKey],
    ) -> Result<Vec<ImmutableBlock<G1>>> {
        let spec = match self.sched_mut()?.prepare_load(keys, ctx) {
            Ok(s) => s,
            Err(e) => {
                // A HIT that is gone by now: the last lookup pass (cut after MAX_PASSES) started
                // promotions whose G2 allocations may evict an unheld G2 hit before it. The
                // manager took no hold; the request recomputes instead (a lost hit, never a
                // wrong one).
                tracing::debug!(error = %e, "prepare_load refused; the prefix is recomputed");
                self.load_refused += 1;
                return Ok(Vec::new());
            }
        };
        let slots = spec
            .chunk_ids()
            .ok_or_else(|| stack_error!("prepare_load returned a spec that is not G2 slots"))?;
        let src: Vec<MoveSource> = slots
            .iter()
            .zip(hashes)
            .map(|(s, h)| MoveSource::from((*s as usize, *h)))
            .collect();
        let dst = match self.g1.manager.allocate_blocks(src.len()) {
            Ok(d) => d,
            Err(_) => self.allocate_g1(src.len())?,
        };
        let g2_to_g1 = self
            .movers
            .as_ref()
            .map(|m| m.g2_to_g1.clone())
            .ok_or_else(|| stack_error!("no G2→G1 path"))?;
        // The slots are the G2 blocks `prepare_load` pinned for this request; they stay pinned
        // (nothing writes them) until `complete_load` below.
        let moved = g2_to_g1.copy_slots(&src, dst);
        self.sched_mut()?
            .complete_load(keys, ctx)
            .context("complete_load")?;
        // The failed blocks were reported to the shared list; the prefix ends at the first.
        drop(std::mem::take(&mut *self.onboard.failed.lock()));
        let mut out = Vec::with_capacity(moved.len());
        for m in moved {
            match m {
                Ok(b) => out.push(b),
                Err(_) => break,
            }
        }
        Ok(out)
    }

    /// `prepare_store`, waiting while G2 is full of blocks the lanes are still writing below
    /// (as the sessions' G1→G2 lane waits for G2 room): up to `offload.g1_to_g2.room_patience_ms` while a
    /// lane has work, and a short grace once it has none (a lane drops its blocks just after it
    /// reports them done). `None`: G2 has no room to give.
    fn prepare_store(
        &mut self,
        ctx: &ReqContext,
        keys: &[OffloadKey],
    ) -> Result<Option<kvbm_tiering::PrepareStoreOutput>> {
        const GRACE: Duration = Duration::from_millis(50);
        let total = self.g2.as_ref().map_or(0, |g| g.manager.total_blocks());
        if keys.len() > total {
            // More than G2 holds at all: no wait can make room.
            return Ok(None);
        }
        let started = Instant::now();
        let mut idle_since: Option<Instant> = None;
        for round in 0.. {
            let out = self
                .sched_mut()?
                .prepare_store(keys, ctx)
                .context("prepare_store")?;
            if out.is_some() {
                return Ok(out);
            }
            if round == 0 {
                self.g2_space_waits.fetch_add(1, Ordering::Relaxed);
            }
            if let Some(w) = &self.write_through {
                w.flush(true);
            }
            self.complete_read_aheads(usize::MAX);
            if self.lane_pending() > 0 {
                idle_since = None;
            } else if idle_since.get_or_insert_with(Instant::now).elapsed() > GRACE {
                return Ok(None);
            }
            if started.elapsed() >= self.g2_room_patience {
                return Ok(None);
            }
            std::thread::sleep(Duration::from_micros(200));
        }
        unreachable!("the loop returns")
    }

    /// `prepare_store` → the G1 → G2 copy → `complete_store`; the manager hands what it
    /// registered to the lower lanes (its store sink, [`WriteThrough`]). `blocks[i]` is
    /// the G1 block of `keys[i]`.
    fn store(
        &mut self,
        ctx: &ReqContext,
        keys: &[OffloadKey],
        blocks: &[ImmutableBlock<G1>],
    ) -> Result<()> {
        let Some(out) = self.prepare_store(ctx, keys)? else {
            // G2 has no evictable block: nothing is stored (as vLLM skips the store).
            self.no_space += keys.len() as u64;
            return Ok(());
        };
        self.filtered_blocks += (keys.len() - out.keys_to_store.len()) as u64;
        if out.keys_to_store.is_empty() {
            return Ok(());
        }
        let slots = out
            .store_spec
            .chunk_ids()
            .ok_or_else(|| stack_error!("prepare_store returned a spec that is not G2 slots"))?;
        // `keys_to_store` is `keys` filtered, in order.
        let mut src = Vec::with_capacity(slots.len());
        let mut j = 0;
        for k in &out.keys_to_store {
            while j < keys.len() && keys[j] != *k {
                j += 1;
            }
            let b = blocks.get(j).ok_or_else(|| {
                stack_error!("prepare_store named a key the request did not give")
            })?;
            // Host to host, inline: no header to bind an identity into, so the source is its
            // slot and hash (no digest read).
            src.push(MoveSource::from((b.block_id(), b.sequence_hash())));
        }
        let dst: Vec<usize> = slots.iter().map(|s| *s as usize).collect();
        let mover = self
            .store_mover
            .as_ref()
            .ok_or_else(|| stack_error!("no G1→G2 store path"))?;
        // SAFETY: the G2 slots were reserved by `prepare_store` for this request (the manager
        // holds them as unregistered `MutableBlock`s until `complete_store`; nothing reads or
        // writes them meanwhile); the G1 sources are registered blocks this request holds.
        let moved = unsafe { mover.move_blocks(&src, &dst) }
            .now_or_never()
            .expect("an inline move is done when it returns");
        let (mut ok, mut failed) = (Vec::with_capacity(dst.len()), Vec::new());
        for (k, r) in out.keys_to_store.iter().zip(moved) {
            match r {
                Ok(()) => ok.push(*k),
                Err(f) => {
                    tracing::warn!(kind = f.kind.as_str(), error = %f.message, "G1→G2 store failed");
                    failed.push(*k);
                }
            }
        }
        self.counters
            .failed_transfers
            .fetch_add(failed.len() as u64, Ordering::Relaxed);
        self.counters
            .add_bytes(MovePath::G1_TO_G2, ok.len(), self.block_bytes);
        let sched = self.sched_mut()?;
        if !failed.is_empty() {
            sched
                .complete_store(&failed, ctx, false)
                .context("complete_store")?;
        }
        if !ok.is_empty() {
            sched
                .complete_store(&ok, ctx, true)
                .context("complete_store")?;
        }
        Ok(())
    }
}

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
/// plus one request; [`TierStack::wait_for_room`] flushes before it waits, and
/// [`TierStack::finish`] before it drains.
///
/// With back-pressure (`offload.write_through.backpressure`), each lane has vLLM's EMA
/// detector: before an enqueue the detector may drop it (counted; the blocks stay in G2,
/// where the next store of a request reusing them can offer them again), and each finished
/// enqueue feeds it the write's latency per MiB. Promotions are never gated.
pub(super) struct WriteThrough {
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
    pub(super) fn flush(&self, all: bool) {
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
