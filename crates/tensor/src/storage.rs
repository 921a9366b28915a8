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

/// Memory owned by another crate that a [`HostBuffer`] can adopt without copying.
///
/// The collectives crate hands out its receive buffers this way: after an all-gather, FSDP
/// turns the gather output into tensor storage and makes every unsharded parameter a view into
/// it (zero-copy unshard), then takes the buffer back with [`HostBuffer::into_foreign`] to
/// reuse it for the next collective.
///
/// Contract: the memory always starts on a [`HOST_ALIGN`] boundary and keeps its length for the
/// lifetime of the object; `bytes` returns the same memory between two `bytes_mut` calls.
/// `bytes_mut` may move the memory to another aligned address (copy-on-write while a collective
/// still reads the old bytes is the use). [`HostBuffer::from_foreign`] checks the alignment once;
/// the element views re-check it through `bytemuck` on every cast, so an implementation that
/// broke the contract would make those views fail loudly, never read misaligned memory.
pub trait ForeignBytes: std::any::Any + Send + Sync {
    /// The bytes.
    fn bytes(&self) -> &[u8];
    /// The bytes, mutably.
    fn bytes_mut(&mut self) -> &mut [u8];
}

impl std::fmt::Debug for dyn ForeignBytes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ForeignBytes")
            .field("len", &self.bytes().len())
            .finish()
    }
}

/// Where a host buffer's bytes come from.
enum HostMemory {
    /// Our own allocation of whole aligned blocks.
    Owned(Vec<Block>),
    /// Memory adopted from another crate.
    Foreign(Box<dyn ForeignBytes>),
}

/// A zero-initialised, 64-byte aligned host allocation of a fixed number of bytes.
///
/// Every buffer counts itself in the [`memory`](crate::memory) tracker current on the thread
/// that allocates it, and uncounts itself when dropped (on whatever thread), so tests can
/// measure the peak storage of one rank even when ranks are threads of one process.
///
/// ```
/// use hypershard_tensor::HostBuffer;
/// let buf = HostBuffer::zeroed(10);
/// assert_eq!(buf.len(), 10);
/// assert_eq!(buf.as_bytes().as_ptr() as usize % 64, 0);
/// ```
pub struct HostBuffer {
    memory: HostMemory,
    len: usize,
    /// The accounting entry, released in `Drop`.
    _tracked: crate::memory::Tracked,
}

impl Clone for HostBuffer {
    /// A copy in a new owned allocation (a foreign buffer's copy is owned by us).
    fn clone(&self) -> Self {
        HostBuffer::from_bytes(self.as_bytes())
    }
}

impl HostBuffer {
    /// A buffer of `len` zero bytes.
    pub fn zeroed(len: usize) -> Self {
        let blocks = bytemuck::zeroed_vec(len.div_ceil(HOST_ALIGN));
        HostBuffer {
            memory: HostMemory::Owned(blocks),
            len,
            _tracked: crate::memory::Tracked::new(len),
        }
    }

    /// A buffer of `len` zero bytes that stands for `device`'s memory (the emulated device's):
    /// the memory trackers count it under the device, not the host.
    pub(crate) fn zeroed_on(len: usize, device: crate::Device) -> Self {
        let blocks = bytemuck::zeroed_vec(len.div_ceil(HOST_ALIGN));
        HostBuffer {
            memory: HostMemory::Owned(blocks),
            len,
            _tracked: crate::memory::Tracked::on_device(len, device),
        }
    }

    /// A buffer holding a copy of `bytes`.
    pub fn from_bytes(bytes: &[u8]) -> Self {
        let mut buf = HostBuffer::zeroed(bytes.len());
        buf.as_bytes_mut().copy_from_slice(bytes);
        buf
    }

