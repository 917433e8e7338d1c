//! `DirectDiskManager`: the scheduler half of the direct disk path (see the module docs of
//! [`direct`](super)): vLLM's manager contract over the disk's slots, the journal kept true.

use std::sync::Arc;

use hashbrown::HashMap;
use kvbm_physical::BlockIdentity;
use kvbm_physical::storage::journal::JournalRecord;

use super::{DirectDisk, key_identity};
use crate::cpu::{CpuManagerConfig, CpuOffloadingManager};
use crate::error::Result;
use crate::key::OffloadKey;
use crate::stats::OffloadingConnectorStats;
use crate::types::{
    LoadStoreSpec, LookupResult, Medium, OffloadingEvent, PrepareStoreOutput, ReqContext,
    RequestOffloadingContext,
};

/// vLLM's `OffloadingManager` for the direct disk path: [`CpuOffloadingManager`]'s bookkeeping
/// with disk slots as its chunk ids, the journal unlisting a slot before it is handed out again,
/// restored chunks adopted by the first lookup of their key.
pub struct DirectDiskManager {
    inner: CpuOffloadingManager,
    disk: Arc<DirectDisk>,
    /// Restored chunks no lookup has named yet: the slot by identity, and back.
    restored: HashMap<BlockIdentity, u32>,
    restored_at: HashMap<u32, BlockIdentity>,
    /// Keys that failed verification while pinned by another load: discarded once idle.
    to_discard: Vec<OffloadKey>,
}

impl std::fmt::Debug for DirectDiskManager {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DirectDiskManager")
            .field("disk", &self.disk)
            .field("resident", &self.inner.len())
            .field("restored", &self.restored.len())
            .finish()
    }
}

impl DirectDiskManager {
    /// A manager of `disk`'s slots with `config`'s policy, events and contract (its
    /// `num_chunks` and medium are the disk's), holding the chunks the journal listed.
    pub fn new(disk: Arc<DirectDisk>, config: CpuManagerConfig) -> Result<Self> {
        let config = CpuManagerConfig {
            num_chunks: disk.config().capacity,
            medium: Medium::Storage,
            ..config
        };
        let mut inner = CpuOffloadingManager::new(config);
        let listed = disk.take_restored();
        let slots: Vec<u32> = listed.iter().map(|&(s, _)| s).collect();
        inner.hold_slots(&slots)?;
        let restored: HashMap<BlockIdentity, u32> = listed.iter().map(|&(s, id)| (id, s)).collect();
        let restored_at = listed.into_iter().collect();
        Ok(Self {
            inner,
            disk,
            restored,
            restored_at,
            to_discard: Vec::new(),
        })
    }

    /// The disk it manages.
    pub fn disk(&self) -> &Arc<DirectDisk> {
        &self.disk
    }

    /// The slot table and policy (tests, invariants, gauges).
    pub fn slots(&self) -> &CpuOffloadingManager {
        &self.inner
    }

    /// Restored chunks not yet adopted by a lookup.
    pub fn num_restored(&self) -> usize {
        self.restored.len()
    }

    /// vLLM's `lookup`: the slot table's answer, or, for a key it does not know, a restored
    /// chunk carrying the key's digest, adopted (a `HIT`).
    pub fn lookup(&mut self, key: &OffloadKey, ctx: &ReqContext) -> LookupResult {
        let r = self.inner.lookup(key, ctx);
        if r == LookupResult::Miss && self.adopt_restored(key) {
            self.inner.lookup(key, ctx)
        } else {
            r
        }
    }

    /// Whether `key`, unknown to the slot table, has a restored chunk, now adopted (ready).
    fn adopt_restored(&mut self, key: &OffloadKey) -> bool {
        if self.restored.is_empty() {
            return false;
        }
        let Some(slot) = self.restored.remove(&key_identity(key)) else {
            return false;
        };
        self.restored_at.remove(&slot);
        self.inner.adopt_held(key, slot)
    }

    /// vLLM's `prepare_load`: the keys' slots, pinned until `complete_load`.
    pub fn prepare_load(&mut self, keys: &[OffloadKey], ctx: &ReqContext) -> Result<Vec<u32>> {
        let spec = self.inner.prepare_load(keys, ctx)?;
        Ok(slot_ids(&spec))
    }

    /// vLLM's `complete_load`; then keys whose reads failed verification are forgotten (a
    /// second read of them would fail the same way).
    pub fn complete_load(&mut self, keys: &[OffloadKey], ctx: &ReqContext) -> Result<()> {
        self.inner.complete_load(keys, ctx)?;
        self.discard_bad();
        Ok(())
    }

