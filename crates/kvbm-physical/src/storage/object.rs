//! G4 objects: one object per block, through `object_store` (S3, local filesystem, in-memory).
//!
//! An object's path is `{namespace}/{key}`; the body is a [`BlockHeader`] followed by the
//! block's serialized payload, so a truncated body is a short read, an overwritten one a
//! checksum mismatch and a deleted one not-found. Requests are bounded by a per-storage
//! semaphore (`max_concurrency`); bodies above `multipart_threshold` go up in parts.
//! [`ObjectStorage::try_create`] is a conditional create (`PutMode::Create`) for locking.

use std::path::Path;
use std::sync::Arc;

use bytes::Bytes;
use futures::StreamExt;
use object_store::path::Path as ObjectPath;
use object_store::{
    GetResultPayload, ObjectStore, ObjectStoreExt, PutMode, PutOptions, PutPayload, WriteMultipart,
};
use tokio::sync::Semaphore;
use xxhash_rust::xxh3::Xxh3;

use crate::checksum::{BlockHeader, HEADER_LEN, checksum_slices};
use crate::error::{PhysicalError, Result};
use crate::storage::{Storage, StorageKind};

/// Opaque key material of an object-tier block (the layer above derives it from a sequence
/// hash). Hash keys render as 32 lowercase hex digits.
#[derive(
    Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize, serde::Deserialize,
)]
pub struct ObjectKey(String);

impl ObjectKey {
    /// A key from 128 bits of hash.
    pub fn from_u128(v: u128) -> Self {
        ObjectKey(format!("{v:032x}"))
    }
    /// A key from a string (must be a valid object path segment sequence).
    pub fn new(s: impl Into<String>) -> Self {
        ObjectKey(s.into())
    }
    /// The key text.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl From<u128> for ObjectKey {
    fn from(v: u128) -> Self {
        ObjectKey::from_u128(v)
    }
}
impl From<String> for ObjectKey {
    fn from(s: String) -> Self {
        ObjectKey(s)
    }
}
impl From<&str> for ObjectKey {
    fn from(s: &str) -> Self {
        ObjectKey(s.to_string())
    }
}
impl std::fmt::Display for ObjectKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

/// Where an S3-compatible server is.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct S3Config {
    /// `http(s)://host:port`; `None` for AWS itself.
    pub endpoint: Option<String>,
    /// Bucket name.
    pub bucket: String,
    /// Region. Default in examples: `us-east-1`.
    pub region: String,
    /// Access key id.
    pub access_key: String,
    /// Secret access key.
    pub secret_key: String,
}

/// Object-tier settings.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct ObjectConfig {
    /// Key prefix for every object. Default: `kvbm`.
    pub namespace: String,
    /// Requests in flight per storage. Default: 16.
    pub max_concurrency: usize,
    /// Bodies larger than this use multipart upload. Default: 32 MiB.
    pub multipart_threshold: usize,
    /// Part size for multipart uploads (S3 needs ≥ 5 MiB). Default: 8 MiB.
    pub part_size: usize,
}

impl Default for ObjectConfig {
    fn default() -> Self {
        ObjectConfig {
            namespace: "kvbm".into(),
            max_concurrency: 16,
            multipart_threshold: 32 << 20,
            part_size: 8 << 20,
        }
    }
}

/// How a block put treats an existing object.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ObjectPutMode {
    /// Replace it. Default.
    #[default]
    Overwrite,
    /// Fail with [`PhysicalError::AlreadyExists`] (conditional create).
    Create,
}

/// An object tier.
#[derive(Debug)]
pub struct ObjectStorage {
    store: Arc<dyn ObjectStore>,
    config: ObjectConfig,
    permits: Semaphore,
}

impl ObjectStorage {
    /// Wraps any `object_store` backend.
    pub fn new(store: Arc<dyn ObjectStore>, config: ObjectConfig) -> Self {
        let permits = Semaphore::new(config.max_concurrency.max(1));
        ObjectStorage {
            store,
            config,
            permits,
        }
    }

