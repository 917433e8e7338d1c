//! [`TierManagers`]: the logical side of an instance's tiers, built once from `[tiers]`: one
//! block manager per tier with blocks, on one registry, each publishing its events to its sink
//! and flushed by the runtime's timer, and the leader over G2..G4.
//!
//! Every composition gets its managers here: the tier set
//! ([`TierSet::build`](crate::stack::TierSet::build), which then lays out the bytes each
//! manager's slots name), an instance whose ranks hold the bytes
//! ([`RankTiers::build`](crate::stack::RankTiers::build)), and
//! [`InstanceLeader::from_config`](crate::InstanceLeader::from_config). So `tiers.g1_blocks` ..
//! `tiers.g4_blocks` (and the rule that G3 and G4 need G2) are read in one place; the storage
//! builders read only where the bytes live (`g3_of`, `open_g4_storage`), and size the layouts
//! from the managers.

use std::sync::Arc;

use kvbm_logical::{
    BlockManager, BlockRegistry, EventSink, G1, G2, G3, G4, LogicalConfig, SequenceHash, Tier,
};

use super::{InstanceLeader, RemoteSearch};
use crate::KvbmConfig;
use crate::error::{Context, EngineError, Result};
use crate::runtime::{EventSource, RuntimeHandle};

/// Where each lower tier's block manager publishes its stored/removed events (none: not
/// published). G1 publishes nothing.
#[derive(Default, Clone)]
pub struct TierSinks {
    /// G2's sink.
    pub g2: Option<Arc<dyn EventSink>>,
    /// G3's sink.
    pub g3: Option<Arc<dyn EventSink>>,
    /// G4's sink.
    pub g4: Option<Arc<dyn EventSink>>,
}

impl TierSinks {
    /// The same sink for G2, G3 and G4.
    pub fn all(sink: Arc<dyn EventSink>) -> Self {
        TierSinks {
            g2: Some(sink.clone()),
            g3: Some(sink.clone()),
            g4: Some(sink),
        }
    }
}

/// One block manager per tier with blocks in `[tiers]`, on one registry, and the leader over
/// them: the one builder of managers, which the tier set, an instance's ranks
/// ([`RankTiers`](crate::stack::RankTiers)) and [`InstanceLeader::from_config`] all call, so the
/// sizes in `[tiers]` (and the rule that G3 and G4 need G2) are read in one place.
pub struct TierManagers {
    /// The registry every manager shares.
    pub registry: BlockRegistry,
    /// G1's bookkeeping (with `tiers.g1_blocks`).
    pub g1: Option<Arc<BlockManager<G1>>>,
    /// G2's (with `tiers.g2_blocks`).
    pub g2: Option<Arc<BlockManager<G2>>>,
    /// G3's (with `tiers.g3_blocks`).
    pub g3: Option<Arc<BlockManager<G3>>>,
    /// G4's presence index (with `tiers.g4_blocks`), room for `tiers.g4_blocks` more than the
    /// blocks listed at start, which are registered.
    pub g4: Option<Arc<BlockManager<G4>>>,
    /// How many of the listed blocks G4 registered.
    pub g4_warm: usize,
}

