//! `StorageTier`: kvbm's G3 disk tier and G4 object tier ([`PhysicalTier<G3>`](kvbm_tiering::PhysicalTier),
//! [`PhysicalTier<G4>`](kvbm_tiering::ObjectTier)) as secondary tiers under vLLM's own tiering
//! manager, moving bytes straight between vLLM's primary region and the disk or object store.
//!
//! ```text
//!  vLLM TieringOffloadingManager ─► KvbmDiskTier / KvbmObjectTier (Python, vLLM's ABC)
//!        (vLLM's Python)                 └─► StorageTier (this) ─► PhysicalTier<G3> ─► O_DIRECT file
//!                                                                 PhysicalTier<G4> ─► S3 / directory
//!  vLLM's primary region (/dev/shm, its workers fill it from the GPU)
//!        └── the same bytes: HostStorage::external, a kvbm layout over vLLM's memory
//! ```
//!
//! # Memory
//!
//! vLLM hands every tier a memoryview of its primary region (`primary_kv_view`: chunk `i` at
//! `i * strides[0]`). The tier takes a buffer export of it (the Python buffer protocol) and
//! wraps the address as external host memory; the export is the owner that keeps the region
//! mapped while the disk tier exists. No byte is copied through Python or a second buffer.
//!
//! kvbm-physical refuses two live layouts over the same memory (its process-wide reservation
//! table), and vLLM hands the same region to every secondary tier. So the region is
//! registered once, by the first kvbm tier over it, and the others share that registration
//! (one `CpuPrimaryTier` and its `TransferManager`, each tier's own layout beside it, as
//! kvbm-tiering's tiers share one primary): `primary_over`. A `kvbm_disk` and a
//! `kvbm_object` under one manager is the configuration this makes work.
//!
//! The moves run on that `TransferManager`'s threads, `io_nice` nicer than the thread that
//! made the first tier (vLLM's scheduler): on a machine short of cores the scheduler's step
//! runs ahead of the tiers' background writes, which take every idle moment instead. Tiers
//! sharing a region share its threads, so they must agree on `io_nice`.
//!
//! Who may write which chunk is vLLM's manager's business, as for its own tiers: a store job
//! reads chunks the manager pinned for the cascade, a load job writes chunks the manager
//! reserved for the promotion, until the job is reported finished.
//!
//! # What the tiers guarantee
//!
//! Bounded: `capacity` chunk slots in one file (the disk), `capacity` keys remembered (objects),
//! the oldest ready key evicted for a new one. Every slot and object carries kvbm-physical's
//! header (checksum, identity from the key's bytes, geometry): a read whose header or bytes do
//! not match is a failed load, never wrong bytes.
//!
//! Bound to the model: every tier is given the [`ModelFingerprint`] of vLLM's
//! `OffloadingConfig` ([`fingerprint_of`]; the Python side reads the config): the model, KV
//! dtype, KV cache layout, chunk size, the parallel shape the region's rows depend on (or
//! canonical, when vLLM says the bytes are parallelism-agnostic or replicated), and vLLM's own
//! parts (`tokens_per_hash`, `blocks_per_chunk`, the KV groups). A disk tier's journal written
//! under another fingerprint is reset (the tier starts cold); an object tier's objects live
//! under `{namespace}/fp-{hex}/`, so instances of other models share a bucket without ever
//! matching.

use std::sync::{Arc, Weak};
use std::time::Instant;

use kvbm_cluster::fleet::FleetTier;
use kvbm_engine::KvbmConfig;
use kvbm_physical::{
    DiskConfig, HostStorage, LayoutConfig, ModelFingerprint, ObjectConfig, Parallelism, S3Config,
    TransferConfig, TransferManager,
};
use kvbm_tiering::tiering::Backpressure;
use kvbm_tiering::{
    CpuManagerConfig, CpuPrimaryTier, DiskTier as RustDiskTier, JobResult, LookupResult,
    ObjectProbe, ObjectTier as RustObjectTier, OffloadKey, ReqContext, RequestOffloadingContext,
    SecondaryTierManager, TierJob,
};
use pyo3::buffer::PyBuffer;
use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyTuple};

use crate::bridge::{Contexts, key, key_list, keys, to_py};
use crate::cpu::LookupMembers;

