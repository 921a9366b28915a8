//! Global-norm clipping over shards, and the peak parameter storage of one rank.

mod common;

use common::*;
use hypershard_fsdp::{FsdpError, FullyShardConfig, ReshardAfterForward};
use hypershard_nn::{Linear, LinearConfig, Module, Sequential, mse_loss};
use hypershard_tensor::memory::MemoryTracker;
use hypershard_tensor::{DType, Device};

const DIMS: [usize; 4] = [5, 3, 7, 2];

/// The reference: gradients of the whole batch on one rank, clipped by nn's clip_grad_norm.
fn reference_clipped(max_norm: f64) -> (f64, Params) {
    let mut model = mlp(&DIMS, DType::F32);
    let (x, y) = batch(0, DIMS[0], DIMS[3], DType::F32);
    let out = model.forward(&x).expect("forward");
    let loss = mse_loss(&out, &y).expect("loss");
    model.backward(&loss.grad).expect("backward");
    let norm = hypershard_nn::optim::clip_grad_norm(&mut model, max_norm).expect("clip");
    let mut grads = Params::new();
    model
        .visit_params("", &mut |name, p| {
            let g = p.grad.as_ref().expect("grad");
            grads.insert(name.to_string(), (g.shape().to_vec(), g.to_f64_vec()?));
            Ok(())
        })
        .expect("visit");
    (norm, grads)
}

#[test]
fn clipping_over_shards_matches_the_unsharded_norm_without_double_counting() {
    let max_norm = 0.05;
    let (want_norm, want_grads) = reference_clipped(max_norm);
    for shape in [vec![3], vec![2, 2], vec![4]] {
        let world: usize = shape.iter().product();
        // One body on the host and on the emulated device: the same norm and gradients.
        let runs = on_both(|device| {
            let comms = hypershard_collectives::local::spawn_world(world).expect("world");
            let mesh_shape = shape.clone();
            hypershard_testkit::run_ranks(world, move |rank| {
                let mesh = dp_mesh(&mesh_shape, comms[rank].clone())?;
                let config = FullyShardConfig::new(mesh.clone());
                let device = rank_device(device, rank);
                let mut model = shard_model(moved(mlp(&DIMS, DType::F32), device), &config)?;
                let (x, y) = batch(0, DIMS[0], DIMS[3], DType::F32);
                let out = model.forward(&on(&local_rows(&x, rank, world), device))?;
                let loss = mse_loss(&out, &on(&local_rows(&y, rank, world), device))?;
                model.backward(&loss.grad)?;
                let norm = model.clip_grad_norm(max_norm)?;
                let mut grads = Params::new();
                model.visit_params("", &mut |name, p| {
                    let g = p.grad.as_ref().expect("grad");
                    assert_eq!(
                        g.device(),
                        device,
                        "{name}: the gradient stays on the device"
                    );
                    let g = g.to_host()?;
                    grads.insert(name.to_string(), (g.shape().to_vec(), g.to_f64_vec()?));
                    Ok(())
                })?;
                Ok::<_, FsdpError>((
                    norm,
                    RankResult {
                        params: grads,
                        shard_rank: mesh.shard_rank(),
                        replicate_rank: mesh.replicate().map_or(0, |c| c.rank()),
                        extra: Vec::new(),
                    },
                ))
            })
            .expect("run")
        });
        for (host, emulated) in runs[0].iter().zip(&runs[1]) {
            assert_eq!(
                host.0.to_bits(),
                emulated.0.to_bits(),
                "mesh {shape:?}: norms"
            );
            assert_eq!(
                host.1.params, emulated.1.params,
                "mesh {shape:?}: gradients"
            );
        }
        let results = runs.into_iter().next().expect("invariant: the host run");
        for (norm, _) in &results {
            assert!(
                (norm - want_norm).abs() <= 1e-5 * want_norm,
                "mesh {shape:?}: norm {norm} vs {want_norm}"
            );
        }
        assert!(want_norm > max_norm, "the test must actually clip");
        let ranks: Vec<RankResult> = results.into_iter().map(|(_, r)| r).collect();
        let got = assemble(&ranks, &dim0, &none);
        assert!(max_rel_err(&got, &want_grads) <= 1e-5, "mesh {shape:?}");
    }
}

