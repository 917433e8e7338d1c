//! Block states as types.
//!
//! ```text
//!   MutableBlock<T> ──complete(hash)──▶ CompleteBlock<T> ──register_blocks──▶ ImmutableBlock<T>
//!        ▲  (reset or filling)    (full, hashed)   │                       (shared, strong) │ ▲
//!        └───────────────reset()───────────────────┘                         downgrade │ │ upgrade
//!                                                                                      ▼ │
//!                                                                              WeakBlock<T>
//! ```
//!
//! * Dropping a [`MutableBlock`] or [`CompleteBlock`] returns its slot to the reset pool.
//! * Dropping the last [`ImmutableBlock`] of a block moves it to the inactive pool, where
//!   [`BlockManager::match_blocks`](crate::BlockManager::match_blocks) can still revive it
//!   until it is evicted. Cloning or dropping a non-last handle takes no lock.
//! * [`WeakBlock::upgrade`] is the commitment point: it returns `None` once the block was
//!   evicted (and no block with the same hash is registered in the tier any more).
//! * A failed transition hands the block back inside a [`BlockError`].
//! * `T` is the tier marker ([`G1`](crate::G1)..[`G4`](crate::G4)), so blocks of different
//!   tiers cannot be mixed up.

use std::fmt;
use std::marker::PhantomData;
use std::mem::ManuallyDrop;
use std::ptr::NonNull;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Weak};

use crate::BlockId;
use crate::error::{BlockError, LogicalError};
use crate::hash::{BlockDigest, SequenceHash, TokenBlock};
use crate::store::Core;
use crate::sync::{fence, ghost};
use crate::tier::Tier;

/// A block owned by one caller, reset or being filled. Dropping it returns the slot to the
/// reset pool.
pub struct MutableBlock<T: Tier> {
    core: Arc<Core>,
    id: u32,
    _tier: PhantomData<T>,
}

/// A full block with its sequence hash, not yet registered. Dropping it returns the slot to
/// the reset pool.
pub struct CompleteBlock<T: Tier> {
    core: Arc<Core>,
    id: u32,
    hash: SequenceHash,
    digest: Option<BlockDigest>,
    _tier: PhantomData<T>,
}

/// A registered block: a strong, shared reference (`Clone` adds one). While any exists the
/// block cannot be evicted; dropping the last moves it to the inactive pool.
pub struct ImmutableBlock<T: Tier> {
    /// A *pin* on the core, not a counted reference of its own: see [`Core::pin_if_first`].
    core: NonNull<Core>,
    id: u32,
    generation: u32,
    hash: SequenceHash,
    _tier: PhantomData<T>,
}

/// A weak reference to a registered block; [`upgrade`](Self::upgrade) fails once it is evicted.
pub struct WeakBlock<T: Tier> {
    core: Weak<Core>,
    id: u32,
    generation: u32,
    hash: SequenceHash,
    digest: Option<BlockDigest>,
    _tier: PhantomData<T>,
}

/// Takes the core out of a block without running its `Drop`.
fn take_core<B>(block: B, core: impl FnOnce(&B) -> &Arc<Core>) -> Arc<Core> {
    let block = ManuallyDrop::new(block);
    // SAFETY: `block` is never dropped or used again, so the `Arc` is moved out exactly once.
    unsafe { std::ptr::read(core(&block)) }
}

impl<T: Tier> MutableBlock<T> {
    pub(crate) fn new(core: Arc<Core>, id: u32) -> Self {
        Self {
            core,
            id,
            _tier: PhantomData,
        }
    }

    /// The slot's id within its tier's manager.
    pub fn block_id(&self) -> BlockId {
        self.id as BlockId
    }

    /// Whether this block's slot belongs to the manager whose core is `core`.
    pub(crate) fn is_of(&self, core: &Arc<Core>) -> bool {
        Arc::ptr_eq(&self.core, core)
    }

    /// Marks the block full with the given hash.
    ///
    /// # Errors
    /// [`LogicalError::BlockSizeMismatch`] (the block handed back) when `hash` was computed
    /// for another block size than the manager's.
    pub fn complete(
        self,
        hash: SequenceHash,
    ) -> Result<CompleteBlock<T>, BlockError<MutableBlock<T>>> {
        self.complete_with_digest(hash, None)
    }

