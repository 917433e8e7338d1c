//! The command's configuration: kvbm-engine's one tree ([`KvbmConfig`]: every crate's section
//! and the engine's own) plus this crate's `[replay]` section (the workload and how it is
//! driven), merged by figment from (lowest first) the code's defaults, a `--config FILE`
//! (TOML), `KVBM_<SECTION>__<KEY>` environment variables, the standard AWS credential
//! variables, and command-line flags.
//!
//! There is one source of truth: what the tier stack is built from lives in the engine's keys
//! and nowhere else. The flags write those keys:
//!
//! ```text
//!  --g1-blocks / --g2-blocks / --g3-blocks   tiers.g1_blocks / g2_blocks / g3_blocks
//!  --block-bytes                             tiers.block_bytes
//!  --g3-dir DIR                              physical.disk.path = DIR/g3.bin
//!  --g4-dir DIR                              physical.object_dir
//!  --s3-endpoint / --s3-bucket               physical.s3.endpoint / bucket
//!  AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY physical.s3.access_key / secret_key (with S3 only)
//!  --eviction                                logical.eviction
//! ```
//!
//! `[replay]` holds only what is the replay's own: the workload (`trace`, `seed`, `requests`),
//! its pace (`time_scale`), read-ahead distance, the front end (`scheduler`), and `g4`, which
//! turns G4 on sized to the workload. The engine's sections are parsed and validated by
//! `KvbmConfig`'s rules ([`KvbmConfig::validate`]), so `config/kvbm.toml`, which documents the
//! whole tree, is a valid `--config` file. Every section refuses unknown keys, so a misspelt key
//! is an error naming it and where it came from. `kvbm config show` prints every value with the
//! provider that set it; secrets are redacted.
//!
//! The replay's defaults differ from the engine's in a few keys (tier sizes for a 20 000-request
//! workload; one replay process is the only writer of its G4 namespace, so no cross-worker
//! locks; small blocks make G2→G3 per-request bound, so several batches in flight, of up to 256
//! blocks; G3 queue depth 128; a G1→G2 batch or store waits up to 30 s for G2 room rather than
//! lose its blocks): they are the lowest layer, named `default`, so a file or a
//! variable still overrides them. A G3 the configuration gives no file gets one in a scratch
//! directory, removed at exit (layer `default (scratch)`).

use std::path::{Path, PathBuf};

use anyhow::{Context, bail};
use figment::providers::{Env, Format, Serialized, Toml};
use figment::value::{Dict, Map};
use figment::{Figment, Metadata, Profile, Provider};
use kvbm_engine::KvbmConfig;
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

/// The whole configuration: the engine's tree and the `[replay]` section.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct CliConfig {
    /// Every section but `[replay]` (`logical`, `physical`, `offload`, `runtime`, `tiers`,
    /// `leader`, `events`, `metrics`, `transport`, `tiering`): kvbm-engine's tree. Its
    /// `replay` field is left empty; the typed section is [`CliConfig::replay`].
    pub engine: KvbmConfig,
    /// `kvbm replay`'s own keys.
    pub replay: ReplayConfig,
    /// The scratch directory holding G3's file when the configuration names none (removed
    /// when the last clone is dropped).
    pub g3_scratch: Option<ScratchDir>,
}

/// A directory removed when the last handle is dropped.
#[derive(Debug, Clone)]
pub(crate) struct ScratchDir(std::sync::Arc<tempfile::TempDir>);

impl ScratchDir {
    /// A new scratch directory named `prefix…` in the system's temporary directory.
    ///
    /// # Errors
    /// It cannot be created.
    pub(crate) fn new(prefix: &str) -> anyhow::Result<Self> {
        let t = tempfile::Builder::new()
            .prefix(prefix)
            .tempdir()
            .with_context(|| format!("cannot create a scratch directory {prefix}*"))?;
        Ok(ScratchDir(std::sync::Arc::new(t)))
    }

    /// Where it is.
    pub(crate) fn path(&self) -> &Path {
        self.0.path()
    }
}

