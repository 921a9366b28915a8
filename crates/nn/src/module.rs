//! The `Module` trait: explicit forward and backward, parameter and child visitors.

use hypershard_tensor::{Device, Tensor};

use crate::{Parameter, Result};

/// A visitor over parameters by shared reference, called with the full dotted name.
pub type ParamVisitor<'a> = dyn FnMut(&str, &Parameter) -> Result<()> + 'a;
/// A visitor over parameters by mutable reference, called with the full dotted name.
pub type ParamVisitorMut<'a> = dyn FnMut(&str, &mut Parameter) -> Result<()> + 'a;
/// A visitor over the direct children of a module, called with the child's local name.
///
/// The child is handed out as the owning box so that a wrapper can replace it in place
/// (`fully_shard` swaps a block for its wrapped version this way, as FSDP2 swaps the class of
/// a module).
pub type ChildVisitorMut<'a> = dyn FnMut(&str, &mut Box<dyn Module>) -> Result<()> + 'a;

/// A layer with an explicit backward pass.
///
/// `forward` caches what `backward` needs; `backward` consumes that cache, accumulates
/// parameter gradients into [`Parameter::grad`] and returns the gradient of the input. A
/// second `backward` without a new `forward` is
/// [`Error::BackwardBeforeForward`](crate::Error::BackwardBeforeForward), as torch refuses
/// to backward through a freed graph.
///
/// Because the trait is object safe and every call goes through it, a wrapper (FSDP) can
/// implement `Module` around any inner module and run code before and after the inner
/// `forward` and `backward` (unshard, reshard, reduce-scatter) at exactly the module boundary.
///
/// Cached inputs are views sharing storage with the caller's tensors: writing into an input in
/// place between `forward` and `backward` changes the gradient (torch would detect this with
/// its version counter; we do not).
pub trait Module: Send {
    /// The kind of module (`"Linear"`), used in errors.
    fn kind(&self) -> &'static str;

    /// Computes the output and caches what `backward` needs.
    fn forward(&mut self, input: &Tensor) -> Result<Tensor>;

    /// Given the gradient of the output, accumulates parameter gradients and returns the
    /// gradient of the input.
    fn backward(&mut self, grad_output: &Tensor) -> Result<Tensor>;

