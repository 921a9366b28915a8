//! nn's device layers (feature `cuda`) against the CPU layers.
//!
//! Its own `main` (harness = false), like the tensor crate's `tests/cuda.rs`:
//!
//! * always: asking for a device that does not exist (and, with no usable GPU, for device 0)
//!   through `DeviceMlp::open` gives `DeviceError::Cuda(CudaError::Unavailable { .. })`, never
//!   a panic;
//! * with `HYPERSHARD_TEST_GPU=1`: no usable device is a FAILURE (exit 1); otherwise the device
//!   tests run: ReLU bit for bit, MSE, one Linear, and 5 SGD steps of a 4-layer MLP in f32 and
//!   in bf16 against the same steps on the CPU from the same initialisation and data;
//! * without the variable the device tests run only when a GPU happens to be usable;
//! * with the argument `--bench`: the reference MLP of the FSDP benchmarks (8 × Linear(1024,
//!   1024) + ReLU, MSE, SGD lr 0.01, batch 32) timed per step on the device and on the CPU,
//!   written as JSON to `target/bench/nn-cuda-mlp.json` (fails without a device).

use std::process::ExitCode;
use std::time::Instant;

use hypershard_nn::cuda::{DeviceError, DeviceMlp, mse_loss as device_mse};
use hypershard_nn::optim::{Sgd, SgdConfig};
use hypershard_nn::{
    Linear, LinearConfig, Module, ParamVisitor, Relu, Sequential, mse_loss, zero_grad,
};
use hypershard_tensor::cuda::{CudaDevice, CudaError, CudaTensor, device_count};
use hypershard_tensor::{DType, RandomInit, Tensor};
use hypershard_testkit::device::{GPU_ENV, Outcome, Tally, contained, fail, gpu_asked};

fn random(shape: &[usize], dtype: DType, seed: u64) -> Result<Tensor, String> {
    Tensor::random(shape, dtype, RandomInit::uniform(seed, -1.0, 1.0)).map_err(fail)
}

/// Linear(dims[i], dims[i+1]) + ReLU for each step of `dims`, seeds two apart as in the
/// benchmarks.
fn mlp(dims: &[usize], dtype: DType) -> Result<Sequential, String> {
    let mut model = Sequential::default();
    for (i, pair) in dims.windows(2).enumerate() {
        let linear = Linear::new(LinearConfig {
            in_features: pair[0],
            out_features: pair[1],
            bias: true,
            dtype,
            seed: 2 * i as u64,
        })
        .map_err(fail)?;
        model = model.with(linear).with(Relu::new());
    }
    Ok(model)
}

/// A parameter's dotted name, values and gradient (if any), as f64.
type HostParam = (String, Vec<f64>, Option<Vec<f64>>);

/// Every parameter of `model`, in visiting order.
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

/// `‖device − cpu‖∞ ≤ rel · ‖cpu‖∞` (a norm-wise bound: elementwise relative errors are
/// meaningless for entries that cancel to near zero).
fn close(what: &str, device: &[f64], cpu: &[f64], rel: f64) -> Outcome {
    if device.len() != cpu.len() {
        return Err(format!(
            "{what}: {} vs {} elements",
            device.len(),
            cpu.len()
        ));
    }
    let scale = cpu.iter().fold(0.0f64, |m, v| m.max(v.abs()));
    let worst = device
        .iter()
        .zip(cpu)
        .map(|(d, c)| (d - c).abs())
        .fold(0.0f64, |m, v| {
            if v.is_nan() || m.is_nan() {
                f64::NAN
            } else {
                m.max(v)
            }
        });
    if worst <= rel * scale {
        Ok(())
    } else {
        Err(format!(
            "{what}: max |device − cpu| = {worst:e} > {rel:e} · ‖cpu‖∞ = {:e}",
            rel * scale
        ))
    }
}

