//! The tiers of one instance, and the one way they are built ([`TierSet::build`]): the host
//! layouts of G1/G2, the G3 disk file with its journal (warm restart) and checksums, the G4
//! object store with its warm listing, all registered on one `TransferManager`, each sized by
//! its block manager ([`TierManagers`](super::TierManagers): the managers on one registry and
//! the [`InstanceLeader`] over G2..G4, built as every composition builds them); and the movers
//! G3→G2, G4→G2, G2→G1 with their checks. Both compositions call it: the
//! [`TierStack`](super::TierStack) (`TierStack::build`) and the cluster plane's instance
//! (kvbm-cluster's `instance::InstanceBuilder::build`); each adds what is its own
//! on top (the stack its lanes and front end; the instance its data plane, events and
//! presence).
//!
//! ```text
//!  TierSetPlan: [tiers] [physical] [logical] [leader]   one TransferManager, one BlockRegistry
//!            shape (geometry of n blocks), pins  ──► G1 host ─ G2 host ─ G3 disk ─ G4 objects
//!            sinks (G2..G4 events)                   G3: DiskJournal::open → listed blocks
//!            contents, identities, remote                registered, their checksums kept
//!                                                    G4: every block object listed, present
//!                                                ──► TierManagers: the managers ([tiers]),
//!                                                    InstanceLeader (G2..G4, remote search)
//!                                                ──► TierMovers: G3ToG2 (journal checksum),
//!                                                    G4ToG2 (header), G2ToG1 (Contents)
//!                                                ──► g2_to_g4_lane (the object pipeline)
//! ```
//!
//! Every key a block leaves the process under is scoped by the instance's model fingerprint
//! ([`KvbmConfig::fingerprint`] of the tiers' geometry; see [`kvbm_physical::fingerprint`]):
//! G4's object paths and header bindings, and G3's journal (one written under another
//! fingerprint starts G3 cold). So a block written for another model, dtype, KV layout, group
//! or rank is never listed at start and never read: a miss, never a hit.
//!
//! The check every G3 read passes, and what a rejected copy becomes (poisoned, never read
//! again, [`discard_rejected`] from its tier), are here too.

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use kvbm_logical::{BlockManager, BlockRegistry, G1, G2, G3, G4, SequenceHash, Tier};
use kvbm_offload::{
    ArrivalCheck, BadCopies, BlockFailure, BlockMoveExecutor, BlockMover, BoundTier, CheckedDisk,
    CompletionSink, MoveSource, ObjectMoveExecutor, ObjectPipeline, ObjectPipelineBuilder,
    ObjectPipelineConfig, Pipeline, PipelineBuilder, PipelineConfig, PresenceFilter,
    create_policy_from_config,
};
use kvbm_physical::{
    BlockLayout, DiskConfig, LayoutHandle, LayoutKind, ModelFingerprint, ObjectConfig,
    ObjectStorage, PhysicalLayout, PinPolicy, TransferManager,
};

use kvbm_tiering::{CpuPrimaryTier, PhysicalTier};

use crate::config::{G1Memory, KvbmConfig};
use crate::error::{EngineError, Result};
use crate::leader::{InstanceLeader, RemoteSearch};
use crate::mover::BlockMove;
use crate::runtime::RuntimeHandle;

use super::context::{Context, stack_error};
use super::hooks::{Contents, Identities};
use super::lanes::{RecordingG3Executor, lane_policy};
use super::movers::{G2ToG1, G3ToG2, G4ToG2, OnboardShared};
use super::plan::probe_endpoint;

use super::counters::Counters;
use crate::leader::{TierManagers, TierSinks};

/// How a tier of `n` blocks is laid out (the geometry of one block, `n` of them).
pub type Shape = Box<dyn Fn(usize) -> Result<BlockLayout> + Send + Sync>;

