//! FSDP on device (`hypershard_fsdp::device`, feature `cuda`) against the unsharded CPU run.
//!
//! Its own `main` (harness = false), like nn's `tests/cuda_mlp.rs`:
//!
//! * always: asking for device 4096 (and, with no usable GPU, device 0) gives
//!   `DeviceFsdpError::Cuda(CudaError::Unavailable { .. })`, never a panic; `Staging::Device`
//!   over a host-only backend and `layers_per_group = 0` are typed errors before any device is
//!   opened;
//! * with `HYPERSHARD_TEST_GPU=1`: no usable device is a FAILURE (exit 1); otherwise the device
//!   tests run: the range copies and the tensor ↔ device-buffer interop against the CPU, then
//!   4 SGD steps of a 37 → 53 → 53 → 53 → 37 MLP (widths that 2 and 3 do not divide) sharded at
//!   world 1 on NCCL, worlds 2 and 3 on the local backend (threads sharing the GPU, staged
//!   through host memory) and world 2 on tcp over 127.0.0.1, each against the same steps on the
//!   CPU unsharded: losses, final parameters and last gradients, the exact number of
//!   collectives per step, and that the gathered parameters are freed; gradient accumulation
//!   without sync, bf16 mixed precision, and the typed errors of misuse;
//! * without the variable the device tests run only when a GPU happens to be usable;
//! * with the argument `--bench`: the FSDP step of the reference MLP (8 × Linear(1024, 1024) +
//!   ReLU, MSE, SGD lr 0.01, batch 32) timed on the device at world 1 on NCCL (f32 and bf16
//!   mixed precision) and world 2 on the local backend (staged), with the unsharded device MLP
//!   and the CPU FSDP step (worlds 1 and 2) for comparison, written as JSON to
//!   `target/bench/fsdp-cuda.json` (fails without a device).

use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use hypershard_collectives::nccl::{DeviceBuffer, NcclCommunicator, NcclInit};
use hypershard_collectives::tcp::{TcpCommunicator, TcpConfig};
use hypershard_collectives::{
    CommConfig, CommCounter, Communicator, DType as CommDType, MemoryStore, OpKind, Store,
};
use hypershard_fsdp::device::{DeviceFsdpConfig, DeviceFsdpError, DeviceFsdpMlp, Staging};
use hypershard_fsdp::{
    DataParallelMesh, FullyShardConfig, fully_shard, fully_shard_children, has_params,
};
use hypershard_nn::cuda::DeviceMlp;
use hypershard_nn::optim::{Sgd, SgdConfig};
use hypershard_nn::{
    Linear, LinearConfig, Module, ParamVisitor, Relu, Sequential, mse_loss, zero_grad,
};
use hypershard_tensor::cuda::{
    CudaDevice, CudaError, CudaTensor, FlatRange, copy_in_ranges, copy_out_ranges, device_count,
};
use hypershard_tensor::{DType, RandomInit, Tensor};
use hypershard_testkit::device::{GPU_ENV, Outcome, Tally, contained, fail, gpu_asked};

fn random(shape: &[usize], dtype: DType, seed: u64) -> Result<Tensor, String> {
    Tensor::random(shape, dtype, RandomInit::uniform(seed, -1.0, 1.0)).map_err(fail)
}

/// Linear(dims[i], dims[i+1]) + ReLU for each step of `dims`, seeds two apart as in the
/// benchmarks (the same model as nn's cuda_mlp test).
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

/// `‖got − want‖∞ ≤ rel · ‖want‖∞` (norm-wise, as in cuda_mlp).
fn close(what: &str, got: &[f64], want: &[f64], rel: f64) -> Outcome {
    if got.len() != want.len() {
        return Err(format!("{what}: {} vs {} elements", got.len(), want.len()));
    }
    let scale = want.iter().fold(0.0f64, |m, v| m.max(v.abs()));
    let worst = got
        .iter()
        .zip(want)
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
            "{what}: max |sharded − cpu| = {worst:e} > {rel:e} · ‖cpu‖∞ = {:e}",
            rel * scale
        ))
    }
}

fn local_world(n: usize) -> Result<Vec<Arc<dyn Communicator>>, String> {
    let config = CommConfig::default().with_timeout(Duration::from_secs(120));
    hypershard_collectives::local::spawn_world_with(n, config).map_err(fail)
}

