//! The pipeline's principles (P1–P6), cancellation at every stage, batching boundaries,
//! concurrency, duplicate suppression, settlement and progress — with a controllable executor.

mod common;

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use common::*;
use kvbm_logical::G1;
use kvbm_offload::cancel::CancelState;
use kvbm_offload::handle::{OffloadProgressCursor, OffloadStatus};
use kvbm_offload::settlement::{
    PipelineFailure, PipelineFailureKind, PipelineLane, SettlementError,
};
use kvbm_offload::source::Precondition;
use kvbm_offload::*;

#[tokio::test(start_paused = true)]
async fn p1_container_is_unit_of_cancellation() {
    // A 10-block container larger than the batch size (4) is never split: it waits as one
    // batch behind the committed one, and cancelling it drops all ten blocks together.
    let exec = TestExecutor::gated();
    let p = spawn_g1_to_g2(exec.clone(), |b| b.batch_size(4).min_batch_size(1));
    let first = p.enqueue(external(50, 2), None).await.unwrap();
    exec.wait_started(1).await;
    let a = p.enqueue(external(0, 10), None).await.unwrap();
    let b = p.enqueue(external(100, 2), None).await.unwrap();
    tokio::time::sleep(Duration::from_millis(1)).await;
    within(1000, a.cancel()).await.expect("confirmed");
    exec.release(100);
    let ra = a.wait().await.unwrap();
    assert!(ra.completed_blocks.is_empty(), "no piece of it transferred");
    let mut cancelled = ra.cancelled_blocks.clone();
    cancelled.sort();
    let mut expect = hashes(0, 10);
    expect.sort();
    assert_eq!(
        cancelled, expect,
        "every block of the container is cancelled with it"
    );
    assert_eq!(ra.status, OffloadStatus::Cancelled);
    first.wait().await.unwrap();
    let rb = b.wait().await.unwrap();
    assert_eq!(
        rb.completed_blocks,
        hashes(100, 2),
        "other containers are untouched"
    );
    assert_eq!(rb.status, OffloadStatus::Complete);
    assert!(
        exec.batches().iter().all(|b| !b.contains(&hash(0))),
        "the cancelled container never reached the executor"
    );
}

#[tokio::test(start_paused = true)]
async fn p2_token_travels_with_container() {
    // Cancelling a clone of the handle's token (not the handle) reaches the queued container:
    // containers carry the same token, not a copy of its state.
    let exec = TestExecutor::gated();
    let p = spawn_g1_to_g2(exec.clone(), |b| b.batch_size(2).min_batch_size(1));
    let first = p.enqueue(external(0, 2), None).await.unwrap();
    exec.wait_started(1).await;
    let second = p.enqueue(external(10, 2), None).await.unwrap();
    let token = second.token();
    assert_eq!(token.offload_id(), second.id());
    tokio::time::sleep(Duration::from_millis(1)).await;
    assert!(
        token.outstanding() > 0,
        "the queued container holds the token"
    );
    token.cancel();
    within(100, second.wait())
        .await
        .expect("the container saw the clone's cancel")
        .unwrap();
    assert_eq!(second.status(), OffloadStatus::Cancelled);
    exec.release(10);
    first.wait().await.unwrap();
    assert_eq!(
        exec.batches().len(),
        1,
        "the cancelled container never reached the executor"
    );
}

#[tokio::test(start_paused = true)]
async fn p3_upgrade_is_point_of_no_return() {
    let exec = TestExecutor::gated();
    let p = spawn_g1_to_g2(exec.clone(), |b| b.min_batch_size(1));
    let h = p.enqueue(external(0, 4), None).await.unwrap();
    exec.wait_started(1).await;
    assert_eq!(h.status(), OffloadStatus::Transferring);
    let mut confirm = std::pin::pin!(h.cancel().into_future());
    assert!(
        within(50, &mut confirm).await.is_none(),
        "confirmation must wait for the committed transfer"
    );
    assert_eq!(h.cancel_state(), Some(CancelState::Draining(1)));
    exec.release(1);
    within(100, confirm)
        .await
        .expect("confirmed once the transfer ended");
    let r = h.wait().await.unwrap();
    assert_eq!(
        r.completed_blocks,
        hashes(0, 4),
        "cancellation no longer applied"
    );
    assert!(r.cancelled_blocks.is_empty());
    assert_eq!(r.status, OffloadStatus::Complete);
}

