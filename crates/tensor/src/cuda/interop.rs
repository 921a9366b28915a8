//! Interop with other crates' device memory, and flat copies of ranges of tensors.
//!
//! * [`CudaTensor::into_device_bytes`] and [`CudaTensor::from_device_bytes`] move a tensor's
//!   memory out of and into a cudarc `CudaSlice<u8>` without a copy, so that another crate
//!   (the NCCL backend's `DeviceBuffer`) can run on the same allocation. Both sides are cudarc
//!   slices in the device's primary context; each slice remembers the stream it was allocated
//!   on and carries cudarc's read/write events, so work on another stream (NCCL's) waits for
//!   the tensor stream's last write before it touches the memory, and the tensor stream waits
//!   for NCCL's write before a kernel here reads it. The contexts must be the same CUDA
//!   context (checked), or those events would mean nothing.
//! * [`copy_in_ranges`] and [`copy_out_ranges`]: the flat copies of [`copy_in`](super::copy_in)
//!   and [`copy_out`](super::copy_out), but for ranges of the parts rather than whole parts.
//!   FSDP needs them: the all-gather output holds rank after rank, and each rank's block holds
//!   a contiguous range of every parameter (its dim-0 shard), so a parameter is rebuilt from
//!   one range per rank. They reuse the crate's `copy_in_bN`/`copy_out_bN` kernels: a table
//!   row is a device address, a flat offset and a length, and the address of a range is the
//!   part's address plus the range's byte offset.
//! * [`CudaTensor::copy_from_host_bytes`]: the inverse of
//!   [`CudaTensor::copy_to_host_bytes`], for staging collectives through host memory.

use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream, DevicePtr, DevicePtrMut, PushKernelArg};

use super::device::CudaDevice;
use super::error::{CudaError, CudaResult, driver};
use super::kernels::{MAX_GRID_Y, check_parts, copy_width, launch_config};
use super::tensor::{CudaTensor, sizes};
use crate::DType;

/// One range of a flat copy: `len` elements starting at element `start` of part `part`, and
/// at element `flat` of the flat buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FlatRange {
    /// The index of the part (into the `parts` slice of the copy).
    pub part: usize,
    /// The range's first element in the part.
    pub start: usize,
    /// The number of elements.
    pub len: usize,
    /// The range's first element in the flat buffer.
    pub flat: usize,
}

impl CudaTensor {
    /// Gives up the tensor's device memory as cudarc bytes, without a copy: exactly
    /// [`nbytes`](CudaTensor::nbytes) bytes, or one byte for an empty tensor (CUDA allocates
    /// no empty buffers). The slice keeps the tensor stream as its own, so it is freed there.
    pub fn into_device_bytes(self) -> CudaSlice<u8> {
        self.data
    }

    /// A tensor of `shape` and `dtype` over `bytes`, without a copy. `bytes` must hold exactly
    /// the tensor's byte length (one byte for an empty tensor), else
    /// [`CudaError::LengthMismatch`], and belong to `device`'s CUDA context, else
    /// [`CudaError::DeviceMismatch`].
    pub fn from_device_bytes(
        device: &CudaDevice,
        bytes: CudaSlice<u8>,
        shape: &[usize],
        dtype: DType,
    ) -> CudaResult<CudaTensor> {
        let op = "CudaTensor::from_device_bytes";
        let (numel, nbytes) = sizes(op, shape, dtype)?;
        let same_context = bytes.ordinal() == device.ordinal()
            && bytes.context().cu_ctx() == device.context().cu_ctx();
        if !same_context {
            return Err(CudaError::DeviceMismatch {
                op,
                lhs: device.ordinal(),
                rhs: bytes.ordinal(),
            });
        }
        if bytes.len() != nbytes.max(1) {
            return Err(CudaError::LengthMismatch {
                op,
                role: "device bytes",
                expected: nbytes.max(1),
                got: bytes.len(),
                unit: "bytes",
            });
        }
        Ok(CudaTensor {
            data: bytes,
            dtype,
            shape: shape.to_vec(),
            numel,
            device: device.clone(),
        })
    }

