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
//!    `nccl`; tensor's `cuda`, nn's `cuda_devices` and fsdp's `cuda_nccl` with feature `cuda`;
//!    one feature set, so cudarc compiles once).
//! 4. Runs each with `HYPERSHARD_TEST_GPU=1`: they fail when the GPU is missing.
//! 5. Runs the benches of [`BENCH_TESTS`]: `cuda_devices --bench`, the reference MLP's training
//!    step (8 × Linear(1024, 1024) + ReLU, batch 32) timed on the device (f32, bf16) and on the
//!    CPU, into `target/bench/nn-cuda-mlp.json`.
//! 6. Trains `small` with `hypershard train --device cuda` at the world sizes of
//!    [`TRAIN_RANKS`], each beside a `--device cpu` run of the same seed, and holds the
//!    losses to the CPU's ([`TRAIN_LOSS_RTOL`]).
//! 7. Times the GPT step (`hypershard train --model gpt2`, one rank) against PyTorch's
//!    (`bench_gpt_cuda.py`) on the same GPU.
//! 8. Runs `bench-nccl` (hypershard-benches, feature `nccl`): the NCCL busbw sweep on one rank
//!    per GPU, interleaved with its torch.distributed peer (`bench_nccl.py`, run by `python3`
//!    or `$HYPERSHARD_TORCH_PYTHON`), into `target/bench/nccl.json`.
//! 9. Writes a summary to `target/bench/gpu-check.json`, with the benchmarks' figures in it.
//!
//! A lent GPU machine has no Rust toolchain and no network, so step 3 can also run here:
//! `cargo xtask gpu-check --bundle DIR` builds the binaries and copies them, with this xtask
//! binary and the torch peer's script, into `DIR`. On the GPU machine,
//! `DIR/xtask gpu-check --prebuilt DIR` then runs steps 1, 2 and 4 to 9 with those binaries
//! (see docs/gpu.md).
//!
//! Every child gets a deadline, in its own process group (killed whole at the deadline, so
//! no rank process outlives it), and the deadlines share one budget of [`TOTAL_BUDGET`], so
//! the whole check on the device stays within five minutes.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// The most the build may take when it runs on the GPU machine (plain `gpu-check`), where it
/// spends device time.
const BUILD_DEADLINE: Duration = Duration::from_secs(180);
/// The most the build may take for `--bundle`, which runs here and spends no device time
/// (a release build of the benches' dependencies takes minutes on a loaded 2-core machine).
const BUNDLE_BUILD_DEADLINE: Duration = Duration::from_secs(1800);
/// The most one test binary (or `nvidia-smi`) may take.
const STEP_DEADLINE: Duration = Duration::from_secs(60);
/// Everything after the build (nvidia-smi, the libraries, the device tests and the benches)
/// shares this budget: each step's deadline is the smaller of its own and what is left.
const TOTAL_BUDGET: Duration = Duration::from_secs(285);
/// The least the NCCL sweep is given; with less left it is not started.
const NCCL_BENCH_MIN: Duration = Duration::from_secs(30);
/// The most the NCCL sweep is given (its own `--budget-s`, plus this margin for its exit).
const NCCL_BENCH_MAX: Duration = Duration::from_secs(150);
const NCCL_BENCH_MARGIN: Duration = Duration::from_secs(10);

/// The device test binaries: (package, feature, test target).
const DEVICE_TESTS: &[(&str, &str, &str)] = &[
    ("hypershard-collectives", "nccl", "nccl_gpu"),
    ("hypershard-tensor", "cuda", "cuda"),
    ("hypershard-nn", "cuda", "cuda_devices"),
    ("hypershard-fsdp", "cuda", "cuda_nccl"),
];

/// The device binaries other than tests: (package, feature, binary). Their features join the
/// tests' in the one cargo call.
const DEVICE_BINS: &[(&str, &str, &str)] = &[
    ("hypershard-benches", "nccl", NCCL_BENCH),
    ("hypershard", "cuda", TRAIN_BIN),
];

/// The CLI, built with CUDA, for the training runs of [`TRAIN_RANKS`].
const TRAIN_BIN: &str = "hypershard";

/// `hypershard train --device cuda` runs at these world sizes (FSDP over all ranks; ranks
/// beyond the GPU count share a GPU), each beside a `--device cpu` run of the same seed.
const TRAIN_RANKS: &[usize] = &[1, 2];
/// Steps of each training run (the `small` preset: seconds on either device).
const TRAIN_STEPS: u64 = 50;
/// The most a step's loss on the GPU may differ from the CPU run's, relative: the two sum in
/// different orders (cuBLAS, the kernels' reductions), and 50 steps of AdamW carry it on.
const TRAIN_LOSS_RTOL: f64 = 1e-3;
/// Where the training runs write (one folder per device and world size).
const TRAIN_OUT: &str = "target/bench/gpu-train";

