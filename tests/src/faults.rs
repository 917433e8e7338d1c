//! Fault injection for the reliability tests: a private S3 server a test may kill and restart,
//! an HTTP fault proxy that adds latency and answers 500/503 for a fraction of requests, and
//! damage at rest ([`flip_last_byte`]: an object's payload changed behind kvbm's back).
//!
//! ```text
//!  kvbm (object_store client) ──► FaultProxy 127.0.0.1:P ──► OwnS3 (s3s-fs) 127.0.0.1:Q ──► dir/
//!                                  │ per request: sleep(latency), then
//!                                  │   error_fraction: 500/503 (S3 XML), connection closed
//!                                  │   else: forwarded with `Connection: close`
//! ```
//!
//! The proxy handles one request per connection: it reads the request head, decides, and either
//! answers the fault itself (after draining a `Content-Length` body) or forwards the head with
//! `Connection: close` and relays both directions until the server closes. So every request
//! meets the fault dice, keep-alive included. It runs on its own small tokio runtime, dropped
//! with it.
//!
//! [`OwnS3`] and [`OwnNats`] are separate from the shared servers that `cargo xtask ci` starts
//! ([`crate::services`]): killing one affects only the test that owns it. They need `s3s-fs` /
//! `nats-server` on `PATH` (`cargo xtask services start` installs them); without it a test
//! panics, or skips under `KVBM_TEST_SKIP_SERVICES=1`, as [`crate::services`] does.

use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// Bucket of an [`OwnS3`].
pub const OWN_BUCKET: &str = "kvbm-fault";
/// Access key of an [`OwnS3`].
pub const OWN_ACCESS_KEY: &str = "kvbm-fault-key";
/// Secret key of an [`OwnS3`] (tests check it never leaks).
pub const OWN_SECRET_KEY: &str = "kvbm-fault-secret-3f9a7c";

/// A free loopback port (bound, then released).
///
/// # Panics
/// When no port can be bound.
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("bind a loopback port")
        .port()
}

/// Waits until something accepts connections on `port`, up to `limit`.
pub fn wait_listening(port: u16, limit: Duration) -> bool {
    let t = Instant::now();
    while t.elapsed() < limit {
        if TcpStream::connect(("127.0.0.1", port)).is_ok() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    false
}

/// `program` on `PATH`; `None` (the test skips) when missing under `KVBM_TEST_SKIP_SERVICES=1`.
///
/// # Panics
/// Missing without the opt-out.
fn find_server(test: &str, program: &str) -> Option<PathBuf> {
    let bin = std::env::var_os("PATH").and_then(|p| {
        std::env::split_paths(&p)
            .map(|d| d.join(program))
            .find(|c| c.is_file())
    });
    if bin.is_none() {
        if std::env::var(crate::services::SKIP_SERVICES).as_deref() == Ok("1") {
            eprintln!("{test}: skipped, needs {program} on PATH");
            return None;
        }
        panic!(
            "{test} needs {program} on PATH: run `cargo xtask services start` (it installs it), \
             or set {}=1 to skip",
            crate::services::SKIP_SERVICES
        );
    }
    bin
}

/// A private nats-server on a fixed loopback port: killable and restartable (a restart is a
/// new server: subscriptions and buffered messages are gone, clients must reconnect).
#[derive(Debug)]
pub struct OwnNats {
    child: Option<Child>,
    bin: PathBuf,
    /// Its port (kept across restarts).
    pub port: u16,
}

impl OwnNats {
    /// Starts nats-server on a free port. `None` when it is not installed and
    /// `KVBM_TEST_SKIP_SERVICES=1` is set.
    ///
    /// # Panics
    /// nats-server missing without the opt-out, or it does not come up.
    pub fn start(test: &str) -> Option<OwnNats> {
        let bin = find_server(test, "nats-server")?;
        let mut n = OwnNats {
            child: None,
            bin,
            port: free_port(),
        };
        n.restart();
        Some(n)
    }

    /// `nats://127.0.0.1:<port>`.
    pub fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }

    /// Kills the server (SIGKILL) and waits for it.
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// (Re)starts the server on the same port and waits until it listens.
    ///
    /// # Panics
    /// It does not come up within 20 s.
    pub fn restart(&mut self) {
        self.kill();
        let child = Command::new(&self.bin)
            .args(["-a", "127.0.0.1", "-p", &self.port.to_string()])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn nats-server");
        self.child = Some(child);
        assert!(
            wait_listening(self.port, Duration::from_secs(20)),
            "nats-server did not listen on {}",
            self.port
        );
    }
}

impl Drop for OwnNats {
    fn drop(&mut self) {
        self.kill();
    }
}

/// A private s3s-fs server over `dir` on a fixed loopback port: killable and restartable.
#[derive(Debug)]
pub struct OwnS3 {
    child: Option<Child>,
    bin: PathBuf,
    /// Its port (kept across restarts).
    pub port: u16,
    /// Its data directory (the bucket is a directory in it).
    pub dir: PathBuf,
}

