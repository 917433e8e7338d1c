//! [`TierStack`]: the whole tier stack, built from the configuration tree with one call
//! ([`TierStack::build`] over a [`StackPlan`]): what every embedder gets, the same stack the
//! `kvbm replay` command drives.
//!
//! # What it holds
//!
//! ```text
//!  [tiers] [physical] [logical]      G1 host layout ─ G2 pinned host ─ G3 O_DIRECT file ─ G4 objects
//!        │                           one BlockRegistry, one BlockManager per tier, one TransferManager
//!        ├─► G3 journal (kvbm-offload) which block is in which slot, with its payload checksum:
//!        │                           warm restart after a crash, torn tail discarded
//!        ├─► G4 warm listing         every block object under the namespace is present at start
//!        ├─► lanes (lanes)           G1→G2 (waits for G2 room) ─sink─► G2→G3 (records the journal)
//!        │   [offload.*]                                        └──► G2→G4 (objects)
//!        ├─► InstanceLeader          find_matches over G2, G3, G4 (and shared G4, feature nats)
//!        ├─► movers (movers)         G3→G2, G4→G2 (every read checked, rejected copies never
//!        │                           read again), G2→G1 (every block checked by the Contents hook)
//!        ├─► EngineTieringManager    the scheduler-facing manager, its stores written through
//!        │                           to the G2→G3 and G2→G4 lanes (scheduled::WriteThrough)
//!        └─► read-ahead (read_ahead) G3→G2 reads for requests still to come
//! ```
//!
//! The tiers, the journal, the warm listing, the leader, the movers and the G2→G4 lane are
//! built by `tiers` (`TierSet::build`, crate-private): the one builder of tiers, which the
//! cluster plane's instance (`cluster::instance::InstanceBuilder::build`, feature `nats`) calls
//! too, with its own geometry, pinning and event sink. What is the stack's alone (the G1→G2 and
//! G2→G3 lanes, the front ends, the read-ahead, the runtimes) is built here.
//!
//! # Driving it
//!
//! An inference engine drives the stack through one of two front ends ([`FrontEnd`]):
//! [`TierStack::serve_scheduled`] makes vLLM's scheduler calls on the
//! [`EngineTieringManager`] (lookup, prepare/complete load and store) and plays its worker's
//! copies between G1 and G2; [`TierStack::serve`] uses the leader's `find_matches` and
//! [`OnboardingSession`](crate::leader::OnboardingSession)s, and sends computed blocks down the G1→G2 lane. Either way a request
//! is served on the caller's thread, as a scheduler waits for its blocks before the forward
//! pass: a session or a promotion runs on a current-thread runtime of the stack's own
//! (`session_rt`), the lanes on the engine runtime's workers. G1 is host memory standing in for
//! the device, so G2↔G1 is one inline host copy per request.
//!
//! What the stack cannot know comes in as hooks ([`Contents`]: a block's bytes, filled when
//! computed and verified at G1; [`Identities`]: the digests of blocks a tier knows only by
//! name). A failure keeps its kind (`kvbm_offload::BlockFailureKind`); a failed transfer is
//! never a hit, a block with wrong bytes is never served.
//!
//! # Ownership and locks
//!
//! A request holds strong G1 handles from lookup to the end of its serve call (its "forward
//! pass"); a matched prefix is held by its session until finished or failed; blocks being
//! offloaded are held by their lane (strong for G1→G2 and for the write-through, weak, upgraded
//! at the commitment point, for the chained lanes). Lock order: the checked tiers' checksum map
//! and bad-copy sets (kvbm-offload) and the write-through buffer are leaf locks, never held while a block manager or the
//! transfer manager is called.

use std::collections::HashSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use kvbm_logical::{G1, G2, G3, G4, ImmutableBlock, SequenceHash};
use kvbm_offload::{
    BlockFailureKind, BlockMoveExecutor, ExternalMover, ObjectPipeline, OffloadHandle,
    OffloadResult, Pipeline, PipelineBuilder,
};
use kvbm_physical::{Backing, PinPolicy, TransferManager};
use parking_lot::Mutex;

use crate::error::{EngineError, Result};
use crate::leader::MoversToG2;
use crate::manager::EngineTieringManager;
use crate::mover::BlockMove;
use crate::{InstanceLeader, KvbmRuntime};

use context::Context;
use movers::OnboardShared;

