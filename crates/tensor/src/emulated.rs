//! The emulated device: device memory that lives on the host, for testing the device path.
//!
//! [`Device::Emulated`] behaves as a GPU does towards the rest of the crate: its memory is a
//! [`DeviceBuffer`](crate::DeviceBuffer) that no host read reaches (`to_vec`, `as_slice`-like
//! reads and `with_data` are [`Error::DeviceData`]), data moves only by explicit copies
//! ([`Tensor::to_device`](crate::Tensor::to_device), [`Tensor::to_host`](crate::Tensor::to_host)),
//! and an op whose inputs are on different devices is [`Error::DeviceMismatch`]. The crate's
//! ops run on it by executing their host kernels on the emulated memory, so the one op body
//! that a CPU test exercises also exercises the device dispatch, staging and errors.
//!
//! # Stream ordering
//!
//! Every operation is recorded on a [`Stream`]: the thread's current one for the device
//! (see [`Stream::enter`]), else the default stream. Each allocation remembers the stream and
//! sequence number of its last write. An access from stream `R` to memory last written on
//! another stream `W` is [`Error::StreamOrder`] unless that write is known to be finished:
//! `W` was [synchronised](Stream::synchronize) after it, or `R` [waited](Stream::wait_for)
//! for `W` after it. On a GPU the same access reads or overwrites memory that a kernel may
//! still be writing; here it fails every time, deterministically, which is the point.
//!
//! A copy to the host on the writer's own stream is ordered after the write by the stream
//! itself, so [`Tensor::to_host`](crate::Tensor::to_host) does what `cudaMemcpy` does: it
//! records the copy on the current stream and then synchronises that stream (the host cannot
//! use the bytes before the copy has finished, so a non-blocking copy to pageable memory
//! would buy nothing). The check thus fires exactly for the unsynchronised cross-stream case,
//! the one a real program gets wrong. Reads after reads, and a write after another stream's
//! read, are not tracked.
//!
//! The memory is counted by the [`memory`](crate::memory) trackers under the device's label,
//! apart from host memory ([`MemoryTracker::device_stats`](crate::memory::MemoryTracker::device_stats)).
//!
//! ```
//! use hypershard_tensor::{DType, Device, Error, Stream, Tensor};
//! let device = Device::Emulated { ordinal: 3 };
//! let side = Stream::new(&device)?;
//! let t = {
//!     let _on_side = side.enter();
//!     Tensor::ones(&[4], DType::F32)?.to_device(&device)? // written on `side`
//! };
//! // Read on the default stream while `side` may still be writing:
//! assert!(matches!(t.to_host(), Err(Error::StreamOrder { .. })));
//! side.synchronize()?;
//! assert_eq!(t.to_host()?.to_vec::<f32>()?, vec![1.0; 4]);
//! # Ok::<(), hypershard_tensor::Error>(())
//! ```

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};

use crate::device::{Device, DeviceBackend, DeviceMemory, Stream};
use crate::storage::HostBuffer;
use crate::{Error, Result};

/// The stream bookkeeping of one emulated device.
#[derive(Debug, Default)]
struct Streams {
    /// The id the next [`Stream::new`] gets (0 is the default stream).
    next: u64,
    /// Operations recorded per stream.
    recorded: HashMap<u64, u64>,
    /// Per stream, the recorded count at its last synchronisation.
    finished: HashMap<u64, u64>,
    /// Per (waiter, waited-on) pair, the waited-on stream's recorded count at the last wait.
    waited: HashMap<(u64, u64), u64>,
}

impl Streams {
    /// Records one operation on `stream`, returning its sequence number.
    fn record(&mut self, stream: u64) -> u64 {
        let count = self.recorded.entry(stream).or_insert(0);
        *count += 1;
        *count
    }

    /// Whether the write `(writer, seq)` is ordered before an access on `reader`.
    fn ordered(&self, writer: u64, seq: u64, reader: u64) -> bool {
        writer == reader
            || self.finished.get(&writer).is_some_and(|&f| f >= seq)
            || self
                .waited
                .get(&(reader, writer))
                .is_some_and(|&w| w >= seq)
    }
}

/// One emulated device, shared by every allocation on it.
#[derive(Debug)]
pub(crate) struct EmulatedBackend {
    ordinal: usize,
    streams: Mutex<Streams>,
}

/// The emulated devices made so far, by ordinal. A process-wide table because a
/// [`Device`] is a plain value: every tensor on `Emulated { ordinal }` must meet the same
/// stream bookkeeping, however it was named.
static DEVICES: Mutex<Vec<Arc<EmulatedBackend>>> = Mutex::new(Vec::new());

/// Emulated device `ordinal`, made on first use.
fn emulated(ordinal: usize) -> Arc<EmulatedBackend> {
    let mut devices = DEVICES.lock().unwrap_or_else(PoisonError::into_inner);
    if let Some(found) = devices.iter().find(|d| d.ordinal == ordinal) {
        return found.clone();
    }
    let made = Arc::new(EmulatedBackend {
        ordinal,
        streams: Mutex::new(Streams {
            next: 1,
            ..Streams::default()
        }),
    });
    devices.push(made.clone());
    made
}

/// The backend of emulated device `ordinal`.
pub(crate) fn backend(ordinal: usize) -> Arc<dyn DeviceBackend> {
    emulated(ordinal)
}

impl EmulatedBackend {
    fn device_value(&self) -> Device {
        Device::Emulated {
            ordinal: self.ordinal,
        }
    }

    fn streams(&self) -> std::sync::MutexGuard<'_, Streams> {
        // The bookkeeping is plain counters; a panic elsewhere leaves them usable.
        self.streams.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn check_stream(&self, op: &'static str, stream: Stream) -> Result<()> {
        if stream.device() == self.device_value() {
            Ok(())
        } else {
            Err(Error::DeviceMismatch {
                op,
                lhs: self.device_value(),
                rhs: stream.device(),
            })
        }
    }
}

