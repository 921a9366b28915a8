//! `Linear`: `y = x Wᵀ + b` with torch's names, shapes and default initialisation.

use hypershard_tensor::{DType, RandomInit, Tensor};

use crate::elementwise::check_float;
use crate::kernels::{
    Float, add_row, build_overwrite, load, same_device, small_nn_rows, store, sum_rows, with_float,
    with_values, with_values2,
};
use crate::linalg::{GemmShape, MatmulOptions, gemm_bias_into, gemm_into};
use crate::module::{ParamVisitor, ParamVisitorMut, join_name};
use crate::{Error, Module, Parameter, Result};

/// How to build a [`Linear`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LinearConfig {
    /// The size of the last input dim.
    pub in_features: usize,
    /// The size of the last output dim.
    pub out_features: usize,
    /// Whether the layer has a bias (torch's default: true).
    pub bias: bool,
    /// The parameters' dtype.
    pub dtype: DType,
    /// The seed of the weight; the bias uses `seed + 1`, so distinct layers need seeds at least
    /// two apart.
    pub seed: u64,
}

/// A fully connected layer: `weight` is `[out_features, in_features]`, `bias` `[out_features]`.
///
/// Both are initialised as torch does, from `U(-1/√in, 1/√in)` (torch's
/// `kaiming_uniform_(a=√5)` for the weight reduces to this bound), drawn from the tensor
/// crate's counter-based generator, so values depend only on the seed, not on torch's RNG.
/// Inputs may have any number of leading dims: `[*, in] → [*, out]`.
#[derive(Debug)]
pub struct Linear {
    /// The weight, `[out_features, in_features]`.
    pub weight: Parameter,
    /// The bias, `[out_features]`, if any.
    pub bias: Option<Parameter>,
    in_features: usize,
    out_features: usize,
    input: Option<Tensor>,
}

impl Linear {
    /// A layer initialised as torch's `nn.Linear`.
    pub fn new(config: LinearConfig) -> Result<Self> {
        check_float("Linear::new", config.dtype)?;
        let weight_shape = [config.out_features, config.in_features];
        let bias_shape = [config.out_features];
        // torch draws from U(-1/sqrt(fan_in), 1/sqrt(fan_in)); with fan_in = 0 the weight is
        // empty and the bound is 0, so the bias is all zeros.
        let (weight, bias) = if config.in_features == 0 {
            let bias = config
                .bias
                .then(|| Tensor::zeros(&bias_shape, config.dtype))
                .transpose()?;
            (Tensor::zeros(&weight_shape, config.dtype)?, bias)
        } else {
            let bound = 1.0 / (config.in_features as f64).sqrt();
            let weight = Tensor::random(
                &weight_shape,
                config.dtype,
                RandomInit::uniform(config.seed, -bound, bound),
            )?;
            let bias = config
                .bias
                .then(|| {
                    Tensor::random(
                        &bias_shape,
                        config.dtype,
                        RandomInit::uniform(config.seed.wrapping_add(1), -bound, bound),
                    )
                })
                .transpose()?;
            (weight, bias)
        };
        Linear::from_tensors(weight, bias)
    }

    /// A layer with the given weight `[out, in]` and optional bias `[out]`.
    pub fn from_tensors(weight: Tensor, bias: Option<Tensor>) -> Result<Self> {
        check_float("Linear::from_tensors", weight.dtype())?;
        let [out_features, in_features] = weight.shape() else {
            return Err(Error::BadShape {
                op: "Linear::from_tensors",
                expected: "a 2-D weight [out, in]".to_string(),
                actual: weight.shape().to_vec(),
            });
        };
        let (out_features, in_features) = (*out_features, *in_features);
        if let Some(b) = &bias {
            if b.shape() != [out_features] {
                return Err(Error::ShapeMismatch {
                    op: "Linear::from_tensors",
                    lhs: weight.shape().to_vec(),
                    rhs: b.shape().to_vec(),
                });
            }
            if b.dtype() != weight.dtype() {
                return Err(Error::DTypeMismatch {
                    op: "Linear::from_tensors",
                    lhs: weight.dtype(),
                    rhs: b.dtype(),
                });
            }
        }
        Ok(Linear {
            weight: Parameter::new("weight", weight),
            bias: bias.map(|b| Parameter::new("bias", b)),
            in_features,
            out_features,
            input: None,
        })
    }

