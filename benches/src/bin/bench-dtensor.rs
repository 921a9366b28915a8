//! `cargo xtask bench dtensor`: the cost of `DTensor::redistribute` over the bare collective
//! that moves the same bytes, on the `tcp` backend.
//!
//! ```text
//! bench-dtensor [--world 2,4] [--mib 64] [--reps 7] [--warmup 2] [--rounds 1]
//!               [--transitions S0-R,P-S0,S0-S1] [--ranks-as threads|processes]
//!               [--pools shared|separate] [--quick]
//! ```
//!
//! `--rounds N` repeats the whole measurement N times in one sitting (fresh communicators
//! each round) and prints every round's ratios, so the spread on a shared machine shows;
//! each round records the load average when it starts. `--quick` is a smoke run for CI
//! (world 2, 1 MiB, 1 warm-up, 2 repetitions, one round; no timing claims).
//!
//! Transitions (f32, a global `[rows, cols]` tensor of `--mib` MiB, 1-d mesh over the world):
//! - `S(0) -> R` against one all-gather of the shards (input: this rank's shard, output: the
//!   full tensor);
//! - `P(sum) -> S(0)` against one reduce-scatter (input: the full-size partial);
//! - `S(0) -> S(1)` against one all-to-all of `bytes / world` per rank.
//!
//! With `--ranks-as threads` (the default) every rank is a thread of this process with its own
//! `TcpCommunicator` over 127.0.0.1 (the same transport as separate processes; the ranks share
//! this machine's cores either way, but also one address space, so one rank's `mmap`/`munmap`
//! and page faults contend with the others' on the process's memory-map lock). With
//! `--ranks-as processes` the binary re-executes itself once per rank and round with the
//! torchrun variables (`RANK`, `WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT`) plus
//! `HYPERSHARD_BENCH_RANK` set, as `bench-collectives` does; each rank joins through
//! `init_from_env` (rank 0 hosts the `TcpStore`), the transport is forced to plain tcp, and rank
//! 0 prints its samples on stdout for the parent, which prints the rows.
//! Each repetition runs `barrier; t0; bare collective; t1` and
//! `barrier; t0; redistribute; t1`, alternating which goes first so drift and warm caches
//! favour neither; a repetition's time is the maximum over the ranks (an all-reduce of the
//! elapsed times, outside the clock). The bare side gets its input buffer ready-made (built before
//! `t0`) and allocates its output inside the timed region, as any caller must; the DTensor
//! side starts from the local tensor, so its extra time is exactly what DTensor adds. Both
//! sides free their buffers after the clock stops. What DTensor adds:
//! planning (cached after the first call), handing the shard to the collective (lent
//! copy-on-write for all-gather and reduce-scatter, which only read their input; for the
//! all-to-all, lent or moved too and read in place by the strided all-to-all when no padding
//! is needed, else packed into a pooled send buffer), unpacking (a view for dim 0, a
//! permuting copy otherwise). Overhead = median(DTensor) /
//! median(bare) - 1. A third column times the bare collective including the copy of the
//! local tensor into its send buffer (what a caller of the bare collective pays when its data
//! lives in a tensor it keeps), which separates DTensor's own cost from that copy. A fourth
//! times `into_redistribute` of a fresh source made before the clock (the consuming form,
//! which takes its input by value like the bare collective: a factory tensor lives in
//! collective memory and is sent without a copy when it needs no padding). A fifth times the
//! bare collective into an output buffer kept from its previous repetition (warm memory, no
//! allocation in the clock): the collective alone, the floor for both sides. DTensor takes its
//! outputs from its buffer pool when one of the right size is idle (a consumed source or a
//! spent send buffer), so its figures can beat the cold-output bare side; "vs warm" compares
//! them with the floor instead. With `--pools shared` (the default) both forms run on one
//! mesh, so one pool: the source the consuming form hands back after its op is the next
//! idle buffer of the output's size, and in the rotation the borrowing form (which runs just
//! before it in four repetitions of five) usually takes it; the consuming form's own output
//! is then a fresh allocation. `--pools separate` gives the consuming form a mesh of its own
//! (same communicator, its own pool), so each form runs in its own steady state: the
//! consuming one reuses its previous source as its output, the borrowing one (whose lent
//! source stays with the tensor) always allocates. Results go to `target/bench/dtensor.json`
//! and stdout (markdown).

