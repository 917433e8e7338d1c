//! [`EngineTieringManager`]: `kvbm-tiering`'s scheduler contract
//! ([`OffloadingManager`]: lookup / prepare_load / complete_load / prepare_store /
//! complete_store …) served over **this engine's tiers**, so a vLLM-style scheduler can drive
//! an [`InstanceLeader`] the way it drives vLLM's offloading manager.
//!
//! # Mapping
//!
//! ```text
//!  scheduler call            engine
//!  ───────────────────────   ───────────────────────────────────────────────────────────────
//!  lookup(k)                 G2 has key_hash(k)            → HIT
//!                            a promotion of k in flight    → HIT_PENDING
//!                            G3/G4 has it                  → start a promotion (G3/G4 → G2 through
//!                                                            the leader's BlockMove), HIT_PENDING
//!                            another instance's G4 has it  → adopted into this leader's G4 (shared
//!                            (shared G4, from its events)    G4: see leader::remote), promoted
//!                            only copies whose promotion   → MISS (a copy that failed is never
//!                            failed                          read again; until reset_cache)
//!                            else                          → MISS
//!  prepare_load(ks)          hold every key's G2 block for the request; CPU spec = G2 block ids
//!  (worker)                  copies G2 slots → GPU (G1) with the spec
//!  complete_load(ks)         release those holds
//!  prepare_store(ks)         allocate G2 blocks for keys G2 lacks (never evicting one of ks);
//!                            CPU spec = their block ids; evicted_keys = exactly the keys whose
//!                            G2 blocks that allocation evicted
//!  (worker)                  copies GPU → the G2 slots
//!  complete_store(ks, ok)    ok: complete + register in G2 (an event); failed: slots go back
//! ```
//!
//! The "CPU chunks" of the contract are the leader's G2 blocks, so what the scheduler stores is
//! what [`InstanceLeader::find_matches`] finds (and what the engine's offload moves on to G3/G4),
//! and what the engine staged is what the scheduler loads: one set of tiers, one block-id space
//! (the bound G2 layout's slots).
//!
//! # Write-through
//!
//! With [`EngineTieringManager::set_store_sink`], what a successful `complete_store`
//! registered in G2 is handed on (strong handles) to the engine's offload lanes, so the
//! blocks the scheduler stores reach G3/G4 without a second lookup; a lane that holds them
//! strongly keeps them in G2 until written below. The sink is a [`StoreSink`] (the stack's
//! write-through, configured by `[offload.write_through]`); what its lanes did comes back
//! through [`StoreSink::lane_stats`] into `get_stats`.
//!
//! # Request-level lanes
//!
//! vLLM's `REQUEST_LEVEL` tiers, over the engine's lanes. When the sink has a request-level
//! lane, `on_new_request` answers [`OffloadScope::RequestLevel`] (the scheduler then offers
//! every block of the request to `prepare_store`, prefix hits included), and `prepare_store`
//! hands the offered keys it does not store on to the request-level lanes:
//!
//! ```text
//!  prepare_store(keys) of a request-level request
//!    keys G2 lacks            → keys_to_store (as for any request; every lane at complete_store)
//!    resident in G2           → StoreSink::request_level (strong holds), now
//!    being written (promoted,
//!    or another request's store) → parked; at each on_schedule_end: written → handed on,
//!                                 gone → dropped; the request retires once none is parked
//!    (has_pending_work while any is parked; reset_cache forgets them)
//! ```
//!
//! A request-level lane so gets what a tier added later, or a tier that dropped stores under
//! back-pressure, would otherwise never see: the prefixes the upper tiers serve.
//!
//! # Back-pressure
//!
//! A lane's back-pressure is its own (the stack's write-through: vLLM's EMA detector per
//! lane, which drops an enqueue while the lane's writes are slow); the manager never gates a
//! promotion. It reports each lane's [`LaneStats`] in vLLM's names under the lane's tier label:
//! write bytes and time, cascade failures, active cascades, the latency EMA, stores and blocks
//! dropped.
//!
//! # Two ways in
//!
//! * [`EngineTieringManager`] (above): the contract served by the leader itself, with its G2
//!   as the CPU tier; promotions are the engine's own moves.
//! * [`InstanceLeader::vllm_tiering_manager`]: `kvbm-tiering`'s own
//!   [`TieringOffloadingManager`] (vLLM's `TieringOffloadingManager`, call for call, with its
//!   private CPU slot table as the primary), whose secondary tiers are `PhysicalTier`s over
//!   **the leader's** bound G3/G4 tiers. What the scheduler cascades to G3 is registered in the
//!   leader's G3 manager, so `find_matches` finds it and an onboarding session stages it.
//!
//! # Keys
//!
//! An [`OffloadKey`] (vLLM block hash + group index) is registered under [`key_hash`]: the
//! first 128 bits of its domain-separated BLAKE3 digest ([`key_digest`]), low 4 bits replaced
//! by `log2(block size)`, with the full digest as the block's identity, so a disk slot or
//! object written for another key fails verification and is never served. Both ways in use
//! `kvbm-tiering`'s functions, so both register a key under the same hash.
//!
//! # Evicted keys
//!
//! The leader's G2 manager evicts by [`SequenceHash`]; the contract reports [`OffloadKey`]s.
//! The manager keeps a hash → key map of the blocks **it** registered in G2 (completed stores
//! and promotions), and allocates through [`BlockManager::allocate_blocks_with`], which
//! protects the call's own keys and names the hashes it evicted; each is mapped back (and
//! dropped from the map). A hash the manager never registered (a block the leader staged for
//! an onboarding session) has no scheduler key and is not reported. Evictions by a promotion's
//! allocation go out as a removal event. Entries whose block left G2 another way (an eviction
//! by the leader's own allocations, `reset_cache`) are pruned when the map outgrows twice G2's
//! capacity and on `reset_cache`.
//!
//! # Failed copies
//!
//! A promotion that fails is never reported as a hit. What happens to the copy depends on the
//! failure's kind ([`BlockFailureKind::drops_copy`]): a transient failure (I/O, a timeout, a
//! refusal) says nothing about the copy, which is kept and may be promoted by a later lookup.
//! A copy proven bad (corrupt, another block's, or gone) is never read again: it is recorded in
//! its tier's [`BadCopies`] (kvbm-offload's rule) and dropped from the tier
//! ([`BadCopies::discard`]: unregistered, its slot freed), so a later lookup of the key is a
//! MISS unless G2 holds fresh bytes (the scheduler recomputed and stored it) or another tier
//! holds a copy, and the engine's offload may write a fresh copy there. A copy another holder
//! still uses cannot be dropped at once: it stays recorded, is never promoted, and is dropped
//! at a later lookup once it can. The sets are the tiers' own when the tier set hands them in
//! ([`EngineTieringManager::with_bad_copies`]: one set per tier, which the stack's movers
//! record in too); a manager built alone keeps its own.
//!
//! # Promotions
//!
//! A promotion runs as a task on the runtime handle given at construction; it owns its source
//! hold and destination until the move settled. Completions are collected by the next call
//! (`lookup`, `on_schedule_end`, …); [`EngineTieringManager::settle`] awaits every promotion in
//! flight. A promoted block is held for the request whose lookup started it until that request
//! loads it or finishes.
//!
//! # Stats and recency
//!
//! [`get_stats`](OffloadingManager::get_stats) reports, since the last call, in
//! `kvbm-tiering`'s metric names: the CPU cache gauges over G2 (used = blocks not free;
//! write = slots reserved by `prepare_store`; read = the rest of used), each `prepare_store`'s
//! allocation size, chunk queries and hits per tier searched by `lookup` (labels
//! `0:primary` = G2, then `1:disk` = G3 and `N:object` = G4 as configured), active
//! promotion jobs and failed promotions per source tier, and promotions refused for lack
//! of G2 room. [`touch`](OffloadingManager::touch) marks the keys recently used in every
//! tier `lookup` searches (G2, G3, G4), so each tier's eviction policy sees the reuse.
//!
//! # Locks
//!
//! The manager is `&mut self` (the scheduler's thread); the only shared state is the
//! completion queue (one `parking_lot` mutex, held to push or drain, never across a manager
//! call or an `.await`).

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use kvbm_logical::{BlockManager, G2, G3, G4, ImmutableBlock, MutableBlock, SequenceHash, TierId};
use kvbm_offload::{BadCopies, BlockFailure, BlockFailureKind, BoundTier, MoveOutcome};
use kvbm_tiering::tiering::{DiskTier, ObjectTier, PhysicalTier, SecondaryTierManager};
use kvbm_tiering::{
    CacheHitSource, CpuLoadStoreSpec, CpuPrimaryTier, LoadStoreSpec, LookupResult, Medium,
    OffloadKey, OffloadScope, OffloadingConnectorStats, OffloadingEvent, OffloadingManager,
    PrepareStoreOutput, ReqContext, RequestOffloadingContext, ScheduleEndContext, TieringError,
    TieringOffloadingManager, UpstreamFixes,
};
use parking_lot::Mutex;

