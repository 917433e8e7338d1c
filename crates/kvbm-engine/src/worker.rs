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
//!     | TransferRequest {src tier, dst tier, (src id, dst id, hash)..., digests}
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
//! * A block's identity travels with it: the request carries each source's digest (when it has
//!   one), every rank's disk or object read requires that identity (`identity_of`, as the
//!   offload lanes wrote it), and the destination is registered with the same digest.
//!
//! [`SpmdParallelWorkers`] calls in-process workers directly; workers in other processes are
//! driven through `transport::control::ControlledWorkers`
//! (NATS request/reply, feature `nats`), which implements the same [`ParallelWorkers`] seam.
//!
//! # Ranks
//!
//! Each rank of an [`SpmdParallelWorkers`] is a [`CoordinatedWorker`]: a worker that knows its
//! rank and world size, refuses requests addressed to another rank
//! ([`EngineError::WrongRank`](crate::EngineError::WrongRank)), and whose G4 storage is
//! checked to write under its own rank's key directory (see [`coordinated`]).
//!
//! # G4 through workers
//!
//! A request from or to G4 names each block's object by its sequence hash
//! ([`kvbm_offload::object_key`]); the rank's [`ObjectStorage`](kvbm_physical::ObjectStorage)
//! adds the namespace and, with more than one rank, `tp{world}.r{rank}/`.
//!
//! # Layouts
//!
//! A worker addresses its layouts by [`TierId`] (G1..G4, the same on every rank),
//! each mapped to the rank's own physical [`LayoutHandle`]. Where the leader's block manager is
//! at hand (in-process ranks), a tier is added as a [`BoundTier`]
//! ([`with_tier`](PhysicalWorker::with_tier)), which checks once that the rank's layout has
//! exactly the manager's block count and lives on this rank's transfer manager, so every block
//! id the leader hands out is a valid slot on this rank. A worker process (which has no logical
//! manager) adds raw layouts with [`with_layout`](PhysicalWorker::with_layout).
//!
//! # Layer ranges
//!
//! A [`TransferRequest`] may name a layer range (layer-wise onboarding, G2→G1):
//! [`SpmdLayerMover`] sends one request per layer, every rank copies that layer of every block,
//! and nothing is registered until the session has every layer (see [`crate::mover`]).
//!
//! # Locks
//!
//! None: a worker is immutable once built; the transfer manager does its own locking.

use std::any::Any;
use std::ops::Range;
use std::sync::Arc;

use futures::future::{BoxFuture, join_all};
use kvbm_logical::{
    BlockDigest, BlockId, BlockManager, ImmutableBlock, MutableBlock, SequenceHash, Tier, TierId,
};
use kvbm_offload::{
    BadCopies, BlockFailure, BlockFailureKind, BoundTier, MoveOutcome, identity_of, object_key,
};
use kvbm_physical::{LayoutHandle, TransferManager, TransferOptions};

use crate::mover::{BlockMove, BlockOutcome, LayerMove, fail_all, foreign_destinations};

