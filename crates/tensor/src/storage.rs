//! Storage: the memory a tensor's elements live in, shared between views.

use std::sync::{PoisonError, RwLock, RwLockReadGuard, RwLockWriteGuard};

/// Alignment of every host allocation, in bytes: a cache line, and enough for any SIMD load.
pub const HOST_ALIGN: usize = 64;

/// One 64-byte, 64-aligned block. A `Vec` of these is a 64-aligned allocation that needs no
/// `unsafe`: `bytemuck` proves the byte reinterpretation sound because the type is `Pod`
/// (no padding, every bit pattern valid).
#[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
#[repr(C, align(64))]
struct Block([u8; HOST_ALIGN]);

/// A zero-initialised, 64-byte aligned host allocation of a fixed number of bytes.
///
/// ```
/// use hypershard_tensor::HostBuffer;
/// let buf = HostBuffer::zeroed(10);
/// assert_eq!(buf.len(), 10);
/// assert_eq!(buf.as_bytes().as_ptr() as usize % 64, 0);
/// ```
#[derive(Clone)]
pub struct HostBuffer {
    blocks: Vec<Block>,
    len: usize,
}

impl HostBuffer {
    /// A buffer of `len` zero bytes.
    pub fn zeroed(len: usize) -> Self {
        let blocks = bytemuck::zeroed_vec(len.div_ceil(HOST_ALIGN));
        HostBuffer { blocks, len }
    }

    /// A buffer holding a copy of `bytes`.
    pub fn from_bytes(bytes: &[u8]) -> Self {
        let mut buf = HostBuffer::zeroed(bytes.len());
        buf.as_bytes_mut().copy_from_slice(bytes);
        buf
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the buffer holds no bytes.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The bytes of the buffer; the slice starts on a 64-byte boundary.
    pub fn as_bytes(&self) -> &[u8] {
        &bytemuck::cast_slice::<Block, u8>(&self.blocks)[..self.len]
    }

    /// The bytes of the buffer, mutably.
    pub fn as_bytes_mut(&mut self) -> &mut [u8] {
        &mut bytemuck::cast_slice_mut::<Block, u8>(&mut self.blocks)[..self.len]
    }

    /// The buffer as elements of `T`, rounding the length down to whole elements.
    pub(crate) fn typed<T: bytemuck::Pod>(&self) -> &[T] {
        let whole = self.len - self.len % size_of::<T>();
        // invariant: the bytes start 64-aligned (Block's alignment) and `whole` is a multiple of
        // size_of::<T>() <= 8, so the cast cannot fail.
        bytemuck::cast_slice(&bytemuck::cast_slice::<Block, u8>(&self.blocks)[..whole])
    }

    /// The buffer as elements of `T`, mutably.
    pub(crate) fn typed_mut<T: bytemuck::Pod>(&mut self) -> &mut [T] {
        let whole = self.len - self.len % size_of::<T>();
        // invariant: as in `typed`.
        bytemuck::cast_slice_mut(
            &mut bytemuck::cast_slice_mut::<Block, u8>(&mut self.blocks)[..whole],
        )
    }
}

impl std::fmt::Debug for HostBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostBuffer")
            .field("len", &self.len)
            .finish()
    }
}

/// Where a tensor's bytes live.
///
/// Today only host memory exists; a device variant (a CUDA buffer behind the `cuda` feature)
/// will be added, which is why the enum is `#[non_exhaustive]`.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub enum Storage {
    /// 64-byte aligned host memory.
    Host(HostBuffer),
}

impl Storage {
    /// Length in bytes.
    pub fn len(&self) -> usize {
        match self {
            Storage::Host(buf) => buf.len(),
        }
    }

    /// Whether the storage holds no bytes.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The host buffer, for kernels that run on the CPU.
    pub(crate) fn host(&self) -> &HostBuffer {
        match self {
            Storage::Host(buf) => buf,
        }
    }

    /// The host buffer, mutably.
    pub(crate) fn host_mut(&mut self) -> &mut HostBuffer {
        match self {
            Storage::Host(buf) => buf,
        }
    }
}

/// Storage shared by every view of it, behind a reader-writer lock.
///
/// Many tensors (views) may alias one `SharedStorage` through an `Arc`. Reads of any view take
/// the read lock; writes into any view (`copy_from`, `add_`, `axpy`, `fill_`...) take the write
/// lock for the duration of one operation, so a write is never observed half-done and the
/// aliasing is sound without `unsafe`. Kernels never panic while holding the lock; should a
/// panic poison it anyway, the bytes are still plain data, so the poison is ignored.
#[derive(Debug)]
pub struct SharedStorage {
    inner: RwLock<Storage>,
}

impl SharedStorage {
    /// Wraps a storage for sharing.
    pub fn new(storage: Storage) -> Self {
        SharedStorage {
            inner: RwLock::new(storage),
        }
    }

    /// The storage, once no other owner is left.
    pub fn into_inner(self) -> Storage {
        self.inner
            .into_inner()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// Locks the storage for reading.
    pub fn read(&self) -> RwLockReadGuard<'_, Storage> {
        self.inner.read().unwrap_or_else(PoisonError::into_inner)
    }

    /// Locks the storage for writing.
    pub fn write(&self) -> RwLockWriteGuard<'_, Storage> {
        self.inner.write().unwrap_or_else(PoisonError::into_inner)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_buffer_is_aligned_and_zeroed() {
        for len in [0usize, 1, 63, 64, 65, 1000] {
            let buf = HostBuffer::zeroed(len);
            assert_eq!(buf.len(), len);
            assert_eq!(buf.as_bytes().len(), len);
            assert_eq!(buf.as_bytes().as_ptr() as usize % HOST_ALIGN, 0);
            assert!(buf.as_bytes().iter().all(|&b| b == 0));
        }
    }

    #[test]
    fn typed_views_reinterpret_bytes() {
        let mut buf = HostBuffer::zeroed(12);
        buf.typed_mut::<f32>().copy_from_slice(&[1.0, 2.0, 3.0]);
        assert_eq!(buf.typed::<f32>(), &[1.0, 2.0, 3.0]);
        assert_eq!(&buf.as_bytes()[4..8], &2.0f32.to_le_bytes());
        // 12 bytes hold one whole f64 and a remainder that is not exposed.
        assert_eq!(buf.typed::<f64>().len(), 1);
        let copy = HostBuffer::from_bytes(buf.as_bytes());
        assert_eq!(copy.typed::<f32>(), &[1.0, 2.0, 3.0]);
    }

    #[test]
    fn shared_storage_write_is_visible_to_readers() {
        let shared = SharedStorage::new(Storage::Host(HostBuffer::zeroed(4)));
        shared.write().host_mut().as_bytes_mut()[2] = 7;
        assert_eq!(shared.read().host().as_bytes(), &[0, 0, 7, 0]);
        assert_eq!(shared.read().len(), 4);
        assert!(!shared.read().is_empty());
    }
}