    /// Overwrites the elements with little-endian element bytes (exactly
    /// [`nbytes`](CudaTensor::nbytes) of them, else [`CudaError::LengthMismatch`]). The copy
    /// is ordered on the device's stream; a pageable source is staged by the driver before the
    /// call returns, so `bytes` may be reused at once.
    pub fn copy_from_host_bytes(&mut self, bytes: &[u8]) -> CudaResult<()> {
        let op = "CudaTensor::copy_from_host_bytes";
        if bytes.len() != self.nbytes() {
            return Err(CudaError::LengthMismatch {
                op,
                role: "source",
                expected: self.nbytes(),
                got: bytes.len(),
                unit: "bytes",
            });
        }
        if bytes.is_empty() {
            return Ok(());
        }
        self.device
            .stream()
            .memcpy_htod(bytes, &mut self.data)
            .map_err(driver(op, "cuMemcpyHtoDAsync"))
    }
}

/// Checks the ranges of a flat copy on the host: every part index exists, every range lies
/// inside its part and inside the flat buffer, and the written side has no overlaps (the flat
/// buffer for copy-in, each part for copy-out). Returns the longest range.
pub(crate) fn check_ranges(
    op: &'static str,
    part_lens: &[usize],
    flat_len: usize,
    ranges: &[FlatRange],
    writes_parts: bool,
) -> CudaResult<usize> {
    for (index, range) in ranges.iter().enumerate() {
        let Some(&capacity) = part_lens.get(range.part) else {
            return Err(CudaError::LengthMismatch {
                op,
                role: "range part index",
                expected: part_lens.len(),
                got: range.part,
                unit: "parts",
            });
        };
        if range
            .start
            .checked_add(range.len)
            .is_none_or(|end| end > capacity)
        {
            return Err(CudaError::OutOfBounds {
                op,
                part: index,
                offset: range.start,
                len: range.len,
                capacity,
            });
        }
    }
    let lens: Vec<usize> = ranges.iter().map(|r| r.len).collect();
    let flats: Vec<usize> = ranges.iter().map(|r| r.flat).collect();
    let longest = check_parts(op, flat_len, &lens, &flats, !writes_parts)?;
    if writes_parts {
        for (part, &capacity) in part_lens.iter().enumerate() {
            let mine: Vec<&FlatRange> = ranges.iter().filter(|r| r.part == part).collect();
            let lens: Vec<usize> = mine.iter().map(|r| r.len).collect();
            let starts: Vec<usize> = mine.iter().map(|r| r.start).collect();
            check_parts(op, capacity, &lens, &starts, true)?;
        }
    }
    Ok(longest)
}

/// The copy kernels (in, out) for `dtype`'s element size.
fn copy_kernels(op: &'static str, dtype: DType) -> CudaResult<(&'static str, &'static str)> {
    Ok(match copy_width(dtype.size_of()) {
        Some("b1") => ("copy_in_b1", "copy_out_b1"),
        Some("b2") => ("copy_in_b2", "copy_out_b2"),
        Some("b4") => ("copy_in_b4", "copy_out_b4"),
        Some("b8") => ("copy_in_b8", "copy_out_b8"),
        _ => {
            return Err(CudaError::UnsupportedDType {
                op,
                from: dtype,
                to: dtype,
            });
        }
    })
}

/// Every part must be on `flat`'s device and have its dtype.
fn check_parts_match(
    op: &'static str,
    flat: &CudaTensor,
    parts: &[(&CudaDevice, DType)],
) -> CudaResult<()> {
    for (device, dtype) in parts {
        flat.device.check_same(op, device)?;
        if *dtype != flat.dtype {
            return Err(CudaError::DTypeMismatch {
                op,
                lhs: flat.dtype,
                rhs: *dtype,
            });
        }
    }
    Ok(())
}