/// One rank: its transfer manager and its layout per tier (bound to the leader's manager where
/// given as a [`BoundTier`]).
#[derive(Clone)]
pub struct PhysicalWorker {
    rank: usize,
    manager: Arc<TransferManager>,
    layouts: [Option<LayoutHandle>; 4],
    /// `BoundTier<T>` of tier `T::ID`, type-erased (see [`PhysicalWorker::bound`]).
    bound: [Option<Arc<dyn Any + Send + Sync>>; 4],
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
            bound: [None, None, None, None],
        }
    }

    /// Uses `layout` (registered with this worker's manager) for `tier`, unbound (no logical
    /// manager checked against it; for worker processes). Prefer [`with_tier`](Self::with_tier).
    pub fn with_layout(mut self, tier: TierId, layout: LayoutHandle) -> Self {
        self.layouts[tier.index()] = Some(layout);
        self.bound[tier.index()] = None;
        self
    }

    /// Uses the bound tier `tier` (the leader's manager bound to this rank's layout) for
    /// `T::ID`.
    ///
    /// # Errors
    /// [`EngineError::Config`](crate::EngineError::Config) (key `workers`) when `tier` is bound
    /// to another transfer manager than this rank's.
    pub fn with_tier<T: Tier>(mut self, tier: BoundTier<T>) -> crate::Result<Self> {
        if !Arc::ptr_eq(tier.transfer_manager(), &self.manager) {
            return Err(crate::EngineError::config(
                "workers",
                format!(
                    "rank {}: the {} tier is bound to another transfer manager",
                    self.rank,
                    T::ID
                ),
            ));
        }
        self.layouts[T::ID.index()] = Some(tier.layout());
        self.bound[T::ID.index()] = Some(Arc::new(tier));
        Ok(self)
    }

    /// A rank over `manager` with every given bound tier (see [`with_tier`](Self::with_tier)).
    ///
    /// # Errors
    /// As [`with_tier`](Self::with_tier).
    pub fn from_tiers(rank: usize, tiers: BoundTiers) -> crate::Result<Self> {
        let mut w = Self::new(rank, tiers.transfer_manager.clone());
        if let Some(t) = tiers.g1 {
            w = w.with_tier(t)?;
        }
        if let Some(t) = tiers.g2 {
            w = w.with_tier(t)?;
        }
        if let Some(t) = tiers.g3 {
            w = w.with_tier(t)?;
        }
        if let Some(t) = tiers.g4 {
            w = w.with_tier(t)?;
        }
        Ok(w)
    }

    /// The bound tier of `T`, when it was given as one.
    pub fn bound<T: Tier>(&self) -> Option<&BoundTier<T>> {
        self.bound[T::ID.index()]
            .as_ref()
            .and_then(|b| b.downcast_ref::<BoundTier<T>>())
    }

    /// The physical layout this rank uses for `handle`.
    pub fn resolve(&self, handle: TierId) -> Option<LayoutHandle> {
        self.layouts[handle.index()]
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
    /// A failure keeps its kind (a damaged copy, another block's, I/O…) and names this rank.
    /// Slots out of range of their layout fail with a refusal (nothing moves).
    ///
    /// # Safety
    ///
    /// A request names slots by id, which proves nothing about who owns them, so the caller
    /// vouches for `TransferManager::execute_transfer`'s contract: every destination slot is
    /// reserved for this request by the leader that owns the tier (a block it allocated and
    /// holds unregistered until the outcome, or an object named by its block's key), every
    /// source is a block it holds registered, and nothing on this rank reads or writes them
    /// outside the transfer manager meanwhile. Across processes the one caller is the cluster
    /// plane's `control::serve`, whose request comes from this worker's leader (see there).
    pub async unsafe fn execute(&self, request: &TransferRequest) -> Vec<BlockOutcome> {
        let n = request.blocks.len();
        let (Some(src), Some(dst)) = (self.layout(request.src), self.layout(request.dst)) else {
            return fail_all(
                n,
                BlockFailureKind::Refused,
                &format!(
                    "rank {}: no layout for {} or {}",
                    self.rank, request.src, request.dst
                ),
            );
        };
        let src_ids: Vec<BlockId> = request.blocks.iter().map(|b| b.0).collect();
        let dst_ids: Vec<BlockId> = request.blocks.iter().map(|b| b.1).collect();
        let object_keys = (request.src == TierId::G4 || request.dst == TierId::G4)
            .then(|| request.blocks.iter().map(|b| object_key(b.2)).collect());
        let options = TransferOptions {
            layer_range: request.layers.clone(),
            object_keys,
            ..TransferOptions::default()
        }
        .identities((0..n).map(|i| request.identity(i)).collect());
        // SAFETY: this fn's contract: the leader reserved every slot for this request
        // (destinations it allocated and holds until the outcome, or objects named by their
        // block's key; sources it holds registered); nothing on this rank reaches them outside
        // the manager.
        let issued = unsafe {
            self.manager
                .execute_transfer(src, &src_ids, dst, &dst_ids, options)
        };
        let completion = match issued {
            Ok(c) => c,
            Err(e) => {
                let f = on_rank(self.rank, BlockFailure::physical(e));
                return (0..n).map(|_| Err(f.clone())).collect();
            }
        };
        let outcome = completion.await;
        let mut results: Vec<BlockOutcome> = outcome
            .blocks
            .into_iter()
            .map(|(_, r)| r.map_err(|e| on_rank(self.rank, BlockFailure::physical(e))))
            .collect();
        results.resize_with(n, || {
            Err(BlockFailure::new(
                BlockFailureKind::ExecutorAborted,
                format!("rank {}: no outcome reported", self.rank),
            ))
        });
        results
    }
}

