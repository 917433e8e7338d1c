//! The tier driver: a scheduler over `kvbm-engine`, with G1..G4 storage and the offload lanes.
//!
//! The replay runs like an inference scheduler on top of the engine: a `KvbmRuntime` built
//! from the merged `KvbmConfig` (its tokio runtime runs the lanes; its event-flush timer
//! covers every tier's manager), an `InstanceLeader` over the replay's G2/G3/G4
//! `BlockManager`s (one shared `BlockRegistry`) doing the lookup (`find_matches`: the longest
//! prefix in G2, G3, G4, held by its RAII holder), and onboarding through the leader's
//! `OnboardingSession` (hold → prepare G3/G4→G2 → onboard G2→G1 → finish), whose movers
//! (`onboard.rs`) are the real transfer paths with the replay's checks. G1 (host memory, the
//! GPU's stand-in) is the inference engine's own prefix cache, matched first. The storage is
//! `kvbm-physical` (host layouts for G1/G2, an O_DIRECT io_uring `DiskStorage` file for G3, an
//! `ObjectStorage` for G4, one `TransferManager`); offloads are `kvbm-offload`'s G1→G2, G2→G3
//! and G2→G4 pipelines (what the engine uses). `replay/mod.rs` only calls [`Tiers::build`],
//! [`Tiers::serve`] and [`Tiers::finish`].
//!
//! ```text
//!  request ──► G1 match ──► leader.find_matches(rest) ──► cut at rejected (poisoned) blocks
//!     │           OnboardingSession::prepare: G3 ──G3ToG2──► G2  (disk header + recorded checksum)
//!     │                                       G4 ──G4ToG2──► G2  (object header checksum)
//!     │           OnboardingSession::onboard: G2 ──G2ToG1──► G1  (bytes checked against the id)
//!     │           a failed block fails the session ──► cut the prefix there, look up again
//!     │  miss: compute in G1 ──► G1→G2 pipeline ──sink──► G2→G3 pipeline (manifest recorded)
//!     │                                           └─────► G2→G4 object pipeline
//!     └─ read-ahead: G3→G2 reads for the next requests (registered in G2 before their turn)
//! ```
//!
//! Sessions run on this thread (a current-thread runtime, `Tiers::session_rt`): the request
//! waits for its blocks, as a scheduler waits before the forward pass, and a session's task
//! needs no hop to another thread. G2→G1 is host to host (G1 is a host stand-in), so it is
//! one inline copy per request (`TransferManager::execute_transfer_inline`, with the
//! manager's claims).
//!
//! Ownership: a request holds strong G1 handles from lookup to the end of [`Tiers::serve`] (its
//! "forward pass"); the matched prefix is held by its session until finished or failed; blocks
//! being offloaded are held by their pipeline (strong for G1→G2, weak, upgraded at the
//! commitment point, for the chained lanes). Lock order: the checksum map and the poisoned
//! sets are leaves, never held while calling a block manager or the transfer manager.

use std::collections::HashSet;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, anyhow, bail};
use kvbm_logical::{
    BlockManager, BlockRegistry, EventSink, G1, G2, G3, G4, ImmutableBlock, LogicalConfig,
    MutableBlock, SequenceHash, Tier, TierId,
};
use kvbm_offload::{
    AllOfPolicy, BatchOutcome, BlockFailure, BlockFailureKind, BlockTransferExecutor, EnqueueError,
    ObjectPipeline, ObjectPipelineBuilder, ObjectPipelineConfig, ObjectTransferExecutor,
    OffloadPolicy, Pipeline, PipelineBuilder, PipelineConfig, PresenceFilter, ResolvedBatch,
    TransferExecutor, TransferHandle, TransferResult, block_identity, create_policy_from_config,
};
use kvbm_physical::{
    Backing, BlockLayout, DiskConfig, IoEngineKind, LayoutHandle, LayoutKind, ObjectConfig,
    ObjectStorage, PhysicalError, PhysicalLayout, PinPolicy, S3Config, TransferManager,
    TransferOptions,
};
use parking_lot::Mutex;

use kvbm_engine::leader::RemoteSearch;
use kvbm_engine::leader::{FinishOutcome, OnboardingSession, StagingMovers};
use kvbm_engine::mover::BlockMove;
use kvbm_engine::pubsub::nats::NatsBus;
use kvbm_engine::pubsub::{CrossInstanceIndex, EventPublisher, InstanceId};
use kvbm_engine::scheduler::{EngineTieringManager, PromotionMovers};
use kvbm_engine::{EventSource, InstanceLeader, KvbmConfig, KvbmRuntime, MatchedPrefix};

use crate::config::Scheduler;

use super::content;
use super::keys::Digests;
use super::manifest::G3Index;
use super::onboard::{G2ToG1, G3ToG2, G4ToG2, OnboardShared};
use super::workload::HASH_BLOCK_SIZE;

mod scheduled;

/// How long a G1→G2 batch waits for G2 space before it fails `NoSpace` (see
/// [`G1ToG2Executor`]).
const G2_SPACE_PATIENCE: Duration = Duration::from_secs(30);

/// Where G4 lives.
#[derive(Debug, Clone)]
pub enum G4Location {
    /// A local-filesystem object store: in `dir` (persistent), or in a temporary directory.
    Local(Option<PathBuf>),
    /// An S3-compatible store.
    S3(S3Config),
}

/// Everything the tiers are built from.
#[derive(Debug, Clone)]
pub struct TierPlan {
    /// Bytes per block (a multiple of 4096).
    pub block_bytes: usize,
    /// G1 capacity (must hold the longest request).
    pub g1_blocks: usize,
    /// G2 capacity; 0 disables G2 (and so G3 and G4, which are staged through it).
    pub g2_blocks: usize,
    /// G3 capacity; 0 disables G3.
    pub g3_blocks: usize,
    /// Where G3's file and manifest live (persistent); a temporary directory when `None`.
    pub g3_dir: Option<PathBuf>,
    /// G3 I/O settings.
    pub g3_engine: IoEngineKind,
    /// G3 requests in flight per transfer.
    pub g3_queue_depth: u32,
    /// G3 O_DIRECT.
    pub g3_direct_io: bool,
    /// G4, when enabled.
    pub g4: Option<G4Location>,
    /// Key prefix of G4 objects.
    pub g4_namespace: String,
    /// Blocks the G4 presence index can hold.
    pub g4_capacity: usize,
    /// Block managers' settings (eviction policy etc.).
    pub logical: LogicalConfig,
    /// G1→G2 lane.
    pub g1_to_g2: PipelineConfig,
    /// G2→G3 lane.
    pub g2_to_g3: PipelineConfig,
    /// G2→G4 lane.
    pub g2_to_g4: ObjectPipelineConfig,
    /// The transfer managers' settings.
    pub transfer: kvbm_physical::TransferConfig,
    /// G4's settings (its namespace is replaced by `g4_namespace`).
    pub object: ObjectConfig,
    /// The merged engine configuration the replay's `KvbmRuntime` is built from (its runtime,
    /// events and metrics sections, and the leader's search order).
    pub engine: KvbmConfig,
    /// Set when this replay is one of several instances sharing G4.
    pub sharing: Option<Sharing>,
    /// The scheduler's way into the engine.
    pub scheduler: Scheduler,
    /// The workload's block identities (`--scheduler tiering`; empty otherwise).
    pub digests: Arc<Digests>,
}

/// Indexes into [`Counters::bytes`].
#[derive(Debug, Clone, Copy)]
pub enum MovePath {
    /// G1→G2 offload.
    G1ToG2 = 0,
    /// G2→G3 offload.
    G2ToG3 = 1,
    /// G3→G2 onboarding.
    G3ToG2 = 2,
    /// G2→G4 offload.
    G2ToG4 = 3,
    /// G4→G2 onboarding.
    G4ToG2 = 4,
    /// G2→G1 onboarding.
    G2ToG1 = 5,
}

/// Names of the paths, in [`MovePath`] order.
pub const PATH_NAMES: [&str; 6] = [
    "g1_to_g2", "g2_to_g3", "g3_to_g2", "g2_to_g4", "g4_to_g2", "g2_to_g1",
];

/// Counters shared with the pipelines' sinks and executors.
#[derive(Debug, Default)]
pub struct Counters {
    /// Bytes moved per path ([`MovePath`] order).
    pub bytes: [AtomicU64; 6],
    /// Blocks whose transfer failed (any lane, any direction), not counting checksum rejections.
    pub failed_transfers: AtomicU64,
    /// Blocks a tier rejected on read (checksum, header or identity).
    pub checksum_failures: AtomicU64,
    /// Blocks the offload lanes accepted (`enqueue` succeeded), every lane.
    pub offload_enqueued: AtomicU64,
}

impl Counters {
    pub(super) fn add_bytes(&self, path: MovePath, blocks: usize, block_bytes: usize) {
        let b = (blocks * block_bytes) as u64;
        self.bytes[path as usize].fetch_add(b, Ordering::Relaxed);
        metrics::counter!("kvbm_replay_bytes_moved_total", "path" => PATH_NAMES[path as usize])
            .increment(b);
    }
}

/// What serving one request did.
#[derive(Debug, Default, Clone, Copy)]
pub struct Served {
    /// Blocks of the hit prefix, per tier they were found in.
    pub hits: [u64; 4],
    /// Blocks that reached G1 from G2 (staged from G3/G4 or found in G2).
    pub onboarded: u64,
    /// Of those, the ones whose bytes were right.
    pub verified: u64,
    /// Of those, the ones whose bytes were wrong (never served).
    pub corrupt: u64,
    /// Blocks computed in G1.
    pub computed: u64,
    /// Of the hits, G4 blocks another instance wrote.
    pub cross_instance: u64,
}