/// The GPT step timed against PyTorch on the same GPU, one rank: `hypershard train --model
/// gpt2` and [`GPT_PEER_SCRIPT`] with these sequences per step and steps, each leaving out
/// the first fifth of its steps (`hypershard train`'s steady state).
const GPT_STEP_BATCH: usize = 8;
const GPT_STEP_STEPS: u64 = 10;
const GPT_STEP_WARMUP: u64 = 2;
/// The most our step time may be over PyTorch's (issue target), reported, not enforced.
const GPT_STEP_TARGET: f64 = 1.3;
/// PyTorch's side of the GPT step, copied into the bundle beside the NCCL peer.
const GPT_PEER_SCRIPT: &str = "benches/python/bench_gpt_cuda.py";
/// The nanoGPT model [`GPT_PEER_SCRIPT`] imports (bundled beside it).
const GPT_MODEL_SCRIPT: &str = "crates/hypershard/scripts/compare_nanogpt.py";
/// Where the GPT step writes (our run's folder, PyTorch's JSON line).
const GPT_STEP_OUT: &str = "target/bench/gpu-gpt-step";

/// The NCCL busbw sweep (`benches/src/bin/bench-nccl.rs`).
const NCCL_BENCH: &str = "bench-nccl";

/// The torch.distributed peer of [`NCCL_BENCH`], copied into the bundle beside it.
const NCCL_PEER_SCRIPT: &str = "benches/python/bench_nccl.py";

/// Where [`NCCL_BENCH`] writes its figures (given to it with `--json`).
const NCCL_JSON: &str = "target/bench/nccl.json";

/// A device test binary that also times something when given `--bench`.
struct BenchTest {
    /// The test binary (one of [`DEVICE_TESTS`]).
    test: &'static str,
    /// Where `--bench` writes its figures (relative to the repository root, the working
    /// folder of gpu-check and its children).
    json: &'static str,
    /// What it times, for the log.
    what: &'static str,
    /// Its key in the summary (`<key>_ok`, `<key>`).
    key: &'static str,
}

/// The benches run after the device tests: the reference MLP's step on one device against
/// the CPU.
const BENCH_TESTS: &[BenchTest] = &[BenchTest {
    test: "cuda_devices",
    json: "target/bench/nn-cuda-mlp.json",
    what: "the reference MLP's step, device vs CPU",
    key: "nn_bench",
}];

/// The benchmark's figures for the summary: its JSON, or a string saying why there is none.
fn bench_figures(path: &Path) -> serde_json::Value {
    match std::fs::read_to_string(path) {
        Ok(text) => serde_json::from_str(&text).unwrap_or_else(|e| {
            serde_json::Value::String(format!("{}: not JSON: {e}", path.display()))
        }),
        Err(e) => serde_json::Value::String(format!("{}: {e}", path.display())),
    }
}

/// The part of the NCCL sweep's JSON that goes into the summary: the target, the comparison
/// and what says how it was measured (the rows stay in [`NCCL_JSON`]); or why there is none.
fn nccl_figures(path: &Path) -> serde_json::Value {
    match bench_figures(path) {
        serde_json::Value::Object(all) => {
            let keep = [
                "world",
                "rounds",
                "peers",
                "peer_errors",
                "notes",
                "target",
                "comparison",
                "seconds",
            ];
            serde_json::Value::Object(
                all.into_iter()
                    .filter(|(key, _)| keep.contains(&key.as_str()))
                    .collect(),
            )
        }
        other => other,
    }
}

/// The time left of a budget that started at `started`.
fn left(started: Instant, budget: Duration) -> Duration {
    budget.saturating_sub(started.elapsed())
}

/// Kills `child` and, since it leads its own process group, everything it started (rank
/// processes, a python's workers).
fn kill_group(child: &mut std::process::Child) {
    // The group's id is the child's pid (`process_group(0)`); `kill -KILL -- -PGID` signals
    // the whole group. If `kill` is missing, at least the child itself goes.
    let _ = Command::new("kill")
        .args(["-KILL", "--", &format!("-{}", child.id())])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status();
    let _ = child.kill();
    let _ = child.wait();
}

/// Runs `command` to completion or kills its process group at `deadline`; `Ok(true)` when it
/// exited 0.
fn run_with_deadline(
    name: &str,
    command: &mut Command,
    deadline: Duration,
) -> Result<bool, String> {
    use std::os::unix::process::CommandExt;
    eprintln!("==> gpu-check: {name} (deadline {deadline:?})");
    let mut child = command
        .process_group(0)
        .spawn()
        .map_err(|e| format!("{name}: cannot start: {e}"))?;
    let started = Instant::now();
    loop {
        match child.try_wait() {
            Ok(Some(status)) => return Ok(status.success()),
            Ok(None) if started.elapsed() > deadline => {
                kill_group(&mut child);
                return Err(format!("{name}: killed after {deadline:?}"));
            }
            Ok(None) => std::thread::sleep(Duration::from_millis(100)),
            Err(e) => return Err(format!("{name}: {e}")),
        }
    }
}

