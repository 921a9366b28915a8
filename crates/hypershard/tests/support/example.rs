//! The `allreduce` example, built on demand for the tests that run it as a rank program
//! (launch.rs, security.rs): `cargo test --test launch` builds the test and the package's
//! binaries, but not its examples, so the test builds the example itself.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

/// The path of the `allreduce` example, built (once per test process) with the profile this
/// test was built with, into the same target directory as the `hypershard` binary. Cargo's
/// own lock on the target directory serialises test processes that build it at once.
pub fn allreduce() -> PathBuf {
    static BUILT: OnceLock<PathBuf> = OnceLock::new();
    BUILT
        .get_or_init(|| build_example(Path::new(env!("CARGO_BIN_EXE_hypershard")), "allreduce"))
        .clone()
}

pub fn build_example(binary: &Path, name: &str) -> PathBuf {
    // invariant: CARGO_BIN_EXE_* is an absolute path <target-dir>/<profile-dir>/<binary>.
    let profile_dir = binary.parent().expect("binary has a parent directory");
    let target_dir = profile_dir.parent().expect("profile dir has a parent");
    let profile = match profile_dir.file_name().and_then(|n| n.to_str()) {
        Some("debug") => "dev",
        Some(other) => other,
        None => panic!("unexpected binary path {}", binary.display()),
    };
    let output = Command::new(env!("CARGO"))
        .args([
            "build",
            "--quiet",
            "--locked",
            "--example",
            name,
            "--profile",
            profile,
        ])
        .arg("--manifest-path")
        .arg(Path::new(env!("CARGO_MANIFEST_DIR")).join("Cargo.toml"))
        .arg("--target-dir")
        .arg(target_dir)
        .output()
        .expect("cargo runs");
    assert!(
        output.status.success(),
        "cargo build --example {name} failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    let path = profile_dir.join("examples").join(name);
    assert!(
        path.exists(),
        "cargo built the example, but not at {}",
        path.display()
    );
    path
}
