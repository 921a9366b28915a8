//! `fully_shard_group`: a list of modules sharing one unit (FSDP2's `fully_shard([m1, m2])`).
//! Parity with the unsharded run, exact collective counts, and misuse.

mod common;

use std::sync::Arc;

use common::*;
use hypershard_collectives::{CommCounter, Communicator, OpKind};
use hypershard_fsdp::{
    DataParallelMesh, FsdpError, FsdpModule, FullyShardConfig, ReshardAfterForward, fully_shard,
    fully_shard_children, fully_shard_group,
};
use hypershard_nn::{Identity, Linear, LinearConfig, Module, Relu, Sequential, mse_loss};
use hypershard_tensor::{DType, Device, Tensor};

/// Uneven layers: children "0" = Linear(5,3), "2" = Linear(3,7), "4" = Linear(7,2).
const DIMS: [usize; 4] = [5, 3, 7, 2];
const TOL: f64 = 1e-5;
const STEPS: usize = 3;

/// Moves the children named in `members` out of `model` into one group, puts the members
/// back in their places, wraps every other child with parameters as a unit of its own, and
/// the model as the root.
fn shard_with_group(
    mut model: Sequential,
    members: &[&str],
    config: &FullyShardConfig,
) -> Result<FsdpModule, FsdpError> {
    let mut taken: Vec<Box<dyn Module>> = Vec::new();
    model.visit_children_mut(&mut |name, slot| {
        if members.contains(&name) {
            taken.push(std::mem::replace(slot, Box::new(Identity)));
        }
        Ok(())
    })?;
    let mut units = fully_shard_group(taken, config.clone())?.into_iter();
    model.visit_children_mut(&mut |name, slot| {
        if members.contains(&name)
            && let Some(unit) = units.next()
        {
            *slot = Box::new(unit);
        }
        Ok(())
    })?;
    fully_shard_children(&mut model, config, &mut |name, m| {
        !members.contains(&name) && hypershard_fsdp::has_params(m)
    })?;
    Ok(fully_shard(Box::new(model), config.clone())?)
}

/// Trains `STEPS` steps of `micro` micro-batches (all but the last without gradient sync,
/// and kept unsharded between them with `keep_between_micro`)
/// on this rank; returns its local parameters, and checks the full state dict on rank 0.
fn train_grouped(
    comm: Arc<dyn Communicator>,
    mesh_shape: &[usize],
    members: &[&str],
    configure: &(dyn Fn(&mut FullyShardConfig) + Send + Sync),
    (micro, keep_between_micro): (usize, bool),
    want: &Params,
    device: Device,
) -> Result<RankResult, FsdpError> {
    let mesh = dp_mesh(mesh_shape, comm)?;
    let mut config = FullyShardConfig::new(mesh.clone());
    configure(&mut config);
    let device = rank_device(device, mesh.rank());
    let mut model = shard_with_group(moved(mlp(&DIMS, DType::F32), device), members, &config)?;
    let mut optimizer = Optimizer::new(Opt::Sgd);
    let dp_world = mesh.world().size();
    let dp_rank = mesh.rank();
    for step in 0..STEPS {
        for m in 0..micro {
            model.set_requires_gradient_sync(m + 1 == micro);
            if keep_between_micro {
                model.set_reshard_after_backward(m + 1 == micro);
            }
            let (x, y) = batch(step * micro + m, DIMS[0], DIMS[3], DType::F32);
            let (x, y) = (
                on(&local_rows(&x, dp_rank, dp_world), device),
                on(&local_rows(&y, dp_rank, dp_world), device),
            );
            let out = model.forward(&x)?;
            let loss = mse_loss(&out, &y)?;
            model.backward(&loss.grad)?;
        }
        optimizer.step(&mut model)?;
        model.zero_grad()?;
    }
    // The full state dict names and shapes the members' parameters as the plain model does.
    let full = model.full_state_dict()?;
    if dp_rank == 0 {
        let got: Params = full
            .iter()
            .map(|(name, t)| {
                (
                    name.clone(),
                    (t.shape().to_vec(), t.to_f64_vec().expect("f64")),
                )
            })
            .collect();
        let err = max_rel_err(&got, want);
        assert!(err <= TOL, "full state dict: max rel err {err}");
    }
    Ok(RankResult {
        params: params_of(&model),
        shard_rank: mesh.shard_rank(),
        replicate_rank: mesh.replicate().map_or(0, |c| c.rank()),
        extra: Vec::new(),
    })
}

