//! AdamW with torch.optim.AdamW's semantics and defaults.

use std::collections::BTreeMap;

use hypershard_tensor::Tensor;

use super::{check_non_negative, step_inputs, write_f64};
use crate::{Error, Module, Parameter, Result};

/// The hyper-parameters of [`AdamW`]; `Default` gives torch's defaults.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamWConfig {
    /// The learning rate (torch: 1e-3).
    pub lr: f64,
    /// The decay rates of the first and second moments (torch: 0.9, 0.999).
    pub betas: (f64, f64),
    /// Added to the denominator (torch: 1e-8).
    pub eps: f64,
    /// The decoupled weight decay (torch: 1e-2).
    pub weight_decay: f64,
}

impl Default for AdamWConfig {
    fn default() -> Self {
        AdamWConfig {
            lr: 1e-3,
            betas: (0.9, 0.999),
            eps: 1e-8,
            weight_decay: 1e-2,
        }
    }
}

/// The state of one parameter (torch's `state[p]`).
#[derive(Debug, Clone)]
pub struct AdamWState {
    /// The number of steps taken with this parameter.
    pub step: u64,
    /// The first moment estimate, in the parameter's dtype.
    pub exp_avg: Tensor,
    /// The second moment estimate, in the parameter's dtype.
    pub exp_avg_sq: Tensor,
}

/// AdamW: at step `t`, `p *= 1 − lr·wd`; `m = β₁m + (1−β₁)g`; `v = β₂v + (1−β₂)g²`;
/// `p −= lr/(1−β₁ᵗ) · m / (√v/√(1−β₂ᵗ) + eps)` (no amsgrad, no maximize).
#[derive(Debug)]
pub struct AdamW {
    config: AdamWConfig,
    state: BTreeMap<String, AdamWState>,
}

impl AdamW {
    /// An optimizer with the given hyper-parameters, validated as torch validates them.
    pub fn new(config: AdamWConfig) -> Result<Self> {
        const OP: &str = "AdamW::new";
        check_non_negative(OP, "lr", config.lr)?;
        check_non_negative(OP, "eps", config.eps)?;
        check_non_negative(OP, "weight_decay", config.weight_decay)?;
        for (field, beta) in [("betas.0", config.betas.0), ("betas.1", config.betas.1)] {
            if !(0.0..1.0).contains(&beta) {
                return Err(Error::InvalidConfig {
                    op: OP,
                    field,
                    value: beta,
                    reason: "must lie in [0, 1)",
                });
            }
        }
        Ok(AdamW {
            config,
            state: BTreeMap::new(),
        })
    }

    /// The hyper-parameters (the learning rate may be changed between steps).
    pub fn config_mut(&mut self) -> &mut AdamWConfig {
        &mut self.config
    }

    /// The state of the parameter named `name`, once it has been stepped.
    pub fn state(&self, name: &str) -> Option<&AdamWState> {
        self.state.get(name)
    }

    /// Steps every parameter of `module` that has a gradient.
    pub fn step(&mut self, module: &mut dyn Module) -> Result<()> {
        module.visit_params_mut("", &mut |name, param| self.step_param(name, param))
    }

    /// Steps one parameter, keeping its state under `name`.
    pub fn step_param(&mut self, name: &str, param: &mut Parameter) -> Result<()> {
        let Some(inputs) = step_inputs("AdamW::step", param)? else {
            return Ok(());
        };
        let AdamWConfig {
            lr,
            betas: (beta1, beta2),
            eps,
            weight_decay,
        } = self.config;
        let data = param.data()?;
        // The state tensors are cloned as views, so an error below leaves the stored state
        // (and the parameter) untouched.
        let state = match self.state.get(name) {
            Some(state) => state.clone(),
            None => AdamWState {
                step: 0,
                exp_avg: Tensor::zeros(data.shape(), data.dtype())?,
                exp_avg_sq: Tensor::zeros(data.shape(), data.dtype())?,
            },
        };
        let step = state.step + 1;
        let mut exp_avg = state.exp_avg.to_f64_vec()?;
        let mut exp_avg_sq = state.exp_avg_sq.to_f64_vec()?;
        let mut values = inputs.values;
        // The exponent only grows by one per step; saturating keeps it defined past i32::MAX.
        let exponent = i32::try_from(step).unwrap_or(i32::MAX);
        let bias_correction1 = 1.0 - beta1.powi(exponent);
        let bias_correction2_sqrt = (1.0 - beta2.powi(exponent)).sqrt();
        let step_size = lr / bias_correction1;
        for (((p, m), v), g) in values
            .iter_mut()
            .zip(exp_avg.iter_mut())
            .zip(exp_avg_sq.iter_mut())
            .zip(&inputs.grad)
        {
            *p *= 1.0 - lr * weight_decay;
            *m = beta1 * *m + (1.0 - beta1) * g;
            *v = beta2 * *v + (1.0 - beta2) * g * g;
            let denom = v.sqrt() / bias_correction2_sqrt + eps;
            *p -= step_size * *m / denom;
        }
        write_f64(&state.exp_avg, exp_avg)?;
        write_f64(&state.exp_avg_sq, exp_avg_sq)?;
        write_f64(data, values)?;
        self.state.insert(
            name.to_string(),
            AdamWState {
                step,
                exp_avg: state.exp_avg,
                exp_avg_sq: state.exp_avg_sq,
            },
        );
        Ok(())
    }
}
