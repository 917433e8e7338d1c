//! A running pipeline: four stages joined by bounded [`CancellableQueue`]s.
//!
//! ```text
//!  enqueue ─► [input] ─► PolicyEvaluator ─► [precondition] ─► PreconditionAwaiter ─► [batch]
//!              queue     (dedupe done at       queue           select!(event, token)   queue
//!                         enqueue; policy                       (P6)                     │
//!                         under timeout)                                                 ▼
//!   sink ◄── settle ◄── executor.execute ◄── upgrade_batch ◄── sweep (P4) ◄── [transfer] ◄── Batcher
//!  (chain)  (report,     (bytes; register   (P3, flat P5)     permit of      queue        (min, max,
//!           release)      on success)                         max_concurrent              flush timer)
//!
//!  CancelSweeper: on every cancel (and each sweep_interval) sweeps input, precondition, batch
//!  and transfer queues; the Batcher sweeps its own open batch on the same signal.
//! ```
//!
//! # Invariants
//!
//! * Every stage checks the container's token when it takes it, and every queue is swept, so a
//!   cancelled container is dropped within one sweep of the request wherever it waits — except
//!   after [`upgrade_batch`], where cancellation no longer applies (P3).
//! * A stage that must wait for room downstream keeps sweeping the item it holds, so a full
//!   queue never delays a cancellation confirmation.
//! * Each stage closes its output queue when its input is closed and drained: shutdown is a
//!   graceful drain front to back.
//!
//! # Lock order
//!
//! Queue mutex, pending-set mutex, a transfer's progress mutex and a lane's settlement mutex are
//! all leaves: none is held while taking another or while dropping blocks.

use std::marker::PhantomData;
use std::sync::Arc;
use std::time::Duration;

use either::Either;
use futures::StreamExt;
use futures::stream::FuturesUnordered;
use kvbm_logical::{SequenceHash, Tier, TierId};
use tokio::sync::{Semaphore, watch};
use tokio::task::JoinSet;
use tokio::time::Instant;

use crate::batch::{OffloadBatch, OffloadContainer, upgrade_batch};
use crate::cancel::CancellationToken;
use crate::config::PipelineConfig;
use crate::error::{BlockFailure, BlockFailureKind, OffloadError, PolicyError};
use crate::executor::TransferExecutor;
use crate::handle::{TransferHandle, TransferShared};
use crate::metrics::{FilterReason, PipelineMetrics};
use crate::pending::PendingTracker;
use crate::policy::{EvalContext, OffloadPolicy, PassAllPolicy};
use crate::queue::{CancellableQueue, PushError, Sweep, SweepTarget};
use crate::settlement::{
    LaneState, PipelineLane, SettlementError, SettlementTarget, SettlementToken,
};
use crate::source::{Precondition, SourceBlocks};
use crate::sweep::{CancelSweeper, SweepSignal};

/// Called with the results of successfully transferred blocks (used by `auto_chain`).
pub type CompletionSink<R> = Arc<dyn Fn(Vec<R>) + Send + Sync>;

/// Builder for pipeline configuration.
pub struct PipelineBuilder<Src: Tier, Dst: Tier> {
    config: PipelineConfig,
    policy: Option<Arc<dyn OffloadPolicy>>,
    lane: Option<PipelineLane>,
    _tiers: PhantomData<fn() -> (Src, Dst)>,
}

impl<Src: Tier, Dst: Tier> std::fmt::Debug for PipelineBuilder<Src, Dst> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PipelineBuilder")
            .field("src", &Src::ID)
            .field("dst", &Dst::ID)
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
    /// A builder with [`PipelineConfig::default`] and [`PassAllPolicy`].
    pub fn new() -> Self {
        Self {
            config: PipelineConfig::default(),
            policy: None,
            lane: None,
            _tiers: PhantomData,
        }
    }

    /// Replaces the whole configuration.
    pub fn config(mut self, config: PipelineConfig) -> Self {
        self.config = config;
        self
    }

    /// The policy. Default: [`PassAllPolicy`] (or the configured `policies`, when the engine
    /// builds it).
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

    /// Capacity of each inter-stage queue. Default: 1024.
    pub fn queue_capacity(mut self, n: usize) -> Self {
        self.config.queue_capacity = n;
        self
    }

    /// The settlement lane this pipeline reports to. Default: derived from the tiers
    /// (G1→G2, G2→G3, G2→G4), else G2→G3.
    pub fn lane(mut self, lane: PipelineLane) -> Self {
        self.lane = Some(lane);
        self
    }

    /// Finishes the configuration (the pipeline starts with [`PipelineSpec::spawn`]).
    pub fn build(self) -> PipelineSpec<Src, Dst> {
        let lane = self.lane.unwrap_or(match (Src::ID, Dst::ID) {
            (TierId::G1, TierId::G2) => PipelineLane::G1ToG2,
            (TierId::G2, TierId::G4) => PipelineLane::G2ToG4,
            _ => PipelineLane::G2ToG3,
        });
        PipelineSpec {
            config: self.config,
            policy: self.policy,
            lane,
            _tiers: PhantomData,
        }
    }
}

