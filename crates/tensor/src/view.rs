//! Views: new shapes, strides and offsets over the same storage. Nothing here copies data,
//! except `reshape`/`flatten` when the layout cannot be expressed as a view.

use crate::layout::{checked_numel, expand_strides, view_strides};
use crate::{Error, Result, Tensor};

impl Tensor {
    /// A view with a new layout over the same storage.
    fn restride(&self, shape: Vec<usize>, strides: Vec<usize>, offset: usize) -> Tensor {
        Tensor {
            storage: self.storage.clone(),
            dtype: self.dtype,
            shape,
            strides,
            offset,
        }
    }

    /// The elements `start..start + len` of `dim`, as a view (torch's `narrow`).
    ///
    /// ```
    /// use hypershard_tensor::{DType, Tensor};
    /// let t = Tensor::arange(10, DType::I64)?;
    /// assert_eq!(t.narrow(0, 3, 4)?.to_vec::<i64>()?, vec![3, 4, 5, 6]);
    /// assert!(t.narrow(0, 8, 3).is_err());
    /// # Ok::<(), hypershard_tensor::Error>(())
    /// ```
    pub fn narrow(&self, dim: usize, start: usize, len: usize) -> Result<Tensor> {
        self.check_dim("narrow", dim)?;
        let size = self.shape[dim];
        if start.checked_add(len).is_none_or(|end| end > size) {
            return Err(Error::RangeOutOfBounds {
                op: "narrow",
                dim,
                start,
                len,
                size,
            });
        }
        let mut shape = self.shape.clone();
        shape[dim] = len;
        // An empty view keeps its offset so that the offset never points past the storage
        // (slicing `data[offset..offset]` must stay in bounds).
        let offset = if shape.contains(&0) {
            self.offset
        } else {
            self.offset + start * self.strides[dim]
        };
        Ok(self.restride(shape, self.strides.clone(), offset))
    }

    /// Splits `dim` into pieces of `split_size` elements (the last may be shorter), as views
    /// (torch's `split` with an int).
    pub fn split(&self, split_size: usize, dim: usize) -> Result<Vec<Tensor>> {
        self.check_dim("split", dim)?;
        let size = self.shape[dim];
        if size == 0 {
            return Ok(vec![self.clone()]);
        }
        if split_size == 0 {
            return Err(Error::InvalidPieceCount {
                op: "split",
                count: split_size,
            });
        }
        (0..size.div_ceil(split_size))
            .map(|i| {
                let start = i * split_size;
                self.narrow(dim, start, split_size.min(size - start))
            })
            .collect()
    }

    /// Splits `dim` into `chunks` views with torch.chunk semantics: each piece has
    /// `ceil(size / chunks)` elements, the last may be shorter, and fewer than `chunks` pieces
    /// come back when the size does not allow that many (`[5].chunk(4)` gives sizes 2, 2, 1).
    ///
    /// ```
    /// use hypershard_tensor::{DType, Tensor};
    /// let t = Tensor::arange(5, DType::F32)?;
    /// let sizes: Vec<usize> = t.chunk(4, 0)?.iter().map(|c| c.numel()).collect();
    /// assert_eq!(sizes, vec![2, 2, 1]);
    /// # Ok::<(), hypershard_tensor::Error>(())
    /// ```
    pub fn chunk(&self, chunks: usize, dim: usize) -> Result<Vec<Tensor>> {
        self.check_dim("chunk", dim)?;
        if chunks == 0 {
            return Err(Error::InvalidPieceCount {
                op: "chunk",
                count: chunks,
            });
        }
        self.split(self.shape[dim].div_ceil(chunks), dim)
    }

    /// Splits `dim` into views of the given sizes, which must add up to the dim's size.
    pub fn split_with_sizes(&self, sizes: &[usize], dim: usize) -> Result<Vec<Tensor>> {
        self.check_dim("split_with_sizes", dim)?;
        let size = self.shape[dim];
        let total = sizes.iter().try_fold(0usize, |acc, &s| acc.checked_add(s));
        if total != Some(size) {
            return Err(Error::SplitSizesMismatch {
                op: "split_with_sizes",
                dim,
                sizes: sizes.to_vec(),
                size,
            });
        }
        let mut start = 0;
        sizes
            .iter()
            .map(|&len| {
                let piece = self.narrow(dim, start, len);
                start += len;
                piece
            })
            .collect()
    }

    /// Swaps two dims, as a view.
    pub fn transpose(&self, dim0: usize, dim1: usize) -> Result<Tensor> {
        self.check_dim("transpose", dim0)?;
        self.check_dim("transpose", dim1)?;
        let mut shape = self.shape.clone();
        let mut strides = self.strides.clone();
        shape.swap(dim0, dim1);
        strides.swap(dim0, dim1);
        Ok(self.restride(shape, strides, self.offset))
    }