/// What [`TierSet::build`] builds from: the configuration tree and what is not configuration.
pub struct TierSetPlan<'a> {
    /// `[tiers]` (blocks per tier; 0: no such tier), `[physical]` (G3's file, G4's store,
    /// the transfer manager), `[logical]`, `[leader]`.
    pub config: &'a KvbmConfig,
    /// The runtime whose event-flush timer every manager is put under.
    pub runtime: &'a RuntimeHandle,
    /// The layout of a tier of `n` blocks.
    pub shape: Shape,
    /// Pinning of the G1 and G2 host layouts.
    pub pin: [PinPolicy; 2],
    /// Where G2..G4 publish their events.
    pub sinks: TierSinks,
    /// Checks every block reaching G1 (none: G2→G1 copies unchecked; the tiers below have
    /// checked their reads already).
    pub contents: Option<Arc<dyn Contents>>,
    /// Identities of blocks a tier knows only by name.
    pub identities: Arc<Identities>,
    /// How the leader searches beyond this instance's tiers.
    pub remote: Option<RemoteSearch>,
    /// What the blocks' bytes mean, when the engine describes them itself (kvbm-vllm: vLLM's
    /// `OffloadingConfig`); `None`: [`KvbmConfig::fingerprint`] of the tiers' geometry.
    pub fingerprint: Option<ModelFingerprint>,
}

/// The onboarding paths: what sessions and promotions move blocks through.
pub struct TierMovers {
    pub(crate) g3_to_g2: Option<Arc<G3ToG2>>,
    pub(crate) g4_to_g2: Option<Arc<G4ToG2>>,
    pub(crate) g2_to_g1: Arc<G2ToG1>,
}

/// The movers as the engine's move seams: what the cluster plane's instance hands its
/// sessions (the in-process stack uses the concrete types).
impl TierMovers {
    /// G3→G2 as the engine's move seam.
    pub fn g3_to_g2(&self) -> Option<Arc<dyn BlockMove<G3, G2>>> {
        self.g3_to_g2
            .clone()
            .map(|m| m as Arc<dyn BlockMove<G3, G2>>)
    }

    /// G4→G2 as the engine's move seam.
    pub fn g4_to_g2(&self) -> Option<Arc<dyn BlockMove<G4, G2>>> {
        self.g4_to_g2
            .clone()
            .map(|m| m as Arc<dyn BlockMove<G4, G2>>)
    }

    /// G2→G1 as the engine's move seam.
    pub fn g2_to_g1(&self) -> Arc<dyn BlockMove<G2, G1>> {
        self.g2_to_g1.clone()
    }
}

/// Every tier of one instance, built by [`TierSet::build`]: layouts on one transfer manager,
/// managers on one registry, the G3 journal (warm restart), the G4 listing, the leader over
/// G2..G4 and the checked movers; the G2→G3 and G2→G4 lanes on request.
pub struct TierSet {
    /// The transfer manager every tier's layout is registered with (a layout is registered in
    /// one manager only, so its claims keep two transfers off one block across every move).
    pub(crate) tm: Arc<TransferManager>,
    /// The registry every tier's manager shares.
    pub(crate) registry: BlockRegistry,
    /// What the movers count (bytes per path, failures).
    pub(crate) counters: Arc<Counters>,
    /// What the movers report (failed hashes, onboarded and verified blocks).
    pub(crate) onboard: Arc<OnboardShared>,
    pub(crate) g1: HostTier<G1>,
    pub(crate) g2: Option<HostTier<G2>>,
    /// G2 as every move into it sees it (its slots are its manager's block ids).
    pub(crate) g2_bound: Option<BoundTier<G2>>,
    pub(crate) g3: Option<G3Tier>,
    pub(crate) g4: Option<G4Tier>,
    /// The block objects G4 listed at start (registered present).
    pub(crate) g4_listed: Vec<SequenceHash>,
    /// The model fingerprint G3's journal and G4's paths are scoped by
    /// ([`KvbmConfig::fingerprint`] of the tiers' geometry). Read by the cluster plane's
    /// instance (its data plane's scope).
    pub(crate) fingerprint: ModelFingerprint,
    /// The leader over G2, G3 and G4 (none without G2: G1 is then the only tier).
    pub(crate) leader: Option<InstanceLeader>,
    /// The onboarding movers (none without G2).
    pub(crate) movers: Option<TierMovers>,
}

impl TierSet {
    /// Builds every tier with blocks in `[tiers]`, loads what persistent G3 (its journal) and
    /// G4 (a listing, 60 s at most) hold, and builds the leader and the movers over them.
    ///
    /// # Errors
    /// [`EngineError::Config`] naming the key: `tiers.g2_blocks` of 0 with G3 or G4,
    /// `physical.disk` for G3, `physical.s3` (or `physical.object_dir`) for G4;
    /// [`EngineError::Stack`] naming the step for storage that cannot be created, opened,
    /// listed or reached; [`EngineError::Physical`] / [`EngineError::Offload`] when a layout or
    /// mover cannot be set up; `physical.g1` when G1 is configured on a device there is none
    /// of (see [`PhysicalLayout::allocate_gpu`]).
    pub async fn build(plan: TierSetPlan<'_>) -> Result<TierSet> {
        Self::build_with(plan, PhysicalLayout::allocate_gpu).await
    }

