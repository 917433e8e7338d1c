//! [`FrontEnd::Tiering`](crate::stack::FrontEnd::Tiering): the stack is driven as vLLM's scheduler drives its
//! offloading manager, through `kvbm-tiering`'s contract served over the engine's tiers
//! ([`EngineTieringManager`](crate::manager::EngineTieringManager)).
//!
//! ```text
//!  on_new_request
//!  G1 match (the inference engine's own prefix cache)
//!  lookup(k) for the blocks after it, until a MISS:
//!     HIT          in G2 (a block read ahead from G3 counts as a G3 hit)
//!     HIT_PENDING  in G3/G4 (or another instance's shared G4): the engine promotes it to G2
//!                  ──► the request waits for the step (settle) and looks up again
//!  prepare_load(hits) ──► the worker copies the G2 slots to G1, every block checked against its
//!                         bytes ──► complete_load     (a failed block: the prefix ends before it)
//!  compute the rest in G1
//!  prepare_store(computed) ──► the worker copies them G1 → the G2 slots ──► complete_store
//!     └─► the manager's store sink: the registered G2 blocks go to the G2→G3 and G2→G4 lanes
//!         (write-through, held strong until written below; enqueued in batches)
//!  on_request_finished
//! ```
//!
//! What a failed promotion leaves is the manager's business: the key reads MISS (never a hit)
//! until the block is stored again; the caller recomputes it. A G1 copy that fails or brings
//! wrong bytes cuts the prefix there; what follows is recomputed (never served).
//!
//! Ownership: the manager pins the loaded G2 blocks between `prepare_load` and
//! `complete_load`, and owns the store's G2 slots between `prepare_store` and
//! `complete_store`, so nothing else touches those slots while the copies run. Both copies are
//! kvbm-offload moves, inline on this thread (host to host: G1 is a host stand-in): the load an
//! inline, checked `BlockMover` (`G2ToG1`), the store an inline `ExternalMover` into the G2
//! slots `prepare_store` reserved (the manager, not the move, registers them at
//! `complete_store`; that reservation is the store's safety argument). Started asynchronously
//! on the transfer manager's threads, the store measured slower here (the issue, the wait and
//! the completion cost more than the copy they overlap, on two cores). The request holds its G1
//! blocks until the end of [`ReplayDriver::serve_scheduled`].

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use futures::FutureExt;
use kvbm_logical::{G1, ImmutableBlock, SequenceHash, TierId};
use kvbm_offload::MoveSource;
use kvbm_tiering::{LookupResult, OffloadKey, OffloadScope, OffloadingManager, ReqContext};

use crate::error::Result;
use crate::manager::EngineTieringManager;
use crate::stack::MovePath;
use crate::stack::context::{Context, stack_error};

use super::ReplayDriver;
use super::counters::{HitSource, Served};

/// Lookup passes a request may wait through before it takes the prefix that is ready.
const MAX_PASSES: usize = 4;

