//! TP + FSDP (2-d) on the local (threads) backend: a Megatron MLP block (column-parallel
//! Linear → ReLU → row-parallel Linear, whose partial output is all-reduced over TP) under
//! `fully_shard` on a `[dp, tp]` mesh. Every TP-local shard is sharded again over the
//! data-parallel dim; the row-parallel bias (TP-replicated) has its reduced gradient
//! all-reduced over TP.
//!
//! ```text
//! cargo run -p hypershard --example tp_fsdp_mlp -- [--dp 2] [--tp 2] [--steps 5]
//! ```
//!
//! Each of the `dp × tp` ranks is a thread. The run trains `steps` SGD steps on a fixed
//! synthetic batch split over the data-parallel ranks, then checks the trained parameters
//! (gathered from the sharded state dict's DTensors) against the same MLP trained unsharded
//! on one rank, and exits with code 1 if the largest relative error exceeds 1e-5.

use std::collections::BTreeMap;
use std::sync::Arc;

use hypershard::collectives::Communicator;
use hypershard::dtensor::ProcessMesh;
use hypershard::fsdp::{
    DataParallelMesh, FsdpError, FullyShardConfig, TensorParallelConfig, TpLinear, fully_shard,
    fully_shard_children, has_params,
};
use hypershard::mesh::DeviceMesh;
use hypershard::nn::optim::{Sgd, SgdConfig};
use hypershard::nn::{Linear, LinearConfig, Module, Relu, Sequential, mse_loss};
use hypershard::tensor::{DType, RandomInit, Tensor};

/// Input, hidden and output sizes. The hidden size 13 divides by no TP size above 1, so the
/// TP pieces are uneven, and so are their data-parallel shards.
const IN: usize = 8;
const HIDDEN: usize = 13;
const OUT: usize = 4;
/// The global batch (divisible by data-parallel sizes 1, 2, 3, 4 and 6).
const BATCH: usize = 12;
const TOL: f64 = 1e-5;

fn layers() -> Result<(Linear, Linear), hypershard::nn::Error> {
    let up = Linear::new(LinearConfig {
        in_features: IN,
        out_features: HIDDEN,
        bias: true,
        dtype: DType::F32,
        seed: 11,
    })?;
    let down = Linear::new(LinearConfig {
        in_features: HIDDEN,
        out_features: OUT,
        bias: true,
        dtype: DType::F32,
        seed: 12,
    })?;
    Ok((up, down))
}

fn data() -> Result<(Tensor, Tensor), hypershard::tensor::Error> {
    let x = Tensor::random(&[BATCH, IN], DType::F32, RandomInit::uniform(1, -1.0, 1.0))?;
    let y = Tensor::random(&[BATCH, OUT], DType::F32, RandomInit::uniform(2, -1.0, 1.0))?;
    Ok((x, y))
}

fn sgd() -> Result<Sgd, hypershard::nn::Error> {
    Sgd::new(SgdConfig {
        lr: 0.1,
        momentum: 0.9,
        ..SgdConfig::default()
    })
}

type Params = BTreeMap<String, Vec<f64>>;

/// The unsharded run on one rank: parameters and per-step losses.
fn reference(steps: usize) -> Result<(Params, Vec<f64>), Box<dyn std::error::Error>> {
    let (up, down) = layers()?;
    let mut model = Sequential::new(vec![Box::new(up), Box::new(Relu::new()), Box::new(down)]);
    let mut optimizer = sgd()?;
    let (x, y) = data()?;
    let mut losses = Vec::new();
    for _ in 0..steps {
        let out = model.forward(&x)?;
        let loss = mse_loss(&out, &y)?;
        losses.push(loss.loss);
        model.backward(&loss.grad)?;
        optimizer.step(&mut model)?;
        hypershard::nn::zero_grad(&mut model)?;
    }
    let mut params = Params::new();
    model.visit_params("", &mut |name, p| {
        params.insert(name.to_string(), p.data()?.to_f64_vec()?);
        Ok(())
    })?;
    Ok((params, losses))
}