/// Creation without CUDA (or without the device) is a typed `Unavailable`, never a panic.
fn creation_reports_unavailability() -> Outcome {
    let model = mlp(&[3, 4], DType::F32)?;
    match DeviceMlp::open(4096, &model) {
        Err(DeviceError::Cuda(CudaError::Unavailable { reason })) => {
            println!("cuda_mlp: device 4096 is unavailable, as it must be: {reason}");
        }
        Err(other) => return Err(format!("expected Unavailable for device 4096, got {other}")),
        Ok(_) => return Err("device 4096 opened".to_string()),
    }
    let usable = matches!(device_count(), Ok(n) if n > 0);
    if !usable {
        match DeviceMlp::open(0, &model) {
            Err(DeviceError::Cuda(CudaError::Unavailable { reason })) => {
                println!("cuda_mlp: no usable GPU here: {reason}");
            }
            Err(other) => return Err(format!("expected Unavailable for device 0, got {other}")),
            Ok(_) => return Err("no devices reported, yet device 0 opened".to_string()),
        }
    }
    Ok(())
}

type DeviceTest = fn(&CudaDevice) -> Outcome;

/// `relu_` and `relu_grad_` bit for bit against the CPU `Relu`, for every float dtype, with
/// NaN, ±0, ±∞ and subnormals among 70 001 values (more than one block row of the grid).
fn relu_matches_the_cpu(device: &CudaDevice) -> Outcome {
    let n = 70_001;
    let mut values = random(&[n], DType::F32, 3)?.to_vec::<f32>().map_err(fail)?;
    let specials = [
        f32::NAN,
        0.0,
        -0.0,
        f32::INFINITY,
        f32::NEG_INFINITY,
        1e-40,
        -1e-40,
    ];
    values[..specials.len()].copy_from_slice(&specials);
    let base = Tensor::from_vec(values, &[n]).map_err(fail)?;
    let grad = random(&[n], DType::F32, 4)?;
    for dtype in [DType::F32, DType::BF16, DType::F16, DType::F64] {
        let x = base.to_dtype(dtype).map_err(fail)?;
        let g = grad.to_dtype(dtype).map_err(fail)?;
        let mut relu = Relu::new();
        let y_cpu = relu.forward(&x).map_err(fail)?;
        let dx_cpu = relu.backward(&g).map_err(fail)?;
        let mut y = CudaTensor::from_host(device, &x).map_err(fail)?;
        y.relu_().map_err(fail)?;
        let mut dx = CudaTensor::from_host(device, &g).map_err(fail)?;
        dx.relu_grad_(&y).map_err(fail)?;
        let bytes = |t: &Tensor| t.to_bytes().map_err(fail);
        if bytes(&y.to_host().map_err(fail)?)? != bytes(&y_cpu)? {
            return Err(format!("relu_ differs from the CPU in {dtype}"));
        }
        if bytes(&dx.to_host().map_err(fail)?)? != bytes(&dx_cpu)? {
            return Err(format!("relu_grad_ differs from the CPU in {dtype}"));
        }
    }
    Ok(())
}

/// The device MSE against the CPU's: the loss within 1e-4 relative (f32 sums in cuBLAS's
/// order against the CPU's f64 sum), the gradient within 4 f32 roundings per element (the
/// device rounds `p − t`, `2/n` and the product; the CPU rounds once); and typed errors.
fn mse_matches_the_cpu(device: &CudaDevice) -> Outcome {
    let p = random(&[29, 37], DType::F32, 5)?;
    let t = random(&[29, 37], DType::F32, 6)?;
    let cpu = mse_loss(&p, &t).map_err(fail)?;
    let dp = CudaTensor::from_host(device, &p).map_err(fail)?;
    let dt = CudaTensor::from_host(device, &t).map_err(fail)?;
    let dev = device_mse(&dp, &dt).map_err(fail)?;
    if (dev.loss - cpu.loss).abs() > 1e-4 * cpu.loss.abs() {
        return Err(format!("loss {} vs the CPU's {}", dev.loss, cpu.loss));
    }
    let g_dev = dev
        .grad
        .to_host()
        .map_err(fail)?
        .to_f64_vec()
        .map_err(fail)?;
    let g_cpu = cpu.grad.to_f64_vec().map_err(fail)?;
    for (i, (d, c)) in g_dev.iter().zip(&g_cpu).enumerate() {
        if (d - c).abs() > 4.0 * f64::from(f32::EPSILON) * c.abs() + 1e-30 {
            return Err(format!("grad[{i}] = {d} vs the CPU's {c}"));
        }
    }
    let short = CudaTensor::from_host(device, &random(&[29, 36], DType::F32, 7)?).map_err(fail)?;
    if !matches!(device_mse(&dp, &short), Err(DeviceError::BadShape { .. })) {
        return Err("a target of another shape was not refused".to_string());
    }
    Ok(())
}

