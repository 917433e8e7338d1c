//! [`FleetTier`]: a kvbm [`Instance`] as a secondary tier under vLLM's tiering manager (feature
//! `nats`), so that a fleet of vLLM instances shares its KV through the cluster plane: found
//! by hash in the index every instance keeps of its peers, pulled from the peer over the
//! authenticated data plane, verified before a byte reaches vLLM's region.
//!
//! ```text
//!  vLLM TieringOffloadingManager ─► KvbmFleetTier (kvbm-vllm) ─► FleetTier (this)
//!   primary region (vLLM's CPU KV)        store: region chunk ──copy──► instance G2 block,
//!        ▲                                       registered → stored event → peers' index
//!        │ load: copy ◄── instance G2 block ◄── local G2, or pulled from the peer the index
//!        │                                      names (DataPlaneClient: identity, binding,
//!        │                                      checksum; a bad copy leaves the index)
//!  Instance (kvbm-cluster): G2 pool + data-plane server (peers pull from it), NATS events,
//!  presence (peers that leave or go silent are forgotten), the cross-instance index;
//!  optionally a disk (G3: `tiers.g3_blocks`, `physical.disk`): what a store shares is written
//!  down too (journaled, checksummed), a load stages it back (checked), a restart is warm
//! ```
//!
//! # Why a tier, and what it holds
//!
//! vLLM's manager owns its primary region's slots and eviction order (kvbm-tiering agrees with
//! it call for call). The cluster's data plane serves only blocks a kvbm-logical manager holds
//! (registered, immutable while served). So the fleet tier is the instance's own G2: `capacity`
//! chunks of host memory, filled by vLLM's cascade (its stores), evicted by kvbm-logical's
//! policy, served to peers, and announced to them. A lookup hits when the chunk is in that G2
//! or in a peer's (the index); the load copies it into vLLM's region, pulling it first when it
//! is a peer's. With a disk, the instance's G3 holds what the share held, written through on
//! every store (`Instance::offload_g3`: journaled, each block's checksum recorded) and listed
//! again at a restart: a lookup also hits there, and a load stages the chunk into the share
//! first (`Instance::stage_g3`: header, checksum, identity checked), from where peers can pull
//! it too. Peers index the disk's blocks (their events are published) but pull only from a
//! share.
//!
//! # The scheduler thread never waits on the network
//!
//! `lookup` reads in-memory maps (the G2 registry, the G3 registry with a disk, the index) and
//! answers `Hit` or `Miss`.
//! Stores and loads run on the instance's runtime; their results are queued for
//! `get_finished_jobs`. A pull is bounded by `transport.pull_deadline_ms`: a peer that dies,
//! stalls or serves bytes that fail the check fails the load job (vLLM recomputes), and the
//! manager marks the key failed for this tier; a proven-bad copy leaves the index
//! (`DataPlaneClient::with_index`). A peer no block of a pull could be read from (refused
//! connection, timeout, I/O) is skipped by lookups for `transport.heartbeat_timeout_ms`: a
//! dead peer is a miss at once rather than a failed load per lookup (vLLM 0.34's own manager
//! retries a failed promotion) until presence forgets it.
//!
//! # Identity
//!
//! A chunk is registered under `key_hash(key)` with the key's digest (`key_digest`, blake3 of
//! vLLM's key) as its identity, the same derivation kvbm's disk and object tiers use. Before a
//! pull the tier tells the instance's [`Identities`] the digest
//! of each key it asks for, so a peer naming another identity for the hash is refused
//! (counted in `ClientStats::digests_refused`); the digest is dropped once the pull settled.
//!
//! # Locks and ownership
//!
//! The tier is driven by one thread (vLLM's scheduler, through its manager). Jobs own clones of
//! the `Arc`s they need and report through a channel; the counters are atomics. The only locks
//! are the managers', the index's and the identities', each held for one call.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, Sender, channel};
use std::time::Instant;