    /// The size of the last input dim.
    pub fn in_features(&self) -> usize {
        self.in_features
    }

    /// The size of the last output dim.
    pub fn out_features(&self) -> usize {
        self.out_features
    }

    /// Views `t` as `[rows, last]`, checking that its last dim is `last`.
    fn as_matrix(&self, t: &Tensor, last: usize, what: &'static str) -> Result<Tensor> {
        if t.shape().last() != Some(&last) {
            return Err(Error::BadShape {
                op: what,
                expected: format!("[*, {last}]"),
                actual: t.shape().to_vec(),
            });
        }
        // The product of the leading dims, not numel / last, so a zero-sized last dim keeps
        // the row count.
        let rows = t.shape()[..t.ndim() - 1].iter().product::<usize>();
        Ok(t.reshape(&[rows, last])?)
    }
}

impl Linear {
    /// Accumulates the parameter gradients of one backward and returns the input's.
    fn accumulate(&mut self, grads: LinearGrads) -> Result<Tensor> {
        if let Some(grad_weight) = grads.grad_weight {
            self.weight.accumulate_grad(grad_weight)?;
        }
        if let (Some(bias), Some(grad_bias)) = (&mut self.bias, grads.grad_bias) {
            bias.accumulate_grad(grad_bias)?;
        }
        Ok(grads.grad_input)
    }
}

/// The gradients one `Linear::backward` produces.
struct LinearGrads {
    grad_input: Tensor,
    grad_weight: Option<Tensor>,
    grad_bias: Option<Tensor>,
}

