//! Controls: gradient accumulation through both switches, resharding after backward, scaling,
//! manual unshard/reshard, explicit prefetch lists, and overlap observed from inside units.

mod common;

use std::sync::{Arc, Mutex};

use common::*;
use hypershard_fsdp::{
    FsdpModule, FullyShardConfig, GradReduceOp, ShardedState, UnitHandle, fully_shard,
    fully_shard_children, has_params,
};
use hypershard_nn::{
    Linear, LinearConfig, Module, ParamVisitor, ParamVisitorMut, Sequential, mse_loss,
};
use hypershard_tensor::{DType, Device, Tensor};

const DIMS: [usize; 4] = [5, 3, 7, 2];
const TOL: f64 = 1e-5;

fn check_micro(mesh_shape: &[usize], configure: Arc<Configure>, hook: Arc<MicroHook>) {
    let want = reference(&DIMS, DType::F32, Opt::Sgd, 2, 2);
    let run = Run {
        dims: DIMS.to_vec(),
        dtype: DType::F32,
        opt: Opt::Sgd,
        steps: 2,
        micro: 2,
        mesh_shape: mesh_shape.to_vec(),
    };
    let results = train_world(run, configure, hook);
    let got = assemble(&results, &dim0, &none);
    let err = max_rel_err(&got, &want);
    assert!(err <= TOL, "mesh {mesh_shape:?}: max rel err {err}");
}

fn defaults() -> Arc<Configure> {
    Arc::new(|_: &mut FullyShardConfig| {})
}

#[test]
fn accumulating_without_gradient_sync_matches_accumulated_reference() {
    let hook: Arc<MicroHook> =
        Arc::new(|m: &mut FsdpModule, _, last| m.set_requires_gradient_sync(last));
    for shape in [vec![2], vec![3], vec![2, 2]] {
        check_micro(&shape, defaults(), hook.clone());
    }
}

#[test]
fn deferring_the_replicate_all_reduce_matches_accumulated_reference() {
    let hook: Arc<MicroHook> =
        Arc::new(|m: &mut FsdpModule, _, last| m.set_requires_all_reduce(last));
    check_micro(&[2, 2], defaults(), hook);
}

#[test]
fn keeping_unsharded_params_across_micro_steps_matches_reference() {
    let hook: Arc<MicroHook> = Arc::new(|m: &mut FsdpModule, _, last| {
        m.set_requires_gradient_sync(last);
        m.set_reshard_after_backward(last);
    });
    check_micro(&[3], defaults(), hook);
}

#[test]
fn sum_with_scaling_factor_equals_the_mean() {
    // factor · Σ grads with factor = 1/world is the mean, so training matches.
    for world in [2usize, 4] {
        let configure: Arc<Configure> = Arc::new(move |c: &mut FullyShardConfig| {
            c.reduce_op = GradReduceOp::Sum;
        });
        let hook: Arc<MicroHook> = Arc::new(move |m: &mut FsdpModule, _, _| {
            m.set_gradient_scaling_factor(1.0 / world as f64)
        });
        check_micro(&[world], configure, hook);
    }
}

#[test]
fn sum_reduction_is_world_times_the_mean() {
    let grads = |op: GradReduceOp, device: Device| {
        let comms = hypershard_collectives::local::spawn_world(3).expect("world");
        hypershard_testkit::run_ranks(3, move |rank| {
            let mesh = dp_mesh(&[3], comms[rank].clone())?;
            let mut config = FullyShardConfig::new(mesh);
            config.reduce_op = op;
            let device = rank_device(device, rank);
            let mut model = shard_model(moved(mlp(&DIMS, DType::F32), device), &config)?;
            let (x, y) = batch(0, DIMS[0], DIMS[3], DType::F32);
            let out = model.forward(&on(&local_rows(&x, rank, 3), device))?;
            let loss = mse_loss(&out, &on(&local_rows(&y, rank, 3), device))?;
            model.backward(&loss.grad)?;
            let mut grads = Vec::new();
            model.visit_params("", &mut |_, p| {
                grads.extend(
                    p.grad
                        .as_ref()
                        .map(|g| g.to_host()?.to_f64_vec())
                        .transpose()?
                        .unwrap_or_default(),
                );
                Ok(())
            })?;
            Ok::<_, hypershard_fsdp::FsdpError>(grads)
        })
        .expect("run")
    };
    let avg = grads(GradReduceOp::Avg, Device::Cpu);
    let sum = grads(GradReduceOp::Sum, Device::Cpu);
    // The emulated device reduces the same values.
    let emulated = Device::Emulated { ordinal: 0 };
    assert_eq!(avg, grads(GradReduceOp::Avg, emulated));
    assert_eq!(sum, grads(GradReduceOp::Sum, emulated));
    for (a, s) in avg.iter().zip(&sum) {
        assert_eq!(a.len(), s.len());
        assert!(!a.is_empty());
        for (x, y) in a.iter().zip(s) {
            assert!(
                (3.0 * x - y).abs() <= 1e-5 * y.abs().max(1e-3),
                "{x} vs {y}"
            );
        }
    }
}

