//! Global-norm gradient clipping (torch's `clip_grad_norm_`).

use crate::kernels::{host_only, load_f64};
use crate::{Module, Parameter, Result};

/// The op the clipping's errors name (it has no CUDA kernel).
const OP: &str = "clip_grad_norm";

/// Scales every gradient of `module` so that their joint L2 norm is at most `max_norm`, and
/// returns the norm before clipping.
///
/// As in torch, the scale is `max_norm / (total_norm + 1e-6)` and is applied only when it is
/// below 1; the norm is accumulated in f64 over all gradients. A non-finite norm is returned
/// as is (torch's `error_if_nonfinite=False`).
pub fn clip_grad_norm(module: &mut dyn Module, max_norm: f64) -> Result<f64> {
    // The visitors cannot hand out references that outlive them, so one pass sums the squares
    // and a second one scales.
    let mut sum_sq = 0.0;
    module.visit_params("", &mut |_, param| {
        if let Some(grad) = &param.grad {
            host_only(OP, &grad.device())?;
            sum_sq += load_f64(grad)?.iter().map(|g| g * g).sum::<f64>();
        }
        Ok(())
    })?;
    let total_norm = sum_sq.sqrt();
    let coef = max_norm / (total_norm + 1e-6);
    if coef < 1.0 {
        module.visit_params_mut("", &mut |_, param| {
            if let Some(grad) = &param.grad {
                grad.scale_(coef)?;
            }
            Ok(())
        })?;
    }
    Ok(total_norm)
}

/// [`clip_grad_norm`] over an explicit set of parameters.
pub fn clip_grad_norm_params(params: &mut [&mut Parameter], max_norm: f64) -> Result<f64> {
    let mut sum_sq = 0.0;
    for param in params.iter() {
        if let Some(grad) = &param.grad {
            host_only(OP, &grad.device())?;
            sum_sq += load_f64(grad)?.iter().map(|g| g * g).sum::<f64>();
        }
    }
    let total_norm = sum_sq.sqrt();
    let coef = max_norm / (total_norm + 1e-6);
    if coef < 1.0 {
        for param in params.iter() {
            if let Some(grad) = &param.grad {
                grad.scale_(coef)?;
            }
        }
    }
    Ok(total_norm)
}
