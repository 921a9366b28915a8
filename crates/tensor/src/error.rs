//! The one error type of this crate.

use std::path::PathBuf;

use crate::{DType, Device, Stream};

/// Everything that can go wrong in a tensor operation.
///
/// Every variant names the operation (`op`) that failed and carries the shapes, dtypes, dims or
/// indices involved, so a caller can react to a failure without parsing a message.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// Two shapes that must be equal are not.
    #[error("{op}: shape mismatch, {lhs:?} vs {rhs:?}")]
    ShapeMismatch {
        /// The operation that failed.
        op: &'static str,
        /// The first shape.
        lhs: Vec<usize>,
        /// The second shape.
        rhs: Vec<usize>,
    },
    /// Two shapes cannot be broadcast together (numpy/torch rules).
    #[error("{op}: shapes {lhs:?} and {rhs:?} are not broadcastable")]
    NotBroadcastable {
        /// The operation that failed.
        op: &'static str,
        /// The first shape.
        lhs: Vec<usize>,
        /// The second shape.
        rhs: Vec<usize>,
    },
    /// A tensor cannot be expanded to the requested shape.
    #[error("{op}: cannot expand shape {shape:?} to {target:?}")]
    NotExpandable {
        /// The operation that failed.
        op: &'static str,
        /// The tensor's shape.
        shape: Vec<usize>,
        /// The requested shape.
        target: Vec<usize>,
    },
    /// Two dtypes that must be equal are not.
    #[error("{op}: dtype mismatch, {lhs} vs {rhs}")]
    DTypeMismatch {
        /// The operation that failed.
        op: &'static str,
        /// The first (or the tensor's) dtype.
        lhs: DType,
        /// The second (or the requested) dtype.
        rhs: DType,
    },
    /// The operation is not defined for this dtype.
    #[error("{op}: not supported for dtype {dtype}")]
    UnsupportedDType {
        /// The operation that failed.
        op: &'static str,
        /// The offending dtype.
        dtype: DType,
    },
    /// A dimension index is not below the number of dimensions.
    #[error("{op}: dim {dim} out of range for a tensor with {ndim} dims")]
    DimOutOfRange {
        /// The operation that failed.
        op: &'static str,
        /// The requested dim.
        dim: usize,
        /// The number of dims of the tensor.
        ndim: usize,
    },
    /// `start + len` exceeds the size of the dimension.
    #[error("{op}: range {start}..{start}+{len} out of bounds for dim {dim} of size {size}")]
    RangeOutOfBounds {
        /// The operation that failed.
        op: &'static str,
        /// The dim being sliced.
        dim: usize,
        /// The first index of the range.
        start: usize,
        /// The length of the range.
        len: usize,
        /// The size of the dim.
        size: usize,
    },
    /// A shape's element count does not match the data (or the other shape).
    #[error("{op}: shape {shape:?} has {expected} elements but {actual} were given")]
    NumelMismatch {
        /// The operation that failed.
        op: &'static str,
        /// The requested shape.
        shape: Vec<usize>,
        /// The element count of `shape`.
        expected: usize,
        /// The element count available.
        actual: usize,
    },
    /// The element count of a shape overflows `usize`.
    #[error("{op}: element count of shape {shape:?} overflows")]
    SizeOverflow {
        /// The operation that failed.
        op: &'static str,
        /// The shape whose size overflows.
        shape: Vec<usize>,
    },
    /// `view` was asked for a shape that the strides cannot express without a copy.
    #[error(
        "{op}: a tensor of shape {shape:?} and strides {strides:?} cannot be viewed as {target:?}; use reshape"
    )]
    NotViewable {
        /// The operation that failed.
        op: &'static str,
        /// The tensor's shape.
        shape: Vec<usize>,
        /// The tensor's strides.
        strides: Vec<usize>,
        /// The requested shape.
        target: Vec<usize>,
    },
    /// The operation needs a contiguous tensor.
    #[error("{op}: tensor of shape {shape:?} and strides {strides:?} is not contiguous")]
    NotContiguous {
        /// The operation that failed.
        op: &'static str,
        /// The tensor's shape.
        shape: Vec<usize>,
        /// The tensor's strides.
        strides: Vec<usize>,
    },
    /// A write targets a view in which several elements alias one memory location.
    #[error(
        "{op}: cannot write into a view with overlapping elements (shape {shape:?}, strides {strides:?})"
    )]
    OverlappingWrite {
        /// The operation that failed.
        op: &'static str,
        /// The destination's shape.
        shape: Vec<usize>,
        /// The destination's strides.
        strides: Vec<usize>,
    },
    /// `chunk` was asked for zero chunks or `split` for chunks of size zero.
    #[error("{op}: {count} is not a valid number or size of pieces")]
    InvalidPieceCount {
        /// The operation that failed.
        op: &'static str,
        /// The requested count or size.
        count: usize,
    },
    /// The sizes given to `split_with_sizes` do not add up to the dim size.
    #[error("{op}: split sizes {sizes:?} do not sum to the size {size} of dim {dim}")]
    SplitSizesMismatch {
        /// The operation that failed.
        op: &'static str,
        /// The dim being split.
        dim: usize,
        /// The requested sizes.
        sizes: Vec<usize>,
        /// The size of the dim.
        size: usize,
    },
    /// A permutation is not a permutation of `0..ndim`.
    #[error("{op}: {perm:?} is not a permutation of 0..{ndim}")]
    InvalidPermutation {
        /// The operation that failed.
        op: &'static str,
        /// The requested permutation.
        perm: Vec<usize>,
        /// The number of dims of the tensor.
        ndim: usize,
    },
    /// `flatten` was given `start_dim > end_dim`.
    #[error("{op}: start dim {start} is after end dim {end}")]
    InvalidDimRange {
        /// The operation that failed.
        op: &'static str,
        /// The first dim.
        start: usize,
        /// The last dim.
        end: usize,
    },
    /// An operation that needs at least one input got none.
    #[error("{op}: needs at least one tensor")]
    EmptyInput {
        /// The operation that failed.
        op: &'static str,
    },
    /// A reduction without an identity (max) over an empty dim.
    #[error("{op}: cannot reduce over dim {dim} of size zero")]
    EmptyReduction {
        /// The operation that failed.
        op: &'static str,
        /// The reduced dim.
        dim: usize,
    },
    /// `item` on a tensor that does not have exactly one element.
    #[error("{op}: tensor of shape {shape:?} does not hold exactly one element")]
    NotScalar {
        /// The operation that failed.
        op: &'static str,
        /// The tensor's shape.
        shape: Vec<usize>,
    },
    /// An index (a token id or a class target) is outside the table it indexes.
    #[error("{op}: index {index} at position {position} is out of range for size {size}")]
    IndexOutOfRange {
        /// The operation that failed.
        op: &'static str,
        /// The flat position of the index in its tensor.
        position: usize,
        /// The index.
        index: i64,
        /// The size of the table.
        size: usize,
    },
    /// Integer division by zero.
    #[error("{op}: integer division by zero")]
    DivisionByZero {
        /// The operation that failed.
        op: &'static str,
    },
    /// Distribution parameters that do not describe a distribution.
    #[error("{op}: invalid distribution parameters ({first}, {second})")]
    InvalidDistribution {
        /// The operation that failed.
        op: &'static str,
        /// `low` of a uniform, `mean` of a normal.
        first: f64,
        /// `high` of a uniform, `std` of a normal.
        second: f64,
    },
    /// A block does not lie inside its global tensor.
    #[error(
        "{op}: block at offset {offset:?} of shape {block_shape:?} does not fit in {global_shape:?}"
    )]
    BlockOutOfBounds {
        /// The operation that failed.
        op: &'static str,
        /// The shape of the global tensor.
        global_shape: Vec<usize>,
        /// The block's offset in the global tensor.
        offset: Vec<usize>,
        /// The block's shape.
        block_shape: Vec<usize>,
    },
    /// The tensor is deferred (shape and dtype only): it has no data to read or write.
    #[error(
        "{op}: the tensor is deferred (shape and dtype only, no data); materialise it first \
         (fully_shard materialises each rank's shard)"
    )]
    Deferred {
        /// The operation that needed the data.
        op: &'static str,
    },
    /// A host read or write (`to_vec`, `item`, `with_data`...) of data on a device; copy it
    /// with [`Tensor::to_host`](crate::Tensor::to_host) first.
    #[error("{op}: the data is on {device}, not the host; copy it with to_host first")]
    DeviceData {
        /// The operation that needed host data.
        op: &'static str,
        /// Where the data is.
        device: Device,
    },
    /// An operation's tensors are on different devices; move one with
    /// [`Tensor::to_device`](crate::Tensor::to_device).
    #[error("{op}: tensors on different devices, {lhs} vs {rhs}")]
    DeviceMismatch {
        /// The operation that failed.
        op: &'static str,
        /// The first (or destination) tensor's device.
        lhs: Device,
        /// The second (or source) tensor's device.
        rhs: Device,
    },
    /// The operation is not available on this device (no kernel for it there, or no device
    /// memory on the host).
    #[error("{op}: not available on {device}")]
    DeviceUnsupported {
        /// The operation that failed.
        op: &'static str,
        /// The device.
        device: Device,
    },
    /// An access to device memory whose last write, on another stream, may not have finished:
    /// synchronise the writer or make the reader wait for it first.
    #[error(
        "{op}: memory last written on {writer} is accessed on {reader} without synchronisation"
    )]
    StreamOrder {
        /// The operation that failed.
        op: &'static str,
        /// The stream of the last write.
        writer: Stream,
        /// The stream of the refused access.
        reader: Stream,
    },
    /// The device's driver or runtime failed (a GPU that is missing, out of memory...).
    #[error("{op}: {device} failed: {reason}")]
    DeviceFailed {
        /// The operation that failed.
        op: &'static str,
        /// The device.
        device: Device,
        /// The driver's error, as text.
        reason: String,
    },
    /// A tensor cannot be materialised from its deferred recipe.
    #[error("{op}: cannot materialise: {reason}")]
    NotMaterializable {
        /// The operation that failed.
        op: &'static str,
        /// Why.
        reason: &'static str,
    },
    /// A safetensors file holds a dtype this crate does not support.
    #[error("{op}: tensor {name:?} has unsupported safetensors dtype {dtype}")]
    UnsupportedFileDType {
        /// The operation that failed.
        op: &'static str,
        /// The tensor's name in the file.
        name: String,
        /// The dtype as the safetensors crate spells it.
        dtype: String,
    },
    /// The safetensors crate rejected the data (feature `safetensors`).
    #[cfg(feature = "safetensors")]
    #[error("{op}: safetensors error")]
    Safetensors {
        /// The operation that failed.
        op: &'static str,
        /// The underlying error.
        #[source]
        source: safetensors::SafeTensorError,
    },
    /// Reading or writing a file failed.
    #[error("{op}: I/O error on {path:?}")]
    Io {
        /// The operation that failed.
        op: &'static str,
        /// The file involved.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },
}

/// The result type of this crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;
