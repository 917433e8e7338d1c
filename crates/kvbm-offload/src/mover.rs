//! The moves: the one place above kvbm-physical where bytes move between layouts.
//! [`BlockMover`] moves blocks into destinations it registers, [`ExternalMover`] into slots the
//! caller manages (whole blocks, a layer range, or anonymous slots between memory layouts); the
//! lanes' executors run them over tier destinations ([`BlockMoveExecutor`],
//! [`CallerAllocated`]) and object destinations ([`ObjectMoveExecutor`]).
//!
//! ```text
//!  ResolvedBatch ──► allocate dst blocks ──► TransferManager::execute_transfer ──► per-block outcome
//!                    (BlockManager<Dst>)      (src ids → dst ids)                   │
//!                                                                ok: complete(hash) + register_blocks
//!                                                                err: drop the MutableBlock (slot back
//!                                                                     to the reset pool, never registered)
//! ```
//!
//! # Why one seam
//!
//! kvbm-physical's `execute_transfer` and `execute_transfer_inline` are `unsafe`: the transfer
//! manager checks transfers against each other, not against owners outside it, so the caller
//! vouches that every destination is the transfer's alone. This module's private `transfer` is
//! the only call of either in the crate (its twin `transfer_ranges`, for the range copies
//! `execute_copies` / `execute_copies_inline`, the only call of those), and every move of the workspace goes through it (the
//! engine's per-rank executor, `PhysicalWorker::execute`, is the one other production caller:
//! it runs what the leader already reserved on every rank). So the safety argument is made in
//! one place per kind of destination:
//!
//! * [`BlockMover`]: each destination is a `MutableBlock` the move owns (no other writer can
//!   reach its slot; it is registered only after its bytes arrived), or an object named by a
//!   key unique to its block;
//! * [`ObjectMoveExecutor`]: objects keyed by their own blocks;
//! * [`ExternalMover`]: its methods are `unsafe` and its caller states who reserved the slots
//!   (the scheduler-facing manager from `prepare_store` to `complete_store`, the connector for
//!   a vLLM worker job, an onboarding session for its unregistered layer-wise destinations).
//!
//! # Invariants
//!
//! The destination block is registered only after its bytes arrived, so the registry never
//! claims a block is present in a tier that does not hold it. Object keys are derived from the
//! sequence hash ([`object_key`]), the same mapping the presence checks and locks use, and every
//! transfer that may write or read a header passes each block's identity ([`identity_of`]: its
//! 256-bit BLAKE3 digest when it has one, else its sequence hash), so a disk slot or object
//! holding another block (including one whose 64-bit chain value collides) is an identity
//! mismatch, never served. The destination is registered with the source's digest, so the
//! identity travels with the block from tier to tier. Inline moves (host to host on the
//! caller's thread) pass no identity: host memory keeps no header.
//!
//! No lock is taken here: the block managers' and the transfer manager's own leaf locks only.

use std::future::Future;
use std::ops::Range;
use std::sync::Arc;

use kvbm_logical::{
    BlockDigest, BlockId, BlockManager, G4, ImmutableBlock, MutableBlock, SequenceHash, Tier,
};
use kvbm_physical::{
    Backing, LayoutHandle, ObjectPutMode, ObjectStorage, PhysicalError, PhysicalLayout, RangeCopy,
    StorageKind, StoredIdentity, TransferCompletion, TransferManager, TransferOptions,
    TransferOutcome,
};

use crate::batch::{BatchOutcome, ResolvedBatch, ResolvedBlock};
use crate::bound::BoundTier;
use crate::error::{BlockFailure, BlockFailureKind, OffloadError};
use crate::executor::MoveExecutor;

pub(crate) use crate::object::keys::{identity_of, object_key};

fn fail_all<R>(n: usize, kind: BlockFailureKind, message: &str) -> BatchOutcome<R> {
    (0..n)
        .map(|_| Err(BlockFailure::new(kind, message)))
        .collect()
}

fn physical_failure(e: PhysicalError) -> BlockFailure {
    BlockFailure::physical(e)
}

fn fail_all_physical<R>(n: usize, e: PhysicalError) -> BatchOutcome<R> {
    let e = Arc::new(e);
    (0..n)
        .map(|_| Err(BlockFailure::physical_shared(&e)))
        .collect()
}

/// What one block move yields: the destination block, registered, or why not.
pub type MoveOutcome<Dst> = Result<ImmutableBlock<Dst>, BlockFailure>;

/// One source of a move: the slot it is read from and the identity its content must have.
///
/// `digest` is the identity the caller *expects*: for a read from a tier that leaves the process
/// (G3, G4) it is compared with the identity stored in the slot's or object's header, so it
/// should come from the request (the caller's own [`TokenBlock`](kvbm_logical::TokenBlock)),
/// not from the stored block. `(BlockId, SequenceHash)` converts with no digest (identity: the
/// sequence hash).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MoveSource {
    /// Slot in the source layout (ignored for a keyed source).
    pub block_id: BlockId,
    /// The content's sequence hash (registered in the destination; the object key).
    pub sequence_hash: SequenceHash,
    /// The content's 256-bit digest, for BLAKE3 sequences.
    pub digest: Option<BlockDigest>,
    /// The digest the destination is registered with when it is not `digest`: for a source
    /// tier that stores the block under its sequence hash alone (its header names the hash),
    /// while the block's identity above it is a digest. `None`: `digest`.
    pub registered_digest: Option<BlockDigest>,
}

impl MoveSource {
    /// A source with the identity of a registered block (its hash and digest).
    pub fn of<T: Tier>(block: &ImmutableBlock<T>) -> Self {
        Self {
            block_id: block.block_id(),
            sequence_hash: block.sequence_hash(),
            digest: block.digest(),
            registered_digest: None,
        }
    }

    /// This source, its destination registered with `digest` (see
    /// [`registered_digest`](Self::registered_digest)).
    pub fn registered_as(mut self, digest: Option<BlockDigest>) -> Self {
        self.registered_digest = digest;
        self
    }

    /// The digest the destination is registered with.
    pub fn destination_digest(&self) -> Option<BlockDigest> {
        self.registered_digest.or(self.digest)
    }

    /// The identity written into and required of the header ([`identity_of`]).
    pub fn identity(&self) -> kvbm_physical::BlockIdentity {
        identity_of(self.sequence_hash, self.digest)
    }
}

impl From<(BlockId, SequenceHash)> for MoveSource {
    fn from((block_id, sequence_hash): (BlockId, SequenceHash)) -> Self {
        Self {
            block_id,
            sequence_hash,
            digest: None,
            registered_digest: None,
        }
    }
}

impl From<(BlockId, SequenceHash, Option<BlockDigest>)> for MoveSource {
    fn from(
        (block_id, sequence_hash, digest): (BlockId, SequenceHash, Option<BlockDigest>),
    ) -> Self {
        Self {
            block_id,
            sequence_hash,
            digest,
            registered_digest: None,
        }
    }
}