#[tokio::test(start_paused = true)]
async fn p4_sweep_before_upgrade() {
    // With every other sweep disabled, the transfer stage's own sweep is the only thing that
    // stands between a cancelled queued batch and the executor.
    let exec = TestExecutor::gated();
    let mut cfg = PipelineConfig {
        sweep_on_cancel: false,
        sweep_interval: Duration::from_secs(3600),
        ..Default::default()
    };
    cfg.batch_config.min_batch_size = 1;
    let p = spawn_g1_to_g2(exec.clone(), |b| b.config(cfg));
    let a = p.enqueue(external(0, 2), None).await.unwrap();
    exec.wait_started(1).await;
    let b = p.enqueue(external(10, 2), None).await.unwrap();
    tokio::time::sleep(Duration::from_millis(5)).await; // b reaches the transfer queue
    b.token().cancel();
    exec.release(10);
    a.wait().await.unwrap();
    let rb = b.wait().await.unwrap();
    assert_eq!(rb.cancelled_blocks, hashes(10, 2));
    assert!(rb.completed_blocks.is_empty());
    assert_eq!(
        exec.batches().len(),
        1,
        "the cancelled batch was swept before upgrade"
    );
}

#[tokio::test(start_paused = true)]
async fn p5_flat_map_after_upgrade() {
    let exec = TestExecutor::open();
    let p = spawn_g1_to_g2(exec.clone(), |b| b.batch_size(64).min_batch_size(9));
    let mut hs = Vec::new();
    for i in 0..3 {
        hs.push(p.enqueue(external(i * 10, 3), None).await.unwrap());
    }
    for (i, h) in hs.iter().enumerate() {
        let r = h.wait().await.unwrap();
        assert_eq!(r.completed_blocks, hashes(i as u32 * 10, 3));
    }
    let batches = exec.batches();
    assert_eq!(batches.len(), 1, "three containers, one transfer");
    let expect: Vec<_> = (0..3).flat_map(|i| hashes(i * 10, 3)).collect();
    assert_eq!(
        batches[0], expect,
        "one flat vector of every container's blocks, in order"
    );
}

#[tokio::test(start_paused = true)]
async fn p6_precondition_wait_selects_on_cancel() {
    let exec = TestExecutor::open();
    let p = spawn_g1_to_g2(exec.clone(), |b| b.min_batch_size(1));
    let (trigger, event) = Precondition::pair();
    let h = p.enqueue(external(0, 3), Some(event)).await.unwrap();
    tokio::time::sleep(Duration::from_millis(1)).await;
    assert_eq!(h.status(), OffloadStatus::Queued);
    within(50, h.cancel())
        .await
        .expect("cancel interrupts the precondition wait");
    assert_eq!(h.wait().await.unwrap().cancelled_blocks, hashes(0, 3));
    assert_eq!(p.pending_blocks(), 0);
    trigger.complete();
    tokio::time::sleep(Duration::from_millis(20)).await;
    assert!(exec.batches().is_empty());
}

