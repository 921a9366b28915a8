//! Times `CausalSelfAttention`'s forward + backward on its tiled path against its
//! materialised path (the one that builds the `[B, H, T, T]` weights, taken when the
//! `attn_dropout` child is wrapped), interleaved, at B = 1, C = 768, H = 12, f32.
//!
//! `cargo run --release -p hypershard-nn --example attention_bench [threads] [reps]`
//! (defaults: 1 thread, 5 repetitions of each path per length). Prints one row per sequence
//! length: the median milliseconds of each path and their ratio (materialised / tiled), then
//! the medians of the same with each round's time of the module's two projections alone
//! (`c_attn`, `c_proj` as separate `Linear`s, timed right after) subtracted: a rough estimate
//! of the attention proper, which the projections' GEMMs dominate at short lengths (on a
//! loaded machine it is noisy, and can even come out negative).

use std::time::Instant;

use hypershard_nn::{
    CausalSelfAttention, CausalSelfAttentionConfig, Linear, LinearConfig, Module, ParamVisitor,
    ParamVisitorMut, Result, replace_module, with_num_threads, zero_grad,
};
use hypershard_tensor::{DType, RandomInit, Tensor};

/// Forwards every call; wrapping `attn_dropout` in it selects the materialised path.
struct Opaque(Box<dyn Module>);

impl Module for Opaque {
    fn kind(&self) -> &'static str {
        "Opaque"
    }
    fn forward(&mut self, input: &Tensor) -> Result<Tensor> {
        self.0.forward(input)
    }
    fn backward(&mut self, grad_output: &Tensor) -> Result<Tensor> {
        self.0.backward(grad_output)
    }
    fn visit_params(&self, prefix: &str, f: &mut ParamVisitor<'_>) -> Result<()> {
        self.0.visit_params(prefix, f)
    }
    fn visit_params_mut(&mut self, prefix: &str, f: &mut ParamVisitorMut<'_>) -> Result<()> {
        self.0.visit_params_mut(prefix, f)
    }
}

/// Milliseconds of one forward + backward.
fn step(module: &mut dyn Module, x: &Tensor, grad: &Tensor) -> Result<f64> {
    zero_grad(module)?;
    let start = Instant::now();
    let y = module.forward(x)?;
    drop(y);
    let dx = module.backward(grad)?;
    let ms = start.elapsed().as_secs_f64() * 1e3;
    drop(dx);
    Ok(ms)
}

fn median(mut xs: Vec<f64>) -> f64 {
    xs.sort_by(f64::total_cmp);
    xs[xs.len() / 2]
}

fn main() -> std::result::Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let threads: usize = args.next().map(|a| a.parse()).transpose()?.unwrap_or(1);
    let reps: usize = args.next().map(|a| a.parse()).transpose()?.unwrap_or(5);
    let (n_embd, n_head) = (768, 12);
    let config = CausalSelfAttentionConfig {
        n_embd,
        n_head,
        bias: true,
        dropout: 0.0,
        dtype: DType::F32,
        seed: 1,
    };
    println!("threads {threads}, {reps} reps each, B=1 C={n_embd} H={n_head} f32");
    println!(
        "{:>5} {:>14} {:>10} {:>7} {:>14} {:>10} {:>7}",
        "T", "materialised", "tiled", "ratio", "attn: mat.", "tiled", "ratio"
    );
    with_num_threads(threads, || -> Result<()> {
        for seq in [64, 256, 512] {
            let mut tiled = CausalSelfAttention::new(config)?;
            let mut dense = CausalSelfAttention::new(config)?;
            dense.visit_children_mut(&mut |name, child| {
                if name == "attn_dropout" {
                    replace_module(child, |inner| Ok(Box::new(Opaque(inner))))?;
                }
                Ok(())
            })?;
            let linear = |out_features, seed| {
                Linear::new(LinearConfig {
                    in_features: n_embd,
                    out_features,
                    bias: true,
                    dtype: DType::F32,
                    seed,
                })
            };
            let (mut c_attn, mut c_proj) = (linear(3 * n_embd, 1)?, linear(n_embd, 3)?);
            let init = |seed| RandomInit::uniform(seed, -1.0, 1.0);
            let x = Tensor::random(&[1, seq, n_embd], DType::F32, init(2))?;
            let g = Tensor::random(&[1, seq, n_embd], DType::F32, init(3))?;
            let g3 = Tensor::random(&[1, seq, 3 * n_embd], DType::F32, init(4))?;
            let projections = |c_attn: &mut Linear, c_proj: &mut Linear| -> Result<f64> {
                Ok(step(c_attn, &x, &g3)? + step(c_proj, &x, &g)?)
            };
            // One untimed step each warms the caches and the recycled buffers.
            step(&mut dense, &x, &g)?;
            step(&mut tiled, &x, &g)?;
            projections(&mut c_attn, &mut c_proj)?;
            let (mut dense_ms, mut tiled_ms) = (Vec::new(), Vec::new());
            let (mut dense_attn, mut tiled_attn) = (Vec::new(), Vec::new());
            for rep in 0..reps {
                // Alternate which path goes first, so neither always runs on the caches and
                // recycled buffers the other left behind.
                let (d, t) = if rep % 2 == 0 {
                    let d = step(&mut dense, &x, &g)?;
                    (d, step(&mut tiled, &x, &g)?)
                } else {
                    let t = step(&mut tiled, &x, &g)?;
                    (step(&mut dense, &x, &g)?, t)
                };
                let p = projections(&mut c_attn, &mut c_proj)?;
                dense_ms.push(d);
                tiled_ms.push(t);
                dense_attn.push(d - p);
                tiled_attn.push(t - p);
            }
            let (d, t) = (median(dense_ms), median(tiled_ms));
            let (da, ta) = (median(dense_attn), median(tiled_attn));
            println!(
                "{seq:>5} {d:>14.2} {t:>10.2} {:>7.2} {da:>14.2} {ta:>10.2} {:>7.2}",
                d / t,
                da / ta
            );
        }
        Ok(())
    })??;
    Ok(())
}