impl Served {
    /// Counts the prefix's hits by the tier each block came from (0..=3 for G1..G4, 4 for a G4
    /// block another instance wrote: a G4 hit and a cross-instance one).
    pub(super) fn count_hits(&mut self, sources: &[u8]) {
        for s in sources {
            self.hits[(*s as usize).min(3)] += 1;
            self.cross_instance += u64::from(*s == 4);
        }
    }

    /// Adds the request's hits per tier and computed blocks to the replay's metrics.
    pub(super) fn publish(&self) {
        for (tier, h) in self.hits.iter().enumerate() {
            if *h > 0 {
                metrics::counter!("kvbm_replay_hit_blocks_total", "tier" => ["g1", "g2", "g3", "g4"][tier])
                    .increment(*h);
            }
        }
        metrics::counter!("kvbm_replay_computed_blocks_total").increment(self.computed);
    }
}

/// Wall time per stage, summed over requests.
#[derive(Debug, Default, Clone, Copy, serde::Serialize)]
pub struct StageTimes {
    /// Lookups over the tiers.
    pub lookup: f64,
    /// G3→G2 onboarding (transfer + manifest check; waiting for prefetched reads).
    pub g3_to_g2: f64,
    /// Starting G3→G2 reads ahead of their request (presence checks, allocation, submission).
    pub prefetch: f64,
    /// G4→G2 onboarding.
    pub g4_to_g2: f64,
    /// G2→G1 onboarding, with the byte check.
    pub g2_to_g1: f64,
    /// Computing missed blocks in G1 and registering them.
    pub compute: f64,
    /// Handing computed blocks to G2: the G1→G2 lane's enqueue (`--scheduler sessions`), or
    /// the scheduler's store (`tiering`: prepare_store → G1→G2 copy → complete_store → the
    /// lower lanes' enqueue).
    pub offload_enqueue: f64,
    /// Waiting for G1 space while offloads drained.
    pub g1_backpressure: f64,
    /// Waiting for the offload lanes to catch up (see `Tiers::backpressure`).
    pub offload_backpressure: f64,
    /// The end: draining every lane, syncing G3, writing its manifest.
    pub drain: f64,
}

struct HostTier<T: Tier> {
    manager: Arc<BlockManager<T>>,
    handle: LayoutHandle,
    layout: Arc<PhysicalLayout>,
}

impl<T: Tier> HostTier<T> {
    /// The bytes of slot `id`.
    ///
    /// # Safety
    /// As [`slot_of`].
    #[allow(clippy::mut_from_ref)]
    unsafe fn slot(&self, id: usize) -> &mut [u8] {
        // SAFETY: per this function's contract.
        unsafe { slot_of(&self.layout, id) }
    }
}

/// The bytes of slot `id` of the host layout `layout`.
///
/// # Safety
/// `layout` is host memory, and the caller must be the only writer of the slot while the slice
/// lives (a freshly allocated block, or a block whose transfer has completed and which no
/// transfer writes).
#[allow(clippy::mut_from_ref)]
pub(super) unsafe fn slot_of(layout: &PhysicalLayout, id: usize) -> &mut [u8] {
    let (addr, len) = layout.block_addrs(id, 0..1)[0];
    // SAFETY: host memory of the layout, `len` bytes at `addr`, exclusivity per the contract.
    unsafe { std::slice::from_raw_parts_mut(addr as *mut u8, len) }
}

/// What checking a G3 read needs: shared by the read-ahead and the onboarding mover.
#[derive(Clone)]
pub(super) struct G3Check {
    pub(super) manager: Arc<BlockManager<G3>>,
    pub(super) checksums: Arc<Mutex<std::collections::HashMap<u128, u128>>>,
    pub(super) poisoned: Arc<Mutex<HashSet<SequenceHash>>>,
    pub(super) index: Arc<G3Index>,
}

impl G3Tier {
    fn check(&self) -> G3Check {
        G3Check {
            manager: self.manager.clone(),
            checksums: self.checksums.clone(),
            poisoned: self.poisoned.clone(),
            index: self.index.clone(),
        }
    }
}

/// A G3→G2 read started ahead of the request that needs it.
struct Prefetch {
    /// Index of the request it is for.
    request: usize,
    src: Vec<ImmutableBlock<G3>>,
    dst: Vec<MutableBlock<G2>>,
    completion: kvbm_physical::TransferCompletion,
    started: Instant,
}

struct G3Tier {
    manager: Arc<BlockManager<G3>>,
    handle: LayoutHandle,
    layout: Arc<PhysicalLayout>,
    dir: PathBuf,
    _temp: Option<tempfile::TempDir>,
    /// xxh3-128 of each block's payload as written to G3 (sequence hash → checksum).
    checksums: Arc<Mutex<std::collections::HashMap<u128, u128>>>,
    poisoned: Arc<Mutex<HashSet<SequenceHash>>>,
    warm_blocks: usize,
    /// The persistent index (`<dir>/g3.journal`).
    index: Arc<G3Index>,
}

struct G4Tier {
    manager: Arc<BlockManager<G4>>,
    handle: LayoutHandle,
    storage: Arc<ObjectStorage>,
    _temp: Option<tempfile::TempDir>,
    poisoned: Arc<Mutex<HashSet<SequenceHash>>>,
    warm_blocks: usize,
    describe: String,
}

/// The tiers of one replay.
pub struct Tiers {
    block_bytes: usize,
    /// The engine runtime's tokio handle: the offload lanes run there.
    rt: tokio::runtime::Handle,
    /// This thread's runtime: onboarding sessions run on the replay's own thread.
    session_rt: tokio::runtime::Runtime,
    tm: Arc<TransferManager>,
    g1: HostTier<G1>,
    g2: Option<HostTier<G2>>,
    /// The leader over G2, G3 and G4 (none without G2: G1 is then the only tier).
    leader: Option<InstanceLeader>,
    /// The paths sessions move blocks through, and what they report.
    movers: Option<Movers>,
    onboard: Arc<OnboardShared>,
    g3: Option<G3Tier>,
    g4: Option<G4Tier>,
    g1_to_g2: Option<Pipeline<G1>>,
    g2_to_g3: Option<Arc<Pipeline<G2>>>,
    g2_to_g4: Option<Arc<ObjectPipeline>>,
    handles: Arc<Mutex<Vec<TransferHandle>>>,
    /// G1→G2 handles, oldest first: the only offloads whose end frees G1 slots, so waiting for
    /// G1 room waits for these alone ([`Tiers::allocate_g1`]).
    g1_handles: std::collections::VecDeque<TransferHandle>,
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
    /// G3→G2 reads started ahead of their request, oldest first.
    prefetches: std::collections::VecDeque<Prefetch>,
    /// Blocks in G2 because a prefetch staged them, not yet claimed by their request.
    prefetched: HashSet<SequenceHash>,
    /// Blocks with a prefetch in flight.
    prefetching: HashSet<SequenceHash>,
    /// Requests served so far (prefetches are tagged with the request they are for).
    served_requests: usize,
    /// Largest G1→G2 batch (G2 space one batch needs).
    g1_batch: usize,
    /// Queued (weak) blocks evicted from their source tier before their lane reached them.
    pub evicted_before_offload: u64,
    /// Outcomes of the lanes' blocks, from their settled handles: transferred, failed,
    /// filtered, cancelled (every lane).
    pub offload_settled: [u64; 4],
    /// Set when G4 is shared with other instances.
    shared_g4: Option<SharedG4>,
    /// The scheduler-facing manager (`--scheduler tiering`; see [`scheduled`]).
    sched: Option<EngineTieringManager>,
    /// Where the manager's stores go on to G3/G4 (`--scheduler tiering`).
    write_through: Option<scheduled::WriteThrough>,
    /// Requests whose `prepare_load` found a HIT gone, and recomputed (`--scheduler tiering`).
    pub load_refused: u64,
    /// The workload's block identities (see [`Digests`]).
    digests: Arc<Digests>,
    /// The engine runtime (event-flush timer, the lanes' tokio runtime). Last: dropped after
    /// everything that runs on it.
    _runtime: KvbmRuntime,
}

/// The onboarding paths handed to sessions.
struct Movers {
    g3_to_g2: Option<Arc<G3ToG2>>,
    g4_to_g2: Option<Arc<G4ToG2>>,
    g2_to_g1: Arc<G2ToG1>,
}

fn geometry(num_blocks: usize, block_bytes: usize) -> anyhow::Result<BlockLayout> {
    Ok(BlockLayout::builder()
        .num_blocks(num_blocks.max(1))
        .num_layers(1)
        .outer_dim(1)
        .page_size(1)
        .inner_dim(block_bytes)
        .dtype_bytes(1)
        .kind(LayoutKind::FullyContiguous)
        .build()?)
}

fn manager<T: Tier>(
    n: usize,
    registry: &BlockRegistry,
    logical: &LogicalConfig,
) -> anyhow::Result<Arc<BlockManager<T>>> {
    manager_with_sink(n, registry, logical, None)
}

fn manager_with_sink<T: Tier>(
    n: usize,
    registry: &BlockRegistry,
    logical: &LogicalConfig,
    sink: Option<Arc<dyn EventSink>>,
) -> anyhow::Result<Arc<BlockManager<T>>> {
    let mut cfg = logical.clone();
    cfg.block_size = HASH_BLOCK_SIZE;
    let mut builder = BlockManager::<T>::builder()
        .config(cfg)
        .block_count(n)
        .registry(registry.clone());
    if let Some(sink) = sink {
        builder = builder.event_sink(sink);
    }
    Ok(Arc::new(builder.build().with_context(|| {
        format!("cannot build the {} block manager", T::ID)
    })?))
}

