//! nn on a CUDA device (`--features cuda`; brings its own main).
//!
//! Every test body is a function of the device it runs on, returning the tensors it made
//! (outputs, input gradients, parameters and their gradients, losses). Always, each body runs
//! on the host and on the emulated device and must give the same bits there (so the bodies
//! themselves are checked on every machine). With `HYPERSHARD_TEST_GPU=1` the GPU must be
//! there (else this FAILS, loudly), each body runs on `Device::Cuda { ordinal: 0 }` too and
//! must agree with the host within its tolerance (cuBLAS and the row kernels sum in their own
//! order, in f32). Without the variable the GPU part runs only when a GPU happens to be usable;
//! the binary says which.
//!
//! With the argument `--bench`: the reference MLP's training step timed on the GPU and on the
//! host, written to `target/bench/nn-cuda-mlp.json` (fails without a GPU).

use std::process::ExitCode;
use std::time::Instant;

use hypershard_nn::linalg::{MatmulOptions, matmul_with};
use hypershard_nn::optim::{AdamW, AdamWConfig, Sgd, SgdConfig, clip_grad_norm};
use hypershard_nn::{
    Block, BlockConfig, CausalSelfAttention, CausalSelfAttentionConfig, DEFAULT_IGNORE_INDEX,
    Dropout, Embedding, EmbeddingConfig, Error, Gelu, GeluApproximation, Gpt, GptConfig, LayerNorm,
    LayerNormConfig, Linear, LinearConfig, Mlp, Module, Relu, Result, RmsNorm, RmsNormConfig,
    Sequential, Silu, cross_entropy, mse_loss, to_device, zero_grad,
};
use hypershard_tensor::cuda::CudaDevice;
use hypershard_tensor::{DType, Device, Tensor};
use hypershard_testkit::device::{GPU_ENV, Outcome, Tally, contained, fail, gpu_asked};

mod common;
use common::{EMULATED, forward_backward, normal, params_and_grads};

const GPU: Device = Device::Cuda { ordinal: 0 };

/// A test body: the tensors it made on the device it was given.
type Body = fn(&Device) -> Result<Vec<Tensor>>;

/// How far a GPU result may be from the host's: `|gpu − host| ≤ atol + rtol · |host|`.
#[derive(Clone, Copy)]
struct Tolerance {
    rtol: f64,
    atol: f64,
}

/// One f32 layer: cuBLAS and the row kernels sum in their own order (a few ulp).
const LAYER: Tolerance = Tolerance {
    rtol: 1e-4,
    atol: 1e-5,
};
/// bf16 storage: one rounding of 2⁻⁸ either side.
const HALF: Tolerance = Tolerance {
    rtol: 1.6e-2,
    atol: 1e-2,
};
/// A few optimizer steps: rounding differences pass through the updates; AdamW's
/// `m / √v` amplifies them for gradients near zero, by at most `lr` per step.
const TRAINING: Tolerance = Tolerance {
    rtol: 1e-3,
    atol: 5e-3,
};

/// A few optimizer steps in bf16: a rounding either side per step.
const HALF_TRAINING: Tolerance = Tolerance {
    rtol: 3e-2,
    atol: 3e-2,
};

fn linear(dtype: DType, bias: bool, [i, o]: [usize; 2], seed: u64) -> Result<Linear> {
    Linear::new(LinearConfig {
        in_features: i,
        out_features: o,
        bias,
        dtype,
        seed,
    })
}

fn linear_f32(d: &Device) -> Result<Vec<Tensor>> {
    let x = normal(&[2, 3, 6], DType::F32, 1)?;
    let mut out = forward_backward(&mut linear(DType::F32, true, [6, 5], 4)?, d, &x, 2)?;
    out.extend(forward_backward(
        &mut linear(DType::F32, false, [6, 5], 6)?,
        d,
        &x,
        3,
    )?);
    Ok(out)
}

fn linear_bf16(d: &Device) -> Result<Vec<Tensor>> {
    let x = normal(&[4, 6], DType::BF16, 1)?;
    forward_backward(&mut linear(DType::BF16, true, [6, 5], 4)?, d, &x, 2)
}

