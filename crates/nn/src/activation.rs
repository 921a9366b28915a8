//! Pointwise activations: ReLU, GELU (exact and tanh), SiLU.

use std::f64::consts::{FRAC_1_SQRT_2, PI};

use hypershard_tensor::Tensor;

use crate::elementwise::{map, zip_map};
use crate::module::{ParamVisitor, ParamVisitorMut};
use crate::special::erf;
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

fn sqrt_2_over_pi() -> f64 {
    (2.0 / PI).sqrt()
}

fn gelu_exact(x: f64) -> f64 {
    0.5 * x * (1.0 + erf(x * FRAC_1_SQRT_2))
}

fn gelu_exact_grad(x: f64) -> f64 {
    let cdf = 0.5 * (1.0 + erf(x * FRAC_1_SQRT_2));
    let pdf = (-0.5 * x * x).exp() / (2.0 * PI).sqrt();
    cdf + x * pdf
}

fn gelu_tanh(x: f64) -> f64 {
    let inner = sqrt_2_over_pi() * (x + GELU_TANH_COEFF * x * x * x);
    0.5 * x * (1.0 + inner.tanh())
}

fn gelu_tanh_grad(x: f64) -> f64 {
    let inner = sqrt_2_over_pi() * (x + GELU_TANH_COEFF * x * x * x);
    let t = inner.tanh();
    let d_inner = sqrt_2_over_pi() * (1.0 + 3.0 * GELU_TANH_COEFF * x * x);
    0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * d_inner
}

fn sigmoid(x: f64) -> f64 {
    1.0 / (1.0 + (-x).exp())
}

/// Implements the parameterless parts of `Module` for an activation whose input is cached in
/// `self.input`.
macro_rules! activation_module {
    ($ty:ty, $kind:literal, |$this:ident, $x:ident| $fwd:expr, |$this2:ident, $xb:ident, $g:ident| $bwd:expr) => {
        impl Module for $ty {
            fn kind(&self) -> &'static str {
                $kind
            }

            fn forward(&mut self, input: &Tensor) -> Result<Tensor> {
                let $this = &*self;
                let output = map($kind, input, |$x| $fwd)?;
                self.input = Some(input.clone());
                Ok(output)
            }

            fn backward(&mut self, grad_output: &Tensor) -> Result<Tensor> {
                let input = self
                    .input
                    .take()
                    .ok_or(Error::BackwardBeforeForward { module: $kind })?;
                let $this2 = &*self;
                zip_map($kind, &input, grad_output, |$xb, $g| $bwd)
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

activation_module!(
    Relu,
    "ReLU",
    |_this, x| if x > 0.0 { x } else { 0.0 },
    |_this, x, g| if x > 0.0 { g } else { 0.0 }
);

activation_module!(
    Gelu,
    "GELU",
    |this, x| match this.approximation {
        GeluApproximation::None => gelu_exact(x),
        GeluApproximation::Tanh => gelu_tanh(x),
    },
    |this, x, g| g * match this.approximation {
        GeluApproximation::None => gelu_exact_grad(x),
        GeluApproximation::Tanh => gelu_tanh_grad(x),
    }
);

activation_module!(Silu, "SiLU", |_this, x| x * sigmoid(x), |_this, x, g| {
    let s = sigmoid(x);
    g * s * (1.0 + x * (1.0 - s))
});

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn closed_form_values() {
        // gelu(1) = 0.5 (1 + erf(1/√2)) = Φ(1) = 0.8413447460685429.
        assert!((gelu_exact(1.0) - 0.841_344_746_068_542_9).abs() < 1e-15);
        assert!((gelu_exact(-1.0) + 0.158_655_253_931_457_05).abs() < 1e-15);
        // torch.nn.functional.gelu(1.0, approximate="tanh") = 0.8411919906082768.
        assert!((gelu_tanh(1.0) - 0.841_191_990_608_276_8).abs() < 1e-15);
        assert!((sigmoid(0.0) - 0.5).abs() < 1e-16);
    }
}