/// The bound tiers of one rank, all on `transfer_manager` (see [`PhysicalWorker::from_tiers`]).
pub struct BoundTiers {
    /// The rank's transfer manager.
    pub transfer_manager: Arc<TransferManager>,
    /// G1 (device, or host memory standing in for it).
    pub g1: Option<BoundTier<kvbm_logical::G1>>,
    /// G2 (pinned host).
    pub g2: Option<BoundTier<kvbm_logical::G2>>,
    /// G3 (disk).
    pub g3: Option<BoundTier<kvbm_logical::G3>>,
    /// G4 (objects).
    pub g4: Option<BoundTier<kvbm_logical::G4>>,
}

/// One operation for every rank: copy `blocks` (source slot, destination slot, the block's
/// hash) from tier `src` to tier `dst`. Each block's identity, written into and required of a
/// disk slot's or object's header, is its digest when `digests` names one, else its hash
/// (`kvbm_offload::identity_of`), as the offload lanes write it.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct TransferRequest {
    /// Source tier.
    pub src: TierId,
    /// Destination tier.
    pub dst: TierId,
    /// `(source block id, destination block id, sequence hash)`.
    pub blocks: Vec<(BlockId, BlockId, SequenceHash)>,
    /// Only these layers (layer-wise onboarding; memory destinations only). `None`: whole
    /// blocks. Absent on the wire means `None`, so older leaders' requests still decode.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub layers: Option<Range<usize>>,
    /// The blocks' 256-bit digests, co-indexed with `blocks`; empty when no block has one.
    /// Absent on the wire means empty, so older leaders' requests still decode.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub digests: Vec<Option<BlockDigest>>,
}

impl TransferRequest {
    /// Whole blocks `blocks` from `src` to `dst`.
    pub fn new(src: TierId, dst: TierId, blocks: Vec<(BlockId, BlockId, SequenceHash)>) -> Self {
        Self {
            src,
            dst,
            blocks,
            layers: None,
            digests: Vec::new(),
        }
    }

    /// Whole blocks from `sources` (registered: each block's hash and digest travel) into
    /// the slots `dst_ids`.
    pub fn from_sources<S: Tier>(
        dst: TierId,
        sources: &[ImmutableBlock<S>],
        dst_ids: impl IntoIterator<Item = BlockId>,
    ) -> Self {
        let mut r = Self::new(
            S::ID,
            dst,
            sources
                .iter()
                .zip(dst_ids)
                .map(|(s, d)| (s.block_id(), d, s.sequence_hash()))
                .collect(),
        );
        if sources.iter().any(|s| s.digest().is_some()) {
            r.digests = sources.iter().map(ImmutableBlock::digest).collect();
        }
        r
    }

    /// The identity block `i` carries in a header.
    pub fn identity(&self, i: usize) -> kvbm_physical::BlockIdentity {
        identity_of(self.blocks[i].2, self.digests.get(i).copied().flatten())
    }
}

/// A transfer whose slots are proven reserved: what [`ParallelWorkers::execute`] runs.
///
/// `TransferManager::execute_transfer`'s contract (every destination slot is the transfer's
/// alone, no source is written meanwhile) is proven once, where the slots are owned, instead
/// of being passed up as `unsafe` through every layer (rank → control → instance):
///
/// * `Reserved::new` (crate-private) takes the handles that own the slots: registered
///   sources and unregistered destination [`MutableBlock`]s, borrowed for the reservation's
///   lifetime. Only the movers call it ([`SpmdMover`], [`SpmdLayerMover`]), over the
///   destination manager they were built with, which is the proof that its blocks are the
///   ranks' slots: checked for in-process ranks ([`SpmdMover::bound`]), vouched for once
///   where the ranks are processes ([`SpmdMover::new`], `unsafe`: the instance checked their
///   described layouts at join).
/// * [`Reserved::vouched`] (`unsafe`) is for a request that arrives as bytes (a worker
///   process serving its leader's request): its caller states who reserved the slots.
///
/// As with kvbm-offload's movers, a future dropped before it resolved ends the borrow while
/// the ranks' transfers may still run; the transfer manager's claims refuse any other
/// transfer of those slots until they settle (`PhysicalError::BlockBusy`).
#[derive(Debug)]
pub struct Reserved<'a> {
    request: TransferRequest,
    _holds: std::marker::PhantomData<&'a ()>,
}

