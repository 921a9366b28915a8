//! A few redistributes on the TCP backend (every rank a thread of this process, talking over
//! 127.0.0.1), with the same first-principles checks as on the local backend.

use std::sync::Arc;
use std::time::Duration;

use hypershard_dtensor::collectives::tcp::{TcpCommunicator, TcpConfig};
use hypershard_dtensor::collectives::{CommConfig, Communicator, MemoryStore, OpKind, Store};
use hypershard_dtensor::{DTensor, Placement, ReduceOp};
use hypershard_testkit::run_ranks;

use crate::common::{Snapshot, expected_local, full_tensor, on_comms};

fn tcp_world(size: usize) -> Vec<Arc<dyn Communicator>> {
    let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
    // Small segments so that every message spans several frames.
    let tcp = TcpConfig::default()
        .with_segment_bytes(512)
        .with_rendezvous_timeout(Duration::from_secs(20));
    let config = CommConfig::default().with_timeout(Duration::from_secs(30));
    run_ranks(size, move |rank| {
        TcpCommunicator::connect(store.as_ref(), rank, size, &tcp, config.clone())
            .map(|comm| Arc::new(comm) as Arc<dyn Communicator>)
    })
    .expect("tcp world")
}

const R: Placement = Placement::Replicate;
const S0: Placement = Placement::Shard(0);
const S1: Placement = Placement::Shard(1);
const PSUM: Placement = Placement::Partial(ReduceOp::Sum);

fn run_transitions(
    mesh_shape: &'static [usize],
    transitions: &'static [(
        &'static [Placement],
        &'static [Placement],
        &'static [OpKind],
    )],
) {
    let world: usize = mesh_shape.iter().product();
    let shape: &'static [usize] = &[11, 6];
    let out = on_comms(tcp_world(world), mesh_shape, &[], move |ctx| {
        let full = full_tensor(shape);
        let coordinate = ctx.mesh.coordinate().to_vec();
        let mut rows = Vec::new();
        for &(src, dst, _) in transitions {
            let local = expected_local(&full, mesh_shape, src, &coordinate);
            let x = DTensor::from_local(local, &ctx.mesh, src, Some(shape))?;
            ctx.reset();
            let y = x.redistribute(dst)?;
            let counts = ctx.counts();
            rows.push((
                Snapshot::of(y.to_local()),
                Snapshot::of(&y.full_tensor()?),
                counts,
            ));
        }
        Ok((coordinate, rows))
    });
    let full = full_tensor(shape);
    for (coordinate, rows) in out {
        for (&(src, dst, ops), (local, y_full, counts)) in transitions.iter().zip(rows) {
            assert_eq!(y_full, Snapshot::of(&full), "{src:?} -> {dst:?}");
            if dst.iter().all(|p| p.partial_op().is_none()) {
                let expected = expected_local(&full, mesh_shape, dst, &coordinate);
                assert_eq!(
                    local,
                    Snapshot::of(&expected),
                    "{src:?} -> {dst:?} at {coordinate:?}"
                );
            }
            let issued: Vec<OpKind> = counts
                .iter()
                .flat_map(|(&op, &n)| std::iter::repeat_n(op, n as usize))
                .collect();
            let mut wanted = ops.to_vec();
            wanted.sort();
            assert_eq!(issued, wanted, "{src:?} -> {dst:?}");
        }
    }
}

#[test]
fn one_d_transitions_on_three_tcp_ranks() {
    run_transitions(
        &[3],
        &[
            (&[S0], &[R], &[OpKind::AllGather]),
            (&[PSUM], &[S0], &[OpKind::ReduceScatter]),
            (&[PSUM], &[R], &[OpKind::AllReduce]),
            (&[S0], &[S1], &[OpKind::AllToAll]),
            (&[R], &[S1], &[]),
        ],
    );
}

#[test]
fn nested_transitions_on_a_two_by_two_tcp_mesh() {
    run_transitions(
        &[2, 2],
        &[
            (&[S0, S0], &[R, R], &[OpKind::AllGather, OpKind::AllGather]),
            (&[S0, S1], &[S1, S0], &[OpKind::AllGather, OpKind::AllToAll]),
            (
                &[PSUM, S1],
                &[S0, R],
                &[OpKind::ReduceScatter, OpKind::AllGather],
            ),
        ],
    );
}

/// `S(0) -> S(1)` from collective memory (a staging tensor, as factories and collectives
/// make): where a rank holds a whole chunk of rows and the columns split evenly, it sends its
/// columns straight from its rows (the strided all-to-all), otherwise it packs; ranks of both
/// kinds mix in one op ([11, 6]: the last of three ranks holds 3 rows, not 4). Borrowing and
/// consuming forms, a 3-d tensor, and one all-to-all each time.
#[test]
fn shard_to_shard_from_collective_memory_reads_rows_in_place() {
    use hypershard_dtensor::bridge::staging_tensor;
    let shapes: &'static [&'static [usize]] = &[&[12, 6], &[11, 6], &[6, 9, 5]];
    let out = on_comms(tcp_world(3), &[3], &[], move |ctx| {
        let coordinate = ctx.mesh.coordinate().to_vec();
        let mut rows = Vec::new();
        for &shape in shapes {
            let full = full_tensor(shape);
            let expected = expected_local(&full, &[3], &[S0], &coordinate);
            for consume in [false, true] {
                let local = staging_tensor(expected.shape(), expected.dtype())?;
                local.copy_from(&expected)?;
                let x = DTensor::from_local(local, &ctx.mesh, &[S0], Some(shape))?;
                ctx.reset();
                let y = if consume {
                    x.into_redistribute(&[S1])?
                } else {
                    let y = x.redistribute(&[S1])?;
                    // The source is untouched by the in-place read.
                    assert_eq!(Snapshot::of(x.to_local()), Snapshot::of(&expected));
                    y
                };
                let counts = ctx.counts();
                rows.push((
                    shape,
                    Snapshot::of(y.to_local()),
                    Snapshot::of(&y.full_tensor()?),
                    counts,
                ));
            }
        }
        Ok((coordinate, rows))
    });
    for (coordinate, rows) in out {
        for (shape, local, y_full, counts) in rows {
            let full = full_tensor(shape);
            assert_eq!(y_full, Snapshot::of(&full), "{shape:?}");
            let expected = expected_local(&full, &[3], &[S1], &coordinate);
            assert_eq!(
                local,
                Snapshot::of(&expected),
                "{shape:?} at {coordinate:?}"
            );
            let issued: Vec<OpKind> = counts
                .iter()
                .flat_map(|(&op, &n)| std::iter::repeat_n(op, n as usize))
                .collect();
            assert_eq!(issued, vec![OpKind::AllToAll], "{shape:?}");
        }
    }
}
