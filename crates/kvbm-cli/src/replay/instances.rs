//! `kvbm replay --instances N --nats-url URL`: N engine instances as separate processes.
//!
//! ```text
//!  kvbm replay --instances 2 ...            (the parent: assigns nothing itself)
//!     ├─ kvbm replay ... --instance-index 0 --json   ─┐  each: its own G1/G2/G3, one leader,
//!     └─ kvbm replay ... --instance-index 1 --json   ─┤  the shared G4 (S3 or one local object
//!                                                      │  dir), G4 events over one NATS subject
//!  parent: waits for every child, sums their JSON ◄────┘  → one report + cross_instance_hit_blocks
//! ```
//!
//! The parent re-invokes its own binary with a hidden child mode (`--instance-index`): the
//! same flags, plus the instance's index, a NATS subject unique to this run (so concurrent runs
//! on one server never see each other's events), the shared G4 location (a temporary object
//! directory when none was given) and, with `--g3-dir D`, a G3 directory `D/instance-I` per
//! instance. Requests are assigned round-robin by conversation ([`assign`]): every instance
//! reads the whole workload and serves its share. An instance finds the blocks the others
//! wrote to G4 through their events (the engine's `CrossInstanceIndex` over `NatsBus`, adopted
//! by its leader's remote search with a shared G4) and reads them from the shared store with
//! the usual checks; those hits are its `cross_instance_hit_blocks`.

use std::collections::HashMap;
use std::ffi::OsString;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::Instant;

use anyhow::{Context, bail};
use serde_json::{Map, Value, json};

use super::workload::Request;
use crate::config::CliConfig;

/// How `--instances` spreads requests over the instances.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum Assign {
    /// Round-robin by conversation (the default): a conversation's turns stay on one instance,
    /// so an instance meets another's blocks only through shared prefixes.
    #[default]
    Conversation,
    /// Round-robin by request: consecutive turns of a conversation land on different
    /// instances, so each turn's prefix was computed by another instance (the cross-instance
    /// path under the most load).
    Request,
}

/// The instance (0-based) serving each request. [`Assign::Conversation`]: conversations (or,
/// without a conversation id, first block ids) in order of first appearance, round-robin over
/// `count` instances. [`Assign::Request`]: request `i` goes to instance `i % count`.
pub(crate) fn assign(requests: &[Request], count: usize, mode: Assign) -> Vec<usize> {
    let count = count.max(1);
    if mode == Assign::Request {
        return (0..requests.len()).map(|i| i % count).collect();
    }
    let mut slots: HashMap<(bool, u64), usize> = HashMap::new();
    requests
        .iter()
        .map(|r| {
            let next = slots.len();
            *slots.entry(r.assignment_key()).or_insert(next) % count
        })
        .collect()
}

/// Flags the parent sets itself for each child (removed from the forwarded ones), and whether
/// each takes a value.
const OWN_FLAGS: [(&str, bool); 9] = [
    ("--json", false),
    ("--metrics-addr", true),
    ("--instances", true),
    ("--nats-url", true),
    ("--instance-index", true),
    ("--events-subject", true),
    ("--g3-dir", true),
    ("--g4-dir", true),
    ("--g4", false),
];

/// The arguments after the program name, without the parent's own flags.
fn forwarded_args(args: Vec<OsString>) -> Vec<OsString> {
    let mut out = Vec::with_capacity(args.len());
    let mut it = args.into_iter();
    while let Some(a) = it.next() {
        let s = a.to_string_lossy();
        let own = OWN_FLAGS
            .iter()
            .find(|(f, _)| s == *f || (s.starts_with(f) && s[f.len()..].starts_with('=')));
        match own {
            Some((f, true)) if s == *f => {
                it.next();
            }
            Some(_) => {}
            None => out.push(a),
        }
    }
    out
}

/// Member credentials a run makes for itself: secure by default on one host. Without
/// configured credentials (and without `security.insecure`), the parent makes a fresh root and
/// one leader credential per instance in a private temporary directory (0700, each file 0600),
/// hands the children the trust root and the path through `KVBM_SECURITY__*`, and removes the
/// directory when the run ends; the root key never leaves the parent's memory. Every event,
/// heartbeat and ready announcement between the instances is then sealed and checked, so
/// another user or container on the host (or a leaf node of a loopback NATS) cannot speak for
/// them.
struct RunCredentials {
    _dir: tempfile::TempDir,
    trust_root: String,
    /// `<dir>/{instance}.cred` (`SecurityConfig::for_instance` names each child's).
    template: PathBuf,
}