fn embedding(d: &Device) -> Result<Vec<Tensor>> {
    let ids = Tensor::from_vec(vec![3i64, 0, 3, 5, 1, 1], &[2, 3])?;
    let mut emb = Embedding::new(EmbeddingConfig {
        num_embeddings: 6,
        embedding_dim: 4,
        dtype: DType::F32,
        seed: 9,
    })?;
    forward_backward(&mut emb, d, &ids, 5)
}

fn layer_norm(d: &Device) -> Result<Vec<Tensor>> {
    let x = normal(&[3, 2, 8], DType::F32, 6)?;
    let mut out = Vec::new();
    for bias in [true, false] {
        let mut ln = LayerNorm::new(LayerNormConfig {
            normalized_shape: 8,
            eps: 1e-5,
            bias,
            dtype: DType::F32,
        })?;
        // Non-trivial parameters, so that their gradients matter.
        ln.weight.data = Some(normal(&[8], DType::F32, 7)?);
        out.extend(forward_backward(&mut ln, d, &x, 8)?);
    }
    // RMSNorm runs the same kernels without centring.
    let mut rms = RmsNorm::new(RmsNormConfig {
        normalized_shape: 8,
        eps: None,
        dtype: DType::F32,
    })?;
    rms.weight.data = Some(normal(&[8], DType::F32, 9)?);
    out.extend(forward_backward(&mut rms, d, &x, 10)?);
    Ok(out)
}

fn activations(d: &Device) -> Result<Vec<Tensor>> {
    let x = normal(&[3, 700], DType::F32, 10)?;
    let mut out = forward_backward(&mut Gelu::new(GeluApproximation::None), d, &x, 12)?;
    out.extend(forward_backward(&mut Relu::new(), d, &x, 14)?);
    out.extend(forward_backward(
        &mut Gelu::new(GeluApproximation::Tanh),
        d,
        &x,
        15,
    )?);
    out.extend(forward_backward(&mut Silu::new(), d, &x, 16)?);
    // Training dropout: the mask is drawn from the layer's seed on either device.
    out.extend(forward_backward(&mut Dropout::new(0.3, 17)?, d, &x, 18)?);
    Ok(out)
}

fn attention_config() -> CausalSelfAttentionConfig {
    CausalSelfAttentionConfig {
        n_embd: 8,
        n_head: 2,
        bias: true,
        dropout: 0.0,
        dtype: DType::F32,
        seed: 21,
    }
}

/// Attention without dropout, then in training with dropout 0.2 on the weights and the
/// residual (two forwards, so the second draws the next masks), at T = 37 (weights over
/// several tiles of the host's kernel), then with one head of width 136: wider than the CUDA
/// tiled kernels take, so the GPU runs the dense path with the dropout child.
fn attention(d: &Device) -> Result<Vec<Tensor>> {
    let x = normal(&[2, 5, 8], DType::F32, 22)?;
    let mut out = forward_backward(
        &mut CausalSelfAttention::new(attention_config())?,
        d,
        &x,
        23,
    )?;
    let mut dropped = CausalSelfAttention::new(CausalSelfAttentionConfig {
        dropout: 0.2,
        ..attention_config()
    })?;
    let x = normal(&[2, 37, 8], DType::F32, 24)?;
    for seed in [25, 26] {
        out.extend(forward_backward(&mut dropped, d, &x, seed)?);
    }
    let mut wide = CausalSelfAttention::new(CausalSelfAttentionConfig {
        n_embd: 136,
        n_head: 1,
        dropout: 0.2,
        ..attention_config()
    })?;
    let x = normal(&[2, 9, 136], DType::F32, 27)?;
    out.extend(forward_backward(&mut wide, d, &x, 28)?);
    Ok(out)
}

fn block_config() -> BlockConfig {
    BlockConfig {
        n_embd: 8,
        n_head: 2,
        bias: true,
        dropout: 0.0,
        dtype: DType::F32,
        seed: 31,
    }
}

fn blocks(d: &Device) -> Result<Vec<Tensor>> {
    let x = normal(&[2, 4, 8], DType::F32, 32)?;
    let mut out = forward_backward(&mut Mlp::new(block_config())?, d, &x, 33)?;
    out.extend(forward_backward(
        &mut Block::new(block_config())?,
        d,
        &x,
        34,
    )?);
    Ok(out)
}

