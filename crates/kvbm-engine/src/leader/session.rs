//! [`OnboardingSession`]: bring a matched prefix up to G1, with explicit phases, failure
//! states, cancellation, and an idempotent end.
//!
//! # Phases
//!
//! ```text
//!  begin_onboarding: search (find_matches) ──► Holding ── prepare ──► Staging ──► Staged
//!                                                 │                     │  G3→G2, G4→G2     │
//!                                                 │                     │  (BlockMove)      │ onboard
//!                                                 │                     v                   v
//!                                                 │                  Failed ◄──────── Onboarding
//!                                                 │                     ^            G2→G1  │
//!                                                 │                     └───────────────────┤
//!                                                 v                                         v
//!   abort (any non-terminal phase) ─────────► Aborting* ──► Aborted      Finished ◄─ finish ─ Complete
//!   (* only while an operation is in flight; it becomes Aborted when that operation settles)
//! ```
//!
//! Terminal phases: `Finished`, `Aborted`, `Failed`.
//!
//! # Layer-wise onboarding
//!
//! [`onboard_layerwise`](OnboardingSession::onboard_layerwise) runs the `Onboarding` phase one
//! layer at a time (all blocks of the prefix per layer, through a [`LayerMove`]) and publishes
//! each finished layer on a watch channel, so the inference engine can run layer `l` of its
//! forward pass as soon as [`LayerwiseOnboard::layer_ready`]`(l)` returns, while later layers
//! are still moving:
//!
//! ```text
//!  task:    layer 0 ──► done=1 ──► [abort?] ──► layer 1 ──► done=2 ──► ... ──► register G1 ──► Complete
//!  engine:  layer_ready(0) ─► run layer 0     layer_ready(1) ─► run layer 1 ...
//! ```
//!
//! The G1 destinations stay unregistered `MutableBlock`s owned by the task until the last layer
//! arrived; only then are they completed and registered (a half-onboarded block is never
//! matchable). A layer that fails on any block (any rank) fails the session like a whole-block
//! onboard. An abort takes effect **between layers**: the layer in flight settles, no further
//! layer starts, and everything (G1 destinations, G2 holds) is released; waiters on later
//! layers get [`SessionError::Aborted`]. `layer_ready` reports `Ok` only while the session is
//! neither failed nor aborted. The pull (remote G2 → local G2, over the
//! data plane's [`RemotePull`]) runs in the `Staging` phase, concurrently with the G3→G2 and
//! G4→G2 stages: the prefix is `Staged` once every local and remote part of it is in local G2.
//!
//! # Why it is shaped like this (what broke upstream)
//!
//! * **A failed transfer never counts as a hit.** Any block that fails to stage or onboard
//!   fails the session (`Failed`, with the first failure's message); the staged or onboarded
//!   blocks of that attempt are released, never handed out.
//! * **Finish/abort are idempotent** (vLLM/Dynamo crashed when `request_finished` ran twice
//!   and when an abort raced a finish): [`finish`](OnboardingSession::finish) and
//!   [`abort`](OnboardingSession::abort) may be called any number of times, in any order,
//!   from any thread; each returns what the session's state is, none panics, and resources
//!   are released exactly once (by whichever call or operation reaches the terminal state).
//! * **A slot outlives every in-flight operation on it.** Each transfer runs in a spawned task
//!   that owns its source holds and its destination blocks until the transfer manager has
//!   settled every block, even if the caller drops the `prepare`/`onboard` future or aborts.
//!   An abort during a transfer therefore only marks the session `Aborting`; the task releases
//!   everything and sets `Aborted` when the transfer settles.
//!
//! # Locks
//!
//! One `parking_lot` mutex per session guards its state; it is never held across an `.await`
//! nor while a block manager is called (blocks are taken out, or put in, under the lock and
//! dropped after it is released), so it nests with nothing.

use std::sync::Arc;

use kvbm_logical::{BlockId, G1, G2, G3, G4, ImmutableBlock, MutableBlock, TierId};
use kvbm_offload::{BlockFailure, BlockFailureKind};
use parking_lot::Mutex;
use tokio::sync::{Notify, watch};

