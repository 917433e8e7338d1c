//! Helpers shared by the integration tests: a controllable executor, a gated policy, hashes.
#![allow(dead_code)]

use std::collections::HashSet;
use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use kvbm_logical::{BlockManager, ImmutableBlock, Salt, SequenceHash, Tier};
use kvbm_offload::{
    BatchOutcome, BlockFailure, BlockFailureKind, EvalContext, ExternalBlock, OffloadPolicy,
    PolicyBatchFuture, PolicyFuture, ResolvedBatch, TransferExecutor, async_batch_result,
    async_result,
};
use parking_lot::Mutex;
use tokio::sync::{Notify, Semaphore};

/// A distinct block-size-4 hash per `i`.
pub fn hash(i: u32) -> SequenceHash {
    SequenceHash::root(Salt::NONE, &[i, 7, 7, 7])
}

/// `n` external blocks with hashes `start..start+n`.
pub fn external(start: u32, n: u32) -> Vec<ExternalBlock> {
    (start..start + n)
        .map(|i| ExternalBlock::new(i as usize, hash(i)))
        .collect()
}

/// Registers `n` blocks with hashes `start..` in `manager`.
pub fn registered<T: Tier>(
    manager: &BlockManager<T>,
    start: u32,
    n: u32,
) -> Vec<ImmutableBlock<T>> {
    let blocks = manager.allocate_blocks(n as usize).expect("allocate");
    let complete = blocks
        .into_iter()
        .zip(start..)
        .map(|(b, i)| b.complete(hash(i)).expect("complete"))
        .collect();
    manager.register_blocks(complete)
}

/// An executor the test drives: each batch waits for one gate permit (unless the gate is
/// open), batches are recorded, chosen hashes fail.
#[derive(Clone, Default)]
pub struct TestExecutor {
    pub inner: Arc<TestExecutorInner>,
}

#[derive(Default)]
pub struct TestExecutorInner {
    pub batches: Mutex<Vec<Vec<SequenceHash>>>,
    pub gate: Option<Semaphore>,
    pub inflight: AtomicUsize,
    pub max_inflight: AtomicUsize,
    pub started: Notify,
    pub fail: Mutex<HashSet<SequenceHash>>,
}

impl TestExecutor {
    /// Every batch completes at once.
    pub fn open() -> Self {
        Self::default()
    }

    /// Every batch waits for [`release`](Self::release).
    pub fn gated() -> Self {
        Self {
            inner: Arc::new(TestExecutorInner {
                gate: Some(Semaphore::new(0)),
                ..Default::default()
            }),
        }
    }

    /// Lets `n` batches finish.
    pub fn release(&self, n: usize) {
        self.inner.gate.as_ref().expect("gated").add_permits(n);
    }

    /// Recorded batches.
    pub fn batches(&self) -> Vec<Vec<SequenceHash>> {
        self.inner.batches.lock().clone()
    }

    /// Sizes of the recorded batches.
    pub fn sizes(&self) -> Vec<usize> {
        self.batches().iter().map(Vec::len).collect()
    }

    /// Waits until at least `n` batches started.
    pub async fn wait_started(&self, n: usize) {
        loop {
            let notified = self.inner.started.notified();
            if self.inner.batches.lock().len() >= n {
                return;
            }
            notified.await;
        }
    }

    /// Makes `h` fail.
    pub fn fail(&self, h: SequenceHash) {
        self.inner.fail.lock().insert(h);
    }
}

impl<T: Tier> TransferExecutor<T> for TestExecutor {
    type Output = SequenceHash;

    fn execute(
        &self,
        batch: &ResolvedBatch<T>,
    ) -> impl Future<Output = BatchOutcome<SequenceHash>> + Send {
        let hashes = batch.sequence_hashes();
        let inner = self.inner.clone();
        async move {
            let now = inner.inflight.fetch_add(1, Ordering::AcqRel) + 1;
            inner.max_inflight.fetch_max(now, Ordering::AcqRel);
            inner.batches.lock().push(hashes.clone());
            inner.started.notify_waiters();
            if let Some(g) = &inner.gate {
                g.acquire().await.expect("gate").forget();
            }
            inner.inflight.fetch_sub(1, Ordering::AcqRel);
            let fail = inner.fail.lock().clone();
            hashes
                .into_iter()
                .map(|h| {
                    if fail.contains(&h) {
                        Err(BlockFailure::new(
                            BlockFailureKind::Transfer,
                            "injected failure",
                        ))
                    } else {
                        Ok(h)
                    }
                })
                .collect()
        }
    }
}

/// An asynchronous policy that passes everything once its gate opens.
#[derive(Clone)]
pub struct GatedPolicy {
    pub gate: Arc<Semaphore>,
    pub asked: Arc<AtomicUsize>,
    pub released: Arc<Mutex<Vec<SequenceHash>>>,
}

impl Default for GatedPolicy {
    fn default() -> Self {
        Self {
            gate: Arc::new(Semaphore::new(0)),
            asked: Arc::default(),
            released: Arc::default(),
        }
    }
}

impl OffloadPolicy for GatedPolicy {
    fn name(&self) -> &'static str {
        "gated"
    }
    fn evaluate(&self, _ctx: &EvalContext) -> PolicyFuture {
        let gate = self.gate.clone();
        async_result(async move {
            gate.acquire().await.expect("gate").forget();
            Ok(true)
        })
    }
    fn evaluate_batch(&self, ctxs: &[EvalContext]) -> PolicyBatchFuture {
        self.asked.fetch_add(ctxs.len(), Ordering::AcqRel);
        let gate = self.gate.clone();
        let n = ctxs.len();
        async_batch_result(async move {
            gate.acquire().await.expect("gate").forget();
            Ok(vec![true; n])
        })
    }
    fn release(&self, hashes: &[SequenceHash]) {
        self.released.lock().extend_from_slice(hashes);
    }
}

/// Awaits `f` for at most `ms` milliseconds (of tokio time); `None` on timeout.
pub async fn within<F: std::future::IntoFuture>(ms: u64, f: F) -> Option<F::Output> {
    tokio::time::timeout(Duration::from_millis(ms), f.into_future())
        .await
        .ok()
}
