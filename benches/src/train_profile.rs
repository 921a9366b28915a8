//! Where one process's training step goes: `bench-train --profile` times, in one process on
//! the kernel threads a single-process `hypershard train` gets, the phases of a step of the
//! nanoGPT model (forward, loss, backward, optimizer) and, separately, the pieces the forward
//! and backward consist of: every weight GEMM of the step at its real shape and transposes,
//! and the attention core (`CausalSelfAttention` forward and backward less its two
//! projections' GEMMs). The rest of forward + backward is the elementwise work (layer norms,
//! GELU, residual adds, embedding, softmax-cross-entropy, bias adds) and the autograd
//! bookkeeping.
//!
//! Every figure is CPU time summed over the process's threads (`CLOCK_PROCESS_CPUTIME_ID`),
//! not wall time: on a machine shared with other jobs the wall time of a phase
//! says more about the others than about the phase, while the CPU time a phase takes is its
//! own (rayon's threads spinning for work count, as they cost a core).

use hypershard_nn::linalg::{MatmulOptions, matmul_f32_into};
use hypershard_nn::optim::{AdamW, AdamWConfig};
use hypershard_nn::{
    CausalSelfAttention, CausalSelfAttentionConfig, DEFAULT_IGNORE_INDEX, Gpt, GptConfig, Module,
    cross_entropy, with_num_threads, zero_grad,
};
use hypershard_tensor::{DType, RandomInit, Tensor};
use serde::Serialize;

use crate::memory::GptShape;
use crate::train::spread;

/// One preset's profile; CPU times (all threads) in milliseconds, medians over the
/// repetitions.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct PhaseProfile {
    /// The preset.
    pub preset: String,
    /// Sequences in the batch.
    pub batch: usize,
    /// Kernel threads.
    pub threads: usize,
    /// Timed repetitions (after one untimed).
    pub reps: usize,
    /// The whole step: forward, loss, backward, optimizer, zero_grad.
    pub step_ms: f64,
    /// Model forward (to the logits).
    pub forward_ms: f64,
    /// Softmax cross-entropy and its gradient.
    pub loss_ms: f64,
    /// Model backward.
    pub backward_ms: f64,
    /// AdamW over every parameter, and zero_grad.
    pub optimizer_ms: f64,
    /// All weight GEMMs of the forward (the output head included).
    pub gemm_forward_ms: f64,
    /// All weight GEMMs of the backward (input and weight gradients).
    pub gemm_backward_ms: f64,
    /// GFLOP per CPU-second of those GEMMs together (per core busy).
    pub gemm_gflops: f64,
    /// Attention core (scores, softmax, weighted values) forward and backward, all layers.
    pub attention_ms: f64,
    /// Forward + loss + backward less GEMMs and attention: elementwise passes and bookkeeping.
    pub elementwise_ms: f64,
}

fn err(e: impl std::fmt::Display) -> String {
    e.to_string()
}

/// Seconds of CPU time all threads of this process have run so far
/// (`CLOCK_PROCESS_CPUTIME_ID`, which counts the running threads up to the call).
pub fn process_cpu_seconds() -> Result<f64, String> {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid, writable timespec that outlives the call, the only memory the
    // call writes. Tested by `cpu_time_counts_work_not_sleep`.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_PROCESS_CPUTIME_ID, &mut ts) };
    if rc != 0 {
        return Err(format!(
            "clock_gettime(CLOCK_PROCESS_CPUTIME_ID): {}",
            std::io::Error::last_os_error()
        ));
    }
    Ok(ts.tv_sec as f64 + ts.tv_nsec as f64 * 1e-9)
}

/// A point in CPU time.
#[derive(Clone, Copy)]
struct CpuClock(f64);

impl CpuClock {
    fn now() -> Result<CpuClock, String> {
        process_cpu_seconds().map(CpuClock)
    }

    fn duration_since(self, earlier: CpuClock) -> f64 {
        self.0 - earlier.0
    }

    fn elapsed(self) -> Result<f64, String> {
        Ok(CpuClock::now()?.duration_since(self))
    }
}

fn median_ms(samples: &[f64]) -> f64 {
    spread(samples).map_or(f64::NAN, |(m, _, _)| m * 1e3)
}

/// The weight matrices of one step: `(rows of x, in, out, count)`.
fn linears(shape: &GptShape, batch: usize) -> Vec<(usize, usize, usize, usize)> {
    let rows = batch * shape.block_size;
    let (c, l, v) = (shape.n_embd, shape.n_layer, shape.vocab_size);
    vec![
        (rows, c, 3 * c, l),
        (rows, c, c, l),
        (rows, c, 4 * c, l),
        (rows, 4 * c, c, l),
        (rows, c, v, 1),
    ]
}

