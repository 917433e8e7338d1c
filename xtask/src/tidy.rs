//! Repository rules that run as ordinary tests (in the style of rust-analyzer's `tidy`).
//!
//! * Every Rust source file opens with a module doc (`//!`), or, for a crate root, with
//!   `#![doc = include_str!(...)]` so the crate's README is its documentation: the first thing a
//!   reader of any file sees is why it exists.
//! * `rust-toolchain.toml` pins exactly `channel = "1.95.0"`: any other spelling makes rustup try
//!   a download, which fails on machines without internet.
//!
//! They run inside `cargo test --workspace`, so `cargo xtask ci` enforces them.

#[cfg(test)]
mod tests {
    use std::path::{Path, PathBuf};

    fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
        let Ok(entries) = std::fs::read_dir(dir) else {
            return;
        };
        for entry in entries.flatten() {
            let path = entry.path();
            let name = entry.file_name();
            let name = name.to_string_lossy();
            if path.is_dir() {
                if name != "target" && !name.starts_with('.') {
                    rust_files(&path, out);
                }
            } else if name.ends_with(".rs") {
                out.push(path);
            }
        }
    }

    #[test]
    fn every_rust_file_opens_with_a_module_doc() {
        let root = crate::project_root();
        let mut files = Vec::new();
        for dir in ["crates", "xtask", "tests"] {
            rust_files(&root.join(dir), &mut files);
        }
        assert!(
            files.len() > 20,
            "found only {} files; is the walk broken?",
            files.len()
        );
        let missing: Vec<String> = files
            .iter()
            .filter(|f| {
                let text = std::fs::read_to_string(f).unwrap_or_default();
                let first = text.lines().find(|l| !l.trim().is_empty()).unwrap_or("");
                !(first.starts_with("//!") || first.starts_with("#![doc = include_str!"))
            })
            .map(|f| f.strip_prefix(&root).unwrap_or(f).display().to_string())
            .collect();
        assert!(
            missing.is_empty(),
            "these files do not open with a `//!` module doc: {missing:#?}"
        );
    }

    #[test]
    fn toolchain_is_pinned_exactly() {
        let text = std::fs::read_to_string(crate::project_root().join("rust-toolchain.toml"))
            .expect("rust-toolchain.toml exists");
        assert!(
            text.lines().any(|l| l.trim() == "channel = \"1.95.0\""),
            "rust-toolchain.toml must say exactly channel = \"1.95.0\":\n{text}"
        );
    }
}
