//! `bench-nccl` (feature `nccl`): the NCCL busbw sweep on device buffers, with its peer measured
//! in the same sitting.
//!
//! ```text
//! bench-nccl [--series all_reduce:f32,all_reduce:bf16,all_gather,reduce_scatter,broadcast]
//!            [--min-bytes 1K] [--max-bytes 256M] [--iters 20] [--reps 5] [--warmup 5]
//!            [--rounds 3] [--world N] [--peer auto|torch|none] [--python PYTHON]
//!            [--torch-script PATH] [--budget-s 150] [--json PATH] [--quick]
//! ```
//!
//! * World: one rank process per visible GPU (`CUDA_VISIBLE_DEVICES` applies), rank `r` on
//!   device `r`, launched like the other suites' rank processes (this binary re-executed with
//!   torchrun's variables; rank 0 hosts the TCP store the NCCL unique id goes through).
//!   `--world N` takes fewer.
//! * A cell is one op in one dtype at one size (doubling from `--min-bytes` to
//!   `--max-bytes`, nccl-tests' size conventions, see `hypershard_benches::nccl_sweep`).
//!   Each cell: the closed-form correctness check of every op first (once per series),
//!   `--warmup` untimed ops, then `--reps` repetitions, each `barrier; synchronize; t0;
//!   --iters ops back to back; synchronize the NCCL stream; t1`, the repetition's time being
//!   the slowest rank's (a `Max` all-reduce). The row is the median over repetitions of the
//!   time per op, with algbw and busbw by nccl-tests' formulas.
//! * The peer, interleaved round by round (ours, then the peer, `--rounds` times):
//!   torch.distributed's NCCL backend (`benches/python/bench_nccl.py`, run by `--python`,
//!   default `$HYPERSHARD_TORCH_PYTHON` or `python3`) on the very same plan (buffer lengths,
//!   ring depth, iterations, repetitions), and, when `NCCL_TESTS_BIN` names nccl-tests'
//!   `all_reduce_perf`, nccl-tests itself (its siblings `all_gather_perf`, ... from the same
//!   folder when present). `--peer auto` runs torch when the python imports it (a missing
//!   torch is then a note, not a failure); `--peer torch` requires it.
//! * Output: a table on standard output, the JSON (`--json`, default
//!   `target/bench/nccl.json`) with every row of every round and source, the pooled
//!   comparison (ours over the peer's bandwidth per cell) and the 256 MiB all-reduce target.
//! * `--budget-s`: every child runs under the time left; a round starts only if the first
//!   one would fit again. Everything still running at the end is killed.
//!
//! Without a usable GPU it fails with the collectives crate's typed
//! `BackendUnavailable` error (no libcuda, no libnccl, no device), never a panic.

use std::collections::VecDeque;
use std::io::Write;
use std::path::PathBuf;
use std::process::{Command, ExitCode, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use hypershard_benches::nccl_sweep::{
    NcclBenchError, PlannedCell, Result, Series, SweepDType, SweepOp, SweepRow, Target, compare,
    parse_nccl_tests, plan_cell, row_from_reps, size_sweep, target,
};
use hypershard_benches::world::run_rank_processes_until;
use hypershard_collectives::nccl::{NcclCommunicator, NcclInit, probe};
use hypershard_collectives::store::{TcpStore, TcpStoreServer};
use hypershard_collectives::{
    Buffer, BufferPair, CommConfig, Communicator, Error as CommError, HostBuffer, ReduceOp, Store,
    Unavailable, Work,
};

/// Set in the environment of the rank processes.
const RANK_VAR: &str = "HYPERSHARD_BENCH_NCCL_RANK";
/// The round a rank process measures.
const ROUND_VAR: &str = "HYPERSHARD_BENCH_NCCL_ROUND";
/// The prefix of the lines by which rank 0 hands its rows to the parent.
const ROW_PREFIX: &str = "NCCL-ROW ";
/// Our rows' source.
const OURS: &str = "hypershard";
/// The `LD_LIBRARY_PATH` the torch peer runs with, when set (empty: none). `cargo xtask
/// gpu-check` runs this binary with its own library folders first on `LD_LIBRARY_PATH` (for
/// cudarc's plain-named links and the toolkit), and passes the path it was started with here:
/// torch's libraries find their own pip wheels through their `RUNPATH`, which
/// `LD_LIBRARY_PATH` would override with the toolkit's (possibly older) copies.
const PEER_LIBRARY_PATH_VAR: &str = "HYPERSHARD_PEER_LD_LIBRARY_PATH";
/// The NCCL op deadline inside the ranks.
const OP_TIMEOUT: Duration = Duration::from_secs(60);

/// Which peer to measure.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum PeerChoice {
    /// torch when its python imports torch; a missing torch is a note.
    Auto,
    /// torch, required.
    Torch,
    /// Only ours (and nccl-tests if `NCCL_TESTS_BIN` is set).
    None,
}

