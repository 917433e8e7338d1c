//! The worker-process harness shared by the tests that run `kvbm-engine-worker` processes over a
//! real `nats-server` (`nats_workers.rs`, `onboarding_layerwise_nats.rs`): spawning a worker
//! (killed and reaped on drop), connecting a leader to two of them, and a prefix staged on
//! their disks whose original bytes every rank knows by digest.
#![allow(dead_code)]

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::mpsc;
use std::time::Duration;

use kvbm_cluster::security::{Credential, Role, RootKey, Security, SecurityConfig};
use kvbm_cluster::transport::control::{
    ControlRequest, ControlResponse, ControlledWorkers, WorkerControl, block_digest, fill_pattern,
};
use kvbm_cluster::transport::nats::{DEFAULT_CONTROL_PREFIX, NatsControl, connect};
use kvbm_engine::InstanceId;
use kvbm_engine::WorkerAddress;
use kvbm_engine::worker::{ParallelWorkers, SpmdMover};
use kvbm_logical::{
    BlockManager, BlockRegistry, G1, G2, G3, ImmutableBlock, Salt, SequenceHash, TierId,
    TokenBlockSequence,
};
use kvbm_physical::{PhysicalLayout, PinPolicy};

use crate::common::{N, geometry, manager};

pub(crate) const SEED: u8 = 0x40;

/// A leader's NATS client at `url` and its membership view of `instance`'s ranks (heartbeat
/// timeout 3 s, security off), followed until the returned token is cancelled.
pub(crate) async fn follow_ranks(
    url: &str,
    instance: InstanceId,
) -> (
    async_nats::Client,
    kvbm_cluster::transport::membership::Membership,
    tokio_util::sync::CancellationToken,
) {
    let client = connect(url, "leader", Duration::from_millis(100))
        .await
        .unwrap();
    let cancel = tokio_util::sync::CancellationToken::new();
    let members = kvbm_cluster::transport::membership::Membership::follow(
        &client,
        DEFAULT_CONTROL_PREFIX,
        instance,
        Duration::from_secs(3),
        Arc::new(Security::Off),
        cancel.clone(),
    )
    .await
    .unwrap();
    (client, members, cancel)
}

/// One worker process; killed (and reaped) on drop.
pub(crate) struct WorkerProcess {
    child: Child,
    pub lines: mpsc::Receiver<String>,
}

impl WorkerProcess {
    pub(crate) fn spawn(
        url: &str,
        instance: InstanceId,
        rank: u32,
        dir: &std::path::Path,
        extra: &[&str],
    ) -> Self {
        Self::spawn_with_env(url, instance, rank, dir, extra, &[])
    }

    /// As [`spawn`](Self::spawn), with `env` set for the process (e.g. `KVBM_CONFIG_PATH`).
    pub(crate) fn spawn_with_env(
        url: &str,
        instance: InstanceId,
        rank: u32,
        dir: &std::path::Path,
        extra: &[&str],
        env: &[(&str, &std::ffi::OsStr)],
    ) -> Self {
        // Security is on by default, loopback too: a rank without a credential (and no
        // configuration file to say otherwise) runs with security explicitly off.
        let explicit =
            extra.contains(&"--credential") || env.iter().any(|(k, _)| *k == "KVBM_CONFIG_PATH");
        let mut child = Command::new(env!("CARGO_BIN_EXE_kvbm-engine-worker"))
            .envs(env.iter().copied())
            .args(if explicit {
                &[][..]
            } else {
                &["--insecure"][..]
            })
            .args(["--nats", url, "--instance", &instance.0.to_string()])
            .args(["--rank", &rank.to_string(), "--blocks", &N.to_string()])
            .args(["--inner-dim", "64", "--announce"])
            .args(["--fill-seed", &(SEED + rank as u8).to_string()])
            .arg("--g3-file")
            .arg(dir.join(format!("rank{rank}.bin")))
            .args(extra)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawn kvbm-engine-worker");
        let out = BufReader::new(child.stdout.take().unwrap());
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in out.lines().map_while(Result::ok) {
                if tx.send(line).is_err() {
                    return;
                }
            }
        });
        let w = Self { child, lines };
        w.expect_line("ready ");
        w
    }

    /// Waits for a line starting with `prefix` (skipping others).
    pub(crate) fn expect_line(&self, prefix: &str) -> String {
        loop {
            match self.lines.recv_timeout(Duration::from_secs(30)) {
                Ok(l) if l.starts_with(prefix) => return l,
                Ok(_) => continue,
                Err(e) => panic!("worker: no `{prefix}` line: {e}"),
            }
        }
    }

    pub(crate) fn kill(&mut self) {
        let _ = self.child.kill(); // SIGKILL
        let _ = self.child.wait();
    }
}

