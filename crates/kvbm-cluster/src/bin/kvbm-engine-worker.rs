//! `kvbm-engine-worker`: one rank of a kvbm instance in its own process (feature `nats`).
//!
//! It owns a transfer manager and its layouts (G1 in host memory, or in GPU memory with
//! `physical.g1 = "device"` (`KVBM_PHYSICAL__G1=device`, a build with feature `cuda`, a
//! driver: refused by name otherwise); G2 in host memory, G3 an O_DIRECT file when
//! `--g3-file` is given, G4 its rank's directory of the object store when the configuration
//! tree has `tiers.g4_blocks` > 0) and answers the leader's control requests over NATS request/reply on
//! `{prefix}.{instance:016x}.worker.{rank}` until its standard input closes (its parent went
//! away) or it is killed.
//!
//! ```text
//! kvbm-engine-worker [--nats URL] --instance ID --rank R [--blocks N] [--layers L]
//!     [--page-size P] [--inner-dim D] [--g3-file PATH] [--fill-seed S] [--prefix P]
//!     [--announce] [--delay-from TIER --delay-ms MS] [--max-in-flight N]
//!     [--trust-root HEX --credential FILE] [--insecure]
//!     [--data-plane HOST:PORT [--data-plane-advertise HOST:PORT]]
//! ```
//!
//! `--instance` is the id of the instance whose rank this is, decimal or `0x`-hex (the
//! instance's `[workers] mode = "processes"` waits for its ranks; see `config/kvbm.toml`).
//!
//! It prints `ready <subject>` on standard output once it serves; with `--announce`, a line
//! `request <kind>` for each request it receives. `--delay-from`/`--delay-ms` delay every
//! transfer out of a tier (fault-injection tests kill the process meanwhile). `--max-in-flight`
//! bounds the requests served at once (default: `transport.worker_max_in_flight`'s, 256; one
//! more is answered `Refused`, see `WorkerServer::max_in_flight`).
//!
//! With `--data-plane` it serves the rank plane there (port 0: any free port; see
//! `kvbm_cluster::dataplane::rank`): the G2 slots its leader lends, to the same rank of the
//! lease's puller instance, and pulls its slice of a peer's blocks when its leader asks. Its
//! address reaches pullers through its leader (`--data-plane-advertise`, its port 0 the bound
//! port, else the bound address). With security on, only workers at this rank of the
//! namespace's instances connect; without `--data-plane` the leader's lend and pull requests
//! are refused (the instance then shares only through G4).
//!
//! It announces its rank and incarnation every `transport.heartbeat_interval_ms` (see
//! `cluster::transport::membership`), and once more as departing when it stops.
//!
//! Configuration is the usual tree (`KVBM_CONFIG_PATH`, `KVBM_*__*` variables), the instance's
//! own: G4 is `[physical.s3]` (or `physical.object_dir`) with `[physical.object]`, this rank's
//! objects under `tp{workers.ranks}.r{rank}/` when there are several ranks, every path and
//! header scoped by the model fingerprint of `[model]`, this rank's geometry and the ranks
//! (`KvbmConfig::fingerprint`, as the instance computes it: a worker process is always a rank
//! of a `workers.mode = "processes"` instance). `--nats` defaults to `transport.nats_url`, and the NATS credentials and TLS files come from
//! `[transport.nats_auth]` only, never from the command line (which `ps` shows); a url with
//! userinfo is refused. A NATS server off loopback is also refused without NATS credentials
//! unless `security.insecure = true` (logged loudly).
//!
//! Security: `[security]` of the configuration tree (`KVBM_CONFIG_PATH`, `KVBM_SECURITY__*`),
//! each of `--trust-root`, `--credential` and `--insecure` overriding its key. With a credential
//! (which must be a worker's, of `--instance` at `--rank`), only requests sealed by that
//! instance's leader are obeyed and replies are sealed (`WorkerServer::security`); without one
//! it refuses to start, on loopback too, unless `security.insecure` (see `docs/security.md`).

use std::io::{BufRead, Write};
use std::sync::Arc;
use std::time::Duration;

use kvbm_cluster::dataplane::DataPlaneConfig;
use kvbm_cluster::dataplane::rank::RankPlane;
use kvbm_cluster::security::{Role, Security, SecurityConfig};
use kvbm_cluster::transport::control::{ControlRequest, fill_pattern};
use kvbm_cluster::transport::nats::{DEFAULT_CONTROL_PREFIX, WorkerServer, connect_with};
use kvbm_engine::InstanceId;
use kvbm_engine::KvbmConfig;
use kvbm_engine::WorkerAddress;
use kvbm_engine::config::{ConfigBuilder, G1Memory, check_nats_url};
use kvbm_engine::worker::PhysicalWorker;
use kvbm_logical::TierId;

