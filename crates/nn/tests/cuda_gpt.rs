//! nanoGPT's GPT on the device (`DeviceGpt`, feature `cuda`) and the tensor crate's GPT
//! kernels, against the CPU code of this crate.
//!
//! Its own `main` (harness = false), like `cuda_mlp`:
//!
//! * always: asking for a device that does not exist (and, with no usable GPU, for device 0)
//!   through `DeviceGpt::open` gives `DeviceError::Cuda(CudaError::Unavailable { .. })`, never
//!   a panic; and, when libnvrtc is loadable (required with `HYPERSHARD_TEST_NVRTC=1` or
//!   `HYPERSHARD_TEST_GPU=1`), the GPT kernels compile for sm_80 and sm_90 without a single
//!   f32 fused multiply-add, which the bit-for-bit checks below rely on;
//! * with `HYPERSHARD_TEST_GPU=1`: no usable device is a FAILURE (exit 1); otherwise each new
//!   kernel is checked against the CPU op (bounds derived in each test), then a tiny GPT
//!   (vocab 67, 2 layers, 2 heads, n_embd 24, block 16, batch 3: sizes that divide nothing
//!   evenly) forward, loss and every gradient, and training steps with SGD and AdamW, against
//!   the CPU GPT from the same initialisation and data;
//! * without the variable the device tests run only when a GPU happens to be usable.

use std::process::ExitCode;

use hypershard_nn::cuda::{DeviceError, DeviceGpt};
use hypershard_nn::optim::{AdamW, AdamWConfig, Sgd, SgdConfig};
use hypershard_nn::{
    DEFAULT_IGNORE_INDEX, Gelu, GeluApproximation, Gpt, GptConfig, LayerNorm, LayerNormConfig,
    Module, ParamVisitor, cross_entropy, zero_grad,
};
use hypershard_tensor::cuda::{
    AdamWStep, CudaDevice, CudaError, CudaTensor, KERNEL_NAMES, KernelImage, TokenIndex, Transpose,
    Unavailable, adamw_, causal_softmax_, causal_softmax_backward_, compile_kernels,
    cross_entropy as device_cross_entropy, device_count, embedding, embedding_backward, gelu,
    gelu_backward, gemm_strided_batched, layer_norm, layer_norm_backward, merge_heads, split_heads,
};
use hypershard_tensor::{DType, RandomInit, Tensor};
use hypershard_testkit::device::{GPU_ENV, Outcome, Tally, contained, fail, gpu_asked};

const NVRTC_ENV: &str = "HYPERSHARD_TEST_NVRTC";
/// The unit roundoff of f32.
const U: f64 = f32::EPSILON as f64 / 2.0;

fn ensure(condition: bool, message: impl FnOnce() -> String) -> Outcome {
    if condition { Ok(()) } else { Err(message()) }
}

fn uniform(shape: &[usize], seed: u64, low: f64, high: f64) -> Result<Tensor, String> {
    Tensor::random(shape, DType::F32, RandomInit::uniform(seed, low, high)).map_err(fail)
}

fn values(t: &Tensor) -> Result<Vec<f64>, String> {
    t.to_f64_vec().map_err(fail)
}

fn device_values(t: &CudaTensor) -> Result<Vec<f64>, String> {
    values(&t.to_host().map_err(fail)?)
}

fn up(device: &CudaDevice, t: &Tensor) -> Result<CudaTensor, String> {
    CudaTensor::from_host(device, t).map_err(fail)
}

/// Deterministic ids in `0..vocab` (a 64-bit LCG), with repeats.
fn ids(count: usize, vocab: usize, seed: u64) -> Vec<i64> {
    let mut state = seed.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1);
    (0..count)
        .map(|_| {
            state = state
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            ((state >> 33) % vocab as u64) as i64
        })
        .collect()
}

fn id_tensor(values: Vec<i64>, shape: &[usize]) -> Result<Tensor, String> {
    Tensor::from_vec(values, shape).map_err(fail)
}

/// The largest |a − b|, NaN if either holds a NaN where the other does not.
fn max_diff(a: &[f64], b: &[f64]) -> f64 {
    a.iter()
        .zip(b)
        .map(|(x, y)| {
            if x.is_nan() != y.is_nan() {
                f64::NAN
            } else if x.is_nan() {
                0.0
            } else {
                (x - y).abs()
            }
        })
        .fold(0.0, |m, v| {
            if v.is_nan() || m.is_nan() {
                f64::NAN
            } else {
                m.max(v)
            }
        })
}

fn norm_inf(a: &[f64]) -> f64 {
    a.iter().fold(0.0f64, |m, v| m.max(v.abs()))
}

/// Elementwise `|device − cpu| ≤ bound(i)`, naming the first element that is not.
fn within(what: &str, device: &[f64], cpu: &[f64], bound: impl Fn(usize) -> f64) -> Outcome {
    ensure(device.len() == cpu.len(), || {
        format!("{what}: {} vs {} elements", device.len(), cpu.len())
    })?;
    for (i, (d, c)) in device.iter().zip(cpu).enumerate() {
        let diff = (d - c).abs();
        let both_nan = d.is_nan() && c.is_nan();
        // `diff <= bound` is false for a NaN difference, which must fail unless both are NaN.
        let inside = diff <= bound(i);
        if !inside && !both_nan {
            return Err(format!(
                "{what}[{i}]: device {d:e} vs cpu {c:e}, |diff| {diff:e} > bound {:e}",
                bound(i)
            ));
        }
    }
    Ok(())
}

/// Bit-for-bit equality of two f32 tensors, with the worst difference in units of the last
/// place when they differ.
fn same_f32(what: &str, device: &Tensor, cpu: &Tensor) -> Outcome {
    let d = device.to_vec::<f32>().map_err(fail)?;
    let c = cpu.to_vec::<f32>().map_err(fail)?;
    ensure(d.len() == c.len(), || format!("{what}: lengths differ"))?;
    let mut differing = 0usize;
    let mut worst = (0u32, 0usize);
    for (i, (x, y)) in d.iter().zip(&c).enumerate() {
        if x.to_bits() != y.to_bits() && !(x.is_nan() && y.is_nan()) {
            differing += 1;
            let ulps = (x.to_bits() as i64 - y.to_bits() as i64).unsigned_abs() as u32;
            if ulps > worst.0 {
                worst = (ulps, i);
            }
        }
    }
    ensure(differing == 0, || {
        format!(
            "{what}: {differing} of {} elements differ from the CPU, worst {} ulp at {} ({:e} vs {:e})",
            d.len(),
            worst.0,
            worst.1,
            d[worst.1],
            c[worst.1]
        )
    })
}

