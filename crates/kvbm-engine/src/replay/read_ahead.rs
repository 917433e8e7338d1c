//! G3 read-ahead: reads, for a request served later, the blocks of its prefix that only G3
//! holds into G2, so the read overlaps the requests before it; each block is checked exactly as
//! a synchronous onboarding checks it when its request comes up.

use std::time::Instant;

use futures::FutureExt;
use futures::future::BoxFuture;
use kvbm_logical::{G2, G3, ImmutableBlock, SequenceHash, TierId};
use kvbm_offload::MoveOutcome;

use super::ReplayDriver;

/// A G3→G2 read started ahead of the request that needs it.
pub(super) struct ReadAhead {
    /// Index of the request it is for.
    pub(super) request: usize,
    /// The G3 sources, held until the read ends.
    pub(super) src: Vec<ImmutableBlock<G3>>,
    /// The read, issued through the stack's G3→G2 move: it registers in G2 the copies that
    /// arrive and pass the journal check.
    pub(super) moved: BoxFuture<'static, Vec<MoveOutcome<G2>>>,
    pub(super) started: Instant,
}

impl ReplayDriver {
    /// Starts reading, for the request with index `request` (served later), the blocks of its
    /// prefix that only G3 holds into G2, so the read overlaps the requests before it.
    ///
    /// Presence is read from the registry without taking handles; blocks are matched in G3
    /// (held until the read ends) and staged exactly as a synchronous onboarding would, with
    /// the same checks, when the request comes up (`complete_read_aheads`). A block
    /// evicted from G2 before then is simply read again.
    pub fn read_ahead(&mut self, request: usize, hashes: &[SequenceHash]) {
        let t = Instant::now();
        self.start_read_ahead(request, hashes);
        self.times.read_ahead += t.elapsed().as_secs_f64();
    }

    pub(super) fn start_read_ahead(&mut self, request: usize, hashes: &[SequenceHash]) {
        let (Some(g2), Some(g3), Some(g3_to_g2)) = (
            &self.stack.tiers.g2,
            &self.stack.tiers.g3,
            self.stack
                .tiers
                .movers
                .as_ref()
                .and_then(|m| m.g3_to_g2.clone()),
        ) else {
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
                && !g3.checked.bad().contains(*h)
                && !self.read_ahead.reading.contains(h)
            {
                want.push(*h);
            }
        }
        if want.is_empty() {
            return;
        }
        // Reads in flight hold G2 slots: keep them to a quarter of G2.
        let budget = (g2.manager.total_blocks() / 4).saturating_sub(self.read_ahead.reading.len());
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
        let started = Instant::now();
        // Issued now; the future registers what arrives when the request comes up.
        let moved = g3_to_g2
            .mover()
            .move_blocks(&g3_to_g2.sources(&src), dst)
            .boxed();
        self.read_ahead
            .reading
            .extend(src.iter().map(|b| b.sequence_hash()));
        self.read_ahead.in_flight.push_back(ReadAhead {
            request,
            src,
            moved,
            started,
        });
    }

    /// Finishes every read-ahead for requests up to `request`: checks each block like a
    /// synchronous G3→G2 onboarding and registers the good ones in G2.
    pub(super) fn complete_read_aheads(&mut self, request: usize) {
        while self
            .read_ahead
            .in_flight
            .front()
            .is_some_and(|p| p.request <= request)
        {
            let p = self.read_ahead.in_flight.pop_front().expect("checked");
            let t = Instant::now();
            // The read runs on the transfer manager's runtime; this only waits for its end.
            let out = futures::executor::block_on(p.moved);
            self.times.g3_to_g2 += t.elapsed().as_secs_f64();
            metrics::histogram!(
                crate::metrics::STACK_TRANSFER_SECONDS,
                crate::metrics::PATH_LABEL => "g3_to_g2"
            )
            .record(p.started.elapsed().as_secs_f64());
            for b in &p.src {
                self.read_ahead.reading.remove(&b.sequence_hash());
            }
            if let Some(g3_to_g2) = self
                .stack
                .tiers
                .movers
                .as_ref()
                .and_then(|m| m.g3_to_g2.clone())
            {
                // No session is waiting on these blocks: failures are accounted, not reported.
                g3_to_g2.settle_read(p.src.iter().map(|b| b.sequence_hash()), &out, false);
            }
            // The copies that arrived are registered; held no further, they are inactive in G2
            // until their request finds them.
            for b in out.into_iter().flatten() {
                self.read_ahead.staged.insert(b.sequence_hash());
            }
        }
    }
}
