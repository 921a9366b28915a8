//! The device mesh: an n-d grid of global ranks with optional dimension names.

use std::fmt;

use crate::dim::DimRef;
use crate::error::{MeshError, Result};

/// An n-dimensional grid of global ranks, stored in row-major order.
///
/// Dimension 0 is the outermost (slowest-varying) one: in the default layout of
/// `DeviceMesh::new(&[2, 4], ..)` the ranks along dimension 1 are consecutive (`0 1 2 3`)
/// and the ranks along dimension 0 are 4 apart (`0 4`). Dimensions may carry unique names
/// such as `"dp_replicate"` and `"dp_shard"`; every method that takes a dimension accepts
/// its index or its name (see [`DimRef`]).
///
/// A mesh is a plain value: it holds no communicator and touches no I/O. Methods that are
/// "for the calling rank" in PyTorch take the rank explicitly here.
///
/// ```
/// use hypershard_mesh::DeviceMesh;
///
/// let mesh = DeviceMesh::new(&[2, 4], &["dp_replicate", "dp_shard"])?;
/// assert_eq!(mesh.coordinate_of(6)?, vec![1, 2]);
/// assert_eq!(mesh.rank_at(&[1, 2])?, 6);
/// assert_eq!(mesh.local_rank(6, "dp_shard")?, 2);
/// assert_eq!(mesh.size("dp_replicate")?, 2);
///
/// // The shard group of rank 6, and every replicate group.
/// assert_eq!(mesh.select(6, &["dp_shard"])?.ranks(), &[4, 5, 6, 7]);
/// assert_eq!(mesh.groups("dp_replicate")?, vec![vec![0, 4], vec![1, 5], vec![2, 6], vec![3, 7]]);
///
/// // Both data-parallel dims as one.
/// let dp = mesh.flatten(&["dp_replicate", "dp_shard"], "dp")?;
/// assert_eq!(dp.shape(), &[8]);
/// # Ok::<(), hypershard_mesh::MeshError>(())
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct DeviceMesh {
    /// The size of every dimension; none is zero and there is at least one.
    shape: Vec<usize>,
    /// The global ranks in row-major order; `ranks.len()` is the product of `shape`.
    ranks: Vec<usize>,
    /// One entry per dimension; the `Some` names are unique.
    names: Vec<Option<String>>,
    /// `(rank, row-major position)` sorted by rank, so a rank is found by binary search.
    positions: Vec<(usize, usize)>,
}

/// The `(color, key)` pair that puts a rank into its group along one mesh dimension,
/// as `MPI_Comm_split` / `ncclCommSplit` expect.
///
/// `color` is the index of the rank's group in [`DeviceMesh::groups`] and `key` is the rank's
/// position inside that group (its local rank along the dimension), so
/// `mesh.groups(dim)?[color][key] == rank`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct SplitKey {
    /// Which group the rank belongs to; equal for all ranks of one group.
    pub color: usize,
    /// The rank's index inside its group; orders the ranks of the new communicator.
    pub key: usize,
}

impl DeviceMesh {
    /// A mesh of the given shape over the ranks `0..n` in row-major order.
    ///
    /// `names` is either empty (unnamed dimensions) or holds one unique name per dimension.
    ///
    /// ```
    /// use hypershard_mesh::DeviceMesh;
    ///
    /// let mesh = DeviceMesh::new(&[3], &[])?;
    /// assert_eq!(mesh.ranks(), &[0, 1, 2]);
    /// assert_eq!(mesh.dim_name(0)?, None);
    /// # Ok::<(), hypershard_mesh::MeshError>(())
    /// ```
    pub fn new(shape: &[usize], names: &[&str]) -> Result<Self> {
        let count = checked_product(shape)?;
        Self::from_ranks(shape, (0..count).collect(), names)
    }