/// The buffer export of vLLM's primary region: the owner of the external memory.
struct Region(#[allow(dead_code)] PyBuffer<u8>);

/// A kvbm tier behind the Python boundary: its `SecondaryTierManager` calls are the same for
/// every kind.
type AnyTier = Box<dyn SecondaryTierManager + Send>;

/// vLLM's region registered for kvbm's tiers: one per region, shared by every kvbm tier over
/// it (see "Memory" in the module docs). It holds the buffer export; the last tier over the
/// region releases it.
type SharedPrimary = Arc<parking_lot::Mutex<CpuPrimaryTier>>;

/// A live registration of a region: its address range, its chunk size, the registration.
struct Registered {
    addr: usize,
    len: usize,
    chunk_bytes: usize,
    io_nice: u8,
    primary: Weak<parking_lot::Mutex<CpuPrimaryTier>>,
}

/// The live registrations. Locked while a tier finds or makes its region's registration,
/// before kvbm-physical's reservation table (taken inside the registration), never the other
/// way round.
static REGIONS: parking_lot::Mutex<Vec<Registered>> = parking_lot::Mutex::new(Vec::new());

/// vLLM's primary region as a kvbm primary tier (memory only: vLLM's manager owns the slots):
/// the registration another kvbm tier over the same region made, else a new one, whose moves
/// run `io_nice` nicer than the caller (see "Memory" in the module docs).
fn primary_over(
    region: &Bound<'_, PyAny>,
    chunk_bytes: usize,
    io_nice: u8,
) -> PyResult<SharedPrimary> {
    let buf = PyBuffer::<u8>::get(region).map_err(|e| {
        PyValueError::new_err(format!(
            "primary_kv_view must export a byte buffer (vLLM's memoryview of its offload \
             region): {e}"
        ))
    })?;
    if buf.readonly() || !buf.is_c_contiguous() {
        return Err(PyValueError::new_err(
            "primary_kv_view must be writable and C-contiguous (vLLM's offload region)",
        ));
    }
    if chunk_bytes == 0 || buf.len_bytes() % chunk_bytes != 0 {
        return Err(PyValueError::new_err(format!(
            "primary_kv_view of {} bytes is not whole chunks of {chunk_bytes} bytes",
            buf.len_bytes()
        )));
    }
    let num_chunks = buf.len_bytes() / chunk_bytes;
    let (ptr, len) = (buf.buf_ptr().cast::<u8>(), buf.len_bytes());
    let mut live = REGIONS.lock();
    live.retain(|r| r.primary.strong_count() > 0);
    if let Some(r) = live.iter().find(|r| r.addr == ptr as usize && r.len == len) {
        let registered = r.chunk_bytes;
        if registered != chunk_bytes {
            return Err(PyValueError::new_err(format!(
                "primary_kv_view: another kvbm tier over this region moves chunks of \
                 {registered} bytes, this one {chunk_bytes}"
            )));
        }
        if r.io_nice != io_nice {
            return Err(PyValueError::new_err(format!(
                "io_nice: another kvbm tier over this region runs its moves at io_nice {}, \
                 this one asks {io_nice}; tiers over one region share their I/O threads, so \
                 give them the same value",
                r.io_nice
            )));
        }
        if let Some(shared) = r.primary.upgrade() {
            // This export is released here; the registration holds the first tier's.
            return Ok(shared);
        }
    }
    // SAFETY: the buffer export keeps vLLM's region mapped and its address fixed until the
    // export is released, which happens only when the HostStorage (its owner) is dropped;
    // writes to chunks are ordered by vLLM's manager's job protocol (module docs).
    let memory = unsafe { HostStorage::external(ptr, len, Box::new(Region(buf))) }
        .map_err(|e| PyValueError::new_err(e.to_string()))?;
    let tm = TransferManager::with_config(TransferConfig {
        worker_nice: io_nice,
        ..TransferConfig::default()
    })
    .map_err(|e| match e {
        kvbm_physical::PhysicalError::InvalidArgument(m) => {
            PyValueError::new_err(format!("io_nice: {m}"))
        }
        other => PyRuntimeError::new_err(format!("cannot start kvbm's I/O threads: {other}")),
    })?;
    let tm = Arc::new(tm);
    let primary = CpuPrimaryTier::over_memory(
        CpuManagerConfig::new(num_chunks),
        chunk_bytes,
        tm,
        Arc::new(memory),
    )
    .map_err(to_py)?;
    let shared = Arc::new(parking_lot::Mutex::new(primary));
    live.push(Registered {
        addr: ptr as usize,
        len,
        chunk_bytes,
        io_nice,
        primary: Arc::downgrade(&shared),
    });
    Ok(shared)
}

/// The disk file at `path` as kvbm-physical opens it (its directory created first).
pub(crate) fn disk_config(
    path: &std::path::Path,
    queue_depth: u32,
    direct_io: bool,
    buffer_pool_bytes: usize,
) -> PyResult<DiskConfig> {
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).map_err(|e| {
            PyRuntimeError::new_err(format!("cannot create {}: {e}", dir.display()))
        })?;
    }
    let mut disk = DiskConfig::new(path);
    disk.queue_depth = queue_depth;
    disk.direct_io = direct_io;
    disk.buffer_pool_bytes = buffer_pool_bytes;
    Ok(disk)
}

/// kvbm's configuration tree for a `kvbm_disk` tier: its keys mapped onto the tree the engine's
/// tier set reads (`kvbm_engine::stack::g3_of`), so vLLM's disk tier is built by the same code
/// as the replay's and an instance's G3:
///
/// | `kvbm_disk` key | tree key |
/// |---|---|
/// | `path` | `physical.disk.path` |
/// | `capacity` | `tiers.g3_blocks` |
/// | `queue_depth`, `direct_io`, `buffer_pool_mb` | `physical.disk.queue_depth`, `.direct_io`, `.buffer_pool_bytes` |
pub(crate) fn disk_tree(disk: DiskConfig, capacity: usize) -> KvbmConfig {
    let mut tree = KvbmConfig::default();
    tree.tiers.g3_blocks = capacity;
    tree.physical.disk = Some(disk);
    tree
}

/// Where a `kvbm_object` tier keeps its objects.
pub(crate) enum ObjectStore {
    /// An S3 bucket (`bucket`, `endpoint`, `region`, the credentials from the environment).
    S3(S3Config),
    /// A local directory (`dir`).
    Dir(std::path::PathBuf),
}