use kvbm_engine::error::{EngineError, Result};
use kvbm_engine::stack::Identities;
use kvbm_engine::{InstanceId, KvbmRuntime};
use kvbm_logical::{BlockDigest, BlockManager, G2, G3, ImmutableBlock, SequenceHash, TierId};
use kvbm_offload::BlockFailureKind;
use kvbm_physical::PhysicalLayout;
use kvbm_tiering::tiering::{digest_hash, key_digest};
use kvbm_tiering::{
    CacheHitSource, CpuPrimaryTier, JobResult, LookupResult, OffloadKey, ReqContext,
    RequestOffloadingContext, ScheduleEndContext, SecondaryTierManager, TierJob,
};

use crate::instance::Instance;

/// What a fleet tier did, in chunks (each chunk one block of the instance's G2).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FleetStats {
    /// Lookups answered `Hit` from this instance's own G2.
    pub local_hits: u64,
    /// Lookups answered `Hit` from the index (a peer's G2).
    pub remote_hits: u64,
    /// Lookups answered `Miss`.
    pub misses: u64,
    /// Chunks stored into this instance's G2 (announced to peers).
    pub stored: u64,
    /// Chunks a store could not place (G2 full of blocks in use).
    pub store_failed: u64,
    /// Chunks written to this instance's disk (its G3, when configured: journaled, warm
    /// across restarts).
    pub stored_disk: u64,
    /// Chunks loaded into vLLM's region from this instance's G2.
    pub loaded_local: u64,
    /// Chunks loaded from this instance's disk (staged G3→G2, every read checked).
    pub loaded_disk: u64,
    /// Chunks pulled from a peer, verified, and loaded into vLLM's region.
    pub loaded_remote: u64,
    /// Chunks a load could not bring (gone, peer dead or silent, bytes refused): each one a
    /// failed job, recomputed by vLLM, never served.
    pub load_failed: u64,
}

#[derive(Debug, Default)]
struct Counters {
    local_hits: AtomicU64,
    remote_hits: AtomicU64,
    misses: AtomicU64,
    stored: AtomicU64,
    store_failed: AtomicU64,
    stored_disk: AtomicU64,
    loaded_local: AtomicU64,
    loaded_disk: AtomicU64,
    loaded_remote: AtomicU64,
    load_failed: AtomicU64,
}

impl Counters {
    fn add(c: &AtomicU64, n: usize) {
        c.fetch_add(n as u64, Ordering::Relaxed);
    }
}

/// What a job needs, shared by every job of the tier.
struct Shared {
    instance: Arc<Instance>,
    g2: Arc<BlockManager<G2>>,
    g2_layout: Arc<PhysicalLayout>,
    /// The instance's disk (G3), when configured.
    g3: Option<Arc<BlockManager<G3>>>,
    /// vLLM's primary region (chunk `i` is block `i`); holds the memory mapped.
    region: Arc<PhysicalLayout>,
    identities: Arc<Identities>,
    counters: Counters,
    /// Peers a pull could not reach, and when: skipped by lookups for `suspect_for` (a dead
    /// peer is a miss at once, not a failed load per lookup until its heartbeat window ends).
    /// A leaf lock, held for one map operation.
    suspects: parking_lot::Mutex<std::collections::HashMap<InstanceId, Instant>>,
    suspect_for: std::time::Duration,
}

/// kvbm's cluster instance as a vLLM secondary tier: see the [module docs](self).
pub struct FleetTier {
    shared: Arc<Shared>,
    tier_type: String,
    block_size: u32,
    chunk_bytes: usize,
    num_chunks: usize,
    done_tx: Sender<JobResult>,
    done_rx: Receiver<JobResult>,
    /// Jobs submitted and not yet returned by `get_finished_jobs`.
    outstanding: usize,
    /// Results received (by `drain_jobs`) and not yet returned.
    ready: Vec<JobResult>,
    /// The counters as last added to the metrics table ([`publish`](Self::publish)).
    published: FleetStats,
    /// The runtime the instance runs on, when the tier owns it (a face that made it for the
    /// tier); dropped last, after the instance.
    runtime: Option<KvbmRuntime>,
}

