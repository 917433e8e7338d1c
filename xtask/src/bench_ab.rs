//! `cargo xtask bench tiering --against REV [--runs N] [-- ARGS]`: the tiering bench of the
//! working tree and of revision `REV`, run alternately on the same machine in the same minutes.
//!
//! # Why alternate
//!
//! This machine is shared: a figure measured at ten o'clock and another at eleven differ by
//! more than most changes move them. So a change's effect is the ratio of two builds measured
//! in turns (`base, head`, then `head, base`, ...), each figure the median over its runs.
//!
//! ```text
//!  git worktree target/ab/<REV> ─► cargo bench --no-run (CARGO_TARGET_DIR=target/ab/target)
//!  working tree                 ─► cargo bench --no-run                  ─┐
//!  for run in 0..N: base then head, or head then base (JSON each)       ◄─┘
//!  per figure: median(base), median(head), head / base
//! ```
//!
//! The base is built with its own bench source (what it measured then); the figures compared
//! are the ones both print: lookup and store rates and each step scenario's CPU time and
//! phases. A figure only one side prints (a phase added since) is shown for that side alone.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, bail};
use serde_json::Value;

/// What `--against` asks for.
pub(crate) struct Ab {
    /// The base revision.
    pub rev: String,
    /// Runs of each build (alternating).
    pub runs: usize,
    /// Arguments passed to each run of the bench binary.
    pub bench_args: Vec<String>,
}

impl Ab {
    /// `--against REV [--runs N] [-- ARGS...]` out of `args`, or `None` without `--against`.
    pub(crate) fn parse(args: &[String]) -> Result<Option<Ab>> {
        let Some(i) = args.iter().position(|a| a == "--against") else {
            return Ok(None);
        };
        let rev = args
            .get(i + 1)
            .context("--against needs a revision (a commit, tag or branch)")?
            .clone();
        let runs = match args.iter().position(|a| a == "--runs") {
            None => 3,
            Some(j) => {
                let v = args.get(j + 1).context("--runs needs a number")?;
                v.parse::<usize>()
                    .ok()
                    .filter(|&n| n > 0)
                    .with_context(|| format!("--runs {v}: a positive number of runs"))?
            }
        };
        let bench_args = match args.iter().position(|a| a == "--") {
            Some(j) => args[j + 1..].to_vec(),
            None => Vec::new(),
        };
        Ok(Some(Ab {
            rev,
            runs,
            bench_args,
        }))
    }
}

