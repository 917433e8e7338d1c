//! `PhysicalTier<T>`: a secondary tier whose bytes live in kvbm-physical storage — G3 disk (one
//! `fallocate`d file of fixed slots, O_DIRECT through io_uring, checksummed header per block) or
//! G4 objects (one object per chunk, checksummed) — owned as a [`BoundTier<T>`] (a
//! `BlockManager<T>` bound to the layout) and moved by kvbm-offload's one move: [`BlockMover`]
//! from the primary tier's pinned host slots into the tier (store), [`ExternalMover`] from the
//! tier into the primary's slots (load).
//!
//! # Keys
//!
//! vLLM's `OffloadKey` (block hash bytes and group index) is digested once ([`key_digest`]: a
//! domain-separated 256-bit BLAKE3 digest of every key byte). The digest is the block's identity
//! in the tier's manager and in every disk slot's or object's header ([`key_identity`]); its
//! first 128 bits, with the low bits set to the manager's block size, are the sequence hash the
//! manager registers the block under ([`key_hash`]), and, for objects, name the object
//! (`<namespace>/<hash hex>`, kvbm-offload's `object_key`).
//!
//! # Bookkeeping (scheduler thread only)
//!
//! ```text
//! submit_store: keys absent → Writing, room found for them (the oldest ready unread keys give
//!               way first; keys a tier full of busy ones has no room for are not stored)
//!               ─ booked ─ on_schedule_end: the step's stores, one task: victims dropped,
//!               MutableBlock<T>s allocated, one BlockMover move
//!                                   ─┬ ok: Ready (holds the registered ImmutableBlock<T>)
//!                                    └ failed: forgotten
//! submit_load:  every key Ready → readers+1 ─ ExternalMover into the reserved primary slots
//!               (its task holds the source blocks) ─► readers-1
//! ```
//!
//! The bookkeeping is the scheduler thread's; no work that grows with a chunk's bytes is, nor
//! the per-chunk work of a move beyond the bookkeeping: each move runs whole as one task on the
//! transfer manager's runtime (a store's: the keys' digests, the transfer's issue and
//! validation, the destinations' registration in the tier's manager, and a disk tier's journal
//! records around the write, with the xxh3-128 of each chunk stored computed on the runtime's
//! blocking pool beside it; a load's: the transfer's issue, validation and settling); the
//! scheduler thread polls its handle. What a chunk costs the scheduler thread is a few
//! probes: the keys' state and their eviction order share one slab (`TierKeys`), probed once
//! per call that names a key, and a job keeps its keys' places in it, so its completion probes
//! nothing.
//!
//! # Stores start at the step's end
//!
//! A store job is booked when it is submitted (its keys Writing, its room found: see "Where a
//! store's blocks come from") but its move starts at the scheduler step's end
//! (`on_schedule_end`), one move for all the jobs of the step, as vLLM's manager batches a
//! step's promotions. A cascade is
//! background work whose bytes sit pinned in the primary either way; started mid-step, its
//! I/O threads took cores from the step itself (on a machine short of cores, several times
//! the step's own time), and per-job moves paid a task, a checksum task and two journal
//! appends per request. `drain_jobs` (and so `shutdown`) starts what is queued before it
//! waits; `has_pending_work` counts queued jobs, so a caller keeps stepping until they ran.
//! Loads start when submitted: vLLM's manager already submits them at the step's end, and a
//! request waits for them.
//!
//! # Where a store's blocks come from
//!
//! A tier built with its own manager ([`disk`](PhysicalTier::disk),
//! [`object`](PhysicalTier::object)) counts its room itself: the manager's blocks are its
//! keys' (Ready or Writing) and its restored ones, so a store books its keys as long as those
//! fit the manager's size, after the oldest unread keys gave way. The blocks are freed and
//! allocated by the move's task (dropping the victims, then allocating: kvbm-logical's
//! eviction and registry work, a cache miss or two per chunk, off the scheduler thread).
//! Every task finds what its booking counted: a booking never counts another job's victims,
//! and a task frees its own before it allocates. A tier over a caller's manager, which others
//! may share, allocates at submission instead, where the manager says what is free; a key
//! the move finds no block for (a shared manager) is not stored.
//!
//! A key is Ready while the tier holds its `ImmutableBlock<T>`; dropping it (eviction, a copy
//! that failed verification) returns the block to the manager's inactive pool, from which the
//! manager reuses it. The tier's keys are the source of truth for presence; the manager is
//! never asked by hash, so a block it still holds inactive is never served again.
//!
//! # Failures
//!
//! A load reports a typed failure per block ([`BlockFailureKind`]), mapped to the tiering
//! manager's handling:
//!
//! | kind | the tier's copy | the job |
//! |---|---|---|
//! | `ChecksumMismatch` (corrupt bytes or header) | dropped: reads `MISS` | failed |
//! | `IdentityMismatch` (another chunk's bytes) | dropped | failed |
//! | `NotFound` (object vanished) | presence cleared | failed |
//! | `Io`, `Timeout`, `Cancelled`, others | kept (a retry may succeed) | failed |
//!
//! A failed store forgets the key (its destination block went back to the manager unregistered).
//! Jobs complete asynchronously on the transfer manager's runtime; `get_finished_jobs` polls the
//! moves without blocking, `drain_jobs` waits for all. A job is reported exactly once.
//!
//! # Persistence (disk)
//!
//! A disk tier keeps kvbm-offload's checked disk ([`CheckedDisk`]: the journal, the checksums,
//! the bad copies) over its file, the journal beside it (`g3.bin` → `g3.journal`):
//! a destination slot is unlisted before it is written, a chunk listed (slot, the key's hash,
//! the xxh3-128 of the bytes read from the primary) after its write completed. A tier opened on
//! the same file replays the journal and holds every listed block ("restored"); a restored
//! block becomes Ready for its key the first time that key is looked up or stored (a key is
//! known to the journal only by its hash), and every read of it is still checked against the
//! key's identity in the slot's header. Restored blocks nobody asked for are the first given
//! up when the tier needs room.
//!
//! A copy is dropped by kvbm-offload's one rule (`kvbm_offload::checked`): only a failure that
//! proves it bad ([`BlockFailureKind::drops_copy`]) drops it, unlisted from a disk tier's journal
//! at once; it leaves the tier's manager as soon as nothing holds it (`BadCopies::discard`),
//! whoever built the manager, and any read of a copy still held fails verification again. Keep
//! a caller's manager on `DuplicationPolicy::Allow` (the default) so a key stored again
//! registers its new block rather than being handed the stale one.

use std::sync::Arc;