impl std::fmt::Debug for FleetTier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FleetTier")
            .field("instance", &self.shared.instance.id())
            .field("tier_type", &self.tier_type)
            .field("outstanding", &self.outstanding)
            .finish_non_exhaustive()
    }
}

impl FleetTier {
    /// The tier over `instance` (built with `identities`, whose chunk geometry is
    /// `primary`'s) and vLLM's region `primary`; `tier_type` is the name vLLM gave it.
    ///
    /// # Errors
    /// [`EngineError::Config`]: the instance's ranks are worker processes (key `workers.mode`),
    /// its blocks are not the region's chunk size (key `instance.geometry`), or the region has
    /// no memory (a manager without a region).
    pub fn new(
        instance: Arc<Instance>,
        identities: Arc<Identities>,
        primary: &CpuPrimaryTier,
        tier_type: impl Into<String>,
    ) -> Result<Self> {
        let Some((g2, g2_layout)) = instance.g2_here() else {
            return Err(EngineError::config(
                "workers.mode",
                "a fleet tier copies into and out of the instance's G2: its ranks must be in this process",
            ));
        };
        let (g2, g2_layout) = (g2.clone(), g2_layout.clone());
        let g3 = instance.leader().g3().cloned();
        let chunk_bytes = primary.chunk_bytes();
        if instance.block_bytes() != chunk_bytes {
            return Err(EngineError::config(
                "instance.geometry",
                format!(
                    "the instance's blocks are {} bytes, vLLM's chunks {chunk_bytes}",
                    instance.block_bytes()
                ),
            ));
        }
        let region = primary
            .memory()
            .ok_or_else(|| {
                EngineError::config("primary", "vLLM's region has no memory to copy to and from")
            })?
            .clone();
        let num_chunks = region.layout().config().num_blocks;
        let (done_tx, done_rx) = channel();
        Ok(Self {
            block_size: g2.block_size(),
            shared: Arc::new(Shared {
                g2,
                g2_layout,
                g3,
                region,
                identities,
                counters: Counters::default(),
                suspects: parking_lot::Mutex::default(),
                suspect_for: std::time::Duration::from_millis(
                    instance.runtime().config().transport.heartbeat_timeout_ms,
                ),
                instance,
            }),
            tier_type: tier_type.into(),
            chunk_bytes,
            num_chunks,
            done_tx,
            done_rx,
            outstanding: 0,
            ready: Vec::new(),
            published: FleetStats::default(),
            runtime: None,
        })
    }

    /// The tier owns `runtime` (the one its instance runs on) and shuts it down last.
    pub fn owning(mut self, runtime: KvbmRuntime) -> Self {
        self.runtime = Some(runtime);
        self
    }

    /// The instance behind the tier.
    pub fn instance(&self) -> &Arc<Instance> {
        &self.shared.instance
    }

    /// Its counters.
    pub fn stats(&self) -> FleetStats {
        let c = &self.shared.counters;
        let l = |a: &AtomicU64| a.load(Ordering::Relaxed);
        FleetStats {
            local_hits: l(&c.local_hits),
            remote_hits: l(&c.remote_hits),
            misses: l(&c.misses),
            stored: l(&c.stored),
            store_failed: l(&c.store_failed),
            stored_disk: l(&c.stored_disk),
            loaded_local: l(&c.loaded_local),
            loaded_disk: l(&c.loaded_disk),
            loaded_remote: l(&c.loaded_remote),
            load_failed: l(&c.load_failed),
        }
    }