/// A pipeline's configuration and policy, not yet running.
pub struct PipelineSpec<Src: Tier, Dst: Tier> {
    pub(crate) config: PipelineConfig,
    pub(crate) policy: Option<Arc<dyn OffloadPolicy>>,
    pub(crate) lane: PipelineLane,
    _tiers: PhantomData<fn() -> (Src, Dst)>,
}

impl<Src: Tier, Dst: Tier> std::fmt::Debug for PipelineSpec<Src, Dst> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PipelineSpec")
            .field("lane", &self.lane)
            .field("config", &self.config)
            .finish()
    }
}

impl<Src: Tier, Dst: Tier> PipelineSpec<Src, Dst> {
    /// The configuration.
    pub fn config(&self) -> &PipelineConfig {
        &self.config
    }

    /// Starts the pipeline's tasks on the current tokio runtime.
    ///
    /// # Errors
    /// [`OffloadError::InvalidConfig`] when the configuration does not validate.
    ///
    /// # Panics
    /// Outside a tokio runtime.
    pub fn spawn<E: TransferExecutor<Src>>(
        self,
        executor: E,
    ) -> Result<Pipeline<Src>, OffloadError> {
        self.spawn_with_sink(executor, None)
    }

    /// Like [`spawn`](Self::spawn), also handing every batch's successful results to `sink`.
    ///
    /// # Errors
    /// [`OffloadError::InvalidConfig`] when the configuration does not validate.
    pub fn spawn_with_sink<E: TransferExecutor<Src>>(
        self,
        executor: E,
        sink: Option<CompletionSink<E::Output>>,
    ) -> Result<Pipeline<Src>, OffloadError> {
        self.config.validate()?;
        let cfg = self.config;
        let policy = self.policy.unwrap_or_else(|| Arc::new(PassAllPolicy));
        let cap = cfg.queue_capacity;
        let inner = Arc::new(Inner {
            input: Arc::new(CancellableQueue::new("input", usize::MAX)),
            pending: PendingTracker::new(),
            sweep: SweepSignal::new(),
            lane: Arc::new(LaneState::new(self.lane)),
            metrics: Arc::new(PipelineMetrics::new(self.lane)),
            record_timing: cfg.record_timing,
            sweep_on_cancel: cfg.sweep_on_cancel,
            source: Src::ID,
            destination: Dst::ID,
        });
        let precond_q = Arc::new(CancellableQueue::new("precondition", cap));
        let batch_q = Arc::new(CancellableQueue::new("batch", cap));
        let transfer_q = Arc::new(CancellableQueue::new(
            "transfer",
            cap.min(cfg.max_concurrent_transfers.max(2)),
        ));
        let stop = tokio_util::sync::CancellationToken::new();

        let sweeper = CancelSweeper::new(
            vec![
                inner.input.clone() as Arc<dyn SweepTarget>,
                precond_q.clone(),
                batch_q.clone(),
                transfer_q.clone(),
            ],
            inner.sweep.clone(),
            cfg.sweep_interval,
        );
        let mut tasks = JoinSet::new();
        tasks.spawn(sweeper.run(stop.clone()));
        tasks.spawn(policy_evaluator(
            inner.clone(),
            policy,
            precond_q.clone(),
            cfg.policy_timeout,
            cfg.max_concurrent_evaluations,
        ));
        tasks.spawn(precondition_awaiter(
            inner.clone(),
            precond_q,
            batch_q.clone(),
        ));
        tasks.spawn(batcher(
            inner.clone(),
            batch_q,
            transfer_q.clone(),
            cfg.clone(),
        ));
        let stop2 = stop.clone();
        let exec_inner = inner.clone();
        tasks.spawn(async move {
            transfer_stage(
                exec_inner,
                transfer_q,
                executor,
                sink,
                cfg.max_concurrent_transfers,
            )
            .await;
            stop2.cancel();
        });
        Ok(Pipeline {
            inner,
            tasks: parking_lot::Mutex::new(Some(tasks)),
            stop,
        })
    }
}

