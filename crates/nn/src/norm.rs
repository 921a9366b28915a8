//! Normalisation over the last dim: `LayerNorm` (with or without bias) and `RMSNorm`.

use hypershard_tensor::{DType, Tensor};

use crate::elementwise::check_float;
use crate::kernels::{Float, load, same_device, store, with_float, with_values, with_values2};
use crate::module::{ParamVisitor, ParamVisitorMut, join_name};
use crate::{Error, Module, Parameter, Result};

/// How to build a [`LayerNorm`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LayerNormConfig {
    /// The size of the normalised (last) dim.
    pub normalized_shape: usize,
    /// Added to the variance (torch: 1e-5).
    pub eps: f64,
    /// Whether there is a bias (torch's `bias=True`; nanoGPT turns it off).
    pub bias: bool,
    /// The parameters' dtype.
    pub dtype: DType,
}

/// torch's `nn.LayerNorm` over the last dim: `(x − mean) / √(var + eps) · weight + bias`, the
/// variance biased (divided by `D`). `weight` starts at ones and `bias` at zeros.
#[derive(Debug)]
pub struct LayerNorm {
    /// The scale, `[D]`.
    pub weight: Parameter,
    /// The shift, `[D]`, if any.
    pub bias: Option<Parameter>,
    eps: f64,
    cache: Option<NormCache>,
}

/// How to build an [`RmsNorm`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RmsNormConfig {
    /// The size of the normalised (last) dim.
    pub normalized_shape: usize,
    /// Added to the mean square; `None` is torch's default, the machine epsilon of the dtype.
    pub eps: Option<f64>,
    /// The parameters' dtype.
    pub dtype: DType,
}

/// torch's `nn.RMSNorm` over the last dim: `x / √(mean(x²) + eps) · weight`; `weight` starts at
/// ones.
#[derive(Debug)]
pub struct RmsNorm {
    /// The scale, `[D]`.
    pub weight: Parameter,
    eps: f64,
    cache: Option<NormCache>,
}

/// What backward needs: the normalised input (before the affine map) and `1/√(…+eps)` per row,
/// both in the compute type (f32 or f64), and the input's shape and dtype.
#[derive(Debug)]
struct NormCache {
    normalized: Tensor,
    inv_std: Tensor,
    shape: Vec<usize>,
    dtype: DType,
}

/// Whether a norm subtracts the mean (LayerNorm) or not (RMSNorm).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Centering {
    Mean,
    None,
}

/// The forward of a norm over rows of width `d`: output, normalised input, inverse std.
struct NormForward<F> {
    out: Vec<F>,
    normalized: Vec<F>,
    inv_std: Vec<F>,
}

/// One fused pass per row: statistics, normalisation and the affine map.
fn norm_forward<F: Float>(
    x: &[F],
    weight: &[F],
    bias: Option<&[F]>,
    eps: f64,
    centering: Centering,
) -> NormForward<F> {
    let d = weight.len();
    let mut out = vec![F::ZERO; x.len()];
    let mut normalized = vec![F::ZERO; x.len()];
    let mut inv_std = Vec::with_capacity(x.len() / d.max(1));
    if d == 0 {
        return NormForward {
            out,
            normalized,
            inv_std,
        };
    }
    let inv_d = F::of(1.0 / d as f64);
    let eps = F::of(eps);
    for ((row, norm_row), out_row) in x
        .chunks_exact(d)
        .zip(normalized.chunks_exact_mut(d))
        .zip(out.chunks_exact_mut(d))
    {
        let mean = match centering {
            Centering::Mean => row.iter().copied().sum::<F>() * inv_d,
            Centering::None => F::ZERO,
        };
        // Two passes (mean, then squared deviations) rather than E[x²] − E[x]², which
        // cancels catastrophically in f32 for rows with a large mean.
        let var = row.iter().map(|&v| (v - mean) * (v - mean)).sum::<F>() * inv_d;
        let r = F::ONE / (var + eps).sqrt();
        inv_std.push(r);
        for (((n, o), &v), &w) in norm_row
            .iter_mut()
            .zip(out_row.iter_mut())
            .zip(row)
            .zip(weight)
        {
            *n = (v - mean) * r;
            *o = *n * w;
        }
        if let Some(bias) = bias {
            crate::kernels::add_assign(out_row, bias);
        }
    }
    NormForward {
        out,
        normalized,
        inv_std,
    }
}

/// The gradients of a norm.
struct NormBackward<F> {
    grad_input: Vec<F>,
    grad_weight: Vec<F>,
    grad_bias: Vec<F>,
}

