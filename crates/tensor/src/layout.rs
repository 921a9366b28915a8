//! Shape and stride arithmetic shared by the view and kernel code.

use crate::{Error, Result};

/// The element count of `shape`, or an error if it overflows `usize`.
pub(crate) fn checked_numel(op: &'static str, shape: &[usize]) -> Result<usize> {
    shape
        .iter()
        .try_fold(1usize, |acc, &d| acc.checked_mul(d))
        .ok_or_else(|| Error::SizeOverflow {
            op,
            shape: shape.to_vec(),
        })
}

/// Row-major (C order) strides of `shape`, in elements.
pub(crate) fn contiguous_strides(shape: &[usize]) -> Vec<usize> {
    let mut strides = vec![0; shape.len()];
    let mut acc = 1usize;
    for (stride, &size) in strides.iter_mut().zip(shape).rev() {
        *stride = acc;
        // As in torch, a size-0 dim counts as 1 so strides stay positive.
        acc = acc.saturating_mul(size.max(1));
    }
    strides
}

/// Whether `(shape, strides)` is row-major contiguous. Dims of size 1 may have any stride, and a
/// tensor with no elements is contiguous, as in torch.
pub(crate) fn is_contiguous(shape: &[usize], strides: &[usize]) -> bool {
    if shape.contains(&0) {
        return true;
    }
    let mut expected = 1usize;
    for (&size, &stride) in shape.iter().zip(strides).rev() {
        if size != 1 {
            if stride != expected {
                return false;
            }
            expected *= size;
        }
    }
    true
}

/// Whether two distinct indices of the view can reach the same storage element. Views made by
/// this crate only alias through stride-0 dims (expand), so that is what is checked.
pub(crate) fn has_internal_overlap(shape: &[usize], strides: &[usize]) -> bool {
    !shape.contains(&0)
        && shape
            .iter()
            .zip(strides)
            .any(|(&size, &stride)| size > 1 && stride == 0)
}

/// The broadcast of two shapes under numpy/torch rules (align right; sizes equal or one is 1).
pub(crate) fn broadcast_shapes(
    op: &'static str,
    lhs: &[usize],
    rhs: &[usize],
) -> Result<Vec<usize>> {
    let ndim = lhs.len().max(rhs.len());
    let mut out = vec![0; ndim];
    for (i, slot) in out.iter_mut().enumerate() {
        let a = dim_from_right(lhs, ndim - 1 - i);
        let b = dim_from_right(rhs, ndim - 1 - i);
        *slot = match (a, b) {
            (x, y) if x == y => x,
            (1, y) => y,
            (x, 1) => x,
            _ => {
                return Err(Error::NotBroadcastable {
                    op,
                    lhs: lhs.to_vec(),
                    rhs: rhs.to_vec(),
                });
            }
        };
    }
    Ok(out)
}

/// The size of the dim `k` places from the right, 1 if the shape is shorter.
fn dim_from_right(shape: &[usize], k: usize) -> usize {
    if k < shape.len() {
        shape[shape.len() - 1 - k]
    } else {
        1
    }
}

/// Strides that read `(shape, strides)` as if expanded to `target` (stride 0 on broadcast dims),
/// or `None` if `shape` does not expand to `target`.
pub(crate) fn expand_strides(
    shape: &[usize],
    strides: &[usize],
    target: &[usize],
) -> Option<Vec<usize>> {
    if target.len() < shape.len() {
        return None;
    }
    let lead = target.len() - shape.len();
    let mut out = vec![0; target.len()];
    for (i, &size) in shape.iter().enumerate() {
        let want = target[lead + i];
        if size == want {
            out[lead + i] = strides[i];
        } else if size == 1 {
            out[lead + i] = 0;
        } else {
            return None;
        }
    }
    Some(out)
}

/// Strides that present `(shape, strides)` as `new_shape` without moving data, or `None` if no
/// such strides exist (the view would need a copy). This is torch's `computeStride`: dims are
/// grouped into chunks that are contiguous with each other, and each chunk must be re-split
/// exactly by the new shape.
pub(crate) fn view_strides(
    shape: &[usize],
    strides: &[usize],
    new_shape: &[usize],
) -> Option<Vec<usize>> {
    if shape.contains(&0) {
        return Some(contiguous_strides(new_shape));
    }
    // A 0-d tensor behaves like shape [1] here.
    let (shape, strides): (&[usize], &[usize]) = if shape.is_empty() {
        (&[1], &[1])
    } else {
        (shape, strides)
    };
    let mut new_strides = vec![0usize; new_shape.len()];
    let mut view_d = new_shape.len() as isize - 1;
    let mut chunk_base_stride = *strides.last()?;
    let mut tensor_numel = 1usize;
    let mut view_numel = 1usize;
    for tensor_d in (0..shape.len()).rev() {
        tensor_numel = tensor_numel.checked_mul(shape[tensor_d])?;
        // An overflowing product cannot equal a real stride, so it ends the chunk.
        let chunk_ends = tensor_d == 0
            || (shape[tensor_d - 1] != 1
                && Some(strides[tensor_d - 1]) != tensor_numel.checked_mul(chunk_base_stride));
        if chunk_ends {
            while view_d >= 0 && (view_numel < tensor_numel || new_shape[view_d as usize] == 1) {
                new_strides[view_d as usize] = view_numel.checked_mul(chunk_base_stride)?;
                view_numel = view_numel.checked_mul(new_shape[view_d as usize])?;
                view_d -= 1;
            }
            if view_numel != tensor_numel {
                return None;
            }
            if tensor_d > 0 {
                chunk_base_stride = strides[tensor_d - 1];
                tensor_numel = 1;
                view_numel = 1;
            }
        }
    }
    if view_d != -1 {
        return None;
    }
    Some(new_strides)
}

