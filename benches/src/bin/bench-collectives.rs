//! `cargo xtask bench collectives`: times all-reduce, all-gather, reduce-scatter and broadcast
//! on the `tcp` backend (one real process per rank, like gloo) or the `local` backend (one
//! thread per rank), with the NCCL-tests conventions of `bench_gloo.py`, the PyTorch peer.
//!
//! ```text
//! bench-collectives [--backend tcp|local|mpi] [--world 2,4] [--sizes 4K,64K,1M,16M,64M]
//!                   [--ops all_reduce,all_gather,reduce_scatter,broadcast] [--json [PATH]]
//!                   [--target-s 2.0] [--warmup 5] [--min-iters 7] [--max-iters 200]
//!                   [--segment-bytes N] [--all-reduce auto|ring|doubling|halving-doubling]
//!                   [--small-all-reduce-bytes N] [--broadcast auto|chain|tree]
//!                   [--gloo gloo.csv] [--quick]
//!                   [--transport tcp|auto|shm] [--shm-ring-bytes N]
//! ```
//!
//! `--transport shm` (or `auto`) moves the data of co-located ranks through the shared-memory
//! transport (docs/shm.md); its rows say backend `tcp+shm`.
//!
//! `--quick` is the CI smoke: world 2, 4 KiB and 64 KiB, one warm-up and at most two timed
//! iterations per cell (a few seconds; flags after it override its choices).
//!
//! Conventions (the same as `bench_gloo.py`): `bytes` is the tensor size of all-reduce and
//! broadcast, the OUTPUT size of all-gather (each rank contributes `bytes / n`) and the INPUT
//! size of reduce-scatter (each rank receives `bytes / n`); elements are f32, the reduction is
//! a sum. Each timed iteration is `barrier; t0; op; t1`, and its time is the maximum over the
//! ranks (an all-reduce with `Max` after the loop); the median and minimum over iterations are
//! reported. The iteration count is chosen from one timed probe so a cell takes about
//! `--target-s` seconds (between `--min-iters` and `--max-iters`), after `--warmup` untimed
//! iterations. algbw = bytes / median (GB/s, 10^9); busbw = algbw × 2(n-1)/n for all-reduce,
//! × (n-1)/n for all-gather and reduce-scatter, × 1 for broadcast.
//!
//! With `--backend tcp` the binary re-executes itself once per rank with the torchrun
//! variables (`RANK`, `WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT`) plus `HYPERSHARD_BENCH_RANK`
//! set; rank 0 hosts the store and prints its rows to stdout, which the parent collects.
//! With `--backend mpi` (a build with the `mpi` feature of hypershard-benches, which needs Open
//! MPI) the parent runs `mpirun -np N` on itself instead, and each rank joins
//! `MPI_COMM_WORLD` through the MPI backend (docs/clusters.md); rank 0 prints the rows the same
//! way. `mpirun` comes from `$HYPERSHARD_MPIRUN` or the `PATH`.
//! `--gloo` reads a CSV written by `bench_gloo.py --csv` and prints the ratios of this run to it.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::{Command, ExitCode, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use hypershard_benches::world::run_rank_processes;
use hypershard_benches::{TimingStats, bench_output_dir};
use hypershard_collectives::shm::TransportPolicy;
use hypershard_collectives::tcp::{
    AllReduceAlgorithm, BroadcastAlgorithm, TcpConfig, init_from_env,
};
use hypershard_collectives::{Buffer, Communicator, DType, ReduceOp, local};

/// Set in the environment of the rank processes the parent spawns.
const RANK_VAR: &str = "HYPERSHARD_BENCH_RANK";
/// The prefix of the lines by which rank 0 hands its rows to the parent.
const ROW_PREFIX: &str = "BENCH-ROW ";

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Op {
    AllReduce,
    AllGather,
    ReduceScatter,
    Broadcast,
}

impl Op {
    const ALL: [Op; 4] = [
        Op::AllReduce,
        Op::AllGather,
        Op::ReduceScatter,
        Op::Broadcast,
    ];