    /// Marks the block full with its hash and, for blocks of a
    /// [`HashAlgorithm::Blake3`](crate::HashAlgorithm::Blake3) sequence, its 256-bit digest,
    /// which the registered block then carries ([`ImmutableBlock::digest`]): tiers that leave
    /// the process bind it as the block's identity.
    ///
    /// # Errors
    /// As [`complete`](Self::complete).
    pub fn complete_with_digest(
        self,
        hash: SequenceHash,
        digest: Option<BlockDigest>,
    ) -> Result<CompleteBlock<T>, BlockError<MutableBlock<T>>> {
        if hash.block_size() != self.core.block_size {
            let error = LogicalError::BlockSizeMismatch {
                hash: hash.as_u128(),
                expected: self.core.block_size,
                actual: hash.block_size(),
            };
            return Err(BlockError { block: self, error });
        }
        let id = self.id;
        let core = take_core(self, |b| &b.core);
        Ok(CompleteBlock {
            core,
            id,
            hash,
            digest,
            _tier: PhantomData,
        })
    }

    /// [`complete_with_digest`](Self::complete_with_digest) with the hash and digest of a
    /// [`TokenBlock`].
    ///
    /// # Errors
    /// As [`complete`](Self::complete).
    pub fn complete_token_block(
        self,
        block: &TokenBlock,
    ) -> Result<CompleteBlock<T>, BlockError<MutableBlock<T>>> {
        self.complete_with_digest(block.sequence_hash(), block.digest())
    }
}

impl<T: Tier> Drop for MutableBlock<T> {
    fn drop(&mut self) {
        self.core.store.lock().release_held(self.id);
    }
}

impl<T: Tier> CompleteBlock<T> {
    /// The slot's id within its tier's manager.
    pub fn block_id(&self) -> BlockId {
        self.id as BlockId
    }

    /// The hash it will be registered under.
    pub fn sequence_hash(&self) -> SequenceHash {
        self.hash
    }

    /// The digest it will be registered with, if any.
    pub fn digest(&self) -> Option<BlockDigest> {
        self.digest
    }

    /// Back to a mutable block, keeping the slot.
    pub fn reset(self) -> MutableBlock<T> {
        let id = self.id;
        MutableBlock::new(take_core(self, |b| &b.core), id)
    }

    /// Consumes the handle without releasing the slot (the caller takes over the slot).
    pub(crate) fn into_raw(self) -> (u32, SequenceHash, Option<BlockDigest>) {
        let (id, hash, digest) = (self.id, self.hash, self.digest);
        drop(take_core(self, |b| &b.core));
        (id, hash, digest)
    }

    pub(crate) fn core(&self) -> &Arc<Core> {
        &self.core
    }
}

impl<T: Tier> Drop for CompleteBlock<T> {
    fn drop(&mut self) {
        self.core.store.lock().release_held(self.id);
    }
}

// SAFETY: the pointer is to a `Core` (which is `Send + Sync`) kept alive by the slot's pin for
// as long as this handle exists; the handle only reads the core through shared references.
unsafe impl<T: Tier> Send for ImmutableBlock<T> {}
// SAFETY: as above.
unsafe impl<T: Tier> Sync for ImmutableBlock<T> {}

impl<T: Tier> ImmutableBlock<T> {
    /// Whether this block's slot belongs to the manager whose core is `core`.
    pub(crate) fn is_of(&self, core: &Arc<Core>) -> bool {
        std::ptr::eq(self.core.as_ptr().cast_const(), Arc::as_ptr(core))
    }

    /// Wraps a slot whose refcount the caller just incremented from `previous` (pinning the
    /// core when `previous == 0`, see [`Core::pin_if_first`]).
    #[inline]
    pub(crate) fn from_acquired(
        core: &Arc<Core>,
        id: u32,
        generation: u32,
        hash: SequenceHash,
        previous: u32,
    ) -> Self {
        Self {
            core: core.pin_if_first(previous),
            id,
            generation,
            hash,
            _tier: PhantomData,
        }
    }

    #[inline]
    fn core(&self) -> &Core {
        ghost::assert_alive(self.core.as_ptr());
        // SAFETY: the slot's pin keeps the core alive while this handle exists.
        unsafe { self.core.as_ref() }
    }

    /// The slot's id within its tier's manager.
    pub fn block_id(&self) -> BlockId {
        self.id as BlockId
    }

    /// The block's sequence hash.
    pub fn sequence_hash(&self) -> SequenceHash {
        self.hash
    }

    /// The 256-bit digest the block was registered with
    /// ([`MutableBlock::complete_with_digest`]); `None` for blocks registered by hash only.
    /// Lock-free.
    pub fn digest(&self) -> Option<BlockDigest> {
        self.core().digest(self.id)
    }

    /// Which registration of its slot this handle belongs to: the slot's generation, bumped
    /// (wrapping) each time the slot is registered. While any handle of a registration exists
    /// the slot's bytes cannot change (nothing writes a registered block), and a match of the
    /// inactive block keeps the registration; so a value derived from the bytes (a checksum)
    /// may be memoised under `(block_id, registration)`.
    pub fn registration(&self) -> u32 {
        self.generation
    }