impl Drop for WorkerProcess {
    fn drop(&mut self) {
        self.kill();
    }
}

pub(crate) struct Instance {
    pub workers: Arc<ControlledWorkers>,
    pub controls: Vec<Arc<dyn WorkerControl>>,
    pub g1: Arc<BlockManager<G1>>,
    pub g2: Arc<BlockManager<G2>>,
    pub g3: Arc<BlockManager<G3>>,
    pub hashes: Vec<kvbm_logical::SequenceHash>,
    /// Per rank, per prefix block: the digest of its original bytes.
    pub expected: Vec<Vec<u64>>,
}

pub(crate) async fn digests(c: &dyn WorkerControl, tier: TierId, blocks: Vec<usize>) -> Vec<u64> {
    match c
        .call(ControlRequest::Digest { tier, blocks })
        .await
        .unwrap()
    {
        ControlResponse::Digests(d) => d,
        other => panic!("{other:?}"),
    }
}

/// Connects to both workers, computes 6 blocks in G2 on both ranks, offloads them to G3
/// through the workers, evicts them from G2 and overwrites every rank's G2 memory, so what
/// reaches G1 later can only come from the disks.
pub(crate) async fn set_up(url: &str, instance: InstanceId, timeout: Duration) -> Instance {
    set_up_secured(url, instance, timeout, Arc::new(Security::Off)).await
}

/// As [`set_up`], the leader sealing its requests with `security` (its leader credential).
pub(crate) async fn set_up_secured(
    url: &str,
    instance: InstanceId,
    timeout: Duration,
    security: Arc<Security>,
) -> Instance {
    let client = connect(url, "leader", Duration::from_millis(100))
        .await
        .unwrap();
    let controls = nats_controls(&client, instance, timeout, |c| {
        c.with_security(security.clone())
    });
    let workers = Arc::new(ControlledWorkers::new(controls.clone()).unwrap());
    let peers = workers.describe_all().await.unwrap();
    assert_eq!(peers.len(), 2);
    for (r, p) in peers.iter().enumerate() {
        assert_eq!(p.worker, WorkerAddress::new(instance, r as u32));
        assert_eq!(p.tiers, vec![TierId::G1, TierId::G2, TierId::G3]);
        assert_eq!(p.num_blocks, N);
    }

    let registry = BlockRegistry::new();
    let (g2, g3) = (manager::<G2>(&registry), manager::<G3>(&registry));
    let g1 = manager::<G1>(&BlockRegistry::new());
    let (on_g2, hashes) = compute_prefix(&g2);
    let ids: Vec<usize> = on_g2.iter().map(|b| b.block_id()).collect();

    // What each rank's G2 holds, by the worker's digest and by one computed here from the
    // same pattern: they must agree, and the ranks must differ.
    let expected = pattern_digests(&ids);
    for (r, c) in controls.iter().enumerate() {
        let d = digests(c.as_ref(), TierId::G2, ids.clone()).await;
        assert_eq!(
            d, expected[r],
            "rank {r}: the worker's bytes are the pattern"
        );
    }
    assert_ne!(expected[0], expected[1]);

    let pw: Arc<dyn ParallelWorkers> = workers.clone();
    // SAFETY: the test's ranks have layouts of this manager's blocks; nothing else writes them.
    let down = unsafe { SpmdMover::<G2, G3>::new(pw, g3.clone()) };
    let out = down.move_from(&on_g2, g3.allocate_blocks(6).unwrap()).await;
    assert!(out.iter().all(Result::is_ok), "{out:?}");
    drop((out, on_g2));
    assert_eq!(g2.reset_inactive_pool(), 6);
    for c in &controls {
        let r = c
            .call(ControlRequest::Fill {
                tier: TierId::G2,
                seed: 0xEE,
            })
            .await
            .unwrap();
        assert_eq!(r, ControlResponse::Done);
    }
    Instance {
        workers,
        controls,
        g1,
        g2,
        g3,
        hashes,
        expected,
    }
}

