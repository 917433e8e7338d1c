//! Two kvbm instances as separate processes (`kvbm-engine-instance`), sharing one real
//! `nats-server` and one S3 bucket on the real S3-compatible server, each driven by line
//! commands:
//!
//! * A computes and offloads a prefix to G4; B learns of it from A's events, finds it,
//!   onboards it and verifies the bytes; B pulls a G2-resident prefix from A over the TCP data
//!   plane, bytes verified;
//! * B never serves a block whose checksum or identity fails: damaged frames on A's data
//!   plane, a damaged object and an object of another block in the bucket are refused,
//!   counted, and B recomputes those blocks;
//! * A killed (SIGKILL): B drops A from its peers and index after the heartbeat timeout, no
//!   longer finds A's G2-only blocks, and still serves A's offloaded prefix from G4.
//!
//! Security is on by default, loopback too: each test makes its own trust root and a leader
//! credential per instance (as `kvbm security init` / `issue` would), so every event,
//! heartbeat and data-plane session between A and B is sealed and checked.
//!
//! Needs `cargo xtask services start` (or skips under `KVBM_TEST_SKIP_SERVICES=1`).

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use kvbm_cluster::security::{Role, RootKey};
use kvbm_logical::{Salt, SequenceHash, TokenBlockSequence};
use kvbm_offload::object_key;
use kvbm_physical::{ObjectConfig, ObjectStorage, S3Config};
use kvbm_tests::wait::eventually;
use object_store::ObjectStoreExt;

/// Bytes of one block at the binary's default geometry: 2 layers × 2 × 16 × 32 × 2.
const BLOCK_BYTES: usize = 2 * 2 * 16 * 32 * 2;

/// One instance process; killed (and reaped) on drop.
struct Proc {
    child: Child,
    stdin: Option<ChildStdin>,
    lines: mpsc::Receiver<String>,
    id: String,
    addr: String,
    /// The model fingerprint its G4 paths are scoped by (`fp-<hex>`).
    fingerprint: String,
}

impl Proc {
    fn spawn(id: u64, setup: &Setup) -> Self {
        let Setup {
            nats,
            subject,
            s3,
            namespace,
            ..
        } = setup;
        let credential = setup.credentials.path().join(format!("{id:x}.cred"));
        setup
            .root
            .issue(
                kvbm_engine::InstanceId(id),
                Role::Leader,
                0,
                "kvbm-instances-test",
                Duration::from_secs(3600),
            )
            .unwrap()
            .save(&credential)
            .unwrap();
        let sets = [
            format!("security.trust_root={}", setup.root.trust_root().to_hex()),
            format!("security.credential_file={}", credential.display()),
            format!("transport.nats_url={nats}"),
            format!("events.subject={subject}"),
            "transport.heartbeat_interval_ms=50".into(),
            "transport.heartbeat_timeout_ms=500".into(),
            "transport.request_timeout_ms=2000".into(),
            "logical.block_size=4".into(),
            "logical.events.max_delay_ms=1".into(),
            "events.idle_tick_ms=1".into(),
            "tiers.g1_blocks=32".into(),
            "tiers.g2_blocks=32".into(),
            "tiers.g4_blocks=128".into(),
            format!("physical.s3.endpoint={}", s3.endpoint.clone().unwrap()),
            format!("physical.s3.bucket={}", s3.bucket),
            format!("physical.s3.region={}", s3.region),
            format!("physical.s3.access_key={}", s3.access_key),
            format!("physical.s3.secret_key={}", s3.secret_key),
            format!("physical.object.namespace={namespace}"),
            "offload.g2_to_g4.use_locks=false".into(),
        ];
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_kvbm-engine-instance"));
        cmd.arg("--id").arg(format!("{id:x}"));
        for s in &sets {
            cmd.arg("--set").arg(s);
        }
        let mut child = cmd
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("kvbm-engine-instance starts");
        let stdout = child.stdout.take().unwrap();
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { return };
                if tx.send(line).is_err() {
                    return;
                }
            }
        });
        let stdin = child.stdin.take();
        let ready = lines
            .recv_timeout(Duration::from_secs(30))
            .expect("instance prints its ready line");
        let f = fields(&ready);
        assert!(ready.starts_with("ready "), "{ready}");
        Self {
            id: f["id"].clone(),
            addr: f["addr"].clone(),
            fingerprint: f["fingerprint"].clone(),
            child,
            stdin,
            lines,
        }
    }

    /// Sends one command; its `ok` answer as key/value fields (panics on `err`).
    fn cmd(&mut self, line: &str) -> HashMap<String, String> {
        let stdin = self.stdin.as_mut().expect("process alive");
        writeln!(stdin, "{line}").unwrap();
        stdin.flush().unwrap();
        let answer = self
            .lines
            .recv_timeout(Duration::from_secs(60))
            .unwrap_or_else(|_| panic!("no answer to {line:?}"));
        assert!(answer.starts_with("ok"), "{line:?} -> {answer}");
        fields(&answer)
    }

    fn num(&mut self, line: &str, key: &str) -> usize {
        let f = self.cmd(line);
        f.get(key)
            .unwrap_or_else(|| panic!("{line:?}: no {key} in {f:?}"))
            .parse()
            .unwrap()
    }

    fn kill(&mut self) {
        let _ = self.child.kill(); // SIGKILL
        let _ = self.child.wait();
        self.stdin = None;
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.kill();
    }
}

