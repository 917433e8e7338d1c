//! Transfer strategies, chosen by the storage kinds of the two sides (table in the parent
//! module's docs).

use std::sync::Arc;

use futures::future::BoxFuture;

use super::bounce::BouncePool;
use super::{BlockId, CopyJob, Job};
use crate::error::{PhysicalError, Result};
use crate::layout::region_pairs;
use crate::physical::{Backing, PhysicalLayout};
use crate::storage::{DeviceMemory, StorageKind};

pub(super) async fn run(job: Job, bounce: Arc<BouncePool>) -> Vec<(BlockId, Result<()>)> {
    let ids = job.dst_ids.clone();
    let results = run_inner(job, bounce).await;
    ids.into_iter().zip(results).collect()
}

fn all_layers(job: &Job) -> std::ops::Range<usize> {
    0..job.src.layout().config().num_layers
}

fn run_inner(job: Job, bounce: Arc<BouncePool>) -> BoxFuture<'static, Vec<Result<()>>> {
    use StorageKind::*;
    Box::pin(async move {
        // Real GPU memory on either side: stream-ordered batched copies (`transfer::cuda`).
        #[cfg(feature = "cuda")]
        if let Some(fut) = super::cuda::dispatch(&job) {
            return fut.await;
        }
        let full = job.layers == all_layers(&job);
        match (job.src.storage_kind(), job.dst.storage_kind()) {
            (Host | Device, Host | Device) => blocking(job, copy_memory).await,
            (Host, Disk) => blocking(job, disk_write).await,
            (Disk, Host) if full => blocking(job, disk_read).await,
            #[cfg(feature = "object")]
            (Host, Object) => object_put(job).await,
            #[cfg(feature = "object")]
            (Object, Host | Device) => object_get(job).await,
            _ => two_hop(job, bounce).await,
        }
    })
}

async fn blocking(job: Job, f: fn(&Job) -> Vec<Result<()>>) -> Vec<Result<()>> {
    let n = job.src_ids.len();
    match tokio::task::spawn_blocking(move || f(&job)).await {
        Ok(r) => r,
        Err(e) => (0..n)
            .map(|_| Err(PhysicalError::Aborted(format!("transfer task failed: {e}"))))
            .collect(),
    }
}

fn device0(layout: &PhysicalLayout) -> Option<&Arc<dyn DeviceMemory>> {
    match layout.backing() {
        Backing::Device(d) => d.first(),
        _ => None,
    }
}

/// Copies the chunks of [`region_pairs`]`(sr, dr)` from `sr`'s memory to `dr`'s; a `None`
/// device means that side is host memory.
///
/// # Safety
/// Every region must lie inside live memory of its side (host addresses for host sides, device
/// addresses for device sides); the caller excludes concurrent writers.
unsafe fn copy_regions(
    sdev: Option<&Arc<dyn DeviceMemory>>,
    ddev: Option<&Arc<dyn DeviceMemory>>,
    sr: &[(usize, usize)],
    dr: &[(usize, usize)],
) -> Result<()> {
    for (s, d, len) in region_pairs(sr, dr) {
        // SAFETY: (all arms) per the caller, both ranges lie inside live allocations, and the
        // manager's claims and validation guarantee they do not overlap and nobody else writes
        // them meanwhile.
        unsafe {
            match (sdev, ddev) {
                (None, None) => std::ptr::copy_nonoverlapping(s as *const u8, d as *mut u8, len),
                (None, Some(dd)) => dd.copy_h2d(d as u64, s as *const u8, len)?,
                (Some(sd), None) => sd.copy_d2h(d as *mut u8, s as u64, len)?,
                (Some(_), Some(dd)) => dd.copy_d2d(d as u64, s as u64, len)?,
            }
        }
    }
    Ok(())
}

pub(super) fn copy_memory(job: &Job) -> Vec<Result<()>> {
    job.src_ids
        .iter()
        .zip(&job.dst_ids)
        .map(|(&s, &d)| {
            let sr = job.src.block_addrs(s, job.layers.clone());
            let dr = job.dst.block_addrs(d, job.layers.clone());
            // SAFETY: regions of the job's registered layouts; the caller excludes writers.
            unsafe { copy_regions(device0(&job.src), device0(&job.dst), &sr, &dr) }
        })
        .collect()
}

/// Runs the range copies of `job` in order (each fragment through the one region copy,
/// [`copy_regions`]); one result per copy.
pub(super) fn copy_ranges(job: &CopyJob) -> Vec<Result<()>> {
    let (sdev, ddev) = (device0(&job.src), device0(&job.dst));
    super::ranges::walk(job, |_, sr, dr| {
        // SAFETY: each fragment lies inside its block on each side (validated; `ranges::walk`
        // cuts it along the blocks' regions), hence in live memory of the job's registered
        // layouts; the job's claims and the caller exclude other writers (and readers of the
        // destination).
        unsafe {
            if let (None, None, [(s, len)], [(d, _)]) = (sdev, ddev, sr, dr) {
                std::ptr::copy_nonoverlapping(*s as *const u8, *d as *mut u8, *len);
                Ok(())
            } else {
                copy_regions(sdev, ddev, sr, dr)
            }
        }
    })
}

