//! # The lock protocol and the one assumption it makes
//!
//! Each filter writes a unique token into its lock objects, and after `lock_verify_delay`
//! (default 20 ms) reads the lock back: it owns the lock only if the token read is its own.
//!
//! * **Real S3** makes the create itself exclusive: `PutObject` with `If-None-Match: *` succeeds
//!   for exactly one writer, the others get `412 Precondition Failed`, and reads after a write
//!   are strongly consistent. The read-back always finds our token; it and the delay are
//!   redundant there (`lock_verify_delay = 0` skips the wait).
//! * **Servers that check and write non-atomically** — the s3s-fs used in CI tests for the
//!   object's existence, then writes — let two concurrent creates both "succeed"; the last write
//!   wins and only its writer reads its own token back. That is only sound under this
//!   **assumption: a create that succeeded lands (is visible to a GET) within
//!   `lock_verify_delay` of being issued.** A racing create that lands later than that, after
//!   the first writer has verified, overwrites a lock already trusted.
//!
//! **If the assumption fails**, two workers both believe they hold the lock and both upload the
//! block. That is the only consequence, and it is harmless:
//!
//! * a block object is written by one PUT (or one multipart completion) of header, payload and
//!   checksum, keyed by the sequence hash; S3 (and s3s-fs, which writes a temporary file and
//!   renames it) replaces objects atomically, so a reader always sees one complete, checksummed
//!   upload — the same bytes for the same hash, since the KV of a sequence hash is the same
//!   content whichever worker computed it. The cost is one wasted upload;
//! * nothing here deletes a block object, and a block is reported completed only when its own
//!   upload succeeded, so no block is reported present that is not;
//! * releases are token-checked (GET the lock, DELETE only if it still holds our token), so the
//!   loser of a late race does not delete the winner's lock and open the door to a third writer.
//!   The check and the delete are two requests; under the same assumption, and as long as the
//!   lock has not expired (see below), no other token can land between them.
//!
//! A lock is tracked from **before** its create request is sent, so a create interrupted by the
//! policy timeout or by cancellation (its future dropped, the request possibly already on the
//! server) is still released: the release then waits `lock_verify_delay` for the create to land
//! before its token-checked delete. Without this, such a lock would be left behind and no worker
//! would offload that block again.
//!
//! # Lock expiry
//!
//! A lock object (`<hash>.lock` under the namespace) is a small JSON record: the owner's token,
//! its creation time (`created_ms`, milliseconds since the Unix epoch by the **writer's** clock)
//! and its lifetime (`ttl_ms`, the writer's
//! [`lock_ttl`](crate::ObjectPipelineConfig::lock_ttl), default [`DEFAULT_LOCK_TTL`]). A worker
//! whose create fails because the lock exists reads it:
//!
//! * **live** (`created_ms + ttl_ms` not yet past by the reader's clock): held, the block is
//!   filtered;
//! * **unparseable** (not a lock record, e.g. written by something else): held, never broken,
//!   and a warning names the key — a lock we cannot read is not one we may judge stale;
//! * **expired**: its holder is presumed dead (crashed, killed, partitioned). The lock is
//!   replaced atomically by our own with a conditional `PutObject` carrying `If-Match: <ETag of
//!   the stale lock>` (`PutMode::Update`): it succeeds only if the object is still that exact
//!   stale lock, so of several workers breaking it at once, one wins (the others get
//!   `412 Precondition Failed` and filter the block), and a lock refreshed or re-taken in the
//!   meantime is never replaced. The replacement then goes through the same read-back
//!   verification as a create. On a non-atomic server (s3s-fs checks `If-Match`, then writes)
//!   two breakers can both "succeed"; the read-back resolves that exactly as for creates, under
//!   the same assumption.
//!   Stores without conditional update (`object_store`'s local filesystem, or a response
//!   without an ETag) fall back to a token-checked delete — GET, DELETE only if it still holds
//!   the same expired token and creation time — and retry the create once. That read-then-delete
//!   is racy: another worker can break the lock and create its own between our GET and our
//!   DELETE, and we then delete its fresh lock and take ours, so both may upload the block.
//!
//! Expiry **assumes loosely synchronized clocks** (skew well below the TTL) and a TTL longer than
//! the longest time a lock is held — policy evaluation, queueing, batching and the transfer.
//! Locks are not renewed while held. If either assumption fails (a clock far ahead, a transfer
//! outliving the TTL), a live holder's lock can be broken and the block uploaded twice; its
//! holder's release then finds another token and leaves the new lock alone. As above, that is
//! harmless: a duplicate upload of identical bytes, never a lost or corrupt block. The same holds
//! for the fallback's delete race. A clock far *behind* only makes this worker wait longer before
//! breaking a lock.
//!
//! A pipeline that shuts down cleanly releases all its locks; expiry is for those that do not.
//!
//! The re-check after taking the lock closes the window in which another worker finished the
//! object and released its lock between our first check and our lock. Locks held are tracked
//! per hash, so each is released exactly once, when its block leaves the pipeline.
//!
//! # Each release belongs to one acquisition
//!
//! Every acquisition writes its own token (`<owner>#<n>`, [`ObjectLockPresenceFilter::token`]
//! is the `<owner>` prefix) and remembers it with the held lock; a release deletes the lock only
//! if it still holds *that* acquisition's token. So a delayed release of an old acquisition —
//! its DELETE still queued while the same filter re-acquired the block — never deletes the
//! newer lock.
//!
//! # What a release guarantees, and when
//!
//! [`OffloadPolicy::release`] is synchronous (the pipeline calls it while dropping a block's
//! resources) and the DELETE is a network request, so `release` **starts** the token-checked
//! delete on the runtime and returns; it does not wait for it. Consequently a transfer's cancel
//! confirmation (and its completion) means the lock is *no longer tracked* by this filter and
//! its delete has been issued, not that the object is gone: another worker may still find the
//! lock for the round trip of that DELETE (and, for a lock whose create was interrupted, for
//! `lock_verify_delay` more). That worker filters the block, which is safe (no duplicate, no
//! lost data); the block is offloaded by whoever enqueues it next. To wait for the deletes
//! themselves, await [`ObjectLockPresenceFilter::flush_releases`];
//! [`ObjectPipeline::shutdown_and_wait`](super::ObjectPipeline::shutdown_and_wait) (and the
//! engine's shutdown) do, so a clean shutdown leaves no lock behind.
//!
//! Lock order: `held` and `releases` are leaf locks; no I/O happens under them.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use futures::StreamExt;
use kvbm_logical::{BlockDigest, SequenceHash};
use kvbm_physical::{ObjectStorage, PhysicalError, UpdateOutcome};
use parking_lot::Mutex;
use serde::{Deserialize, Serialize};

