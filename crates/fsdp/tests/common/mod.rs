//! Shared fixtures: small MLPs, deterministic data, an unsharded reference run and helpers to
//! run a sharded one on N local (or tcp) ranks and reassemble its parameters.

#![allow(dead_code)]

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use hypershard_collectives::tcp::{TcpCommunicator, TcpConfig};
use hypershard_collectives::{CommConfig, CommCounter, Communicator, MemoryStore, Store};
use hypershard_fsdp::{
    DataParallelMesh, FsdpError, FsdpModule, FullyShardConfig, fully_shard, fully_shard_children,
    has_params,
};
use hypershard_mesh::{DeviceMesh, shard_span};
use hypershard_nn::optim::{AdamW, AdamWConfig, Sgd, SgdConfig};
use hypershard_nn::{Linear, LinearConfig, Module, Relu, Sequential, mse_loss};
use hypershard_tensor::{DType, Device, RandomInit, Tensor};

/// The devices every test body runs on: the host, and the emulated device (host memory
/// reachable only through the device API, stream order checked), where the same values must
/// come out.
pub const DEVICES: [Device; 2] = [Device::Cpu, Device::Emulated { ordinal: 0 }];

/// The device rank `rank` uses when the run is on `device`: the host, or a device of its own
/// (ordinal = rank), one GPU per rank.
pub fn rank_device(device: Device, rank: usize) -> Device {
    match device {
        Device::Cpu => Device::Cpu,
        #[cfg(feature = "cuda")]
        Device::Cuda { .. } => Device::Cuda { ordinal: rank },
        _ => Device::Emulated { ordinal: rank },
    }
}

/// Runs `body` once on the host and once on the emulated device and returns both results
/// (host first).
pub fn on_both<R>(body: impl Fn(Device) -> R) -> Vec<R> {
    DEVICES.iter().map(|&device| body(device)).collect()
}

/// `t` on `device` (no copy when it is there already).
pub fn on(t: &Tensor, device: Device) -> Tensor {
    t.to_device(&device)
        .expect("invariant: a host tensor moves to any device")
}

/// A module's parameters moved to `device`.
pub fn moved<M: Module>(mut module: M, device: Device) -> M {
    hypershard_nn::to_device(&mut module, &device).expect("invariant: the module moves");
    module
}

/// The global batch: divisible by 1, 2, 3 and 4 ranks.
pub const BATCH: usize = 12;

/// An MLP `dims[0] → dims[1] → …` with ReLU between layers, in `dtype`.
pub fn mlp(dims: &[usize], dtype: DType) -> Sequential {
    let mut layers: Vec<Box<dyn Module>> = Vec::new();
    for (i, pair) in dims.windows(2).enumerate() {
        let linear = Linear::new(LinearConfig {
            in_features: pair[0],
            out_features: pair[1],
            bias: true,
            dtype,
            seed: 100 + 2 * i as u64,
        })
        .expect("invariant: valid layer sizes");
        layers.push(Box::new(linear));
        if i + 2 < dims.len() {
            layers.push(Box::new(Relu::new()));
        }
    }
    Sequential::new(layers)
}

/// Input and target of micro-batch `step` (the whole global batch).
pub fn batch(step: usize, in_dim: usize, out_dim: usize, dtype: DType) -> (Tensor, Tensor) {
    let x = Tensor::random(
        &[BATCH, in_dim],
        dtype,
        RandomInit::uniform(7 + step as u64, -1.0, 1.0),
    )
    .expect("invariant: valid shape");
    let y = Tensor::random(
        &[BATCH, out_dim],
        dtype,
        RandomInit::uniform(1000 + step as u64, -1.0, 1.0),
    )
    .expect("invariant: valid shape");
    (x, y)
}

/// Rows of the global batch that data-parallel rank `dp_rank` of `dp_world` trains on.
pub fn local_rows(t: &Tensor, dp_rank: usize, dp_world: usize) -> Tensor {
    let rows = BATCH / dp_world;
    t.narrow(0, dp_rank * rows, rows)
        .expect("invariant: batch divisible")
}

