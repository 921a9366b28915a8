//! Normalisation over the last dim: `LayerNorm` (with or without bias) and `RMSNorm`.

use hypershard_tensor::{DType, Tensor};

use crate::elementwise::{check_float, from_f64};
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

/// What backward needs: the normalised input (before the affine map) and `1/√(…+eps)` per row.
#[derive(Debug)]
struct NormCache {
    normalized: Vec<f64>,
    inv_std: Vec<f64>,
    shape: Vec<usize>,
    dtype: DType,
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
        let d = weight.numel();
        check_input("LayerNorm::forward", input, d, weight.dtype())?;
        let w = weight.to_f64_vec()?;
        let b = match &self.bias {
            Some(bias) => bias.data()?.to_f64_vec()?,
            None => vec![0.0; d],
        };
        let x = input.to_f64_vec()?;
        let mut normalized = vec![0.0; x.len()];
        let mut out = vec![0.0; x.len()];
        let mut inv_std = Vec::new();
        for ((row, norm_row), out_row) in x
            .chunks(d.max(1))
            .zip(normalized.chunks_mut(d.max(1)))
            .zip(out.chunks_mut(d.max(1)))
        {
            let mean = row.iter().sum::<f64>() / d as f64;
            let var = row.iter().map(|v| (v - mean) * (v - mean)).sum::<f64>() / d as f64;
            let r = 1.0 / (var + self.eps).sqrt();
            inv_std.push(r);
            for (i, v) in row.iter().enumerate() {
                norm_row[i] = (v - mean) * r;
                out_row[i] = norm_row[i] * w[i] + b[i];
            }
        }
        self.cache = Some(NormCache {
            normalized,
            inv_std,
            shape: input.shape().to_vec(),
            dtype: input.dtype(),
        });
        from_f64(out, input.shape(), input.dtype())
    }

    fn backward(&mut self, grad_output: &Tensor) -> Result<Tensor> {
        let cache = self.cache.take().ok_or(Error::BackwardBeforeForward {
            module: "LayerNorm",
        })?;
        let weight = self.weight.data()?;
        let d = weight.numel();
        check_grad("LayerNorm::backward", grad_output, &cache)?;
        let w = weight.to_f64_vec()?;
        let g = grad_output.to_f64_vec()?;
        let mut grad_input = vec![0.0; g.len()];
        let mut grad_weight = vec![0.0; d];
        let mut grad_bias = vec![0.0; d];
        for (((g_row, xhat), r), gx_row) in g
            .chunks(d.max(1))
            .zip(cache.normalized.chunks(d.max(1)))
            .zip(&cache.inv_std)
            .zip(grad_input.chunks_mut(d.max(1)))
        {
            // With ĝ = g·w: dx = r · (ĝ − mean(ĝ) − x̂ · mean(ĝ · x̂)).
            let mut mean_g = 0.0;
            let mut mean_gx = 0.0;
            for i in 0..d {
                let gh = g_row[i] * w[i];
                mean_g += gh;
                mean_gx += gh * xhat[i];
                grad_weight[i] += g_row[i] * xhat[i];
                grad_bias[i] += g_row[i];
            }
            mean_g /= d as f64;
            mean_gx /= d as f64;
            for i in 0..d {
                gx_row[i] = r * (g_row[i] * w[i] - mean_g - xhat[i] * mean_gx);
            }
        }
        let dtype = cache.dtype;
        self.weight
            .accumulate_grad(from_f64(grad_weight, &[d], dtype)?)?;
        if let Some(bias) = &mut self.bias {
            bias.accumulate_grad(from_f64(grad_bias, &[d], dtype)?)?;
        }
        from_f64(grad_input, &cache.shape, dtype)
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
        let weight = self.weight.data()?;
        let d = weight.numel();
        check_input("RmsNorm::forward", input, d, weight.dtype())?;
        let w = weight.to_f64_vec()?;
        let x = input.to_f64_vec()?;
        let mut normalized = vec![0.0; x.len()];
        let mut out = vec![0.0; x.len()];
        let mut inv_std = Vec::new();
        for ((row, norm_row), out_row) in x
            .chunks(d.max(1))
            .zip(normalized.chunks_mut(d.max(1)))
            .zip(out.chunks_mut(d.max(1)))
        {
            let mean_sq = row.iter().map(|v| v * v).sum::<f64>() / d as f64;
            let r = 1.0 / (mean_sq + self.eps).sqrt();
            inv_std.push(r);
            for (i, v) in row.iter().enumerate() {
                norm_row[i] = v * r;
                out_row[i] = norm_row[i] * w[i];
            }
        }
        self.cache = Some(NormCache {
            normalized,
            inv_std,
            shape: input.shape().to_vec(),
            dtype: input.dtype(),
        });
        from_f64(out, input.shape(), input.dtype())
    }

    fn backward(&mut self, grad_output: &Tensor) -> Result<Tensor> {
        let cache = self
            .cache
            .take()
            .ok_or(Error::BackwardBeforeForward { module: "RMSNorm" })?;
        let weight = self.weight.data()?;
        let d = weight.numel();
        check_grad("RmsNorm::backward", grad_output, &cache)?;
        let w = weight.to_f64_vec()?;
        let g = grad_output.to_f64_vec()?;
        let mut grad_input = vec![0.0; g.len()];
        let mut grad_weight = vec![0.0; d];
        for (((g_row, xhat), r), gx_row) in g
            .chunks(d.max(1))
            .zip(cache.normalized.chunks(d.max(1)))
            .zip(&cache.inv_std)
            .zip(grad_input.chunks_mut(d.max(1)))
        {
            // With x̂ = x·r and ĝ = g·w: dx = r · (ĝ − x̂ · mean(ĝ · x̂)).
            let mut mean_gx = 0.0;
            for i in 0..d {
                mean_gx += g_row[i] * w[i] * xhat[i];
                grad_weight[i] += g_row[i] * xhat[i];
            }
            mean_gx /= d as f64;
            for i in 0..d {
                gx_row[i] = r * (g_row[i] * w[i] - xhat[i] * mean_gx);
            }
        }
        self.weight
            .accumulate_grad(from_f64(grad_weight, &[d], cache.dtype)?)?;
        from_f64(grad_input, &cache.shape, cache.dtype)
    }

    fn visit_params(&self, prefix: &str, f: &mut ParamVisitor<'_>) -> Result<()> {
        f(&join_name(prefix, "weight"), &self.weight)
    }

    fn visit_params_mut(&mut self, prefix: &str, f: &mut ParamVisitorMut<'_>) -> Result<()> {
        f(&join_name(prefix, "weight"), &mut self.weight)
    }
}