/// Two Linears (no activation; the second with and without bias) forward and backward
/// against the CPU layers, f32: the output and every gradient within 1e-5 of its ∞-norm
/// (cuBLAS's summation order against the CPU's); the first layer's dW checks the second
/// layer's dx, which is its gradient input. Also the typed errors for a wrong input and for a
/// backward before any forward.
fn linears_match_the_cpu(device: &CudaDevice) -> Outcome {
    for bias in [true, false] {
        let layer = |i, o, bias, seed| {
            Linear::new(LinearConfig {
                in_features: i,
                out_features: o,
                bias,
                dtype: DType::F32,
                seed,
            })
            .map_err(fail)
        };
        let mut cpu = Sequential::default()
            .with(layer(41, 53, true, 11)?)
            .with(layer(53, 37, bias, 13)?);
        let mut dev = DeviceMlp::from_cpu(device, &cpu).map_err(fail)?;
        if !matches!(
            dev.backward(CudaTensor::zeros(device, &[29, 37], DType::F32).map_err(fail)?),
            Err(DeviceError::BackwardBeforeForward { .. })
        ) {
            return Err("a backward before forward was not refused".to_string());
        }
        let x = random(&[29, 41], DType::F32, 21)?;
        let g = random(&[29, 37], DType::F32, 22)?;
        let y_cpu = cpu.forward(&x).map_err(fail)?;
        cpu.backward(&g).map_err(fail)?;
        let dx = CudaTensor::from_host(device, &x).map_err(fail)?;
        let y_dev = dev.forward(&dx).map_err(fail)?.to_host().map_err(fail)?;
        close(
            &format!("output (bias {bias})"),
            &y_dev.to_f64_vec().map_err(fail)?,
            &y_cpu.to_f64_vec().map_err(fail)?,
            1e-5,
        )?;
        dev.backward(CudaTensor::from_host(device, &g).map_err(fail)?)
            .map_err(fail)?;
        let got = params(&dev.to_cpu(true).map_err(fail)?)?;
        let want = params(&cpu)?;
        if got.len() != want.len() {
            return Err(format!(
                "{} parameters vs the CPU's {}",
                got.len(),
                want.len()
            ));
        }
        for ((name, _, g_dev), (cpu_name, _, g_cpu)) in got.iter().zip(&want) {
            if name != cpu_name {
                return Err(format!("parameter {name} vs the CPU's {cpu_name}"));
            }
            let (Some(g_dev), Some(g_cpu)) = (g_dev, g_cpu) else {
                return Err(format!("{name}: a gradient is missing"));
            };
            close(&format!("grad of {name} (bias {bias})"), g_dev, g_cpu, 1e-5)?;
        }
        let wrong =
            CudaTensor::from_host(device, &random(&[29, 40], DType::F32, 23)?).map_err(fail)?;
        if !matches!(dev.forward(&wrong), Err(DeviceError::BadShape { .. })) {
            return Err("an input of the wrong width was not refused".to_string());
        }
        let half =
            CudaTensor::from_host(device, &random(&[29, 41], DType::BF16, 24)?).map_err(fail)?;
        if !matches!(dev.forward(&half), Err(DeviceError::DTypeMismatch { .. })) {
            return Err("an input of another dtype was not refused".to_string());
        }
    }
    Ok(())
}

/// The tolerances of [`train_matches_the_cpu`].
#[derive(Clone, Copy)]
struct Bounds {
    /// The output of a forward pass before training, relative to its ∞-norm.
    output: f64,
    /// Each step's loss, relative.
    loss: f64,
    /// The final weights and biases, relative to their ∞-norm.
    weight: f64,
    /// The last step's gradients, relative to their ∞-norm (`None`: not compared).
    grad: Option<f64>,
    /// The least the CPU's weights must have moved (relative to their ∞-norm), so that the
    /// weight comparison has power.
    min_move: f64,
}