pub use counters::{Counters, HitSource, MovePath, PATH_NAMES, Served, StageTimes};
pub use hooks::{Contents, Identities, ShareG4, SharedG4};
pub use plan::{FrontEnd, StackPlan, probe_endpoint};

use lanes::{Handoffs, enqueue_from_sink, lane_policy};
use read_ahead::ReadAhead;
use tiers::{
    G3Check, G3Tier, G4Tier, HostTier, count_failure, g3_arrival_check, g3_read_failed, geometry,
};
pub use tiers::{
    RankTiers, Shape, TierMovers, TierSet, TierSetPlan, TierSinks, g3_of, list_g4, open_g4_storage,
    secondary_disk, secondary_object,
};

pub(crate) mod context;
mod counters;
mod hooks;
mod lanes;
mod movers;
mod plan;
mod read_ahead;
mod scheduled;
mod serve;
mod tiers;

/// The built tier stack: see the [module docs](self).
pub struct TierStack {
    block_bytes: usize,
    /// The engine runtime's tokio handle: the offload lanes run there.
    rt: tokio::runtime::Handle,
    /// The caller's runtime: sessions and promotions run on the thread that serves a request.
    session_rt: tokio::runtime::Runtime,
    /// The transfer manager every tier's layout is registered with, dropped with the stack
    /// (after its runtimes, before its tiers). Nothing here calls it: every copy goes through
    /// a mover, which holds it too.
    _tm: Arc<TransferManager>,
    g1: HostTier<G1>,
    g2: Option<HostTier<G2>>,
    /// The leader over G2, G3 and G4 (none without G2: G1 is then the only tier).
    leader: Option<InstanceLeader>,
    /// The paths sessions move blocks through, and what they report.
    movers: Option<TierMovers>,
    onboard: Arc<OnboardShared>,
    g3: Option<G3Tier>,
    g4: Option<G4Tier>,
    g1_to_g2: Option<Pipeline<G1>>,
    g2_to_g3: Option<Arc<Pipeline<G2>>>,
    g2_to_g4: Option<Arc<ObjectPipeline>>,
    handles: Arc<Mutex<Vec<OffloadHandle>>>,
    /// G1→G2 handles, oldest first: the only offloads whose end frees G1 slots, so waiting for
    /// G1 room waits for these alone ([`TierStack::allocate_g1`]).
    g1_handles: std::collections::VecDeque<OffloadHandle>,
    /// Hand-offs from a completion sink to a full lane, still waiting for room
    /// ([`enqueue_from_sink`]); drained before the lower lanes are waited for.
    handoffs: Handoffs,
    /// Shared counters.
    pub counters: Arc<Counters>,
    /// Stage timings.
    pub times: StageTimes,
    /// Blocks the lanes filtered (already present, or by policy).
    pub filtered_blocks: u64,
    /// Offloads refused because the destination had no evictable block (nothing moved).
    pub no_space: u64,
    /// Times a G1→G2 batch found G2 full and waited for the lower lanes to free a slot.
    pub g2_space_waits: Arc<AtomicU64>,
    /// How long the scheduler-path store waits for G2 room (`offload.g1_to_g2.room_patience_ms`:
    /// it is that lane's work on the Tiering front end).
    g2_room_patience: std::time::Duration,
    /// G3→G2 reads started ahead of their request, oldest first.
    reads_ahead: std::collections::VecDeque<ReadAhead>,
    /// Blocks in G2 because a read-ahead staged them, not yet claimed by their request.
    read_ahead_staged: HashSet<SequenceHash>,
    /// Blocks with a read-ahead in flight.
    reading_ahead: HashSet<SequenceHash>,
    /// Requests served so far (reads_ahead are tagged with the request they are for).
    served_requests: usize,
    /// Largest G1→G2 batch (G2 space one batch needs).
    g1_batch: usize,
    /// Queued (weak) blocks evicted from their source tier before their lane reached them.
    pub evicted_before_offload: u64,
    /// Outcomes of the lanes' blocks, from their settled handles: transferred, failed,
    /// filtered, cancelled (every lane).
    pub offload_settled: [u64; 4],
    /// Set when G4 is shared with other instances.
    shared_g4: Option<Box<dyn SharedG4>>,
    /// The scheduler-facing manager (`--scheduler tiering`; see [`scheduled`]).
    sched: Option<EngineTieringManager>,
    /// Where the manager's stores go on to G3/G4 (`--scheduler tiering`).
    write_through: Option<scheduled::WriteThrough>,
    /// The scheduler-path store's copy, G1 → the G2 slots `prepare_store` reserved: an inline
    /// [`ExternalMover`] (`--scheduler tiering`; see [`scheduled`]).
    store_mover: Option<ExternalMover<G1>>,
    /// Requests whose `prepare_load` found a HIT gone, and recomputed (`--scheduler tiering`).
    pub load_refused: u64,
    /// What each block's bytes are.
    contents: Arc<dyn Contents>,
    /// The engine runtime (event-flush timer, the lanes' tokio runtime). Last: dropped after
    /// everything that runs on it.
    _runtime: KvbmRuntime,
}