    /// Calls `f` with every parameter and its full name (`prefix` joined with the local path by
    /// dots; an empty prefix gives `weight`, `0.weight`, ...).
    fn visit_params(&self, prefix: &str, f: &mut ParamVisitor<'_>) -> Result<()>;

    /// Calls `f` with every parameter, mutably, and its full name.
    fn visit_params_mut(&mut self, prefix: &str, f: &mut ParamVisitorMut<'_>) -> Result<()>;

    /// Calls `f` with each direct child and its local name. Leaves have no children.
    fn visit_children_mut(&mut self, f: &mut ChildVisitorMut<'_>) -> Result<()> {
        let _ = f;
        Ok(())
    }

    /// Switches between training and evaluation behaviour (torch's `train()` / `eval()`):
    /// only dropout changes. The default forwards the switch to every child, so containers and
    /// wrappers that expose their inner modules as children need not override it.
    fn set_training(&mut self, training: bool) -> Result<()> {
        self.visit_children_mut(&mut |_, child| child.set_training(training))
    }

    /// Drops what the last `forward` cached for `backward` (activation checkpointing frees a
    /// block's activations this way); a `backward` after it is
    /// [`Error::BackwardBeforeForward`](crate::Error::BackwardBeforeForward) until the next
    /// `forward`. The default clears every child; a module that caches anything itself
    /// overrides it (and still clears its children), so a module that does not only keeps
    /// its activations longer than asked, never computes a wrong gradient.
    fn clear_cache(&mut self) -> Result<()> {
        self.visit_children_mut(&mut |_, child| child.clear_cache())
    }

    /// Calls `f` with every random-stream counter of this module and the modules below it (a
    /// dropout layer's count of masks drawn), always in the same order, so that a
    /// recomputation can rewind them and draw the same masks again. The default visits the
    /// children; a module that draws random numbers itself, or holds modules it does not
    /// expose as children, overrides it.
    fn visit_rng_counters_mut(&mut self, f: &mut dyn FnMut(&mut u64)) -> Result<()> {
        self.visit_children_mut(&mut |_, child| child.visit_rng_counters_mut(&mut *f))
    }

    /// This module as `Any`, for wrappers that need to find their own kind among the children
    /// of a module (the outermost `fully_shard` unit discovers the nested units this way).
    /// Plain layers keep the default, `None`; `Dropout` offers itself, so attention can find
    /// its weights' dropout and draw the mask inside its tiled kernel.
    fn as_any_mut(&mut self) -> Option<&mut dyn std::any::Any> {
        None
    }
}

/// Replaces the module in `slot` by `wrap(old)`, for wrappers applied in place.
///
/// While `wrap` runs, the slot holds an [`Identity`]; if `wrap` fails, the error is returned and
/// the slot keeps the identity (the old module went into `wrap` by value and is lost with the
/// error, as in any by-value constructor).
pub fn replace_module(
    slot: &mut Box<dyn Module>,
    wrap: impl FnOnce(Box<dyn Module>) -> Result<Box<dyn Module>>,
) -> Result<()> {
    let old = std::mem::replace(slot, Box::new(Identity));
    *slot = wrap(old)?;
    Ok(())
}

/// The identity module: no parameters, output = input, input grad = output grad.
#[derive(Debug, Default, Clone, Copy)]
pub struct Identity;

impl Module for Identity {
    fn kind(&self) -> &'static str {
        "Identity"
    }

    fn forward(&mut self, input: &Tensor) -> Result<Tensor> {
        Ok(input.clone())
    }

    fn backward(&mut self, grad_output: &Tensor) -> Result<Tensor> {
        Ok(grad_output.clone())
    }

    fn visit_params(&self, _prefix: &str, _f: &mut ParamVisitor<'_>) -> Result<()> {
        Ok(())
    }

    fn visit_params_mut(&mut self, _prefix: &str, _f: &mut ParamVisitorMut<'_>) -> Result<()> {
        Ok(())
    }
}

/// Joins a prefix and a local name with a dot, as torch's `named_parameters` does.
pub fn join_name(prefix: &str, name: &str) -> String {
    if prefix.is_empty() {
        name.to_string()
    } else {
        format!("{prefix}.{name}")
    }
}

/// The names of all parameters of `module`, in visiting order.
pub fn parameter_names(module: &dyn Module) -> Result<Vec<String>> {
    let mut names = Vec::new();
    module.visit_params("", &mut |name, _| {
        names.push(name.to_string());
        Ok(())
    })?;
    Ok(names)
}

/// Clears every parameter's gradient (torch's `zero_grad(set_to_none=True)`).
pub fn zero_grad(module: &mut dyn Module) -> Result<()> {
    module.visit_params_mut("", &mut |_, param| {
        param.clear_grad();
        Ok(())
    })
}

/// Moves every parameter of `module`, and its gradient, to `device` (torch's
/// `module.to(device)`): layers run where their parameters are, so after this call the
/// module takes inputs on `device` and returns outputs and gradients there. Parameters
/// already on `device` are left as they are (no copy); a deferred (shape-only) parameter is
/// [`Error::Deferred`](crate::Error::Deferred): materialise it first.
///
/// ```
/// use hypershard_nn::{Linear, LinearConfig, Module, to_device};
/// use hypershard_tensor::{DType, Device, Tensor};
/// let device = Device::Emulated { ordinal: 0 };
/// let mut layer = Linear::new(LinearConfig {
///     in_features: 3,
///     out_features: 2,
///     bias: true,
///     dtype: DType::F32,
///     seed: 0,
/// })?;
/// to_device(&mut layer, &device)?;
/// let y = layer.forward(&Tensor::ones(&[4, 3], DType::F32)?.to_device(&device)?)?;
/// assert_eq!(y.device(), device);
/// # Ok::<(), hypershard_nn::Error>(())
/// ```
pub fn to_device(module: &mut dyn Module, device: &Device) -> Result<()> {
    module.visit_params_mut("", &mut |_, param| {
        let moved = param.data()?.to_device(device)?;
        param.data = Some(moved);
        if let Some(grad) = &param.grad {
            param.grad = Some(grad.to_device(device)?);
        }
        Ok(())
    })?;
    // Cached activations live where the old parameters were.
    module.clear_cache()
}

/// Sets every parameter's [`Parameter::name`] to its full dotted name, so errors such as
/// [`Error::NotMaterialised`](crate::Error::NotMaterialised) name `0.weight` rather than
/// `weight`. A wrapper calls this once on the root after building the model.
pub fn qualify_parameter_names(module: &mut dyn Module) -> Result<()> {
    module.visit_params_mut("", &mut |name, param| {
        param.name = name.to_string();
        Ok(())
    })
}