impl PartialEq for ScratchDir {
    fn eq(&self, other: &Self) -> bool {
        self.path() == other.path()
    }
}

/// The replay's defaults that differ from the engine's (see the module docs).
fn replay_defaults() -> Value {
    json!({
        "replay": ReplayConfig::default(),
        "tiers": {
            "g1_blocks": 1024,
            "g2_blocks": 8192,
            "g3_blocks": 32768,
            "block_bytes": 4096,
        },
        "physical": { "object": { "namespace": "kvbm-replay" } },
        "offload": {
            "g1_to_g2": { "room_patience_ms": 30000 },
            "g2_to_g4": { "use_locks": false },
            "g2_to_g3": {
                "max_concurrent_transfers": 4,
                "batch_config": { "max_batch_size": 256 },
            },
        },
    })
}

/// The `[replay]` section: the replay's own keys (the stack's are the engine's, see the
/// [module docs](self)).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub(crate) struct ReplayConfig {
    /// Mooncake JSONL trace; the built-in synthetic workload when unset.
    pub trace: Option<PathBuf>,
    /// Seed of the synthetic workload.
    pub seed: u64,
    /// Requests: of the synthetic workload, or the first N of the trace. Default: 20000
    /// synthetic, the whole trace.
    pub requests: Option<usize>,
    /// Enables G4 (objects), its presence index sized to the workload: on `[physical.s3]`
    /// when set, else in `physical.object_dir`, else in a scratch directory. Setting either of
    /// those enables G4 too. Its objects go under `physical.object.namespace` with the block
    /// size appended (`kvbm-replay/b4096`).
    pub g4: bool,
    /// 0: as fast as possible; 1.0: honour the trace's timestamps; 0.1: ten times faster.
    pub time_scale: f64,
    /// Start G3→G2 reads this many requests ahead of their request (0: only on demand).
    pub read_ahead_requests: usize,
    /// How the replay's scheduler drives the engine: through the scheduler-facing tiering
    /// manager (`tiering`, vLLM's call sequence) or the leader's onboarding sessions
    /// (`sessions`).
    pub scheduler: Scheduler,
}

/// The replay's scheduler front end (see `replay::tiers`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub(crate) enum Scheduler {
    /// `kvbm-tiering`'s scheduler contract served by the engine (`EngineTieringManager`):
    /// lookup → prepare_load → load → complete_load, prepare_store → store → complete_store.
    #[default]
    Tiering,
    /// The engine leader's `find_matches` and `OnboardingSession`s, block runs per tier.
    Sessions,
}

impl Default for ReplayConfig {
    fn default() -> Self {
        ReplayConfig {
            trace: None,
            seed: 42,
            requests: None,
            g4: false,
            time_scale: 0.0,
            read_ahead_requests: 16,
            scheduler: Scheduler::Tiering,
        }
    }
}

/// A provider under a name of our choosing (shown by `config show` and in errors).
struct Named<P> {
    name: String,
    inner: P,
}

impl<P: Provider> Provider for Named<P> {
    fn metadata(&self) -> Metadata {
        Metadata::named(self.name.clone())
    }
    fn data(&self) -> Result<Map<Profile, Dict>, figment::Error> {
        self.inner.data()
    }
}

fn named<P: Provider>(name: impl Into<String>, inner: P) -> Named<P> {
    Named {
        name: name.into(),
        inner,
    }
}

/// The merged configuration and the figment that knows where each value came from.
pub(crate) struct Loaded {
    /// The configuration.
    pub config: CliConfig,
    figment: Figment,
}