    /// [`build`](Self::build) with the allocator of a G1 configured on a device given: the
    /// CPU tests run the device path (G1 not host memory, onboarded through the transfer
    /// manager, never read in place) over the host stand-in of device memory
    /// ([`PhysicalLayout::allocate_device`]).
    pub(crate) async fn build_with(
        plan: TierSetPlan<'_>,
        allocate_g1: fn(BlockLayout, usize) -> kvbm_physical::Result<PhysicalLayout>,
    ) -> Result<TierSet> {
        let cfg = plan.config;
        let tiers = &cfg.tiers;
        let tm = Arc::new(
            TransferManager::with_config(cfg.physical.transfer.clone())
                .context("cannot start the transfer manager")?,
        );
        let counters = Arc::new(Counters::default());
        let shape = &plan.shape;
        // What every stored block's key is scoped by: a block written under another model,
        // dtype, layout, group or rank is never listed or read here.
        let fingerprint = match plan.fingerprint {
            Some(f) => f,
            None => cfg.fingerprint(shape(1)?.config())?,
        };

        let host = |n: usize, pin: PinPolicy| -> Result<(LayoutHandle, Arc<PhysicalLayout>)> {
            let layout = PhysicalLayout::allocate_host(shape(n)?, pin)?;
            let h = tm.register_layout(layout)?;
            Ok((h, tm.layout(h)?))
        };
        // G4 is listed first: its manager registers what the listing found (warm start:
        // every block object already under the namespace is present).
        let (g4_storage, g4_listed) = if tiers.g4_blocks == 0 {
            (None, Vec::new())
        } else {
            let (storage, describe) =
                open_g4_storage(cfg, fingerprint, cfg.physical.object.clone()).await?;
            let listed = list_g4(&storage, &describe).await?;
            (Some((storage, describe)), listed)
        };
        // Every manager and the leader: built as every composition builds them.
        let managers = TierManagers::build(cfg, plan.sinks, &g4_listed)?;
        managers.flush_events_with(plan.runtime);
        let leader = managers.leader(cfg, plan.remote.clone())?;
        let g1_manager = managers.g1.clone().ok_or_else(|| {
            EngineError::config("tiers.g1_blocks", "the tier set needs G1: must be > 0")
        })?;
        let (h1, l1) = match cfg.physical.g1 {
            G1Memory::Host => host(g1_manager.total_blocks(), plan.pin[0])?,
            G1Memory::Device => {
                let ordinal = cfg.physical.g1_device;
                let layout =
                    allocate_g1(shape(g1_manager.total_blocks())?, ordinal).map_err(|e| {
                        EngineError::config(
                            "physical.g1",
                            format!("\"device\" (CUDA device {ordinal}): {e}"),
                        )
                    })?;
                let h = tm.register_layout(layout)?;
                (h, tm.layout(h)?)
            }
        };
        let g1 = HostTier {
            manager: g1_manager,
            handle: h1,
            layout: l1,
        };
        let g2 = match &managers.g2 {
            Some(m) => {
                let (h, l) = host(m.total_blocks(), plan.pin[1])?;
                Some(HostTier {
                    manager: m.clone(),
                    handle: h,
                    layout: l,
                })
            }
            None => None,
        };

        let g3 = match (g3_of(cfg)?, &managers.g3) {
            (Some((_, disk)), Some(manager)) => {
                let dir = g3_dir(disk)?;
                let layout = PhysicalLayout::create_disk(shape(manager.total_blocks())?, disk)
                    .with_context(|| {
                        format!("cannot create the G3 file {}", disk.path.display())
                    })?;
                let handle = tm.register_layout(layout)?;
                let (checked, listed) = CheckedDisk::open(
                    &disk.path,
                    &*tm.layout(handle)?,
                    Some(&fingerprint),
                    manager,
                )?;
                Some(G3Tier {
                    manager: manager.clone(),
                    handle,
                    layout: tm.layout(handle)?,
                    dir,
                    checked: Arc::new(checked),
                    warm_blocks: listed.len(),
                })
            }
            _ => None,
        };

        let g4 = match (g4_storage, &managers.g4) {
            (Some((storage, describe)), Some(manager)) => {
                // Objects are keyed by block: the layout's one slot only carries the geometry.
                let handle =
                    tm.register_layout(PhysicalLayout::object(shape(1)?, storage.clone()))?;
                Some(G4Tier {
                    manager: manager.clone(),
                    handle,
                    storage,
                    bad: Arc::default(),
                    warm_blocks: managers.g4_warm,
                    describe,
                })
            }
            _ => None,
        };

        // Every onboarding move runs on the shared transfer manager.
        let onboard = Arc::new(OnboardShared::default());
        let g2_bound = g2
            .as_ref()
            .map(|t| BoundTier::new(tm.clone(), t.handle, t.manager.clone()))
            .transpose()?;
        let registry = managers.registry.clone();
        let mut movers = None;
        if let (Some(g2t), Some(g2b)) = (&g2, &g2_bound) {
            let b = g2t.layout.layout().config().block_bytes();
            movers = Some(TierMovers {
                g3_to_g2: match &g3 {
                    Some(g3t) => Some(Arc::new(G3ToG2::new(
                        &BoundTier::new(tm.clone(), g3t.handle, g3t.manager.clone())?,
                        g2b,
                        g3t.check(),
                        counters.clone(),
                        b,
                        onboard.clone(),
                        plan.identities.clone(),
                    )?)),
                    None => None,
                },
                g4_to_g2: match &g4 {
                    Some(g4t) => Some(Arc::new(G4ToG2::new(
                        &BoundTier::new(tm.clone(), g4t.handle, g4t.manager.clone())?,
                        g2b,
                        g4t.bad.clone(),
                        counters.clone(),
                        b,
                        onboard.clone(),
                        plan.identities.clone(),
                    )?)),
                    None => None,
                },
                g2_to_g1: Arc::new(G2ToG1::new(
                    g2t.handle,
                    &BoundTier::new(tm.clone(), g1.handle, g1.manager.clone())?,
                    plan.contents.clone(),
                    counters.clone(),
                    b,
                    onboard.clone(),
                )?),
            });
        }
        Ok(TierSet {
            tm,
            registry,
            counters,
            onboard,
            g1,
            g2,
            g2_bound,
            g3,
            g4,
            g4_listed,
            fingerprint,
            leader,
            movers,
        })
    }