use super::CHECK_CONCURRENCY;
use super::keys::lock_key;
use super::presence::block_present;
use crate::error::PolicyError;
use crate::policy::{
    EvalContext, OffloadPolicy, PolicyBatchFuture, PolicyFuture, async_batch_result, async_result,
};

/// Default delay before a new lock is read back to confirm ownership.
pub const DEFAULT_LOCK_VERIFY_DELAY: std::time::Duration = std::time::Duration::from_millis(20);

/// Default lifetime of a lock object (a configuration default, kept with the others).
pub use crate::config::DEFAULT_LOCK_TTL;

/// The largest lock object read (a lock record is ~150 bytes); a larger object at a lock key is
/// refused unread and treated as an unparseable lock.
const MAX_LOCK_BYTES: usize = 4096;

/// G2→G4 filter with distributed locking: check meta, acquire lock, track acquired locks.
///
/// A block passes only when its object is absent and this filter won its lock object (an S3
/// conditional create, `PutMode::Create`). The lock is deleted by [`OffloadPolicy::release`]
/// when the block leaves the pipeline, whatever the outcome.
///
/// Lock objects expire after their TTL ([`with_lock_ttl`](Self::with_lock_ttl)); an expired
/// lock is replaced by a conditional update (see the [module docs](super::lock#lock-expiry)).
pub struct ObjectLockPresenceFilter {
    storage: Arc<ObjectStorage>,
    owner: String,
    verify_delay: std::time::Duration,
    ttl: std::time::Duration,
    held: Arc<Mutex<HashMap<SequenceHash, Held>>>,
    releases: Arc<Mutex<Vec<tokio::task::JoinHandle<()>>>>,
    acquisitions: Arc<AtomicU64>,
}

/// One acquisition of a lock: its state and the token it wrote.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Held {
    state: LockState,
    token: Arc<str>,
}