    /// A mesh of the given shape over an explicit array of global ranks in row-major order.
    ///
    /// The array must hold exactly one rank per mesh position and no rank twice.
    ///
    /// ```
    /// use hypershard_mesh::DeviceMesh;
    ///
    /// let mesh = DeviceMesh::from_ranks(&[2, 2], vec![7, 5, 3, 1], &["pp", "tp"])?;
    /// assert_eq!(mesh.coordinate_of(3)?, vec![1, 0]);
    /// assert_eq!(mesh.groups("pp")?, vec![vec![7, 3], vec![5, 1]]);
    /// # Ok::<(), hypershard_mesh::MeshError>(())
    /// ```
    pub fn from_ranks(shape: &[usize], ranks: Vec<usize>, names: &[&str]) -> Result<Self> {
        let names = match names.len() {
            0 => vec![None; shape.len()],
            len if len == shape.len() => names.iter().map(|name| Some(name.to_string())).collect(),
            len => {
                return Err(MeshError::NameCountMismatch {
                    names: len,
                    ndim: shape.len(),
                });
            }
        };
        Self::build(shape.to_vec(), ranks, names)
    }

    /// Checks every invariant of the struct and builds the rank lookup table.
    fn build(shape: Vec<usize>, ranks: Vec<usize>, names: Vec<Option<String>>) -> Result<Self> {
        let expected = checked_product(&shape)?;
        if ranks.len() != expected {
            return Err(MeshError::RankCountMismatch {
                ranks: ranks.len(),
                expected,
                shape,
            });
        }
        if names.len() != shape.len() {
            return Err(MeshError::NameCountMismatch {
                names: names.len(),
                ndim: shape.len(),
            });
        }
        let mut seen_names: Vec<&str> = names.iter().flatten().map(String::as_str).collect();
        seen_names.sort_unstable();
        if let Some(pair) = seen_names.windows(2).find(|pair| pair[0] == pair[1]) {
            return Err(MeshError::DuplicateDimName {
                name: pair[0].to_string(),
            });
        }
        let mut positions: Vec<(usize, usize)> = ranks
            .iter()
            .enumerate()
            .map(|(position, &rank)| (rank, position))
            .collect();
        positions.sort_unstable();
        if let Some(pair) = positions.windows(2).find(|pair| pair[0].0 == pair[1].0) {
            return Err(MeshError::DuplicateRank { rank: pair[0].0 });
        }
        Ok(Self {
            shape,
            ranks,
            names,
            positions,
        })
    }

    /// The number of mesh dimensions (at least 1).
    pub fn ndim(&self) -> usize {
        self.shape.len()
    }

    /// The size of every mesh dimension.
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    /// The number of ranks in the mesh (the product of its shape).
    pub fn num_ranks(&self) -> usize {
        self.ranks.len()
    }

    /// The global ranks in row-major order.
    pub fn ranks(&self) -> &[usize] {
        &self.ranks
    }

    /// Whether `rank` is part of the mesh.
    pub fn contains(&self, rank: usize) -> bool {
        self.position_of(rank).is_ok()
    }

