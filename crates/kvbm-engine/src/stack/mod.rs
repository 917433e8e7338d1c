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
//!        └─► EngineTieringManager    the scheduler-facing manager, its stores written through
//!                                    to the G2→G3 and G2→G4 lanes (write_through)
//! ```
//!
//! The tiers, the journal, the warm listing, the leader, the movers and the G2→G4 lane are
//! built by `tiers` (`TierSet::build`, crate-private): the one builder of tiers, which the
//! cluster plane's instance (`cluster::instance::InstanceBuilder::build`, feature `nats`) calls
//! too, with its own geometry, pinning and event sink. What is the stack's alone (the G1→G2 and
//! G2→G3 lanes, the front ends, the runtimes) is built here.
//!
//! # Driving it
//!
//! An inference engine drives the stack through one of two front ends ([`FrontEnd`]): the
//! scheduler-facing [`EngineTieringManager`] (lookup, prepare/complete load and store), its
//! stores written through to the G2→G3 and G2→G4 lanes; or the leader's `find_matches` and
//! [`OnboardingSession`](crate::leader::OnboardingSession)s, computed blocks sent down the
//! G1→G2 lane. G1 is host memory standing in for the device, so G2↔G1 is one inline host
//! copy. The stack holds no request: the serve loop that plays a workload over it (a request's
//! lookups, loads, computing and stores; stage timings; G3 read-ahead; what a request hit) is
//! the replay driver's ([`crate::replay`]).
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
use std::sync::atomic::Ordering;

use kvbm_logical::{G1, G2, G3, G4, ImmutableBlock, SequenceHash, Tier, TierId};
use kvbm_offload::{BadCopies, BlockMoveExecutor, ExternalMover, ObjectPipeline, PipelineBuilder};
use kvbm_physical::{Backing, PinPolicy};

use crate::error::{EngineError, Result};
use crate::leader::MoversToG2;
use crate::manager::EngineTieringManager;
use crate::mover::BlockMove;
use crate::{KvbmRuntime, MatchedPrefix};

use context::Context;

pub use crate::leader::{TierManagers, TierSinks};
pub use counters::{Counters, MovePath, PATH_NAMES};
pub use hooks::{Contents, Identities, ShareG4, SharedG4};
pub use lanes::LaneOutcomes;
pub use plan::{FrontEnd, StackPlan, probe_endpoint};

pub(crate) use lanes::Lanes;
use lanes::{enqueue_from_sink, lane_policy};
use tiers::{G3Check, count_failure, g3_arrival_check, g3_read_failed, geometry};
pub use tiers::{
    RankTiers, Shape, TierMovers, TierSet, TierSetPlan, g3_of, list_g4, open_g4_storage,
    secondary_disk, secondary_object,
};
use write_through::WriteThrough;

pub(crate) mod context;
mod counters;
#[cfg(all(test, feature = "cuda"))]
mod gpu_tests;
mod hooks;
mod lanes;
mod movers;
mod plan;
#[cfg(test)]
mod tests;
mod tiers;
mod write_through;

/// The built tier stack: see the [module docs](self).
pub struct TierStack {
    /// The engine runtime's tokio handle: the offload lanes run there.
    pub(crate) rt: tokio::runtime::Handle,
    /// The caller's runtime: sessions and promotions run on the thread that serves a request.
    pub(crate) session_rt: tokio::runtime::Runtime,
    /// The tiers, the leader and the movers ([`TierSet::build`], the one builder of tiers).
    pub(crate) tiers: TierSet,
    /// The offload lanes and what they settled.
    pub(crate) lanes: Lanes,
    /// Set when G4 is shared with other instances.
    pub(crate) shared_g4: Option<Box<dyn SharedG4>>,
    /// The scheduler-facing manager and its store path ([`FrontEnd::Tiering`]).
    pub(crate) scheduler: Option<SchedulerFront>,
    /// What each block's bytes are.
    pub(crate) contents: Arc<dyn Contents>,
    pub(crate) block_bytes: usize,
    /// The engine runtime (event-flush timer, the lanes' tokio runtime). Last: dropped after
    /// everything that runs on it.
    _runtime: KvbmRuntime,
}

