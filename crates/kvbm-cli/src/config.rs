//! The command's configuration: kvbm-engine's one tree ([`KvbmConfig`]: every crate's section
//! and the engine's own) plus this crate's `[replay]` section, merged by figment from (lowest
//! first) the code's defaults, a `--config FILE` (TOML), `KVBM_<SECTION>__<KEY>` environment
//! variables, the standard AWS credential variables, and command-line flags.
//!
//! There is one source of truth: the engine's sections are `KvbmConfig`'s own structs (and
//! through it each lower crate's), parsed and validated by `KvbmConfig`'s rules
//! ([`KvbmConfig::validate`]); `[replay]` is the section `KvbmConfig` carries unparsed for this
//! crate, parsed here into [`ReplayConfig`]. So `config/kvbm.toml`, which documents the whole
//! tree, is a valid `--config` file, engine sections included. Every section refuses unknown
//! keys, so a misspelt key is an error naming it and where it came from. `kvbm config show`
//! prints every value with the provider that set it; secrets are redacted.
//!
//! The replay's defaults differ from the engine's in three keys (one replay process is the only
//! writer of its G4 namespace, so no cross-worker locks; small blocks make G2→G3 per-request
//! bound, so several batches in flight, of up to 256 blocks): they are the lowest layer, named
//! `default`, so a file or a variable still overrides them.

use std::path::{Path, PathBuf};

use anyhow::{Context, bail};
use figment::providers::{Env, Format, Serialized, Toml};
use figment::value::{Dict, Map};
use figment::{Figment, Metadata, Profile, Provider};
use kvbm_engine::KvbmConfig;
use kvbm_physical::IoEngineKind;
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

/// The whole configuration: the engine's tree and the `[replay]` section.
#[derive(Debug, Clone, PartialEq)]
pub struct CliConfig {
    /// Every section but `[replay]` (`logical`, `physical`, `offload`, `runtime`, `tiers`,
    /// `leader`, `events`, `metrics`, `transport`, `tiering`): kvbm-engine's tree. Its
    /// `replay` field is left empty; the typed section is [`CliConfig::replay`].
    pub engine: KvbmConfig,
    /// `kvbm replay` (and the tiers `kvbm bench` uses).
    pub replay: ReplayConfig,
}

/// The replay's defaults that differ from the engine's (see the module docs).
fn replay_defaults() -> Value {
    json!({
        "replay": ReplayConfig::default(),
        "offload": {
            "g2_to_g4": { "use_locks": false },
            "g2_to_g3": {
                "max_concurrent_transfers": 4,
                "batch_config": { "max_batch_size": 256 },
            },
        },
    })
}

/// The `[replay]` section.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ReplayConfig {
    /// Mooncake JSONL trace; the built-in synthetic workload when unset.
    pub trace: Option<PathBuf>,
    /// Seed of the synthetic workload.
    pub seed: u64,
    /// Requests: of the synthetic workload, or the first N of the trace. Default: 20000
    /// synthetic, the whole trace.
    pub requests: Option<usize>,
    /// G1 capacity in blocks (host memory stands in for the GPU).
    pub g1_blocks: usize,
    /// G2 (host) capacity in blocks; 0 disables G2, G3 and G4.
    pub g2_blocks: usize,
    /// G3 (disk) capacity in blocks; 0 disables it.
    pub g3_blocks: usize,
    /// Enables G4 (objects): a local-filesystem store, or S3 when `s3.endpoint` is set.
    pub g4: bool,
    /// Bytes per block (a multiple of 4096).
    pub block_bytes: usize,
    /// Keep G3 here (persistent: the next run starts warm); a temporary directory when unset.
    pub g3_dir: Option<PathBuf>,
    /// Keep a local G4 here (persistent); a temporary directory when unset.
    pub g4_dir: Option<PathBuf>,
    /// Key prefix of G4 objects (the block size is appended).
    pub g4_namespace: String,
    /// 0: as fast as possible; 1.0: honour the trace's timestamps; 0.1: ten times faster.
    pub time_scale: f64,
    /// Start G3→G2 reads this many requests ahead of their request (0: only on demand).
    pub prefetch_requests: usize,
    /// G3 I/O engine: `auto`, `uring`, `psync`.
    pub g3_engine: IoEngineKind,
    /// G3 I/O requests in flight per transfer.
    pub g3_queue_depth: u32,
    /// Open G3 with O_DIRECT (falls back with a warning where refused).
    pub g3_direct_io: bool,
    /// The S3 endpoint for G4 (and `kvbm bench object`).
    pub s3: S3Section,
    /// How the replay's scheduler drives the engine: through the scheduler-facing tiering
    /// manager (`tiering`, vLLM's call sequence) or the leader's onboarding sessions
    /// (`sessions`).
    pub scheduler: Scheduler,
}

