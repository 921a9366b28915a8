//! Times the elementwise layers of a transformer block on one thread of the current rayon
//! pool, at the `medium` preset's shapes (1024 tokens: `[1024, 768]` for the MLP's GELU,
//! `[1024, 192]` for LayerNorm), in nanoseconds per element: GELU (exact) forward and
//! backward, LayerNorm forward and backward, and ReLU forward, a pass that only reads its
//! input and writes its output, as the floor of any such pass.
//!
//! `RAYON_NUM_THREADS=1 cargo run --release -p hypershard-nn --example elementwise_bench [reps]`
//! (default 50). Each figure is the median of 5 rounds of `reps` calls after 3 untimed ones; a
//! backward is timed as forward + backward less the forward's median.

use std::time::Instant;

use hypershard_nn::{Gelu, GeluApproximation, LayerNorm, LayerNormConfig, Module, Relu, Result};
use hypershard_tensor::{DType, Tensor};

const ROUNDS: usize = 5;

/// Values in [-2, 2) that repeat with period 1000, so every branch of GELU's `erf` is taken.
fn input(rows: usize, cols: usize) -> Result<Tensor> {
    let values = (0..rows * cols)
        .map(|i| (i * 7919 % 1000) as f32 / 250.0 - 2.0)
        .collect();
    Ok(Tensor::from_vec(values, &[rows, cols])?)
}

/// The median over [`ROUNDS`] of the mean seconds per call of `f` over `reps` calls.
fn median_seconds(reps: usize, f: &mut dyn FnMut() -> Result<()>) -> Result<f64> {
    for _ in 0..3 {
        f()?;
    }
    let mut rounds = Vec::with_capacity(ROUNDS);
    for _ in 0..ROUNDS {
        let start = Instant::now();
        for _ in 0..reps {
            f()?;
        }
        rounds.push(start.elapsed().as_secs_f64() / reps as f64);
    }
    rounds.sort_by(f64::total_cmp);
    Ok(rounds[ROUNDS / 2])
}

/// Prints the forward's and (if `backward`) the backward's nanoseconds per element.
fn time_layer(
    name: &str,
    layer: &mut dyn Module,
    x: &Tensor,
    backward: bool,
    reps: usize,
) -> Result<()> {
    let grad = Tensor::from_vec(vec![0.5f32; x.numel()], x.shape())?;
    let per_element = 1e9 / x.numel() as f64;
    let forward = median_seconds(reps, &mut || layer.forward(x).map(drop))?;
    print!(
        "{name:<10} forward {:6.2} ns/element",
        forward * per_element
    );
    if backward {
        let both = median_seconds(reps, &mut || {
            layer.forward(x)?;
            layer.backward(&grad).map(drop)
        })?;
        print!(
            "   backward {:6.2} ns/element",
            (both - forward) * per_element
        );
    }
    println!();
    Ok(())
}

fn main() -> Result<()> {
    let reps = match std::env::args().nth(1) {
        Some(text) => match text.parse::<usize>() {
            Ok(reps) if reps > 0 => reps,
            _ => {
                eprintln!("elementwise_bench: reps must be a positive integer, got {text:?}");
                std::process::exit(2);
            }
        },
        None => 50,
    };
    let hidden = input(1024, 768)?;
    let width = input(1024, 192)?;
    time_layer(
        "GELU",
        &mut Gelu::new(GeluApproximation::None),
        &hidden,
        true,
        reps,
    )?;
    time_layer("ReLU", &mut Relu::new(), &hidden, false, reps)?;
    let mut norm = LayerNorm::new(LayerNormConfig {
        normalized_shape: 192,
        eps: 1e-5,
        bias: true,
        dtype: DType::F32,
    })?;
    time_layer("LayerNorm", &mut norm, &width, true, reps)?;
    Ok(())
}