/// Merges defaults, `file`, the environment and `flags` (a JSON tree of only the flags given),
/// and names a scratch G3 file when the configuration gives G3 none.
///
/// # Errors
/// An unreadable file, or a bad key or value anywhere (named, with its source).
pub(crate) fn load(file: Option<&Path>, flags: Value) -> anyhow::Result<Loaded> {
    let mut figment =
        Figment::new().merge(named("default", Serialized::defaults(replay_defaults())));
    if let Some(path) = file {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("cannot read config file {}", path.display()))?;
        figment = figment.merge(named(
            format!("file {}", path.display()),
            Toml::string(&text),
        ));
    }
    // KVBM_<SECTION>__<KEY>; variables without "__" (KVBM_TEST_*, KVBM_LOG) are not config.
    // A secret (`..__TOKEN`, `..__PASSWORD`) is taken as the text given, never parsed ("0123"
    // stays "0123").
    let secret_var = |k: &str| kvbm_engine::config::is_secret_key(&k.replace("__", "."));
    figment = figment.merge(named(
        "env KVBM_*",
        Env::prefixed("KVBM_")
            .filter(move |k| k.as_str().contains("__") && !secret_var(k.as_str()))
            .split("__"),
    ));
    let secrets = secret_env_tree(std::env::vars());
    if secrets.as_object().is_some_and(|m| !m.is_empty()) {
        figment = figment.merge(named("env KVBM_*", Serialized::defaults(secrets)));
    }
    // The AWS variables fill in [physical.s3] when S3 is configured (a bucket or an endpoint
    // from any layer); without S3 they are not configuration.
    let with_flags = figment.clone().merge(Serialized::defaults(flags.clone()));
    let s3_configured = with_flags.find_value("physical.s3.bucket").is_ok()
        || with_flags.find_value("physical.s3.endpoint").is_ok();
    let mut aws = serde_json::Map::new();
    for (var, key) in [
        ("AWS_ACCESS_KEY_ID", "access_key"),
        ("AWS_SECRET_ACCESS_KEY", "secret_key"),
        ("AWS_REGION", "region"),
        ("AWS_ENDPOINT_URL", "endpoint"),
    ] {
        if let Ok(v) = std::env::var(var)
            && !v.is_empty()
        {
            aws.insert(key.into(), Value::String(v));
        }
    }
    if s3_configured && !aws.is_empty() {
        figment = figment.merge(named(
            "env AWS_*",
            Serialized::defaults(json!({ "physical": { "s3": aws } })),
        ));
    }
    figment = figment.merge(named("flag", Serialized::defaults(flags)));
    if s3_configured {
        const CREDENTIALS: &str = "S3 credentials missing: set AWS_ACCESS_KEY_ID and \
            AWS_SECRET_ACCESS_KEY (or physical.s3.access_key / secret_key)";
        for (key, missing) in [
            (
                "physical.s3.bucket",
                "an S3 endpoint needs a bucket (--s3-bucket or physical.s3.bucket)",
            ),
            ("physical.s3.access_key", CREDENTIALS),
            ("physical.s3.secret_key", CREDENTIALS),
        ] {
            if figment.find_value(key).is_err() {
                bail!("{missing}");
            }
        }
    }
    // G3 without a file: one in a scratch directory (the lowest layer), and the replay's queue
    // depth for whatever file G3 has.
    let g3_blocks: usize = figment.extract_inner("tiers.g3_blocks").unwrap_or(0);
    let mut g3_scratch = None;
    if g3_blocks > 0 && figment.find_value("physical.disk.path").is_err() {
        let dir = ScratchDir::new("kvbm-g3-")?;
        figment = figment.join(named(
            "default (scratch)",
            Serialized::defaults(
                json!({ "physical": { "disk": { "path": dir.path().join("g3.bin") } } }),
            ),
        ));
        g3_scratch = Some(dir);
    }
    if figment.find_value("physical.disk.path").is_ok() {
        figment = figment.join(named(
            "default",
            Serialized::defaults(json!({ "physical": { "disk": { "queue_depth": 128 } } })),
        ));
    }
    let bad = |e: figment::Error| {
        let msgs: Vec<String> = e.into_iter().map(|e| e.to_string()).collect();
        anyhow::anyhow!("bad configuration: {}", msgs.join("; "))
    };
    let mut engine: KvbmConfig = figment.extract().map_err(bad)?;
    let replay: ReplayConfig = figment.extract_inner("replay").map_err(bad)?;
    engine.replay = None;
    engine
        .validate()
        .map_err(|e| anyhow::anyhow!("bad configuration: {e}"))?;
    let config = CliConfig {
        engine,
        replay,
        g3_scratch,
    };
    validate(&config)?;
    Ok(Loaded { config, figment })
}