struct Inner<Src: Tier> {
    input: Arc<CancellableQueue<OffloadContainer<Src>>>,
    pending: PendingTracker,
    sweep: SweepSignal,
    lane: Arc<LaneState>,
    metrics: Arc<PipelineMetrics>,
    record_timing: bool,
    sweep_on_cancel: bool,
    source: TierId,
    destination: TierId,
}

/// A running pipeline instance.
///
/// Dropping it closes its input: what is queued is still drained in the background.
pub struct Pipeline<Src: Tier> {
    inner: Arc<Inner<Src>>,
    tasks: parking_lot::Mutex<Option<JoinSet<()>>>,
    stop: tokio_util::sync::CancellationToken,
}

impl<Src: Tier> std::fmt::Debug for Pipeline<Src> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pipeline")
            .field("lane", &self.inner.lane.lane())
            .field("pending", &self.inner.pending.len())
            .finish()
    }
}

impl<Src: Tier> Pipeline<Src> {
    /// Enqueues blocks for offload; they wait for `precondition` (if any) before being batched.
    ///
    /// Blocks already in flight in this pipeline are reported filtered at once (duplicate
    /// suppression).
    ///
    /// # Errors
    /// [`OffloadError::PipelineClosed`] after [`shutdown`](Self::shutdown).
    pub fn enqueue(
        &self,
        blocks: impl Into<SourceBlocks<Src>>,
        precondition: Option<Precondition>,
    ) -> Result<TransferHandle, OffloadError> {
        let inner = &self.inner;
        if inner.input.is_closed() {
            return Err(OffloadError::PipelineClosed);
        }
        let blocks = blocks.into().into_vec();
        let seq = inner.lane.submit();
        let shared = Arc::new(TransferShared::new(
            inner.sweep_on_cancel.then(|| inner.sweep.clone()),
            Some((inner.lane.clone(), seq)),
            inner.record_timing,
            Some(inner.metrics.clone()),
        ));
        inner.metrics.enqueued(blocks.len());
        shared
            .total
            .store(blocks.len(), std::sync::atomic::Ordering::Release);
        let token = CancellationToken { shared };
        let handle = TransferHandle::new(token.clone());

        let mut guards = inner
            .pending
            .try_insert_batch(blocks.iter().map(|b| b.sequence_hash()));
        let (blocks, pending) = if guards.iter().all(Option::is_some) {
            (blocks, guards)
        } else {
            let mut kept = Vec::with_capacity(blocks.len());
            let mut kept_guards = Vec::with_capacity(blocks.len());
            let mut dups = Vec::new();
            for (b, g) in blocks.into_iter().zip(guards.drain(..)) {
                if g.is_some() {
                    kept.push(b);
                    kept_guards.push(g);
                } else {
                    dups.push(b.sequence_hash());
                }
            }
            inner.metrics.filtered(FilterReason::Duplicate, dups.len());
            token.shared.report_filtered(dups);
            (kept, kept_guards)
        };
        let container = OffloadContainer::new(blocks, pending, precondition, token);
        if container.is_empty() {
            return Ok(handle);
        }
        match inner.input.try_push(container) {
            Ok(()) => Ok(handle),
            Err(PushError::Closed(c) | PushError::Full(c)) => {
                drop(c);
                Err(OffloadError::PipelineClosed)
            }
        }
    }

    /// The lane this pipeline reports settlement to.
    pub fn lane(&self) -> PipelineLane {
        self.inner.lane.lane()
    }

    /// Source tier.
    pub fn source(&self) -> TierId {
        self.inner.source
    }

    /// Destination tier.
    pub fn destination(&self) -> TierId {
        self.inner.destination
    }