/// A failure of this binary: the underlying error when there is one, else its message.
type BinError = Box<dyn std::error::Error + Send + Sync>;
use kvbm_physical::{
    BlockLayout, DiskConfig, LayoutKind, PhysicalLayout, PinPolicy, TransferManager,
};

struct Args {
    nats: String,
    instance: u64,
    rank: u32,
    blocks: usize,
    layers: usize,
    page_size: usize,
    inner_dim: usize,
    g3_file: Option<String>,
    fill_seed: Option<u8>,
    prefix: String,
    announce: bool,
    delay: Option<(TierId, u64)>,
    max_in_flight: usize,
    data_plane: Option<String>,
    data_plane_advertise: Option<String>,
    security: SecurityConfig,
    config: KvbmConfig,
}

fn parse() -> Result<Args, BinError> {
    let mut a = Args {
        nats: String::new(),
        instance: 0,
        rank: 0,
        blocks: 8,
        layers: 2,
        page_size: 16,
        inner_dim: 64,
        g3_file: None,
        fill_seed: None,
        prefix: DEFAULT_CONTROL_PREFIX.to_string(),
        announce: false,
        delay: None,
        max_in_flight: kvbm_engine::config::TransportConfig::default().worker_max_in_flight,
        data_plane: None,
        data_plane_advertise: None,
        security: SecurityConfig::default(),
        config: ConfigBuilder::from_process_env()
            .and_then(|b| b.build())
            .map_err(|e| format!("configuration: {e}"))?,
    };
    a.security = a.config.security.clone();
    let (mut delay_from, mut delay_ms) = (None, None);
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        if flag == "--announce" {
            a.announce = true;
            continue;
        }
        if flag == "--insecure" {
            a.security.insecure = true;
            continue;
        }
        let value = it.next().ok_or_else(|| format!("{flag}: missing value"))?;
        let num = |v: &str| {
            v.parse::<u64>()
                .map_err(|e| format!("{flag}: `{v}` is not a number ({e})"))
        };
        match flag.as_str() {
            "--nats" => a.nats = value,
            // Decimal, or hex with `0x` (as `kvbm-engine-instance` prints its id).
            "--instance" => {
                a.instance = match value.strip_prefix("0x") {
                    Some(hex) => u64::from_str_radix(hex, 16)
                        .map_err(|e| format!("{flag}: `{value}` is not a hex id ({e})"))?,
                    None => num(&value)?,
                }
            }
            "--rank" => a.rank = num(&value)? as u32,
            "--blocks" => a.blocks = num(&value)? as usize,
            "--layers" => a.layers = num(&value)? as usize,
            "--page-size" => a.page_size = num(&value)? as usize,
            "--inner-dim" => a.inner_dim = num(&value)? as usize,
            "--g3-file" => a.g3_file = Some(value),
            "--data-plane" => a.data_plane = Some(value),
            "--data-plane-advertise" => a.data_plane_advertise = Some(value),
            "--fill-seed" => a.fill_seed = Some(num(&value)? as u8),
            "--prefix" => a.prefix = value,
            "--trust-root" => a.security.trust_root = Some(value),
            "--credential" => a.security.credential_file = Some(value.into()),
            "--max-in-flight" => match num(&value)? {
                0 => return Err("--max-in-flight: must be > 0".into()),
                n => a.max_in_flight = n as usize,
            },
            "--delay-ms" => delay_ms = Some(num(&value)?),
            "--delay-from" => {
                delay_from = Some(match value.to_ascii_uppercase().as_str() {
                    "G1" => TierId::G1,
                    "G2" => TierId::G2,
                    "G3" => TierId::G3,
                    "G4" => TierId::G4,
                    _ => return Err(format!("--delay-from: unknown tier `{value}`").into()),
                })
            }
            _ => return Err(format!("unknown flag `{flag}`").into()),
        }
    }
    if a.nats.is_empty() {
        a.nats = a
            .config
            .transport
            .nats_url
            .clone()
            .ok_or("--nats URL (or transport.nats_url) is required")?;
    }
    check_nats_url("--nats", &a.nats)?;
    if a.data_plane_advertise.is_some() && a.data_plane.is_none() {
        return Err("--data-plane-advertise needs --data-plane".into());
    }
    a.delay = match (delay_from, delay_ms) {
        (Some(t), Some(ms)) => Some((t, ms)),
        (None, None) => None,
        _ => return Err("--delay-from and --delay-ms go together".into()),
    };
    Ok(a)
}

