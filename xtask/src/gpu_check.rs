//! `cargo xtask gpu-check`: the one command to run on a GPU machine for the `cuda` feature. It
//! builds kvbm-physical's and kvbm-engine's unit-test binaries in release with `--features
//! cuda`, checks that a CUDA driver and device are usable, runs the GPU tests (`cuda::` in the
//! first: allocation, adopted tensors, the G1→G2→G3→G2→G1 round trip, layer-wise onboarding,
//! scattered blocks, `NHD` range copies, the event precondition; `gpu_` in the second: G1 on
//! the device in a tier set, kvbm-tiering's worker over an engine's device caches; all with
//! `KVBM_REQUIRE_GPU=1` so none can silently skip), runs the GPU benchmark (the ignored test
//! `cuda::tests::bench::gpu_bench`), and writes `OUT/gpu-check.json` with both.
//!
//! Without a GPU it fails at once with the reason and writes no JSON: no numbers are made up.
//!
//! ```text
//! cargo xtask gpu-check --out DIR              build here and run (needs cargo and a GPU)
//! cargo xtask gpu-check --bundle DIR           build here only; copy the test binary and this
//!                                              xtask into DIR, to carry to a GPU machine
//!                                              that has no Rust toolchain
//! sh DIR/run.sh OUT                           run a bundle (no cargo needed); it calls
//!                                              DIR/xtask gpu-check --prebuilt DIR --out OUT
//! ```
//!
//! Files written to OUT: `gpu-check.json` (summary), `bench.json` (the benchmark's own output),
//! `gpu-tests.log`, `gpu-bench.log`.

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use serde_json::{Value, json};

/// Name of the test binary inside a bundle.
const BUNDLED_TESTS: &str = "kvbm-physical-cuda-tests";
/// Name of the engine's test binary inside a bundle (its `gpu_` tests: G1 on the device in a
/// tier set, kvbm-tiering's worker over an engine's device caches).
const BUNDLED_ENGINE_TESTS: &str = "kvbm-engine-cuda-tests";
/// Limits for the two runs (the whole check should stay well under 6 minutes).
const TESTS_TIMEOUT: Duration = Duration::from_secs(150);
const BENCH_TIMEOUT: Duration = Duration::from_secs(150);

const USAGE: &str =
    "usage: cargo xtask gpu-check (--out DIR | --bundle DIR | --prebuilt DIR --out DIR)";

