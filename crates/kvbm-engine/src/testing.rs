//! Test support for users of this crate (feature `testing`): workers whose every tier is host
//! memory, and a [`MockWorker`] that wraps a real in-process worker and fails on command.
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
use kvbm_logical::TierId;
use kvbm_physical::{BlockLayout, LayoutKind, PhysicalLayout, PinPolicy, TransferManager};
use parking_lot::Mutex;

use crate::address::{InstanceId, WorkerAddress};
use crate::cluster::transport::control::{
    ControlError, ControlRequest, ControlResponse, ControlledWorkers, InProcessControl,
    WorkerControl,
};
use crate::error::{EngineError, Result};
use crate::worker::PhysicalWorker;

/// A small fully contiguous geometry: `num_blocks` blocks of 2 layers × 2 × 16 tokens × 64 ×
/// 2 bytes (8 KiB a block).
///
/// # Errors
/// [`EngineError::Config`] (key `layout`) for zero blocks.
pub fn small_geometry(num_blocks: usize) -> Result<BlockLayout> {
    BlockLayout::builder()
        .num_blocks(num_blocks)
        .num_layers(2)
        .outer_dim(2)
        .page_size(16)
        .inner_dim(64)
        .dtype_bytes(2)
        .kind(LayoutKind::FullyContiguous)
        .build()
        .map_err(|e| EngineError::config("layout", e.to_string()))
}

/// Rank `rank` with a host-memory layout of `geometry` for each of `tiers` (in-memory tiers:
/// G1, G2, even G3/G4 stand-ins), on its own transfer manager.
///
/// # Errors
/// [`EngineError::Config`] (key `layout`) when memory cannot be allocated or registered.
pub fn host_worker(rank: usize, geometry: BlockLayout, tiers: &[TierId]) -> Result<PhysicalWorker> {
    let err = |e: &dyn std::fmt::Display| EngineError::config("layout", e.to_string());
    let tm = Arc::new(TransferManager::new().map_err(|e| err(&e))?);
    let mut w = PhysicalWorker::new(rank, tm.clone());
    for &t in tiers {
        let layout =
            PhysicalLayout::allocate_host(geometry, PinPolicy::Unpinned).map_err(|e| err(&e))?;
        w = w.with_layout(t, tm.register_layout(layout).map_err(|e| err(&e))?);
    }
    Ok(w)
}

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
    use crate::worker::{ParallelWorkers, TransferRequest};

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
        // SAFETY: mock workers: no memory is touched.
        assert_eq!(unsafe { workers.execute(req.clone()) }.await, vec![Ok(())]);
        mocks[1].fail_next(MockFailure::Gone);
        // SAFETY: mock workers over their own layouts; nothing else uses them.
        let e = unsafe { workers.transfer(&req) }.await.unwrap_err();
        assert_eq!(
            e,
            ControlError::NoResponders {
                worker: WorkerAddress::new(InstanceId(1), 1)
            }
        );
        // SAFETY: as above.
        assert_eq!(unsafe { workers.execute(req.clone()) }.await, vec![Ok(())]);
        mocks[0].fail_always(Some(MockFailure::Timeout));
        // SAFETY: as above.
        assert!(unsafe { workers.execute(req.clone()) }.await[0].is_err());
        mocks[0].fail_always(None);
        // SAFETY: as above.
        assert_eq!(unsafe { workers.execute(req) }.await, vec![Ok(())]);
        assert_eq!(mocks[0].calls(), 5);
    }
}
