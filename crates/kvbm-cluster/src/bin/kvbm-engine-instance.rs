//! `kvbm-engine-instance`: one whole kvbm instance ([`kvbm_cluster::instance::Instance`]) in its
//! own process (feature `nats`), driven by line commands on standard input, so tests (and
//! operators) can run several instances as separate processes sharing one NATS server and one
//! S3 bucket.
//!
//! ```text
//! kvbm-engine-instance [--id HEX] [--layers L] [--page-size P] [--inner-dim D]
//!     [--set key=value]...
//! ```
//!
//! Configuration is the usual tree: defaults, `KVBM_CONFIG_PATH`, `KVBM_*__*` variables, then
//! each `--set` (value parsed as an integer, a boolean, or else taken as a string). It needs
//! `transport.nats_url`, `tiers.g1_blocks` and `tiers.g2_blocks` (and `[physical.s3]` with
//! `tiers.g4_blocks` for a shared G4).
//!
//! With `workers.mode = "processes"` (`--set workers.mode=processes --set workers.ranks=N`)
//! its blocks live in `N` `kvbm-engine-worker` processes the operator starts (`--instance
//! 0x<its --id>`, `--rank 0..N`, the same geometry flags, `--blocks` at least `[tiers]`'s);
//! it does not start them (a supervisor does, and restarts one that dies); it waits for them
//! (`workers.join_timeout_ms`) before `ready`, has no data plane (`addr=-`), and `compute`
//! is refused (the ranks write their own memory).
//!
//! Once started it prints `ready id=<hex> addr=<data-plane address> fingerprint=fp-<hex>` (the
//! model fingerprint its G4 paths and NATS subjects are scoped by). Each command line gets one
//! answer line, `ok key=value ...` or `err <why>`. A prefix `SEED N` is the `N` blocks (4
//! tokens each, `logical.block_size` permitting) of the tokens `SEED*100000..`; block bytes are
//! [`synthetic_block`], so any instance can verify what it received.
//!
//! | command | does | answer |
//! |---|---|---|
//! | `compute SEED N` | writes the prefix into G2 | `computed=` |
//! | `offload SEED N` | G2 → shared G4 | `offloaded=` |
//! | `fetch SEED N` | onboards (local, G4, peers' G2); on a refusal recomputes and onboards again; verifies every G1 block's bytes | `matched= g2= g3= g4= remote= remote_from= refused= recomputed= onboarded= verified_blocks= verified_bytes= mismatched=` |
//! | `index SEED N` | what the cross-instance index says | `prefix=<hex>:<len>,... g2= g4=` (leading blocks another instance holds in that tier) |
//! | `peers` | live peers and their data planes | `live=<hex>@addr,...` |
//! | `corrupt-served N` | (feature `testing`) the next N served frames are damaged | `corrupt=N` |
//! | `stats` | instance, presence and security counters | `... secured= sec_accepted= sec_rejected= unauthenticated=` |
//! | `quit` | departs and exits | `bye` |
//!
//! It exits when its standard input closes (its parent went away).

use std::io::{BufRead, Write};

use kvbm_cluster::instance::{Instance, synthetic_block};
use kvbm_engine::InstanceId;
use kvbm_engine::KvbmRuntimeBuilder;
use kvbm_logical::{Salt, SequenceHash, TokenBlockSequence};
use kvbm_physical::{BlockLayout, LayoutKind};

/// A failure of this binary: the underlying error when there is one, else its message.
type BinError = Box<dyn std::error::Error + Send + Sync>;

struct Args {
    id: Option<u64>,
    layers: usize,
    page_size: usize,
    inner_dim: usize,
    sets: Vec<(String, String)>,
}

fn parse() -> Result<Args, BinError> {
    let mut a = Args {
        id: None,
        layers: 2,
        page_size: 16,
        inner_dim: 32,
        sets: Vec::new(),
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = || it.next().ok_or_else(|| format!("{flag} needs a value"));
        let num = |v: String| v.parse::<usize>().map_err(|e| format!("{flag} {v}: {e}"));
        match flag.as_str() {
            "--id" => {
                let v = value()?;
                a.id = Some(
                    u64::from_str_radix(v.trim_start_matches("0x"), 16)
                        .map_err(|e| format!("--id {v}: {e}"))?,
                );
            }
            "--layers" => a.layers = num(value()?)?,
            "--page-size" => a.page_size = num(value()?)?,
            "--inner-dim" => a.inner_dim = num(value()?)?,
            "--set" => {
                let v = value()?;
                let (k, val) = v
                    .split_once('=')
                    .ok_or_else(|| format!("--set {v}: expected key=value"))?;
                a.sets.push((k.to_string(), val.to_string()));
            }
            other => return Err(format!("unknown argument {other}").into()),
        }
    }
    Ok(a)
}