    /// The index of a mesh dimension given by index or by name.
    pub fn dim_index<'a>(&self, dim: impl Into<DimRef<'a>>) -> Result<usize> {
        match dim.into() {
            DimRef::Index(index) if index < self.ndim() => Ok(index),
            DimRef::Index(index) => Err(MeshError::DimOutOfRange {
                dim: index,
                ndim: self.ndim(),
            }),
            DimRef::Name(name) => self
                .names
                .iter()
                .position(|candidate| candidate.as_deref() == Some(name))
                .ok_or_else(|| MeshError::UnknownDimName {
                    name: name.to_string(),
                    names: self.names.clone(),
                }),
        }
    }

    /// The name of a mesh dimension, or `None` if it is unnamed.
    pub fn dim_name<'a>(&self, dim: impl Into<DimRef<'a>>) -> Result<Option<&str>> {
        let index = self.dim_index(dim)?;
        Ok(self.names[index].as_deref())
    }

    /// The size of one mesh dimension.
    pub fn size<'a>(&self, dim: impl Into<DimRef<'a>>) -> Result<usize> {
        Ok(self.shape[self.dim_index(dim)?])
    }

    /// The coordinate of `rank` in the mesh, one entry per dimension.
    pub fn coordinate_of(&self, rank: usize) -> Result<Vec<usize>> {
        Ok(unravel(self.position_of(rank)?, &self.shape))
    }

    /// The rank at a coordinate (one entry per dimension, each below its dimension's size).
    pub fn rank_at(&self, coordinate: &[usize]) -> Result<usize> {
        if coordinate.len() != self.ndim() {
            return Err(MeshError::CoordinateLengthMismatch {
                len: coordinate.len(),
                ndim: self.ndim(),
            });
        }
        for (dim, (&index, &size)) in coordinate.iter().zip(&self.shape).enumerate() {
            if index >= size {
                return Err(MeshError::CoordinateOutOfRange { dim, index, size });
            }
        }
        Ok(self.ranks[ravel(coordinate, &self.shape)])
    }

    /// The index of `rank` along one dimension: its coordinate entry there, which is also
    /// its rank inside the communicator of that dimension.
    pub fn local_rank<'a>(&self, rank: usize, dim: impl Into<DimRef<'a>>) -> Result<usize> {
        let dim = self.dim_index(dim)?;
        Ok(self.coordinate_of(rank)?[dim])
    }

    /// The sub-mesh over the listed dimensions that contains `rank`: the other dimensions are
    /// held at `rank`'s coordinate. The result's dimensions follow the order of `dims` and keep
    /// their names.
    ///
    /// ```
    /// use hypershard_mesh::DeviceMesh;
    ///
    /// let mesh = DeviceMesh::new(&[2, 2, 2], &["pp", "dp", "tp"])?;
    /// let dp_tp = mesh.select(5, &["dp", "tp"])?;
    /// assert_eq!(dp_tp.shape(), &[2, 2]);
    /// assert_eq!(dp_tp.ranks(), &[4, 5, 6, 7]);
    /// assert_eq!(mesh.select(5, &["tp", "dp"])?.ranks(), &[4, 6, 5, 7]);
    /// # Ok::<(), hypershard_mesh::MeshError>(())
    /// ```
    pub fn select<'a, D>(&self, rank: usize, dims: &[D]) -> Result<Self>
    where
        D: Into<DimRef<'a>> + Copy,
    {
        let dims = self.resolve_dims(dims, "select")?;
        let base = self.coordinate_of(rank)?;
        let groups: Vec<Vec<usize>> = dims.iter().map(|&dim| vec![dim]).collect();
        let (shape, ranks) = self.rearrange(&base, &groups);
        let names = dims.iter().map(|&dim| self.names[dim].clone()).collect();
        Self::build(shape, ranks, names)
    }

    /// Merges the listed dimensions into one dimension called `name`.
    ///
    /// The merged dimension enumerates the listed dimensions in the given order (the first
    /// listed varies slowest) and sits where the lowest-index listed dimension was; the other
    /// dimensions keep their order and names. The dimensions need not be adjacent.
    ///
    /// ```
    /// use hypershard_mesh::DeviceMesh;
    ///
    /// let mesh = DeviceMesh::new(&[2, 3, 2], &["dp_replicate", "tp", "dp_shard"])?;
    /// let flat = mesh.flatten(&["dp_replicate", "dp_shard"], "dp")?;
    /// assert_eq!(flat.shape(), &[4, 3]);
    /// assert_eq!(flat.dim_name(0)?, Some("dp"));
    /// assert_eq!(flat.groups("dp")?[0], vec![0, 1, 6, 7]);
    /// # Ok::<(), hypershard_mesh::MeshError>(())
    /// ```
    pub fn flatten<'a, D>(&self, dims: &[D], name: &str) -> Result<Self>
    where
        D: Into<DimRef<'a>> + Copy,
    {
        let merged = self.resolve_dims(dims, "flatten")?;
        // invariant: resolve_dims rejects an empty list, so a minimum exists.
        let first = *merged.iter().min().expect("invariant: merged is not empty");
        let mut groups = Vec::with_capacity(self.ndim() - merged.len() + 1);
        let mut names = Vec::with_capacity(groups.capacity());
        for dim in 0..self.ndim() {
            if dim == first {
                groups.push(merged.clone());
                names.push(Some(name.to_string()));
            } else if !merged.contains(&dim) {
                groups.push(vec![dim]);
                names.push(self.names[dim].clone());
            }
        }
        let base = vec![0; self.ndim()];
        let (shape, ranks) = self.rearrange(&base, &groups);
        Self::build(shape, ranks, names)
    }

    /// Every group of ranks along one dimension: the ranks that differ only in their
    /// coordinate along `dim`, each group ordered by that coordinate. Groups are ordered
    /// row-major over the other dimensions; their index is the [`SplitKey::color`].
    ///
    /// Creating one communicator per group gives the communicator of this dimension.
    pub fn groups<'a>(&self, dim: impl Into<DimRef<'a>>) -> Result<Vec<Vec<usize>>> {
        let dim = self.dim_index(dim)?;
        let others: Vec<usize> = (0..self.ndim()).filter(|&other| other != dim).collect();
        let other_shape: Vec<usize> = others.iter().map(|&other| self.shape[other]).collect();
        let group_count = self.num_ranks() / self.shape[dim];
        let mut groups = Vec::with_capacity(group_count);
        for color in 0..group_count {
            let mut coordinate = vec![0; self.ndim()];
            for (&other, index) in others.iter().zip(unravel(color, &other_shape)) {
                coordinate[other] = index;
            }
            let (_, ranks) = self.rearrange(&coordinate, &[vec![dim]]);
            groups.push(ranks);
        }
        Ok(groups)
    }

    /// The `(color, key)` that puts `rank` into its group along `dim` when a communicator
    /// over the whole mesh is split (`MPI_Comm_split`-style).
    ///
    /// ```
    /// use hypershard_mesh::{DeviceMesh, SplitKey};
    ///
    /// let mesh = DeviceMesh::new(&[2, 4], &["dp_replicate", "dp_shard"])?;
    /// assert_eq!(mesh.split_key(6, "dp_shard")?, SplitKey { color: 1, key: 2 });
    /// assert_eq!(mesh.split_key(6, "dp_replicate")?, SplitKey { color: 2, key: 1 });
    /// # Ok::<(), hypershard_mesh::MeshError>(())
    /// ```
    pub fn split_key<'a>(&self, rank: usize, dim: impl Into<DimRef<'a>>) -> Result<SplitKey> {
        let dim = self.dim_index(dim)?;
        let coordinate = self.coordinate_of(rank)?;
        let mut color = 0;
        for (other, (&index, &size)) in coordinate.iter().zip(&self.shape).enumerate() {
            if other != dim {
                color = color * size + index;
            }
        }
        Ok(SplitKey {
            color,
            key: coordinate[dim],
        })
    }

    /// The row-major position of `rank` in `ranks`.
    fn position_of(&self, rank: usize) -> Result<usize> {
        self.positions
            .binary_search_by_key(&rank, |&(candidate, _)| candidate)
            .map(|found| self.positions[found].1)
            .map_err(|_| MeshError::RankNotInMesh { rank })
    }

    /// Resolves a list of dimensions to unique indices, in the given order.
    fn resolve_dims<'a, D>(&self, dims: &[D], op: &'static str) -> Result<Vec<usize>>
    where
        D: Into<DimRef<'a>> + Copy,
    {
        let mut resolved: Vec<usize> = Vec::with_capacity(dims.len());
        for &dim in dims {
            let index = self.dim_index(dim)?;
            if resolved.contains(&index) {
                return Err(MeshError::DuplicateDim { dim: index });
            }
            resolved.push(index);
        }
        if resolved.is_empty() {
            return Err(MeshError::NoDims { op });
        }
        Ok(resolved)
    }

    /// Builds the shape and row-major ranks of a new grid whose dimension `i` enumerates the
    /// old dimensions `groups[i]` (first one slowest). Old dimensions in no group stay at
    /// their entry in `base`. The groups must be disjoint valid dimension indices.
    fn rearrange(&self, base: &[usize], groups: &[Vec<usize>]) -> (Vec<usize>, Vec<usize>) {
        let shape: Vec<usize> = groups
            .iter()
            .map(|group| group.iter().map(|&dim| self.shape[dim]).product())
            .collect();
        // The order of old dims as they vary in the new row-major order.
        let order: Vec<usize> = groups.iter().flatten().copied().collect();
        let order_shape: Vec<usize> = order.iter().map(|&dim| self.shape[dim]).collect();
        let count: usize = order_shape.iter().product();
        let mut coordinate = base.to_vec();
        let ranks = (0..count)
            .map(|position| {
                for (&dim, index) in order.iter().zip(unravel(position, &order_shape)) {
                    coordinate[dim] = index;
                }
                self.ranks[ravel(&coordinate, &self.shape)]
            })
            .collect();
        (shape, ranks)
    }
}

