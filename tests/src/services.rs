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
