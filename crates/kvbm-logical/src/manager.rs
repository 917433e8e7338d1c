//! [`BlockManager`]: one tier's pool of blocks, and its validating builder.
//!
//! All state lives in one store behind one mutex (see the `store` module docs for the slot
//! state machine and the lock order: store, then registry shard or event buffer). Every batch
//! operation takes the lock **once** for the whole batch.

use std::marker::PhantomData;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use crate::blocks::{CompleteBlock, ImmutableBlock, MutableBlock};
use crate::config::{DuplicationPolicy, FreeSlotReuse, LogicalConfig};
use crate::error::LogicalError;
use crate::events::{EventBatchConfig, EventBatcher, EventSink};
use crate::eviction::{Admission, EvictionBackend, EvictionPolicy};
use crate::hash::{SequenceHash, validate_block_size};
use crate::metrics::Metrics;
use crate::registry::BlockRegistry;
use crate::store::{Core, PoolCounts, ProtectSet, Store};
use crate::sync::{AtomicU32, Mutex, ghost};
use crate::tier::{Tier, TierId};

/// One tier's logical block manager. `Send + Sync`; share it as `Arc<BlockManager<T>>`.
///
/// ```
/// use kvbm_logical::{BlockManager, G2, Salt, TokenBlockSequence};
///
/// let manager = BlockManager::<G2>::builder().block_count(8).block_size(4).build()?;
/// let seq = TokenBlockSequence::from_tokens(&[1, 2, 3, 4, 5, 6, 7, 8, 9], 4, Salt::NONE)?;
///
/// let blocks = manager.allocate_blocks(2)?;
/// let complete = blocks
///     .into_iter()
///     .zip(seq.blocks())
///     .map(|(b, tb)| b.complete_token_block(tb).unwrap())
///     .collect();
/// let registered = manager.register_blocks(complete);
/// drop(registered); // now inactive, still matchable
///
/// let matched = manager.match_blocks(&seq.hashes());
/// assert_eq!(matched.len(), 2);
/// # Ok::<(), kvbm_logical::LogicalError>(())
/// ```
pub struct BlockManager<T: Tier> {
    core: Arc<Core>,
    total: usize,
    policy: EvictionPolicy,
    _tier: PhantomData<T>,
}

/// The result of [`BlockManager::allocate_blocks_with`]: the blocks, and the hashes whose
/// registrations were evicted to provide them (in eviction order).
#[derive(Debug)]
pub struct Allocation<T: Tier> {
    /// The allocated blocks.
    pub blocks: Vec<MutableBlock<T>>,
    /// The sequence hashes evicted from this tier by this allocation.
    pub evicted: Vec<SequenceHash>,
}

impl<T: Tier> std::fmt::Debug for BlockManager<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BlockManager")
            .field("tier", &T::ID)
            .field("total", &self.total)
            .field("pools", &self.pool_counts())
            .finish()
    }
}

/// Builds a [`BlockManager`]; [`build`](Self::build) validates the settings.
pub struct BlockManagerBuilder<T: Tier> {
    block_count: Option<usize>,
    config: LogicalConfig,
    registry: Option<BlockRegistry>,
    sink: Option<Arc<dyn EventSink>>,
    _tier: PhantomData<T>,
}

impl<T: Tier> std::fmt::Debug for BlockManagerBuilder<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BlockManagerBuilder")
            .field("tier", &T::ID)
            .field("block_count", &self.block_count)
            .field("config", &self.config)
            .field("event_sink", &self.sink.is_some())
            .finish()
    }
}

impl<T: Tier> Default for BlockManagerBuilder<T> {
    fn default() -> Self {
        Self {
            block_count: None,
            config: LogicalConfig::default(),
            registry: None,
            sink: None,
            _tier: PhantomData,
        }
    }
}

impl<T: Tier> BlockManagerBuilder<T> {
    /// Number of blocks (slots). Required; `1..u32::MAX`.
    pub fn block_count(mut self, n: usize) -> Self {
        self.block_count = Some(n);
        self
    }

    /// Tokens per block: a power of two in `1..=1024`. Default: 16.
    pub fn block_size(mut self, block_size: u32) -> Self {
        self.config.block_size = block_size;
        self
    }

    /// Takes every setting of a [`LogicalConfig`] (block size, eviction, duplication, events,
    /// registry sizing).
    pub fn config(mut self, config: LogicalConfig) -> Self {
        self.config = config;
        self
    }

    /// The registry shared across tiers. Default: a new registry built from
    /// [`LogicalConfig::registry`].
    pub fn registry(mut self, registry: BlockRegistry) -> Self {
        self.registry = Some(registry);
        self
    }

