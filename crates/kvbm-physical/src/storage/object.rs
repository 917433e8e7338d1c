//! G4 objects: one object per block, through `object_store` (S3, local filesystem, in-memory).
//!
//! An object's path is `{namespace}/{key}` (with tensor parallelism, `{namespace}/tp{world}.r{rank}/{key}`,
//! so each rank stores its own heads; with a [`ModelFingerprint`]
//! ([`ObjectStorage::with_fingerprint`]), `{namespace}/fp-{fingerprint}/[tp{world}.r{rank}/]{key}`,
//! so storages of different models, dtypes, layouts or ranks share a bucket and never list,
//! probe or read each other's blocks); the body is a [`BlockHeader`] followed by the block's
//! serialized payload, so a truncated body is a short read, an overwritten one a checksum
//! mismatch and a deleted one not-found. The header binds the block to its
//! [`BlockIdentity`], its namespace, key, rank and fingerprint ([`ObjectBinding`]) and its layout geometry
//! ([`geometry_digest`]): an object copied to another key, written under another namespace or
//! geometry, or by another rank is [`PhysicalError::IdentityMismatch`], never served.
//!
//! # One door to the store
//!
//! The raw `object_store` handle is private. Every request — block puts and gets, presence
//! probes, and the small-object operations the offload lock protocol needs
//! ([`try_create`](ObjectStorage::try_create), [`get_small`](ObjectStorage::get_small),
//! [`put_update`](ObjectStorage::put_update), [`delete`](ObjectStorage::delete)) — takes an
//! [`ObjectKey`], is prefixed with the namespace (and rank) here, and holds one of the
//! `max_concurrency` request permits for its whole duration (body streaming included), in the
//! manner of `object_store`'s `PrefixStore` and `LimitStore`. No caller can skip either.
//!
//! A transfer whose verified read proves an object damaged from the object alone (a complete
//! read whose checksum differs from its header's, a header that does not decode or disagrees
//! with the body, a body the store says has the wrong size, a header bound to another key,
//! namespace or rank, or naming an identity that is not its key's block) deletes it after
//! reporting the error, so presence probes stop counting it and the next offload of that block
//! writes it again ([`ObjectStorage::evicted_objects`] counts them). Nothing else deletes a
//! block object: a short read, an I/O error or a timeout may be transient, and a header naming
//! another identity of the same key, or another geometry, may be a valid object the reader
//! misnamed (presence probes count it foreign, so the next offload overwrites it).
//!
//! Bodies are size-checked from the store's metadata before they are read: a block body must be
//! exactly header + payload, a small object at most the caller's limit. Bodies above
//! `multipart_threshold` go up in parts; an upload that fails or whose future is dropped is
//! aborted, so no incomplete multipart upload is left behind.

use std::path::Path;
use std::sync::{Arc, OnceLock};

use bytes::Bytes;
use futures::StreamExt;
use object_store::path::Path as ObjectPath;
use object_store::{
    GetOptions, GetRange, GetResultPayload, MultipartUpload, ObjectStore, ObjectStoreExt, PutMode,
    PutOptions, PutPayload, UpdateVersion,
};
use tokio::sync::Semaphore;

use crate::checksum::{BlockHeader, HEADER_LEN, checksum_slices};
use crate::error::{PhysicalError, Result};
use crate::fingerprint::ModelFingerprint;
use crate::identity::{BlockIdentity, ObjectBinding, geometry_digest};
use crate::layout::LayoutConfig;
use crate::storage::{ObjectKey, ObjectPutMode, Storage, StorageKind};

/// Where an S3-compatible server is.
///
/// `Debug` and `Serialize` print `secret_key` as [`REDACTED`]; only deserializing reads it.
#[derive(Clone, PartialEq, Eq, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct S3Config {
    /// `http(s)://host:port`; `None` for AWS itself.
    #[serde(default)]
    pub endpoint: Option<String>,
    /// Bucket name.
    pub bucket: String,
    /// Region. Default: `us-east-1`.
    #[serde(default = "default_region")]
    pub region: String,
    /// Access key id.
    pub access_key: String,
    /// Secret access key. Never printed.
    pub secret_key: String,
    /// Accept a plain `http://` endpoint off the loopback interface. Default: `false`: an
    /// on-path party could read every object and change any (so, too, a verified read over
    /// such an endpoint never deletes the object it refused; see
    /// [`ObjectStorage::evicts_damaged`]). On loopback plain `http` is accepted without it.
    #[serde(default)]
    pub allow_http: bool,
}

/// What [`S3Config`] prints instead of its secret.
pub const REDACTED: &str = "<redacted>";

/// Whether `endpoint` is plain `http` off the loopback interface: refused unless
/// [`S3Config::allow_http`], and never trusted to prove an object damaged.
fn plain_http_off_loopback(endpoint: &str) -> bool {
    endpoint.starts_with("http://") && !crate::net::is_loopback(endpoint)
}

fn default_region() -> String {
    "us-east-1".into()
}

impl std::fmt::Debug for S3Config {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("S3Config")
            .field("endpoint", &self.endpoint)
            .field("bucket", &self.bucket)
            .field("region", &self.region)
            .field("access_key", &self.access_key)
            .field("secret_key", &REDACTED)
            .field("allow_http", &self.allow_http)
            .finish()
    }
}

