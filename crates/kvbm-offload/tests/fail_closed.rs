//! Issue 10, the pipeline's share: every stage fails closed (a panic fails the lane and
//! completes every handle), a full queue never delays a cancellation, input is bounded, and
//! configuration refuses values that would silently break the pipeline. Every wait is bounded
//! by `within`, so a regression fails instead of hanging CI.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::*;
use kvbm_logical::{G1, G2, SequenceHash};
use kvbm_offload::config::MAX_CONCURRENT_TRANSFERS;
use kvbm_offload::handle::OffloadStatus;
use kvbm_offload::object::ObjectPresenceFilter;
use kvbm_offload::policy::{
    EvalContext, PassAllPolicy, PolicyBatchFuture, PolicyFuture, sync_result,
};
use kvbm_offload::settlement::{PipelineFailureKind, PipelineLane, PipelineStage};
use kvbm_offload::source::{Precondition, PreconditionError};
use kvbm_offload::*;

/// A policy that panics when asked.
struct PanickingPolicy;

impl OffloadPolicy for PanickingPolicy {
    fn name(&self) -> &'static str {
        "panicking"
    }
    fn evaluate(&self, _ctx: &EvalContext) -> PolicyFuture {
        panic!("policy blew up")
    }
    fn evaluate_batch(&self, _ctxs: &[EvalContext]) -> PolicyBatchFuture {
        panic!("policy blew up")
    }
}

/// Passes everything; panics when a block is released (so the stage that drops a container
/// panics).
struct PanickingRelease;

impl OffloadPolicy for PanickingRelease {
    fn name(&self) -> &'static str {
        "panicking_release"
    }
    fn evaluate(&self, _ctx: &EvalContext) -> PolicyFuture {
        sync_result(true)
    }
    fn release(&self, _hashes: &[SequenceHash]) {
        panic!("release blew up")
    }
}

/// A presence checker that answers with an empty vector, whatever it is asked.
struct EmptyChecker;

impl PresenceChecker for EmptyChecker {
    fn has_blocks(
        &self,
        _blocks: Vec<(SequenceHash, Option<kvbm_logical::BlockDigest>)>,
    ) -> BoxFuture<Result<Vec<bool>, PolicyError>> {
        Box::pin(async { Ok(Vec::new()) })
    }
}

/// Asserts the pipeline failed with `kind`, refuses new work with that failure, and that
/// `shutdown_and_wait` returns.
async fn assert_lane_failed(p: &Pipeline<G1>, kind: PipelineFailureKind) {
    let f = p.failure().expect("the lane failed");
    assert_eq!(f.kind, kind, "{f}");
    assert_eq!(f.lane, PipelineLane::G1_TO_G2);
    match p.try_enqueue(external(900, 1), None) {
        Err(EnqueueError::Failed { failure, rejected }) => {
            assert_eq!(failure, f);
            assert_eq!(rejected.blocks.len(), 1, "the blocks are handed back");
        }
        other => panic!("expected Failed, got {other:?}"),
    }
    assert!(matches!(
        p.enqueue(external(901, 1), None).await,
        Err(OffloadError::PipelineFailed(_))
    ));
    within(1000, p.shutdown_and_wait())
        .await
        .expect("shutdown_and_wait returns");
}

/// Waits (bounded) for `h` and asserts every block failed with `PipelineFailed`.
async fn assert_failed_by_pipeline(h: &OffloadHandle, n: usize) {
    let r = within(1000, h.wait())
        .await
        .expect("the handle completes")
        .unwrap();
    assert_eq!(r.status, OffloadStatus::Failed, "{r:?}");
    assert_eq!(r.failed_blocks.len(), n, "{r:?}");
    assert_all_failed(&r, BlockFailureKind::PipelineFailed);
}

#[tokio::test(start_paused = true)]
async fn fail_closed_policy_panic() {
    let exec = TestExecutor::open();
    let p = spawn_g1_to_g2(exec.clone(), |b| {
        b.policy(Arc::new(PanickingPolicy)).min_batch_size(1)
    });
    let h = p.enqueue(external(0, 3), None).await.unwrap();
    assert_failed_by_pipeline(&h, 3).await;
    assert_lane_failed(
        &p,
        PipelineFailureKind::StagePanicked(PipelineStage::Policy),
    )
    .await;
    assert!(exec.batches().is_empty());
}

