//! Devices, streams, and the small backend trait every kind of device memory implements.
//!
//! A [`Device`] names where a tensor's bytes live: the host ([`Device::Cpu`]), the emulated
//! device ([`Device::Emulated`], see [`emulated`](crate::emulated)) or a CUDA GPU
//! ([`Device::Cuda`], feature `cuda`). Device memory is a [`DeviceBuffer`]: a boxed
//! [`DeviceMemory`] that only the backend's own calls reach (allocate, copies host → device,
//! device → host and device → device, fill), each recorded on a [`Stream`].
//!
//! Kernels do not live in the backends: the crate's ops are written once over byte slices,
//! and a backend whose memory the host can execute on ([`DeviceMemory::kernel_bytes`]) runs
//! them as they are. The emulated device does; a CUDA buffer does not, so an op without a
//! CUDA kernel is [`Error::DeviceUnsupported`](crate::Error::DeviceUnsupported) there.
//!
//! ```
//! use hypershard_tensor::{DType, Device, Tensor};
//! let device = Device::Emulated { ordinal: 0 };
//! let a = Tensor::arange(5, DType::F32)?.to_device(&device)?;
//! let b = a.add(&a)?; // runs on the device; the result stays there
//! assert_eq!(b.device(), device);
//! assert!(b.to_vec::<f32>().is_err()); // no host read of device data
//! assert_eq!(b.to_host()?.to_vec::<f32>()?, vec![0.0, 2.0, 4.0, 6.0, 8.0]);
//! # Ok::<(), hypershard_tensor::Error>(())
//! ```

use std::cell::RefCell;
use std::fmt;
use std::sync::Arc;

use crate::storage::HostBuffer;
use crate::{Error, Result};

/// Where a tensor's bytes live.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Device {
    /// Host memory: every op runs here.
    Cpu,
    /// The emulated device: host memory reachable only through the device API, with stream
    /// ordering checked (see [`emulated`](crate::emulated)). For testing the device-generic
    /// path on machines without a GPU.
    Emulated {
        /// Which emulated device; each ordinal has its own streams.
        ordinal: usize,
    },
    /// A CUDA GPU (feature `cuda`).
    #[cfg(feature = "cuda")]
    Cuda {
        /// The CUDA device ordinal.
        ordinal: usize,
    },
}

impl fmt::Display for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Device::Cpu => write!(f, "cpu"),
            Device::Emulated { ordinal } => write!(f, "emulated:{ordinal}"),
            #[cfg(feature = "cuda")]
            Device::Cuda { ordinal } => write!(f, "cuda:{ordinal}"),
        }
    }
}

impl Device {
    /// Whether this is the host.
    pub fn is_cpu(&self) -> bool {
        matches!(self, Device::Cpu)
    }

    /// Whether this is a CUDA GPU (always false without the `cuda` feature).
    pub fn is_cuda(&self) -> bool {
        #[cfg(feature = "cuda")]
        {
            matches!(self, Device::Cuda { .. })
        }
        #[cfg(not(feature = "cuda"))]
        {
            false
        }
    }

    /// The backend that allocates and moves this device's memory; the host has none
    /// ([`Error::DeviceUnsupported`]).
    pub fn backend(&self, op: &'static str) -> Result<Arc<dyn DeviceBackend>> {
        match *self {
            Device::Cpu => Err(Error::DeviceUnsupported { op, device: *self }),
            Device::Emulated { ordinal } => Ok(crate::emulated::backend(ordinal)),
            #[cfg(feature = "cuda")]
            Device::Cuda { ordinal } => crate::cuda::backend(op, ordinal),
        }
    }

    /// The stream this thread's device operations are recorded on: the innermost entered
    /// ([`Stream::enter`]) stream of this device, or its default stream.
    pub fn current_stream(&self) -> Stream {
        CURRENT_STREAMS
            .try_with(|streams| {
                streams
                    .borrow()
                    .iter()
                    .rev()
                    .find(|s| s.device == *self)
                    .copied()
            })
            .ok()
            .flatten()
            .unwrap_or(Stream {
                device: *self,
                id: 0,
            })
    }

    /// Waits for every stream of this device (a no-op on the host).
    pub fn synchronize(&self) -> Result<()> {
        if self.is_cpu() {
            return Ok(());
        }
        self.backend("synchronize")?.synchronize_all()
    }
}

/// A queue of device operations: operations on one stream run in order; operations on two
/// streams are unordered until one [waits for](Stream::wait_for) the other or is
/// [synchronised](Stream::synchronize).
///
/// Id 0 is the device's default stream. [`Stream::new`] makes another.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Stream {
    device: Device,
    id: u64,
}

impl fmt::Display for Stream {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} stream {}", self.device, self.id)
    }
}

