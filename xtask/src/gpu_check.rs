//! `cargo xtask gpu-check`: the prepared script for the few minutes a GPU machine is lent.
//!
//! It prints `nvidia-smi`, finds libcuda and libnccl (pip's `libnccl.so.2` is exposed to
//! cudarc as `libnccl.so` through a symlink in `target/nccl-lib`, put first on the children's
//! `LD_LIBRARY_PATH`), runs the NCCL device tests with `HYPERSHARD_TEST_GPU=1` (they fail when
//! the GPU is missing), and writes a summary to `target/bench/gpu-check.json`. Every child
//! gets a deadline so the whole check stays within five minutes.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// The most one step may take.
const STEP_DEADLINE: Duration = Duration::from_secs(240);

/// Runs `command` to completion or kills it at the deadline; `Ok(true)` when it exited 0.
fn run_with_deadline(name: &str, command: &mut Command) -> Result<bool, String> {
    eprintln!("==> gpu-check: {name}");
    let mut child = command
        .spawn()
        .map_err(|e| format!("{name}: cannot start: {e}"))?;
    let started = Instant::now();
    loop {
        match child.try_wait() {
            Ok(Some(status)) => return Ok(status.success()),
            Ok(None) if started.elapsed() > STEP_DEADLINE => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(format!("{name}: killed after {STEP_DEADLINE:?}"));
            }
            Ok(None) => std::thread::sleep(Duration::from_millis(100)),
            Err(e) => return Err(format!("{name}: {e}")),
        }
    }
}

/// The first `libnccl.so.2` in the usual places (`HYPERSHARD_NCCL_LIB` first).
fn find_libnccl() -> Option<PathBuf> {
    let mut candidates: Vec<PathBuf> = Vec::new();
    if let Some(named) = std::env::var_os("HYPERSHARD_NCCL_LIB") {
        candidates.push(PathBuf::from(named));
    }
    if let Some(paths) = std::env::var_os("LD_LIBRARY_PATH") {
        candidates.extend(std::env::split_paths(&paths));
    }
    for dir in [
        "/usr/lib/x86_64-linux-gnu",
        "/usr/lib64",
        "/usr/local/cuda/lib64",
    ] {
        candidates.push(PathBuf::from(dir));
    }
    // pip's wheel: ask Python where `nvidia.nccl` lives.
    let python = Command::new("python3")
        .args([
            "-c",
            "import nvidia.nccl, os; print(os.path.join(list(nvidia.nccl.__path__)[0], 'lib'))",
        ])
        .stderr(Stdio::null())
        .output();
    if let Ok(out) = python
        && out.status.success()
    {
        candidates.push(PathBuf::from(String::from_utf8_lossy(&out.stdout).trim()));
    }
    candidates.into_iter().find_map(|c| {
        if c.is_file() {
            return Some(c);
        }
        let file = c.join("libnccl.so.2");
        file.is_file().then_some(file)
    })
}

/// Makes `target/nccl-lib/libnccl.so` point at `library`; returns the directory.
fn expose_libnccl(library: &Path) -> Result<PathBuf, String> {
    let dir = PathBuf::from("target/nccl-lib");
    std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let link = dir.join("libnccl.so");
    let _ = std::fs::remove_file(&link);
    std::os::unix::fs::symlink(library, &link).map_err(|e| format!("{}: {e}", link.display()))?;
    std::fs::canonicalize(&dir).map_err(|e| format!("{}: {e}", dir.display()))
}

/// `cargo xtask gpu-check`.
pub fn gpu_check(args: &[String]) -> Result<(), String> {
    if let Some(extra) = args.first() {
        return Err(format!("gpu-check takes no arguments, got `{extra}`"));
    }
    let started = Instant::now();
    let smi =
        run_with_deadline("nvidia-smi", &mut Command::new("nvidia-smi")).unwrap_or_else(|e| {
            eprintln!("{e}");
            false
        });
    let nccl = find_libnccl();
    let mut library_path = std::env::var("LD_LIBRARY_PATH").unwrap_or_default();
    match &nccl {
        Some(library) => {
            eprintln!("libnccl: {}", library.display());
            let dir = expose_libnccl(library)?;
            library_path = format!("{}:{library_path}", dir.display());
        }
        None => eprintln!("libnccl.so.2 not found (set HYPERSHARD_NCCL_LIB)"),
    }
    let tests = run_with_deadline(
        "NCCL device tests (HYPERSHARD_TEST_GPU=1)",
        Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_string()))
            .args([
                "test",
                "--release",
                "-p",
                "hypershard-collectives",
                "--features",
                "nccl",
                "--test",
                "nccl_gpu",
            ])
            .env("HYPERSHARD_TEST_GPU", "1")
            .env("LD_LIBRARY_PATH", &library_path),
    )?;
    let summary = serde_json::json!({
        "nvidia_smi_ok": smi,
        "libnccl": nccl.as_ref().map(|p| p.display().to_string()),
        "device_tests_passed": tests,
        "seconds": started.elapsed().as_secs_f64(),
    });
    std::fs::create_dir_all("target/bench").map_err(|e| format!("target/bench: {e}"))?;
    std::fs::write("target/bench/gpu-check.json", summary.to_string())
        .map_err(|e| format!("target/bench/gpu-check.json: {e}"))?;
    eprintln!("gpu-check: wrote target/bench/gpu-check.json: {summary}");
    if smi && tests {
        Ok(())
    } else {
        Err("gpu-check failed (see above); the device tests fail without a GPU".to_string())
    }
}
