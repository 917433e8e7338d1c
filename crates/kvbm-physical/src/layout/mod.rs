//! How a block maps onto memory.
//!
//! A block is `num_layers × outer_dim` *regions* of `page_size × inner_dim × dtype_bytes` bytes
//! each (outer is 2 for K/V, 1 for MLA). A [`BlockLayout`] maps `(block, layer, outer)` to a
//! [`Region`]: an allocation index, a byte offset and a length.
//!
//! * [`LayoutKind::FullyContiguous`]: one allocation shaped
//!   `[blocks, layers, outer, tokens, inner]`; a whole block is one contiguous range.
//! * [`LayoutKind::LayerSeparate`]: one allocation per layer, either block-contiguous
//!   `[blocks, outer, tokens, inner]` or outer-contiguous `[outer, blocks, tokens, inner]`
//!   (vLLM style).
//!
//! Invariants (property-tested): regions never overlap, stay inside their allocation, and the
//! regions of a block cover exactly `block_bytes` bytes.
//!
//! The *serialized* form of a block (what disk slots and objects hold) is its regions
//! concatenated in `(layer, outer)` order, so a block written under one layout reads back under
//! any other with the same geometry. [`canonical`] holds the tensor-parallel mapping of seed
//! 002 (`CopyRun`, `CanonicalPageMapping`).

pub mod canonical;

use crate::error::{PhysicalError, Result};

/// The per-block geometry shared by all kinds of layout.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub struct LayoutConfig {
    /// Blocks in the layout.
    pub num_blocks: usize,
    /// Layers per block.
    pub num_layers: usize,
    /// Outer dimension: 2 for separate K and V, 1 for MLA.
    pub outer_dim: usize,
    /// Tokens per block (page size).
    pub page_size: usize,
    /// Elements per token per outer slice (heads × head_dim).
    pub inner_dim: usize,
    /// Bytes per element.
    pub dtype_bytes: usize,
}

impl LayoutConfig {
    /// Bytes of one `(block, layer, outer)` region.
    pub fn region_bytes(&self) -> usize {
        self.page_size * self.inner_dim * self.dtype_bytes
    }
    /// Bytes of one layer of a block (`outer_dim` regions).
    pub fn layer_bytes(&self) -> usize {
        self.outer_dim * self.region_bytes()
    }
    /// Bytes of one block.
    pub fn block_bytes(&self) -> usize {
        self.num_layers * self.layer_bytes()
    }
    /// Whether two configs can exchange blocks (everything but the block count agrees).
    pub fn same_block_geometry(&self, other: &LayoutConfig) -> bool {
        LayoutConfig {
            num_blocks: 0,
            ..*self
        } == LayoutConfig {
            num_blocks: 0,
            ..*other
        }
    }
}

/// Which dimension is outermost in a per-layer allocation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub enum BlockDim {
    /// `[blocks, outer, tokens, inner]`: a block's layer is contiguous.
    BlockContiguous,
    /// `[outer, blocks, tokens, inner]`: K of all blocks, then V of all blocks.
    OuterContiguous,
}

/// The arrangement of blocks in memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub enum LayoutKind {
    /// One allocation `[blocks, layers, outer, tokens, inner]`.
    FullyContiguous,
    /// One allocation per layer.
    LayerSeparate(BlockDim),
}

/// Where one `(block, layer, outer)` slice lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Region {
    /// Index of the allocation (0 for fully contiguous, the layer for layer-separate).
    pub allocation: usize,
    /// Byte offset inside the allocation.
    pub offset: usize,
    /// Length in bytes.
    pub len: usize,
}

/// A validated layout: geometry plus arrangement.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct BlockLayout {
    config: LayoutConfig,
    kind: LayoutKind,
}

/// Validating builder for [`BlockLayout`].
///
/// Defaults: `outer_dim` 2, `dtype_bytes` 2, kind fully contiguous; the other dimensions are
/// required.
#[derive(Debug, Clone, Default)]
pub struct LayoutBuilder {
    num_blocks: Option<usize>,
    num_layers: Option<usize>,
    outer_dim: Option<usize>,
    page_size: Option<usize>,
    inner_dim: Option<usize>,
    dtype_bytes: Option<usize>,
    kind: Option<LayoutKind>,
}

impl LayoutBuilder {
    /// Number of blocks. Required.
    pub fn num_blocks(mut self, n: usize) -> Self {
        self.num_blocks = Some(n);
        self
    }
    /// Layers per block. Required.
    pub fn num_layers(mut self, n: usize) -> Self {
        self.num_layers = Some(n);
        self
    }
    /// Outer dimension (2 for K/V, 1 for MLA). Default: 2.
    pub fn outer_dim(mut self, n: usize) -> Self {
        self.outer_dim = Some(n);
        self
    }
    /// Tokens per block. Required.
    pub fn page_size(mut self, n: usize) -> Self {
        self.page_size = Some(n);
        self
    }
    /// Elements per token per outer slice. Required.
    pub fn inner_dim(mut self, n: usize) -> Self {
        self.inner_dim = Some(n);
        self
    }
    /// Bytes per element. Default: 2.
    pub fn dtype_bytes(mut self, n: usize) -> Self {
        self.dtype_bytes = Some(n);
        self
    }
    /// Arrangement. Default: fully contiguous.
    pub fn kind(mut self, kind: LayoutKind) -> Self {
        self.kind = Some(kind);
        self
    }
    /// Fully contiguous arrangement.
    pub fn fully_contiguous(self) -> Self {
        self.kind(LayoutKind::FullyContiguous)
    }
    /// Layer-separate arrangement.
    pub fn layer_separate(self, dim: BlockDim) -> Self {
        self.kind(LayoutKind::LayerSeparate(dim))
    }
    /// Starts from an existing config.
    pub fn config(self, c: LayoutConfig) -> Self {
        self.num_blocks(c.num_blocks)
            .num_layers(c.num_layers)
            .outer_dim(c.outer_dim)
            .page_size(c.page_size)
            .inner_dim(c.inner_dim)
            .dtype_bytes(c.dtype_bytes)
    }

