//! The direct disk path end to end on host memory standing in for the device: the manager and
//! the worker as vLLM's connector drives them, real files (O_DIRECT where the filesystem takes
//! it), restarts, corruption and room.

use std::os::unix::fs::FileExt;
use std::path::Path;
use std::sync::Arc;

use kvbm_physical::DiskConfig;

use super::*;
use crate::cpu::CpuManagerConfig;
use crate::key::make_offload_key;
use crate::types::{LookupResult, Medium, ReqContext};

const PAGE: usize = 512;
const REFS: usize = 2;
const BPC: usize = 2;
const CHUNK: usize = PAGE * REFS * BPC;

/// A KV cache in host memory: `REFS` tensors of `blocks` pages each.
struct Kv {
    tensors: Vec<Vec<u8>>,
}

impl Kv {
    fn new(blocks: usize) -> Self {
        Kv {
            tensors: (0..REFS).map(|_| vec![0u8; blocks * PAGE]).collect(),
        }
    }

    fn fill(&mut self, seed: u8) {
        for (d, t) in self.tensors.iter_mut().enumerate() {
            for (i, b) in t.iter_mut().enumerate() {
                *b = seed.wrapping_add((i * 7 + d * 13) as u8);
            }
        }
    }

    fn page(&self, d: usize, block: usize) -> &[u8] {
        &self.tensors[d][block * PAGE..(block + 1) * PAGE]
    }

    /// The pages of `blocks` (one group, first logical block `first`), as vLLM resolves them.
    fn pointers(&mut self, blocks: &[usize], first: usize) -> DevicePointers {
        let mut ptrs = Vec::new();
        for t in &mut self.tensors {
            for &b in blocks {
                ptrs.push(t.as_mut_ptr() as u64 + (b * PAGE) as u64);
            }
        }
        DevicePointers {
            sizes: vec![PAGE as u64; ptrs.len()],
            ptrs,
            group_block_counts: vec![blocks.len()],
            group_data_ref_counts: vec![REFS],
            block_indices: vec![first],
        }
    }
}

fn config(path: &Path, capacity: usize) -> DirectDiskConfig {
    DirectDiskConfig {
        disk: DiskConfig::new(path),
        capacity,
        chunk_bytes: CHUNK,
        fingerprint: None,
    }
}

fn open(path: &Path, capacity: usize) -> (DirectDiskManager, DirectDiskWorker) {
    let disk = DirectDisk::open(config(path, capacity)).unwrap();
    let m =
        DirectDiskManager::new(Arc::clone(&disk), CpuManagerConfig::new(0).events(true)).unwrap();
    let w = DirectDiskWorker::new(disk, BPC).unwrap();
    (m, w)
}

fn key(i: u8) -> OffloadKey {
    make_offload_key(&[i; 16], 0).unwrap()
}

fn ctx(id: &str) -> ReqContext {
    ReqContext::new(id)
}

/// Stores `keys` from the KV cache's `blocks` (BPC blocks per key) as the connector does.
fn store(
    m: &mut DirectDiskManager,
    w: &mut DirectDiskWorker,
    kv: &mut Kv,
    keys: &[OffloadKey],
    blocks: &[usize],
    job: u64,
) -> bool {
    let c = ctx("store");
    let (out, slots) = m.prepare_store(keys, &c).unwrap().expect("room");
    assert_eq!(out.keys_to_store, keys);
    let p = kv.pointers(blocks, 0);
    // SAFETY: `kv` outlives the job, which is waited for below.
    unsafe { w.submit_store(job, &p, &out.keys_to_store, &slots) }.unwrap();
    w.wait(&[job]);
    let r = w.get_finished();
    assert_eq!(r.len(), 1);
    m.complete_store(keys, &c, r[0].success).unwrap();
    r[0].success
}

/// Loads `keys` into the KV cache's `blocks`; whether the job succeeded.
fn load(
    m: &mut DirectDiskManager,
    w: &mut DirectDiskWorker,
    kv: &mut Kv,
    keys: &[OffloadKey],
    blocks: &[usize],
    job: u64,
) -> bool {
    let c = ctx("load");
    for k in keys {
        assert_eq!(m.lookup(k, &c), LookupResult::Hit, "{k}");
    }
    let slots = m.prepare_load(keys, &c).unwrap();
    let p = kv.pointers(blocks, 0);
    // SAFETY: `kv` outlives the job, which is waited for below.
    unsafe { w.submit_load(job, keys, &slots, &p, true) }.unwrap();
    w.wait(&[job]);
    let r = w.get_finished();
    m.complete_load(keys, &c).unwrap();
    r[0].success
}

