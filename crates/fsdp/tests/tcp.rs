//! fully_shard over the tcp backend (ranks as threads over 127.0.0.1).

mod common;

use common::*;
use hypershard_fsdp::{FsdpModule, FullyShardConfig};
use hypershard_tensor::DType;

const DIMS: [usize; 4] = [5, 3, 7, 2];

fn check_tcp(mesh_shape: &[usize]) {
    let want = reference(&DIMS, DType::F32, Opt::AdamW, 2, 1);
    let world: usize = mesh_shape.iter().product();
    // The same body on the host and on the emulated device (staged through host buffers for
    // the tcp backend): both match the unsharded run, and each other exactly.
    let runs = on_both(|device| {
        let comms = tcp_world(world);
        let shape = mesh_shape.to_vec();
        hypershard_testkit::run_ranks(world, move |rank| {
            let run = Run {
                dims: DIMS.to_vec(),
                dtype: DType::F32,
                opt: Opt::AdamW,
                steps: 2,
                micro: 1,
                mesh_shape: shape.clone(),
            };
            train_rank_on(
                &run,
                comms[rank].clone(),
                device,
                &|_: &mut FullyShardConfig| {},
                &|_: &mut FsdpModule, _, _| {},
            )
        })
        .unwrap_or_else(|e| panic!("{device:?}: {e}"))
    });
    assert_same_results(&runs[0], &runs[1]);
    let got = assemble(&runs[0], &dim0, &none);
    let err = max_rel_err(&got, &want);
    assert!(err <= 1e-5, "tcp {mesh_shape:?}: {err}");
}

#[test]
fn fsdp_on_tcp_world_2_matches_unsharded() {
    check_tcp(&[2]);
}

#[test]
fn hsdp_on_tcp_2x2_matches_unsharded() {
    check_tcp(&[2, 2]);
}
