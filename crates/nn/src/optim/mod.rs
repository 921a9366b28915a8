//! Optimizers with torch.optim's update rules and defaults, and gradient clipping.
//!
//! An optimizer keeps per-parameter state keyed by the parameter's full name, so the same
//! optimizer can step a whole module ([`Sgd::step`]) or any set of parameters one at a time
//! ([`Sgd::step_param`]), for example the local shards an FSDP wrapper owns. Parameters whose
//! `grad` is `None` are skipped, as torch skips them. Updates are computed in f64 and rounded
//! once into the parameter's dtype; optimizer state is stored in the parameter's dtype, as
//! torch stores it.

mod adamw;
mod clip;
mod schedule;
mod sgd;

pub use adamw::{AdamW, AdamWConfig, AdamWState, AdamWTensors, AdamWUpdate, adamw_update};
pub use clip::{clip_grad_norm, clip_grad_norm_params, sum_of_squares};
pub use schedule::WarmupCosine;
pub use sgd::{Sgd, SgdConfig};

use hypershard_tensor::Tensor;

use crate::kernels::{load_f64, same_device};
use crate::{Error, Parameter, Result};

/// The values and gradient of one parameter, checked to agree in shape and dtype.
pub(crate) struct StepInputs {
    pub(crate) values: Vec<f64>,
    pub(crate) grad: Vec<f64>,
}

/// Reads a parameter's values and gradient, or `None` when it has no gradient.
pub(crate) fn step_inputs(op: &'static str, param: &Parameter) -> Result<Option<StepInputs>> {
    let Some(grad) = &param.grad else {
        return Ok(None);
    };
    let data = param.data()?;
    if data.shape() != grad.shape() {
        return Err(Error::ShapeMismatch {
            op,
            lhs: data.shape().to_vec(),
            rhs: grad.shape().to_vec(),
        });
    }
    if data.dtype() != grad.dtype() {
        return Err(Error::DTypeMismatch {
            op,
            lhs: data.dtype(),
            rhs: grad.dtype(),
        });
    }
    // The general update runs on the host only (plain SGD and AdamW have CUDA paths).
    crate::kernels::host_only(op, &same_device(op, &[data, grad])?)?;
    Ok(Some(StepInputs {
        values: load_f64(data)?,
        grad: load_f64(grad)?,
    }))
}

/// Writes f64 values into `target` (any dtype and layout), rounding once.
pub(crate) fn write_f64(target: &Tensor, values: Vec<f64>) -> Result<()> {
    target.copy_from(&Tensor::from_vec_on(
        values,
        target.shape(),
        &target.device(),
    )?)?;
    Ok(())
}

/// Errors unless `value` is finite and `>= 0`.
pub(crate) fn check_non_negative(op: &'static str, field: &'static str, value: f64) -> Result<()> {
    if value.is_finite() && value >= 0.0 {
        Ok(())
    } else {
        Err(Error::InvalidConfig {
            op,
            field,
            value,
            reason: "must be finite and non-negative",
        })
    }
}