    /// Blocks currently in flight (pending-set size).
    pub fn pending_blocks(&self) -> usize {
        self.inner.pending.len()
    }

    /// Whether `hash` is in flight in this pipeline.
    pub fn is_pending(&self, hash: SequenceHash) -> bool {
        self.inner.pending.contains(hash)
    }

    /// Captures a settlement checkpoint: every submission made so far.
    pub fn settlement_token(&self) -> SettlementToken {
        SettlementToken::new(SettlementTarget::new().with(self.lane(), self.inner.lane.submitted()))
    }

    /// Submissions settled so far (the longest settled prefix).
    pub fn settled(&self) -> u64 {
        self.inner.lane.settled_prefix()
    }

    /// Waits until every submission captured by `token` (for this pipeline's lane) settled.
    ///
    /// # Errors
    /// [`SettlementError::Failed`] if the lane failed before that.
    pub async fn wait_settled(&self, token: &SettlementToken) -> Result<(), SettlementError> {
        self.inner
            .lane
            .wait_for(token.target().get(self.lane()))
            .await
    }

    pub(crate) fn lane_state(&self) -> &Arc<LaneState> {
        &self.inner.lane
    }

    /// Stops accepting work; what is queued drains through the stages.
    pub fn shutdown(&self) {
        self.inner.input.close();
    }

    /// Shuts down and waits until every stage has finished.
    pub async fn shutdown_and_wait(&self) {
        self.shutdown();
        let tasks = self.tasks.lock().take();
        if let Some(mut tasks) = tasks {
            while tasks.join_next().await.is_some() {}
        }
        self.stop.cancel();
    }
}

impl<Src: Tier> Drop for Pipeline<Src> {
    fn drop(&mut self) {
        self.inner.input.close();
        if let Some(mut tasks) = self.tasks.get_mut().take() {
            tasks.detach_all();
        }
    }
}

/// Pushes into `q`, waiting for room while sweeping the held item on every cancellation.
/// Returns `false` (the item dropped) if it was cancelled or the queue closed.
async fn push_sweeping<T: Sweep>(
    q: &CancellableQueue<T>,
    mut item: T,
    signal: &mut watch::Receiver<u64>,
) -> bool {
    loop {
        match q.try_push(item) {
            Ok(()) => return true,
            Err(PushError::Closed(_)) => return false,
            Err(PushError::Full(i)) => item = i,
        }
        tokio::select! {
            _ = q.space_available() => {}
            r = signal.changed() => {
                if r.is_err() || item.sweep_cancelled() {
                    return false;
                }
            }
        }
    }
}

