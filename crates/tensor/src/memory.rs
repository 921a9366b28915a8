//! Accounting of tensor storage: live and peak bytes, per rank and per process.
//!
//! Every [`HostBuffer`](crate::HostBuffer) counts its bytes in the process-wide tracker
//! ([`process`]) and in the tracker current on the allocating thread, if any. A rank that runs
//! as a thread (the `local` backend) makes its own tracker current for the duration of its work
//! with [`MemoryTracker::enter`]; the bytes are released from the same trackers when the buffer
//! is dropped, whichever thread drops it. This is what FSDP's memory tests read: the peak bytes
//! of tensor storage one rank held, measured at the allocator rather than estimated.
//!
//! ```
//! use hypershard_tensor::memory::MemoryTracker;
//! use hypershard_tensor::{DType, Tensor};
//! let tracker = MemoryTracker::new();
//! {
//!     let _scope = tracker.enter();
//!     let a = Tensor::zeros(&[256], DType::F32)?; // 1 KiB
//!     drop(a);
//!     let _b = Tensor::zeros(&[128], DType::F32)?; // 512 B
//!     assert_eq!(tracker.live_bytes(), 512);
//! }
//! assert_eq!(tracker.peak_bytes(), 1024);
//! # Ok::<(), hypershard_tensor::Error>(())
//! ```
//!
//! Device memory (a [`DeviceBuffer`](crate::DeviceBuffer) of the emulated device) counts in
//! the same trackers under its device's label, apart from host memory:
//!
//! ```
//! use hypershard_tensor::memory::MemoryTracker;
//! use hypershard_tensor::{DType, Device, Tensor};
//! let device = Device::Emulated { ordinal: 0 };
//! let tracker = MemoryTracker::new();
//! let _scope = tracker.enter();
//! let host = Tensor::zeros(&[64], DType::F32)?;
//! let on_device = host.to_device(&device)?;
//! assert_eq!(tracker.live_bytes(), 256); // the host tensor only
//! assert_eq!(tracker.device_stats(&device).live_bytes, 256);
//! drop(on_device);
//! assert_eq!(tracker.device_stats(&device).live_bytes, 0);
//! assert_eq!(tracker.device_stats(&device).peak_bytes, 256);
//! # Ok::<(), hypershard_tensor::Error>(())
//! ```

use std::cell::RefCell;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use crate::Device;

/// Live and peak byte counters, shared by every buffer counted in them.
#[derive(Debug, Default)]
struct Counters {
    live: AtomicUsize,
    peak: AtomicUsize,
    allocations: AtomicUsize,
    /// Device memory, per device (a short list: one entry per device ever counted here).
    devices: Mutex<Vec<(Device, MemoryStats)>>,
}

impl Counters {
    fn add(&self, bytes: usize) {
        let live = self.live.fetch_add(bytes, Ordering::Relaxed) + bytes;
        self.peak.fetch_max(live, Ordering::Relaxed);
        self.allocations.fetch_add(1, Ordering::Relaxed);
    }

    fn sub(&self, bytes: usize) {
        self.live.fetch_sub(bytes, Ordering::Relaxed);
    }

    /// Runs `f` on the counters of `device`, made zero on first use.
    fn on_device<R>(&self, device: Device, f: impl FnOnce(&mut MemoryStats) -> R) -> R {
        // Plain counters: a panic elsewhere leaves them usable.
        let mut devices = self.devices.lock().unwrap_or_else(PoisonError::into_inner);
        let at = match devices.iter().position(|(d, _)| *d == device) {
            Some(at) => at,
            None => {
                devices.push((device, MemoryStats::default()));
                devices.len() - 1
            }
        };
        f(&mut devices[at].1)
    }

    fn add_device(&self, device: Device, bytes: usize) {
        self.on_device(device, |stats| {
            stats.live_bytes += bytes;
            stats.peak_bytes = stats.peak_bytes.max(stats.live_bytes);
            stats.allocations += 1;
        });
    }

    fn sub_device(&self, device: Device, bytes: usize) {
        self.on_device(device, |stats| stats.live_bytes -= bytes);
    }

    fn device_stats(&self, device: Device) -> MemoryStats {
        self.on_device(device, |stats| *stats)
    }
}

/// A set of counters that buffers allocated under [`MemoryTracker::enter`] count themselves in.
///
/// Cloning gives another handle to the same counters.
#[derive(Debug, Clone, Default)]
pub struct MemoryTracker {
    counters: Arc<Counters>,
}

/// A snapshot of a tracker's counters.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct MemoryStats {
    /// Bytes held by buffers alive now.
    pub live_bytes: usize,
    /// The most bytes held at once since creation or the last [`MemoryTracker::reset_peak`].
    pub peak_bytes: usize,
    /// Number of buffers allocated since creation.
    pub allocations: usize,
}

impl MemoryTracker {
    /// A tracker with zero counts.
    pub fn new() -> Self {
        Self::default()
    }

    /// Makes this tracker current on this thread until the guard drops (the previous one, if
    /// any, is current again afterwards). Buffers allocated meanwhile count here.
    pub fn enter(&self) -> TrackerScope {
        let previous = CURRENT.with(|c| c.replace(Some(self.counters.clone())));
        TrackerScope { previous }
    }

    /// Bytes held by buffers alive now.
    pub fn live_bytes(&self) -> usize {
        self.counters.live.load(Ordering::Relaxed)
    }

    /// The most bytes held at once.
    pub fn peak_bytes(&self) -> usize {
        self.counters.peak.load(Ordering::Relaxed)
    }

