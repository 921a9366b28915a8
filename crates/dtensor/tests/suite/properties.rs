//! Property tests: random meshes (1-3 dims, at most 8 ranks), random global shapes (uneven,
//! empty and smaller than the mesh) and random source/target placements.

use std::collections::BTreeMap;

use hypershard_dtensor::collectives::OpKind;
use hypershard_dtensor::{DTensor, Error, Placement, ReduceOp};
use proptest::prelude::*;

use crate::common::{Snapshot, expected_local, full_tensor, on_mesh};

fn mesh_shapes() -> impl Strategy<Value = Vec<usize>> {
    prop::collection::vec(1usize..=4, 1..=3)
        .prop_filter("at most 8 ranks", |s| s.iter().product::<usize>() <= 8)
}

fn placement(tensor_ndim: usize) -> impl Strategy<Value = Placement> {
    prop_oneof![
        2 => Just(Placement::Replicate),
        4 => (0..tensor_ndim).prop_map(Placement::Shard),
        1 => Just(Placement::Partial(ReduceOp::Sum)),
        1 => Just(Placement::Partial(ReduceOp::Avg)),
        1 => Just(Placement::Partial(ReduceOp::Max)),
    ]
}

/// Whether the pending reductions commute (all linear, or all one op), as the crate requires.
fn commute(placements: &[Placement]) -> bool {
    let ops: Vec<ReduceOp> = placements
        .iter()
        .filter_map(Placement::partial_op)
        .collect();
    ops.iter()
        .all(|op| matches!(op, ReduceOp::Sum | ReduceOp::Avg))
        || ops.windows(2).all(|w| w[0] == w[1])
}

#[derive(Debug, Clone)]
struct Case {
    mesh_shape: Vec<usize>,
    global_shape: Vec<usize>,
    src: Vec<Placement>,
    dst: Vec<Placement>,
}

fn cases() -> impl Strategy<Value = Case> {
    (mesh_shapes(), prop::collection::vec(0usize..=7, 1..=3))
        .prop_flat_map(|(mesh_shape, global_shape)| {
            let m = mesh_shape.len();
            let nd = global_shape.len();
            (
                Just(mesh_shape),
                Just(global_shape),
                prop::collection::vec(placement(nd), m),
                prop::collection::vec(placement(nd), m),
            )
        })
        .prop_filter("layouts whose partials commute", |(_, _, src, dst)| {
            commute(src) && commute(dst)
        })
        .prop_map(|(mesh_shape, global_shape, src, dst)| Case {
            mesh_shape,
            global_shape,
            src,
            dst,
        })
}

/// The collective a single-dim change issues according to the transition table, when the
/// change is legal on its own (no later mesh dim shards the tensor dims it touches).
fn table_collective(case: &Case) -> Option<Option<OpKind>> {
    let changed: Vec<usize> = (0..case.src.len())
        .filter(|&i| case.src[i] != case.dst[i])
        .collect();
    let [i] = changed[..] else {
        return None;
    };
    let later_shards = |d: usize| case.src[i + 1..].contains(&Placement::Shard(d));
    use Placement::{Partial, Replicate, Shard};
    match (case.src[i], case.dst[i]) {
        (Shard(d), Replicate) if !later_shards(d) => Some(Some(OpKind::AllGather)),
        (Partial(_), Replicate) => Some(Some(OpKind::AllReduce)),
        (Partial(_), Shard(d)) if !later_shards(d) => Some(Some(OpKind::ReduceScatter)),
        (Shard(d), Shard(e)) if !later_shards(d) && !later_shards(e) => {
            Some(Some(OpKind::AllToAll))
        }
        (Replicate, Shard(d)) if !later_shards(d) => Some(None),
        (Replicate, Partial(_)) => Some(None),
        (Shard(d), Partial(ReduceOp::Sum)) if !later_shards(d) => Some(None),
        _ => None,
    }
}

#[derive(Debug)]
struct Done {
    coordinate: Vec<usize>,
    plan: Vec<(usize, OpKind)>,
    counts: BTreeMap<OpKind, u64>,
    dst_local: Snapshot,
    dst_full: Snapshot,
    back_local: Snapshot,
    back_full: Snapshot,
    borrowed_back_local: Snapshot,
    source_after: Snapshot,
}

