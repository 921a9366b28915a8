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

/// Writes the tensors for which `rename` returns a name (e.g. model parameters under their
/// nanoGPT names, leaving optimizer state out) into one safetensors file at `out`, crash-safely
/// (temporary file, fsync, rename). Refuses to replace an existing file unless `overwrite`.
pub fn export_consolidated(
    checkpoint: &Checkpoint,
    out: &Path,
    overwrite: bool,
    rename: impl Fn(&str) -> Option<String>,
) -> Result<ExportSummary> {
    if out.exists() && !overwrite {
        return Err(Error::WouldOverwrite {
            path: out.to_path_buf(),
        });
    }
    let mut selected: Vec<(String, TensorHeader)> = Vec::new();
    for (name, entry) in &checkpoint.metadata().tensors {
        if let Some(exported) = rename(name) {
            selected.push((
                name.clone(),
                TensorHeader {
                    name: exported,
                    dtype: entry_dtype(name, entry)?,
                    shape: entry.shape.clone(),
                },
            ));
        }
    }
    let headers: Vec<TensorHeader> = selected.iter().map(|(_, h)| h.clone()).collect();
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
        let (name, _) = &selected[i];
        let tensor = checkpoint.read_tensor(name)?;
        tensor.to_bytes().map_err(|source| Error::Tensor {
            name: name.clone(),
            source,
        })
    })?;
    std::fs::rename(&temp, out).map_err(|e| Error::io(FileAction::Rename, &temp, e))?;
    fsync_dir(parent)?;
    Ok(ExportSummary {
        tensors: headers.len(),
        bytes,
    })
}
