//! Buffers: the owned, dtype-tagged memory that ops take by value and hand back.
//!
//! A [`Buffer`] is an enum so that a CUDA device variant can be added for the NCCL backend
//! without changing any caller: code that builds buffers with [`Buffer::from_vec`] and reads them
//! back with [`Buffer::into_vec`] keeps working, and a backend that meets a buffer it cannot
//! serve returns [`Error::UnsupportedBuffer`].

use std::fmt;
use std::sync::Arc;

use bytemuck::{Pod, Zeroable};
use half::{bf16, f16};

use crate::dtype::{DType, Element};
use crate::error::{Error, Result};

pub use crate::location::BufferLocation;

/// The allocation unit of a [`HostBuffer`]: 64 bytes, 64-byte aligned, so the storage is aligned
/// for every element type and for full-width vector loads.
#[derive(Clone, Copy, Pod, Zeroable)]
#[repr(C, align(64))]
struct Block([u8; BLOCK_BYTES]);

const BLOCK_BYTES: usize = 64;

/// Buffers at least this large ask the kernel for transparent huge pages (Linux
/// `madvise(MADV_HUGEPAGE)`): collective buffers of many MiB are written once, end to end, by a
/// receive or a copy, and on 4 KiB pages that first write is one page fault per 4 KiB; the
/// shared-memory transport measured 1.2–1.4× more all-gather / reduce-scatter bandwidth at
/// 64 MiB with huge pages (docs/shm.md). Smaller buffers stay on ordinary pages: rounding them to
/// 2 MiB would waste memory for little gain.
pub const HUGE_PAGE_MIN_BYTES: usize = 4 << 20;

/// The size of a transparent huge page on x86-64 and most aarch64 kernels.
const HUGE_PAGE_BYTES: usize = 2 << 20;

/// Set to `0` (or `off`, `false`, `no`) to keep every buffer on ordinary pages, e.g. to measure
/// what huge pages bring; read once per process. Any other value, or none, leaves them on.
pub const HUGE_PAGES_ENV: &str = "HYPERSHARD_HUGE_PAGES";

fn huge_pages_wanted() -> bool {
    static WANTED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *WANTED.get_or_init(|| {
        std::env::var(HUGE_PAGES_ENV).map_or(true, |v| crate::env::parse_switch(&v) != Some(false))
    })
}

/// The whole huge pages inside `[start, start + len)`: the start rounded up and the end rounded
/// down to `HUGE_PAGE_BYTES`, or `None` when not one whole huge page fits.
fn huge_page_span(start: usize, len: usize) -> Option<(usize, usize)> {
    let first = start.checked_next_multiple_of(HUGE_PAGE_BYTES)?;
    let end = start.checked_add(len)? / HUGE_PAGE_BYTES * HUGE_PAGE_BYTES;
    (end > first).then(|| (first, end - first))
}

/// `len` zeroed blocks. The advice is given on the fresh, still untouched allocation and the
/// zeros are written after it, so the first touch of each 2 MiB range faults in one huge page
/// instead of 512 base pages. (The zeroed-allocation path cannot be used for this: for a
/// 64-byte alignment the system allocator zeroes the memory itself, before any advice.)
fn zeroed_blocks(len: usize) -> Vec<Block> {
    let mut blocks: Vec<Block> = Vec::with_capacity(len);
    let bytes = len * BLOCK_BYTES;
    if bytes >= HUGE_PAGE_MIN_BYTES && huge_pages_wanted() {
        advise_huge_pages(blocks.as_ptr() as usize, bytes);
    }
    blocks.resize(len, Block([0; BLOCK_BYTES]));
    blocks
}

#[cfg(target_os = "linux")]
fn advise_huge_pages(start: usize, len: usize) {
    let Some((first, span)) = huge_page_span(start, len) else {
        return;
    };
    // SAFETY: `[first, first + span)` lies inside one live allocation of `len` bytes at `start`
    // (huge_page_span only shrinks the range) and is aligned to 2 MiB, hence to the base page
    // size, as madvise requires. MADV_HUGEPAGE is advice about how to back the range: it does
    // not change its contents, its protection or its lifetime, so no Rust reference to the
    // memory is invalidated. The result is deliberately ignored: a kernel built without
    // transparent huge pages answers EINVAL and the buffer simply stays on base pages.
    unsafe {
        libc::madvise(first as *mut libc::c_void, span, libc::MADV_HUGEPAGE);
    }
}

