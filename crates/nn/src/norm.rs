//! Normalisation over the last dim: `LayerNorm` (with or without bias) and `RMSNorm`.

use hypershard_tensor::{DType, Tensor};

use crate::elementwise::check_float;
use crate::kernels::vector_isa::vectorized;
use crate::kernels::{
    Float, REDUCTION_LANES, in_dtype, lane_sum, lane_total, load, overwrite_target, same_device,
    store, with_float, with_values, with_values2,
};
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

#[cfg(feature = "cuda")]
impl Centering {
    /// The device kernels' name for the same normalisation.
    fn device_norm(self) -> crate::kernels::cuda::Norm {
        match self {
            Centering::Mean => crate::kernels::cuda::Norm::Layer,
            Centering::None => crate::kernels::cuda::Norm::Rms,
        }
    }
}

/// Rows per parallel task of the norm kernels. Fixed, so the backward's per-task partial sums
/// of the parameter gradients (and so their bits) do not depend on the number of threads.
const ROWS_PER_TASK: usize = 16;
/// Elements below which one thread runs the whole kernel (spreading would cost more).
const PARALLEL_ELEMENTS: usize = 1 << 15;

/// The forward of one block of rows of width `d = weight.len()`: writes the output, the
/// normalised input and the inverse std of each row, in one fused pass per row (statistics,
/// normalisation, affine map).
struct ForwardRows<'a, F> {
    weight: &'a [F],
    bias: Option<&'a [F]>,
    eps: F,
    centering: Centering,
}

impl<F: Float> ForwardRows<'_, F> {
    fn run(&self, x: &[F], out: &mut [F], normalized: &mut [F], inv_std: &mut [F]) {
        vectorized!(|| self.run_rows(x, out, normalized, inv_std))
    }

    #[inline(always)]
    fn run_rows(&self, x: &[F], out: &mut [F], normalized: &mut [F], inv_std: &mut [F]) {
        let d = self.weight.len();
        let inv_d = F::of(1.0 / d as f64);
        for (((row, norm_row), out_row), r_out) in x
            .chunks_exact(d)
            .zip(normalized.chunks_exact_mut(d))
            .zip(out.chunks_exact_mut(d))
            .zip(inv_std.iter_mut())
        {
            let mean = match self.centering {
                Centering::Mean => lane_sum(row, |v| v) * inv_d,
                Centering::None => F::ZERO,
            };
            // Two passes (mean, then squared deviations) rather than E[x²] − E[x]², which
            // cancels catastrophically in f32 for rows with a large mean.
            let var = lane_sum(row, |v| (v - mean) * (v - mean)) * inv_d;
            let r = F::ONE / (var + self.eps).sqrt();
            *r_out = r;
            for (((n, o), &v), &w) in norm_row
                .iter_mut()
                .zip(out_row.iter_mut())
                .zip(row)
                .zip(self.weight)
            {
                *n = (v - mean) * r;
                *o = *n * w;
            }
            if let Some(bias) = self.bias {
                crate::kernels::add_assign(out_row, bias);
            }
        }
    }
}

impl<F: Float> ForwardRows<'_, F> {
    /// The forward of every row, blocks of [`ROWS_PER_TASK`] rows spread over the kernel
    /// threads.
    fn run_all(&self, x: &[F], out: &mut [F], normalized: &mut [F], inv_std: &mut [F]) {
        let d = self.weight.len();
        if d == 0 {
            return;
        }
        if x.len() < PARALLEL_ELEMENTS {
            self.run(x, out, normalized, inv_std);
            return;
        }
        use rayon::prelude::*;
        let block = ROWS_PER_TASK * d;
        x.par_chunks(block)
            .zip(out.par_chunks_mut(block))
            .zip(normalized.par_chunks_mut(block))
            .zip(inv_std.par_chunks_mut(ROWS_PER_TASK))
            .for_each(|(((x, out), normalized), inv_std)| self.run(x, out, normalized, inv_std));
    }
}

/// The parameter gradients of a norm (the input gradient is written in place).
struct NormParamGrads<F> {
    grad_weight: Vec<F>,
    grad_bias: Vec<F>,
}

