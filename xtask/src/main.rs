//! The project's task runner, in the style of rust-analyzer's `xtask`.
//!
//! `cargo xtask <command>` (the alias lives in `.cargo/config.toml`) is the one entry point for
//! every check. Each command lives in its own module with a `run` function; `main` only
//! dispatches. Commands work from any directory: they first change to the workspace root.
//!
//! | command | what it does |
//! |---|---|
//! | `ci` | the whole gate: fmt, clippy, layering, tests (with real servers), Python (vLLM's tests), docs |
//! | `layering` | fails when a crate depends on one at or above its own layer |
//! | `python` | builds the kvbm-vllm wheel, runs vLLM's own kv_offload tests against vLLM's and kvbm's classes |
//! | `services` | `start` prints `export` lines for servers it started; `stop` stops them |
//! | `bench [crate]` | runs the benchmarks (all, or one crate's); `bench tiering\|vllm --against REV`: alternately with REV's build |
//! | `fuzz [secs]` | runs the `fuzz/` cargo-fuzz targets (decoders of outside bytes) |
//! | `soak [secs]` | every tier under random S3 errors; corrupt 0, settled, RSS flat |
//! | `gpu-check --out DIR` | on a GPU machine: the `cuda` feature's tests and benchmark, as JSON |

mod bench;
mod bench_ab;
mod ci;
mod fuzz;
mod gpu_check;
mod layering;
mod nats_jwt;
mod nixl;
mod python;
mod services;
mod soak;
mod tidy;

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, bail};

const USAGE: &str = "\
usage: cargo xtask <command>

commands:
  ci                 fmt, clippy, layering, tests against real servers, docs (the CI gate)
  layering           check the crate layering rule against `cargo metadata`
  python             build the kvbm-vllm wheel; run vLLM's own kv_offload tests with vLLM's
                     classes, then with kvbm's substituted (installs maturin when missing)
  services start     start the test servers and print `export` lines for them
  services stop      stop servers started by `services start`
  bench [NAME]       run benchmarks (NAME: logical, physical, offload, ...; default all)
  bench tiering|vllm --against REV [--runs N] [-- ARGS]
                     the tiering bench (vllm: the step from Python, tiering_step.py) of the
                     working tree and of REV, alternately (N runs each, default 3), figure by
                     figure: median, median, head/base
  fuzz [SECS] [T..]  run the fuzz/ targets (cargo-fuzz, nightly) SECS each (default 60)
  soak [SECS]        kvbm replay, every tier, random S3 errors, for SECS (default 600)
  nixl               kvbm-physical's NIXL transport over loopback, with the nixl-cu12 wheel's
                     library (downloaded once into target/nixl)
  gpu-check --out DIR  on a GPU machine: build kvbm-physical --features cuda, run its GPU
                     tests and benchmark, write DIR/gpu-check.json (--bundle/--prebuilt: see gpu_check.rs)
";

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    std::env::set_current_dir(project_root()).context("changing to the workspace root")?;
    let rest = args.get(1..).unwrap_or_default();
    match args.first().map(String::as_str) {
        Some("ci") => ci::run(rest),
        Some("layering") => layering::run(),
        Some("python") => python::run(),
        Some("services") => services::run_command(rest),
        Some("bench") => bench::run(rest),
        Some("fuzz") => fuzz::run(rest),
        Some("soak") => soak::run(rest),
        Some("gpu-check") => gpu_check::run(rest),
        Some("nixl") => nixl::run(),
        Some("help" | "-h" | "--help") | None => {
            print!("{USAGE}");
            Ok(())
        }
        Some(other) => bail!("unknown command `{other}`\n\n{USAGE}"),
    }
}

/// The workspace root (the parent of this crate's manifest directory).
pub(crate) fn project_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("xtask lives one level below the workspace root")
        .to_path_buf()
}

/// Runs a command, echoing it first, and fails with its name when it fails.
pub(crate) fn run_step(cmd: &mut Command) -> Result<()> {
    let shown = format!("{cmd:?}").replace('"', "");
    eprintln!("\n$ {shown}");
    let status = cmd
        .status()
        .with_context(|| format!("starting `{shown}`"))?;
    if !status.success() {
        bail!("`{shown}` failed ({status})");
    }
    Ok(())
}

/// Runs `cargo ARGS --message-format=json-render-diagnostics` (its diagnostics shown as they
/// come, echoed first like [`run_step`]) and returns the artifacts it built
/// (`compiler-artifact` messages). `cmd` is the `cargo` command with its directory and
/// environment set; the arguments are added here.
pub(crate) fn cargo_artifacts(cmd: &mut Command, args: &[&str]) -> Result<Vec<serde_json::Value>> {
    cmd.args(args)
        .arg("--message-format=json-render-diagnostics")
        .stderr(std::process::Stdio::inherit());
    let shown = format!("{cmd:?}").replace('"', "");
    eprintln!("\n$ {shown}");
    let out = cmd
        .output()
        .with_context(|| format!("starting `{shown}`"))?;
    if !out.status.success() {
        bail!("`{shown}` failed ({})", out.status);
    }
    Ok(String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|v| v["reason"] == "compiler-artifact")
        .collect())
}

/// Whether `program` is on PATH.
pub(crate) fn on_path(program: &str) -> bool {
    find_on_path(program).is_some()
}

/// The full path of `program` on PATH (or in `~/.cargo/bin`, where `cargo install` puts tools).
pub(crate) fn find_on_path(program: &str) -> Option<PathBuf> {
    let mut dirs: Vec<PathBuf> = std::env::var_os("PATH")
        .map(|p| std::env::split_paths(&p).collect())
        .unwrap_or_default();
    if let Some(home) = std::env::var_os("CARGO_HOME") {
        dirs.push(PathBuf::from(home).join("bin"));
    } else if let Some(home) = std::env::var_os("HOME") {
        dirs.push(PathBuf::from(home).join(".cargo/bin"));
    }
    dirs.into_iter()
        .map(|d| d.join(program))
        .find(|p| p.is_file())
}