/// Builds the `tiering` bench of kvbm-tiering in `dir` (target `target_dir` when given); its
/// executable.
fn build(dir: &Path, target_dir: Option<&Path>) -> Result<PathBuf> {
    let mut cmd = Command::new("cargo");
    cmd.current_dir(dir).args([
        "bench",
        "-p",
        "kvbm-tiering",
        "--bench",
        "tiering",
        "--no-run",
        "--message-format=json",
    ]);
    if let Some(t) = target_dir {
        cmd.env("CARGO_TARGET_DIR", t);
    }
    let out = cmd
        .output()
        .with_context(|| format!("building the tiering bench in {}", dir.display()))?;
    if !out.status.success() {
        bail!(
            "building the tiering bench in {} failed:\n{}",
            dir.display(),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter(|v| v["target"]["name"] == "tiering")
        .find_map(|v| v["executable"].as_str().map(PathBuf::from))
        .with_context(|| {
            format!(
                "cargo named no tiering bench executable in {}",
                dir.display()
            )
        })
}

/// A worktree of `rev` under `target/ab/` (made once; checked out at `rev` each time).
fn worktree(rev: &str) -> Result<PathBuf> {
    let commit = git(&["rev-parse", "--verify", &format!("{rev}^{{commit}}")])
        .with_context(|| format!("`{rev}` is no commit of this repository"))?;
    let dir = PathBuf::from("target/ab/base");
    if !dir.join(".git").exists() {
        std::fs::create_dir_all("target/ab")?;
        git(&["worktree", "add", "--detach", "target/ab/base", &commit])?;
    } else {
        let out = Command::new("git")
            .current_dir(&dir)
            .args(["checkout", "--detach", "--quiet", &commit])
            .status()?;
        if !out.success() {
            bail!("checking out {commit} in {}", dir.display());
        }
    }
    Ok(std::fs::canonicalize(dir)?)
}

fn git(args: &[&str]) -> Result<String> {
    let out = Command::new("git").args(args).output()?;
    if !out.status.success() {
        bail!(
            "git {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).trim().to_string())
}

/// One run of `exe`: its JSON.
fn run_once(exe: &Path, args: &[String]) -> Result<Value> {
    let out = Command::new(exe)
        .args(args)
        .output()
        .with_context(|| format!("running {}", exe.display()))?;
    if !out.status.success() {
        bail!(
            "{} failed:\n{}",
            exe.display(),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    serde_json::from_slice(&out.stdout)
        .with_context(|| format!("{} printed no JSON", exe.display()))
}

/// The figures of one run, by name: `lookup_mps.*`, `store_complete_kps.*`, and per step
/// scenario its CPU time and each phase's time.
fn figures(v: &Value) -> Vec<(String, f64)> {
    let mut f = Vec::new();
    for group in ["lookup_mps", "store_complete_kps"] {
        if let Some(m) = v[group].as_object() {
            for (k, x) in m {
                if let Some(x) = x.as_f64()
                    && k != "goal"
                    && !k.starts_with("ratio")
                {
                    f.push((format!("{group}.{k}"), x));
                }
            }
        }
    }
    // `step`: over the in-memory tier; `step_own`: over a tier that answers without a set.
    for group in ["step", "step_own"] {
        for s in v[group].as_array().into_iter().flatten() {
            let name = s["scenario"].as_str().unwrap_or("?");
            if let Some(x) = s["cpu_us_per_step"].as_f64() {
                f.push((format!("{group}.{name}.cpu_us"), x));
            }
            for (p, x) in s["phases_us_share"].as_object().into_iter().flatten() {
                // `[us, share]` (or a bare number in older benches).
                if let Some(x) = x.get(0).and_then(Value::as_f64).or(x.as_f64()) {
                    f.push((format!("{group}.{name}.{p}_us"), x));
                }
            }
        }
    }
    f
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Runs the comparison and prints it.
pub(crate) fn run(ab: &Ab) -> Result<()> {
    let base_dir = worktree(&ab.rev)?;
    eprintln!("building the base ({}) in {}", ab.rev, base_dir.display());
    let base = build(&base_dir, Some(&base_dir.join("../target")))?;
    eprintln!("building the working tree");
    let head = build(Path::new("."), None)?;
    let mut runs: [Vec<Vec<(String, f64)>>; 2] = [Vec::new(), Vec::new()];
    for r in 0..ab.runs {
        let order = if r % 2 == 0 { [0, 1] } else { [1, 0] };
        for side in order {
            let exe = if side == 0 { &base } else { &head };
            eprintln!("run {} of {}: {}", r + 1, ab.runs, ["base", "head"][side]);
            runs[side].push(figures(&run_once(exe, &ab.bench_args)?));
        }
    }
    // Every figure either side printed, in the head's order, then the base's own.
    let mut names: Vec<String> = Vec::new();
    for side in [1, 0] {
        for (n, _) in &runs[side][0] {
            if !names.contains(n) {
                names.push(n.clone());
            }
        }
    }
    let med = |side: usize, name: &str| -> Option<f64> {
        let v: Vec<f64> = runs[side]
            .iter()
            .filter_map(|r| r.iter().find(|(n, _)| n == name).map(|(_, x)| *x))
            .collect();
        (!v.is_empty()).then(|| median(v))
    };
    println!(
        "{:44} {:>12} {:>12} {:>8}   (median of {} alternating runs; base {})",
        "figure", "base", "head", "head/base", ab.runs, ab.rev
    );
    for n in &names {
        let (b, h) = (med(0, n), med(1, n));
        let cell = |x: Option<f64>| x.map_or("-".to_string(), |x| format!("{x:.1}"));
        let ratio = match (b, h) {
            (Some(b), Some(h)) if b > 0.0 => format!("{:.3}", h / b),
            _ => "-".into(),
        };
        println!("{n:44} {:>12} {:>12} {ratio:>8}", cell(b), cell(h));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(s: &str) -> Vec<String> {
        s.split_whitespace().map(String::from).collect()
    }

    #[test]
    fn parses_against_runs_and_bench_arguments() {
        assert!(Ab::parse(&args("tiering")).unwrap().is_none());
        let ab = Ab::parse(&args("tiering --against HEAD~1 --runs 5 -- --steps-only"))
            .unwrap()
            .unwrap();
        assert_eq!(ab.rev, "HEAD~1");
        assert_eq!(ab.runs, 5);
        assert_eq!(ab.bench_args, vec!["--steps-only".to_string()]);
        assert_eq!(
            Ab::parse(&args("x --against main")).unwrap().unwrap().runs,
            3
        );
        assert!(Ab::parse(&args("x --against")).is_err());
        assert!(Ab::parse(&args("x --against main --runs 0")).is_err());
    }

    #[test]
    fn figures_read_both_phase_shapes() {
        let v: Value = serde_json::from_str(
            r#"{"lookup_mps": {"cpu_manager": 90.0, "goal": 30.0, "ratio_cpu_to_raw": 0.5},
                "store_complete_kps": {"cpu_manager": 2000.0},
                "step": [{"scenario": "cold", "cpu_us_per_step": 3000.0,
                          "phases_us_share": {"lookup": [900.0, 0.3], "store": 2000.0}}],
                "step_own": [{"scenario": "cold", "cpu_us_per_step": 2000.0}]}"#,
        )
        .unwrap();
        let f = figures(&v);
        let get = |n: &str| f.iter().find(|(k, _)| k == n).map(|(_, x)| *x);
        assert_eq!(get("lookup_mps.cpu_manager"), Some(90.0));
        assert_eq!(get("lookup_mps.goal"), None);
        assert_eq!(get("lookup_mps.ratio_cpu_to_raw"), None);
        assert_eq!(get("store_complete_kps.cpu_manager"), Some(2000.0));
        assert_eq!(get("step.cold.cpu_us"), Some(3000.0));
        assert_eq!(get("step.cold.lookup_us"), Some(900.0));
        assert_eq!(get("step.cold.store_us"), Some(2000.0));
        assert_eq!(get("step_own.cold.cpu_us"), Some(2000.0));
    }
}