impl<T: Tier> From<&ResolvedBlock<T>> for MoveSource {
    fn from(b: &ResolvedBlock<T>) -> Self {
        Self {
            block_id: b.block_id,
            sequence_hash: b.sequence_hash,
            digest: b.digest,
            registered_digest: None,
        }
    }
}

/// A check of one destination's bytes after they arrived and before the block is registered
/// ([`BlockMover::with_arrival_check`]): given the source (its hash and expected identity) and
/// the destination's regions in order (one slice per layer region of the block), `Ok` lets
/// the block be registered; an `Err` drops the destination (its slot back to the pool, nothing
/// registered) and becomes that block's outcome. A check against a checksum recorded at write,
/// or against the bytes a block must have, plugs in here.
pub type ArrivalCheck =
    Arc<dyn Fn(&MoveSource, &[&[u8]]) -> Result<(), BlockFailure> + Send + Sync>;

/// Runs `check` on every block that arrived (`blocks[i]` ok), turning a refusal into that
/// block's failure.
fn check_arrivals<Dst: Tier>(
    check: &ArrivalCheck,
    layout: &PhysicalLayout,
    sources: &[MoveSource],
    destinations: &[MutableBlock<Dst>],
    blocks: &mut [Result<(), BlockFailure>],
) {
    let layers = layout.layout().config().num_layers;
    for ((src, dst), r) in sources.iter().zip(destinations).zip(blocks.iter_mut()) {
        if r.is_err() {
            continue;
        }
        // SAFETY: the layout is host memory (checked when the check was set) owned by the
        // transfer manager, which outlives this call; `dst` is a `MutableBlock` this move owns
        // exclusively, and its transfer has completed, so nothing writes the slot while these
        // slices live.
        let view = |&(addr, len): &(usize, usize)| unsafe {
            std::slice::from_raw_parts(addr as *const u8, len)
        };
        *r = match layout.block_addrs(dst.block_id(), 0..layers).as_slice() {
            // One region (every fully contiguous layout): no list to build.
            [one] => check(src, &[view(one)]),
            many => check(src, &many.iter().map(view).collect::<Vec<_>>()),
        };
    }
}

/// Where a move's transfer goes, and how it runs: the two layouts (a keyed side is addressed by
/// each block's [`object_key`], its slot ids become positions) and whether it copies on the
/// caller's thread.
#[derive(Debug, Clone, Copy)]
struct Route {
    src: LayoutHandle,
    keyed_src: bool,
    dst: LayoutHandle,
    keyed_dst: bool,
    /// Host to host on the caller's thread ([`TransferManager::execute_transfer_inline`]).
    inline: bool,
}

/// A transfer issued on the transfer manager's runtime, or already done on the caller's thread.
enum Issued {
    Pending(TransferCompletion),
    Done(TransferOutcome),
}

impl Issued {
    /// The transfer's outcome, once it settled.
    async fn settled(self) -> TransferOutcome {
        match self {
            Issued::Pending(c) => c.await,
            Issued::Done(outcome) => outcome,
        }
    }
}

/// The raw transfer: the only call of `TransferManager::execute_transfer` and
/// `execute_transfer_inline` in this crate, so every move of the workspace (every mover of
/// this module; the engine's per-rank executor aside) reaches kvbm-physical here.
///
/// # Safety
///
/// `TransferManager::execute_transfer`'s contract, for the whole transfer: every slot of
/// `dst_ids` is exclusively this transfer's to write (no owner expects its content to stay, no
/// view made outside the manager reads or writes it) and no source is written meanwhile. Each
/// caller says which handle or reservation vouches for that.
unsafe fn transfer(
    manager: &TransferManager,
    route: Route,
    src_ids: &[BlockId],
    dst_ids: &[BlockId],
    options: TransferOptions,
) -> Result<Issued, PhysicalError> {
    if route.inline {
        // SAFETY: this function's contract (for the duration of the call).
        unsafe { manager.execute_transfer_inline(route.src, src_ids, route.dst, dst_ids, options) }
            .map(Issued::Done)
    } else {
        // SAFETY: this function's contract (until the completion resolves).
        unsafe { manager.execute_transfer(route.src, src_ids, route.dst, dst_ids, options) }
            .map(Issued::Pending)
    }
}

/// The raw range copy: the only call of `TransferManager::execute_copies` and
/// `execute_copies_inline` in this crate (see [`transfer`]).
///
/// # Safety
///
/// As [`transfer`], for every block a copy of `copies` writes (and no block it reads is
/// written meanwhile).
unsafe fn transfer_ranges(
    manager: &TransferManager,
    route: Route,
    copies: Vec<RangeCopy>,
) -> Result<Issued, PhysicalError> {
    if route.inline {
        // SAFETY: this function's contract (for the duration of the call).
        unsafe { manager.execute_copies_inline(route.src, route.dst, copies) }.map(Issued::Done)
    } else {
        // SAFETY: this function's contract (until the completion resolves).
        unsafe { manager.execute_copies(route.src, route.dst, copies) }.map(Issued::Pending)
    }
}

/// Issues the transfer of `sources` into `dst_ids` now (the claims on every slot are taken
/// here; an inline route has copied when it returns). Every block carries its identity
/// ([`MoveSource::identity`]) to whatever header the transfer writes or reads; an inline route
/// is host memory on both sides, which keeps no header, so it passes none. `layers`: only that
/// range of each block (memory destinations only; `None`: whole blocks).
///
/// # Safety
///
/// As [`transfer`], for the slots of `dst_ids` (a keyed destination's objects are named by keys
/// unique to their blocks).
unsafe fn issue(
    manager: &TransferManager,
    route: Route,
    sources: &[MoveSource],
    dst_ids: &[BlockId],
    layers: Option<Range<usize>>,
    put_mode: ObjectPutMode,
) -> Result<Issued, PhysicalError> {
    let n = sources.len();
    let positions = || (0..n).collect::<Vec<BlockId>>();
    let src_ids: Vec<BlockId> = if route.keyed_src {
        positions()
    } else {
        sources.iter().map(|s| s.block_id).collect()
    };
    let keyed_dst_ids;
    let dst_ids: &[BlockId] = if route.keyed_dst {
        keyed_dst_ids = positions();
        &keyed_dst_ids
    } else {
        dst_ids
    };
    let mut options = if route.keyed_src || route.keyed_dst {
        TransferOptions::with_object_keys(
            sources
                .iter()
                .map(|s| object_key(s.sequence_hash))
                .collect(),
        )
    } else {
        TransferOptions::default()
    };
    if !route.inline {
        // A disk slot or object holding another block is an identity mismatch, never served.
        options = options.identities(sources.iter().map(MoveSource::identity).collect());
    }
    options.layer_range = layers;
    options.object_put_mode = put_mode;
    // SAFETY: this function's contract.
    unsafe { transfer(manager, route, &src_ids, dst_ids, options) }
}

