//! NATS authentication, TLS and the secure-by-default rule against real servers: the
//! authenticated `nats-server`s `cargo xtask services` starts (one with two accounts, two
//! tenants, and users per role; one demanding TLS, a client certificate and a token; see
//! `xtask/src/services.rs` and `docs/security.md`), real worker processes and real
//! instances.
//!
//! * Without credentials, with wrong ones, or without the CA, a connect fails with an error
//!   naming what is missing and no secret; each credential kind connects and carries messages.
//! * Accounts isolate tenants: tenant B never sees tenant A's `kvbm.events`.
//! * The server enforces role permissions: a worker's user cannot publish to another
//!   instance's control subject nor forge events (the violation is asserted, nothing
//!   arrives), while a real worker process under that user keeps serving its leader.
//! * Off loopback, an instance or worker without credentials is refused naming the key, and
//!   runs with `security.insecure = true`.
//! * No secret appears in `Debug` of the configuration or in an error.
//!
//! Needs `cargo xtask services start` (or skips under `KVBM_TEST_SKIP_SERVICES=1`).

use std::io::{BufRead, BufReader};
use std::net::{IpAddr, TcpListener, UdpSocket};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use futures::StreamExt;
use kvbm_cluster::instance::Instance;
use kvbm_cluster::transport::control::{ControlRequest, ControlResponse, WorkerControl};
use kvbm_cluster::transport::nats::{DEFAULT_CONTROL_PREFIX, NatsControl, connect_with};
use kvbm_engine::config::{ConfigBuilder, NatsAuthConfig, Secret};
use kvbm_engine::{EngineError, InstanceId, KvbmRuntime, WorkerAddress};
use kvbm_tests::services::{CONTROL_INSTANCE, NatsAuthService, nats_auth};

#[path = "../../kvbm-engine/tests/common/mod.rs"]
mod common;

const MS50: Duration = Duration::from_millis(50);

fn unique(test: &str) -> String {
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    format!("{test}_{}_{nanos}", std::process::id())
}

/// `user` of the accounts server, its password from its file.
fn user(svc: &NatsAuthService, name: &str) -> NatsAuthConfig {
    NatsAuthConfig {
        user: Some(name.into()),
        password_file: Some(svc.password_file(name)),
        ..NatsAuthConfig::default()
    }
}

/// Everything the TLS server asks for: its CA, a client certificate, the token.
fn tls(svc: &NatsAuthService) -> NatsAuthConfig {
    NatsAuthConfig {
        token_file: Some(svc.token_file()),
        ca_file: Some(svc.ca_file()),
        cert_file: Some(svc.cert_file()),
        key_file: Some(svc.key_file()),
        require_tls: true,
        ..NatsAuthConfig::default()
    }
}

/// Every secret the services wrote (passwords, token, nkey seed).
fn secrets(svc: &NatsAuthService) -> Vec<String> {
    let mut s: Vec<String> = ["instance_a", "leader_a", "worker_a", "instance_b"]
        .iter()
        .map(|u| svc.read(&svc.password_file(u)))
        .collect();
    s.push(svc.read(&svc.token_file()));
    s.push(svc.read(&svc.nkey_file()));
    // The user nkey seeds inside the `.creds` files.
    for f in [svc.creds_file(), svc.foreign_creds_file()] {
        let text = std::fs::read_to_string(&f).unwrap();
        let seed = text
            .lines()
            .find(|l| l.starts_with("SU"))
            .expect("a user seed");
        s.push(seed.to_string());
    }
    s
}

fn assert_no_secret(what: &str, text: &str, secrets: &[String]) {
    for s in secrets {
        assert!(!text.contains(s.as_str()), "{what} leaks a secret: {text}");
    }
}

