//! The suite's checks beyond the op matrix: async ordering, concurrent splits, mismatched
//! arguments, and the absent-rank timeout (which leaves the communicator out of step).

use super::*;

/// Issues several async ops, waits for them in reverse order, and checks every result and that
/// ops complete in issue order (when the last is done, all earlier ones are). Returns the
/// number of cases checked.
pub fn check_async_ordering(comm: &dyn Communicator) -> Result<usize, ConformanceFailure> {
    let mut checker = Checker {
        comm,
        rank: comm.rank(),
        size: comm.size(),
        cases: 0,
    };
    let (rank, size) = (checker.rank, checker.size);
    let dtype = DType::F32;
    let w0 = comm.all_reduce_async(buffer(dtype, 33, |i| value(rank, i)), ReduceOp::Sum);
    let w1 = comm.all_gather_async(
        buffer(dtype, 5, |i| value(rank, i)),
        Buffer::zeros(dtype, 5 * size),
    );
    let w2 = comm.broadcast_async(buffer(dtype, 9, |i| value(rank, i)), size - 1);
    let w3 = comm.all_reduce_async(buffer(DType::I64, 17, |i| value(rank, i)), ReduceOp::Max);
    let case3 = checker.case(OpKind::AllReduce, DType::I64, Some(ReduceOp::Max), 17);
    let out3 = w3.wait().map_err(checker.comm_err(case3))?;
    for (index, done) in [w0.is_completed(), w1.is_completed(), w2.is_completed()]
        .into_iter()
        .enumerate()
    {
        if !done {
            return Err(ConformanceFailure::Property {
                case: case3,
                rank,
                property: Property::IssueOrder { incomplete: index },
            });
        }
    }
    checker.check_elements(case3, &out3, DType::I64, 17, |i| {
        reduced(ReduceOp::Max, DType::I64, size, i)
    })?;
    let case2 = checker.case(OpKind::Broadcast, dtype, None, 9);
    let out2 = w2.wait().map_err(checker.comm_err(case2))?;
    checker.check_elements(case2, &out2, dtype, 9, |i| value(size - 1, i))?;
    let case1 = checker.case(OpKind::AllGather, dtype, None, 5);
    let out1 = w1.wait().map_err(checker.comm_err(case1))?;
    checker.check_elements(case1, &out1.output, dtype, 5 * size, |i| {
        value(i / 5, i % 5)
    })?;
    let case0 = checker.case(OpKind::AllReduce, dtype, Some(ReduceOp::Sum), 33);
    let out0 = w0.wait().map_err(checker.comm_err(case0))?;
    checker.check_elements(case0, &out0, dtype, 33, |i| {
        reduced(ReduceOp::Sum, dtype, size, i)
    })?;
    Ok(checker.cases)
}

/// Splits the group by parity of rank (keys reverse the order; with 3+ ranks the last rank opts
/// out), checks each member's new rank and size, then runs all-reduces on the child and the
/// parent concurrently and checks both.
pub fn check_split_concurrent(comm: &dyn Communicator) -> Result<usize, ConformanceFailure> {
    let (rank, size) = (comm.rank(), comm.size());
    let opted_out = |r: usize| size >= 3 && r == size - 1;
    let color = if opted_out(rank) {
        None
    } else {
        Some((rank % 2) as u32)
    };
    let case = Case {
        op: OpKind::Split,
        dtype: None,
        reduce: None,
        len: 0,
        world: size,
    };
    let child = comm
        .split(color, -(rank as i64))
        .map_err(|source| ConformanceFailure::Comm { case, rank, source })?;
    // Members of my color, ordered by key = -rank: the highest old rank becomes rank 0.
    let mut members: Vec<usize> = (0..size)
        .filter(|&r| !opted_out(r) && r % 2 == rank % 2)
        .collect();
    members.reverse();
    let mut checker = Checker {
        comm,
        rank,
        size,
        cases: 1,
    };
    let Some(child) = child else {
        if color.is_some() {
            return Err(ConformanceFailure::Property {
                case,
                rank,
                property: Property::SplitLayout {
                    expected_size: members.len(),
                    expected_rank: members.iter().position(|&r| r == rank).unwrap_or(0),
                    size: 0,
                    rank: 0,
                },
            });
        }
        // Still take part in the parent's all-reduce below.
        let parent_case = checker.case(OpKind::AllReduce, DType::F64, Some(ReduceOp::Sum), 64);
        let out = comm
            .all_reduce(buffer(DType::F64, 64, |i| value(rank, i)), ReduceOp::Sum)
            .map_err(checker.comm_err(parent_case))?;
        checker.check_elements(parent_case, &out, DType::F64, 64, |i| {
            reduced(ReduceOp::Sum, DType::F64, size, i)
        })?;
        return Ok(checker.cases);
    };
    let expected_rank = members
        .iter()
        .position(|&r| r == rank)
        .unwrap_or(usize::MAX);
    if child.size() != members.len() || child.rank() != expected_rank {
        return Err(ConformanceFailure::Property {
            case,
            rank,
            property: Property::SplitLayout {
                expected_size: members.len(),
                expected_rank,
                size: child.size(),
                rank: child.rank(),
            },
        });
    }
    // Child and parent ops in flight at the same time, on their own streams.
    let child_work = child.all_reduce_async(
        buffer(DType::F64, 4099, |i| (rank * 1000 + i) as f64),
        ReduceOp::Sum,
    );
    let parent_work =
        comm.all_reduce_async(buffer(DType::F64, 64, |i| value(rank, i)), ReduceOp::Sum);
    let child_case = Case {
        world: members.len(),
        ..checker.case(OpKind::AllReduce, DType::F64, Some(ReduceOp::Sum), 4099)
    };
    let child_out = child_work.wait().map_err(checker.comm_err(child_case))?;
    let member_sum: f64 = members.iter().map(|&r| (r * 1000) as f64).sum();
    let count = members.len() as f64;
    checker.check_elements(child_case, &child_out, DType::F64, 4099, |i| {
        member_sum + count * i as f64
    })?;
    let parent_case = checker.case(OpKind::AllReduce, DType::F64, Some(ReduceOp::Sum), 64);
    let parent_out = parent_work.wait().map_err(checker.comm_err(parent_case))?;
    checker.check_elements(parent_case, &parent_out, DType::F64, 64, |i| {
        reduced(ReduceOp::Sum, DType::F64, size, i)
    })?;
    Ok(checker.cases)
}