#[test]
fn stores_and_loads_pages_in_file_order() {
    let dir = tempfile::tempdir().unwrap();
    let (mut m, mut w) = open(&dir.path().join("g3.bin"), 8);
    let mut src = Kv::new(8);
    src.fill(3);
    let keys = [key(1), key(2)];
    assert!(store(&mut m, &mut w, &mut src, &keys, &[4, 5, 6, 7], 1));
    assert_eq!(m.disk().listed(), 2);
    let mut dst = Kv::new(8);
    assert!(load(&mut m, &mut w, &mut dst, &keys, &[0, 1, 2, 3], 2));
    for d in 0..REFS {
        for (s, t) in [(4, 0), (5, 1), (6, 2), (7, 3)] {
            assert_eq!(src.page(d, s), dst.page(d, t), "ref {d} block {s}");
        }
    }
    // The slot holds the pages in vLLM's file order: data ref major, then block.
    let (out, _) = (m.disk().storage().path().to_owned(), ());
    let file = std::fs::File::open(out).unwrap();
    let slot = m.slots().chunk(&keys[1]).unwrap().0 as u64;
    let mut page = vec![0u8; PAGE];
    file.read_exact_at(
        &mut page,
        m.disk().storage().slot_offset(slot as usize) + (BPC * PAGE) as u64,
    )
    .unwrap();
    assert_eq!(
        page,
        src.page(1, 6),
        "ref 1, first block of the second chunk"
    );
    let events = m.take_events();
    assert!(events.iter().all(|e| e.medium == Medium::Storage));
    assert!(events.iter().any(|e| !e.removed && e.keys == keys));
}

#[test]
fn a_chunk_entered_mid_way_is_padded_and_loads_its_pages() {
    let dir = tempfile::tempdir().unwrap();
    let (mut m, mut w) = open(&dir.path().join("g3.bin"), 4);
    let mut src = Kv::new(4);
    src.fill(9);
    let c = ctx("r");
    let k = key(7);
    let (out, slots) = m.prepare_store(&[k], &c).unwrap().unwrap();
    // One block, logical block 1: the second half of the chunk.
    let p = src.pointers(&[2], 1);
    // SAFETY: the KV cache outlives the job (waited for, or never queued).
    unsafe { w.submit_store(1, &p, &out.keys_to_store, &slots) }.unwrap();
    w.wait(&[1]);
    assert!(w.get_finished()[0].success);
    m.complete_store(&[k], &c, true).unwrap();
    let mut dst = Kv::new(4);
    m.lookup(&k, &c);
    let slots = m.prepare_load(&[k], &c).unwrap();
    let p = dst.pointers(&[3], 1);
    // SAFETY: the KV cache outlives the job (waited for, or never queued).
    unsafe { w.submit_load(2, &[k], &slots, &p, false) }.unwrap();
    w.wait(&[2]);
    assert!(w.get_finished()[0].success);
    m.complete_load(&[k], &c).unwrap();
    for d in 0..REFS {
        assert_eq!(src.page(d, 2), dst.page(d, 3));
    }
}

#[test]
fn a_restart_adopts_listed_chunks_on_lookup() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("g3.bin");
    let mut src = Kv::new(8);
    src.fill(5);
    let keys = [key(1), key(2), key(3)];
    {
        let (mut m, mut w) = open(&path, 8);
        assert!(store(
            &mut m,
            &mut w,
            &mut src,
            &keys[..2],
            &[0, 1, 2, 3],
            1
        ));
        // A store handed out and never completed (the process died mid-write): unlisted.
        let (out, slots) = m.prepare_store(&keys[2..], &ctx("x")).unwrap().unwrap();
        assert_eq!((out.keys_to_store.len(), slots.len()), (1, 1));
        w.shutdown().unwrap();
    }
    let (mut m, mut w) = open(&path, 8);
    assert_eq!(m.disk().opened().restored, 2);
    assert_eq!(m.num_restored(), 2);
    m.slots().check_invariants().unwrap();
    assert_eq!(m.lookup(&keys[2], &ctx("a")), LookupResult::Miss);
    let mut dst = Kv::new(8);
    assert!(load(&mut m, &mut w, &mut dst, &keys[..2], &[4, 5, 6, 7], 2));
    assert_eq!(m.num_restored(), 0);
    m.slots().check_invariants().unwrap();
    for d in 0..REFS {
        for (s, t) in [(0, 4), (1, 5), (2, 6), (3, 7)] {
            assert_eq!(src.page(d, s), dst.page(d, t));
        }
    }
}

