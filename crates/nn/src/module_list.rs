//! `ModuleList`: an indexed list of modules, named `0`, `1`, ... under a prefix.

use crate::module::{ChildVisitorMut, ParamVisitor, ParamVisitorMut, join_name};
use crate::{Module, Result};

/// Holds modules by index, as torch's `nn.ModuleList`, for a parent that decides how to call
/// them (a GPT runs its blocks in order, but a list could also be called selectively).
///
/// Like torch's, it has no `forward` of its own, so it is not a [`Module`]; the parent
/// forwards its visitors here with the list's own name as prefix (`transformer.h` gives
/// `transformer.h.0.ln_1.weight` and children `transformer.h.0`, ...). The modules are held
/// as owning boxes so a wrapper can replace one in place through
/// [`visit_children_mut`](ModuleList::visit_children_mut).
#[derive(Default)]
pub struct ModuleList {
    modules: Vec<Box<dyn Module>>,
}

impl std::fmt::Debug for ModuleList {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list()
            .entries(self.modules.iter().map(|m| m.kind()))
            .finish()
    }
}

impl ModuleList {
    /// A list of the given modules.
    pub fn new(modules: Vec<Box<dyn Module>>) -> Self {
        ModuleList { modules }
    }

    /// Appends a module.
    pub fn push(&mut self, module: Box<dyn Module>) {
        self.modules.push(module);
    }

    /// The number of modules.
    pub fn len(&self) -> usize {
        self.modules.len()
    }

    /// Whether the list is empty.
    pub fn is_empty(&self) -> bool {
        self.modules.is_empty()
    }

    /// The module at `index`.
    pub fn get(&self, index: usize) -> Option<&dyn Module> {
        self.modules.get(index).map(|m| m.as_ref())
    }

    /// The owning box at `index`, so the caller may call or replace it.
    pub fn get_mut(&mut self, index: usize) -> Option<&mut Box<dyn Module>> {
        self.modules.get_mut(index)
    }

    /// The modules in order.
    pub fn iter(&self) -> impl DoubleEndedIterator<Item = &dyn Module> {
        self.modules.iter().map(|m| m.as_ref())
    }

    /// The owning boxes in order.
    pub fn iter_mut(&mut self) -> impl DoubleEndedIterator<Item = &mut Box<dyn Module>> {
        self.modules.iter_mut()
    }

    /// Visits every module's parameters under `prefix.index`.
    pub fn visit_params(&self, prefix: &str, f: &mut ParamVisitor<'_>) -> Result<()> {
        for (index, module) in self.modules.iter().enumerate() {
            module.visit_params(&join_name(prefix, &index.to_string()), f)?;
        }
        Ok(())
    }

    /// Visits every module's parameters mutably under `prefix.index`.
    pub fn visit_params_mut(&mut self, prefix: &str, f: &mut ParamVisitorMut<'_>) -> Result<()> {
        for (index, module) in self.modules.iter_mut().enumerate() {
            module.visit_params_mut(&join_name(prefix, &index.to_string()), f)?;
        }
        Ok(())
    }

    /// Hands every module to `f` as a child named `prefix.index` (just `index` with an empty
    /// prefix).
    pub fn visit_children_mut(&mut self, prefix: &str, f: &mut ChildVisitorMut<'_>) -> Result<()> {
        for (index, module) in self.modules.iter_mut().enumerate() {
            f(&join_name(prefix, &index.to_string()), module)?;
        }
        Ok(())
    }
}
