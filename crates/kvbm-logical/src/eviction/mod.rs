//! Eviction: which inactive block goes first. One trait, one module per policy.
//!
//! The store (see `store.rs`) owns slots, the hash index and the reset pool; it tells an
//! [`Eviction`] policy about each registered slot's life and asks it for victims. A policy
//! never sees bytes, locks or the hash map; it only orders slot ids. Adding a policy means
//! adding a module here and a variant to [`AnyEviction`] / [`EvictionBackend`]: the store is
//! not touched.
//!
//! ```text
//!   register ──▶ on_register ──▶ (active) ──last drop──▶ on_release ──▶ (evictable)
//!                                   ▲                                      │
//!                                   └──────────── on_acquire (match) ◀─────┤
//!                                                                          ▼
//!                       allocate ──▶ pop_victim / remove ──▶ gone (restore undoes it)
//! ```
//!
//! # Contract (every policy)
//!
//! * Slots are dense ids `0..capacity`. `on_register` is called once per registration of a
//!   primary slot, which is then *active*. `on_release` makes it *evictable*, `on_acquire`
//!   active again. `on_touch` is a recency hint that must not count as a frequency hit;
//!   `on_hint` gives a caller's next-use time (only [`Belady`] uses it).
//! * `pop_victim` returns an evictable slot for which `protected` is false, and forgets it,
//!   or `None` when there is none it may evict. It may reorder other slots (S3-FIFO moves
//!   entries between its queues). `remove` forgets a registered slot chosen by someone else
//!   (an admission filter). `restore` undoes the latest `pop_victim`/`remove` of that slot:
//!   the store calls it, in reverse order and with no call in between, when an allocation
//!   fails, so allocation is all-or-nothing.
//! * The hot path (`on_release`, `on_acquire`, `pop_victim` with nothing protected) does not
//!   allocate for the list policies; [`Belady`] uses a B-tree and is a reference policy.
//! * Dispatch is static: [`AnyEviction`] is an enum over the policies, so the store's calls
//!   are inlined `match`es, not virtual calls (the trait is therefore not object-safe).
//!
//! # Policies
//!
//! | name | module | order |
//! |---|---|---|
//! | `lru` | [`lru`] | least recently released first |
//! | `multi_lru` | [`multi_lru`] | four LRU levels by registry frequency |
//! | `lineage` | [`lineage`] | leaves only (prefix-aware), least recently released leaf first |
//! | `fifo` | [`fifo`] | registration order |
//! | `arc` | [`arc`] | adaptive replacement cache (T1/T2 with B1/B2 ghosts, adaptive p) |
//! | `s3fifo` | [`s3fifo`] | small/main FIFO queues with a ghost queue |
//! | `belady` | [`belady`] | farthest next use, from caller hints (offline reference) |
//! | `tinylfu-<base>` | [`tinylfu`] | admission filter over any base: first sightings are evicted first |
//! | `adaptive-<base>` | [`tinylfu`] | the filter dueling with LRU through sampled shadows (default `adaptive-lru`) |
//! | `orphan-<policy>` | [`orphan`] | prefix awareness over any policy: blocks whose parent left go first |

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use crate::hash::SequenceHash;
use crate::registry::BlockRegistry;

pub mod arc;
pub mod belady;
pub mod fifo;
mod ghost;
pub mod lineage;
pub(crate) mod list;
pub mod lru;
pub mod multi_lru;
pub mod orphan;
pub mod s3fifo;
mod shadow;
pub mod tinylfu;

pub use arc::ArcPolicy;
pub use belady::Belady;
pub use fifo::Fifo;
pub use lineage::Lineage;
pub use lru::Lru;
pub use multi_lru::MultiLru;
pub use orphan::OrphanFirst;
pub use s3fifo::S3Fifo;
pub use tinylfu::TinyLfu;

/// What a policy may read about slots: their hashes and the shared registry.
#[derive(Copy, Clone)]
pub struct EvictionCtx<'a> {
    hashes: &'a [SequenceHash],
    registry: &'a BlockRegistry,
}

