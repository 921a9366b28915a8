//! Dtype checks and the f64 constructor shared by the layers.

use hypershard_tensor::{DType, Device, Tensor};

use crate::{Error, Result};

/// Errors unless `dtype` is a float dtype the layers support.
pub(crate) fn check_float(op: &'static str, dtype: DType) -> Result<()> {
    match dtype {
        DType::F32 | DType::F64 | DType::BF16 | DType::F16 => Ok(()),
        dtype => Err(Error::UnsupportedDType { op, dtype }),
    }
}

/// Builds a tensor of `dtype` on `device` from f64 values, rounding once.
pub(crate) fn from_f64(
    values: Vec<f64>,
    shape: &[usize],
    dtype: DType,
    device: &Device,
) -> Result<Tensor> {
    crate::kernels::store::<f64>(values, shape, dtype, device)
}
