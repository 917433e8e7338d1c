//! Duplicate suppression: a block already in flight to a destination is not enqueued twice.
//!
//! `enqueue` inserts every block's sequence hash into the pipeline's [`PendingTracker`] and keeps
//! a [`PendingGuard`] with the block until its transfer has finished **and** the destination has
//! registered it. A second enqueue of the same hash in that window is reported as filtered.
//! After the guard drops, the presence policies see the block in the destination instead, so
//! there is no gap in which a duplicate could slip through.
//!
//! Lock order: the tracker's mutex is a leaf lock; guards are dropped outside it.

use std::collections::HashSet;
use std::sync::Arc;

use kvbm_logical::SequenceHash;
use parking_lot::Mutex;

/// Tracks sequence hashes that are currently pending transfer.
#[derive(Clone, Default)]
pub struct PendingTracker {
    set: Arc<Mutex<HashSet<SequenceHash>>>,
}

impl std::fmt::Debug for PendingTracker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PendingTracker")
            .field("pending", &self.len())
            .finish()
    }
}

impl PendingTracker {
    /// An empty tracker.
    pub fn new() -> Self {
        Self::default()
    }

    /// Marks `hash` pending; `None` when it already is.
    pub fn try_insert(&self, hash: SequenceHash) -> Option<PendingGuard> {
        self.set.lock().insert(hash).then(|| PendingGuard {
            tracker: self.clone(),
            hash,
        })
    }

    /// Marks each hash pending under one lock acquisition; `None` entries were already pending
    /// (including a repeat earlier in the same slice).
    pub fn try_insert_batch(
        &self,
        hashes: impl IntoIterator<Item = SequenceHash>,
    ) -> Vec<Option<PendingGuard>> {
        let mut set = self.set.lock();
        hashes
            .into_iter()
            .map(|hash| {
                set.insert(hash).then(|| PendingGuard {
                    tracker: self.clone(),
                    hash,
                })
            })
            .collect()
    }

    /// Whether `hash` is pending.
    pub fn contains(&self, hash: SequenceHash) -> bool {
        self.set.lock().contains(&hash)
    }

    /// Number of pending hashes.
    pub fn len(&self) -> usize {
        self.set.lock().len()
    }

    /// Whether nothing is pending.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// RAII guard that removes a sequence hash from the pending set on drop.
pub struct PendingGuard {
    tracker: PendingTracker,
    hash: SequenceHash,
}

impl PendingGuard {
    /// The guarded hash.
    pub fn sequence_hash(&self) -> SequenceHash {
        self.hash
    }
}

impl std::fmt::Debug for PendingGuard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("PendingGuard").field(&self.hash).finish()
    }
}

impl Drop for PendingGuard {
    fn drop(&mut self) {
        self.tracker.set.lock().remove(&self.hash);
    }
}
