//! Block arithmetic and segment copies shared by the backends' algorithms: where each
//! rank's block lies in a flat buffer, and the copy every gather-like step applies to a
//! received segment.

use std::ops::Range;

use crate::dtype::DType;
use crate::error::Result;
use crate::op::block_offsets;

/// The copy applied to a received segment by gather-like steps (the reducing steps apply
/// `ReducePlan::combine` instead). Both slices have the same length by construction of the
/// callers (`Link::recv_data` hands out `dst` cut to the segment's length).
pub(crate) fn copy_segment(dst: &mut [u8], src: &[u8]) -> Result<()> {
    dst.copy_from_slice(src);
    Ok(())
}

/// Byte ranges of consecutive blocks of `counts[r]` elements of `dtype`, block `r` first
/// at the prefix sum of the counts before it.
pub(crate) fn byte_blocks(counts: &[usize], dtype: DType) -> Vec<Range<usize>> {
    let size = dtype.size_bytes();
    block_offsets(counts)
        .iter()
        .zip(counts)
        .map(|(start, len)| start * size..(start + len) * size)
        .collect()
}

/// The element range `[start, end)` of block `r` when `n` elements are cut into `size`
/// blocks of `ceil(n / size)`, the trailing ones short or empty (how all-reduce splits its
/// vector into per-rank blocks).
pub(crate) fn even_block(n: usize, size: usize, r: usize) -> (usize, usize) {
    let chunk = n.div_ceil(size.max(1));
    let start = (r * chunk).min(n);
    (start, ((r + 1) * chunk).min(n))
}

/// `(&work[send], &mut work[recv])` for two disjoint ranges of one buffer, so a step can send
/// one block while it receives into another. Callers pass blocks of distinct ranks from
/// [`byte_blocks`] (or sub-ranges of them), which never overlap.
pub(crate) fn send_and_recv_views(
    work: &mut [u8],
    send: Range<usize>,
    recv: Range<usize>,
) -> (&[u8], &mut [u8]) {
    if recv.is_empty() {
        return (&work[send], &mut []);
    }
    if send.is_empty() {
        return (&[], &mut work[recv]);
    }
    if send.end <= recv.start {
        let (low, high) = work.split_at_mut(recv.start);
        (&low[send], &mut high[..recv.len()])
    } else {
        // invariant: the ranges are disjoint (see above), so here recv lies before send.
        let (low, high) = work.split_at_mut(send.start);
        (&high[..send.len()], &mut low[recv])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn views_of_disjoint_ranges_in_either_order() {
        let mut work: Vec<u8> = (0..10).collect();
        let (send, recv) = send_and_recv_views(&mut work, 0..3, 5..9);
        assert_eq!(send, &[0, 1, 2]);
        recv.copy_from_slice(&[9, 9, 9, 9]);
        assert_eq!(work, vec![0, 1, 2, 3, 4, 9, 9, 9, 9, 9]);
        let (send, recv) = send_and_recv_views(&mut work, 6..8, 1..3);
        assert_eq!(send, &[9, 9]);
        recv.copy_from_slice(&[7, 7]);
        assert_eq!(work[..4], [0, 7, 7, 3]);
        let (send, recv) = send_and_recv_views(&mut work, 4..4, 2..5);
        assert!(send.is_empty());
        assert_eq!(recv.len(), 3);
        let (send, recv) = send_and_recv_views(&mut work, 2..5, 9..9);
        assert_eq!(send.len(), 3);
        assert!(recv.is_empty());
    }

    #[test]
    fn blocks_cover_the_buffer_in_rank_order() {
        assert_eq!(byte_blocks(&[2, 0, 3], DType::F32), vec![0..8, 8..8, 8..20]);
        // 10 elements over 4 ranks: chunks of 3, the last one short.
        let blocks: Vec<_> = (0..4).map(|r| even_block(10, 4, r)).collect();
        assert_eq!(blocks, vec![(0, 3), (3, 6), (6, 9), (9, 10)]);
        assert_eq!(even_block(2, 4, 3), (2, 2));
    }
}
