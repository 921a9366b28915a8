//! Your own model under `fully_shard`: a user-defined `Module` (a residual MLP block with
//! LayerNorm, built from `nn` layers) trained with HSDP on a 2 x 2 mesh (2 replicas of 2
//! shards), bf16 parameters with f32 gradient reduction, gradient accumulation over
//! micro-batches, and a sharded checkpoint that is saved, reloaded into a fresh model and
//! checked equal. See `docs/guide/own-model.md`.
//!
//! ```text
//! cargo build -p hypershard --example own_model
//! hypershard launch --nproc-per-node 4 -- target/debug/examples/own_model --out /tmp/own
//! target/debug/examples/own_model --reference --load /tmp/own   # one process, unsharded f32
//! ```
//!
//! Launched, every rank trains its quarter of each micro-batch; rank 0 prints the global loss
//! of every step, then the checkpoint lines. `--reference` trains the same model on the same
//! data in one process, unsharded and in f32, and prints the same loss lines; with `--load DIR`
//! it then loads the launched run's checkpoint (saved by 4 ranks) and prints the checksum of
//! its parameters, which must equal the launched run's.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use hypershard::checkpoint::{
    Block, BlockSpec, Checkpoint, CheckpointDir, CommitInfo, ShardWriter,
};
use hypershard::collectives::{Communicator, CommunicatorExt, ReduceOp, init_default_from_env};
use hypershard::dtensor::{DTensor, Placement};
use hypershard::fsdp::{
    DataParallelMesh, FsdpModule, FullyShardConfig, MixedPrecisionPolicy, fully_shard,
    fully_shard_children, has_params,
};
use hypershard::mesh::local_block;
use hypershard::nn::optim::{Sgd, SgdConfig};
use hypershard::nn::{
    ChildVisitorMut, Gelu, GeluApproximation, LayerNorm, LayerNormConfig, Linear, LinearConfig,
    Module, ParamVisitor, ParamVisitorMut, Sequential, join_name, mse_loss,
};
use hypershard::tensor::{DType, RandomInit, Tensor};

type AnyResult<T> = Result<T, Box<dyn std::error::Error + Send + Sync>>;

/// Feature width, hidden width of each block, output width.
const WIDTH: usize = 16;
const HIDDEN: usize = 32;
const OUT: usize = 4;
/// Residual blocks before the output layer.
const BLOCKS: usize = 2;
/// Rows of one optimizer step; split into `MICRO` micro-batches, each split over the ranks.
const BATCH: usize = 32;
const MICRO: usize = 2;
const STEPS: usize = 8;
/// Replicas of the HSDP mesh (the rest of the world shards each replica).
const REPLICAS: usize = 2;
const STEP_TAG: u64 = STEPS as u64;

/// `x + down(gelu(up(norm(x))))`: a pre-norm residual MLP block. The layers sit in one
/// `Sequential` child named `body`, so `fully_shard` sees the block's parameters as
/// `body.0.weight`, ... and could wrap the body on its own.
struct ResidualMlp {
    body: Box<dyn Module>,
}

impl ResidualMlp {
    fn new(seed: u64) -> AnyResult<ResidualMlp> {
        let norm = LayerNorm::new(LayerNormConfig {
            normalized_shape: WIDTH,
            eps: 1e-5,
            bias: true,
            dtype: DType::F32,
        })?;
        let up = Linear::new(LinearConfig {
            in_features: WIDTH,
            out_features: HIDDEN,
            bias: true,
            dtype: DType::F32,
            seed,
        })?;
        let down = Linear::new(LinearConfig {
            in_features: HIDDEN,
            out_features: WIDTH,
            bias: true,
            dtype: DType::F32,
            seed: seed + 1,
        })?;
        let body = Sequential::new(vec![
            Box::new(norm),
            Box::new(up),
            Box::new(Gelu::new(GeluApproximation::Tanh)),
            Box::new(down),
        ]);
        Ok(ResidualMlp {
            body: Box::new(body),
        })
    }
}

