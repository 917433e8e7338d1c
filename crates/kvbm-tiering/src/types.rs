//! The value types of vLLM's `kv_offload/base.py`: media, tier filters, request context, lookup
//! results, policies, specs, events and the canonical KV cache description.
//!
//! `ReqContext` is a cheap handle (`Arc` inside): the scheduler hands the same context to every
//! call of a request and managers keep clones in jobs, as vLLM keeps the same Python object.

use std::any::{Any, TypeId};
use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use hashbrown::HashMap;
use parking_lot::Mutex;

use crate::error::{Result, TieringError};
use crate::key::OffloadKey;

/// The vLLM release line whose offloading contract a manager follows, call for call.
///
/// kvbm follows the current and the previous vLLM minor release. What differs (0.34 against
/// 0.33), and where each difference is acted on:
/// - the store threshold counts a key once per request, and a skipped store once per
///   request (`CpuOffloadingManager::prepare_store`);
/// - a stored event carries the request context that completed the store, with
///   `removal_expected` set ([`OffloadingEvent::req_context`]);
/// - a failed promotion may defer the release of its primary chunks until its tier says its
///   I/O can no longer touch them (`TieringOffloadingManager`, `JobResult::deferred_release`);
/// - `touch` is gone (kept for 0.33 callers; a 0.34 caller never calls it).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Contract {
    /// vLLM 0.33.x.
    #[default]
    V0_33,
    /// vLLM 0.34.x.
    V0_34,
}

impl Contract {
    /// The contract of vLLM `major.minor`, when kvbm follows that line.
    pub fn of_line(major: u32, minor: u32) -> Option<Self> {
        match (major, minor) {
            (0, 33) => Some(Contract::V0_33),
            (0, 34) => Some(Contract::V0_34),
            _ => None,
        }
    }

    /// The store threshold counts a key once per request (0.34).
    pub fn counts_once_per_request(self) -> bool {
        self >= Contract::V0_34
    }

    /// A stored event carries its request context and expects a removal (0.34).
    pub fn stored_event_context(self) -> bool {
        self >= Contract::V0_34
    }
}

/// Storage medium of an offloading tier.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Medium {
    /// Host memory.
    Cpu,
    /// Files or objects.
    Storage,
}

impl Medium {
    /// Upper-case name as vLLM's enum (`CPU`, `STORAGE`).
    pub fn name(self) -> &'static str {
        match self {
            Medium::Cpu => "CPU",
            Medium::Storage => "STORAGE",
        }
    }
    /// Case-insensitive parse.
    pub fn parse(s: &str) -> Option<Self> {
        match s.to_ascii_uppercase().as_str() {
            "CPU" => Some(Medium::Cpu),
            "STORAGE" => Some(Medium::Storage),
            _ => None,
        }
    }
}

/// Locality of a tier's storage relative to the publishing instance.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Locality {
    /// Same host.
    Local,
    /// Across the network.
    Remote,
}

impl Locality {
    /// Case-insensitive parse.
    pub fn parse(s: &str) -> Option<Self> {
        match s.to_ascii_uppercase().as_str() {
            "LOCAL" => Some(Locality::Local),
            "REMOTE" => Some(Locality::Remote),
            _ => None,
        }
    }
}

/// One clause of a [`TierFilter`]; `None` on either side is a wildcard.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TierMatcher {
    /// Required medium, or any.
    pub medium: Option<Medium>,
    /// Required locality, or any.
    pub locality: Option<Locality>,
}

impl TierMatcher {
    /// Whether a tier with this medium and locality matches (a `None` tier attribute is a wildcard too).
    pub fn matches(&self, medium: Option<Medium>, locality: Option<Locality>) -> bool {
        let m = self.medium.is_none() || medium.is_none() || self.medium == medium;
        let l = self.locality.is_none() || locality.is_none() || self.locality == locality;
        m && l
    }
}

/// Per-request filter controlling which secondary tiers participate in lookups.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TierFilter {
    /// `None` is the `ALL` sentinel; an empty list denies every secondary tier.
    matchers: Option<Vec<TierMatcher>>,
}

impl TierFilter {
    /// Allows every tier.
    pub const ALL: TierFilter = TierFilter { matchers: None };