#[cfg(not(target_os = "linux"))]
fn advise_huge_pages(_start: usize, _len: usize) {}

/// Host memory holding `len` elements of `dtype`, 64-byte aligned.
///
/// The blocks sit behind an [`Arc`] so that [`share`](HostBuffer::share) can lend the same
/// memory to another owner without copying (a sender keeps its data while a collective reads
/// it). Sharing is copy-on-write: the first mutable access through a shared buffer copies its
/// bytes into a private allocation first, so no owner ever sees another's writes. A buffer
/// that was never shared pays one reference-count check per mutable access.
pub struct HostBuffer {
    blocks: Arc<Vec<Block>>,
    dtype: DType,
    len: usize,
}

impl Clone for HostBuffer {
    /// A deep copy in a new allocation (use [`share`](HostBuffer::share) to lend the memory
    /// instead).
    fn clone(&self) -> Self {
        HostBuffer {
            blocks: Arc::new(self.blocks.as_ref().clone()),
            dtype: self.dtype,
            len: self.len,
        }
    }
}

impl HostBuffer {
    /// A buffer of `len` zero elements (zero bits are `0` / `+0.0` in every dtype).
    pub fn zeros(dtype: DType, len: usize) -> Self {
        let bytes = len.saturating_mul(dtype.size_bytes());
        HostBuffer {
            blocks: Arc::new(zeroed_blocks(bytes.div_ceil(BLOCK_BYTES))),
            dtype,
            len,
        }
    }

    /// Another handle to the same memory, without copying.
    ///
    /// Both handles read the same bytes; whichever is written first (through
    /// [`as_bytes_mut`](HostBuffer::as_bytes_mut) or any method built on it) copies them into
    /// a private allocation first. This is how a caller lends its data to an op that only
    /// reads its input (all-gather, reduce-scatter, all-to-all send buffers) while keeping it.
    pub fn share(&self) -> HostBuffer {
        HostBuffer {
            blocks: Arc::clone(&self.blocks),
            dtype: self.dtype,
            len: self.len,
        }
    }

    /// Whether another handle made by [`share`](HostBuffer::share) still holds this memory (a
    /// write would copy it first).
    pub fn is_shared(&self) -> bool {
        Arc::strong_count(&self.blocks) > 1
    }

    /// A buffer holding a copy of `values`.
    pub fn from_slice<T: Element>(values: &[T]) -> Self {
        let mut buffer = HostBuffer::zeros(T::DTYPE, values.len());
        buffer
            .as_bytes_mut()
            .copy_from_slice(bytemuck::cast_slice(values));
        buffer
    }

    /// A buffer holding the elements of `values` (copied once into aligned storage).
    pub fn from_vec<T: Element>(values: Vec<T>) -> Self {
        HostBuffer::from_slice(&values)
    }

    /// A buffer of `dtype` elements holding a copy of `bytes` (native byte order).
    ///
    /// Fails with [`Error::MisalignedBytes`] when `bytes.len()` is not a multiple of the element
    /// size.
    pub fn from_bytes(dtype: DType, bytes: &[u8]) -> Result<Self> {
        if !bytes.len().is_multiple_of(dtype.size_bytes()) {
            return Err(Error::MisalignedBytes {
                dtype,
                bytes: bytes.len(),
            });
        }
        let mut buffer = HostBuffer::zeros(dtype, bytes.len() / dtype.size_bytes());
        buffer.as_bytes_mut().copy_from_slice(bytes);
        Ok(buffer)
    }

    /// A buffer of `dtype` whose element `i` is `values[i]` converted the way `as` converts
    /// (floats round to nearest, integers truncate and saturate). Used by tests and fixtures.
    pub fn from_f64(dtype: DType, values: &[f64]) -> Self {
        match dtype {
            DType::F32 => HostBuffer::from_vec(values.iter().map(|&v| v as f32).collect()),
            DType::F64 => HostBuffer::from_slice(values),
            DType::BF16 => {
                HostBuffer::from_vec(values.iter().map(|&v| bf16::from_f64(v)).collect())
            }
            DType::F16 => HostBuffer::from_vec(values.iter().map(|&v| f16::from_f64(v)).collect()),
            DType::I32 => HostBuffer::from_vec(values.iter().map(|&v| v as i32).collect()),
            DType::I64 => HostBuffer::from_vec(values.iter().map(|&v| v as i64).collect()),
            DType::U8 => HostBuffer::from_vec(values.iter().map(|&v| v as u8).collect()),
        }
    }