use super::holder::MatchedPrefix;
use crate::cross_instance::RemotePull;
pub use crate::error::{Phase, SessionError, SessionFailure};
use crate::mover::{BlockMove, LayerMove};

/// What [`OnboardingSession::finish`] found.
#[derive(Debug)]
pub enum FinishOutcome {
    /// The onboarded G1 blocks, handed to the caller (first finish after `Complete`).
    Finished(Vec<ImmutableBlock<G1>>),
    /// A previous finish already handed them over; nothing happens.
    AlreadyFinished,
    /// The session was aborted (before or racing this finish); nothing to hand over.
    Aborted,
    /// The session failed; nothing to hand over.
    Failed(SessionFailure),
    /// The session is not complete yet (in this phase); nothing changes.
    NotReady(Phase),
}

/// The movers that bring blocks into G2: a session's staging (one per lower tier present in
/// the prefix) and the scheduler-facing manager's promotions (G3 and G4; the remote pull is the
/// sessions'). In-process (`kvbm_offload::BlockMover`) or across ranks (`SpmdMover`). Their
/// destination must be the leader's G2 manager.
#[derive(Default, Clone)]
pub struct MoversToG2 {
    /// G3 → G2.
    pub g3_to_g2: Option<Arc<dyn BlockMove<G3, G2>>>,
    /// G4 → G2 (for an object layout, a keyed source).
    pub g4_to_g2: Option<Arc<dyn BlockMove<G4, G2>>>,
    /// Remote G2 → local G2 (the pull; e.g. a `dataplane::DataPlaneClient`).
    pub remote_g2: Option<Arc<dyn RemotePull>>,
}

#[derive(Default)]
struct State {
    phase: Option<Phase>,
    matched: Option<MatchedPrefix>,
    staged: Vec<ImmutableBlock<G2>>,
    onboarded: Vec<ImmutableBlock<G1>>,
    failure: Option<SessionFailure>,
}

impl State {
    fn phase(&self) -> Phase {
        self.phase.unwrap_or(Phase::Holding)
    }

    /// Moves every held block out (to be dropped after the lock is released).
    fn take_all(&mut self) -> Released {
        Released {
            _matched: self.matched.take(),
            _staged: std::mem::take(&mut self.staged),
            _onboarded: std::mem::take(&mut self.onboarded),
        }
    }
}

/// Blocks released by a transition, dropped outside the session lock.
struct Released {
    _matched: Option<MatchedPrefix>,
    _staged: Vec<ImmutableBlock<G2>>,
    _onboarded: Vec<ImmutableBlock<G1>>,
}

struct Shared {
    state: Mutex<State>,
    settled: Notify,
}

/// One onboarding of one matched prefix: see the [module docs](self). `Send + Sync`; calls
/// take `&self`. Dropping the session aborts it.
pub struct OnboardingSession {
    shared: Arc<Shared>,
    prefix_len: usize,
}

impl std::fmt::Debug for OnboardingSession {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OnboardingSession")
            .field("phase", &self.phase())
            .field("prefix_len", &self.prefix_len)
            .finish()
    }
}

/// How many of `outcomes` failed, and the first failure.
fn first_failure<T>(outcomes: &[Result<T, BlockFailure>]) -> Option<(usize, BlockFailure)> {
    let mut failed = outcomes.iter().filter_map(|o| o.as_ref().err());
    let first = failed.next()?.clone();
    Some((1 + failed.count(), first))
}

impl OnboardingSession {
    /// A session holding `matched` (the search's result), in `Holding`.
    pub fn new(matched: MatchedPrefix) -> Self {
        let prefix_len = matched.len();
        Self {
            shared: Arc::new(Shared {
                state: Mutex::new(State {
                    phase: Some(Phase::Holding),
                    matched: Some(matched),
                    ..State::default()
                }),
                settled: Notify::new(),
            }),
            prefix_len,
        }
    }

    /// The current phase.
    pub fn phase(&self) -> Phase {
        self.shared.state.lock().phase()
    }

    /// Blocks in the matched prefix.
    pub fn prefix_len(&self) -> usize {
        self.prefix_len
    }

    /// Why the session failed, once it has.
    pub fn failure(&self) -> Option<SessionFailure> {
        self.shared.state.lock().failure.clone()
    }

