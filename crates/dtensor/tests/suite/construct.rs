//! Making DTensors: distribute_tensor (rank-0 source), distribute_local, factories,
//! from_local and the validating from_local_checked.

use hypershard_dtensor::collectives::OpKind;
use hypershard_dtensor::tensor::{RandomInit, Tensor};
use hypershard_dtensor::{DTensor, DType, Error, Placement, ReduceOp, distribute_tensor};

use crate::common::{F64, Snapshot, block, expected_spans, full_tensor, on_mesh};

const R: Placement = Placement::Replicate;
const S0: Placement = Placement::Shard(0);
const S1: Placement = Placement::Shard(1);
const PSUM: Placement = Placement::Partial(ReduceOp::Sum);

#[test]
fn distribute_tensor_takes_the_values_of_coordinate_zero() {
    let shape: &[usize] = &[7, 3];
    let placements = [S0, R, S1];
    let out = on_mesh(&[2, 2, 2], &[], move |ctx| {
        // Every rank passes different values; only rank 0's (the full tensor) count.
        let mine = if ctx.mesh.rank() == 0 {
            full_tensor(shape)
        } else {
            full_tensor(shape).scale(-(ctx.mesh.rank() as f64))?
        };
        let d = distribute_tensor(&mine, &ctx.mesh, &placements)?;
        let counts = ctx.counts();
        Ok((
            ctx.mesh.coordinate().to_vec(),
            Snapshot::of(d.to_local()),
            counts,
        ))
    });
    let full = full_tensor(shape);
    for (coordinate, local, counts) in out {
        let spans = expected_spans(shape, &[2, 2, 2], &placements, &coordinate);
        assert_eq!(local, Snapshot::of(&block(&full, &spans)), "{coordinate:?}");
        assert_eq!(counts.get(&OpKind::Scatter), Some(&2));
        assert_eq!(counts.get(&OpKind::Broadcast), Some(&1));
    }
}

#[test]
fn distribute_local_and_partial_placements_round_trip() {
    let out = on_mesh(&[3], &[], |ctx| {
        let full = full_tensor(&[4, 2]);
        let partial = DTensor::distribute_local(&full, &ctx.mesh, &[PSUM])?;
        let distributed = distribute_tensor(&full, &ctx.mesh, &[PSUM])?;
        ctx.reset();
        let local_only = DTensor::distribute_local(&full, &ctx.mesh, &[S0])?;
        let silent = ctx.counts().is_empty();
        Ok((
            Snapshot::of(&partial.full_tensor()?) == Snapshot::of(&full),
            Snapshot::of(&distributed.full_tensor()?) == Snapshot::of(&full),
            local_only.to_local().shape().to_vec(),
            silent,
        ))
    });
    let shapes: Vec<Vec<usize>> = out.iter().map(|o| o.2.clone()).collect();
    assert_eq!(shapes, vec![vec![2, 2], vec![2, 2], vec![0, 2]]);
    assert!(out.iter().all(|o| o.0 && o.1 && o.3));
}

#[test]
fn rand_is_the_same_global_tensor_on_every_layout() {
    let shape: &[usize] = &[5, 6];
    let init = RandomInit::normal(11, 0.0, 1.0);
    let layouts: Vec<Vec<Placement>> = vec![
        vec![R, R],
        vec![S0, S1],
        vec![S1, S0],
        vec![S0, S0],
        vec![PSUM, S1],
    ];
    let out = on_mesh(&[2, 3], &[], move |ctx| {
        let mut fulls = Vec::new();
        for placements in &layouts {
            let t = DTensor::rand(&ctx.mesh, shape, DType::F32, init, placements)?;
            fulls.push(Snapshot::of(&t.full_tensor()?));
        }
        Ok(fulls)
    });
    let reference = Snapshot::of(&Tensor::random(shape, DType::F32, init).expect("random"));
    for fulls in out {
        for full in fulls {
            assert_eq!(full, reference);
        }
    }
}

#[test]
fn constant_factories_fill_the_global_tensor() {
    let out = on_mesh(&[2, 2], &[], |ctx| {
        let zeros = DTensor::zeros(&ctx.mesh, &[3, 3], DType::BF16, &[S0, S1])?;
        let ones = DTensor::ones(&ctx.mesh, &[3], DType::F32, &[PSUM, R])?;
        let sevens = DTensor::full(&ctx.mesh, &[2, 5], 7.0, DType::I32, &[S1, PSUM])?;
        Ok((
            zeros.full_tensor()?.to_f64_vec()?,
            zeros.to_local().shape().to_vec(),
            ones.full_tensor()?.to_f64_vec()?,
            sevens.full_tensor()?.to_f64_vec()?,
            ctx.mesh.coordinate().to_vec(),
        ))
    });
    for (zeros, local_shape, ones, sevens, coordinate) in out {
        assert_eq!(zeros, vec![0.0; 9]);
        let rows = if coordinate[0] == 0 { 2 } else { 1 };
        let cols = if coordinate[1] == 0 { 2 } else { 1 };
        assert_eq!(local_shape, vec![rows, cols]);
        assert_eq!(ones, vec![1.0; 3]);
        assert_eq!(sevens, vec![7.0; 10]);
    }
}

