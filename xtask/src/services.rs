//! The real servers tests need, provisioned and started by xtask.
//!
//! ```text
//!   ensure installed ──► pick free 127.0.0.1 port ──► spawn with own data dir ──► wait for port
//!        │                                                                            │
//!        └─ s3s-fs: `cargo install s3s-fs@0.14.1 --features binary --locked`         ▼
//!        └─ nats-server: `apt-get install -y nats-server`          export KVBM_TEST_* to tests
//! ```
//!
//! Besides the open NATS server, three authenticated ones (the `security_*` tests' servers,
//! [`Services::start_nats_auth`]): one with two accounts (two tenants) whose users have the
//! subject permissions of the roles in `docs/security.md` (user/password and nkey users),
//! one that demands TLS with a client certificate and a token, and one in operator mode
//! whose users log in with `.creds` files. Their CA, certificates
//! (made with the `openssl` CLI, installed with apt-get when missing), passwords, nkey seed
//! and token are written at start, mode 0600, to one directory exported as
//! `KVBM_TEST_NATS_AUTH_DIR`:
//!
//! ```text
//!  KVBM_TEST_NATS_AUTH_URL  nats://127.0.0.1:P  accounts TENANT_A (users instance_a, leader_a,
//!                                                worker_a: password files <user>.password; an
//!                                                nkey user: nkey_a.seed) and TENANT_B
//!                                                (instance_b)
//!  KVBM_TEST_NATS_TLS_URL   tls://127.0.0.1:Q   TLS (ca.pem), client certificate required
//!                                                (client-cert.pem, client-key.pem), token
//!                                                (token)
//!  KVBM_TEST_NATS_JWT_URL   nats://127.0.0.1:R  operator mode (JWTs, memory resolver): a user
//!                                                of the trusted account (user_jwt.creds), a
//!                                                user of an account it never signed
//!                                                (foreign_jwt.creds; see `nats_jwt`)
//!  KVBM_TEST_NATS_AUTH_DIR  the files above, and the servers' configurations
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

/// The NATS grants per role, written once in kvbm-cluster (std only, so xtask compiles it
/// as its own module without depending on the workspace's crates).
/// Its document forms (`publish_line`, …) are kvbm-cluster's test's alone.
#[path = "../../crates/kvbm-cluster/src/transport/grants.rs"]
#[allow(dead_code, unreachable_pub, unexpected_cfgs)]
mod grants;
use grants::Grants;

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
/// The NATS server with accounts and users (`nats://127.0.0.1:PORT`).
pub(crate) const NATS_AUTH_URL: &str = "KVBM_TEST_NATS_AUTH_URL";
/// The NATS server that demands TLS, a client certificate and a token (`tls://127.0.0.1:PORT`).
pub(crate) const NATS_TLS_URL: &str = "KVBM_TEST_NATS_TLS_URL";
/// The NATS server in operator mode (JWT accounts; `.creds` logins).
pub(crate) const NATS_JWT_URL: &str = "KVBM_TEST_NATS_JWT_URL";
/// The directory of the authenticated servers' secrets and certificates.
pub(crate) const NATS_AUTH_DIR: &str = "KVBM_TEST_NATS_AUTH_DIR";

