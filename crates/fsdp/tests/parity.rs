//! Parity: N steps under fully_shard equal the unsharded single-rank run. `train_world` runs
//! each check on the host and again on the emulated device (every rank on a device of its
//! own), whose parameters must equal the host's bit for bit.

mod common;

use std::sync::Arc;

use common::*;
use hypershard_fsdp::{CommFusionPolicy, FsdpModule, FullyShardConfig, ReshardAfterForward};
use hypershard_tensor::DType;

/// Uneven layers: Linear(5,3), Linear(3,7), Linear(7,2).
const DIMS: [usize; 4] = [5, 3, 7, 2];
const TOL: f64 = 1e-5;

fn no_hook() -> Arc<MicroHook> {
    Arc::new(|_: &mut FsdpModule, _, _| {})
}

fn check(mesh_shape: &[usize], opt: Opt, configure: Arc<Configure>) {
    let want = reference(&DIMS, DType::F32, opt, 3, 1);
    let run = Run {
        dims: DIMS.to_vec(),
        dtype: DType::F32,
        opt,
        steps: 3,
        micro: 1,
        mesh_shape: mesh_shape.to_vec(),
    };
    let results = train_world(run, configure, no_hook());
    check_shard_shapes(&results, &want, &dim0, &none);
    let got = assemble(&results, &dim0, &none);
    let err = max_rel_err(&got, &want);
    assert!(err <= TOL, "mesh {mesh_shape:?} {opt:?}: max rel err {err}");
}

fn defaults() -> Arc<Configure> {
    Arc::new(|_: &mut FullyShardConfig| {})
}

#[test]
fn fsdp_sgd_matches_unsharded_at_worlds_1_to_4() {
    for world in 1..=4 {
        check(&[world], Opt::Sgd, defaults());
    }
}

#[test]
fn fsdp_adamw_matches_unsharded_at_worlds_2_and_3() {
    for world in [2, 3] {
        check(&[world], Opt::AdamW, defaults());
    }
}

#[test]
fn hsdp_matches_unsharded_on_2x2_1x3_and_2x1() {
    for shape in [[2, 2], [1, 3], [2, 1]] {
        check(&shape, Opt::Sgd, defaults());
    }
}

#[test]
fn unfused_and_zero_copy_match_unsharded() {
    check(
        &[3],
        Opt::Sgd,
        Arc::new(|c: &mut FullyShardConfig| {
            c.comm_fusion = CommFusionPolicy {
                enabled: false,
                ..CommFusionPolicy::default()
            }
        }),
    );
    check(
        &[2, 2],
        Opt::AdamW,
        Arc::new(|c: &mut FullyShardConfig| {
            c.comm_fusion = CommFusionPolicy {
                zero_copy: true,
                ..CommFusionPolicy::default()
            }
        }),
    );
}

#[test]
fn reshard_after_forward_keep_and_smaller_group_match_unsharded() {
    check(
        &[3],
        Opt::Sgd,
        Arc::new(|c: &mut FullyShardConfig| c.reshard_after_forward = ReshardAfterForward::Keep),
    );
    check(
        &[4],
        Opt::Sgd,
        Arc::new(|c: &mut FullyShardConfig| {
            c.reshard_after_forward = ReshardAfterForward::ToGroupOf(2)
        }),
    );
}