    /// Reorders the dims: dim `i` of the result is dim `perm[i]` of `self`, as a view.
    ///
    /// ```
    /// use hypershard_tensor::{DType, Tensor};
    /// let t = Tensor::zeros(&[2, 3, 4], DType::F32)?.permute(&[2, 0, 1])?;
    /// assert_eq!(t.shape(), &[4, 2, 3]);
    /// assert_eq!(t.strides(), &[1, 12, 4]);
    /// # Ok::<(), hypershard_tensor::Error>(())
    /// ```
    pub fn permute(&self, perm: &[usize]) -> Result<Tensor> {
        let ndim = self.ndim();
        let mut seen = vec![false; ndim];
        let valid = perm.len() == ndim
            && perm
                .iter()
                .all(|&d| d < ndim && !std::mem::replace(&mut seen[d], true));
        if !valid {
            return Err(Error::InvalidPermutation {
                op: "permute",
                perm: perm.to_vec(),
                ndim,
            });
        }
        let shape = perm.iter().map(|&d| self.shape[d]).collect();
        let strides = perm.iter().map(|&d| self.strides[d]).collect();
        Ok(self.restride(shape, strides, self.offset))
    }

    /// The same elements under a new shape, without copying; an error when the strides cannot
    /// express it (then use [`reshape`](Tensor::reshape)).
    ///
    /// ```
    /// use hypershard_tensor::{DType, Tensor};
    /// let t = Tensor::zeros(&[2, 3], DType::F32)?;
    /// assert_eq!(t.view(&[3, 2])?.shape(), &[3, 2]);
    /// assert!(t.transpose(0, 1)?.view(&[6]).is_err());
    /// # Ok::<(), hypershard_tensor::Error>(())
    /// ```
    pub fn view(&self, shape: &[usize]) -> Result<Tensor> {
        self.check_same_numel("view", shape)?;
        let strides =
            view_strides(&self.shape, &self.strides, shape).ok_or_else(|| Error::NotViewable {
                op: "view",
                shape: self.shape.clone(),
                strides: self.strides.clone(),
                target: shape.to_vec(),
            })?;
        Ok(self.restride(shape.to_vec(), strides, self.offset))
    }

    /// The same elements under a new shape: a view when possible, otherwise a contiguous copy.
    pub fn reshape(&self, shape: &[usize]) -> Result<Tensor> {
        self.check_same_numel("reshape", shape)?;
        match view_strides(&self.shape, &self.strides, shape) {
            Some(strides) => Ok(self.restride(shape.to_vec(), strides, self.offset)),
            None => self.contiguous()?.view(shape),
        }
    }

    /// Merges dims `start_dim..=end_dim` into one (like [`reshape`](Tensor::reshape), a view
    /// when possible). A 0-d tensor flattens to shape `[1]`.
    pub fn flatten(&self, start_dim: usize, end_dim: usize) -> Result<Tensor> {
        if self.ndim() == 0 {
            return self.reshape(&[1]);
        }
        self.check_dim("flatten", start_dim)?;
        self.check_dim("flatten", end_dim)?;
        if start_dim > end_dim {
            return Err(Error::InvalidDimRange {
                op: "flatten",
                start: start_dim,
                end: end_dim,
            });
        }
        let merged: usize = self.shape[start_dim..=end_dim].iter().product();
        let mut shape = self.shape[..start_dim].to_vec();
        shape.push(merged);
        shape.extend_from_slice(&self.shape[end_dim + 1..]);
        self.reshape(&shape)
    }

    /// A view broadcast to `shape` (numpy rules): size-1 dims and new leading dims get stride 0,
    /// so every element of such a dim aliases one storage element. Such views can be read but
    /// not written.
    ///
    /// ```
    /// use hypershard_tensor::Tensor;
    /// let row = Tensor::from_vec(vec![1.0f32, 2.0], &[2])?;
    /// let grid = row.expand(&[3, 2])?;
    /// assert_eq!(grid.strides(), &[0, 1]);
    /// assert_eq!(grid.to_vec::<f32>()?, vec![1.0, 2.0, 1.0, 2.0, 1.0, 2.0]);
    /// # Ok::<(), hypershard_tensor::Error>(())
    /// ```
    pub fn expand(&self, shape: &[usize]) -> Result<Tensor> {
        checked_numel("expand", shape)?;
        let strides = expand_strides(&self.shape, &self.strides, shape).ok_or_else(|| {
            Error::NotExpandable {
                op: "expand",
                shape: self.shape.clone(),
                target: shape.to_vec(),
            }
        })?;
        Ok(self.restride(shape.to_vec(), strides, self.offset))
    }

