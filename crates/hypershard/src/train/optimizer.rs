//! AdamW over a rank's local parameter shards, with nanoGPT's weight-decay rule (decay only
//! parameters of 2 or more dims) and state that a checkpoint can save and restore.
//!
//! The update is nn's [`AdamWUpdate`], torch.optim.AdamW's rule computed in f64 and rounded
//! once into the parameter's dtype: `p *= 1 − lr·wd`; `m = β₁m + (1−β₁)g`;
//! `v = β₂v + (1−β₂)g²`; `p −= lr/(1−β₁ᵗ) · m / (√v/√(1−β₂ᵗ) + ε)`. It is elementwise, so
//! stepping each shard on its own rank is the same as stepping the whole tensor.

use std::collections::BTreeMap;

use hypershard_nn::optim::{AdamWConfig, AdamWUpdate};
use hypershard_nn::{Module, Parameter};
use hypershard_tensor::{DType, Tensor};

use super::config::OptimConfig;
use crate::error::{Error, Result};

/// One parameter's moments (f32, the local shard's shape).
#[derive(Clone, Debug)]
pub struct Moments {
    /// First moment.
    pub exp_avg: Vec<f32>,
    /// Second moment.
    pub exp_avg_sq: Vec<f32>,
}

/// AdamW state for every local shard, by parameter name.
#[derive(Debug)]
pub struct ShardedAdamW {
    config: OptimConfig,
    /// Optimizer steps taken (the same for every parameter).
    pub step: u64,
    /// Moments by parameter name.
    pub moments: BTreeMap<String, Moments>,
}

fn tensor_error(name: &str) -> impl Fn(hypershard_tensor::Error) -> Error + '_ {
    move |source| Error::Tensor {
        name: name.to_string(),
        source,
    }
}

impl ShardedAdamW {
    /// A fresh optimizer.
    pub fn new(config: OptimConfig) -> ShardedAdamW {
        ShardedAdamW {
            config,
            step: 0,
            moments: BTreeMap::new(),
        }
    }

    /// Bytes of the moments held (both moments of every local shard, f32).
    pub fn moment_bytes(&self) -> u64 {
        self.moments
            .values()
            .map(|m| ((m.exp_avg.len() + m.exp_avg_sq.len()) * size_of::<f32>()) as u64)
            .sum()
    }

    /// Steps every parameter of `module` that has a gradient, at learning rate `lr`.
    pub fn step(&mut self, module: &mut dyn Module, lr: f64) -> Result<()> {
        self.step += 1;
        let step = self.step;
        let config = self.config;
        let moments = &mut self.moments;
        let mut failure: Option<Error> = None;
        module.visit_params_mut("", &mut |name, param| {
            if failure.is_none()
                && let Err(error) = step_one(&config, step, lr, moments, name, param)
            {
                failure = Some(error);
            }
            Ok(())
        })?;
        failure.map_or(Ok(()), Err)
    }
}

fn step_one(
    config: &OptimConfig,
    step: u64,
    lr: f64,
    moments: &mut BTreeMap<String, Moments>,
    name: &str,
    param: &mut Parameter,
) -> Result<()> {
    let Some(grad) = &param.grad else {
        return Ok(());
    };
    let data = param.data().map_err(Error::from)?;
    let len = data.numel();
    if grad.numel() != len {
        return Err(Error::InconsistentTensor {
            name: name.to_string(),
            reason: format!("gradient of {} elements for {len} values", grad.numel()),
        });
    }
    let state = moments.entry(name.to_string()).or_insert_with(|| Moments {
        exp_avg: vec![0.0; len],
        exp_avg_sq: vec![0.0; len],
    });
    if state.exp_avg.len() != len {
        return Err(Error::InconsistentTensor {
            name: name.to_string(),
            reason: format!(
                "optimizer state of {} elements for a shard of {len}",
                state.exp_avg.len(),
            ),
        });
    }
    let weight_decay = if data.ndim() >= 2 {
        config.weight_decay
    } else {
        0.0
    };
    let update = AdamWUpdate::new(
        &AdamWConfig {
            lr,
            betas: (config.beta1, config.beta2),
            eps: config.eps,
            weight_decay,
        },
        step,
    );
    let in_place = data.dtype() == DType::F32
        && grad.dtype() == DType::F32
        && data.is_contiguous()
        && grad.is_contiguous()
        && !grad.shares_storage(data);
    if in_place {
        // The common case (f32 master shards and gradients): one pass over the shard, with
        // no copy of the values or the gradient, spread over the rank's kernel threads.
        // Kernels where the shard lives (on the host, exactly `with_data`).
        let nested = grad.with_kernel_data::<f32, _>("adamw", |g| {
            data.with_kernel_data_mut::<f32, _>("adamw", |p| {
                update.apply_f32(p, &mut state.exp_avg, &mut state.exp_avg_sq, g)
            })
        });
        return nested
            .and_then(|inner| inner)
            .map_err(tensor_error(name))?
            .map_err(Error::from);
    }
    // Any other dtype or layout: the same arithmetic through f64 copies, so both paths give
    // the same bits for f32.
    let grad = grad
        .to_host()
        .and_then(|g| g.to_f64_vec())
        .map_err(tensor_error(name))?;
    let mut values = data
        .to_host()
        .and_then(|d| d.to_f64_vec())
        .map_err(tensor_error(name))?;
    for (((p, m), v), &g) in values
        .iter_mut()
        .zip(state.exp_avg.iter_mut())
        .zip(state.exp_avg_sq.iter_mut())
        .zip(&grad)
    {
        let (mut m64, mut v64) = (f64::from(*m), f64::from(*v));
        *p = update.apply(*p, &mut m64, &mut v64, g);
        *m = m64 as f32;
        *v = v64 as f32;
    }
    let updated =
        Tensor::from_vec_on(values, data.shape(), &data.device()).map_err(tensor_error(name))?;
    data.copy_from(&updated).map_err(tensor_error(name))
}

