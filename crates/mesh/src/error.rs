//! The one error type of this crate.

/// Every way a mesh, placement or shard computation can reject its input.
///
/// Each variant carries the values that made the input invalid, so a caller can report
/// exactly which rank, dimension or shape was at fault.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum MeshError {
    /// A mesh needs at least one dimension.
    #[error("a device mesh needs at least one dimension, got shape []")]
    EmptyMesh,
    /// A mesh dimension has size zero, so the mesh would hold no rank.
    #[error("mesh dimension {dim} has size 0 in shape {shape:?}")]
    ZeroSizeDim {
        /// The index of the zero-size dimension.
        dim: usize,
        /// The whole mesh shape.
        shape: Vec<usize>,
    },
    /// The product of the mesh shape does not fit in `usize`.
    #[error("mesh shape {shape:?} holds more ranks than usize can count")]
    MeshTooLarge {
        /// The offending mesh shape.
        shape: Vec<usize>,
    },
    /// Dimension names were given, but not one per mesh dimension.
    #[error("got {names} dimension names for a {ndim}-d mesh")]
    NameCountMismatch {
        /// How many names were given.
        names: usize,
        /// How many dimensions the mesh has.
        ndim: usize,
    },
    /// Two mesh dimensions would carry the same name.
    #[error("dimension name {name:?} is used more than once")]
    DuplicateDimName {
        /// The repeated name.
        name: String,
    },
    /// No mesh dimension carries the requested name.
    #[error("no mesh dimension is named {name:?}; the dimensions are {names:?}")]
    UnknownDimName {
        /// The requested name.
        name: String,
        /// The names the mesh has (`None` for an unnamed dimension).
        names: Vec<Option<String>>,
    },
    /// A dimension index is not below the mesh's number of dimensions.
    #[error("mesh dimension {dim} is out of range for a {ndim}-d mesh")]
    DimOutOfRange {
        /// The requested dimension index.
        dim: usize,
        /// How many dimensions the mesh has.
        ndim: usize,
    },
    /// The same mesh dimension was listed twice in one `select` or `flatten`.
    #[error("mesh dimension {dim} is listed more than once")]
    DuplicateDim {
        /// The index of the repeated dimension.
        dim: usize,
    },
    /// A `select` or `flatten` was asked for with no dimension at all.
    #[error("{op} needs at least one mesh dimension")]
    NoDims {
        /// The operation that was called (`"select"` or `"flatten"`).
        op: &'static str,
    },
    /// An explicit rank array does not hold one rank per mesh position.
    #[error("mesh shape {shape:?} needs {expected} ranks, got {ranks}")]
    RankCountMismatch {
        /// How many ranks were given.
        ranks: usize,
        /// How many the shape needs (the product of its sizes).
        expected: usize,
        /// The mesh shape.
        shape: Vec<usize>,
    },
    /// An explicit rank array holds the same rank twice.
    #[error("rank {rank} appears more than once in the mesh")]
    DuplicateRank {
        /// The repeated rank.
        rank: usize,
    },
    /// The rank is not part of this mesh.
    #[error("rank {rank} is not in the mesh")]
    RankNotInMesh {
        /// The rank that was looked up.
        rank: usize,
    },
    /// A coordinate does not have one entry per mesh dimension.
    #[error("a coordinate of length {len} does not address a {ndim}-d mesh")]
    CoordinateLengthMismatch {
        /// The length of the given coordinate.
        len: usize,
        /// How many dimensions the mesh has.
        ndim: usize,
    },
    /// A coordinate entry is not below the size of its mesh dimension.
    #[error("coordinate {index} is out of range for mesh dimension {dim} of size {size}")]
    CoordinateOutOfRange {
        /// The mesh dimension.
        dim: usize,
        /// The coordinate entry along that dimension.
        index: usize,
        /// The size of that dimension.
        size: usize,
    },
    /// There must be exactly one placement per mesh dimension.
    #[error("got {placements} placements for a {mesh_ndim}-d mesh")]
    PlacementCountMismatch {
        /// How many placements were given.
        placements: usize,
        /// How many dimensions the mesh has.
        mesh_ndim: usize,
    },
    /// A `Shard(dim)` placement names a tensor dimension the tensor does not have.
    #[error(
        "placement for mesh dimension {mesh_dim} shards tensor dimension {shard_dim}, \
         but the tensor has {tensor_ndim} dimensions"
    )]
    ShardDimOutOfRange {
        /// The mesh dimension whose placement is at fault.
        mesh_dim: usize,
        /// The tensor dimension the placement shards.
        shard_dim: usize,
        /// How many dimensions the tensor has.
        tensor_ndim: usize,
    },
    /// A length cannot be split over zero shards.
    #[error("cannot split a length over 0 shards")]
    ZeroShards,
    /// A shard index is not below the number of shards.
    #[error("shard index {index} is out of range for {shards} shards")]
    ShardIndexOutOfRange {
        /// The requested shard index.
        index: usize,
        /// How many shards there are.
        shards: usize,
    },
    /// The padded length (chunk size times shard count) does not fit in `usize`.
    #[error("padding a length of {len} over {shards} shards overflows usize")]
    PaddedLenOverflow {
        /// The length being split.
        len: usize,
        /// How many shards there are.
        shards: usize,
    },
}

/// The result type of this crate.
pub type Result<T> = std::result::Result<T, MeshError>;
