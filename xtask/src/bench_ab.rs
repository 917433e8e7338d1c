//! `cargo xtask bench tiering --against REV [--runs N] [-- ARGS]`: the tiering bench of the
//! working tree and of revision `REV`, run alternately on the same machine in the same minutes;
//! `cargo xtask bench vllm --against REV ...` the same for the scheduler step driven from Python
//! (`crates/kvbm-vllm/benches/tiering_step.py`, vLLM's manager beside kvbm's).
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
//!
//! The Python bench is the working tree's script for both sides, run by `target/pyvenv`'s
//! interpreter (`cargo xtask python` makes it, with vLLM's sources) with each side's
//! `kvbm_vllm` first on `PYTHONPATH`: that revision's Python package beside its extension
//! module built in release (`target/ab/py-{base,head}`). Its figures: per scenario and manager
//! the median wall and CPU time, vLLM's time over each kvbm manager's, and (with `--phases`)
//! each kvbm manager's time above the floor per phase.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, bail};
use serde_json::Value;

/// Which bench is compared.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum Bench {
    /// kvbm-tiering's `tiering` bench (Rust).
    Tiering,
    /// `crates/kvbm-vllm/benches/tiering_step.py` (Python, vLLM's manager beside kvbm's).
    Vllm,
}

/// What `--against` asks for.
pub(crate) struct Ab {
    /// The bench compared.
    pub bench: Bench,
    /// The base revision.
    pub rev: String,
    /// Runs of each build (alternating).
    pub runs: usize,
    /// Arguments passed to each run of the bench binary.
    pub bench_args: Vec<String>,
}

impl Ab {
    /// `NAME --against REV [--runs N] [-- ARGS...]` out of `args` (`NAME`: `tiering` or
    /// `vllm`), or `None` without `--against`.
    pub(crate) fn parse(args: &[String]) -> Result<Option<Ab>> {
        let Some(i) = args.iter().position(|a| a == "--against") else {
            return Ok(None);
        };
        let bench = match args.first().map(String::as_str) {
            Some("tiering" | "kvbm-tiering") => Bench::Tiering,
            Some("vllm" | "kvbm-vllm") => Bench::Vllm,
            other => bail!(
                "--against compares `tiering` (the Rust bench) or `vllm` (the step from \
                 Python), not {}: `cargo xtask bench tiering --against REV`",
                other.map_or("nothing".to_string(), |o| format!("`{o}`"))
            ),
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
            bench,
            rev,
            runs,
            bench_args,
        }))
    }
}

/// `cargo` in `dir`, its target `target_dir` when given.
fn cargo_in(dir: &Path, target_dir: Option<&Path>) -> Command {
    let mut cmd = Command::new("cargo");
    cmd.current_dir(dir);
    if let Some(t) = target_dir {
        cmd.env("CARGO_TARGET_DIR", t);
    }
    cmd
}

/// Builds the `tiering` bench of kvbm-tiering in `dir` (target `target_dir` when given); its
/// executable.
fn build(dir: &Path, target_dir: Option<&Path>) -> Result<PathBuf> {
    crate::cargo_artifacts(
        &mut cargo_in(dir, target_dir),
        &[
            "bench",
            "-p",
            "kvbm-tiering",
            "--bench",
            "tiering",
            "--no-run",
        ],
    )
    .with_context(|| format!("building the tiering bench in {}", dir.display()))?
    .into_iter()
    .filter(|v| v["target"]["name"] == "tiering")
    .find_map(|v| v["executable"].as_str().map(PathBuf::from))
    .with_context(|| {
        format!(
            "cargo named no tiering bench executable in {}",
            dir.display()
        )
    })
}