    /// Adopts foreign memory without copying; its length is the buffer's length.
    ///
    /// Gives the object back unchanged when its bytes do not start on a [`HOST_ALIGN`]
    /// boundary (the kernels reinterpret bytes as elements, which needs the alignment).
    ///
    /// ```
    /// use hypershard_tensor::{ForeignBytes, HostBuffer};
    /// struct Pages(HostBuffer);
    /// impl ForeignBytes for Pages {
    ///     fn bytes(&self) -> &[u8] { self.0.as_bytes() }
    ///     fn bytes_mut(&mut self) -> &mut [u8] { self.0.as_bytes_mut() }
    /// }
    /// let Ok(buf) = HostBuffer::from_foreign(Box::new(Pages(HostBuffer::zeroed(8)))) else {
    ///     return Err("the pages were not aligned".into());
    /// };
    /// assert_eq!(buf.len(), 8);
    /// let Ok(back) = buf.into_foreign() else {
    ///     return Err("the buffer did not hold foreign memory".into());
    /// };
    /// assert_eq!(back.bytes().len(), 8);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn from_foreign(
        foreign: Box<dyn ForeignBytes>,
    ) -> std::result::Result<HostBuffer, Box<dyn ForeignBytes>> {
        let bytes = foreign.bytes();
        if !(bytes.as_ptr() as usize).is_multiple_of(HOST_ALIGN) {
            return Err(foreign);
        }
        let len = bytes.len();
        Ok(HostBuffer {
            memory: HostMemory::Foreign(foreign),
            len,
            _tracked: crate::memory::Tracked::new(len),
        })
    }

    /// A borrow of the adopted foreign memory, or `None` when the buffer owns its bytes.
    ///
    /// The distributed-tensor crate uses it to recognise its own collective buffers inside a
    /// tensor's storage and lend them to the next collective without a copy.
    ///
    /// ```
    /// use hypershard_tensor::{ForeignBytes, HostBuffer};
    /// struct Pages(HostBuffer);
    /// impl ForeignBytes for Pages {
    ///     fn bytes(&self) -> &[u8] { self.0.as_bytes() }
    ///     fn bytes_mut(&mut self) -> &mut [u8] { self.0.as_bytes_mut() }
    /// }
    /// let Ok(adopted) = HostBuffer::from_foreign(Box::new(Pages(HostBuffer::zeroed(8)))) else {
    ///     return Err("the pages were not aligned".into());
    /// };
    /// let foreign = adopted.foreign().ok_or("no adopted memory")?;
    /// assert!((foreign as &dyn std::any::Any).is::<Pages>());
    /// assert!(HostBuffer::zeroed(8).foreign().is_none());
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn foreign(&self) -> Option<&dyn ForeignBytes> {
        match &self.memory {
            HostMemory::Foreign(foreign) => Some(foreign.as_ref()),
            HostMemory::Owned(_) => None,
        }
    }

    /// The adopted foreign memory, or the buffer back if it owns its bytes.
    pub fn into_foreign(self) -> std::result::Result<Box<dyn ForeignBytes>, HostBuffer> {
        match self.memory {
            HostMemory::Foreign(foreign) => Ok(foreign),
            memory @ HostMemory::Owned(_) => Err(HostBuffer { memory, ..self }),
        }
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
        match &self.memory {
            HostMemory::Owned(blocks) => &bytemuck::cast_slice::<Block, u8>(blocks)[..self.len],
            HostMemory::Foreign(foreign) => foreign.bytes(),
        }
    }

    /// The bytes of the buffer, mutably.
    pub fn as_bytes_mut(&mut self) -> &mut [u8] {
        match &mut self.memory {
            HostMemory::Owned(blocks) => {
                &mut bytemuck::cast_slice_mut::<Block, u8>(blocks)[..self.len]
            }
            HostMemory::Foreign(foreign) => foreign.bytes_mut(),
        }
    }

    /// The buffer as elements of `T`, rounding the length down to whole elements.
    pub(crate) fn typed<T: bytemuck::Pod>(&self) -> &[T] {
        let bytes = self.as_bytes();
        let whole = bytes.len() - bytes.len() % size_of::<T>();
        // invariant: the bytes start 64-aligned (Block's alignment, or checked in
        // `from_foreign` for memory that the `ForeignBytes` contract keeps aligned) and
        // `whole` is a multiple of size_of::<T>() <= 8, so the cast cannot fail.
        bytemuck::cast_slice(&bytes[..whole])
    }

    /// The buffer as elements of `T`, mutably.
    pub(crate) fn typed_mut<T: bytemuck::Pod>(&mut self) -> &mut [T] {
        let bytes = self.as_bytes_mut();
        let whole = bytes.len() - bytes.len() % size_of::<T>();
        // invariant: as in `typed`.
        bytemuck::cast_slice_mut(&mut bytes[..whole])
    }
}