pub(crate) fn run(args: &[String]) -> Result<()> {
    let mut out = None;
    let mut bundle = None;
    let mut prebuilt = None;
    let mut it = args.iter();
    while let Some(a) = it.next() {
        let mut val = || {
            it.next()
                .map(PathBuf::from)
                .with_context(|| format!("{a} needs a directory\n{USAGE}"))
        };
        match a.as_str() {
            "--out" => out = Some(val()?),
            "--bundle" => bundle = Some(val()?),
            "--prebuilt" => prebuilt = Some(val()?),
            other => bail!("unknown argument `{other}`\n{USAGE}"),
        }
    }
    let started = Instant::now();
    if let Some(dir) = bundle {
        let exe = build()?;
        let engine = build_engine()?;
        return make_bundle(&exe, &engine, &dir);
    }
    let Some(out) = out else { bail!("{USAGE}") };
    let out = absolute(&out)?;
    std::fs::create_dir_all(&out).with_context(|| format!("creating {}", out.display()))?;
    // KVBM_GPU_CHECK_NO_PRECHECK=1 goes on to the test binary's own probe (used to test this
    // command's failure path on a machine without a GPU).
    let precheck = std::env::var_os("KVBM_GPU_CHECK_NO_PRECHECK").is_none();
    if let Some(reason) = no_driver_reason().filter(|_| precheck) {
        bail!(
            "gpu-check: no GPU here ({reason}). Nothing was built or measured and no JSON was \
             written. Run this on a machine with an NVIDIA driver (see crates/kvbm-physical/src/cuda/mod.rs)."
        );
    }
    let (exe, engine_exe, build_s) = match prebuilt {
        Some(dir) => {
            let dir = absolute(&dir)?;
            (
                dir.join(BUNDLED_TESTS),
                dir.join(BUNDLED_ENGINE_TESTS),
                None,
            )
        }
        None => {
            let t = Instant::now();
            let exe = build()?;
            let engine = build_engine()?;
            (exe, engine, Some(t.elapsed().as_secs_f64()))
        }
    };
    for e in [&exe, &engine_exe] {
        if !e.is_file() {
            bail!("test binary {} not found", e.display());
        }
    }
    // Probe: one GPU test that must not skip.
    let probe = run_capture(
        Command::new(&exe)
            .args(["cuda::tests::gpu_allocation", "--exact", "--nocapture"])
            .env("KVBM_REQUIRE_GPU", "1"),
        Duration::from_secs(60),
    )?;
    if !probe.ok {
        let reason = probe
            .text
            .lines()
            .find(|l| l.contains("KVBM_REQUIRE_GPU is set but"))
            .unwrap_or("the allocation probe failed (see below)");
        bail!("gpu-check: CUDA is not usable: {reason}\nNo JSON was written (probe output above).");
    }

    eprintln!("gpu-check: running the GPU tests");
    let tests = run_capture(
        Command::new(&exe)
            .args(["cuda::", "--test-threads=1", "--show-output"])
            .env("KVBM_REQUIRE_GPU", "1")
            .env("RUST_BACKTRACE", "1"),
        TESTS_TIMEOUT,
    )?;
    eprintln!("gpu-check: running the engine's GPU tests");
    let engine_tests = run_capture(
        Command::new(&engine_exe)
            .args(["gpu_", "--test-threads=1", "--show-output"])
            .env("KVBM_REQUIRE_GPU", "1")
            .env("RUST_BACKTRACE", "1"),
        TESTS_TIMEOUT,
    )?;
    std::fs::write(
        out.join("gpu-tests.log"),
        format!("{}\n{}", tests.text, engine_tests.text),
    )?;
    let mut results = serde_json::Map::new();
    for (prefix, text) in [("", &tests.text), ("engine::", &engine_tests.text)] {
        for line in text.lines() {
            if let Some(rest) = line.strip_prefix("test ")
                && let Some((name, verdict)) = rest.split_once(" ... ")
            {
                results.insert(
                    format!("{prefix}{name}"),
                    Value::String(verdict.trim().to_string()),
                );
            }
        }
    }
    let failed = results.values().filter(|v| *v != "ok").count();
    let tests_ok = tests.ok && engine_tests.ok && failed == 0 && !results.is_empty();

    eprintln!("gpu-check: running the GPU benchmark");
    let bench_path = out.join("bench.json");
    let _ = std::fs::remove_file(&bench_path);
    let bench = run_capture(
        Command::new(&exe)
            .args([
                "cuda::tests::bench::gpu_bench",
                "--exact",
                "--ignored",
                "--nocapture",
            ])
            .env("KVBM_REQUIRE_GPU", "1")
            .env("KVBM_GPU_BENCH_OUT", &bench_path),
        BENCH_TIMEOUT,
    )?;
    std::fs::write(out.join("gpu-bench.log"), &bench.text)?;
    let bench_json: Option<Value> = if bench.ok {
        std::fs::read_to_string(&bench_path)
            .ok()
            .and_then(|s| serde_json::from_str(&s).ok())
    } else {
        None
    };
    let goal = |k: &str| bench_json.as_ref().and_then(|b| b.get(k)).cloned();
    let summary = json!({
        "status": if tests_ok && bench_json.is_some() { "pass" } else { "fail" },
        "tests_ok": tests_ok,
        "tests_run": results.len(),
        "tests_failed": failed,
        "tests_timed_out": tests.timed_out || engine_tests.timed_out,
        "tests": Value::Object(results),
        "bench_ok": bench_json.is_some(),
        "bench_timed_out": bench.timed_out,
        "bench": bench_json.clone().unwrap_or(Value::Null),
        "goals": {
            "blocks_2mib_ratio_ge_0_9": goal("goal_2mib_ratio_ge_0_9"),
            "offload_64_block_overhead_lt_50us": goal("goal_overhead_lt_50us"),
            "pieces_64kib_batched_h2d_ratio": goal("pieces_64kib_batched_h2d_ratio"),
            "pieces_64kib_batched_d2h_ratio": goal("pieces_64kib_batched_d2h_ratio"),
            "nhd_fragments_h2d_ratio": goal("nhd_fragments_h2d_ratio"),
            "nhd_fragments_d2h_ratio": goal("nhd_fragments_d2h_ratio"),
        },
        "build_seconds": build_s,
        "total_seconds": started.elapsed().as_secs_f64(),
        "test_binary": exe.display().to_string(),
        "engine_test_binary": engine_exe.display().to_string(),
    });
    let path = out.join("gpu-check.json");
    std::fs::write(&path, serde_json::to_string_pretty(&summary)? + "\n")?;
    eprintln!("gpu-check: wrote {}", path.display());
    println!("{}", serde_json::to_string_pretty(&summary)?);
    if !tests_ok {
        bail!(
            "gpu-check: GPU tests failed (see {}/gpu-tests.log)",
            out.display()
        );
    }
    if bench_json.is_none() {
        bail!(
            "gpu-check: the benchmark failed (see {}/gpu-bench.log)",
            out.display()
        );
    }
    Ok(())
}