fn disk_of(layout: &PhysicalLayout) -> &crate::storage::DiskStorage {
    match layout.backing() {
        Backing::Disk(d) => d,
        _ => unreachable!("strategy chosen by storage kind"),
    }
}

fn disk_write(job: &Job) -> Vec<Result<()>> {
    let blocks: Vec<_> = job
        .src_ids
        .iter()
        .zip(&job.dst_ids)
        .enumerate()
        .map(|(pos, (&s, &d))| {
            (
                d,
                job.identity(pos),
                job.src.block_addrs(s, all_layers(job)),
            )
        })
        .collect();
    // SAFETY: host regions of a registered layout; the caller excludes concurrent writers.
    unsafe { disk_of(&job.dst).write_blocks(&blocks) }
        .into_iter()
        .map(|r| r.map(drop))
        .collect()
}

fn disk_read(job: &Job) -> Vec<Result<()>> {
    let blocks: Vec<_> = job
        .src_ids
        .iter()
        .zip(&job.dst_ids)
        .enumerate()
        .map(|(pos, (&s, &d))| {
            (
                s,
                job.identity(pos),
                job.dst.block_addrs(d, all_layers(job)),
            )
        })
        .collect();
    // SAFETY: host regions of a registered layout; the caller excludes concurrent access.
    unsafe { disk_of(&job.src).read_blocks(&blocks) }
}

/// Object puts and gets (the default `object` feature).
#[cfg(feature = "object")]
mod object_io {
    use std::sync::Arc;

    use bytes::Bytes;
    use futures::StreamExt;

    use super::{Job, all_layers, copy_regions, device0};
    use crate::error::{PhysicalError, Result};
    use crate::physical::{Backing, PhysicalLayout};

    /// Host memory of a registered layout lent to a `Bytes` without copying; keeps the layout
    /// alive until the body is sent.
    struct Lent {
        _layout: Arc<PhysicalLayout>,
        addr: usize,
        len: usize,
    }

    impl AsRef<[u8]> for Lent {
        fn as_ref(&self) -> &[u8] {
            // SAFETY: inside a live host allocation of `_layout`; the transfer's caller excludes
            // writers until the completion resolves.
            unsafe { std::slice::from_raw_parts(self.addr as *const u8, self.len) }
        }
    }

    fn object_of(layout: &PhysicalLayout) -> &Arc<crate::storage::ObjectStorage> {
        match layout.backing() {
            Backing::Object(o) => o,
            _ => unreachable!("strategy chosen by storage kind"),
        }
    }

    pub(super) async fn object_put(job: Job) -> Vec<Result<()>> {
        let store = Arc::clone(object_of(&job.dst));
        let keys = Arc::clone(job.keys.as_ref().expect("validated"));
        let conc = store.config().max_concurrency.max(1);
        let layers = all_layers(&job);
        let geometry = *job.src.layout().config();
        let job = &job;
        futures::stream::iter(job.src_ids.iter().copied().enumerate())
            .map(|(pos, s)| {
                let parts: Vec<Bytes> = job
                    .src
                    .block_addrs(s, layers.clone())
                    .into_iter()
                    .map(|(addr, len)| {
                        Bytes::from_owner(Lent {
                            _layout: Arc::clone(&job.src),
                            addr,
                            len,
                        })
                    })
                    .collect();
                let store = Arc::clone(&store);
                let keys = Arc::clone(&keys);
                let mode = job.put_mode;
                let identity = job.identity(pos);
                async move {
                    let r = store
                        .put_block(&keys[pos], &identity, &geometry, parts, mode)
                        .await;
                    (pos, r)
                }
            })
            .buffer_unordered(conc)
            .collect::<Vec<_>>()
            .await
            .into_iter()
            .pipe(in_order)
    }

    /// Puts `(position, result)` pairs back in request order (unordered streams avoid head-of-line
    /// blocking behind one slow request).
    fn in_order(results: impl Iterator<Item = (usize, Result<()>)>) -> Vec<Result<()>> {
        let mut v: Vec<(usize, Result<()>)> = results.collect();
        v.sort_by_key(|(pos, _)| *pos);
        v.into_iter().map(|(_, r)| r).collect()
    }

    trait Pipe: Sized {
        fn pipe<T>(self, f: impl FnOnce(Self) -> T) -> T {
            f(self)
        }
    }
    impl<I: Iterator> Pipe for I {}