/// What a lock object holds: whose it is, and until when.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct LockRecord {
    /// The acquisition's unique token (`<owner>#<n>`).
    token: String,
    /// Creation time, milliseconds since the Unix epoch, by the writer's clock.
    created_ms: u64,
    /// Lifetime from `created_ms`, milliseconds.
    ttl_ms: u64,
}

impl LockRecord {
    /// A lock for `token`, created now.
    fn new(token: &str, ttl: std::time::Duration) -> Self {
        Self {
            token: token.to_string(),
            created_ms: now_ms(),
            ttl_ms: u64::try_from(ttl.as_millis()).unwrap_or(u64::MAX),
        }
    }

    fn encode(&self) -> bytes::Bytes {
        serde_json::to_vec(self)
            .expect("a lock record serializes")
            .into()
    }

    /// `None` when `body` is not a lock record.
    fn decode(body: &[u8]) -> Option<Self> {
        serde_json::from_slice(body).ok()
    }

    /// Whether `created + ttl` is past at `now_ms`.
    fn expired_at(&self, now_ms: u64) -> bool {
        self.created_ms.saturating_add(self.ttl_ms) < now_ms
    }
}

/// Milliseconds since the Unix epoch by this machine's clock (0 if it is before the epoch).
fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

/// Whether `body` is a lock record holding `token`.
fn holds_token(body: &[u8], token: &str) -> bool {
    LockRecord::decode(body).is_some_and(|r| r.token == token)
}

/// What one evaluation needs, shared by the per-block futures of a batch.
struct LockCtx {
    storage: Arc<ObjectStorage>,
    held: Arc<Mutex<HashMap<SequenceHash, Held>>>,
    owner: String,
    acquisitions: Arc<AtomicU64>,
    verify_delay: std::time::Duration,
    ttl: std::time::Duration,
}

/// A lock this filter may hold.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum LockState {
    /// The create was (or is being) sent and ownership is not verified yet: the lock may or may
    /// not be ours, and may not have landed yet.
    Acquiring,
    /// Created and read back with our token.
    Verified,
}

impl std::fmt::Debug for ObjectLockPresenceFilter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ObjectLockPresenceFilter")
            .field("owner", &self.owner)
            .field("held", &self.held.lock().len())
            .finish()
    }
}

