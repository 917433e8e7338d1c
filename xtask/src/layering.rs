//! `cargo xtask layering`: the crate layering rule, enforced from `cargo metadata`.
//!
//! ```text
//!   layer 5   kvbm-cli          kvbm-vllm         (siblings)
//!   layer 4   kvbm-cluster
//!   layer 3   kvbm-engine
//!   layer 2   kvbm-tiering
//!   layer 1   kvbm-offload
//!   layer 0   kvbm-logical      kvbm-physical     (siblings: neither depends on the other)
//! ```
//!
//! A crate may depend only on crates in a lower layer. That holds for every kind of dependency
//! (normal, build and dev): a lower crate's tests that reached upward would tie the layers together
//! just as firmly. Two crates sit outside the stack:
//!
//! * `kvbm-tests` holds workspace integration tests (dev-dependencies on everything) and a small
//!   library of test helpers with no internal dependencies, so any crate may take it as a
//!   **dev**-dependency and none may take it as a normal one;
//! * `xtask`, the task runner, which depends on no kvbm crate.
//!
//! Any other workspace member is an error until it is placed in [`LAYERS`], so a new crate cannot
//! slip past the rule.
//!
//! The engine's core (`kvbm-engine`: the tiers, leader, sessions, manager, moves, workers,
//! runtime, configuration) and the cluster plane (`kvbm-cluster`: control, NATS, the data
//! plane, pub/sub, presence, shared G4, security, the binaries) are two crates, so "the core
//! never uses the cluster plane" is the rule above. One more rule keeps the core lean
//! ([`CLUSTER_ONLY`]): no crate below the cluster plane depends (normally) on what only the
//! cluster needs, the NATS client and the member keys' cryptography.

use std::fmt;
use std::process::Command;

use anyhow::{Context, Result, bail};
use serde_json::Value;

/// The layered crates and their layer, bottom (0) to top.
pub(crate) const LAYERS: &[(&str, u8)] = &[
    ("kvbm-logical", 0),
    ("kvbm-physical", 0),
    ("kvbm-offload", 1),
    ("kvbm-tiering", 2),
    ("kvbm-engine", 3),
    ("kvbm-cluster", 4),
    ("kvbm-cli", 5),
    ("kvbm-vllm", 5),
];

/// Third-party crates only the cluster plane may depend on (normal dependencies): the NATS
/// client and the member keys' cryptography. A core that needed them would be the cluster plane
/// again.
pub(crate) const CLUSTER_ONLY: &[&str] = &["async-nats", "ed25519-dalek", "curve25519-dalek"];

/// The cluster plane's crate: [`CLUSTER_ONLY`] holds below it.
const CLUSTER: &str = "kvbm-cluster";

/// The workspace test-support crate (dev-only below the top).
const TEST_SUPPORT: &str = "kvbm-tests";
/// The task runner.
const XTASK: &str = "xtask";

/// One edge that breaks the rule.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Violation {
    pub(crate) from: String,
    pub(crate) to: String,
    pub(crate) kind: String,
    pub(crate) why: String,
}

impl fmt::Display for Violation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} -> {} ({} dependency): {}",
            self.from, self.to, self.kind, self.why
        )
    }
}

fn layer_of(name: &str) -> Option<u8> {
    LAYERS.iter().find(|(n, _)| *n == name).map(|(_, l)| *l)
}

/// Checks a `cargo metadata --format-version 1` document and returns every violation.
pub(crate) fn check(metadata: &Value) -> Result<Vec<Violation>> {
    let packages = metadata["packages"]
        .as_array()
        .context("metadata has no `packages` array")?;
    let members: Vec<&str> = metadata["workspace_members"]
        .as_array()
        .context("metadata has no `workspace_members` array")?
        .iter()
        .filter_map(Value::as_str)
        .collect();

    let mut internal = Vec::new();
    for package in packages {
        let id = package["id"].as_str().unwrap_or_default();
        if members.contains(&id) {
            internal.push(package);
        }
    }
    let internal_names: Vec<&str> = internal.iter().filter_map(|p| p["name"].as_str()).collect();

    let mut violations = Vec::new();
    for package in &internal {
        let from = package["name"].as_str().context("package without a name")?;
        if from != TEST_SUPPORT && from != XTASK && layer_of(from).is_none() {
            violations.push(Violation {
                from: from.to_string(),
                to: "-".to_string(),
                kind: "membership".to_string(),
                why: format!(
                    "workspace member `{from}` has no layer; add it to LAYERS in xtask/src/layering.rs"
                ),
            });
        }
        for dep in package["dependencies"].as_array().into_iter().flatten() {
            let to = dep["name"].as_str().unwrap_or_default();
            let kind = dep["kind"].as_str().unwrap_or("normal").to_string();
            if !internal_names.contains(&to) {
                if let Some(why) = cluster_only_violation(from, to, &kind) {
                    violations.push(Violation {
                        from: from.to_string(),
                        to: to.to_string(),
                        kind,
                        why,
                    });
                }
                continue;
            }
            if let Some(why) = edge_violation(from, to, &kind) {
                violations.push(Violation {
                    from: from.to_string(),
                    to: to.to_string(),
                    kind,
                    why,
                });
            }
        }
    }
    Ok(violations)
}