    /// Every element widened to `f64` (exact for every dtype except large `i64`s).
    pub fn to_f64_vec(&self) -> Vec<f64> {
        let bytes = self.as_bytes();
        match self.dtype {
            DType::F32 => typed::<f32>(bytes).iter().map(|&v| v as f64).collect(),
            DType::F64 => typed::<f64>(bytes).to_vec(),
            DType::BF16 => typed::<bf16>(bytes).iter().map(|v| v.to_f64()).collect(),
            DType::F16 => typed::<f16>(bytes).iter().map(|v| v.to_f64()).collect(),
            DType::I32 => typed::<i32>(bytes).iter().map(|&v| v as f64).collect(),
            DType::I64 => typed::<i64>(bytes).iter().map(|&v| v as f64).collect(),
            DType::U8 => bytes.iter().map(|&v| v as f64).collect(),
        }
    }

    /// The element type.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// The number of elements.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the buffer holds no elements.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The number of payload bytes (`len × element size`).
    pub fn byte_len(&self) -> usize {
        self.len * self.dtype.size_bytes()
    }

    /// The payload bytes, in native byte order.
    pub fn as_bytes(&self) -> &[u8] {
        let all: &[u8] = bytemuck::cast_slice(self.blocks.as_slice());
        &all[..self.byte_len()]
    }

    /// The payload bytes, mutable.
    pub fn as_bytes_mut(&mut self) -> &mut [u8] {
        let byte_len = self.byte_len();
        // Copy-on-write: a shared buffer gets private blocks before anyone writes.
        let all: &mut [u8] =
            bytemuck::cast_slice_mut(Arc::make_mut(&mut self.blocks).as_mut_slice());
        &mut all[..byte_len]
    }

    /// The elements as `&[T]`; [`Error::ElementTypeMismatch`] when `T` is not the buffer's dtype.
    pub fn as_slice<T: Element>(&self) -> Result<&[T]> {
        self.check_element::<T>()?;
        Ok(typed(self.as_bytes()))
    }

    /// The elements as `&mut [T]`; [`Error::ElementTypeMismatch`] when `T` is not the dtype.
    pub fn as_mut_slice<T: Element>(&mut self) -> Result<&mut [T]> {
        self.check_element::<T>()?;
        Ok(typed_mut(self.as_bytes_mut()))
    }

    /// The elements as a `Vec<T>`; [`Error::ElementTypeMismatch`] when `T` is not the dtype.
    pub fn into_vec<T: Element>(self) -> Result<Vec<T>> {
        Ok(self.as_slice::<T>()?.to_vec())
    }

    fn check_element<T: Element>(&self) -> Result<()> {
        if T::DTYPE == self.dtype {
            Ok(())
        } else {
            Err(Error::ElementTypeMismatch {
                buffer: self.dtype,
                requested: T::DTYPE,
            })
        }
    }
}

/// Reinterprets aligned payload bytes as elements.
///
/// Every `&[u8]` handed in comes from a [`HostBuffer`] (64-byte aligned storage) sliced at a
/// multiple of the element size, so the cast cannot fail on alignment or length; `bytemuck`
/// still checks both.
pub(crate) fn typed<T: Pod>(bytes: &[u8]) -> &[T] {
    bytemuck::cast_slice(bytes)
}

/// The mutable counterpart of [`typed`].
pub(crate) fn typed_mut<T: Pod>(bytes: &mut [u8]) -> &mut [T] {
    bytemuck::cast_slice_mut(bytes)
}

impl fmt::Debug for HostBuffer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HostBuffer")
            .field("dtype", &self.dtype)
            .field("len", &self.len)
            .finish()
    }
}

impl PartialEq for HostBuffer {
    fn eq(&self, other: &Self) -> bool {
        self.dtype == other.dtype && self.len == other.len && self.as_bytes() == other.as_bytes()
    }
}

