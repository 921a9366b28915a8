//! [`MpiCommunicator`]: the [`Communicator`] of the MPI backend, and `split` through
//! `MPI_Comm_split`.

use std::sync::Arc;

use mpi::topology::{Color, Communicator as _};

use super::agree::agree;
use super::ops::{self, BACKEND};
use super::p2p;
use super::raw::Comm;
use super::runtime::Runtime;
use crate::agree::{Desc, Faults};
use crate::buffer::Buffer;
use crate::buffer::BufferPair;
use crate::communicator::Communicator;
use crate::config::CommConfig;
use crate::engine::{JobContext, JobSpec, ProgressEngine};
use crate::error::{Error, Result};
use crate::op::{AllToAllCounts, OpKind, ReduceOp};
use crate::work::Work;

/// What an MPI group's ops share. Field order matters: `comm` is freed (`MPI_Comm_free`)
/// before `runtime` may finalise MPI.
pub(crate) struct Inner {
    pub(crate) comm: Comm,
    pub(crate) rank: usize,
    pub(crate) size: usize,
    pub(crate) runtime: Arc<Runtime>,
}

/// A [`Communicator`] over MPI (Open MPI, MPICH, ...), one per rank, for jobs started by
/// `mpirun`/`srun`.
///
/// Every op runs on the communicator's own progress thread as one nonblocking MPI call
/// (`MPI_Iallreduce`, `MPI_Iallgatherv`, ...) that the thread tests until it completes or the
/// op's deadline passes; before it, the ranks exchange op descriptors so that mismatched
/// arguments fail with the same typed error on every rank. Splits get their own MPI
/// communicator and progress thread, so MPI must provide `MPI_THREAD_MULTIPLE`.
pub struct MpiCommunicator {
    inner: Arc<Inner>,
    engine: ProgressEngine,
    config: CommConfig,
    name: String,
}

impl std::fmt::Debug for MpiCommunicator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MpiCommunicator")
            .field("group", &self.name)
            .field("rank", &self.inner.rank)
            .field("size", &self.inner.size)
            .finish()
    }
}

impl MpiCommunicator {
    /// Initialises MPI (once per process, with `MPI_THREAD_MULTIPLE`) and returns this rank's
    /// communicator over a duplicate of `MPI_COMM_WORLD`. Calling it again while a world is
    /// alive gives another world handle on the same runtime; MPI is finalised when the last
    /// communicator (and the last op on it) is gone, after which it cannot start again.
    pub fn world(config: CommConfig) -> Result<MpiCommunicator> {
        let runtime = Runtime::get()?;
        let world = mpi::topology::SimpleCommunicator::world().duplicate();
        MpiCommunicator::from_parts(runtime, world, config, "world".to_string())
    }

    fn from_parts(
        runtime: Arc<Runtime>,
        handle: mpi::topology::SimpleCommunicator,
        config: CommConfig,
        name: String,
    ) -> Result<MpiCommunicator> {
        // invariant: MPI ranks and sizes are non-negative C ints.
        let rank = usize::try_from(handle.rank()).unwrap_or(0);
        let size = usize::try_from(handle.size()).unwrap_or(1);
        let comm = Comm::adopt(handle)?;
        let engine = ProgressEngine::new(format!("mpi-{name}"))?;
        Ok(MpiCommunicator {
            inner: Arc::new(Inner {
                comm,
                rank,
                size,
                runtime,
            }),
            engine,
            config,
            name,
        })
    }

    fn submit<T, F>(&self, op: OpKind, bytes: usize, job: F) -> Work<T>
    where
        T: Send + 'static,
        F: FnOnce(&Inner, &JobContext) -> Result<T> + Send + 'static,
    {
        let inner = self.inner.clone();
        self.engine.submit(
            JobSpec {
                op,
                bytes,
                timeout: self.config.timeout,
            },
            move |ctx| job(&inner, ctx),
        )
    }
}

/// Where this rank lands in a split: the color's index among the colors in use (MPI colors
/// must be non-negative C ints, ours are any u32) and its rank by `(key, old rank)`.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct SplitPlace {
    pub(crate) color_index: i32,
    pub(crate) new_rank: i32,
}

