//! The tier set's faces for vLLM's manager (`kvbm_engine::stack::secondary_disk` and
//! `secondary_object`, what kvbm-vllm's `kvbm_disk` and `kvbm_object` build their tiers with):
//! tiers under a CPU primary kvbm did not lay out, built from the configuration tree. The disk
//! tier (`[tiers] g3_blocks`, `[physical] disk`) goes through the same checked disk as the tier
//! set's own G3: its chunks restart warm from the journal, bound to the model fingerprint. The
//! object tier (`[tiers] g4_blocks`, `[physical] object_dir` or `s3`, `[physical] object`) opens
//! its store as every G4 of the tier set: a new tier on the same directory finds the objects of
//! its model, not another's. The keys each needs are named when missing.

use std::sync::Arc;

use kvbm_engine::stack::{secondary_disk, secondary_object};
use kvbm_engine::{EngineError, KvbmConfig};
use kvbm_logical::G3;
use kvbm_physical::ObjectConfig;
use kvbm_physical::{DiskConfig, ModelFingerprint, Parallelism, TransferManager};
use kvbm_tiering::{
    CpuManagerConfig, CpuPrimaryTier, LookupResult, OffloadingManager, PhysicalTier, ReqContext,
    TieringOffloadingManager, UpstreamFixes,
};

use kvbm_tiering::testing::{chunk_pattern, key as k, settle, store};

const CHUNK: usize = 8192;

fn pattern(i: u64) -> Vec<u8> {
    chunk_pattern(i, CHUNK)
}

fn fingerprint(model: &str) -> ModelFingerprint {
    ModelFingerprint::builder()
        .model(model)
        .dtype("int8")
        .kv_layout("NHD")
        .parallelism(Parallelism::Canonical)
        .geometry(*CpuPrimaryTier::block_layout(1, CHUNK).unwrap().config())
        .build()
        .unwrap()
}

fn tree(path: &std::path::Path, slots: usize) -> KvbmConfig {
    let mut cfg = KvbmConfig::default();
    cfg.tiers.g3_blocks = slots;
    cfg.physical.disk = Some(DiskConfig::new(path));
    cfg
}

/// A tiering manager over a primary of 2 chunks and the disk tier the tier set builds.
fn manager(cfg: &KvbmConfig, model: &str) -> TieringOffloadingManager {
    let tm = Arc::new(TransferManager::new().unwrap());
    let primary =
        CpuPrimaryTier::with_transfer_manager(CpuManagerConfig::new(2), CHUNK, tm).unwrap();
    let tier = if cfg.tiers.g3_blocks > 0 {
        Box::new(secondary_disk(cfg, &primary, &fingerprint(model)).unwrap())
            as Box<dyn kvbm_tiering::SecondaryTierManager + Send>
    } else {
        Box::new(secondary_object(cfg, &primary, &fingerprint(model)).unwrap())
    };
    TieringOffloadingManager::with_primary(primary, vec![tier], UpstreamFixes::default(), false)
}

#[test]
fn the_disk_tier_vllm_gets_restarts_warm_from_the_tier_sets_journal() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    // The directory does not exist yet: the builder makes it.
    let path = dir.path().join("kvbm_disk").join("g3.bin");
    let cfg = tree(&path, 8);
    {
        let mut m = manager(&cfg, "model-a");
        let c = ReqContext::new("first run");
        m.on_new_request(&c).unwrap();
        store(&mut m, &c, &[0, 1]);
        settle(&mut m);
        store(&mut m, &c, &[2, 3]); // 0 and 1 leave the primary for the disk
        settle(&mut m);
        m.on_request_finished(&c).unwrap();
        m.shutdown().unwrap();
    }
    assert!(
        path.with_extension("journal").exists(),
        "the journal beside the file"
    );

    let mut m = manager(&cfg, "model-a");
    let t = m.tier_mut::<PhysicalTier<G3>>(0).unwrap();
    assert_eq!(
        t.num_restored(),
        4,
        "every chunk written is listed at restart"
    );
    let c = ReqContext::new("second run");
    m.on_new_request(&c).unwrap();
    assert_eq!(
        m.lookup(&k(0), &c),
        LookupResult::HitPending,
        "found on disk"
    );
    settle(&mut m);
    assert_eq!(m.lookup(&k(0), &c), LookupResult::Hit);
    assert_eq!(
        m.primary().chunk(&k(0)).unwrap(),
        pattern(0).as_slice(),
        "with its bytes"
    );
    m.on_request_finished(&c).unwrap();
    m.shutdown().unwrap();

    // Another model on the same file: nothing of model A is served.
    let mut other = manager(&cfg, "model-b");
    let t = other.tier_mut::<PhysicalTier<G3>>(0).unwrap();
    assert_eq!(t.num_restored(), 0, "another fingerprint starts cold");
    other.shutdown().unwrap();
}