impl Module for Linear {
    fn kind(&self) -> &'static str {
        "Linear"
    }

    fn forward(&mut self, input: &Tensor) -> Result<Tensor> {
        let weight = self.weight.data()?;
        if input.dtype() != weight.dtype() {
            return Err(Error::DTypeMismatch {
                op: "Linear::forward",
                lhs: weight.dtype(),
                rhs: input.dtype(),
            });
        }
        let x = self.as_matrix(input, self.in_features, "Linear::forward")?;
        let rows = x.shape()[0];
        let mut out_shape = input.shape().to_vec();
        if let Some(last) = out_shape.last_mut() {
            *last = self.out_features;
        }
        let options = MatmulOptions {
            transpose_a: false,
            transpose_b: true,
        };
        let shape = GemmShape::new(rows, self.in_features, self.out_features, options)?;
        let bias = self.bias.as_ref().map(Parameter::data).transpose()?;
        let device = match bias {
            Some(b) => same_device("Linear::forward", &[weight, input, b])?,
            None => same_device("Linear::forward", &[weight, input])?,
        };
        #[cfg(feature = "cuda")]
        if device.is_cuda() {
            let y = crate::kernels::cuda::linear_forward(&x, weight, bias, &out_shape)?;
            self.input = Some(input.clone());
            return Ok(y);
        }
        let y = with_float!("Linear::forward", weight.dtype(), F => {
            let bias = bias.map(load::<F>).transpose()?;
            build_overwrite::<F>(&out_shape, weight.dtype(), &device, |y| {
                with_values2::<F, _>(&x, weight, |xs, ws| {
                    // Few rows (a small batch): the packing-free kernel reads the weight in
                    // place, and the bias is a pass of its own; otherwise the general GEMM,
                    // which adds the bias as it stores each tile.
                    if F::small_gemm_nt(xs, ws, rows, self.in_features, self.out_features, y) {
                        if let Some(bias) = &bias {
                            add_row(y, bias);
                        }
                        Ok(())
                    } else {
                        match &bias {
                            Some(bias) => gemm_bias_into(xs, ws, shape, bias, y),
                            None => gemm_into(xs, ws, shape, y),
                        }
                    }
                })?
            })?
        });
        self.input = Some(input.clone());
        Ok(y)
    }

    fn backward(&mut self, grad_output: &Tensor) -> Result<Tensor> {
        let input = self
            .input
            .take()
            .ok_or(Error::BackwardBeforeForward { module: "Linear" })?;
        let weight = self.weight.data()?;
        if grad_output.dtype() != weight.dtype() {
            return Err(Error::DTypeMismatch {
                op: "Linear::backward",
                lhs: weight.dtype(),
                rhs: grad_output.dtype(),
            });
        }
        let gy = self.as_matrix(grad_output, self.out_features, "Linear::backward")?;
        let x = self.as_matrix(&input, self.in_features, "Linear::backward")?;
        if gy.shape()[0] != x.shape()[0] {
            return Err(Error::ShapeMismatch {
                op: "Linear::backward",
                lhs: input.shape().to_vec(),
                rhs: grad_output.shape().to_vec(),
            });
        }
        let rows = x.shape()[0];
        let (n_in, n_out) = (self.in_features, self.out_features);
        let dtype = weight.dtype();
        let device = same_device("Linear::backward", &[weight, grad_output])?;
        let weight_wants_grad = self.weight.requires_grad;
        let bias_wants_grad = self.bias.as_ref().is_some_and(|b| b.requires_grad);
        #[cfg(feature = "cuda")]
        if device.is_cuda() {
            let (grad_input, grad_weight, grad_bias) = crate::kernels::cuda::linear_backward(
                &x,
                &gy,
                weight,
                [weight_wants_grad, bias_wants_grad],
                input.shape(),
            )?;
            return self.accumulate(LinearGrads {
                grad_input,
                grad_weight,
                grad_bias,
            });
        }
        let grads = with_float!("Linear::backward", dtype, F => {
            let backward = |g: &[F]| -> Result<LinearGrads> {
                // dx = gy · W, [N, out] · [out, in].
                let dx_shape = GemmShape::new(rows, n_out, n_in, MatmulOptions::default())?;
                let grad_input = build_overwrite::<F>(input.shape(), dtype, &device, |dx| {
                    with_values::<F, _>(weight, |ws| {
                        if F::small_gemm_nn(g, ws, rows, n_out, n_in, dx)
                            || small_nn_in_row_blocks(g, ws, (rows, n_out, n_in), dx)
                        {
                            Ok(())
                        } else {
                            gemm_into(g, ws, dx_shape, dx)
                        }
                    })?
                })?;
                let grad_weight = if weight_wants_grad {
                    // dW = gyᵀ · x, [out, N] · [N, in].
                    let options = MatmulOptions {
                        transpose_a: true,
                        transpose_b: false,
                    };
                    let dw_shape = GemmShape::new(n_out, rows, n_in, options)?;
                    Some(build_overwrite::<F>(&[n_out, n_in], dtype, &device, |dw| {
                        with_values::<F, _>(&x, |xs| gemm_into(g, xs, dw_shape, dw))?
                    })?)
                } else {
                    None
                };
                let grad_bias = if bias_wants_grad {
                    Some(store(sum_rows(g, n_out), &[n_out], dtype, &device)?)
                } else {
                    None
                };
                Ok(LinearGrads {
                    grad_input,
                    grad_weight,
                    grad_bias,
                })
            };
            // The output gradient is read in place (no copy of an activation-sized tensor)
            // unless it shares storage with the weight or the input, whose read locks the
            // GEMMs take while it is held: one thread never read-locks one storage twice.
            if gy.shares_storage(weight) || gy.shares_storage(&x) {
                backward(&load::<F>(&gy)?)?
            } else {
                with_values::<F, _>(&gy, backward)??
            }
        });
        self.accumulate(grads)
    }

    fn clear_cache(&mut self) -> Result<()> {
        self.input = None;
        Ok(())
    }

    fn visit_params(&self, prefix: &str, f: &mut ParamVisitor<'_>) -> Result<()> {
        f(&join_name(prefix, "weight"), &self.weight)?;
        if let Some(bias) = &self.bias {
            f(&join_name(prefix, "bias"), bias)?;
        }
        Ok(())
    }

    fn visit_params_mut(&mut self, prefix: &str, f: &mut ParamVisitorMut<'_>) -> Result<()> {
        f(&join_name(prefix, "weight"), &mut self.weight)?;
        if let Some(bias) = &mut self.bias {
            f(&join_name(prefix, "bias"), bias)?;
        }
        Ok(())
    }
}