    /// With the state locked: the phase must be `expected`; moves to `next`, returning what
    /// the operation needs.
    fn begin(&self, expected: Phase, next: Phase) -> Result<(), SessionError> {
        let mut s = self.shared.state.lock();
        let actual = s.phase();
        if actual != expected {
            return Err(match actual {
                Phase::Aborted | Phase::Aborting => SessionError::Aborted,
                Phase::Failed => {
                    SessionError::Failed(s.failure.clone().expect("a failed session has a failure"))
                }
                _ => SessionError::WrongPhase { expected, actual },
            });
        }
        s.phase = Some(next);
        Ok(())
    }

    /// An operation gave up before moving anything: back to `back`, unless an abort arrived
    /// meanwhile, in which case the session ends `Aborted` (everything released).
    fn give_up(&self, back: Phase, error: SessionError) -> SessionError {
        let mut s = self.shared.state.lock();
        if s.phase() == Phase::Aborting {
            s.phase = Some(Phase::Aborted);
            let released = s.take_all();
            drop(s);
            drop(released);
            self.shared.settled.notify_waiters();
            return SessionError::Aborted;
        }
        s.phase = Some(back);
        error
    }

    /// Stages the G3 and G4 parts of the prefix into G2 and pulls its remote part
    /// (`Holding` → `Staging` → `Staged`). Destinations are allocated from each mover's (and
    /// the puller's) destination manager (the leader's G2).
    ///
    /// # Errors
    /// [`SessionError::WrongPhase`] outside `Holding` (nothing changes);
    /// [`SessionError::NoMover`] / [`SessionError::Destinations`] (the session stays
    /// `Holding`); [`SessionError::Failed`] when a block failed to stage (the session is
    /// `Failed`, everything released); [`SessionError::Aborted`] when aborted meanwhile.
    pub async fn prepare(&self, movers: MoversToG2) -> Result<(), SessionError> {
        self.begin(Phase::Holding, Phase::Staging)?;
        // Check and allocate before anything moves; on error go back to Holding.
        let prepared = {
            let s = self.shared.state.lock();
            let matched = s.matched.as_ref().expect("held while Holding");
            let need3 = matched.g3().len();
            let need4 = matched.g4().len();
            let need_r = matched.remote_len();
            drop(s);
            (|| {
                let d3 = match (&movers.g3_to_g2, need3) {
                    (_, 0) => Vec::new(),
                    (None, _) => return Err(SessionError::NoMover(TierId::G3)),
                    (Some(m), n) => m
                        .destination()
                        .allocate_blocks(n)
                        .map_err(|e| SessionError::Destinations(e.to_string()))?,
                };
                let d4 = match (&movers.g4_to_g2, need4) {
                    (_, 0) => Vec::new(),
                    (None, _) => return Err(SessionError::NoMover(TierId::G4)),
                    (Some(m), n) => m
                        .destination()
                        .allocate_blocks(n)
                        .map_err(|e| SessionError::Destinations(e.to_string()))?,
                };
                let dr = match (&movers.remote_g2, need_r) {
                    (_, 0) => Vec::new(),
                    (None, _) => return Err(SessionError::NoPuller),
                    (Some(m), n) => m
                        .destination()
                        .allocate_blocks(n)
                        .map_err(|e| SessionError::Destinations(e.to_string()))?,
                };
                Ok((d3, d4, dr))
            })()
        };
        let (d3, d4, dr) = match prepared {
            Ok(d) => d,
            Err(e) => return Err(self.give_up(Phase::Holding, e)),
        };
        let matched = self
            .shared
            .state
            .lock()
            .matched
            .take()
            .expect("held while Staging");

        // The task owns the sources (matched) and destinations until every block settled.
        let shared = self.shared.clone();
        let task = tokio::spawn(async move {
            let (g2, g3, g4) = (
                matched.g2().blocks().to_vec(),
                matched.g3().blocks(),
                matched.g4().blocks(),
            );
            let stage3 = async {
                match &movers.g3_to_g2 {
                    Some(m) if !g3.is_empty() => m.move_blocks(g3, d3).await,
                    _ => Vec::new(),
                }
            };
            let stage4 = async {
                match &movers.g4_to_g2 {
                    Some(m) if !g4.is_empty() => m.move_blocks(g4, d4).await,
                    _ => Vec::new(),
                }
            };
            let pull = async {
                match (&movers.remote_g2, matched.remote()) {
                    (Some(p), Some(r)) => p.pull(r.instance, &r.hashes, dr).await,
                    _ => Vec::new(),
                }
            };
            // Every part settles before the task looks at any outcome.
            let (mut out3, mut out4, mut outr) = futures::join!(stage3, stage4, pull);
            let failure = first_failure(&out3)
                .or_else(|| first_failure(&out4))
                .or_else(|| first_failure(&outr));
            let failed = out3
                .iter()
                .chain(&out4)
                .chain(&outr)
                .filter(|o| o.is_err())
                .count();
            // Assemble the prefix in G2, in order.
            let mut staged = Vec::with_capacity(matched.len());
            let mut g2_rest = Vec::new();
            if failure.is_none() {
                let (mut it2, mut it3, mut it4) = (
                    g2.into_iter(),
                    std::mem::take(&mut out3).into_iter().flatten(),
                    std::mem::take(&mut out4).into_iter().flatten(),
                );
                for run in matched.runs() {
                    for _ in 0..run.len {
                        let b = match run.tier {
                            TierId::G2 => it2.next(),
                            TierId::G3 => it3.next(),
                            TierId::G4 => it4.next(),
                            TierId::G1 => None,
                        };
                        staged.extend(b);
                    }
                }
                // The remote run comes after every local run.
                staged.extend(std::mem::take(&mut outr).into_iter().flatten());
            } else {
                g2_rest = g2;
            }
            let mut s = shared.state.lock();
            let result = match (s.phase(), failure) {
                (Phase::Aborting, _) => {
                    s.phase = Some(Phase::Aborted);
                    Err(SessionError::Aborted)
                }
                (_, Some((_, first))) => {
                    let f = SessionFailure::new(Phase::Staging, failed, first);
                    s.failure = Some(f.clone());
                    s.phase = Some(Phase::Failed);
                    Err(SessionError::Failed(f))
                }
                (_, None) => {
                    s.staged = staged;
                    staged = Vec::new();
                    s.phase = Some(Phase::Staged);
                    Ok(())
                }
            };
            let released = if result.is_err() {
                Some(s.take_all())
            } else {
                None
            };
            drop(s);
            // Sources (matched) and anything unused drop here, outside the lock.
            drop((released, staged, out3, out4, outr, g2_rest, matched));
            shared.settled.notify_waiters();
            result
        });
        task.await.unwrap_or_else(|e| {
            Err(SessionError::Destinations(format!(
                "staging task ended: {e}"
            )))
        })
    }

