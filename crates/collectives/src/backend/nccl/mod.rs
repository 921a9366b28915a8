//! The NCCL backend (feature `nccl`): a [`Communicator`](crate::Communicator) over CUDA
//! device buffers, through cudarc's NCCL and driver bindings.
//!
//! * [`NcclCommunicator::new`] joins a world of one CUDA device per rank; the NCCL unique id
//!   travels through the job's [`Store`](crate::Store). `split` gives each new group a fresh
//!   id the same way (cudarc has no safe `ncclCommSplit`).
//! * [`DeviceBuffer`] ([`Buffer::Cuda`](crate::Buffer::Cuda)) is device memory; host buffers
//!   are staged through the device.
//! * Ops run on the communicator's own stream; their [`Work`](crate::Work) completes on a CUDA
//!   event. [`NcclCommunicator::group`] fuses ops into one NCCL group.
//! * Nothing here panics when CUDA or NCCL is missing: [`probe`] (and every constructor)
//!   returns [`Error::BackendUnavailable`](crate::Error::BackendUnavailable). pip's NCCL
//!   ships only `libnccl.so.2`; see [`NCCL_LIB_ENV`] and `docs/gpu.md`.

mod communicator;
mod completion;
mod ffi;
mod library;
mod placement;
mod plan;
mod split;

pub use crate::device_buffer::DeviceBuffer;
pub use communicator::{NcclCommunicator, NcclInit, accepts};
pub use library::{NCCL_LIB_ENV, probe};
pub use placement::{device_count, device_for_local_rank};
