//! `cargo xtask bench fsdp`: a training step under `fully_shard` next to PyTorch FSDP2, and
//! fused against per-parameter collectives.
//!
//! ```text
//! bench-fsdp [--steps 20] [--warmup 5] [--fusion-reps 30] [--fusion-embd 128] [--no-torch]
//!            [--modes single,fsdp,hsdp,fusion] [--quick]
//! ```
//!
//! `--modes` picks which parts run (default: all four); profiling one mode alone is its use.
//!
//! `--quick` is the CI smoke (`cargo xtask bench --quick`): 2 timed steps after 1 warm-up per
//! mode and 2 fusion repetitions; the numbers mean nothing, the run checks that every mode
//! still trains. Later flags override its choices.
//!
//! Step = zero_grad + forward + backward + SGD step (lr 0.01) with MSE loss on
//! 8 × (Linear(1024, 1024) + ReLU), fp32, batch 32 per rank — the model and step of
//! `shared/bench/pytorch/bench_fsdp2.py`. Modes: `single` (one rank, no fully_shard), `fsdp`
//! (world 2) and `hsdp` (2 × 2). Ranks are **threads of this process**, each with its own
//! tcp communicator over 127.0.0.1 and a one-thread compute pool (torch runs one intra-op
//! thread per rank); `HYPERSHARD_TRANSPORT=shm` (or `auto`) moves the bulk data through the
//! tcp backend's shared-memory transport instead, and the JSON records which. Each step starts after a barrier and is timed as the max over ranks; the
//! median over `--steps` steps after `--warmup` is reported. `peak_rss_mib` is this process's
//! VmHWM after the mode ran, so for threads it covers every rank of the world together.
//!
//! The fusion part times one unit's forward + backward (all-gather, all-gather again,
//! reduce-scatter) for a GPT block's parameter list (LayerNorms, attention and MLP weights and
//! biases; `--fusion-embd` wide) at world 2 on tcp, fused (one collective per pass) against
//! one collective per parameter.
//!
//! PyTorch runs right after in the same sitting, with `$TORCH_VENV/bin/python` (default
//! `~/.cache/hypershard-bench/torch-venv`); without it (or with `--no-torch`) only our side is
//! reported. Output: `target/bench/fsdp.json` (`[{"mode", "world", "median_ms",
//! "peak_rss_mib", ...}]`).

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::{Command, ExitCode};
use std::sync::Arc;
use std::time::{Duration, Instant};

use hypershard_benches::{TimingStats, write_json};
use hypershard_collectives::tcp::{TcpCommunicator, TcpConfig};
use hypershard_collectives::{CommConfig, Communicator, MemoryStore, Store};
use hypershard_fsdp::{
    CommFusionPolicy, DataParallelMesh, FsdpModule, FullyShardConfig, fully_shard,
    fully_shard_children, has_params,
};
use hypershard_mesh::DeviceMesh;
use hypershard_nn::optim::{Sgd, SgdConfig};
use hypershard_nn::{
    Linear, LinearConfig, Module, ParamVisitor, ParamVisitorMut, Parameter, Relu, Sequential,
    mse_loss, with_num_threads, zero_grad,
};
use hypershard_tensor::{DType, RandomInit, Tensor};

type BoxError = Box<dyn std::error::Error + Send + Sync>;

#[derive(Debug, Clone)]
struct Args {
    steps: usize,
    warmup: usize,
    fusion_reps: usize,
    fusion_embd: usize,
    torch: bool,
    modes: Vec<String>,
}

const ALL_MODES: [&str; 4] = ["single", "fsdp", "hsdp", "fusion"];

impl Args {
    fn wants(&self, mode: &str) -> bool {
        self.modes.iter().any(|m| m == mode)
    }
}