impl RunCredentials {
    fn unless_configured(
        security: &kvbm_engine::config::SecurityConfig,
        count: usize,
    ) -> anyhow::Result<Option<Self>> {
        use kvbm_cluster::security::{Role, RootKey};
        if security.has_credentials() {
            return Ok(None);
        }
        if security.insecure {
            tracing::warn!(
                "SECURITY OFF: security.insecure = true; the {count} instances of this run \
                 accept unsealed events and announcements from anyone on their NATS server"
            );
            return Ok(None);
        }
        let dir = tempfile::Builder::new()
            .prefix("kvbm-run-credentials-")
            .tempdir()
            .context("cannot create the run's credential directory")?;
        let root = RootKey::generate()?;
        for i in 0..count {
            let id = kvbm_engine::InstanceId(i as u64 + 1);
            root.issue(
                id,
                Role::Leader,
                0,
                "kvbm-replay",
                std::time::Duration::from_secs(7 * 86_400),
            )?
            .save(&dir.path().join(format!("{:016x}.cred", id.0)))?;
        }
        Ok(Some(Self {
            trust_root: root.trust_root().to_hex(),
            template: dir.path().join("{instance}.cred"),
            _dir: dir,
        }))
    }
}

/// Runs `count` instances and returns the combined report.
///
/// # Errors
/// A child that cannot start, fails, or prints no report (its stderr was shown).
pub(crate) fn run_parent(cfg: &CliConfig, count: usize, nats_url: &str) -> anyhow::Result<Value> {
    if count == 0 {
        bail!("--instances must be at least 1");
    }
    let wl = super::load_workload(cfg)?;
    let physical = &cfg.engine.physical;
    // One shared G4: the S3 bucket, the given directory, or a temporary one.
    let mut temp_g4 = None;
    let g4_dir: Option<PathBuf> = if physical.s3.is_some() {
        None
    } else if let Some(d) = &physical.object_dir {
        Some(d.clone())
    } else {
        let t = tempfile::Builder::new()
            .prefix("kvbm-g4-shared-")
            .tempdir()
            .context("cannot create the shared G4 directory")?;
        let p = t.path().to_path_buf();
        temp_g4 = Some(t);
        Some(p)
    };
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    let subject = format!(
        "{}.replay.{}.{nanos}",
        cfg.engine.events.subject,
        std::process::id()
    );
    let exe = std::env::current_exe().context("cannot find the kvbm binary to re-invoke")?;
    let base = forwarded_args(std::env::args_os().skip(1).collect());
    let own = RunCredentials::unless_configured(&cfg.engine.security, count)?;

    let start = Instant::now();
    let mut children = Vec::with_capacity(count);
    for i in 0..count {
        let mut cmd = Command::new(&exe);
        cmd.args(&base)
            .arg("--json")
            .arg("--instances")
            .arg(count.to_string())
            .arg("--nats-url")
            .arg(nats_url)
            .arg("--instance-index")
            .arg(i.to_string())
            .arg("--events-subject")
            .arg(&subject);
        cmd.arg("--g4");
        if let Some(d) = &g4_dir {
            cmd.arg("--g4-dir").arg(d);
        }
        // A G3 file the configuration names is the parent's: each instance keeps its own
        // beside it (a scratch G3 is each child's own anyway).
        if cfg.g3_scratch.is_none()
            && let Some(disk) = &physical.disk
            && let Some(dir) = disk.path.parent()
        {
            cmd.arg("--g3-dir").arg(dir.join(format!("instance-{i}")));
        }
        if let Some(c) = &own {
            cmd.env("KVBM_SECURITY__TRUST_ROOT", &c.trust_root)
                .env("KVBM_SECURITY__CREDENTIAL_FILE", &c.template);
        }
        cmd.stdout(Stdio::piped()).stderr(Stdio::inherit());
        let child = cmd
            .spawn()
            .with_context(|| format!("cannot start instance {i}"))?;
        children.push(child);
    }
    let mut reports = Vec::with_capacity(count);
    let mut failure = None;
    for (i, child) in children.into_iter().enumerate() {
        let out = child
            .wait_with_output()
            .with_context(|| format!("instance {i} did not finish"))?;
        if !out.status.success() {
            failure.get_or_insert(format!("instance {i} failed ({})", out.status));
            continue;
        }
        let v: Value = serde_json::from_slice(&out.stdout)
            .with_context(|| format!("instance {i} printed no report"))?;
        reports.push(v);
    }
    if let Some(f) = failure {
        bail!("{f} (its error is above)");
    }
    let wall = start.elapsed().as_secs_f64();
    drop(temp_g4);
    drop(own);
    Ok(combine(
        &reports,
        wl.total_blocks(),
        wl.unique_blocks(),
        wall,
    ))
}