impl<'a> Reserved<'a> {
    /// `sources[i]` into `destinations[i]`, whole blocks (see the type's docs for why this is
    /// crate-private).
    pub(crate) fn new<Src: Tier, Dst: Tier>(
        sources: &'a [ImmutableBlock<Src>],
        destinations: &'a [MutableBlock<Dst>],
    ) -> Self {
        Self {
            request: TransferRequest::from_sources(
                Dst::ID,
                sources,
                destinations.iter().map(MutableBlock::block_id),
            ),
            _holds: std::marker::PhantomData,
        }
    }

    /// Only `layers` of each block (layer-wise onboarding).
    pub(crate) fn layers(mut self, layers: Range<usize>) -> Self {
        self.request.layers = Some(layers);
        self
    }

    /// A request whose slots the caller vouches for.
    ///
    /// # Safety
    ///
    /// `TransferManager::execute_transfer`'s contract on every rank the request reaches, until
    /// it settled: every destination slot is reserved for it by the leader that owns the tier
    /// (a block it allocated and holds unregistered, or an object named by its block's key),
    /// every source is a block it holds registered, and nothing reads or writes them outside
    /// the transfer manager meanwhile.
    pub unsafe fn vouched(request: TransferRequest) -> Reserved<'static> {
        Reserved {
            request,
            _holds: std::marker::PhantomData,
        }
    }

    /// The request.
    pub fn request(&self) -> &TransferRequest {
        &self.request
    }
}

/// The seam between the leader and its workers.
pub trait ParallelWorkers: Send + Sync {
    /// Ranks.
    fn world_size(&self) -> usize;
    /// Runs `reserved` on every rank; per block `Ok` only if every rank moved it, else the
    /// first failure. Resolves only after every rank settled.
    fn execute<'a>(&'a self, reserved: Reserved<'a>) -> BoxFuture<'a, Vec<BlockOutcome>>;
}

/// `f` with the rank it happened on in front of its message (the kind is kept).
pub(crate) fn on_rank(rank: usize, mut f: BlockFailure) -> BlockFailure {
    f.message = format!("rank {rank}: {}", f.message);
    f
}

/// Every operation on every rank, in-process: see the [module docs](self).
#[derive(Clone, Debug)]
pub struct SpmdParallelWorkers {
    ranks: Vec<CoordinatedWorker>,
}

impl SpmdParallelWorkers {
    /// Over `workers`, which must be ranks `0..n` in order, each made a
    /// [`CoordinatedWorker`] of a world of `n`.
    ///
    /// # Errors
    /// [`EngineError::Config`](crate::EngineError::Config) (key `workers`) when empty or the
    /// ranks are not `0..n` in order; as [`CoordinatedWorker::new`] (a rank's G4 storage
    /// built for another rank or world size).
    pub fn new(workers: Vec<PhysicalWorker>) -> crate::Result<Self> {
        let n = workers.len();
        Self::check_order(workers.iter().map(PhysicalWorker::rank))?;
        let ranks = workers
            .into_iter()
            .map(|w| CoordinatedWorker::new(w, n))
            .collect::<crate::Result<Vec<_>>>()?;
        Ok(Self { ranks })
    }

    /// Over coordinated ranks `0..n` of one world of `n`, in order.
    ///
    /// # Errors
    /// [`EngineError::Config`](crate::EngineError::Config) (key `workers`) when empty, the
    /// ranks are not `0..n` in order, or a rank's world size is not `n`.
    pub fn from_coordinated(ranks: Vec<CoordinatedWorker>) -> crate::Result<Self> {
        Self::check_order(ranks.iter().map(CoordinatedWorker::rank))?;
        if let Some(w) = ranks.iter().find(|w| w.world_size() != ranks.len()) {
            return Err(crate::EngineError::config(
                "workers",
                format!(
                    "{} given with {} ranks; every rank's world size must be the rank count",
                    w.address(),
                    ranks.len()
                ),
            ));
        }
        Ok(Self { ranks })
    }