    /// The inactive pool's eviction order, without admission filter (the default policy is
    /// `adaptive-lru`, see [`policy`](Self::policy)).
    pub fn eviction(mut self, backend: EvictionBackend) -> Self {
        self.config.eviction = EvictionPolicy::plain(backend);
        self
    }

    /// The eviction policy (backend and admission filter), e.g. `"s3fifo".parse()?`.
    /// Default: `adaptive-lru`.
    pub fn policy(mut self, policy: EvictionPolicy) -> Self {
        self.config.eviction = policy;
        self
    }

    /// The admission filter in front of the eviction backend. Default: [`Admission::None`].
    pub fn admission(mut self, admission: Admission) -> Self {
        self.config.eviction.admission = admission;
        self
    }

    /// How slots freed by eviction are handed out. Default: [`FreeSlotReuse::EvictionOrder`].
    pub fn free_slot_reuse(mut self, reuse: FreeSlotReuse) -> Self {
        self.config.free_slot_reuse = reuse;
        self
    }

    /// Shorthand for `eviction(EvictionBackend::Lru)`.
    pub fn with_lru_backend(self) -> Self {
        self.eviction(EvictionBackend::Lru)
    }

    /// Shorthand for `eviction(EvictionBackend::MultiLru)`.
    pub fn with_multi_lru_backend(self) -> Self {
        self.eviction(EvictionBackend::MultiLru)
    }

    /// Shorthand for `eviction(EvictionBackend::Lineage)`.
    pub fn with_lineage_backend(self) -> Self {
        self.eviction(EvictionBackend::Lineage)
    }

    /// Shorthand for `eviction(EvictionBackend::Fifo)`.
    pub fn with_fifo_backend(self) -> Self {
        self.eviction(EvictionBackend::Fifo)
    }

    /// What to do with a duplicate registration. Default: [`DuplicationPolicy::Allow`].
    pub fn duplication_policy(mut self, policy: DuplicationPolicy) -> Self {
        self.config.duplication = policy;
        self
    }

    /// Whether matches record a registry touch per matched block. Default: `true`.
    pub fn touch_on_match(mut self, touch: bool) -> Self {
        self.config.touch_on_match = touch;
        self
    }

    /// Where stored/removed events go. Default: none (no events are built at all).
    pub fn event_sink(mut self, sink: Arc<dyn EventSink>) -> Self {
        self.sink = Some(sink);
        self
    }

    /// Event batching. Default: [`EventBatchConfig::default`].
    pub fn event_batching(mut self, config: EventBatchConfig) -> Self {
        self.config.events = config;
        self
    }

    /// Validates the settings and builds the manager.
    ///
    /// # Errors
    /// [`LogicalError::InvalidConfig`] when `block_count` is missing, zero or too large;
    /// [`LogicalError::InvalidBlockSize`] for a bad block size.
    pub fn build(self) -> Result<BlockManager<T>, LogicalError> {
        let total = self
            .block_count
            .ok_or_else(|| LogicalError::InvalidConfig("block_count is required".into()))?;
        if total == 0 || total >= u32::MAX as usize {
            return Err(LogicalError::InvalidConfig(format!(
                "block_count must be in 1..{}, got {total}",
                u32::MAX
            )));
        }
        validate_block_size(self.config.block_size)?;
        if self.config.events.max_batch == 0 {
            return Err(LogicalError::InvalidConfig(
                "events.max_batch must be at least 1".into(),
            ));
        }
        let registry = self
            .registry
            .unwrap_or_else(|| BlockRegistry::with_config(&self.config.registry));
        let core = Core {
            tier: T::ID,
            block_size: self.config.block_size,
            refs: (0..total).map(|_| AtomicU32::new(0)).collect(),
            store: Mutex::new(Store::new(
                total,
                self.config.eviction,
                self.config.free_slot_reuse,
            )),
            registry,
            events: self.sink.map(|s| EventBatcher::new(s, &self.config.events)),
            metrics: Metrics::new(T::ID),
            duplication: self.config.duplication,
            touch_on_match: self.config.touch_on_match,
            digests: std::sync::OnceLock::new(),
        };
        let core = Arc::new(core);
        ghost::born(Arc::as_ptr(&core));
        let manager = BlockManager {
            core,
            total,
            policy: self.config.eviction,
            _tier: PhantomData,
        };
        manager.core.metrics.reset.set(total as f64);
        Ok(manager)
    }
}

impl<T: Tier> BlockManager<T> {
    /// A builder with every default.
    pub fn builder() -> BlockManagerBuilder<T> {
        BlockManagerBuilder::default()
    }