    /// Validates: every dimension non-zero, the total size representable.
    pub fn build(self) -> Result<BlockLayout> {
        let need = |v: Option<usize>, name: &str| {
            v.ok_or_else(|| PhysicalError::InvalidLayout(format!("{name} is required")))
        };
        let config = LayoutConfig {
            num_blocks: need(self.num_blocks, "num_blocks")?,
            num_layers: need(self.num_layers, "num_layers")?,
            outer_dim: self.outer_dim.unwrap_or(2),
            page_size: need(self.page_size, "page_size")?,
            inner_dim: need(self.inner_dim, "inner_dim")?,
            dtype_bytes: self.dtype_bytes.unwrap_or(2),
        };
        let dims = [
            ("num_blocks", config.num_blocks),
            ("num_layers", config.num_layers),
            ("outer_dim", config.outer_dim),
            ("page_size", config.page_size),
            ("inner_dim", config.inner_dim),
            ("dtype_bytes", config.dtype_bytes),
        ];
        let mut total: usize = 1;
        for (name, v) in dims {
            if v == 0 {
                return Err(PhysicalError::InvalidLayout(format!("{name} must be > 0")));
            }
            total = total.checked_mul(v).ok_or_else(|| {
                PhysicalError::InvalidLayout(format!("total size overflows at {name}"))
            })?;
        }
        if total > isize::MAX as usize {
            return Err(PhysicalError::InvalidLayout(format!(
                "total size {total} exceeds isize::MAX"
            )));
        }
        Ok(BlockLayout {
            config,
            kind: self.kind.unwrap_or(LayoutKind::FullyContiguous),
        })
    }
}

impl BlockLayout {
    /// A builder.
    pub fn builder() -> LayoutBuilder {
        LayoutBuilder::default()
    }
    /// The geometry.
    pub fn config(&self) -> &LayoutConfig {
        &self.config
    }
    /// The arrangement.
    pub fn kind(&self) -> LayoutKind {
        self.kind
    }
    /// Number of allocations this layout needs.
    pub fn num_allocations(&self) -> usize {
        match self.kind {
            LayoutKind::FullyContiguous => 1,
            LayoutKind::LayerSeparate(_) => self.config.num_layers,
        }
    }
    /// Bytes of each allocation.
    pub fn allocation_bytes(&self) -> usize {
        match self.kind {
            LayoutKind::FullyContiguous => self.config.num_blocks * self.config.block_bytes(),
            LayoutKind::LayerSeparate(_) => self.config.num_blocks * self.config.layer_bytes(),
        }
    }

    /// The region of `(block, layer, outer)`.
    ///
    /// # Panics
    /// When an index is out of range (callers validate ids first).
    pub fn region(&self, block: usize, layer: usize, outer: usize) -> Region {
        let c = &self.config;
        assert!(
            block < c.num_blocks && layer < c.num_layers && outer < c.outer_dim,
            "region ({block}, {layer}, {outer}) out of range for {c:?}"
        );
        let r = c.region_bytes();
        let (allocation, index) = match self.kind {
            LayoutKind::FullyContiguous => {
                (0, (block * c.num_layers + layer) * c.outer_dim + outer)
            }
            LayoutKind::LayerSeparate(BlockDim::BlockContiguous) => {
                (layer, block * c.outer_dim + outer)
            }
            LayoutKind::LayerSeparate(BlockDim::OuterContiguous) => {
                (layer, outer * c.num_blocks + block)
            }
        };
        Region {
            allocation,
            offset: index * r,
            len: r,
        }
    }

    /// The regions of `block` for `layers`, in serialized `(layer, outer)` order.
    pub fn block_regions(
        &self,
        block: usize,
        layers: std::ops::Range<usize>,
    ) -> impl Iterator<Item = Region> + '_ {
        let outer = self.config.outer_dim;
        layers.flat_map(move |l| (0..outer).map(move |o| self.region(block, l, o)))
    }
}

/// Walks two region lists `(addr, len)` that cover the same serialized bytes and yields
/// `(src addr, dst addr, len)` for the largest chunks contiguous on both sides, in order.
///
/// The one region-pair walk behind host copies, copies into a layout from a plain buffer and
/// the CUDA copy planner. Stops at the end of the shorter list.
pub(crate) fn region_pairs<'a>(
    src: &'a [(usize, usize)],
    dst: &'a [(usize, usize)],
) -> impl Iterator<Item = (usize, usize, usize)> + 'a {
    let (mut i, mut j, mut so, mut dof) = (0, 0, 0, 0);
    std::iter::from_fn(move || {
        if i >= src.len() || j >= dst.len() {
            return None;
        }
        let n = (src[i].1 - so).min(dst[j].1 - dof);
        let item = (src[i].0 + so, dst[j].0 + dof, n);
        so += n;
        dof += n;
        if so == src[i].1 {
            i += 1;
            so = 0;
        }
        if dof == dst[j].1 {
            j += 1;
            dof = 0;
        }
        Some(item)
    })
}

#[cfg(test)]
mod tests;