fn validate(c: &CliConfig) -> anyhow::Result<()> {
    let r = &c.replay;
    if !(r.time_scale.is_finite() && r.time_scale >= 0.0) {
        bail!(
            "time_scale must be a non-negative number, got {}",
            r.time_scale
        );
    }
    Ok(())
}

/// The `KVBM_*__*` variables among `vars` that set a secret key, as a tree of raw strings.
fn secret_env_tree(vars: impl IntoIterator<Item = (String, String)>) -> Value {
    let mut tree = serde_json::Map::new();
    for (name, value) in vars {
        let Some(rest) = name.strip_prefix("KVBM_") else {
            continue;
        };
        let key = rest.to_ascii_lowercase().replace("__", ".");
        if !rest.contains("__") || !kvbm_engine::config::is_secret_key(&key) {
            continue;
        }
        let segments: Vec<&str> = key.split('.').collect();
        insert_at(&mut tree, &segments, Value::String(value));
    }
    Value::Object(tree)
}

/// Sets `path` (segments) in `map` to `v`, making the tables on the way.
fn insert_at(map: &mut serde_json::Map<String, Value>, path: &[&str], v: Value) {
    match path {
        [] => {}
        [last] => {
            map.insert(last.to_string(), v);
        }
        [first, rest @ ..] => {
            if let Value::Object(m) = map
                .entry(first.to_string())
                .or_insert_with(|| Value::Object(serde_json::Map::new()))
            {
                insert_at(m, rest, v);
            }
        }
    }
}

fn is_secret(key: &str) -> bool {
    // The engine's [physical.s3] keys, and every secret key (NATS token, password).
    kvbm_engine::config::is_secret_key(key) || key.ends_with("access_key")
}

impl Loaded {
    /// Every leaf `key = value  # source`, secrets redacted, as printed by `config show`.
    pub(crate) fn show(&self) -> anyhow::Result<String> {
        let mut tree = serde_json::to_value(&self.config.engine)?;
        tree["replay"] = serde_json::to_value(&self.config.replay)?;
        let mut leaves = Vec::new();
        flatten("", &tree, &mut leaves);
        let width = leaves.iter().map(|(k, _)| k.len()).max().unwrap_or(0);
        let mut out = String::new();
        for (key, value) in leaves {
            let source = self
                .figment
                .find_metadata(&key)
                .map_or("default".to_string(), |m| m.name.to_string());
            let shown = if is_secret(&key) && !value.is_null() {
                "\"<redacted>\"".to_string()
            } else if value.is_null() {
                "(unset)".to_string()
            } else {
                value.to_string()
            };
            out.push_str(&format!("{key:width$} = {shown}  # {source}\n"));
        }
        Ok(out)
    }
}