#[derive(Clone, Debug)]
struct Options {
    series: Vec<Series>,
    sizes: Vec<usize>,
    iters: usize,
    reps: usize,
    warmup: usize,
    rounds: usize,
    world: Option<usize>,
    peer: PeerChoice,
    python: String,
    script: PathBuf,
    budget: Duration,
    json: PathBuf,
    /// The arguments as given, passed on to the rank processes.
    raw: Vec<String>,
}

fn parse_size(text: &str) -> Result<usize> {
    let upper = text.trim().to_ascii_uppercase();
    let upper = upper.strip_suffix("IB").unwrap_or(&upper);
    let upper = upper.strip_suffix('B').unwrap_or(upper);
    let (digits, unit) = match upper.chars().last() {
        Some('K') => (&upper[..upper.len() - 1], 1usize << 10),
        Some('M') => (&upper[..upper.len() - 1], 1 << 20),
        Some('G') => (&upper[..upper.len() - 1], 1 << 30),
        _ => (upper, 1),
    };
    digits
        .parse::<usize>()
        .ok()
        .and_then(|d| d.checked_mul(unit))
        .ok_or_else(|| NcclBenchError::Usage(format!("cannot read size `{text}` (1K, 256M)")))
}

fn number(flag: &str, text: &str) -> Result<usize> {
    text.parse()
        .map_err(|_| NcclBenchError::Usage(format!("{flag}: `{text}` is not a whole number")))
}

fn default_script() -> PathBuf {
    let here = PathBuf::from("benches/python/bench_nccl.py");
    if here.is_file() {
        here
    } else {
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("python/bench_nccl.py")
    }
}

fn parse_args(raw: Vec<String>) -> Result<Options> {
    let mut options = Options {
        series: Series::defaults(),
        sizes: Vec::new(),
        iters: 20,
        reps: 5,
        warmup: 5,
        rounds: 3,
        world: None,
        peer: PeerChoice::Auto,
        python: std::env::var("HYPERSHARD_TORCH_PYTHON").unwrap_or_else(|_| "python3".into()),
        script: default_script(),
        budget: Duration::from_secs(150),
        json: PathBuf::from("target/bench/nccl.json"),
        raw: raw.clone(),
    };
    let (mut min, mut max) = (1usize << 10, 256usize << 20);
    let mut args = raw.into_iter();
    while let Some(flag) = args.next() {
        let mut value = || {
            args.next()
                .ok_or_else(|| NcclBenchError::Usage(format!("{flag} needs a value")))
        };
        match flag.as_str() {
            "--series" => {
                options.series = value()?
                    .split(',')
                    .filter(|s| !s.is_empty())
                    .map(Series::parse)
                    .collect::<Result<_>>()?
            }
            "--min-bytes" => min = parse_size(&value()?)?,
            "--max-bytes" => max = parse_size(&value()?)?,
            "--iters" => options.iters = number(&flag, &value()?)?.max(1),
            "--reps" => options.reps = number(&flag, &value()?)?.max(1),
            "--warmup" => options.warmup = number(&flag, &value()?)?,
            "--rounds" => options.rounds = number(&flag, &value()?)?.max(1),
            "--world" => {
                let n = number(&flag, &value()?)?;
                if n == 0 {
                    return Err(NcclBenchError::Usage("--world must be at least 1".into()));
                }
                options.world = Some(n);
            }
            "--peer" => {
                options.peer = match value()?.as_str() {
                    "auto" => PeerChoice::Auto,
                    "torch" => PeerChoice::Torch,
                    "none" => PeerChoice::None,
                    other => {
                        return Err(NcclBenchError::Usage(format!(
                            "unknown peer `{other}` (auto, torch, none)"
                        )));
                    }
                }
            }
            "--python" => options.python = value()?,
            "--torch-script" => options.script = PathBuf::from(value()?),
            "--budget-s" => {
                let text = value()?;
                let seconds: f64 = text
                    .parse()
                    .ok()
                    .filter(|s: &f64| s.is_finite() && *s > 0.0)
                    .ok_or_else(|| {
                        NcclBenchError::Usage(format!("--budget-s: `{text}` is not seconds"))
                    })?;
                options.budget = Duration::from_secs_f64(seconds);
            }
            "--json" => options.json = PathBuf::from(value()?),
            // A smoke run: four sizes, one round, few iterations (the numbers mean little).
            "--quick" => {
                (min, max) = (1 << 10, 1 << 20);
                options.iters = 5;
                options.reps = 3;
                options.warmup = 1;
                options.rounds = 1;
            }
            other => return Err(NcclBenchError::Usage(format!("unknown argument `{other}`"))),
        }
    }
    options.sizes = size_sweep(min, max)?;
    Ok(options)
}