/// [`run_with_deadline`], with a failure to start or a kill at the deadline printed and counted
/// as not passed.
fn passed(name: &str, command: &mut Command, deadline: Duration) -> bool {
    run_with_deadline(name, command, deadline).unwrap_or_else(|e| {
        eprintln!("{e}");
        false
    })
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

/// The python whose pip wheels are searched and which runs the torch peer: `python3`, or
/// `$HYPERSHARD_TORCH_PYTHON`.
fn python() -> String {
    std::env::var("HYPERSHARD_TORCH_PYTHON").unwrap_or_else(|_| "python3".to_string())
}

/// The script [`wheel_lib_dirs`] runs: every `nvidia/<wheel>/lib` folder (pip's CUDA 12 layout,
/// `nvidia/cublas/lib`, ..., and CUDA 13's, `nvidia/cu13/lib` and `nvidia/nccl/lib`) under each
/// of python's site-packages folders as `site` reports them (`site.getsitepackages()` and the
/// user's), then under the `nvidia` namespace package's own path (a `.pth` or `PYTHONPATH`
/// entry), each once.
const WHEEL_DIRS_SCRIPT: &str = "\
import os, site
roots = []
try:
    roots += [os.path.join(p, 'nvidia') for p in site.getsitepackages()]
except Exception:
    pass
try:
    roots.append(os.path.join(site.getusersitepackages(), 'nvidia'))
except Exception:
    pass
try:
    import nvidia
    roots += list(nvidia.__path__)
except Exception:
    pass
seen = set()
for root in roots:
    if not os.path.isdir(root):
        continue
    for sub in sorted(os.listdir(root)):
        lib = os.path.realpath(os.path.join(root, sub, 'lib'))
        if os.path.isdir(lib) and lib not in seen:
            seen.add(lib)
            print(lib)
";

/// Every `lib` folder of pip's `nvidia` wheels for [`python`] (see [`WHEEL_DIRS_SCRIPT`]).
fn wheel_lib_dirs() -> Vec<PathBuf> {
    wheel_lib_dirs_of(Command::new(python()))
}

/// [`wheel_lib_dirs`] for the python that `python` runs; none when it cannot run.
fn wheel_lib_dirs_of(mut python: Command) -> Vec<PathBuf> {
    let Ok(out) = python
        .args(["-c", WHEEL_DIRS_SCRIPT])
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
/// under names cudarc tries, so it is only reported), and cuBLASLt, which libcublas loads by
/// its versioned name through `LD_LIBRARY_PATH` (reported so a missing one is seen; its plain
/// link is harmless).
const LIBRARIES: &[&str] = &["nvrtc", "cublas", "cublasLt", "nccl"];

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

/// Copies the built binaries, this xtask binary and the torch peer's script into `dir`, and
/// strips the binaries' debug information when `strip` is there (the bundle travels inside a
/// 64 MiB carry; the debug xtask alone is about 15 MB unstripped).
fn bundle(dir: &Path, executables: &[(String, PathBuf)]) -> Result<(), String> {
    std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let mut copied = Vec::new();
    for (name, executable) in executables {
        std::fs::copy(executable, dir.join(name))
            .map_err(|e| format!("{} -> {}: {e}", executable.display(), dir.display()))?;
        copied.push(dir.join(name));
    }
    let me = std::env::current_exe().map_err(|e| format!("this executable: {e}"))?;
    std::fs::copy(&me, dir.join("xtask")).map_err(|e| format!("{}: {e}", me.display()))?;
    copied.push(dir.join("xtask"));
    for script in [NCCL_PEER_SCRIPT, GPT_PEER_SCRIPT, GPT_MODEL_SCRIPT] {
        let script = Path::new(script);
        let script_name = script
            .file_name()
            .ok_or("the peer script has no file name")?;
        std::fs::copy(script, dir.join(script_name))
            .map_err(|e| format!("{}: {e}", script.display()))?;
    }
    for file in &copied {
        match Command::new("strip")
            .arg("--strip-debug")
            .arg(file)
            .status()
        {
            Ok(status) if status.success() => {}
            Ok(status) => eprintln!("gpu-check: strip {}: {status}", file.display()),
            Err(e) => eprintln!("gpu-check: strip is not usable ({e}); the bundle is unstripped"),
        }
    }
    Ok(())
}

/// The executables of the test or binary targets named `names` in cargo's
/// `--message-format=json` output, as `(target name, path)` in the order cargo reported them.
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
            .is_some_and(|kinds| kinds.iter().any(|k| k == "test" || k == "bin"));
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

/// The one cargo call that builds every device binary (release): `cargo build --test T` for
/// each test and `--bin B` for each of [`DEVICE_BINS`], every package's feature in one set, so
/// cudarc compiles once.
fn build_command(cargo: &str) -> Command {
    let mut build = Command::new(cargo);
    build.args([
        "build",
        "--release",
        "--locked",
        "--message-format=json-render-diagnostics",
    ]);
    let mut features = Vec::new();
    for (package, feature, test) in DEVICE_TESTS {
        build.args(["-p", package, "--test", test]);
        features.push(format!("{package}/{feature}"));
    }
    for (package, feature, bin) in DEVICE_BINS {
        build.args(["-p", package, "--bin", bin]);
        features.push(format!("{package}/{feature}"));
    }
    // Two test binaries of one package name its feature once.
    let mut seen = std::collections::HashSet::new();
    features.retain(|f| seen.insert(f.clone()));
    build.args(["--features", &features.join(",")]);
    build
}

/// The names of every device binary, tests first.
fn device_binary_names() -> Vec<&'static str> {
    DEVICE_TESTS
        .iter()
        .map(|(_, _, test)| *test)
        .chain(DEVICE_BINS.iter().map(|(_, _, bin)| *bin))
        .collect()
}

/// Trains `small` for [`TRAIN_STEPS`] steps on `ranks` ranks with `--device cuda` and with
/// `--device cpu` (same seed and data), and compares the losses step by step.
fn train_against_cpu(
    hypershard: &Path,
    ranks: usize,
    library_path: &std::ffi::OsStr,
    deadline: &dyn Fn(Duration) -> Duration,
) -> serde_json::Value {
    let mut losses = Vec::new();
    for device in ["cuda", "cpu"] {
        let out = Path::new(TRAIN_OUT).join(format!("{device}-{ranks}"));
        // A folder left by an earlier check would make train refuse (or pass stale losses).
        let _ = std::fs::remove_dir_all(&out);
        let started = Instant::now();
        let ran = passed(
            &format!("`hypershard train --device {device}` on {ranks} rank(s)"),
            Command::new(hypershard)
                .args(["train", "--model", "small", "--device", device])
                .args(["--nproc", &ranks.to_string(), "--mesh", &ranks.to_string()])
                .args(["--steps", &TRAIN_STEPS.to_string(), "--eval-every", "0"])
                .arg("--out")
                .arg(&out)
                .env("LD_LIBRARY_PATH", library_path),
            deadline(STEP_DEADLINE),
        );
        let seconds = started.elapsed().as_secs_f64();
        if !ran {
            return serde_json::json!({"ok": false, "why": format!("the {device} run failed"), "seconds": seconds});
        }
        match read_losses(&out.join("losses.jsonl")) {
            Ok(read) => losses.push(read),
            Err(why) => return serde_json::json!({"ok": false, "why": why}),
        }
    }
    compare_losses(&losses[1], &losses[0], TRAIN_LOSS_RTOL)
}

/// `hypershard train --device cuda --model gpt2` and PyTorch's step on the same GPU, one rank
/// each, run one after the other; their steady-state tokens per second and the step-time ratio.
fn gpt_step_against_torch(
    hypershard: &Path,
    script: &Path,
    library_path: &std::ffi::OsStr,
    deadline: &dyn Fn(Duration) -> Duration,
) -> serde_json::Value {
    let out = Path::new(GPT_STEP_OUT);
    let _ = std::fs::remove_dir_all(out);
    if let Err(e) = std::fs::create_dir_all(out) {
        return serde_json::json!({"ok": false, "why": format!("{}: {e}", out.display())});
    }
    let ours_dir = out.join("hypershard");
    let ours_ran = passed(
        "`hypershard train --device cuda --model gpt2` (the GPT step)",
        Command::new(hypershard)
            .args([
                "train", "--model", "gpt2", "--device", "cuda", "--nproc", "1",
            ])
            .args(["--mesh", "1", "--eval-every", "0"])
            .args(["--batch-size", &GPT_STEP_BATCH.to_string()])
            .args(["--steps", &GPT_STEP_STEPS.to_string()])
            .arg("--out")
            .arg(&ours_dir)
            .env("LD_LIBRARY_PATH", library_path),
        deadline(STEP_DEADLINE),
    );
    let ours = if ours_ran {
        steady_tokens(&ours_dir.join("summary.json"))
    } else {
        Err("the hypershard run failed".to_string())
    };
    let torch_json = out.join("torch.json");
    let torch_ran = passed(
        "PyTorch's GPT step (bench_gpt_cuda.py)",
        Command::new(python())
            .arg(script)
            .args(["--preset", "gpt2", "--device", "cuda"])
            .args(["--batch-size", &GPT_STEP_BATCH.to_string()])
            .args(["--steps", &GPT_STEP_STEPS.to_string()])
            .args(["--warmup", &GPT_STEP_WARMUP.to_string()])
            .arg("--json")
            .arg(&torch_json)
            // PyTorch keeps the library path it was started with (its own wheels).
            .env(
                "LD_LIBRARY_PATH",
                std::env::var_os("LD_LIBRARY_PATH").unwrap_or_default(),
            ),
        deadline(STEP_DEADLINE),
    );
    let torch = if torch_ran {
        std::fs::read_to_string(&torch_json)
            .map_err(|e| format!("{}: {e}", torch_json.display()))
            .and_then(|line| {
                serde_json::from_str::<serde_json::Value>(&line)
                    .map_err(|e| format!("{}: not JSON ({e})", torch_json.display()))
            })
            .and_then(|row| {
                row["tokens_per_s"]
                    .as_f64()
                    .ok_or_else(|| format!("{}: no tokens_per_s", torch_json.display()))
            })
    } else {
        Err("the PyTorch run failed".to_string())
    };
    gpt_step_verdict(ours, torch)
}

/// The steady-state tokens per second of a `hypershard train` run's `summary.json`.
fn steady_tokens(path: &Path) -> Result<f64, String> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let summary: serde_json::Value =
        serde_json::from_str(&text).map_err(|e| format!("{}: not JSON ({e})", path.display()))?;
    summary["steady_tokens_per_second"]
        .as_f64()
        .ok_or_else(|| format!("{}: no steady_tokens_per_second", path.display()))
}