#[tokio::test(start_paused = true)]
async fn precondition_gates_batching_and_failure_fails_blocks() {
    let exec = TestExecutor::open();
    let p = spawn_g1_to_g2(exec.clone(), |b| b.min_batch_size(1));
    let (ok_trigger, ok_event) = Precondition::pair();
    let (bad_trigger, bad_event) = Precondition::pair();
    let ok = p.enqueue(external(0, 2), Some(ok_event)).await.unwrap();
    let bad = p.enqueue(external(10, 2), Some(bad_event)).await.unwrap();
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert!(
        exec.batches().is_empty(),
        "nothing moves before the forward pass is done"
    );
    ok_trigger.complete();
    bad_trigger.fail("forward pass aborted");
    assert_eq!(ok.wait().await.unwrap().completed_blocks, hashes(0, 2));
    let r = bad.wait().await.unwrap();
    assert_eq!(r.status, OffloadStatus::Failed);
    assert_all_failed(&r, BlockFailureKind::PreconditionFailed);
}

#[tokio::test(start_paused = true)]
async fn cancel_while_evaluating() {
    let policy = GatedPolicy::default();
    let exec = TestExecutor::open();
    let p = spawn_g1_to_g2(exec.clone(), |b| {
        b.policy(Arc::new(policy.clone()))
            .policy_timeout(Duration::from_secs(60))
    });
    let h = p.enqueue(external(0, 4), None).await.unwrap();
    tokio::time::sleep(Duration::from_millis(1)).await;
    assert_eq!(policy.asked.load(Ordering::Acquire), 4);
    assert_eq!(h.status(), OffloadStatus::Evaluating);
    within(50, h.cancel())
        .await
        .expect("cancelled during evaluation");
    assert_eq!(h.wait().await.unwrap().cancelled_blocks.len(), 4);
    assert!(exec.batches().is_empty());
}

#[tokio::test(start_paused = true)]
async fn policy_timeout_filters_blocks() {
    let policy = GatedPolicy::default();
    let exec = TestExecutor::open();
    let p = spawn_g1_to_g2(exec.clone(), |b| {
        b.policy(Arc::new(policy))
            .policy_timeout(Duration::from_millis(100))
    });
    let h = p.enqueue(external(0, 4), None).await.unwrap();
    let r = within(150, h.wait())
        .await
        .expect("timeout applied")
        .unwrap();
    assert_eq!(r.filtered_blocks, hashes(0, 4));
    assert_eq!(r.status, OffloadStatus::Complete);
}

#[tokio::test(start_paused = true)]
async fn cancel_while_queued_does_not_wait_for_running_transfer() {
    let exec = TestExecutor::gated();
    let p = spawn_g1_to_g2(exec.clone(), |b| b.min_batch_size(1));
    let a = p.enqueue(external(0, 2), None).await.unwrap();
    exec.wait_started(1).await;
    let b = p.enqueue(external(10, 2), None).await.unwrap();
    tokio::time::sleep(Duration::from_millis(1)).await;
    assert_eq!(b.status(), OffloadStatus::Queued);
    within(5, b.cancel())
        .await
        .expect("swept from the queue while A still runs");
    assert_eq!(a.status(), OffloadStatus::Transferring);
    exec.release(1);
    a.wait().await.unwrap();
    assert_eq!(exec.batches().len(), 1);
}

#[tokio::test(start_paused = true)]
async fn cancel_while_batched_before_flush() {
    let exec = TestExecutor::open();
    let p = spawn_g1_to_g2(exec.clone(), |b| {
        b.min_batch_size(32).flush_interval(Duration::from_secs(10))
    });
    let h = p.enqueue(external(0, 4), None).await.unwrap();
    tokio::time::sleep(Duration::from_millis(1)).await;
    within(5, h.cancel())
        .await
        .expect("the batcher sweeps its open batch");
    assert_eq!(h.wait().await.unwrap().cancelled_blocks.len(), 4);
    tokio::time::sleep(Duration::from_secs(11)).await;
    assert!(exec.batches().is_empty());
}

