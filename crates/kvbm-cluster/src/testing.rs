//! Test support for users of this crate (feature `testing`): a [`MockWorker`] that wraps a
//! real in-process worker (the engine's `testing::host_worker`) behind the control seam and
//! fails on command.
//!
//! # Why
//!
//! A scheduler or connector built on the engine wants to test its own failure handling
//! (a rank that times out, refuses, or disappears) without GPUs, disks or a NATS server.
//! Everything here moves real bytes through a real `TransferManager` in host memory, so a
//! test still sees transfers succeed or fail for real; only *which* calls fail is scripted.
//!
//! # Locks
//!
//! [`MockWorker`] has one `parking_lot` mutex around its scripted failures, never held across
//! an `.await`.

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use futures::future::BoxFuture;
use kvbm_engine::testing::host_worker;
use kvbm_engine::{InstanceId, Result, WorkerAddress};
use kvbm_logical::TierId;
use kvbm_physical::BlockLayout;
use parking_lot::Mutex;

use crate::transport::control::{
    ControlError, ControlRequest, ControlResponse, ControlledWorkers, InProcessControl,
    WorkerControl,
};

/// `world` in-process ranks of `instance` ([`host_worker`] each) behind [`MockWorker`]s, and
/// the [`ControlledWorkers`] over them.
///
/// # Errors
/// As [`host_worker`].
pub fn mock_workers(
    instance: InstanceId,
    world: usize,
    geometry: BlockLayout,
    tiers: &[TierId],
) -> Result<(ControlledWorkers, Vec<Arc<MockWorker>>)> {
    let mocks: Vec<Arc<MockWorker>> = (0..world)
        .map(|r| {
            host_worker(r, geometry, tiers).map(|w| {
                Arc::new(MockWorker::new(InProcessControl::new(
                    instance,
                    Arc::new(w),
                )))
            })
        })
        .collect::<Result<_>>()?;
    let controls = mocks
        .iter()
        .map(|m| m.clone() as Arc<dyn WorkerControl>)
        .collect();
    Ok((ControlledWorkers::new(controls)?, mocks))
}

/// What a scripted failure looks like.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum MockFailure {
    /// [`ControlError::Timeout`] (reported at once, without waiting).
    Timeout,
    /// [`ControlError::NoResponders`].
    Gone,
}

/// A real in-process worker whose calls can be made to fail: see the [module docs](self).
#[derive(Debug)]
pub struct MockWorker {
    inner: InProcessControl,
    script: Mutex<VecDeque<MockFailure>>,
    always: Mutex<Option<MockFailure>>,
    calls: AtomicUsize,
}

impl MockWorker {
    /// Wraps `inner`; calls pass through until failures are scripted.
    pub fn new(inner: InProcessControl) -> Self {
        Self {
            inner,
            script: Mutex::new(VecDeque::new()),
            always: Mutex::new(None),
            calls: AtomicUsize::new(0),
        }
    }

    /// The next call fails with `failure` (queued after earlier scripted ones).
    pub fn fail_next(&self, failure: MockFailure) {
        self.script.lock().push_back(failure);
    }

    /// Every call from now on fails with `failure` (`None`: calls pass through again).
    pub fn fail_always(&self, failure: Option<MockFailure>) {
        *self.always.lock() = failure;
    }

    /// Calls received so far (failed ones included).
    pub fn calls(&self) -> usize {
        self.calls.load(Ordering::Relaxed)
    }

    /// Counts a call and takes the failure scripted for it, if any.
    fn scripted(&self) -> Option<ControlError> {
        self.calls.fetch_add(1, Ordering::Relaxed);
        let scripted = self.script.lock().pop_front().or(*self.always.lock());
        scripted.map(|f| self.error(f))
    }

    fn error(&self, f: MockFailure) -> ControlError {
        let worker: WorkerAddress = self.inner.address();
        match f {
            MockFailure::Timeout => ControlError::Timeout {
                worker,
                timeout_ms: 0,
            },
            MockFailure::Gone => ControlError::NoResponders { worker },
        }
    }
}

impl WorkerControl for MockWorker {
    fn address(&self) -> WorkerAddress {
        self.inner.address()
    }

    fn call(
        &self,
        request: ControlRequest,
    ) -> BoxFuture<'_, Result<ControlResponse, ControlError>> {
        match self.scripted() {
            Some(e) => Box::pin(async move { Err(e) }),
            None => self.inner.call(request),
        }
    }

    unsafe fn call_unchecked(
        &self,
        request: ControlRequest,
    ) -> BoxFuture<'_, Result<ControlResponse, ControlError>> {
        match self.scripted() {
            Some(e) => Box::pin(async move { Err(e) }),
            // SAFETY: forwarded from the caller.
            None => unsafe { self.inner.call_unchecked(request) },
        }
    }
}

#[cfg(test)]
mod tests {
    //! The mock passes calls through until told otherwise, then fails them with the scripted
    //! typed error; a failed rank fails the whole transfer.

    use kvbm_logical::{Salt, TokenBlockSequence};

    use super::*;
    use kvbm_engine::testing::small_geometry;
    use kvbm_engine::worker::{ParallelWorkers, Reserved, TransferRequest};

    #[tokio::test]
    async fn scripted_failures_fail_the_operation_then_calls_pass_again() {
        let (workers, mocks) = mock_workers(
            InstanceId(1),
            2,
            small_geometry(4).unwrap(),
            &[TierId::G1, TierId::G2],
        )
        .unwrap();
        let h = TokenBlockSequence::from_tokens(&[1, 2, 3, 4], 4, Salt::NONE)
            .unwrap()
            .hashes();
        let req = TransferRequest::new(TierId::G2, TierId::G1, vec![(0, 1, h[0])]);
        // SAFETY: mock workers over their own layouts; nothing else uses them.
        let reserved = || unsafe { Reserved::vouched(req.clone()) };
        assert_eq!(workers.execute(reserved()).await, vec![Ok(())]);
        mocks[1].fail_next(MockFailure::Gone);
        let e = workers.transfer(&reserved()).await.unwrap_err();
        assert_eq!(
            e,
            ControlError::NoResponders {
                worker: WorkerAddress::new(InstanceId(1), 1)
            }
        );
        assert_eq!(workers.execute(reserved()).await, vec![Ok(())]);
        mocks[0].fail_always(Some(MockFailure::Timeout));
        assert!(workers.execute(reserved()).await[0].is_err());
        mocks[0].fail_always(None);
        assert_eq!(workers.execute(reserved()).await, vec![Ok(())]);
        assert_eq!(mocks[0].calls(), 5);
    }
}