/// `Ok` when the layouts `src` and `dst` of `manager` are both host memory and neither side is
/// keyed: what an inline mover (`label`) needs.
fn check_inline(
    manager: &TransferManager,
    label: &str,
    (src, dst): (LayoutHandle, LayoutHandle),
    keyed: bool,
) -> Result<(), OffloadError> {
    for (side, h) in [("source", src), ("destination", dst)] {
        let kind = manager
            .layout(h)
            .map_err(|e| OffloadError::Setup(format!("inline mover: {side} layout: {e}")))?
            .storage_kind();
        if kind != StorageKind::Host || keyed {
            return Err(OffloadError::InvalidConfig(format!(
                "inline mover {label}: the {side} is not host memory ({kind:?})"
            )));
        }
    }
    Ok(())
}

/// The per-block results of a settled transfer, in order (a block the manager reported no
/// outcome for fails).
fn settle(n: usize, outcome: TransferOutcome) -> Vec<Result<(), BlockFailure>> {
    let mut out: Vec<Result<(), BlockFailure>> = outcome
        .blocks
        .into_iter()
        .take(n)
        .map(|(_, r)| r.map_err(physical_failure))
        .collect();
    out.resize_with(n, || {
        Err(BlockFailure::new(
            BlockFailureKind::Transfer,
            "transfer manager reported no outcome",
        ))
    });
    out
}

/// The one block move, for every direction (G1↔G2, G2↔G3, G3→G2, G2→G4 put, G4→G2 get):
/// copies source slots of `Src` into **caller-allocated** destination blocks of `Dst` and
/// registers each destination whose bytes arrived.
///
/// ```text
///  sources (slot ids or keys + identities) ─┐
///  destinations: MutableBlock<Dst> (allocated by the caller) ─► transfer issued at the call
///                                                                   │ per block (future)
///                         ok: complete(hash) + register ─► ImmutableBlock<Dst>
///                         err: the MutableBlock drops (slot back to the reset pool), typed failure
/// ```
///
/// Keyed variants: a keyed *source* (an object layout, [`keyed_source`](Self::keyed_source))
/// reads each block from the object named by its sequence hash ([`object_key`]); a keyed
/// *destination* (a bound object tier, whose manager records presence) writes each block to
/// that object and registers the presence record once it is written.
///
/// The handles make exclusivity a type fact: a `MutableBlock` is owned by this move, so no other
/// writer can target the slot; the caller keeps the sources alive (an [`ImmutableBlock`], or an
/// external slot it manages) until the future resolves ([`move_from`](Self::move_from) holds
/// them in the future).
///
/// The transfer is issued when [`move_blocks`](Self::move_blocks) is called, not when its
/// future is first polled, and the future is `'static` and needs no runtime: a synchronous
/// caller may poll it without blocking (`now_or_never`) or wait for it
/// (`futures::executor::block_on`).
pub struct BlockMover<Src: Tier, Dst: Tier> {
    manager: Arc<TransferManager>,
    src_layout: LayoutHandle,
    dst_layout: LayoutHandle,
    dst: Arc<BlockManager<Dst>>,
    keyed_src: bool,
    keyed_dst: bool,
    /// Copy on the caller's thread ([`inline`](Self::inline)).
    inline: bool,
    /// Checked before registration ([`with_arrival_check`](Self::with_arrival_check)), with
    /// the destination's host layout.
    check: Option<(ArrivalCheck, Arc<PhysicalLayout>)>,
    _src: std::marker::PhantomData<fn() -> Src>,
}

impl<Src: Tier, Dst: Tier> Clone for BlockMover<Src, Dst> {
    fn clone(&self) -> Self {
        Self {
            manager: self.manager.clone(),
            src_layout: self.src_layout,
            dst_layout: self.dst_layout,
            dst: self.dst.clone(),
            keyed_src: self.keyed_src,
            keyed_dst: self.keyed_dst,
            inline: self.inline,
            check: self.check.clone(),
            _src: std::marker::PhantomData,
        }
    }
}

impl<Src: Tier, Dst: Tier> std::fmt::Debug for BlockMover<Src, Dst> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BlockMover")
            .field("src", &Src::ID)
            .field("dst", &Dst::ID)
            .field("src_layout", &self.src_layout)
            .field("dst_layout", &self.dst_layout)
            .field("keyed_src", &self.keyed_src)
            .field("keyed_dst", &self.keyed_dst)
            .field("inline", &self.inline)
            .field("checked", &self.check.is_some())
            .finish()
    }
}

impl<Src: Tier, Dst: Tier> BlockMover<Src, Dst> {
    /// A mover between two bound tiers (their block ids are their layouts' slot ids, checked
    /// by [`BoundTier::new`]). A keyed source (an object layout) reads each block from its key;
    /// a keyed destination writes each block to its key.
    ///
    /// # Errors
    /// [`OffloadError::InvalidConfig`] when the two tiers are bound to different transfer
    /// managers, or both are keyed (object to object).
    pub fn new(src: &BoundTier<Src>, dst: &BoundTier<Dst>) -> Result<Self, OffloadError> {
        if !Arc::ptr_eq(src.transfer_manager(), dst.transfer_manager()) {
            return Err(OffloadError::InvalidConfig(format!(
                "mover {:?} -> {:?}: the tiers are bound to different transfer managers",
                Src::ID,
                Dst::ID
            )));
        }
        if src.is_keyed() && dst.is_keyed() {
            return Err(OffloadError::InvalidConfig(format!(
                "mover {:?} -> {:?}: both tiers are keyed (object to object)",
                Src::ID,
                Dst::ID
            )));
        }
        let mut mover = Self::from_layout(src.layout(), dst)?;
        mover.keyed_src = src.is_keyed();
        Ok(mover)
    }

    /// A mover from a source the caller manages outside `kvbm-logical` (e.g. G1 slots of the
    /// inference engine, the slot table of a vLLM-style primary tier, or an object layout read
    /// by key with [`keyed_source`](Self::keyed_source)), registered with `dst`'s transfer
    /// manager, into the bound tier `dst` (keyed or not).
    ///
    /// # Errors
    /// [`OffloadError::Setup`] when `src_layout` is not registered with `dst`'s transfer
    /// manager.
    pub fn from_layout(
        src_layout: LayoutHandle,
        dst: &BoundTier<Dst>,
    ) -> Result<Self, OffloadError> {
        dst.transfer_manager().layout(src_layout).map_err(|e| {
            OffloadError::Setup(format!("mover into {:?}: source layout: {e}", Dst::ID))
        })?;
        Ok(Self {
            manager: dst.transfer_manager().clone(),
            src_layout,
            dst_layout: dst.layout(),
            dst: dst.manager().clone(),
            keyed_src: false,
            keyed_dst: dst.is_keyed(),
            inline: false,
            check: None,
            _src: std::marker::PhantomData,
        })
    }