impl std::fmt::Debug for HostBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let foreign = matches!(self.memory, HostMemory::Foreign(_));
        f.debug_struct("HostBuffer")
            .field("len", &self.len)
            .field("foreign", &foreign)
            .finish()
    }
}

/// Where a tensor's bytes live.
///
/// Host memory; no memory at all: a [`Deferred`](Storage::Deferred) storage carries only its
/// length and how it would be filled (PyTorch's meta device); or device memory, a
/// [`DeviceBuffer`](crate::DeviceBuffer) on the emulated device or (feature `cuda`) a GPU.
/// Every op dispatches on it: the host arm runs the kernels directly, a device arm runs them
/// through its backend or refuses with a typed error naming the op and the device.
#[derive(Debug)]
#[non_exhaustive]
pub enum Storage {
    /// 64-byte aligned host memory.
    Host(HostBuffer),
    /// No bytes: the tensor has a shape and a dtype but its data was never allocated (see
    /// [`deferred_init`](crate::deferred_init)). Every kernel refuses it with
    /// [`Error::Deferred`](crate::Error::Deferred).
    Deferred(crate::deferred::DeferredStorage),
    /// Device memory, reached only through its backend (explicit copies, stream ordered).
    /// Host reads of it are [`Error::DeviceData`](crate::Error::DeviceData).
    Device(crate::DeviceBuffer),
}

impl Storage {
    /// Length in bytes (what the data would take, for a deferred storage).
    pub fn len(&self) -> usize {
        match self {
            Storage::Host(buf) => buf.len(),
            Storage::Deferred(deferred) => deferred.len(),
            Storage::Device(buf) => buf.len(),
        }
    }

    /// Whether the storage holds no bytes.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Whether the storage is CUDA memory (a match on the kind first, so the host pays one
    /// comparison).
    #[cfg(feature = "cuda")]
    pub(crate) fn is_cuda(&self) -> bool {
        matches!(self, Storage::Device(buf) if buf.device().is_cuda())
    }

    /// Whether this is a deferred (shape-only) storage.
    pub fn is_deferred(&self) -> bool {
        matches!(self, Storage::Deferred(_))
    }

    /// The device the bytes are on; a deferred storage is materialised on the host, so it
    /// counts as [`Device::Cpu`](crate::Device::Cpu).
    pub fn device(&self) -> crate::Device {
        match self {
            Storage::Host(_) | Storage::Deferred(_) => crate::Device::Cpu,
            Storage::Device(buf) => buf.device(),
        }
    }

    /// The host buffer, for host reads and writes of the data (`to_vec`, `with_data`...): a
    /// deferred storage is [`Error::Deferred`](crate::Error::Deferred) and device memory
    /// [`Error::DeviceData`](crate::Error::DeviceData), both naming `op`.
    pub(crate) fn host(&self, op: &'static str) -> crate::Result<&HostBuffer> {
        match self {
            Storage::Host(buf) => Ok(buf),
            Storage::Deferred(_) => Err(crate::Error::Deferred { op }),
            Storage::Device(buf) => Err(crate::Error::DeviceData {
                op,
                device: buf.device(),
            }),
        }
    }

    /// The host buffer, mutably (see [`host`](Storage::host)).
    pub(crate) fn host_mut(&mut self, op: &'static str) -> crate::Result<&mut HostBuffer> {
        match self {
            Storage::Host(buf) => Ok(buf),
            Storage::Deferred(_) => Err(crate::Error::Deferred { op }),
            Storage::Device(buf) => Err(crate::Error::DeviceData {
                op,
                device: buf.device(),
            }),
        }
    }

    /// The bytes an op's kernel reads, wherever the storage is: host memory as it is, device
    /// memory through its backend (ordered on the device's current stream), or a typed error
    /// naming `op` where the backend cannot run the crate's kernels.
    pub(crate) fn data(&self, op: &'static str) -> crate::Result<&HostBuffer> {
        match self {
            Storage::Host(buf) => Ok(buf),
            Storage::Deferred(_) => Err(crate::Error::Deferred { op }),
            Storage::Device(buf) => buf.kernel_bytes(op),
        }
    }