impl fmt::Display for DeviceMesh {
    /// Shows the shape with names, e.g. `DeviceMesh(dp_replicate=2, dp_shard=4)`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("DeviceMesh(")?;
        for (dim, (size, name)) in self.shape.iter().zip(&self.names).enumerate() {
            if dim > 0 {
                f.write_str(", ")?;
            }
            match name {
                Some(name) => write!(f, "{name}={size}")?,
                None => write!(f, "{size}")?,
            }
        }
        f.write_str(")")
    }
}

/// The product of a mesh shape, checking that it is non-empty, has no zero and fits in usize.
fn checked_product(shape: &[usize]) -> Result<usize> {
    if shape.is_empty() {
        return Err(MeshError::EmptyMesh);
    }
    if let Some(dim) = shape.iter().position(|&size| size == 0) {
        return Err(MeshError::ZeroSizeDim {
            dim,
            shape: shape.to_vec(),
        });
    }
    shape
        .iter()
        .try_fold(1usize, |product, &size| product.checked_mul(size))
        .ok_or_else(|| MeshError::MeshTooLarge {
            shape: shape.to_vec(),
        })
}

/// The row-major position of a coordinate that is in range for `shape`.
fn ravel(coordinate: &[usize], shape: &[usize]) -> usize {
    coordinate
        .iter()
        .zip(shape)
        .fold(0, |position, (&index, &size)| position * size + index)
}

