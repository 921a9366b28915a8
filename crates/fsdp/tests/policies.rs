//! Mixed precision, fp32 main grads, zero-copy unshard, replicate and ignored parameters; each
//! run on the host and on the emulated device, with the same values.

mod common;

use std::collections::BTreeSet;
use std::sync::Arc;

use common::*;
use hypershard_fsdp::{
    CommFusionPolicy, FsdpError, FsdpModule, FullyShardConfig, MixedPrecisionPolicy,
};
use hypershard_nn::{Module, Sequential, mse_loss};
use hypershard_tensor::DType;

const DIMS: [usize; 4] = [5, 3, 7, 2];

fn no_hook() -> Arc<MicroHook> {
    Arc::new(|_: &mut FsdpModule, _, _| {})
}

fn bf16_policy() -> MixedPrecisionPolicy {
    MixedPrecisionPolicy {
        param_dtype: Some(DType::BF16),
        reduce_dtype: Some(DType::F32),
        output_dtype: Some(DType::F32),
        cast_forward_inputs: true,
        fp32_main_grad: false,
    }
}

#[test]
fn bf16_params_train_within_a_bf16_bound_of_the_fp32_reference() {
    let want = reference(&DIMS, DType::F32, Opt::Sgd, 3, 1);
    let run = Run {
        dims: DIMS.to_vec(),
        dtype: DType::F32,
        opt: Opt::Sgd,
        steps: 3,
        micro: 1,
        mesh_shape: vec![2],
    };
    let results = train_world(
        run,
        Arc::new(|c: &mut FullyShardConfig| c.mp_policy = bf16_policy()),
        no_hook(),
    );
    let got = assemble(&results, &dim0, &none);
    let err = max_rel_err(&got, &want);
    // bf16 keeps 8 significant bits (relative spacing 2^-8 ≈ 0.004); three steps of compute
    // in bf16 stay within a few of those, and differ from fp32 at all.
    assert!(err <= 3e-2, "bf16 max rel err {err}");
    assert!(
        err > 1e-6,
        "bf16 run identical to fp32 ({err}): the policy did not apply"
    );
    // The sharded parameters stay in their original dtype.
    for r in &results {
        assert!(r.params.keys().all(|k| !k.is_empty()));
    }
}

#[test]
fn fp32_main_grad_collects_reduced_grads_outside_the_parameter() {
    let runs = on_both(|device| {
        let comms = hypershard_collectives::local::spawn_world(2).expect("world");
        hypershard_testkit::run_ranks(2, move |rank| {
            let mesh = dp_mesh(&[2], comms[rank].clone())?;
            let mut config = FullyShardConfig::new(mesh);
            config.mp_policy = MixedPrecisionPolicy {
                fp32_main_grad: true,
                ..bf16_policy()
            };
            let device = rank_device(device, rank);
            let mut model = shard_model(moved(mlp(&DIMS, DType::F32), device), &config)?;
            let (x, y) = batch(0, DIMS[0], DIMS[3], DType::F32);
            let out = model.forward(&on(&local_rows(&x, rank, 2), device))?;
            assert_eq!(out.dtype(), DType::F32);
            let loss = mse_loss(&out, &on(&local_rows(&y, rank, 2), device))?;
            model.backward(&loss.grad)?;
            let mut grads = 0;
            model.visit_params("", &mut |_, p| {
                assert!(p.grad.is_none());
                assert_eq!(p.data()?.dtype(), DType::F32);
                Ok(())
            })?;
            for unit in model.units() {
                for info in unit.params() {
                    let _ = info;
                    grads += 1;
                }
            }
            assert_eq!(grads, 6);
            Ok::<_, FsdpError>(out.to_host()?.to_f64_vec()?)
        })
        .unwrap_or_else(|e| panic!("on {device:?}: {e}"))
    });
    // The bf16 forward gives the host's outputs on the emulated device.
    assert_eq!(
        runs[0], runs[1],
        "the emulated device's run differs from the host's"
    );
}

#[test]
fn zero_copy_single_parameter_buckets_match_unsharded() {
    let want = reference(&DIMS, DType::F32, Opt::AdamW, 2, 1);
    let run = Run {
        dims: DIMS.to_vec(),
        dtype: DType::F32,
        opt: Opt::AdamW,
        steps: 2,
        micro: 1,
        mesh_shape: vec![3],
    };
    let results = train_world(
        run,
        Arc::new(|c: &mut FullyShardConfig| {
            c.comm_fusion = CommFusionPolicy {
                enabled: false,
                zero_copy: true,
                ..CommFusionPolicy::default()
            }
        }),
        no_hook(),
    );
    let got = assemble(&results, &dim0, &none);
    assert!(max_rel_err(&got, &want) <= 1e-5);
}