/// Mismatched lengths, dtypes and output sizes across ranks must fail on every rank with the
/// typed error (not hang), and the communicator must work afterwards. Needs 2+ ranks; returns
/// 0 cases on one rank.
pub fn check_mismatched_arguments(comm: &dyn Communicator) -> Result<usize, ConformanceFailure> {
    let (rank, size) = (comm.rank(), comm.size());
    if size < 2 {
        return Ok(0);
    }
    let mut checker = Checker {
        comm,
        rank,
        size,
        cases: 0,
    };
    let expect = |checker: &mut Checker<'_>,
                  case: Case,
                  expected: ExpectedError,
                  result: crate::Result<()>| {
        checker.cases += 1;
        let ok = matches!(
            (&result, expected),
            (
                Err(Error::LengthMismatch { .. }),
                ExpectedError::LengthMismatch
            ) | (
                Err(Error::DTypeMismatch { .. }),
                ExpectedError::DTypeMismatch
            )
        );
        if ok {
            Ok(())
        } else {
            Err(ConformanceFailure::WrongOutcome {
                case,
                rank,
                expected,
                got: Outcome(result.err()),
            })
        }
    };
    // The last rank passes one element more.
    let len = if rank == size - 1 { 5 } else { 4 };
    let case = checker.case(OpKind::AllReduce, DType::F32, Some(ReduceOp::Sum), len);
    let result = comm
        .all_reduce(buffer(DType::F32, len, |i| value(rank, i)), ReduceOp::Sum)
        .map(drop);
    expect(&mut checker, case, ExpectedError::LengthMismatch, result)?;
    // Rank 1 passes i32 where the others pass f32.
    let dtype = if rank == 1 { DType::I32 } else { DType::F32 };
    let case = checker.case(OpKind::AllGather, dtype, None, 3);
    let result = comm
        .all_gather(
            buffer(dtype, 3, |i| value(rank, i)),
            Buffer::zeros(dtype, 3 * size),
        )
        .map(drop);
    expect(&mut checker, case, ExpectedError::DTypeMismatch, result)?;
    // Rank 0's output is one element short: its own error is about its output, the others'
    // about rank 0's buffer.
    let out_len = if rank == 0 { 3 * size - 1 } else { 3 * size };
    let case = checker.case(OpKind::AllGather, DType::F32, None, 3);
    let result = comm
        .all_gather(
            buffer(DType::F32, 3, |i| value(rank, i)),
            Buffer::zeros(DType::F32, out_len),
        )
        .map(drop);
    if let Err(Error::LengthMismatch { role, .. }) = &result {
        let expected_role = if rank == 0 {
            BufferRole::Output
        } else {
            BufferRole::Peer { rank: 0 }
        };
        if *role != expected_role {
            return Err(ConformanceFailure::WrongOutcome {
                case,
                rank,
                expected: ExpectedError::LengthMismatch,
                got: Outcome(result.err()),
            });
        }
    }
    expect(&mut checker, case, ExpectedError::LengthMismatch, result)?;
    // Rank 0's strided rows run one element past its input: every rank fails (rank 0 on its
    // input, the others on rank 0's), and none sends the wrong bytes.
    let blocks = StridedBlocks {
        rows: 3,
        width: 2,
        stride: 2 * size,
        offsets: (0..size).map(|j| 2 * j).collect(),
    };
    let in_len = if rank == 0 { 6 * size - 1 } else { 6 * size };
    let case = checker.case(OpKind::AllToAll, DType::F32, None, in_len);
    let result = comm
        .all_to_all_strided(
            buffer(DType::F32, in_len, |i| value(rank, i)),
            Buffer::zeros(DType::F32, 6 * size),
            blocks,
        )
        .map(drop);
    expect(&mut checker, case, ExpectedError::LengthMismatch, result)?;
    // The group is still usable.
    checker.all_reduce(DType::F32, ReduceOp::Sum, 7)?;
    Ok(checker.cases)
}

/// Every rank but `absent` issues an all-reduce that `absent` never joins: each must fail with
/// [`Error::Timeout`] or [`Error::PeerLost`] within the communicator's deadline. Leaves the
/// communicator out of step: call it last, with a short [`CommConfig::timeout`](crate::CommConfig).
pub fn check_timeout_when_a_rank_is_absent(
    comm: &dyn Communicator,
    absent: usize,
) -> Result<usize, ConformanceFailure> {
    let rank = comm.rank();
    if rank == absent {
        return Ok(0);
    }
    let case = Case {
        op: OpKind::AllReduce,
        dtype: Some(DType::F32),
        reduce: Some(ReduceOp::Sum),
        len: 8,
        world: comm.size(),
    };
    match comm.all_reduce(buffer(DType::F32, 8, |i| value(rank, i)), ReduceOp::Sum) {
        Err(Error::Timeout { .. } | Error::PeerLost { .. }) => Ok(1),
        other => Err(ConformanceFailure::WrongOutcome {
            case,
            rank,
            expected: ExpectedError::TimeoutOrPeerLost,
            got: Outcome(other.err()),
        }),
    }
}