    /// The staged G2 blocks, in prefix order (empty outside `Staged`).
    pub fn staged(&self) -> Vec<ImmutableBlock<G2>> {
        self.shared.state.lock().staged.clone()
    }

    /// Moves the staged prefix into `destinations` (`Staged` → `Onboarding` → `Complete`),
    /// one destination per prefix block, in order. Whole blocks move (not yet layer by layer).
    ///
    /// # Errors
    /// [`SessionError::WrongPhase`] outside `Staged`, [`SessionError::Destinations`] for a
    /// count mismatch (the session stays `Staged`; the unused destinations return to their
    /// pool as they drop); [`SessionError::Failed`] when a block failed (`Failed`, everything
    /// released, no G1 block counted); [`SessionError::Aborted`].
    pub async fn onboard(
        &self,
        mover: Arc<dyn BlockMove<G2, G1>>,
        destinations: Vec<MutableBlock<G1>>,
    ) -> Result<(), SessionError> {
        self.begin(Phase::Staged, Phase::Onboarding)?;
        let staged = {
            let s = self.shared.state.lock();
            if destinations.len() != s.staged.len() {
                let e = SessionError::Destinations(format!(
                    "{} destinations for {} staged blocks",
                    destinations.len(),
                    s.staged.len()
                ));
                drop(s);
                return Err(self.give_up(Phase::Staged, e));
            }
            // The task holds its own copies of the handles for the move's duration.
            s.staged.clone()
        };
        let shared = self.shared.clone();
        let task = tokio::spawn(async move {
            let out = mover.move_blocks(&staged, destinations).await;
            let failure = first_failure(&out);
            let failed = out.iter().filter(|o| o.is_err()).count();
            let mut s = shared.state.lock();
            let mut unused = Vec::new();
            let result = match (s.phase(), failure) {
                (Phase::Aborting, _) => {
                    s.phase = Some(Phase::Aborted);
                    unused = out;
                    Err(SessionError::Aborted)
                }
                (_, Some((_, first))) => {
                    let f = SessionFailure::new(Phase::Onboarding, failed, first);
                    s.failure = Some(f.clone());
                    s.phase = Some(Phase::Failed);
                    unused = out;
                    Err(SessionError::Failed(f))
                }
                (_, None) => {
                    s.onboarded = out.into_iter().flatten().collect();
                    s.phase = Some(Phase::Complete);
                    Ok(())
                }
            };
            let released = if result.is_err() {
                Some(s.take_all())
            } else {
                None
            };
            drop(s);
            drop((released, unused, staged));
            shared.settled.notify_waiters();
            result
        });
        task.await.unwrap_or_else(|e| {
            Err(SessionError::Destinations(format!(
                "onboarding task ended: {e}"
            )))
        })
    }