    /// Inserts a dim of size 1 at position `dim` (`0..=ndim`).
    pub fn unsqueeze(&self, dim: usize) -> Result<Tensor> {
        if dim > self.ndim() {
            return Err(Error::DimOutOfRange {
                op: "unsqueeze",
                dim,
                ndim: self.ndim() + 1,
            });
        }
        // The stride of a size-1 dim is never used to step; torch's choice keeps views tidy.
        let stride = if dim < self.ndim() {
            self.shape[dim].saturating_mul(self.strides[dim])
        } else {
            1
        };
        let mut shape = self.shape.clone();
        let mut strides = self.strides.clone();
        shape.insert(dim, 1);
        strides.insert(dim, stride);
        Ok(self.restride(shape, strides, self.offset))
    }

    /// Removes `dim` if its size is 1; otherwise returns the same view (as torch does).
    pub fn squeeze(&self, dim: usize) -> Result<Tensor> {
        self.check_dim("squeeze", dim)?;
        if self.shape[dim] != 1 {
            return Ok(self.clone());
        }
        let mut shape = self.shape.clone();
        let mut strides = self.strides.clone();
        shape.remove(dim);
        strides.remove(dim);
        Ok(self.restride(shape, strides, self.offset))
    }

    /// Removes every dim of size 1.
    pub fn squeeze_all(&self) -> Tensor {
        let (shape, strides) = self
            .shape
            .iter()
            .zip(&self.strides)
            .filter(|(size, _)| **size != 1)
            .map(|(&size, &stride)| (size, stride))
            .unzip();
        self.restride(shape, strides, self.offset)
    }

    /// Errors unless `shape` has as many elements as `self`.
    fn check_same_numel(&self, op: &'static str, shape: &[usize]) -> Result<()> {
        let expected = checked_numel(op, shape)?;
        if expected == self.numel() {
            Ok(())
        } else {
            Err(Error::NumelMismatch {
                op,
                shape: shape.to_vec(),
                expected,
                actual: self.numel(),
            })
        }
    }
}

#[cfg(test)]
mod tests {
    use crate::{DType, Error, Result, Tensor};

    fn iota(shape: &[usize]) -> Result<Tensor> {
        let n: usize = shape.iter().product();
        Tensor::arange(n, DType::I64)?.view(shape)
    }

    #[test]
    fn narrow_and_errors() -> Result<()> {
        let t = iota(&[3, 4])?;
        let n = t.narrow(1, 1, 2)?;
        assert_eq!(n.shape(), &[3, 2]);
        assert_eq!(n.offset(), 1);
        assert_eq!(n.to_vec::<i64>()?, vec![1, 2, 5, 6, 9, 10]);
        assert!(matches!(
            t.narrow(2, 0, 1),
            Err(Error::DimOutOfRange {
                dim: 2,
                ndim: 2,
                ..
            })
        ));
        assert!(matches!(
            t.narrow(1, 3, 2),
            Err(Error::RangeOutOfBounds {
                start: 3,
                len: 2,
                size: 4,
                ..
            })
        ));
        assert!(matches!(
            t.narrow(1, usize::MAX, 2),
            Err(Error::RangeOutOfBounds { .. })
        ));
        // Narrowing a tensor that is already empty must not move the offset past the storage.
        let hollow = Tensor::zeros(&[3, 0], DType::F32)?.narrow(0, 2, 1)?;
        assert_eq!(hollow.offset(), 0);
        assert_eq!(hollow.to_vec::<f32>()?, Vec::<f32>::new());
        let empty = t.narrow(1, 4, 0)?;
        assert_eq!(empty.numel(), 0);
        assert_eq!(empty.to_vec::<i64>()?, Vec::<i64>::new());
        assert_eq!(empty.contiguous()?.numel(), 0);
        Ok(())
    }

    #[test]
    fn chunk_follows_torch() -> Result<()> {
        let t = iota(&[7])?;
        let sizes = |v: Vec<Tensor>| v.iter().map(Tensor::numel).collect::<Vec<_>>();
        assert_eq!(sizes(t.chunk(3, 0)?), vec![3, 3, 1]);
        assert_eq!(sizes(t.chunk(7, 0)?), vec![1; 7]);
        assert_eq!(sizes(t.chunk(10, 0)?), vec![1; 7]);
        assert_eq!(sizes(iota(&[6])?.chunk(4, 0)?), vec![2, 2, 2]);
        assert_eq!(sizes(iota(&[0])?.chunk(4, 0)?), vec![0]);
        assert_eq!(t.chunk(3, 0)?[2].to_vec::<i64>()?, vec![6]);
        assert!(matches!(
            t.chunk(0, 0),
            Err(Error::InvalidPieceCount { count: 0, .. })
        ));
        assert!(matches!(
            t.split(0, 0),
            Err(Error::InvalidPieceCount { .. })
        ));
        assert_eq!(sizes(t.split(3, 0)?), vec![3, 3, 1]);
        let parts = iota(&[2, 5])?.split_with_sizes(&[1, 0, 4], 1)?;
        assert_eq!(parts[0].to_vec::<i64>()?, vec![0, 5]);
        assert_eq!(parts[1].numel(), 0);
        assert_eq!(parts[2].to_vec::<i64>()?, vec![1, 2, 3, 4, 6, 7, 8, 9]);
        assert!(matches!(
            iota(&[5])?.split_with_sizes(&[2, 2], 0),
            Err(Error::SplitSizesMismatch { size: 5, .. })
        ));
        assert!(matches!(
            iota(&[5])?.split_with_sizes(&[usize::MAX, 2], 0),
            Err(Error::SplitSizesMismatch { .. })
        ));
        Ok(())
    }

