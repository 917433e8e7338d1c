//! The stage loops of a pipeline and their supervision.
//!
//! Each stage runs as one task under [`supervise`]: the stage future is polled inside
//! `catch_unwind`, so a panic anywhere in it (its own code, a policy, a precondition future, the
//! batcher's bookkeeping) is caught, recorded as the lane's failure and turned into a teardown
//! ([`Inner::fail`]). Blocks dropped while unwinding or after the failure report
//! `PipelineFailed`, never `Cancelled`. The transfer stage is the one stage not dropped on a
//! teardown: it stops taking batches and lets the committed ones (P3) run to their end.
//!
//! No stage awaits a push: each keeps what it cannot push yet in a small outbox and waits for
//! room in the same `select!` that polls its other work, so cancellation is observed while a
//! downstream queue is full.

use std::collections::VecDeque;
use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::time::Duration;

use either::Either;
use futures::FutureExt;
use futures::StreamExt;
use futures::stream::FuturesUnordered;
use kvbm_logical::{SequenceHash, Tier};
use tokio::runtime::Handle;
use tokio::sync::{Semaphore, watch};
use tokio::task::JoinSet;
use tokio::time::Instant;

use super::{CompletionSink, Inner, Pipeline};
use crate::batch::{OffloadBatch, OffloadContainer, upgrade_batch};
use crate::config::PipelineConfig;
use crate::error::{BlockFailure, BlockFailureKind, PolicyError};
use crate::executor::MoveExecutor;
use crate::metrics::{FilterReason, PipelineMetrics};
use crate::pending::PendingTracker;
use crate::policy::{EvalContext, OffloadPolicy, PassAllPolicy};
use crate::queue::{CancellableQueue, PushError, Sweep, SweepTarget};
use crate::settlement::{LaneState, PipelineFailureKind, PipelineLane, PipelineStage};
use crate::sweep::{CancelSweeper, SweepSignal};

/// Builds the queues and spawns every stage on `runtime`.
pub(crate) fn start<Src: Tier, A: Send + 'static, E: MoveExecutor<Src, A>>(
    runtime: &Handle,
    cfg: PipelineConfig,
    policy: Option<Arc<dyn OffloadPolicy>>,
    lane: PipelineLane,
    executor: E,
    sink: Option<CompletionSink<E::Output>>,
) -> Pipeline<Src, A> {
    let policy = policy.unwrap_or_else(|| Arc::new(PassAllPolicy));
    let cap = cfg.queue_capacity;
    let metrics = PipelineMetrics::new(lane);
    let transfer_cap = cap.min(cfg.max_concurrent_transfers.max(2));
    metrics.bounds(
        cfg.max_concurrent_transfers,
        &[
            ("input", cap),
            ("precondition", cap),
            ("batch", cap),
            ("transfer", transfer_cap),
        ],
    );
    let inner = Arc::new(Inner {
        input: bounded_queue(&metrics, "input", cap),
        precondition_q: bounded_queue(&metrics, "precondition", cap),
        batch_q: bounded_queue(&metrics, "batch", cap),
        transfer_q: bounded_queue(&metrics, "transfer", transfer_cap),
        pending: PendingTracker::new(),
        sweep: SweepSignal::new(),
        lane: Arc::new(LaneState::new(lane)),
        metrics: Arc::new(metrics),
        record_timing: cfg.record_timing,
        sweep_on_cancel: cfg.sweep_on_cancel,
        abort: tokio_util::sync::CancellationToken::new(),
    });
    let stop = tokio_util::sync::CancellationToken::new();
    let sweeper = CancelSweeper::new(
        vec![
            inner.input.clone() as Arc<dyn SweepTarget>,
            inner.precondition_q.clone(),
            inner.batch_q.clone(),
            inner.transfer_q.clone(),
        ],
        inner.sweep.clone(),
        cfg.sweep_interval,
    );
    let mut tasks = JoinSet::new();
    let mut spawn = |stage, abortable, fut| {
        tasks.spawn_on(supervise(inner.clone(), stage, abortable, fut), runtime);
    };
    spawn(
        PipelineStage::Sweeper,
        true,
        sweeper.run(stop.clone()).boxed(),
    );
    spawn(
        PipelineStage::Policy,
        true,
        policy_evaluator(
            inner.clone(),
            policy,
            cfg.policy_timeout,
            cfg.max_concurrent_evaluations,
        )
        .boxed(),
    );
    spawn(
        PipelineStage::Precondition,
        true,
        precondition_awaiter(inner.clone(), cap).boxed(),
    );
    spawn(
        PipelineStage::Batcher,
        true,
        batcher(inner.clone(), cfg.clone()).boxed(),
    );
    let stop2 = stop.clone();
    let exec_inner = inner.clone();
    spawn(
        PipelineStage::Transfer,
        false,
        async move {
            // Whatever way the transfer stage ends, the sweeper stops with it.
            let _stop = stop2.drop_guard();
            transfer_stage(exec_inner, executor, sink, cfg.max_concurrent_transfers).await;
        }
        .boxed(),
    );
    Pipeline {
        inner,
        tasks: parking_lot::Mutex::new(Some(tasks)),
        stop,
        runtime: runtime.clone(),
    }
}

