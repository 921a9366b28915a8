//! Every single-mesh-dim transition of the table in docs/redistribute.md, on uneven and empty
//! shards, with the exact collectives each one issues.

use std::collections::BTreeMap;

use hypershard_dtensor::collectives::OpKind;
use hypershard_dtensor::{DTensor, Error, Placement, ReduceOp};

use hypershard_dtensor::tensor::{Device, Tensor};

use crate::common::{Snapshot, expected_local, expected_spans, full_tensor, on_mesh};

const R: Placement = Placement::Replicate;
const S0: Placement = Placement::Shard(0);
const S1: Placement = Placement::Shard(1);
const PSUM: Placement = Placement::Partial(ReduceOp::Sum);
const PAVG: Placement = Placement::Partial(ReduceOp::Avg);
const PMAX: Placement = Placement::Partial(ReduceOp::Max);
const PMIN: Placement = Placement::Partial(ReduceOp::Min);

/// (src, dst, the one collective expected, if any).
const TABLE: &[(Placement, Placement, Option<OpKind>)] = &[
    (S0, R, Some(OpKind::AllGather)),
    (S1, R, Some(OpKind::AllGather)),
    (PSUM, R, Some(OpKind::AllReduce)),
    (PAVG, R, Some(OpKind::AllReduce)),
    (PMAX, R, Some(OpKind::AllReduce)),
    (PMIN, R, Some(OpKind::AllReduce)),
    (PSUM, S0, Some(OpKind::ReduceScatter)),
    (PAVG, S1, Some(OpKind::ReduceScatter)),
    (PMAX, S0, Some(OpKind::ReduceScatter)),
    (R, S0, None),
    (R, S1, None),
    (S0, S1, Some(OpKind::AllToAll)),
    (S1, S0, Some(OpKind::AllToAll)),
    (R, PSUM, None),
    (R, PAVG, None),
    (R, PMAX, None),
    (S0, PSUM, None),
    (S1, PSUM, None),
    (S0, PMAX, Some(OpKind::AllGather)),
];

/// Runs the whole table on a 1-d mesh of `world` ranks for `shape`; checks the local blocks
/// of non-partial results against the first-principles blocks, the full tensors, and the
/// collectives issued.
fn run_table(world: usize, shape: &'static [usize]) {
    let out = on_mesh(&[world], &["x"], move |ctx| {
        let full = full_tensor(shape);
        let coordinate = ctx.mesh.coordinate().to_vec();
        let mut rows = Vec::new();
        for &(src, dst, _) in TABLE {
            let local = expected_local(&full, &[world], &[src], &coordinate);
            let x = DTensor::from_local(local, &ctx.mesh, &[src], Some(shape))?;
            ctx.reset();
            let y = x.redistribute(&[dst])?;
            let counts = ctx.counts();
            let y_full = y.full_tensor()?;
            rows.push((Snapshot::of(y.to_local()), counts, Snapshot::of(&y_full)));
        }
        Ok((coordinate, rows))
    });
    let full = full_tensor(shape);
    for (coordinate, rows) in out {
        for (&(src, dst, collective), (local, counts, y_full)) in TABLE.iter().zip(rows) {
            let case =
                format!("world {world}, shape {shape:?}, {src} -> {dst}, coord {coordinate:?}");
            let expected_counts: BTreeMap<OpKind, u64> =
                collective.into_iter().map(|op| (op, 1)).collect();
            assert_eq!(counts, expected_counts, "{case}: collectives");
            assert_eq!(y_full, Snapshot::of(&full), "{case}: full tensor");
            if dst.partial_op().is_none() {
                let expected = expected_local(&full, &[world], &[dst], &coordinate);
                assert_eq!(local, Snapshot::of(&expected), "{case}: local block");
            } else {
                let expected = match src {
                    // S -> P(sum) places the shard in zeros of the full extent.
                    Placement::Shard(_) if dst == PSUM => {
                        let zeros = Tensor::zeros(shape, crate::common::F64).unwrap();
                        let spans = expected_spans(shape, &[world], &[src], &coordinate);
                        let mut view = zeros.clone();
                        for (d, &(offset, len)) in spans.iter().enumerate() {
                            view = view.narrow(d, offset, len).unwrap();
                        }
                        view.copy_from(&expected_local(&full, &[world], &[src], &coordinate))
                            .unwrap();
                        Snapshot::of(&zeros)
                    }
                    // R -> P keeps the value on coordinate 0 for sum, everywhere for avg/max.
                    _ if coordinate[0] == 0 || dst != PSUM => {
                        Snapshot::of(&expected_local(&full, &[world], &[R], &coordinate))
                    }
                    _ => Snapshot {
                        shape: shape.to_vec(),
                        values: vec![0.0; shape.iter().product()],
                    },
                };
                assert_eq!(local, expected, "{case}: partial local");
            }
        }
    }
}