/// The backward of one block of rows: writes its rows of the input gradient and returns its
/// share of the parameter gradients.
struct BackwardRows<'a, F> {
    weight: &'a [F],
    centering: Centering,
}

impl<F: Float> BackwardRows<'_, F> {
    fn run(
        &self,
        grad: &[F],
        normalized: &[F],
        inv_std: &[F],
        grad_input: &mut [F],
    ) -> NormParamGrads<F> {
        vectorized!(|| self.run_rows(grad, normalized, inv_std, grad_input))
    }

    #[inline(always)]
    fn run_rows(
        &self,
        grad: &[F],
        normalized: &[F],
        inv_std: &[F],
        grad_input: &mut [F],
    ) -> NormParamGrads<F> {
        let weight = self.weight;
        let d = weight.len();
        let inv_d = F::of(1.0 / d as f64);
        let mut dw = vec![F::ZERO; d];
        let mut db = vec![F::ZERO; d];
        // The columns in whole lanes; the rest of each row is summed in order after them.
        let whole = d - d % REDUCTION_LANES;
        for (((g_row, xhat), &r), gx_row) in grad
            .chunks_exact(d)
            .zip(normalized.chunks_exact(d))
            .zip(inv_std)
            .zip(grad_input.chunks_exact_mut(d))
        {
            // The row sums in lane-parallel partial sums (`kernels::lane_sum`), the parameter
            // gradients in a loop of their own: both vectorise, where one loop carrying the
            // two scalar sums would not.
            let mut lanes_g = [F::ZERO; REDUCTION_LANES];
            let mut lanes_gx = [F::ZERO; REDUCTION_LANES];
            for ((g, w), x) in g_row[..whole]
                .chunks_exact(REDUCTION_LANES)
                .zip(weight[..whole].chunks_exact(REDUCTION_LANES))
                .zip(xhat[..whole].chunks_exact(REDUCTION_LANES))
            {
                for k in 0..REDUCTION_LANES {
                    let gh = g[k] * w[k];
                    lanes_g[k] += gh;
                    lanes_gx[k] += gh * x[k];
                }
            }
            let mut sum_g = lane_total(lanes_g);
            let mut sum_gx = lane_total(lanes_gx);
            for i in whole..d {
                let gh = g_row[i] * weight[i];
                sum_g += gh;
                sum_gx += gh * xhat[i];
            }
            for (((dw, db), &g), &x) in dw.iter_mut().zip(db.iter_mut()).zip(g_row).zip(xhat) {
                *dw += g * x;
                *db += g;
            }
            let mean_g = match self.centering {
                Centering::Mean => sum_g * inv_d,
                Centering::None => F::ZERO,
            };
            let mean_gx = sum_gx * inv_d;
            for i in 0..d {
                gx_row[i] = r * (g_row[i] * weight[i] - mean_g - xhat[i] * mean_gx);
            }
        }
        NormParamGrads {
            grad_weight: dw,
            grad_bias: db,
        }
    }
}