use futures::FutureExt;
use futures::future::BoxFuture;
use hashbrown::HashMap;
use kvbm_logical::{
    BlockDigest, BlockManager, G2, G3, G4, ImmutableBlock, MutableBlock, SequenceHash, Tier,
};
use kvbm_offload::{
    BadCopies, BlockFailure, BlockFailureKind, BlockMover, BoundTier, CheckedDisk, ExternalMover,
    MoveOutcome, MoveSource,
};
use kvbm_physical::{
    BlockId, BlockIdentity, DiskConfig, LayoutHandle, ModelFingerprint, ObjectStorage,
    PhysicalLayout,
};

use crate::cpu::CpuPrimaryTier;
use crate::error::{Result, TieringError};
use crate::key::OffloadKey;
use crate::tiering::backpressure::{Backpressure, BackpressureDetector};
use crate::tiering::base::{JobId, JobResult, SecondaryTierManager, TierJob};
use crate::types::{
    Locality, LookupResult, Medium, OffloadingEvent, ReqContext, RequestOffloadingContext,
};

/// Tokens per block of the managers this module builds: a chunk is one block, and the sequence
/// hashes of [`key_hash`] carry no token geometry.
pub const TIER_BLOCK_SIZE: u32 = 1;

/// The digest of a key: domain-separated 256-bit BLAKE3 of the key's bytes (block hash and group
/// index; a key may be up to 39 bytes, more than a 32-byte identity holds, so it is digested,
/// not copied).
pub fn key_digest(key: &OffloadKey) -> BlockDigest {
    // The domain, the key's length and its bytes, hashed as one input (the same bytes as
    // feeding them to a `blake3::Hasher` in turn, without its incremental bookkeeping: this
    // runs once per chunk a tier learns, on the scheduler thread).
    const DOMAIN: &[u8] = b"kvbm-tiering-offload-key-v1";
    let k = key.as_bytes();
    let mut buf = [0u8; DOMAIN.len() + 1 + OffloadKey::MAX_LEN];
    buf[..DOMAIN.len()].copy_from_slice(DOMAIN);
    buf[DOMAIN.len()] = k.len() as u8;
    buf[DOMAIN.len() + 1..DOMAIN.len() + 1 + k.len()].copy_from_slice(k);
    BlockDigest(*blake3::hash(&buf[..DOMAIN.len() + 1 + k.len()]).as_bytes())
}

/// The sequence hash a key is registered under in a tier's `BlockManager` of `block_size`
/// tokens per block: the first 128 bits of [`key_digest`], low 4 bits replaced by
/// `log2(block_size)` (the field `SequenceHash` keeps its block size in). Deterministic, so any
/// process derives the same hash (and object name) from the same key.
///
/// # Panics
/// If `block_size` is not a power of two in `1..=1024` (a manager refuses any other).
pub fn key_hash(key: &OffloadKey, block_size: u32) -> SequenceHash {
    digest_hash(&key_digest(key), block_size)
}

/// The sequence hash of the key whose [`key_digest`] is `digest` ([`key_hash`] without
/// hashing the key again): for a caller that keeps the digest as the block's identity and
/// derives the hash from it.
///
/// # Panics
/// As [`key_hash`].
pub fn digest_hash(digest: &BlockDigest, block_size: u32) -> SequenceHash {
    assert!(
        block_size.is_power_of_two() && block_size <= 1024,
        "a manager's block size is a power of two in 1..=1024, not {block_size}"
    );
    SequenceHash::from_u128((digest.as_u128() & !0xF) | u128::from(block_size.trailing_zeros()))
}

/// The move source of the key whose digest is `digest`, at `block_id`: its identity, and the
/// hash derived from it for a manager of `block_size` tokens per block.
fn move_source(digest: BlockDigest, block_id: BlockId, block_size: u32) -> MoveSource {
    MoveSource {
        block_id,
        sequence_hash: digest_hash(&digest, block_size),
        digest: Some(digest),
        registered_digest: None,
    }
}

/// The identity a chunk's header carries in a disk slot or object, and which a load requires:
/// [`key_digest`] as a `BlockIdentity` (kvbm-offload's `identity_of(hash, Some(digest))`).
pub fn key_identity(key: &OffloadKey) -> BlockIdentity {
    BlockIdentity::from_bytes(key_digest(key).0)
}

mod keys;

use keys::TierKeys;

/// What the tier keeps with a Ready key: its registered block, and the key's digest (its
/// identity in every move: a load's source expects the identity of the key asked for, not
/// whatever the stored block was registered with).
struct Held<T: Tier> {
    block: ImmutableBlock<T>,
    digest: BlockDigest,
}

struct JobMeta {
    job_id: JobId,
    keys: Vec<OffloadKey>,
    /// Each key's node in the tier's [`TierKeys`], co-indexed (a job's nodes stay its keys'
    /// until it is finished: see `keys`'s invariants).
    nodes: Vec<u32>,
    bytes: u64,
    started: std::time::Instant,
    /// The request the job serves: a store's stored event names it (vLLM 0.34).
    req_context: ReqContext,
}

