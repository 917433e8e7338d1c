//! [`OffloadEngine`]: the pipelines of one worker, built from a list of lanes.
//!
//! ```text
//!  OffloadEngine::builder(registry)
//!     .external_tier::<G1>(layout) .tier(BoundTier::<G2>::new(..)?) .tier(BoundTier::<G3>::new(..)?)
//!     .lane(LaneSpec::over_tiers(PipelineBuilder::<G1, G2>::new().build()))     G1→G2 ─┐ chain
//!     .lane(LaneSpec::over_tiers(PipelineBuilder::<G2, G3>::new().build()))     G2→G3 ◄┘
//!     .lane(LaneSpec::onboarding(PipelineBuilder::<G3, G2>::new()
//!                                  .caller_allocated().build()))             G3→G2 (up)
//!     .lane(LaneSpec::object(ObjectPipelineBuilder::new(storage), None))       G2→G4
//!     .chain(PipelineLane::G1_TO_G2, PipelineLane::G2_TO_G3)
//!     .build()?
//! ```
//!
//! A lane is its (source, destination) pair; the engine keeps one pipeline per pair, with no
//! positional arrays and no per-direction code: every lane is spawned by the same generic path.
//! A tier is *bound* once: a [`BoundTier`] (its block manager and layout, whose counts were
//! checked to agree), or, for a source whose slots the caller manages (G1 of the inference
//! engine), only its layout ([`external_tier`](OffloadEngineBuilder::external_tier)); a lane
//! built [`over_tiers`](LaneSpec::over_tiers) gets a
//! [`BlockMoveExecutor`] (the executor allocates destinations) and one built for
//! [`onboarding`](LaneSpec::onboarding) a [`CallerAllocated`] executor over the same
//! [`BlockMover`]; [`LaneSpec::with_executor`] supplies any executor (tests, custom transports,
//! the G4 get side).
//!
//! With a [`chain`](OffloadEngineBuilder::chain), every block the first lane registers in its
//! destination is enqueued (as a weak reference, so it does not pin the tier) into the second
//! lane, whose own policy then decides; the hand-off never waits (a full input drops the weak
//! references, counted as refused).
//!
//! Pipelines run on the runtime given to [`OffloadEngineBuilder::runtime`] (default: the
//! current one), so a synchronous caller can own the engine.

use std::any::Any;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};

use futures::future::BoxFuture;
use kvbm_logical::{BlockManager, BlockRegistry, G2, ImmutableBlock, MutableBlock, Tier, TierId};
use kvbm_physical::{LayoutHandle, TransferManager};
use tokio::runtime::Handle;

use crate::bound::BoundTier;
use crate::error::OffloadError;
use crate::executor::MoveExecutor;
use crate::handle::OffloadHandle;
use crate::mover::{BlockMoveExecutor, BlockMover, CallerAllocated, ObjectMoveExecutor};
use crate::object::{ObjectPipeline, ObjectPipelineBuilder};
use crate::pipeline::{CompletionSink, Pipeline, PipelineSpec};
use crate::policy::create_policy_from_config;
use crate::settlement::{
    LaneState, PipelineLane, SettlementError, SettlementTarget, SettlementToken,
};
use crate::source::{Precondition, SourceBlocks};

/// A running lane, type-erased.
trait RunningLane: Send + Sync {
    fn lane_state(&self) -> &Arc<LaneState>;
    fn shutdown_and_wait(&self) -> BoxFuture<'_, ()>;
    /// The `Pipeline<S, A>` itself (for typed access by downcast).
    fn pipeline_any(&self) -> &dyn Any;
    fn object(&self) -> Option<&ObjectPipeline> {
        None
    }
}

impl<S: Tier, A: Send + 'static> RunningLane for Pipeline<S, A> {
    fn lane_state(&self) -> &Arc<LaneState> {
        Pipeline::lane_state(self)
    }
    fn shutdown_and_wait(&self) -> BoxFuture<'_, ()> {
        Box::pin(Pipeline::shutdown_and_wait(self))
    }
    fn pipeline_any(&self) -> &dyn Any {
        self
    }
}

impl RunningLane for ObjectPipeline {
    fn lane_state(&self) -> &Arc<LaneState> {
        self.pipeline().lane_state()
    }
    fn shutdown_and_wait(&self) -> BoxFuture<'_, ()> {
        // Flushes the lock releases too.
        Box::pin(ObjectPipeline::shutdown_and_wait(self))
    }
    fn pipeline_any(&self) -> &dyn Any {
        self.pipeline()
    }
    fn object(&self) -> Option<&ObjectPipeline> {
        Some(self)
    }
}

