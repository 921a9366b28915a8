//! The [`Communicator`] trait: the one interface `dtensor` and `fsdp` talk to hardware through.

use std::sync::Arc;

use crate::buffer::BufferPair;
use crate::buffer::{Buffer, HostBuffer};
use crate::config::CommConfig;
use crate::dtype::Element;
use crate::error::Result;
use crate::op::{AllToAllCounts, ReduceOp, StridedBlocks};
use crate::work::Work;

/// A group of `size()` ranks that run collectives together; this handle is rank `rank()`.
///
/// # Ordering and asynchrony
/// Every op has an async form (`*_async`) that takes its buffers by value and returns a
/// [`Work`]; [`Work::wait`] hands the buffers back. Ops issued on one communicator execute in
/// issue order on the communicator's progress thread (stream semantics), so the caller computes
/// while they run. All ranks must issue the same collectives in the same order; a rank that
/// issues a different op at the same position gets [`Error::OpMismatch`](crate::Error::OpMismatch)
/// or a length/dtype error on every rank.
///
/// The blocking forms are provided methods that call the async form and wait, so a backend
/// implements only the async ones.
///
/// # Buffers and lengths
/// Lengths are in elements. `n` below is the length of this rank's input. Every rank must pass
/// the same dtype (and, for the even ops, the same `n`); disagreements become errors on every
/// rank, not hangs. On error the buffers are dropped.
///
/// # Deadlines
/// Every op must finish within [`CommConfig::timeout`] of starting to execute, or fail with
/// [`Error::Timeout`](crate::Error::Timeout) / [`Error::PeerLost`](crate::Error::PeerLost).
pub trait Communicator: Send + Sync {
    /// This rank's index in the group, `0..size()`.
    fn rank(&self) -> usize;

    /// The number of ranks in the group.
    fn size(&self) -> usize;

    /// The options the communicator was built with (inherited by `split`).
    fn config(&self) -> &CommConfig;

    /// A name for spans and logs: `"world"` for a world, `"world/c1#0"` for a split, ...
    fn group_name(&self) -> &str;

    /// The backend's name: `"local"`, `"tcp"`, ...
    fn backend(&self) -> &'static str;

    /// Reduces `buffer` element-wise across the ranks, in place: every rank gets the result.
    fn all_reduce_async(&self, buffer: Buffer, op: ReduceOp) -> Work<Buffer>;

    /// Concatenates every rank's `input` (`n` elements) into `output` (`size × n`, rank `r`'s
    /// block at `r × n`), on every rank.
    fn all_gather_async(&self, input: Buffer, output: Buffer) -> Work<BufferPair>;

    /// Uneven all-gather: rank `r` contributes `counts[r]` elements (its `input` must have
    /// exactly that many), and `output` holds `sum(counts)` elements with rank `r`'s block at
    /// `sum(counts[..r])`. Every rank passes the same `counts` (length `size`).
    fn all_gather_v_async(
        &self,
        input: Buffer,
        output: Buffer,
        counts: Vec<usize>,
    ) -> Work<BufferPair>;

    /// Reduces `input` (`size × m` elements) across the ranks and leaves block `rank()` of the
    /// result (`m` elements, from offset `rank() × m`) in `output`.
    fn reduce_scatter_async(&self, input: Buffer, output: Buffer, op: ReduceOp)
    -> Work<BufferPair>;

    /// Uneven reduce-scatter: `input` holds `sum(counts)` elements on every rank; rank `r`
    /// receives the reduction of the block of `counts[r]` elements at `sum(counts[..r])`.
    /// Every rank passes the same `counts`.
    fn reduce_scatter_v_async(
        &self,
        input: Buffer,
        output: Buffer,
        counts: Vec<usize>,
        op: ReduceOp,
    ) -> Work<BufferPair>;

    /// Copies `root`'s `buffer` into every rank's `buffer` (same length everywhere).
    fn broadcast_async(&self, buffer: Buffer, root: usize) -> Work<Buffer>;

    /// Reduces `buffer` across the ranks into `root`'s `buffer`; other ranks get their buffer
    /// back unchanged.
    fn reduce_async(&self, buffer: Buffer, root: usize, op: ReduceOp) -> Work<Buffer>;

