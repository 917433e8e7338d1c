//! `cargo xtask python`: builds the kvbm-vllm wheel and runs vLLM's own tests against it.
//!
//! ```text
//!   maturin and zig (pip-installed when missing) ─► wheel (release, abi3, manylinux_2_28,
//!     stripped) ─► pip install into a fresh venv (target/pyvenv-fresh): it must load there
//!     ─► venv target/pyvenv
//!     ─► for each supported vLLM (0.33.0, 0.34.0): its kv_offload tests with vLLM's classes
//!        (all must pass: proves the harness), then with kvbm's classes substituted (expected
//!        failures listed with reasons)
//!     ─► kvbm-vllm's own tests (`tests/python`), under each supported vLLM:
//!        `python -m kvbm_vllm.replay` writes the same
//!        lines as kvbm-tiering's Rust replay example, call for call, through the Python API;
//!        kvbm's disk and object tiers (a real S3 server) under vLLM's own tiering manager;
//!        a fleet of scheduler processes sharing through kvbm_fleet (a real NATS server,
//!        credentials from the `kvbm` command this step builds)
//! ```
//!
//! The venv holds only the wheel (installed without dependencies); the harness pip-installs its
//! pinned test dependencies (pytest, numpy, …) into `target/peer/vllm-sdist/pydeps` and fetches
//! vLLM's source distribution pinned by sha256 (`crates/kvbm-vllm/tests/upstream`). A step that
//! fails stops the gate with its command named.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, bail};

use crate::services::Services;
use crate::{project_root, run_step};

/// The classes kvbm substitutes in vLLM's tests (every manager class they construct); the
/// harness runs every test file it pins for the version.
const KVBM_CLASSES: &str =
    "CPUOffloadingManager,CPUPrimaryTierOffloadingManager,TieringOffloadingManager";
/// The vLLM releases kvbm supports (the current and the previous minor), whose tests run.
const VLLM_VERSIONS: [&str; 2] = ["0.33.0", "0.34.0"];

fn python() -> String {
    std::env::var("PYTHON").unwrap_or_else(|_| "python3".into())
}

/// Installs maturin and zig (`ziglang`, the linker that targets an older glibc) with pip
/// unless `python -m maturin` / `python -m ziglang` already work.
fn ensure_maturin(py: &str) -> Result<()> {
    let has = |module: &str, arg: &str| {
        Command::new(py)
            .args(["-m", module, arg])
            .output()
            .map(|o| o.status.success())
            .unwrap_or(false)
    };
    if !has("maturin", "--version") {
        run_step(Command::new(py).args(["-m", "pip", "install", "-q", "maturin>=1.9,<2"]))
            .context("installing maturin (the wheel builder) with pip")?;
    }
    if !has("ziglang", "version") {
        run_step(Command::new(py).args(["-m", "pip", "install", "-q", "ziglang>=0.13,<0.15"]))
            .context("installing zig (ziglang, the wheel's manylinux_2_28 linker) with pip")?;
    }
    Ok(())
}

/// The wheel operators install: release, abi3, linked against glibc 2.28 through zig (vLLM's
/// own wheels are manylinux_2_28, so wherever vLLM installs, this does) and stripped.
const WHEEL_ARGS: [&str; 6] = [
    "build",
    "--release",
    "--zig",
    "--compatibility",
    "manylinux_2_28",
    "--strip",
];

/// The venv's interpreter, creating the venv when it is missing.
fn venv(py: &str, root: &Path) -> Result<PathBuf> {
    let dir = root.join("target/pyvenv");
    let bin = dir.join("bin/python");
    if !bin.exists() {
        run_step(Command::new(py).args(["-m", "venv"]).arg(&dir))
            .context("creating the Python venv target/pyvenv")?;
    }
    Ok(bin)
}

/// The wheel as an operator installs it: `pip install` (its dependencies from the index) into
/// a venv made afresh, then the package, its extension and its plugin entry point load there.
fn fresh_install(py: &str, root: &Path, wheel: &Path) -> Result<()> {
    let name = wheel
        .file_name()
        .and_then(|n| n.to_str())
        .unwrap_or_default();
    if !name.contains("manylinux_2_28") || !name.contains("abi3") {
        bail!("the kvbm-vllm wheel is {name}: expected an abi3 manylinux_2_28 wheel");
    }
    let dir = root.join("target/pyvenv-fresh");
    let _ = std::fs::remove_dir_all(&dir);
    run_step(Command::new(py).args(["-m", "venv"]).arg(&dir))
        .context("creating the fresh venv target/pyvenv-fresh")?;
    let bin = dir.join("bin/python");
    run_step(
        Command::new(&bin)
            .args(["-m", "pip", "install", "-q"])
            .arg(wheel),
    )
    .context("pip install of the kvbm-vllm wheel into a fresh venv")?;
    run_step(Command::new(&bin).args([
        "-c",
        "import importlib.metadata as md, kvbm_vllm, kvbm_vllm._kvbm as ext; \
         eps = [e for e in md.entry_points(group='vllm.general_plugins') if e.name == 'kvbm']; \
         assert eps and eps[0].value == 'kvbm_vllm:register', eps; \
         print('fresh venv: kvbm_vllm', md.version('kvbm-vllm'), 'loads, plugin', eps[0].value)",
    ]))
    .context("loading kvbm_vllm in the fresh venv")
}

