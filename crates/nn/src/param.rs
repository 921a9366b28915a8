//! Parameters: named tensors with an optional gradient.

use hypershard_tensor::Tensor;

use crate::{Error, Result};

/// A trainable tensor, its accumulated gradient and whether it wants one.
///
/// `data` is `None` when the storage is not materialised on this rank (FSDP keeps only a shard
/// and frees the unsharded tensor between uses); [`Parameter::data`] then returns
/// [`Error::NotMaterialised`] naming the parameter instead of panicking.
#[derive(Debug, Clone)]
pub struct Parameter {
    /// The name used in errors. Modules set it to the local name (`"weight"`); a wrapper that
    /// knows the full dotted path may overwrite it.
    pub name: String,
    /// The values, or `None` while not materialised.
    pub data: Option<Tensor>,
    /// The accumulated gradient, `None` until the first backward (as `param.grad` in torch).
    pub grad: Option<Tensor>,
    /// Whether backward accumulates a gradient into this parameter.
    pub requires_grad: bool,
}

impl Parameter {
    /// A materialised parameter that requires a gradient.
    pub fn new(name: impl Into<String>, data: Tensor) -> Self {
        Parameter {
            name: name.into(),
            data: Some(data),
            grad: None,
            requires_grad: true,
        }
    }

    /// The values, or [`Error::NotMaterialised`] naming the parameter.
    pub fn data(&self) -> Result<&Tensor> {
        self.data.as_ref().ok_or_else(|| Error::NotMaterialised {
            name: self.name.clone(),
        })
    }

    /// Adds `grad` into the accumulated gradient (a no-op when `requires_grad` is false).
    ///
    /// The first gradient is stored as given, later ones are added in place, so gradient
    /// accumulation over micro-batches works as in torch. The gradient must have the
    /// parameter's shape and dtype.
    pub fn accumulate_grad(&mut self, grad: Tensor) -> Result<()> {
        if !self.requires_grad {
            return Ok(());
        }
        let data = self.data()?;
        if data.shape() != grad.shape() {
            return Err(Error::ShapeMismatch {
                op: "Parameter::accumulate_grad",
                lhs: data.shape().to_vec(),
                rhs: grad.shape().to_vec(),
            });
        }
        if data.dtype() != grad.dtype() {
            return Err(Error::DTypeMismatch {
                op: "Parameter::accumulate_grad",
                lhs: data.dtype(),
                rhs: grad.dtype(),
            });
        }
        match &self.grad {
            Some(existing) => existing.add_(&grad)?,
            None => self.grad = Some(grad),
        }
        Ok(())
    }

    /// Drops the accumulated gradient (torch's `zero_grad(set_to_none=True)`).
    pub fn clear_grad(&mut self) {
        self.grad = None;
    }
}