/// Seconds of one `[rows, in] → [rows, out]` linear's forward GEMM and its two backward ones,
/// with the operand layouts `Linear` uses, each into a preallocated output as a `Linear`
/// writes its products (so neither an operand copy nor a fresh output's page faults count).
fn time_linear(rows: usize, n_in: usize, n_out: usize, seed: u64) -> Result<(f64, f64), String> {
    let random = |shape: &[usize], s| -> Result<Vec<f32>, String> {
        Tensor::random(shape, DType::F32, RandomInit::uniform(seed + s, -1.0, 1.0))
            .and_then(|t| t.to_vec::<f32>())
            .map_err(err)
    };
    let x = random(&[rows, n_in], 0)?;
    let w = random(&[n_out, n_in], 1)?;
    let gy = random(&[rows, n_out], 2)?;
    let nt = MatmulOptions {
        transpose_a: false,
        transpose_b: true,
    };
    let tn = MatmulOptions {
        transpose_a: true,
        transpose_b: false,
    };
    let mut y = vec![0.0f32; rows * n_out];
    let mut gx = vec![0.0f32; rows * n_in];
    let mut gw = vec![0.0f32; n_out * n_in];
    let started = CpuClock::now()?;
    matmul_f32_into(&x, &w, [rows, n_in, n_out], nt, &mut y).map_err(err)?;
    let forward = started.elapsed()?;
    let started = CpuClock::now()?;
    let plain = MatmulOptions::default();
    matmul_f32_into(&gy, &w, [rows, n_out, n_in], plain, &mut gx).map_err(err)?;
    matmul_f32_into(&gy, &x, [n_out, rows, n_in], tn, &mut gw).map_err(err)?;
    Ok((forward, started.elapsed()?))
}