/// Trains a 4-layer MLP (37 → 53 → 53 → 53 → 37, each Linear followed by a ReLU) in `dtype`
/// for 5 SGD steps (lr 0.05, batch 29) on the device and on the CPU from the same
/// initialisation and data, and compares within `bounds`.
fn train_matches_the_cpu(device: &CudaDevice, dtype: DType, bounds: Bounds) -> Outcome {
    let Bounds {
        output: output_rel,
        loss: loss_rel,
        weight: param_rel,
        grad: grad_rel,
        min_move,
    } = bounds;
    let dims = [37, 53, 53, 53, 37];
    let (batch, steps, lr) = (29, 5, 0.05);
    let x = random(&[batch, dims[0]], DType::F32, 10)?
        .to_dtype(dtype)
        .map_err(fail)?;
    let t = random(&[batch, dims[4]], DType::F32, 20)?
        .to_dtype(dtype)
        .map_err(fail)?;
    let mut cpu = mlp(&dims, dtype)?;
    let initial = params(&cpu)?;
    let mut dev = DeviceMlp::from_cpu(device, &cpu).map_err(fail)?;
    let mut sgd = Sgd::new(SgdConfig {
        lr,
        ..SgdConfig::default()
    })
    .map_err(fail)?;
    let dx = CudaTensor::from_host(device, &x).map_err(fail)?;
    let dt = CudaTensor::from_host(device, &t).map_err(fail)?;
    let y_cpu = cpu.forward(&x).map_err(fail)?.to_f64_vec().map_err(fail)?;
    let y_dev = dev.forward(&dx).map_err(fail)?.to_host().map_err(fail)?;
    close(
        &format!("{dtype} output before training"),
        &y_dev.to_f64_vec().map_err(fail)?,
        &y_cpu,
        output_rel,
    )?;
    for step in 0..steps {
        zero_grad(&mut cpu).map_err(fail)?;
        let out = cpu.forward(&x).map_err(fail)?;
        let loss = mse_loss(&out, &t).map_err(fail)?;
        cpu.backward(&loss.grad).map_err(fail)?;
        sgd.step(&mut cpu).map_err(fail)?;
        let dev_loss = dev.train_step(&dx, &dt, lr).map_err(fail)?;
        println!(
            "cuda_mlp: {dtype} step {step}: loss {dev_loss} (CPU {})",
            loss.loss
        );
        let within = (dev_loss - loss.loss).abs() <= loss_rel * loss.loss.abs();
        if !within {
            return Err(format!(
                "{dtype} step {step}: loss {dev_loss} vs the CPU's {} (bound {loss_rel:e} relative)",
                loss.loss
            ));
        }
    }
    let got = params(&dev.to_cpu(true).map_err(fail)?)?;
    let want = params(&cpu)?;
    if got.len() != want.len() || got.len() != 2 * (dims.len() - 1) {
        return Err(format!(
            "{} parameters vs the CPU's {}",
            got.len(),
            want.len()
        ));
    }
    let mut moved = 0.0f64;
    for (((name, w_dev, g_dev), (cpu_name, w_cpu, g_cpu)), (_, w0, _)) in
        got.iter().zip(&want).zip(&initial)
    {
        if name != cpu_name {
            return Err(format!("parameter {name} vs the CPU's {cpu_name}"));
        }
        close(&format!("{dtype} {name}"), w_dev, w_cpu, param_rel)?;
        let (Some(g_dev), Some(g_cpu)) = (g_dev, g_cpu) else {
            return Err(format!("{name}: a gradient is missing"));
        };
        if let Some(grad_rel) = grad_rel {
            close(&format!("{dtype} grad of {name}"), g_dev, g_cpu, grad_rel)?;
        }
        let scale = w_cpu.iter().fold(0.0f64, |m, v| m.max(v.abs()));
        let change = w_cpu
            .iter()
            .zip(w0)
            .fold(0.0f64, |m, (a, b)| m.max((a - b).abs()));
        moved = moved.max(change / scale);
    }
    println!("cuda_mlp: {dtype}: the weights moved by up to {moved:e} of their ∞-norm");
    if moved <= min_move {
        return Err(format!(
            "{dtype}: the weights moved by at most {moved:e} of their ∞-norm (needed more than \
             {min_move:e}), too little for the weight bound to mean anything"
        ));
    }
    Ok(())
}