/// This worker's security from `[security]` and the flags: off, or its own worker credential
/// (of `--instance` at `--rank`). Without one, refused unless insecure (loopback too).
fn security(a: &Args) -> Result<Security, BinError> {
    let security = Security::from_config(&a.security)?;
    security.require_for(a.security.insecure, [a.nats.as_str()])?;
    a.config
        .transport
        .nats_auth
        .require_for(&a.nats, a.security.insecure)?;
    if let Some(signer) = security.signer() {
        let cert = signer.cert();
        if cert.role != Role::Worker
            || cert.instance != InstanceId(a.instance)
            || cert.rank != a.rank
        {
            return Err(format!(
                "the credential is for {cert}, not worker rank {} of {}",
                a.rank,
                InstanceId(a.instance)
            )
            .into());
        }
    }
    Ok(security)
}

/// The configuration as the instance this process is a rank of sees it: its ranks run as
/// processes, and its fingerprint binds them so (`KvbmConfig::parallelism`), whatever mode
/// this tree says.
fn instance_config(a: &Args) -> KvbmConfig {
    let mut config = a.config.clone();
    config.workers.mode = kvbm_engine::config::WorkersMode::Processes;
    config
}

/// This rank's rank plane on `--data-plane` over its G2, scoped by the instance's fingerprint.
async fn rank_plane(
    a: &Args,
    bind: &str,
    worker: &PhysicalWorker,
    security: Arc<Security>,
) -> Result<Arc<RankPlane>, BinError> {
    let g2 = worker
        .layout(TierId::G2)
        .ok_or("no G2 layout")
        .and_then(|h| {
            worker
                .transfer_manager()
                .layout(h)
                .map_err(|_| "no G2 layout")
        })?;
    let config = instance_config(a);
    let mut dp = DataPlaneConfig::from_transport(&config.transport)?;
    dp.bind = bind
        .parse()
        .map_err(|e| format!("--data-plane: {bind:?} is not a host:port address ({e})"))?;
    dp.scope = config.fingerprint(g2.layout().config())?.short();
    // A whole pull, and a whole response, end before the leader's control request gives up
    // on it: a pull's destination slots, and a lease's slots once its `EndLease` (which waits
    // for the responses) answered, are then reused.
    let t = &config.transport;
    let within =
        |ms: u64| Duration::from_millis(ms.min(t.request_timeout_ms.saturating_mul(3) / 4).max(1));
    dp.pull_deadline = within(t.pull_deadline_ms);
    dp.response_deadline = within(t.response_deadline_ms);
    let address = WorkerAddress::new(InstanceId(a.instance), a.rank);
    let plane = RankPlane::start(dp, address, g2, security, a.data_plane_advertise.as_deref())
        .await
        .map_err(|e| format!("--data-plane {bind}: {e}"))?;
    Ok(Arc::new(plane))
}

/// This rank's G4 (with `tiers.g4_blocks` > 0): its directory of the configured object store,
/// scoped by the instance's fingerprint of `geometry`.
fn g4_layout(
    a: &Args,
    geometry: &BlockLayout,
    runtime: &tokio::runtime::Runtime,
) -> Result<Option<PhysicalLayout>, BinError> {
    if a.config.tiers.g4_blocks == 0 {
        return Ok(None);
    }
    let config = instance_config(a);
    let fingerprint = config.fingerprint(geometry.config())?;
    let object = config.rank_object_config(a.rank)?;
    let (storage, _) = runtime.block_on(kvbm_engine::stack::open_g4_storage(
        &config,
        fingerprint,
        object,
    ))?;
    // Objects are named by block: the layout's one slot only carries the geometry.
    let one = BlockLayout::builder()
        .config(*geometry.config())
        .kind(geometry.kind())
        .num_blocks(1)
        .build()
        .map_err(|e| format!("layout: {e}"))?;
    Ok(Some(PhysicalLayout::object(one, storage)))
}

fn worker(a: &Args, runtime: &tokio::runtime::Runtime) -> Result<PhysicalWorker, BinError> {
    let geometry = BlockLayout::builder()
        .num_blocks(a.blocks)
        .num_layers(a.layers)
        .outer_dim(2)
        .page_size(a.page_size)
        .inner_dim(a.inner_dim)
        .dtype_bytes(2)
        .kind(LayoutKind::FullyContiguous)
        .build()
        .map_err(|e| format!("layout: {e}"))?;
    let tm = Arc::new(TransferManager::new().map_err(|e| format!("transfer manager: {e}"))?);
    let host = || -> Result<PhysicalLayout, BinError> {
        Ok(PhysicalLayout::allocate_host(
            geometry,
            PinPolicy::Unpinned,
        )?)
    };
    let g2 = host()?;
    if let Some(seed) = a.fill_seed
        // SAFETY: `g2` was just allocated and is not registered yet: nothing else uses it.
        && !unsafe { fill_pattern(&g2, seed) }
    {
        return Err("the G2 layout is not host memory".into());
    }
    let reg = |l: PhysicalLayout| tm.register_layout(l).map_err(|e| e.to_string());
    // G1 where `physical.g1` puts it (KVBM_PHYSICAL__G1): host memory, or the GPU's, refused
    // by name where there is none (`Digest` and `Fill` then refuse G1: not host memory).
    let g1 = match a.config.physical.g1 {
        G1Memory::Host => host()?,
        G1Memory::Device => PhysicalLayout::allocate_gpu(geometry, a.config.physical.g1_device)
            .map_err(|e| format!("physical.g1 = \"device\": {e}"))?,
    };
    let mut w = PhysicalWorker::new(a.rank as usize, tm.clone())
        .with_layout(TierId::G1, reg(g1)?)
        .with_layout(TierId::G2, reg(g2)?);
    if let Some(path) = &a.g3_file {
        let disk = PhysicalLayout::create_disk(geometry, &DiskConfig::new(path))
            .map_err(|e| format!("--g3-file {path}: {e}"))?;
        w = w.with_layout(TierId::G3, reg(disk)?);
    }
    if let Some(objects) = g4_layout(a, &geometry, runtime).map_err(|e| format!("G4: {e}"))? {
        w = w.with_layout(TierId::G4, reg(objects)?);
    }
    Ok(w)
}