    /// Hands out `n` blocks from the reset pool, evicting inactive blocks when it is short.
    ///
    /// All or nothing: on error nothing is handed out and nothing is evicted.
    ///
    /// # Errors
    /// [`LogicalError::InsufficientBlocks`] when even eviction cannot provide `n` blocks.
    pub fn allocate_blocks(&self, n: usize) -> Result<Vec<MutableBlock<T>>, LogicalError> {
        self.allocate_inner(n, &[] as &[SequenceHash], None)
    }

    /// Like [`allocate_blocks`](Self::allocate_blocks), but never evicts a block whose hash
    /// is in `protect` (e.g. the keys of the same store call), and reports the hashes it
    /// evicted. All or nothing: on error nothing is handed out and nothing is evicted.
    ///
    /// A protected evictable block is passed over by the policy's walk, so a large protect
    /// set that covers the head of the eviction order costs one check per protected block.
    ///
    /// # Errors
    /// [`LogicalError::InsufficientBlocks`] when `n` blocks cannot be provided without
    /// evicting a protected block.
    pub fn allocate_blocks_with<P: ProtectSet + ?Sized>(
        &self,
        n: usize,
        protect: &P,
    ) -> Result<Allocation<T>, LogicalError> {
        let mut evicted = Vec::new();
        let blocks = self.allocate_inner(n, protect, Some(&mut evicted))?;
        Ok(Allocation { blocks, evicted })
    }

    fn allocate_inner<P: ProtectSet + ?Sized>(
        &self,
        n: usize,
        protect: &P,
        evicted: Option<&mut Vec<SequenceHash>>,
    ) -> Result<Vec<MutableBlock<T>>, LogicalError> {
        let core = &self.core;
        let emit = core.events.is_some();
        let (result, counts, events) = {
            let mut store = core.store.lock();
            let r = store.allocate(n, protect, core.tier, &core.registry, emit, evicted);
            let events = store.take_events();
            if let Some(events) = &events
                && let Some(b) = &core.events
            {
                b.push(events.iter().copied());
            }
            (r, store.counts(), events.is_some())
        };
        self.after_op(counts, events);
        match result {
            Ok((slots, evicted)) => {
                core.metrics.allocations.increment(n as u64);
                core.metrics.evictions.increment(evicted as u64);
                Ok(slots
                    .into_iter()
                    .map(|s| MutableBlock::new(core.clone(), s))
                    .collect())
            }
            Err(available) => Err(LogicalError::InsufficientBlocks {
                tier: T::ID,
                requested: n,
                available,
                total: self.total,
            }),
        }
    }

    /// Recency touch: tells the eviction policy that these registered blocks were just used,
    /// without counting a frequency hit in the registry (unlike a match). Returns how many of
    /// `hashes` are registered in this tier. (LRU-like policies move evictable blocks to the
    /// most recent end; FIFO, S3-FIFO and Belady ignore it.)
    pub fn touch_blocks(&self, hashes: &[SequenceHash]) -> usize {
        let core = &self.core;
        let mut store = core.store.lock();
        hashes
            .iter()
            .filter(|h| store.touch(h, &core.registry))
            .count()
    }

    /// Next-use hints for the `belady` policy (ignored by the others): for each registered
    /// `(hash, next_use)`, the time (any monotonic clock; `u64::MAX` for never) at which the
    /// caller will need the block next. Returns how many hashes are registered in this tier.
    pub fn hint_next_use(&self, hints: &[(SequenceHash, u64)]) -> usize {
        let core = &self.core;
        let mut store = core.store.lock();
        hints
            .iter()
            .filter(|(h, t)| store.hint(h, *t, &core.registry))
            .count()
    }

    /// The eviction policy this manager was built with.
    pub fn eviction_policy(&self) -> EvictionPolicy {
        self.policy
    }

    /// Registers complete blocks, returning one strong handle per input block, in order.
    ///
    /// For a hash that is already registered in this tier, the [`DuplicationPolicy`] decides:
    /// `Allow` registers the new block as a duplicate, `Reject` returns the existing block and
    /// puts the new block's slot back in the reset pool. Each registered slot keeps the
    /// [`BlockDigest`](crate::BlockDigest) its block was completed with
    /// ([`ImmutableBlock::digest`]); with `Reject`, the returned existing block keeps *its*
    /// digest, so a caller that needs the identity it asked for compares the digests. A block that came from another manager
    /// of the same tier type is registered in its own manager.
    pub fn register_blocks(&self, blocks: Vec<CompleteBlock<T>>) -> Vec<ImmutableBlock<T>> {
        if blocks.iter().any(|b| !Arc::ptr_eq(b.core(), &self.core)) {
            // Rare misuse: route each block to the manager it belongs to.
            return blocks
                .into_iter()
                .map(|b| {
                    let core = b.core().clone();
                    register_batch::<T>(&core, vec![b])
                        .pop()
                        .expect("one block in, one out")
                })
                .collect();
        }
        register_batch::<T>(&self.core, blocks)
    }

