//! The pool of pinned host bounce buffers behind two-hop transfers.
//!
//! A two-hop transfer (device ↔ disk/object, disk ↔ object, disk → disk, partial-layer disk
//! reads) stages its blocks through host memory. The [`TransferManager`](super::TransferManager)
//! owns a bounded pool of [`TransferConfig::bounce_buffers`](super::TransferConfig) buffers of
//! [`TransferConfig::bounce_buffer_bytes`](super::TransferConfig) each, allocated (page-aligned,
//! `mlock`ed per [`PinPolicy::TryPin`]) on first demand and kept for the manager's lifetime, so
//! steady-state two-hop transfers allocate and pin nothing. Under `cuda` a buffer's CUDA host
//! registration is attached to the buffer and so survives reuse as well.
//!
//! A transfer holds one buffer from its first round to its last; each round stages as many
//! whole blocks as fit (`bounce_buffer_bytes / block_bytes`, at most the transfer's length).
//! When every buffer is lent out, a transfer **waits** for one (memory stays bounded by
//! `bounce_buffers × bounce_buffer_bytes`). Only a block larger than a pooled buffer takes a
//! one-off allocation of [`ONE_OFF_BLOCKS`] blocks (at most), freed after the transfer and logged
//! at debug level; it still takes one of the pool's permits, so the number of bounce
//! allocations alive at once stays bounded too.
//!
//! Two-hop transfers never nest (their steps always have a host memory side, which has a direct
//! strategy), so a transfer never waits for a second buffer while holding one: a pool of one
//! cannot deadlock.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use parking_lot::Mutex;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::error::Result;
use crate::layout::{BlockLayout, LayoutConfig};
use crate::physical::{Backing, PhysicalLayout};
use crate::storage::{HostStorage, PinPolicy};

/// Most blocks per round when a block does not fit a pooled buffer (the one-off path).
pub const ONE_OFF_BLOCKS: usize = 32;

/// Counters of a manager's bounce pool (cumulative since the manager started).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct BouncePoolStats {
    /// Buffers the pool may hold ([`super::TransferConfig::bounce_buffers`]).
    pub capacity: usize,
    /// Bytes per pooled buffer ([`super::TransferConfig::bounce_buffer_bytes`]).
    pub buffer_bytes: usize,
    /// Pooled buffers allocated so far (never more than `capacity`).
    pub allocated: u64,
    /// Leases served by an idle pooled buffer (no allocation, no `mlock`).
    pub reused: u64,
    /// Leases that had to wait because every buffer was lent out.
    pub waited: u64,
    /// One-off allocations for blocks larger than a pooled buffer.
    pub one_off: u64,
    /// Pooled buffers idle right now.
    pub idle: usize,
}

#[derive(Debug)]
pub(crate) struct BouncePool {
    buffer_bytes: usize,
    capacity: usize,
    permits: Arc<Semaphore>,
    idle: Mutex<Vec<Arc<HostStorage>>>,
    allocated: AtomicU64,
    reused: AtomicU64,
    waited: AtomicU64,
    one_off: AtomicU64,
}

/// One buffer lent to a transfer, returned to the pool when dropped.
///
/// Drop it only once every step that used the buffer has finished (`two_hop` awaits each
/// step before the next round and before returning).
#[derive(Debug)]
pub(crate) struct BounceLease {
    pool: Arc<BouncePool>,
    /// `Some` for a pooled buffer, returned on drop; `None` for a one-off allocation.
    pooled: Option<Arc<HostStorage>>,
    /// The buffer viewed with the transfer's block geometry.
    layout: Arc<PhysicalLayout>,
    /// Released after the buffer is back in the idle list (field order).
    _permit: OwnedSemaphorePermit,
}

impl BouncePool {
    pub(crate) fn new(buffers: usize, buffer_bytes: usize) -> Self {
        let capacity = buffers.max(1);
        BouncePool {
            buffer_bytes: buffer_bytes.max(1),
            capacity,
            permits: Arc::new(Semaphore::new(capacity)),
            idle: Mutex::new(Vec::with_capacity(capacity)),
            allocated: AtomicU64::new(0),
            reused: AtomicU64::new(0),
            waited: AtomicU64::new(0),
            one_off: AtomicU64::new(0),
        }
    }

    pub(crate) fn stats(&self) -> BouncePoolStats {
        BouncePoolStats {
            capacity: self.capacity,
            buffer_bytes: self.buffer_bytes,
            allocated: self.allocated.load(Ordering::Relaxed),
            reused: self.reused.load(Ordering::Relaxed),
            waited: self.waited.load(Ordering::Relaxed),
            one_off: self.one_off.load(Ordering::Relaxed),
            idle: self.idle.lock().len(),
        }
    }

    /// Lends a buffer laid out as `geometry` (fully contiguous) for a transfer of `n` blocks,
    /// waiting while every buffer is lent out.
    pub(crate) async fn lease(
        self: &Arc<Self>,
        geometry: LayoutConfig,
        n: usize,
    ) -> Result<BounceLease> {
        let block_bytes = geometry.block_bytes().max(1);
        let fit = self.buffer_bytes / block_bytes;
        let permit = match Arc::clone(&self.permits).try_acquire_owned() {
            Ok(p) => p,
            Err(_) => {
                self.waited.fetch_add(1, Ordering::Relaxed);
                Arc::clone(&self.permits)
                    .acquire_owned()
                    .await
                    .expect("bounce semaphore never closed")
            }
        };
        let (pooled, backing, blocks) = if fit == 0 {
            let blocks = ONE_OFF_BLOCKS.min(n.max(1));
            tracing::debug!(
                block_bytes,
                buffer_bytes = self.buffer_bytes,
                blocks,
                "block larger than a pooled bounce buffer; one-off bounce allocation"
            );
            self.one_off.fetch_add(1, Ordering::Relaxed);
            let buf = Arc::new(HostStorage::new(blocks * block_bytes, PinPolicy::TryPin)?);
            (None, buf, blocks)
        } else {
            let idle = self.idle.lock().pop();
            let buf = match idle {
                Some(b) => {
                    self.reused.fetch_add(1, Ordering::Relaxed);
                    b
                }
                None => {
                    let b = Arc::new(HostStorage::new(self.buffer_bytes, PinPolicy::TryPin)?);
                    self.allocated.fetch_add(1, Ordering::Relaxed);
                    b
                }
            };
            (Some(Arc::clone(&buf)), buf, fit.min(n.max(1)))
        };
        let view = BlockLayout::builder()
            .config(geometry)
            .num_blocks(blocks)
            .fully_contiguous()
            .build()
            .and_then(|l| PhysicalLayout::from_backing(l, Backing::Host(vec![backing])));
        match view {
            Ok(layout) => Ok(BounceLease {
                pool: Arc::clone(self),
                pooled,
                layout: Arc::new(layout),
                _permit: permit,
            }),
            Err(e) => {
                if let Some(buf) = pooled {
                    self.idle.lock().push(buf);
                }
                Err(e)
            }
        }
    }
}

impl BounceLease {
    /// The buffer as a fully contiguous layout of the transfer's geometry.
    pub(crate) fn layout(&self) -> &Arc<PhysicalLayout> {
        &self.layout
    }
    /// Blocks staged per round.
    pub(crate) fn blocks(&self) -> usize {
        self.layout.layout().config().num_blocks
    }
}

impl Drop for BounceLease {
    fn drop(&mut self) {
        if let Some(buf) = self.pooled.take() {
            self.pool.idle.lock().push(buf);
        }
    }
}
