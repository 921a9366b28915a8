//! The training-throughput suite's figures: the model FLOPs of one nanoGPT training step, the
//! machine's f32 FMA peak, and the reduction of interleaved runs (ours and PyTorch FSDP2's) to
//! one row per preset and mesh.
//!
//! Throughput is steady-state tokens per second on both sides, defined alike: the first steps
//! are warm-up and left out, and the tokens of the remaining steps (all ranks) are divided by
//! the summed time of those steps (forward to optimizer step, data generation excluded). The
//! PyTorch script times each rank and takes the slowest; ours times rank 0, which every step's
//! collectives keep in step with the others.

use serde::{Deserialize, Serialize};

use crate::memory::GptShape;

/// The presets of `hypershard train --model` and `bench_gpt_fsdp2.py --preset`, with the
/// vocabulary each side trains with (ours: the byte tokenizer's 256 ids for the small presets,
/// GPT-2's padded 50304 for `gpt2`; the script gets the same through `--vocab`).
pub fn preset(name: &str) -> Option<GptShape> {
    let shape = |vocab_size, block_size, n_layer, n_head, n_embd| GptShape {
        vocab_size,
        block_size,
        n_layer,
        n_head,
        n_embd,
        bias: true,
        dropout: 0.0,
    };
    match name {
        "tiny" => Some(shape(256, 32, 2, 2, 32)),
        "small" => Some(shape(256, 64, 4, 4, 64)),
        "medium" => Some(shape(256, 128, 6, 6, 192)),
        "gpt2" => Some(shape(50_304, 1024, 12, 12, 768)),
        _ => None,
    }
}

/// The FLOPs of one training step (forward and backward, all ranks) of `shape` on `tokens`
/// tokens of full-length sequences.
///
/// Every matrix product of `m × k` by `k × n` costs `2mkn` multiply-adds counted as two FLOPs,
/// and backward runs two products per forward one (the input gradient and the weight
/// gradient), so a weight matrix of `P` entries costs `6 P` FLOPs per token. The weight
/// matrices are, per block, `c_attn` (3C²), the attention `c_proj` (C²) and the MLP (8C²),
/// plus the output head (V·C, tied to the token embedding, whose lookup is no product). The
/// position embedding, the layer norms and the biases are elementwise and not counted.
/// Attention adds `QKᵀ` and `A·V`: `2·T·C` multiply-adds per token per layer forward, so
/// `12·L·T·C` FLOPs per token over forward and backward, counted over the full `T × T` square
/// (the causal half skipped by an implementation is not subtracted, as in the usual model-FLOPs
/// utilisation). Total: `6·(12·L·C² + V·C)·tokens + 12·L·T·C·tokens`.
pub fn step_flops(shape: &GptShape, tokens: u64) -> f64 {
    let (l, t, c, v) = (
        shape.n_layer as f64,
        shape.block_size as f64,
        shape.n_embd as f64,
        shape.vocab_size as f64,
    );
    let matmul_params = 12.0 * l * c * c + v * c;
    (6.0 * matmul_params + 12.0 * l * t * c) * tokens as f64
}

/// The f32 multiply-adds one core of this machine can retire, measured.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct FmaPeak {
    /// Threads run at once (one per core the runs use).
    pub threads: usize,
    /// FLOP/s of one thread (an FMA counted as two), the best repetition, in GFLOP/s.
    pub per_thread_gflops: f64,
    /// `per_thread_gflops` times the threads: the machine's peak over those cores.
    pub total_gflops: f64,
}

/// Independent accumulators of the FMA kernel: with a latency of 4 cycles and two FMA ports an
/// x86 core needs at least 8 FMAs in flight; 12 leave room for a 5-cycle latency and still fit
/// the 16 AVX registers beside the two operands.
const ACCUMULATORS: usize = 12;

/// f32 lanes of one AVX2 register.
const LANES: usize = 8;
/// f32 lanes of one AVX-512 register.
const LANES_512: usize = 16;