/// Builds kvbm-vllm's extension module in release in `dir` (target `target_dir` when given)
/// and lays it out with that tree's Python package as `out/kvbm_vllm` (made afresh); `out`.
fn python_package(dir: &Path, target_dir: Option<&Path>, out: &Path) -> Result<PathBuf> {
    let so = crate::cargo_artifacts(
        &mut cargo_in(dir, target_dir),
        &["build", "--release", "-p", "kvbm-vllm", "--lib"],
    )
    .with_context(|| format!("building kvbm-vllm in {}", dir.display()))?
    .into_iter()
    .filter(|v| v["target"]["name"] == "kvbm_vllm")
    .flat_map(|v| {
        v["filenames"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|f| f.as_str().map(PathBuf::from))
            .collect::<Vec<_>>()
    })
    .find(|f| f.extension().is_some_and(|e| e == "so"))
    .with_context(|| {
        format!(
            "cargo named no kvbm_vllm extension module in {}",
            dir.display()
        )
    })?;
    let pkg = out.join("kvbm_vllm");
    let _ = std::fs::remove_dir_all(out);
    std::fs::create_dir_all(&pkg)?;
    let src = dir.join("crates/kvbm-vllm/python/kvbm_vllm");
    for e in std::fs::read_dir(&src).with_context(|| format!("reading {}", src.display()))? {
        let e = e?;
        if e.path().extension().is_some_and(|x| x == "py") {
            std::fs::copy(e.path(), pkg.join(e.file_name()))?;
        }
    }
    std::fs::copy(&so, pkg.join("_kvbm.abi3.so"))
        .with_context(|| format!("copying {}", so.display()))?;
    Ok(std::fs::canonicalize(out)?)
}

/// One run of the Python bench with `package` first on `PYTHONPATH`: its JSON.
fn run_python(package: &Path, args: &[String]) -> Result<Value> {
    let python = Path::new("target/pyvenv/bin/python");
    if !python.exists() {
        bail!(
            "target/pyvenv/bin/python is missing: `cargo xtask python` makes it (with vLLM's \
             sources, which the bench loads)"
        );
    }
    let out = std::fs::canonicalize("target/ab")?.join("vllm-bench.json");
    let _ = std::fs::remove_file(&out);
    let status = Command::new(python)
        .arg("crates/kvbm-vllm/benches/tiering_step.py")
        .args(args)
        .arg("--json")
        .arg(&out)
        .env("PYTHONPATH", package)
        .stdout(std::process::Stdio::null())
        .status()
        .context("running crates/kvbm-vllm/benches/tiering_step.py")?;
    if !status.success() {
        bail!("crates/kvbm-vllm/benches/tiering_step.py failed ({status})");
    }
    let text = std::fs::read_to_string(&out)
        .with_context(|| format!("the Python bench wrote no {}", out.display()))?;
    serde_json::from_str(&text).with_context(|| format!("{} is no JSON", out.display()))
}

