//! AdamW with torch.optim.AdamW's semantics and defaults.

use std::collections::BTreeMap;

use hypershard_tensor::{DType, Tensor};

use super::{check_non_negative, write_f64};
use crate::kernels::vector_isa::vectorized;
use crate::kernels::{load_f64, same_device};
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
        const OP: &str = "AdamW::step";
        let Some(grad) = &param.grad else {
            return Ok(());
        };
        let data = param.data()?;
        if data.shape() != grad.shape() {
            return Err(Error::ShapeMismatch {
                op: OP,
                lhs: data.shape().to_vec(),
                rhs: grad.shape().to_vec(),
            });
        }
        if data.dtype() != grad.dtype() {
            return Err(Error::DTypeMismatch {
                op: OP,
                lhs: data.dtype(),
                rhs: grad.dtype(),
            });
        }
        let state = match self.state.get(name) {
            Some(state) => state.clone(),
            None => AdamWState {
                step: 0,
                exp_avg: Tensor::zeros_on(data.shape(), data.dtype(), &data.device())?,
                exp_avg_sq: Tensor::zeros_on(data.shape(), data.dtype(), &data.device())?,
            },
        };
        if state.exp_avg.shape() != data.shape() {
            return Err(Error::ShapeMismatch {
                op: "AdamW::step (state of an earlier parameter under this name)",
                lhs: data.shape().to_vec(),
                rhs: state.exp_avg.shape().to_vec(),
            });
        }
        let step = state.step + 1;
        adamw_update(
            AdamWTensors {
                param: data,
                grad,
                exp_avg: &state.exp_avg,
                exp_avg_sq: &state.exp_avg_sq,
            },
            &self.config,
            step,
        )?;
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

/// The four tensors of one AdamW update: the parameter, its gradient and its two moments,
/// all of the parameter's shape and on one device.
#[derive(Debug, Clone, Copy)]
pub struct AdamWTensors<'a> {
    /// The parameter, updated in place.
    pub param: &'a Tensor,
    /// Its gradient.
    pub grad: &'a Tensor,
    /// The first moment, updated in place.
    pub exp_avg: &'a Tensor,
    /// The second moment, updated in place.
    pub exp_avg_sq: &'a Tensor,
}

/// Step `step` (1 for the first) of AdamW on one parameter, in place, wherever its tensors
/// live: the `adamw_f32` kernel on a CUDA device; on the host (and the emulated device) one
/// pass over the four f32 arrays spread over the kernel threads, or f64 copies rounded once
/// into each tensor for other dtypes and layouts. Both host paths give the same bits for f32.
/// What [`AdamW`] runs for each parameter, for optimizers that keep their state elsewhere.
pub fn adamw_update(tensors: AdamWTensors<'_>, config: &AdamWConfig, step: u64) -> Result<()> {
    const OP: &str = "adamw_update";
    let AdamWTensors {
        param,
        grad,
        exp_avg,
        exp_avg_sq,
    } = tensors;
    for t in [grad, exp_avg, exp_avg_sq] {
        if t.shape() != param.shape() {
            return Err(Error::ShapeMismatch {
                op: OP,
                lhs: param.shape().to_vec(),
                rhs: t.shape().to_vec(),
            });
        }
    }
    let _device = same_device(OP, &[param, grad, exp_avg, exp_avg_sq])?;
    #[cfg(feature = "cuda")]
    if _device.is_cuda() {
        // The same update on the GPU, in place on the four arrays.
        return crate::kernels::cuda::adamw([param, exp_avg, exp_avg_sq, grad], config, step);
    }
    let update = AdamWUpdate::new(config, step);
    let all = [param, grad, exp_avg, exp_avg_sq];
    let all_f32_and_contiguous = all
        .iter()
        .all(|t| t.dtype() == DType::F32 && t.is_contiguous());
    // Four locks at once need four storages; aliased tensors take the copying path.
    let apart = all
        .iter()
        .enumerate()
        .all(|(i, a)| all[i + 1..].iter().all(|b| !a.shares_storage(b)));
    if all_f32_and_contiguous && apart {
        // The common case: one pass over the four arrays in place, no copies. The
        // arithmetic is the general path's, so both give the same bits.
        let nested = grad.with_kernel_data::<f32, _>(OP, |g| {
            param.with_kernel_data_mut::<f32, _>(OP, |p| {
                exp_avg.with_kernel_data_mut::<f32, _>(OP, |m| {
                    exp_avg_sq.with_kernel_data_mut::<f32, _>(OP, |v| update.apply_f32(p, m, v, g))
                })
            })
        });
        nested.and_then(|r| r).and_then(|r| r).and_then(|r| r)??;
    } else {
        // Any other dtype or layout: through f64 copies, rounded once into each tensor. All
        // are read before any is written, so an error leaves every tensor as it was.
        let mut values = load_f64(param)?;
        let grads = load_f64(grad)?;
        let mut first = load_f64(exp_avg)?;
        let mut second = load_f64(exp_avg_sq)?;
        for (((p, m), v), &g) in values
            .iter_mut()
            .zip(first.iter_mut())
            .zip(second.iter_mut())
            .zip(&grads)
        {
            *p = update.apply(*p, m, v, g);
        }
        write_f64(exp_avg, first)?;
        write_f64(exp_avg_sq, second)?;
        write_f64(param, values)?;
    }
    Ok(())
}

