//! Reductions (sum, mean, max along a dim or over everything) and `allclose`.

use crate::dtype::{Arith, with_arith};
use crate::layout::StridedIndices;
use crate::{Error, Result, Tensor};

/// Sums `n` elements starting at `base`, `stride` apart. Contiguous runs use eight
/// independent accumulators so the loop vectorises and rounding error grows more slowly.
fn sum_run<T: Arith>(data: &[T], base: usize, n: usize, stride: usize) -> T::Acc {
    if n == 0 {
        // `base` of an empty run may lie past the storage; touch nothing.
        T::acc_zero()
    } else if stride == 1 {
        let run = &data[base..base + n];
        let mut lanes = [T::acc_zero(); 8];
        let mut blocks = run.chunks_exact(8);
        for block in &mut blocks {
            for (lane, &x) in lanes.iter_mut().zip(block) {
                *lane = T::acc_add(*lane, x);
            }
        }
        let mut acc = lanes.into_iter().fold(T::acc_zero(), T::acc_merge);
        for &x in blocks.remainder() {
            acc = T::acc_add(acc, x);
        }
        acc
    } else {
        (0..n).fold(T::acc_zero(), |acc, k| {
            T::acc_add(acc, data[base + k * stride])
        })
    }
}

/// How one reduction turns a run of elements into one output element.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Reduction {
    Sum,
    Mean,
    Max,
}

impl Reduction {
    fn name(self) -> &'static str {
        match self {
            Reduction::Sum => "sum",
            Reduction::Mean => "mean",
            Reduction::Max => "max",
        }
    }
}

fn reduce_run<T: Arith>(how: Reduction, data: &[T], base: usize, n: usize, stride: usize) -> T {
    match how {
        Reduction::Sum => T::from_acc(sum_run(data, base, n, stride)),
        Reduction::Mean => T::acc_mean(sum_run(data, base, n, stride), n),
        Reduction::Max => (1..n).fold(data[base], |m, k| T::max_nan(m, data[base + k * stride])),
    }
}

impl Tensor {
    fn reduce(&self, dim: usize, keepdim: bool, how: Reduction) -> Result<Tensor> {
        let op = how.name();
        self.check_dim(op, dim)?;
        if how == Reduction::Mean && !self.dtype.is_float() {
            return Err(Error::UnsupportedDType {
                op,
                dtype: self.dtype,
            });
        }
        let n = self.shape[dim];
        if how == Reduction::Max && n == 0 {
            return Err(Error::EmptyReduction { op, dim });
        }
        let mut outer_shape = self.shape.clone();
        let mut outer_strides = self.strides.clone();
        outer_shape.remove(dim);
        outer_strides.remove(dim);
        let stride = self.strides[dim];
        let out_shape = if keepdim {
            let mut s = self.shape.clone();
            s[dim] = 1;
            s
        } else {
            outer_shape.clone()
        };
        let guard = self.storage.read();
        let device = guard.device();
        let host = guard.data(op)?;
        with_arith!(self.dtype, op, T => {
            let data = host.typed::<T>();
            let bases = StridedIndices::new(&outer_shape, &outer_strides, self.offset);
            Tensor::build_on::<T>(op, device, &out_shape, |out| {
                for (o, base) in out.iter_mut().zip(bases) {
                    *o = reduce_run(how, data, base, n, stride);
                }
            })
        })
    }

    /// The sum along `dim` (kept as size 1 when `keepdim`), in the same dtype. bf16/f16/f32
    /// accumulate in f32, f64 in f64, integers wrap.
    ///
    /// ```
    /// use hypershard_tensor::{DType, Tensor};
    /// let t = Tensor::arange(6, DType::F32)?.view(&[2, 3])?;
    /// assert_eq!(t.sum(0, false)?.to_vec::<f32>()?, vec![3.0, 5.0, 7.0]);
    /// assert_eq!(t.sum(1, true)?.shape(), &[2, 1]);
    /// # Ok::<(), hypershard_tensor::Error>(())
    /// ```
    pub fn sum(&self, dim: usize, keepdim: bool) -> Result<Tensor> {
        self.reduce(dim, keepdim, Reduction::Sum)
    }

