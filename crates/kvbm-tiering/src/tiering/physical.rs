//! `PhysicalTier`: a secondary tier whose bytes live in kvbm-physical storage — G3 disk (one
//! `fallocate`d file of fixed slots, O_DIRECT through io_uring, checksummed header per block) or
//! G4 objects (one object per chunk, checksummed) — moved by kvbm-physical's `TransferManager`
//! between the primary tier's pinned host slots and the tier.
//!
//! Bookkeeping (scheduler thread only):
//!
//! ```text
//! submit_store: key absent → slot allocated (free list, else the oldest ready unread key is
//!               evicted; a full tier of busy keys drops the key) → Writing ──copy ok──► Ready
//!                                                                   └─copy failed─► freed
//! submit_load:  every key Ready → readers+1 ─► copy into the reserved primary slots ─► readers-1
//!               (a key whose read fails verification is dropped: it reads MISS afterwards)
//! ```
//!
//! Jobs complete asynchronously on the transfer manager's runtime; `get_finished_jobs` polls the
//! completions without blocking, `drain_jobs` waits for all. A job is reported exactly once.
//! Object chunks are named `<namespace>/<tier prefix><key hex>`; the object side's block ids
//! are positions, as kvbm-physical defines them.
//!
//! # Identity
//!
//! Every transfer, both ways, passes each chunk's identity ([`key_identity`]: a 256-bit BLAKE3
//! digest of the full `OffloadKey` bytes, i.e. vLLM's block hash and group index). It is
//! written into the disk slot's or object's header on store and required on load, so a slot
//! reused for another key, a file written by another instance, or an object under a copied or
//! colliding name is an identity mismatch: the read fails, the key is dropped and reads MISS,
//! never another chunk's bytes. Why this tier does not go through `kvbm-offload`'s `BlockMover`:
//! see the crate README ("Real-byte tiers and the one move").

use std::sync::Arc;

use futures::FutureExt;
use hashbrown::HashMap;
use kvbm_physical::{
    BlockId, BlockIdentity, DiskConfig, LayoutHandle, ObjectKey, ObjectStorage, PhysicalLayout,
    TransferCompletion, TransferManager, TransferOptions,
};

use crate::cpu::CpuPrimaryTier;
use crate::cpu::order::LinkedKeySet;
use crate::error::{Result, TieringError};
use crate::key::OffloadKey;
use crate::tiering::backpressure::BackpressureDetector;
use crate::tiering::base::{JobId, JobResult, SecondaryTierManager, TransferJob};
use crate::types::{Locality, LookupResult, Medium, ReqContext, RequestOffloadingContext};

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum State {
    Writing,
    Ready,
}

struct Entry {
    slot: u32,
    state: State,
    readers: u32,
}

struct JobMeta {
    job_id: JobId,
    is_promotion: bool,
    keys: Vec<OffloadKey>,
    bytes: u64,
    started: std::time::Instant,
}

struct Inflight {
    meta: JobMeta,
    completion: TransferCompletion,
}

enum Backend {
    Disk,
    Object { prefix: String },
}

/// The identity a chunk's header carries in a disk slot or object, and which a load requires: a
/// domain-separated 256-bit BLAKE3 digest of the key's bytes (block hash and group index; a key
/// may be up to 39 bytes, more than a 32-byte identity holds, so it is digested, not copied).
pub fn key_identity(key: &OffloadKey) -> BlockIdentity {
    let mut h = blake3::Hasher::new();
    h.update(b"kvbm-tiering-offload-key-v1");
    h.update(&[key.as_bytes().len() as u8]);
    h.update(key.as_bytes());
    BlockIdentity::from_bytes(*h.finalize().as_bytes())
}

/// A G3 (disk) or G4 (object) secondary tier over kvbm-physical.
pub struct PhysicalTier {
    tier_type: String,
    medium: Medium,
    locality: Locality,
    chunk_bytes: usize,
    tm: Arc<TransferManager>,
    primary: LayoutHandle,
    tier: LayoutHandle,
    backend: Backend,
    capacity: usize,
    entries: HashMap<OffloadKey, Entry>,
    ready_order: LinkedKeySet,
    free: Vec<u32>,
    next_slot: u32,
    inflight: Vec<Inflight>,
    done: Vec<JobResult>,
    detector: Option<BackpressureDetector>,
}

impl PhysicalTier {
    fn primary_of(primary: &CpuPrimaryTier) -> Result<(Arc<TransferManager>, LayoutHandle)> {
        let (tm, h) = primary.transfer().ok_or_else(|| {
            TieringError::Config(
                "the primary tier's memory is not registered with a TransferManager \
                 (build it with CpuPrimaryTier::with_transfer_manager)"
                    .into(),
            )
        })?;
        Ok((tm.clone(), h))
    }