fn prefix(seed: u32, n: usize, block_size: usize) -> Result<Vec<SequenceHash>, BinError> {
    let tokens: Vec<u32> = (0..(n * block_size) as u32)
        .map(|t| seed.wrapping_mul(100_000).wrapping_add(t))
        .collect();
    TokenBlockSequence::from_tokens(&tokens, block_size as u32, Salt::NONE)
        .map(|s| s.hashes())
        .map_err(|e| format!("prefix: {e}").into())
}

fn seed_n(words: &[&str]) -> Result<(u32, usize), BinError> {
    match words {
        [s, n] => Ok((
            s.parse().map_err(|e| format!("seed {s}: {e}"))?,
            n.parse().map_err(|e| format!("count {n}: {e}"))?,
        )),
        _ => Err("expected SEED N".into()),
    }
}

async fn answer(inst: &Instance, block_size: usize, line: &str) -> Result<String, BinError> {
    let words: Vec<&str> = line.split_whitespace().collect();
    let Some((&cmd, rest)) = words.split_first() else {
        return Err("empty command".into());
    };
    let hashes = || {
        let (seed, n) = seed_n(rest)?;
        prefix(seed, n, block_size)
    };
    match cmd {
        "compute" => {
            let n = inst
                .compute(&hashes()?, &synthetic_block)
                .map_err(|e| e.to_string())?;
            Ok(format!("computed={n}"))
        }
        "offload" => {
            let n = inst
                .offload_g4(&hashes()?)
                .await
                .map_err(|e| e.to_string())?;
            Ok(format!("offloaded={n}"))
        }
        "fetch" => {
            let hs = hashes()?;
            let before = inst.stats();
            let (first, second) = inst
                .onboard_or_compute(&hs, &synthetic_block)
                .await
                .map_err(|e| e.to_string())?;
            let after = inst.stats();
            let done = second.as_ref().unwrap_or(&first);
            let mut want = vec![0u8; inst.block_bytes()];
            let (mut ok, mut bytes, mut bad) = (0usize, 0usize, 0usize);
            for (b, h) in done.blocks.iter().zip(&hs) {
                synthetic_block(*h, &mut want);
                if b.sequence_hash() == *h && inst.read_g1(b).as_ref() == Some(&want) {
                    ok += 1;
                    bytes += want.len();
                } else {
                    bad += 1;
                }
            }
            Ok(format!(
                "matched={} g2={} g3={} g4={} remote={} remote_from={} refused={} recomputed={} \
                 onboarded={} verified_blocks={ok} verified_bytes={bytes} mismatched={bad} \
                 refused_why={:?}",
                first.matched(),
                first.local_g2,
                first.local_g3,
                first.g4,
                first.remote_g2.map_or(0, |r| r.1),
                first
                    .remote_g2
                    .map_or_else(|| "-".to_string(), |r| format!("{:x}", r.0.0)),
                after.refused_blocks - before.refused_blocks,
                after.recomputed_blocks - before.recomputed_blocks,
                done.blocks.len(),
                first
                    .refused
                    .as_ref()
                    .map_or("", |r| r.1.as_str())
                    .replace(' ', "_"),
            ))
        }
        "index" => {
            let hs = hashes()?;
            let p: Vec<String> = inst
                .index()
                .prefix_by_instance(&hs, Some(inst.id()))
                .into_iter()
                .map(|(i, n)| format!("{:x}:{n}", i.0))
                .collect();
            // Leading hashes some other instance is said to hold in G2 / in G4.
            let run = |tier: kvbm_logical::TierId| {
                hs.iter()
                    .take_while(|h| {
                        inst.index()
                            .locations(**h)
                            .iter()
                            .any(|(i, t)| *i != inst.id() && *t == tier)
                    })
                    .count()
            };
            Ok(format!(
                "prefix={} g2={} g4={}",
                p.join(","),
                run(kvbm_logical::TierId::G2),
                run(kvbm_logical::TierId::G4)
            ))
        }
        "peers" => {
            let live: Vec<String> = inst
                .presence()
                .live_peers()
                .into_iter()
                .map(|p| {
                    let addr = inst
                        .peers()
                        .get(p)
                        .map_or_else(|| "-".to_string(), |a| a.to_string());
                    format!("{:x}@{addr}", p.0)
                })
                .collect();
            Ok(format!("live={}", live.join(",")))
        }
        #[cfg(feature = "testing")]
        "corrupt-served" => {
            let n: u64 = rest
                .first()
                .ok_or("expected N")?
                .parse()
                .map_err(|e| format!("{e}"))?;
            inst.data_plane()
                .ok_or("no data plane (workers.mode = \"processes\")")?
                .corrupt_next_frames(n);
            Ok(format!("corrupt={n}"))
        }
        "stats" => {
            let s = inst.stats();
            let p = inst.presence().stats();
            let sec = inst.security().stats();
            Ok(format!(
                "onboarded={} g4={} remote={} refused={} recomputed={} expired={} resyncs={} \
                 served={} secured={} sec_accepted={} sec_rejected={} unauthenticated={}",
                s.onboarded_blocks,
                s.g4_blocks,
                s.remote_g2_blocks,
                s.refused_blocks,
                s.recomputed_blocks,
                p.expired,
                p.resyncs,
                inst.data_plane().map_or(0, |d| d.stats().blocks_served()),
                inst.security().is_on(),
                sec.map_or(0, |s| s.accepted()),
                sec.map_or(0, |s| s.rejected_total()),
                p.unauthenticated,
            ))
        }
        other => Err(format!("unknown command {other}").into()),
    }
}