/// A tier bound to the engine: its layout and, unless external, its [`BoundTier`] (type-erased).
struct TierBinding {
    layout: LayoutHandle,
    bound: Option<Arc<dyn Any + Send + Sync>>,
}

/// What a lane's spawner may use.
struct Ctx<'a> {
    registry: &'a BlockRegistry,
    runtime: &'a Handle,
    tm: Option<Arc<TransferManager>>,
    tiers: &'a HashMap<TierId, TierBinding>,
    /// Chain targets: filled with the target pipeline once every lane runs.
    outlets: &'a HashMap<PipelineLane, Outlet>,
    chained: &'a Arc<AtomicU64>,
    refused: &'a Arc<AtomicU64>,
}

type Outlet = Arc<OnceLock<Arc<dyn RunningLane>>>;

impl Ctx<'_> {
    fn tm(&self) -> Result<Arc<TransferManager>, OffloadError> {
        self.tm
            .clone()
            .ok_or(OffloadError::Missing("transfer manager"))
    }

    fn layout(&self, tier: TierId) -> Result<LayoutHandle, OffloadError> {
        self.tiers
            .get(&tier)
            .map(|b| b.layout)
            .ok_or(OffloadError::MissingTier(tier))
    }

    fn bound<T: Tier>(&self) -> Result<&BoundTier<T>, OffloadError> {
        self.tiers
            .get(&T::ID)
            .and_then(|b| b.bound.as_ref())
            .and_then(|m| m.downcast_ref::<BoundTier<T>>())
            .ok_or(OffloadError::MissingTier(T::ID))
    }

    fn manager<T: Tier>(&self) -> Result<Arc<BlockManager<T>>, OffloadError> {
        self.bound::<T>().map(|b| b.manager().clone())
    }

    /// The mover between two bound tiers, or from an external source into a bound tier.
    fn mover<S: Tier, D: Tier>(&self) -> Result<BlockMover<S, D>, OffloadError> {
        let tm = self.tm()?;
        let dst = self.bound::<D>()?;
        if !Arc::ptr_eq(dst.transfer_manager(), &tm) {
            return Err(OffloadError::InvalidConfig(format!(
                "tier {:?} is bound to another transfer manager than the engine's",
                D::ID
            )));
        }
        match self.bound::<S>() {
            Ok(src) => BlockMover::new(src, dst),
            Err(_) => BlockMover::from_layout(self.layout(S::ID)?, dst),
        }
    }

    /// The sink handing `lane`'s registered blocks to the lane it is chained to, if any.
    fn chain_sink<D: Tier>(&self, lane: PipelineLane) -> Option<CompletionSink<ImmutableBlock<D>>> {
        let outlet = self.outlets.get(&lane)?.clone();
        let chained = self.chained.clone();
        let refused = self.refused.clone();
        Some(Arc::new(move |blocks: Vec<ImmutableBlock<D>>| {
            let Some(next) = outlet
                .get()
                .and_then(|r| r.pipeline_any().downcast_ref::<Pipeline<D>>())
            else {
                refused.fetch_add(blocks.len() as u64, Ordering::Relaxed);
                tracing::error!(%lane, "chain target does not allocate its own destinations");
                return;
            };
            let weak: Vec<_> = blocks.iter().map(|b| b.downgrade()).collect();
            drop(blocks);
            let n = weak.len() as u64;
            // Never waits (this runs inside a transfer's settlement): a full input drops the
            // weak references, which pin nothing.
            match next.try_enqueue(weak, None) {
                Ok(_) => {
                    chained.fetch_add(n, Ordering::Relaxed);
                }
                Err(e) => {
                    refused.fetch_add(n, Ordering::Relaxed);
                    tracing::debug!(error = %e, "chained enqueue refused");
                }
            }
        }))
    }
}

type Spawner = Box<dyn FnOnce(&Ctx<'_>) -> Result<Arc<dyn RunningLane>, OffloadError> + Send>;

/// One lane of an engine, not yet running: a pipeline spec and how its executor is made.
pub struct LaneSpec {
    lane: PipelineLane,
    spawn: Spawner,
}

impl std::fmt::Debug for LaneSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LaneSpec")
            .field("lane", &self.lane)
            .finish()
    }
}