    /// A filter allowing a tier iff any matcher matches (empty = deny all).
    pub fn new(matchers: Vec<TierMatcher>) -> Self {
        Self {
            matchers: Some(matchers),
        }
    }

    /// Whether a tier participates.
    #[inline]
    pub fn allows(&self, medium: Option<Medium>, locality: Option<Locality>) -> bool {
        match &self.matchers {
            None => true,
            Some(ms) => ms.iter().any(|m| m.matches(medium, locality)),
        }
    }

    /// Whether this is the `ALL` sentinel.
    pub fn is_all(&self) -> bool {
        self.matchers.is_none()
    }

    /// The matchers (`None` for `ALL`).
    pub fn matchers(&self) -> Option<&[TierMatcher]> {
        self.matchers.as_deref()
    }

    /// Parses the per-request `kv_transfer_params` tier filter as vLLM's `_parse_tier_filter`:
    /// a list of `{"medium": .., "locality": ..}` objects. A non-list, or a list whose every
    /// entry is invalid, gives `ALL`; invalid entries among valid ones are skipped; `[]` denies all.
    pub fn parse(value: &serde_json::Value) -> TierFilter {
        let Some(list) = value.as_array() else {
            return TierFilter::ALL;
        };
        if list.is_empty() {
            return TierFilter::new(Vec::new());
        }
        let mut out = Vec::new();
        for item in list {
            let entry = match item {
                serde_json::Value::String(s) => Medium::parse(s).map(|m| TierMatcher {
                    medium: Some(m),
                    locality: None,
                }),
                serde_json::Value::Object(o) => {
                    let medium = match o.get("medium") {
                        None | Some(serde_json::Value::Null) => Ok(None),
                        Some(serde_json::Value::String(s)) => Medium::parse(s).map(Some).ok_or(()),
                        _ => Err(()),
                    };
                    let locality = match o.get("locality") {
                        None | Some(serde_json::Value::Null) => Ok(None),
                        Some(serde_json::Value::String(s)) => {
                            Locality::parse(s).map(Some).ok_or(())
                        }
                        _ => Err(()),
                    };
                    match (medium, locality) {
                        (Ok(medium), Ok(locality)) => Some(TierMatcher { medium, locality }),
                        _ => None,
                    }
                }
                _ => None,
            };
            if let Some(e) = entry {
                out.push(e);
            }
        }
        if out.is_empty() {
            TierFilter::ALL
        } else {
            TierFilter::new(out)
        }
    }
}

impl Default for TierFilter {
    fn default() -> Self {
        TierFilter::ALL
    }
}

static NEXT_CTX_UID: AtomicU64 = AtomicU64::new(1);

struct ReqInner {
    req_id: Arc<str>,
    uid: u64,
    kv_transfer_params: Option<serde_json::Value>,
    kv_hints: Option<serde_json::Value>,
    load_tier_filter: TierFilter,
    state: Mutex<HashMap<TypeId, Box<dyn Any + Send + Sync>>>,
    has_positions: AtomicBool,
    positions: Mutex<HashMap<OffloadKey, u64>>,
}

/// Per-request context handed to every manager call of a request (vLLM `ReqContext`).
///
/// Cloning shares the context. Identity (`uid`) distinguishes two contexts of the same request id.
#[derive(Clone)]
pub struct ReqContext(Arc<ReqInner>);

impl ReqContext {
    /// A context with defaults (`load_tier_filter = ALL`).
    pub fn new(req_id: impl Into<Arc<str>>) -> Self {
        Self::builder(req_id).build()
    }

    /// A builder for the optional fields.
    pub fn builder(req_id: impl Into<Arc<str>>) -> ReqContextBuilder {
        ReqContextBuilder {
            req_id: req_id.into(),
            kv_transfer_params: None,
            kv_hints: None,
            load_tier_filter: TierFilter::ALL,
        }
    }

    /// The request id.
    #[inline]
    pub fn req_id(&self) -> &str {
        &self.0.req_id
    }

    /// The request id as a shared string.
    #[inline]
    pub fn req_id_arc(&self) -> &Arc<str> {
        &self.0.req_id
    }

    /// Unique identity of this context object.
    #[inline]
    pub fn uid(&self) -> u64 {
        self.0.uid
    }