fn main() {
    let args = match parse() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("kvbm-engine-instance: {e}");
            std::process::exit(2);
        }
    };
    let mut builder = match KvbmRuntimeBuilder::from_env() {
        Ok(b) => b,
        Err(e) => {
            eprintln!("kvbm-engine-instance: {e}");
            std::process::exit(2);
        }
    };
    for (k, v) in &args.sets {
        builder = if let Ok(i) = v.parse::<i64>() {
            builder.set(k.clone(), i)
        } else if let Ok(b) = v.parse::<bool>() {
            builder.set(k.clone(), b)
        } else {
            builder.set(k.clone(), v.clone())
        };
    }
    let runtime = match builder.build() {
        Ok(r) => r,
        Err(e) => {
            eprintln!("kvbm-engine-instance: {e}");
            std::process::exit(2);
        }
    };
    let rt = runtime.handle();
    let block_size = rt.config().logical.block_size as usize;
    let geometry = BlockLayout::builder()
        .num_blocks(1)
        .num_layers(args.layers)
        .outer_dim(2)
        .page_size(args.page_size)
        .inner_dim(args.inner_dim)
        .dtype_bytes(2)
        .kind(LayoutKind::FullyContiguous)
        .build();
    let geometry = match geometry {
        Ok(g) => g,
        Err(e) => {
            eprintln!("kvbm-engine-instance: geometry: {e}");
            std::process::exit(2);
        }
    };
    let mut b = Instance::builder(&rt).geometry(geometry);
    if let Some(id) = args.id {
        b = b.id(InstanceId(id));
    }
    let inst = match rt.tokio().block_on(b.build()) {
        Ok(i) => i,
        Err(e) => {
            eprintln!("kvbm-engine-instance: {e}");
            std::process::exit(1);
        }
    };
    let mut out = std::io::stdout().lock();
    let _ = writeln!(
        out,
        "ready id={:x} addr={} fingerprint={}",
        inst.id().0,
        inst.data_plane()
            .map_or_else(|| "-".to_string(), |d| d.local_addr().to_string()),
        inst.fingerprint()
    );
    let _ = out.flush();
    for line in std::io::stdin().lock().lines() {
        let Ok(line) = line else { break };
        let line = line.trim();
        if line.is_empty() {
            continue;
        }
        if line == "quit" {
            rt.tokio().block_on(inst.shutdown());
            let _ = writeln!(out, "ok bye");
            let _ = out.flush();
            break;
        }
        let reply = match rt.tokio().block_on(answer(&inst, block_size, line)) {
            Ok(s) => format!("ok {s}"),
            Err(e) => format!("err {}", e.to_string().replace('\n', " ")),
        };
        let _ = writeln!(out, "{reply}");
        let _ = out.flush();
    }
    rt.tokio().block_on(inst.shutdown());
    drop(inst);
    runtime.shutdown();
}
