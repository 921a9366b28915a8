//! `cargo xtask bench train`: `hypershard train`'s steady-state tokens/s against PyTorch FSDP2
//! (`bench_gpt_fsdp2.py`) on the same nanoGPT shapes, batch per rank and mesh, interleaved, with
//! peak resident memory per rank and the fraction of the machine's f32 FMA peak each reaches.
//!
//! ```text
//! bench-train [--quick] [--no-torch] [--hypershard PATH] [--presets small,medium,gpt2]
//!             [--meshes 1,2,2x2] [--reps N] [--gpt2-reps N] [--no-history] [--merge]
//! bench-train --profile [--presets medium,gpt2] [--reps N]
//! ```
//!
//! Full run: presets `small` and `medium` (batch 8 per rank) and `gpt2` (batch 1 per rank), each
//! at one process (no FSDP), FSDP over 2 ranks and HSDP 2×2. Each cell runs ours and PyTorch's
//! alternately, `--reps` times (`--gpt2-reps` for gpt2), the order swapped every repetition so
//! both see the same machine load. Fair shares: every rank of either library gets
//! `cores / ranks` kernel threads (ours through `RAYON_NUM_THREADS`, PyTorch through
//! `--threads` and `OMP_NUM_THREADS`). Throughput is the steady state on both sides: the same
//! warm-up steps left out (a fifth of the run, 2 to 5), the tokens of the rest over the summed
//! time of their steps. Before the runs the FMA peak is measured with one thread per core.
//!
//! Output: `target/bench/train.json` (the peak, one row per cell, every run), the markdown
//! table of docs/performance.md in `target/bench/train-table.md`, and the full run appended to
//! the history in `benches/results/train.json`. `--quick` (the CI smoke): `small` for 8 steps at
//! one process and FSDP 2, one repetition, no judgement; PyTorch only if asked for.
//!
//! `--merge`: keep the cells of an earlier `train.json` that this run does not measure (a
//! long sitting split into several invocations); the peak is the best of all of them.
//!
//! `--profile`: where one process's step goes (forward, loss, backward, optimizer; weight
//! GEMMs, attention core, elementwise), in this process on `cores` threads, for each preset
//! (default `medium` at batch 8 and `gpt2` at batch 1); `target/bench/train-profile.json`.

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode, Stdio};
use std::time::Instant;

use hypershard_benches::memory::{
    MemoryBenchError, Result, io_error, read_summary, read_torch_row,
};
use hypershard_benches::train::{
    CellSpec, FmaPeak, RunFigures, TrainCell, markdown_table, measure_fma_peak, mesh_world, preset,
    threads_per_rank, warmup_steps,
};
use hypershard_benches::train_history::append_history;
use hypershard_benches::train_profile::profile;
use hypershard_benches::{bench_output_dir, write_json};
use serde::{Deserialize, Serialize};

#[derive(Debug, Clone)]
struct Args {
    quick: bool,
    torch: bool,
    hypershard: Option<PathBuf>,
    presets: Vec<String>,
    meshes: Vec<String>,
    reps: usize,
    gpt2_reps: usize,
    history: bool,
    profile: bool,
    merge: bool,
}

fn usage(message: String) -> MemoryBenchError {
    MemoryBenchError::Usage(message)
}

