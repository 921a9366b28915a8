//! Keeps `hypershard-dtensor` with `default-features = false` small: a user who wants only
//! distributed tensors on the in-process backend must not build the TCP store's HMAC, the
//! shared-memory transport's memmap2, CRC32C or safetensors with its serde / serde_json.
//!
//! Counted the way a reader can repeat it: the distinct packages of
//! `cargo tree -p hypershard-dtensor --no-default-features -e normal --prefix none --no-dedupe`
//! (hypershard-dtensor itself and the proc-macro crates included).

use std::collections::BTreeSet;
use std::path::Path;
use std::process::Command;

/// The most packages the no-default-features tree may hold.
const MAX_PACKAGES: usize = 25;

/// Crates that only the default features (`tcp`, `safetensors`) may bring in.
const FEATURE_GATED: [&str; 8] = [
    "hmac",
    "sha2",
    "getrandom",
    "memmap2",
    "crc32c",
    "safetensors",
    "serde",
    "serde_json",
];

/// The distinct packages (`name version`) of dtensor's normal dependency tree.
fn packages(default_features: bool) -> BTreeSet<String> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("invariant: xtask sits in the workspace root");
    let mut command = Command::new(env!("CARGO"));
    command.current_dir(root).args([
        "tree",
        "--locked",
        "--offline",
        "-p",
        "hypershard-dtensor",
        "-e",
        "normal",
        "--prefix",
        "none",
        "--no-dedupe",
        "--format",
        "{p}",
    ]);
    if !default_features {
        command.arg("--no-default-features");
    }
    let output = command.output().expect("cargo tree runs");
    assert!(
        output.status.success(),
        "cargo tree failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8(output.stdout)
        .expect("cargo tree prints UTF-8")
        .lines()
        .filter(|line| !line.trim().is_empty())
        // `{p}` is `name vX.Y.Z (path)` for path packages, plus ` (proc-macro)` for macros;
        // name and version identify a package.
        .map(|line| {
            line.split_whitespace()
                .take(2)
                .collect::<Vec<_>>()
                .join(" ")
        })
        .collect()
}

fn names(packages: &BTreeSet<String>) -> BTreeSet<&str> {
    packages
        .iter()
        .filter_map(|p| p.split(' ').next())
        .collect()
}

#[test]
fn no_default_features_tree_stays_small() {
    let lean = packages(false);
    assert!(
        lean.len() <= MAX_PACKAGES,
        "hypershard-dtensor --no-default-features has {} packages (at most {MAX_PACKAGES}): {lean:#?}",
        lean.len()
    );
    let lean_names = names(&lean);
    for gated in FEATURE_GATED {
        assert!(
            !lean_names.contains(gated),
            "{gated} is in hypershard-dtensor's --no-default-features tree"
        );
    }
    assert!(lean_names.contains("hypershard-collectives"));
    assert!(lean_names.contains("hypershard-tensor"));
}

#[test]
fn default_features_keep_tcp_and_safetensors() {
    // The defaults stay "everything": the gated crates are back with them, so the check above
    // measures the features rather than a dependency that disappeared for good.
    let full = packages(true);
    let full_names = names(&full);
    for gated in FEATURE_GATED {
        assert!(
            full_names.contains(gated),
            "{gated} is missing from hypershard-dtensor's default tree"
        );
    }
    assert!(full.len() > packages(false).len());
}
