//! [`BoundTier`]: one tier's block manager bound to its physical layout, with one block-id
//! space.
//!
//! `kvbm-logical` hands out block ids (`BlockManager<T>`) and `kvbm-physical` addresses slots of
//! a layout; the two are siblings and neither knows the other, so their ids agree only if the
//! manager has exactly as many blocks as the layout has slots. A `BoundTier` is where that is
//! checked, once, when the tier is bound: every block id the manager hands out is a valid slot of
//! the layout, and every mover, lane and engine built from bound tiers inherits that fact.
//!
//! ```text
//!   BlockManager<T> (ids 0..n) ──┐
//!                                ├─ BoundTier::new: n == layout slots? ─► BoundTier<T>
//!   LayoutHandle (slots 0..m) ───┘        else TierSizeMismatch { manager_blocks: n, layout_blocks: m }
//! ```
//!
//! An object layout (G4) has no slots: blocks are addressed by key (their sequence hash), so a
//! bound object tier is *keyed*, its manager only records presence and no count is compared. A
//! mover whose source is a keyed tier reads each block from its key.

use std::sync::Arc;

use kvbm_logical::{BlockManager, LogicalError, MutableBlock, Tier};
use kvbm_physical::{LayoutHandle, StorageKind, TransferManager};

use crate::error::OffloadError;

/// A tier's block manager and its physical layout, with counts checked to agree: one block-id
/// space, so a manager's block id is the layout's slot id (object layouts are keyed and exempt).
/// Cheap to clone.
pub struct BoundTier<T: Tier> {
    transfer_manager: Arc<TransferManager>,
    layout: LayoutHandle,
    manager: Arc<BlockManager<T>>,
    layout_blocks: usize,
    keyed: bool,
}

impl<T: Tier> Clone for BoundTier<T> {
    fn clone(&self) -> Self {
        Self {
            transfer_manager: self.transfer_manager.clone(),
            layout: self.layout,
            manager: self.manager.clone(),
            layout_blocks: self.layout_blocks,
            keyed: self.keyed,
        }
    }
}

impl<T: Tier> std::fmt::Debug for BoundTier<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BoundTier")
            .field("tier", &T::ID)
            .field("layout", &self.layout)
            .field("blocks", &self.manager.total_blocks())
            .field("keyed", &self.keyed)
            .finish()
    }
}

impl<T: Tier> BoundTier<T> {
    /// Binds `manager` to `layout` (registered with `transfer_manager`).
    ///
    /// # Errors
    /// [`OffloadError::TierSizeMismatch`] (naming both counts) when the manager's block count
    /// differs from the layout's slot count (object layouts excepted: they are keyed);
    /// [`OffloadError::Setup`] when `layout` is not registered with `transfer_manager`.
    pub fn new(
        transfer_manager: Arc<TransferManager>,
        layout: LayoutHandle,
        manager: Arc<BlockManager<T>>,
    ) -> Result<Self, OffloadError> {
        let physical = transfer_manager
            .layout(layout)
            .map_err(|e| OffloadError::Setup(format!("tier {:?}: {e}", T::ID)))?;
        let layout_blocks = physical.layout().config().num_blocks;
        let keyed = physical.storage_kind() == StorageKind::Object;
        let manager_blocks = manager.total_blocks();
        if !keyed && manager_blocks != layout_blocks {
            return Err(OffloadError::TierSizeMismatch {
                tier: T::ID,
                manager_blocks,
                layout_blocks,
            });
        }
        Ok(Self {
            transfer_manager,
            layout,
            manager,
            layout_blocks,
            keyed,
        })
    }

    /// The layout (its slot ids are the manager's block ids).
    pub fn layout(&self) -> LayoutHandle {
        self.layout
    }

    /// The block manager.
    pub fn manager(&self) -> &Arc<BlockManager<T>> {
        &self.manager
    }

    /// The transfer manager the layout is registered with.
    pub fn transfer_manager(&self) -> &Arc<TransferManager> {
        &self.transfer_manager
    }

    /// Blocks in the tier's id space (the manager's count, equal to the layout's slots unless
    /// the tier is keyed).
    pub fn block_count(&self) -> usize {
        self.manager.total_blocks()
    }

    /// Slots of the layout (for a keyed tier, the most blocks one transfer may name).
    pub fn layout_blocks(&self) -> usize {
        self.layout_blocks
    }

    /// Whether blocks are addressed by key (an object layout), not by slot.
    pub fn is_keyed(&self) -> bool {
        self.keyed
    }

    /// Allocates `n` destination blocks from the manager (ids valid in the layout).
    ///
    /// # Errors
    /// As [`BlockManager::allocate_blocks`].
    pub fn allocate(&self, n: usize) -> Result<Vec<MutableBlock<T>>, LogicalError> {
        self.manager.allocate_blocks(n)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvbm_logical::{G2, G3};
    use kvbm_physical::{LayoutKind, PhysicalLayout, PinPolicy};

    fn host(tm: &TransferManager, n: usize) -> LayoutHandle {
        let layout = kvbm_physical::BlockLayout::builder()
            .num_blocks(n)
            .num_layers(1)
            .outer_dim(1)
            .page_size(4)
            .inner_dim(16)
            .dtype_bytes(2)
            .kind(LayoutKind::FullyContiguous)
            .build()
            .unwrap();
        tm.register_layout(PhysicalLayout::allocate_host(layout, PinPolicy::Unpinned).unwrap())
            .unwrap()
    }

    fn manager<T: Tier>(n: usize) -> Arc<BlockManager<T>> {
        Arc::new(
            BlockManager::<T>::builder()
                .block_count(n)
                .block_size(4)
                .build()
                .unwrap(),
        )
    }

    #[test]
    fn bound_tier_refuses_a_count_mismatch_naming_both_counts() {
        let tm = Arc::new(TransferManager::new().unwrap());
        let layout = host(&tm, 8);
        let err = BoundTier::new(tm.clone(), layout, manager::<G3>(6)).unwrap_err();
        assert!(
            matches!(
                err,
                OffloadError::TierSizeMismatch {
                    tier: kvbm_logical::TierId::G3,
                    manager_blocks: 6,
                    layout_blocks: 8
                }
            ),
            "{err}"
        );
        let msg = err.to_string();
        assert!(msg.contains('6') && msg.contains('8'), "{msg}");
        let bound = BoundTier::new(tm.clone(), layout, manager::<G2>(8)).unwrap();
        assert_eq!((bound.block_count(), bound.layout_blocks()), (8, 8));
        assert!(!bound.is_keyed());
        // Every id the manager hands out is a slot of the layout.
        let ids: Vec<usize> = bound
            .allocate(8)
            .unwrap()
            .iter()
            .map(|b| b.block_id())
            .collect();
        assert!(ids.iter().all(|&i| i < bound.layout_blocks()));
        // A handle of another transfer manager is refused (handle ids are process-unique).
        let other = TransferManager::new().unwrap();
        let foreign = host(&other, 8);
        assert!(matches!(
            BoundTier::new(tm.clone(), foreign, manager::<G2>(8)),
            Err(OffloadError::Setup(_))
        ));
    }
}