/// The storage element index of every element of a strided view, in row-major order.
#[derive(Debug, Clone)]
pub(crate) struct StridedIndices<'a> {
    shape: &'a [usize],
    strides: &'a [usize],
    counter: Vec<usize>,
    next: usize,
    remaining: usize,
}

impl<'a> StridedIndices<'a> {
    /// Iterates `(shape, strides)` from element `offset`.
    pub(crate) fn new(shape: &'a [usize], strides: &'a [usize], offset: usize) -> Self {
        // Shapes reaching here come from tensors, whose element counts were checked.
        let remaining = shape.iter().product();
        StridedIndices {
            shape,
            strides,
            counter: vec![0; shape.len()],
            next: offset,
            remaining,
        }
    }
}

impl Iterator for StridedIndices<'_> {
    type Item = usize;

    #[inline]
    fn next(&mut self) -> Option<usize> {
        if self.remaining == 0 {
            return None;
        }
        self.remaining -= 1;
        let current = self.next;
        for d in (0..self.shape.len()).rev() {
            self.counter[d] += 1;
            self.next += self.strides[d];
            if self.counter[d] < self.shape[d] {
                break;
            }
            self.next -= self.strides[d] * self.shape[d];
            self.counter[d] = 0;
        }
        Some(current)
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        (self.remaining, Some(self.remaining))
    }
}

impl ExactSizeIterator for StridedIndices<'_> {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strides_and_contiguity() {
        assert_eq!(contiguous_strides(&[2, 3, 4]), vec![12, 4, 1]);
        assert_eq!(contiguous_strides(&[]), Vec::<usize>::new());
        assert_eq!(contiguous_strides(&[2, 0, 3]), vec![3, 3, 1]);
        assert!(!has_internal_overlap(&[2, 0], &[0, 1]));
        assert!(is_contiguous(&[2, 3], &[3, 1]));
        assert!(!is_contiguous(&[2, 3], &[1, 2]));
        assert!(is_contiguous(&[2, 1, 3], &[3, 99, 1]));
        assert!(is_contiguous(&[0, 3], &[7, 7]));
        assert!(has_internal_overlap(&[2, 3], &[0, 1]));
        assert!(!has_internal_overlap(&[1, 3], &[0, 1]));
    }

    #[test]
    fn numel_overflow_is_an_error() {
        assert_eq!(checked_numel("t", &[2, 3]).ok(), Some(6));
        assert!(matches!(
            checked_numel("t", &[usize::MAX, 2]),
            Err(Error::SizeOverflow { .. })
        ));
    }

    #[test]
    fn broadcasting_rules() {
        assert_eq!(broadcast_shapes("t", &[3, 1], &[4]).ok(), Some(vec![3, 4]));
        assert_eq!(broadcast_shapes("t", &[], &[2, 2]).ok(), Some(vec![2, 2]));
        assert_eq!(
            broadcast_shapes("t", &[0, 1], &[1, 5]).ok(),
            Some(vec![0, 5])
        );
        assert!(matches!(
            broadcast_shapes("t", &[3], &[4]),
            Err(Error::NotBroadcastable { .. })
        ));
        assert_eq!(
            expand_strides(&[3, 1], &[1, 1], &[2, 3, 4]),
            Some(vec![0, 1, 0])
        );
        assert_eq!(expand_strides(&[3], &[1], &[4]), None);
    }

    #[test]
    fn view_strides_follow_torch() {
        // Contiguous: any regrouping works.
        assert_eq!(view_strides(&[2, 6], &[6, 1], &[3, 4]), Some(vec![4, 1]));
        // Transposed [3,2] of a [2,3]: merging is impossible, splitting a dim is fine.
        assert_eq!(view_strides(&[3, 2], &[1, 3], &[6]), None);
        assert_eq!(
            view_strides(&[4, 2], &[1, 4], &[2, 2, 2]),
            Some(vec![2, 1, 4])
        );
        // Narrowed rows keep their row stride.
        assert_eq!(
            view_strides(&[2, 3], &[5, 1], &[2, 3, 1]),
            Some(vec![5, 1, 1])
        );
        assert_eq!(view_strides(&[2, 3], &[5, 1], &[6]), None);
        // Scalars and size-1 dims.
        assert_eq!(view_strides(&[], &[], &[1, 1]), Some(vec![1, 1]));
        assert_eq!(view_strides(&[1], &[1], &[]), Some(vec![]));
        // Overflowing sizes are not viewable rather than a panic.
        assert_eq!(
            view_strides(&[usize::MAX, 4], &[0, 1], &[2, usize::MAX]),
            None
        );
        // Expanded dims split into zero strides.
        assert_eq!(
            view_strides(&[4, 3], &[0, 1], &[2, 2, 3]),
            Some(vec![0, 0, 1])
        );
    }

    #[test]
    fn strided_indices_walk_row_major() {
        let idx: Vec<usize> = StridedIndices::new(&[2, 3], &[1, 2], 10).collect();
        assert_eq!(idx, vec![10, 12, 14, 11, 13, 15]);
        let scalar: Vec<usize> = StridedIndices::new(&[], &[], 4).collect();
        assert_eq!(scalar, vec![4]);
        assert_eq!(StridedIndices::new(&[3, 0], &[1, 1], 0).count(), 0);
        let expanded: Vec<usize> = StridedIndices::new(&[2, 2], &[0, 1], 0).collect();
        assert_eq!(expanded, vec![0, 1, 0, 1]);
    }
}
