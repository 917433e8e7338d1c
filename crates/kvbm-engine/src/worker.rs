//! Workers: [`PhysicalWorker`] (one rank's transfer manager and layouts), the
//! [`ParallelWorkers`] seam, and [`SpmdParallelWorkers`], which runs every operation on every
//! rank; [`SpmdMover`] puts the leader's logical bookkeeping on top.
//!
//! # Why
//!
//! With tensor parallelism each rank holds its own slice (heads) of every block, in its own
//! memory and files, while the leader owns one logical view: one block id per block for all
//! ranks. A block has moved only when **every** rank moved its slice; until every rank has
//! settled, every rank's destination slot may still be written.
//!
//! ```text
//!  SpmdMover (leader: logical blocks)
//!     | TransferRequest {src tier, dst tier, (src id, dst id, hash)...}
//!     v
//!  SpmdParallelWorkers --submit--> rank 0: TransferManager::execute_transfer ─┐
//!                      --submit--> rank 1: TransferManager::execute_transfer ─┤ join: all settle
//!                                                                            v
//!                      per block: Ok iff Ok on every rank, else the first failure (with its rank)
//!     |
//!  SpmdMover: Ok blocks complete + register (bytes everywhere); failed destinations drop back
//!             to their pool, only now that no rank can still write them
//! ```
//!
//! # Invariants
//!
//! * [`ParallelWorkers::execute`] resolves only after every rank's transfer settled, also when
//!   a rank failed to submit or failed a block.
//! * A block is reported `Ok` only when every rank reported it `Ok`.
//!
//! [`SpmdParallelWorkers`] calls in-process workers directly; workers in other processes are
//! driven through [`transport::control::ControlledWorkers`](crate::transport::control::ControlledWorkers)
//! (NATS request/reply, feature `nats`), which implements the same [`ParallelWorkers`] seam.
//! `CoordinatedWorker` is not built yet.

use std::sync::Arc;

use futures::future::{BoxFuture, join_all};
use kvbm_logical::{
    BlockId, BlockManager, ImmutableBlock, MutableBlock, SequenceHash, Tier, TierId,
};
use kvbm_offload::block_identity;
use kvbm_physical::{LayoutHandle, TransferManager, TransferOptions};

/// One rank: its transfer manager and its layout per tier.
#[derive(Clone)]
pub struct PhysicalWorker {
    rank: usize,
    manager: Arc<TransferManager>,
    layouts: [Option<LayoutHandle>; 4],
}

impl std::fmt::Debug for PhysicalWorker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PhysicalWorker")
            .field("rank", &self.rank)
            .field("layouts", &self.layouts)
            .finish()
    }
}

impl PhysicalWorker {
    /// Rank `rank` over `manager`, with no layouts yet.
    pub fn new(rank: usize, manager: Arc<TransferManager>) -> Self {
        Self {
            rank,
            manager,
            layouts: [None; 4],
        }
    }

    /// Uses `layout` (registered with this worker's manager) for `tier`.
    pub fn with_layout(mut self, tier: TierId, layout: LayoutHandle) -> Self {
        self.layouts[tier.index()] = Some(layout);
        self
    }

    /// This worker's rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// The layout of `tier`, if any.
    pub fn layout(&self, tier: TierId) -> Option<LayoutHandle> {
        self.layouts[tier.index()]
    }

    /// The transfer manager.
    pub fn transfer_manager(&self) -> &Arc<TransferManager> {
        &self.manager
    }

    /// Runs `request` on this rank; one result per block, in order, once every block settled.
    pub async fn execute(&self, request: &TransferRequest) -> Vec<Result<(), String>> {
        let n = request.blocks.len();
        let fail_all = |m: String| (0..n).map(|_| Err(m.clone())).collect();
        let (Some(src), Some(dst)) = (self.layout(request.src), self.layout(request.dst)) else {
            return fail_all(format!(
                "rank {}: no layout for {} or {}",
                self.rank, request.src, request.dst
            ));
        };
        let src_ids: Vec<BlockId> = request.blocks.iter().map(|b| b.0).collect();
        let dst_ids: Vec<BlockId> = request.blocks.iter().map(|b| b.1).collect();
        let options = TransferOptions::default()
            .identities(request.blocks.iter().map(|b| block_identity(b.2)).collect());
        // SAFETY: the leader sends a rank only slots it reserved for this request: destinations
        // are blocks it allocated (`MutableBlock`s it holds until the outcome), sources blocks
        // it holds registered; nothing on this rank reaches them outside the manager.
        let issued = unsafe {
            self.manager
                .execute_transfer(src, &src_ids, dst, &dst_ids, options)
        };
        let completion = match issued {
            Ok(c) => c,
            Err(e) => return fail_all(format!("rank {}: {e}", self.rank)),
        };
        let outcome = completion.await;
        let mut results: Vec<Result<(), String>> = outcome
            .blocks
            .into_iter()
            .map(|(_, r)| r.map_err(|e| format!("rank {}: {e}", self.rank)))
            .collect();
        results.resize_with(n, || {
            Err(format!("rank {}: no outcome reported", self.rank))
        });
        results
    }
}

