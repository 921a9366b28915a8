//! A data-parallel world of one rank: the unsharded parameter is the shard itself and the
//! gradient lands as it is, with no collective. Training is then bitwise the unsharded run's
//! under every path a gradient can take (accumulation without sync, resharding or keeping
//! after forward, replicated and dim-1 parameters, SGD and AdamW), on the host and on the
//! emulated device; mixed precision stays within bf16's bound; the gradient scaling factor
//! scales. (A gradient written into the parameter's own memory is refused:
//! `head_grad_in_place.rs`.)

mod common;

use std::collections::BTreeSet;
use std::sync::Arc;

use common::*;
use hypershard_fsdp::{
    FsdpModule, FullyShardConfig, MixedPrecisionPolicy, ReshardAfterForward, fully_shard,
};
use hypershard_nn::{Module, mse_loss};
use hypershard_tensor::DType;

const DIMS: [usize; 4] = [5, 3, 7, 2];

fn run(opt: Opt, steps: usize, micro: usize) -> Run {
    Run {
        dims: DIMS.to_vec(),
        dtype: DType::F32,
        opt,
        steps,
        micro,
        mesh_shape: vec![1],
    }
}

fn no_hook() -> Arc<MicroHook> {
    Arc::new(|_: &mut FsdpModule, _, _| {})
}

