//! `bench-gemm`: the f32 GEMM of `hypershard-nn` against matrixmultiply's `sgemm` on the
//! products of a GPT training step, one thread each, interleaved.
//!
//! ```text
//! bench-gemm [--reps 7] [--rounds 3] [--model gpt2|medium|both] [--only TEXT] [--json [PATH]]
//! ```
//!
//! For each layer of the model (the attention's `qkv` and output projections, the MLP's two
//! layers) it times the three products of a `Linear` at 1024 tokens: the forward `x · Wᵀ`,
//! the input gradient `dy · W` and the weight gradient `dyᵀ · x`, stored as training stores
//! them. The two GEMMs alternate for `--rounds` rounds; each time is the median of `--reps`
//! repetitions after two untimed ones. `hypershard-nn`'s side is `linalg::matmul_f32_into`,
//! the GEMM a `Linear` runs, on slices as matrixmultiply's is.
//! `--only` keeps the products whose name contains TEXT (`--only "proj forward"`).
//! JSON goes to `target/bench/gemm.json` (or PATH).

use std::path::PathBuf;

use hypershard_benches::memory::GptShape;
use hypershard_benches::train::preset;
use hypershard_benches::{TimingStats, time_runs, write_json};
use hypershard_nn::linalg::{MatmulOptions, matmul_f32_into};
use hypershard_nn::with_num_threads;

struct Args {
    reps: usize,
    rounds: usize,
    models: Vec<&'static str>,
    only: Option<String>,
    json: Option<Option<PathBuf>>,
}

fn parse_args() -> Result<Args, String> {
    let mut args = Args {
        reps: 7,
        rounds: 3,
        models: vec!["gpt2", "medium"],
        only: None,
        json: None,
    };
    let mut it = std::env::args().skip(1).peekable();
    while let Some(flag) = it.next() {
        let mut value = || it.next().ok_or(format!("{flag} needs a value"));
        let number = |s: String| match s.parse::<usize>() {
            Ok(0) => Err(format!("{flag} must be at least 1")),
            Ok(n) => Ok(n),
            Err(e) => Err(format!("{flag} {s}: {e}")),
        };
        match flag.as_str() {
            "--reps" => args.reps = number(value()?)?,
            "--rounds" => args.rounds = number(value()?)?,
            "--model" => {
                args.models = match value()?.as_str() {
                    "gpt2" => vec!["gpt2"],
                    "medium" => vec!["medium"],
                    "both" => vec!["gpt2", "medium"],
                    other => return Err(format!("--model {other}: expected gpt2, medium or both")),
                }
            }
            "--only" => args.only = Some(value()?),
            "--json" => {
                let path = match it.peek() {
                    Some(next) if !next.starts_with("--") => it.next().map(PathBuf::from),
                    _ => None,
                };
                args.json = Some(path);
            }
            other => return Err(format!("unknown flag {other}")),
        }
    }
    Ok(args)
}

/// One product `C[m, n] = op(A) · op(B)`: `A` stored `[m, k]` (or `[k, m]` when
/// `transpose_a`), `B` stored `[k, n]` (or `[n, k]` when `transpose_b`).
#[derive(Debug, Clone, serde::Serialize)]
struct Product {
    model: &'static str,
    name: String,
    m: usize,
    k: usize,
    n: usize,
    transpose_a: bool,
    transpose_b: bool,
}

/// The three products of each distinct `Linear` shape (`[in, out]`) of `model` at `tokens`.
fn products(model: &'static str, tokens: usize) -> Result<Vec<Product>, String> {
    let shape = preset(model).ok_or_else(|| format!("{model} is not a preset"))?;
    let embd = shape.n_embd;
    let layers = [
        ("qkv", tokens, embd, 3 * embd),
        ("proj", tokens, embd, embd),
        ("fc", tokens, embd, 4 * embd),
        ("fc_proj", tokens, 4 * embd, embd),
    ];
    let mut out = Vec::new();
    for (layer, rows, input, output) in layers.into_iter().chain(head(model, &shape)) {
        let product = |pass: &str, m, k, n, transpose_a, transpose_b| Product {
            model,
            name: format!("{layer} {pass}"),
            m,
            k,
            n,
            transpose_a,
            transpose_b,
        };
        // y[t, out] = x[t, in] · W[out, in]ᵀ
        out.push(product("forward", rows, input, output, false, true));
        // dx[t, in] = dy[t, out] · W[out, in]
        out.push(product("input grad", rows, output, input, false, false));
        // dW[out, in] = dy[t, out]ᵀ · x[t, in]
        out.push(product("weight grad", output, rows, input, true, false));
    }
    Ok(out)
}

/// GPT-2's loss head as the fused head runs it: one block of as many token rows as keep its
/// logits within 2²³ elements (the fused head's block; 166 rows) against the `[V, C]`
/// embedding. Medium's vocabulary is too small to matter.
fn head(model: &str, shape: &GptShape) -> Option<(&'static str, usize, usize, usize)> {
    let rows = (1 << 23) / shape.vocab_size;
    (model == "gpt2").then_some(("head", rows, shape.n_embd, shape.vocab_size))
}

#[derive(Debug, Clone, serde::Serialize)]
struct Row {
    product: Product,
    hypershard: Vec<TimingStats>,
    matrixmultiply: Vec<TimingStats>,
    hypershard_gflops: f64,
    matrixmultiply_gflops: f64,
    speedup: f64,
}