fn main() {
    let args = match parse() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("kvbm-engine-worker: {e}");
            std::process::exit(2);
        }
    };
    let security = match security(&args) {
        Ok(s) => Arc::new(s),
        Err(e) => {
            eprintln!("kvbm-engine-worker: security: {e}");
            std::process::exit(2);
        }
    };
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("tokio runtime");
    let worker = match worker(&args, &runtime) {
        Ok(w) => Arc::new(w),
        Err(e) => {
            eprintln!("kvbm-engine-worker: {e}");
            std::process::exit(1);
        }
    };
    let cancel = tokio_util::sync::CancellationToken::new();
    // Standard input closing means the parent is gone: stop serving.
    let on_eof = cancel.clone();
    std::thread::spawn(move || {
        let mut sink = String::new();
        while std::io::stdin()
            .lock()
            .read_line(&mut sink)
            .is_ok_and(|n| n > 0)
        {
            sink.clear();
        }
        on_eof.cancel();
    });
    let code = runtime.block_on(async move {
        let name = format!("kvbm-worker-{}-{}", args.instance, args.rank);
        let auth = &args.config.transport.nats_auth;
        let client = match connect_with(&args.nats, auth, &name, Duration::from_millis(500)).await {
            Ok(c) => c,
            Err(e) => {
                eprintln!("kvbm-engine-worker: {e}");
                return 1;
            }
        };
        let address = WorkerAddress::new(InstanceId(args.instance), args.rank);
        let plane = match &args.data_plane {
            None => None,
            Some(bind) => match rank_plane(&args, bind, &worker, security.clone()).await {
                Ok(p) => Some(p),
                Err(e) => {
                    eprintln!("kvbm-engine-worker: {e}");
                    return 1;
                }
            },
        };
        let mut server = WorkerServer::new(client, &args.prefix, address, worker)
            .max_in_flight(args.max_in_flight)
            .heartbeat(std::time::Duration::from_millis(
                args.config.transport.heartbeat_interval_ms,
            ))
            .security(security);
        if let Some(p) = &plane {
            server = server.rank_plane(p.clone());
        }
        if args.announce {
            server = server.on_request(Arc::new(|r: &ControlRequest| {
                let kind = match r {
                    ControlRequest::Describe => "describe".to_string(),
                    ControlRequest::Transfer(t) => {
                        format!("transfer {}->{} {}", t.src, t.dst, t.blocks.len())
                    }
                    ControlRequest::Digest { tier, .. } => format!("digest {tier}"),
                    ControlRequest::Fill { tier, .. } => format!("fill {tier}"),
                    ControlRequest::Lend { blocks, .. } => format!("lend {}", blocks.len()),
                    ControlRequest::EndLease { .. } => "end-lease".to_string(),
                    ControlRequest::PullSlices { hashes, .. } => {
                        format!("pull-slices {}", hashes.len())
                    }
                };
                let mut out = std::io::stdout().lock();
                let _ = writeln!(out, "request {kind}");
                let _ = out.flush();
            }));
        }
        if let Some((tier, ms)) = args.delay {
            server = server.delay_transfers_from(tier, Duration::from_millis(ms));
        }
        let task = match server.start(cancel.clone()).await {
            Ok(t) => t,
            Err(e) => {
                eprintln!("kvbm-engine-worker: {e}");
                return 1;
            }
        };
        {
            let mut out = std::io::stdout().lock();
            if let Some(p) = &plane {
                let _ = writeln!(out, "rank-plane {}", p.advertised());
            }
            let _ = writeln!(out, "ready {}", address.control_subject(&args.prefix));
            let _ = out.flush();
        }
        let _ = task.await;
        0
    });
    std::process::exit(code);
}