    /// Connector parameters of the request.
    pub fn kv_transfer_params(&self) -> Option<&serde_json::Value> {
        self.0.kv_transfer_params.as_ref()
    }

    /// Opaque KV hints envelope.
    pub fn kv_hints(&self) -> Option<&serde_json::Value> {
        self.0.kv_hints.as_ref()
    }

    /// Which secondary tiers lookups may consult.
    #[inline]
    pub fn load_tier_filter(&self) -> &TierFilter {
        &self.0.load_tier_filter
    }

    /// Stores per-request scratch state keyed by its type.
    pub fn set_state<T: Any + Send + Sync>(&self, val: T) {
        self.0.state.lock().insert(TypeId::of::<T>(), Box::new(val));
    }

    /// Reads per-request scratch state of type `T`.
    pub fn get_state<T: Any + Send + Sync + Clone>(&self) -> Option<T> {
        self.0
            .state
            .lock()
            .get(&TypeId::of::<T>())
            .and_then(|b| b.downcast_ref::<T>())
            .cloned()
    }

    /// Records the end-token position of a key in this request.
    pub fn set_offload_key_position(&self, key: OffloadKey, end_token: u64) {
        self.0.positions.lock().insert(key, end_token);
        self.0.has_positions.store(true, Ordering::Release);
    }

    /// The end-token position of a key, if recorded.
    #[inline]
    pub fn get_offload_key_position(&self, key: &OffloadKey) -> Option<u64> {
        if !self.0.has_positions.load(Ordering::Acquire) {
            return None;
        }
        self.0.positions.lock().get(key).copied()
    }

    /// Whether any key position was recorded (fast path for policies).
    #[inline]
    pub fn has_positions(&self) -> bool {
        self.0.has_positions.load(Ordering::Acquire)
    }

    /// Whether two handles are the same context object.
    pub fn same(&self, other: &ReqContext) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }
}

impl fmt::Debug for ReqContext {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ReqContext")
            .field("req_id", &self.0.req_id)
            .field("uid", &self.0.uid)
            .field("load_tier_filter", &self.0.load_tier_filter)
            .finish()
    }
}

/// Builder of [`ReqContext`].
pub struct ReqContextBuilder {
    req_id: Arc<str>,
    kv_transfer_params: Option<serde_json::Value>,
    kv_hints: Option<serde_json::Value>,
    load_tier_filter: TierFilter,
}

impl ReqContextBuilder {
    /// Connector parameters.
    pub fn kv_transfer_params(mut self, v: serde_json::Value) -> Self {
        self.kv_transfer_params = Some(v);
        self
    }
    /// Opaque hints.
    pub fn kv_hints(mut self, v: serde_json::Value) -> Self {
        self.kv_hints = Some(v);
        self
    }
    /// Tier filter for lookups.
    pub fn load_tier_filter(mut self, f: TierFilter) -> Self {
        self.load_tier_filter = f;
        self
    }
    /// Builds the context.
    pub fn build(self) -> ReqContext {
        ReqContext(Arc::new(ReqInner {
            req_id: self.req_id,
            uid: NEXT_CTX_UID.fetch_add(1, Ordering::Relaxed),
            kv_transfer_params: self.kv_transfer_params,
            kv_hints: self.kv_hints,
            load_tier_filter: self.load_tier_filter,
            state: Mutex::new(HashMap::new()),
            has_positions: AtomicBool::new(false),
            positions: Mutex::new(HashMap::new()),
        }))
    }
}

/// Result of `OffloadingManager::lookup`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum LookupResult {
    /// Not found.
    Miss,
    /// Offloaded and ready.
    Hit,
    /// Found but not yet readable (write in flight, promotion staged).
    HitPending,
    /// Not known yet; ask again later.
    Retry,
}

impl LookupResult {
    /// vLLM's enum name (`MISS`, `HIT`, `HIT_PENDING`, `RETRY`).
    pub fn name(self) -> &'static str {
        match self {
            LookupResult::Miss => "MISS",
            LookupResult::Hit => "HIT",
            LookupResult::HitPending => "HIT_PENDING",
            LookupResult::Retry => "RETRY",
        }
    }
}

