//! Moving bytes between tensors and communication buffers without detours.
//!
//! Tensors and collectives each own a host buffer type; FSDP packs shards straight from tensor
//! storage into a communication buffer (one copy, the copy-in) and unpacks the result straight
//! into tensor storage (one copy, the copy-out).

use hypershard_collectives::{Buffer, DType as CommDType};
use hypershard_tensor::{DType, ForeignBytes, HostBuffer, Storage, Tensor};

use crate::error::{FsdpError, Result};

/// The collectives dtype of a tensor dtype; bool has none (collectives do not reduce bools).
pub(crate) fn comm_dtype(dtype: DType) -> Option<CommDType> {
    match dtype {
        DType::F32 => Some(CommDType::F32),
        DType::F64 => Some(CommDType::F64),
        DType::BF16 => Some(CommDType::BF16),
        DType::F16 => Some(CommDType::F16),
        DType::I32 => Some(CommDType::I32),
        DType::I64 => Some(CommDType::I64),
        DType::U8 => Some(CommDType::U8),
        _ => None,
    }
}

/// A collective's output buffer adopted as tensor storage.
struct CommBytes(hypershard_collectives::HostBuffer);

impl ForeignBytes for CommBytes {
    fn bytes(&self) -> &[u8] {
        self.0.as_bytes()
    }

    fn bytes_mut(&mut self) -> &mut [u8] {
        self.0.as_bytes_mut()
    }
}

/// A flat tensor of `dtype` over the bytes of `buffer`, without copying when the buffer is
/// aligned for tensor kernels (collectives allocate 64-byte aligned, so it always is).
pub(crate) fn tensor_from_buffer(buffer: Buffer, dtype: DType) -> Result<Tensor> {
    let host = buffer.into_host().map_err(|_| FsdpError::NotHostStorage {
        op: "tensor_from_buffer",
    })?;
    let numel = host.len();
    let storage = match HostBuffer::from_foreign(Box::new(CommBytes(host))) {
        Ok(storage) => storage,
        Err(foreign) => HostBuffer::from_bytes(foreign.bytes()),
    };
    Ok(Tensor::from_host_buffer(storage, &[numel], dtype)?)
}

/// Calls `f` with the bytes of `tensor` in row-major order (a contiguous copy is made first
/// when the tensor is a strided view).
pub(crate) fn with_bytes<R>(tensor: &Tensor, f: impl FnOnce(&[u8]) -> R) -> Result<R> {
    let owned;
    let tensor = if tensor.is_contiguous() {
        tensor
    } else {
        owned = tensor.contiguous()?;
        &owned
    };
    let start = tensor.offset() * tensor.dtype().size_of();
    let len = tensor.nbytes();
    let guard = tensor.storage().read();
    match &*guard {
        Storage::Host(buf) => {
            let bytes = buf
                .as_bytes()
                .get(start..start + len)
                .ok_or(FsdpError::BufferLength {
                    op: "with_bytes",
                    expected: start + len,
                    actual: buf.len(),
                })?;
            Ok(f(bytes))
        }
        _ => Err(FsdpError::NotHostStorage { op: "with_bytes" }),
    }
}

/// Writes `bytes` into the contiguous tensor `tensor` starting at element `elem_offset` of it.
pub(crate) fn write_bytes(tensor: &Tensor, elem_offset: usize, bytes: &[u8]) -> Result<()> {
    if !tensor.is_contiguous() {
        return Err(FsdpError::NotHostStorage {
            op: "write_bytes (strided destination)",
        });
    }
    let size = tensor.dtype().size_of();
    let start = (tensor.offset() + elem_offset) * size;
    let end = start + bytes.len();
    let limit = (tensor.offset() + tensor.numel()) * size;
    if end > limit {
        return Err(FsdpError::BufferLength {
            op: "write_bytes",
            expected: limit - tensor.offset() * size,
            actual: end - tensor.offset() * size,
        });
    }
    let mut guard = tensor.storage().write();
    match &mut *guard {
        Storage::Host(buf) => {
            buf.as_bytes_mut()[start..end].copy_from_slice(bytes);
            Ok(())
        }
        _ => Err(FsdpError::NotHostStorage { op: "write_bytes" }),
    }
}

/// Sets every element of the contiguous `tensor` to zero bits (0 in every dtype), whatever
/// its stale contents (`scale_(0.0)` would keep a NaN).
pub(crate) fn fill_zero(tensor: &Tensor) -> Result<()> {
    let bytes = vec![0u8; tensor.nbytes()];
    write_bytes(tensor, 0, &bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bytes_round_trip_through_views() -> Result<()> {
        let flat = Tensor::zeros(&[6], DType::F32)?;
        let view = flat.narrow(0, 2, 3)?;
        let src = Tensor::from_vec(vec![1.0f32, 2.0, 3.0], &[3])?;
        with_bytes(&src, |b| write_bytes(&view, 0, b))??;
        assert_eq!(flat.to_vec::<f32>()?, vec![0.0, 0.0, 1.0, 2.0, 3.0, 0.0]);
        let got = with_bytes(&view, |b| b.to_vec())?;
        assert_eq!(got.len(), 12);
        assert!(matches!(
            write_bytes(&view, 1, &[0u8; 12]),
            Err(FsdpError::BufferLength { .. })
        ));
        // Zeroing a view with a NaN in it clears only the view.
        view.copy_from(&Tensor::from_vec(vec![f32::NAN, 5.0, 6.0], &[3])?)?;
        fill_zero(&view)?;
        assert_eq!(flat.to_vec::<f32>()?, vec![0.0; 6]);
        // A strided (transposed) source is read in row-major order.
        let m = Tensor::from_vec(vec![1.0f32, 2.0, 3.0, 4.0], &[2, 2])?.transpose(0, 1)?;
        let bytes = with_bytes(&m, |b| b.to_vec())?;
        let t = Tensor::from_bytes(&bytes, &[2, 2], DType::F32)?;
        assert_eq!(t.to_vec::<f32>()?, vec![1.0, 3.0, 2.0, 4.0]);
        Ok(())
    }

    #[test]
    fn a_comm_buffer_becomes_a_tensor_without_copying() -> Result<()> {
        let buffer = Buffer::from_vec(vec![1.0f32, 2.0, 3.0]);
        let address = buffer
            .as_host()
            .map_err(FsdpError::from)?
            .as_bytes()
            .as_ptr() as usize;
        let t = tensor_from_buffer(buffer, DType::F32)?;
        assert_eq!(t.to_vec::<f32>()?, vec![1.0, 2.0, 3.0]);
        let adopted = with_bytes(&t, |b| b.as_ptr() as usize)?;
        assert_eq!(adopted, address);
        Ok(())
    }
}