impl ReplayDriver {
    /// Serves one request through the scheduler-facing manager: lookups until a miss (waiting
    /// for promotions), the load of the hits, the store of the rest.
    /// `keys[i]` is the key of the block registered under `hashes[i]`.
    ///
    /// # Errors
    /// Only when the request cannot be served at all (G1 too small) or the manager refused a
    /// call it must accept (a bug); failed or rejected transfers are counted and their blocks
    /// recomputed.
    pub fn serve_scheduled(
        &mut self,
        hashes: &[SequenceHash],
        keys: &[OffloadKey],
    ) -> Result<Served> {
        debug_assert_eq!(hashes.len(), keys.len());
        self.admit(hashes);
        let n = hashes.len();
        let mut served = Served::default();
        let before = self.stack.onboard_tally();
        let ctx = ReqContext::new(format!("replay-{}", self.served_requests));
        // A request-level request offers every block it has to the store (its prefix hits
        // too), as vLLM's connector does for a REQUEST_LEVEL answer.
        let request_level = self
            .sched_mut()?
            .on_new_request(&ctx)
            .context("on_new_request")?
            .policy
            == OffloadScope::RequestLevel;

        // 1. The inference engine's own prefix cache, then the manager's lookups.
        let t = Instant::now();
        let mut held: Vec<ImmutableBlock<G1>> = self.stack.tiers.g1.manager.match_blocks(hashes);
        let at = held.len();
        served.hits[0] = at as u64;
        self.times.lookup += t.elapsed().as_secs_f64();
        let (ready, sources) = self.look_up(&ctx, &hashes[at..], &keys[at..])?;

        // 2. Load the hits: G2 → G1, every block checked.
        let mut end = at;
        if ready > 0 {
            let t = Instant::now();
            let loaded = self.load(&ctx, &hashes[at..at + ready], &keys[at..at + ready])?;
            end = at + loaded.len();
            held.extend(loaded);
            self.times.g2_to_g1 += t.elapsed().as_secs_f64();
        }
        let after = self.stack.onboard_tally();
        served.onboarded = after[0] - before[0];
        served.verified = after[1] - before[1];
        served.corrupt = after[2] - before[2];
        served.count_hits(&sources[..end - at]);

        // 3. Compute the rest in G1, then store it through the manager (a request-level
        //    request: every block, so the manager hands its resident ones to the
        //    request-level lanes).
        if end < n || request_level {
            let t = Instant::now();
            let computed = self.compute(&hashes[end..])?;
            served.computed = computed.len() as u64;
            self.times.compute += t.elapsed().as_secs_f64();
            held.extend(computed);
            let t = Instant::now();
            let from = if request_level { 0 } else { end };
            self.store(&ctx, &keys[from..], &held[from..])?;
            if let Some(w) = &self.stack.lanes.write_through {
                w.flush(false);
            }
            self.times.offload_enqueue += t.elapsed().as_secs_f64();
        }
        let sched = self.sched_mut()?;
        sched
            .on_request_finished(&ctx)
            .context("on_request_finished")?;
        // The stack keeps no event consumer: the engine's own events (G2's event sink) are
        // what other instances follow.
        drop(sched.take_events());
        served.publish();
        // End of the "forward pass": the request's G1 blocks become inactive (evictable).
        drop(held);
        Ok(served)
    }

    fn sched_mut(&mut self) -> Result<&mut EngineTieringManager> {
        self.stack
            .scheduler
            .as_mut()
            .map(|s| &mut s.manager)
            .ok_or_else(|| stack_error!("the tiering scheduler needs G2 (--g2-blocks > 0)"))
    }

    /// Where the block `h` is before the lookup (the tier its hit counts for; a block read
    /// ahead from G3 into G2 counts for G3).
    fn source_of(&mut self, h: SequenceHash) -> HitSource {
        let registry = self.stack.tiers.g1.manager.registry();
        if registry.is_present(h, TierId::G2) {
            return HitSource::Tier(if self.read_ahead.staged.remove(&h) {
                TierId::G3
            } else {
                TierId::G2
            });
        }
        if registry.is_present(h, TierId::G3) {
            return HitSource::Tier(TierId::G3);
        }
        let own_g4 = registry.is_present(h, TierId::G4);
        match &self.stack.shared_g4 {
            // Written by another instance (or adopted from its events by this lookup).
            Some(s) if !own_g4 || !s.own().lock().contains(&h) => HitSource::OtherInstance,
            _ => HitSource::Tier(TierId::G4),
        }
    }