impl serde::Serialize for S3Config {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        use serde::ser::SerializeStruct;
        let mut st = s.serialize_struct("S3Config", 6)?;
        st.serialize_field("endpoint", &self.endpoint)?;
        st.serialize_field("bucket", &self.bucket)?;
        st.serialize_field("region", &self.region)?;
        st.serialize_field("access_key", &self.access_key)?;
        st.serialize_field("secret_key", REDACTED)?;
        st.serialize_field("allow_http", &self.allow_http)?;
        st.end()
    }
}

/// Object-tier settings.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ObjectConfig {
    /// Key prefix for every object. Default: `kvbm`.
    pub namespace: String,
    /// Requests in flight per storage. Default: 16.
    pub max_concurrency: usize,
    /// Bodies larger than this use multipart upload. Default: 32 MiB.
    pub multipart_threshold: usize,
    /// Part size for multipart uploads (S3 needs ≥ 5 MiB). Default: 8 MiB.
    pub part_size: usize,
    /// Tensor-parallel rank of this worker. Default: 0.
    pub tp_rank: usize,
    /// Tensor-parallel world size. With more than one rank, every key is stored under
    /// `tp{world}.r{rank}/` so ranks never read each other's heads. Default: 1.
    pub tp_world_size: usize,
    /// S3 only: the longest one HTTP request may take, body included (ms). Default: 30000.
    pub request_timeout_ms: u64,
    /// S3 only: the longest a connection may take to open (ms). Default: 2000.
    pub connect_timeout_ms: u64,
    /// S3 only: retries of a failed request (5xx, connection errors; timeouts only for
    /// idempotent requests), with exponential backoff. 0 disables retries. Default: 3.
    pub max_retries: usize,
    /// S3 only: no retry starts later than this after the first attempt (ms). Default: 10000.
    pub retry_timeout_ms: u64,
    /// S3 only: first backoff between retries (ms; doubled each retry). Default: 100.
    pub retry_initial_backoff_ms: u64,
    /// S3 only: longest backoff between retries (ms). Default: 2000.
    pub retry_max_backoff_ms: u64,
}

impl ObjectConfig {
    /// Checks the settings: `tp_world_size` at least 1 and `tp_rank` below it (a rank outside
    /// its world would share another rank's keys or none at all).
    ///
    /// # Errors
    /// [`PhysicalError::InvalidArgument`] naming the key (`physical.object.tp_rank` /
    /// `physical.object.tp_world_size`) and both values.
    pub fn validate(&self) -> Result<()> {
        if self.tp_world_size == 0 {
            return Err(PhysicalError::InvalidArgument(
                "physical.object.tp_world_size must be at least 1, got 0".into(),
            ));
        }
        if self.tp_rank >= self.tp_world_size {
            return Err(PhysicalError::InvalidArgument(format!(
                "physical.object.tp_rank must be below physical.object.tp_world_size: \
                 tp_rank = {}, tp_world_size = {}",
                self.tp_rank, self.tp_world_size
            )));
        }
        Ok(())
    }
}

impl Default for ObjectConfig {
    fn default() -> Self {
        ObjectConfig {
            namespace: "kvbm".into(),
            max_concurrency: 16,
            multipart_threshold: 32 << 20,
            part_size: 8 << 20,
            tp_rank: 0,
            tp_world_size: 1,
            request_timeout_ms: 30_000,
            connect_timeout_ms: 2_000,
            max_retries: 3,
            retry_timeout_ms: 10_000,
            retry_initial_backoff_ms: 100,
            retry_max_backoff_ms: 2_000,
        }
    }
}

/// What a presence probe found at a block's key.
///
/// Equality compares the variant and, for [`ObjectPresence::Foreign`], the error's message.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub enum ObjectPresence {
    /// Nothing there.
    Absent,
    /// An object whose header binds this key, namespace, rank, identity (and geometry, when
    /// known). Its payload is verified only when it is read.
    Present,
    /// An object that is not this block (another key's, another geometry's, corrupt): it
    /// counts as absent, and the next put replaces it. The error says what differed.
    Foreign(PhysicalError),
}

impl PartialEq for ObjectPresence {
    fn eq(&self, other: &Self) -> bool {
        match (self, other) {
            (ObjectPresence::Absent, ObjectPresence::Absent)
            | (ObjectPresence::Present, ObjectPresence::Present) => true,
            (ObjectPresence::Foreign(a), ObjectPresence::Foreign(b)) => {
                a.to_string() == b.to_string()
            }
            _ => false,
        }
    }
}
impl Eq for ObjectPresence {}

/// What [`ObjectStorage::stored_identity`] found at a block's key.
#[derive(Debug)]
#[non_exhaustive]
pub enum StoredIdentity {
    /// Nothing there.
    Absent,
    /// An intact header bound to this key, namespace, rank (and geometry, when known),
    /// recording this identity. Its payload is verified only when it is read.
    Bound(BlockIdentity),
    /// A corrupt header, or one bound elsewhere: not a block of this key.
    Foreign(PhysicalError),
}