#[tokio::test(start_paused = true)]
async fn fail_closed_policy_checker_returns_wrong_length() {
    // A presence checker answering with an empty vector inside a composite policy (as the
    // object pipeline composes them): the verdict is refused, every block is filtered as a
    // policy error, nothing is transferred.
    let exec = TestExecutor::open();
    let policy = AllOfPolicy::new(vec![
        Arc::new(PassAllPolicy),
        Arc::new(ObjectPresenceFilter::new(Arc::new(EmptyChecker))),
    ]);
    let p = spawn_g1_to_g2(exec.clone(), |b| {
        b.policy(Arc::new(policy)).min_batch_size(1)
    });
    let h = p.enqueue(external(0, 3), None).await.unwrap();
    let r = within(1000, h.wait()).await.expect("completes").unwrap();
    assert_eq!(r.filtered_blocks.len(), 3, "{r:?}");
    assert!(r.completed_blocks.is_empty(), "{r:?}");
    assert!(exec.batches().is_empty(), "nothing was transferred");
    assert!(p.failure().is_none());
}

#[tokio::test(start_paused = true)]
async fn fail_closed_precondition_panic() {
    let exec = TestExecutor::open();
    let p = spawn_g1_to_g2(exec.clone(), |b| b.min_batch_size(1));
    // One container waits on a precondition that never fires; the next one's precondition
    // panics when polled.
    let (_keep, never) = Precondition::pair();
    let waiting = p.enqueue(external(0, 2), Some(never)).await.unwrap();
    let bomb = Precondition::new::<PreconditionError>(async { panic!("precondition blew up") });
    let boom = p.enqueue(external(10, 3), Some(bomb)).await.unwrap();
    assert_failed_by_pipeline(&boom, 3).await;
    assert_failed_by_pipeline(&waiting, 2).await;
    assert_lane_failed(
        &p,
        PipelineFailureKind::StagePanicked(PipelineStage::Precondition),
    )
    .await;
}

#[tokio::test(start_paused = true)]
async fn fail_closed_batcher_panic() {
    // The batcher drops a cancelled container from its open batch; the policy's release hook
    // panics there, inside the batcher.
    let exec = TestExecutor::open();
    let p = spawn_g1_to_g2(exec.clone(), |b| {
        b.policy(Arc::new(PanickingRelease))
            .batch_size(64)
            .min_batch_size(64)
            .flush_interval(Duration::from_secs(3600))
    });
    let (_keep, never) = Precondition::pair();
    let waiting = p.enqueue(external(100, 2), Some(never)).await.unwrap();
    let open = p.enqueue(external(0, 3), None).await.unwrap();
    tokio::time::sleep(Duration::from_millis(5)).await; // `open` sits in the open batch
    open.token().cancel();
    within(1000, open.wait()).await.expect("completes").unwrap();
    assert_failed_by_pipeline(&waiting, 2).await;
    assert_lane_failed(
        &p,
        PipelineFailureKind::StagePanicked(PipelineStage::Batcher),
    )
    .await;
    assert!(exec.batches().is_empty());
}

#[tokio::test(start_paused = true)]
async fn fail_closed_executor_panic() {
    struct Boom;
    impl<T: kvbm_logical::Tier> MoveExecutor<T> for Boom {
        type Output = ();
        async fn execute(&self, _batch: &ResolvedBatch<T>) -> BatchOutcome<()> {
            panic!("executor blew up")
        }
    }
    let p = spawn_g1_to_g2(Boom, |b| b.min_batch_size(1));
    let (_keep, never) = Precondition::pair();
    let waiting = p.enqueue(external(100, 2), Some(never)).await.unwrap();
    let h = p.enqueue(external(0, 2), None).await.unwrap();
    let r = within(1000, h.wait()).await.expect("completes").unwrap();
    assert_all_failed(&r, BlockFailureKind::ExecutorAborted);
    assert_failed_by_pipeline(&waiting, 2).await;
    assert_lane_failed(&p, PipelineFailureKind::ExecutorPanicked).await;
}