enum Move<T: Tier> {
    /// The move's outcomes (a task on the transfer manager's runtime: see `store_move`).
    Store(BoxFuture<'static, Vec<MoveOutcome<T>>>),
    Load(BoxFuture<'static, Vec<std::result::Result<(), BlockFailure>>>),
}

/// The outcomes of a move's `n` chunks from its task's handle. A task that could not finish
/// (the runtime shut down under it, or it panicked) fails every chunk `Cancelled`: none counts
/// as moved.
fn task_outcomes<R, E: std::fmt::Display>(
    task: impl Future<Output = std::result::Result<Vec<std::result::Result<R, BlockFailure>>, E>>
    + Send
    + 'static,
    n: usize,
    what: &'static str,
) -> BoxFuture<'static, Vec<std::result::Result<R, BlockFailure>>> {
    task.map(move |r| {
        r.unwrap_or_else(|e| {
            let m = format!("the {what}'s task did not finish: {e}");
            (0..n)
                .map(|_| Err(BlockFailure::new(BlockFailureKind::Cancelled, m.clone())))
                .collect()
        })
    })
    .boxed()
}

/// Up to `n` blocks from `bound`'s manager (fewer when the rest of it is busy, or the manager
/// is shared and others hold the rest).
fn allocate_upto<T: Tier>(bound: &BoundTier<T>, n: usize) -> Vec<MutableBlock<T>> {
    if n == 0 {
        return Vec::new();
    }
    if let Ok(blocks) = bound.allocate(n) {
        return blocks;
    }
    // Short of `n`: as many as the manager gives, one at a time.
    let mut out = Vec::with_capacity(n);
    while out.len() < n {
        match bound.allocate(1) {
            Ok(mut b) => out.append(&mut b),
            Err(_) => break,
        }
    }
    out
}

/// A journaled store's move ([`CheckedDisk::write`]: unlist
/// the slots, write, list what was written), with the xxh3-128 of each source chunk (the
/// primary's `slots`, co-indexed with `sources`) computed on the runtime's blocking pool
/// beside it.
async fn store_recorded<T: Tier>(
    tm: &Arc<kvbm_physical::TransferManager>,
    mover: &BlockMover<G2, T>,
    checked: &CheckedDisk<T>,
    memory: &Arc<PhysicalLayout>,
    sources: &[MoveSource],
    destinations: Vec<MutableBlock<T>>,
    slots: Vec<BlockId>,
) -> Vec<MoveOutcome<T>> {
    let hashes: Vec<u128> = sources.iter().map(|s| s.sequence_hash.as_u128()).collect();
    let memory = memory.clone();
    let sums = tm.spawn_blocking(move || {
        hashes
            .into_iter()
            .zip(slots)
            .map(|(h, s)| {
                let (addr, len) = memory
                    .block_span(s)
                    .unwrap_or_else(|| memory.block_addrs(s, 0..1)[0]);
                // SAFETY: host memory of the primary layout, which outlives the tier; the
                // job's chunks are pinned by the tiering manager (nothing writes them) until
                // the job is reported, which waits for this task: the move's task awaits it,
                // and a job is reported only once that task settled (`get_finished_jobs`,
                // `drain_jobs`; dropping the tier waits for it too).
                let bytes = unsafe { std::slice::from_raw_parts(addr as *const u8, len) };
                (h, kvbm_physical::checksum::checksum(bytes))
            })
            .collect::<Vec<(u128, u128)>>()
    });
    // A checksum task that could not run (the runtime going away) lists nothing: the chunks
    // stay readable for this run, as when the journal cannot be appended.
    let sums = async { sums.await.unwrap_or_default() };
    checked.write(mover, sources, destinations, sums).await
}

/// A move in flight and the jobs it serves: one load, or a step's stores, whose chunks the
/// move's outcomes list job after job.
struct Inflight<T: Tier> {
    jobs: Vec<JobMeta>,
    mv: Move<T>,
}

/// A store job booked but not started (see "Stores start at the step's end").
struct Queued<T: Tier> {
    meta: JobMeta,
    /// The blocks of the first keys, allocated at submission (a caller's manager); the move's
    /// task allocates the rest (see "Where a store's blocks come from").
    destinations: Vec<MutableBlock<T>>,
    /// Blocks of keys that gave way for this job's, dropped by the move's task.
    victims: Vec<ImmutableBlock<T>>,
    /// The primary's chunks, co-indexed with `meta.keys`.
    slots: Vec<BlockId>,
}

enum Settled<T: Tier> {
    Store(Vec<MoveOutcome<T>>),
    Load(Vec<std::result::Result<(), BlockFailure>>),
}

impl<T: Tier> Inflight<T> {
    fn poll_now(&mut self) -> Option<Settled<T>> {
        match &mut self.mv {
            Move::Store(f) => f.now_or_never().map(Settled::Store),
            Move::Load(f) => f.now_or_never().map(Settled::Load),
        }
    }

    fn wait(self) -> (Vec<JobMeta>, Settled<T>) {
        let settled = match self.mv {
            Move::Store(f) => Settled::Store(futures::executor::block_on(f)),
            Move::Load(f) => Settled::Load(futures::executor::block_on(f)),
        };
        (self.jobs, settled)
    }
}

/// A disk tier ([`PhysicalTier::disk`]).
pub type DiskTier = PhysicalTier<G3>;
/// An object tier ([`PhysicalTier::object`]).
pub type ObjectTier = PhysicalTier<G4>;

/// A G3 (disk) or G4 (object) secondary tier over a [`BoundTier<T>`], moving bytes with the one
/// move (see the [module docs](self)).
pub struct PhysicalTier<T: Tier> {
    tier_type: String,
    medium: Medium,
    locality: Locality,
    chunk_bytes: usize,
    bound: BoundTier<T>,
    store: BlockMover<G2, T>,
    load: ExternalMover<T>,
    /// Registered by this tier's own constructor (unregistered at shutdown).
    owned_layout: Option<LayoutHandle>,
    /// Every key the tier knows (Writing or Ready) and the Ready keys' eviction order.
    keys: TierKeys<Held<T>>,
    inflight: Vec<Inflight<T>>,
    /// Store jobs booked this step, started at its end.
    queued: Vec<Queued<T>>,
    done: Vec<JobResult>,
    detector: Option<BackpressureDetector>,
    failures: HashMap<BlockFailureKind, u64>,
    /// The disk tier's checks (kvbm-offload's [`CheckedDisk`]: journal, checksums, bad
    /// copies); `None` for objects.
    checked: Option<Arc<CheckedDisk<T>>>,
    /// An object tier's copies proven bad (a disk tier's are its checked disk's).
    bad: BadCopies<T>,
    /// Blocks the journal listed at open that no key has claimed yet, by sequence hash.
    restored: HashMap<SequenceHash, ImmutableBlock<T>>,
    /// The primary's memory (checksums of what a journaled store writes).
    primary_memory: Arc<PhysicalLayout>,
    /// vLLM-format events of this tier's contents (`None`: events off): a chunk stored, a
    /// chunk evicted for room, a copy dropped because a read proved it bad.
    events: Option<Vec<OffloadingEvent>>,
}

impl<T: Tier> PhysicalTier<T> {
    /// A tier over `tier`, a bound tier the caller owns (its manager and layout; the layout's
    /// block geometry is `primary`'s, i.e. built with [`CpuPrimaryTier::block_layout`]), registered with the same transfer manager as
    /// `primary`'s memory. A keyed (object) tier reports type `obj` and remote locality, another
    /// `disk` and local; [`with_tier_type`](Self::with_tier_type) renames it.
    ///
    /// # Errors
    /// [`TieringError::Config`] when `primary` is not registered with a transfer manager, or
    /// with another one than `tier`, or the layout's block geometry differs from the primary's;
    /// [`TieringError::Offload`] when the movers cannot be built.
    pub fn over(primary: &CpuPrimaryTier, tier: BoundTier<T>) -> Result<Self> {
        let (tm, primary_h) = primary.transfer().ok_or_else(|| {
            TieringError::Config(
                "the primary tier's memory is not registered with a TransferManager \
                 (build it with CpuPrimaryTier::with_transfer_manager)"
                    .into(),
            )
        })?;
        if !Arc::ptr_eq(tm, tier.transfer_manager()) {
            return Err(TieringError::Config(format!(
                "tier {:?}: bound to another transfer manager than the primary tier's memory",
                T::ID
            )));
        }
        let theirs = *tm.layout(tier.layout())?.layout().config();
        let ours = *tm.layout(primary_h)?.layout().config();
        if !theirs.same_block_geometry(&ours) {
            return Err(TieringError::Config(format!(
                "tier {:?}: block geometry {theirs:?} differs from the primary's chunks \
                 {ours:?} (build the layout with CpuPrimaryTier::block_layout)",
                T::ID
            )));
        }
        let primary_memory = tm.layout(primary_h)?;
        let store = BlockMover::<G2, T>::from_layout(primary_h, &tier)?;
        let load = ExternalMover::new(&tier, primary_h)?;
        let (tier_type, locality) = if tier.is_keyed() {
            ("obj", Locality::Remote)
        } else {
            ("disk", Locality::Local)
        };
        // Sized for a full tier up front (up to a million keys, tens of MiB): a tier filling
        // up, every deployment's first steps, would otherwise grow its maps on the scheduler
        // thread, a rehash of everything so far at a time.
        let capacity = tier.manager().total_blocks().min(1 << 20);
        Ok(Self {
            tier_type: tier_type.into(),
            medium: Medium::Storage,
            locality,
            chunk_bytes: primary.chunk_bytes(),
            bound: tier,
            store,
            load,
            owned_layout: None,
            keys: TierKeys::with_capacity(capacity),
            inflight: Vec::new(),
            queued: Vec::new(),
            done: Vec::new(),
            detector: None,
            failures: HashMap::new(),
            checked: None,
            bad: BadCopies::default(),
            restored: HashMap::new(),
            primary_memory,
            events: None,
        })
    }