fn fields(line: &str) -> HashMap<String, String> {
    line.split_whitespace()
        .filter_map(|w| w.split_once('='))
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

struct Setup {
    nats: String,
    subject: String,
    s3: S3Config,
    namespace: String,
    /// This test's trust root, and the directory its instances' credentials are saved in.
    root: RootKey,
    credentials: tempfile::TempDir,
}

fn setup(test: &str) -> Option<Setup> {
    let nats = kvbm_tests::services::nats(test)?;
    let s3 = kvbm_tests::services::s3(test)?;
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    Some(Setup {
        nats: nats.url,
        subject: format!("kvbm.test.{test}.{}.{nanos}", std::process::id()),
        s3: S3Config {
            endpoint: Some(s3.endpoint),
            bucket: s3.bucket,
            region: "us-east-1".into(),
            access_key: s3.access_key,
            secret_key: s3.secret_key,
            allow_http: false,
        },
        namespace: format!("engine-{test}-{}-{nanos}", std::process::id()),
        root: RootKey::generate().unwrap(),
        credentials: tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap(),
    })
}

impl Setup {
    fn two(&self) -> (Proc, Proc) {
        let a = Proc::spawn(0xa, self);
        let b = Proc::spawn(0xb, self);
        (a, b)
    }
}

/// Waits until `b` sees `a` live with its data-plane address.
fn peered(a: &Proc, b: &mut Proc) {
    let want = format!("{}@{}", a.id, a.addr);
    eventually("B sees A's heartbeat", || b.cmd("peers")["live"] == want);
}

/// The binary's prefix `SEED N` (4-token blocks of `SEED*100000..`).
fn prefix(seed: u32, n: usize) -> Vec<SequenceHash> {
    let tokens: Vec<u32> = (0..(n as u32 * 4)).map(|t| seed * 100_000 + t).collect();
    TokenBlockSequence::from_tokens(&tokens, 4, Salt::NONE)
        .unwrap()
        .hashes()
}

#[test]
fn b_onboards_what_a_offloaded_to_g4_and_pulls_a_g2_prefix_over_tcp() {
    let Some(s) = setup("instances_share") else {
        return;
    };
    let (mut a, mut b) = s.two();
    peered(&a, &mut b);
    assert_eq!(a.num("compute 1 8", "computed"), 8);
    assert_eq!(a.num("offload 1 8", "offloaded"), 8);
    assert_eq!(a.num("compute 2 6", "computed"), 6);
    eventually("B's index has both prefixes", || {
        b.cmd("index 1 8")["g4"] == "8" && b.cmd("index 2 6")["g2"] == "6"
    });

    // Prefix 1 from the shared bucket, learnt from A's G4 events.
    let f = b.cmd("fetch 1 8");
    assert_eq!(f["g4"], "8", "{f:?}");
    assert_eq!(f["remote"], "0", "{f:?}");
    assert_eq!(f["refused"], "0", "{f:?}");
    assert_eq!(f["verified_blocks"], "8", "{f:?}");
    assert_eq!(f["verified_bytes"], (8 * BLOCK_BYTES).to_string());
    assert_eq!(f["mismatched"], "0");

    // Prefix 2 only in A's G2: pulled over TCP.
    let f = b.cmd("fetch 2 6");
    assert_eq!(
        (f["remote"].as_str(), f["remote_from"].as_str()),
        ("6", "a"),
        "{f:?}"
    );
    assert_eq!(f["verified_blocks"], "6", "{f:?}");
    assert_eq!(f["verified_bytes"], (6 * BLOCK_BYTES).to_string());
    // (The server counts a frame after its last byte is written: possibly after B read it.)
    eventually("A counted 6 served", || a.num("stats", "served") == 6);
    // Now B's own: a second fetch is local.
    let f = b.cmd("fetch 2 6");
    assert_eq!(
        (f["g2"].as_str(), f["remote"].as_str()),
        ("6", "0"),
        "{f:?}"
    );
    assert_eq!(a.num("stats", "served"), 6);
}

#[test]
fn b_never_serves_a_block_that_fails_its_checksum_or_identity_it_refuses_counts_and_recomputes() {
    let Some(s) = setup("instances_corrupt") else {
        return;
    };
    let (mut a, mut b) = s.two();
    peered(&a, &mut b);

    // Damaged frames on A's data plane: the first pulled block fails its checksum.
    assert_eq!(a.num("compute 3 4", "computed"), 4);
    eventually("B learns prefix 3", || {
        b.cmd("index 3 4")["prefix"] == "a:4"
    });
    a.cmd("corrupt-served 1");
    let f = b.cmd("fetch 3 4");
    assert_eq!(f["remote"], "4", "{f:?}");
    assert_eq!(
        f["refused"], "4",
        "the bad frame fails its block and every later one: {f:?}"
    );
    assert!(f["refused_why"].contains("checksum"), "{f:?}");
    assert_eq!(f["recomputed"], "4", "{f:?}");
    assert_eq!(f["verified_blocks"], "4", "{f:?}");

    // A damaged object in the bucket: refused, counted, recomputed.
    assert_eq!(a.num("compute 4 2", "computed"), 2);
    assert_eq!(a.num("offload 4 2", "offloaded"), 2);
    let hashes = prefix(4, 2);
    // The instances' objects live under their model fingerprint (default `[model]`, rank 0 of
    // 1, the binary's default geometry): this storage reaches them only scoped by it.
    let fingerprint = kvbm_engine::config::KvbmConfig::default()
        .fingerprint(&kvbm_physical::LayoutConfig {
            num_blocks: 1,
            num_layers: 2,
            outer_dim: 2,
            page_size: 16,
            inner_dim: 32,
            dtype_bytes: 2,
        })
        .unwrap();
    assert_eq!(fingerprint.key_segment(), a.fingerprint);
    let storage = ObjectStorage::s3(
        &s.s3,
        ObjectConfig {
            namespace: s.namespace.clone(),
            ..Default::default()
        },
    )
    .unwrap()
    .with_fingerprint(fingerprint);
    let raw = ObjectStorage::s3_client(&s.s3).unwrap();
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let path = storage.path(&object_key(hashes[1]));
        kvbm_tests::faults::flip_last_byte(&*raw, &path, 0xff).await;
    });
    eventually("B learns prefix 4 in G4", || {
        b.cmd("index 4 2")["g4"] == "2"
    });
    let f = b.cmd("fetch 4 2");
    assert_eq!(f["g4"], "2", "{f:?}");
    assert_eq!(f["refused"], "1", "{f:?}");
    assert!(f["refused_why"].contains("checksum"), "{f:?}");
    // Block 0 verified and stayed in B's G2; only the refused block is computed again.
    assert_eq!(f["recomputed"], "1", "{f:?}");
    assert_eq!(f["verified_blocks"], "2", "{f:?}");
    assert_eq!(f["mismatched"], "0", "{f:?}");

    // An object with a valid checksum but another block's identity (block 0's object stored
    // under block 1's key): refused, counted, recomputed.
    assert_eq!(a.num("compute 7 2", "computed"), 2);
    assert_eq!(a.num("offload 7 2", "offloaded"), 2);
    let hashes = prefix(7, 2);
    rt.block_on(async {
        let from = storage.path(&object_key(hashes[0]));
        let to = storage.path(&object_key(hashes[1]));
        let body = raw.get(&from).await.unwrap().bytes().await.unwrap();
        raw.put(&to, body.into()).await.unwrap();
    });
    eventually("B learns prefix 7 in G4", || {
        b.cmd("index 7 2")["g4"] == "2"
    });
    let f = b.cmd("fetch 7 2");
    assert_eq!(f["g4"], "2", "{f:?}");
    assert_eq!(f["refused"], "1", "{f:?}");
    assert!(f["refused_why"].contains("identity"), "{f:?}");
    assert_eq!(f["recomputed"], "1", "{f:?}");
    assert_eq!(f["verified_blocks"], "2", "{f:?}");
    assert_eq!(f["mismatched"], "0", "{f:?}");
    let st = b.cmd("stats");
    assert_eq!(st["refused"], "6", "{st:?}");
    assert_eq!(st["recomputed"], "6", "{st:?}");
}

