//! An instance's worker ranks as separate processes (`[workers] mode = "processes"`): the
//! instance's block memory is the ranks' (`kvbm-engine-worker`), the instance holds only the
//! block managers and drives the ranks over NATS control.
//!
//! ```text
//!  build:  Membership::follow(<control_prefix>.<instance>.members)
//!          wait_for(ranks, join_timeout_ms) ──timeout──► EngineError::RanksMissing{missing}
//!          NatsControl(rank r).with_membership.with_security  ×ranks ─► ControlledWorkers
//!          describe_all: every rank has G1, G2 (G3 when tiers.g3_blocks > 0, G4 when
//!            tiers.g4_blocks > 0), at least [tiers] blocks each, and blocks of the instance's
//!            geometry's bytes, else EngineError::Config naming the key and the rank
//!          G4 (tiers.g4_blocks > 0): one ObjectStorage per rank (rank_object_config: its own
//!            tp{ranks}.r{r}/ directory of the bucket), each listed; a block whose slices every
//!            rank holds is present (warm start); EveryChecker over them (presence checks)
//!          RankTiers::build (managers + leader; no layouts) ─► SpmdMovers G3→G2, G2→G1,
//!            G2→G3, G2→G4, G4→G2
//!          G3 with workers.g3_journal: the journal of which block each slot holds, listed
//!            into G3 (warm start); offload_g3 unlists a slot before the ranks rewrite it and
//!            lists it once every rank wrote it (each rank's slot header still checks reads)
//!          every rank described a rank plane (`--data-plane`): Lender on
//!            <events subject>.lease.<id> and RankPull as the remote-G2 move (lending.rs); G2
//!            events published. Else: G2 events unpublished, remote G2 not searched
//!          keep_in_step(forget G2 (leader) and G1 until nothing old is held) until shutdown
//!  calls:  every rank in step, or the call fails with ControlError::{NotJoined, Rejoining}
//!          before anything is held or moved; a rank lost mid-call fails that call's session
//!          (refused, nothing served)
//! ```
//!
//! The processes are not started here: an operator (or a test, or a supervisor) starts one
//! `kvbm-engine-worker` per rank with this instance's id, and restarts one that died; the
//! instance waits for them at build, refuses work while one is missing, and brings a restarted
//! one back in step (see [`Membership`]).
//!
//! # G4
//!
//! Each rank writes and reads its own slice of a block (`kvbm-engine-worker` opens G4 from the
//! same configuration tree: `[physical.s3]` or `physical.object_dir`, its rank's directory),
//! every object checksummed and bound to the block's identity, the rank and the fingerprint;
//! this process only lists and probes (it holds no block bytes). A block is in G4 only when
//! every rank wrote its slice: a move reports `Ok` only when every rank's did
//! ([`SpmdMover`]), and what is found at start or by a presence check must be in every rank's
//! directory with one identity ([`EveryChecker`]). G4's events are published: another instance
//! of the same fingerprint (so the same rank count) reads the same objects through its own
//! ranks.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use async_nats::Client;
use kvbm_logical::{G1, G2, G3, G4, ImmutableBlock, SequenceHash, Tier, TierId};
use kvbm_offload::journal::DiskJournal;
use kvbm_offload::{BadCopies, EveryChecker, PresenceChecker, S3PresenceChecker};
use kvbm_physical::{BlockLayout, JournalGeometry};
use tokio_util::sync::CancellationToken;

use super::lending::{Asker, Lender, LenderStats, RankPull};
use crate::security::Security;
use crate::transport::control::{ControlledWorkers, WorkerControl};
use crate::transport::membership::Membership;
use crate::transport::nats::NatsControl;
use kvbm_engine::config::KvbmConfig;
use kvbm_engine::error::{ControlError, EngineError, Result};
use kvbm_engine::leader::RemoteSearch;
use kvbm_engine::runtime::RuntimeHandle;
use kvbm_engine::stack::{Identities, RankTiers, TierSinks, list_g4, open_g4_storage};
use kvbm_engine::worker::{ParallelWorkers, SpmdMover};
use kvbm_engine::{InstanceId, WorkerAddress};

