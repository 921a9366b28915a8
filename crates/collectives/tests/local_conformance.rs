//! The conformance suite on the local backend, plus the fault checks that need control over
//! when each rank acts (deadlines, abort).

use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use hypershard_collectives::conformance::{self, SuiteParams};
use hypershard_collectives::local::spawn_world_with;
use hypershard_collectives::{Buffer, CommConfig, Communicator, DType, Error, OpKind, ReduceOp};
use hypershard_testkit::{WORLD_SIZES, run_ranks};

/// A small segment so the "past two segments" size stays cheap in debug builds.
const SEGMENT_BYTES: usize = 16 * 1024;

fn world(size: usize, timeout: Duration) -> Vec<Arc<dyn Communicator>> {
    spawn_world_with(size, CommConfig::default().with_timeout(timeout)).unwrap()
}

#[test]
fn full_suite_on_every_world_size() {
    for size in WORLD_SIZES {
        let comms = world(size, Duration::from_secs(60));
        let reports = run_ranks(size, move |rank| {
            conformance::run_all(comms[rank].as_ref(), &SuiteParams::new(SEGMENT_BYTES))
        })
        .unwrap_or_else(|e| panic!("world {size}: {e}"));
        // Every rank checked the whole matrix (counts differ by a case or two between ranks:
        // a rank that opts out of a split checks less).
        for report in &reports {
            assert!(
                report.cases > 1000,
                "world {size}: only {} cases",
                report.cases
            );
        }
    }
}

#[test]
fn sixty_four_ranks() {
    let comms = world(64, Duration::from_secs(60));
    run_ranks(64, move |rank| {
        let comm = comms[rank].as_ref();
        let mut params = SuiteParams::new(SEGMENT_BYTES);
        params.dtypes = vec![DType::BF16];
        params.large_sizes = false;
        params.reduce_ops = vec![ReduceOp::Sum];
        conformance::run_all(comm, &params)
    })
    .unwrap();
}

#[test]
fn an_absent_rank_times_out_the_others() {
    let timeout = Duration::from_millis(300);
    let comms = world(4, timeout);
    let start = Instant::now();
    let counts = run_ranks(4, move |rank| {
        conformance::check_timeout_when_a_rank_is_absent(comms[rank].as_ref(), 2)
    })
    .unwrap();
    assert_eq!(counts, vec![1, 1, 0, 1]);
    // Within the deadline plus scheduling slack, never a hang.
    assert!(start.elapsed() < Duration::from_secs(10));
}

#[test]
fn the_first_to_time_out_names_the_missing_rank() {
    let comms = world(2, Duration::from_millis(100));
    match comms[0].all_reduce(Buffer::zeros(DType::F32, 4), ReduceOp::Sum) {
        Err(Error::Timeout { op, after, peer }) => {
            assert_eq!(op, OpKind::AllReduce);
            assert_eq!(after, Duration::from_millis(100));
            assert_eq!(peer, Some(1));
        }
        other => panic!("expected Timeout, got {other:?}"),
    }
    // The late rank finds the round abandoned and fails fast instead of waiting.
    let start = Instant::now();
    let late = comms[1].all_reduce(Buffer::zeros(DType::F32, 4), ReduceOp::Sum);
    assert!(
        matches!(late, Err(Error::PeerLost { peer: 0, .. })),
        "{late:?}"
    );
    assert!(start.elapsed() < Duration::from_secs(5));
}

#[test]
fn abort_fails_pending_work_and_peers_see_peer_lost() {
    let comms = world(3, Duration::from_secs(30));
    let aborted = Arc::new(Barrier::new(3));
    let outcomes = run_ranks(3, move |rank| {
        let comm = &comms[rank];
        comm.barrier()?;
        if rank == 0 {
            // Two ops the others never join: one running, one queued behind it.
            let running = comm.all_reduce_async(Buffer::zeros(DType::F32, 8), ReduceOp::Sum);
            let queued = comm.broadcast_async(Buffer::zeros(DType::F32, 8), 0);
            comm.abort();
            aborted.wait();
            let running = running.wait();
            let queued = queued.wait();
            let later = comm.barrier();
            assert!(comm.is_aborted());
            return Ok::<_, Error>(vec![
                matches!(running, Err(Error::Aborted { .. })),
                matches!(queued, Err(Error::Aborted { .. })),
                matches!(later, Err(Error::Aborted { .. })),
            ]);
        }
        aborted.wait();
        let start = Instant::now();
        let result = comm.all_reduce(Buffer::zeros(DType::F32, 8), ReduceOp::Sum);
        Ok(vec![
            matches!(result, Err(Error::PeerLost { peer: 0, .. })),
            // Fails fast: far inside the 30 s deadline.
            start.elapsed() < Duration::from_secs(10),
        ])
    })
    .unwrap();
    for (rank, flags) in outcomes.iter().enumerate() {
        assert!(flags.iter().all(|&ok| ok), "rank {rank}: {flags:?}");
    }
}

