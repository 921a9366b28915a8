//! How our dtypes, reduce ops and lengths become MPI datatypes, MPI ops and C `int`s.
//!
//! Data that only moves (gathers, broadcasts, all-to-all, point-to-point) travels as unsigned
//! integers of the element's width, so bf16 and f16 need no MPI type of their own. Reductions
//! use MPI's predefined ops on the element type; bf16 and f16 are *staged* through f32: each
//! rank widens its contribution to f32, MPI reduces in f32, and the result is rounded back once
//! (more accurate than rounding after every partial sum, and no user-defined MPI op is needed).

use std::ffi::c_int;

use half::slice::HalfFloatSliceExt;
use half::{bf16, f16};
use mpi::collective::SystemOperation;
use mpi::datatype::Equivalence;
use mpi::ffi;
use mpi::raw::AsRaw;

use crate::buffer::HostBuffer;
use crate::dtype::DType;
use crate::error::{Error, MpiQuantity, Result};
use crate::op::OpKind;
use crate::reduce::Combine;

/// The MPI datatype data of `dtype` moves as (an unsigned integer of the same width).
pub(crate) fn movement_type(dtype: DType) -> ffi::MPI_Datatype {
    match dtype.size_bytes() {
        1 => u8::equivalent_datatype().as_raw(),
        2 => u16::equivalent_datatype().as_raw(),
        4 => u32::equivalent_datatype().as_raw(),
        _ => u64::equivalent_datatype().as_raw(),
    }
}

/// The dtype MPI reduces `dtype` in: itself, or f32 for bf16 and f16.
pub(crate) fn staging_dtype(dtype: DType) -> DType {
    match dtype {
        DType::BF16 | DType::F16 => DType::F32,
        other => other,
    }
}

/// The MPI datatype of a reduction over `staged` (a dtype [`staging_dtype`] returns).
pub(crate) fn reduce_type(staged: DType) -> ffi::MPI_Datatype {
    match staged {
        DType::F64 => f64::equivalent_datatype().as_raw(),
        DType::I32 => i32::equivalent_datatype().as_raw(),
        DType::I64 => i64::equivalent_datatype().as_raw(),
        DType::U8 => u8::equivalent_datatype().as_raw(),
        // F32, and bf16/f16 once staged.
        _ => f32::equivalent_datatype().as_raw(),
    }
}

/// MPI's predefined op for a combine step (`Avg` and `PreMulSum` are sums with a scaling
/// before or after, done by [`ReducePlan`](crate::reduce::ReducePlan)).
pub(crate) fn mpi_op(combine: Combine) -> ffi::MPI_Op {
    match combine {
        Combine::Sum => SystemOperation::sum().as_raw(),
        Combine::Max => SystemOperation::max().as_raw(),
        Combine::Min => SystemOperation::min().as_raw(),
        Combine::Product => SystemOperation::product().as_raw(),
    }
}

/// `value` as the C `int` MPI takes, or [`Error::MpiLimit`].
pub(crate) fn to_int(op: OpKind, quantity: MpiQuantity, value: usize) -> Result<c_int> {
    c_int::try_from(value).map_err(|_| Error::MpiLimit {
        op,
        quantity,
        value: value as u64,
        limit: c_int::MAX as u64,
    })
}

/// Counts and their displacements (prefix sums) as C `int`s.
pub(crate) struct IntBlocks {
    pub(crate) counts: Vec<c_int>,
    pub(crate) displs: Vec<c_int>,
}

/// [`IntBlocks`] of `counts`, checking that every count and offset fits a C `int`.
pub(crate) fn int_blocks(op: OpKind, counts: &[usize]) -> Result<IntBlocks> {
    let mut blocks = IntBlocks {
        counts: Vec::with_capacity(counts.len()),
        displs: Vec::with_capacity(counts.len()),
    };
    let mut offset = 0usize;
    for &count in counts {
        blocks.counts.push(to_int(op, MpiQuantity::Count, count)?);
        blocks
            .displs
            .push(to_int(op, MpiQuantity::Displacement, offset)?);
        offset = offset.saturating_add(count);
    }
    // The end of the last block must be addressable too.
    to_int(op, MpiQuantity::Displacement, offset)?;
    Ok(blocks)
}