impl TierStack {
    /// Builds every enabled tier, loads what persistent G3/G4 hold, and starts the lanes.
    ///
    /// # Errors
    /// Invalid sizes, storage that cannot be created, an unreachable S3 endpoint.
    pub fn build(plan: &StackPlan) -> Result<TierStack> {
        let cfg = &plan.config;
        let tiers = &cfg.tiers;
        let b = tiers.block_bytes;
        if b == 0 || !b.is_multiple_of(4096) {
            return Err(EngineError::config(
                "tiers.block_bytes",
                format!("must be a positive multiple of 4096 (O_DIRECT alignment), got {b}"),
            ));
        }
        if cfg.workers.mode == crate::config::WorkersMode::Processes {
            return Err(EngineError::config(
                "workers.mode",
                "the tier stack serves from this process's memory (its G1 stands in for the \
                 device): worker processes serve through the cluster plane's Instance",
            ));
        }
        if tiers.g1_blocks == 0 {
            return Err(EngineError::config(
                "tiers.g1_blocks",
                "the stack serves every block in G1 (host memory standing in for the device): \
                 must be > 0",
            ));
        }
        let runtime = KvbmRuntime::builder()
            .config(cfg.clone())
            .build()
            .context("cannot start the kvbm runtime")?;
        let rt = runtime.handle().tokio().clone();
        let session_rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .context("cannot start the serving thread's runtime")?;
        let _enter = rt.enter();
        // Sharing G4 with other instances (feature `nats`): joined first, so G4's manager
        // publishes to it and the leader searches the others' blocks.
        let shared = match &plan.sharing {
            Some(s) => {
                if tiers.g4_blocks == 0 {
                    return Err(EngineError::config(
                        "tiers.g4_blocks",
                        "instances share G4: must be > 0",
                    ));
                }
                let fingerprint = cfg.fingerprint(geometry(1, b)?.config())?;
                Some(s.join(&runtime, &fingerprint)?)
            }
            None => None,
        };
        // Every tier, its journal and warm listing, the leader and the movers: built as every
        // composition builds them ([`TierSet::build`]).
        let events = runtime.handle();
        let built = rt.block_on(TierSet::build(TierSetPlan {
            config: cfg,
            runtime: &events,
            shape: Box::new(move |n| geometry(n, b)),
            pin: [PinPolicy::Unpinned, PinPolicy::TryPin],
            sinks: TierSinks {
                g4: shared.as_ref().map(|sh| sh.sink()),
                ..TierSinks::default()
            },
            contents: Some(plan.contents.clone()),
            identities: plan.identities.clone(),
            remote: shared.as_ref().map(|sh| sh.remote()),
        }))?;
        if let Some(sh) = &shared {
            sh.own().lock().extend(built.g4_listed.iter().copied());
        }
        let g2_to_g4 = {
            let c = built.counters.clone();
            let own = shared.as_ref().map(|sh| sh.own().clone());
            let sink: kvbm_offload::CompletionSink<SequenceHash> =
                Arc::new(move |done: Vec<SequenceHash>| {
                    c.add_bytes(MovePath::G2_TO_G4, done.len(), b);
                    if let Some(own) = &own {
                        own.lock().extend(done);
                    }
                });
            built
                .g2_to_g4_lane(&cfg.offload.g2_to_g4, None, Some(sink))?
                .map(Arc::new)
        };
        let g2_to_g3 = {
            let _guard = rt.enter();
            built.g2_to_g3_lane(&cfg.offload.g2_to_g3)?.map(Arc::new)
        };
        let TierSet {
            tm,
            registry,
            counters,
            onboard,
            g1,
            g2,
            g2_bound,
            g3,
            g4,
            leader,
            movers,
            ..
        } = built;
        let handles: Arc<Mutex<Vec<OffloadHandle>>> = Arc::new(Mutex::new(Vec::new()));
        let g2_space_waits = Arc::new(AtomicU64::new(0));
        let handoffs: Handoffs = Arc::new(Mutex::new(Vec::new()));
        let mut g1_to_g2 = None;
        if let Some(g2b) = &g2_bound {
            // With the tiering scheduler, the scheduler's own store (prepare_store → copy →
            // complete_store) is G1→G2, and the stack hands the stored blocks to the lower
            // lanes itself ([`scheduled`]).
            if plan.front_end == FrontEnd::Sessions {
                // G1 is host memory here: the copy is inline (a memcpy of one batch on the
                // lane's task, no hop to the transfer manager's runtime); a batch that finds G2
                // full of blocks the lower lanes still write waits for room as configured.
                let exec = BlockMoveExecutor::from_mover(
                    kvbm_offload::BlockMover::from_layout(g1.handle, g2b)?.inline()?,
                )
                .waiting_for_room(cfg.offload.g1_to_g2.room_patience, g2_space_waits.clone());
                let (next3, next4, hs, ho, c) = (
                    g2_to_g3.clone(),
                    g2_to_g4.clone(),
                    handles.clone(),
                    handoffs.clone(),
                    counters.clone(),
                );
                let sink: kvbm_offload::CompletionSink<ImmutableBlock<G2>> =
                    Arc::new(move |blocks: Vec<ImmutableBlock<G2>>| {
                        c.add_bytes(MovePath::G1_TO_G2, blocks.len(), b);
                        // Strong references: a G2 block is not evicted before it reached the lower
                        // tiers (write-through). Backpressure bounds how many are in flight.
                        if let Some(p) = &next3 {
                            enqueue_from_sink(p, |p| p, blocks.clone(), &hs, &ho, &c, "G2→G3");
                        }
                        if let Some(p) = &next4 {
                            enqueue_from_sink(
                                p,
                                ObjectPipeline::pipeline,
                                blocks,
                                &hs,
                                &ho,
                                &c,
                                "G2→G4",
                            );
                        }
                    });
                g1_to_g2 = Some(
                    PipelineBuilder::<G1, G2>::new()
                        .config(cfg.offload.g1_to_g2.clone())
                        .policy(lane_policy(&registry, &cfg.offload.g1_to_g2))
                        .build()
                        .spawn_with_sink(exec, Some(sink))
                        .context("cannot start the G1→G2 pipeline")?,
                );
            }
        }
        let (mut write_through, mut store_mover) = (None, None);
        let sched = match (&leader, &movers, &g2, plan.front_end) {
            (Some(l), Some(m), Some(g2t), FrontEnd::Tiering) => Some({
                let mut sched = l
                    .tiering_manager(
                        MoversToG2 {
                            g3_to_g2: m.g3_to_g2.clone().map(|m| m as Arc<dyn BlockMove<G3, G2>>),
                            g4_to_g2: m.g4_to_g2.clone().map(|m| m as Arc<dyn BlockMove<G4, G2>>),
                            remote_g2: None,
                        },
                        rt.clone(),
                    )
                    .context("cannot build the scheduler-facing tiering manager")?
                    .with_bad_copies(
                        g3.as_ref().map(|t| t.checked.bad().clone()),
                        g4.as_ref().map(|t| t.bad.clone()),
                    );
                sched.set_block_bytes(b);
                let w = scheduled::WriteThrough::new(
                    g2_to_g3.clone(),
                    g2_to_g4.clone(),
                    &cfg.offload.write_through,
                    handles.clone(),
                    counters.clone(),
                    // A batch is a small share of G2 (the buffer holds its blocks).
                    (tiers.g2_blocks / 32).min(256),
                    b,
                )?;
                sched.set_store_sink(w.sink());
                write_through = Some(w);
                // G1 and G2 are host memory: the store copies on the serving thread.
                store_mover = Some(
                    ExternalMover::new(
                        &kvbm_offload::BoundTier::new(tm.clone(), g1.handle, g1.manager.clone())?,
                        g2t.handle,
                    )?
                    .inline()?,
                );
                sched
            }),
            _ => None,
        };
        drop(_enter);
        // Everything is set up: wait for the other instances before serving.
        if let Some(sh) = &shared {
            sh.wait_for_all(&rt)?;
        }
        Ok(TierStack {
            block_bytes: b,
            rt,
            session_rt,
            _tm: tm,
            g1,
            g2,
            leader,
            movers,
            onboard,
            g3,
            g4,
            g1_to_g2,
            g2_to_g3,
            g2_to_g4,
            handles,
            g1_handles: std::collections::VecDeque::new(),
            handoffs,
            counters,
            times: StageTimes::default(),
            filtered_blocks: 0,
            evicted_before_offload: 0,
            offload_settled: [0; 4],
            no_space: 0,
            g2_space_waits,
            g2_room_patience: cfg.offload.g1_to_g2.room_patience,
            reads_ahead: std::collections::VecDeque::new(),
            read_ahead_staged: HashSet::new(),
            reading_ahead: HashSet::new(),
            served_requests: 0,
            g1_batch: cfg.offload.g1_to_g2.batch_config.max_batch_size,
            shared_g4: shared,
            sched,
            write_through,
            store_mover,
            load_refused: 0,
            contents: plan.contents.clone(),
            _runtime: runtime,
        })
    }

