//! [`Instance`]: one kvbm instance composed from the configuration tree (feature `nats`): its
//! leader's tiers and layouts, the TCP data plane, block events and the cross-instance index
//! over NATS, and the presence protocol that fills the peer directory and recovers the index.
//!
//! # What is built from what, and where
//!
//! The tiers are not built here: [`InstanceBuilder::build`] calls the core's one tier builder
//! (`stack::TierSet::build`, `stack/tiers.rs`), the same code the `TierStack` is built by, with
//! the caller's block geometry and pinning, this instance's event sink on G2..G4 and its
//! cross-instance search. What that builds, and what this module adds on top of it:
//!
//! ```text
//!  built by stack::TierSet::build (core):
//!  [tiers]  g1/g2/g3/g4_blocks ─► BlockManagers (one registry, G2..G4 publishing to OwnEvents)
//!  [physical.disk] (G3)            host G1/G2 layouts, a disk G3 layout with its journal (the
//!  [physical.s3] | object_dir (G4) blocks it lists are present again at start: warm restart),
//!  [physical.object.namespace]     an object G4 layout (one bucket + namespace shared by every
//!                                  instance; the block objects listed at start are present),
//!                                  all on one TransferManager; the InstanceLeader (G2, G3, G4,
//!                                  then other instances through the index); the movers:
//!                                  G3→G2 (journal checksum), G4→G2 (object header), G2→G1; a
//!                                  copy a tier rejected is poisoned, never read again, and
//!                                  dropped from its tier before the next onboarding
//!  [offload.g2_to_g3] ───────────► the G2→G3 lane (TierSet::g2_to_g3_lane: journal-recorded)
//!  [offload.g2_to_g4] ───────────► the G2→G4 lane (TierSet::g2_to_g4_lane; owner: this id)
//!
//!  added here (cluster plane):
//!  [transport] data_plane_bind ──► DataPlaneServer (this instance's G2) + DataPlaneClient
//!  [transport] nats_url ─────────► one NATS client (reconnects; counts reconnections)
//!  [events] subject, capacity ───► EventPublisher ─► NatsBus ─► peers' CrossInstanceIndex
//!                                  NatsBus ─► CrossInstanceIndex::follow (this one's index)
//!  [transport] heartbeat_* ──────► Presence: PeerInfo announce, PeerDirectory, expiry,
//!                                  snapshot resync after reconnects (see [`presence`])
//! ```
//!
//! # Worker ranks: this process, or processes
//!
//! `[workers] mode` says where the blocks' bytes are. `in_process` (the default): one rank,
//! this process, everything above. `processes`: `workers.ranks` `kvbm-engine-worker`
//! processes, which the operator starts (one per rank, `--instance` this id); the instance
//! does not start them, it waits for them (see `ranks.rs` for the whole of it):
//!
//! ```text
//!  [workers] mode = "processes", ranks = N
//!    control_prefix ─────────────► Membership::follow (<prefix>.<id>.members heartbeats)
//!    join_timeout_ms ────────────► wait for ranks 0..N in step, else RanksMissing{missing}
//!                                  NatsControl(r).with_membership ×N ─► ControlledWorkers
//!                                  each rank's G1/G2/G3 checked against [tiers], geometry
//!  [tiers] g1..g4_blocks ────────► RankTiers::build: managers + leader, no layouts here
//!                                  SpmdMovers through the ranks: G3→G2, G4→G2, G2→G1,
//!                                  G2→G3, G2→G4 (each rank its slice, its own directory)
//!  [transport] heartbeat_timeout ► a silent rank is lost: calls fail NotJoined naming it
//!                                  keep_in_step until shutdown: a restarted rank's G2/G1
//!                                  declared empty, then it gets work again
//!  [workers] g3_journal ─────────► which block each G3 slot holds: G3 warm at start (every
//!                                  rank's read checks its slot's header)
//!  every rank --data-plane ───────► the rank plane: G2 lent to peers and pulled from theirs,
//!                                  rank to rank (`lending.rs`, `crate::dataplane::rank`);
//!                                  else G2 events unpublished, nothing pulled
//! ```
//!
//! # Fingerprint
//!
//! Every subject is `events.subject` scoped by the instance's model fingerprint
//! ([`Instance::events_subject`], `<subject>.fp-<hex>`), as its G3 journal and G4 object paths
//! are: instances of another model, dtype, KV layout, group or rank share the NATS server and
//! the bucket without ever hearing, indexing, matching or pulling each other's blocks. The
//! data plane folds the fingerprint into the geometry value its requests and frames carry
//! (`DataPlaneConfig::scope`), so even a peer reached by address refuses a pull across
//! fingerprints.
//!
//! [`Instance::offload_g3`] writes G2-resident blocks to G3 through the stack's own G2→G3
//! lane: each written block is listed in G3's journal with the checksum of its bytes, so this
//! instance (or the next one on the same file) serves it, every read checked; its stored event
//! goes to the index like any tier's. [`Instance::offload_g4`] does the same for the shared
//! bucket.
//!
//! Every lower tier's (G2, G3, G4) stored/removed events go through one sink ([`OwnEvents`])
//! that records them in this instance's own index (the source of its snapshot answers) and
//! hands them to the never-blocking publisher (bounded queue, drops counted).
//!
//! # Bounds
//!
//! What a peer (or anyone on the NATS server) can make an instance hold is bounded, each
//! bound a `[transport]` key and each refusal counted: the data-plane server's connections
//! (`max_connections`) and response deadline (`response_deadline_ms`), the client's request
//! deadline (`pull_deadline_ms`) and idle pool (`max_idle_peers`, `idle_expiry_ms`) (see
//! [`crate::dataplane`], [`Instance::data_plane_client_stats`]); snapshot fetches
//! (`snapshot_max_pages`, `snapshot_max_entries`), snapshot offsets, and the index (events of
//! instances that have not joined by heartbeat are ignored) (see [`presence`]).
//!
//! # Lookup and onboarding
//!
//! [`Instance::onboard`] searches local G2, G3, G4, then other instances (the shared G4 bucket
//! as the index places blocks there, then the longest run in one peer's G2), and when the index
//! leaves the prefix short, asks the bucket itself ([`InstanceLeader::adopt_present_g4`]). The
//! session stages G3/G4 to G2, pulls the remote run over TCP (every frame's checksum, identity
//! and binding verified) and onboards G2→G1. A block that fails verification fails the session:
//! it is counted as refused ([`InstanceStats::refused_blocks`]) and never served; the caller
//! recomputes ([`Instance::onboard_or_compute`] does it in one call). A G3 or G4 copy whose
//! failure proves it bad (`BlockFailureKind::drops_copy`) is poisoned by the tier's mover:
//! refused without being read again, and dropped from its tier (its removed event published)
//! at the start of the next [`Instance::onboard`]; a transient failure keeps the copy.
//!
//! # Locks
//!
//! The instance takes no lock of its own; counters are atomics. The leader, data plane,
//! index and presence each document theirs; none is held while another is taken here.

pub(crate) mod lending;
pub mod presence;
mod ranks;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use kvbm_logical::{
    BlockEvent, BlockManager, EventSink, G1, G2, G3, G4, ImmutableBlock, SequenceHash, TierId,
};
use kvbm_offload::{ObjectPipeline, Pipeline, PresenceChecker, S3PresenceChecker};
use kvbm_physical::{BlockLayout, PhysicalLayout, PinPolicy};
use tokio_util::sync::CancellationToken;