/// kvbm's configuration tree for a `kvbm_object` tier, as [`disk_tree`] for a disk tier (the
/// engine's tier set opens the store: `kvbm_engine::stack::secondary_object`):
///
/// | `kvbm_object` key | tree key |
/// |---|---|
/// | `bucket`, `endpoint`, `region`, `allow_http` (credentials from the environment) | `physical.s3` |
/// | `dir` | `physical.object_dir` |
/// | `namespace` | `physical.object.namespace` |
/// | `capacity` | `tiers.g4_blocks` |
pub(crate) fn object_tree(store: ObjectStore, namespace: String, capacity: usize) -> KvbmConfig {
    let mut tree = KvbmConfig::default();
    tree.tiers.g4_blocks = capacity;
    match store {
        ObjectStore::S3(s3) => tree.physical.s3 = Some(s3),
        ObjectStore::Dir(dir) => tree.physical.object_dir = Some(dir),
    }
    tree.physical.object = ObjectConfig {
        namespace,
        ..ObjectConfig::default()
    };
    tree
}

/// The [`ModelFingerprint`] of a vLLM tier's chunks, from the description the Python side
/// reads off vLLM's `OffloadingConfig` (`kvbm_vllm.tiers._fingerprint`): `model`, `dtype`,
/// `kv_layout` (str), `parallelism` (`("canonical",)` or `("engine", tp, pp, pcp, dcp)`) and
/// `parts` (a dict of str → str). The geometry is one chunk row of `chunk_bytes` bytes (in
/// elements of the dtype when kvbm knows its size).
pub(crate) fn fingerprint_of(
    d: &Bound<'_, PyDict>,
    chunk_bytes: usize,
) -> PyResult<ModelFingerprint> {
    fn item<'py>(d: &Bound<'py, PyDict>, k: &str) -> PyResult<Bound<'py, PyAny>> {
        d.get_item(k)?
            .ok_or_else(|| PyValueError::new_err(format!("model fingerprint: no {k:?} given")))
    }
    let text = |k: &str| -> PyResult<String> {
        item(d, k)?
            .extract::<String>()
            .map_err(|_| PyValueError::new_err(format!("model fingerprint: {k:?} must be a str")))
    };
    let (model, dtype, kv_layout) = (text("model")?, text("dtype")?, text("kv_layout")?);
    let par = item(d, "parallelism")?;
    let parallelism = match par.extract::<(String,)>() {
        Ok((k,)) if k == "canonical" => Parallelism::Canonical,
        _ => match par.extract::<(String, usize, usize, usize, usize)>() {
            Ok((k, tp, pp, pcp, dcp)) if k == "engine" => Parallelism::Engine { tp, pp, pcp, dcp },
            _ => {
                return Err(PyValueError::new_err(format!(
                    "model fingerprint: parallelism must be (\"canonical\",) or (\"engine\", tp, \
                     pp, pcp, dcp), got {par}"
                )));
            }
        },
    };
    let parts: std::collections::BTreeMap<String, String> =
        item(d, "parts")?.extract().map_err(|_| {
            PyValueError::new_err("model fingerprint: parts must be a dict of str to str")
        })?;
    let elem = kvbm_physical::fingerprint::dtype_size(&dtype).unwrap_or(1);
    if chunk_bytes == 0 || !chunk_bytes.is_multiple_of(elem) {
        return Err(PyValueError::new_err(format!(
            "model fingerprint: a chunk of {chunk_bytes} bytes is not whole {dtype} elements"
        )));
    }
    let geometry = LayoutConfig {
        num_blocks: 1,
        num_layers: 1,
        outer_dim: 1,
        page_size: chunk_bytes / elem,
        inner_dim: 1,
        dtype_bytes: elem,
    };
    parts
        .into_iter()
        .fold(
            ModelFingerprint::builder()
                .model(model)
                .dtype(dtype)
                .kv_layout(kv_layout)
                .geometry(geometry)
                .parallelism(parallelism),
            |b, (k, v)| b.part(k, v),
        )
        .build()
        .map_err(|e| PyValueError::new_err(e.to_string()))
}

/// A running tier and the registration of vLLM's region it moves bytes from and to.
struct Live {
    tier: AnyTier,
    /// Holds the region's buffer export; dropped with the tier at shutdown (the export is
    /// released with the last kvbm tier over the region), so vLLM can unmap its region.
    primary: SharedPrimary,
    /// Chunks in the region.
    num_chunks: usize,
}

/// The tier itself, shared by its Python object and (when kvbm's tiering manager drives it)
/// that manager's [`SharedTier`]; `None` after `shutdown`. Locked for one tier call at a
/// time, never across a call into Python.
type TierSlot = Arc<parking_lot::Mutex<Option<Live>>>;

/// kvbm's disk or object tier for vLLM's tiering manager: see the [module docs](self).
#[pyclass(module = "kvbm_vllm._kvbm")]
pub(crate) struct StorageTier {
    tier: TierSlot,
    contexts: Contexts,
    results: LookupMembers,
    finished: Vec<JobResult>,
}

impl StorageTier {
    fn tier(&self) -> PyResult<parking_lot::MappedMutexGuard<'_, AnyTier>> {
        parking_lot::MutexGuard::try_map(self.tier.lock(), |t| t.as_mut().map(|l| &mut l.tier))
            .map_err(|_| PyRuntimeError::new_err("the kvbm tier is shut down"))
    }
}

impl StorageTier {
    /// The tier for kvbm's tiering manager to drive in Rust ([`SharedTier`]); this object
    /// keeps reaching the same tier.
    pub(crate) fn share(this: &Bound<'_, StorageTier>) -> PyResult<SharedTier> {
        let me = this.borrow();
        let tier_type = me.tier()?.tier_type().to_string();
        Ok(SharedTier {
            slot: me.tier.clone(),
            tier_type,
            bp: SharedBackpressure(me.tier.clone()),
            py_bp: None,
            _owner: this.clone().unbind(),
        })
    }

