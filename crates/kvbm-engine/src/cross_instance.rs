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

use futures::future::BoxFuture;
use kvbm_logical::{
    BlockEvent, BlockEventKind, BlockManager, G2, MutableBlock, SequenceHash, TierId,
};
use kvbm_offload::MoveOutcome;
use parking_lot::Mutex;

use crate::address::InstanceId;

/// Where blocks live across instances, as their events say: see the [module docs](self).
#[derive(Debug, Default)]
pub struct CrossInstanceIndex {
    entries: Mutex<HashMap<SequenceHash, HashSet<(InstanceId, TierId)>>>,
}

impl CrossInstanceIndex {
    /// An empty index.
    pub fn new() -> Self {
        Self::default()
    }

    /// Applies `events` published by `instance`.
    pub fn apply_events(&self, instance: InstanceId, events: &[BlockEvent]) {
        let mut entries = self.entries.lock();
        for e in events {
            match e.kind {
                BlockEventKind::Stored => {
                    entries
                        .entry(e.hash)
                        .or_default()
                        .insert((instance, e.tier));
                }
                BlockEventKind::Removed => {
                    if let Some(set) = entries.get_mut(&e.hash) {
                        set.remove(&(instance, e.tier));
                        if set.is_empty() {
                            entries.remove(&e.hash);
                        }
                    }
                }
            }
        }
    }

    /// Everything `instance` is said to hold, sorted (e.g. to answer a snapshot request from
    /// this instance's own record).
    pub fn entries_of(&self, instance: InstanceId) -> Vec<(SequenceHash, TierId)> {
        let mut out: Vec<_> = self
            .entries
            .lock()
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

    /// How many (block, tier) locations `instance` is said to hold.
    pub fn count_of(&self, instance: InstanceId) -> usize {
        self.entries
            .lock()
            .values()
            .map(|set| set.iter().filter(|(i, _)| *i == instance).count())
            .sum()
    }

    /// Forgets everything about `instance` (it left or expired); returns how many locations
    /// were dropped.
    pub fn remove_instance(&self, instance: InstanceId) -> usize {
        let mut entries = self.entries.lock();
        let mut dropped = 0;
        entries.retain(|_, set| {
            let before = set.len();
            set.retain(|(i, _)| *i != instance);
            dropped += before - set.len();
            !set.is_empty()
        });
        dropped
    }

    /// Replaces what is known about `instance` with `entries` (a snapshot it answered), in
    /// one step under the lock.
    pub fn replace_instance(&self, instance: InstanceId, entries: &[(SequenceHash, TierId)]) {
        let mut map = self.entries.lock();
        map.retain(|_, set| {
            set.retain(|(i, _)| *i != instance);
            !set.is_empty()
        });
        for (h, t) in entries {
            map.entry(*h).or_default().insert((instance, *t));
        }
    }

    /// The instances the index knows anything about, sorted.
    pub fn instances(&self) -> Vec<InstanceId> {
        let set: HashSet<InstanceId> = self
            .entries
            .lock()
            .values()
            .flat_map(|s| s.iter().map(|(i, _)| *i))
            .collect();
        let mut out: Vec<_> = set.into_iter().collect();
        out.sort();
        out
    }

    /// Where `hash` is said to be.
    pub fn locations(&self, hash: SequenceHash) -> Vec<(InstanceId, TierId)> {
        let mut out: Vec<_> = self
            .entries
            .lock()
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
        let entries = self.entries.lock();
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
        self.entries.lock().len()
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