/// A small object read whole by [`ObjectStorage::get_small`].
#[derive(Debug, Clone)]
pub struct SmallObject {
    /// The body.
    pub body: Bytes,
    /// Its version, for a conditional [`ObjectStorage::put_update`].
    pub version: UpdateVersion,
}

/// Result of a conditional update.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum UpdateOutcome {
    /// The object was still at the given version and now holds the new body.
    Updated,
    /// It changed or vanished meanwhile; nothing was written.
    Conflict,
    /// The store (or the version, lacking an ETag) cannot do conditional updates.
    Unsupported,
}

/// An object tier.
#[derive(Debug)]
pub struct ObjectStorage {
    store: Arc<dyn ObjectStore>,
    config: ObjectConfig,
    permits: Semaphore,
    /// The block geometry of the first object layout bound to this storage (presence probes
    /// check it when known).
    geometry: OnceLock<LayoutConfig>,
    /// The fingerprint every path and binding is scoped by (none: unscoped, the layout before
    /// fingerprints).
    fingerprint: Option<ModelFingerprint>,
    /// Set when `config` failed [`ObjectConfig::validate`]: every request is refused with it.
    invalid: Option<PhysicalError>,
    /// Objects a verified read proved damaged and deleted ([`evicted_objects`](Self::evicted_objects)).
    evicted: std::sync::atomic::AtomicU64,
    /// Whether a proven-damaged object may be deleted ([`evicts_damaged`](Self::evicts_damaged)).
    evicts: bool,
}

/// Aborts a multipart upload whose `put_block` future is dropped before it finished (a failed
/// one is aborted in place).
struct AbortOnDrop(Option<Box<dyn MultipartUpload>>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        if let Some(mut up) = self.0.take()
            && let Ok(rt) = tokio::runtime::Handle::try_current()
        {
            rt.spawn(async move {
                if let Err(e) = up.abort().await {
                    tracing::warn!(error = %e, "cannot abort an interrupted multipart upload");
                }
            });
        }
    }
}

/// Splits `header + parts` into multipart parts of `part_size` bytes (the last may be
/// shorter), without copying the payload.
fn split_parts(header: Bytes, parts: Vec<Bytes>, part_size: usize) -> Vec<PutPayload> {
    let mut out = Vec::new();
    let mut cur: Vec<Bytes> = Vec::new();
    let mut cur_len = 0;
    for mut b in std::iter::once(header).chain(parts) {
        while !b.is_empty() {
            let n = (part_size - cur_len).min(b.len());
            cur.push(b.split_to(n));
            cur_len += n;
            if cur_len == part_size {
                out.push(std::mem::take(&mut cur).into_iter().collect());
                cur_len = 0;
            }
        }
    }
    if cur_len > 0 {
        out.push(cur.into_iter().collect());
    }
    out
}

impl ObjectStorage {
    /// Wraps any `object_store` backend. The store is used only through this storage's
    /// namespace and request limit. A `config` that fails [`ObjectConfig::validate`] gives a
    /// storage that refuses every request with that error (use [`try_new`](Self::try_new),
    /// [`s3`](Self::s3) or [`local`](Self::local) to get the error up front).
    pub fn new(store: Arc<dyn ObjectStore>, config: ObjectConfig) -> Self {
        let permits = Semaphore::new(config.max_concurrency.max(1));
        ObjectStorage {
            store,
            invalid: config.validate().err(),
            config,
            permits,
            geometry: OnceLock::new(),
            fingerprint: None,
            evicted: std::sync::atomic::AtomicU64::new(0),
            evicts: true,
        }
    }

    /// Whether a verified read that proves an object damaged deletes it (so it is rewritten):
    /// true for a local directory, memory, an `https` (or AWS) S3 endpoint and plain `http` on
    /// the loopback interface (no path to be on); false over plain `http` off loopback (only
    /// with [`S3Config::allow_http`]), where the damage may have been made in transit by an
    /// on-path party, who could otherwise delete any valid shared object. A refused object is
    /// never served either way.
    pub fn evicts_damaged(&self) -> bool {
        self.evicts
    }

