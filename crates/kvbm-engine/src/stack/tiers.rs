//! The storage of each tier: host layouts for G1/G2, the G3 disk file with its journal and
//! checksums, the G4 object store; the block managers over them (one registry); and the check
//! every G3 read passes.

use std::collections::HashSet;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use kvbm_logical::{
    BlockManager, BlockRegistry, EventSink, G3, G4, LogicalConfig, SequenceHash, Tier,
};
use kvbm_offload::{ArrivalCheck, BlockFailure, BlockFailureKind, MoveSource};
use kvbm_physical::{BlockLayout, LayoutHandle, LayoutKind, ObjectStorage, PhysicalLayout};
use parking_lot::Mutex;

use crate::error::Result;

use super::context::Context;
use kvbm_offload::journal::DiskJournal;

use super::counters::Counters;

pub(super) struct HostTier<T: Tier> {
    pub(super) manager: Arc<BlockManager<T>>,
    pub(super) handle: LayoutHandle,
    pub(super) layout: Arc<PhysicalLayout>,
}

impl<T: Tier> HostTier<T> {
    /// The bytes of slot `id`.
    ///
    /// # Safety
    /// As [`slot_of`].
    #[allow(clippy::mut_from_ref)]
    pub(super) unsafe fn slot(&self, id: usize) -> &mut [u8] {
        // SAFETY: per this function's contract.
        unsafe { slot_of(&self.layout, id) }
    }
}

/// The bytes of slot `id` of the host layout `layout`.
///
/// # Safety
/// `layout` is host memory, and the caller must be the only writer of the slot while the slice
/// lives (a freshly allocated block, or a block whose transfer has completed and which no
/// transfer writes).
#[allow(clippy::mut_from_ref)]
pub(super) unsafe fn slot_of(layout: &PhysicalLayout, id: usize) -> &mut [u8] {
    let (addr, len) = layout.block_addrs(id, 0..1)[0];
    // SAFETY: host memory of the layout, `len` bytes at `addr`, exclusivity per the contract.
    unsafe { std::slice::from_raw_parts_mut(addr as *mut u8, len) }
}

/// What checking a G3 read needs: shared by the read-ahead and the onboarding mover.
#[derive(Clone)]
pub(super) struct G3Check {
    pub(super) manager: Arc<BlockManager<G3>>,
    pub(super) checksums: Arc<Mutex<std::collections::HashMap<u128, u128>>>,
    pub(super) poisoned: Arc<Mutex<HashSet<SequenceHash>>>,
    pub(super) index: Arc<DiskJournal>,
}

impl G3Tier {
    pub(super) fn check(&self) -> G3Check {
        G3Check {
            manager: self.manager.clone(),
            checksums: self.checksums.clone(),
            poisoned: self.poisoned.clone(),
            index: self.index.clone(),
        }
    }
}

pub(super) struct G3Tier {
    pub(super) manager: Arc<BlockManager<G3>>,
    pub(super) handle: LayoutHandle,
    pub(super) layout: Arc<PhysicalLayout>,
    pub(super) dir: PathBuf,
    /// xxh3-128 of each block's payload as written to G3 (sequence hash → checksum).
    pub(super) checksums: Arc<Mutex<std::collections::HashMap<u128, u128>>>,
    pub(super) poisoned: Arc<Mutex<HashSet<SequenceHash>>>,
    pub(super) warm_blocks: usize,
    /// The persistent index (`<dir>/g3.journal`).
    pub(super) index: Arc<DiskJournal>,
}

pub(super) struct G4Tier {
    pub(super) manager: Arc<BlockManager<G4>>,
    pub(super) handle: LayoutHandle,
    pub(super) storage: Arc<ObjectStorage>,
    pub(super) poisoned: Arc<Mutex<HashSet<SequenceHash>>>,
    pub(super) warm_blocks: usize,
    pub(super) describe: String,
}

