//! `cargo xtask nixl`: kvbm-physical's NIXL transport over loopback, against the real NIXL
//! library of the `nixl-cu12` wheel from the package index (no GPU needed: host memory, UCX
//! over loopback).
//!
//! ```text
//!  pip download nixl-cu12==VERSION (once, into target/nixl) ─► unzip its libraries
//!  cargo test -p kvbm-physical --features nixl --lib nixl   with LD_LIBRARY_PATH, NIXL_PLUGIN_DIR,
//!                                                            KVBM_REQUIRE_NIXL=1 (none may skip)
//! ```
//!
//! The wheel carries `libnixl_capi.so` (what `nixl-sys`'s stub API loads), its plugins (UCX
//! among them) and UCX itself; nothing is installed system-wide. CI runs it after the tests.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, bail};

/// The wheel pinned (its C API is the one `nixl-sys` 1.5 binds).
const WHEEL: &str = "nixl-cu12==1.5.1";

/// Where the wheel's libraries are unpacked: `(libraries, plugins)`.
fn unpacked(root: &Path) -> (PathBuf, PathBuf) {
    let libs = root.join("x/.nixl_cu12.mesonpy.libs");
    let plugins = libs.join("plugins");
    (libs, plugins)
}

/// Downloads and unpacks the wheel once; returns the directories for `LD_LIBRARY_PATH` and
/// `NIXL_PLUGIN_DIR`.
pub(crate) fn fetch() -> Result<(Vec<PathBuf>, PathBuf)> {
    let root = crate::project_root().join("target/nixl");
    let (libs, plugins) = unpacked(&root);
    if !libs.join("libnixl_capi.so").exists() {
        std::fs::create_dir_all(&root)?;
        crate::run_step(Command::new("python3").args([
            "-m",
            "pip",
            "download",
            "--quiet",
            "--no-deps",
            "--only-binary=:all:",
            "--python-version",
            "3.11",
            "--platform",
            "manylinux_2_28_x86_64",
            "--dest",
            root.to_str().context("a UTF-8 target path")?,
            WHEEL,
        ]))
        .context("downloading the NIXL wheel from the package index")?;
        let wheel = std::fs::read_dir(&root)?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .find(|p| p.extension().is_some_and(|x| x == "whl"))
            .context("the NIXL wheel was not downloaded")?;
        crate::run_step(
            Command::new("python3")
                .args(["-m", "zipfile", "-e"])
                .arg(&wheel)
                .arg(root.join("x")),
        )
        .context("unpacking the NIXL wheel")?;
        if !libs.join("libnixl_capi.so").exists() {
            bail!(
                "the NIXL wheel {} has no {}",
                wheel.display(),
                libs.join("libnixl_capi.so").display()
            );
        }
    }
    Ok((vec![libs, root.join("x/nixl_cu12.libs")], plugins))
}

/// The test command, its environment set (libraries found, none may skip).
pub(crate) fn test_command(cargo: Command) -> Result<Command> {
    let (libs, plugins) = fetch()?;
    let mut cmd = cargo;
    cmd.args([
        "test",
        "-p",
        "kvbm-physical",
        "--features",
        "nixl",
        "--lib",
        "nixl",
    ])
    .env("LD_LIBRARY_PATH", std::env::join_paths(&libs)?)
    .env("NIXL_PLUGIN_DIR", plugins)
    .env("KVBM_REQUIRE_NIXL", "1")
    // Loopback only: shared memory and TCP on this machine.
    .env("UCX_TLS", "tcp,self,sm");
    Ok(cmd)
}

pub(crate) fn run() -> Result<()> {
    let cargo = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()));
    crate::run_step(&mut test_command(cargo)?)
}
