//! `cargo xtask bench memory`: peak resident memory per rank of `hypershard train` as ranks
//! are added, beside PyTorch FSDP2 with meta-device init, and the demonstration that a model
//! too big for one rank's memory trains when sharded.
//!
//! ```text
//! bench-memory [--quick] [--no-torch] [--hypershard PATH]
//! bench-memory --demo [--limit 1.25GiB] [--hypershard PATH]
//! ```
//!
//! Full run: `--model gpt2` (124 M parameters, vocab 50304, context 1024), batch 1 per rank,
//! two optimizer steps (the second is the steady state: AdamW's moments exist from the first
//! step's end), at 1 rank and at 4 (`--mesh 4`). Ours deferred (the default: each rank
//! materialises only its shard), with and without `--activation-checkpointing`; ours
//! `--eager-init` at 4 ranks for contrast; PyTorch's `bench_gpt_fsdp2.py --meta-init` at 1 and
//! 4 ranks on the same model and batch. The runs alternate between the libraries so both see
//! the same machine load. Each row is the maximum over the run's ranks; `target/bench/memory.json`
//! has the rows and the three target ratios (start-up per rank 4/1 ≤ 0.35; training per rank
//! 4/1 with checkpointing ≤ 0.5; peak minus idle per rank, ours / PyTorch at 4 ranks ≤ 0.8).
//!
//! `--quick` (the smoke): the `small` preset at 1 and 2 ranks, ours only, a few seconds. Its
//! ratios are printed but not judged against the targets.
//!
//! `--demo`: a GPT of 24 layers, width 1024, 16 heads, context 256, vocab 50304 (354 M
//! parameters; fp32 weights, grads and AdamW moments 5.7 GB) trains 2 steps over 8 ranks with
//! activation checkpointing and `--max-rank-memory 1.25GiB` (each rank in its own memory
//! cgroup: resident memory and page cache charged to it count, and a rank over the limit is
//! killed by the kernel). Deferred init, then `--eager-init`. Should the deferred run not fit,
//! the same pair runs again at vocab 256 (303 M parameters). Output:
//! `target/bench/memory-demo.json`.
//!
//! Runs go to `target/bench/memory-runs/<case>/` (the train logs and `summary.json`; the
//! checkpoint each run writes at its end is deleted once read). `hypershard train` is the
//! release binary, `target/release/hypershard` (`cargo build --release -p hypershard`;
//! `cargo xtask bench memory` builds it).

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode, ExitStatus, Stdio};
use std::time::Instant;

use hypershard_benches::memory::{
    GptShape, Init, Library, MemoryBenchError, MemoryRun, Result, Target, io_error, mib,
    parse_size, rank_named_in, read_summary, read_torch_row, targets,
};
use hypershard_benches::{bench_output_dir, write_json};
use serde::Serialize;

#[derive(Debug, Clone)]
struct Args {
    quick: bool,
    demo: bool,
    torch: bool,
    hypershard: Option<PathBuf>,
    limit: String,
}

fn parse_args() -> Result<Args> {
    let mut args = Args {
        quick: false,
        demo: false,
        torch: true,
        hypershard: None,
        limit: "1.25GiB".into(),
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = |name: &str| {
            it.next()
                .ok_or_else(|| MemoryBenchError::Usage(format!("{name} needs a value")))
        };
        match flag.as_str() {
            "--quick" => args.quick = true,
            "--demo" => args.demo = true,
            "--no-torch" => args.torch = false,
            "--hypershard" => args.hypershard = Some(PathBuf::from(value("--hypershard")?)),
            "--limit" => args.limit = value("--limit")?,
            other => {
                return Err(MemoryBenchError::Usage(format!(
                    "unknown flag {other}; flags: --quick, --demo, --no-torch, \
                     --hypershard PATH, --limit SIZE"
                )));
            }
        }
    }
    parse_size(&args.limit)?;
    Ok(args)
}

/// How a child process ended, and its wall time.
struct Finished {
    status: ExitStatus,
    wall_s: f64,
    /// The last lines of its stderr.
    stderr_tail: Vec<String>,
}