fn parse_args() -> Result<Args> {
    let mut args = Args {
        quick: false,
        torch: true,
        hypershard: None,
        presets: ["small", "medium", "gpt2"].map(String::from).to_vec(),
        meshes: ["1", "2", "2x2"].map(String::from).to_vec(),
        reps: 3,
        gpt2_reps: 1,
        history: true,
        profile: false,
        merge: false,
    };
    let mut it = std::env::args().skip(1);
    let list = |text: String| -> Vec<String> {
        text.split(',')
            .filter(|s| !s.is_empty())
            .map(String::from)
            .collect()
    };
    while let Some(flag) = it.next() {
        let mut value = |name: &str| {
            it.next()
                .ok_or_else(|| usage(format!("{name} needs a value")))
        };
        let count = |name: &str, text: String| -> Result<usize> {
            text.parse::<usize>()
                .ok()
                .filter(|&n| n > 0)
                .ok_or_else(|| usage(format!("{name} takes a count of 1 or more, not `{text}`")))
        };
        match flag.as_str() {
            "--quick" => args.quick = true,
            "--no-torch" => args.torch = false,
            "--no-history" => args.history = false,
            "--profile" => args.profile = true,
            "--merge" => args.merge = true,
            "--hypershard" => args.hypershard = Some(PathBuf::from(value("--hypershard")?)),
            "--presets" => args.presets = list(value("--presets")?),
            "--meshes" => args.meshes = list(value("--meshes")?),
            "--reps" => args.reps = count("--reps", value("--reps")?)?,
            "--gpt2-reps" => args.gpt2_reps = count("--gpt2-reps", value("--gpt2-reps")?)?,
            other => {
                return Err(usage(format!(
                    "unknown flag {other}; flags: --quick, --no-torch, --hypershard PATH, \
                     --presets LIST, --meshes LIST, --reps N, --gpt2-reps N, --no-history, \
                     --profile, --merge"
                )));
            }
        }
    }
    if args.quick {
        args.presets = vec!["small".into()];
        args.meshes = vec!["1".into(), "2".into()];
        args.reps = 1;
        args.history = false;
    }
    for p in &args.presets {
        if preset(p).is_none() {
            return Err(usage(format!(
                "unknown preset `{p}`; presets: tiny, small, medium, gpt2"
            )));
        }
    }
    for m in &args.meshes {
        if mesh_world(m).is_none() {
            return Err(usage(format!(
                "bad mesh `{m}`: N (FSDP over N ranks, 1 = one process) or RxS (HSDP)"
            )));
        }
    }
    Ok(args)
}

