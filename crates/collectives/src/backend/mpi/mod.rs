//! The MPI backend (cargo feature `mpi`): a [`Communicator`](crate::Communicator) over the
//! system's MPI library through rsmpi, for jobs started by `mpirun` or `srun`.
//!
//! * **Async.** Every op is one nonblocking MPI call (`MPI_Iallreduce`,
//!   `MPI_Ireduce_scatter(_block)`, `MPI_Iallgatherv`, `MPI_Ibcast`, `MPI_Ireduce`,
//!   `MPI_Igather`, `MPI_Iscatter`, `MPI_Ialltoallv`, `MPI_Ibarrier`, `MPI_Isend`/`MPI_Irecv`)
//!   started and tested on the communicator's progress thread ([`ProgressEngine`](crate::ProgressEngine)),
//!   so ops run in issue order behind [`Work`](crate::Work) while the caller computes, and
//!   each op fails with [`Error::Timeout`](crate::Error::Timeout) when its deadline passes.
//!   A started MPI collective cannot be cancelled: a timed-out or aborted op's buffers are
//!   leaked (MPI may still write them) and the group must be abandoned, as with TCP.
//! * **Threads.** MPI is initialised with `MPI_THREAD_MULTIPLE` (required: every communicator,
//!   split children included, calls MPI from its own progress thread, plus one drain thread
//!   for eager sends). A library that provides less is
//!   [`MpiInitProblem::ThreadLevel`](crate::MpiInitProblem).
//! * **Agreement.** Before each op the ranks all-gather their op descriptors (the TCP
//!   backend's wire form) and run the shared checks, so mismatched lengths, dtypes, roots,
//!   reduce ops or counts give the same typed error on every rank — never MPI's undefined
//!   behaviour. This costs two small all-gathers per op (latency, not bandwidth).
//! * **Reductions.** MPI's predefined `SUM`/`MAX`/`MIN`/`PROD` on f32, f64, i32, i64 and u8.
//!   bf16 and f16 are staged through f32 (widened, reduced in f32, rounded back once). `Avg`
//!   is a sum scaled by `1/size` afterwards, `PreMulSum(f)` scales each contribution by `f`
//!   before the sum (both float-only, like NCCL).
//! * **Lifetime.** The first [`MpiCommunicator::world`] initialises MPI; `MPI_Finalize` runs
//!   when the last communicator and the last op on it are gone (after the send queue
//!   drained). Keep the world alive until the end of `main` and wait every op.
//! * **Limits.** Counts, displacements and tags must fit a C `int`
//!   ([`Error::MpiLimit`](crate::Error::MpiLimit)). Device buffers are rejected
//!   ([`Error::UnsupportedBuffer`](crate::Error::UnsupportedBuffer)).

mod agree;
mod communicator;
mod ops;
mod p2p;
mod raw;
mod runtime;
mod types;

pub use communicator::MpiCommunicator;
