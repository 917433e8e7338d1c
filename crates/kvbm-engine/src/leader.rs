//! [`InstanceLeader`]: the process that owns block metadata and decides placement.
//!
//! # What is built
//!
//! The leader owns one logical [`BlockManager`] per configured lower tier (G2 pinned host, G3
//! disk, G4 objects), all sharing one [`BlockRegistry`] so presence and frequency are seen
//! across tiers. [`InstanceLeader::find_matches`] answers "how much of this sequence do we
//! already have, and where" and **holds** the answer (a [`MatchedPrefix`]) so none of it can
//! be evicted while the caller stages and onboards it.
//!
//! # Search
//!
//! ```text
//!  hashes:  h0 h1 h2 h3 h4 h5 h6
//!  G2:      h0 h1 .. (stops at the first miss)
//!  G3:            h2 h3 ..        (searched from where G2 stopped)
//!  G4:                  h4 ..     (from where G3 stopped)
//!  prefix = [h0 h1 | h2 h3 | h4], runs G2:2, G3:2, G4:1; h5 missing everywhere ends it
//! ```
//!
//! Each tier in [`LeaderConfig::search`](crate::config::LeaderConfig::search) order (default
//! G2, G3, G4; unconfigured tiers skipped) extends the prefix from where the previous tier
//! stopped, with that tier's contiguous `match_blocks`. A block present in an earlier tier
//! *after* a later tier took over is not used from the earlier tier (one run per tier, like
//! upstream's search); it is still correct, since the later tier holds the same bytes.
//! With a [`RemoteSearch`] the search continues past the local tiers into other instances
//! (shared G4, then another instance's G2): see [`remote`].
//!
//! # Locks
//!
//! The leader takes no lock of its own: each `match_blocks` takes its manager's store lock once
//! (then the registry's shard locks, per `kvbm-logical`'s order) and releases it before the next
//! tier is searched, so no two tiers' locks are ever held together.

pub mod accessor;
mod holder;
mod managers;
pub mod policy;
pub mod remote;
pub mod session;

use std::sync::Arc;

use kvbm_logical::{
    BlockManager, BlockRegistry, EventSink, G2, G3, G4, SequenceHash, Tier, TierId,
};

pub use accessor::{BlockAccessor, RunSource, ScanRun};
pub use holder::RemoteRun;
pub use holder::{BlockHolder, MatchedPrefix, TierRun};
pub use managers::{TierManagers, TierSinks};
pub use policy::{
    AllOf, CostModel, MinRun, OnboardAll, OnboardPolicy, PrefixScan, RunKind, SourceCost,
};
pub use remote::RemoteSearch;
pub use session::{
    FinishOutcome, LayerwiseOnboard, MoversToG2, OnboardingSession, Phase, SessionError,
    SessionFailure,
};

use crate::address::InstanceId;
use crate::config::KvbmConfig;
use crate::cross_instance::CrossInstanceIndex;
use crate::error::{EngineError, Result};
use crate::runtime::{EventSource, RuntimeHandle};

/// The leader of one kvbm instance: see the [module docs](self).
#[derive(Debug, Clone)]
pub struct InstanceLeader {
    g2: Option<Arc<BlockManager<G2>>>,
    g3: Option<Arc<BlockManager<G3>>>,
    g4: Option<Arc<BlockManager<G4>>>,
    registry: BlockRegistry,
    search: Vec<TierId>,
    remote: Option<RemoteSearch>,
    policy: Arc<dyn OnboardPolicy>,
}

/// Builds an [`InstanceLeader`] from explicit managers.
#[derive(Debug, Default)]
pub struct InstanceLeaderBuilder {
    g2: Option<Arc<BlockManager<G2>>>,
    g3: Option<Arc<BlockManager<G3>>>,
    g4: Option<Arc<BlockManager<G4>>>,
    search: Option<Vec<TierId>>,
    remote: Option<RemoteSearch>,
    policy: Option<Arc<dyn OnboardPolicy>>,
}

impl InstanceLeaderBuilder {
    /// The policy [`begin_onboarding`](InstanceLeader::begin_onboarding) asks which part of
    /// a match is worth onboarding (see [`policy`]). Default: [`OnboardAll`].
    pub fn policy(mut self, policy: Arc<dyn OnboardPolicy>) -> Self {
        self.policy = Some(policy);
        self
    }

    /// Search other instances after the local tiers (see [`remote`]).
    pub fn remote(mut self, remote: RemoteSearch) -> Self {
        self.remote = Some(remote);
        self
    }

    /// Shorthand for [`remote`](Self::remote) without a shared G4: follow `index` (kept up to
    /// date by `CrossInstanceIndex::follow`, e.g. over NATS) and find other instances' G2 runs.
    pub fn remote_index(self, index: Arc<CrossInstanceIndex>, this: InstanceId) -> Self {
        self.remote(RemoteSearch {
            index,
            this,
            shared_g4: false,
            remote_g2: true,
        })
    }

    /// The G2 (pinned host) manager.
    pub fn g2(mut self, manager: Arc<BlockManager<G2>>) -> Self {
        self.g2 = Some(manager);
        self
    }