/// One rank of the `[dp, tp]` job: the trained parameters (gathered whole) and its local
/// loss per step.
fn rank_main(
    dp: usize,
    tp: usize,
    steps: usize,
    comm: Arc<dyn Communicator>,
) -> Result<(Params, Vec<f64>), FsdpError> {
    let world = ProcessMesh::new(DeviceMesh::new(&[dp, tp], &["dp", "tp"])?, comm)?;
    let tp_mesh = world.select(&["tp"])?;
    let dp_mesh = DataParallelMesh::from_process_mesh(world.select(&["dp"])?)?;
    let mut config = FullyShardConfig::new(dp_mesh.clone());
    config.tensor_parallel = Some(TensorParallelConfig::new(world.clone(), "tp"));

    // The TP layers cut the same full layers every rank builds: rows of `up`, columns of
    // `down`. Each becomes an FSDP unit; the block is the root.
    let (up, down) = layers()?;
    let mut block = Sequential::new(vec![
        Box::new(TpLinear::column(&up, &tp_mesh)?),
        Box::new(Relu::new()),
        Box::new(TpLinear::row(&down, &tp_mesh)?),
    ]);
    fully_shard_children(&mut block, &config, &mut |_, m| has_params(m))?;
    let mut model = fully_shard(Box::new(block), config)?;
    if world.rank() == 0 || world.rank() == world.shape().iter().product::<usize>() - 1 {
        for (index, unit) in model.units().iter().enumerate().skip(1) {
            for p in unit.params() {
                println!(
                    "rank {} unit {index}: {} global {:?} tp {:?} local shard {:?}",
                    world.rank(),
                    p.name,
                    p.global_shape,
                    p.tp_placement,
                    p.local_shape
                );
            }
        }
    }

    let mut optimizer = sgd()?;
    let (x, y) = data()?;
    let rows = BATCH / dp;
    let dp_rank = dp_mesh.shard_rank();
    let (x, y) = (
        x.narrow(0, dp_rank * rows, rows)?,
        y.narrow(0, dp_rank * rows, rows)?,
    );
    let mut losses = Vec::new();
    for _ in 0..steps {
        let out = model.forward(&x)?;
        let loss = mse_loss(&out, &y)?;
        losses.push(loss.loss);
        model.backward(&loss.grad)?;
        optimizer.step(&mut model)?;
        model.zero_grad()?;
    }

    // The sharded state dict: DTensors over the mesh ordered [tp, dp], global shapes.
    let mut params = Params::new();
    for (name, dtensor) in model.sharded_state_dict()? {
        if world.rank() == 0 {
            println!(
                "state dict {name}: global {:?} placements {:?} local {:?}",
                dtensor.shape(),
                dtensor.placements(),
                dtensor.to_local().shape()
            );
        }
        params.insert(name, dtensor.full_tensor()?.to_f64_vec()?);
    }
    Ok((params, losses))
}

fn arg(args: &[String], flag: &str, default: usize) -> Result<usize, String> {
    match args.iter().position(|a| a == flag) {
        Some(i) => args
            .get(i + 1)
            .and_then(|v| v.parse().ok())
            .filter(|v| *v > 0)
            .ok_or_else(|| format!("{flag} needs a positive integer")),
        None => Ok(default),
    }
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let dp = arg(&args, "--dp", 2)?;
    let tp = arg(&args, "--tp", 2)?;
    let steps = arg(&args, "--steps", 5)?;
    if !BATCH.is_multiple_of(dp) {
        return Err(format!("--dp {dp} must divide the batch of {BATCH}").into());
    }
    let (want, want_losses) = reference(steps)?;
    let comms = hypershard::collectives::local::spawn_world(dp * tp)?;
    let handles: Vec<_> = comms
        .into_iter()
        .map(|comm| std::thread::spawn(move || rank_main(dp, tp, steps, comm)))
        .collect();
    let mut results = Vec::new();
    for handle in handles {
        let result = handle.join().map_err(|_| "a rank panicked")??;
        results.push(result);
    }
    // The global loss is the mean of the data-parallel ranks' losses (TP ranks agree).
    for (step, want_loss) in want_losses.iter().enumerate() {
        let mean: f64 = (0..dp).map(|i| results[i * tp].1[step]).sum::<f64>() / dp as f64;
        println!("step {step}: loss {mean:.6} (unsharded {want_loss:.6})");
    }
    let mut worst = 0.0f64;
    for (params, _) in &results {
        for (name, values) in &want {
            let got = params.get(name).ok_or_else(|| format!("no {name}"))?;
            let scale = values.iter().fold(1e-12f64, |m, v| m.max(v.abs()));
            let diff = values
                .iter()
                .zip(got)
                .fold(0.0f64, |m, (a, b)| m.max((a - b).abs()));
            worst = worst.max(diff / scale);
        }
    }
    println!("dp {dp} x tp {tp}, {steps} steps: max relative error vs unsharded {worst:.3e}");
    if worst > TOL {
        eprintln!("parity lost: {worst:.3e} > {TOL:e}");
        std::process::exit(1);
    }
    Ok(())
}