/// The instance id whose control subjects the test users `leader_a` and `worker_a` may use
/// (`kvbm.ctl.{TEST_INSTANCE:016x}.>`).
const TEST_INSTANCE: u64 = 0xa1;

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
        ensure_openssl()?;
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
        services.start_nats_auth()?;
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

    /// The two authenticated NATS servers (see the module docs).
    fn start_nats_auth(&mut self) -> Result<()> {
        let dir = self.dir.join("nats-auth");
        fs::create_dir_all(&dir).context("creating the NATS auth directory")?;
        make_certificates(&dir)?;
        let bin = find_on_path("nats-server").context("nats-server is not installed")?;

        // Accounts = tenants; users per role with the grants of docs/security.md, from the one
        // source both are written from (kvbm-cluster's `transport::grants`). The instance role
        // also gets `kvbm.test.>`, the subjects tests publish events on.
        let instance = Grants::instance("kvbm.events")
            .with_subjects(&["kvbm.test.>"])
            .to_conf();
        let leader = Grants::leader("kvbm.ctl", TEST_INSTANCE).to_conf();
        let worker = Grants::worker("kvbm.ctl", TEST_INSTANCE).to_conf();
        let mut users_a = Vec::new();
        for (user, perms) in [
            ("instance_a", instance.clone()),
            ("leader_a", leader),
            ("worker_a", worker),
        ] {
            let password = secret_file(&dir, &format!("{user}.password"))?;
            users_a.push(format!(
                r#"      {{ user: "{user}", password: "{password}", permissions: {perms} }}"#
            ));
        }
        let nkey = nkeys::KeyPair::new_user();
        write_secret(
            &dir.join("nkey_a.seed"),
            &nkey.seed().map_err(|e| anyhow::anyhow!("nkey seed: {e}"))?,
        )?;
        users_a.push(format!(
            r#"      {{ nkey: "{}", permissions: {instance} }}"#,
            nkey.public_key()
        ));
        let password_b = secret_file(&dir, "instance_b.password")?;
        let port = free_port()?;
        let conf = format!(
            "# Written by `cargo xtask services` (xtask/src/services.rs).\n\
             listen: \"127.0.0.1:{port}\"\n\
             accounts {{\n  TENANT_A {{\n    users = [\n{}\n    ]\n  }}\n  TENANT_B {{\n    \
             users = [\n      {{ user: \"instance_b\", password: \"{password_b}\", \
             permissions: {instance} }}\n    ]\n  }}\n}}\n",
            users_a.join("\n")
        );
        let conf_path = dir.join("nats-auth.conf");
        write_secret(&conf_path, &conf)?;
        let mut cmd = Command::new(&bin);
        cmd.arg("-c").arg(&conf_path);
        self.spawn("nats-server-auth", cmd, port)?;
        self.env
            .push((NATS_AUTH_URL, format!("nats://127.0.0.1:{port}")));

        let token = secret_file(&dir, "token")?;
        let port = free_port()?;
        let d = dir.display();
        let conf = format!(
            "# Written by `cargo xtask services` (xtask/src/services.rs).\n\
             listen: \"127.0.0.1:{port}\"\n\
             tls {{\n  cert_file: \"{d}/server-cert.pem\"\n  key_file: \"{d}/server-key.pem\"\n  \
             ca_file: \"{d}/ca.pem\"\n  verify: true\n  timeout: 5\n}}\n\
             authorization {{\n  token: \"{token}\"\n}}\n"
        );
        let conf_path = dir.join("nats-tls.conf");
        write_secret(&conf_path, &conf)?;
        let mut cmd = Command::new(&bin);
        cmd.arg("-c").arg(&conf_path);
        self.spawn("nats-server-tls", cmd, port)?;
        self.env
            .push((NATS_TLS_URL, format!("tls://127.0.0.1:{port}")));

        // Operator mode (decentralized JWT authentication): `.creds` logins.
        let jwt = crate::nats_jwt::operator_setup()?;
        write_secret(&dir.join("user_jwt.creds"), &jwt.user_creds)?;
        write_secret(&dir.join("foreign_jwt.creds"), &jwt.foreign_creds)?;
        let port = free_port()?;
        let conf = format!(
            "# Written by `cargo xtask services` (xtask/src/services.rs).\n\
             listen: \"127.0.0.1:{port}\"\n{}",
            jwt.server_conf
        );
        let conf_path = dir.join("nats-jwt.conf");
        write_secret(&conf_path, &conf)?;
        let mut cmd = Command::new(&bin);
        cmd.arg("-c").arg(&conf_path);
        self.spawn("nats-server-jwt", cmd, port)?;
        self.env
            .push((NATS_JWT_URL, format!("nats://127.0.0.1:{port}")));
        self.env.push((NATS_AUTH_DIR, dir.display().to_string()));
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

/// 32 random bytes, hex: a password or token (no quoting needed in the server's config).
fn random_hex() -> Result<String> {
    let mut bytes = [0u8; 32];
    use std::io::Read;
    fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut bytes))
        .context("reading /dev/urandom")?;
    Ok(bytes.iter().map(|b| format!("{b:02x}")).collect())
}