    /// Adds what the counters gained since the last call to the metrics table
    /// ([`FLEET_LOOKUPS`](kvbm_engine::metrics::FLEET_LOOKUPS) by `result`,
    /// [`FLEET_CHUNKS`](kvbm_engine::metrics::FLEET_CHUNKS) by `outcome`): once per scheduler
    /// step and as jobs are reported, never per lookup (the lookup stays one atomic add).
    fn publish(&mut self) {
        use kvbm_engine::metrics::{FLEET_CHUNKS, FLEET_LOOKUPS};
        let now = self.stats();
        let was = std::mem::replace(&mut self.published, now);
        for (result, n) in [
            ("local", now.local_hits - was.local_hits),
            ("remote", now.remote_hits - was.remote_hits),
            ("miss", now.misses - was.misses),
        ] {
            if n > 0 {
                metrics::counter!(FLEET_LOOKUPS, "result" => result).increment(n);
            }
        }
        for (outcome, n) in [
            ("stored", now.stored - was.stored),
            ("store_failed", now.store_failed - was.store_failed),
            ("stored_disk", now.stored_disk - was.stored_disk),
            ("loaded_local", now.loaded_local - was.loaded_local),
            ("loaded_disk", now.loaded_disk - was.loaded_disk),
            ("loaded_remote", now.loaded_remote - was.loaded_remote),
            ("load_failed", now.load_failed - was.load_failed),
        ] {
            if n > 0 {
                metrics::counter!(FLEET_CHUNKS, "outcome" => outcome).increment(n);
            }
        }
    }

    /// The hash `key` is registered under in the instance's G2.
    pub fn hash_of(&self, key: &OffloadKey) -> SequenceHash {
        digest_hash(&key_digest(key), self.block_size)
    }

    /// The first peer whose G2 holds `hash`, by the index, that the directory can reach and
    /// no pull found unreachable within `suspect_for`.
    fn peer_holding(shared: &Shared, hash: SequenceHash) -> Option<InstanceId> {
        let me = shared.instance.id();
        let locations = shared.instance.index().locations(hash);
        let suspect = |i: InstanceId| {
            let mut s = shared.suspects.lock();
            match s.get(&i) {
                Some(t) if t.elapsed() < shared.suspect_for => true,
                Some(_) => {
                    s.remove(&i);
                    false
                }
                None => false,
            }
        };
        locations
            .into_iter()
            .find(|(i, t)| {
                *t == TierId::G2
                    && *i != me
                    && shared.instance.peers().get(*i).is_some()
                    && !suspect(*i)
            })
            .map(|(i, _)| i)
    }

    /// Checks a job's chunk ids against the region; the first bad one, named.
    fn check_chunks(&self, job: &TierJob) -> std::result::Result<(), String> {
        if job.keys.len() != job.chunk_ids.len() {
            return Err(format!(
                "{} keys for {} chunks",
                job.keys.len(),
                job.chunk_ids.len()
            ));
        }
        match job
            .chunk_ids
            .iter()
            .find(|c| **c < 0 || **c as usize >= self.num_chunks)
        {
            Some(c) => Err(format!(
                "chunk {c} is outside vLLM's region of {} chunks",
                self.num_chunks
            )),
            None => Ok(()),
        }
    }

    fn spawn(&mut self, job: Arc<TierJob>, work: fn(&Shared, &TierJob, u32) -> JobResult) {
        self.outstanding += 1;
        let tx = self.done_tx.clone();
        let shared = self.shared.clone();
        let block_size = self.block_size;
        let failed = |job: &TierJob, m: String| {
            tracing::warn!(job = job.job_id, "fleet tier job refused: {m}");
            JobResult {
                job_id: job.job_id,
                success: false,
                successful_keys: None,
                transfer_time: None,
                transfer_bytes: None,
                deferred_release: None,
            }
        };
        if let Err(m) = self.check_chunks(&job) {
            let _ = tx.send(failed(&job, m));
            return;
        }
        // A runtime shut down runs nothing: the job fails now rather than never ending.
        if shared.instance.runtime().is_shut_down() {
            let _ = tx.send(failed(&job, "the instance's runtime is shut down".into()));
            return;
        }
        let rt = shared.instance.runtime().tokio().clone();
        drop(rt.spawn_blocking(move || {
            let result = work(&shared, &job, block_size);
            let _ = tx.send(result);
        }));
    }
}

