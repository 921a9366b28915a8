//! `cargo xtask gpu-check`: the prepared script for the few minutes a GPU machine is lent.
//!
//! 1. Prints `nvidia-smi`.
//! 2. Finds the libraries. The folders go first on the children's `LD_LIBRARY_PATH` (the
//!    dynamic loader reads it only when a process starts, so the tests cannot fix it
//!    themselves), in this order:
//!    * the CUDA toolkit's `/usr/local/cuda/lib64` (its NVRTC matches the driver);
//!    * the driver's `/usr/local/nvidia/lib64`;
//!    * every `lib` folder of pip's `nvidia` wheels (`nvidia/cuda_nvrtc/lib`,
//!      `nvidia/cu13/lib`, ...).
//!
//!    cudarc opens only `libX.so` or `libX.so.<N>` with `N` ≤ 12, so a library found only
//!    under another name (pip's `libnccl.so.2`, CUDA 13's `libnvrtc.so.13` and
//!    `libcublas.so.13`) is exposed under the plain name through a symlink in
//!    `target/cuda-lib`, which goes first.
//! 3. Builds the device test binaries in one cargo call (collectives' `nccl_gpu` with feature
//!    `nccl`, tensor's `cuda` and nn's `cuda_mlp` with feature `cuda`; one feature set, so
//!    cudarc compiles once).
//! 4. Runs each with `HYPERSHARD_TEST_GPU=1`: they fail when the GPU is missing.
//! 5. Runs `cuda_mlp --bench`: the reference MLP's training step (8 × Linear(1024, 1024) +
//!    ReLU, batch 32) timed on the device (f32, bf16) and on the CPU, written by the binary to
//!    `target/bench/nn-cuda-mlp.json`.
//! 6. Writes a summary to `target/bench/gpu-check.json`, with the benchmark's JSON in it.
//!
//! A lent GPU machine has no Rust toolchain and no network, so step 3 can also run here:
//! `cargo xtask gpu-check --bundle DIR` builds the test binaries and copies them, with this
//! xtask binary, into `DIR`. On the GPU machine, `DIR/xtask gpu-check --prebuilt DIR` then
//! runs steps 1, 2, 4 and 5 with those binaries (see docs/gpu.md).
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
    ("hypershard-nn", "cuda", "cuda_mlp"),
];

/// The test binary that also times the reference MLP's step when given `--bench`.
const BENCH_TEST: &str = "cuda_mlp";

/// Where [`BENCH_TEST`]` --bench` writes its figures (relative to the repository root, the
/// working folder of gpu-check and its children).
const BENCH_JSON: &str = "target/bench/nn-cuda-mlp.json";

/// The benchmark's figures for the summary: its JSON, or a string saying why there is none.
fn bench_figures(path: &Path) -> serde_json::Value {
    match std::fs::read_to_string(path) {
        Ok(text) => serde_json::from_str(&text).unwrap_or_else(|e| {
            serde_json::Value::String(format!("{}: not JSON: {e}", path.display()))
        }),
        Err(e) => serde_json::Value::String(format!("{}: {e}", path.display())),
    }
}

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