/// Both sides' tokens per second, our step time over PyTorch's (the target is at most
/// [`GPT_STEP_TARGET`]), or why a side has no figure.
fn gpt_step_verdict(ours: Result<f64, String>, torch: Result<f64, String>) -> serde_json::Value {
    match (ours, torch) {
        (Ok(ours), Ok(torch)) if ours > 0.0 && torch > 0.0 => {
            let step_time_ratio = torch / ours;
            serde_json::json!({
                "ok": true,
                "hypershard_tokens_per_s": ours,
                "torch_tokens_per_s": torch,
                "step_time_over_torch": step_time_ratio,
                "target": GPT_STEP_TARGET,
                "target_met": step_time_ratio <= GPT_STEP_TARGET,
                "batch_size": GPT_STEP_BATCH,
                "steps": GPT_STEP_STEPS,
            })
        }
        (ours, torch) => serde_json::json!({
            "ok": false,
            "hypershard": ours.map_or_else(serde_json::Value::from, serde_json::Value::from),
            "torch": torch.map_or_else(serde_json::Value::from, serde_json::Value::from),
        }),
    }
}

/// `(step, loss)` of every line of a run's `losses.jsonl`.
fn read_losses(path: &Path) -> Result<Vec<(u64, f64)>, String> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
    text.lines()
        .filter(|line| !line.trim().is_empty())
        .map(|line| {
            let row: serde_json::Value = serde_json::from_str(line)
                .map_err(|e| format!("{}: not JSON ({e}): {line}", path.display()))?;
            match (row["step"].as_u64(), row["loss"].as_f64()) {
                (Some(step), Some(loss)) => Ok((step, loss)),
                _ => Err(format!("{}: no step and loss in {line}", path.display())),
            }
        })
        .collect()
}

