//! Rectangular blocks of a global tensor: where a rank's shard sits (offset + shape), and the
//! copy of the overlap of two blocks, which is all that resharding needs.

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

/// A box `offset .. offset + shape` inside a global tensor, in elements per dimension.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Block {
    /// The block's first index in each dimension.
    pub offset: Vec<usize>,
    /// The block's extent in each dimension.
    pub shape: Vec<usize>,
}

impl Block {
    /// The whole of a tensor of `shape`.
    pub fn whole(shape: &[usize]) -> Block {
        Block {
            offset: vec![0; shape.len()],
            shape: shape.to_vec(),
        }
    }

    /// Elements in the block (saturating at `usize::MAX` for shapes no memory could hold;
    /// [`Block::checked_volume`] tells those apart).
    pub fn volume(&self) -> usize {
        self.checked_volume().unwrap_or(usize::MAX)
    }

    /// Elements in the block, or `None` when the count overflows `usize` (a hostile or
    /// corrupt shape).
    pub fn checked_volume(&self) -> Option<usize> {
        self.shape.iter().try_fold(1usize, |n, &d| n.checked_mul(d))
    }

    /// Checks the block lies inside a tensor of `global_shape` (same rank, in bounds).
    pub fn check_inside(&self, name: &str, global_shape: &[usize]) -> Result<()> {
        let fits = self.offset.len() == global_shape.len()
            && self.shape.len() == global_shape.len()
            && self
                .offset
                .iter()
                .zip(&self.shape)
                .zip(global_shape)
                .all(|((o, s), g)| o.checked_add(*s).is_some_and(|end| end <= *g));
        if fits {
            Ok(())
        } else {
            Err(Error::BlockOutOfBounds {
                name: name.to_string(),
                offset: self.offset.clone(),
                shape: self.shape.clone(),
                global_shape: global_shape.to_vec(),
            })
        }
    }

    /// The overlap of two blocks of the same tensor, if it is not empty.
    pub fn intersect(&self, other: &Block) -> Option<Block> {
        let mut offset = Vec::with_capacity(self.offset.len());
        let mut shape = Vec::with_capacity(self.offset.len());
        for d in 0..self.offset.len() {
            let lo = self.offset[d].max(other.offset[d]);
            let hi = (self.offset[d] + self.shape[d]).min(other.offset[d] + other.shape[d]);
            if hi <= lo {
                return None;
            }
            offset.push(lo);
            shape.push(hi - lo);
        }
        Some(Block { offset, shape })
    }
}

/// Row-major element strides of a block of `shape`.
fn strides(shape: &[usize]) -> Vec<usize> {
    let mut strides = vec![1; shape.len()];
    for d in (0..shape.len().saturating_sub(1)).rev() {
        strides[d] = strides[d + 1] * shape[d + 1];
    }
    strides
}

/// Copies the overlap of `src_block` (row-major bytes `src`) into `dst_block` (row-major bytes
/// `dst`), `element_size` bytes per element. Both blocks are of the same global tensor, and
/// the byte lengths must equal their volumes × `element_size` (checked by the callers).
/// Returns the number of elements copied.
pub fn copy_overlap(
    src_block: &Block,
    src: &[u8],
    dst_block: &Block,
    dst: &mut [u8],
    element_size: usize,
) -> usize {
    let Some(overlap) = src_block.intersect(dst_block) else {
        return 0;
    };
    let ndim = overlap.shape.len();
    if ndim == 0 {
        // Scalars: both blocks are the one element.
        dst[..element_size].copy_from_slice(&src[..element_size]);
        return 1;
    }
    let src_strides = strides(&src_block.shape);
    let dst_strides = strides(&dst_block.shape);
    let run = overlap.shape[ndim - 1] * element_size;
    // Walk every index of the overlap except the last dimension, copying one contiguous run
    // per position; `index` counts in overlap-local coordinates.
    let outer: usize = overlap.shape[..ndim - 1].iter().product();
    let mut index = vec![0usize; ndim - 1];
    for _ in 0..outer {
        let mut src_at = 0;
        let mut dst_at = 0;
        for d in 0..ndim {
            let global = overlap.offset[d] + if d < ndim - 1 { index[d] } else { 0 };
            src_at += (global - src_block.offset[d]) * src_strides[d];
            dst_at += (global - dst_block.offset[d]) * dst_strides[d];
        }
        let (s, t) = (src_at * element_size, dst_at * element_size);
        dst[t..t + run].copy_from_slice(&src[s..s + run]);
        for d in (0..ndim - 1).rev() {
            index[d] += 1;
            if index[d] < overlap.shape[d] {
                break;
            }
            index[d] = 0;
        }
    }
    overlap.volume()
}

