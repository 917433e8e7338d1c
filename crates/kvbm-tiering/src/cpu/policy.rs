//! Cache policies of the CPU tier (vLLM 0.33 `cpu/policies/{lru,arc}.py`), over slot indices.
//!
//! The manager owns the key → slot map and the per-slot reference counts; a policy owns only the
//! recency order of resident slots (and, for ARC, the ghost lists of evicted keys).
//!
//! **LRU.** vLLM 0.33 keeps a logical rank per resident key (a counter bumped by insert and
//! touch, or `(request rank, -end token position)` when the scheduler recorded positions) and a
//! heap of the evictable keys; eviction takes the smallest ranks among `ref_cnt == 0`, skipping
//! the call's own keys. Here every resident slot sits in one list ordered by rank (a fresh rank is
//! always the largest, so insert/touch is a move to the back; a positional rank is placed by a
//! walk from the back), and eviction walks from the front skipping pinned, pending and protected
//! slots. The order of evictable slots is the heap's order, so victims are identical.
//!
//! **ARC.** T1 (seen once), T2 (reused), ghosts B1/B2 of evicted keys, `target_t1_size`; eviction
//! scans T1/T2 monotonically and is atomic (`None` = nothing changed); ghost lists are trimmed to
//! the capacity. Recency hooks follow 0.33: `touch` promotes ready T1 keys to T2, a not-ready T1
//! key stays in T1 at its back, ghost hits adapt the target; `on_store_miss` adapts the target;
//! `on_request_finished` moves insertion-only keys to the back of their list and reused keys to T2.

use crate::cpu::order::{LinkedKeySet, Links, List, NIL};
use crate::key::OffloadKey;

/// Which policy a CPU tier uses.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum CachePolicyKind {
    /// Least recently used.
    #[default]
    Lru,
    /// Adaptive replacement cache.
    Arc,
}

impl CachePolicyKind {
    /// Parses `lru` / `arc`.
    pub fn parse(s: &str) -> Option<Self> {
        match s.to_ascii_lowercase().as_str() {
            "lru" => Some(Self::Lru),
            "arc" => Some(Self::Arc),
            _ => None,
        }
    }
}

/// What the policy may read of the manager's slot table.
pub(crate) struct SlotView<'a> {
    pub keys: &'a [OffloadKey],
    pub ref_cnt: &'a [i32],
    pub protect: &'a [u64],
    pub stamp: u64,
}

impl SlotView<'_> {
    #[inline]
    fn evictable(&self, s: u32) -> bool {
        self.ref_cnt[s as usize] == 0 && self.protect[s as usize] != self.stamp
    }
}

/// Rank of an LRU slot: (counter or request rank, -position).
type Rank = (u64, i64);

pub(crate) struct Lru {
    links: Links,
    order: List,
    rank: Vec<Rank>,
    next_rank: u64,
}

pub(crate) struct Arc {
    capacity: usize,
    links: Links,
    t1: List,
    t2: List,
    /// 0 = none, 1 = T1, 2 = T2.
    which: Vec<u8>,
    b1: LinkedKeySet,
    b2: LinkedKeySet,
    target_t1_size: f64,
}

/// A policy instance (one per manager, so the variant size difference does not matter).
#[allow(clippy::large_enum_variant)]
pub(crate) enum Policy {
    Lru(Lru),
    Arc(Arc),
}

impl Policy {
    pub(crate) fn new(kind: CachePolicyKind, capacity: usize) -> Self {
        match kind {
            CachePolicyKind::Lru => Policy::Lru(Lru {
                links: Links::new(capacity),
                order: List::default(),
                rank: vec![(0, 0); capacity],
                next_rank: 0,
            }),
            CachePolicyKind::Arc => Policy::Arc(Arc {
                capacity,
                links: Links::new(capacity),
                t1: List::default(),
                t2: List::default(),
                which: vec![0; capacity],
                b1: LinkedKeySet::new(),
                b2: LinkedKeySet::new(),
                target_t1_size: 0.0,
            }),
        }
    }

