//! AdamW over a rank's local parameter shards, with nanoGPT's weight-decay rule (decay only
//! parameters of 2 or more dims) and state that a checkpoint can save and restore.
//!
//! The update is nn's [`AdamWUpdate`], torch.optim.AdamW's rule computed in f64 and rounded
//! once into the parameter's dtype: `p *= 1 − lr·wd`; `m = β₁m + (1−β₁)g`;
//! `v = β₂v + (1−β₂)g²`; `p −= lr/(1−β₁ᵗ) · m / (√v/√(1−β₂ᵗ) + ε)`. It is elementwise, so
//! stepping each shard on its own rank is the same as stepping the whole tensor.
//!
//! The moments live beside their shard, on its device, and each shard's update is nn's
//! [`adamw_update`]: one in-place pass on the host, the `adamw_f32` kernel on a GPU. A
//! checkpoint copies them to the host.

use std::collections::BTreeMap;

use hypershard_nn::optim::{AdamWConfig, AdamWTensors, adamw_update};
use hypershard_nn::{Module, Parameter};
use hypershard_tensor::{DType, Tensor};

use super::config::OptimConfig;
use crate::error::{Error, Result};

/// One parameter's moments: f32, the local shard's shape, on the shard's device.
#[derive(Clone, Debug)]
pub struct Moments {
    /// First moment.
    pub exp_avg: Tensor,
    /// Second moment.
    pub exp_avg_sq: Tensor,
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
            .map(|m| ((m.exp_avg.numel() + m.exp_avg_sq.numel()) * size_of::<f32>()) as u64)
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
    let state = match moments.entry(name.to_string()) {
        std::collections::btree_map::Entry::Occupied(entry) => entry.into_mut(),
        std::collections::btree_map::Entry::Vacant(entry) => {
            let zeros = || {
                Tensor::zeros_on(data.shape(), DType::F32, &data.device())
                    .map_err(tensor_error(name))
            };
            entry.insert(Moments {
                exp_avg: zeros()?,
                exp_avg_sq: zeros()?,
            })
        }
    };
    if state.exp_avg.shape() != data.shape() || state.exp_avg_sq.shape() != data.shape() {
        return Err(Error::InconsistentTensor {
            name: name.to_string(),
            reason: format!(
                "optimizer state of {} elements for a shard of {len}",
                state.exp_avg.numel(),
            ),
        });
    }
    let weight_decay = if data.ndim() >= 2 {
        config.weight_decay
    } else {
        0.0
    };
    adamw_update(
        AdamWTensors {
            param: data,
            grad,
            exp_avg: &state.exp_avg,
            exp_avg_sq: &state.exp_avg_sq,
        },
        &AdamWConfig {
            lr,
            betas: (config.beta1, config.beta2),
            eps: config.eps,
            weight_decay,
        },
        step,
    )
    .map_err(Error::from)
}

/// A saved moment brought back as f32 in the shard's shape onto its device.
pub fn restored_moment(name: &str, saved: &Tensor, shard: &Tensor) -> Result<Tensor> {
    saved
        .to_dtype(DType::F32)
        .and_then(|t| t.reshape(shard.shape()))
        .and_then(|t| t.to_device(&shard.device()))
        .map_err(tensor_error(name))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::train::config::LrSchedule;
    use hypershard_nn::optim::{AdamW, AdamWConfig};
    use hypershard_nn::{Linear, LinearConfig};
    use hypershard_tensor::Device;

    /// AdamW at a constant `lr`, β = (0.9, 0.95), weight decay 0.1, no clipping.
    fn constant_lr(lr: f64) -> OptimConfig {
        OptimConfig {
            lr,
            min_lr: 0.0,
            warmup_steps: 0,
            schedule: LrSchedule::Constant,
            decay_steps: None,
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            weight_decay: 0.1,
            grad_clip: 0.0,
        }
    }

    #[test]
    fn matches_nn_adamw_with_decay_on_matrices_only() {
        let config = constant_lr(0.1);
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

    /// On a device the moments are made there and the update runs there, with the host's
    /// bits (the emulated device runs the host kernels behind the device API).
    #[test]
    fn moments_live_on_the_shards_device_and_match_the_host_run() {
        let config = constant_lr(0.05);
        let device = Device::Emulated { ordinal: 0 };
        let run = |device: Option<&Device>| {
            let mut model = Linear::new(LinearConfig {
                in_features: 5,
                out_features: 3,
                bias: true,
                dtype: DType::F32,
                seed: 4,
            })
            .unwrap();
            let mut x =
                Tensor::from_vec((0..10).map(|i| i as f32 * 0.1 - 0.4).collect(), &[2, 5]).unwrap();
            if let Some(device) = device {
                hypershard_nn::to_device(&mut model, device).unwrap();
                x = x.to_device(device).unwrap();
            }
            let mut optimizer = ShardedAdamW::new(config);
            for _ in 0..3 {
                hypershard_nn::zero_grad(&mut model).unwrap();
                let y = model.forward(&x).unwrap();
                model.backward(&y).unwrap();
                optimizer.step(&mut model, 0.05).unwrap();
            }
            let mut values = Vec::new();
            model
                .visit_params("", &mut |_, p| {
                    values.extend(p.data()?.to_host()?.to_vec::<f32>()?);
                    Ok(())
                })
                .unwrap();
            for moments in optimizer.moments.values() {
                for m in [&moments.exp_avg, &moments.exp_avg_sq] {
                    assert_eq!(m.device(), device.copied().unwrap_or(Device::Cpu));
                    values.extend(m.to_host().unwrap().to_vec::<f32>().unwrap());
                }
            }
            assert_eq!(optimizer.moment_bytes(), 2 * (15 + 3) * 4);
            values
        };
        let (host, on_device) = (run(None), run(Some(&device)));
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&host), bits(&on_device));
        assert!(host.iter().any(|&v| v != 0.0));
    }
}