// ---------------------------------------------------------------------------------------------
// Always run.
// ---------------------------------------------------------------------------------------------

fn tiny_config(seed: u64) -> GptConfig {
    GptConfig {
        vocab_size: 67,
        block_size: 16,
        n_layer: 2,
        n_head: 2,
        n_embd: 24,
        bias: true,
        dropout: 0.0,
        dtype: DType::F32,
        seed,
    }
}

/// Creation without CUDA (or without the device) is a typed `Unavailable`, never a panic.
fn creation_reports_unavailability() -> Outcome {
    let model = Gpt::new(tiny_config(1)).map_err(fail)?;
    match DeviceGpt::open(4096, &model) {
        Err(DeviceError::Cuda(CudaError::Unavailable { reason })) => {
            println!("cuda_gpt: device 4096 is unavailable, as it must be: {reason}");
        }
        Err(other) => return Err(format!("expected Unavailable for device 4096, got {other}")),
        Ok(_) => return Err("device 4096 opened".to_string()),
    }
    if !matches!(device_count(), Ok(n) if n > 0) {
        match DeviceGpt::open(0, &model) {
            Err(DeviceError::Cuda(CudaError::Unavailable { reason })) => {
                println!("cuda_gpt: no usable GPU here: {reason}");
            }
            Err(other) => return Err(format!("expected Unavailable for device 0, got {other}")),
            Ok(_) => return Err("no devices reported, yet device 0 opened".to_string()),
        }
    }
    Ok(())
}

