//! The pipeline's metrics move by exactly what happened, observed through an in-memory recorder.

mod common;

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use common::*;
use kvbm_logical::{G1, G2, SequenceHash};
use kvbm_offload::metrics::*;
use kvbm_offload::policy::{EvalContext, PolicyFuture, sync_result};
use kvbm_offload::source::Precondition;
use kvbm_offload::*;

const P: (&str, &str) = (PIPELINE_LABEL, "g1_to_g2");

/// Rejects the listed hashes, synchronously.
struct Reject(HashSet<SequenceHash>);

impl OffloadPolicy for Reject {
    fn name(&self) -> &'static str {
        "reject"
    }
    fn evaluate(&self, ctx: &EvalContext) -> PolicyFuture {
        sync_result(!self.0.contains(&ctx.sequence_hash))
    }
}

/// Spawns a G1→G2 pipeline whose metrics go to `rec`.
fn spawn(
    rec: &TestRecorder,
    exec: TestExecutor,
    f: impl FnOnce(PipelineBuilder<G1, G2>) -> PipelineBuilder<G1, G2>,
) -> Pipeline<G1> {
    ::metrics::with_local_recorder(rec, || spawn_g1_to_g2(exec, f))
}

#[tokio::test(start_paused = true)]
async fn counts_enqueued_filtered_transferred_and_batches() {
    // 10 blocks, the policy rejects 3, one batch of 7 transfers.
    let rec = TestRecorder::default();
    let exec = TestExecutor::open();
    let rejected = Reject((0..3).map(hash).collect());
    let p = spawn(&rec, exec.clone(), |b| {
        b.policy(Arc::new(rejected)).min_batch_size(1)
    });
    let r = p
        .enqueue(external(0, 10), None)
        .await
        .unwrap()
        .wait()
        .await
        .unwrap();
    assert_eq!((r.filtered_blocks.len(), r.completed_blocks.len()), (3, 7));

    assert_eq!(rec.counter(BLOCKS_ENQUEUED, &[P]), 10);
    assert_eq!(
        rec.counter(BLOCKS_FILTERED, &[P, (REASON_LABEL, "policy")]),
        3
    );
    assert_eq!(rec.counter_total(BLOCKS_FILTERED), 3);
    assert_eq!(rec.counter(BLOCKS_TRANSFERRED, &[P]), 7);
    assert_eq!(rec.counter_total(BLOCKS_FAILED), 0);
    assert_eq!(rec.counter(BLOCKS_CANCELLED, &[P]), 0);
    assert_eq!(rec.counter(BATCHES_SUBMITTED, &[P]), 1);
    assert_eq!(rec.histogram(BATCH_SIZE, &[P]), vec![7.0]);
    assert_eq!(rec.counter(POLICY_TIMEOUTS, &[P]), 0);
    assert_eq!(rec.gauge(TRANSFERS_IN_FLIGHT, &[P]), 0.0);
    assert!(rec.histogram(CANCEL_CONFIRMATION_SECONDS, &[P]).is_empty());
}

#[tokio::test(start_paused = true)]
async fn counts_failures_by_reason() {
    let rec = TestRecorder::default();
    let exec = TestExecutor::open();
    exec.fail(hash(1));
    let p = spawn(&rec, exec, |b| b.min_batch_size(1));
    let (trigger, event) = Precondition::pair();
    let a = p.enqueue(external(0, 3), None).await.unwrap();
    let b = p.enqueue(external(10, 2), Some(event)).await.unwrap();
    trigger.fail("forward pass aborted");
    a.wait().await.unwrap();
    b.wait().await.unwrap();

    assert_eq!(rec.counter(BLOCKS_ENQUEUED, &[P]), 5);
    assert_eq!(rec.counter(BLOCKS_TRANSFERRED, &[P]), 2);
    assert_eq!(
        rec.counter(BLOCKS_FAILED, &[P, (REASON_LABEL, "transfer")]),
        1
    );
    assert_eq!(
        rec.counter(BLOCKS_FAILED, &[P, (REASON_LABEL, "precondition_failed")]),
        2
    );
    assert_eq!(rec.counter_total(BLOCKS_FAILED), 3);
    assert_eq!(rec.counter(BATCHES_SUBMITTED, &[P]), 1);
}