/// Connects with `auth`; the error's text when it fails.
async fn refused(url: &str, auth: &NatsAuthConfig) -> String {
    match connect_with(url, auth, "refused", MS50).await {
        Ok(_) => panic!("connect to {url} must fail"),
        Err(e) => {
            assert!(
                matches!(e, EngineError::Nats { .. } | EngineError::Config { .. }),
                "{e:?}"
            );
            e.to_string()
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn security_connect_without_or_with_wrong_credentials_fails_naming_what_is_missing() {
    let Some(svc) = nats_auth("security_connect_without_credentials") else {
        return;
    };
    let secrets = secrets(&svc);

    // No credentials: the error says the server wants them and which keys give them.
    let e = refused(&svc.url, &NatsAuthConfig::default()).await;
    assert!(e.contains("authorization violation"), "{e}");
    assert!(e.contains("none are configured"), "{e}");
    assert!(e.contains("transport.nats_auth.creds_file"), "{e}");

    // A wrong password, and tenant B's password for tenant A's user: refused naming the key,
    // neither password echoed.
    let wrong = NatsAuthConfig {
        user: Some("instance_a".into()),
        password: Some(Secret::new("wrong-pw-7f3a9c")),
        ..NatsAuthConfig::default()
    };
    let e = refused(&svc.url, &wrong).await;
    assert!(e.contains("transport.nats_auth.user"), "{e}");
    assert!(!e.contains("wrong-pw-7f3a9c"), "{e}");
    let crossed = NatsAuthConfig {
        password_file: Some(svc.password_file("instance_b")),
        ..user(&svc, "instance_a")
    };
    let e = refused(&svc.url, &crossed).await;
    assert!(e.contains("authorization violation"), "{e}");
    assert_no_secret("cross-tenant password", &e, &secrets);

    // TLS demanded and the client has no CA for the server's certificate: says to set ca_file.
    let no_ca = NatsAuthConfig {
        ca_file: None,
        ..tls(&svc)
    };
    let e = refused(&svc.tls_url, &no_ca).await;
    assert!(e.contains("transport.nats_auth.ca_file"), "{e}");
    assert_no_secret("no CA", &e, &secrets);
    // The CA but no client certificate: the server refuses the handshake.
    let no_cert = NatsAuthConfig {
        cert_file: None,
        key_file: None,
        ..tls(&svc)
    };
    assert_no_secret("no cert", &refused(&svc.tls_url, &no_cert).await, &secrets);
    // TLS right but no token, then a wrong one: refused, the token never echoed.
    let no_token = NatsAuthConfig {
        token_file: None,
        ..tls(&svc)
    };
    let e = refused(&svc.tls_url, &no_token).await;
    assert!(e.contains("authorization violation"), "{e}");
    let wrong_token = NatsAuthConfig {
        token_file: None,
        token: Some(Secret::new("wrong-token-51d0e2")),
        ..tls(&svc)
    };
    let e = refused(&svc.tls_url, &wrong_token).await;
    assert!(e.contains("transport.nats_auth.token"), "{e}");
    assert!(!e.contains("wrong-token-51d0e2"), "{e}");
    assert_no_secret("wrong token", &e, &secrets);
    // require_tls refuses a server that offers no TLS, with the right password.
    let plain = NatsAuthConfig {
        require_tls: true,
        ..user(&svc, "instance_a")
    };
    assert_no_secret("require_tls", &refused(&svc.url, &plain).await, &secrets);
    // A file that is not there is named with its key.
    let missing = NatsAuthConfig {
        password_file: Some("/nonexistent/kvbm/pw".into()),
        ..user(&svc, "instance_a")
    };
    let e = refused(&svc.url, &missing).await;
    assert!(e.contains("transport.nats_auth.password_file"), "{e}");
    // Credentials in the url are refused before anything connects, the secret not echoed.
    let url = svc
        .url
        .replace("nats://", "nats://instance_a:pw-in-url-0f9e@");
    let e = refused(&url, &NatsAuthConfig::default()).await;
    assert!(e.contains("userinfo"), "{e}");
    assert!(!e.contains("pw-in-url-0f9e"), "{e}");

    // Operator mode: no credentials, then a well-formed `.creds` of an account the operator
    // never signed: refused naming the key, the seed never echoed.
    let e = refused(&svc.jwt_url, &NatsAuthConfig::default()).await;
    assert!(e.contains("none are configured"), "{e}");
    let foreign = NatsAuthConfig {
        creds_file: Some(svc.foreign_creds_file()),
        ..NatsAuthConfig::default()
    };
    let e = refused(&svc.jwt_url, &foreign).await;
    assert!(e.contains("transport.nats_auth.creds_file"), "{e}");
    assert_no_secret("foreign creds", &e, &secrets);
    // The trusted user's `.creds` with its JWT's signature damaged: refused the same way.
    let dir = tempfile::tempdir().unwrap();
    let damaged = dir.path().join("damaged.creds");
    let text = std::fs::read_to_string(svc.creds_file()).unwrap();
    let jwt = text.lines().nth(1).unwrap();
    let flipped = format!(
        "{}{}",
        &jwt[..jwt.len() - 4],
        if jwt.ends_with("AAAA") {
            "BBBB"
        } else {
            "AAAA"
        }
    );
    std::fs::write(&damaged, text.replace(jwt, &flipped)).unwrap();
    private(&damaged);
    let e = refused(
        &svc.jwt_url,
        &NatsAuthConfig {
            creds_file: Some(damaged),
            ..NatsAuthConfig::default()
        },
    )
    .await;
    assert!(e.contains("transport.nats_auth.creds_file"), "{e}");
    assert_no_secret("damaged creds", &e, &secrets);
}

/// Makes `path` readable by its owner only (as an operator keeps a secret file).
fn private(path: &std::path::Path) {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600)).unwrap();
}

/// N9 of the second review: a NATS secret file others may read is refused before it is used,
/// for every kind (password, token, `.creds`, TLS client key), naming the key and the mode; the
/// same file made private connects. Another user of a shared host must not hold the instance's
/// NATS credentials.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn security_nats_secret_files_others_may_read_are_refused() {
    use std::os::unix::fs::PermissionsExt;
    let Some(svc) = nats_auth("security_nats_secret_files_others_may_read") else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    // Each secret copied world-readable, as a careless `cp` or a umask of 022 leaves it.
    let exposed = |name: &str, from: &std::path::Path| {
        let to = dir.path().join(name);
        std::fs::copy(from, &to).unwrap();
        std::fs::set_permissions(&to, std::fs::Permissions::from_mode(0o644)).unwrap();
        to
    };
    let tls_base = tls(&svc);
    let cases: Vec<(&str, &str, NatsAuthConfig)> = vec![
        (
            "password_file",
            &svc.url,
            NatsAuthConfig {
                password_file: Some(exposed("pw", &svc.password_file("instance_a"))),
                ..user(&svc, "instance_a")
            },
        ),
        (
            "token_file",
            &svc.tls_url,
            NatsAuthConfig {
                token_file: Some(exposed("token", &svc.token_file())),
                ..tls_base.clone()
            },
        ),
        (
            "creds_file",
            &svc.jwt_url,
            NatsAuthConfig {
                creds_file: Some(exposed("user.creds", &svc.creds_file())),
                ..NatsAuthConfig::default()
            },
        ),
        (
            "key_file",
            &svc.tls_url,
            NatsAuthConfig {
                key_file: Some(exposed(
                    "client-key.pem",
                    tls_base.key_file.as_ref().unwrap(),
                )),
                ..tls_base.clone()
            },
        ),
    ];
    for (key, url, auth) in cases {
        let e = refused(url, &auth).await;
        assert!(
            e.contains(&format!("transport.nats_auth.{key}")),
            "{key}: {e}"
        );
        assert!(
            e.contains("readable by group or others (mode 644)"),
            "{key}: {e}"
        );
        // The same file, private: the connection is made.
        for path in [
            &auth.password_file,
            &auth.token_file,
            &auth.creds_file,
            &auth.key_file,
        ]
        .into_iter()
        .flatten()
        {
            if path.starts_with(dir.path()) {
                private(path);
            }
        }
        let client = connect_with(url, &auth, "kvbm-test", Duration::from_secs(1))
            .await
            .unwrap_or_else(|e| panic!("{key} made private connects: {e}"));
        carries_messages(key, &client).await;
    }
}