#[test]
fn shard_dim_one_and_replicated_biases_match_unsharded() {
    let want = reference(&DIMS, DType::F32, Opt::Sgd, 2, 1);
    for shape in [vec![3], vec![2, 2]] {
        let run = Run {
            dims: DIMS.to_vec(),
            dtype: DType::F32,
            opt: Opt::Sgd,
            steps: 2,
            micro: 1,
            mesh_shape: shape.clone(),
        };
        let results = train_world(
            run,
            Arc::new(|c: &mut FullyShardConfig| {
                c.replicate_params = BTreeSet::from(["bias".to_string()]);
                c.shard_placement_fn = Some(Arc::new(|name, _| (name == "weight").then_some(1)));
            }),
            no_hook(),
        );
        let is_bias = |name: &str| name.ends_with("bias");
        let shard_dim = |name: &str| if is_bias(name) { 0 } else { 1 };
        check_shard_shapes(&results, &want, &shard_dim, &is_bias);
        let got = assemble(&results, &shard_dim, &is_bias);
        let err = max_rel_err(&got, &want);
        assert!(err <= 1e-5, "mesh {shape:?}: {err}");
        // Replicated biases are identical on every rank.
        for r in &results[1..] {
            for (name, value) in &r.params {
                if is_bias(name) {
                    assert_eq!(value, &results[0].params[name], "{name}");
                }
            }
        }
    }
}

/// Freezes every weight so only biases train.
fn freeze_weights(model: &mut Sequential) {
    model
        .visit_params_mut("", &mut |name, p| {
            if name.ends_with("weight") {
                p.requires_grad = false;
            }
            Ok(())
        })
        .expect("visit");
}

#[test]
fn ignored_params_stay_whole_and_untouched() {
    // Reference: frozen weights, biases trained on the whole batch.
    let mut reference_model = mlp(&DIMS, DType::F32);
    freeze_weights(&mut reference_model);
    let mut optimizer = Optimizer::new(Opt::Sgd);
    for step in 0..2 {
        let (x, y) = batch(step, DIMS[0], DIMS[3], DType::F32);
        let out = reference_model.forward(&x).expect("forward");
        let loss = mse_loss(&out, &y).expect("loss");
        reference_model.backward(&loss.grad).expect("backward");
        optimizer.step(&mut reference_model).expect("step");
        hypershard_nn::zero_grad(&mut reference_model).expect("zero");
    }
    let want = params_of(&reference_model);
    let mut runs = on_both(|device| {
        let comms = hypershard_collectives::local::spawn_world(3).expect("world");
        hypershard_testkit::run_ranks(3, move |rank| {
            let mesh = dp_mesh(&[3], comms[rank].clone())?;
            let mut config = FullyShardConfig::new(mesh.clone());
            config.ignored_params = BTreeSet::from(["weight".to_string()]);
            let device = rank_device(device, rank);
            let mut model = moved(mlp(&DIMS, DType::F32), device);
            freeze_weights(&mut model);
            let mut model = shard_model(model, &config)?;
            let mut optimizer = Optimizer::new(Opt::Sgd);
            for step in 0..2 {
                let (x, y) = batch(step, DIMS[0], DIMS[3], DType::F32);
                let out = model.forward(&on(&local_rows(&x, rank, 3), device))?;
                let loss = mse_loss(&out, &on(&local_rows(&y, rank, 3), device))?;
                model.backward(&loss.grad)?;
                optimizer.step(&mut model)?;
                model.zero_grad()?;
            }
            Ok::<_, FsdpError>(RankResult {
                params: params_of(&model),
                shard_rank: mesh.shard_rank(),
                replicate_rank: 0,
                extra: Vec::new(),
            })
        })
        .expect("run")
    });
    let on_device = runs.pop().expect("invariant: two runs");
    let results = runs.pop().expect("invariant: two runs");
    assert_same_results(&results, &on_device);
    let is_weight = |name: &str| name.ends_with("weight");
    let got = assemble(&results, &dim0, &is_weight);
    assert!(max_rel_err(&got, &want) <= 1e-5);
    for r in &results {
        for (name, value) in &r.params {
            if is_weight(name) {
                assert_eq!(value, &want[name], "{name} must stay whole and untouched");
            }
        }
    }
}