    /// How many objects this storage deleted because a verified read proved them damaged
    /// from the object alone: a complete read whose checksum differs from its header's, a
    /// header that does not decode or disagrees with the body, a size the store confirms
    /// wrong, a header bound to another key, namespace or rank, or naming an identity that is
    /// not its key's block. A short read, an I/O error, a timeout or a header naming another
    /// identity of the same key leaves an object in place.
    pub fn evicted_objects(&self) -> u64 {
        self.evicted.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Counts one object deleted as damaged (see [`evicted_objects`](Self::evicted_objects)).
    pub(crate) fn count_evicted(&self) {
        self.evicted
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }

    /// [`new`](Self::new), refusing a `config` that fails [`ObjectConfig::validate`].
    ///
    /// # Errors
    /// The validation error, naming the key.
    pub fn try_new(store: Arc<dyn ObjectStore>, config: ObjectConfig) -> Result<Self> {
        config.validate()?;
        Ok(Self::new(store, config))
    }

    /// An S3-compatible store (`AmazonS3Builder`, path-style, http allowed for endpoints).
    ///
    /// # Errors
    /// A `config` failing [`ObjectConfig::validate`]; a client that cannot be built.
    pub fn s3(s3: &S3Config, config: ObjectConfig) -> Result<Self> {
        config.validate()?;
        let mut storage = Self::new(Self::s3_client_with(s3, &config)?, config);
        storage.evicts = !s3.endpoint.as_deref().is_some_and(plain_http_off_loopback);
        Ok(storage)
    }

    /// A bare S3 client for `s3`, configured as [`s3`](Self::s3) configures its own: for callers
    /// that need a raw `object_store` baseline (benchmarks) or to wrap it themselves with
    /// [`new`](Self::new). Requests made through it bypass every storage's namespace and limit.
    pub fn s3_client(s3: &S3Config) -> Result<Arc<dyn ObjectStore>> {
        Self::s3_client_with(s3, &ObjectConfig::default())
    }

    /// [`s3_client`](Self::s3_client) with `config`'s timeouts and retry policy: each request
    /// is bounded by `request_timeout_ms` (connecting by `connect_timeout_ms`); a failed one is
    /// retried up to `max_retries` times with exponential backoff while `retry_timeout_ms` has
    /// not passed (`object_store` retries timeouts only for idempotent requests).
    pub fn s3_client_with(s3: &S3Config, config: &ObjectConfig) -> Result<Arc<dyn ObjectStore>> {
        use std::time::Duration;
        let ms = Duration::from_millis;
        let retry = object_store::RetryConfig {
            backoff: object_store::BackoffConfig {
                init_backoff: ms(config.retry_initial_backoff_ms),
                max_backoff: ms(config
                    .retry_max_backoff_ms
                    .max(config.retry_initial_backoff_ms)),
                base: 2.0,
            },
            max_retries: config.max_retries,
            retry_timeout: ms(config.retry_timeout_ms),
        };
        let options = object_store::ClientOptions::new()
            .with_timeout(ms(config.request_timeout_ms.max(1)))
            .with_connect_timeout(ms(config.connect_timeout_ms.max(1)));
        let mut b = object_store::aws::AmazonS3Builder::new()
            .with_retry(retry)
            .with_client_options(options)
            .with_bucket_name(&s3.bucket)
            .with_region(&s3.region)
            .with_access_key_id(&s3.access_key)
            .with_secret_access_key(&s3.secret_key)
            .with_virtual_hosted_style_request(false);
        if let Some(ep) = &s3.endpoint {
            if plain_http_off_loopback(ep) && !s3.allow_http {
                return Err(PhysicalError::InvalidArgument(format!(
                    "physical.s3.endpoint {ep}: plain http off the loopback interface is \
                     refused (anyone on the path could read every object and change any); use \
                     https, or set physical.s3.allow_http = true"
                )));
            }
            b = b
                .with_endpoint(ep)
                .with_allow_http(ep.starts_with("http://"));
        }
        let store = b
            .build()
            .map_err(|e| PhysicalError::object("build s3 client", &s3.bucket, e))?;
        Ok(Arc::new(store))
    }

    /// A local-filesystem store rooted at `root` (created if missing).
    pub fn local(root: &Path, config: ObjectConfig) -> Result<Self> {
        config.validate()?;
        std::fs::create_dir_all(root)
            .map_err(|e| PhysicalError::io("create object root", Some(root), e))?;
        let store = object_store::local::LocalFileSystem::new_with_prefix(root).map_err(|e| {
            PhysicalError::object("open local store", &root.display().to_string(), e)
        })?;
        Ok(Self::new(Arc::new(store), config))
    }

    /// An in-memory store (tests).
    pub fn in_memory(config: ObjectConfig) -> Self {
        Self::new(Arc::new(object_store::memory::InMemory::new()), config)
    }

    /// The settings.
    pub fn config(&self) -> &ObjectConfig {
        &self.config
    }

    /// Scopes every path (`{namespace}/fp-{fingerprint}/…`) and every header binding by
    /// `fingerprint`: objects written under another fingerprint are never listed, probed or
    /// read here (see [`crate::fingerprint`]).
    pub fn with_fingerprint(mut self, fingerprint: ModelFingerprint) -> Self {
        self.fingerprint = Some(fingerprint);
        self
    }

    /// The fingerprint this storage is scoped by, if any.
    pub fn fingerprint(&self) -> Option<&ModelFingerprint> {
        self.fingerprint.as_ref()
    }

    /// Records the block geometry of an object layout bound to this storage (the first one
    /// wins); presence probes then check it too.
    pub(crate) fn bind_geometry(&self, geometry: &LayoutConfig) {
        let _ = self.geometry.set(*geometry);
    }

    /// One of the `max_concurrency` request slots, held for the request's duration.
    /// Refused with the configuration error when the config is invalid.
    async fn permit(&self) -> Result<tokio::sync::SemaphorePermit<'_>> {
        if let Some(e) = &self.invalid {
            return Err(e.clone());
        }
        Ok(self
            .permits
            .acquire()
            .await
            .expect("semaphore never closed"))
    }