    fn check_order(ranks: impl ExactSizeIterator<Item = usize>) -> crate::Result<()> {
        if ranks.len() == 0 {
            return Err(crate::EngineError::config("workers", "at least one rank"));
        }
        for (i, r) in ranks.enumerate() {
            if r != i {
                return Err(crate::EngineError::config(
                    "workers",
                    format!("worker {i} has rank {r}; ranks must be 0..n in order"),
                ));
            }
        }
        Ok(())
    }
}

impl SpmdParallelWorkers {
    /// The ranks, in order.
    pub fn ranks(&self) -> &[CoordinatedWorker] {
        &self.ranks
    }

    /// The ranks' workers, in order.
    pub fn workers(&self) -> impl ExactSizeIterator<Item = &Arc<PhysicalWorker>> {
        self.ranks.iter().map(CoordinatedWorker::worker)
    }

    /// Checks that every rank has tier `T` bound ([`PhysicalWorker::with_tier`]) to this very
    /// `manager`, so every block id it hands out is a slot on every rank.
    ///
    /// # Errors
    /// [`EngineError::Config`](crate::EngineError::Config) (key `workers`) naming the first
    /// rank whose `T` tier is unbound or bound to another manager.
    pub fn check_bound<T: Tier>(&self, manager: &Arc<BlockManager<T>>) -> crate::Result<()> {
        for w in self.workers() {
            match w.bound::<T>() {
                Some(b) if Arc::ptr_eq(b.manager(), manager) => {}
                Some(_) => {
                    return Err(crate::EngineError::config(
                        "workers",
                        format!(
                            "rank {}: its {} tier is bound to another block manager",
                            w.rank(),
                            T::ID
                        ),
                    ));
                }
                None => {
                    return Err(crate::EngineError::config(
                        "workers",
                        format!("rank {}: no bound {} tier", w.rank(), T::ID),
                    ));
                }
            }
        }
        Ok(())
    }

    /// Layers per block of tier `T` on every rank (from the ranks' layouts).
    ///
    /// # Errors
    /// [`EngineError::Config`](crate::EngineError::Config) (key `workers`) when a rank lacks
    /// the tier or the ranks disagree.
    pub fn num_layers<T: Tier>(&self) -> crate::Result<usize> {
        let mut layers = None;
        for w in self.workers() {
            let n = w
                .layout(T::ID)
                .and_then(|h| w.transfer_manager().layout(h).ok())
                .map(|l| l.layout().config().num_layers)
                .ok_or_else(|| {
                    crate::EngineError::config(
                        "workers",
                        format!("rank {}: no {} layout", w.rank(), T::ID),
                    )
                })?;
            if *layers.get_or_insert(n) != n {
                return Err(crate::EngineError::config(
                    "workers",
                    format!(
                        "rank {}: {} blocks of {n} layers, rank 0 has {}",
                        w.rank(),
                        T::ID,
                        layers.unwrap_or(0)
                    ),
                ));
            }
        }
        layers.ok_or_else(|| crate::EngineError::config("workers", "no ranks"))
    }
}

impl ParallelWorkers for SpmdParallelWorkers {
    fn world_size(&self) -> usize {
        self.ranks.len()
    }

