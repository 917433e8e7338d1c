//! Finding the real servers that `cargo xtask ci` provisions.
//!
//! `xtask` starts an S3-compatible server (s3s-fs) and a NATS server on free loopback ports and
//! exports where they are through environment variables. A test that needs one calls
//! [`s3`] or [`nats`]:
//!
//! * when the variables are set, it gets the endpoint;
//! * when they are missing and `KVBM_TEST_SKIP_SERVICES=1` is set (a quick local run), it gets
//!   `None` and should return early, having printed why;
//! * otherwise it panics with a message saying to run `cargo xtask ci`, so a CI run can never pass
//!   by silently skipping its real-server tests.
//!
//! The variable names are the contract with `xtask/src/services.rs`; keep them in step.

/// Environment variable naming the S3 endpoint, e.g. `http://127.0.0.1:43121`.
pub const S3_ENDPOINT: &str = "KVBM_TEST_S3_ENDPOINT";
/// Environment variable naming the bucket xtask created.
pub const S3_BUCKET: &str = "KVBM_TEST_S3_BUCKET";
/// Environment variable with the access key id.
pub const S3_ACCESS_KEY: &str = "KVBM_TEST_S3_ACCESS_KEY";
/// Environment variable with the secret access key.
pub const S3_SECRET_KEY: &str = "KVBM_TEST_S3_SECRET_KEY";
/// Environment variable naming the NATS url, e.g. `nats://127.0.0.1:4222`.
pub const NATS_URL: &str = "KVBM_TEST_NATS_URL";
/// Environment variable naming the NATS server with accounts and users (see
/// `xtask/src/services.rs`), e.g. `nats://127.0.0.1:4223`.
pub const NATS_AUTH_URL: &str = "KVBM_TEST_NATS_AUTH_URL";
/// Environment variable naming the NATS server that demands TLS, a client certificate and a
/// token, e.g. `tls://127.0.0.1:4224`.
pub const NATS_TLS_URL: &str = "KVBM_TEST_NATS_TLS_URL";
/// Environment variable naming the NATS server in operator mode (JWT accounts; users log in
/// with `.creds` files), e.g. `nats://127.0.0.1:4225`.
pub const NATS_JWT_URL: &str = "KVBM_TEST_NATS_JWT_URL";
/// Environment variable naming the directory of those servers' secrets and certificates.
pub const NATS_AUTH_DIR: &str = "KVBM_TEST_NATS_AUTH_DIR";
/// Set to `1` to let tests that need a server skip when none is provisioned.
pub const SKIP_SERVICES: &str = "KVBM_TEST_SKIP_SERVICES";

/// Where the provisioned S3-compatible server is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct S3Service {
    /// `http://host:port`, no bucket in it.
    pub endpoint: String,
    /// A bucket that exists and is writable.
    pub bucket: String,
    /// Access key id.
    pub access_key: String,
    /// Secret access key.
    pub secret_key: String,
}

/// Where the provisioned NATS server is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NatsService {
    /// `nats://host:port`.
    pub url: String,
}

/// Where the authenticated NATS servers are, and their secrets' files.
///
/// The server at [`url`](Self::url) has two accounts (tenants): `TENANT_A` with the users
/// `instance_a`, `leader_a` and `worker_a` (role permissions of `docs/security.md`;
/// `leader_a`/`worker_a` for instance [`CONTROL_INSTANCE`]'s control subjects) and an nkey
/// user with the instance role, and `TENANT_B` with `instance_b`. The server at
/// [`tls_url`](Self::tls_url) demands TLS with a client certificate, and a token.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NatsAuthService {
    /// `nats://host:port` of the server with accounts.
    pub url: String,
    /// `tls://host:port` of the TLS server.
    pub tls_url: String,
    /// `nats://host:port` of the server in operator mode.
    pub jwt_url: String,
    /// The directory of the files below.
    pub dir: std::path::PathBuf,
}

/// The instance whose control subjects `leader_a` may publish to and `worker_a` serve.
pub const CONTROL_INSTANCE: u64 = 0xa1;