use crate::dataplane::{DataPlaneClient, DataPlaneConfig, DataPlaneServer, PeerDirectory};
use crate::pubsub::EventPublisher;
use crate::pubsub::nats::NatsBus;
use crate::security::{Role as SecurityRole, Security};
use crate::transport::PeerInfo;
use crate::transport::control::ControlledWorkers;
use crate::transport::membership::Membership;
use kvbm_engine::config::{KvbmConfig, WorkersMode};
use kvbm_engine::cross_instance::CrossInstanceIndex;
use kvbm_engine::error::{EngineError, Result};
use kvbm_engine::leader::{FinishOutcome, InstanceLeader, MoversToG2, RemoteSearch, SessionError};
use kvbm_engine::mover::BlockMove;
use kvbm_engine::runtime::RuntimeHandle;
use kvbm_engine::stack::{Identities, TierMovers, TierSet, TierSetPlan, TierSinks};
use kvbm_engine::{InstanceId, WorkerAddress};
use ranks::Ranks;

pub use lending::{LenderStats, MAX_LEASES, MAX_LEASES_PER_LESSEE};

pub use presence::{Presence, PresenceConfig, PresenceStats};

/// The sink of every tier of an instance: records the events in the instance's own index,
/// then hands them to the publisher (never blocks; see [`EventPublisher`]).
#[derive(Debug)]
pub struct OwnEvents {
    instance: InstanceId,
    own: Arc<CrossInstanceIndex>,
    publisher: Option<Arc<EventPublisher>>,
}

impl EventSink for OwnEvents {
    fn publish(&self, batch: Vec<BlockEvent>) {
        self.own.apply_events(self.instance, &batch);
        if let Some(p) = &self.publisher {
            p.publish(batch);
        }
    }
}

/// Counters of one instance, in blocks.
#[derive(Debug, Default)]
struct Counters {
    lookups: AtomicU64,
    local_g2: AtomicU64,
    local_g3: AtomicU64,
    g4: AtomicU64,
    remote_g2: AtomicU64,
    onboarded: AtomicU64,
    refused: AtomicU64,
    recomputed: AtomicU64,
    computed: AtomicU64,
    offloaded_g3: AtomicU64,
    offloaded_g4: AtomicU64,
    presence_adopted: AtomicU64,
}

/// A copy of an instance's counters (blocks). Cross-instance hits are
/// [`remote_g2_blocks`](Self::remote_g2_blocks) (pulled from a peer's G2) plus what came from
/// the shared bucket ([`g4_blocks`](Self::g4_blocks), this instance's own offloads included).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct InstanceStats {
    /// Onboardings asked for.
    pub lookups: u64,
    /// Blocks onboarded from local G2.
    pub local_g2_blocks: u64,
    /// Blocks onboarded from local G3.
    pub local_g3_blocks: u64,
    /// Blocks onboarded from G4 (the shared bucket).
    pub g4_blocks: u64,
    /// Blocks pulled from another instance's G2 over the data plane and onboarded.
    pub remote_g2_blocks: u64,
    /// Blocks onboarded to G1 in all.
    pub onboarded_blocks: u64,
    /// Blocks refused because they failed verification (checksum, identity, binding) or could
    /// not be read; never served.
    pub refused_blocks: u64,
    /// Blocks recomputed after a refusal ([`Instance::onboard_or_compute`]).
    pub recomputed_blocks: u64,
    /// Blocks computed into G2 ([`Instance::compute`]).
    pub computed_blocks: u64,
    /// Blocks written to G3 ([`Instance::offload_g3`]).
    pub offloaded_g3_blocks: u64,
    /// Blocks written to G4 ([`Instance::offload_g4`]).
    pub offloaded_g4_blocks: u64,
    /// Blocks found by a G4 presence check (no event told of them).
    pub presence_adopted_blocks: u64,
}

/// What one [`Instance::onboard`] did.
#[derive(Debug, Default)]
pub struct Onboarded {
    /// The onboarded G1 blocks, in prefix order (empty when nothing matched or it failed).
    pub blocks: Vec<ImmutableBlock<G1>>,
    /// Blocks of the prefix from local G2, G3, G4 and a peer's G2.
    pub local_g2: usize,
    /// From local G3.
    pub local_g3: usize,
    /// From G4.
    pub g4: usize,
    /// From a peer's G2, and which peer.
    pub remote_g2: Option<(InstanceId, usize)>,
    /// When staging or onboarding failed: how many blocks failed and why (nothing served).
    pub refused: Option<(usize, String)>,
}

impl Onboarded {
    /// Blocks matched (whether or not they onboarded).
    pub fn matched(&self) -> usize {
        self.local_g2 + self.local_g3 + self.g4 + self.remote_g2.map_or(0, |r| r.1)
    }
}

/// Builds an [`Instance`].
#[derive(Debug)]
pub struct InstanceBuilder {
    runtime: RuntimeHandle,
    id: Option<InstanceId>,
    geometry: Option<BlockLayout>,
    presence_check: bool,
    pin: PinPolicy,
    security: Option<Security>,
    identities: Arc<Identities>,
    fingerprint: Option<kvbm_physical::ModelFingerprint>,
}

impl InstanceBuilder {
    /// An instance on `runtime`, configured by its tree.
    pub fn new(runtime: &RuntimeHandle) -> Self {
        Self {
            runtime: runtime.clone(),
            id: None,
            geometry: None,
            presence_check: true,
            pin: PinPolicy::Unpinned,
            security: None,
            identities: Arc::default(),
            fingerprint: None,
        }
    }

    /// What the blocks' bytes mean, when the engine describes them itself (kvbm-vllm's fleet
    /// tier: vLLM's `OffloadingConfig`, model, dtype, layout, parallel shape and vLLM's own
    /// parts). Every subject, G3 journal, G4 path and data-plane request is scoped by it.
    /// Default: [`KvbmConfig::fingerprint`](kvbm_engine::config::KvbmConfig::fingerprint) of
    /// `[model]` and the geometry. In process only: worker ranks describe their own blocks.
    pub fn fingerprint(mut self, fingerprint: kvbm_physical::ModelFingerprint) -> Self {
        self.fingerprint = Some(fingerprint);
        self
    }

    /// The digests this instance knows itself, from its own keys (an inference engine's block
    /// hashes). A block pulled from a peer, read from G3 or G4 must carry the same (a peer
    /// naming another is refused and counted) and is registered with this one, so what G3
    /// and G4 headers record is never a peer's choice. Default: none known (a pulled block
    /// keeps the digest its frame names, bound to its hash).
    pub fn identities(mut self, identities: Arc<Identities>) -> Self {
        self.identities = identities;
        self
    }

    /// This member's security (a credential and the trust root). Default: built from
    /// `[security]` ([`Security::from_config`]); without credentials there, off.
    pub fn security(mut self, security: Security) -> Self {
        self.security = Some(security);
        self
    }

    /// Its id. Default: derived from the process id and the data-plane port.
    pub fn id(mut self, id: InstanceId) -> Self {
        self.id = Some(id);
        self
    }

    /// The block geometry (layers, page size, ...; the number of blocks is taken from
    /// `[tiers]` per tier). Required.
    pub fn geometry(mut self, layout: BlockLayout) -> Self {
        self.geometry = Some(layout);
        self
    }