    fn execute<'a>(&'a self, reserved: Reserved<'a>) -> BoxFuture<'a, Vec<BlockOutcome>> {
        Box::pin(async move {
            let request = reserved.request();
            let per_rank = join_all(self.ranks.iter().map(|w| w.execute(&reserved))).await;
            let mut merged: Vec<BlockOutcome> = vec![Ok(()); request.blocks.len()];
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
    rejected: Option<Arc<BadCopies<Src>>>,
    _src: std::marker::PhantomData<Src>,
}

impl<Src: Tier, Dst: Tier> SpmdMover<Src, Dst> {
    /// Moves from `Src` into `dst`'s tier through `workers`.
    ///
    /// # Safety
    ///
    /// `dst`'s blocks are the ranks' `Dst` slots, with this leader their only writer: every
    /// rank's `Dst` layout has at least `dst`'s block count, and nothing but moves built over
    /// `dst` writes those slots. This is the one place that is stated; the moves themselves
    /// are safe ([`Reserved`]). In process, [`bound`](Self::bound) checks it instead.
    pub unsafe fn new(workers: Arc<dyn ParallelWorkers>, dst: Arc<BlockManager<Dst>>) -> Self {
        Self {
            workers,
            dst,
            rejected: None,
            _src: std::marker::PhantomData,
        }
    }

    /// Hands every failed read of a source to `rejected` (kvbm-offload's rule: a copy proven
    /// bad, [`BlockFailureKind::drops_copy`], is recorded so the owner drops it from the source
    /// tier instead of reading it again; a transient failure, I/O, a timeout or a lost rank,
    /// keeps the copy).
    pub fn with_rejected(mut self, rejected: Arc<BadCopies<Src>>) -> Self {
        self.rejected = Some(rejected);
        self
    }

    /// As [`new`](Self::new) over in-process ranks whose `Dst` tier is bound to `dst` on
    /// every rank (checked: [`SpmdParallelWorkers::check_bound`]).
    ///
    /// # Errors
    /// As [`SpmdParallelWorkers::check_bound`].
    pub fn bound(
        workers: Arc<SpmdParallelWorkers>,
        dst: Arc<BlockManager<Dst>>,
    ) -> crate::Result<Self> {
        workers.check_bound(&dst)?;
        // SAFETY: `check_bound`: every rank's `Dst` tier is bound to `dst` (its layout has
        // exactly `dst`'s blocks, on that rank's transfer manager).
        Ok(unsafe { Self::new(workers, dst) })
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
    ) -> Vec<MoveOutcome<Dst>> {
        let n = sources.len();
        if destinations.len() != n {
            let m = format!("{n} sources but {} destinations", destinations.len());
            return fail_all(n, BlockFailureKind::Refused, &m);
        }
        if let Some(refused) = foreign_destinations(&self.dst, &destinations) {
            return refused;
        }
        // Every destination is a `MutableBlock` this move owns, of the manager the ranks' slots
        // are (`new`'s contract; checked just above), registered only after every rank
        // settled; the sources are held registered for the call.
        let outcome = self
            .workers
            .execute(Reserved::new(sources, &destinations))
            .await;
        let mut results: Vec<Option<MoveOutcome<Dst>>> = (0..n).map(|_| None).collect();
        let mut complete = Vec::new();
        let mut idx = Vec::new();
        for (i, ((d, s), r)) in destinations
            .into_iter()
            .zip(sources)
            .zip(outcome)
            .enumerate()
        {
            match r {
                // The destination keeps the source's identity (its digest), as the lanes do.
                Ok(()) => match d.complete_with_digest(s.sequence_hash(), s.digest()) {
                    Ok(c) => {
                        complete.push(c);
                        idx.push(i);
                    }
                    Err(e) => {
                        results[i] = Some(Err(BlockFailure::new(
                            BlockFailureKind::Transfer,
                            format!("cannot register: {}", e.error),
                        )))
                    }
                },
                // Every rank has settled: the destination may go back to its pool now.
                Err(m) => {
                    if let Some(rejected) = &self.rejected {
                        rejected.read_failed(s.sequence_hash(), &m);
                    }
                    results[i] = Some(Err(m))
                }
            }
        }
        for (i, b) in idx.into_iter().zip(self.dst.register_blocks(complete)) {
            results[i] = Some(Ok(b));
        }
        results
            .into_iter()
            .map(|r| {
                r.unwrap_or_else(|| {
                    Err(BlockFailure::new(
                        BlockFailureKind::ExecutorAborted,
                        "the workers reported no outcome",
                    ))
                })
            })
            .collect()
    }
}

impl<Src: Tier, Dst: Tier> BlockMove<Src, Dst> for SpmdMover<Src, Dst> {
    fn destination(&self) -> &Arc<BlockManager<Dst>> {
        SpmdMover::destination(self)
    }

    fn move_blocks<'a>(
        &'a self,
        sources: &'a [ImmutableBlock<Src>],
        destinations: Vec<MutableBlock<Dst>>,
    ) -> BoxFuture<'a, Vec<MoveOutcome<Dst>>> {
        Box::pin(self.move_from(sources, destinations))
    }
}

/// The leader's side of a layer-wise move across all ranks ([`LayerMove`]): one
/// [`TransferRequest`] with a layer range per call; nothing is registered (the onboarding
/// session registers the destinations after the last layer).
pub struct SpmdLayerMover<Src: Tier, Dst: Tier> {
    workers: Arc<dyn ParallelWorkers>,
    dst: Arc<BlockManager<Dst>>,
    num_layers: usize,
    _src: std::marker::PhantomData<fn() -> Src>,
}

impl<Src: Tier, Dst: Tier> SpmdLayerMover<Src, Dst> {
    /// Moves layers of `num_layers`-layer blocks from `Src` into `dst`'s tier through
    /// `workers`.
    ///
    /// # Errors
    /// [`EngineError::Config`](crate::EngineError::Config) (key `onboard.layerwise`) for zero
    /// layers.
    ///
    /// # Safety
    ///
    /// As [`SpmdMover::new`]: `dst`'s blocks are the ranks' `Dst` slots, this leader their only
    /// writer. In process, [`bound`](Self::bound) checks it instead.
    pub unsafe fn new(
        workers: Arc<dyn ParallelWorkers>,
        dst: Arc<BlockManager<Dst>>,
        num_layers: usize,
    ) -> crate::Result<Self> {
        if num_layers == 0 {
            return Err(crate::EngineError::config(
                "onboard.layerwise",
                "blocks have at least one layer",
            ));
        }
        Ok(Self {
            workers,
            dst,
            num_layers,
            _src: std::marker::PhantomData,
        })
    }
}

impl<Src: Tier, Dst: Tier> SpmdLayerMover<Src, Dst> {
    /// Over in-process ranks whose `Dst` tier is bound to `dst` on every rank, with the
    /// layer count read from the ranks' layouts (`Src` and `Dst` must agree).
    ///
    /// # Errors
    /// As [`SpmdParallelWorkers::check_bound`] and [`SpmdParallelWorkers::num_layers`];
    /// [`EngineError::Config`](crate::EngineError::Config) (key `onboard.layerwise`) when the
    /// two tiers' layer counts differ.
    pub fn bound(
        workers: Arc<SpmdParallelWorkers>,
        dst: Arc<BlockManager<Dst>>,
    ) -> crate::Result<Self> {
        workers.check_bound(&dst)?;
        let (src_layers, dst_layers) = (workers.num_layers::<Src>()?, workers.num_layers::<Dst>()?);
        if src_layers != dst_layers {
            return Err(crate::EngineError::config(
                "onboard.layerwise",
                format!(
                    "{} blocks have {src_layers} layers, {} blocks {dst_layers}",
                    Src::ID,
                    Dst::ID
                ),
            ));
        }
        // SAFETY: `check_bound`, as in `SpmdMover::bound`.
        unsafe { Self::new(workers, dst, dst_layers) }
    }
}

impl<Src: Tier, Dst: Tier> LayerMove<Src, Dst> for SpmdLayerMover<Src, Dst> {
    fn destination(&self) -> &Arc<BlockManager<Dst>> {
        &self.dst
    }