    /// Blocks restored from the journal that no key has claimed yet.
    pub fn num_restored(&self) -> usize {
        self.restored.len()
    }

    /// Claims the restored block of `key` (which the tier does not know), if the journal
    /// listed one: it becomes Ready. Returns its node.
    fn claim_restored(&mut self, key: &OffloadKey) -> Option<u32> {
        if self.restored.is_empty() {
            return None;
        }
        let digest = key_digest(key);
        let h = digest_hash(&digest, self.bound.manager().block_size());
        let block = self.restored.remove(&h)?;
        Some(self.keys.insert(*key, Some(Held { block, digest })))
    }

    /// The store move of a job (`keys` from the primary's `slots`, co-indexed), run whole as
    /// one task on the transfer manager's runtime: the keys' digests, the transfer's issue and
    /// validation, the destinations' registration in the tier's manager and, for a journaled
    /// tier, the journal's protocol around the write
    /// ([`CheckedDisk::write`]: unlist the slots, write, list
    /// what was written) with the xxh3-128 of each source chunk computed on the runtime's
    /// blocking pool beside the move. None of it runs on the caller's (the scheduler's)
    /// thread, where a job of many small chunks would cost the step a digest, a journal
    /// record, a claim and a registration per chunk; the caller polls the task's handle.
    ///
    /// `destinations` are the first keys' blocks; the task allocates the rest from the tier's
    /// manager after dropping `victims` (the blocks of the keys that gave way for them: see
    /// "Where a store's blocks come from"). A key left without a block is not stored: its
    /// outcome is a `NoSpace` failure, which [`finish`](Self::finish) forgets quietly.
    fn store_move(
        &self,
        keys: Vec<OffloadKey>,
        mut destinations: Vec<MutableBlock<T>>,
        victims: Vec<ImmutableBlock<T>>,
        mut slots: Vec<BlockId>,
    ) -> Move<T> {
        let tm = self.bound.transfer_manager().clone();
        let mover = self.store.clone();
        let bound = self.bound.clone();
        let block_size = self.bound.manager().block_size();
        let n = keys.len();
        let checked = self.checked.clone();
        let memory = self.primary_memory.clone();
        let task = tm.clone().spawn_io(async move {
            // Victims first: their blocks go inactive, where the allocation finds them.
            drop(victims);
            if destinations.len() < n {
                destinations.extend(allocate_upto(&bound, n - destinations.len()));
            }
            let m = destinations.len();
            slots.truncate(m);
            let sources: Vec<MoveSource> = keys[..m]
                .iter()
                .zip(&slots)
                .map(|(k, &c)| move_source(key_digest(k), c, block_size))
                .collect();
            let mut outcomes = match checked {
                None => mover.move_blocks(&sources, destinations).await,
                Some(checked) => {
                    store_recorded(
                        &tm,
                        &mover,
                        &checked,
                        &memory,
                        &sources,
                        destinations,
                        slots,
                    )
                    .await
                }
            };
            outcomes.extend((m..n).map(|_| {
                Err(BlockFailure::new(
                    BlockFailureKind::NoSpace,
                    "no block of the tier was free for it",
                ))
            }));
            outcomes
        });
        // A store's task that could not finish dropped its destinations unregistered.
        Move::Store(task_outcomes(task, n, "store"))
    }

    fn owning(primary: &CpuPrimaryTier, layout: PhysicalLayout, blocks: usize) -> Result<Self> {
        let tm = primary
            .transfer()
            .map(|(tm, _)| tm.clone())
            .ok_or_else(|| {
                TieringError::Config(
                    "the primary tier's memory is not registered with a TransferManager \
                     (build it with CpuPrimaryTier::with_transfer_manager)"
                        .into(),
                )
            })?;
        // Plain LRU: the tier picks its own victims (`give_way`), so the manager's inactive
        // pool only holds what the tier gave up, and any order of reusing it will do; an
        // adaptive policy's frequency sketch would be updated per chunk stored for nothing.
        let manager = BlockManager::<T>::builder()
            .block_count(blocks)
            .block_size(TIER_BLOCK_SIZE)
            .eviction(kvbm_logical::EvictionBackend::Lru)
            .build()
            .map_err(|e| TieringError::Config(format!("tier {:?} manager: {e}", T::ID)))?;
        let h = tm.register_layout(layout)?;
        let bound = BoundTier::new(tm.clone(), h, Arc::new(manager)).and_then(|b| {
            Self::over(primary, b).map_err(|e| match e {
                TieringError::Offload(o) => o,
                other => kvbm_offload::OffloadError::Setup(other.to_string()),
            })
        });
        match bound {
            Ok(mut t) => {
                t.owned_layout = Some(h);
                Ok(t)
            }
            Err(e) => {
                let _ = tm.unregister_layout(h);
                Err(e.into())
            }
        }
    }