/// The f32 tensor of a moment vector in `shape`.
pub fn moment_tensor(name: &str, values: &[f32], shape: &[usize]) -> Result<Tensor> {
    Tensor::from_slice(values, shape).map_err(tensor_error(name))
}

/// Reads a moment tensor back (cast to f32 if saved otherwise).
pub fn moment_values(name: &str, tensor: &Tensor) -> Result<Vec<f32>> {
    let tensor = tensor.to_dtype(DType::F32).map_err(tensor_error(name))?;
    tensor.to_vec::<f32>().map_err(tensor_error(name))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::train::config::LrSchedule;
    use hypershard_nn::optim::{AdamW, AdamWConfig};
    use hypershard_nn::{Linear, LinearConfig};

    #[test]
    fn matches_nn_adamw_with_decay_on_matrices_only() {
        let config = OptimConfig {
            lr: 0.1,
            min_lr: 0.0,
            warmup_steps: 0,
            schedule: LrSchedule::Constant,
            decay_steps: None,
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            weight_decay: 0.1,
            grad_clip: 0.0,
        };
        let linear = |seed| {
            Linear::new(LinearConfig {
                in_features: 3,
                out_features: 2,
                bias: true,
                dtype: DType::F64,
                seed,
            })
            .unwrap()
        };
        let (mut ours_model, mut reference_model) = (linear(1), linear(1));
        let mut ours = ShardedAdamW::new(config);
        // The reference: nn's AdamW with decay for the weight, none for the bias.
        let decay = |wd| {
            AdamW::new(AdamWConfig {
                lr: 0.1,
                betas: (0.9, 0.95),
                eps: 1e-8,
                weight_decay: wd,
            })
            .unwrap()
        };
        let (mut with_decay, mut without) = (decay(0.1), decay(0.0));
        let x = Tensor::from_vec(vec![1.0f64, -2.0, 0.5, 0.3, 0.2, -0.1], &[2, 3]).unwrap();
        for _ in 0..3 {
            for model in [&mut ours_model, &mut reference_model] {
                hypershard_nn::zero_grad(model).unwrap();
                let y = model.forward(&x).unwrap();
                model.backward(&y).unwrap();
            }
            ours.step(&mut ours_model, 0.1).unwrap();
            reference_model
                .visit_params_mut("", &mut |name, p| {
                    if p.data()?.ndim() >= 2 {
                        with_decay.step_param(name, p)
                    } else {
                        without.step_param(name, p)
                    }
                })
                .unwrap();
        }
        let values = |m: &Linear| {
            let mut out = Vec::new();
            m.visit_params("", &mut |_, p| {
                out.extend(p.data()?.to_f64_vec()?);
                Ok(())
            })
            .unwrap();
            out
        };
        for (a, b) in values(&ours_model).iter().zip(values(&reference_model)) {
            // Our moments are stored in f32, the reference's in f64.
            assert!((a - b).abs() < 1e-6, "{a} vs {b}");
        }
        assert_eq!(ours.step, 3);
    }
}
