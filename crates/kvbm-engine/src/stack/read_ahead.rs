//! G3 read-ahead: reads, for a request served later, the blocks of its prefix that only G3
//! holds into G2, so the read overlaps the requests before it; each block is checked exactly as
//! a synchronous onboarding checks it when its request comes up.

use std::time::Instant;

use kvbm_logical::{G2, G3, ImmutableBlock, MutableBlock, SequenceHash, TierId};
use kvbm_offload::block_identity;
use kvbm_physical::TransferOptions;

use super::TierStack;
use super::counters::MovePath;
use super::tiers::check_g3_read;

/// A G3→G2 read started ahead of the request that needs it.
pub(super) struct Prefetch {
    /// Index of the request it is for.
    pub(super) request: usize,
    pub(super) src: Vec<ImmutableBlock<G3>>,
    pub(super) dst: Vec<MutableBlock<G2>>,
    pub(super) completion: kvbm_physical::TransferCompletion,
    pub(super) started: Instant,
}

impl TierStack {
    /// Starts reading, for the request with index `request` (served later), the blocks of its
    /// prefix that only G3 holds into G2, so the read overlaps the requests before it.
    ///
    /// Presence is read from the registry without taking handles; blocks are matched in G3
    /// (held until the read ends) and staged exactly as a synchronous onboarding would, with
    /// the same checks, when the request comes up (`complete_prefetches`). A block
    /// evicted from G2 before then is simply read again.
    pub fn prefetch(&mut self, request: usize, hashes: &[SequenceHash]) {
        let t = Instant::now();
        self.start_prefetch(request, hashes);
        self.times.prefetch += t.elapsed().as_secs_f64();
    }

    pub(super) fn start_prefetch(&mut self, request: usize, hashes: &[SequenceHash]) {
        let (Some(g2), Some(g3)) = (&self.g2, &self.g3) else {
            return;
        };
        let registry = g2.manager.registry();
        let mut want = Vec::new();
        for h in hashes {
            let tiers = registry.tiers(*h);
            if tiers.contains(&TierId::G1) || tiers.contains(&TierId::G2) {
                continue;
            }
            if !tiers.contains(&TierId::G3) && !tiers.contains(&TierId::G4) {
                break; // the prefix ends here
            }
            if tiers.contains(&TierId::G3)
                && !g3.poisoned.lock().contains(h)
                && !self.prefetching.contains(h)
            {
                want.push(*h);
            }
        }
        if want.is_empty() {
            return;
        }
        // Reads in flight hold G2 slots: keep them to a quarter of G2.
        let budget = (g2.manager.total_blocks() / 4).saturating_sub(self.prefetching.len());
        want.truncate(budget);
        if want.is_empty() {
            return;
        }
        let src = g3.manager.scan_matches(&want);
        if src.is_empty() {
            return;
        }
        let Ok(dst) = g2.manager.allocate_blocks(src.len()) else {
            return;
        };
        let src_ids: Vec<usize> = src.iter().map(|b| b.block_id()).collect();
        let dst_ids: Vec<usize> = dst.iter().map(|b| b.block_id()).collect();
        let started = Instant::now();
        // SAFETY: the destinations are `MutableBlock`s allocated for this read-ahead (nothing reads
        // them before it completes); the sources are registered G3 blocks held by `src`.
        if let Ok(completion) = unsafe {
            self.tm.execute_transfer(
                g3.handle,
                &src_ids,
                g2.handle,
                &dst_ids,
                TransferOptions::default().identities(
                    src.iter()
                        .map(|b| block_identity(b.sequence_hash()))
                        .collect(),
                ),
            )
        } {
            self.prefetching
                .extend(src.iter().map(|b| b.sequence_hash()));
            self.prefetches.push_back(Prefetch {
                request,
                src,
                dst,
                completion,
                started,
            });
        }
    }

    /// Finishes every prefetch for requests up to `request`: checks each block like a
    /// synchronous G3→G2 onboarding and registers the good ones in G2.
    pub(super) fn complete_prefetches(&mut self, request: usize) {
        while self
            .prefetches
            .front()
            .is_some_and(|p| p.request <= request)
        {
            let p = self.prefetches.pop_front().expect("checked");
            let t = Instant::now();
            let outcome = p.completion.wait();
            self.times.g3_to_g2 += t.elapsed().as_secs_f64();
            metrics::histogram!("kvbm_replay_transfer_seconds", "path" => "g3_to_g2")
                .record(p.started.elapsed().as_secs_f64());
            let (Some(g2), Some(g3)) = (&self.g2, &self.g3) else {
                return;
            };
            let check = g3.check();
            let mut ok = 0;
            let mut complete = Vec::with_capacity(p.src.len());
            for ((blk, mblk), (_, r)) in p.src.iter().zip(p.dst).zip(outcome.blocks) {
                let h = blk.sequence_hash();
                self.prefetching.remove(&h);
                ok += usize::from(r.is_ok());
                if check_g3_read(&g2.layout, &check, &self.counters, &mblk, h, r).is_ok()
                    && let Ok(c) = mblk.complete_with_digest(h, self.identities.get(h))
                {
                    complete.push(c);
                }
            }
            self.counters
                .add_bytes(MovePath::G3ToG2, ok, self.block_bytes);
            for b in g2.manager.register_blocks(complete) {
                self.prefetched.insert(b.sequence_hash());
            }
        }
    }
}
