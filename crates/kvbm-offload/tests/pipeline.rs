//! The pipeline's principles (P1–P6), cancellation at every stage, batching boundaries,
//! concurrency, duplicate suppression, settlement and progress — with a controllable executor.

mod common;

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use common::*;
use kvbm_logical::G1;
use kvbm_offload::*;

#[tokio::test(start_paused = true)]
async fn p1_container_is_unit_of_cancellation() {
    // One transfer of 10 blocks split into batches of 4: the first batch is committed and held
    // by the executor; cancelling then drops *every* other piece of the container together.
    let exec = TestExecutor::gated();
    let p = spawn_g1_to_g2(exec.clone(), |b| b.batch_size(4).min_batch_size(1));
    let a = p.enqueue(external(0, 10), None).unwrap();
    let b = p.enqueue(external(100, 2), None).unwrap();
    exec.wait_started(1).await;
    let confirm = a.cancel();
    exec.release(100);
    within(1000, confirm).await.expect("confirmed");
    let ra = a.wait().await.unwrap();
    assert_eq!(
        ra.completed_blocks,
        hashes(0, 4),
        "only the committed piece transferred"
    );
    let mut cancelled = ra.cancelled_blocks.clone();
    cancelled.sort();
    let mut expect = hashes(4, 6);
    expect.sort();
    assert_eq!(
        cancelled, expect,
        "every other block of the container is cancelled with it"
    );
    assert_eq!(ra.status, TransferStatus::Cancelled);
    let rb = b.wait().await.unwrap();
    assert_eq!(
        rb.completed_blocks,
        hashes(100, 2),
        "other containers are untouched"
    );
    assert_eq!(rb.status, TransferStatus::Complete);
}

#[tokio::test(start_paused = true)]
async fn p2_token_travels_with_container() {
    // Cancelling a clone of the handle's token (not the handle) reaches the queued container:
    // containers carry the same token, not a copy of its state.
    let exec = TestExecutor::gated();
    let p = spawn_g1_to_g2(exec.clone(), |b| b.batch_size(2).min_batch_size(1));
    let first = p.enqueue(external(0, 2), None).unwrap();
    exec.wait_started(1).await;
    let second = p.enqueue(external(10, 2), None).unwrap();
    let token = second.token();
    assert_eq!(token.transfer_id(), second.id());
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
    assert_eq!(second.status(), TransferStatus::Cancelled);
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
    let h = p.enqueue(external(0, 4), None).unwrap();
    exec.wait_started(1).await;
    assert_eq!(h.status(), TransferStatus::Transferring);
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
    assert_eq!(r.status, TransferStatus::Complete);
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
    let a = p.enqueue(external(0, 2), None).unwrap();
    exec.wait_started(1).await;
    let b = p.enqueue(external(10, 2), None).unwrap();
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
    let hs: Vec<_> = (0..3)
        .map(|i| p.enqueue(external(i * 10, 3), None).unwrap())
        .collect();
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
    let h = p.enqueue(external(0, 3), Some(event)).unwrap();
    tokio::time::sleep(Duration::from_millis(1)).await;
    assert_eq!(h.status(), TransferStatus::Queued);
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
    let ok = p.enqueue(external(0, 2), Some(ok_event)).unwrap();
    let bad = p.enqueue(external(10, 2), Some(bad_event)).unwrap();
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert!(
        exec.batches().is_empty(),
        "nothing moves before the forward pass is done"
    );
    ok_trigger.complete();
    bad_trigger.fail("forward pass aborted");
    assert_eq!(ok.wait().await.unwrap().completed_blocks, hashes(0, 2));
    let r = bad.wait().await.unwrap();
    assert_eq!(r.status, TransferStatus::Failed);
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
    let h = p.enqueue(external(0, 4), None).unwrap();
    tokio::time::sleep(Duration::from_millis(1)).await;
    assert_eq!(policy.asked.load(Ordering::Acquire), 4);
    assert_eq!(h.status(), TransferStatus::Evaluating);
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
    let h = p.enqueue(external(0, 4), None).unwrap();
    let r = within(150, h.wait())
        .await
        .expect("timeout applied")
        .unwrap();
    assert_eq!(r.filtered_blocks, hashes(0, 4));
    assert_eq!(r.status, TransferStatus::Complete);
}

#[tokio::test(start_paused = true)]
async fn cancel_while_queued_does_not_wait_for_running_transfer() {
    let exec = TestExecutor::gated();
    let p = spawn_g1_to_g2(exec.clone(), |b| b.min_batch_size(1));
    let a = p.enqueue(external(0, 2), None).unwrap();
    exec.wait_started(1).await;
    let b = p.enqueue(external(10, 2), None).unwrap();
    tokio::time::sleep(Duration::from_millis(1)).await;
    assert_eq!(b.status(), TransferStatus::Queued);
    within(5, b.cancel())
        .await
        .expect("swept from the queue while A still runs");
    assert_eq!(a.status(), TransferStatus::Transferring);
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
    let h = p.enqueue(external(0, 4), None).unwrap();
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
    let running = p.enqueue(external(50, 1), None).unwrap();
    exec.wait_started(1).await;
    let h = p.enqueue(blocks, None).unwrap();
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
    let r = p.enqueue(weak, None).unwrap().wait().await.unwrap();
    assert_eq!(r.failed_blocks.len(), 2);
    assert_all_failed(&r, BlockFailureKind::Evicted);
    assert!(exec.batches().iter().all(Vec::is_empty));
}