/// `prepare_store` does no journal work on the scheduler's thread: the slot it hands out keeps
/// its old chunk listed (its bytes intact) until the worker unlists it just before writing it.
/// A restart in between restores the old chunk with its own bytes; after the write, the new one.
#[test]
fn a_victims_slot_stays_listed_until_the_worker_writes_it() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("g3.bin");
    let mut kv = Kv::new(4);
    kv.fill(9);
    {
        let (mut m, mut w) = open(&path, 1);
        assert!(store(&mut m, &mut w, &mut kv, &[key(1)], &[0, 1], 1));
        // key 2 takes key 1's slot (the policy's victim); nothing is submitted.
        let (out, slots) = m.prepare_store(&[key(2)], &ctx("x")).unwrap().unwrap();
        assert_eq!(
            (out.evicted_keys.as_slice(), slots.len()),
            ([key(1)].as_slice(), 1)
        );
        assert_eq!(
            m.disk().listed(),
            1,
            "the victim stays listed: its bytes are intact"
        );
        w.shutdown().unwrap();
    }
    {
        // The process died before the write: key 1 comes back, its bytes its own.
        let (mut m, mut w) = open(&path, 1);
        assert_eq!(m.num_restored(), 1);
        let mut dst = Kv::new(4);
        assert!(load(&mut m, &mut w, &mut dst, &[key(1)], &[2, 3], 2));
        for d in 0..REFS {
            assert_eq!(kv.page(d, 0), dst.page(d, 2));
            assert_eq!(kv.page(d, 1), dst.page(d, 3));
        }
        // This time key 2's store is written: the worker unlists the slot, writes, lists.
        kv.fill(11);
        assert!(store(&mut m, &mut w, &mut kv, &[key(2)], &[0, 1], 3));
        assert_eq!(m.disk().listed(), 1);
        w.shutdown().unwrap();
    }
    let (mut m, mut w) = open(&path, 1);
    assert_eq!(m.num_restored(), 1);
    assert_eq!(m.lookup(&key(1), &ctx("a")), LookupResult::Miss);
    let mut dst = Kv::new(4);
    assert!(load(&mut m, &mut w, &mut dst, &[key(2)], &[2, 3], 4));
    for d in 0..REFS {
        assert_eq!(kv.page(d, 0), dst.page(d, 2));
    }
    m.slots().check_invariants().unwrap();
}

#[test]
fn a_corrupt_slot_fails_its_load_and_is_forgotten() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("g3.bin");
    let (mut m, mut w) = open(&path, 4);
    let mut kv = Kv::new(4);
    kv.fill(1);
    let k = key(4);
    assert!(store(&mut m, &mut w, &mut kv, &[k], &[0, 1], 1));
    let slot = m.slots().chunk(&k).unwrap().0 as usize;
    let at = m.disk().storage().slot_offset(slot) + 100;
    let f = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
    f.write_all_at(&[0xEE], at).unwrap();
    f.sync_all().unwrap();
    let mut dst = Kv::new(4);
    assert!(!load(&mut m, &mut w, &mut dst, &[k], &[2, 3], 2));
    assert_eq!(m.lookup(&k, &ctx("again")), LookupResult::Miss);
    assert_eq!(m.disk().listed(), 0, "unlisted");
    m.slots().check_invariants().unwrap();
}

