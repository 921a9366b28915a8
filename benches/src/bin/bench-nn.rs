//! `cargo xtask bench nn`: f32 GEMM 1024³ GFLOP/s and a nanoGPT forward+backward step, at 1
//! and 2 threads, side by side with PyTorch on the same machine in the same sitting.
//!
//! ```text
//! bench-nn [--threads 1,2] [--reps 7] [--gemm-n 1024] [--batch 8] [--seq 128] [--layers 4]
//!          [--heads 4] [--embd 256] [--vocab 512] [--rounds 3] [--no-torch] [--json [PATH]]
//!          [--quick]
//! ```
//!
//! `--quick` is the CI smoke (`cargo xtask bench --quick`): a 128³ GEMM and a one-layer GPT of
//! width 32, one thread, one round of one repetition; the numbers mean nothing, the run checks
//! that both sides still work. Later flags override its choices.
//!
//! A GPT step is forward, cross-entropy, backward and `zero_grad` (no optimizer), f32, no
//! dropout. The PyTorch side is `benches/python/bench_nn.py`, run with the venv at
//! `$TORCH_VENV` (default `~/.cache/hypershard-bench/torch-venv`, made by
//! `bash shared/bench/pytorch/run_all.sh setup`) right after the Rust side, so both see the
//! same machine load; without the venv (or with `--no-torch`) only the Rust side is reported.
//! Times are medians over `--reps` timed repetitions after 2 untimed ones. The two sides
//! alternate for `--rounds` rounds (Rust, torch, Rust, torch, ...) because the machine is
//! shared and its load drifts; the table shows, per side, the best round (the lowest median:
//! the least disturbed measurement) and the median over rounds, each with its ratio.

use std::path::PathBuf;
use std::process::{Command, ExitCode};

use hypershard_benches::{TimingStats, time_runs, write_json};
use hypershard_nn::linalg::matmul;
use hypershard_nn::{
    DEFAULT_IGNORE_INDEX, Gpt, GptConfig, Module, cross_entropy, with_num_threads, zero_grad,
};
use hypershard_tensor::{DType, RandomInit, Tensor};

#[derive(Debug, Clone)]
struct Args {
    threads: Vec<usize>,
    reps: usize,
    gemm_n: usize,
    batch: usize,
    seq: usize,
    layers: usize,
    heads: usize,
    embd: usize,
    vocab: usize,
    torch: bool,
    rounds: usize,
    json: Option<Option<PathBuf>>,
}