#[test]
fn the_keys_a_disk_tier_needs_are_named() {
    let tm = Arc::new(TransferManager::new().unwrap());
    let primary =
        CpuPrimaryTier::with_transfer_manager(CpuManagerConfig::new(2), CHUNK, tm).unwrap();
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let key_of = |cfg: &KvbmConfig| match secondary_disk(cfg, &primary, &fingerprint("m")) {
        Err(EngineError::Config { key, .. }) => key,
        other => panic!("not a configuration error: {:?}", other.map(|_| ())),
    };
    assert_eq!(
        key_of(&tree(&dir.path().join("g3.bin"), 0)),
        "tiers.g3_blocks"
    );
    let mut no_file = tree(&dir.path().join("g3.bin"), 4);
    no_file.physical.disk = None;
    assert_eq!(key_of(&no_file), "physical.disk");
}

#[test]
fn the_object_tier_vllm_gets_opens_its_store_as_the_tier_set_does() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let mut cfg = KvbmConfig::default();
    cfg.tiers.g3_blocks = 0;
    cfg.tiers.g4_blocks = 16;
    cfg.physical.object_dir = Some(dir.path().join("objects"));
    cfg.physical.object = ObjectConfig {
        namespace: "vllm-a".into(),
        ..ObjectConfig::default()
    };
    {
        let mut m = manager(&cfg, "model-a");
        let c = ReqContext::new("writer");
        m.on_new_request(&c).unwrap();
        store(&mut m, &c, &[5, 6]);
        settle(&mut m);
        store(&mut m, &c, &[7, 8]); // 5 and 6 leave the primary for the store
        settle(&mut m);
        m.on_request_finished(&c).unwrap();
        m.shutdown().unwrap();
    }
    // The objects live under the namespace, scoped by the fingerprint.
    let names: Vec<String> = walk(&dir.path().join("objects"));
    assert!(
        names
            .iter()
            .any(|n| n.contains("vllm-a") && n.contains("/fp-")),
        "{names:?}"
    );
    // A new tier of the same model finds the objects (the probe a shared tier adopts them
    // with); another model's tier on the same directory never does.
    let rt = tokio::runtime::Runtime::new().unwrap();
    let present = |model: &str, key: u64| {
        let mut m = manager(&cfg, model);
        let probe = m
            .tier_mut::<PhysicalTier<kvbm_logical::G4>>(0)
            .unwrap()
            .probe()
            .unwrap();
        let found = rt.block_on(probe.present(&k(key))).unwrap();
        m.shutdown().unwrap();
        found
    };
    assert!(present("model-a", 5), "the same model finds its object");
    assert!(!present("model-a", 9), "a key never stored is absent");
    assert!(!present("model-b", 5), "another fingerprint never matches");

    let tm = Arc::new(TransferManager::new().unwrap());
    let primary =
        CpuPrimaryTier::with_transfer_manager(CpuManagerConfig::new(2), CHUNK, tm).unwrap();
    let key_of = |cfg: &KvbmConfig| match secondary_object(cfg, &primary, &fingerprint("m")) {
        Err(EngineError::Config { key, .. }) => key,
        other => panic!("not a configuration error: {:?}", other.map(|_| ())),
    };
    let mut none = cfg.clone();
    none.tiers.g4_blocks = 0;
    assert_eq!(key_of(&none), "tiers.g4_blocks");
    let mut no_store = cfg.clone();
    no_store.physical.object_dir = None;
    assert_eq!(key_of(&no_store), "physical.s3");
}

/// Every file under `dir`, as paths relative to it.
fn walk(dir: &std::path::Path) -> Vec<String> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                stack.push(p);
            } else {
                out.push(p.strip_prefix(dir).unwrap().to_string_lossy().into_owned());
            }
        }
    }
    out
}