impl<'a> EvictionCtx<'a> {
    /// A context over `hashes[slot]` (the hash each registered slot holds) and a registry.
    pub fn new(hashes: &'a [SequenceHash], registry: &'a BlockRegistry) -> Self {
        Self { hashes, registry }
    }

    /// The hash registered in `slot`.
    #[inline]
    pub fn hash(&self, slot: u32) -> SequenceHash {
        self.hashes[slot as usize]
    }

    /// The registry (frequency sketch, presence).
    #[inline]
    pub fn registry(&self) -> &'a BlockRegistry {
        self.registry
    }
}

/// A slot as the store sees it, for [`Eviction::check`].
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum SlotStatus {
    /// Not registered as a primary (reset, held, or a duplicate).
    Unregistered,
    /// Registered, with a strong reference.
    Active,
    /// Registered, evictable.
    Evictable,
}

/// An eviction policy over dense slot ids (see the [module docs](self) for the contract).
pub trait Eviction: Send + 'static {
    /// `slot` was registered (it is active).
    fn on_register(&mut self, slot: u32, ctx: &EvictionCtx<'_>);
    /// `slot`'s last strong reference was dropped: it is evictable.
    fn on_release(&mut self, slot: u32, ctx: &EvictionCtx<'_>);
    /// Evictable `slot` was revived (a match or an upgrade): it is active.
    fn on_acquire(&mut self, slot: u32, ctx: &EvictionCtx<'_>);
    /// Active `slot` was matched again (a hit that revived nothing), reported once before its
    /// next `on_release`. Default: nothing.
    fn on_hit(&mut self, slot: u32, ctx: &EvictionCtx<'_>) {
        let _ = (slot, ctx);
    }
    /// A recency touch of a registered slot, which is not a frequency hit. Default: nothing.
    fn on_touch(&mut self, slot: u32, ctx: &EvictionCtx<'_>) {
        let _ = (slot, ctx);
    }
    /// The caller's estimate of `slot`'s next use (any monotonic clock). Default: ignored.
    fn on_hint(&mut self, slot: u32, next_use: u64, ctx: &EvictionCtx<'_>) {
        let _ = (slot, next_use, ctx);
    }
    /// Whether the policy allows `slot` to be removed now (lineage: only leaves). Default: yes.
    fn can_remove(&self, slot: u32) -> bool {
        let _ = slot;
        true
    }
    /// Takes the next victim among evictable, unprotected slots; `None` if there is none.
    fn pop_victim(
        &mut self,
        ctx: &EvictionCtx<'_>,
        protected: &impl Fn(u32) -> bool,
    ) -> Option<u32>;
    /// Forgets registered `slot`, evicted by someone else's choice.
    fn remove(&mut self, slot: u32, ctx: &EvictionCtx<'_>);
    /// Undoes the latest `pop_victim`/`remove` of `slot` (called in reverse order).
    fn restore(&mut self, slot: u32, ctx: &EvictionCtx<'_>);
    /// Checks internal consistency against the store's view of every slot.
    ///
    /// # Errors
    /// A description of the first inconsistency.
    fn check(&self, status: &dyn Fn(u32) -> SlotStatus) -> Result<(), String>;
}

/// Which eviction order the inactive pool uses (see the [module docs](self)).
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum EvictionBackend {
    /// Least recently released first.
    #[default]
    Lru,
    /// Four LRU levels by registry frequency (thresholds 3, 8, 15): the lowest non-empty level
    /// is evicted first, least recently released first within a level.
    MultiLru,
    /// Leaves first: never a block whose child is still cached in this tier (a prefix match
    /// stops at the first missing block, so evicting a parent would strand its children).
    /// Least recently released leaf first; a parent freed by evicting its last child is queued
    /// as the next victim, so stale chains are consumed from the tail.
    Lineage,
    /// First registered, first evicted, regardless of reuse.
    Fifo,
    /// Adaptive replacement cache: recency (T1) and frequency (T2) lists with ghost lists
    /// (B1, B2) steering the target size of T1.
    Arc,
    /// S3-FIFO: a small FIFO (10%) filtering one-hit blocks, a main FIFO with reinsertion,
    /// and a ghost queue.
    #[serde(rename = "s3fifo")]
    S3Fifo,
    /// Belady's offline optimum: evicts the block whose next use (from caller hints, see
    /// `BlockManager::hint_next_use`) is farthest; blocks without a hint first.
    Belady,
}

impl EvictionBackend {
    /// Every backend.
    pub const ALL: [EvictionBackend; 7] = [
        EvictionBackend::Lru,
        EvictionBackend::MultiLru,
        EvictionBackend::Lineage,
        EvictionBackend::Fifo,
        EvictionBackend::Arc,
        EvictionBackend::S3Fifo,
        EvictionBackend::Belady,
    ];

    /// The backend's name in configuration (`lru`, `multi_lru`, ...).
    pub fn name(self) -> &'static str {
        match self {
            EvictionBackend::Lru => "lru",
            EvictionBackend::MultiLru => "multi_lru",
            EvictionBackend::Lineage => "lineage",
            EvictionBackend::Fifo => "fifo",
            EvictionBackend::Arc => "arc",
            EvictionBackend::S3Fifo => "s3fifo",
            EvictionBackend::Belady => "belady",
        }
    }
}

impl fmt::Display for EvictionBackend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for EvictionBackend {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        EvictionBackend::ALL
            .into_iter()
            .find(|b| b.name() == s)
            .ok_or_else(|| {
                format!(
                    "unknown eviction backend {s:?}: expected one of {}",
                    EvictionBackend::ALL.map(|b| b.name()).join(", ")
                )
            })
    }
}

/// An admission filter in front of the eviction backend.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Admission {
    /// Every released block enters the backend's order.
    #[default]
    None,
    /// TinyLFU-style: a block whose registry frequency (sightings: registrations and matches)
    /// is below 2 when released goes to a probation queue evicted before the backend's order.
    #[serde(rename = "tinylfu")]
    TinyLfu,
    /// [`TinyLfu`] dueling with LRU (`adaptive-<base>`): two sampled shadow caches estimate
    /// LRU's and the filter's hit ratios, and while LRU's is ahead victims are taken in
    /// release order across probation and the base (LRU's order over an LRU base), so the
    /// filter's gains are kept where it wins and LRU is followed where it does not.
    Adaptive,
}

/// Prefix awareness in front of the admission filter and the backend.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PrefixAwareness {
    /// The policy's own order only.
    #[default]
    None,
    /// [`OrphanFirst`]: a block whose parent left the tier (it can no longer be reached by a
    /// prefix match) is evicted before anything the policy would choose.
    #[serde(rename = "orphan")]
    OrphanFirst,
}

