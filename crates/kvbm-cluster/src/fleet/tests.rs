//! The fleet tier's byte copy between layouts cut into different pieces (vLLM's region: one
//! piece per chunk; the instance's G2: its geometry's layer pieces).

use kvbm_physical::{BlockLayout, PhysicalLayout, PinPolicy};
use proptest::prelude::*;

use super::copy_block;

fn layout(layers: usize, outer: usize, inner: usize, blocks: usize) -> PhysicalLayout {
    PhysicalLayout::allocate_host(
        BlockLayout::builder()
            .num_blocks(blocks)
            .num_layers(layers)
            .outer_dim(outer)
            .page_size(1)
            .inner_dim(inner)
            .dtype_bytes(1)
            .build()
            .unwrap(),
        PinPolicy::Unpinned,
    )
    .unwrap()
}

fn block(l: &PhysicalLayout, b: usize) -> Vec<u8> {
    let layers = l.layout().config().num_layers;
    l.block_addrs(b, 0..layers)
        .into_iter()
        // SAFETY: host memory of the layout, read while nothing writes it.
        .flat_map(|(a, n)| unsafe { std::slice::from_raw_parts(a as *const u8, n) }.to_vec())
        .collect()
}

fn write(l: &PhysicalLayout, b: usize, seed: u8) {
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
    /// Every byte of the source block lands in order in the destination block, whatever the
    /// pieces of each side; the neighbouring blocks are untouched.
    #[test]
    fn a_block_copies_whole_across_piece_shapes(
        layers in 1usize..4, outer in 1usize..3, src in 0usize..3, dst in 0usize..3, seed: u8,
    ) {
        let inner = 24;
        let bytes = layers * outer * inner;
        let from = layout(layers, outer, inner, 3);
        let to = layout(1, 1, bytes, 3);
        for b in 0..3 {
            write(&from, b, seed.wrapping_add(b as u8));
            write(&to, b, 0xEE);
        }
        let others: Vec<Vec<u8>> = (0..3).map(|b| block(&to, b)).collect();
        // SAFETY: both layouts are this test's; nothing else touches them.
        let n = unsafe { copy_block(&from, src, &to, dst) };
        prop_assert_eq!(n, bytes);
        prop_assert_eq!(block(&to, dst), block(&from, src));
        for b in (0..3).filter(|b| *b != dst) {
            prop_assert_eq!(&block(&to, b), &others[b]);
        }
    }
}
