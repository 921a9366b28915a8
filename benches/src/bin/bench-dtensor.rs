//! `cargo xtask bench dtensor`: the cost of `DTensor::redistribute` over the bare collective
//! that moves the same bytes, on the `tcp` backend.
//!
//! ```text
//! bench-dtensor [--world 2,4] [--mib 64] [--reps 7] [--warmup 2] [--rounds 1]
//!               [--transitions S0-R,P-S0,S0-S1] [--quick]
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
//! Every rank is a thread of this process with its own `TcpCommunicator` over 127.0.0.1 (the
//! same transport as separate processes; the ranks share this machine's cores either way).
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
//! them with the floor instead. Results go to `target/bench/dtensor.json` and stdout
//! (markdown).

use std::process::ExitCode;
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use hypershard_benches::{TimingStats, write_json};
use hypershard_collectives::tcp::{TcpCommunicator, TcpConfig};
use hypershard_collectives::{
    Buffer, BufferPair, CommConfig, Communicator, CommunicatorExt, DType as WireDType, MemoryStore,
    ReduceOp, Store,
};
use hypershard_dtensor::tensor::{DType, Tensor};
use hypershard_dtensor::{
    DTensor, Placement, ProcessMesh, ReduceOp as LayoutOp, init_process_mesh,
};

#[derive(Debug, Clone)]
struct Args {
    worlds: Vec<usize>,
    mib: usize,
    reps: usize,
    warmup: usize,
    rounds: usize,
    transitions: Vec<Transition>,
}

fn parse_args() -> Result<Args, String> {
    let mut args = Args {
        worlds: vec![2, 4],
        mib: 64,
        reps: 7,
        warmup: 2,
        rounds: 1,
        transitions: Transition::ALL.to_vec(),
    };
    let mut it = std::env::args().skip(1);
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

fn tcp_world(size: usize) -> Result<Vec<Arc<dyn Communicator>>, String> {
    let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
    let tcp = TcpConfig::default().with_rendezvous_timeout(Duration::from_secs(30));
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
                Some(DTensor::ones(mesh, shape, DType::F32, &[src]).map_err(|e| e.to_string())?)
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

fn bench_world(world: usize, args: &Args, round: Round) -> Result<Vec<Row>, String> {
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
    let comms = tcp_world(world)?;
    let start = Arc::new(Barrier::new(world));
    let handles: Vec<_> = comms
        .into_iter()
        .map(|comm| {
            let (args, shape, start) = (args.clone(), shape.clone(), start.clone());
            std::thread::spawn(move || -> Result<Vec<Samples>, String> {
                let mesh = init_process_mesh(comm, &[world], &["x"]).map_err(|e| e.to_string())?;
                start.wait();
                args.transitions
                    .iter()
                    .map(|&t| rank_main(&mesh, t, &shape, &args))
                    .collect()
            })
        })
        .collect();
    let mut per_rank = Vec::new();
    for handle in handles {
        per_rank.push(handle.join().map_err(|_| "a rank panicked".to_string())??);
    }
    // Every rank holds the same max-over-ranks timings; rank 0's are reported.
    let rank0 = per_rank.swap_remove(0);
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
        "| round | load | world | transition | bare collective | MiB | bare (ms) | bare + input copy (ms) | bare, warm output (ms) | `redistribute` (ms) | vs bare | vs warm | `into_redistribute` (ms) | vs bare | vs warm |"
    );
    println!(
        "|------:|-----:|------:|------------|-----------------|----:|----------:|-----------------------:|-----------------------:|--------------------:|--------:|--------:|-------------------------:|--------:|--------:|"
    );
    for row in &rows {
        let load = row.load_1m.map_or("?".to_string(), |l| format!("{l:.1}"));
        println!(
            "| {} | {} | {} | `{}` | {} | {} | {:.1} | {:.1} | {:.1} | {:.1} | {:+.1}% | {:+.1}% | {:.1} | {:+.1}% | {:+.1}% |",
            row.round,
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