/// The widest f32 FMA this CPU has: `"AVX-512"` (16 lanes), `"AVX2"` (8 lanes), or `None`.
pub fn fma_isa() -> Option<&'static str> {
    #[cfg(target_arch = "x86_64")]
    {
        if is_x86_feature_detected!("avx512f") {
            return Some("AVX-512");
        }
        if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
            return Some("AVX2");
        }
    }
    None
}

/// What one run of [`fma_kernel`] did.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct FmaRun {
    /// The sum of every lane of every accumulator.
    pub sum: f32,
    /// FLOPs of one iteration: an FMA counted as two, over all accumulators and lanes.
    pub flops_per_iteration: u64,
}

/// Runs `iterations` rounds of `ACCUMULATORS` independent fused multiply-adds on the widest
/// vectors the CPU has ([`fma_isa`]) (`acc = acc·a + b` on every lane, `a` and `b` the given
/// constants, every accumulator starting at 0) and returns the sum of all lanes of all
/// accumulators, or `None` when the CPU has neither AVX-512 nor AVX2 and FMA. A machine's
/// peak is its widest FMA's: a GEMM kernel for AVX-512 retires twice the FLOPs of AVX2's.
pub fn fma_kernel(iterations: u64, a: f32, b: f32) -> Option<FmaRun> {
    #[cfg(target_arch = "x86_64")]
    {
        if is_x86_feature_detected!("avx512f") {
            // SAFETY: the CPU has AVX-512F (checked just above), which is all the function's
            // target features require; it reads and writes only its own locals. Tested by
            // `fma_kernel_matches_the_scalar_recurrence`.
            let sum = unsafe { fma_kernel_avx512(iterations, a, b) };
            return Some(FmaRun {
                sum,
                flops_per_iteration: (2 * ACCUMULATORS * LANES_512) as u64,
            });
        }
        if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
            // SAFETY: the CPU has AVX2 and FMA (checked just above), which is all the
            // function's target features require; it reads and writes only its own locals.
            // Tested by `fma_kernel_matches_the_scalar_recurrence`.
            let sum = unsafe { fma_kernel_avx2(iterations, a, b) };
            return Some(FmaRun {
                sum,
                flops_per_iteration: (2 * ACCUMULATORS * LANES) as u64,
            });
        }
    }
    let _ = (iterations, a, b);
    None
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
fn fma_kernel_avx512(iterations: u64, a: f32, b: f32) -> f32 {
    use std::arch::x86_64::{
        _mm512_fmadd_ps, _mm512_reduce_add_ps, _mm512_set1_ps, _mm512_setzero_ps,
    };
    let va = _mm512_set1_ps(a);
    let vb = _mm512_set1_ps(b);
    // As in the AVX2 kernel: twelve named, independent accumulators (32 registers here).
    let z = _mm512_setzero_ps();
    let (mut a0, mut a1, mut a2, mut a3, mut a4, mut a5) = (z, z, z, z, z, z);
    let (mut a6, mut a7, mut a8, mut a9, mut a10, mut a11) = (z, z, z, z, z, z);
    for _ in 0..iterations {
        a0 = _mm512_fmadd_ps(a0, va, vb);
        a1 = _mm512_fmadd_ps(a1, va, vb);
        a2 = _mm512_fmadd_ps(a2, va, vb);
        a3 = _mm512_fmadd_ps(a3, va, vb);
        a4 = _mm512_fmadd_ps(a4, va, vb);
        a5 = _mm512_fmadd_ps(a5, va, vb);
        a6 = _mm512_fmadd_ps(a6, va, vb);
        a7 = _mm512_fmadd_ps(a7, va, vb);
        a8 = _mm512_fmadd_ps(a8, va, vb);
        a9 = _mm512_fmadd_ps(a9, va, vb);
        a10 = _mm512_fmadd_ps(a10, va, vb);
        a11 = _mm512_fmadd_ps(a11, va, vb);
    }
    let mut sum = 0.0f32;
    for slot in [a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11] {
        sum += _mm512_reduce_add_ps(slot);
    }
    sum
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn fma_kernel_avx2(iterations: u64, a: f32, b: f32) -> f32 {
    use std::arch::x86_64::{
        __m256, _mm256_add_ps, _mm256_fmadd_ps, _mm256_set1_ps, _mm256_setzero_ps, _mm256_storeu_ps,
    };
    let va = _mm256_set1_ps(a);
    let vb = _mm256_set1_ps(b);
    // Twelve named accumulators (not an array, which the compiler may keep in memory): each
    // depends only on itself, so the FMAs of one round are independent, issue back to back,
    // and the loop runs at the FMA ports' throughput.
    let z = _mm256_setzero_ps();
    let (mut a0, mut a1, mut a2, mut a3, mut a4, mut a5) = (z, z, z, z, z, z);
    let (mut a6, mut a7, mut a8, mut a9, mut a10, mut a11) = (z, z, z, z, z, z);
    for _ in 0..iterations {
        a0 = _mm256_fmadd_ps(a0, va, vb);
        a1 = _mm256_fmadd_ps(a1, va, vb);
        a2 = _mm256_fmadd_ps(a2, va, vb);
        a3 = _mm256_fmadd_ps(a3, va, vb);
        a4 = _mm256_fmadd_ps(a4, va, vb);
        a5 = _mm256_fmadd_ps(a5, va, vb);
        a6 = _mm256_fmadd_ps(a6, va, vb);
        a7 = _mm256_fmadd_ps(a7, va, vb);
        a8 = _mm256_fmadd_ps(a8, va, vb);
        a9 = _mm256_fmadd_ps(a9, va, vb);
        a10 = _mm256_fmadd_ps(a10, va, vb);
        a11 = _mm256_fmadd_ps(a11, va, vb);
    }
    let mut sum: __m256 = z;
    for slot in [a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11] {
        sum = _mm256_add_ps(sum, slot);
    }
    let mut lanes = [0.0f32; LANES];
    // SAFETY: `lanes` is 8 f32s, exactly the 32 bytes an unaligned store writes. Tested by
    // `fma_kernel_matches_the_scalar_recurrence`.
    unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), sum) };
    lanes.iter().sum()
}