use crate::error::{EngineError, Result};
use crate::leader::{InstanceLeader, MoversToG2};
use crate::mover::BlockMove;

use kvbm_tiering::stats::names;
pub use kvbm_tiering::tiering::{digest_hash, key_digest, key_hash};

/// The engine's lower tiers handed to `kvbm-tiering`'s own manager
/// ([`InstanceLeader::vllm_tiering_manager`]): each must be bound to the leader's manager of
/// that tier, on the primary tier's transfer manager, with the primary's block geometry.
#[derive(Default)]
pub struct SchedulerTiers {
    /// G3, the first secondary tier.
    pub g3: Option<BoundTier<G3>>,
    /// G4, after G3.
    pub g4: Option<BoundTier<G4>>,
}

/// One value per tier `lookup` searches (G2, then G3 and G4 below it), indexed by its
/// [`TierId`]. G1 is the inference engine's and is never searched.
#[derive(Clone, Debug, Default)]
struct PerTier<T>([T; 3]);

impl<T> PerTier<T> {
    /// The searched tiers, in search order.
    const TIERS: [TierId; 3] = [TierId::G2, TierId::G3, TierId::G4];

    fn at(t: TierId) -> usize {
        match t {
            TierId::G3 => 1,
            TierId::G4 => 2,
            _ => 0,
        }
    }
}

impl<T> std::ops::Index<TierId> for PerTier<T> {
    type Output = T;
    fn index(&self, t: TierId) -> &T {
        &self.0[Self::at(t)]
    }
}

impl<T> std::ops::IndexMut<TierId> for PerTier<T> {
    fn index_mut(&mut self, t: TierId) -> &mut T {
        &mut self.0[Self::at(t)]
    }
}

/// Counters since the last `get_stats` (see "Stats and recency").
#[derive(Default)]
struct Stats {
    /// Chunk queries per searched tier.
    queries: PerTier<u64>,
    /// Chunk hits per searched tier.
    hits: PerTier<u64>,
    /// Blocks allocated per `prepare_store`.
    allocation_sizes: Vec<usize>,
    /// Failed promotions per source tier (G3, G4).
    promotion_failures: PerTier<u64>,
    /// Promotions not started for lack of G2 room.
    promotion_allocation_failures: u64,
    /// Successful promotions per source tier (G3, G4): blocks and seconds reading.
    promoted_blocks: PerTier<u64>,
    promoted_seconds: PerTier<f64>,
    /// Lookup time per searched tier, when recorded.
    lookup_seconds: PerTier<Vec<f64>>,
}

/// The one outcome of a one-block move (a mover that reported none failed it).
fn first_outcome(out: Vec<MoveOutcome<G2>>) -> MoveOutcome<G2> {
    out.into_iter().next().unwrap_or_else(|| {
        Err(BlockFailure::new(
            BlockFailureKind::ExecutorAborted,
            "the mover reported no outcome",
        ))
    })
}

