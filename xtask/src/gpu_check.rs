//! `cargo xtask gpu-check`: the prepared script for the few minutes a GPU machine is lent.
//!
//! 1. Prints `nvidia-smi`.
//! 2. Finds the libraries: libnccl (pip's `libnccl.so.2` is exposed to cudarc as `libnccl.so`
//!    through a symlink in `target/nccl-lib`), and the library folders of pip's CUDA wheels
//!    (`nvidia.cuda_nvrtc`, `nvidia.cublas`, `nvidia.nccl`, `nvidia.cuda_runtime`) and of
//!    `/usr/local/cuda/lib64`. All of them go first on the children's `LD_LIBRARY_PATH`
//!    (the dynamic loader reads it only when a process starts, so the tests cannot fix it
//!    themselves).
//! 3. Builds both device test binaries in one cargo call (collectives' `nccl_gpu` with feature
//!    `nccl`, tensor's `cuda` with feature `cuda`; one feature set, so cudarc compiles once).
//! 4. Runs each with `HYPERSHARD_TEST_GPU=1`: they fail when the GPU is missing.
//! 5. Writes a summary to `target/bench/gpu-check.json`.
//!
//! Every child gets a deadline so the whole check stays within five minutes.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// The most the build may take.
const BUILD_DEADLINE: Duration = Duration::from_secs(180);
/// The most one test binary (or `nvidia-smi`) may take.
const STEP_DEADLINE: Duration = Duration::from_secs(60);

/// The device test binaries: (package, feature, test target).
const DEVICE_TESTS: &[(&str, &str, &str)] = &[
    ("hypershard-collectives", "nccl", "nccl_gpu"),
    ("hypershard-tensor", "cuda", "cuda"),
];

/// Runs `command` to completion or kills it at `deadline`; `Ok(true)` when it exited 0.
fn run_with_deadline(
    name: &str,
    command: &mut Command,
    deadline: Duration,
) -> Result<bool, String> {
    eprintln!("==> gpu-check: {name}");
    let mut child = command
        .spawn()
        .map_err(|e| format!("{name}: cannot start: {e}"))?;
    let started = Instant::now();
    loop {
        match child.try_wait() {
            Ok(Some(status)) => return Ok(status.success()),
            Ok(None) if started.elapsed() > deadline => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(format!("{name}: killed after {deadline:?}"));
            }
            Ok(None) => std::thread::sleep(Duration::from_millis(100)),
            Err(e) => return Err(format!("{name}: {e}")),
        }
    }
}

/// Runs `command` with its standard output captured (its diagnostics go to our standard error)
/// to completion or kills it at `deadline`; returns whether it exited 0, and the output.
fn run_capturing(mut command: Command, deadline: Duration) -> Result<(bool, String), String> {
    let mut child = command
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .map_err(|e| format!("cannot start {command:?}: {e}"))?;
    let mut stdout = child
        .stdout
        .take()
        .ok_or("no pipe for the child's output")?;
    // A thread drains the pipe so a child with much output never blocks on a full pipe.
    let reader = std::thread::spawn(move || {
        let mut text = String::new();
        let _ = std::io::Read::read_to_string(&mut stdout, &mut text);
        text
    });
    let started = Instant::now();
    let status = loop {
        match child.try_wait() {
            Ok(Some(status)) => break status,
            Ok(None) if started.elapsed() > deadline => {
                let _ = child.kill();
                let _ = child.wait();
                let _ = reader.join();
                return Err(format!("build killed after {deadline:?}"));
            }
            Ok(None) => std::thread::sleep(Duration::from_millis(100)),
            Err(e) => return Err(format!("build: {e}")),
        }
    };
    let text = reader.join().map_err(|_| "the output reader panicked")?;
    Ok((status.success(), text))
}