#[tokio::test(start_paused = true)]
async fn fail_closed_absurd_max_concurrent_transfers() {
    // A semaphore cannot hold usize::MAX permits: refused by validation, naming the key,
    // instead of a transfer stage that panics at start.
    let err = PipelineBuilder::<G1, G2>::new()
        .max_concurrent_transfers(usize::MAX)
        .build()
        .spawn(TestExecutor::open())
        .unwrap_err();
    match err {
        OffloadError::InvalidConfig(m) => assert!(m.contains("max_concurrent_transfers"), "{m}"),
        other => panic!("unexpected {other:?}"),
    }
    let ok = PipelineBuilder::<G1, G2>::new()
        .max_concurrent_transfers(MAX_CONCURRENT_TRANSFERS)
        .build()
        .spawn(TestExecutor::open());
    assert!(ok.is_ok());
}

#[test]
fn fail_closed_policy_timeout_zero_is_rejected() {
    let cfg: PipelineConfig = toml::from_str("policy_timeout_ms = 0").unwrap();
    match cfg.validate().unwrap_err() {
        OffloadError::InvalidConfig(m) => assert!(m.contains("policy_timeout_ms"), "{m}"),
        other => panic!("unexpected {other:?}"),
    }
    let obj = ObjectPipelineConfig {
        pipeline: cfg,
        ..Default::default()
    };
    assert!(obj.validate().is_err());
}

#[tokio::test(start_paused = true)]
async fn fail_closed_cancel_confirmed_while_downstream_is_full() {
    // Capacity 1 everywhere and a gated executor: the executor holds A, B fills the transfer
    // queue, C waits in the batcher, D fills the batch queue. F waits on its precondition in
    // the precondition stage, E (no precondition) is behind it. Cancelling F must be
    // confirmed at once although nothing can move downstream.
    let exec = TestExecutor::gated();
    let p = spawn_g1_to_g2(exec.clone(), |b| {
        b.batch_size(1)
            .min_batch_size(1)
            .queue_capacity(1)
            .max_concurrent_transfers(1)
    });
    let settle = || tokio::time::sleep(Duration::from_millis(1));
    let a = p.enqueue(external(0, 1), None).await.unwrap();
    exec.wait_started(1).await;
    let mut rest = Vec::new();
    for i in 1..4 {
        rest.push(p.enqueue(external(i, 1), None).await.unwrap());
        settle().await;
    }
    let (_keep, never) = Precondition::pair();
    let f = p.enqueue(external(50, 1), Some(never)).await.unwrap();
    settle().await;
    let e = within(100, p.enqueue(external(60, 1), None))
        .await
        .expect("room in the precondition queue")
        .unwrap();
    settle().await;
    within(100, f.cancel())
        .await
        .expect("the cancel is confirmed while every queue downstream is full");
    assert_eq!(
        f.wait().await.unwrap().cancelled_blocks,
        vec![hash(50)],
        "cancelled, not transferred"
    );
    exec.release(100);
    for h in std::iter::once(&a).chain(&rest).chain(std::iter::once(&e)) {
        let r = within(1000, h.wait()).await.expect("drains").unwrap();
        assert_eq!(r.completed_blocks.len(), 1);
    }
}

