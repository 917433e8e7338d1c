//! `cargo xtask ci`: the whole gate, in order, stopping at the first failure.
//!
//! ```text
//!   fmt --check ─► clippy -D warnings ─► layering ─► [start servers] tests [stop servers] ─► docs
//! ```
//!
//! Tests run against real servers started by [`crate::services`]; they are stopped after the
//! tests whatever the outcome. Extra feature builds (e.g. `cuda`) are listed in
//! [`FEATURE_CHECKS`] so the code behind them cannot rot even though CI has no GPU.

use std::process::Command;

use anyhow::Result;

use crate::{layering, run_step, services::Services};

/// Extra `cargo clippy` runs with non-default features: (package, features).
const FEATURE_CHECKS: &[(&str, &str)] = &[];

fn cargo() -> Command {
    Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()))
}

pub(crate) fn run(_args: &[String]) -> Result<()> {
    run_step(cargo().args(["fmt", "--all", "--check"]))?;
    run_step(cargo().args([
        "clippy",
        "--workspace",
        "--all-targets",
        "--",
        "-D",
        "warnings",
    ]))?;
    for (package, features) in FEATURE_CHECKS {
        run_step(cargo().args([
            "clippy",
            "-p",
            package,
            "--all-targets",
            "--features",
            features,
            "--",
            "-D",
            "warnings",
        ]))?;
    }
    eprintln!("\n$ cargo xtask layering");
    layering::run()?;

    let services = Services::start_all()?;
    let mut test = cargo();
    test.args(["test", "--workspace"]);
    services.export_to(&mut test);
    let tested = run_step(&mut test);
    services.stop();
    tested?;

    run_step(
        cargo()
            .args(["doc", "--workspace", "--no-deps"])
            .env("RUSTDOCFLAGS", "-D warnings"),
    )?;
    eprintln!("\nci: all steps passed");
    Ok(())
}
