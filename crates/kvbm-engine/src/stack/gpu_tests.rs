//! GPU tests of the engine (feature `cuda`, run by `cargo xtask gpu-check`, which bundles this
//! binary beside kvbm-physical's): a tier set with `physical.g1 = "device"` onboarding through
//! the copy engine (`tests`' body over real GPU memory), and kvbm-tiering's worker over an
//! engine's device caches (what vLLM's `get_worker(kv_caches)` hands over). Each skips, saying why, without a GPU (fails instead
//! under `KVBM_REQUIRE_GPU`).

use std::sync::Arc;

use kvbm_physical::testing::{bytes, gpu_or_skip, pattern};
use kvbm_physical::{DeviceMemory, PhysicalLayout, PinPolicy, TransferManager};

/// Row `b` of the engine's tensor `t`: `testing`'s pattern, seeded by the tensor.
fn row(t: usize, b: usize, page: usize) -> Vec<u8> {
    (0..page).map(|k| pattern(t as u8, b, k)).collect()
}

#[test]
fn gpu_tier_set_with_g1_on_the_device_onboards_through_the_copy_engine() {
    if !gpu_or_skip("gpu_tier_set_with_g1_on_the_device_onboards_through_the_copy_engine") {
        return;
    }
    super::tests::g1_on_a_device_onboards_through_the_transfer_manager(
        PhysicalLayout::allocate_gpu,
    );
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