/// The replay's scheduler front end (see `replay::tiers`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum Scheduler {
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
            g1_blocks: 1024,
            g2_blocks: 8192,
            g3_blocks: 32768,
            g4: false,
            block_bytes: 4096,
            g3_dir: None,
            g4_dir: None,
            g4_namespace: "kvbm-replay".into(),
            time_scale: 0.0,
            prefetch_requests: 16,
            g3_engine: IoEngineKind::Auto,
            g3_queue_depth: 128,
            g3_direct_io: true,
            s3: S3Section::default(),
            scheduler: Scheduler::Tiering,
        }
    }
}

/// `[replay.s3]`. Credentials normally come from `AWS_ACCESS_KEY_ID` / `AWS_SECRET_ACCESS_KEY`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct S3Section {
    /// `http(s)://host:port`.
    pub endpoint: Option<String>,
    /// Bucket.
    pub bucket: Option<String>,
    /// Region.
    pub region: String,
    /// Access key id (secret: redacted by `config show`).
    pub access_key_id: Option<String>,
    /// Secret access key (secret: redacted by `config show`).
    pub secret_access_key: Option<String>,
}

impl Default for S3Section {
    fn default() -> Self {
        S3Section {
            endpoint: None,
            bucket: None,
            region: "us-east-1".into(),
            access_key_id: None,
            secret_access_key: None,
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
pub struct Loaded {
    /// The configuration.
    pub config: CliConfig,
    figment: Figment,
}

/// Merges defaults, `file`, the environment and `flags` (a JSON tree of only the flags given).
///
/// # Errors
/// An unreadable file, or a bad key or value anywhere (named, with its source).
pub fn load(file: Option<&Path>, flags: Value) -> anyhow::Result<Loaded> {
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
    figment = figment.merge(named(
        "env KVBM_*",
        Env::prefixed("KVBM_")
            .filter(|k| k.as_str().contains("__"))
            .split("__"),
    ));
    let mut aws = serde_json::Map::new();
    for (var, key) in [
        ("AWS_ACCESS_KEY_ID", "access_key_id"),
        ("AWS_SECRET_ACCESS_KEY", "secret_access_key"),
        ("AWS_REGION", "region"),
        ("AWS_ENDPOINT_URL", "endpoint"),
    ] {
        if let Ok(v) = std::env::var(var)
            && !v.is_empty()
        {
            aws.insert(key.into(), Value::String(v));
        }
    }
    if !aws.is_empty() {
        figment = figment.merge(named(
            "env AWS_*",
            Serialized::defaults(json!({ "replay": { "s3": aws } })),
        ));
    }
    figment = figment.merge(named("flag", Serialized::defaults(flags)));
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
    let config = CliConfig { engine, replay };
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
    if r.s3.endpoint.is_some() && r.s3.bucket.is_none() {
        bail!("an S3 endpoint needs a bucket (--s3-bucket or replay.s3.bucket)");
    }
    Ok(())
}

fn is_secret(key: &str) -> bool {
    // [replay.s3] and the engine's [physical.s3].
    [
        "secret_access_key",
        "access_key_id",
        "secret_key",
        "access_key",
    ]
    .iter()
    .any(|k| key.ends_with(k))
}

impl Loaded {
    /// Every leaf `key = value  # source`, secrets redacted, as printed by `config show`.
    pub fn show(&self) -> anyhow::Result<String> {
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
        let l = load(Some(&file), json!({"replay": {"g1_blocks": 7}})).unwrap();
        assert_eq!(l.config.replay.g1_blocks, 7);
        let shown = l.show().unwrap();
        assert!(shown.contains("replay.g1_blocks"), "{shown}");
        assert!(
            shown
                .lines()
                .any(|l| l.starts_with("replay.g1_blocks") && l.ends_with("# flag"))
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
    fn secrets_are_redacted() {
        let l = load(
            None,
            json!({"replay": {"s3": {"secret_access_key": "hunter2", "endpoint": "http://x:1", "bucket": "b"}}}),
        )
        .unwrap();
        let shown = l.show().unwrap();
        assert!(!shown.contains("hunter2"), "{shown}");
        assert!(shown.contains("<redacted>"));
    }
}
