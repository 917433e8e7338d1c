//! [`PipelineBuilder`] and [`PipelineSpec`]: configuration, policy and lane of a pipeline, and
//! starting it on a runtime.
//!
//! The lane is the pipeline's (source, destination) tier pair, taken from its type parameters:
//! nothing maps one pair onto another. A pipeline is started on an explicit tokio
//! [`Handle`](tokio::runtime::Handle) ([`PipelineSpec::spawn_on`]), so a synchronous caller that
//! owns a runtime can build and drive pipelines without being inside it;
//! [`PipelineSpec::spawn`] uses the current runtime and errs (never panics) outside one.

use std::marker::PhantomData;
use std::sync::Arc;
use std::time::Duration;

use kvbm_logical::{MutableBlock, Tier};
use tokio::runtime::Handle;

use super::{CompletionSink, Pipeline};
use crate::config::PipelineConfig;
use crate::error::OffloadError;
use crate::executor::MoveExecutor;
use crate::policy::OffloadPolicy;
use crate::settlement::PipelineLane;

/// Type-level lane and attachment of a builder or spec.
type Marker<Src, Dst, A> = PhantomData<fn() -> (Src, Dst, A)>;

/// Builder for pipeline configuration.
pub struct PipelineBuilder<Src: Tier, Dst: Tier, A = ()> {
    config: PipelineConfig,
    policy: Option<Arc<dyn OffloadPolicy>>,
    requested: Option<PipelineLane>,
    _tiers: Marker<Src, Dst, A>,
}

impl<Src: Tier, Dst: Tier, A> std::fmt::Debug for PipelineBuilder<Src, Dst, A> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PipelineBuilder")
            .field("lane", &Self::LANE)
            .field("config", &self.config)
            .finish()
    }
}

impl<Src: Tier, Dst: Tier> Default for PipelineBuilder<Src, Dst> {
    fn default() -> Self {
        Self::new()
    }
}

impl<Src: Tier, Dst: Tier> PipelineBuilder<Src, Dst> {
    /// A builder with [`PipelineConfig::default`] and [`PassAllPolicy`](crate::policy::PassAllPolicy),
    /// for a lane whose executor allocates the destinations.
    pub fn new() -> Self {
        Self {
            config: PipelineConfig::default(),
            policy: None,
            requested: None,
            _tiers: PhantomData,
        }
    }

    /// The lane carries caller-allocated destinations: each enqueued block comes with the
    /// `MutableBlock<Dst>` it moves into ([`Pipeline::enqueue_into`]).
    pub fn caller_allocated(self) -> PipelineBuilder<Src, Dst, MutableBlock<Dst>> {
        PipelineBuilder {
            config: self.config,
            policy: self.policy,
            requested: self.requested,
            _tiers: PhantomData,
        }
    }
}

impl<Src: Tier, Dst: Tier, A> PipelineBuilder<Src, Dst, A> {
    /// The lane of every pipeline this builder makes: `(Src, Dst)`.
    pub const LANE: PipelineLane = PipelineLane::new(Src::ID, Dst::ID);

    /// Replaces the whole configuration.
    pub fn config(mut self, config: PipelineConfig) -> Self {
        self.config = config;
        self
    }

    /// The policy. Default: [`PassAllPolicy`](crate::policy::PassAllPolicy) (or the configured
    /// `policies`, when the engine builds it).
    pub fn policy(mut self, policy: Arc<dyn OffloadPolicy>) -> Self {
        self.policy = Some(policy);
        self
    }

    /// Maximum blocks per batch. Default: 64.
    pub fn batch_size(mut self, n: usize) -> Self {
        self.config.batch_config.max_batch_size = n;
        self
    }

    /// Minimum blocks before a batch is flushed without waiting. Default: 8.
    pub fn min_batch_size(mut self, n: usize) -> Self {
        self.config.batch_config.min_batch_size = n;
        self
    }

    /// Time before a partial batch is flushed. Default: 10 ms.
    pub fn flush_interval(mut self, d: Duration) -> Self {
        self.config.batch_config.flush_interval = d;
        self
    }

    /// Timeout of one policy evaluation. Default: 100 ms.
    pub fn policy_timeout(mut self, d: Duration) -> Self {
        self.config.policy_timeout = d;
        self
    }

    /// Backstop interval of the cancel sweeper. Default: 10 ms.
    pub fn sweep_interval(mut self, d: Duration) -> Self {
        self.config.sweep_interval = d;
        self
    }