fn losses_and_matmul(d: &Device) -> Result<Vec<Tensor>> {
    let logits = normal(&[4, 5], DType::F32, 40)?;
    let targets = Tensor::from_vec(vec![1i64, DEFAULT_IGNORE_INDEX, 4, 0], &[4])?;
    let prediction = normal(&[3, 2], DType::F32, 41)?;
    let target = normal(&[3, 2], DType::F32, 42)?;
    let a = normal(&[3, 4], DType::F32, 43)?;
    let b = normal(&[5, 4], DType::F32, 44)?;
    let ce = cross_entropy(&logits.to_device(d)?, &targets.to_device(d)?, -100)?;
    let mse = mse_loss(&prediction.to_device(d)?, &target.to_device(d)?)?;
    let nt = MatmulOptions {
        transpose_a: false,
        transpose_b: true,
    };
    let tn = MatmulOptions {
        transpose_a: true,
        transpose_b: false,
    };
    let (a, b) = (a.to_device(d)?, b.to_device(d)?);
    Ok(vec![
        Tensor::from_vec_on(vec![ce.loss, mse.loss], &[2], d)?,
        ce.grad,
        mse.grad,
        matmul_with(&a, &b, nt)?,
        matmul_with(&a, &a, tn)?,
    ])
}

/// Three AdamW steps with the gradients clipped, then SGD plain, with momentum, dampening and
/// weight decay, and with Nesterov momentum, two steps each, of a Linear.
fn optimizers(d: &Device) -> Result<Vec<Tensor>> {
    let x = normal(&[3, 6], DType::F32, 50)?;
    let mut layer = linear(DType::F32, true, [6, 5], 4)?;
    let mut adamw = AdamW::new(AdamWConfig::default())?;
    let mut out = Vec::new();
    for step in 0..3 {
        forward_backward(&mut layer, d, &x, 51 + step)?;
        let norm = clip_grad_norm(&mut layer, 0.5)?;
        out.push(Tensor::from_vec_on(vec![norm], &[1], d)?);
        adamw.step(&mut layer)?;
        zero_grad(&mut layer)?;
    }
    out.extend(params_and_grads(&layer)?);
    if let Some(state) = adamw.state("weight") {
        out.extend([state.exp_avg.clone(), state.exp_avg_sq.clone()]);
    }
    let sgd_configs = [
        SgdConfig {
            lr: 0.1,
            ..SgdConfig::default()
        },
        SgdConfig {
            lr: 0.1,
            momentum: 0.9,
            dampening: 0.1,
            weight_decay: 0.01,
            nesterov: false,
        },
        SgdConfig {
            lr: 0.1,
            momentum: 0.8,
            nesterov: true,
            ..SgdConfig::default()
        },
    ];
    for config in sgd_configs {
        let mut layer = linear(DType::F32, true, [6, 5], 8)?;
        let mut sgd = Sgd::new(config)?;
        for step in 0..2 {
            forward_backward(&mut layer, d, &x, 60 + step)?;
            sgd.step(&mut layer)?;
            zero_grad(&mut layer)?;
        }
        out.extend(params_and_grads(&layer)?);
        out.extend(sgd.momentum_buffer("weight").cloned());
    }
    Ok(out)
}

/// Linear(dims[i], dims[i+1]) + ReLU for each step of `dims`, seeds two apart: the reference
/// MLP of the FSDP benchmarks.
fn mlp(dims: &[usize], dtype: DType) -> Result<Sequential> {
    let mut model = Sequential::default();
    for (i, pair) in dims.windows(2).enumerate() {
        model = model
            .with(linear(dtype, true, [pair[0], pair[1]], 2 * i as u64)?)
            .with(Relu::new());
    }
    Ok(model)
}

