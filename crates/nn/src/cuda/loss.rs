//! The mean squared error on the device.

use hypershard_tensor::DType;
use hypershard_tensor::cuda::{CudaTensor, Transpose, gemm};

use super::error::{DeviceError, DeviceResult};

/// A loss value (read back to the host) and its gradient on the device.
#[derive(Debug)]
pub struct DeviceLoss {
    /// The loss.
    pub loss: f64,
    /// `∂loss/∂prediction`, in the prediction's shape and dtype.
    pub grad: CudaTensor,
}

/// `mean((prediction − target)²)` and its gradient `2 (prediction − target) / n`, as the CPU
/// [`mse_loss`](crate::mse_loss) (torch's `reduction="mean"`).
///
/// The difference `d = prediction − target` is one `axpy_` (in the dtype's compute precision,
/// rounded to the dtype), the sum of squares is the GEMM `d[1, n] · dᵀ[n, 1]` into an f32
/// scalar (f32 accumulation in cuBLAS's order, where the CPU sums in f64), and the gradient is
/// `d` scaled in place by `2 / n`. An empty prediction gives NaN (0/0), as on the CPU.
pub fn mse_loss(prediction: &CudaTensor, target: &CudaTensor) -> DeviceResult<DeviceLoss> {
    const OP: &str = "cuda::mse_loss";
    if prediction.shape() != target.shape() {
        return Err(DeviceError::BadShape {
            op: OP,
            expected: format!("a target of shape {:?}", prediction.shape()),
            actual: target.shape().to_vec(),
        });
    }
    if prediction.dtype() != target.dtype() {
        return Err(DeviceError::DTypeMismatch {
            op: OP,
            lhs: prediction.dtype(),
            rhs: target.dtype(),
        });
    }
    let shape = prediction.shape().to_vec();
    let n = prediction.numel();
    let mut diff = prediction.try_clone()?;
    diff.axpy_(-1.0, target)?;
    let diff = diff.reshape(&[1, n])?;
    let mut sum = CudaTensor::zeros(prediction.device(), &[1, 1], DType::F32)?;
    gemm(
        1.0,
        &diff,
        Transpose::No,
        &diff,
        Transpose::Yes,
        0.0,
        &mut sum,
    )?;
    let sum = sum.to_host()?.to_vec::<f32>()?;
    let loss = f64::from(sum.first().copied().unwrap_or(f32::NAN)) / n as f64;
    let mut grad = diff.reshape(&shape)?;
    grad.scale_(2.0 / n as f64)?;
    Ok(DeviceLoss { loss, grad })
}