fn with_policy<S: Tier, D: Tier, A>(
    mut spec: PipelineSpec<S, D, A>,
    registry: &BlockRegistry,
) -> PipelineSpec<S, D, A> {
    if spec.policy.is_none() {
        spec.policy = Some(create_policy_from_config(&spec.config.policies, registry));
    }
    spec
}

impl LaneSpec {
    /// The lane.
    pub fn lane(&self) -> PipelineLane {
        self.lane
    }

    /// A lane between two bound tiers whose executor allocates the destinations
    /// ([`BlockMoveExecutor`]): the offload lanes (G1→G2, G2→G3), or promotion.
    pub fn over_tiers<S: Tier, D: Tier>(spec: PipelineSpec<S, D>) -> Self {
        let lane = spec.lane();
        Self {
            lane,
            spawn: Box::new(move |ctx| {
                let exec = BlockMoveExecutor::from_mover(ctx.mover::<S, D>()?);
                let spec = with_policy(spec, ctx.registry);
                let sink = ctx.chain_sink::<D>(lane);
                Ok(Arc::new(spec.spawn_on_with_sink(
                    ctx.runtime,
                    exec,
                    sink,
                )?))
            }),
        }
    }

    /// A lane between two bound tiers whose destinations the caller allocates before the
    /// transfer ([`CallerAllocated`]): onboarding (G3→G2, G2→G1). Enqueue with
    /// [`OffloadEngine::enqueue_into`].
    pub fn onboarding<S: Tier, D: Tier>(spec: PipelineSpec<S, D, MutableBlock<D>>) -> Self {
        let lane = spec.lane();
        Self {
            lane,
            spawn: Box::new(move |ctx| {
                let exec = CallerAllocated::new(ctx.mover::<S, D>()?);
                let spec = with_policy(spec, ctx.registry);
                let sink = ctx.chain_sink::<D>(lane);
                Ok(Arc::new(spec.spawn_on_with_sink(
                    ctx.runtime,
                    exec,
                    sink,
                )?))
            }),
        }
    }

    /// A lane with its own executor (tests, custom transports, an object get executor).
    pub fn with_executor<S, D, A, E>(spec: PipelineSpec<S, D, A>, executor: E) -> Self
    where
        S: Tier,
        D: Tier,
        A: Send + 'static,
        E: MoveExecutor<S, A>,
    {
        let lane = spec.lane();
        Self {
            lane,
            spawn: Box::new(move |ctx| {
                let spec = with_policy(spec, ctx.registry);
                Ok(Arc::new(spec.spawn_on(ctx.runtime, executor)?))
            }),
        }
    }

    /// The G2→G4 object lane (presence checks and locks, see [`ObjectPipelineBuilder`]), with
    /// `executor`, or an [`ObjectMoveExecutor`] over the bound G2 and G4 layouts (recording
    /// presence in the bound G4 manager, if any).
    pub fn object<E: MoveExecutor<G2>>(
        builder: ObjectPipelineBuilder,
        executor: Option<E>,
    ) -> Self {
        Self {
            lane: PipelineLane::G2_TO_G4,
            spawn: Box::new(move |ctx| {
                let pipeline = match executor {
                    Some(e) => builder.spawn_on(ctx.runtime, e)?,
                    None => {
                        let mut e = ObjectMoveExecutor::<G2>::new(
                            ctx.tm()?,
                            ctx.layout(TierId::G2)?,
                            ctx.layout(TierId::G4)?,
                        );
                        if let Ok(g4) = ctx.manager::<kvbm_logical::G4>() {
                            e = e.with_g4_manager(g4);
                        }
                        builder.spawn_on(ctx.runtime, e)?
                    }
                };
                Ok(Arc::new(pipeline))
            }),
        }
    }
}

/// Builder for [`OffloadEngine`].
pub struct OffloadEngineBuilder {
    registry: BlockRegistry,
    runtime: Option<Handle>,
    transfer_manager: Option<Arc<TransferManager>>,
    tiers: HashMap<TierId, TierBinding>,
    lanes: Vec<LaneSpec>,
    chains: Vec<(PipelineLane, PipelineLane)>,
}

impl std::fmt::Debug for OffloadEngineBuilder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OffloadEngineBuilder")
            .field("lanes", &self.lanes)
            .field("chains", &self.chains)
            .finish()
    }
}

impl OffloadEngineBuilder {
    /// The runtime the pipelines run on. Default: the current one (building outside a runtime
    /// without this is [`OffloadError::NoRuntime`]).
    pub fn runtime(mut self, runtime: Handle) -> Self {
        self.runtime = Some(runtime);
        self
    }