    /// Whether a short lookup asks the G4 bucket itself (one header read per object) for
    /// blocks no event told of. Default: true.
    pub fn presence_check(mut self, on: bool) -> Self {
        self.presence_check = on;
        self
    }

    /// Pinning of the host G1/G2 layouts. Default: unpinned.
    pub fn pin(mut self, pin: PinPolicy) -> Self {
        self.pin = pin;
        self
    }

    /// Builds the tiers (`stack::TierSet::build`, see the [module docs](self)), starts the data
    /// plane, connects NATS, and starts publishing, following and the presence protocol.
    /// Returns once every subscription is in place. With worker processes, instead of the
    /// tiers' layouts and the data plane: waits for every rank to join, checks their layouts,
    /// and builds the managers and the moves through the ranks (see `ranks.rs`); returns once
    /// every rank is in step.
    ///
    /// # Errors
    /// [`EngineError::Config`] naming the key: no geometry (`instance.geometry`),
    /// `tiers.g1_blocks`/`tiers.g2_blocks` of 0, `transport.nats_url` unset, G3 without
    /// `physical.disk`, G4 without `physical.s3` (or `physical.object_dir`);
    /// [`EngineError::Stack`] naming the step when G3's file or journal, or G4's store, cannot
    /// be created, opened, reached or listed; [`EngineError::Physical`] /
    /// [`EngineError::Offload`] when a layout or mover cannot be set up;
    /// [`EngineError::DataPlane`] when the address cannot be bound; [`EngineError::Nats`] when
    /// the server cannot be reached; [`EngineError::ShutDown`] after shutdown. With worker
    /// processes (`[workers] mode = "processes"`): [`EngineError::RanksMissing`] naming the
    /// ranks not in step within `workers.join_timeout_ms`; [`EngineError::Config`] naming
    /// `tiers.g1_blocks`..`tiers.g3_blocks` or `instance.geometry` and the rank whose layouts
    /// do not fit; [`EngineError::Control`] when a rank cannot be described.
    pub async fn build(self) -> Result<Instance> {
        let rt = self.runtime;
        let config = rt.config().clone();
        let geometry = self.geometry.ok_or_else(|| {
            EngineError::config("instance.geometry", "a block geometry is required")
        })?;
        let tiers = &config.tiers;
        if tiers.g1_blocks == 0 {
            return Err(EngineError::config(
                "tiers.g1_blocks",
                "must be > 0 for an instance (onboarding needs G1)",
            ));
        }
        if tiers.g2_blocks == 0 {
            return Err(EngineError::config(
                "tiers.g2_blocks",
                "must be > 0 for an instance (staging and the data plane need G2)",
            ));
        }
        let url = config.transport.nats_url.clone().ok_or_else(|| {
            EngineError::config("transport.nats_url", "must be set for an instance")
        })?;
        // Every subject this instance speaks on (events, heartbeats, snapshots) is scoped by its
        // model fingerprint, as its G3 journal and G4 paths are (`stack::TierSet::build` derives
        // the same one): peers of another fingerprint are never heard, so their blocks are
        // never indexed, matched or pulled; and the data plane folds it into the geometry
        // value of every request and frame, so a pull across fingerprints is refused anyway.
        let fingerprint = match self.fingerprint {
            Some(_) if config.workers.mode == WorkersMode::Processes => {
                return Err(EngineError::config(
                    "workers.mode",
                    "an engine-described fingerprint needs the ranks in this process (worker \
                     processes derive theirs from [model])",
                ));
            }
            Some(f) => f,
            None => config.fingerprint(geometry.config())?,
        };
        let subject = format!("{}.{}", config.events.subject, fingerprint.key_segment());
        let dp_config = DataPlaneConfig {
            payload_mac: config.security.dataplane_payload_mac,
            scope: fingerprint.short(),
            ..DataPlaneConfig::from_transport(&config.transport)?
        };
        let security = Arc::new(match self.security {
            Some(s) => s,
            // A `{instance}` in the credential path names this instance's file when its id is
            // given (one configuration for several instances).
            None => Security::from_config(&match self.id {
                Some(id) => config.security.for_instance(id),
                None => config.security.clone(),
            })?,
        });
        // No cluster runs without credentials unless the operator says so (loopback too).
        security.require_for(
            config.security.insecure,
            [dp_config.bind.to_string().as_str(), url.as_str()],
        )?;
        // ... nor uses a NATS server off loopback without NATS credentials.
        config
            .transport
            .nats_auth
            .require_for(&url, config.security.insecure)?;
        let id = match security.signer() {
            // With a credential, the instance is the one its certificate names.
            Some(signer) => {
                let cert = signer.cert();
                if cert.role != SecurityRole::Leader {
                    return Err(EngineError::config(
                        "security.credential_file",
                        format!("an instance needs a leader's credential, got a {cert}"),
                    ));
                }
                if let Some(asked) = self.id.filter(|i| *i != cert.instance) {
                    return Err(EngineError::config(
                        "security.credential_file",
                        format!("the credential is for {}, not {asked}", cert.instance),
                    ));
                }
                cert.instance
            }
            None => self.id.unwrap_or_else(default_id),
        };

        let cancel = rt.shutdown_token().child_token();
        // Until the instance is built, an error stops whatever was started so far.
        let started = cancel.clone().drop_guard();
        let (client, epoch) = crate::transport::nats::connect_observed_with(
            &url,
            &config.transport.nats_auth,
            &format!("kvbm-{id}"),
            Duration::from_millis(config.transport.heartbeat_interval_ms.clamp(10, 1000)),
        )
        .await?;
        let bus = NatsBus::start_secured(
            &rt,
            cancel.clone(),
            client.clone(),
            subject.clone(),
            config.events.channel_capacity,
            security.clone(),
        )
        .await?;
        // Each peer's share bounded by what one snapshot of it may carry.
        let index = Arc::new(CrossInstanceIndex::with_cap(
            config.transport.snapshot_max_entries,
        ));
        // Subscribed now, so nothing published after this returns is missed; applied by the
        // presence protocol's follower (which skips departed peers).
        let events = crate::pubsub::EventBus::subscribe(&*bus);
        let own = Arc::new(CrossInstanceIndex::new());
        let publisher = if config.events.enabled {
            Some(EventPublisher::spawn_until(
                &rt,
                cancel.clone(),
                id,
                bus.clone(),
            )?)
        } else {
            None
        };
        let sink = Arc::new(OwnEvents {
            instance: id,
            own: own.clone(),
            publisher: publisher.clone(),
        });
        let (leader, memory, this) = match config.workers.mode {
            WorkersMode::InProcess => {
                let (leader, here) = Here::build(HerePlan {
                    config: &config,
                    rt: &rt,
                    id,
                    geometry,
                    pin: self.pin,
                    sink,
                    index: index.clone(),
                    dp_config,
                    security: security.clone(),
                    identities: self.identities.clone(),
                    fingerprint,
                })
                .await?;
                let this = PeerInfo {
                    worker: WorkerAddress::new(id, 0),
                    tiers: [TierId::G2, TierId::G3, TierId::G4]
                        .into_iter()
                        .filter(|t| leader.has_tier(*t))
                        .collect(),
                    num_blocks: tiers.g2_blocks,
                    block_bytes: here.g2_layout.layout().config().block_bytes(),
                    // What peers dial: the advertised address (its port 0 the bound one),
                    // else the bound address.
                    data_plane: Some(crate::dataplane::advertised(
                        config.transport.data_plane_advertise.as_deref(),
                        here.server.local_addr(),
                    )?),
                };
                (leader, Memory::Here(Box::new(here)), this)
            }
            WorkersMode::Processes => {
                // The ranks' G2 is served to peers only when every rank serves the rank plane
                // (`Ranks::start` decides: without it, G2 events are not published, so no peer
                // is sent to a G2 it cannot pull from). G4 is the shared bucket: its events
                // are (peers of this fingerprint, so of this rank count, read the same objects
                // through their own ranks).
                let sinks = TierSinks {
                    g2: Some(sink.clone() as Arc<dyn EventSink>),
                    g3: Some(sink.clone() as Arc<dyn EventSink>),
                    g4: Some(sink.clone() as Arc<dyn EventSink>),
                };
                let remote = RemoteSearch {
                    index: index.clone(),
                    this: id,
                    shared_g4: true,
                    remote_g2: true,
                };
                let ranks = Ranks::start(
                    &config,
                    &rt,
                    id,
                    &geometry,
                    &client,
                    security.clone(),
                    sinks,
                    remote,
                    ranks::Sharing {
                        subject: subject.clone(),
                        identities: self.identities.clone(),
                    },
                    &cancel,
                )
                .await?;
                let leader = ranks.tiers.leader.clone();
                let lends = ranks.pull.is_some();
                let this = PeerInfo {
                    worker: WorkerAddress::new(id, 0),
                    tiers: [TierId::G2, TierId::G3, TierId::G4]
                        .into_iter()
                        .filter(|t| leader.has_tier(*t) && (*t != TierId::G2 || lends))
                        .collect(),
                    num_blocks: tiers.g2_blocks,
                    block_bytes: ranks.block_bytes,
                    data_plane: None,
                };
                (leader, Memory::Ranks(Box::new(ranks)), this)
            }
        };
        let peers = match &memory {
            Memory::Here(h) => h.peers.clone(),
            Memory::Ranks(_) => Arc::new(PeerDirectory::new()),
        };
        let presence = Presence::start_secured(
            &rt,
            cancel.clone(),
            client,
            epoch,
            &subject,
            PresenceConfig::from_transport(&config.transport),
            this,
            index.clone(),
            own.clone(),
            peers.clone(),
            security.clone(),
        )
        .await?;
        presence.follow(&rt, cancel.clone(), events)?;
        started.disarm();
        Ok(Instance {
            id,
            runtime: rt,
            cancel,
            leader,
            memory,
            peers,
            index,
            own,
            bus,
            publisher,
            presence,
            presence_check: self.presence_check,
            counters: Counters::default(),
            security,
        })
    }
}