    /// The full path of `key`: namespace, rank directory (with tensor parallelism), key. For
    /// logs; every request computes it itself.
    pub fn path(&self, key: &ObjectKey) -> ObjectPath {
        let c = &self.config;
        let scope = match &self.fingerprint {
            Some(fp) => format!("{}/{}", c.namespace, fp.key_segment()),
            None => c.namespace.clone(),
        };
        if c.tp_world_size > 1 {
            ObjectPath::from(format!(
                "{scope}/tp{}.r{}/{}",
                c.tp_world_size,
                c.tp_rank,
                key.as_str()
            ))
        } else {
            ObjectPath::from(format!("{scope}/{}", key.as_str()))
        }
    }

    fn binding(&self, key: &ObjectKey) -> u128 {
        ObjectBinding {
            namespace: &self.config.namespace,
            key: key.as_str(),
            rank: self.config.tp_rank,
            world_size: self.config.tp_world_size.max(1),
            fingerprint: self.fingerprint.as_ref(),
        }
        .digest()
    }

    /// Stores a block: header (binding `identity`, key, namespace, rank and `geometry`) +
    /// `parts` (the serialized payload, in order).
    pub async fn put_block(
        &self,
        key: &ObjectKey,
        identity: &BlockIdentity,
        geometry: &LayoutConfig,
        parts: Vec<Bytes>,
        mode: ObjectPutMode,
    ) -> Result<()> {
        let len: usize = parts.iter().map(|p| p.len()).sum();
        let header = BlockHeader {
            len: len as u64,
            slot: geometry_digest(geometry),
            checksum: checksum_slices(parts.iter().map(|p| &p[..])),
            identity: *identity,
            binding: self.binding(key),
        };
        let path = self.path(key);
        let _permit = self.permit().await?;
        let body_len = len + HEADER_LEN;
        if body_len > self.config.multipart_threshold && mode == ObjectPutMode::Overwrite {
            let upload = self
                .store
                .put_multipart(&path)
                .await
                .map_err(|e| PhysicalError::object("put_multipart", path.as_ref(), e))?;
            let mut guard = AbortOnDrop(Some(upload));
            let up = guard.0.as_mut().expect("just set");
            let header = Bytes::copy_from_slice(&header.to_bytes());
            let part_size = self.config.part_size.max(5 << 20);
            let uploads: Vec<_> = split_parts(header, parts, part_size)
                .into_iter()
                .map(|p| up.put_part(p))
                .collect();
            let result = match futures::future::try_join_all(uploads).await {
                Ok(_) => up.complete().await.map(|_| ()),
                Err(e) => Err(e),
            };
            match result {
                Ok(()) => {
                    guard.0 = None;
                    return Ok(());
                }
                Err(e) => {
                    if let Some(mut up) = guard.0.take()
                        && let Err(abort) = up.abort().await
                    {
                        tracing::warn!(error = %abort, path = %path, "cannot abort a failed multipart upload");
                    }
                    return Err(PhysicalError::object("put_multipart", path.as_ref(), e));
                }
            }
        }
        let payload: PutPayload = std::iter::once(Bytes::copy_from_slice(&header.to_bytes()))
            .chain(parts)
            .collect();
        let opts = PutOptions {
            mode: match mode {
                ObjectPutMode::Overwrite => PutMode::Overwrite,
                ObjectPutMode::Create => PutMode::Create,
            },
            ..Default::default()
        };
        self.store
            .put_opts(&path, payload, opts)
            .await
            .map_err(|e| PhysicalError::object("put", path.as_ref(), e))?;
        Ok(())
    }

    /// Checks a body's size from the store's metadata before reading it: larger than a header
    /// plus `expected_len` is refused unread.
    fn check_size(path: &ObjectPath, size: u64, expected_len: usize) -> Result<()> {
        let limit = (expected_len + HEADER_LEN) as u64;
        if size > limit {
            return Err(PhysicalError::TooLarge {
                location: format!("object:{path}"),
                size,
                limit,
            });
        }
        Ok(())
    }

    /// Fetches and verifies a block whose payload must be `expected_len` bytes, written for
    /// `identity` under `geometry` at this key, namespace and rank; returns the payload.
    pub async fn get_block(
        &self,
        key: &ObjectKey,
        identity: &BlockIdentity,
        geometry: &LayoutConfig,
    ) -> Result<Bytes> {
        let expected_len = geometry.block_bytes();
        let path = self.path(key);
        let loc = || format!("object:{path}");
        let body = {
            let _permit = self.permit().await?;
            let got = self
                .store
                .get(&path)
                .await
                .map_err(|e| PhysicalError::object("get", path.as_ref(), e))?;
            Self::check_size(&path, got.meta.size, expected_len)?;
            got.bytes()
                .await
                .map_err(|e| PhysicalError::object("get body", path.as_ref(), e))?
        };
        let expect = self.expectation(key, identity, geometry);
        verify_body(&body, &expect, &loc)
    }

    fn expectation(
        &self,
        key: &ObjectKey,
        identity: &BlockIdentity,
        geometry: &LayoutConfig,
    ) -> Expect {
        Expect {
            len: geometry.block_bytes(),
            geometry: geometry_digest(geometry),
            binding: self.binding(key),
            identity: *identity,
        }
    }