fn add_numbers(into: &mut Map<String, Value>, from: &Map<String, Value>) {
    for (k, v) in from {
        match (into.get_mut(k), v) {
            (Some(Value::Number(a)), Value::Number(b)) => {
                *a = match (a.as_u64(), b.as_u64()) {
                    (Some(x), Some(y)) => (x + y).into(),
                    _ => serde_json::Number::from_f64(
                        a.as_f64().unwrap_or(0.0) + b.as_f64().unwrap_or(0.0),
                    )
                    .unwrap_or_else(|| 0.into()),
                };
            }
            (Some(Value::Object(a)), Value::Object(b)) => add_numbers(a, b),
            (None, _) => {
                into.insert(k.clone(), v.clone());
            }
            _ => {}
        }
    }
}

/// One report from the instances' reports: counters, bytes, per-tier hits, stage times and
/// capacities summed (G4's capacity is the shared store's index: the largest), ratios and
/// throughput recomputed over the whole workload and the parent's wall time.
pub(crate) fn combine(reports: &[Value], total: usize, unique: usize, wall: f64) -> Value {
    let mut out = Map::new();
    for r in reports {
        if let Value::Object(m) = r {
            add_numbers(&mut out, m);
        }
    }
    let g4_cap = reports
        .iter()
        .filter_map(|r| {
            r.pointer("/tiers/g4/capacity_blocks")
                .and_then(Value::as_u64)
        })
        .max()
        .unwrap_or(0);
    if let Some(v) = out
        .get_mut("tiers")
        .and_then(|t| t.pointer_mut("/g4/capacity_blocks"))
    {
        *v = g4_cap.into();
    }
    let hits = out.get("hit_blocks").and_then(Value::as_u64).unwrap_or(0);
    let (total_f, unique_f) = (total as f64, unique as f64);
    let ratio = |x: f64| if total > 0 { x / total_f } else { 0.0 };
    out.insert("blocks".into(), json!(total));
    out.insert("unique_blocks".into(), json!(unique));
    out.insert("hit_ratio".into(), json!(ratio(hits as f64)));
    out.insert("max_hit_ratio".into(), json!(ratio(total_f - unique_f)));
    out.insert("wall_seconds".into(), json!(wall));
    out.insert(
        "blocks_per_second".into(),
        json!(if wall > 0.0 { total_f / wall } else { 0.0 }),
    );
    for k in [
        "eviction_policy",
        "scheduler",
        "block_bytes",
        "workload",
        "storage",
    ] {
        if let Some(v) = reports.first().and_then(|r| r.get(k)) {
            out.insert(k.into(), v.clone());
        }
    }
    out.remove("instance");
    out.insert("instances".into(), json!(reports.len()));
    out.insert("per_instance".into(), Value::Array(reports.to_vec()));
    Value::Object(out)
}