#[tokio::test(start_paused = true)]
async fn counts_duplicates_cancellation_and_in_flight() {
    let rec = TestRecorder::default();
    let exec = TestExecutor::gated();
    let p = spawn(&rec, exec.clone(), |b| b.min_batch_size(1));
    let a = p.enqueue(external(0, 2), None).await.unwrap();
    exec.wait_started(1).await;
    assert_eq!(
        rec.gauge(TRANSFERS_IN_FLIGHT, &[P]),
        1.0,
        "A is being executed"
    );
    // hash(1) is in flight already: filtered as a duplicate; hash(2) passes.
    let b = p.enqueue(external(1, 2), None).await.unwrap();
    let c = p.enqueue(external(10, 4), None).await.unwrap();
    tokio::time::sleep(Duration::from_millis(1)).await;
    within(50, c.cancel()).await.expect("C swept while queued");
    assert_eq!(rec.counter(BLOCKS_CANCELLED, &[P]), 4);
    assert_eq!(
        rec.histogram(CANCEL_CONFIRMATION_SECONDS, &[P]).len(),
        1,
        "one confirmation observed"
    );
    exec.release(10);
    a.wait().await.unwrap();
    b.wait().await.unwrap();

    assert_eq!(rec.counter(BLOCKS_ENQUEUED, &[P]), 8);
    assert_eq!(
        rec.counter(BLOCKS_FILTERED, &[P, (REASON_LABEL, "duplicate")]),
        1
    );
    assert_eq!(rec.counter(BLOCKS_TRANSFERRED, &[P]), 3);
    assert_eq!(rec.counter(BATCHES_SUBMITTED, &[P]), 2);
    assert_eq!(rec.histogram(BATCH_SIZE, &[P]), vec![2.0, 1.0]);
    assert_eq!(rec.gauge(TRANSFERS_IN_FLIGHT, &[P]), 0.0);
    // Every enqueued block has exactly one outcome.
    assert_eq!(
        rec.counter_total(BLOCKS_FILTERED)
            + rec.counter(BLOCKS_CANCELLED, &[P])
            + rec.counter(BLOCKS_TRANSFERRED, &[P])
            + rec.counter_total(BLOCKS_FAILED),
        8
    );
}

#[tokio::test(start_paused = true)]
async fn counts_policy_timeouts() {
    let rec = TestRecorder::default();
    let p = spawn(&rec, TestExecutor::open(), |b| {
        b.policy(Arc::new(GatedPolicy::default()))
            .policy_timeout(Duration::from_millis(100))
    });
    let r = p
        .enqueue(external(0, 4), None)
        .await
        .unwrap()
        .wait()
        .await
        .unwrap();
    assert_eq!(r.filtered_blocks.len(), 4);
    assert_eq!(rec.counter(POLICY_TIMEOUTS, &[P]), 1, "one evaluation");
    assert_eq!(
        rec.counter(BLOCKS_FILTERED, &[P, (REASON_LABEL, "policy_error")]),
        4
    );
    assert_eq!(rec.counter(BATCHES_SUBMITTED, &[P]), 0);
}

#[tokio::test(start_paused = true)]
async fn a_pipeline_reports_to_the_recorder_current_when_it_was_spawned() {
    // Handles are resolved once per pipeline: two pipelines, two recorders, no crosstalk.
    let (one, two) = (TestRecorder::default(), TestRecorder::default());
    let p1 = spawn(&one, TestExecutor::open(), |b| b.min_batch_size(1));
    let p2 = spawn(&two, TestExecutor::open(), |b| b.min_batch_size(1));
    p1.enqueue(external(0, 3), None)
        .await
        .unwrap()
        .wait()
        .await
        .unwrap();
    p2.enqueue(external(0, 5), None)
        .await
        .unwrap()
        .wait()
        .await
        .unwrap();
    assert_eq!(one.counter(BLOCKS_TRANSFERRED, &[P]), 3);
    assert_eq!(two.counter(BLOCKS_TRANSFERRED, &[P]), 5);
}

#[tokio::test(start_paused = true)]
async fn an_upward_lane_is_labelled_by_its_pair() {
    let rec = TestRecorder::default();
    let g2 = manager::<kvbm_logical::G2>(8, None);
    let p = ::metrics::with_local_recorder(&rec, || {
        spawn_g3_to_g2(TestExecutor::open(), |b| b.min_batch_size(1))
    });
    p.enqueue_into(external(0, 3), g2.allocate_blocks(3).unwrap(), None)
        .await
        .unwrap()
        .wait()
        .await
        .unwrap();
    let up = (PIPELINE_LABEL, "g3_to_g2");
    assert_eq!(rec.counter(BLOCKS_TRANSFERRED, &[up]), 3);
    assert_eq!(rec.counter(BLOCKS_TRANSFERRED, &[P]), 0);
}
