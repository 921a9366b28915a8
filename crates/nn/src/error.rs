//! The one error type of this crate.

use hypershard_tensor::DType;

/// Everything that can go wrong in a module, loss or optimizer.
///
/// Variants carry the operation (`op`), the module kind, the parameter name, shapes or dtypes
/// involved, so a caller can react without parsing a message.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A tensor operation failed.
    #[error(transparent)]
    Tensor(#[from] hypershard_tensor::Error),
    /// A parameter's storage is not materialised on this rank (for example, sharded away).
    #[error("parameter `{name}` is not materialised")]
    NotMaterialised {
        /// The parameter's name as stored in the [`Parameter`](crate::Parameter).
        name: String,
    },
    /// A parameter built deferred (shape and dtype only) was used before being materialised.
    #[error(
        "parameter `{name}` is deferred (shape and dtype only, no data): wrap its module with \
         fully_shard, which materialises each rank's shard, or call materialize_module first"
    )]
    Deferred {
        /// The parameter's name as stored in the [`Parameter`](crate::Parameter).
        name: String,
    },
    /// A deferred parameter could not be materialised (no recipe and no init hook, or the hook
    /// failed or returned the wrong block).
    #[error("parameter `{name}`: cannot materialise: {reason}")]
    Materialize {
        /// The parameter's name.
        name: String,
        /// Why, in words.
        reason: String,
    },
    /// A model with a fused loss head ran its forward without targets set for it.
    #[error(
        "{module}: the loss head is fused but no targets were set for this forward (LossTargets::for_backward or for_eval)"
    )]
    LossTargetsMissing {
        /// The kind of module, e.g. `"GPT"`.
        module: &'static str,
    },
    /// `backward` was called without a preceding `forward` (or twice after one forward).
    #[error("{module}: backward called without a preceding forward")]
    BackwardBeforeForward {
        /// The kind of module, e.g. `"Linear"`.
        module: &'static str,
    },
    /// A tensor has a shape the operation does not accept.
    #[error("{op}: expected shape {expected}, got {actual:?}")]
    BadShape {
        /// The operation that failed.
        op: &'static str,
        /// What the operation expects, in words (e.g. `"[*, 4]"`).
        expected: String,
        /// The shape it got.
        actual: Vec<usize>,
    },
    /// Two shapes that must agree do not.
    #[error("{op}: shape mismatch, {lhs:?} vs {rhs:?}")]
    ShapeMismatch {
        /// The operation that failed.
        op: &'static str,
        /// The first shape.
        lhs: Vec<usize>,
        /// The second shape.
        rhs: Vec<usize>,
    },
    /// Two dtypes that must agree do not.
    #[error("{op}: dtype mismatch, {lhs} vs {rhs}")]
    DTypeMismatch {
        /// The operation that failed.
        op: &'static str,
        /// The first dtype.
        lhs: DType,
        /// The second dtype.
        rhs: DType,
    },
    /// The operation does not support this dtype.
    #[error("{op}: dtype {dtype} is not supported")]
    UnsupportedDType {
        /// The operation that failed.
        op: &'static str,
        /// The offending dtype.
        dtype: DType,
    },
    /// A class index is neither in `0..classes` nor the ignore index.
    #[error("{op}: target {target} at position {position} is outside 0..{classes}")]
    TargetOutOfRange {
        /// The operation that failed.
        op: &'static str,
        /// The position of the target in the flattened targets.
        position: usize,
        /// The offending target.
        target: i64,
        /// The number of classes.
        classes: usize,
    },
    /// An index into a table (an embedding row) is outside `0..size`.
    #[error("{op}: index {index} at position {position} is outside 0..{size}")]
    IndexOutOfRange {
        /// The operation that failed.
        op: &'static str,
        /// The position of the index in the flattened indices.
        position: usize,
        /// The offending index.
        index: i64,
        /// The size of the table.
        size: usize,
    },
    /// A configuration value is outside its valid range.
    #[error("{op}: invalid {field} = {value}: {reason}")]
    InvalidConfig {
        /// The constructor that rejected the value.
        op: &'static str,
        /// The configuration field.
        field: &'static str,
        /// The rejected value.
        value: f64,
        /// Why it is rejected.
        reason: &'static str,
    },
    /// A checkpoint lacks a tensor the module has.
    #[error("{op}: tensor `{name}` is missing from the checkpoint")]
    MissingTensor {
        /// The loader.
        op: &'static str,
        /// The parameter's dotted name.
        name: String,
    },
    /// A checkpoint has a tensor the module does not.
    #[error("{op}: tensor `{name}` in the checkpoint matches no parameter")]
    UnexpectedTensor {
        /// The loader.
        op: &'static str,
        /// The tensor's name in the checkpoint.
        name: String,
    },
    /// A checkpoint tensor's shape differs from the parameter's (a config mismatch).
    #[error(
        "{op}: tensor `{name}` has shape {actual:?} in the checkpoint, the model expects {expected:?}"
    )]
    CheckpointShape {
        /// The loader.
        op: &'static str,
        /// The parameter's dotted name.
        name: String,
        /// The parameter's shape.
        expected: Vec<usize>,
        /// The checkpoint tensor's shape.
        actual: Vec<usize>,
    },
    /// A thread pool for [`with_num_threads`](crate::with_num_threads) could not be built.
    #[error("could not build a pool of {threads} threads: {source}")]
    ThreadPool {
        /// The requested number of threads.
        threads: usize,
        /// Why rayon refused.
        #[source]
        source: rayon::ThreadPoolBuildError,
    },
    /// An error raised by a layer outside this crate that runs inside a module's `forward` or
    /// `backward` (for example a `fully_shard` hook), carried whole so the caller can
    /// downcast [`source`](std::error::Error::source) to the original typed error.
    #[error("{op}: {source}")]
    Foreign {
        /// The foreign layer, e.g. `"fully_shard hook"`.
        op: &'static str,
        /// The original error.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync + 'static>,
    },
    /// Activation checkpointing could not replay a forward: the wrapped module has a
    /// different number of random streams (dropout layers) than when its forward ran, so the
    /// recomputation would not draw the same masks.
    #[error(
        "Checkpointed({module}): {expected} random streams at forward, {actual} at the recomputation"
    )]
    RecomputeMismatch {
        /// The kind of the wrapped module.
        module: &'static str,
        /// The number of random streams when the forward ran.
        expected: usize,
        /// The number now.
        actual: usize,
    },
    /// A size does not fit the integer type a kernel needs.
    #[error("{op}: size {size} does not fit the kernel's index type")]
    SizeOverflow {
        /// The operation that failed.
        op: &'static str,
        /// The offending size.
        size: usize,
    },
}

/// The result type of this crate.
pub type Result<T> = std::result::Result<T, Error>;