fn parse_args() -> Result<Args, String> {
    let mut args = Args {
        steps: 20,
        warmup: 5,
        fusion_reps: 30,
        fusion_embd: 128,
        torch: true,
        modes: ALL_MODES.iter().map(|m| m.to_string()).collect(),
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = |name: &str| -> Result<usize, String> {
            it.next()
                .ok_or(format!("{name} needs a value"))?
                .parse()
                .map_err(|e| format!("{name}: {e}"))
        };
        match flag.as_str() {
            "--steps" => args.steps = value("--steps")?,
            "--warmup" => args.warmup = value("--warmup")?,
            "--fusion-reps" => args.fusion_reps = value("--fusion-reps")?,
            "--fusion-embd" => args.fusion_embd = value("--fusion-embd")?,
            "--no-torch" => args.torch = false,
            "--modes" => {
                let list = it.next().ok_or("--modes needs a value")?;
                args.modes = list.split(',').map(str::to_string).collect();
                if let Some(bad) = args.modes.iter().find(|m| !ALL_MODES.contains(&m.as_str())) {
                    return Err(format!(
                        "--modes: unknown mode {bad} (modes: {})",
                        ALL_MODES.join(",")
                    ));
                }
            }
            "--quick" => {
                args.steps = 2;
                args.warmup = 1;
                args.fusion_reps = 2;
            }
            other => return Err(format!("unknown flag {other}")),
        }
    }
    Ok(args)
}

const DEPTH: usize = 8;
const WIDTH: usize = 1024;
const BATCH: usize = 32;

fn model() -> Result<Sequential, BoxError> {
    let mut layers: Vec<Box<dyn Module>> = Vec::new();
    for i in 0..DEPTH {
        layers.push(Box::new(Linear::new(LinearConfig {
            in_features: WIDTH,
            out_features: WIDTH,
            bias: true,
            dtype: DType::F32,
            seed: 2 * i as u64,
        })?));
        layers.push(Box::new(Relu::new()));
    }
    Ok(Sequential::new(layers))
}

fn tcp_world(n: usize) -> Result<Vec<Arc<dyn Communicator>>, BoxError> {
    let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
    let tcp = TcpConfig::default().with_rendezvous_timeout(Duration::from_secs(30));
    let config = CommConfig::default().with_timeout(Duration::from_secs(120));
    let handles: Vec<_> = (0..n)
        .map(|rank| {
            let store = store.clone();
            let tcp = tcp.clone();
            let config = config.clone();
            std::thread::spawn(move || {
                TcpCommunicator::connect(store.as_ref(), rank, n, &tcp, config)
                    .map(|c| Arc::new(c) as Arc<dyn Communicator>)
            })
        })
        .collect();
    let mut comms = Vec::with_capacity(n);
    for handle in handles {
        let comm = handle.join().map_err(|_| "rendezvous thread panicked")??;
        comms.push(comm);
    }
    Ok(comms)
}

fn peak_rss_mib() -> f64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find(|l| l.starts_with("VmHWM:"))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|kb| kb.parse::<f64>().ok())
        .map_or(0.0, |kb| kb / 1024.0)
}

/// Runs `f(rank, comm)` for each rank on its own thread with a one-thread compute pool and
/// returns the per-rank results.
fn on_ranks<T: Send + 'static>(
    comms: Vec<Arc<dyn Communicator>>,
    f: impl Fn(usize, Arc<dyn Communicator>) -> Result<T, BoxError> + Send + Sync + 'static,
) -> Result<Vec<T>, BoxError> {
    let f = Arc::new(f);
    let handles: Vec<_> = comms
        .into_iter()
        .enumerate()
        .map(|(rank, comm)| {
            let f = f.clone();
            std::thread::spawn(move || -> Result<T, BoxError> {
                with_num_threads(1, || f(rank, comm))?
            })
        })
        .collect();
    let mut out = Vec::new();
    for handle in handles {
        out.push(handle.join().map_err(|_| "rank thread panicked")??);
    }
    Ok(out)
}