    /// Capacity per tier (G4: its presence index), 0 when disabled.
    pub fn capacities(&self) -> [usize; 4] {
        [
            self.g1.manager.total_blocks(),
            self.g2.as_ref().map_or(0, |t| t.manager.total_blocks()),
            self.g3.as_ref().map_or(0, |t| t.manager.total_blocks()),
            self.g4.as_ref().map_or(0, |t| t.manager.total_blocks()),
        ]
    }

    /// The scheduler-facing manager's stats since the last call, in vLLM's metric names
    /// (`OffloadingManager::get_stats`: G2 gauges, lookups and hits per tier, promotions, and
    /// per lane the write-through's writes and back-pressure); `None` without the `Tiering`
    /// front end. Settles the lanes' finished writes first.
    pub fn scheduler_stats(&mut self) -> Option<kvbm_tiering::OffloadingConnectorStats> {
        if let Some(w) = &self.write_through {
            w.flush(false);
        }
        kvbm_tiering::OffloadingManager::get_stats(self.sched.as_mut()?)
    }

    /// Blocks G3 and G4 held at start (from a previous run).
    pub fn warm_blocks(&self) -> (usize, usize) {
        (
            self.g3.as_ref().map_or(0, |t| t.warm_blocks),
            self.g4.as_ref().map_or(0, |t| t.warm_blocks),
        )
    }

