//! Which NCCL calls an op makes, with every length checked before any of them is made.
//!
//! NCCL trusts its arguments: a count larger than a buffer reads or writes past it, and ranks
//! that disagree hang. So each op is first turned into a list of [`Call`]s over [`Span`]s of
//! its buffers, from this rank's lengths alone, and [`check_spans`] proves every span lies
//! inside its buffer before the FFI layer turns spans into device pointers. Ops NCCL has no
//! primitive for are built from the ones it has inside one group: uneven all-gather from a
//! broadcast per rank, uneven reduce-scatter from a reduce per rank, gather/scatter/all-to-all
//! from point-to-point sends and receives.

use crate::error::{Error, Result};
use crate::op::{AllToAllCounts, BufferRole, OpKind, block_offsets};

/// Which of an op's buffers a span is in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Side {
    /// The input (or the only, in-place buffer).
    Input,
    /// The output.
    Output,
}

/// `count` elements from element `offset` of one of the op's buffers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Span {
    pub side: Side,
    pub offset: usize,
    pub count: usize,
}

impl Span {
    fn input(offset: usize, count: usize) -> Span {
        Span {
            side: Side::Input,
            offset,
            count,
        }
    }

    fn output(offset: usize, count: usize) -> Span {
        Span {
            side: Side::Output,
            offset,
            count,
        }
    }
}

/// One NCCL call. Counts are the spans' counts (NCCL's `count` argument is `recv.count` for
/// broadcast, `send.count` for all-gather and reduce, `recv.count` for reduce-scatter).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Call {
    /// `ncclAllReduce`, in place.
    AllReduce { data: Span },
    /// `ncclAllGather` of `send.count` elements per rank.
    AllGather { send: Span, recv: Span },
    /// `ncclReduceScatter` of `recv.count` elements per rank.
    ReduceScatter { send: Span, recv: Span },
    /// `ncclBroadcast` of `recv.count` elements (`send` is read on the root only).
    Broadcast { root: usize, send: Span, recv: Span },
    /// `ncclReduce` of `send.count` elements (`recv` is written on the root only).
    Reduce { root: usize, send: Span, recv: Span },
    /// `ncclSend`.
    Send { peer: usize, data: Span },
    /// `ncclRecv`.
    Recv { peer: usize, data: Span },
}

/// An op and its scalar arguments, as far as planning needs them.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Request<'a> {
    AllReduce,
    AllGather,
    AllGatherV(&'a [usize]),
    ReduceScatter,
    ReduceScatterV(&'a [usize]),
    Broadcast { root: usize },
    Reduce { root: usize },
    Gather { root: usize },
    Scatter { root: usize },
    AllToAll,
    AllToAllV(&'a AllToAllCounts),
    Send { peer: usize },
    Recv { peer: usize },
}

impl Request<'_> {
    /// The op's kind, for errors and spans.
    pub fn kind(&self) -> OpKind {
        match self {
            Request::AllReduce => OpKind::AllReduce,
            Request::AllGather => OpKind::AllGather,
            Request::AllGatherV(_) => OpKind::AllGatherV,
            Request::ReduceScatter => OpKind::ReduceScatter,
            Request::ReduceScatterV(_) => OpKind::ReduceScatterV,
            Request::Broadcast { .. } => OpKind::Broadcast,
            Request::Reduce { .. } => OpKind::Reduce,
            Request::Gather { .. } => OpKind::Gather,
            Request::Scatter { .. } => OpKind::Scatter,
            Request::AllToAll => OpKind::AllToAll,
            Request::AllToAllV(_) => OpKind::AllToAllV,
            Request::Send { .. } => OpKind::Send,
            Request::Recv { .. } => OpKind::Recv,
        }
    }
}

/// The element counts of this rank's buffers (`output` is 0 for the in-place ops).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Shape {
    pub input: usize,
    pub output: usize,
}

/// This rank's place in its group.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Place {
    pub rank: usize,
    pub size: usize,
}

