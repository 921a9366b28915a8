//! Activation checkpointing under `fully_shard`: a GPT whose blocks are checkpointed trains
//! bitwise like the same GPT without checkpointing, at worlds 2 and 3, in both wrapping orders
//! (`fully_shard(Checkpointed(block))` and `Checkpointed(fully_shard(block))`), and issues
//! exactly the same all-gathers per step: the recomputation's all-gather is the backward one.

mod common;

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use common::{DEVICES, counted_world, on, rank_device};
use hypershard_collectives::{CommCounter, OpKind};
use hypershard_fsdp::{
    DataParallelMesh, FsdpError, FullyShardConfig, ReshardAfterForward, ShardedState,
    TrainingState, UnitHandle, fully_shard, fully_shard_children, has_params,
};
use hypershard_nn::optim::{AdamW, AdamWConfig};
use hypershard_nn::{
    Checkpointed, DEFAULT_IGNORE_INDEX, Gpt, GptConfig, Linear, LinearConfig, Module, ParamVisitor,
    ParamVisitorMut, Sequential, cross_entropy, replace_module,
};
use hypershard_tensor::{DType, Device, Tensor};

const LAYERS: u64 = 3;
const STEPS: usize = 2;

fn config(dropout: f64) -> GptConfig {
    GptConfig {
        vocab_size: 37,
        block_size: 8,
        n_layer: LAYERS as usize,
        n_head: 2,
        n_embd: 12,
        bias: true,
        dropout,
        dtype: DType::F32,
        seed: 11,
    }
}

/// Where the checkpoint wrapper sits relative to each block's unit.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Wrapping {
    /// No checkpointing.
    Plain,
    /// `fully_shard(Checkpointed(block))`: checkpoint first, then shard (what the CLI does).
    CheckpointThenShard,
    /// `Checkpointed(fully_shard(block))`: the unit's forward runs again during backward.
    ShardThenCheckpoint,
}

/// The calls of `op` on `counter` and on every communicator split from it.
fn calls(counter: &CommCounter, op: OpKind) -> u64 {
    counter.calls(op) + counter.children().iter().map(|c| c.calls(op)).sum::<u64>()
}

/// One rank's record of a step: the loss's bits, every (sharded) gradient's bits by name, and
/// the all-gathers and reduce-scatters the step issued (on any group).
#[derive(Debug)]
struct Step {
    loss: u64,
    grads: BTreeMap<String, Vec<u32>>,
    all_gathers: u64,
    reduce_scatters: u64,
}

fn wrap_blocks(gpt: &mut Gpt) -> hypershard_nn::Result<()> {
    for slot in gpt.blocks_mut().iter_mut() {
        replace_module(slot, |block| Ok(Box::new(Checkpointed::new(block))))?;
    }
    Ok(())
}

/// Token ids `[2, 6]` and next-token targets for `rank` at `step` (different on every rank).
fn batch(rank: usize, step: usize, vocab: usize) -> (Tensor, Tensor) {
    let token = |i: usize| ((i * 5 + rank * 17 + step * 3 + 1) % vocab) as i64;
    // invariant: 12 values for a [2, 6] tensor.
    let ids = Tensor::from_vec((0..12).map(token).collect::<Vec<_>>(), &[2, 6]).expect("ids");
    let targets =
        Tensor::from_vec((1..13).map(token).collect::<Vec<_>>(), &[2, 6]).expect("targets");
    (ids, targets)
}

fn train_rank(
    counter: Arc<CommCounter>,
    rank: usize,
    wrapping: Wrapping,
    dropout: f64,
    reshard: ReshardAfterForward,
    device: Device,
) -> Result<Vec<Step>, FsdpError> {
    let config = config(dropout);
    let device = rank_device(device, rank);
    let mesh = DataParallelMesh::fsdp(counter.clone())?;
    let mut fsdp = FullyShardConfig::new(mesh);
    fsdp.reshard_after_forward = reshard;
    let mut gpt = Gpt::new(config)?;
    hypershard_nn::to_device(&mut gpt, &device)?;
    if wrapping == Wrapping::CheckpointThenShard {
        wrap_blocks(&mut gpt)?;
    }
    let blocks = fully_shard_children(&mut gpt, &fsdp, &mut |name, block| {
        name.starts_with("transformer.h.") && has_params(block)
    })?;
    assert_eq!(blocks.len(), LAYERS as usize);
    if wrapping == Wrapping::ShardThenCheckpoint {
        wrap_blocks(&mut gpt)?;
    }
    let mut model = fully_shard(Box::new(gpt), fsdp)?;
    // The root finds every block's unit through the checkpoint wrappers.
    assert_eq!(model.units().len(), 1 + LAYERS as usize);
    let mut optimizer = AdamW::new(AdamWConfig {
        lr: 1e-2,
        ..AdamWConfig::default()
    })?;
    let mut steps = Vec::new();
    for step in 0..STEPS {
        let (gathers, scatters) = (
            calls(&counter, OpKind::AllGather),
            calls(&counter, OpKind::ReduceScatter),
        );
        let (ids, targets) = batch(rank, step, config.vocab_size);
        let logits = model.forward(&on(&ids, device))?;
        let loss = cross_entropy(&logits, &on(&targets, device), DEFAULT_IGNORE_INDEX)?;
        model.backward(&loss.grad)?;
        for unit in &blocks {
            assert_eq!(unit.training_state(), TrainingState::Idle);
        }
        let mut grads = BTreeMap::new();
        model.visit_params("", &mut |name, p| {
            let grad = p.grad.as_ref().expect("every parameter gets a gradient");
            let bits = grad
                .to_host()?
                .to_vec::<f32>()?
                .iter()
                .map(|g| g.to_bits())
                .collect();
            grads.insert(name.to_string(), bits);
            Ok(())
        })?;
        steps.push(Step {
            loss: loss.loss.to_bits(),
            grads,
            all_gathers: calls(&counter, OpKind::AllGather) - gathers,
            reduce_scatters: calls(&counter, OpKind::ReduceScatter) - scatters,
        });
        optimizer.step(&mut model)?;
        model.zero_grad()?;
    }
    Ok(steps)
}