const UNITS: usize = 6;
const WIDTH: usize = 64;

fn wide_model() -> Sequential {
    let layers: Vec<Box<dyn Module>> = (0..UNITS)
        .map(|i| {
            Box::new(
                Linear::new(LinearConfig {
                    in_features: WIDTH,
                    out_features: WIDTH,
                    bias: true,
                    dtype: DType::F32,
                    seed: 2 * i as u64,
                })
                .expect("layer"),
            ) as Box<dyn Module>
        })
        .collect();
    Sequential::new(layers)
}

/// Peak tensor-storage bytes of rank 0 during forward, and during forward + backward, above
/// what it held before: host memory for a host run, the device's memory for a device run
/// (its collectives' staging buffers are host memory, counted apart).
fn peaks(reshard: ReshardAfterForward, device: Device) -> (usize, usize, usize) {
    let comms = hypershard_collectives::local::spawn_world(4).expect("world");
    let results = hypershard_testkit::run_ranks(4, move |rank| {
        let tracker = MemoryTracker::new();
        let _scope = tracker.enter();
        let device = rank_device(device, rank);
        let bytes = |tracker: &MemoryTracker| match device {
            Device::Cpu => tracker.stats(),
            _ => tracker.device_stats(&device),
        };
        let mesh = dp_mesh(&[4], comms[rank].clone())?;
        let mut config = FullyShardConfig::new(mesh);
        config.reshard_after_forward = reshard;
        let mut model = shard_model(moved(wide_model(), device), &config)?;
        let x = on(
            &hypershard_tensor::Tensor::ones(&[2, WIDTH], DType::F32)?,
            device,
        );
        let held = bytes(&tracker).live_bytes;
        tracker.reset_peak();
        let out = model.forward(&x)?;
        let forward_peak = bytes(&tracker).peak_bytes;
        model.backward(&on(
            &hypershard_tensor::Tensor::ones(out.shape(), DType::F32)?,
            device,
        ))?;
        let step_peak = bytes(&tracker).peak_bytes;
        Ok::<_, FsdpError>((held, forward_peak, step_peak))
    })
    .expect("run");
    results[0]
}

#[test]
fn peak_parameter_storage_at_world_4_stays_within_shards_plus_two_units() {
    let unit_bytes = (WIDTH * WIDTH + WIDTH) * 4;
    let total = UNITS * unit_bytes;
    // Activations here are a few rows of 64 floats; 8 KiB covers them and small temporaries.
    let slack = 8 << 10;
    for device in DEVICES {
        let (held, forward_peak, step_peak) = peaks(ReshardAfterForward::Reshard, device);
        // Before forward the rank holds its shards (total / 4, every weight splits evenly)
        // and x.
        assert!(held <= total / 4 + slack, "{device:?}: held {held}");
        let bound = total / 4 + 2 * unit_bytes + slack;
        assert!(
            forward_peak <= bound,
            "{device:?}: forward peak {forward_peak} > {bound}"
        );
        // Backward adds the sharded gradients and at most two units' full gradients.
        let step_bound = bound + total / 4 + 2 * unit_bytes;
        assert!(
            step_peak <= step_bound,
            "{device:?}: step peak {step_peak} > {step_bound}"
        );
        // The bound is tight enough to see the difference: keeping every unit unsharded after
        // forward exceeds it.
        let (_, keep_peak, _) = peaks(ReshardAfterForward::Keep, device);
        assert!(
            keep_peak > bound,
            "{device:?}: keep peak {keep_peak} should exceed {bound}"
        );
        assert!(keep_peak >= total / 4 + UNITS * unit_bytes - slack);
    }
}
