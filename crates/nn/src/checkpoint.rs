//! State dicts: every parameter by its dotted name, to and from safetensors.

use std::collections::BTreeMap;
use std::path::Path;

use hypershard_tensor::Tensor;

use crate::{Error, Module, Result};

/// Every parameter's values by dotted name, in visiting order (torch's `state_dict()` without
/// buffers). The tensors share storage with the parameters, on their device; the safetensors
/// writers below copy device parameters to the host first.
pub fn state_dict(module: &dyn Module) -> Result<Vec<(String, Tensor)>> {
    let mut out = Vec::new();
    module.visit_params("", &mut |name, param| {
        out.push((name.to_string(), param.data()?.clone()));
        Ok(())
    })?;
    Ok(out)
}

/// Replaces every parameter's values by the tensor of the same name, cast to the parameter's
/// dtype (torch's strict `load_state_dict`).
///
/// Everything is checked before anything is replaced: a parameter without a tensor is
/// [`Error::MissingTensor`], a tensor of another shape [`Error::CheckpointShape`] and a tensor
/// without a parameter [`Error::UnexpectedTensor`], each naming the tensor; on error the
/// module is unchanged. Gradients are left as they are.
pub fn load_state_dict(module: &mut dyn Module, tensors: &BTreeMap<String, Tensor>) -> Result<()> {
    const OP: &str = "load_state_dict";
    let mut seen = Vec::new();
    module.visit_params("", &mut |name, param| {
        let data = param.tensor()?;
        let tensor = tensors.get(name).ok_or_else(|| Error::MissingTensor {
            op: OP,
            name: name.to_string(),
        })?;
        if tensor.shape() != data.shape() {
            return Err(Error::CheckpointShape {
                op: OP,
                name: name.to_string(),
                expected: data.shape().to_vec(),
                actual: tensor.shape().to_vec(),
            });
        }
        seen.push(name.to_string());
        Ok(())
    })?;
    if let Some(extra) = tensors.keys().find(|k| !seen.contains(k)) {
        return Err(Error::UnexpectedTensor {
            op: OP,
            name: extra.clone(),
        });
    }
    module.visit_params_mut("", &mut |name, param| {
        let (dtype, device) = (param.tensor()?.dtype(), param.tensor()?.device());
        let tensor = tensors.get(name).ok_or_else(|| Error::MissingTensor {
            op: OP,
            name: name.to_string(),
        })?;
        // A copy in new storage, so the module never aliases the caller's tensors; it goes
        // where the parameter is.
        let copy = tensor.to_dtype(dtype)?.deep_copy()?;
        param.data = Some(copy.to_device(&device)?);
        Ok(())
    })
}

/// The module's parameters as safetensors bytes, by dotted name.
pub fn save_safetensors(module: &dyn Module) -> Result<Vec<u8>> {
    let tensors = host_state_dict(module)?;
    Ok(hypershard_tensor::save_safetensors(
        tensors.iter().map(|(n, t)| (n.as_str(), t)),
    )?)
}

/// Writes the module's parameters to a safetensors file.
pub fn save_safetensors_file(module: &dyn Module, path: &Path) -> Result<()> {
    let tensors = host_state_dict(module)?;
    Ok(hypershard_tensor::save_safetensors_file(
        tensors.iter().map(|(n, t)| (n.as_str(), t)),
        path,
    )?)
}

/// [`state_dict`] with every tensor on the host (host tensors as they are).
fn host_state_dict(module: &dyn Module) -> Result<Vec<(String, Tensor)>> {
    state_dict(module)?
        .into_iter()
        .map(|(name, t)| Ok((name, t.to_host()?)))
        .collect()
}

/// Loads safetensors bytes into the module with [`load_state_dict`]'s checks.
pub fn load_safetensors(module: &mut dyn Module, bytes: &[u8]) -> Result<()> {
    load_state_dict(module, &hypershard_tensor::load_safetensors(bytes)?)
}