/// One lane's [`LaneStats`] in vLLM's metric names, under the lane's tier label.
fn report_lane(
    out: &mut OffloadingConnectorStats,
    label: &str,
    lane: &LaneStats,
    block_bytes: u64,
) {
    let l = Some(label);
    if lane.written_blocks > 0 {
        if block_bytes > 0 {
            out.increase_counter(
                names::WRITE_BYTES,
                l,
                (lane.written_blocks * block_bytes) as f64,
            );
        }
        out.increase_counter(names::WRITE_TIME, l, lane.write_seconds);
    }
    if lane.failed_enqueues > 0 {
        out.increase_counter(names::CASCADE_JOB_FAILURES, l, lane.failed_enqueues as f64);
    }
    out.set_gauge(names::ACTIVE_CASCADE_JOBS, l, lane.in_flight as f64);
    if let Some(ema) = lane.latency_ema {
        out.set_gauge(names::BACKPRESSURE_STORE_LATENCY_EMA, l, ema);
    }
    if lane.stores_dropped > 0 {
        out.increase_counter(
            names::BACKPRESSURE_STORES_DROPPED,
            l,
            lane.stores_dropped as f64,
        );
        out.increase_counter(
            names::BACKPRESSURE_BLOCKS_DROPPED,
            l,
            lane.blocks_dropped as f64,
        );
    }
}

type Completion = (OffloadKey, MoveOutcome<G2>);

struct Promotion {
    owner: u64,
    /// The tier it reads from (G3 or G4).
    tier: TierId,
    /// When it started (the read time of a successful promotion).
    started: std::time::Instant,
    task: tokio::task::JoinHandle<()>,
}

#[derive(Default)]
struct ReqState {
    req_id: String,
    /// Holds taken by `prepare_load`, one per outstanding load of the key.
    pins: HashMap<OffloadKey, Vec<ImmutableBlock<G2>>>,
    /// Destinations reserved by `prepare_store`.
    stores: HashMap<OffloadKey, MutableBlock<G2>>,
    /// Blocks promoted for this request's lookups, held until loaded or finished.
    promoted: HashMap<OffloadKey, ImmutableBlock<G2>>,
    /// The request's resident blocks go to the request-level lanes when it stores.
    request_level: bool,
    /// Request-level keys whose G2 block was still being written (a promotion, another
    /// request's store) when the request stored: handed on once written, at a step's end.
    parked: Vec<OffloadKey>,
    finished: bool,
}

impl ReqState {
    fn idle(&self) -> bool {
        self.pins.is_empty() && self.stores.is_empty() && self.parked.is_empty()
    }
}

/// Where the G2 blocks the scheduler stores go on (see "Write-through" and "Request-level
/// lanes" in the [module docs](self)): typically the engine's G2→G3 / G2→G4 offload lanes
/// (the stack's write-through). Its calls run on the scheduler's thread, inside the manager's
/// call: they buffer or enqueue, never wait for long.
///
/// A closure `FnMut(Vec<ImmutableBlock<G2>>)` is a sink with every lane chunk level.
pub trait StoreSink: Send {
    /// The blocks a successful `complete_store` registered in G2 (strong handles, in the call's
    /// key order): for every lane.
    fn stored(&mut self, blocks: Vec<ImmutableBlock<G2>>);

    /// A request-level request's blocks that were already in G2 when it stored (strong
    /// handles): for the request-level lanes only. Default: dropped.
    fn request_level(&mut self, blocks: Vec<ImmutableBlock<G2>>) {
        drop(blocks);
    }

    /// Whether some lane is request level: then the manager answers `on_new_request` with
    /// [`OffloadScope::RequestLevel`] and hands such requests' resident blocks on. Default:
    /// false.
    fn has_request_level(&self) -> bool {
        false
    }

    /// What each lane did since the last call, reported by the manager's `get_stats` under
    /// the lane's tier label. Default: nothing.
    fn lane_stats(&mut self) -> Vec<(TierId, LaneStats)> {
        Vec::new()
    }
}

impl<F: FnMut(Vec<ImmutableBlock<G2>>) + Send> StoreSink for F {
    fn stored(&mut self, blocks: Vec<ImmutableBlock<G2>>) {
        self(blocks)
    }
}

/// What one lower lane did since the last [`StoreSink::lane_stats`] (reported in vLLM's
/// metric names: write bytes and time, cascade failures, active cascades, back-pressure).
#[derive(Clone, Debug, Default, PartialEq)]
#[non_exhaustive]
pub struct LaneStats {
    /// Blocks the lane wrote to its tier.
    pub written_blocks: u64,
    /// Seconds the lane's finished enqueues took, from enqueue to their last block's outcome.
    pub write_seconds: f64,
    /// Finished enqueues with at least one failed block.
    pub failed_enqueues: u64,
    /// Enqueues not finished yet (a gauge).
    pub in_flight: usize,
    /// The back-pressure EMA of write latency, seconds per MiB (with back-pressure on).
    pub latency_ema: Option<f64>,
    /// Enqueues dropped under back-pressure.
    pub stores_dropped: u64,
    /// Blocks those enqueues carried.
    pub blocks_dropped: u64,
}

/// The scheduler-facing manager over an [`InstanceLeader`]'s tiers: see the
/// [module docs](self).
pub struct EngineTieringManager {
    leader: InstanceLeader,
    /// Receives the blocks each successful `complete_store` registered.
    store_sink: Option<Box<dyn StoreSink>>,
    g2: Arc<BlockManager<G2>>,
    movers: MoversToG2,
    runtime: tokio::runtime::Handle,
    requests: HashMap<u64, ReqState>,
    promotions: HashMap<OffloadKey, Promotion>,
    completions: Arc<Mutex<Vec<Completion>>>,
    /// G3's copies proven bad (see "Failed copies").
    bad_g3: Arc<BadCopies<G3>>,
    /// G4's copies proven bad.
    bad_g4: Arc<BadCopies<G4>>,
    /// Keys reserved by some request's `prepare_store`.
    storing: HashSet<OffloadKey>,
    events: Vec<OffloadingEvent>,
    promotion_failures: u64,
    /// Keys of the G2 blocks this manager registered (see "Evicted keys").
    registered: HashMap<SequenceHash, OffloadKey>,
    stats: Stats,
    /// Bytes per block (promotion byte counters; 0: not reported).
    block_bytes: u64,
    /// Whether lookups record their time per tier.
    record_lookup_latency: bool,
    /// Metric label per searched tier (G2, G3, G4); `None` where not configured.
    labels: PerTier<Option<String>>,
}

