//! fully_shard over the tcp backend (ranks as threads over 127.0.0.1).

mod common;

use common::*;
use hypershard_fsdp::{FsdpModule, FullyShardConfig};
use hypershard_tensor::DType;

const DIMS: [usize; 4] = [5, 3, 7, 2];

fn check_tcp(mesh_shape: &[usize]) {
    let want = reference(&DIMS, DType::F32, Opt::AdamW, 2, 1);
    let world: usize = mesh_shape.iter().product();
    let comms = tcp_world(world);
    let shape = mesh_shape.to_vec();
    let results = hypershard_testkit::run_ranks(world, move |rank| {
        let run = Run {
            dims: DIMS.to_vec(),
            dtype: DType::F32,
            opt: Opt::AdamW,
            steps: 2,
            micro: 1,
            mesh_shape: shape.clone(),
        };
        train_rank(
            &run,
            comms[rank].clone(),
            &|_: &mut FullyShardConfig| {},
            &|_: &mut FsdpModule, _, _| {},
        )
    })
    .unwrap_or_else(|e| panic!("{e}"));
    let got = assemble(&results, &dim0, &none);
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
