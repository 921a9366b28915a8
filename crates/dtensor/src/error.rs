//! The one error type of this crate.

use hypershard_mesh::{MeshError, Placement};
use hypershard_tensor::DType;

/// Every way a process mesh, a distributed tensor, a redistribute or a sharded op can fail.
///
/// Errors of the layers below are wrapped as they are ([`Error::Mesh`], [`Error::Tensor`],
/// [`Error::Comm`]); the other variants carry the op, the placements, the shapes and the rank
/// that made the input invalid.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The mesh rejected its input (shape, names, placements, shard math).
    #[error(transparent)]
    Mesh(#[from] MeshError),
    /// A local tensor operation failed.
    #[error(transparent)]
    Tensor(#[from] hypershard_tensor::Error),
    /// A collective failed (timeout, lost peer, argument mismatch between ranks, ...).
    #[error(transparent)]
    Comm(#[from] hypershard_collectives::Error),
    /// A rank of [`run_local`](crate::run_local) returned an error.
    #[error("rank {rank} failed: {source}")]
    RankFailed {
        /// The rank.
        rank: usize,
        /// Its error.
        source: Box<Error>,
    },
    /// A rank of [`run_local`](crate::run_local) panicked.
    #[error("rank {rank} panicked: {message}")]
    RankPanicked {
        /// The rank.
        rank: usize,
        /// The panic message.
        message: String,
    },
    /// Ranks of [`run_local`](crate::run_local) were still running at the deadline.
    #[error("ranks {unfinished:?} had not finished after {deadline:?}")]
    RankDeadline {
        /// The deadline.
        deadline: std::time::Duration,
        /// The ranks still running.
        unfinished: Vec<usize>,
    },
    /// A rank's thread could not be started.
    #[error("could not start the thread of rank {rank}: {reason}")]
    RankThread {
        /// The rank.
        rank: usize,
        /// Why.
        reason: String,
    },
    /// The mesh names a rank that the world communicator does not have.
    #[error(
        "the mesh holds rank {max_rank}, but the world communicator has only {world_size} ranks"
    )]
    MeshExceedsWorld {
        /// The largest rank in the mesh.
        max_rank: usize,
        /// The size of the world communicator.
        world_size: usize,
    },
    /// The calling rank is not part of the mesh (it still took part in the collective setup).
    #[error("rank {rank} is not in the mesh")]
    RankNotInMesh {
        /// The calling rank.
        rank: usize,
    },
    /// A communicator split gave no communicator to a rank that asked for a group.
    #[error(
        "{op}: the split of the world gave rank {rank} no communicator for mesh dim {mesh_dim}"
    )]
    SplitGaveNoGroup {
        /// The operation that split (`"ProcessMesh::new"`, `"flatten"`).
        op: &'static str,
        /// The calling rank.
        rank: usize,
        /// The mesh dimension whose group was being made.
        mesh_dim: usize,
    },
    /// A value (rank, dim, count) does not fit the integer type the wire or a split key needs.
    #[error("{op}: the value {value} does not fit the {target} it must be sent as")]
    ValueTooLarge {
        /// The operation.
        op: &'static str,
        /// The value.
        value: usize,
        /// The target type.
        target: &'static str,
    },
    /// A tensor dtype has no wire dtype in the collectives layer.
    #[error("{op}: dtype {dtype:?} cannot travel through a collective")]
    UnsupportedDType {
        /// The operation.
        op: &'static str,
        /// The dtype.
        dtype: DType,
    },
    /// A tensor's elements are not in host memory the bridge can read or write in place: a
    /// deferred (shape-only) tensor, or a strided destination for a byte write.
    #[error("{op}: the tensor's elements are not contiguous host memory")]
    NotHostMemory {
        /// The operation.
        op: &'static str,
    },
    /// A buffer handed back by a collective does not have the length or dtype expected.
    #[error(
        "{op}: the collective buffer holds {actual} elements of {wire_dtype}, expected {expected}"
    )]
    BufferMismatch {
        /// The operation.
        op: &'static str,
        /// The element count expected.
        expected: usize,
        /// The element count found.
        actual: usize,
        /// The buffer's wire dtype name.
        wire_dtype: &'static str,
    },
    /// A local tensor does not have the shape its placements and the global shape give.
    #[error(
        "{op}: rank {rank} holds a local tensor of shape {actual:?}, but global shape \
         {global_shape:?} with placements {placements:?} gives it {expected:?}"
    )]
    LocalShapeMismatch {
        /// The operation.
        op: &'static str,
        /// The rank whose local tensor is wrong.
        rank: usize,
        /// The global shape.
        global_shape: Vec<usize>,
        /// The placements.
        placements: Vec<Placement>,
        /// The shape the rank should hold.
        expected: Vec<usize>,
        /// The shape it holds.
        actual: Vec<usize>,
    },
    /// The ranks disagree about something that must be equal everywhere (a validating
    /// constructor found it).
    #[error("{op}: rank {rank} disagrees with rank {reference} about the {what}")]
    InconsistentAcrossRanks {
        /// The operation.
        op: &'static str,
        /// The first rank found to disagree.
        rank: usize,
        /// The rank it was compared with.
        reference: usize,
        /// What differs (`"dtype"`, `"placements"`, `"local shape"`, ...).
        what: &'static str,
    },
    /// A redistribute asked to turn one pending reduction into another on one mesh dim.
    #[error("redistribute: mesh dim {mesh_dim} cannot go from {from} to {to} (reduce first)")]
    PartialOpChange {
        /// The mesh dimension.
        mesh_dim: usize,
        /// The source placement.
        from: Placement,
        /// The requested placement.
        to: Placement,
    },
    /// Pending reductions on different mesh dims that do not commute (e.g. max over one dim,
    /// sum over another), so the full value would depend on the reduction order.
    #[error("{op}: placements {placements:?} mix partial reductions that do not commute")]
    MixedPartialOps {
        /// The operation.
        op: &'static str,
        /// The placements.
        placements: Vec<Placement>,
    },
    /// A replicated value cannot be written as a partial of this reduction.
    #[error("{op}: a replicated value cannot be made {placement} on mesh dim {mesh_dim}")]
    UnsupportedPartial {
        /// The operation.
        op: &'static str,
        /// The mesh dimension.
        mesh_dim: usize,
        /// The requested placement.
        placement: Placement,
    },
    /// The planner found no sequence of steps (a bug guard: every valid pair has one).
    #[error("redistribute: no plan from {from:?} to {to:?} for global shape {global_shape:?}")]
    NoPlan {
        /// The source placements.
        from: Vec<Placement>,
        /// The target placements.
        to: Vec<Placement>,
        /// The global shape.
        global_shape: Vec<usize>,
    },
    /// Two distributed tensors of one op live on different meshes.
    #[error("{op}: the operands live on different meshes ({lhs} and {rhs})")]
    MeshMismatch {
        /// The operation.
        op: &'static str,
        /// The left operand's mesh.
        lhs: String,
        /// The right operand's mesh.
        rhs: String,
    },
    /// The operands' global shapes do not fit the op.
    #[error("{op}: global shapes {lhs:?} and {rhs:?} do not fit")]
    ShapeMismatch {
        /// The operation.
        op: &'static str,
        /// The left shape.
        lhs: Vec<usize>,
        /// The right shape.
        rhs: Vec<usize>,
    },
    /// The operands' dtypes differ.
    #[error("{op}: dtypes {lhs:?} and {rhs:?} differ")]
    DTypeMismatch {
        /// The operation.
        op: &'static str,
        /// The left dtype.
        lhs: DType,
        /// The right dtype.
        rhs: DType,
    },
    /// A tensor dimension is out of range.
    #[error("{op}: dim {dim} is out of range for a {ndim}-d tensor")]
    DimOutOfRange {
        /// The operation.
        op: &'static str,
        /// The dimension.
        dim: usize,
        /// The tensor's number of dims.
        ndim: usize,
    },
    /// A sharded op has no propagation rule for these placements on one mesh dim (pass
    /// [`OpConfig::auto_redistribute`](crate::OpConfig) to let the op redistribute first).
    #[error("{op}: no sharding rule for {lhs} with {rhs} on mesh dim {mesh_dim}")]
    UnsupportedSharding {
        /// The operation.
        op: &'static str,
        /// The mesh dimension.
        mesh_dim: usize,
        /// The left operand's placement there.
        lhs: Placement,
        /// The right operand's placement there (`lhs` again for unary ops).
        rhs: Placement,
    },
    /// A reshape would split or merge a sharded tensor dimension.
    #[error("reshape: {from:?} -> {to:?} splits or merges a dim sharded by {placements:?}")]
    UnsupportedReshape {
        /// The global shape.
        from: Vec<usize>,
        /// The requested global shape.
        to: Vec<usize>,
        /// The placements.
        placements: Vec<Placement>,
    },
}

/// The result type of this crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;
