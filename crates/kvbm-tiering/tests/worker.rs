//! The worker half moves real bytes between a GPU-side layout (host stand-in without CUDA) and
//! the primary tier's pinned slots, driven by what the scheduler half handed out.

use std::sync::Arc;

use kvbm_physical::{PhysicalLayout, PinPolicy, TransferManager};
use kvbm_tiering::*;

const CHUNK: usize = 4096;

#[test]
fn store_then_load_round_trip_through_the_primary() {
    let tm = Arc::new(TransferManager::new().unwrap());
    let mut primary =
        CpuPrimaryTier::with_transfer_manager(CpuManagerConfig::new(8), CHUNK, tm.clone()).unwrap();
    let gpu_layout = CpuPrimaryTier::block_layout(4, CHUNK).unwrap();
    let gpu = tm
        .register_layout(PhysicalLayout::allocate_host(gpu_layout, PinPolicy::TryPin).unwrap())
        .unwrap();
    let gpu_mem = tm.layout(gpu).unwrap();
    let fill = |block: usize, v: u8| {
        let (addr, len) = gpu_mem.block_addrs(block, 0..1)[0];
        // SAFETY: the block is `len` bytes of the registered host layout; no transfer runs.
        unsafe { std::ptr::write_bytes(addr as *mut u8, v, len) };
    };
    let read = |block: usize| -> Vec<u8> {
        let (addr, len) = gpu_mem.block_addrs(block, 0..1)[0];
        // SAFETY: as above.
        unsafe { std::slice::from_raw_parts(addr as *const u8, len).to_vec() }
    };
    fill(0, 0x11);
    fill(1, 0x22);
    let (_, cpu) = primary.transfer().unwrap();
    let mut w = PhysicalOffloadingWorker::new(tm.clone(), gpu, cpu, CHUNK).unwrap();

    // scheduler: store two chunks; worker: GPU blocks 0,1 -> the CPU slots handed out
    let c = ReqContext::new("r");
    let keys = [OffloadKey::from_u64(1), OffloadKey::from_u64(2)];
    let m = primary.manager_mut();
    m.on_new_request(&c).unwrap();
    let out = m.prepare_store(&keys, &c).unwrap().unwrap();
    let src = GpuLoadStoreSpec::new(vec![0, 1], vec![2], vec![0]).unwrap();
    assert!(w.submit_store(7, &src, &out.store_spec));
    w.wait(&[7]);
    let done = w.get_finished();
    assert_eq!(done.len(), 1);
    assert!(done[0].success && done[0].job_id == 7);
    assert_eq!(done[0].transfer_size, Some(2 * CHUNK as u64));
    primary
        .manager_mut()
        .complete_store(&keys, &c, true)
        .unwrap();
    assert!(primary.chunk(&keys[0]).unwrap().iter().all(|&b| b == 0x11));
    assert!(primary.chunk(&keys[1]).unwrap().iter().all(|&b| b == 0x22));

    // load them back into GPU blocks 3, 2
    let spec = primary.manager_mut().prepare_load(&keys, &c).unwrap();
    let dst = GpuLoadStoreSpec::new(vec![3, 2], vec![2], vec![0]).unwrap();
    assert!(w.submit_load(8, &spec, &dst));
    let mut got = Vec::new();
    while got.is_empty() {
        got = w.get_finished();
    }
    assert!(got[0].success);
    primary.manager_mut().complete_load(&keys, &c).unwrap();
    assert!(read(3).iter().all(|&b| b == 0x11));
    assert!(read(2).iter().all(|&b| b == 0x22));

    // mismatched specs never start
    let bad = GpuLoadStoreSpec::new(vec![0], vec![1], vec![0]).unwrap();
    assert!(!w.submit_load(9, &spec, &bad));
    assert!(GpuLoadStoreSpec::new(vec![0, 1], vec![1], vec![0]).is_err());
    w.shutdown();
}