    fn over(
        tier: AnyTier,
        primary: SharedPrimary,
        lookup_results: &Bound<'_, PyTuple>,
    ) -> PyResult<Self> {
        let num_chunks = primary.lock().manager().num_chunks();
        Ok(Self {
            tier: Arc::new(parking_lot::Mutex::new(Some(Live {
                tier,
                primary,
                num_chunks,
            }))),
            contexts: Contexts::default(),
            results: LookupMembers::from_tuple(lookup_results)?,
            finished: Vec::new(),
        })
    }
}

#[pymethods]
impl StorageTier {
    /// A disk tier. `region`: vLLM's `primary_kv_view` (writable, C-contiguous, `chunk_bytes`
    /// per chunk); `fingerprint`: what the chunks' bytes mean ([`fingerprint_of`]); `path`: the
    /// tier's file; `capacity`: chunk slots in it; `buffer_pool_bytes`: aligned I/O buffers the
    /// file keeps idle between jobs (`DiskConfig::buffer_pool_bytes`); `tier_type`: the name
    /// vLLM gave the tier (its configured `type`, in labels and events' ownership; default
    /// `kvbm_disk`), so the tier reads the same under kvbm's manager and vLLM's.
    /// `io_nice`: how much nicer than the caller the region's move threads run (0..=19; see
    /// "Memory" in the module docs; every tier over one region must give the same).
    #[staticmethod]
    #[pyo3(signature = (region, chunk_bytes, fingerprint, path, capacity, queue_depth, direct_io, buffer_pool_bytes, lookup_results, events = false, tier_type = None, io_nice = 0))]
    #[allow(clippy::too_many_arguments)]
    fn disk(
        region: &Bound<'_, PyAny>,
        chunk_bytes: usize,
        fingerprint: &Bound<'_, PyDict>,
        path: std::path::PathBuf,
        capacity: usize,
        queue_depth: u32,
        direct_io: bool,
        buffer_pool_bytes: usize,
        lookup_results: &Bound<'_, PyTuple>,
        events: bool,
        tier_type: Option<String>,
        io_nice: u8,
    ) -> PyResult<Self> {
        if capacity == 0 {
            return Err(PyValueError::new_err(
                "capacity: the disk tier needs at least one chunk slot",
            ));
        }
        let fingerprint = fingerprint_of(fingerprint, chunk_bytes)?;
        let primary = primary_over(region, chunk_bytes, io_nice)?;
        let tree = disk_tree(
            disk_config(&path, queue_depth, direct_io, buffer_pool_bytes)?,
            capacity,
        );
        let tier = kvbm_engine::stack::secondary_disk(&tree, &primary.lock(), &fingerprint)
            .map_err(|e| {
                PyRuntimeError::new_err(format!(
                    "cannot start the kvbm disk tier at {}: {e}",
                    path.display()
                ))
            })?;
        Self::over(
            Box::new(
                tier.with_tier_type(tier_type.as_deref().unwrap_or("kvbm_disk"))
                    .with_events(events),
            ),
            primary,
            lookup_results,
        )
    }

    /// An object tier: objects named by each key's hash under `namespace`, in the S3 bucket
    /// `bucket` (at `endpoint`, `None` for AWS) or, with `dir`, in a local directory;
    /// `capacity`: keys it remembers; `fingerprint` as for [`disk`](Self::disk) (objects live
    /// under `{namespace}/fp-{hex}/`); `tier_type` and `io_nice` as for [`disk`](Self::disk)
    /// (default type `kvbm_object`).
    #[staticmethod]
    #[pyo3(signature = (region, chunk_bytes, fingerprint, namespace, capacity, bucket, endpoint, s3_region, access_key, secret_key, dir, lookup_results, events = false, tier_type = None, io_nice = 0, allow_http = false))]
    #[allow(clippy::too_many_arguments)]
    fn object(
        region: &Bound<'_, PyAny>,
        chunk_bytes: usize,
        fingerprint: &Bound<'_, PyDict>,
        namespace: String,
        capacity: usize,
        bucket: Option<String>,
        endpoint: Option<String>,
        s3_region: String,
        access_key: Option<String>,
        secret_key: Option<String>,
        dir: Option<std::path::PathBuf>,
        lookup_results: &Bound<'_, PyTuple>,
        events: bool,
        tier_type: Option<String>,
        io_nice: u8,
        allow_http: bool,
    ) -> PyResult<Self> {
        if capacity == 0 {
            return Err(PyValueError::new_err(
                "capacity: the object tier must remember at least one key",
            ));
        }
        let fingerprint = fingerprint_of(fingerprint, chunk_bytes)?;
        let primary = primary_over(region, chunk_bytes, io_nice)?;
        let store = match (bucket, dir) {
            (Some(bucket), None) => ObjectStore::S3(S3Config {
                endpoint,
                bucket,
                region: s3_region,
                access_key: access_key.unwrap_or_default(),
                secret_key: secret_key.unwrap_or_default(),
                allow_http,
            }),
            (None, Some(dir)) => ObjectStore::Dir(dir),
            _ => {
                return Err(PyValueError::new_err(
                    "an object tier needs exactly one of bucket (S3) and dir (a local directory)",
                ));
            }
        };
        let tree = object_tree(store, namespace, capacity);
        let tier = kvbm_engine::stack::secondary_object(&tree, &primary.lock(), &fingerprint)
            .map_err(|e| {
                PyRuntimeError::new_err(format!("cannot start the kvbm object tier: {e}"))
            })?;
        Self::over(
            Box::new(
                tier.with_tier_type(tier_type.as_deref().unwrap_or("kvbm_object"))
                    .with_events(events),
            ),
            primary,
            lookup_results,
        )
    }