    /// Takes the leader over G2, G3 and G4 (none without G2, or when taken already): a
    /// composition that owns the leader itself (the cluster plane's instance) takes it once.
    pub fn take_leader(&mut self) -> Option<InstanceLeader> {
        self.leader.take()
    }

    /// Takes the onboarding movers (none without G2, or when taken already).
    pub fn take_movers(&mut self) -> Option<TierMovers> {
        self.movers.take()
    }

    /// The model fingerprint G3's journal and G4's paths are scoped by
    /// ([`KvbmConfig::fingerprint`] of the tiers' geometry).
    pub fn fingerprint(&self) -> ModelFingerprint {
        self.fingerprint
    }

    /// G1's manager and layout (where onboarded blocks land): host memory, or GPU memory under
    /// `physical.g1 = "device"` (check [`PhysicalLayout::storage_kind`] before reading it in
    /// place).
    pub fn g1(&self) -> (&Arc<BlockManager<G1>>, &Arc<PhysicalLayout>) {
        (&self.g1.manager, &self.g1.layout)
    }

    /// G2's manager and host layout (none without G2).
    pub fn g2(&self) -> Option<(&Arc<BlockManager<G2>>, &Arc<PhysicalLayout>)> {
        self.g2.as_ref().map(|t| (&t.manager, &t.layout))
    }

    /// G4's object store (none without G4).
    pub fn g4_storage(&self) -> Option<&Arc<ObjectStorage>> {
        self.g4.as_ref().map(|t| &t.storage)
    }

    /// Drops every copy G3 or G4 rejected on an earlier read once nothing holds it (a copy
    /// still held stays rejected until a later call), so it is neither matched nor read again.
    pub fn discard_rejected(&self) {
        discard_rejected(self.g3.as_ref(), self.g4.as_ref());
    }

    /// Forgets the hashes the movers recorded as failed (kept for a caller that recomputes
    /// from the first one; one that reports refusals through its session has no use for them).
    pub fn forget_failed(&self) {
        self.onboard.failed.lock().clear();
    }