/// The calls of `request` on this rank, or the first length, count or rank error.
///
/// `place.rank < place.size` (the communicator's own place), so indexing a count list that
/// was checked to have `size` entries by `rank` is in bounds.
pub(crate) fn plan(request: Request<'_>, shape: Shape, place: Place) -> Result<Vec<Call>> {
    let op = request.kind();
    let Place { rank, size } = place;
    let n = shape.input;
    let length = |role: BufferRole, expected: usize, got: usize| -> Result<()> {
        if expected == got {
            Ok(())
        } else {
            Err(Error::LengthMismatch {
                op,
                role,
                expected,
                got,
            })
        }
    };
    let check_rank = |rank: usize| -> Result<()> {
        if rank < size {
            Ok(())
        } else {
            Err(Error::InvalidRank { op, rank, size })
        }
    };
    let total = |counts: &[usize], role: BufferRole| -> Result<usize> {
        counts
            .iter()
            .try_fold(0usize, |sum, &c| sum.checked_add(c))
            .ok_or(Error::LengthMismatch {
                op,
                role,
                expected: usize::MAX,
                got: counts.len(),
            })
    };
    let blocks = |count: usize| -> Result<usize> {
        count.checked_mul(size).ok_or(Error::LengthMismatch {
            op,
            role: BufferRole::Input,
            expected: usize::MAX,
            got: count,
        })
    };
    let mut calls = Vec::new();
    match request {
        Request::AllReduce => {
            if n > 0 {
                calls.push(Call::AllReduce {
                    data: Span::input(0, n),
                });
            }
        }
        Request::AllGather => {
            length(BufferRole::Output, blocks(n)?, shape.output)?;
            if n > 0 {
                calls.push(Call::AllGather {
                    send: Span::input(0, n),
                    recv: Span::output(0, shape.output),
                });
            }
        }
        Request::AllGatherV(counts) => {
            length(BufferRole::Counts, size, counts.len())?;
            length(BufferRole::Input, counts[rank], n)?;
            length(
                BufferRole::Output,
                total(counts, BufferRole::Counts)?,
                shape.output,
            )?;
            for (root, (&count, offset)) in counts.iter().zip(block_offsets(counts)).enumerate() {
                if count > 0 {
                    let send = Span::input(0, if root == rank { count } else { 0 });
                    calls.push(Call::Broadcast {
                        root,
                        send,
                        recv: Span::output(offset, count),
                    });
                }
            }
        }
        Request::ReduceScatter => {
            let m = shape.output;
            length(BufferRole::Input, blocks(m)?, n)?;
            if m > 0 {
                calls.push(Call::ReduceScatter {
                    send: Span::input(0, n),
                    recv: Span::output(0, m),
                });
            }
        }
        Request::ReduceScatterV(counts) => {
            length(BufferRole::Counts, size, counts.len())?;
            length(BufferRole::Input, total(counts, BufferRole::Counts)?, n)?;
            length(BufferRole::Output, counts[rank], shape.output)?;
            for (root, (&count, offset)) in counts.iter().zip(block_offsets(counts)).enumerate() {
                if count > 0 {
                    let recv = Span::output(0, if root == rank { count } else { 0 });
                    calls.push(Call::Reduce {
                        root,
                        send: Span::input(offset, count),
                        recv,
                    });
                }
            }
        }
        Request::Broadcast { root } => {
            check_rank(root)?;
            if n > 0 {
                calls.push(Call::Broadcast {
                    root,
                    send: Span::input(0, n),
                    recv: Span::input(0, n),
                });
            }
        }
        Request::Reduce { root } => {
            check_rank(root)?;
            if n > 0 {
                calls.push(Call::Reduce {
                    root,
                    send: Span::input(0, n),
                    recv: Span::input(0, n),
                });
            }
        }
        Request::Gather { root } => {
            check_rank(root)?;
            if rank == root {
                length(BufferRole::Output, blocks(n)?, shape.output)?;
            }
            if n > 0 {
                calls.push(Call::Send {
                    peer: root,
                    data: Span::input(0, n),
                });
                if rank == root {
                    for peer in 0..size {
                        calls.push(Call::Recv {
                            peer,
                            data: Span::output(peer * n, n),
                        });
                    }
                }
            }
        }
        Request::Scatter { root } => {
            check_rank(root)?;
            let m = shape.output;
            if rank == root {
                length(BufferRole::Input, blocks(m)?, n)?;
            }
            if m > 0 {
                if rank == root {
                    for peer in 0..size {
                        calls.push(Call::Send {
                            peer,
                            data: Span::input(peer * m, m),
                        });
                    }
                }
                calls.push(Call::Recv {
                    peer: root,
                    data: Span::output(0, m),
                });
            }
        }
        Request::AllToAll => {
            let block = n / size;
            length(BufferRole::Input, blocks(block)?, n)?;
            length(BufferRole::Output, n, shape.output)?;
            if block > 0 {
                for peer in 0..size {
                    calls.push(Call::Send {
                        peer,
                        data: Span::input(peer * block, block),
                    });
                    calls.push(Call::Recv {
                        peer,
                        data: Span::output(peer * block, block),
                    });
                }
            }
        }
        Request::AllToAllV(counts) => {
            length(BufferRole::SendCounts, size, counts.send.len())?;
            length(BufferRole::RecvCounts, size, counts.recv.len())?;
            length(
                BufferRole::Input,
                total(&counts.send, BufferRole::SendCounts)?,
                n,
            )?;
            length(
                BufferRole::Output,
                total(&counts.recv, BufferRole::RecvCounts)?,
                shape.output,
            )?;
            let send_offsets = block_offsets(&counts.send);
            let recv_offsets = block_offsets(&counts.recv);
            for peer in 0..size {
                if counts.send[peer] > 0 {
                    calls.push(Call::Send {
                        peer,
                        data: Span::input(send_offsets[peer], counts.send[peer]),
                    });
                }
                if counts.recv[peer] > 0 {
                    calls.push(Call::Recv {
                        peer,
                        data: Span::output(recv_offsets[peer], counts.recv[peer]),
                    });
                }
            }
        }
        Request::Send { peer } => {
            check_rank(peer)?;
            if n > 0 {
                calls.push(Call::Send {
                    peer,
                    data: Span::input(0, n),
                });
            }
        }
        Request::Recv { peer } => {
            check_rank(peer)?;
            if n > 0 {
                calls.push(Call::Recv {
                    peer,
                    data: Span::input(0, n),
                });
            }
        }
    }
    check_spans(op, &calls, shape)?;
    Ok(calls)
}

