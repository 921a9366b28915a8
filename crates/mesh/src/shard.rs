//! Shard math with `torch.chunk` semantics, in one dimension and for n-d placements.

use crate::error::{MeshError, Result};
use crate::mesh::DeviceMesh;
use crate::placement::Placement;

/// The part of a length-`n` dimension that one shard holds.
///
/// With `chunk = ceil(n / shards)`, shard `k` holds `[min(k·chunk, n), min((k+1)·chunk, n))`:
/// every shard but the trailing ones holds `chunk` elements, and trailing shards may be short
/// or empty. Collectives pad every shard to `padded_len == chunk`, so a gather or scatter over
/// the group moves `chunk · shards` elements and each rank unpads its own `len`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ShardSpan {
    /// The index of the shard's first element in the unsharded dimension.
    pub offset: usize,
    /// How many elements the shard holds (`<= padded_len`, possibly 0).
    pub len: usize,
    /// The length every shard is padded to for collectives: the chunk size `ceil(n / shards)`.
    pub padded_len: usize,
}

/// The chunk size `ceil(len / shards)`: the length of every full shard.
///
/// ```
/// assert_eq!(hypershard_mesh::chunk_size(10, 4)?, 3);
/// assert_eq!(hypershard_mesh::chunk_size(0, 4)?, 0);
/// # Ok::<(), hypershard_mesh::MeshError>(())
/// ```
pub fn chunk_size(len: usize, shards: usize) -> Result<usize> {
    if shards == 0 {
        return Err(MeshError::ZeroShards);
    }
    Ok(len.div_ceil(shards))
}

/// The total length collectives move when every shard is padded to the chunk size:
/// `chunk_size(len, shards) * shards`.
///
/// ```
/// assert_eq!(hypershard_mesh::padded_len(10, 4)?, 12);
/// assert_eq!(hypershard_mesh::padded_len(8, 4)?, 8);
/// # Ok::<(), hypershard_mesh::MeshError>(())
/// ```
pub fn padded_len(len: usize, shards: usize) -> Result<usize> {
    chunk_size(len, shards)?
        .checked_mul(shards)
        .ok_or(MeshError::PaddedLenOverflow { len, shards })
}

/// The span of shard `index` when a dimension of length `len` is split into `shards` shards.
///
/// ```
/// use hypershard_mesh::{shard_span, ShardSpan};
///
/// // 10 rows on 4 ranks: 3, 3, 3, 1.
/// assert_eq!(shard_span(10, 4, 3)?, ShardSpan { offset: 9, len: 1, padded_len: 3 });
/// // 5 rows on 4 ranks: 2, 2, 1, 0; the empty shard sits at the end.
/// assert_eq!(shard_span(5, 4, 3)?, ShardSpan { offset: 5, len: 0, padded_len: 2 });
/// # Ok::<(), hypershard_mesh::MeshError>(())
/// ```
pub fn shard_span(len: usize, shards: usize, index: usize) -> Result<ShardSpan> {
    let chunk = chunk_size(len, shards)?;
    if index >= shards {
        return Err(MeshError::ShardIndexOutOfRange { index, shards });
    }
    // Saturating keeps the clamp correct where index * chunk would pass usize::MAX: such a
    // start is past `len` anyway.
    let start = index.saturating_mul(chunk).min(len);
    let end = index.saturating_add(1).saturating_mul(chunk).min(len);
    Ok(ShardSpan {
        offset: start,
        len: end - start,
        padded_len: chunk,
    })
}

/// The block of a global tensor that one rank holds: its local shape and the global index of
/// its first element.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct LocalBlock {
    /// The local shape, one entry per tensor dimension.
    pub shape: Vec<usize>,
    /// The global index of the block's first element, one entry per tensor dimension.
    pub offset: Vec<usize>,
}