async fn policy_evaluator<Src: Tier>(
    inner: Arc<Inner<Src>>,
    policy: Arc<dyn OffloadPolicy>,
    out: Arc<CancellableQueue<OffloadContainer<Src>>>,
    timeout: Duration,
    max_inflight: usize,
) {
    let mut signal = inner.sweep.subscribe();
    let mut inflight = FuturesUnordered::new();
    let finish = |mut c: OffloadContainer<Src>, verdict: Result<Vec<bool>, PolicyError>| {
        let (filtered, reason) = match verdict {
            Ok(v) if v.len() == c.len() => (c.retain_verdicts(&v), FilterReason::Policy),
            Ok(_) | Err(_) => {
                if let Err(PolicyError::Timeout) = verdict {
                    inner.metrics.policy_timeout();
                }
                // Verdict unknown: let the policy drop whatever it may have taken for them.
                let all: Vec<SequenceHash> = c.hashes().collect();
                policy.release(&all);
                if let Err(e) = &verdict {
                    tracing::warn!(policy = policy.name(), error = %e, "policy evaluation failed; filtering");
                } else {
                    tracing::error!(
                        policy = policy.name(),
                        "policy returned a mis-sized verdict; filtering"
                    );
                }
                (
                    c.retain_verdicts(&vec![false; c.len()]),
                    FilterReason::PolicyError,
                )
            }
        };
        let shared = &c.cancel_token().shared;
        if !filtered.is_empty() {
            inner.metrics.filtered(reason, filtered.len());
            shared.report_filtered(filtered);
        }
        if c.is_empty() {
            return None;
        }
        shared.report_passed(c.len());
        c.set_release(policy.clone());
        if inner.record_timing {
            c.timing.evaluated = Some(std::time::Instant::now());
        }
        Some(c)
    };
    loop {
        tokio::select! {
            biased;
            Some(done) = inflight.next(), if !inflight.is_empty() => {
                if let Some((c, verdict)) = done
                    && let Some(c) = finish(c, verdict)
                {
                    push_sweeping(&out, c, &mut signal).await;
                }
            }
            item = inner.input.pop(), if inflight.len() < max_inflight => {
                let Some(c) = item else { break };
                if c.is_cancelled() {
                    continue;
                }
                let ctxs: Vec<EvalContext> = c
                    .blocks()
                    .iter()
                    .map(|b| EvalContext {
                        sequence_hash: b.sequence_hash(),
                        block_id: Some(b.block_id()),
                        source: inner.source,
                        destination: inner.destination,
                    })
                    .collect();
                match policy.evaluate_batch(&ctxs) {
                    Either::Left(ready) => {
                        if let Some(c) = finish(c, ready.into_inner()) {
                            push_sweeping(&out, c, &mut signal).await;
                        }
                    }
                    Either::Right(fut) => {
                        let token = c.cancel_token().clone();
                        let policy = policy.clone();
                        inflight.push(async move {
                            tokio::select! {
                                biased;
                                _ = token.cancelled() => {
                                    // Cancelled while evaluating: the container drops here, and
                                    // the policy drops whatever it took for these blocks.
                                    let all: Vec<SequenceHash> = c.hashes().collect();
                                    drop(c);
                                    policy.release(&all);
                                    None
                                }
                                r = tokio::time::timeout(timeout, fut) => {
                                    Some((c, r.unwrap_or(Err(PolicyError::Timeout))))
                                }
                            }
                        });
                    }
                }
            }
        }
    }
    while let Some(done) = inflight.next().await {
        if let Some((c, verdict)) = done
            && let Some(c) = finish(c, verdict)
        {
            push_sweeping(&out, c, &mut signal).await;
        }
    }
    out.close();
}

async fn precondition_awaiter<Src: Tier>(
    inner: Arc<Inner<Src>>,
    input: Arc<CancellableQueue<OffloadContainer<Src>>>,
    out: Arc<CancellableQueue<OffloadContainer<Src>>>,
) {
    let mut signal = inner.sweep.subscribe();
    let mut waiting = FuturesUnordered::new();
    let record = inner.record_timing;
    let met = |mut c: OffloadContainer<Src>| {
        if record {
            c.timing.precondition_met = Some(std::time::Instant::now());
        }
        c
    };
    let mut open = true;
    while open || !waiting.is_empty() {
        tokio::select! {
            biased;
            Some(done) = waiting.next(), if !waiting.is_empty() => match done {
                None => {}
                Some((c, Ok(()))) => {
                    push_sweeping(&out, met(c), &mut signal).await;
                }
                Some((c, Err(reason))) => {
                    OffloadContainer::fail_all(
                        c,
                        BlockFailure::new(BlockFailureKind::PreconditionFailed, reason),
                    );
                }
            },
            item = input.pop(), if open => {
                let Some(mut c) = item else {
                    open = false;
                    continue;
                };
                if c.is_cancelled() {
                    continue;
                }
                match c.take_precondition() {
                    None => {
                        push_sweeping(&out, met(c), &mut signal).await;
                    }
                    Some(event) => {
                        let token = c.cancel_token().clone();
                        // P6: wait on the event and the token together; on cancel the
                        // container is dropped at once.
                        waiting.push(async move {
                            tokio::select! {
                                biased;
                                _ = token.cancelled() => {
                                    drop(c);
                                    None
                                }
                                r = event.wait() => Some((c, r)),
                            }
                        });
                    }
                }
            }
        }
    }
    out.close();
}