    /// Copies on the caller's thread ([`TransferManager::execute_transfer_inline`]): for host to
    /// host moves (G2 → G1 where host memory stands in for the device, G1 → G2), where the hop
    /// to the transfer manager's runtime and back costs more than the copy. The future
    /// [`move_blocks`](Self::move_blocks) returns is then ready at once.
    ///
    /// # Errors
    /// [`OffloadError::InvalidConfig`] when either side is not host memory.
    pub fn inline(mut self) -> Result<Self, OffloadError> {
        let label = format!("{:?} -> {:?}", Src::ID, Dst::ID);
        check_inline(
            &self.manager,
            &label,
            (self.src_layout, self.dst_layout),
            self.keyed_src || self.keyed_dst,
        )?;
        self.inline = true;
        Ok(self)
    }

    /// The route of this mover's transfers.
    fn route(&self) -> Route {
        Route {
            src: self.src_layout,
            keyed_src: self.keyed_src,
            dst: self.dst_layout,
            keyed_dst: self.keyed_dst,
            inline: self.inline,
        }
    }

    /// Runs `check` on each destination's bytes after they arrived and before the block is
    /// registered (see [`ArrivalCheck`]): a block the check refuses is never registered.
    ///
    /// # Errors
    /// [`OffloadError::InvalidConfig`] when the destination is not host memory (its bytes
    /// cannot be read in place).
    pub fn with_arrival_check(mut self, check: ArrivalCheck) -> Result<Self, OffloadError> {
        let layout = self
            .manager
            .layout(self.dst_layout)
            .map_err(|e| OffloadError::Setup(format!("checked mover: destination layout: {e}")))?;
        if layout.storage_kind() != StorageKind::Host || self.keyed_dst {
            return Err(OffloadError::InvalidConfig(format!(
                "checked mover into {:?}: the destination is not host memory",
                Dst::ID
            )));
        }
        self.check = Some((check, layout));
        Ok(self)
    }

    /// The source is an object layout (the G4 get side): each block is read from the object
    /// keyed by its sequence hash ([`object_key`]); source slot ids are ignored. (A mover
    /// whose destination is keyed too fails every block: object to object is not a move.)
    pub fn keyed_source(mut self) -> Self {
        self.keyed_src = true;
        self
    }

    /// The destination manager (allocate destinations from it).
    pub fn destination(&self) -> &Arc<BlockManager<Dst>> {
        &self.dst
    }

    /// Moves `sources[i]` (source slot id and the identity its content must have, see
    /// [`MoveSource`]) into `destinations[i]`; one outcome per block, in order. A length
    /// mismatch fails every block (nothing is moved). The transfer is issued now; the future
    /// registers the destinations whose bytes arrived.
    ///
    /// Each destination is registered with the source's hash and digest ([`MoveSource::destination_digest`]). A source whose stored
    /// header names another identity fails with
    /// [`IdentityMismatch`](BlockFailureKind::IdentityMismatch), and so does a destination whose
    /// manager already holds the hash under another digest (policy `Reject`): a 64-bit
    /// collision is never served.
    pub fn move_blocks<S: Into<MoveSource> + Copy>(
        &self,
        sources: &[S],
        destinations: Vec<MutableBlock<Dst>>,
    ) -> impl Future<Output = Vec<MoveOutcome<Dst>>> + Send + 'static + use<Src, Dst, S> {
        let sources: Vec<MoveSource> = sources.iter().map(|s| (*s).into()).collect();
        let n = sources.len();
        let dst = self.dst.clone();
        let check = self.check.clone();
        let issued = if destinations.len() != n {
            let m = format!("{} sources but {} destinations", n, destinations.len());
            Err(fail_all(n, BlockFailureKind::Transfer, &m))
        } else if self.keyed_src && self.keyed_dst {
            let m = "object to object is not a move";
            Err(fail_all(n, BlockFailureKind::Transfer, m))
        } else {
            let dst_ids: Vec<BlockId> = destinations.iter().map(|b| b.block_id()).collect();
            // SAFETY: every destination is a `MutableBlock` this move owns (so no other writer
            // or reader can reach its slot, and it is registered only after the transfer), or,
            // for a keyed destination, an object named by a key unique to its block; the caller
            // keeps the sources alive and registered.
            unsafe {
                issue(
                    &self.manager,
                    self.route(),
                    &sources,
                    &dst_ids,
                    None,
                    ObjectPutMode::Overwrite,
                )
            }
            .map_err(|e| fail_all_physical(n, e))
        };
        async move {
            let outcome = match issued {
                Ok(issued) => issued.settled().await,
                Err(failed) => return failed,
            };
            let mut blocks = settle(n, outcome);
            if let Some((check, layout)) = &check {
                check_arrivals(check, layout, &sources, &destinations, &mut blocks);
            }
            register(&dst, &sources, destinations, blocks)
        }
    }

    /// [`move_blocks`](Self::move_blocks) from registered source blocks, held by the future
    /// until the move settles, each expected to have the identity it was registered with
    /// ([`MoveSource::of`]). To verify a read against the identity a request asked for, pass
    /// [`MoveSource`]s built from the request to [`move_blocks`](Self::move_blocks).
    ///
    /// A keyed source block registered without a digest (adopted by name: another instance's
    /// event, a lookup that found the object) is first asked its identity: one header read
    /// ([`ObjectStorage::stored_identity`](kvbm_physical::ObjectStorage::stored_identity), on
    /// the transfer manager's runtime), and when the header names the block
    /// ([`digest_named`](crate::digest_named)) the read expects, and the destination is
    /// registered with, the digest it records. The transfer of such a move is issued once those
    /// reads are done, not at the call. A header that is absent, foreign or unreadable leaves
    /// the source as it was: its read then fails (and deletes nothing).
    pub fn move_from(
        &self,
        sources: &[ImmutableBlock<Src>],
        destinations: Vec<MutableBlock<Dst>>,
    ) -> impl Future<Output = Vec<MoveOutcome<Dst>>> + Send + 'static + use<Src, Dst> {
        let mut ids: Vec<MoveSource> = sources.iter().map(MoveSource::of).collect();
        let held: Vec<ImmutableBlock<Src>> = sources.to_vec();
        let named = self.named_only(&ids);
        let moved = match named {
            None => futures::future::Either::Left(self.move_blocks(&ids, destinations)),
            Some(storage) => {
                let this = self.clone();
                let manager = self.manager.clone();
                futures::future::Either::Right(async move {
                    let asked: Vec<(usize, SequenceHash)> = ids
                        .iter()
                        .enumerate()
                        .filter(|(_, s)| s.digest.is_none())
                        .map(|(i, s)| (i, s.sequence_hash))
                        .collect();
                    let read = manager.spawn_io(async move {
                        let mut out = Vec::with_capacity(asked.len());
                        for (i, h) in asked {
                            if let Ok(StoredIdentity::Bound(id)) =
                                storage.stored_identity(&object_key(h)).await
                                && let Some(digest) = crate::object::digest_named(h, &id)
                            {
                                out.push((i, digest));
                            }
                        }
                        out
                    });
                    for (i, digest) in read.await.unwrap_or_default() {
                        ids[i].digest = digest;
                    }
                    this.move_blocks(&ids, destinations).await
                })
            }
        };
        async move {
            let out = moved.await;
            drop(held);
            out
        }
    }

    /// The object storage of a keyed source when some of `sources` carry no digest (blocks
    /// known only by name, whose identity [`move_from`](Self::move_from) reads first).
    fn named_only(&self, sources: &[MoveSource]) -> Option<Arc<ObjectStorage>> {
        if !self.keyed_src || self.keyed_dst || sources.iter().all(|s| s.digest.is_some()) {
            return None;
        }
        match self.manager.layout(self.src_layout).ok()?.backing() {
            Backing::Object(o) => Some(o.clone()),
            _ => None,
        }
    }
}

