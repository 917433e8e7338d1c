//! The G2→G4 pipeline: a [`Pipeline`] whose policy checks object presence (and, with
//! `use_locks`, takes the distributed lock of [`super::lock`]) before uploading.
//!
//! Shutdown: [`ObjectPipeline::shutdown_and_wait`] drains the pipeline and then waits for the
//! lock deletions its releases started, so a clean shutdown leaves no lock object behind.

use std::sync::Arc;

use kvbm_logical::G2;
use kvbm_physical::ObjectStorage;

use super::lock::ObjectLockPresenceFilter;
use super::presence::{ObjectPresenceFilter, S3PresenceChecker};
use crate::config::ObjectPipelineConfig;
use crate::error::OffloadError;
use crate::executor::MoveExecutor;
use crate::handle::OffloadHandle;
use crate::pipeline::{CompletionSink, Pipeline, PipelineBuilder};
use crate::policy::{AllOfPolicy, OffloadPolicy};
use crate::settlement::PipelineLane;
use crate::source::{Precondition, SourceBlocks};

/// Builder for object pipeline configuration.
pub struct ObjectPipelineBuilder {
    config: ObjectPipelineConfig,
    storage: Arc<ObjectStorage>,
    owner: String,
    extra: Vec<Arc<dyn OffloadPolicy>>,
}

impl std::fmt::Debug for ObjectPipelineBuilder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ObjectPipelineBuilder")
            .field("config", &self.config)
            .field("owner", &self.owner)
            .finish()
    }
}

impl ObjectPipelineBuilder {
    /// A builder writing to `storage` (used for presence checks and locks; the executor's
    /// object layout must use the same storage).
    pub fn new(storage: Arc<ObjectStorage>) -> Self {
        Self {
            config: ObjectPipelineConfig::default(),
            storage,
            owner: format!("kvbm-{}", std::process::id()),
            extra: Vec::new(),
        }
    }

    /// The configuration. Default: [`ObjectPipelineConfig::default`].
    pub fn config(mut self, config: ObjectPipelineConfig) -> Self {
        self.config = config;
        self
    }

    /// Identifies this worker in lock objects. Default: `kvbm-<pid>`.
    pub fn owner(mut self, owner: impl Into<String>) -> Self {
        self.owner = owner.into();
        self
    }

    /// A policy evaluated before the object checks (e.g. a frequency threshold), so remote
    /// requests are only made for blocks it passes.
    pub fn policy(mut self, policy: Arc<dyn OffloadPolicy>) -> Self {
        self.extra.push(policy);
        self
    }

    /// Starts the pipeline with `executor` on the current tokio runtime.
    ///
    /// # Errors
    /// [`OffloadError::NoRuntime`] outside a tokio runtime (use [`spawn_on`](Self::spawn_on));
    /// [`OffloadError::InvalidConfig`] when the configuration does not validate.
    pub fn spawn<E: MoveExecutor<G2>>(self, executor: E) -> Result<ObjectPipeline, OffloadError> {
        self.spawn_with_sink(executor, None)
    }

    /// Like [`spawn`](Self::spawn), with a completion sink.
    ///
    /// # Errors
    /// As [`spawn`](Self::spawn).
    pub fn spawn_with_sink<E: MoveExecutor<G2>>(
        self,
        executor: E,
        sink: Option<CompletionSink<E::Output>>,
    ) -> Result<ObjectPipeline, OffloadError> {
        // A bad configuration is named first, runtime or not.
        self.config.validate()?;
        let runtime = tokio::runtime::Handle::try_current().map_err(|_| OffloadError::NoRuntime)?;
        self.spawn_on_with_sink(&runtime, executor, sink)
    }

    /// Starts the pipeline's tasks on `runtime`; callable from any thread, inside a runtime or
    /// not (the runtime seam for synchronous callers).
    ///
    /// # Errors
    /// [`OffloadError::InvalidConfig`] when the configuration does not validate.
    pub fn spawn_on<E: MoveExecutor<G2>>(
        self,
        runtime: &tokio::runtime::Handle,
        executor: E,
    ) -> Result<ObjectPipeline, OffloadError> {
        self.spawn_on_with_sink(runtime, executor, None)
    }

    /// Like [`spawn_on`](Self::spawn_on), with a completion sink.
    ///
    /// # Errors
    /// As [`spawn_on`](Self::spawn_on).
    pub fn spawn_on_with_sink<E: MoveExecutor<G2>>(
        self,
        runtime: &tokio::runtime::Handle,
        executor: E,
        sink: Option<CompletionSink<E::Output>>,
    ) -> Result<ObjectPipeline, OffloadError> {
        self.config.validate()?;
        let mut policies = self.extra;
        let lock_filter = if self.config.use_locks {
            let f = Arc::new(
                ObjectLockPresenceFilter::new(self.storage.clone(), self.owner)
                    .with_verify_delay(self.config.lock_verify_delay)
                    .with_lock_ttl(self.config.lock_ttl),
            );
            policies.push(f.clone());
            Some(f)
        } else {
            policies.push(Arc::new(ObjectPresenceFilter::new(Arc::new(
                S3PresenceChecker::new(self.storage.clone()),
            ))));
            None
        };
        let policy: Arc<dyn OffloadPolicy> = if policies.len() == 1 {
            policies.pop().expect("one policy")
        } else {
            Arc::new(AllOfPolicy::new(policies))
        };
        let pipeline = PipelineBuilder::<G2, kvbm_logical::G4>::new()
            .config(self.config.pipeline)
            .policy(policy)
            .lane(PipelineLane::G2ToG4)
            .build()
            .spawn_on_with_sink(runtime, executor, sink)?;
        Ok(ObjectPipeline {
            pipeline,
            lock_filter,
            storage: self.storage,
        })
    }
}

/// A running pipeline instance for object storage destinations.
pub struct ObjectPipeline {
    pipeline: Pipeline<G2>,
    lock_filter: Option<Arc<ObjectLockPresenceFilter>>,
    storage: Arc<ObjectStorage>,
}

impl std::fmt::Debug for ObjectPipeline {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ObjectPipeline")
            .field("pipeline", &self.pipeline)
            .field("locks", &self.lock_filter.is_some())
            .finish()
    }
}

impl ObjectPipeline {
    /// Enqueues G2 blocks for upload.
    ///
    /// # Errors
    /// [`OffloadError::PipelineClosed`] after shutdown.
    pub async fn enqueue(
        &self,
        blocks: impl Into<SourceBlocks<G2>>,
        precondition: Option<Precondition>,
    ) -> Result<OffloadHandle, OffloadError> {
        self.pipeline.enqueue(blocks, precondition).await
    }

    /// The underlying pipeline.
    pub fn pipeline(&self) -> &Pipeline<G2> {
        &self.pipeline
    }

    /// The lock filter, when locks are used.
    pub fn lock_filter(&self) -> Option<&Arc<ObjectLockPresenceFilter>> {
        self.lock_filter.as_ref()
    }

    /// The object storage.
    pub fn storage(&self) -> &Arc<ObjectStorage> {
        &self.storage
    }

    /// Stops accepting work, waits for the pipeline to drain, then waits for every lock
    /// deletion its releases started.
    pub async fn shutdown_and_wait(&self) {
        self.pipeline.shutdown_and_wait().await;
        if let Some(f) = &self.lock_filter {
            f.flush_releases().await;
        }
    }
}