    /// Concatenates every rank's `input` (`n` elements) into `root`'s `output` (`size × n`).
    /// On other ranks `output` is not read or written and may have any length (use an empty
    /// buffer).
    fn gather_async(&self, input: Buffer, output: Buffer, root: usize) -> Work<BufferPair>;

    /// Splits `root`'s `input` (`size × n`) into blocks and sends block `r` to rank `r`'s
    /// `output` (`n` elements). On other ranks `input` is not read and may have any length.
    fn scatter_async(&self, input: Buffer, output: Buffer, root: usize) -> Work<BufferPair>;

    /// Block `j` of this rank's `input` (`size × n`) goes to rank `j`; block `i` of `output`
    /// (`size × n`) comes from rank `i`.
    fn all_to_all_async(&self, input: Buffer, output: Buffer) -> Work<BufferPair>;

    /// Uneven all-to-all with per-peer counts (see [`AllToAllCounts`]).
    fn all_to_all_v_async(
        &self,
        input: Buffer,
        output: Buffer,
        counts: AllToAllCounts,
    ) -> Work<BufferPair>;

    /// [`Communicator::all_to_all_async`] whose send blocks are read as strided rows of
    /// `input` (see [`StridedBlocks`]), so a caller holding a row-major matrix need not cut
    /// each peer's columns into a send buffer first. It is the same op on the wire (kind
    /// [`OpKind::AllToAll`](crate::OpKind::AllToAll), issued in stream order like any other)
    /// and fills `output` (`size × rows × width` elements) exactly as the plain form does with
    /// the packed blocks. A layout whose rows do not fit in `input` fails the op on every rank.
    ///
    /// This default packs the blocks on the caller's thread and runs the plain form; the
    /// `input` handed back is then the packed copy. A backend that reads the rows in place
    /// (tcp) hands `input` itself back.
    fn all_to_all_strided_async(
        &self,
        input: Buffer,
        output: Buffer,
        blocks: StridedBlocks,
    ) -> Work<BufferPair> {
        let packed = pack_strided(input, &blocks, self.size());
        self.all_to_all_async(packed, output)
    }

    /// Sends `buffer` to rank `peer` with a `tag`; hands the buffer back once the transport has
    /// taken its contents. A send never waits for the matching receive to be posted, so a pair
    /// of ranks may each send before they receive.
    fn send_async(&self, buffer: Buffer, peer: usize, tag: u32) -> Work<Buffer>;

    /// Receives the next message from `peer` with `tag` into `buffer`, whose length and dtype
    /// must equal the message's (else [`Error::LengthMismatch`](crate::Error::LengthMismatch) /
    /// [`Error::DTypeMismatch`](crate::Error::DTypeMismatch) with role `Message`). Messages from
    /// one peer with one tag arrive in the order they were sent.
    fn recv_async(&self, buffer: Buffer, peer: usize, tag: u32) -> Work<Buffer>;

    /// Completes once every rank has reached it.
    fn barrier_async(&self) -> Work<()>;

    /// Splits the group like `MPI_Comm_split`: ranks that pass the same `Some(color)` form a new
    /// group whose ranks are ordered by `(key, old rank)`; ranks that pass `None` get `None`.
    /// Every rank must call it (it is a collective, executed in stream order, and this call
    /// blocks until it is done). The new communicator has its own stream and runs concurrently
    /// with its parent and its siblings; it inherits the parent's [`CommConfig`].
    fn split(&self, color: Option<u32>, key: i64) -> Result<Option<Arc<dyn Communicator>>>;

    /// Fails every pending and future op on this handle with
    /// [`Error::Aborted`](crate::Error::Aborted), including one blocked mid-transfer; peers
    /// waiting on this rank see [`Error::PeerLost`](crate::Error::PeerLost) or a timeout.
    /// Sub-communicators made by `split` are not aborted with it.
    fn abort(&self);

    /// Whether [`Communicator::abort`] was called.
    fn is_aborted(&self) -> bool;

    /// Blocking [`Communicator::all_reduce_async`].
    fn all_reduce(&self, buffer: Buffer, op: ReduceOp) -> Result<Buffer> {
        self.all_reduce_async(buffer, op).wait()
    }