    /// The transfer manager executors are built on.
    pub fn with_transfer_manager(mut self, tm: Arc<TransferManager>) -> Self {
        self.transfer_manager = Some(tm);
        self
    }

    /// Binds tier `T`: its block manager and layout, one block-id space (see [`BoundTier`]).
    /// Its transfer manager must be the engine's.
    pub fn tier<T: Tier>(mut self, tier: BoundTier<T>) -> Self {
        self.tiers.insert(
            T::ID,
            TierBinding {
                layout: tier.layout(),
                bound: Some(Arc::new(tier) as Arc<dyn Any + Send + Sync>),
            },
        );
        self
    }

    /// Binds a source tier whose slots the caller manages outside `kvbm-logical` (G1 of the
    /// inference engine): only its layout. It cannot be a lane's destination.
    pub fn external_tier<T: Tier>(mut self, layout: LayoutHandle) -> Self {
        self.tiers.insert(
            T::ID,
            TierBinding {
                layout,
                bound: None,
            },
        );
        self
    }

    /// Adds a lane. One pipeline per (source, destination) pair.
    pub fn lane(mut self, lane: LaneSpec) -> Self {
        self.lanes.push(lane);
        self
    }

    /// Hands every block `from` registers in its destination to `to` (as weak references).
    /// `from`'s destination must be `to`'s source, and `to` must allocate its own destinations.
    pub fn chain(mut self, from: PipelineLane, to: PipelineLane) -> Self {
        self.chains.push((from, to));
        self
    }

    /// Spawns every lane.
    ///
    /// # Errors
    /// [`OffloadError::DuplicateLane`], [`OffloadError::InvalidConfig`] for a chain whose ends
    /// do not meet or name a missing lane, [`OffloadError::MissingTier`] /
    /// [`OffloadError::Missing`] for what a lane needs and was not given,
    /// [`OffloadError::NoRuntime`], and any pipeline's own configuration error.
    pub fn build(self) -> Result<OffloadEngine, OffloadError> {
        let runtime = match self.runtime {
            Some(h) => h,
            None => Handle::try_current().map_err(|_| OffloadError::NoRuntime)?,
        };
        let mut seen = std::collections::HashSet::new();
        for l in &self.lanes {
            if !seen.insert(l.lane) {
                return Err(OffloadError::DuplicateLane(l.lane));
            }
        }
        let mut outlets: HashMap<PipelineLane, Outlet> = HashMap::new();
        for (from, to) in &self.chains {
            if from.destination != to.source || !seen.contains(from) || !seen.contains(to) {
                return Err(OffloadError::InvalidConfig(format!(
                    "chain {from} -> {to}: both lanes must exist and {from} must end where {to} starts"
                )));
            }
            outlets.insert(*from, Arc::new(OnceLock::new()));
        }
        let chained = Arc::new(AtomicU64::new(0));
        let refused = Arc::new(AtomicU64::new(0));
        let ctx = Ctx {
            registry: &self.registry,
            runtime: &runtime,
            tm: self.transfer_manager.clone(),
            tiers: &self.tiers,
            outlets: &outlets,
            chained: &chained,
            refused: &refused,
        };
        let mut lanes: Vec<(PipelineLane, Arc<dyn RunningLane>)> = Vec::new();
        for spec in self.lanes {
            let running = (spec.spawn)(&ctx)?;
            lanes.push((spec.lane, running));
        }
        for (from, to) in &self.chains {
            let target = lanes
                .iter()
                .find(|(l, _)| l == to)
                .map(|(_, r)| r.clone())
                .expect("checked above");
            let _ = outlets[from].set(target);
        }
        Ok(OffloadEngine {
            registry: self.registry,
            runtime,
            lanes,
            chained,
            refused,
        })
    }
}

/// Central coordinator for offload pipelines.
pub struct OffloadEngine {
    registry: BlockRegistry,
    runtime: Handle,
    lanes: Vec<(PipelineLane, Arc<dyn RunningLane>)>,
    chained: Arc<AtomicU64>,
    refused: Arc<AtomicU64>,
}

impl std::fmt::Debug for OffloadEngine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OffloadEngine")
            .field("lanes", &self.lanes())
            .finish()
    }
}

impl OffloadEngine {
    /// A builder around the shared registry (presence and frequency for the policies).
    pub fn builder(registry: BlockRegistry) -> OffloadEngineBuilder {
        OffloadEngineBuilder {
            registry,
            runtime: None,
            transfer_manager: None,
            tiers: HashMap::new(),
            lanes: Vec::new(),
            chains: Vec::new(),
        }
    }

