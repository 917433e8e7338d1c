//! Removing a member: the revocation list (`security.revoked_file`).
//!
//! # Why
//!
//! A certificate is otherwise good until it expires: without a list, the only way to remove a
//! member whose key leaked, or that left, was a new root for everyone. The list names
//! certificates by fingerprint ([`MemberCert::fingerprint`], printed by `kvbm security show`
//! and `issue`) or every certificate of an instance (`instance <id>`), and every check of a
//! certificate consults it: sealed messages (heartbeats, events, snapshots, control, beats),
//! data-plane handshakes, and live data-plane sessions, which are re-checked every
//! `security.revocation_check_ms` while they last.
//!
//! # Invariants
//!
//! * The file is looked at again at most every `revocation_check_ms` (its modification time
//!   and length; read again only when they changed), lazily, by the check that needs it: no
//!   task of its own.
//! * A list that cannot be read or parsed at start is an error naming the file and the line.
//!   Later, an unreadable or malformed version is logged and **the last good list is kept**:
//!   a failure never un-revokes anyone.
//! * The file must not be writable by group or others: whoever may write it may remove any
//!   member (it holds no secret, so reading is fine).
//!
//! # Locks
//!
//! One `parking_lot` mutex over the loaded list, a leaf: held to compare and swap the list,
//! never across file I/O of another caller's and never across an `.await`.

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant, SystemTime};

use parking_lot::Mutex;

use super::{MemberCert, SecurityError, unhex};

/// What a list revokes.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
struct List {
    fingerprints: HashSet<[u8; 32]>,
    instances: HashSet<u64>,
}

/// The file's state when last read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Stamp {
    modified: Option<SystemTime>,
    len: u64,
}

#[derive(Debug)]
struct State {
    list: List,
    stamp: Stamp,
    looked: Instant,
}

/// The revocation list of one member (`security.revoked_file`): consulted by every check of a
/// certificate, looked at again every `security.revocation_check_ms` (see [`crate::security`]).
#[derive(Debug)]
pub struct Revocations {
    path: PathBuf,
    every: Duration,
    state: Mutex<State>,
}

impl Revocations {
    /// Loads `path`, to be looked at again every `every`.
    ///
    /// # Errors
    /// [`SecurityError`] naming the file: unreadable, writable by group or others, or a line
    /// that is neither a fingerprint nor `instance <id>`.
    pub fn load(path: &Path, every: Duration) -> Result<Self, SecurityError> {
        let (list, stamp) = read(path)?;
        Ok(Self {
            path: path.to_owned(),
            every,
            state: Mutex::new(State {
                list,
                stamp,
                looked: Instant::now(),
            }),
        })
    }

    /// Whether `cert` is revoked (looking at the file again first when it is due).
    pub fn is_revoked(&self, cert: &MemberCert) -> bool {
        self.refresh();
        let st = self.state.lock();
        st.list.instances.contains(&cert.instance.0)
            || st.list.fingerprints.contains(&cert.fingerprint())
    }

    /// The file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// How often the file is looked at again.
    pub fn every(&self) -> Duration {
        self.every
    }

    fn refresh(&self) {
        let now = Instant::now();
        let stamp = {
            let mut st = self.state.lock();
            if now.duration_since(st.looked) < self.every {
                return;
            }
            st.looked = now;
            st.stamp
        };
        match stamp_of(&self.path) {
            Ok(s) if s == stamp => {}
            Ok(_) => match read(&self.path) {
                Ok((list, stamp)) => {
                    let mut st = self.state.lock();
                    if st.list != list {
                        tracing::info!(
                            file = %self.path.display(),
                            certificates = list.fingerprints.len(),
                            instances = list.instances.len(),
                            "revocation list reloaded"
                        );
                    }
                    st.list = list;
                    st.stamp = stamp;
                }
                Err(e) => tracing::warn!(
                    error = %e,
                    "the revocation list changed and cannot be read: keeping the last one"
                ),
            },
            Err(e) => tracing::warn!(
                error = %e,
                "the revocation list cannot be looked at: keeping the last one"
            ),
        }
    }
}

/// An I/O failure on the list, naming its key and file.
fn io(path: &Path, e: std::io::Error) -> SecurityError {
    SecurityError::Io {
        path: path.to_owned(),
        source: std::io::Error::new(e.kind(), format!("security.revoked_file: {e}")),
    }
}

fn stamp_of(path: &Path) -> Result<Stamp, SecurityError> {
    let m = std::fs::metadata(path).map_err(|e| io(path, e))?;
    Ok(Stamp {
        modified: m.modified().ok(),
        len: m.len(),
    })
}

fn read(path: &Path) -> Result<(List, Stamp), SecurityError> {
    let name = path.display();
    let stamp = stamp_of(path)?;
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(path)
            .map_err(|e| io(path, e))?
            .permissions()
            .mode();
        if mode & 0o022 != 0 {
            return Err(SecurityError::Invalid(format!(
                "security.revoked_file {name}: mode {:o} lets group or others write it (and so \
                 remove any member); chmod go-w",
                mode & 0o777
            )));
        }
    }
    let text = std::fs::read_to_string(path).map_err(|e| io(path, e))?;
    let mut list = List::default();
    for (i, line) in text.lines().enumerate() {
        let line = line.split('#').next().unwrap_or("").trim();
        if line.is_empty() {
            continue;
        }
        let bad = || {
            SecurityError::Invalid(format!(
                "security.revoked_file {name} line {}: {line:?} is neither a certificate \
                 fingerprint (64 hex digits) nor `instance <id>`",
                i + 1
            ))
        };
        if let Some(id) = line.strip_prefix("instance") {
            let id = id.trim();
            let id = id.strip_prefix("0x").unwrap_or(id);
            list.instances
                .insert(u64::from_str_radix(id, 16).map_err(|_| bad())?);
        } else {
            let fp: [u8; 32] = unhex(line)
                .and_then(|b| b.try_into().ok())
                .ok_or_else(bad)?;
            list.fingerprints.insert(fp);
        }
    }
    Ok((list, stamp))
}
