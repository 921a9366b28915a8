//! `DeviceLinear`: `y = x·Wᵀ + b` on the device, through the tensor crate's cuBLAS GEMM.

use hypershard_tensor::cuda::{CudaDevice, CudaTensor, Transpose, gemm};
use hypershard_tensor::{DType, Tensor};

use super::error::{DeviceError, DeviceResult};
use crate::{Linear, Parameter};

/// A fully connected layer on the device, with its gradients.
///
/// `weight` is `[out, in]` as on the CPU; the bias and its gradient are kept as `[1, out]`
/// row matrices, because the bias is broadcast and reduced by GEMMs against a column of ones
/// (`ones[rows, 1] · b[1, out]` and `onesᵀ · dy`), which needs no kernel of its own. The
/// gradients always exist on the device; [`DeviceLinear::zero_grad`] zeroes them.
#[derive(Debug)]
pub struct DeviceLinear {
    /// The weight, `[out_features, in_features]`.
    pub weight: CudaTensor,
    /// The bias as a `[1, out_features]` row, if any.
    pub bias: Option<CudaTensor>,
    /// The accumulated weight gradient, `[out_features, in_features]`.
    pub grad_weight: CudaTensor,
    /// The accumulated bias gradient, `[1, out_features]`.
    pub grad_bias: Option<CudaTensor>,
    in_features: usize,
    out_features: usize,
}