    /// Blocking [`Communicator::all_gather_async`].
    fn all_gather(&self, input: Buffer, output: Buffer) -> Result<BufferPair> {
        self.all_gather_async(input, output).wait()
    }

    /// Blocking [`Communicator::all_gather_v_async`].
    fn all_gather_v(
        &self,
        input: Buffer,
        output: Buffer,
        counts: Vec<usize>,
    ) -> Result<BufferPair> {
        self.all_gather_v_async(input, output, counts).wait()
    }

    /// Blocking [`Communicator::reduce_scatter_async`].
    fn reduce_scatter(&self, input: Buffer, output: Buffer, op: ReduceOp) -> Result<BufferPair> {
        self.reduce_scatter_async(input, output, op).wait()
    }

    /// Blocking [`Communicator::reduce_scatter_v_async`].
    fn reduce_scatter_v(
        &self,
        input: Buffer,
        output: Buffer,
        counts: Vec<usize>,
        op: ReduceOp,
    ) -> Result<BufferPair> {
        self.reduce_scatter_v_async(input, output, counts, op)
            .wait()
    }

    /// Blocking [`Communicator::broadcast_async`].
    fn broadcast(&self, buffer: Buffer, root: usize) -> Result<Buffer> {
        self.broadcast_async(buffer, root).wait()
    }

    /// Blocking [`Communicator::reduce_async`].
    fn reduce(&self, buffer: Buffer, root: usize, op: ReduceOp) -> Result<Buffer> {
        self.reduce_async(buffer, root, op).wait()
    }

    /// Blocking [`Communicator::gather_async`].
    fn gather(&self, input: Buffer, output: Buffer, root: usize) -> Result<BufferPair> {
        self.gather_async(input, output, root).wait()
    }

    /// Blocking [`Communicator::scatter_async`].
    fn scatter(&self, input: Buffer, output: Buffer, root: usize) -> Result<BufferPair> {
        self.scatter_async(input, output, root).wait()
    }

    /// Blocking [`Communicator::all_to_all_async`].
    fn all_to_all(&self, input: Buffer, output: Buffer) -> Result<BufferPair> {
        self.all_to_all_async(input, output).wait()
    }

    /// Blocking [`Communicator::all_to_all_v_async`].
    fn all_to_all_v(
        &self,
        input: Buffer,
        output: Buffer,
        counts: AllToAllCounts,
    ) -> Result<BufferPair> {
        self.all_to_all_v_async(input, output, counts).wait()
    }

    /// Blocking [`Communicator::all_to_all_strided_async`].
    fn all_to_all_strided(
        &self,
        input: Buffer,
        output: Buffer,
        blocks: StridedBlocks,
    ) -> Result<BufferPair> {
        self.all_to_all_strided_async(input, output, blocks).wait()
    }

    /// Blocking [`Communicator::send_async`].
    fn send(&self, buffer: Buffer, peer: usize, tag: u32) -> Result<Buffer> {
        self.send_async(buffer, peer, tag).wait()
    }

    /// Blocking [`Communicator::recv_async`].
    fn recv(&self, buffer: Buffer, peer: usize, tag: u32) -> Result<Buffer> {
        self.recv_async(buffer, peer, tag).wait()
    }

    /// Blocking [`Communicator::barrier_async`].
    fn barrier(&self) -> Result<()> {
        self.barrier_async().wait()
    }
}

/// The packed send buffer of a strided all-to-all (`size` blocks of `blocks.block_len()`
/// elements). When the rows do not fit in `input` (or `input` is not host memory), an empty
/// buffer of its dtype is handed on instead: its length disagrees with every peer's in phase
/// 0, so the op fails on every rank rather than sending the wrong bytes.
fn pack_strided(input: Buffer, blocks: &StridedBlocks, size: usize) -> Buffer {
    let dtype = input.dtype();
    let total = blocks.block_len().checked_mul(size);
    let fits =
        blocks.extent().is_some_and(|extent| extent <= input.len()) && blocks.offsets.len() == size;
    let host = match input {
        Buffer::Host(host) if fits && total.is_some() => host,
        _ => return Buffer::zeros(dtype, 0),
    };
    let Some(total) = total else {
        return Buffer::zeros(dtype, 0);
    };
    let mut packed = HostBuffer::zeros(dtype, total);
    let element = dtype.size_bytes();
    let block_bytes = blocks.block_len() * element;
    if block_bytes > 0 {
        let out = packed.as_bytes_mut();
        for (peer, chunk) in out.chunks_mut(block_bytes).enumerate() {
            blocks.copy_packed(host.as_bytes(), element, peer, 0, chunk);
        }
    }
    Buffer::Host(packed)
}

