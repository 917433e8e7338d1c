//! Layout property tests: regions never overlap, stay inside their allocation and cover each
//! block exactly, for every layout kind the builder accepts.

use proptest::prelude::*;

use super::*;

fn any_layout() -> impl Strategy<Value = BlockLayout> {
    (
        1usize..6,
        1usize..5,
        1usize..3,
        1usize..5,
        1usize..5,
        1usize..3,
        0usize..3,
    )
        .prop_map(|(nb, nl, no, ps, inner, dt, kind)| {
            let kind = match kind {
                0 => LayoutKind::FullyContiguous,
                1 => LayoutKind::LayerSeparate(BlockDim::BlockContiguous),
                _ => LayoutKind::LayerSeparate(BlockDim::OuterContiguous),
            };
            BlockLayout::builder()
                .num_blocks(nb)
                .num_layers(nl)
                .outer_dim(no)
                .page_size(ps)
                .inner_dim(inner)
                .dtype_bytes(dt)
                .kind(kind)
                .build()
                .unwrap()
        })
}

proptest! {
    #[test]
    fn regions_never_overlap_stay_in_bounds_and_cover_blocks(layout in any_layout()) {
        let c = *layout.config();
        let mut owner: Vec<Vec<Option<usize>>> =
            vec![vec![None; layout.allocation_bytes()]; layout.num_allocations()];
        for b in 0..c.num_blocks {
            let mut covered = 0;
            for r in layout.block_regions(b, 0..c.num_layers) {
                prop_assert!(r.allocation < layout.num_allocations());
                prop_assert!(r.offset + r.len <= layout.allocation_bytes());
                for byte in &mut owner[r.allocation][r.offset..r.offset + r.len] {
                    prop_assert!(byte.is_none(), "overlap");
                    *byte = Some(b);
                }
                covered += r.len;
            }
            prop_assert_eq!(covered, c.block_bytes());
        }
        // Every byte of every allocation belongs to exactly one block.
        for alloc in &owner {
            prop_assert!(alloc.iter().all(|o| o.is_some()));
        }
    }
}

#[test]
fn builder_rejects_zero_and_missing_and_overflow() {
    assert!(BlockLayout::builder().num_blocks(1).build().is_err());
    let base = || {
        BlockLayout::builder()
            .num_blocks(2)
            .num_layers(2)
            .page_size(4)
            .inner_dim(8)
    };
    assert!(base().build().is_ok());
    assert!(base().outer_dim(0).build().is_err());
    assert!(base().inner_dim(usize::MAX / 2).build().is_err());
}

#[test]
fn fully_contiguous_block_is_one_range() {
    let l = BlockLayout::builder()
        .num_blocks(3)
        .num_layers(2)
        .page_size(4)
        .inner_dim(8)
        .build()
        .unwrap();
    let rs: Vec<_> = l.block_regions(1, 0..2).collect();
    assert_eq!(rs[0].offset, l.config().block_bytes());
    for w in rs.windows(2) {
        assert_eq!(w[0].offset + w[0].len, w[1].offset);
    }
}

#[test]
fn region_pairs_split_at_both_sides_boundaries() {
    let src = [(100, 10), (200, 6)];
    let dst = [(1000, 4), (2000, 12)];
    let got: Vec<_> = super::region_pairs(&src, &dst).collect();
    assert_eq!(
        got,
        vec![(100, 1000, 4), (104, 2000, 6), (200, 2006, 6)],
        "chunks end wherever either side's region ends"
    );
    assert_eq!(super::region_pairs(&src, &[]).count(), 0);
}

proptest! {
    /// A block's span is where `block_addrs` puts all of it (one merged range) in host memory,
    /// for a fully contiguous layout; any other kind has none.
    #[test]
    fn block_span_is_the_whole_block_of_a_contiguous_layout(layout in any_layout()) {
        let c = *layout.config();
        let contiguous = layout.kind() == LayoutKind::FullyContiguous;
        let p = crate::physical::PhysicalLayout::allocate_host(layout, crate::storage::PinPolicy::Unpinned).unwrap();
        for b in 0..c.num_blocks {
            let addrs = p.block_addrs(b, 0..c.num_layers);
            match p.block_span(b) {
                Some(span) => {
                    prop_assert!(contiguous);
                    prop_assert_eq!(addrs, vec![span]);
                    prop_assert_eq!(span.1, c.block_bytes());
                }
                None => prop_assert!(!contiguous),
            }
        }
    }
}

