//! Names for operations and their arguments: reduce ops, op kinds, and the named outputs ops
//! hand back.

use std::fmt;

use crate::buffer::Buffer;

/// How a reducing collective combines the contributions of the ranks.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum ReduceOp {
    /// Element-wise sum. Integer sums wrap.
    Sum,
    /// Sum, then scale by `1 / size`. Floating-point dtypes only (an integer average is an
    /// [`Error::UnsupportedOp`](crate::Error::UnsupportedOp), as in NCCL).
    Avg,
    /// Element-wise maximum.
    Max,
    /// Element-wise minimum.
    Min,
    /// Element-wise product. Integer products wrap.
    Product,
    /// Multiply every contribution by the factor, then sum (NCCL's `ncclRedOpCreatePreMulSum`).
    /// Floating-point dtypes only.
    PreMulSum(f64),
}

impl ReduceOp {
    /// Every reduce op with a representative `PreMulSum` factor (handy for exhaustive tests).
    pub const ALL: [ReduceOp; 6] = [
        ReduceOp::Sum,
        ReduceOp::Avg,
        ReduceOp::Max,
        ReduceOp::Min,
        ReduceOp::Product,
        ReduceOp::PreMulSum(0.5),
    ];

    /// The op's name without its factor.
    pub const fn name(self) -> &'static str {
        match self {
            ReduceOp::Sum => "sum",
            ReduceOp::Avg => "avg",
            ReduceOp::Max => "max",
            ReduceOp::Min => "min",
            ReduceOp::Product => "product",
            ReduceOp::PreMulSum(_) => "premul_sum",
        }
    }
}

impl fmt::Display for ReduceOp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ReduceOp::PreMulSum(factor) => write!(f, "premul_sum({factor})"),
            other => f.write_str(other.name()),
        }
    }
}

/// Which operation a [`Work`](crate::Work), error, span or counter refers to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[non_exhaustive]
pub enum OpKind {
    /// [`Communicator::all_reduce_async`](crate::Communicator::all_reduce_async).
    AllReduce,
    /// [`Communicator::all_gather_async`](crate::Communicator::all_gather_async).
    AllGather,
    /// [`Communicator::all_gather_v_async`](crate::Communicator::all_gather_v_async).
    AllGatherV,
    /// [`Communicator::reduce_scatter_async`](crate::Communicator::reduce_scatter_async).
    ReduceScatter,
    /// [`Communicator::reduce_scatter_v_async`](crate::Communicator::reduce_scatter_v_async).
    ReduceScatterV,
    /// [`Communicator::broadcast_async`](crate::Communicator::broadcast_async).
    Broadcast,
    /// [`Communicator::reduce_async`](crate::Communicator::reduce_async).
    Reduce,
    /// [`Communicator::gather_async`](crate::Communicator::gather_async).
    Gather,
    /// [`Communicator::scatter_async`](crate::Communicator::scatter_async).
    Scatter,
    /// [`Communicator::all_to_all_async`](crate::Communicator::all_to_all_async).
    AllToAll,
    /// [`Communicator::all_to_all_v_async`](crate::Communicator::all_to_all_v_async).
    AllToAllV,
    /// [`Communicator::send_async`](crate::Communicator::send_async).
    Send,
    /// [`Communicator::recv_async`](crate::Communicator::recv_async).
    Recv,
    /// [`Communicator::barrier_async`](crate::Communicator::barrier_async).
    Barrier,
    /// [`Communicator::split`](crate::Communicator::split).
    Split,
}

impl OpKind {
    /// Every op kind, in declaration order.
    pub const ALL: [OpKind; 15] = [
        OpKind::AllReduce,
        OpKind::AllGather,
        OpKind::AllGatherV,
        OpKind::ReduceScatter,
        OpKind::ReduceScatterV,
        OpKind::Broadcast,
        OpKind::Reduce,
        OpKind::Gather,
        OpKind::Scatter,
        OpKind::AllToAll,
        OpKind::AllToAllV,
        OpKind::Send,
        OpKind::Recv,
        OpKind::Barrier,
        OpKind::Split,
    ];

    /// The snake-case name used in spans, counters and messages.
    pub const fn as_str(self) -> &'static str {
        match self {
            OpKind::AllReduce => "all_reduce",
            OpKind::AllGather => "all_gather",
            OpKind::AllGatherV => "all_gather_v",
            OpKind::ReduceScatter => "reduce_scatter",
            OpKind::ReduceScatterV => "reduce_scatter_v",
            OpKind::Broadcast => "broadcast",
            OpKind::Reduce => "reduce",
            OpKind::Gather => "gather",
            OpKind::Scatter => "scatter",
            OpKind::AllToAll => "all_to_all",
            OpKind::AllToAllV => "all_to_all_v",
            OpKind::Send => "send",
            OpKind::Recv => "recv",
            OpKind::Barrier => "barrier",
            OpKind::Split => "split",
        }
    }

    /// Whether every rank of the group must take part (everything except send and recv).
    pub const fn is_collective(self) -> bool {
        !matches!(self, OpKind::Send | OpKind::Recv)
    }
}