    fn num_layers(&self) -> usize {
        self.num_layers
    }

    fn move_layers<'a>(
        &'a self,
        sources: &'a [ImmutableBlock<Src>],
        destinations: &'a [MutableBlock<Dst>],
        layers: Range<usize>,
    ) -> BoxFuture<'a, Vec<BlockOutcome>> {
        Box::pin(async move {
            let n = sources.len();
            if destinations.len() != n {
                return fail_all(
                    n,
                    BlockFailureKind::Refused,
                    &format!("{n} sources but {} destinations", destinations.len()),
                );
            }
            if layers.start >= layers.end || layers.end > self.num_layers {
                return fail_all(
                    n,
                    BlockFailureKind::Refused,
                    &format!("layer range {layers:?} outside 0..{}", self.num_layers),
                );
            }
            if let Some(refused) = foreign_destinations(&self.dst, destinations) {
                return refused;
            }
            // The destinations are the caller's unregistered blocks of `dst` (the ranks' slots:
            // `new`'s contract; checked just above), the sources held registered.
            self.workers
                .execute(Reserved::new(sources, destinations).layers(layers))
                .await
        })
    }
}

pub mod coordinated;
pub use coordinated::{AddressedRequest, CoordinatedWorker};

#[cfg(test)]
mod tests;