/// Typed conveniences over any communicator (`Vec<T>` in, `Vec<T>` out), blanket-implemented
/// for every [`Communicator`], `dyn Communicator` included.
pub trait CommunicatorExt: Communicator {
    /// All-reduce of a vector.
    fn all_reduce_vec<T: Element>(&self, values: Vec<T>, op: ReduceOp) -> Result<Vec<T>> {
        self.all_reduce(Buffer::from_vec(values), op)?.into_vec()
    }

    /// All-gather of a vector: `size × values.len()` elements, rank order.
    fn all_gather_vec<T: Element>(&self, values: Vec<T>) -> Result<Vec<T>> {
        let output = Buffer::zeros(T::DTYPE, values.len().saturating_mul(self.size()));
        self.all_gather(Buffer::from_vec(values), output)?
            .output
            .into_vec()
    }

    /// Reduce-scatter of a vector of `size × m` elements: this rank's `m`-element block.
    fn reduce_scatter_vec<T: Element>(&self, values: Vec<T>, op: ReduceOp) -> Result<Vec<T>> {
        let output = Buffer::zeros(T::DTYPE, values.len() / self.size().max(1));
        self.reduce_scatter(Buffer::from_vec(values), output, op)?
            .output
            .into_vec()
    }

    /// Broadcast of a vector from `root`.
    fn broadcast_vec<T: Element>(&self, values: Vec<T>, root: usize) -> Result<Vec<T>> {
        self.broadcast(Buffer::from_vec(values), root)?.into_vec()
    }
}

impl<C: Communicator + ?Sized> CommunicatorExt for C {}

