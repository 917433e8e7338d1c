//! [`OffloadEngine`]: the pipelines of one worker, wired to its tiers.
//!
//! ```text
//! ┌─────────────────────────────────────────────────────────────────┐
//! │                        OffloadEngine                            │
//! │  ┌───────────────┐    ┌───────────────┐    ┌───────────────┐    │
//! │  │G1→G2 Pipeline │────│ G2→G3 Pipeline│    │ G2→G4 Pipeline│    │
//! │  └───────────────┘    └───────────────┘    └───────────────┘    │
//! │         └─────────auto_chain──┘                                 │
//! └─────────────────────────────────────────────────────────────────┘
//! ```
//!
//! With `auto_chain`, every block the G1→G2 pipeline registers in G2 is enqueued (as a weak
//! reference, so it does not pin G2) into the G2→G3 pipeline, whose own policy then decides.
//! Executors are built from the transfer manager, the layouts and the destination managers, or
//! supplied directly (tests, custom transports).

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use kvbm_logical::{BlockManager, BlockRegistry, G1, G2, G3, G4, ImmutableBlock, SequenceHash};
use kvbm_physical::{LayoutHandle, TransferManager};

use crate::error::OffloadError;
use crate::executor::{ArcExecutor, TransferExecutor};
use crate::handle::TransferHandle;
use crate::object::{ObjectPipeline, ObjectPipelineBuilder};
use crate::pipeline::{CompletionSink, Pipeline, PipelineSpec};
use crate::policy::create_policy_from_config;
use crate::settlement::{PipelineLane, SettlementError, SettlementTarget, SettlementToken};
use crate::source::{Precondition, SourceBlocks};
use crate::transfer::{BlockTransferExecutor, ObjectTransferExecutor};

/// Builder for [`OffloadEngine`].
pub struct OffloadEngineBuilder {
    registry: BlockRegistry,
    transfer_manager: Option<Arc<TransferManager>>,
    layouts: [Option<LayoutHandle>; 4],
    g2_manager: Option<Arc<BlockManager<G2>>>,
    g3_manager: Option<Arc<BlockManager<G3>>>,
    g4_manager: Option<Arc<BlockManager<G4>>>,
    g1_to_g2: Option<PipelineSpec<G1, G2>>,
    g2_to_g3: Option<PipelineSpec<G2, G3>>,
    g2_to_g4: Option<ObjectPipelineBuilder>,
    g1_to_g2_executor: Option<ArcExecutor<G1, ImmutableBlock<G2>>>,
    g2_to_g3_executor: Option<ArcExecutor<G2, ImmutableBlock<G3>>>,
    g2_to_g4_executor: Option<ArcExecutor<G2, SequenceHash>>,
    auto_chain: bool,
}

impl std::fmt::Debug for OffloadEngineBuilder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OffloadEngineBuilder")
            .field("g1_to_g2", &self.g1_to_g2.is_some())
            .field("g2_to_g3", &self.g2_to_g3.is_some())
            .field("g2_to_g4", &self.g2_to_g4.is_some())
            .field("auto_chain", &self.auto_chain)
            .finish()
    }
}

impl OffloadEngineBuilder {
    /// The transfer manager executors are built on.
    pub fn with_transfer_manager(mut self, tm: Arc<TransferManager>) -> Self {
        self.transfer_manager = Some(tm);
        self
    }

    /// The layout of G1 (device) blocks in the transfer manager.
    pub fn with_g1_layout(mut self, h: LayoutHandle) -> Self {
        self.layouts[0] = Some(h);
        self
    }

    /// The layout of G2 (host) blocks.
    pub fn with_g2_layout(mut self, h: LayoutHandle) -> Self {
        self.layouts[1] = Some(h);
        self
    }

    /// The layout of G3 (disk) blocks.
    pub fn with_g3_layout(mut self, h: LayoutHandle) -> Self {
        self.layouts[2] = Some(h);
        self
    }

    /// The object layout of G4.
    pub fn with_g4_layout(mut self, h: LayoutHandle) -> Self {
        self.layouts[3] = Some(h);
        self
    }