/// The `lib` folder of each pip wheel module (`nvidia.cublas`, ...) that Python can import.
fn wheel_lib_dirs(modules: &[&str]) -> Vec<PathBuf> {
    let script = format!(
        "import importlib, os\nfor m in {modules:?}:\n    try:\n        p = importlib.import_module(m)\n        print(os.path.join(list(p.__path__)[0], 'lib'))\n    except Exception:\n        pass\n"
    );
    let Ok(out) = Command::new("python3")
        .args(["-c", &script])
        .stderr(Stdio::null())
        .output()
    else {
        return Vec::new();
    };
    if !out.status.success() {
        return Vec::new();
    }
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|line| PathBuf::from(line.trim()))
        .filter(|dir| dir.is_dir())
        .collect()
}

/// The first `libnccl.so.2` in the usual places (`HYPERSHARD_NCCL_LIB` first).
fn find_libnccl(wheel_dirs: &[PathBuf]) -> Option<PathBuf> {
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
    candidates.extend(wheel_dirs.iter().cloned());
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

/// The executables of the test targets named `names` in cargo's `--message-format=json`
/// output, as `(target name, path)` in the order cargo reported them.
fn test_executables(json_lines: &str, names: &[&str]) -> Vec<(String, PathBuf)> {
    let mut found = Vec::new();
    for line in json_lines.lines() {
        let Ok(message) = serde_json::from_str::<serde_json::Value>(line) else {
            continue;
        };
        if message["reason"] != "compiler-artifact" {
            continue;
        }
        let target = &message["target"];
        let is_test = target["kind"]
            .as_array()
            .is_some_and(|kinds| kinds.iter().any(|k| k == "test"));
        let (Some(name), Some(executable)) =
            (target["name"].as_str(), message["executable"].as_str())
        else {
            continue;
        };
        if is_test && names.contains(&name) {
            found.push((name.to_string(), PathBuf::from(executable)));
        }
    }
    found
}

/// `cargo xtask gpu-check`.
pub fn gpu_check(args: &[String]) -> Result<(), String> {
    if let Some(extra) = args.first() {
        return Err(format!("gpu-check takes no arguments, got `{extra}`"));
    }
    let started = Instant::now();
    let smi = run_with_deadline("nvidia-smi", &mut Command::new("nvidia-smi"), STEP_DEADLINE)
        .unwrap_or_else(|e| {
            eprintln!("{e}");
            false
        });

    // Libraries.
    let mut library_dirs = wheel_lib_dirs(&[
        "nvidia.cuda_nvrtc",
        "nvidia.cublas",
        "nvidia.nccl",
        "nvidia.cuda_runtime",
    ]);
    let system_cuda = PathBuf::from("/usr/local/cuda/lib64");
    if system_cuda.is_dir() {
        library_dirs.push(system_cuda);
    }
    let nccl = find_libnccl(&library_dirs);
    match &nccl {
        Some(library) => {
            eprintln!("libnccl: {}", library.display());
            library_dirs.insert(0, expose_libnccl(library)?);
        }
        None => eprintln!("libnccl.so.2 not found (set HYPERSHARD_NCCL_LIB)"),
    }
    for dir in &library_dirs {
        eprintln!("library folder: {}", dir.display());
    }
    let mut paths = library_dirs.clone();
    if let Some(existing) = std::env::var_os("LD_LIBRARY_PATH") {
        paths.extend(std::env::split_paths(&existing));
    }
    let library_path = std::env::join_paths(&paths).map_err(|e| format!("LD_LIBRARY_PATH: {e}"))?;

    // One build of both device test binaries.
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_string());
    let mut build = Command::new(&cargo);
    build.args([
        "test",
        "--release",
        "--no-run",
        "--message-format=json-render-diagnostics",
    ]);
    let features: Vec<String> = DEVICE_TESTS
        .iter()
        .map(|(package, feature, _)| format!("{package}/{feature}"))
        .collect();
    for (package, _, test) in DEVICE_TESTS {
        build.args(["-p", package, "--test", test]);
    }
    build.args(["--features", &features.join(",")]);
    eprintln!("==> gpu-check: build the device tests");
    let build_started = Instant::now();
    let (build_ok, stdout) = run_capturing(build, BUILD_DEADLINE).unwrap_or_else(|e| {
        eprintln!("{e}");
        (false, String::new())
    });
    let build_seconds = build_started.elapsed().as_secs_f64();
    let names: Vec<&str> = DEVICE_TESTS.iter().map(|(_, _, test)| *test).collect();
    let executables = test_executables(&stdout, &names);
    let built = build_ok && executables.len() == DEVICE_TESTS.len();
    if !built {
        eprintln!("gpu-check: the build failed or did not produce {names:?} (got {executables:?})");
    }

    // Each device test binary, with the GPU asked for.
    let mut results = serde_json::Map::new();
    for (name, executable) in &executables {
        let passed = run_with_deadline(
            &format!("device tests `{name}` (HYPERSHARD_TEST_GPU=1)"),
            Command::new(executable)
                .env("HYPERSHARD_TEST_GPU", "1")
                .env("LD_LIBRARY_PATH", &library_path),
            STEP_DEADLINE,
        )
        .unwrap_or_else(|e| {
            eprintln!("{e}");
            false
        });
        results.insert(name.clone(), serde_json::Value::Bool(passed));
    }
    let all_passed = built
        && results
            .values()
            .all(|v| v == &serde_json::Value::Bool(true));

    let summary = serde_json::json!({
        "nvidia_smi_ok": smi,
        "libnccl": nccl.as_ref().map(|p| p.display().to_string()),
        "library_dirs": library_dirs.iter().map(|p| p.display().to_string()).collect::<Vec<_>>(),
        "build_ok": built,
        "build_seconds": build_seconds,
        "device_tests": results,
        "device_tests_passed": all_passed,
        "seconds": started.elapsed().as_secs_f64(),
    });
    std::fs::create_dir_all("target/bench").map_err(|e| format!("target/bench: {e}"))?;
    std::fs::write("target/bench/gpu-check.json", summary.to_string())
        .map_err(|e| format!("target/bench/gpu-check.json: {e}"))?;
    eprintln!("gpu-check: wrote target/bench/gpu-check.json: {summary}");
    if smi && all_passed {
        Ok(())
    } else {
        Err("gpu-check failed (see above); the device tests fail without a GPU".to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_the_test_executables_in_cargo_json() {
        let lines = [
            r#"{"reason":"compiler-artifact","target":{"kind":["lib"],"name":"hypershard_tensor"},"executable":null}"#,
            r#"{"reason":"compiler-artifact","target":{"kind":["test"],"name":"cuda"},"executable":"/t/release/deps/cuda-1"}"#,
            r#"{"reason":"compiler-artifact","target":{"kind":["test"],"name":"other"},"executable":"/t/release/deps/other-2"}"#,
            "not json",
            r#"{"reason":"build-finished","success":true}"#,
            r#"{"reason":"compiler-artifact","target":{"kind":["test"],"name":"nccl_gpu"},"executable":"/t/release/deps/nccl_gpu-3"}"#,
        ]
        .join("\n");
        let found = test_executables(&lines, &["nccl_gpu", "cuda"]);
        assert_eq!(
            found,
            vec![
                ("cuda".to_string(), PathBuf::from("/t/release/deps/cuda-1")),
                (
                    "nccl_gpu".to_string(),
                    PathBuf::from("/t/release/deps/nccl_gpu-3")
                ),
            ]
        );
        assert!(test_executables("", &["cuda"]).is_empty());
    }

    #[test]
    fn libnccl_is_found_in_a_wheel_folder() {
        let dir = std::env::temp_dir().join(format!("xtask-gpu-check-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("libnccl.so.2"), b"not really a library").unwrap();
        // Only meaningful where the machine has no NCCL of its own (true of CI and this
        // project's machines); the wheel folder is then the only candidate.
        let found = find_libnccl(std::slice::from_ref(&dir));
        if !Path::new("/usr/lib/x86_64-linux-gnu/libnccl.so.2").exists()
            && std::env::var_os("HYPERSHARD_NCCL_LIB").is_none()
            && std::env::var_os("LD_LIBRARY_PATH").is_none()
        {
            assert_eq!(found, Some(dir.join("libnccl.so.2")));
        } else {
            assert!(found.is_some());
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
