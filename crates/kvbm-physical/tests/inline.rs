//! `TransferManager::execute_transfer_inline`: host-to-host copies on the caller's thread keep
//! every safety check of the runtime path (claims against transfers in flight, no chained copy,
//! no foreign storage kinds) and release their claims when they return.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::{block_bytes, expected, fill, small};
use kvbm_physical::*;
use object_store::memory::InMemory;
use object_store::throttle::{ThrottleConfig, ThrottledStore};

fn host(n: usize, seed: u8) -> PhysicalLayout {
    let l =
        PhysicalLayout::allocate_host(small(n, LayoutKind::FullyContiguous), PinPolicy::Unpinned)
            .unwrap();
    fill(&l, seed);
    l
}

#[test]
fn inline_copy_moves_the_bytes_and_matches_the_runtime_path() {
    let tm = TransferManager::new().unwrap();
    let a = tm.register_layout(host(4, 1)).unwrap();
    let b = tm.register_layout(host(4, 2)).unwrap();
    let out =
        // SAFETY: test-owned layouts; nothing outside the manager reads or writes their blocks while the transfer runs.
        unsafe { tm.execute_transfer_inline(a, &[3, 0], b, &[1, 2], TransferOptions::default()) }
            .unwrap();
    assert_eq!(
        out.blocks.iter().map(|(id, _)| *id).collect::<Vec<_>>(),
        vec![1, 2],
        "outcomes in request order, named by destination"
    );
    assert!(out.is_complete_success(), "{:?}", out.blocks);
    let (la, lb) = (tm.layout(a).unwrap(), tm.layout(b).unwrap());
    let c = *la.layout().config();
    let all = 0..c.num_layers;
    assert_eq!(
        block_bytes(&lb, 1, all.clone()),
        expected(&c, 1, 3, all.clone())
    );
    assert_eq!(
        block_bytes(&lb, 2, all.clone()),
        expected(&c, 1, 0, all.clone())
    );
    // Untouched destination blocks keep their bytes.
    assert_eq!(
        block_bytes(&lb, 0, all.clone()),
        expected(&c, 2, 0, all.clone())
    );
    assert_eq!(block_bytes(&lb, 3, all.clone()), expected(&c, 2, 3, all));
    // A layer range works as on the runtime path.
    let out =
        // SAFETY: test-owned layouts; nothing outside the manager reads or writes their blocks while the transfer runs.
        unsafe { tm.execute_transfer_inline(b, &[0], a, &[0], TransferOptions::layers(1..2)) }
            .unwrap();
    assert!(out.is_complete_success());
    assert_eq!(block_bytes(&la, 0, 1..2), expected(&c, 2, 0, 1..2));
    assert_eq!(block_bytes(&la, 0, 0..1), expected(&c, 1, 0, 0..1));
}

#[test]
fn inline_copy_refuses_what_the_runtime_path_refuses() {
    let tm = TransferManager::new().unwrap();
    let a = tm.register_layout(host(4, 1)).unwrap();
    let chained =
        // SAFETY: test-owned layouts; nothing outside the manager reads or writes their blocks while the transfer runs.
        unsafe { tm.execute_transfer_inline(a, &[0, 1], a, &[1, 2], TransferOptions::default()) };
    assert!(
        matches!(&chained, Err(PhysicalError::InvalidArgument(m)) if m.contains("chained")),
        "{chained:?}"
    );
    let twice =
        // SAFETY: test-owned layouts; nothing outside the manager reads or writes their blocks while the transfer runs.
        unsafe { tm.execute_transfer_inline(a, &[0, 1], a, &[2, 2], TransferOptions::default()) };
    assert!(
        matches!(twice, Err(PhysicalError::InvalidArgument(_))),
        "{twice:?}"
    );
    // SAFETY: test-owned layouts; nothing outside the manager reads or writes their blocks while the transfer runs.
    let range = unsafe { tm.execute_transfer_inline(a, &[0], a, &[9], TransferOptions::default()) };
    assert!(
        matches!(
            range,
            Err(PhysicalError::BlockOutOfRange { block_id: 9, .. })
        ),
        "{range:?}"
    );
    // Only host memory: a disk side is refused, nothing claimed.
    let dir = tempfile::tempdir().unwrap();
    let d = tm
        .register_layout(common::disk(
            small(4, LayoutKind::FullyContiguous),
            &dir.path().join("g3.bin"),
            IoEngineKind::Psync,
            false,
        ))
        .unwrap();
    // SAFETY: test-owned layouts; nothing outside the manager reads or writes their blocks while the transfer runs.
    let r = unsafe { tm.execute_transfer_inline(a, &[0], d, &[0], TransferOptions::default()) };
    assert!(matches!(r, Err(PhysicalError::NotSupported(_))), "{r:?}");
    // SAFETY: test-owned layouts; nothing outside the manager reads or writes their blocks while the transfer runs.
    let out = unsafe { tm.execute_transfer(a, &[0], d, &[0], TransferOptions::default()) }
        .unwrap()
        .wait();
    assert!(
        out.is_complete_success(),
        "the refused call claimed nothing"
    );
}