use std::process::ExitCode;
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use hypershard_benches::world::run_rank_processes;
use hypershard_benches::{TimingStats, write_json};
use hypershard_collectives::shm::TransportPolicy;
use hypershard_collectives::tcp::{TcpCommunicator, TcpConfig, init_from_env};
use hypershard_collectives::{
    Buffer, BufferPair, CommConfig, Communicator, CommunicatorExt, DType as WireDType, MemoryStore,
    ReduceOp, Store,
};
use hypershard_dtensor::tensor::{DType, Tensor};
use hypershard_dtensor::{
    DTensor, Placement, ProcessMesh, ReduceOp as LayoutOp, init_process_mesh,
};

/// Set in the environment of the rank processes that `--ranks-as processes` spawns.
const RANK_VAR: &str = "HYPERSHARD_BENCH_RANK";
/// The prefix of the line by which rank 0 hands its samples to the parent.
const SAMPLES_PREFIX: &str = "BENCH-SAMPLES ";

/// How the ranks of one world run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum RanksAs {
    /// Threads of this process, one `TcpCommunicator` each.
    Threads,
    /// One process per rank (this binary re-executed), joined through `init_from_env`.
    Processes,
}

impl RanksAs {
    fn name(self) -> &'static str {
        match self {
            RanksAs::Threads => "threads",
            RanksAs::Processes => "processes",
        }
    }
}

/// Whether the two DTensor forms share one mesh's buffer pool.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Pools {
    /// One mesh for both forms: a source the consuming form hands back can become the
    /// borrowing form's next output.
    Shared,
    /// A mesh (and pool) per form: each runs in its own steady state.
    Separate,
}

impl Pools {
    fn name(self) -> &'static str {
        match self {
            Pools::Shared => "shared",
            Pools::Separate => "separate",
        }
    }
}

#[derive(Debug, Clone)]
struct Args {
    worlds: Vec<usize>,
    mib: usize,
    reps: usize,
    warmup: usize,
    rounds: usize,
    transitions: Vec<Transition>,
    ranks_as: RanksAs,
    pools: Pools,
    /// The command line as given, passed on to rank processes.
    raw: Vec<String>,
}

