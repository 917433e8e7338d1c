//! The worker's validated description of the KV caches: per KV group its data refs (a tensor,
//! an un-padded page size, optionally a canonical mapping), `blocks_per_chunk`, and whether the
//! CPU chunks hold pages as the GPU does ([`ChunkLayout::Direct`]) or as canonical,
//! parallelism-free pages ([`ChunkLayout::Canonical`]); and the planner turning a job's specs
//! into range copies.
//!
//! Tensor `t` of a vLLM `CanonicalKVCaches` is layer `t` of the GPU layout (one row of
//! `gpu_row` bytes per GPU block) and layer `t` of the CPU layout (one row of `cpu_row` bytes
//! per chunk, holding `blocks_per_chunk` sub-pages of `sub_page = cpu_row / blocks_per_chunk`
//! bytes). Invariants the builder establishes (each refusal names the group, ref and rule):
//!
//! * every ref names a tensor both layouts have, with `0 < page_size_bytes <= gpu_row`;
//! * `cpu_row` is a multiple of `blocks_per_chunk`, and each sub-page holds what a ref puts
//!   there: its page (direct) or its canonical page (canonical);
//! * canonical: every ref has a mapping (certified) whose local page is the ref's page, whose
//!   runs stay inside both pages and whose writer index is below its writer count.
//!
//! Planning a job (store or load) walks the groups in order: group `g` takes the next
//! `group_sizes[g]` GPU ids and the next `ceil((group_sizes[g] + skip) / blocks_per_chunk)`
//! chunk ids, `skip = block_indices[g] % blocks_per_chunk` sub-blocks of its first chunk being
//! left alone; every id must be consumed exactly, and no destination id (chunks of a store,
//! GPU blocks of a load) named twice. A canonical store copies a block only where
//! the ref's mapping says this rank writes the canonical page `chunk * blocks_per_chunk + sub`.

use std::sync::Arc;

use kvbm_physical::{BlockId, CanonicalPageMapping, LayoutHandle, RangeCopy, TransferManager};

use crate::error::{Result, TieringError};
use crate::types::{CanonicalKVCacheRef, CanonicalKVCaches, GpuLoadStoreSpec};

/// How CPU chunks hold pages.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum ChunkLayout {
    /// Each sub-page is the GPU page as this rank holds it (per-rank bytes).
    #[default]
    Direct,
    /// Each sub-page is the canonical page (all heads, parallelism-free); each rank copies its
    /// fragments in and out through its refs' [`CanonicalPageMapping`]s.
    Canonical,
}

/// One data ref of a group, validated.
#[derive(Clone, Debug)]
pub(crate) struct DataRef {
    pub(crate) tensor: usize,
    pub(crate) page: usize,
    pub(crate) mapping: Option<CanonicalPageMapping>,
}

/// A validated description: what [`WorkerLayoutBuilder::build`] makes.
#[derive(Clone, Debug)]
pub(crate) struct WorkerLayout {
    pub(crate) groups: Vec<Vec<DataRef>>,
    pub(crate) blocks_per_chunk: usize,
    pub(crate) gpu_row: usize,
    pub(crate) cpu_row: usize,
    pub(crate) sub_page: usize,
    pub(crate) gpu_blocks: usize,
    pub(crate) cpu_chunks: usize,
}

/// Builder of a [`PhysicalOffloadingWorker`](super::PhysicalOffloadingWorker) over a GPU
/// layout and a CPU layout registered in one transfer manager.
#[derive(Debug)]
pub struct WorkerLayoutBuilder {
    pub(crate) tm: Arc<TransferManager>,
    pub(crate) gpu: LayoutHandle,
    pub(crate) cpu: LayoutHandle,
    groups: Vec<Vec<CanonicalKVCacheRef>>,
    blocks_per_chunk: usize,
    layout: ChunkLayout,
}

fn refuse(msg: String) -> TieringError {
    TieringError::Config(format!("worker layout: {msg}"))
}