/// How a request's chunks are offloaded.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum OffloadScope {
    /// Only newly computed chunks.
    #[default]
    ChunkLevel,
    /// Every chunk of the request, prefix hits included.
    RequestLevel,
}

/// A manager's answer to `on_new_request`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RequestOffloadingContext {
    /// The policy for this request.
    pub policy: OffloadScope,
}

/// Per-step scheduling info passed to `on_schedule_end`.
#[derive(Clone, Debug, Default)]
pub struct ScheduleEndContext {
    /// Requests scheduled for the first time this step.
    pub new_req_ids: Vec<String>,
    /// Requests preempted this step.
    pub preempted_req_ids: Vec<String>,
}

/// CPU chunk indices (vLLM `CPULoadStoreSpec`), co-indexed with the keys of the call.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct CpuLoadStoreSpec {
    /// Chunk (slot) ids.
    pub chunk_ids: Vec<i32>,
}

/// Block numbers of some medium (vLLM `BlockIDsLoadStoreSpec`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct BlockIdsLoadStoreSpec {
    /// Block ids.
    pub block_ids: Vec<i32>,
}

/// GPU blocks, ordered by KV group (vLLM `GPULoadStoreSpec`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GpuLoadStoreSpec {
    block_ids: Vec<i32>,
    group_sizes: Vec<usize>,
    block_indices: Vec<usize>,
}

impl GpuLoadStoreSpec {
    /// Validates `sum(group_sizes) == len(block_ids)` and `len(block_indices) == len(group_sizes)`.
    pub fn new(
        block_ids: Vec<i32>,
        group_sizes: Vec<usize>,
        block_indices: Vec<usize>,
    ) -> Result<Self> {
        if group_sizes.iter().sum::<usize>() != block_ids.len() {
            return Err(TieringError::Config(format!(
                "GpuLoadStoreSpec: group_sizes sum to {} but there are {} block ids",
                group_sizes.iter().sum::<usize>(),
                block_ids.len()
            )));
        }
        if block_indices.len() != group_sizes.len() {
            return Err(TieringError::Config(format!(
                "GpuLoadStoreSpec: {} block_indices for {} groups",
                block_indices.len(),
                group_sizes.len()
            )));
        }
        Ok(Self {
            block_ids,
            group_sizes,
            block_indices,
        })
    }
    /// GPU block ids.
    pub fn block_ids(&self) -> &[i32] {
        &self.block_ids
    }
    /// Blocks per KV group.
    pub fn group_sizes(&self) -> &[usize] {
        &self.group_sizes
    }
    /// Logical index of the first block of each group.
    pub fn block_indices(&self) -> &[usize] {
        &self.block_indices
    }
}

/// What a worker needs to load or store blocks (vLLM `LoadStoreSpec` and subclasses).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum LoadStoreSpec {
    /// Primary (CPU) chunk ids.
    Cpu(CpuLoadStoreSpec),
    /// GPU blocks.
    Gpu(GpuLoadStoreSpec),
    /// Block ids of another medium.
    BlockIds(BlockIdsLoadStoreSpec),
}

impl LoadStoreSpec {
    /// The CPU chunk ids, if this is a CPU spec.
    pub fn chunk_ids(&self) -> Option<&[i32]> {
        match self {
            LoadStoreSpec::Cpu(c) => Some(&c.chunk_ids),
            _ => None,
        }
    }
}

/// Output of `prepare_store`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PrepareStoreOutput {
    /// Keys the caller must write (already-present keys are skipped).
    pub keys_to_store: Vec<OffloadKey>,
    /// Where to write them (co-indexed with `keys_to_store`).
    pub store_spec: LoadStoreSpec,
    /// Keys evicted to make room.
    pub evicted_keys: Vec<OffloadKey>,
}

impl Default for PrepareStoreOutput {
    /// Nothing to store: no keys, an empty CPU spec, nothing evicted (no allocation).
    fn default() -> Self {
        Self {
            keys_to_store: Vec::new(),
            store_spec: LoadStoreSpec::Cpu(CpuLoadStoreSpec {
                chunk_ids: Vec::new(),
            }),
            evicted_keys: Vec::new(),
        }
    }
}

