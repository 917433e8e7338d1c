//! `cargo xtask layering`: the crate layering rule, enforced from `cargo metadata`.
//!
//! ```text
//!   layer 4   kvbm-cli          kvbm-vllm         (siblings)
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
//! Inside `kvbm-engine` one more rule holds, by planes ([`check_planes`]): the core (the stack,
//! leader, sessions, manager, moves, workers, runtime, configuration) never names the cluster
//! plane (`crate::cluster`: control, NATS, the data plane, pub/sub, presence, shared G4); the
//! cluster plane fills the core's seams. Only `lib.rs` (which declares both), `prelude.rs`,
//! `testing.rs`, the binaries and the cluster's own files may name it.

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
    ("kvbm-cli", 4),
    ("kvbm-vllm", 4),
];

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
            if !internal_names.contains(&to) {
                continue;
            }
            let kind = dep["kind"].as_str().unwrap_or("normal").to_string();
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

/// The engine's source directory, relative to the workspace root.
const ENGINE_SRC: &str = "crates/kvbm-engine/src";

/// Files of `ENGINE_SRC` (relative, `/`-separated) that may name the cluster plane.
fn may_name_cluster(rel: &str) -> bool {
    rel == "lib.rs"
        || rel == "prelude.rs"
        || rel == "testing.rs"
        || rel == "cluster.rs"
        || rel.starts_with("cluster/")
        || rel.starts_with("bin/")
}

/// Every line of the engine's core that names `crate::cluster`, as a violation (file and line).
pub(crate) fn check_planes(src: &std::path::Path) -> Result<Vec<Violation>> {
    let mut violations = Vec::new();
    let mut stack = vec![src.to_path_buf()];
    while let Some(dir) = stack.pop() {
        let entries =
            std::fs::read_dir(&dir).with_context(|| format!("reading {}", dir.display()))?;
        for entry in entries {
            let path = entry?.path();
            if path.is_dir() {
                stack.push(path);
                continue;
            }
            if path.extension().is_none_or(|e| e != "rs") {
                continue;
            }
            let rel = path
                .strip_prefix(src)
                .expect("walked from src")
                .to_string_lossy()
                .replace('\\', "/");
            if may_name_cluster(&rel) {
                continue;
            }
            let text = std::fs::read_to_string(&path)
                .with_context(|| format!("reading {}", path.display()))?;
            for (n, line) in text.lines().enumerate() {
                if line.contains("crate::cluster") || line.contains("super::cluster") {
                    violations.push(Violation {
                        from: format!("kvbm-engine/src/{rel}:{}", n + 1),
                        to: "crate::cluster".to_string(),
                        kind: "module".to_string(),
                        why: "the engine's core must not name the cluster plane; add a seam \
                              the cluster fills instead"
                            .to_string(),
                    });
                }
            }
        }
    }
    violations.sort_by(|a, b| a.from.cmp(&b.from));
    Ok(violations)
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
    let mut violations = check(&metadata)?;
    let root = metadata["workspace_root"]
        .as_str()
        .context("metadata has no `workspace_root`")?;
    violations.extend(check_planes(&std::path::Path::new(root).join(ENGINE_SRC))?);
    if violations.is_empty() {
        eprintln!(
            "layering: ok ({} layered crates; the engine's core names no cluster plane)",
            LAYERS.len()
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
    fn core_naming_the_cluster_plane_is_rejected_with_file_and_line() {
        let dir = tempfile::tempdir().unwrap();
        let src = dir.path();
        std::fs::create_dir_all(src.join("stack")).unwrap();
        std::fs::create_dir_all(src.join("cluster")).unwrap();
        std::fs::write(src.join("lib.rs"), "pub mod cluster;\npub mod stack;\n").unwrap();
        std::fs::write(
            src.join("cluster/pubsub.rs"),
            "use crate::cluster::transport::X;\n",
        )
        .unwrap();
        std::fs::write(src.join("stack/mod.rs"), "use crate::leader::L;\n").unwrap();
        assert!(check_planes(src).unwrap().is_empty());
        std::fs::write(
            src.join("stack/mod.rs"),
            "use crate::leader::L;\nuse crate::cluster::pubsub::Bus;\n",
        )
        .unwrap();
        let v = check_planes(src).unwrap();
        assert_eq!(v.len(), 1, "{v:?}");
        assert_eq!(v[0].from, "kvbm-engine/src/stack/mod.rs:2");
        assert_eq!(v[0].kind, "module");
    }

    #[test]
    fn this_workspace_passes() {
        // The real workspace, through the real `cargo metadata`.
        run().expect("the workspace obeys its own layering rule");
    }
}