impl DeviceLinear {
    /// Copies a CPU layer's parameters to `device` (gradients start at zero).
    pub(crate) fn from_host(
        device: &CudaDevice,
        weight: &Tensor,
        bias: Option<&Tensor>,
    ) -> DeviceResult<DeviceLinear> {
        let &[out_features, in_features] = weight.shape() else {
            return Err(DeviceError::BadShape {
                op: "DeviceLinear::from_host",
                expected: "a 2-D weight [out, in]".to_string(),
                actual: weight.shape().to_vec(),
            });
        };
        let dtype = weight.dtype();
        let bias = bias
            .map(|b| {
                let row = b.reshape(&[1, out_features])?;
                CudaTensor::from_host(device, &row).map_err(DeviceError::from)
            })
            .transpose()?;
        let grad_bias = bias
            .as_ref()
            .map(|_| CudaTensor::zeros(device, &[1, out_features], dtype))
            .transpose()?;
        Ok(DeviceLinear {
            weight: CudaTensor::from_host(device, weight)?,
            bias,
            grad_weight: CudaTensor::zeros(device, &[out_features, in_features], dtype)?,
            grad_bias,
            in_features,
            out_features,
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

    /// Checks that `t` is `[rows, cols]` in the layer's dtype; returns `rows`.
    fn check_matrix(&self, op: &'static str, t: &CudaTensor, cols: usize) -> DeviceResult<usize> {
        if t.dtype() != self.weight.dtype() {
            return Err(DeviceError::DTypeMismatch {
                op,
                lhs: self.weight.dtype(),
                rhs: t.dtype(),
            });
        }
        match t.shape() {
            &[rows, c] if c == cols => Ok(rows),
            other => Err(DeviceError::BadShape {
                op,
                expected: format!("[rows, {cols}]"),
                actual: other.to_vec(),
            }),
        }
    }

    /// `y = x·Wᵀ + b` for `x: [rows, in]`; `ones` is a `[rows, 1]` column of ones in the
    /// layer's dtype (it broadcasts the bias through a rank-1 GEMM, which is exact: each
    /// element is `1 · b`).
    pub fn forward(&self, x: &CudaTensor, ones: &CudaTensor) -> DeviceResult<CudaTensor> {
        const OP: &str = "DeviceLinear::forward";
        let rows = self.check_matrix(OP, x, self.in_features)?;
        let mut y = CudaTensor::zeros(x.device(), &[rows, self.out_features], x.dtype())?;
        let beta = match &self.bias {
            Some(bias) => {
                check_ones(OP, ones, rows, self.weight.dtype())?;
                gemm(1.0, ones, Transpose::No, bias, Transpose::No, 0.0, &mut y)?;
                1.0
            }
            None => 0.0,
        };
        gemm(
            1.0,
            x,
            Transpose::No,
            &self.weight,
            Transpose::Yes,
            beta,
            &mut y,
        )?;
        Ok(y)
    }

    /// Accumulates `dW += dyᵀ·x` and `db += Σ_rows dy` (as `onesᵀ·dy`), and returns `dx =
    /// dy·W` when `need_input_grad` (the first layer of a model needs none).
    pub fn backward(
        &mut self,
        x: &CudaTensor,
        grad_output: &CudaTensor,
        ones: &CudaTensor,
        need_input_grad: bool,
    ) -> DeviceResult<Option<CudaTensor>> {
        const OP: &str = "DeviceLinear::backward";
        let rows = self.check_matrix(OP, x, self.in_features)?;
        let grad_rows = self.check_matrix(OP, grad_output, self.out_features)?;
        if grad_rows != rows {
            return Err(DeviceError::BadShape {
                op: OP,
                expected: format!("a gradient [{rows}, {}]", self.out_features),
                actual: grad_output.shape().to_vec(),
            });
        }
        gemm(
            1.0,
            grad_output,
            Transpose::Yes,
            x,
            Transpose::No,
            1.0,
            &mut self.grad_weight,
        )?;
        if let Some(grad_bias) = &mut self.grad_bias {
            check_ones(OP, ones, rows, grad_output.dtype())?;
            gemm(
                1.0,
                ones,
                Transpose::Yes,
                grad_output,
                Transpose::No,
                1.0,
                grad_bias,
            )?;
        }
        if !need_input_grad {
            return Ok(None);
        }
        let mut dx = CudaTensor::zeros(x.device(), &[rows, self.in_features], x.dtype())?;
        gemm(
            1.0,
            grad_output,
            Transpose::No,
            &self.weight,
            Transpose::No,
            0.0,
            &mut dx,
        )?;
        Ok(Some(dx))
    }

    /// Zeroes the accumulated gradients.
    pub fn zero_grad(&mut self) -> DeviceResult<()> {
        self.grad_weight.zero_()?;
        if let Some(grad_bias) = &mut self.grad_bias {
            grad_bias.zero_()?;
        }
        Ok(())
    }

    /// Plain SGD in place: `p −= lr · grad` for the weight and the bias (the tensor crate's
    /// `axpy_`, one rounding in the compute type, as the CPU `Sgd` without momentum).
    pub fn sgd_step(&mut self, lr: f64) -> DeviceResult<()> {
        self.weight.axpy_(-lr, &self.grad_weight)?;
        if let (Some(bias), Some(grad_bias)) = (&mut self.bias, &self.grad_bias) {
            bias.axpy_(-lr, grad_bias)?;
        }
        Ok(())
    }

    /// The layer back on the host, as a CPU [`Linear`]; with `grads`, each parameter's `grad`
    /// is the device gradient.
    pub fn to_cpu(&self, grads: bool) -> DeviceResult<Linear> {
        let weight = self.weight.to_host()?;
        let bias = self
            .bias
            .as_ref()
            .map(|b| {
                b.to_host()?
                    .reshape(&[self.out_features])
                    .map_err(DeviceError::from)
            })
            .transpose()?;
        let mut linear = Linear::from_tensors(weight, bias)?;
        if grads {
            linear.weight.grad = Some(self.grad_weight.to_host()?);
            if let (Some(param), Some(grad)) = (&mut linear.bias, &self.grad_bias) {
                param.grad = Some(grad.to_host()?.reshape(&[self.out_features])?);
            }
        }
        Ok(linear)
    }
}

/// Reads a CPU parameter for the device: materialised and wanting a gradient.
pub(crate) fn host_param<'a>(
    op: &'static str,
    name: &str,
    param: &'a Parameter,
) -> DeviceResult<&'a Tensor> {
    if !param.requires_grad {
        return Err(DeviceError::FrozenParameter {
            op,
            name: name.to_string(),
        });
    }
    Ok(param.data()?)
}

/// Checks that `ones` is the `[rows, 1]` column the bias GEMMs need, in `dtype`.
fn check_ones(op: &'static str, ones: &CudaTensor, rows: usize, dtype: DType) -> DeviceResult<()> {
    if ones.shape() != [rows, 1] {
        return Err(DeviceError::BadShape {
            op,
            expected: format!("a column of ones [{rows}, 1]"),
            actual: ones.shape().to_vec(),
        });
    }
    if ones.dtype() != dtype {
        return Err(DeviceError::DTypeMismatch {
            op,
            lhs: dtype,
            rhs: ones.dtype(),
        });
    }
    Ok(())
}