/// Measures the f32 FMA peak with `threads` threads at once, each running [`fma_kernel`] for
/// `iterations` rounds `reps` times. The peak is the best repetition of any thread, times the
/// threads: on a shared machine a short repetition (a few milliseconds, shorter than a
/// scheduler slice) often runs undisturbed, while a long one almost never does, and other work
/// can only slow a repetition down, never speed it up. All threads run at once, so the clock
/// the cores hold with every core busy is the one measured. `None` without AVX2 and FMA.
pub fn measure_fma_peak(threads: usize, iterations: u64, reps: usize) -> Option<FmaPeak> {
    fma_kernel(1, 0.5, 1.0)?;
    let threads = threads.max(1);
    let barrier = std::sync::Barrier::new(threads);
    let best: Vec<f64> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..threads)
            .map(|_| {
                scope.spawn(|| {
                    barrier.wait();
                    let mut best = 0.0f64;
                    for _ in 0..reps.max(1) {
                        let started = std::time::Instant::now();
                        let out = fma_kernel(iterations, std::hint::black_box(0.999_999), 1e-3);
                        std::hint::black_box(out);
                        let seconds = started.elapsed().as_secs_f64().max(1e-9);
                        let flops = out.map_or(0, |run| run.flops_per_iteration);
                        best = best.max((iterations * flops) as f64 / seconds);
                    }
                    best
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap_or(0.0))
            .collect()
    });
    let per_thread = best.iter().copied().fold(0.0, f64::max);
    Some(FmaPeak {
        threads,
        per_thread_gflops: per_thread / 1e9,
        total_gflops: per_thread * threads as f64 / 1e9,
    })
}

/// The warm-up steps `hypershard train` leaves out of its steady state for a run of
/// `steps` steps (a fifth, at least 2 and at most 5, never every step of a run of two or
/// more: the rule of `hypershard::train::warmup_steps`); the suite gives PyTorch the same.
pub fn warmup_steps(steps: u64) -> u64 {
    (steps / 5).clamp(2, 5).min(steps.saturating_sub(1)).max(1)
}