#[test]
fn from_local_infers_even_shapes_and_checks_the_block() {
    let out = on_mesh(&[2], &[], |ctx| {
        let local = Tensor::zeros(&[3, 2], F64)?;
        let even = DTensor::from_local(local.clone(), &ctx.mesh, &[S0], None)?;
        let uneven = DTensor::from_local(local.clone(), &ctx.mesh, &[S0], Some(&[5, 2]));
        let wrong_rank_count = DTensor::from_local(local, &ctx.mesh, &[S0, R], None);
        Ok((
            even.shape().to_vec(),
            even.stride(),
            match uneven {
                Ok(_) => None,
                Err(Error::LocalShapeMismatch { rank, expected, .. }) => Some((rank, expected)),
                Err(e) => return Err(e),
            },
            matches!(wrong_rank_count, Err(Error::Mesh(_))),
        ))
    });
    assert_eq!(out[0], (vec![6, 2], vec![2, 1], None, true));
    assert_eq!(
        out[1],
        (vec![6, 2], vec![2, 1], Some((1, vec![2, 2])), true)
    );
}

#[test]
fn from_local_checked_derives_uneven_global_shapes() {
    // [S(0), S(0)] on [2, 3] over 10 rows: 2, 2, 1, 2, 2, 1; columns sharded 7 -> 4, 3 on dim 0.
    let out = on_mesh(&[2, 3], &[], |ctx| {
        let full = full_tensor(&[10, 7]);
        let placements = [S1, S0];
        let spans = expected_spans(&[10, 7], &[2, 3], &placements, ctx.mesh.coordinate());
        let local = block(&full, &spans);
        let checked = DTensor::from_local_checked(local.clone(), &ctx.mesh, &placements, None)?;
        let given = DTensor::from_local_checked(local, &ctx.mesh, &placements, Some(&[10, 7]))?;
        let ok = Snapshot::of(&checked.full_tensor()?) == Snapshot::of(&full);
        Ok((checked.shape().to_vec(), given.shape().to_vec(), ok))
    });
    assert_eq!(out, vec![(vec![10, 7], vec![10, 7], true); 6]);
}

#[test]
fn from_local_checked_fails_on_every_rank_together() {
    let out = on_mesh(&[2, 2], &[], |ctx| {
        let rank = ctx.mesh.rank();
        // Rank 3 holds one row too few; 5 rows over 2 are 3, 2.
        let rows = match (ctx.mesh.coordinate()[0], rank) {
            (_, 3) => 1,
            (0, _) => 3,
            _ => 2,
        };
        let bad_shape =
            DTensor::from_local_checked(Tensor::zeros(&[rows, 2], F64)?, &ctx.mesh, &[S0, R], None);
        // Rank 1 passes a different dtype.
        let dtype = if rank == 1 { DType::F32 } else { F64 };
        let bad_dtype =
            DTensor::from_local_checked(Tensor::zeros(&[2, 2], dtype)?, &ctx.mesh, &[R, R], None);
        // Every rank passes the wrong global shape.
        let bad_global = DTensor::from_local_checked(
            Tensor::zeros(&[2, 2], F64)?,
            &ctx.mesh,
            &[R, R],
            Some(&[2, 3]),
        );
        let describe = |result: hypershard_dtensor::Result<DTensor>| match result {
            Ok(_) => "ok".to_string(),
            Err(Error::LocalShapeMismatch { rank, .. }) => format!("local {rank}"),
            Err(Error::InconsistentAcrossRanks { rank, what, .. }) => format!("peer {rank} {what}"),
            Err(e) => format!("other {e}"),
        };
        Ok((
            describe(bad_shape),
            describe(bad_dtype),
            describe(bad_global),
        ))
    });
    assert_eq!(out[3].0, "local 3");
    for row in &out[..3] {
        assert_eq!(row.0, "peer 3 local shape");
    }
    for row in &out {
        assert_eq!(row.1, "peer 1 dtype, ndim or placements");
        assert!(row.2.starts_with("peer"), "{}", row.2);
    }
}
