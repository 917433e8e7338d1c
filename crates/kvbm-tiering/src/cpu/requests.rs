//! `Requests`: the CPU manager's per-request access records, found by context without a
//! string hash on every call, and recycled.
//!
//! # Why
//!
//! vLLM's scheduler calls the manager for one request at a time: its `lookup` of each chunk,
//! then `prepare_load`/`prepare_store`, then `on_request_finished`. Every one of those calls
//! (and a promotion's one-key store, once per promoted chunk) reads or updates the request's
//! record. Keyed by request id alone, each call hashed the id string and probed a map, and each
//! new request grew its key map from empty, a rehash at 4, 8, 16, 32, 64 keys. Here:
//!
//! - the records sit in a slab, the id map points into it, and the last record used is
//!   remembered with its context's unique id: the next call for the same context (nearly
//!   every call) goes straight to it;
//! - a finished request's record is cleared and kept for the next new request, its key map's
//!   and order's capacity with it (a bounded number of them, small ones only).
//!
//! # Invariants
//!
//! - `by_id[id] = i` exactly when `slab[i]` is live (its `ctx_uid` is not [`FREE`]) and was
//!   started for request `id`; a freed slot is on `free` and nowhere else.
//! - `last = (uid, i)` is a hint: it is used only when `slab[i].ctx_uid == uid`. A context's
//!   uid is unique (a process-wide counter), and one context has one request id, so a live
//!   slot with that uid is that context's record; a freed or reused slot fails the check.
//! - A record handed out by [`Requests::take`] is no longer reachable here; [`Requests::recycle`]
//!   clears it before keeping it, so no key or flag of a finished request reaches another.

use std::sync::Arc as StdArc;

use hashbrown::{HashMap, HashTable, hash_table};

use crate::key::{KeyHasher, OffloadKey};
use crate::types::ReqContext;

/// The uid of a free slab slot (context uids count from 1 and never reach it).
const FREE: u64 = u64::MAX;

/// Cleared records kept for new requests, at most.
const MAX_SPARE: usize = 64;
/// A record whose key map grew past this many keys is dropped rather than kept (a long
/// prompt's map would otherwise hold its memory for every later short request).
const MAX_SPARE_KEYS: usize = 4096;

/// One request's accesses (vLLM 0.33's per-request bookkeeping; see the manager's docs).
///
/// A key's flags sit in a hash table whose bucket a call can keep: after
/// [`reserve(n)`](Self::reserve), the next `n` new keys do not grow the table, so the
/// [`place`](Self::place)s found for them and for the keys already there stay where they are
/// until a key beyond the reserved room is added. `prepare_store` finds each key's place once
/// and reaches its flags through it in every later pass (store misses, accesses, insertions).
#[derive(Default)]
pub(crate) struct RequestAccess {
    pub(crate) ctx_uid: u64,
    /// Keys in first-seen order.
    pub(crate) order: Vec<OffloadKey>,
    /// Keys this request's calls pinned or stored, with the slot each had then, in call order
    /// (`prepare_load`'s pins, `prepare_store`'s new slots): hints that spare a later call of
    /// the same request (`complete_load`, `on_request_finished`) a probe of the slot index,
    /// each used only while the slot still holds its key
    /// (`CpuOffloadingManager::hinted_slot`).
    pub(crate) known: Vec<(OffloadKey, u32)>,
    /// `(key, SEEN | INSERTED | REUSED | STORE_MISS)`; a key not here has no flags.
    flags: HashTable<(OffloadKey, u8)>,
    hasher: KeyHasher,
    /// LRU request rank (positional recency).
    pub(crate) req_rank: Option<u64>,
}

impl RequestAccess {
    fn restart(&mut self, uid: u64) {
        self.ctx_uid = uid;
        self.order.clear();
        self.known.clear();
        self.flags.clear();
        self.req_rank = None;
    }