    /// All counters at once.
    pub fn stats(&self) -> MemoryStats {
        MemoryStats {
            live_bytes: self.live_bytes(),
            peak_bytes: self.peak_bytes(),
            allocations: self.counters.allocations.load(Ordering::Relaxed),
        }
    }

    /// The counters of `device`'s memory (all zero for the host: see
    /// [`stats`](MemoryTracker::stats)).
    pub fn device_stats(&self, device: &Device) -> MemoryStats {
        self.counters.device_stats(*device)
    }

    /// Restarts peak tracking from the live bytes now (host and every device).
    pub fn reset_peak(&self) {
        self.counters.peak.store(
            self.counters.live.load(Ordering::Relaxed),
            Ordering::Relaxed,
        );
        let mut devices = self
            .counters
            .devices
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        for (_, stats) in devices.iter_mut() {
            stats.peak_bytes = stats.live_bytes;
        }
    }
}

/// Restores the previously current tracker when dropped.
#[must_use = "the tracker is current only while the scope is alive"]
#[derive(Debug)]
pub struct TrackerScope {
    previous: Option<Arc<Counters>>,
}

impl Drop for TrackerScope {
    fn drop(&mut self) {
        let previous = self.previous.take();
        // `try_with` so a scope dropped during thread teardown never panics.
        let _ = CURRENT.try_with(|c| c.replace(previous));
    }
}

thread_local! {
    static CURRENT: RefCell<Option<Arc<Counters>>> = const { RefCell::new(None) };
}

static PROCESS: Counters = Counters {
    live: AtomicUsize::new(0),
    peak: AtomicUsize::new(0),
    allocations: AtomicUsize::new(0),
    devices: Mutex::new(Vec::new()),
};

/// The process-wide counters: every buffer of every thread.
pub fn process() -> MemoryStats {
    MemoryStats {
        live_bytes: PROCESS.live.load(Ordering::Relaxed),
        peak_bytes: PROCESS.peak.load(Ordering::Relaxed),
        allocations: PROCESS.allocations.load(Ordering::Relaxed),
    }
}

/// The process-wide counters of `device`'s memory.
pub fn process_device(device: &Device) -> MemoryStats {
    PROCESS.device_stats(*device)
}

/// The accounting entry of one buffer: counted on creation, released on drop.
#[derive(Debug)]
pub(crate) struct Tracked {
    bytes: usize,
    /// `None` for host memory, else the device whose counters hold the bytes.
    device: Option<Device>,
    thread_tracker: Option<Arc<Counters>>,
}

impl Tracked {
    /// Host bytes: lock-free counters only, as host allocation is the hot path.
    pub(crate) fn new(bytes: usize) -> Self {
        PROCESS.add(bytes);
        let thread_tracker = CURRENT.try_with(|c| c.borrow().clone()).ok().flatten();
        if let Some(counters) = &thread_tracker {
            counters.add(bytes);
        }
        Tracked {
            bytes,
            device: None,
            thread_tracker,
        }
    }

    /// Bytes of `device`'s memory.
    pub(crate) fn on_device(bytes: usize, device: Device) -> Self {
        PROCESS.add_device(device, bytes);
        let thread_tracker = CURRENT.try_with(|c| c.borrow().clone()).ok().flatten();
        if let Some(counters) = &thread_tracker {
            counters.add_device(device, bytes);
        }
        Tracked {
            bytes,
            device: Some(device),
            thread_tracker,
        }
    }
}

impl Drop for Tracked {
    fn drop(&mut self) {
        match self.device {
            None => {
                PROCESS.sub(self.bytes);
                if let Some(counters) = &self.thread_tracker {
                    counters.sub(self.bytes);
                }
            }
            Some(device) => {
                PROCESS.sub_device(device, self.bytes);
                if let Some(counters) = &self.thread_tracker {
                    counters.sub_device(device, self.bytes);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::HostBuffer;

    #[test]
    fn ranks_on_threads_count_separately_even_when_dropped_elsewhere() {
        let a = MemoryTracker::new();
        let b = MemoryTracker::new();
        let from_a = std::thread::scope(|s| {
            let ta = s.spawn(|| {
                let _scope = a.enter();
                let keep = HostBuffer::zeroed(1000);
                let _tmp = HostBuffer::zeroed(500);
                keep
            });
            let tb = s.spawn(|| {
                let _scope = b.enter();
                drop(HostBuffer::zeroed(64));
            });
            tb.join().expect("thread b");
            ta.join().expect("thread a")
        });
        assert_eq!(
            a.stats(),
            MemoryStats {
                live_bytes: 1000,
                peak_bytes: 1500,
                allocations: 2
            }
        );
        assert_eq!(
            b.stats(),
            MemoryStats {
                live_bytes: 0,
                peak_bytes: 64,
                allocations: 1
            }
        );
        // Dropped on this thread, which has no tracker: still released from `a`.
        drop(from_a);
        assert_eq!(a.live_bytes(), 0);
        a.reset_peak();
        assert_eq!(a.peak_bytes(), 0);
    }

    #[test]
    fn scopes_nest_and_restore() {
        let outer = MemoryTracker::new();
        let inner = MemoryTracker::new();
        let _o = outer.enter();
        {
            let _i = inner.enter();
            let _buf = HostBuffer::zeroed(10);
            assert_eq!(inner.live_bytes(), 10);
            assert_eq!(outer.live_bytes(), 0);
        }
        let _buf = HostBuffer::zeroed(7);
        assert_eq!(outer.live_bytes(), 7);
        assert_eq!(inner.live_bytes(), 0);
        assert!(process().peak_bytes >= 10);
    }
}