#[test]
fn manual_unshard_shows_full_params_and_reshard_frees_them() {
    for device in DEVICES {
        let comms = hypershard_collectives::local::spawn_world(3).expect("world");
        let want = params_of(&mlp(&DIMS, DType::F32));
        hypershard_testkit::run_ranks(3, move |rank| {
            let mesh = dp_mesh(&[3], comms[rank].clone())?;
            let config = FullyShardConfig::new(mesh);
            let device = rank_device(device, rank);
            let mut unit = fully_shard(Box::new(moved(mlp(&DIMS, DType::F32), device)), config)?;
            assert!(unit.is_in_state(ShardedState::Sharded));
            unit.unshard()?;
            assert!(unit.handle().is_unsharded());
            let full = params_of(&unit);
            assert_eq!(full, want, "rank {rank}");
            unit.reshard()?;
            assert!(unit.is_in_state(ShardedState::Sharded));
            let shards = params_of(&unit);
            assert_eq!(shards["0.weight"].0, vec![1, 5]);
            // An async unshard is consumed by the next unshard.
            unit.unshard_async()?;
            assert!(unit.handle().gather_in_flight());
            unit.unshard()?;
            assert!(!unit.handle().gather_in_flight());
            assert_eq!(params_of(&unit), want);
            // Shards and unsharded parameters alike stay on the unit's device.
            unit.visit_params("", &mut |name, p| {
                assert_eq!(p.data()?.device(), device, "{name}");
                Ok(())
            })?;
            Ok::<_, hypershard_fsdp::FsdpError>(())
        })
        .expect("run");
    }
}

#[test]
fn explicit_prefetch_lists_and_disabled_prefetch_keep_parity() {
    let configure = defaults();
    // Root prefetches every unit up front in forward; units prefetch nothing in backward.
    let hook: Arc<MicroHook> = Arc::new(|m: &mut FsdpModule, micro, _| {
        if micro == 0 {
            let units = m.units();
            m.set_modules_to_forward_prefetch(&units[1..]);
            let none: Vec<UnitHandle> = Vec::new();
            m.set_modules_to_backward_prefetch(&none);
        }
    });
    check_micro(&[2], configure, hook);
}

/// Records what it sees of other units while its forward and backward run.
struct Probe {
    watched: Arc<Mutex<Vec<UnitHandle>>>,
    seen: Arc<Mutex<Vec<Observation>>>,
}

#[derive(Debug, Clone, PartialEq)]
struct Observation {
    backward: bool,
    gathers_in_flight: Vec<bool>,
    reductions_in_flight: Vec<bool>,
    unsharded: usize,
}

impl Probe {
    fn observe(&self, backward: bool) {
        let watched = self.watched.lock().expect("probe lock");
        let observation = Observation {
            backward,
            gathers_in_flight: watched.iter().map(|u| u.gather_in_flight()).collect(),
            reductions_in_flight: watched.iter().map(|u| u.reduction_in_flight()).collect(),
            unsharded: watched
                .iter()
                .filter(|u| u.is_unsharded() || u.gather_in_flight())
                .count(),
        };
        self.seen.lock().expect("probe lock").push(observation);
    }
}

impl Module for Probe {
    fn kind(&self) -> &'static str {
        "Probe"
    }
    fn forward(&mut self, input: &Tensor) -> hypershard_nn::Result<Tensor> {
        self.observe(false);
        Ok(input.clone())
    }
    fn backward(&mut self, grad_output: &Tensor) -> hypershard_nn::Result<Tensor> {
        self.observe(true);
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

#[test]
fn gathers_run_ahead_and_reductions_overlap_the_next_units_backward() {
    let comms = hypershard_collectives::local::spawn_world(2).expect("world");
    let seen = hypershard_testkit::run_ranks(2, move |rank| {
        let mesh = dp_mesh(&[2], comms[rank].clone())?;
        let config = FullyShardConfig::new(mesh);
        let watched = Arc::new(Mutex::new(Vec::new()));
        let seen = Arc::new(Mutex::new(Vec::new()));
        // Four layers, a probe inside the second unit: [L0], [L1 + probe], [L2], [L3].
        let mut layers: Vec<Box<dyn Module>> = Vec::new();
        for i in 0..4u64 {
            let layer: Box<dyn Module> = Box::new(Linear::new(LinearConfig {
                in_features: 4,
                out_features: 4,
                bias: true,
                dtype: DType::F32,
                seed: 10 * i,
            })?);
            if i == 1 {
                let probe = Probe {
                    watched: watched.clone(),
                    seen: seen.clone(),
                };
                layers.push(Box::new(Sequential::new(vec![layer, Box::new(probe)])));
            } else {
                layers.push(layer);
            }
        }
        let mut model = Sequential::new(layers);
        let handles = fully_shard_children(&mut model, &config, &mut |_, m| has_params(m))?;
        *watched.lock().expect("lock") = handles;
        let mut root = fully_shard(Box::new(model), config)?;
        let x = Tensor::ones(&[2, 4], DType::F32)?;
        let out = root.forward(&x)?;
        root.backward(&Tensor::ones(out.shape(), DType::F32)?)?;
        let seen = seen.lock().expect("lock").clone();
        Ok::<_, hypershard_fsdp::FsdpError>(seen)
    })
    .expect("run");
    for observations in seen {
        assert_eq!(observations.len(), 2);
        let forward = &observations[0];
        // In unit 1's forward: unit 2's all-gather was issued ahead (implicit prefetch).
        assert_eq!(forward.gathers_in_flight, vec![false, false, true, false]);
        // Unit 1 (unsharded) and unit 2 (prefetched) only: at most two units alive.
        assert_eq!(forward.unsharded, 2);
        let backward = &observations[1];
        // In unit 1's backward: unit 0's gather is in flight (backward prefetch) and unit 2's
        // reduce-scatter is still pending, overlapping this compute.
        assert_eq!(backward.gathers_in_flight, vec![true, false, false, false]);
        assert_eq!(
            backward.reductions_in_flight,
            vec![false, false, true, false]
        );
        assert_eq!(backward.unsharded, 2);
    }
}