    /// The registry.
    pub fn registry(&self) -> &BlockRegistry {
        &self.registry
    }

    /// The runtime the pipelines run on.
    pub fn runtime(&self) -> &Handle {
        &self.runtime
    }

    /// The lanes, in the order they were added.
    pub fn lanes(&self) -> Vec<PipelineLane> {
        self.lanes.iter().map(|(l, _)| *l).collect()
    }

    fn running(&self, lane: PipelineLane) -> Option<&Arc<dyn RunningLane>> {
        self.lanes.iter().find(|(l, _)| *l == lane).map(|(_, r)| r)
    }

    /// The pipeline of `lane`, when it reads from `S` and carries attachment `A` (`()` for
    /// executor-allocated destinations, `MutableBlock<D>` for onboarding lanes).
    pub fn pipeline<S: Tier, A: Send + 'static>(
        &self,
        lane: PipelineLane,
    ) -> Option<&Pipeline<S, A>> {
        self.running(lane)?
            .pipeline_any()
            .downcast_ref::<Pipeline<S, A>>()
    }

    /// The G2→G4 object pipeline.
    pub fn object_pipeline(&self) -> Option<&ObjectPipeline> {
        self.running(PipelineLane::G2_TO_G4)?.object()
    }

    /// Enqueues `S` blocks into `lane` (whose executor allocates destinations), after
    /// `precondition`; waits while its input is full.
    ///
    /// # Errors
    /// [`OffloadError::NoPipeline`] when no such lane reads from `S`; the pipeline's errors.
    pub async fn enqueue<S: Tier>(
        &self,
        lane: PipelineLane,
        blocks: impl Into<SourceBlocks<S>>,
        precondition: Option<Precondition>,
    ) -> Result<OffloadHandle, OffloadError> {
        self.pipeline::<S, ()>(lane)
            .ok_or(OffloadError::NoPipeline(lane))?
            .enqueue(blocks, precondition)
            .await
    }

    /// Enqueues `S` blocks into an onboarding `lane`, each with the destination the caller
    /// allocated for it.
    ///
    /// # Errors
    /// [`OffloadError::NoPipeline`] when no such lane moves `S` into caller-allocated `D`
    /// blocks; the pipeline's errors.
    pub async fn enqueue_into<S: Tier, D: Tier>(
        &self,
        lane: PipelineLane,
        blocks: impl Into<SourceBlocks<S>>,
        destinations: Vec<MutableBlock<D>>,
        precondition: Option<Precondition>,
    ) -> Result<OffloadHandle, OffloadError> {
        self.pipeline::<S, MutableBlock<D>>(lane)
            .ok_or(OffloadError::NoPipeline(lane))?
            .enqueue_into(blocks, destinations, precondition)
            .await
    }

    /// Blocks handed from one lane to the next by chains so far.
    pub fn chained_blocks(&self) -> u64 {
        self.chained.load(Ordering::Relaxed)
    }

    /// Blocks a chain could not hand on because the next lane's input was full.
    pub fn chain_refused_blocks(&self) -> u64 {
        self.refused.load(Ordering::Relaxed)
    }

    /// Captures a checkpoint over every lane.
    pub fn settlement_token(&self) -> SettlementToken {
        let target = self
            .lanes
            .iter()
            .fold(SettlementTarget::new(), |t, (lane, r)| {
                t.with(*lane, r.lane_state().dispatched())
            });
        SettlementToken::new(target)
    }

    /// Waits until everything `token` captured has settled.
    ///
    /// # Errors
    /// [`SettlementError::Failed`] when a captured batch can no longer settle;
    /// [`SettlementError::UnknownLane`] when the token names a lane this engine does not run.
    pub async fn wait_for_settlement(
        &self,
        token: &SettlementToken,
    ) -> Result<(), SettlementError> {
        for (lane, n) in token.target().lanes() {
            let state = self
                .running(*lane)
                .ok_or(SettlementError::UnknownLane(*lane))?
                .lane_state();
            state.wait_for(*n).await?;
        }
        Ok(())
    }

    /// Stops accepting work and waits for every pipeline to drain, in the order the lanes were
    /// added (put a chain's first lane first, so what it hands on is drained too).
    pub async fn shutdown(&self) {
        for (_, r) in &self.lanes {
            r.shutdown_and_wait().await;
        }
    }
}
