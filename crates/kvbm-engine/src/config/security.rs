//! The `[security]` section: who may speak in the cluster (the trust root, this member's
//! credential, the insecure opt-out, the verifier's bounds).
//!
//! It is configuration only: the keys, certificates and sealing that use it are the cluster
//! plane's (`kvbm_cluster::security`), so the engine's core carries no cryptography. The one
//! rule both need, whether an endpoint is on the loopback interface, is [`is_loopback`]
//! (kvbm-physical's, which its S3 client needs too).

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

pub use kvbm_physical::is_loopback;

use crate::address::InstanceId;

/// The `[security]` configuration section (see `docs/security.md`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SecurityConfig {
    /// The cluster's trust root: 64 hex digits (`kvbm security init` prints them). While a
    /// root is rotated, several, separated by commas: a certificate any of them signed is
    /// accepted (see `docs/security.md`, "Rotating the root").
    pub trust_root: Option<String>,
    /// This member's credential file (`kvbm security issue` writes it; mode 0600). Where one
    /// configuration serves several instances (`kvbm replay --instances`), `{instance}` in the
    /// path is replaced by each instance's id in 16 hex digits ([`SecurityConfig::for_instance`]).
    pub credential_file: Option<PathBuf>,
    /// Run a cluster without member credentials (on loopback too: security is on by default
    /// everywhere), or off loopback without NATS credentials. Logged loudly at every start.
    pub insecure: bool,
    /// Largest accepted clock difference between sender and receiver, in milliseconds.
    pub max_clock_skew_ms: u64,
    /// Sequence numbers tracked per sender against replays.
    pub replay_window: u32,
    /// Senders whose certificates and replay windows are remembered at once.
    pub max_senders: usize,
    /// Also tag every data-plane payload with keyed BLAKE3 (the header, which carries the
    /// payload's checksum, is always tagged): `true` on every connection, `false` never (the
    /// other end may still ask), absent (the default) on every connection whose other end is
    /// off the loopback interface, where an on-path party could change bytes.
    pub dataplane_payload_mac: Option<bool>,
    /// The revocation list: one line per revoked certificate (its fingerprint, 64 hex digits,
    /// as `kvbm security show` prints it) or `instance <id>` for every certificate of an
    /// instance; `#` comments. Re-read when it changes. A file others may write is refused.
    /// Default: none.
    pub revoked_file: Option<PathBuf>,
    /// How often the revocation list is looked at again, and live data-plane sessions are
    /// re-checked (revocation and expiry), in milliseconds. Default: 5000. At least 1.
    pub revocation_check_ms: u64,
    /// Warn (at start, then at most once an hour) when this member's own certificate expires
    /// within this many milliseconds. Default: 86 400 000 (one day).
    pub expiry_warning_ms: u64,
}

impl Default for SecurityConfig {
    fn default() -> Self {
        Self {
            trust_root: None,
            credential_file: None,
            insecure: false,
            max_clock_skew_ms: 30_000,
            replay_window: 4096,
            max_senders: 4096,
            dataplane_payload_mac: None,
            revoked_file: None,
            revocation_check_ms: 5000,
            expiry_warning_ms: 86_400_000,
        }
    }
}

impl SecurityConfig {
    /// This configuration for instance `id`: `{instance}` in `credential_file` replaced by the
    /// id in 16 hex digits (`/etc/kvbm/{instance}.cred` → `/etc/kvbm/000000000000002a.cred`).
    pub fn for_instance(&self, id: InstanceId) -> Self {
        let mut c = self.clone();
        if let Some(f) = &self.credential_file {
            let path = f.to_string_lossy();
            if path.contains("{instance}") {
                c.credential_file =
                    Some(path.replace("{instance}", &format!("{:016x}", id.0)).into());
            }
        }
        c
    }

    /// The trust roots named (`trust_root` split at commas, trimmed; empty without one).
    pub fn trust_roots(&self) -> Vec<&str> {
        self.trust_root
            .as_deref()
            .map(|r| {
                r.split(',')
                    .map(str::trim)
                    .filter(|s| !s.is_empty())
                    .collect()
            })
            .unwrap_or_default()
    }

    /// Whether a trust root and a credential are named (the credential itself is loaded, per
    /// instance, when a member starts).
    pub fn has_credentials(&self) -> bool {
        self.trust_root.is_some() && self.credential_file.is_some()
    }

    /// Checks the values (both of `trust_root` and `credential_file`, or neither; the trust
    /// root's 64 hex digits; whether they are a key is checked when kvbm-cluster loads it).
    ///
    /// # Errors
    /// `(key, message)` for the first bad value.
    pub fn validate(&self) -> Result<(), (&'static str, String)> {
        match (&self.trust_root, &self.credential_file) {
            (Some(_), None) => {
                return Err((
                    "security.credential_file",
                    "security.trust_root is set but no credential file".into(),
                ));
            }
            (None, Some(_)) => {
                return Err((
                    "security.trust_root",
                    "security.credential_file is set but no trust root".into(),
                ));
            }
            (Some(r), Some(_)) => {
                for r in self.trust_roots() {
                    if r.len() != 64 || !r.bytes().all(|b| b.is_ascii_hexdigit()) {
                        return Err((
                            "security.trust_root",
                            "expected 64 hex digits per root, several separated by commas \
                             (`kvbm security init` prints them)"
                                .into(),
                        ));
                    }
                }
                if r.trim().is_empty() {
                    return Err(("security.trust_root", "is empty".into()));
                }
            }
            (None, None) => {}
        }
        if self.max_clock_skew_ms == 0 {
            return Err(("security.max_clock_skew_ms", "must be at least 1".into()));
        }
        if self.replay_window == 0 {
            return Err(("security.replay_window", "must be at least 1".into()));
        }
        if self.max_senders == 0 {
            return Err(("security.max_senders", "must be at least 1".into()));
        }
        if self.revocation_check_ms == 0 {
            return Err(("security.revocation_check_ms", "must be at least 1".into()));
        }
        Ok(())
    }
}