/// One instance of several (`kvbm replay --instances`): G4 is shared with the others, and
/// each instance's G4 stored/removed events travel over NATS, so every instance's leader
/// finds the others' G4 blocks (adopted into its own G4 and read from the shared store).
#[derive(Debug, Clone)]
pub struct Sharing {
    /// The NATS server.
    pub nats_url: String,
    /// The subject every instance of this run publishes and subscribes on.
    pub subject: String,
    /// This instance's id (distinct per instance, not 0).
    pub instance: u64,
    /// Instances in the run: each waits for all of them to be subscribed before it starts.
    pub instances: usize,
}

/// What sharing G4 needs at run time.
struct SharedG4 {
    /// Hashes this instance wrote to G4 (or found there at start): a G4 hit on any other
    /// hash is a block another instance wrote.
    own: Arc<Mutex<HashSet<SequenceHash>>>,
    _bus: Arc<NatsBus>,
}

/// Connects to NATS and starts the event bus, the publisher and the cross-instance index.
#[allow(clippy::type_complexity)]
fn start_sharing(
    runtime: &KvbmRuntime,
    s: &Sharing,
) -> anyhow::Result<(
    (Arc<NatsBus>, Arc<EventPublisher>, Arc<CrossInstanceIndex>),
    async_nats::Client,
)> {
    let h = runtime.handle();
    let capacity = runtime.config().events.channel_capacity;
    let (bus, client) = h
        .tokio()
        .block_on(async {
            tokio::time::timeout(Duration::from_secs(15), async {
                let client = kvbm_engine::transport::nats::connect(
                    &s.nats_url,
                    &format!("kvbm-replay-{}", s.instance),
                    Duration::from_secs(1),
                )
                .await?;
                let bus = NatsBus::start(&h, client.clone(), s.subject.clone(), capacity).await?;
                Ok::<_, kvbm_engine::EngineError>((bus, client))
            })
            .await
        })
        .map_err(|_| anyhow!("NATS server {} did not answer within 15 s", s.nats_url))?
        .with_context(|| format!("cannot reach the NATS server {}", s.nats_url))?;
    let publisher = EventPublisher::spawn(&h, InstanceId(s.instance), bus.clone())
        .context("cannot start the event publisher")?;
    let index = Arc::new(CrossInstanceIndex::new());
    CrossInstanceIndex::follow(index.clone(), &h, &*bus)
        .context("cannot follow the cross-instance events")?;
    Ok(((bus, publisher, index), client))
}

/// Waits until every instance of the run is subscribed to the events (NATS does not replay
/// what was published before a subscription, so an instance that started serving early could
/// publish blocks a slower one never hears of). Each instance announces itself on
/// `<subject>.ready` every 50 ms until it has heard all `count`, then once more. Why that is
/// enough: an instance announces only after subscribing, so whoever has heard everyone knows
/// everyone is subscribed, and its last announcement reaches them all.
async fn ready_barrier(
    client: &async_nats::Client,
    subject: &str,
    me: u64,
    count: usize,
) -> anyhow::Result<()> {
    use futures::StreamExt;
    let subject = format!("{subject}.ready");
    let mut sub = client.subscribe(subject.clone()).await?;
    client.flush().await?;
    let mut seen = HashSet::new();
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        client
            .publish(subject.clone(), me.to_string().into())
            .await?;
        client.flush().await?;
        if seen.len() >= count {
            return Ok(());
        }
        if Instant::now() > deadline {
            bail!(
                "only {} of {count} instances announced themselves within 60 s",
                seen.len()
            );
        }
        let tick = tokio::time::sleep(Duration::from_millis(50));
        tokio::pin!(tick);
        loop {
            tokio::select! {
                m = sub.next() => match m {
                    Some(m) => {
                        if let Ok(id) = std::str::from_utf8(&m.payload).unwrap_or("").parse::<u64>() {
                            seen.insert(id);
                        }
                    }
                    None => bail!("the NATS subscription for {subject} ended"),
                },
                () = &mut tick => break,
            }
        }
    }
}

fn lane_policy(registry: &BlockRegistry, cfg: &PipelineConfig) -> Arc<dyn OffloadPolicy> {
    let presence: Arc<dyn OffloadPolicy> = Arc::new(PresenceFilter::new(registry.clone()));
    if cfg.policies.is_empty() {
        presence
    } else {
        Arc::new(AllOfPolicy::new(vec![
            presence,
            create_policy_from_config(&cfg.policies, registry),
        ]))
    }
}

/// Checks a G3→G2 read of block `h` into `dst`: the transfer's outcome `r` (header and
/// identity), then the payload against the checksum recorded when it was written (a valid
/// slot holding another block, or no record of this one, fails). Counts a failure that proves
/// the copy bad ([`BlockFailureKind::drops_copy`]) as a checksum failure and any other as a
/// failed transfer; a block that fails is poisoned in G3 and its record dropped, so it is never
/// read again. `Ok` when the block may be served.
pub(super) fn check_g3_read(
    g2_layout: &PhysicalLayout,
    g3: &G3Check,
    counters: &Counters,
    dst: &MutableBlock<G2>,
    h: SequenceHash,
    r: Result<(), PhysicalError>,
) -> Result<(), BlockFailure> {
    let checked = r.map_err(BlockFailure::physical).and_then(|()| {
        // SAFETY: the transfer into this freshly allocated slot has completed.
        let bytes = unsafe { slot_of(g2_layout, dst.block_id()) };
        let actual = xxhash_rust::xxh3::xxh3_128(bytes);
        let expected = g3.checksums.lock().get(&h.as_u128()).copied();
        if expected == Some(actual) {
            Ok(())
        } else {
            Err(BlockFailure::new(
                BlockFailureKind::ChecksumMismatch,
                format!("G3 block {h} differs from the checksum recorded at write"),
            ))
        }
    });
    if let Err(f) = &checked {
        count_failure(counters, "G3", f);
        g3.poisoned.lock().insert(h);
        g3.checksums.lock().remove(&h.as_u128());
        if let Some(b) = g3.manager.scan_matches(&[h]).first() {
            g3.index.dropped(b.block_id());
        }
    }
    checked
}

/// Counts a failed read from `tier`: a copy proven bad as a checksum failure, anything else as
/// a failed transfer.
pub(super) fn count_failure(counters: &Counters, tier: &str, f: &BlockFailure) {
    if f.kind.drops_copy() {
        tracing::warn!(kind = f.kind.as_str(), error = %f.message, "{tier} rejected a block on read");
        counters.checksum_failures.fetch_add(1, Ordering::Relaxed);
    } else {
        tracing::warn!(kind = f.kind.as_str(), error = %f.message, "{tier}→G2 transfer failed");
        counters.failed_transfers.fetch_add(1, Ordering::Relaxed);
    }
}

/// G2→G3 executor: records each block's payload checksum (for the manifest) before the
/// `kvbm-offload` executor writes it, and counts bytes.
struct RecordingG3Executor {
    inner: BlockTransferExecutor<G2, G3>,
    g2_layout: Arc<PhysicalLayout>,
    checksums: Arc<Mutex<std::collections::HashMap<u128, u128>>>,
    counters: Arc<Counters>,
    block_bytes: usize,
    index: Arc<G3Index>,
}

impl TransferExecutor<G2> for RecordingG3Executor {
    type Output = ImmutableBlock<G3>;

    async fn execute(&self, batch: &ResolvedBatch<G2>) -> BatchOutcome<ImmutableBlock<G3>> {
        // The batch holds its source blocks (upgraded), so their bytes are stable here.
        let sums: Vec<(u128, u128)> = batch
            .block_ids()
            .into_iter()
            .zip(batch.sequence_hashes())
            .map(|(id, h)| {
                let (addr, len) = self.g2_layout.block_addrs(id, 0..1)[0];
                // SAFETY: host memory of the G2 layout; the source block is held by the batch
                // and nothing writes a registered block.
                let bytes = unsafe { std::slice::from_raw_parts(addr as *const u8, len) };
                (h.as_u128(), xxhash_rust::xxh3::xxh3_128(bytes))
            })
            .collect();
        self.checksums.lock().extend(sums.iter().copied());
        let t = Instant::now();
        let out = super::manifest::write_recorded(&self.inner, &self.index, batch, &sums).await;
        metrics::histogram!("kvbm_replay_transfer_seconds", "path" => "g2_to_g3")
            .record(t.elapsed().as_secs_f64());
        let ok = out.iter().filter(|r| r.is_ok()).count();
        self.counters
            .add_bytes(MovePath::G2ToG3, ok, self.block_bytes);
        out
    }
}

