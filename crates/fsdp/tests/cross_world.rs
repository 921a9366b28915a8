//! Checkpoints across world sizes: train 2 steps at world 2, save (per-rank pieces, or the
//! full state dict), load into a fresh job at another world size or mesh shape and train 2
//! more steps. Losses and parameters equal the unsharded run of 4 steps.

mod common;

use std::collections::BTreeMap;
use std::sync::Arc;

use common::*;
use hypershard_collectives::Communicator;
use hypershard_fsdp::{FsdpError, FsdpModule, FullyShardConfig, SavedShard};
use hypershard_nn::optim::{Sgd, SgdConfig};
use hypershard_nn::{Module, mse_loss};
use hypershard_tensor::{DType, Device, Tensor};

/// Uneven layers, so the saved and loaded shards cut rows at different places.
const DIMS: [usize; 4] = [5, 7, 3, 2];
const SAVED_AT: usize = 2;
const TOTAL: usize = 4;

fn sgd() -> Sgd {
    Sgd::new(SgdConfig {
        lr: 0.1,
        ..SgdConfig::default()
    })
    .expect("invariant: valid lr")
}

/// The unsharded run: parameters after `TOTAL` steps and the loss of every step.
fn reference_run() -> (Params, Vec<f64>) {
    let mut model = mlp(&DIMS, DType::F32);
    let mut opt = sgd();
    let mut losses = Vec::new();
    for step in 0..TOTAL {
        let (x, y) = batch(step, DIMS[0], DIMS[3], DType::F32);
        let out = model.forward(&x).expect("forward");
        let loss = mse_loss(&out, &y).expect("loss");
        losses.push(loss.loss);
        model.backward(&loss.grad).expect("backward");
        opt.step(&mut model).expect("step");
        hypershard_nn::zero_grad(&mut model).expect("zero_grad");
    }
    (params_of(&model), losses)
}

/// Steps `steps` of a sharded job on this rank; returns the global loss of each (the mean of
/// equal-sized local means, all-reduced).
fn train_steps(
    model: &mut FsdpModule,
    comm: &Arc<dyn Communicator>,
    steps: std::ops::Range<usize>,
    device: Device,
) -> Result<Vec<f64>, FsdpError> {
    let mut opt = sgd();
    let (rank, world) = (comm.rank(), comm.size());
    let mut losses = Vec::new();
    for step in steps {
        let (x, y) = batch(step, DIMS[0], DIMS[3], DType::F32);
        let (x, y) = (
            on(&local_rows(&x, rank, world), device),
            on(&local_rows(&y, rank, world), device),
        );
        let out = model.forward(&x)?;
        let loss = mse_loss(&out, &y)?;
        model.backward(&loss.grad)?;
        opt.step(model)?;
        model.zero_grad()?;
        let sum = comm
            .all_reduce(
                hypershard_collectives::Buffer::from_vec(vec![loss.loss]),
                hypershard_collectives::ReduceOp::Avg,
            )?
            .into_vec::<f64>()?;
        losses.push(sum[0]);
    }
    Ok(losses)
}

/// What the first job left.
struct Saved {
    pieces: BTreeMap<String, Vec<SavedShard>>,
    full: BTreeMap<String, Tensor>,
    losses: Vec<f64>,
}

fn first_job(comms: Vec<Arc<dyn Communicator>>, device: Device) -> Saved {
    let world = comms.len();
    let per_rank = hypershard_testkit::run_ranks(world, move |rank| {
        let comm = comms[rank].clone();
        let config = FullyShardConfig::new(dp_mesh(&[world], comm.clone())?);
        let device = rank_device(device, rank);
        let mut model = shard_model(moved(mlp(&DIMS, DType::F32), device), &config)?;
        let losses = train_steps(&mut model, &comm, 0..SAVED_AT, device)?;
        let pieces = model.saved_shards()?;
        let full = model.full_state_dict()?;
        // What a checkpoint writes is host memory, whatever the module's device.
        for piece in pieces.values() {
            assert_eq!(piece.tensor.device(), Device::Cpu);
        }
        for tensor in full.values() {
            assert_eq!(tensor.device(), Device::Cpu);
        }
        Ok::<_, FsdpError>((pieces, full, losses))
    })
    .unwrap_or_else(|e| panic!("first job: {e}"));
    let mut saved = Saved {
        pieces: BTreeMap::new(),
        full: BTreeMap::new(),
        losses: per_rank[0].2.clone(),
    };
    for (pieces, full, _) in per_rank {
        for (name, piece) in pieces {
            saved.pieces.entry(name).or_default().push(piece);
        }
        saved.full.extend(full);
    }
    saved
}

#[derive(Clone, Copy, PartialEq, Debug)]
enum Form {
    Pieces,
    Full,
}