/// Step times of one rank.
fn train_steps(
    module: &mut dyn Module,
    step_fn: &mut dyn FnMut(&mut dyn Module) -> Result<(), BoxError>,
    barrier: &dyn Fn() -> Result<(), BoxError>,
    total: usize,
) -> Result<Vec<Duration>, BoxError> {
    let mut times = Vec::with_capacity(total);
    for _ in 0..total {
        barrier()?;
        let start = Instant::now();
        step_fn(module)?;
        times.push(start.elapsed());
    }
    Ok(times)
}

fn one_step(
    module: &mut dyn Module,
    sgd: &mut Sgd,
    x: &Tensor,
    y: &Tensor,
) -> Result<(), BoxError> {
    zero_grad(module)?;
    let out = module.forward(x)?;
    let loss = mse_loss(&out, y)?;
    module.backward(&loss.grad)?;
    sgd.step(module)?;
    Ok(())
}

fn data(rank: usize) -> Result<(Tensor, Tensor), BoxError> {
    let x = Tensor::random(
        &[BATCH, WIDTH],
        DType::F32,
        RandomInit::uniform(10 + rank as u64, -1.0, 1.0),
    )?;
    let y = Tensor::random(
        &[BATCH, WIDTH],
        DType::F32,
        RandomInit::uniform(20 + rank as u64, -1.0, 1.0),
    )?;
    Ok((x, y))
}

fn sgd() -> Result<Sgd, BoxError> {
    Ok(Sgd::new(SgdConfig {
        lr: 0.01,
        ..SgdConfig::default()
    })?)
}

/// Median over steps of the max over ranks, in ms.
fn median_of_max(per_rank: &[Vec<Duration>], warmup: usize) -> Option<TimingStats> {
    let steps = per_rank.iter().map(Vec::len).min()?;
    let maxima: Vec<Duration> = (warmup..steps)
        .map(|s| per_rank.iter().map(|r| r[s]).max().unwrap_or_default())
        .collect();
    TimingStats::from_samples(&maxima)
}

#[derive(Debug, Clone, serde::Serialize)]
struct Row {
    mode: String,
    world: usize,
    median_ms: f64,
    min_ms: f64,
    peak_rss_mib: f64,
    backend: &'static str,
    /// `HYPERSHARD_TRANSPORT` as the tcp backend read it (`tcp` when unset): `shm` or `auto`
    /// move bulk data through shared memory between these co-located ranks.
    transport: String,
    ranks_as: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    torch_median_ms: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    ratio_vs_torch: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    note: Option<String>,
}

fn run_single(args: &Args) -> Result<Row, BoxError> {
    let total = args.warmup + args.steps;
    let times = with_num_threads(1, || -> Result<Vec<Duration>, BoxError> {
        let mut m = model()?;
        let mut opt = sgd()?;
        let (x, y) = data(0)?;
        train_steps(
            &mut m,
            &mut |m| one_step(m, &mut opt, &x, &y),
            &|| Ok(()),
            total,
        )
    })??;
    let stats = median_of_max(&[times], args.warmup).ok_or("no samples")?;
    Ok(row("single", 1, stats))
}

/// The transport the tcp communicators use, from `HYPERSHARD_TRANSPORT` (default tcp).
fn transport() -> String {
    std::env::var("HYPERSHARD_TRANSPORT").unwrap_or_else(|_| "tcp".to_string())
}

fn row(mode: &str, world: usize, stats: TimingStats) -> Row {
    Row {
        mode: mode.to_string(),
        world,
        median_ms: stats.median_s * 1e3,
        min_ms: stats.min_s * 1e3,
        peak_rss_mib: peak_rss_mib(),
        backend: "tcp",
        transport: transport(),
        ranks_as: "threads",
        torch_median_ms: None,
        ratio_vs_torch: None,
        note: None,
    }
}