/// The ranks of an instance run as processes, the instance's view of them, and the moves
/// through them.
pub(super) struct Ranks {
    pub(super) tiers: RankTiers,
    pub(super) workers: Arc<ControlledWorkers>,
    pub(super) membership: Membership,
    pub(super) world: u32,
    pub(super) instance: InstanceId,
    pub(super) block_bytes: usize,
    pub(super) g3_to_g2: Option<Arc<SpmdMover<G3, G2>>>,
    pub(super) g2_to_g3: Option<SpmdMover<G2, G3>>,
    pub(super) g2_to_g1: Arc<SpmdMover<G2, G1>>,
    pub(super) g4_to_g2: Option<Arc<SpmdMover<G4, G2>>>,
    pub(super) g2_to_g4: Option<SpmdMover<G2, G4>>,
    /// Whether a block is in every rank's directory of the bucket (with G4).
    pub(super) g4_checker: Option<EveryChecker>,
    /// G3 and G4 copies a rank rejected on read (proven bad), dropped from their managers
    /// before the next onboarding ([`discard_rejected`](Self::discard_rejected)).
    g3_rejected: Arc<BadCopies<G3>>,
    g4_rejected: Arc<BadCopies<G4>>,
    /// Which block each G3 slot holds (`workers.g3_journal`): listed at start (warm), a slot
    /// unlisted before the ranks rewrite it and listed once every rank wrote it.
    pub(super) g3_journal: Option<DiskJournal>,
    /// Every rank serves the rank plane (`kvbm-engine-worker --data-plane`): this instance
    /// lends its G2 to peers, publishes its G2 events, and pulls peers' G2 through its ranks
    /// (`lending.rs`); else G2 stays its own.
    pub(super) pull: Option<Arc<RankPull>>,
    pub(super) lender: Option<Arc<LenderStats>>,
}

/// What an instance shares through its ranks' rank plane (when every rank serves one).
pub(super) struct Sharing {
    /// The events subject (lease subjects are under it).
    pub(super) subject: String,
    pub(super) identities: Arc<Identities>,
}

