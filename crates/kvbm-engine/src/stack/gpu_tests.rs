//! GPU tests of the engine (feature `cuda`, run by `cargo xtask gpu-check`, which bundles this
//! binary beside kvbm-physical's): a tier set with `physical.g1 = "device"` onboarding through
//! the copy engine, and kvbm-tiering's worker over an engine's device caches (what vLLM's
//! `get_worker(kv_caches)` hands over). Each skips, saying why, without a GPU (fails instead
//! under `KVBM_REQUIRE_GPU`).

use std::sync::Arc;

use kvbm_logical::SequenceHash;
use kvbm_physical::testing::{bytes, fill, geometry, gpu_or_skip, pattern};
use kvbm_physical::{
    DeviceMemory, PhysicalLayout, PinPolicy, StorageKind, TransferManager, TransferOptions,
};

use super::tiers::{TierSet, TierSetPlan};
use crate::config::{G1Memory, KvbmConfig};
use crate::leader::TierSinks;
use crate::runtime::KvbmRuntime;

/// Blocks of 2 layers × 2 × 16 tokens × 64 × 2 bytes (8 KiB), fully contiguous.
fn small_geometry(n: usize) -> crate::Result<kvbm_physical::BlockLayout> {
    Ok(geometry(n, 2, 64))
}

/// Row `b` of the engine's tensor `t`: `testing`'s pattern, seeded by the tensor.
fn row(t: usize, b: usize, page: usize) -> Vec<u8> {
    (0..page).map(|k| pattern(t as u8, b, k)).collect()
}