    /// Allocates the request's LRU rank on first use (vLLM `_get_request_rank`).
    fn request_rank(lru: &mut Lru, slot: &mut Option<u64>) -> u64 {
        match slot {
            Some(r) => *r,
            None => {
                lru.next_rank += 1;
                *slot = Some(lru.next_rank);
                lru.next_rank
            }
        }
    }

    /// Places an LRU slot (not linked) by rank, ties by key bytes (the heap's tuple order).
    fn lru_place(lru: &mut Lru, keys: &[OffloadKey], s: u32) {
        let r = lru.rank[s as usize];
        let mut at = NIL; // insert before `at`
        let mut cur = lru.order.tail;
        while cur != NIL {
            let rc = lru.rank[cur as usize];
            let greater =
                rc > r || (rc == r && keys[cur as usize].as_bytes() > keys[s as usize].as_bytes());
            if !greater {
                break;
            }
            at = cur;
            cur = lru.links.prev(cur);
        }
        lru.links.insert_before(&mut lru.order, s, at);
    }

    /// A newly allocated slot (ref_cnt -1). `position` is the key's end-token position if the
    /// scheduler recorded one.
    pub(crate) fn insert(
        &mut self,
        keys: &[OffloadKey],
        s: u32,
        position: Option<u64>,
        req_rank: &mut Option<u64>,
    ) {
        match self {
            Policy::Lru(l) => match position {
                None => {
                    l.next_rank += 1;
                    l.rank[s as usize] = (l.next_rank, 0);
                    l.links.push_back(&mut l.order, s);
                }
                Some(p) => {
                    let rr = Self::request_rank(l, req_rank);
                    l.rank[s as usize] = (rr, -(p as i64));
                    Self::lru_place(l, keys, s);
                }
            },
            Policy::Arc(a) => {
                a.links.push_back(&mut a.t1, s);
                a.which[s as usize] = 1;
                let k = &keys[s as usize];
                a.b1.remove(k);
                a.b2.remove(k);
            }
        }
    }

    /// Removes a resident slot (failed write).
    pub(crate) fn remove(&mut self, s: u32) {
        match self {
            Policy::Lru(l) => l.links.unlink(&mut l.order, s),
            Policy::Arc(a) => {
                match a.which[s as usize] {
                    1 => a.links.unlink(&mut a.t1, s),
                    2 => a.links.unlink(&mut a.t2, s),
                    _ => {}
                }
                a.which[s as usize] = 0;
            }
        }
    }

    /// Touch of one key (called in reverse key order by the manager): `slot` is its resident
    /// slot, if any, and `ready` whether its ref_cnt >= 0.
    pub(crate) fn touch_one(&mut self, key: &OffloadKey, slot: Option<u32>, ready: bool) {
        match self {
            Policy::Lru(l) => {
                if let Some(s) = slot {
                    l.next_rank += 1;
                    l.rank[s as usize] = (l.next_rank, 0);
                    l.links.move_to_back(&mut l.order, s);
                }
            }
            Policy::Arc(a) => match slot {
                Some(s) if a.which[s as usize] == 1 => {
                    if ready {
                        a.links.unlink(&mut a.t1, s);
                        a.links.push_back(&mut a.t2, s);
                        a.which[s as usize] = 2;
                    } else {
                        a.links.move_to_back(&mut a.t1, s);
                    }
                }
                Some(s) => a.links.move_to_back(&mut a.t2, s),
                None => {
                    a.adapt_to_ghost_hit(key);
                }
            },
        }
    }

    /// Store misses (keys absent from the cache), in reverse order by the caller.
    pub(crate) fn on_store_miss_one(&mut self, key: &OffloadKey) {
        // LRU: `touch` of an absent key does nothing.
        if let Policy::Arc(a) = self {
            a.adapt_to_ghost_hit(key);
        }
    }

