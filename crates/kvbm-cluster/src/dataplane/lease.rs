//! [`Leases`]: the G2 slots a worker rank's leader lent to one puller instance, which the
//! rank's slice server serves (see [`crate::dataplane::rank`]).
//!
//! A worker rank owns its G2 bytes but not their bookkeeping: which block a slot holds, and
//! whether it may be rewritten, is its leader's. The leader *lends* slots: it holds the blocks
//! (`ImmutableBlock`s, so nothing rewrites the slots), then tells each rank, over its sealed
//! control channel, which slot holds which block, for which puller instance, until when. The
//! rank serves exactly those, to a worker of that instance at its own rank, and nothing else.
//!
//! # Invariants
//!
//! * A slot is read only under a `LentHold`: a read guard on its lease's gate, taken while
//!   the lease is in the table and not expired.
//! * [`Leases::end`] removes the lease, then takes the gate's write side: it returns only when
//!   no read of the lease's slots is in flight. The leader drops its block holds only after
//!   every rank answered `EndLease` (or was lost), so a slot is never rewritten while a rank
//!   reads it.
//! * An expired lease serves nothing more; it is removed from the table only when no read
//!   holds its gate (so [`Leases::end`] finding nothing means nothing reads).
//!
//! # Locks
//!
//! One `parking_lot` mutex over the table, taken inside these methods only, never across an
//! `.await`; the gates are tokio `RwLock`s, awaited only by [`Leases::end`] (after the table's
//! mutex is released).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvbm_logical::{BlockDigest, SequenceHash};
use parking_lot::Mutex;
use serde::{Deserialize, Serialize};
use tokio::sync::{OwnedRwLockReadGuard, RwLock};

use kvbm_engine::InstanceId;

/// Most leases a rank keeps at once; a leader lending more is refused (a leader bounds its own
/// leases lower: `transport.max_connections`).
pub const MAX_LEASES: usize = 4096;

/// One lent block: its hash, the slot that holds it, the registration it holds it under (the
/// checksum memo's key) and its digest, if recorded.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LentBlock {
    /// The block's sequence hash.
    pub hash: SequenceHash,
    /// Its G2 slot (block id) on every rank.
    pub slot: usize,
    /// The registration the leader holds it under.
    pub registration: u32,
    /// Its 256-bit identity, when the leader recorded one.
    pub digest: Option<BlockDigest>,
}

struct Lease {
    lessee: InstanceId,
    expires: Instant,
    gate: Arc<RwLock<()>>,
    blocks: HashMap<SequenceHash, LentBlock>,
}

/// A lent block held for one response: its lease cannot end while this lives.
pub(crate) struct LentHold {
    pub(crate) block: LentBlock,
    _gate: Arc<OwnedRwLockReadGuard<()>>,
}

/// The slots a rank's leader lent: see the [module docs](self).
#[derive(Default)]
pub struct Leases {
    table: Mutex<HashMap<u128, Lease>>,
}

impl std::fmt::Debug for Leases {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Leases")
            .field("leases", &self.table.lock().len())
            .finish()
    }
}

impl Leases {
    /// An empty table.
    pub fn new() -> Self {
        Self::default()
    }

    /// Records lease `id`: `blocks` served to workers of `lessee` for `ttl`.
    ///
    /// # Errors
    /// A message when `id` is already lent, or [`MAX_LEASES`] are.
    pub fn lend(
        &self,
        id: u128,
        lessee: InstanceId,
        ttl: Duration,
        blocks: &[LentBlock],
    ) -> Result<(), String> {
        let mut table = self.table.lock();
        let now = Instant::now();
        // Expired leases nobody reads any more leave (their reads are over: `try_write`).
        table.retain(|_, l| l.expires > now || l.gate.try_write().is_err());
        if table.contains_key(&id) {
            return Err(format!("lease {id:032x} is already lent"));
        }
        if table.len() >= MAX_LEASES {
            return Err(format!("{MAX_LEASES} leases are lent already"));
        }
        table.insert(
            id,
            Lease {
                lessee,
                expires: now + ttl,
                gate: Arc::new(RwLock::new(())),
                blocks: blocks.iter().map(|b| (b.hash, *b)).collect(),
            },
        );
        Ok(())
    }