/// What [`Here::build`] builds from.
struct HerePlan<'a> {
    config: &'a KvbmConfig,
    rt: &'a RuntimeHandle,
    id: InstanceId,
    geometry: BlockLayout,
    pin: PinPolicy,
    sink: Arc<OwnEvents>,
    index: Arc<CrossInstanceIndex>,
    dp_config: DataPlaneConfig,
    security: Arc<Security>,
    identities: Arc<Identities>,
    fingerprint: kvbm_physical::ModelFingerprint,
}

impl Here {
    /// The tiers in this process, as every composition builds them (`stack::TierSet::build`):
    /// layouts on one transfer manager, managers on one registry publishing through the sink,
    /// the G3 journal (warm restart), the G4 listing, the leader, the checked movers; the
    /// lanes; and the data plane over G2.
    async fn build(plan: HerePlan<'_>) -> Result<(InstanceLeader, Here)> {
        let HerePlan {
            config,
            rt,
            id,
            geometry,
            pin,
            sink,
            index,
            dp_config,
            security,
            identities,
            fingerprint,
        } = plan;
        let shared_g4 = config.tiers.g4_blocks > 0;
        let mut built = TierSet::build(TierSetPlan {
            config,
            runtime: rt,
            shape: Box::new(move |n: usize| -> Result<BlockLayout> {
                Ok(BlockLayout::builder()
                    .config(*geometry.config())
                    .kind(geometry.kind())
                    .num_blocks(n.max(1))
                    .build()?)
            }),
            pin: [pin, pin],
            sinks: TierSinks::all(sink),
            contents: None,
            identities: identities.clone(),
            remote: Some(RemoteSearch {
                index: index.clone(),
                this: id,
                shared_g4,
                remote_g2: true,
            }),
            fingerprint: Some(fingerprint),
        })
        .await?;
        let leader = built
            .take_leader()
            .ok_or(EngineError::TierMissing(TierId::G2))?;
        let movers = built
            .take_movers()
            .ok_or(EngineError::TierMissing(TierId::G2))?;
        let (g2, g2_layout) = match built.g2() {
            Some((m, l)) => (m.clone(), l.clone()),
            None => return Err(EngineError::TierMissing(TierId::G2)),
        };
        let g3_lane = {
            let _guard = rt.tokio().enter();
            built.g2_to_g3_lane(&config.offload.g2_to_g3)?
        };
        let g4 = match built.g4_storage() {
            None => None,
            Some(storage) => {
                let pipeline = {
                    let _guard = rt.tokio().enter();
                    built.g2_to_g4_lane(&config.offload.g2_to_g4, Some(id.to_string()), None)?
                };
                pipeline.map(|pipeline| G4Side {
                    checker: S3PresenceChecker::new(storage.clone()),
                    pipeline,
                })
            }
        };

        let server = {
            // Started on the runtime's tokio (its tasks live there, whoever polls `build`).
            let start = DataPlaneServer::start_secured(
                dp_config.clone(),
                id,
                g2.clone(),
                g2_layout.clone(),
                security.clone(),
            );
            rt.spawn(start)?.await.map_err(|e| {
                EngineError::data_plane(dp_config.bind.to_string(), format!("start task: {e}"))
            })??
        };
        let peers = Arc::new(PeerDirectory::new());
        let client = Arc::new(
            DataPlaneClient::new_secured(
                dp_config,
                g2.clone(),
                g2_layout.clone(),
                peers.clone(),
                security,
            )?
            .with_identities(identities)
            .with_index(index),
        );
        Ok((
            leader,
            Here {
                tiers: built,
                movers,
                g2_layout,
                g3_lane,
                g4,
                server,
                client,
                peers,
            },
        ))
    }
}

/// One outcome per block in request order, from the per-block slots a call filled; a slot
/// nothing filled (a move that answered fewer outcomes than blocks) is a failure, so no block
/// goes missing from the answer.
fn in_order(
    slots: Vec<Option<kvbm_offload::mover::MoveOutcome<G2>>>,
) -> Vec<kvbm_offload::mover::MoveOutcome<G2>> {
    slots
        .into_iter()
        .map(|o| {
            o.unwrap_or_else(|| {
                Err(kvbm_offload::BlockFailure::new(
                    kvbm_offload::BlockFailureKind::ExecutorAborted,
                    "the move reported no outcome for this block",
                ))
            })
        })
        .collect()
}

/// A process-unique id: the process id and the time, mixed.
fn default_id() -> InstanceId {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    let mixed = xxhash_rust::xxh3::xxh3_64(
        &[
            u64::from(std::process::id()).to_le_bytes(),
            nanos.to_le_bytes(),
            n.to_le_bytes(),
        ]
        .concat(),
    );
    InstanceId(mixed)
}

/// What the instance adds to its G4: the bucket presence check and the G2→G4 lane.
struct G4Side {
    checker: S3PresenceChecker,
    pipeline: ObjectPipeline,
}

