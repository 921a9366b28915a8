//! The local argument checks of every collective, shared by all backends: each function
//! takes an op's arguments, records the first local error in [`Faults`] (posted to the
//! peers in phase 0, not returned, so every rank fails together) and fills in the phase-0
//! [`Desc`] whose fields the ranks must agree on. A backend then opens phase 0 with the
//! faults and the descriptor and moves the data its own way.

use super::{Desc, Faults};
use crate::buffer::{Buffer, HostBuffer};
use crate::dtype::DType;
use crate::op::{AllToAllCounts, BufferRole, OpKind, ReduceOp, StridedBlocks};
use crate::reduce::ReducePlan;

/// The checked arguments of a one-buffer op (all-reduce, broadcast, reduce).
pub(crate) struct Single {
    pub(crate) faults: Faults,
    pub(crate) desc: Desc,
    pub(crate) host: HostBuffer,
    /// The reduction (`None` for broadcast, or when the op/dtype pair is a fault).
    pub(crate) plan: Option<ReducePlan>,
}

/// The checked arguments of a two-buffer op.
pub(crate) struct Pair {
    pub(crate) faults: Faults,
    pub(crate) desc: Desc,
    pub(crate) input: HostBuffer,
    pub(crate) output: HostBuffer,
    /// The dtype every rank must share.
    pub(crate) dtype: DType,
    /// The element count of each rank's block (gathers and reduce-scatters; empty otherwise).
    pub(crate) counts: Vec<usize>,
    /// The reduction of a reduce-scatter.
    pub(crate) plan: Option<ReducePlan>,
}

/// The checked arguments of an all-to-all: a [`Pair`] and the counts this rank sends and
/// receives (the even split for the plain form).
pub(crate) struct AllToAll {
    pub(crate) pair: Pair,
    // Only the TCP backend moves blocks by these counts (local reads them from the descriptor).
    #[cfg_attr(not(feature = "tcp"), allow(dead_code))]
    pub(crate) counts: AllToAllCounts,
}

/// Where an op runs: the group's size, this rank in it, and the backend's habits that the
/// checks must respect.
#[derive(Clone, Copy)]
pub(crate) struct Place {
    pub(crate) size: usize,
    pub(crate) rank: usize,
    /// The backend's name, for the error a device buffer gets.
    pub(crate) backend: &'static str,
    /// The dtype a reduction over a given buffer dtype is computed in: the identity for
    /// backends that accumulate bf16/f16 in f32 inside each step, f32 for MPI, which reduces
    /// a staged f32 copy (MPI has no half-precision sum).
    pub(crate) reduce_dtype: fn(DType) -> DType,
}

impl Place {
    /// A place whose reductions run in the buffer's own dtype.
    pub(crate) fn new(size: usize, rank: usize, backend: &'static str) -> Self {
        Place {
            size,
            rank,
            backend,
            reduce_dtype: std::convert::identity,
        }
    }

    fn plan(&self, faults: &mut Faults, op: ReduceOp, dtype: DType) -> Option<ReducePlan> {
        faults.plan(op, (self.reduce_dtype)(dtype), self.size)
    }
}

fn single(place: Place, kind: OpKind, buffer: Buffer) -> (Faults, HostBuffer, Desc) {
    let mut faults = Faults::new(kind);
    let host = faults.host(buffer, place.backend);
    let mut desc = Desc::new(kind);
    desc.dtype = Some(host.dtype());
    desc.len = Some(host.len());
    (faults, host, desc)
}

fn pair(
    place: Place,
    kind: OpKind,
    input: Buffer,
    output: Buffer,
) -> (Faults, HostBuffer, HostBuffer) {
    let mut faults = Faults::new(kind);
    let input = faults.host(input, place.backend);
    let output = faults.host(output, place.backend);
    (faults, input, output)
}

/// All-reduce: any buffer; the reduce op must exist for its dtype.
pub(crate) fn all_reduce(place: Place, buffer: Buffer, op: ReduceOp) -> Single {
    let (mut faults, host, mut desc) = single(place, OpKind::AllReduce, buffer);
    let plan = place.plan(&mut faults, op, host.dtype());
    desc.reduce = Some(op);
    Single {
        faults,
        desc,
        host,
        plan,
    }
}

/// Broadcast: the root must be a rank of the group.
pub(crate) fn broadcast(place: Place, buffer: Buffer, root: usize) -> Single {
    let (mut faults, host, mut desc) = single(place, OpKind::Broadcast, buffer);
    faults.rank(root, place.size);
    desc.root = Some(root);
    Single {
        faults,
        desc,
        host,
        plan: None,
    }
}