/// Host layouts of 3 blocks of `layers × outer × inner` bytes (any piece shape of one size).
fn host_layout(
    layers: usize,
    outer: usize,
    inner: usize,
    kind: LayoutKind,
) -> crate::physical::PhysicalLayout {
    crate::physical::PhysicalLayout::allocate_host(
        BlockLayout::builder()
            .num_blocks(3)
            .num_layers(layers)
            .outer_dim(outer)
            .page_size(1)
            .inner_dim(inner)
            .dtype_bytes(1)
            .kind(kind)
            .build()
            .unwrap(),
        crate::storage::PinPolicy::Unpinned,
    )
    .unwrap()
}

fn host_block(l: &crate::physical::PhysicalLayout, b: usize) -> Vec<u8> {
    let layers = l.layout().config().num_layers;
    l.block_addrs(b, 0..layers)
        .into_iter()
        // SAFETY: host memory of the layout, read while nothing writes it.
        .flat_map(|(a, n)| unsafe { std::slice::from_raw_parts(a as *const u8, n) }.to_vec())
        .collect()
}

fn write_host_block(l: &crate::physical::PhysicalLayout, b: usize, seed: u8) {
    let layers = l.layout().config().num_layers;
    let mut k = 0u8;
    for (a, n) in l.block_addrs(b, 0..layers) {
        // SAFETY: host memory of the layout, written by this test only.
        let s = unsafe { std::slice::from_raw_parts_mut(a as *mut u8, n) };
        for x in s {
            *x = k.wrapping_mul(7).wrapping_add(seed);
            k = k.wrapping_add(1);
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(32))]
    /// `copy_host_block`: every byte of the source block lands in order in the destination
    /// block, whatever the regions of each side; the neighbouring blocks are untouched.
    #[test]
    fn a_host_block_copies_whole_across_region_shapes(
        layers in 1usize..4, outer in 1usize..3, src in 0usize..3, dst in 0usize..3, seed: u8,
        kind in 0usize..3,
    ) {
        let inner = 24;
        let bytes = layers * outer * inner;
        // Whole blocks, per layer per block, or K of every block then V: three region shapes.
        let kind = match kind {
            0 => LayoutKind::FullyContiguous,
            1 => LayoutKind::LayerSeparate(BlockDim::BlockContiguous),
            _ => LayoutKind::LayerSeparate(BlockDim::OuterContiguous),
        };
        let from = host_layout(layers, outer, inner, kind);
        let to = host_layout(1, 1, bytes, LayoutKind::FullyContiguous);
        for b in 0..3 {
            write_host_block(&from, b, seed.wrapping_add(b as u8));
            write_host_block(&to, b, 0xEE);
        }
        let others: Vec<Vec<u8>> = (0..3).map(|b| host_block(&to, b)).collect();
        // SAFETY: both layouts are this test's; nothing else touches them.
        let n = unsafe { from.copy_host_block(src, &to, dst) }.unwrap();
        prop_assert_eq!(n, bytes);
        prop_assert_eq!(host_block(&to, dst), host_block(&from, src));
        for b in (0..3).filter(|b| *b != dst) {
            prop_assert_eq!(&host_block(&to, b), &others[b]);
        }
    }
}

#[test]
fn copy_host_block_refuses_other_sizes_and_blocks_out_of_range() {
    let (a, b) = (
        host_layout(2, 1, 8, LayoutKind::FullyContiguous),
        host_layout(1, 1, 8, LayoutKind::FullyContiguous),
    );
    // SAFETY: the test's own layouts; nothing is copied when refused.
    let sizes = unsafe { a.copy_host_block(0, &b, 0) };
    assert!(
        matches!(sizes, Err(crate::PhysicalError::InvalidArgument(_))),
        "{sizes:?}"
    );
    // SAFETY: as above.
    let range = unsafe { b.copy_host_block(3, &b, 0) };
    assert!(
        matches!(range, Err(crate::PhysicalError::InvalidArgument(_))),
        "{range:?}"
    );
}
