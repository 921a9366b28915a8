//! The local dense tensor of hypershard.
//!
//! A [`Tensor`] is shared storage plus a dtype, shape, strides and an offset (in elements).
//! It is deliberately small: what DTensor and FSDP need on one rank (views into flat buffers,
//! casts, elementwise math, reductions, seeded initialisation, safetensors checkpoints), with
//! typed errors instead of panics.
//!
//! # Storage
//!
//! [`Storage`] is an enum (`#[non_exhaustive]`) with three kinds:
//!
//! * [`Storage::Host`]: a [`HostBuffer`], 64-byte aligned and zero-initialised, built from a
//!   `Vec` of 64-byte blocks so that no `unsafe` is needed. Every op runs here.
//! * [`Storage::Deferred`]: no bytes at all, only a length and a recipe (the meta device: see
//!   [`deferred`]), so a model can be described on a rank that could not hold it. Every kernel
//!   refuses it with [`Error::Deferred`].
//! * [`Storage::Device`]: a [`DeviceBuffer`] on a [`Device`], reached only through its
//!   backend ([`DeviceBackend`], [`DeviceMemory`]: allocate, copies host → device,
//!   device → host and device → device, fill, each ordered on a [`Stream`]). Two backends:
//!   the [`emulated`] device (host memory behind the device API, stream ordering checked; for
//!   testing the device path without a GPU) and, behind the `cuda` feature, CUDA memory.
//!
//! Tensors hold an `Arc<`[`SharedStorage`]`>`; the storage is freed when the last view of it
//! is dropped. [`Tensor::device`] says where the data is; [`Tensor::to_device`] and
//! [`Tensor::to_host`] copy explicitly. Ops are written once and dispatch on the storage:
//! their output goes where their inputs are, an op whose inputs are on different devices is
//! [`Error::DeviceMismatch`] naming the op and both devices, and a host read of device data
//! (`to_vec`, `item`, `with_data`, ...) is [`Error::DeviceData`] naming the op and the device.
//! On the emulated device every op of this crate runs (the host kernels, executed on the
//! emulated memory through the backend); on a CUDA device the copies and views run, and an op
//! with no CUDA kernel wired to it is [`Error::DeviceUnsupported`]. Views (`narrow`,
//! `reshape`, `transpose`, `expand`, ...) only change the layout, so they work on every kind.
//!
//! # Views and aliasing
//!
//! `narrow`, `chunk`, `split`, `split_with_sizes`, `view`, `transpose`, `permute`, `expand`,
//! `unsqueeze`, `squeeze` and (when possible) `reshape`/`flatten` return views: new
//! shape/strides/offset over the same `Arc`. Writes through a view (`copy_from`, `fill_`,
//! `add_`, `axpy`, `with_data_mut`, ...) take `&self` and are visible through every other view
//! of the storage, which is what FSDP needs: write a shard into its slice of a flat all-gather
//! buffer, then read parameters as views into that buffer.
//!
//! Soundness comes from a reader-writer lock per storage, not from `unsafe`: reads hold the
//! read lock and a write holds the write lock for one whole operation, so no operation sees
//! another half-done. When an operation needs two storages it locks them in address order,
//! so two threads cannot deadlock; when source and destination are the same storage, the
//! source is copied out first, so overlapping copies (`t[0..5] = t[1..6]`) are well defined.
//! A write into a view with stride-0 (expanded) dims is rejected with
//! [`Error::OverlappingWrite`], as in torch. Concurrent writers to *disjoint* views of one
//! storage serialise on the lock; that is correct, merely not parallel.
//!
//! # Dtypes
//!
//! [`DType`]: f32, f64, bf16, f16 (the `half` crate), i32, i64, u8, bool (one byte, 0/1).
//! Binary ops need equal dtypes (no implicit promotion); cast with [`Tensor::to_dtype`] or
//! let [`Tensor::copy_from`] cast on the way in. bf16/f16 compute and accumulate in f32.
//!
//! # Random tensors
//!
//! [`Tensor::random`] and [`Tensor::random_block`] use a counter-based generator (see
//! [`random`]): the value at global flat index `i` depends only on `(seed, i)`, so a block of
//! a global tensor made on its own equals the same block of the full tensor.
//!
//! ```
//! use hypershard_tensor::{DType, Tensor};
//! let flat = Tensor::zeros(&[8], DType::F32)?;
//! let (w, b) = (flat.narrow(0, 0, 6)?.view(&[2, 3])?, flat.narrow(0, 6, 2)?);
//! flat.copy_from(&Tensor::arange(8, DType::F32)?)?;
//! assert_eq!(w.sum(1, false)?.to_vec::<f32>()?, vec![3.0, 12.0]);
//! assert_eq!(b.to_vec::<f32>()?, vec![6.0, 7.0]);
//! # Ok::<(), hypershard_tensor::Error>(())
//! ```
#![deny(missing_docs)]

mod copy;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod deferred;
mod device;
mod dtype;
pub mod emulated;
mod error;
#[cfg(feature = "safetensors")]
mod io;
pub mod kernel_access;
mod layout;
mod lock;
pub mod memory;
mod ops;
pub mod random;
mod reduce;
mod storage;
mod tensor;
mod transfer;
mod view;

pub use deferred::{DeferredStorage, Fill, deferred_init, in_deferred_init};
pub use device::{Device, DeviceBackend, DeviceBuffer, DeviceMemory, Stream, StreamScope};
pub use dtype::{DType, Element};
pub use error::{Error, Result};
#[cfg(feature = "safetensors")]
pub use io::{load_safetensors, load_safetensors_file, save_safetensors, save_safetensors_file};
pub use random::{Block, Distribution, RandomInit};
pub use storage::{ForeignBytes, HOST_ALIGN, HostBuffer, SharedStorage, Storage};
pub use tensor::Tensor;
