//! NIXL over loopback: two agents in one process, UCX between them. Skips, saying why, where
//! NIXL's library cannot be loaded (fails instead under `KVBM_REQUIRE_NIXL`, as CI sets it with
//! the wheel's libraries on the path).

use std::sync::Arc;
use std::time::Duration;

use super::*;
use crate::layout::{BlockDim, BlockLayout, LayoutKind};
use crate::physical::PhysicalLayout;
use crate::storage::PinPolicy;
use crate::testing::{bytes, fill};

fn nixl_or_skip(test: &str) -> bool {
    if super::super::nixl_available() {
        return true;
    }
    let why = format!("{} cannot be loaded", super::super::NIXL_LIBRARY);
    if std::env::var_os("KVBM_REQUIRE_NIXL").is_some() {
        panic!("{test}: KVBM_REQUIRE_NIXL is set but {why}");
    }
    eprintln!("SKIPPED {test}: {why}");
    false
}

fn host(n: usize, kind: LayoutKind, seed: Option<u8>) -> Arc<PhysicalLayout> {
    let l = BlockLayout::builder()
        .num_blocks(n)
        .num_layers(3)
        .outer_dim(2)
        .page_size(8)
        .inner_dim(64)
        .dtype_bytes(2)
        .kind(kind)
        .build()
        .unwrap();
    let p = PhysicalLayout::allocate_host(l, PinPolicy::Unpinned).unwrap();
    if let Some(seed) = seed {
        fill(&p, seed);
    }
    Arc::new(p)
}

#[test]
fn loopback_write_and_read_move_blocks_between_layouts_of_two_kinds() {
    if !nixl_or_skip("loopback_write_and_read_move_blocks_between_layouts_of_two_kinds") {
        return;
    }
    let mut a = NixlAgent::new("kvbm-a").unwrap();
    let mut b = NixlAgent::new("kvbm-b").unwrap();
    let src = host(8, LayoutKind::FullyContiguous, Some(0x5e));
    let dst = host(
        8,
        LayoutKind::LayerSeparate(BlockDim::OuterContiguous),
        None,
    );
    let back = host(8, LayoutKind::FullyContiguous, None);
    a.register(src.clone()).unwrap();
    a.register(back.clone()).unwrap();
    let remote = b.register(dst.clone()).unwrap();
    let peer = a.load_remote(&b.metadata().unwrap()).unwrap();
    assert_eq!(peer, "kvbm-b");
    // SAFETY: the test's layouts; nothing else touches them meanwhile.
    let moved = unsafe { a.transfer(NixlOp::Write, &src, &[5, 0, 2], &peer, &remote, &[1, 7, 3]) }
        .unwrap()
        .wait(Duration::from_secs(30))
        .unwrap();
    assert_eq!(moved as usize, 3 * src.layout().config().block_bytes());
    for (s, d) in [(5, 1), (0, 7), (2, 3)] {
        assert_eq!(bytes(&src, s), bytes(&dst, d), "block {s} written to {d}");
    }
    // Read them back into other blocks.
    // SAFETY: as above.
    unsafe { a.transfer(NixlOp::Read, &back, &[4, 6, 0], &peer, &remote, &[1, 7, 3]) }
        .unwrap()
        .wait(Duration::from_secs(30))
        .unwrap();
    for (s, d) in [(5, 4), (0, 6), (2, 0)] {
        assert_eq!(
            bytes(&src, s),
            bytes(&back, d),
            "block {s} read back into {d}"
        );
    }
}

#[test]
fn refusals_post_nothing() {
    if !nixl_or_skip("refusals_post_nothing") {
        return;
    }
    let mut a = NixlAgent::new("kvbm-ra").unwrap();
    let mut b = NixlAgent::new("kvbm-rb").unwrap();
    let src = host(4, LayoutKind::FullyContiguous, Some(1));
    let unregistered = host(4, LayoutKind::FullyContiguous, Some(2));
    a.register(src.clone()).unwrap();
    let remote = b
        .register(host(4, LayoutKind::FullyContiguous, None))
        .unwrap();
    let peer = a.load_remote(&b.metadata().unwrap()).unwrap();
    // SAFETY: refused before anything is posted.
    let e = unsafe { a.transfer(NixlOp::Write, &src, &[0], &peer, &remote, &[4]) }.unwrap_err();
    assert!(
        matches!(e, PhysicalError::BlockOutOfRange { block_id: 4, .. }),
        "{e}"
    );
    // SAFETY: refused before anything is posted.
    let e = unsafe { a.transfer(NixlOp::Write, &unregistered, &[0], &peer, &remote, &[0]) }
        .unwrap_err();
    assert!(e.to_string().contains("not registered"), "{e}");
    let mut other = remote.clone();
    other.config.inner_dim = 32;
    // SAFETY: refused before anything is posted.
    let e = unsafe { a.transfer(NixlOp::Write, &src, &[0], &peer, &other, &[0]) }.unwrap_err();
    assert!(matches!(e, PhysicalError::IncompatibleLayouts(_)), "{e}");
    // SAFETY: refused before anything is posted.
    let e = unsafe { a.transfer(NixlOp::Write, &src, &[0, 1], &peer, &remote, &[0]) }.unwrap_err();
    assert!(e.to_string().contains("2 local blocks for 1"), "{e}");
}