    /// The scheduler's lookups over `keys` until the first MISS, waiting (as a request waits
    /// for the next step) while promotions are pending. Returns how many blocks are HITs now
    /// and the tier each came from.
    fn look_up(
        &mut self,
        ctx: &ReqContext,
        hashes: &[SequenceHash],
        keys: &[OffloadKey],
    ) -> Result<(usize, Vec<HitSource>)> {
        let mut sources: Vec<HitSource> = Vec::with_capacity(keys.len());
        let mut pass = 0;
        loop {
            let t = Instant::now();
            let (mut ready, mut first_pending) = (0, None);
            for (i, (k, h)) in keys.iter().zip(hashes).enumerate() {
                if i == sources.len() {
                    let s = self.source_of(*h);
                    sources.push(s);
                }
                match self.sched_mut()?.lookup(k, ctx) {
                    LookupResult::Hit => ready = i + 1,
                    LookupResult::HitPending => {
                        first_pending.get_or_insert(i);
                        ready = i + 1;
                    }
                    LookupResult::Miss | LookupResult::Retry => break,
                }
            }
            self.times.lookup += t.elapsed().as_secs_f64();
            pass += 1;
            let Some(p) = first_pending else {
                sources.truncate(ready);
                return Ok((ready, sources));
            };
            if pass == MAX_PASSES {
                sources.truncate(p);
                return Ok((p, sources));
            }
            // The step ends; the promotions settle before the request is scheduled again.
            let t = Instant::now();
            let from_g4 = sources[p..ready].iter().any(|s| s.is_g4());
            let sched = &mut self
                .stack
                .scheduler
                .as_mut()
                .expect("checked by sched_mut")
                .manager;
            self.stack.session_rt.block_on(sched.settle());
            let waited = t.elapsed().as_secs_f64();
            if from_g4 {
                self.times.g4_to_g2 += waited;
            } else {
                self.times.g3_to_g2 += waited;
            }
        }
    }

    /// `prepare_load` → the G2 → G1 copy (bytes checked) → `complete_load`. Returns the G1
    /// blocks of the longest prefix that arrived whole and right.
    fn load(
        &mut self,
        ctx: &ReqContext,
        hashes: &[SequenceHash],
        keys: &[OffloadKey],
    ) -> Result<Vec<ImmutableBlock<G1>>> {
        let spec = match self.sched_mut()?.prepare_load(keys, ctx) {
            Ok(s) => s,
            Err(e) => {
                // A HIT that is gone by now: the last lookup pass (cut after MAX_PASSES) started
                // promotions whose G2 allocations may evict an unheld G2 hit before it. The
                // manager took no hold; the request recomputes instead (a lost hit, never a
                // wrong one).
                tracing::debug!(error = %e, "prepare_load refused; the prefix is recomputed");
                self.counts.load_refused += 1;
                return Ok(Vec::new());
            }
        };
        let slots = spec
            .chunk_ids()
            .ok_or_else(|| stack_error!("prepare_load returned a spec that is not G2 slots"))?;
        let src: Vec<MoveSource> = slots
            .iter()
            .zip(hashes)
            .map(|(s, h)| MoveSource::from((*s as usize, *h)))
            .collect();
        let dst = match self.stack.tiers.g1.manager.allocate_blocks(src.len()) {
            Ok(d) => d,
            Err(_) => self.allocate_g1(src.len())?,
        };
        let g2_to_g1 = self
            .stack
            .tiers
            .movers
            .as_ref()
            .map(|m| m.g2_to_g1.clone())
            .ok_or_else(|| stack_error!("no G2→G1 path"))?;
        // The slots are the G2 blocks `prepare_load` pinned for this request; they stay pinned
        // (nothing writes them) until `complete_load` below.
        let moved = g2_to_g1.copy_slots(&src, dst);
        self.sched_mut()?
            .complete_load(keys, ctx)
            .context("complete_load")?;
        // The failed blocks were reported to the shared list; the prefix ends at the first.
        drop(std::mem::take(&mut *self.stack.tiers.onboard.failed.lock()));
        let mut out = Vec::with_capacity(moved.len());
        for m in moved {
            match m {
                Ok(b) => out.push(b),
                Err(_) => break,
            }
        }
        Ok(out)
    }