#[test]
fn room_comes_from_restored_chunks_first_then_the_policy() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("g3.bin");
    let mut kv = Kv::new(4);
    kv.fill(2);
    {
        let (mut m, mut w) = open(&path, 3);
        for i in 0..3u8 {
            assert!(store(
                &mut m,
                &mut w,
                &mut kv,
                &[key(10 + i)],
                &[0, 1],
                i as u64
            ));
        }
    }
    let (mut m, mut w) = open(&path, 3);
    assert_eq!(m.num_restored(), 3);
    // Adopt one; two more stores take the two restored slots nobody asked for.
    assert_eq!(m.lookup(&key(10), &ctx("a")), LookupResult::Hit);
    assert!(store(&mut m, &mut w, &mut kv, &[key(20)], &[0, 1], 10));
    assert!(store(&mut m, &mut w, &mut kv, &[key(21)], &[2, 3], 11));
    assert_eq!(m.num_restored(), 0);
    assert_eq!(m.lookup(&key(11), &ctx("b")), LookupResult::Miss);
    assert_eq!(m.lookup(&key(10), &ctx("b")), LookupResult::Hit);
    // Full: the next store evicts the policy's victim.
    assert!(store(&mut m, &mut w, &mut kv, &[key(22)], &[0, 1], 12));
    assert_eq!(m.slots().len(), 3);
    assert_eq!(m.disk().listed(), 3);
    m.slots().check_invariants().unwrap();
}

#[test]
fn a_failed_store_is_unlisted_and_another_model_starts_cold() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("g3.bin");
    let mut kv = Kv::new(4);
    {
        let (mut m, mut w) = open(&path, 4);
        assert!(store(&mut m, &mut w, &mut kv, &[key(1)], &[0, 1], 1));
        // The worker wrote and listed it; the connector reports the job failed.
        let c = ctx("f");
        let (out, slots) = m.prepare_store(&[key(2)], &c).unwrap().unwrap();
        let p = kv.pointers(&[2, 3], 0);
        // SAFETY: the KV cache outlives the job (waited for, or never queued).
        unsafe { w.submit_store(2, &p, &out.keys_to_store, &slots) }.unwrap();
        w.wait(&[2]);
        assert!(w.get_finished()[0].success);
        m.complete_store(&[key(2)], &c, false).unwrap();
        assert_eq!(m.disk().listed(), 1);
    }
    let (m, _w) = open(&path, 4);
    assert_eq!(m.num_restored(), 1);
    drop((m, _w));
    let mut other = config(&path, 4);
    other.fingerprint = Some(
        kvbm_physical::ModelFingerprint::builder()
            .model("another/model")
            .dtype("int8")
            .kv_layout("NHD")
            .geometry(kvbm_physical::LayoutConfig {
                num_blocks: 1,
                num_layers: REFS,
                outer_dim: 1,
                page_size: BPC,
                inner_dim: PAGE,
                dtype_bytes: 1,
            })
            .parallelism(kvbm_physical::Parallelism::Canonical)
            .build()
            .unwrap(),
    );
    let disk = DirectDisk::open(other).unwrap();
    assert_eq!(disk.opened().restored, 0);
    assert!(disk.opened().reset.is_some());
}

#[test]
fn pointers_that_disagree_with_the_spec_are_refused_with_nothing_queued() {
    let dir = tempfile::tempdir().unwrap();
    let (mut m, mut w) = open(&dir.path().join("g3.bin"), 4);
    let mut kv = Kv::new(4);
    let (out, slots) = m.prepare_store(&[key(1)], &ctx("r")).unwrap().unwrap();
    // Two chunks of pages for one key.
    let p = kv.pointers(&[0, 1, 2, 3], 0);
    // SAFETY: the KV cache outlives the job (waited for, or never queued).
    let e = unsafe { w.submit_store(1, &p, &out.keys_to_store, &slots) }.unwrap_err();
    assert!(e.to_string().contains("2 chunks"), "{e}");
    // Pages larger than a chunk holds.
    let mut p = kv.pointers(&[0, 1], 0);
    p.sizes[0] = (CHUNK * 2) as u64;
    // SAFETY: the KV cache outlives the job (waited for, or never queued).
    assert!(unsafe { w.submit_store(1, &p, &out.keys_to_store, &slots) }.is_err());
    assert_eq!(w.num_pending(), 0);
    // The job id is free again: a good submission takes it.
    let p = kv.pointers(&[0, 1], 0);
    // SAFETY: the KV cache outlives the job (waited for, or never queued).
    unsafe { w.submit_store(1, &p, &out.keys_to_store, &slots) }.unwrap();
    w.wait(&[1]);
    assert!(w.get_finished()[0].success);
}

