//! Serving a request through onboarding sessions ([`FrontEnd::Sessions`]): lookup, staging,
//! onboarding, computing the rest; and the admission every request passes first (the
//! back-pressure that keeps the lanes ahead, G1 room), whatever its front end.
//!
//! [`FrontEnd::Sessions`]: crate::stack::FrontEnd::Sessions

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use kvbm_logical::{G1, G2, G3, G4, ImmutableBlock, MutableBlock, SequenceHash, TierId};

use crate::MatchedPrefix;
use crate::error::Result;
use crate::leader::{FinishOutcome, MoversToG2, OnboardingSession};
use crate::mover::BlockMove;
use crate::stack::context::{bail, stack_error};

use super::ReplayDriver;
use super::counters::{HitSource, Served};

impl ReplayDriver {
    /// Before a request of `hashes` takes any handle: waits out offload backpressure, finishes
    /// the reads started ahead for it (and any still reading one of its blocks: read again here,
    /// it would be a second transfer of the same slot, and a damaged block would be rejected,
    /// and counted, twice), and makes room in G1.
    pub(super) fn admit(&mut self, hashes: &[SequenceHash]) {
        self.stack.discard_rejected();
        self.wait_for_room(hashes.len());
        self.complete_read_aheads(self.served_requests);
        if !self.read_ahead.reading.is_empty()
            && hashes.iter().any(|h| self.read_ahead.reading.contains(h))
        {
            self.complete_read_aheads(usize::MAX);
        }
        self.ensure_g1_room(hashes.len());
        self.served_requests += 1;
    }

    /// Serves one request: lookup, onboarding, computing the rest, offloading it.
    ///
    /// # Errors
    /// Only when the request cannot be served at all (G1 too small); failed or rejected
    /// transfers are counted and their blocks recomputed.
    pub fn serve(&mut self, hashes: &[SequenceHash]) -> Result<Served> {
        self.admit(hashes);
        let mut served = Served::default();
        let n = hashes.len();
        let before = self.stack.onboard_tally();
        let (found, src, mut held_g1) = self.onboard_prefix(hashes)?;
        let fail_at = found;
        let after = self.stack.onboard_tally();
        served.onboarded = after[0] - before[0];
        served.verified = after[1] - before[1];
        served.corrupt = after[2] - before[2];
        served.count_hits(&src[..fail_at]);

        // 4. Compute the rest in G1 and hand it to the G1→G2 lane.
        if fail_at < n {
            let t = Instant::now();
            let nested = self.nested_time();
            let registered = self.compute(&hashes[fail_at..])?;
            served.computed = registered.len() as u64;
            self.times.compute += t.elapsed().as_secs_f64() - (self.nested_time() - nested);
            let t = Instant::now();
            self.stack.lanes.enqueue_g1(registered.clone())?;
            self.times.offload_enqueue += t.elapsed().as_secs_f64();
            held_g1.extend(registered);
        }
        served.publish();
        // End of the "forward pass": the request's G1 blocks become inactive (evictable).
        drop(held_g1);
        Ok(served)
    }

    /// Fills fresh G1 blocks with the bytes of `hashes` and registers them.
    pub(super) fn compute(&mut self, hashes: &[SequenceHash]) -> Result<Vec<ImmutableBlock<G1>>> {
        let blocks = self.allocate_g1(hashes.len())?;
        let mut complete = Vec::with_capacity(hashes.len());
        for (blk, h) in blocks.into_iter().zip(hashes) {
            // SAFETY: freshly allocated slot: no transfer reads or writes it.
            let slot = unsafe { self.stack.tiers.g1.slot(blk.block_id()) };
            self.stack.contents.fill(*h, slot);
            complete.push(
                blk.complete(*h)
                    .map_err(|e| stack_error!("cannot complete a G1 block: {}", e.error))?,
            );
        }
        Ok(self.stack.tiers.g1.manager.register_blocks(complete))
    }