/// Why the edge `from -> to` of `kind` breaks the rule, or `None` when it is allowed.
fn edge_violation(from: &str, to: &str, kind: &str) -> Option<String> {
    if from == to {
        // A crate's dev-dependency on itself turns on its test features (`testing`) for its
        // own integration tests: no edge between crates.
        return (kind != "dev").then(|| format!("`{from}` depends on itself"));
    }
    if to == TEST_SUPPORT {
        return (kind != "dev")
            .then(|| format!("`{TEST_SUPPORT}` is test support and may only be a dev-dependency"));
    }
    if from == XTASK {
        return Some("xtask must not depend on kvbm crates (it checks them)".to_string());
    }
    if from == TEST_SUPPORT {
        return (kind != "dev").then(|| {
            format!(
                "`{TEST_SUPPORT}`'s library is used as a dev-dependency everywhere, so it may \
                 depend on kvbm crates only through dev-dependencies"
            )
        });
    }
    let (Some(lf), Some(lt)) = (layer_of(from), layer_of(to)) else {
        return None; // unknown members are reported once, as membership violations
    };
    if lt < lf {
        return None;
    }
    Some(if lt == lf {
        format!(
            "`{from}` and `{to}` are siblings in layer {lf}; neither may depend on the other \
             (the layers above join them)"
        )
    } else {
        format!("`{to}` (layer {lt}) is above `{from}` (layer {lf}); dependencies must point down")
    })
}

/// Why `from` may not depend on the third-party crate `to` with `kind`, or `None`.
fn cluster_only_violation(from: &str, to: &str, kind: &str) -> Option<String> {
    let (Some(lf), Some(lc)) = (layer_of(from), layer_of(CLUSTER)) else {
        return None;
    };
    (lf < lc && kind == "normal" && CLUSTER_ONLY.contains(&to)).then(|| {
        format!(
            "`{to}` is the cluster plane's ({CLUSTER}); `{from}` is below it and must not carry it"
        )
    })
}