#[derive(Debug)]
enum Outcome {
    PartialChange,
    Done(Box<Done>),
}

fn run_case(case: &Case) -> Vec<Outcome> {
    let shared = case.clone();
    on_mesh(&case.mesh_shape, &[], move |ctx| {
        let case = &shared;
        let full = full_tensor(&case.global_shape);
        let coordinate = ctx.mesh.coordinate().to_vec();
        let local = expected_local(&full, &case.mesh_shape, &case.src, &coordinate);
        let x = DTensor::from_local(local, &ctx.mesh, &case.src, Some(&case.global_shape))?;
        ctx.reset();
        let y = match x.redistribute(&case.dst) {
            Err(Error::PartialOpChange { .. }) => return Ok(Outcome::PartialChange),
            other => other?,
        };
        let counts = ctx.counts();
        let plan = x.plan_to(&case.dst)?.collectives();
        let dst_full = Snapshot::of(&y.full_tensor()?);
        let dst_local = Snapshot::of(y.to_local());
        // Borrowing from collective memory: lent to the collectives where no padding is
        // needed, copied where it is; either way `y` must be left as it was.
        let borrowed_back = y.redistribute(&case.src)?;
        let source_after = Snapshot::of(y.to_local());
        // Consuming: buffers that came out of collectives go back into them uncopied.
        let back = y.into_redistribute(&case.src)?;
        Ok(Outcome::Done(Box::new(Done {
            coordinate,
            plan,
            counts,
            dst_local,
            dst_full,
            back_local: Snapshot::of(back.to_local()),
            back_full: Snapshot::of(&back.full_tensor()?),
            borrowed_back_local: Snapshot::of(borrowed_back.to_local()),
            source_after,
        })))
    })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    #[test]
    fn redistribute_preserves_the_global_tensor(case in cases()) {
        let full = Snapshot::of(&full_tensor(&case.global_shape));
        let partial_change = case.src.iter().zip(&case.dst).any(|pair| matches!(
            pair,
            (Placement::Partial(a), Placement::Partial(b)) if a != b
        ));
        for outcome in run_case(&case) {
            let Outcome::Done(done) = outcome else {
                prop_assert!(partial_change, "unexpected PartialOpChange for {case:?}");
                continue;
            };
            prop_assert!(!partial_change);
            let Done { coordinate, plan, counts, dst_local, dst_full, back_local, back_full, borrowed_back_local, source_after } = *done;
            prop_assert_eq!(&source_after, &dst_local, "a borrowing redistribute changed its source {:?}", case);
            prop_assert_eq!(&borrowed_back_local, &back_local, "borrowing vs consuming round trip {:?}", case);
            prop_assert_eq!(&dst_full, &full, "full tensor after {:?}", case);
            prop_assert_eq!(&back_full, &full, "full tensor after the round trip {:?}", case);
            // Local shards are the torch.chunk blocks.
            if case.dst.iter().all(|p| p.partial_op().is_none()) {
                let expected = expected_local(&full_tensor(&case.global_shape), &case.mesh_shape, &case.dst, &coordinate);
                prop_assert_eq!(&dst_local, &Snapshot::of(&expected), "local block {:?} at {:?}", case, coordinate);
            }
            if case.src.iter().all(|p| p.partial_op().is_none()) {
                let expected = expected_local(&full_tensor(&case.global_shape), &case.mesh_shape, &case.src, &coordinate);
                prop_assert_eq!(&back_local, &Snapshot::of(&expected), "round trip {:?} at {:?}", case, coordinate);
            }
            // The collectives issued are exactly the plan's, and the table's for one change.
            let mut planned: BTreeMap<OpKind, u64> = BTreeMap::new();
            for (_, op) in &plan {
                *planned.entry(*op).or_default() += 1;
            }
            prop_assert_eq!(&counts, &planned, "collectives of {:?}", case);
            if let Some(expected) = table_collective(&case) {
                let table: BTreeMap<OpKind, u64> = expected.into_iter().map(|op| (op, 1)).collect();
                prop_assert_eq!(&counts, &table, "table collective of {:?}", case);
            }
        }
    }
}