impl std::fmt::Debug for EngineTieringManager {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EngineTieringManager")
            .field("requests", &self.requests.len())
            .field("promotions", &self.promotions.len())
            .field("bad_g3_empty", &self.bad_g3.is_empty())
            .field("bad_g4_empty", &self.bad_g4.is_empty())
            .finish()
    }
}

impl InstanceLeader {
    /// The scheduler-facing manager over this leader's tiers (see [`crate::manager`]);
    /// promotions from G3/G4 run through `movers` (their G3 and G4 movers; another instance's
    /// blocks reach the manager through the shared G4, not a remote pull) as tasks on
    /// `runtime`.
    ///
    /// # Errors
    /// [`EngineError::TierMissing`] without a G2 manager (it is the contract's CPU tier);
    /// [`EngineError::Config`] (key `scheduler.movers`) when a mover's destination is not this
    /// leader's G2 manager.
    pub fn tiering_manager(
        &self,
        movers: MoversToG2,
        runtime: tokio::runtime::Handle,
    ) -> Result<EngineTieringManager> {
        EngineTieringManager::new(self.clone(), movers, runtime)
    }
}

impl InstanceLeader {
    /// `kvbm-tiering`'s [`TieringOffloadingManager`] over `primary` (its CPU slot table,
    /// registered with the tiers' transfer manager) and this leader's bound G3 / G4 tiers as
    /// its secondary tiers, in that order (see the [module docs](crate::manager)).
    ///
    /// # Errors
    /// [`EngineError::Config`] (key `scheduler.tiers`) when a bound tier's manager is not this
    /// leader's manager of that tier; [`EngineError::Tiering`] when `kvbm-tiering` refuses a
    /// tier (another transfer manager than the primary's, another block geometry).
    pub fn vllm_tiering_manager(
        &self,
        primary: CpuPrimaryTier,
        tiers: SchedulerTiers,
        fixes: UpstreamFixes,
    ) -> Result<TieringOffloadingManager> {
        fn check<T: kvbm_logical::Tier>(
            bound: &BoundTier<T>,
            leader: Option<&Arc<BlockManager<T>>>,
        ) -> Result<()> {
            match leader {
                Some(m) if Arc::ptr_eq(m, bound.manager()) => Ok(()),
                _ => Err(EngineError::config(
                    "scheduler.tiers",
                    format!(
                        "the {} tier is not bound to the leader's {} manager",
                        T::ID,
                        T::ID
                    ),
                )),
            }
        }
        let mut secondary: Vec<Box<dyn SecondaryTierManager>> = Vec::new();
        if let Some(g3) = tiers.g3 {
            check(&g3, self.g3())?;
            let tier: DiskTier = PhysicalTier::over(&primary, g3)?;
            secondary.push(Box::new(tier));
        }
        if let Some(g4) = tiers.g4 {
            check(&g4, self.g4())?;
            let tier: ObjectTier = PhysicalTier::over(&primary, g4)?;
            secondary.push(Box::new(tier));
        }
        Ok(TieringOffloadingManager::with_primary(
            primary, secondary, fixes, false,
        ))
    }
}

fn unknown(call: &'static str, ctx: &ReqContext) -> TieringError {
    TieringError::UnknownRequest {
        call,
        req_id: ctx.req_id().to_owned(),
    }
}

impl EngineTieringManager {
    /// See [`InstanceLeader::tiering_manager`].
    ///
    /// # Errors
    /// As [`InstanceLeader::tiering_manager`].
    pub fn new(
        leader: InstanceLeader,
        movers: MoversToG2,
        runtime: tokio::runtime::Handle,
    ) -> Result<Self> {
        let g2 = leader
            .g2()
            .cloned()
            .ok_or(EngineError::TierMissing(TierId::G2))?;
        let same = |d: &Arc<BlockManager<G2>>| Arc::ptr_eq(d, &g2);
        if movers
            .g3_to_g2
            .as_ref()
            .is_some_and(|m| !same(m.destination()))
            || movers
                .g4_to_g2
                .as_ref()
                .is_some_and(|m| !same(m.destination()))
        {
            return Err(EngineError::config(
                "scheduler.movers",
                "a promotion mover's destination is not the leader's G2 manager",
            ));
        }
        let mut labels = PerTier([Some("0:primary".to_string()), None, None]);
        let mut next = 1;
        if leader.g3().is_some() {
            labels[TierId::G3] = Some(format!("{next}:disk"));
            next += 1;
        }
        if leader.g4().is_some() {
            labels[TierId::G4] = Some(format!("{next}:object"));
        }
        Ok(Self {
            leader,
            store_sink: None,
            g2,
            movers,
            runtime,
            requests: HashMap::new(),
            promotions: HashMap::new(),
            completions: Arc::new(Mutex::new(Vec::new())),
            bad_g3: Arc::default(),
            bad_g4: Arc::default(),
            storing: HashSet::new(),
            events: Vec::new(),
            promotion_failures: 0,
            registered: HashMap::new(),
            stats: Stats::default(),
            labels,
            block_bytes: 0,
            record_lookup_latency: false,
        })
    }

    /// Records proven-bad copies in the tiers' own sets (kvbm-offload's [`BadCopies`]: G3's
    /// checked disk's, G4's) instead of the manager's, so a copy the stack's movers rejected is
    /// never promoted and one this manager rejected is never read by them: one set per tier.
    #[must_use]
    pub fn with_bad_copies(
        mut self,
        g3: Option<Arc<BadCopies<G3>>>,
        g4: Option<Arc<BadCopies<G4>>>,
    ) -> Self {
        if let Some(g3) = g3 {
            self.bad_g3 = g3;
        }
        if let Some(g4) = g4 {
            self.bad_g4 = g4;
        }
        self
    }

    /// Bytes per block, for the promotion byte counters (`vllm:kv_offload_tiering_read_bytes`
    /// per tier); 0 (the default) reports no bytes.
    pub fn set_block_bytes(&mut self, bytes: usize) {
        self.block_bytes = bytes as u64;
    }

