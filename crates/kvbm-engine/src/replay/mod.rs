//! [`ReplayDriver`]: plays a workload over a [`TierStack`] as an inference engine would, one
//! request at a time, and measures it. The `kvbm replay` command, the stack's integration tests
//! and the cluster's instances tests drive the stack through it.
//!
//! The stack is the tiers, the lanes and the front ends; what is the replay's alone lives here:
//!
//! ```text
//!  the serve loop      sessions.rs  FrontEnd::Sessions: G1 match → find_matches → stage
//!                                   (G3/G4→G2) → onboard (G2→G1) → compute → G1→G2 lane
//!                      scheduled.rs FrontEnd::Tiering: vLLM's call sequence on the manager,
//!                                   the worker's G2→G1 load and G1→G2 store played inline
//!  admission           the caller's back-pressure before a request takes any handle (lanes
//!                      too far behind, G1 without room)
//!  read-ahead          read_ahead.rs  G3→G2 reads for requests still to come
//!  what it measured    counters.rs  hits per tier per request (Served), wall time per stage
//!                                   (StageTimes); the stores' no-space and filtered blocks,
//!                                   the loads refused
//! ```
//!
//! G1 is host memory standing in for the device; computing a block is filling its G1 slot with
//! the bytes the [`Contents`](crate::stack::Contents) hook gives. A request is served on the
//! caller's thread (a scheduler waits for its blocks before the forward pass): its sessions and
//! promotions run on the stack's current-thread runtime, the lanes on the engine runtime.
//!
//! # Ownership
//!
//! A request holds strong G1 handles from lookup to the end of its serve call (its "forward
//! pass"); a matched prefix is held by its session until finished or failed. A read started
//! ahead holds its G3 sources and G2 destinations until its request comes up or the driver
//! needs the G2 room (every wait for room finishes them first: a G1→G2 batch waiting for G2
//! room must not wait on this thread).

use std::collections::{HashSet, VecDeque};

use kvbm_logical::SequenceHash;

use crate::error::Result;
use crate::stack::{LaneOutcomes, StackPlan, TierStack};

pub use counters::{HitSource, Served, StageTimes};

mod counters;
mod read_ahead;
mod scheduled;
mod sessions;

/// What the driver counted beyond the stack's own counters and the lanes' outcomes.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct DriverCounts {
    /// Blocks a scheduler's store skipped because G2 had no evictable block (nothing moved).
    pub store_no_space: u64,
    /// Blocks a scheduler's store found already stored (`prepare_store` filtered them).
    pub store_filtered: u64,
    /// Requests whose `prepare_load` found a HIT gone, and recomputed (`FrontEnd::Tiering`).
    pub load_refused: u64,
}

/// The G3→G2 reads started ahead of their request, and what they staged.
#[derive(Default)]
struct ReadAheads {
    /// Reads in flight, oldest first.
    in_flight: VecDeque<read_ahead::ReadAhead>,
    /// Blocks in G2 because a read-ahead staged them, not yet claimed by their request.
    staged: HashSet<SequenceHash>,
    /// Blocks with a read in flight.
    reading: HashSet<SequenceHash>,
}

/// Serves requests over a [`TierStack`]: see the [module docs](self).
pub struct ReplayDriver {
    stack: TierStack,
    times: StageTimes,
    read_ahead: ReadAheads,
    /// Requests served so far (a read ahead is tagged with the request it is for).
    served_requests: usize,
    counts: DriverCounts,
}

impl ReplayDriver {
    /// A driver over `stack`.
    pub fn new(stack: TierStack) -> Self {
        ReplayDriver {
            stack,
            times: StageTimes::default(),
            read_ahead: ReadAheads::default(),
            served_requests: 0,
            counts: DriverCounts::default(),
        }
    }

    /// Builds the stack of `plan` ([`TierStack::build`]) and a driver over it.
    ///
    /// # Errors
    /// What [`TierStack::build`] returns.
    pub fn build(plan: &StackPlan) -> Result<Self> {
        Ok(Self::new(TierStack::build(plan)?))
    }

    /// The stack served over.
    pub fn stack(&self) -> &TierStack {
        &self.stack
    }

    /// The stack served over, mutably (its scheduler's stats settle the lanes).
    pub fn stack_mut(&mut self) -> &mut TierStack {
        &mut self.stack
    }

    /// Wall time per stage so far.
    pub fn times(&self) -> StageTimes {
        self.times
    }

    /// What the driver counted so far.
    pub fn counts(&self) -> DriverCounts {
        self.counts
    }

    /// What the lanes settled so far ([`TierStack::lane_outcomes`]).
    pub fn lane_outcomes(&self) -> LaneOutcomes {
        self.stack.lane_outcomes()
    }

    /// The caller is about to wait for the next request ([`TierStack::idle`]).
    pub fn idle(&mut self) {
        self.stack.idle();
    }

    /// Collects finished lane handles ([`TierStack::reap`]).
    pub fn reap(&mut self) {
        self.stack.reap();
    }

    /// Finishes every read started ahead, then the stack ([`TierStack::finish`]: lanes
    /// drained, G3 and its journal synced); counted as the `drain` stage.
    ///
    /// # Errors
    /// What [`TierStack::finish`] returns.
    pub fn finish(&mut self) -> Result<()> {
        let t = std::time::Instant::now();
        self.complete_read_aheads(usize::MAX);
        let r = self.stack.finish();
        self.times.drain += t.elapsed().as_secs_f64();
        r
    }
}