fn parse_args() -> Result<Args, String> {
    let mut args = Args {
        threads: vec![1, 2],
        reps: 7,
        gemm_n: 1024,
        batch: 8,
        seq: 128,
        layers: 4,
        heads: 4,
        embd: 256,
        vocab: 512,
        torch: true,
        rounds: 3,
        json: None,
    };
    let mut it = std::env::args().skip(1).peekable();
    while let Some(flag) = it.next() {
        let mut value = || it.next().ok_or(format!("{flag} needs a value"));
        let number = |s: String| s.parse::<usize>().map_err(|e| format!("{s}: {e}"));
        match flag.as_str() {
            "--threads" => {
                args.threads = value()?
                    .split(',')
                    .map(|s| number(s.to_string()))
                    .collect::<Result<_, _>>()?
            }
            "--reps" => args.reps = number(value()?)?,
            "--gemm-n" => args.gemm_n = number(value()?)?,
            "--batch" => args.batch = number(value()?)?,
            "--seq" => args.seq = number(value()?)?,
            "--layers" => args.layers = number(value()?)?,
            "--heads" => args.heads = number(value()?)?,
            "--embd" => args.embd = number(value()?)?,
            "--vocab" => args.vocab = number(value()?)?,
            "--no-torch" => args.torch = false,
            "--quick" => {
                args.threads = vec![1];
                args.reps = 1;
                args.gemm_n = 128;
                args.batch = 2;
                args.seq = 16;
                args.layers = 1;
                args.heads = 2;
                args.embd = 32;
                args.vocab = 64;
                args.rounds = 1;
            }
            "--rounds" => args.rounds = number(value()?)?,
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
    if args.reps == 0 || args.rounds == 0 || args.threads.is_empty() {
        return Err("--reps, --rounds and --threads must be non-empty".to_string());
    }
    Ok(args)
}

#[derive(Debug, Clone, serde::Serialize)]
struct Row {
    threads: usize,
    gemm: TimingStats,
    gemm_gflops: f64,
    gpt_step: TimingStats,
}

#[derive(Debug, Clone, serde::Serialize)]
struct TorchRow {
    threads: usize,
    gemm_median_s: f64,
    gemm_gflops: f64,
    gpt_step_median_s: f64,
}

#[derive(Debug, serde::Serialize)]
struct Report {
    gemm_n: usize,
    gpt: String,
    gpt_params: usize,
    /// One entry per round, each with one row per thread count.
    rust_rounds: Vec<Vec<Row>>,
    torch_version: Option<String>,
    torch_rounds: Vec<Vec<TorchRow>>,
    summary: Vec<Summary>,
}

/// Per thread count: the best round and the median over rounds, for each side.
#[derive(Debug, Clone, serde::Serialize)]
struct Summary {
    threads: usize,
    rust_gemm_gflops_best: f64,
    rust_gemm_gflops_median: f64,
    rust_step_s_best: f64,
    rust_step_s_median: f64,
    torch_gemm_gflops_best: Option<f64>,
    torch_gemm_gflops_median: Option<f64>,
    torch_step_s_best: Option<f64>,
    torch_step_s_median: Option<f64>,
}

/// The minimum and the median of `values` (which is not empty: one per round).
fn best_and_median(mut values: Vec<f64>, best_is_max: bool) -> (f64, f64) {
    values.sort_by(f64::total_cmp);
    let median = if values.len() % 2 == 1 {
        values[values.len() / 2]
    } else {
        (values[values.len() / 2 - 1] + values[values.len() / 2]) / 2.0
    };
    let best = if best_is_max {
        values[values.len() - 1]
    } else {
        values[0]
    };
    (best, median)
}

fn run_rust(args: &Args, threads: usize) -> Result<Row, String> {
    let err = |e: hypershard_nn::Error| e.to_string();
    let n = args.gemm_n;
    let a = Tensor::random(&[n, n], DType::F32, RandomInit::uniform(1, -1.0, 1.0))
        .map_err(|e| e.to_string())?;
    let b = Tensor::random(&[n, n], DType::F32, RandomInit::uniform(2, -1.0, 1.0))
        .map_err(|e| e.to_string())?;
    let mut model = Gpt::new(gpt_config(args)).map_err(err)?;
    let ids = |seed| {
        let values: Vec<i64> = (0..args.batch * args.seq)
            .map(|i| {
                (hypershard_tensor::random::random_bits(seed, i as u64) % args.vocab as u64) as i64
            })
            .collect();
        Tensor::from_vec(values, &[args.batch, args.seq]).map_err(|e| e.to_string())
    };
    let (inputs, targets) = (ids(3)?, ids(4)?);
    with_num_threads(threads, || {
        let gemm = time_runs(args.reps, || matmul(&a, &b).map(drop).map_err(err))?;
        let gpt_step = time_runs(args.reps, || {
            let logits = model.forward(&inputs).map_err(err)?;
            let loss = cross_entropy(&logits, &targets, DEFAULT_IGNORE_INDEX).map_err(err)?;
            model.backward(&loss.grad).map_err(err)?;
            zero_grad(&mut model).map_err(err)
        })?;
        Ok(Row {
            threads,
            gemm,
            gemm_gflops: 2.0 * (n as f64).powi(3) / gemm.median_s / 1e9,
            gpt_step,
        })
    })
    .map_err(err)?
}

fn gpt_config(args: &Args) -> GptConfig {
    GptConfig {
        vocab_size: args.vocab,
        block_size: args.seq,
        n_layer: args.layers,
        n_head: args.heads,
        n_embd: args.embd,
        bias: true,
        dropout: 0.0,
        dtype: DType::F32,
        seed: 0,
    }
}

/// Runs the PyTorch script and parses its JSON line; `None` (with a note) when no venv.
fn run_torch(args: &Args) -> Result<Option<(String, Vec<TorchRow>)>, String> {
    let venv = std::env::var_os("TORCH_VENV")
        .map(PathBuf::from)
        .or_else(|| {
            std::env::var_os("HOME")
                .map(|h| PathBuf::from(h).join(".cache/hypershard-bench/torch-venv"))
        });
    let python = venv.map(|v| v.join("bin/python")).filter(|p| p.exists());
    let Some(python) = python else {
        eprintln!("bench-nn: no torch venv (set TORCH_VENV); reporting the Rust side only");
        return Ok(None);
    };
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("python/bench_nn.py");
    let threads: Vec<String> = args.threads.iter().map(usize::to_string).collect();
    let output = Command::new(python)
        .arg(script)
        .arg("--threads")
        .args(&threads)
        .args(["--reps", &args.reps.to_string()])
        .args(["--gemm-n", &args.gemm_n.to_string()])
        .args(["--batch", &args.batch.to_string()])
        .args(["--seq", &args.seq.to_string()])
        .args(["--layers", &args.layers.to_string()])
        .args(["--heads", &args.heads.to_string()])
        .args(["--embd", &args.embd.to_string()])
        .args(["--vocab", &args.vocab.to_string()])
        .env(
            "OMP_NUM_THREADS",
            args.threads.iter().max().unwrap_or(&1).to_string(),
        )
        .output()
        .map_err(|e| format!("running the torch script: {e}"))?;
    if !output.status.success() {
        return Err(format!(
            "torch script failed: {}",
            String::from_utf8_lossy(&output.stderr)
        ));
    }
    let stdout = String::from_utf8_lossy(&output.stdout);
    let line = stdout
        .lines()
        .last()
        .ok_or("torch script printed nothing")?;
    let value: serde_json::Value = serde_json::from_str(line).map_err(|e| e.to_string())?;
    let version = value["torch"].as_str().unwrap_or("?").to_string();
    let rows = value["rows"]
        .as_array()
        .ok_or("torch JSON has no rows")?
        .iter()
        .map(|r| {
            let f =
                |v: &serde_json::Value| v.as_f64().ok_or("torch JSON: not a number".to_string());
            Ok(TorchRow {
                threads: r["threads"].as_u64().ok_or("torch JSON: threads")? as usize,
                gemm_median_s: f(&r["gemm"]["median_s"])?,
                gemm_gflops: f(&r["gemm"]["gflops"])?,
                gpt_step_median_s: f(&r["gpt_step"]["median_s"])?,
            })
        })
        .collect::<Result<Vec<_>, String>>()?;
    Ok(Some((version, rows)))
}

fn run() -> Result<(), String> {
    let args = parse_args()?;
    let config = gpt_config(&args);
    let params = Gpt::new(config)
        .and_then(|m| m.num_params(false))
        .map_err(|e| e.to_string())?;
    let gpt = format!(
        "B={} T={} n_layer={} n_head={} n_embd={} vocab={}",
        args.batch, args.seq, args.layers, args.heads, args.embd, args.vocab
    );
    let mut rust_rounds = Vec::new();
    let mut torch_rounds = Vec::new();
    let mut torch_version = None;
    for round in 0..args.rounds {
        eprintln!("bench-nn: round {} of {}", round + 1, args.rounds);
        let mut rows = Vec::new();
        for &threads in &args.threads {
            rows.push(run_rust(&args, threads)?);
        }
        rust_rounds.push(rows);
        if args.torch
            && let Some((version, rows)) = run_torch(&args)?
        {
            torch_version = Some(version);
            torch_rounds.push(rows);
        }
    }
    let summary: Vec<Summary> = args
        .threads
        .iter()
        .map(|&threads| {
            let rust: Vec<&Row> = rust_rounds
                .iter()
                .filter_map(|r| r.iter().find(|row| row.threads == threads))
                .collect();
            let torch: Vec<&TorchRow> = torch_rounds
                .iter()
                .filter_map(|r| r.iter().find(|row| row.threads == threads))
                .collect();
            let (rg_best, rg_med) =
                best_and_median(rust.iter().map(|r| r.gemm_gflops).collect(), true);
            let (rs_best, rs_med) =
                best_and_median(rust.iter().map(|r| r.gpt_step.median_s).collect(), false);
            let torch_pair = |values: Vec<f64>, max: bool| {
                (!values.is_empty()).then(|| best_and_median(values, max))
            };
            let tg = torch_pair(torch.iter().map(|t| t.gemm_gflops).collect(), true);
            let ts = torch_pair(torch.iter().map(|t| t.gpt_step_median_s).collect(), false);
            Summary {
                threads,
                rust_gemm_gflops_best: rg_best,
                rust_gemm_gflops_median: rg_med,
                rust_step_s_best: rs_best,
                rust_step_s_median: rs_med,
                torch_gemm_gflops_best: tg.map(|p| p.0),
                torch_gemm_gflops_median: tg.map(|p| p.1),
                torch_step_s_best: ts.map(|p| p.0),
                torch_step_s_median: ts.map(|p| p.1),
            }
        })
        .collect();
    println!(
        "GPT {gpt} ({params} parameters), f32; GEMM {0}x{0}x{0} f32; {1} rounds of {2} reps",
        args.gemm_n, args.rounds, args.reps
    );
    println!(
        "| threads | statistic | GEMM hypershard GFLOP/s | GEMM torch GFLOP/s | GEMM ratio | GPT step hypershard ms | GPT step torch ms | step time ratio |"
    );
    println!("|---|---|---|---|---|---|---|---|");
    let cell =
        |v: Option<f64>, scale: f64| v.map_or("–".to_string(), |v| format!("{:.1}", v * scale));
    let ratio = |a: f64, b: Option<f64>| b.map_or("–".to_string(), |b| format!("{:.2}×", a / b));
    for s in &summary {
        for (label, rg, tg, rs, ts) in [
            (
                "best round",
                s.rust_gemm_gflops_best,
                s.torch_gemm_gflops_best,
                s.rust_step_s_best,
                s.torch_step_s_best,
            ),
            (
                "median of rounds",
                s.rust_gemm_gflops_median,
                s.torch_gemm_gflops_median,
                s.rust_step_s_median,
                s.torch_step_s_median,
            ),
        ] {
            println!(
                "| {} | {label} | {rg:.1} | {} | {} | {:.1} | {} | {} |",
                s.threads,
                cell(tg, 1.0),
                ratio(rg, tg),
                rs * 1e3,
                cell(ts, 1e3),
                ratio(rs, ts),
            );
        }
    }
    let report = Report {
        gemm_n: args.gemm_n,
        gpt,
        gpt_params: params,
        rust_rounds,
        torch_version,
        torch_rounds,
        summary,
    };
    match &args.json {
        Some(Some(path)) => {
            let text = serde_json::to_string_pretty(&report).map_err(|e| e.to_string())?;
            std::fs::write(path, text + "\n").map_err(|e| e.to_string())?;
            eprintln!("wrote {}", path.display());
        }
        _ => {
            let path = write_json("nn", &report).map_err(|e| e.to_string())?;
            eprintln!("wrote {}", path.display());
        }
    }
    Ok(())
}

fn main() -> ExitCode {
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("bench-nn: {e}");
            ExitCode::FAILURE
        }
    }
}