fn run(
    world: usize,
    wrapping: Wrapping,
    dropout: f64,
    reshard: ReshardAfterForward,
    device: Device,
) -> Vec<Vec<Step>> {
    let counters = counted_world(world);
    hypershard_testkit::run_ranks(world, move |rank| {
        train_rank(
            counters[rank].clone(),
            rank,
            wrapping,
            dropout,
            reshard,
            device,
        )
    })
    .unwrap_or_else(|e| panic!("world {world}, {wrapping:?}, {device:?}: {e}"))
}

/// Both wrapping orders, on the host and on the emulated device, against the plain host run:
/// bitwise equal losses and gradients on every rank, and the same collectives,
/// `gathers_per_step` all-gathers each step.
fn check(world: usize, dropout: f64, reshard: ReshardAfterForward, gathers_per_step: u64) {
    let plain = run(world, Wrapping::Plain, dropout, reshard, Device::Cpu);
    for steps in &plain {
        for step in steps {
            assert_eq!(step.all_gathers, gathers_per_step, "plain, world {world}");
            // One reduce-scatter per block unit and one for the root.
            assert_eq!(step.reduce_scatters, 1 + LAYERS, "plain, world {world}");
        }
    }
    let runs = DEVICES.into_iter().flat_map(|device| {
        [
            Wrapping::Plain,
            Wrapping::CheckpointThenShard,
            Wrapping::ShardThenCheckpoint,
        ]
        .into_iter()
        .filter(move |&w| w != Wrapping::Plain || device != Device::Cpu)
        .map(move |w| (w, device))
    });
    for (wrapping, device) in runs {
        let got = run(world, wrapping, dropout, reshard, device);
        for (rank, (want, got)) in plain.iter().zip(&got).enumerate() {
            assert_eq!(want.len(), got.len());
            for (i, (w, g)) in want.iter().zip(got).enumerate() {
                let at =
                    format!("{wrapping:?} on {device:?}, world {world}, rank {rank}, step {i}");
                assert_eq!(w.loss, g.loss, "loss bits, {at}");
                assert_eq!(w.all_gathers, g.all_gathers, "all-gathers, {at}");
                assert_eq!(
                    w.reduce_scatters, g.reduce_scatters,
                    "reduce-scatters, {at}"
                );
                assert_eq!(w.grads.len(), g.grads.len(), "{at}");
                for (name, bits) in &w.grads {
                    // Compared by name so that a failure names the gradient, not all of them.
                    assert!(g.grads.get(name) == Some(bits), "gradient of {name}, {at}");
                }
            }
        }
    }
}

#[test]
fn checkpointed_gpt_trains_bitwise_like_the_plain_one_at_world_2() {
    // Forward: the root's all-gather and one per block; backward: one per block (the root
    // keeps its parameters).
    check(2, 0.0, ReshardAfterForward::Reshard, 1 + 2 * LAYERS);
}

#[test]
fn checkpointed_gpt_with_dropout_trains_bitwise_like_the_plain_one_at_world_3() {
    check(3, 0.1, ReshardAfterForward::Reshard, 1 + 2 * LAYERS);
}

#[test]
fn checkpointing_adds_no_gather_when_units_keep_their_parameters() {
    // Without resharding after forward, neither the plain backward nor the recomputation
    // gathers: one all-gather per unit per step.
    check(2, 0.1, ReshardAfterForward::Keep, 1 + LAYERS);
}

