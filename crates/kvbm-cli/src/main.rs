//! The `kvbm` command line.
//!
//! * `kvbm replay` replays a request trace (or the built-in synthetic multi-turn workload)
//!   through G1..G4 with real bytes, real transfers and verification (see [`replay`]);
//! * `kvbm bench` measures each data path against a raw baseline in the same run ([`mod@bench`]);
//! * `kvbm config show` prints the merged configuration and where each value came from
//!   ([`config`]).
//!
//! Errors are printed as one message (with its causes) and exit with status 1; usage errors
//! exit with status 2 (clap). Nothing panics on bad input.

mod bench;
mod config;
mod metrics_http;
mod replay;
mod security;

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Args, Parser, Subcommand};
use serde_json::{Map, Value, json};

/// kvbm: a multi-tier KV-cache block manager for LLM inference.
#[derive(Debug, Parser)]
#[command(name = "kvbm", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Replay a request trace through the tiered cache (built-in synthetic workload when no
    /// --trace is given).
    Replay {
        #[command(flatten)]
        flags: ReplayFlags,
        /// Print one JSON object instead of the table.
        #[arg(long)]
        json: bool,
        /// Serve Prometheus metrics on this address while running (e.g. 127.0.0.1:9464).
        #[arg(long, value_name = "ADDR")]
        metrics_addr: Option<String>,
        /// Run N engine instances as separate processes sharing one G4 (S3, --g4-dir, or a
        /// temporary object directory) and one NATS server; requests are assigned round-robin
        /// by conversation.
        #[arg(long, value_name = "N")]
        instances: Option<usize>,
        /// NATS server for --instances (default: the configuration's transport.nats_url).
        #[arg(long, value_name = "URL")]
        nats_url: Option<String>,
        /// With --instances: spread requests round-robin by conversation (default) or by
        /// request (consecutive turns on different instances).
        #[arg(long, value_enum, default_value_t = replay::instances::Assign::Conversation)]
        assign: replay::instances::Assign,
        /// Child mode of --instances: serve this instance's share (set by the parent).
        #[arg(long, hide = true, requires = "instances")]
        instance_index: Option<usize>,
        /// Child mode of --instances: the run's NATS subject (set by the parent).
        #[arg(long, hide = true, requires = "instance_index")]
        events_subject: Option<String>,
        /// Sweep G2 capacities instead of one replay: hit ratio per eviction policy and capacity,
        /// with Belady (offline optimum) and the infinite cache as bounds. Runs the logical-only
        /// simulation (G2 only, G1 = 0, prefix hits as in the replay, no bytes moved).
        #[arg(long, value_name = "N,N,..")]
        sweep_g2: Option<String>,
        /// Policies for --sweep-g2 (default: every built-in one).
        #[arg(long, value_name = "P,P,..", requires = "sweep_g2")]
        sweep_policies: Option<String>,
        /// With --sweep-g2: draw hit ratio against capacity into this SVG file.
        #[arg(long, value_name = "FILE", requires = "sweep_g2")]
        plot: Option<PathBuf>,
    },
    /// Measure the data paths against raw baselines measured in the same run.
    Bench {
        /// Which path: host, disk, object, tiering or all.
        #[arg(default_value = "all")]
        which: bench::Which,
        /// Print one JSON object.
        #[arg(long)]
        json: bool,
        /// Directory for the disk benchmark's files (default: a temporary directory).
        #[arg(long, value_name = "DIR")]
        dir: Option<PathBuf>,
        #[command(flatten)]
        flags: ReplayFlags,
    },
    /// Cluster credentials: make the trust root, issue member credentials, show one.
    Security {
        #[command(subcommand)]
        command: security::SecurityCommand,
    },
    /// Configuration commands.
    Config {
        #[command(subcommand)]
        command: ConfigCommand,
    },
}

#[derive(Debug, Subcommand)]
enum ConfigCommand {
    /// Print the merged configuration and where each value came from (secrets redacted).
    Show {
        #[command(flatten)]
        flags: ReplayFlags,
    },
}

