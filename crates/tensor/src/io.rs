//! safetensors load and save through the `safetensors` crate.
//!
//! safetensors stores little-endian bytes; this crate's storage is the host's native order,
//! so the format is only supported on little-endian hosts (every platform hypershard targets).

#[cfg(target_endian = "big")]
compile_error!("hypershard-tensor's safetensors I/O assumes a little-endian host");

use std::borrow::Cow;
use std::collections::BTreeMap;
use std::path::Path;

use safetensors::tensor::{Dtype as FileDType, SafeTensors, View};

use crate::{DType, Error, Result, Tensor};

fn to_file_dtype(dtype: DType) -> FileDType {
    match dtype {
        DType::F32 => FileDType::F32,
        DType::F64 => FileDType::F64,
        DType::BF16 => FileDType::BF16,
        DType::F16 => FileDType::F16,
        DType::I32 => FileDType::I32,
        DType::I64 => FileDType::I64,
        DType::U8 => FileDType::U8,
        DType::Bool => FileDType::BOOL,
    }
}

fn from_file_dtype(name: &str, dtype: FileDType) -> Result<DType> {
    Ok(match dtype {
        FileDType::F32 => DType::F32,
        FileDType::F64 => DType::F64,
        FileDType::BF16 => DType::BF16,
        FileDType::F16 => DType::F16,
        FileDType::I32 => DType::I32,
        FileDType::I64 => DType::I64,
        FileDType::U8 => DType::U8,
        FileDType::BOOL => DType::Bool,
        other => {
            return Err(Error::UnsupportedFileDType {
                op: "load_safetensors",
                name: name.to_owned(),
                dtype: other.to_string(),
            });
        }
    })
}

/// One tensor's bytes, made contiguous, in the form the safetensors crate serialises.
struct FileTensor {
    dtype: FileDType,
    shape: Vec<usize>,
    bytes: Vec<u8>,
}

impl View for &FileTensor {
    fn dtype(&self) -> FileDType {
        self.dtype
    }
    fn shape(&self) -> &[usize] {
        &self.shape
    }
    fn data(&self) -> Cow<'_, [u8]> {
        Cow::Borrowed(&self.bytes)
    }
    fn data_len(&self) -> usize {
        self.bytes.len()
    }
}