/// Deterministic values in [-1, 1).
fn values(len: usize, seed: u64) -> Vec<f32> {
    (0..len as u64)
        .map(|i| {
            let x =
                (i.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ seed).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            ((x >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect()
}

fn measure(p: &Product, args: &Args) -> Result<Row, String> {
    let err = |e: hypershard_nn::Error| e.to_string();
    let (m, k, n) = (p.m, p.k, p.n);
    let a_values = values(m * k, 1);
    let b_values = values(k * n, 2);
    let options = MatmulOptions {
        transpose_a: p.transpose_a,
        transpose_b: p.transpose_b,
    };
    let strides = |transposed: bool, rows: usize, cols: usize| -> (isize, isize) {
        // Element (i, j) of op(X) for X stored [rows, cols] (or [cols, rows] transposed).
        if transposed {
            (1, rows as isize)
        } else {
            (cols as isize, 1)
        }
    };
    let (rsa, csa) = strides(p.transpose_a, m, k);
    let (rsb, csb) = strides(p.transpose_b, k, n);
    let mut c = vec![0.0f32; m * n];
    // The two sides compute the same product: compare once (f32 rounding of sums of k
    // products of magnitude < 1 stays far below k · 1e-5).
    let mut ours = vec![0.0f32; m * n];
    let hypershard_gemm = |out: &mut [f32]| {
        matmul_f32_into(&a_values, &b_values, [m, k, n], options, out).map_err(err)
    };
    hypershard_gemm(&mut ours)?;
    // SAFETY: `a_values` holds `m·k` and `b_values` `k·n` elements laid out as the strides
    // say, so every `(i, p)` and `(p, j)` addressed is inside them; `c` holds `m·n`
    // elements with row stride `n`, a separate allocation.
    let reference = |c: &mut Vec<f32>| unsafe {
        matrixmultiply::sgemm(
            m,
            k,
            n,
            1.0,
            a_values.as_ptr(),
            rsa,
            csa,
            b_values.as_ptr(),
            rsb,
            csb,
            0.0,
            c.as_mut_ptr(),
            n as isize,
            1,
        )
    };
    reference(&mut c);
    let worst = ours
        .iter()
        .zip(&c)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0f32, f32::max);
    if worst > 1e-5 * k as f32 {
        return Err(format!("{}: the two GEMMs differ by {worst}", p.name));
    }
    let mut hypershard = Vec::new();
    let mut mm = Vec::new();
    for _ in 0..args.rounds {
        hypershard.push(time_runs(args.reps, || hypershard_gemm(&mut ours))?);
        mm.push(time_runs(args.reps, || {
            reference(&mut c);
            Ok(())
        })?);
    }
    let flops = 2.0 * (m * k * n) as f64;
    let best = |runs: &[TimingStats]| runs.iter().map(|t| t.median_s).fold(f64::MAX, f64::min);
    let (ours_s, mm_s) = (best(&hypershard), best(&mm));
    Ok(Row {
        product: p.clone(),
        hypershard,
        matrixmultiply: mm,
        hypershard_gflops: flops / ours_s / 1e9,
        matrixmultiply_gflops: flops / mm_s / 1e9,
        speedup: mm_s / ours_s,
    })
}

fn main() {
    if let Err(message) = run() {
        eprintln!("bench-gemm: {message}");
        std::process::exit(1);
    }
}

fn run() -> Result<(), String> {
    let args = parse_args()?;
    println!(
        "{:<8} {:<22} {:>5} {:>5} {:>5}  {:>10} {:>10}  {:>7}",
        "model", "product", "m", "k", "n", "ours GF/s", "mm GF/s", "ours/mm"
    );
    let mut rows = Vec::new();
    for model in &args.models {
        // 1024 tokens: gpt2's batch 1 and medium's batch 8 of full sequences.
        for p in products(model, 1024)? {
            if args
                .only
                .as_ref()
                .is_some_and(|only| !p.name.contains(only.as_str()))
            {
                continue;
            }
            // One single-thread pool per product, around all its timings: a pool per call
            // would add a thread's start, and fresh per-thread packing buffers, to every
            // GEMM timed.
            let row = with_num_threads(1, || measure(&p, &args)).map_err(|e| e.to_string())??;
            println!(
                "{:<8} {:<22} {:>5} {:>5} {:>5}  {:>10.1} {:>10.1}  {:>7.2}",
                p.model,
                p.name,
                p.m,
                p.k,
                p.n,
                row.hypershard_gflops,
                row.matrixmultiply_gflops,
                row.speedup
            );
            rows.push(row);
        }
    }
    if rows.is_empty() {
        return Err("no product matches --only".to_string());
    }
    let geomean = (rows.iter().map(|r| r.speedup.ln()).sum::<f64>() / rows.len() as f64).exp();
    println!("geometric mean ours/mm: {geomean:.2}");
    if let Some(path) = &args.json {
        let report = serde_json::json!({ "rows": rows, "geomean_speedup": geomean });
        let written = match path {
            Some(path) => {
                let text = serde_json::to_string_pretty(&report).map_err(|e| e.to_string())?;
                std::fs::write(path, text).map_err(|e| format!("{}: {e}", path.display()))?;
                path.clone()
            }
            None => write_json("gemm", &report).map_err(|e| e.to_string())?,
        };
        println!("wrote {}", written.display());
    }
    Ok(())
}
