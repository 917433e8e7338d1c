//! Helpers shared by the integration tests (and the benchmark): a controllable executor, a gated
//! policy, hashes, block managers, physical layouts, an in-memory metrics recorder.
#![allow(dead_code)]

use std::collections::{HashMap, HashSet};
use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;

use kvbm_logical::{
    BlockManager, BlockRegistry, G1, G2, G3, ImmutableBlock, MutableBlock, Salt, SequenceHash, Tier,
};
use kvbm_offload::policy::{
    EvalContext, PolicyBatchFuture, PolicyFuture, async_batch_result, async_result,
};
use kvbm_offload::{
    BatchOutcome, BlockFailure, BlockFailureKind, ExternalBlock, MoveExecutor, OffloadPolicy,
    OffloadResult, Pipeline, PipelineBuilder, ResolvedBatch,
};
/// `n` blocks of `layers` × 2 × 16 × `inner_dim` × 2 bytes (the workspace's test kit).
#[allow(unused_imports)] // each test binary uses its own subset
pub(crate) use kvbm_physical::testing::geometry;
use kvbm_physical::{
    BlockLayout, DiskConfig, LayoutHandle, PhysicalLayout, PinPolicy, TransferManager,
};
use parking_lot::Mutex;
use tokio::sync::{Notify, Semaphore};

/// A distinct block-size-4 hash per `i`.
pub(crate) fn hash(i: u32) -> SequenceHash {
    SequenceHash::root(Salt::NONE, &[i, 7, 7, 7])
}

/// The hashes `start..start+n`.
pub(crate) fn hashes(start: u32, n: u32) -> Vec<SequenceHash> {
    (start..start + n).map(hash).collect()
}

/// `n` external blocks with hashes `start..start+n`.
pub(crate) fn external(start: u32, n: u32) -> Vec<ExternalBlock> {
    (start..start + n)
        .map(|i| ExternalBlock::new(i as usize, hash(i)))
        .collect()
}

/// A manager of `n` blocks of size 4, joined to `registry` when given.
pub(crate) fn manager<T: Tier>(n: usize, registry: Option<&BlockRegistry>) -> BlockManager<T> {
    let b = BlockManager::<T>::builder().block_count(n).block_size(4);
    match registry {
        Some(r) => b.registry(r.clone()),
        None => b,
    }
    .build()
    .unwrap()
}

/// Spawns a G1→G2 pipeline configured by `f` over `exec`.
pub(crate) fn spawn_g1_to_g2<E: MoveExecutor<G1>>(
    exec: E,
    f: impl FnOnce(PipelineBuilder<G1, G2>) -> PipelineBuilder<G1, G2>,
) -> Pipeline<G1> {
    f(PipelineBuilder::<G1, G2>::new())
        .build()
        .spawn(exec)
        .unwrap()
}

/// Spawns a G3→G2 onboarding pipeline (caller-allocated destinations) configured by `f`.
pub(crate) fn spawn_g3_to_g2<E: MoveExecutor<G3, MutableBlock<G2>>>(
    exec: E,
    f: impl FnOnce(
        PipelineBuilder<G3, G2, MutableBlock<G2>>,
    ) -> PipelineBuilder<G3, G2, MutableBlock<G2>>,
) -> Pipeline<G3, MutableBlock<G2>> {
    f(PipelineBuilder::<G3, G2>::new().caller_allocated())
        .build()
        .spawn(exec)
        .unwrap()
}

/// Asserts that `r` failed and that every failed block failed with `kind`.
#[track_caller]
pub(crate) fn assert_all_failed(r: &OffloadResult, kind: BlockFailureKind) {
    assert!(!r.failed_blocks.is_empty(), "nothing failed: {r:?}");
    assert!(
        r.failed_blocks.iter().all(|(_, f)| f.kind == kind),
        "expected every failure to be {kind:?}: {:?}",
        r.failed_blocks
    );
}

/// Allocates host memory for `geometry` and registers it with `tm`.
pub(crate) fn host_layout(
    tm: &TransferManager,
    geometry: BlockLayout,
    pin: PinPolicy,
) -> LayoutHandle {
    tm.register_layout(PhysicalLayout::allocate_host(geometry, pin).unwrap())
        .unwrap()
}

