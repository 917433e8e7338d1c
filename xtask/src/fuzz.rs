//! `cargo xtask fuzz [SECS] [TARGET...]`: runs the `fuzz/` crate's libFuzzer targets (nightly,
//! cargo-fuzz, coverage-instrumented with AddressSanitizer) for SECS seconds each (default 60).
//!
//! | target | decoder |
//! |---|---|
//! | `trace_line` | the Mooncake trace line parser of `kvbm replay` |
//! | `journal` | the G3 journal's header, record and replay decoders |
//! | `block_header` | the block header of disk slots and object bodies |
//! | `object_key` | the block object key parser |
//! | `control_envelope` | leader↔worker control requests and responses (JSON over NATS) |
//! | `presence` | heartbeats, snapshot requests and snapshot pages |
//! | `event_batch` | cross-instance block event batches |
//! | `dataplane_request` | the data plane's request heads and hash lists (both versions), hellos |
//! | `dataplane_response` | the data plane's response heads and frame headers |
//! | `member_cert` | member certificates, and the verifier's check of one |
//! | `sealed` | sealed messages: arbitrary bytes, and genuine ones partly overwritten |
//!
//! cargo-fuzz is installed once (`cargo install cargo-fuzz --locked`) when it is not on PATH.
//! The cluster plane's targets reach the engine through `kvbm_cluster::fuzzing`
//! (hidden), so the fuzz crate builds kvbm-cluster with `nats` and its whole tree (object_store,
//! HTTP, TLS, NATS client) instrumented: a cold build takes many minutes on two cores; the
//! target directory is kept between runs. `cargo xtask ci` runs every target for [`CI_SECS`]
//! seconds; this command is the longer run.
//!
//! Each run's libFuzzer output is passed through and read: a target that reports no covered
//! edges (`cov: 0`) was not instrumented (no feedback, so not guided fuzzing) and fails the
//! step; the summary line per target gives its executions and its coverage at the first and
//! last status lines. The corpus grows in `fuzz/corpus/<target>/` across runs. A crash leaves
//! its input under `fuzz/artifacts/<target>/`.

use std::process::Command;

use anyhow::{Context, Result, bail};

use crate::{on_path, run_step};

/// Every target of `fuzz/`.
pub(crate) const TARGETS: [&str; 12] = [
    "trace_line",
    "journal",
    "block_header",
    "object_key",
    "control_envelope",
    "presence",
    "event_batch",
    "dataplane_request",
    "dataplane_response",
    "member_cert",
    "sealed",
    "rank_beat",
];

/// Installs cargo-fuzz when it is missing (idempotent).
pub(crate) fn ensure_cargo_fuzz() -> Result<()> {
    if on_path("cargo-fuzz") {
        return Ok(());
    }
    eprintln!("fuzz: installing cargo-fuzz (once)");
    run_step(Command::new("cargo").args(["install", "cargo-fuzz", "--locked"]))
        .context("installing cargo-fuzz")
}

/// Seconds per target in `cargo xtask ci`.
pub(crate) const CI_SECS: u64 = 20;

/// What one libFuzzer run reported.
#[derive(Debug, Default, PartialEq, Eq)]
pub(crate) struct FuzzSummary {
    /// Coverage (`cov:`) at the first status line.
    first_cov: Option<u64>,
    /// Coverage at the last status line.
    last_cov: u64,
    /// Executions (`#N` of the last status line, or `Done N runs`).
    execs: u64,
}

impl FuzzSummary {
    /// Reads one libFuzzer status line (`#1024 pulse cov: 93 ft: 120 corp: 9/41b exec/s: ...`,
    /// `Done 12345 runs in 20 second(s)`).
    pub(crate) fn add_line(&mut self, line: &str) {
        let mut words = line.split_whitespace();
        let Some(first) = words.next() else { return };
        if first == "Done" {
            if let Some(n) = words.next().and_then(|w| w.parse().ok()) {
                self.execs = self.execs.max(n);
            }
            return;
        }
        let Some(n) = first.strip_prefix('#').and_then(|n| n.parse::<u64>().ok()) else {
            return;
        };
        let rest: Vec<&str> = words.collect();
        if let Some(cov) = rest
            .windows(2)
            .find(|w| w[0] == "cov:")
            .and_then(|w| w[1].parse::<u64>().ok())
        {
            self.first_cov.get_or_insert(cov);
            self.last_cov = self.last_cov.max(cov);
        }
        self.execs = self.execs.max(n);
    }

    /// Whether coverage feedback was seen: libFuzzer counted instrumented edges (an
    /// uninstrumented build reports `cov: 0` throughout). With an empty corpus the count also
    /// grows during the run; with a corpus from an earlier run it may start where it ends.
    pub(crate) fn guided(&self) -> bool {
        self.last_cov > 0
    }
}

/// Runs `targets` for `secs` seconds each; fails on a crash or an uninstrumented run.
pub(crate) fn run_targets(secs: u64, targets: &[&str]) -> Result<()> {
    use std::io::{BufRead, BufReader, Write};
    ensure_cargo_fuzz()?;
    let dir = crate::project_root().join("fuzz");
    let mut lines = Vec::new();
    for t in targets {
        let mut cmd = Command::new("cargo");
        cmd.current_dir(&dir)
            .args(["+nightly", "fuzz", "run", t, "--"])
            .arg(format!("-max_total_time={secs}"))
            .arg("-rss_limit_mb=2048")
            .arg("-print_final_stats=1")
            .stderr(std::process::Stdio::piped());
        let shown = format!("{cmd:?}").replace('"', "");
        eprintln!("\n$ {shown}");
        let mut child = cmd.spawn().with_context(|| format!("starting `{shown}`"))?;
        let stderr = child.stderr.take().expect("piped");
        let mut summary = FuzzSummary::default();
        let mut err = std::io::stderr().lock();
        for line in BufReader::new(stderr).lines() {
            let line = line?;
            summary.add_line(&line);
            writeln!(err, "{line}")?;
        }
        drop(err);
        let status = child.wait()?;
        if !status.success() {
            bail!("fuzz target {t} failed ({status}): a crash input is under fuzz/artifacts/{t}/");
        }
        if !summary.guided() {
            bail!(
                "fuzz target {t}: no coverage feedback (cov {:?} → {}): the build is not instrumented",
                summary.first_cov,
                summary.last_cov
            );
        }
        lines.push(format!(
            "fuzz {t}: {} executions in {secs} s, coverage {} → {} edges",
            summary.execs,
            summary.first_cov.unwrap_or(0),
            summary.last_cov
        ));
    }
    for l in lines {
        eprintln!("{l}");
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

#[cfg(test)]
mod tests {
    use super::FuzzSummary;

    #[test]
    fn summary_reads_libfuzzer_status_lines() {
        let mut s = FuzzSummary::default();
        s.add_line("INFO: Seed: 123");
        s.add_line("#2\tINITED cov: 40 ft: 41 corp: 1/1b exec/s: 0 rss: 30Mb");
        s.add_line("#1024\tpulse  cov: 93 ft: 120 corp: 9/41b lim: 14 exec/s: 512 rss: 31Mb");
        s.add_line("Done 51234 runs in 20 second(s)");
        assert_eq!(s.first_cov, Some(40));
        assert_eq!(s.last_cov, 93);
        assert_eq!(s.execs, 51234);
        assert!(s.guided());
        let mut flat = FuzzSummary::default();
        flat.add_line("#2\tINITED cov: 0 ft: 0 corp: 1/1b");
        flat.add_line("Done 900000 runs in 20 second(s)");
        assert!(!flat.guided(), "no covered edge means no feedback");
    }
}