    /// Records each lookup's time per searched tier (`vllm:kv_offload_tiering_lookup_sync_
    /// delay_seconds`; two clock reads per tier per lookup). Off by default.
    pub fn set_record_lookup_latency(&mut self, on: bool) {
        self.record_lookup_latency = on;
    }

    /// Hands the G2 blocks each successful `complete_store` registers to `sink` (strong
    /// handles, in the call's key order), so the engine's offload lanes write them through to
    /// G3/G4 without looking them up again; without a sink they are dropped (inactive,
    /// evictable). The sink runs on the thread calling `complete_store`, inside the call: it
    /// must not wait for long (an enqueue that applies backpressure is fine).
    pub fn set_store_sink(&mut self, sink: Box<dyn StoreSink>) {
        self.store_sink = Some(sink);
    }

    /// The leader whose tiers this manager serves.
    pub fn leader(&self) -> &InstanceLeader {
        &self.leader
    }

    /// The sequence hash `key` has in this engine's managers.
    pub fn hash_of(&self, key: &OffloadKey) -> SequenceHash {
        key_hash(key, self.g2.block_size())
    }

    /// Promotions in flight.
    pub fn promotions_in_flight(&self) -> usize {
        self.promotions.len()
    }

    /// Promotions that failed (a failed block is never reported as a hit).
    pub fn promotion_failures(&self) -> u64 {
        self.promotion_failures
    }

    /// Waits for every promotion in flight to settle and collects its outcome.
    pub async fn settle(&mut self) {
        let tasks: Vec<_> = self.promotions.values_mut().map(|p| &mut p.task).collect();
        for t in tasks {
            let _ = t.await;
        }
        self.collect();
    }

    /// Remembers that this manager registered `key` in G2 (pruning stale entries when the
    /// map outgrows twice G2's capacity).
    fn remember(&mut self, key: OffloadKey, h: SequenceHash) {
        self.registered.insert(h, key);
        if self.registered.len() > 2 * self.g2.total_blocks().max(1) {
            self.prune_registered();
        }
    }

    /// Drops the entries whose block is no longer in G2.
    fn prune_registered(&mut self) {
        let accessor = self.leader.accessor();
        self.registered
            .retain(|h, _| accessor.is_present(*h, TierId::G2));
    }

    /// The scheduler keys of the evicted `hashes` (dropped from the map); hashes this
    /// manager never registered have none.
    fn forget_evicted(&mut self, hashes: &[SequenceHash]) -> Vec<OffloadKey> {
        hashes
            .iter()
            .filter_map(|h| self.registered.remove(h))
            .collect()
    }

    /// Takes the finished promotions' outcomes (no waiting).
    fn collect(&mut self) {
        let done = std::mem::take(&mut *self.completions.lock());
        for (key, outcome) in done {
            let Some(p) = self.promotions.remove(&key) else {
                continue;
            };
            match outcome {
                Ok(block) => {
                    self.stats.promoted_blocks[p.tier] += 1;
                    self.stats.promoted_seconds[p.tier] += p.started.elapsed().as_secs_f64();
                    let h = self.hash_of(&key);
                    self.remember(key, h);
                    match self.requests.get_mut(&p.owner) {
                        Some(r) if !r.finished => {
                            r.promoted.insert(key, block);
                        }
                        // The owner is gone: the block stays registered (inactive) in G2.
                        _ => drop(block),
                    }
                }
                Err(failure) => {
                    self.promotion_failures += 1;
                    self.stats.promotion_failures[p.tier] += 1;
                    if !failure.kind.drops_copy() {
                        // Transient (I/O, timeout, a refusal…): the copy is intact as far as
                        // anyone knows; a later lookup may promote it again.
                        tracing::warn!(%key, kind = failure.kind.as_str(), error = %failure.message, tier = %p.tier, "promotion to G2 failed; the copy is kept");
                        continue;
                    }
                    tracing::warn!(%key, kind = failure.kind.as_str(), error = %failure.message, tier = %p.tier, "promotion to G2 failed; that copy is dropped, never read again");
                    let h = self.hash_of(&key);
                    match p.tier {
                        TierId::G3 => self.bad_g3.read_failed(h, &failure),
                        TierId::G4 => self.bad_g4.read_failed(h, &failure),
                        _ => false,
                    };
                    self.discard_bad(p.tier);
                }
            }
        }
    }

    /// Drops `tier`'s bad copies nothing holds any more from its manager (see "Failed copies").
    fn discard_bad(&self, tier: TierId) {
        match tier {
            TierId::G3 => {
                if let Some(m) = self.leader.g3() {
                    self.bad_g3.discard(m);
                }
            }
            TierId::G4 => {
                if let Some(m) = self.leader.g4() {
                    self.bad_g4.discard(m);
                }
            }
            _ => {}
        }
    }

    /// Whether `tier`'s copy of `h` was proven bad and has not left the tier.
    fn is_bad(&self, h: SequenceHash, tier: TierId) -> bool {
        match tier {
            TierId::G3 => self.bad_g3.contains(h),
            TierId::G4 => self.bad_g4.contains(h),
            _ => false,
        }
    }

    fn in_g2(&self, h: SequenceHash) -> bool {
        self.leader.accessor().is_present(h, TierId::G2)
    }