    /// Names the tier (its `tier_type`, e.g. in stats).
    pub fn with_tier_type(mut self, tier_type: &str) -> Self {
        self.tier_type = tier_type.into();
        self
    }

    /// Records vLLM-format events of the tier's contents for `take_events` (vLLM's
    /// `enable_kv_events`): stored when a chunk's write completes, removed when a chunk is
    /// evicted for room or its copy is dropped as bad.
    pub fn with_events(mut self, on: bool) -> Self {
        self.events = on.then(Vec::new);
        self
    }

    /// An event of `keys`; a stored one names the request whose store wrote them (`ctx`).
    fn event(&mut self, keys: Vec<OffloadKey>, removed: bool, ctx: Option<&ReqContext>) {
        if keys.is_empty() {
            return;
        }
        if let Some(ev) = &mut self.events {
            ev.push(OffloadingEvent {
                keys,
                medium: self.medium,
                removed,
                locality: Some(self.locality),
                ownership: Some(self.tier_type.clone()),
                removal_expected: false,
                metadata_only: false,
                req_context: ctx.cloned(),
            });
        }
    }

    /// Attaches a backpressure detector.
    pub fn with_backpressure(mut self, d: BackpressureDetector) -> Self {
        self.detector = Some(d);
        self
    }

    /// The bound tier (its manager holds every Ready key's block).
    pub fn bound(&self) -> &BoundTier<T> {
        &self.bound
    }

    /// Keys readable from the tier.
    pub fn num_ready(&self) -> usize {
        self.keys.num_ready()
    }

    /// Jobs not yet finished: moving, or booked for the step's end.
    pub fn num_inflight(&self) -> usize {
        self.inflight.len() + self.queued.len()
    }

    /// The block (slot of a disk tier) holding `key`, when it is Ready.
    pub fn block_id(&self, key: &OffloadKey) -> Option<BlockId> {
        let n = self.keys.find(key)?;
        self.keys.node(n).block.as_ref().map(|h| h.block.block_id())
    }

    /// Blocks whose move failed with `kind` (loads and stores) since the tier was built.
    pub fn failures(&self, kind: BlockFailureKind) -> u64 {
        self.failures.get(&kind).copied().unwrap_or(0)
    }

    /// `n` destination blocks, in one allocation, or as many as the tier can give (fewer
    /// when the rest of it is busy: being written or read). When the manager has too few to
    /// give, blocks give way first ([`give_way`](Self::give_way)).
    fn allocate(&mut self, n: usize) -> Vec<MutableBlock<T>> {
        if n == 0 {
            return Vec::new();
        }
        let mut room = self.bound.manager().available_blocks();
        while room < n && self.give_way(None) {
            room += 1;
        }
        let want = n.min(room);
        // The manager may have counted a block it could not give yet (a release still in
        // flight, or a caller's manager shared with someone else): another key gives way each
        // time it falls short.
        let mut out = allocate_upto(&self.bound, want);
        while out.len() < want && self.give_way(None) {
            out.extend(allocate_upto(&self.bound, want - out.len()));
        }
        out
    }

    /// Room for the `n` keys a store just made Writing (already among the tier's keys): how
    /// many of them get a block; their blocks where they are allocated now (a caller's
    /// manager); and the blocks of the keys that gave way for them, which the move's task
    /// drops before it allocates (the tier's own manager). See "Where a store's blocks come
    /// from".
    fn book(&mut self, n: usize) -> (usize, Vec<MutableBlock<T>>, Vec<ImmutableBlock<T>>) {
        if self.owned_layout.is_none() {
            let blocks = self.allocate(n);
            return (blocks.len(), blocks, Vec::new());
        }
        // The manager is the tier's alone: its blocks are the keys' (Ready or Writing) and the
        // restored ones, so the room is counted here, with no probe of the manager.
        let cap = self.bound.manager().total_blocks();
        let mut victims = Vec::new();
        while self.keys.len() + self.restored.len() > cap && self.give_way(Some(&mut victims)) {}
        let over = (self.keys.len() + self.restored.len()).saturating_sub(cap);
        (n.saturating_sub(over), Vec::new(), victims)
    }

    /// Frees one block for the manager to reuse: a restored block nobody claimed, else the
    /// oldest ready key nobody is reading (its block goes inactive when dropped: here, or,
    /// given `victims`, by whoever drops that). `false`: none can go.
    fn give_way(&mut self, victims: Option<&mut Vec<ImmutableBlock<T>>>) -> bool {
        let block = if let Some(h) = self.restored.keys().next().copied() {
            self.restored.remove(&h)
        } else {
            let Some(victim) = self.keys.oldest_unread() else {
                return false;
            };
            let key = *self.keys.key(victim);
            let node = self.keys.remove(victim);
            self.event(vec![key], true, None);
            node.block.map(|h| h.block)
        };
        if let (Some(v), Some(b)) = (victims, block) {
            v.push(b);
        }
        true
    }

    /// This tier's copies proven bad: a disk tier's checked disk's, an object tier's own.
    fn bad_copies(&self) -> &BadCopies<T> {
        self.checked.as_ref().map_or(&self.bad, |c| c.bad())
    }

    fn count(&mut self, f: &BlockFailure) {
        *self.failures.entry(f.kind).or_default() += 1;
    }

    /// Starts the queued store jobs as one move (see "Stores start at the step's end").
    fn start_queued(&mut self) {
        if self.queued.is_empty() {
            return;
        }
        let n: usize = self.queued.iter().map(|q| q.meta.keys.len()).sum();
        let (mut keys, mut destinations, mut slots) = (
            Vec::with_capacity(n),
            Vec::with_capacity(n),
            Vec::with_capacity(n),
        );
        let mut victims = Vec::new();
        let mut jobs = Vec::with_capacity(self.queued.len());
        // A tier's jobs all allocate at submission (a caller's manager: every key has its
        // block) or all in the move (its own manager: none has), so the blocks stay the first
        // keys' when concatenated.
        for q in std::mem::take(&mut self.queued) {
            debug_assert!(q.destinations.is_empty() || q.destinations.len() == q.meta.keys.len());
            keys.extend_from_slice(&q.meta.keys);
            destinations.extend(q.destinations);
            victims.extend(q.victims);
            slots.extend(q.slots);
            jobs.push(q.meta);
        }
        let mv = self.store_move(keys, destinations, victims, slots);
        self.inflight.push(Inflight { jobs, mv });
    }