/// A copy of `host` in its staging dtype (bf16/f16 widened to f32; others copied as they are).
pub(crate) fn stage(host: &HostBuffer) -> Result<HostBuffer> {
    match host.dtype() {
        DType::BF16 => {
            let values: &[bf16] = host.as_slice()?;
            let mut wide = vec![0f32; values.len()];
            values.convert_to_f32_slice(&mut wide);
            Ok(HostBuffer::from_vec(wide))
        }
        DType::F16 => {
            let values: &[f16] = host.as_slice()?;
            let mut wide = vec![0f32; values.len()];
            values.convert_to_f32_slice(&mut wide);
            Ok(HostBuffer::from_vec(wide))
        }
        dtype => HostBuffer::from_bytes(dtype, host.as_bytes()),
    }
}

/// A zeroed buffer of `len` elements in the staging dtype of `dtype`.
pub(crate) fn staged_zeros(dtype: DType, len: usize) -> HostBuffer {
    HostBuffer::zeros(staging_dtype(dtype), len)
}

/// Writes the staged result `staged` into `out` (rounding f32 back to bf16/f16 once).
pub(crate) fn unstage(staged: &HostBuffer, out: &mut HostBuffer) -> Result<()> {
    match out.dtype() {
        DType::BF16 => {
            let wide: &[f32] = staged.as_slice()?;
            let narrow: &mut [bf16] = out.as_mut_slice()?;
            check_same_len(wide.len(), narrow.len())?;
            narrow.convert_from_f32_slice(wide);
        }
        DType::F16 => {
            let wide: &[f32] = staged.as_slice()?;
            let narrow: &mut [f16] = out.as_mut_slice()?;
            check_same_len(wide.len(), narrow.len())?;
            narrow.convert_from_f32_slice(wide);
        }
        _ => {
            check_same_len(staged.byte_len(), out.byte_len())?;
            out.as_bytes_mut().copy_from_slice(staged.as_bytes());
        }
    }
    Ok(())
}

fn check_same_len(got: usize, expected: usize) -> Result<()> {
    if got == expected {
        Ok(())
    } else {
        Err(Error::LengthMismatch {
            op: OpKind::AllReduce,
            role: crate::op::BufferRole::Output,
            expected,
            got,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn half_floats_round_trip_through_f32_staging() {
        let values: Vec<bf16> = [1.5f32, -2.0, 3.25, 0.0]
            .iter()
            .map(|&v| bf16::from_f32(v))
            .collect();
        let host = HostBuffer::from_slice(&values);
        let staged = stage(&host).unwrap();
        assert_eq!(staged.dtype(), DType::F32);
        assert_eq!(staged.as_slice::<f32>().unwrap(), &[1.5, -2.0, 3.25, 0.0]);
        let mut back = HostBuffer::zeros(DType::BF16, 4);
        unstage(&staged, &mut back).unwrap();
        assert_eq!(back, host);
        let halves = HostBuffer::from_slice(&[f16::from_f32(0.5), f16::from_f32(7.0)]);
        let mut back = HostBuffer::zeros(DType::F16, 2);
        unstage(&stage(&halves).unwrap(), &mut back).unwrap();
        assert_eq!(back, halves);
    }

    #[test]
    fn counts_past_c_int_are_typed_errors() {
        let blocks = int_blocks(OpKind::AllGatherV, &[2, 0, 3]).unwrap();
        assert_eq!(blocks.counts, vec![2, 0, 3]);
        assert_eq!(blocks.displs, vec![0, 2, 2]);
        let big = c_int::MAX as usize;
        assert!(matches!(
            int_blocks(OpKind::AllGatherV, &[big, 1]),
            Err(Error::MpiLimit {
                quantity: MpiQuantity::Displacement,
                ..
            })
        ));
        assert!(matches!(
            to_int(OpKind::AllReduce, MpiQuantity::Count, big + 1),
            Err(Error::MpiLimit {
                quantity: MpiQuantity::Count,
                ..
            })
        ));
    }
}