/// The newest kvbm-vllm wheel in `dir`.
fn wheel(dir: &Path) -> Result<PathBuf> {
    let mut wheels: Vec<PathBuf> = std::fs::read_dir(dir)
        .with_context(|| format!("reading {}", dir.display()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with("kvbm_vllm-") && n.ends_with(".whl"))
        })
        .collect();
    wheels.sort_by_key(|p| p.metadata().and_then(|m| m.modified()).ok());
    match wheels.pop() {
        Some(w) => Ok(w),
        None => bail!("maturin built no kvbm_vllm wheel into {}", dir.display()),
    }
}

/// `cargo xtask python`: starts the test servers (the object tier's S3 test needs one), runs
/// [`run_with`], stops them whatever the outcome.
pub(crate) fn run() -> Result<()> {
    let services = Services::start_all()?;
    let r = run_with(&services);
    services.stop();
    r
}

/// The whole Python step against servers already started (`cargo xtask ci` reuses its own).
pub(crate) fn run_with(services: &Services) -> Result<()> {
    let root = project_root();
    let py = python();
    ensure_maturin(&py)?;
    let wheels = root.join("target/wheels");
    // Only this build's wheel is found below.
    let _ = std::fs::remove_dir_all(&wheels);
    run_step(
        Command::new(&py)
            .args(["-m", "maturin"])
            .args(WHEEL_ARGS)
            .args(["-i", &py, "-o"])
            .arg(&wheels)
            .current_dir(root.join("crates/kvbm-vllm")),
    )
    .context("building the kvbm-vllm wheel")?;
    fresh_install(&py, &root, &wheel(&wheels)?)?;
    let venv_py = venv(&py, &root)?;
    run_step(
        Command::new(&venv_py)
            .args([
                "-m",
                "pip",
                "install",
                "-q",
                "--force-reinstall",
                "--no-deps",
            ])
            .arg(wheel(&wheels)?),
    )
    .context("installing the kvbm-vllm wheel into target/pyvenv")?;

    let harness = root.join("crates/kvbm-vllm/tests/upstream/run.py");
    let reports = root.join("target/upstream");
    std::fs::create_dir_all(&reports)?;
    for version in VLLM_VERSIONS {
        run_step(
            Command::new(&venv_py)
                .arg(&harness)
                .args(["--vllm", version, "--impl", "vllm", "--report"])
                .arg(reports.join(format!("vllm-{version}.json"))),
        )
        .with_context(|| format!("vLLM {version}'s kv_offload tests with vLLM's own classes"))?;
        run_step(
            Command::new(&venv_py)
                .arg(&harness)
                .args([
                    "--vllm",
                    version,
                    "--impl",
                    "kvbm",
                    "--classes",
                    KVBM_CLASSES,
                    "--report",
                ])
                .arg(reports.join(format!("kvbm-{version}.json"))),
        )
        .with_context(|| format!("vLLM {version}'s kv_offload tests with kvbm's classes"))?;
    }

    // The Rust reference the Python replay is compared with.
    run_step(
        std::process::Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into())).args(
            [
                "build",
                "--release",
                "-p",
                "kvbm-tiering",
                "--example",
                "replay",
            ],
        ),
    )?;
    // The `kvbm` command: the fleet tests issue their members' credentials with it.
    run_step(
        std::process::Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()))
            .args(["build", "-p", "kvbm-cli", "--bin", "kvbm"]),
    )
    .context("building the kvbm command (kvbm security issues the fleet tests' credentials)")?;
    // kvbm-vllm's own tests, under each supported vLLM (the harness extracted both above).
    std::fs::create_dir_all(root.join("target/pytest-tmp"))?;
    for version in VLLM_VERSIONS {
        let mut pytest = Command::new(&venv_py);
        services.export_to(&mut pytest);
        run_step(
            pytest
                .args(["-m", "pytest", "-q", "-p", "no:cacheprovider"])
                // One temporary tree per version, emptied by pytest when it starts (its default
                // keeps its last three runs' files under /tmp for good).
                .arg("--basetemp")
                .arg(root.join(format!("target/pytest-tmp/{version}")))
                .arg(root.join("crates/kvbm-vllm/tests/python"))
                // pytest and numpy: the harness's pinned copies (installed by the run above).
                .env("PYTHONPATH", root.join("target/peer/vllm-sdist/pydeps"))
                .env("KVBM_VLLM_VERSION", version)
                .env("KVBM_BIN", root.join("target/debug/kvbm"))
                .env(
                    "KVBM_REPLAY_BIN",
                    root.join("target/release/examples/replay"),
                ),
        )
        .with_context(|| {
            format!("kvbm-vllm's Python tests under vLLM {version} (call for call against the Rust replay)")
        })?;
    }
    Ok(())
}