    /// A fleet tier (`kvbm_fleet`): a kvbm cluster instance whose G2 (`capacity` chunks of
    /// host memory) holds what vLLM stores, announced to and served to the instances of its
    /// namespace, with their chunks found in its index and pulled, verified, on a load
    /// ([`kvbm_cluster::fleet`]). The configuration is kvbm's one tree, merged as everywhere:
    /// `KVBM_CONFIG_PATH` and the `KVBM_*` environment, then `config_file`, then `settings`
    /// (dotted tree keys to values, from the tier's keys: its disk, `tiers.g3_blocks` and
    /// `physical.disk`, among them), then what the tier fixes (G1, G2 and G4's sizes). Security as `kvbm replay --instances`: without member credentials it refuses to
    /// start, naming the key, unless `security.insecure`.
    #[staticmethod]
    #[pyo3(signature = (region, chunk_bytes, fingerprint, capacity, settings, lookup_results, config_file = None, tier_type = None, io_nice = 0))]
    #[allow(clippy::too_many_arguments)]
    fn fleet(
        py: Python<'_>,
        region: &Bound<'_, PyAny>,
        chunk_bytes: usize,
        fingerprint: &Bound<'_, PyDict>,
        capacity: usize,
        settings: &Bound<'_, PyDict>,
        lookup_results: &Bound<'_, PyTuple>,
        config_file: Option<std::path::PathBuf>,
        tier_type: Option<String>,
        io_nice: u8,
    ) -> PyResult<Self> {
        if capacity == 0 {
            return Err(PyValueError::new_err(
                "capacity: the fleet tier needs at least one chunk of memory",
            ));
        }
        let fingerprint = fingerprint_of(fingerprint, chunk_bytes)?;
        let primary = primary_over(region, chunk_bytes, io_nice)?;
        let mut tree = kvbm_engine::config::ConfigBuilder::from_process_env()
            .map_err(|e| PyValueError::new_err(e.to_string()))?;
        if let Some(f) = &config_file {
            tree = tree
                .file(f)
                .map_err(|e| PyValueError::new_err(format!("config_file: {e}")))?;
        }
        for (k, v) in settings.iter() {
            let k: String = k.extract()?;
            tree = if let Ok(b) = v.extract::<bool>() {
                tree.set(k, b)
            } else if let Ok(i) = v.extract::<i64>() {
                tree.set(k, i)
            } else if let Ok(s) = v.extract::<String>() {
                tree.set(k, s)
            } else {
                return Err(PyValueError::new_err(format!(
                    "fleet setting {k}: a bool, an int or a str, got {v}"
                )));
            };
        }
        let tree = tree
            .set("tiers.g1_blocks", 1)
            .set("tiers.g2_blocks", capacity)
            .set("tiers.g4_blocks", 0)
            .set("logical.block_size", kvbm_tiering::tiering::TIER_BLOCK_SIZE);
        let tier_type = tier_type.unwrap_or_else(|| "kvbm_fleet".into());
        let primary_for_tier = primary.clone();
        let tier = py
            .detach(move || -> Result<FleetTier, String> {
                let rt = kvbm_engine::KvbmRuntime::builder()
                    .config_builder(tree)
                    .build()
                    .map_err(|e| e.to_string())?;
                let identities = Arc::new(kvbm_engine::stack::Identities::default());
                let instance = rt
                    .handle()
                    .tokio()
                    .block_on(
                        kvbm_cluster::instance::Instance::builder(&rt.handle())
                            .geometry(
                                CpuPrimaryTier::block_layout(1, chunk_bytes)
                                    .map_err(|e| e.to_string())?,
                            )
                            .fingerprint(fingerprint)
                            .identities(identities.clone())
                            .build(),
                    )
                    .map_err(|e| e.to_string())?;
                let tier = FleetTier::new(
                    Arc::new(instance),
                    identities,
                    &primary_for_tier.lock(),
                    tier_type,
                )
                .map_err(|e| e.to_string())?;
                Ok(tier.owning(rt))
            })
            .map_err(|e| {
                PyRuntimeError::new_err(format!("cannot start the kvbm fleet tier: {e}"))
            })?;
        Self::over(Box::new(tier), primary, lookup_results)
    }

