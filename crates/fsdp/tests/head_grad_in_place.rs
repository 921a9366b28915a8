//! The root's reduce-scatter input made in the gathered buffer the head's gradient already
//! lives in (nn's `Gpt::keep_head_grad_in_gathered_weight`, as `hypershard train` runs): the
//! losses and every sharded gradient are bitwise those of the default run, at a world that
//! does not divide the vocabulary and under HSDP, and the pool never lends a second buffer of
//! the root's size. At a world of one rank, where the unsharded weight is the shard itself,
//! the in-place head gradient is refused with a typed error instead of overwriting the weight.

mod common;

use std::collections::BTreeMap;

use common::{dp_mesh, on, rank_device};
use hypershard_fsdp::{FsdpError, FullyShardConfig, fully_shard, fully_shard_children, has_params};
use hypershard_nn::optim::{AdamW, AdamWConfig};
use hypershard_nn::{DEFAULT_IGNORE_INDEX, Gpt, GptConfig, Module};
use hypershard_tensor::{DType, Device, Tensor};

const VOCAB: usize = 2053;
const WIDTH: usize = 16;
const STEPS: usize = 2;

fn config() -> GptConfig {
    GptConfig {
        vocab_size: VOCAB,
        block_size: 8,
        n_layer: 1,
        n_head: 2,
        n_embd: WIDTH,
        bias: true,
        dropout: 0.0,
        dtype: DType::F32,
        seed: 5,
    }
}

/// One rank's run: per step the loss's bits and every sharded gradient's bits by name, and
/// the pool's peak bytes lent at once over the run.
struct Run {
    steps: Vec<(u64, BTreeMap<String, Vec<u32>>)>,
    pool_peak: usize,
}

fn train(mesh_shape: &[usize], in_weight: bool, device: Device) -> Vec<Run> {
    let world: usize = mesh_shape.iter().product();
    let comms = hypershard_collectives::local::spawn_world(world).expect("local world");
    let mesh_shape = mesh_shape.to_vec();
    hypershard_testkit::run_ranks(world, move |rank| {
        let mesh = dp_mesh(&mesh_shape, comms[rank].clone())?;
        let config = FullyShardConfig::new(mesh.clone());
        let device = rank_device(device, rank);
        let mut gpt = Gpt::new(self::config())?;
        hypershard_nn::to_device(&mut gpt, &device)?;
        let targets_handle = gpt.fused_loss(DEFAULT_IGNORE_INDEX);
        gpt.keep_head_grad_in_gathered_weight(in_weight);
        fully_shard_children(&mut gpt, &config, &mut |name, block| {
            name.starts_with("transformer.h.") && has_params(block)
        })?;
        let mut model = fully_shard(Box::new(gpt), config)?;
        let mut optimizer = AdamW::new(AdamWConfig {
            lr: 1e-2,
            ..AdamWConfig::default()
        })?;
        let mut steps = Vec::new();
        for step in 0..STEPS {
            // Token ids different on every rank and step, spread over the whole vocabulary so
            // that every rank's rows of the head's gradient see tokens.
            let token = |i: usize| ((i * 331 + rank * 977 + step * 59 + 1) % VOCAB) as i64;
            // invariant: 16 values for a [2, 8] tensor.
            let ids =
                Tensor::from_vec((0..16).map(token).collect::<Vec<_>>(), &[2, 8]).expect("ids");
            let targets =
                Tensor::from_vec((1..17).map(token).collect::<Vec<_>>(), &[2, 8]).expect("targets");
            targets_handle.for_backward(on(&targets, device));
            let loss = model.forward(&on(&ids, device))?.to_host()?;
            model.backward(&on(&Tensor::from_vec(vec![1.0f32], &[1])?, device))?;
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
            steps.push((loss.to_f64_vec()?[0].to_bits(), grads));
            optimizer.step(&mut model)?;
            model.zero_grad()?;
        }
        let pool_peak = mesh.process_mesh().buffer_pool().stats().peak_in_use_bytes;
        Ok::<_, FsdpError>(Run { steps, pool_peak })
    })
    .unwrap_or_else(|e| panic!("sharded run failed: {e}"))
}