    /// Lookup and onboarding of a request's prefix, like a scheduler over the engine:
    ///
    /// ```text
    ///  G1 match (the inference engine's own prefix cache)
    ///   └─► leader.find_matches(rest): G2, G3, G4 runs, held  ──► cut at rejected blocks
    ///        └─► OnboardingSession: prepare (G3→G2, G4→G2) ──► onboard (G2→G1) ──► finish
    ///  any block failed ──► the session fails (releasing everything); the prefix is cut at the
    ///  first failed block and looked up again (what moved before it is found in G1/G2 now)
    /// ```
    ///
    /// Returns the prefix length reached in G1, the tier each prefix block was found in
    /// (0..=3, 4 for a G4 block another instance wrote; fixed by the first attempt so a block moved up by a failed attempt still counts
    /// as the tier it came from), and the held G1 blocks.
    #[allow(clippy::type_complexity)]
    pub(super) fn onboard_prefix(
        &mut self,
        hashes: &[SequenceHash],
    ) -> Result<(usize, Vec<HitSource>, Vec<ImmutableBlock<G1>>)> {
        let n = hashes.len();
        let mut src: Vec<HitSource> = Vec::with_capacity(n);
        let mut held_g1: Vec<ImmutableBlock<G1>> = Vec::with_capacity(n);
        let mut limit = n;
        loop {
            held_g1.clear();
            let t = Instant::now();
            let g1m = self.stack.tiers.g1.manager.match_blocks(&hashes[..limit]);
            let at = g1m.len();
            held_g1.extend(g1m);
            while src.len() < at {
                src.push(HitSource::Tier(TierId::G1));
            }
            let matched = match &self.stack.tiers.leader {
                Some(l) if at < limit => {
                    let mut m = l.find_matches(&hashes[at..limit]);
                    m.truncate(self.stack.usable(&m));
                    m
                }
                _ => MatchedPrefix::default(),
            };
            for run in matched.runs() {
                for k in run.start..run.start + run.len {
                    if at + k < src.len() {
                        continue;
                    }
                    src.push(match run.tier {
                        // A block read ahead from G3 for this request is a G3 hit.
                        TierId::G2 if self.read_ahead.staged.remove(&hashes[at + k]) => {
                            HitSource::Tier(TierId::G3)
                        }
                        // Written by another instance: a cross-instance hit.
                        TierId::G4
                            if self
                                .stack
                                .shared_g4
                                .as_ref()
                                .is_some_and(|s| !s.own().lock().contains(&hashes[at + k])) =>
                        {
                            HitSource::OtherInstance
                        }
                        t => HitSource::Tier(t),
                    });
                }
            }
            self.times.lookup += t.elapsed().as_secs_f64();
            let (Some(movers), false) = (&self.stack.tiers.movers, matched.is_empty()) else {
                return Ok((at, src, held_g1));
            };
            let (g3_to_g2, g4_to_g2, g2_to_g1) = (
                movers.g3_to_g2.clone(),
                movers.g4_to_g2.clone(),
                movers.g2_to_g1.clone(),
            );
            let end = at + matched.len();
            let need4 = matched.count(TierId::G4);
            let need = matched.count(TierId::G3) + need4;
            let first_staged = matched
                .runs()
                .iter()
                .find(|r| r.tier != TierId::G2)
                .map_or(at, |r| at + r.start);
            let session = OnboardingSession::new(matched);

            // Stage the G3 and G4 parts in G2 (a G2-only prefix just moves to `Staged`). Reads
            // started ahead hold G2 slots: finish them first when G2 lacks the room.
            {
                let t = Instant::now();
                let nested = self.nested_time();
                if !self.read_ahead.in_flight.is_empty()
                    && self
                        .stack
                        .tiers
                        .g2
                        .as_ref()
                        .is_some_and(|g2| g2.manager.available_blocks() < need)
                {
                    self.complete_read_aheads(usize::MAX);
                }
                let g3_before = self.stack.tiers.onboard.g3_nanos.load(Ordering::Relaxed);
                let staged = self.stack.session_rt.block_on(session.prepare(MoversToG2 {
                    g3_to_g2: g3_to_g2.map(|m| m as Arc<dyn BlockMove<G3, G2>>),
                    g4_to_g2: g4_to_g2.map(|m| m as Arc<dyn BlockMove<G4, G2>>),
                    remote_g2: None,
                }));
                let g3 = (self.stack.tiers.onboard.g3_nanos.load(Ordering::Relaxed) - g3_before)
                    as f64
                    / 1e9;
                let all = t.elapsed().as_secs_f64() - (self.nested_time() - nested);
                self.times.g3_to_g2 += g3;
                // The rest is G4 staging, or, for a prefix all in G2, the session's own cost
                // (part of bringing G2 blocks to G1).
                if need4 > 0 {
                    self.times.g4_to_g2 += (all - g3).max(0.0);
                } else {
                    self.times.g2_to_g1 += (all - g3).max(0.0);
                }
                if let Err(e) = staged {
                    tracing::debug!(error = %e, "staging failed; the prefix is cut");
                    limit = self
                        .stack
                        .first_failed(hashes, at, end)
                        .unwrap_or(first_staged);
                    continue;
                }
            }

            // Onboard the staged prefix to G1 (every block checked against its bytes).
            let t = Instant::now();
            let nested = self.nested_time();
            let len = session.prefix_len();
            let dst = match self.stack.tiers.g1.manager.allocate_blocks(len) {
                Ok(d) => d,
                Err(_) => self.allocate_g1(len)?,
            };
            let onboarded = self
                .stack
                .session_rt
                .block_on(session.onboard(g2_to_g1 as Arc<dyn BlockMove<G2, G1>>, dst));
            self.times.g2_to_g1 += t.elapsed().as_secs_f64() - (self.nested_time() - nested);
            if let Err(e) = onboarded {
                tracing::debug!(error = %e, "onboarding failed; the prefix is cut");
                limit = self.stack.first_failed(hashes, at, end).unwrap_or(at);
                continue;
            }
            match session.finish() {
                FinishOutcome::Finished(blocks) => held_g1.extend(blocks),
                other => bail!("an onboarded session did not finish: {other:?}"),
            }
            return Ok((end, src, held_g1));
        }
    }