    /// Fetches and verifies a block like [`get_block`](Self::get_block), but hands the payload
    /// to `sink(offset, bytes)` as it arrives instead of collecting it: each chunk of the body
    /// is hashed and passed on while it is in cache, and no body-sized buffer is allocated.
    /// `sink` sees contiguous, increasing payload offsets, never past the block's length. The
    /// result (and its error kinds) is that of `get_block`; on an error, whatever `sink`
    /// received is unverified and must not be used.
    pub(crate) async fn get_block_into(
        &self,
        key: &ObjectKey,
        identity: &BlockIdentity,
        geometry: &LayoutConfig,
        mut sink: impl FnMut(usize, &[u8]) + Send,
    ) -> Result<()> {
        let expect = self.expectation(key, identity, geometry);
        let expected_len = expect.len;
        let path = self.path(key);
        let loc = || format!("object:{path}");
        let body_err = |e| PhysicalError::object("get body", path.as_ref(), e);
        let _permit = self.permit().await?;
        let got = self
            .store
            .get(&path)
            .await
            .map_err(|e| PhysicalError::object("get", path.as_ref(), e))?;
        Self::check_size(&path, got.meta.size, expected_len)?;
        if !matches!(got.payload, GetResultPayload::Stream(_)) {
            // A local file: one read beats the fs backend's small chunked reads.
            let body = got.bytes().await.map_err(body_err)?;
            sink(0, &verify_body(&body, &expect, &loc)?);
            return Ok(());
        }
        let mut stream = got.into_stream();
        let mut header = [0u8; HEADER_LEN];
        let mut head_len = 0;
        let mut decoded: Option<BlockHeader> = None;
        let mut payload_len = 0usize;
        let mut hasher = crate::checksum::Checksummer::new();
        while let Some(chunk) = stream.next().await {
            let chunk = chunk.map_err(body_err)?;
            let mut rest = &chunk[..];
            if decoded.is_none() {
                let n = (HEADER_LEN - head_len).min(rest.len());
                header[head_len..head_len + n].copy_from_slice(&rest[..n]);
                head_len += n;
                rest = &rest[n..];
                if head_len < HEADER_LEN {
                    continue;
                }
                let h = BlockHeader::decode(&header, &loc)?;
                // Foreign objects are refused before any of their payload reaches the sink.
                expect.bound(&h, &loc)?;
                decoded = Some(h);
            }
            hasher.update(rest);
            if payload_len < expected_len {
                let n = rest.len().min(expected_len - payload_len);
                sink(payload_len, &rest[..n]);
            }
            payload_len += rest.len();
        }
        let h = match decoded {
            Some(h) => h,
            // Shorter than a header: the same error `get_block` reports.
            None => BlockHeader::decode(&header[..head_len], &loc)?,
        };
        check_payload(&h, &expect, payload_len, &loc)?;
        h.verify(hasher.finish(), &loc)
    }

    /// Whether the block `identity` is stored at `key`: reads only the object's header (one
    /// ranged GET, like a HEAD) and checks its binding (key, namespace, rank), identity and,
    /// when the storage knows its geometry, the geometry. A foreign or corrupt header is
    /// [`ObjectPresence::Foreign`], which callers count as absent so the block is rewritten.
    pub async fn probe(&self, key: &ObjectKey, identity: &BlockIdentity) -> Result<ObjectPresence> {
        Ok(match self.stored_identity(key).await? {
            StoredIdentity::Absent => ObjectPresence::Absent,
            StoredIdentity::Foreign(e) => ObjectPresence::Foreign(e),
            StoredIdentity::Bound(found) if found == *identity => ObjectPresence::Present,
            StoredIdentity::Bound(found) => {
                ObjectPresence::Foreign(PhysicalError::IdentityMismatch {
                    location: format!("object:{}", self.path(key)),
                    what: "block identity",
                    expected: identity.to_hex(),
                    found: found.to_hex(),
                })
            }
        })
    }

    /// The identity the header of the object at `key` records, when the header is intact and
    /// binds this key, namespace, rank (and geometry, when known): one ranged GET of the
    /// header, like [`probe`](Self::probe), but the identity is read, not required. What a
    /// reader that knows a block only by name (adopted from another instance's event or a
    /// presence check) registers it with, so its later verified read expects what the object
    /// says (the caller still checks that identity against the block's name).
    pub async fn stored_identity(&self, key: &ObjectKey) -> Result<StoredIdentity> {
        let path = self.path(key);
        let loc = || format!("object:{path}");
        let head = {
            let _permit = self.permit().await?;
            let opts = GetOptions {
                range: Some(GetRange::Bounded(0..HEADER_LEN as u64)),
                ..Default::default()
            };
            let got = match self.store.get_opts(&path, opts).await {
                Ok(g) => g,
                Err(object_store::Error::NotFound { .. }) => return Ok(StoredIdentity::Absent),
                Err(e) => return Err(PhysicalError::object("get header", path.as_ref(), e)),
            };
            if let Some(g) = self.geometry.get() {
                let want = (g.block_bytes() + HEADER_LEN) as u64;
                if got.meta.size != want {
                    return Ok(StoredIdentity::Foreign(PhysicalError::CorruptHeader {
                        location: loc(),
                        reason: format!("object has {} bytes, a block {want}", got.meta.size),
                    }));
                }
            }
            got.bytes()
                .await
                .map_err(|e| PhysicalError::object("get header", path.as_ref(), e))?
        };
        let h = match BlockHeader::decode(&head, &loc) {
            Ok(h) => h,
            Err(e) => return Ok(StoredIdentity::Foreign(e)),
        };
        let geometry = self.geometry.get().map(geometry_digest);
        let check = || -> Result<()> {
            if let Some(g) = geometry
                && h.slot != g
            {
                return Err(PhysicalError::IdentityMismatch {
                    location: loc(),
                    what: "layout geometry",
                    expected: format!("{g:016x}"),
                    found: format!("{:016x}", h.slot),
                });
            }
            h.expect_bound(
                h.len as usize,
                h.slot,
                ("object binding", self.binding(key)),
                &h.identity,
                &loc,
            )
        };
        Ok(match check() {
            Ok(()) => StoredIdentity::Bound(h.identity),
            Err(e) => StoredIdentity::Foreign(e),
        })
    }

