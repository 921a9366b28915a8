//! Project automation: `cargo xtask <command>`.
//!
//! Commands:
//! - `ci`: the same checks `.ci/run` performs (fmt, clippy, tests, docs), for local use.

use std::process::{Command, ExitCode};

fn run(step: &str, args: &[&str], env: &[(&str, &str)]) -> Result<(), String> {
    eprintln!("==> {step}: cargo {}", args.join(" "));
    let mut cmd = Command::new(env!("CARGO"));
    cmd.args(args);
    for (k, v) in env {
        cmd.env(k, v);
    }
    let status = cmd
        .status()
        .map_err(|e| format!("{step}: could not start cargo: {e}"))?;
    if status.success() {
        Ok(())
    } else {
        Err(format!("{step} failed with {status}"))
    }
}

fn ci() -> Result<(), String> {
    run("fmt", &["fmt", "--all", "--check"], &[])?;
    run(
        "clippy",
        &[
            "clippy",
            "--workspace",
            "--all-targets",
            "--",
            "-D",
            "warnings",
        ],
        &[],
    )?;
    run("test", &["test", "--workspace"], &[])?;
    run(
        "doc",
        &["doc", "--workspace", "--no-deps"],
        &[("RUSTDOCFLAGS", "-D warnings")],
    )
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let result = match args.first().map(String::as_str) {
        Some("ci") => ci(),
        Some(other) => Err(format!("unknown xtask command `{other}`; known: ci")),
        None => Err("usage: cargo xtask <ci>".to_string()),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("xtask: {e}");
            ExitCode::FAILURE
        }
    }
}