/// Median, minimum and maximum of `values` (`None` when empty).
pub fn spread(values: &[f64]) -> Option<(f64, f64, f64)> {
    if values.is_empty() {
        return None;
    }
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    let mid = sorted.len() / 2;
    let median = if sorted.len() % 2 == 1 {
        sorted[mid]
    } else {
        (sorted[mid - 1] + sorted[mid]) / 2.0
    };
    Some((median, sorted[0], sorted[sorted.len() - 1]))
}

/// Threads per rank that give every rank an equal share of `cores` (at least one).
pub fn threads_per_rank(cores: usize, ranks: usize) -> usize {
    (cores / ranks.max(1)).max(1)
}

/// The cores a run's kernel threads occupy: its threads over all its ranks, at most the
/// machine's `cores`. Four one-thread ranks on two cores share those two, so their FMA peak is
/// two cores' peak, not four.
pub fn cores_used(threads_per_rank: usize, world: usize, cores: usize) -> usize {
    threads_per_rank.saturating_mul(world).min(cores).max(1)
}

/// Processes a mesh (`1`, `N`, `RxS`) runs, or `None` when it does not parse.
pub fn mesh_world(mesh: &str) -> Option<usize> {
    match mesh.split_once('x') {
        Some((r, s)) => Some(r.parse::<usize>().ok()? * s.parse::<usize>().ok()?),
        None => mesh.parse().ok(),
    }
    .filter(|&w| w > 0)
}

/// One preset and mesh: both libraries' runs reduced to medians and the ratio.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TrainCell {
    /// The model preset.
    pub preset: String,
    /// The mesh (`1`: one process, no FSDP).
    pub mesh: String,
    /// Processes.
    pub world: usize,
    /// Kernel threads per rank, both libraries.
    pub threads_per_rank: usize,
    /// The cores those threads occupy ([`cores_used`]): the peak fractions' denominator.
    /// Absent from reports written before it was recorded; [`TrainCell::set_peak`] sets it.
    #[serde(default)]
    pub cores_used: usize,
    /// Sequences per rank per step.
    pub batch_per_rank: usize,
    /// Steps per run, warm-up included.
    pub steps: u64,
    /// Warm-up steps left out, both libraries.
    pub warmup_steps: u64,
    /// Parameters of the model.
    pub params: u64,
    /// Context length (tokens per sequence).
    pub block_size: usize,
    /// Model FLOPs of one step over all ranks ([`step_flops`]), in GFLOP.
    pub step_gflop: f64,
    /// Our runs' steady-state tokens/s: median, min, max.
    pub ours_tokens_per_s: Option<f64>,
    /// Slowest of our runs.
    pub ours_min: Option<f64>,
    /// Fastest of our runs.
    pub ours_max: Option<f64>,
    /// PyTorch's runs' steady-state tokens/s: median, min, max.
    pub torch_tokens_per_s: Option<f64>,
    /// Slowest of PyTorch's runs.
    pub torch_min: Option<f64>,
    /// Fastest of PyTorch's runs.
    pub torch_max: Option<f64>,
    /// Median over the interleaved pairs of ours / PyTorch.
    pub ratio: Option<f64>,
    /// Smallest pair ratio.
    pub ratio_min: Option<f64>,
    /// Largest pair ratio.
    pub ratio_max: Option<f64>,
    /// Our peak resident set per rank (the largest rank, the largest run), MiB.
    pub ours_peak_rss_mib: Option<f64>,
    /// PyTorch's, likewise.
    pub torch_peak_rss_mib: Option<f64>,
    /// Our median throughput's FLOP/s over the FMA peak of the cores the run uses
    /// (`cores_used`).
    pub ours_peak_fraction: Option<f64>,
    /// PyTorch's, likewise.
    pub torch_peak_fraction: Option<f64>,
}

/// What one run gave: steady-state tokens/s and the largest rank's peak resident set.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RunFigures {
    /// Steady-state tokens/s (`None`: the run failed).
    pub tokens_per_s: Option<f64>,
    /// Peak resident set of the largest rank, MiB.
    pub peak_rss_mib: Option<f64>,
}