/// The second job on a local world of `mesh_shape`, loading `form`; checks it against the
/// reference.
fn second_job(saved: &Arc<Saved>, mesh_shape: &[usize], form: Form, device: Device) -> Vec<f64> {
    let (want_params, want_losses) = reference_run();
    for (got, want) in saved.losses.iter().zip(&want_losses) {
        assert!((got - want).abs() <= 1e-5 * want.abs(), "{got} vs {want}");
    }
    let world: usize = mesh_shape.iter().product();
    let comms = hypershard_collectives::local::spawn_world(world).expect("local world");
    let saved = saved.clone();
    let shape = mesh_shape.to_vec();
    let results = hypershard_testkit::run_ranks(world, move |rank| {
        let comm = comms[rank].clone();
        let mesh = dp_mesh(&shape, comm.clone())?;
        let config = FullyShardConfig::new(mesh.clone());
        let device = rank_device(device, rank);
        let mut model = shard_model(moved(mlp(&DIMS, DType::F32), device), &config)?;
        match form {
            Form::Pieces => model.load_saved_shards(&saved.pieces)?,
            // Every rank reads the full file (rank 0 of the first job wrote it).
            Form::Full => model.load_state_dict(&saved.full)?,
        }
        let losses = train_steps(&mut model, &comm, SAVED_AT..TOTAL, device)?;
        Ok::<_, FsdpError>((
            RankResult {
                params: params_of(&model),
                shard_rank: mesh.shard_rank(),
                replicate_rank: mesh.replicate().map_or(0, |c| c.rank()),
                extra: Vec::new(),
            },
            losses,
        ))
    })
    .unwrap_or_else(|e| panic!("second job {mesh_shape:?} {form:?} {device:?}: {e}"));
    let losses = results[0].1.clone();
    for (got, want) in results[0].1.iter().zip(&want_losses[SAVED_AT..]) {
        let rel = (got - want).abs() / want.abs();
        assert!(rel <= 1e-5, "{mesh_shape:?} {form:?}: loss {got} vs {want}");
    }
    let ranks: Vec<RankResult> = results.into_iter().map(|(r, _)| r).collect();
    let got = assemble(&ranks, &dim0, &none);
    let err = max_rel_err(&got, &want_params);
    assert!(err <= 1e-5, "{mesh_shape:?} {form:?}: max rel err {err}");
    losses
}

/// A checkpoint saved on `saved_on` and resumed at `mesh_shape` on both devices: the same
/// losses bit for bit.
fn resume_on_both(saved: &Arc<Saved>, mesh_shape: &[usize], form: Form) {
    let losses = on_both(|device| second_job(saved, mesh_shape, form, device));
    let bits = |l: &[f64]| l.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
    assert_eq!(
        bits(&losses[0]),
        bits(&losses[1]),
        "{mesh_shape:?} {form:?}"
    );
}

#[test]
fn saved_at_world_2_loads_at_worlds_1_3_4_and_2x2() {
    // Saved on either device, resumed on either: one checkpoint format.
    for saved_on in DEVICES {
        let comms = hypershard_collectives::local::spawn_world(2).expect("local world");
        let saved = Arc::new(first_job(comms, saved_on));
        for shape in [vec![3], vec![4], vec![1], vec![2, 2]] {
            for form in [Form::Pieces, Form::Full] {
                resume_on_both(&saved, &shape, form);
            }
        }
    }
}

#[test]
fn saved_on_tcp_at_world_3_loads_at_world_2() {
    for device in DEVICES {
        let saved = Arc::new(first_job(tcp_world(3), device));
        resume_on_both(&saved, &[2], Form::Pieces);
    }
}

#[test]
fn incomplete_or_mismatched_pieces_are_typed_errors_and_change_nothing() {
    let comms = hypershard_collectives::local::spawn_world(2).expect("local world");
    let saved = first_job(comms, Device::Cpu);
    let comms = hypershard_collectives::local::spawn_world(3).expect("local world");
    let saved = Arc::new(saved);
    hypershard_testkit::run_ranks(3, move |rank| {
        // The same refusals for a module on the host and on the emulated device.
        for device in DEVICES {
            let config = FullyShardConfig::new(dp_mesh(&[3], comms[rank].clone())?);
            let device = rank_device(device, rank);
            let mut model = shard_model(moved(mlp(&DIMS, DType::F32), device), &config)?;
            let before = params_of(&model);
            // Only the first job's rank-0 pieces: ranks whose box reaches past them fail.
            let mut partial = saved.pieces.clone();
            for pieces in partial.values_mut() {
                pieces.truncate(1);
            }
            let result = model.load_saved_shards(&partial);
            // Rank 0's box of `0.weight` (rows 0..3 of 7) lies in saved rank 0's rows 0..4, but
            // rank 2's (rows 6..7) does not.
            if rank == 2 {
                assert!(
                    matches!(&result, Err(FsdpError::SavedShardsIncomplete { .. })),
                    "{result:?}"
                );
                assert_eq!(params_of(&model), before);
            }
            // A piece of another global shape.
            let mut wrong = saved.pieces.clone();
            if let Some(pieces) = wrong.get_mut("0.weight") {
                pieces[0].global_shape = vec![8, 5];
            }
            let result = model.load_saved_shards(&wrong);
            assert!(
                matches!(&result, Err(FsdpError::StateDictShape { name, .. }) if name == "0.weight"),
                "{result:?}"
            );
            let mut missing = saved.pieces.clone();
            missing.remove("2.bias");
            let result = model.load_saved_shards(&missing);
            assert!(
                matches!(&result, Err(FsdpError::StateDictMissing { name }) if name == "2.bias"),
                "{result:?}"
            );
        }
        Ok::<_, FsdpError>(())
    })
    .unwrap_or_else(|e| panic!("{e}"));
}
