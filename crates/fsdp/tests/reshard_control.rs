//! `set_reshard_after_forward` after wrapping: switching the policy between steps keeps
//! parity with the unsharded run, moves the backward all-gather to the smaller group, and
//! refuses bad sizes and mid-step changes with typed errors that change nothing; each on the
//! host and on the emulated device, with the same values.

mod common;

use std::cell::Cell;
use std::sync::Arc;

use common::*;
use hypershard_collectives::{Communicator, OpKind};
use hypershard_fsdp::{FsdpError, FsdpModule, FullyShardConfig, ReshardAfterForward};
use hypershard_nn::mse_loss;
use hypershard_tensor::{DType, Device, Tensor};

const DIMS: [usize; 4] = [5, 3, 7, 2];

thread_local! {
    /// Micro-batches this rank's thread has started (each rank runs on its own thread).
    static STEP: Cell<usize> = const { Cell::new(0) };
}

/// The policy of step `s`: it cycles through every form.
fn policy_of(step: usize, shard_world: usize) -> ReshardAfterForward {
    let small = if shard_world.is_multiple_of(2) { 2 } else { 1 };
    [
        ReshardAfterForward::Keep,
        ReshardAfterForward::ToGroupOf(small),
        ReshardAfterForward::Reshard,
        ReshardAfterForward::ToGroupOf(shard_world),
    ][step % 4]
}

fn check_switching(mesh_shape: &[usize]) {
    let steps = 4;
    let want = reference(&DIMS, DType::F32, Opt::Sgd, steps, 1);
    let shard_world = *mesh_shape.last().expect("a non-empty mesh");
    let run = Run {
        dims: DIMS.to_vec(),
        dtype: DType::F32,
        opt: Opt::Sgd,
        steps,
        micro: 1,
        mesh_shape: mesh_shape.to_vec(),
    };
    let hook: Arc<MicroHook> = Arc::new(move |m: &mut FsdpModule, _, _| {
        let step = STEP.with(|s| {
            let step = s.get();
            s.set(step + 1);
            step
        });
        m.set_reshard_after_forward(policy_of(step, shard_world))
            .expect("every unit is resharded between steps");
    });
    let results = train_world(run, Arc::new(|_: &mut FullyShardConfig| {}), hook);
    let got = assemble(&results, &dim0, &none);
    let err = max_rel_err(&got, &want);
    assert!(err <= 1e-5, "mesh {mesh_shape:?}: max rel err {err}");
}

/// Rank `rank`'s quarter of the first batch, on `device`.
fn rank_batch(rank: usize, device: Device) -> (Tensor, Tensor) {
    let (x, y) = batch(0, DIMS[0], DIMS[3], DType::F32);
    (
        on(&local_rows(&x, rank, 4), device),
        on(&local_rows(&y, rank, 4), device),
    )
}

#[test]
fn switching_policies_between_steps_matches_unsharded() {
    for shape in [vec![2], vec![3], vec![4], vec![2, 2]] {
        check_switching(&shape);
    }
}

/// One step on a counted world of 4 after switching every unit to `ToGroupOf(2)`: the
/// backward all-gathers of the three nested units run on the 2-rank group, not the shard group.
/// On the host and the emulated device: the same counts and the same outputs.
#[test]
fn smaller_group_takes_the_backward_gathers() {
    let runs = on_both(|device| {
        let counters = counted_world(4);
        hypershard_testkit::run_ranks(4, move |rank| {
            let comm: Arc<dyn Communicator> = counters[rank].clone();
            let mesh = dp_mesh(&[4], comm)?;
            let config = FullyShardConfig::new(mesh.clone());
            let device = rank_device(device, rank);
            let mut model = shard_model(moved(mlp(&DIMS, DType::F32), device), &config)?;
            model.set_reshard_after_forward(ReshardAfterForward::ToGroupOf(2))?;
            let (x, y) = rank_batch(rank, device);
            let out = model.forward(&x)?;
            let loss = mse_loss(&out, &y)?;
            model.backward(&loss.grad)?;
            let world_gathers = counters[rank].calls(OpKind::AllGather);
            let small_gathers: u64 = counters[rank]
                .children()
                .iter()
                .map(|c| c.calls(OpKind::AllGather))
                .sum();
            let out = out.to_host()?.to_f64_vec()?;
            Ok::<_, FsdpError>((world_gathers, small_gathers, out))
        })
        .unwrap_or_else(|e| panic!("on {device:?}: {e}"))
    });
    for (device, results) in DEVICES.iter().zip(&runs) {
        for (world_gathers, small_gathers, _) in results {
            // Forward: 3 nested units over the shard (world) group; backward: 3 over the pair.
            assert_eq!((*world_gathers, *small_gathers), (3, 3), "{device:?}");
        }
    }
    assert_eq!(
        runs[0], runs[1],
        "the emulated device's run differs from the host's"
    );
}

#[test]
fn bad_sizes_and_mid_step_changes_are_typed_errors() {
    // The same refusals, changing nothing, whichever device the shards are on.
    on_both(|device| {
        let comms = hypershard_collectives::local::spawn_world(4).expect("local world");
        hypershard_testkit::run_ranks(4, move |rank| {
            let mesh = dp_mesh(&[4], comms[rank].clone())?;
            let config = FullyShardConfig::new(mesh);
            let device = rank_device(device, rank);
            let mut model = shard_model(moved(mlp(&DIMS, DType::F32), device), &config)?;
            let bad = model.set_reshard_after_forward(ReshardAfterForward::ToGroupOf(3));
            assert!(
                matches!(
                    bad,
                    Err(FsdpError::ReshardSize {
                        value: 3,
                        shard_world: 4
                    })
                ),
                "{device:?}: {bad:?}"
            );
            // Between forward and backward the nested units hold their post-forward shards
            // over the pair: refused, nothing changed.
            model.set_reshard_after_forward(ReshardAfterForward::ToGroupOf(2))?;
            let (x, y) = rank_batch(rank, device);
            let out = model.forward(&x)?;
            let mid = model.set_reshard_after_forward(ReshardAfterForward::Keep);
            assert!(
                matches!(mid, Err(FsdpError::InvalidState { .. })),
                "{device:?}: {mid:?}"
            );
            let loss = mse_loss(&out, &y)?;
            model.backward(&loss.grad)?;
            model.set_reshard_after_forward(ReshardAfterForward::Keep)?;
            Ok::<_, FsdpError>(())
        })
        .unwrap_or_else(|e| panic!("on {device:?}: {e}"))
    });
}