    /// The longest contiguous prefix of `hashes` registered in this tier, as strong handles
    /// (inactive blocks are revived). Stops at the first missing hash.
    pub fn match_blocks(&self, hashes: &[SequenceHash]) -> Vec<ImmutableBlock<T>> {
        self.find(hashes, true)
    }

    /// Every hash of `hashes` registered in this tier, without requiring contiguity.
    pub fn scan_matches(&self, hashes: &[SequenceHash]) -> Vec<ImmutableBlock<T>> {
        self.find(hashes, false)
    }

    fn find(&self, hashes: &[SequenceHash], contiguous: bool) -> Vec<ImmutableBlock<T>> {
        let core = &self.core;
        let mut out = Vec::with_capacity(hashes.len());
        let counts = {
            let mut store = core.store.lock();
            for hash in hashes {
                match store.lookup(hash) {
                    Some(s) => {
                        store.acquire(s, &core.registry);
                        let previous = core.refs[s as usize].fetch_add(1, Ordering::Relaxed);
                        let generation = store.slots[s as usize].generation;
                        out.push(ImmutableBlock::from_acquired(
                            core, s, generation, *hash, previous,
                        ));
                    }
                    None if contiguous => break,
                    None => {}
                }
            }
            store.counts()
        };
        if core.touch_on_match {
            if contiguous {
                core.registry.touch_all(&hashes[..out.len()]);
            } else {
                for b in &out {
                    core.registry.touch(b.sequence_hash());
                }
            }
        }
        core.metrics.match_requests.increment(1);
        core.metrics.matched_blocks.increment(out.len() as u64);
        self.after_op(counts, false);
        out
    }

    /// Evicts every evictable inactive block to the reset pool; returns how many were evicted.
    /// (With the lineage backend, inactive parents of active blocks stay.)
    pub fn reset_inactive_pool(&self) -> usize {
        self.evict_with(|store, core, emit| store.reset_inactive(core.tier, &core.registry, emit))
    }

    /// Runs `evict` (which returns how many blocks it evicted) under the store's lock, then
    /// publishes its events, counts the evictions and updates the gauges.
    fn evict_with(&self, evict: impl FnOnce(&mut Store, &Core, bool) -> usize) -> usize {
        let core = &self.core;
        let emit = core.events.is_some();
        let (n, counts, events) = {
            let mut store = core.store.lock();
            let n = evict(&mut store, core, emit);
            let events = store.take_events();
            if let Some(events) = &events
                && let Some(b) = &core.events
            {
                b.push(events.iter().copied());
            }
            (n, store.counts(), events.is_some())
        };
        core.metrics.evictions.increment(n as u64);
        self.after_op(counts, events);
        n
    }

    /// Drops the inactive blocks of `hashes` from this tier: a copy found bad (a checksum or
    /// identity that failed on read) must never be matched again, and its slot is better
    /// reused than left to age out. Each is unregistered (a `Removed` event; the registry
    /// forgets this tier for it) and its slot returns to the reset pool. A block that is held
    /// (active), or that the policy cannot remove now (`lineage`: a parent of registered
    /// blocks), is left as it is: a caller that must never read it again keeps its own guard
    /// and may retry once it is released. Returns how many were dropped.
    pub fn discard_inactive(&self, hashes: &[SequenceHash]) -> usize {
        self.evict_with(|store, core, emit| {
            hashes
                .iter()
                .filter(|h| store.discard_inactive(h, core.tier, &core.registry, emit))
                .count()
        })
    }

    /// Blocks that `allocate_blocks` could hand out now: reset plus inactive. (With the
    /// lineage backend, inactive parents of active blocks are counted but not evictable.)
    pub fn available_blocks(&self) -> usize {
        let c = self.core.store.lock().counts();
        c.reset + c.inactive
    }

    /// The manager's capacity.
    pub fn total_blocks(&self) -> usize {
        self.total
    }

    /// Whether `block`'s slot is one of this manager's: a caller that writes a layout slot by
    /// a block's id checks it first (another manager's id may lie outside the layout, or name a
    /// slot this manager lent to someone else).
    pub fn owns(&self, block: &MutableBlock<T>) -> bool {
        block.is_of(&self.core)
    }

