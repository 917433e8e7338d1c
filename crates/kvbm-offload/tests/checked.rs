//! The checked tier (`kvbm_offload::checked`) over a real O_DIRECT G3 file: a journaled write
//! restarts warm with its checksums; the check on read refuses other bytes; a failure that
//! proves a copy bad unlists it (a restart does not bring it back) and it leaves the manager
//! once unheld, while a transient failure keeps everything.

mod common;

use std::sync::Arc;

use common::{geometry, hash, manager, registered, scratch};
use kvbm_logical::{BlockManager, BlockRegistry, G2, G3, TierId};
use kvbm_offload::{BadCopies, BlockFailure, BlockFailureKind, BlockMover, BoundTier, CheckedDisk};
use kvbm_physical::testing::{bytes, fill};
use kvbm_physical::{DiskConfig, PhysicalLayout, PinPolicy, TransferManager};

const N: usize = 4;

/// One run over the G3 file `path`: G2 host memory filled with `pattern`, G3 the file, both on
/// one registry; the checked disk opened over it.
struct Run {
    g2: BlockManager<G2>,
    g3: Arc<BlockManager<G3>>,
    g2_layout: Arc<PhysicalLayout>,
    mover: BlockMover<G2, G3>,
    disk: CheckedDisk,
    listed: usize,
}

fn run(path: &std::path::Path, pattern: u8) -> Run {
    let registry = BlockRegistry::new();
    let g2 = manager::<G2>(N, Some(&registry));
    let g3 = Arc::new(manager::<G3>(N, Some(&registry)));
    let tm = Arc::new(TransferManager::new().unwrap());
    let host = PhysicalLayout::allocate_host(geometry(N, 2, 64), PinPolicy::Unpinned).unwrap();
    fill(&host, pattern);
    let g2_h = tm.register_layout(host).unwrap();
    let file = PhysicalLayout::create_disk(geometry(N, 2, 64), &DiskConfig::new(path)).unwrap();
    let g3_h = tm.register_layout(file).unwrap();
    let (disk, listed) = CheckedDisk::open(path, &tm.layout(g3_h).unwrap(), None, &g3).unwrap();
    let mover =
        BlockMover::from_layout(g2_h, &BoundTier::new(tm.clone(), g3_h, g3.clone()).unwrap())
            .unwrap();
    Run {
        g2,
        g3,
        g2_layout: tm.layout(g2_h).unwrap(),
        mover,
        disk,
        listed: listed.len(),
    }
}

/// The payload of G2 block `id`, as the write's checksum sees it.
fn payload(layout: &PhysicalLayout, id: usize) -> Vec<u8> {
    bytes(layout, id)
}

fn sum(bytes: &[u8]) -> u128 {
    kvbm_physical::checksum::checksum(bytes)
}

/// Writes G2 blocks `0..N` (hashes `0..N`) into G3 through the checked disk.
async fn write_all(r: &Run) -> Vec<kvbm_logical::ImmutableBlock<G3>> {
    let src = registered(&r.g2, 0, N as u32);
    let sources: Vec<(usize, kvbm_logical::SequenceHash)> = src
        .iter()
        .map(|b| (b.block_id(), b.sequence_hash()))
        .collect();
    let sums: Vec<(u128, u128)> = src
        .iter()
        .map(|b| {
            (
                b.sequence_hash().as_u128(),
                sum(&payload(&r.g2_layout, b.block_id())),
            )
        })
        .collect();
    let dst = r.g3.allocate_blocks(N).unwrap();
    let out = r.disk.write(&r.mover, &sources, dst, async { sums }).await;
    out.into_iter().map(|o| o.expect("written")).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_journaled_write_restarts_warm_and_every_read_is_checked() {
    let dir = scratch();
    let path = dir.path().join("g3.bin");
    let first = run(&path, 0x31);
    assert_eq!(first.listed, 0, "a new file starts cold");
    let written = write_all(&first).await;
    let good = payload(&first.g2_layout, 0);
    first.disk.journal().sync().unwrap();
    drop((written, first));

    let again = run(&path, 0x00);
    assert_eq!(again.listed, N, "every written block is listed at restart");
    assert!(again.g3.registry().is_present(hash(0), TierId::G3));
    // The checksum recorded at write came back with the journal: the stored bytes pass, any
    // others are refused as a checksum mismatch.
    again.disk.check(hash(0), &[&good]).unwrap();
    let mut other = good.clone();
    other[7] ^= 1;
    let e = again.disk.check(hash(0), &[&other]).unwrap_err();
    assert_eq!(e.kind, BlockFailureKind::ChecksumMismatch);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_copy_proven_bad_is_unlisted_and_leaves_once_unheld_a_transient_failure_keeps_it() {
    let dir = scratch();
    let path = dir.path().join("g3.bin");
    let first = run(&path, 0x42);
    let written = write_all(&first).await;
    let slot = |i: usize| written[i].block_id();

    // A timeout says nothing about the copy: kept, listed, still checked.
    let transient = BlockFailure::new(BlockFailureKind::Io, "read timed out");
    assert!(!first.disk.read_failed(hash(0), Some(slot(0)), &transient));
    assert!(!first.disk.bad().contains(hash(0)));

    // A checksum failure proves block 1's copy bad: recorded, and unlisted at once.
    let corrupt = BlockFailure::new(BlockFailureKind::ChecksumMismatch, "bytes differ");
    assert!(first.disk.read_failed(hash(1), Some(slot(1)), &corrupt));
    assert!(first.disk.bad().contains(hash(1)));
    // Still held (by `written`): it stays in G3 and recorded until released.
    first.disk.bad().discard(&first.g3);
    assert!(first.disk.bad().contains(hash(1)));
    let (bad, rest): (Vec<_>, Vec<_>) = written
        .into_iter()
        .partition(|b| b.sequence_hash() == hash(1));
    drop(bad);
    first.disk.bad().discard(&first.g3);
    assert!(first.disk.bad().is_empty(), "discarded once unheld");
    assert!(
        !first.g3.registry().is_present(hash(1), TierId::G3),
        "the bad copy left G3"
    );
    assert!(first.g3.registry().is_present(hash(0), TierId::G3));
    first.disk.journal().sync().unwrap();
    drop((rest, first));

    let again = run(&path, 0x00);
    assert_eq!(again.listed, N - 1, "the bad copy is not listed at restart");
    assert!(!again.g3.registry().is_present(hash(1), TierId::G3));
    assert!(
        again.g3.registry().is_present(hash(0), TierId::G3),
        "the transient failure kept block 0"
    );
}

#[test]
fn bad_copies_follow_the_rule_for_every_kind() {
    let m = manager::<G3>(2, None);
    let bad = BadCopies::<G3>::default();
    for kind in BlockFailureKind::ALL {
        let h = hash(kind.index() as u32);
        let recorded = bad.read_failed(h, &BlockFailure::new(kind, "x"));
        assert_eq!(recorded, kind.drops_copy(), "{kind:?}");
        assert_eq!(bad.contains(h), kind.drops_copy(), "{kind:?}");
    }
    // Copies the manager never held leave the set at once.
    bad.discard(&m);
    assert!(bad.is_empty());
}