/// Registers each destination whose bytes arrived (`blocks[i]` ok) under its source's hash
/// and digest; the others drop (slot back to the reset pool).
fn register<Dst: Tier>(
    dst: &BlockManager<Dst>,
    sources: &[MoveSource],
    destinations: Vec<MutableBlock<Dst>>,
    blocks: Vec<Result<(), BlockFailure>>,
) -> Vec<MoveOutcome<Dst>> {
    let n = sources.len();
    let mut results: Vec<Option<MoveOutcome<Dst>>> = (0..n).map(|_| None).collect();
    let mut complete = Vec::with_capacity(n);
    let mut complete_idx = Vec::with_capacity(n);
    for (i, ((mutable, src), r)) in destinations
        .into_iter()
        .zip(sources)
        .zip(blocks)
        .enumerate()
    {
        match r {
            Ok(()) => {
                match mutable.complete_with_digest(src.sequence_hash, src.destination_digest()) {
                    Ok(c) => {
                        complete.push(c);
                        complete_idx.push(i);
                    }
                    Err(e) => {
                        results[i] = Some(Err(BlockFailure::new(
                            BlockFailureKind::Transfer,
                            format!("cannot register in destination: {}", e.error),
                        )))
                    }
                }
            }
            // The slot goes back to the reset pool; nothing is registered.
            Err(e) => results[i] = Some(Err(e)),
        }
    }
    for (i, registered) in complete_idx.into_iter().zip(dst.register_blocks(complete)) {
        // With duplication `Reject`, the manager hands back the block it already holds
        // under this hash: another block if its digest differs.
        results[i] = Some(if registered.digest() == sources[i].destination_digest() {
            Ok(registered)
        } else {
            Err(BlockFailure::new(
                BlockFailureKind::IdentityMismatch,
                format!(
                    "{:?} already holds {} under another identity",
                    Dst::ID,
                    sources[i].sequence_hash
                ),
            ))
        });
    }
    results
        .into_iter()
        .map(|r| {
            r.unwrap_or_else(|| {
                Err(BlockFailure::new(
                    BlockFailureKind::Transfer,
                    "transfer manager reported no outcome",
                ))
            })
        })
        .collect()
}

/// The one move into slots the caller manages outside `kvbm-logical` (G1 of the inference
/// engine, the slot table of a vLLM-style primary tier, the destinations of a layer-wise
/// onboarding): the same transfer, identities and typed per-block failures as [`BlockMover`],
/// but nothing is registered on the destination side (the caller records what arrived).
///
/// ```text
///  source: a bound tier (new), or caller-managed slots too (from_layout)
///     move_blocks / move_from   whole blocks, each with its identity ──┐
///     move_layers               a layer range of each block ───────────┼─► transfer issued at the call
///     copy_slots                anonymous slots, memory to memory ─────┘   (inline: done at the call)
///                                                   Ok(()) | BlockFailure per slot
/// ```
///
/// Why the three calls: a block a tier knows carries its identity into (and is checked against)
/// a disk slot's or object's header ([`move_blocks`](Self::move_blocks)); a layer range
/// ([`move_layers`](Self::move_layers)) leaves the block unfinished, so only the caller can say
/// when it is whole and register it; and a caller that moves *slots*, not blocks (vLLM's
/// worker is handed slot ids), has no identity to give ([`copy_slots`](Self::copy_slots), so
/// only between memory layouts, which keep no header). [`inline`](Self::inline) copies host to
/// host on the caller's thread, for all three.
///
/// # Safety argument
///
/// No handle proves that a caller-managed slot is free, so every call is `unsafe`: its caller
/// vouches, as for the raw transfer, that each destination slot is the move's alone until the
/// move settles (who reserved it: the scheduler-facing manager between `prepare_store` and
/// `complete_store`, the connector for a vLLM job, an onboarding session for its unregistered
/// destinations until the last layer). The sources are a bound tier's registered blocks the
/// caller holds, or slots it reserved for reading.
pub struct ExternalMover<Src: Tier> {
    manager: Arc<TransferManager>,
    src_layout: LayoutHandle,
    keyed_src: bool,
    dst_layout: LayoutHandle,
    /// Both sides are memory (host or device) and the source is not keyed: no header to bind
    /// an identity into, so [`copy_slots`](Self::copy_slots) may copy anonymous slots.
    memory: bool,
    /// Copy on the caller's thread ([`inline`](Self::inline)).
    inline: bool,
    _src: std::marker::PhantomData<fn() -> Src>,
}

impl<Src: Tier> Clone for ExternalMover<Src> {
    fn clone(&self) -> Self {
        Self {
            manager: self.manager.clone(),
            src_layout: self.src_layout,
            keyed_src: self.keyed_src,
            dst_layout: self.dst_layout,
            memory: self.memory,
            inline: self.inline,
            _src: std::marker::PhantomData,
        }
    }
}

impl<Src: Tier> std::fmt::Debug for ExternalMover<Src> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ExternalMover")
            .field("src", &Src::ID)
            .field("src_layout", &self.src_layout)
            .field("keyed_src", &self.keyed_src)
            .field("dst_layout", &self.dst_layout)
            .field("memory", &self.memory)
            .field("inline", &self.inline)
            .finish()
    }
}

impl<Src: Tier> ExternalMover<Src> {
    /// A mover from the bound tier `src` into `dst_layout` (registered with `src`'s transfer
    /// manager), whose slots the caller manages.
    ///
    /// # Errors
    /// [`OffloadError::Setup`] when `dst_layout` is not registered with `src`'s transfer
    /// manager.
    pub fn new(src: &BoundTier<Src>, dst_layout: LayoutHandle) -> Result<Self, OffloadError> {
        Self::over(
            src.transfer_manager(),
            (src.layout(), src.is_keyed()),
            dst_layout,
        )
    }

    /// A mover between two layouts of `manager` whose slots the caller manages on both sides
    /// (vLLM's worker: GPU blocks and the primary tier's slots); `Src` names the tier the
    /// source slots belong to.
    ///
    /// # Errors
    /// [`OffloadError::Setup`] when either layout is not registered with `manager`.
    pub fn from_layout(
        manager: &Arc<TransferManager>,
        src_layout: LayoutHandle,
        dst_layout: LayoutHandle,
    ) -> Result<Self, OffloadError> {
        Self::over(manager, (src_layout, false), dst_layout)
    }