/// Creation without CUDA (or without the device) is a typed `Unavailable`; configuration
/// errors are typed and come before the device is opened.
fn creation_reports_unavailability() -> Outcome {
    let model = mlp(&[3, 4], DType::F32)?;
    let comm = local_world(1)?.remove(0);
    match DeviceFsdpMlp::open(4096, &model, comm.clone(), DeviceFsdpConfig::default()) {
        Err(DeviceFsdpError::Cuda(CudaError::Unavailable { reason })) => {
            println!("device_fsdp: device 4096 is unavailable, as it must be: {reason}");
        }
        Err(other) => return Err(format!("expected Unavailable for device 4096, got {other}")),
        Ok(_) => return Err("device 4096 opened".to_string()),
    }
    let usable = matches!(device_count(), Ok(n) if n > 0);
    if !usable {
        match DeviceFsdpMlp::open(0, &model, comm.clone(), DeviceFsdpConfig::default()) {
            Err(DeviceFsdpError::Cuda(CudaError::Unavailable { reason })) => {
                println!("device_fsdp: no usable GPU here: {reason}");
            }
            Err(other) => return Err(format!("expected Unavailable for device 0, got {other}")),
            Ok(_) => return Err("no devices reported, yet device 0 opened".to_string()),
        }
    }
    let device_only = DeviceFsdpConfig {
        staging: Staging::Device,
        ..DeviceFsdpConfig::default()
    };
    match DeviceFsdpMlp::open(0, &model, comm.clone(), device_only) {
        Err(DeviceFsdpError::DeviceBuffersUnsupported {
            rank: 0,
            backend: "local",
        }) => {}
        Err(other) => return Err(format!("expected DeviceBuffersUnsupported, got {other}")),
        Ok(_) => return Err("Staging::Device accepted over the local backend".to_string()),
    }
    let zero = DeviceFsdpConfig {
        layers_per_group: 0,
        ..DeviceFsdpConfig::default()
    };
    match DeviceFsdpMlp::open(0, &model, comm, zero) {
        Err(DeviceFsdpError::ZeroGroupSize { rank: 0 }) => Ok(()),
        Err(other) => Err(format!("expected ZeroGroupSize, got {other}")),
        Ok(_) => Err("layers_per_group = 0 accepted".to_string()),
    }
}

type DeviceTest = fn(&CudaDevice) -> Outcome;

/// `copy_out_ranges` and `copy_in_ranges` against the same copies on the host, for 4- and
/// 2-byte elements, with ranges that leave gaps, an empty range, and one part in three
/// ranges; and their errors.
fn ranges_round_trip(device: &CudaDevice) -> Outcome {
    for dtype in [DType::F32, DType::BF16] {
        let a = random(&[7, 5], DType::F32, 1)?
            .to_dtype(dtype)
            .map_err(fail)?;
        let b = random(&[11], DType::F32, 2)?
            .to_dtype(dtype)
            .map_err(fail)?;
        let flat_len = 64;
        let ranges = [
            FlatRange {
                part: 0,
                start: 0,
                len: 15,
                flat: 0,
            },
            FlatRange {
                part: 1,
                start: 0,
                len: 6,
                flat: 17,
            },
            FlatRange {
                part: 0,
                start: 15,
                len: 10,
                flat: 30,
            },
            FlatRange {
                part: 1,
                start: 6,
                len: 0,
                flat: 40,
            },
            FlatRange {
                part: 1,
                start: 6,
                len: 5,
                flat: 41,
            },
            FlatRange {
                part: 0,
                start: 25,
                len: 10,
                flat: 50,
            },
        ];
        let host_a = a.to_f64_vec().map_err(fail)?;
        let host_b = b.to_f64_vec().map_err(fail)?;
        let parts_host = [&host_a, &host_b];
        let mut want = vec![0.0f64; flat_len];
        for r in &ranges {
            want[r.flat..r.flat + r.len]
                .copy_from_slice(&parts_host[r.part][r.start..r.start + r.len]);
        }
        let da = CudaTensor::from_host(device, &a).map_err(fail)?;
        let db = CudaTensor::from_host(device, &b).map_err(fail)?;
        let mut flat = CudaTensor::zeros(device, &[flat_len], dtype).map_err(fail)?;
        copy_in_ranges(&mut flat, &[&da, &db], &ranges).map_err(fail)?;
        let got = flat.to_host().map_err(fail)?.to_f64_vec().map_err(fail)?;
        if got != want {
            return Err(format!(
                "{dtype}: copy_in_ranges differs from the host copy"
            ));
        }
        let mut ra = CudaTensor::zeros(device, &[7, 5], dtype).map_err(fail)?;
        let mut rb = CudaTensor::zeros(device, &[11], dtype).map_err(fail)?;
        copy_out_ranges(&flat, &mut [&mut ra, &mut rb], &ranges).map_err(fail)?;
        if ra.to_host().map_err(fail)?.to_f64_vec().map_err(fail)? != host_a
            || rb.to_host().map_err(fail)?.to_f64_vec().map_err(fail)? != host_b
        {
            return Err(format!(
                "{dtype}: copy_out_ranges did not rebuild the parts"
            ));
        }
        let overlapping = [
            FlatRange {
                part: 0,
                start: 0,
                len: 4,
                flat: 0,
            },
            FlatRange {
                part: 1,
                start: 0,
                len: 4,
                flat: 2,
            },
        ];
        match copy_in_ranges(&mut flat, &[&da, &db], &overlapping) {
            Err(CudaError::OverlappingParts { .. }) => {}
            other => return Err(format!("overlapping copy-in: {other:?}")),
        }
        let outside = [FlatRange {
            part: 1,
            start: 8,
            len: 4,
            flat: 0,
        }];
        match copy_out_ranges(&flat, &mut [&mut ra, &mut rb], &outside) {
            Err(CudaError::OutOfBounds { .. }) => {}
            other => return Err(format!("range past its part: {other:?}")),
        }
        // f16 is neither the f32 nor the bf16 flat buffer's dtype.
        let f16 = CudaTensor::zeros(device, &[4], DType::F16).map_err(fail)?;
        match copy_in_ranges(&mut flat, &[&f16], &[]) {
            Err(CudaError::DTypeMismatch { .. }) => {}
            other => return Err(format!("part of another dtype: {other:?}")),
        }
    }
    Ok(())
}

