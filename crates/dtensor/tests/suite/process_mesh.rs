//! ProcessMesh: one communicator per mesh dim, select, flatten (cached), partial meshes.

use std::sync::Arc;

use hypershard_dtensor::collectives::{self, CommCounter, Communicator, CommunicatorExt, OpKind};
use hypershard_dtensor::{DeviceMesh, Error, ProcessMesh, init_process_mesh};
use hypershard_testkit::run_ranks;

use crate::common::{on_mesh, slots, take};

#[test]
fn every_mesh_dim_gets_its_group() {
    // Mesh [2, 3]: rank r sits at (r / 3, r % 3); "dp" groups are {0,3} {1,4} {2,5}.
    let out = on_mesh(&[2, 3], &["dp", "tp"], |ctx| {
        let mesh = &ctx.mesh;
        let rank = mesh.rank();
        let dp = mesh.dim_comm("dp")?;
        let tp = mesh.group(1)?;
        // Summing the global ranks over each group tells who is in it.
        let dp_sum = dp.all_reduce_vec(vec![rank as i64], collectives::ReduceOp::Sum)?[0];
        let tp_sum = tp.all_reduce_vec(vec![rank as i64], collectives::ReduceOp::Sum)?[0];
        Ok((
            mesh.coordinate().to_vec(),
            mesh.local_rank("tp")?,
            dp.size(),
            dp.rank(),
            tp.size(),
            tp.rank(),
            dp_sum,
            tp_sum,
        ))
    });
    for (rank, (coordinate, tp_rank, dp_size, dp_rank, tp_size, tp_comm_rank, dp_sum, tp_sum)) in
        out.into_iter().enumerate()
    {
        let (row, col) = (rank / 3, rank % 3);
        assert_eq!(coordinate, vec![row, col]);
        assert_eq!((tp_rank, tp_comm_rank), (col, col));
        assert_eq!((dp_size, dp_rank, tp_size), (2, row, 3));
        assert_eq!(dp_sum, (col + col + 3) as i64);
        assert_eq!(tp_sum, (3 * row * 3 + 3) as i64);
    }
}

#[test]
fn a_one_d_world_mesh_uses_the_world_communicator() {
    let out = on_mesh(&[4], &["dp"], |ctx| {
        ctx.mesh
            .dim_comm(0)?
            .all_reduce_vec(vec![1.0f32], collectives::ReduceOp::Sum)?;
        Ok((
            ctx.counter.calls(OpKind::Split),
            ctx.counter.calls(OpKind::AllReduce),
        ))
    });
    assert_eq!(out, vec![(0, 1); 4]);
}

#[test]
fn select_carries_the_communicators_and_flatten_splits_once() {
    let out = on_mesh(&[2, 2, 2], &["pp", "dp", "tp"], |ctx| {
        let mesh = &ctx.mesh;
        let dp_tp = mesh.select(&["dp", "tp"])?;
        let splits_after_select = ctx.counter.calls(OpKind::Split);
        let flat = mesh.flatten(&["dp", "tp"], "dptp")?;
        let splits_after_flatten = ctx.counter.calls(OpKind::Split);
        let again = mesh.flatten(&["dp", "tp"], "dptp")?;
        let splits_after_second = ctx.counter.calls(OpKind::Split);
        let merged = flat.dim_comm("dptp")?;
        let sum = merged.all_reduce_vec(vec![mesh.rank() as i64], collectives::ReduceOp::Sum)?;
        let single = mesh.flatten(&["tp"], "tp2")?;
        Ok((
            dp_tp.mesh().ranks().to_vec(),
            Arc::ptr_eq(dp_tp.dim_comm("tp")?, mesh.dim_comm("tp")?),
            splits_after_flatten - splits_after_select,
            splits_after_second - splits_after_flatten,
            flat.shape().to_vec(),
            merged.size(),
            merged.rank(),
            sum[0],
            again.same_mesh(&flat),
            Arc::ptr_eq(single.dim_comm("tp2")?, mesh.dim_comm("tp")?),
        ))
    });
    for (rank, row) in out.into_iter().enumerate() {
        let (ranks, shared, first, second, shape, size, merged_rank, sum, same, single) = row;
        let base = rank / 4 * 4;
        assert_eq!(ranks, (base..base + 4).collect::<Vec<_>>());
        assert!(shared);
        assert_eq!(
            (first, second),
            (1, 0),
            "flatten splits once, then comes from the cache"
        );
        assert_eq!(shape, vec![2, 4]);
        assert_eq!((size, merged_rank), (4, rank % 4));
        assert_eq!(sum, (base * 4 + 6) as i64);
        assert!(same && single);
    }
}

#[test]
fn ranks_outside_the_mesh_take_part_and_are_told() {
    let comms = collectives::local::spawn_world(4).expect("world");
    let slots = slots(comms);
    let out = run_ranks(4, move |rank| {
        let world = take(&slots, rank);
        let mesh = DeviceMesh::from_ranks(&[2], vec![3, 1], &["x"])?;
        match ProcessMesh::new(mesh, world) {
            Ok(mesh) => {
                let comm = mesh.dim_comm(0)?;
                let got = comm.all_gather_vec(vec![rank as i64])?;
                Ok::<_, Error>(Some((
                    mesh.coordinate().to_vec(),
                    got,
                    mesh.root_comm().size(),
                )))
            }
            Err(Error::RankNotInMesh { rank: r }) if r == rank => Ok(None),
            Err(e) => Err(e),
        }
    })
    .expect("ranks");
    assert_eq!(out[0], None);
    assert_eq!(out[2], None);
    assert_eq!(out[1], Some((vec![1], vec![3, 1], 2)));
    assert_eq!(out[3], Some((vec![0], vec![3, 1], 2)));
}

#[test]
fn a_mesh_larger_than_the_world_is_rejected() {
    let world = collectives::local::spawn_world(1).expect("world").remove(0);
    let counted: Arc<dyn Communicator> = CommCounter::new(world);
    let err = init_process_mesh(counted, &[2], &[]).unwrap_err();
    assert!(matches!(
        err,
        Error::MeshExceedsWorld {
            max_rank: 1,
            world_size: 1
        }
    ));
}

#[test]
fn unknown_dims_are_typed_errors() {
    let out = on_mesh(&[2], &["dp"], |ctx| {
        Ok((
            matches!(ctx.mesh.dim_comm("tp"), Err(Error::Mesh(_))),
            matches!(ctx.mesh.local_rank(3), Err(Error::Mesh(_))),
        ))
    });
    assert_eq!(out, vec![(true, true); 2]);
}