/// Every transition of the table with each rank's local tensor on an emulated device of its
/// own: the result stays on that device, with the host run's values (the collectives take
/// host buffers, so the executor stages the local tensor through the host).
#[test]
fn transitions_of_device_tensors_stay_on_the_device_with_the_hosts_values() {
    const SHAPE: &[usize] = &[5, 3];
    let world = 3;
    let out = on_mesh(&[world], &["x"], move |ctx| {
        let full = full_tensor(SHAPE);
        let coordinate = ctx.mesh.coordinate().to_vec();
        let device = Device::Emulated {
            ordinal: coordinate[0],
        };
        let mut rows = Vec::new();
        for &(src, dst, _) in TABLE {
            let local = expected_local(&full, &[world], &[src], &coordinate);
            let host = DTensor::from_local(local.clone(), &ctx.mesh, &[src], Some(SHAPE))?
                .redistribute(&[dst])?;
            let moved = local.to_device(&device)?;
            let on_device = DTensor::from_local(moved, &ctx.mesh, &[src], Some(SHAPE))?
                .into_redistribute(&[dst])?;
            let placed = on_device.to_local().device();
            let values = Snapshot::of(&on_device.to_local().to_host()?);
            rows.push((placed, Snapshot::of(host.to_local()), values));
        }
        Ok((device, rows))
    });
    for (device, rows) in out {
        for (&(src, dst, _), (placed, host, on_device)) in TABLE.iter().zip(rows) {
            assert_eq!(placed, device, "{src} -> {dst}: the result left the device");
            assert_eq!(host, on_device, "{src} -> {dst} on {device}");
        }
    }
}

#[test]
fn table_on_four_ranks_with_a_short_trailing_shard() {
    // 10 rows on 4 ranks: 3, 3, 3, 1; 5 columns: 2, 2, 1, 0.
    run_table(4, &[10, 5]);
}

#[test]
fn table_on_three_ranks_with_empty_shards() {
    // 1 row on 3 ranks: 1, 0, 0; 2 columns: 1, 1, 0.
    run_table(3, &[1, 2]);
}

#[test]
fn table_on_two_ranks_with_even_and_zero_extents() {
    run_table(2, &[4, 0]);
    run_table(2, &[0, 3]);
}

#[test]
fn table_on_one_rank() {
    run_table(1, &[3, 2]);
}

#[test]
fn nested_shards_unshard_innermost_first() {
    // 10 rows on [2, 3] with [S(0), S(0)]: 5 | 5, then 2, 2, 1 each.
    let shape: &[usize] = &[10, 3];
    let out = on_mesh(&[2, 3], &[], move |ctx| {
        let full = full_tensor(shape);
        let coordinate = ctx.mesh.coordinate().to_vec();
        let src = [S0, S0];
        let local = expected_local(&full, &[2, 3], &src, &coordinate);
        let x = DTensor::from_local(local, &ctx.mesh, &src, Some(shape))?;
        let plan = x.plan_to(&[R, R])?;
        ctx.reset();
        let full_back = x.full_tensor()?;
        let counts = ctx.counts();
        // Misaligned order: [S(0), S(0)] -> [S(0), S(1)] must not all-to-all mesh dim 0.
        let z = x.redistribute(&[S1, S0])?;
        let z_expected = expected_local(&full, &[2, 3], &[S1, S0], &coordinate);
        Ok((
            plan.collectives(),
            counts,
            Snapshot::of(&full_back) == Snapshot::of(&full),
            Snapshot::of(z.to_local()) == Snapshot::of(&z_expected),
        ))
    });
    for (collectives, counts, full_ok, z_ok) in out {
        assert_eq!(
            collectives,
            vec![(1, OpKind::AllGather), (0, OpKind::AllGather)]
        );
        assert_eq!(counts, BTreeMap::from([(OpKind::AllGather, 2)]));
        assert!(full_ok && z_ok);
    }
}

#[test]
fn changing_the_pending_reduction_is_an_error() {
    let out = on_mesh(&[2], &[], |ctx| {
        let x = DTensor::zeros(&ctx.mesh, &[3], hypershard_dtensor::DType::F32, &[PSUM])?;
        let change = x.redistribute(&[PAVG]);
        let mixed = DTensor::zeros(&ctx.mesh, &[3], hypershard_dtensor::DType::F32, &[R])?
            .redistribute(&[PMAX]);
        Ok((
            matches!(
                change,
                Err(Error::PartialOpChange {
                    mesh_dim: 0,
                    from: PSUM,
                    to: PAVG
                })
            ),
            mixed.is_ok(),
            ctx.counts().is_empty(),
        ))
    });
    assert_eq!(out, vec![(true, true, true); 2]);
}