impl Stream {
    /// A new stream on `device` ([`Error::DeviceUnsupported`] where the backend has only its
    /// default stream, and on the host, which has none).
    pub fn new(device: &Device) -> Result<Stream> {
        let id = device.backend("Stream::new")?.new_stream()?;
        Ok(Stream {
            device: *device,
            id,
        })
    }

    /// The stream with this id on `device`; backends make the ids ([`DeviceBackend::new_stream`]).
    pub fn from_id(device: Device, id: u64) -> Stream {
        Stream { device, id }
    }

    /// The device.
    pub fn device(&self) -> Device {
        self.device
    }

    /// The id on its device (0: the default stream).
    pub fn id(&self) -> u64 {
        self.id
    }

    /// Makes this the stream of its device's operations on this thread until the scope drops.
    pub fn enter(&self) -> StreamScope {
        // `try_with`: during thread teardown there is nothing left to order.
        let _ = CURRENT_STREAMS.try_with(|streams| streams.borrow_mut().push(*self));
        StreamScope { stream: *self }
    }

    /// Waits until every operation recorded on this stream so far has finished.
    pub fn synchronize(&self) -> Result<()> {
        self.device.backend("synchronize")?.synchronize(*self)
    }

    /// Orders every later operation of this stream after the operations recorded on `other`
    /// so far (an event recorded on `other` and waited on here), without blocking the host.
    pub fn wait_for(&self, other: &Stream) -> Result<()> {
        if other.device != self.device {
            return Err(Error::DeviceMismatch {
                op: "wait_for",
                lhs: self.device,
                rhs: other.device,
            });
        }
        self.device.backend("wait_for")?.wait(*self, *other)
    }
}

/// Makes the previous stream current again when dropped.
#[must_use = "the stream is current only while the scope is alive"]
#[derive(Debug)]
pub struct StreamScope {
    stream: Stream,
}

impl Drop for StreamScope {
    fn drop(&mut self) {
        let stream = self.stream;
        let _ = CURRENT_STREAMS.try_with(|streams| {
            let mut streams = streams.borrow_mut();
            if let Some(at) = streams.iter().rposition(|s| *s == stream) {
                streams.remove(at);
            }
        });
    }
}

thread_local! {
    /// The streams entered on this thread, innermost last.
    static CURRENT_STREAMS: RefCell<Vec<Stream>> = const { RefCell::new(Vec::new()) };
}

/// A device's allocator, stream bookkeeping and synchronisation.
pub trait DeviceBackend: Send + Sync + fmt::Debug {
    /// The device.
    fn device(&self) -> Device;
    /// `len` bytes of device memory, zeroed, allocated on `stream`.
    fn allocate(&self, len: usize, stream: Stream) -> Result<Box<dyn DeviceMemory>>;
    /// The id of a new stream.
    fn new_stream(&self) -> Result<u64>;
    /// Blocks until `stream`'s operations so far have finished.
    fn synchronize(&self, stream: Stream) -> Result<()>;
    /// Blocks until every stream's operations so far have finished.
    fn synchronize_all(&self) -> Result<()>;
    /// Orders `waiter`'s later operations after `on`'s operations so far.
    fn wait(&self, waiter: Stream, on: Stream) -> Result<()>;
}