    /// Starts promoting `key` from G3 or G4; whether it started. The source is held and its
    /// mover checked before a G2 block is allocated, so nothing is evicted for a promotion
    /// that cannot start.
    fn promote(&mut self, key: OffloadKey, h: SequenceHash, owner: u64) -> bool {
        enum Source {
            G3(Arc<dyn BlockMove<G3, G2>>, Vec<ImmutableBlock<G3>>),
            G4(Arc<dyn BlockMove<G4, G2>>, Vec<ImmutableBlock<G4>>),
        }
        let accessor = self.leader.accessor();
        let mut at = accessor.locate(h);
        if at.is_none() && self.leader.adopt_shared_g4(h) {
            at = Some(TierId::G4);
        }
        // A copy that failed its promotion is never read again; another tier's copy may be.
        // One that could not be dropped then (held elsewhere) is dropped now if it can be.
        if let Some(l) = at
            && self.is_bad(h, l)
        {
            self.discard_bad(l);
            if !self.is_bad(h, l) {
                at = accessor.locate(h);
            }
        }
        if let Some(l) = at
            && self.is_bad(h, l)
        {
            at = [TierId::G3, TierId::G4]
                .into_iter()
                .find(|o| *o != l && accessor.is_present(h, *o) && !self.is_bad(h, *o));
        }
        let source = match at {
            Some(TierId::G3) => {
                let (Some(m), Some(g3)) = (self.movers.g3_to_g2.clone(), self.leader.g3()) else {
                    return false;
                };
                Source::G3(m, g3.match_blocks(&[h]))
            }
            Some(TierId::G4) => {
                let (Some(m), Some(g4)) = (self.movers.g4_to_g2.clone(), self.leader.g4()) else {
                    return false;
                };
                Source::G4(m, g4.match_blocks(&[h]))
            }
            _ => return false,
        };
        let (tier, empty) = match &source {
            Source::G3(_, s) => (TierId::G3, s.is_empty()),
            Source::G4(_, s) => (TierId::G4, s.is_empty()),
        };
        if empty {
            return false;
        }
        let alloc = match self.g2.allocate_blocks_with(1, &[h]) {
            Ok(a) => a,
            Err(_) => {
                self.stats.promotion_allocation_failures += 1;
                return false;
            }
        };
        let evicted = self.forget_evicted(&alloc.evicted);
        if !evicted.is_empty() {
            self.events
                .push(OffloadingEvent::new(evicted, Medium::Cpu, true));
        }
        let Some(dst) = alloc.blocks.into_iter().next() else {
            return false;
        };
        let completions = self.completions.clone();
        let task = match source {
            // The source hold is released before the outcome is reported, so a failed copy is
            // inactive (discardable) when the manager collects the failure.
            Source::G3(m, src) => self.runtime.spawn(async move {
                let out = m.move_blocks(&src, vec![dst]).await;
                drop(src);
                completions.lock().push((key, first_outcome(out)));
            }),
            Source::G4(m, src) => self.runtime.spawn(async move {
                let out = m.move_blocks(&src, vec![dst]).await;
                drop(src);
                completions.lock().push((key, first_outcome(out)));
            }),
        };
        self.promotions.insert(
            key,
            Promotion {
                owner,
                tier,
                started: std::time::Instant::now(),
                task,
            },
        );
        true
    }

    /// Hands a request-level request's `keys` that it did not store on to the request-level
    /// lanes (vLLM's cascade of existing chunks): a key resident in G2 goes now (a strong
    /// hold: not evicted before written below); a key whose G2 block is still being written
    /// (a promotion, another request's store) is parked until a step's end finds it written;
    /// a key not in G2 (evicted, never stored) is dropped.
    fn hand_on_resident(&mut self, uid: u64, keys: Vec<OffloadKey>) {
        if keys.is_empty() {
            return;
        }
        let mut resident = Vec::new();
        let mut parked = Vec::new();
        for k in keys {
            if self.promotions.contains_key(&k) || self.storing.contains(&k) {
                parked.push(k);
            } else if let Some(b) = self.g2.match_blocks(&[self.hash_of(&k)]).pop() {
                resident.push(b);
            }
        }
        if let Some(r) = self.requests.get_mut(&uid) {
            r.parked.extend(parked);
        }
        if let Some(sink) = &mut self.store_sink
            && !resident.is_empty()
        {
            sink.request_level(resident);
        }
    }

    /// Retries the parked request-level keys (each resolves once its write settled), then
    /// retires requests that finished meanwhile.
    fn flush_parked(&mut self) {
        let waiting: Vec<u64> = self
            .requests
            .iter()
            .filter(|(_, r)| !r.parked.is_empty())
            .map(|(uid, _)| *uid)
            .collect();
        for uid in waiting {
            let keys = std::mem::take(&mut self.requests.get_mut(&uid).expect("listed").parked);
            self.hand_on_resident(uid, keys);
            self.retire_if_done(uid);
        }
    }

    /// The G2 block of `key` held for `req`: its promoted block, else a fresh hold.
    fn hold(&self, req: &ReqState, key: &OffloadKey) -> Option<ImmutableBlock<G2>> {
        if let Some(b) = req.promoted.get(key) {
            return Some(b.clone());
        }
        self.g2.match_blocks(&[self.hash_of(key)]).pop()
    }

    fn retire_if_done(&mut self, uid: u64) {
        if self
            .requests
            .get(&uid)
            .is_some_and(|r| r.finished && r.idle())
        {
            self.requests.remove(&uid);
        }
    }
}

impl OffloadingManager for EngineTieringManager {
    fn lookup(&mut self, key: &OffloadKey, req_context: &ReqContext) -> LookupResult {
        self.collect();
        if self.promotions.contains_key(key) {
            return LookupResult::HitPending;
        }
        let h = self.hash_of(key);
        self.stats.queries[TierId::G2] += 1;
        let t0 = self.record_lookup_latency.then(std::time::Instant::now);
        let in_g2 = self.in_g2(h);
        if let Some(t) = t0 {
            self.stats.lookup_seconds[TierId::G2].push(t.elapsed().as_secs_f64());
        }
        if in_g2 {
            self.stats.hits[TierId::G2] += 1;
            return LookupResult::Hit;
        }
        let t1 = self.record_lookup_latency.then(std::time::Instant::now);
        let found = self.leader.accessor().locate(h);
        let below = t1.map(|t| t.elapsed().as_secs_f64());
        for tier in [TierId::G3, TierId::G4] {
            if self.labels[tier].is_none() {
                continue;
            }
            self.stats.queries[tier] += 1;
            if let Some(d) = below {
                // One search answers for every lower tier: each searched one records it.
                self.stats.lookup_seconds[tier].push(d);
            }
            if found == Some(tier) {
                self.stats.hits[tier] += 1;
                break;
            }
        }
        if self.promote(*key, h, req_context.uid()) {
            LookupResult::HitPending
        } else {
            LookupResult::Miss
        }
    }