fn parse_args() -> Result<Args, String> {
    let mut args = Args {
        worlds: vec![2, 4],
        mib: 64,
        reps: 7,
        warmup: 2,
        rounds: 1,
        transitions: Transition::ALL.to_vec(),
        ranks_as: RanksAs::Threads,
        pools: Pools::Shared,
        raw: std::env::args().skip(1).collect(),
    };
    let mut it = args.raw.clone().into_iter();
    while let Some(flag) = it.next() {
        if flag == "--quick" {
            args.worlds = vec![2];
            args.mib = 1;
            args.reps = 2;
            args.warmup = 1;
            args.rounds = 1;
            continue;
        }
        let mut value = || it.next().ok_or(format!("{flag} needs a value"));
        let number = |s: String| s.parse::<usize>().map_err(|e| format!("{s}: {e}"));
        match flag.as_str() {
            "--world" => {
                args.worlds = value()?
                    .split(',')
                    .map(|w| w.parse::<usize>().map_err(|e| format!("{w}: {e}")))
                    .collect::<Result<_, _>>()?
            }
            "--mib" => args.mib = number(value()?)?,
            "--reps" => args.reps = number(value()?)?.max(1),
            "--warmup" => args.warmup = number(value()?)?,
            "--rounds" => args.rounds = number(value()?)?.max(1),
            "--transitions" => {
                args.transitions = value()?
                    .split(',')
                    .map(|name| {
                        Transition::ALL
                            .into_iter()
                            .find(|t| t.flag() == name)
                            .ok_or(format!("unknown transition {name} (S0-R, P-S0, S0-S1)"))
                    })
                    .collect::<Result<_, _>>()?
            }
            "--ranks-as" => {
                args.ranks_as = match value()?.as_str() {
                    "threads" => RanksAs::Threads,
                    "processes" => RanksAs::Processes,
                    other => {
                        return Err(format!("unknown --ranks-as {other} (threads, processes)"));
                    }
                }
            }
            "--pools" => {
                args.pools = match value()?.as_str() {
                    "shared" => Pools::Shared,
                    "separate" => Pools::Separate,
                    other => return Err(format!("unknown --pools {other} (shared, separate)")),
                }
            }
            other => return Err(format!("unknown flag {other}")),
        }
    }
    Ok(args)
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Transition {
    ShardToReplicate,
    PartialToShard,
    ShardToShard,
}

impl Transition {
    const ALL: [Transition; 3] = [
        Transition::ShardToReplicate,
        Transition::PartialToShard,
        Transition::ShardToShard,
    ];

    fn flag(self) -> &'static str {
        match self {
            Transition::ShardToReplicate => "S0-R",
            Transition::PartialToShard => "P-S0",
            Transition::ShardToShard => "S0-S1",
        }
    }

    fn name(self) -> &'static str {
        match self {
            Transition::ShardToReplicate => "S(0)->R",
            Transition::PartialToShard => "P(sum)->S(0)",
            Transition::ShardToShard => "S(0)->S(1)",
        }
    }

    fn collective(self) -> &'static str {
        match self {
            Transition::ShardToReplicate => "all_gather",
            Transition::PartialToShard => "reduce_scatter",
            Transition::ShardToShard => "all_to_all",
        }
    }

    fn placements(self) -> (Placement, Placement) {
        match self {
            Transition::ShardToReplicate => (Placement::Shard(0), Placement::Replicate),
            Transition::PartialToShard => (Placement::Partial(LayoutOp::Sum), Placement::Shard(0)),
            Transition::ShardToShard => (Placement::Shard(0), Placement::Shard(1)),
        }
    }
}

#[derive(Debug, Clone, serde::Serialize)]
struct Row {
    round: usize,
    /// `threads` or `processes` (`--ranks-as`).
    ranks_as: &'static str,
    /// `shared` or `separate` (`--pools`).
    pools: &'static str,
    /// The 1-minute load average when the round started (`/proc/loadavg`).
    load_1m: Option<f64>,
    world: usize,
    transition: &'static str,
    collective: &'static str,
    global_shape: Vec<usize>,
    bytes: usize,
    bare: TimingStats,
    bare_with_copy: TimingStats,
    dtensor: TimingStats,
    dtensor_by_value: TimingStats,
    /// The bare collective into a warm output buffer (reused across repetitions).
    bare_warm_output: TimingStats,
    overhead_pct: f64,
    overhead_vs_copy_pct: f64,
    by_value_overhead_pct: f64,
    /// `redistribute` over the warm-output bare collective, minus 1, in percent.
    overhead_vs_warm_pct: f64,
    /// `into_redistribute` over the warm-output bare collective, minus 1, in percent.
    by_value_vs_warm_pct: f64,
}

/// The tcp options of every rank: plain sockets between co-located ranks (no shared-memory
/// transport; `main` refuses a `HYPERSHARD_TRANSPORT` that would override this) and a 30 s
/// rendezvous.
fn tcp_config() -> TcpConfig {
    TcpConfig::default()
        .with_transport(TransportPolicy::Tcp)
        .with_rendezvous_timeout(Duration::from_secs(30))
}