/// Runs `command` with its output in `dir/stdout.log` and `dir/stderr.log`; `Err` with the
/// end of stderr when it fails.
fn run_logged(
    command: &mut Command,
    dir: &Path,
    what: &str,
) -> Result<std::result::Result<f64, String>> {
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
    if status.success() {
        return Ok(Ok(wall_s));
    }
    let text = std::fs::read_to_string(&stderr_path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().filter(|l| !l.trim().is_empty()).collect();
    let tail = lines[lines.len().saturating_sub(4)..].join(" / ");
    eprintln!("    failed ({status}) after {wall_s} s: {tail}");
    Ok(Err(format!("{status}: {tail}")))
}

fn fresh_dir(root: &Path, case: &str) -> Result<PathBuf> {
    let dir = root.join(case);
    if dir.exists() {
        std::fs::remove_dir_all(&dir).map_err(io_error(&dir))?;
    }
    std::fs::create_dir_all(&dir).map_err(io_error(&dir))?;
    Ok(dir)
}

/// One cell's settings.
#[derive(Clone, Debug)]
struct Cell {
    spec: CellSpec,
}

impl Cell {
    fn case(&self, library: &str, rep: usize) -> String {
        format!(
            "{}-{}-m{}-r{rep}",
            library, self.spec.preset, self.spec.mesh
        )
    }
}

/// One run as `train.json` lists it.
#[derive(Clone, Debug, Serialize, Deserialize)]
struct RunRecord {
    library: String,
    preset: String,
    mesh: String,
    rep: usize,
    /// Position in the sitting (runs alternate between the libraries).
    order: usize,
    status: String,
    wall_s: Option<f64>,
    tokens_per_s: Option<f64>,
    /// Whole-run average (ours only; PyTorch reports the steady state only).
    whole_run_tokens_per_s: Option<f64>,
    peak_rss_mib: Option<f64>,
    per_rank_peak_rss_mib: Vec<f64>,
    /// The 1-minute load average as the run started: on shared cores it tells a contended run
    /// (whose tokens/s can be several times lower on either side) from a quiet one.
    #[serde(default)]
    load_avg_1m: Option<f64>,
}

impl RunRecord {
    fn figures(&self) -> RunFigures {
        RunFigures {
            tokens_per_s: self.tokens_per_s,
            peak_rss_mib: self.peak_rss_mib,
        }
    }
}

/// The first field of `/proc/loadavg` (`None` where it cannot be read, as off Linux).
fn load_average() -> Option<f64> {
    let text = std::fs::read_to_string("/proc/loadavg").ok()?;
    text.split_whitespace().next()?.parse().ok()
}

fn run_ours(
    binary: &Path,
    root: &Path,
    cell: &Cell,
    rep: usize,
    order: usize,
) -> Result<RunRecord> {
    let spec = &cell.spec;
    let case = cell.case("hypershard", rep);
    let dir = fresh_dir(root, &case)?;
    let mut command = Command::new(binary);
    command.arg("train").args([
        "--nproc",
        &spec.world.to_string(),
        "--mesh",
        &spec.mesh,
        "--model",
        &spec.preset,
        "--batch-size",
        &spec.batch_per_rank.to_string(),
        "--steps",
        &spec.steps.to_string(),
        "--eval-every",
        "0",
    ]);
    command
        .arg("--out")
        .arg(dir.join("run"))
        .env("RAYON_NUM_THREADS", spec.threads_per_rank.to_string());
    let mut record = RunRecord {
        library: "hypershard".into(),
        preset: spec.preset.clone(),
        mesh: spec.mesh.clone(),
        rep,
        order,
        status: "ok".into(),
        wall_s: None,
        tokens_per_s: None,
        whole_run_tokens_per_s: None,
        peak_rss_mib: None,
        per_rank_peak_rss_mib: Vec::new(),
        load_avg_1m: load_average(),
    };
    let finished = run_logged(&mut command, &dir, &case)?;
    // The checkpoint written at the end is not measured (gigabytes for gpt2).
    let _ = std::fs::remove_dir_all(dir.join("run").join("checkpoints"));
    match finished {
        Err(why) => record.status = why,
        Ok(wall) => {
            record.wall_s = Some(wall);
            let summary = read_summary(&dir.join("run").join("summary.json"))?;
            if summary.warmup_steps != Some(warmup_steps(spec.steps)) {
                record.status = format!(
                    "the summary left out {:?} warm-up steps, the suite expected {}",
                    summary.warmup_steps,
                    warmup_steps(spec.steps)
                );
            }
            record.tokens_per_s = summary.steady_tokens_per_second;
            record.whole_run_tokens_per_s = Some(summary.tokens_per_second);
            record.per_rank_peak_rss_mib = summary
                .memory
                .iter()
                .map(|m| m.peak_rss_bytes as f64 / (1024.0 * 1024.0))
                .collect();
            record.peak_rss_mib = record
                .per_rank_peak_rss_mib
                .iter()
                .copied()
                .reduce(f64::max);
            eprintln!(
                "    {:.1} tokens/s steady state",
                record.tokens_per_s.unwrap_or(f64::NAN)
            );
        }
    }
    Ok(record)
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

fn free_port() -> Result<u16> {
    let listener = TcpListener::bind("127.0.0.1:0").map_err(io_error(Path::new("127.0.0.1:0")))?;
    listener
        .local_addr()
        .map(|a| a.port())
        .map_err(io_error(Path::new("127.0.0.1:0")))
}

fn run_torch(
    torch: &Torch,
    root: &Path,
    cell: &Cell,
    rep: usize,
    order: usize,
) -> Result<RunRecord> {
    let spec = &cell.spec;
    let case = cell.case("torch", rep);
    let dir = fresh_dir(root, &case)?;
    let json = dir.join("torch.jsonl");
    let warmup = warmup_steps(spec.steps);
    let mut command = Command::new(&torch.python);
    if spec.world > 1 {
        command.args(["-m", "torch.distributed.run", "--nproc-per-node"]);
        command.arg(spec.world.to_string());
        command.args(["--master-addr", "127.0.0.1", "--master-port"]);
        command.arg(free_port()?.to_string());
    }
    let threads = spec.threads_per_rank.to_string();
    command.arg(&torch.script).args([
        "--mesh",
        &spec.mesh,
        "--preset",
        &spec.preset,
        "--vocab",
        &spec.shape.vocab_size.to_string(),
        "--batch-size",
        &spec.batch_per_rank.to_string(),
        // The script's --steps are the timed ones, after its --warmup.
        "--steps",
        &(spec.steps - warmup).to_string(),
        "--warmup",
        &warmup.to_string(),
        "--threads",
        &threads,
        "--json",
    ]);
    command
        .arg(&json)
        .env("GLOO_SOCKET_IFNAME", "lo")
        .env("OMP_NUM_THREADS", &threads);
    let mut record = RunRecord {
        library: "torch-fsdp2".into(),
        preset: spec.preset.clone(),
        mesh: spec.mesh.clone(),
        rep,
        order,
        status: "ok".into(),
        wall_s: None,
        tokens_per_s: None,
        whole_run_tokens_per_s: None,
        peak_rss_mib: None,
        per_rank_peak_rss_mib: Vec::new(),
        load_avg_1m: load_average(),
    };
    match run_logged(&mut command, &dir, &case)? {
        Err(why) => record.status = why,
        Ok(wall) => {
            let row = read_torch_row(&json)?;
            record.wall_s = Some(wall);
            record.tokens_per_s = Some(row.tokens_per_s);
            record.peak_rss_mib = Some(row.peak_rss_mib);
            eprintln!("    {:.1} tokens/s steady state", row.tokens_per_s);
        }
    }
    Ok(record)
}

/// What `--merge` reads back from an earlier `train.json`.
#[derive(Deserialize)]
struct PriorReport {
    fma_peak: Option<FmaPeak>,
    torch_version: Option<String>,
    cells: Vec<TrainCell>,
    runs: Vec<RunRecord>,
}

/// Folds an earlier `train.json` into this run's figures: this run's cells, and its runs,
/// replace the earlier ones of the same preset and mesh.
fn merge_prior(
    fma_peak: &mut Option<FmaPeak>,
    torch_version: &mut Option<String>,
    cells: &mut Vec<TrainCell>,
    runs: &mut Vec<RunRecord>,
) -> Result<()> {
    let path = bench_output_dir()
        .map_err(io_error(Path::new("target/bench")))?
        .join("train.json");
    let text = match std::fs::read_to_string(&path) {
        Ok(text) => text,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(io_error(&path)(e)),
    };
    let prior: PriorReport = serde_json::from_str(&text).map_err(|e| MemoryBenchError::Io {
        path: path.clone(),
        source: std::io::Error::other(format!("not a train report: {e}")),
    })?;
    let measured_now =
        |preset: &str, mesh: &str| cells.iter().any(|c| c.preset == preset && c.mesh == mesh);
    let mut all_runs: Vec<RunRecord> = prior
        .runs
        .into_iter()
        .filter(|old| !measured_now(&old.preset, &old.mesh))
        .collect();
    let mut merged: Vec<TrainCell> = prior
        .cells
        .into_iter()
        .filter(|old| !measured_now(&old.preset, &old.mesh))
        .collect();
    merged.append(cells);
    *cells = merged;
    all_runs.append(runs);
    *runs = all_runs;
    if let Some(old) = prior.fma_peak
        && fma_peak.is_none_or(|p| p.per_thread_gflops < old.per_thread_gflops)
    {
        *fma_peak = Some(old);
    }
    if torch_version.is_none() {
        *torch_version = prior.torch_version;
    }
    Ok(())
}

/// `target/bench/train.json`.
#[derive(Serialize)]
struct TrainReport {
    mode: &'static str,
    cores: usize,
    definition: &'static str,
    flops: &'static str,
    fma_peak_method: &'static str,
    fma_peak: Option<FmaPeak>,
    torch_version: Option<String>,
    cells: Vec<TrainCell>,
    runs: Vec<RunRecord>,
}

const DEFINITION: &str = "steady-state tokens/s, both libraries alike: the first \
     max(1, min(steps - 1, max(2, min(5, steps/5)))) steps are warm-up and left out; the \
     tokens of the remaining steps \
     (all ranks) over the summed time of those steps (forward to optimizer step; data generation \
     excluded). PyTorch times every rank and takes the slowest; hypershard times rank 0, kept \
     in step with the others by each step's collectives. Every rank of either library gets \
     cores/ranks kernel threads. Peak RSS: the largest rank's peak resident set (VmHWM; \
     ru_maxrss for PyTorch), the largest over the repetitions.";

const FLOPS: &str = "model FLOPs per step: 6·(12·L·C² + V·C)·tokens + 12·L·T·C·tokens (weight \
     matrices forward and backward, the head tied to the embedding counted once; attention \
     QKᵀ and A·V over the full T×T square); peak fraction = median tokens/s × FLOPs per token \
     / (FMA peak per core × min(threads per rank × ranks, cores))";

const FMA_METHOD: &str = "one thread per core, all at once, each running 12 independent FMA \
     chains of the widest vectors the CPU has (AVX-512: 16 f32 lanes, else AVX2: 8; an FMA \
     counted as 2 FLOPs; 12 chains hide the FMA latency on two ports) in repetitions of 10^6 \
     rounds, before the runs and after them; peak = the best repetition of any thread times \
     the threads (other work can only slow a repetition down)";

fn hypershard_binary(args: &Args) -> Result<PathBuf> {
    let binary = match &args.hypershard {
        Some(path) => path.clone(),
        None => bench_output_dir()
            .map_err(io_error(Path::new("target/bench")))?
            .join("../release/hypershard"),
    };
    if !binary.exists() {
        return Err(usage(format!(
            "no hypershard binary at {} (build it with `cargo build --release -p hypershard`, \
             or pass --hypershard PATH)",
            binary.display()
        )));
    }
    Ok(binary)
}

/// Steps per run: long enough for a steady state of several steps, short enough for gpt2
/// (whose two warm-up steps leave two timed ones).
fn steps_for(preset: &str, quick: bool) -> u64 {
    match (preset, quick) {
        (_, true) => 8,
        ("gpt2", false) => 4,
        ("medium", false) => 20,
        _ => 30,
    }
}

fn run(args: &Args) -> Result<()> {
    let binary = hypershard_binary(args)?;
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let (iterations, reps) = if args.quick {
        (2_000_000, 2)
    } else {
        (50_000_000, 5)
    };
    let fma_peak = measure_fma_peak(cores, iterations, reps);
    match &fma_peak {
        Some(p) => eprintln!(
            "f32 FMA peak: {:.1} GFLOP/s per core, {:.1} over {} cores",
            p.per_thread_gflops, p.total_gflops, p.threads
        ),
        None => eprintln!("bench-train: no AVX2/FMA; no peak fractions"),
    }
    let torch = if args.torch { find_torch() } else { None };
    if args.torch && torch.is_none() {
        eprintln!("bench-train: no torch venv or bench_gpt_fsdp2.py; ours only");
    }
    let root = bench_output_dir()
        .map_err(io_error(Path::new("target/bench")))?
        .join("train-runs");
    let mut cells = Vec::new();
    let mut runs: Vec<RunRecord> = Vec::new();
    let mut torch_version = None;
    for name in &args.presets {
        let shape = preset(name).ok_or_else(|| usage(format!("unknown preset `{name}`")))?;
        for mesh in &args.meshes {
            let world = mesh_world(mesh).ok_or_else(|| usage(format!("bad mesh `{mesh}`")))?;
            let cell = Cell {
                spec: CellSpec {
                    preset: name.clone(),
                    shape,
                    mesh: mesh.clone(),
                    world,
                    threads_per_rank: threads_per_rank(cores, world),
                    cores,
                    batch_per_rank: if name == "gpt2" { 1 } else { 8 },
                    steps: steps_for(name, args.quick),
                },
            };
            let reps = if name == "gpt2" {
                args.gpt2_reps
            } else {
                args.reps
            };
            let mut pairs = Vec::new();
            for rep in 0..reps {
                // Swap who goes first every repetition.
                let ours_first = rep % 2 == 0;
                let mut ours = None;
                let mut theirs = None;
                for turn in 0..2 {
                    let order = runs.len();
                    if (turn == 0) == ours_first {
                        let r = run_ours(&binary, &root, &cell, rep, order)?;
                        ours = Some(r.clone());
                        runs.push(r);
                    } else if let Some(torch) = &torch {
                        let r = run_torch(torch, &root, &cell, rep, order)?;
                        if torch_version.is_none() && r.status == "ok" {
                            torch_version = read_torch_row(
                                &root.join(cell.case("torch", rep)).join("torch.jsonl"),
                            )
                            .ok()
                            .map(|row| row.torch);
                        }
                        theirs = Some(r.clone());
                        runs.push(r);
                    }
                }
                if let Some(ours) = ours {
                    pairs.push((ours.figures(), theirs.map(|t| t.figures())));
                }
            }
            let reduced = TrainCell::reduce(
                &cell.spec,
                &pairs,
                fma_peak.map(|p| p.total_gflops / p.threads as f64),
            );
            eprintln!(
                "{name} mesh {mesh}: ours {:?} tok/s, torch {:?}, ratio {:?}",
                reduced.ours_tokens_per_s, reduced.torch_tokens_per_s, reduced.ratio
            );
            cells.push(reduced);
        }
    }
    // The peak again after the runs (the machine's load changes; a peak takes the best).
    let fma_peak = match (fma_peak, measure_fma_peak(cores, iterations, reps)) {
        (Some(a), Some(b)) => Some(if b.per_thread_gflops > a.per_thread_gflops {
            b
        } else {
            a
        }),
        (a, b) => a.or(b),
    };
    let mut fma_peak = fma_peak;
    // This sitting's failures only: runs kept from an earlier report by --merge were
    // reported when they ran.
    let failed: Vec<String> = runs
        .iter()
        .filter(|r| r.status != "ok")
        .map(|r| {
            format!(
                "{} {} mesh {} rep {}: {}",
                r.library, r.preset, r.mesh, r.rep, r.status
            )
        })
        .collect();
    if args.merge {
        merge_prior(&mut fma_peak, &mut torch_version, &mut cells, &mut runs)?;
    }
    if let Some(p) = &fma_peak {
        eprintln!(
            "f32 FMA peak (best before and after): {:.1} GFLOP/s per core",
            p.per_thread_gflops
        );
        for cell in &mut cells {
            cell.set_peak(p.per_thread_gflops, cores);
        }
    }
    let report = TrainReport {
        mode: if args.quick { "quick" } else { "full" },
        cores,
        definition: DEFINITION,
        flops: FLOPS,
        fma_peak_method: FMA_METHOD,
        fma_peak,
        torch_version,
        cells,
        runs,
    };
    let path = write_json("train", &report).map_err(io_error(Path::new("train.json")))?;
    eprintln!("wrote {}", path.display());
    let table = markdown_table(&report.cells);
    let table_path = path.with_file_name("train-table.md");
    std::fs::write(&table_path, &table).map_err(io_error(&table_path))?;
    print!("{table}");
    if args.history {
        let passed: Vec<String> = std::env::args()
            .skip(1)
            .filter(|a| a != "--no-torch")
            .collect();
        let compare = if args.torch { " --compare-pytorch" } else { "" };
        let command = format!("cargo xtask bench train{compare} {}", passed.join(" "));
        let history = append_history(report.fma_peak.as_ref(), &report.cells, command.trim_end())?;
        eprintln!("appended to {}", history.display());
    }
    if failed.is_empty() {
        Ok(())
    } else {
        Err(usage(format!("runs failed: {}", failed.join("; "))))
    }
}

fn run_profile(args: &Args, explicit_presets: bool) -> Result<()> {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let presets: Vec<String> = if explicit_presets {
        args.presets.clone()
    } else {
        vec!["medium".into(), "gpt2".into()]
    };
    let mut rows = Vec::new();
    for name in &presets {
        let shape = preset(name).ok_or_else(|| usage(format!("unknown preset `{name}`")))?;
        let batch = if name == "gpt2" { 1 } else { 8 };
        let reps = if name == "gpt2" {
            args.gpt2_reps
        } else {
            args.reps
        };
        eprintln!("==> profile {name} batch {batch}, {cores} threads, {reps} reps");
        let p = profile(name, &shape, batch, cores, reps).map_err(usage)?;
        let pct = |ms: f64| 100.0 * ms / p.step_ms;
        println!(
            "{name} (batch {batch}, {cores} threads), CPU time: step {:.1} ms = forward {:.1} + loss {:.1} \
             + backward {:.1} + optimizer {:.1}\n  GEMM {:.1} ms ({:.0} %, {:.1} GFLOP per CPU-s), \
             attention core {:.1} ms ({:.0} %), elementwise and the rest {:.1} ms ({:.0} %), \
             optimizer {:.0} %",
            p.step_ms,
            p.forward_ms,
            p.loss_ms,
            p.backward_ms,
            p.optimizer_ms,
            p.gemm_forward_ms + p.gemm_backward_ms,
            pct(p.gemm_forward_ms + p.gemm_backward_ms),
            p.gemm_gflops,
            p.attention_ms,
            pct(p.attention_ms),
            p.elementwise_ms,
            pct(p.elementwise_ms),
            pct(p.optimizer_ms),
        );
        rows.push(p);
    }
    let path =
        write_json("train-profile", &rows).map_err(io_error(Path::new("train-profile.json")))?;
    eprintln!("wrote {}", path.display());
    Ok(())
}

fn main() -> ExitCode {
    let explicit_presets = std::env::args().any(|a| a == "--presets");
    let outcome = parse_args().and_then(|args| {
        if args.profile {
            run_profile(&args, explicit_presets)
        } else {
            run(&args)
        }
    });
    match outcome {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("bench-train: {e}");
            ExitCode::FAILURE
        }
    }
}