/// One kvbm instance: see the [module docs](self). Dropping it stops its tasks (event
/// forwarding, NATS bus, presence, data plane; peers then expire it after their heartbeat
/// timeout); [`shutdown`](Self::shutdown) also tells them first. The runtime keeps running.
pub struct Instance {
    id: InstanceId,
    runtime: RuntimeHandle,
    cancel: CancellationToken,
    leader: InstanceLeader,
    /// Where the blocks' bytes are: this process, or its worker ranks' processes.
    memory: Memory,
    peers: Arc<PeerDirectory>,
    index: Arc<CrossInstanceIndex>,
    own: Arc<CrossInstanceIndex>,
    bus: Arc<NatsBus>,
    publisher: Option<Arc<EventPublisher>>,
    presence: Presence,
    presence_check: bool,
    counters: Counters,
    security: Arc<Security>,
}

/// Where an instance's blocks' bytes are (`workers.mode`), and how they move.
enum Memory {
    /// `in_process`: this process's layouts, the data plane over its G2.
    Here(Box<Here>),
    /// `processes`: the worker ranks' processes (see [`ranks`]).
    Ranks(Box<Ranks>),
}

/// The tiers of an instance whose one rank is its own process.
struct Here {
    /// Every tier, built as the stack builds them (the leader and movers taken out).
    tiers: TierSet,
    movers: TierMovers,
    g2_layout: Arc<PhysicalLayout>,
    /// The G2→G3 lane (with G3).
    g3_lane: Option<Pipeline<G2>>,
    g4: Option<G4Side>,
    server: DataPlaneServer,
    client: Arc<DataPlaneClient>,
    peers: Arc<PeerDirectory>,
}

impl std::fmt::Debug for Instance {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Instance")
            .field("id", &self.id)
            .field("data_plane", &self.data_plane().map(|s| s.local_addr()))
            .field("stats", &self.stats())
            .finish_non_exhaustive()
    }
}

/// Synthetic block content for `hash`: what a replay or test "computes" in place of real KV
/// values, so any instance can tell whether a block it received holds exactly the bytes the
/// computing instance wrote (bytes differ per hash and per offset).
pub fn synthetic_block(hash: SequenceHash, buf: &mut [u8]) {
    let seed = xxhash_rust::xxh3::xxh3_64(hash.to_string().as_bytes());
    let mut x = seed | 1;
    for chunk in buf.chunks_mut(8) {
        // xorshift64: cheap, deterministic, every byte depends on the seed.
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let b = x.to_le_bytes();
        chunk.copy_from_slice(&b[..chunk.len()]);
    }
}

/// Reads the bytes of `block` of a host `layout`, in layer order.
fn read_host(layout: &PhysicalLayout, block: usize) -> Vec<u8> {
    let layers = layout.layout().config().num_layers;
    let mut out = Vec::with_capacity(layout.layout().config().block_bytes());
    for (addr, len) in layout.block_addrs(block, 0..layers) {
        // SAFETY: host memory owned by the layout (alive for `&layout`); callers read only
        // registered (immutable) blocks, which nothing writes.
        out.extend_from_slice(unsafe { std::slice::from_raw_parts(addr as *const u8, len) });
    }
    out
}

impl Instance {
    /// A builder on `runtime`.
    pub fn builder(runtime: &RuntimeHandle) -> InstanceBuilder {
        InstanceBuilder::new(runtime)
    }

    /// Its id.
    pub fn id(&self) -> InstanceId {
        self.id
    }

    /// This member's security: its signer and verifier, or off.
    pub fn security(&self) -> &Arc<Security> {
        &self.security
    }

    /// The runtime it runs on.
    pub fn runtime(&self) -> &RuntimeHandle {
        &self.runtime
    }

    /// Its leader (tiers, search, sessions).
    pub fn leader(&self) -> &InstanceLeader {
        &self.leader
    }

    /// Its data-plane server (address, counters); none when its worker ranks are processes
    /// (`workers.mode = "processes"`: each rank serves its own slices, the rank plane).
    pub fn data_plane(&self) -> Option<&DataPlaneServer> {
        match &self.memory {
            Memory::Here(h) => Some(&h.server),
            Memory::Ranks(_) => None,
        }
    }

    /// Its data-plane client's counters and idle pool (deadlines exceeded, pool evictions);
    /// none when its worker ranks are processes (it pulls nothing from peers).
    pub fn data_plane_client_stats(&self) -> Option<crate::dataplane::ClientStats> {
        match &self.memory {
            Memory::Here(h) => Some(h.client.stats()),
            Memory::Ranks(_) => None,
        }
    }

    /// Its worker ranks when they are processes (`workers.mode = "processes"`): every rank's
    /// control (in rank order), as the instance drives them; none in process.
    pub fn workers(&self) -> Option<&Arc<ControlledWorkers>> {
        match &self.memory {
            Memory::Here(_) => None,
            Memory::Ranks(r) => Some(&r.workers),
        }
    }

    /// With worker processes that serve the rank plane: the counters of the leases it lent
    /// peers (`lending.rs`); none otherwise.
    pub fn lender_stats(&self) -> Option<&Arc<LenderStats>> {
        match &self.memory {
            Memory::Here(_) => None,
            Memory::Ranks(r) => r.lender.as_ref(),
        }
    }

    /// Its view of its worker ranks when they are processes (who joined, was lost, restarted;
    /// [`Membership::events`], [`Membership::wait_for`]); none in process.
    pub fn membership(&self) -> Option<&Membership> {
        match &self.memory {
            Memory::Here(_) => None,
            Memory::Ranks(r) => Some(&r.membership),
        }
    }

    /// Where peers' data planes listen, as their heartbeats say.
    pub fn peers(&self) -> &Arc<PeerDirectory> {
        &self.peers
    }

    /// Where blocks live across instances, as events and snapshots say.
    pub fn index(&self) -> &Arc<CrossInstanceIndex> {
        &self.index
    }

    /// What this instance itself stores, per its own events (what it answers snapshots
    /// from).
    pub fn own_index(&self) -> &Arc<CrossInstanceIndex> {
        &self.own
    }

    /// The NATS event bus (its counters: sent, dropped, received, rejected).
    pub fn bus(&self) -> &Arc<NatsBus> {
        &self.bus
    }

    /// The event publisher (batches queued and dropped), when events are enabled.
    pub fn publisher(&self) -> Option<&Arc<EventPublisher>> {
        self.publisher.as_ref()
    }

    /// The model fingerprint every key and subject of this instance is scoped by (see
    /// [`KvbmConfig::fingerprint`](kvbm_engine::config::KvbmConfig::fingerprint)).
    pub fn fingerprint(&self) -> kvbm_physical::ModelFingerprint {
        match &self.memory {
            Memory::Here(h) => h.tiers.fingerprint(),
            Memory::Ranks(r) => r.tiers.fingerprint,
        }
    }

    /// The NATS subject its events go out on: `events.subject` scoped by the fingerprint
    /// (`<events.subject>.fp-<hex>`); heartbeats and snapshots live under it.
    pub fn events_subject(&self) -> &str {
        self.bus.subject()
    }

    /// The presence protocol (live peers, expiry, resyncs).
    pub fn presence(&self) -> &Presence {
        &self.presence
    }