    /// The G2→G3 lane (none without G2 or G3): kvbm-offload's pipeline over the block move
    /// into G3's bound tier, configured by `config` (`[offload.g2_to_g3]`: blocks already
    /// present below filtered out, then the configured policies; a batch that finds G3 full of
    /// held blocks waits `room_patience` for room, then drops). Each written block is listed in
    /// G3's journal with the checksum of the bytes read from G2 (`RecordingG3Executor`), so
    /// a restart finds it and a read checks it; its bytes are counted on `G2_TO_G3`. Spawns on
    /// the current tokio runtime.
    ///
    /// # Errors
    /// [`EngineError::Stack`] when the pipeline cannot be started.
    pub fn g2_to_g3_lane(&self, config: &PipelineConfig) -> Result<Option<Pipeline<G2>>> {
        let (Some(g2t), Some(g3t)) = (&self.g2, &self.g3) else {
            return Ok(None);
        };
        let exec = RecordingG3Executor {
            inner: BlockMoveExecutor::<G2, G3>::from_mover(BlockMover::from_layout(
                g2t.handle,
                &BoundTier::new(self.tm.clone(), g3t.handle, g3t.manager.clone())?,
            )?)
            .waiting_for_room(config.room_patience, Arc::default()),
            g2_layout: g2t.layout.clone(),
            checked: g3t.checked.clone(),
            counters: self.counters.clone(),
            block_bytes: g2t.layout.layout().config().block_bytes(),
        };
        Ok(Some(
            PipelineBuilder::<G2, G3>::new()
                .config(config.clone())
                .policy(lane_policy(&self.registry, config))
                .build()
                .spawn(exec)
                .context("cannot start the G2→G3 pipeline")?,
        ))
    }

    /// The G2→G4 lane (none without G2 or G4): kvbm-offload's object pipeline, configured by
    /// `config` (`[offload.g2_to_g4]`), blocks already present in G4 filtered out, then the
    /// configured policies; every written block is recorded in G4's manager (which publishes
    /// its stored event) and handed to `sink`. `owner` names the writer in lock objects.
    /// Spawns on the current tokio runtime.
    ///
    /// # Errors
    /// [`EngineError::Stack`] when the pipeline cannot be started.
    pub fn g2_to_g4_lane(
        &self,
        config: &ObjectPipelineConfig,
        owner: Option<String>,
        sink: Option<CompletionSink<SequenceHash>>,
    ) -> Result<Option<ObjectPipeline>> {
        let (Some(g2t), Some(g4t)) = (&self.g2, &self.g4) else {
            return Ok(None);
        };
        let exec = ObjectMoveExecutor::<G2>::new(self.tm.clone(), g2t.handle, g4t.handle)
            .with_g4_manager(g4t.manager.clone());
        let mut builder = ObjectPipelineBuilder::new(g4t.storage.clone())
            .config(config.clone())
            .policy(Arc::new(PresenceFilter::new(self.registry.clone())));
        if !config.pipeline.policies.is_empty() {
            builder = builder.policy(create_policy_from_config(
                &config.pipeline.policies,
                &self.registry,
            ));
        }
        if let Some(owner) = owner {
            builder = builder.owner(owner);
        }
        Ok(Some(
            builder
                .spawn_with_sink(exec, sink)
                .context("cannot start the G2→G4 pipeline")?,
        ))
    }
}

/// `[tiers] g3_blocks` and `[physical] disk`, read for every builder of a G3 file (the tier
/// set's, and a secondary tier under vLLM's manager, [`secondary_disk`]): none when G3 has no
/// blocks.
///
/// # Errors
/// [`EngineError::Config`] naming `physical.disk` when G3 has blocks but no file.
pub fn g3_of(cfg: &KvbmConfig) -> Result<Option<(usize, &DiskConfig)>> {
    if cfg.tiers.g3_blocks == 0 {
        return Ok(None);
    }
    let disk =
        cfg.physical.disk.as_ref().ok_or_else(|| {
            EngineError::config("physical.disk", "required when tiers.g3_blocks > 0")
        })?;
    Ok(Some((cfg.tiers.g3_blocks, disk)))
}

/// The directory of G3's file, created if missing.
fn g3_dir(disk: &DiskConfig) -> Result<PathBuf> {
    let dir = disk
        .path
        .parent()
        .filter(|d| !d.as_os_str().is_empty())
        .unwrap_or(std::path::Path::new("."))
        .to_path_buf();
    std::fs::create_dir_all(&dir)
        .with_context(|| format!("cannot create G3 directory {}", dir.display()))?;
    Ok(dir)
}

