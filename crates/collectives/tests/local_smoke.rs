//! Quick end-to-end checks of the local backend that the conformance suite does not cover.

use std::time::Duration;

use hypershard_collectives::local::spawn_world_with;
use hypershard_collectives::{CommConfig, CommunicatorExt, ReduceOp};
use hypershard_testkit::{fixture, fixture_sum, run_ranks};

#[test]
fn all_reduce_sum_of_fixtures() {
    for world in [1, 2, 3, 5] {
        let comms = spawn_world_with(
            world,
            CommConfig::default().with_timeout(Duration::from_secs(20)),
        )
        .unwrap();
        let out = run_ranks(world, move |rank| {
            let values: Vec<f64> = (0..10).map(|i| fixture(rank, i)).collect();
            comms[rank].all_reduce_vec(values, ReduceOp::Sum)
        })
        .unwrap();
        for got in out {
            let expected: Vec<f64> = (0..10).map(|i| fixture_sum(world, i)).collect();
            assert_eq!(got, expected);
        }
    }
}
