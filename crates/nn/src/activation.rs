//! Pointwise activations: ReLU, GELU (exact and tanh), SiLU.

use std::f64::consts::{FRAC_1_SQRT_2, PI};

use hypershard_tensor::{DType, Device, Tensor};

use crate::kernels::vector_isa::vectorized;
use crate::kernels::{
    Float, POINTWISE_CHUNK, build_overwrite, in_parallel_chunks, overwrite_target, same_device,
    with_float, with_values, with_values2,
};
use crate::module::{ParamVisitor, ParamVisitorMut};
use crate::{Error, Module, Result};

/// `max(x, 0)`; the gradient at 0 is 0, as in torch.
#[derive(Debug, Default)]
pub struct Relu {
    saved: Option<Saved>,
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
///
/// Forward keeps `f'(x)` for backward rather than `x` when the tensor is in its own compute
/// type (f32, f64) on the host: the derivative shares most of its work with the value (GELU's
/// `erf` already evaluates the Gaussian its derivative needs), so forward computes both in one
/// pass and backward is a multiply, bit for bit the values of computing `f'(x)` there. Where
/// the dtype is narrower than the compute type (bf16, f16) or on a device, it keeps `x`, as
/// rounding `f'(x)` to the narrow type would change the gradient.
#[derive(Debug, Default)]
pub struct Gelu {
    approximation: GeluApproximation,
    saved: Option<Saved>,
}

impl Gelu {
    /// A GELU with the given formula.
    pub fn new(approximation: GeluApproximation) -> Self {
        Gelu {
            approximation,
            saved: None,
        }
    }
}

/// `x · σ(x)` (also called swish). Keeps `f'(x)` for backward as [`Gelu`] does.
#[derive(Debug, Default)]
pub struct Silu {
    saved: Option<Saved>,
}

/// What an activation's forward keeps for its backward.
#[derive(Debug)]
enum Saved {
    /// The input `x`.
    Input(Tensor),
    /// The derivative `f'(x)`, computed with the output.
    Derivative(Tensor),
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
    /// Whether forward keeps `f'(x)` rather than `x` where it can (see [`apply_saving`]):
    /// worth it where the derivative shares work with the value, not for ReLU, whose
    /// derivative is a comparison.
    const KEEPS_DERIVATIVE: bool;

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

    /// `out = f(xs)` and `derivatives = f'(xs)` over slices of one length (see
    /// [`values`](Pointwise::values)); each bit for bit what `values` and
    /// [`grads`](Pointwise::grads) compute.
    #[inline(always)]
    fn values_and_derivatives<F: Float>(&self, xs: &[F], out: &mut [F], derivatives: &mut [F]) {
        for ((o, d), &x) in out.iter_mut().zip(derivatives.iter_mut()).zip(xs) {
            *o = self.value(x);
            *d = self.derivative(x);
        }
    }