    fn over(
        manager: &Arc<TransferManager>,
        (src_layout, keyed_src): (LayoutHandle, bool),
        dst_layout: LayoutHandle,
    ) -> Result<Self, OffloadError> {
        let kind = |side: &str, h: LayoutHandle| {
            manager.layout(h).map(|l| l.storage_kind()).map_err(|e| {
                OffloadError::Setup(format!("mover out of {:?}: {side} layout: {e}", Src::ID))
            })
        };
        let dst_kind = kind("destination", dst_layout)?;
        let src_kind = kind("source", src_layout)?;
        let memory = |k: StorageKind| matches!(k, StorageKind::Host | StorageKind::Device);
        Ok(Self {
            manager: manager.clone(),
            src_layout,
            keyed_src,
            dst_layout,
            memory: !keyed_src && memory(src_kind) && memory(dst_kind),
            inline: false,
            _src: std::marker::PhantomData,
        })
    }

    /// Copies on the caller's thread ([`TransferManager::execute_transfer_inline`]), as
    /// [`BlockMover::inline`]: for host to host moves (G1 → G2 into the slots a store
    /// reserved), where the hop to the transfer manager's runtime and back costs more than the
    /// copy. Every future this mover returns is then ready at once.
    ///
    /// # Errors
    /// [`OffloadError::InvalidConfig`] when either side is not host memory.
    pub fn inline(mut self) -> Result<Self, OffloadError> {
        let label = format!("{:?} -> external", Src::ID);
        check_inline(
            &self.manager,
            &label,
            (self.src_layout, self.dst_layout),
            self.keyed_src,
        )?;
        self.inline = true;
        Ok(self)
    }

    /// The route of this mover's transfers.
    fn route(&self) -> Route {
        Route {
            src: self.src_layout,
            keyed_src: self.keyed_src,
            dst: self.dst_layout,
            keyed_dst: false,
            inline: self.inline,
        }
    }

    /// Issues the transfer of `layers` (`None`: whole blocks) of `sources` into `dst_slots`
    /// now; `Err`: every block's failure, nothing moved.
    ///
    /// # Safety
    ///
    /// As [`move_blocks`](Self::move_blocks).
    unsafe fn start(
        &self,
        sources: &[MoveSource],
        dst_slots: &[BlockId],
        layers: Option<Range<usize>>,
    ) -> Result<Issued, Vec<Result<(), BlockFailure>>> {
        let n = sources.len();
        if dst_slots.len() != n {
            let m = format!("{} sources but {} destinations", n, dst_slots.len());
            return Err(fail_all(n, BlockFailureKind::Transfer, &m));
        }
        // SAFETY: every destination slot is vouched for by this function's caller.
        unsafe {
            issue(
                &self.manager,
                self.route(),
                sources,
                dst_slots,
                layers,
                ObjectPutMode::Overwrite,
            )
        }
        .map_err(|e| fail_all_physical(n, e))
    }

    /// Moves `sources[i]` (its slot, or its key for a keyed tier, and the identity its content
    /// must have) into slot `dst_slots[i]` of the destination layout; one outcome per block, in
    /// order. A length mismatch fails every block (nothing is moved). The transfer is issued
    /// now. The caller keeps the sources alive (or uses [`move_from`](Self::move_from)).
    ///
    /// # Safety
    ///
    /// The destination slots are the caller's, so their exclusivity is too (the contract of
    /// `TransferManager::execute_transfer`): until the returned future resolves (or is dropped
    /// and the transfer has ended), no reference or pointer made outside the transfer manager
    /// reads or writes a slot of `dst_slots`, and no owner expects its content to stay.
    pub unsafe fn move_blocks<S: Into<MoveSource> + Copy>(
        &self,
        sources: &[S],
        dst_slots: &[BlockId],
    ) -> impl Future<Output = Vec<Result<(), BlockFailure>>> + Send + 'static + use<Src, S> {
        let sources: Vec<MoveSource> = sources.iter().map(|s| (*s).into()).collect();
        // SAFETY: the caller's contract for `dst_slots` is this function's own.
        let started = unsafe { self.start(&sources, dst_slots, None) };
        settled(sources.len(), started)
    }

    /// [`move_blocks`](Self::move_blocks) of the layers `layers` only (layer-wise onboarding:
    /// one layer of every block at a time, into memory slots): the destinations stay
    /// unfinished blocks until the caller's last layer arrived, so this never registers
    /// anything either. An empty or out-of-range `layers` (the transfer manager's check), a
    /// keyed source (objects are read whole, [`Refused`](BlockFailureKind::Refused)) or a
    /// length mismatch fails every block without moving anything.
    ///
    /// # Safety
    ///
    /// As [`move_blocks`](Self::move_blocks): each slot of `dst_slots` is the caller's alone
    /// (typically a `MutableBlock` it holds unregistered until the last layer).
    pub unsafe fn move_layers<S: Into<MoveSource> + Copy>(
        &self,
        sources: &[S],
        dst_slots: &[BlockId],
        layers: Range<usize>,
    ) -> impl Future<Output = Vec<Result<(), BlockFailure>>> + Send + 'static + use<Src, S> {
        let sources: Vec<MoveSource> = sources.iter().map(|s| (*s).into()).collect();
        let n = sources.len();
        let started = if self.keyed_src {
            let m = format!(
                "{:?} is an object tier: it is read whole, not by layer",
                Src::ID
            );
            Err(fail_all(n, BlockFailureKind::Refused, &m))
        } else {
            // SAFETY: the caller's contract for `dst_slots` is this function's own.
            unsafe { self.start(&sources, dst_slots, Some(layers)) }
        };
        settled(n, started)
    }

    /// Refuses a copy of `what` without identities unless both sides are memory.
    fn require_memory(&self, what: &str) -> Result<(), BlockFailure> {
        if self.memory {
            return Ok(());
        }
        Err(BlockFailure::new(
            BlockFailureKind::Refused,
            format!(
                "{what} out of {:?} copied without identities: both sides must be memory",
                Src::ID
            ),
        ))
    }

    /// Copies slot `src_slots[i]` into slot `dst_slots[i]`, whole, with no identity: for a
    /// caller that moves slots rather than blocks (vLLM's worker, handed slot ids by its
    /// scheduler). One outcome per slot, in order, from the returned future. The transfer is
    /// issued now; unlike the block moves, a transfer that cannot start is returned here, not
    /// folded into the outcomes, since a job-based caller must answer "not started".
    ///
    /// # Errors
    /// Nothing started: [`Refused`](BlockFailureKind::Refused) when either side is not memory
    /// (a disk slot or object binds an identity in its header: move blocks there), a
    /// [`Transfer`](BlockFailureKind::Transfer) failure for lists of different lengths, or the
    /// transfer manager's refusal (a slot out of range, a slot busy in another transfer, ...).
    ///
    /// # Safety
    ///
    /// As [`move_blocks`](Self::move_blocks), and no source slot is written until the future
    /// resolves (the caller reserved both lists).
    pub unsafe fn copy_slots(
        &self,
        src_slots: &[BlockId],
        dst_slots: &[BlockId],
    ) -> Result<
        impl Future<Output = Vec<Result<(), BlockFailure>>> + Send + 'static + use<Src>,
        BlockFailure,
    > {
        self.require_memory("slots")?;
        let n = src_slots.len();
        if dst_slots.len() != n {
            return Err(BlockFailure::new(
                BlockFailureKind::Transfer,
                format!("{} source slots but {} destinations", n, dst_slots.len()),
            ));
        }
        // SAFETY: the caller's contract for both slot lists is this function's own.
        let issued = unsafe {
            transfer(
                &self.manager,
                self.route(),
                src_slots,
                dst_slots,
                TransferOptions::default(),
            )
        }
        .map_err(BlockFailure::physical)?;
        Ok(async move { settle(n, issued.settled().await) })
    }

    /// Runs `copies` (each a strided run of byte fragments from a source slot into a
    /// destination slot, [`RangeCopy`]) in order, with no identity: for a caller that moves
    /// parts of slots (vLLM's worker: a KV group's page within a GPU block, a sub-block of a
    /// CPU chunk, the fragments of a canonical page). One outcome per copy, in order, from the
    /// returned future. Issued now; a copy list that cannot start is returned here, as for
    /// [`copy_slots`](Self::copy_slots).
    ///
    /// # Errors
    /// Nothing started: [`Refused`](BlockFailureKind::Refused) when either side is not memory,
    /// or the transfer manager's refusal (a fragment outside its slot, a slot out of range or
    /// busy in another transfer, ...).
    ///
    /// # Safety
    ///
    /// As [`copy_slots`](Self::copy_slots), for every slot a copy reads or writes.
    pub unsafe fn copy_ranges(
        &self,
        copies: Vec<RangeCopy>,
    ) -> Result<
        impl Future<Output = Vec<Result<(), BlockFailure>>> + Send + 'static + use<Src>,
        BlockFailure,
    > {
        self.require_memory("ranges")?;
        let n = copies.len();
        // SAFETY: the caller's contract for every slot the copies touch is this function's own.
        let issued = unsafe { transfer_ranges(&self.manager, self.route(), copies) }
            .map_err(BlockFailure::physical)?;
        Ok(async move { settle(n, issued.settled().await) })
    }

    /// [`move_blocks`](Self::move_blocks) from held source blocks: `sources[i]`, expected to
    /// have the identity it was registered with ([`MoveSource::of`]), into `dst_slots[i]`. The
    /// future holds the sources until the move settles.
    ///
    /// # Safety
    ///
    /// As [`move_blocks`](Self::move_blocks).
    pub unsafe fn move_from(
        &self,
        sources: Vec<ImmutableBlock<Src>>,
        dst_slots: &[BlockId],
    ) -> impl Future<Output = Vec<Result<(), BlockFailure>>> + Send + 'static + use<Src> {
        let ids: Vec<MoveSource> = sources.iter().map(MoveSource::of).collect();
        // SAFETY: the caller's contract for `dst_slots` is this function's own.
        let moved = unsafe { self.move_blocks(&ids, dst_slots) };
        async move {
            let out = moved.await;
            drop(sources);
            out
        }
    }
}