/// The reference MLP (4 × Linear + ReLU) trained with MSE and plain SGD for five steps in
/// `dtype`: the losses and the final parameters.
fn train_mlp(d: &Device, dtype: DType) -> Result<Vec<Tensor>> {
    let mut mlp = mlp(&[16, 32, 32, 32, 4], dtype)?;
    to_device(&mut mlp, d)?;
    let mut sgd = Sgd::new(SgdConfig {
        lr: 0.05,
        ..SgdConfig::default()
    })?;
    let x = normal(&[8, 16], dtype, 90)?.to_device(d)?;
    let y = normal(&[8, 4], dtype, 91)?.to_device(d)?;
    let mut losses = Vec::new();
    for _ in 0..5 {
        let out = mlp.forward(&x)?;
        let loss = mse_loss(&out, &y)?;
        losses.push(loss.loss);
        mlp.backward(&loss.grad)?;
        sgd.step(&mut mlp)?;
        zero_grad(&mut mlp)?;
    }
    let mut out = vec![Tensor::from_vec_on(losses, &[5], d)?];
    out.extend(params_and_grads(&mlp)?);
    Ok(out)
}

fn reference_mlp(d: &Device) -> Result<Vec<Tensor>> {
    train_mlp(d, DType::F32)
}

fn reference_mlp_bf16(d: &Device) -> Result<Vec<Tensor>> {
    train_mlp(d, DType::BF16)
}

fn small_gpt() -> GptConfig {
    GptConfig {
        vocab_size: 11,
        block_size: 6,
        n_layer: 2,
        n_head: 2,
        n_embd: 8,
        bias: true,
        dropout: 0.0,
        dtype: DType::F32,
        seed: 70,
    }
}

/// Three AdamW steps of a small GPT (logits and `cross_entropy`): the losses, the first
/// step's logits and the final parameters.
fn gpt(d: &Device) -> Result<Vec<Tensor>> {
    let ids = Tensor::from_vec(vec![1i64, 4, 9, 2, 0, 10, 3, 3, 7, 5, 8, 6], &[2, 6])?;
    let targets = Tensor::from_vec(vec![4i64, 9, 2, 0, 10, -100, 3, 7, 5, 8, 6, 1], &[12])?;
    let mut model = Gpt::new(small_gpt())?;
    to_device(&mut model, d)?;
    let mut adamw = AdamW::new(AdamWConfig::default())?;
    let (ids, targets) = (ids.to_device(d)?, targets.to_device(d)?);
    let mut losses = Vec::new();
    let mut first_logits = None;
    for _ in 0..3 {
        let logits = model.forward(&ids)?;
        let flat = logits.view(&[12, 11])?;
        let loss = cross_entropy(&flat, &targets, -100)?;
        losses.push(loss.loss);
        model.backward(&loss.grad.view(logits.shape())?)?;
        first_logits.get_or_insert(logits);
        adamw.step(&mut model)?;
        zero_grad(&mut model)?;
    }
    let mut out = vec![Tensor::from_vec_on(losses, &[3], d)?];
    out.extend(first_logits);
    out.extend(params_and_grads(&model)?);
    Ok(out)
}

/// Three AdamW steps of the small GPT with the loss fused into its head (`Gpt::fused_loss`,
/// as `hypershard train` runs it): the losses and the final parameters.
fn gpt_fused_loss(d: &Device) -> Result<Vec<Tensor>> {
    let ids = Tensor::from_vec(vec![1i64, 4, 9, 2, 0, 10, 3, 3, 7, 5, 8, 6], &[2, 6])?;
    let targets = Tensor::from_vec(vec![4i64, 9, 2, 0, 10, -100, 3, 7, 5, 8, 6, 1], &[2, 6])?;
    let mut model = Gpt::new(small_gpt())?;
    to_device(&mut model, d)?;
    let handle = model.fused_loss(DEFAULT_IGNORE_INDEX);
    let mut adamw = AdamW::new(AdamWConfig::default())?;
    let (ids, targets) = (ids.to_device(d)?, targets.to_device(d)?);
    let mut losses = Vec::new();
    for _ in 0..3 {
        handle.for_backward(targets.clone());
        let loss = model.forward(&ids)?;
        losses.push(loss.to_host()?.to_f64_vec()?[0]);
        model.backward(&Tensor::from_vec_on(vec![1.0f64], &[1], d)?)?;
        adamw.step(&mut model)?;
        zero_grad(&mut model)?;
    }
    let mut out = vec![Tensor::from_vec_on(losses, &[3], d)?];
    out.extend(params_and_grads(&model)?);
    Ok(out)
}