/// What [`TrainCell::reduce`] needs besides the runs.
#[derive(Clone, Debug)]
pub struct CellSpec {
    /// The preset's name.
    pub preset: String,
    /// Its shape.
    pub shape: GptShape,
    /// The mesh.
    pub mesh: String,
    /// Processes.
    pub world: usize,
    /// Threads per rank.
    pub threads_per_rank: usize,
    /// The machine's cores, which every rank's threads share.
    pub cores: usize,
    /// Sequences per rank.
    pub batch_per_rank: usize,
    /// Steps per run.
    pub steps: u64,
}

impl TrainCell {
    /// Reduces interleaved runs (`pairs[i]` = ours and PyTorch's i-th run, PyTorch's `None`
    /// when it did not run) against an FMA peak of `peak_gflops_per_thread` per thread.
    pub fn reduce(
        spec: &CellSpec,
        pairs: &[(RunFigures, Option<RunFigures>)],
        peak_gflops_per_thread: Option<f64>,
    ) -> TrainCell {
        let ours: Vec<f64> = pairs.iter().filter_map(|(o, _)| o.tokens_per_s).collect();
        let torch: Vec<f64> = pairs
            .iter()
            .filter_map(|(_, t)| t.and_then(|t| t.tokens_per_s))
            .collect();
        let ratios: Vec<f64> = pairs
            .iter()
            .filter_map(|(o, t)| Some(o.tokens_per_s? / t.as_ref()?.tokens_per_s?))
            .collect();
        let peak_rss = |values: Vec<Option<f64>>| values.into_iter().flatten().reduce(f64::max);
        let tokens_per_step = (spec.world * spec.batch_per_rank * spec.shape.block_size) as u64;
        let flops = step_flops(&spec.shape, tokens_per_step);
        let cores = cores_used(spec.threads_per_rank, spec.world, spec.cores);
        let peak = peak_gflops_per_thread.map(|p| p * 1e9 * cores as f64);
        let fraction = |tokens_per_s: Option<f64>| {
            Some(tokens_per_s? / tokens_per_step as f64 * flops / peak?)
        };
        let (om, omin, omax) = split(spread(&ours));
        let (tm, tmin, tmax) = split(spread(&torch));
        let (rm, rmin, rmax) = split(spread(&ratios));
        TrainCell {
            preset: spec.preset.clone(),
            mesh: spec.mesh.clone(),
            world: spec.world,
            threads_per_rank: spec.threads_per_rank,
            cores_used: cores,
            batch_per_rank: spec.batch_per_rank,
            steps: spec.steps,
            warmup_steps: warmup_steps(spec.steps),
            params: spec.shape.params(),
            block_size: spec.shape.block_size,
            step_gflop: flops / 1e9,
            ours_tokens_per_s: om,
            ours_min: omin,
            ours_max: omax,
            torch_tokens_per_s: tm,
            torch_min: tmin,
            torch_max: tmax,
            ratio: rm,
            ratio_min: rmin,
            ratio_max: rmax,
            ours_peak_rss_mib: peak_rss(pairs.iter().map(|(o, _)| o.peak_rss_mib).collect()),
            torch_peak_rss_mib: peak_rss(
                pairs
                    .iter()
                    .map(|(_, t)| t.and_then(|t| t.peak_rss_mib))
                    .collect(),
            ),
            ours_peak_fraction: fraction(om),
            torch_peak_fraction: fraction(tm),
        }
    }
}

impl TrainCell {
    /// Recomputes the peak fractions against `peak_gflops_per_thread` per core of a machine
    /// with `cores` cores.
    pub fn set_peak(&mut self, peak_gflops_per_thread: f64, cores: usize) {
        self.cores_used = cores_used(self.threads_per_rank, self.world, cores);
        let peak = peak_gflops_per_thread * 1e9 * self.cores_used as f64;
        let flops_per_token = self.step_gflop * 1e9
            / (self.world * self.batch_per_rank) as f64
            / self.block_size as f64;
        let fraction = |t: Option<f64>| t.map(|t| t * flops_per_token / peak);
        self.ours_peak_fraction = fraction(self.ours_tokens_per_s);
        self.torch_peak_fraction = fraction(self.torch_tokens_per_s);
    }
}

