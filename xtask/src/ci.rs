//! `cargo xtask ci`: the whole gate, in order, stopping at the first failure.
//!
//! ```text
//!   fmt --check ─► clippy -D warnings ─► layering ─► [start servers] tests, python (the
//!     kvbm-vllm wheel; vLLM's own tests, see [`crate::python`]) [stop servers] ─► loom model
//!     checks ─► NIXL over loopback ([`crate::nixl`]) ─► fuzz (each target 20 s, instrumented)
//!     ─► soak (60 s) ─► docs
//! ```
//!
//! Each step's wall time is printed when the run ends, passed or not (`ci: step times`).
//!
//! The fuzz step installs cargo-fuzz when it is missing and builds the `fuzz/` crate on nightly
//! (its own target directory; the physical decoders, and the cluster plane's through
//! `kvbm_cluster::fuzzing`); it fails on a crash or when libFuzzer reports no coverage
//! growth. The soak runs two instances with every tier, random S3 errors and NATS
//! restarts for 60 s ([`crate::soak`]).
//!
//! Tests run against real servers started by [`crate::services`]; they are stopped after the
//! tests whatever the outcome. Extra feature builds (e.g. `cuda`) are listed in
//! [`FEATURE_CHECKS`] so the code behind them cannot rot even though CI has no GPU.

use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::Result;

use crate::{layering, run_step, services::Services};

/// Extra `cargo clippy` runs with feature sets the workspace run does not see: (package,
/// features; "" = the package's defaults alone, which the workspace's feature unification
/// hides: the engine's core and kvbm-cluster without `nats` must build and test warning-free
/// for an embedder).
const FEATURE_CHECKS: &[(&str, &str)] = &[
    ("kvbm-engine", ""),
    ("kvbm-cluster", ""),
    ("kvbm-physical", "cuda"),
    ("kvbm-physical", "nixl"),
    ("kvbm-cluster", "nats,testing"),
];

/// Features the workspace test run turns on: those whose tests need only the servers CI
/// starts (not a GPU), so they run against them.
pub(crate) const TEST_FEATURES: &str = "kvbm-cluster/nats,kvbm-cluster/testing";

fn cargo() -> Command {
    Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()))
}

/// Each step's wall time, printed when the run ends (passed or not): where the minutes go.
struct Clock {
    start: Instant,
    steps: Vec<(&'static str, Duration)>,
    reported: bool,
}

impl Clock {
    fn new() -> Self {
        Clock {
            start: Instant::now(),
            steps: Vec::new(),
            reported: false,
        }
    }

    /// Runs `f` as the step `name`, timing it.
    fn step<T>(&mut self, name: &'static str, f: impl FnOnce() -> Result<T>) -> Result<T> {
        let t = Instant::now();
        let r = f();
        self.steps.push((name, t.elapsed()));
        r
    }