/// Flags that override the configuration (shared by replay, bench and config show).
#[derive(Debug, Args, Default)]
struct ReplayFlags {
    /// TOML configuration file (e.g. config/kvbm.toml).
    #[arg(long, value_name = "FILE")]
    config: Option<PathBuf>,
    /// Mooncake JSONL trace (timestamp, input_length, output_length, hash_ids).
    #[arg(long, value_name = "FILE")]
    trace: Option<PathBuf>,
    /// Seed of the synthetic workload.
    #[arg(long)]
    seed: Option<u64>,
    /// Number of requests (synthetic), or the first N of the trace.
    #[arg(long, value_name = "N")]
    requests: Option<usize>,
    /// G1 capacity in blocks.
    #[arg(long, value_name = "N")]
    g1_blocks: Option<usize>,
    /// G2 capacity in blocks (0 disables G2, G3 and G4).
    #[arg(long, value_name = "N")]
    g2_blocks: Option<usize>,
    /// G3 capacity in blocks (0 disables G3).
    #[arg(long, value_name = "N")]
    g3_blocks: Option<usize>,
    /// Enable G4 (local-filesystem object store, or S3 with --s3-endpoint).
    #[arg(long)]
    g4: bool,
    /// S3 endpoint for G4 (credentials from AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY).
    #[arg(long, value_name = "URL")]
    s3_endpoint: Option<String>,
    /// S3 bucket for G4.
    #[arg(long, value_name = "BUCKET")]
    s3_bucket: Option<String>,
    /// Bytes per block (a multiple of 4096).
    #[arg(long, value_name = "BYTES")]
    block_bytes: Option<usize>,
    /// Keep G3 in this directory (a second run starts warm): `physical.disk.path = DIR/g3.bin`.
    #[arg(long, value_name = "DIR")]
    g3_dir: Option<PathBuf>,
    /// Keep G4 in this local directory (a second run starts warm): `physical.object_dir`.
    #[arg(long, value_name = "DIR")]
    g4_dir: Option<PathBuf>,
    /// Eviction policy of every tier: lru, multi_lru, lineage, fifo, arc, s3fifo, belady,
    /// tinylfu-BASE or adaptive-BASE (BASE one of those), orphan-POLICY (any of those)
    /// (default adaptive-lru).
    #[arg(long, value_name = "NAME")]
    eviction_policy: Option<String>,
    /// 0: as fast as possible; 1.0: honour the trace's timestamps.
    #[arg(long, value_name = "X")]
    time_scale: Option<f64>,
    /// The scheduler's way into the engine: the scheduler-facing tiering manager (default) or
    /// the leader's onboarding sessions.
    #[arg(long, value_enum)]
    scheduler: Option<config::Scheduler>,
}

impl ReplayFlags {
    /// The flags given, as a configuration tree (for figment's "flag" layer): the stack's
    /// flags write the engine's keys, the workload's `[replay]` (see `config`'s module docs).
    fn to_tree(&self) -> Value {
        let mut tree = Map::new();
        let mut put = |path: &[&str], v: Option<Value>| {
            let Some(v) = v else { return };
            let mut node = &mut tree;
            for k in &path[..path.len() - 1] {
                node = node
                    .entry(*k)
                    .or_insert_with(|| Value::Object(Map::new()))
                    .as_object_mut()
                    .expect("a table");
            }
            node.insert(path[path.len() - 1].into(), v);
        };
        let path = |p: &Option<PathBuf>| p.as_ref().map(|p| json!(p));
        put(&["replay", "trace"], path(&self.trace));
        put(&["replay", "seed"], self.seed.map(|v| json!(v)));
        put(&["replay", "requests"], self.requests.map(|v| json!(v)));
        put(&["replay", "g4"], self.g4.then_some(json!(true)));
        put(&["replay", "time_scale"], self.time_scale.map(|v| json!(v)));
        put(&["replay", "scheduler"], self.scheduler.map(|v| json!(v)));
        put(&["tiers", "g1_blocks"], self.g1_blocks.map(|v| json!(v)));
        put(&["tiers", "g2_blocks"], self.g2_blocks.map(|v| json!(v)));
        put(&["tiers", "g3_blocks"], self.g3_blocks.map(|v| json!(v)));
        put(
            &["tiers", "block_bytes"],
            self.block_bytes.map(|v| json!(v)),
        );
        put(
            &["physical", "disk", "path"],
            self.g3_dir.as_ref().map(|d| json!(d.join("g3.bin"))),
        );
        put(&["physical", "object_dir"], path(&self.g4_dir));
        put(
            &["physical", "s3", "endpoint"],
            self.s3_endpoint.as_ref().map(|v| json!(v)),
        );
        put(
            &["physical", "s3", "bucket"],
            self.s3_bucket.as_ref().map(|v| json!(v)),
        );
        put(
            &["logical", "eviction"],
            self.eviction_policy.as_ref().map(|v| json!(v)),
        );
        Value::Object(tree)
    }

    fn load(&self) -> anyhow::Result<config::Loaded> {
        config::load(self.config.as_deref(), self.to_tree())
    }
}

fn init_logging() {
    let filter = tracing_subscriber::EnvFilter::try_from_env("KVBM_LOG").unwrap_or_else(|_| {
        // Pinning refused by RLIMIT_MEMLOCK is expected on most desktops: not worth a line.
        tracing_subscriber::EnvFilter::new("warn,kvbm_physical::storage::host=error")
    });
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_target(false)
        .try_init();
}