fn absolute(p: &Path) -> Result<PathBuf> {
    Ok(if p.is_absolute() {
        p.to_path_buf()
    } else {
        std::env::current_dir()?.join(p)
    })
}

/// Why no CUDA driver can be loaded here, or `None` when `libcuda.so` is found (the test
/// binary's probe is the authoritative check).
fn no_driver_reason() -> Option<String> {
    let names = ["libcuda.so.1", "libcuda.so"];
    let mut dirs: Vec<PathBuf> = std::env::var_os("LD_LIBRARY_PATH")
        .map(|p| std::env::split_paths(&p).collect())
        .unwrap_or_default();
    dirs.extend(
        [
            "/usr/lib/x86_64-linux-gnu",
            "/usr/lib64",
            "/usr/lib",
            "/usr/local/nvidia/lib64",
            "/usr/local/nvidia/lib",
            "/usr/local/cuda/lib64",
            "/usr/local/cuda/compat",
            "/usr/lib/wsl/lib",
        ]
        .map(PathBuf::from),
    );
    if dirs
        .iter()
        .any(|d| names.iter().any(|n| d.join(n).exists()))
    {
        return None;
    }
    if let Ok(o) = Command::new("ldconfig").arg("-p").output()
        && String::from_utf8_lossy(&o.stdout).contains("libcuda.so")
    {
        return None;
    }
    Some(
        "libcuda.so not found in LD_LIBRARY_PATH, the usual driver folders or `ldconfig -p`".into(),
    )
}

/// Builds the release unit-test binary of kvbm-physical with `--features cuda`; returns its path.
fn build() -> Result<PathBuf> {
    build_tests("kvbm-physical")
}

/// The same for kvbm-engine (its `gpu_` tests).
fn build_engine() -> Result<PathBuf> {
    build_tests("kvbm-engine")
}

/// Builds `package`'s release unit-test binary with `--features cuda`; returns its path.
fn build_tests(package: &str) -> Result<PathBuf> {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let built = crate::cargo_artifacts(
        &mut Command::new(cargo),
        &[
            "test",
            "-p",
            package,
            "--features",
            "cuda",
            "--release",
            "--lib",
            "--no-run",
        ],
    )
    .with_context(|| format!("building {package}'s tests with --features cuda"))?;
    let target = package.replace('-', "_");
    for v in built {
        if v["target"]["name"] == target.as_str()
            && v["profile"]["test"] == true
            && let Some(exe) = v["executable"].as_str()
        {
            return Ok(PathBuf::from(exe));
        }
    }
    bail!("cargo built no test executable for {target}")
}