    /// The bytes an op's kernel writes (see [`data`](Storage::data)).
    pub(crate) fn data_mut(&mut self, op: &'static str) -> crate::Result<&mut HostBuffer> {
        match self {
            Storage::Host(buf) => Ok(buf),
            Storage::Deferred(_) => Err(crate::Error::Deferred { op }),
            Storage::Device(buf) => buf.kernel_bytes_mut(op),
        }
    }
}

/// The one device two storages an op reads are on; [`Error::DeviceMismatch`](crate::Error)
/// naming `op` and both devices otherwise. A deferred storage has no device yet: its kernel
/// refuses it with [`Error::Deferred`](crate::Error::Deferred) instead.
pub(crate) fn common_device(
    op: &'static str,
    a: &Storage,
    b: &Storage,
) -> crate::Result<crate::Device> {
    match (a, b) {
        // The host path stays one comparison.
        (Storage::Host(_), Storage::Host(_)) => Ok(crate::Device::Cpu),
        (Storage::Deferred(_), other) | (other, Storage::Deferred(_)) => Ok(other.device()),
        _ if a.device() == b.device() => Ok(a.device()),
        _ => Err(crate::Error::DeviceMismatch {
            op,
            lhs: a.device(),
            rhs: b.device(),
        }),
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

    /// Foreign memory for the tests: a vector of bytes with a chosen start offset, so that a
    /// misaligned start can be made on purpose.
    struct Offset {
        bytes: Vec<u8>,
        start: usize,
        len: usize,
    }

    impl Offset {
        fn aligned(len: usize) -> Offset {
            let bytes = vec![0u8; len + HOST_ALIGN];
            let start = bytes.as_ptr().align_offset(HOST_ALIGN);
            Offset { bytes, start, len }
        }
    }

    impl ForeignBytes for Offset {
        fn bytes(&self) -> &[u8] {
            &self.bytes[self.start..self.start + self.len]
        }
        fn bytes_mut(&mut self) -> &mut [u8] {
            &mut self.bytes[self.start..self.start + self.len]
        }
    }

    #[test]
    fn foreign_memory_is_adopted_without_copying_and_given_back() {
        let mut foreign = Offset::aligned(12);
        foreign
            .bytes_mut()
            .copy_from_slice(bytemuck::cast_slice(&[1.0f32, 2.0, 3.0]));
        let address = foreign.bytes().as_ptr() as usize;
        let Ok(buf) = HostBuffer::from_foreign(Box::new(foreign)) else {
            panic!("an aligned foreign buffer is adopted");
        };
        assert_eq!(buf.as_bytes().as_ptr() as usize, address);
        let t = crate::Tensor::from_host_buffer(buf, &[3], crate::DType::F32).expect("tensor");
        t.scale_(2.0).expect("scale");
        assert_eq!(t.to_vec::<f32>().expect("f32"), vec![2.0, 4.0, 6.0]);
        let buf = t.try_into_host_buffer().expect("sole owner");
        let Ok(back) = buf.into_foreign() else {
            panic!("the adopted memory comes back");
        };
        assert_eq!(back.bytes().as_ptr() as usize, address);
        assert_eq!(
            bytemuck::cast_slice::<u8, f32>(back.bytes()),
            &[2.0, 4.0, 6.0]
        );
        // An owned buffer is not foreign and comes back unchanged.
        let owned = HostBuffer::zeroed(3).into_foreign().expect_err("owned");
        assert_eq!(owned.len(), 3);
    }

    #[test]
    fn misaligned_foreign_memory_is_refused() {
        let mut foreign = Offset::aligned(8);
        foreign.start += 4;
        let Err(refused) = HostBuffer::from_foreign(Box::new(foreign)) else {
            panic!("a misaligned foreign buffer is refused");
        };
        assert_eq!(refused.bytes().len(), 8);
    }

    #[test]
    fn shared_storage_write_is_visible_to_readers() {
        let shared = SharedStorage::new(Storage::Host(HostBuffer::zeroed(4)));
        shared
            .write()
            .host_mut("test")
            .expect("host storage")
            .as_bytes_mut()[2] = 7;
        assert_eq!(
            shared.read().host("test").expect("host storage").as_bytes(),
            &[0, 0, 7, 0]
        );
        assert_eq!(shared.read().len(), 4);
        assert!(!shared.read().is_empty());
    }
}