#[test]
fn non_commuting_partials_on_two_dims_are_rejected() {
    let out = on_mesh(&[2, 2], &[], |ctx| {
        let bad = DTensor::zeros(
            &ctx.mesh,
            &[3],
            hypershard_dtensor::DType::F32,
            &[PMAX, PSUM],
        );
        let linear = DTensor::zeros(
            &ctx.mesh,
            &[3],
            hypershard_dtensor::DType::F32,
            &[PAVG, PSUM],
        );
        Ok((
            matches!(bad, Err(Error::MixedPartialOps { .. })),
            linear.is_ok(),
        ))
    });
    assert_eq!(out, vec![(true, true); 4]);
}

#[test]
fn premul_sum_partials_reduce_with_their_factor() {
    let premul = Placement::Partial(ReduceOp::PreMulSum(0.5));
    let out = on_mesh(&[3], &[], move |ctx| {
        let full = full_tensor(&[4]);
        let coordinate = ctx.mesh.coordinate().to_vec();
        let local = expected_local(&full, &[3], &[premul], &coordinate);
        let x = DTensor::from_local(local, &ctx.mesh, &[premul], Some(&[4]))?;
        let r = x.full_tensor()?;
        let round = DTensor::distribute_local(&full, &ctx.mesh, &[premul])?.full_tensor()?;
        Ok((Snapshot::of(&r), Snapshot::of(&round)))
    });
    for (r, round) in out {
        assert_eq!(r.values, vec![1.0, 2.0, 3.0, 4.0]);
        assert_eq!(round.values, vec![1.0, 2.0, 3.0, 4.0]);
    }
}

#[test]
fn plans_are_cached_per_mesh() {
    let out = on_mesh(&[2], &[], |ctx| {
        let x = DTensor::ones(&ctx.mesh, &[5], hypershard_dtensor::DType::F32, &[S0])?;
        let before = ctx.mesh.plan_cache().misses();
        x.redistribute(&[R])?;
        x.redistribute(&[R])?;
        let sub = ctx.mesh.select(&[0])?;
        DTensor::ones(&sub, &[5], hypershard_dtensor::DType::F32, &[S0])?.redistribute(&[R])?;
        Ok((
            ctx.mesh.plan_cache().misses() - before,
            ctx.mesh.plan_cache().hits(),
        ))
    });
    assert_eq!(out, vec![(1, 2); 2]);
}

#[test]
fn async_redistribute_overlaps_and_matches_the_blocking_one() {
    let out = on_mesh(&[2, 2], &[], |ctx| {
        let full = full_tensor(&[5, 3]);
        let x = DTensor::distribute_local(&full, &ctx.mesh, &[S0, S1])?;
        let pending = x.redistribute_async(&[R, R])?;
        let plan_len = pending.plan().steps.len();
        // The first collective is already in flight; other work proceeds meanwhile.
        let other = x.redistribute_async(&[S1, S0])?;
        let gathered = pending.wait()?;
        let swapped = other.wait()?;
        let swapped_sync = x.redistribute(&[S1, S0])?;
        Ok((
            plan_len,
            Snapshot::of(gathered.to_local()) == Snapshot::of(&full),
            Snapshot::of(swapped.to_local()) == Snapshot::of(swapped_sync.to_local()),
        ))
    });
    assert_eq!(out, vec![(2, true, true); 4]);
}

#[test]
fn every_dtype_survives_the_data_movement() {
    use hypershard_dtensor::DType;
    let out = on_mesh(&[3], &[], |ctx| {
        let mut rows = Vec::new();
        for dtype in DType::ALL {
            let full = full_tensor(&[5, 2]).to_dtype(dtype)?;
            let x = DTensor::distribute_local(&full, &ctx.mesh, &[S0])?;
            let gathered = x.redistribute(&[R])?;
            let swapped = x.redistribute(&[S1])?.full_tensor()?;
            let partial_ok = if dtype == DType::Bool {
                true
            } else {
                let p = DTensor::distribute_local(&full, &ctx.mesh, &[PSUM])?;
                Snapshot::of(&p.redistribute(&[S1])?.full_tensor()?) == Snapshot::of(&full)
            };
            rows.push((
                dtype,
                gathered.to_local().dtype() == dtype,
                Snapshot::of(gathered.to_local()) == Snapshot::of(&full),
                Snapshot::of(&swapped) == Snapshot::of(&full),
                partial_ok,
            ));
        }
        // Averages of integers are rejected by the collective on every rank.
        let ints =
            DTensor::distribute_local(&Tensor::zeros(&[3], DType::I32)?, &ctx.mesh, &[PAVG])?;
        let avg = matches!(ints.full_tensor(), Err(Error::Comm(_)));
        Ok((rows, avg))
    });
    for (rows, avg) in out {
        for (dtype, same_dtype, gathered, swapped, partial) in rows {
            assert!(same_dtype && gathered && swapped && partial, "{dtype:?}");
        }
        assert!(avg);
    }
}