    /// Ends lease `id`: nothing of it is served after this returns, and no read of its slots
    /// is in flight. Returns whether it was lent (an unknown or pruned lease: nothing reads).
    pub async fn end(&self, id: u128) -> bool {
        let Some(lease) = self.table.lock().remove(&id) else {
            return false;
        };
        // Every read in flight holds the gate's read side.
        let _done = lease.gate.write().await;
        true
    }

    /// Leases lent now (expired ones included until they are pruned).
    pub fn len(&self) -> usize {
        self.table.lock().len()
    }

    /// Whether none is lent.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The blocks of `hashes` lent to `lessee` (any lessee when `None`: an unauthenticated
    /// rank plane, where nobody can be told apart), each held for one response.
    pub(crate) fn hold(
        &self,
        lessee: Option<InstanceId>,
        hashes: &[SequenceHash],
    ) -> HashMap<SequenceHash, LentHold> {
        let now = Instant::now();
        let table = self.table.lock();
        let mut out = HashMap::new();
        // One read guard per lease used by this response.
        let mut gates: HashMap<u128, Arc<OwnedRwLockReadGuard<()>>> = HashMap::new();
        for h in hashes {
            if out.contains_key(h) {
                continue;
            }
            let found = table.iter().find(|(_, l)| {
                l.expires > now && lessee.is_none_or(|i| i == l.lessee) && l.blocks.contains_key(h)
            });
            let Some((id, lease)) = found else {
                continue;
            };
            let gate = match gates.get(id) {
                Some(g) => g.clone(),
                None => match lease.gate.clone().try_read_owned() {
                    Ok(g) => {
                        let g = Arc::new(g);
                        gates.insert(*id, g.clone());
                        g
                    }
                    // Ending: serves nothing more.
                    Err(_) => continue,
                },
            };
            out.insert(
                *h,
                LentHold {
                    block: lease.blocks[h],
                    _gate: gate,
                },
            );
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn block(h: u128, slot: usize) -> LentBlock {
        LentBlock {
            hash: SequenceHash::from_u128(h),
            slot,
            registration: 1,
            digest: None,
        }
    }

    const P: InstanceId = InstanceId(7);

    #[tokio::test]
    async fn a_lease_serves_its_lessee_only_until_it_ends_and_end_waits_for_reads() {
        let leases = Arc::new(Leases::new());
        leases
            .lend(1, P, Duration::from_secs(60), &[block(10, 3), block(11, 4)])
            .unwrap();
        assert!(leases.lend(1, P, Duration::from_secs(60), &[]).is_err());
        let hashes = [SequenceHash::from_u128(10), SequenceHash::from_u128(12)];
        assert!(leases.hold(Some(InstanceId(8)), &hashes).is_empty());
        let held = leases.hold(Some(P), &hashes);
        assert_eq!(held.len(), 1);
        assert_eq!(held[&hashes[0]].block.slot, 3);
        // `end` waits while a read holds the lease.
        let ending = tokio::spawn({
            let leases = leases.clone();
            async move { leases.end(1).await }
        });
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(
            !ending.is_finished(),
            "end returned while a read was in flight"
        );
        // Ending: nothing new is served.
        assert!(leases.hold(Some(P), &hashes).is_empty());
        drop(held);
        assert!(ending.await.unwrap());
        assert!(leases.is_empty());
        assert!(!leases.end(1).await);
    }

    #[tokio::test]
    async fn an_expired_lease_serves_nothing_and_is_pruned_once_unread() {
        let leases = Leases::new();
        leases
            .lend(1, P, Duration::from_millis(1), &[block(10, 3)])
            .unwrap();
        tokio::time::sleep(Duration::from_millis(5)).await;
        assert!(
            leases
                .hold(Some(P), &[SequenceHash::from_u128(10)])
                .is_empty()
        );
        leases
            .lend(2, P, Duration::from_secs(60), &[block(10, 5)])
            .unwrap();
        assert_eq!(leases.len(), 1, "the expired lease was pruned");
        let held = leases.hold(None, &[SequenceHash::from_u128(10)]);
        assert_eq!(held[&SequenceHash::from_u128(10)].block.slot, 5);
    }
}