    /// The G3 (disk) manager.
    pub fn g3(mut self, manager: Arc<BlockManager<G3>>) -> Self {
        self.g3 = Some(manager);
        self
    }

    /// The G4 (object) manager.
    pub fn g4(mut self, manager: Arc<BlockManager<G4>>) -> Self {
        self.g4 = Some(manager);
        self
    }

    /// Search order. Default: G2, G3, G4 (tiers without a manager are skipped).
    pub fn search(mut self, order: Vec<TierId>) -> Self {
        self.search = Some(order);
        self
    }

    /// Checks the managers share one registry and the search order names only lower tiers,
    /// once each.
    ///
    /// # Errors
    /// [`EngineError::Config`] (key `leader.search`) for G1 or a repeated tier;
    /// [`EngineError::TierMissing`] when no tier is configured at all.
    pub fn build(self) -> Result<InstanceLeader> {
        let search = self
            .search
            .unwrap_or_else(|| vec![TierId::G2, TierId::G3, TierId::G4]);
        for (i, tier) in search.iter().enumerate() {
            if *tier == TierId::G1 {
                return Err(EngineError::config(
                    "leader.search",
                    "G1 is the inference engine's cache and cannot be searched",
                ));
            }
            if search[..i].contains(tier) {
                return Err(EngineError::config(
                    "leader.search",
                    format!("{tier} is listed twice"),
                ));
            }
        }
        let registry = self
            .g2
            .as_ref()
            .map(|m| m.registry().clone())
            .or_else(|| self.g3.as_ref().map(|m| m.registry().clone()))
            .or_else(|| self.g4.as_ref().map(|m| m.registry().clone()))
            .ok_or(EngineError::TierMissing(TierId::G2))?;
        let mut leader = InstanceLeader {
            g2: self.g2,
            g3: self.g3,
            g4: self.g4,
            registry,
            search: Vec::new(),
            remote: self.remote,
            policy: self.policy.unwrap_or_else(|| Arc::new(OnboardAll)),
        };
        leader.search = search.into_iter().filter(|t| leader.has_tier(*t)).collect();
        Ok(leader)
    }
}

impl InstanceLeader {
    /// A builder over explicit managers.
    pub fn builder() -> InstanceLeaderBuilder {
        InstanceLeaderBuilder::default()
    }

    /// Builds one manager per tier with blocks in `config.tiers`, from `config.logical`, sharing
    /// one registry, searched in `config.leader.search` order.
    ///
    /// # Errors
    /// [`EngineError::Logical`] when a manager rejects its settings; as
    /// [`InstanceLeaderBuilder::build`].
    pub fn from_config(config: &KvbmConfig) -> Result<Self> {
        Self::from_config_with_sink(config, None)
    }

    /// As [`from_config`](Self::from_config), every manager publishing its stored/removed
    /// events to `sink` (e.g. the cluster plane's `EventPublisher`).
    ///
    /// # Errors
    /// As [`from_config`](Self::from_config).
    pub fn from_config_with_sink(
        config: &KvbmConfig,
        sink: Option<Arc<dyn EventSink>>,
    ) -> Result<Self> {
        let sinks = match sink {
            Some(s) => TierSinks::all(s),
            None => TierSinks::default(),
        };
        TierManagers::build(config, sinks, &[])?
            .leader(config, None)?
            .ok_or(EngineError::TierMissing(TierId::G2))
    }

    /// As [`from_config`](Self::from_config) with the runtime's configuration, and every
    /// manager put under the runtime's event-flush timer.
    ///
    /// # Errors
    /// As [`from_config`](Self::from_config).
    pub fn from_runtime(runtime: &RuntimeHandle) -> Result<Self> {
        Self::from_runtime_with_sink(runtime, None)
    }

    /// As [`from_runtime`](Self::from_runtime), the managers publishing to `sink`; the
    /// runtime's timer then bounds how long an idle tier holds a partial batch.
    ///
    /// # Errors
    /// As [`from_config`](Self::from_config).
    pub fn from_runtime_with_sink(
        runtime: &RuntimeHandle,
        sink: Option<Arc<dyn EventSink>>,
    ) -> Result<Self> {
        let leader = Self::from_config_with_sink(runtime.config(), sink)?;
        for source in leader.event_sources() {
            runtime.register_event_source(&source);
        }
        Ok(leader)
    }

    fn event_sources(&self) -> Vec<Arc<dyn EventSource>> {
        let mut out: Vec<Arc<dyn EventSource>> = Vec::new();
        if let Some(m) = &self.g2 {
            out.push(m.clone());
        }
        if let Some(m) = &self.g3 {
            out.push(m.clone());
        }
        if let Some(m) = &self.g4 {
            out.push(m.clone());
        }
        out
    }

    /// Whether `tier` has a manager.
    pub fn has_tier(&self, tier: TierId) -> bool {
        match tier {
            TierId::G1 => false,
            TierId::G2 => self.g2.is_some(),
            TierId::G3 => self.g3.is_some(),
            TierId::G4 => self.g4.is_some(),
        }
    }

    /// The effective search order (configured tiers only).
    pub fn search_order(&self) -> &[TierId] {
        &self.search
    }