/// One allocation of device memory. Every call names the [`Stream`] it is ordered on and the
/// op (for errors); ranges are in bytes and checked by [`DeviceBuffer`] before they get here.
pub trait DeviceMemory: Send + Sync + fmt::Debug + std::any::Any {
    /// The device the memory is on.
    fn device(&self) -> Device;
    /// Length in bytes.
    fn len(&self) -> usize;
    /// Whether the allocation holds no bytes.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Copies `src` to the bytes at `offset` (host → device).
    fn copy_from_host(
        &mut self,
        op: &'static str,
        offset: usize,
        src: &[u8],
        stream: Stream,
    ) -> Result<()>;
    /// Copies the bytes at `offset` into `dst` (device → host) and waits for the copy, so
    /// the bytes are there when it returns.
    fn copy_to_host(
        &self,
        op: &'static str,
        offset: usize,
        dst: &mut [u8],
        stream: Stream,
    ) -> Result<()>;
    /// Copies `len` bytes of `src` (same device) at `src_offset` to `dst_offset`
    /// (device → device).
    fn copy_from_device(
        &mut self,
        op: &'static str,
        dst_offset: usize,
        src: &dyn DeviceMemory,
        src_offset: usize,
        len: usize,
        stream: Stream,
    ) -> Result<()>;
    /// Sets `len` bytes at `offset` to `byte`.
    fn fill(
        &mut self,
        op: &'static str,
        offset: usize,
        len: usize,
        byte: u8,
        stream: Stream,
    ) -> Result<()>;
    /// The bytes as host memory that the crate's kernels can read, for a backend whose memory
    /// the host can execute on; [`Error::DeviceUnsupported`] otherwise. The access is
    /// ordered on `stream` (a read).
    fn kernel_bytes(&self, op: &'static str, stream: Stream) -> Result<&HostBuffer>;
    /// [`kernel_bytes`](DeviceMemory::kernel_bytes) for a kernel that writes.
    fn kernel_bytes_mut(&mut self, op: &'static str, stream: Stream) -> Result<&mut HostBuffer>;
    /// The memory as `Any`, for a backend to recognise its own kind in a device → device copy.
    fn as_any(&self) -> &dyn std::any::Any;
}

/// Device memory in a tensor's [`Storage`](crate::Storage): a [`DeviceMemory`] whose ranges
/// are checked here, once, for every backend.
#[derive(Debug)]
pub struct DeviceBuffer {
    memory: Box<dyn DeviceMemory>,
}

impl DeviceBuffer {
    /// `len` zero bytes on `device`, on its current stream.
    pub fn zeroed(op: &'static str, device: &Device, len: usize) -> Result<DeviceBuffer> {
        let backend = device.backend(op)?;
        let memory = backend.allocate(len, device.current_stream())?;
        Ok(DeviceBuffer { memory })
    }

    /// A copy of `bytes` on `device` (host → device on the current stream).
    pub fn from_host(op: &'static str, device: &Device, bytes: &[u8]) -> Result<DeviceBuffer> {
        let mut buf = DeviceBuffer::zeroed(op, device, bytes.len())?;
        buf.copy_from_host(op, 0, bytes)?;
        Ok(buf)
    }

    /// A backend's allocation as a buffer (its ranges are checked here from now on).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) fn from_memory(memory: Box<dyn DeviceMemory>) -> DeviceBuffer {
        DeviceBuffer { memory }
    }

    /// The backend's allocation, for a backend that hands its memory to another crate.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) fn into_memory(self) -> Box<dyn DeviceMemory> {
        self.memory
    }

    /// The device.
    pub fn device(&self) -> Device {
        self.memory.device()
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.memory.len()
    }

    /// Whether the buffer holds no bytes.
    pub fn is_empty(&self) -> bool {
        self.memory.is_empty()
    }

    /// The backend's memory.
    pub fn memory(&self) -> &dyn DeviceMemory {
        self.memory.as_ref()
    }

    fn check_range(&self, op: &'static str, offset: usize, len: usize) -> Result<()> {
        if offset.checked_add(len).is_none_or(|end| end > self.len()) {
            return Err(Error::RangeOutOfBounds {
                op,
                dim: 0,
                start: offset,
                len,
                size: self.len(),
            });
        }
        Ok(())
    }

    /// Copies `src` to the bytes at `offset`, on the device's current stream.
    pub fn copy_from_host(&mut self, op: &'static str, offset: usize, src: &[u8]) -> Result<()> {
        self.check_range(op, offset, src.len())?;
        let stream = self.device().current_stream();
        self.memory.copy_from_host(op, offset, src, stream)
    }

    /// Copies the bytes at `offset` into `dst`, on the device's current stream, and waits.
    pub fn copy_to_host(&self, op: &'static str, offset: usize, dst: &mut [u8]) -> Result<()> {
        self.check_range(op, offset, dst.len())?;
        let stream = self.device().current_stream();
        self.memory.copy_to_host(op, offset, dst, stream)
    }

    /// Copies `len` bytes of `src` at `src_offset` to `dst_offset`; both on one device.
    pub fn copy_from_device(
        &mut self,
        op: &'static str,
        dst_offset: usize,
        src: &DeviceBuffer,
        src_offset: usize,
        len: usize,
    ) -> Result<()> {
        if src.device() != self.device() {
            return Err(Error::DeviceMismatch {
                op,
                lhs: self.device(),
                rhs: src.device(),
            });
        }
        self.check_range(op, dst_offset, len)?;
        src.check_range(op, src_offset, len)?;
        let stream = self.device().current_stream();
        self.memory
            .copy_from_device(op, dst_offset, src.memory(), src_offset, len, stream)
    }

    /// Sets `len` bytes at `offset` to `byte`.
    pub fn fill(&mut self, op: &'static str, offset: usize, len: usize, byte: u8) -> Result<()> {
        self.check_range(op, offset, len)?;
        let stream = self.device().current_stream();
        self.memory.fill(op, offset, len, byte, stream)
    }

    /// The bytes for a host-executed kernel (see [`DeviceMemory::kernel_bytes`]).
    pub(crate) fn kernel_bytes(&self, op: &'static str) -> Result<&HostBuffer> {
        let stream = self.device().current_stream();
        self.memory.kernel_bytes(op, stream)
    }

    /// The bytes for a host-executed kernel that writes them.
    pub(crate) fn kernel_bytes_mut(&mut self, op: &'static str) -> Result<&mut HostBuffer> {
        let stream = self.device().current_stream();
        self.memory.kernel_bytes_mut(op, stream)
    }
}