fn check(
    mesh_shape: &[usize],
    members: &'static [&'static str],
    configure: Arc<dyn Fn(&mut FullyShardConfig) + Send + Sync>,
    micro: usize,
    keep_between_micro: bool,
) {
    let want = Arc::new(reference(&DIMS, DType::F32, Opt::Sgd, STEPS, micro));
    let world: usize = mesh_shape.iter().product();
    let mut runs = on_both(|device| {
        let comms = hypershard_collectives::local::spawn_world(world).expect("local world");
        let shape = mesh_shape.to_vec();
        let want_ranks = want.clone();
        let configure = configure.clone();
        hypershard_testkit::run_ranks(world, move |rank| {
            train_grouped(
                comms[rank].clone(),
                &shape,
                members,
                configure.as_ref(),
                (micro, keep_between_micro),
                &want_ranks,
                device,
            )
        })
        .unwrap_or_else(|e| panic!("grouped run on {device:?} failed: {e}"))
    });
    let on_device = runs.pop().expect("invariant: two runs");
    let results = runs.pop().expect("invariant: two runs");
    assert_same_results(&results, &on_device);
    check_shard_shapes(&results, &want, &dim0, &none);
    let got = assemble(&results, &dim0, &none);
    let err = max_rel_err(&got, &want);
    assert!(
        err <= TOL,
        "mesh {mesh_shape:?} members {members:?}: max rel err {err}"
    );
}

fn defaults() -> Arc<dyn Fn(&mut FullyShardConfig) + Send + Sync> {
    Arc::new(|_: &mut FullyShardConfig| {})
}

#[test]
fn adjacent_members_match_unsharded_at_worlds_1_2_3_and_hsdp_2x2() {
    for shape in [&[1][..], &[2], &[3], &[2, 2]] {
        check(shape, &["0", "2"], defaults(), 1, false);
    }
}

#[test]
fn members_with_another_unit_between_them_match_unsharded() {
    for shape in [&[2][..], &[3], &[2, 2]] {
        check(shape, &["0", "4"], defaults(), 1, false);
    }
}

#[test]
fn one_group_of_every_layer_matches_unsharded_with_each_post_forward_policy() {
    check(&[3], &["0", "2", "4"], defaults(), 1, false);
    check(
        &[3],
        &["0", "2", "4"],
        Arc::new(|c: &mut FullyShardConfig| c.reshard_after_forward = ReshardAfterForward::Keep),
        1,
        false,
    );
    check(
        &[4],
        &["0", "2"],
        Arc::new(|c: &mut FullyShardConfig| {
            c.reshard_after_forward = ReshardAfterForward::ToGroupOf(2)
        }),
        1,
        false,
    );
}

#[test]
fn a_group_accumulates_gradients_without_sync_and_matches_unsharded() {
    check(&[3], &["0", "4"], defaults(), 2, false);
    check(&[2, 2], &["0", "2"], defaults(), 2, false);
}