    /// The registry shared by the tiers.
    pub fn registry(&self) -> &BlockRegistry {
        &self.registry
    }

    /// The G2 manager.
    pub fn g2(&self) -> Option<&Arc<BlockManager<G2>>> {
        self.g2.as_ref()
    }

    /// A worker rank lost its memory (it restarted): every G2 block this leader placed is no
    /// longer the bytes it names on that rank, and in SPMD a block is only whole on every
    /// rank. Drops every inactive G2 block (unregistered: never matched again) and says
    /// whether G2 is now empty: `false` while blocks are still held or being filled (sessions
    /// in flight, which fail because the rank refuses their work), so the caller asks again
    /// later and brings the rank back in step only once this is `true` (the cluster plane's
    /// `Membership::keep_in_step` does).
    /// G3 and G4 are the leader's own storage and are kept.
    pub fn forget_worker_memory(&self) -> bool {
        match &self.g2 {
            None => true,
            Some(g2) => {
                let dropped = g2.reset_inactive_pool();
                if dropped > 0 {
                    tracing::warn!(
                        blocks = dropped,
                        "G2 declared empty: a worker rank lost its memory"
                    );
                }
                g2.available_blocks() == g2.total_blocks()
            }
        }
    }

    /// The G3 manager.
    pub fn g3(&self) -> Option<&Arc<BlockManager<G3>>> {
        self.g3.as_ref()
    }

    /// The G4 manager.
    pub fn g4(&self) -> Option<&Arc<BlockManager<G4>>> {
        self.g4.as_ref()
    }

    /// The longest prefix of `hashes` present across the searched tiers, held so nothing in it
    /// is evicted until the returned [`MatchedPrefix`] (or its parts) is dropped.
    pub fn find_matches(&self, hashes: &[SequenceHash]) -> MatchedPrefix {
        let mut out = MatchedPrefix {
            requested: hashes.len(),
            ..MatchedPrefix::default()
        };
        // Passes over the search order until one adds nothing: a prefix whose blocks sit in
        // G4, then G3, then G4 again (an offload still in flight to G4, say) is found whole, as
        // several runs per tier. A prefix in one tier costs one pass; a miss costs one more
        // lookup per tier at the first missing hash.
        let mut at = 0;
        loop {
            let pass_start = at;
            for &tier in &self.search {
                if at == hashes.len() {
                    break;
                }
                let rest = &hashes[at..];
                let n = match tier {
                    TierId::G2 => extend(&self.g2, rest, &mut out.g2),
                    TierId::G3 => extend(&self.g3, rest, &mut out.g3),
                    TierId::G4 => extend(&self.g4, rest, &mut out.g4),
                    TierId::G1 => 0,
                };
                if n > 0 {
                    out.runs.push(TierRun {
                        tier,
                        start: at,
                        len: n,
                    });
                    at += n;
                }
            }
            if at == pass_start || at == hashes.len() {
                break;
            }
        }
        if let Some(r) = &self.remote
            && at < hashes.len()
        {
            remote::extend(self, r, hashes, &mut out, at);
        }
        out
    }

    /// Starts searching other instances too (see [`remote`]).
    pub fn set_remote(&mut self, remote: RemoteSearch) {
        self.remote = Some(remote);
    }

    /// Searches `hashes` ([`find_matches`](Self::find_matches)), keeps the part of the match
    /// the leader's [policy](InstanceLeaderBuilder::policy) finds worth onboarding (the rest is
    /// released at once), and starts an onboarding session holding it (phase `Holding`).
    pub fn begin_onboarding(&self, hashes: &[SequenceHash]) -> OnboardingSession {
        OnboardingSession::new(self.find_matches_with(hashes, self.policy.as_ref()))
    }

    /// [`find_matches`](Self::find_matches), then cut to what `policy` selects (see
    /// [`policy`]); the blocks past the cut are released before this returns.
    pub fn find_matches_with(
        &self,
        hashes: &[SequenceHash],
        policy: &dyn OnboardPolicy,
    ) -> MatchedPrefix {
        let mut matched = self.find_matches(hashes);
        if matched.is_empty() {
            return matched;
        }
        let runs = matched.scan_runs();
        let keep = policy.select(&PrefixScan {
            runs: &runs,
            requested: hashes.len(),
        });
        if keep < matched.len() {
            matched.truncate(keep);
        }
        matched
    }

    /// The leader's onboarding policy.
    pub fn policy(&self) -> &Arc<dyn OnboardPolicy> {
        &self.policy
    }

    /// A read view of where blocks live, holding nothing (see [`accessor`]).
    pub fn accessor(&self) -> BlockAccessor<'_> {
        BlockAccessor::new(self)
    }
}

fn extend<T: Tier>(
    manager: &Option<Arc<BlockManager<T>>>,
    hashes: &[SequenceHash],
    holder: &mut BlockHolder<T>,
) -> usize {
    let Some(manager) = manager else {
        return 0;
    };
    let blocks = manager.match_blocks(hashes);
    let n = blocks.len();
    holder.extend(blocks);
    n
}

#[cfg(test)]
mod tests;