/// Every `lib` folder of pip's `nvidia` namespace package, one and two levels down
/// (`nvidia/cublas/lib`, `nvidia/cu13/lib`), for the `python3` on the path.
fn wheel_lib_dirs() -> Vec<PathBuf> {
    let script = "import os\ntry:\n    import nvidia\nexcept Exception:\n    raise SystemExit(0)\nfor root in nvidia.__path__:\n    for sub in sorted(os.listdir(root)):\n        lib = os.path.join(root, sub, 'lib')\n        if os.path.isdir(lib):\n            print(lib)\n";
    let Ok(out) = Command::new("python3")
        .args(["-c", script])
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

/// The folders to search, in order of preference: `HYPERSHARD_NCCL_LIB` (a file's folder, or
/// a folder), the toolkit, the driver, `LD_LIBRARY_PATH`, the system folders, pip's wheels.
fn library_search_dirs(wheel_dirs: &[PathBuf]) -> Vec<PathBuf> {
    let mut dirs: Vec<PathBuf> = Vec::new();
    if let Some(named) = std::env::var_os("HYPERSHARD_NCCL_LIB") {
        let named = PathBuf::from(named);
        match named.parent() {
            Some(parent) if named.is_file() => dirs.push(parent.to_path_buf()),
            _ => dirs.push(named),
        }
    }
    for dir in [
        "/usr/local/cuda/lib64",
        "/usr/local/nvidia/lib64",
        "/usr/local/nvidia/lib",
    ] {
        dirs.push(PathBuf::from(dir));
    }
    if let Some(paths) = std::env::var_os("LD_LIBRARY_PATH") {
        dirs.extend(std::env::split_paths(&paths));
    }
    for dir in ["/usr/lib/x86_64-linux-gnu", "/usr/lib64"] {
        dirs.push(PathBuf::from(dir));
    }
    dirs.extend(wheel_dirs.iter().cloned());
    let mut seen = std::collections::HashSet::new();
    dirs.retain(|d| d.is_dir() && seen.insert(d.clone()));
    dirs
}

/// Where `lib{name}` is: `Ok(folder)` when a folder holds the plain `lib{name}.so` (cudarc
/// finds it once the folder is on `LD_LIBRARY_PATH`), `Err(Some(file))` when only a versioned
/// `lib{name}.so.<N>` exists (the first folder's highest `N`), `Err(None)` when neither does.
fn find_library(name: &str, dirs: &[PathBuf]) -> Result<PathBuf, Option<PathBuf>> {
    let plain = format!("lib{name}.so");
    if let Some(dir) = dirs.iter().find(|d| d.join(&plain).exists()) {
        return Ok(dir.clone());
    }
    let prefix = format!("{plain}.");
    for dir in dirs {
        let Ok(entries) = std::fs::read_dir(dir) else {
            continue;
        };
        let mut best: Option<(u32, PathBuf)> = None;
        for entry in entries.flatten() {
            let file = entry.file_name();
            let file = file.to_string_lossy();
            let Some(version) = file.strip_prefix(&prefix) else {
                continue;
            };
            // `libX.so.13` or `libX.so.13.0.1`: the major version leads.
            let Ok(major) = version.split('.').next().unwrap_or("").parse::<u32>() else {
                continue;
            };
            if best.as_ref().is_none_or(|(b, _)| major > *b) {
                best = Some((major, entry.path()));
            }
        }
        if let Some((_, path)) = best {
            return Err(Some(path));
        }
    }
    Err(None)
}

/// Makes `dir/lib{name}.so` point at `library`.
fn expose(dir: &Path, name: &str, library: &Path) -> Result<(), String> {
    std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let link = dir.join(format!("lib{name}.so"));
    let _ = std::fs::remove_file(&link);
    std::os::unix::fs::symlink(library, &link).map_err(|e| format!("{}: {e}", link.display()))
}

/// The libraries cudarc opens, by the name it tries first (`libcuda.so` comes with the driver,
/// under names cudarc tries, so it is only reported).
const LIBRARIES: &[&str] = &["nvrtc", "cublas", "nccl"];

/// Finds the libraries, exposes versioned-only ones under `target/cuda-lib`, and returns the
/// folders for `LD_LIBRARY_PATH` (first) and, per library, where it was found.
fn prepare_libraries() -> Result<(Vec<PathBuf>, serde_json::Map<String, serde_json::Value>), String>
{
    let search = library_search_dirs(&wheel_lib_dirs());
    let link_dir = PathBuf::from("target/cuda-lib");
    let _ = std::fs::remove_dir_all(&link_dir);
    let mut found = serde_json::Map::new();
    let mut linked = false;
    for name in LIBRARIES {
        let value = match find_library(name, &search) {
            Ok(dir) => dir.join(format!("lib{name}.so")).display().to_string(),
            Err(Some(file)) => {
                expose(&link_dir, name, &file)?;
                linked = true;
                format!(
                    "{} (linked as target/cuda-lib/lib{name}.so)",
                    file.display()
                )
            }
            Err(None) => {
                eprintln!("gpu-check: lib{name} not found");
                "not found".to_string()
            }
        };
        eprintln!("lib{name}: {value}");
        found.insert(format!("lib{name}"), serde_json::Value::String(value));
    }
    let mut dirs = search;
    if linked {
        let canonical =
            std::fs::canonicalize(&link_dir).map_err(|e| format!("{}: {e}", link_dir.display()))?;
        dirs.insert(0, canonical);
    }
    Ok((dirs, found))
}

/// Copies the built test binaries and this xtask binary into `dir`.
fn bundle(dir: &Path, executables: &[(String, PathBuf)]) -> Result<(), String> {
    std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    for (name, executable) in executables {
        std::fs::copy(executable, dir.join(name))
            .map_err(|e| format!("{} -> {}: {e}", executable.display(), dir.display()))?;
    }
    let me = std::env::current_exe().map_err(|e| format!("this executable: {e}"))?;
    std::fs::copy(&me, dir.join("xtask")).map_err(|e| format!("{}: {e}", me.display()))?;
    Ok(())
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

/// How the test binaries are obtained.
#[derive(Debug, PartialEq, Eq)]
enum Mode {
    /// Build them here and run them (a GPU machine with cargo).
    BuildAndRun,
    /// Build them here and copy them into the folder, with this binary; run nothing.
    Bundle(PathBuf),
    /// Run the binaries in the folder (a GPU machine without cargo).
    Prebuilt(PathBuf),
}

fn parse_mode(args: &[String]) -> Result<Mode, String> {
    match args {
        [] => Ok(Mode::BuildAndRun),
        [flag, dir] if flag == "--bundle" => Ok(Mode::Bundle(PathBuf::from(dir))),
        [flag, dir] if flag == "--prebuilt" => Ok(Mode::Prebuilt(PathBuf::from(dir))),
        _ => Err(format!(
            "usage: gpu-check [--bundle DIR | --prebuilt DIR], got {args:?}"
        )),
    }
}

/// Builds the device test binaries (release) in one cargo call; returns their executables.
fn build_device_tests() -> Result<(Vec<(String, PathBuf)>, f64), String> {
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
    let started = Instant::now();
    let (ok, stdout) = run_capturing(build, BUILD_DEADLINE)?;
    let seconds = started.elapsed().as_secs_f64();
    let names: Vec<&str> = DEVICE_TESTS.iter().map(|(_, _, test)| *test).collect();
    let executables = test_executables(&stdout, &names);
    if ok && executables.len() == DEVICE_TESTS.len() {
        Ok((executables, seconds))
    } else {
        Err(format!(
            "the build failed or did not produce {names:?} (got {executables:?})"
        ))
    }
}

/// `cargo xtask gpu-check [--bundle DIR | --prebuilt DIR]`.
pub fn gpu_check(args: &[String]) -> Result<(), String> {
    let mode = parse_mode(args)?;
    let started = Instant::now();
    let (executables, build_seconds) = match &mode {
        Mode::Prebuilt(dir) => {
            let executables: Vec<(String, PathBuf)> = DEVICE_TESTS
                .iter()
                .map(|(_, _, test)| (test.to_string(), dir.join(test)))
                .collect();
            if let Some((_, missing)) = executables.iter().find(|(_, path)| !path.is_file()) {
                return Err(format!(
                    "{} is missing: make the bundle with `cargo xtask gpu-check --bundle {}`",
                    missing.display(),
                    dir.display()
                ));
            }
            (executables, 0.0)
        }
        Mode::BuildAndRun | Mode::Bundle(_) => match build_device_tests() {
            Ok(built) => built,
            Err(e) if mode == Mode::BuildAndRun => {
                eprintln!("gpu-check: {e}");
                (Vec::new(), 0.0)
            }
            Err(e) => return Err(e),
        },
    };
    if let Mode::Bundle(dir) = &mode {
        bundle(dir, &executables)?;
        eprintln!(
            "gpu-check: bundled {:?} and xtask into {}; on the GPU machine run `{}/xtask gpu-check --prebuilt {}`",
            executables.iter().map(|(n, _)| n).collect::<Vec<_>>(),
            dir.display(),
            dir.display(),
            dir.display()
        );
        return Ok(());
    }
    let built = executables.len() == DEVICE_TESTS.len();

    let smi = run_with_deadline("nvidia-smi", &mut Command::new("nvidia-smi"), STEP_DEADLINE)
        .unwrap_or_else(|e| {
            eprintln!("{e}");
            false
        });
    let (library_dirs, libraries) = prepare_libraries()?;
    for dir in &library_dirs {
        eprintln!("library folder: {}", dir.display());
    }
    let mut paths = library_dirs.clone();
    if let Some(existing) = std::env::var_os("LD_LIBRARY_PATH") {
        paths.extend(std::env::split_paths(&existing));
    }
    let library_path = std::env::join_paths(&paths).map_err(|e| format!("LD_LIBRARY_PATH: {e}"))?;

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
    // The reference MLP's step on the device and on the CPU; a stale file from an earlier run
    // must not pass for this one's figures.
    let _ = std::fs::remove_file(BENCH_JSON);
    let bench_ok = match executables.iter().find(|(name, _)| name == BENCH_TEST) {
        Some((_, executable)) => run_with_deadline(
            &format!("`{BENCH_TEST} --bench` (the reference MLP's step, device vs CPU)"),
            Command::new(executable)
                .arg("--bench")
                .env("LD_LIBRARY_PATH", &library_path),
            STEP_DEADLINE,
        )
        .unwrap_or_else(|e| {
            eprintln!("{e}");
            false
        }),
        None => false,
    };
    let all_passed = built
        && bench_ok
        && results
            .values()
            .all(|v| v == &serde_json::Value::Bool(true));

    let summary = serde_json::json!({
        "nvidia_smi_ok": smi,
        "libraries": libraries,
        "library_dirs": library_dirs.iter().map(|p| p.display().to_string()).collect::<Vec<_>>(),
        "prebuilt": matches!(mode, Mode::Prebuilt(_)),
        "build_ok": built,
        "build_seconds": build_seconds,
        "device_tests": results,
        "nn_bench_ok": bench_ok,
        "nn_bench": bench_figures(Path::new(BENCH_JSON)),
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
    fn libraries_are_found_plain_or_versioned() {
        let root = std::env::temp_dir().join(format!("xtask-gpu-check-{}", std::process::id()));
        let (a, b) = (root.join("a"), root.join("b"));
        std::fs::create_dir_all(&a).unwrap();
        std::fs::create_dir_all(&b).unwrap();
        let dirs = vec![a.clone(), b.clone()];
        assert_eq!(find_library("nvrtc", &dirs), Err(None));
        // Only versioned names: the highest major of the first folder that has one.
        for file in [
            "libnvrtc.so.12",
            "libnvrtc.so.13",
            "libnvrtc.so.13.0.88",
            "libnvrtc.so.x",
        ] {
            std::fs::write(b.join(file), b"").unwrap();
        }
        std::fs::write(b.join("libnvrtc-builtins.so.13"), b"").unwrap();
        match find_library("nvrtc", &dirs) {
            Err(Some(path)) => {
                assert!(path.starts_with(&b));
                let file = path.file_name().unwrap().to_string_lossy().into_owned();
                assert!(file.starts_with("libnvrtc.so.13"), "{file}");
            }
            other => panic!("{other:?}"),
        }
        // A plain name anywhere wins.
        std::fs::write(b.join("libnvrtc.so"), b"").unwrap();
        assert_eq!(find_library("nvrtc", &dirs), Ok(b.clone()));
        // Exposing makes the plain name in the link folder.
        let links = root.join("links");
        expose(&links, "nccl", &b.join("libnvrtc.so.12")).unwrap();
        assert_eq!(
            std::fs::read_link(links.join("libnccl.so")).unwrap(),
            b.join("libnvrtc.so.12")
        );
        expose(&links, "nccl", &b.join("libnvrtc.so.13")).unwrap();
        assert_eq!(
            std::fs::read_link(links.join("libnccl.so")).unwrap(),
            b.join("libnvrtc.so.13")
        );
        std::fs::remove_dir_all(&root).unwrap();
    }

    #[test]
    fn every_device_test_is_built_and_the_bench_is_one_of_them() {
        let names: Vec<&str> = DEVICE_TESTS.iter().map(|(_, _, t)| *t).collect();
        assert_eq!(names, ["nccl_gpu", "cuda", "cuda_mlp"]);
        assert!(names.contains(&BENCH_TEST));
        let nn = DEVICE_TESTS
            .iter()
            .find(|(_, _, t)| *t == "cuda_mlp")
            .unwrap();
        assert_eq!((nn.0, nn.1), ("hypershard-nn", "cuda"));
    }

    #[test]
    fn bench_figures_are_read_or_explained() {
        let root = std::env::temp_dir().join(format!("xtask-bench-{}", std::process::id()));
        std::fs::create_dir_all(&root).unwrap();
        let file = root.join("nn.json");
        match bench_figures(&file) {
            serde_json::Value::String(why) => assert!(why.contains("nn.json"), "{why}"),
            other => panic!("{other}"),
        }
        std::fs::write(
            &file,
            r#"{"bench":"nn-cuda-mlp","rows":[{"median_ms":1.5}]}"#,
        )
        .unwrap();
        assert_eq!(bench_figures(&file)["rows"][0]["median_ms"], 1.5);
        std::fs::write(&file, "not json").unwrap();
        match bench_figures(&file) {
            serde_json::Value::String(why) => assert!(why.contains("not JSON"), "{why}"),
            other => panic!("{other}"),
        }
        std::fs::remove_dir_all(&root).unwrap();
    }

    #[test]
    fn modes() {
        let args = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        assert_eq!(parse_mode(&[]), Ok(Mode::BuildAndRun));
        assert_eq!(
            parse_mode(&args(&["--bundle", "target/gpu-bundle"])),
            Ok(Mode::Bundle(PathBuf::from("target/gpu-bundle")))
        );
        assert_eq!(
            parse_mode(&args(&["--prebuilt", "b"])),
            Ok(Mode::Prebuilt(PathBuf::from("b")))
        );
        assert!(parse_mode(&args(&["--bundle"])).is_err());
        assert!(parse_mode(&args(&["extra"])).is_err());
    }
}