    /// New keys seen by a request (LRU: positional ranks only).
    pub(crate) fn on_request_access(
        &mut self,
        keys: &[OffloadKey],
        new_keys: &[(OffloadKey, Option<u32>, Option<u64>)],
        req_rank: &mut Option<u64>,
    ) {
        if let Policy::Lru(l) = self {
            let rr = Self::request_rank(l, req_rank);
            for &(_, slot, pos) in new_keys {
                let (Some(s), Some(p)) = (slot, pos) else {
                    continue;
                };
                let r = (rr, -(p as i64));
                if l.rank[s as usize] >= r {
                    continue;
                }
                l.rank[s as usize] = r;
                l.links.unlink(&mut l.order, s);
                Self::lru_place(l, keys, s);
            }
        }
    }

    /// Request finished: `ordered` keys (group, then position or first-seen order), with
    /// resident slot, insertion-only and reused flags. Walked in reverse.
    pub(crate) fn on_request_finished(
        &mut self,
        ordered: &[(OffloadKey, Option<u32>, bool, bool)],
    ) {
        match self {
            Policy::Lru(l) => {
                for &(_, slot, _, _) in ordered.iter().rev() {
                    if let Some(s) = slot {
                        l.next_rank += 1;
                        l.rank[s as usize] = (l.next_rank, 0);
                        l.links.move_to_back(&mut l.order, s);
                    }
                }
            }
            Policy::Arc(a) => {
                for &(_, slot, insertion_only, reused) in ordered.iter().rev() {
                    let Some(s) = slot else { continue };
                    let w = a.which[s as usize];
                    if insertion_only {
                        match w {
                            1 => a.links.move_to_back(&mut a.t1, s),
                            2 => a.links.move_to_back(&mut a.t2, s),
                            _ => {}
                        }
                        continue;
                    }
                    if reused && w == 1 {
                        a.links.unlink(&mut a.t1, s);
                        a.links.push_back(&mut a.t2, s);
                        a.which[s as usize] = 2;
                    } else if reused && w == 2 {
                        a.links.move_to_back(&mut a.t2, s);
                    }
                }
            }
        }
    }

    /// Chooses `n` victims among evictable, unprotected slots; `None` (and no change) if there
    /// are fewer. On success the victims are unlinked (ARC: their keys enter the ghost lists).
    pub(crate) fn evict(&mut self, n: usize, view: &SlotView<'_>, out: &mut Vec<u32>) -> bool {
        out.clear();
        if n == 0 {
            return true;
        }
        match self {
            Policy::Lru(l) => {
                let mut cur = l.order.head;
                while cur != NIL && out.len() < n {
                    if view.evictable(cur) {
                        out.push(cur);
                    }
                    cur = l.links.next(cur);
                }
                if out.len() < n {
                    out.clear();
                    return false;
                }
                for &s in out.iter() {
                    l.links.unlink(&mut l.order, s);
                }
                true
            }
            Policy::Arc(a) => {
                let mut from_t1: Vec<bool> = Vec::with_capacity(n);
                let mut virtual_t1 = a.t1.len as usize;
                let mut c1 = a.t1.head;
                let mut c2 = a.t2.head;
                let next = |links: &Links, c: &mut u32| -> u32 {
                    while *c != NIL {
                        let s = *c;
                        *c = links.next(s);
                        if view.evictable(s) {
                            return s;
                        }
                    }
                    NIL
                };
                for _ in 0..n {
                    let mut cand = NIL;
                    let mut t1 = false;
                    if virtual_t1 >= a.target_t1_size as usize {
                        let e = next(&a.links, &mut c1);
                        if e != NIL {
                            cand = e;
                            t1 = true;
                            virtual_t1 = virtual_t1.wrapping_sub(1);
                        }
                    }
                    if cand == NIL {
                        cand = next(&a.links, &mut c2);
                    }
                    if cand == NIL {
                        let e = next(&a.links, &mut c1);
                        if e == NIL {
                            out.clear();
                            return false;
                        }
                        cand = e;
                        t1 = true;
                        virtual_t1 = virtual_t1.wrapping_sub(1);
                    }
                    out.push(cand);
                    from_t1.push(t1);
                }
                for (&s, &t1) in out.iter().zip(&from_t1) {
                    let key = view.keys[s as usize];
                    if t1 {
                        a.links.unlink(&mut a.t1, s);
                        a.b1.insert(key, 0);
                    } else {
                        a.links.unlink(&mut a.t2, s);
                        a.b2.insert(key, 0);
                    }
                    a.which[s as usize] = 0;
                }
                for ghost in [&mut a.b1, &mut a.b2] {
                    while ghost.len() > a.capacity {
                        ghost.pop_front();
                    }
                }
                true
            }
        }
    }

