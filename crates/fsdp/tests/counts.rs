//! Exact collective counts: one all-gather per unit per forward and per backward (when
//! resharded), one reduce-scatter (+ one all-reduce for HSDP) per unit per backward.

mod common;

use std::sync::Arc;

use common::*;
use hypershard_collectives::{CommCounter, Communicator, OpKind};
use hypershard_fsdp::{CommFusionPolicy, FsdpModule, FullyShardConfig, ReshardAfterForward};
use hypershard_tensor::DType;

/// Three Linear units (each with weight and bias) under a root without parameters.
const DIMS: [usize; 4] = [5, 3, 7, 2];
const UNITS: u64 = 3;

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

/// Runs `steps` steps and returns, per rank, the counts on the world communicator and on each
/// communicator split from it (in split order): on the host and on the emulated device,
/// whose counts must be the same (staging adds copies, never collectives).
fn count(
    mesh_shape: &[usize],
    steps: usize,
    configure: Arc<Configure>,
) -> Vec<(Counts, Vec<Counts>)> {
    let mut both = on_both(|device| count_on(mesh_shape, steps, device, configure.clone()));
    let on_device = both.pop().expect("invariant: two runs");
    let on_host = both.pop().expect("invariant: two runs");
    assert_eq!(
        on_host, on_device,
        "mesh {mesh_shape:?}: host and emulated counts"
    );
    on_host
}

fn count_on(
    mesh_shape: &[usize],
    steps: usize,
    device: hypershard_tensor::Device,
    configure: Arc<Configure>,
) -> Vec<(Counts, Vec<Counts>)> {
    let world: usize = mesh_shape.iter().product();
    let counters = counted_world(world);
    let mesh_shape = mesh_shape.to_vec();
    hypershard_testkit::run_ranks(world, move |rank| {
        let run = Run {
            dims: DIMS.to_vec(),
            dtype: DType::F32,
            opt: Opt::Sgd,
            steps,
            micro: 1,
            mesh_shape: mesh_shape.clone(),
        };
        let comm: Arc<dyn Communicator> = counters[rank].clone();
        train_rank_on(
            &run,
            comm,
            device,
            configure.as_ref(),
            &|_: &mut FsdpModule, _, _| {},
        )?;
        let children = counters[rank]
            .children()
            .iter()
            .map(|c| counts_of(c))
            .collect();
        Ok::<_, hypershard_fsdp::FsdpError>((counts_of(&counters[rank]), children))
    })
    .unwrap_or_else(|e| panic!("{e}"))
}

#[test]
fn fused_fsdp_issues_one_gather_per_unit_per_pass_and_one_reduce_scatter() {
    for world in [1, 2, 3] {
        // One rank has nothing to gather or reduce: its units issue no collective at all.
        let collectives = u64::from(world > 1);
        for (world_counts, children) in count(&[world], 2, Arc::new(|_: &mut FullyShardConfig| {}))
        {
            assert_eq!(
                world_counts,
                Counts {
                    all_gather: 2 * 2 * UNITS * collectives,
                    reduce_scatter: 2 * UNITS * collectives,
                    all_reduce: 0
                },
                "world {world}"
            );
            assert!(children.is_empty());
        }
    }
}

#[test]
fn keep_after_forward_skips_the_backward_gather() {
    let configure =
        Arc::new(|c: &mut FullyShardConfig| c.reshard_after_forward = ReshardAfterForward::Keep);
    for (world_counts, _) in count(&[2], 1, configure) {
        assert_eq!(
            world_counts,
            Counts {
                all_gather: UNITS,
                reduce_scatter: UNITS,
                all_reduce: 0
            }
        );
    }
}

#[test]
fn unfused_issues_one_collective_per_parameter() {
    let configure = Arc::new(|c: &mut FullyShardConfig| {
        c.comm_fusion = CommFusionPolicy {
            enabled: false,
            ..CommFusionPolicy::default()
        }
    });
    for (world_counts, _) in count(&[2], 1, configure) {
        assert_eq!(
            world_counts,
            Counts {
                all_gather: 2 * 2 * UNITS,
                reduce_scatter: 2 * UNITS,
                all_reduce: 0
            }
        );
    }
}

#[test]
fn hsdp_adds_one_all_reduce_per_unit_on_the_replicate_group() {
    for (world_counts, children) in count(&[2, 2], 1, Arc::new(|_: &mut FullyShardConfig| {})) {
        assert_eq!(
            world_counts,
            Counts {
                all_gather: 0,
                reduce_scatter: 0,
                all_reduce: 0
            }
        );
        // Split order (one communicator per mesh dim): the replicate group, then the shard group.
        assert_eq!(children.len(), 2);
        assert_eq!(
            children[1],
            Counts {
                all_gather: 2 * UNITS,
                reduce_scatter: UNITS,
                all_reduce: 0
            }
        );
        assert_eq!(
            children[0],
            Counts {
                all_gather: 0,
                reduce_scatter: 0,
                all_reduce: UNITS
            }
        );
    }
}

#[test]
fn smaller_post_forward_group_gathers_backward_within_it() {
    let configure = Arc::new(|c: &mut FullyShardConfig| {
        c.reshard_after_forward = ReshardAfterForward::ToGroupOf(2)
    });
    for (world_counts, children) in count(&[4], 1, configure) {
        assert_eq!(
            world_counts,
            Counts {
                all_gather: UNITS,
                reduce_scatter: UNITS,
                all_reduce: 0
            }
        );
        assert_eq!(children.len(), 1);
        assert_eq!(children[0].all_gather, UNITS);
        assert_eq!(children[0].reduce_scatter, 0);
    }
}