/// G3 as a secondary tier under a primary kvbm did not lay out (vLLM's offload region, as a
/// kvbm-tiering [`CpuPrimaryTier`]): `[tiers] g3_blocks` chunk slots in the file `[physical]
/// disk`, through the same checked disk (kvbm-offload's `CheckedDisk`: journal, checksums,
/// bad copies, warm restart) as the tier set's own G3, its journal bound to `fingerprint`. The
/// face kvbm-vllm's `kvbm_disk` builds its tier with.
///
/// # Errors
/// [`EngineError::Config`] naming `tiers.g3_blocks` (0) or `physical.disk` (missing);
/// [`EngineError::Stack`] when the directory or the file cannot be created, or the tier cannot
/// be started over it.
pub fn secondary_disk(
    cfg: &KvbmConfig,
    primary: &CpuPrimaryTier,
    fingerprint: &ModelFingerprint,
) -> Result<PhysicalTier<G3>> {
    let (g3_blocks, disk) = g3_of(cfg)?.ok_or_else(|| {
        EngineError::config(
            "tiers.g3_blocks",
            "a disk tier needs at least one chunk slot",
        )
    })?;
    g3_dir(disk)?;
    PhysicalTier::disk(primary, disk, g3_blocks, Some(fingerprint))
        .with_context(|| format!("cannot start the disk tier at {}", disk.path.display()))
}

/// G4 as a secondary tier under a primary kvbm did not lay out (vLLM's offload region): the
/// object store `[physical] s3` (its endpoint probed once configured, on the caller's thread:
/// 3 s at most per address) or `[physical] object_dir`, with `[physical] object` (the namespace),
/// scoped by `fingerprint`, opened as every G4 of the tier set is ([`open_g4_storage`]);
/// `[tiers] g4_blocks` keys remembered. The face kvbm-vllm's `kvbm_object` builds its tier with.
///
/// # Errors
/// [`EngineError::Config`] naming `tiers.g4_blocks` (0) or `physical.s3` (no store);
/// [`EngineError::Stack`] when the endpoint does not answer or the store cannot be opened.
pub fn secondary_object(
    cfg: &KvbmConfig,
    primary: &CpuPrimaryTier,
    fingerprint: &ModelFingerprint,
) -> Result<PhysicalTier<G4>> {
    if cfg.tiers.g4_blocks == 0 {
        return Err(EngineError::config(
            "tiers.g4_blocks",
            "an object tier must remember at least one key",
        ));
    }
    let (storage, describe) = g4_storage(cfg, *fingerprint, cfg.physical.object.clone())?;
    if let Some(ep) = cfg
        .physical
        .s3
        .as_ref()
        .and_then(|s3| s3.endpoint.as_deref())
    {
        probe_endpoint(ep)?;
    }
    PhysicalTier::object(primary, storage, cfg.tiers.g4_blocks)
        .with_context(|| format!("cannot start the object tier on {describe}"))
}

/// The tiers of an instance whose block memory is its worker ranks' (`workers.mode =
/// "processes"`): only the block managers (one registry, G2 and G3 publishing to their sinks)
/// and the leader over them. Every block's bytes live in each rank's layout of its tier under
/// the block's id (a rank resolves the tier id to its own layout,
/// [`PhysicalWorker::resolve`](crate::worker::PhysicalWorker::resolve)), so these managers'
/// block ids are slots of every rank, and blocks move by the ranks
/// ([`SpmdMover`](crate::worker::SpmdMover)). No layout is allocated here; G3 is each rank's
/// own file (cold here; kvbm-cluster's instance lists it warm from `workers.g3_journal`); G4
/// is one bucket in which each rank
/// keeps its slice of every block under its own directory
/// ([`KvbmConfig::rank_object_config`]), named by the block, so G4's block ids are bookkeeping
/// only, as in the stack.
pub struct RankTiers {
    /// G1's bookkeeping (where onboarded blocks land).
    pub g1: Arc<BlockManager<G1>>,
    /// G2's bookkeeping.
    pub g2: Arc<BlockManager<G2>>,
    /// G3's bookkeeping (with `tiers.g3_blocks`; cold at start: the journal is each rank's).
    pub g3: Option<Arc<BlockManager<G3>>>,
    /// G4's bookkeeping (with `tiers.g4_blocks`), the blocks listed at start registered.
    pub g4: Option<Arc<BlockManager<G4>>>,
    /// The model fingerprint of `geometry` ([`KvbmConfig::fingerprint`]), as [`TierSet`] has.
    pub fingerprint: ModelFingerprint,
    /// The leader over G2, G3 and G4.
    pub leader: InstanceLeader,
}

