//! Where blocks live in other instances, and how their G2 blocks come here: the two seams
//! between the core (the leader's remote search, an onboarding session's pull phase) and the
//! cluster plane that fills them.
//!
//! * [`CrossInstanceIndex`]: hash → {(instance, tier)}, kept by the cluster plane's pub/sub
//!   (`cluster::pubsub`: `CrossInstanceIndex::apply` / `follow`) and read by the leader
//!   (`leader::RemoteSearch`). A hint of where blocks probably are,
//!   never proof: whoever acts on it verifies presence and checksums.
//! * [`RemotePull`]: pulls remote G2 blocks into local G2 (the data plane's `DataPlaneClient`
//!   over TCP; NIXL would be another).
//!
//! # Locks
//!
//! The index has one `parking_lot` mutex, taken only inside its own methods.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use futures::future::BoxFuture;
use kvbm_logical::{
    BlockEvent, BlockEventKind, BlockManager, G2, MutableBlock, SequenceHash, TierId,
};
use kvbm_offload::MoveOutcome;
use parking_lot::Mutex;

use crate::address::InstanceId;

/// Where blocks live across instances, as their events say: see the [module docs](self).
///
/// Bounded per instance: at most [`cap`](Self::cap) locations of any one instance are kept (a
/// stored event past it is dropped and counted, [`over_cap`](Self::over_cap)), so a member
/// announcing without end fills only its own share. How many locations an instance holds is
/// kept as they change ([`count_of`](Self::count_of) scans nothing).
#[derive(Debug)]
pub struct CrossInstanceIndex {
    inner: Mutex<Entries>,
    cap: usize,
    over_cap: AtomicU64,
}

#[derive(Debug, Default)]
struct Entries {
    by_hash: HashMap<SequenceHash, HashSet<(InstanceId, TierId)>>,
    /// Locations per instance (never 0: an instance with none has no entry).
    counts: HashMap<InstanceId, usize>,
}

impl Entries {
    fn insert(
        &mut self,
        cap: usize,
        instance: InstanceId,
        hash: SequenceHash,
        tier: TierId,
    ) -> bool {
        if self
            .by_hash
            .get(&hash)
            .is_some_and(|set| set.contains(&(instance, tier)))
        {
            return true;
        }
        if self.counts.get(&instance).copied().unwrap_or(0) >= cap {
            return false;
        }
        self.by_hash
            .entry(hash)
            .or_default()
            .insert((instance, tier));
        *self.counts.entry(instance).or_default() += 1;
        true
    }

    fn remove(&mut self, instance: InstanceId, hash: SequenceHash, tier: TierId) {
        if let Some(set) = self.by_hash.get_mut(&hash)
            && set.remove(&(instance, tier))
        {
            if set.is_empty() {
                self.by_hash.remove(&hash);
            }
            if let Some(c) = self.counts.get_mut(&instance) {
                *c -= 1;
                if *c == 0 {
                    self.counts.remove(&instance);
                }
            }
        }
    }

    /// The locations held of `instance`.
    fn count(&self, instance: InstanceId) -> usize {
        self.counts.get(&instance).copied().unwrap_or(0)
    }

    fn remove_instance(&mut self, instance: InstanceId) -> usize {
        if self.counts.remove(&instance).is_none() {
            return 0;
        }
        let mut dropped = 0;
        self.by_hash.retain(|_, set| {
            let before = set.len();
            set.retain(|(i, _)| *i != instance);
            dropped += before - set.len();
            !set.is_empty()
        });
        dropped
    }
}

/// Sets the index-size gauge of `instance` (outside the index's lock).
fn publish_count(instance: InstanceId, count: usize) {
    metrics::gauge!(
        crate::metrics::INDEX_PEER_ENTRIES,
        crate::metrics::PEER_LABEL => instance.to_string()
    )
    .set(count as f64);
}

impl Default for CrossInstanceIndex {
    fn default() -> Self {
        Self::with_cap(usize::MAX)
    }
}

impl CrossInstanceIndex {
    /// An empty index with no bound per instance (tests, a single trusted process).
    pub fn new() -> Self {
        Self::default()
    }

    /// An empty index keeping at most `cap` locations of any one instance (the cluster plane's
    /// instance uses `transport.snapshot_max_entries`, what one snapshot may carry).
    pub fn with_cap(cap: usize) -> Self {
        Self {
            inner: Mutex::new(Entries::default()),
            cap: cap.max(1),
            over_cap: AtomicU64::new(0),
        }
    }

    /// The most locations kept of one instance.
    pub fn cap(&self) -> usize {
        self.cap
    }

    /// Stored locations dropped because their instance was at the cap.
    pub fn over_cap(&self) -> u64 {
        self.over_cap.load(Ordering::Relaxed)
    }

    /// Applies `events` published by `instance`.
    pub fn apply_events(&self, instance: InstanceId, events: &[BlockEvent]) {
        let mut dropped = 0;
        let count = {
            let mut entries = self.inner.lock();
            for e in events {
                match e.kind {
                    BlockEventKind::Stored => {
                        if !entries.insert(self.cap, instance, e.hash, e.tier) {
                            dropped += 1;
                        }
                    }
                    BlockEventKind::Removed => entries.remove(instance, e.hash, e.tier),
                }
            }
            entries.count(instance)
        };
        self.dropped(dropped);
        publish_count(instance, count);
    }