    /// Conditional create: stores `body` at `key` only if nothing is there. `Ok(true)` when
    /// created, `Ok(false)` when the key already existed (someone else holds the lock).
    pub async fn try_create(&self, key: &ObjectKey, body: Bytes) -> Result<bool> {
        let path = self.path(key);
        let opts = PutOptions {
            mode: PutMode::Create,
            ..Default::default()
        };
        let _permit = self.permit().await?;
        match self.store.put_opts(&path, body.into(), opts).await {
            Ok(_) => Ok(true),
            Err(object_store::Error::AlreadyExists { .. })
            | Err(object_store::Error::Precondition { .. }) => Ok(false),
            Err(e) => Err(PhysicalError::object("conditional put", path.as_ref(), e)),
        }
    }

    /// Reads a small object (a lock record) whole, with its version. `Ok(None)` when absent;
    /// a body above `max_bytes` (per the store's metadata) is [`PhysicalError::TooLarge`],
    /// refused unread.
    pub async fn get_small(
        &self,
        key: &ObjectKey,
        max_bytes: usize,
    ) -> Result<Option<SmallObject>> {
        let path = self.path(key);
        let _permit = self.permit().await?;
        let got = match self.store.get(&path).await {
            Ok(g) => g,
            Err(object_store::Error::NotFound { .. }) => return Ok(None),
            Err(e) => return Err(PhysicalError::object("get", path.as_ref(), e)),
        };
        if got.meta.size > max_bytes as u64 {
            return Err(PhysicalError::TooLarge {
                location: format!("object:{path}"),
                size: got.meta.size,
                limit: max_bytes as u64,
            });
        }
        let version = UpdateVersion {
            e_tag: got.meta.e_tag.clone(),
            version: got.meta.version.clone(),
        };
        match got.bytes().await {
            Ok(body) => Ok(Some(SmallObject { body, version })),
            Err(object_store::Error::NotFound { .. }) => Ok(None),
            Err(e) => Err(PhysicalError::object("get body", path.as_ref(), e)),
        }
    }

    /// Replaces the object at `key` with `body` only if it is still at `version` (S3
    /// `If-Match`).
    pub async fn put_update(
        &self,
        key: &ObjectKey,
        body: Bytes,
        version: UpdateVersion,
    ) -> Result<UpdateOutcome> {
        if version.e_tag.is_none() && version.version.is_none() {
            return Ok(UpdateOutcome::Unsupported);
        }
        let path = self.path(key);
        let opts = PutOptions {
            mode: PutMode::Update(version),
            ..Default::default()
        };
        let _permit = self.permit().await?;
        match self.store.put_opts(&path, body.into(), opts).await {
            Ok(_) => Ok(UpdateOutcome::Updated),
            Err(
                object_store::Error::Precondition { .. }
                | object_store::Error::NotFound { .. }
                | object_store::Error::AlreadyExists { .. },
            ) => Ok(UpdateOutcome::Conflict),
            Err(object_store::Error::NotImplemented { .. }) => Ok(UpdateOutcome::Unsupported),
            Err(e) => Err(PhysicalError::object(
                "conditional update",
                path.as_ref(),
                e,
            )),
        }
    }

    /// The size the store records for the object at `key` (a HEAD), `None` when absent: how a
    /// short read is told from a short object (the store itself says it is short).
    pub async fn object_size(&self, key: &ObjectKey) -> Result<Option<u64>> {
        let path = self.path(key);
        let _permit = self.permit().await?;
        match self.store.head(&path).await {
            Ok(meta) => Ok(Some(meta.size)),
            Err(object_store::Error::NotFound { .. }) => Ok(None),
            Err(e) => Err(PhysicalError::object("head", path.as_ref(), e)),
        }
    }

    /// Whether any object exists at `key` (a HEAD; says nothing about what it holds — use
    /// [`probe`](Self::probe) for blocks).
    pub async fn exists(&self, key: &ObjectKey) -> Result<bool> {
        let path = self.path(key);
        let _permit = self.permit().await?;
        match self.store.head(&path).await {
            Ok(_) => Ok(true),
            Err(object_store::Error::NotFound { .. }) => Ok(false),
            Err(e) => Err(PhysicalError::object("head", path.as_ref(), e)),
        }
    }

