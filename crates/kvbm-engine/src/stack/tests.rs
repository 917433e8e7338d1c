//! Tests of the tier set's compositions that need no server: G1 configured on a device,
//! over the host stand-in of device memory (the device path: not host memory, onboarded
//! through the transfer manager, never read in place). `gpu_tests` runs the same over a GPU.

use std::sync::Arc;

use kvbm_logical::{Salt, SequenceHash};
use kvbm_physical::testing::{bytes, fill, geometry};
use kvbm_physical::{
    BlockLayout, PhysicalLayout, PinPolicy, StorageKind, TransferManager, TransferOptions,
};

use super::tiers::{TierSet, TierSetPlan};
use crate::config::{G1Memory, KvbmConfig};
use crate::leader::TierSinks;
use crate::runtime::KvbmRuntime;

/// Blocks of 2 layers × 2 × 16 tokens × 64 × 2 bytes (8 KiB), fully contiguous.
fn small_geometry(n: usize) -> crate::Result<BlockLayout> {
    Ok(geometry(n, 2, 64))
}

/// G1 and G2 of `n` blocks of 8 KiB, G1 configured on a device.
fn device_g1(n: usize) -> KvbmConfig {
    let mut cfg = KvbmConfig::default();
    cfg.tiers.g1_blocks = n;
    cfg.tiers.g2_blocks = n;
    cfg.tiers.block_bytes = 8192;
    cfg.physical.g1 = G1Memory::Device;
    cfg
}

/// The tier set of `cfg` (no sinks, no remote search), its device G1 from `allocate`.
fn tier_set(
    cfg: &KvbmConfig,
    handle: &crate::runtime::RuntimeHandle,
    contents: Option<Arc<dyn crate::stack::Contents>>,
    allocate: fn(BlockLayout, usize) -> kvbm_physical::Result<PhysicalLayout>,
) -> crate::Result<TierSet> {
    handle.tokio().block_on(TierSet::build_with(
        TierSetPlan {
            config: cfg,
            runtime: handle,
            shape: Box::new(small_geometry),
            pin: [PinPolicy::TryPin, PinPolicy::TryPin],
            sinks: TierSinks::default(),
            contents,
            identities: Arc::default(),
            remote: None,
            fingerprint: None,
        },
        allocate,
    ))
}

#[test]
fn g1_on_a_device_stand_in_onboards_through_the_transfer_manager() {
    g1_on_a_device_onboards_through_the_transfer_manager(PhysicalLayout::allocate_device);
}

/// A tier set with `physical.g1 = "device"`, its G1 from `allocate` (real GPU memory, or the
/// host stand-in), onboarding eight G2 blocks through its G2→G1 mover (not inline: G1 is not
/// host memory), each read back through the transfer manager and compared with its G2 bytes.
pub(super) fn g1_on_a_device_onboards_through_the_transfer_manager(
    allocate: fn(BlockLayout, usize) -> kvbm_physical::Result<PhysicalLayout>,
) {
    let cfg = device_g1(16);
    let runtime = KvbmRuntime::builder().config(cfg.clone()).build().unwrap();
    let handle = runtime.handle();
    let mut set = tier_set(&cfg, &handle, None, allocate).unwrap();
    let (g1m, g1l) = set.g1();
    let (g1m, g1l) = (g1m.clone(), g1l.clone());
    assert_eq!(g1l.storage_kind(), StorageKind::Device);
    let (g2m, g2l) = set.g2().map(|(m, l)| (m.clone(), l.clone())).unwrap();
    // Eight blocks computed into G2 (every slot filled with its pattern) and registered.
    fill(&g2l, 7);
    let tokens = cfg.logical.block_size;
    let hashes: Vec<SequenceHash> = (0..8u32)
        .map(|i| {
            let block: Vec<u32> = (0..tokens).map(|t| i * 1000 + t).collect();
            SequenceHash::root(Salt::NONE, &block)
        })
        .collect();
    let blocks = g2m.allocate_blocks(8).unwrap();
    let complete: Vec<_> = blocks
        .into_iter()
        .zip(&hashes)
        .map(|(b, h)| b.complete(*h).unwrap())
        .collect();
    let g2_blocks = g2m.register_blocks(complete);
    // Onboarded into G1 through the tier set's G2→G1 mover.
    let movers = set.take_movers().unwrap();
    let dst = g1m.allocate_blocks(8).unwrap();
    let out = handle
        .tokio()
        .block_on(movers.g2_to_g1().move_blocks(&g2_blocks, dst));
    let g1_blocks: Vec<_> = out.into_iter().map(|o| o.expect("onboarded")).collect();
    // Read back through the transfer manager and compared.
    let tm: &Arc<TransferManager> = &set.tm;
    let host = tm
        .register_layout(
            PhysicalLayout::allocate_host(small_geometry(8).unwrap(), PinPolicy::TryPin).unwrap(),
        )
        .unwrap();
    let g1h = set.g1.handle;
    let ids: Vec<usize> = g1_blocks.iter().map(|b| b.block_id()).collect();
    // SAFETY: registered G1 blocks (nothing writes them) into the test's own host layout.
    let o = unsafe {
        tm.execute_transfer(
            g1h,
            &ids,
            host,
            &(0..8).collect::<Vec<_>>(),
            TransferOptions::default(),
        )
    }
    .unwrap()
    .wait();
    assert!(o.is_complete_success(), "{:?}", o.failures().next());
    let back = tm.layout(host).unwrap();
    for (i, src) in g2_blocks.iter().enumerate() {
        assert_eq!(
            bytes(&back, i),
            bytes(&g2l, src.block_id()),
            "block {i} from G1"
        );
    }
}

/// A contents check reads G1 on the host: with G1 in device memory the tier set refuses it,
/// naming `physical.g1`, instead of reading device addresses as host ones.
#[test]
fn a_contents_check_over_g1_in_device_memory_is_refused_naming_the_key() {
    #[derive(Debug)]
    struct Any;
    impl crate::stack::Contents for Any {
        fn fill(&self, _: SequenceHash, _: &mut [u8]) {}
        fn verify(&self, _: SequenceHash, _: &[u8]) -> bool {
            true
        }
    }
    let cfg = device_g1(4);
    let runtime = KvbmRuntime::builder().config(cfg.clone()).build().unwrap();
    let handle = runtime.handle();
    let built = tier_set(
        &cfg,
        &handle,
        Some(Arc::new(Any)),
        PhysicalLayout::allocate_device,
    );
    match built {
        Err(e) => assert_eq!(e.config_key(), Some("physical.g1"), "{e}"),
        Ok(_) => panic!("a contents check over device G1 was accepted"),
    }
}