#[tokio::test(start_paused = true)]
async fn fail_closed_try_enqueue_is_bounded_and_hands_blocks_back() {
    // Every container waits on a precondition that never fires: nothing drains. The input and
    // every stage are bounded, so try_enqueue reports Full after a bounded number of
    // containers and hands the (strong) blocks back untouched.
    let g1 = manager::<G1>(200, None);
    let exec = TestExecutor::open();
    let mut cfg = PipelineConfig {
        queue_capacity: 2,
        max_concurrent_evaluations: 1,
        ..Default::default()
    };
    cfg.batch_config.min_batch_size = 1;
    let p = spawn_g1_to_g2(exec.clone(), |b| b.config(cfg));
    let mut keep = Vec::new();
    let mut accepted = 0;
    let mut full = None;
    for i in 0..100u32 {
        let (trigger, event) = Precondition::pair();
        keep.push(trigger);
        let blocks = registered(&g1, i * 2, 2);
        match p.try_enqueue(blocks, Some(event)) {
            Ok(_) => accepted += 1,
            Err(EnqueueError::Full(rejected)) => {
                full = Some((i, rejected));
                break;
            }
            Err(other) => panic!("unexpected {other:?}"),
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    let (i, rejected) = full.expect("the pipeline applied backpressure");
    // input 2 + policy outbox 1 + precondition queue 2 + waiting 2 (+ slack of one).
    assert!(accepted <= 8, "accepted {accepted} containers");
    let back: Vec<SequenceHash> = rejected
        .blocks
        .into_vec()
        .iter()
        .map(|b| b.sequence_hash())
        .collect();
    assert_eq!(back, vec![hash(i * 2), hash(i * 2 + 1)]);
    assert!(rejected.precondition.is_some());
}

#[tokio::test(start_paused = true)]
async fn fail_closed_enqueue_waits_for_room() {
    let exec = TestExecutor::gated();
    let p = spawn_g1_to_g2(exec.clone(), |b| {
        b.queue_capacity(1)
            .batch_size(1)
            .min_batch_size(1)
            .max_concurrent_transfers(1)
    });
    let mut handles = Vec::new();
    // Fill every place until an enqueue has to wait.
    let mut waited = None;
    for i in 0..50u32 {
        let mut fut = std::pin::pin!(p.enqueue(external(i, 1), None));
        match within(10, &mut fut).await {
            Some(h) => handles.push(h.unwrap()),
            None => {
                waited = Some(i);
                exec.release(1);
                handles.push(
                    within(1000, fut)
                        .await
                        .expect("room opened once a transfer finished")
                        .unwrap(),
                );
                break;
            }
        }
    }
    assert!(waited.is_some(), "enqueue never waited: input is unbounded");
    exec.release(100);
    for h in handles {
        within(1000, h.wait()).await.expect("drains").unwrap();
    }
}

#[tokio::test(start_paused = true)]
async fn fail_closed_sweeper_panic() {
    // A cancelled batch waiting in the transfer queue is dropped by the sweeper, where the
    // policy's release hook panics.
    let exec = TestExecutor::gated();
    let p = spawn_g1_to_g2(exec.clone(), |b| {
        b.policy(Arc::new(PanickingRelease)).min_batch_size(1)
    });
    let (_keep, never) = Precondition::pair();
    let waiting = p.enqueue(external(100, 2), Some(never)).await.unwrap();
    let running = p.enqueue(external(0, 1), None).await.unwrap();
    exec.wait_started(1).await;
    let queued = p.enqueue(external(10, 2), None).await.unwrap();
    tokio::time::sleep(Duration::from_millis(5)).await; // in the transfer queue
    queued.token().cancel();
    within(1000, queued.wait())
        .await
        .expect("completes")
        .unwrap();
    assert_failed_by_pipeline(&waiting, 2).await;
    let f = p.failure().expect("failed");
    assert_eq!(
        f.kind,
        PipelineFailureKind::StagePanicked(PipelineStage::Sweeper),
        "{f}"
    );
    // The committed transfer runs to its end (P3), then shutdown returns.
    exec.release(10);
    within(1000, running.wait())
        .await
        .expect("completes")
        .unwrap();
    assert_lane_failed(&p, f.kind).await;
}

#[tokio::test(start_paused = true)]
async fn fail_closed_transfer_stage_panic() {
    // The transfer stage's own loop panics: upgrading a batch whose weak block was evicted
    // releases it through the policy hook, which panics.
    let g1 = manager::<G1>(2, None);
    let strong = registered(&g1, 0, 1);
    let weak: Vec<_> = strong.iter().map(|b| b.downgrade()).collect();
    drop(strong);
    let _hog = g1.allocate_blocks(2).unwrap(); // evicts it
    let exec = TestExecutor::open();
    let p = spawn_g1_to_g2(exec.clone(), |b| {
        b.policy(Arc::new(PanickingRelease)).min_batch_size(1)
    });
    let (_keep, never) = Precondition::pair();
    let waiting = p.enqueue(external(100, 2), Some(never)).await.unwrap();
    let h = p.enqueue(weak, None).await.unwrap();
    within(1000, h.wait()).await.expect("completes").unwrap();
    assert_failed_by_pipeline(&waiting, 2).await;
    assert_lane_failed(
        &p,
        PipelineFailureKind::StagePanicked(PipelineStage::Transfer),
    )
    .await;
}
