//! `Sequential`: modules applied in order, named `0`, `1`, ... as in torch.

use hypershard_tensor::Tensor;

use crate::module::{ChildVisitorMut, ParamVisitor, ParamVisitorMut, join_name};
use crate::{Module, Result};

/// Applies its children in order; backward runs them in reverse.
///
/// Parameters are named by the child's index, as torch's `nn.Sequential` does (`0.weight`,
/// `2.bias`). The children are public so a wrapper can replace one by a wrapped version.
#[derive(Default)]
pub struct Sequential {
    /// The children in application order.
    pub layers: Vec<Box<dyn Module>>,
}

impl std::fmt::Debug for Sequential {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list()
            .entries(self.layers.iter().map(|layer| layer.kind()))
            .finish()
    }
}

impl Sequential {
    /// A sequence of the given modules.
    pub fn new(layers: Vec<Box<dyn Module>>) -> Self {
        Sequential { layers }
    }

    /// Appends a module and returns `self`, for building in one expression.
    pub fn with(mut self, layer: impl Module + 'static) -> Self {
        self.layers.push(Box::new(layer));
        self
    }
}

impl Module for Sequential {
    fn kind(&self) -> &'static str {
        "Sequential"
    }

    fn forward(&mut self, input: &Tensor) -> Result<Tensor> {
        let mut x = input.clone();
        for layer in &mut self.layers {
            x = layer.forward(&x)?;
        }
        Ok(x)
    }

    fn backward(&mut self, grad_output: &Tensor) -> Result<Tensor> {
        let mut g = grad_output.clone();
        for layer in self.layers.iter_mut().rev() {
            g = layer.backward(&g)?;
        }
        Ok(g)
    }

    fn visit_params(&self, prefix: &str, f: &mut ParamVisitor<'_>) -> Result<()> {
        for (index, layer) in self.layers.iter().enumerate() {
            layer.visit_params(&join_name(prefix, &index.to_string()), f)?;
        }
        Ok(())
    }

    fn visit_params_mut(&mut self, prefix: &str, f: &mut ParamVisitorMut<'_>) -> Result<()> {
        for (index, layer) in self.layers.iter_mut().enumerate() {
            layer.visit_params_mut(&join_name(prefix, &index.to_string()), f)?;
        }
        Ok(())
    }

    fn visit_children_mut(&mut self, f: &mut ChildVisitorMut<'_>) -> Result<()> {
        for (index, layer) in self.layers.iter_mut().enumerate() {
            f(&index.to_string(), layer)?;
        }
        Ok(())
    }
}