fn run_sharded(args: &Args, mesh_shape: Vec<usize>) -> Result<Row, BoxError> {
    let world: usize = mesh_shape.iter().product();
    let comms = tcp_world(world)?;
    let total = args.warmup + args.steps;
    let shape = mesh_shape.clone();
    let per_rank = on_ranks(comms, move |rank, comm| {
        let names: &[&str] = if shape.len() == 2 {
            &["dp_replicate", "dp_shard"]
        } else {
            &["dp_shard"]
        };
        let mesh = DataParallelMesh::new(DeviceMesh::new(&shape, names)?, comm.clone())?;
        let config = FullyShardConfig::new(mesh);
        let mut m = model()?;
        fully_shard_children(&mut m, &config, &mut |_, c| has_params(c))?;
        let mut root: FsdpModule = fully_shard(Box::new(m), config).map_err(|r| r.error)?;
        let mut opt = sgd()?;
        let (x, y) = data(rank)?;
        train_steps(
            &mut root,
            &mut |m| one_step(m, &mut opt, &x, &y),
            &|| Ok(comm.barrier()?),
            total,
        )
    })?;
    let stats = median_of_max(&per_rank, args.warmup).ok_or("no samples")?;
    let mode = if mesh_shape.len() == 2 {
        "hsdp"
    } else {
        "fsdp"
    };
    Ok(row(mode, world, stats))
}

/// A unit whose "compute" is nothing: forward is the identity and backward gives every
/// parameter a ready-made gradient of ones (built once, handed out as shared handles), so
/// only FSDP's collectives and copies are timed.
struct ParamBag {
    params: Vec<Parameter>,
    grads: Vec<Tensor>,
}

impl ParamBag {
    fn new(params: Vec<Parameter>) -> Result<Self, BoxError> {
        let grads = params
            .iter()
            .map(|p| Ok(Tensor::ones(p.data()?.shape(), DType::F32)?))
            .collect::<Result<_, BoxError>>()?;
        Ok(ParamBag { params, grads })
    }
}

impl Module for ParamBag {
    fn kind(&self) -> &'static str {
        "ParamBag"
    }
    fn forward(&mut self, input: &Tensor) -> hypershard_nn::Result<Tensor> {
        Ok(input.clone())
    }
    fn backward(&mut self, grad_output: &Tensor) -> hypershard_nn::Result<Tensor> {
        // FSDP only reads the gradient it takes off the parameter (it is packed into the
        // reduce-scatter input), so one tensor serves every repetition.
        for (p, g) in self.params.iter_mut().zip(&self.grads) {
            p.accumulate_grad(g.clone())?;
        }
        Ok(grad_output.clone())
    }
    fn visit_params(&self, prefix: &str, f: &mut ParamVisitor<'_>) -> hypershard_nn::Result<()> {
        for p in &self.params {
            f(&hypershard_nn::join_name(prefix, &p.name), p)?;
        }
        Ok(())
    }
    fn visit_params_mut(
        &mut self,
        prefix: &str,
        f: &mut ParamVisitorMut<'_>,
    ) -> hypershard_nn::Result<()> {
        for p in &mut self.params {
            let name = hypershard_nn::join_name(prefix, &p.name);
            f(&name, p)?;
        }
        Ok(())
    }
}

/// The parameter list of one GPT-2 block of width `e` (nanoGPT names and shapes).
fn gpt_block_params(e: usize) -> Result<Vec<Parameter>, BoxError> {
    let shapes: [(&str, Vec<usize>); 12] = [
        ("ln_1.weight", vec![e]),
        ("ln_1.bias", vec![e]),
        ("attn.c_attn.weight", vec![3 * e, e]),
        ("attn.c_attn.bias", vec![3 * e]),
        ("attn.c_proj.weight", vec![e, e]),
        ("attn.c_proj.bias", vec![e]),
        ("ln_2.weight", vec![e]),
        ("ln_2.bias", vec![e]),
        ("mlp.c_fc.weight", vec![4 * e, e]),
        ("mlp.c_fc.bias", vec![4 * e]),
        ("mlp.c_proj.weight", vec![e, 4 * e]),
        ("mlp.c_proj.bias", vec![e]),
    ];
    shapes
        .into_iter()
        .enumerate()
        .map(|(i, (name, shape))| {
            let t = Tensor::random(&shape, DType::F32, RandomInit::uniform(i as u64, -0.1, 0.1))?;
            Ok(Parameter::new(name, t))
        })
        .collect()
}

