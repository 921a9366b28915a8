//! Pointwise activations: ReLU, GELU (exact and tanh), SiLU.

use std::f64::consts::{FRAC_1_SQRT_2, PI};

use hypershard_tensor::Tensor;

use crate::kernels::vector_isa::vectorized;
use crate::kernels::{
    Float, build_overwrite, in_parallel_chunks, same_device, with_float, with_values, with_values2,
};
use crate::module::{ParamVisitor, ParamVisitorMut};
use crate::{Error, Module, Result};

/// `max(x, 0)`; the gradient at 0 is 0, as in torch.
#[derive(Debug, Default)]
pub struct Relu {
    input: Option<Tensor>,
}

impl Relu {
    /// A ReLU.
    pub fn new() -> Self {
        Relu::default()
    }
}

/// Which formula [`Gelu`] uses (torch's `approximate="none"` / `"tanh"`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum GeluApproximation {
    /// `x · Φ(x)` with the exact normal CDF.
    #[default]
    None,
    /// `0.5 x (1 + tanh(√(2/π) (x + 0.044715 x³)))`.
    Tanh,
}

/// The Gaussian error linear unit.
#[derive(Debug, Default)]
pub struct Gelu {
    approximation: GeluApproximation,
    input: Option<Tensor>,
}

impl Gelu {
    /// A GELU with the given formula.
    pub fn new(approximation: GeluApproximation) -> Self {
        Gelu {
            approximation,
            input: None,
        }
    }
}

/// `x · σ(x)` (also called swish).
#[derive(Debug, Default)]
pub struct Silu {
    input: Option<Tensor>,
}

impl Silu {
    /// A SiLU.
    pub fn new() -> Self {
        Silu::default()
    }
}

const GELU_TANH_COEFF: f64 = 0.044_715;
/// `1/√(2π)`, the standard normal density at 0.
const INV_SQRT_2PI: f64 = 0.398_942_280_401_432_7;

/// `√(2/π)`.
fn sqrt_2_over_pi() -> f64 {
    (2.0 / PI).sqrt()
}

/// A pointwise function and its derivative, generic over the compute type so one definition
/// serves the f64 reference path and the vectorised f32 path.
trait Pointwise: Sync {
    /// `f(x)`.
    fn value<F: Float>(&self, x: F) -> F;
    /// `f'(x)`.
    fn derivative<F: Float>(&self, x: F) -> F;

    /// `out = f(xs)` over slices of one length. A formula chosen by a runtime field (GELU's
    /// approximation) is chosen once here, outside the loop, so the loop body is branch-free
    /// and vectorises.
    #[inline(always)]
    fn values<F: Float>(&self, xs: &[F], out: &mut [F]) {
        for (o, &x) in out.iter_mut().zip(xs) {
            *o = self.value(x);
        }
    }

    /// `f(x)` (or, with `grad`, `grad · f'(x)`) on a CUDA device: the kernel of this
    /// function, or [`DeviceUnsupported`](hypershard_tensor::Error::DeviceUnsupported) naming
    /// `op` where it has none.
    #[cfg(feature = "cuda")]
    fn cuda(&self, op: &'static str, x: &Tensor, _grad: Option<&Tensor>) -> Result<Tensor> {
        Err(hypershard_tensor::Error::DeviceUnsupported {
            op,
            device: x.device(),
        }
        .into())
    }

    /// `out = gs · f'(xs)` over slices of one length (see [`values`](Pointwise::values)).
    #[inline(always)]
    fn grads<F: Float>(&self, xs: &[F], gs: &[F], out: &mut [F]) {
        for ((o, &x), &g) in out.iter_mut().zip(xs).zip(gs) {
            *o = g * self.derivative(x);
        }
    }
}

#[inline(always)]
fn gelu_exact<F: Float>(x: F) -> F {
    let half = F::of(0.5);
    half * x * (F::ONE + (x * F::of(FRAC_1_SQRT_2)).erf())
}

#[inline(always)]
fn gelu_exact_grad<F: Float>(x: F) -> F {
    let half = F::of(0.5);
    // `e^(−z²)` at `z = x/√2` is `e^(−x²/2)`, the density's exponential: one for both.
    let (erf, gauss) = (x * F::of(FRAC_1_SQRT_2)).erf_and_gauss();
    let cdf = half * (F::ONE + erf);
    let pdf = gauss * F::of(INV_SQRT_2PI);
    cdf + x * pdf
}

#[inline(always)]
fn gelu_tanh<F: Float>(x: F) -> F {
    let inner = F::of(sqrt_2_over_pi()) * (x + F::of(GELU_TANH_COEFF) * x * x * x);
    F::of(0.5) * x * (F::ONE + inner.tanh())
}

#[inline(always)]
fn gelu_tanh_grad<F: Float>(x: F) -> F {
    let c = F::of(sqrt_2_over_pi());
    let coeff = F::of(GELU_TANH_COEFF);
    let half = F::of(0.5);
    let t = (c * (x + coeff * x * x * x)).tanh();
    let d_inner = c * (F::ONE + F::of(3.0) * coeff * x * x);
    half * (F::ONE + t) + half * x * (F::ONE - t * t) * d_inner
}