#[test]
fn a_group_kept_unsharded_between_micro_steps_matches_unsharded() {
    // `set_reshard_after_backward(false)` on all but the last micro-step: the members keep
    // their unsharded parameters and gradients across backward.
    check(&[3], &["0", "4"], defaults(), 2, true);
    check(&[2, 2], &["0", "2", "4"], defaults(), 3, true);
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Counts {
    all_gather: u64,
    reduce_scatter: u64,
    all_reduce: u64,
}

fn counts_of(counter: &CommCounter) -> Counts {
    Counts {
        all_gather: counter.calls(OpKind::AllGather),
        reduce_scatter: counter.calls(OpKind::ReduceScatter),
        all_reduce: counter.calls(OpKind::AllReduce),
    }
}

/// Per rank: the counts on the world communicator and on each one split from it, after
/// `STEPS` steps on `device`.
fn count(
    mesh_shape: &[usize],
    members: &'static [&'static str],
    device: Device,
) -> Vec<(Counts, Vec<Counts>)> {
    let world: usize = mesh_shape.iter().product();
    let counters = counted_world(world);
    let shape = mesh_shape.to_vec();
    let want = Arc::new(reference(&DIMS, DType::F32, Opt::Sgd, STEPS, 1));
    hypershard_testkit::run_ranks(world, move |rank| {
        let comm: Arc<dyn Communicator> = counters[rank].clone();
        train_grouped(comm, &shape, members, &|_| {}, (1, false), &want, device)?;
        let counts = counts_of(&counters[rank]);
        let children = counters[rank]
            .children()
            .iter()
            .map(|c| counts_of(c))
            .collect();
        Ok::<_, FsdpError>((counts, children))
    })
    .unwrap_or_else(|e| panic!("on {device:?}: {e}"))
}

#[test]
fn a_group_issues_one_gather_per_pass_and_one_reduce_scatter_per_backward() {
    // The device moves no collective: the same counts on the host and the emulated device.
    for device in DEVICES {
        check_counts(device);
    }
}

fn check_counts(device: Device) {
    let steps = STEPS as u64;
    for world in [2, 3] {
        // Two units: the group {0, 2} and the unit of child 4. The full state dict at the end
        // adds one gather per parameter, which is not an all-gather.
        for (counts, _) in count(&[world], &["0", "2"], device) {
            assert_eq!(
                counts,
                Counts {
                    all_gather: steps * 2 * 2,
                    reduce_scatter: steps * 2,
                    all_reduce: 0
                },
                "world {world} on {device:?}"
            );
        }
        // One unit holding every layer.
        for (counts, _) in count(&[world], &["0", "2", "4"], device) {
            assert_eq!(
                counts,
                Counts {
                    all_gather: steps * 2,
                    reduce_scatter: steps,
                    all_reduce: 0
                },
                "world {world} on {device:?}"
            );
        }
    }
    // HSDP: the shard group (split second) gathers and reduce-scatters, the replicate group
    // all-reduces once per unit per backward.
    for (world_counts, children) in count(&[2, 2], &["0", "4"], device) {
        assert_eq!(
            world_counts.all_gather + world_counts.reduce_scatter,
            0,
            "{device:?}"
        );
        assert_eq!(
            children[1],
            Counts {
                all_gather: steps * 2 * 2,
                reduce_scatter: steps * 2,
                all_reduce: 0
            },
            "{device:?}"
        );
        assert_eq!(children[0].all_reduce, steps * 2, "{device:?}");
    }
}

fn one_rank_config() -> FullyShardConfig {
    let comm = hypershard_collectives::local::spawn_world(1)
        .expect("world")
        .remove(0);
    FullyShardConfig::new(DataParallelMesh::fsdp(comm).expect("mesh"))
}

/// A Linear layer with its parameters on `device`.
fn linear(in_features: usize, out_features: usize, seed: u64, device: Device) -> Box<dyn Module> {
    let layer = Linear::new(LinearConfig {
        in_features,
        out_features,
        bias: true,
        dtype: DType::F32,
        seed,
    })
    .expect("layer");
    Box::new(moved(layer, device))
}

fn order_error(result: Result<Tensor, FsdpError>) -> (&'static str, usize, Option<usize>) {
    match result {
        Err(FsdpError::GroupOrder {
            op,
            member,
            expected,
            ..
        }) => (op, member, expected),
        other => panic!("expected GroupOrder, got {other:?}"),
    }
}

#[test]
fn members_out_of_order_give_typed_errors_and_the_group_recovers() {
    // The same refusals on the host and the emulated device, and between them the calls
    // that run give the host's values on the device.
    let runs = on_both(members_out_of_order);
    assert_eq!(
        runs[0], runs[1],
        "the emulated device's run differs from the host's"
    );
}