/// Profiles `preset` at `batch` sequences on `threads` threads, `reps` timed repetitions.
pub fn profile(
    preset: &str,
    shape: &GptShape,
    batch: usize,
    threads: usize,
    reps: usize,
) -> Result<PhaseProfile, String> {
    let config = GptConfig {
        vocab_size: shape.vocab_size,
        block_size: shape.block_size,
        n_layer: shape.n_layer,
        n_head: shape.n_head,
        n_embd: shape.n_embd,
        bias: shape.bias,
        dropout: 0.0,
        dtype: DType::F32,
        seed: 0,
    };
    let tokens = batch * shape.block_size;
    let ids = |seed: u64| {
        let values: Vec<i64> = (0..tokens)
            .map(|i| {
                (hypershard_tensor::random::random_bits(seed, i as u64) % shape.vocab_size as u64)
                    as i64
            })
            .collect();
        Tensor::from_vec(values, &[batch, shape.block_size]).map_err(err)
    };
    let (inputs, targets) = (ids(3)?, ids(4)?);
    with_num_threads(threads, || -> Result<PhaseProfile, String> {
        let mut model = Gpt::new(config).map_err(err)?;
        let mut optimizer = AdamW::new(AdamWConfig::default()).map_err(err)?;
        let mut attention = CausalSelfAttention::new(CausalSelfAttentionConfig {
            n_embd: shape.n_embd,
            n_head: shape.n_head,
            bias: shape.bias,
            dropout: 0.0,
            dtype: DType::F32,
            seed: 5,
        })
        .map_err(err)?;
        let x = Tensor::random(
            &[batch, shape.block_size, shape.n_embd],
            DType::F32,
            RandomInit::uniform(6, -1.0, 1.0),
        )
        .map_err(err)?;
        let ones = Tensor::random(
            &[batch, shape.block_size, shape.n_embd],
            DType::F32,
            RandomInit::uniform(7, -1.0, 1.0),
        )
        .map_err(err)?;
        let mut phases: [Vec<f64>; 9] = Default::default();
        let mut gemm_flops = 0.0;
        for rep in 0..=reps {
            let t0 = CpuClock::now()?;
            let logits = model.forward(&inputs).map_err(err)?;
            let t1 = CpuClock::now()?;
            let loss = cross_entropy(&logits, &targets, DEFAULT_IGNORE_INDEX).map_err(err)?;
            let t2 = CpuClock::now()?;
            model.backward(&loss.grad).map_err(err)?;
            let t3 = CpuClock::now()?;
            optimizer.step(&mut model).map_err(err)?;
            zero_grad(&mut model).map_err(err)?;
            let t4 = CpuClock::now()?;
            drop((logits, loss));
            let (mut gemm_fwd, mut gemm_bwd) = (0.0, 0.0);
            let mut flops = 0.0;
            // The attention module's own projections, to subtract from its time.
            let (mut proj_fwd, mut proj_bwd) = (0.0, 0.0);
            for (i, (rows, n_in, n_out, count)) in linears(shape, batch).into_iter().enumerate() {
                let (f, b) = time_linear(rows, n_in, n_out, 10 * i as u64)?;
                gemm_fwd += f * count as f64;
                gemm_bwd += b * count as f64;
                flops += 6.0 * (rows * n_in * n_out * count) as f64;
                if i < 2 {
                    proj_fwd += f;
                    proj_bwd += b;
                }
            }
            let a0 = CpuClock::now()?;
            let y = attention.forward(&x).map_err(err)?;
            attention.backward(&ones).map_err(err)?;
            let one_layer = a0.elapsed()? - proj_fwd - proj_bwd;
            drop(y);
            zero_grad(&mut attention).map_err(err)?;
            if rep == 0 {
                continue;
            }
            let s = |a: CpuClock, b: CpuClock| b.duration_since(a);
            phases[0].push(s(t0, t4));
            phases[1].push(s(t0, t1));
            phases[2].push(s(t1, t2));
            phases[3].push(s(t2, t3));
            phases[4].push(s(t3, t4));
            phases[5].push(gemm_fwd);
            phases[6].push(gemm_bwd);
            phases[7].push(one_layer.max(0.0) * shape.n_layer as f64);
            phases[8].push(s(t0, t3) - gemm_fwd - gemm_bwd - one_layer * shape.n_layer as f64);
            gemm_flops = flops;
        }
        let gemm_ms = median_ms(&phases[5]) + median_ms(&phases[6]);
        Ok(PhaseProfile {
            preset: preset.to_string(),
            batch,
            threads,
            reps,
            step_ms: median_ms(&phases[0]),
            forward_ms: median_ms(&phases[1]),
            loss_ms: median_ms(&phases[2]),
            backward_ms: median_ms(&phases[3]),
            optimizer_ms: median_ms(&phases[4]),
            gemm_forward_ms: median_ms(&phases[5]),
            gemm_backward_ms: median_ms(&phases[6]),
            gemm_gflops: gemm_flops / (gemm_ms / 1e3) / 1e9,
            attention_ms: median_ms(&phases[7]),
            elementwise_ms: median_ms(&phases[8]),
        })
    })
    .map_err(err)?
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::train::{preset, step_flops};

    #[test]
    fn the_profiled_gemms_are_the_step_flops_without_attention() {
        let shape = preset("medium").expect("preset");
        let gemm: f64 = linears(&shape, 8)
            .iter()
            .map(|&(rows, n_in, n_out, count)| 6.0 * (rows * n_in * n_out * count) as f64)
            .sum();
        let tokens = 8 * shape.block_size as u64;
        let attention = 12.0 * (shape.n_layer * shape.block_size * shape.n_embd) as f64;
        assert_eq!(gemm, step_flops(&shape, tokens) - attention * tokens as f64);
    }

    /// The tests that read the process's CPU time run one at a time (each counts the others').
    static CPU: std::sync::Mutex<()> = std::sync::Mutex::new(());

    #[test]
    fn a_tiny_profile_accounts_for_its_step() {
        let _one = CPU.lock().unwrap_or_else(|e| e.into_inner());
        let shape = preset("tiny").expect("preset");
        let p = profile("tiny", &shape, 2, 1, 1).expect("profile");
        assert_eq!((p.batch, p.threads, p.reps), (2, 1, 1));
        let parts = p.forward_ms + p.loss_ms + p.backward_ms + p.optimizer_ms;
        // The step is timed from the same instants as its phases.
        assert!(
            (parts - p.step_ms).abs() < 1e-6 * p.step_ms.max(1.0),
            "{p:?}"
        );
        assert!(p.gemm_forward_ms > 0.0 && p.gemm_backward_ms > 0.0 && p.gemm_gflops > 0.0);
    }

    #[test]
    fn cpu_time_counts_work_not_sleep() {
        let _one = CPU.lock().unwrap_or_else(|e| e.into_inner());
        let before = process_cpu_seconds().expect("schedstat");
        std::thread::sleep(std::time::Duration::from_millis(50));
        let slept = process_cpu_seconds().expect("schedstat") - before;
        let started = std::time::Instant::now();
        let mut x = 0u64;
        while started.elapsed().as_millis() < 50 {
            x = std::hint::black_box(x.wrapping_mul(6364136223846793005).wrapping_add(1));
        }
        let spun = process_cpu_seconds().expect("schedstat") - before - slept;
        // Other tests of this process may run meanwhile (not the profile, which holds the
        // lock): the sleep costs far less than the spin, which gets at most its wall time
        // per thread running.
        assert!(spun > 0.005, "spinning 50 ms counted {spun} s of CPU");
        assert!(
            slept < spun,
            "sleeping cost {slept} s of CPU, spinning {spun} s"
        );
    }
}
