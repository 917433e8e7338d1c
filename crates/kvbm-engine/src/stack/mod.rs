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
//! and G2→G4 pipelines (what the engine uses). `replay/mod.rs` only calls [`TierStack::build`],
//! [`TierStack::serve`] and [`TierStack::finish`].
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
//! Sessions run on this thread (a current-thread runtime, `TierStack::session_rt`): the request
//! waits for its blocks, as a scheduler waits before the forward pass, and a session's task
//! needs no hop to another thread. G2→G1 is host to host (G1 is a host stand-in), so it is
//! one inline copy per request (`TransferManager::execute_transfer_inline`, with the
//! manager's claims).
//!
//! Ownership: a request holds strong G1 handles from lookup to the end of [`TierStack::serve`] (its
//! "forward pass"); the matched prefix is held by its session until finished or failed; blocks
//! being offloaded are held by their pipeline (strong for G1→G2, weak, upgraded at the
//! commitment point, for the chained lanes). Lock order: the checksum map and the poisoned
//! sets are leaves, never held while calling a block manager or the transfer manager.

use std::collections::HashSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use kvbm_logical::{BlockRegistry, G1, G2, G3, G4, ImmutableBlock, SequenceHash};
use kvbm_offload::{
    BlockFailureKind, BlockTransferExecutor, ObjectPipeline, ObjectPipelineBuilder,
    ObjectTransferExecutor, Pipeline, PipelineBuilder, PresenceFilter, TransferHandle,
    TransferResult, create_policy_from_config,
};
use kvbm_physical::{
    Backing, DiskConfig, LayoutHandle, ObjectConfig, ObjectStorage, PhysicalLayout, PinPolicy,
    TransferManager,
};
use parking_lot::Mutex;

use crate::error::Result;
#[cfg(not(feature = "nats"))]
use crate::leader::RemoteSearch;
use crate::mover::BlockMove;
use crate::scheduler::{EngineTieringManager, PromotionMovers};
use crate::{EventSource, InstanceLeader, KvbmRuntime};

use context::{Context, bail, stack_error};
use journal::G3Index;
use movers::{G2ToG1, G3ToG2, G4ToG2, OnboardShared};

pub use counters::{Counters, MovePath, PATH_NAMES, Served, StageTimes};
pub use hooks::{Contents, Identities};
pub use plan::{FrontEnd, G4Location, StackPlan, probe_endpoint};

use lanes::{
    G1ToG2Executor, G2_SPACE_PATIENCE, Handoffs, RecordingG3Executor, enqueue_from_sink,
    lane_policy,
};
use read_ahead::Prefetch;
#[cfg(feature = "nats")]
use sharing::SharedG4;
#[cfg(feature = "nats")]
pub use sharing::Sharing;
use tiers::{
    G3Check, G3Tier, G4Tier, HostTier, check_g3_read, count_failure, geometry, list_blocks,
    manager, manager_with_sink, slot_of,
};

/// Without NATS no G4 is shared: an uninhabited type, so the build reads the same and the
/// compiler proves every use of it unreachable.
#[cfg(not(feature = "nats"))]
enum SharedG4 {}

#[cfg(not(feature = "nats"))]
impl SharedG4 {
    fn own(&self) -> &Arc<Mutex<HashSet<SequenceHash>>> {
        match *self {}
    }
    fn sink(&self) -> Arc<dyn kvbm_logical::EventSink> {
        match *self {}
    }
    fn remote(&self) -> RemoteSearch {
        match *self {}
    }
}

mod context;
mod counters;
mod hooks;
mod journal;
mod lanes;
mod movers;
mod plan;
mod read_ahead;
mod scheduled;
mod serve;
#[cfg(feature = "nats")]
mod sharing;
mod tiers;

/// The tiers of one replay.
pub struct TierStack {
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
    /// G1 room waits for these alone ([`TierStack::allocate_g1`]).
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
    /// Identities of blocks known only by name (see [`Identities`]).
    identities: Arc<Identities>,
    /// What each block's bytes are.
    contents: Arc<dyn Contents>,
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

impl TierStack {
    /// Builds every enabled tier, loads what persistent G3/G4 hold, and starts the lanes.
    ///
    /// # Errors
    /// Invalid sizes, storage that cannot be created, an unreachable S3 endpoint.
    pub fn build(plan: &StackPlan) -> Result<TierStack> {
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

        let host = |n: usize, pin: PinPolicy| -> Result<(LayoutHandle, Arc<PhysicalLayout>)> {
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

        // Sharing G4 with other instances (feature `nats`).
        #[cfg(feature = "nats")]
        let shared = match &plan.sharing {
            Some(s) => {
                if plan.g4.is_none() {
                    bail!("instances share G4: enable it (--g4, --g4-dir or --s3-endpoint)");
                }
                Some(SharedG4::start(&runtime, s)?)
            }
            None => None,
        };
        #[cfg(not(feature = "nats"))]
        let shared: Option<SharedG4> = None;
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
                    .map_err(|_| stack_error!("listing G4 ({describe}) timed out after 60 s"))?
                    .with_context(|| format!("cannot list G4 ({describe})"))?;
                if let Some(sh) = &shared {
                    sh.own().lock().extend(listed.iter().copied());
                }
                let manager = manager_with_sink::<G4>(
                    plan.g4_capacity + listed.len(),
                    &registry,
                    &plan.logical,
                    shared.as_ref().map(SharedG4::sink),
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
            if let Some(sh) = &shared {
                builder = builder.remote(sh.remote());
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
                        identities: plan.identities.clone(),
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
                        identities: plan.identities.clone(),
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
                    contents: plan.contents.clone(),
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
                let own = shared.as_ref().map(|sh| sh.own().clone());
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
            if plan.front_end == FrontEnd::Sessions {
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
        let sched = match (&leader, &movers, plan.front_end) {
            (Some(l), Some(m), FrontEnd::Tiering) => Some({
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
        #[cfg(feature = "nats")]
        if let Some(sh) = &shared {
            sh.wait_for_all(&rt)?;
        }
        Ok(TierStack {
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
            shared_g4: shared,
            sched,
            write_through,
            load_refused: 0,
            identities: plan.identities.clone(),
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
    pub fn finish(&mut self) -> Result<()> {
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
