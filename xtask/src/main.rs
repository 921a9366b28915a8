//! Project automation: `cargo xtask <command>`.
//!
//! Commands:
//! - `ci`: the same checks `.ci/run` performs (fmt, clippy, tests, docs), for local use.
//! - `bench [SUITE] [--quick] [--compare-pytorch] [--report-only] [ARGS...]`: runs every
//!   benchmark suite (or the one named, passing `ARGS` to its binary) in release mode, then
//!   writes `target/bench/report.md` and the SVG plots under `target/bench/plots/` (see
//!   the `bench` module). Each suite is one binary, `benches/src/bin/bench-<suite>.rs`, writing
//!   `target/bench/<suite>.json`. `cargo xtask bench --list` lists the suites.

mod bench;
mod gpu_check;
mod plot;
mod report;
mod results;
mod soak;

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

/// The benchmark suites: one binary per file in `benches/src/bin/`, named `bench-<suite>.rs`.
fn bench_suites() -> Result<Vec<String>, String> {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../benches/src/bin");
    let entries = match std::fs::read_dir(&dir) {
        Ok(entries) => entries,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => {
            return Err(format!(
                "cannot list benchmark suites in {}: {e}",
                dir.display()
            ));
        }
    };
    let mut suites: Vec<String> = entries
        .filter_map(|entry| entry.ok())
        .filter_map(|entry| {
            let name = entry.file_name().into_string().ok()?;
            let suite = name.strip_prefix("bench-")?.strip_suffix(".rs")?;
            Some(suite.to_string())
        })
        .collect();
    suites.sort();
    Ok(suites)
}

fn bench_command(args: &[String]) -> Result<(), String> {
    let suites = bench_suites()?;
    if args.first().map(String::as_str) == Some("--list") {
        println!("{}", suites.join("\n"));
        return Ok(());
    }
    bench::bench(args, &suites)
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let result = match args.first().map(String::as_str) {
        Some("ci") => ci(),
        Some("bench") => bench_command(&args[1..]),
        Some("soak") => soak::soak(&args[1..]),
        Some("gpu-check") => gpu_check::gpu_check(&args[1..]),
        Some(other) => Err(format!("unknown xtask command `{other}`; known: ci, bench")),
        None => Err(
            "usage: cargo xtask <ci | bench [SUITE] [--quick] [--compare-pytorch] [ARGS...]>"
                .to_string(),
        ),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("xtask: {e}");
            ExitCode::FAILURE
        }
    }
}