#[test]
fn one_process_shares_one_disk_by_path_and_refuses_another_geometry() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("g3.bin");
    let a = DirectDisk::shared(config(&path, 4)).unwrap();
    let b = DirectDisk::shared(config(&path, 4)).unwrap();
    assert!(Arc::ptr_eq(&a, &b));
    let e = DirectDisk::shared(config(&path, 8)).unwrap_err();
    assert!(e.to_string().contains("4 chunks"), "{e}");
    drop((a, b));
    // Gone when nobody holds it: reopened with another capacity.
    DirectDisk::shared(config(&path, 8)).unwrap();
}

mod model {
    //! Random sequences of stores (some reported failed), loads and restarts against a model of
    //! what was stored: the slot table's invariants hold after every call, a key never stored
    //! is never a hit, and every hit loads the bytes last stored under its key.

    use std::collections::HashMap;

    use proptest::prelude::*;

    use super::*;

    #[derive(Clone, Debug)]
    enum Op {
        Store(Vec<u8>, bool),
        Load(u8),
        Restart,
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            4 => (prop::collection::hash_set(0u8..12, 1..4), prop::bool::weighted(0.8))
                .prop_map(|(k, ok)| Op::Store(k.into_iter().collect(), ok)),
            4 => (0u8..14).prop_map(Op::Load),
            1 => Just(Op::Restart),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]
        #[test]
        fn hits_load_the_bytes_last_stored(ops in prop::collection::vec(op(), 1..40)) {
            let dir = tempfile::tempdir().unwrap();
            let path = dir.path().join("g3.bin");
            let (mut m, mut w) = open(&path, 5);
            let mut kv = Kv::new(2 * BPC * 4);
            // key -> the fill seed of the bytes stored under it
            let mut model: HashMap<u8, u8> = HashMap::new();
            let mut job = 0u64;
            for (n, op) in ops.into_iter().enumerate() {
                let seed = n as u8;
                match op {
                    Op::Store(ids, ok) => {
                        let keys: Vec<OffloadKey> = ids.iter().map(|&i| key(i)).collect();
                        let c = ctx("s");
                        let Some((out, slots)) = m.prepare_store(&keys, &c).unwrap() else {
                            continue;
                        };
                        for e in &out.evicted_keys {
                            model.retain(|&i, _| key(i) != *e);
                        }
                        kv.fill(seed);
                        let blocks: Vec<usize> = (0..out.keys_to_store.len() * BPC).collect();
                        job += 1;
                        if !out.keys_to_store.is_empty() {
                            let p = kv.pointers(&blocks, 0);
                            // SAFETY: `kv` outlives the job, waited for just below.
                            unsafe { w.submit_store(job, &p, &out.keys_to_store, &slots) }
                                .unwrap();
                            w.wait(&[job]);
                            let r = w.get_finished();
                            prop_assert!(r[0].success);
                        }
                        m.complete_store(&out.keys_to_store, &c, ok).unwrap();
                        if ok {
                            for (j, k) in out.keys_to_store.iter().enumerate() {
                                let i = ids.iter().copied().find(|&i| key(i) == *k).unwrap();
                                // The chunk's bytes: blocks j*BPC.. of this fill.
                                model.insert(i, seed.wrapping_add((j * BPC * PAGE * 7) as u8));
                            }
                        }
                    }
                    Op::Load(i) => {
                        let k = key(i);
                        let c = ctx("l");
                        if m.lookup(&k, &c) != LookupResult::Hit {
                            continue;
                        }
                        prop_assert!(model.contains_key(&i), "key {} was never stored", i);
                        let slots = m.prepare_load(&[k], &c).unwrap();
                        let mut dst = Kv::new(BPC);
                        let p = dst.pointers(&(0..BPC).collect::<Vec<_>>(), 0);
                        job += 1;
                        // SAFETY: `dst` outlives the job, waited for just below.
                        unsafe { w.submit_load(job, &[k], &slots, &p, false) }.unwrap();
                        w.wait(&[job]);
                        prop_assert!(w.get_finished()[0].success);
                        m.complete_load(&[k], &c).unwrap();
                        let mut want = Kv::new(BPC);
                        want.fill(model[&i]);
                        prop_assert_eq!(&dst.tensors, &want.tensors, "key {}", i);
                    }
                    Op::Restart => {
                        drop((m, w));
                        (m, w) = open(&path, 5);
                    }
                }
                m.slots().check_invariants().map_err(TestCaseError::fail)?;
            }
        }
    }
}