/// A device tensor's memory as an NCCL device buffer and back, without a copy: the values
/// survive, a wrong length or dtype is a typed error.
fn interop_round_trip(device: &CudaDevice) -> Outcome {
    let t = random(&[3, 5], DType::F32, 4)?;
    let want = t.to_f64_vec().map_err(fail)?;
    let dt = CudaTensor::from_host(device, &t).map_err(fail)?;
    let buffer = DeviceBuffer::from_slice(dt.into_device_bytes(), CommDType::F32).map_err(fail)?;
    if buffer.len() != 15 || buffer.device() != device.ordinal() {
        return Err(format!("device buffer {buffer:?}"));
    }
    let host = buffer.to_host().map_err(fail)?;
    if host.to_f64_vec() != want {
        return Err("the device buffer does not hold the tensor's values".to_string());
    }
    let shared = buffer.share();
    // A shared buffer gives back a private copy; the last handle gives back the memory.
    let copy = shared.into_slice().map_err(fail)?;
    let copy = CudaTensor::from_device_bytes(device, copy, &[15], DType::F32).map_err(fail)?;
    let back = buffer.into_slice().map_err(fail)?;
    let back = CudaTensor::from_device_bytes(device, back, &[3, 5], DType::F32).map_err(fail)?;
    for (name, tensor) in [("copy", &copy), ("original", &back)] {
        if tensor.to_host().map_err(fail)?.to_f64_vec().map_err(fail)? != want {
            return Err(format!("the {name} lost the values"));
        }
    }
    match CudaTensor::from_device_bytes(device, back.into_device_bytes(), &[4, 5], DType::F32) {
        Err(CudaError::LengthMismatch {
            expected: 80,
            got: 60,
            ..
        }) => {}
        other => return Err(format!("wrong length: {other:?}")),
    }
    let odd = CudaTensor::zeros(device, &[3], DType::U8).map_err(fail)?;
    match DeviceBuffer::from_slice(odd.into_device_bytes(), CommDType::F32) {
        Err(hypershard_collectives::Error::MisalignedBytes { bytes: 3, .. }) => Ok(()),
        other => Err(format!("3 bytes as f32: {other:?}")),
    }
}

/// The widths of the parity runs: none is divisible by 2 or 3.
const DIMS: [usize; 5] = [37, 53, 53, 53, 37];
/// The global batch: 30 rows, split evenly over 1, 2 and 3 ranks (so the average of the
/// ranks' mean-loss gradients is the full batch's).
const BATCH: usize = 30;
const STEPS: usize = 4;
const LR: f64 = 0.05;

#[derive(Debug, Clone, Copy, PartialEq)]
enum Backend {
    Nccl,
    Local,
    Tcp,
}

/// What one parity run does and how close it must be.
#[derive(Clone)]
struct Run {
    backend: Backend,
    world: usize,
    config: DeviceFsdpConfig,
    /// Micro-batches per step; all but the last run without gradient sync.
    micro: usize,
    /// Bounds (relative to the CPU's ∞-norm): losses, weights, gradients (None: not compared).
    loss: f64,
    weight: f64,
    grad: Option<f64>,
}

/// The data of micro-batch `m` of step `step`: the whole global batch.
fn batch(step: usize, m: usize) -> Result<(Tensor, Tensor), String> {
    let seed = 100 * step as u64 + 10 * m as u64;
    Ok((
        random(&[BATCH, DIMS[0]], DType::F32, 10 + seed)?,
        random(&[BATCH, DIMS[4]], DType::F32, 20 + seed)?,
    ))
}

/// The unsharded CPU run: per step, the micro-batches' gradients summed, then SGD. Returns
/// the mean loss of each micro-batch, the final parameters and the last step's gradients.
/// The CPU run's losses, final parameters (with the last gradients) and initial parameters.
type Reference = (Vec<f64>, Vec<HostParam>, Vec<HostParam>);

fn cpu_reference(micro: usize) -> Result<Reference, String> {
    let mut model = mlp(&DIMS, DType::F32)?;
    let initial = params(&model)?;
    let mut sgd = Sgd::new(SgdConfig {
        lr: LR,
        ..SgdConfig::default()
    })
    .map_err(fail)?;
    let mut losses = Vec::new();
    for step in 0..STEPS {
        zero_grad(&mut model).map_err(fail)?;
        for m in 0..micro {
            let (x, t) = batch(step, m)?;
            let out = model.forward(&x).map_err(fail)?;
            let loss = mse_loss(&out, &t).map_err(fail)?;
            model.backward(&loss.grad).map_err(fail)?;
            losses.push(loss.loss);
        }
        sgd.step(&mut model).map_err(fail)?;
    }
    Ok((losses, params(&model)?, initial))
}

