//! The fragment walk of range copies ([`RangeCopy`](super::RangeCopy)): each copy's strided
//! fragments as address ranges on both sides, cut along the blocks' regions. Its own module,
//! below both of its users (the ordered copies of `strategy` and the GPU's batched submission
//! of `cuda`), so neither imports the other.

use super::{BlockId, CopyJob};
use crate::error::Result;
use crate::physical::PhysicalLayout;

/// The part `[offset, offset + len)` of a block's serialized bytes, as address ranges of its
/// regions `regions` (validated: it lies inside the block).
fn sub_regions(
    regions: &[(usize, usize)],
    mut offset: usize,
    mut len: usize,
) -> Vec<(usize, usize)> {
    let mut out = Vec::new();
    for &(addr, rlen) in regions {
        if len == 0 {
            break;
        }
        if offset >= rlen {
            offset -= rlen;
            continue;
        }
        let n = (rlen - offset).min(len);
        out.push((addr + offset, n));
        len -= n;
        offset = 0;
    }
    out
}

/// The address of `[offset, offset + len)` of a block's serialized bytes when it lies inside
/// one of its regions `regions`.
#[inline]
fn within(regions: &[(usize, usize)], mut offset: usize, len: usize) -> Option<usize> {
    for &(addr, rlen) in regions {
        if offset < rlen {
            return (offset + len <= rlen).then_some(addr + offset);
        }
        offset -= rlen;
    }
    None
}

/// Walks the range copies of `job` in order: for each copy, `f(copy index, src regions, dst
/// regions)` once per fragment, each side's regions the fragment's address ranges (one range
/// each in the usual case, a fragment inside one region: a tensor's row), stopping a copy at
/// its first error; one result per copy. The one walk behind the ordered copies
/// (`strategy::copy_ranges`) and the GPU's batched submission (`transfer::cuda`).
pub(super) fn walk(
    job: &CopyJob,
    mut f: impl FnMut(usize, &[(usize, usize)], &[(usize, usize)]) -> Result<()>,
) -> Vec<Result<()>> {
    let (sl, dl) = (
        0..job.src.layout().config().num_layers,
        0..job.dst.layout().config().num_layers,
    );
    // Block regions of the last block seen on each side (copies come grouped by block).
    let mut src_cache: Option<(BlockId, Vec<(usize, usize)>)> = None;
    let mut dst_cache: Option<(BlockId, Vec<(usize, usize)>)> = None;
    let regions = |cache: &mut Option<(BlockId, Vec<(usize, usize)>)>,
                   layout: &PhysicalLayout,
                   block: BlockId,
                   layers: &std::ops::Range<usize>| {
        if cache.as_ref().is_none_or(|(b, _)| *b != block) {
            *cache = Some((block, layout.block_addrs(block, layers.clone())));
        }
    };
    job.copies
        .iter()
        .enumerate()
        .map(|(k, c)| {
            regions(&mut src_cache, &job.src, c.src_block, &sl);
            regions(&mut dst_cache, &job.dst, c.dst_block, &dl);
            let sr = &src_cache.as_ref().expect("just set").1;
            let dr = &dst_cache.as_ref().expect("just set").1;
            // The whole strided span inside one region on each side (the usual case: a
            // tensor's row): one lookup per copy, then plain pointer steps.
            let span = |stride: usize| (c.count - 1) * stride + c.len;
            if let (Some(s0), Some(d0)) = (
                within(sr, c.src_offset, span(c.src_stride)),
                within(dr, c.dst_offset, span(c.dst_stride)),
            ) {
                for i in 0..c.count {
                    let (s, d) = (s0 + i * c.src_stride, d0 + i * c.dst_stride);
                    f(k, &[(s, c.len)], &[(d, c.len)])?;
                }
                return Ok(());
            }
            for i in 0..c.count {
                let (so, dof) = (
                    c.src_offset + i * c.src_stride,
                    c.dst_offset + i * c.dst_stride,
                );
                f(k, &sub_regions(sr, so, c.len), &sub_regions(dr, dof, c.len))?;
            }
            Ok(())
        })
        .collect()
}