fn collectives(context: impl Into<String>) -> impl FnOnce(CommError) -> NcclBenchError {
    let context = context.into();
    move |source| NcclBenchError::Collectives { context, source }
}

/// The visible CUDA devices, after the typed probe of libcuda and libnccl.
fn device_count() -> Result<usize> {
    probe().map_err(collectives("NCCL backend"))?;
    // A driver that cannot initialise (a machine with libcuda but no usable GPU) is the
    // collectives crate's `DriverInit`, as its own constructor reports it.
    let count =
        cudarc::driver::CudaContext::device_count().map_err(|e| NcclBenchError::Collectives {
            context: "NCCL backend".to_string(),
            source: CommError::BackendUnavailable {
                backend: "nccl",
                reason: Unavailable::DriverInit { code: e.0 as i32 },
            },
        })?;
    Ok(usize::try_from(count).unwrap_or(0))
}

/// `Unavailable::NoDevice` in the collectives crate's error, for a world the devices cannot
/// hold.
fn no_device(requested: usize, available: usize) -> NcclBenchError {
    NcclBenchError::Collectives {
        context: "NCCL backend".to_string(),
        source: CommError::BackendUnavailable {
            backend: "nccl",
            reason: Unavailable::NoDevice {
                requested,
                available,
            },
        },
    }
}

// ---------------------------------------------------------------------------------------------
// The rank side.

/// One buffer set of a cell.
enum Set {
    InPlace(Buffer),
    Pair { input: Buffer, output: Buffer },
}

/// A launched op.
enum Pending {
    One(Work<Buffer>),
    Pair(Work<BufferPair>),
}

fn launch(comm: &NcclCommunicator, op: SweepOp, set: Set) -> Result<Pending> {
    Ok(match (op, set) {
        (SweepOp::AllReduce, Set::InPlace(b)) => {
            Pending::One(comm.all_reduce_async(b, ReduceOp::Sum))
        }
        (SweepOp::Broadcast, Set::InPlace(b)) => Pending::One(comm.broadcast_async(b, 0)),
        (SweepOp::AllGather, Set::Pair { input, output }) => {
            Pending::Pair(comm.all_gather_async(input, output))
        }
        (SweepOp::ReduceScatter, Set::Pair { input, output }) => {
            Pending::Pair(comm.reduce_scatter_async(input, output, ReduceOp::Sum))
        }
        (op, _) => {
            return Err(NcclBenchError::Usage(format!(
                "{}: buffers of the wrong shape",
                op.name()
            )));
        }
    })
}

fn settle(pending: Pending, op: SweepOp) -> Result<Set> {
    let fail = collectives(op.name());
    match pending {
        Pending::One(work) => work.wait().map(Set::InPlace).map_err(fail),
        Pending::Pair(work) => work
            .wait()
            .map(|pair| Set::Pair {
                input: pair.input,
                output: pair.output,
            })
            .map_err(fail),
    }
}

fn sync(comm: &NcclCommunicator) -> Result<()> {
    comm.stream()
        .synchronize()
        .map_err(|e| NcclBenchError::Driver {
            call: "cuStreamSynchronize",
            message: e.to_string(),
        })
}

/// Issues `iters` ops back to back over the ring of sets: a set is reused once the op that
/// last used it has completed (the host waits for the oldest op while the rest stay queued).
/// Returns the ops still pending; the caller synchronises the stream, then settles them.
fn issue(
    comm: &NcclCommunicator,
    op: SweepOp,
    ring: &mut Vec<Set>,
    iters: usize,
) -> Result<VecDeque<Pending>> {
    let mut pending = VecDeque::with_capacity(ring.len());
    for _ in 0..iters {
        let set = match ring.pop() {
            Some(set) => set,
            None => match pending.pop_front() {
                Some(oldest) => settle(oldest, op)?,
                None => {
                    return Err(NcclBenchError::Usage("a ring of no buffer sets".into()));
                }
            },
        };
        pending.push_back(launch(comm, op, set)?);
    }
    Ok(pending)
}