/// A readable summary of a combined report.
pub(crate) fn table(r: &Value) -> String {
    let u = |p: &str| r.pointer(p).and_then(Value::as_u64).unwrap_or(0);
    let f = |p: &str| r.pointer(p).and_then(Value::as_f64).unwrap_or(0.0);
    let mut s = format!(
        "  instances {}   requests {}   blocks {} ({} unique)\n",
        u("/instances"),
        u("/requests"),
        u("/blocks"),
        u("/unique_blocks")
    );
    s += &format!(
        "  hit ratio {:.4}  ({} hit blocks, {} from another instance's G4; {:.4} if every tier held everything)\n",
        f("/hit_ratio"),
        u("/hit_blocks"),
        u("/cross_instance_hit_blocks"),
        f("/max_hit_ratio")
    );
    s += &format!(
        "  wall {:.2} s   {:.0} blocks/s\n",
        f("/wall_seconds"),
        f("/blocks_per_second")
    );
    s += &format!(
        "  hits: g1 {} | g2 {} | g3 {} | g4 {}\n",
        u("/tiers/g1/hit_blocks"),
        u("/tiers/g2/hit_blocks"),
        u("/tiers/g3/hit_blocks"),
        u("/tiers/g4/hit_blocks")
    );
    s += &format!(
        "  onboarded {}  verified {}  corrupt {}  checksum failures {}  failed transfers {}\n",
        u("/onboarded_blocks"),
        u("/verified_blocks"),
        u("/corrupt_blocks"),
        u("/checksum_failures"),
        u("/failed_transfers")
    );
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(conversation: Option<u64>, first: u64) -> Request {
        Request {
            timestamp_ms: 0,
            hash_ids: vec![first, first + 1],
            conversation,
        }
    }

    #[test]
    fn assignment_is_round_robin_by_conversation_then_first_block() {
        let rs = [
            req(Some(7), 0),
            req(Some(9), 0),
            req(Some(7), 5),
            req(Some(3), 0),
            req(None, 100),
            req(None, 100),
            req(None, 200),
        ];
        assert_eq!(
            assign(&rs, 2, Assign::Conversation),
            vec![0, 1, 0, 0, 1, 1, 0]
        );
        assert_eq!(assign(&rs, 2, Assign::Request), vec![0, 1, 0, 1, 0, 1, 0]);
        assert_eq!(assign(&rs, 1, Assign::Conversation), vec![0; 7]);
        assert_eq!(assign(&rs, 1, Assign::Request), vec![0; 7]);
    }

    #[test]
    fn the_parents_own_flags_are_not_forwarded() {
        let args = [
            "replay",
            "--json",
            "--instances",
            "2",
            "--nats-url=nats://x",
            "--g4",
            "--g3-dir",
            "/d",
            "--requests",
            "5",
            "--g4-dir",
            "/g",
        ]
        .map(OsString::from)
        .to_vec();
        assert_eq!(
            forwarded_args(args),
            ["replay", "--requests", "5"].map(OsString::from).to_vec()
        );
    }

    #[test]
    fn reports_combine_into_sums_and_recomputed_ratios() {
        let a = json!({"requests": 2, "hit_blocks": 3, "cross_instance_hit_blocks": 0,
            "tiers": {"g4": {"capacity_blocks": 10, "hit_blocks": 1}},
            "bytes": {"g4_to_g2": 4096}, "stage_seconds": {"lookup": 0.5}, "instance": 0});
        let b = json!({"requests": 1, "hit_blocks": 2, "cross_instance_hit_blocks": 2,
            "tiers": {"g4": {"capacity_blocks": 10, "hit_blocks": 2}},
            "bytes": {"g4_to_g2": 8192}, "stage_seconds": {"lookup": 0.25}, "instance": 1});
        let c = combine(&[a, b], 10, 4, 2.0);
        assert_eq!(c["requests"], 3);
        assert_eq!(c["hit_blocks"], 5);
        assert_eq!(c["cross_instance_hit_blocks"], 2);
        assert_eq!(c["tiers"]["g4"]["capacity_blocks"], 10);
        assert_eq!(c["tiers"]["g4"]["hit_blocks"], 3);
        assert_eq!(c["bytes"]["g4_to_g2"], 12288);
        assert_eq!(c["stage_seconds"]["lookup"], 0.75);
        assert_eq!(c["hit_ratio"], 0.5);
        assert_eq!(c["max_hit_ratio"], 0.6);
        assert_eq!(c["blocks_per_second"], 5.0);
        assert_eq!(c["instances"], 2);
        assert!(c.get("instance").is_none());
    }
}