impl Ranks {
    /// Follows the ranks of `id`, waits for all of them, checks what they registered against
    /// `geometry` and `[tiers]`, builds the managers and movers, and keeps restarted ranks in
    /// step until `cancel`. See the [module docs](self).
    ///
    /// # Errors
    /// [`EngineError::RanksMissing`] when a rank is not in step within
    /// `workers.join_timeout_ms`; [`EngineError::Control`] when a rank cannot be described;
    /// [`EngineError::Config`] naming the key when a rank's layouts do not fit this instance;
    /// [`EngineError::Nats`] when the membership subject cannot be subscribed.
    #[allow(clippy::too_many_arguments)]
    pub(super) async fn start(
        config: &KvbmConfig,
        rt: &RuntimeHandle,
        id: InstanceId,
        geometry: &BlockLayout,
        client: &Client,
        security: Arc<Security>,
        mut sinks: TierSinks,
        mut remote: RemoteSearch,
        sharing: Sharing,
        cancel: &CancellationToken,
    ) -> Result<Ranks> {
        let w = &config.workers;
        let world = w.ranks;
        // Followed on the runtime's tokio, whoever polls `build`: its task lives there.
        let membership = {
            let (client, prefix, security, cancel) = (
                client.clone(),
                w.control_prefix.clone(),
                security.clone(),
                cancel.clone(),
            );
            let timeout = Duration::from_millis(config.transport.heartbeat_timeout_ms);
            rt.spawn(async move {
                Membership::follow(&client, &prefix, id, timeout, security, cancel).await
            })?
            .await
            .map_err(|e| EngineError::Nats {
                url: w.control_prefix.clone(),
                message: format!("membership task: {e}"),
            })??
        };
        if let Err(why) = membership
            .wait_for(world, Duration::from_millis(w.join_timeout_ms))
            .await
        {
            let missing = (0..world)
                .filter(|r| membership.target(WorkerAddress::new(id, *r)).is_err())
                .collect();
            return Err(EngineError::RanksMissing {
                instance: id,
                missing,
                waited_ms: w.join_timeout_ms,
                why,
            });
        }
        let timeout = Duration::from_millis(config.transport.request_timeout_ms);
        let controls: Vec<Arc<dyn WorkerControl>> = (0..world)
            .map(|r| {
                let c = NatsControl::new(
                    client.clone(),
                    &w.control_prefix,
                    WorkerAddress::new(id, r),
                    timeout,
                )
                .with_membership(membership.clone())
                .with_security(security.clone());
                Arc::new(c) as Arc<dyn WorkerControl>
            })
            .collect();
        let workers = Arc::new(ControlledWorkers::new(controls)?);
        let block_bytes = geometry.config().block_bytes();
        let lending = check_ranks(config, block_bytes, &workers).await?;
        if !lending {
            // No rank plane to serve G2 from: its events would send peers to a G2 they cannot
            // pull from.
            sinks.g2 = None;
            remote.remote_g2 = false;
        }
        let index = remote.index.clone();

        let (g4_listed, g4_checker) = if config.tiers.g4_blocks > 0 {
            let (listed, checker) = open_rank_g4(config, geometry, world).await?;
            (listed, Some(checker))
        } else {
            (Vec::new(), None)
        };
        let tiers = RankTiers::build(config, rt, geometry, sinks, Some(remote), &g4_listed)?;
        // G3 warm from the journal, before anything allocates from it.
        let g3_journal = match (&tiers.g3, &w.g3_journal) {
            (Some(g3), Some(path)) => {
                let geometry = JournalGeometry {
                    payload_bytes: block_bytes as u64,
                    num_slots: g3.total_blocks() as u64,
                    // The slots are this instance's, on this many ranks.
                    file_id: (u128::from(id.0) << 64) | u128::from(world),
                    fingerprint: tiers.fingerprint.short(),
                };
                let opened = DiskJournal::open_apart(path, geometry)?;
                let (_, listed) = opened.register_listed(g3)?;
                tracing::info!(
                    blocks = listed,
                    journal = %path.display(),
                    "G3 warm: the ranks' slots listed by the journal"
                );
                Some(opened.journal)
            }
            _ => None,
        };
        let pw: Arc<dyn ParallelWorkers> = workers.clone();
        let (g3_rejected, g4_rejected) = (
            Arc::<BadCopies<G3>>::default(),
            Arc::<BadCopies<G4>>::default(),
        );
        // SAFETY: proven once for every move over these ranks: each rank joined with layouts
        // checked against these managers (`check_ranks`: every tier's layout has at least
        // the manager's blocks), and this leader is the only writer of their slots (a worker
        // process obeys only its own leader's sealed requests). The moves are then safe calls
        // (`kvbm_engine::worker::Reserved`).
        let (g4_to_g2, g2_to_g4, g3_to_g2, g2_to_g3, g2_to_g1) = unsafe {
            (
                tiers.g4.as_ref().map(|_| {
                    Arc::new(
                        SpmdMover::<G4, G2>::new(pw.clone(), tiers.g2.clone())
                            .with_rejected(g4_rejected.clone()),
                    )
                }),
                tiers
                    .g4
                    .as_ref()
                    .map(|g4| SpmdMover::<G2, G4>::new(pw.clone(), g4.clone())),
                tiers.g3.as_ref().map(|_| {
                    Arc::new(
                        SpmdMover::<G3, G2>::new(pw.clone(), tiers.g2.clone())
                            .with_rejected(g3_rejected.clone()),
                    )
                }),
                tiers
                    .g3
                    .as_ref()
                    .map(|g3| SpmdMover::<G2, G3>::new(pw.clone(), g3.clone())),
                Arc::new(SpmdMover::<G2, G1>::new(pw, tiers.g1.clone())),
            )
        };

        // A restarted rank's memory is empty: what this instance placed on the old process is
        // dropped (G2 through the leader, G1 here) before the rank gets work again; it stays
        // rejoining while a caller still holds blocks of the old incarnation.
        let (leader, g1) = (tiers.leader.clone(), tiers.g1.clone());
        {
            let _guard = rt.tokio().enter();
            membership.keep_in_step(
            move |t| {
                let g2_empty = leader.forget_worker_memory();
                let dropped = g1.reset_inactive_pool();
                if dropped > 0 {
                    tracing::warn!(worker = %t.address, blocks = dropped, "G1 declared empty: a worker rank lost its memory");
                }
                g2_empty && g1.available_blocks() == g1.total_blocks()
            },
            cancel.clone(),
        );
        }
        let (pull, lender) = if lending {
            let lender = Lender::start(
                rt,
                cancel.clone(),
                client.clone(),
                &sharing.subject,
                id,
                security.clone(),
                tiers.g2.clone(),
                workers.clone(),
                Duration::from_millis(
                    config.transport.pull_deadline_ms + config.transport.request_timeout_ms,
                ),
                crate::dataplane::DataPlaneConfig::default().max_blocks_per_request,
            )
            .await?;
            let pull = RankPull {
                asker: Asker {
                    client: client.clone(),
                    prefix: sharing.subject.clone(),
                    security: security.clone(),
                    timeout,
                },
                this: id,
                g2: tiers.g2.clone(),
                workers: workers.clone(),
                identities: sharing.identities.clone(),
                index,
                block_bytes: block_bytes * world as usize,
            };
            (Some(Arc::new(pull)), Some(lender))
        } else {
            (None, None)
        };
        Ok(Ranks {
            pull,
            lender,
            tiers,
            workers,
            membership,
            world,
            instance: id,
            block_bytes,
            g3_to_g2,
            g2_to_g3,
            g2_to_g1,
            g4_to_g2,
            g2_to_g4,
            g4_checker,
            g3_rejected,
            g4_rejected,
            g3_journal,
        })
    }