impl OwnS3 {
    /// Starts s3s-fs over `dir` (created, with the bucket [`OWN_BUCKET`]). `None` when s3s-fs is
    /// not installed and `KVBM_TEST_SKIP_SERVICES=1` is set.
    ///
    /// # Panics
    /// s3s-fs missing without the opt-out, or it does not come up.
    pub fn start(test: &str, dir: &Path) -> Option<OwnS3> {
        let bin = find_server(test, "s3s-fs")?;
        std::fs::create_dir_all(dir.join(OWN_BUCKET)).expect("create the bucket directory");
        let mut s = OwnS3 {
            child: None,
            bin,
            port: free_port(),
            dir: dir.to_path_buf(),
        };
        s.restart();
        Some(s)
    }

    /// `http://127.0.0.1:<port>`.
    pub fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// The directory holding the bucket's objects.
    pub fn bucket_dir(&self) -> PathBuf {
        self.dir.join(OWN_BUCKET)
    }

    /// Kills the server (SIGKILL) and waits for it.
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Whether the server is running.
    pub fn running(&self) -> bool {
        self.child.is_some()
    }

    /// (Re)starts the server on the same port and directory and waits until it listens.
    ///
    /// # Panics
    /// It does not come up within 20 s.
    pub fn restart(&mut self) {
        self.kill();
        let log = std::fs::File::create(self.dir.with_extension("log")).expect("s3s-fs log");
        let child = Command::new(&self.bin)
            .args(["--host", "127.0.0.1", "--port", &self.port.to_string()])
            .args([
                "--access-key",
                OWN_ACCESS_KEY,
                "--secret-key",
                OWN_SECRET_KEY,
            ])
            .arg(&self.dir)
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("spawn s3s-fs");
        self.child = Some(child);
        assert!(
            wait_listening(self.port, Duration::from_secs(20)),
            "s3s-fs did not listen on {}",
            self.port
        );
    }
}

impl Drop for OwnS3 {
    fn drop(&mut self) {
        self.kill();
    }
}

/// What the proxy injects.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct FaultConfig {
    /// Fraction of requests answered 500 or 503 (alternately) instead of forwarded.
    pub error_fraction: f64,
    /// Added latency per request, uniform in `[min, max]` milliseconds.
    pub latency_ms: (u64, u64),
    /// Seed of the dice.
    pub seed: u64,
}

impl Default for FaultConfig {
    fn default() -> Self {
        FaultConfig {
            error_fraction: 0.0,
            latency_ms: (0, 0),
            seed: 1,
        }
    }
}

/// Counters of a [`FaultProxy`].
#[derive(Debug, Default)]
pub struct ProxyStats {
    /// Requests seen (heads read).
    pub requests: AtomicU64,
    /// Requests answered with an injected 500/503.
    pub injected_errors: AtomicU64,
    /// Requests forwarded to the server.
    pub forwarded: AtomicU64,
    /// Forwards that could not reach the server.
    pub upstream_unreachable: AtomicU64,
}

struct Shared {
    upstream: SocketAddr,
    config: parking_lot::Mutex<(FaultConfig, u64)>,
    stats: ProxyStats,
}

impl Shared {
    /// (latency, inject an error, which status).
    fn roll(&self) -> (Duration, Option<u16>) {
        let mut g = self.config.lock();
        let (cfg, state) = &mut *g;
        let mut next = || {
            *state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let mut z = *state;
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            z ^ (z >> 31)
        };
        let (lo, hi) = cfg.latency_ms;
        let lat = lo + next() % (hi.saturating_sub(lo) + 1);
        let p = (next() >> 11) as f64 / (1u64 << 53) as f64;
        let err = (p < cfg.error_fraction).then(|| if next() & 1 == 0 { 500 } else { 503 });
        (Duration::from_millis(lat), err)
    }
}

/// A fault-injecting HTTP proxy in front of one server (see the module docs).
pub struct FaultProxy {
    port: u16,
    shared: Arc<Shared>,
    rt: Option<tokio::runtime::Runtime>,
}

impl std::fmt::Debug for FaultProxy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FaultProxy")
            .field("port", &self.port)
            .field("upstream", &self.shared.upstream)
            .finish()
    }
}

impl FaultProxy {
    /// Starts a proxy on a free loopback port in front of `upstream`.
    ///
    /// # Panics
    /// No runtime or port.
    pub fn start(upstream: SocketAddr, config: FaultConfig) -> FaultProxy {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .thread_name("fault-proxy")
            .build()
            .expect("proxy runtime");
        let listener = rt
            .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
            .expect("bind the proxy");
        let port = listener.local_addr().expect("proxy address").port();
        let shared = Arc::new(Shared {
            upstream,
            config: parking_lot::Mutex::new((config, config.seed)),
            stats: ProxyStats::default(),
        });
        let s = shared.clone();
        rt.spawn(async move {
            loop {
                let Ok((conn, _)) = listener.accept().await else {
                    continue;
                };
                let s = s.clone();
                tokio::spawn(async move {
                    let _ = handle(conn, &s).await;
                });
            }
        });
        FaultProxy {
            port,
            shared,
            rt: Some(rt),
        }
    }

