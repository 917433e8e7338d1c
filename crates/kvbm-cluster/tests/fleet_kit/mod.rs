//! Set-up shared by the fleet tier's tests (`tests/fleet.rs`) and its benchmark
//! (`benches/fleet.rs`, which includes this file by path): a fleet's root and credentials, a
//! member (vLLM's region stand-in and its fleet tier over a cluster instance), running one job
//! to its end.

#![allow(dead_code)] // each target uses its own subset

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvbm_cluster::fleet::FleetTier;
use kvbm_cluster::instance::Instance;
use kvbm_cluster::security::{Role, RootKey};
use kvbm_engine::stack::Identities;
use kvbm_engine::{InstanceId, KvbmRuntime};
use kvbm_physical::{LayoutConfig, ModelFingerprint, Parallelism};
use kvbm_tiering::{
    CpuManagerConfig, CpuPrimaryTier, JobResult, OffloadKey, ReqContext, SecondaryTierManager,
    TierJob,
};

/// What a member's chunks mean: `model`'s, in chunks of `chunk` bytes of bfloat16.
pub(crate) fn fingerprint(model: &str, chunk: usize) -> ModelFingerprint {
    ModelFingerprint::builder()
        .model(model)
        .dtype("bfloat16")
        .kv_layout("NHD")
        .geometry(LayoutConfig {
            num_blocks: 1,
            num_layers: 1,
            outer_dim: 1,
            page_size: chunk / 2,
            inner_dim: 1,
            dtype_bytes: 2,
        })
        .parallelism(Parallelism::Canonical)
        .build()
        .unwrap()
}

/// One vLLM instance's side: its region (a `CpuPrimaryTier` with memory) and its fleet tier,
/// which owns the runtime under its instance.
pub(crate) struct Member {
    pub(crate) primary: CpuPrimaryTier,
    pub(crate) tier: FleetTier,
}

/// A fleet's trust root, the directory its credentials are written to, and its NATS server.
pub(crate) struct Fleet {
    pub(crate) root: RootKey,
    dir: tempfile::TempDir,
    nats_url: String,
}

/// The shape of a member: its chunks' bytes and count (region and share alike), and tree keys
/// set over the kit's.
pub(crate) struct Shape<'a> {
    pub(crate) chunk: usize,
    pub(crate) chunks: usize,
    pub(crate) sets: &'a [(&'a str, u64)],
    /// Text keys set over the kit's.
    pub(crate) texts: &'a [(&'a str, &'a str)],
    /// The member's disk (its G3): the file and its chunks.
    pub(crate) disk: Option<(&'a std::path::Path, usize)>,
}

impl Fleet {
    pub(crate) fn new(nats_url: &str) -> Self {
        Self {
            root: RootKey::generate().unwrap(),
            dir: tempfile::tempdir().unwrap(),
            nats_url: nats_url.to_string(),
        }
    }

    /// Instance `id` speaking on `subject` for `model`, its credential issued by the root.
    pub(crate) fn join(&self, id: u64, subject: &str, model: &str, shape: &Shape<'_>) -> Member {
        let id = InstanceId(id);
        let cred = self.dir.path().join(format!("{:x}.cred", id.0));
        if !cred.exists() {
            self.root
                .issue(id, Role::Leader, 0, "ns", Duration::from_secs(3600))
                .unwrap()
                .save(&cred)
                .unwrap();
        }
        let mut b = KvbmRuntime::builder()
            .set("logical.block_size", 16)
            .set("logical.events.max_delay_ms", 1)
            .set("events.idle_tick_ms", 1)
            .set("events.subject", subject)
            .set("tiers.g1_blocks", 1)
            .set("tiers.g2_blocks", shape.chunks)
            .set("transport.nats_url", &self.nats_url)
            .set("security.trust_root", self.root.trust_root().to_hex())
            .set("security.credential_file", cred.display().to_string());
        for (k, v) in shape.sets {
            b = b.set(*k, *v);
        }
        for (k, v) in shape.texts {
            b = b.set(*k, *v);
        }
        if let Some((path, chunks)) = shape.disk {
            b = b
                .set("tiers.g3_blocks", chunks)
                .set("physical.disk.path", path.display().to_string())
                // A temporary directory may be tmpfs, which refuses O_DIRECT.
                .set("physical.disk.direct_io", false);
        }
        let rt = b.build().unwrap();
        let identities = Arc::new(Identities::default());
        let instance = rt
            .handle()
            .tokio()
            .block_on(
                Instance::builder(&rt.handle())
                    .id(id)
                    .geometry(CpuPrimaryTier::block_layout(1, shape.chunk).unwrap())
                    .fingerprint(fingerprint(model, shape.chunk))
                    .identities(identities.clone())
                    .build(),
            )
            .unwrap();
        let primary =
            CpuPrimaryTier::new(CpuManagerConfig::new(shape.chunks), shape.chunk).unwrap();
        let tier = FleetTier::new(Arc::new(instance), identities, &primary, "kvbm_fleet")
            .unwrap()
            .owning(rt);
        Member { primary, tier }
    }
}

impl Member {
    /// Submits `job`, waits for it, and returns its result (the only one reported).
    pub(crate) fn run(&mut self, job: TierJob) -> JobResult {
        let id = job.job_id;
        if job.is_promotion {
            self.tier.submit_load(Arc::new(job));
        } else {
            self.tier.submit_store(Arc::new(job));
        }
        self.tier.drain_jobs().unwrap();
        let mut out = Vec::new();
        self.tier.get_finished_jobs(&mut out);
        assert_eq!(out.len(), 1);
        assert_eq!(out[0].job_id, id);
        out.pop().unwrap()
    }
}

/// A store (or, with `promotion`, a load) of `keys` in the region's `chunks`.
pub(crate) fn job(
    id: u64,
    keys: &[OffloadKey],
    chunks: std::ops::Range<i32>,
    promotion: bool,
) -> TierJob {
    TierJob {
        job_id: id,
        keys: keys.to_vec(),
        chunk_ids: chunks.collect(),
        is_promotion: promotion,
        req_context: ReqContext::new("r"),
        submit_time: Instant::now(),
    }
}