impl WorkerLayoutBuilder {
    pub(crate) fn new(tm: Arc<TransferManager>, gpu: LayoutHandle, cpu: LayoutHandle) -> Self {
        Self {
            tm,
            gpu,
            cpu,
            groups: Vec::new(),
            blocks_per_chunk: 1,
            layout: ChunkLayout::Direct,
        }
    }

    /// Appends a KV group with its data refs (`tensor_idx`: a layer of both layouts).
    pub fn group(mut self, refs: Vec<CanonicalKVCacheRef>) -> Self {
        self.groups.push(refs);
        self
    }

    /// The groups of a vLLM `CanonicalKVCaches`, after checking that its tensors are the GPU
    /// layout's layers: as many, each `page_size_bytes` the layer's bytes, `num_blocks` the
    /// layout's blocks, and (for a layer-separate layout) `ptr` the layer's address.
    pub fn caches(mut self, caches: &CanonicalKVCaches) -> Result<Self> {
        let gpu = self.tm.layout(self.gpu)?;
        let c = *gpu.layout().config();
        if caches.tensors.len() != c.num_layers {
            return Err(refuse(format!(
                "{} tensors described, the GPU layout has {} layers",
                caches.tensors.len(),
                c.num_layers
            )));
        }
        let separate = matches!(
            gpu.layout().kind(),
            kvbm_physical::LayoutKind::LayerSeparate(kvbm_physical::BlockDim::BlockContiguous)
        );
        for (t, tensor) in caches.tensors.iter().enumerate() {
            if tensor.page_size_bytes != c.layer_bytes() || tensor.num_blocks != c.num_blocks {
                return Err(refuse(format!(
                    "tensor {t}: {} blocks of {} bytes, the GPU layout has {} of {}",
                    tensor.num_blocks,
                    tensor.page_size_bytes,
                    c.num_blocks,
                    c.layer_bytes()
                )));
            }
            let addr = gpu.block_addrs(0, t..t + 1).first().map(|r| r.0);
            if separate && addr != Some(tensor.ptr) {
                return Err(refuse(format!(
                    "tensor {t}: at {:#x}, the GPU layout's layer {t} is at {addr:#x?}",
                    tensor.ptr
                )));
            }
        }
        self.groups.extend(caches.group_data_refs.iter().cloned());
        Ok(self)
    }

    /// GPU blocks per CPU chunk (default 1).
    pub fn blocks_per_chunk(mut self, n: usize) -> Self {
        self.blocks_per_chunk = n;
        self
    }

    /// How the chunks hold pages (default [`ChunkLayout::Direct`]).
    pub fn layout(mut self, layout: ChunkLayout) -> Self {
        self.layout = layout;
        self
    }

    /// Validates the description (see the module docs for the rules) and builds the worker.
    ///
    /// # Errors
    /// [`TieringError::Config`] naming the group, ref and rule a layout breaks; a layout not
    /// registered in the transfer manager.
    pub fn build(self) -> Result<super::PhysicalOffloadingWorker> {
        super::PhysicalOffloadingWorker::from_builder(&self)
    }