#[test]
fn consuming_redistributes_chain_and_borrowing_ones_leave_the_source_alone() {
    use hypershard_dtensor::DType;
    let out = on_mesh(&[3], &[], |ctx| {
        let full = full_tensor(&[7, 4]);
        // Borrowing: the source's local tensor (collective memory from a factory) survives
        // a reduce-scatter that may use its send buffer as scratch.
        let p = DTensor::ones(&ctx.mesh, &[7, 4], DType::F64, &[PSUM])?;
        let before = Snapshot::of(p.to_local());
        let scattered = p.redistribute(&[S0])?;
        let source_intact = Snapshot::of(p.to_local()) == before;
        let scattered_ok = scattered.full_tensor()?.to_f64_vec()? == vec![1.0; 28];
        // Consuming: S(0) -> R -> S(1) -> P(sum) -> R, each step handing its buffer on.
        let x = DTensor::distribute_local(&full, &ctx.mesh, &[S0])?;
        let chained = x
            .into_redistribute(&[R])?
            .into_redistribute(&[S1])?
            .into_redistribute(&[PSUM])?
            .into_redistribute(&[R])?;
        Ok((
            source_intact,
            scattered_ok,
            Snapshot::of(chained.to_local()) == Snapshot::of(&full),
        ))
    });
    assert_eq!(out, vec![(true, true, true); 3]);
}

#[test]
fn send_buffers_are_lent_or_kept_for_reuse_and_can_be_released() {
    let out = on_mesh(&[2], &[], |ctx| {
        // 5 rows on 2 ranks: 3 and 2. Rank 0's shard came out of the scatter (collective
        // memory) and needs no padding: it is lent to the all-gather and nothing is pooled.
        // Rank 1's is padded to 3 rows, so it is copied into a 3 x 2 f64 send buffer that
        // comes back to the pool (and is reused by the second redistribute).
        let full = full_tensor(&[5, 2]);
        let x = DTensor::distribute_local(&full, &ctx.mesh, &[S0])?;
        let first = x.redistribute(&[R])?;
        let second = x.redistribute(&[R])?;
        let gathered = Snapshot::of(first.to_local()) == Snapshot::of(&full)
            && Snapshot::of(second.to_local()) == Snapshot::of(&full);
        let freed = ctx.mesh.release_buffers();
        Ok((gathered, freed, ctx.mesh.release_buffers()))
    });
    assert_eq!(out, vec![(true, 0, 0), (true, 48, 0)]);
}

#[test]
fn consumed_sources_of_one_size_do_not_pile_up_in_the_pool() {
    use hypershard_dtensor::DType;
    let out = on_mesh(&[2], &[], |ctx| {
        // P(sum) -> S(0) of an even [4, 3] f32: each consuming redistribute moves its 12-element
        // source into the reduce-scatter and hands it back to the pool, while the 6-element
        // outputs are kept by the caller. Three in a row give back three sources of one size;
        // the pool keeps one (48 bytes) instead of three.
        let mut outputs = Vec::new();
        for _ in 0..3 {
            let p = DTensor::ones(&ctx.mesh, &[4, 3], DType::F32, &[PSUM])?;
            outputs.push(p.into_redistribute(&[S0])?);
        }
        let values: Vec<Vec<f32>> = outputs
            .iter()
            .map(|o| o.to_local().to_vec::<f32>())
            .collect::<std::result::Result<_, _>>()?;
        let after_sources = ctx.mesh.release_buffers();
        // An S(0) -> S(1) of a [4, 4] f32 tensor, consuming: its 8-element output is taken
        // from the pool when one is idle, and its source (8 elements) handed back, so a loop of
        // them runs on one buffer and the pool stays at one buffer of that size.
        let mut x = DTensor::ones(&ctx.mesh, &[4, 4], DType::F32, &[S0])?;
        for _ in 0..4 {
            x = x.into_redistribute(&[S1])?.into_redistribute(&[S0])?;
        }
        let looped = x.full_tensor()?.to_vec::<f32>()?;
        Ok((values, after_sources, looped, ctx.mesh.release_buffers()))
    });
    for (values, after_sources, looped, after_loop) in out {
        // A factory's global tensor does not depend on the layout: all ones, so each rank's
        // 2 x 3 block of the reduced sum is ones.
        assert_eq!(values, vec![vec![1.0f32; 6]; 3]);
        assert_eq!(
            after_sources,
            12 * 4,
            "one 12-element f32 source kept, not three"
        );
        assert_eq!(looped, vec![1.0f32; 16]);
        assert_eq!(
            after_loop,
            8 * 4,
            "one 8-element f32 buffer kept after the loop"
        );
    }
}

