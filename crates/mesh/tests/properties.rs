//! Property tests: rank ↔ coordinate is a bijection, groups and split keys agree, and the local
//! blocks of all ranks tile the global tensor exactly once.
//!
//! The strategies generate only valid meshes and layouts, so every `unwrap` on a result of the
//! crate rests on that invariant: an error there is a bug, and proptest reports it as a failure.

use std::collections::BTreeMap;

use hypershard_mesh::{DeviceMesh, Placement, ReduceOp, local_block};
use proptest::prelude::*;

/// A mesh shape of 1 to 3 dims of size 1..=4 and a shuffled, spread-out rank array for it.
fn mesh_strategy() -> impl Strategy<Value = (Vec<usize>, Vec<usize>)> {
    proptest::collection::vec(1usize..=4, 1..=3).prop_flat_map(|shape| {
        let count: usize = shape.iter().product();
        // Ranks 3k + 1 so a mesh's ranks are neither 0..n nor contiguous.
        let ranks: Vec<usize> = (0..count).map(|k| 3 * k + 1).collect();
        (Just(shape), Just(ranks).prop_shuffle())
    })
}

/// A global shape of 1 to 3 dims of length 0..=7, a mesh of 1 to 3 dims of size 1..=3, and one
/// placement per mesh dim (shards may repeat a tensor dim, which makes them nest).
fn layout_strategy() -> impl Strategy<Value = (Vec<usize>, Vec<usize>, Vec<Placement>)> {
    (
        proptest::collection::vec(0usize..=7, 1..=3),
        proptest::collection::vec(1usize..=3, 1..=3),
    )
        .prop_flat_map(|(global, mesh_shape)| {
            let tensor_ndim = global.len();
            let placement = prop_oneof![
                3 => (0..tensor_ndim).prop_map(Placement::Shard),
                1 => Just(Placement::Replicate),
                1 => Just(Placement::Partial(ReduceOp::Sum)),
            ];
            let placements = proptest::collection::vec(placement, mesh_shape.len());
            (Just(global), Just(mesh_shape), placements)
        })
}

/// The row-major coordinate of `position` in `shape`.
fn unravel(mut position: usize, shape: &[usize]) -> Vec<usize> {
    let mut coordinate = vec![0; shape.len()];
    for (entry, &size) in coordinate.iter_mut().zip(shape).rev() {
        *entry = position % size;
        position /= size;
    }
    coordinate
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn rank_and_coordinate_are_a_bijection((shape, ranks) in mesh_strategy()) {
        let mesh = DeviceMesh::from_ranks(&shape, ranks.clone(), &[]).unwrap();
        let mut seen = BTreeMap::new();
        for (position, &rank) in ranks.iter().enumerate() {
            let coordinate = mesh.coordinate_of(rank).unwrap();
            prop_assert_eq!(&coordinate, &unravel(position, &shape));
            prop_assert_eq!(mesh.rank_at(&coordinate).unwrap(), rank);
            for (dim, &index) in coordinate.iter().enumerate() {
                prop_assert_eq!(mesh.local_rank(rank, dim).unwrap(), index);
            }
            prop_assert!(seen.insert(coordinate, rank).is_none());
        }
        // Every coordinate of the grid maps to a rank, and back.
        let count: usize = shape.iter().product();
        prop_assert_eq!(seen.len(), count);
        for position in 0..count {
            let coordinate = unravel(position, &shape);
            let rank = mesh.rank_at(&coordinate).unwrap();
            prop_assert_eq!(mesh.coordinate_of(rank).unwrap(), coordinate);
        }
        // Ranks that are not in the mesh are rejected.
        prop_assert!(mesh.coordinate_of(0).is_err());
        prop_assert!(mesh.coordinate_of(3 * count + 1).is_err());
    }

    #[test]
    fn groups_and_split_keys_partition_every_dim((shape, ranks) in mesh_strategy()) {
        let mesh = DeviceMesh::from_ranks(&shape, ranks.clone(), &[]).unwrap();
        for dim in 0..shape.len() {
            let groups = mesh.groups(dim).unwrap();
            prop_assert_eq!(groups.len(), ranks.len() / shape[dim]);
            let mut members: Vec<usize> = groups.iter().flatten().copied().collect();
            members.sort_unstable();
            let mut expected = ranks.clone();
            expected.sort_unstable();
            prop_assert_eq!(members, expected);
            for &rank in &ranks {
                let key = mesh.split_key(rank, dim).unwrap();
                prop_assert_eq!(groups[key.color][key.key], rank);
                // Ranks of one group differ only along `dim`.
                let coordinate = mesh.coordinate_of(rank).unwrap();
                for &peer in &groups[key.color] {
                    let peer_coordinate = mesh.coordinate_of(peer).unwrap();
                    for other in (0..shape.len()).filter(|&other| other != dim) {
                        prop_assert_eq!(peer_coordinate[other], coordinate[other]);
                    }
                }
                prop_assert_eq!(mesh.select(rank, &[dim]).unwrap().ranks().to_vec(), groups[key.color].clone());
            }
        }
        // Flattening every dim keeps the row-major rank order.
        let all: Vec<usize> = (0..shape.len()).collect();
        prop_assert_eq!(mesh.flatten(&all[..], "all").unwrap().ranks().to_vec(), ranks.clone());
    }

    #[test]
    fn local_blocks_tile_the_global_tensor_exactly_once(
        (global, mesh_shape, placements) in layout_strategy(),
        shuffle in any::<prop::sample::Index>(),
    ) {
        let count: usize = mesh_shape.iter().product();
        // Rotate the rank array so ranks are not in row-major order.
        let start = shuffle.index(count);
        let ranks: Vec<usize> = (0..count).map(|k| (k + start) % count).collect();
        let mesh = DeviceMesh::from_ranks(&mesh_shape, ranks, &[]).unwrap();
        let elements: usize = global.iter().product();
        // Ranks that agree on every non-shard mesh coordinate form one replica; each replica
        // must cover every element exactly once.
        let mut coverage: BTreeMap<Vec<usize>, Vec<u32>> = BTreeMap::new();
        for &rank in mesh.ranks() {
            let block = local_block(&global, &mesh, &placements, rank).unwrap();
            prop_assert_eq!(block.shape.len(), global.len());
            for ((&offset, &len), &size) in block.offset.iter().zip(&block.shape).zip(&global) {
                prop_assert!(offset + len <= size);
            }
            let coordinate = mesh.coordinate_of(rank).unwrap();
            let replica: Vec<usize> = coordinate
                .iter()
                .zip(&placements)
                .filter(|(_, placement)| !placement.is_shard())
                .map(|(&index, _)| index)
                .collect();
            let counts = coverage.entry(replica).or_insert_with(|| vec![0; elements]);
            let block_elements: usize = block.shape.iter().product();
            for local in 0..block_elements {
                let local_index = unravel(local, &block.shape);
                let flat = local_index
                    .iter()
                    .zip(&block.offset)
                    .zip(&global)
                    .fold(0, |flat, ((&index, &offset), &size)| flat * size + index + offset);
                counts[flat] += 1;
            }
        }
        let replicas: usize = mesh_shape
            .iter()
            .zip(&placements)
            .filter(|(_, placement)| !placement.is_shard())
            .map(|(&size, _)| size)
            .product();
        prop_assert_eq!(coverage.len(), replicas);
        for counts in coverage.values() {
            prop_assert!(counts.iter().all(|&count| count == 1), "coverage {:?}", counts);
        }
    }
}