    /// Its counters.
    pub fn stats(&self) -> InstanceStats {
        let c = &self.counters;
        let l = |a: &AtomicU64| a.load(Ordering::Relaxed);
        InstanceStats {
            lookups: l(&c.lookups),
            local_g2_blocks: l(&c.local_g2),
            local_g3_blocks: l(&c.local_g3),
            g4_blocks: l(&c.g4),
            remote_g2_blocks: l(&c.remote_g2),
            onboarded_blocks: l(&c.onboarded),
            refused_blocks: l(&c.refused),
            recomputed_blocks: l(&c.recomputed),
            computed_blocks: l(&c.computed),
            offloaded_g3_blocks: l(&c.offloaded_g3),
            offloaded_g4_blocks: l(&c.offloaded_g4),
            presence_adopted_blocks: l(&c.presence_adopted),
        }
    }

    /// Bytes of one block.
    pub fn block_bytes(&self) -> usize {
        match &self.memory {
            Memory::Here(h) => h.g2_layout.layout().config().block_bytes(),
            Memory::Ranks(r) => r.block_bytes,
        }
    }

    /// This instance's G2 manager and layout, when its blocks' bytes are in this process (not
    /// with worker processes): what an engine face copies into and out of (kvbm-vllm's fleet
    /// tier, [`crate::fleet`]).
    pub fn g2_here(&self) -> Option<(&Arc<BlockManager<G2>>, &Arc<PhysicalLayout>)> {
        match &self.memory {
            Memory::Here(h) => self.leader.g2().map(|g2| (g2, &h.g2_layout)),
            Memory::Ranks(_) => None,
        }
    }

    /// Pulls `hashes` from `peer`'s G2 into this instance's G2 over the data plane: one outcome
    /// per block, in order, each block registered (its stored event published) only if its
    /// frame verified (identity, binding, geometry, length, checksum). A block this instance
    /// already holds is not pulled again: its outcome is the held block.
    ///
    /// # Errors
    /// [`EngineError::Config`] (key `workers.mode`) with worker processes (their G2 is not
    /// served or pulled); [`EngineError::Logical`] when G2 has no room for the blocks.
    pub async fn pull_g2(
        &self,
        peer: InstanceId,
        hashes: &[SequenceHash],
    ) -> Result<Vec<kvbm_offload::mover::MoveOutcome<G2>>> {
        let Memory::Here(here) = &self.memory else {
            return Err(EngineError::config(
                "workers.mode",
                "worker processes neither serve nor pull G2 over the data plane",
            ));
        };
        let g2 = self
            .leader
            .g2()
            .ok_or(EngineError::TierMissing(TierId::G2))?;
        let mut out: Vec<Option<kvbm_offload::mover::MoveOutcome<G2>>> =
            hashes.iter().map(|_| None).collect();
        let mut wanted = Vec::new();
        for (i, h) in hashes.iter().enumerate() {
            match g2.match_blocks(std::slice::from_ref(h)).pop() {
                Some(b) => out[i] = Some(Ok(b)),
                None => wanted.push(i),
            }
        }
        if !wanted.is_empty() {
            let pull: Vec<SequenceHash> = wanted.iter().map(|&i| hashes[i]).collect();
            let destinations = g2.allocate_blocks(pull.len())?;
            let pulled = kvbm_engine::cross_instance::RemotePull::pull(
                &*here.client,
                peer,
                &pull,
                destinations,
            )
            .await;
            for (i, o) in wanted.into_iter().zip(pulled) {
                out[i] = Some(o);
            }
        }
        Ok(in_order(out))
    }

    /// Stages this instance's G3 copies of `hashes` into its G2 through the checked G3→G2 move
    /// (the disk header, the journal's checksum of the block as written, its identity): one
    /// outcome per block, in order, each registered in G2 only if its read verified. A block
    /// already in G2 is not read again (its outcome is the held block); one in neither tier
    /// fails as not found. A copy a read proves bad is dropped from G3 (and its journal) before
    /// the next stage or onboarding, as [`onboard`](Self::onboard) does.
    ///
    /// # Errors
    /// [`EngineError::Config`] (key `workers.mode`) with worker processes;
    /// [`EngineError::TierMissing`] without G3; [`EngineError::Logical`] when G2 has no room.
    pub async fn stage_g3(
        &self,
        hashes: &[SequenceHash],
    ) -> Result<Vec<kvbm_offload::mover::MoveOutcome<G2>>> {
        let Memory::Here(here) = &self.memory else {
            return Err(EngineError::config(
                "workers.mode",
                "stage_g3 moves this process's G3 into its G2; worker ranks hold their own",
            ));
        };
        let (g2, g3) = (
            self.leader
                .g2()
                .ok_or(EngineError::TierMissing(TierId::G2))?,
            self.leader
                .g3()
                .ok_or(EngineError::TierMissing(TierId::G3))?,
        );
        let mover = here
            .movers
            .g3_to_g2()
            .ok_or(EngineError::TierMissing(TierId::G3))?;
        here.tiers.discard_rejected();
        let mut out: Vec<Option<kvbm_offload::mover::MoveOutcome<G2>>> =
            hashes.iter().map(|_| None).collect();
        let (mut sources, mut wanted) = (Vec::new(), Vec::new());
        for (i, h) in hashes.iter().enumerate() {
            let one = std::slice::from_ref(h);
            if let Some(b) = g2.match_blocks(one).pop() {
                out[i] = Some(Ok(b));
            } else if let Some(b) = g3.match_blocks(one).pop() {
                sources.push(b);
                wanted.push(i);
            } else {
                out[i] = Some(Err(kvbm_offload::BlockFailure::new(
                    kvbm_offload::BlockFailureKind::NotFound,
                    format!("block {:032x} is in neither G2 nor G3", h.as_u128()),
                )));
            }
        }
        if !sources.is_empty() {
            let destinations = g2.allocate_blocks(sources.len())?;
            let moved = mover.move_blocks(&sources, destinations).await;
            for (i, o) in wanted.into_iter().zip(moved) {
                out[i] = Some(o);
            }
        }
        // The movers note failed hashes for a caller that recomputes from them; the outcomes
        // above say it instead.
        here.tiers.forget_failed();
        Ok(in_order(out))
    }

    /// The G1 manager (where onboarded blocks land).
    fn g1(&self) -> &Arc<BlockManager<G1>> {
        match &self.memory {
            Memory::Here(h) => h.tiers.g1().0,
            Memory::Ranks(r) => &r.tiers.g1,
        }
    }

    /// The G4 presence check: the bucket's (in process), every rank's directory of it (worker
    /// processes); none without G4.
    fn g4_checker(&self) -> Option<&dyn PresenceChecker> {
        match &self.memory {
            Memory::Here(h) => h.g4.as_ref().map(|g4| &g4.checker as &dyn PresenceChecker),
            Memory::Ranks(r) => r.g4_checker(),
        }
    }

    /// With worker processes: every rank in step, or the first one's error (a call then fails
    /// before anything is held or moved). In process: always.
    fn ranks_in_step(&self) -> Result<()> {
        match &self.memory {
            Memory::Here(_) => Ok(()),
            Memory::Ranks(r) => Ok(r.in_step()?),
        }
    }