#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Opt {
    Sgd,
    AdamW,
}

pub enum Optimizer {
    Sgd(Sgd),
    AdamW(AdamW),
}

impl Optimizer {
    pub fn new(kind: Opt) -> Self {
        match kind {
            Opt::Sgd => Optimizer::Sgd(
                Sgd::new(SgdConfig {
                    lr: 0.1,
                    momentum: 0.9,
                    ..SgdConfig::default()
                })
                .expect("invariant: valid config"),
            ),
            Opt::AdamW => Optimizer::AdamW(
                AdamW::new(AdamWConfig {
                    lr: 0.01,
                    ..AdamWConfig::default()
                })
                .expect("invariant: valid config"),
            ),
        }
    }

    pub fn step(&mut self, module: &mut dyn Module) -> hypershard_nn::Result<()> {
        match self {
            Optimizer::Sgd(o) => o.step(module),
            Optimizer::AdamW(o) => o.step(module),
        }
    }
}

/// Parameters by full name, as f64.
pub type Params = BTreeMap<String, (Vec<usize>, Vec<f64>)>;

pub fn params_of(module: &dyn Module) -> Params {
    let mut out = Params::new();
    module
        .visit_params("", &mut |name, p| {
            // Read on the host whatever the device (one explicit copy).
            let data = p.data()?.to_host()?;
            out.insert(
                name.to_string(),
                (data.shape().to_vec(), data.to_f64_vec()?),
            );
            Ok(())
        })
        .expect("invariant: materialised parameters");
    out
}

/// The unsharded run: `steps` steps of `micro` accumulated micro-batches on one rank.
pub fn reference(dims: &[usize], dtype: DType, opt: Opt, steps: usize, micro: usize) -> Params {
    let mut model = mlp(dims, dtype);
    let mut optimizer = Optimizer::new(opt);
    let out_dim = dims[dims.len() - 1];
    for step in 0..steps {
        for m in 0..micro {
            let (x, y) = batch(step * micro + m, dims[0], out_dim, dtype);
            let out = model.forward(&x).expect("forward");
            let loss = mse_loss(&out, &y).expect("loss");
            model.backward(&loss.grad).expect("backward");
        }
        optimizer.step(&mut model).expect("step");
        hypershard_nn::zero_grad(&mut model).expect("zero_grad");
    }
    params_of(&model)
}

/// Wraps every Linear of `model` as a unit and then the whole model as the root.
pub fn shard_model(model: Sequential, config: &FullyShardConfig) -> Result<FsdpModule, FsdpError> {
    let mut model = model;
    fully_shard_children(&mut model, config, &mut |_, m| has_params(m))?;
    Ok(fully_shard(Box::new(model), config.clone())?)
}

/// One rank's result: its local parameters and its data-parallel coordinates.
pub struct RankResult {
    pub params: Params,
    pub shard_rank: usize,
    pub replicate_rank: usize,
    pub extra: Vec<u64>,
}

/// Reassembles full parameters from the shards of replica 0 (`shard_dim` per name).
pub fn assemble(
    results: &[RankResult],
    shard_dim: &dyn Fn(&str) -> usize,
    replicated: &dyn Fn(&str) -> bool,
) -> Params {
    let mut shards: Vec<&RankResult> = results.iter().filter(|r| r.replicate_rank == 0).collect();
    shards.sort_by_key(|r| r.shard_rank);
    let mut out = Params::new();
    for name in shards[0].params.keys() {
        if replicated(name) {
            out.insert(name.clone(), shards[0].params[name].clone());
            continue;
        }
        let dim = shard_dim(name);
        let pieces: Vec<Tensor> = shards
            .iter()
            .map(|r| {
                let (shape, values) = &r.params[name];
                Tensor::from_vec(values.clone(), shape).expect("invariant: consistent shard")
            })
            .collect();
        let refs: Vec<&Tensor> = pieces.iter().filter(|t| t.numel() > 0).collect();
        let full = Tensor::cat(&refs, dim).expect("shards concatenate");
        out.insert(
            name.clone(),
            (full.shape().to_vec(), full.to_f64_vec().expect("f64")),
        );
    }
    out
}

