//! Non-temporal stores for large destinations that nobody reads again soon (a posted
//! all-gather block, a reduce-scatter's output). A normal store to a line that is not in the
//! cache first reads that line from DRAM (read-for-ownership), so writing into a cold 32 MiB
//! block costs a read and a write of DRAM per line; streaming stores skip the read.
//!
//! * [`stream_copy`] copies out of the ring. Measured on the 2-core dev VM: a 32 MiB block
//!   filled from a cache-hot 4 MiB ring in 1 MiB pieces took 3.0–3.2 ms with
//!   `copy_from_slice` and 1.7–1.9 ms streamed.
//! * [`stream_combine_from`] computes `dst = own ⊕ incoming` (a reduction out of place) one
//!   L1-sized tile at a time with the plan's own kernel, then streams the tile out. Of the
//!   four DRAM streams of a world-2 reduce-scatter's receive side (its own block read, the
//!   output's read-for-ownership and write, the ring being in cache) it removes one.

use crate::error::Result;
use crate::reduce::ReducePlan;

/// Posted destinations at least this large are filled with streaming stores: a quarter of
/// the dev VM's 32 MiB L3, beyond which a block is unlikely to still be cached when it is
/// read. Smaller ones may be read from cache soon, where normal stores are better.
pub(crate) const STREAM_MIN_DESTINATION: usize = 8 << 20;

/// The tile [`stream_combine_from`] combines into before streaming it out: a quarter of the
/// 32 KiB L1 data cache, so the tile, and the pieces of `own` and `incoming` it is made
/// from, stay in L1 between the combine and the streaming copy. A multiple of every element
/// size, so tiles hold whole elements.
const COMBINE_TILE: usize = 8 << 10;

/// A [`COMBINE_TILE`] on a cache-line boundary: the combine kernel views it as elements of
/// any dtype (an unaligned view would be copied), and its lines map one to one onto the
/// streaming stores.
#[repr(C, align(64))]
struct Tile([u8; COMBINE_TILE]);

/// Copies `src` into `dst` (equal lengths; a length mismatch copies the shorter prefix)
/// bypassing the caches where the CPU can (x86-64), and with `copy_from_slice` elsewhere.
/// The stores are fenced before returning, so they are ordered before anything this thread
/// does next (such as publishing that the bytes are there).
pub(crate) fn stream_copy(dst: &mut [u8], src: &[u8]) {
    stream_copy_unfenced(dst, src);
    store_fence();
}

/// Orders every streaming store of this thread before its later stores.
fn store_fence() {
    // SAFETY: SSE2 (and with it `sfence`) is part of the x86-64 baseline; the fence has no
    // operands.
    #[cfg(target_arch = "x86_64")]
    unsafe {
        std::arch::x86_64::_mm_sfence();
    }
}

/// [`stream_copy`] without the closing fence: the caller fences once after a run of copies.
fn stream_copy_unfenced(dst: &mut [u8], src: &[u8]) {
    let len = dst.len().min(src.len());
    let (dst, src) = (&mut dst[..len], &src[..len]);
    #[cfg(target_arch = "x86_64")]
    {
        // The first bytes up to a 16-byte boundary of `dst` go the normal way.
        let head = (dst.as_ptr() as usize).wrapping_neg() % 16;
        let head = head.min(len);
        dst[..head].copy_from_slice(&src[..head]);
        let body = (len - head) / 64 * 64;
        // SAFETY: SSE2 is part of the x86-64 baseline. Every load reads 16 bytes inside
        // `src[head..head + body]` (unaligned loads are allowed) and every store writes 16
        // bytes inside `dst[head..head + body]`, whose start is 16-byte aligned as
        // `_mm_stream_si128` requires; both slices are borrowed for the whole block. The
        // weakly-ordered streaming stores are fenced by the caller (`store_fence`).
        unsafe {
            use std::arch::x86_64::{__m128i, _mm_loadu_si128, _mm_stream_si128};
            let from = src.as_ptr().add(head).cast::<__m128i>();
            let to = dst.as_mut_ptr().add(head).cast::<__m128i>();
            for line in 0..body / 64 {
                let at = line * 4;
                let a = _mm_loadu_si128(from.add(at));
                let b = _mm_loadu_si128(from.add(at + 1));
                let c = _mm_loadu_si128(from.add(at + 2));
                let d = _mm_loadu_si128(from.add(at + 3));
                _mm_stream_si128(to.add(at), a);
                _mm_stream_si128(to.add(at + 1), b);
                _mm_stream_si128(to.add(at + 2), c);
                _mm_stream_si128(to.add(at + 3), d);
            }
        }
        let done = head + body;
        dst[done..].copy_from_slice(&src[done..]);
    }
    #[cfg(not(target_arch = "x86_64"))]
    dst.copy_from_slice(src);
}