fn flatten(prefix: &str, v: &Value, out: &mut Vec<(String, Value)>) {
    match v {
        Value::Object(m) if !m.is_empty() => {
            for (k, v) in m {
                let key = if prefix.is_empty() {
                    k.clone()
                } else {
                    format!("{prefix}.{k}")
                };
                flatten(&key, v, out);
            }
        }
        _ => out.push((prefix.to_string(), v.clone())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn project_config_file_parses_and_flags_win() {
        let file = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../config/kvbm.toml");
        let l = load(Some(&file), json!({"tiers": {"g1_blocks": 7}})).unwrap();
        assert_eq!(l.config.engine.tiers.g1_blocks, 7);
        let shown = l.show().unwrap();
        assert!(shown.contains("tiers.g1_blocks"), "{shown}");
        assert!(
            shown
                .lines()
                .any(|l| l.starts_with("tiers.g1_blocks") && l.ends_with("# flag"))
        );
        assert!(
            shown
                .lines()
                .any(|l| l.starts_with("logical.eviction") && l.contains("file "))
        );
    }

    #[test]
    fn project_config_file_replay_section_is_the_default() {
        let file = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../config/kvbm.toml");
        let text = std::fs::read_to_string(&file).unwrap();
        let table: toml::Table = toml::from_str(&text).unwrap();
        let replay: ReplayConfig = table["replay"].clone().try_into().unwrap();
        assert_eq!(
            replay,
            ReplayConfig::default(),
            "config/kvbm.toml [replay] drifted"
        );
    }

    #[test]
    fn the_stack_is_configured_by_the_engine_keys_only() {
        // The replay's old duplicates of engine keys are unknown keys now.
        for old in [
            "g1_blocks",
            "g3_dir",
            "block_bytes",
            "g3_queue_depth",
            "g4_namespace",
        ] {
            let e = load(None, json!({"replay": {old: 1}}))
                .err()
                .unwrap()
                .to_string();
            assert!(e.contains(old), "{old}: {e}");
        }
        // The replay's sizes are the lowest layer of the engine's keys.
        let l = load(None, json!({})).unwrap();
        let t = &l.config.engine.tiers;
        assert_eq!((t.g1_blocks, t.g2_blocks, t.g3_blocks), (1024, 8192, 32768));
        // G3 without a file gets a scratch one, shown as such, with the replay's queue depth.
        let disk = l
            .config
            .engine
            .physical
            .disk
            .clone()
            .expect("G3 has a file");
        let scratch = l.config.g3_scratch.clone().expect("a scratch directory");
        assert_eq!(disk.path, scratch.path().join("g3.bin"));
        assert_eq!(disk.queue_depth, 128);
        let shown = l.show().unwrap();
        assert!(
            shown
                .lines()
                .any(|l| l.starts_with("physical.disk.path") && l.ends_with("# default (scratch)")),
            "{shown}"
        );
        // A named file is used as it is, and no scratch directory is made.
        let l = load(
            None,
            json!({"physical": {"disk": {"path": "/tmp/x/g3.bin"}}}),
        )
        .unwrap();
        assert!(l.config.g3_scratch.is_none());
        assert_eq!(
            l.config.engine.physical.disk.unwrap().path,
            Path::new("/tmp/x/g3.bin")
        );
        // S3 named without credentials is one clear error (where the environment has none).
        if std::env::var_os("AWS_ACCESS_KEY_ID").is_some() {
            return;
        }
        let e = load(
            None,
            json!({"physical": {"s3": {"endpoint": "http://127.0.0.1:1", "bucket": "b"}}}),
        )
        .err()
        .unwrap()
        .to_string();
        assert!(e.contains("S3 credentials missing"), "{e}");
    }

    #[test]
    fn unknown_key_is_an_error_naming_it() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("c.toml");
        std::fs::write(&p, "[replay]\ng1_blockz = 3\n").unwrap();
        let e = load(Some(&p), json!({})).err().unwrap().to_string();
        assert!(e.contains("g1_blockz"), "{e}");
    }

    #[test]
    fn engine_sections_come_from_the_engine_tree() {
        // The project file's engine sections (uncommented) are the engine's defaults.
        let file = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../config/kvbm.toml");
        let l = load(Some(&file), json!({})).unwrap();
        assert_eq!(
            l.config.engine.runtime,
            kvbm_engine::config::RuntimeConfig::default()
        );
        assert_eq!(
            l.config.engine.transport,
            kvbm_engine::config::TransportConfig::default()
        );
        assert!(
            l.config.engine.replay.is_none(),
            "[replay] is typed, not carried twice"
        );
        // A value set in a file is read, and shown with its source.
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("c.toml");
        std::fs::write(
            &p,
            "[transport]\nnats_url = \"nats://127.0.0.1:4222\"\n[tiers]\ng2_blocks = 77\n",
        )
        .unwrap();
        let l = load(Some(&p), json!({})).unwrap();
        assert_eq!(
            l.config.engine.transport.nats_url.as_deref(),
            Some("nats://127.0.0.1:4222")
        );
        assert_eq!(l.config.engine.tiers.g2_blocks, 77);
        let shown = l.show().unwrap();
        assert!(
            shown.lines().any(|l| l.starts_with("tiers.g2_blocks")
                && l.contains("= 77")
                && l.contains("# file ")),
            "{shown}"
        );
        assert!(
            shown
                .lines()
                .any(|l| l.starts_with("events.subject") && l.ends_with("# default")),
            "{shown}"
        );
        // The replay's own defaults for the offload lanes are the lowest layer.
        assert!(!l.config.engine.offload.g2_to_g4.use_locks);
        assert_eq!(l.config.engine.offload.g2_to_g3.max_concurrent_transfers, 4);
    }

    #[test]
    fn engine_section_errors_name_the_key() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("c.toml");
        std::fs::write(&p, "[events]\nsubjekt = \"x\"\n").unwrap();
        let e = load(Some(&p), json!({})).err().unwrap().to_string();
        assert!(e.contains("subjekt"), "{e}");
        // The engine's own validation runs too: a value of the right type out of range.
        std::fs::write(&p, "[runtime]\nworker_threads = 0\n").unwrap();
        let e = load(Some(&p), json!({})).err().unwrap().to_string();
        assert!(e.contains("runtime.worker_threads"), "{e}");
    }

    #[test]
    fn engine_s3_secret_is_redacted() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("c.toml");
        std::fs::write(
            &p,
            "[physical.s3]\nbucket = \"b\"\naccess_key = \"AKIDEXAMPLE\"\nsecret_key = \"hunter3\"\n",
        )
        .unwrap();
        let shown = load(Some(&p), json!({})).unwrap().show().unwrap();
        assert!(!shown.contains("hunter3"), "{shown}");
        assert!(!shown.contains("AKIDEXAMPLE"), "{shown}");
        assert!(shown.contains("physical.s3.secret_key"), "{shown}");
    }

    #[test]
    fn security_nats_secrets_are_redacted_and_read_raw() {
        let l = load(
            None,
            json!({"transport": {"nats_auth": {"user": "u", "password": "pw-5ecret-0123"}}}),
        )
        .unwrap();
        let auth = &l.config.engine.transport.nats_auth;
        assert_eq!(auth.password.as_ref().unwrap().expose(), "pw-5ecret-0123");
        let shown = l.show().unwrap();
        assert!(shown.contains("transport.nats_auth.password"), "{shown}");
        assert!(!shown.contains("pw-5ecret"), "{shown}");
        assert!(!format!("{:?}", l.config).contains("pw-5ecret"));
        // From the environment, a secret is the text given: a leading zero is kept.
        let tree = secret_env_tree([
            (
                "KVBM_TRANSPORT__NATS_AUTH__TOKEN".to_string(),
                "0123".to_string(),
            ),
            (
                "KVBM_TRANSPORT__REQUEST_TIMEOUT_MS".to_string(),
                "7".to_string(),
            ),
        ]);
        assert_eq!(tree, json!({"transport": {"nats_auth": {"token": "0123"}}}));
        // A url with userinfo is refused naming the key, without the secret.
        let e = load(
            None,
            json!({"transport": {"nats_url": "nats://u:pw-5ecret-0123@127.0.0.1:4222"}}),
        )
        .err()
        .unwrap();
        let e = format!("{e:#}");
        assert!(e.contains("transport.nats_url"), "{e}");
        assert!(!e.contains("pw-5ecret"), "{e}");
    }

    #[test]
    fn secrets_are_redacted() {
        let l = load(
            None,
            json!({"physical": {"s3": {"secret_key": "hunter2", "access_key": "k", "endpoint": "http://x:1", "bucket": "b"}}}),
        )
        .unwrap();
        let shown = l.show().unwrap();
        assert!(!shown.contains("hunter2"), "{shown}");
        assert!(shown.contains("<redacted>"));
    }
}