/// What one rank reports.
struct RankReport {
    losses: Vec<f64>,
    /// All-gathers and reduce-scatters of each step, and the all-gather input bytes.
    counts: Vec<(u64, u64, u64)>,
    /// Elements of this rank's block of each group.
    group_shards: Vec<usize>,
    unsharded_after_steps: Vec<usize>,
    /// The full model with the last step's reduced gradients (every rank gathers it; rank
    /// 0's is compared).
    full: Option<Vec<HostParam>>,
}

fn rank_run(
    rank: usize,
    world: usize,
    device: &CudaDevice,
    comm: Arc<dyn Communicator>,
    run: &Run,
) -> Result<RankReport, String> {
    let counter = CommCounter::new(comm);
    let model = mlp(&DIMS, DType::F32)?;
    let mut fsdp = DeviceFsdpMlp::new(device, &model, counter.clone(), run.config.clone())
        .map_err(|e| format!("rank {rank}: {e}"))?;
    let expect_device = run.backend == Backend::Nccl && run.config.staging != Staging::Host;
    if fsdp.uses_device_buffers() != expect_device {
        return Err(format!(
            "rank {rank}: device buffers {} on {:?}",
            fsdp.uses_device_buffers(),
            run.backend
        ));
    }
    let rows = BATCH / world;
    let mut report = RankReport {
        losses: Vec::new(),
        counts: Vec::new(),
        group_shards: fsdp.groups().iter().map(|g| g.shard_numel).collect(),
        unsharded_after_steps: Vec::new(),
        full: None,
    };
    for step in 0..STEPS {
        let before = (
            counter.calls(OpKind::AllGather),
            counter.calls(OpKind::ReduceScatter),
            counter.bytes(OpKind::AllGather),
        );
        fsdp.zero_grad().map_err(fail)?;
        for m in 0..run.micro {
            let (x, t) = batch(step, m)?;
            let x = x.narrow(0, rank * rows, rows).map_err(fail)?;
            let t = t.narrow(0, rank * rows, rows).map_err(fail)?;
            let dx = CudaTensor::from_host(device, &x).map_err(fail)?;
            let dt = CudaTensor::from_host(device, &t).map_err(fail)?;
            fsdp.set_requires_gradient_sync(m + 1 == run.micro);
            let (loss, grad) = fsdp.forward_loss(&dx, &dt).map_err(fail)?;
            fsdp.backward(grad).map_err(fail)?;
            report.losses.push(loss);
        }
        fsdp.sgd_step(LR).map_err(fail)?;
        report.counts.push((
            counter.calls(OpKind::AllGather) - before.0,
            counter.calls(OpKind::ReduceScatter) - before.1,
            counter.bytes(OpKind::AllGather) - before.2,
        ));
        report.unsharded_after_steps.push(fsdp.unsharded_bytes());
    }
    device.synchronize().map_err(fail)?;
    report.full = Some(params(&fsdp.full_model(true).map_err(fail)?)?);
    Ok(report)
}

fn comms(backend: Backend, world: usize) -> Result<Vec<Arc<dyn Communicator>>, String> {
    match backend {
        Backend::Local => local_world(world),
        Backend::Nccl => {
            if world != 1 {
                return Err("NCCL refuses two ranks of one communicator on one GPU".to_string());
            }
            let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
            let comm = NcclCommunicator::new(NcclInit {
                rank: 0,
                size: 1,
                device: 0,
                store,
                config: CommConfig::default().with_timeout(Duration::from_secs(120)),
            })
            .map_err(fail)?;
            Ok(vec![Arc::new(comm) as Arc<dyn Communicator>])
        }
        Backend::Tcp => {
            let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
            let tcp = TcpConfig::default().with_rendezvous_timeout(Duration::from_secs(20));
            let config = CommConfig::default().with_timeout(Duration::from_secs(120));
            hypershard_testkit::run_ranks(world, move |rank| {
                TcpCommunicator::connect(store.as_ref(), rank, world, &tcp, config.clone())
                    .map(|comm| Arc::new(comm) as Arc<dyn Communicator>)
            })
            .map_err(fail)
        }
    }
}