impl NatsAuthService {
    /// The password file of `user` (`instance_a`, `leader_a`, `worker_a`, `instance_b`).
    pub fn password_file(&self, user: &str) -> std::path::PathBuf {
        self.dir.join(format!("{user}.password"))
    }
    /// The nkey seed file of `TENANT_A`'s nkey user (instance role).
    pub fn nkey_file(&self) -> std::path::PathBuf {
        self.dir.join("nkey_a.seed")
    }
    /// The `.creds` file (user JWT and nkey seed) of a user of the account the operator-mode
    /// server trusts.
    pub fn creds_file(&self) -> std::path::PathBuf {
        self.dir.join("user_jwt.creds")
    }
    /// A well-formed `.creds` file of a user of an account the operator never signed.
    pub fn foreign_creds_file(&self) -> std::path::PathBuf {
        self.dir.join("foreign_jwt.creds")
    }
    /// The TLS server's token file.
    pub fn token_file(&self) -> std::path::PathBuf {
        self.dir.join("token")
    }
    /// The CA that signed both servers' and the client's certificates.
    pub fn ca_file(&self) -> std::path::PathBuf {
        self.dir.join("ca.pem")
    }
    /// The client certificate the TLS server accepts.
    pub fn cert_file(&self) -> std::path::PathBuf {
        self.dir.join("client-cert.pem")
    }
    /// Its private key.
    pub fn key_file(&self) -> std::path::PathBuf {
        self.dir.join("client-key.pem")
    }
    /// The secret in `file` (one line).
    ///
    /// # Panics
    /// When the file cannot be read.
    pub fn read(&self, file: &std::path::Path) -> String {
        std::fs::read_to_string(file)
            .unwrap_or_else(|e| panic!("{}: {e}", file.display()))
            .trim()
            .to_string()
    }
}

/// The authenticated NATS servers provisioned by `cargo xtask ci`, `None` only under the
/// explicit opt-out.
///
/// # Panics
/// When no server is provisioned and the opt-out is not set.
pub fn nats_auth(test: &str) -> Option<NatsAuthService> {
    resolve(
        test,
        "the authenticated NATS servers",
        &|k| std::env::var(k).ok(),
        |get| {
            Some(NatsAuthService {
                url: get(NATS_AUTH_URL)?,
                tls_url: get(NATS_TLS_URL)?,
                jwt_url: get(NATS_JWT_URL)?,
                dir: get(NATS_AUTH_DIR)?.into(),
            })
        },
    )
}

/// The S3 server provisioned by `cargo xtask ci`, `None` only under the explicit opt-out.
///
/// # Panics
/// When no server is provisioned and the opt-out is not set.
pub fn s3(test: &str) -> Option<S3Service> {
    resolve(
        test,
        "an S3-compatible server",
        &|k| std::env::var(k).ok(),
        |get| {
            Some(S3Service {
                endpoint: get(S3_ENDPOINT)?,
                bucket: get(S3_BUCKET)?,
                access_key: get(S3_ACCESS_KEY)?,
                secret_key: get(S3_SECRET_KEY)?,
            })
        },
    )
}

/// The NATS server provisioned by `cargo xtask ci`, `None` only under the explicit opt-out.
///
/// # Panics
/// When no server is provisioned and the opt-out is not set.
pub fn nats(test: &str) -> Option<NatsService> {
    resolve(test, "a NATS server", &|k| std::env::var(k).ok(), |get| {
        Some(NatsService {
            url: get(NATS_URL)?,
        })
    })
}

fn resolve<T>(
    test: &str,
    what: &str,
    get: &dyn Fn(&str) -> Option<String>,
    build: impl FnOnce(&dyn Fn(&str) -> Option<String>) -> Option<T>,
) -> Option<T> {
    if let Some(found) = build(get) {
        return Some(found);
    }
    if get(SKIP_SERVICES).as_deref() == Some("1") {
        eprintln!("{test}: skipped, needs {what} and {SKIP_SERVICES}=1 is set");
        return None;
    }
    panic!(
        "{test} needs {what}, but none is provisioned. Run the tests through `cargo xtask ci` \
         (it starts the servers), or set {SKIP_SERVICES}=1 to skip such tests in a quick local run."
    );
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn lookup(map: HashMap<&'static str, &'static str>) -> impl Fn(&str) -> Option<String> {
        move |k| map.get(k).map(|v| v.to_string())
    }

    #[test]
    fn found_when_all_variables_set() {
        let get = lookup(HashMap::from([(NATS_URL, "nats://127.0.0.1:1")]));
        let got = resolve("t", "nats", &get, |g| g(NATS_URL));
        assert_eq!(got.as_deref(), Some("nats://127.0.0.1:1"));
    }

    #[test]
    fn skipped_only_under_opt_out() {
        let get = lookup(HashMap::from([(SKIP_SERVICES, "1")]));
        let got = resolve("t", "nats", &get, |g| g(NATS_URL));
        assert_eq!(got, None);
    }

    #[test]
    fn missing_server_without_opt_out_panics_with_instructions() {
        let get = lookup(HashMap::new());
        let err = std::panic::catch_unwind(|| resolve("t", "nats", &get, |g| g(NATS_URL)))
            .expect_err("must panic");
        let msg = err.downcast_ref::<String>().cloned().unwrap_or_default();
        assert!(msg.contains("cargo xtask ci"), "message was: {msg}");
    }
}