/// An owned, dtype-tagged buffer that an op takes by value and hands back when it completes.
#[derive(Clone, Debug, PartialEq)]
#[non_exhaustive]
pub enum Buffer {
    /// Host memory.
    Host(HostBuffer),
    /// CUDA device memory (the NCCL backend); see [`DeviceBuffer`](crate::device_buffer::DeviceBuffer).
    #[cfg(feature = "nccl")]
    Cuda(crate::device_buffer::DeviceBuffer),
}

impl Buffer {
    /// A host buffer of `len` zero elements.
    pub fn zeros(dtype: DType, len: usize) -> Self {
        Buffer::Host(HostBuffer::zeros(dtype, len))
    }

    /// A host buffer holding the elements of `values`.
    pub fn from_vec<T: Element>(values: Vec<T>) -> Self {
        Buffer::Host(HostBuffer::from_vec(values))
    }

    /// A host buffer holding a copy of `values`.
    pub fn from_slice<T: Element>(values: &[T]) -> Self {
        Buffer::Host(HostBuffer::from_slice(values))
    }

    /// The element type.
    pub fn dtype(&self) -> DType {
        match self {
            Buffer::Host(host) => host.dtype(),
            #[cfg(feature = "nccl")]
            Buffer::Cuda(device) => device.dtype(),
        }
    }

    /// The number of elements.
    pub fn len(&self) -> usize {
        match self {
            Buffer::Host(host) => host.len(),
            #[cfg(feature = "nccl")]
            Buffer::Cuda(device) => device.len(),
        }
    }

    /// Whether the buffer holds no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The number of payload bytes.
    pub fn byte_len(&self) -> usize {
        self.len() * self.dtype().size_bytes()
    }

    /// Where the memory lives.
    pub fn location(&self) -> BufferLocation {
        match self {
            Buffer::Host(_) => BufferLocation::Host,
            #[cfg(feature = "nccl")]
            Buffer::Cuda(device) => device.location(),
        }
    }

    /// The host buffer, or [`Error::NotHost`] for device memory.
    pub fn as_host(&self) -> Result<&HostBuffer> {
        match self {
            Buffer::Host(host) => Ok(host),
            #[cfg(feature = "nccl")]
            Buffer::Cuda(device) => Err(Error::NotHost {
                location: device.location(),
            }),
        }
    }

    /// The host buffer, mutable, or [`Error::NotHost`] for device memory.
    pub fn as_host_mut(&mut self) -> Result<&mut HostBuffer> {
        match self {
            Buffer::Host(host) => Ok(host),
            #[cfg(feature = "nccl")]
            Buffer::Cuda(device) => Err(Error::NotHost {
                location: device.location(),
            }),
        }
    }

    /// The host buffer by value, or [`Error::NotHost`] for device memory.
    pub fn into_host(self) -> Result<HostBuffer> {
        match self {
            Buffer::Host(host) => Ok(host),
            #[cfg(feature = "nccl")]
            Buffer::Cuda(device) => Err(Error::NotHost {
                location: device.location(),
            }),
        }
    }

    /// The elements as `&[T]` (host buffers only).
    pub fn as_slice<T: Element>(&self) -> Result<&[T]> {
        self.as_host()?.as_slice()
    }

    /// The elements as `&mut [T]` (host buffers only).
    pub fn as_mut_slice<T: Element>(&mut self) -> Result<&mut [T]> {
        self.as_host_mut()?.as_mut_slice()
    }

    /// The elements as a `Vec<T>`; [`Error::ElementTypeMismatch`] when `T` is not the dtype.
    pub fn into_vec<T: Element>(self) -> Result<Vec<T>> {
        self.into_host()?.into_vec()
    }
}

impl From<HostBuffer> for Buffer {
    fn from(host: HostBuffer) -> Self {
        Buffer::Host(host)
    }
}

impl<T: Element> From<Vec<T>> for Buffer {
    fn from(values: Vec<T>) -> Self {
        Buffer::from_vec(values)
    }
}