/// Whether `device`'s losses follow `reference`'s: the same steps, every loss finite and
/// within `rtol` of the reference's, relative. Returns the verdict with the largest
/// difference and where it was.
fn compare_losses(reference: &[(u64, f64)], device: &[(u64, f64)], rtol: f64) -> serde_json::Value {
    let steps = |losses: &[(u64, f64)]| losses.iter().map(|(s, _)| *s).collect::<Vec<_>>();
    if reference.is_empty() || steps(reference) != steps(device) {
        return serde_json::json!({
            "ok": false,
            "why": format!("steps differ: {} on the CPU, {} on the device", reference.len(), device.len()),
        });
    }
    let (mut worst, mut at) = (0.0f64, reference[0].0);
    for (&(step, want), &(_, got)) in reference.iter().zip(device) {
        let diff = if got.is_finite() {
            (got - want).abs() / want.abs().max(f64::MIN_POSITIVE)
        } else {
            f64::INFINITY
        };
        if diff > worst || diff.is_nan() {
            (worst, at) = (diff, step);
        }
    }
    serde_json::json!({
        "ok": worst <= rtol,
        "steps": reference.len(),
        "max_rel_diff": if worst.is_finite() { serde_json::json!(worst) } else { serde_json::json!("inf") },
        "at_step": at,
        "rtol": rtol,
        "first_loss": [reference[0].1, device[0].1],
        "last_loss": [reference[reference.len() - 1].1, device[device.len() - 1].1],
    })
}