/// One sharded run against the CPU: the mean of the ranks' losses against the CPU's loss of
/// each micro-batch (the ranks hold equal rows), rank 0's gathered parameters and gradients
/// against the CPU's, every rank's collective counts, and the freed memory.
fn parity(device: &CudaDevice, run: Run) -> Outcome {
    let (want_losses, want, initial) = cpu_reference(run.micro)?;
    let world = run.world;
    let comms = comms(run.backend, world)?;
    let reports: Vec<RankReport> = if world == 1 {
        vec![rank_run(0, 1, device, comms[0].clone(), &run)?]
    } else {
        let device = device.clone();
        let run_for_ranks = run.clone();
        hypershard_testkit::run_ranks(world, move |rank| {
            rank_run(rank, world, &device, comms[rank].clone(), &run_for_ranks)
        })
        .map_err(fail)?
    };
    let label = format!(
        "{:?} world {world}, {} per group, param_dtype {:?}, {} micro",
        run.backend, run.config.layers_per_group, run.config.param_dtype, run.micro
    );
    for (i, want) in want_losses.iter().enumerate() {
        let mean = reports.iter().map(|r| r.losses[i]).sum::<f64>() / world as f64;
        if (mean - want).abs() > run.loss * want.abs() {
            return Err(format!(
                "{label}: loss {i}: {mean} vs the CPU's {want} (bound {:e} relative)",
                run.loss
            ));
        }
    }
    // Exact collective counts per step: one all-gather per group per forward, one more per
    // group freed after the forward (all but the last) for the backward, and one
    // reduce-scatter per group per synchronised backward. With `micro` micro-batches, the
    // unsynchronised ones gather as often but reduce nothing.
    // The all-gather input is each group's block, in the compute dtype (2 bytes for bf16: the
    // mixed-precision gather moves half the bytes).
    let shards = &reports[0].group_shards;
    let groups = shards.len() as u64;
    let all: u64 = shards.iter().map(|&n| n as u64).sum();
    let last = shards.last().map_or(0, |&n| n as u64);
    let (per_forward, gathered) = if run.config.reshard_after_forward {
        (2 * groups - 1, 2 * all - last)
    } else {
        (groups, all)
    };
    let element = match run.config.param_dtype {
        Some(DType::BF16) | Some(DType::F16) => 2,
        _ => 4,
    };
    let gather_bytes = gathered * run.micro as u64 * element;
    for (rank, report) in reports.iter().enumerate() {
        for (step, &(gathers, reduces, bytes)) in report.counts.iter().enumerate() {
            let want = (per_forward * run.micro as u64, groups, gather_bytes);
            if (gathers, reduces, bytes) != want {
                return Err(format!(
                    "{label}: rank {rank} step {step}: {gathers} all-gathers, {reduces} reduce-scatters, {bytes} gathered bytes; expected {want:?}"
                ));
            }
        }
        if let Some(bytes) = report.unsharded_after_steps.iter().find(|&&b| b != 0) {
            return Err(format!(
                "{label}: rank {rank} holds {bytes} bytes of unsharded parameters or gradients after a step"
            ));
        }
    }
    let got = reports[0]
        .full
        .as_ref()
        .ok_or_else(|| format!("{label}: no gathered model"))?;
    if got.len() != want.len() {
        return Err(format!(
            "{label}: {} parameters vs {}",
            got.len(),
            want.len()
        ));
    }
    let mut moved = 0.0f64;
    for (((name, w, g), (cpu_name, w_cpu, g_cpu)), (_, w0, _)) in
        got.iter().zip(&want).zip(&initial)
    {
        if name != cpu_name {
            return Err(format!("{label}: parameter {name} vs the CPU's {cpu_name}"));
        }
        close(&format!("{label}: {name}"), w, w_cpu, run.weight)?;
        if let Some(rel) = run.grad {
            let (Some(g), Some(g_cpu)) = (g, g_cpu) else {
                return Err(format!("{label}: {name}: a gradient is missing"));
            };
            close(&format!("{label}: grad of {name}"), g, g_cpu, rel)?;
        }
        let scale = w_cpu.iter().fold(0.0f64, |m, v| m.max(v.abs()));
        let change = w_cpu
            .iter()
            .zip(w0)
            .fold(0.0f64, |m, (a, b)| m.max((a - b).abs()));
        moved = moved.max(change / scale);
    }
    if moved <= 1e-3 {
        return Err(format!(
            "{label}: the weights moved by at most {moved:e} of their ∞-norm, too little for the bound to mean anything"
        ));
    }
    // Other ranks gathered the same model.
    for (rank, report) in reports.iter().enumerate().skip(1) {
        if report.full.as_ref() != Some(got) {
            return Err(format!(
                "{label}: rank {rank} gathered another model than rank 0"
            ));
        }
    }
    println!("device_fsdp: {label}: ok (weights moved by {moved:e})");
    Ok(())
}

/// f32 bounds, as in cuda_mlp's f32 run: losses, weights and gradients within 1e-4 (relative,
/// of the ∞-norm). The device and the CPU round the same f32 operations and differ in the
/// GEMMs' summation order and the loss's sum (f32 against f64); sharding adds the average of
/// the ranks' mean-loss gradients (a sum of `world` terms and a division, against the CPU's
/// one mean over the batch). Measured on the CPU with this model, data and 4 steps, the f32
/// run with the batch split over 1, 2 or 3 ranks and the gradients averaged in f32, against
/// the f64 run on the whole batch: losses within 8.9e-10, weights within 1.8e-7, gradients
/// within 2.5e-7. So 1e-4 leaves a wide margin for cuBLAS's summation order, while a lost
/// shard, a wrong range or a missing 1/world is O(1) (and the weights must move by more
/// than 1e-3 of their ∞-norm for the weight bound to mean anything).
fn f32_run(backend: Backend, world: usize, config: DeviceFsdpConfig) -> Run {
    Run {
        backend,
        world,
        config,
        micro: 1,
        loss: 1e-4,
        weight: 1e-4,
        grad: Some(1e-4),
    }
}