    /// Moves the staged prefix into `destinations` layer by layer (`Staged` → `Onboarding` →
    /// `Complete`), one destination per prefix block, in order; see the
    /// [module docs](self#layer-wise-onboarding). Returns at once with a [`LayerwiseOnboard`]
    /// to wait on each layer; the move runs in a task that owns the G1 destinations and its
    /// copies of the G2 holds until it settled.
    ///
    /// # Errors
    /// As [`onboard`](Self::onboard), checked before anything moves; failures while moving
    /// are reported by [`LayerwiseOnboard::layer_ready`] and [`LayerwiseOnboard::wait`].
    pub async fn onboard_layerwise(
        &self,
        mover: Arc<dyn LayerMove<G2, G1>>,
        destinations: Vec<MutableBlock<G1>>,
    ) -> Result<LayerwiseOnboard, SessionError> {
        self.begin(Phase::Staged, Phase::Onboarding)?;
        let staged = {
            let s = self.shared.state.lock();
            let problem = if destinations.len() != s.staged.len() {
                Some(format!(
                    "{} destinations for {} staged blocks",
                    destinations.len(),
                    s.staged.len()
                ))
            } else if mover.num_layers() == 0 {
                Some("the layer mover reports zero layers".to_owned())
            } else {
                None
            };
            if let Some(m) = problem {
                drop(s);
                return Err(self.give_up(Phase::Staged, SessionError::Destinations(m)));
            }
            s.staged.clone()
        };
        let num_layers = mover.num_layers();
        let ids: Vec<BlockId> = destinations.iter().map(|b| b.block_id()).collect();
        let (tx, rx) = watch::channel(LayerProgress::default());
        let shared = self.shared.clone();
        let task = tokio::spawn(async move {
            let mut failure: Option<(usize, BlockFailure)> = None;
            let mut aborted = false;
            for layer in 0..num_layers {
                // The cancellation point: between layers.
                if shared.state.lock().phase() == Phase::Aborting {
                    aborted = true;
                    break;
                }
                // `destinations` are this task's unregistered blocks of the mover's destination
                // manager, held until they are registered after the last layer (or dropped on
                // failure); `staged` holds the sources registered.
                let out = mover
                    .move_layers(&staged, &destinations, layer..layer + 1)
                    .await;
                if let Some((n, mut first)) = first_failure(&out) {
                    first.message = format!("layer {layer}: {}", first.message);
                    failure = Some((n, first));
                    break;
                }
                tx.send_modify(|p| p.done = layer + 1);
            }
            // Register outside the session lock (the lock nests with no manager call). A
            // block is whole only now that every layer arrived.
            let whole = match (&failure, aborted) {
                (None, false) => Some(register_whole(mover.destination(), &staged, destinations)),
                _ => {
                    drop(destinations);
                    None
                }
            };
            let mut s = shared.state.lock();
            let mut unused: Vec<ImmutableBlock<G1>> = Vec::new();
            let result = match (s.phase(), failure, whole) {
                (Phase::Aborting, _, whole) => {
                    s.phase = Some(Phase::Aborted);
                    if let Some(Ok(b) | Err((_, b))) = whole {
                        unused = b;
                    }
                    Err(SessionError::Aborted)
                }
                (_, Some((failed_blocks, first)), _) => {
                    let f = SessionFailure::new(Phase::Onboarding, failed_blocks, first);
                    s.failure = Some(f.clone());
                    s.phase = Some(Phase::Failed);
                    Err(SessionError::Failed(f))
                }
                (_, None, Some(Ok(on_g1))) => {
                    s.onboarded = on_g1;
                    s.phase = Some(Phase::Complete);
                    Ok(())
                }
                (_, None, Some(Err((f, rest)))) => {
                    s.failure = Some(f.clone());
                    s.phase = Some(Phase::Failed);
                    unused = rest;
                    Err(SessionError::Failed(f))
                }
                (phase, None, None) => {
                    // Only an abort stops the loop early, and only the task leaves Aborting.
                    unreachable!("layer-wise onboard stopped early in {phase:?}")
                }
            };
            let released = if result.is_err() {
                Some(s.take_all())
            } else {
                None
            };
            drop(s);
            drop((released, unused, staged));
            tx.send_modify(|p| p.end = Some(result.clone()));
            shared.settled.notify_waiters();
            result
        });
        Ok(LayerwiseOnboard {
            progress: rx,
            num_layers,
            g1_blocks: ids,
            task: Mutex::new(Some(task)),
        })
    }