    fn new(
        primary: &CpuPrimaryTier,
        tier_type: &str,
        medium: Medium,
        locality: Locality,
        layout: PhysicalLayout,
        backend: Backend,
        capacity: usize,
    ) -> Result<Self> {
        let (tm, ph) = Self::primary_of(primary)?;
        let th = tm.register_layout(layout)?;
        Ok(Self {
            tier_type: tier_type.into(),
            medium,
            locality,
            chunk_bytes: primary.chunk_bytes(),
            tm,
            primary: ph,
            tier: th,
            backend,
            capacity,
            entries: HashMap::new(),
            ready_order: LinkedKeySet::new(),
            free: Vec::new(),
            next_slot: 0,
            inflight: Vec::new(),
            done: Vec::new(),
            detector: None,
        })
    }

    /// A disk tier of `capacity` chunk slots in the file `config.path`.
    pub fn disk(primary: &CpuPrimaryTier, config: &DiskConfig, capacity: usize) -> Result<Self> {
        let layout = CpuPrimaryTier::block_layout(capacity, primary.chunk_bytes())?;
        let disk = PhysicalLayout::create_disk(layout, config)?;
        Self::new(
            primary,
            "disk",
            Medium::Storage,
            Locality::Local,
            disk,
            Backend::Disk,
            capacity,
        )
    }

    /// An object tier (unbounded) in `storage`, object names prefixed with `prefix`.
    pub fn object(
        primary: &CpuPrimaryTier,
        storage: Arc<ObjectStorage>,
        prefix: &str,
    ) -> Result<Self> {
        let layout = CpuPrimaryTier::block_layout(
            primary.manager().num_chunks().max(1),
            primary.chunk_bytes(),
        )?;
        let obj = PhysicalLayout::object(layout, storage);
        Self::new(
            primary,
            "obj",
            Medium::Storage,
            Locality::Remote,
            obj,
            Backend::Object {
                prefix: prefix.into(),
            },
            usize::MAX,
        )
    }

    /// Attaches a backpressure detector.
    pub fn with_backpressure(mut self, d: BackpressureDetector) -> Self {
        self.detector = Some(d);
        self
    }

    /// Keys readable from the tier.
    pub fn num_ready(&self) -> usize {
        self.ready_order.len()
    }

    /// Jobs not yet finished.
    pub fn num_inflight(&self) -> usize {
        self.inflight.len()
    }

    fn object_key(prefix: &str, k: &OffloadKey) -> ObjectKey {
        let mut s = String::with_capacity(prefix.len() + 2 * k.as_bytes().len());
        s.push_str(prefix);
        for b in k.as_bytes() {
            use std::fmt::Write as _;
            let _ = write!(s, "{b:02x}");
        }
        ObjectKey::new(s)
    }

    fn alloc_slot(&mut self) -> Option<u32> {
        if let Some(s) = self.free.pop() {
            return Some(s);
        }
        if matches!(self.backend, Backend::Object { .. })
            || (self.next_slot as usize) < self.capacity
        {
            self.next_slot = self.next_slot.wrapping_add(1);
            return Some(self.next_slot.wrapping_sub(1));
        }
        // evict the oldest ready key nobody is reading
        let victim = self
            .ready_order
            .iter()
            .find(|k| self.entries.get(k).is_some_and(|e| e.readers == 0))?;
        self.ready_order.remove(&victim);
        let e = self
            .entries
            .remove(&victim)
            .expect("ready key has an entry");
        Some(e.slot)
    }

    /// Object keys (object tier) and, for every chunk, its [`key_identity`].
    fn options(&self, keys: &[OffloadKey]) -> TransferOptions {
        let opts = match &self.backend {
            Backend::Disk => TransferOptions::default(),
            Backend::Object { prefix } => TransferOptions::with_object_keys(
                keys.iter().map(|k| Self::object_key(prefix, k)).collect(),
            ),
        };
        opts.identities(keys.iter().map(key_identity).collect())
    }

    fn tier_ids(&self, slots: &[u32]) -> Vec<BlockId> {
        match self.backend {
            Backend::Disk => slots.iter().map(|&s| s as BlockId).collect(),
            Backend::Object { .. } => (0..slots.len()).collect(),
        }
    }

    fn finish(&mut self, f: JobMeta, outcome: kvbm_physical::TransferOutcome) {
        let mut ok_keys = Vec::new();
        for (i, (_, r)) in outcome.blocks.iter().enumerate() {
            let k = f.keys[i];
            if f.is_promotion {
                if let Some(e) = self.entries.get_mut(&k) {
                    e.readers -= 1;
                }
                match r {
                    Ok(()) => ok_keys.push(k),
                    Err(err) => {
                        // the tier's copy failed verification or vanished: never serve it again
                        tracing::warn!(key = %k, error = %err, "secondary read failed; dropping the key");
                        if self.entries.get(&k).is_some_and(|e| e.readers == 0) {
                            let e = self.entries.remove(&k).expect("present");
                            self.ready_order.remove(&k);
                            self.free.push(e.slot);
                        }
                    }
                }
            } else {
                match r {
                    Ok(()) => {
                        if let Some(e) = self.entries.get_mut(&k) {
                            e.state = State::Ready;
                        }
                        self.ready_order.insert(k, 0);
                        ok_keys.push(k);
                    }
                    Err(err) => {
                        tracing::warn!(key = %k, error = %err, "secondary write failed");
                        if let Some(e) = self.entries.remove(&k) {
                            self.free.push(e.slot);
                        }
                    }
                }
            }
        }
        let success = ok_keys.len() == f.keys.len();
        self.done.push(JobResult {
            job_id: f.job_id,
            success,
            successful_keys: (!success && f.is_promotion).then_some(ok_keys),
            transfer_time: Some(f.started.elapsed().as_secs_f64()),
            transfer_bytes: Some(f.bytes),
        });
    }