#[test]
fn a_lent_source_written_during_the_collective_keeps_its_write_and_sends_its_old_values() {
    use hypershard_dtensor::DType;
    let out = on_mesh(&[2], &[], |ctx| {
        // Factory tensors live in collective memory: a borrowing redistribute lends them to
        // the reduce-scatter / all-gather (nothing is copied into a pooled send buffer).
        let p = DTensor::ones(&ctx.mesh, &[4, 3], DType::F32, &[PSUM])?;
        let s = DTensor::full(&ctx.mesh, &[4, 3], 2.0, DType::F32, &[S0])?;
        p.redistribute(&[S0])?;
        s.redistribute(&[R])?;
        let pooled = ctx.mesh.release_buffers();
        let scatter = p.redistribute_async(&[S0])?;
        let gather = s.redistribute_async(&[R])?;
        // Writes while lent (the collectives may or may not have finished) go to private
        // copies: the sources change, the collectives send the values at the call.
        p.to_local().fill_(5.0)?;
        s.to_local().fill_(7.0)?;
        let scattered = scatter.wait()?.to_local().to_vec::<f32>()?;
        let gathered = gather.wait()?.to_local().to_vec::<f32>()?;
        let sources = (p.to_local().to_vec::<f32>()?, s.to_local().to_vec::<f32>()?);
        Ok((scattered, gathered, sources, pooled))
    });
    for (scattered, gathered, (p, s), pooled) in out {
        // A factory's values do not depend on the layout: the global tensor is all ones.
        assert_eq!(scattered, vec![1.0; 6]);
        assert_eq!(gathered, vec![2.0; 12]);
        assert_eq!(
            (p, s),
            (vec![5.0; 12], vec![7.0; 6]),
            "the writes stay in the sources"
        );
        assert_eq!(pooled, 0, "lent, not copied into a pooled send buffer");
    }
}

#[test]
fn bool_tensors_travel_as_bytes_at_an_uneven_world() {
    use hypershard_dtensor::DType;
    // A [7, 3] bool tensor on 3 ranks: rows split 3, 3, 1 and columns 1, 1, 1. Element (i, j)
    // is true when (3i + j) mod 4 == 1, so every block has a closed form.
    let value = |i: usize, j: usize| u8::from((3 * i + j) % 4 == 1);
    let block = move |rows: std::ops::Range<usize>, cols: std::ops::Range<usize>| -> Vec<u8> {
        rows.flat_map(|i| cols.clone().map(move |j| value(i, j)))
            .collect()
    };
    let out = on_mesh(&[3], &[], move |ctx| {
        let bytes = block(0..7, 0..3);
        let full = Tensor::from_bytes(&bytes, &[7, 3], DType::Bool)?;
        let sharded = DTensor::distribute_local(&full, &ctx.mesh, &[S0])?;
        let rows = sharded.to_local().to_bytes()?;
        let gathered = sharded.redistribute(&[R])?;
        let columns = sharded.redistribute(&[S1])?;
        let back = columns.clone().into_redistribute(&[S0])?;
        Ok((
            rows,
            gathered.to_local().dtype(),
            gathered.to_local().to_bytes()?,
            columns.to_local().to_bytes()?,
            back.to_local().to_bytes()?,
            columns.full_tensor()?.to_bytes()?,
        ))
    });
    let row_spans = [0..3, 3..6, 6..7];
    for (rank, (rows, dtype, gathered, columns, back, full)) in out.into_iter().enumerate() {
        assert_eq!(rows, block(row_spans[rank].clone(), 0..3), "rank {rank}");
        assert_eq!(dtype, DType::Bool);
        assert_eq!(gathered, block(0..7, 0..3), "rank {rank}");
        assert_eq!(columns, block(0..7, rank..rank + 1), "rank {rank}");
        assert_eq!(back, block(row_spans[rank].clone(), 0..3), "rank {rank}");
        assert_eq!(full, block(0..7, 0..3), "rank {rank}");
    }
}