/// Checks the shard shapes follow torch.chunk (shard `k` of `n` holds its span).
pub fn check_shard_shapes(
    results: &[RankResult],
    reference: &Params,
    shard_dim: &dyn Fn(&str) -> usize,
    replicated: &dyn Fn(&str) -> bool,
) {
    let shard_world = results.iter().map(|r| r.shard_rank).max().unwrap_or(0) + 1;
    for r in results {
        for (name, (shape, _)) in &r.params {
            let (global, _) = &reference[name];
            if replicated(name) {
                assert_eq!(shape, global, "{name}");
                continue;
            }
            let dim = shard_dim(name);
            let span = shard_span(global[dim], shard_world, r.shard_rank).expect("span");
            let mut expected = global.clone();
            expected[dim] = span.len;
            assert_eq!(shape, &expected, "{name} on shard rank {}", r.shard_rank);
        }
    }
}

/// max |a − b| / max |b| over every parameter.
pub fn max_rel_err(got: &Params, want: &Params) -> f64 {
    assert_eq!(
        got.keys().collect::<Vec<_>>(),
        want.keys().collect::<Vec<_>>()
    );
    let mut worst: f64 = 0.0;
    for (name, (shape, values)) in want {
        let (got_shape, got_values) = &got[name];
        assert_eq!(got_shape, shape, "{name}");
        let scale = values.iter().fold(0.0f64, |m, v| m.max(v.abs())).max(1e-12);
        let diff = values
            .iter()
            .zip(got_values)
            .fold(0.0f64, |m, (a, b)| m.max((a - b).abs()));
        worst = worst.max(diff / scale);
    }
    worst
}

/// A local world, each communicator wrapped in a counter.
pub fn counted_world(n: usize) -> Vec<Arc<CommCounter>> {
    hypershard_collectives::local::spawn_world(n)
        .expect("local world")
        .into_iter()
        .map(CommCounter::new)
        .collect()
}

/// A tcp world over 127.0.0.1 (each rank a thread of this process).
pub fn tcp_world(n: usize) -> Vec<Arc<dyn Communicator>> {
    let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
    let tcp = TcpConfig::default().with_rendezvous_timeout(Duration::from_secs(20));
    let config = CommConfig::default().with_timeout(Duration::from_secs(60));
    hypershard_testkit::run_ranks(n, move |rank| {
        TcpCommunicator::connect(store.as_ref(), rank, n, &tcp, config.clone())
            .map(|comm| Arc::new(comm) as Arc<dyn Communicator>)
    })
    .expect("tcp world")
}

/// The mesh for `shape` ([w] or [r, s]) over `comm`.
pub fn dp_mesh(
    shape: &[usize],
    comm: Arc<dyn Communicator>,
) -> Result<Arc<DataParallelMesh>, FsdpError> {
    let names: &[&str] = if shape.len() == 2 {
        &["dp_replicate", "dp_shard"]
    } else {
        &["dp_shard"]
    };
    let mesh = DeviceMesh::new(shape, names)?;
    DataParallelMesh::new(mesh, comm)
}

/// How a sharded training run is set up.
pub struct Run {
    pub dims: Vec<usize>,
    pub dtype: DType,
    pub opt: Opt,
    pub steps: usize,
    /// Micro-batches per step; all but the last run with the given `accumulate` control.
    pub micro: usize,
    pub mesh_shape: Vec<usize>,
}

/// A hook to tweak the config and the wrapped model per rank.
pub type Configure = dyn Fn(&mut FullyShardConfig) + Send + Sync;
/// Called before each micro-batch with (model, micro index, is last micro).
pub type MicroHook = dyn Fn(&mut FsdpModule, usize, bool) + Send + Sync;