    /// Validates the description (see the module docs for the rules).
    pub(crate) fn validate(&self) -> Result<WorkerLayout> {
        let bpc = self.blocks_per_chunk;
        if bpc == 0 {
            return Err(refuse("blocks_per_chunk must be > 0".into()));
        }
        if self.gpu == self.cpu {
            return Err(refuse("the GPU and CPU layouts are one layout".into()));
        }
        let gpu = self.tm.layout(self.gpu)?;
        let cpu = self.tm.layout(self.cpu)?;
        for (side, l) in [("GPU", &gpu), ("CPU", &cpu)] {
            if !l.is_memory() {
                return Err(refuse(format!(
                    "the {side} layout is {:?}, not memory",
                    l.storage_kind()
                )));
            }
        }
        let (gc, cc) = (*gpu.layout().config(), *cpu.layout().config());
        let (gpu_row, cpu_row) = (gc.layer_bytes(), cc.layer_bytes());
        if !cpu_row.is_multiple_of(bpc) {
            return Err(refuse(format!(
                "a CPU row of {cpu_row} bytes does not split into {bpc} sub-pages"
            )));
        }
        let sub_page = cpu_row / bpc;
        if self.groups.is_empty() {
            return Err(refuse("no KV group".into()));
        }
        let mut groups = Vec::with_capacity(self.groups.len());
        for (g, refs) in self.groups.iter().enumerate() {
            if refs.is_empty() {
                return Err(refuse(format!("group {g} has no data ref")));
            }
            let mut out = Vec::with_capacity(refs.len());
            for (r, rf) in refs.iter().enumerate() {
                let at = format!("group {g} ref {r} (tensor {})", rf.tensor_idx);
                if rf.tensor_idx >= gc.num_layers || rf.tensor_idx >= cc.num_layers {
                    return Err(refuse(format!(
                        "{at}: no such tensor (the GPU layout has {}, the CPU layout {})",
                        gc.num_layers, cc.num_layers
                    )));
                }
                if rf.page_size_bytes == 0 || rf.page_size_bytes > gpu_row {
                    return Err(refuse(format!(
                        "{at}: page of {} bytes, a GPU row holds 1..={gpu_row}",
                        rf.page_size_bytes
                    )));
                }
                let need = match self.layout {
                    ChunkLayout::Direct => rf.page_size_bytes,
                    ChunkLayout::Canonical => {
                        let Some(m) = &rf.mapping else {
                            return Err(refuse(format!(
                                "{at}: no canonical mapping (uncertified), a canonical layout cannot serve it"
                            )));
                        };
                        check_mapping(&at, m, rf.page_size_bytes)?;
                        m.canonical_page_size_bytes
                    }
                };
                if need > sub_page {
                    return Err(refuse(format!(
                        "{at}: CPU rows too small: a sub-page of {sub_page} bytes ({cpu_row}-byte row / {bpc} blocks per chunk) cannot hold a {} page of {need} bytes",
                        match self.layout {
                            ChunkLayout::Direct => "direct",
                            ChunkLayout::Canonical => "canonical",
                        }
                    )));
                }
                out.push(DataRef {
                    tensor: rf.tensor_idx,
                    page: rf.page_size_bytes,
                    mapping: match self.layout {
                        ChunkLayout::Direct => None,
                        ChunkLayout::Canonical => rf.mapping.clone(),
                    },
                });
            }
            groups.push(out);
        }
        Ok(WorkerLayout {
            groups,
            blocks_per_chunk: bpc,
            gpu_row,
            cpu_row,
            sub_page,
            gpu_blocks: gc.num_blocks,
            cpu_chunks: cc.num_blocks,
        })
    }
}

/// A mapping usable for a ref with a page of `page` bytes.
fn check_mapping(at: &str, m: &CanonicalPageMapping, page: usize) -> Result<()> {
    if m.local_page_size_bytes != page {
        return Err(refuse(format!(
            "{at}: the mapping's local page is {} bytes, the ref's page {page}",
            m.local_page_size_bytes
        )));
    }
    if m.num_writers == 0 || m.writer_index >= m.num_writers {
        return Err(refuse(format!(
            "{at}: writer {} of {} writers",
            m.writer_index, m.num_writers
        )));
    }
    for (i, r) in m.runs.iter().enumerate() {
        let end = |off: usize, stride: usize| {
            r.num_fragments
                .checked_sub(1)
                .and_then(|n| n.checked_mul(stride))
                .and_then(|x| x.checked_add(off))
                .and_then(|x| x.checked_add(r.fragment_size))
        };
        let inside = r.fragment_size > 0
            && matches!(end(r.local_offset, r.local_stride), Some(e) if e <= page)
            && matches!(end(r.canonical_offset, r.canonical_stride), Some(e) if e <= m.canonical_page_size_bytes);
        if !inside {
            return Err(refuse(format!(
                "{at}: mapping run {i} ({r:?}) leaves the local page ({page} bytes) or the canonical page ({} bytes)",
                m.canonical_page_size_bytes
            )));
        }
    }
    Ok(())
}

/// Which way a job moves.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Direction {
    /// GPU → CPU.
    Store,
    /// CPU → GPU.
    Load,
}