/// The Python bench's figures by name: per scenario, each manager's wall and CPU time, vLLM's
/// CPU time over each other manager's, and each kvbm manager's time above the floor by phase.
fn python_figures(v: &Value) -> Vec<(String, f64)> {
    let mut f = Vec::new();
    for (scenario, r) in v.as_object().into_iter().flatten() {
        for what in ["wall_ms", "cpu_ms"] {
            for (kind, x) in r[what].as_object().into_iter().flatten() {
                if let Some(x) = x.as_f64() {
                    f.push((format!("{scenario}.{what}.{kind}"), x));
                }
            }
        }
        if let Some(vllm) = r["cpu_ms"]["vllm"].as_f64() {
            for (kind, x) in r["cpu_ms"].as_object().into_iter().flatten() {
                if let Some(x) = x.as_f64()
                    && kind != "vllm"
                    && x > 0.0
                {
                    f.push((format!("{scenario}.vllm_over.{kind}"), vllm / x));
                }
            }
        }
        for (kind, phases) in r["above_floor_ms"].as_object().into_iter().flatten() {
            for (p, x) in phases.as_object().into_iter().flatten() {
                if let Some(x) = x.as_f64() {
                    f.push((format!("{scenario}.above_floor.{kind}.{p}"), x));
                }
            }
        }
    }
    f
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

/// The figures of a run, by name.
type Figures = Vec<(String, f64)>;

/// One run of one side.
type Side = dyn Fn() -> Result<Figures>;

/// Runs the comparison and prints it.
pub(crate) fn run(ab: &Ab) -> Result<()> {
    let base_dir = worktree(&ab.rev)?;
    let base_target = base_dir.join("../target");
    eprintln!("building the base ({}) in {}", ab.rev, base_dir.display());
    // Each side: what one run of it is.
    let sides: [Box<Side>; 2] = match ab.bench {
        Bench::Tiering => {
            let base = build(&base_dir, Some(&base_target))?;
            eprintln!("building the working tree");
            let head = build(Path::new("."), None)?;
            let args = ab.bench_args.clone();
            let args2 = args.clone();
            [
                Box::new(move || Ok(figures(&run_once(&base, &args)?))),
                Box::new(move || Ok(figures(&run_once(&head, &args2)?))),
            ]
        }
        Bench::Vllm => {
            let base = python_package(
                &base_dir,
                Some(&base_target),
                Path::new("target/ab/py-base"),
            )?;
            eprintln!("building the working tree");
            let head = python_package(Path::new("."), None, Path::new("target/ab/py-head"))?;
            let args = ab.bench_args.clone();
            let args2 = args.clone();
            [
                Box::new(move || Ok(python_figures(&run_python(&base, &args)?))),
                Box::new(move || Ok(python_figures(&run_python(&head, &args2)?))),
            ]
        }
    };
    let mut runs: [Vec<Vec<(String, f64)>>; 2] = [Vec::new(), Vec::new()];
    for r in 0..ab.runs {
        let order = if r % 2 == 0 { [0, 1] } else { [1, 0] };
        for side in order {
            eprintln!("run {} of {}: {}", r + 1, ab.runs, ["base", "head"][side]);
            runs[side].push(sides[side]()?);
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
        "{:52} {:>10} {:>10} {:>9}   (median of {} alternating runs; base {})",
        "figure", "base", "head", "head/base", ab.runs, ab.rev
    );
    for n in &names {
        let (b, h) = (med(0, n), med(1, n));
        let cell = |x: Option<f64>| x.map_or("-".to_string(), |x| format!("{x:.1}"));
        let ratio = match (b, h) {
            (Some(b), Some(h)) if b > 0.0 => format!("{:.3}", h / b),
            _ => "-".into(),
        };
        println!("{n:52} {:>10} {:>10} {ratio:>9}", cell(b), cell(h));
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
        assert_eq!(ab.bench, Bench::Tiering);
        assert_eq!(ab.rev, "HEAD~1");
        assert_eq!(ab.runs, 5);
        assert_eq!(ab.bench_args, vec!["--steps-only".to_string()]);
        let vllm = Ab::parse(&args("vllm --against main")).unwrap().unwrap();
        assert_eq!((vllm.bench, vllm.runs), (Bench::Vllm, 3));
        assert!(Ab::parse(&args("logical --against main")).is_err());
        assert!(Ab::parse(&args("tiering --against")).is_err());
        assert!(Ab::parse(&args("tiering --against main --runs 0")).is_err());
    }

    #[test]
    fn python_figures_name_each_manager_and_phase() {
        let v: Value = serde_json::from_str(
            r#"{"warm": {"wall_ms": {"vllm": 100.0, "floor": 2.0, "kvbm+disk": 5.0},
                         "cpu_ms": {"vllm": 110.0, "floor": 2.0, "kvbm+disk": 5.5},
                         "above_floor_ms": {"kvbm+disk": {"lookup": 2.0, "total": 3.5}}}}"#,
        )
        .unwrap();
        let f = python_figures(&v);
        let get = |n: &str| f.iter().find(|(k, _)| k == n).map(|(_, x)| *x);
        assert_eq!(get("warm.wall_ms.kvbm+disk"), Some(5.0));
        assert_eq!(get("warm.cpu_ms.vllm"), Some(110.0));
        assert_eq!(get("warm.vllm_over.kvbm+disk"), Some(20.0));
        assert_eq!(get("warm.vllm_over.floor"), Some(55.0));
        assert_eq!(get("warm.vllm_over.vllm"), None);
        assert_eq!(get("warm.above_floor.kvbm+disk.lookup"), Some(2.0));
        assert_eq!(get("warm.above_floor.kvbm+disk.total"), Some(3.5));
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