fn split(s: Option<(f64, f64, f64)>) -> (Option<f64>, Option<f64>, Option<f64>) {
    match s {
        Some((a, b, c)) => (Some(a), Some(b), Some(c)),
        None => (None, None, None),
    }
}

/// The markdown table of the cells, as docs/performance.md shows it.
pub fn markdown_table(cells: &[TrainCell]) -> String {
    let num = |v: Option<f64>, digits: usize| match v {
        Some(v) => format!("{v:.digits$}"),
        None => "–".to_string(),
    };
    let pct = |v: Option<f64>| match v {
        Some(v) => format!("{:.1} %", 100.0 * v),
        None => "–".to_string(),
    };
    let mut out = String::from(
        "| model | mesh | threads/rank | hypershard tok/s | PyTorch FSDP2 tok/s | ratio (min–max) \
         | hypershard % of FMA peak | PyTorch % of FMA peak | peak RSS/rank MiB (ours / torch) |\n\
         |---|---|---|---|---|---|---|---|---|\n",
    );
    for c in cells {
        let mesh = match c.mesh.as_str() {
            "1" => "1 process".to_string(),
            m if m.contains('x') => format!("HSDP {m}"),
            m => format!("FSDP {m}"),
        };
        let digits = |v: Option<f64>| if v.is_some_and(|v| v < 1000.0) { 1 } else { 0 };
        out += &format!(
            "| {} (batch {}) | {mesh} | {} | {} | {} | {} ({}–{}) | {} | {} | {} / {} |\n",
            c.preset,
            c.batch_per_rank,
            c.threads_per_rank,
            num(c.ours_tokens_per_s, digits(c.ours_tokens_per_s)),
            num(c.torch_tokens_per_s, digits(c.torch_tokens_per_s)),
            num(c.ratio, 2),
            num(c.ratio_min, 2),
            num(c.ratio_max, 2),
            pct(c.ours_peak_fraction),
            pct(c.torch_peak_fraction),
            num(c.ours_peak_rss_mib, 0),
            num(c.torch_peak_rss_mib, 0),
        );
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gpt2_step_flops_follow_the_closed_form() {
        let gpt2 = preset("gpt2").expect("preset");
        // 12·12·768² + 50304·768 = 84 934 656 + 38 633 472 matmul weights.
        let matmul = 84_934_656.0 + 38_633_472.0;
        let attention = 12.0 * 12.0 * 1024.0 * 768.0;
        let expected = (6.0 * matmul + attention) * 1024.0;
        assert_eq!(step_flops(&gpt2, 1024), expected);
        // ≈ 0.875 TFLOP for one sequence of 1024 tokens, and linear in the tokens.
        assert!((step_flops(&gpt2, 1024) / 1e12 - 0.8752).abs() < 1e-3);
        assert_eq!(step_flops(&gpt2, 4096), 4.0 * expected);
        // nanoGPT's GPT-2 has 124 M parameters (wte tied to the head, counted once).
        assert_eq!(gpt2.params(), 124_475_904);
    }

    #[test]
    fn fma_kernel_matches_the_scalar_recurrence() {
        let Some(run) = fma_kernel(37, 0.5, 1.0) else {
            // Without AVX2/FMA the kernel says so, and no peak is made up.
            assert!(measure_fma_peak(1, 10, 1).is_none());
            return;
        };
        // Each lane: x ← 0.5·x + 1 from 0, 37 times: 2 − 2^(1−37), then summed over
        // 12 accumulators × the lanes of the widest vector (8 for AVX2, 16 for AVX-512).
        let mut x = 0.0f32;
        for _ in 0..37 {
            x = x.mul_add(0.5, 1.0);
        }
        let lanes = match fma_isa() {
            Some("AVX-512") => LANES_512,
            _ => LANES,
        };
        assert_eq!(run.flops_per_iteration, (2 * ACCUMULATORS * lanes) as u64);
        assert_eq!(run.sum, x * (ACCUMULATORS * lanes) as f32);
        assert!((run.sum - 2.0 * (ACCUMULATORS * lanes) as f32).abs() < 1e-3);
        let peak = measure_fma_peak(1, 1000, 1).expect("the kernel ran above");
        assert!(peak.per_thread_gflops > 0.0 && peak.total_gflops >= peak.per_thread_gflops);
    }

    #[test]
    fn meshes_threads_and_warmup() {
        assert_eq!(mesh_world("1"), Some(1));
        assert_eq!(mesh_world("2x2"), Some(4));
        assert_eq!(mesh_world("4"), Some(4));
        assert_eq!(mesh_world("0"), None);
        assert_eq!(mesh_world("2xq"), None);
        assert_eq!(threads_per_rank(2, 1), 2);
        assert_eq!(threads_per_rank(2, 4), 1);
        assert_eq!(threads_per_rank(16, 4), 4);
        assert_eq!(
            [1, 2, 3, 4, 10, 30, 400].map(warmup_steps),
            [1, 1, 2, 2, 2, 5, 5]
        );
    }

    #[test]
    fn a_cell_reduces_pairs_to_medians_ratios_and_peak_fractions() {
        let spec = CellSpec {
            preset: "small".into(),
            shape: preset("small").expect("preset"),
            mesh: "1".into(),
            world: 1,
            threads_per_rank: 2,
            cores: 2,
            batch_per_rank: 8,
            steps: 30,
        };
        let run = |t: f64, rss: f64| RunFigures {
            tokens_per_s: Some(t),
            peak_rss_mib: Some(rss),
        };
        let failed = RunFigures {
            tokens_per_s: None,
            peak_rss_mib: None,
        };
        let pairs = [
            (run(100.0, 10.0), Some(run(50.0, 300.0))),
            (run(120.0, 12.0), Some(run(40.0, 310.0))),
            (run(90.0, 11.0), Some(failed)),
        ];
        let cell = TrainCell::reduce(&spec, &pairs, Some(10.0));
        assert_eq!(cell.ours_tokens_per_s, Some(100.0));
        assert_eq!((cell.ours_min, cell.ours_max), (Some(90.0), Some(120.0)));
        assert_eq!(cell.torch_tokens_per_s, Some(45.0));
        // The pairs that both finished: 2.0 and 3.0.
        assert_eq!(cell.ratio, Some(2.5));
        assert_eq!((cell.ratio_min, cell.ratio_max), (Some(2.0), Some(3.0)));
        assert_eq!(cell.ours_peak_rss_mib, Some(12.0));
        assert_eq!(cell.torch_peak_rss_mib, Some(310.0));
        // 100 tok/s × FLOPs per token over 2 threads × 10 GFLOP/s.
        let per_token = step_flops(&spec.shape, 1);
        let fraction = cell.ours_peak_fraction.expect("peak given");
        assert!((fraction - 100.0 * per_token / 20e9).abs() < 1e-12);
        assert_eq!(cell.warmup_steps, 5);
        assert_eq!(cell.cores_used, 2);
        let mut halved = cell.clone();
        halved.set_peak(20.0, 2);
        let half = halved.ours_peak_fraction.expect("peak given");
        assert!((half - fraction / 2.0).abs() < 1e-12);
        // Four one-thread ranks on the same two cores: the peak is still two cores'.
        let shared = CellSpec {
            mesh: "2x2".into(),
            world: 4,
            threads_per_rank: 1,
            ..spec.clone()
        };
        let four = TrainCell::reduce(&shared, &pairs, Some(10.0));
        assert_eq!(four.cores_used, 2);
        let per_token = step_flops(&shared.shape, 1);
        let four_fraction = four.ours_peak_fraction.expect("peak given");
        assert!((four_fraction - 100.0 * per_token / 20e9).abs() < 1e-12);
        // On a machine of eight cores they would have four to themselves.
        let mut roomy = four.clone();
        roomy.set_peak(10.0, 8);
        assert_eq!(roomy.cores_used, 4);
        let roomy_fraction = roomy.ours_peak_fraction.expect("peak given");
        assert!((roomy_fraction - four_fraction / 2.0).abs() < 1e-12);
        let table = markdown_table(&[cell]);
        assert!(
            table.contains("| small (batch 8) | 1 process | 2 | 100.0 | 45.0 | 2.50 (2.00–3.00) |")
        );
    }
}