    /// An S3-compatible store (`AmazonS3Builder`, path-style, http allowed for endpoints).
    pub fn s3(s3: &S3Config, config: ObjectConfig) -> Result<Self> {
        let mut b = object_store::aws::AmazonS3Builder::new()
            .with_bucket_name(&s3.bucket)
            .with_region(&s3.region)
            .with_access_key_id(&s3.access_key)
            .with_secret_access_key(&s3.secret_key)
            .with_virtual_hosted_style_request(false);
        if let Some(ep) = &s3.endpoint {
            b = b
                .with_endpoint(ep)
                .with_allow_http(ep.starts_with("http://"));
        }
        let store = b
            .build()
            .map_err(|e| PhysicalError::object("build s3 client", &s3.bucket, e))?;
        Ok(Self::new(Arc::new(store), config))
    }

    /// A local-filesystem store rooted at `root` (created if missing).
    pub fn local(root: &Path, config: ObjectConfig) -> Result<Self> {
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

    /// The underlying store.
    pub fn store(&self) -> &Arc<dyn ObjectStore> {
        &self.store
    }
    /// The settings.
    pub fn config(&self) -> &ObjectConfig {
        &self.config
    }
    /// One of the `max_concurrency` request slots, held for the request's duration.
    async fn permit(&self) -> tokio::sync::SemaphorePermit<'_> {
        self.permits
            .acquire()
            .await
            .expect("semaphore never closed")
    }

    /// The full path of `key`.
    pub fn path(&self, key: &ObjectKey) -> ObjectPath {
        ObjectPath::from(format!("{}/{}", self.config.namespace, key.as_str()))
    }