    fn discard_bad(&mut self) {
        let mut bad = self.disk.take_bad();
        bad.append(&mut self.to_discard);
        for k in bad {
            match self.inner.chunk(&k) {
                Some((_, 0)) => {
                    // Unlisted: the slot's bytes are not the key's. If that fails it stays
                    // listed: a restart holds it again and every read of it fails verification
                    // again (never served); said, not hidden.
                    if let Some(slot) = self.inner.discard(&k)
                        && let Err(e) = self
                            .disk
                            .journal()
                            .record(&[JournalRecord::Removed { slot: slot as u64 }])
                    {
                        tracing::warn!(slot, error = %e, "direct disk: unlisting a bad copy failed");
                    }
                }
                Some((_, n)) if n > 0 => self.to_discard.push(k),
                // Gone already, or stored again since (a new write): nothing to forget.
                _ => {}
            }
        }
    }

    /// vLLM's `prepare_store`: slots for the keys not yet stored (a key with a restored chunk
    /// adopts it; restored chunks nobody asked for give way first, then the policy's victims).
    /// `None`, having changed nothing, where there is no room. No journal work here (the
    /// scheduler's thread): a slot handed out stays listed under its old chunk, whose bytes
    /// are intact, until the worker unlists it just before writing it.
    ///
    /// # Errors
    /// The manager's contract (see [`CpuOffloadingManager::prepare_store`]).
    pub fn prepare_store(
        &mut self,
        keys: &[OffloadKey],
        ctx: &ReqContext,
    ) -> Result<Option<(PrepareStoreOutput, Vec<u32>)>> {
        if !self.restored_at.is_empty() {
            // A key whose chunk was restored is stored already: adopted, not written again
            // (and never left behind as a second, older copy under the same key).
            for k in keys {
                if self.inner.chunk(k).is_none() {
                    self.adopt_restored(k);
                }
            }
            let new = keys
                .iter()
                .filter(|k| self.inner.chunk(k).is_none())
                .count();
            let short = new.saturating_sub(self.inner.num_free_slots());
            if short > 0 {
                for s in self.inner.release_held(short) {
                    if let Some(id) = self.restored_at.remove(&s) {
                        self.restored.remove(&id);
                    }
                }
            }
        }
        let Some(out) = self.inner.prepare_store(keys, ctx)? else {
            return Ok(None);
        };
        let slots = slot_ids(&out.store_spec);
        Ok(Some((out, slots)))
    }

    /// vLLM's `complete_store`: the keys become loadable, or, for a failed store, are forgotten
    /// and their slots unlisted (the worker may have listed some before another chunk failed).
    pub fn complete_store(
        &mut self,
        keys: &[OffloadKey],
        ctx: &ReqContext,
        success: bool,
    ) -> Result<()> {
        if !success {
            let unlist: Vec<JournalRecord> = keys
                .iter()
                .filter_map(|k| match self.inner.chunk(k) {
                    Some((s, -1)) => Some(JournalRecord::Removed { slot: s as u64 }),
                    _ => None,
                })
                .collect();
            if !unlist.is_empty() {
                self.disk.journal().record(&unlist)?;
            }
        }
        self.inner.complete_store(keys, ctx, success)
    }

    /// vLLM's `on_new_request`.
    pub fn on_new_request(&mut self, ctx: &ReqContext) -> Result<RequestOffloadingContext> {
        self.inner.on_new_request(ctx)
    }

    /// vLLM's `on_request_finished`.
    pub fn on_request_finished(&mut self, ctx: &ReqContext) -> Result<()> {
        self.inner.on_request_finished(ctx)
    }

    /// vLLM's `take_events` (medium `STORAGE`).
    pub fn take_events(&mut self) -> Vec<OffloadingEvent> {
        self.inner.take_events()
    }

    /// vLLM's `get_stats`.
    pub fn get_stats(&mut self) -> Option<OffloadingConnectorStats> {
        self.inner.get_stats()
    }

    /// Chunks being written.
    pub fn has_pending_work(&self) -> bool {
        self.inner.num_write_pending() > 0
    }

    /// vLLM's `reset_cache`: every chunk forgotten, the journal emptied (restored chunks too).
    pub fn reset_cache(&mut self) -> Result<()> {
        self.inner.reset_cache()?;
        self.restored.clear();
        self.restored_at.clear();
        self.to_discard.clear();
        let unlist: Vec<JournalRecord> = self
            .disk
            .journal()
            .entries()
            .into_iter()
            .map(|e| JournalRecord::Removed { slot: e.slot })
            .collect();
        if !unlist.is_empty() {
            self.disk.journal().record(&unlist)?;
        }
        Ok(())
    }

    /// Flushes the file and the journal to stable storage.
    pub fn shutdown(&mut self) -> Result<()> {
        self.disk.sync()
    }
}

fn slot_ids(spec: &LoadStoreSpec) -> Vec<u32> {
    spec.chunk_ids()
        .map(|ids| ids.iter().map(|&s| s as u32).collect())
        .unwrap_or_default()
}