    #[test]
    fn transpose_permute_and_errors() -> Result<()> {
        let t = iota(&[2, 3])?;
        assert_eq!(t.transpose(0, 1)?.to_vec::<i64>()?, vec![0, 3, 1, 4, 2, 5]);
        assert!(!t.transpose(0, 1)?.is_contiguous());
        assert!(t.transpose(0, 1)?.transpose(1, 0)?.is_contiguous());
        let p = iota(&[2, 3, 4])?.permute(&[1, 2, 0])?;
        assert_eq!(p.shape(), &[3, 4, 2]);
        assert_eq!(p.to_vec::<i64>()?[..4], [0, 12, 1, 13]);
        assert!(matches!(
            t.permute(&[0, 0]),
            Err(Error::InvalidPermutation { .. })
        ));
        assert!(matches!(
            t.permute(&[0]),
            Err(Error::InvalidPermutation { .. })
        ));
        assert!(matches!(
            t.permute(&[0, 2]),
            Err(Error::InvalidPermutation { .. })
        ));
        assert!(matches!(
            t.transpose(0, 5),
            Err(Error::DimOutOfRange { .. })
        ));
        Ok(())
    }

    #[test]
    fn view_reshape_flatten() -> Result<()> {
        let t = iota(&[2, 3, 4])?;
        let v = t.view(&[6, 4])?;
        assert!(v.shares_storage(&t));
        assert!(matches!(
            t.view(&[5, 5]),
            Err(Error::NumelMismatch {
                expected: 25,
                actual: 24,
                ..
            })
        ));
        let tt = t.transpose(1, 2)?;
        assert!(matches!(tt.view(&[24]), Err(Error::NotViewable { .. })));
        let r = tt.reshape(&[24])?;
        assert!(!r.shares_storage(&t));
        assert_eq!(r.to_vec::<i64>()?, tt.to_vec::<i64>()?);
        // Reshape of a view-compatible layout does not copy.
        assert!(t.narrow(0, 1, 1)?.reshape(&[3, 4])?.shares_storage(&t));
        let f = t.flatten(1, 2)?;
        assert_eq!(f.shape(), &[2, 12]);
        assert!(f.shares_storage(&t));
        assert_eq!(Tensor::scalar(1.0f32).flatten(0, 0)?.shape(), &[1]);
        assert!(matches!(
            t.flatten(2, 1),
            Err(Error::InvalidDimRange { .. })
        ));
        assert!(matches!(t.flatten(0, 3), Err(Error::DimOutOfRange { .. })));
        Ok(())
    }

    #[test]
    fn expand_unsqueeze_squeeze() -> Result<()> {
        let col = iota(&[3, 1])?;
        let e = col.expand(&[2, 3, 4])?;
        assert_eq!(e.strides(), &[0, 1, 0]);
        assert_eq!(e.to_vec::<i64>()?[..8], [0, 0, 0, 0, 1, 1, 1, 1]);
        assert!(matches!(
            col.expand(&[3, 2, 2]),
            Err(Error::NotExpandable { .. })
        ));
        assert!(matches!(col.expand(&[1]), Err(Error::NotExpandable { .. })));
        let u = iota(&[2, 3])?.unsqueeze(1)?;
        assert_eq!(u.shape(), &[2, 1, 3]);
        assert!(u.is_contiguous());
        assert_eq!(iota(&[2, 3])?.unsqueeze(2)?.shape(), &[2, 3, 1]);
        assert!(matches!(
            iota(&[2])?.unsqueeze(2),
            Err(Error::DimOutOfRange { .. })
        ));
        assert_eq!(u.squeeze(1)?.shape(), &[2, 3]);
        assert_eq!(u.squeeze(0)?.shape(), &[2, 1, 3]);
        assert_eq!(iota(&[1, 2, 1])?.squeeze_all().shape(), &[2]);
        Ok(())
    }
}