    /// The G2 block manager (destination of G1→G2).
    pub fn with_g2_manager(mut self, m: Arc<BlockManager<G2>>) -> Self {
        self.g2_manager = Some(m);
        self
    }

    /// The G3 block manager (destination of G2→G3).
    pub fn with_g3_manager(mut self, m: Arc<BlockManager<G3>>) -> Self {
        self.g3_manager = Some(m);
        self
    }

    /// A G4 block manager recording object presence in the registry. Default: none.
    pub fn with_g4_manager(mut self, m: Arc<BlockManager<G4>>) -> Self {
        self.g4_manager = Some(m);
        self
    }

    /// Runs a G1→G2 pipeline.
    pub fn with_g1_to_g2_pipeline(mut self, spec: PipelineSpec<G1, G2>) -> Self {
        self.g1_to_g2 = Some(spec);
        self
    }

    /// Runs a G2→G3 pipeline.
    pub fn with_g2_to_g3_pipeline(mut self, spec: PipelineSpec<G2, G3>) -> Self {
        self.g2_to_g3 = Some(spec);
        self
    }

    /// Runs a G2→G4 pipeline.
    pub fn with_g2_to_g4_pipeline(mut self, builder: ObjectPipelineBuilder) -> Self {
        self.g2_to_g4 = Some(builder);
        self
    }

    /// Uses `executor` for G1→G2 instead of one built from the transfer manager.
    pub fn with_g1_to_g2_executor(
        mut self,
        executor: impl TransferExecutor<G1, Output = ImmutableBlock<G2>>,
    ) -> Self {
        self.g1_to_g2_executor = Some(ArcExecutor::new(executor));
        self
    }

    /// Uses `executor` for G2→G3.
    pub fn with_g2_to_g3_executor(
        mut self,
        executor: impl TransferExecutor<G2, Output = ImmutableBlock<G3>>,
    ) -> Self {
        self.g2_to_g3_executor = Some(ArcExecutor::new(executor));
        self
    }

    /// Uses `executor` for G2→G4.
    pub fn with_g2_to_g4_executor(
        mut self,
        executor: impl TransferExecutor<G2, Output = SequenceHash>,
    ) -> Self {
        self.g2_to_g4_executor = Some(ArcExecutor::new(executor));
        self
    }

    /// Feeds G1→G2 completions into G2→G3. Default: false.
    pub fn auto_chain(mut self, on: bool) -> Self {
        self.auto_chain = on;
        self
    }

    fn tm(&self) -> Result<Arc<TransferManager>, OffloadError> {
        self.transfer_manager
            .clone()
            .ok_or(OffloadError::Missing("transfer manager"))
    }

    fn layout(&self, i: usize, what: &'static str) -> Result<LayoutHandle, OffloadError> {
        self.layouts[i].ok_or(OffloadError::Missing(what))
    }