/// Every span of every call, in call order.
pub(crate) fn spans(call: &Call) -> Vec<Span> {
    match *call {
        Call::AllReduce { data } | Call::Send { data, .. } | Call::Recv { data, .. } => vec![data],
        Call::AllGather { send, recv }
        | Call::ReduceScatter { send, recv }
        | Call::Broadcast { send, recv, .. }
        | Call::Reduce { send, recv, .. } => vec![send, recv],
    }
}

/// Which buffers an op's calls touch (spans of zero elements touch nothing).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Usage {
    pub input_used: bool,
    pub input_written: bool,
    pub output_used: bool,
    pub output_written: bool,
}

/// The [`Usage`] of `calls`.
pub(crate) fn usage(calls: &[Call]) -> Usage {
    let mut usage = Usage::default();
    for call in calls {
        let written = match *call {
            Call::AllReduce { data } | Call::Recv { data, .. } => Some(data),
            Call::AllGather { recv, .. }
            | Call::ReduceScatter { recv, .. }
            | Call::Broadcast { recv, .. }
            | Call::Reduce { recv, .. } => Some(recv),
            Call::Send { .. } => None,
        };
        for span in spans(call).into_iter().filter(|s| s.count > 0) {
            let writes = written == Some(span);
            match span.side {
                Side::Input => {
                    usage.input_used = true;
                    usage.input_written |= writes;
                }
                Side::Output => {
                    usage.output_used = true;
                    usage.output_written |= writes;
                }
            }
        }
    }
    usage
}