fn prepare<'a, I, S>(tensors: I) -> Result<Vec<(String, FileTensor)>>
where
    I: IntoIterator<Item = (S, &'a Tensor)>,
    S: AsRef<str>,
{
    tensors
        .into_iter()
        .map(|(name, t)| {
            Ok((
                name.as_ref().to_owned(),
                FileTensor {
                    dtype: to_file_dtype(t.dtype()),
                    shape: t.shape().to_vec(),
                    bytes: t.to_bytes()?,
                },
            ))
        })
        .collect()
}

fn st_error(op: &'static str) -> impl FnOnce(safetensors::SafeTensorError) -> Error {
    move |source| Error::Safetensors { op, source }
}

/// Serialises named tensors (any layout; strided views are written contiguously) to
/// safetensors bytes.
///
/// ```
/// use hypershard_tensor::{DType, Tensor, load_safetensors, save_safetensors};
/// let w = Tensor::arange(6, DType::BF16)?.view(&[2, 3])?;
/// let bytes = save_safetensors([("layer.weight", &w)])?;
/// let loaded = load_safetensors(&bytes)?;
/// assert_eq!(loaded["layer.weight"].shape(), &[2, 3]);
/// assert_eq!(loaded["layer.weight"].to_f64_vec()?, w.to_f64_vec()?);
/// # Ok::<(), hypershard_tensor::Error>(())
/// ```
pub fn save_safetensors<'a, I, S>(tensors: I) -> Result<Vec<u8>>
where
    I: IntoIterator<Item = (S, &'a Tensor)>,
    S: AsRef<str>,
{
    let prepared = prepare(tensors)?;
    safetensors::serialize(prepared.iter().map(|(n, t)| (n.as_str(), t)), None)
        .map_err(st_error("save_safetensors"))
}

/// Writes named tensors to a safetensors file at `path`.
pub fn save_safetensors_file<'a, I, S>(tensors: I, path: &Path) -> Result<()>
where
    I: IntoIterator<Item = (S, &'a Tensor)>,
    S: AsRef<str>,
{
    let prepared = prepare(tensors)?;
    safetensors::serialize_to_file(prepared.iter().map(|(n, t)| (n.as_str(), t)), None, path)
        .map_err(|source| match source {
            safetensors::SafeTensorError::IoError(source) => Error::Io {
                op: "save_safetensors_file",
                path: path.to_owned(),
                source,
            },
            source => Error::Safetensors {
                op: "save_safetensors_file",
                source,
            },
        })
}

/// Reads every tensor of safetensors bytes into new contiguous tensors, by name.
pub fn load_safetensors(bytes: &[u8]) -> Result<BTreeMap<String, Tensor>> {
    let file = SafeTensors::deserialize(bytes).map_err(st_error("load_safetensors"))?;
    file.iter()
        .map(|(name, view)| {
            let dtype = from_file_dtype(name, view.dtype())?;
            let t = Tensor::from_bytes(view.data(), view.shape(), dtype)?;
            Ok((name.to_owned(), t))
        })
        .collect()
}

/// Reads every tensor of the safetensors file at `path`.
pub fn load_safetensors_file(path: &Path) -> Result<BTreeMap<String, Tensor>> {
    let bytes = std::fs::read(path).map_err(|source| Error::Io {
        op: "load_safetensors_file",
        path: path.to_owned(),
        source,
    })?;
    load_safetensors(&bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_every_dtype_through_a_file() -> Result<()> {
        let mut tensors = BTreeMap::new();
        for (i, dtype) in DType::ALL.into_iter().enumerate() {
            let t = Tensor::arange(12, DType::F64)?
                .view(&[3, 4])?
                .to_dtype(dtype)?
                .transpose(0, 1)?;
            tensors.insert(format!("t{i}.{}", dtype.name()), t);
        }
        tensors.insert("scalar".to_owned(), Tensor::scalar(3i64));
        tensors.insert("empty".to_owned(), Tensor::zeros(&[0, 2], DType::F16)?);
        let dir = std::env::temp_dir().join(format!("hypershard-tensor-io-{}", std::process::id()));
        std::fs::create_dir_all(&dir).map_err(|source| Error::Io {
            op: "test",
            path: dir.clone(),
            source,
        })?;
        let path = dir.join("round_trip.safetensors");
        save_safetensors_file(tensors.iter(), &path)?;
        let loaded = load_safetensors_file(&path)?;
        let _ = std::fs::remove_dir_all(&dir);
        assert_eq!(loaded.len(), tensors.len());
        for (name, t) in &tensors {
            let l = &loaded[name];
            assert_eq!(l.dtype(), t.dtype(), "{name}");
            assert_eq!(l.shape(), t.shape(), "{name}");
            assert_eq!(l.to_bytes()?, t.to_bytes()?, "{name}");
        }
        Ok(())
    }

    #[test]
    fn bad_input_is_an_error() {
        assert!(matches!(
            load_safetensors(&[1, 2, 3]),
            Err(Error::Safetensors { .. })
        ));
        let missing = Path::new("/nonexistent/hypershard/x.safetensors");
        assert!(matches!(
            load_safetensors_file(missing),
            Err(Error::Io { .. })
        ));
    }

    #[test]
    fn foreign_dtypes_are_reported() -> Result<()> {
        let data = [0u8; 4];
        let view = safetensors::tensor::TensorView::new(FileDType::U32, vec![1], &data)
            .map_err(st_error("test"))?;
        let bytes = safetensors::serialize([("x", view)], None).map_err(st_error("test"))?;
        assert!(matches!(
            load_safetensors(&bytes),
            Err(Error::UnsupportedFileDType { ref name, .. }) if name == "x"
        ));
        Ok(())
    }
}