/// The two buffers of an op with a separate input and output, handed back by
/// [`Work::wait`](crate::Work::wait).
#[derive(Debug)]
pub struct BufferPair {
    /// The input, unchanged.
    pub input: Buffer,
    /// The output, filled by the op.
    pub output: Buffer,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn huge_page_spans_are_the_whole_pages_inside() {
        const H: usize = HUGE_PAGE_BYTES;
        assert_eq!(huge_page_span(0, 3 * H), Some((0, 3 * H)));
        assert_eq!(huge_page_span(64, 3 * H), Some((H, 2 * H)));
        assert_eq!(huge_page_span(H - 64, 2 * H + 64), Some((H, 2 * H)));
        assert_eq!(huge_page_span(64, 2 * H - 64), Some((H, H)));
        assert_eq!(huge_page_span(64, 2 * H - 65), None);
        assert_eq!(huge_page_span(H + 1, H), None);
        assert_eq!(huge_page_span(usize::MAX - 10, 5), None);
        assert_eq!(huge_page_span(5, 0), None);
    }

    #[test]
    fn large_buffers_are_zero_and_writable() {
        let len = (HUGE_PAGE_MIN_BYTES + 12_345) / 4;
        let mut buffer = HostBuffer::zeros(DType::F32, len);
        assert_eq!(buffer.len(), len);
        assert!(buffer.as_bytes().iter().all(|&b| b == 0));
        let values = buffer.as_mut_slice::<f32>().unwrap();
        for (i, v) in values.iter_mut().enumerate() {
            *v = i as f32;
        }
        let values = buffer.as_slice::<f32>().unwrap();
        assert_eq!(values[len - 1], (len - 1) as f32);
        assert_eq!(values[len / 2], (len / 2) as f32);
    }

    /// The transparent-huge-page mode, from `[madvise]` in the sysfs file.
    #[cfg(target_os = "linux")]
    fn thp_mode() -> String {
        let text = std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/enabled")
            .unwrap_or_default();
        text.split_whitespace()
            .find_map(|w| w.strip_prefix('[').and_then(|w| w.strip_suffix(']')))
            .unwrap_or("never")
            .to_string()
    }

    /// The `AnonHugePages` of the mappings of this process that overlap `[start, start + len)`,
    /// in kB. (The advice splits the buffer's mapping at the 2 MiB boundaries, so its head and
    /// tail sit in mappings of their own.)
    #[cfg(target_os = "linux")]
    fn anon_huge_kb(start: usize, len: usize) -> u64 {
        let smaps = std::fs::read_to_string("/proc/self/smaps").expect("read /proc/self/smaps");
        let mut inside = false;
        let mut total = 0;
        for line in smaps.lines() {
            let first = line.split_whitespace().next().unwrap_or("");
            if let Some((lo, hi)) = first.split_once('-')
                && let (Ok(lo), Ok(hi)) =
                    (usize::from_str_radix(lo, 16), usize::from_str_radix(hi, 16))
            {
                inside = lo < start + len && start < hi;
                continue;
            }
            if inside && let Some(rest) = line.strip_prefix("AnonHugePages:") {
                total += rest
                    .trim()
                    .trim_end_matches("kB")
                    .trim()
                    .parse::<u64>()
                    .unwrap_or(0);
            }
        }
        total
    }

    /// A large buffer, once written, is backed by huge pages wherever the kernel offers them
    /// (THP mode `madvise` or `always`), and by none where THP is off (`never`) or our advice
    /// is turned off (`HYPERSHARD_HUGE_PAGES=0`) under `madvise`.
    #[cfg(target_os = "linux")]
    #[test]
    fn large_buffers_get_huge_pages_where_the_kernel_offers_them() {
        let mode = thp_mode();
        let mut buffer = HostBuffer::zeros(DType::U8, 16 << 20);
        buffer.as_bytes_mut().fill(7);
        let address = buffer.as_bytes().as_ptr() as usize;
        let huge = anon_huge_kb(address, buffer.byte_len());
        match (mode.as_str(), huge_pages_wanted()) {
            ("always", _) => assert!(huge > 0, "THP always, yet no huge page backs the buffer"),
            ("madvise", true) => {
                assert!(
                    huge > 0,
                    "THP madvise and advised, yet no huge page backs the buffer"
                )
            }
            // Under `madvise` only advised memory gets huge pages: none without our advice.
            ("madvise", false) | ("never", _) => assert_eq!(
                huge, 0,
                "THP {mode} without advice, yet {huge} kB of huge pages back the buffer"
            ),
            (other, _) => panic!("unknown THP mode {other:?}"),
        }
        assert!(buffer.as_bytes().iter().all(|&b| b == 7));
    }