fn check(mesh_shape: &[usize]) {
    let default = train(mesh_shape, false, Device::Cpu);
    let in_place = train(mesh_shape, true, Device::Cpu);
    // On the emulated device the gathered head weight is device memory, which the host's
    // in-place input cannot take: both settings take the copy-in, with the same bits.
    let emulated = Device::Emulated { ordinal: 0 };
    let device_runs = [false, true].map(|in_weight| train(mesh_shape, in_weight, emulated));
    let head_bytes = VOCAB * WIDTH * 4;
    for got in device_runs.iter().chain([&in_place]) {
        for (rank, (want, got)) in default.iter().zip(got).enumerate() {
            for (step, ((loss_a, grads_a), (loss_b, grads_b))) in
                want.steps.iter().zip(&got.steps).enumerate()
            {
                let at = format!("mesh {mesh_shape:?}, rank {rank}, step {step}");
                assert_eq!(loss_a, loss_b, "loss bits, {at}");
                assert_eq!(
                    grads_a.keys().collect::<Vec<_>>(),
                    grads_b.keys().collect::<Vec<_>>(),
                    "{at}"
                );
                for (name, bits) in grads_a {
                    assert!(grads_b.get(name) == Some(bits), "gradient of {name}, {at}");
                }
            }
        }
    }
    for (rank, got) in in_place.iter().enumerate() {
        // Without the in-place input the pool lends the root's gathered buffer (holding the
        // head's gradient) and a reduce-scatter input of the same size at once: at least twice
        // the head weight. (The default run's pool peak is no yardstick: its head gradient is
        // a tensor of its own, outside the pool.)
        assert!(
            got.pool_peak < 2 * head_bytes,
            "mesh {mesh_shape:?}, rank {rank}: the pool lent {} bytes at once, two buffers of \
             the root's size (head weight {head_bytes} bytes)",
            got.pool_peak
        );
    }
}

#[test]
fn in_place_root_reduce_is_bitwise_the_default_at_world_3() {
    check(&[3]);
}

#[test]
fn in_place_root_reduce_is_bitwise_the_default_under_hsdp_2x2() {
    check(&[2, 2]);
}

#[test]
fn one_rank_refuses_the_head_gradient_in_its_own_weight() {
    for device in [Device::Cpu, Device::Emulated { ordinal: 0 }] {
        let comms = hypershard_collectives::local::spawn_world(1).expect("local world");
        let mesh = dp_mesh(&[1], comms[0].clone()).expect("mesh");
        let config = FullyShardConfig::new(mesh);
        let mut gpt = Gpt::new(self::config()).expect("gpt");
        hypershard_nn::to_device(&mut gpt, &device).expect("to device");
        let targets_handle = gpt.fused_loss(DEFAULT_IGNORE_INDEX);
        gpt.keep_head_grad_in_gathered_weight(true);
        let mut model = fully_shard(Box::new(gpt), config).expect("fully_shard");
        let tokens = |first: i64| (first..first + 16).collect::<Vec<_>>();
        let ids = Tensor::from_vec(tokens(0), &[2, 8]).expect("ids");
        targets_handle.for_backward(on(
            &Tensor::from_vec(tokens(1), &[2, 8]).expect("t"),
            device,
        ));
        model.forward(&on(&ids, device)).expect("forward");
        let one = Tensor::from_vec(vec![1.0f32], &[1]).expect("seed");
        match model.backward(&on(&one, device)) {
            Err(FsdpError::GradAliasesParam { param, .. }) => {
                assert_eq!(param, "transformer.wte.weight", "{device:?}")
            }
            other => panic!("{device:?}: expected GradAliasesParam, got {other:?}"),
        }
    }
}