/// The bodies, with the tolerance each needs on a GPU.
const BODIES: [(&str, Body, Tolerance); 13] = [
    ("linear_f32", linear_f32, LAYER),
    ("linear_bf16", linear_bf16, HALF),
    ("embedding", embedding, LAYER),
    ("layer_norm", layer_norm, LAYER),
    ("activations", activations, LAYER),
    ("attention", attention, LAYER),
    ("blocks", blocks, LAYER),
    ("losses_and_matmul", losses_and_matmul, LAYER),
    ("optimizers", optimizers, TRAINING),
    ("reference_mlp", reference_mlp, TRAINING),
    ("reference_mlp_bf16", reference_mlp_bf16, HALF_TRAINING),
    ("gpt", gpt, TRAINING),
    ("gpt_fused_loss", gpt_fused_loss, TRAINING),
];

/// Checks that every tensor of `got` is on `device` and matches the host's within `tol`
/// (`None`: the same bits).
fn agrees(host: &[Tensor], got: &[Tensor], device: Device, tol: Option<Tolerance>) -> Outcome {
    if host.len() != got.len() {
        return Err(format!(
            "{} tensors vs {} on the host",
            got.len(),
            host.len()
        ));
    }
    for (i, (h, g)) in host.iter().zip(got).enumerate() {
        if g.device() != device || g.shape() != h.shape() || g.dtype() != h.dtype() {
            return Err(format!(
                "output {i}: {} {:?} {} on {}, the host's is {:?} {}",
                g.dtype(),
                g.shape(),
                g.device(),
                device,
                h.shape(),
                h.dtype()
            ));
        }
        let g = g.to_host().map_err(fail)?;
        let Some(tol) = tol else {
            if g.to_bytes().map_err(fail)? != h.to_bytes().map_err(fail)? {
                return Err(format!("output {i}: the bits differ from the host's"));
            }
            continue;
        };
        let (hv, gv) = (h.to_f64_vec().map_err(fail)?, g.to_f64_vec().map_err(fail)?);
        for (j, (a, b)) in hv.iter().zip(&gv).enumerate() {
            if (a - b).abs() > tol.atol + tol.rtol * a.abs() || a.is_nan() != b.is_nan() {
                return Err(format!("output {i}[{j}]: {b} on {device}, {a} on the host"));
            }
        }
    }
    Ok(())
}

/// Runs `body` on the host and on `device` and compares.
fn run_body(body: Body, device: Device, tol: Option<Tolerance>) -> Outcome {
    let host = body(&Device::Cpu).map_err(|e| format!("on the host: {e}"))?;
    let got = body(&device).map_err(|e| format!("on {device}: {e}"))?;
    agrees(&host, &got, device, tol)
}

/// Without a usable GPU, moving a tensor or a module to it is a typed error, never a panic.
fn no_gpu_is_a_typed_error() -> Outcome {
    let moved = Tensor::ones(&[2], DType::F32).and_then(|t| t.to_device(&GPU));
    if !matches!(moved, Err(hypershard_tensor::Error::DeviceFailed { .. })) {
        return Err(format!("to_device without a GPU: {moved:?}"));
    }
    let mut layer = linear(DType::F32, true, [2, 2], 0).map_err(fail)?;
    match to_device(&mut layer, &GPU) {
        Err(Error::Tensor(hypershard_tensor::Error::DeviceFailed { .. })) => Ok(()),
        other => Err(format!("a module to a missing GPU: {other:?}")),
    }
}