/// One operation for every rank: copy `blocks` (source slot, destination slot, the block's
/// hash, used as its identity) from tier `src` to tier `dst`.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct TransferRequest {
    /// Source tier.
    pub src: TierId,
    /// Destination tier.
    pub dst: TierId,
    /// `(source block id, destination block id, sequence hash)`.
    pub blocks: Vec<(BlockId, BlockId, SequenceHash)>,
}

/// The seam between the leader and its workers.
pub trait ParallelWorkers: Send + Sync {
    /// Ranks.
    fn world_size(&self) -> usize;
    /// Runs `request` on every rank; per block `Ok` only if every rank moved it, else the
    /// first failure. Resolves only after every rank settled.
    fn execute(&self, request: TransferRequest) -> BoxFuture<'_, Vec<Result<(), String>>>;
}

/// Every operation on every rank, in-process: see the [module docs](self).
#[derive(Clone, Debug)]
pub struct SpmdParallelWorkers {
    workers: Vec<Arc<PhysicalWorker>>,
}

impl SpmdParallelWorkers {
    /// Over `workers`, which must be ranks `0..n` in order.
    ///
    /// # Errors
    /// [`EngineError::Config`](crate::EngineError::Config) (key `workers`) when empty or the
    /// ranks are not `0..n` in order.
    pub fn new(workers: Vec<PhysicalWorker>) -> crate::Result<Self> {
        if workers.is_empty() {
            return Err(crate::EngineError::config("workers", "at least one rank"));
        }
        for (i, w) in workers.iter().enumerate() {
            if w.rank() != i {
                return Err(crate::EngineError::config(
                    "workers",
                    format!(
                        "worker {i} has rank {}; ranks must be 0..n in order",
                        w.rank()
                    ),
                ));
            }
        }
        Ok(Self {
            workers: workers.into_iter().map(Arc::new).collect(),
        })
    }
}

impl ParallelWorkers for SpmdParallelWorkers {
    fn world_size(&self) -> usize {
        self.workers.len()
    }

    fn execute(&self, request: TransferRequest) -> BoxFuture<'_, Vec<Result<(), String>>> {
        Box::pin(async move {
            let per_rank = join_all(self.workers.iter().map(|w| w.execute(&request))).await;
            let mut merged: Vec<Result<(), String>> = vec![Ok(()); request.blocks.len()];
            for rank in per_rank {
                for (m, r) in merged.iter_mut().zip(rank) {
                    if m.is_ok() {
                        *m = r;
                    }
                }
            }
            merged
        })
    }
}

/// The leader's side of a move across all ranks: destination blocks are allocated by the
/// caller; a block is completed and registered only when every rank moved it.
pub struct SpmdMover<Src: Tier, Dst: Tier> {
    workers: Arc<dyn ParallelWorkers>,
    dst: Arc<BlockManager<Dst>>,
    _src: std::marker::PhantomData<Src>,
}

impl<Src: Tier, Dst: Tier> SpmdMover<Src, Dst> {
    /// Moves from `Src` into `dst`'s tier through `workers`.
    pub fn new(workers: Arc<dyn ParallelWorkers>, dst: Arc<BlockManager<Dst>>) -> Self {
        Self {
            workers,
            dst,
            _src: std::marker::PhantomData,
        }
    }

    /// The manager destinations are allocated from.
    pub fn destination(&self) -> &Arc<BlockManager<Dst>> {
        &self.dst
    }

    /// Moves `sources[i]` into `destinations[i]` on every rank; one outcome per block. A
    /// failed block's destination returns to its pool (after every rank settled); nothing of
    /// it is registered. A length mismatch fails every block without moving anything.
    pub async fn move_from(
        &self,
        sources: &[ImmutableBlock<Src>],
        destinations: Vec<MutableBlock<Dst>>,
    ) -> Vec<Result<ImmutableBlock<Dst>, String>> {
        let n = sources.len();
        if destinations.len() != n {
            let m = format!("{n} sources but {} destinations", destinations.len());
            return (0..n).map(|_| Err(m.clone())).collect();
        }
        let request = TransferRequest {
            src: Src::ID,
            dst: Dst::ID,
            blocks: sources
                .iter()
                .zip(&destinations)
                .map(|(s, d)| (s.block_id(), d.block_id(), s.sequence_hash()))
                .collect(),
        };
        let outcome = self.workers.execute(request).await;
        let mut results: Vec<Option<Result<ImmutableBlock<Dst>, String>>> =
            (0..n).map(|_| None).collect();
        let mut complete = Vec::new();
        let mut idx = Vec::new();
        for (i, ((d, s), r)) in destinations
            .into_iter()
            .zip(sources)
            .zip(outcome)
            .enumerate()
        {
            match r {
                Ok(()) => match d.complete(s.sequence_hash()) {
                    Ok(c) => {
                        complete.push(c);
                        idx.push(i);
                    }
                    Err(e) => results[i] = Some(Err(format!("cannot register: {}", e.error))),
                },
                // Every rank has settled: the destination may go back to its pool now.
                Err(m) => results[i] = Some(Err(m)),
            }
        }
        for (i, b) in idx.into_iter().zip(self.dst.register_blocks(complete)) {
            results[i] = Some(Ok(b));
        }
        results
            .into_iter()
            .map(|r| r.unwrap_or_else(|| Err("no outcome".into())))
            .collect()
    }
}

#[cfg(test)]
mod tests;