/// With `ĝ = g·w` and `x̂` the normalised input, per row:
/// LayerNorm `dx = r · (ĝ − mean(ĝ) − x̂ · mean(ĝ · x̂))`, RMSNorm the same without `mean(ĝ)`;
/// `dw = Σ g · x̂`, `db = Σ g` over rows.
fn norm_backward<F: Float>(
    grad: &[F],
    normalized: &[F],
    inv_std: &[F],
    weight: &[F],
    centering: Centering,
) -> NormBackward<F> {
    let d = weight.len();
    let mut grad_input = vec![F::ZERO; grad.len()];
    let mut grad_weight = vec![F::ZERO; d];
    let mut grad_bias = vec![F::ZERO; d];
    if d == 0 {
        return NormBackward {
            grad_input,
            grad_weight,
            grad_bias,
        };
    }
    let inv_d = F::of(1.0 / d as f64);
    for (((g_row, xhat), &r), gx_row) in grad
        .chunks_exact(d)
        .zip(normalized.chunks_exact(d))
        .zip(inv_std)
        .zip(grad_input.chunks_exact_mut(d))
    {
        let mut sum_g = F::ZERO;
        let mut sum_gx = F::ZERO;
        for i in 0..d {
            let gh = g_row[i] * weight[i];
            sum_g += gh;
            sum_gx += gh * xhat[i];
            grad_weight[i] += g_row[i] * xhat[i];
            grad_bias[i] += g_row[i];
        }
        let mean_g = match centering {
            Centering::Mean => sum_g * inv_d,
            Centering::None => F::ZERO,
        };
        let mean_gx = sum_gx * inv_d;
        for i in 0..d {
            gx_row[i] = r * (g_row[i] * weight[i] - mean_g - xhat[i] * mean_gx);
        }
    }
    NormBackward {
        grad_input,
        grad_weight,
        grad_bias,
    }
}

/// The shared forward of both norms: runs the kernel in the compute type and fills the cache.
fn run_forward(
    op: &'static str,
    input: &Tensor,
    weight: &Tensor,
    bias: Option<&Tensor>,
    eps: f64,
    centering: Centering,
) -> Result<(Tensor, NormCache)> {
    let d = weight.numel();
    check_input(op, input, d, weight.dtype())?;
    let device = match bias {
        Some(b) => same_device(op, &[weight, input, b])?,
        None => same_device(op, &[weight, input])?,
    };
    #[cfg(feature = "cuda")]
    if device.is_cuda() {
        // Only LayerNorm has a kernel.
        if centering == Centering::None {
            crate::kernels::host_only(op, &device)?;
        }
        let fwd = crate::kernels::cuda::layer_norm(input, weight, bias, eps)?;
        let cache = NormCache {
            normalized: fwd.xhat,
            inv_std: fwd.rstd,
            shape: input.shape().to_vec(),
            dtype: input.dtype(),
        };
        return Ok((fwd.out, cache));
    }
    with_float!(op, input.dtype(), F => {
        // The parameters are copied (one row each); the input is read in place.
        let w = load::<F>(weight)?;
        let b = bias.map(load::<F>).transpose()?;
        let fwd = with_values::<F, _>(input, |x| norm_forward(x, &w, b.as_deref(), eps, centering))?;
        let rows = fwd.inv_std.len();
        let cache = NormCache {
            normalized: Tensor::from_vec_on(fwd.normalized, input.shape(), &device)?,
            inv_std: Tensor::from_vec_on(fwd.inv_std, &[rows], &device)?,
            shape: input.shape().to_vec(),
            dtype: input.dtype(),
        };
        Ok((store(fwd.out, input.shape(), input.dtype(), &device)?, cache))
    })
}

/// The shared backward of both norms; returns the input gradient and the parameter gradients
/// (in the input's dtype).
fn run_backward(
    op: &'static str,
    grad_output: &Tensor,
    weight: &Tensor,
    cache: &NormCache,
    centering: Centering,
) -> Result<NormGrads> {
    check_grad(op, grad_output, cache)?;
    let d = weight.numel();
    let dtype = cache.dtype;
    let device = same_device(op, &[weight, grad_output, &cache.normalized])?;
    #[cfg(feature = "cuda")]
    if device.is_cuda() {
        if centering == Centering::None {
            crate::kernels::host_only(op, &device)?;
        }
        let saved = [&cache.normalized, &cache.inv_std];
        let [grad_input, grad_weight, grad_bias] =
            crate::kernels::cuda::layer_norm_backward(&grad_output.contiguous()?, saved, weight)?;
        return Ok(NormGrads {
            grad_input,
            grad_weight,
            grad_bias,
        });
    }
    with_float!(op, dtype, F => {
        // The two activation-sized operands are read in place; one value per row and one
        // per feature are copied.
        let (inv_std, w) = (load::<F>(&cache.inv_std)?, load::<F>(weight)?);
        let bwd = with_values2::<F, _>(grad_output, &cache.normalized, |g, normalized| {
            norm_backward(g, normalized, &inv_std, &w, centering)
        })?;
        Ok(NormGrads {
            grad_input: store(bwd.grad_input, &cache.shape, dtype, &device)?,
            grad_weight: store(bwd.grad_weight, &[d], dtype, &device)?,
            grad_bias: store(bwd.grad_bias, &[d], dtype, &device)?,
        })
    })
}

/// The gradients of a norm as tensors.
struct NormGrads {
    grad_input: Tensor,
    grad_weight: Tensor,
    grad_bias: Tensor,
}