#[tokio::test(start_paused = true)]
async fn confirmation_only_after_release() {
    let g1 = manager::<G1>(8, None);
    let blocks = registered(&g1, 0, 4);
    let probe = blocks[0].clone();
    let exec = TestExecutor::gated();
    let p = spawn_g1_to_g2(exec.clone(), |b| b.min_batch_size(1));
    let running = p.enqueue(external(50, 1), None).await.unwrap();
    exec.wait_started(1).await;
    let h = p.enqueue(blocks, None).await.unwrap();
    tokio::time::sleep(Duration::from_millis(1)).await;
    assert_eq!(
        probe.strong_count(),
        2,
        "the queued container holds a strong reference"
    );
    assert!(p.is_pending(probe.sequence_hash()));
    h.cancel().await;
    assert_eq!(
        probe.strong_count(),
        1,
        "confirmed only after the pipeline released the block"
    );
    assert!(
        !p.is_pending(probe.sequence_hash()),
        "and its pending entry"
    );
    assert_eq!(h.cancel_state(), Some(CancelState::Confirmed));
    exec.release(1);
    running.wait().await.unwrap();
}

#[tokio::test(start_paused = true)]
async fn weak_block_evicted_before_upgrade_fails_as_evicted() {
    let g1 = manager::<G1>(2, None);
    let strong = registered(&g1, 0, 2);
    let weak: Vec<_> = strong.iter().map(|b| b.downgrade()).collect();
    drop(strong);
    // Evict both by allocating every block.
    let _hog = g1.allocate_blocks(2).unwrap();
    let exec = TestExecutor::open();
    let p = spawn_g1_to_g2(exec.clone(), |b| b.min_batch_size(1));
    let r = p.enqueue(weak, None).await.unwrap().wait().await.unwrap();
    assert_eq!(r.failed_blocks.len(), 2);
    assert_all_failed(&r, BlockFailureKind::Evicted);
    assert!(exec.batches().iter().all(Vec::is_empty));
}

#[tokio::test(start_paused = true)]
async fn fail_closed_oversized_container_is_its_own_batch() {
    // Seed 000, P1: a container is never split. One larger than max_batch_size is one batch.
    let exec = TestExecutor::open();
    let p = spawn_g1_to_g2(exec.clone(), |b| b.batch_size(64).min_batch_size(8));
    let r = p
        .enqueue(external(0, 150), None)
        .await
        .unwrap()
        .wait()
        .await
        .unwrap();
    assert_eq!(r.completed_blocks.len(), 150);
    assert_eq!(exec.sizes(), vec![150]);
}

#[tokio::test(start_paused = true)]
async fn fail_closed_container_that_does_not_fit_closes_the_open_batch() {
    // 3 blocks open a batch (min 8 not reached); 6 more do not fit max 8: the open batch is
    // flushed as it is and the 6 start the next one, instead of 5 + 1 pieces.
    let exec = TestExecutor::open();
    let p = spawn_g1_to_g2(exec.clone(), |b| {
        b.batch_size(8)
            .min_batch_size(8)
            .flush_interval(Duration::from_millis(10))
    });
    let a = p.enqueue(external(0, 3), None).await.unwrap();
    tokio::time::sleep(Duration::from_millis(1)).await;
    let b = p.enqueue(external(10, 6), None).await.unwrap();
    within(1000, a.wait()).await.unwrap().unwrap();
    within(1000, b.wait()).await.unwrap().unwrap();
    assert_eq!(exec.sizes(), vec![3, 6]);
    let batches = exec.batches();
    assert_eq!(batches[1], hashes(10, 6), "the container stayed whole");
}

#[tokio::test(start_paused = true)]
async fn batch_min_collects_until_reached() {
    let exec = TestExecutor::open();
    let p = spawn_g1_to_g2(exec.clone(), |b| {
        b.min_batch_size(8)
            .flush_interval(Duration::from_millis(10))
    });
    let a = p.enqueue(external(0, 3), None).await.unwrap();
    tokio::time::sleep(Duration::from_millis(5)).await;
    assert!(exec.batches().is_empty(), "3 < min: waits");
    let b = p.enqueue(external(10, 5), None).await.unwrap();
    tokio::time::sleep(Duration::from_millis(1)).await;
    assert_eq!(
        exec.sizes(),
        vec![8],
        "min reached: flushed before the timer"
    );
    a.wait().await.unwrap();
    b.wait().await.unwrap();
}