#[test]
fn a_killed_is_dropped_after_the_heartbeat_timeout_and_b_still_serves_from_g4() {
    let Some(s) = setup("instances_kill") else {
        return;
    };
    let (mut a, mut b) = s.two();
    peered(&a, &mut b);
    assert_eq!(a.num("compute 5 4", "computed"), 4);
    assert_eq!(a.num("offload 5 4", "offloaded"), 4);
    assert_eq!(a.num("compute 6 3", "computed"), 3);
    eventually("B learns both prefixes", || {
        b.cmd("index 5 4")["g4"] == "4" && b.cmd("index 6 3")["g2"] == "3"
    });
    a.kill();
    eventually("B drops A", || {
        b.cmd("peers")["live"].is_empty()
            && b.cmd("index 5 4")["prefix"].is_empty()
            && b.cmd("index 6 3")["prefix"].is_empty()
    });
    assert_eq!(b.num("stats", "expired"), 1);
    // A's G2-only prefix is gone with A: nothing matched, nothing refused.
    let f = b.cmd("fetch 6 3");
    assert_eq!(
        (f["matched"].as_str(), f["refused"].as_str()),
        ("0", "0"),
        "{f:?}"
    );
    // Its offloaded prefix is still in the bucket (found by a presence check).
    let f = b.cmd("fetch 5 4");
    assert_eq!(f["g4"], "4", "{f:?}");
    assert_eq!(f["verified_blocks"], "4", "{f:?}");
    assert_eq!(f["verified_bytes"], (4 * BLOCK_BYTES).to_string());
}