/// Checks that `t` has the parameters' dtype and last dim `size`.
fn check_input(op: &'static str, t: &Tensor, size: usize, dtype: DType) -> Result<()> {
    if t.dtype() != dtype {
        return Err(Error::DTypeMismatch {
            op,
            lhs: dtype,
            rhs: t.dtype(),
        });
    }
    if t.shape().last() != Some(&size) {
        return Err(Error::BadShape {
            op,
            expected: format!("[*, {size}]"),
            actual: t.shape().to_vec(),
        });
    }
    Ok(())
}

impl LayerNorm {
    /// A layer norm with weight ones and bias zeros, as torch initialises it.
    pub fn new(config: LayerNormConfig) -> Result<Self> {
        check_float("LayerNorm::new", config.dtype)?;
        let d = config.normalized_shape;
        let bias = config
            .bias
            .then(|| Tensor::zeros(&[d], config.dtype))
            .transpose()?;
        Ok(LayerNorm {
            weight: Parameter::new("weight", Tensor::ones(&[d], config.dtype)?),
            bias: bias.map(|b| Parameter::new("bias", b)),
            eps: config.eps,
            cache: None,
        })
    }
}

impl Module for LayerNorm {
    fn kind(&self) -> &'static str {
        "LayerNorm"
    }

    fn forward(&mut self, input: &Tensor) -> Result<Tensor> {
        let weight = self.weight.data()?;
        let bias = self.bias.as_ref().map(Parameter::data).transpose()?;
        let (out, cache) = run_forward(
            "LayerNorm::forward",
            input,
            weight,
            bias,
            self.eps,
            Centering::Mean,
        )?;
        self.cache = Some(cache);
        Ok(out)
    }

    fn backward(&mut self, grad_output: &Tensor) -> Result<Tensor> {
        let cache = self.cache.take().ok_or(Error::BackwardBeforeForward {
            module: "LayerNorm",
        })?;
        let grads = run_backward(
            "LayerNorm::backward",
            grad_output,
            self.weight.data()?,
            &cache,
            Centering::Mean,
        )?;
        self.weight.accumulate_grad(grads.grad_weight)?;
        if let Some(bias) = &mut self.bias {
            bias.accumulate_grad(grads.grad_bias)?;
        }
        Ok(grads.grad_input)
    }

    fn clear_cache(&mut self) -> Result<()> {
        self.cache = None;
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

/// Checks a gradient against the cached forward input.
fn check_grad(op: &'static str, grad: &Tensor, cache: &NormCache) -> Result<()> {
    if grad.shape() != cache.shape.as_slice() {
        return Err(Error::ShapeMismatch {
            op,
            lhs: cache.shape.clone(),
            rhs: grad.shape().to_vec(),
        });
    }
    if grad.dtype() != cache.dtype {
        return Err(Error::DTypeMismatch {
            op,
            lhs: cache.dtype,
            rhs: grad.dtype(),
        });
    }
    Ok(())
}

impl RmsNorm {
    /// An RMS norm with weight ones, as torch initialises it.
    pub fn new(config: RmsNormConfig) -> Result<Self> {
        check_float("RmsNorm::new", config.dtype)?;
        let eps = config.eps.unwrap_or(match config.dtype {
            DType::F64 => f64::EPSILON,
            DType::BF16 => 0.0078125,
            DType::F16 => 0.0009765625,
            _ => f64::from(f32::EPSILON),
        });
        Ok(RmsNorm {
            weight: Parameter::new(
                "weight",
                Tensor::ones(&[config.normalized_shape], config.dtype)?,
            ),
            eps,
            cache: None,
        })
    }
}

impl Module for RmsNorm {
    fn kind(&self) -> &'static str {
        "RMSNorm"
    }

    fn forward(&mut self, input: &Tensor) -> Result<Tensor> {
        let (out, cache) = run_forward(
            "RmsNorm::forward",
            input,
            self.weight.data()?,
            None,
            self.eps,
            Centering::None,
        )?;
        self.cache = Some(cache);
        Ok(out)
    }

    fn backward(&mut self, grad_output: &Tensor) -> Result<Tensor> {
        let cache = self
            .cache
            .take()
            .ok_or(Error::BackwardBeforeForward { module: "RMSNorm" })?;
        let grads = run_backward(
            "RmsNorm::backward",
            grad_output,
            self.weight.data()?,
            &cache,
            Centering::None,
        )?;
        self.weight.accumulate_grad(grads.grad_weight)?;
        Ok(grads.grad_input)
    }

    fn clear_cache(&mut self) -> Result<()> {
        self.cache = None;
        Ok(())
    }

    fn visit_params(&self, prefix: &str, f: &mut ParamVisitor<'_>) -> Result<()> {
        f(&join_name(prefix, "weight"), &self.weight)
    }

    fn visit_params_mut(&mut self, prefix: &str, f: &mut ParamVisitorMut<'_>) -> Result<()> {
        f(&join_name(prefix, "weight"), &mut self.weight)
    }
}