/// Copy-in of ranges: writes elements `[start, start + len)` of `parts[range.part]` into
/// `flat` at `range.flat`, for every range, in one kernel launch per 65 535 ranges (FSDP's
/// gradient reduce-scatter input: each rank's block holds one range of every gradient).
///
/// Parts must be on `flat`'s device with its dtype; ranges must lie inside their part and
/// inside `flat` ([`CudaError::OutOfBounds`]) and must not overlap in `flat`
/// ([`CudaError::OverlappingParts`], indices into `ranges`). Elements of `flat` outside the
/// ranges are left as they are. Empty ranges are skipped.
pub fn copy_in_ranges(
    flat: &mut CudaTensor,
    parts: &[&CudaTensor],
    ranges: &[FlatRange],
) -> CudaResult<()> {
    let op = "cuda::copy_in_ranges";
    let meta: Vec<(&CudaDevice, DType)> = parts.iter().map(|p| (&p.device, p.dtype)).collect();
    check_parts_match(op, flat, &meta)?;
    let lens: Vec<usize> = parts.iter().map(|p| p.numel).collect();
    let longest = check_ranges(op, &lens, flat.numel, ranges, false)?;
    let (name, _) = copy_kernels(op, flat.dtype)?;
    let size = flat.dtype.size_of() as u64;
    let device = flat.device.clone();
    let stream = device.stream();
    let live: Vec<&FlatRange> = ranges.iter().filter(|r| r.len > 0).collect();
    let Some(config) = launch_config(op, longest, live.len().min(MAX_GRID_Y))? else {
        return Ok(());
    };
    // The read guards make the stream wait for earlier writes to each part (on any stream,
    // through cudarc's events) and record the read after the launch.
    let mut guards = Vec::with_capacity(parts.len());
    let mut addresses = Vec::with_capacity(parts.len());
    for part in parts {
        let (address, guard) = part.data.device_ptr(stream);
        addresses.push(address);
        guards.push(guard);
    }
    let table = upload_range_table(op, stream, &addresses, &live, size)?;
    let kernels = device.kernels(op)?;
    let function = kernels.function(op, name)?;
    for first in (0..live.len()).step_by(MAX_GRID_Y) {
        let rows = (live.len() - first).min(MAX_GRID_Y);
        let mut config = config;
        config.grid_dim.1 = rows as u32;
        let first = first as u32;
        let mut launch = stream.launch_builder(function);
        launch.arg(&mut flat.data).arg(&table).arg(&first);
        // SAFETY: `copy_in_bN(T* flat, const u64* table, u32 first)` runs block row `y` over
        // table row `first + y < live.len()` (the grid has `rows` rows). Each row holds a
        // device address inside a live part (the part's base address plus `start` elements of
        // the element size N, with `start + len` within the part: check_ranges), the flat
        // offset and the length, with `flat + len <= flat.numel` and no two rows overlapping
        // in `flat` (check_ranges, disjoint). The parts are kept alive by `parts` and their
        // guards until after the launch, and `flat` is distinct from every part (`&mut` vs
        // `&`). Tested by the device test `ranges_round_trip` (crates/fsdp/tests/device_fsdp.rs)
        // and every FSDP device parity test.
        unsafe { launch.launch(config) }.map_err(driver(op, "cuLaunchKernel"))?;
    }
    drop(guards);
    Ok(())
}

/// Uploads the launch table of a ranges copy: one row of (part address + `start` elements of
/// `size` bytes, flat offset, length) per live range, the layout both copy kernels read.
fn upload_range_table(
    op: &'static str,
    stream: &Arc<CudaStream>,
    addresses: &[u64],
    live: &[&FlatRange],
    size: u64,
) -> CudaResult<CudaSlice<u64>> {
    let mut table = Vec::with_capacity(3 * live.len());
    for range in live {
        table.extend([
            addresses[range.part] + range.start as u64 * size,
            range.flat as u64,
            range.len as u64,
        ]);
    }
    stream
        .clone_htod(&table)
        .map_err(driver(op, "cuMemcpyHtoDAsync"))
}