fn nccl_world_1(device: &CudaDevice) -> Outcome {
    parity(
        device,
        f32_run(Backend::Nccl, 1, DeviceFsdpConfig::default()),
    )?;
    // NCCL over host buffers (the communicator stages them itself), and two layers per group.
    parity(
        device,
        f32_run(
            Backend::Nccl,
            1,
            DeviceFsdpConfig {
                staging: Staging::Host,
                layers_per_group: 2,
                ..DeviceFsdpConfig::default()
            },
        ),
    )
}

fn local_world_2(device: &CudaDevice) -> Outcome {
    parity(
        device,
        f32_run(Backend::Local, 2, DeviceFsdpConfig::default()),
    )
}

fn local_world_3(device: &CudaDevice) -> Outcome {
    parity(
        device,
        f32_run(Backend::Local, 3, DeviceFsdpConfig::default()),
    )?;
    // Three layers in the first group and one in the second, no prefetch, parameters kept
    // gathered between forward and backward.
    parity(
        device,
        f32_run(
            Backend::Local,
            3,
            DeviceFsdpConfig {
                layers_per_group: 3,
                prefetch: false,
                reshard_after_forward: false,
                ..DeviceFsdpConfig::default()
            },
        ),
    )
}

fn tcp_world_2(device: &CudaDevice) -> Outcome {
    parity(
        device,
        f32_run(Backend::Tcp, 2, DeviceFsdpConfig::default()),
    )
}

/// Two micro-batches per step, the first without gradient sync: the unsharded gradients
/// accumulate, one reduce-scatter per group per step; against the CPU's summed gradients.
fn no_sync_accumulates(device: &CudaDevice) -> Outcome {
    let mut run = f32_run(Backend::Local, 2, DeviceFsdpConfig::default());
    run.micro = 2;
    parity(device, run)
}

/// bf16 mixed precision at world 2 (local): the f32 shard cast to bf16 and gathered in bf16
/// (the counted all-gather bytes are 2 per element), gradients accumulated in f32 by the
/// GEMMs and reduced in f32, SGD on the f32 shard; against the f32 CPU run. Bounds: losses
/// 2e-3 relative, weights 5e-3 of their ∞-norm, gradients not compared. Measured on the CPU
/// with a proxy of this run (each step the f32 master weights rounded to bf16, forward and
/// backward in bf16 with bf16 gradients, SGD in f32 on the master weights, same model, data
/// and 4 steps), against the f32 run: losses within 4.9e-5, weights within 2.8e-4, gradients
/// 28% apart (bf16 noise, so not compared), while the weights move by 2.0e-2. The device's
/// gradients are closer to f32 than the proxy's (f32 accumulators) but its summation order
/// differs, so the bounds leave 18-40× the measured distance; the weight bound stays a
/// quarter of the movement, so a lost update or a missing 1/world in the average fails.
fn mixed_bf16(device: &CudaDevice) -> Outcome {
    let mut run = f32_run(
        Backend::Local,
        2,
        DeviceFsdpConfig {
            param_dtype: Some(DType::BF16),
            ..DeviceFsdpConfig::default()
        },
    );
    run.loss = 2e-3;
    run.weight = 5e-3;
    run.grad = None;
    parity(device, run)
}

/// Misuse gives typed errors naming the rank, never a panic.
fn misuse_is_typed(device: &CudaDevice) -> Outcome {
    let model = mlp(&DIMS, DType::F32)?;
    let comm = local_world(1)?.remove(0);
    let mut fsdp = DeviceFsdpMlp::new(device, &model, comm.clone(), DeviceFsdpConfig::default())
        .map_err(fail)?;
    let grad = CudaTensor::zeros(device, &[4, DIMS[4]], DType::F32).map_err(fail)?;
    match fsdp.backward(grad) {
        Err(DeviceFsdpError::BackwardBeforeForward { rank: 0 }) => {}
        other => return Err(format!("backward before forward: {other:?}")),
    }
    match fsdp.sgd_step(0.1) {
        Err(DeviceFsdpError::NoGradient { rank: 0, group: 0 }) => {}
        other => return Err(format!("step without gradients: {other:?}")),
    }
    let wide = CudaTensor::zeros(device, &[4, DIMS[0] + 1], DType::F32).map_err(fail)?;
    match fsdp.forward(&wide) {
        Err(DeviceFsdpError::BadTensor {
            role: "input",
            actual,
            ..
        }) if actual == [4, 38] => {}
        other => return Err(format!("wrong input width: {other:?}")),
    }
    let x = CudaTensor::zeros(device, &[4, DIMS[0]], DType::F32).map_err(fail)?;
    let t = CudaTensor::zeros(device, &[5, DIMS[4]], DType::F32).map_err(fail)?;
    match fsdp.forward_loss(&x, &t) {
        Err(DeviceFsdpError::BadTensor { role: "target", .. }) => {}
        other => return Err(format!("wrong target rows: {other:?}")),
    }
    fsdp.forward(&x).map_err(fail)?;
    let wrong = CudaTensor::zeros(device, &[4, DIMS[4]], DType::BF16).map_err(fail)?;
    match fsdp.backward(wrong) {
        Err(DeviceFsdpError::BadTensor {
            role: "gradient",
            dtype: DType::BF16,
            ..
        }) => {}
        other => return Err(format!("gradient of another dtype: {other:?}")),
    }
    let bf16_model = mlp(&DIMS, DType::BF16)?;
    let f16 = DeviceFsdpConfig {
        param_dtype: Some(DType::F16),
        ..DeviceFsdpConfig::default()
    };
    match DeviceFsdpMlp::new(device, &bf16_model, comm, f16) {
        Err(DeviceFsdpError::UnsupportedParamDType {
            storage: DType::BF16,
            param_dtype: DType::F16,
            ..
        }) => Ok(()),
        other => Err(format!("f16 compute over bf16 shards: {other:?}")),
    }
}