#[tokio::test(start_paused = true)]
async fn batch_max_splits_large_container() {
    let exec = TestExecutor::open();
    let p = spawn_g1_to_g2(exec.clone(), |b| b.batch_size(64).min_batch_size(8));
    let r = p
        .enqueue(external(0, 150), None)
        .unwrap()
        .wait()
        .await
        .unwrap();
    assert_eq!(r.completed_blocks.len(), 150);
    assert_eq!(exec.sizes(), vec![64, 64, 22]);
}

#[tokio::test(start_paused = true)]
async fn batch_min_collects_until_reached() {
    let exec = TestExecutor::open();
    let p = spawn_g1_to_g2(exec.clone(), |b| {
        b.min_batch_size(8)
            .flush_interval(Duration::from_millis(10))
    });
    let a = p.enqueue(external(0, 3), None).unwrap();
    tokio::time::sleep(Duration::from_millis(5)).await;
    assert!(exec.batches().is_empty(), "3 < min: waits");
    let b = p.enqueue(external(10, 5), None).unwrap();
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
    let h = p.enqueue(external(0, 3), None).unwrap();
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
    let h = p.enqueue(external(0, 12), None).unwrap();
    exec.wait_started(2).await;
    tokio::time::sleep(Duration::from_millis(20)).await;
    assert_eq!(exec.batches().len(), 2, "a third batch waits for a slot");
    exec.release(100);
    h.wait().await.unwrap();
    assert_eq!(exec.batches().len(), 6);
    assert_eq!(exec.inner.max_inflight.load(Ordering::Acquire), 2);
}

#[tokio::test(start_paused = true)]
async fn duplicates_in_flight_are_suppressed() {
    let exec = TestExecutor::gated();
    let p = spawn_g1_to_g2(exec.clone(), |b| b.min_batch_size(1));
    let a = p.enqueue(external(0, 2), None).unwrap();
    let b = p
        .enqueue(
            vec![
                ExternalBlock::new(1, hash(1)),
                ExternalBlock::new(2, hash(2)),
            ],
            None,
        )
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
    let c = p.enqueue(external(1, 1), None).unwrap();
    assert_eq!(c.wait().await.unwrap().completed_blocks, vec![hash(1)]);
}

#[tokio::test(start_paused = true)]
async fn failed_blocks_are_reported_with_reason() {
    let exec = TestExecutor::open();
    exec.fail(hash(1));
    let p = spawn_g1_to_g2(exec.clone(), |b| b.min_batch_size(1));
    let r = p
        .enqueue(external(0, 3), None)
        .unwrap()
        .wait()
        .await
        .unwrap();
    assert_eq!(r.status, TransferStatus::Failed);
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
    let h = p.enqueue(external(0, 4), None).unwrap();
    let mut cursor = TransferProgressCursor::default();
    exec.wait_started(1).await;
    assert!(h.progress_since(&mut cursor).is_empty());
    exec.release(1);
    exec.wait_started(2).await;
    let d1 = h.progress_since(&mut cursor);
    assert_eq!(d1.completed, hashes(0, 2));
    exec.release(1);
    h.wait().await.unwrap();
    let d2 = h.progress_since(&mut cursor);
    assert_eq!(d2.completed, hashes(2, 2));
    assert!(h.progress_since(&mut cursor).is_empty());
    let counts = h.counts();
    assert_eq!(
        (
            counts.total,
            counts.passed,
            counts.completed,
            counts.remaining()
        ),
        (4, 4, 4, 0)
    );
    let t = h.timing(hash(3)).expect("timing recorded");
    assert!(t.evaluated.is_some() && t.batched.is_some() && t.upgraded.is_some());
    assert!(t.total().is_some());
}

#[tokio::test(start_paused = true)]
async fn settlement_waits_for_submissions_before_the_token_only() {
    let exec = TestExecutor::gated();
    let p = spawn_g1_to_g2(exec.clone(), |b| b.min_batch_size(1));
    let a = p.enqueue(external(0, 1), None).unwrap();
    let token = p.settlement_token();
    assert_eq!(token.target().get(PipelineLane::G1ToG2), 1);
    exec.wait_started(1).await;
    let later = p.enqueue(external(10, 1), None).unwrap();
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
    assert!(!later.is_done(), "a later submission is not waited for");
    exec.release(1);
    later.wait().await.unwrap();
}

struct PanickingExecutor;

impl<T: kvbm_logical::Tier> TransferExecutor<T> for PanickingExecutor {
    type Output = ();
    async fn execute(&self, _batch: &ResolvedBatch<T>) -> BatchOutcome<()> {
        panic!("executor blew up")
    }
}

#[tokio::test(start_paused = true)]
async fn settlement_reports_executor_failure() {
    let p = spawn_g1_to_g2(PanickingExecutor, |b| b.min_batch_size(1));
    let h = p.enqueue(external(0, 2), None).unwrap();
    let token = p.settlement_token();
    let err = p.wait_settled(&token).await.unwrap_err();
    match err {
        SettlementError::Failed(f) => {
            assert_eq!(f.kind, PipelineFailureKind::ExecutorPanicked);
            assert_eq!(f.lane, PipelineLane::G1ToG2);
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
    let h = p.enqueue(external(0, 5), None).unwrap();
    p.shutdown_and_wait().await;
    assert_eq!(
        h.wait().await.unwrap().completed_blocks.len(),
        5,
        "drained on shutdown"
    );
    assert_eq!(
        p.enqueue(external(10, 1), None).unwrap_err(),
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
    let a = p.enqueue(external(0, 2), None).unwrap();
    exec.wait_started(1).await;
    let b = p.enqueue(external(10, 2), None).unwrap();
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