fn tcp_world(size: usize) -> Result<Vec<Arc<dyn Communicator>>, String> {
    let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
    let tcp = tcp_config();
    let config = CommConfig::default().with_timeout(Duration::from_secs(120));
    let handles: Vec<_> = (0..size)
        .map(|rank| {
            let (store, tcp, config) = (store.clone(), tcp.clone(), config.clone());
            std::thread::spawn(move || {
                TcpCommunicator::connect(store.as_ref(), rank, size, &tcp, config)
                    .map(|c| Arc::new(c) as Arc<dyn Communicator>)
            })
        })
        .collect();
    handles
        .into_iter()
        .map(|h| {
            h.join()
                .map_err(|_| "a rank panicked while connecting".to_string())?
                .map_err(|e| e.to_string())
        })
        .collect()
}

/// The bare collective's input, made before the clock starts: the local tensor's elements
/// (the shapes divide evenly, so no padding is needed and the byte counts match the
/// redistribute's exactly).
fn bare_input(local: &Tensor) -> Result<Buffer, String> {
    local
        .with_data(|xs: &[f32]| Buffer::from_slice(xs))
        .map_err(|e| e.to_string())
}

/// Runs the bare collective; the buffers it hands back are returned so that they are freed
/// after the clock stops (the DTensor side also keeps its output past the clock).
/// Runs the bare collective, into `output` when one is given (a warm buffer of the right
/// size) or into a fresh one allocated here, inside the caller's clock.
fn run_bare(
    transition: Transition,
    comm: &Arc<dyn Communicator>,
    input: Buffer,
    output: Option<Buffer>,
) -> Result<BufferPair, String> {
    let n = comm.size();
    let len = input.len();
    let out_len = match transition {
        Transition::ShardToReplicate => len * n,
        Transition::PartialToShard => len / n,
        Transition::ShardToShard => len,
    };
    let output = output.unwrap_or_else(|| Buffer::zeros(WireDType::F32, out_len));
    let result = match transition {
        Transition::ShardToReplicate => comm.all_gather(input, output),
        Transition::PartialToShard => comm.reduce_scatter(input, output, ReduceOp::Sum),
        Transition::ShardToShard => comm.all_to_all(input, output),
    };
    result.map_err(|e| e.to_string())
}

/// Per repetition: bare, bare including the input copy, DTensor, DTensor by value, bare into
/// a warm output.
type Samples = [Vec<Duration>; 5];

/// Times one transition on one rank; returns (bare, dtensor) per repetition, each the max over
/// the ranks.
fn rank_main(
    mesh: &ProcessMesh,
    by_value_mesh: &ProcessMesh,
    transition: Transition,
    shape: &[usize],
    args: &Args,
) -> Result<Samples, String> {
    let comm = mesh.dim_comm(0).map_err(|e| e.to_string())?.clone();
    let (src, dst) = transition.placements();
    let source = DTensor::ones(mesh, shape, DType::F32, &[src]).map_err(|e| e.to_string())?;
    let mut samples: Samples = Default::default();
    let max_over_ranks = |elapsed: Duration| -> Result<Duration, String> {
        let secs = comm
            .all_reduce_vec(vec![elapsed.as_secs_f64()], ReduceOp::Max)
            .map_err(|e| e.to_string())?;
        Ok(Duration::from_secs_f64(secs[0]))
    };
    // The warm-output side's output, kept from one repetition to the next (the first, a
    // warm-up, faults it in).
    let mut warm: Option<Buffer> = None;
    for rep in 0..args.warmup + args.reps {
        let mut times = [Duration::ZERO; 5];
        // Rotate which side goes first, so warm caches and drift favour none.
        for turn in 0..5 {
            let side = (rep + turn) % 5;
            // Inputs made before the clock starts: the bare sides' send buffer, the by-value
            // side's fresh source (a factory tensor, which lives in collective memory).
            let input = (side == 0 || side == 4)
                .then(|| bare_input(source.to_local()))
                .transpose()?;
            let owned = if side == 3 {
                Some(
                    DTensor::ones(by_value_mesh, shape, DType::F32, &[src])
                        .map_err(|e| e.to_string())?,
                )
            } else {
                None
            };
            comm.barrier().map_err(|e| e.to_string())?;
            let t0 = Instant::now();
            match (side, owned) {
                (4, _) => {
                    let input = input.ok_or("the warm side's input is made before the clock")?;
                    let kept = run_bare(transition, &comm, input, warm.take())?;
                    times[4] = max_over_ranks(t0.elapsed())?;
                    warm = Some(kept.output);
                }
                (0 | 1, _) => {
                    // Side 1 pays for building its send buffer from the tensor, as a caller
                    // of the bare collective holding its data in a tensor would.
                    let input = match input {
                        Some(input) => input,
                        None => bare_input(source.to_local())?,
                    };
                    let kept = run_bare(transition, &comm, input, None)?;
                    times[side] = max_over_ranks(t0.elapsed())?;
                    drop(kept);
                }
                (_, Some(owned)) => {
                    let out = owned.into_redistribute(&[dst]).map_err(|e| e.to_string())?;
                    times[3] = max_over_ranks(t0.elapsed())?;
                    drop(out);
                }
                (_, None) => {
                    let out = source.redistribute(&[dst]).map_err(|e| e.to_string())?;
                    times[2] = max_over_ranks(t0.elapsed())?;
                    drop(out);
                }
            }
        }
        if rep >= args.warmup {
            for (sample, time) in samples.iter_mut().zip(times) {
                sample.push(time);
            }
        }
    }
    Ok(samples)
}