#[inline]
fn sigmoid<F: Float>(x: F) -> F {
    F::ONE / (F::ONE + (-x).exp())
}

impl Pointwise for Relu {
    #[cfg(feature = "cuda")]
    fn cuda(&self, _op: &'static str, x: &Tensor, grad: Option<&Tensor>) -> Result<Tensor> {
        match grad {
            None => crate::kernels::cuda::relu(x),
            Some(grad) => crate::kernels::cuda::relu_backward(x, grad),
        }
    }

    fn value<F: Float>(&self, x: F) -> F {
        if x > F::ZERO { x } else { F::ZERO }
    }
    fn derivative<F: Float>(&self, x: F) -> F {
        if x > F::ZERO { F::ONE } else { F::ZERO }
    }
}

impl Pointwise for Gelu {
    #[cfg(feature = "cuda")]
    fn cuda(&self, _op: &'static str, x: &Tensor, grad: Option<&Tensor>) -> Result<Tensor> {
        use crate::kernels::cuda::{Activation, activation, activation_backward};
        let f = match self.approximation {
            GeluApproximation::None => Activation::GeluExact,
            GeluApproximation::Tanh => Activation::GeluTanh,
        };
        Ok(match grad {
            None => activation(f, x)?,
            Some(grad) => activation_backward(f, x, grad)?,
        })
    }

    #[inline(always)]
    fn values<F: Float>(&self, xs: &[F], out: &mut [F]) {
        // `for` loops rather than `for_each` closures: a closure would be one function shared
        // by the vector trampolines, compiled for none of them (`kernels::vector_isa`).
        match self.approximation {
            GeluApproximation::None => {
                for (o, &x) in out.iter_mut().zip(xs) {
                    *o = gelu_exact(x);
                }
            }
            GeluApproximation::Tanh => {
                for (o, &x) in out.iter_mut().zip(xs) {
                    *o = gelu_tanh(x);
                }
            }
        }
    }

    #[inline(always)]
    fn grads<F: Float>(&self, xs: &[F], gs: &[F], out: &mut [F]) {
        match self.approximation {
            GeluApproximation::None => {
                for ((o, &x), &g) in out.iter_mut().zip(xs).zip(gs) {
                    *o = g * gelu_exact_grad(x);
                }
            }
            GeluApproximation::Tanh => {
                for ((o, &x), &g) in out.iter_mut().zip(xs).zip(gs) {
                    *o = g * gelu_tanh_grad(x);
                }
            }
        }
    }

    fn value<F: Float>(&self, x: F) -> F {
        match self.approximation {
            GeluApproximation::None => gelu_exact(x),
            GeluApproximation::Tanh => gelu_tanh(x),
        }
    }
    fn derivative<F: Float>(&self, x: F) -> F {
        match self.approximation {
            GeluApproximation::None => gelu_exact_grad(x),
            GeluApproximation::Tanh => gelu_tanh_grad(x),
        }
    }
}

impl Pointwise for Silu {
    #[cfg(feature = "cuda")]
    fn cuda(&self, _op: &'static str, x: &Tensor, grad: Option<&Tensor>) -> Result<Tensor> {
        use crate::kernels::cuda::{Activation, activation, activation_backward};
        Ok(match grad {
            None => activation(Activation::Silu, x)?,
            Some(grad) => activation_backward(Activation::Silu, x, grad)?,
        })
    }

    fn value<F: Float>(&self, x: F) -> F {
        x * sigmoid(x)
    }
    fn derivative<F: Float>(&self, x: F) -> F {
        let s = sigmoid(x);
        s * (F::ONE + x * (F::ONE - s))
    }
}

/// `f(x)` for every element of `input`, in the compute type of its dtype.
fn apply<P: Pointwise>(op: &'static str, f: &P, input: &Tensor) -> Result<Tensor> {
    let device = input.device();
    #[cfg(feature = "cuda")]
    if device.is_cuda() {
        return f.cuda(op, input, None);
    }
    with_float!(op, input.dtype(), F => {
        build_overwrite::<F>(input.shape(), input.dtype(), &device, |out| {
            with_values::<F, _>(input, |xs| {
                in_parallel_chunks(out, |start, out| {
                    vectorized!(|| f.values(&xs[start..start + out.len()], out))
                })
            })
        })
    })
}

/// `g · f'(x)` for every element, checking that `grad` matches `input`.
fn apply_grad<P: Pointwise>(
    op: &'static str,
    f: &P,
    input: &Tensor,
    grad: &Tensor,
) -> Result<Tensor> {
    if input.shape() != grad.shape() {
        return Err(Error::ShapeMismatch {
            op,
            lhs: input.shape().to_vec(),
            rhs: grad.shape().to_vec(),
        });
    }
    if input.dtype() != grad.dtype() {
        return Err(Error::DTypeMismatch {
            op,
            lhs: input.dtype(),
            rhs: grad.dtype(),
        });
    }
    let device = same_device(op, &[input, grad])?;
    #[cfg(feature = "cuda")]
    if device.is_cuda() {
        return f.cuda(op, input, Some(grad));
    }
    with_float!(op, input.dtype(), F => {
        build_overwrite::<F>(input.shape(), input.dtype(), &device, |out| {
            with_values2::<F, _>(input, grad, |xs, gs| {
                in_parallel_chunks(out, |start, out| {
                    let end = start + out.len();
                    vectorized!(|| f.grads(&xs[start..end], &gs[start..end], out))
                })
            })
        })
    })
}