    pub(super) async fn object_get(job: Job) -> Vec<Result<()>> {
        let store = Arc::clone(object_of(&job.src));
        let keys = Arc::clone(job.keys.as_ref().expect("validated"));
        let conc = store.config().max_concurrency.max(1);
        let c = *job.dst.layout().config();
        let lb = c.layer_bytes();
        let job = &job;
        futures::stream::iter(job.dst_ids.iter().copied().enumerate())
            .map(|(pos, d)| {
                let store = Arc::clone(&store);
                let keys = Arc::clone(&keys);
                async move {
                    let dr = job.dst.block_addrs(d, job.layers.clone());
                    let (start, end) = (job.layers.start * lb, job.layers.end * lb);
                    let identity = job.identity(pos);
                    let r = if device0(&job.dst).is_none() {
                        // Host destination: hash and scatter each chunk of the body as it arrives.
                        let mut out = Scatter::new(&dr);
                        store
                            .get_block_into(&keys[pos], &identity, &c, |off, bytes| {
                                let (lo, hi) = (start.max(off), end.min(off + bytes.len()));
                                if lo < hi {
                                    // SAFETY: `dr` lies in a live host allocation of the
                                    // destination; the caller excludes other access.
                                    unsafe { out.write(&bytes[lo - off..hi - off]) };
                                }
                            })
                            .await
                    } else {
                        match store.get_block(&keys[pos], &identity, &c).await {
                            // SAFETY: `payload` is a live host buffer of `block_bytes`; `dr` lies
                            // in a live allocation of the destination layout.
                            Ok(payload) => unsafe {
                                copy_regions(
                                    None,
                                    device0(&job.dst),
                                    &[(payload.as_ptr() as usize + start, end - start)],
                                    &dr,
                                )
                            },
                            Err(e) => Err(e),
                        }
                    };
                    if let Err(e) = &r {
                        evict_if_bad(&store, &keys[pos], e).await;
                    }
                    (pos, r)
                }
            })
            .buffer_unordered(conc)
            .collect::<Vec<_>>()
            .await
            .into_iter()
            .pipe(in_order)
    }

    /// A verified read proved the object damaged from the object alone: delete it (best
    /// effort, counted in
    /// [`ObjectStorage::evicted_objects`](crate::storage::ObjectStorage::evicted_objects)), so
    /// presence probes stop counting it and the next offload of the block writes it again.
    ///
    /// Proof is what the object says of itself, whoever asked: a complete read whose payload
    /// checksum differs from its header's; a complete header that does not decode, or whose
    /// length disagrees with the body; a body the store says is too long, or too short (a short
    /// read is checked with a HEAD: a cut connection is not damage); a
    /// header bound to another key, namespace or rank (a copy at the wrong place); a header
    /// identity that does not name the block of its own key (see [`names_key`]).
    ///
    /// Nothing else deletes: a short read, an I/O error or a timeout is transient (the object
    /// may be whole), and a header naming another identity *of this key* or another geometry
    /// proves only that the object is not what the reader expected, which may be the reader's
    /// mistake or a forged hint (an event, a presence answer) — deleting on it would let anyone
    /// who can name a hash destroy a valid shared object.
    async fn evict_if_bad(
        store: &crate::storage::ObjectStorage,
        key: &crate::ObjectKey,
        e: &PhysicalError,
    ) {
        let proven = match e {
            PhysicalError::ChecksumMismatch { .. }
            | PhysicalError::CorruptHeader { .. }
            | PhysicalError::TooLarge { .. } => true,
            // A body that ended early is damage only when the store itself says the object is
            // that short (a fresh HEAD); otherwise the connection was cut: transient.
            PhysicalError::ShortRead { expected, .. } => matches!(
                store.object_size(key).await,
                Ok(Some(size)) if size < *expected as u64
            ),
            PhysicalError::IdentityMismatch { what, found, .. } => {
                what.starts_with("object binding")
                    || (*what == "block identity" && !names_key(key, found))
            }
            _ => false,
        };
        if proven && !store.evicts_damaged() {
            tracing::warn!(key = %store.path(key), error = %e, "kept a damaged object: read over plain HTTP, the damage may be in transit");
        } else if proven {
            match store.delete(key).await {
                Ok(()) => {
                    store.count_evicted();
                    tracing::warn!(key = %store.path(key), error = %e, "evicted a damaged object")
                }
                Err(d) => {
                    tracing::warn!(key = %store.path(key), error = %e, delete_error = %d, "cannot evict a damaged object")
                }
            }
        }
    }