    /// A fleet tier's counters and its instance's (`kvbm_fleet` only): chunks hit locally and
    /// through peers, stored, loaded from each, failed; the peers indexed; the data plane's
    /// refusals.
    fn fleet_stats<'py>(&mut self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let mut t = self.tier()?;
        let Some(f) = t.as_any_mut().downcast_ref::<FleetTier>() else {
            return Err(PyValueError::new_err("only a fleet tier has fleet stats"));
        };
        let s = f.stats();
        let d = PyDict::new(py);
        d.set_item("instance", f.instance().id().to_string())?;
        d.set_item("local_hits", s.local_hits)?;
        d.set_item("remote_hits", s.remote_hits)?;
        d.set_item("misses", s.misses)?;
        d.set_item("stored", s.stored)?;
        d.set_item("store_failed", s.store_failed)?;
        d.set_item("stored_disk", s.stored_disk)?;
        d.set_item("loaded_local", s.loaded_local)?;
        d.set_item("loaded_disk", s.loaded_disk)?;
        d.set_item("loaded_remote", s.loaded_remote)?;
        d.set_item("load_failed", s.load_failed)?;
        // The peers' entries (the index also follows this instance's own events).
        let (me, index) = (f.instance().id(), f.instance().index());
        let peers: Vec<_> = index.instances().into_iter().filter(|i| *i != me).collect();
        let entries: usize = peers.iter().map(|i| index.count_of(*i)).sum();
        d.set_item("peers", peers.len())?;
        d.set_item("index_entries", entries)?;
        if let Some(c) = f.instance().data_plane_client_stats() {
            d.set_item("digests_refused", c.digests_refused)?;
            d.set_item("entries_forgotten", c.entries_forgotten)?;
        }
        if let Some(dp) = f.instance().data_plane() {
            d.set_item("data_plane", dp.local_addr().to_string())?;
        }
        if let Some(sec) = f.instance().security().stats() {
            d.set_item("messages_accepted", sec.accepted())?;
            d.set_item("messages_refused", sec.rejected_total())?;
        }
        Ok(d)
    }

    fn lookup(&mut self, key_: &Bound<'_, PyAny>, ctx: &Bound<'_, PyAny>) -> PyResult<Py<PyAny>> {
        let k = key(key_)?;
        let c = self.contexts.get(ctx)?;
        let r = self.tier()?.lookup(&k, &c);
        Ok(self.results.get(key_.py(), r))
    }

    /// Starts a job: a store (cascade, primary → disk) or, with `is_promotion`, a load.
    #[pyo3(signature = (job_id, keys_, chunk_ids, is_promotion, ctx))]
    fn submit(
        &mut self,
        job_id: u64,
        keys_: &Bound<'_, PyAny>,
        chunk_ids: Vec<i64>,
        is_promotion: bool,
        ctx: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let ks = keys(keys_)?;
        if ks.len() != chunk_ids.len() {
            return Err(PyValueError::new_err(format!(
                "job {job_id}: {} keys but {} chunk ids",
                ks.len(),
                chunk_ids.len()
            )));
        }
        let num_chunks = self.tier.lock().as_ref().map_or(0, |l| l.num_chunks) as i64;
        if let Some(bad) = chunk_ids.iter().find(|&&c| c < 0 || c >= num_chunks) {
            return Err(PyValueError::new_err(format!(
                "job {job_id}: chunk id {bad} outside the primary region's {num_chunks} chunks"
            )));
        }
        let c = self.contexts.get(ctx)?;
        let job = Arc::new(TierJob {
            job_id,
            keys: ks.to_vec(),
            chunk_ids: chunk_ids.iter().map(|&c| c as i32).collect(),
            is_promotion,
            req_context: c,
            submit_time: Instant::now(),
        });
        let mut tier = self.tier()?;
        if is_promotion {
            tier.submit_load(job);
        } else {
            tier.submit_store(job);
        }
        Ok(())
    }

    /// Jobs finished since the last call: `(job_id, success, successful_keys, seconds, bytes)`.
    #[allow(clippy::type_complexity)]
    fn get_finished_jobs<'py>(
        &mut self,
        py: Python<'py>,
    ) -> PyResult<
        Vec<(
            u64,
            bool,
            Option<Bound<'py, pyo3::types::PyList>>,
            Option<f64>,
            Option<u64>,
        )>,
    > {
        let mut out = std::mem::take(&mut self.finished);
        self.tier()?.get_finished_jobs(&mut out);
        out.into_iter()
            .map(|r| {
                let keys = r
                    .successful_keys
                    .as_deref()
                    .map(|k| key_list(py, k))
                    .transpose()?;
                Ok((r.job_id, r.success, keys, r.transfer_time, r.transfer_bytes))
            })
            .collect()
    }

    /// Blocks until every submitted job finished (they are then reported by
    /// `get_finished_jobs`). Releases the GIL while waiting.
    fn drain_jobs(&mut self, py: Python<'_>) -> PyResult<()> {
        let slot = self.tier.clone();
        let r = py.detach(move || slot.lock().as_mut().map(|l| l.tier.drain_jobs()));
        match r {
            None => Err(PyRuntimeError::new_err("the kvbm tier is shut down")),
            Some(r) => r.map_err(to_py),
        }
    }

    fn has_pending_work(&mut self) -> bool {
        self.tier
            .lock()
            .as_ref()
            .is_some_and(|l| l.tier.has_pending_work())
    }

    /// The end of a scheduler step: the tier starts the step's stores (kvbm-tiering's
    /// `PhysicalTier`, "Stores start at the step's end"). vLLM's context is not read.
    fn on_schedule_end(&mut self) {
        if let Some(l) = self.tier.lock().as_mut() {
            l.tier
                .on_schedule_end(&kvbm_tiering::ScheduleEndContext::default());
        }
    }

    /// `"chunk_level"` or `"request_level"`.
    fn on_new_request(&mut self, ctx: &Bound<'_, PyAny>) -> PyResult<&'static str> {
        let c = self.contexts.get(ctx)?;
        Ok(crate::bridge::scope_name(
            self.tier()?.on_new_request(&c).policy,
        ))
    }

    fn on_request_finished(&mut self, ctx: &Bound<'_, PyAny>) -> PyResult<()> {
        let c = self.contexts.get(ctx)?;
        self.tier()?.on_request_finished(&c);
        self.contexts.forget(ctx)?;
        Ok(())
    }

    fn touch(&mut self, keys_: &Bound<'_, PyAny>, ctx: &Bound<'_, PyAny>) -> PyResult<()> {
        let ks = keys(keys_)?;
        let c = self.contexts.get(ctx)?;
        self.tier()?.touch(&ks, &c);
        Ok(())
    }

    /// Events of the tier's contents since the last call (when built with `events`), as
    /// `(keys, removed, req_context)`: a stored event's request is the caller's own
    /// `ReqContext` object (vLLM 0.34 puts it on the event), else `None`.
    #[allow(clippy::type_complexity)]
    fn take_events<'py>(
        &mut self,
        py: Python<'py>,
    ) -> PyResult<
        Vec<(
            Bound<'py, pyo3::types::PyList>,
            bool,
            Option<Bound<'py, PyAny>>,
        )>,
    > {
        let events = self.tier()?.take_events();
        events
            .into_iter()
            .map(|e| {
                let ctx = e
                    .req_context
                    .as_ref()
                    .and_then(|c| crate::bridge::origin(py, c));
                Ok((key_list(py, &e.keys)?, e.removed, ctx))
            })
            .collect()
    }

    /// Chunks written and ready on disk.
    fn num_ready(&mut self) -> usize {
        let mut slot = self.tier.lock();
        let Some(t) = slot.as_mut().map(|l| &mut l.tier) else {
            return 0;
        };
        let any = t.as_any_mut();
        if let Some(d) = any.downcast_ref::<RustDiskTier>() {
            return d.num_ready();
        }
        any.downcast_ref::<RustObjectTier>()
            .map_or(0, |o| o.num_ready())
    }

    /// A probe of the object store (`kvbm_object` only), for a thread other than the
    /// scheduler's: see [`Probe`].
    fn object_probe(&mut self) -> PyResult<Probe> {
        let mut t = self.tier()?;
        let Some(o) = t.as_any_mut().downcast_ref::<RustObjectTier>() else {
            return Err(PyValueError::new_err(
                "only an object tier has an object probe",
            ));
        };
        let probe = o.probe().map_err(to_py)?;
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("kvbm-object-probe")
            .enable_all()
            .build()
            .map_err(|e| PyRuntimeError::new_err(format!("cannot start the probe runtime: {e}")))?;
        Ok(Probe {
            probe,
            rt: Arc::new(rt),
        })
    }

    /// Makes `key` Ready in the object tier after a [`Probe`] found its object (another
    /// instance wrote it); whether it is Ready now.
    fn adopt(&mut self, key_: &Bound<'_, PyAny>) -> PyResult<bool> {
        let k = key(key_)?;
        let mut t = self.tier()?;
        match t.as_any_mut().downcast_mut::<RustObjectTier>() {
            Some(o) => Ok(o.adopt(&k)),
            None => Err(PyValueError::new_err("only an object tier adopts keys")),
        }
    }

    /// Waits for every job, then releases the file and vLLM's region. Idempotent.
    fn shutdown(&mut self, py: Python<'_>) -> PyResult<()> {
        let taken = self.tier.lock().take();
        if let Some(Live {
            mut tier,
            primary: _region,
            ..
        }) = taken
        {
            let r = py.detach(|| tier.shutdown());
            // Jobs drained by the shutdown are still reported.
            tier.get_finished_jobs(&mut self.finished);
            r.map_err(to_py)?;
        }
        Ok(())
    }
}