    /// A weak reference to this block.
    pub fn downgrade(&self) -> WeakBlock<T> {
        ghost::assert_alive(self.core.as_ptr());
        // SAFETY: the pointer came from `Arc::as_ptr` and the core is alive (pinned); the
        // temporary `Arc` is never dropped, so no count changes hands.
        let arc = ManuallyDrop::new(unsafe { Arc::from_raw(self.core.as_ptr().cast_const()) });
        WeakBlock {
            core: Arc::downgrade(&arc),
            id: self.id,
            generation: self.generation,
            hash: self.hash,
            digest: self.digest(),
            _tier: PhantomData,
        }
    }

    /// How many strong references the block has right now (racy; for diagnostics).
    pub fn strong_count(&self) -> usize {
        self.core().refs[self.id as usize].load(Ordering::Relaxed) as usize
    }
}

impl<T: Tier> Clone for ImmutableBlock<T> {
    #[inline]
    fn clone(&self) -> Self {
        // never 0 -> 1 (we hold a reference), so no new pin
        self.core().refs[self.id as usize].fetch_add(1, Ordering::Relaxed);
        Self {
            core: self.core,
            id: self.id,
            generation: self.generation,
            hash: self.hash,
            _tier: PhantomData,
        }
    }
}

impl<T: Tier> Drop for ImmutableBlock<T> {
    #[inline]
    fn drop(&mut self) {
        let core = self.core();
        let refs = &core.refs[self.id as usize];
        if refs.fetch_sub(1, Ordering::Release) == 1 {
            fence(Ordering::Acquire);
            // The epoch's pin, owned by this handle from here on, keeps the core alive.
            ghost::assert_alive(self.core.as_ptr());
            let mut store = core.store.lock();
            ghost::assert_alive(self.core.as_ptr());
            store.release_registered(self.id, refs, &core.registry);
            drop(store);
            // SAFETY: this handle ended the slot's non-zero epoch, so it owns that epoch's pin;
            // the store lock is released above, so the core may be freed now.
            unsafe { Core::unpin(self.core) };
        }
    }
}

impl<T: Tier> WeakBlock<T> {
    /// The block's sequence hash.
    pub fn sequence_hash(&self) -> SequenceHash {
        self.hash
    }

    /// The digest the block carried when this weak reference was made (see
    /// [`ImmutableBlock::digest`]).
    pub fn digest(&self) -> Option<BlockDigest> {
        self.digest
    }

    /// The slot id the block had when this weak reference was made.
    pub fn block_id(&self) -> BlockId {
        self.id as BlockId
    }

    /// A strong reference, reviving the block if it is inactive; `None` once it was evicted
    /// (or the manager is gone). If the slot was evicted but the same hash has been registered
    /// again in this tier, that block is returned.
    pub fn upgrade(&self) -> Option<ImmutableBlock<T>> {
        let core = self.core.upgrade()?;
        let (id, generation, previous) = {
            let mut store = core.store.lock();
            let slot = &store.slots[self.id as usize];
            let same = slot.generation == self.generation
                && store.hashes[self.id as usize] == self.hash
                && matches!(
                    slot.state,
                    crate::store::SlotState::Active | crate::store::SlotState::Inactive
                );
            let id = if same {
                self.id
            } else {
                store.lookup(&self.hash)?
            };
            store.acquire(id, &core.registry);
            let previous = core.refs[id as usize].fetch_add(1, Ordering::Relaxed);
            (id, store.slots[id as usize].generation, previous)
        };
        Some(ImmutableBlock::from_acquired(
            &core, id, generation, self.hash, previous,
        ))
    }
}

impl<T: Tier> Clone for WeakBlock<T> {
    fn clone(&self) -> Self {
        Self {
            core: self.core.clone(),
            id: self.id,
            generation: self.generation,
            hash: self.hash,
            digest: self.digest,
            _tier: PhantomData,
        }
    }
}

impl<T: Tier> fmt::Debug for MutableBlock<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MutableBlock")
            .field("tier", &T::ID)
            .field("block_id", &self.id)
            .finish()
    }
}

impl<T: Tier> fmt::Debug for CompleteBlock<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CompleteBlock")
            .field("tier", &T::ID)
            .field("block_id", &self.id)
            .field("hash", &self.hash)
            .finish()
    }
}

impl<T: Tier> fmt::Debug for ImmutableBlock<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ImmutableBlock")
            .field("tier", &T::ID)
            .field("block_id", &self.id)
            .field("hash", &self.hash)
            .finish()
    }
}

impl<T: Tier> fmt::Debug for WeakBlock<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("WeakBlock")
            .field("tier", &T::ID)
            .field("block_id", &self.id)
            .field("hash", &self.hash)
            .finish()
    }
}