    /// Whether the registered `block` is one of this manager's (see [`owns`](Self::owns)).
    pub fn holds(&self, block: &ImmutableBlock<T>) -> bool {
        block.is_of(&self.core)
    }

    /// A consistent snapshot of the pool sizes.
    pub fn pool_counts(&self) -> PoolCounts {
        self.core.store.lock().counts()
    }

    /// The registry this manager reports presence to.
    pub fn registry(&self) -> &BlockRegistry {
        &self.core.registry
    }

    /// Tokens per block.
    pub fn block_size(&self) -> u32 {
        self.core.block_size
    }

    /// This manager's tier.
    pub fn tier(&self) -> TierId {
        T::ID
    }

    /// Hands every buffered event to the sink now.
    pub fn flush_events(&self) {
        if let Some(b) = &self.core.events {
            b.flush();
        }
    }

    /// When the buffered partial event batch becomes due by age
    /// ([`EventBatchConfig::max_delay_ms`] after its oldest event); `None` when no event is
    /// buffered or there is no sink. The library has no timer of its own: an owner that wants
    /// idle tiers to publish on time sleeps until this deadline and then calls
    /// [`flush_due_events`](Self::flush_due_events) (see the [`events`](crate::events) docs).
    pub fn next_event_deadline(&self) -> Option<std::time::Instant> {
        self.core.events.as_ref()?.next_deadline()
    }

    /// Flushes the buffered events if a batch is due at `now` (full, or its oldest event at
    /// least [`EventBatchConfig::max_delay_ms`] older than `now`); returns whether it flushed.
    /// Pass `Instant::now()` from the owner's timer. Takes no store lock.
    pub fn flush_due_events(&self, now: std::time::Instant) -> bool {
        self.core.events.as_ref().is_some_and(|b| b.flush_due(now))
    }

    /// Checks every internal invariant (each slot in exactly one pool, counts, hash index,
    /// eviction lists) and returns the pool counts. For tests and debugging; takes the lock
    /// and scans every slot.
    ///
    /// # Errors
    /// A description of the first violated invariant.
    pub fn check_invariants(&self) -> Result<PoolCounts, String> {
        self.core.store.lock().check(&self.core.refs)
    }

    /// The loom model's witness: keeps the core's allocation (not its value) alive, so the
    /// model can check that the last pin was dropped exactly when it should have been.
    #[cfg(all(loom, test))]
    pub(crate) fn core_witness(&self) -> std::sync::Weak<Core> {
        Arc::downgrade(&self.core)
    }

    fn after_op(&self, counts: PoolCounts, events_pushed: bool) {
        let m = &self.core.metrics;
        m.reset.set(counts.reset as f64);
        m.active.set(counts.active as f64);
        m.inactive.set(counts.inactive as f64);
        // `maybe_flush` also flushes an idle batch that has grown old (time-based batching).
        let _ = events_pushed;
        if let Some(b) = &self.core.events {
            b.maybe_flush();
        }
    }
}

fn register_batch<T: Tier>(
    core: &Arc<Core>,
    blocks: Vec<CompleteBlock<T>>,
) -> Vec<ImmutableBlock<T>> {
    let emit = core.events.is_some();
    let mut out = Vec::with_capacity(blocks.len());
    let n = blocks.len();
    let counts = {
        let mut store = core.store.lock();
        for block in blocks {
            let (s, hash, digest) = block.into_raw();
            let id = match store.lookup(&hash) {
                None => {
                    core.set_digest(s, digest.as_ref());
                    store.register_primary(s, hash, core.tier, &core.registry, emit);
                    s
                }
                Some(_) if core.duplication == DuplicationPolicy::Allow => {
                    core.set_digest(s, digest.as_ref());
                    store.register_duplicate(s, hash);
                    s
                }
                Some(existing) => {
                    store.release_held(s);
                    store.acquire(existing, &core.registry);
                    existing
                }
            };
            let previous = core.refs[id as usize].fetch_add(1, Ordering::Relaxed);
            let generation = store.slots[id as usize].generation;
            out.push(ImmutableBlock::from_acquired(
                core, id, generation, hash, previous,
            ));
        }
        if let Some(events) = store.take_events()
            && let Some(b) = &core.events
        {
            b.push(events);
        }
        store.counts()
    };
    core.metrics.registrations.increment(n as u64);
    let m = &core.metrics;
    m.reset.set(counts.reset as f64);
    m.active.set(counts.active as f64);
    m.inactive.set(counts.inactive as f64);
    if let Some(b) = &core.events {
        b.maybe_flush();
    }
    out
}

#[cfg(test)]
pub(crate) mod tests;
