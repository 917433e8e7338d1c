//! Remote search: where [`InstanceLeader::find_matches`](super::InstanceLeader::find_matches)
//! goes after the local tiers stopped, using the [`CrossInstanceIndex`] the pub/sub keeps.
//!
//! # Order
//!
//! ```text
//!  hashes:        h0 h1 h2 h3 h4 h5 h6
//!  local tiers:   h0 h1 (G2/G3/G4 runs, as before)
//!  shared G4:           h2 h3        other instances' G4 events (shared bucket): adopted
//!                                    into the local G4 manager, held, staged like local G4
//!  remote G2:                 h4 h5  the one instance with the longest G2 run from here:
//!                                    a RemoteRun, pulled over the data plane
//! ```
//!
//! * **Shared G4.** With [`RemoteSearch::shared_g4`], every instance's G4 is the same bucket
//!   and namespace, so an object another instance offloaded is readable here. The contiguous
//!   run of hashes that the index places in another instance's G4 is registered in this
//!   leader's G4 manager (bookkeeping of what the bucket holds, no bytes move) and appended
//!   to the prefix's G4 run (only when the G4 run is the last local run, or there is none,
//!   so each tier still contributes one run). Staging then reads the objects through the G4
//!   mover, which checks checksum, identity and binding: an object that is missing or fails
//!   is a failed block, never a served one.
//! * **Remote G2** (with [`RemoteSearch::remote_g2`]: the instance has a data plane to pull
//!   over). Blocks in another instance's host memory are not held by the search (a
//!   hold would need a round trip); the serving side holds them for the duration of the pull,
//!   and the pull verifies every frame. The index is a hint: a block evicted meanwhile is a
//!   failed pull, never a hit.
//!
//! * **G4 presence check.** Without events (a late joiner, or lost events),
//!   [`InstanceLeader::adopt_present_g4`](super::InstanceLeader::adopt_present_g4) asks a
//!   [`PresenceChecker`] (e.g. `kvbm_offload::S3PresenceChecker`: one header read per object,
//!   binding verified, a foreign object counts as absent) about the hashes past the local
//!   prefix and adopts the present contiguous run the same way, each block registered with
//!   the digest its object's header records ([`PresenceChecker::stored_blocks`]).
//!
//! # Digests travel
//!
//! A block adopted by name has only its sequence hash; its object's header records its
//! identity (for a BLAKE3 sequence, the 256-bit digest). The presence check registers the
//! block with that digest. A block adopted from an event (which names only the hash) is
//! registered without one, and the G4 mover (`BlockMover::move_from`) reads its header first
//! and expects, and registers the G2 copy with, the digest it records when that digest names
//! the hash (`kvbm_offload::digest_named`). So a valid shared object onboards with its digest,
//! and a forged event can at worst make this leader read an object that is really there.
//! A failed read never deletes an object except a complete read whose checksum differs from
//! the header's (proven damage; `ObjectStorage::evicted_objects` counts them): a short read,
//! an I/O error, a timeout or an identity the reader did not expect leaves it in place.
//!
//! # Locks
//!
//! The index's mutex is taken once per looked-up hash (inside `locations`) and released
//! before the G4 manager is called; no two are held together.

use std::sync::Arc;

use kvbm_logical::{SequenceHash, TierId};
use kvbm_offload::{PresenceChecker, StoredBlock};

use super::holder::{MatchedPrefix, RemoteRun, TierRun};
use crate::address::InstanceId;
use crate::cross_instance::CrossInstanceIndex;
use crate::error::{EngineError, Result};

/// What a leader needs to search beyond its own tiers.
#[derive(Clone, Debug)]
pub struct RemoteSearch {
    /// Where blocks live across instances (kept up to date by `CrossInstanceIndex::follow`).
    pub index: Arc<CrossInstanceIndex>,
    /// This instance (its own entries in the index are skipped).
    pub this: InstanceId,
    /// Whether all instances' G4 is one shared bucket and namespace (then other instances'
    /// G4 blocks are adopted into this leader's G4).
    pub shared_g4: bool,
    /// Whether other instances' G2 is searched: this instance can pull a remote run (over its
    /// data plane, or, with worker ranks as processes, through their rank plane).
    pub remote_g2: bool,
}

fn elsewhere(r: &RemoteSearch, h: SequenceHash, tier: TierId) -> Vec<InstanceId> {
    r.index
        .locations(h)
        .into_iter()
        .filter(|(i, t)| *i != r.this && *t == tier)
        .map(|(i, _)| i)
        .collect()
}