/// Trains `run` on `comm` (this rank's world communicator) on the host; returns the local
/// parameters.
pub fn train_rank(
    run: &Run,
    comm: Arc<dyn Communicator>,
    configure: &Configure,
    micro_hook: &MicroHook,
) -> Result<RankResult, FsdpError> {
    train_rank_on(run, comm, Device::Cpu, configure, micro_hook)
}

/// [`train_rank`] with the model, the data and therefore every shard, gradient and bucket on
/// `device` (moved there before sharding, as a user would).
pub fn train_rank_on(
    run: &Run,
    comm: Arc<dyn Communicator>,
    device: Device,
    configure: &Configure,
    micro_hook: &MicroHook,
) -> Result<RankResult, FsdpError> {
    let mesh = dp_mesh(&run.mesh_shape, comm)?;
    let mut config = FullyShardConfig::new(mesh.clone());
    configure(&mut config);
    let device = rank_device(device, mesh.rank());
    let mut model = shard_model(moved(mlp(&run.dims, run.dtype), device), &config)?;
    let mut optimizer = Optimizer::new(run.opt);
    let dp_world = mesh.world().size();
    let dp_rank = mesh.rank();
    let out_dim = run.dims[run.dims.len() - 1];
    for step in 0..run.steps {
        for m in 0..run.micro {
            micro_hook(&mut model, m, m + 1 == run.micro);
            let (x, y) = batch(step * run.micro + m, run.dims[0], out_dim, run.dtype);
            let (x, y) = (
                on(&local_rows(&x, dp_rank, dp_world), device),
                on(&local_rows(&y, dp_rank, dp_world), device),
            );
            let out = model.forward(&x)?;
            let loss = mse_loss(&out, &y)?;
            model.backward(&loss.grad)?;
        }
        optimizer.step(&mut model)?;
        model.zero_grad()?;
    }
    let replicate_rank = mesh.replicate().map_or(0, |c| c.rank());
    Ok(RankResult {
        params: params_of(&model),
        shard_rank: mesh.shard_rank(),
        replicate_rank,
        extra: Vec::new(),
    })
}

/// Runs `run` on a local world of the mesh's size and returns every rank's result: on the
/// host and again on the emulated device, whose parameters must equal the host run's
/// exactly (the same values in the same order of operations); the host results come back.
pub fn train_world(
    run: Run,
    configure: Arc<Configure>,
    micro_hook: Arc<MicroHook>,
) -> Vec<RankResult> {
    let run = Arc::new(run);
    let mut both = on_both(|device| train_world_on(&run, device, &configure, &micro_hook));
    let device_run = both.pop().expect("invariant: two runs");
    let host_run = both.pop().expect("invariant: two runs");
    assert_same_results(&host_run, &device_run);
    host_run
}

/// Fails unless two runs left every rank with equal parameters.
pub fn assert_same_results(host: &[RankResult], device: &[RankResult]) {
    assert_eq!(host.len(), device.len());
    for (rank, (h, d)) in host.iter().zip(device).enumerate() {
        assert_eq!(
            h.params, d.params,
            "rank {rank}: the emulated device's run differs from the host's"
        );
    }
}

/// Runs `run` on a local world with every rank's model on `device` (see [`rank_device`]).
pub fn train_world_on(
    run: &Arc<Run>,
    device: Device,
    configure: &Arc<Configure>,
    micro_hook: &Arc<MicroHook>,
) -> Vec<RankResult> {
    let world: usize = run.mesh_shape.iter().product();
    let comms = hypershard_collectives::local::spawn_world(world).expect("local world");
    let (run, configure, micro_hook) = (run.clone(), configure.clone(), micro_hook.clone());
    hypershard_testkit::run_ranks(world, move |rank| {
        train_rank_on(
            &run,
            comms[rank].clone(),
            device,
            configure.as_ref(),
            micro_hook.as_ref(),
        )
    })
    .unwrap_or_else(|e| panic!("sharded run on {device:?} failed: {e}"))
}

pub fn dim0(_: &str) -> usize {
    0
}

pub fn none(_: &str) -> bool {
    false
}