/// Before a cluster starts: the NATS url carries no credentials (it is printed and passed on
/// the children's command lines; they go in `[transport.nats_auth]`, which children inherit
/// through the environment or the `--config` file); off loopback the NATS credentials are not
/// missing unless `security.insecure`; member credentials are configured, or made for the run
/// (`replay::instances`), or security is explicitly off (logged; see `kvbm_cluster::security`).
fn cluster_checks(engine: &kvbm_engine::KvbmConfig, key: &str, url: &str) -> anyhow::Result<()> {
    kvbm_engine::config::check_nats_url(key, url)?;
    let insecure = engine.security.insecure;
    // Each child loads its own credential (`{instance}` in the path names it); without one
    // configured the run makes its own (`replay::instances`), unless security is explicitly off.
    if !engine.security.has_credentials() && insecure {
        kvbm_cluster::security::Security::Off.require_for(insecure, [url])?;
    }
    engine.transport.nats_auth.require_for(url, insecure)?;
    Ok(())
}

fn run(cli: Cli) -> anyhow::Result<()> {
    match cli.command {
        Command::Replay {
            flags,
            json,
            metrics_addr,
            instances,
            nats_url,
            assign,
            instance_index,
            events_subject,
            sweep_g2,
            sweep_policies,
            plot,
        } => {
            if let Some(caps) = sweep_g2 {
                let caps = replay::sweep::parse_capacities(&caps)?;
                let policies = replay::sweep::parse_policies(
                    sweep_policies
                        .as_deref()
                        .unwrap_or(&replay::sweep::DEFAULT_POLICIES.join(",")),
                )?;
                let sweep = replay::sweep::run(&flags.load()?.config, &caps, &policies)?;
                if let Some(p) = &plot {
                    sweep.plot(p)?;
                }
                if json {
                    println!("{}", serde_json::to_string_pretty(&sweep)?);
                } else {
                    print!("{}", sweep.table());
                }
                return Ok(());
            }
            let loaded = flags.load()?;
            if instances.is_some() || nats_url.is_some() {
                let count = instances.unwrap_or(1);
                let key = if nats_url.is_some() {
                    "--nats-url"
                } else {
                    "transport.nats_url"
                };
                let url = nats_url
                    .or_else(|| loaded.config.engine.transport.nats_url.clone())
                    .ok_or_else(|| {
                        anyhow::anyhow!(
                            "--instances needs a NATS server: --nats-url URL (or transport.nats_url)"
                        )
                    })?;
                cluster_checks(&loaded.config.engine, key, &url)?;
                if let Some(index) = instance_index {
                    if index >= count {
                        anyhow::bail!("--instance-index {index} is not below --instances {count}");
                    }
                    let subject = events_subject
                        .unwrap_or_else(|| loaded.config.engine.events.subject.clone());
                    let spec = replay::InstanceSpec {
                        index,
                        count,
                        sharing: kvbm_cluster::shared_g4::Sharing {
                            nats_url: url,
                            subject,
                            instance: index as u64 + 1,
                            instances: count,
                        },
                        assign,
                    };
                    let report = replay::run_instance(&loaded.config, Some(&spec))?;
                    println!("{}", serde_json::to_string_pretty(&report)?);
                    return Ok(());
                }
                if let Some(addr) = &metrics_addr {
                    anyhow::bail!(
                        "--metrics-addr {addr} is per process; with --instances it is not served"
                    );
                }
                let report = replay::instances::run_parent(&loaded.config, count, &url)?;
                if json {
                    println!("{}", serde_json::to_string_pretty(&report)?);
                } else {
                    print!("{}", replay::instances::table(&report));
                }
                return Ok(());
            }
            if let Some(addr) = &metrics_addr {
                metrics_http::serve(addr)?;
            }
            let report = replay::run(&loaded.config)?;
            if json {
                println!("{}", serde_json::to_string_pretty(&report)?);
            } else {
                print!("{}", report.table());
            }
            Ok(())
        }
        Command::Bench {
            which,
            json,
            dir,
            flags,
        } => {
            let loaded = flags.load()?;
            let out = bench::run(which, dir.as_deref(), &loaded.config)?;
            if json {
                println!("{}", serde_json::to_string_pretty(&out)?);
            } else {
                print!("{}", out.table());
            }
            Ok(())
        }
        Command::Security { command } => {
            print!("{}", security::run(command)?);
            Ok(())
        }
        Command::Config {
            command: ConfigCommand::Show { flags },
        } => {
            let loaded = flags.load()?;
            print!("{}", loaded.show()?);
            Ok(())
        }
    }
}

fn main() -> ExitCode {
    // A bug must still end in one line, not a backtrace.
    std::panic::set_hook(Box::new(|info| {
        eprintln!("kvbm: internal error (a bug, please report it): {info}");
    }));
    init_logging();
    let cli = Cli::parse();
    match run(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("kvbm: error: {e:#}");
            ExitCode::FAILURE
        }
    }
}