/// Copy-out of ranges: fills elements `[start, start + len)` of `parts[range.part]` from
/// `flat` at `range.flat`, for every range, in one kernel launch per 65 535 ranges (FSDP's
/// unshard: a parameter is one range from each rank's block of the all-gather output).
///
/// Ranges must lie inside their part and inside `flat`, and must not overlap within a part
/// (they may overlap in `flat`). Elements of the parts outside the ranges are left as they are.
pub fn copy_out_ranges(
    flat: &CudaTensor,
    parts: &mut [&mut CudaTensor],
    ranges: &[FlatRange],
) -> CudaResult<()> {
    let op = "cuda::copy_out_ranges";
    let meta: Vec<(&CudaDevice, DType)> = parts.iter().map(|p| (&p.device, p.dtype)).collect();
    check_parts_match(op, flat, &meta)?;
    let lens: Vec<usize> = parts.iter().map(|p| p.numel).collect();
    let longest = check_ranges(op, &lens, flat.numel, ranges, true)?;
    let (_, name) = copy_kernels(op, flat.dtype)?;
    let size = flat.dtype.size_of() as u64;
    let device = flat.device.clone();
    let stream = device.stream();
    let live: Vec<&FlatRange> = ranges.iter().filter(|r| r.len > 0).collect();
    let Some(config) = launch_config(op, longest, live.len().min(MAX_GRID_Y))? else {
        return Ok(());
    };
    let mut guards = Vec::with_capacity(parts.len());
    let mut addresses = Vec::with_capacity(parts.len());
    for part in parts.iter_mut() {
        let (address, guard) = part.data.device_ptr_mut(stream);
        addresses.push(address);
        guards.push(guard);
    }
    let table = upload_range_table(op, stream, &addresses, &live, size)?;
    let kernels = device.kernels(op)?;
    let function = kernels.function(op, name)?;
    for first in (0..live.len()).step_by(MAX_GRID_Y) {
        let rows = (live.len() - first).min(MAX_GRID_Y);
        let mut config = config;
        config.grid_dim.1 = rows as u32;
        let first = first as u32;
        let mut launch = stream.launch_builder(function);
        launch.arg(&flat.data).arg(&table).arg(&first);
        // SAFETY: as in `copy_in_ranges` with the roles swapped: block row `y` writes table
        // row `first + y`, a range inside a live, exclusively borrowed part (`start + len`
        // within the part, and no two ranges of one part overlapping: check_ranges), from
        // `flat[offset..offset + len]`, which lies inside `flat`. The parts are distinct
        // `&mut` borrows, so no two writes alias, and none aliases `flat` (`&`). Tested by the
        // device test `ranges_round_trip` (crates/fsdp/tests/device_fsdp.rs) and every FSDP
        // device parity test.
        unsafe { launch.launch(config) }.map_err(driver(op, "cuLaunchKernel"))?;
    }
    drop(guards);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn range(part: usize, start: usize, len: usize, flat: usize) -> FlatRange {
        FlatRange {
            part,
            start,
            len,
            flat,
        }
    }

    #[test]
    fn ranges_are_checked_on_the_host() {
        let op = "t";
        // Two parts of 6 and 4 elements, a flat buffer of 12: each part in two ranges.
        let good = [
            range(0, 0, 3, 0),
            range(1, 0, 2, 3),
            range(0, 3, 3, 6),
            range(1, 2, 2, 9),
        ];
        assert_eq!(check_ranges(op, &[6, 4], 12, &good, false).unwrap(), 3);
        assert_eq!(check_ranges(op, &[6, 4], 12, &good, true).unwrap(), 3);
        // A part index that does not exist.
        assert!(matches!(
            check_ranges(op, &[6, 4], 12, &[range(2, 0, 1, 0)], false),
            Err(CudaError::LengthMismatch {
                role: "range part index",
                expected: 2,
                got: 2,
                ..
            })
        ));
        // A range past its part's end, and past the flat buffer's end.
        assert!(matches!(
            check_ranges(op, &[6, 4], 12, &[range(1, 3, 2, 0)], true),
            Err(CudaError::OutOfBounds {
                part: 0,
                offset: 3,
                len: 2,
                capacity: 4,
                ..
            })
        ));
        assert!(matches!(
            check_ranges(op, &[6, 4], 12, &[range(0, 0, 3, 10)], true),
            Err(CudaError::OutOfBounds { capacity: 12, .. })
        ));
        // Overlap in the flat buffer: an error for copy-in (two writes), allowed for copy-out.
        let shared_flat = [range(0, 0, 3, 0), range(1, 0, 2, 2)];
        assert!(matches!(
            check_ranges(op, &[6, 4], 12, &shared_flat, false),
            Err(CudaError::OverlappingParts { .. })
        ));
        assert_eq!(
            check_ranges(op, &[6, 4], 12, &shared_flat, true).unwrap(),
            3
        );
        // Overlap inside one part: an error for copy-out (two writes), allowed for copy-in.
        let shared_part = [range(0, 0, 3, 0), range(0, 2, 2, 5)];
        assert!(matches!(
            check_ranges(op, &[6, 4], 12, &shared_part, true),
            Err(CudaError::OverlappingParts { .. })
        ));
        assert_eq!(
            check_ranges(op, &[6, 4], 12, &shared_part, false).unwrap(),
            3
        );
        // Empty ranges are fine anywhere inside, and overflow is an error, not a wrap.
        assert_eq!(
            check_ranges(op, &[6], 12, &[range(0, 6, 0, 12)], true).unwrap(),
            0
        );
        assert!(check_ranges(op, &[6], 12, &[range(0, usize::MAX, 2, 0)], true).is_err());
    }

    #[test]
    fn every_range_copy_kernel_exists() {
        for dtype in DType::ALL {
            let (copy_in, copy_out) = copy_kernels("t", dtype).unwrap();
            assert!(super::super::KERNEL_NAMES.contains(&copy_in), "{copy_in}");
            assert!(super::super::KERNEL_NAMES.contains(&copy_out), "{copy_out}");
        }
    }
}
