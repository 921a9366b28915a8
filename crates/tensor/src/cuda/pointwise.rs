//! The pointwise device operations of nn's layers on CUDA tensors, f32 only: the activations
//! with a kernel pair (exact and tanh GELU, SiLU) and dropout's mask. Each kernel follows the
//! host's formula operation by operation (kernels.cu), so every element rounds as on the host;
//! the host emulation of the kernels compares them bit for bit.

use cudarc::driver::PushKernelArg;

#[cfg(test)]
use super::KERNEL_NAMES;
use super::kernels::launch_config;
use super::nn_ops::f32_of;
use super::view::launch;
use crate::{DType, Result, Tensor};

/// The kernels this module launches (all in [`KERNEL_NAMES`]; a unit test checks).
const GELU: &str = "gelu_f32";
const GELU_GRAD: &str = "gelu_grad_f32";
const GELU_TANH: &str = "gelu_tanh_f32";
const GELU_TANH_GRAD: &str = "gelu_tanh_grad_f32";
const SILU: &str = "silu_f32";
const SILU_GRAD: &str = "silu_grad_f32";
const DROPOUT: &str = "dropout_f32";

/// An elementwise activation of nn's with a kernel pair here (f32). Each kernel computes the
/// host's formula with the host's own `erf`, `exp` and `tanh` approximations, operation by
/// operation, so each element rounds as on the host.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Activation {
    /// The exact GELU `x · Φ(x)`.
    GeluExact,
    /// The tanh approximation `½x(1 + tanh(√(2/π)(x + 0.044715x³)))`.
    GeluTanh,
    /// SiLU `x · σ(x)`.
    Silu,
}

impl Activation {
    /// The forward and backward kernels.
    fn kernels(self) -> (&'static str, &'static str) {
        match self {
            Activation::GeluExact => (GELU, GELU_GRAD),
            Activation::GeluTanh => (GELU_TANH, GELU_TANH_GRAD),
            Activation::Silu => (SILU, SILU_GRAD),
        }
    }
}

/// `f(x)` of every element of `x` (f32) for the activation `f`.
pub fn activation(f: Activation, x: &Tensor) -> Result<Tensor> {
    const OP: &str = "cuda::activation";
    let xd = f32_of(OP, x)?;
    let (y, yd) = xd.output(OP, &xd.shape, DType::F32)?;
    if let Some(config) = launch_config(OP, xd.numel, 1).map_err(xd.error(OP))? {
        let n = xd.numel as u64;
        // Checked: x and y hold n f32.
        launch!(OP, &xd, f.kernels().0, config, |l| {
            l.arg(&yd.ptr).arg(&xd.ptr).arg(&n);
        })?;
    }
    Ok(y)
}

/// The activation's backward: `grad · f'(x)` for the forward's input `x`.
pub fn activation_backward(f: Activation, x: &Tensor, grad: &Tensor) -> Result<Tensor> {
    const OP: &str = "cuda::activation_backward";
    let xd = f32_of(OP, x)?;
    let g = f32_of(OP, grad)?;
    xd.same_device(OP, &g)?;
    g.shape_is(OP, &xd.shape)?;
    let (dx, dxd) = xd.output(OP, &xd.shape, DType::F32)?;
    if let Some(config) = launch_config(OP, xd.numel, 1).map_err(xd.error(OP))? {
        let n = xd.numel as u64;
        // Checked: x, grad and dx hold n f32.
        launch!(OP, &xd, f.kernels().1, config, |l| {
            l.arg(&dxd.ptr).arg(&g.ptr).arg(&xd.ptr).arg(&n);
        })?;
    }
    Ok(dx)
}

/// Dropout's mask applied to `x` (f32), as hypershard-nn's host `Dropout`: element `i` is
/// zeroed when the tensor crate's uniform of `(seed, i)` (element `i` of
/// [`crate::RandomInit::uniform`]`(seed, 0.0, 1.0)`) is below `p`
/// and scaled by `keep_scale` otherwise (the scale rounded to f32). Every element comes from
/// its own counter, so the backward regenerates the same mask from `seed`.
pub fn dropout(x: &Tensor, seed: u64, p: f64, keep_scale: f64) -> Result<Tensor> {
    const OP: &str = "cuda::dropout";
    let xd = f32_of(OP, x)?;
    let (y, yd) = xd.output(OP, &xd.shape, DType::F32)?;
    if let Some(config) = launch_config(OP, xd.numel, 1).map_err(xd.error(OP))? {
        let n = xd.numel as u64;
        // Checked: x and y hold n f32.
        launch!(OP, &xd, DROPOUT, config, |l| {
            l.arg(&yd.ptr)
                .arg(&xd.ptr)
                .arg(&n)
                .arg(&seed)
                .arg(&p)
                .arg(&keep_scale);
        })?;
    }
    Ok(y)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_kernel_exists() {
        let all = [
            GELU,
            GELU_GRAD,
            GELU_TANH,
            GELU_TANH_GRAD,
            SILU,
            SILU_GRAD,
            DROPOUT,
        ];
        for name in all {
            assert!(KERNEL_NAMES.contains(&name), "{name}");
        }
        for f in [
            Activation::GeluExact,
            Activation::GeluTanh,
            Activation::Silu,
        ] {
            let (forward, backward) = f.kernels();
            assert!(all.contains(&forward) && all.contains(&backward), "{f:?}");
            assert_ne!(forward, backward, "{f:?}");
        }
    }
}