    /// Transfer batches in flight at once. Default: 1.
    pub fn max_concurrent_transfers(mut self, n: usize) -> Self {
        self.config.max_concurrent_transfers = n;
        self
    }

    /// Capacity of the input queue and of each inter-stage queue. Default: 1024.
    pub fn queue_capacity(mut self, n: usize) -> Self {
        self.config.queue_capacity = n;
        self
    }

    /// Names the lane explicitly. The lane is always `(Src, Dst)`; naming another pair is an
    /// error at spawn ([`OffloadError::LaneMismatch`]), never a silently re-labelled pipeline.
    pub fn lane(mut self, lane: PipelineLane) -> Self {
        self.requested = Some(lane);
        self
    }

    /// Finishes the configuration (the pipeline starts with [`PipelineSpec::spawn_on`]).
    pub fn build(self) -> PipelineSpec<Src, Dst, A> {
        PipelineSpec {
            config: self.config,
            policy: self.policy,
            lane: Self::LANE,
            requested: self.requested,
            _tiers: PhantomData,
        }
    }
}

/// A pipeline's configuration and policy, not yet running.
pub struct PipelineSpec<Src: Tier, Dst: Tier, A = ()> {
    pub(crate) config: PipelineConfig,
    pub(crate) policy: Option<Arc<dyn OffloadPolicy>>,
    pub(crate) lane: PipelineLane,
    requested: Option<PipelineLane>,
    _tiers: Marker<Src, Dst, A>,
}

impl<Src: Tier, Dst: Tier, A> std::fmt::Debug for PipelineSpec<Src, Dst, A> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PipelineSpec")
            .field("lane", &self.lane)
            .field("config", &self.config)
            .finish()
    }
}

impl<Src: Tier, Dst: Tier, A: Send + 'static> PipelineSpec<Src, Dst, A> {
    /// The configuration.
    pub fn config(&self) -> &PipelineConfig {
        &self.config
    }

    /// The lane, `(Src, Dst)`.
    pub fn lane(&self) -> PipelineLane {
        self.lane
    }

    /// Starts the pipeline's tasks on the current tokio runtime.
    ///
    /// # Errors
    /// [`OffloadError::NoRuntime`] outside a tokio runtime (use [`spawn_on`](Self::spawn_on));
    /// [`OffloadError::InvalidConfig`] when the configuration does not validate.
    pub fn spawn<E: MoveExecutor<Src, A>>(
        self,
        executor: E,
    ) -> Result<Pipeline<Src, A>, OffloadError> {
        self.spawn_with_sink(executor, None)
    }

    /// Like [`spawn`](Self::spawn), also handing every batch's successful results to `sink`.
    ///
    /// # Errors
    /// As [`spawn`](Self::spawn).
    pub fn spawn_with_sink<E: MoveExecutor<Src, A>>(
        self,
        executor: E,
        sink: Option<CompletionSink<E::Output>>,
    ) -> Result<Pipeline<Src, A>, OffloadError> {
        let runtime = Handle::try_current().map_err(|_| OffloadError::NoRuntime)?;
        self.spawn_on_with_sink(&runtime, executor, sink)
    }

    /// Starts the pipeline's tasks on `runtime`; callable from any thread, inside a runtime or
    /// not (the runtime seam for synchronous callers).
    ///
    /// # Errors
    /// [`OffloadError::InvalidConfig`] when the configuration does not validate.
    pub fn spawn_on<E: MoveExecutor<Src, A>>(
        self,
        runtime: &Handle,
        executor: E,
    ) -> Result<Pipeline<Src, A>, OffloadError> {
        self.spawn_on_with_sink(runtime, executor, None)
    }

    /// Like [`spawn_on`](Self::spawn_on), with a completion sink.
    ///
    /// # Errors
    /// [`OffloadError::InvalidConfig`] when the configuration does not validate;
    /// [`OffloadError::LaneMismatch`] when [`PipelineBuilder::lane`] named another pair.
    pub fn spawn_on_with_sink<E: MoveExecutor<Src, A>>(
        self,
        runtime: &Handle,
        executor: E,
        sink: Option<CompletionSink<E::Output>>,
    ) -> Result<Pipeline<Src, A>, OffloadError> {
        self.config.validate()?;
        if let Some(requested) = self.requested
            && requested != self.lane
        {
            return Err(OffloadError::LaneMismatch {
                requested,
                pipeline: self.lane,
            });
        }
        Ok(super::stages::start(
            runtime,
            self.config,
            self.policy,
            self.lane,
            executor,
            sink,
        ))
    }
}