/// The scheduler-facing manager of [`FrontEnd::Tiering`] and what its caller stores through.
pub(crate) struct SchedulerFront {
    /// vLLM's offloading-manager contract over the engine's tiers, its stores written through
    /// to the G2→G3 and G2→G4 lanes.
    pub(crate) manager: EngineTieringManager,
    /// The store's copy, G1 → the G2 slots `prepare_store` reserved: an inline
    /// [`ExternalMover`] (G1 and G2 are host memory).
    pub(crate) store_mover: ExternalMover<G1>,
    /// How long a store waits for G2 room (`offload.g1_to_g2.room_patience_ms`: it is that
    /// lane's work on this front end).
    pub(crate) room_patience: std::time::Duration,
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
        if cfg.physical.g1 == crate::config::G1Memory::Device {
            return Err(EngineError::config(
                "physical.g1",
                "the tier stack computes every block into G1 and checks it there, on the host \
                 (its G1 stands in for the device): G1 in GPU memory is for an instance whose \
                 engine writes it (the cluster plane's Instance, a worker process)",
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
            fingerprint: None,
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
        let counters = built.counters.clone();
        let mut lanes = Lanes::new(
            counters.clone(),
            cfg.offload.g1_to_g2.batch_config.max_batch_size,
        );
        lanes.g2_to_g3 = g2_to_g3;
        lanes.g2_to_g4 = g2_to_g4;
        if let Some(g2b) = &built.g2_bound {
            // With the tiering scheduler, the scheduler's own store (prepare_store → copy →
            // complete_store) is G1→G2, and the stack hands the stored blocks to the lower
            // lanes itself (the write-through).
            if plan.front_end == FrontEnd::Sessions {
                // G1 is host memory here: the copy is inline (a memcpy of one batch on the
                // lane's task, no hop to the transfer manager's runtime); a batch that finds G2
                // full of blocks the lower lanes still write waits for room as configured.
                let exec = BlockMoveExecutor::from_mover(
                    kvbm_offload::BlockMover::from_layout(built.g1.handle, g2b)?.inline()?,
                )
                .waiting_for_room(
                    cfg.offload.g1_to_g2.room_patience,
                    lanes.g2_space_waits.clone(),
                );
                let (next3, next4, hs, ho, c) = (
                    lanes.g2_to_g3.clone(),
                    lanes.g2_to_g4.clone(),
                    lanes.handles.clone(),
                    lanes.handoffs.clone(),
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
                lanes.g1_to_g2 = Some(
                    PipelineBuilder::<G1, G2>::new()
                        .config(cfg.offload.g1_to_g2.clone())
                        .policy(lane_policy(&built.registry, &cfg.offload.g1_to_g2))
                        .build()
                        .spawn_with_sink(exec, Some(sink))
                        .context("cannot start the G1→G2 pipeline")?,
                );
            }
        }
        let scheduler = match (&built.leader, &built.movers, &built.g2, plan.front_end) {
            (Some(l), Some(m), Some(g2t), FrontEnd::Tiering) => Some({
                let mut manager = l
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
                        built.g3.as_ref().map(|t| t.checked.bad().clone()),
                        built.g4.as_ref().map(|t| t.bad.clone()),
                    );
                manager.set_block_bytes(b);
                let w = WriteThrough::new(
                    lanes.g2_to_g3.clone(),
                    lanes.g2_to_g4.clone(),
                    &cfg.offload.write_through,
                    lanes.handles.clone(),
                    counters.clone(),
                    // A batch is a small share of G2 (the buffer holds its blocks).
                    (tiers.g2_blocks / 32).min(256),
                    b,
                )?;
                manager.set_store_sink(w.sink());
                lanes.write_through = Some(w);
                SchedulerFront {
                    manager,
                    // G1 and G2 are host memory: the store copies on the serving thread.
                    store_mover: ExternalMover::new(
                        &kvbm_offload::BoundTier::new(
                            built.tm.clone(),
                            built.g1.handle,
                            built.g1.manager.clone(),
                        )?,
                        g2t.handle,
                    )?
                    .inline()?,
                    room_patience: cfg.offload.g1_to_g2.room_patience,
                }
            }),
            _ => None,
        };
        drop(_enter);
        // Everything is set up: wait for the other instances before serving.
        if let Some(sh) = &shared {
            sh.wait_for_all(&rt)?;
        }
        Ok(TierStack {
            rt,
            session_rt,
            tiers: built,
            lanes,
            shared_g4: shared,
            scheduler,
            contents: plan.contents.clone(),
            block_bytes: b,
            _runtime: runtime,
        })
    }

    /// Capacity per tier (G4: its presence index), 0 when disabled.
    pub fn capacities(&self) -> [usize; 4] {
        let t = &self.tiers;
        [
            t.g1.manager.total_blocks(),
            t.g2.as_ref().map_or(0, |t| t.manager.total_blocks()),
            t.g3.as_ref().map_or(0, |t| t.manager.total_blocks()),
            t.g4.as_ref().map_or(0, |t| t.manager.total_blocks()),
        ]
    }

    /// What the movers and lanes counted: bytes per path, failed transfers, checksum
    /// rejections, blocks enqueued.
    pub fn counters(&self) -> &Counters {
        &self.tiers.counters
    }

    /// What the lanes' settled handles said so far (see [`Self::reap`]).
    pub fn lane_outcomes(&self) -> LaneOutcomes {
        self.lanes.outcomes()
    }

    /// Times a store into G2 found it full and waited for the lower lanes to free a slot.
    pub fn g2_space_waits(&self) -> u64 {
        self.lanes.g2_space_waits.load(Ordering::Relaxed)
    }

    /// The scheduler-facing manager's stats since the last call, in vLLM's metric names
    /// (`OffloadingManager::get_stats`: G2 gauges, lookups and hits per tier, promotions, and
    /// per lane the write-through's writes and back-pressure); `None` without the `Tiering`
    /// front end. Settles the lanes' finished writes first.
    pub fn scheduler_stats(&mut self) -> Option<kvbm_tiering::OffloadingConnectorStats> {
        if let Some(w) = &self.lanes.write_through {
            w.flush(false);
        }
        kvbm_tiering::OffloadingManager::get_stats(&mut self.scheduler.as_mut()?.manager)
    }

    /// Blocks G3 and G4 held at start (from a previous run).
    pub fn warm_blocks(&self) -> (usize, usize) {
        (
            self.tiers.g3.as_ref().map_or(0, |t| t.warm_blocks),
            self.tiers.g4.as_ref().map_or(0, |t| t.warm_blocks),
        )
    }

    /// Where G3 and G4 keep their data, for the report.
    pub fn locations(&self) -> (Option<String>, Option<String>) {
        (
            self.tiers.g3.as_ref().map(|t| t.dir.display().to_string()),
            self.tiers.g4.as_ref().map(|t| t.describe.clone()),
        )
    }

    /// The G3 engine in use, for the report.
    pub fn g3_capabilities(&self) -> Option<String> {
        let g3 = self.tiers.g3.as_ref()?;
        match g3.layout.backing() {
            Backing::Disk(d) => Some(format!("{:?}", d.capabilities())),
            _ => None,
        }
    }

    /// Blocks held (not available) per tier now: once the stack is drained and no request
    /// holds a block, any block still held is a leak.
    pub fn held_blocks(&self) -> [usize; 4] {
        let held = |total: usize, available: usize| total - available.min(total);
        let t = &self.tiers;
        [
            held(t.g1.manager.total_blocks(), t.g1.manager.available_blocks()),
            t.g2.as_ref().map_or(0, |t| {
                held(t.manager.total_blocks(), t.manager.available_blocks())
            }),
            t.g3.as_ref().map_or(0, |t| {
                held(t.manager.total_blocks(), t.manager.available_blocks())
            }),
            t.g4.as_ref().map_or(0, |t| {
                held(t.manager.total_blocks(), t.manager.available_blocks())
            }),
        ]
    }

    /// The caller is about to wait (for the next request): hands everything buffered
    /// on to the lanes, so the wait overlaps their work.
    pub fn idle(&mut self) {
        if let Some(w) = &self.lanes.write_through {
            w.flush(true);
        }
    }

    /// Collects finished lane handles.
    pub fn reap(&mut self) {
        self.lanes.reap();
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

    /// Settles the scheduler's promotions, drains every lane (G1→G2 first, so its chained
    /// blocks are enqueued before the lower lanes are waited for), syncs G3 and its journal,
    /// and stops the pipelines.
    ///
    /// # Errors
    /// A G3 or journal sync that failed.
    pub fn finish(&mut self) -> Result<()> {
        if let Some(s) = &mut self.scheduler {
            self.session_rt.block_on(s.manager.settle());
        }
        self.lanes.drain(&self.rt);
        if let Some(g3) = &self.tiers.g3 {
            if let Backing::Disk(d) = g3.layout.backing() {
                d.sync().context("cannot sync the G3 file")?;
            }
            g3.checked
                .journal()
                .sync()
                .context("cannot sync the G3 journal")?;
        }
        self.lanes.shut_down(&self.rt);
        Ok(())
    }

    /// Drops the G3 and G4 blocks their tier rejected on read (kvbm-offload's `BadCopies`)
    /// from the tier's manager once nothing holds them (`BlockManager::discard_inactive`):
    /// unregistered, their slots free, so the lanes may write a fresh copy later. A block stays
    /// rejected (never read) until it is dropped or has left the tier.
    pub(crate) fn discard_rejected(&self) {
        tiers::discard_rejected(self.tiers.g3.as_ref(), self.tiers.g4.as_ref());
    }

    /// Where `matched` must end: before its first G3 or G4 block already rejected.
    pub(crate) fn usable(&self, matched: &MatchedPrefix) -> usize {
        let mut cut = matched.len();
        // The holder's index of the first block a tier rejected, mapped to its prefix position
        // (a tier may hold several runs of the prefix).
        fn first_bad<T: Tier>(
            blocks: &[ImmutableBlock<T>],
            bad: &BadCopies<T>,
            positions: impl FnOnce() -> Vec<usize>,
        ) -> Option<usize> {
            if bad.is_empty() {
                return None;
            }
            let i = blocks
                .iter()
                .position(|b| bad.contains(b.sequence_hash()))?;
            Some(positions()[i])
        }
        if let Some(g3) = &self.tiers.g3
            && let Some(at) = first_bad(matched.g3().blocks(), g3.checked.bad(), || {
                matched.positions(TierId::G3)
            })
        {
            cut = cut.min(at);
        }
        if let Some(g4) = &self.tiers.g4
            && let Some(at) = first_bad(matched.g4().blocks(), &g4.bad, || {
                matched.positions(TierId::G4)
            })
        {
            cut = cut.min(at);
        }
        cut
    }

    /// The first block of `hashes[from..to]` a mover reported failed (and clears the reports).
    pub(crate) fn first_failed(
        &self,
        hashes: &[SequenceHash],
        from: usize,
        to: usize,
    ) -> Option<usize> {
        let failed = std::mem::take(&mut *self.tiers.onboard.failed.lock());
        if failed.is_empty() {
            return None;
        }
        let failed: HashSet<SequenceHash> = failed.into_iter().collect();
        hashes[from..to]
            .iter()
            .position(|h| failed.contains(h))
            .map(|i| from + i)
    }

    /// Onboarded, verified and corrupt blocks so far.
    pub(crate) fn onboard_tally(&self) -> [u64; 3] {
        let o = &self.tiers.onboard;
        [
            o.onboarded.load(Ordering::Relaxed),
            o.verified.load(Ordering::Relaxed),
            o.corrupt.load(Ordering::Relaxed),
        ]
    }
}
