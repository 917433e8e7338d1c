//! The manager's bounce-buffer pool: two-hop transfers share a bounded set of pinned buffers.

mod common;

use common::*;
use kvbm_physical::*;

const BLOCK: usize = 16 << 10; // `small()` geometry

fn manager(buffers: usize, buffer_bytes: usize) -> TransferManager {
    TransferManager::with_config(TransferConfig {
        bounce_buffers: buffers,
        bounce_buffer_bytes: buffer_bytes,
        ..Default::default()
    })
    .unwrap()
}

/// `n` transfers of 3 blocks each, all started before any is awaited: device (stand-in
/// without a GPU) → disk → fresh device, both hops staged through the pool.
async fn concurrent_round_trips(tm: &TransferManager, dir: &std::path::Path, n: usize) {
    let per = 3;
    let disk = tm
        .register_layout(
            PhysicalLayout::create_disk(
                small(n * per, LayoutKind::FullyContiguous),
                &DiskConfig::new(dir.join("g3.bin")),
            )
            .unwrap(),
        )
        .unwrap();
    let srcs: Vec<LayoutHandle> = (0..n)
        .map(|t| {
            let l = PhysicalLayout::allocate_device(
                small(per, LayoutKind::LayerSeparate(BlockDim::BlockContiguous)),
                0,
            )
            .unwrap();
            fill(&l, t as u8);
            tm.register_layout(l).unwrap()
        })
        .collect();
    let slots = |t: usize| -> Vec<usize> { (0..per).map(|b| t * per + (per - 1 - b)).collect() };
    let writes: Vec<_> = (0..n)
        .map(|t| {
            // SAFETY: test-owned layouts; nothing outside the manager reads or writes their blocks while the transfer runs.
            unsafe { tm.execute_transfer(srcs[t], &[0, 1, 2], disk, &slots(t), Default::default()) }
                .unwrap()
        })
        .collect();
    for w in futures::future::join_all(writes).await {
        assert!(w.is_complete_success(), "{:?}", w.blocks);
    }
    let dsts: Vec<LayoutHandle> = (0..n)
        .map(|_| {
            tm.register_layout(
                PhysicalLayout::allocate_device(small(per, LayoutKind::FullyContiguous), 0)
                    .unwrap(),
            )
            .unwrap()
        })
        .collect();
    let reads: Vec<_> = (0..n)
        .map(|t| {
            // SAFETY: test-owned layouts; nothing outside the manager reads or writes their blocks while the transfer runs.
            unsafe { tm.execute_transfer(disk, &slots(t), dsts[t], &[0, 1, 2], Default::default()) }
                .unwrap()
        })
        .collect();
    for r in futures::future::join_all(reads).await {
        assert!(r.is_complete_success(), "{:?}", r.blocks);
    }
    for (t, &h) in dsts.iter().enumerate() {
        let d = tm.layout(h).unwrap();
        let c = *d.layout().config();
        for b in 0..per {
            assert_eq!(
                block_bytes(&d, b, 0..4),
                expected(&c, t as u8, b, 0..4),
                "transfer {t} block {b}"
            );
        }
    }
    // The file is held (flock) while its layout is registered: let the next round reopen it.
    tm.unregister_layout(disk).unwrap();
}

#[tokio::test]
async fn concurrent_two_hop_transfers_share_a_pool_of_one() {
    let dir = tempfile::tempdir().unwrap();
    // One buffer of two blocks: each 3-block transfer takes two rounds, and all 16 wait in turn.
    let tm = manager(1, 2 * BLOCK);
    let n = 8;
    concurrent_round_trips(&tm, dir.path(), n).await;
    let s = tm.bounce_stats();
    assert_eq!((s.capacity, s.buffer_bytes), (1, 2 * BLOCK));
    assert_eq!(s.allocated, 1, "one buffer, allocated once: {s:?}");
    assert_eq!(
        s.reused,
        2 * n as u64 - 1,
        "every later transfer reused it: {s:?}"
    );
    assert_eq!(s.one_off, 0);
    assert_eq!(s.idle, 1, "returned after the last transfer");

    // Steady state: more two-hop transfers allocate nothing.
    concurrent_round_trips(&tm, dir.path(), 2).await;
    let s2 = tm.bounce_stats();
    assert_eq!(s2.allocated, 1);
    assert_eq!(s2.reused, s.reused + 4);
}

#[tokio::test]
async fn default_pool_is_bounded_and_reused() {
    let dir = tempfile::tempdir().unwrap();
    let tm = TransferManager::new().unwrap();
    concurrent_round_trips(&tm, dir.path(), 6).await;
    let s = tm.bounce_stats();
    let d = TransferConfig::default();
    assert_eq!(
        (s.capacity, s.buffer_bytes),
        (d.bounce_buffers, d.bounce_buffer_bytes)
    );
    assert!(
        s.allocated >= 1 && s.allocated <= s.capacity as u64,
        "{s:?}"
    );
    assert_eq!(s.allocated + s.reused, 12, "one lease per transfer: {s:?}");
}

#[tokio::test]
async fn block_larger_than_a_buffer_takes_a_one_off_allocation() {
    let dir = tempfile::tempdir().unwrap();
    let tm = manager(1, BLOCK / 2);
    concurrent_round_trips(&tm, dir.path(), 2).await;
    let s = tm.bounce_stats();
    assert_eq!(s.allocated, 0, "{s:?}");
    assert_eq!(s.one_off, 4, "{s:?}");
}
