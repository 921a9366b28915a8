//! Backend-agnostic collectives for hypershard.
//!
//! * [`Communicator`]: the object-safe trait (`Arc<dyn Communicator>`) with all-reduce,
//!   all-gather, reduce-scatter (and their uneven `_v` variants), broadcast, reduce, gather,
//!   scatter, all-to-all, send/recv, barrier and `split`. Async by ownership: every op takes its
//!   [`Buffer`]s by value and [`Work::wait`] hands them back.
//! * [`ProgressEngine`]: the per-communicator worker thread that runs ops in issue order; every
//!   backend uses it.
//! * [`Store`]: the rendezvous key-value store ([`MemoryStore`], [`PrefixStore`]; the TCP store
//!   lives in `store::tcp`), and [`LaunchEnv`] for torchrun's variables.
//! * Backends: [`local`] (ranks as threads of one process) and `tcp` (processes, with a
//!   same-host shared-memory transport; cargo feature `tcp`, on by default).
//! * [`CommCounter`]: a wrapper that counts calls and bytes per op.
//! * `conformance`: the suite every backend must pass (cargo feature `testing`).
//!
//! See `docs/collectives.md` for the semantics of each op.
//!
//! The source is layered, each folder importing only from those listed before it: the root
//! files (the trait, buffers, errors, ops, the reduce kernels, the progress thread), then
//! `rendezvous/` (the stores), `agree/` (argument checks and the phase-0 agreement every
//! backend runs before data moves), `transport/` (TCP frames and mailboxes, shared-memory
//! rings), `algorithms/` (one per file), `backend/` (each backend's `Communicator` adapter),
//! and on top the watchdog, `init_default_from_env` and the test-only modules. xtask's tidy
//! test enforces the order.

mod agree;
#[cfg(feature = "tcp")]
mod algorithms;
#[cfg(feature = "tcp")]
pub mod auth;
mod backend;
// Byte-block arithmetic of the TCP and shared-memory transports.
#[cfg(feature = "tcp")]
mod blocks;
mod buffer;
mod communicator;
mod config;
#[cfg(feature = "testing")]
pub mod conformance;
mod counter;
#[cfg(feature = "nccl")]
mod device_buffer;
mod dtype;
mod engine;
mod env;
mod error;
#[cfg(feature = "tcp")]
mod frame_key;
#[cfg(all(feature = "testing", feature = "tcp"))]
#[doc(hidden)]
pub mod fuzzing;
#[cfg(feature = "tcp")]
mod init;
mod location;
mod op;
#[cfg(feature = "tcp")]
mod progress;
// The byte-slice kernels behind `ReducePlan` serve the wire backends (TCP, MPI); the local
// backend reduces typed slices, so a build without `tcp` leaves most of them unused.
#[cfg_attr(not(feature = "tcp"), allow(dead_code))]
mod reduce;
mod rendezvous;
pub mod store;
#[cfg(all(feature = "testing", feature = "tcp"))]
#[doc(hidden)]
pub mod testing;
mod transport;
#[cfg(feature = "tcp")]
pub mod watchdog;
mod work;

pub use backend::local;
#[cfg(feature = "mpi")]
pub use backend::mpi;
#[cfg(feature = "nccl")]
pub use backend::nccl;
#[cfg(feature = "tcp")]
pub use backend::tcp;
pub use buffer::{Buffer, BufferLocation, BufferPair, HostBuffer};
pub use communicator::{Communicator, CommunicatorExt};
pub use config::{CommConfig, DEFAULT_TIMEOUT, TIMEOUT_ENV, parse_seconds};
pub use counter::{CommCounter, CounterSnapshot, OpCount};
pub use dtype::{DType, Element};
pub use engine::{AbortFlag, JobContext, JobSpec, ProgressEngine};
pub use env::{BACKEND_ENV, BackendChoice, DEFAULT_MASTER_PORT, LaunchEnv, Launcher};
pub use error::{DeviceLibrary, Unavailable};
pub use error::{
    EnvExpectation, Error, IoAction, MpiInitProblem, MpiQuantity, ProtocolViolation, Result,
    SecretProblem,
};
#[cfg(feature = "tcp")]
pub use frame_key::{FrameKey, FrameKind};
#[cfg(feature = "tcp")]
pub use init::{DefaultWorld, init_default_from_env};
pub use op::{
    AllToAllCounts, Argument, BufferRole, Knob, OpKind, ReduceOp, StridedBlocks, block_offsets,
};
pub use store::{MemoryStore, PrefixStore, Store};
#[cfg(feature = "tcp")]
pub use transport::shm;
pub use work::{Completer, WaitOutcome, Work};

/// Re-exported so callers name `bf16`/`f16` the same way this crate does.
pub use half::{bf16, f16};