/// `dst = own ⊕ incoming` with `plan`'s combine step, like [`ReducePlan::combine_from`]
/// (same checks, same typed errors, bit-identical results), but with `dst` written by
/// streaming stores: each tile of [`COMBINE_TILE`] bytes is combined into an L1 buffer and
/// then streamed out. The stores are fenced before returning.
pub(crate) fn stream_combine_from(
    plan: &ReducePlan,
    dst: &mut [u8],
    own: &[u8],
    incoming: &[u8],
) -> Result<()> {
    if dst.len() != own.len() || dst.len() != incoming.len() {
        // The plan names the mismatch (and which operand) as its typed error.
        return plan.combine_from(dst, own, incoming);
    }
    let mut tile = Tile([0; COMBINE_TILE]);
    let pieces = dst
        .chunks_mut(COMBINE_TILE)
        .zip(own.chunks(COMBINE_TILE).zip(incoming.chunks(COMBINE_TILE)));
    let mut outcome = Ok(());
    for (dst, (own, incoming)) in pieces {
        let staged = &mut tile.0[..dst.len()];
        outcome = plan.combine_from(staged, own, incoming);
        if outcome.is_err() {
            break;
        }
        stream_copy_unfenced(dst, staged);
    }
    store_fence();
    outcome
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dtype::DType;
    use crate::op::ReduceOp;

    #[test]
    fn streamed_bytes_equal_the_source_at_every_alignment_and_length() {
        let source: Vec<u8> = (0..5000u32)
            .map(|i| (i.wrapping_mul(2_654_435_761) >> 11) as u8)
            .collect();
        let mut target = vec![0u8; 5100];
        for offset in [0usize, 1, 7, 15, 16, 33] {
            for len in [0usize, 1, 15, 16, 63, 64, 65, 1000, 4097] {
                target.fill(0xee);
                stream_copy(&mut target[offset..offset + len], &source[3..3 + len]);
                assert_eq!(
                    &target[offset..offset + len],
                    &source[3..3 + len],
                    "offset {offset} len {len}"
                );
                // Nothing outside the destination is touched.
                assert!(target[..offset].iter().all(|&b| b == 0xee));
                assert!(target[offset + len..].iter().all(|&b| b == 0xee));
            }
        }
    }

    /// `count` elements of `dtype` as bytes, each a hash of its index and `seed` (so two
    /// seeds give different operands) reduced to 0..32: small integers, which every dtype
    /// holds exactly.
    fn operand(dtype: DType, count: usize, seed: u32) -> Vec<u8> {
        let values =
            (0..count as u32).map(|i| i.wrapping_add(seed).wrapping_mul(2_654_435_761) >> 27);
        match dtype {
            DType::F32 => values.flat_map(|v| (v as f32).to_le_bytes()).collect(),
            DType::F64 => values.flat_map(|v| f64::from(v).to_le_bytes()).collect(),
            DType::I32 => values.flat_map(|v| (v as i32 - 9).to_le_bytes()).collect(),
            DType::I64 => values
                .flat_map(|v| (i64::from(v) - 9).to_le_bytes())
                .collect(),
            DType::U8 => values.map(|v| v as u8).collect(),
            DType::BF16 => values
                .flat_map(|v| half::bf16::from_f32(v as f32).to_le_bytes())
                .collect(),
            DType::F16 => values
                .flat_map(|v| half::f16::from_f32(v as f32).to_le_bytes())
                .collect(),
        }
    }

    #[test]
    fn a_streamed_combine_matches_the_plain_one_for_every_dtype_op_offset_and_length() {
        let dtypes = [
            DType::F32,
            DType::F64,
            DType::I32,
            DType::I64,
            DType::U8,
            DType::BF16,
            DType::F16,
        ];
        let ops = [
            ReduceOp::Sum,
            ReduceOp::Max,
            ReduceOp::Min,
            ReduceOp::Product,
        ];
        for dtype in dtypes {
            let size = dtype.size_bytes();
            for op in ops {
                let plan = ReducePlan::new(op, dtype, 3).unwrap();
                // Lengths below, at and across tile and line boundaries.
                for count in [
                    0usize,
                    1,
                    3,
                    17,
                    COMBINE_TILE / size,
                    3 * COMBINE_TILE / size + 5,
                ] {
                    let own = operand(dtype, count, 0x5eed);
                    let incoming = operand(dtype, count, 0xbeef);
                    let mut expected = vec![0u8; count * size];
                    plan.combine_from(&mut expected, &own, &incoming).unwrap();
                    // Offsets in whole elements, so `dst` starts on and off a 16-byte line.
                    for offset in [0usize, 1, 3] {
                        let at = offset * size;
                        let mut target = vec![0xeeu8; count * size + 2 * at + 64];
                        stream_combine_from(
                            &plan,
                            &mut target[at..at + count * size],
                            &own,
                            &incoming,
                        )
                        .unwrap();
                        assert_eq!(
                            &target[at..at + count * size],
                            &expected[..],
                            "{dtype:?} {op:?} count {count} offset {offset}"
                        );
                        // Nothing outside the destination is touched.
                        assert!(target[..at].iter().all(|&b| b == 0xee));
                        assert!(target[at + count * size..].iter().all(|&b| b == 0xee));
                    }
                }
            }
        }
    }

    #[test]
    fn a_streamed_combine_of_unequal_lengths_is_the_plans_length_error() {
        let plan = ReducePlan::new(ReduceOp::Sum, DType::F32, 2).unwrap();
        let mut dst = vec![0u8; 16];
        let own = vec![0u8; 16];
        let incoming = vec![0u8; 12];
        let streamed = stream_combine_from(&plan, &mut dst, &own, &incoming).unwrap_err();
        let plain = plan.combine_from(&mut dst, &own, &incoming).unwrap_err();
        assert_eq!(format!("{streamed:?}"), format!("{plain:?}"));
        assert!(matches!(
            streamed,
            crate::error::Error::LengthMismatch { .. }
        ));
    }
}