    fn dropped(&self, n: u64) {
        if n > 0 {
            self.over_cap.fetch_add(n, Ordering::Relaxed);
            metrics::counter!(crate::metrics::INDEX_ENTRIES_OVER_CAP).increment(n);
        }
    }

    /// Everything `instance` is said to hold, sorted (e.g. to answer a snapshot request from
    /// this instance's own record).
    pub fn entries_of(&self, instance: InstanceId) -> Vec<(SequenceHash, TierId)> {
        let mut out: Vec<_> = self
            .inner
            .lock()
            .by_hash
            .iter()
            .flat_map(|(h, set)| {
                set.iter()
                    .filter(|(i, _)| *i == instance)
                    .map(|(_, t)| (*h, *t))
                    .collect::<Vec<_>>()
            })
            .collect();
        out.sort();
        out
    }

    /// How many (block, tier) locations `instance` is said to hold (kept as they change).
    pub fn count_of(&self, instance: InstanceId) -> usize {
        self.inner
            .lock()
            .counts
            .get(&instance)
            .copied()
            .unwrap_or(0)
    }

    /// Forgets that `instance` holds `hash` in `tier` (a pull from it proved the entry wrong:
    /// the block is not there, or it is not the block asked for); returns whether it was
    /// known. A later event or snapshot of the instance may announce it again.
    pub fn forget(&self, instance: InstanceId, hash: SequenceHash, tier: TierId) -> bool {
        let (known, count) = {
            let mut entries = self.inner.lock();
            let known = entries
                .by_hash
                .get(&hash)
                .is_some_and(|set| set.contains(&(instance, tier)));
            entries.remove(instance, hash, tier);
            (known, entries.count(instance))
        };
        publish_count(instance, count);
        known
    }

    /// Forgets everything about `instance` (it left or expired); returns how many locations
    /// were dropped.
    pub fn remove_instance(&self, instance: InstanceId) -> usize {
        let dropped = self.inner.lock().remove_instance(instance);
        publish_count(instance, 0);
        dropped
    }

    /// Replaces what is known about `instance` with `entries` (a snapshot it answered), in
    /// one step under the lock; past the cap the rest are dropped and counted.
    pub fn replace_instance(&self, instance: InstanceId, entries: &[(SequenceHash, TierId)]) {
        let mut dropped = 0;
        let count = {
            let mut map = self.inner.lock();
            map.remove_instance(instance);
            for (h, t) in entries {
                if !map.insert(self.cap, instance, *h, *t) {
                    dropped += 1;
                }
            }
            map.count(instance)
        };
        self.dropped(dropped);
        publish_count(instance, count);
    }

    /// The instances the index knows anything about, sorted.
    pub fn instances(&self) -> Vec<InstanceId> {
        let mut out: Vec<_> = self.inner.lock().counts.keys().copied().collect();
        out.sort();
        out
    }

    /// Where `hash` is said to be.
    pub fn locations(&self, hash: SequenceHash) -> Vec<(InstanceId, TierId)> {
        let mut out: Vec<_> = self
            .inner
            .lock()
            .by_hash
            .get(&hash)
            .map(|s| s.iter().copied().collect())
            .unwrap_or_default();
        out.sort();
        out
    }

    /// For each instance other than `except`, how long a prefix of `hashes` it is said to hold
    /// (in any tier); longest first, instances holding nothing omitted.
    pub fn prefix_by_instance(
        &self,
        hashes: &[SequenceHash],
        except: Option<InstanceId>,
    ) -> Vec<(InstanceId, usize)> {
        let inner = self.inner.lock();
        let entries = &inner.by_hash;
        let mut alive: Option<HashSet<InstanceId>> = None;
        let mut lengths: HashMap<InstanceId, usize> = HashMap::new();
        for (i, h) in hashes.iter().enumerate() {
            let here: HashSet<InstanceId> = entries
                .get(h)
                .map(|s| s.iter().map(|(inst, _)| *inst).collect())
                .unwrap_or_default();
            let next: HashSet<InstanceId> = match &alive {
                None => here,
                Some(a) => a.intersection(&here).copied().collect(),
            };
            for inst in &next {
                lengths.insert(*inst, i + 1);
            }
            if next.is_empty() {
                break;
            }
            alive = Some(next);
        }
        let mut out: Vec<_> = lengths
            .into_iter()
            .filter(|(inst, _)| Some(*inst) != except)
            .collect();
        out.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
        out
    }

    /// Number of hashes with at least one location.
    pub fn len(&self) -> usize {
        self.inner.lock().by_hash.len()
    }

    /// Whether the index knows nothing.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Pulls remote G2 blocks into local G2: the seam an onboarding session's pull phase uses
/// (the cluster plane's `DataPlaneClient` over TCP; NIXL would be another).
pub trait RemotePull: Send + Sync + 'static {
    /// The local G2 manager destinations are allocated from and registered in.
    fn destination(&self) -> &Arc<BlockManager<G2>>;
    /// Pulls `hashes[i]` from `instance` into `destinations[i]`; one outcome per block, in
    /// order. A block is registered only if its frame verified; resolves when every block
    /// settled (its destination is registered or dropped).
    fn pull<'a>(
        &'a self,
        instance: InstanceId,
        hashes: &'a [SequenceHash],
        destinations: Vec<MutableBlock<G2>>,
    ) -> BoxFuture<'a, Vec<MoveOutcome<G2>>>;
}

#[cfg(test)]
mod tests;
