//! fully_shard on a deferred (shape-only) model: each rank materialises only its shard, equal
//! bit for bit to the same shard of the eagerly built model, and training is unchanged.

mod common;

use std::sync::Arc;

use common::{DEVICES, dp_mesh, moved, on, rank_device};
use hypershard_collectives::Communicator;
use hypershard_fsdp::{
    FsdpError, FsdpModule, FullyShardConfig, fully_shard, fully_shard_children, has_params,
};
use hypershard_nn::optim::{AdamW, AdamWConfig};
use hypershard_nn::{DEFAULT_IGNORE_INDEX, Gpt, GptConfig, Module, cross_entropy};
use hypershard_tensor::memory::MemoryTracker;
use hypershard_tensor::{DType, Device, Tensor};

/// Shapes that no world of 2, 3 or 4 divides: 67 vocabulary rows, 13 positions, 3·10 = 30
/// rows of c_attn, 40 of c_fc.
fn uneven_gpt() -> GptConfig {
    GptConfig {
        vocab_size: 67,
        block_size: 13,
        n_layer: 2,
        n_head: 2,
        n_embd: 10,
        bias: true,
        dropout: 0.0,
        dtype: DType::F32,
        seed: 3,
    }
}

/// Wraps every block, then the root, as `hypershard train` does.
fn shard_gpt(mut gpt: Gpt, config: &FullyShardConfig) -> Result<FsdpModule, FsdpError> {
    fully_shard_children(&mut gpt, config, &mut |name, block| {
        name.starts_with("transformer.h.") && has_params(block)
    })?;
    fully_shard(Box::new(gpt), config.clone()).map_err(|rejected| rejected.error)
}

fn build(config: GptConfig, deferred: bool) -> Gpt {
    let built = if deferred {
        Gpt::new_deferred(config)
    } else {
        Gpt::new(config)
    };
    built.expect("invariant: valid config")
}

/// Every local shard's bytes, by name.
fn local_bytes(model: &dyn Module) -> Vec<(String, Vec<usize>, Vec<u8>)> {
    let mut out = Vec::new();
    model
        .visit_params("", &mut |name, param| {
            let data = param.data()?.to_host()?;
            out.push((name.to_string(), data.shape().to_vec(), data.to_bytes()?));
            Ok(())
        })
        .expect("invariant: every shard materialised");
    out
}

fn run_world<T: Send + 'static>(
    mesh_shape: &[usize],
    f: impl Fn(usize, Arc<dyn Communicator>) -> Result<T, FsdpError> + Send + Sync + 'static,
) -> Vec<T> {
    let world: usize = mesh_shape.iter().product();
    let comms = hypershard_collectives::local::spawn_world(world).expect("local world");
    hypershard_testkit::run_ranks(world, move |rank| f(rank, comms[rank].clone()))
        .unwrap_or_else(|e| panic!("run failed: {e}"))
}

#[test]
fn deferred_shards_equal_the_eager_shards_for_every_gpt_parameter() {
    // Deferred shards materialised on the unit's device (`FullyShardConfig::device`) equal
    // the eager host model's shards.
    for (mesh_shape, device) in [vec![1], vec![2], vec![3], vec![4], vec![2, 2]]
        .into_iter()
        .flat_map(|shape| DEVICES.map(|device| (shape.clone(), device)))
    {
        let shape = mesh_shape.clone();
        let results = run_world(&mesh_shape, move |rank, comm| {
            let mesh = dp_mesh(&shape, comm)?;
            let eager = shard_gpt(
                build(uneven_gpt(), false),
                &FullyShardConfig::new(mesh.clone()),
            )?;
            let mut config = FullyShardConfig::new(mesh);
            let device = rank_device(device, rank);
            config.device = Some(device);
            let deferred = shard_gpt(build(uneven_gpt(), true), &config)?;
            deferred.visit_params("", &mut |name, param| {
                assert_eq!(param.data()?.device(), device, "{name}");
                Ok(())
            })?;
            Ok((local_bytes(&deferred), local_bytes(&eager)))
        });
        for (rank, (deferred, eager)) in results.iter().enumerate() {
            assert_eq!(
                deferred.len(),
                2 + 2 * 12 + 2,
                "every parameter, mesh {mesh_shape:?}"
            );
            for (d, e) in deferred.iter().zip(eager) {
                assert_eq!(d.0, e.0);
                assert_eq!(
                    d.1, e.1,
                    "{} shape on rank {rank}, mesh {mesh_shape:?}",
                    d.0
                );
                assert!(
                    d.2 == e.2,
                    "{} bytes on rank {rank}, mesh {mesh_shape:?}",
                    d.0
                );
            }
        }
    }
}