    /// Reports every job of a settled move: a store's outcomes are its jobs' chunks, job after
    /// job.
    fn settle(&mut self, jobs: Vec<JobMeta>, settled: Settled<T>) {
        match settled {
            Settled::Store(outcomes) => {
                let mut outcomes = outcomes.into_iter();
                for meta in jobs {
                    let mut mine: Vec<MoveOutcome<T>> =
                        outcomes.by_ref().take(meta.keys.len()).collect();
                    // A move reports one outcome per chunk; should one be missing, its chunk
                    // counts as not stored rather than staying Writing forever.
                    while mine.len() < meta.keys.len() {
                        mine.push(Err(BlockFailure::new(
                            BlockFailureKind::Cancelled,
                            "the store's move reported no outcome for this chunk",
                        )));
                    }
                    self.finish(meta, Settled::Store(mine));
                }
            }
            Settled::Load(outcomes) => {
                debug_assert!(jobs.len() == 1, "a load moves for one job");
                if let Some(meta) = jobs.into_iter().next() {
                    self.finish(meta, Settled::Load(outcomes));
                }
            }
        }
    }

    fn finish(&mut self, meta: JobMeta, settled: Settled<T>) {
        let mut ok_keys = Vec::with_capacity(meta.keys.len());
        let mut dropped = Vec::new();
        // Keys a store found no block for (a caller's manager others filled): not stored, as
        // a key the booking had no room for, and no failure of the job.
        let mut not_stored = 0;
        let promotion = matches!(settled, Settled::Load(_));
        match settled {
            Settled::Store(outcomes) => {
                for ((k, &n), r) in meta.keys.iter().zip(&meta.nodes).zip(outcomes) {
                    debug_assert!(self.keys.key(n) == k, "a Writing node is its store's");
                    match r {
                        Ok(block) => {
                            // The digest the move's task registered the block with, the key's
                            // (derived again only for a block registered without one).
                            let digest = block.digest().unwrap_or_else(|| key_digest(k));
                            self.keys.set_ready(n, Held { block, digest });
                            ok_keys.push(*k);
                        }
                        Err(f) if f.kind == BlockFailureKind::NoSpace => {
                            tracing::debug!(key = %k, "no block of the tier was free; not stored");
                            self.count(&f);
                            not_stored += 1;
                            self.keys.remove(n);
                        }
                        Err(f) => {
                            tracing::warn!(key = %k, kind = f.kind.as_str(), error = %f, "secondary write failed");
                            self.count(&f);
                            self.keys.remove(n);
                        }
                    }
                }
                self.event(ok_keys.clone(), false, Some(&meta.req_context));
            }
            Settled::Load(outcomes) => {
                for ((k, &n), r) in meta.keys.iter().zip(&meta.nodes).zip(outcomes) {
                    debug_assert!(self.keys.key(n) == k, "a node being read is its load's");
                    // A node with readers stays live; one this job's own failed read dropped
                    // had no other reader, so it was the key's last occurrence here.
                    let node = self.keys.node_mut(n);
                    node.readers -= 1;
                    let unread = node.readers == 0;
                    match r {
                        Ok(()) => ok_keys.push(*k),
                        Err(f) => {
                            self.count(&f);
                            let drop_copy = f.kind.drops_copy();
                            tracing::warn!(key = %k, kind = f.kind.as_str(), error = %f, drop_copy, "secondary read failed");
                            // The tier's copy is corrupt, another chunk's, or gone: never serve
                            // it again (once no other load is reading it).
                            if drop_copy && unread {
                                let gone = self.keys.remove(n);
                                if let Some(h) = &gone.block {
                                    let (hash, slot) =
                                        (h.block.sequence_hash(), h.block.block_id());
                                    match &self.checked {
                                        Some(c) => c.read_failed(hash, Some(slot), &f),
                                        None => self.bad.read_failed(hash, &f),
                                    };
                                }
                                drop(gone);
                                self.bad_copies().discard(self.bound.manager());
                                dropped.push(*k);
                            }
                        }
                    }
                }
            }
        }
        self.event(dropped, true, None);
        let success = ok_keys.len() + not_stored == meta.keys.len();
        self.done.push(JobResult {
            job_id: meta.job_id,
            success,
            successful_keys: (!success && promotion).then_some(ok_keys),
            transfer_time: Some(meta.started.elapsed().as_secs_f64()),
            transfer_bytes: Some(meta.bytes),
            // A finished move touches the primary no more: nothing to defer.
            deferred_release: None,
        });
    }

    fn meta(&self, job: &TierJob, keys: Vec<OffloadKey>, nodes: Vec<u32>) -> JobMeta {
        JobMeta {
            job_id: job.job_id,
            bytes: (keys.len() * self.chunk_bytes) as u64,
            keys,
            nodes,
            started: std::time::Instant::now(),
            req_context: job.req_context.clone(),
        }
    }
}

impl<T: Tier> Drop for PhysicalTier<T> {
    /// Waits for moves still in flight: a promotion writes primary slots the manager may reuse
    /// once the tier is gone.
    fn drop(&mut self) {
        for f in std::mem::take(&mut self.inflight) {
            drop(f.wait());
        }
    }
}

impl PhysicalTier<G3> {
    /// A disk tier of `capacity` chunk slots in the file `config.path`, with its own
    /// `BlockManager<G3>` of `capacity` blocks.
    ///
    /// The tier keeps a journal beside the file (`<path>` with extension `journal`) and starts
    /// warm from it: every chunk a previous tier on the same file completed is restored (see the
    /// module docs, "Persistence").
    ///
    /// `fingerprint` binds the journal to what the chunks' bytes mean (the model, dtype,
    /// layout and parallelism that produced them; [`kvbm_physical::fingerprint`]): a journal
    /// written under another fingerprint (or none) is reset, so the tier starts cold and never
    /// serves another model's chunks. `None` binds none (tests, single-model tools).
    pub fn disk(
        primary: &CpuPrimaryTier,
        config: &DiskConfig,
        capacity: usize,
        fingerprint: Option<&ModelFingerprint>,
    ) -> Result<Self> {
        let layout = CpuPrimaryTier::block_layout(capacity, primary.chunk_bytes())?;
        let disk = PhysicalLayout::create_disk(layout, config)?;
        let mut tier = Self::owning(primary, disk, capacity)?;
        let file = tier.bound.transfer_manager().layout(tier.bound.layout())?;
        let (checked, blocks) =
            CheckedDisk::open(&config.path, &file, fingerprint, tier.bound.manager())?;
        tier.restored = blocks.into_iter().map(|b| (b.sequence_hash(), b)).collect();
        if !tier.restored.is_empty() {
            tracing::info!(path = %config.path.display(), chunks = tier.restored.len(), "disk tier starts warm");
        }
        tier.checked = Some(Arc::new(checked));
        Ok(tier)
    }
}

impl PhysicalTier<G4> {
    /// The default number of keys an object tier built by [`object`](Self::object) remembers
    /// (its `BlockManager<G4>` records presence; the oldest unread key is forgotten beyond it).
    pub const DEFAULT_OBJECT_KEYS: usize = 1 << 16;