impl fmt::Display for OpKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Which buffer or argument of an op an error is about.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum BufferRole {
    /// The op's input (or its only, in-place buffer).
    Input,
    /// The op's output buffer.
    Output,
    /// The per-rank `counts` of a `_v` op (its length must be the group size).
    Counts,
    /// The send counts of [`all_to_all_v`](crate::Communicator::all_to_all_v_async).
    SendCounts,
    /// The receive counts of [`all_to_all_v`](crate::Communicator::all_to_all_v_async).
    RecvCounts,
    /// A message that arrived for a receive.
    Message,
    /// The corresponding buffer of another rank, which disagrees with the reference rank.
    Peer {
        /// The rank whose buffer disagrees.
        rank: usize,
    },
}

impl fmt::Display for BufferRole {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            BufferRole::Input => f.write_str("input"),
            BufferRole::Output => f.write_str("output"),
            BufferRole::Counts => f.write_str("counts"),
            BufferRole::SendCounts => f.write_str("send counts"),
            BufferRole::RecvCounts => f.write_str("receive counts"),
            BufferRole::Message => f.write_str("incoming message"),
            BufferRole::Peer { rank } => write!(f, "rank {rank}'s buffer"),
        }
    }
}

/// A scalar argument that every rank of a collective must pass identically.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Argument {
    /// The root rank of a rooted collective.
    Root,
    /// The reduce op.
    ReduceOp,
    /// The per-rank counts of a `_v` op.
    Counts,
    /// A knob of the backend's configuration that decides which algorithm runs or how it
    /// cuts the data (the TCP backend's `TcpConfig`): ranks that disagree would run different
    /// exchanges, so every op fails on every rank instead.
    AlgorithmKnob(Knob),
}

/// A configuration knob every rank of a TCP group must set alike (see
/// [`Argument::AlgorithmKnob`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Knob {
    /// `TcpConfig::segment_bytes`.
    SegmentBytes,
    /// `TcpConfig::all_reduce`.
    AllReduceAlgorithm,
    /// `TcpConfig::small_all_reduce_bytes`.
    SmallAllReduceBytes,
    /// `TcpConfig::halving_doubling_bytes`.
    HalvingDoublingBytes,
    /// `TcpConfig::broadcast`.
    BroadcastAlgorithm,
    /// `TcpConfig::tree_broadcast_bytes`.
    TreeBroadcastBytes,
}

impl fmt::Display for Knob {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Knob::SegmentBytes => "segment_bytes",
            Knob::AllReduceAlgorithm => "all_reduce",
            Knob::SmallAllReduceBytes => "small_all_reduce_bytes",
            Knob::HalvingDoublingBytes => "halving_doubling_bytes",
            Knob::BroadcastAlgorithm => "broadcast",
            Knob::TreeBroadcastBytes => "tree_broadcast_bytes",
        })
    }
}

impl fmt::Display for Argument {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Argument::Root => f.write_str("root"),
            Argument::ReduceOp => f.write_str("reduce op"),
            Argument::Counts => f.write_str("counts"),
            Argument::AlgorithmKnob(knob) => write!(f, "TcpConfig::{knob} (algorithm knob)"),
        }
    }
}

/// The two buffers of an op with a separate input and output, handed back by
/// [`Work::wait`](crate::Work::wait).
#[derive(Debug)]
pub struct BufferPair {
    /// The input, unchanged.
    pub input: Buffer,
    /// The output, filled by the op.
    pub output: Buffer,
}

/// The per-peer element counts of
/// [`all_to_all_v`](crate::Communicator::all_to_all_v_async).
///
/// `send[j]` elements starting at `sum(send[..j])` of the input go to rank `j`; `recv[i]`
/// elements from rank `i` land at `sum(recv[..i])` of the output. Rank `i`'s `send[j]` must
/// equal rank `j`'s `recv[i]`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AllToAllCounts {
    /// Elements this rank sends to each peer, indexed by peer rank.
    pub send: Vec<usize>,
    /// Elements this rank receives from each peer, indexed by peer rank.
    pub recv: Vec<usize>,
}

/// The offsets of consecutive blocks of the given sizes: `offsets(&[2, 0, 3]) == [0, 2, 2]`.
pub fn block_offsets(counts: &[usize]) -> Vec<usize> {
    let mut offset = 0;
    counts
        .iter()
        .map(|count| {
            let start = offset;
            offset += count;
            start
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn offsets_are_prefix_sums() {
        assert_eq!(block_offsets(&[2, 0, 3]), vec![0, 2, 2]);
        assert!(block_offsets(&[]).is_empty());
    }

    #[test]
    fn names_are_snake_case() {
        assert_eq!(OpKind::AllGatherV.to_string(), "all_gather_v");
        assert_eq!(ReduceOp::PreMulSum(0.25).to_string(), "premul_sum(0.25)");
        assert!(!OpKind::Recv.is_collective());
        assert!(OpKind::Barrier.is_collective());
    }
}