/// Each key of `job` as the share registers it: its hash and its identity (digest), derived
/// once per job.
fn keyed(job: &TierJob, block_size: u32) -> Vec<(SequenceHash, BlockDigest)> {
    job.keys
        .iter()
        .map(|k| {
            let digest = key_digest(k);
            (digest_hash(&digest, block_size), digest)
        })
        .collect()
}

/// A store job: each chunk not yet in G2 is copied into a new G2 block and registered under its
/// key's hash and digest (which publishes its stored event to the fleet).
fn store(shared: &Shared, job: &TierJob, block_size: u32) -> JobResult {
    let started = Instant::now();
    let keyed = keyed(job, block_size);
    let todo: Vec<(SequenceHash, BlockDigest, usize)> = keyed
        .iter()
        .zip(&job.chunk_ids)
        .filter(|((hash, _), _)| {
            shared
                .g2
                .match_blocks(std::slice::from_ref(hash))
                .is_empty()
        })
        .map(|(&(hash, digest), &chunk)| (hash, digest, chunk as usize))
        .collect();
    let mut ok = true;
    let mut bytes = 0u64;
    if !todo.is_empty() {
        match shared.g2.allocate_blocks(todo.len()) {
            Ok(blocks) => {
                let mut complete = Vec::with_capacity(blocks.len());
                for (b, (hash, digest, chunk)) in blocks.into_iter().zip(&todo) {
                    // SAFETY: the manager pinned `chunk` for this store until the job is
                    // reported; the G2 block is mutable (just allocated, not registered).
                    let copied = unsafe {
                        shared
                            .region
                            .copy_host_block(*chunk, &shared.g2_layout, b.block_id())
                    };
                    match copied {
                        Ok(n) => bytes += n as u64,
                        Err(e) => {
                            // The block goes back to its pool unregistered.
                            tracing::warn!(error = %e, "fleet tier: chunk not copied");
                            ok = false;
                            continue;
                        }
                    }
                    match b.complete_with_digest(*hash, Some(*digest)) {
                        Ok(c) => complete.push(c),
                        Err(e) => {
                            tracing::warn!(error = %e.error, "fleet tier: block refused");
                            ok = false;
                        }
                    }
                }
                let n = complete.len();
                drop(shared.g2.register_blocks(complete));
                Counters::add(&shared.counters.stored, n);
            }
            Err(e) => {
                tracing::debug!(error = %e, chunks = todo.len(), "fleet tier: no room in G2");
                Counters::add(&shared.counters.store_failed, todo.len());
                ok = false;
            }
        }
    }
    // With a disk, what the share holds of the job is written down too (journaled; blocks
    // already there are skipped). A failed write loses nothing the share holds.
    if ok && shared.g3.is_some() {
        let hashes: Vec<SequenceHash> = keyed.iter().map(|(h, _)| *h).collect();
        let rt = shared.instance.runtime().tokio().clone();
        match rt.block_on(shared.instance.offload_g3(&hashes)) {
            Ok(n) => Counters::add(&shared.counters.stored_disk, n),
            Err(e) => tracing::warn!(error = %e, "fleet tier: writing to its disk failed"),
        }
    }
    JobResult {
        job_id: job.job_id,
        success: ok,
        successful_keys: None,
        transfer_time: Some(started.elapsed().as_secs_f64()),
        transfer_bytes: Some(bytes),
        deferred_release: None,
    }
}