impl Module for ResidualMlp {
    fn kind(&self) -> &'static str {
        "ResidualMlp"
    }

    fn forward(&mut self, input: &Tensor) -> hypershard::nn::Result<Tensor> {
        let branch = self.body.forward(input)?;
        Ok(input.add(&branch)?)
    }

    fn backward(&mut self, grad_output: &Tensor) -> hypershard::nn::Result<Tensor> {
        // d(x + f(x)) = g + f'(x)ᵀ g: the skip path passes the gradient through unchanged.
        let through_branch = self.body.backward(grad_output)?;
        Ok(grad_output.add(&through_branch)?)
    }

    fn visit_params(&self, prefix: &str, f: &mut ParamVisitor<'_>) -> hypershard::nn::Result<()> {
        self.body.visit_params(&join_name(prefix, "body"), f)
    }

    fn visit_params_mut(
        &mut self,
        prefix: &str,
        f: &mut ParamVisitorMut<'_>,
    ) -> hypershard::nn::Result<()> {
        self.body.visit_params_mut(&join_name(prefix, "body"), f)
    }

    fn visit_children_mut(&mut self, f: &mut ChildVisitorMut<'_>) -> hypershard::nn::Result<()> {
        f("body", &mut self.body)
    }
}

/// The model: `BLOCKS` residual blocks, then a Linear to `OUT`. `seed` picks the initial
/// weights (the reload check builds a second model from another seed).
fn model(seed: u64) -> AnyResult<Sequential> {
    let mut layers: Vec<Box<dyn Module>> = Vec::new();
    for block in 0..BLOCKS as u64 {
        layers.push(Box::new(ResidualMlp::new(seed + 10 * block)?));
    }
    layers.push(Box::new(Linear::new(LinearConfig {
        in_features: WIDTH,
        out_features: OUT,
        bias: true,
        dtype: DType::F32,
        seed: seed + 100,
    })?));
    Ok(Sequential::new(layers))
}

fn sgd() -> AnyResult<Sgd> {
    Ok(Sgd::new(SgdConfig {
        lr: 0.05,
        momentum: 0.9,
        ..SgdConfig::default()
    })?)
}

/// Micro-batch `micro` of step `step`: inputs and regression targets, drawn by global index
/// so every run (any world size) sees the same rows.
fn micro_batch(step: usize, micro: usize) -> AnyResult<(Tensor, Tensor)> {
    let rows = BATCH / MICRO;
    let seed = 1000 + (step * MICRO + micro) as u64 * 2;
    let x = Tensor::random(
        &[rows, WIDTH],
        DType::F32,
        RandomInit::normal(seed, 0.0, 1.0),
    )?;
    // A fixed teacher: the targets are a smooth function of the first OUT features.
    let y = x.narrow(1, 0, OUT)?.scale(0.5)?;
    let noise = Tensor::random(
        &[rows, OUT],
        DType::F32,
        RandomInit::normal(seed + 1, 0.0, 0.1),
    )?;
    Ok((x, y.add(&noise)?))
}

/// The sum of every parameter value, name by name in sorted order, in f64: equal for equal
/// parameters whatever the world size that holds them.
fn checksum(params: &BTreeMap<String, Vec<f64>>) -> f64 {
    params.values().flat_map(|v| v.iter()).sum()
}

/// `--reference`: the same training in one process, unsharded, f32; then, with `--load`,
/// the checksum of the launched run's checkpoint loaded into the unsharded model.
fn reference(load: Option<&Path>) -> AnyResult<()> {
    let mut model = model(1)?;
    let mut optimizer = sgd()?;
    for step in 0..STEPS {
        let mut loss = 0.0;
        for micro in 0..MICRO {
            let (x, y) = micro_batch(step, micro)?;
            let out = model.forward(&x)?;
            let micro_loss = mse_loss(&out, &y)?;
            loss += micro_loss.loss / MICRO as f64;
            model.backward(&micro_loss.grad.scale(1.0 / MICRO as f64)?)?;
        }
        optimizer.step(&mut model)?;
        hypershard::nn::zero_grad(&mut model)?;
        println!("step {step} loss {loss:.9}");
    }
    if let Some(dir) = load {
        let checkpoint = Checkpoint::open(dir)?;
        let mut tensors = BTreeMap::new();
        for name in hypershard::nn::parameter_names(&model)? {
            let tensor = checkpoint.read_tensor(&name)?;
            tensors.insert(name, tensor);
        }
        hypershard::nn::checkpoint::load_state_dict(&mut model, &tensors)?;
        let mut params = BTreeMap::new();
        model.visit_params("", &mut |name, p| {
            params.insert(name.to_string(), p.data()?.to_f64_vec()?);
            Ok(())
        })?;
        println!(
            "loaded {} tensors saved by the launched run: checksum {:.17e}",
            params.len(),
            checksum(&params)
        );
    }
    Ok(())
}

