//! Checked element ranges of host buffers: the block arithmetic every host backend moves
//! data with once phase 0 has agreed on the shapes. The ranges were validated by then, but
//! the copies stay total (a typed error, never a panic).

use crate::buffer::HostBuffer;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::op::{BufferRole, OpKind};

/// Elements `start..start + len` of `bytes`, as bytes; a typed error if out of range (phase
/// 0's validation makes that impossible, but the copy stays total).
pub(crate) fn elements(
    op: OpKind,
    bytes: &[u8],
    dtype: DType,
    start: usize,
    len: usize,
) -> Result<&[u8]> {
    let size = dtype.size_bytes();
    bytes
        .get(start * size..(start + len) * size)
        .ok_or(Error::LengthMismatch {
            op,
            role: BufferRole::Message,
            expected: start + len,
            got: bytes.len() / size,
        })
}

/// Copies whole elements into `dst` at element offset `start`, checking the range.
pub(crate) fn copy_into(op: OpKind, dst: &mut HostBuffer, start: usize, src: &[u8]) -> Result<()> {
    let size = dst.dtype().size_bytes();
    let have = dst.len();
    let begin = start * size;
    match dst.as_bytes_mut().get_mut(begin..begin + src.len()) {
        Some(target) => {
            target.copy_from_slice(src);
            Ok(())
        }
        None => Err(Error::LengthMismatch {
            op,
            role: BufferRole::Output,
            expected: start + src.len() / size,
            got: have,
        }),
    }
}

/// The block of `n` elements that rank `r` of `size` reduces in an all-reduce: chunks of
/// `ceil(n / size)`, the trailing ones short or empty.
pub(crate) fn block(n: usize, size: usize, r: usize) -> (usize, usize) {
    let chunk = n.div_ceil(size.max(1));
    let start = (r * chunk).min(n);
    (start, ((r + 1) * chunk).min(n))
}