async fn batcher<Src: Tier>(
    inner: Arc<Inner<Src>>,
    input: Arc<CancellableQueue<OffloadContainer<Src>>>,
    out: Arc<CancellableQueue<OffloadBatch<Src>>>,
    cfg: PipelineConfig,
) {
    let max = cfg.batch_config.max_batch_size;
    let min = cfg.batch_config.min_batch_size.max(1);
    let flush_interval = cfg.batch_config.flush_interval;
    let record = inner.record_timing;
    let mut signal = inner.sweep.subscribe();
    let mut batch = OffloadBatch::new();
    let mut deadline: Option<Instant> = None;

    async fn flush<Src: Tier>(
        batch: &mut OffloadBatch<Src>,
        out: &CancellableQueue<OffloadBatch<Src>>,
        signal: &mut watch::Receiver<u64>,
        record: bool,
    ) {
        let mut full = std::mem::take(batch);
        if full.is_empty() {
            return;
        }
        if record {
            let now = std::time::Instant::now();
            full.mark_batched(now);
        }
        push_sweeping(out, full, signal).await;
    }

    loop {
        tokio::select! {
            biased;
            r = signal.changed() => {
                if r.is_err() {
                    break;
                }
                batch.sweep_cancelled();
                if batch.is_empty() {
                    deadline = None;
                }
            }
            _ = sleep_until_opt(deadline), if deadline.is_some() => {
                flush(&mut batch, &out, &mut signal, record).await;
                deadline = None;
            }
            item = input.pop() => {
                let Some(first) = item else { break };
                let mut next = Some(first);
                while let Some(mut c) = next.take() {
                    if !c.is_cancelled() {
                        // Fill up to `max`, splitting a container that does not fit.
                        loop {
                            let room = max - batch.total_blocks();
                            if c.len() <= room {
                                if batch.is_empty() {
                                    deadline = Some(Instant::now() + flush_interval);
                                }
                                batch.push(c);
                                break;
                            }
                            let rest = c.split_off(room);
                            batch.push(c);
                            flush(&mut batch, &out, &mut signal, record).await;
                            deadline = None;
                            c = rest;
                        }
                        if batch.total_blocks() >= max {
                            flush(&mut batch, &out, &mut signal, record).await;
                            deadline = None;
                        }
                    }
                    next = input.try_pop();
                }
                if batch.total_blocks() >= min {
                    flush(&mut batch, &out, &mut signal, record).await;
                    deadline = None;
                }
            }
        }
    }
    flush(&mut batch, &out, &mut signal, record).await;
    out.close();
}

async fn sleep_until_opt(deadline: Option<Instant>) {
    match deadline {
        Some(d) => tokio::time::sleep_until(d).await,
        None => std::future::pending().await,
    }
}

async fn transfer_stage<Src: Tier, E: TransferExecutor<Src>>(
    inner: Arc<Inner<Src>>,
    input: Arc<CancellableQueue<OffloadBatch<Src>>>,
    executor: E,
    sink: Option<CompletionSink<E::Output>>,
    max_concurrent: usize,
) {
    let executor = Arc::new(executor);
    let permits = Arc::new(Semaphore::new(max_concurrent));
    let mut running = JoinSet::new();
    loop {
        while let Some(r) = running.try_join_next() {
            reap(&inner, r);
        }
        // Take a transfer slot first, so the batch waits in the (swept) queue, not here.
        let permit = permits
            .clone()
            .acquire_owned()
            .await
            .expect("semaphore never closed");
        let Some(mut batch) = input.pop().await else {
            break;
        };
        // P4: the last cancellation check, immediately before the commitment point.
        batch.sweep_cancelled();
        if batch.is_empty() {
            continue;
        }
        // P3 + P5: upgrade and flatten; cancellation no longer applies.
        let mut resolved = upgrade_batch(batch);
        resolved.set_lane(inner.lane.clone());
        let executor = executor.clone();
        let sink = sink.clone();
        let metrics = inner.metrics.clone();
        running.spawn(async move {
            let outcome = if resolved.is_empty() {
                Vec::new()
            } else {
                let _in_flight = metrics.submitted(resolved.len());
                executor.execute(&resolved).await
            };
            resolved.settle(
                outcome,
                sink.as_deref().map(|s| s as &dyn Fn(Vec<E::Output>)),
            );
            drop(permit);
        });
    }
    while let Some(r) = running.join_next().await {
        reap(&inner, r);
    }
}

fn reap<Src: Tier>(inner: &Inner<Src>, r: Result<(), tokio::task::JoinError>) {
    if let Err(e) = r
        && e.is_panic()
    {
        inner.lane.fail(
            crate::settlement::PipelineFailureKind::ExecutorPanicked,
            format!("transfer task panicked: {e}"),
        );
    }
}