/// The widest `dx` (columns: the layer's input width) that [`small_nn_in_row_blocks`] takes.
/// Up to one 64-wide panel, the packing-free kernel keeps that panel of `W` in cache for every
/// block of rows and beats packing: `hypershard train --model small` (width 64) at one process
/// +10 % tok/s over three alternating pairs. At 192 columns (`medium`) it was 1–2 % slower.
const SMALL_NN_MAX_COLUMNS: usize = 64;

/// `dx[rows, n] = g[rows, k] · W[k, n]` by the packing-free kernel in row blocks spread over
/// the kernel threads ([`small_nn_rows`]), when `n` is at most [`SMALL_NN_MAX_COLUMNS`];
/// returns whether it ran, else `dx` is untouched.
fn small_nn_in_row_blocks<F: Float>(
    g: &[F],
    ws: &[F],
    (rows, k, n): (usize, usize, usize),
    dx: &mut [F],
) -> bool {
    n <= SMALL_NN_MAX_COLUMNS && small_nn_rows(g, ws, (rows, k, n), dx, true)
}

#[cfg(test)]
mod row_block_tests {
    use super::*;

    /// The blocked product is the packing GEMM's to rounding, on row counts around the blocks,
    /// declines wide outputs and f64 untouched, and runs exactly where the kernel does.
    #[test]
    fn small_nn_row_blocks_match_the_gemm_and_decline_what_they_do_not_take() {
        for &(rows, k, n) in &[
            (1, 3, 5),
            (31, 64, 64),
            (33, 17, 64),
            (200, 256, 64),
            (512, 64, 48),
        ] {
            let g: Vec<f32> = (0..rows * k)
                .map(|i| ((i * 37 % 101) as f32 - 50.0) / 64.0)
                .collect();
            let w: Vec<f32> = (0..k * n)
                .map(|i| ((i * 53 % 89) as f32 - 44.0) / 64.0)
                .collect();
            let mut want = vec![0.0f32; rows * n];
            let shape = GemmShape::new(rows, k, n, MatmulOptions::default()).unwrap();
            gemm_into(&g, &w, shape, &mut want).unwrap();
            let mut got = vec![f32::NAN; rows * n];
            let ran = small_nn_in_row_blocks(&g, &w, (rows, k, n), &mut got);
            assert_eq!(
                ran,
                crate::kernels::small_gemm::available(),
                "{rows}x{k}x{n}"
            );
            if ran {
                for (index, (a, b)) in got.iter().zip(&want).enumerate() {
                    assert!(
                        (a - b).abs() <= 1e-4 * k as f32,
                        "{rows}x{k}x{n} [{index}] {a} vs {b}"
                    );
                }
            }
        }
        let (g, w) = (vec![1.0f32; 64 * 8], vec![1.0f32; 8 * 65]);
        let mut wide = vec![7.0f32; 64 * 65];
        assert!(!small_nn_in_row_blocks(&g, &w, (64, 8, 65), &mut wide));
        assert!(wide.iter().all(|&v| v == 7.0));
        let (g, w) = (vec![1.0f64; 64 * 8], vec![1.0f64; 8 * 8]);
        let mut double = vec![7.0f64; 64 * 8];
        assert!(!small_nn_in_row_blocks(&g, &w, (64, 8, 8), &mut double));
        assert!(double.iter().all(|&v| v == 7.0));
    }
}
