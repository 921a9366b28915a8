//! The optimizer steps of nn on CUDA tensors, f32 only: AdamW and SGD with momentum and weight
//! decay, each one kernel over a parameter and its state. Each follows the host optimizer's
//! formula (kernels.cu); SGD computes in f64 as the host does, so its results are the host's
//! bit for bit.

use cudarc::driver::PushKernelArg;

#[cfg(test)]
use super::KERNEL_NAMES;
use super::kernels::launch_config;
use super::nn_ops::f32_of;
use super::view::launch;
use crate::{Result, Tensor};

/// The kernels this module launches (all in [`KERNEL_NAMES`]; a unit test checks).
const ADAMW: &str = "adamw_f32";
const SGD: &str = "sgd_f32";

/// The hyperparameters of one AdamW step, as hypershard-nn's `AdamWConfig`, with the step
/// number (1 for the first step).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamWStep {
    /// The learning rate.
    pub lr: f64,
    /// `(β₁, β₂)`.
    pub betas: (f64, f64),
    /// Added to the denominator.
    pub eps: f64,
    /// Decoupled weight decay.
    pub weight_decay: f64,
    /// The step number (the first step is 1).
    pub step: std::num::NonZeroU64,
}

/// One AdamW step in place on an f32 parameter and its f32 moments, from `grad`: the host
/// `AdamW`'s update (which runs in f64) in f32, with the bias corrections computed on the
/// host in f64 and rounded once.
pub fn adamw_(
    param: &Tensor,
    exp_avg: &Tensor,
    exp_avg_sq: &Tensor,
    grad: &Tensor,
    config: &AdamWStep,
) -> Result<()> {
    const OP: &str = "cuda::adamw_";
    let [p, m, v, g] = [param, exp_avg, exp_avg_sq, grad].map(|t| f32_of(OP, t));
    let (p, m, v, g) = (p?, m?, v?, g?);
    for t in [&m, &v, &g] {
        p.same_device(OP, t)?;
        t.shape_is(OP, &p.shape)?;
    }
    for t in [param, exp_avg, exp_avg_sq] {
        t.check_writable(OP)?;
    }
    let Some(launch_cfg) = launch_config(OP, p.numel, 1).map_err(p.error(OP))? else {
        return Ok(());
    };
    let (beta1, beta2) = config.betas;
    let exponent = i32::try_from(config.step.get()).unwrap_or(i32::MAX);
    let bias_correction1 = 1.0 - beta1.powi(exponent);
    let bc2_sqrt = (1.0 - beta2.powi(exponent)).sqrt();
    let scalars = [
        1.0 - config.lr * config.weight_decay,
        beta1,
        1.0 - beta1,
        beta2,
        1.0 - beta2,
        config.lr / bias_correction1,
        bc2_sqrt,
        config.eps,
    ]
    .map(|v| v as f32);
    let n = p.numel as u64;
    // Checked: param, exp_avg, exp_avg_sq and grad hold n f32 each.
    launch!(OP, &p, ADAMW, launch_cfg, |l| {
        l.arg(&p.ptr).arg(&m.ptr).arg(&v.ptr).arg(&g.ptr).arg(&n);
        for v in &scalars {
            l.arg(v);
        }
    })
}

/// The hyperparameters of one SGD step, as hypershard-nn's `SgdConfig`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SgdStep {
    /// The learning rate.
    pub lr: f64,
    /// The L2 penalty added to the gradient.
    pub weight_decay: f64,
}

/// SGD's momentum: the buffer it keeps per parameter and how it is updated.
#[derive(Debug, Clone, Copy)]
pub struct SgdMomentum<'a> {
    /// The momentum buffer (f32, the parameter's shape), updated in place.
    pub buffer: &'a Tensor,
    /// Whether the buffer holds nothing yet: the first step sets it to the gradient, as torch.
    pub first: bool,
    /// The momentum factor μ.
    pub momentum: f64,
    /// The dampening τ.
    pub dampening: f64,
    /// Nesterov momentum.
    pub nesterov: bool,
}

/// One SGD step in place on an f32 parameter from `grad`, as the host `Sgd`'s general path
/// (computed in f64, each stored value rounded to f32 once), with momentum when `momentum`
/// is given.
pub fn sgd_(
    param: &Tensor,
    grad: &Tensor,
    step: &SgdStep,
    momentum: Option<SgdMomentum<'_>>,
) -> Result<()> {
    const OP: &str = "cuda::sgd_";
    let p = f32_of(OP, param)?;
    let g = f32_of(OP, grad)?;
    p.same_device(OP, &g)?;
    g.shape_is(OP, &p.shape)?;
    param.check_writable(OP)?;
    let buffer = match &momentum {
        Some(m) => {
            let b = f32_of(OP, m.buffer)?;
            p.same_device(OP, &b)?;
            b.shape_is(OP, &p.shape)?;
            m.buffer.check_writable(OP)?;
            Some(b)
        }
        None => None,
    };
    let Some(launch_cfg) = launch_config(OP, p.numel, 1).map_err(p.error(OP))? else {
        return Ok(());
    };
    let n = p.numel as u64;
    let flags = [
        u32::from(momentum.is_some()),
        u32::from(momentum.is_some_and(|m| m.nesterov)),
        u32::from(momentum.is_some_and(|m| m.first)),
    ];
    let scalars = [
        step.lr,
        momentum.map_or(0.0, |m| m.momentum),
        momentum.map_or(0.0, |m| m.dampening),
        step.weight_decay,
    ];
    // Checked: param and grad hold n f32, and so does the buffer when there is momentum;
    // without it the kernel never touches its buffer argument, the parameter's pointer.
    let buffer_ptr = buffer.as_ref().map_or(&p.ptr, |b| &b.ptr);
    launch!(OP, &p, SGD, launch_cfg, |l| {
        l.arg(&p.ptr).arg(buffer_ptr).arg(&g.ptr).arg(&n);
        for v in &scalars {
            l.arg(v);
        }
        for f in &flags {
            l.arg(f);
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_kernel_exists() {
        for name in [ADAMW, SGD] {
            assert!(KERNEL_NAMES.contains(&name), "{name}");
        }
    }
}