/// A stored or removed set of keys.
///
/// Equality leaves [`req_context`](Self::req_context) out, as vLLM's dataclass does
/// (`compare=False`): two events of the same keys and kind are equal whoever caused them.
#[derive(Clone, Debug)]
pub struct OffloadingEvent {
    /// Keys.
    pub keys: Vec<OffloadKey>,
    /// Medium.
    pub medium: Medium,
    /// Removed (true) or stored (false).
    pub removed: bool,
    /// Locality of the owning tier.
    pub locality: Option<Locality>,
    /// Owning secondary tier, `None` for the primary.
    pub ownership: Option<String>,
    /// Whether the removal was expected.
    pub removal_expected: bool,
    /// Bookkeeping-only removal (failed write): dropped at `take_events` for keys present again.
    pub metadata_only: bool,
    /// The request whose completed store this stored event announces (vLLM 0.34's
    /// `req_context`): set by the CPU manager under [`Contract::V0_34`] and by a physical tier
    /// always (a 0.33 host leaves it out); `None` for removals.
    pub req_context: Option<ReqContext>,
}

impl PartialEq for OffloadingEvent {
    fn eq(&self, o: &Self) -> bool {
        self.keys == o.keys
            && self.medium == o.medium
            && self.removed == o.removed
            && self.locality == o.locality
            && self.ownership == o.ownership
            && self.removal_expected == o.removal_expected
            && self.metadata_only == o.metadata_only
    }
}

impl Eq for OffloadingEvent {}

impl OffloadingEvent {
    /// A primary-tier event.
    pub fn new(keys: Vec<OffloadKey>, medium: Medium, removed: bool) -> Self {
        Self {
            keys,
            medium,
            removed,
            locality: None,
            ownership: None,
            removal_expected: false,
            metadata_only: false,
            req_context: None,
        }
    }
}

/// Event publishing configuration (vLLM `OffloadingKVEventsConfig`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct OffloadingKVEventsConfig {
    /// Global KV event publishing flag; when false event capture stays inert (nobody drains it).
    pub enable_kv_cache_events: bool,
    /// Self-describing BlockStored payloads (only effective with events enabled).
    pub self_describing_kv_events: bool,
}

impl OffloadingKVEventsConfig {
    /// Whether managers should record events at all.
    pub fn capture(&self) -> bool {
        self.enable_kv_cache_events
    }
}

/// Where a hit will be loaded from (vLLM `CacheHitSource`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CacheHitSource {
    /// Host memory.
    Host,
    /// Another instance's memory (vLLM's peer-to-peer tier).
    P2p,
    /// Local disk.
    Disk,
    /// Unknown external source.
    ExternalUnspecified,
}

/// A canonical KV cache tensor (`num_blocks` leading), described by its memory.
#[derive(Clone, Debug)]
pub struct CanonicalKVCacheTensor {
    /// Base address of the tensor.
    pub ptr: usize,
    /// Number of blocks.
    pub num_blocks: usize,
    /// Padded page size per block in bytes.
    pub page_size_bytes: usize,
}

/// Per-layer reference to a canonical tensor; `mapping == None` means uncertified.
#[derive(Clone, Debug)]
pub struct CanonicalKVCacheRef {
    /// Index into `CanonicalKVCaches::tensors`.
    pub tensor_idx: usize,
    /// Un-padded page size.
    pub page_size_bytes: usize,
    /// How this worker's page maps into a canonical page; `None` = uncertified.
    pub mapping: Option<kvbm_physical::CanonicalPageMapping>,
}

/// Canonicalised block-level description of the KV caches.
#[derive(Clone, Debug, Default)]
pub struct CanonicalKVCaches {
    /// Unique tensors.
    pub tensors: Vec<CanonicalKVCacheTensor>,
    /// Per KV group, the references of its layers.
    pub group_data_refs: Vec<Vec<CanonicalKVCacheRef>>,
}

/// A finished worker transfer (vLLM `WorkerJobResult`).
#[derive(Clone, Debug, PartialEq)]
pub struct WorkerJobResult {
    /// Job id.
    pub job_id: u64,
    /// Whether every block moved.
    pub success: bool,
    /// Bytes moved.
    pub transfer_size: Option<u64>,
    /// Seconds taken.
    pub transfer_time: Option<f64>,
}