/// f32: the output, losses, weights and gradients within 1e-4 relative. The device and the
/// CPU round the same operations in f32; they differ in the GEMMs' summation order (cuBLAS's
/// blocking against the CPU's kernels) and in the loss's sum (f32 against f64). Measured on
/// the CPU alone, this run in f32 against the same run in f64 differs by at most 2.7e-7 (of
/// the ∞-norm) in any weight or gradient after 5 steps, so 1e-4 leaves a wide margin for a
/// second summation order, while a wrong transpose, a missing bias or a lost update is O(1)
/// (the weights move by about 4e-2 of their ∞-norm; at least 1e-3 is required).
fn train_f32_matches_the_cpu(device: &CudaDevice) -> Outcome {
    let bounds = Bounds {
        output: 1e-4,
        loss: 1e-4,
        weight: 1e-4,
        grad: Some(1e-4),
        min_move: 1e-3,
    };
    train_matches_the_cpu(device, DType::F32, bounds)
}

/// bf16: the output before training within 2e-2 of its ∞-norm, each loss within 2e-2
/// relative, the weights after 5 steps within 5e-2 of their ∞-norm; the gradients are not
/// compared. Measured on the CPU alone, this run in bf16 against the same run (same bf16
/// initialisation and data) in f32 differs by 3.5e-3 in the output, 5.7e-4 in the losses and
/// 1.3e-2 in the weights, while the early layers' gradients (sums over the batch that cancel,
/// of operands rounded to bf16 at every layer) differ by 10-39%: bf16 gradients are that
/// noisy, so a device-against-CPU bound on them would be either loose or flaky. Both round
/// each Linear's output to bf16 once from an f32 accumulator, but cuBLAS sums in another order,
/// so an output may land on the neighbouring bf16 value, and the device rounds `p − t` to bf16
/// in the loss where the CPU works in f64: the device run is another bf16 run at about the
/// measured distance from the f32 one, and the bounds allow twice that and a margin. The output
/// check is the one with power (a wrong transpose or bias moves the output by O(1) of its
/// norm); the weight bound catches garbage only (the weights move by about 4e-2 in 5 steps);
/// the f32 run checks the training arithmetic itself.
fn train_bf16_within_bound(device: &CudaDevice) -> Outcome {
    let bounds = Bounds {
        output: 2e-2,
        loss: 2e-2,
        weight: 5e-2,
        grad: None,
        min_move: 0.0,
    };
    train_matches_the_cpu(device, DType::BF16, bounds)
}