    /// Time of the stages that can run nested inside another (waiting for G1 room, finishing
    /// read_ahead_staged G3 reads): subtracted from the enclosing stage so the stages add up to the wall
    /// time.
    pub(super) fn nested_time(&self) -> f64 {
        self.times.g1_backpressure + self.times.g3_to_g2
    }

    /// Waits for room: the caller's back-pressure (not the lanes' own, which drops stores:
    /// `offload.write_through.backpressure`). The lanes hold their G2 blocks until written below, and the
    /// caller's "forward pass" is instant, so without a bound it would outrun them and find G2
    /// full of pinned blocks. Before a request of `n` blocks it waits (as a scheduler stalls
    /// on a full host cache) while lanes still have work and either more than half of G2 is
    /// queued in them or G2 has fewer than `n` + one G1→G2 batch allocatable blocks.
    ///
    /// While it waits, G3 reads started ahead (which hold G2 slots until their request comes
    /// up) are finished, so their slots become evictable: a G1→G2 batch waiting for G2 room
    /// (`offload.g1_to_g2.room_patience_ms`) must not wait on this thread.
    pub(super) fn wait_for_room(&mut self, n: usize) {
        let Some(g2) = self.stack.tiers.g2.as_ref().map(|g| g.manager.clone()) else {
            return;
        };
        let high = (g2.total_blocks() / 2).max(1);
        let reserve = n + self.stack.lanes.g1_batch;
        let starved = |t: &Self| {
            let pending = t.stack.lanes.pending();
            pending > 0 && (pending > high || g2.available_blocks() < reserve)
        };
        // Blocks buffered for the write-through are held in G2: hand them to the lanes before
        // deciding (they are what the lanes must write to free G2).
        if let Some(w) = &self.stack.lanes.write_through
            && g2.available_blocks() < reserve
        {
            w.flush(true);
        }
        if !starved(self) {
            return;
        }
        let t = Instant::now();
        let nested = self.nested_time();
        self.complete_read_aheads(usize::MAX);
        while starved(self) {
            std::thread::sleep(Duration::from_micros(200));
        }
        self.times.offload_backpressure +=
            t.elapsed().as_secs_f64() - (self.nested_time() - nested);
    }

    /// Makes sure G1 can hand out `n` blocks before the request takes any handle: waits, holding
    /// nothing, for G1→G2 offloads (oldest first) to release G1 slots. Waiting later, while
    /// holding the request's G2 hits, could be a cycle: the G1→G2 lane holds G1 blocks and may
    /// be waiting for G2 room those hits take.
    pub(super) fn ensure_g1_room(&mut self, n: usize) {
        if self.stack.tiers.g1.manager.available_blocks() >= n {
            return;
        }
        // The G1→G2 lane may be waiting for G2 room that reads started ahead hold.
        self.complete_read_aheads(usize::MAX);
        let t = Instant::now();
        while self.stack.tiers.g1.manager.available_blocks() < n
            && self.stack.lanes.wait_oldest_g1(&self.stack.rt)
        {}
        self.times.g1_backpressure += t.elapsed().as_secs_f64();
    }

    pub(super) fn allocate_g1(&mut self, n: usize) -> Result<Vec<MutableBlock<G1>>> {
        if let Ok(v) = self.stack.tiers.g1.manager.allocate_blocks(n) {
            return Ok(v);
        }
        // G1 is full of blocks still being offloaded (the lanes hold them until they are
        // written below): wait for the outstanding offloads, oldest first, retrying after each
        // round. (A settlement token would not do: it covers only dispatched batches.) A G1→G2
        // batch may itself be waiting for G2 room: finish the reads started ahead first, so the
        // G2 slots they hold become evictable and cannot keep it waiting (their time counts as
        // G3→G2). Normally [`Self::ensure_g1_room`] made room before the request took any
        // handle, and this path is not taken.
        self.complete_read_aheads(usize::MAX);
        let t = Instant::now();
        while self.stack.lanes.wait_oldest_g1(&self.stack.rt) {
            if let Ok(v) = self.stack.tiers.g1.manager.allocate_blocks(n) {
                self.times.g1_backpressure += t.elapsed().as_secs_f64();
                return Ok(v);
            }
        }
        let r = self.stack.tiers.g1.manager.allocate_blocks(n).map_err(|e| {
            stack_error!(
                "G1 ({} blocks) cannot hold a request of {n} blocks: {e}; raise --g1-blocks",
                self.stack.tiers.g1.manager.total_blocks()
            )
        });
        self.times.g1_backpressure += t.elapsed().as_secs_f64();
        r
    }
}