/// A named policy: a backend plus an admission filter and prefix awareness, written `lru`,
/// `s3fifo`, `tinylfu-lru`, `orphan-tinylfu-lineage`, ... (serde and `FromStr`/`Display` use
/// this name).
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct EvictionPolicy {
    /// The eviction order.
    pub backend: EvictionBackend,
    /// The admission filter.
    pub admission: Admission,
    /// Prefix awareness over both (`orphan-` in the name).
    pub prefix: PrefixAwareness,
}

impl EvictionPolicy {
    /// A backend without admission filter.
    pub const fn plain(backend: EvictionBackend) -> Self {
        Self {
            backend,
            admission: Admission::None,
            prefix: PrefixAwareness::None,
        }
    }

    /// A backend behind the TinyLFU admission filter.
    pub const fn tinylfu(backend: EvictionBackend) -> Self {
        Self {
            backend,
            admission: Admission::TinyLfu,
            prefix: PrefixAwareness::None,
        }
    }

    /// A backend behind the admission filter dueling with LRU (`adaptive-<backend>`).
    pub const fn adaptive(backend: EvictionBackend) -> Self {
        Self {
            backend,
            admission: Admission::Adaptive,
            prefix: PrefixAwareness::None,
        }
    }

    /// This policy behind [`OrphanFirst`] (`orphan-` + its name).
    pub const fn orphan_first(self) -> Self {
        Self {
            prefix: PrefixAwareness::OrphanFirst,
            ..self
        }
    }

