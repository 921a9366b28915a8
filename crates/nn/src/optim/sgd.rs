//! Stochastic gradient descent with torch.optim.SGD's semantics.

use std::collections::BTreeMap;

use hypershard_tensor::Tensor;

use super::{check_non_negative, step_inputs, write_f64};
use crate::kernels::load_f64;
use crate::{Error, Module, Parameter, Result};

/// The hyper-parameters of [`Sgd`]; `Default` gives torch's defaults.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SgdConfig {
    /// The learning rate (torch: 1e-3).
    pub lr: f64,
    /// The momentum factor (torch: 0).
    pub momentum: f64,
    /// The dampening of the momentum (torch: 0).
    pub dampening: f64,
    /// The L2 penalty added to the gradient (torch: 0).
    pub weight_decay: f64,
    /// Nesterov momentum (torch: false); needs `momentum > 0` and `dampening == 0`.
    pub nesterov: bool,
}

impl Default for SgdConfig {
    fn default() -> Self {
        SgdConfig {
            lr: 1e-3,
            momentum: 0.0,
            dampening: 0.0,
            weight_decay: 0.0,
            nesterov: false,
        }
    }
}

/// SGD: with `g = grad + weight_decay·p`, the momentum buffer is `b = g` on the first step
/// and `b = momentum·b + (1 − dampening)·g` afterwards; the step direction is `g +
/// momentum·b` (Nesterov) or `b`, or `g` without momentum; then `p −= lr·direction`.
#[derive(Debug)]
pub struct Sgd {
    config: SgdConfig,
    momentum_buffers: BTreeMap<String, Tensor>,
}

impl Sgd {
    /// An optimizer with the given hyper-parameters, validated as torch validates them.
    pub fn new(config: SgdConfig) -> Result<Self> {
        const OP: &str = "Sgd::new";
        check_non_negative(OP, "lr", config.lr)?;
        check_non_negative(OP, "momentum", config.momentum)?;
        check_non_negative(OP, "dampening", config.dampening)?;
        check_non_negative(OP, "weight_decay", config.weight_decay)?;
        if config.nesterov && (config.momentum <= 0.0 || config.dampening != 0.0) {
            return Err(Error::InvalidConfig {
                op: OP,
                field: "nesterov",
                value: config.momentum,
                reason: "Nesterov momentum requires momentum > 0 and dampening = 0",
            });
        }
        Ok(Sgd {
            config,
            momentum_buffers: BTreeMap::new(),
        })
    }

    /// The hyper-parameters (the learning rate may be changed between steps).
    pub fn config_mut(&mut self) -> &mut SgdConfig {
        &mut self.config
    }

    /// The momentum buffer of the parameter named `name`, once it exists.
    pub fn momentum_buffer(&self, name: &str) -> Option<&Tensor> {
        self.momentum_buffers.get(name)
    }

    /// Steps every parameter of `module` that has a gradient.
    pub fn step(&mut self, module: &mut dyn Module) -> Result<()> {
        module.visit_params_mut("", &mut |name, param| self.step_param(name, param))
    }

    /// Steps one parameter, keeping its state under `name`.
    pub fn step_param(&mut self, name: &str, param: &mut Parameter) -> Result<()> {
        if self.config.momentum == 0.0 && self.config.weight_decay == 0.0 {
            // Plain SGD: `p -= lr · g` in place, in the dtype's compute precision with one
            // rounding (as torch's f32 kernel), without the f64 round trip of the general path.
            let Some(grad) = &param.grad else {
                return Ok(());
            };
            let data = param.data()?;
            if data.shape() != grad.shape() {
                return Err(Error::ShapeMismatch {
                    op: "Sgd::step",
                    lhs: data.shape().to_vec(),
                    rhs: grad.shape().to_vec(),
                });
            }
            if data.dtype() != grad.dtype() {
                return Err(Error::DTypeMismatch {
                    op: "Sgd::step",
                    lhs: data.dtype(),
                    rhs: grad.dtype(),
                });
            }
            // `axpy` runs where the tensors are and refuses two devices.
            data.axpy(-self.config.lr, grad)?;
            return Ok(());
        }
        #[cfg(feature = "cuda")]
        if let Some(grad) = &param.grad
            && grad.device().is_cuda()
        {
            return self.step_on_cuda(name, param.data()?, grad);
        }
        let Some(inputs) = step_inputs("Sgd::step", param)? else {
            return Ok(());
        };
        let SgdConfig {
            lr,
            momentum,
            dampening,
            weight_decay,
            nesterov,
        } = self.config;
        let mut values = inputs.values;
        let mut grad = inputs.grad;
        if weight_decay != 0.0 {
            grad.iter_mut()
                .zip(&values)
                .for_each(|(g, p)| *g += weight_decay * p);
        }
        if momentum != 0.0 {
            let buffer = match self.momentum_buffers.get(name) {
                None => grad.clone(),
                Some(existing) => load_f64(existing)?
                    .iter()
                    .zip(&grad)
                    .map(|(b, g)| momentum * b + (1.0 - dampening) * g)
                    .collect(),
            };
            if nesterov {
                grad.iter_mut()
                    .zip(&buffer)
                    .for_each(|(g, b)| *g += momentum * b);
            } else {
                grad.clone_from(&buffer);
            }
            let data = param.data()?;
            let stored = match self.momentum_buffers.get(name) {
                Some(existing) => existing.clone(),
                None => Tensor::zeros_on(data.shape(), data.dtype(), &data.device())?,
            };
            write_f64(&stored, buffer)?;
            self.momentum_buffers.insert(name.to_string(), stored);
        }
        values.iter_mut().zip(&grad).for_each(|(p, g)| *p -= lr * g);
        write_f64(param.data()?, values)
    }

    /// The general step on a CUDA device: one kernel updates the parameter and its momentum
    /// buffer in place, with the host path's f64 arithmetic (so the same bits).
    #[cfg(feature = "cuda")]
    fn step_on_cuda(&mut self, name: &str, data: &Tensor, grad: &Tensor) -> Result<()> {
        let config = self.config;
        let momentum = if config.momentum != 0.0 {
            let first = !self.momentum_buffers.contains_key(name);
            let buffer = match self.momentum_buffers.entry(name.to_string()) {
                std::collections::btree_map::Entry::Occupied(entry) => entry.into_mut(),
                std::collections::btree_map::Entry::Vacant(entry) => entry.insert(
                    Tensor::zeros_on(data.shape(), data.dtype(), &data.device())?,
                ),
            };
            Some((&*buffer, first))
        } else {
            None
        };
        crate::kernels::cuda::sgd(data, grad, &config, momentum)
    }
}