/// The coordinate of a row-major position below the product of `shape`.
fn unravel(mut position: usize, shape: &[usize]) -> Vec<usize> {
    let mut coordinate = vec![0; shape.len()];
    for (entry, &size) in coordinate.iter_mut().zip(shape).rev() {
        *entry = position % size;
        position /= size;
    }
    coordinate
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hsdp() -> DeviceMesh {
        // invariant: a valid literal shape with unique names.
        DeviceMesh::new(&[2, 4], &["dp_replicate", "dp_shard"]).expect("valid mesh")
    }

    #[test]
    fn new_lays_ranks_out_row_major() {
        let mesh = hsdp();
        assert_eq!(mesh.ndim(), 2);
        assert_eq!(mesh.shape(), &[2, 4]);
        assert_eq!(mesh.num_ranks(), 8);
        assert_eq!(mesh.ranks(), &[0, 1, 2, 3, 4, 5, 6, 7]);
        for rank in 0..8 {
            assert_eq!(mesh.coordinate_of(rank), Ok(vec![rank / 4, rank % 4]));
        }
        assert_eq!(mesh.dim_name(0), Ok(Some("dp_replicate")));
        assert_eq!(mesh.dim_name("dp_shard"), Ok(Some("dp_shard")));
        assert_eq!(mesh.to_string(), "DeviceMesh(dp_replicate=2, dp_shard=4)");
    }

    #[test]
    fn unnamed_mesh_has_no_names() {
        let mesh = DeviceMesh::new(&[3, 1, 2], &[]).expect("valid mesh"); // invariant: valid literal.
        assert_eq!(mesh.dim_name(1), Ok(None));
        assert_eq!(mesh.to_string(), "DeviceMesh(3, 1, 2)");
        assert_eq!(
            mesh.size("dp"),
            Err(MeshError::UnknownDimName {
                name: "dp".into(),
                names: vec![None, None, None],
            })
        );
    }

    #[test]
    fn from_ranks_uses_the_given_order() {
        let mesh =
            DeviceMesh::from_ranks(&[2, 3], vec![10, 11, 12, 20, 21, 22], &[]).expect("valid mesh"); // invariant: valid literal.
        assert_eq!(mesh.rank_at(&[1, 2]), Ok(22));
        assert_eq!(mesh.coordinate_of(11), Ok(vec![0, 1]));
        assert!(mesh.contains(20));
        assert!(!mesh.contains(0));
        assert_eq!(
            mesh.coordinate_of(0),
            Err(MeshError::RankNotInMesh { rank: 0 })
        );
    }

    #[test]
    fn size_and_local_rank_by_index_and_name() {
        let mesh = hsdp();
        assert_eq!(mesh.size(0), Ok(2));
        assert_eq!(mesh.size("dp_shard"), Ok(4));
        assert_eq!(mesh.local_rank(6, "dp_shard"), Ok(2));
        assert_eq!(mesh.local_rank(6, 0), Ok(1));
        assert_eq!(mesh.dim_index("dp_shard"), Ok(1));
        assert_eq!(
            mesh.size(2),
            Err(MeshError::DimOutOfRange { dim: 2, ndim: 2 })
        );
        assert_eq!(
            mesh.local_rank(8, 0),
            Err(MeshError::RankNotInMesh { rank: 8 })
        );
    }

    #[test]
    fn construction_errors_are_typed() {
        assert_eq!(DeviceMesh::new(&[], &[]), Err(MeshError::EmptyMesh));
        assert_eq!(
            DeviceMesh::new(&[2, 0], &[]),
            Err(MeshError::ZeroSizeDim {
                dim: 1,
                shape: vec![2, 0],
            })
        );
        assert_eq!(
            DeviceMesh::new(&[usize::MAX, 2], &[]),
            Err(MeshError::MeshTooLarge {
                shape: vec![usize::MAX, 2],
            })
        );
        assert_eq!(
            DeviceMesh::new(&[2, 2], &["dp"]),
            Err(MeshError::NameCountMismatch { names: 1, ndim: 2 })
        );
        assert_eq!(
            DeviceMesh::new(&[2, 2], &["dp", "dp"]),
            Err(MeshError::DuplicateDimName { name: "dp".into() })
        );
        assert_eq!(
            DeviceMesh::from_ranks(&[2, 2], vec![0, 1, 2], &[]),
            Err(MeshError::RankCountMismatch {
                ranks: 3,
                expected: 4,
                shape: vec![2, 2],
            })
        );
        assert_eq!(
            DeviceMesh::from_ranks(&[2, 2], vec![0, 3, 1, 3], &[]),
            Err(MeshError::DuplicateRank { rank: 3 })
        );
        assert_eq!(
            DeviceMesh::from_ranks(&[], vec![], &[]),
            Err(MeshError::EmptyMesh)
        );
    }

    #[test]
    fn rank_at_checks_the_coordinate() {
        let mesh = hsdp();
        assert_eq!(mesh.rank_at(&[0, 3]), Ok(3));
        assert_eq!(
            mesh.rank_at(&[1]),
            Err(MeshError::CoordinateLengthMismatch { len: 1, ndim: 2 })
        );
        assert_eq!(
            mesh.rank_at(&[1, 4]),
            Err(MeshError::CoordinateOutOfRange {
                dim: 1,
                index: 4,
                size: 4,
            })
        );
    }

    #[test]
    fn select_returns_the_group_of_the_rank() {
        let mesh = hsdp();
        let shard = mesh.select(6, &["dp_shard"]).expect("valid select"); // invariant: known dim.
        assert_eq!(shard.shape(), &[4]);
        assert_eq!(shard.ranks(), &[4, 5, 6, 7]);
        assert_eq!(shard.dim_name(0), Ok(Some("dp_shard")));
        let replicate = mesh.select(6, &[0]).expect("valid select"); // invariant: known dim.
        assert_eq!(replicate.ranks(), &[2, 6]);
        assert_eq!(replicate.dim_name(0), Ok(Some("dp_replicate")));
        let both = mesh
            .select(6, &["dp_shard", "dp_replicate"])
            .expect("valid"); // invariant: known dims.
        assert_eq!(both.shape(), &[4, 2]);
        assert_eq!(both.ranks(), &[0, 4, 1, 5, 2, 6, 3, 7]);
        let mixed = [DimRef::Name("dp_shard"), DimRef::Index(0)];
        assert_eq!(mesh.select(6, &mixed), Ok(both));
    }

    #[test]
    fn select_errors_are_typed() {
        let mesh = hsdp();
        let none: [&str; 0] = [];
        assert_eq!(
            mesh.select(0, &none),
            Err(MeshError::NoDims { op: "select" })
        );
        assert_eq!(
            mesh.select(0, &["dp_shard", "dp_shard"]),
            Err(MeshError::DuplicateDim { dim: 1 })
        );
        assert_eq!(
            mesh.select(9, &["dp_shard"]),
            Err(MeshError::RankNotInMesh { rank: 9 })
        );
        assert!(matches!(
            mesh.select(0, &["tp"]),
            Err(MeshError::UnknownDimName { name, .. }) if name == "tp"
        ));
    }

    #[test]
    fn flatten_merges_adjacent_dims() {
        let mesh = hsdp();
        let dp = mesh
            .flatten(&["dp_replicate", "dp_shard"], "dp")
            .expect("valid flatten"); // invariant: known dims.
        assert_eq!(dp.shape(), &[8]);
        assert_eq!(dp.ranks(), &[0, 1, 2, 3, 4, 5, 6, 7]);
        assert_eq!(dp.dim_name(0), Ok(Some("dp")));
        let reversed = mesh.flatten(&[1, 0], "dp").expect("valid flatten"); // invariant: known dims.
        assert_eq!(reversed.ranks(), &[0, 4, 1, 5, 2, 6, 3, 7]);
    }

    #[test]
    fn flatten_merges_non_adjacent_dims_and_keeps_the_rest() {
        let mesh = DeviceMesh::new(&[2, 3, 2], &["a", "b", "c"]).expect("valid"); // invariant: literal.
        let flat = mesh.flatten(&["c", "a"], "ca").expect("valid flatten"); // invariant: known dims.
        assert_eq!(flat.shape(), &[4, 3]);
        assert_eq!(flat.dim_name(0), Ok(Some("ca")));
        assert_eq!(flat.dim_name(1), Ok(Some("b")));
        // Position (ca, b) = (c * 2 + a, b) holds old rank a * 6 + b * 2 + c.
        for ca in 0..4 {
            for b in 0..3 {
                let (c, a) = (ca / 2, ca % 2);
                assert_eq!(flat.rank_at(&[ca, b]), Ok(a * 6 + b * 2 + c));
            }
        }
        let single = mesh.flatten(&["b"], "b").expect("valid flatten"); // invariant: known dim.
        assert_eq!(single, mesh);
    }

    #[test]
    fn flatten_errors_are_typed() {
        let mesh = DeviceMesh::new(&[2, 3, 2], &["a", "b", "c"]).expect("valid"); // invariant: literal.
        let none: [usize; 0] = [];
        assert_eq!(
            mesh.flatten(&none, "x"),
            Err(MeshError::NoDims { op: "flatten" })
        );
        assert_eq!(
            mesh.flatten(&["a", "c"], "b"),
            Err(MeshError::DuplicateDimName { name: "b".into() })
        );
        assert_eq!(
            mesh.flatten(&[0, 0], "x"),
            Err(MeshError::DuplicateDim { dim: 0 })
        );
        assert_eq!(
            mesh.flatten(&[0, 3], "x"),
            Err(MeshError::DimOutOfRange { dim: 3, ndim: 3 })
        );
    }

    #[test]
    fn groups_cover_every_rank_once_per_dim() {
        let mesh = hsdp();
        assert_eq!(
            mesh.groups("dp_shard"),
            Ok(vec![vec![0, 1, 2, 3], vec![4, 5, 6, 7]])
        );
        assert_eq!(
            mesh.groups(0),
            Ok(vec![vec![0, 4], vec![1, 5], vec![2, 6], vec![3, 7]])
        );
        let line = DeviceMesh::from_ranks(&[3], vec![5, 1, 9], &[]).expect("valid"); // invariant: literal.
        assert_eq!(line.groups(0), Ok(vec![vec![5, 1, 9]]));
        assert_eq!(
            mesh.groups(2),
            Err(MeshError::DimOutOfRange { dim: 2, ndim: 2 })
        );
    }

    #[test]
    fn split_keys_index_the_groups() {
        let mesh = DeviceMesh::from_ranks(&[2, 3, 2], (0..12).rev().collect(), &[]).expect("valid"); // invariant: literal.
        for dim in 0..3 {
            let groups = mesh.groups(dim).expect("valid dim"); // invariant: dim < ndim.
            for &rank in mesh.ranks() {
                let SplitKey { color, key } = mesh.split_key(rank, dim).expect("valid"); // invariant: rank in mesh.
                assert_eq!(groups[color][key], rank);
                assert_eq!(key, mesh.local_rank(rank, dim).expect("valid")); // invariant: as above.
                let selected = mesh.select(rank, &[dim]).expect("valid"); // invariant: as above.
                assert_eq!(selected.ranks(), groups[color].as_slice());
            }
        }
        assert_eq!(
            mesh.split_key(12, 0),
            Err(MeshError::RankNotInMesh { rank: 12 })
        );
        assert_eq!(
            mesh.split_key(0, 3),
            Err(MeshError::DimOutOfRange { dim: 3, ndim: 3 })
        );
    }
}
