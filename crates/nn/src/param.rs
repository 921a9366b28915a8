//! Parameters: named tensors with an optional gradient.

use std::sync::Arc;

use hypershard_tensor::{DType, Tensor};

use crate::{Error, Result};

/// The block of a parameter an init hook must build: the global shape and dtype, and the
/// block's offset and shape in it (a row range of dim 0 for FSDP's `Shard(0)`).
#[derive(Debug, Clone, Copy)]
pub struct InitRequest<'a> {
    /// The parameter's name.
    pub name: &'a str,
    /// The shape of the whole parameter.
    pub global_shape: &'a [usize],
    /// The block's first index along every dim.
    pub offset: &'a [usize],
    /// The block's shape.
    pub shape: &'a [usize],
    /// The dtype the block must have.
    pub dtype: DType,
}

/// A per-parameter initialiser of deferred parameters (torch's `reset_parameters` after
/// `to_empty`, but per block): called with the block a rank owns, it returns exactly that
/// block. It must be a pure function of the request, so every rank's block agrees with the
/// same block of the whole tensor.
pub type InitFn = Arc<dyn Fn(InitRequest<'_>) -> Result<Tensor> + Send + Sync>;

/// A trainable tensor, its accumulated gradient and whether it wants one.
///
/// `data` is `None` when the storage is not materialised on this rank (FSDP keeps only a shard
/// and frees the unsharded tensor between uses); [`Parameter::data`] then returns
/// [`Error::NotMaterialised`] naming the parameter instead of panicking. A parameter built
/// inside [`deferred_init`](hypershard_tensor::deferred_init) holds a deferred tensor (shape
/// and dtype, no bytes); [`Parameter::data`] refuses it with [`Error::Deferred`] and
/// [`Parameter::materialize_block`] builds any block of it.
#[derive(Clone)]
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
    /// How to build a block of this parameter while it is deferred; when `None`, the deferred
    /// tensor's own recipe (its factory: zeros, ones, full, random) is used.
    pub init: Option<InitFn>,
}

impl std::fmt::Debug for Parameter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Parameter")
            .field("name", &self.name)
            .field("data", &self.data)
            .field("grad", &self.grad)
            .field("requires_grad", &self.requires_grad)
            .field("init", &self.init.as_ref().map(|_| "<fn>"))
            .finish()
    }
}

impl Parameter {
    /// A materialised parameter that requires a gradient.
    pub fn new(name: impl Into<String>, data: Tensor) -> Self {
        Parameter {
            name: name.into(),
            data: Some(data),
            grad: None,
            requires_grad: true,
            init: None,
        }
    }

    /// The values: [`Error::NotMaterialised`] when absent, [`Error::Deferred`] when the
    /// parameter is deferred, both naming the parameter.
    pub fn data(&self) -> Result<&Tensor> {
        let tensor = self.tensor()?;
        if tensor.is_deferred() {
            return Err(Error::Deferred {
                name: self.name.clone(),
            });
        }
        Ok(tensor)
    }

    /// The tensor whether or not it holds data (a deferred one has a shape and a dtype):
    /// what code that only needs shapes and dtypes reads.
    pub fn tensor(&self) -> Result<&Tensor> {
        self.data.as_ref().ok_or_else(|| Error::NotMaterialised {
            name: self.name.clone(),
        })
    }

    /// Whether the parameter is deferred (shape and dtype only).
    pub fn is_deferred(&self) -> bool {
        self.data.as_ref().is_some_and(Tensor::is_deferred)
    }

    /// Builds the block at `offset` of shape `shape` of a deferred parameter, alone, through
    /// its [`init`](Parameter::init) hook or else its tensor's recipe; the block equals the
    /// same block of the eagerly built parameter.
    pub fn materialize_block(&self, offset: &[usize], shape: &[usize]) -> Result<Tensor> {
        let tensor = self.tensor()?;
        let fail = |reason: String| Error::Materialize {
            name: self.name.clone(),
            reason,
        };
        if !tensor.is_deferred() {
            return Err(fail("it already holds data".into()));
        }
        let Some(init) = &self.init else {
            return tensor
                .materialize_block(offset, shape)
                .map_err(|error| fail(error.to_string()));
        };
        let block = init(InitRequest {
            name: &self.name,
            global_shape: tensor.shape(),
            offset,
            shape,
            dtype: tensor.dtype(),
        })?;
        if block.shape() != shape || block.dtype() != tensor.dtype() || block.is_deferred() {
            return Err(fail(format!(
                "the init hook returned a {} {:?}{} tensor for a {} {shape:?} block",
                block.dtype(),
                block.shape(),
                if block.is_deferred() { " deferred" } else { "" },
                tensor.dtype(),
            )));
        }
        Ok(block)
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

/// Materialises every deferred parameter of `module` in full, on this rank (torch's
/// `to_empty` + `reset_parameters` for a module that fits one rank). Values equal the eagerly
/// built module's, bit for bit. A model too big for one rank is materialised shard by shard
/// by `fully_shard` instead.
pub fn materialize_module(module: &mut dyn crate::Module) -> Result<()> {
    module.visit_params_mut("", &mut |_, param| {
        if param.is_deferred() {
            let shape = param.tensor()?.shape().to_vec();
            let zeros = vec![0; shape.len()];
            param.data = Some(param.materialize_block(&zeros, &shape)?);
        }
        Ok(())
    })
}