    /// Where G3 and G4 keep their data, for the report.
    pub fn locations(&self) -> (Option<String>, Option<String>) {
        (
            self.g3.as_ref().map(|t| t.dir.display().to_string()),
            self.g4.as_ref().map(|t| t.describe.clone()),
        )
    }

    /// The G3 engine in use, for the report.
    pub fn g3_capabilities(&self) -> Option<String> {
        let g3 = self.g3.as_ref()?;
        match g3.layout.backing() {
            Backing::Disk(d) => Some(format!("{:?}", d.capabilities())),
            _ => None,
        }
    }

    /// Counts one finished lane transfer: evicted-before-offload, filtered and no-space blocks
    /// are offloads that never started (nothing moved); every other failure is a failed
    /// transfer.
    fn tally(&mut self, r: &OffloadResult) {
        let (mut evicted, mut no_space) = (0u64, 0u64);
        for (h, f) in &r.failed_blocks {
            match f.kind {
                BlockFailureKind::Evicted => evicted += 1,
                BlockFailureKind::NoSpace => no_space += 1,
                _ => {
                    self.counters
                        .failed_transfers
                        .fetch_add(1, Ordering::Relaxed);
                    tracing::debug!(hash = %h, kind = f.kind.as_str(), reason = %f.message, "offload failed");
                }
            }
        }
        self.evicted_before_offload += evicted;
        self.no_space += no_space;
        self.filtered_blocks += r.filtered_blocks.len() as u64;
        for (n, len) in self.offload_settled.iter_mut().zip([
            r.completed_blocks.len(),
            r.failed_blocks.len(),
            r.filtered_blocks.len(),
            r.cancelled_blocks.len(),
        ]) {
            *n += len as u64;
        }
    }