/// The local block that `rank` holds of a tensor of `global_shape` laid out on `mesh` with one
/// placement per mesh dimension.
///
/// `Replicate` and `Partial` keep the full extent; `Shard(d)` splits tensor dimension `d` over
/// the mesh dimension with [`shard_span`]. When several mesh dimensions shard the same tensor
/// dimension, they nest in mesh-dimension order: the first splits the full length, the next
/// splits that chunk further (DTensor's default order).
///
/// ```
/// use hypershard_mesh::{local_block, DeviceMesh, LocalBlock, Placement};
///
/// // 10 rows sharded over a 2 x 2 mesh on both dims: 10 -> 5 | 5 -> 3, 2 | 3, 2.
/// let mesh = DeviceMesh::new(&[2, 2], &[])?;
/// let placements = [Placement::Shard(0), Placement::Shard(0)];
/// let block = local_block(&[10, 4], &mesh, &placements, 3)?;
/// assert_eq!(block, LocalBlock { shape: vec![2, 4], offset: vec![8, 0] });
/// # Ok::<(), hypershard_mesh::MeshError>(())
/// ```
pub fn local_block(
    global_shape: &[usize],
    mesh: &DeviceMesh,
    placements: &[Placement],
    rank: usize,
) -> Result<LocalBlock> {
    if placements.len() != mesh.ndim() {
        return Err(MeshError::PlacementCountMismatch {
            placements: placements.len(),
            mesh_ndim: mesh.ndim(),
        });
    }
    // Check every placement before the rank, so a bad layout is reported the same on every rank.
    for (mesh_dim, placement) in placements.iter().enumerate() {
        if let Some(shard_dim) = placement.shard_dim()
            && shard_dim >= global_shape.len()
        {
            return Err(MeshError::ShardDimOutOfRange {
                mesh_dim,
                shard_dim,
                tensor_ndim: global_shape.len(),
            });
        }
    }
    let coordinate = mesh.coordinate_of(rank)?;
    let mut shape = global_shape.to_vec();
    let mut offset = vec![0; global_shape.len()];
    for ((placement, &index), &shards) in placements.iter().zip(&coordinate).zip(mesh.shape()) {
        if let Some(dim) = placement.shard_dim() {
            let span = shard_span(shape[dim], shards, index)?;
            offset[dim] += span.offset;
            shape[dim] = span.len;
        }
    }
    Ok(LocalBlock { shape, offset })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::placement::ReduceOp;

    fn lens(len: usize, shards: usize) -> Vec<usize> {
        (0..shards)
            .map(|index| shard_span(len, shards, index).map(|span| span.len))
            .collect::<Result<_>>()
            .expect("index < shards") // invariant: index ranges over 0..shards.
    }

    #[test]
    fn chunk_sizes_follow_torch_chunk() {
        assert_eq!(lens(10, 4), [3, 3, 3, 1]);
        assert_eq!(lens(5, 4), [2, 2, 1, 0]);
        assert_eq!(lens(6, 4), [2, 2, 2, 0]);
        assert_eq!(lens(8, 4), [2, 2, 2, 2]);
        assert_eq!(lens(1, 3), [1, 0, 0]);
        assert_eq!(lens(0, 3), [0, 0, 0]);
        assert_eq!(lens(7, 1), [7]);
        // Flat sharding over 6 ranks differs from the nested 2 x 3 layout (docs/placements.md).
        assert_eq!(lens(10, 6), [2, 2, 2, 2, 2, 0]);
    }

    #[test]
    fn spans_are_contiguous_and_padded_to_the_chunk() {
        let spans: Vec<ShardSpan> = (0..4)
            .map(|index| shard_span(5, 4, index))
            .collect::<Result<_>>()
            .expect("index < shards"); // invariant: index ranges over 0..4.
        assert_eq!(
            spans,
            [
                ShardSpan {
                    offset: 0,
                    len: 2,
                    padded_len: 2
                },
                ShardSpan {
                    offset: 2,
                    len: 2,
                    padded_len: 2
                },
                ShardSpan {
                    offset: 4,
                    len: 1,
                    padded_len: 2
                },
                ShardSpan {
                    offset: 5,
                    len: 0,
                    padded_len: 2
                },
            ]
        );
        assert_eq!(chunk_size(5, 4), Ok(2));
        assert_eq!(padded_len(5, 4), Ok(8));
        assert_eq!(padded_len(0, 4), Ok(0));
    }

    #[test]
    fn shard_math_errors_are_typed() {
        assert_eq!(chunk_size(3, 0), Err(MeshError::ZeroShards));
        assert_eq!(padded_len(3, 0), Err(MeshError::ZeroShards));
        assert_eq!(shard_span(3, 0, 0), Err(MeshError::ZeroShards));
        assert_eq!(
            shard_span(3, 2, 2),
            Err(MeshError::ShardIndexOutOfRange {
                index: 2,
                shards: 2
            })
        );
        assert_eq!(
            padded_len(usize::MAX, 2),
            Err(MeshError::PaddedLenOverflow {
                len: usize::MAX,
                shards: 2
            })
        );
    }

    #[test]
    fn huge_lengths_do_not_overflow_the_span() {
        let last = shard_span(usize::MAX, 2, 1).expect("index < shards"); // invariant: 1 < 2.
        assert_eq!(last.offset + last.len, usize::MAX);
        assert_eq!(last.padded_len, usize::MAX / 2 + 1);
    }

    #[test]
    fn local_block_of_replicate_and_partial_is_the_full_tensor() {
        let mesh = DeviceMesh::new(&[2, 2], &[]).expect("valid"); // invariant: literal.
        let placements = [Placement::Replicate, Placement::Partial(ReduceOp::Sum)];
        for rank in 0..4 {
            assert_eq!(
                local_block(&[3, 5], &mesh, &placements, rank),
                Ok(LocalBlock {
                    shape: vec![3, 5],
                    offset: vec![0, 0]
                })
            );
        }
    }

    #[test]
    fn local_block_shards_two_tensor_dims() {
        let mesh = DeviceMesh::new(&[2, 3], &[]).expect("valid"); // invariant: literal.
        let placements = [Placement::Shard(1), Placement::Shard(0)];
        // Tensor [7, 5]: dim 1 over 2 -> 3, 2; dim 0 over 3 -> 3, 3, 1.
        let block = local_block(&[7, 5], &mesh, &placements, 5).expect("valid"); // invariant: rank 5 in mesh.
        assert_eq!(
            block,
            LocalBlock {
                shape: vec![1, 2],
                offset: vec![6, 3]
            }
        );
        let block = local_block(&[7, 5], &mesh, &placements, 1).expect("valid"); // invariant: rank 1 in mesh.
        assert_eq!(
            block,
            LocalBlock {
                shape: vec![3, 3],
                offset: vec![3, 0]
            }
        );
    }

    #[test]
    fn nested_shards_split_in_mesh_dim_order() {
        // 10 rows, mesh dim 0 (size 2) splits first: 5 | 5; mesh dim 1 (size 3) splits each
        // 5 into 2, 2, 1.
        let mesh = DeviceMesh::new(&[2, 3], &[]).expect("valid"); // invariant: literal.
        let placements = [Placement::Shard(0), Placement::Shard(0)];
        let rows: Vec<(usize, usize)> = (0..6)
            .map(|rank| {
                local_block(&[10], &mesh, &placements, rank).map(|b| (b.offset[0], b.shape[0]))
            })
            .collect::<Result<_>>()
            .expect("valid"); // invariant: every rank is in the mesh.
        assert_eq!(rows, [(0, 2), (2, 2), (4, 1), (5, 2), (7, 2), (9, 1)]);
    }

    #[test]
    fn local_block_errors_are_typed() {
        let mesh = DeviceMesh::new(&[2, 2], &[]).expect("valid"); // invariant: literal.
        assert_eq!(
            local_block(&[4], &mesh, &[Placement::Shard(0)], 0),
            Err(MeshError::PlacementCountMismatch {
                placements: 1,
                mesh_ndim: 2
            })
        );
        assert_eq!(
            local_block(&[4], &mesh, &[Placement::Replicate, Placement::Shard(1)], 0),
            Err(MeshError::ShardDimOutOfRange {
                mesh_dim: 1,
                shard_dim: 1,
                tensor_ndim: 1
            })
        );
        assert_eq!(
            local_block(&[4], &mesh, &[Placement::Shard(0), Placement::Replicate], 4),
            Err(MeshError::RankNotInMesh { rank: 4 })
        );
    }
}