pub(super) fn geometry(num_blocks: usize, block_bytes: usize) -> Result<BlockLayout> {
    Ok(BlockLayout::builder()
        .num_blocks(num_blocks.max(1))
        .num_layers(1)
        .outer_dim(1)
        .page_size(1)
        .inner_dim(block_bytes)
        .dtype_bytes(1)
        .kind(LayoutKind::FullyContiguous)
        .build()?)
}

pub(super) fn manager<T: Tier>(
    n: usize,
    registry: &BlockRegistry,
    logical: &LogicalConfig,
) -> Result<Arc<BlockManager<T>>> {
    manager_with_sink(n, registry, logical, None)
}

pub(super) fn manager_with_sink<T: Tier>(
    n: usize,
    registry: &BlockRegistry,
    logical: &LogicalConfig,
    sink: Option<Arc<dyn EventSink>>,
) -> Result<Arc<BlockManager<T>>> {
    let mut builder = BlockManager::<T>::builder()
        .config(logical.clone())
        .block_count(n)
        .registry(registry.clone());
    if let Some(sink) = sink {
        builder = builder.event_sink(sink);
    }
    Ok(Arc::new(builder.build().with_context(|| {
        format!("cannot build the {} block manager", T::ID)
    })?))
}

/// The check every G3 read passes before its G2 copy is registered: the payload must match
/// the xxh3-128 checksum the journal recorded when it was written (a valid slot holding
/// another block, or no record of this one, fails `ChecksumMismatch`). The disk layer has
/// already checked the slot's header (slot, length, file id, identity, payload checksum).
pub(super) fn g3_arrival_check(g3: G3Check) -> ArrivalCheck {
    Arc::new(move |src: &MoveSource, regions: &[&[u8]]| {
        let actual = match regions {
            [one] => xxhash_rust::xxh3::xxh3_128(one),
            many => {
                let mut h = xxhash_rust::xxh3::Xxh3::new();
                for r in many {
                    h.update(r);
                }
                h.digest128()
            }
        };
        let h = src.sequence_hash;
        if g3.checksums.lock().get(&h.as_u128()).copied() == Some(actual) {
            Ok(())
        } else {
            Err(BlockFailure::new(
                BlockFailureKind::ChecksumMismatch,
                format!("G3 block {h} differs from the checksum recorded at write"),
            ))
        }
    })
}

/// A G3 read of `h` failed with `f`: counted ([`count_failure`]); when the failure proves the
/// copy bad ([`BlockFailureKind::drops_copy`]) the block is poisoned in G3 and unlisted from
/// the journal, so it is never read again, while a transient failure keeps the copy.
pub(super) fn g3_read_failed(g3: &G3Check, counters: &Counters, h: SequenceHash, f: &BlockFailure) {
    count_failure(counters, "G3", f);
    if f.kind.drops_copy() {
        g3.poisoned.lock().insert(h);
        g3.checksums.lock().remove(&h.as_u128());
        if let Some(b) = g3.manager.scan_matches(&[h]).first() {
            g3.index.dropped(b.block_id());
        }
    }
}

/// Counts a failed read from `tier`: a copy proven bad as a checksum failure, anything else as
/// a failed transfer.
pub(super) fn count_failure(counters: &Counters, tier: &str, f: &BlockFailure) {
    if f.kind.drops_copy() {
        tracing::warn!(kind = f.kind.as_str(), error = %f.message, "{tier} rejected a block on read");
        counters.checksum_failures.fetch_add(1, Ordering::Relaxed);
    } else {
        tracing::warn!(kind = f.kind.as_str(), error = %f.message, "{tier}→G2 transfer failed");
        counters.failed_transfers.fetch_add(1, Ordering::Relaxed);
    }
}

/// The sequence hashes of every block object under the storage's namespace (lock objects and
/// foreign keys are skipped).
pub(super) async fn list_blocks(storage: &ObjectStorage) -> Result<Vec<SequenceHash>> {
    Ok(storage
        .list_keys()
        .await?
        .iter()
        .filter_map(|k| k.parse_hash().ok().map(SequenceHash::from_u128))
        .collect())
}