    #[test]
    fn round_trips_every_dtype() {
        let values = [0.0, 1.0, 2.5, 100.0];
        for dtype in DType::ALL {
            let buffer = HostBuffer::from_f64(dtype, &values);
            assert_eq!(buffer.len(), 4);
            assert_eq!(buffer.byte_len(), 4 * dtype.size_bytes());
            let expected: Vec<f64> = values
                .iter()
                .map(|&v| if dtype.is_float() { v } else { v.trunc() })
                .collect();
            assert_eq!(buffer.to_f64_vec(), expected, "{dtype}");
        }
    }

    #[test]
    fn typed_access_checks_the_dtype() {
        let buffer = Buffer::from_vec(vec![1.0f32, 2.0, 3.0]);
        assert_eq!(buffer.as_slice::<f32>().unwrap(), &[1.0, 2.0, 3.0]);
        match buffer.clone().into_vec::<i32>() {
            Err(Error::ElementTypeMismatch { buffer, requested }) => {
                assert_eq!(buffer, DType::F32);
                assert_eq!(requested, DType::I32);
            }
            other => panic!("expected ElementTypeMismatch, got {other:?}"),
        }
        assert_eq!(buffer.into_vec::<f32>().unwrap(), vec![1.0, 2.0, 3.0]);
    }

    #[test]
    fn storage_is_64_byte_aligned() {
        for len in [1, 3, 17, 1000] {
            let buffer = HostBuffer::zeros(DType::F64, len);
            assert_eq!(buffer.as_bytes().as_ptr() as usize % 64, 0);
            assert_eq!(buffer.as_bytes().len(), len * 8);
        }
        assert!(HostBuffer::zeros(DType::U8, 0).is_empty());
    }

    #[test]
    fn from_bytes_rejects_partial_elements() {
        assert!(matches!(
            HostBuffer::from_bytes(DType::I32, &[1, 2, 3]),
            Err(Error::MisalignedBytes {
                dtype: DType::I32,
                bytes: 3
            })
        ));
        let ok = HostBuffer::from_bytes(DType::I32, &7i32.to_ne_bytes()).unwrap();
        assert_eq!(ok.as_slice::<i32>().unwrap(), &[7]);
    }

    #[test]
    fn shares_read_the_same_memory_and_copy_on_write() {
        let mut owner = HostBuffer::from_slice(&[1.0f32, 2.0, 3.0]);
        assert!(!owner.is_shared());
        let lent = owner.share();
        assert!(owner.is_shared() && lent.is_shared());
        assert_eq!(
            lent.as_bytes().as_ptr(),
            owner.as_bytes().as_ptr(),
            "no copy"
        );
        // The owner writes: it copies first, the lent handle keeps the old values.
        owner.as_mut_slice::<f32>().unwrap()[0] = 9.0;
        assert_ne!(lent.as_bytes().as_ptr(), owner.as_bytes().as_ptr());
        assert_eq!(owner.as_slice::<f32>().unwrap(), &[9.0, 2.0, 3.0]);
        assert_eq!(lent.as_slice::<f32>().unwrap(), &[1.0, 2.0, 3.0]);
        assert!(!owner.is_shared() && !lent.is_shared());
        assert_eq!(
            owner.as_bytes().as_ptr() as usize % 64,
            0,
            "the copy is aligned"
        );
        // An unshared buffer writes in place; a clone is a deep copy.
        let mut alone = lent;
        let before = alone.as_bytes().as_ptr();
        alone.as_mut_slice::<f32>().unwrap()[2] = 7.0;
        assert_eq!(alone.as_bytes().as_ptr(), before);
        let copy = alone.clone();
        assert!(!alone.is_shared());
        assert_ne!(copy.as_bytes().as_ptr(), alone.as_bytes().as_ptr());
        assert_eq!(copy, alone);
    }

    #[test]
    fn mutation_through_slices() {
        let mut buffer = Buffer::zeros(DType::I64, 3);
        buffer.as_mut_slice::<i64>().unwrap()[1] = 42;
        assert_eq!(buffer.into_vec::<i64>().unwrap(), vec![0, 42, 0]);
    }
}
