//! Agreement: what every backend runs before any data moves.
//!
//! An op starts with *phase 0*: each rank checks its own arguments ([`args`], recording the
//! first error in [`Faults`] instead of returning it), describes its call in a [`Desc`], and
//! the ranks exchange descriptors (in memory on `local`, in the wire form of [`descriptor`]
//! on TCP and MPI). Every rank then runs the same [`validate`] over the same descriptors, so
//! all of them reach the same verdict: an argument error or a cross-rank disagreement fails
//! the op on every rank, and nobody is left waiting for data that will not come.
//!
//! This folder sits above the crate's root types (errors, buffers, ops, the reduce kernels)
//! and below the transports, algorithms and backends; it imports nothing from them.

pub(crate) mod args;
mod desc;
#[cfg(feature = "tcp")]
pub(crate) mod descriptor;
mod faults;
#[cfg(not(feature = "tcp"))]
mod knobs_absent;
mod slices;
mod validate;

pub(crate) use desc::Desc;
#[cfg(feature = "tcp")]
pub(crate) use descriptor::AlgorithmKnobs;
pub(crate) use faults::Faults;
#[cfg(not(feature = "tcp"))]
pub(crate) use knobs_absent::AlgorithmKnobs;
pub(crate) use slices::{block, copy_into, elements};
pub(crate) use validate::{peer_view, validate};