    fn start(
        &mut self,
        job: &TransferJob,
        keys: Vec<OffloadKey>,
        src: Vec<BlockId>,
        dst: Vec<BlockId>,
        promotion: bool,
    ) {
        let opts = self.options(&keys);
        let (s, d) = if promotion {
            (self.tier, self.primary)
        } else {
            (self.primary, self.tier)
        };
        let bytes = (keys.len() * self.chunk_bytes) as u64;
        match self.tm.execute_transfer(s, &src, d, &dst, opts) {
            Ok(completion) => self.inflight.push(Inflight {
                meta: JobMeta {
                    job_id: job.job_id,
                    is_promotion: promotion,
                    keys,
                    bytes,
                    started: std::time::Instant::now(),
                },
                completion,
            }),
            Err(e) => {
                tracing::error!(job_id = job.job_id, error = %e, "transfer rejected");
                for k in &keys {
                    if promotion {
                        if let Some(en) = self.entries.get_mut(k) {
                            en.readers -= 1;
                        }
                    } else if let Some(en) = self.entries.remove(k) {
                        self.free.push(en.slot);
                    }
                }
                self.done.push(JobResult::new(job.job_id, false));
            }
        }
    }
}

impl SecondaryTierManager for PhysicalTier {
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
    fn bp_detector(&mut self) -> Option<&mut BackpressureDetector> {
        self.detector.as_mut()
    }
    fn lookup(&mut self, key: &OffloadKey, _: &ReqContext) -> LookupResult {
        match self.entries.get(key) {
            Some(e) if e.state == State::Ready => LookupResult::Hit,
            _ => LookupResult::Miss,
        }
    }
    fn submit_store(&mut self, job: Arc<TransferJob>) {
        let (mut keys, mut src, mut slots) = (Vec::new(), Vec::new(), Vec::new());
        for (k, &c) in job.keys.iter().zip(&job.chunk_ids) {
            if self.entries.contains_key(k) {
                continue;
            }
            let Some(slot) = self.alloc_slot() else {
                tracing::debug!(key = %k, "secondary tier full of busy keys; store dropped");
                continue;
            };
            self.entries.insert(
                *k,
                Entry {
                    slot,
                    state: State::Writing,
                    readers: 0,
                },
            );
            keys.push(*k);
            src.push(c as BlockId);
            slots.push(slot);
        }
        if keys.is_empty() {
            self.done.push(JobResult::new(job.job_id, true));
            return;
        }
        let dst = self.tier_ids(&slots);
        self.start(&job, keys, src, dst, false);
    }
    fn submit_load(&mut self, job: Arc<TransferJob>) {
        let all_ready = job
            .keys
            .iter()
            .all(|k| self.entries.get(k).is_some_and(|e| e.state == State::Ready));
        if !all_ready {
            self.done.push(JobResult::new(job.job_id, false));
            return;
        }
        let mut slots = Vec::with_capacity(job.keys.len());
        for k in &job.keys {
            let e = self.entries.get_mut(k).expect("checked");
            e.readers += 1;
            slots.push(e.slot);
        }
        let src = self.tier_ids(&slots);
        let dst = job.chunk_ids.iter().map(|&c| c as BlockId).collect();
        self.start(&job, job.keys.clone(), src, dst, true);
    }
    fn get_finished_jobs(&mut self, out: &mut Vec<JobResult>) {
        let mut i = 0;
        while i < self.inflight.len() {
            match (&mut self.inflight[i].completion).now_or_never() {
                Some(outcome) => {
                    let f = self.inflight.swap_remove(i);
                    self.finish(f.meta, outcome);
                }
                None => i += 1,
            }
        }
        out.append(&mut self.done);
    }
    fn drain_jobs(&mut self) -> Result<()> {
        for f in std::mem::take(&mut self.inflight) {
            let outcome = f.completion.wait();
            self.finish(f.meta, outcome);
        }
        Ok(())
    }
    fn on_new_request(&mut self, _: &ReqContext) -> RequestOffloadingContext {
        RequestOffloadingContext::default()
    }
    fn has_pending_work(&self) -> bool {
        !self.inflight.is_empty()
    }
    fn shutdown(&mut self) -> Result<()> {
        self.drain_jobs()?;
        self.tm
            .unregister_layout(self.tier)
            .map_err(TieringError::from)
    }
    fn as_any_mut(&mut self) -> &mut dyn std::any::Any {
        self
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