#[test]
fn gpu_tier_set_with_g1_on_the_device_onboards_through_the_copy_engine() {
    if !gpu_or_skip("gpu_tier_set_with_g1_on_the_device_onboards_through_the_copy_engine") {
        return;
    }
    let mut cfg = KvbmConfig::default();
    cfg.tiers.g1_blocks = 16;
    cfg.tiers.g2_blocks = 16;
    cfg.tiers.block_bytes = 8192;
    cfg.physical.g1 = G1Memory::Device;
    let runtime = KvbmRuntime::builder().config(cfg.clone()).build().unwrap();
    let handle = runtime.handle();
    let mut set = handle
        .tokio()
        .block_on(TierSet::build(TierSetPlan {
            config: &cfg,
            runtime: &handle,
            shape: Box::new(small_geometry),
            pin: [PinPolicy::TryPin, PinPolicy::TryPin],
            sinks: TierSinks::default(),
            contents: None,
            identities: Arc::default(),
            remote: None,
            fingerprint: None,
        }))
        .unwrap();
    let (g1m, g1l) = set.g1();
    let (g1m, g1l) = (g1m.clone(), g1l.clone());
    assert_eq!(g1l.storage_kind(), StorageKind::Device);
    let (g2m, g2l) = set.g2().map(|(m, l)| (m.clone(), l.clone())).unwrap();
    // Eight blocks computed into G2 (every slot filled with its pattern) and registered.
    fill(&g2l, 7);
    let hashes: Vec<SequenceHash> = (0..8u64)
        .map(|i| SequenceHash::from_u128(1000 + i as u128))
        .collect();
    let blocks = g2m.allocate_blocks(8).unwrap();
    let complete: Vec<_> = blocks
        .into_iter()
        .zip(&hashes)
        .map(|(b, h)| b.complete(*h).unwrap())
        .collect();
    let g2_blocks = g2m.register_blocks(complete);
    // Onboarded into G1 on the device through the tier set's G2→G1 mover.
    let movers = set.take_movers().unwrap();
    let dst = g1m.allocate_blocks(8).unwrap();
    let out = handle
        .tokio()
        .block_on(movers.g2_to_g1().move_blocks(&g2_blocks, dst));
    let g1_blocks: Vec<_> = out.into_iter().map(|o| o.expect("onboarded")).collect();
    // Read back from the device and compared.
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

#[test]
fn gpu_worker_over_the_engines_device_caches() {
    if !gpu_or_skip("gpu_worker_over_the_engines_device_caches") {
        return;
    }
    use kvbm_tiering::worker::OffloadingWorker;
    use kvbm_tiering::{
        CanonicalKVCacheRef, CanonicalKVCacheTensor, CanonicalKVCaches, CpuLoadStoreSpec,
        GpuLoadStoreSpec, LoadStoreSpec, PhysicalOffloadingWorker,
    };
    let (blocks, page, tensors) = (32usize, 16384usize, 4usize);
    let engine: Vec<Arc<kvbm_physical::cuda::CudaDeviceMemory>> = (0..tensors)
        .map(|_| Arc::new(kvbm_physical::cuda::CudaDeviceMemory::new(blocks * page, 0).unwrap()))
        .collect();
    let caches = CanonicalKVCaches {
        tensors: engine
            .iter()
            .map(|m| CanonicalKVCacheTensor {
                ptr: m.device_addr() as usize,
                num_blocks: blocks,
                page_size_bytes: page,
            })
            .collect(),
        group_data_refs: vec![
            (0..tensors)
                .map(|t| CanonicalKVCacheRef {
                    tensor_idx: t,
                    page_size_bytes: page,
                    mapping: None,
                })
                .collect(),
        ],
    };
    // The engine writes its blocks (through the driver: the test's stand-in for attention).
    for (t, m) in engine.iter().enumerate() {
        for b in 0..blocks {
            let p = row(t, b, page);
            // SAFETY: inside the allocation; no job runs.
            unsafe { m.copy_h2d(m.device_addr() + (b * page) as u64, p.as_ptr(), page) }.unwrap();
        }
    }
    let tm = Arc::new(TransferManager::new().unwrap());
    let cpu = kvbm_physical::BlockLayout::builder()
        .num_blocks(8)
        .num_layers(tensors)
        .outer_dim(1)
        .page_size(1)
        .inner_dim(page)
        .dtype_bytes(1)
        .layer_separate(kvbm_physical::BlockDim::BlockContiguous)
        .build()
        .unwrap();
    let cpu_h = tm
        .register_layout(PhysicalLayout::allocate_host(cpu, PinPolicy::TryPin).unwrap())
        .unwrap();
    let owner: kvbm_physical::Owner = Arc::new(engine.clone());
    // SAFETY: the allocations live as long as `owner`; the test touches blocks only between
    // jobs.
    let mut w = unsafe {
        PhysicalOffloadingWorker::adopting(
            tm.clone(),
            &caches,
            kvbm_physical::TensorDevice::Cuda(0),
            owner,
            cpu_h,
        )
    }
    .unwrap()
    .build()
    .unwrap();
    let spec = |ids: &[i32]| GpuLoadStoreSpec::new(ids.to_vec(), vec![ids.len()], vec![0]).unwrap();
    let chunks = |ids: &[i32]| {
        LoadStoreSpec::Cpu(CpuLoadStoreSpec {
            chunk_ids: ids.to_vec(),
        })
    };
    let wait = |w: &mut PhysicalOffloadingWorker, job: u64| {
        w.wait(&[job]);
        let done = w.get_finished();
        assert!(done.len() == 1 && done[0].success, "job {job}: {done:?}");
    };
    // Offload GPU blocks 9, 2, 30 to chunks 0..3, then onboard them into blocks 5, 6, 7.
    assert!(w.submit_store(1, &spec(&[9, 2, 30]), &chunks(&[0, 1, 2])));
    wait(&mut w, 1);
    let cpu_l = tm.layout(cpu_h).unwrap();
    for (chunk, b) in [(0, 9), (1, 2), (2, 30)] {
        let want: Vec<u8> = (0..tensors).flat_map(|t| row(t, b, page)).collect();
        assert_eq!(bytes(&cpu_l, chunk), want, "chunk {chunk} (GPU block {b})");
    }
    assert!(w.submit_load(2, &chunks(&[0, 1, 2]), &spec(&[5, 6, 7])));
    wait(&mut w, 2);
    for (t, m) in engine.iter().enumerate() {
        for (b, from) in [(5, 9), (6, 2), (7, 30)] {
            let mut got = vec![0u8; page];
            // SAFETY: inside the allocation; the job finished.
            unsafe { m.copy_d2h(got.as_mut_ptr(), m.device_addr() + (b * page) as u64, page) }
                .unwrap();
            assert_eq!(got, row(t, from, page), "tensor {t} block {b}");
        }
    }
}