#[tokio::test(start_paused = true)]
async fn batch_flush_timer_sends_partial_batch() {
    let exec = TestExecutor::open();
    let p = spawn_g1_to_g2(exec.clone(), |b| {
        b.min_batch_size(8)
            .flush_interval(Duration::from_millis(10))
    });
    let start = tokio::time::Instant::now();
    let h = p.enqueue(external(0, 3), None).await.unwrap();
    tokio::time::sleep(Duration::from_millis(9)).await;
    assert!(exec.batches().is_empty());
    h.wait().await.unwrap();
    assert_eq!(exec.sizes(), vec![3]);
    let waited = start.elapsed();
    assert!(
        waited >= Duration::from_millis(10) && waited < Duration::from_millis(12),
        "{waited:?}"
    );
}

#[tokio::test(start_paused = true)]
async fn concurrency_limit_is_respected() {
    let exec = TestExecutor::gated();
    let p = spawn_g1_to_g2(exec.clone(), |b| {
        b.batch_size(2)
            .min_batch_size(2)
            .max_concurrent_transfers(2)
    });
    let mut hs = Vec::new();
    for i in 0..6 {
        hs.push(p.enqueue(external(i * 10, 2), None).await.unwrap());
    }
    exec.wait_started(2).await;
    tokio::time::sleep(Duration::from_millis(20)).await;
    assert_eq!(exec.batches().len(), 2, "a third batch waits for a slot");
    exec.release(100);
    for h in hs {
        h.wait().await.unwrap();
    }
    assert_eq!(exec.batches().len(), 6);
    assert_eq!(exec.inner.max_inflight.load(Ordering::Acquire), 2);
}

#[tokio::test(start_paused = true)]
async fn duplicates_in_flight_are_suppressed() {
    let exec = TestExecutor::gated();
    let p = spawn_g1_to_g2(exec.clone(), |b| b.min_batch_size(1));
    let a = p.enqueue(external(0, 2), None).await.unwrap();
    let b = p
        .enqueue(
            vec![
                ExternalBlock::new(1, hash(1)),
                ExternalBlock::new(2, hash(2)),
            ],
            None,
        )
        .await
        .unwrap();
    exec.release(10);
    let ra = a.wait().await.unwrap();
    let rb = b.wait().await.unwrap();
    assert_eq!(ra.completed_blocks, hashes(0, 2));
    assert_eq!(rb.filtered_blocks, vec![hash(1)], "in flight already");
    assert_eq!(rb.completed_blocks, vec![hash(2)]);
    assert_eq!(
        p.pending_blocks(),
        0,
        "pending entries released after completion"
    );
    // Once settled it can be offloaded again (presence is the policy's business).
    let c = p.enqueue(external(1, 1), None).await.unwrap();
    assert_eq!(c.wait().await.unwrap().completed_blocks, vec![hash(1)]);
}

#[tokio::test(start_paused = true)]
async fn failed_blocks_are_reported_with_reason() {
    let exec = TestExecutor::open();
    exec.fail(hash(1));
    let p = spawn_g1_to_g2(exec.clone(), |b| b.min_batch_size(1));
    let r = p
        .enqueue(external(0, 3), None)
        .await
        .unwrap()
        .wait()
        .await
        .unwrap();
    assert_eq!(r.status, OffloadStatus::Failed);
    assert_eq!(r.completed_blocks, vec![hash(0), hash(2)]);
    assert_eq!(r.failed_blocks.len(), 1);
    assert_eq!(r.failed_blocks[0].0, hash(1));
    assert_eq!(r.failed_blocks[0].1.kind, BlockFailureKind::Transfer);
    assert!(r.failed_blocks[0].1.message.contains("injected"));
}