/// The 1-minute load average, where the OS reports one.
fn load_1m() -> Option<f64> {
    std::fs::read_to_string("/proc/loadavg")
        .ok()?
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

/// Which round of how many, and the load when it started.
#[derive(Debug, Clone, Copy)]
struct Round {
    index: usize,
    load_1m: Option<f64>,
}

/// The global `[rows, cols]` shape of `--mib` MiB of f32 for a world of `world` ranks.
fn bench_shape(world: usize, args: &Args) -> Result<Vec<usize>, String> {
    let elements = args.mib * (1 << 20) / 4;
    let side = (elements as f64).sqrt() as usize;
    // A power-of-two square for the default size: divisible by every world size benchmarked.
    let shape = vec![side, elements / side];
    for &extent in &shape {
        if extent % world != 0 {
            return Err(format!(
                "shape {shape:?} does not divide evenly over {world} ranks"
            ));
        }
    }
    Ok(shape)
}

/// One rank's measurement of every transition, on a world communicator.
fn rank_samples(
    comm: Arc<dyn Communicator>,
    shape: &[usize],
    args: &Args,
) -> Result<Vec<Samples>, String> {
    let world = comm.size();
    let mesh = init_process_mesh(comm.clone(), &[world], &["x"]).map_err(|e| e.to_string())?;
    // `--pools separate`: the consuming side's tensors live on a mesh of their own (the same
    // communicator, another buffer pool), so neither form's redistributes take buffers the
    // other handed back.
    let by_value_mesh = match args.pools {
        Pools::Shared => mesh.clone(),
        Pools::Separate => init_process_mesh(comm, &[world], &["x"]).map_err(|e| e.to_string())?,
    };
    args.transitions
        .iter()
        .map(|&t| rank_main(&mesh, &by_value_mesh, t, shape, args))
        .collect()
}

/// Rank 0's samples of a world of rank threads.
fn thread_world_samples(
    world: usize,
    shape: &[usize],
    args: &Args,
) -> Result<Vec<Samples>, String> {
    let comms = tcp_world(world)?;
    let start = Arc::new(Barrier::new(world));
    let handles: Vec<_> = comms
        .into_iter()
        .map(|comm| {
            let (args, shape, start) = (args.clone(), shape.to_vec(), start.clone());
            std::thread::spawn(move || -> Result<Vec<Samples>, String> {
                start.wait();
                rank_samples(comm, &shape, &args)
            })
        })
        .collect();
    let mut per_rank = Vec::new();
    for handle in handles {
        per_rank.push(handle.join().map_err(|_| "a rank panicked".to_string())??);
    }
    // Every rank holds the same max-over-ranks timings; rank 0's are reported.
    Ok(per_rank.swap_remove(0))
}

/// Samples as seconds, the form in which a rank process hands them to the parent.
fn samples_to_secs(samples: &[Samples]) -> Vec<Vec<Vec<f64>>> {
    samples
        .iter()
        .map(|variants| {
            variants
                .iter()
                .map(|times| times.iter().map(Duration::as_secs_f64).collect())
                .collect()
        })
        .collect()
}

/// The inverse of [`samples_to_secs`], checking that every transition has five variants.
fn samples_from_secs(secs: Vec<Vec<Vec<f64>>>) -> Result<Vec<Samples>, String> {
    secs.into_iter()
        .map(|variants| {
            let variants: Vec<Vec<Duration>> = variants
                .into_iter()
                .map(|times| {
                    times
                        .into_iter()
                        .map(|t| Duration::try_from_secs_f64(t).map_err(|e| format!("{t}: {e}")))
                        .collect()
                })
                .collect::<Result<_, _>>()?;
            <Samples>::try_from(variants)
                .map_err(|v| format!("rank 0 sent {} variants, not 5", v.len()))
        })
        .collect()
}

/// A rank process (`--ranks-as processes`): joins the world from the torchrun variables,
/// measures, and (rank 0) prints its samples for the parent.
fn rank_process(args: &Args) -> Result<(), String> {
    let world = init_from_env(&tcp_config()).map_err(|e| format!("rendezvous: {e}"))?;
    let comm: Arc<dyn Communicator> = world.comm.clone();
    let (rank, size) = (comm.rank(), comm.size());
    let shape = bench_shape(size, args)?;
    let samples = rank_samples(comm.clone(), &shape, args)?;
    if rank == 0 {
        let line = serde_json::to_string(&samples_to_secs(&samples)).map_err(|e| e.to_string())?;
        println!("{SAMPLES_PREFIX}{line}");
    }
    // Rank 0 hosts the store: every rank is done with it before rank 0 exits.
    comm.barrier().map_err(|e| e.to_string())?;
    Ok(())
}

/// Rank 0's samples of a world of rank processes (this binary, re-executed once per rank).
fn process_world_samples(world: usize, args: &Args) -> Result<Vec<Samples>, String> {
    // The same op deadline as the rank threads get.
    let env = [("HYPERSHARD_TIMEOUT", "120")];
    let lines = run_rank_processes(world, &args.raw, RANK_VAR, &env, SAMPLES_PREFIX)?;
    let json = lines.last().ok_or("rank 0 printed no samples")?;
    let secs = serde_json::from_str(json).map_err(|e| format!("rank 0 samples: {e}"))?;
    samples_from_secs(secs)
}

fn bench_world(world: usize, args: &Args, round: Round) -> Result<Vec<Row>, String> {
    let shape = bench_shape(world, args)?;
    let rank0 = match args.ranks_as {
        RanksAs::Threads => thread_world_samples(world, &shape, args)?,
        RanksAs::Processes => process_world_samples(world, args)?,
    };
    if rank0.len() != args.transitions.len() {
        return Err(format!(
            "{} transitions measured, {} asked for",
            rank0.len(),
            args.transitions.len()
        ));
    }
    let bytes = shape.iter().product::<usize>() * 4;
    args.transitions
        .iter()
        .zip(rank0)
        .map(|(&t, [bare, bare_copy, dtensor, by_value, warm])| {
            let bare = TimingStats::from_samples(&bare).ok_or("no samples")?;
            let bare_warm_output = TimingStats::from_samples(&warm).ok_or("no samples")?;
            let bare_with_copy = TimingStats::from_samples(&bare_copy).ok_or("no samples")?;
            let dtensor = TimingStats::from_samples(&dtensor).ok_or("no samples")?;
            let dtensor_by_value = TimingStats::from_samples(&by_value).ok_or("no samples")?;
            Ok(Row {
                round: round.index,
                ranks_as: args.ranks_as.name(),
                pools: args.pools.name(),
                load_1m: round.load_1m,
                world,
                transition: t.name(),
                collective: t.collective(),
                global_shape: shape.clone(),
                bytes,
                overhead_pct: (dtensor.median_s / bare.median_s - 1.0) * 100.0,
                overhead_vs_copy_pct: (dtensor.median_s / bare_with_copy.median_s - 1.0) * 100.0,
                by_value_overhead_pct: (dtensor_by_value.median_s / bare.median_s - 1.0) * 100.0,
                overhead_vs_warm_pct: (dtensor.median_s / bare_warm_output.median_s - 1.0) * 100.0,
                by_value_vs_warm_pct: (dtensor_by_value.median_s / bare_warm_output.median_s - 1.0)
                    * 100.0,
                bare_warm_output,
                dtensor_by_value,
                bare,
                bare_with_copy,
                dtensor,
            })
        })
        .collect()
}

fn main() -> ExitCode {
    let args = match parse_args() {
        Ok(args) => args,
        Err(e) => {
            eprintln!("bench-dtensor: {e}");
            return ExitCode::FAILURE;
        }
    };
    // The measurement is of the tcp backend: an environment that would move co-located
    // ranks' data through shared memory instead is refused rather than silently obeyed.
    if let Ok(transport) = std::env::var(hypershard_collectives::shm::TRANSPORT_ENV)
        && transport != "tcp"
    {
        eprintln!(
            "bench-dtensor: {}={transport} would bypass the tcp sockets; unset it",
            hypershard_collectives::shm::TRANSPORT_ENV
        );
        return ExitCode::FAILURE;
    }
    if std::env::var_os(RANK_VAR).is_some() {
        return match rank_process(&args) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("bench-dtensor rank: {e}");
                ExitCode::FAILURE
            }
        };
    }
    let mut rows = Vec::new();
    for index in 1..=args.rounds {
        let round = Round {
            index,
            load_1m: load_1m(),
        };
        for &world in &args.worlds {
            match bench_world(world, &args, round) {
                Ok(mut r) => rows.append(&mut r),
                Err(e) => {
                    eprintln!("bench-dtensor: world {world}: {e}");
                    return ExitCode::FAILURE;
                }
            }
        }
    }
    println!(
        "| round | ranks | pools | load | world | transition | bare collective | MiB | bare (ms) | bare + input copy (ms) | bare, warm output (ms) | `redistribute` (ms) | vs bare | vs warm | `into_redistribute` (ms) | vs bare | vs warm |"
    );
    println!(
        "|------:|-------|-------|-----:|------:|------------|-----------------|----:|----------:|-----------------------:|-----------------------:|--------------------:|--------:|--------:|-------------------------:|--------:|--------:|"
    );
    for row in &rows {
        let load = row.load_1m.map_or("?".to_string(), |l| format!("{l:.1}"));
        println!(
            "| {} | {} | {} | {} | {} | `{}` | {} | {} | {:.1} | {:.1} | {:.1} | {:.1} | {:+.1}% | {:+.1}% | {:.1} | {:+.1}% | {:+.1}% |",
            row.round,
            row.ranks_as,
            row.pools,
            load,
            row.world,
            row.transition,
            row.collective,
            row.bytes >> 20,
            row.bare.median_s * 1e3,
            row.bare_with_copy.median_s * 1e3,
            row.bare_warm_output.median_s * 1e3,
            row.dtensor.median_s * 1e3,
            row.overhead_pct,
            row.overhead_vs_warm_pct,
            row.dtensor_by_value.median_s * 1e3,
            row.by_value_overhead_pct,
            row.by_value_vs_warm_pct,
        );
    }
    match write_json("dtensor", &rows) {
        Ok(path) => eprintln!("wrote {}", path.display()),
        Err(e) => {
            eprintln!("bench-dtensor: cannot write results: {e}");
            return ExitCode::FAILURE;
        }
    }
    ExitCode::SUCCESS
}