    fn prepare_load(
        &mut self,
        keys: &[OffloadKey],
        req_context: &ReqContext,
    ) -> kvbm_tiering::Result<LoadStoreSpec> {
        self.collect();
        let uid = req_context.uid();
        let req = self
            .requests
            .get(&uid)
            .ok_or_else(|| unknown("prepare_load", req_context))?;
        // Take every hold before recording any: a key that is not a HIT changes nothing.
        let mut held = Vec::with_capacity(keys.len());
        for k in keys {
            match self.hold(req, k) {
                Some(b) => held.push(b),
                None => {
                    return Err(TieringError::KeyState {
                        call: "prepare_load",
                        key: *k,
                        state: "not a HIT in G2",
                    });
                }
            }
        }
        let req = self.requests.get_mut(&uid).expect("checked above");
        let chunk_ids = held.iter().map(|b| b.block_id() as i32).collect();
        for (k, b) in keys.iter().zip(held) {
            req.promoted.remove(k);
            req.pins.entry(*k).or_default().push(b);
        }
        Ok(LoadStoreSpec::Cpu(CpuLoadStoreSpec { chunk_ids }))
    }

    fn touch(
        &mut self,
        keys: &[OffloadKey],
        _req_context: &ReqContext,
    ) -> kvbm_tiering::Result<()> {
        let hashes: Vec<SequenceHash> = keys.iter().map(|k| self.hash_of(k)).collect();
        self.g2.touch_blocks(&hashes);
        if let Some(g3) = self.leader.g3() {
            g3.touch_blocks(&hashes);
        }
        if let Some(g4) = self.leader.g4() {
            g4.touch_blocks(&hashes);
        }
        Ok(())
    }

    fn complete_load(
        &mut self,
        keys: &[OffloadKey],
        req_context: &ReqContext,
    ) -> kvbm_tiering::Result<()> {
        let uid = req_context.uid();
        let req = self
            .requests
            .get_mut(&uid)
            .ok_or_else(|| unknown("complete_load", req_context))?;
        let mut need: HashMap<OffloadKey, usize> = HashMap::new();
        for k in keys {
            *need.entry(*k).or_default() += 1;
        }
        if let Some(k) = need
            .iter()
            .find(|(k, n)| req.pins.get(*k).map_or(0, Vec::len) < **n)
            .map(|(k, _)| *k)
        {
            return Err(TieringError::KeyState {
                call: "complete_load",
                key: k,
                state: "not loading for this request",
            });
        }
        let mut released = Vec::with_capacity(keys.len());
        for k in keys {
            let pins = req.pins.get_mut(k).expect("checked above");
            released.extend(pins.pop());
            if pins.is_empty() {
                req.pins.remove(k);
            }
        }
        drop(released);
        self.retire_if_done(uid);
        Ok(())
    }

    fn prepare_store(
        &mut self,
        keys: &[OffloadKey],
        req_context: &ReqContext,
    ) -> kvbm_tiering::Result<Option<PrepareStoreOutput>> {
        let uid = req_context.uid();
        if !self.requests.contains_key(&uid) {
            return Err(unknown("prepare_store", req_context));
        }
        let hashes: Vec<SequenceHash> = keys.iter().map(|k| self.hash_of(k)).collect();
        let mut seen = HashSet::new();
        let to_store: Vec<OffloadKey> = keys
            .iter()
            .zip(&hashes)
            .filter(|(k, h)| seen.insert(**k) && !self.storing.contains(*k) && !self.in_g2(**h))
            .map(|(k, _)| *k)
            .collect();
        let (blocks, evicted_keys) = if to_store.is_empty() {
            (Vec::new(), Vec::new())
        } else {
            // The call's own keys are never evicted to make room for the call.
            let protect: HashSet<SequenceHash> = hashes.into_iter().collect();
            match self.g2.allocate_blocks_with(to_store.len(), &protect) {
                Ok(a) => {
                    self.stats.allocation_sizes.push(a.blocks.len());
                    let evicted = self.forget_evicted(&a.evicted);
                    (a.blocks, evicted)
                }
                Err(_) => return Ok(None),
            }
        };
        if !evicted_keys.is_empty() {
            self.events.push(OffloadingEvent::new(
                evicted_keys.clone(),
                Medium::Cpu,
                true,
            ));
        }
        let chunk_ids = blocks.iter().map(|b| b.block_id() as i32).collect();
        let req = self.requests.get_mut(&uid).expect("checked above");
        for (k, b) in to_store.iter().zip(blocks) {
            req.stores.insert(*k, b);
            self.storing.insert(*k);
        }
        if req.request_level {
            // The keys this call does not store are resident (or being written): the
            // request-level lanes get them too.
            let mut seen: HashSet<OffloadKey> = to_store.iter().copied().collect();
            let existing: Vec<OffloadKey> =
                keys.iter().copied().filter(|k| seen.insert(*k)).collect();
            self.hand_on_resident(uid, existing);
        }
        Ok(Some(PrepareStoreOutput {
            keys_to_store: to_store,
            store_spec: LoadStoreSpec::Cpu(CpuLoadStoreSpec { chunk_ids }),
            evicted_keys,
        }))
    }

    fn complete_store(
        &mut self,
        keys: &[OffloadKey],
        req_context: &ReqContext,
        success: bool,
    ) -> kvbm_tiering::Result<()> {
        let uid = req_context.uid();
        let req = self
            .requests
            .get_mut(&uid)
            .ok_or_else(|| unknown("complete_store", req_context))?;
        if keys.iter().any(|k| !req.stores.contains_key(k)) {
            return Err(TieringError::NoPendingStore {
                call: "complete_store",
                req_id: req.req_id.clone(),
            });
        }
        let block_size = self.g2.block_size();
        let mut complete = Vec::with_capacity(keys.len());
        let mut stored = Vec::with_capacity(keys.len());
        for k in keys {
            let Some(b) = req.stores.remove(k) else {
                continue; // a key listed twice
            };
            self.storing.remove(k);
            if success {
                let digest = key_digest(k);
                let h = digest_hash(&digest, block_size);
                match b.complete_with_digest(h, Some(digest)) {
                    Ok(c) => {
                        complete.push(c);
                        stored.push((*k, h));
                    }
                    Err(e) => tracing::warn!(key = %k, error = %e.error, "cannot register in G2"),
                }
            }
        }
        let registered = self.g2.register_blocks(complete);
        match &mut self.store_sink {
            Some(sink) if !registered.is_empty() => sink.stored(registered),
            _ => drop(registered),
        }
        for (k, h) in &stored {
            self.remember(*k, *h);
        }
        if !stored.is_empty() {
            let keys = stored.into_iter().map(|(k, _)| k).collect();
            self.events
                .push(OffloadingEvent::new(keys, Medium::Cpu, false));
        }
        self.retire_if_done(uid);
        Ok(())
    }