    /// Drops from G3 and G4 every copy a rank rejected on an earlier read (once nothing holds
    /// it), so it is neither matched nor read again, as an in-process instance does (a rank
    /// already deleted a G4 slice whose checksum failed; a bad G3 slot is overwritten when
    /// its slot is reused).
    pub(super) fn discard_rejected(&self) {
        if let Some(g3) = &self.tiers.g3 {
            self.g3_rejected.discard(g3);
        }
        if let Some(g4) = &self.tiers.g4 {
            self.g4_rejected.discard(g4);
        }
    }

    /// Writes the G2-resident blocks of `hashes` not yet in `Dst` through `down` (every rank
    /// its slice), counting the written ones on `written`; returns how many were written.
    ///
    /// # Errors
    /// [`ControlError`] when a rank is not in step (nothing moved); [`EngineError::Stack`]
    /// naming the first failed block when a rank could not write it (the others are written
    /// and counted); [`EngineError::Logical`] when `Dst` has no room.
    pub(super) async fn offload<Dst: Tier>(
        &self,
        down: &SpmdMover<G2, Dst>,
        hashes: &[SequenceHash],
        written: &AtomicU64,
        journal: Option<&DiskJournal>,
    ) -> Result<usize> {
        self.in_step()?;
        let registry = self.tiers.g2.registry();
        let blocks: Vec<ImmutableBlock<G2>> = self
            .tiers
            .g2
            .match_blocks(hashes)
            .into_iter()
            .filter(|b| !registry.is_present(b.sequence_hash(), Dst::ID))
            .collect();
        if blocks.is_empty() {
            return Ok(0);
        }
        let destinations = down.destination().allocate_blocks(blocks.len())?;
        // A slot is unlisted before any rank rewrites it: a write cut short (a rank or this
        // process dying) never leaves a listed slot holding another block.
        if let Some(j) = journal {
            j.will_write(destinations.iter().map(|d| d.block_id()))
                .map_err(|e| EngineError::stack(format!("the G3 journal: {e}")))?;
        }
        let out = down.move_from(&blocks, destinations).await;
        if let Some(j) = journal {
            let listed: Vec<(usize, u128, u128)> = out
                .iter()
                .filter_map(|o| o.as_ref().ok())
                // Each rank's slot header carries the checksum its read checks; the journal
                // says only which block the slot holds.
                .map(|b| (b.block_id(), b.sequence_hash().as_u128(), 0))
                .collect();
            if let Err(e) = j.written(&listed) {
                // The blocks are written and registered; only a restart will not find them.
                tracing::warn!(error = %e, blocks = listed.len(), "the G3 journal could not list written blocks");
            }
        }
        let n = out.iter().filter(|o| o.is_ok()).count();
        written.fetch_add(n as u64, Ordering::Relaxed);
        match out.into_iter().find_map(|o| o.err()) {
            None => Ok(n),
            Some(f) => Err(EngineError::stack_caused(
                format!(
                    "the worker ranks wrote {n} of {} blocks to {}",
                    blocks.len(),
                    Dst::ID
                ),
                f,
            )),
        }
    }

    /// The presence check over every rank's directory of the bucket (with G4).
    pub(super) fn g4_checker(&self) -> Option<&dyn PresenceChecker> {
        self.g4_checker.as_ref().map(|c| c as &dyn PresenceChecker)
    }