    /// `http://127.0.0.1:<port>`.
    pub fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// Replaces what is injected from now on.
    pub fn set(&self, config: FaultConfig) {
        let mut g = self.shared.config.lock();
        g.0 = config;
    }

    /// The counters.
    pub fn stats(&self) -> &ProxyStats {
        &self.shared.stats
    }
}

impl Drop for FaultProxy {
    fn drop(&mut self) {
        if let Some(rt) = self.rt.take() {
            rt.shutdown_background();
        }
    }
}

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}

async fn handle(mut client: tokio::net::TcpStream, s: &Shared) -> std::io::Result<()> {
    let mut buf = Vec::with_capacity(4096);
    let head_end = loop {
        if let Some(i) = find(&buf, b"\r\n\r\n") {
            break i + 4;
        }
        if buf.len() > 64 << 10 {
            return Ok(());
        }
        let mut chunk = [0u8; 4096];
        let n = client.read(&mut chunk).await?;
        if n == 0 {
            return Ok(());
        }
        buf.extend_from_slice(&chunk[..n]);
    };
    s.stats.requests.fetch_add(1, Ordering::Relaxed);
    let head = String::from_utf8_lossy(&buf[..head_end]).into_owned();
    let mut lines = head.split("\r\n");
    let request_line = lines.next().unwrap_or_default().to_string();
    let mut kept: Vec<&str> = Vec::new();
    let mut content_length: Option<usize> = None;
    for l in lines.filter(|l| !l.is_empty()) {
        let lower = l.to_ascii_lowercase();
        if lower.starts_with("connection:") {
            continue;
        }
        if let Some(v) = lower.strip_prefix("content-length:") {
            content_length = v.trim().parse().ok();
        }
        kept.push(l);
    }
    let (latency, error) = s.roll();
    if !latency.is_zero() {
        tokio::time::sleep(latency).await;
    }
    if let Some(status) = error {
        // Drain the body, then answer like an overloaded S3.
        let mut have = buf.len() - head_end;
        if let Some(want) = content_length {
            let mut chunk = [0u8; 8192];
            while have < want {
                let n = client.read(&mut chunk).await?;
                if n == 0 {
                    break;
                }
                have += n;
            }
        }
        let (code, reason) = if status == 500 {
            ("InternalError", "Internal Server Error")
        } else {
            ("SlowDown", "Service Unavailable")
        };
        let body = format!(
            "<?xml version=\"1.0\" encoding=\"UTF-8\"?><Error><Code>{code}</Code><Message>injected by the fault proxy</Message></Error>"
        );
        let resp = format!(
            "HTTP/1.1 {status} {reason}\r\nContent-Type: application/xml\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
            body.len()
        );
        s.stats.injected_errors.fetch_add(1, Ordering::Relaxed);
        client.write_all(resp.as_bytes()).await?;
        let _ = client.shutdown().await;
        return Ok(());
    }
    let mut upstream = match tokio::net::TcpStream::connect(s.upstream).await {
        Ok(u) => u,
        Err(e) => {
            s.stats.upstream_unreachable.fetch_add(1, Ordering::Relaxed);
            return Err(e);
        }
    };
    s.stats.forwarded.fetch_add(1, Ordering::Relaxed);
    let mut out = request_line;
    out.push_str("\r\n");
    for l in kept {
        out.push_str(l);
        out.push_str("\r\n");
    }
    out.push_str("Connection: close\r\n\r\n");
    upstream.write_all(out.as_bytes()).await?;
    upstream.write_all(&buf[head_end..]).await?;
    let (mut cr, mut cw) = client.into_split();
    let (mut ur, mut uw) = upstream.into_split();
    let up = tokio::spawn(async move {
        let _ = tokio::io::copy(&mut cr, &mut uw).await;
    });
    let _ = tokio::io::copy(&mut ur, &mut cw).await;
    let _ = cw.shutdown().await;
    up.abort();
    Ok(())
}

/// Damages the object at `path` at rest, behind kvbm's back: its last byte (payload, never the
/// header) XORed with `mask` (not 0), the length kept. A reader must then refuse it on its
/// checksum.
///
/// # Panics
/// When the object cannot be read or written back, or `mask` is 0 (no damage).
pub async fn flip_last_byte(
    store: &dyn object_store::ObjectStore,
    path: &object_store::path::Path,
    mask: u8,
) {
    use object_store::ObjectStoreExt;
    assert_ne!(mask, 0, "a zero mask damages nothing");
    let mut body = store
        .get(path)
        .await
        .unwrap_or_else(|e| panic!("read {path}: {e}"))
        .bytes()
        .await
        .unwrap_or_else(|e| panic!("read {path}: {e}"))
        .to_vec();
    let last = body.len() - 1;
    body[last] ^= mask;
    store
        .put(path, body.into())
        .await
        .unwrap_or_else(|e| panic!("write {path}: {e}"));
}