impl RankTiers {
    /// The managers of `[tiers]` (G1 and G2 required, G3 and G4 optional) on one registry,
    /// their events flushed by `runtime`, G4 holding `g4_listed` (the blocks every rank's
    /// directory of the bucket holds at start), and the leader over G2..G4 searching in
    /// `[leader]`'s order (and beyond, through `remote`).
    ///
    /// # Errors
    /// [`EngineError::Config`] naming `tiers.g1_blocks`/`tiers.g2_blocks` (0);
    /// [`EngineError::Stack`] when a manager or the leader cannot be built.
    pub fn build(
        cfg: &KvbmConfig,
        runtime: &RuntimeHandle,
        geometry: &BlockLayout,
        sinks: TierSinks,
        remote: Option<RemoteSearch>,
        g4_listed: &[SequenceHash],
    ) -> Result<RankTiers> {
        let fingerprint = cfg.fingerprint(geometry.config())?;
        let managers = TierManagers::build(cfg, sinks, g4_listed)?;
        let needed = |key: &str| {
            EngineError::config(key, "must be > 0 when the worker ranks hold the blocks")
        };
        let g1 = managers
            .g1
            .clone()
            .ok_or_else(|| needed("tiers.g1_blocks"))?;
        let g2 = managers
            .g2
            .clone()
            .ok_or_else(|| needed("tiers.g2_blocks"))?;
        managers.flush_events_with(runtime);
        let leader = managers
            .leader(cfg, remote)?
            .expect("a leader is built over G2");
        let (g3, g4) = (managers.g3.clone(), managers.g4.clone());
        Ok(RankTiers {
            g1,
            g2,
            g3,
            g4,
            fingerprint,
            leader,
        })
    }
}

/// Drops every copy G3 or G4 rejected on read (kvbm-offload's `BadCopies`) from its tier
/// when nothing holds it any more (G3 also unlisted it from the journal when it was rejected),
/// so it is neither matched nor read again; a copy still held stays rejected until a later call.
pub(crate) fn discard_rejected(g3: Option<&G3Tier>, g4: Option<&G4Tier>) {
    if let Some(g3) = g3 {
        g3.checked.bad().discard(&g3.manager);
    }
    if let Some(g4) = g4 {
        g4.bad.discard(&g4.manager);
    }
}

pub(crate) struct HostTier<T: Tier> {
    pub(crate) manager: Arc<BlockManager<T>>,
    pub(crate) handle: LayoutHandle,
    pub(crate) layout: Arc<PhysicalLayout>,
}