/// The reference MLP of the FSDP benchmarks (8 × Linear(1024, 1024) + ReLU, MSE, SGD lr
/// 0.01, batch 32): one training step timed on the GPU (f32, bf16) and on the host (f32),
/// written as JSON to `target/bench/nn-cuda-mlp.json`.
fn bench(name: &str) -> Outcome {
    const WIDTH: usize = 1024;
    const DEPTH: usize = 8;
    const BATCH: usize = 32;
    const LR: f64 = 0.01;
    let median = |mut v: Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let step_times = |device: Device, dtype: DType, (warmup, steps): (usize, usize)| {
        let run = || -> Result<(Vec<f64>, Vec<f64>)> {
            let mut model = mlp(&[WIDTH; DEPTH + 1], dtype)?;
            to_device(&mut model, &device)?;
            let mut sgd = Sgd::new(SgdConfig {
                lr: LR,
                ..SgdConfig::default()
            })?;
            let x = normal(&[BATCH, WIDTH], dtype, 10)?.to_device(&device)?;
            let t = normal(&[BATCH, WIDTH], dtype, 20)?.to_device(&device)?;
            let (mut times, mut losses) = (Vec::new(), Vec::new());
            for step in 0..warmup + steps {
                let started = Instant::now();
                let loss = mse_loss(&model.forward(&x)?, &t)?;
                model.backward(&loss.grad)?;
                sgd.step(&mut model)?;
                zero_grad(&mut model)?;
                device.synchronize()?;
                if step >= warmup {
                    times.push(started.elapsed().as_secs_f64() * 1e3);
                    losses.push(loss.loss);
                }
            }
            Ok((times, losses))
        };
        run().map_err(fail)
    };
    let mut rows = Vec::new();
    for dtype in [DType::F32, DType::BF16] {
        let (times, losses) = step_times(GPU, dtype, (5, 50))?;
        rows.push(format!(
            "{{\"where\":\"device\",\"dtype\":\"{dtype}\",\"steps\":50,\"median_ms\":{},\"min_ms\":{},\"first_loss\":{},\"last_loss\":{}}}",
            median(times.clone()),
            times.iter().copied().fold(f64::INFINITY, f64::min),
            losses[0],
            losses[losses.len() - 1]
        ));
    }
    let (times, _) = step_times(Device::Cpu, DType::F32, (2, 10))?;
    let threads = std::thread::available_parallelism().map_or(0, |n| n.get());
    rows.push(format!(
        "{{\"where\":\"cpu\",\"dtype\":\"f32\",\"steps\":10,\"threads\":{threads},\"median_ms\":{},\"min_ms\":{}}}",
        median(times.clone()),
        times.iter().copied().fold(f64::INFINITY, f64::min)
    ));
    let name = name.replace(['"', '\\'], "");
    let json = format!(
        "{{\"bench\":\"nn-cuda-mlp\",\"model\":\"{DEPTH} x (Linear({WIDTH},{WIDTH}) + ReLU), MSE, SGD lr {LR}\",\"batch\":{BATCH},\"device\":\"{name}\",\"rows\":[{}]}}\n",
        rows.join(",")
    );
    std::fs::create_dir_all("target/bench").map_err(fail)?;
    std::fs::write("target/bench/nn-cuda-mlp.json", &json).map_err(fail)?;
    print!("cuda_devices: wrote target/bench/nn-cuda-mlp.json: {json}");
    Ok(())
}

fn main() -> ExitCode {
    let mut tally = Tally::default();
    if std::env::args().any(|a| a == "--bench") {
        // The bench needs the GPU: without one it fails.
        let outcome = CudaDevice::new(0)
            .map_err(fail)
            .and_then(|device| bench(&device.name().map_err(fail)?));
        tally.check("bench", contained(|| outcome));
        return tally.finish();
    }
    for (name, body, _) in BODIES {
        tally.check(
            &format!("{name}_on_the_emulated_device"),
            contained(|| run_body(body, EMULATED, None)),
        );
    }
    match CudaDevice::new(0) {
        Ok(device) => {
            println!(
                "cuda: device 0 is {}; running nn on it",
                device.name().unwrap_or_else(|e| e.to_string())
            );
            for (name, body, tol) in BODIES {
                tally.check(
                    &format!("{name}_on_the_gpu"),
                    contained(|| run_body(body, GPU, Some(tol))),
                );
            }
        }
        Err(error) if gpu_asked() => {
            eprintln!(
                "cuda: {GPU_ENV}=1 asks for the GPU tests, but no CUDA device is usable: {error}"
            );
            tally.check("gpu_available", Err(error.to_string()));
        }
        Err(error) => {
            tally.check(
                "no_gpu_is_a_typed_error",
                contained(no_gpu_is_a_typed_error),
            );
            println!(
                "cuda: {GPU_ENV}=1 is not set and no GPU is usable ({error}), so nn did not run on a GPU"
            );
        }
    }
    tally.finish()
}