    /// The keys of every object under this storage's prefix (namespace and, with tensor
    /// parallelism, rank directory), relative to it: what a restarted process lists to learn
    /// what the tier holds. Objects in deeper directories are skipped. One request slot is held
    /// for the whole listing.
    pub async fn list_keys(&self) -> Result<Vec<ObjectKey>> {
        use futures::StreamExt;
        let prefix = self.path(&ObjectKey::new(""));
        let prefix_str = prefix.as_ref().trim_end_matches('/').to_string();
        let prefix = ObjectPath::from(prefix_str.as_str());
        let _permit = self.permit().await?;
        let mut stream = self.store.list(Some(&prefix));
        let mut out = Vec::new();
        while let Some(meta) = stream.next().await {
            let meta = meta.map_err(|e| PhysicalError::object("list", &prefix_str, e))?;
            let loc = meta.location.as_ref();
            if let Some(rest) = loc
                .strip_prefix(prefix_str.as_str())
                .and_then(|r| r.strip_prefix('/'))
                && !rest.is_empty()
                && !rest.contains('/')
            {
                out.push(ObjectKey::new(rest));
            }
        }
        Ok(out)
    }

    /// Whether the store answers under this storage's prefix: one listing request, reading at
    /// most its first entry (a bucket of any size answers in one round trip). For a tier's
    /// start: an unreachable endpoint, a bucket that does not exist or credentials it refuses
    /// are an error here, not a silent miss on every later lookup.
    ///
    /// # Errors
    /// The store's answer ([`PhysicalError::ObjectStore`]), after the configured retries.
    pub async fn check_access(&self) -> Result<()> {
        use futures::StreamExt;
        let prefix = self.path(&ObjectKey::new(""));
        let prefix_str = prefix.as_ref().trim_end_matches('/').to_string();
        let prefix = ObjectPath::from(prefix_str.as_str());
        let _permit = self.permit().await?;
        let mut stream = self.store.list(Some(&prefix));
        match stream.next().await {
            None | Some(Ok(_)) => Ok(()),
            Some(Err(e)) => Err(PhysicalError::object("list", &prefix_str, e)),
        }
    }

    /// Deletes the object at `key` (absent is fine).
    pub async fn delete(&self, key: &ObjectKey) -> Result<()> {
        let path = self.path(key);
        let _permit = self.permit().await?;
        match self.store.delete(&path).await {
            Ok(()) | Err(object_store::Error::NotFound { .. }) => Ok(()),
            Err(e) => Err(PhysicalError::object("delete", path.as_ref(), e)),
        }
    }
}

/// What a reader requires of a block object's header.
struct Expect {
    len: usize,
    geometry: u64,
    binding: u128,
    identity: BlockIdentity,
}

impl Expect {
    /// Geometry, binding and identity (the length is checked with the body's).
    fn bound(&self, h: &BlockHeader, loc: &dyn Fn() -> String) -> Result<()> {
        if h.slot != self.geometry {
            return Err(PhysicalError::IdentityMismatch {
                location: loc(),
                what: "layout geometry",
                expected: format!("{:016x}", self.geometry),
                found: format!("{:016x}", h.slot),
            });
        }
        if h.binding != self.binding {
            return Err(PhysicalError::IdentityMismatch {
                location: loc(),
                what: "object binding (namespace, key, rank)",
                expected: format!("{:032x}", self.binding),
                found: format!("{:032x}", h.binding),
            });
        }
        if h.identity != self.identity {
            return Err(PhysicalError::IdentityMismatch {
                location: loc(),
                what: "block identity",
                expected: self.identity.to_hex(),
                found: h.identity.to_hex(),
            });
        }
        Ok(())
    }
}

/// Verifies a whole fetched body (header, lengths, checksum); returns its payload.
fn verify_body(body: &Bytes, expect: &Expect, loc: &dyn Fn() -> String) -> Result<Bytes> {
    let h = BlockHeader::decode(body, loc)?;
    expect.bound(&h, loc)?;
    let payload = body.slice(HEADER_LEN..);
    check_payload(&h, expect, payload.len(), loc)?;
    h.verify(checksum_slices([&payload[..]]), loc)?;
    Ok(payload)
}

/// The length checks of a fetched body, in the order `get_block` has always applied them:
/// a short body is [`PhysicalError::ShortRead`], a header or body of the wrong length
/// [`PhysicalError::CorruptHeader`].
fn check_payload(
    h: &BlockHeader,
    expect: &Expect,
    payload_len: usize,
    loc: &dyn Fn() -> String,
) -> Result<()> {
    let expected_len = expect.len;
    if payload_len < expected_len || (h.len as usize) > payload_len {
        return Err(PhysicalError::ShortRead {
            location: loc(),
            expected: expected_len + HEADER_LEN,
            actual: payload_len + HEADER_LEN,
        });
    }
    h.expect(expected_len, expect.geometry, loc)?;
    if payload_len != expected_len {
        return Err(PhysicalError::CorruptHeader {
            location: loc(),
            reason: format!(
                "body has {payload_len} payload bytes, header says {}",
                h.len
            ),
        });
    }
    Ok(())
}

impl Storage for ObjectStorage {
    fn kind(&self) -> StorageKind {
        StorageKind::Object
    }
    fn size_bytes(&self) -> usize {
        usize::MAX
    }
}