#[tokio::test(start_paused = true)]
async fn progress_cursor_reads_incrementally_and_timing_is_recorded() {
    let exec = TestExecutor::gated();
    let p = spawn_g1_to_g2(exec.clone(), |b| b.batch_size(2).min_batch_size(2));
    // The fifth block repeats the first: filtered at once as a duplicate in flight.
    let mut blocks = external(0, 4);
    blocks.push(blocks[0]);
    let h = p.enqueue(blocks, None).await.unwrap();
    let mut cursor = OffloadProgressCursor::default();
    exec.wait_started(1).await;
    let d0 = h.progress_since(&mut cursor);
    assert_eq!(d0.filtered, vec![hash(0)]);
    assert!(d0.completed.is_empty());
    assert!(h.progress_since(&mut cursor).is_empty());
    exec.release(1);
    h.wait().await.unwrap();
    let d1 = h.progress_since(&mut cursor);
    assert_eq!(d1.completed, hashes(0, 4));
    assert!(d1.filtered.is_empty());
    assert!(h.progress_since(&mut cursor).is_empty());
    let counts = h.counts();
    assert_eq!(
        (
            counts.total,
            counts.passed,
            counts.completed,
            counts.remaining()
        ),
        (5, 4, 4, 0)
    );
    let t = h.timing(hash(3)).expect("timing recorded");
    assert!(t.evaluated.is_some() && t.batched.is_some() && t.upgraded.is_some());
    assert!(t.total().is_some());
}

#[tokio::test(start_paused = true)]
async fn settlement_waits_for_batches_before_the_token_only() {
    let exec = TestExecutor::gated();
    let p = spawn_g1_to_g2(exec.clone(), |b| b.min_batch_size(1));
    let a = p.enqueue(external(0, 1), None).await.unwrap();
    exec.wait_started(1).await;
    let token = p.settlement_token();
    assert_eq!(token.target().get(PipelineLane::G1_TO_G2), 1);
    let later = p.enqueue(external(10, 1), None).await.unwrap();
    assert!(
        within(20, p.wait_settled(&token)).await.is_none(),
        "A has not settled"
    );
    exec.release(1);
    within(100, p.wait_settled(&token))
        .await
        .expect("settles")
        .unwrap();
    assert!(a.is_done());
    assert!(!later.is_done(), "a later batch is not waited for");
    exec.release(1);
    later.wait().await.unwrap();
}

#[tokio::test(start_paused = true)]
async fn fail_closed_settlement_counts_transfer_batches() {
    // Seed 000: "SettlementTarget: expected completed transfer batches for each pipeline lane".
    // Three enqueues that travel as one batch are one batch in the target, not three.
    let exec = TestExecutor::gated();
    let p = spawn_g1_to_g2(exec.clone(), |b| b.batch_size(6).min_batch_size(6));
    for i in 0..3 {
        p.enqueue(external(i * 10, 2), None).await.unwrap();
    }
    exec.wait_started(1).await;
    assert_eq!(exec.sizes(), vec![6]);
    let token = p.settlement_token();
    assert_eq!(token.target().get(PipelineLane::G1_TO_G2), 1);
    assert_eq!(p.settled(), 0);
    exec.release(1);
    within(100, p.wait_settled(&token)).await.unwrap().unwrap();
    assert_eq!(p.settled(), 1);
}

/// Panics on the batch holding `hash(666)`, transfers the others.
struct PanicOn666;

impl<T: kvbm_logical::Tier> MoveExecutor<T> for PanicOn666 {
    type Output = ();
    async fn execute(&self, batch: &ResolvedBatch<T>) -> BatchOutcome<()> {
        tokio::task::yield_now().await;
        if batch.sequence_hashes().contains(&hash(666)) {
            panic!("executor blew up");
        }
        (0..batch.len()).map(|_| Ok(())).collect()
    }
}