/// Three AdamW steps of the uneven GPT on `mesh_shape` with every rank's model on `device`
/// (materialised there when deferred, moved there when eager); every rank's losses.
fn train_losses(mesh_shape: &[usize], deferred: bool, device: Device) -> Vec<Vec<f64>> {
    let shape = mesh_shape.to_vec();
    run_world(mesh_shape, move |rank, comm| {
        let mesh = dp_mesh(&shape, comm)?;
        let mut config = FullyShardConfig::new(mesh.clone());
        let device = rank_device(device, rank);
        let gpt = if deferred {
            config.device = Some(device);
            build(uneven_gpt(), true)
        } else {
            moved(build(uneven_gpt(), false), device)
        };
        let mut model = shard_gpt(gpt, &config)?;
        let mut optimizer = AdamW::new(AdamWConfig {
            lr: 1e-2,
            ..AdamWConfig::default()
        })?;
        let (dp_rank, dp_world) = (mesh.rank(), mesh.world().size());
        let (rows, seq) = (2, 7);
        let mut losses = Vec::new();
        for step in 0..3 {
            // Rank r's rows of a global batch whose token k is a formula of (step, k).
            let ids: Vec<i64> = (0..rows * seq)
                .map(|k| ((step * 31 + (dp_rank * rows * seq + k) * 7) % 67) as i64)
                .collect();
            let targets: Vec<i64> = ids.iter().map(|t| (t * 5 + 1) % 67).collect();
            let ids = on(&Tensor::from_vec(ids, &[rows, seq])?, device);
            let targets = on(&Tensor::from_vec(targets, &[rows * seq])?, device);
            let logits = model.forward(&ids)?;
            let loss = cross_entropy(
                &logits.view(&[rows * seq, 67])?,
                &targets,
                DEFAULT_IGNORE_INDEX,
            )?;
            model.backward(
                &loss
                    .grad
                    .scale(1.0 / dp_world as f64)?
                    .view(logits.shape())?,
            )?;
            optimizer.step(&mut model)?;
            model.zero_grad()?;
            losses.push(loss.loss);
        }
        Ok(losses)
    })
}

#[test]
fn training_from_deferred_init_gives_the_eager_losses_bitwise() {
    for mesh_shape in [vec![3], vec![2, 2]] {
        let eager = train_losses(&mesh_shape, false, Device::Cpu);
        let runs = DEVICES.into_iter().flat_map(|device| {
            [true, false]
                .into_iter()
                .filter(move |&deferred| deferred || device != Device::Cpu)
                .map(move |deferred| (device, deferred))
        });
        for (device, deferred_init) in runs {
            let deferred = train_losses(&mesh_shape, deferred_init, device);
            let mesh_shape = format!("{mesh_shape:?}, {device:?}, deferred {deferred_init}");
            assert_eq!(deferred.len(), eager.len());
            for (d, e) in deferred.iter().zip(&eager) {
                assert_eq!(d.len(), 3);
                assert!(d.iter().all(|l| l.is_finite()));
                let (db, eb): (Vec<u64>, Vec<u64>) = (
                    d.iter().map(|l| l.to_bits()).collect(),
                    e.iter().map(|l| l.to_bits()).collect(),
                );
                assert_eq!(db, eb, "mesh {mesh_shape}: {d:?} vs {e:?}");
            }
        }
    }
}

/// A GPT of 21.3 M parameters: 6 blocks of 3.15 M, a 2.1 M-row embedding.
fn twenty_million() -> GptConfig {
    GptConfig {
        vocab_size: 4096,
        block_size: 64,
        n_layer: 6,
        n_head: 8,
        n_embd: 512,
        bias: true,
        dropout: 0.0,
        dtype: DType::F32,
        seed: 1,
    }
}

#[test]
fn the_full_model_is_never_allocated_at_world_4() {
    let config = twenty_million();
    let total_params = build(config, true).num_params(false).expect("count");
    assert!(total_params >= 20_000_000, "{total_params}");
    let total = total_params * 4;
    // The largest unit: one block (12 C² weights + 13 C biases and norms) or the root (wte,
    // wpe, ln_f), whichever is larger.
    let c = config.n_embd;
    let block = (12 * c * c + 13 * c) * 4;
    let root = (config.vocab_size * c + config.block_size * c + 2 * c) * 4;
    let largest_unit = block.max(root);
    let peaks = run_world(&[4], move |rank, comm| {
        let tracker = MemoryTracker::new();
        let _scope = tracker.enter();
        let mesh = dp_mesh(&[4], comm.clone())?;
        let model = shard_gpt(build(config, true), &FullyShardConfig::new(mesh))?;
        let held = tracker.live_bytes();
        let peak = tracker.peak_bytes();
        drop(model);
        // Materialised on a device, the device holds the shards and the host at most one
        // block at a time on its way there.
        let device = Device::Emulated { ordinal: rank };
        tracker.reset_peak();
        let mut on_device = FullyShardConfig::new(dp_mesh(&[4], comm)?);
        on_device.device = Some(device);
        let model = shard_gpt(build(config, true), &on_device)?;
        let device_stats = tracker.device_stats(&device);
        drop(model);
        Ok((peak, held, tracker.peak_bytes(), device_stats))
    });
    // 64 KiB covers the per-unit bookkeeping tensors; activations do not exist yet.
    let slack = 64 << 10;
    for (rank, &(peak, held, staging_peak, device)) in peaks.iter().enumerate() {
        // On the device: the shards and nothing more, there and on the host on the way.
        assert!(
            device.peak_bytes <= total / 4 + slack,
            "rank {rank}: device peak {}",
            device.peak_bytes
        );
        assert!(device.live_bytes >= total / 4 - 4 * 1024, "{device:?}");
        assert!(
            staging_peak <= largest_unit / 4 + slack,
            "rank {rank}: host peak {staging_peak} while materialising on the device"
        );
        assert!(
            peak <= total / 4 + largest_unit + slack,
            "rank {rank}: peak {peak} B at start-up, model {total} B, largest unit {largest_unit} B"
        );
        // Each rank holds a quarter (rounded up per tensor) and never more than it needs.
        assert!(
            held >= total / 4 - 4 * 1024 && held <= total / 4 + slack,
            "{held}"
        );
        // Stronger than the bound above: no unit is ever built whole.
        assert!(peak <= total / 4 + slack, "rank {rank}: peak {peak}");
    }
}