impl DeviceBackend for EmulatedBackend {
    fn device(&self) -> Device {
        self.device_value()
    }

    fn allocate(&self, len: usize, stream: Stream) -> Result<Box<dyn DeviceMemory>> {
        self.check_stream("allocate", stream)?;
        let device = self.device_value();
        // The zeroing is the allocation's first write, on the allocating stream.
        let seq = self.streams().record(stream.id());
        Ok(Box::new(EmulatedMemory {
            backend: emulated(self.ordinal),
            bytes: HostBuffer::zeroed_on(len, device),
            last_write: Some((stream.id(), seq)),
        }))
    }

    fn new_stream(&self) -> Result<u64> {
        let mut streams = self.streams();
        let id = streams.next;
        streams.next += 1;
        Ok(id)
    }

    fn synchronize(&self, stream: Stream) -> Result<()> {
        self.check_stream("synchronize", stream)?;
        let mut streams = self.streams();
        let recorded = streams.recorded.get(&stream.id()).copied().unwrap_or(0);
        streams.finished.insert(stream.id(), recorded);
        Ok(())
    }

    fn synchronize_all(&self) -> Result<()> {
        let mut streams = self.streams();
        let recorded: Vec<(u64, u64)> = streams.recorded.iter().map(|(&s, &n)| (s, n)).collect();
        streams.finished.extend(recorded);
        Ok(())
    }

    fn wait(&self, waiter: Stream, on: Stream) -> Result<()> {
        self.check_stream("wait_for", waiter)?;
        self.check_stream("wait_for", on)?;
        let mut streams = self.streams();
        let recorded = streams.recorded.get(&on.id()).copied().unwrap_or(0);
        streams.waited.insert((waiter.id(), on.id()), recorded);
        Ok(())
    }
}

/// One emulated allocation: host bytes that only the [`DeviceMemory`] calls reach.
#[derive(Debug)]
struct EmulatedMemory {
    backend: Arc<EmulatedBackend>,
    bytes: HostBuffer,
    /// The stream and sequence number of the last write.
    last_write: Option<(u64, u64)>,
}

impl EmulatedMemory {
    /// Errors unless the last write is ordered before an access on `stream`.
    fn check_ordered(&self, op: &'static str, stream: Stream) -> Result<()> {
        self.backend.check_stream(op, stream)?;
        let Some((writer, seq)) = self.last_write else {
            return Ok(());
        };
        if self.backend.streams().ordered(writer, seq, stream.id()) {
            Ok(())
        } else {
            Err(Error::StreamOrder {
                op,
                writer: Stream::from_id(self.backend.device_value(), writer),
                reader: stream,
            })
        }
    }

    /// Checks ordering for a write on `stream`, then records it.
    fn write(&mut self, op: &'static str, stream: Stream) -> Result<()> {
        self.check_ordered(op, stream)?;
        let seq = self.backend.streams().record(stream.id());
        self.last_write = Some((stream.id(), seq));
        Ok(())
    }

    /// Checks ordering for a read on `stream`, then records it.
    fn read(&self, op: &'static str, stream: Stream) -> Result<()> {
        self.check_ordered(op, stream)?;
        self.backend.streams().record(stream.id());
        Ok(())
    }
}

impl DeviceMemory for EmulatedMemory {
    fn device(&self) -> Device {
        self.backend.device_value()
    }

    fn len(&self) -> usize {
        self.bytes.len()
    }

    fn copy_from_host(
        &mut self,
        op: &'static str,
        offset: usize,
        src: &[u8],
        stream: Stream,
    ) -> Result<()> {
        self.write(op, stream)?;
        self.bytes.as_bytes_mut()[offset..offset + src.len()].copy_from_slice(src);
        Ok(())
    }

    fn copy_to_host(
        &self,
        op: &'static str,
        offset: usize,
        dst: &mut [u8],
        stream: Stream,
    ) -> Result<()> {
        self.read(op, stream)?;
        dst.copy_from_slice(&self.bytes.as_bytes()[offset..offset + dst.len()]);
        // The host uses the bytes next: the copy must have finished (see the module docs).
        self.backend.synchronize(stream)
    }

    fn copy_from_device(
        &mut self,
        op: &'static str,
        dst_offset: usize,
        src: &dyn DeviceMemory,
        src_offset: usize,
        len: usize,
        stream: Stream,
    ) -> Result<()> {
        let Some(src) = src.as_any().downcast_ref::<EmulatedMemory>() else {
            return Err(Error::DeviceMismatch {
                op,
                lhs: self.device(),
                rhs: src.device(),
            });
        };
        src.read(op, stream)?;
        self.write(op, stream)?;
        self.bytes.as_bytes_mut()[dst_offset..dst_offset + len]
            .copy_from_slice(&src.bytes.as_bytes()[src_offset..src_offset + len]);
        Ok(())
    }

    fn fill(
        &mut self,
        op: &'static str,
        offset: usize,
        len: usize,
        byte: u8,
        stream: Stream,
    ) -> Result<()> {
        self.write(op, stream)?;
        self.bytes.as_bytes_mut()[offset..offset + len].fill(byte);
        Ok(())
    }

    fn kernel_bytes(&self, op: &'static str, stream: Stream) -> Result<&HostBuffer> {
        self.read(op, stream)?;
        Ok(&self.bytes)
    }

    fn kernel_bytes_mut(&mut self, op: &'static str, stream: Stream) -> Result<&mut HostBuffer> {
        self.write(op, stream)?;
        Ok(&mut self.bytes)
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}