    /// An object tier in `storage` (objects named by [`key_hash`] inside the storage's
    /// namespace) remembering up to `capacity` keys.
    pub fn object(
        primary: &CpuPrimaryTier,
        storage: Arc<ObjectStorage>,
        capacity: usize,
    ) -> Result<Self> {
        let layout = CpuPrimaryTier::block_layout(
            primary.manager().num_chunks().max(1),
            primary.chunk_bytes(),
        )?;
        Self::owning(primary, PhysicalLayout::object(layout, storage), capacity)
    }
}

/// Whether a key's object is in an object tier's store, whoever wrote it (one header read,
/// checked against the key's identity; another key's or a damaged header counts as absent).
/// The probe behind [`PhysicalTier::adopt`]: it is async I/O, so a caller runs it off the
/// scheduler thread (vLLM's tier answers `RETRY` meanwhile).
#[derive(Clone)]
pub struct ObjectProbe {
    storage: Arc<ObjectStorage>,
    block_size: u32,
}

impl std::fmt::Debug for ObjectProbe {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ObjectProbe").finish_non_exhaustive()
    }
}

impl ObjectProbe {
    /// Whether `key`'s object is present in the store.
    ///
    /// # Errors
    /// [`TieringError::Physical`](crate::TieringError) when the store cannot be asked (a
    /// transient failure: the caller tries again later; it is not an absence).
    pub async fn present(&self, key: &OffloadKey) -> Result<bool> {
        let h = key_hash(key, self.block_size);
        let key_name = kvbm_offload::object::object_key(h);
        Ok(
            match self.storage.probe(&key_name, &key_identity(key)).await? {
                kvbm_physical::ObjectPresence::Present => true,
                kvbm_physical::ObjectPresence::Foreign(why) => {
                    tracing::debug!(%key, error = %why, "object of another block: absent");
                    false
                }
                _ => false,
            },
        )
    }
}

impl ObjectProbe {
    /// Whether the store answers at all (see `ObjectStorage::check_access`): for a tier's
    /// start, so that an unreachable endpoint or a missing bucket is an error there.
    ///
    /// # Errors
    /// [`TieringError::Physical`](crate::TieringError) with the store's answer.
    pub async fn check_access(&self) -> Result<()> {
        Ok(self.storage.check_access().await?)
    }
}

impl PhysicalTier<G4> {
    /// A probe of this tier's store (see [`ObjectProbe`]).
    ///
    /// # Errors
    /// [`TieringError::Config`] when the tier's layout is not an object store.
    pub fn probe(&self) -> Result<ObjectProbe> {
        let layout = self.bound.transfer_manager().layout(self.bound.layout())?;
        match layout.backing() {
            kvbm_physical::Backing::Object(storage) => Ok(ObjectProbe {
                storage: storage.clone(),
                block_size: self.bound.manager().block_size(),
            }),
            _ => Err(TieringError::Config(
                "the object tier's layout is not an object store".into(),
            )),
        }
    }

    /// Registers `key` as Ready: an [`ObjectProbe`] found its object in the store (another
    /// instance sharing the namespace wrote it). Nothing is read now; a load reads the object
    /// and checks it against the key's identity as for any chunk. Returns whether the key is
    /// Ready (it may already be; `false`: the tier has no block to give it).
    pub fn adopt(&mut self, key: &OffloadKey) -> bool {
        if let Some(n) = self.keys.find(key) {
            return self.keys.node(n).block.is_some();
        }
        let Some(block) = self.allocate(1).pop() else {
            return false;
        };
        let digest = key_digest(key);
        let h = digest_hash(&digest, self.bound.manager().block_size());
        let Ok(complete) = block.complete_with_digest(h, Some(digest)) else {
            return false;
        };
        let Some(registered) = self.bound.manager().register_blocks(vec![complete]).pop() else {
            return false;
        };
        self.keys.insert(
            *key,
            Some(Held {
                block: registered,
                digest,
            }),
        );
        true
    }
}