/// The per-block outcomes of a move that registers nothing, once `started` settled.
async fn settled(
    n: usize,
    started: Result<Issued, Vec<Result<(), BlockFailure>>>,
) -> Vec<Result<(), BlockFailure>> {
    match started {
        Ok(issued) => settle(n, issued.settled().await),
        Err(failed) => failed,
    }
}

/// Moves blocks between two tiers through a [`BlockMover`], allocating the destination blocks
/// in `BlockManager<Dst>` right before the move (the offload lanes, where the pipeline decides
/// what moves). For destinations allocated by the caller before the transfer, use
/// [`CallerAllocated`].
pub struct BlockMoveExecutor<Src: Tier, Dst: Tier> {
    mover: BlockMover<Src, Dst>,
    /// How long a batch waits for destination room ([`PipelineConfig::room_patience`](crate::PipelineConfig::room_patience)).
    patience: std::time::Duration,
    /// Allocation retries that found the destination full (each one backoff sleep).
    waits: Arc<std::sync::atomic::AtomicU64>,
}

impl<Src: Tier, Dst: Tier> std::fmt::Debug for BlockMoveExecutor<Src, Dst> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BlockMoveExecutor")
            .field("mover", &self.mover)
            .field("patience", &self.patience)
            .finish()
    }
}

impl<Src: Tier, Dst: Tier> BlockMoveExecutor<Src, Dst> {
    /// An executor between two bound tiers (counts checked by [`BoundTier::new`]).
    ///
    /// # Errors
    /// As [`BlockMover::new`].
    pub fn new(src: &BoundTier<Src>, dst: &BoundTier<Dst>) -> Result<Self, OffloadError> {
        Ok(Self::from_mover(BlockMover::new(src, dst)?))
    }

    /// An executor over `mover`; a batch that finds the destination full fails `NoSpace` at
    /// once (see [`waiting_for_room`](Self::waiting_for_room)).
    pub fn from_mover(mover: BlockMover<Src, Dst>) -> Self {
        Self {
            mover,
            patience: std::time::Duration::ZERO,
            waits: Arc::default(),
        }
    }

    /// A batch that finds the destination full waits up to `patience` for room, retrying the
    /// allocation with a short backoff (50 µs doubling to 2 ms), instead of failing `NoSpace`
    /// at once: backpressure on the lane, no block dropped while the tiers below free slots.
    /// Only a batch larger than the whole destination, or one still without room after
    /// `patience` (something holds the tier for good: logged, never a hang), fails `NoSpace`.
    /// The lane's [`PipelineConfig::room_patience`](crate::PipelineConfig::room_patience);
    /// every retry that found the destination full is counted in `waits`.
    pub fn waiting_for_room(
        mut self,
        patience: std::time::Duration,
        waits: Arc<std::sync::atomic::AtomicU64>,
    ) -> Self {
        self.patience = patience;
        self.waits = waits;
        self
    }

    /// The mover.
    pub fn mover(&self) -> &BlockMover<Src, Dst> {
        &self.mover
    }
}

impl<Src: Tier, Dst: Tier> MoveExecutor<Src> for BlockMoveExecutor<Src, Dst> {
    type Output = ImmutableBlock<Dst>;

    fn execute(
        &self,
        batch: &ResolvedBatch<Src>,
    ) -> impl Future<Output = BatchOutcome<ImmutableBlock<Dst>>> + Send {
        let n = batch.len();
        let sources: Vec<MoveSource> = batch.blocks().iter().map(MoveSource::from).collect();
        async move {
            match self.allocate(n).await {
                Ok(dst_blocks) => self.mover.move_blocks(&sources, dst_blocks).await,
                Err(f) => (0..n).map(|_| Err(f.clone())).collect(),
            }
        }
    }
}