    /// `k`'s entry, made with no flags when it has none (one probe).
    #[inline]
    fn entry(&mut self, k: OffloadKey) -> hash_table::OccupiedEntry<'_, (OffloadKey, u8)> {
        let hasher = &self.hasher;
        self.flags
            .entry(hasher.hash(&k), |e| e.0 == k, |e| hasher.hash(&e.0))
            .or_insert((k, 0))
    }

    /// `k`'s flags, made empty when it has none (one probe).
    #[inline]
    pub(crate) fn flags_mut(&mut self, k: OffloadKey) -> &mut u8 {
        &mut self.entry(k).into_mut().1
    }

    /// `k`'s flags (none when it has none).
    #[inline]
    pub(crate) fn flags_of(&self, k: &OffloadKey) -> u8 {
        self.flags
            .find(self.hasher.hash(k), |e| e.0 == *k)
            .map_or(0, |e| e.1)
    }

    /// Sets `bits` in `k`'s flags.
    #[inline]
    pub(crate) fn set(&mut self, k: OffloadKey, bits: u8) {
        *self.flags_mut(k) |= bits;
    }

    /// Room for `n` more keys without growing the table (see the type's docs).
    pub(crate) fn reserve(&mut self, n: usize) {
        let hasher = &self.hasher;
        self.flags.reserve(n, |e| hasher.hash(&e.0));
    }

    /// `k`'s place (its flags made empty when it has none), valid while the table does not
    /// grow: after [`reserve`](Self::reserve) for it and the other new keys of the call.
    #[inline]
    pub(crate) fn place(&mut self, k: OffloadKey) -> usize {
        self.entry(k).bucket_index()
    }

    /// The flags at a [`place`](Self::place) found in this call.
    ///
    /// # Panics
    /// When the place is stale (the table grew past the reserved room since): a bug in the
    /// caller, never a wrong key's flags.
    #[inline]
    pub(crate) fn at(&mut self, place: usize) -> &mut u8 {
        &mut self
            .flags
            .get_bucket_mut(place)
            .expect("a place found in this call, with room reserved for its keys")
            .1
    }

    /// Keys with flags.
    #[cfg(test)]
    pub(crate) fn num_flagged(&self) -> usize {
        self.flags.len()
    }
}

/// The live records by request id, plus the spare ones (see the [module docs](self)).
#[derive(Default)]
pub(crate) struct Requests {
    by_id: HashMap<StdArc<str>, u32>,
    slab: Vec<RequestAccess>,
    free: Vec<u32>,
    spare: Vec<RequestAccess>,
    last: (u64, u32),
}

impl Requests {
    /// The remembered slot, when it is `ctx`'s live record (see the invariants).
    #[inline]
    fn last_hit(&self, ctx: &ReqContext) -> Option<u32> {
        let (uid, i) = self.last;
        (uid == ctx.uid() && self.slab.get(i as usize).is_some_and(|r| r.ctx_uid == uid))
            .then_some(i)
    }

    /// The slab slot of `ctx`'s live record, if it has one.
    #[inline]
    fn find(&self, ctx: &ReqContext) -> Option<u32> {
        if let Some(i) = self.last_hit(ctx) {
            return Some(i);
        }
        let &i = self.by_id.get(ctx.req_id())?;
        (self.slab[i as usize].ctx_uid == ctx.uid()).then_some(i)
    }

    /// `ctx`'s record, started (empty) when the request has none, or restarted when the one
    /// it has belongs to another context of the same id (vLLM keys its state by request id
    /// and a new context replaces the old one's).
    pub(crate) fn access(&mut self, ctx: &ReqContext) -> &mut RequestAccess {
        if let Some(i) = self.last_hit(ctx) {
            return &mut self.slab[i as usize];
        }
        let uid = ctx.uid();
        let i = match self.by_id.get(ctx.req_id()) {
            Some(&i) => {
                let r = &mut self.slab[i as usize];
                if r.ctx_uid != uid {
                    r.restart(uid);
                }
                i
            }
            None => {
                let mut r = self.spare.pop().unwrap_or_default();
                r.restart(uid);
                let i = match self.free.pop() {
                    Some(i) => {
                        self.slab[i as usize] = r;
                        i
                    }
                    None => {
                        self.slab.push(r);
                        (self.slab.len() - 1) as u32
                    }
                };
                self.by_id.insert(ctx.req_id_arc().clone(), i);
                i
            }
        };
        self.last = (uid, i);
        &mut self.slab[i as usize]
    }

    /// `ctx`'s record, when it has a live one (started by this very context).
    pub(crate) fn get(&self, ctx: &ReqContext) -> Option<&RequestAccess> {
        self.find(ctx).map(|i| &self.slab[i as usize])
    }

    /// Ends `ctx`'s record and hands it over (`None`: the request has none, or its record
    /// belongs to another context of the same id). Give it back with [`recycle`](Self::recycle).
    pub(crate) fn take(&mut self, ctx: &ReqContext) -> Option<RequestAccess> {
        let i = self.find(ctx)?;
        self.by_id.remove(ctx.req_id());
        let mut r = std::mem::take(&mut self.slab[i as usize]);
        self.slab[i as usize].ctx_uid = FREE;
        self.free.push(i);
        r.ctx_uid = FREE;
        Some(r)
    }

    /// Keeps a finished record's allocations for a later request (cleared now), within the
    /// bounds of the [module docs](self).
    pub(crate) fn recycle(&mut self, mut r: RequestAccess) {
        if self.spare.len() < MAX_SPARE
            && r.flags.capacity() <= MAX_SPARE_KEYS
            && r.known.capacity() <= MAX_SPARE_KEYS
        {
            r.restart(FREE);
            self.spare.push(r);
        }
    }

    /// Forgets every record (`reset_cache`).
    pub(crate) fn clear(&mut self) {
        self.by_id.clear();
        self.slab.clear();
        self.free.clear();
        self.last = (FREE, 0);
    }

    /// Live records.
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.by_id.len()
    }
}

#[cfg(test)]
mod tests;