impl ObjectLockPresenceFilter {
    /// A filter locking through `storage`; `owner` is written into lock objects (for humans).
    pub fn new(storage: Arc<ObjectStorage>, owner: impl Into<String>) -> Self {
        static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos());
        let unique = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        Self {
            storage,
            owner: format!("{}/{}/{nanos}/{unique}", owner.into(), std::process::id()),
            verify_delay: DEFAULT_LOCK_VERIFY_DELAY,
            ttl: DEFAULT_LOCK_TTL,
            held: Arc::default(),
            releases: Arc::default(),
            acquisitions: Arc::default(),
        }
    }

    /// Delay between creating a lock and reading it back to confirm ownership.
    /// Default: [`DEFAULT_LOCK_VERIFY_DELAY`].
    pub fn with_verify_delay(mut self, delay: std::time::Duration) -> Self {
        self.verify_delay = delay;
        self
    }

    /// Lifetime written into this filter's locks: once it has passed, another worker may break
    /// the lock. Must exceed the longest time a block is held (evaluation through transfer).
    /// Default: [`DEFAULT_LOCK_TTL`].
    pub fn with_lock_ttl(mut self, ttl: std::time::Duration) -> Self {
        self.ttl = ttl;
        self
    }

    /// The lifetime written into this filter's locks.
    pub fn lock_ttl(&self) -> std::time::Duration {
        self.ttl
    }

    /// The owner part of the tokens this filter writes into its locks (each acquisition
    /// appends `#<n>`).
    pub fn token(&self) -> &str {
        &self.owner
    }

    /// Locks currently held (or being acquired) by this filter.
    pub fn held_locks(&self) -> Vec<SequenceHash> {
        self.held.lock().keys().copied().collect()
    }

    /// Waits for lock deletions started by `release` to finish (including those started
    /// while waiting).
    pub async fn flush_releases(&self) {
        loop {
            let handles = std::mem::take(&mut *self.releases.lock());
            if handles.is_empty() {
                return;
            }
            for h in handles {
                let _ = h.await;
            }
        }
    }

    async fn check_and_lock(
        ctx: Arc<LockCtx>,
        h: SequenceHash,
        digest: Option<BlockDigest>,
    ) -> Result<bool, PolicyError> {
        let LockCtx {
            storage,
            held,
            owner,
            verify_delay,
            ..
        } = &*ctx;
        if block_present(storage, h, digest).await? {
            return Ok(false);
        }
        let token: Arc<str> = format!(
            "{owner}#{}",
            ctx.acquisitions.fetch_add(1, Ordering::Relaxed)
        )
        .into();
        // Tracked before the request is sent: if this future is dropped (policy timeout,
        // cancellation) while the create is on its way, the release still cleans it up.
        {
            let mut held = held.lock();
            if held.contains_key(&h) {
                // This filter is already locking (or holds) this block.
                return Ok(false);
            }
            held.insert(
                h,
                Held {
                    state: LockState::Acquiring,
                    token: token.clone(),
                },
            );
        }
        // Forget our entry only if it is still this acquisition's.
        let forget = || {
            let mut held = held.lock();
            if held.get(&h).is_some_and(|e| e.token == token) {
                held.remove(&h);
            }
        };
        let record = LockRecord::new(&token, ctx.ttl);
        let acquired = match storage.try_create(&lock_key(h), record.encode()).await {
            Ok(true) => Ok(true),
            // Taken: by a live worker, or by one that died holding it.
            Ok(false) => Self::take_over_if_expired(&ctx, &token, h).await,
            Err(e) => Err(PolicyError::Backend(e)),
        };
        if !acquired? {
            forget();
            return Ok(false);
        }
        // Confirm ownership: a racing create on a non-atomic server may have overwritten ours.
        if !verify_delay.is_zero() {
            tokio::time::sleep(*verify_delay).await;
        }
        let body = match storage.get_small(&lock_key(h), MAX_LOCK_BYTES).await {
            Ok(Some(got)) => got.body,
            Ok(None) | Err(PhysicalError::TooLarge { .. }) => {
                forget();
                return Ok(false);
            }
            Err(e) => return Err(PolicyError::Backend(e)),
        };
        if !holds_token(&body, &token) {
            // Someone else's lock: forget it without deleting it.
            forget();
            return Ok(false);
        }
        match held.lock().get_mut(&h) {
            Some(e) if e.token == token => e.state = LockState::Verified,
            // Released while we verified: the release deletes it.
            _ => return Ok(false),
        }
        // Another worker may have finished the object and released its lock in between.
        if block_present(storage, h, digest).await? {
            let ours = {
                let mut held = held.lock();
                match held.get(&h) {
                    Some(e) if e.token == token => held.remove(&h).is_some(),
                    _ => false,
                }
            };
            if ours {
                release_lock(storage, &token, h).await?;
            }
            return Ok(false);
        }
        Ok(true)
    }

    /// Our create of `h`'s lock failed because the lock exists: read it, and if it has expired
    /// replace it with ours (written with `token`). `Ok(true)` when our lock was written (still
    /// to be verified), `Ok(false)` when the lock is held (live, unparseable, or broken by
    /// someone else first).
    async fn take_over_if_expired(
        ctx: &LockCtx,
        token: &str,
        h: SequenceHash,
    ) -> Result<bool, PolicyError> {
        let storage = &ctx.storage;
        let key = lock_key(h);
        let path = storage.path(&key);
        let got = match storage.get_small(&key, MAX_LOCK_BYTES).await {
            Ok(Some(got)) => got,
            Ok(None) => {
                // Released between our create and our read: retry the acquire once.
                let record = LockRecord::new(token, ctx.ttl);
                return Ok(storage.try_create(&key, record.encode()).await?);
            }
            Err(PhysicalError::TooLarge { .. }) => {
                tracing::warn!(key = %path, "object lock is too large to be a lock record: treated as held, never broken");
                return Ok(false);
            }
            Err(e) => return Err(PolicyError::Backend(e)),
        };
        let Some(stale) = LockRecord::decode(&got.body) else {
            tracing::warn!(
                key = %path,
                "object lock is not a lock record: treated as held, never broken"
            );
            return Ok(false);
        };
        let now = now_ms();
        if !stale.expired_at(now) {
            return Ok(false);
        }
        tracing::info!(
            key = %path,
            owner = %stale.token,
            expired_ms_ago = now - stale.created_ms.saturating_add(stale.ttl_ms),
            "breaking expired object lock"
        );
        let ours = LockRecord::new(token, ctx.ttl).encode();
        // Atomic on S3: replaced only if it is still exactly the stale lock we read.
        match storage.put_update(&key, ours.clone(), got.version).await? {
            UpdateOutcome::Updated => return Ok(true),
            // Broken (or released and re-taken) by someone else first.
            UpdateOutcome::Conflict => return Ok(false),
            UpdateOutcome::Unsupported => {}
        }
        // No conditional update here: delete it if it is still the same stale lock, then retry
        // the create once. Racy (see the module docs); at worst one duplicate upload.
        match storage.get_small(&key, MAX_LOCK_BYTES).await {
            Ok(Some(again)) => {
                if LockRecord::decode(&again.body).as_ref() != Some(&stale) {
                    return Ok(false);
                }
                storage.delete(&key).await?;
            }
            Ok(None) => {}
            Err(PhysicalError::TooLarge { .. }) => return Ok(false),
            Err(e) => return Err(PolicyError::Backend(e)),
        }
        Ok(storage.try_create(&key, ours).await?)
    }
}