/// The order checks on `device`; the outputs of the calls that ran, read on the host.
fn members_out_of_order(device: Device) -> Vec<Vec<f64>> {
    let read = |t: Tensor| {
        t.to_host()
            .and_then(|t| t.to_f64_vec())
            .expect("invariant: a materialised f32 tensor copies to the host")
    };
    let config = one_rank_config();
    let mut members = fully_shard_group(
        vec![linear(4, 3, 1, device), linear(3, 2, 2, device)],
        config,
    )
    .expect("group");
    assert_eq!(members[1].member(), 1);
    assert_eq!(members[1].params()[0].global_shape, vec![2, 3]);
    let ones = |shape: &[usize]| on(&Tensor::ones(shape, DType::F32).expect("ones"), device);
    let (x, h, g) = (ones(&[2, 4]), ones(&[2, 3]), ones(&[2, 2]));
    // The second member cannot run first.
    assert_eq!(order_error(members[1].forward(&h)), ("forward", 1, Some(0)));
    let mut ran = vec![read(members[0].forward(&x).expect("member 0"))];
    // Nor can the first run twice in one pass.
    assert_eq!(order_error(members[0].forward(&x)), ("forward", 0, Some(1)));
    ran.push(read(members[1].forward(&h).expect("member 1")));
    // Backward runs in reverse list order.
    assert_eq!(
        order_error(members[0].backward(&h)),
        ("backward", 0, Some(1))
    );
    ran.push(read(members[1].backward(&g).expect("member 1 backward")));
    // A new forward may not start while the group's backward is half done.
    assert_eq!(order_error(members[0].forward(&x)), ("forward", 0, None));
    ran.push(read(members[0].backward(&h).expect("member 0 backward")));
    assert!(members[0].params()[0].state == hypershard_fsdp::ShardedState::Sharded);
    // No backward without a forward first.
    ran.push(read(members[0].forward(&x).expect("member 0 again")));
    assert_eq!(order_error(members[1].backward(&g)), ("backward", 1, None));
    ran
}

#[test]
fn wrapping_a_member_again_or_grouping_it_twice_is_refused_unchanged() {
    // The same refusals, with every module handed back on its device, on both devices.
    for device in DEVICES {
        wrapping_again_is_refused(device);
    }
}

fn wrapping_again_is_refused(device: Device) {
    let config = one_rank_config();
    let mut members = fully_shard_group(
        vec![linear(4, 3, 1, device), linear(3, 2, 2, device)],
        config.clone(),
    )
    .expect("group");
    let second = members.pop().expect("member");
    // A member wrapped again on its own.
    let rejected = fully_shard(Box::new(second), config.clone()).expect_err("wrapped twice");
    assert!(matches!(rejected.error, FsdpError::AlreadySharded));
    // A member of one group put into another: refused, naming it, with every module back.
    let rejected = fully_shard_group(
        vec![linear(5, 4, 3, device), rejected.module],
        config.clone(),
    )
    .expect_err("in two groups");
    match &rejected.error {
        FsdpError::GroupMember { member: 1, source } => {
            assert!(matches!(**source, FsdpError::AlreadySharded))
        }
        other => panic!("expected GroupMember, got {other:?}"),
    }
    assert_eq!(rejected.modules.len(), 2);
    let mut shapes = Vec::new();
    rejected.modules[0]
        .visit_params("", &mut |_, p| {
            assert_eq!(p.data()?.device(), device, "handed back where it was");
            shapes.push(p.data()?.shape().to_vec());
            Ok(())
        })
        .expect("visit");
    assert_eq!(shapes, vec![vec![4, 5], vec![4]]);
    // An empty list.
    let rejected = fully_shard_group(Vec::new(), config.clone()).expect_err("empty");
    assert!(matches!(rejected.error, FsdpError::EmptyGroup));
    // A parent wrapped by fully_shard leaves a member's parameters to the member's unit.
    let mut others = fully_shard_group(
        vec![linear(2, 2, 5, device), linear(2, 2, 6, device)],
        config.clone(),
    )
    .expect("group");
    let member: Box<dyn Module> = Box::new(others.remove(0));
    let parent = Sequential::new(vec![Box::new(Relu::new()), member]);
    let root = fully_shard(Box::new(parent), config).expect("root");
    assert!(root.params().is_empty());
}