#[test]
fn checkpointing_gathers_backward_within_the_smaller_post_forward_group() {
    // ToGroupOf(2) at world 4: forward gathers over all 4 ranks, backward (the recomputation)
    // within the pair, from the post-forward shard; still one each per unit.
    check(4, 0.1, ReshardAfterForward::ToGroupOf(2), 1 + 2 * LAYERS);
}

/// What a probe inside a unit saw: the call, the unit's training state and whether its
/// parameters were gathered.
type Seen = Arc<Mutex<Vec<(&'static str, TrainingState, bool)>>>;

/// A parameterless module inside a unit that records the unit's state at every call.
struct Probe {
    unit: Arc<Mutex<Option<UnitHandle>>>,
    seen: Seen,
}

impl Probe {
    fn observe(&self, call: &'static str) {
        let unit = self.unit.lock().expect("probe lock");
        let unit = unit
            .as_ref()
            .expect("the handle is set before the first forward");
        let gathered = unit
            .params()
            .iter()
            .all(|p| p.state == ShardedState::Unsharded);
        let state = unit.training_state();
        self.seen
            .lock()
            .expect("probe lock")
            .push((call, state, gathered));
    }
}

impl Module for Probe {
    fn kind(&self) -> &'static str {
        "Probe"
    }
    fn forward(&mut self, input: &Tensor) -> hypershard_nn::Result<Tensor> {
        self.observe("forward");
        Ok(input.clone())
    }
    fn backward(&mut self, grad_output: &Tensor) -> hypershard_nn::Result<Tensor> {
        self.observe("backward");
        Ok(grad_output.clone())
    }
    fn visit_params(&self, _: &str, _: &mut ParamVisitor<'_>) -> hypershard_nn::Result<()> {
        Ok(())
    }
    fn visit_params_mut(
        &mut self,
        _: &str,
        _: &mut ParamVisitorMut<'_>,
    ) -> hypershard_nn::Result<()> {
        Ok(())
    }
}

/// One step of `[unit(probe, linear)]` under a parameterless root at world 2, the unit
/// checkpointed from outside or inside; returns what the probe saw on rank 0.
fn probe_step(wrapping: Wrapping) -> Vec<(&'static str, TrainingState, bool)> {
    let comms = hypershard_collectives::local::spawn_world(2).expect("world");
    let seen = hypershard_testkit::run_ranks(2, move |rank| {
        let mesh = DataParallelMesh::fsdp(comms[rank].clone())?;
        let config = FullyShardConfig::new(mesh);
        let handle = Arc::new(Mutex::new(None));
        let seen: Seen = Arc::new(Mutex::new(Vec::new()));
        let linear = Linear::new(LinearConfig {
            in_features: 4,
            out_features: 3,
            bias: true,
            dtype: DType::F32,
            seed: 1,
        })?;
        let probe = Probe {
            unit: handle.clone(),
            seen: seen.clone(),
        };
        let block: Box<dyn Module> = Box::new(Sequential::default().with(probe).with(linear));
        let block = match wrapping {
            Wrapping::CheckpointThenShard => {
                fully_shard(Box::new(Checkpointed::new(block)), config.clone())?
            }
            _ => fully_shard(block, config.clone())?,
        };
        *handle.lock().expect("probe lock") = Some(block.handle());
        let block: Box<dyn Module> = match wrapping {
            Wrapping::ShardThenCheckpoint => Box::new(Checkpointed::new(Box::new(block))),
            _ => Box::new(block),
        };
        let mut root = fully_shard(Box::new(Sequential::new(vec![block])), config)?;
        let out = root.forward(&Tensor::ones(&[2, 4], DType::F32)?)?;
        root.backward(&Tensor::ones(out.shape(), DType::F32)?)?;
        let state = handle
            .lock()
            .expect("probe lock")
            .as_ref()
            .map(UnitHandle::training_state);
        assert_eq!(state, Some(TrainingState::Idle));
        let seen = seen.lock().expect("probe lock").clone();
        Ok::<_, FsdpError>(seen)
    })
    .unwrap_or_else(|e| panic!("{wrapping:?}: {e}"));
    seen.into_iter().next().expect("rank 0")
}

#[test]
fn a_unit_recomputed_from_outside_runs_forward_in_backward_on_gathered_parameters() {
    use TrainingState::*;
    // The recomputation runs in ForwardInBackward on the parameters it gathered, and the
    // unit's backward runs on those same parameters.
    assert_eq!(
        probe_step(Wrapping::ShardThenCheckpoint),
        [
            ("forward", Forward, true),
            ("forward", ForwardInBackward, true),
            ("backward", PreBackward, true),
        ]
    );
    // Checkpointed inside the unit: the recomputation runs within the unit's backward hook.
    assert_eq!(
        probe_step(Wrapping::CheckpointThenShard),
        [
            ("forward", Forward, true),
            ("forward", PreBackward, true),
            ("backward", PreBackward, true),
        ]
    );
}
