//! Megatron's MLP pattern with DTensors: `x · W1` with `W1` sharded by columns gives
//! activations sharded by columns; `· W2` with `W2` sharded by rows gives `Partial(sum)`, one
//! all-reduce from the replicated result. Run:
//! `cargo run -p hypershard-dtensor --example sharded_matmul`.

use std::time::Duration;

use hypershard_dtensor::tensor::RandomInit;
use hypershard_dtensor::{DTensor, DType, Placement, Tensor, init_process_mesh, run_local};

fn main() -> Result<(), hypershard_dtensor::Error> {
    let x = Tensor::random(&[4, 6], DType::F64, RandomInit::normal(1, 0.0, 1.0))?;
    let w1 = Tensor::random(&[6, 10], DType::F64, RandomInit::normal(2, 0.0, 1.0))?;
    let w2 = Tensor::random(&[10, 6], DType::F64, RandomInit::normal(3, 0.0, 1.0))?;
    let hidden = naive_matmul(&x.to_vec::<f64>()?, &w1.to_vec::<f64>()?, 4, 6, 10);
    let expected = naive_matmul(&hidden, &w2.to_vec::<f64>()?, 4, 10, 6);
    let (xs, w1s, w2s) = (x.clone(), w1.clone(), w2.clone());
    let results = run_local(3, Duration::from_secs(60), move |world| {
        let mesh = init_process_mesh(world, &[3], &["tp"])?;
        let x = DTensor::distribute_local(&xs, &mesh, &[Placement::Replicate])?;
        let w1 = DTensor::distribute_local(&w1s, &mesh, &[Placement::Shard(1)])?;
        let w2 = DTensor::distribute_local(&w2s, &mesh, &[Placement::Shard(0)])?;
        let hidden = x.matmul(&w1)?; // Shard(1): 10 columns as 4, 4, 2
        let partial = hidden.matmul(&w2)?; // Partial(sum)
        let placement = format!("{:?} then {:?}", hidden.placements(), partial.placements());
        let out = partial.redistribute(&[Placement::Replicate])?;
        Ok((placement, out.to_local().to_vec::<f64>()?))
    })?;
    let (placements, out) = &results[0];
    let err = out
        .iter()
        .zip(&expected)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0f64, f64::max);
    println!("placements: {placements}");
    println!("max |sharded - unsharded| = {err:.2e}");
    assert!(
        err < 1e-12,
        "the sharded matmul must equal the unsharded one"
    );
    Ok(())
}

/// The unsharded reference, `[m, k] · [k, n]`, row-major.
fn naive_matmul(a: &[f64], b: &[f64], m: usize, k: usize, n: usize) -> Vec<f64> {
    let mut out = vec![0.0; m * n];
    for i in 0..m {
        for p in 0..k {
            for j in 0..n {
                out[i * n + j] += a[i * k + p] * b[p * n + j];
            }
        }
    }
    out
}