    fn report(&mut self) {
        self.reported = true;
        eprintln!("\nci: step times");
        for (name, d) in &self.steps {
            eprintln!("ci: {:>8.1} s  {name}", d.as_secs_f64());
        }
        eprintln!("ci: {:>8.1} s  in all", self.start.elapsed().as_secs_f64());
    }
}

impl Drop for Clock {
    /// A run that stopped at a failure still says where its time went.
    fn drop(&mut self) {
        if !self.reported {
            self.report();
        }
    }
}

pub(crate) fn run(_args: &[String]) -> Result<()> {
    let mut clock = Clock::new();
    clock.step("fmt", || {
        run_step(cargo().args(["fmt", "--all", "--check"]))
    })?;
    clock.step("clippy (workspace)", || {
        run_step(cargo().args([
            "clippy",
            "--workspace",
            "--all-targets",
            "--",
            "-D",
            "warnings",
        ]))
    })?;
    clock.step("clippy (feature sets)", || {
        for (package, features) in FEATURE_CHECKS {
            let mut clippy = cargo();
            clippy.args(["clippy", "-p", package, "--all-targets"]);
            if !features.is_empty() {
                clippy.args(["--features", features]);
            }
            run_step(clippy.args(["--", "-D", "warnings"]))?;
        }
        Ok(())
    })?;
    clock.step("layering", || {
        eprintln!("\n$ cargo xtask layering");
        layering::run()
    })?;

    let services = clock.step("services", Services::start_all)?;
    let mut test = cargo();
    test.args(["test", "--workspace", "--features", TEST_FEATURES]);
    services.export_to(&mut test);
    let tested = clock.step("tests (build and run)", || Ok(run_counting(&mut test)))?;
    // The Python step (kvbm-vllm's wheel, vLLM's own tests, the object tier on S3) while the
    // servers are up.
    let python = match &tested {
        Ok(_) => clock.step("python (wheel, vLLM's tests, kvbm-vllm's)", || {
            eprintln!("\n$ cargo xtask python");
            Ok(crate::python::run_with(&services))
        })?,
        Err(_) => Ok(()), // the tests' failure is the one reported
    };
    services.stop();
    let mut totals = tested?;
    python?;

    // Loom model checks of the logical crate's handle-lifetime protocol: their own cfg, so their
    // own target dir (keeps the main build cache), release for speed.
    let loomed = clock.step("loom", || {
        let mut loom = cargo();
        loom.args(["test", "-p", "kvbm-logical", "--release", "--lib", "loom"])
            .env("RUSTFLAGS", "--cfg loom")
            .env(
                "CARGO_TARGET_DIR",
                crate::project_root().join("target/loom"),
            );
        run_counting(&mut loom)
    })?;
    totals.passed += loomed.passed;
    totals.failed += loomed.failed;
    totals.ignored += loomed.ignored;

    // NIXL over loopback with the real library (the nixl-cu12 wheel; no GPU needed).
    let nixl = clock.step("nixl (loopback)", || {
        run_counting(&mut crate::nixl::test_command(cargo())?)
    })?;
    totals.passed += nixl.passed;
    totals.failed += nixl.failed;
    totals.ignored += nixl.ignored;

    clock.step("fuzz (build and run)", || {
        crate::fuzz::run_targets(crate::fuzz::CI_SECS, &crate::fuzz::TARGETS)
    })?;
    clock.step("soak", || crate::soak::run_for(crate::soak::CI_SECS))?;

    clock.step("docs", || {
        run_step(
            cargo()
                .args(["doc", "--workspace", "--no-deps"])
                .env("RUSTDOCFLAGS", "-D warnings"),
        )?;
        for (package, features) in FEATURE_CHECKS {
            let mut doc = cargo();
            doc.args(["doc", "--no-deps", "-p", package]);
            if !features.is_empty() {
                doc.args(["--features", features]);
            }
            run_step(doc.env("RUSTDOCFLAGS", "-D warnings"))?;
        }
        Ok(())
    })?;
    eprintln!("\nci: all steps passed");
    clock.report();
    // The last line is the whole run's tally, so nobody has to add up per-binary results.
    println!(
        "ci: {} passed, {} failed, {} skipped",
        totals.passed, totals.failed, totals.ignored
    );
    Ok(())
}

/// Test counts summed over every `test result:` line of a `cargo test` run.
#[derive(Debug, Default, PartialEq, Eq)]
struct Totals {
    passed: u64,
    failed: u64,
    ignored: u64,
}

impl Totals {
    /// Adds one libtest summary line (`test result: ok. 8 passed; 0 failed; 1 ignored; ...`).
    fn add_line(&mut self, line: &str) {
        let Some(rest) = line.trim().strip_prefix("test result: ") else {
            return;
        };
        for part in rest.split(['.', ';']) {
            let mut words = part.split_whitespace();
            let (Some(n), Some(what)) = (words.next(), words.next()) else {
                continue;
            };
            let Ok(n) = n.parse::<u64>() else { continue };
            match what {
                "passed" => self.passed += n,
                "failed" => self.failed += n,
                "ignored" => self.ignored += n,
                _ => {}
            }
        }
    }
}

/// Runs `cargo test`, passing its output through while counting results; fails when it fails.
fn run_counting(cmd: &mut Command) -> Result<Totals> {
    use std::io::{BufRead, BufReader, Write};
    let shown = format!("{cmd:?}").replace('"', "");
    eprintln!("\n$ {shown}");
    let mut child = cmd.stdout(std::process::Stdio::piped()).spawn()?;
    let mut totals = Totals::default();
    let stdout = child.stdout.take().expect("piped");
    let mut out = std::io::stdout().lock();
    for line in BufReader::new(stdout).lines() {
        let line = line?;
        totals.add_line(&line);
        writeln!(out, "{line}")?;
    }
    drop(out);
    let status = child.wait()?;
    if !status.success() {
        anyhow::bail!(
            "`{shown}` failed ({status}): {} passed, {} failed",
            totals.passed,
            totals.failed
        );
    }
    if totals.passed == 0 {
        anyhow::bail!("`{shown}` ran no test");
    }
    Ok(totals)
}

#[cfg(test)]
mod tests {
    use super::Totals;

    #[test]
    fn totals_sum_libtest_summaries() {
        let mut t = Totals::default();
        t.add_line("test result: ok. 8 passed; 0 failed; 1 ignored; 0 measured; 0 filtered out; finished in 0.03s");
        t.add_line(
            "test result: FAILED. 2 passed; 3 failed; 0 ignored; 0 measured; 0 filtered out",
        );
        t.add_line("running 8 tests");
        t.add_line("test foo ... ok");
        assert_eq!(
            t,
            Totals {
                passed: 10,
                failed: 3,
                ignored: 1
            }
        );
    }
}