/// A load job: each chunk from this instance's G2, or pulled from the peer the index names
/// (verified), then copied into its reserved primary slot. A chunk that cannot be brought
/// fails the job; no byte of it is written.
fn load(shared: &Shared, job: &TierJob, block_size: u32) -> JobResult {
    let started = Instant::now();
    let n = job.keys.len();
    let keyed = keyed(job, block_size);
    let hashes: Vec<SequenceHash> = keyed.iter().map(|(h, _)| *h).collect();
    let mut blocks: Vec<Option<ImmutableBlock<G2>>> = hashes
        .iter()
        .map(|h| shared.g2.match_blocks(std::slice::from_ref(h)).pop())
        .collect();
    let local = blocks.iter().filter(|b| b.is_some()).count();
    // Then this instance's disk: staged into the share, every read checked.
    let mut disk = 0;
    if shared.g3.is_some() {
        // `stage_g3` answers not found for a chunk its disk does not hold either.
        let idx: Vec<usize> = (0..n).filter(|i| blocks[*i].is_none()).collect();
        if !idx.is_empty() {
            let asked: Vec<SequenceHash> = idx.iter().map(|&i| hashes[i]).collect();
            let rt = shared.instance.runtime().tokio().clone();
            match rt.block_on(shared.instance.stage_g3(&asked)) {
                Ok(outcomes) => {
                    for (&i, o) in idx.iter().zip(outcomes) {
                        match o {
                            Ok(b) => {
                                blocks[i] = Some(b);
                                disk += 1;
                            }
                            Err(f) if f.kind == BlockFailureKind::NotFound => {}
                            Err(f) => tracing::debug!(failure = %f, "fleet tier: disk read failed"),
                        }
                    }
                }
                Err(e) => tracing::debug!(error = %e, "fleet tier: disk read not started"),
            }
        }
    }
    // The rest, grouped by the peer the index names for each.
    let mut by_peer: Vec<(InstanceId, Vec<usize>)> = Vec::new();
    for i in (0..n).filter(|i| blocks[*i].is_none()) {
        let Some(peer) = FleetTier::peer_holding(shared, hashes[i]) else {
            continue;
        };
        match by_peer.iter_mut().find(|(p, _)| *p == peer) {
            Some((_, v)) => v.push(i),
            None => by_peer.push((peer, vec![i])),
        }
    }
    let mut remote = 0;
    for (peer, idx) in by_peer {
        let asked: Vec<SequenceHash> = idx.iter().map(|&i| hashes[i]).collect();
        for &i in &idx {
            shared.identities.learn(keyed[i].0, keyed[i].1);
        }
        let pulled = shared
            .instance
            .runtime()
            .tokio()
            .block_on(shared.instance.pull_g2(peer, &asked));
        for &i in &idx {
            shared.identities.forget(hashes[i]);
        }
        match pulled {
            Ok(outcomes) => {
                let mut unreachable = !outcomes.is_empty();
                for (&i, o) in idx.iter().zip(outcomes) {
                    match o {
                        Ok(b) => {
                            blocks[i] = Some(b);
                            remote += 1;
                            unreachable = false;
                        }
                        Err(f) => {
                            // A copy proven bad says nothing of the peer; anything else
                            // (refused connection, timeout, I/O) on every block does.
                            unreachable &= !f.kind.drops_copy();
                            tracing::debug!(%peer, failure = %f, "fleet tier: pull failed");
                        }
                    }
                }
                if unreachable {
                    tracing::info!(%peer, "fleet tier: peer unreachable; skipped until its heartbeat window passed");
                    shared.suspects.lock().insert(peer, Instant::now());
                }
            }
            Err(e) => tracing::debug!(%peer, error = %e, "fleet tier: pull not started"),
        }
    }
    let mut moved = Vec::with_capacity(n);
    let mut bytes = 0u64;
    for (i, b) in blocks.iter().enumerate() {
        if let Some(b) = b {
            // SAFETY: the manager reserved the chunk for this promotion until the job is
            // reported; the G2 block is registered (immutable) and held here.
            let copied = unsafe {
                shared.g2_layout.copy_host_block(
                    b.block_id(),
                    &shared.region,
                    job.chunk_ids[i] as usize,
                )
            };
            match copied {
                Ok(n) => {
                    bytes += n as u64;
                    moved.push(job.keys[i]);
                }
                Err(e) => tracing::warn!(error = %e, "fleet tier: chunk not copied"),
            }
        }
    }
    let c = &shared.counters;
    Counters::add(&c.loaded_local, local);
    Counters::add(&c.loaded_disk, disk);
    Counters::add(&c.loaded_remote, remote);
    Counters::add(&c.load_failed, n - moved.len());
    let success = moved.len() == n;
    JobResult {
        job_id: job.job_id,
        success,
        successful_keys: (!success && !moved.is_empty()).then_some(moved),
        transfer_time: Some(started.elapsed().as_secs_f64()),
        transfer_bytes: Some(bytes),
        deferred_release: None,
    }
}

