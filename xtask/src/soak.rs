//! `cargo xtask soak [SECS]`: the soak test (`crates/kvbm-cli/tests/soak.rs`) for SECS seconds
//! (default 600; `cargo xtask ci` runs [`CI_SECS`]): `kvbm replay --instances 2` (two instance
//! processes sharing one bucket, G4 events over NATS), every tier on, random S3 errors from the
//! fault proxy and NATS restarted at random, checking zero corrupt blocks, no leaked block in
//! any pool, every transfer settled and flat resident memory.
//!
//! It is built with the same features as the CI test run, so after `cargo xtask ci`'s tests it
//! rebuilds nothing.

use std::process::Command;

use anyhow::{Result, bail};

use crate::run_step;

/// Seconds of the soak in `cargo xtask ci`.
pub(crate) const CI_SECS: u64 = 60;

/// Runs the soak for `secs` seconds.
pub(crate) fn run_for(secs: u64) -> Result<()> {
    run_step(
        Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()))
            .args(["test", "-p", "kvbm-cli", "--features"])
            .arg(crate::ci::TEST_FEATURES)
            .args(["--test", "soak", "--"])
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