    /// Starts the configured pipelines on the current tokio runtime.
    ///
    /// # Errors
    /// [`OffloadError::Missing`] naming what a configured pipeline lacks;
    /// [`OffloadError::InvalidConfig`] from a pipeline's configuration.
    pub fn build(mut self) -> Result<OffloadEngine, OffloadError> {
        let registry = self.registry.clone();
        let chained = Arc::new(AtomicU64::new(0));

        let g2_to_g3 = match self.g2_to_g3.take() {
            None => None,
            Some(mut spec) => {
                if spec.policy.is_none() {
                    spec.policy = Some(create_policy_from_config(&spec.config.policies, &registry));
                }
                let exec = match self.g2_to_g3_executor.take() {
                    Some(e) => e,
                    None => ArcExecutor::new(BlockTransferExecutor::<G2, G3>::new(
                        self.tm()?,
                        self.layout(1, "G2 layout")?,
                        self.layout(2, "G3 layout")?,
                        self.g3_manager
                            .clone()
                            .ok_or(OffloadError::Missing("G3 manager"))?,
                    )),
                };
                Some(Arc::new(spec.spawn(exec)?))
            }
        };

        let g1_to_g2 = match self.g1_to_g2.take() {
            None => None,
            Some(mut spec) => {
                if spec.policy.is_none() {
                    spec.policy = Some(create_policy_from_config(&spec.config.policies, &registry));
                }
                let exec = match self.g1_to_g2_executor.take() {
                    Some(e) => e,
                    None => ArcExecutor::new(BlockTransferExecutor::<G1, G2>::new(
                        self.tm()?,
                        self.layout(0, "G1 layout")?,
                        self.layout(1, "G2 layout")?,
                        self.g2_manager
                            .clone()
                            .ok_or(OffloadError::Missing("G2 manager"))?,
                    )),
                };
                let sink: Option<CompletionSink<ImmutableBlock<G2>>> =
                    match (&g2_to_g3, self.auto_chain) {
                        (Some(next), true) => {
                            let next = next.clone();
                            let chained = chained.clone();
                            Some(Arc::new(move |blocks: Vec<ImmutableBlock<G2>>| {
                                let weak: Vec<_> = blocks.iter().map(|b| b.downgrade()).collect();
                                drop(blocks);
                                let n = weak.len() as u64;
                                // Never waits (this runs inside a transfer's settlement): a full
                                // G2→G3 input drops the weak references, which pin nothing.
                                match next.try_enqueue(weak, None) {
                                    Ok(_) => {
                                        chained.fetch_add(n, Ordering::Relaxed);
                                    }
                                    Err(e) => {
                                        tracing::debug!(error = %e, "auto_chain enqueue refused")
                                    }
                                }
                            }))
                        }
                        (None, true) => {
                            return Err(OffloadError::Missing("G2→G3 pipeline for auto_chain"));
                        }
                        _ => None,
                    };
                Some(spec.spawn_with_sink(exec, sink)?)
            }
        };

        let g2_to_g4 = match self.g2_to_g4.take() {
            None => None,
            Some(builder) => {
                let exec = match self.g2_to_g4_executor.take() {
                    Some(e) => e,
                    None => {
                        let mut e = ObjectTransferExecutor::<G2>::new(
                            self.tm()?,
                            self.layout(1, "G2 layout")?,
                            self.layout(3, "G4 layout")?,
                        );
                        if let Some(g4) = &self.g4_manager {
                            e = e.with_g4_manager(g4.clone());
                        }
                        ArcExecutor::new(e)
                    }
                };
                Some(builder.spawn(exec)?)
            }
        };

        Ok(OffloadEngine {
            registry,
            g1_to_g2,
            g2_to_g3,
            g2_to_g4,
            chained,
        })
    }
}

/// Central coordinator for offload pipelines.
pub struct OffloadEngine {
    registry: BlockRegistry,
    g1_to_g2: Option<Pipeline<G1>>,
    g2_to_g3: Option<Arc<Pipeline<G2>>>,
    g2_to_g4: Option<ObjectPipeline>,
    chained: Arc<AtomicU64>,
}

impl std::fmt::Debug for OffloadEngine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OffloadEngine")
            .field("g1_to_g2", &self.g1_to_g2.is_some())
            .field("g2_to_g3", &self.g2_to_g3.is_some())
            .field("g2_to_g4", &self.g2_to_g4.is_some())
            .finish()
    }
}

impl OffloadEngine {
    /// A builder around the shared registry (presence and frequency for the policies).
    pub fn builder(registry: BlockRegistry) -> OffloadEngineBuilder {
        OffloadEngineBuilder {
            registry,
            transfer_manager: None,
            layouts: [None; 4],
            g2_manager: None,
            g3_manager: None,
            g4_manager: None,
            g1_to_g2: None,
            g2_to_g3: None,
            g2_to_g4: None,
            g1_to_g2_executor: None,
            g2_to_g3_executor: None,
            g2_to_g4_executor: None,
            auto_chain: false,
        }
    }

    /// The registry.
    pub fn registry(&self) -> &BlockRegistry {
        &self.registry
    }

    /// Enqueues G1 blocks for G1→G2, after `precondition` (the forward pass).
    ///
    /// # Errors
    /// [`OffloadError::NoPipeline`] when none is configured; [`OffloadError::PipelineClosed`].
    pub async fn enqueue_g1_to_g2(
        &self,
        blocks: impl Into<SourceBlocks<G1>>,
        precondition: Option<Precondition>,
    ) -> Result<TransferHandle, OffloadError> {
        self.g1_to_g2
            .as_ref()
            .ok_or(OffloadError::NoPipeline("G1→G2"))?
            .enqueue(blocks, precondition)
            .await
    }