    /// The mean along `dim` (float dtypes only; NaN over an empty dim, as in torch).
    pub fn mean(&self, dim: usize, keepdim: bool) -> Result<Tensor> {
        self.reduce(dim, keepdim, Reduction::Mean)
    }

    /// The maximum along `dim` (values only; NaN propagates; an empty dim is an error).
    pub fn max(&self, dim: usize, keepdim: bool) -> Result<Tensor> {
        self.reduce(dim, keepdim, Reduction::Max)
    }

    /// All elements as one 1-d tensor, copying only if the layout needs it.
    fn as_flat(&self) -> Result<Tensor> {
        self.reshape(&[self.numel()])
    }

    /// The sum of all elements, as a 0-d tensor of the same dtype.
    ///
    /// ```
    /// use hypershard_tensor::{DType, Tensor};
    /// assert_eq!(Tensor::arange(5, DType::I64)?.sum_all()?.item::<i64>()?, 10);
    /// # Ok::<(), hypershard_tensor::Error>(())
    /// ```
    pub fn sum_all(&self) -> Result<Tensor> {
        self.as_flat()?.sum(0, false)
    }

    /// The mean of all elements, as a 0-d tensor (float dtypes only).
    pub fn mean_all(&self) -> Result<Tensor> {
        self.as_flat()?.mean(0, false)
    }

    /// The maximum of all elements, as a 0-d tensor.
    pub fn max_all(&self) -> Result<Tensor> {
        self.as_flat()?.max(0, false)
    }

    /// Whether `|self - other| <= atol + rtol * |other|` for every element, broadcasting
    /// the two shapes (torch's `allclose` with `equal_nan = false`). Infinities of one sign
    /// compare equal; NaN is never close. Both tensors must have one dtype.
    ///
    /// ```
    /// use hypershard_tensor::Tensor;
    /// let a = Tensor::from_vec(vec![1.0f32, 2.0], &[2])?;
    /// let b = Tensor::from_vec(vec![1.0f32, 2.0001], &[2])?;
    /// assert!(a.allclose(&b, 1e-3, 0.0)?);
    /// assert!(!a.allclose(&b, 1e-6, 1e-6)?);
    /// # Ok::<(), hypershard_tensor::Error>(())
    /// ```
    pub fn allclose(&self, other: &Tensor, rtol: f64, atol: f64) -> Result<bool> {
        let shape = self.broadcast_with("allclose", other)?;
        let a = self.expand(&shape)?.to_f64_vec()?;
        let b = other.expand(&shape)?.to_f64_vec()?;
        Ok(a.iter()
            .zip(&b)
            .all(|(&x, &y)| x == y || (x - y).abs() <= atol + rtol * y.abs()))
    }
}

#[cfg(test)]
mod tests {
    use half::bf16;

    use crate::{DType, Error, Result, Tensor};

    #[test]
    fn reductions_along_dims() -> Result<()> {
        let t = Tensor::arange(24, DType::F64)?.view(&[2, 3, 4])?;
        let s1 = t.sum(1, false)?;
        assert_eq!(s1.shape(), &[2, 4]);
        assert_eq!(
            s1.to_vec::<f64>()?,
            vec![12., 15., 18., 21., 48., 51., 54., 57.]
        );
        assert_eq!(t.mean(2, true)?.shape(), &[2, 3, 1]);
        assert_eq!(
            t.mean(2, true)?.to_vec::<f64>()?,
            vec![1.5, 5.5, 9.5, 13.5, 17.5, 21.5]
        );
        assert_eq!(
            t.max(0, false)?.to_vec::<f64>()?,
            (12..24).map(f64::from).collect::<Vec<_>>()
        );
        // Strided input: reduce a transposed view.
        let tt = t.permute(&[2, 0, 1])?;
        assert_eq!(
            tt.sum(2, false)?.to_vec::<f64>()?,
            vec![12., 48., 15., 51., 18., 54., 21., 57.]
        );
        assert_eq!(t.sum_all()?.item::<f64>()?, 276.0);
        assert_eq!(tt.sum_all()?.item::<f64>()?, 276.0);
        assert_eq!(t.mean_all()?.item::<f64>()?, 11.5);
        assert_eq!(tt.max_all()?.item::<f64>()?, 23.0);
        Ok(())
    }