/// Reduce: a valid root and a reduce op that exists for the dtype.
pub(crate) fn reduce(place: Place, buffer: Buffer, root: usize, op: ReduceOp) -> Single {
    let (mut faults, host, mut desc) = single(place, OpKind::Reduce, buffer);
    faults.rank(root, place.size);
    let plan = place.plan(&mut faults, op, host.dtype());
    desc.root = Some(root);
    desc.reduce = Some(op);
    Single {
        faults,
        desc,
        host,
        plan,
    }
}

/// How a gather-like op's blocks are checked: `counts` (the `_v` form) against the group size,
/// this rank's block against `own` (the buffer holding one block) and their sum against
/// `whole` (the buffer holding every block); without counts every block is `block_len`.
struct Blocks<'b> {
    own: (BufferRole, usize),
    whole: (BufferRole, usize),
    block_len: usize,
    counts: Option<Vec<usize>>,
    desc: &'b mut Desc,
}

fn blocks(place: Place, faults: &mut Faults, spec: Blocks<'_>) -> Vec<usize> {
    match spec.counts {
        Some(counts) => {
            faults.length(BufferRole::Counts, place.size, counts.len());
            if counts.len() == place.size {
                faults.length(spec.own.0, counts[place.rank], spec.own.1);
                faults.length(spec.whole.0, counts.iter().sum(), spec.whole.1);
            }
            spec.desc.counts = Some(counts.clone());
            counts
        }
        None => {
            faults.length(spec.whole.0, place.size * spec.block_len, spec.whole.1);
            vec![spec.block_len; place.size]
        }
    }
}

/// All-gather (`counts: None`) or all-gather-v: the output holds every rank's block.
pub(crate) fn all_gather(
    place: Place,
    input: Buffer,
    output: Buffer,
    counts: Option<Vec<usize>>,
) -> Pair {
    let kind = if counts.is_some() {
        OpKind::AllGatherV
    } else {
        OpKind::AllGather
    };
    let (mut faults, input, output) = pair(place, kind, input, output);
    let dtype = input.dtype();
    faults.dtype(BufferRole::Output, dtype, output.dtype());
    let mut desc = Desc::new(kind);
    desc.dtype = Some(dtype);
    if counts.is_none() {
        desc.len = Some(input.len());
    }
    let spec = Blocks {
        own: (BufferRole::Input, input.len()),
        whole: (BufferRole::Output, output.len()),
        block_len: input.len(),
        counts,
        desc: &mut desc,
    };
    let counts = blocks(place, &mut faults, spec);
    Pair {
        faults,
        desc,
        input,
        output,
        dtype,
        counts,
        plan: None,
    }
}

/// Reduce-scatter (`counts: None`) or reduce-scatter-v: the input holds every rank's block.
pub(crate) fn reduce_scatter(
    place: Place,
    input: Buffer,
    output: Buffer,
    counts: Option<Vec<usize>>,
    op: ReduceOp,
) -> Pair {
    let kind = if counts.is_some() {
        OpKind::ReduceScatterV
    } else {
        OpKind::ReduceScatter
    };
    let (mut faults, input, output) = pair(place, kind, input, output);
    let dtype = input.dtype();
    faults.dtype(BufferRole::Output, dtype, output.dtype());
    let plan = place.plan(&mut faults, op, dtype);
    let mut desc = Desc::new(kind);
    desc.dtype = Some(dtype);
    desc.reduce = Some(op);
    if counts.is_none() {
        desc.len = Some(input.len());
    }
    let spec = Blocks {
        own: (BufferRole::Output, output.len()),
        whole: (BufferRole::Input, input.len()),
        block_len: output.len(),
        counts,
        desc: &mut desc,
    };
    let counts = blocks(place, &mut faults, spec);
    Pair {
        faults,
        desc,
        input,
        output,
        dtype,
        counts,
        plan,
    }
}

/// Gather: the root's output holds `size` input-sized blocks.
pub(crate) fn gather(place: Place, input: Buffer, output: Buffer, root: usize) -> Pair {
    let kind = OpKind::Gather;
    let (mut faults, input, output) = pair(place, kind, input, output);
    faults.rank(root, place.size);
    let (dtype, n) = (input.dtype(), input.len());
    if place.rank == root {
        faults.dtype(BufferRole::Output, dtype, output.dtype());
        faults.length(BufferRole::Output, place.size * n, output.len());
    }
    rooted_pair(kind, faults, input, output, (dtype, n, root))
}