/// Builds the device binaries in one cargo call; returns their executables.
fn build_device_tests(deadline: Duration) -> Result<(Vec<(String, PathBuf)>, f64), String> {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_string());
    let build = build_command(&cargo);
    eprintln!("==> gpu-check: build the device binaries");
    let started = Instant::now();
    let (ok, stdout) = run_capturing(build, deadline)?;
    let seconds = started.elapsed().as_secs_f64();
    let names = device_binary_names();
    let executables = test_executables(&stdout, &names);
    if ok && executables.len() == names.len() {
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
            let executables: Vec<(String, PathBuf)> = device_binary_names()
                .into_iter()
                .map(|name| (name.to_string(), dir.join(name)))
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
        Mode::BuildAndRun | Mode::Bundle(_) => {
            match build_device_tests(if mode == Mode::BuildAndRun {
                BUILD_DEADLINE
            } else {
                BUNDLE_BUILD_DEADLINE
            }) {
                Ok(built) => built,
                Err(e) if mode == Mode::BuildAndRun => {
                    eprintln!("gpu-check: {e}");
                    (Vec::new(), 0.0)
                }
                Err(e) => return Err(e),
            }
        }
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
    let built = executables.len() == device_binary_names().len();
    // The device time starts here.
    let budget_started = Instant::now();
    let deadline = |own: Duration| own.min(left(budget_started, TOTAL_BUDGET));

    let smi = passed(
        "nvidia-smi",
        &mut Command::new("nvidia-smi"),
        deadline(STEP_DEADLINE),
    );
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
    let tests = executables
        .iter()
        .filter(|(name, _)| DEVICE_TESTS.iter().any(|(_, _, test)| test == name));
    for (name, executable) in tests {
        let ran = passed(
            &format!("device tests `{name}` (HYPERSHARD_TEST_GPU=1)"),
            Command::new(executable)
                .env("HYPERSHARD_TEST_GPU", "1")
                .env("LD_LIBRARY_PATH", &library_path),
            deadline(STEP_DEADLINE),
        );
        results.insert(name.clone(), serde_json::Value::Bool(ran));
    }
    // The benches' steps on the device and on the CPU; a stale file from an earlier run must
    // not pass for this one's figures.
    let mut bench_ok = true;
    let mut benches = serde_json::Map::new();
    for bench in BENCH_TESTS {
        let _ = std::fs::remove_file(bench.json);
        let ok = match executables.iter().find(|(name, _)| name == bench.test) {
            Some((_, executable)) => passed(
                &format!("`{} --bench` ({})", bench.test, bench.what),
                Command::new(executable)
                    .arg("--bench")
                    .env("LD_LIBRARY_PATH", &library_path),
                deadline(STEP_DEADLINE),
            ),
            None => false,
        };
        bench_ok &= ok;
        benches.insert(format!("{}_ok", bench.key), serde_json::Value::Bool(ok));
        benches.insert(bench.key.to_string(), bench_figures(Path::new(bench.json)));
    }
    // `hypershard train --device cuda` against the CPU run of the same seed.
    let mut train_ok = true;
    let mut train = serde_json::Map::new();
    let hypershard = executables
        .iter()
        .find(|(name, _)| name == TRAIN_BIN)
        .map(|(_, path)| path.clone());
    for &ranks in TRAIN_RANKS {
        let result = match &hypershard {
            Some(executable) => {
                train_against_cpu(executable, ranks, &library_path, &|own| deadline(own))
            }
            None => serde_json::json!({"ok": false, "why": "the CLI was not built"}),
        };
        train_ok &= result["ok"] == serde_json::Value::Bool(true);
        train.insert(format!("world_{ranks}"), result);
    }
    // The GPT step against PyTorch's on the same GPU.
    let gpt_step = match &hypershard {
        Some(executable) => {
            let script = match &mode {
                Mode::Prebuilt(dir) => dir.join("bench_gpt_cuda.py"),
                _ => PathBuf::from(GPT_PEER_SCRIPT),
            };
            gpt_step_against_torch(executable, &script, &library_path, &|own| deadline(own))
        }
        None => serde_json::json!({"ok": false, "why": "the CLI was not built"}),
    };
    let gpt_step_ok = gpt_step["ok"] == serde_json::Value::Bool(true);
    // The NCCL sweep with its torch peer, in what is left of the budget.
    let _ = std::fs::remove_file(NCCL_JSON);
    let nccl_ok = match executables.iter().find(|(name, _)| name == NCCL_BENCH) {
        Some((_, executable)) => {
            let remaining = left(budget_started, TOTAL_BUDGET);
            if remaining < NCCL_BENCH_MIN {
                eprintln!("gpu-check: {remaining:?} left, too little for {NCCL_BENCH}");
                false
            } else {
                let own = (remaining - NCCL_BENCH_MARGIN).min(NCCL_BENCH_MAX);
                let script = match &mode {
                    Mode::Prebuilt(dir) => dir.join("bench_nccl.py"),
                    _ => PathBuf::from(NCCL_PEER_SCRIPT),
                };
                passed(
                    &format!(
                        "`{NCCL_BENCH}` (NCCL busbw sweep, interleaved with torch.distributed)"
                    ),
                    Command::new(executable)
                        .args(["--peer", "torch", "--json", NCCL_JSON, "--budget-s"])
                        .arg(format!("{}", own.as_secs()))
                        .arg("--python")
                        .arg(python())
                        .arg("--torch-script")
                        .arg(&script)
                        .env("LD_LIBRARY_PATH", &library_path)
                        // The torch peer runs with the path this check was started with,
                        // so its libraries keep their own wheels (bench-nccl's docs).
                        .env(
                            "HYPERSHARD_PEER_LD_LIBRARY_PATH",
                            std::env::var_os("LD_LIBRARY_PATH").unwrap_or_default(),
                        ),
                    deadline(own + NCCL_BENCH_MARGIN),
                )
            }
        }
        None => false,
    };
    let all_passed = built
        && bench_ok
        && train_ok
        && gpt_step_ok
        && nccl_ok
        && results
            .values()
            .all(|v| v == &serde_json::Value::Bool(true));

    let mut summary = serde_json::json!({
        "nvidia_smi_ok": smi,
        "libraries": libraries,
        "library_dirs": library_dirs.iter().map(|p| p.display().to_string()).collect::<Vec<_>>(),
        "prebuilt": matches!(mode, Mode::Prebuilt(_)),
        "build_ok": built,
        "build_seconds": build_seconds,
        "device_tests": results,
        "train_ok": train_ok,
        "train": train,
        "gpt_step_ok": gpt_step_ok,
        "gpt_step": gpt_step,
        "nccl_bench_ok": nccl_ok,
        "nccl_bench": nccl_figures(Path::new(NCCL_JSON)),
        "device_tests_passed": all_passed,
        "seconds": started.elapsed().as_secs_f64(),
    });
    if let Some(fields) = summary.as_object_mut() {
        fields.extend(benches);
    }
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
            r#"{"reason":"compiler-artifact","target":{"kind":["bin"],"name":"bench-nccl"},"executable":"/t/release/bench-nccl"}"#,
            r#"{"reason":"compiler-artifact","target":{"kind":["bin"],"name":"bench-nn"},"executable":"/t/release/bench-nn"}"#,
        ]
        .join("\n");
        assert_eq!(
            test_executables(&lines, &["bench-nccl"]),
            vec![(
                "bench-nccl".to_string(),
                PathBuf::from("/t/release/bench-nccl")
            )]
        );
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
        assert_eq!(names, ["nccl_gpu", "cuda", "cuda_devices", "cuda_nccl"]);
        for bench in BENCH_TESTS {
            assert!(names.contains(&bench.test), "{}", bench.test);
        }
        let nn = DEVICE_TESTS
            .iter()
            .find(|(_, _, t)| *t == "cuda_devices")
            .unwrap();
        assert_eq!((nn.0, nn.1), ("hypershard-nn", "cuda"));
    }

    #[test]
    fn device_losses_are_held_to_the_cpu_run() {
        let reference = [(0, 5.5), (1, 5.0), (2, 4.0)];
        let close = [(0, 5.5), (1, 5.0 * (1.0 + 4e-4)), (2, 4.0 * (1.0 - 2e-4))];
        let verdict = compare_losses(&reference, &close, 1e-3);
        assert_eq!(verdict["ok"], true, "{verdict}");
        assert_eq!(verdict["at_step"], 1);
        assert!((verdict["max_rel_diff"].as_f64().unwrap() - 4e-4).abs() < 1e-12);

        let drifted = [(0, 5.5), (1, 5.0), (2, 4.01)];
        let verdict = compare_losses(&reference, &drifted, 1e-3);
        assert_eq!(
            (verdict["ok"].clone(), verdict["at_step"].clone()),
            (false.into(), 2.into())
        );

        let nan = [(0, 5.5), (1, f64::NAN), (2, 4.0)];
        let verdict = compare_losses(&reference, &nan, 1e-3);
        assert_eq!(verdict["ok"], false, "{verdict}");
        assert_eq!(verdict["max_rel_diff"], "inf");

        let short = [(0, 5.5), (1, 5.0)];
        let verdict = compare_losses(&reference, &short, 1e-3);
        assert!(
            verdict["why"].as_str().unwrap().contains("steps differ"),
            "{verdict}"
        );
    }

    #[test]
    fn the_gpt_step_is_a_ratio_of_two_measured_sides() {
        let verdict = gpt_step_verdict(Ok(100.0), Ok(120.0));
        assert_eq!(verdict["ok"], true);
        assert!((verdict["step_time_over_torch"].as_f64().unwrap() - 1.2).abs() < 1e-12);
        assert_eq!(verdict["target_met"], true);
        let verdict = gpt_step_verdict(Ok(100.0), Ok(140.0));
        assert_eq!(verdict["target_met"], false);
        let verdict = gpt_step_verdict(Err("the hypershard run failed".into()), Ok(140.0));
        assert_eq!(verdict["ok"], false);
        assert_eq!(verdict["hypershard"], "the hypershard run failed");
        assert_eq!(verdict["torch"], 140.0);
        assert_eq!(gpt_step_verdict(Ok(0.0), Ok(1.0))["ok"], false);

        let root = std::env::temp_dir().join(format!("xtask-gpu-summary-{}", std::process::id()));
        std::fs::create_dir_all(&root).unwrap();
        let file = root.join("summary.json");
        std::fs::write(&file, r#"{"steps":10,"steady_tokens_per_second":81234.5}"#).unwrap();
        assert_eq!(steady_tokens(&file).unwrap(), 81234.5);
        std::fs::write(&file, r#"{"steps":10}"#).unwrap();
        assert!(
            steady_tokens(&file)
                .unwrap_err()
                .contains("steady_tokens_per_second")
        );
        std::fs::remove_dir_all(&root).unwrap();
    }

    #[test]
    fn losses_are_read_from_the_runs_jsonl() {
        let root = std::env::temp_dir().join(format!("xtask-gpu-losses-{}", std::process::id()));
        std::fs::create_dir_all(&root).unwrap();
        let file = root.join("losses.jsonl");
        std::fs::write(
            &file,
            "{\"step\":0,\"loss\":5.5,\"lr\":0.001,\"tokens\":512}\n{\"step\":1,\"loss\":5.25,\"lr\":0.001,\"tokens\":1024}\n",
        )
        .unwrap();
        assert_eq!(read_losses(&file).unwrap(), [(0, 5.5), (1, 5.25)]);
        std::fs::write(&file, "{\"step\":0}\n").unwrap();
        assert!(read_losses(&file).unwrap_err().contains("no step and loss"));
        std::fs::remove_dir_all(&root).unwrap();
    }

    #[test]
    fn bench_figures_are_read_or_explained() {
        let root = std::env::temp_dir().join(format!("xtask-gpu-figures-{}", std::process::id()));
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
    fn one_build_call_makes_every_device_binary_with_one_feature_set() {
        let build = build_command("cargo");
        let args: Vec<String> = build
            .get_args()
            .map(|a| a.to_string_lossy().into_owned())
            .collect();
        assert_eq!(&args[..3], ["build", "--release", "--locked"]);
        let joined = args.join(" ");
        for (package, _, test) in DEVICE_TESTS {
            assert!(
                joined.contains(&format!("-p {package} --test {test}")),
                "{joined}"
            );
        }
        assert!(
            joined.contains("-p hypershard-benches --bin bench-nccl"),
            "{joined}"
        );
        assert!(
            joined.contains("-p hypershard --bin hypershard"),
            "{joined}"
        );
        let features = &args[args.iter().position(|a| a == "--features").unwrap() + 1];
        assert_eq!(
            features,
            "hypershard-collectives/nccl,hypershard-tensor/cuda,hypershard-nn/cuda,hypershard-fsdp/cuda,hypershard-benches/nccl,hypershard/cuda"
        );
        assert_eq!(
            device_binary_names(),
            [
                "nccl_gpu",
                "cuda",
                "cuda_devices",
                "cuda_nccl",
                "bench-nccl",
                "hypershard"
            ]
        );
    }

    #[test]
    fn wheel_folders_are_found_in_the_cu12_and_cu13_layouts() {
        // pip's CUDA 13 layout (nvidia/cu13/lib, nvidia/nccl/lib) and CUDA 12's
        // (nvidia/cuda_nvrtc/lib), found through the `nvidia` package on PYTHONPATH.
        let root = std::env::temp_dir().join(format!("xtask-wheels-{}", std::process::id()));
        let site = root.join("site");
        for sub in ["cu13", "nccl", "cuda_nvrtc"] {
            std::fs::create_dir_all(site.join("nvidia").join(sub).join("lib")).unwrap();
        }
        std::fs::create_dir_all(site.join("nvidia").join("no_lib")).unwrap();
        let mut python = Command::new("python3");
        python.env("PYTHONPATH", &site);
        let dirs = wheel_lib_dirs_of(python);
        let site = std::fs::canonicalize(&site).unwrap();
        for sub in ["cu13", "nccl", "cuda_nvrtc"] {
            let lib = site.join("nvidia").join(sub).join("lib");
            assert_eq!(dirs.iter().filter(|d| **d == lib).count(), 1, "{dirs:?}");
        }
        assert!(
            !dirs
                .iter()
                .any(|d| d.starts_with(site.join("nvidia/no_lib")))
        );
        // A python that cannot run gives no folders, not an error.
        assert!(wheel_lib_dirs_of(Command::new(root.join("no-python"))).is_empty());
        std::fs::remove_dir_all(&root).unwrap();
    }

    #[test]
    fn the_nccl_summary_keeps_the_comparison_and_drops_the_rows() {
        let root = std::env::temp_dir().join(format!("xtask-nccl-{}", std::process::id()));
        std::fs::create_dir_all(&root).unwrap();
        let file = root.join("nccl.json");
        std::fs::write(
            &file,
            r#"{"bench":"nccl","world":1,"rows":[{"op":"all_reduce"}],"target":{"peer":"torch-nccl"},"comparison":[],"peer_errors":[]}"#,
        )
        .unwrap();
        let summary = nccl_figures(&file);
        assert_eq!(summary["world"], 1);
        assert_eq!(summary["target"]["peer"], "torch-nccl");
        assert!(summary.get("rows").is_none() && summary.get("bench").is_none());
        std::fs::remove_file(&file).unwrap();
        assert!(nccl_figures(&file).is_string());
        std::fs::remove_dir_all(&root).unwrap();
        // The budget only shrinks.
        let started = Instant::now();
        assert!(left(started, Duration::from_secs(5)) <= Duration::from_secs(5));
        assert_eq!(left(started, Duration::ZERO), Duration::ZERO);
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