impl TierManagers {
    /// The managers of `cfg`'s `[tiers]` (their settings from `[logical]`), G2..G4 publishing to
    /// `sinks`, G4 holding `g4_listed` (every block object its storage listed at start).
    ///
    /// # Errors
    /// [`EngineError::Config`] naming `tiers.g2_blocks` when G3 or G4 has blocks and G2 none
    /// (blocks move to and from them through host memory); [`EngineError::Stack`] when a
    /// manager rejects its settings.
    pub fn build(cfg: &KvbmConfig, sinks: TierSinks, g4_listed: &[SequenceHash]) -> Result<Self> {
        let t = &cfg.tiers;
        if t.g2_blocks == 0 && (t.g3_blocks > 0 || t.g4_blocks > 0) {
            return Err(EngineError::config(
                "tiers.g2_blocks",
                "G3 and G4 need G2: blocks move to and from them through host memory (must be > 0)",
            ));
        }
        let registry = BlockRegistry::with_config(&cfg.logical.registry);
        let l = &cfg.logical;
        let g4 = manager::<G4>(
            if t.g4_blocks > 0 {
                t.g4_blocks + g4_listed.len()
            } else {
                0
            },
            &registry,
            l,
            sinks.g4,
        )?;
        let g4_warm = match &g4 {
            Some(m) => register_listed(m, g4_listed)?,
            None => 0,
        };
        Ok(TierManagers {
            g1: manager::<G1>(t.g1_blocks, &registry, l, None)?,
            g2: manager::<G2>(t.g2_blocks, &registry, l, sinks.g2)?,
            g3: manager::<G3>(t.g3_blocks, &registry, l, sinks.g3)?,
            g4,
            g4_warm,
            registry,
        })
    }

    /// Puts every manager under `runtime`'s event-flush timer (a partial batch of events is
    /// published within the flush interval).
    pub fn flush_events_with(&self, runtime: &RuntimeHandle) {
        let sources: [Option<Arc<dyn EventSource>>; 4] = [
            self.g1.clone().map(|m| m as Arc<dyn EventSource>),
            self.g2.clone().map(|m| m as Arc<dyn EventSource>),
            self.g3.clone().map(|m| m as Arc<dyn EventSource>),
            self.g4.clone().map(|m| m as Arc<dyn EventSource>),
        ];
        for s in sources.iter().flatten() {
            runtime.register_event_source(s);
        }
    }

    /// The leader over G2, G3 and G4, searching in `[leader]`'s order (and beyond, through
    /// `remote`); none without G2.
    ///
    /// # Errors
    /// [`EngineError::Stack`] when the leader rejects its settings (`leader.search`).
    pub fn leader(
        &self,
        cfg: &KvbmConfig,
        remote: Option<RemoteSearch>,
    ) -> Result<Option<InstanceLeader>> {
        let Some(g2) = &self.g2 else {
            return Ok(None);
        };
        let mut builder = InstanceLeader::builder()
            .g2(g2.clone())
            .search(cfg.leader.search.clone());
        if let Some(g3) = &self.g3 {
            builder = builder.g3(g3.clone());
        }
        if let Some(g4) = &self.g4 {
            builder = builder.g4(g4.clone());
        }
        if let Some(r) = remote {
            builder = builder.remote(r);
        }
        Ok(Some(
            builder
                .build()
                .context("cannot build the instance leader")?,
        ))
    }
}

/// A manager of `n` blocks (none for 0) on `registry`, publishing to `sink`.
fn manager<T: Tier>(
    n: usize,
    registry: &BlockRegistry,
    logical: &LogicalConfig,
    sink: Option<Arc<dyn EventSink>>,
) -> Result<Option<Arc<BlockManager<T>>>> {
    if n == 0 {
        return Ok(None);
    }
    let mut builder = BlockManager::<T>::builder()
        .config(logical.clone())
        .block_count(n)
        .registry(registry.clone());
    if let Some(sink) = sink {
        builder = builder.event_sink(sink);
    }
    Ok(Some(Arc::new(builder.build().with_context(|| {
        format!("cannot build the {} block manager", T::ID)
    })?)))
}

/// Registers `listed` in G4 (present at start); returns how many were.
fn register_listed(manager: &BlockManager<G4>, listed: &[SequenceHash]) -> Result<usize> {
    let mut complete = Vec::with_capacity(listed.len());
    for (blk, h) in manager
        .allocate_blocks(listed.len())?
        .into_iter()
        .zip(listed)
    {
        if let Ok(c) = blk.complete(*h) {
            complete.push(c);
        }
    }
    Ok(manager.register_blocks(complete).len())
}