#[test]
fn inline_copy_respects_claims_of_transfers_in_flight_and_releases_its_own() {
    let tm = TransferManager::new().unwrap();
    // An object get that stays in flight (and holds its claim on b[0]) for a while.
    let slow = ThrottledStore::new(
        InMemory::new(),
        ThrottleConfig {
            wait_get_per_call: Duration::from_secs(3),
            ..Default::default()
        },
    );
    let storage = Arc::new(ObjectStorage::new(Arc::new(slow), ObjectConfig::default()));
    let obj = tm
        .register_layout(PhysicalLayout::object(
            small(4, LayoutKind::FullyContiguous),
            storage,
        ))
        .unwrap();
    let a = tm.register_layout(host(4, 1)).unwrap();
    let b = tm.register_layout(host(4, 2)).unwrap();
    // SAFETY: test-owned layouts; nothing outside the manager reads or writes their blocks while the transfer runs.
    let get = unsafe {
        tm.execute_transfer(
            obj,
            &[0],
            b,
            &[0],
            TransferOptions::with_object_keys(vec![ObjectKey::from_u128(7)]),
        )
    }
    .unwrap();
    let busy = |r: Result<TransferOutcome>, what: &str| {
        assert!(
            matches!(r, Err(PhysicalError::BlockBusy { block_id: 0, .. })),
            "{what}: {r:?}"
        );
    };
    busy(
        // SAFETY: test-owned layouts; nothing outside the manager reads or writes their blocks while the transfer runs.
        unsafe { tm.execute_transfer_inline(a, &[1], b, &[0], TransferOptions::default()) },
        "an inline write of a block being written",
    );
    busy(
        // SAFETY: test-owned layouts; nothing outside the manager reads or writes their blocks while the transfer runs.
        unsafe { tm.execute_transfer_inline(b, &[0], a, &[2], TransferOptions::default()) },
        "an inline read of a block being written",
    );
    // Other blocks are free; the inline copy's own claims end with the call, so the same copy
    // is accepted again at once, on either path.
    for _ in 0..2 {
        let out =
            // SAFETY: test-owned layouts; nothing outside the manager reads or writes their blocks while the transfer runs.
            unsafe { tm.execute_transfer_inline(a, &[1], b, &[1], TransferOptions::default()) }
                .unwrap();
        assert!(out.is_complete_success());
    }
    // SAFETY: test-owned layouts; nothing outside the manager reads or writes their blocks while the transfer runs.
    let out = unsafe { tm.execute_transfer(a, &[1], b, &[1], TransferOptions::default()) }
        .unwrap()
        .wait();
    assert!(out.is_complete_success());
    // The get fails (no such object) and frees b[0].
    let out = get.wait();
    assert!(!out.is_complete_success());
    // SAFETY: test-owned layouts; nothing outside the manager reads or writes their blocks while the transfer runs.
    let out = unsafe { tm.execute_transfer_inline(a, &[1], b, &[0], TransferOptions::default()) }
        .unwrap();
    assert!(out.is_complete_success());
}