/// The GPT kernels in the NVRTC build for sm_80 and sm_90: every entry is there, and none of
/// them has an f32 fused multiply-add (`--fmad=false` honoured), so each element rounds as the
/// CPU's separate multiply and add. (The f64 `log` of the cross-entropy is libdevice's, which
/// uses f64 FMAs; no f32 result depends on it.)
fn gpt_kernels_compile_without_fma(asked: bool) -> Outcome {
    let gpt_kernels: Vec<&str> = KERNEL_NAMES
        .iter()
        .copied()
        .skip_while(|&name| name != "layer_norm_f32")
        .collect();
    ensure(gpt_kernels.len() == 14, || {
        format!("expected the 14 GPT kernels, found {gpt_kernels:?}")
    })?;
    for (major, minor) in [(8, 0), (9, 0)] {
        let ptx = match compile_kernels(major, minor, KernelImage::Ptx) {
            Ok(ptx) => String::from_utf8(ptx).map_err(fail)?,
            Err(CudaError::Unavailable {
                reason:
                    Unavailable::LibraryNotFound {
                        library: "libnvrtc",
                        ..
                    },
            }) if !asked => {
                println!(
                    "cuda_gpt: libnvrtc is not loadable here, so the kernels were not compiled"
                );
                return Ok(());
            }
            Err(other) => return Err(other.to_string()),
        };
        for name in &gpt_kernels {
            let start = ptx
                .find(&format!(".entry {name}("))
                .ok_or_else(|| format!("sm_{major}{minor}: no entry {name}"))?;
            let body = &ptx[start..];
            let end = body[1..].find(".entry ").map_or(body.len(), |e| e + 1);
            ensure(!body[..end].contains("fma.rn.f32"), || {
                format!("sm_{major}{minor}: {name} has an f32 fused multiply-add")
            })?;
        }
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Device tests: the kernels.
// ---------------------------------------------------------------------------------------------

type DeviceTest = fn(&CudaDevice) -> Outcome;

/// LayerNorm forward and backward against the CPU `LayerNorm`, for a row narrower than a
/// block (24) and one wider (300, so each thread sums two columns).
///
/// Bound: both evaluate the same f32 operations and differ only in the order of the three row
/// sums (Σx, Σ(x − mean)², and backward's Σĝ, Σĝx̂). A sum of d terms in any order is within
/// (d − 1)·u·Σ|terms| of the exact sum, so the mean differs by at most 2(d − 1)·u·mean|x|, the
/// variance by 2(d − 1)·u·var relative; with inputs of mean 3 and spread 1 (so |x − mean|
/// ≈ 0.6 ≪ mean|x| ≈ 3, the hard case for the centred sum) that moves x̂ by at most
/// 2(d − 1)·u·(mean|x|·r + 1), which is the bound used (times ‖w‖∞ for the output, plus the
/// output's own 4 roundings). The parameter gradients sum rows in the same order as the CPU,
/// so they differ only through x̂: rows · that bound.
fn layer_norm_matches_the_cpu(device: &CudaDevice) -> Outcome {
    for (rows, d) in [(37usize, 24usize), (29, 300)] {
        let x = uniform(&[rows, d], 11, 2.0, 4.0)?;
        let w = uniform(&[d], 12, 0.5, 1.5)?;
        let b = uniform(&[d], 13, -1.0, 1.0)?;
        let g = uniform(&[rows, d], 14, -1.0, 1.0)?;
        let mut cpu = LayerNorm::new(LayerNormConfig {
            normalized_shape: d,
            eps: 1e-5,
            bias: true,
            dtype: DType::F32,
        })
        .map_err(fail)?;
        cpu.weight.data = Some(w.clone());
        if let Some(bias) = &mut cpu.bias {
            bias.data = Some(b.clone());
        }
        let out_cpu = values(&cpu.forward(&x).map_err(fail)?)?;
        let dx_cpu = values(&cpu.backward(&g).map_err(fail)?)?;
        let dw_cpu = values(cpu.weight.grad.as_ref().ok_or("no weight grad")?)?;
        let db_cpu = values(
            cpu.bias
                .as_ref()
                .and_then(|p| p.grad.as_ref())
                .ok_or("no bias grad")?,
        )?;

        let (xd, wd, bd, gd) = (
            up(device, &x)?,
            up(device, &w)?,
            up(device, &b)?,
            up(device, &g)?,
        );
        let saved = layer_norm(&xd, &wd, Some(&bd), 1e-5).map_err(fail)?;
        let mut dw = CudaTensor::zeros(device, &[d], DType::F32).map_err(fail)?;
        let mut db = CudaTensor::zeros(device, &[d], DType::F32).map_err(fail)?;
        let dx = layer_norm_backward(&gd, &saved, &wd, &mut dw, Some(&mut db)).map_err(fail)?;

        let xs = values(&x)?;
        let mean_abs = xs.iter().map(|v| v.abs()).sum::<f64>() / xs.len() as f64;
        let r = norm_inf(&device_values(&saved.rstd)?);
        let xhat_bound = 2.0 * (d as f64 - 1.0) * U * (mean_abs * r + 1.0);
        let w_inf = norm_inf(&values(&w)?);
        let out_bound = xhat_bound * w_inf + 8.0 * U * norm_inf(&out_cpu);
        within(
            &format!("layer norm out d={d}"),
            &device_values(&saved.out)?,
            &out_cpu,
            |_| out_bound,
        )?;
        // dx = r·(ĝ − mean ĝ − x̂·mean ĝx̂): through x̂ and r (relative xhat_bound each) and the
        // two backward sums (2(d − 1)·u each), all scaled by ‖dx‖-sized terms.
        let g_inf = norm_inf(&values(&g)?);
        let dx_bound = (3.0 * xhat_bound + 4.0 * (d as f64) * U) * r * g_inf * w_inf * 3.0;
        within(
            &format!("layer norm dx d={d}"),
            &device_values(&dx)?,
            &dx_cpu,
            |_| dx_bound,
        )?;
        let dw_bound = rows as f64 * g_inf * xhat_bound + rows as f64 * U * norm_inf(&dw_cpu);
        within(
            &format!("layer norm dw d={d}"),
            &device_values(&dw)?,
            &dw_cpu,
            |_| dw_bound,
        )?;
        // db = Σ g sums the same values in the same order as the CPU: bit for bit.
        same_f32(
            &format!("layer norm db d={d}"),
            &db.to_host().map_err(fail)?,
            &Tensor::from_vec(db_cpu.iter().map(|&v| v as f32).collect(), &[d]).map_err(fail)?,
        )?;
    }
    // Typed errors before any launch.
    let x = up(device, &uniform(&[3, 5], 1, -1.0, 1.0)?)?;
    let w = up(device, &uniform(&[4], 2, -1.0, 1.0)?)?;
    ensure(
        matches!(
            layer_norm(&x, &w, None, 1e-5),
            Err(CudaError::ShapeMismatch { .. })
        ),
        || "a weight of the wrong width was accepted".to_string(),
    )?;
    let x16 = x.to_dtype(DType::BF16).map_err(fail)?;
    ensure(
        matches!(
            layer_norm(&x16, &w, None, 1e-5),
            Err(CudaError::UnsupportedDType { .. })
        ),
        || "a bf16 input was accepted".to_string(),
    )
}

/// GELU and its backward bit for bit against the CPU's f32 `Gelu` (exact formula): the kernel
/// evaluates the CPU's own `erf_f32` and `exp_f32` step for step, with `--fmad=false` (checked
/// by `gpt_kernels_compile_without_fma`), so every element rounds the same way. 70 001 values
/// over [−10, 10] (both branches of erf, the clamps of exp) plus ±0 and ±∞.
fn gelu_matches_the_cpu(device: &CudaDevice) -> Outcome {
    let n = 70_001;
    let mut xs = uniform(&[n], 21, -10.0, 10.0)?
        .to_vec::<f32>()
        .map_err(fail)?;
    let specials = [
        0.0,
        -0.0,
        0.5,
        -0.5,
        0.499_999_97,
        f32::INFINITY,
        f32::NEG_INFINITY,
    ];
    xs[..specials.len()].copy_from_slice(&specials);
    let x = Tensor::from_vec(xs, &[n]).map_err(fail)?;
    let g = uniform(&[n], 22, -1.0, 1.0)?;
    let mut cpu = Gelu::new(GeluApproximation::None);
    let y_cpu = cpu.forward(&x).map_err(fail)?;
    let dx_cpu = cpu.backward(&g).map_err(fail)?;
    let xd = up(device, &x)?;
    let y = gelu(&xd).map_err(fail)?;
    let dx = gelu_backward(&xd, &up(device, &g)?).map_err(fail)?;
    same_f32("gelu", &y.to_host().map_err(fail)?, &y_cpu)?;
    same_f32("gelu backward", &dx.to_host().map_err(fail)?, &dx_cpu)
}

/// The causal softmax and its backward against an f64 reference, for T = 16 and T = 300
/// (rows wider than the block), scores of spread ±8.
///
/// Bound (forward): each visible p is exp_f32 (≤ 2 ulp) of a value rounded twice, divided by
/// a sum of ≤ T terms in some order (≤ (T − 1)·u relative): |p − p_exact| ≤ (T + 8)·u·p, plus
/// the same in the f64 reference's use of the f32 score (exact). Masked entries are exactly 0.
/// Backward, from the device's own probabilities: the dot of T terms (≤ T·u·Σ|p·g|) and 3
/// roundings: |dS − ref| ≤ scale·p·((T + 4)·u·(|g| + Σ|p·g|)).
fn softmax_matches_the_reference(device: &CudaDevice) -> Outcome {
    for (heads, t) in [(6usize, 16usize), (2, 300)] {
        let scores = uniform(&[heads, t, t], 31 + t as u64, -8.0, 8.0)?;
        let grad = uniform(&[heads, t, t], 32 + t as u64, -1.0, 1.0)?;
        let scale = 1.0 / 12f64.sqrt();
        let scale32 = f64::from(scale as f32);
        let s = values(&scores)?;
        let mut probs = up(device, &scores)?;
        causal_softmax_(&mut probs, scale).map_err(fail)?;
        let p = device_values(&probs)?;
        let mut reference = vec![0.0; s.len()];
        for row in 0..heads * t {
            let i = row % t;
            let base = row * t;
            // The kernel's input to exp: the f32 product and difference, rounded as it does.
            let scaled: Vec<f64> = (0..=i)
                .map(|j| f64::from((s[base + j] as f32) * (scale as f32)))
                .collect();
            let max = scaled.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            let e: Vec<f64> = scaled
                .iter()
                .map(|&v| f64::from((v - max) as f32).exp())
                .collect();
            let sum: f64 = e.iter().sum();
            for j in 0..=i {
                reference[base + j] = e[j] / sum;
            }
        }
        for (k, &value) in p.iter().enumerate() {
            let (row, j) = (k / t, k % t);
            if j > row % t {
                ensure(value == 0.0, || format!("T={t}: masked p[{k}] = {value}"))?;
            }
        }
        within(&format!("softmax T={t}"), &p, &reference, |k| {
            (t as f64 + 8.0) * U * reference[k] + f64::MIN_POSITIVE
        })?;

        let g = values(&grad)?;
        let mut ds = up(device, &grad)?;
        causal_softmax_backward_(&mut ds, &probs, scale).map_err(fail)?;
        let ds = device_values(&ds)?;
        let mut expected = vec![0.0; g.len()];
        let mut bounds = vec![0.0; g.len()];
        for row in 0..heads * t {
            let base = row * t;
            let dot: f64 = (0..t).map(|j| p[base + j] * g[base + j]).sum();
            let abs_dot: f64 = (0..t).map(|j| (p[base + j] * g[base + j]).abs()).sum();
            for j in 0..t {
                let k = base + j;
                expected[k] = scale32 * p[k] * (g[k] - dot);
                bounds[k] =
                    scale32 * p[k] * (t as f64 + 4.0) * U * (g[k].abs() + abs_dot + dot.abs());
            }
        }
        within(&format!("softmax backward T={t}"), &ds, &expected, |k| {
            bounds[k]
        })?;
    }
    let mut not_square = up(device, &uniform(&[2, 3, 4], 1, -1.0, 1.0)?)?;
    ensure(
        matches!(
            causal_softmax_(&mut not_square, 1.0),
            Err(CudaError::ShapeMismatch { .. })
        ),
        || "non-square scores were accepted".to_string(),
    )
}

/// Cross-entropy against the CPU `cross_entropy` (f32 logits, some targets ignored), for
/// V = 67 and V = 1000 (wider than the block).
///
/// Bound: the same f32 operations but the Σexp in another order (≤ (V − 1)·u relative): each
/// row's ln Σe moves by at most V·u, so the mean loss by V·u (both add the row losses in f64 in
/// row order); each gradient element e·(scale/Σ) by (V + 4)·u relative, i.e. ≤ (V + 6)·u·scale
/// absolute (|e/Σ| ≤ 1), which also covers the class element after its exact-order subtraction.
fn cross_entropy_matches_the_cpu(device: &CudaDevice) -> Outcome {
    for (rows, v) in [(37usize, 67usize), (23, 1000)] {
        let logits = uniform(&[rows, v], 41 + v as u64, -6.0, 6.0)?;
        let mut targets = ids(rows, v, 42);
        targets[3] = DEFAULT_IGNORE_INDEX;
        targets[rows - 1] = DEFAULT_IGNORE_INDEX;
        let targets = id_tensor(targets, &[rows])?;
        let cpu = cross_entropy(&logits, &targets, DEFAULT_IGNORE_INDEX).map_err(fail)?;
        let dev = device_cross_entropy(&up(device, &logits)?, &targets, DEFAULT_IGNORE_INDEX)
            .map_err(fail)?;
        let loss_bound = v as f64 * U * 2.0;
        ensure((dev.loss - cpu.loss).abs() <= loss_bound, || {
            format!(
                "cross-entropy V={v}: loss {} vs cpu {} (bound {loss_bound:e})",
                dev.loss, cpu.loss
            )
        })?;
        let scale = 1.0 / (rows - 2) as f64;
        within(
            &format!("cross-entropy grad V={v}"),
            &device_values(&dev.grad)?,
            &values(&cpu.grad)?,
            |_| (v as f64 + 6.0) * U * scale,
        )?;
    }
    // Every target ignored: NaN and a zero gradient, as the CPU.
    let logits = up(device, &uniform(&[2, 5], 3, -1.0, 1.0)?)?;
    let ignored = id_tensor(vec![DEFAULT_IGNORE_INDEX; 2], &[2])?;
    let out = device_cross_entropy(&logits, &ignored, DEFAULT_IGNORE_INDEX).map_err(fail)?;
    ensure(out.loss.is_nan(), || {
        format!("all ignored gave loss {}", out.loss)
    })?;
    ensure(device_values(&out.grad)?.iter().all(|&g| g == 0.0), || {
        "all ignored gave a nonzero gradient".to_string()
    })?;
    let bad = id_tensor(vec![0, 5], &[2])?;
    ensure(
        matches!(
            device_cross_entropy(&logits, &bad, DEFAULT_IGNORE_INDEX),
            Err(CudaError::IndexOutOfRange {
                position: 1,
                index: 5,
                size: 5,
                ..
            })
        ),
        || "a target out of range was accepted".to_string(),
    )?;
    let wrong = Tensor::from_vec(vec![0i32, 1], &[2]).map_err(fail)?;
    ensure(
        matches!(
            device_cross_entropy(&logits, &wrong, DEFAULT_IGNORE_INDEX),
            Err(CudaError::DTypeMismatch { .. })
        ),
        || "i32 targets were accepted".to_string(),
    )
}

/// The embeddings and their backward bit for bit against a host reference that adds in the
/// CPU GPT's order (`wte[id] + wpe[t]`; each token's gradient rows summed in position order
/// from zero, each position's over the batch in order), onto nonzero existing gradients, for
/// 3 × 11 tokens of a 67-row table with repeats (and rows never used), wpe of 16 rows.
fn embedding_matches_the_cpu(device: &CudaDevice) -> Outcome {
    let (batch, seq, v, c, p) = (3usize, 11usize, 67usize, 24usize, 16usize);
    let wte = uniform(&[v, c], 51, -1.0, 1.0)?;
    let wpe = uniform(&[p, c], 52, -1.0, 1.0)?;
    let token_ids = ids(batch * seq, 13, 53); // only rows 0..13: many repeats
    let tokens =
        TokenIndex::new(device, &id_tensor(token_ids.clone(), &[batch, seq])?, v).map_err(fail)?;
    let out = embedding(&up(device, &wte)?, &up(device, &wpe)?, &tokens).map_err(fail)?;
    let (wte_h, wpe_h) = (
        wte.to_vec::<f32>().map_err(fail)?,
        wpe.to_vec::<f32>().map_err(fail)?,
    );
    let mut expected = Vec::with_capacity(batch * seq * c);
    for (position, &id) in token_ids.iter().enumerate() {
        let t = position % seq;
        for col in 0..c {
            expected.push(wte_h[id as usize * c + col] + wpe_h[t * c + col]);
        }
    }
    same_f32(
        "embedding",
        &out.to_host().map_err(fail)?,
        &Tensor::from_vec(expected, &[batch * seq, c]).map_err(fail)?,
    )?;

    let g = uniform(&[batch * seq, c], 54, -1.0, 1.0)?;
    let gh = g.to_vec::<f32>().map_err(fail)?;
    let prior_wte = uniform(&[v, c], 55, -1.0, 1.0)?;
    let prior_wpe = uniform(&[p, c], 56, -1.0, 1.0)?;
    let mut grad_wte = up(device, &prior_wte)?;
    let mut grad_wpe = up(device, &prior_wpe)?;
    embedding_backward(&up(device, &g)?, &tokens, &mut grad_wte, &mut grad_wpe).map_err(fail)?;
    let mut acc_wte = vec![0f32; v * c];
    let mut used = vec![false; v];
    for (position, &id) in token_ids.iter().enumerate() {
        used[id as usize] = true;
        for col in 0..c {
            acc_wte[id as usize * c + col] += gh[position * c + col];
        }
    }
    let mut want_wte = prior_wte.to_vec::<f32>().map_err(fail)?;
    for row in 0..v {
        if used[row] {
            for col in 0..c {
                want_wte[row * c + col] += acc_wte[row * c + col];
            }
        }
    }
    let mut want_wpe = prior_wpe.to_vec::<f32>().map_err(fail)?;
    for t in 0..seq {
        for col in 0..c {
            let mut acc = 0f32;
            for b in 0..batch {
                acc += gh[(b * seq + t) * c + col];
            }
            want_wpe[t * c + col] += acc;
        }
    }
    same_f32(
        "embedding backward wte",
        &grad_wte.to_host().map_err(fail)?,
        &Tensor::from_vec(want_wte, &[v, c]).map_err(fail)?,
    )?;
    same_f32(
        "embedding backward wpe",
        &grad_wpe.to_host().map_err(fail)?,
        &Tensor::from_vec(want_wpe, &[p, c]).map_err(fail)?,
    )?;
    let bad = id_tensor(vec![0, 66, 67], &[1, 3])?;
    ensure(
        matches!(
            TokenIndex::new(device, &bad, v),
            Err(CudaError::IndexOutOfRange {
                position: 2,
                index: 67,
                size: 67,
                ..
            })
        ),
        || "a token id out of range was accepted".to_string(),
    )?;
    let negative = id_tensor(vec![-1], &[1, 1])?;
    ensure(
        matches!(
            TokenIndex::new(device, &negative, v),
            Err(CudaError::IndexOutOfRange { .. })
        ),
        || "a negative token id was accepted".to_string(),
    )
}

/// The strided-batched GEMM for all four transpose combinations, batch 5, 7 × 3 × 4, on small
/// integers (every product and sum exact in f32, so the result must equal the f64 reference
/// exactly), with beta = 1 onto a nonzero C.
fn batched_gemm_matches_the_cpu(device: &CudaDevice) -> Outcome {
    let (batch, m, k, n) = (5usize, 7usize, 3usize, 4usize);
    let int = |count: usize, salt: usize| -> Vec<f32> {
        (0..count)
            .map(|i| ((i * 7 + salt) % 11) as f32 - 5.0)
            .collect()
    };
    for op_a in [Transpose::No, Transpose::Yes] {
        for op_b in [Transpose::No, Transpose::Yes] {
            let a_shape = if op_a == Transpose::No {
                [batch, m, k]
            } else {
                [batch, k, m]
            };
            let b_shape = if op_b == Transpose::No {
                [batch, k, n]
            } else {
                [batch, n, k]
            };
            let a = int(batch * m * k, 1);
            let b = int(batch * k * n, 4);
            let c0 = int(batch * m * n, 9);
            let mut expected = vec![0f64; batch * m * n];
            for bi in 0..batch {
                for i in 0..m {
                    for j in 0..n {
                        let mut sum = f64::from(c0[(bi * m + i) * n + j]);
                        for l in 0..k {
                            let av = if op_a == Transpose::No {
                                a[(bi * m + i) * k + l]
                            } else {
                                a[(bi * k + l) * m + i]
                            };
                            let bv = if op_b == Transpose::No {
                                b[(bi * k + l) * n + j]
                            } else {
                                b[(bi * n + j) * k + l]
                            };
                            sum += f64::from(av) * f64::from(bv);
                        }
                        expected[(bi * m + i) * n + j] = sum;
                    }
                }
            }
            let ad = up(device, &Tensor::from_vec(a, &a_shape).map_err(fail)?)?;
            let bd = up(device, &Tensor::from_vec(b, &b_shape).map_err(fail)?)?;
            let mut cd = up(device, &Tensor::from_vec(c0, &[batch, m, n]).map_err(fail)?)?;
            gemm_strided_batched(1.0, &ad, op_a, &bd, op_b, 1.0, &mut cd).map_err(fail)?;
            ensure(device_values(&cd)? == expected, || {
                format!("batched gemm {op_a:?} {op_b:?} differs from the exact result")
            })?;
        }
    }
    Ok(())
}

/// Head split and merge: against the CPU attention's layout (`[B, T, 3C]` rows, head `h` of
/// part `p` at columns `p·C + h·D ..`), exactly, and merge ∘ split is the identity.
fn heads_round_trip(device: &CudaDevice) -> Outcome {
    let (batch, seq, h, d) = (3usize, 5usize, 2usize, 3usize);
    let c = h * d;
    let rows = uniform(&[batch, seq, 3 * c], 61, -1.0, 1.0)?;
    let rh = rows.to_vec::<f32>().map_err(fail)?;
    let rd = up(device, &rows)?;
    let mut back = CudaTensor::zeros(device, &[batch, seq, 3 * c], DType::F32).map_err(fail)?;
    for part in 0..3 {
        let heads = split_heads(&rd, part, 3, h).map_err(fail)?;
        let got = heads
            .to_host()
            .map_err(fail)?
            .to_vec::<f32>()
            .map_err(fail)?;
        for b in 0..batch {
            for head in 0..h {
                for t in 0..seq {
                    for dd in 0..d {
                        let want = rh[(b * seq + t) * 3 * c + part * c + head * d + dd];
                        let at = ((b * h + head) * seq + t) * d + dd;
                        ensure(got[at].to_bits() == want.to_bits(), || {
                            format!("split part {part}: element {at}")
                        })?;
                    }
                }
            }
        }
        merge_heads(&heads, &mut back, part, 3, h).map_err(fail)?;
    }
    same_f32("merge ∘ split", &back.to_host().map_err(fail)?, &rows)?;
    ensure(
        matches!(
            split_heads(&rd, 3, 3, h),
            Err(CudaError::ShapeMismatch { .. })
        ),
        || "part 3 of 3 was accepted".to_string(),
    )?;
    ensure(
        matches!(
            split_heads(&rd, 0, 3, 4),
            Err(CudaError::ShapeMismatch { .. })
        ),
        || "4 heads of width 1.5 were accepted".to_string(),
    )
}

/// Three AdamW steps on one tensor against the CPU `AdamW` (which runs in f64): the device
/// runs the same update in f32, about 10 roundings per step each relative to its term, so the
/// parameter is within 3 · 10·u·(|p| + lr) per element after 3 steps, and the moments within
/// 3 · 6·u of their size.
fn adamw_matches_the_cpu(device: &CudaDevice) -> Outcome {
    let config = AdamWConfig {
        lr: 1e-2,
        betas: (0.9, 0.95),
        eps: 1e-8,
        weight_decay: 0.1,
    };
    let n = 1_001;
    let p0 = uniform(&[n], 71, -1.0, 1.0)?;
    let mut cpu = hypershard_nn::Parameter::new("p", p0.clone());
    let mut adamw = AdamW::new(config).map_err(fail)?;
    let mut p = up(device, &p0)?;
    let mut m = CudaTensor::zeros(device, &[n], DType::F32).map_err(fail)?;
    let mut v = CudaTensor::zeros(device, &[n], DType::F32).map_err(fail)?;
    for step in 1..=3u64 {
        let g = uniform(&[n], 72 + step, -1.0, 1.0)?;
        cpu.grad = Some(g.clone());
        adamw.step_param("p", &mut cpu).map_err(fail)?;
        let step_config = AdamWStep {
            lr: config.lr,
            betas: config.betas,
            eps: config.eps,
            weight_decay: config.weight_decay,
            step: std::num::NonZeroU64::new(step).ok_or("step 0")?,
        };
        adamw_(&mut p, &mut m, &mut v, &up(device, &g)?, &step_config).map_err(fail)?;
    }
    let p_cpu = values(cpu.data().map_err(fail)?)?;
    within("adamw param", &device_values(&p)?, &p_cpu, |i| {
        30.0 * U * (p_cpu[i].abs() + config.lr)
    })?;
    let state = adamw.state("p").ok_or("no AdamW state")?;
    let m_cpu = values(&state.exp_avg)?;
    let v_cpu = values(&state.exp_avg_sq)?;
    within("adamw exp_avg", &device_values(&m)?, &m_cpu, |_| {
        18.0 * U * norm_inf(&m_cpu)
    })?;
    within("adamw exp_avg_sq", &device_values(&v)?, &v_cpu, |i| {
        18.0 * U * v_cpu[i].abs()
    })
}

// ---------------------------------------------------------------------------------------------
// Device tests: the GPT.
// ---------------------------------------------------------------------------------------------

/// A parameter's name, values and gradient, as f64.
type HostParam = (String, Vec<f64>, Option<Vec<f64>>);

fn params(model: &dyn Module) -> Result<Vec<HostParam>, String> {
    let mut out = Vec::new();
    let visit: &mut ParamVisitor<'_> = &mut |name, p| {
        let data = p.data()?.to_f64_vec()?;
        let grad = p.grad.as_ref().map(Tensor::to_f64_vec).transpose()?;
        out.push((name.to_string(), data, grad));
        Ok(())
    };
    model.visit_params("", visit).map_err(fail)?;
    Ok(out)
}

/// The same GPT in f64: the f32 model's parameters widened exactly.
fn widened(model: &Gpt) -> Result<Gpt, String> {
    let mut wide = Gpt::new(GptConfig {
        dtype: DType::F64,
        ..*model.config()
    })
    .map_err(fail)?;
    let source = params(model)?;
    let mut index = 0;
    wide.visit_params_mut("", &mut |name, p| {
        let (src_name, data, _) = &source[index];
        index += 1;
        assert_eq!(src_name, name);
        let shape = p.data()?.shape().to_vec();
        p.data = Some(Tensor::from_vec(data.clone(), &shape)?);
        Ok(())
    })
    .map_err(fail)?;
    Ok(wide)
}

/// `‖device − cpu‖∞ ≤ 8 · ‖cpu − cpu64‖∞ + 16·u·‖cpu64‖∞`, and never more than 1e-3 of
/// ‖cpu64‖∞: the device and the CPU evaluate the same f32 operations in other summation
/// orders (GEMMs, row sums), so each is about as far from the exact result as the other; the
/// CPU's own distance from the f64 evaluation of the same model measures that rounding noise,
/// and the device may be 8 times as far from the CPU (twice by the triangle inequality, and a
/// factor 4 for the orders being different). The floor covers quantities the f32 CPU happens
/// to get almost exact; the cap keeps the bound meaningful whatever the noise. Returns the
/// ratio of the device's distance to the noise, for the report.
fn noise_bounded(what: &str, device: &[f64], cpu: &[f64], cpu64: &[f64]) -> Result<f64, String> {
    ensure(
        device.len() == cpu.len() && cpu.len() == cpu64.len(),
        || format!("{what}: lengths differ"),
    )?;
    let noise = max_diff(cpu, cpu64);
    let scale = norm_inf(cpu64);
    let bound = (8.0 * noise + 16.0 * U * scale).min(1e-3 * scale);
    let got = max_diff(device, cpu);
    ensure(got <= bound, || {
        format!(
            "{what}: ‖device − cpu‖∞ = {got:e} > bound {bound:e} (cpu vs f64: {noise:e}, ‖·‖∞ {scale:e})"
        )
    })?;
    Ok(got / noise.max(U * scale))
}

struct CpuRun {
    logits: Vec<f64>,
    loss: f64,
    params: Vec<HostParam>,
}

/// The CPU forward, loss and backward of `model`.
fn cpu_step(model: &mut Gpt, ids: &Tensor, targets: &Tensor) -> Result<CpuRun, String> {
    zero_grad(model).map_err(fail)?;
    let logits = model.forward(ids).map_err(fail)?;
    let out = cross_entropy(&logits, targets, DEFAULT_IGNORE_INDEX).map_err(fail)?;
    model.backward(&out.grad).map_err(fail)?;
    Ok(CpuRun {
        logits: values(&logits)?,
        loss: out.loss,
        params: params(model)?,
    })
}

/// The tiny GPT's data: ids and next-token targets `[3, seq]`, one target ignored.
fn batch(seq: usize, seed: u64) -> Result<(Tensor, Tensor), String> {
    let (b, v) = (3usize, 67usize);
    let stream = ids(b * (seq + 1), v, seed);
    let mut inputs = Vec::with_capacity(b * seq);
    let mut targets = Vec::with_capacity(b * seq);
    for row in 0..b {
        let chunk = &stream[row * (seq + 1)..(row + 1) * (seq + 1)];
        inputs.extend_from_slice(&chunk[..seq]);
        targets.extend_from_slice(&chunk[1..]);
    }
    targets[seq + 2] = DEFAULT_IGNORE_INDEX;
    Ok((
        id_tensor(inputs, &[b, seq])?,
        id_tensor(targets, &[b, seq])?,
    ))
}

/// The tiny GPT (vocab 67, 2 layers, 2 heads, n_embd 24, block 16, batch 3), with and without
/// biases, at the full block (T = 16) and a shorter sequence (T = 11, so wpe's last rows get no
/// gradient): the logits, the loss and every parameter gradient against the CPU GPT, within
/// [`noise_bounded`]'s bound; the device model's `to_cpu` names and values; and the typed
/// errors of bad input.
fn gpt_matches_the_cpu(device: &CudaDevice) -> Outcome {
    for (bias, seq) in [(true, 16usize), (true, 11), (false, 16)] {
        let mut cpu = Gpt::new(GptConfig {
            bias,
            ..tiny_config(7)
        })
        .map_err(fail)?;
        let mut wide = widened(&cpu)?;
        let mut gpu = DeviceGpt::from_cpu(device, &cpu).map_err(fail)?;
        let (ids, targets) = batch(seq, 8 + seq as u64)?;
        let run = cpu_step(&mut cpu, &ids, &targets)?;
        let run64 = cpu_step(&mut wide, &ids, &targets)?;
        let label = format!("bias {bias} T={seq}");

        let logits = device_values(gpu.forward(&ids).map_err(fail)?)?;
        let ratio = noise_bounded(
            &format!("{label} logits"),
            &logits,
            &run.logits,
            &run64.logits,
        )?;
        let loss = gpu.loss(&ids, &targets).map_err(fail)?;
        let loss_ratio = noise_bounded(
            &format!("{label} loss"),
            &[loss],
            &[run.loss],
            &[run64.loss],
        )?;
        gpu.backward().map_err(fail)?;
        let back = gpu.to_cpu(true).map_err(fail)?;
        let device_params = params(&back)?;
        ensure(device_params.len() == run.params.len(), || {
            format!(
                "{label}: {} device parameters, {} on the CPU",
                device_params.len(),
                run.params.len()
            )
        })?;
        let mut worst = (0.0f64, String::new());
        for ((dev, cpu32), cpu64) in device_params.iter().zip(&run.params).zip(&run64.params) {
            ensure(dev.0 == cpu32.0, || {
                format!("{label}: parameter {} vs {}", dev.0, cpu32.0)
            })?;
            ensure(dev.1 == cpu32.1, || {
                format!("{label}: {} changed on the way", dev.0)
            })?;
            let grad = |p: &HostParam| p.2.clone().ok_or(format!("{label}: {} has no grad", p.0));
            let r = noise_bounded(
                &format!("{label} grad {}", dev.0),
                &grad(dev)?,
                &grad(cpu32)?,
                &grad(cpu64)?,
            )?;
            if r > worst.0 {
                worst = (r, dev.0.clone());
            }
        }
        println!(
            "cuda_gpt: {label}: device/noise ratios: logits {ratio:.2}, loss {loss_ratio:.2}, worst grad {:.2} ({})",
            worst.0, worst.1
        );
        if seq < 16 {
            // wpe rows at positions ≥ T get exactly zero gradient.
            let wpe = &device_params[1];
            let grad = wpe.2.as_ref().ok_or("no wpe grad")?;
            ensure(grad[seq * 24..].iter().all(|&g| g == 0.0), || {
                format!("{label}: wpe rows past T have gradient")
            })?;
        }
    }
    // Typed errors of bad input, before any launch.
    let cpu = Gpt::new(tiny_config(7)).map_err(fail)?;
    let mut gpu = DeviceGpt::from_cpu(device, &cpu).map_err(fail)?;
    ensure(
        matches!(
            gpu.backward(),
            Err(DeviceError::BackwardBeforeForward { .. })
        ),
        || "backward before forward was accepted".to_string(),
    )?;
    let too_long = id_tensor(vec![0; 17], &[1, 17])?;
    ensure(
        matches!(gpu.forward(&too_long), Err(DeviceError::BadShape { .. })),
        || "17 tokens in a block of 16 were accepted".to_string(),
    )?;
    let out_of_range = id_tensor(vec![0, 67], &[1, 2])?;
    ensure(
        matches!(
            gpu.forward(&out_of_range),
            Err(DeviceError::Cuda(CudaError::IndexOutOfRange {
                position: 1,
                index: 67,
                ..
            }))
        ),
        || "token 67 of a vocabulary of 67 was accepted".to_string(),
    )?;
    let floats = uniform(&[1, 2], 1, 0.0, 1.0)?;
    ensure(
        matches!(
            gpu.forward(&floats),
            Err(DeviceError::Cuda(CudaError::DTypeMismatch { .. }))
        ),
        || "f32 token ids were accepted".to_string(),
    )?;
    let (ids, _) = batch(4, 1)?;
    gpu.forward(&ids).map_err(fail)?;
    let wrong = CudaTensor::zeros(device, &[3, 4, 66], DType::F32).map_err(fail)?;
    ensure(
        matches!(gpu.backward_from(wrong), Err(DeviceError::BadShape { .. })),
        || "a logits gradient of the wrong shape was accepted".to_string(),
    )?;
    // The rejected gradient left the forward in place: a correct one still runs.
    let right = CudaTensor::zeros(device, &[3, 4, 67], DType::F32).map_err(fail)?;
    gpu.backward_from(right).map_err(fail)
}

/// Training: 4 SGD steps (lr 0.1) and then 3 AdamW steps (lr 1e-2, weight decay 0.1) of the
/// tiny GPT on the device and on the CPU (f32, and f64 for the noise), from the same
/// initialisation, on the same batch each step: every loss and the final parameters within
/// [`noise_bounded`]'s bound, and the loss must fall (the steps do something).
///
/// The model has no biases: with them, the key projection's bias has an exactly zero gradient
/// (a constant added to a row of scores leaves its softmax unchanged), so every evaluation's
/// gradient there is pure rounding noise of random sign, which AdamW normalises into steps of
/// size lr; the device and the CPU would then differ by lr in those entries, by design rather
/// than by error. (The biased model's gradients are compared in `gpt_matches_the_cpu`.)
fn training_matches_the_cpu(device: &CudaDevice) -> Outcome {
    let config = GptConfig {
        bias: false,
        ..tiny_config(9)
    };
    let mut cpu = Gpt::new(config).map_err(fail)?;
    let mut wide = widened(&cpu)?;
    let mut gpu = DeviceGpt::from_cpu(device, &cpu).map_err(fail)?;
    let sgd_config = SgdConfig {
        lr: 0.1,
        ..SgdConfig::default()
    };
    let adamw_config = AdamWConfig {
        lr: 1e-2,
        betas: (0.9, 0.95),
        eps: 1e-8,
        weight_decay: 0.1,
    };
    let mut sgd = (
        Sgd::new(sgd_config).map_err(fail)?,
        Sgd::new(sgd_config).map_err(fail)?,
    );
    let mut adamw = (
        AdamW::new(adamw_config).map_err(fail)?,
        AdamW::new(adamw_config).map_err(fail)?,
    );
    let mut losses = Vec::new();
    for step in 0..7u64 {
        // The same batch each step, so the loss must fall.
        let (ids, targets) = batch(16, 100)?;
        let run = cpu_step(&mut cpu, &ids, &targets)?;
        let run64 = cpu_step(&mut wide, &ids, &targets)?;
        gpu.zero_grad().map_err(fail)?;
        let loss = gpu.loss(&ids, &targets).map_err(fail)?;
        gpu.backward().map_err(fail)?;
        if step < 4 {
            sgd.0.step(&mut cpu).map_err(fail)?;
            sgd.1.step(&mut wide).map_err(fail)?;
            gpu.sgd_step(sgd_config.lr).map_err(fail)?;
        } else {
            adamw.0.step(&mut cpu).map_err(fail)?;
            adamw.1.step(&mut wide).map_err(fail)?;
            gpu.adamw_step(&adamw_config).map_err(fail)?;
        }
        noise_bounded(
            &format!("step {step} loss"),
            &[loss],
            &[run.loss],
            &[run64.loss],
        )?;
        losses.push(loss);
    }
    println!("cuda_gpt: training losses on the device: {losses:?}");
    ensure(losses[6] < losses[0] - 0.05, || {
        format!("the loss did not fall: {losses:?}")
    })?;
    let (dev, cpu32, cpu64) = (
        params(&gpu.to_cpu(false).map_err(fail)?)?,
        params(&cpu)?,
        params(&wide)?,
    );
    let moved = max_diff(&cpu32[0].1, &params(&Gpt::new(config).map_err(fail)?)?[0].1);
    ensure(moved > 1e-3, || format!("wte moved by only {moved:e}"))?;
    for ((d, c), w) in dev.iter().zip(&cpu32).zip(&cpu64) {
        noise_bounded(&format!("trained {}", d.0), &d.1, &c.1, &w.1)?;
    }
    Ok(())
}

fn main() -> ExitCode {
    let mut tally = Tally::default();
    let asked = gpu_asked();
    let nvrtc_asked = asked || std::env::var(NVRTC_ENV).is_ok_and(|v| v == "1");
    tally.check(
        "creation_reports_unavailability",
        contained(creation_reports_unavailability),
    );
    tally.check(
        "gpt_kernels_compile_without_fma",
        contained(|| gpt_kernels_compile_without_fma(nvrtc_asked)),
    );
    match CudaDevice::new(0) {
        Ok(device) => {
            println!(
                "cuda_gpt: device 0 is {}; running the device tests",
                device.name().unwrap_or_else(|e| e.to_string())
            );
            let tests: [(&str, DeviceTest); 9] = [
                ("layer_norm_matches_the_cpu", layer_norm_matches_the_cpu),
                ("gelu_matches_the_cpu", gelu_matches_the_cpu),
                (
                    "softmax_matches_the_reference",
                    softmax_matches_the_reference,
                ),
                (
                    "cross_entropy_matches_the_cpu",
                    cross_entropy_matches_the_cpu,
                ),
                ("embedding_matches_the_cpu", embedding_matches_the_cpu),
                ("batched_gemm_matches_the_cpu", batched_gemm_matches_the_cpu),
                ("heads_round_trip", heads_round_trip),
                ("adamw_matches_the_cpu", adamw_matches_the_cpu),
                ("gpt_matches_the_cpu", gpt_matches_the_cpu),
            ];
            for (name, test) in tests {
                tally.check(name, contained(|| test(&device)));
            }
            tally.check(
                "training_matches_the_cpu",
                contained(|| training_matches_the_cpu(&device)),
            );
            tally.check("synchronize", device.synchronize().map_err(fail));
        }
        Err(error) if asked => {
            eprintln!(
                "cuda_gpt: the device was asked for ({GPU_ENV}=1), but no CUDA device is usable: {error}"
            );
            tally.check("gpu_available", Err(error.to_string()));
        }
        Err(error) => {
            println!(
                "cuda_gpt: {GPU_ENV}=1 is not set and no GPU is usable ({error}), so the device tests did not run"
            );
        }
    }
    tally.finish()
}