/// Implements `Module` for an activation whose input is cached in `self.input`.
macro_rules! activation_module {
    ($ty:ty, $kind:literal) => {
        impl Module for $ty {
            fn kind(&self) -> &'static str {
                $kind
            }

            fn forward(&mut self, input: &Tensor) -> Result<Tensor> {
                let output = apply($kind, &*self, input)?;
                self.input = Some(input.clone());
                Ok(output)
            }

            fn backward(&mut self, grad_output: &Tensor) -> Result<Tensor> {
                let input = self
                    .input
                    .take()
                    .ok_or(Error::BackwardBeforeForward { module: $kind })?;
                apply_grad($kind, &*self, &input, grad_output)
            }

            fn clear_cache(&mut self) -> Result<()> {
                self.input = None;
                Ok(())
            }

            fn visit_params(&self, _prefix: &str, _f: &mut ParamVisitor<'_>) -> Result<()> {
                Ok(())
            }

            fn visit_params_mut(
                &mut self,
                _prefix: &str,
                _f: &mut ParamVisitorMut<'_>,
            ) -> Result<()> {
                Ok(())
            }
        }
    };
}

activation_module!(Relu, "ReLU");
activation_module!(Gelu, "GELU");
activation_module!(Silu, "SiLU");

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn closed_form_values() {
        // gelu(1) = 0.5 (1 + erf(1/√2)) = Φ(1) = 0.8413447460685429.
        assert!((gelu_exact(1.0f64) - 0.841_344_746_068_542_9).abs() < 1e-15);
        assert!((gelu_exact(-1.0f64) + 0.158_655_253_931_457_05).abs() < 1e-15);
        // torch.nn.functional.gelu(1.0, approximate="tanh") = 0.8411919906082768.
        assert!((gelu_tanh(1.0f64) - 0.841_191_990_608_276_8).abs() < 1e-15);
        assert!((sigmoid(0.0f64) - 0.5).abs() < 1e-16);
    }

    #[test]
    fn large_tensors_split_over_threads_give_each_element_its_own_value() {
        // Three and a bit chunks, so the last task is short and every task boundary is crossed.
        let n = 3 * crate::kernels::POINTWISE_CHUNK + 77;
        let xs: Vec<f32> = (0..n).map(|i| (i % 601) as f32 * 0.01 - 3.0).collect();
        let gs: Vec<f32> = (0..n).map(|i| (i % 37) as f32 * 0.1 - 1.5).collect();
        let input = Tensor::from_slice(&xs, &[n]).expect("input");
        let grad = Tensor::from_slice(&gs, &[n]).expect("grad");
        for approximation in [GeluApproximation::None, GeluApproximation::Tanh] {
            let gelu = Gelu::new(approximation);
            for threads in [1, 2, 3] {
                let (values, grads) = crate::with_num_threads(threads, || {
                    let v = apply("Gelu", &gelu, &input).expect("values");
                    let g = apply_grad("Gelu", &gelu, &input, &grad).expect("grads");
                    (
                        v.to_vec::<f32>().expect("f32"),
                        g.to_vec::<f32>().expect("f32"),
                    )
                })
                .expect("pool");
                for i in 0..n {
                    assert_eq!(
                        values[i].to_bits(),
                        gelu.value(xs[i]).to_bits(),
                        "value {i}"
                    );
                    let want = gs[i] * gelu.derivative(xs[i]);
                    assert_eq!(grads[i].to_bits(), want.to_bits(), "grad {i}");
                }
            }
        }
    }

    #[test]
    fn f32_kernels_match_the_f64_reference() {
        let exact = Gelu::new(GeluApproximation::None);
        let tanh = Gelu::new(GeluApproximation::Tanh);
        let silu = Silu::new();
        let mut x = -8.0f32;
        while x < 8.0 {
            let x64 = f64::from(x);
            let pairs = [
                (exact.value(x), exact.value(x64)),
                (exact.derivative(x), exact.derivative(x64)),
                (tanh.value(x), tanh.value(x64)),
                (tanh.derivative(x), tanh.derivative(x64)),
                (silu.value(x), silu.value(x64)),
                (silu.derivative(x), silu.derivative(x64)),
            ];
            for (index, (got, want)) in pairs.into_iter().enumerate() {
                let err = (f64::from(got) - want).abs();
                assert!(
                    err < 2e-6 * (1.0 + want.abs()),
                    "{index} at {x}: {got} vs {want}"
                );
            }
            x += 0.0173;
        }
    }
}