    /// Ends a `Complete` session, handing over the G1 blocks and releasing the G2 holds.
    /// Idempotent and harmless in every phase: see [`FinishOutcome`].
    pub fn finish(&self) -> FinishOutcome {
        let mut s = self.shared.state.lock();
        match s.phase() {
            Phase::Complete => {
                s.phase = Some(Phase::Finished);
                let onboarded = std::mem::take(&mut s.onboarded);
                let released = s.take_all();
                drop(s);
                drop(released);
                self.shared.settled.notify_waiters();
                FinishOutcome::Finished(onboarded)
            }
            Phase::Finished => FinishOutcome::AlreadyFinished,
            Phase::Aborted | Phase::Aborting => FinishOutcome::Aborted,
            Phase::Failed => {
                FinishOutcome::Failed(s.failure.clone().expect("a failed session has a failure"))
            }
            other => FinishOutcome::NotReady(other),
        }
    }

    /// Aborts: releases everything now, or, with an operation in flight, when it settles
    /// (`Aborting`). Idempotent; a no-op on a terminal session. Returns the phase after the call.
    pub fn abort(&self) -> Phase {
        let mut s = self.shared.state.lock();
        let phase = s.phase();
        if phase.is_terminal() || phase == Phase::Aborting {
            return phase;
        }
        if phase.in_flight() {
            s.phase = Some(Phase::Aborting);
            return Phase::Aborting;
        }
        s.phase = Some(Phase::Aborted);
        let released = s.take_all();
        drop(s);
        drop(released);
        self.shared.settled.notify_waiters();
        Phase::Aborted
    }

    /// Waits until no operation is in flight; returns the phase then.
    pub async fn settled(&self) -> Phase {
        loop {
            let notified = self.shared.settled.notified();
            let phase = self.phase();
            if !phase.in_flight() {
                return phase;
            }
            notified.await;
        }
    }
}