/// The reference MLP's FSDP step on the device, as JSON under target/bench.
fn bench(device: &CudaDevice) -> Outcome {
    const WIDTH: usize = 1024;
    const DEPTH: usize = 8;
    const BATCH_ROWS: usize = 32;
    const BENCH_LR: f64 = 0.01;
    let dims = [WIDTH; DEPTH + 1];
    let x = random(&[BATCH_ROWS, WIDTH], DType::F32, 10)?;
    let t = random(&[BATCH_ROWS, WIDTH], DType::F32, 20)?;
    let model = mlp(&dims, DType::F32)?;
    let median = |mut v: Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let (warmup, steps) = (5usize, 30usize);
    let mut rows = Vec::new();
    // The unsharded device MLP, for the cost of sharding.
    {
        let mut dev = DeviceMlp::from_cpu(device, &model).map_err(fail)?;
        let dx = CudaTensor::from_host(device, &x).map_err(fail)?;
        let dt = CudaTensor::from_host(device, &t).map_err(fail)?;
        let mut times = Vec::new();
        for step in 0..warmup + steps {
            let started = Instant::now();
            dev.train_step(&dx, &dt, BENCH_LR).map_err(fail)?;
            device.synchronize().map_err(fail)?;
            if step >= warmup {
                times.push(started.elapsed().as_secs_f64() * 1e3);
            }
        }
        rows.push(format!(
            "{{\"what\":\"unsharded DeviceMlp\",\"backend\":\"none\",\"world\":1,\"param_dtype\":\"f32\",\"steps\":{steps},\"median_ms\":{},\"min_ms\":{}}}",
            median(times.clone()),
            times.iter().copied().fold(f64::INFINITY, f64::min)
        ));
    }
    let cases: [(Backend, usize, Option<DType>); 3] = [
        (Backend::Nccl, 1, None),
        (Backend::Nccl, 1, Some(DType::BF16)),
        (Backend::Local, 2, None),
    ];
    for (backend, world, param_dtype) in cases {
        let comms = comms(backend, world)?;
        let device = device.clone();
        let per_rank = move |rank: usize| -> Result<(Vec<f64>, f64, f64), String> {
            let model = mlp(&dims, DType::F32)?;
            let x = random(&[BATCH_ROWS, WIDTH], DType::F32, 10)?;
            let t = random(&[BATCH_ROWS, WIDTH], DType::F32, 20)?;
            let config = DeviceFsdpConfig {
                param_dtype,
                ..DeviceFsdpConfig::default()
            };
            let mut fsdp =
                DeviceFsdpMlp::new(&device, &model, comms[rank].clone(), config).map_err(fail)?;
            let rows = BATCH_ROWS / world;
            let dx = CudaTensor::from_host(&device, &x.narrow(0, rank * rows, rows).map_err(fail)?)
                .map_err(fail)?;
            let dt = CudaTensor::from_host(&device, &t.narrow(0, rank * rows, rows).map_err(fail)?)
                .map_err(fail)?;
            let mut times = Vec::new();
            let (mut first, mut last) = (f64::NAN, f64::NAN);
            for step in 0..warmup + steps {
                let started = Instant::now();
                let loss = fsdp.train_step(&dx, &dt, BENCH_LR).map_err(fail)?;
                device.synchronize().map_err(fail)?;
                if step >= warmup {
                    times.push(started.elapsed().as_secs_f64() * 1e3);
                    if step == warmup {
                        first = loss;
                    }
                    last = loss;
                }
            }
            Ok((times, first, last))
        };
        let results = hypershard_testkit::run_ranks(world, per_rank).map_err(fail)?;
        let (times, first, last) = &results[0];
        let backend_name = match backend {
            Backend::Nccl => "nccl",
            Backend::Local => "local (staged through host memory)",
            Backend::Tcp => "tcp",
        };
        let dtype = param_dtype.map_or("f32".to_string(), |d| d.to_string());
        rows.push(format!(
            "{{\"what\":\"DeviceFsdpMlp\",\"backend\":\"{backend_name}\",\"world\":{world},\"param_dtype\":\"{dtype}\",\"steps\":{steps},\"median_ms\":{},\"min_ms\":{},\"first_loss\":{first},\"last_loss\":{last}}}",
            median(times.clone()),
            times.iter().copied().fold(f64::INFINITY, f64::min)
        ));
    }
    // The CPU FSDP step of the same model (fully_shard per Linear under a root, local
    // backend, the machine's threads), for the device's speed-up over the CPU.
    for world in [1usize, 2] {
        let comms = local_world(world)?;
        let per_rank = move |rank: usize| -> Result<Vec<f64>, String> {
            let mut model = mlp(&dims, DType::F32)?;
            let mesh = DataParallelMesh::fsdp(comms[rank].clone()).map_err(fail)?;
            let config = FullyShardConfig::new(mesh);
            fully_shard_children(&mut model, &config, &mut |_, m| has_params(m)).map_err(fail)?;
            let mut fsdp = fully_shard(Box::new(model), config).map_err(fail)?;
            let mut sgd = Sgd::new(SgdConfig {
                lr: BENCH_LR,
                ..SgdConfig::default()
            })
            .map_err(fail)?;
            let rows = BATCH_ROWS / world;
            let x = random(&[BATCH_ROWS, WIDTH], DType::F32, 10)?
                .narrow(0, rank * rows, rows)
                .map_err(fail)?;
            let t = random(&[BATCH_ROWS, WIDTH], DType::F32, 20)?
                .narrow(0, rank * rows, rows)
                .map_err(fail)?;
            let (cpu_warmup, cpu_steps) = (2, 10);
            let mut times = Vec::new();
            for step in 0..cpu_warmup + cpu_steps {
                let started = Instant::now();
                let out = fsdp.forward(&x).map_err(fail)?;
                let loss = mse_loss(&out, &t).map_err(fail)?;
                fsdp.backward(&loss.grad).map_err(fail)?;
                sgd.step(&mut fsdp).map_err(fail)?;
                fsdp.zero_grad().map_err(fail)?;
                if step >= cpu_warmup {
                    times.push(started.elapsed().as_secs_f64() * 1e3);
                }
            }
            Ok(times)
        };
        let results = hypershard_testkit::run_ranks(world, per_rank).map_err(fail)?;
        let threads = std::thread::available_parallelism().map_or(0, |n| n.get());
        rows.push(format!(
            "{{\"what\":\"CPU FsdpModule\",\"backend\":\"local\",\"world\":{world},\"param_dtype\":\"f32\",\"steps\":{},\"threads\":{threads},\"median_ms\":{},\"min_ms\":{}}}",
            results[0].len(),
            median(results[0].clone()),
            results[0].iter().copied().fold(f64::INFINITY, f64::min)
        ));
    }
    let name = device.name().map_err(fail)?.replace(['"', '\\'], "");
    let json = format!(
        "{{\"bench\":\"fsdp-cuda\",\"model\":\"{DEPTH} x (Linear({WIDTH},{WIDTH}) + ReLU), MSE, SGD lr {BENCH_LR}\",\"global_batch\":{BATCH_ROWS},\"groups\":\"one per Linear, prefetch, reshard after forward\",\"device\":\"{name}\",\"rows\":[{}]}}\n",
        rows.join(",")
    );
    std::fs::create_dir_all("target/bench").map_err(fail)?;
    std::fs::write("target/bench/fsdp-cuda.json", &json).map_err(fail)?;
    print!("device_fsdp: wrote target/bench/fsdp-cuda.json: {json}");
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
                "device_fsdp: device 0 is {}; running the device tests",
                device.name().unwrap_or_else(|e| e.to_string())
            );
            let tests: [(&str, DeviceTest); 9] = [
                ("ranges_round_trip", ranges_round_trip),
                ("interop_round_trip", interop_round_trip),
                ("misuse_is_typed", misuse_is_typed),
                ("nccl_world_1", nccl_world_1),
                ("local_world_2", local_world_2),
                ("local_world_3", local_world_3),
                ("tcp_world_2", tcp_world_2),
                ("no_sync_accumulates", no_sync_accumulates),
                ("mixed_bf16", mixed_bf16),
            ];
            for (name, test) in tests {
                tally.check(name, contained(|| test(&device)));
            }
            tally.check("synchronize", device.synchronize().map_err(fail));
        }
        Err(error) if asked => {
            eprintln!(
                "device_fsdp: the device was asked for ({GPU_ENV}=1 or --bench), but no CUDA device is usable: {error}"
            );
            tally.check("gpu_available", Err(error.to_string()));
        }
        Err(error) => {
            println!(
                "device_fsdp: {GPU_ENV}=1 is not set and no GPU is usable ({error}), so the device tests did not run"
            );
        }
    }
    tally.finish()
}