/// Checks that `blocks` are pairwise disjoint and together cover a tensor of `global_shape`
/// exactly once, so that any requested block can be assembled from them.
pub fn check_exact_cover(name: &str, global_shape: &[usize], blocks: &[Block]) -> Result<()> {
    for block in blocks {
        block.check_inside(name, global_shape)?;
    }
    // Shapes come from metadata.json, so their products are checked: an overflowing one is
    // a coverage error, not a panic.
    let numel = Block::whole(global_shape).checked_volume();
    let covered = blocks.iter().try_fold(0usize, |sum, b| {
        b.checked_volume().and_then(|v| sum.checked_add(v))
    });
    let (Some(numel), Some(covered)) = (numel, covered) else {
        return Err(Error::BlockCoverage {
            name: name.to_string(),
            covered: 0,
            numel: usize::MAX,
        });
    };
    let overlapping = blocks.iter().enumerate().any(|(i, a)| {
        blocks[i + 1..]
            .iter()
            .any(|b| a.intersect(b).is_some_and(|o| o.volume() > 0))
    });
    if covered != numel || overlapping {
        return Err(Error::BlockCoverage {
            name: name.to_string(),
            covered: if overlapping { 0 } else { covered },
            numel,
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn block(offset: &[usize], shape: &[usize]) -> Block {
        Block {
            offset: offset.to_vec(),
            shape: shape.to_vec(),
        }
    }

    /// Row-major f32 bytes of the global tensor value f(i, j) = 10·i + j over a block.
    fn values(b: &Block) -> Vec<u8> {
        let mut out = Vec::new();
        for i in 0..b.shape[0] {
            for j in 0..b.shape[1] {
                let v = (10 * (b.offset[0] + i) + b.offset[1] + j) as f32;
                out.extend_from_slice(&v.to_le_bytes());
            }
        }
        out
    }

    #[test]
    fn a_block_is_assembled_from_the_blocks_it_overlaps() {
        // A 4×6 tensor saved as a 2×2 grid of 2×3 blocks; read back rows 1..3, cols 2..6.
        let saved: Vec<Block> = [(0, 0), (0, 3), (2, 0), (2, 3)]
            .iter()
            .map(|&(r, c)| block(&[r, c], &[2, 3]))
            .collect();
        check_exact_cover("t", &[4, 6], &saved).unwrap();
        let want = block(&[1, 2], &[2, 4]);
        let mut out = vec![0u8; want.volume() * 4];
        let copied: usize = saved
            .iter()
            .map(|b| copy_overlap(b, &values(b), &want, &mut out, 4))
            .sum();
        assert_eq!(copied, 8);
        assert_eq!(out, values(&want));
    }

    #[test]
    fn gaps_overlaps_and_out_of_bounds_are_rejected() {
        let halves = [block(&[0, 0], &[2, 6]), block(&[2, 0], &[2, 6])];
        check_exact_cover("t", &[4, 6], &halves).unwrap();
        assert!(matches!(
            check_exact_cover("t", &[4, 6], &halves[..1]),
            Err(Error::BlockCoverage {
                covered: 12,
                numel: 24,
                ..
            })
        ));
        let overlapping = [
            block(&[0, 0], &[3, 6]),
            block(&[2, 0], &[1, 6]),
            block(&[3, 0], &[1, 0]),
        ];
        assert!(matches!(
            check_exact_cover("t", &[4, 6], &overlapping),
            Err(Error::BlockCoverage { .. })
        ));
        assert!(matches!(
            block(&[3, 0], &[2, 6]).check_inside("t", &[4, 6]),
            Err(Error::BlockOutOfBounds { .. })
        ));
    }

    #[test]
    fn scalars_and_vectors_copy() {
        let mut out = vec![0u8; 4];
        assert_eq!(
            copy_overlap(
                &Block::whole(&[]),
                &7f32.to_le_bytes(),
                &Block::whole(&[]),
                &mut out,
                4
            ),
            1
        );
        assert_eq!(out, 7f32.to_le_bytes());
        let src: Vec<u8> = (0u8..8).collect();
        let mut dst = vec![0u8; 4];
        copy_overlap(&block(&[4], &[8]), &src, &block(&[6], &[4]), &mut dst, 1);
        assert_eq!(dst, vec![2, 3, 4, 5]);
    }
}