/// The reference MLP's step on the device and on the CPU, as JSON under target/bench.
fn bench(device: &CudaDevice) -> Outcome {
    const WIDTH: usize = 1024;
    const DEPTH: usize = 8;
    const BATCH: usize = 32;
    const LR: f64 = 0.01;
    let dims = [WIDTH; DEPTH + 1];
    let x = Tensor::random(
        &[BATCH, WIDTH],
        DType::F32,
        RandomInit::uniform(10, -1.0, 1.0),
    )
    .map_err(fail)?;
    let t = Tensor::random(
        &[BATCH, WIDTH],
        DType::F32,
        RandomInit::uniform(20, -1.0, 1.0),
    )
    .map_err(fail)?;
    let median = |mut v: Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let mut rows = Vec::new();
    for dtype in [DType::F32, DType::BF16] {
        let cpu = mlp(&dims, dtype)?;
        let mut dev = DeviceMlp::from_cpu(device, &cpu).map_err(fail)?;
        let dx = CudaTensor::from_host(device, &x.to_dtype(dtype).map_err(fail)?).map_err(fail)?;
        let dt = CudaTensor::from_host(device, &t.to_dtype(dtype).map_err(fail)?).map_err(fail)?;
        let (warmup, steps) = (5, 50);
        let mut times = Vec::with_capacity(steps);
        let mut losses = Vec::with_capacity(steps);
        for step in 0..warmup + steps {
            let started = Instant::now();
            let loss = dev.train_step(&dx, &dt, LR).map_err(fail)?;
            device.synchronize().map_err(fail)?;
            if step >= warmup {
                times.push(started.elapsed().as_secs_f64() * 1e3);
                losses.push(loss);
            }
        }
        rows.push(format!(
            "{{\"where\":\"device\",\"dtype\":\"{dtype}\",\"steps\":{steps},\"median_ms\":{},\"min_ms\":{},\"first_loss\":{},\"last_loss\":{}}}",
            median(times.clone()),
            times.iter().copied().fold(f64::INFINITY, f64::min),
            losses[0],
            losses[losses.len() - 1]
        ));
    }
    let mut cpu = mlp(&dims, DType::F32)?;
    let mut sgd = Sgd::new(SgdConfig {
        lr: LR,
        ..SgdConfig::default()
    })
    .map_err(fail)?;
    let (warmup, steps) = (2, 10);
    let mut times = Vec::with_capacity(steps);
    for step in 0..warmup + steps {
        let started = Instant::now();
        zero_grad(&mut cpu).map_err(fail)?;
        let out = cpu.forward(&x).map_err(fail)?;
        let loss = mse_loss(&out, &t).map_err(fail)?;
        cpu.backward(&loss.grad).map_err(fail)?;
        sgd.step(&mut cpu).map_err(fail)?;
        if step >= warmup {
            times.push(started.elapsed().as_secs_f64() * 1e3);
        }
    }
    let threads = std::thread::available_parallelism().map_or(0, |n| n.get());
    rows.push(format!(
        "{{\"where\":\"cpu\",\"dtype\":\"f32\",\"steps\":{steps},\"threads\":{threads},\"median_ms\":{},\"min_ms\":{}}}",
        median(times.clone()),
        times.iter().copied().fold(f64::INFINITY, f64::min)
    ));
    let name = device.name().map_err(fail)?.replace(['"', '\\'], "");
    let json = format!(
        "{{\"bench\":\"nn-cuda-mlp\",\"model\":\"{DEPTH} x (Linear({WIDTH},{WIDTH}) + ReLU), MSE, SGD lr {LR}\",\"batch\":{BATCH},\"device\":\"{name}\",\"rows\":[{}]}}\n",
        rows.join(",")
    );
    std::fs::create_dir_all("target/bench").map_err(fail)?;
    std::fs::write("target/bench/nn-cuda-mlp.json", &json).map_err(fail)?;
    print!("cuda_mlp: wrote target/bench/nn-cuda-mlp.json: {json}");
    Ok(())
}

fn main() -> ExitCode {
    let mut tally = Tally::default();
    let bench_asked = std::env::args().any(|a| a == "--bench");
    let asked = bench_asked || gpu_asked();
    if !bench_asked {
        tally.check(
            "creation_reports_unavailability",
            contained(creation_reports_unavailability),
        );
    }
    match CudaDevice::new(0) {
        Ok(device) if bench_asked => tally.check("bench", contained(|| bench(&device))),
        Ok(device) => {
            println!(
                "cuda_mlp: device 0 is {}; running the device tests",
                device.name().unwrap_or_else(|e| e.to_string())
            );
            let tests: [(&str, DeviceTest); 5] = [
                ("relu_matches_the_cpu", relu_matches_the_cpu),
                ("mse_matches_the_cpu", mse_matches_the_cpu),
                ("linears_match_the_cpu", linears_match_the_cpu),
                ("train_f32_matches_the_cpu", train_f32_matches_the_cpu),
                ("train_bf16_within_bound", train_bf16_within_bound),
            ];
            for (name, test) in tests {
                tally.check(name, contained(|| test(&device)));
            }
            tally.check("synchronize", device.synchronize().map_err(fail));
        }
        Err(error) if asked => {
            eprintln!(
                "cuda_mlp: the device was asked for ({GPU_ENV}=1 or --bench), but no CUDA device is usable: {error}"
            );
            tally.check("gpu_available", Err(error.to_string()));
        }
        Err(error) => {
            println!(
                "cuda_mlp: {GPU_ENV}=1 is not set and no GPU is usable ({error}), so the device tests did not run"
            );
        }
    }
    tally.finish()
}