/// With `ĝ = g·w` and `x̂` the normalised input, per row:
/// LayerNorm `dx = r · (ĝ − mean(ĝ) − x̂ · mean(ĝ · x̂))`, RMSNorm the same without `mean(ĝ)`;
/// `dw = Σ g · x̂`, `db = Σ g` over rows. Blocks of [`ROWS_PER_TASK`] rows are spread over the
/// kernel threads; each sums its own share of `dw` and `db`, and the shares are added in row
/// order, the same on any number of threads.
fn norm_backward<F: Float>(
    grad: &[F],
    normalized: &[F],
    inv_std: &[F],
    weight: &[F],
    centering: Centering,
    grad_input: &mut [F],
) -> NormParamGrads<F> {
    let d = weight.len();
    let mut total = NormParamGrads {
        grad_weight: vec![F::ZERO; d],
        grad_bias: vec![F::ZERO; d],
    };
    if d == 0 {
        return total;
    }
    let rows = BackwardRows { weight, centering };
    let block = ROWS_PER_TASK * d;
    let shares: Vec<NormParamGrads<F>> = if grad.len() < PARALLEL_ELEMENTS {
        grad.chunks(block)
            .zip(normalized.chunks(block))
            .zip(inv_std.chunks(ROWS_PER_TASK))
            .zip(grad_input.chunks_mut(block))
            .map(|(((g, n), r), gx)| rows.run(g, n, r, gx))
            .collect()
    } else {
        use rayon::prelude::*;
        grad.par_chunks(block)
            .zip(normalized.par_chunks(block))
            .zip(inv_std.par_chunks(ROWS_PER_TASK))
            .zip(grad_input.par_chunks_mut(block))
            .map(|(((g, n), r), gx)| rows.run(g, n, r, gx))
            .collect()
    };
    for share in shares {
        crate::kernels::add_assign(&mut total.grad_weight, &share.grad_weight);
        crate::kernels::add_assign(&mut total.grad_bias, &share.grad_bias);
    }
    total
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
        let fwd = crate::kernels::cuda::norm(centering.device_norm(), input, weight, bias, eps)?;
        let cache = NormCache {
            normalized: fwd.xhat,
            inv_std: fwd.rstd,
            shape: input.shape().to_vec(),
            dtype: input.dtype(),
        };
        return Ok((fwd.out, cache));
    }
    let rows = input.numel().checked_div(d).unwrap_or(0);
    with_float!(op, input.dtype(), F => {
        // The parameters are copied (one row each); the input is read in place, and the
        // output and the normalised input are written where they will live.
        let w = load::<F>(weight)?;
        let b = bias.map(load::<F>).transpose()?;
        let mut inv_std = vec![F::ZERO; rows];
        let kernel = ForwardRows {
            weight: &w,
            bias: b.as_deref(),
            eps: F::of(eps),
            centering,
        };
        let out = overwrite_target::<F>(input.shape(), &device)?;
        let normalized = overwrite_target::<F>(input.shape(), &device)?;
        out.with_kernel_data_mut::<F, _>(op, |out| {
            normalized.with_kernel_data_mut::<F, _>(op, |norm| {
                with_values::<F, _>(input, |x| kernel.run_all(x, out, norm, &mut inv_std))
            })
        })???;
        let cache = NormCache {
            normalized,
            inv_std: Tensor::from_vec_on(inv_std, &[rows], &device)?,
            shape: input.shape().to_vec(),
            dtype: input.dtype(),
        };
        Ok((in_dtype(out, input.dtype())?, cache))
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
        let saved = [&cache.normalized, &cache.inv_std];
        let [grad_input, grad_weight, grad_bias] = crate::kernels::cuda::norm_backward(
            centering.device_norm(),
            &grad_output.contiguous()?,
            saved,
            weight,
        )?;
        return Ok(NormGrads {
            grad_input,
            grad_weight,
            grad_bias,
        });
    }
    with_float!(op, dtype, F => {
        // The two activation-sized operands are read in place and the input gradient is
        // written where it will live; one value per row and one per feature are copied.
        let (inv_std, w) = (load::<F>(&cache.inv_std)?, load::<F>(weight)?);
        let grad_input = overwrite_target::<F>(&cache.shape, &device)?;
        let params = grad_input.with_kernel_data_mut::<F, _>(op, |gx| {
            with_values2::<F, _>(grad_output, &cache.normalized, |g, normalized| {
                norm_backward(g, normalized, &inv_std, &w, centering, gx)
            })
        })??;
        Ok(NormGrads {
            grad_input: in_dtype(grad_input, dtype)?,
            grad_weight: store(params.grad_weight, &[d], dtype, &device)?,
            grad_bias: store(params.grad_bias, &[d], dtype, &device)?,
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

#[cfg(test)]
mod tests {
    use super::*;

    /// The row-parallel kernels past their threshold, with a row count that leaves a partial
    /// block: forward and every gradient against an f64 reference, and the same bits on one
    /// thread and on two.
    #[test]
    fn norm_kernels_match_the_reference_on_any_thread_count() -> Result<()> {
        let (rows, d) = (403usize, 96usize);
        assert!(rows * d >= PARALLEL_ELEMENTS && rows % ROWS_PER_TASK != 0);
        let x: Vec<f32> = (0..rows * d)
            .map(|i| ((i * 7919 % 997) as f32 / 997.0 - 0.4) * 3.0 + (i / d) as f32 * 0.01)
            .collect();
        let g: Vec<f32> = (0..rows * d)
            .map(|i| ((i * 104_729 % 991) as f32 / 991.0 - 0.5) * 0.1)
            .collect();
        let weight: Vec<f32> = (0..d).map(|i| 0.5 + i as f32 / d as f32).collect();
        let bias: Vec<f32> = (0..d).map(|i| i as f32 * 0.01 - 0.3).collect();
        // Output, input gradient, weight gradient, bias gradient.
        type Run = (Vec<f32>, Vec<f32>, Vec<f32>, Vec<f32>);
        let run = |threads| -> Result<Run> {
            crate::with_num_threads(threads, || -> Result<_> {
                let mut ln = LayerNorm::new(LayerNormConfig {
                    normalized_shape: d,
                    eps: 1e-5,
                    bias: true,
                    dtype: DType::F32,
                })?;
                ln.weight.data = Some(Tensor::from_vec(weight.clone(), &[d])?);
                if let Some(b) = ln.bias.as_mut() {
                    b.data = Some(Tensor::from_vec(bias.clone(), &[d])?);
                }
                let y = ln.forward(&Tensor::from_vec(x.clone(), &[rows, d])?)?;
                let gx = ln.backward(&Tensor::from_vec(g.clone(), &[rows, d])?)?;
                let grad = |p: &Parameter| -> Result<Vec<f32>> {
                    let t = p
                        .grad
                        .as_ref()
                        .ok_or(Error::BackwardBeforeForward { module: "t" })?;
                    Ok(t.to_vec::<f32>()?)
                };
                let gb = ln.bias.as_ref().map(grad).transpose()?.unwrap_or_default();
                Ok((
                    y.to_vec::<f32>()?,
                    gx.to_vec::<f32>()?,
                    grad(&ln.weight)?,
                    gb,
                ))
            })?
        };
        let one = run(1)?;
        let two = run(2)?;
        assert_eq!(one, two);
        let (y, gx, gw, gb) = two;
        let mut want_gw = vec![0.0f64; d];
        let mut want_gb = vec![0.0f64; d];
        for r in 0..rows {
            let row: Vec<f64> = x[r * d..(r + 1) * d]
                .iter()
                .map(|&v| f64::from(v))
                .collect();
            let mean = row.iter().sum::<f64>() / d as f64;
            let var = row.iter().map(|v| (v - mean) * (v - mean)).sum::<f64>() / d as f64;
            let inv = 1.0 / (var + 1e-5).sqrt();
            let xhat: Vec<f64> = row.iter().map(|v| (v - mean) * inv).collect();
            let gr: Vec<f64> = g[r * d..(r + 1) * d]
                .iter()
                .map(|&v| f64::from(v))
                .collect();
            let gh: Vec<f64> = (0..d).map(|i| gr[i] * f64::from(weight[i])).collect();
            let mean_g = gh.iter().sum::<f64>() / d as f64;
            let mean_gx = (0..d).map(|i| gh[i] * xhat[i]).sum::<f64>() / d as f64;
            for i in 0..d {
                let want_y = xhat[i] * f64::from(weight[i]) + f64::from(bias[i]);
                assert!(
                    (f64::from(y[r * d + i]) - want_y).abs() < 1e-5,
                    "y[{r},{i}]"
                );
                let want_gx = inv * (gh[i] - mean_g - xhat[i] * mean_gx);
                assert!(
                    (f64::from(gx[r * d + i]) - want_gx).abs() < 1e-5,
                    "gx[{r},{i}]"
                );
                want_gw[i] += gr[i] * xhat[i];
                want_gb[i] += gr[i];
            }
        }
        for i in 0..d {
            assert!((f64::from(gw[i]) - want_gw[i]).abs() < 1e-4, "gw[{i}]");
            assert!((f64::from(gb[i]) - want_gb[i]).abs() < 1e-4, "gb[{i}]");
        }
        Ok(())
    }
}