    fn name(self) -> &'static str {
        match self {
            Op::AllReduce => "all_reduce",
            Op::AllGather => "all_gather",
            Op::ReduceScatter => "reduce_scatter",
            Op::Broadcast => "broadcast",
        }
    }

    fn parse(name: &str) -> Result<Op, String> {
        Op::ALL
            .into_iter()
            .find(|op| op.name() == name)
            .ok_or_else(|| {
                format!("unknown op `{name}` (all_reduce, all_gather, reduce_scatter, broadcast)")
            })
    }

    /// The NCCL-tests factor from algbw to busbw.
    fn busbw_factor(self, world: usize) -> f64 {
        let n = world as f64;
        match self {
            Op::AllReduce => 2.0 * (n - 1.0) / n,
            Op::AllGather | Op::ReduceScatter => (n - 1.0) / n,
            Op::Broadcast => 1.0,
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Backend {
    Tcp,
    Local,
    Mpi,
}

impl Backend {
    fn name(self) -> &'static str {
        match self {
            Backend::Tcp => "tcp",
            Backend::Local => "local",
            Backend::Mpi => "mpi",
        }
    }
}

/// Everything the command line says; rank processes parse the same arguments.
#[derive(Clone, Debug)]
struct Options {
    backend: Backend,
    worlds: Vec<usize>,
    sizes: Vec<usize>,
    ops: Vec<Op>,
    json: Option<PathBuf>,
    target_s: f64,
    warmup: usize,
    min_iters: usize,
    max_iters: usize,
    tcp: TcpConfig,
    gloo_csv: Option<PathBuf>,
    /// The arguments as given, passed on to the rank processes.
    raw: Vec<String>,
}

fn parse_size(text: &str) -> Result<usize, String> {
    let upper = text.trim().to_ascii_uppercase();
    let upper = upper.strip_suffix("IB").unwrap_or(&upper);
    let upper = upper.strip_suffix('B').unwrap_or(upper);
    let (digits, unit) = match upper.chars().last() {
        Some('K') => (&upper[..upper.len() - 1], 1usize << 10),
        Some('M') => (&upper[..upper.len() - 1], 1 << 20),
        Some('G') => (&upper[..upper.len() - 1], 1 << 30),
        _ => (upper, 1),
    };
    let value: f64 = digits
        .parse()
        .map_err(|_| format!("cannot read size `{text}` (e.g. 4K, 64KiB, 16M)"))?;
    Ok((value * unit as f64) as usize)
}

fn human(bytes: usize) -> String {
    for (unit, factor) in [("GiB", 1usize << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)] {
        if bytes >= factor {
            return format!("{} {unit}", bytes as f64 / factor as f64);
        }
    }
    format!("{bytes} B")
}

fn list<T>(text: &str, item: impl Fn(&str) -> Result<T, String>) -> Result<Vec<T>, String> {
    text.split(',')
        .filter(|s| !s.is_empty())
        .map(item)
        .collect()
}

fn parse_args(raw: Vec<String>) -> Result<Options, String> {
    let mut options = Options {
        backend: Backend::Tcp,
        worlds: vec![2, 4],
        sizes: list("4K,64K,1M,16M,64M", parse_size)?,
        ops: Op::ALL.to_vec(),
        json: None,
        target_s: 2.0,
        warmup: 5,
        min_iters: 7,
        max_iters: 200,
        tcp: TcpConfig::default().with_rendezvous_timeout(Duration::from_secs(60)),
        gloo_csv: None,
        raw: raw.clone(),
    };
    let mut args = raw.into_iter().peekable();
    while let Some(flag) = args.next() {
        let mut value = || args.next().ok_or_else(|| format!("{flag} needs a value"));
        match flag.as_str() {
            "--backend" => {
                options.backend = match value()?.as_str() {
                    "tcp" => Backend::Tcp,
                    "local" => Backend::Local,
                    "mpi" if cfg!(feature = "mpi") => Backend::Mpi,
                    "mpi" => {
                        return Err("`--backend mpi` needs a build with the `mpi` feature \
                                    (cargo xtask bench collectives builds without it; run \
                                    cargo run --release -p hypershard-benches --features mpi \
                                    --bin bench-collectives -- --backend mpi ...)"
                            .to_string());
                    }
                    other => return Err(format!("unknown backend `{other}` (tcp, local, mpi)")),
                }
            }
            "--world" => {
                options.worlds = list(&value()?, |s| {
                    s.parse::<usize>()
                        .ok()
                        .filter(|&n| n >= 1)
                        .ok_or_else(|| format!("bad world size `{s}`"))
                })?
            }
            "--sizes" => options.sizes = list(&value()?, parse_size)?,
            "--ops" => options.ops = list(&value()?, Op::parse)?,
            "--json" => {
                // The path is optional: a bare `--json` keeps the default location.
                options.json = match args.next_if(|next| !next.starts_with("--")) {
                    Some(path) => Some(PathBuf::from(path)),
                    None => options.json.take(),
                }
            }
            "--target-s" => {
                options.target_s = value()?
                    .parse()
                    .map_err(|_| "--target-s needs seconds".to_string())?
            }
            "--warmup" => options.warmup = number(&value()?)?,
            "--min-iters" => options.min_iters = number(&value()?)?.max(1),
            "--max-iters" => options.max_iters = number(&value()?)?.max(1),
            "--segment-bytes" => {
                options.tcp = options.tcp.with_segment_bytes(parse_size(&value()?)?)
            }
            "--small-all-reduce-bytes" => {
                options.tcp.small_all_reduce_bytes = parse_size(&value()?)?
            }
            "--all-reduce" => {
                let algorithm = match value()?.as_str() {
                    "auto" => AllReduceAlgorithm::Auto,
                    "ring" => AllReduceAlgorithm::Ring,
                    "doubling" => AllReduceAlgorithm::RecursiveDoubling,
                    "halving-doubling" => AllReduceAlgorithm::HalvingDoubling,
                    other => return Err(format!("unknown all-reduce algorithm `{other}`")),
                };
                options.tcp = options.tcp.with_all_reduce(algorithm);
            }
            "--broadcast" => {
                let algorithm = match value()?.as_str() {
                    "auto" => BroadcastAlgorithm::Auto,
                    "chain" => BroadcastAlgorithm::Chain,
                    "tree" => BroadcastAlgorithm::Tree,
                    other => return Err(format!("unknown broadcast algorithm `{other}`")),
                };
                options.tcp = options.tcp.with_broadcast(algorithm);
            }
            "--gloo" => options.gloo_csv = Some(PathBuf::from(value()?)),
            // The CI smoke (`cargo xtask bench --quick`): world 2, two tiny sizes, one warm-up
            // and at most two timed iterations per cell, a few seconds in all; the numbers
            // mean nothing, the run checks that every op still works. Later flags override.
            "--quick" => {
                options.worlds = vec![2];
                options.sizes = vec![4 << 10, 64 << 10];
                options.warmup = 1;
                options.min_iters = 1;
                options.max_iters = 2;
                options.target_s = 0.001;
            }
            // The shared-memory transport for co-located ranks (docs/shm.md); rank processes
            // re-parse these flags, and HYPERSHARD_TRANSPORT still overrides them.
            "--transport" => {
                let text = value()?;
                let policy = TransportPolicy::parse(&text)
                    .ok_or_else(|| format!("unknown transport `{text}` (tcp, auto, shm)"))?;
                options.tcp = options.tcp.with_transport(policy);
            }
            "--shm-ring-bytes" => {
                options.tcp = options.tcp.with_shm_ring_bytes(parse_size(&value()?)?)
            }
            other => return Err(format!("unknown argument `{other}`")),
        }
    }
    Ok(options)
}

fn number(text: &str) -> Result<usize, String> {
    text.parse()
        .map_err(|_| format!("`{text}` is not a whole number"))
}

/// One measured cell, in the JSON layout of issue 3.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
struct Row {
    op: String,
    backend: String,
    /// `processes` (tcp) or `threads` (local).
    ranks_as: String,
    world: usize,
    bytes: usize,
    iters: usize,
    median_us: f64,
    min_us: f64,
    algbw_gbps: f64,
    busbw_gbps: f64,
}

/// The buffers one op runs on, handed back by every call.
enum Buffers {
    InPlace(Buffer),
    Pair { input: Buffer, output: Buffer },
}

fn buffers(op: Op, bytes: usize, world: usize) -> Buffers {
    let elements = bytes / 4;
    let per_rank = elements / world;
    match op {
        Op::AllReduce | Op::Broadcast => Buffers::InPlace(Buffer::zeros(DType::F32, elements)),
        Op::AllGather => Buffers::Pair {
            input: Buffer::zeros(DType::F32, per_rank),
            output: Buffer::zeros(DType::F32, per_rank * world),
        },
        Op::ReduceScatter => Buffers::Pair {
            input: Buffer::zeros(DType::F32, per_rank * world),
            output: Buffer::zeros(DType::F32, per_rank),
        },
    }
}

type BenchResult<T> = Result<T, String>;

fn run_op(comm: &dyn Communicator, op: Op, buffers: Buffers) -> BenchResult<Buffers> {
    let fail = |e: hypershard_collectives::Error| format!("{}: {e}", op.name());
    Ok(match (op, buffers) {
        (Op::AllReduce, Buffers::InPlace(buffer)) => {
            Buffers::InPlace(comm.all_reduce(buffer, ReduceOp::Sum).map_err(fail)?)
        }
        (Op::Broadcast, Buffers::InPlace(buffer)) => {
            Buffers::InPlace(comm.broadcast(buffer, 0).map_err(fail)?)
        }
        (Op::AllGather, Buffers::Pair { input, output }) => {
            let pair = comm.all_gather(input, output).map_err(fail)?;
            Buffers::Pair {
                input: pair.input,
                output: pair.output,
            }
        }
        (Op::ReduceScatter, Buffers::Pair { input, output }) => {
            let pair = comm
                .reduce_scatter(input, output, ReduceOp::Sum)
                .map_err(fail)?;
            Buffers::Pair {
                input: pair.input,
                output: pair.output,
            }
        }
        _ => return Err(format!("{}: buffers of the wrong shape", op.name())),
    })
}

/// Checks each op once on closed-form data (rank `r` contributes `r + i`), so a fast but wrong
/// build cannot produce a table.
fn check_results(comm: &dyn Communicator) -> BenchResult<()> {
    let (n, r) = (comm.size(), comm.rank());
    let len = 1000;
    let fail = |e: hypershard_collectives::Error| format!("correctness check: {e}");
    let mine: Vec<f32> = (0..len).map(|i| (r + i) as f32).collect();
    let sum = comm
        .all_reduce(Buffer::from_vec(mine.clone()), ReduceOp::Sum)
        .and_then(|b| b.into_vec::<f32>())
        .map_err(fail)?;
    let ranks_sum = (n * (n - 1) / 2) as f32;
    if (0..len).any(|i| sum[i] != ranks_sum + (n * i) as f32) {
        return Err("correctness check: all_reduce is wrong".into());
    }
    let gathered = comm
        .all_gather(
            Buffer::from_vec(mine.clone()),
            Buffer::zeros(DType::F32, n * len),
        )
        .and_then(|pair| pair.output.into_vec::<f32>())
        .map_err(fail)?;
    if (0..n * len).any(|j| gathered[j] != (j / len + j % len) as f32) {
        return Err("correctness check: all_gather is wrong".into());
    }
    let input: Vec<f32> = (0..n * len).map(|j| (r + j) as f32).collect();
    let scattered = comm
        .reduce_scatter(
            Buffer::from_vec(input),
            Buffer::zeros(DType::F32, len),
            ReduceOp::Sum,
        )
        .and_then(|pair| pair.output.into_vec::<f32>())
        .map_err(fail)?;
    if (0..len).any(|i| scattered[i] != ranks_sum + (n * (r * len + i)) as f32) {
        return Err("correctness check: reduce_scatter is wrong".into());
    }
    let root_data: Vec<f32> = (0..len).map(|i| (i * (r + 1)) as f32).collect();
    let broadcast = comm
        .broadcast(Buffer::from_vec(root_data), 0)
        .and_then(|b| b.into_vec::<f32>())
        .map_err(fail)?;
    if (0..len).any(|i| broadcast[i] != i as f32) {
        return Err("correctness check: broadcast is wrong".into());
    }
    Ok(())
}

/// The body every rank runs: all cells, in order. Rank 0 returns the rows.
fn run_rank(comm: &dyn Communicator, options: &Options) -> BenchResult<Vec<Row>> {
    let world = comm.size();
    check_results(comm)?;
    let fail = |e: hypershard_collectives::Error| e.to_string();
    let mut rows = Vec::new();
    for &op in &options.ops {
        for &bytes in &options.sizes {
            let mut current = buffers(op, bytes, world);
            for _ in 0..options.warmup {
                current = run_op(comm, op, current)?;
            }
            // One timed probe picks the iteration count; rank 0's choice is broadcast so every
            // rank runs the same number of collectives.
            comm.barrier().map_err(fail)?;
            let started = Instant::now();
            current = run_op(comm, op, current)?;
            let probe = started.elapsed().as_secs_f64();
            let probe = comm
                .broadcast(Buffer::from_vec(vec![probe]), 0)
                .and_then(|b| b.into_vec::<f64>())
                .map_err(fail)?[0];
            let iters = ((options.target_s / probe.max(1e-6)) as usize)
                .clamp(options.min_iters, options.max_iters.max(options.min_iters));
            let mut times = Vec::with_capacity(iters);
            for _ in 0..iters {
                comm.barrier().map_err(fail)?;
                let started = Instant::now();
                current = run_op(comm, op, current)?;
                times.push(started.elapsed().as_secs_f64());
            }
            drop(current);
            let slowest = comm
                .all_reduce(Buffer::from_vec(times), ReduceOp::Max)
                .and_then(|b| b.into_vec::<f64>())
                .map_err(fail)?;
            if comm.rank() != 0 {
                continue;
            }
            let samples: Vec<Duration> = slowest
                .iter()
                .map(|&s| Duration::from_secs_f64(s))
                .collect();
            let stats = TimingStats::from_samples(&samples)
                .ok_or_else(|| "no timed iterations".to_string())?;
            let algbw = bytes as f64 / stats.median_s / 1e9;
            let row = Row {
                op: op.name().to_string(),
                backend: match (options.backend, options.tcp.transport) {
                    (Backend::Tcp, policy) if policy.wants_shm() => "tcp+shm".to_string(),
                    _ => options.backend.name().to_string(),
                },
                ranks_as: match options.backend {
                    Backend::Tcp | Backend::Mpi => "processes",
                    Backend::Local => "threads",
                }
                .to_string(),
                world,
                bytes,
                iters,
                median_us: round(stats.median_s * 1e6, 1),
                min_us: round(stats.min_s * 1e6, 1),
                algbw_gbps: round(algbw, 4),
                busbw_gbps: round(algbw * op.busbw_factor(world), 4),
            };
            eprintln!(
                "{} n={world} {:15} {:>9} iters={iters:3} median={:10.1}us algbw={:7.3} busbw={:7.3} GB/s",
                row.backend,
                row.op,
                human(bytes),
                row.median_us,
                row.algbw_gbps,
                row.busbw_gbps
            );
            rows.push(row);
        }
    }
    comm.barrier().map_err(fail)?;
    Ok(rows)
}

fn round(value: f64, digits: i32) -> f64 {
    let scale = 10f64.powi(digits);
    (value * scale).round() / scale
}

/// A rank process (`--backend tcp`): joins the world from the torchrun variables, runs the
/// cells, and (rank 0) prints the rows for the parent.
fn rank_process(options: &Options) -> BenchResult<()> {
    let rows = match options.backend {
        Backend::Mpi => mpi_rank_rows(options)?,
        _ => {
            let world = init_from_env(&options.tcp).map_err(|e| format!("rendezvous: {e}"))?;
            run_rank(world.comm.as_ref(), options)?
        }
    };
    for row in rows {
        let line = serde_json::to_string(&row).map_err(|e| e.to_string())?;
        println!("{ROW_PREFIX}{line}");
    }
    Ok(())
}

/// The cells of one MPI rank, on `MPI_COMM_WORLD`.
#[cfg(feature = "mpi")]
fn mpi_rank_rows(options: &Options) -> BenchResult<Vec<Row>> {
    let comm = hypershard_collectives::mpi::MpiCommunicator::world(
        hypershard_collectives::CommConfig::default(),
    )
    .map_err(|e| format!("MPI world: {e}"))?;
    run_rank(&comm, options)
}

/// Without the `mpi` feature `--backend mpi` is refused while parsing; this is never reached.
#[cfg(not(feature = "mpi"))]
fn mpi_rank_rows(_options: &Options) -> BenchResult<Vec<Row>> {
    Err("this build has no MPI backend (feature `mpi`)".to_string())
}

/// Runs `mpirun -np world` on this binary and collects rank 0's rows (rank 0 is the only rank
/// that prints rows, so every row line comes from it whatever `mpirun` does with the others'
/// output).
fn run_mpi_world(options: &Options, world: usize) -> BenchResult<Vec<Row>> {
    let exe = std::env::current_exe().map_err(|e| format!("own path: {e}"))?;
    let mpirun = std::env::var_os("HYPERSHARD_MPIRUN").unwrap_or_else(|| "mpirun".into());
    let output = Command::new(&mpirun)
        .args(["--oversubscribe", "--allow-run-as-root", "-np"])
        .arg(world.to_string())
        .args(["-x", RANK_VAR])
        .arg(&exe)
        .args(&options.raw)
        .env(RANK_VAR, "mpi")
        .stderr(Stdio::inherit())
        .output()
        .map_err(|e| format!("{}: {e}", mpirun.to_string_lossy()))?;
    if !output.status.success() {
        return Err(format!("mpirun world {world}: {}", output.status));
    }
    String::from_utf8_lossy(&output.stdout)
        .lines()
        .filter_map(|line| line.strip_prefix(ROW_PREFIX))
        .map(|json| serde_json::from_str(json).map_err(|e| format!("rank 0 row: {e}")))
        .collect()
}

/// Spawns `world` rank processes of this binary and collects rank 0's rows.
fn run_tcp_world(options: &Options, world: usize) -> BenchResult<Vec<Row>> {
    run_rank_processes(world, &options.raw, RANK_VAR, &[], ROW_PREFIX)
        .map_err(|e| format!("world {world}: {e}"))?
        .iter()
        .map(|json| serde_json::from_str(json).map_err(|e| format!("rank 0 row: {e}")))
        .collect()
}

/// Runs a world of threads on the local backend and collects rank 0's rows.
fn run_local_world(options: &Options, world: usize) -> BenchResult<Vec<Row>> {
    let comms = local::spawn_world(world).map_err(|e| e.to_string())?;
    let handles: Vec<_> = comms
        .into_iter()
        .map(|comm: Arc<dyn Communicator>| {
            let options = options.clone();
            std::thread::spawn(move || run_rank(comm.as_ref(), &options))
        })
        .collect();
    let mut rows = Vec::new();
    for handle in handles {
        let result = handle
            .join()
            .map_err(|_| "a rank thread panicked".to_string())?;
        rows.extend(result?);
    }
    Ok(rows)
}

/// Which measurement a row is: op, world size and message size.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
struct Cell {
    op: String,
    world: usize,
    bytes: usize,
}

/// What the comparison needs of one gloo row.
#[derive(Clone, Copy, Debug)]
struct GlooCell {
    median_us: f64,
    busbw_gbps: f64,
}

type GlooTable = BTreeMap<Cell, GlooCell>;

/// gloo's rows from a `bench_gloo.py --csv` file.
fn read_gloo(path: &PathBuf) -> BenchResult<GlooTable> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let mut lines = text.lines();
    let header: Vec<&str> = lines.next().unwrap_or_default().split(',').collect();
    let column = |name: &str| {
        header
            .iter()
            .position(|h| *h == name)
            .ok_or_else(|| format!("{}: no column `{name}`", path.display()))
    };
    let (op, world, bytes, median, busbw) = (
        column("op")?,
        column("world_size")?,
        column("bytes")?,
        column("median_us")?,
        column("busbw_GBps")?,
    );
    let mut rows = BTreeMap::new();
    for line in lines {
        let cells: Vec<&str> = line.split(',').collect();
        let cell = |i: usize| cells.get(i).copied().unwrap_or_default();
        let (Ok(w), Ok(b), Ok(m), Ok(bw)) = (
            cell(world).parse::<usize>(),
            cell(bytes).parse::<usize>(),
            cell(median).parse::<f64>(),
            cell(busbw).parse::<f64>(),
        ) else {
            continue;
        };
        let key = Cell {
            op: cell(op).to_string(),
            world: w,
            bytes: b,
        };
        rows.insert(
            key,
            GlooCell {
                median_us: m,
                busbw_gbps: bw,
            },
        );
    }
    Ok(rows)
}