/// Fails with [`Error::LengthMismatch`] unless every span lies inside its buffer: the last
/// check before spans become device pointers.
pub(crate) fn check_spans(op: OpKind, calls: &[Call], shape: Shape) -> Result<()> {
    for span in calls.iter().flat_map(spans) {
        let (len, role) = match span.side {
            Side::Input => (shape.input, BufferRole::Input),
            Side::Output => (shape.output, BufferRole::Output),
        };
        let end = span.offset.checked_add(span.count);
        if end.is_none_or(|end| end > len) {
            return Err(Error::LengthMismatch {
                op,
                role,
                expected: end.unwrap_or(usize::MAX),
                got: len,
            });
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn place(rank: usize, size: usize) -> Place {
        Place { rank, size }
    }

    fn shape(input: usize, output: usize) -> Shape {
        Shape { input, output }
    }

    #[test]
    fn all_gather_checks_the_output_and_makes_one_call() {
        let calls = plan(Request::AllGather, shape(3, 12), place(1, 4)).unwrap();
        assert_eq!(
            calls,
            vec![Call::AllGather {
                send: Span::input(0, 3),
                recv: Span::output(0, 12)
            }]
        );
        match plan(Request::AllGather, shape(3, 11), place(1, 4)) {
            Err(Error::LengthMismatch {
                op: OpKind::AllGather,
                role: BufferRole::Output,
                expected: 12,
                got: 11,
            }) => {}
            other => panic!("expected an output length error, got {other:?}"),
        }
    }

    #[test]
    fn uneven_all_gather_is_one_broadcast_per_nonempty_rank() {
        let counts = [2, 0, 3];
        let calls = plan(Request::AllGatherV(&counts), shape(3, 5), place(2, 3)).unwrap();
        assert_eq!(
            calls,
            vec![
                Call::Broadcast {
                    root: 0,
                    send: Span::input(0, 0),
                    recv: Span::output(0, 2)
                },
                Call::Broadcast {
                    root: 2,
                    send: Span::input(0, 3),
                    recv: Span::output(2, 3)
                },
            ]
        );
        assert!(matches!(
            plan(Request::AllGatherV(&counts[..2]), shape(3, 5), place(2, 3)),
            Err(Error::LengthMismatch {
                role: BufferRole::Counts,
                expected: 3,
                got: 2,
                ..
            })
        ));
        assert!(matches!(
            plan(Request::AllGatherV(&counts), shape(2, 5), place(2, 3)),
            Err(Error::LengthMismatch {
                role: BufferRole::Input,
                expected: 3,
                got: 2,
                ..
            })
        ));
    }

    #[test]
    fn uneven_reduce_scatter_reduces_each_block_to_its_owner() {
        let counts = [1, 4];
        let calls = plan(Request::ReduceScatterV(&counts), shape(5, 1), place(0, 2)).unwrap();
        assert_eq!(
            calls,
            vec![
                Call::Reduce {
                    root: 0,
                    send: Span::input(0, 1),
                    recv: Span::output(0, 1)
                },
                Call::Reduce {
                    root: 1,
                    send: Span::input(1, 4),
                    recv: Span::output(0, 0)
                },
            ]
        );
    }

    #[test]
    fn all_to_all_v_pairs_sends_and_receives_at_prefix_offsets() {
        let counts = AllToAllCounts {
            send: vec![1, 0, 2],
            recv: vec![3, 1, 0],
        };
        let calls = plan(Request::AllToAllV(&counts), shape(3, 4), place(1, 3)).unwrap();
        assert_eq!(
            calls,
            vec![
                Call::Send {
                    peer: 0,
                    data: Span::input(0, 1)
                },
                Call::Recv {
                    peer: 0,
                    data: Span::output(0, 3)
                },
                Call::Recv {
                    peer: 1,
                    data: Span::output(3, 1)
                },
                Call::Send {
                    peer: 2,
                    data: Span::input(1, 2)
                },
            ]
        );
        assert!(matches!(
            plan(Request::AllToAllV(&counts), shape(3, 5), place(1, 3)),
            Err(Error::LengthMismatch {
                role: BufferRole::Output,
                expected: 4,
                got: 5,
                ..
            })
        ));
    }

    #[test]
    fn rooted_ops_check_the_root_and_only_the_root_checks_its_big_buffer() {
        assert!(matches!(
            plan(Request::Broadcast { root: 4 }, shape(3, 0), place(0, 4)),
            Err(Error::InvalidRank {
                op: OpKind::Broadcast,
                rank: 4,
                size: 4
            })
        ));
        // A non-root gather may pass any output; the root's must hold size × n.
        assert_eq!(
            plan(Request::Gather { root: 0 }, shape(2, 0), place(1, 2))
                .unwrap()
                .len(),
            1
        );
        let root = plan(Request::Gather { root: 0 }, shape(2, 4), place(0, 2)).unwrap();
        assert_eq!(root.len(), 3, "a send to itself and a receive per rank");
        assert!(plan(Request::Gather { root: 0 }, shape(2, 3), place(0, 2)).is_err());
        let scatter = plan(Request::Scatter { root: 1 }, shape(6, 3), place(1, 2)).unwrap();
        assert_eq!(
            scatter,
            vec![
                Call::Send {
                    peer: 0,
                    data: Span::input(0, 3)
                },
                Call::Send {
                    peer: 1,
                    data: Span::input(3, 3)
                },
                Call::Recv {
                    peer: 1,
                    data: Span::output(0, 3)
                },
            ]
        );
    }

    #[test]
    fn usage_marks_what_calls_read_and_write() {
        let calls = plan(Request::AllGather, shape(2, 4), place(0, 2)).unwrap();
        assert_eq!(
            usage(&calls),
            Usage {
                input_used: true,
                input_written: false,
                output_used: true,
                output_written: true
            }
        );
        let calls = plan(Request::AllReduce, shape(2, 0), place(0, 2)).unwrap();
        let all_reduce = usage(&calls);
        assert!(all_reduce.input_written && !all_reduce.output_used);
        // A non-root rank of an uneven all-gather with nothing to send reads no input.
        let counts = [0, 3];
        let calls = plan(Request::AllGatherV(&counts), shape(0, 3), place(0, 2)).unwrap();
        assert!(!usage(&calls).input_used);
    }

    #[test]
    fn empty_ops_make_no_calls() {
        for request in [
            Request::AllReduce,
            Request::Send { peer: 0 },
            Request::AllToAll,
        ] {
            assert!(plan(request, shape(0, 0), place(0, 2)).unwrap().is_empty());
        }
    }

    #[test]
    fn every_planned_span_lies_inside_its_buffer() {
        // Sweep small worlds and lengths: whatever plan accepts, check_spans accepts (plan
        // runs it too, so a bad span would have surfaced as an error, never as a call).
        for size in 1..=4 {
            for rank in 0..size {
                for n in 0..6 {
                    let counts: Vec<usize> = (0..size).map(|r| (r + n) % 3).collect();
                    let sum: usize = counts.iter().sum();
                    let a2a = AllToAllCounts {
                        send: counts.clone(),
                        recv: counts.iter().rev().copied().collect(),
                    };
                    let cases = [
                        (Request::AllReduce, shape(n, 0)),
                        (Request::AllGather, shape(n, n * size)),
                        (Request::AllGatherV(&counts), shape(counts[rank], sum)),
                        (Request::ReduceScatter, shape(n * size, n)),
                        (Request::ReduceScatterV(&counts), shape(sum, counts[rank])),
                        (Request::Gather { root: 0 }, shape(n, n * size)),
                        (Request::Scatter { root: size - 1 }, shape(n * size, n)),
                        (Request::AllToAll, shape(n * size, n * size)),
                        (Request::AllToAllV(&a2a), shape(sum, sum)),
                    ];
                    for (request, shape) in cases {
                        let calls = plan(request, shape, place(rank, size)).unwrap();
                        check_spans(request.kind(), &calls, shape).unwrap();
                    }
                }
            }
        }
        let bad = [Call::Send {
            peer: 0,
            data: Span::input(2, 2),
        }];
        assert!(matches!(
            check_spans(OpKind::Send, &bad, shape(3, 0)),
            Err(Error::LengthMismatch {
                expected: 4,
                got: 3,
                ..
            })
        ));
    }
}