fn drain(pending: VecDeque<Pending>, op: SweepOp, ring: &mut Vec<Set>) -> Result<()> {
    for p in pending {
        ring.push(settle(p, op)?);
    }
    Ok(())
}

fn device_buffer(comm: &NcclCommunicator, dtype: SweepDType, values: &[f64]) -> Result<Buffer> {
    comm.upload(&HostBuffer::from_f64(dtype.dtype(), values))
        .map_err(collectives("upload"))
}

fn host_values(buffer: &Buffer) -> Result<Vec<f64>> {
    Ok(buffer
        .to_host()
        .map_err(collectives("download"))?
        .to_f64_vec())
}

fn expect(op: SweepOp, dtype: SweepDType, got: &[f64], want: impl Fn(usize) -> f64) -> Result<()> {
    match (0..got.len()).find(|&i| got[i] != want(i)) {
        None => Ok(()),
        Some(i) => Err(NcclBenchError::WrongResult {
            op: op.name(),
            dtype: dtype.name(),
            detail: format!("element {i} is {}, expected {}", got[i], want(i)),
        }),
    }
}

/// Checks `series` once on closed-form device data before it is timed: rank `r` gives
/// `(r + i) mod 8` (exact in bf16 and in every sum of up to 32 ranks), 1000 elements per rank
/// (a length no world here divides into powers of two).
fn check_series(comm: &NcclCommunicator, series: Series) -> Result<()> {
    let (n, r) = (comm.size(), comm.rank());
    let len = 1000;
    let value = |rank: usize, i: usize| ((rank + i) % 8) as f64;
    let mine: Vec<f64> = (0..len).map(|i| value(r, i)).collect();
    let (op, dtype) = (series.op, series.dtype);
    let fail = collectives(format!("correctness check of {}", op.name()));
    match op {
        SweepOp::AllReduce => {
            let out = comm
                .all_reduce(device_buffer(comm, dtype, &mine)?, ReduceOp::Sum)
                .map_err(fail)?;
            expect(op, dtype, &host_values(&out)?, |i| {
                (0..n).map(|q| value(q, i)).sum()
            })
        }
        SweepOp::AllGather => {
            let pair = comm
                .all_gather(
                    device_buffer(comm, dtype, &mine)?,
                    device_buffer(comm, dtype, &vec![0.0; n * len])?,
                )
                .map_err(fail)?;
            expect(op, dtype, &host_values(&pair.output)?, |j| {
                value(j / len, j % len)
            })
        }
        SweepOp::ReduceScatter => {
            let input: Vec<f64> = (0..n * len).map(|j| value(r, j)).collect();
            let pair = comm
                .reduce_scatter(
                    device_buffer(comm, dtype, &input)?,
                    device_buffer(comm, dtype, &vec![0.0; len])?,
                    ReduceOp::Sum,
                )
                .map_err(fail)?;
            expect(op, dtype, &host_values(&pair.output)?, |i| {
                (0..n).map(|q| value(q, r * len + i)).sum()
            })
        }
        SweepOp::Broadcast => {
            let root: Vec<f64> = (0..len).map(|i| ((i * (r + 1)) % 8) as f64).collect();
            let out = comm
                .broadcast(device_buffer(comm, dtype, &root)?, 0)
                .map_err(fail)?;
            expect(op, dtype, &host_values(&out)?, |i| (i % 8) as f64)
        }
    }
}

/// Times one cell on this rank; returns the per-repetition times (the slowest rank's).
fn time_cell(
    comm: &NcclCommunicator,
    series: Series,
    cell: &PlannedCell,
    options: &Options,
) -> Result<Vec<f64>> {
    let op = series.op;
    let dtype = series.dtype.dtype();
    let zeros = |len: usize| comm.zeros(dtype, len).map_err(collectives("allocate"));
    let mut ring = Vec::with_capacity(cell.depth);
    for _ in 0..cell.depth {
        ring.push(if op.in_place() {
            Set::InPlace(zeros(cell.input_len)?)
        } else {
            Set::Pair {
                input: zeros(cell.input_len)?,
                output: zeros(cell.output_len)?,
            }
        });
    }
    let warm = issue(comm, op, &mut ring, options.warmup)?;
    sync(comm)?;
    drain(warm, op, &mut ring)?;
    let mut times = Vec::with_capacity(options.reps);
    for _ in 0..options.reps {
        comm.barrier().map_err(collectives("barrier"))?;
        sync(comm)?;
        let started = Instant::now();
        let pending = issue(comm, op, &mut ring, options.iters)?;
        sync(comm)?;
        times.push(started.elapsed().as_secs_f64());
        drain(pending, op, &mut ring)?;
    }
    let slowest = comm
        .all_reduce(Buffer::from_vec(times), ReduceOp::Max)
        .and_then(|b| b.into_vec::<f64>())
        .map_err(collectives("the slowest rank's times"))?;
    Ok(slowest)
}