    fn on_new_request(
        &mut self,
        req_context: &ReqContext,
    ) -> kvbm_tiering::Result<RequestOffloadingContext> {
        let request_level = self
            .store_sink
            .as_ref()
            .is_some_and(|s| s.has_request_level());
        self.requests.insert(
            req_context.uid(),
            ReqState {
                req_id: req_context.req_id().to_owned(),
                request_level,
                ..ReqState::default()
            },
        );
        Ok(RequestOffloadingContext {
            policy: if request_level {
                OffloadScope::RequestLevel
            } else {
                OffloadScope::ChunkLevel
            },
        })
    }

    fn on_request_finished(&mut self, req_context: &ReqContext) -> kvbm_tiering::Result<()> {
        let uid = req_context.uid();
        let req = self
            .requests
            .get_mut(&uid)
            .ok_or_else(|| unknown("on_request_finished", req_context))?;
        req.finished = true;
        let promoted = std::mem::take(&mut req.promoted);
        drop(promoted);
        self.retire_if_done(uid);
        Ok(())
    }

    fn take_events(&mut self) -> Vec<OffloadingEvent> {
        std::mem::take(&mut self.events)
    }

    fn on_schedule_end(&mut self, _context: &ScheduleEndContext) -> kvbm_tiering::Result<()> {
        self.collect();
        self.flush_parked();
        Ok(())
    }

    fn has_pending_work(&self) -> bool {
        !self.promotions.is_empty() || self.requests.values().any(|r| !r.parked.is_empty())
    }

    fn reset_cache(&mut self) -> kvbm_tiering::Result<()> {
        self.collect();
        for r in self.requests.values_mut() {
            r.promoted.clear();
            r.parked.clear();
        }
        let done: Vec<u64> = self.requests.keys().copied().collect();
        for uid in done {
            self.retire_if_done(uid);
        }
        // Bad copies stay recorded (they are the tiers'); those nothing holds leave now.
        self.discard_bad(TierId::G3);
        self.discard_bad(TierId::G4);
        self.g2.reset_inactive_pool();
        self.prune_registered();
        Ok(())
    }

    fn get_stats(&mut self) -> Option<OffloadingConnectorStats> {
        self.collect();
        let mut out = OffloadingConnectorStats::default();
        let total = self.g2.total_blocks();
        let (usage, write) = if total > 0 {
            let used = total.saturating_sub(self.g2.available_blocks());
            (
                used as f64 / total as f64,
                self.storing.len() as f64 / total as f64,
            )
        } else {
            (0.0, 0.0)
        };
        out.set_gauge(names::CPU_CACHE_USAGE_PERC, None, usage);
        out.set_gauge(names::CPU_CACHE_WRITE_USAGE_PERC, None, write);
        out.set_gauge(
            names::CPU_CACHE_READ_USAGE_PERC,
            None,
            (usage - write).max(0.0),
        );
        let stats = std::mem::take(&mut self.stats);
        for a in stats.allocation_sizes {
            out.observe_histogram(names::CPU_ALLOCATION_SIZE, None, a as f64);
        }
        for tier in PerTier::<()>::TIERS {
            let Some(l) = self.labels[tier].as_deref() else {
                continue;
            };
            if stats.queries[tier] > 0 {
                out.increase_counter(names::CHUNK_QUERIES, Some(l), stats.queries[tier] as f64);
            }
            if stats.hits[tier] > 0 {
                out.increase_counter(names::CHUNK_HITS, Some(l), stats.hits[tier] as f64);
            }
            out.observe_histogram_all(
                names::LOOKUP_SYNC_DELAY,
                Some(l),
                stats.lookup_seconds[tier].iter().copied(),
            );
            if tier != TierId::G2 {
                let active = self.promotions.values().filter(|p| p.tier == tier).count();
                out.set_gauge(names::ACTIVE_PROMOTION_JOBS, Some(l), active as f64);
                let promoted = stats.promoted_blocks[tier];
                if promoted > 0 {
                    if self.block_bytes > 0 {
                        out.increase_counter(
                            names::READ_BYTES,
                            Some(l),
                            (promoted * self.block_bytes) as f64,
                        );
                    }
                    out.increase_counter(names::READ_TIME, Some(l), stats.promoted_seconds[tier]);
                }
                let failed = stats.promotion_failures[tier];
                if failed > 0 {
                    out.increase_counter(names::PROMOTION_JOB_FAILURES, Some(l), failed as f64);
                }
            }
        }
        if let Some(sink) = &mut self.store_sink {
            for (tier, lane) in sink.lane_stats() {
                let Some(l) = self.labels[tier].as_deref() else {
                    continue;
                };
                report_lane(&mut out, l, &lane, self.block_bytes);
            }
        }
        if stats.promotion_allocation_failures > 0 {
            out.increase_counter(
                names::PROMOTION_ALLOCATION_FAILURES,
                None,
                stats.promotion_allocation_failures as f64,
            );
        }
        Some(out)
    }

    fn get_load_source(&self, key: &OffloadKey, _req_context: &ReqContext) -> CacheHitSource {
        match self.leader.accessor().locate(self.hash_of(key)) {
            Some(TierId::G2) => CacheHitSource::Host,
            Some(TierId::G3) => CacheHitSource::Disk,
            _ => CacheHitSource::ExternalUnspecified,
        }
    }
}

#[cfg(test)]
mod tests;