    /// Blocks held (not available) per tier now: once the stack is drained and no request
    /// holds a block, any block still held is a leak.
    pub fn held_blocks(&self) -> [usize; 4] {
        let held = |total: usize, available: usize| total - available.min(total);
        [
            held(
                self.g1.manager.total_blocks(),
                self.g1.manager.available_blocks(),
            ),
            self.g2.as_ref().map_or(0, |t| {
                held(t.manager.total_blocks(), t.manager.available_blocks())
            }),
            self.g3.as_ref().map_or(0, |t| {
                held(t.manager.total_blocks(), t.manager.available_blocks())
            }),
            self.g4.as_ref().map_or(0, |t| {
                held(t.manager.total_blocks(), t.manager.available_blocks())
            }),
        ]
    }

    /// The caller is about to wait (for the next request): hands everything buffered
    /// on to the lanes, so the wait overlaps their work.
    pub fn idle(&mut self) {
        if let Some(w) = &self.write_through {
            w.flush(true);
        }
    }

    /// Collects finished lane handles.
    pub fn reap(&mut self) {
        let done: Vec<OffloadResult> = {
            let mut hs = self.handles.lock();
            let mut done = Vec::new();
            hs.retain(|h| match h.try_result() {
                Some(r) => {
                    done.push(r);
                    false
                }
                None => true,
            });
            done
        };
        for r in &done {
            self.tally(r);
        }
        while let Some(r) = self.g1_handles.front().and_then(|h| h.try_result()) {
            self.g1_handles.pop_front();
            self.tally(&r);
        }
    }

    /// Capacity gauges per tier (occupancy and evictions per tier come from `kvbm-logical`'s
    /// own `kvbm_logical_{active,inactive,reset}_blocks` and `kvbm_logical_evicted_blocks_total`).
    pub fn publish_capacity(&self) {
        for (tier, cap) in ["g1", "g2", "g3", "g4"].into_iter().zip(self.capacities()) {
            metrics::gauge!(
                crate::metrics::STACK_TIER_CAPACITY_BLOCKS,
                crate::metrics::TIER_LABEL => tier
            )
            .set(cap as f64);
        }
    }

    /// Drains every lane (G1→G2 first, so its chained blocks are enqueued before the lower
    /// lanes are waited for), syncs G3 and its journal, and stops the pipelines.
    ///
    /// # Errors
    /// A G3 or journal sync that failed.
    pub fn finish(&mut self) -> Result<()> {
        let t = Instant::now();
        if let Some(s) = &mut self.sched {
            self.session_rt.block_on(s.settle());
        }
        if let Some(w) = &self.write_through {
            w.flush(true);
        }

        self.complete_read_aheads(usize::MAX);
        while let Some(h) = self.g1_handles.pop_front() {
            match self.rt.block_on(h.wait()) {
                Ok(r) => self.tally(&r),
                Err(e) => tracing::warn!(error = %e, "an offload did not finish"),
            }
        }
        // Wait until the lanes are quiescent: every handle settled and every sink hand-off
        // enqueued. A finishing G1→G2 batch hands its blocks on to G2→G3/G2→G4 from its sink,
        // which adds handles (or hand-offs) while this waits, so loop until a round finds none.
        loop {
            let waiting: Vec<_> = std::mem::take(&mut *self.handoffs.lock());
            let pending: Vec<OffloadHandle> = std::mem::take(&mut *self.handles.lock());
            if waiting.is_empty() && pending.is_empty() {
                break;
            }
            for j in waiting {
                let _ = self.rt.block_on(j);
            }
            for h in pending {
                match self.rt.block_on(h.wait()) {
                    Ok(r) => self.tally(&r),
                    Err(e) => tracing::warn!(error = %e, "an offload did not finish"),
                }
            }
        }
        if let Some(g3) = &self.g3 {
            if let Backing::Disk(d) = g3.layout.backing() {
                d.sync().context("cannot sync the G3 file")?;
            }
            g3.checked
                .journal()
                .sync()
                .context("cannot sync the G3 journal")?;
        }
        let (a, b, c) = (
            self.g1_to_g2.as_ref(),
            self.g2_to_g3.clone(),
            self.g2_to_g4.clone(),
        );
        self.rt.block_on(async {
            if let Some(p) = a {
                p.shutdown_and_wait().await;
            }
            if let Some(p) = b {
                p.shutdown_and_wait().await;
            }
            if let Some(p) = c {
                // Flushes the lock releases too.
                p.shutdown_and_wait().await;
            }
        });
        self.times.drain += t.elapsed().as_secs_f64();
        Ok(())
    }
}