/// The place of rank `me` given every rank's `(color, key)`, or `None` if it opted out.
pub(crate) fn split_place(me: usize, choices: &[(Option<u32>, i64)]) -> Option<SplitPlace> {
    let color = choices.get(me)?.0?;
    let mut colors: Vec<u32> = choices.iter().filter_map(|c| c.0).collect();
    colors.sort_unstable();
    colors.dedup();
    let color_index = colors.iter().position(|&c| c == color)?;
    let mut members: Vec<(i64, usize)> = choices
        .iter()
        .enumerate()
        .filter(|(_, c)| c.0 == Some(color))
        .map(|(rank, c)| (c.1, rank))
        .collect();
    members.sort_unstable();
    let new_rank = members.iter().position(|&(_, rank)| rank == me)?;
    Some(SplitPlace {
        color_index: i32::try_from(color_index).ok()?,
        new_rank: i32::try_from(new_rank).ok()?,
    })
}

/// The split itself, on the parent's progress thread: agree on every rank's `(color, key)`,
/// then `MPI_Comm_split` (blocking: MPI has no nonblocking split, but every rank has just
/// passed phase 0, so none is missing).
fn split_job(
    inner: &Inner,
    ctx: &JobContext,
    color: Option<u32>,
    key: i64,
) -> Result<Option<mpi::topology::SimpleCommunicator>> {
    let kind = OpKind::Split;
    let mut desc = Desc::new(kind);
    desc.split = Some((color, key));
    let agreed = agree(inner, ctx, desc, Faults::new(kind))?;
    let choices: Vec<(Option<u32>, i64)> = agreed
        .descs
        .iter()
        .map(|d| d.split.unwrap_or((None, 0)))
        .collect();
    let place = split_place(inner.rank, &choices);
    let (mpi_color, mpi_key) = match &place {
        Some(place) => (Color::with_value(place.color_index), place.new_rank),
        None => (Color::undefined(), 0),
    };
    let child = inner
        .comm
        .handle()
        .split_by_color_with_key(mpi_color, mpi_key);
    if place.is_some() && child.is_none() {
        return Err(Error::Mpi {
            op: Some(kind),
            call: "MPI_Comm_split",
            code: -1,
        });
    }
    Ok(child)
}

impl Communicator for MpiCommunicator {
    fn rank(&self) -> usize {
        self.inner.rank
    }

    fn size(&self) -> usize {
        self.inner.size
    }

    fn config(&self) -> &CommConfig {
        &self.config
    }

    fn group_name(&self) -> &str {
        &self.name
    }

