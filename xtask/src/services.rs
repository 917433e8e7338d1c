//! The real servers tests need, provisioned and started by xtask.
//!
//! ```text
//!   ensure installed ──► pick free 127.0.0.1 port ──► spawn with own data dir ──► wait for port
//!        │                                                                            │
//!        └─ s3s-fs: `cargo install s3s-fs@0.14.1 --features binary --locked`         ▼
//!        └─ nats-server: `apt-get install -y nats-server`          export KVBM_TEST_* to tests
//! ```
//!
//! Installation is idempotent: a tool already on PATH (or in `~/.cargo/bin`) is used as is.
//! Every server gets a fresh data directory under `target/kvbm-services/<pid>/` and its output
//! goes to a log file there, printed when the server fails to come up.
//!
//! Tests find the servers through the environment variables below (the contract with
//! `kvbm-tests/src/services.rs`; keep the two in step). [`Services`] stops every server it
//! started when dropped, so `cargo xtask ci` stops them whatever the tests' outcome.

use std::fs;
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};

use crate::{find_on_path, on_path, run_step};

/// S3 endpoint variable (`http://127.0.0.1:PORT`).
pub(crate) const S3_ENDPOINT: &str = "KVBM_TEST_S3_ENDPOINT";
/// Bucket variable.
pub(crate) const S3_BUCKET: &str = "KVBM_TEST_S3_BUCKET";
/// Access key variable.
pub(crate) const S3_ACCESS_KEY: &str = "KVBM_TEST_S3_ACCESS_KEY";
/// Secret key variable.
pub(crate) const S3_SECRET_KEY: &str = "KVBM_TEST_S3_SECRET_KEY";
/// NATS url variable (`nats://127.0.0.1:PORT`).
pub(crate) const NATS_URL: &str = "KVBM_TEST_NATS_URL";

const S3S_FS_VERSION: &str = "0.14.1";
const BUCKET: &str = "kvbm-test";
const ACCESS_KEY: &str = "kvbm-test-key";
const SECRET_KEY: &str = "kvbm-test-secret";
const STARTUP_TIMEOUT: Duration = Duration::from_secs(20);

/// A started server.
struct Server {
    name: &'static str,
    child: Child,
    log: PathBuf,
}

/// The servers started for one run, and the environment that points tests at them.
pub(crate) struct Services {
    servers: Vec<Server>,
    env: Vec<(&'static str, String)>,
    dir: PathBuf,
}

impl Services {
    /// Installs (when missing) and starts every server the tests need.
    pub(crate) fn start_all() -> Result<Self> {
        ensure_s3s_fs()?;
        ensure_nats_server()?;
        let dir = crate::project_root()
            .join("target/kvbm-services")
            .join(std::process::id().to_string());
        if dir.exists() {
            fs::remove_dir_all(&dir).with_context(|| format!("clearing {}", dir.display()))?;
        }
        fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
        let mut services = Services {
            servers: Vec::new(),
            env: Vec::new(),
            dir,
        };
        services.start_s3()?;
        services.start_nats()?;
        Ok(services)
    }

    /// Benchmarks that touch G4 need the S3 server; start the same set as tests.
    pub(crate) fn start_for_benches() -> Result<Self> {
        Self::start_all()
    }

    /// Adds the `KVBM_TEST_*` variables to `cmd`.
    pub(crate) fn export_to(&self, cmd: &mut Command) {
        for (k, v) in &self.env {
            cmd.env(k, v);
        }
    }

    /// Stops every server (also done on drop).
    pub(crate) fn stop(mut self) {
        self.stop_all();
    }

    fn stop_all(&mut self) {
        for mut server in self.servers.drain(..) {
            let _ = server.child.kill();
            let _ = server.child.wait();
        }
        let _ = fs::remove_dir_all(&self.dir);
    }

    fn start_s3(&mut self) -> Result<()> {
        let data = self.dir.join("s3");
        fs::create_dir_all(data.join(BUCKET)).context("creating the S3 bucket directory")?;
        let port = free_port()?;
        let bin = find_on_path("s3s-fs").context("s3s-fs is not installed")?;
        let mut cmd = Command::new(bin);
        cmd.args(["--host", "127.0.0.1", "--port", &port.to_string()])
            .args(["--access-key", ACCESS_KEY, "--secret-key", SECRET_KEY])
            .arg(&data);
        self.spawn("s3s-fs", cmd, port)?;
        self.env
            .push((S3_ENDPOINT, format!("http://127.0.0.1:{port}")));
        self.env.push((S3_BUCKET, BUCKET.to_string()));
        self.env.push((S3_ACCESS_KEY, ACCESS_KEY.to_string()));
        self.env.push((S3_SECRET_KEY, SECRET_KEY.to_string()));
        Ok(())
    }