    /// Every named policy: each backend, plain and behind TinyLFU, each with and without
    /// orphan-first.
    pub fn all() -> Vec<EvictionPolicy> {
        EvictionBackend::ALL
            .into_iter()
            .flat_map(|b| [Self::plain(b), Self::tinylfu(b), Self::adaptive(b)])
            .flat_map(|p| [p, p.orphan_first()])
            .collect()
    }
}

impl Default for EvictionPolicy {
    /// `adaptive-lru`: the admission filter over LRU dueling with LRU, the best online policy
    /// measured on the Mooncake traces that is never below LRU (1,024–32,768 blocks, both
    /// traces; see `docs/eviction.md` and `examples/hit_ratio.rs`).
    fn default() -> Self {
        Self::adaptive(EvictionBackend::Lru)
    }
}

impl fmt::Display for EvictionPolicy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.prefix == PrefixAwareness::OrphanFirst {
            f.write_str("orphan-")?;
        }
        match self.admission {
            Admission::None => write!(f, "{}", self.backend),
            Admission::TinyLfu => write!(f, "tinylfu-{}", self.backend),
            Admission::Adaptive => write!(f, "adaptive-{}", self.backend),
        }
    }
}

impl FromStr for EvictionPolicy {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        if let Some(rest) = s.strip_prefix("orphan-") {
            return Ok(rest.parse::<Self>()?.orphan_first());
        }
        if let Some(base) = s.strip_prefix("adaptive-") {
            return Ok(Self::adaptive(base.parse()?));
        }
        match s.strip_prefix("tinylfu-") {
            Some(base) => Ok(Self::tinylfu(base.parse()?)),
            None => Ok(Self::plain(s.parse()?)),
        }
    }
}

impl From<EvictionBackend> for EvictionPolicy {
    fn from(backend: EvictionBackend) -> Self {
        Self::plain(backend)
    }
}

impl TryFrom<String> for EvictionPolicy {
    type Error = String;
    fn try_from(s: String) -> Result<Self, String> {
        s.parse()
    }
}

impl From<EvictionPolicy> for String {
    fn from(p: EvictionPolicy) -> String {
        p.to_string()
    }
}

/// Any policy, chosen at run time by [`EvictionPolicy`]; static dispatch by `match`.
#[derive(Debug)]
pub enum AnyEviction {
    /// [`Lru`].
    Lru(Lru),
    /// [`MultiLru`].
    MultiLru(MultiLru),
    /// [`Lineage`].
    Lineage(Lineage),
    /// [`Fifo`].
    Fifo(Fifo),
    /// [`ArcPolicy`].
    Arc(Box<ArcPolicy>),
    /// [`S3Fifo`].
    S3Fifo(Box<S3Fifo>),
    /// [`Belady`].
    Belady(Box<Belady>),
    /// [`TinyLfu`] over [`Lru`], plain or adaptive (without a second dispatch).
    TinyLfuLru(TinyLfu<Lru>),
    /// [`TinyLfu`] over another policy.
    TinyLfu(Box<TinyLfu<AnyEviction>>),
    /// [`OrphanFirst`] over another policy.
    Orphan(Box<OrphanFirst<AnyEviction>>),
}

impl AnyEviction {
    /// Builds `policy` for slots `0..capacity`.
    pub fn new(policy: EvictionPolicy, capacity: usize) -> Self {
        if policy.prefix == PrefixAwareness::OrphanFirst {
            let inner = EvictionPolicy {
                prefix: PrefixAwareness::None,
                ..policy
            };
            return AnyEviction::Orphan(Box::new(OrphanFirst::new(
                AnyEviction::new(inner, capacity),
                capacity,
            )));
        }
        if policy == EvictionPolicy::tinylfu(EvictionBackend::Lru) {
            return AnyEviction::TinyLfuLru(TinyLfu::new(Lru::new(capacity), capacity));
        }
        if policy == EvictionPolicy::adaptive(EvictionBackend::Lru) {
            return AnyEviction::TinyLfuLru(TinyLfu::adaptive(Lru::new(capacity), capacity));
        }
        let base = match policy.backend {
            EvictionBackend::Lru => AnyEviction::Lru(Lru::new(capacity)),
            EvictionBackend::MultiLru => AnyEviction::MultiLru(MultiLru::new(capacity)),
            EvictionBackend::Lineage => AnyEviction::Lineage(Lineage::new(capacity)),
            EvictionBackend::Fifo => AnyEviction::Fifo(Fifo::new(capacity)),
            EvictionBackend::Arc => AnyEviction::Arc(Box::new(ArcPolicy::new(capacity))),
            EvictionBackend::S3Fifo => AnyEviction::S3Fifo(Box::new(S3Fifo::new(capacity))),
            EvictionBackend::Belady => AnyEviction::Belady(Box::new(Belady::new(capacity))),
        };
        match policy.admission {
            Admission::None => base,
            Admission::TinyLfu => AnyEviction::TinyLfu(Box::new(TinyLfu::new(base, capacity))),
            Admission::Adaptive => {
                AnyEviction::TinyLfu(Box::new(TinyLfu::adaptive(base, capacity)))
            }
        }
    }
}

