//! `cargo xtask fuzz [SECS] [TARGET...]`: runs the `fuzz/` crate's libFuzzer targets (nightly,
//! cargo-fuzz) for SECS seconds each (default 60).
//!
//! | target | decoder |
//! |---|---|
//! | `trace_line` | the Mooncake trace line parser of `kvbm replay` |
//! | `manifest` | the G3 manifest header, record and replay decoders |
//! | `block_header` | the block header of disk slots and object bodies |
//! | `object_key` | the block object key parser |
//!
//! cargo-fuzz is installed once (`cargo install cargo-fuzz --locked`) when it is not on PATH.
//! A fuzz build instruments the whole dependency tree (object_store's TLS stack included) and
//! takes minutes, so `cargo xtask ci` does not build it: CI runs property tests over the same
//! decoders instead (`crates/kvbm-physical/tests/decoders.rs`, the manifest's and the trace
//! line's unit tests), and this command is the longer run. A crash leaves its input under
//! `fuzz/artifacts/<target>/`.

use std::process::Command;

use anyhow::{Context, Result, bail};

use crate::{on_path, run_step};

/// Every target of `fuzz/`.
pub(crate) const TARGETS: [&str; 4] = ["trace_line", "manifest", "block_header", "object_key"];

/// Installs cargo-fuzz when it is missing (idempotent).
pub(crate) fn ensure_cargo_fuzz() -> Result<()> {
    if on_path("cargo-fuzz") {
        return Ok(());
    }
    eprintln!("fuzz: installing cargo-fuzz (once)");
    run_step(Command::new("cargo").args(["install", "cargo-fuzz", "--locked"]))
        .context("installing cargo-fuzz")
}

/// Runs `targets` for `secs` seconds each.
pub(crate) fn run_targets(secs: u64, targets: &[&str]) -> Result<()> {
    ensure_cargo_fuzz()?;
    let dir = crate::project_root().join("fuzz");
    for t in targets {
        run_step(
            Command::new("cargo")
                .current_dir(&dir)
                .args(["+nightly", "fuzz", "run", t, "--"])
                .arg(format!("-max_total_time={secs}"))
                .arg("-rss_limit_mb=2048"),
        )
        .with_context(|| format!("fuzz target {t} (a crash input is under fuzz/artifacts/{t}/)"))?;
    }
    Ok(())
}

/// `cargo xtask fuzz [SECS] [TARGET...]`.
pub(crate) fn run(args: &[String]) -> Result<()> {
    let mut secs = 60;
    let mut targets: Vec<&str> = Vec::new();
    for a in args {
        if let Ok(s) = a.parse::<u64>() {
            secs = s;
        } else if let Some(t) = TARGETS.iter().find(|t| **t == a.as_str()) {
            targets.push(t);
        } else {
            bail!(
                "unknown fuzz argument `{a}` (seconds, or a target: {})",
                TARGETS.join(", ")
            );
        }
    }
    if targets.is_empty() {
        targets = TARGETS.to_vec();
    }
    run_targets(secs, &targets)
}