/// Copies the test binaries and this xtask into `dir` (stripped of debug info when `strip` is
/// available) with a README saying how to run them.
fn make_bundle(exe: &Path, engine: &Path, dir: &Path) -> Result<()> {
    std::fs::create_dir_all(dir)?;
    let me = std::env::current_exe().context("locating the xtask binary")?;
    for (from, name) in [
        (exe, BUNDLED_TESTS),
        (engine, BUNDLED_ENGINE_TESTS),
        (me.as_path(), "xtask"),
    ] {
        let to = dir.join(name);
        std::fs::copy(from, &to).with_context(|| format!("copying {}", from.display()))?;
        let _ = Command::new("strip").arg("--strip-debug").arg(&to).status();
    }
    // The bundled xtask changes to the workspace root it was built in before dispatching;
    // where that path does not exist (the GPU machine's copy of the tree lives elsewhere),
    // run.sh points it at the bundle.
    let root = crate::project_root();
    let script = format!(
        "#!/bin/sh\n\
         # Runs gpu-check from this bundle: ./run.sh OUT_DIR\n\
         set -e\n\
         here=$(cd \"$(dirname \"$0\")\" && pwd)\n\
         root='{}'\n\
         [ -d \"$root\" ] || {{ mkdir -p \"$(dirname \"$root\")\" && ln -s \"$here\" \"$root\"; }}\n\
         exec \"$here/xtask\" gpu-check --prebuilt \"$here\" --out \"${{1:?usage: run.sh OUT_DIR}}\"\n",
        root.display()
    );
    let run_sh = dir.join("run.sh");
    std::fs::write(&run_sh, script)?;
    let _ = Command::new("chmod").arg("+x").arg(&run_sh).status();
    let readme = format!(
        "Bundle for `gpu-check` (kvbm-physical and kvbm-engine, feature cuda), built from {}.\n\
         On the GPU machine, from the repository root (the round-trip test writes a temp file):\n\
         \n    sh {}/run.sh \"$OUT\"\n",
        exe.display(),
        dir.display()
    );
    std::fs::write(dir.join("README.txt"), readme)?;
    let mut total = 0;
    for e in std::fs::read_dir(dir)? {
        total += e?.metadata()?.len();
    }
    eprintln!(
        "gpu-check: bundle in {} ({:.1} MiB). Run there, from the repository root: sh {}/run.sh OUT_DIR",
        dir.display(),
        total as f64 / (1 << 20) as f64,
        dir.display()
    );
    Ok(())
}

struct Captured {
    ok: bool,
    timed_out: bool,
    text: String,
}

/// Runs `cmd` with stdout and stderr captured together (echoed afterwards), killed after
/// `limit`.
fn run_capture(cmd: &mut Command, limit: Duration) -> Result<Captured> {
    let shown = format!("{cmd:?}").replace('"', "");
    eprintln!("\n$ {shown}");
    let log = tempfile_path();
    let file = std::fs::File::create(&log)?;
    let mut child = cmd
        .stdout(file.try_clone()?)
        .stderr(file)
        .spawn()
        .with_context(|| format!("starting `{shown}`"))?;
    let t = Instant::now();
    let (status, timed_out) = loop {
        if let Some(s) = child.try_wait()? {
            break (Some(s), false);
        }
        if t.elapsed() > limit {
            let _ = child.kill();
            let _ = child.wait();
            break (None, true);
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    let mut text = String::new();
    std::fs::File::open(&log)?.read_to_string(&mut text)?;
    let _ = std::fs::remove_file(&log);
    if timed_out {
        text.push_str(&format!("\n[gpu-check: killed after {limit:?}]\n"));
    }
    eprint!("{text}");
    Ok(Captured {
        ok: status.is_some_and(|s| s.success()),
        timed_out,
        text,
    })
}

fn tempfile_path() -> PathBuf {
    static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    std::env::temp_dir().join(format!("kvbm-gpu-check-{}-{n}.log", std::process::id()))
}