/// Asks an object tier's store whether a key's object is there (one header read), off the
/// scheduler thread: `present` blocks its caller (the GIL released) and shares nothing mutable
/// with the tier, so the tier keeps answering the scheduler meanwhile.
#[pyclass(module = "kvbm_vllm._kvbm", frozen)]
pub(crate) struct Probe {
    probe: ObjectProbe,
    rt: Arc<tokio::runtime::Runtime>,
}

#[pymethods]
impl Probe {
    /// Whether the store answers under the tier's namespace (one listing request, bounded by
    /// the store's timeouts and retries); a RuntimeError with the store's answer when not.
    fn check_access(&self, py: Python<'_>) -> PyResult<()> {
        let (probe, rt) = (self.probe.clone(), self.rt.clone());
        py.detach(move || rt.block_on(probe.check_access()))
            .map_err(|e| PyRuntimeError::new_err(e.to_string()))
    }

    /// Whether `key`'s object is in the store. A store that cannot be asked raises (a
    /// transient failure, not an absence).
    fn present(&self, py: Python<'_>, key_: &Bound<'_, PyAny>) -> PyResult<bool> {
        let k = key(key_)?;
        let (probe, rt) = (self.probe.clone(), self.rt.clone());
        py.detach(move || rt.block_on(probe.present(&k)))
            .map_err(|e| PyRuntimeError::new_err(e.to_string()))
    }
}

/// A kvbm tier driven by kvbm's tiering manager in Rust while its Python object
/// ([`StorageTier`]) keeps reaching it: each call locks the shared slot for that call only.
/// A tier that was shut down answers as an empty tier (misses, no jobs).
pub(crate) struct SharedTier {
    slot: TierSlot,
    tier_type: String,
    bp: SharedBackpressure,
    /// The detector vLLM's factory gave the tier's Python object (its `bp_detector`), asked and
    /// fed as vLLM's manager would; before the Rust tier's own.
    py_bp: Option<Box<dyn Backpressure + Send>>,
    /// Keeps the Python object, and with it the primary region's registration, alive.
    _owner: Py<StorageTier>,
}