/// A stage queue of `cap` items whose high-water mark is exported with the lane's metrics.
fn bounded_queue<T>(
    metrics: &PipelineMetrics,
    name: &'static str,
    cap: usize,
) -> Arc<CancellableQueue<T>> {
    Arc::new(CancellableQueue::new(name, cap).with_high_water_gauge(metrics.queue_high_water(name)))
}

/// Runs one stage: a panic fails the lane and tears it down; an `abortable` stage is dropped
/// (with everything it holds) when the lane fails elsewhere.
async fn supervise<Src: Tier, A: Send + 'static>(
    inner: Arc<Inner<Src, A>>,
    stage: PipelineStage,
    abortable: bool,
    fut: futures::future::BoxFuture<'static, ()>,
) {
    let abort = inner.abort.clone();
    let guarded = AssertUnwindSafe(fut).catch_unwind();
    let result = if abortable {
        tokio::select! {
            biased;
            r = guarded => r,
            _ = abort.cancelled() => Ok(()),
        }
    } else {
        guarded.await
    };
    if let Err(panic) = result {
        inner.fail(
            PipelineFailureKind::StagePanicked(stage),
            format!(
                "{} stage panicked: {}",
                stage.as_str(),
                panic_message(&*panic)
            ),
        );
    }
}

pub(crate) fn panic_message(panic: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = panic.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = panic.downcast_ref::<String>() {
        s.clone()
    } else {
        "non-string panic payload".to_string()
    }
}

/// Moves what it can from `outbox` into `q`: stops at the first `Full` (order is kept); drops
/// everything once `q` is closed.
fn drain_outbox<T>(q: &CancellableQueue<T>, outbox: &mut VecDeque<T>) {
    while let Some(item) = outbox.pop_front() {
        match q.try_push(item) {
            Ok(()) => {}
            Err(PushError::Full(item)) => {
                outbox.push_front(item);
                return;
            }
            Err(PushError::Closed(_)) => {
                outbox.clear();
                return;
            }
        }
    }
}

/// Drops the cancelled items of an outbox (after a sweep signal).
fn sweep_outbox<T: Sweep>(outbox: &mut VecDeque<T>) {
    let mut kept = VecDeque::with_capacity(outbox.len());
    for mut item in outbox.drain(..) {
        if !item.sweep_cancelled() {
            kept.push_back(item);
        }
    }
    *outbox = kept;
}

/// Resolves when the sweep signal fires; never when it is gone.
async fn signalled(signal: &mut watch::Receiver<u64>) {
    if signal.changed().await.is_err() {
        std::future::pending::<()>().await;
    }
}