/// Writes `text` to `path`, readable by its owner only.
fn write_secret(path: &Path, text: &str) -> Result<()> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let mut f = fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(path)
        .with_context(|| format!("writing {}", path.display()))?;
    f.write_all(text.as_bytes())
        .with_context(|| format!("writing {}", path.display()))
}

/// A new random secret, written to `dir/name` (0600) and returned.
fn secret_file(dir: &Path, name: &str) -> Result<String> {
    let secret = random_hex()?;
    write_secret(&dir.join(name), &format!("{secret}\n"))?;
    Ok(secret)
}

/// A CA, a server certificate for 127.0.0.1/localhost and a client certificate, all signed by
/// the CA, made with the `openssl` CLI in `dir` (valid two days; made anew at each start).
fn make_certificates(dir: &Path) -> Result<()> {
    let openssl = |args: &[&str]| -> Result<()> {
        let out = Command::new("openssl")
            .args(args)
            .current_dir(dir)
            .stdin(Stdio::null())
            .output()
            .context("running openssl")?;
        if !out.status.success() {
            bail!(
                "openssl {} failed ({}): {}",
                args.join(" "),
                out.status,
                String::from_utf8_lossy(&out.stderr)
            );
        }
        Ok(())
    };
    fs::write(
        dir.join("openssl.cnf"),
        "[req]\ndistinguished_name = dn\nprompt = no\nx509_extensions = v3_ca\n\
         [dn]\nCN = kvbm test CA\n\
         [v3_ca]\nbasicConstraints = critical,CA:TRUE\nkeyUsage = critical,keyCertSign,cRLSign\n\
         subjectKeyIdentifier = hash\n\
         [server]\nbasicConstraints = CA:FALSE\nkeyUsage = critical,digitalSignature\n\
         extendedKeyUsage = serverAuth\nsubjectAltName = IP:127.0.0.1,DNS:localhost\n\
         [client]\nbasicConstraints = CA:FALSE\nkeyUsage = critical,digitalSignature\n\
         extendedKeyUsage = clientAuth\n",
    )?;
    let ec = [
        "-newkey",
        "ec",
        "-pkeyopt",
        "ec_paramgen_curve:prime256v1",
        "-nodes",
    ];
    let mut ca = vec!["req", "-x509", "-config", "openssl.cnf", "-days", "2"];
    ca.extend(ec);
    ca.extend(["-keyout", "ca-key.pem", "-out", "ca.pem"]);
    openssl(&ca)?;
    for (name, cn, serial) in [
        ("server", "localhost", "2"),
        ("client", "kvbm-test-client", "3"),
    ] {
        let (key, csr, cert) = (
            format!("{name}-key.pem"),
            format!("{name}.csr"),
            format!("{name}-cert.pem"),
        );
        let subj = format!("/CN={cn}");
        let mut req = vec!["req", "-new", "-config", "openssl.cnf", "-subj", &subj];
        req.extend(ec);
        req.extend(["-keyout", &key, "-out", &csr]);
        openssl(&req)?;
        openssl(&[
            "x509",
            "-req",
            "-in",
            &csr,
            "-CA",
            "ca.pem",
            "-CAkey",
            "ca-key.pem",
            "-set_serial",
            serial,
            "-days",
            "2",
            "-extfile",
            "openssl.cnf",
            "-extensions",
            name,
            "-out",
            &cert,
        ])?;
    }
    for key in ["ca-key.pem", "server-key.pem", "client-key.pem"] {
        use std::os::unix::fs::PermissionsExt;
        fs::set_permissions(dir.join(key), fs::Permissions::from_mode(0o600))?;
    }
    Ok(())
}

fn ensure_openssl() -> Result<()> {
    if on_path("openssl") {
        return Ok(());
    }
    if !on_path("apt-get") {
        bail!("openssl is missing and apt-get is not available to install it; install openssl");
    }
    eprintln!("services: installing openssl from Debian packages");
    run_step(Command::new("apt-get").arg("update").arg("-qq"))?;
    run_step(Command::new("apt-get").args(["install", "-y", "-qq", "openssl"]))
        .context("installing openssl")
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