/// The G1→G2 executor: waits for G2 space instead of failing `NoSpace`, and copies on the
/// lane's own thread.
///
/// G2 stages every offload: the lower lanes hold a G2 block (strongly) until it is written to
/// G3/G4, so with G2 barely larger than G1 a G1→G2 batch can find every G2 slot held for a
/// moment. `kvbm-offload`'s allocate-then-move executor fails such a batch (`NoSpace`) and the
/// blocks are recomputed later: lost hits. This one retries the allocation, with a short
/// backoff, until G2 has room — the lower lanes free slots as they finish — so no block is
/// dropped for lack of space; the wait is backpressure on the G1→G2 lane (and so on G1, where
/// the replay waits for it). Only a batch larger than G2, or one still without room after
/// `patience` (something holds G2 for good: a bug, reported, never a hang), fails `NoSpace`.
///
/// G1 here is host memory (the GPU's stand-in), so the copy is host to host: one
/// [`TransferManager::execute_transfer_inline`] (the manager's claims and checks, a `memcpy` of
/// at most one batch on this task) instead of a round trip through the manager's runtime.
/// Destinations are registered only after their bytes arrived, as `kvbm-offload`'s
/// `BlockMover` does.
struct G1ToG2Executor {
    tm: Arc<TransferManager>,
    src: LayoutHandle,
    dst: LayoutHandle,
    g2: Arc<BlockManager<G2>>,
    patience: Duration,
    /// Allocation retries that found G2 full (each one backoff sleep).
    waits: Arc<AtomicU64>,
}

impl G1ToG2Executor {
    /// Copies `sources` into `dst` and registers the destinations whose bytes arrived.
    fn copy(
        &self,
        sources: &[(usize, SequenceHash)],
        dst: Vec<MutableBlock<G2>>,
    ) -> BatchOutcome<ImmutableBlock<G2>> {
        let n = sources.len();
        let src_ids: Vec<usize> = sources.iter().map(|(id, _)| *id).collect();
        let dst_ids: Vec<usize> = dst.iter().map(|b| b.block_id()).collect();
        // SAFETY: the destinations are `MutableBlock`s this executor owns (freshly allocated,
        // registered only after the copy); the G1 sources are slots the batch holds, read only.
        let issued = unsafe {
            self.tm.execute_transfer_inline(
                self.src,
                &src_ids,
                self.dst,
                &dst_ids,
                TransferOptions::default(),
            )
        };
        let outcome = match issued {
            Ok(o) => o,
            Err(e) => {
                let e = Arc::new(e);
                return (0..n)
                    .map(|_| Err(BlockFailure::physical_shared(&e)))
                    .collect();
            }
        };
        let mut results: Vec<Option<Result<ImmutableBlock<G2>, BlockFailure>>> =
            (0..n).map(|_| None).collect();
        let (mut complete, mut at) = (Vec::with_capacity(n), Vec::with_capacity(n));
        for (i, ((m, (_, h)), (_, r))) in
            dst.into_iter().zip(sources).zip(outcome.blocks).enumerate()
        {
            match r {
                Ok(()) => match m.complete(*h) {
                    Ok(c) => {
                        complete.push(c);
                        at.push(i);
                    }
                    Err(e) => {
                        results[i] = Some(Err(BlockFailure::new(
                            BlockFailureKind::Transfer,
                            format!("cannot register in G2: {}", e.error),
                        )))
                    }
                },
                // The slot goes back to G2's reset pool; nothing is registered.
                Err(e) => results[i] = Some(Err(BlockFailure::physical(e))),
            }
        }
        for (i, b) in at.into_iter().zip(self.g2.register_blocks(complete)) {
            results[i] = Some(Ok(b));
        }
        results
            .into_iter()
            .map(|r| {
                r.unwrap_or_else(|| {
                    Err(BlockFailure::new(
                        BlockFailureKind::Transfer,
                        "G2 registered fewer blocks than it was given",
                    ))
                })
            })
            .collect()
    }
}

impl TransferExecutor<G1> for G1ToG2Executor {
    type Output = ImmutableBlock<G2>;

    async fn execute(&self, batch: &ResolvedBatch<G1>) -> BatchOutcome<ImmutableBlock<G2>> {
        let n = batch.len();
        let sources: Vec<(usize, SequenceHash)> = batch
            .blocks()
            .iter()
            .map(|b| (b.block_id, b.sequence_hash))
            .collect();
        let no_space = |why: String| -> BatchOutcome<ImmutableBlock<G2>> {
            (0..n)
                .map(|_| Err(BlockFailure::new(BlockFailureKind::NoSpace, why.clone())))
                .collect()
        };
        if n > self.g2.total_blocks() {
            return no_space(format!(
                "a batch of {n} blocks exceeds G2 ({} blocks)",
                self.g2.total_blocks()
            ));
        }
        let deadline = Instant::now() + self.patience;
        let mut backoff = Duration::from_micros(50);
        loop {
            match self.g2.allocate_blocks(n) {
                Ok(dst) => return self.copy(&sources, dst),
                Err(e) if Instant::now() >= deadline => {
                    tracing::warn!(error = %e, "G2 stayed full for {:?}", self.patience);
                    return no_space(format!("G2 stayed full for {:?}: {e}", self.patience));
                }
                Err(_) => {
                    self.waits.fetch_add(1, Ordering::Relaxed);
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(Duration::from_millis(2));
                }
            }
        }
    }
}

/// Fails fast, with a clear message, when nothing listens at an S3 endpoint (the object store
/// client would otherwise retry for minutes).
pub fn probe_endpoint(endpoint: &str) -> anyhow::Result<()> {
    use std::net::ToSocketAddrs;
    let rest = endpoint
        .strip_prefix("http://")
        .or_else(|| endpoint.strip_prefix("https://"))
        .ok_or_else(|| anyhow!("S3 endpoint {endpoint:?} must start with http:// or https://"))?;
    let hostport = rest.split('/').next().unwrap_or(rest);
    let hostport = if hostport.contains(':') {
        hostport.to_string()
    } else if endpoint.starts_with("https://") {
        format!("{hostport}:443")
    } else {
        format!("{hostport}:80")
    };
    let addrs: Vec<_> = hostport
        .to_socket_addrs()
        .with_context(|| format!("cannot resolve S3 endpoint {endpoint}"))?
        .collect();
    let mut last = None;
    for a in addrs {
        match std::net::TcpStream::connect_timeout(&a, Duration::from_secs(3)) {
            Ok(_) => return Ok(()),
            Err(e) => last = Some(e),
        }
    }
    Err(anyhow!(
        "cannot reach S3 endpoint {endpoint}: {}",
        last.map_or("no address".to_string(), |e| e.to_string())
    ))
}

