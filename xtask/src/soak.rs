//! `cargo xtask soak [SECS]`: the soak test (`crates/kvbm-cli/tests/soak.rs`) for SECS seconds
//! (default 600): `kvbm replay` with every tier on and random S3 errors from the fault proxy,
//! checking zero corrupt blocks, every transfer settled and flat resident memory.

use std::process::Command;

use anyhow::{Result, bail};

use crate::run_step;

/// Runs the soak for `secs` seconds.
pub(crate) fn run_for(secs: u64) -> Result<()> {
    run_step(
        Command::new("cargo")
            .args(["test", "-p", "kvbm-cli", "--test", "soak", "--"])
            .args(["--ignored", "--nocapture"])
            .env("KVBM_SOAK_SECS", secs.to_string()),
    )
}

/// `cargo xtask soak [SECS]`.
pub(crate) fn run(args: &[String]) -> Result<()> {
    let secs = match args.first() {
        None => 600,
        Some(a) => match a.parse() {
            Ok(s) => s,
            Err(_) => bail!("`cargo xtask soak [SECS]`: {a:?} is not a number of seconds"),
        },
    };
    run_for(secs)
}