fn launch_var(name: &str) -> Result<usize> {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .ok_or_else(|| NcclBenchError::Ranks(format!("{name} is not set to a number")))
}

/// A rank process: joins the NCCL world, checks and times every cell, and (rank 0) prints the
/// rows for the parent.
fn rank_process(options: &Options) -> Result<()> {
    let (rank, world) = (launch_var("RANK")?, launch_var("WORLD_SIZE")?);
    let device = launch_var("LOCAL_RANK")?;
    let round = launch_var(ROUND_VAR)?;
    let port = launch_var("MASTER_PORT")?;
    let addr = format!("127.0.0.1:{port}");
    // Rank 0 hosts the store; the server lives until this function returns.
    let (server, store): (Option<TcpStoreServer>, Arc<dyn Store>) = if rank == 0 {
        let server = TcpStoreServer::bind(&addr).map_err(collectives("store server"))?;
        let store = server.store();
        (Some(server), store)
    } else {
        let client =
            TcpStore::connect(&addr, Duration::from_secs(60)).map_err(collectives("store"))?;
        (None, Arc::new(client))
    };
    let comm = NcclCommunicator::new(NcclInit {
        rank,
        size: world,
        device,
        store,
        config: CommConfig::default().with_timeout(OP_TIMEOUT),
    })
    .map_err(collectives(format!(
        "NCCL world (rank {rank}, device {device})"
    )))?;
    let mut stdout = std::io::stdout().lock();
    for &series in &options.series {
        check_series(&comm, series)?;
        for &bytes in &options.sizes {
            let cell = plan_cell(series, bytes, world, options.iters)?;
            let reps = time_cell(&comm, series, &cell, options)?;
            if rank != 0 {
                continue;
            }
            let row = row_from_reps(OURS, round, series, world, &cell, options.iters, &reps)
                .ok_or_else(|| NcclBenchError::Ranks("no timed repetitions".into()))?;
            eprintln!(
                "hypershard n={world} {:15} {:4} {:>10} B depth={:2} median={:10.2}us algbw={:8.3} busbw={:8.3} GB/s",
                row.op,
                row.dtype,
                row.bytes,
                cell.depth,
                row.median_us,
                row.algbw_gbps,
                row.busbw_gbps
            );
            let line =
                serde_json::to_string(&row).map_err(|e| NcclBenchError::Ranks(e.to_string()))?;
            let _ = writeln!(stdout, "{ROW_PREFIX}{line}");
        }
    }
    comm.barrier().map_err(collectives("final barrier"))?;
    drop(comm);
    drop(server);
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// The parent side.

/// The plan of every cell, in the order the ranks run them.
fn plan(options: &Options, world: usize) -> Result<Vec<(Series, PlannedCell)>> {
    let mut cells = Vec::new();
    for &series in &options.series {
        for &bytes in &options.sizes {
            cells.push((series, plan_cell(series, bytes, world, options.iters)?));
        }
    }
    Ok(cells)
}

/// Runs `command` with its standard output captured, in its own process group, killing the
/// whole group (a python and its rank processes) at `deadline`.
fn run_child(
    mut command: Command,
    input: &[u8],
    deadline: Duration,
) -> std::result::Result<(bool, String), String> {
    use std::os::unix::process::CommandExt;
    let mut child = command
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .process_group(0)
        .spawn()
        .map_err(|e| format!("cannot start {command:?}: {e}"))?;
    if let Some(mut stdin) = child.stdin.take() {
        stdin
            .write_all(input)
            .map_err(|e| format!("writing the plan to {command:?}: {e}"))?;
    }
    let mut stdout = child
        .stdout
        .take()
        .ok_or("no pipe for the child's output")?;
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
                // The group's id is the child's pid (process_group(0)).
                let _ = Command::new("kill")
                    .args(["-KILL", "--", &format!("-{}", child.id())])
                    .status();
                let _ = child.kill();
                let _ = child.wait();
                let _ = reader.join();
                return Err(format!("killed after {deadline:?}"));
            }
            Ok(None) => std::thread::sleep(Duration::from_millis(50)),
            Err(e) => return Err(e.to_string()),
        }
    };
    let text = reader.join().map_err(|_| "the output reader panicked")?;
    Ok((status.success(), text))
}

/// What the torch script reports: versions, and per cell the repetitions' seconds.
#[derive(serde::Deserialize)]
struct TorchReport {
    torch: String,
    nccl: String,
    device: String,
    cells: Vec<TorchCell>,
}