impl Tiers {
    /// Builds every enabled tier, loads what persistent G3/G4 hold, and starts the lanes.
    ///
    /// # Errors
    /// Invalid sizes, storage that cannot be created, an unreachable S3 endpoint.
    pub fn build(plan: &TierPlan) -> anyhow::Result<Tiers> {
        let b = plan.block_bytes;
        if b == 0 || !b.is_multiple_of(4096) {
            bail!(
                "--block-bytes must be a positive multiple of 4096 (O_DIRECT alignment), got {b}"
            );
        }
        if plan.g1_blocks == 0 {
            bail!("G1 cannot be disabled: the replay computes and serves every block in G1");
        }
        if plan.g2_blocks == 0 && (plan.g3_blocks > 0 || plan.g4.is_some()) {
            bail!(
                "G3 and G4 need G2: blocks move to and from them through host memory (set --g2-blocks > 0)"
            );
        }
        let runtime = KvbmRuntime::builder()
            .config(plan.engine.clone())
            .build()
            .context("cannot start the kvbm runtime")?;
        let rt = runtime.handle().tokio().clone();
        let session_rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .context("cannot start the replay thread's runtime")?;
        let _enter = rt.enter();
        let tm = Arc::new(
            TransferManager::with_config(plan.transfer.clone())
                .context("cannot start the transfer manager")?,
        );
        let registry = BlockRegistry::with_config(&plan.logical.registry);
        let counters = Arc::new(Counters::default());

        let host =
            |n: usize, pin: PinPolicy| -> anyhow::Result<(LayoutHandle, Arc<PhysicalLayout>)> {
                let layout = PhysicalLayout::allocate_host(geometry(n, b)?, pin)?;
                let h = tm.register_layout(layout)?;
                Ok((h, tm.layout(h)?))
            };
        let (h1, l1) = host(plan.g1_blocks, PinPolicy::Unpinned)?;
        let g1 = HostTier {
            manager: manager::<G1>(plan.g1_blocks, &registry, &plan.logical)?,
            handle: h1,
            layout: l1,
        };
        let g2 = if plan.g2_blocks > 0 {
            let (h, l) = host(plan.g2_blocks, PinPolicy::TryPin)?;
            Some(HostTier {
                manager: manager::<G2>(plan.g2_blocks, &registry, &plan.logical)?,
                handle: h,
                layout: l,
            })
        } else {
            None
        };

        let g3 = if plan.g3_blocks > 0 {
            let (dir, temp) = match &plan.g3_dir {
                Some(d) => {
                    std::fs::create_dir_all(d)
                        .with_context(|| format!("cannot create G3 directory {}", d.display()))?;
                    (d.clone(), None)
                }
                None => {
                    let t = tempfile::Builder::new()
                        .prefix("kvbm-g3-")
                        .tempdir()
                        .context("cannot create a temporary G3 directory")?;
                    (t.path().to_path_buf(), Some(t))
                }
            };
            let mut disk = DiskConfig::new(dir.join("g3.bin"));
            disk.engine = plan.g3_engine;
            disk.queue_depth = plan.g3_queue_depth;
            disk.direct_io = plan.g3_direct_io;
            let layout = PhysicalLayout::create_disk(geometry(plan.g3_blocks, b)?, &disk)
                .with_context(|| format!("cannot create the G3 file {}", disk.path.display()))?;
            let handle = tm.register_layout(layout)?;
            let manager = manager::<G3>(plan.g3_blocks, &registry, &plan.logical)?;
            let opened = G3Index::open(&dir, &*tm.layout(handle)?)?;
            let (checksums, warm_blocks) = opened.register_listed(&manager)?;
            Some(G3Tier {
                manager,
                handle,
                layout: tm.layout(handle)?,
                dir,
                _temp: temp,
                checksums: Arc::new(Mutex::new(checksums)),
                poisoned: Arc::default(),
                warm_blocks,
                index: Arc::new(opened.index),
            })
        } else {
            None
        };

        // Sharing G4 with other instances: (bus, publisher, index) and the own-G4 set.
        let mut barrier_client = None;
        #[allow(clippy::type_complexity)]
        let shared: Option<(
            (Arc<NatsBus>, Arc<EventPublisher>, Arc<CrossInstanceIndex>),
            Arc<Mutex<HashSet<SequenceHash>>>,
        )> = match &plan.sharing {
            Some(s) => {
                if plan.g4.is_none() {
                    bail!("instances share G4: enable it (--g4, --g4-dir or --s3-endpoint)");
                }
                let (started, client) = start_sharing(&runtime, s)?;
                barrier_client = Some(client);
                Some((started, Arc::default()))
            }
            None => None,
        };
        let g4 = match &plan.g4 {
            None => None,
            Some(loc) => {
                let ocfg = ObjectConfig {
                    namespace: plan.g4_namespace.clone(),
                    ..plan.object.clone()
                };
                let (storage, temp, describe) = match loc {
                    G4Location::Local(Some(dir)) => (
                        ObjectStorage::local(dir, ocfg).with_context(|| {
                            format!("cannot open the G4 directory {}", dir.display())
                        })?,
                        None,
                        format!("local filesystem {}", dir.display()),
                    ),
                    G4Location::Local(None) => {
                        let t = tempfile::Builder::new()
                            .prefix("kvbm-g4-")
                            .tempdir()
                            .context("cannot create a temporary G4 directory")?;
                        let s = ObjectStorage::local(t.path(), ocfg)?;
                        let d = format!("local filesystem {} (temporary)", t.path().display());
                        (s, Some(t), d)
                    }
                    G4Location::S3(s3) => {
                        if let Some(ep) = &s3.endpoint {
                            probe_endpoint(ep)?;
                        }
                        let s = ObjectStorage::s3(s3, ocfg)
                            .with_context(|| format!("cannot configure S3 bucket {}", s3.bucket))?;
                        let d = format!(
                            "S3 {} bucket {}",
                            s3.endpoint.as_deref().unwrap_or("(AWS)"),
                            s3.bucket
                        );
                        (s, None, d)
                    }
                };
                let storage = Arc::new(storage);
                // Warm start: every block object already under the namespace is present.
                let listed = rt
                    .block_on(async {
                        tokio::time::timeout(Duration::from_secs(60), list_blocks(&storage)).await
                    })
                    .map_err(|_| anyhow!("listing G4 ({describe}) timed out after 60 s"))?
                    .with_context(|| format!("cannot list G4 ({describe})"))?;
                if let Some(sh) = &shared {
                    sh.1.lock().extend(listed.iter().copied());
                }
                let manager = manager_with_sink::<G4>(
                    plan.g4_capacity + listed.len(),
                    &registry,
                    &plan.logical,
                    shared
                        .as_ref()
                        .map(|sh| sh.0.1.clone() as Arc<dyn EventSink>),
                )?;
                let mut complete = Vec::with_capacity(listed.len());
                for (blk, h) in manager
                    .allocate_blocks(listed.len())?
                    .into_iter()
                    .zip(&listed)
                {
                    if let Ok(c) = blk.complete(*h) {
                        complete.push(c);
                    }
                }
                let warm_blocks = manager.register_blocks(complete).len();
                let handle =
                    tm.register_layout(PhysicalLayout::object(geometry(1, b)?, storage.clone()))?;
                Some(G4Tier {
                    manager,
                    handle,
                    storage,
                    _temp: temp,
                    poisoned: Arc::default(),
                    warm_blocks,
                    describe,
                })
            }
        };

        // The leader searches the replay's own G2/G3/G4 managers (one shared registry); every
        // onboarding move runs on the shared transfer manager: a layout is registered in one
        // manager only (kvbm-physical refuses a second view of the same memory, which could race
        // with the first), so the claims that keep two transfers off one block cover every move.
        let onboard = Arc::new(OnboardShared::default());
        let (mut leader, mut movers) = (None, None);
        let events = runtime.handle();
        events.register_event_source(&(g1.manager.clone() as Arc<dyn EventSource>));
        if let Some(g2t) = &g2 {
            let mut builder = InstanceLeader::builder()
                .g2(g2t.manager.clone())
                .search(plan.engine.leader.search.clone());
            events.register_event_source(&(g2t.manager.clone() as Arc<dyn EventSource>));
            if let Some(g3t) = &g3 {
                builder = builder.g3(g3t.manager.clone());
                events.register_event_source(&(g3t.manager.clone() as Arc<dyn EventSource>));
            }
            if let Some(g4t) = &g4 {
                builder = builder.g4(g4t.manager.clone());
                events.register_event_source(&(g4t.manager.clone() as Arc<dyn EventSource>));
            }
            if let (Some(((_, _, index), _)), Some(s)) = (&shared, &plan.sharing) {
                builder = builder.remote(RemoteSearch {
                    index: index.clone(),
                    this: InstanceId(s.instance),
                    shared_g4: true,
                });
            }
            leader = Some(
                builder
                    .build()
                    .context("cannot build the instance leader")?,
            );
            movers = Some(Movers {
                g3_to_g2: g3.as_ref().map(|g3t| {
                    Arc::new(G3ToG2 {
                        tm: tm.clone(),
                        g3: g3t.handle,
                        g2: g2t.handle,
                        g2_manager: g2t.manager.clone(),
                        g2_layout: g2t.layout.clone(),
                        check: g3t.check(),
                        counters: counters.clone(),
                        block_bytes: b,
                        shared: onboard.clone(),
                        digests: plan.digests.clone(),
                    })
                }),
                g4_to_g2: g4.as_ref().map(|g4t| {
                    Arc::new(G4ToG2 {
                        tm: tm.clone(),
                        g4: g4t.handle,
                        g2: g2t.handle,
                        g2_manager: g2t.manager.clone(),
                        poisoned: g4t.poisoned.clone(),
                        counters: counters.clone(),
                        block_bytes: b,
                        shared: onboard.clone(),
                        digests: plan.digests.clone(),
                    })
                }),
                g2_to_g1: Arc::new(G2ToG1 {
                    tm: tm.clone(),
                    g2: g2t.handle,
                    g1: g1.handle,
                    g1_manager: g1.manager.clone(),
                    g1_layout: g1.layout.clone(),
                    counters: counters.clone(),
                    block_bytes: b,
                    shared: onboard.clone(),
                }),
            });
        }

        let handles: Arc<Mutex<Vec<TransferHandle>>> = Arc::new(Mutex::new(Vec::new()));
        let g2_space_waits = Arc::new(AtomicU64::new(0));
        let handoffs: Handoffs = Arc::new(Mutex::new(Vec::new()));
        let (mut g1_to_g2, mut g2_to_g3, mut g2_to_g4) = (None, None, None);
        if let Some(g2t) = &g2 {
            if let Some(g3t) = &g3 {
                let exec = RecordingG3Executor {
                    inner: BlockTransferExecutor::<G2, G3>::from_mover(
                        kvbm_offload::BlockMover::from_layout(
                            g2t.handle,
                            &kvbm_offload::BoundTier::new(
                                tm.clone(),
                                g3t.handle,
                                g3t.manager.clone(),
                            )?,
                        )?,
                    ),
                    g2_layout: g2t.layout.clone(),
                    checksums: g3t.checksums.clone(),
                    counters: counters.clone(),
                    block_bytes: b,
                    index: g3t.index.clone(),
                };
                g2_to_g3 = Some(Arc::new(
                    PipelineBuilder::<G2, G3>::new()
                        .config(plan.g2_to_g3.clone())
                        .policy(lane_policy(&registry, &plan.g2_to_g3))
                        .build()
                        .spawn(exec)
                        .context("cannot start the G2→G3 pipeline")?,
                ));
            }
            if let Some(g4t) = &g4 {
                let exec = ObjectTransferExecutor::<G2>::new(tm.clone(), g2t.handle, g4t.handle)
                    .with_g4_manager(g4t.manager.clone());
                let c = counters.clone();
                let own = shared.as_ref().map(|sh| sh.1.clone());
                let sink: kvbm_offload::CompletionSink<SequenceHash> =
                    Arc::new(move |done: Vec<SequenceHash>| {
                        c.add_bytes(MovePath::G2ToG4, done.len(), b);
                        if let Some(own) = &own {
                            own.lock().extend(done);
                        }
                    });
                let mut builder = ObjectPipelineBuilder::new(g4t.storage.clone())
                    .config(plan.g2_to_g4.clone())
                    .policy(Arc::new(PresenceFilter::new(registry.clone())));
                if !plan.g2_to_g4.pipeline.policies.is_empty() {
                    builder = builder.policy(create_policy_from_config(
                        &plan.g2_to_g4.pipeline.policies,
                        &registry,
                    ));
                }
                g2_to_g4 = Some(Arc::new(
                    builder
                        .spawn_with_sink(exec, Some(sink))
                        .context("cannot start the G2→G4 pipeline")?,
                ));
            }
            // With the tiering scheduler, the scheduler's own store (prepare_store → copy →
            // complete_store) is G1→G2, and the replay hands the stored blocks to the lower
            // lanes itself ([`scheduled`]).
            if plan.scheduler == Scheduler::Sessions {
                let exec = G1ToG2Executor {
                    tm: tm.clone(),
                    src: g1.handle,
                    dst: g2t.handle,
                    g2: g2t.manager.clone(),
                    patience: G2_SPACE_PATIENCE,
                    waits: g2_space_waits.clone(),
                };
                let (next3, next4, hs, ho, c) = (
                    g2_to_g3.clone(),
                    g2_to_g4.clone(),
                    handles.clone(),
                    handoffs.clone(),
                    counters.clone(),
                );
                let sink: kvbm_offload::CompletionSink<ImmutableBlock<G2>> =
                    Arc::new(move |blocks: Vec<ImmutableBlock<G2>>| {
                        c.add_bytes(MovePath::G1ToG2, blocks.len(), b);
                        // Strong references: a G2 block is not evicted before it reached the lower
                        // tiers (write-through). The replay loop bounds how many are in flight.
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
                        .config(plan.g1_to_g2.clone())
                        .policy(lane_policy(&registry, &plan.g1_to_g2))
                        .build()
                        .spawn_with_sink(exec, Some(sink))
                        .context("cannot start the G1→G2 pipeline")?,
                );
            }
        }
        let mut write_through = None;
        let sched = match (&leader, &movers, plan.scheduler) {
            (Some(l), Some(m), Scheduler::Tiering) => Some({
                let mut sched = l
                    .tiering_manager(
                        PromotionMovers {
                            g3_to_g2: m.g3_to_g2.clone().map(|m| m as Arc<dyn BlockMove<G3, G2>>),
                            g4_to_g2: m.g4_to_g2.clone().map(|m| m as Arc<dyn BlockMove<G4, G2>>),
                        },
                        rt.clone(),
                    )
                    .context("cannot build the scheduler-facing tiering manager")?;
                let w = scheduled::WriteThrough::new(
                    g2_to_g3.clone(),
                    g2_to_g4.clone(),
                    handles.clone(),
                    counters.clone(),
                    // A batch is a small share of G2 (the buffer holds its blocks).
                    (plan.g2_blocks / 32).min(256),
                );
                sched.set_store_sink(w.sink());
                write_through = Some(w);
                sched
            }),
            _ => None,
        };
        drop(_enter);
        // Everything is set up: wait for the other instances before serving.
        if let (Some(client), Some(s)) = (&barrier_client, &plan.sharing) {
            rt.block_on(ready_barrier(client, &s.subject, s.instance, s.instances))
                .context("waiting for the other instances")?;
        }
        Ok(Tiers {
            block_bytes: b,
            rt,
            session_rt,
            tm,
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
            prefetches: std::collections::VecDeque::new(),
            prefetched: HashSet::new(),
            prefetching: HashSet::new(),
            served_requests: 0,
            g1_batch: plan.g1_to_g2.batch_config.max_batch_size,
            shared_g4: shared.map(|((bus, _, _), own)| SharedG4 { own, _bus: bus }),
            sched,
            write_through,
            load_refused: 0,
            digests: plan.digests.clone(),
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

    /// Before a request of `hashes` takes any handle: waits out offload backpressure, finishes
    /// the reads started ahead for it (and any still reading one of its blocks: read again here,
    /// it would be a second transfer of the same slot, and a damaged block would be rejected,
    /// and counted, twice), and makes room in G1.
    fn admit(&mut self, hashes: &[SequenceHash]) {
        self.discard_rejected();
        self.backpressure(hashes.len());
        self.complete_prefetches(self.served_requests);
        if !self.prefetching.is_empty() && hashes.iter().any(|h| self.prefetching.contains(h)) {
            self.complete_prefetches(usize::MAX);
        }
        self.ensure_g1_room(hashes.len());
        self.served_requests += 1;
    }

    /// Drops the G3 and G4 blocks their tier rejected on read (poisoned) from the tier's
    /// manager once nothing holds them (`BlockManager::discard_inactive`): unregistered, their
    /// slots free, so the lanes may write a fresh copy later. A block stays poisoned (never
    /// read) until it is dropped or has left the tier. The poisoned sets are leaf locks: read,
    /// released, then the manager is called, then taken again to forget the dropped ones.
    fn discard_rejected(&mut self) {
        fn drop_from<T: Tier>(manager: &BlockManager<T>, poisoned: &Mutex<HashSet<SequenceHash>>) {
            let pending: Vec<SequenceHash> = {
                let p = poisoned.lock();
                if p.is_empty() {
                    return;
                }
                p.iter().copied().collect()
            };
            let gone: Vec<SequenceHash> = pending
                .into_iter()
                .filter(|h| {
                    manager.discard_inactive(&[*h]) == 1
                        || !manager.registry().is_present(*h, T::ID)
                })
                .collect();
            if !gone.is_empty() {
                let mut p = poisoned.lock();
                for h in gone {
                    p.remove(&h);
                }
            }
        }
        if let Some(g3) = &self.g3 {
            drop_from(&g3.manager, &g3.poisoned);
        }
        if let Some(g4) = &self.g4 {
            drop_from(&g4.manager, &g4.poisoned);
        }
    }

    /// Serves one request: lookup, onboarding, computing the rest, offloading it.
    ///
    /// # Errors
    /// Only when the request cannot be served at all (G1 too small); failed or rejected
    /// transfers are counted and their blocks recomputed.
    pub fn serve(&mut self, hashes: &[SequenceHash]) -> anyhow::Result<Served> {
        self.admit(hashes);
        let mut served = Served::default();
        let n = hashes.len();
        let before = self.onboard_tally();
        let (found, src, mut held_g1) = self.onboard_prefix(hashes)?;
        let fail_at = found;
        let after = self.onboard_tally();
        served.onboarded = after[0] - before[0];
        served.verified = after[1] - before[1];
        served.corrupt = after[2] - before[2];
        served.count_hits(&src[..fail_at]);

        // 4. Compute the rest in G1 and hand it to the G1→G2 lane.
        if fail_at < n {
            let t = Instant::now();
            let nested = self.nested_time();
            let registered = self.compute(&hashes[fail_at..])?;
            served.computed = registered.len() as u64;
            self.times.compute += t.elapsed().as_secs_f64() - (self.nested_time() - nested);
            if let Some(p) = &self.g1_to_g2 {
                let t = Instant::now();
                // A plain blocking enqueue: no trip through the runtime unless the queue is full.
                match p.enqueue_blocking(registered.clone(), None) {
                    Ok(h) => {
                        self.counters
                            .offload_enqueued
                            .fetch_add(registered.len() as u64, Ordering::Relaxed);
                        self.g1_handles.push_back(h);
                    }
                    Err(e) => bail!("the G1→G2 pipeline refused blocks: {e}"),
                }
                self.times.offload_enqueue += t.elapsed().as_secs_f64();
            }
            held_g1.extend(registered);
        }
        served.publish();
        // End of the "forward pass": the request's G1 blocks become inactive (evictable).
        drop(held_g1);
        Ok(served)
    }

    /// Fills fresh G1 blocks with the bytes of `hashes` and registers them.
    fn compute(&mut self, hashes: &[SequenceHash]) -> anyhow::Result<Vec<ImmutableBlock<G1>>> {
        let blocks = self.allocate_g1(hashes.len())?;
        let mut complete = Vec::with_capacity(hashes.len());
        for (blk, h) in blocks.into_iter().zip(hashes) {
            // SAFETY: freshly allocated slot: no transfer reads or writes it.
            let slot = unsafe { self.g1.slot(blk.block_id()) };
            content::fill(content::seed(*h), slot);
            complete.push(
                blk.complete(*h)
                    .map_err(|e| anyhow!("cannot complete a G1 block: {}", e.error))?,
            );
        }
        Ok(self.g1.manager.register_blocks(complete))
    }

    /// Onboarded, verified and corrupt blocks so far.
    fn onboard_tally(&self) -> [u64; 3] {
        let o = &self.onboard;
        [
            o.onboarded.load(Ordering::Relaxed),
            o.verified.load(Ordering::Relaxed),
            o.corrupt.load(Ordering::Relaxed),
        ]
    }

    /// Where `matched` must end: before its first G3 or G4 block already rejected (poisoned).
    fn usable(&self, matched: &MatchedPrefix) -> usize {
        let mut cut = matched.len();
        // The holder's index of the first rejected block, mapped to its prefix position (a
        // tier may hold several runs of the prefix).
        let first_bad = |tier: TierId, i: Option<usize>| i.map(|i| matched.positions(tier)[i]);
        if let Some(g3) = &self.g3 {
            let p = g3.poisoned.lock();
            if !p.is_empty() {
                let i = matched
                    .g3()
                    .blocks()
                    .iter()
                    .position(|b| p.contains(&b.sequence_hash()));
                if let Some(at) = first_bad(TierId::G3, i) {
                    cut = cut.min(at);
                }
            }
        }
        if let Some(g4) = &self.g4 {
            let p = g4.poisoned.lock();
            if !p.is_empty() {
                let i = matched
                    .g4()
                    .blocks()
                    .iter()
                    .position(|b| p.contains(&b.sequence_hash()));
                if let Some(at) = first_bad(TierId::G4, i) {
                    cut = cut.min(at);
                }
            }
        }
        cut
    }

    /// The first block of `hashes[from..to]` a mover reported failed (and clears the reports).
    fn first_failed(&self, hashes: &[SequenceHash], from: usize, to: usize) -> Option<usize> {
        let failed = std::mem::take(&mut *self.onboard.failed.lock());
        if failed.is_empty() {
            return None;
        }
        let failed: HashSet<SequenceHash> = failed.into_iter().collect();
        hashes[from..to]
            .iter()
            .position(|h| failed.contains(h))
            .map(|i| from + i)
    }

    /// Lookup and onboarding of a request's prefix, like a scheduler over the engine:
    ///
    /// ```text
    ///  G1 match (the inference engine's own prefix cache)
    ///   └─► leader.find_matches(rest): G2, G3, G4 runs, held  ──► cut at rejected blocks
    ///        └─► OnboardingSession: prepare (G3→G2, G4→G2) ──► onboard (G2→G1) ──► finish
    ///  any block failed ──► the session fails (releasing everything); the prefix is cut at the
    ///  first failed block and looked up again (what moved before it is found in G1/G2 now)
    /// ```
    ///
    /// Returns the prefix length reached in G1, the tier each prefix block was found in
    /// (0..=3, 4 for a G4 block another instance wrote; fixed by the first attempt so a block moved up by a failed attempt still counts
    /// as the tier it came from), and the held G1 blocks.
    #[allow(clippy::type_complexity)]
    fn onboard_prefix(
        &mut self,
        hashes: &[SequenceHash],
    ) -> anyhow::Result<(usize, Vec<u8>, Vec<ImmutableBlock<G1>>)> {
        let n = hashes.len();
        let mut src: Vec<u8> = Vec::with_capacity(n);
        let mut held_g1: Vec<ImmutableBlock<G1>> = Vec::with_capacity(n);
        let mut limit = n;
        loop {
            held_g1.clear();
            let t = Instant::now();
            let g1m = self.g1.manager.match_blocks(&hashes[..limit]);
            let at = g1m.len();
            held_g1.extend(g1m);
            while src.len() < at {
                src.push(0);
            }
            let matched = match &self.leader {
                Some(l) if at < limit => {
                    let mut m = l.find_matches(&hashes[at..limit]);
                    m.truncate(self.usable(&m));
                    m
                }
                _ => MatchedPrefix::default(),
            };
            for run in matched.runs() {
                for k in run.start..run.start + run.len {
                    if at + k < src.len() {
                        continue;
                    }
                    src.push(match run.tier {
                        // A block read ahead from G3 for this request is a G3 hit.
                        TierId::G2 if self.prefetched.remove(&hashes[at + k]) => 2,
                        TierId::G2 => 1,
                        TierId::G3 => 2,
                        // Written by another instance: a cross-instance hit (tier 4 here).
                        TierId::G4
                            if self
                                .shared_g4
                                .as_ref()
                                .is_some_and(|s| !s.own.lock().contains(&hashes[at + k])) =>
                        {
                            4
                        }
                        TierId::G4 => 3,
                        TierId::G1 => 0,
                    });
                }
            }
            self.times.lookup += t.elapsed().as_secs_f64();
            let (Some(movers), false) = (&self.movers, matched.is_empty()) else {
                return Ok((at, src, held_g1));
            };
            let (g3_to_g2, g4_to_g2, g2_to_g1) = (
                movers.g3_to_g2.clone(),
                movers.g4_to_g2.clone(),
                movers.g2_to_g1.clone(),
            );
            let end = at + matched.len();
            let need4 = matched.count(TierId::G4);
            let need = matched.count(TierId::G3) + need4;
            let first_staged = matched
                .runs()
                .iter()
                .find(|r| r.tier != TierId::G2)
                .map_or(at, |r| at + r.start);
            let session = OnboardingSession::new(matched);

            // Stage the G3 and G4 parts in G2 (a G2-only prefix just moves to `Staged`). Reads
            // started ahead hold G2 slots: finish them first when G2 lacks the room.
            {
                let t = Instant::now();
                let nested = self.nested_time();
                if !self.prefetches.is_empty()
                    && self
                        .g2
                        .as_ref()
                        .is_some_and(|g2| g2.manager.available_blocks() < need)
                {
                    self.complete_prefetches(usize::MAX);
                }
                let g3_before = self.onboard.g3_nanos.load(Ordering::Relaxed);
                let staged = self.session_rt.block_on(session.prepare(StagingMovers {
                    g3_to_g2: g3_to_g2.map(|m| m as Arc<dyn BlockMove<G3, G2>>),
                    g4_to_g2: g4_to_g2.map(|m| m as Arc<dyn BlockMove<G4, G2>>),
                    remote_g2: None,
                }));
                let g3 = (self.onboard.g3_nanos.load(Ordering::Relaxed) - g3_before) as f64 / 1e9;
                let all = t.elapsed().as_secs_f64() - (self.nested_time() - nested);
                self.times.g3_to_g2 += g3;
                // The rest is G4 staging, or, for a prefix all in G2, the session's own cost
                // (part of bringing G2 blocks to G1).
                if need4 > 0 {
                    self.times.g4_to_g2 += (all - g3).max(0.0);
                } else {
                    self.times.g2_to_g1 += (all - g3).max(0.0);
                }
                if let Err(e) = staged {
                    tracing::debug!(error = %e, "staging failed; the prefix is cut");
                    limit = self.first_failed(hashes, at, end).unwrap_or(first_staged);
                    continue;
                }
            }

            // Onboard the staged prefix to G1 (every block checked against its bytes).
            let t = Instant::now();
            let nested = self.nested_time();
            let len = session.prefix_len();
            let dst = match self.g1.manager.allocate_blocks(len) {
                Ok(d) => d,
                Err(_) => self.allocate_g1(len)?,
            };
            let onboarded = self
                .session_rt
                .block_on(session.onboard(g2_to_g1 as Arc<dyn BlockMove<G2, G1>>, dst));
            self.times.g2_to_g1 += t.elapsed().as_secs_f64() - (self.nested_time() - nested);
            if let Err(e) = onboarded {
                tracing::debug!(error = %e, "onboarding failed; the prefix is cut");
                limit = self.first_failed(hashes, at, end).unwrap_or(at);
                continue;
            }
            match session.finish() {
                FinishOutcome::Finished(blocks) => held_g1.extend(blocks),
                other => bail!("an onboarded session did not finish: {other:?}"),
            }
            return Ok((end, src, held_g1));
        }
    }

    /// Time of the stages that can run nested inside another (waiting for G1 room, finishing
    /// prefetched G3 reads): subtracted from the enclosing stage so the stages add up to the wall
    /// time.
    fn nested_time(&self) -> f64 {
        self.times.g1_backpressure + self.times.g3_to_g2
    }

    /// Blocks queued or in flight in the offload lanes.
    fn lane_pending(&self) -> usize {
        self.g1_to_g2.as_ref().map_or(0, |p| p.pending_blocks())
            + self.g2_to_g3.as_ref().map_or(0, |p| p.pending_blocks())
            + self
                .g2_to_g4
                .as_ref()
                .map_or(0, |p| p.pipeline().pending_blocks())
    }

    /// Offload backpressure. The lanes hold their G2 blocks until written below, and the
    /// replay's "forward pass" is instant, so without a bound it would outrun them and find G2
    /// full of pinned blocks. Before a request of `n` blocks it waits (as a scheduler stalls
    /// on a full host cache) while lanes still have work and either more than half of G2 is
    /// queued in them or G2 has fewer than `n` + one G1→G2 batch allocatable blocks.
    ///
    /// While it waits, G3 reads started ahead (which hold G2 slots until their request comes
    /// up) are finished, so their slots become evictable: a G1→G2 batch waiting for G2 room
    /// (see [`G1ToG2Executor`]) must not wait on this thread.
    fn backpressure(&mut self, n: usize) {
        let Some(g2) = self.g2.as_ref().map(|g| g.manager.clone()) else {
            return;
        };
        let high = (g2.total_blocks() / 2).max(1);
        let reserve = n + self.g1_batch;
        let starved = |t: &Self| {
            let pending = t.lane_pending();
            pending > 0 && (pending > high || g2.available_blocks() < reserve)
        };
        // Blocks buffered for the write-through are held in G2: hand them to the lanes before
        // deciding (they are what the lanes must write to free G2).
        if let Some(w) = &self.write_through
            && g2.available_blocks() < reserve
        {
            w.flush(true);
        }
        if !starved(self) {
            return;
        }
        let t = Instant::now();
        let nested = self.nested_time();
        self.complete_prefetches(usize::MAX);
        while starved(self) {
            std::thread::sleep(Duration::from_micros(200));
        }
        self.times.offload_backpressure +=
            t.elapsed().as_secs_f64() - (self.nested_time() - nested);
    }

    /// Makes sure G1 can hand out `n` blocks before the request takes any handle: waits, holding
    /// nothing, for G1→G2 offloads (oldest first) to release G1 slots. Waiting later, while
    /// holding the request's G2 hits, could be a cycle: the G1→G2 lane holds G1 blocks and may
    /// be waiting for G2 room those hits take.
    fn ensure_g1_room(&mut self, n: usize) {
        if self.g1.manager.available_blocks() >= n {
            return;
        }
        // The G1→G2 lane may be waiting for G2 room that reads started ahead hold.
        self.complete_prefetches(usize::MAX);
        let t = Instant::now();
        while self.g1.manager.available_blocks() < n {
            let Some(h) = self.g1_handles.pop_front() else {
                break; // nothing left to wait for; allocation reports G1 too small
            };
            match self.rt.block_on(h.wait()) {
                Ok(r) => self.tally(&r),
                Err(e) => tracing::warn!(error = %e, "an offload did not finish"),
            }
        }
        self.times.g1_backpressure += t.elapsed().as_secs_f64();
    }

    fn allocate_g1(&mut self, n: usize) -> anyhow::Result<Vec<MutableBlock<G1>>> {
        if let Ok(v) = self.g1.manager.allocate_blocks(n) {
            return Ok(v);
        }
        // G1 is full of blocks still being offloaded (the lanes hold them until they are
        // written below): wait for the outstanding offloads, oldest first, retrying after each
        // round. (A settlement token would not do: it covers only dispatched batches.) A G1→G2
        // batch may itself be waiting for G2 room: finish the reads started ahead first, so the
        // G2 slots they hold become evictable and cannot keep it waiting (their time counts as
        // G3→G2). Normally [`Self::ensure_g1_room`] made room before the request took any
        // handle, and this path is not taken.
        self.complete_prefetches(usize::MAX);
        let t = Instant::now();
        while let Some(h) = self.g1_handles.pop_front() {
            match self.rt.block_on(h.wait()) {
                Ok(r) => self.tally(&r),
                Err(e) => tracing::warn!(error = %e, "an offload did not finish"),
            }
            if let Ok(v) = self.g1.manager.allocate_blocks(n) {
                self.times.g1_backpressure += t.elapsed().as_secs_f64();
                return Ok(v);
            }
        }
        let r = self.g1.manager.allocate_blocks(n).map_err(|e| {
            anyhow!(
                "G1 ({} blocks) cannot hold a request of {n} blocks: {e}; raise --g1-blocks",
                self.g1.manager.total_blocks()
            )
        });
        self.times.g1_backpressure += t.elapsed().as_secs_f64();
        r
    }

    /// Starts reading, for the request with index `request` (served later), the blocks of its
    /// prefix that only G3 holds into G2, so the read overlaps the requests before it.
    ///
    /// Presence is read from the registry without taking handles; blocks are matched in G3
    /// (held until the read ends) and staged exactly as a synchronous onboarding would, with
    /// the same checks, when the request comes up ([`Self::complete_prefetches`]). A block
    /// evicted from G2 before then is simply read again.
    pub fn prefetch(&mut self, request: usize, hashes: &[SequenceHash]) {
        let t = Instant::now();
        self.start_prefetch(request, hashes);
        self.times.prefetch += t.elapsed().as_secs_f64();
    }

    fn start_prefetch(&mut self, request: usize, hashes: &[SequenceHash]) {
        let (Some(g2), Some(g3)) = (&self.g2, &self.g3) else {
            return;
        };
        let registry = g2.manager.registry();
        let mut want = Vec::new();
        for h in hashes {
            let tiers = registry.tiers(*h);
            if tiers.contains(&TierId::G1) || tiers.contains(&TierId::G2) {
                continue;
            }
            if !tiers.contains(&TierId::G3) && !tiers.contains(&TierId::G4) {
                break; // the prefix ends here
            }
            if tiers.contains(&TierId::G3)
                && !g3.poisoned.lock().contains(h)
                && !self.prefetching.contains(h)
            {
                want.push(*h);
            }
        }
        if want.is_empty() {
            return;
        }
        // Reads in flight hold G2 slots: keep them to a quarter of G2.
        let budget = (g2.manager.total_blocks() / 4).saturating_sub(self.prefetching.len());
        want.truncate(budget);
        if want.is_empty() {
            return;
        }
        let src = g3.manager.scan_matches(&want);
        if src.is_empty() {
            return;
        }
        let Ok(dst) = g2.manager.allocate_blocks(src.len()) else {
            return;
        };
        let src_ids: Vec<usize> = src.iter().map(|b| b.block_id()).collect();
        let dst_ids: Vec<usize> = dst.iter().map(|b| b.block_id()).collect();
        let started = Instant::now();
        // SAFETY: the destinations are `MutableBlock`s allocated for this read-ahead (nothing reads
        // them before it completes); the sources are registered G3 blocks held by `src`.
        if let Ok(completion) = unsafe {
            self.tm.execute_transfer(
                g3.handle,
                &src_ids,
                g2.handle,
                &dst_ids,
                TransferOptions::default().identities(
                    src.iter()
                        .map(|b| block_identity(b.sequence_hash()))
                        .collect(),
                ),
            )
        } {
            self.prefetching
                .extend(src.iter().map(|b| b.sequence_hash()));
            self.prefetches.push_back(Prefetch {
                request,
                src,
                dst,
                completion,
                started,
            });
        }
    }

    /// Finishes every prefetch for requests up to `request`: checks each block like a
    /// synchronous G3→G2 onboarding and registers the good ones in G2.
    fn complete_prefetches(&mut self, request: usize) {
        while self
            .prefetches
            .front()
            .is_some_and(|p| p.request <= request)
        {
            let p = self.prefetches.pop_front().expect("checked");
            let t = Instant::now();
            let outcome = p.completion.wait();
            self.times.g3_to_g2 += t.elapsed().as_secs_f64();
            metrics::histogram!("kvbm_replay_transfer_seconds", "path" => "g3_to_g2")
                .record(p.started.elapsed().as_secs_f64());
            let (Some(g2), Some(g3)) = (&self.g2, &self.g3) else {
                return;
            };
            let check = g3.check();
            let mut ok = 0;
            let mut complete = Vec::with_capacity(p.src.len());
            for ((blk, mblk), (_, r)) in p.src.iter().zip(p.dst).zip(outcome.blocks) {
                let h = blk.sequence_hash();
                self.prefetching.remove(&h);
                ok += usize::from(r.is_ok());
                if check_g3_read(&g2.layout, &check, &self.counters, &mblk, h, r).is_ok()
                    && let Ok(c) = mblk.complete_with_digest(h, self.digests.get(h))
                {
                    complete.push(c);
                }
            }
            self.counters
                .add_bytes(MovePath::G3ToG2, ok, self.block_bytes);
            for b in g2.manager.register_blocks(complete) {
                self.prefetched.insert(b.sequence_hash());
            }
        }
    }

    /// Counts one finished lane transfer: evicted-before-offload, filtered and no-space blocks
    /// are offloads that never started (nothing moved); every other failure is a failed
    /// transfer.
    fn tally(&mut self, r: &TransferResult) {
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

    /// Blocks held (not available) per tier now: once the replay is drained and no request
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

    /// The replay is about to wait for the next request's timestamp: hands everything buffered
    /// on to the lanes, so the wait overlaps their work.
    pub fn idle(&mut self) {
        if let Some(w) = &self.write_through {
            w.flush(true);
        }
    }

    /// Collects finished lane handles.
    pub fn reap(&mut self) {
        let done: Vec<TransferResult> = {
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
            metrics::gauge!("kvbm_replay_tier_capacity_blocks", "tier" => tier).set(cap as f64);
        }
    }

    /// Drains every lane (G1→G2 first, so its chained blocks are enqueued before the lower
    /// lanes are waited for), syncs G3 and writes its manifest, and stops the pipelines.
    ///
    /// # Errors
    /// A G3 sync or manifest write that failed.
    pub fn finish(&mut self) -> anyhow::Result<()> {
        let t = Instant::now();
        if let Some(s) = &mut self.sched {
            self.session_rt.block_on(s.settle());
        }
        if let Some(w) = &self.write_through {
            w.flush(true);
        }

        self.complete_prefetches(usize::MAX);
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
            let pending: Vec<TransferHandle> = std::mem::take(&mut *self.handles.lock());
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
            g3.index.sync().context("cannot sync the G3 journal")?;
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

/// Sink hand-offs still waiting for room in a full lane.
type Handoffs = Arc<Mutex<Vec<tokio::task::JoinHandle<()>>>>;

/// Hands blocks from a completion sink to the next lane. A sink runs on a pipeline's runtime
/// thread and must not block, so this tries first and, when the next lane's input queue is full,
/// finishes the hand-off with an awaited enqueue on a task of that runtime: backpressure delays
/// the blocks, it never drops them. A closed or failed lane is logged (the replay's drain
/// reports what did not settle).
fn enqueue_from_sink<P: Send + Sync + 'static>(
    p: &Arc<P>,
    pipeline: fn(&P) -> &Pipeline<G2>,
    blocks: Vec<ImmutableBlock<G2>>,
    handles: &Arc<Mutex<Vec<TransferHandle>>>,
    handoffs: &Handoffs,
    counters: &Arc<Counters>,
    lane: &'static str,
) {
    let n = blocks.len() as u64;
    match pipeline(p).try_enqueue(blocks, None) {
        Ok(h) => {
            counters.offload_enqueued.fetch_add(n, Ordering::Relaxed);
            handles.lock().push(h);
        }
        Err(EnqueueError::Full(rejected)) => {
            let (p, handles, counters) = (Arc::clone(p), Arc::clone(handles), Arc::clone(counters));
            handoffs.lock().push(tokio::spawn(async move {
                match pipeline(&p).enqueue(rejected.blocks, None).await {
                    Ok(h) => {
                        counters.offload_enqueued.fetch_add(n, Ordering::Relaxed);
                        handles.lock().push(h);
                    }
                    Err(e) => tracing::debug!(error = %e, "{lane} enqueue refused"),
                }
            }));
        }
        Err(e) => tracing::debug!(error = %e, "{lane} enqueue refused"),
    }
}

/// The sequence hashes of every block object under the storage's namespace (lock objects and
/// foreign keys are skipped).
async fn list_blocks(storage: &ObjectStorage) -> anyhow::Result<Vec<SequenceHash>> {
    Ok(storage
        .list_keys()
        .await?
        .iter()
        .filter_map(|k| k.parse_hash().ok().map(SequenceHash::from_u128))
        .collect())
}