/// The leader's controls of ranks 0 and 1 of `instance` over `client` (default prefix, each
/// request timing out after `timeout`), each finished by `with`.
pub(crate) fn nats_controls(
    client: &async_nats::Client,
    instance: InstanceId,
    timeout: Duration,
    with: impl Fn(NatsControl) -> NatsControl,
) -> Vec<Arc<dyn WorkerControl>> {
    (0..2)
        .map(|r| {
            let c = NatsControl::new(
                client.clone(),
                DEFAULT_CONTROL_PREFIX,
                WorkerAddress::new(instance, r),
                timeout,
            );
            Arc::new(with(c)) as Arc<dyn WorkerControl>
        })
        .collect()
}

/// Six blocks of one fixed prefix computed in `g2` (registered and held): their handles and
/// the prefix's hashes. The workers' G2 holds their fill pattern there.
pub(crate) fn compute_prefix(
    g2: &BlockManager<G2>,
) -> (Vec<ImmutableBlock<G2>>, Vec<SequenceHash>) {
    let seq =
        TokenBlockSequence::from_tokens(&(0..24).collect::<Vec<u32>>(), 4, Salt::NONE).unwrap();
    let complete = g2
        .allocate_blocks(6)
        .unwrap()
        .into_iter()
        .zip(seq.blocks())
        .map(|(b, tb)| b.complete_token_block(tb).unwrap())
        .collect();
    (g2.register_blocks(complete), seq.hashes())
}

/// Per rank (0 and 1), the digests of blocks `ids` of the rank's fill pattern, computed here
/// from the same pattern the worker process filled its G2 with.
pub(crate) fn pattern_digests(ids: &[usize]) -> Vec<Vec<u64>> {
    (0..2u8)
        .map(|r| {
            let local = PhysicalLayout::allocate_host(geometry(), PinPolicy::Unpinned).unwrap();
            // SAFETY: `local` is this test's own layout; nothing else uses it.
            let filled = unsafe { fill_pattern(&local, SEED + r) };
            assert!(filled, "host memory");
            ids.iter()
                // SAFETY: as above.
                .map(|&b| unsafe { block_digest(&local, b) }.unwrap())
                .collect()
        })
        .collect()
}

pub(crate) fn instance_id(tag: u64) -> InstanceId {
    InstanceId((u64::from(std::process::id()) << 8) | tag)
}

/// A trust root and its credentials, each written to a file (mode 0600) as an operator's
/// `kvbm security issue` would.
pub(crate) struct Members {
    pub root: RootKey,
    pub dir: tempfile::TempDir,
}

impl Members {
    pub(crate) fn new() -> Self {
        Self {
            root: RootKey::generate().unwrap(),
            dir: tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap(),
        }
    }

    /// The trust root's hex (`security.trust_root`).
    pub(crate) fn trust_root(&self) -> String {
        self.root.trust_root().to_hex()
    }

    /// A credential for `role` of `instance` at `rank`, saved; its path.
    pub(crate) fn save(&self, instance: InstanceId, role: Role, rank: u32) -> std::path::PathBuf {
        let cred = self.issue(instance, role, rank);
        let path = self
            .dir
            .path()
            .join(format!("{:x}-{role}-{rank}.cred", instance.0));
        cred.save(&path).unwrap();
        path
    }

    pub(crate) fn issue(&self, instance: InstanceId, role: Role, rank: u32) -> Credential {
        self.root
            .issue(instance, role, rank, "ns", Duration::from_secs(3600))
            .unwrap()
    }

    /// Security for `role` of `instance` at `rank`, loaded from its saved file.
    pub(crate) fn security(&self, instance: InstanceId, role: Role, rank: u32) -> Arc<Security> {
        let config = SecurityConfig {
            trust_root: Some(self.trust_root()),
            credential_file: Some(self.save(instance, role, rank)),
            ..SecurityConfig::default()
        };
        Arc::new(Security::from_config(&config).unwrap())
    }

    /// The worker flags for rank `rank` of `instance`.
    pub(crate) fn worker_flags(&self, instance: InstanceId, rank: u32) -> Vec<String> {
        vec![
            "--trust-root".into(),
            self.trust_root(),
            "--credential".into(),
            self.save(instance, Role::Worker, rank)
                .display()
                .to_string(),
        ]
    }
}