    /// Whether every rank is in step now: the first one that is not, as its error.
    ///
    /// # Errors
    /// [`ControlError::NotJoined`] (absent or lost) or [`ControlError::Rejoining`] (restarted,
    /// not yet brought back in step).
    pub(super) fn in_step(&self) -> std::result::Result<(), ControlError> {
        (0..self.world).try_for_each(|r| {
            self.membership
                .target(WorkerAddress::new(self.instance, r))
                .map(|_| ())
        })
    }
}

/// Every rank's layouts fit this instance: G1 and G2 (and G3 with `tiers.g3_blocks`), each of
/// at least `[tiers]`'s blocks (this instance's block ids are slots of every rank's layout),
/// with blocks of `block_bytes` bytes (the geometry each rank registered is this instance's);
/// and G4 with `tiers.g4_blocks` (its objects are named by block, so any slot count does).
/// Returns whether every rank serves the rank plane.
async fn check_ranks(
    config: &KvbmConfig,
    block_bytes: usize,
    workers: &ControlledWorkers,
) -> Result<bool> {
    let t = &config.tiers;
    let described = workers.describe_all().await?;
    let lending = described.iter().all(|p| p.data_plane.is_some());
    if !lending && described.iter().any(|p| p.data_plane.is_some()) {
        tracing::warn!(
            "some worker ranks serve the rank plane and some do not: G2 is not shared (start every rank with --data-plane)"
        );
    }
    for p in described {
        let r = p.worker;
        if t.g4_blocks > 0 && !p.tiers.contains(&TierId::G4) {
            return Err(EngineError::config(
                "tiers.g4_blocks",
                format!(
                    "{} blocks of G4, but rank {r} registered no G4 layout (its configuration has no tiers.g4_blocks, or no physical.s3 / physical.object_dir)",
                    t.g4_blocks
                ),
            ));
        }
        for (tier, key, n) in [
            (TierId::G1, "tiers.g1_blocks", t.g1_blocks),
            (TierId::G2, "tiers.g2_blocks", t.g2_blocks),
            (TierId::G3, "tiers.g3_blocks", t.g3_blocks),
        ] {
            if n == 0 {
                continue;
            }
            if !p.tiers.contains(&tier) {
                return Err(EngineError::config(
                    key,
                    format!("{n} blocks of {tier}, but rank {r} registered no {tier} layout"),
                ));
            }
            if p.num_blocks < n {
                return Err(EngineError::config(
                    key,
                    format!(
                        "{n} blocks of {tier}, but rank {r} registered only {} (its --blocks)",
                        p.num_blocks
                    ),
                ));
            }
        }
        if p.block_bytes != block_bytes {
            return Err(EngineError::config(
                "instance.geometry",
                format!(
                    "blocks of {block_bytes} bytes, but rank {r} registered blocks of {} bytes (its --layers, --page-size, --inner-dim)",
                    p.block_bytes
                ),
            ));
        }
    }
    Ok(lending)
}

/// Every rank's directory of the G4 bucket (as each `kvbm-engine-worker` opens its own,
/// [`KvbmConfig::rank_object_config`], scoped by this instance's fingerprint), listed: the
/// blocks whose objects every rank holds, in rank 0's order, and the presence check over all
/// of them.
///
/// # Errors
/// As [`open_g4_storage`]; [`EngineError::Stack`] when a listing fails or takes over 60 s.
async fn open_rank_g4(
    config: &KvbmConfig,
    geometry: &BlockLayout,
    world: u32,
) -> Result<(Vec<SequenceHash>, EveryChecker)> {
    let fingerprint = config.fingerprint(geometry.config())?;
    let mut checkers: Vec<Arc<dyn PresenceChecker>> = Vec::with_capacity(world as usize);
    let mut listed: Option<Vec<SequenceHash>> = None;
    for r in 0..world {
        let (storage, describe) =
            open_g4_storage(config, fingerprint, config.rank_object_config(r)?).await?;
        let here = list_g4(&storage, &describe).await?;
        listed = Some(match listed {
            None => here,
            Some(mut l) => {
                let here: std::collections::HashSet<SequenceHash> = here.into_iter().collect();
                l.retain(|h| here.contains(h));
                l
            }
        });
        checkers.push(Arc::new(S3PresenceChecker::new(storage)));
    }
    Ok((listed.unwrap_or_default(), EveryChecker::new(checkers)))
}