    /// Enqueues G2 blocks for G2→G3.
    ///
    /// # Errors
    /// [`OffloadError::NoPipeline`] when none is configured; [`OffloadError::PipelineClosed`].
    pub async fn enqueue_g2_to_g3(
        &self,
        blocks: impl Into<SourceBlocks<G2>>,
    ) -> Result<TransferHandle, OffloadError> {
        self.g2_to_g3
            .as_ref()
            .ok_or(OffloadError::NoPipeline("G2→G3"))?
            .enqueue(blocks, None)
            .await
    }

    /// Enqueues G2 blocks for G2→G4.
    ///
    /// # Errors
    /// [`OffloadError::NoPipeline`] when none is configured; [`OffloadError::PipelineClosed`].
    pub async fn enqueue_g2_to_g4(
        &self,
        blocks: impl Into<SourceBlocks<G2>>,
    ) -> Result<TransferHandle, OffloadError> {
        self.g2_to_g4
            .as_ref()
            .ok_or(OffloadError::NoPipeline("G2→G4"))?
            .enqueue(blocks, None)
            .await
    }

    /// The G1→G2 pipeline.
    pub fn g1_to_g2(&self) -> Option<&Pipeline<G1>> {
        self.g1_to_g2.as_ref()
    }

    /// The G2→G3 pipeline.
    pub fn g2_to_g3(&self) -> Option<&Pipeline<G2>> {
        self.g2_to_g3.as_deref()
    }

    /// The G2→G4 pipeline.
    pub fn g2_to_g4(&self) -> Option<&ObjectPipeline> {
        self.g2_to_g4.as_ref()
    }

    /// Blocks handed from G1→G2 to G2→G3 by `auto_chain` so far.
    pub fn chained_blocks(&self) -> u64 {
        self.chained.load(Ordering::Relaxed)
    }

    fn lanes(&self) -> Vec<(PipelineLane, &Arc<crate::settlement::LaneState>)> {
        let mut v = Vec::new();
        if let Some(p) = &self.g1_to_g2 {
            v.push((PipelineLane::G1ToG2, p.lane_state()));
        }
        if let Some(p) = &self.g2_to_g3 {
            v.push((PipelineLane::G2ToG3, p.lane_state()));
        }
        if let Some(p) = &self.g2_to_g4 {
            v.push((PipelineLane::G2ToG4, p.pipeline().lane_state()));
        }
        v
    }

    /// Captures a checkpoint over every configured lane.
    pub fn settlement_token(&self) -> SettlementToken {
        let target = self
            .lanes()
            .into_iter()
            .fold(SettlementTarget::new(), |t, (lane, s)| {
                t.with(lane, s.dispatched())
            });
        SettlementToken::new(target)
    }

    /// Waits until everything `token` captured has settled.
    ///
    /// # Errors
    /// [`SettlementError::Failed`] when a lane failed; [`SettlementError::UnknownLane`] when the
    /// token names a lane this engine does not run.
    pub async fn wait_for_settlement(
        &self,
        token: &SettlementToken,
    ) -> Result<(), SettlementError> {
        let lanes = self.lanes();
        for (lane, n) in token.target().lanes() {
            let state = lanes
                .iter()
                .find(|(l, _)| l == lane)
                .ok_or(SettlementError::UnknownLane(*lane))?
                .1;
            state.wait_for(*n).await?;
        }
        Ok(())
    }

    /// Stops accepting work and waits for every pipeline to drain.
    pub async fn shutdown(&self) {
        if let Some(p) = &self.g1_to_g2 {
            p.shutdown_and_wait().await;
        }
        if let Some(p) = &self.g2_to_g3 {
            p.shutdown_and_wait().await;
        }
        if let Some(p) = &self.g2_to_g4 {
            p.pipeline().shutdown_and_wait().await;
        }
    }
}