impl SharedTier {
    /// Asks `detector` (the tier's Python detector) whether to store and feeds it completions.
    pub(crate) fn with_detector(mut self, detector: Box<dyn Backpressure + Send>) -> Self {
        self.py_bp = Some(detector);
        self
    }

    fn with<R>(&self, idle: R, f: impl FnOnce(&mut AnyTier) -> R) -> R {
        match self.slot.lock().as_mut() {
            Some(l) => f(&mut l.tier),
            None => idle,
        }
    }
}

impl SecondaryTierManager for SharedTier {
    fn tier_type(&self) -> &str {
        &self.tier_type
    }
    fn medium(&self) -> Option<kvbm_tiering::Medium> {
        self.with(None, |t| t.medium())
    }
    fn locality(&self) -> Option<kvbm_tiering::Locality> {
        self.with(None, |t| t.locality())
    }
    fn cache_hit_source(&self) -> kvbm_tiering::CacheHitSource {
        self.with(kvbm_tiering::CacheHitSource::ExternalUnspecified, |t| {
            t.cache_hit_source()
        })
    }
    fn block_size_bytes(&self) -> usize {
        self.with(0, |t| t.block_size_bytes())
    }
    fn bp_detector(&mut self) -> Option<&mut dyn Backpressure> {
        if self.py_bp.is_some() {
            return self
                .py_bp
                .as_deref_mut()
                .map(|d| d as &mut dyn Backpressure);
        }
        let has = self.with(false, |t| t.bp_detector().is_some());
        has.then_some(&mut self.bp as &mut dyn Backpressure)
    }
    fn lookup(&mut self, key: &OffloadKey, ctx: &ReqContext) -> LookupResult {
        self.with(LookupResult::Miss, |t| t.lookup(key, ctx))
    }
    fn submit_store(&mut self, job: Arc<TierJob>) {
        self.with((), |t| t.submit_store(job));
    }
    fn submit_load(&mut self, job: Arc<TierJob>) {
        self.with((), |t| t.submit_load(job));
    }
    fn get_finished_jobs(&mut self, out: &mut Vec<JobResult>) {
        self.with((), |t| t.get_finished_jobs(out));
    }
    fn drain_jobs(&mut self) -> kvbm_tiering::Result<()> {
        self.with(Ok(()), |t| t.drain_jobs())
    }
    fn on_new_request(&mut self, ctx: &ReqContext) -> RequestOffloadingContext {
        self.with(RequestOffloadingContext::default(), |t| {
            t.on_new_request(ctx)
        })
    }
    fn on_request_finished(&mut self, ctx: &ReqContext) {
        self.with((), |t| t.on_request_finished(ctx));
    }
    fn touch(&mut self, keys: &[OffloadKey], ctx: &ReqContext) {
        self.with((), |t| t.touch(keys, ctx));
    }
    fn take_events(&mut self) -> Vec<kvbm_tiering::OffloadingEvent> {
        self.with(Vec::new(), |t| t.take_events())
    }
    fn has_pending_work(&self) -> bool {
        self.with(false, |t| t.has_pending_work())
    }
    fn on_schedule_end(&mut self, context: &kvbm_tiering::ScheduleEndContext) {
        self.with((), |t| t.on_schedule_end(context));
    }
    fn shutdown(&mut self) -> kvbm_tiering::Result<()> {
        // The Python object shuts the tier down (it also reports the drained jobs); the
        // manager's shutdown stops it here the same way, once.
        let taken = self.slot.lock().take();
        match taken {
            // The region's registration goes with the tier, after it stopped.
            Some(Live {
                mut tier, primary, ..
            }) => {
                let r = tier.shutdown();
                drop(tier);
                drop(primary);
                r
            }
            None => Ok(()),
        }
    }
    fn get_stats(&mut self) -> Option<kvbm_tiering::OffloadingConnectorStats> {
        self.with(None, |t| t.get_stats())
    }
    fn as_any_mut(&mut self) -> &mut dyn std::any::Any {
        self
    }
}

/// The shared tier's back-pressure detector, reached through the slot for each call.
struct SharedBackpressure(TierSlot);

impl SharedBackpressure {
    fn with<R>(&self, idle: R, f: impl FnOnce(&mut dyn Backpressure) -> R) -> R {
        match self.0.lock().as_mut().and_then(|l| l.tier.bp_detector()) {
            Some(d) => f(d),
            None => idle,
        }
    }
}

impl Backpressure for SharedBackpressure {
    fn should_store(&mut self, num_blocks: usize) -> bool {
        self.with(true, |d| d.should_store(num_blocks))
    }
    fn on_store_completed(&mut self, job: &TierJob, num_bytes: u64) {
        self.with((), |d| d.on_store_completed(job, num_bytes));
    }
    fn on_store_failed(&mut self) {
        self.with((), |d| d.on_store_failed());
    }
    fn is_under_pressure(&mut self) -> bool {
        self.with(false, |d| d.is_under_pressure())
    }
    fn store_latency_ema(&mut self) -> Option<f64> {
        self.with(None, |d| d.store_latency_ema())
    }
    fn pop_stores_dropped(&mut self) -> (u64, u64) {
        self.with((0, 0), |d| d.pop_stores_dropped())
    }
    fn reset(&mut self) {
        self.with((), |d| d.reset());
    }
}