#[derive(serde::Deserialize)]
struct TorchCell {
    op: String,
    dtype: String,
    bytes: usize,
    rep_seconds: Vec<f64>,
}

/// One torch.distributed round on the same plan; returns its rows and a line naming the peer.
fn torch_round(
    options: &Options,
    world: usize,
    round: usize,
    cells: &[(Series, PlannedCell)],
    deadline: Duration,
) -> Result<(Vec<SweepRow>, String)> {
    let peer = |reason: String| NcclBenchError::Peer {
        peer: "torch-nccl",
        reason,
    };
    let plan = serde_json::json!({
        "world": world,
        "iters": options.iters,
        "reps": options.reps,
        "warmup": options.warmup,
        "cells": cells.iter().map(|(_, c)| c).collect::<Vec<_>>(),
    });
    let mut command = Command::new(&options.python);
    command.arg(&options.script);
    match std::env::var_os(PEER_LIBRARY_PATH_VAR) {
        Some(path) if path.is_empty() => {
            command.env_remove("LD_LIBRARY_PATH");
        }
        Some(path) => {
            command.env("LD_LIBRARY_PATH", path);
        }
        None => {}
    }
    let (ok, out) = run_child(command, plan.to_string().as_bytes(), deadline).map_err(peer)?;
    if !ok {
        return Err(peer(format!(
            "{} {} failed (its messages are above)",
            options.python,
            options.script.display()
        )));
    }
    let report: TorchReport = serde_json::from_str(out.trim())
        .map_err(|e| peer(format!("its output is not the report: {e}")))?;
    let mut rows = Vec::new();
    for cell in &report.cells {
        let Some((series, planned)) = cells.iter().find(|(s, c)| {
            s.op.name() == cell.op && s.dtype.name() == cell.dtype && c.bytes == cell.bytes
        }) else {
            return Err(peer(format!(
                "a cell that was not planned: {} {} {}",
                cell.op, cell.dtype, cell.bytes
            )));
        };
        let row = row_from_reps(
            "torch-nccl",
            round,
            *series,
            world,
            planned,
            options.iters,
            &cell.rep_seconds,
        )
        .ok_or_else(|| peer(format!("no repetitions for {} {}", cell.op, cell.bytes)))?;
        rows.push(row);
    }
    Ok((
        rows,
        format!(
            "torch {} (NCCL {}, {})",
            report.torch, report.nccl, report.device
        ),
    ))
}

/// nccl-tests, when `NCCL_TESTS_BIN` names `all_reduce_perf`: each series' binary from the same
/// folder, over the same sizes, iterations and warm-up, `-g world` in one process.
fn nccl_tests_round(
    options: &Options,
    world: usize,
    round: usize,
    bin: &std::path::Path,
    deadline: Duration,
) -> Result<(Vec<SweepRow>, Vec<String>)> {
    let started = Instant::now();
    let folder = bin.parent().map(PathBuf::from).unwrap_or_default();
    let mut rows = Vec::new();
    let mut notes = Vec::new();
    let (min, max) = (options.sizes[0], options.sizes[options.sizes.len() - 1]);
    for &series in &options.series {
        let exe = if series.op == SweepOp::AllReduce {
            bin.to_path_buf()
        } else {
            folder.join(series.op.nccl_tests_binary())
        };
        if !exe.is_file() {
            notes.push(format!(
                "{} is missing, so nccl-tests has no {} rows",
                exe.display(),
                series.op.name()
            ));
            continue;
        }
        let mut command = Command::new(&exe);
        command.args([
            "-b",
            &min.to_string(),
            "-e",
            &max.to_string(),
            "-f",
            "2",
            "-g",
            &world.to_string(),
            "-n",
            &options.iters.to_string(),
            "-w",
            &options.warmup.to_string(),
            "-d",
            series.dtype.nccl_tests_name(),
            "-c",
            "0",
        ]);
        let left = deadline.saturating_sub(started.elapsed());
        let (ok, out) = run_child(command, b"", left).map_err(|reason| NcclBenchError::Peer {
            peer: "nccl-tests",
            reason: format!("{}: {reason}", exe.display()),
        })?;
        if !ok {
            return Err(NcclBenchError::Peer {
                peer: "nccl-tests",
                reason: format!("{} failed", exe.display()),
            });
        }
        rows.extend(parse_nccl_tests(
            &out,
            series.op,
            series.dtype,
            world,
            round,
            options.iters,
        )?);
    }
    Ok((rows, notes))
}

