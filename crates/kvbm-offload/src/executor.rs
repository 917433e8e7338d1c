//! The transfer stage's seam: [`MoveExecutor`].
//!
//! The pipeline owns everything up to the commitment point and the bookkeeping after it; an
//! executor only moves bytes for a [`ResolvedBatch`] and says, per block, whether it worked and
//! what it produced (for a tier destination, the block registered there). Keeping this a trait
//! lets tests drive the pipeline with a controllable executor, benchmarks with [`NoopExecutor`],
//! and production with [`BlockMoveExecutor`](crate::BlockMoveExecutor) /
//! [`ObjectMoveExecutor`](crate::ObjectMoveExecutor) over `kvbm-physical`.
//!
//! # Contract
//!
//! * The outcome has exactly one entry per block of the batch, in order. A mis-sized outcome
//!   fails the whole batch.
//! * A block reported `Ok` must be registered in the destination (when the destination is a
//!   tier); a block reported `Err` must not be.
//! * The executor must not hold on to the batch's blocks after its future resolves.

use std::future::Future;
use std::sync::Arc;

use kvbm_logical::Tier;

use crate::batch::{BatchOutcome, ResolvedBatch};

/// Executes the transfer of a resolved batch.
///
/// `A` is the per-block destination attachment the pipeline carries: `()` (the default) when
/// the executor allocates destinations itself, a caller-allocated `MutableBlock<Dst>` when the
/// caller chose them before the transfer ([`ResolvedBatch::take_destinations`]).
pub trait MoveExecutor<T: Tier, A = ()>: Send + Sync + 'static {
    /// What one successfully transferred block yields (e.g. the destination block).
    type Output: Send + 'static;

    /// Transfers `batch`; one outcome per block, in order.
    fn execute(
        &self,
        batch: &ResolvedBatch<T, A>,
    ) -> impl Future<Output = BatchOutcome<Self::Output>> + Send;
}

/// An executor that does nothing and reports every block transferred. For benchmarks and
/// tests of the pipeline's own overhead.
#[derive(Debug, Clone, Copy, Default)]
pub struct NoopExecutor;

impl<T: Tier> MoveExecutor<T> for NoopExecutor {
    type Output = ();

    fn execute(&self, batch: &ResolvedBatch<T>) -> impl Future<Output = BatchOutcome<()>> + Send {
        let n = batch.len();
        std::future::ready((0..n).map(|_| Ok(())).collect())
    }
}

/// Object-safe form of [`MoveExecutor`], for storing executors of different types behind
/// one `Arc<dyn …>` (costs one boxed future per batch).
pub trait DynMoveExecutor<T: Tier, R, A = ()>: Send + Sync + 'static {
    /// See [`MoveExecutor::execute`].
    fn execute_boxed<'a>(
        &'a self,
        batch: &'a ResolvedBatch<T, A>,
    ) -> BoxFutureRef<'a, BatchOutcome<R>>;
}

/// A boxed future borrowing its inputs.
pub(crate) type BoxFutureRef<'a, O> = std::pin::Pin<Box<dyn Future<Output = O> + Send + 'a>>;

impl<T: Tier, A: Send + 'static, E: MoveExecutor<T, A>> DynMoveExecutor<T, E::Output, A> for E {
    fn execute_boxed<'a>(
        &'a self,
        batch: &'a ResolvedBatch<T, A>,
    ) -> BoxFutureRef<'a, BatchOutcome<E::Output>> {
        Box::pin(self.execute(batch))
    }
}

/// A type-erased executor.
pub struct ArcExecutor<T: Tier, R, A = ()>(pub Arc<dyn DynMoveExecutor<T, R, A>>);

impl<T: Tier, R, A> Clone for ArcExecutor<T, R, A> {
    fn clone(&self) -> Self {
        Self(self.0.clone())
    }
}

impl<T: Tier, R, A> std::fmt::Debug for ArcExecutor<T, R, A> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ArcExecutor")
    }
}

impl<T: Tier, R: Send + 'static, A: Send + 'static> ArcExecutor<T, R, A> {
    /// Erases `executor`'s type.
    pub fn new(executor: impl MoveExecutor<T, A, Output = R>) -> Self {
        Self(Arc::new(executor))
    }
}

impl<T: Tier, R: Send + 'static, A: Send + 'static> MoveExecutor<T, A> for ArcExecutor<T, R, A> {
    type Output = R;

    async fn execute(&self, batch: &ResolvedBatch<T, A>) -> BatchOutcome<R> {
        self.0.execute_boxed(batch).await
    }
}