pub(crate) fn run() -> Result<()> {
    let output = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()))
        .args(["metadata", "--format-version", "1", "--no-deps"])
        .output()
        .context("running `cargo metadata`")?;
    if !output.status.success() {
        bail!(
            "`cargo metadata` failed:\n{}",
            String::from_utf8_lossy(&output.stderr)
        );
    }
    let metadata: Value =
        serde_json::from_slice(&output.stdout).context("parsing `cargo metadata` output")?;
    let violations = check(&metadata)?;
    if violations.is_empty() {
        eprintln!(
            "layering: ok ({} layered crates; no crate below {CLUSTER} carries {})",
            LAYERS.len(),
            CLUSTER_ONLY.join(", ")
        );
        return Ok(());
    }
    for v in &violations {
        eprintln!("layering violation: {v}");
    }
    bail!(
        "{} layering violation(s); see docs/architecture.md for the rule",
        violations.len()
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A fixture shaped like `cargo metadata --no-deps` output: the current workspace's edges.
    fn fixture(path: &str) -> Value {
        let text = std::fs::read_to_string(
            std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("fixtures")
                .join(path),
        )
        .expect("fixture exists");
        serde_json::from_str(&text).expect("fixture is JSON")
    }

    /// Adds a dependency edge to a fixture document.
    fn with_edge(mut doc: Value, from: &str, to: &str, kind: Option<&str>) -> Value {
        let package = doc["packages"]
            .as_array_mut()
            .unwrap()
            .iter_mut()
            .find(|p| p["name"] == from)
            .expect("package in fixture");
        package["dependencies"]
            .as_array_mut()
            .unwrap()
            .push(serde_json::json!({
                "name": to, "kind": kind, "path": format!("/ws/crates/{to}"),
            }));
        doc
    }

    #[test]
    fn clean_fixture_passes() {
        assert_eq!(check(&fixture("metadata-clean.json")).unwrap(), vec![]);
    }

    #[test]
    fn upward_edge_is_rejected_and_named() {
        let doc = with_edge(
            fixture("metadata-clean.json"),
            "kvbm-logical",
            "kvbm-offload",
            None,
        );
        let v = check(&doc).unwrap();
        assert_eq!(v.len(), 1, "{v:?}");
        assert_eq!(
            (v[0].from.as_str(), v[0].to.as_str()),
            ("kvbm-logical", "kvbm-offload")
        );
        let shown = v[0].to_string();
        assert!(shown.contains("kvbm-logical -> kvbm-offload"), "{shown}");
        assert!(shown.contains("above"), "{shown}");
    }

    #[test]
    fn upward_edge_in_the_stored_fixture_is_rejected() {
        let v = check(&fixture("metadata-upward.json")).unwrap();
        assert_eq!(v.len(), 1, "{v:?}");
        assert_eq!(
            (v[0].from.as_str(), v[0].to.as_str()),
            ("kvbm-offload", "kvbm-engine")
        );
    }

    #[test]
    fn a_crates_dev_dependency_on_itself_is_no_violation() {
        let doc = with_edge(
            fixture("metadata-clean.json"),
            "kvbm-tiering",
            "kvbm-tiering",
            Some("dev"),
        );
        assert!(check(&doc).unwrap().is_empty());
    }

    #[test]
    fn logical_physical_edge_is_rejected_both_ways() {
        for (from, to) in [
            ("kvbm-logical", "kvbm-physical"),
            ("kvbm-physical", "kvbm-logical"),
        ] {
            let doc = with_edge(fixture("metadata-clean.json"), from, to, None);
            let v = check(&doc).unwrap();
            assert_eq!(v.len(), 1, "{from}->{to}: {v:?}");
            assert!(v[0].why.contains("siblings"), "{}", v[0]);
        }
    }

    #[test]
    fn upward_dev_dependency_is_rejected_too() {
        let doc = with_edge(
            fixture("metadata-clean.json"),
            "kvbm-physical",
            "kvbm-engine",
            Some("dev"),
        );
        let v = check(&doc).unwrap();
        assert_eq!(v.len(), 1, "{v:?}");
        assert_eq!(v[0].kind, "dev");
    }

    #[test]
    fn test_support_only_as_dev_dependency() {
        let ok = with_edge(
            fixture("metadata-clean.json"),
            "kvbm-logical",
            "kvbm-tests",
            Some("dev"),
        );
        assert_eq!(check(&ok).unwrap(), vec![]);
        let bad = with_edge(
            fixture("metadata-clean.json"),
            "kvbm-logical",
            "kvbm-tests",
            None,
        );
        assert_eq!(check(&bad).unwrap().len(), 1);
    }

    #[test]
    fn unlayered_member_is_rejected() {
        let mut doc = fixture("metadata-clean.json");
        doc["packages"].as_array_mut().unwrap().push(serde_json::json!({
            "name": "kvbm-stray", "id": "path+file:///ws/crates/kvbm-stray#0.1.0", "dependencies": [],
        }));
        doc["workspace_members"]
            .as_array_mut()
            .unwrap()
            .push("path+file:///ws/crates/kvbm-stray#0.1.0".into());
        let v = check(&doc).unwrap();
        assert_eq!(v.len(), 1, "{v:?}");
        assert_eq!(v[0].kind, "membership");
    }

    #[test]
    fn the_core_carrying_a_cluster_only_crate_is_rejected() {
        let bad = with_edge(
            fixture("metadata-clean.json"),
            "kvbm-engine",
            "ed25519-dalek",
            None,
        );
        let v = check(&bad).unwrap();
        assert_eq!(v.len(), 1, "{v:?}");
        assert_eq!(
            (v[0].from.as_str(), v[0].to.as_str()),
            ("kvbm-engine", "ed25519-dalek")
        );
        assert!(v[0].why.contains("kvbm-cluster"), "{}", v[0]);
        // As a dev-dependency (a test of the core may sign), and in the cluster plane itself,
        // it is allowed.
        let dev = with_edge(
            fixture("metadata-clean.json"),
            "kvbm-engine",
            "ed25519-dalek",
            Some("dev"),
        );
        assert_eq!(check(&dev).unwrap(), vec![]);
        let cluster = with_edge(
            fixture("metadata-clean.json"),
            "kvbm-cluster",
            "async-nats",
            None,
        );
        assert_eq!(check(&cluster).unwrap(), vec![]);
    }

    #[test]
    fn this_workspace_passes() {
        // The real workspace, through the real `cargo metadata`.
        run().expect("the workspace obeys its own layering rule");
    }
}