    #[test]
    fn reduction_dtypes_and_edge_cases() -> Result<()> {
        let i = Tensor::from_vec(vec![i32::MAX, 1, -5], &[3])?;
        assert_eq!(
            i.sum(0, false)?.item::<i32>()?,
            i32::MAX.wrapping_add(1).wrapping_sub(5)
        );
        assert_eq!(i.max(0, false)?.item::<i32>()?, i32::MAX);
        assert!(matches!(
            i.mean(0, false),
            Err(Error::UnsupportedDType { .. })
        ));
        let b = Tensor::from_bools(&[true], &[1])?;
        assert!(matches!(
            b.sum(0, false),
            Err(Error::UnsupportedDType { .. })
        ));
        let empty = Tensor::zeros(&[2, 0], DType::F32)?;
        assert_eq!(empty.sum(1, false)?.to_vec::<f32>()?, vec![0.0, 0.0]);
        assert!(
            empty
                .mean(1, false)?
                .to_vec::<f32>()?
                .iter()
                .all(|x| x.is_nan())
        );
        assert!(matches!(
            empty.max(1, false),
            Err(Error::EmptyReduction { dim: 1, .. })
        ));
        assert!(matches!(
            empty.sum(2, false),
            Err(Error::DimOutOfRange { .. })
        ));
        let nan = Tensor::from_vec(vec![1.0f32, f32::NAN, 3.0], &[3])?;
        assert!(nan.max_all()?.item::<f32>()?.is_nan());
        // bf16 accumulates in f32: 256 + 1 + 1 + ... stays exact until the final rounding.
        let ones = Tensor::ones(&[300], DType::BF16)?;
        assert_eq!(ones.sum_all()?.item::<bf16>()?, bf16::from_f32(300.0));
        // Long f32 sums use several lanes; the result is exact for small integers.
        let long = Tensor::arange(1001, DType::F32)?;
        assert_eq!(long.sum_all()?.item::<f32>()?, 500_500.0);
        Ok(())
    }

    #[test]
    fn allclose_rules() -> Result<()> {
        let a = Tensor::from_vec(vec![1.0f64, f64::INFINITY, 100.0], &[3])?;
        let b = Tensor::from_vec(vec![1.0 + 1e-9, f64::INFINITY, 100.5], &[3])?;
        assert!(a.allclose(&b, 1e-2, 0.0)?);
        assert!(!a.allclose(&b, 1e-3, 0.0)?);
        let n = Tensor::from_vec(vec![f64::NAN], &[1])?;
        assert!(!n.allclose(&n, 1.0, 1.0)?);
        let row = Tensor::from_vec(vec![1.0f64, 1.0, 1.0], &[3])?;
        assert!(row.allclose(&Tensor::ones(&[2, 3], DType::F64)?, 0.0, 0.0)?);
        assert!(matches!(
            row.allclose(&Tensor::ones(&[2], DType::F64)?, 0.0, 0.0),
            Err(Error::NotBroadcastable { .. })
        ));
        assert!(matches!(
            row.allclose(&Tensor::ones(&[3], DType::F32)?, 0.0, 0.0),
            Err(Error::DTypeMismatch { .. })
        ));
        Ok(())
    }
}