macro_rules! dispatch {
    ($self:expr, $p:ident => $e:expr) => {
        match $self {
            AnyEviction::Lru($p) => $e,
            AnyEviction::MultiLru($p) => $e,
            AnyEviction::Lineage($p) => $e,
            AnyEviction::Fifo($p) => $e,
            AnyEviction::Arc($p) => $e,
            AnyEviction::S3Fifo($p) => $e,
            AnyEviction::Belady($p) => $e,
            AnyEviction::TinyLfuLru($p) => $e,
            AnyEviction::TinyLfu($p) => $e,
            AnyEviction::Orphan($p) => $e,
        }
    };
}

impl Eviction for AnyEviction {
    #[inline]
    fn on_register(&mut self, slot: u32, ctx: &EvictionCtx<'_>) {
        dispatch!(self, p => p.on_register(slot, ctx))
    }
    #[inline]
    fn on_release(&mut self, slot: u32, ctx: &EvictionCtx<'_>) {
        dispatch!(self, p => p.on_release(slot, ctx))
    }
    #[inline]
    fn on_acquire(&mut self, slot: u32, ctx: &EvictionCtx<'_>) {
        dispatch!(self, p => p.on_acquire(slot, ctx))
    }
    #[inline]
    fn on_hit(&mut self, slot: u32, ctx: &EvictionCtx<'_>) {
        dispatch!(self, p => p.on_hit(slot, ctx))
    }
    #[inline]
    fn on_touch(&mut self, slot: u32, ctx: &EvictionCtx<'_>) {
        dispatch!(self, p => p.on_touch(slot, ctx))
    }
    #[inline]
    fn on_hint(&mut self, slot: u32, next_use: u64, ctx: &EvictionCtx<'_>) {
        dispatch!(self, p => p.on_hint(slot, next_use, ctx))
    }
    #[inline]
    fn can_remove(&self, slot: u32) -> bool {
        dispatch!(self, p => p.can_remove(slot))
    }
    #[inline]
    fn pop_victim(
        &mut self,
        ctx: &EvictionCtx<'_>,
        protected: &impl Fn(u32) -> bool,
    ) -> Option<u32> {
        dispatch!(self, p => p.pop_victim(ctx, protected))
    }
    #[inline]
    fn remove(&mut self, slot: u32, ctx: &EvictionCtx<'_>) {
        dispatch!(self, p => p.remove(slot, ctx))
    }
    #[inline]
    fn restore(&mut self, slot: u32, ctx: &EvictionCtx<'_>) {
        dispatch!(self, p => p.restore(slot, ctx))
    }
    fn check(&self, status: &dyn Fn(u32) -> SlotStatus) -> Result<(), String> {
        dispatch!(self, p => p.check(status))
    }
}

/// Checks that every listed slot is registered and evictable (for policies that list only
/// evictable slots).
pub(crate) fn check_listed_evictable<const K: usize>(
    lists: &list::Lists<K>,
    capacity: usize,
    status: &dyn Fn(u32) -> SlotStatus,
) -> Result<(), String> {
    lists.check()?;
    for s in 0..capacity as u32 {
        if lists.is_listed(s) && status(s) != SlotStatus::Evictable {
            return Err(format!("slot {s} listed while {:?}", status(s)));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests;