/// Extends `out` (which covers `hashes[..at]`) past the local tiers; returns the new end.
pub(super) fn extend(
    leader: &super::InstanceLeader,
    r: &RemoteSearch,
    hashes: &[SequenceHash],
    out: &mut MatchedPrefix,
    mut at: usize,
) -> usize {
    if r.shared_g4
        && let Some(g4) = leader.g4()
        && (out.g4.is_empty() || out.runs.last().is_some_and(|l| l.tier == TierId::G4))
    {
        let run: Vec<SequenceHash> = hashes[at..]
            .iter()
            .take_while(|h| !elsewhere(r, **h, TierId::G4).is_empty())
            .copied()
            .collect();
        let n = run.len().min(g4.available_blocks());
        if n > 0
            && let Ok(blocks) = g4.allocate_blocks(n)
        {
            let complete: Vec<_> = blocks
                .into_iter()
                .zip(&run)
                .map_while(|(b, h)| b.complete(*h).ok())
                .collect();
            let adopted = g4.register_blocks(complete);
            let got = adopted.len();
            out.g4.extend(adopted);
            match out.runs.last_mut() {
                Some(last) if last.tier == TierId::G4 => last.len += got,
                _ => out.runs.push(TierRun {
                    tier: TierId::G4,
                    start: at,
                    len: got,
                }),
            }
            at += got;
        }
    }
    if r.remote_g2 && at < hashes.len() {
        // The instance with the longest contiguous G2 run from `at`.
        let mut alive = elsewhere(r, hashes[at], TierId::G2);
        let mut len = 0;
        let mut best: Option<InstanceId> = alive.first().copied();
        while !alive.is_empty() {
            best = alive.first().copied();
            len += 1;
            if at + len == hashes.len() {
                break;
            }
            let next = elsewhere(r, hashes[at + len], TierId::G2);
            alive.retain(|i| next.contains(i));
        }
        if let (Some(instance), true) = (best, len > 0) {
            out.remote = Some(RemoteRun {
                instance,
                start: at,
                hashes: hashes[at..at + len].to_vec(),
            });
            at += len;
        }
    }
    at
}

impl super::InstanceLeader {
    /// Adopts `h` into this leader's G4 when the cross-instance index places it in another
    /// instance's G4 and G4 is shared (see "Shared G4" above): the scheduler-facing manager's
    /// lookup of a single key. Returns whether `h` is now registered in this leader's G4 (no
    /// bytes move; the promotion reads and verifies the object).
    pub fn adopt_shared_g4(&self, h: SequenceHash) -> bool {
        let (Some(r), Some(g4)) = (&self.remote, self.g4()) else {
            return false;
        };
        if !r.shared_g4 || elsewhere(r, h, TierId::G4).is_empty() {
            return false;
        }
        let Ok(mut blocks) = g4.allocate_blocks(1) else {
            return false;
        };
        let Some(b) = blocks.pop() else {
            return false;
        };
        match b.complete(h) {
            // Registered and dropped: an inactive G4 entry, as a local G4 block is.
            Ok(c) => !g4.register_blocks(vec![c]).is_empty(),
            Err(_) => false,
        }
    }

    /// Asks `checker` which of `hashes` past the locally held prefix are in the shared G4,
    /// and registers the contiguous present run in this leader's G4 (no bytes move; staging
    /// verifies each object). Returns how many were adopted.
    ///
    /// # Errors
    /// [`EngineError::TierMissing`] without a G4 manager; [`EngineError::Presence`] when the
    /// check itself failed (nothing adopted).
    pub async fn adopt_present_g4(
        &self,
        hashes: &[SequenceHash],
        checker: &dyn PresenceChecker,
    ) -> Result<usize> {
        let g4 = self.g4().ok_or(EngineError::TierMissing(TierId::G4))?;
        let at = {
            let local = self.find_matches(hashes);
            local.len() - local.remote_len()
        };
        if at == hashes.len() {
            return Ok(0);
        }
        let rest = hashes[at..].to_vec();
        // Engine lookups carry no BLAKE3 digest, so the probe reads the digest each object's
        // header records (checked to name its hash) and the block is registered with it: the
        // digest travels into G2 and G1, and staging's verified read expects it.
        let stored = checker
            .stored_blocks(rest.clone())
            .await
            .map_err(EngineError::Presence)?;
        let run: Vec<Option<kvbm_logical::BlockDigest>> = stored
            .iter()
            .map_while(|s| match s {
                StoredBlock::Present(d) => Some(*d),
                StoredBlock::Absent => None,
            })
            .collect();
        let n = run.len().min(g4.available_blocks());
        if n == 0 {
            return Ok(0);
        }
        let blocks = g4.allocate_blocks(n)?;
        let complete: Vec<_> = blocks
            .into_iter()
            .zip(rest.iter().zip(&run))
            .map_while(|(b, (h, d))| b.complete_with_digest(*h, *d).ok())
            .collect();
        Ok(g4.register_blocks(complete).len())
    }
}