impl Finished {
    fn describe(&self) -> String {
        use std::os::unix::process::ExitStatusExt;
        match (self.status.code(), self.status.signal()) {
            (Some(code), _) => format!("exit {code}"),
            (None, Some(signal)) => format!("killed by signal {signal}"),
            (None, None) => "ended without a status".into(),
        }
    }
}

/// Runs `command` with its output in `dir/stdout.log` and `dir/stderr.log`.
fn run_logged(command: &mut Command, dir: &Path, what: &str) -> Result<Finished> {
    let stdout_path = dir.join("stdout.log");
    let stderr_path = dir.join("stderr.log");
    let stdout = std::fs::File::create(&stdout_path).map_err(io_error(&stdout_path))?;
    let stderr = std::fs::File::create(&stderr_path).map_err(io_error(&stderr_path))?;
    eprintln!("==> {what}");
    let started = Instant::now();
    let program = PathBuf::from(command.get_program());
    let status = command
        .stdin(Stdio::null())
        .stdout(stdout)
        .stderr(stderr)
        .status()
        .map_err(io_error(&program))?;
    let wall_s = (started.elapsed().as_secs_f64() * 10.0).round() / 10.0;
    let text = std::fs::read_to_string(&stderr_path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().filter(|l| !l.trim().is_empty()).collect();
    let stderr_tail = lines[lines.len().saturating_sub(6)..]
        .iter()
        .map(|l| l.to_string())
        .collect();
    let finished = Finished {
        status,
        wall_s,
        stderr_tail,
    };
    eprintln!("    {} after {wall_s} s", finished.describe());
    Ok(finished)
}

/// A fresh directory for one run.
fn run_dir(root: &Path, case: &str) -> Result<PathBuf> {
    let dir = root.join(case);
    if dir.exists() {
        std::fs::remove_dir_all(&dir).map_err(io_error(&dir))?;
    }
    std::fs::create_dir_all(&dir).map_err(io_error(&dir))?;
    Ok(dir)
}

/// One of our runs.
#[derive(Clone, Debug)]
struct OursSpec {
    world: usize,
    init: Init,
    checkpointing: bool,
}

impl OursSpec {
    fn case(&self) -> String {
        let init = match self.init {
            Init::Eager => "eager",
            _ => "deferred",
        };
        let ckpt = if self.checkpointing { "-ckpt" } else { "" };
        format!("hypershard-{init}{ckpt}-w{}", self.world)
    }
}

/// `hypershard train` arguments shared by every run of ours.
fn train_command(
    binary: &Path,
    model: &str,
    world: usize,
    steps: usize,
    init: Init,
    checkpointing: bool,
    out: &Path,
) -> Command {
    let mut command = Command::new(binary);
    command.arg("train").args([
        "--nproc",
        &world.to_string(),
        "--mesh",
        &world.to_string(),
        "--model",
        model,
        "--batch-size",
        "1",
        "--steps",
        &steps.to_string(),
        "--eval-every",
        "0",
    ]);
    command.arg("--out").arg(out.join("run"));
    // The memory-lean settings (`hypershard train` keeps its step buffers and maps shared
    // memory rings by default), stated at every world size so that the ratios compare like
    // with like.
    command.arg("--keep-step-buffers=false");
    // And TCP: shared memory maps 8 MiB of rings per peer into every rank.
    command.args(["--transport", "tcp"]);
    if init == Init::Eager {
        command.arg("--eager-init");
    }
    if checkpointing {
        command.arg("--activation-checkpointing");
    }
    command
}

/// Deletes the checkpoint a run wrote at its end (gigabytes for the larger models).
fn drop_checkpoints(out: &Path) {
    let checkpoints = out.join("run").join("checkpoints");
    if checkpoints.exists()
        && let Err(e) = std::fs::remove_dir_all(&checkpoints)
    {
        eprintln!(
            "bench-memory: could not delete {}: {e}",
            checkpoints.display()
        );
    }
}

/// Optimizer steps per run of the suite: the second runs with AdamW's moments allocated, as
/// every later step does, so its peak is the steady state's (the first step's peak comes
/// before the first optimizer step allocates them).
const STEPS: usize = 2;

fn run_ours(binary: &Path, root: &Path, model: &str, spec: &OursSpec) -> Result<MemoryRun> {
    let case = spec.case();
    let dir = run_dir(root, &case)?;
    let mut command = train_command(
        binary,
        model,
        spec.world,
        STEPS,
        spec.init,
        spec.checkpointing,
        &dir,
    );
    let finished = run_logged(&mut command, &dir, &case)?;
    drop_checkpoints(&dir);
    let failed = |why: String| {
        MemoryRun::failed(
            &case,
            Library::Hypershard,
            spec.world,
            spec.init,
            spec.checkpointing,
            finished.wall_s,
            why,
        )
    };
    if !finished.status.success() {
        return Ok(failed(format!(
            "{}: {}",
            finished.describe(),
            finished.stderr_tail.join(" / ")
        )));
    }
    match read_summary(&dir.join("run").join("summary.json")) {
        Ok(summary) => Ok(MemoryRun::from_summary(
            &case,
            spec.init,
            spec.checkpointing,
            finished.wall_s,
            &summary,
        )),
        Err(e) => Ok(failed(e.to_string())),
    }
}

/// PyTorch: the venv's python and the peer's script.
struct Torch {
    python: PathBuf,
    script: PathBuf,
}

fn find_torch() -> Option<Torch> {
    let venv = std::env::var_os("TORCH_VENV")
        .map(PathBuf::from)
        .or_else(|| {
            std::env::var_os("HOME")
                .map(|h| PathBuf::from(h).join(".cache/hypershard-bench/torch-venv"))
        })?;
    let python = venv.join("bin/python");
    let dirs = [
        std::env::var_os("HYPERSHARD_PYTORCH_BENCH_DIR").map(PathBuf::from),
        Some(PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../shared/bench/pytorch")),
        Some(PathBuf::from("/work/shared/bench/pytorch")),
    ];
    let script = dirs
        .into_iter()
        .flatten()
        .map(|d| d.join("bench_gpt_fsdp2.py"))
        .find(|s| s.exists())?;
    python.exists().then_some(Torch { python, script })
}

/// A free local port for torch's rendezvous (several sittings may share the machine, so
/// torch's fixed default could collide).
fn free_port() -> Result<u16> {
    let listener = TcpListener::bind("127.0.0.1:0").map_err(io_error(Path::new("127.0.0.1:0")))?;
    let port = listener
        .local_addr()
        .map_err(io_error(Path::new("127.0.0.1:0")))?
        .port();
    Ok(port)
}

fn run_torch(torch: &Torch, root: &Path, preset: &str, world: usize) -> Result<MemoryRun> {
    let case = format!("torch-fsdp2-meta-w{world}");
    let dir = run_dir(root, &case)?;
    let json = dir.join("torch.jsonl");
    let mut command = Command::new(&torch.python);
    if world > 1 {
        // One process is the script alone (it applies no FSDP at world 1); more go through
        // torchrun.
        command.args(["-m", "torch.distributed.run", "--nproc-per-node"]);
        command.arg(world.to_string());
        command.args(["--master-addr", "127.0.0.1", "--master-port"]);
        command.arg(free_port()?.to_string());
    }
    command.arg(&torch.script).args([
        "--mesh",
        &world.to_string(),
        "--preset",
        preset,
        "--vocab",
        "50304",
        "--batch-size",
        "1",
        "--steps",
        &STEPS.to_string(),
        "--warmup",
        "0",
        "--meta-init",
        "--json",
    ]);
    command
        .arg(&json)
        .env("GLOO_SOCKET_IFNAME", "lo")
        .env("OMP_NUM_THREADS", "1");
    let finished = run_logged(&mut command, &dir, &case)?;
    let row = if finished.status.success() {
        read_torch_row(&json).map_err(|e| e.to_string())
    } else {
        Err(format!(
            "{}: {}",
            finished.describe(),
            finished.stderr_tail.join(" / ")
        ))
    };
    Ok(match row {
        Ok(row) => MemoryRun::from_torch(&case, finished.wall_s, &row),
        Err(why) => MemoryRun::failed(
            &case,
            Library::TorchFsdp2,
            world,
            Init::Meta,
            false,
            finished.wall_s,
            why,
        ),
    })
}

/// `target/bench/memory.json`.
#[derive(Serialize)]
struct MemoryReport {
    mode: &'static str,
    model: String,
    /// Parameters of the model (computed from its shape), when the shape is known here.
    params: Option<u64>,
    batch_size_per_rank: usize,
    steps: usize,
    measured: &'static str,
    torch_version: Option<String>,
    runs: Vec<MemoryRun>,
    targets: Vec<Target>,
    note: Option<String>,
}

const MEASURED: &str = "resident memory: VmHWM (peak resident set) of each rank process, \
     ru_maxrss for PyTorch; start-up = peak once the model is built and sharded, before step 1; \
     idle = resident set before the model is built; each figure the maximum over the ranks";

fn gpt2() -> GptShape {
    hypershard_benches::train::preset("gpt2").expect("invariant: gpt2 is one of the presets")
}

fn hypershard_binary(args: &Args) -> Result<PathBuf> {
    let binary = match &args.hypershard {
        Some(path) => path.clone(),
        None => {
            let bench = bench_output_dir().map_err(io_error(Path::new("target/bench")))?;
            bench.join("../release/hypershard")
        }
    };
    if !binary.exists() {
        return Err(MemoryBenchError::Usage(format!(
            "no hypershard binary at {} (build it with `cargo build --release -p hypershard`, \
             or pass --hypershard PATH)",
            binary.display()
        )));
    }
    Ok(binary)
}

fn full_or_quick(args: &Args, binary: &Path, root: &Path) -> Result<()> {
    let (preset, worlds, torch) = if args.quick {
        ("small", [1, 2], None)
    } else {
        let torch = if args.torch { find_torch() } else { None };
        if args.torch && torch.is_none() {
            eprintln!("bench-memory: no torch venv or bench_gpt_fsdp2.py; reporting ours only");
        }
        ("gpt2", [1, 4], torch)
    };
    let mut runs = Vec::new();
    for world in worlds {
        let ours = |init, checkpointing| OursSpec {
            world,
            init,
            checkpointing,
        };
        // Ours, PyTorch, ours again: the libraries alternate under the same machine load.
        runs.push(run_ours(
            binary,
            root,
            preset,
            &ours(Init::Deferred, false),
        )?);
        if let Some(torch) = &torch {
            runs.push(run_torch(torch, root, preset, world)?);
        }
        runs.push(run_ours(binary, root, preset, &ours(Init::Deferred, true))?);
        if world > 1 {
            runs.push(run_ours(binary, root, preset, &ours(Init::Eager, false))?);
        }
    }
    let world = worlds[1];
    let targets = targets(&runs, world, !args.quick);
    let torch_version = if torch.is_some() {
        read_torch_version(root, world)
    } else {
        None
    };
    let report = MemoryReport {
        mode: if args.quick { "quick" } else { "full" },
        model: preset.to_string(),
        params: (!args.quick).then(|| gpt2().params()),
        batch_size_per_rank: 1,
        steps: STEPS,
        measured: MEASURED,
        torch_version,
        runs,
        targets,
        note: args.quick.then(|| {
            "quick smoke: the small preset at 1 and 2 ranks; the ratios are not judged (the \
             targets are for gpt2 at 4 ranks)"
                .to_string()
        }),
    };
    for t in &report.targets {
        eprintln!(
            "{}: {} (at most {}) {}",
            t.name,
            t.ratio.map_or("not measured".into(), |r| r.to_string()),
            t.at_most,
            match t.met {
                Some(true) => "met",
                Some(false) => "NOT met",
                None => "",
            }
        );
    }
    let failed: Vec<&str> = report
        .runs
        .iter()
        .filter(|r| r.status != "ok")
        .map(|r| r.case.as_str())
        .collect();
    let path = write_json("memory", &report).map_err(io_error(Path::new("memory.json")))?;
    eprintln!("wrote {}", path.display());
    if failed.is_empty() {
        Ok(())
    } else {
        Err(MemoryBenchError::Usage(format!(
            "runs failed (see their status in {}): {}",
            path.display(),
            failed.join(", ")
        )))
    }
}

fn read_torch_version(root: &Path, world: usize) -> Option<String> {
    let json = root
        .join(format!("torch-fsdp2-meta-w{world}"))
        .join("torch.jsonl");
    read_torch_row(&json).ok().map(|row| row.torch)
}

/// One run of the demonstration.
#[derive(Serialize)]
struct DemoRun {
    case: String,
    model: GptShape,
    params: u64,
    full_training_state_gib: f64,
    full_weights_gib: f64,
    init: Init,
    /// Exit code of `hypershard train` (`None` when a signal ended it).
    exit_code: Option<i32>,
    /// Whether it ran every step and wrote its summary.
    trained: bool,
    steps_run: Option<u64>,
    wall_s: f64,
    /// The rank the launcher's error names.
    failed_rank: Option<usize>,
    /// The last lines `hypershard train` wrote to stderr.
    stderr_tail: Vec<String>,
    max_peak_rss_mib: Option<f64>,
    per_rank_peak_rss_mib: Vec<f64>,
    per_rank_startup_peak_rss_mib: Vec<f64>,
    /// Whether every rank's peak resident set stayed under the limit.
    under_limit: Option<bool>,
    first_loss: Option<f64>,
    last_loss: Option<f64>,
}

/// `target/bench/memory-demo.json`.
#[derive(Serialize)]
struct DemoReport {
    limit: String,
    limit_bytes: u64,
    limit_mechanism: &'static str,
    world: usize,
    batch_size_per_rank: usize,
    steps: usize,
    activation_checkpointing: bool,
    runs: Vec<DemoRun>,
}

const DEMO_WORLD: usize = 8;
const DEMO_STEPS: usize = 2;
const GIB: f64 = 1024.0 * 1024.0 * 1024.0;

fn run_demo_case(
    binary: &Path,
    root: &Path,
    shape: GptShape,
    init: Init,
    limit: &str,
    limit_bytes: u64,
) -> Result<DemoRun> {
    let init_name = if init == Init::Eager {
        "eager"
    } else {
        "deferred"
    };
    let case = format!("demo-v{}-{init_name}-w{DEMO_WORLD}", shape.vocab_size);
    let dir = run_dir(root, &case)?;
    let model_path = dir.join("model.json");
    let text = serde_json::to_string_pretty(&shape).map_err(|e| MemoryBenchError::Io {
        path: model_path.clone(),
        source: std::io::Error::other(e),
    })?;
    std::fs::write(&model_path, text).map_err(io_error(&model_path))?;
    let model = model_path.display().to_string();
    let mut command = train_command(binary, &model, DEMO_WORLD, DEMO_STEPS, init, true, &dir);
    command.args(["--max-rank-memory", limit]);
    if init == Init::Eager {
        // The estimate alone refuses the eager run before it starts; the demonstration is
        // what the kernel does when the whole model is built on every rank anyway.
        command.arg("--no-memory-check");
    }
    let finished = run_logged(&mut command, &dir, &case)?;
    drop_checkpoints(&dir);
    let summary = if finished.status.success() {
        read_summary(&dir.join("run").join("summary.json")).ok()
    } else {
        None
    };
    let params = shape.params();
    let mut ranks: Vec<_> = summary.iter().flat_map(|s| s.memory.iter()).collect();
    ranks.sort_by_key(|m| m.rank);
    let peaks: Vec<f64> = ranks.iter().map(|m| mib(m.peak_rss_bytes)).collect();
    let stderr = finished.stderr_tail.join("\n");
    Ok(DemoRun {
        case,
        model: shape,
        params,
        full_training_state_gib: round2(shape.training_state_bytes() as f64 / GIB),
        full_weights_gib: round2(4.0 * params as f64 / GIB),
        init,
        exit_code: finished.status.code(),
        trained: summary
            .as_ref()
            .is_some_and(|s| s.steps_run == DEMO_STEPS as u64),
        steps_run: summary.as_ref().map(|s| s.steps_run),
        wall_s: finished.wall_s,
        failed_rank: if finished.status.success() {
            None
        } else {
            rank_named_in(&stderr)
        },
        stderr_tail: finished.stderr_tail.clone(),
        max_peak_rss_mib: peaks.iter().copied().reduce(f64::max),
        per_rank_peak_rss_mib: peaks,
        per_rank_startup_peak_rss_mib: ranks
            .iter()
            .map(|m| mib(m.startup_peak_rss_bytes))
            .collect(),
        under_limit: summary
            .as_ref()
            .map(|s| s.memory.iter().all(|m| m.peak_rss_bytes <= limit_bytes)),
        first_loss: summary.as_ref().and_then(|s| s.first_loss),
        last_loss: summary.as_ref().and_then(|s| s.last_loss),
    })
}

fn round2(value: f64) -> f64 {
    (value * 100.0).round() / 100.0
}

fn demo(args: &Args, binary: &Path, root: &Path) -> Result<()> {
    let limit_bytes = parse_size(&args.limit)?;
    let shape = GptShape {
        vocab_size: 50_304,
        block_size: 256,
        n_layer: 24,
        n_head: 16,
        n_embd: 1024,
        bias: true,
        dropout: 0.0,
    };
    let mut report = DemoReport {
        limit: args.limit.clone(),
        limit_bytes,
        limit_mechanism: "hypershard train --max-rank-memory: each rank in its own memory \
             cgroup (v1 memory.limit_in_bytes, v2 memory.max); resident memory and page cache \
             charged to the rank count, a rank over the limit is killed by the kernel",
        world: DEMO_WORLD,
        batch_size_per_rank: 1,
        steps: DEMO_STEPS,
        activation_checkpointing: true,
        runs: Vec::new(),
    };
    let mut shapes = vec![shape];
    let mut i = 0;
    while i < shapes.len() {
        let shape = shapes[i];
        // The eager run first: it is expected to end within seconds. The file is rewritten
        // after every run, so what ran is on disk however long the rest takes.
        for init in [Init::Eager, Init::Deferred] {
            let run = run_demo_case(binary, root, shape, init, &args.limit, limit_bytes)?;
            eprintln!(
                "{}: trained {} ({}), max peak RSS {} MiB, wall {} s",
                run.case,
                run.trained,
                run.exit_code
                    .map_or("signal".into(), |c| format!("exit {c}")),
                run.max_peak_rss_mib.map_or("–".into(), |m| m.to_string()),
                run.wall_s
            );
            let fits = init == Init::Deferred && run.trained;
            report.runs.push(run);
            write_json("memory-demo", &report).map_err(io_error(Path::new("memory-demo.json")))?;
            // Only when the 354 M model does not fit: the same without the large vocabulary.
            if init == Init::Deferred && !fits && shape.vocab_size != 256 {
                shapes.push(GptShape {
                    vocab_size: 256,
                    ..shape
                });
            }
        }
        i += 1;
    }
    eprintln!("wrote target/bench/memory-demo.json");
    Ok(())
}

fn run() -> Result<()> {
    let args = parse_args()?;
    let binary = hypershard_binary(&args)?;
    let root = bench_output_dir()
        .map_err(io_error(Path::new("target/bench")))?
        .join("memory-runs");
    if args.demo {
        demo(&args, &binary, &root)
    } else {
        full_or_quick(&args, &binary, &root)
    }
}

fn main() -> ExitCode {
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("bench-memory: {e}");
            ExitCode::FAILURE
        }
    }
}