fn print_table(rows: &[Row], gloo: Option<&GlooTable>) {
    if gloo.is_some() {
        println!(
            "| world | op | size | median us | busbw GB/s | gloo median us | gloo busbw GB/s | busbw ratio | latency ratio |"
        );
        println!("|---|---|---|---|---|---|---|---|---|");
    } else {
        println!("| world | op | size | iters | median us | min us | algbw GB/s | busbw GB/s |");
        println!("|---|---|---|---|---|---|---|---|");
    }
    for row in rows {
        match gloo {
            Some(gloo) => {
                let key = Cell {
                    op: row.op.clone(),
                    world: row.world,
                    bytes: row.bytes,
                };
                let peer = gloo.get(&key).copied().unwrap_or(GlooCell {
                    median_us: f64::NAN,
                    busbw_gbps: f64::NAN,
                });
                let (peer_median, peer_busbw) = (peer.median_us, peer.busbw_gbps);
                println!(
                    "| {} | {} | {} | {} | {:.3} | {} | {:.3} | {:.2}× | {:.2}× |",
                    row.world,
                    row.op,
                    human(row.bytes),
                    row.median_us,
                    row.busbw_gbps,
                    peer_median,
                    peer_busbw,
                    row.busbw_gbps / peer_busbw,
                    row.median_us / peer_median
                );
            }
            None => println!(
                "| {} | {} | {} | {} | {} | {} | {:.3} | {:.3} |",
                row.world,
                row.op,
                human(row.bytes),
                row.iters,
                row.median_us,
                row.min_us,
                row.algbw_gbps,
                row.busbw_gbps
            ),
        }
    }
}