/// Publishes on a fresh subject and reads it back over one client.
async fn carries_messages(what: &str, client: &async_nats::Client) {
    let subject = format!("kvbm.test.{}", unique("kind"));
    let mut sub = client.subscribe(subject.clone()).await.unwrap();
    client.flush().await.unwrap();
    client
        .publish(subject, what.to_string().into())
        .await
        .unwrap();
    let m = tokio::time::timeout(Duration::from_secs(5), sub.next())
        .await
        .unwrap_or_else(|_| panic!("{what}: message within 5 s"))
        .unwrap();
    assert_eq!(&m.payload[..], what.as_bytes());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn security_each_nats_credential_kind_connects_and_carries_messages() {
    let Some(svc) = nats_auth("security_each_credential_kind") else {
        return;
    };
    let inline = NatsAuthConfig {
        user: Some("instance_b".into()),
        password: Some(Secret::new(svc.read(&svc.password_file("instance_b")))),
        ..NatsAuthConfig::default()
    };
    let nkey = NatsAuthConfig {
        nkey_file: Some(svc.nkey_file()),
        ..NatsAuthConfig::default()
    };
    let inline_token = NatsAuthConfig {
        token_file: None,
        token: Some(Secret::new(svc.read(&svc.token_file()))),
        ..tls(&svc)
    };
    for (what, url, auth) in [
        ("user and password_file", &svc.url, user(&svc, "instance_a")),
        ("user and inline password", &svc.url, inline),
        ("nkey seed file", &svc.url, nkey),
        (
            "TLS: CA, client certificate, token_file",
            &svc.tls_url,
            tls(&svc),
        ),
        ("TLS: inline token", &svc.tls_url, inline_token),
        (
            "creds file (user JWT and nkey seed, operator mode)",
            &svc.jwt_url,
            NatsAuthConfig {
                creds_file: Some(svc.creds_file()),
                ..NatsAuthConfig::default()
            },
        ),
    ] {
        let c = connect_with(url, &auth, what, MS50)
            .await
            .unwrap_or_else(|e| panic!("{what}: {e}"));
        carries_messages(what, &c).await;
    }
}

/// The payloads `sub` receives within `window`.
async fn drain(sub: &mut async_nats::Subscriber, window: Duration) -> Vec<String> {
    let mut got = Vec::new();
    let end = tokio::time::Instant::now() + window;
    while let Ok(Some(m)) = tokio::time::timeout_at(end, sub.next()).await {
        got.push(String::from_utf8_lossy(&m.payload).into_owned());
    }
    got
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn security_accounts_isolate_tenants_events() {
    let Some(svc) = nats_auth("security_accounts_isolate") else {
        return;
    };
    let nonce = unique("iso");
    let a = connect_with(&svc.url, &user(&svc, "instance_a"), "a", MS50)
        .await
        .unwrap();
    let a2 = connect_with(
        &svc.url,
        &NatsAuthConfig {
            nkey_file: Some(svc.nkey_file()),
            ..NatsAuthConfig::default()
        },
        "a2",
        MS50,
    )
    .await
    .unwrap();
    let b = connect_with(&svc.url, &user(&svc, "instance_b"), "b", MS50)
        .await
        .unwrap();
    let mut a_sub = a.subscribe("kvbm.events").await.unwrap();
    let mut b_sub = b.subscribe("kvbm.events").await.unwrap();
    // A flush only puts bytes on the socket, and two connections reach the server in no set
    // order: the one proof that the server has processed a publish is a later message of the
    // same connection coming back. So every step ends with such a marker, read back; the
    // server delivers to one connection in the order it processed, so an event leaked to the
    // other tenant reaches its subscriber before that tenant's next marker.
    let from = |p: &str| format!("from-{p}-{nonce}");
    let marker = |p: &str| format!("marker-{p}-{nonce}");
    // Both subscriptions are live before anything is published.
    let mut seen_a = round_trip(&a, &mut a_sub, &marker("a-ready"), &nonce).await;
    let mut seen_b = round_trip(&b, &mut b_sub, &marker("b-ready"), &nonce).await;
    // Tenant B publishes; then tenant A, through another user of A's account; then B closes.
    publish(&b, &from("b")).await;
    seen_b.extend(round_trip(&b, &mut b_sub, &marker("b-sent"), &nonce).await);
    publish(&a2, &from("a")).await;
    seen_a.extend(round_trip(&a2, &mut a_sub, &marker("a-sent"), &nonce).await);
    seen_b.extend(round_trip(&b, &mut b_sub, &marker("b-end"), &nonce).await);
    // Each tenant sees its own account's event (the subscription works) and never the other's.
    assert_eq!(seen_a, vec![from("a")], "tenant A's subscriber");
    assert_eq!(seen_b, vec![from("b")], "tenant B's subscriber");
}

async fn publish(client: &async_nats::Client, payload: &str) {
    client
        .publish("kvbm.events", payload.to_string().into())
        .await
        .unwrap();
    client.flush().await.unwrap();
}

/// Publishes `marker` on `client` and reads `sub` up to it (within 10 s); returns the events
/// (`from-…` payloads ending in `nonce`) received before it.
async fn round_trip(
    client: &async_nats::Client,
    sub: &mut async_nats::Subscriber,
    marker: &str,
    nonce: &str,
) -> Vec<String> {
    publish(client, marker).await;
    let mut got = Vec::new();
    let end = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let m = tokio::time::timeout_at(end, sub.next())
            .await
            .unwrap_or_else(|_| panic!("`{marker}` within 10 s; before it: {got:?}"))
            .expect("subscription open");
        let p = String::from_utf8_lossy(&m.payload).into_owned();
        if p == marker {
            return got;
        }
        if p.starts_with("from-") && p.ends_with(nonce) {
            got.push(p);
        }
    }
}

/// A `kvbm-engine-worker` process configured through the environment (its NATS credentials
/// from `KVBM_TRANSPORT__NATS_AUTH__*`, never its command line).
struct Worker {
    child: Child,
    lines: std::sync::mpsc::Receiver<String>,
}

impl Worker {
    fn spawn(url: &str, instance: u64, env: &[(&str, String)]) -> Self {
        let dir = std::env::temp_dir();
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_kvbm-engine-worker"));
        cmd.args(["--nats", url, "--instance", &instance.to_string()])
            .args(["--rank", "0", "--blocks", "8", "--inner-dim", "64"])
            .current_dir(dir)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        for (k, v) in env {
            cmd.env(k, v);
        }
        let mut child = cmd.spawn().expect("spawn kvbm-engine-worker");
        let (tx, lines) = std::sync::mpsc::channel();
        for out in [
            Box::new(child.stdout.take().unwrap()) as Box<dyn std::io::Read + Send>,
            Box::new(child.stderr.take().unwrap()),
        ] {
            let tx = tx.clone();
            std::thread::spawn(move || {
                for line in BufReader::new(out).lines().map_while(Result::ok) {
                    if tx.send(line).is_err() {
                        return;
                    }
                }
            });
        }
        Self { child, lines }
    }

    /// Output lines until it prints `ready` (Ok) or exits (Err, with everything it printed).
    fn ready(&mut self) -> Result<String, String> {
        let start = Instant::now();
        let mut all = Vec::new();
        while start.elapsed() < Duration::from_secs(30) {
            match self.lines.recv_timeout(Duration::from_millis(100)) {
                Ok(l) if l.starts_with("ready ") => return Ok(l),
                Ok(l) => all.push(l),
                Err(_) => {
                    if let Ok(Some(status)) = self.child.try_wait() {
                        // Whatever is still buffered.
                        std::thread::sleep(Duration::from_millis(100));
                        all.extend(self.lines.try_iter());
                        return Err(format!("exited ({status}): {}", all.join("\n")));
                    }
                }
            }
        }
        panic!(
            "worker neither ready nor exited in 30 s: {}",
            all.join("\n")
        );
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Whether the worker behind `c` answers a `Describe`.
async fn describe(c: &NatsControl) -> bool {
    matches!(
        c.call(ControlRequest::Describe).await,
        Ok(ControlResponse::Described(_))
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn security_worker_user_cannot_publish_to_another_instance_or_forge_events() {
    let Some(svc) = nats_auth("security_worker_permissions") else {
        return;
    };
    let secrets = secrets(&svc);
    // A real worker process logged in as worker_a serves instance a1's rank 0 ...
    let mut worker = Worker::spawn(
        &svc.url,
        CONTROL_INSTANCE,
        &[
            ("KVBM_TRANSPORT__NATS_AUTH__USER", "worker_a".into()),
            (
                "KVBM_TRANSPORT__NATS_AUTH__PASSWORD_FILE",
                svc.password_file("worker_a").display().to_string(),
            ),
            // The NATS grants are what this test checks; member security explicitly off.
            ("KVBM_SECURITY__INSECURE", "true".into()),
        ],
    );
    worker.ready().expect("the worker serves under worker_a");
    // ... and its leader (leader_a) drives it.
    let leader = connect_with(&svc.url, &user(&svc, "leader_a"), "leader", MS50)
        .await
        .unwrap();
    let address = WorkerAddress::new(InstanceId(CONTROL_INSTANCE), 0);
    let control = NatsControl::new(
        leader.clone(),
        DEFAULT_CONTROL_PREFIX,
        address,
        Duration::from_secs(5),
    );
    assert!(describe(&control).await, "the leader reaches its worker");
    // N7 of the second review: under exactly the documented grants, the worker's beats reach
    // its leader (without them an instance of worker processes ends in `RanksMissing`).
    let mut beats = leader
        .subscribe(kvbm_cluster::transport::membership::members_subject(
            DEFAULT_CONTROL_PREFIX,
            InstanceId(CONTROL_INSTANCE),
        ))
        .await
        .unwrap();
    leader.flush().await.unwrap();
    tokio::time::timeout(Duration::from_secs(10), beats.next())
        .await
        .expect("the worker's beat reaches the leader within 10 s")
        .expect("the members subscription is open");

    // An observer in the same tenant, allowed to read events.
    let observer = connect_with(&svc.url, &user(&svc, "instance_a"), "observer", MS50)
        .await
        .unwrap();
    let mut events = observer.subscribe("kvbm.events").await.unwrap();
    observer.flush().await.unwrap();

    // The attacker holds worker_a's password and publishes to another instance's control
    // subject, to another rank of its own instance, and forges an event batch; it also tries
    // to read the events.
    let (tx, mut violations) = tokio::sync::mpsc::unbounded_channel::<String>();
    let attacker = async_nats::ConnectOptions::with_user_and_password(
        "worker_a".into(),
        svc.read(&svc.password_file("worker_a")),
    )
    .event_callback(move |event| {
        let tx = tx.clone();
        async move {
            if let async_nats::Event::ServerError(e) = event {
                let _ = tx.send(e.to_string().to_ascii_lowercase());
            }
        }
    })
    .connect(&svc.url)
    .await
    .unwrap();
    let nonce = unique("forged");
    let other_ctl = WorkerAddress::new(InstanceId(0xb2), 0).control_subject(DEFAULT_CONTROL_PREFIX);
    let other_rank =
        WorkerAddress::new(InstanceId(CONTROL_INSTANCE), 1).control_subject(DEFAULT_CONTROL_PREFIX);
    let _sub = attacker.subscribe("kvbm.events").await.unwrap();
    for subject in [&other_ctl, &other_rank, &"kvbm.events".to_string()] {
        attacker
            .publish(subject.clone(), nonce.clone().into())
            .await
            .unwrap();
    }
    let _ = attacker.flush().await;
    let mut seen = Vec::new();
    let end = tokio::time::Instant::now() + Duration::from_secs(10);
    let wanted = [
        format!("publish to \"{other_ctl}\""),
        format!("publish to \"{other_rank}\""),
        "publish to \"kvbm.events\"".to_string(),
        "subscription to \"kvbm.events\"".to_string(),
    ];
    while !wanted
        .iter()
        .all(|w| seen.iter().any(|s: &String| s.contains(w)))
    {
        match tokio::time::timeout_at(end, violations.recv()).await {
            Ok(Some(v)) => seen.push(v),
            _ => break,
        }
    }
    for w in &wanted {
        assert!(
            seen.iter()
                .any(|s| s.contains("permissions violation") && s.contains(w)),
            "the server refuses `{w}`: {seen:?}"
        );
    }
    // Nothing forged arrived, and the worker still serves its leader.
    let forged: Vec<String> = drain(&mut events, Duration::from_millis(300))
        .await
        .into_iter()
        .filter(|p| p == &nonce)
        .collect();
    assert!(forged.is_empty(), "forged events delivered: {forged:?}");
    assert!(describe(&control).await, "the worker keeps serving");

    // The leader's user cannot drive another instance's workers either.
    let (tx, mut violations) = tokio::sync::mpsc::unbounded_channel::<String>();
    let rogue_leader = async_nats::ConnectOptions::with_user_and_password(
        "leader_a".into(),
        svc.read(&svc.password_file("leader_a")),
    )
    .event_callback(move |event| {
        let tx = tx.clone();
        async move {
            if let async_nats::Event::ServerError(e) = event {
                let _ = tx.send(e.to_string().to_ascii_lowercase());
            }
        }
    })
    .connect(&svc.url)
    .await
    .unwrap();
    rogue_leader
        .publish(other_ctl.clone(), nonce.clone().into())
        .await
        .unwrap();
    let _ = rogue_leader.flush().await;
    let v = tokio::time::timeout(Duration::from_secs(10), violations.recv())
        .await
        .expect("a violation within 10 s")
        .unwrap();
    assert!(
        v.contains("permissions violation") && v.contains(&other_ctl),
        "{v}"
    );
    // The worker's output never showed a secret.
    let _ = worker.child.kill();
    let printed: Vec<String> = worker.lines.try_iter().collect();
    assert_no_secret("worker output", &printed.join("\n"), &secrets);
}

/// An address of this machine off the loopback interface (the one its default route uses),
/// if it has one. No packet is sent.
fn off_loopback_ip() -> Option<IpAddr> {
    let s = UdpSocket::bind("0.0.0.0:0").ok()?;
    s.connect("192.0.2.1:9").ok()?;
    let ip = s.local_addr().ok()?.ip();
    (!ip.is_loopback() && !ip.is_unspecified()).then_some(ip)
}

/// An open (no auth) `nats-server` listening on `ip`; killed on drop.
struct OpenServer {
    child: Child,
    url: String,
}

impl OpenServer {
    fn start(ip: IpAddr) -> Self {
        let port = TcpListener::bind((ip, 0))
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let child = Command::new("nats-server")
            .args(["-a", &ip.to_string(), "-p", &port.to_string()])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("nats-server is on PATH (cargo xtask services installs it)");
        let start = Instant::now();
        while std::net::TcpStream::connect((ip, port)).is_err() {
            assert!(
                start.elapsed() < Duration::from_secs(10),
                "nats-server starts"
            );
            std::thread::sleep(Duration::from_millis(10));
        }
        OpenServer {
            child,
            url: format!("nats://{ip}:{port}"),
        }
    }
}

impl Drop for OpenServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn runtime(nats_url: &str, sets: &[(&str, serde_json::Value)]) -> KvbmRuntime {
    let mut b = KvbmRuntime::builder()
        .tokio_handle(tokio::runtime::Handle::current())
        .set("logical.block_size", 4)
        .set("tiers.g1_blocks", 8)
        .set("tiers.g2_blocks", 8)
        .set("events.subject", format!("kvbm.test.{}", unique("sbd")))
        .set("transport.nats_url", nats_url)
        .set("transport.heartbeat_interval_ms", 50)
        .set("transport.heartbeat_timeout_ms", 400);
    for (k, v) in sets {
        b = b.set(*k, v.clone());
    }
    b.build().unwrap()
}

async fn build(rt: &KvbmRuntime) -> kvbm_engine::Result<Instance> {
    Instance::builder(&rt.handle())
        .id(InstanceId(0x5bd))
        .geometry(common::geometry_with(32))
        .build()
        .await
}

/// N6 of the second review: loopback is not a boundary (a shared host's other users and
/// containers reach its ports). Attack: a lone instance on loopback, its data plane and NATS
/// server both there, started without member credentials: refused, naming the keys, before it
/// joins anything; with `security.insecure = true` it runs (logged), and with its own
/// credential it runs sealed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn security_a_lone_instance_on_loopback_without_credentials_is_refused() {
    let Some(nats) = kvbm_tests::services::nats("security_lone_loopback") else {
        return;
    };
    assert!(kvbm_cluster::security::is_loopback(&nats.url));
    let rt = runtime(&nats.url, &[]);
    let e = build(&rt)
        .await
        .expect_err("refused on loopback too")
        .to_string();
    assert!(
        e.contains("security.credential_file") && e.contains("security.insecure"),
        "{e}"
    );
    rt.shutdown();
    let rt = runtime(&nats.url, &[("security.insecure", true.into())]);
    let i = build(&rt).await.expect("insecure = true runs");
    assert!(!i.security().is_on());
    i.shutdown().await;
    rt.shutdown();
    let root = kvbm_cluster::security::RootKey::generate().unwrap();
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let path = dir.path().join("leader.cred");
    root.issue(
        InstanceId(0x5bd),
        kvbm_cluster::security::Role::Leader,
        0,
        "ns",
        Duration::from_secs(3600),
    )
    .unwrap()
    .save(&path)
    .unwrap();
    let rt = runtime(
        &nats.url,
        &[
            ("security.trust_root", root.trust_root().to_hex().into()),
            (
                "security.credential_file",
                path.display().to_string().into(),
            ),
        ],
    );
    let i = build(&rt).await.expect("with a credential it runs");
    assert!(i.security().is_on());
    i.shutdown().await;
    rt.shutdown();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn security_off_loopback_without_credentials_is_refused_naming_the_key_unless_insecure() {
    let Some(nats) = kvbm_tests::services::nats("security_off_loopback") else {
        return;
    };
    // A data plane bound to every interface, no member credentials: refused, naming the keys.
    let open_bind = [("transport.data_plane_bind", "0.0.0.0:0".into())];
    let rt = runtime(&nats.url, &open_bind);
    let e = build(&rt).await.expect_err("refused").to_string();
    assert!(
        e.contains("security.credential_file") && e.contains("security.insecure"),
        "{e}"
    );
    rt.shutdown();
    // With security.insecure, the same instance runs (and serves its peers).
    let insecure = [open_bind[0].clone(), ("security.insecure", true.into())];
    let rt = runtime(&nats.url, &insecure);
    let i = build(&rt).await.expect("insecure = true runs");
    assert!(i.data_plane().unwrap().local_addr().ip().is_unspecified());
    i.shutdown().await;
    rt.shutdown();

    let Some(ip) = off_loopback_ip() else {
        eprintln!("security_off_loopback: no address off loopback here; NATS half skipped");
        return;
    };
    let server = OpenServer::start(ip);
    // A NATS server off loopback without NATS credentials: the instance is refused naming
    // transport.nats_auth (member credentials do not stand in for the server's own auth) ...
    let root = kvbm_cluster::security::RootKey::generate().unwrap();
    let cred = root
        .issue(
            InstanceId(0x5bd),
            kvbm_cluster::security::Role::Leader,
            0,
            "ns",
            Duration::from_secs(3600),
        )
        .unwrap();
    let cred = std::sync::Arc::new(cred);
    let secured = || {
        kvbm_cluster::security::Security::with_credential(
            root.trust_root(),
            cred.clone(),
            &kvbm_cluster::security::SecurityConfig::default(),
        )
    };
    let rt = runtime(&server.url, &[]);
    let e = Instance::builder(&rt.handle())
        .security(secured())
        .geometry(common::geometry_with(32))
        .build()
        .await
        .expect_err("refused");
    assert_eq!(e.config_key(), Some("transport.nats_auth"), "{e}");
    assert!(e.to_string().contains("security.insecure"), "{e}");
    rt.shutdown();
    // ... and runs with security.insecure.
    let rt = runtime(&server.url, &[("security.insecure", true.into())]);
    let i = Instance::builder(&rt.handle())
        .security(secured())
        .geometry(common::geometry_with(32))
        .build()
        .await
        .expect("insecure = true runs");
    i.shutdown().await;
    rt.shutdown();

    // The worker binary: the same rule, named in its error; with insecure it serves.
    let mut w = Worker::spawn(&server.url, 7, &[]);
    let e = w.ready().expect_err("refused");
    assert!(
        e.contains("security.credential_file") || e.contains("transport.nats_auth"),
        "{e}"
    );
    let mut w = Worker::spawn(
        &server.url,
        7,
        &[("KVBM_SECURITY__INSECURE", "true".into())],
    );
    w.ready().expect("insecure = true serves");
    // And a url with credentials in it is refused, the password not echoed.
    let with_pw = server.url.replace("nats://", "nats://u:pw-in-arg-33aa@");
    let mut w = Worker::spawn(&with_pw, 7, &[("KVBM_SECURITY__INSECURE", "true".into())]);
    let e = w.ready().expect_err("refused");
    assert!(e.contains("--nats") && e.contains("userinfo"), "{e}");
    assert!(!e.contains("pw-in-arg-33aa"), "{e}");
}

#[test]
fn security_secrets_never_appear_in_debug_serialization_or_config_errors() {
    // From the environment: kept as given (a leading zero too), printed nowhere.
    let config = ConfigBuilder::from_env_vars([
        ("KVBM_TRANSPORT__NATS_AUTH__USER", "instance_a"),
        ("KVBM_TRANSPORT__NATS_AUTH__PASSWORD", "0123-pw-6c1e"),
        ("KVBM_PHYSICAL__S3__BUCKET", "b"),
        ("KVBM_PHYSICAL__S3__ACCESS_KEY", "ak"),
        ("KVBM_PHYSICAL__S3__SECRET_KEY", "s3-secret-9d8c"),
    ])
    .unwrap()
    .build()
    .unwrap();
    let auth = &config.transport.nats_auth;
    assert_eq!(auth.password.as_ref().unwrap().expose(), "0123-pw-6c1e");
    let debug = format!("{config:?}");
    let json = serde_json::to_string(&config).unwrap();
    for (what, text) in [("Debug", &debug), ("JSON", &json)] {
        assert!(!text.contains("0123-pw-6c1e"), "{what}: {text}");
        assert!(!text.contains("s3-secret-9d8c"), "{what}: {text}");
        assert!(text.contains("<redacted>"), "{what}: {text}");
    }
    assert_eq!(format!("{}", Secret::new("x-secret")), "<redacted>");
    // A secret of digits stays text: "00789" is not the number 789.
    let config = ConfigBuilder::from_env_vars([("KVBM_TRANSPORT__NATS_AUTH__TOKEN", "00789")])
        .unwrap()
        .build()
        .unwrap();
    let token = config.transport.nats_auth.token.as_ref().unwrap();
    assert_eq!(token.expose(), "00789");

    // A url with userinfo is refused naming the key; neither the password nor the url shown.
    let e = ConfigBuilder::new()
        .set("transport.nats_url", "nats://u:hunter2-pw-71@10.0.0.1:4222")
        .build()
        .unwrap_err();
    assert_eq!(e.config_key(), Some("transport.nats_url"), "{e}");
    assert!(!e.to_string().contains("hunter2-pw-71"), "{e}");
    let e = ConfigBuilder::new()
        .set("transport.nats_url", "nats://tok3n-ab12@127.0.0.1:4222")
        .build()
        .unwrap_err();
    assert!(!e.to_string().contains("tok3n-ab12"), "{e}");

    // Conflicting or incomplete credentials are named by key, values never shown.
    for (sets, key) in [
        (
            vec![("user", "u"), ("password", "p-1"), ("token", "t-1")],
            "transport.nats_auth.user",
        ),
        (vec![("user", "u")], "transport.nats_auth.password_file"),
        (vec![("password", "p-2-secret")], "transport.nats_auth.user"),
        (
            vec![("token", "t-2-secret"), ("token_file", "/x")],
            "transport.nats_auth.token_file",
        ),
        (vec![("cert_file", "/c")], "transport.nats_auth.key_file"),
    ] {
        let mut b = ConfigBuilder::new();
        for (k, v) in &sets {
            b = b.set(format!("transport.nats_auth.{k}"), v);
        }
        let e = b.build().unwrap_err();
        assert_eq!(e.config_key(), Some(key), "{sets:?}: {e}");
        for (k, v) in &sets {
            if *k == "password" || *k == "token" {
                assert!(!e.to_string().contains(v), "{e}");
            }
        }
    }
}