    /// `prepare_store`, waiting while G2 is full of blocks the lanes are still writing below
    /// (as the sessions' G1→G2 lane waits for G2 room): up to `offload.g1_to_g2.room_patience_ms` while a
    /// lane has work, and a short grace once it has none (a lane drops its blocks just after it
    /// reports them done). `None`: G2 has no room to give.
    fn prepare_store(
        &mut self,
        ctx: &ReqContext,
        keys: &[OffloadKey],
    ) -> Result<Option<kvbm_tiering::PrepareStoreOutput>> {
        const GRACE: Duration = Duration::from_millis(50);
        let total = self
            .stack
            .tiers
            .g2
            .as_ref()
            .map_or(0, |g| g.manager.total_blocks());
        if keys.len() > total {
            // More than G2 holds at all: no wait can make room.
            return Ok(None);
        }
        let room_patience = self
            .stack
            .scheduler
            .as_ref()
            .map_or(Duration::ZERO, |s| s.room_patience);
        let started = Instant::now();
        let mut idle_since: Option<Instant> = None;
        for round in 0.. {
            let out = self
                .sched_mut()?
                .prepare_store(keys, ctx)
                .context("prepare_store")?;
            if out.is_some() {
                return Ok(out);
            }
            if round == 0 {
                self.stack
                    .lanes
                    .g2_space_waits
                    .fetch_add(1, Ordering::Relaxed);
            }
            if let Some(w) = &self.stack.lanes.write_through {
                w.flush(true);
            }
            self.complete_read_aheads(usize::MAX);
            if self.stack.lanes.pending() > 0 {
                idle_since = None;
            } else if idle_since.get_or_insert_with(Instant::now).elapsed() > GRACE {
                return Ok(None);
            }
            if started.elapsed() >= room_patience {
                return Ok(None);
            }
            std::thread::sleep(Duration::from_micros(200));
        }
        unreachable!("the loop returns")
    }

    /// `prepare_store` → the G1 → G2 copy → `complete_store`; the manager hands what it
    /// registered to the lower lanes (its store sink, [`WriteThrough`]). `blocks[i]` is
    /// the G1 block of `keys[i]`.
    fn store(
        &mut self,
        ctx: &ReqContext,
        keys: &[OffloadKey],
        blocks: &[ImmutableBlock<G1>],
    ) -> Result<()> {
        let Some(out) = self.prepare_store(ctx, keys)? else {
            // G2 has no evictable block: nothing is stored (as vLLM skips the store).
            self.counts.store_no_space += keys.len() as u64;
            return Ok(());
        };
        self.counts.store_filtered += (keys.len() - out.keys_to_store.len()) as u64;
        if out.keys_to_store.is_empty() {
            return Ok(());
        }
        let slots = out
            .store_spec
            .chunk_ids()
            .ok_or_else(|| stack_error!("prepare_store returned a spec that is not G2 slots"))?;
        // `keys_to_store` is `keys` filtered, in order.
        let mut src = Vec::with_capacity(slots.len());
        let mut j = 0;
        for k in &out.keys_to_store {
            while j < keys.len() && keys[j] != *k {
                j += 1;
            }
            let b = blocks.get(j).ok_or_else(|| {
                stack_error!("prepare_store named a key the request did not give")
            })?;
            // Host to host, inline: no header to bind an identity into, so the source is its
            // slot and hash (no digest read).
            src.push(MoveSource::from((b.block_id(), b.sequence_hash())));
        }
        let dst: Vec<usize> = slots.iter().map(|s| *s as usize).collect();
        let mover = &self
            .stack
            .scheduler
            .as_ref()
            .ok_or_else(|| stack_error!("no G1→G2 store path"))?
            .store_mover;
        // SAFETY: the G2 slots were reserved by `prepare_store` for this request (the manager
        // holds them as unregistered `MutableBlock`s until `complete_store`; nothing reads or
        // writes them meanwhile); the G1 sources are registered blocks this request holds.
        let moved = unsafe { mover.move_blocks(&src, &dst) }
            .now_or_never()
            .expect("an inline move is done when it returns");
        let (mut ok, mut failed) = (Vec::with_capacity(dst.len()), Vec::new());
        for (k, r) in out.keys_to_store.iter().zip(moved) {
            match r {
                Ok(()) => ok.push(*k),
                Err(f) => {
                    tracing::warn!(kind = f.kind.as_str(), error = %f.message, "G1→G2 store failed");
                    failed.push(*k);
                }
            }
        }
        self.stack
            .tiers
            .counters
            .failed_transfers
            .fetch_add(failed.len() as u64, Ordering::Relaxed);
        self.stack
            .tiers
            .counters
            .add_bytes(MovePath::G1_TO_G2, ok.len(), self.stack.block_bytes);
        let sched = self.sched_mut()?;
        if !failed.is_empty() {
            sched
                .complete_store(&failed, ctx, false)
                .context("complete_store")?;
        }
        if !ok.is_empty() {
            sched
                .complete_store(&ok, ctx, true)
                .context("complete_store")?;
        }
        Ok(())
    }
}
