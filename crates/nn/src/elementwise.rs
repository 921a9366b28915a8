//! Elementwise kernels shared by the activations and losses.
//!
//! Values are computed in f64 and rounded once to the tensor's dtype, so f32 results are at
//! least as accurate as torch's (which computes in f32). Fused, vectorised f32 loops are the
//! kernels part of the nn issue.

use hypershard_tensor::{DType, Tensor};

use crate::{Error, Result};

/// Errors unless `dtype` is a float dtype the layers support.
pub(crate) fn check_float(op: &'static str, dtype: DType) -> Result<()> {
    match dtype {
        DType::F32 | DType::F64 | DType::BF16 | DType::F16 => Ok(()),
        dtype => Err(Error::UnsupportedDType { op, dtype }),
    }
}

/// Builds a tensor of `dtype` from f64 values, rounding once.
pub(crate) fn from_f64(values: Vec<f64>, shape: &[usize], dtype: DType) -> Result<Tensor> {
    let t = Tensor::from_vec(values, shape)?;
    if dtype == DType::F64 {
        Ok(t)
    } else {
        Ok(t.to_dtype(dtype)?)
    }
}

/// `f(x)` for every element.
pub(crate) fn map(op: &'static str, x: &Tensor, f: impl Fn(f64) -> f64) -> Result<Tensor> {
    check_float(op, x.dtype())?;
    let out = x.to_f64_vec()?.into_iter().map(f).collect();
    from_f64(out, x.shape(), x.dtype())
}

/// `f(x, g)` for every pair of elements of two tensors of one shape and dtype.
pub(crate) fn zip_map(
    op: &'static str,
    x: &Tensor,
    g: &Tensor,
    f: impl Fn(f64, f64) -> f64,
) -> Result<Tensor> {
    check_float(op, x.dtype())?;
    if x.shape() != g.shape() {
        return Err(Error::ShapeMismatch {
            op,
            lhs: x.shape().to_vec(),
            rhs: g.shape().to_vec(),
        });
    }
    if x.dtype() != g.dtype() {
        return Err(Error::DTypeMismatch {
            op,
            lhs: x.dtype(),
            rhs: g.dtype(),
        });
    }
    let xs = x.to_f64_vec()?;
    let gs = g.to_f64_vec()?;
    let out = xs.iter().zip(&gs).map(|(&x, &g)| f(x, g)).collect();
    from_f64(out, x.shape(), x.dtype())
}
