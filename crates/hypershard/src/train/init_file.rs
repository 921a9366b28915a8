//! `--init FILE`: initial weights from a safetensors file, read shard by shard.
//!
//! The model is built deferred, so its parameters have shapes but no bytes. [`attach_init_file`]
//! checks the file against the model (every parameter present with its shape, nothing left
//! over) and gives every parameter an init hook that reads only the rows it is asked for:
//! `fully_shard` then asks each rank for its `Shard(0)` block, so a rank reads its own rows of
//! every tensor and nothing else (one contiguous byte range per tensor, since safetensors is
//! row-major). A parameter that is not deferred is loaded whole, at once.

use std::path::Path;
use std::sync::Arc;

use hypershard_nn::{InitRequest, Module};
use hypershard_tensor::Tensor;

use crate::checkpoint::SafetensorsIndex;
use crate::error::{Error, Result};

/// Names a nanoGPT `state_dict` holds that are not parameters here: the lm_head (tied to
/// `wte`) and the causal-mask buffers of versions without flash attention.
fn is_skipped(name: &str) -> bool {
    name == "lm_head.weight" || name.ends_with(".attn.bias") || name.ends_with(".attn.masked_bias")
}

fn init_error(path: &Path, reason: String) -> Error {
    Error::InitFile {
        path: path.to_path_buf(),
        reason,
    }
}

/// Reads the block `request` asks for from the tensor `stored_name` of `index`: its rows of
/// dim 0 as one byte range, the other dims narrowed afterwards, cast to the parameter's dtype.
pub(super) fn read_block(
    index: &SafetensorsIndex,
    stored_name: &str,
    request: InitRequest<'_>,
) -> std::result::Result<Tensor, Error> {
    let (start, len) = match (request.offset.first(), request.shape.first()) {
        (Some(&start), Some(&len)) => (start, len),
        // A 0-d parameter is one element.
        _ => (0, 1),
    };
    let (stored, bytes) = index.read_rows(stored_name, start, len)?;
    let mut rows_shape = stored.shape.clone();
    if let Some(first) = rows_shape.first_mut() {
        *first = len;
    }
    let tensor_error = |source| Error::Tensor {
        name: request.name.to_string(),
        source,
    };
    let mut block = Tensor::from_bytes(&bytes, &rows_shape, stored.dtype).map_err(tensor_error)?;
    let wanted = request.offset.iter().zip(request.shape).zip(&rows_shape);
    for (dim, ((&offset, &want), &have)) in wanted.enumerate().skip(1) {
        if want != have {
            block = block.narrow(dim, offset, want).map_err(tensor_error)?;
        }
    }
    block
        .to_dtype(request.dtype)
        .and_then(|t| t.contiguous())
        .map_err(tensor_error)
}

/// Checks `path` against `module`'s parameters and makes every parameter read its values
/// from it: deferred ones lazily (only the blocks later asked for), others at once. Returns
/// the file's index, whose [`bytes_read`](SafetensorsIndex::bytes_read) counts what was read.
///
/// Nothing in the module changes unless the whole file matches: a missing tensor, a tensor
/// of another shape, or a tensor that is not a parameter is [`Error::InitFile`] naming it.
pub fn attach_init_file(module: &mut dyn Module, path: &Path) -> Result<SafetensorsIndex> {
    let index = SafetensorsIndex::open(path)?;
    let mut expected = Vec::new();
    module.visit_params("", &mut |name, param| {
        expected.push((name.to_string(), param.tensor()?.shape().to_vec()));
        Ok(())
    })?;
    for (name, shape) in &expected {
        let Some(stored) = index.tensors().get(name) else {
            return Err(init_error(path, format!("tensor {name} is missing")));
        };
        if &stored.shape != shape {
            return Err(init_error(
                path,
                format!(
                    "tensor {name} has shape {:?}, the model needs {shape:?}",
                    stored.shape
                ),
            ));
        }
    }
    if let Some(extra) = index
        .tensors()
        .keys()
        .find(|name| !is_skipped(name) && !expected.iter().any(|(e, _)| e == *name))
    {
        return Err(init_error(
            path,
            format!("tensor {extra} is not a parameter of the model"),
        ));
    }
    let mut failure = None;
    module.visit_params_mut("", &mut |name, param| {
        if failure.is_none() {
            let reader = index.clone();
            failure = load_param(name, param, move |request| {
                read_block(&reader, request.name, request)
            })?
            .err();
        }
        Ok(())
    })?;
    match failure {
        Some(error) => Err(error),
        None => Ok(index),
    }
}

/// Makes `param` take its values from `read`: a deferred parameter gets it as its init hook
/// (called later with only the blocks this rank owns), a materialised one is read whole now.
/// The outer `Result` is the module's (a missing tensor), the inner one the file's.
pub(crate) fn load_param(
    name: &str,
    param: &mut hypershard_nn::Parameter,
    read: impl Fn(InitRequest<'_>) -> Result<Tensor> + Send + Sync + 'static,
) -> hypershard_nn::Result<Result<()>> {
    if param.is_deferred() {
        param.init = Some(Arc::new(move |request: InitRequest<'_>| {
            read(request).map_err(|error| hypershard_nn::Error::Materialize {
                name: request.name.to_string(),
                reason: error.to_string(),
            })
        }));
        return Ok(Ok(()));
    }
    let tensor = param.tensor()?;
    let shape = tensor.shape().to_vec();
    let zeros = vec![0; shape.len()];
    let request = InitRequest {
        name,
        global_shape: &shape,
        offset: &zeros,
        shape: &shape,
        dtype: tensor.dtype(),
    };
    Ok(read(request).map(|block| param.data = Some(block)))
}