#[test]
fn different_ops_at_the_same_position_fail_on_every_rank() {
    let comms = world(3, Duration::from_secs(30));
    let errors = run_ranks(3, move |rank| {
        let comm = &comms[rank];
        let result = if rank == 2 {
            comm.broadcast(Buffer::zeros(DType::F32, 4), 0).map(drop)
        } else {
            comm.all_reduce(Buffer::zeros(DType::F32, 4), ReduceOp::Sum)
                .map(drop)
        };
        // The group stays usable for the next collective.
        let sum = comm.all_reduce(Buffer::from_vec(vec![1i32]), ReduceOp::Sum)?;
        Ok::<_, Error>((result.err().map(|e| e.to_string()), sum.into_vec::<i32>()?))
    })
    .unwrap();
    for (rank, (error, sum)) in errors.into_iter().enumerate() {
        let error = error.unwrap_or_else(|| panic!("rank {rank} succeeded"));
        assert!(error.contains("collective #0"), "rank {rank}: {error}");
        assert_eq!(sum, vec![3]);
    }
}

#[test]
fn bad_arguments_on_one_rank_reach_every_rank() {
    let comms = world(3, Duration::from_secs(30));
    let errors = run_ranks(3, move |rank| {
        let comm = &comms[rank];
        let root = if rank == 1 { 9 } else { 0 };
        let bad_root = comm.broadcast(Buffer::zeros(DType::U8, 2), root).err();
        let avg_int = comm
            .all_reduce(Buffer::from_vec(vec![1i64, 2]), ReduceOp::Avg)
            .err();
        let counts = if rank == 0 { vec![1, 1] } else { vec![1, 1, 1] };
        let bad_counts = comm
            .all_gather_v(
                Buffer::zeros(DType::F64, 1),
                Buffer::zeros(DType::F64, 3),
                counts,
            )
            .err();
        Ok::<_, Error>((bad_root, avg_int, bad_counts))
    })
    .unwrap();
    for (rank, (bad_root, avg_int, bad_counts)) in errors.into_iter().enumerate() {
        assert!(
            matches!(
                bad_root,
                Some(Error::InvalidRank {
                    rank: 9,
                    size: 3,
                    ..
                })
            ),
            "rank {rank}: {bad_root:?}"
        );
        assert!(
            matches!(
                avg_int,
                Some(Error::UnsupportedOp {
                    op: ReduceOp::Avg,
                    dtype: DType::I64
                })
            ),
            "rank {rank}: {avg_int:?}"
        );
        assert!(
            matches!(bad_counts, Some(Error::LengthMismatch { .. })),
            "rank {rank}: {bad_counts:?}"
        );
    }
}

#[test]
fn nested_splits_run_concurrently_with_their_parents() {
    let comms = world(8, Duration::from_secs(30));
    let sums = run_ranks(8, move |rank| {
        let world = &comms[rank];
        // 2 × 4 layout: rows of 4 and columns of 2, like an HSDP mesh.
        let row = world
            .split(Some((rank / 4) as u32), rank as i64)?
            .ok_or(Error::InvalidWorldSize { size: 0 })?;
        let col = world
            .split(Some((rank % 4) as u32), rank as i64)?
            .ok_or(Error::InvalidWorldSize { size: 0 })?;
        let half = row
            .split(Some((row.rank() / 2) as u32), 0)?
            .ok_or(Error::InvalidWorldSize { size: 0 })?;
        let v = || Buffer::from_vec(vec![rank as i64]);
        let works = [
            row.all_reduce_async(v(), ReduceOp::Sum),
            col.all_reduce_async(v(), ReduceOp::Sum),
            half.all_reduce_async(v(), ReduceOp::Sum),
            world.all_reduce_async(v(), ReduceOp::Sum),
        ];
        works
            .into_iter()
            .map(|w| Ok(w.wait()?.into_vec::<i64>()?[0]))
            .collect::<Result<Vec<i64>, Error>>()
    })
    .unwrap();
    for (rank, got) in sums.into_iter().enumerate() {
        let r = rank as i64;
        let row: i64 = (0..4).map(|i| (r / 4) * 4 + i).sum();
        let col = (r % 4) + (r % 4 + 4);
        let half_start = (r / 2) * 2;
        assert_eq!(
            got,
            vec![row, col, half_start + half_start + 1, 28],
            "rank {rank}"
        );
    }
}
