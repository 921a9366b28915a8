//! `hypershard export`: one consolidated safetensors file from a sharded checkpoint, written
//! one tensor at a time (each assembled from its saved blocks, written, then dropped).

use std::collections::BTreeMap;
use std::path::Path;

use super::reader::Checkpoint;
use super::safetensors_file::{TensorHeader, write_streaming};
use super::writer::{entry_dtype, fsync_dir};
use crate::error::{Error, FileAction, Result};

/// What [`export_consolidated`] wrote.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExportSummary {
    /// Tensors written.
    pub tensors: usize,
    /// Bytes of tensor data written.
    pub bytes: usize,
}

/// How one checkpoint tensor is written by [`export_tensors`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExportAs {
    /// The name in the file.
    pub name: String,
    /// Write a 2-d tensor transposed (Hugging Face's `Conv1D` stores `[in, out]`).
    pub transpose: bool,
}

/// Writes the tensors for which `rename` returns a name (e.g. model parameters under their
/// nanoGPT names, leaving optimizer state out) into one safetensors file at `out`, crash-safely
/// (temporary file, fsync, rename). Refuses to replace an existing file unless `overwrite`.
pub fn export_consolidated(
    checkpoint: &Checkpoint,
    out: &Path,
    overwrite: bool,
    rename: impl Fn(&str) -> Option<String>,
) -> Result<ExportSummary> {
    export_tensors(checkpoint, out, overwrite, |name| {
        rename(name).map(|name| ExportAs {
            name,
            transpose: false,
        })
    })
}

/// [`export_consolidated`] where `plan` also says which tensors are written transposed.
pub fn export_tensors(
    checkpoint: &Checkpoint,
    out: &Path,
    overwrite: bool,
    plan: impl Fn(&str) -> Option<ExportAs>,
) -> Result<ExportSummary> {
    if out.exists() && !overwrite {
        return Err(Error::WouldOverwrite {
            path: out.to_path_buf(),
        });
    }
    let mut selected: Vec<(String, bool, TensorHeader)> = Vec::new();
    for (name, entry) in &checkpoint.metadata().tensors {
        if let Some(exported) = plan(name) {
            let shape = match (exported.transpose, &entry.shape[..]) {
                (false, _) => entry.shape.clone(),
                (true, [rows, cols]) => vec![*cols, *rows],
                (true, other) => {
                    return Err(Error::InconsistentTensor {
                        name: name.clone(),
                        reason: format!("shape {other:?} is not 2-d and cannot be transposed"),
                    });
                }
            };
            selected.push((
                name.clone(),
                exported.transpose,
                TensorHeader {
                    name: exported.name,
                    dtype: entry_dtype(name, entry)?,
                    shape,
                },
            ));
        }
    }
    let headers: Vec<TensorHeader> = selected.iter().map(|(_, _, h)| h.clone()).collect();
    let bytes: usize = headers.iter().map(TensorHeader::nbytes).sum();
    let parent = out
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    let mut temp_name = out.file_name().unwrap_or_default().to_os_string();
    temp_name.push(".partial");
    let temp = parent.join(temp_name);
    let metadata = BTreeMap::from([("format".to_string(), "pt".to_string())]);
    write_streaming(&temp, &headers, &metadata, |i| {
        let (name, transpose, _) = &selected[i];
        let tensor = checkpoint.read_tensor(name)?;
        let tensor_error = |source| Error::Tensor {
            name: name.clone(),
            source,
        };
        if *transpose {
            let transposed = tensor.transpose(0, 1).map_err(tensor_error)?;
            transposed.contiguous().map_err(tensor_error)?.to_bytes()
        } else {
            tensor.to_bytes()
        }
        .map_err(tensor_error)
    })?;
    std::fs::rename(&temp, out).map_err(|e| Error::io(FileAction::Rename, &temp, e))?;
    fsync_dir(parent)?;
    Ok(ExportSummary {
        tensors: headers.len(),
        bytes,
    })
}