impl<T: Tier> SecondaryTierManager for PhysicalTier<T> {
    fn tier_type(&self) -> &str {
        &self.tier_type
    }
    fn medium(&self) -> Option<Medium> {
        Some(self.medium)
    }
    fn locality(&self) -> Option<Locality> {
        Some(self.locality)
    }
    fn block_size_bytes(&self) -> usize {
        self.chunk_bytes
    }
    fn bp_detector(&mut self) -> Option<&mut dyn Backpressure> {
        self.detector.as_mut().map(|d| d as &mut dyn Backpressure)
    }
    fn lookup(&mut self, key: &OffloadKey, _: &ReqContext) -> LookupResult {
        // One probe for a key the tier knows (the scheduler's every lookup that reaches here).
        if let Some(n) = self.keys.find(key) {
            return if self.keys.node(n).block.is_some() {
                LookupResult::Hit
            } else {
                LookupResult::Miss
            };
        }
        if self.claim_restored(key).is_some() {
            LookupResult::Hit
        } else {
            LookupResult::Miss
        }
    }
    fn submit_store(&mut self, job: Arc<TierJob>) {
        // The keys the tier does not know yet (a key twice in the job counts once), Writing
        // from here on: each gets a destination block, all in one allocation.
        let n = job.keys.len();
        let (mut keys, mut nodes, mut chunks) = (
            Vec::with_capacity(n),
            Vec::with_capacity(n),
            Vec::with_capacity(n),
        );
        for (k, &c) in job.keys.iter().zip(&job.chunk_ids) {
            if self.keys.find(k).is_some() || self.claim_restored(k).is_some() {
                continue;
            }
            nodes.push(self.keys.insert(*k, None));
            keys.push(*k);
            chunks.push(c as BlockId);
        }
        let (booked, destinations, victims) = self.book(keys.len());
        if booked < keys.len() {
            // The rest of the tier is busy (being written or read): the keys without a
            // block are not stored.
            tracing::debug!(
                dropped = keys.len() - booked,
                "secondary tier full of busy keys; stores dropped"
            );
            for n in nodes.drain(booked..) {
                self.keys.remove(n);
            }
            keys.truncate(booked);
            chunks.truncate(booked);
        }
        if keys.is_empty() {
            drop(victims);
            self.done.push(JobResult::new(job.job_id, true));
            return;
        }
        // The move starts at the step's end with the step's other stores (`start_queued`);
        // the keys' digests, the journal's protocol, the transfer and the registration run
        // with its task (`store_move`); the keys stay Writing until it settled.
        let meta = self.meta(&job, keys, nodes);
        self.queued.push(Queued {
            meta,
            destinations,
            victims,
            slots: chunks,
        });
    }
    fn submit_load(&mut self, job: Arc<TierJob>) {
        // Every key ready (a restored block claimed now counts), one probe per key.
        let mut nodes = Vec::with_capacity(job.keys.len());
        let mut all_ready = true;
        for k in &job.keys {
            match self.keys.find(k).or_else(|| self.claim_restored(k)) {
                Some(n) if self.keys.node(n).block.is_some() => nodes.push(n),
                _ => all_ready = false,
            }
        }
        if !all_ready {
            self.done.push(JobResult::new(job.job_id, false));
            return;
        }
        let mut sources = Vec::with_capacity(job.keys.len());
        let mut held = Vec::with_capacity(job.keys.len());
        let block_size = self.bound.manager().block_size();
        for &n in &nodes {
            let node = self.keys.node_mut(n);
            node.readers += 1;
            let h = node.block.as_ref().expect("checked");
            let (id, digest) = (h.block.block_id(), h.digest);
            held.push(h.block.clone());
            sources.push(move_source(digest, id, block_size));
        }
        let slots: Vec<BlockId> = job.chunk_ids.iter().map(|&c| c as BlockId).collect();
        // The identity each read must have comes from the key asked for, not from the
        // stored block. The move is issued and settled by one task on the transfer manager's
        // runtime (its validation and claims off the scheduler's thread, as a store's), which
        // holds the source blocks until the move settled.
        let mover = self.load.clone();
        let n = sources.len();
        let task = self.bound.transfer_manager().spawn_io(async move {
            // SAFETY: `slots` are the primary's slots the tiering manager reserved for this
            // promotion (`prepare_write`: write pending, so `CpuPrimaryTier::chunk` refuses
            // them; `chunk_mut` is the GPU-store path, which the manager's contract never uses
            // for a key under promotion) until the job is reported, which happens only after
            // this task settled (`get_finished_jobs`, `drain_jobs`; dropping the tier waits
            // for it too).
            let moved = unsafe { mover.move_blocks(&sources, &slots) };
            let out = moved.await;
            drop(held);
            out
        });
        let mv = Move::Load(task_outcomes(task, n, "load"));
        let meta = self.meta(&job, job.keys.clone(), nodes);
        self.inflight.push(Inflight {
            jobs: vec![meta],
            mv,
        });
    }
    fn take_events(&mut self) -> Vec<OffloadingEvent> {
        self.events.as_mut().map(std::mem::take).unwrap_or_default()
    }
    /// Recency: a touched ready chunk goes to the back of the eviction order (the oldest
    /// untouched ready chunk gives way first).
    fn touch(&mut self, keys: &[OffloadKey], _: &ReqContext) {
        for k in keys {
            if let Some(n) = self.keys.find(k) {
                self.keys.touch(n);
            }
        }
    }
    fn get_finished_jobs(&mut self, out: &mut Vec<JobResult>) {
        let mut i = 0;
        while i < self.inflight.len() {
            match self.inflight[i].poll_now() {
                Some(settled) => {
                    let f = self.inflight.swap_remove(i);
                    self.settle(f.jobs, settled);
                }
                None => i += 1,
            }
        }
        out.append(&mut self.done);
    }
    fn drain_jobs(&mut self) -> Result<()> {
        self.start_queued();
        for f in std::mem::take(&mut self.inflight) {
            let (jobs, settled) = f.wait();
            self.settle(jobs, settled);
        }
        Ok(())
    }
    fn on_new_request(&mut self, _: &ReqContext) -> RequestOffloadingContext {
        RequestOffloadingContext::default()
    }
    fn has_pending_work(&self) -> bool {
        self.num_inflight() > 0
    }
    /// Starts the step's store jobs (see "Stores start at the step's end").
    fn on_schedule_end(&mut self, _: &crate::types::ScheduleEndContext) {
        self.start_queued();
    }
    fn shutdown(&mut self) -> Result<()> {
        self.drain_jobs()?;
        if let Some(c) = &self.checked {
            let layout = self.bound.transfer_manager().layout(self.bound.layout())?;
            if let kvbm_physical::Backing::Disk(d) = layout.backing() {
                d.sync()?;
            }
            c.journal().sync()?;
        }
        self.restored.clear();
        // Ready keys' blocks go back to the manager (inactive).
        self.keys.clear();
        if let Some(h) = self.owned_layout.take() {
            self.bound.transfer_manager().unregister_layout(h)?;
        }
        Ok(())
    }
    fn as_any_mut(&mut self) -> &mut dyn std::any::Any {
        self
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The digest is BLAKE3 of the domain, the key's length byte and the key's bytes, as
    /// tiers written before it was computed in one call defined it (their disk headers and
    /// object names carry it).
    #[test]
    fn key_digest_is_blake3_of_domain_length_and_key() {
        for len in 4..=OffloadKey::MAX_LEN {
            let bytes: Vec<u8> = (0..len as u8).map(|i| i.wrapping_mul(37) ^ 0x5a).collect();
            let key = OffloadKey::from_bytes(&bytes).unwrap();
            let mut h = blake3::Hasher::new();
            h.update(b"kvbm-tiering-offload-key-v1");
            h.update(&[len as u8]);
            h.update(&bytes);
            assert_eq!(
                key_digest(&key),
                BlockDigest(*h.finalize().as_bytes()),
                "len {len}"
            );
        }
    }

    #[test]
    fn key_identity_is_a_digest_of_every_key_byte() {
        let a = OffloadKey::from_bytes(&[1u8; 36]).unwrap();
        let mut other_group = [1u8; 36];
        other_group[35] = 2;
        let b = OffloadKey::from_bytes(&other_group).unwrap();
        let long = OffloadKey::from_bytes(&[1u8; 39]).unwrap();
        let ids = [key_identity(&a), key_identity(&b), key_identity(&long)];
        assert_ne!(ids[0], ids[1], "the group index is part of the identity");
        assert_ne!(ids[0], ids[2], "so is the key's length");
        assert!(ids.iter().all(|i| *i != BlockIdentity::ANONYMOUS));
        assert_eq!(key_identity(&a), ids[0], "stable");
    }
}