fn run_fusion(args: &Args, fused: bool) -> Result<(TimingStats, usize), BoxError> {
    let comms = tcp_world(2)?;
    let reps = args.fusion_reps;
    let embd = args.fusion_embd;
    let numel = gpt_block_params(embd)?
        .iter()
        .map(|p| p.data().map(|d| d.numel()).unwrap_or(0))
        .sum();
    let per_rank = on_ranks(comms, move |_, comm| {
        let mesh = DataParallelMesh::fsdp(comm.clone())?;
        let mut config = FullyShardConfig::new(mesh);
        config.comm_fusion = CommFusionPolicy {
            enabled: fused,
            ..CommFusionPolicy::default()
        };
        // The bag is a nested unit under a parameterless root, so it reshards after forward
        // and its backward all-gathers again, as every non-root unit does.
        let bag = ParamBag::new(gpt_block_params(embd)?)?;
        let unit = fully_shard(Box::new(bag), config.clone()).map_err(|r| r.error)?;
        let mut root = fully_shard(Box::new(Sequential::new(vec![Box::new(unit)])), config)
            .map_err(|r| r.error)?;
        let x = Tensor::ones(&[1, 4], DType::F32)?;
        let mut times = Vec::new();
        for _ in 0..reps + 3 {
            comm.barrier()?;
            let start = Instant::now();
            let y = root.forward(&x)?;
            root.backward(&y)?;
            root.zero_grad()?;
            times.push(start.elapsed());
        }
        Ok(times)
    })?;
    let stats = median_of_max(&per_rank, 3).ok_or("no samples")?;
    Ok((stats, numel))
}

#[derive(Debug, Clone, serde::Serialize)]
struct FusionRow {
    mode: String,
    world: usize,
    median_ms: f64,
    peak_rss_mib: f64,
    params: usize,
    numel: usize,
    fused_speedup: Option<f64>,
    transport: String,
}

/// The PyTorch median step (ms, max over ranks) per mode, from `bench_fsdp2.py --csv`.
fn run_torch(args: &Args) -> Result<Option<BTreeMap<String, f64>>, BoxError> {
    if !args.torch {
        return Ok(None);
    }
    let venv = std::env::var_os("TORCH_VENV")
        .map(PathBuf::from)
        .or_else(|| {
            std::env::var_os("HOME")
                .map(|h| PathBuf::from(h).join(".cache/hypershard-bench/torch-venv"))
        });
    let Some(python) = venv.map(|v| v.join("bin/python")).filter(|p| p.exists()) else {
        eprintln!("bench-fsdp: no torch venv (set TORCH_VENV); reporting our side only");
        return Ok(None);
    };
    let script =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../shared/bench/pytorch/bench_fsdp2.py");
    let script = if script.exists() {
        script
    } else {
        PathBuf::from("/work/shared/bench/pytorch/bench_fsdp2.py")
    };
    let mut medians = BTreeMap::new();
    for mode in ["single", "fsdp2", "hsdp"] {
        let ours = if mode == "fsdp2" { "fsdp" } else { mode };
        if !args.wants(ours) {
            continue;
        }
        let csv = std::env::temp_dir().join(format!("bench-fsdp-torch-{mode}.csv"));
        let output = Command::new(&python)
            .arg(&script)
            .args(["--mode", mode])
            .args(["--steps", &args.steps.to_string()])
            .args(["--warmup", &args.warmup.to_string()])
            .arg("--csv")
            .arg(&csv)
            .env("OMP_NUM_THREADS", "1")
            .env("GLOO_SOCKET_IFNAME", "lo")
            .output()?;
        if !output.status.success() {
            eprintln!(
                "bench-fsdp: torch {mode} failed: {}",
                String::from_utf8_lossy(&output.stderr)
            );
            continue;
        }
        let text = std::fs::read_to_string(&csv)?;
        let mut lines = text.lines();
        let header: Vec<&str> = lines.next().unwrap_or_default().split(',').collect();
        let col = |name: &str| header.iter().position(|h| *h == name);
        let (Some(median), Some(threads), Some(batch), Some(status)) = (
            col("median_ms"),
            col("threads"),
            col("batch"),
            col("status"),
        ) else {
            continue;
        };
        let mut best: Option<f64> = None;
        for line in lines {
            let cells: Vec<&str> = line.split(',').collect();
            if cells.get(status) != Some(&"ok")
                || cells.get(threads) != Some(&"1")
                || cells.get(batch) != Some(&"32")
            {
                continue;
            }
            if let Some(v) = cells.get(median).and_then(|c| c.parse::<f64>().ok()) {
                // Max over ranks, as our side reports.
                best = Some(best.map_or(v, |b: f64| b.max(v)));
            }
        }
        if let Some(v) = best {
            medians.insert(ours.to_string(), v);
        }
    }
    Ok(Some(medians))
}