/// Saves the sharded state dict as step `STEP_TAG` under `root`: every rank writes its
/// blocks; of the HSDP replicas of a block only replica 0 writes it. Collective.
fn save(
    world: &Arc<dyn Communicator>,
    root: &CheckpointDir,
    state: &BTreeMap<String, DTensor>,
) -> AnyResult<()> {
    let rank = world.rank();
    if rank == 0 {
        root.prepare_staging(STEP_TAG)?;
    }
    world.barrier()?;
    let mut writer = ShardWriter::new(root.staging_dir(STEP_TAG), rank);
    for (name, tensor) in state {
        let mesh = tensor.process_mesh();
        let writes = tensor
            .placements()
            .iter()
            .zip(mesh.coordinate())
            .all(|(placement, &index)| matches!(placement, Placement::Shard(_)) || index == 0);
        if !writes {
            continue;
        }
        let block = local_block(
            tensor.shape(),
            mesh.mesh(),
            tensor.placements(),
            mesh.rank(),
        )?;
        writer.add(
            BlockSpec {
                name,
                global_shape: tensor.shape(),
                offset: &block.offset,
                placement: Some(&format!("{:?}", tensor.placements())),
            },
            tensor.to_local(),
        )?;
    }
    writer.finish()?;
    world.barrier()?;
    if rank == 0 {
        root.commit(CommitInfo {
            step: STEP_TAG,
            world_size: world.size(),
            model_config: serde_json::json!({ "width": WIDTH, "hidden": HIDDEN, "blocks": BLOCKS }),
            state: serde_json::Value::Null,
        })?;
    }
    world.barrier()?;
    Ok(())
}

/// Loads the checkpoint under `root` into `model`: each rank reads the blocks its own
/// sharded state dict holds (same names, placements and mesh), whatever layout saved them.
fn load(root: &Path, model: &mut FsdpModule) -> AnyResult<()> {
    let checkpoint = Checkpoint::open(root)?;
    let mut state = BTreeMap::new();
    for (name, tensor) in model.sharded_state_dict()? {
        let mesh = tensor.process_mesh();
        let mine = local_block(
            tensor.shape(),
            mesh.mesh(),
            tensor.placements(),
            mesh.rank(),
        )?;
        let local = checkpoint.read_block(
            &name,
            &Block {
                offset: mine.offset,
                shape: mine.shape,
            },
        )?;
        let loaded = DTensor::from_local(local, mesh, tensor.placements(), Some(tensor.shape()))?;
        state.insert(name, loaded);
    }
    model.load_sharded_state_dict(&state)?;
    Ok(())
}