/// Completes and registers layer-wise destinations whose every layer arrived; on a
/// registration refusal (another block under the hash with another identity) fails, handing
/// back nothing registered.
#[allow(clippy::type_complexity)]
fn register_whole(
    g1: &Arc<kvbm_logical::BlockManager<G1>>,
    staged: &[ImmutableBlock<G2>],
    destinations: Vec<MutableBlock<G1>>,
) -> Result<Vec<ImmutableBlock<G1>>, (SessionFailure, Vec<ImmutableBlock<G1>>)> {
    let fail = |kind, message: String| {
        SessionFailure::new(Phase::Onboarding, 1, BlockFailure::new(kind, message))
    };
    let mut complete = Vec::with_capacity(destinations.len());
    for (d, s) in destinations.into_iter().zip(staged) {
        match d.complete_with_digest(s.sequence_hash(), s.digest()) {
            Ok(c) => complete.push(c),
            Err(e) => {
                let f = fail(
                    BlockFailureKind::Transfer,
                    format!("cannot register in G1: {}", e.error),
                );
                return Err((f, Vec::new()));
            }
        }
    }
    let registered = g1.register_blocks(complete);
    if let Some((_, s)) = registered
        .iter()
        .zip(staged)
        .find(|(b, s)| b.digest() != s.digest())
    {
        let f = fail(
            BlockFailureKind::IdentityMismatch,
            format!(
                "G1 already holds {} under another identity",
                s.sequence_hash()
            ),
        );
        return Err((f, registered));
    }
    Ok(registered)
}

/// Progress of a layer-wise onboard, published on a watch channel.
#[derive(Clone, Debug, Default)]
struct LayerProgress {
    /// Layers of every block that arrived (layers `0..done`).
    done: usize,
    /// How the onboard ended, once it has.
    end: Option<Result<(), SessionError>>,
}

/// A running layer-wise onboard ([`OnboardingSession::onboard_layerwise`]): wait on each
/// layer, or on the whole. Dropping it does not stop the move (abort the session for that).
#[derive(Debug)]
pub struct LayerwiseOnboard {
    progress: watch::Receiver<LayerProgress>,
    num_layers: usize,
    g1_blocks: Vec<BlockId>,
    task: Mutex<Option<tokio::task::JoinHandle<Result<(), SessionError>>>>,
}

impl LayerwiseOnboard {
    /// Layers per block.
    pub fn num_layers(&self) -> usize {
        self.num_layers
    }

    /// The G1 slots the prefix is onboarded into, in prefix order (the engine's attention
    /// reads layer `l` of these once `layer_ready(l)` returned `Ok`).
    pub fn g1_block_ids(&self) -> &[BlockId] {
        &self.g1_blocks
    }

    /// Layers that arrived so far, for every block.
    pub fn layers_done(&self) -> usize {
        self.progress.borrow().done
    }

    /// Waits until layer `layer` of every block is in G1.
    ///
    /// # Errors
    /// [`SessionError::Destinations`] for a layer past the last; [`SessionError::Failed`] /
    /// [`SessionError::Aborted`] when the onboard ended that way (also for layers that had
    /// arrived: their slots are released).
    pub async fn layer_ready(&self, layer: usize) -> Result<(), SessionError> {
        if layer >= self.num_layers {
            return Err(SessionError::Destinations(format!(
                "layer {layer} of {}-layer blocks",
                self.num_layers
            )));
        }
        let mut rx = self.progress.clone();
        let p = rx
            .wait_for(|p| p.done > layer || p.end.is_some())
            .await
            .map_err(|_| SessionError::Destinations("onboarding task ended".into()))?;
        match &p.end {
            Some(Err(e)) => Err(e.clone()),
            _ => Ok(()),
        }
    }

    /// Waits for the whole onboard (every layer, then registration).
    ///
    /// # Errors
    /// As [`OnboardingSession::onboard`].
    pub async fn wait(&self) -> Result<(), SessionError> {
        let mut rx = self.progress.clone();
        let end = rx
            .wait_for(|p| p.end.is_some())
            .await
            .map(|p| p.end.clone());
        match end {
            Ok(Some(r)) => r,
            _ => {
                let task = self.task.lock().take();
                match task {
                    Some(t) => t.await.unwrap_or_else(|e| {
                        Err(SessionError::Destinations(format!(
                            "onboarding task ended: {e}"
                        )))
                    }),
                    None => Err(SessionError::Destinations("onboarding task ended".into())),
                }
            }
        }
    }
}

impl Drop for OnboardingSession {
    fn drop(&mut self) {
        // Releases now, or makes the in-flight task release when it settles.
        self.abort();
    }
}

#[cfg(test)]
mod tests;