    /// The bytes of an onboarded G1 block; `None` when `block` is not one of this instance's
    /// G1 blocks (its id would name another layout's slot), or when its worker ranks are
    /// processes (each rank holds its own bytes: ask them, e.g. a `ControlRequest::Digest`
    /// through [`workers`](Self::workers)), or in GPU memory (`physical.g1 = "device"`: the
    /// host cannot read it in place).
    pub fn read_g1(&self, block: &ImmutableBlock<G1>) -> Option<Vec<u8>> {
        let Memory::Here(h) = &self.memory else {
            return None;
        };
        let (g1, layout) = h.tiers.g1();
        let on_host = layout.storage_kind() == kvbm_physical::StorageKind::Host;
        (on_host && g1.holds(block)).then(|| read_host(layout, block.block_id()))
    }

    /// Computes `hashes` into G2: each block not already in G2 gets the bytes `fill(hash,
    /// buffer)` writes, and is registered (its stored event published). Returns how many were
    /// computed (those already present are skipped).
    ///
    /// # Errors
    /// [`EngineError::Logical`] when G2 has no room; [`EngineError::Config`] (key
    /// `workers.mode`) when the worker ranks are processes: their G2 is theirs to write (the
    /// caller allocates blocks from [`leader`](Self::leader)'s G2, has every rank write those
    /// slots, and registers them).
    pub fn compute(
        &self,
        hashes: &[SequenceHash],
        fill: &(dyn Fn(SequenceHash, &mut [u8]) + Send + Sync),
    ) -> Result<usize> {
        let Memory::Here(here) = &self.memory else {
            return Err(EngineError::config(
                "workers.mode",
                "compute writes G2 in this process; with worker processes each rank writes its own G2 slots (allocate from leader().g2(), have the ranks write them, register)",
            ));
        };
        let g2 = self
            .leader
            .g2()
            .ok_or(EngineError::TierMissing(TierId::G2))?;
        let missing: Vec<SequenceHash> = hashes
            .iter()
            .filter(|h| g2.match_blocks(std::slice::from_ref(*h)).is_empty())
            .copied()
            .collect();
        if missing.is_empty() {
            return Ok(0);
        }
        let blocks = g2.allocate_blocks(missing.len())?;
        let layers = here.g2_layout.layout().config().num_layers;
        let mut buf = vec![0u8; self.block_bytes()];
        let mut complete = Vec::with_capacity(missing.len());
        for (b, h) in blocks.into_iter().zip(&missing) {
            fill(*h, &mut buf);
            let mut at = 0;
            for (addr, len) in here.g2_layout.block_addrs(b.block_id(), 0..layers) {
                // SAFETY: host memory of the G2 layout; the block is mutable (allocated here,
                // not registered), so nothing else reads or writes its slot.
                unsafe {
                    std::ptr::copy_nonoverlapping(buf[at..at + len].as_ptr(), addr as *mut u8, len)
                };
                at += len;
            }
            complete.push(b.complete(*h).map_err(|e| {
                EngineError::config("instance.compute", format!("block refused: {e}"))
            })?);
        }
        let n = complete.len();
        drop(g2.register_blocks(complete));
        self.counters
            .computed
            .fetch_add(n as u64, Ordering::Relaxed);
        Ok(n)
    }

    /// Writes the G2-resident blocks of the prefix `hashes` to this instance's G3 through the
    /// G2→G3 lane (`[offload.g2_to_g3]`; blocks already in G3 are filtered out) and waits
    /// until they settled. Each written block is listed in G3's journal with its checksum, so
    /// it is served from G3 (every read checked) by this instance and by the next one started
    /// on the same file; G3's manager publishes its stored event. Returns how many were
    /// written.
    ///
    /// With worker processes, every rank writes its G2 copies to its own G3 file through
    /// the ranks (`SpmdMover`); with `workers.g3_journal` this process lists which block each
    /// slot holds (a restarted instance starts G3 warm), else G3 starts cold.
    ///
    /// # Errors
    /// [`EngineError::TierMissing`] without G3; [`EngineError::Offload`] when the lane refused
    /// the batch; with worker processes, [`EngineError::Control`] when a rank is not in step
    /// (nothing moved), [`EngineError::Stack`] naming the first failed block when a rank could
    /// not write it (the others are written and counted).
    pub async fn offload_g3(&self, hashes: &[SequenceHash]) -> Result<usize> {
        match &self.memory {
            Memory::Here(h) => {
                let lane = h
                    .g3_lane
                    .as_ref()
                    .ok_or(EngineError::TierMissing(TierId::G3))?;
                self.offload_through(lane, hashes, &self.counters.offloaded_g3)
                    .await
            }
            Memory::Ranks(r) => {
                let down = r
                    .g2_to_g3
                    .as_ref()
                    .ok_or(EngineError::TierMissing(TierId::G3))?;
                r.offload(
                    down,
                    hashes,
                    &self.counters.offloaded_g3,
                    r.g3_journal.as_ref(),
                )
                .await
            }
        }
    }

    /// Writes the G2-resident blocks of the prefix `hashes` to the shared G4 bucket (the
    /// offload crate's object pipeline: checksummed, identity-bound objects) and records them
    /// in G4, which publishes their stored events. Returns how many were written.
    ///
    /// With worker processes, every rank writes its slice of each block to its own directory
    /// of the bucket through the ranks (`SpmdMover`, blocks already in G4 skipped); a block is
    /// recorded (and its event published) only when every rank wrote it.
    ///
    /// # Errors
    /// [`EngineError::TierMissing`] without G4; [`EngineError::Offload`] when the pipeline
    /// refused the batch; with worker processes, as [`offload_g3`](Self::offload_g3).
    pub async fn offload_g4(&self, hashes: &[SequenceHash]) -> Result<usize> {
        match &self.memory {
            Memory::Here(h) => {
                let g4 = h.g4.as_ref().ok_or(EngineError::TierMissing(TierId::G4))?;
                self.offload_through(g4.pipeline.pipeline(), hashes, &self.counters.offloaded_g4)
                    .await
            }
            Memory::Ranks(r) => {
                let down = r
                    .g2_to_g4
                    .as_ref()
                    .ok_or(EngineError::TierMissing(TierId::G4))?;
                r.offload(down, hashes, &self.counters.offloaded_g4, None)
                    .await
            }
        }
    }

    /// Enqueues the G2-resident blocks of `hashes` on `lane`, waits until they settled and
    /// counts the written ones on `written`.
    async fn offload_through(
        &self,
        lane: &Pipeline<G2>,
        hashes: &[SequenceHash],
        written: &AtomicU64,
    ) -> Result<usize> {
        let g2 = self
            .leader
            .g2()
            .ok_or(EngineError::TierMissing(TierId::G2))?;
        let blocks = g2.match_blocks(hashes);
        if blocks.is_empty() {
            return Ok(0);
        }
        let result = lane.enqueue(blocks, None).await?.wait().await?;
        let n = result.completed_blocks.len();
        written.fetch_add(n as u64, Ordering::Relaxed);
        Ok(n)
    }

    /// Where the longest prefix of `hashes` is, here or elsewhere, without moving anything
    /// ([`Onboarded`] with no blocks; no G4 presence check). Other instances' shared-G4 blocks
    /// found through the index are recorded in this instance's G4 as a side effect (as any
    /// search does).
    pub fn lookup(&self, hashes: &[SequenceHash]) -> Onboarded {
        let matched = self.leader.find_matches(hashes);
        Onboarded {
            local_g2: matched.count(TierId::G2),
            local_g3: matched.count(TierId::G3),
            g4: matched.count(TierId::G4),
            remote_g2: matched.remote().map(|r| (r.instance, r.hashes.len())),
            ..Onboarded::default()
        }
    }