fn run(args: &Args) -> Result<(), BoxError> {
    let mut rows = Vec::new();
    if args.wants("single") {
        rows.push(run_single(args)?);
        println!("single: {:.1} ms", rows[rows.len() - 1].median_ms);
    }
    if args.wants("fsdp") {
        rows.push(run_sharded(args, vec![2])?);
        println!("fsdp w2: {:.1} ms", rows[rows.len() - 1].median_ms);
    }
    if args.wants("hsdp") {
        rows.push(run_sharded(args, vec![2, 2])?);
        println!("hsdp 2x2: {:.1} ms", rows[rows.len() - 1].median_ms);
    }

    let mut fusion = None;
    if args.wants("fusion") {
        let (fused, numel) = run_fusion(args, true)?;
        let (unfused, _) = run_fusion(args, false)?;
        let speedup = unfused.median_s / fused.median_s;
        println!(
            "GPT block ({numel} params, 12 tensors) at world 2: fused {:.2} ms, per-parameter {:.2} ms ({speedup:.2}x)",
            fused.median_s * 1e3,
            unfused.median_s * 1e3
        );
        fusion = Some((fused, unfused, numel, speedup));
    }

    if let Some(torch) = run_torch(args)? {
        for row in &mut rows {
            if let Some(&t) = torch.get(&row.mode) {
                row.torch_median_ms = Some(t);
                row.ratio_vs_torch = Some(row.median_ms / t);
            }
        }
    }
    for row in &rows {
        println!(
            "| {} | {} | {:.1} | {} | {} | {:.0} |",
            row.mode,
            row.world,
            row.median_ms,
            row.torch_median_ms
                .map_or("-".to_string(), |t| format!("{t:.1}")),
            row.ratio_vs_torch
                .map_or("-".to_string(), |r| format!("{r:.2}")),
            row.peak_rss_mib
        );
    }
    let fusion_rows: Vec<FusionRow> = fusion
        .map(|(fused, unfused, numel, speedup)| {
            [
                ("fusion_fused", fused, Some(speedup)),
                ("fusion_per_param", unfused, None),
            ]
            .map(|(mode, stats, fused_speedup)| FusionRow {
                mode: mode.to_string(),
                world: 2,
                median_ms: stats.median_s * 1e3,
                peak_rss_mib: peak_rss_mib(),
                params: 12,
                numel,
                fused_speedup,
                transport: transport(),
            })
            .to_vec()
        })
        .unwrap_or_default();
    let mut json: Vec<serde_json::Value> = rows
        .iter()
        .map(serde_json::to_value)
        .collect::<Result<_, _>>()?;
    for f in &fusion_rows {
        json.push(serde_json::to_value(f)?);
    }
    let path = write_json("fsdp", &json)?;
    println!("wrote {}", path.display());
    Ok(())
}

fn main() -> ExitCode {
    let args = match parse_args() {
        Ok(args) => args,
        Err(e) => {
            eprintln!("bench-fsdp: {e}");
            return ExitCode::FAILURE;
        }
    };
    match run(&args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("bench-fsdp: {e}");
            ExitCode::FAILURE
        }
    }
}