impl SecondaryTierManager for FleetTier {
    fn tier_type(&self) -> &str {
        &self.tier_type
    }

    /// The fleet's: every hit of this tier is reported as the peer-to-peer source, whether
    /// its chunk sits in this instance's share or a peer's ([`FleetStats`] tells them apart).
    /// One source per tier, as vLLM's manager keys its accounting of a failed load by it.
    fn cache_hit_source(&self) -> CacheHitSource {
        CacheHitSource::P2p
    }

    fn block_size_bytes(&self) -> usize {
        self.chunk_bytes
    }

    fn lookup(&mut self, key: &OffloadKey, _: &ReqContext) -> LookupResult {
        let hash = self.hash_of(key);
        let c = &self.shared.counters;
        if !self
            .shared
            .g2
            .match_blocks(std::slice::from_ref(&hash))
            .is_empty()
        {
            Counters::add(&c.local_hits, 1);
            return LookupResult::Hit;
        }
        if let Some(g3) = &self.shared.g3
            && !g3.match_blocks(std::slice::from_ref(&hash)).is_empty()
        {
            Counters::add(&c.local_hits, 1);
            return LookupResult::Hit;
        }
        if Self::peer_holding(&self.shared, hash).is_some() {
            Counters::add(&c.remote_hits, 1);
            return LookupResult::Hit;
        }
        Counters::add(&c.misses, 1);
        LookupResult::Miss
    }

    fn submit_store(&mut self, job: Arc<TierJob>) {
        self.spawn(job, store);
    }

    fn submit_load(&mut self, job: Arc<TierJob>) {
        self.spawn(job, load);
    }

    fn get_finished_jobs(&mut self, out: &mut Vec<JobResult>) {
        self.ready.extend(self.done_rx.try_iter());
        self.outstanding -= self.ready.len();
        if !self.ready.is_empty() {
            self.publish();
        }
        out.append(&mut self.ready);
    }

    fn on_schedule_end(&mut self, _: &ScheduleEndContext) {
        self.publish();
    }

    fn drain_jobs(&mut self) -> kvbm_tiering::Result<()> {
        // Every job ends by sending its result (a pull is bounded by the data plane's
        // deadline), so this returns; the results wait for `get_finished_jobs`.
        while self.ready.len() < self.outstanding {
            match self.done_rx.recv() {
                Ok(r) => self.ready.push(r),
                Err(_) => break,
            }
        }
        Ok(())
    }

    fn on_new_request(&mut self, _: &ReqContext) -> RequestOffloadingContext {
        RequestOffloadingContext::default()
    }

    fn has_pending_work(&self) -> bool {
        self.outstanding > 0
    }

    /// Waits for every job, then tells the peers this instance leaves (they drop its blocks
    /// from their index at once rather than after its heartbeat window) and stops it.
    fn shutdown(&mut self) -> kvbm_tiering::Result<()> {
        self.drain_jobs()?;
        let instance = self.shared.instance.clone();
        let rt = instance.runtime().clone();
        if tokio::runtime::Handle::try_current().is_ok() {
            // On a runtime thread: the departure cannot be waited for here.
            drop(rt.spawn(async move { instance.shutdown().await }));
        } else {
            rt.tokio().block_on(instance.shutdown());
        }
        Ok(())
    }

    fn as_any_mut(&mut self) -> &mut dyn std::any::Any {
        self
    }
}