/// Creates the file `path` for `geometry` and registers it with `tm`.
pub(crate) fn disk_layout(
    tm: &TransferManager,
    geometry: BlockLayout,
    path: &std::path::Path,
) -> LayoutHandle {
    tm.register_layout(PhysicalLayout::create_disk(geometry, &DiskConfig::new(path)).unwrap())
        .unwrap()
}

/// A scratch directory under the target directory (not /tmp: it may be tmpfs, which refuses
/// O_DIRECT).
pub(crate) fn scratch() -> tempfile::TempDir {
    tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap()
}

/// Registers `n` blocks with hashes `start..` in `manager`.
pub(crate) fn registered<T: Tier>(
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
pub(crate) struct TestExecutor {
    pub inner: Arc<TestExecutorInner>,
}

#[derive(Default)]
pub(crate) struct TestExecutorInner {
    pub batches: Mutex<Vec<Vec<SequenceHash>>>,
    pub gate: Option<Semaphore>,
    pub inflight: AtomicUsize,
    pub max_inflight: AtomicUsize,
    pub started: Notify,
    pub fail: Mutex<HashSet<SequenceHash>>,
}

impl TestExecutor {
    /// Every batch completes at once.
    pub(crate) fn open() -> Self {
        Self::default()
    }

    /// Every batch waits for [`release`](Self::release).
    pub(crate) fn gated() -> Self {
        Self {
            inner: Arc::new(TestExecutorInner {
                gate: Some(Semaphore::new(0)),
                ..Default::default()
            }),
        }
    }

    /// Lets `n` batches finish.
    pub(crate) fn release(&self, n: usize) {
        self.inner.gate.as_ref().expect("gated").add_permits(n);
    }

    /// Recorded batches.
    pub(crate) fn batches(&self) -> Vec<Vec<SequenceHash>> {
        self.inner.batches.lock().clone()
    }

    /// Sizes of the recorded batches.
    pub(crate) fn sizes(&self) -> Vec<usize> {
        self.batches().iter().map(Vec::len).collect()
    }

    /// Waits until at least `n` batches started.
    pub(crate) async fn wait_started(&self, n: usize) {
        loop {
            let notified = self.inner.started.notified();
            if self.inner.batches.lock().len() >= n {
                return;
            }
            notified.await;
        }
    }

    /// Makes `h` fail.
    pub(crate) fn fail(&self, h: SequenceHash) {
        self.inner.fail.lock().insert(h);
    }
}

impl<T: Tier> MoveExecutor<T> for TestExecutor {
    type Output = SequenceHash;

    fn execute(
        &self,
        batch: &ResolvedBatch<T>,
    ) -> impl Future<Output = BatchOutcome<SequenceHash>> + Send {
        self.run(batch.sequence_hashes(), ())
    }
}

/// The same executor for a lane with caller-allocated destinations: it holds the batch's
/// destinations while it runs (as a real move would) and drops them after.
impl<T: Tier, D: Tier> MoveExecutor<T, MutableBlock<D>> for TestExecutor {
    type Output = SequenceHash;

    fn execute(
        &self,
        batch: &ResolvedBatch<T, MutableBlock<D>>,
    ) -> impl Future<Output = BatchOutcome<SequenceHash>> + Send {
        let dests = batch.take_destinations();
        assert_eq!(dests.len(), batch.len(), "one destination per block");
        self.run(batch.sequence_hashes(), dests)
    }
}

impl TestExecutor {
    fn run<H: Send + 'static>(
        &self,
        hashes: Vec<SequenceHash>,
        held: H,
    ) -> impl Future<Output = BatchOutcome<SequenceHash>> + Send + 'static {
        let inner = self.inner.clone();
        async move {
            let _held = held;
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
pub(crate) struct GatedPolicy {
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
pub(crate) async fn within<F: std::future::IntoFuture>(ms: u64, f: F) -> Option<F::Output> {
    tokio::time::timeout(Duration::from_millis(ms), f.into_future())
        .await
        .ok()
}

/// A `metrics` recorder that keeps every series in memory, for asserting exact values.
///
/// Install it with `metrics::with_local_recorder(&rec, || spec.spawn(..))`: a pipeline resolves
/// its handles when it is spawned, so the thread-local install only has to cover the spawn.
#[derive(Clone, Default)]
pub(crate) struct TestRecorder {
    counters: Arc<Mutex<HashMap<String, Arc<AtomicU64>>>>,
    gauges: Arc<Mutex<HashMap<String, Arc<AtomicU64>>>>,
    histograms: Arc<Mutex<HashMap<String, Arc<TestHistogram>>>>,
}

#[derive(Default)]
pub(crate) struct TestHistogram(Mutex<Vec<f64>>);

impl metrics::HistogramFn for TestHistogram {
    fn record(&self, value: f64) {
        self.0.lock().push(value);
    }
}

/// `name{k=v,...}` with the labels sorted, so lookups do not depend on label order.
fn series_id<'a>(name: &str, labels: impl IntoIterator<Item = (&'a str, &'a str)>) -> String {
    let mut labels: Vec<String> = labels
        .into_iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect();
    labels.sort();
    format!("{name}{{{}}}", labels.join(","))
}

fn key_id(key: &metrics::Key) -> String {
    series_id(key.name(), key.labels().map(|l| (l.key(), l.value())))
}

impl TestRecorder {
    /// The counter `name` with `labels` (0 if never registered).
    pub(crate) fn counter(&self, name: &str, labels: &[(&str, &str)]) -> u64 {
        self.counters
            .lock()
            .get(&series_id(name, labels.iter().copied()))
            .map_or(0, |c| c.load(Ordering::Acquire))
    }

    /// The gauge `name` with `labels` (0 if never registered).
    pub(crate) fn gauge(&self, name: &str, labels: &[(&str, &str)]) -> f64 {
        self.gauges
            .lock()
            .get(&series_id(name, labels.iter().copied()))
            .map_or(0.0, |g| f64::from_bits(g.load(Ordering::Acquire)))
    }

    /// Every value recorded into the histogram `name` with `labels`.
    pub(crate) fn histogram(&self, name: &str, labels: &[(&str, &str)]) -> Vec<f64> {
        self.histograms
            .lock()
            .get(&series_id(name, labels.iter().copied()))
            .map_or_else(Vec::new, |h| h.0.lock().clone())
    }

    /// Sum of every series of the counter `name`, whatever its labels.
    pub(crate) fn counter_total(&self, name: &str) -> u64 {
        let prefix = format!("{name}{{");
        self.counters
            .lock()
            .iter()
            .filter(|(k, _)| k.starts_with(&prefix))
            .map(|(_, c)| c.load(Ordering::Acquire))
            .sum()
    }
}

impl metrics::Recorder for TestRecorder {
    fn describe_counter(
        &self,
        _: metrics::KeyName,
        _: Option<metrics::Unit>,
        _: metrics::SharedString,
    ) {
    }
    fn describe_gauge(
        &self,
        _: metrics::KeyName,
        _: Option<metrics::Unit>,
        _: metrics::SharedString,
    ) {
    }
    fn describe_histogram(
        &self,
        _: metrics::KeyName,
        _: Option<metrics::Unit>,
        _: metrics::SharedString,
    ) {
    }

    fn register_counter(&self, key: &metrics::Key, _: &metrics::Metadata<'_>) -> metrics::Counter {
        let c = self.counters.lock().entry(key_id(key)).or_default().clone();
        metrics::Counter::from_arc(c)
    }

    fn register_gauge(&self, key: &metrics::Key, _: &metrics::Metadata<'_>) -> metrics::Gauge {
        let g = self.gauges.lock().entry(key_id(key)).or_default().clone();
        metrics::Gauge::from_arc(g)
    }

    fn register_histogram(
        &self,
        key: &metrics::Key,
        _: &metrics::Metadata<'_>,
    ) -> metrics::Histogram {
        let h = self
            .histograms
            .lock()
            .entry(key_id(key))
            .or_default()
            .clone();
        metrics::Histogram::from_arc(h)
    }
}