    /// Forgets everything (ARC: ghosts and target too).
    pub(crate) fn clear(&mut self) {
        match self {
            Policy::Lru(l) => {
                let n = l.rank.len();
                l.links = Links::new(n);
                l.order = List::default();
                l.next_rank = 0;
            }
            Policy::Arc(a) => {
                a.links = Links::new(a.which.len());
                a.t1 = List::default();
                a.t2 = List::default();
                a.which.iter_mut().for_each(|w| *w = 0);
                a.b1.clear();
                a.b2.clear();
                a.target_t1_size = 0.0;
            }
        }
    }

    /// Resident slots in eviction order (LRU: by rank; ARC: T1 then T2). For tests/introspection.
    pub(crate) fn order(&self) -> Vec<u32> {
        let mut v = Vec::new();
        let walk = |links: &Links, l: &List, v: &mut Vec<u32>| {
            let mut c = l.head;
            while c != NIL {
                v.push(c);
                c = links.next(c);
            }
        };
        match self {
            Policy::Lru(l) => walk(&l.links, &l.order, &mut v),
            Policy::Arc(a) => {
                walk(&a.links, &a.t1, &mut v);
                walk(&a.links, &a.t2, &mut v);
            }
        }
        v
    }

    /// ARC introspection: (T1 slots, T2 slots, B1 keys, B2 keys, target).
    #[allow(clippy::type_complexity)]
    pub(crate) fn arc_state(
        &self,
    ) -> Option<(Vec<u32>, Vec<u32>, Vec<OffloadKey>, Vec<OffloadKey>, f64)> {
        let Policy::Arc(a) = self else { return None };
        let walk = |l: &List| {
            let mut v = Vec::new();
            let mut c = l.head;
            while c != NIL {
                v.push(c);
                c = a.links.next(c);
            }
            v
        };
        Some((
            walk(&a.t1),
            walk(&a.t2),
            a.b1.iter().collect(),
            a.b2.iter().collect(),
            a.target_t1_size,
        ))
    }
}

impl Policy {
    /// Sets ARC's `target_t1_size` (test setup); no-op for LRU.
    pub(crate) fn set_arc_target(&mut self, t: f64) {
        if let Policy::Arc(a) = self {
            a.target_t1_size = t;
        }
    }
}

impl Arc {
    fn adapt_to_ghost_hit(&mut self, key: &OffloadKey) -> bool {
        if self.b1.contains(key) {
            let delta = f64::max(1.0, self.b2.len() as f64 / self.b1.len() as f64);
            self.target_t1_size = f64::min(self.target_t1_size + delta, self.capacity as f64);
            self.b1.move_to_back(key);
            return true;
        }
        if self.b2.contains(key) {
            let delta = f64::max(1.0, self.b1.len() as f64 / self.b2.len() as f64);
            self.target_t1_size = f64::max(self.target_t1_size - delta, 0.0);
            self.b2.move_to_back(key);
            return true;
        }
        false
    }
}