impl<Src: Tier, Dst: Tier> BlockMoveExecutor<Src, Dst> {
    /// `n` destination blocks, waiting for room as configured
    /// ([`waiting_for_room`](Self::waiting_for_room)).
    ///
    /// # Errors
    /// A [`NoSpace`](BlockFailureKind::NoSpace) failure when `n` exceeds the destination, or
    /// it had no room within the patience.
    pub async fn allocate(&self, n: usize) -> Result<Vec<MutableBlock<Dst>>, BlockFailure> {
        {
            let dst = self.mover.destination();
            if n > dst.total_blocks() {
                return Err(BlockFailure::new(
                    BlockFailureKind::NoSpace,
                    format!(
                        "a batch of {n} blocks exceeds {:?} ({} blocks)",
                        Dst::ID,
                        dst.total_blocks()
                    ),
                ));
            }
            let deadline = std::time::Instant::now() + self.patience;
            let mut backoff = std::time::Duration::from_micros(50);
            loop {
                match dst.allocate_blocks(n) {
                    Ok(b) => return Ok(b),
                    Err(e) if std::time::Instant::now() >= deadline => {
                        if !self.patience.is_zero() {
                            tracing::warn!(error = %e, "{:?} stayed full for {:?}", Dst::ID, self.patience);
                        }
                        return Err(BlockFailure::new(BlockFailureKind::NoSpace, e.to_string()));
                    }
                    Err(_) => {
                        self.waits
                            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        tokio::time::sleep(backoff).await;
                        backoff = (backoff * 2).min(std::time::Duration::from_millis(2));
                    }
                }
            }
        }
    }
}

/// A [`BlockMover`] as the executor of a lane whose destinations the caller allocated before
/// the transfer (onboarding G3→G2, G2→G1, promotion): each block moves into the
/// `MutableBlock<Dst>` enqueued with it ([`Pipeline::enqueue_into`](crate::Pipeline::enqueue_into)).
pub struct CallerAllocated<Src: Tier, Dst: Tier> {
    mover: BlockMover<Src, Dst>,
}

impl<Src: Tier, Dst: Tier> std::fmt::Debug for CallerAllocated<Src, Dst> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CallerAllocated")
            .field("mover", &self.mover)
            .finish()
    }
}

impl<Src: Tier, Dst: Tier> CallerAllocated<Src, Dst> {
    /// An executor moving into caller-allocated destinations through `mover`.
    pub fn new(mover: BlockMover<Src, Dst>) -> Self {
        Self { mover }
    }

    /// The mover.
    pub fn mover(&self) -> &BlockMover<Src, Dst> {
        &self.mover
    }
}

impl<Src: Tier, Dst: Tier> MoveExecutor<Src, MutableBlock<Dst>> for CallerAllocated<Src, Dst> {
    type Output = ImmutableBlock<Dst>;

    fn execute(
        &self,
        batch: &ResolvedBatch<Src, MutableBlock<Dst>>,
    ) -> impl Future<Output = BatchOutcome<ImmutableBlock<Dst>>> + Send {
        let sources: Vec<MoveSource> = batch.blocks().iter().map(MoveSource::from).collect();
        let destinations = batch.take_destinations();
        async move { self.mover.move_blocks(&sources, destinations).await }
    }
}

/// Writes blocks to an object-store layout, one object per block keyed by [`object_key`].
///
/// Optionally records presence in a `BlockManager<G4>` (the registry's view of the object
/// tier) for successfully written blocks only.
pub struct ObjectMoveExecutor<Src: Tier> {
    manager: Arc<TransferManager>,
    src_layout: LayoutHandle,
    object_layout: LayoutHandle,
    g4: Option<Arc<BlockManager<G4>>>,
    put_mode: ObjectPutMode,
    _src: std::marker::PhantomData<fn() -> Src>,
}

impl<Src: Tier> std::fmt::Debug for ObjectMoveExecutor<Src> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ObjectMoveExecutor")
            .field("src_layout", &self.src_layout)
            .field("object_layout", &self.object_layout)
            .finish()
    }
}

impl<Src: Tier> ObjectMoveExecutor<Src> {
    /// An executor writing from `src_layout` into the object layout `object_layout`.
    pub fn new(
        manager: Arc<TransferManager>,
        src_layout: LayoutHandle,
        object_layout: LayoutHandle,
    ) -> Self {
        Self {
            manager,
            src_layout,
            object_layout,
            g4: None,
            put_mode: ObjectPutMode::Overwrite,
            _src: std::marker::PhantomData,
        }
    }

    /// Records presence of written blocks in `g4`. Default: not recorded.
    pub fn with_g4_manager(mut self, g4: Arc<BlockManager<G4>>) -> Self {
        self.g4 = Some(g4);
        self
    }

    /// How puts treat an existing object. Default: overwrite.
    pub fn with_put_mode(mut self, mode: ObjectPutMode) -> Self {
        self.put_mode = mode;
        self
    }

    fn record_presence(&self, written: &[(SequenceHash, Option<BlockDigest>)]) {
        let Some(g4) = &self.g4 else { return };
        match g4.allocate_blocks(written.len()) {
            Ok(blocks) => {
                let complete: Vec<_> = blocks
                    .into_iter()
                    .zip(written)
                    .filter_map(|(b, (h, d))| b.complete_with_digest(*h, *d).ok())
                    .collect();
                drop(g4.register_blocks(complete));
            }
            Err(e) => tracing::warn!(error = %e, "cannot record G4 presence"),
        }
    }
}

impl<Src: Tier> MoveExecutor<Src> for ObjectMoveExecutor<Src> {
    type Output = SequenceHash;

    fn execute(
        &self,
        batch: &ResolvedBatch<Src>,
    ) -> impl Future<Output = BatchOutcome<SequenceHash>> + Send {
        let n = batch.len();
        let src_ids = batch.block_ids();
        let hashes = batch.sequence_hashes();
        let digests: Vec<Option<BlockDigest>> = batch.blocks().iter().map(|b| b.digest).collect();
        async move {
            // The move's own transfer (keyed put, identities), with this executor's put mode.
            let sources: Vec<MoveSource> = src_ids
                .iter()
                .zip(&hashes)
                .zip(&digests)
                .map(|((&id, &h), &d)| MoveSource::from((id, h, d)))
                .collect();
            let route = Route {
                src: self.src_layout,
                keyed_src: false,
                dst: self.object_layout,
                keyed_dst: true,
                inline: false,
            };
            // SAFETY: the destination is keyed: each block is written to the object named by
            // its own key ([`object_key`], unique to its block), which no slot of another
            // owner aliases; the caller holds the sources registered.
            let issued = unsafe { issue(&self.manager, route, &sources, &[], None, self.put_mode) };
            let blocks = match issued {
                Ok(issued) => settle(n, issued.settled().await),
                Err(e) => return fail_all_physical(n, e),
            };
            let mut out = Vec::with_capacity(n);
            let mut written = Vec::with_capacity(n);
            for (s, r) in sources.iter().zip(blocks) {
                match r {
                    Ok(()) => {
                        written.push((s.sequence_hash, s.digest));
                        out.push(Ok(s.sequence_hash));
                    }
                    Err(f) => out.push(Err(f)),
                }
            }
            self.record_presence(&written);
            out
        }
    }
}