    fn start_nats(&mut self) -> Result<()> {
        let data = self.dir.join("nats");
        fs::create_dir_all(&data).context("creating the NATS data directory")?;
        let port = free_port()?;
        let bin = find_on_path("nats-server").context("nats-server is not installed")?;
        let mut cmd = Command::new(bin);
        cmd.args(["-a", "127.0.0.1", "-p", &port.to_string(), "-js", "-sd"])
            .arg(&data);
        self.spawn("nats-server", cmd, port)?;
        self.env
            .push((NATS_URL, format!("nats://127.0.0.1:{port}")));
        Ok(())
    }

    fn spawn(&mut self, name: &'static str, mut cmd: Command, port: u16) -> Result<()> {
        let log = self.dir.join(format!("{name}.log"));
        let out = fs::File::create(&log).with_context(|| format!("creating {}", log.display()))?;
        cmd.stdin(Stdio::null())
            .stdout(out.try_clone()?)
            .stderr(out);
        let child = cmd.spawn().with_context(|| format!("starting {name}"))?;
        self.servers.push(Server { name, child, log });
        let server = self.servers.last_mut().expect("just pushed");
        wait_for_port(server, port)?;
        eprintln!("services: {name} listening on 127.0.0.1:{port}");
        Ok(())
    }

    /// Forgets the servers so they keep running after xtask exits (for `services start`).
    fn detach(mut self) -> Vec<u32> {
        let pids = self.servers.drain(..).map(|s| s.child.id()).collect();
        std::mem::forget(self);
        pids
    }
}

impl Drop for Services {
    fn drop(&mut self) {
        self.stop_all();
    }
}

fn wait_for_port(server: &mut Server, port: u16) -> Result<()> {
    let addr = SocketAddr::from(([127, 0, 0, 1], port));
    let deadline = Instant::now() + STARTUP_TIMEOUT;
    loop {
        if let Some(status) = server.child.try_wait()? {
            bail!(
                "{} exited during start ({status}); its log:\n{}",
                server.name,
                read_log(&server.log)
            );
        }
        if TcpStream::connect_timeout(&addr, Duration::from_millis(100)).is_ok() {
            return Ok(());
        }
        if Instant::now() > deadline {
            bail!(
                "{} did not open port {port} within {STARTUP_TIMEOUT:?}; its log:\n{}",
                server.name,
                read_log(&server.log)
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn read_log(path: &Path) -> String {
    fs::read_to_string(path).unwrap_or_else(|e| format!("(could not read {}: {e})", path.display()))
}

fn free_port() -> Result<u16> {
    let listener = TcpListener::bind("127.0.0.1:0").context("finding a free loopback port")?;
    Ok(listener.local_addr()?.port())
}

fn ensure_s3s_fs() -> Result<()> {
    if on_path("s3s-fs") {
        return Ok(());
    }
    eprintln!("services: installing s3s-fs {S3S_FS_VERSION} (once; about two minutes)");
    run_step(Command::new("cargo").args([
        "install",
        &format!("s3s-fs@{S3S_FS_VERSION}"),
        "--features",
        "binary",
        "--locked",
    ]))
    .context("installing s3s-fs, the S3-compatible test server")
}

fn ensure_nats_server() -> Result<()> {
    if on_path("nats-server") {
        return Ok(());
    }
    if !on_path("apt-get") {
        bail!(
            "nats-server is missing and apt-get is not available to install it; install nats-server"
        );
    }
    eprintln!("services: installing nats-server from Debian packages");
    run_step(Command::new("apt-get").arg("update").arg("-qq"))?;
    run_step(Command::new("apt-get").args(["install", "-y", "-qq", "nats-server"]))
        .context("installing nats-server")
}

/// `cargo xtask services start|stop`.
pub(crate) fn run_command(args: &[String]) -> Result<()> {
    let pid_file = crate::project_root().join("target/kvbm-services/running.pids");
    match args.first().map(String::as_str) {
        Some("start") => {
            let services = Services::start_all()?;
            for (k, v) in &services.env {
                println!("export {k}={v}");
            }
            let pids = services.detach();
            let text: Vec<String> = pids.iter().map(u32::to_string).collect();
            fs::write(&pid_file, text.join("\n"))?;
            eprintln!("services: started; stop them with `cargo xtask services stop`");
            Ok(())
        }
        Some("stop") => {
            let Ok(text) = fs::read_to_string(&pid_file) else {
                eprintln!("services: nothing recorded as running");
                return Ok(());
            };
            for pid in text.lines().filter(|l| !l.is_empty()) {
                let _ = Command::new("kill").arg(pid).status();
            }
            fs::remove_file(&pid_file)?;
            Ok(())
        }
        _ => bail!("usage: cargo xtask services start|stop"),
    }
}