async fn policy_evaluator<Src: Tier, A: Send + 'static>(
    inner: Arc<Inner<Src, A>>,
    policy: Arc<dyn OffloadPolicy>,
    timeout: Duration,
    max_inflight: usize,
) {
    let out = inner.precondition_q.clone();
    let mut signal = inner.sweep.subscribe();
    let mut inflight = FuturesUnordered::new();
    let mut outbox: VecDeque<OffloadContainer<Src, A>> = VecDeque::new();
    let finish = |mut c: OffloadContainer<Src, A>, verdict: Result<Vec<bool>, PolicyError>| {
        let (filtered, reason) = match verdict {
            Ok(v) if v.len() == c.len() => (c.retain_verdicts(&v), FilterReason::Policy),
            Ok(_) | Err(_) => {
                if let Err(PolicyError::Timeout) = verdict {
                    inner.metrics.policy_timeout();
                }
                match &verdict {
                    Err(e) => {
                        tracing::warn!(policy = policy.name(), error = %e, "policy evaluation failed; filtering")
                    }
                    Ok(v) => tracing::error!(
                        policy = policy.name(),
                        expected = c.len(),
                        got = v.len(),
                        "policy returned a mis-sized verdict; filtering"
                    ),
                }
                // Verdict unknown: every block is filtered, and the policy drops whatever it
                // may have taken for them (through the container's release hook).
                let all: Vec<SequenceHash> = c.hashes().collect();
                let filtered = c.retain_verdicts(&vec![false; c.len()]);
                policy.release(&all);
                (filtered, FilterReason::PolicyError)
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
        if inner.record_timing {
            c.timing.evaluated = Some(std::time::Instant::now());
        }
        Some(c)
    };
    let mut open = true;
    loop {
        drain_outbox(&out, &mut outbox);
        if !open && inflight.is_empty() && outbox.is_empty() {
            break;
        }
        // Bounded: evaluations in flight by `max_concurrent_evaluations`; nothing new is taken
        // while a verdict waits for room downstream (the outbox only holds what completed).
        let room = inflight.len() < max_inflight && outbox.is_empty();
        tokio::select! {
            biased;
            // Only what waits in the outbox needs sweeping here (evaluations and precondition
            // waits select on their own tokens); no waker is registered on the hot path.
            _ = signalled(&mut signal), if !outbox.is_empty() => sweep_outbox(&mut outbox),
            Some(done) = inflight.next(), if !inflight.is_empty() => {
                if let Some((c, verdict)) = done
                    && let Some(c) = finish(c, verdict)
                {
                    outbox.push_back(c);
                }
            }
            _ = out.space_available(), if !outbox.is_empty() => {}
            item = inner.input.pop(), if open && room => {
                let Some(mut c) = item else {
                    open = false;
                    continue;
                };
                if c.is_cancelled() {
                    continue;
                }
                // From here on, a container dropped for any reason (cancelled while
                // evaluating, the lane torn down) releases what the policy took for it.
                c.set_release(policy.clone());
                let ctxs: Vec<EvalContext> = c
                    .blocks()
                    .iter()
                    .map(|b| EvalContext {
                        sequence_hash: b.sequence_hash(),
                        digest: b.digest(),
                        block_id: Some(b.block_id()),
                        source: inner.lane.lane().source,
                        destination: inner.lane.lane().destination,
                    })
                    .collect();
                match policy.evaluate_batch(&ctxs) {
                    Either::Left(ready) => {
                        if let Some(c) = finish(c, ready.into_inner()) {
                            outbox.push_back(c);
                        }
                    }
                    Either::Right(fut) => {
                        let token = c.cancel_token().clone();
                        inflight.push(async move {
                            tokio::select! {
                                biased;
                                // Cancelled while evaluating: the container drops here.
                                _ = token.cancelled() => None,
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
    out.close();
}

type PreconditionWait<Src, A> = std::pin::Pin<
    Box<
        dyn Future<
                Output = Option<(
                    OffloadContainer<Src, A>,
                    Result<(), crate::source::PreconditionError>,
                )>,
            > + Send,
    >,
>;

async fn precondition_awaiter<Src: Tier, A: Send + 'static>(
    inner: Arc<Inner<Src, A>>,
    max_waiting: usize,
) {
    let input = inner.precondition_q.clone();
    let out = inner.batch_q.clone();
    let mut signal = inner.sweep.subscribe();
    let mut waiting: FuturesUnordered<PreconditionWait<Src, A>> = FuturesUnordered::new();
    let mut outbox: VecDeque<OffloadContainer<Src, A>> = VecDeque::new();
    let record = inner.record_timing;
    let met = |mut c: OffloadContainer<Src, A>| {
        if record {
            c.timing.precondition_met = Some(std::time::Instant::now());
        }
        c
    };
    let mut open = true;
    loop {
        drain_outbox(&out, &mut outbox);
        if !open && waiting.is_empty() && outbox.is_empty() {
            break;
        }
        // Bounded: at most `max_waiting` containers wait on their event, and nothing new is
        // taken while one waits for room downstream.
        let room = waiting.len() < max_waiting && outbox.is_empty();
        tokio::select! {
            biased;
            // Only what waits in the outbox needs sweeping here (evaluations and precondition
            // waits select on their own tokens); no waker is registered on the hot path.
            _ = signalled(&mut signal), if !outbox.is_empty() => sweep_outbox(&mut outbox),
            Some(done) = waiting.next(), if !waiting.is_empty() => match done {
                None => {}
                Some((c, Ok(()))) => outbox.push_back(met(c)),
                Some((c, Err(reason))) => {
                    OffloadContainer::fail_all(
                        c,
                        BlockFailure::new(BlockFailureKind::PreconditionFailed, reason.to_string()),
                    );
                }
            },
            _ = out.space_available(), if !outbox.is_empty() => {}
            item = input.pop(), if open && room => {
                let Some(mut c) = item else {
                    open = false;
                    continue;
                };
                if c.is_cancelled() {
                    continue;
                }
                match c.take_precondition() {
                    None => outbox.push_back(met(c)),
                    Some(event) => {
                        let token = c.cancel_token().clone();
                        // P6: wait on the event and the token together; on cancel the
                        // container is dropped at once.
                        waiting.push(Box::pin(async move {
                            tokio::select! {
                                biased;
                                _ = token.cancelled() => None,
                                r = event.wait() => Some((c, r)),
                            }
                        }));
                    }
                }
            }
        }
    }
    out.close();
}

async fn batcher<Src: Tier, A: Send + 'static>(inner: Arc<Inner<Src, A>>, cfg: PipelineConfig) {
    let input = inner.batch_q.clone();
    let out = inner.transfer_q.clone();
    let max = cfg.batch_config.max_batch_size;
    let min = cfg.batch_config.min_batch_size.max(1);
    let flush_interval = cfg.batch_config.flush_interval;
    let record = inner.record_timing;
    let mut signal = inner.sweep.subscribe();
    let mut batch = OffloadBatch::new();
    let mut deadline: Option<Instant> = None;
    // Full batches waiting for room in the transfer queue (at most a few: input is only taken
    // while it is empty).
    let mut outbox: VecDeque<OffloadBatch<Src, A>> = VecDeque::new();

    let flush = |batch: &mut OffloadBatch<Src, A>,
                 outbox: &mut VecDeque<OffloadBatch<Src, A>>,
                 deadline: &mut Option<Instant>| {
        *deadline = None;
        let mut full = std::mem::take(batch);
        if full.is_empty() {
            return;
        }
        if record {
            full.mark_batched(std::time::Instant::now());
        }
        outbox.push_back(full);
    };
    // P1: a container is never split. One that does not fit the open batch closes it; one
    // larger than `max` is a batch of its own.
    let add = |c: OffloadContainer<Src, A>,
               batch: &mut OffloadBatch<Src, A>,
               outbox: &mut VecDeque<OffloadBatch<Src, A>>,
               deadline: &mut Option<Instant>| {
        if c.is_cancelled() {
            return;
        }
        if !batch.is_empty() && batch.total_blocks() + c.len() > max {
            flush(batch, outbox, deadline);
        }
        if batch.is_empty() {
            *deadline = Some(Instant::now() + flush_interval);
        }
        batch.push(c);
        if batch.total_blocks() >= max {
            flush(batch, outbox, deadline);
        }
    };

    let mut open = true;
    loop {
        drain_outbox(&out, &mut outbox);
        if !open {
            if !batch.is_empty() {
                flush(&mut batch, &mut outbox, &mut deadline);
                continue;
            }
            if outbox.is_empty() {
                break;
            }
        }
        tokio::select! {
            biased;
            _ = signalled(&mut signal) => {
                batch.remove_cancelled();
                if batch.is_empty() {
                    deadline = None;
                }
                sweep_outbox(&mut outbox);
            }
            _ = out.space_available(), if !outbox.is_empty() => {}
            _ = sleep_until_opt(deadline), if deadline.is_some() => {
                flush(&mut batch, &mut outbox, &mut deadline);
            }
            item = input.pop(), if open && outbox.is_empty() => {
                let Some(first) = item else {
                    open = false;
                    continue;
                };
                add(first, &mut batch, &mut outbox, &mut deadline);
                // Take what is immediately available, while nothing waits for room.
                while outbox.is_empty() {
                    match input.try_pop() {
                        Some(c) => add(c, &mut batch, &mut outbox, &mut deadline),
                        None => break,
                    }
                }
                if batch.total_blocks() >= min {
                    flush(&mut batch, &mut outbox, &mut deadline);
                }
            }
        }
    }
    out.close();
}

async fn sleep_until_opt(deadline: Option<Instant>) {
    match deadline {
        Some(d) => tokio::time::sleep_until(d).await,
        None => std::future::pending().await,
    }
}

async fn transfer_stage<Src: Tier, A: Send + 'static, E: MoveExecutor<Src, A>>(
    inner: Arc<Inner<Src, A>>,
    executor: E,
    sink: Option<CompletionSink<E::Output>>,
    max_concurrent: usize,
) {
    let input = inner.transfer_q.clone();
    let executor = Arc::new(executor);
    let permits = Arc::new(Semaphore::new(max_concurrent));
    let mut running = JoinSet::new();
    loop {
        while let Some(r) = running.try_join_next() {
            reap(&inner, r);
        }
        // Take a transfer slot first, so the batch waits in the (swept) queue, not here.
        let permit = tokio::select! {
            biased;
            _ = inner.abort.cancelled() => break,
            Some(r) = running.join_next(), if !running.is_empty() => {
                reap(&inner, r);
                continue;
            }
            p = permits.clone().acquire_owned() => p.expect("semaphore never closed"),
        };
        let batch = tokio::select! {
            biased;
            _ = inner.abort.cancelled() => break,
            Some(r) = running.join_next(), if !running.is_empty() => {
                reap(&inner, r);
                drop(permit);
                continue;
            }
            b = input.pop() => b,
        };
        let Some(mut batch) = batch else {
            break;
        };
        // P4: the last cancellation check, immediately before the commitment point.
        batch.remove_cancelled();
        if batch.is_empty() {
            continue;
        }
        // P3 + P5: upgrade and flatten; cancellation no longer applies.
        let mut resolved = upgrade_batch(batch);
        resolved.dispatch_in(inner.lane.clone());
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
    // Committed transfers run to their end (P3), also when the lane failed.
    while let Some(r) = running.join_next().await {
        reap(&inner, r);
    }
}

fn reap<Src: Tier, A: Send + 'static>(
    inner: &Inner<Src, A>,
    r: Result<(), tokio::task::JoinError>,
) {
    if let Err(e) = r
        && e.is_panic()
    {
        let message = format!(
            "transfer executor panicked: {}",
            panic_message(&*e.into_panic())
        );
        inner.fail(PipelineFailureKind::ExecutorPanicked, message);
    }
}