#[tokio::test(start_paused = true)]
async fn fail_closed_failure_does_not_poison_settled_tokens() {
    let p = spawn_g1_to_g2(PanicOn666, |b| b.min_batch_size(1));
    let a = p.enqueue(external(0, 2), None).await.unwrap();
    a.wait().await.unwrap();
    let settled = p.settlement_token();
    assert_eq!(settled.target().get(PipelineLane::G1_TO_G2), 1);
    let bad = p.enqueue(external(666, 1), None).await.unwrap();
    let r = within(1000, bad.wait()).await.expect("completes").unwrap();
    assert_all_failed(&r, BlockFailureKind::ExecutorAborted);
    let after = p.settlement_token();
    assert!(p.failure().is_some(), "the lane failed");
    within(100, p.wait_settled(&settled))
        .await
        .expect("answers at once")
        .expect("a token met before the failure stays met");
    let err = within(100, p.wait_settled(&after))
        .await
        .expect("answers at once")
        .unwrap_err();
    assert!(matches!(
        err,
        SettlementError::Failed(PipelineFailure {
            kind: PipelineFailureKind::ExecutorPanicked,
            ..
        })
    ));
}

struct PanickingExecutor;

impl<T: kvbm_logical::Tier> MoveExecutor<T> for PanickingExecutor {
    type Output = ();
    async fn execute(&self, _batch: &ResolvedBatch<T>) -> BatchOutcome<()> {
        panic!("executor blew up")
    }
}

#[tokio::test(start_paused = true)]
async fn settlement_reports_executor_failure() {
    let p = spawn_g1_to_g2(PanickingExecutor, |b| b.min_batch_size(1));
    let h = p.enqueue(external(0, 2), None).await.unwrap();
    tokio::time::sleep(Duration::from_millis(1)).await; // dispatched
    let token = p.settlement_token();
    assert_eq!(token.target().get(PipelineLane::G1_TO_G2), 1);
    let err = p.wait_settled(&token).await.unwrap_err();
    match err {
        SettlementError::Failed(f) => {
            assert_eq!(f.kind, PipelineFailureKind::ExecutorPanicked);
            assert_eq!(f.lane, PipelineLane::G1_TO_G2);
        }
        other => panic!("unexpected {other:?}"),
    }
    let r = h.wait().await.unwrap();
    assert_all_failed(&r, BlockFailureKind::ExecutorAborted);
}

#[tokio::test(start_paused = true)]
async fn shutdown_drains_and_refuses_new_work() {
    let exec = TestExecutor::open();
    let p = spawn_g1_to_g2(exec.clone(), |b| b.min_batch_size(50));
    let h = p.enqueue(external(0, 5), None).await.unwrap();
    p.shutdown_and_wait().await;
    assert_eq!(
        h.wait().await.unwrap().completed_blocks.len(),
        5,
        "drained on shutdown"
    );
    assert_eq!(
        p.enqueue(external(10, 1), None).await.unwrap_err(),
        OffloadError::PipelineClosed
    );
}

#[tokio::test(start_paused = true)]
async fn policy_release_sees_every_passed_block_once() {
    let policy = GatedPolicy::default();
    policy.gate.add_permits(1000);
    let exec = TestExecutor::gated();
    let p = spawn_g1_to_g2(exec.clone(), |b| {
        b.policy(Arc::new(policy.clone())).min_batch_size(1)
    });
    let a = p.enqueue(external(0, 2), None).await.unwrap();
    exec.wait_started(1).await;
    let b = p.enqueue(external(10, 2), None).await.unwrap();
    tokio::time::sleep(Duration::from_millis(1)).await;
    b.cancel().await;
    exec.release(1);
    a.wait().await.unwrap();
    let mut released = policy.released.lock().clone();
    released.sort();
    let mut expect: Vec<_> = hashes(0, 2).into_iter().chain(hashes(10, 2)).collect();
    expect.sort();
    assert_eq!(released, expect);
}