fn main() -> ExitCode {
    let options = match parse_args(std::env::args().skip(1).collect()) {
        Ok(options) => options,
        Err(e) => {
            eprintln!("bench-collectives: {e}");
            return ExitCode::from(2);
        }
    };
    if std::env::var_os(RANK_VAR).is_some() {
        return match rank_process(&options) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("bench-collectives rank: {e}");
                ExitCode::FAILURE
            }
        };
    }
    match run(&options) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("bench-collectives: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run(options: &Options) -> BenchResult<()> {
    let gloo = options.gloo_csv.as_ref().map(read_gloo).transpose()?;
    let mut rows = Vec::new();
    for &world in &options.worlds {
        rows.extend(match options.backend {
            Backend::Tcp => run_tcp_world(options, world)?,
            Backend::Local => run_local_world(options, world)?,
            Backend::Mpi => run_mpi_world(options, world)?,
        });
    }
    print_table(&rows, gloo.as_ref());
    let path = match &options.json {
        Some(path) => path.clone(),
        None => bench_output_dir()
            .map_err(|e| format!("bench directory: {e}"))?
            .join("collectives.json"),
    };
    let text = serde_json::to_string_pretty(&rows).map_err(|e| e.to_string())?;
    std::fs::write(&path, text + "\n").map_err(|e| format!("{}: {e}", path.display()))?;
    eprintln!("wrote {}", path.display());
    Ok(())
}