    /// Stores a block: header + `parts` (the serialized payload, in order).
    pub async fn put_block(
        &self,
        key: &ObjectKey,
        parts: Vec<Bytes>,
        mode: ObjectPutMode,
    ) -> Result<()> {
        let len: usize = parts.iter().map(|p| p.len()).sum();
        let header = BlockHeader {
            len: len as u64,
            slot: 0,
            checksum: checksum_slices(parts.iter().map(|p| &p[..])),
        };
        let path = self.path(key);
        let _permit = self.permit().await;
        let body_len = len + HEADER_LEN;
        if body_len > self.config.multipart_threshold && mode == ObjectPutMode::Overwrite {
            let upload = self
                .store
                .put_multipart(&path)
                .await
                .map_err(|e| PhysicalError::object("put_multipart", path.as_ref(), e))?;
            let mut w =
                WriteMultipart::new_with_chunk_size(upload, self.config.part_size.max(5 << 20));
            w.write(&header.to_bytes());
            for p in &parts {
                w.write(p);
            }
            w.finish()
                .await
                .map_err(|e| PhysicalError::object("put_multipart", path.as_ref(), e))?;
            return Ok(());
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

    /// Fetches and verifies a block whose payload must be `expected_len` bytes; returns the
    /// payload.
    pub async fn get_block(&self, key: &ObjectKey, expected_len: usize) -> Result<Bytes> {
        let path = self.path(key);
        let loc = || format!("object:{path}");
        let body = {
            let _permit = self.permit().await;
            let got = self
                .store
                .get(&path)
                .await
                .map_err(|e| PhysicalError::object("get", path.as_ref(), e))?;
            got.bytes()
                .await
                .map_err(|e| PhysicalError::object("get body", path.as_ref(), e))?
        };
        verify_body(&body, expected_len, &loc)
    }

    /// Fetches and verifies a block like [`get_block`](Self::get_block), but hands the payload
    /// to `sink(offset, bytes)` as it arrives instead of collecting it: each chunk of the body
    /// is hashed and passed on while it is in cache, and no body-sized buffer is allocated.
    /// `sink` sees contiguous, increasing payload offsets, never past `expected_len`. The result
    /// (and its error kinds) is that of `get_block`; on an error, whatever `sink` received is
    /// unverified and must not be used.
    pub(crate) async fn get_block_into(
        &self,
        key: &ObjectKey,
        expected_len: usize,
        mut sink: impl FnMut(usize, &[u8]) + Send,
    ) -> Result<()> {
        let path = self.path(key);
        let loc = || format!("object:{path}");
        let body_err = |e| PhysicalError::object("get body", path.as_ref(), e);
        let _permit = self.permit().await;
        let got = self
            .store
            .get(&path)
            .await
            .map_err(|e| PhysicalError::object("get", path.as_ref(), e))?;
        if !matches!(got.payload, GetResultPayload::Stream(_)) {
            // A local file: one read beats the fs backend's small chunked reads.
            let body = got.bytes().await.map_err(body_err)?;
            sink(0, &verify_body(&body, expected_len, &loc)?);
            return Ok(());
        }
        let mut stream = got.into_stream();
        let mut header = [0u8; HEADER_LEN];
        let mut head_len = 0;
        let mut decoded: Option<BlockHeader> = None;
        let mut payload_len = 0usize;
        let mut hasher = Xxh3::new();
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
                decoded = Some(BlockHeader::decode(&header, &loc)?);
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
        check_payload(&h, expected_len, payload_len, &loc)?;
        h.verify(hasher.digest128(), &loc)
    }

    /// Conditional create: stores `body` at `key` only if nothing is there. `Ok(true)` when
    /// created, `Ok(false)` when the key already existed (someone else holds the lock).
    pub async fn try_create(&self, key: &ObjectKey, body: Bytes) -> Result<bool> {
        let path = self.path(key);
        let opts = PutOptions {
            mode: PutMode::Create,
            ..Default::default()
        };
        let _permit = self.permit().await;
        match self.store.put_opts(&path, body.into(), opts).await {
            Ok(_) => Ok(true),
            Err(object_store::Error::AlreadyExists { .. })
            | Err(object_store::Error::Precondition { .. }) => Ok(false),
            Err(e) => Err(PhysicalError::object("conditional put", path.as_ref(), e)),
        }
    }

    /// Whether an object exists at `key`.
    pub async fn exists(&self, key: &ObjectKey) -> Result<bool> {
        let path = self.path(key);
        let _permit = self.permit().await;
        match self.store.head(&path).await {
            Ok(_) => Ok(true),
            Err(object_store::Error::NotFound { .. }) => Ok(false),
            Err(e) => Err(PhysicalError::object("head", path.as_ref(), e)),
        }
    }

    /// Deletes the object at `key` (absent is fine).
    pub async fn delete(&self, key: &ObjectKey) -> Result<()> {
        let path = self.path(key);
        let _permit = self.permit().await;
        match self.store.delete(&path).await {
            Ok(()) | Err(object_store::Error::NotFound { .. }) => Ok(()),
            Err(e) => Err(PhysicalError::object("delete", path.as_ref(), e)),
        }
    }
}

/// Verifies a whole fetched body (header, lengths, checksum); returns its payload.
fn verify_body(body: &Bytes, expected_len: usize, loc: &dyn Fn() -> String) -> Result<Bytes> {
    let h = BlockHeader::decode(body, loc)?;
    let payload = body.slice(HEADER_LEN..);
    check_payload(&h, expected_len, payload.len(), loc)?;
    h.verify(checksum_slices([&payload[..]]), loc)?;
    Ok(payload)
}

/// The length checks of a fetched body, in the order `get_block` has always applied them:
/// a short body is [`PhysicalError::ShortRead`], a header or body of the wrong length
/// [`PhysicalError::CorruptHeader`].
fn check_payload(
    h: &BlockHeader,
    expected_len: usize,
    payload_len: usize,
    loc: &dyn Fn() -> String,
) -> Result<()> {
    if payload_len < expected_len || (h.len as usize) > payload_len {
        return Err(PhysicalError::ShortRead {
            location: loc(),
            expected: expected_len + HEADER_LEN,
            actual: payload_len + HEADER_LEN,
        });
    }
    h.expect(expected_len, 0, loc)?;
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
