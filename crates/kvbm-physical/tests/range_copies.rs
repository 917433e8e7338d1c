//! `TransferManager::execute_copies` (and its inline twin): strided range copies between two
//! memory layouts of different arrangements, checked byte for byte against a model over the
//! blocks' serialized bytes (fragments crossing region boundaries included), and the refusals
//! that leave everything untouched.

use std::sync::Arc;

use kvbm_physical::*;

fn layout(kind: LayoutKind) -> BlockLayout {
    // 3 blocks × 2 layers × K/V × 4 tokens × 3 × 1 B: 12-byte regions, 48-byte blocks.
    BlockLayout::builder()
        .num_blocks(3)
        .num_layers(2)
        .outer_dim(2)
        .page_size(4)
        .inner_dim(3)
        .dtype_bytes(1)
        .kind(kind)
        .build()
        .unwrap()
}

/// The serialized bytes of `block` (its regions concatenated).
fn read(l: &PhysicalLayout, block: usize) -> Vec<u8> {
    let mut out = Vec::new();
    for (addr, len) in l.block_addrs(block, 0..2) {
        // SAFETY: a region of a live layout; no transfer runs while the test reads.
        out.extend_from_slice(unsafe { std::slice::from_raw_parts(addr as *const u8, len) });
    }
    out
}

fn write(l: &PhysicalLayout, block: usize, f: impl Fn(usize) -> u8) {
    let mut i = 0;
    for (addr, len) in l.block_addrs(block, 0..2) {
        // SAFETY: as in `read`, and nothing else holds a view of the region.
        let s = unsafe { std::slice::from_raw_parts_mut(addr as *mut u8, len) };
        for x in s {
            *x = f(i);
            i += 1;
        }
    }
}

fn copies() -> Vec<RangeCopy> {
    vec![
        // Strided gather crossing region boundaries (12-byte regions) on the source.
        RangeCopy {
            src_block: 2,
            src_offset: 5,
            dst_block: 0,
            dst_offset: 1,
            len: 9,
            count: 4,
            src_stride: 10,
            dst_stride: 11,
        },
        RangeCopy::contiguous((0, 0), (2, 40), 8),
    ]
}

fn model(src: &[Vec<u8>], dst: &mut [Vec<u8>], copies: &[RangeCopy]) {
    for c in copies {
        for i in 0..c.count {
            let (s, d) = (
                c.src_offset + i * c.src_stride,
                c.dst_offset + i * c.dst_stride,
            );
            let bytes = src[c.src_block][s..s + c.len].to_vec();
            dst[c.dst_block][d..d + c.len].copy_from_slice(&bytes);
        }
    }
}

#[test]
fn strided_range_copies_match_the_model_across_arrangements() {
    let tm = Arc::new(TransferManager::new().unwrap());
    for (sk, dk, inline) in [
        (
            LayoutKind::FullyContiguous,
            LayoutKind::LayerSeparate(BlockDim::OuterContiguous),
            false,
        ),
        (
            LayoutKind::LayerSeparate(BlockDim::BlockContiguous),
            LayoutKind::FullyContiguous,
            true,
        ),
    ] {
        let src = PhysicalLayout::allocate_host(layout(sk), PinPolicy::Unpinned).unwrap();
        // The host stand-in of device memory (its addresses are host addresses, which the test
        // reads; real GPU memory under feature `cuda` would not be).
        let dl = layout(dk);
        let allocs = (0..dl.num_allocations())
            .map(|_| {
                Arc::new(HostStandInDevice::new(dl.allocation_bytes()).unwrap())
                    as Arc<dyn DeviceMemory>
            })
            .collect();
        let dst = PhysicalLayout::from_backing(dl, Backing::Device(allocs)).unwrap();
        let (sh, dh) = (
            tm.register_layout(src).unwrap(),
            tm.register_layout(dst).unwrap(),
        );
        let (src, dst) = (tm.layout(sh).unwrap(), tm.layout(dh).unwrap());
        for b in 0..3 {
            write(&src, b, |i| (b * 50 + i + 1) as u8);
            write(&dst, b, |_| 0);
        }
        let s: Vec<Vec<u8>> = (0..3).map(|b| read(&src, b)).collect();
        let mut want: Vec<Vec<u8>> = (0..3).map(|b| read(&dst, b)).collect();
        model(&s, &mut want, &copies());
        // SAFETY: the test owns both layouts; nothing else touches them.
        let outcome = unsafe {
            if inline {
                tm.execute_copies_inline(sh, dh, copies()).unwrap()
            } else {
                tm.execute_copies(sh, dh, copies()).unwrap().wait()
            }
        };
        assert!(outcome.is_complete_success());
        assert_eq!(outcome.blocks.len(), 2);
        let got: Vec<Vec<u8>> = (0..3).map(|b| read(&dst, b)).collect();
        assert_eq!(got, want, "{sk:?} -> {dk:?}");

        // Refusals start nothing.
        let bad = |c: Vec<RangeCopy>| {
            // SAFETY: as above.
            unsafe { tm.execute_copies_inline(sh, dh, c) }.unwrap_err()
        };
        let past_end = RangeCopy {
            count: 5,
            ..copies()[0]
        };
        assert!(
            bad(vec![past_end])
                .to_string()
                .contains("leave block 2 of 48 bytes")
        );
        assert!(matches!(
            bad(vec![RangeCopy::contiguous((3, 0), (0, 0), 1)]),
            PhysicalError::BlockOutOfRange { block_id: 3, .. }
        ));
        assert!(
            bad(vec![RangeCopy::contiguous((0, 0), (0, 0), 0)])
                .to_string()
                .contains("empty")
        );
        // SAFETY: as above.
        let same = unsafe { tm.execute_copies_inline(sh, sh, copies()) }.unwrap_err();
        assert!(same.to_string().contains("two layouts"), "{same}");
        assert_eq!((0..3).map(|b| read(&dst, b)).collect::<Vec<_>>(), want);
    }
}
