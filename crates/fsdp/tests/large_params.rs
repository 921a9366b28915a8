//! Parity with parameters large enough (≥ 64 KiB) that the unshard compacts the all-gather
//! output in place and the unsharded weight is a view into it instead of a copy. `train_world`
//! runs each check on the host and the emulated device, with the same parameters bit for bit.

mod common;

use std::sync::Arc;

use common::*;
use hypershard_fsdp::{CommFusionPolicy, FsdpModule, FullyShardConfig, ReshardAfterForward};
use hypershard_tensor::DType;

/// Linear(130, 129): a 67,080-byte f32 weight, 129 rows (uneven at worlds 2 and 4), then a
/// small Linear(129, 3) whose weight takes the copy-out path.
const DIMS: [usize; 3] = [130, 129, 3];
const TOL: f64 = 1e-5;

fn check(mesh_shape: &[usize], configure: Arc<Configure>) {
    let want = reference(&DIMS, DType::F32, Opt::Sgd, 3, 1);
    let run = Run {
        dims: DIMS.to_vec(),
        dtype: DType::F32,
        opt: Opt::Sgd,
        steps: 3,
        micro: 1,
        mesh_shape: mesh_shape.to_vec(),
    };
    let hook: Arc<MicroHook> = Arc::new(|_: &mut FsdpModule, _, _| {});
    let results = train_world(run, configure, hook);
    check_shard_shapes(&results, &want, &dim0, &none);
    let got = assemble(&results, &dim0, &none);
    let err = max_rel_err(&got, &want);
    assert!(err <= TOL, "mesh {mesh_shape:?}: max rel err {err}");
}

#[test]
fn large_weights_match_unsharded_at_worlds_1_to_4_and_2x2() {
    for shape in [vec![1], vec![2], vec![3], vec![4], vec![2, 2]] {
        check(&shape, Arc::new(|_: &mut FullyShardConfig| {}));
    }
}

#[test]
fn large_weights_match_with_post_forward_groups_unfused_and_kept() {
    // Backward re-gathers within groups of 2 (the post-forward layout is compacted too).
    check(
        &[4],
        Arc::new(|c: &mut FullyShardConfig| {
            c.reshard_after_forward = ReshardAfterForward::ToGroupOf(2);
        }),
    );
    // One bucket per parameter: the weight is the whole rank block.
    check(
        &[3],
        Arc::new(|c: &mut FullyShardConfig| {
            c.comm_fusion = CommFusionPolicy {
                enabled: false,
                ..CommFusionPolicy::default()
            };
        }),
    );
    // Kept after forward: one gather per step, the view lives through backward.
    check(
        &[2],
        Arc::new(|c: &mut FullyShardConfig| {
            c.reshard_after_forward = ReshardAfterForward::Keep;
        }),
    );
}
