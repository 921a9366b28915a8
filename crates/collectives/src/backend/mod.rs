//! The backends, each only its [`Communicator`](crate::Communicator) adapter over what lies
//! below: `local` (ranks as threads of one process), `tcp` (processes over the TCP and
//! shared-memory transports and the algorithms), `mpi` (the system's MPI) and `nccl` (CUDA
//! device buffers). Public as `collectives::{local, tcp, mpi, nccl}`.

pub mod local;
#[cfg(feature = "mpi")]
pub mod mpi;
#[cfg(feature = "nccl")]
pub mod nccl;
#[cfg(feature = "tcp")]
pub mod tcp;