    /// `out = gs · f'(xs)` over slices of one length (see [`values`](Pointwise::values)).
    #[inline(always)]
    fn grads<F: Float>(&self, xs: &[F], gs: &[F], out: &mut [F]) {
        for ((o, &x), &g) in out.iter_mut().zip(xs).zip(gs) {
            *o = g * self.derivative(x);
        }
    }
}

/// `x · Φ(x)` with `Φ(x) = (1 + erf(x/√2)) / 2`.
#[inline(always)]
fn gelu_exact<F: Float>(x: F) -> F {
    let (one_plus_erf, _) = (x * F::of(FRAC_1_SQRT_2)).one_plus_erf_and_gauss();
    F::of(0.5) * x * one_plus_erf
}

/// `Φ(x) + x · φ(x)`.
#[inline(always)]
fn gelu_exact_grad<F: Float>(x: F) -> F {
    gelu_exact_and_grad(x).1
}

/// [`gelu_exact`] and [`gelu_exact_grad`] (bit for bit each) from one `erf` evaluation: `e^(−z²)`
/// at `z = x/√2` is `e^(−x²/2)`, the density's exponential.
#[inline(always)]
fn gelu_exact_and_grad<F: Float>(x: F) -> (F, F) {
    let half = F::of(0.5);
    let (one_plus_erf, gauss) = (x * F::of(FRAC_1_SQRT_2)).one_plus_erf_and_gauss();
    let value = half * x * one_plus_erf;
    let cdf = half * one_plus_erf;
    let pdf = gauss * F::of(INV_SQRT_2PI);
    (value, cdf + x * pdf)
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
    const KEEPS_DERIVATIVE: bool = false;

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
    const KEEPS_DERIVATIVE: bool = true;

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
    fn values_and_derivatives<F: Float>(&self, xs: &[F], out: &mut [F], derivatives: &mut [F]) {
        match self.approximation {
            GeluApproximation::None => {
                let lanes = out.iter_mut().zip(derivatives.iter_mut()).zip(xs);
                for ((o, d), &x) in lanes {
                    (*o, *d) = gelu_exact_and_grad(x);
                }
            }
            GeluApproximation::Tanh => {
                let lanes = out.iter_mut().zip(derivatives.iter_mut()).zip(xs);
                for ((o, d), &x) in lanes {
                    *o = gelu_tanh(x);
                    *d = gelu_tanh_grad(x);
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
    const KEEPS_DERIVATIVE: bool = true;

    #[cfg(feature = "cuda")]
    fn cuda(&self, _op: &'static str, x: &Tensor, grad: Option<&Tensor>) -> Result<Tensor> {
        use crate::kernels::cuda::{Activation, activation, activation_backward};
        Ok(match grad {
            None => activation(Activation::Silu, x)?,
            Some(grad) => activation_backward(Activation::Silu, x, grad)?,
        })
    }

    #[inline(always)]
    fn values_and_derivatives<F: Float>(&self, xs: &[F], out: &mut [F], derivatives: &mut [F]) {
        for ((o, d), &x) in out.iter_mut().zip(derivatives.iter_mut()).zip(xs) {
            let s = sigmoid(x);
            *o = x * s;
            *d = s * (F::ONE + x * (F::ONE - s));
        }
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

/// Checks that `grad` has the shape, dtype and device of `saved` (the input or the kept
/// derivative); returns that device.
fn check_gradient(op: &'static str, saved: &Tensor, grad: &Tensor) -> Result<Device> {
    if saved.shape() != grad.shape() {
        return Err(Error::ShapeMismatch {
            op,
            lhs: saved.shape().to_vec(),
            rhs: grad.shape().to_vec(),
        });
    }
    if saved.dtype() != grad.dtype() {
        return Err(Error::DTypeMismatch {
            op,
            lhs: saved.dtype(),
            rhs: grad.dtype(),
        });
    }
    same_device(op, &[saved, grad])
}

/// `g · f'(x)` for every element, checking that `grad` matches `input`.
fn apply_grad<P: Pointwise>(
    op: &'static str,
    f: &P,
    input: &Tensor,
    grad: &Tensor,
) -> Result<Tensor> {
    let device = check_gradient(op, input, grad)?;
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

/// `f(x)` for every element of `input`, with what backward needs: `f'(x)` where the function
/// keeps it and `input` is in its compute type on the host (computed in the same pass), else
/// `input` itself.
fn apply_saving<P: Pointwise>(op: &'static str, f: &P, input: &Tensor) -> Result<(Tensor, Saved)> {
    let device = input.device();
    // f32 and f64 are their own compute types; bf16 and f16 compute in f32.
    let keeps_derivative =
        P::KEEPS_DERIVATIVE && device.is_cpu() && matches!(input.dtype(), DType::F32 | DType::F64);
    if !keeps_derivative {
        return Ok((apply(op, f, input)?, Saved::Input(input.clone())));
    }
    with_float!(op, input.dtype(), F => {
        let output = overwrite_target::<F>(input.shape(), &device)?;
        let derivative = overwrite_target::<F>(input.shape(), &device)?;
        output.with_kernel_data_mut::<F, _>(op, |out| {
            derivative.with_kernel_data_mut::<F, _>(op, |ds| {
                with_values::<F, _>(input, |xs| values_and_derivatives_in_parallel(f, xs, out, ds))
            })
        })???;
        Ok((output, Saved::Derivative(derivative)))
    })
}

/// [`Pointwise::values_and_derivatives`] over whole slices, in chunks on every thread.
fn values_and_derivatives_in_parallel<P: Pointwise, F: Float>(
    f: &P,
    xs: &[F],
    out: &mut [F],
    derivatives: &mut [F],
) {
    if out.len() <= POINTWISE_CHUNK {
        vectorized!(|| f.values_and_derivatives(xs, out, derivatives));
        return;
    }
    use rayon::prelude::*;
    out.par_chunks_mut(POINTWISE_CHUNK)
        .zip(derivatives.par_chunks_mut(POINTWISE_CHUNK))
        .zip(xs.par_chunks(POINTWISE_CHUNK))
        .for_each(|((out, ds), xs)| vectorized!(|| f.values_and_derivatives(xs, out, ds)));
}

/// `g · f'(x)` for every element from what [`apply_saving`] kept.
fn apply_grad_saved<P: Pointwise>(
    op: &'static str,
    f: &P,
    saved: &Saved,
    grad: &Tensor,
) -> Result<Tensor> {
    let derivative = match saved {
        Saved::Input(input) => return apply_grad(op, f, input, grad),
        Saved::Derivative(derivative) => derivative,
    };
    let device = check_gradient(op, derivative, grad)?;
    with_float!(op, grad.dtype(), F => {
        build_overwrite::<F>(grad.shape(), grad.dtype(), &device, |out| {
            with_values2::<F, _>(derivative, grad, |ds, gs| {
                in_parallel_chunks(out, |start, out| {
                    let end = start + out.len();
                    vectorized!(|| multiply(&ds[start..end], &gs[start..end], out))
                })
            })
        })
    })
}

/// `out = a · b` elementwise.
#[inline(always)]
fn multiply<F: Float>(a: &[F], b: &[F], out: &mut [F]) {
    for ((o, &x), &y) in out.iter_mut().zip(a).zip(b) {
        *o = x * y;
    }
}

/// Implements `Module` for an activation that keeps what [`apply_saving`] returns in
/// `self.saved`.
macro_rules! activation_module {
    ($ty:ty, $kind:literal) => {
        impl Module for $ty {
            fn kind(&self) -> &'static str {
                $kind
            }

            fn forward(&mut self, input: &Tensor) -> Result<Tensor> {
                let (output, saved) = apply_saving($kind, &*self, input)?;
                self.saved = Some(saved);
                Ok(output)
            }

            fn backward(&mut self, grad_output: &Tensor) -> Result<Tensor> {
                let saved = self
                    .saved
                    .take()
                    .ok_or(Error::BackwardBeforeForward { module: $kind })?;
                apply_grad_saved($kind, &*self, &saved, grad_output)
            }

            fn clear_cache(&mut self) -> Result<()> {
                self.saved = None;
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

    /// Forward then backward through the module, as f32 values.
    fn module_round_trip(
        module: &mut dyn Module,
        input: &Tensor,
        grad: &Tensor,
    ) -> (Vec<f32>, Vec<f32>) {
        let y = module.forward(input).expect("forward");
        let g = module.backward(grad).expect("backward");
        (
            y.to_dtype(DType::F32)
                .expect("f32")
                .to_vec::<f32>()
                .expect("f32"),
            g.to_dtype(DType::F32)
                .expect("f32")
                .to_vec::<f32>()
                .expect("f32"),
        )
    }

    #[test]
    fn modules_keeping_the_derivative_match_the_formulas_bit_for_bit() {
        // Over several chunks, so the two-output pass crosses task boundaries too.
        let n = 2 * crate::kernels::POINTWISE_CHUNK + 301;
        let xs: Vec<f32> = (0..n).map(|i| (i % 977) as f32 * 0.013 - 6.3).collect();
        let gs: Vec<f32> = (0..n).map(|i| (i % 41) as f32 * 0.07 - 1.4).collect();
        let input = Tensor::from_slice(&xs, &[n]).expect("input");
        let grad = Tensor::from_slice(&gs, &[n]).expect("grad");
        let mut exact = Gelu::new(GeluApproximation::None);
        let mut tanh = Gelu::new(GeluApproximation::Tanh);
        let mut silu = Silu::new();
        // Each case: the module, and its value and derivative at a point.
        type Case<'a> = (&'a mut dyn Module, &'a dyn Fn(f32) -> (f32, f32));
        for threads in [1, 2] {
            crate::with_num_threads(threads, || {
                let cases: [Case<'_>; 3] = [
                    (&mut exact, &|x| (gelu_exact(x), gelu_exact_grad(x))),
                    (&mut tanh, &|x| (gelu_tanh(x), gelu_tanh_grad(x))),
                    (&mut silu, &|x| {
                        let silu = Silu::new();
                        (silu.value(x), silu.derivative(x))
                    }),
                ];
                for (module, formulas) in cases {
                    let (values, grads) = module_round_trip(module, &input, &grad);
                    for i in 0..n {
                        let (value, derivative) = formulas(xs[i]);
                        assert_eq!(values[i].to_bits(), value.to_bits(), "value {i}");
                        let want = gs[i] * derivative;
                        assert_eq!(grads[i].to_bits(), want.to_bits(), "grad {i}");
                    }
                }
            })
            .expect("pool");
        }
        // An f32 forward keeps the derivative; backward takes it, leaving nothing behind.
        let mut gelu = Gelu::default();
        gelu.forward(&input).expect("forward");
        assert!(matches!(gelu.saved, Some(Saved::Derivative(_))));
        gelu.backward(&grad).expect("backward");
        assert!(gelu.saved.is_none());
        assert!(matches!(
            gelu.backward(&grad),
            Err(Error::BackwardBeforeForward { module: "GELU" })
        ));
        // ReLU's derivative is a comparison: it keeps its input.
        let mut relu = Relu::new();
        relu.forward(&input).expect("forward");
        assert!(matches!(relu.saved, Some(Saved::Input(_))));
    }

    #[test]
    fn narrow_dtypes_keep_the_input_and_round_once() {
        let xs: Vec<f32> = (0..300).map(|i| i as f32 * 0.03 - 4.5).collect();
        let gs: Vec<f32> = (0..300).map(|i| (i % 13) as f32 * 0.25 - 1.5).collect();
        let input = Tensor::from_slice(&xs, &[300])
            .and_then(|t| t.to_dtype(DType::BF16))
            .expect("input");
        let grad = Tensor::from_slice(&gs, &[300])
            .and_then(|t| t.to_dtype(DType::BF16))
            .expect("grad");
        let mut gelu = Gelu::default();
        let (_, grads) = {
            let y = gelu.forward(&input).expect("forward");
            // Rounding f'(x) to bf16 would change the gradient: the input is kept instead.
            assert!(matches!(gelu.saved, Some(Saved::Input(_))));
            let g = gelu.backward(&grad).expect("backward");
            (
                y,
                g.to_dtype(DType::F32)
                    .expect("f32")
                    .to_vec::<f32>()
                    .expect("f32"),
            )
        };
        let x_rounded = input
            .to_dtype(DType::F32)
            .expect("f32")
            .to_vec::<f32>()
            .expect("f32");
        let g_rounded = grad
            .to_dtype(DType::F32)
            .expect("f32")
            .to_vec::<f32>()
            .expect("f32");
        for i in 0..300 {
            // g · f'(x) in f32 from the bf16 operands, rounded once to bf16.
            let want = Tensor::from_slice(&[g_rounded[i] * gelu_exact_grad(x_rounded[i])], &[1])
                .and_then(|t| t.to_dtype(DType::BF16))
                .and_then(|t| t.to_dtype(DType::F32))
                .and_then(|t| t.to_vec::<f32>())
                .expect("round");
            assert_eq!(grads[i].to_bits(), want[0].to_bits(), "grad {i}");
        }
    }

    #[test]
    fn a_gradient_of_the_wrong_shape_is_a_typed_error() {
        let input = Tensor::from_slice(&[0.5f32, -1.0, 2.0], &[3]).expect("input");
        let grad = Tensor::from_slice(&[1.0f32, 1.0], &[2]).expect("grad");
        let mut silu = Silu::new();
        silu.forward(&input).expect("forward");
        assert!(matches!(
            silu.backward(&grad),
            Err(Error::ShapeMismatch { op: "SiLU", .. })
        ));
    }
}