/// Implements the op methods of [`Communicator`] (every `*_async` op and `split`) inside an
/// `impl Communicator for X` block, for a backend type `X` with a method
/// `fn submit<T, F>(&self, op: OpKind, bytes: usize, job: F) -> Work<T>` (where
/// `F: FnOnce(&Inner, &JobContext) -> Result<T>`) that runs `job` on its progress thread.
/// Each op names the function that runs it there, so every backend forwards its ops the same
/// way: the op kind for the engine and the counters, the byte count (the input's, 0 for
/// barrier and split), and the arguments moved into the job.
macro_rules! forward_ops {
    (
        all_reduce: $all_reduce:path,
        all_gather: $all_gather:path,
        reduce_scatter: $reduce_scatter:path,
        broadcast: $broadcast:path,
        reduce: $reduce:path,
        gather: $gather:path,
        scatter: $scatter:path,
        all_to_all: $all_to_all:path,
        send: $send:path,
        recv: $recv:path,
        barrier: $barrier:path,
        split: $split:path $(,)?
    ) => {
        fn all_reduce_async(
            &self,
            buffer: $crate::Buffer,
            op: $crate::ReduceOp,
        ) -> $crate::Work<$crate::Buffer> {
            self.submit(
                $crate::OpKind::AllReduce,
                buffer.byte_len(),
                move |inner, ctx| $all_reduce(inner, ctx, buffer, op),
            )
        }

        fn all_gather_async(
            &self,
            input: $crate::Buffer,
            output: $crate::Buffer,
        ) -> $crate::Work<$crate::BufferPair> {
            self.submit(
                $crate::OpKind::AllGather,
                input.byte_len(),
                move |inner, ctx| $all_gather(inner, ctx, input, output, None),
            )
        }

        fn all_gather_v_async(
            &self,
            input: $crate::Buffer,
            output: $crate::Buffer,
            counts: Vec<usize>,
        ) -> $crate::Work<$crate::BufferPair> {
            self.submit(
                $crate::OpKind::AllGatherV,
                input.byte_len(),
                move |inner, ctx| $all_gather(inner, ctx, input, output, Some(counts)),
            )
        }

        fn reduce_scatter_async(
            &self,
            input: $crate::Buffer,
            output: $crate::Buffer,
            op: $crate::ReduceOp,
        ) -> $crate::Work<$crate::BufferPair> {
            self.submit(
                $crate::OpKind::ReduceScatter,
                input.byte_len(),
                move |inner, ctx| $reduce_scatter(inner, ctx, input, output, None, op),
            )
        }

        fn reduce_scatter_v_async(
            &self,
            input: $crate::Buffer,
            output: $crate::Buffer,
            counts: Vec<usize>,
            op: $crate::ReduceOp,
        ) -> $crate::Work<$crate::BufferPair> {
            self.submit(
                $crate::OpKind::ReduceScatterV,
                input.byte_len(),
                move |inner, ctx| $reduce_scatter(inner, ctx, input, output, Some(counts), op),
            )
        }

        fn broadcast_async(
            &self,
            buffer: $crate::Buffer,
            root: usize,
        ) -> $crate::Work<$crate::Buffer> {
            self.submit(
                $crate::OpKind::Broadcast,
                buffer.byte_len(),
                move |inner, ctx| $broadcast(inner, ctx, buffer, root),
            )
        }

        fn reduce_async(
            &self,
            buffer: $crate::Buffer,
            root: usize,
            op: $crate::ReduceOp,
        ) -> $crate::Work<$crate::Buffer> {
            self.submit(
                $crate::OpKind::Reduce,
                buffer.byte_len(),
                move |inner, ctx| $reduce(inner, ctx, buffer, root, op),
            )
        }

        fn gather_async(
            &self,
            input: $crate::Buffer,
            output: $crate::Buffer,
            root: usize,
        ) -> $crate::Work<$crate::BufferPair> {
            self.submit(
                $crate::OpKind::Gather,
                input.byte_len(),
                move |inner, ctx| $gather(inner, ctx, input, output, root),
            )
        }

        fn scatter_async(
            &self,
            input: $crate::Buffer,
            output: $crate::Buffer,
            root: usize,
        ) -> $crate::Work<$crate::BufferPair> {
            self.submit(
                $crate::OpKind::Scatter,
                input.byte_len(),
                move |inner, ctx| $scatter(inner, ctx, input, output, root),
            )
        }

        fn all_to_all_async(
            &self,
            input: $crate::Buffer,
            output: $crate::Buffer,
        ) -> $crate::Work<$crate::BufferPair> {
            self.submit(
                $crate::OpKind::AllToAll,
                input.byte_len(),
                move |inner, ctx| $all_to_all(inner, ctx, input, output, None),
            )
        }

        fn all_to_all_v_async(
            &self,
            input: $crate::Buffer,
            output: $crate::Buffer,
            counts: $crate::AllToAllCounts,
        ) -> $crate::Work<$crate::BufferPair> {
            self.submit(
                $crate::OpKind::AllToAllV,
                input.byte_len(),
                move |inner, ctx| $all_to_all(inner, ctx, input, output, Some(counts)),
            )
        }

        fn send_async(
            &self,
            buffer: $crate::Buffer,
            peer: usize,
            tag: u32,
        ) -> $crate::Work<$crate::Buffer> {
            self.submit(
                $crate::OpKind::Send,
                buffer.byte_len(),
                move |inner, ctx| $send(inner, ctx, buffer, peer, tag),
            )
        }

        fn recv_async(
            &self,
            buffer: $crate::Buffer,
            peer: usize,
            tag: u32,
        ) -> $crate::Work<$crate::Buffer> {
            self.submit(
                $crate::OpKind::Recv,
                buffer.byte_len(),
                move |inner, ctx| $recv(inner, ctx, buffer, peer, tag),
            )
        }

        fn barrier_async(&self) -> $crate::Work<()> {
            self.submit($crate::OpKind::Barrier, 0, $barrier)
        }

        fn split(
            &self,
            color: Option<u32>,
            key: i64,
        ) -> $crate::Result<Option<std::sync::Arc<dyn $crate::Communicator>>> {
            self.submit($crate::OpKind::Split, 0, move |inner, ctx| {
                $split(inner, ctx, color, key)
            })
            .wait()
        }
    };
}

pub(crate) use forward_ops;