impl<T: Tier> HostTier<T> {
    /// The bytes of slot `id`.
    ///
    /// # Safety
    /// As [`slot_of`].
    #[allow(clippy::mut_from_ref)]
    pub(crate) unsafe fn slot(&self, id: usize) -> &mut [u8] {
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
pub(crate) struct G3Check {
    pub(crate) manager: Arc<BlockManager<G3>>,
    pub(crate) checked: Arc<CheckedDisk>,
}

impl G3Tier {
    pub(crate) fn check(&self) -> G3Check {
        G3Check {
            manager: self.manager.clone(),
            checked: self.checked.clone(),
        }
    }
}

pub(crate) struct G3Tier {
    pub(crate) manager: Arc<BlockManager<G3>>,
    pub(crate) handle: LayoutHandle,
    pub(crate) layout: Arc<PhysicalLayout>,
    pub(crate) dir: PathBuf,
    /// The journal (`<dir>/g3.journal`), the checksum of each block as written, and the copies
    /// proven bad on read: kvbm-offload's one checked disk.
    pub(crate) checked: Arc<CheckedDisk>,
    pub(crate) warm_blocks: usize,
}

pub(crate) struct G4Tier {
    pub(crate) manager: Arc<BlockManager<G4>>,
    pub(crate) handle: LayoutHandle,
    pub(crate) storage: Arc<ObjectStorage>,
    /// The copies proven bad on read (kvbm-offload's rule).
    pub(crate) bad: Arc<BadCopies<G4>>,
    pub(crate) warm_blocks: usize,
    pub(crate) describe: String,
}

pub(super) fn geometry(num_blocks: usize, block_bytes: usize) -> Result<BlockLayout> {
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

pub(super) fn g3_arrival_check(g3: G3Check) -> ArrivalCheck {
    Arc::new(move |src: &MoveSource, regions: &[&[u8]]| {
        g3.checked.check(src.sequence_hash, regions)
    })
}

/// A G3 read of `h` failed with `f`: counted ([`count_failure`]) and handed to the checked
/// disk, which drops and unlists the copy when the failure proves it bad and keeps it
/// otherwise (kvbm-offload's rule, `CheckedDisk::read_failed`).
pub(super) fn g3_read_failed(g3: &G3Check, counters: &Counters, h: SequenceHash, f: &BlockFailure) {
    count_failure(counters, "G3", f);
    if f.kind.drops_copy() {
        let slot = g3.manager.scan_matches(&[h]).first().map(|b| b.block_id());
        g3.checked.read_failed(h, slot, f);
    }
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

/// G4's object storage as `[physical]` says (`physical.s3`, else `physical.object_dir`), with
/// the object settings `object` (`physical.object`, or one worker rank's,
/// [`KvbmConfig::rank_object_config`]), scoped by `fingerprint`; and its description for
/// errors and logs. An S3 endpoint is probed first (3 s at most per address), so a server that
/// is not there fails here, naming it, not at the first write. The one way every composition
/// (the stack, an instance, a worker process) opens G4.
///
/// # Errors
/// [`EngineError::Config`] naming `physical.s3` when neither store is configured;
/// [`EngineError::Stack`] when the endpoint does not answer or the store cannot be opened.
pub async fn open_g4_storage(
    cfg: &KvbmConfig,
    fingerprint: ModelFingerprint,
    object: ObjectConfig,
) -> Result<(Arc<ObjectStorage>, String)> {
    // Configured first (a refused endpoint is named at once), then probed.
    let opened = g4_storage(cfg, fingerprint, object)?;
    if let Some(ep) = cfg.physical.s3.as_ref().and_then(|s3| s3.endpoint.clone()) {
        // A blocking connect (3 s at most per address): off the async workers.
        tokio::task::spawn_blocking(move || probe_endpoint(&ep))
            .await
            .context("the S3 endpoint probe did not finish")??;
    }
    Ok(opened)
}

/// [`open_g4_storage`] after its probe: the one reader of `[physical] s3` and `object_dir`.
fn g4_storage(
    cfg: &KvbmConfig,
    fingerprint: ModelFingerprint,
    object: ObjectConfig,
) -> Result<(Arc<ObjectStorage>, String)> {
    let (storage, describe) = match (&cfg.physical.s3, &cfg.physical.object_dir) {
        (Some(s3), _) => {
            let s = ObjectStorage::s3(s3, object)
                .with_context(|| format!("cannot configure S3 bucket {}", s3.bucket))?
                .with_fingerprint(fingerprint);
            let d = format!(
                "S3 {} bucket {}",
                s3.endpoint.as_deref().unwrap_or("(AWS)"),
                s3.bucket
            );
            (s, d)
        }
        (None, Some(dir)) => (
            ObjectStorage::local(dir, object)
                .with_context(|| format!("cannot open the G4 directory {}", dir.display()))?
                .with_fingerprint(fingerprint),
            format!("local filesystem {}", dir.display()),
        ),
        (None, None) => {
            return Err(EngineError::config(
                "physical.s3",
                "required (or physical.object_dir) when tiers.g4_blocks > 0",
            ));
        }
    };
    Ok((Arc::new(storage), describe))
}

/// Every block object under `storage`'s namespace (60 s at most): what a warm start finds.
pub async fn list_g4(storage: &ObjectStorage, describe: &str) -> Result<Vec<SequenceHash>> {
    tokio::time::timeout(Duration::from_secs(60), list_blocks(storage))
        .await
        .map_err(|_| stack_error!("listing G4 ({describe}) timed out after 60 s"))?
        .with_context(|| format!("cannot list G4 ({describe})"))
}

/// The sequence hashes of every block object under the storage's namespace (lock objects and
/// foreign keys are skipped).
pub(super) async fn list_blocks(storage: &ObjectStorage) -> Result<Vec<SequenceHash>> {
    Ok(storage
        .list_keys()
        .await?
        .iter()
        .filter_map(|k| k.parse_hash().ok().map(SequenceHash::from_u128))
        .collect())
}