/// Whether `python` imports torch with CUDA (for `--peer auto`).
fn torch_available(python: &str) -> bool {
    Command::new(python)
        .args([
            "-c",
            "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)",
        ])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

fn print_table(rows: &[SweepRow], comparisons: &[hypershard_benches::nccl_sweep::Comparison]) {
    println!(
        "| source | round | op | dtype | world | bytes | median us | algbw GB/s | busbw GB/s |"
    );
    println!("|---|---|---|---|---|---|---|---|---|");
    for r in rows {
        println!(
            "| {} | {} | {} | {} | {} | {} | {} | {:.3} | {:.3} |",
            r.source,
            r.round,
            r.op,
            r.dtype,
            r.world,
            r.bytes,
            r.median_us,
            r.algbw_gbps,
            r.busbw_gbps
        );
    }
    if comparisons.is_empty() {
        return;
    }
    println!();
    println!(
        "| peer | op | dtype | world | bytes | ours us | peer us | ours busbw | peer busbw | ours/peer |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|");
    for c in comparisons {
        println!(
            "| {} | {} | {} | {} | {} | {} | {} | {:.3} | {:.3} | {:.3} |",
            c.peer,
            c.op,
            c.dtype,
            c.world,
            c.bytes,
            c.ours_us,
            c.peer_us,
            c.ours_busbw_gbps,
            c.peer_busbw_gbps,
            c.ours_over_peer
        );
    }
}

fn run(options: &Options) -> Result<bool> {
    let started = Instant::now();
    let available = device_count()?;
    if available == 0 {
        return Err(no_device(0, 0));
    }
    let world = options.world.unwrap_or(available);
    if world > available {
        return Err(no_device(world - 1, available));
    }
    let cells = plan(options, world)?;
    let nccl_tests = std::env::var_os("NCCL_TESTS_BIN").map(PathBuf::from);
    let use_torch = match options.peer {
        PeerChoice::Torch => true,
        PeerChoice::None => false,
        PeerChoice::Auto => torch_available(&options.python),
    };
    let mut notes: Vec<String> = Vec::new();
    if options.peer == PeerChoice::Auto && !use_torch {
        notes.push(format!(
            "{} cannot import torch with CUDA, so there is no torch peer",
            options.python
        ));
    }
    let mut peers: Vec<String> = Vec::new();
    let mut peer_errors: Vec<String> = Vec::new();
    let mut rows: Vec<SweepRow> = Vec::new();
    let mut first_round: Option<Duration> = None;
    let mut rounds_done = 0;
    for round in 1..=options.rounds {
        let round_started = Instant::now();
        let left = options.budget.saturating_sub(started.elapsed());
        if let Some(first) = first_round
            && left < first
        {
            notes.push(format!(
                "stopped after {rounds_done} round(s): {left:?} left of the budget, a round took {first:?}"
            ));
            break;
        }
        let round_text = round.to_string();
        let ours = run_rank_processes_until(
            world,
            &options.raw,
            RANK_VAR,
            &[(ROUND_VAR, round_text.as_str())],
            ROW_PREFIX,
            left,
        )
        .map_err(NcclBenchError::Ranks)?;
        for line in ours {
            rows.push(
                serde_json::from_str(&line)
                    .map_err(|e| NcclBenchError::Ranks(format!("rank 0's row: {e}")))?,
            );
        }
        if use_torch {
            let left = options.budget.saturating_sub(started.elapsed());
            match torch_round(options, world, round, &cells, left) {
                Ok((torch_rows, name)) => {
                    rows.extend(torch_rows);
                    if !peers.contains(&name) {
                        peers.push(name);
                    }
                }
                Err(e) => {
                    eprintln!("bench-nccl: {e}");
                    peer_errors.push(format!("round {round}: {e}"));
                }
            }
        }
        if let Some(bin) = &nccl_tests {
            let left = options.budget.saturating_sub(started.elapsed());
            match nccl_tests_round(options, world, round, bin, left) {
                Ok((tests_rows, tests_notes)) => {
                    rows.extend(tests_rows);
                    let name = format!("nccl-tests ({})", bin.display());
                    if !peers.contains(&name) {
                        peers.push(name);
                    }
                    for note in tests_notes {
                        if !notes.contains(&note) {
                            notes.push(note);
                        }
                    }
                }
                Err(e) => {
                    eprintln!("bench-nccl: {e}");
                    peer_errors.push(format!("round {round}: {e}"));
                }
            }
        }
        rounds_done = round;
        first_round.get_or_insert(round_started.elapsed());
    }
    let mut comparisons = compare(&rows, OURS, "torch-nccl");
    comparisons.extend(compare(&rows, OURS, "nccl-tests"));
    let goal: Option<Target> = target(&comparisons);
    print_table(&rows, &comparisons);
    if let Some(goal) = &goal {
        eprintln!(
            "bench-nccl: target (all_reduce f32 256 MiB vs {}): ours/peer = {:.3}, within 10%: {} ({})",
            goal.peer, goal.comparison.ours_over_peer, goal.within_10_percent, goal.note
        );
    }
    let summary = serde_json::json!({
        "bench": "nccl",
        "world": world,
        "rounds": rounds_done,
        "iters": options.iters,
        "reps": options.reps,
        "warmup": options.warmup,
        "ring_budget_bytes": hypershard_benches::nccl_sweep::RING_BUDGET_BYTES,
        "peers": peers,
        "peer_errors": peer_errors,
        "notes": notes,
        "target": goal,
        "comparison": comparisons,
        "rows": rows,
        "seconds": started.elapsed().as_secs_f64(),
    });
    if let Some(dir) = options.json.parent() {
        std::fs::create_dir_all(dir).map_err(|source| NcclBenchError::Io {
            path: dir.display().to_string(),
            source,
        })?;
    }
    let text = serde_json::to_string_pretty(&summary).map_err(|e| NcclBenchError::Io {
        path: options.json.display().to_string(),
        source: std::io::Error::other(e),
    })?;
    std::fs::write(&options.json, text + "\n").map_err(|source| NcclBenchError::Io {
        path: options.json.display().to_string(),
        source,
    })?;
    eprintln!("bench-nccl: wrote {}", options.json.display());
    // A required peer that failed fails the run (after the figures were written).
    Ok(peer_errors.is_empty() || options.peer == PeerChoice::Auto)
}

fn main() -> ExitCode {
    let options = match parse_args(std::env::args().skip(1).collect()) {
        Ok(options) => options,
        Err(e) => {
            eprintln!("bench-nccl: {e}");
            return ExitCode::from(2);
        }
    };
    if std::env::var_os(RANK_VAR).is_some() {
        return match rank_process(&options) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("bench-nccl rank: {e}");
                ExitCode::FAILURE
            }
        };
    }
    match run(&options) {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => {
            eprintln!("bench-nccl: the peer failed (see peer_errors in the JSON)");
            ExitCode::FAILURE
        }
        Err(e) => {
            eprintln!("bench-nccl: {e}");
            ExitCode::FAILURE
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn arguments_parse_and_bad_ones_are_usage_errors() {
        let o = parse_args(args(&[])).unwrap();
        assert_eq!(o.sizes.len(), 19);
        assert_eq!(o.series.len(), 5);
        assert_eq!((o.iters, o.reps, o.rounds), (20, 5, 3));
        let o = parse_args(args(&[
            "--quick",
            "--series",
            "all_reduce:bf16",
            "--world",
            "2",
        ]))
        .unwrap();
        assert_eq!(
            o.sizes,
            vec![
                1 << 10,
                2 << 10,
                4 << 10,
                8 << 10,
                16 << 10,
                32 << 10,
                64 << 10,
                128 << 10,
                256 << 10,
                512 << 10,
                1 << 20
            ]
        );
        assert_eq!(o.world, Some(2));
        assert_eq!(o.series[0].dtype, SweepDType::BF16);
        for bad in [
            &["--world", "0"][..],
            &["--peer", "gloo"],
            &["--iters"],
            &["--budget-s", "-1"],
            &["--min-bytes", "1X"],
            &["--max-bytes", "512", "--min-bytes", "1K"],
            &["--frobnicate"],
        ] {
            assert!(
                matches!(parse_args(args(bad)), Err(NcclBenchError::Usage(_))),
                "{bad:?}"
            );
        }
        assert_eq!(parse_size("256M").unwrap(), 256 << 20);
        assert_eq!(parse_size("4KiB").unwrap(), 4096);
    }

    #[test]
    fn without_a_gpu_the_error_is_backend_unavailable() {
        // On a machine with a usable GPU this test has nothing to show; the device run is the
        // binary itself (cargo xtask gpu-check).
        match device_count() {
            Ok(n) if n > 0 => {}
            Ok(_) => {
                let text = no_device(0, 0).to_string();
                assert!(text.contains("nccl"), "{text}");
            }
            Err(NcclBenchError::Collectives {
                source: CommError::BackendUnavailable { backend, .. },
                ..
            }) => assert_eq!(backend, "nccl"),
            Err(other) => panic!("not BackendUnavailable: {other}"),
        }
    }
}