    fn backend(&self) -> &'static str {
        BACKEND
    }

    fn all_reduce_async(&self, buffer: Buffer, op: ReduceOp) -> Work<Buffer> {
        let bytes = buffer.byte_len();
        self.submit(OpKind::AllReduce, bytes, move |inner, ctx| {
            ops::all_reduce(inner, ctx, buffer, op)
        })
    }

    fn all_gather_async(&self, input: Buffer, output: Buffer) -> Work<BufferPair> {
        let bytes = input.byte_len();
        self.submit(OpKind::AllGather, bytes, move |inner, ctx| {
            ops::all_gather(inner, ctx, input, output, None)
        })
    }

    fn all_gather_v_async(
        &self,
        input: Buffer,
        output: Buffer,
        counts: Vec<usize>,
    ) -> Work<BufferPair> {
        let bytes = input.byte_len();
        self.submit(OpKind::AllGatherV, bytes, move |inner, ctx| {
            ops::all_gather(inner, ctx, input, output, Some(counts))
        })
    }

    fn reduce_scatter_async(
        &self,
        input: Buffer,
        output: Buffer,
        op: ReduceOp,
    ) -> Work<BufferPair> {
        let bytes = input.byte_len();
        self.submit(OpKind::ReduceScatter, bytes, move |inner, ctx| {
            ops::reduce_scatter(inner, ctx, input, output, None, op)
        })
    }

    fn reduce_scatter_v_async(
        &self,
        input: Buffer,
        output: Buffer,
        counts: Vec<usize>,
        op: ReduceOp,
    ) -> Work<BufferPair> {
        let bytes = input.byte_len();
        self.submit(OpKind::ReduceScatterV, bytes, move |inner, ctx| {
            ops::reduce_scatter(inner, ctx, input, output, Some(counts), op)
        })
    }

    fn broadcast_async(&self, buffer: Buffer, root: usize) -> Work<Buffer> {
        let bytes = buffer.byte_len();
        self.submit(OpKind::Broadcast, bytes, move |inner, ctx| {
            ops::broadcast(inner, ctx, buffer, root)
        })
    }

    fn reduce_async(&self, buffer: Buffer, root: usize, op: ReduceOp) -> Work<Buffer> {
        let bytes = buffer.byte_len();
        self.submit(OpKind::Reduce, bytes, move |inner, ctx| {
            ops::reduce(inner, ctx, buffer, root, op)
        })
    }

    fn gather_async(&self, input: Buffer, output: Buffer, root: usize) -> Work<BufferPair> {
        let bytes = input.byte_len();
        self.submit(OpKind::Gather, bytes, move |inner, ctx| {
            ops::gather(inner, ctx, input, output, root)
        })
    }

    fn scatter_async(&self, input: Buffer, output: Buffer, root: usize) -> Work<BufferPair> {
        let bytes = input.byte_len();
        self.submit(OpKind::Scatter, bytes, move |inner, ctx| {
            ops::scatter(inner, ctx, input, output, root)
        })
    }

    fn all_to_all_async(&self, input: Buffer, output: Buffer) -> Work<BufferPair> {
        let bytes = input.byte_len();
        self.submit(OpKind::AllToAll, bytes, move |inner, ctx| {
            ops::all_to_all(inner, ctx, input, output, None)
        })
    }

    fn all_to_all_v_async(
        &self,
        input: Buffer,
        output: Buffer,
        counts: AllToAllCounts,
    ) -> Work<BufferPair> {
        let bytes = input.byte_len();
        self.submit(OpKind::AllToAllV, bytes, move |inner, ctx| {
            ops::all_to_all(inner, ctx, input, output, Some(counts))
        })
    }

    fn send_async(&self, buffer: Buffer, peer: usize, tag: u32) -> Work<Buffer> {
        let bytes = buffer.byte_len();
        self.submit(OpKind::Send, bytes, move |inner, ctx| {
            p2p::send(inner, ctx, buffer, peer, tag)
        })
    }

    fn recv_async(&self, buffer: Buffer, peer: usize, tag: u32) -> Work<Buffer> {
        let bytes = buffer.byte_len();
        self.submit(OpKind::Recv, bytes, move |inner, ctx| {
            p2p::recv(inner, ctx, buffer, peer, tag)
        })
    }

    fn barrier_async(&self) -> Work<()> {
        self.submit(OpKind::Barrier, 0, ops::barrier)
    }

    fn split(&self, color: Option<u32>, key: i64) -> Result<Option<Arc<dyn Communicator>>> {
        let child = self
            .submit(OpKind::Split, 0, move |inner, ctx| {
                split_job(inner, ctx, color, key).map(|child| child.map(ChildComm))
            })
            .wait()?;
        let Some(ChildComm(handle)) = child else {
            return Ok(None);
        };
        // Splits of one parent are numbered by the parent's split count, like tcp's names.
        let name = format!("{}/c{}#{}", self.name, color.unwrap_or(0), handle.rank());
        let child = MpiCommunicator::from_parts(
            self.inner.runtime.clone(),
            handle,
            self.config.clone(),
            name,
        )?;
        Ok(Some(Arc::new(child)))
    }

    fn abort(&self) {
        self.engine.abort();
    }

    fn is_aborted(&self) -> bool {
        self.engine.is_aborted()
    }
}

/// A new MPI communicator on its way from the progress thread to the caller.
struct ChildComm(mpi::topology::SimpleCommunicator);

// SAFETY: the handle was made under MPI_THREAD_MULTIPLE, where a communicator may be used and
// freed from any thread; it is moved (never shared) from the progress thread to the caller.
unsafe impl Send for ChildComm {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn split_places_order_by_key_then_rank_and_compact_colors() {
        // Ranks 0..5: colors 7, None, 7, 3, 7; keys reverse the order within color 7.
        let choices = [
            (Some(7), 0),
            (None, 0),
            (Some(7), -2),
            (Some(3), 5),
            (Some(7), -2),
        ];
        assert_eq!(
            split_place(0, &choices),
            Some(SplitPlace {
                color_index: 1,
                new_rank: 2
            })
        );
        assert_eq!(split_place(1, &choices), None);
        // Equal keys fall back to the old rank.
        assert_eq!(split_place(2, &choices).map(|p| p.new_rank), Some(0));
        assert_eq!(split_place(4, &choices).map(|p| p.new_rank), Some(1));
        assert_eq!(
            split_place(3, &choices),
            Some(SplitPlace {
                color_index: 0,
                new_rank: 0
            })
        );
    }
}
