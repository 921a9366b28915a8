//! The one error type of this crate.

use hypershard_tensor::DType;

use crate::state::{ShardedState, TrainingState};

/// Everything that can go wrong while sharding, unsharding or reducing.
///
/// Variants name the unit, parameter, shapes, dtypes or sizes involved so a caller can react
/// without parsing a message.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum FsdpError {
    /// A module operation failed inside a unit.
    #[error(transparent)]
    Nn(#[from] hypershard_nn::Error),
    /// A tensor operation failed.
    #[error(transparent)]
    Tensor(#[from] hypershard_tensor::Error),
    /// A collective failed.
    #[error(transparent)]
    Comm(#[from] hypershard_collectives::Error),
    /// A DTensor operation failed (process mesh, state dict).
    #[error(transparent)]
    DTensor(Box<hypershard_dtensor::Error>),
    /// Mesh math failed.
    #[error(transparent)]
    Mesh(#[from] hypershard_mesh::MeshError),
    /// `fully_shard` needs a 1-d (FSDP) or 2-d (HSDP) data-parallel mesh.
    #[error("fully_shard needs a 1-d or 2-d mesh, got {ndim} dims")]
    MeshDims {
        /// The number of dims of the mesh given.
        ndim: usize,
    },
    /// The mesh and the communicator disagree on the number of ranks, or the rank is absent.
    #[error(
        "mesh of {mesh_ranks} ranks does not match communicator of size {comm_size} (rank {rank})"
    )]
    WorldSizeMismatch {
        /// The number of ranks in the mesh.
        mesh_ranks: usize,
        /// The size of the communicator.
        comm_size: usize,
        /// This rank.
        rank: usize,
    },
    /// `shard_placement_fn` asked for a dim the parameter does not have.
    #[error("parameter `{param}` of shape {shape:?}: shard dim {dim} is out of range")]
    ShardDimOutOfRange {
        /// The parameter.
        param: String,
        /// Its shape.
        shape: Vec<usize>,
        /// The requested dim.
        dim: usize,
    },
    /// A parameter was named both in `ignored_params` and in `replicate_params`.
    #[error("parameter `{param}` is both ignored and replicated")]
    IgnoredAndReplicated {
        /// The parameter.
        param: String,
    },
    /// A name in `ignored_params` or `replicate_params` matches no parameter of the module.
    #[error("{list} names `{param}`, which is not a parameter of the module")]
    UnknownParam {
        /// Which list (`"ignored_params"` or `"replicate_params"`).
        list: &'static str,
        /// The name.
        param: String,
    },
    /// The module is already a `fully_shard` unit.
    #[error("module is already wrapped by fully_shard")]
    AlreadySharded,
    /// `reshard_after_forward = int(k)` needs `k` to divide the shard group size.
    #[error("reshard_after_forward = {value} does not divide the shard group size {shard_world}")]
    ReshardSize {
        /// The requested post-forward group size.
        value: usize,
        /// The shard group size.
        shard_world: usize,
    },
    /// A parameter dtype that collectives cannot carry (bool).
    #[error("parameter `{param}`: dtype {dtype} cannot be sharded")]
    UnsupportedDType {
        /// The parameter.
        param: String,
        /// Its dtype.
        dtype: DType,
    },
    /// A parameter was found in a state an operation does not accept.
    #[error(
        "unit `{unit}`, parameter `{param}`: {op} expects state {expected:?}, found {actual:?}"
    )]
    InvalidState {
        /// The unit (the kind of the wrapped module and its id).
        unit: String,
        /// The parameter.
        param: String,
        /// The operation.
        op: &'static str,
        /// The states it accepts.
        expected: &'static [ShardedState],
        /// The state found.
        actual: ShardedState,
    },
    /// At a data-parallel world of one rank the unsharded parameter is the shard itself, and
    /// the model wrote a gradient into its memory (an in-place trick meant for all-gathered
    /// copies, such as nn's `Gpt::keep_head_grad_in_gathered_weight`): the parameter is lost.
    #[error(
        "unit `{unit}`, parameter `{param}`: its gradient was written into the parameter's own \
         memory; at a data-parallel world of one rank the unsharded parameter is the shard \
         itself, so in-place gradient tricks for gathered weights must be off"
    )]
    GradAliasesParam {
        /// The unit (the kind of the wrapped module and its id).
        unit: String,
        /// The parameter.
        param: String,
    },
    /// A unit's hook ran in a training state that does not allow it (a forward recomputed
    /// during backward and then a new forward instead of the unit's backward, or a hook
    /// re-entered).
    #[error("{unit}: cannot go from training state {from:?} to {to:?}")]
    TrainingTransition {
        /// The unit (the kind of the wrapped module and its id).
        unit: String,
        /// The state the unit was in.
        from: TrainingState,
        /// The state the hook needed to enter.
        to: TrainingState,
    },
    /// The module's parameter was replaced behind fully_shard's back (its storage changed).
    #[error("parameter `{param}` was replaced outside fully_shard (use load_state_dict)")]
    ParamReplaced {
        /// The parameter.
        param: String,
    },
    /// A parameter managed by the unit disappeared from the module.
    #[error("parameter `{param}` managed by unit `{unit}` is missing from the module")]
    ParamMissing {
        /// The unit.
        unit: String,
        /// The parameter.
        param: String,
    },
    /// A state dict entry has the wrong shape.
    #[error(
        "state dict entry `{name}`: expected shape {expected:?} (or local {local:?}), got {actual:?}"
    )]
    StateDictShape {
        /// The entry.
        name: String,
        /// The global shape.
        expected: Vec<usize>,
        /// The local shard shape.
        local: Vec<usize>,
        /// What was given.
        actual: Vec<usize>,
    },
    /// A state dict lacks an entry the module needs.
    #[error("state dict has no entry `{name}`")]
    StateDictMissing {
        /// The entry.
        name: String,
    },
    /// Saved pieces do not cover this rank's local box of a parameter exactly once.
    #[error("saved shards of `{name}` cover {covered} of the {needed} local elements")]
    SavedShardsIncomplete {
        /// The parameter.
        name: String,
        /// Elements the pieces cover (overlapping distinct pieces count twice).
        covered: usize,
        /// Elements of the local box.
        needed: usize,
    },
    /// A managed parameter is not on the unit's device (a module with parameters on two
    /// devices, or parameters elsewhere than [`FullyShardConfig::device`]).
    ///
    /// [`FullyShardConfig::device`]: crate::FullyShardConfig::device
    #[error(
        "fully_shard: parameter `{param}` is on {actual:?}, but the unit's parameters are on \
         {expected:?}; move the module to one device first (hypershard_nn::to_device)"
    )]
    ParamDevice {
        /// The parameter's name relative to the wrapped module.
        param: String,
        /// The unit's device.
        expected: hypershard_tensor::Device,
        /// The parameter's device.
        actual: hypershard_tensor::Device,
    },
    /// A communication buffer was not in host memory.
    #[error("{op}: tensor storage is not host memory")]
    NotHostStorage {
        /// The operation.
        op: &'static str,
    },
    /// A buffer came back from a collective with an unexpected length.
    #[error("{op}: buffer of {actual} elements, expected {expected}")]
    BufferLength {
        /// The operation.
        op: &'static str,
        /// The expected length.
        expected: usize,
        /// The length found.
        actual: usize,
    },
    /// `fully_shard_group` was given no modules.
    #[error("fully_shard_group needs at least one module")]
    EmptyGroup,
    /// `fully_shard_group` refused one of its modules (e.g. one already wrapped, or in
    /// another group).
    #[error("fully_shard_group: module {member} of the list: {source}")]
    GroupMember {
        /// The position of the refused module in the list.
        member: usize,
        /// Why it was refused.
        source: Box<FsdpError>,
    },
    /// A member of a `fully_shard_group` unit ran its forward or backward out of order
    /// (forwards run in list order, backwards in reverse list order after a full forward).
    #[error(
        "unit `{unit}`: member {member}'s {op} ran out of order (expected member {expected:?} next)"
    )]
    GroupOrder {
        /// The unit.
        unit: String,
        /// `"forward"` or `"backward"`.
        op: &'static str,
        /// The member that ran.
        member: usize,
        /// The member whose `op` should run next, or `None` when no member's `op` may run now
        /// (a backward before a complete forward, or a forward while a backward is half done).
        expected: Option<usize>,
    },
    /// A TP mesh must have exactly one dim.
    #[error("a tensor-parallel mesh needs 1 dim, got {ndim}")]
    TpMeshDims {
        /// The number of dims of the mesh given.
        ndim: usize,
    },
    /// The module holds tensor-parallel layers but the config has no `tensor_parallel`.
    #[error("parameter `{param}` is tensor-parallel but the config has no tensor_parallel")]
    TpConfigMissing {
        /// A parameter of a tensor-parallel layer.
        param: String,
    },
    /// The meshes of tensor parallelism and data parallelism do not fit together.
    #[error("tensor parallelism: {what}")]
    TpMeshMismatch {
        /// What does not fit.
        what: String,
    },
    /// A feature that is not built for tensor parallelism.
    #[error("{what} is not supported with tensor parallelism")]
    TpUnsupported {
        /// The feature.
        what: &'static str,
    },
    /// An FSDP hook failed in a nested unit; the root reports the first such error.
    #[error("a nested fully_shard hook failed and its error was already taken")]
    NestedHookFailed,
}

impl From<hypershard_dtensor::Error> for FsdpError {
    fn from(error: hypershard_dtensor::Error) -> Self {
        // Boxed: the DTensor error is large and would bloat every result of this crate.
        FsdpError::DTensor(Box::new(error))
    }
}

/// The result type of this crate.
pub type Result<T> = std::result::Result<T, FsdpError>;