/// The launched run: HSDP training, then the checkpoint save, reload and check.
fn sharded(out: &Path) -> AnyResult<()> {
    let job = init_default_from_env()?;
    let world = Arc::clone(&job.comm);
    let (rank, size) = (world.rank(), world.size());
    if !size.is_multiple_of(REPLICAS) || !(BATCH / MICRO).is_multiple_of(size) {
        return Err(format!(
            "{size} ranks: need a multiple of {REPLICAS} that divides {} rows",
            BATCH / MICRO
        )
        .into());
    }
    let mesh = DataParallelMesh::hsdp(Arc::clone(&world), REPLICAS)?;
    let mut config = FullyShardConfig::new(mesh);
    // Compute in bf16 (parameters gathered and cast to bf16, inputs cast too), reduce
    // gradients in f32, hand f32 outputs to the loss; the sharded parameters and the
    // optimizer stay in f32.
    config.mp_policy = MixedPrecisionPolicy {
        param_dtype: Some(DType::BF16),
        reduce_dtype: Some(DType::F32),
        output_dtype: Some(DType::F32),
        cast_forward_inputs: true,
        fp32_main_grad: false,
    };
    let build = |seed: u64| -> AnyResult<FsdpModule> {
        let mut plain = model(seed)?;
        // One unit per block (and the output layer), then the root over them: each block's
        // parameters are gathered just before it runs and freed after.
        fully_shard_children(&mut plain, &config, &mut |_, m| has_params(m))?;
        // A refusal hands the module back; only the reason matters here.
        fully_shard(Box::new(plain), config.clone()).map_err(|rejected| rejected.error.into())
    };
    let mut model = build(1)?;
    let mut optimizer = sgd()?;
    let rows = BATCH / MICRO / size;
    for step in 0..STEPS {
        let mut loss = 0.0;
        for micro in 0..MICRO {
            let last = micro + 1 == MICRO;
            // Gradient accumulation: reduce (reduce-scatter + all-reduce over replicas) only
            // after the last micro-batch; the earlier ones accumulate unreduced gradients.
            model.set_requires_gradient_sync(last);
            let (x, y) = micro_batch(step, micro)?;
            let (x, y) = (
                x.narrow(0, rank * rows, rows)?,
                y.narrow(0, rank * rows, rows)?,
            );
            let out = model.forward(&x)?;
            let micro_loss = mse_loss(&out, &y)?;
            loss += micro_loss.loss / MICRO as f64;
            model.backward(&micro_loss.grad.scale(1.0 / MICRO as f64)?)?;
        }
        optimizer.step(&mut model)?;
        model.zero_grad()?;
        // Every rank saw its own rows: the global loss is the mean over ranks.
        let global = world.all_reduce_vec(vec![loss], ReduceOp::Sum)?[0] / size as f64;
        if rank == 0 {
            println!("step {step} loss {global:.9}");
        }
    }

    let root = CheckpointDir::new(out);
    let trained = model.sharded_state_dict()?;
    save(&world, &root, &trained)?;
    // A fresh model from other initial weights, loaded from the checkpoint, must hold the
    // trained values bit for bit.
    let mut fresh = build(7)?;
    load(out, &mut fresh)?;
    let reloaded = fresh.sharded_state_dict()?;
    let mut full = BTreeMap::new();
    for (name, tensor) in &trained {
        let again = reloaded
            .get(name)
            .ok_or_else(|| format!("the reloaded model has no {name}"))?;
        let bits = |t: &Tensor| -> AnyResult<Vec<u32>> {
            Ok(t.to_vec::<f32>()?.iter().map(|v| v.to_bits()).collect())
        };
        if bits(tensor.to_local())? != bits(again.to_local())? {
            return Err(format!("rank {rank}: {name} differs after the reload").into());
        }
        full.insert(name.clone(), tensor.full_tensor()?.to_f64_vec()?);
    }
    if rank == 0 {
        println!(
            "checkpoint saved by {size} ranks and reloaded equal: {} tensors, checksum {:.17e}",
            full.len(),
            checksum(&full)
        );
    }
    // The store lives in rank 0's process: every rank finishes before it goes.
    world.barrier()?;
    drop(job);
    Ok(())
}

fn main() -> AnyResult<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let value = |flag: &str| -> AnyResult<Option<PathBuf>> {
        match args.iter().position(|a| a == flag) {
            Some(i) => match args.get(i + 1) {
                Some(v) => Ok(Some(PathBuf::from(v))),
                None => Err(format!("{flag} needs a directory").into()),
            },
            None => Ok(None),
        }
    };
    if args.iter().any(|a| a == "--reference") {
        return reference(value("--load")?.as_deref());
    }
    let out = value("--out")?.ok_or("--out DIR is required (where the checkpoint goes)")?;
    sharded(&out)
}