/// Scatter: the root's input holds `size` output-sized blocks.
pub(crate) fn scatter(place: Place, input: Buffer, output: Buffer, root: usize) -> Pair {
    let kind = OpKind::Scatter;
    let (mut faults, input, output) = pair(place, kind, input, output);
    faults.rank(root, place.size);
    let (dtype, n) = (output.dtype(), output.len());
    if place.rank == root {
        faults.dtype(BufferRole::Input, dtype, input.dtype());
        faults.length(BufferRole::Input, place.size * n, input.len());
    }
    rooted_pair(kind, faults, input, output, (dtype, n, root))
}

/// The [`Pair`] of gather and scatter: every rank shares the dtype, the block length `n`
/// and the root.
fn rooted_pair(
    kind: OpKind,
    faults: Faults,
    input: HostBuffer,
    output: HostBuffer,
    (dtype, n, root): (DType, usize, usize),
) -> Pair {
    let mut desc = Desc::new(kind);
    desc.dtype = Some(dtype);
    desc.len = Some(n);
    desc.root = Some(root);
    Pair {
        faults,
        desc,
        input,
        output,
        dtype,
        counts: Vec::new(),
        plan: None,
    }
}

/// All-to-all (`counts: None`: the input splits evenly) or all-to-all-v (the send counts
/// cover the input, the receive counts the output; the pairwise agreement is checked in
/// phase 0).
pub(crate) fn all_to_all(
    place: Place,
    input: Buffer,
    output: Buffer,
    counts: Option<AllToAllCounts>,
) -> AllToAll {
    let kind = if counts.is_some() {
        OpKind::AllToAllV
    } else {
        OpKind::AllToAll
    };
    let (mut faults, input, output) = pair(place, kind, input, output);
    let dtype = input.dtype();
    faults.dtype(BufferRole::Output, dtype, output.dtype());
    let mut desc = Desc::new(kind);
    desc.dtype = Some(dtype);
    let size = place.size;
    let counts = match counts {
        Some(counts) => {
            faults.length(BufferRole::SendCounts, size, counts.send.len());
            faults.length(BufferRole::RecvCounts, size, counts.recv.len());
            faults.length(BufferRole::Input, counts.send.iter().sum(), input.len());
            faults.length(BufferRole::Output, counts.recv.iter().sum(), output.len());
            desc.a2a = Some(counts.clone());
            counts
        }
        None => {
            let block = input.len() / size.max(1);
            faults.length(BufferRole::Input, block * size, input.len());
            faults.length(BufferRole::Output, input.len(), output.len());
            desc.len = Some(input.len());
            AllToAllCounts {
                send: vec![block; size],
                recv: vec![block; size],
            }
        }
    };
    AllToAll {
        pair: Pair {
            faults,
            desc,
            input,
            output,
            dtype,
            counts: Vec::new(),
            plan: None,
        },
        counts,
    }
}

/// Strided all-to-all ([`StridedBlocks`]): the plain all-to-all of the packed blocks, so its
/// descriptor is the plain form's (a peer may run either), and the rows must fit in the input
/// (else a length fault naming the extent they need) with one block offset per rank.
// The TCP backend's strided all-to-all; the other backends pack through the trait's default.
#[cfg_attr(not(feature = "tcp"), allow(dead_code))]
pub(crate) fn all_to_all_strided(
    place: Place,
    input: Buffer,
    output: Buffer,
    blocks: &StridedBlocks,
) -> AllToAll {
    let kind = OpKind::AllToAll;
    let (mut faults, input, output) = pair(place, kind, input, output);
    let dtype = input.dtype();
    faults.dtype(BufferRole::Output, dtype, output.dtype());
    let size = place.size;
    faults.length(BufferRole::SendCounts, size, blocks.offsets.len());
    let extent = blocks.extent().unwrap_or(usize::MAX);
    if extent > input.len() {
        faults.length(BufferRole::Input, extent, input.len());
    }
    let block = blocks.block_len();
    let total = block.saturating_mul(size);
    faults.length(BufferRole::Output, total, output.len());
    let mut desc = Desc::new(kind);
    desc.dtype = Some(dtype);
    desc.len = Some(total);
    AllToAll {
        pair: Pair {
            faults,
            desc,
            input,
            output,
            dtype,
            counts: Vec::new(),
            plan: None,
        },
        counts: AllToAllCounts {
            send: vec![block; size],
            recv: vec![block; size],
        },
    }
}