/// One AdamW step's arithmetic for every element of a parameter: torch's update rule in f64,
/// rounded once into each stored value. Shared by [`AdamW`] and any optimizer that keeps its
/// state elsewhere (the trainer keeps a rank's moments beside its local shards).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamWUpdate {
    beta1: f64,
    beta2: f64,
    eps: f64,
    /// `1 − lr·weight_decay`.
    decay: f64,
    /// `lr / (1 − β₁ᵗ)`.
    step_size: f64,
    /// `1 / √(1 − β₂ᵗ)`: the update multiplies by it where torch divides by `√(1 − β₂ᵗ)`,
    /// which differs by at most an ulp of f64, far below the f32 rounding of the result, and
    /// spares one of the update's two f64 divisions per element (its costliest instructions:
    /// 2.6 → 1.7 ns per element on one thread).
    inv_bias_correction2_sqrt: f64,
}

/// Elements per task of the parallel in-place update: large enough that scheduling costs
/// nothing next to the arithmetic, small enough that a 2-core pool splits a layer's shard.
const UPDATE_CHUNK: usize = 1 << 15;

impl AdamWUpdate {
    /// The update of step `step` (1 for the first) with `config`'s hyper-parameters.
    pub fn new(config: &AdamWConfig, step: u64) -> Self {
        // The exponent only grows by one per step; saturating keeps it defined past i32::MAX.
        let exponent = i32::try_from(step).unwrap_or(i32::MAX);
        let (beta1, beta2) = config.betas;
        AdamWUpdate {
            beta1,
            beta2,
            eps: config.eps,
            decay: 1.0 - config.lr * config.weight_decay,
            step_size: config.lr / (1.0 - beta1.powi(exponent)),
            inv_bias_correction2_sqrt: 1.0 / (1.0 - beta2.powi(exponent)).sqrt(),
        }
    }

    /// The updated value of one parameter element `p` with gradient `g`, updating its moments.
    #[inline]
    pub fn apply(&self, p: f64, m: &mut f64, v: &mut f64, g: f64) -> f64 {
        let p = p * self.decay;
        *m = self.beta1 * *m + (1.0 - self.beta1) * g;
        *v = self.beta2 * *v + (1.0 - self.beta2) * g * g;
        let denom = v.sqrt() * self.inv_bias_correction2_sqrt + self.eps;
        p - self.step_size * *m / denom
    }

    /// Updates f32 values and moments in place from an f32 gradient, element by element as
    /// [`apply`](Self::apply) (each moment rounded to f32 once, the parameter uses the unrounded
    /// moment), in parallel over the current rayon pool: the result does not depend on the
    /// number of threads. All four slices must have one length.
    pub fn apply_f32(
        &self,
        values: &mut [f32],
        exp_avg: &mut [f32],
        exp_avg_sq: &mut [f32],
        grad: &[f32],
    ) -> Result<()> {
        let len = values.len();
        for (op, other) in [
            ("AdamWUpdate::apply_f32 (values, exp_avg)", exp_avg.len()),
            (
                "AdamWUpdate::apply_f32 (values, exp_avg_sq)",
                exp_avg_sq.len(),
            ),
            ("AdamWUpdate::apply_f32 (values, grad)", grad.len()),
        ] {
            if other != len {
                return Err(Error::ShapeMismatch {
                    op,
                    lhs: vec![len],
                    rhs: vec![other],
                });
            }
        }
        let chunk = |((p, m), v): ((&mut [f32], &mut [f32]), &mut [f32]), g: &[f32]| {
            vectorized!(|| {
                for (((p, m), v), &g) in p.iter_mut().zip(m).zip(v).zip(g) {
                    let (mut m64, mut v64) = (f64::from(*m), f64::from(*v));
                    *p = self.apply(f64::from(*p), &mut m64, &mut v64, f64::from(g)) as f32;
                    *m = m64 as f32;
                    *v = v64 as f32;
                }
            })
        };
        if len <= UPDATE_CHUNK {
            chunk(((values, exp_avg), exp_avg_sq), grad);
        } else {
            use rayon::prelude::*;
            values
                .par_chunks_mut(UPDATE_CHUNK)
                .zip(exp_avg.par_chunks_mut(UPDATE_CHUNK))
                .zip(exp_avg_sq.par_chunks_mut(UPDATE_CHUNK))
                .zip(grad.par_chunks(UPDATE_CHUNK))
                .for_each(|(pmv, g)| chunk(pmv, g));
        }
        Ok(())
    }
}