#[test]
fn one_rank_trains_bitwise_like_the_unsharded_model_on_every_gradient_path() {
    type Case = (&'static str, Opt, usize, Arc<Configure>, Arc<MicroHook>);
    let cases: Vec<Case> = vec![
        (
            "default, SGD",
            Opt::Sgd,
            1,
            Arc::new(|_: &mut _| {}),
            no_hook(),
        ),
        (
            "default, AdamW",
            Opt::AdamW,
            1,
            Arc::new(|_: &mut _| {}),
            no_hook(),
        ),
        (
            "two micro-batches, both synchronised (added into the sharded gradient)",
            Opt::Sgd,
            2,
            Arc::new(|_: &mut _| {}),
            no_hook(),
        ),
        (
            "three micro-batches, gradients synchronised on the last",
            Opt::Sgd,
            3,
            Arc::new(|_: &mut _| {}),
            Arc::new(|m: &mut FsdpModule, _, last| m.set_requires_gradient_sync(last)),
        ),
        (
            "two micro-batches, unsharded between them",
            Opt::AdamW,
            2,
            Arc::new(|_: &mut _| {}),
            Arc::new(|m: &mut FsdpModule, _, last| {
                m.set_requires_gradient_sync(last);
                m.set_reshard_after_backward(last);
            }),
        ),
        (
            "kept unsharded after forward",
            Opt::Sgd,
            1,
            Arc::new(|c: &mut FullyShardConfig| {
                c.reshard_after_forward = ReshardAfterForward::Keep
            }),
            no_hook(),
        ),
        (
            "replicated biases, weights on dim 1",
            Opt::AdamW,
            1,
            Arc::new(|c: &mut FullyShardConfig| {
                c.replicate_params = BTreeSet::from(["bias".to_string()]);
                c.shard_placement_fn = Some(Arc::new(|name, _| (name == "weight").then_some(1)));
            }),
            no_hook(),
        ),
    ];
    for (name, opt, micro, configure, hook) in cases {
        let want = reference(&DIMS, DType::F32, opt, 3, micro);
        // `train_world` also runs on the emulated device and checks it equals the host.
        let results = train_world(run(opt, 3, micro), configure, hook);
        assert_eq!(results.len(), 1);
        let got = assemble(&results, &|_| 0, &|_| false);
        assert_eq!(
            got, want,
            "{name}: one rank differs from the unsharded model"
        );
    }
}

fn bf16_policy(fp32_main_grad: bool) -> MixedPrecisionPolicy {
    MixedPrecisionPolicy {
        param_dtype: Some(DType::BF16),
        reduce_dtype: Some(DType::F32),
        output_dtype: Some(DType::F32),
        cast_forward_inputs: true,
        fp32_main_grad,
    }
}

/// The unsharded f32 model's gradients of micro-batch 0, by name.
fn plain_grads() -> std::collections::BTreeMap<String, Vec<f64>> {
    let (x, y) = batch(0, DIMS[0], DIMS[3], DType::F32);
    let mut plain = mlp(&DIMS, DType::F32);
    let out = plain.forward(&x).expect("forward");
    plain
        .backward(&mse_loss(&out, &y).expect("loss").grad)
        .expect("backward");
    let mut grads = std::collections::BTreeMap::new();
    plain
        .visit_params("", &mut |name, p| {
            let grad = p.grad.as_ref().expect("every parameter has a gradient");
            grads.insert(name.to_string(), grad.to_f64_vec()?);
            Ok(())
        })
        .expect("visit");
    grads
}

#[test]
fn one_rank_bf16_params_stay_within_a_bf16_bound_and_apply() {
    let want = reference(&DIMS, DType::F32, Opt::Sgd, 3, 1);
    let results = train_world(
        run(Opt::Sgd, 3, 1),
        Arc::new(|c: &mut FullyShardConfig| c.mp_policy = bf16_policy(false)),
        no_hook(),
    );
    let got = assemble(&results, &|_| 0, &|_| false);
    let err = max_rel_err(&got, &want);
    // The same bound as at more ranks: bf16 keeps 8 significant bits.
    assert!(err <= 3e-2, "{err}");
    assert!(err > 1e-6, "bf16 did not apply ({err})");
}

#[test]
fn one_rank_fp32_main_grads_hold_the_bf16_gradients_outside_the_parameters() {
    let want = plain_grads();
    let comms = hypershard_collectives::local::spawn_world(1).expect("world");
    let mesh = dp_mesh(&[1], comms[0].clone()).expect("mesh");
    let mut config = FullyShardConfig::new(mesh);
    config.mp_policy = bf16_policy(true);
    // The root alone holds every parameter, so its main grads are reachable by full name.
    let mut model = fully_shard(Box::new(mlp(&DIMS, DType::F32)), config).expect("shard");
    let (x, y) = batch(0, DIMS[0], DIMS[3], DType::F32);
    let out = model.forward(&x).expect("forward");
    model
        .backward(&mse_loss(&out, &y).expect("loss").grad)
        .expect("backward");
    model
        .visit_params("", &mut |_, p| {
            assert!(p.grad.is_none(), "the gradient went to the main grad");
            assert_eq!(p.data()?.dtype(), DType::F32);
            Ok(())
        })
        .expect("visit");
    let mut differs = false;
    for (name, grad) in &want {
        let main = model
            .main_grad(name)
            .expect("a main grad for every parameter");
        assert_eq!(main.dtype(), DType::F32, "{name}");
        let main = main.to_f64_vec().expect("host");
        let scale = grad.iter().fold(0f64, |m, g| m.max(g.abs())).max(1e-12);
        for (a, b) in main.iter().zip(grad) {
            assert!((a - b).abs() <= 3e-2 * scale, "{name}: {a} vs {b}");
            differs |= a != b;
        }
    }
    assert!(differs, "bf16 compute did not apply");
}

#[test]
fn one_rank_scales_gradients_by_the_scaling_factor() {
    let comms = hypershard_collectives::local::spawn_world(1).expect("world");
    let want = plain_grads();
    let (x, y) = batch(0, DIMS[0], DIMS[3], DType::F32);
    let mesh = dp_mesh(&[1], comms[0].clone()).expect("mesh");
    let mut model =
        shard_model(mlp(&DIMS, DType::F32), &FullyShardConfig::new(mesh)).expect("shard");
    model.set_gradient_scaling_factor(0.25);
    let out = model.forward(&x).expect("forward");
    model
        .backward(&mse_loss(&out, &y).expect("loss").grad)
        .expect("backward");
    let mut seen = 0;
    model
        .visit_params("", &mut |name, p| {
            let grad = p.grad.as_ref().expect("every parameter has a gradient");
            // A power of two scales exactly.
            let scaled: Vec<f64> = want[name].iter().map(|g| g * 0.25).collect();
            assert_eq!(grad.to_f64_vec()?, scaled, "{name}");
            seen += 1;
            Ok(())
        })
        .expect("visit");
    assert_eq!(seen, want.len());
}