impl OffloadPolicy for ObjectLockPresenceFilter {
    fn name(&self) -> &'static str {
        "object_lock_presence"
    }
    fn evaluate(&self, ctx: &EvalContext) -> PolicyFuture {
        let fut = self.evaluate_batch(std::slice::from_ref(ctx));
        async_result(async move {
            match fut {
                either::Either::Left(r) => r.await.map(|v| v[0]),
                either::Either::Right(f) => f.await.map(|v| v[0]),
            }
        })
    }
    fn evaluate_batch(&self, ctxs: &[EvalContext]) -> PolicyBatchFuture {
        let ctx = Arc::new(LockCtx {
            storage: self.storage.clone(),
            held: self.held.clone(),
            owner: self.owner.clone(),
            acquisitions: self.acquisitions.clone(),
            verify_delay: self.verify_delay,
            ttl: self.ttl,
        });
        let names: Vec<(SequenceHash, Option<BlockDigest>)> =
            ctxs.iter().map(|c| (c.sequence_hash, c.digest)).collect();
        async_batch_result(async move {
            futures::stream::iter(names)
                .map(|(h, d)| Self::check_and_lock(ctx.clone(), h, d))
                .buffered(CHECK_CONCURRENCY)
                .collect::<Vec<_>>()
                .await
                .into_iter()
                .collect()
        })
    }
    fn release(&self, hashes: &[SequenceHash]) {
        let mine: Vec<(SequenceHash, Held)> = {
            let mut held = self.held.lock();
            hashes
                .iter()
                .filter_map(|h| held.remove(h).map(|s| (*h, s)))
                .collect()
        };
        if mine.is_empty() {
            return;
        }
        let storage = self.storage.clone();
        let delay = self.verify_delay;
        let release = async move {
            if mine.iter().any(|(_, s)| s.state == LockState::Acquiring) && !delay.is_zero() {
                // A create may still be on its way to the server: let it land first.
                tokio::time::sleep(delay).await;
            }
            for (h, held) in mine {
                if let Err(e) = release_lock(&storage, &held.token, h).await {
                    tracing::warn!(error = %e, "cannot release object lock");
                }
            }
        };
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            tracing::warn!(
                "object locks released outside a tokio runtime cannot be deleted; they expire after their TTL"
            );
            return;
        };
        let task = rt.spawn(release);
        let mut releases = self.releases.lock();
        releases.retain(|h| !h.is_finished());
        releases.push(task);
    }
}

/// Deletes the lock of `h` if it holds the acquisition token `token` (absent, someone else's or
/// another acquisition's: left alone).
async fn release_lock(
    storage: &ObjectStorage,
    token: &str,
    h: SequenceHash,
) -> Result<(), PhysicalError> {
    let key = lock_key(h);
    match storage.get_small(&key, MAX_LOCK_BYTES).await {
        Ok(Some(got)) if holds_token(&got.body, token) => storage.delete(&key).await,
        Ok(_) | Err(PhysicalError::TooLarge { .. }) => Ok(()),
        Err(e) => Err(e),
    }
}