impl WorkerLayout {
    /// The copies of a job between the GPU blocks of `gpu` and the chunks `chunks` (source to
    /// destination per `dir`), or why the specs do not fit this layout (nothing may move).
    pub(crate) fn plan(
        &self,
        gpu: &GpuLoadStoreSpec,
        chunks: &[i32],
        dir: Direction,
    ) -> std::result::Result<Vec<RangeCopy>, String> {
        let sizes = gpu.group_sizes();
        if sizes.len() != self.groups.len() {
            return Err(format!(
                "the GPU spec has {} groups, the worker {}",
                sizes.len(),
                self.groups.len()
            ));
        }
        let id = |v: i32, n: usize, what: &str| -> std::result::Result<BlockId, String> {
            usize::try_from(v)
                .ok()
                .filter(|&i| i < n)
                .ok_or_else(|| format!("{what} {v} outside 0..{n}"))
        };
        let bpc = self.blocks_per_chunk;
        let ids = gpu.block_ids();
        let (mut k, mut c) = (0usize, 0usize);
        let mut copies = Vec::new();
        for (g, refs) in self.groups.iter().enumerate() {
            let size = sizes[g];
            if size == 0 {
                continue;
            }
            let skip = gpu.block_indices()[g] % bpc;
            let n_chunks = (size + skip).div_ceil(bpc);
            if c + n_chunks > chunks.len() {
                return Err(format!(
                    "group {g}: {size} blocks from sub-block {skip} need {n_chunks} chunks, {} left",
                    chunks.len() - c
                ));
            }
            for j in 0..size {
                let block = id(ids[k + j], self.gpu_blocks, "GPU block")?;
                let logical = skip + j;
                let chunk = id(chunks[c + logical / bpc], self.cpu_chunks, "CPU chunk")?;
                let sub = logical % bpc;
                for r in refs {
                    self.ref_copies(r, block, chunk, sub, dir, &mut copies);
                }
            }
            k += size;
            c += n_chunks;
        }
        if c != chunks.len() {
            return Err(format!("{} chunk ids but the groups use {c}", chunks.len()));
        }
        // Each destination named once: two writes to one slot would leave whichever came last.
        let (what, dst): (&str, &[i32]) = match dir {
            Direction::Store => ("chunk", chunks),
            Direction::Load => ("GPU block", ids),
        };
        let mut seen = std::collections::HashSet::with_capacity(dst.len());
        if let Some(dup) = dst.iter().find(|&&i| !seen.insert(i)) {
            return Err(format!("destination {what} {dup} named twice"));
        }
        Ok(copies)
    }

    /// The copies of one ref of one block (nothing for a canonical store by a non-writer).
    fn ref_copies(
        &self,
        r: &DataRef,
        block: BlockId,
        chunk: BlockId,
        sub: usize,
        dir: Direction,
        out: &mut Vec<RangeCopy>,
    ) {
        let g_base = r.tensor * self.gpu_row;
        let c_base = r.tensor * self.cpu_row + sub * self.sub_page;
        let orient = |(go, gs): (usize, usize), (co, cs): (usize, usize), len, count| match dir {
            Direction::Store => RangeCopy {
                src_block: block,
                src_offset: go,
                src_stride: gs,
                dst_block: chunk,
                dst_offset: co,
                dst_stride: cs,
                len,
                count,
            },
            Direction::Load => RangeCopy {
                src_block: chunk,
                src_offset: co,
                src_stride: cs,
                dst_block: block,
                dst_offset: go,
                dst_stride: gs,
                len,
                count,
            },
        };
        match &r.mapping {
            None => out.push(orient((g_base, r.page), (c_base, r.page), r.page, 1)),
            Some(m) => {
                if dir == Direction::Store && !m.is_writer(chunk * self.blocks_per_chunk + sub) {
                    return;
                }
                out.extend(m.runs.iter().map(|run| {
                    orient(
                        (g_base + run.local_offset, run.local_stride),
                        (c_base + run.canonical_offset, run.canonical_stride),
                        run.fragment_size,
                        run.num_fragments,
                    )
                }));
            }
        }
    }
}
