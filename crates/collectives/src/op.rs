//! Names for operations and their arguments: reduce ops, op kinds, and the named outputs ops
//! hand back.

use std::fmt;

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

/// The send side of [`all_to_all_strided`](crate::Communicator::all_to_all_strided_async):
/// where each peer's block lies in the input, as rows read in place.
///
/// Block `j` (the one rank `j` receives) is `rows` rows of `width` elements; row `r` of it
/// starts at element `offsets[j] + r * stride` of the input. On the wire and in every
/// rank's output this is exactly the plain [`all_to_all`](crate::Communicator::all_to_all_async)
/// of the packed blocks (`size × rows × width` elements), so ranks may mix the two forms.
/// The usual case is a column split of a row-major matrix: `rows` rows of `stride` columns,
/// peer `j` getting columns `offsets[j]..offsets[j] + width`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StridedBlocks {
    /// Rows in every block.
    pub rows: usize,
    /// Elements in every row.
    pub width: usize,
    /// Elements from the start of one row to the start of the next.
    pub stride: usize,
    /// The first element of each peer's block, indexed by peer rank.
    pub offsets: Vec<usize>,
}

impl StridedBlocks {
    /// The elements of one packed block (`rows × width`).
    pub fn block_len(&self) -> usize {
        self.rows.saturating_mul(self.width)
    }

    /// The smallest input length (in elements) that holds every row of every block; 0 when
    /// the blocks are empty. `None` when it overflows `usize`.
    pub fn extent(&self) -> Option<usize> {
        if self.block_len() == 0 {
            return Some(0);
        }
        self.offsets.iter().try_fold(0usize, |most, &offset| {
            let last = (self.rows - 1).checked_mul(self.stride)?;
            let end = offset.checked_add(last)?.checked_add(self.width)?;
            Some(most.max(end))
        })
    }

    /// Copies bytes `from..from + dst.len()` of block `peer`, packed, out of `input` (the
    /// input's bytes, elements of `element` bytes) into `dst`. The caller has checked that
    /// the input holds [`StridedBlocks::extent`] elements and that the range lies within the
    /// packed block, so every row read is in bounds.
    pub(crate) fn copy_packed(
        &self,
        input: &[u8],
        element: usize,
        peer: usize,
        from: usize,
        dst: &mut [u8],
    ) {
        let mut done = 0;
        for piece in self.packed_pieces(input, element, peer, from, dst.len()) {
            dst[done..done + piece.len()].copy_from_slice(piece);
            done += piece.len();
        }
    }

    /// The pieces of `input` (rows, or parts of rows) that make up bytes `from..from + len`
    /// of block `peer`, packed, in order: their concatenation is that range. Same
    /// preconditions as [`StridedBlocks::copy_packed`].
    pub(crate) fn packed_pieces<'i>(
        &self,
        input: &'i [u8],
        element: usize,
        peer: usize,
        from: usize,
        len: usize,
    ) -> impl Iterator<Item = &'i [u8]> + use<'i> {
        let row_bytes = self.width * element;
        let (base, stride) = (self.offsets[peer] * element, self.stride * element);
        let mut at = from;
        let end = if row_bytes == 0 { from } else { from + len };
        std::iter::from_fn(move || {
            if at >= end {
                return None;
            }
            let (row, within) = (at / row_bytes, at % row_bytes);
            let take = (row_bytes - within).min(end - at);
            let start = base + row * stride + within;
            at += take;
            Some(&input[start..start + take])
        })
    }
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
    fn strided_blocks_pack_rows_in_place_across_row_boundaries() {
        // A 3 x 7 matrix of u16 (element j holds j), columns split 2 / 2 / 2 over three peers
        // with column 6 left out: block j is rows 0..3 of columns 2j..2j + 2.
        let input: Vec<u8> = (0u16..21).flat_map(u16::to_le_bytes).collect();
        let blocks = StridedBlocks {
            rows: 3,
            width: 2,
            stride: 7,
            offsets: vec![0, 2, 4],
        };
        assert_eq!(blocks.block_len(), 6);
        assert_eq!(blocks.extent(), Some(4 + 2 * 7 + 2));
        for peer in 0..3 {
            let expected: Vec<u8> = (0..3)
                .flat_map(|row| (0..2).map(move |col| (row * 7 + 2 * peer + col) as u16))
                .flat_map(u16::to_le_bytes)
                .collect();
            // Whole, and in pieces of 3 bytes (so pieces start mid-element and mid-row).
            let mut whole = vec![0u8; 12];
            blocks.copy_packed(&input, 2, peer, 0, &mut whole);
            assert_eq!(whole, expected, "peer {peer}");
            let mut pieces = vec![0u8; 12];
            for (index, piece) in pieces.chunks_mut(3).enumerate() {
                blocks.copy_packed(&input, 2, peer, index * 3, piece);
            }
            assert_eq!(pieces, expected, "peer {peer}");
        }
        let empty = StridedBlocks {
            rows: 0,
            width: 4,
            stride: 9,
            offsets: vec![5, 7],
        };
        assert_eq!(empty.extent(), Some(0));
        let huge = StridedBlocks {
            rows: 3,
            width: 1,
            stride: usize::MAX,
            offsets: vec![0],
        };
        assert_eq!(huge.extent(), None);
    }

    #[test]
    fn names_are_snake_case() {
        assert_eq!(OpKind::AllGatherV.to_string(), "all_gather_v");
        assert_eq!(ReduceOp::PreMulSum(0.25).to_string(), "premul_sum(0.25)");
        assert!(!OpKind::Recv.is_collective());
        assert!(OpKind::Barrier.is_collective());
    }
}