    /// Whether a header identity (`found`, as [`BlockIdentity::to_hex`](crate::BlockIdentity::to_hex)
    /// writes it) names the block of a block key (a 128-bit sequence hash): the hash itself, or
    /// a 256-bit digest whose first 8 bytes are the hash's chain value (its top 64 bits), as a
    /// BLAKE3 sequence derives its hashes. A key that is not a block key names anything.
    fn names_key(key: &crate::ObjectKey, found: &str) -> bool {
        let Ok(hash) = crate::storage::parse_hash_key(key.as_str()) else {
            return true;
        };
        let bytes: Option<Vec<u8>> = (0..found.len() / 2)
            .map(|i| {
                found
                    .get(2 * i..2 * i + 2)
                    .and_then(|b| u8::from_str_radix(b, 16).ok())
            })
            .collect();
        let Some(id) = bytes.and_then(|b| crate::BlockIdentity::from_slice(&b)) else {
            return true;
        };
        id == crate::BlockIdentity::from_u128(hash)
            || id.as_bytes()[..8] == ((hash >> 64) as u64).to_be_bytes()
    }

    /// Writes a byte stream into host regions in order (the streaming side of an object get).
    struct Scatter<'a> {
        regions: &'a [(usize, usize)],
        i: usize,
        off: usize,
    }

    impl<'a> Scatter<'a> {
        fn new(regions: &'a [(usize, usize)]) -> Self {
            Scatter {
                regions,
                i: 0,
                off: 0,
            }
        }

        /// Copies `bytes` to the next unwritten bytes of the regions (any excess is dropped).
        ///
        /// # Safety
        /// The regions must be writable host memory no one else accesses meanwhile.
        unsafe fn write(&mut self, mut bytes: &[u8]) {
            while !bytes.is_empty() && self.i < self.regions.len() {
                let (addr, len) = self.regions[self.i];
                let n = (len - self.off).min(bytes.len());
                // SAFETY: `addr + off .. + n` lies inside region `i` (per the caller, writable).
                unsafe {
                    std::ptr::copy_nonoverlapping(bytes.as_ptr(), (addr + self.off) as *mut u8, n)
                };
                bytes = &bytes[n..];
                self.off += n;
                if self.off == len {
                    self.i += 1;
                    self.off = 0;
                }
            }
        }
    }
}

#[cfg(feature = "object")]
use object_io::{object_get, object_put};

/// Stages through a pinned host buffer leased from the manager's pool: `src → bounce` (whole
/// blocks), then `bounce → dst` (the requested layers), as many blocks per round as the buffer
/// holds. The lease is held across all rounds and returned when this returns.
async fn two_hop(job: Job, pool: Arc<BouncePool>) -> Vec<Result<()>> {
    let n = job.src_ids.len();
    let mut out: Vec<Result<()>> = Vec::with_capacity(n);
    let lease = match pool.lease(*job.src.layout().config(), n).await {
        Ok(l) => l,
        Err(e) => {
            let msg = format!("bounce buffer: {e}");
            return (0..n)
                .map(|_| Err(PhysicalError::Aborted(msg.clone())))
                .collect();
        }
    };
    let bounce = lease.layout();
    let chunk = lease.blocks();
    let src_obj = job.src.storage_kind() == StorageKind::Object;
    for start in (0..n).step_by(chunk) {
        let end = (start + chunk).min(n);
        let positions: Vec<usize> = (start..end).collect();
        let step1 = Job {
            src: Arc::clone(&job.src),
            dst: Arc::clone(bounce),
            src_ids: job.src_ids[start..end].to_vec(),
            dst_ids: (0..end - start).collect(),
            layers: all_layers(&job),
            keys: if src_obj {
                job.keys.as_ref().map(|k| Arc::new(k[start..end].to_vec()))
            } else {
                None
            },
            put_mode: job.put_mode,
            identities: job
                .identities
                .as_ref()
                .map(|v| Arc::new(v[start..end].to_vec())),
            _guard: None,
        };
        let mut r1 = run_inner(step1, Arc::clone(&pool)).await;
        let ok: Vec<usize> = (0..r1.len()).filter(|&i| r1[i].is_ok()).collect();
        let step2 = Job {
            src: Arc::clone(bounce),
            dst: Arc::clone(&job.dst),
            src_ids: ok.clone(),
            dst_ids: ok.iter().map(|&i| job.dst_ids[positions[i]]).collect(),
            layers: job.layers.clone(),
            keys: if src_obj {
                None
            } else {
                job.keys
                    .as_ref()
                    .map(|k| Arc::new(ok.iter().map(|&i| k[positions[i]].clone()).collect()))
            },
            put_mode: job.put_mode,
            identities: job
                .identities
                .as_ref()
                .map(|v| Arc::new(ok.iter().map(|&i| v[positions[i]]).collect())),
            _guard: None,
        };
        let r2 = if ok.is_empty() {
            Vec::new()
        } else {
            run_inner(step2, Arc::clone(&pool)).await
        };
        for (i, r) in ok.into_iter().zip(r2) {
            r1[i] = r;
        }
        out.extend(r1);
    }
    drop(lease);
    out
}