    /// Finds the longest prefix of `hashes` here or elsewhere, stages and pulls it, and
    /// onboards it to G1 (see the [module docs](self)). A verification failure is not an
    /// error: [`Onboarded::refused`] says how many blocks failed and why, and nothing of them
    /// is served or registered.
    ///
    /// With worker processes, a rank lost mid-session fails the session (refused, nothing
    /// served); one that is not in step when the call starts fails the call.
    ///
    /// # Errors
    /// [`EngineError::Logical`] when G1 has no room for the prefix;
    /// [`EngineError::Session`] for a session call in a wrong state; with worker processes,
    /// [`EngineError::Control`] (`ControlError::NotJoined` or `ControlError::Rejoining`,
    /// naming the rank) when a rank is not in step: nothing is held, moved or served.
    pub async fn onboard(&self, hashes: &[SequenceHash]) -> Result<Onboarded> {
        self.ranks_in_step()?;
        self.counters.lookups.fetch_add(1, Ordering::Relaxed);
        // Copies a tier rejected on an earlier read leave it before this search.
        let h = match &self.memory {
            Memory::Ranks(r) => {
                r.discard_rejected();
                return self.onboard_matched(hashes).await;
            }
            Memory::Here(h) => h,
        };
        h.tiers.discard_rejected();
        let out = self.onboard_matched(hashes).await;
        // The movers record failed hashes for a caller that recomputes from the first one;
        // an instance reports refusals through the session instead, so nothing reads them.
        h.tiers.forget_failed();
        out
    }

    async fn onboard_matched(&self, hashes: &[SequenceHash]) -> Result<Onboarded> {
        let mut matched = self.leader.find_matches(hashes);
        if matched.len() < hashes.len()
            && self.presence_check
            && let Some(checker) = self.g4_checker()
        {
            drop(matched);
            match self.leader.adopt_present_g4(hashes, checker).await {
                Ok(n) => {
                    self.counters
                        .presence_adopted
                        .fetch_add(n as u64, Ordering::Relaxed);
                }
                Err(e) => tracing::warn!(error = %e, "G4 presence check failed"),
            }
            matched = self.leader.find_matches(hashes);
        }
        let mut out = Onboarded {
            local_g2: matched.count(TierId::G2),
            local_g3: matched.count(TierId::G3),
            g4: matched.count(TierId::G4),
            remote_g2: matched.remote().map(|r| (r.instance, r.hashes.len())),
            ..Onboarded::default()
        };
        let n = matched.len();
        if n == 0 {
            return Ok(out);
        }
        let session = kvbm_engine::leader::OnboardingSession::new(matched);
        let (movers, g2_to_g1): (MoversToG2, Arc<dyn BlockMove<G2, G1>>) = match &self.memory {
            Memory::Here(h) => (
                MoversToG2 {
                    g3_to_g2: h.movers.g3_to_g2(),
                    g4_to_g2: h.movers.g4_to_g2(),
                    remote_g2: Some(h.client.clone()),
                },
                h.movers.g2_to_g1(),
            ),
            Memory::Ranks(r) => (
                MoversToG2 {
                    g3_to_g2: r.g3_to_g2.clone().map(|m| m as Arc<dyn BlockMove<G3, G2>>),
                    g4_to_g2: r.g4_to_g2.clone().map(|m| m as Arc<dyn BlockMove<G4, G2>>),
                    remote_g2: r
                        .pull
                        .clone()
                        .map(|p| p as Arc<dyn kvbm_engine::cross_instance::RemotePull>),
                },
                r.g2_to_g1.clone(),
            ),
        };
        let refused = |out: &mut Onboarded, e: SessionError| -> Result<()> {
            match e {
                SessionError::Failed(f) => {
                    self.counters
                        .refused
                        .fetch_add(f.failed_blocks as u64, Ordering::Relaxed);
                    metrics::counter!(kvbm_engine::metrics::REFUSED_BLOCKS)
                        .increment(f.failed_blocks as u64);
                    out.refused = Some((f.failed_blocks, f.message));
                    Ok(())
                }
                e => Err(EngineError::Session(e)),
            }
        };
        if let Err(e) = session.prepare(movers).await {
            refused(&mut out, e)?;
            return Ok(out);
        }
        let destinations = self.g1().allocate_blocks(n)?;
        if let Err(e) = session.onboard(g2_to_g1, destinations).await {
            refused(&mut out, e)?;
            return Ok(out);
        }
        match session.finish() {
            FinishOutcome::Finished(blocks) => {
                let c = &self.counters;
                c.local_g2.fetch_add(out.local_g2 as u64, Ordering::Relaxed);
                c.local_g3.fetch_add(out.local_g3 as u64, Ordering::Relaxed);
                c.g4.fetch_add(out.g4 as u64, Ordering::Relaxed);
                c.remote_g2
                    .fetch_add(out.remote_g2.map_or(0, |r| r.1) as u64, Ordering::Relaxed);
                c.onboarded
                    .fetch_add(blocks.len() as u64, Ordering::Relaxed);
                out.blocks = blocks;
                Ok(out)
            }
            FinishOutcome::Failed(f) => {
                refused(&mut out, SessionError::Failed(f))?;
                Ok(out)
            }
            other => Err(EngineError::Session(SessionError::Destinations(format!(
                "session ended {other:?}"
            )))),
        }
    }

    /// [`onboard`](Self::onboard); when that refused blocks, computes the prefix's blocks
    /// that are not in G2 ([`compute`](Self::compute), counted as recomputed) and onboards
    /// again, now from local G2. Returns both results (the second only after a refusal).
    ///
    /// # Errors
    /// As [`onboard`](Self::onboard) and [`compute`](Self::compute).
    pub async fn onboard_or_compute(
        &self,
        hashes: &[SequenceHash],
        fill: &(dyn Fn(SequenceHash, &mut [u8]) + Send + Sync),
    ) -> Result<(Onboarded, Option<Onboarded>)> {
        let first = self.onboard(hashes).await?;
        if first.refused.is_none() {
            return Ok((first, None));
        }
        let n = self.compute(hashes, fill)?;
        self.counters
            .recomputed
            .fetch_add(n as u64, Ordering::Relaxed);
        let second = self.onboard(hashes).await?;
        Ok((first, Some(second)))
    }

    /// Tells peers this instance leaves, then stops its tasks and data plane. Idempotent.
    pub async fn shutdown(&self) {
        if !self.cancel.is_cancelled() {
            self.presence.depart().await;
        }
        self.cancel.cancel();
        if let Memory::Here(h) = &self.memory {
            h.server.shutdown();
            if let Some(lane) = &h.g3_lane {
                lane.shutdown();
            }
            if let Some(g4) = &h.g4 {
                g4.pipeline.pipeline().shutdown();
            }
        }
    }
}

/// Compile-time check: callers may spawn these futures.
#[cfg(test)]
fn _futures_are_send(b: InstanceBuilder, i: &Instance, h: &[SequenceHash]) {
    fn send<T: Send>(_: T) {}
    send(b.build());
    send(i.onboard(h));
    send(i.onboard_or_compute(h, &synthetic_block));
    send(i.offload_g3(h));
    send(i.offload_g4(h));
    send(i.shutdown());
}

impl Drop for Instance {
    fn drop(&mut self) {
        self.cancel.cancel();
        if let Memory::Here(h) = &self.memory {
            h.server.shutdown();
        }
    }
}
