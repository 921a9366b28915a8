//! The [`Tensor`] type: a strided view into shared storage, its accessors and constructors.

use std::fmt;
use std::sync::Arc;

use crate::deferred::Fill;
use crate::dtype::sealed::Repr;
use crate::dtype::{BoolByte, Element, with_repr};
use crate::layout::{StridedIndices, checked_numel, contiguous_strides, is_contiguous};
use crate::storage::{HostBuffer, SharedStorage, Storage};
use crate::{DType, Error, Result};

/// A dense n-d array: shared storage plus dtype, shape, strides and offset (both in elements).
///
/// `Clone` is cheap and makes another *view* of the same storage (like assigning a tensor to a
/// second name in Python); [`Tensor::deep_copy`] makes an independent copy (torch's `clone()`).
/// Views made by [`narrow`](Tensor::narrow), [`chunk`](Tensor::chunk),
/// [`transpose`](Tensor::transpose), [`view`](Tensor::view), [`expand`](Tensor::expand)...
/// share storage, so a write through one (for example [`copy_from`](Tensor::copy_from)) is seen
/// by all. See the crate docs for the aliasing rules.
///
/// ```
/// use hypershard_tensor::{DType, Tensor};
/// let t = Tensor::from_vec(vec![1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0], &[2, 3])?;
/// assert_eq!(t.shape(), &[2, 3]);
/// assert_eq!(t.strides(), &[3, 1]);
/// let col = t.narrow(1, 1, 1)?;
/// assert_eq!(col.to_vec::<f32>()?, vec![2.0, 5.0]);
/// assert!(col.shares_storage(&t));
/// # Ok::<(), hypershard_tensor::Error>(())
/// ```
#[derive(Clone)]
pub struct Tensor {
    pub(crate) storage: Arc<SharedStorage>,
    pub(crate) dtype: DType,
    pub(crate) shape: Vec<usize>,
    pub(crate) strides: Vec<usize>,
    pub(crate) offset: usize,
}

impl fmt::Debug for Tensor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Tensor")
            .field("dtype", &self.dtype)
            .field("shape", &self.shape)
            .field("strides", &self.strides)
            .field("offset", &self.offset)
            .finish()
    }
}

impl Tensor {
    // ----- accessors -----

    /// The element type.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// The size of every dim.
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    /// The stride of every dim, in elements. Expanded dims have stride 0.
    pub fn strides(&self) -> &[usize] {
        &self.strides
    }

    /// The index of the first element in the storage, in elements.
    pub fn offset(&self) -> usize {
        self.offset
    }

    /// The number of dims.
    pub fn ndim(&self) -> usize {
        self.shape.len()
    }

    /// The number of elements.
    pub fn numel(&self) -> usize {
        // Element counts were checked for overflow when the shape was made.
        self.shape.iter().product()
    }

    /// The number of bytes the elements take when contiguous.
    pub fn nbytes(&self) -> usize {
        self.numel() * self.dtype.size_of()
    }

    /// The size of `dim`.
    pub fn size(&self, dim: usize) -> Result<usize> {
        self.check_dim("size", dim)?;
        Ok(self.shape[dim])
    }

    /// The shared storage this tensor views.
    pub fn storage(&self) -> &Arc<SharedStorage> {
        &self.storage
    }

    /// Whether `self` and `other` view the same storage.
    pub fn shares_storage(&self, other: &Tensor) -> bool {
        Arc::ptr_eq(&self.storage, &other.storage)
    }

    /// Whether the elements are laid out row-major without gaps (size-1 dims may have any
    /// stride, as in torch).
    pub fn is_contiguous(&self) -> bool {
        is_contiguous(&self.shape, &self.strides)
    }

    // ----- construction -----

    /// A contiguous tensor over freshly allocated storage.
    pub(crate) fn from_host(buf: HostBuffer, dtype: DType, shape: Vec<usize>) -> Tensor {
        Tensor::from_storage(Storage::Host(buf), dtype, shape)
    }

    /// A contiguous tensor over `storage`.
    pub(crate) fn from_storage(storage: Storage, dtype: DType, shape: Vec<usize>) -> Tensor {
        let strides = contiguous_strides(&shape);
        Tensor {
            storage: Arc::new(SharedStorage::new(storage)),
            dtype,
            shape,
            strides,
            offset: 0,
        }
    }

    /// Allocates a contiguous tensor of `shape` and lets `fill` write its elements.
    pub(crate) fn build<T: Repr>(
        op: &'static str,
        shape: &[usize],
        fill: impl FnOnce(&mut [T]),
    ) -> Result<Tensor> {
        Tensor::build_raw::<T>(op, shape, T::DTYPE, fill)
    }

    /// Like [`Tensor::build`], writing the elements as `T` (any type of `dtype`'s width).
    pub(crate) fn build_raw<T: bytemuck::Pod>(
        op: &'static str,
        shape: &[usize],
        dtype: DType,
        fill: impl FnOnce(&mut [T]),
    ) -> Result<Tensor> {
        Tensor::build_raw_on::<T>(op, crate::Device::Cpu, shape, dtype, fill)
    }

    /// The bytes `shape` takes at `elem` bytes an element, capped at `isize::MAX` like every
    /// Rust allocation.
    pub(crate) fn checked_bytes(op: &'static str, shape: &[usize], elem: usize) -> Result<usize> {
        let numel = checked_numel(op, shape)?;
        numel
            .checked_mul(elem)
            .filter(|&b| b <= isize::MAX as usize)
            .ok_or_else(|| Error::SizeOverflow {
                op,
                shape: shape.to_vec(),
            })
    }

    /// A tensor holding `data` in row-major order.
    ///
    /// ```
    /// use hypershard_tensor::Tensor;
    /// let t = Tensor::from_vec(vec![1i64, 2, 3], &[3])?;
    /// assert_eq!(t.to_vec::<i64>()?, vec![1, 2, 3]);
    /// assert!(Tensor::from_vec(vec![1i64, 2, 3], &[2, 2]).is_err());
    /// # Ok::<(), hypershard_tensor::Error>(())
    /// ```
    pub fn from_vec<T: Element>(data: Vec<T>, shape: &[usize]) -> Result<Tensor> {
        Tensor::from_slice(&data, shape)
    }

    /// A tensor holding a copy of `data` in row-major order.
    pub fn from_slice<T: Element>(data: &[T], shape: &[usize]) -> Result<Tensor> {
        let numel = checked_numel("from_slice", shape)?;
        if numel != data.len() {
            return Err(Error::NumelMismatch {
                op: "from_slice",
                shape: shape.to_vec(),
                expected: numel,
                actual: data.len(),
            });
        }
        Tensor::build::<T>("from_slice", shape, |out| out.copy_from_slice(data))
    }

    /// A 0-d tensor holding `value`.
    pub fn scalar<T: Element>(value: T) -> Tensor {
        let mut buf = HostBuffer::zeroed(size_of::<T>());
        buf.typed_mut::<T>()[0] = value;
        Tensor::from_host(buf, T::DTYPE, Vec::new())
    }

    /// A bool tensor from `data` in row-major order.
    pub fn from_bools(data: &[bool], shape: &[usize]) -> Result<Tensor> {
        let bytes: Vec<u8> = data.iter().map(|&b| u8::from(b)).collect();
        let numel = checked_numel("from_bools", shape)?;
        if numel != data.len() {
            return Err(Error::NumelMismatch {
                op: "from_bools",
                shape: shape.to_vec(),
                expected: numel,
                actual: data.len(),
            });
        }
        Tensor::build::<BoolByte>("from_bools", shape, |out| {
            for (o, b) in out.iter_mut().zip(bytes) {
                *o = BoolByte(b);
            }
        })
    }

    /// A tensor of `shape` and `dtype` whose bytes are `bytes` (little-endian, row-major).
    pub fn from_bytes(bytes: &[u8], shape: &[usize], dtype: DType) -> Result<Tensor> {
        let numel = checked_numel("from_bytes", shape)?;
        let expected = numel
            .checked_mul(dtype.size_of())
            .ok_or_else(|| Error::SizeOverflow {
                op: "from_bytes",
                shape: shape.to_vec(),
            })?;
        if expected != bytes.len() {
            return Err(Error::NumelMismatch {
                op: "from_bytes",
                shape: shape.to_vec(),
                expected: numel,
                actual: bytes.len() / dtype.size_of(),
            });
        }
        let mut buf = HostBuffer::from_bytes(bytes);
        if dtype == DType::Bool {
            // Keep the 0/1 invariant of bool storage whatever the bytes were.
            for b in buf.as_bytes_mut() {
                *b = u8::from(*b != 0);
            }
        }
        Ok(Tensor::from_host(buf, dtype, shape.to_vec()))
    }

    /// A contiguous tensor of `shape` and `dtype` over `buf`, without copying; `buf` must hold
    /// exactly the tensor's bytes.
    pub fn from_host_buffer(buf: HostBuffer, shape: &[usize], dtype: DType) -> Result<Tensor> {
        let numel = checked_numel("from_host_buffer", shape)?;
        if numel.checked_mul(dtype.size_of()) != Some(buf.len()) {
            return Err(Error::NumelMismatch {
                op: "from_host_buffer",
                shape: shape.to_vec(),
                expected: numel,
                actual: buf.len() / dtype.size_of(),
            });
        }
        let mut buf = buf;
        if dtype == DType::Bool {
            for b in buf.as_bytes_mut() {
                *b = u8::from(*b != 0);
            }
        }
        Ok(Tensor::from_host(buf, dtype, shape.to_vec()))
    }

    /// The host buffer behind this tensor, without copying, when this is the only view of it
    /// and covers it exactly (contiguous, offset 0); otherwise the tensor comes back unchanged.
    /// This lets a caller hand memory to a communicator by value.
    ///
    /// ```
    /// use hypershard_tensor::{DType, Tensor};
    /// let t = Tensor::ones(&[4], DType::F32)?;
    /// let view = t.clone();
    /// let t = t.try_into_host_buffer().unwrap_err(); // `view` still aliases it
    /// drop(view);
    /// let buf = t.try_into_host_buffer().map_err(|_| hypershard_tensor::Error::EmptyInput { op: "doc" })?;
    /// assert_eq!(buf.len(), 16);
    /// # Ok::<(), hypershard_tensor::Error>(())
    /// ```
    pub fn try_into_host_buffer(self) -> std::result::Result<HostBuffer, Tensor> {
        let covers_all =
            self.offset == 0 && self.is_contiguous() && self.storage.read().len() == self.nbytes();
        if !covers_all {
            return Err(self);
        }
        let Tensor {
            storage,
            dtype,
            shape,
            strides,
            offset,
        } = self;
        match Arc::try_unwrap(storage) {
            Ok(shared) => match shared.into_inner() {
                Storage::Host(buf) => Ok(buf),
                other => Err(Tensor {
                    storage: Arc::new(SharedStorage::new(other)),
                    dtype,
                    shape,
                    strides,
                    offset,
                }),
            },
            Err(storage) => Err(Tensor {
                storage,
                dtype,
                shape,
                strides,
                offset,
            }),
        }
    }

    /// The 1-D tensor over the whole of this tensor's storage, sharing it, when this tensor is
    /// a contiguous prefix of that storage (offset 0) whose length is a whole number of
    /// elements; otherwise the tensor comes back unchanged. No reference is added: with the
    /// last view consumed, [`try_into_host_buffer`](Self::try_into_host_buffer) of the result
    /// hands the memory on. FSDP uses it to turn a gradient that was accumulated into the
    /// prefix of a gathered buffer back into that buffer.
    ///
    /// ```
    /// use hypershard_tensor::{DType, Tensor};
    /// let base = Tensor::arange(6, DType::F32)?;
    /// let prefix = base.narrow(0, 0, 4)?.view(&[2, 2])?;
    /// drop(base);
    /// let whole = prefix.into_whole_storage().map_err(|_| hypershard_tensor::Error::EmptyInput { op: "doc" })?;
    /// assert_eq!(whole.to_vec::<f32>()?, vec![0.0, 1.0, 2.0, 3.0, 4.0, 5.0]);
    /// # Ok::<(), hypershard_tensor::Error>(())
    /// ```
    pub fn into_whole_storage(self) -> std::result::Result<Tensor, Tensor> {
        let bytes = self.storage.read().len();
        let size = self.dtype.size_of();
        if self.offset != 0 || !self.is_contiguous() || size == 0 || !bytes.is_multiple_of(size) {
            return Err(self);
        }
        let numel = bytes / size;
        Ok(Tensor {
            strides: contiguous_strides(&[numel]),
            shape: vec![numel],
            offset: 0,
            dtype: self.dtype,
            storage: self.storage,
        })
    }

    /// A tensor of zeros.
    ///
    /// ```
    /// use hypershard_tensor::{DType, Tensor};
    /// let z = Tensor::zeros(&[2, 2], DType::BF16)?;
    /// assert_eq!(z.to_f64_vec()?, vec![0.0; 4]);
    /// # Ok::<(), hypershard_tensor::Error>(())
    /// ```
    pub fn zeros(shape: &[usize], dtype: DType) -> Result<Tensor> {
        if crate::deferred::in_deferred_init() {
            return Tensor::deferred_with("zeros", shape, dtype, Some(Fill::Constant(0.0)));
        }
        // All-zero bytes are 0 (or false) in every dtype.
        with_repr!(dtype, T => Tensor::build::<T>("zeros", shape, |_| {}))
    }

    /// A tensor of ones.
    pub fn ones(shape: &[usize], dtype: DType) -> Result<Tensor> {
        Tensor::full(shape, 1.0, dtype)
    }

    /// A tensor with every element `value`, converted to `dtype` (rounded to nearest for floats,
    /// truncated and saturated for integers, `value != 0` for bool).
    pub fn full(shape: &[usize], value: f64, dtype: DType) -> Result<Tensor> {
        if crate::deferred::in_deferred_init() {
            return Tensor::deferred_with("full", shape, dtype, Some(Fill::Constant(value)));
        }
        Tensor::eager_full(shape, value, dtype)
    }

    /// [`Tensor::full`], allocated even inside a deferred scope.
    pub(crate) fn eager_full(shape: &[usize], value: f64, dtype: DType) -> Result<Tensor> {
        with_repr!(dtype, T => {
            let v = T::from_f64(value);
            Tensor::build::<T>("full", shape, |out| out.fill(v))
        })
    }

    /// The 1-d tensor `[0, 1, ..., n-1]` (values above the dtype's range saturate).
    ///
    /// ```
    /// use hypershard_tensor::{DType, Tensor};
    /// assert_eq!(Tensor::arange(4, DType::I32)?.to_vec::<i32>()?, vec![0, 1, 2, 3]);
    /// # Ok::<(), hypershard_tensor::Error>(())
    /// ```
    pub fn arange(n: usize, dtype: DType) -> Result<Tensor> {
        with_repr!(dtype, T => Tensor::build::<T>("arange", &[n], |out| {
            for (i, o) in out.iter_mut().enumerate() {
                // Through f64: exact below 2^53, saturating at the dtype's maximum.
                *o = T::from_f64(i as f64);
            }
        }))
    }

    // ----- reading -----

    /// Checks that `dim < ndim`.
    pub(crate) fn check_dim(&self, op: &'static str, dim: usize) -> Result<()> {
        if dim < self.ndim() {
            Ok(())
        } else {
            Err(Error::DimOutOfRange {
                op,
                dim,
                ndim: self.ndim(),
            })
        }
    }

    /// Checks that the tensor's dtype is `T`'s.
    pub(crate) fn check_dtype<T: Repr>(&self, op: &'static str) -> Result<()> {
        if self.dtype == T::DTYPE {
            Ok(())
        } else {
            Err(Error::DTypeMismatch {
                op,
                lhs: self.dtype,
                rhs: T::DTYPE,
            })
        }
    }

    /// The storage element index of every element, in row-major order.
    pub(crate) fn indices(&self) -> StridedIndices<'_> {
        StridedIndices::new(&self.shape, &self.strides, self.offset)
    }

    /// The elements in row-major order, read from `data` (this tensor's storage as `T`).
    pub(crate) fn gather<T: Copy>(&self, data: &[T]) -> Vec<T> {
        if self.is_contiguous() {
            data[self.offset..self.offset + self.numel()].to_vec()
        } else {
            self.indices().map(|i| data[i]).collect()
        }
    }

    /// The elements in row-major order. `T` must be the tensor's element type.
    ///
    /// ```
    /// use hypershard_tensor::Tensor;
    /// let t = Tensor::from_vec(vec![1.0f64, 2.0, 3.0, 4.0], &[2, 2])?.transpose(0, 1)?;
    /// assert_eq!(t.to_vec::<f64>()?, vec![1.0, 3.0, 2.0, 4.0]);
    /// assert!(t.to_vec::<f32>().is_err());
    /// # Ok::<(), hypershard_tensor::Error>(())
    /// ```
    pub fn to_vec<T: Element>(&self) -> Result<Vec<T>> {
        self.check_dtype::<T>("to_vec")?;
        let guard = self.storage.read();
        Ok(self.gather(guard.host("to_vec")?.typed::<T>()))
    }

    /// The elements of a bool tensor in row-major order.
    pub fn to_bools(&self) -> Result<Vec<bool>> {
        self.check_dtype::<BoolByte>("to_bools")?;
        let guard = self.storage.read();
        Ok(self
            .gather(guard.host("to_bools")?.typed::<BoolByte>())
            .into_iter()
            .map(|b| b.0 != 0)
            .collect())
    }

    /// The elements converted to `f64`, whatever the dtype (bool gives 0 or 1).
    pub fn to_f64_vec(&self) -> Result<Vec<f64>> {
        let guard = self.storage.read();
        let host = guard.host("to_f64_vec")?;
        Ok(with_repr!(self.dtype, T => {
            self.gather(host.typed::<T>()).into_iter().map(T::to_f64).collect()
        }))
    }

    /// The elements as little-endian bytes, row-major.
    pub fn to_bytes(&self) -> Result<Vec<u8>> {
        let guard = self.storage.read();
        let host = guard.host("to_bytes")?;
        Ok(crate::dtype::with_bits!(self.dtype, T => {
            bytemuck::cast_slice::<T, u8>(&self.gather(host.typed::<T>())).to_vec()
        }))
    }

    /// The only element of a one-element tensor (any shape). `T` must be the element type.
    ///
    /// ```
    /// use hypershard_tensor::Tensor;
    /// assert_eq!(Tensor::scalar(2.5f32).item::<f32>()?, 2.5);
    /// # Ok::<(), hypershard_tensor::Error>(())
    /// ```
    pub fn item<T: Element>(&self) -> Result<T> {
        self.check_dtype::<T>("item")?;
        if self.numel() != 1 {
            return Err(Error::NotScalar {
                op: "item",
                shape: self.shape.clone(),
            });
        }
        let guard = self.storage.read();
        Ok(guard.host("item")?.typed::<T>()[self.offset])
    }

    /// The only element of a one-element tensor, converted to `f64`.
    pub fn item_f64(&self) -> Result<f64> {
        if self.numel() != 1 {
            return Err(Error::NotScalar {
                op: "item_f64",
                shape: self.shape.clone(),
            });
        }
        let guard = self.storage.read();
        let host = guard.host("item_f64")?;
        Ok(with_repr!(self.dtype, T => host.typed::<T>()[self.offset].to_f64()))
    }

    /// Runs `f` on the elements of a contiguous tensor, in place in the storage (no copy).
    ///
    /// This is how data reaches a communicator or a GEMM without an extra copy. The storage
    /// lock is held while `f` runs, so `f` must not use another view of the same storage
    /// (that would wait on itself).
    pub fn with_data<T: Element, R>(&self, f: impl FnOnce(&[T]) -> R) -> Result<R> {
        self.check_dtype::<T>("with_data")?;
        self.check_contiguous("with_data")?;
        let guard = self.storage.read();
        Ok(f(
            &guard.host("with_data")?.typed::<T>()[self.offset..self.offset + self.numel()]
        ))
    }

    /// Runs `f` on the elements of a contiguous tensor, mutably, holding the storage's write
    /// lock: every view of the storage sees the writes afterwards. As with
    /// [`with_data`](Tensor::with_data), `f` must not touch the same storage through another
    /// view.
    ///
    /// ```
    /// use hypershard_tensor::{DType, Tensor};
    /// let flat = Tensor::zeros(&[6], DType::F32)?;
    /// let part = flat.narrow(0, 2, 3)?;
    /// part.with_data_mut(|xs: &mut [f32]| xs.fill(1.0))?;
    /// assert_eq!(flat.to_vec::<f32>()?, vec![0.0, 0.0, 1.0, 1.0, 1.0, 0.0]);
    /// # Ok::<(), hypershard_tensor::Error>(())
    /// ```
    pub fn with_data_mut<T: Element, R>(&self, f: impl FnOnce(&mut [T]) -> R) -> Result<R> {
        self.check_dtype::<T>("with_data_mut")?;
        self.check_contiguous("with_data_mut")?;
        let mut guard = self.storage.write();
        let n = self.numel();
        Ok(f(
            &mut guard.host_mut("with_data_mut")?.typed_mut::<T>()[self.offset..self.offset + n]
        ))
    }

    /// Errors unless the tensor is contiguous.
    pub(crate) fn check_contiguous(&self, op: &'static str) -> Result<()> {
        if self.is_contiguous() {
            Ok(())
        } else {
            Err(Error::NotContiguous {
                op,
                shape: self.shape.clone(),
                strides: self.strides.clone(),
            })
        }
    }
}

#[cfg(test)]
mod tests {
    use half::{bf16, f16};

    use super::*;

    #[test]
    fn a_prefix_view_widens_to_its_whole_storage_and_nothing_else_does() -> Result<()> {
        let base = Tensor::arange(12, DType::F32)?;
        // A prefix, reshaped: widens, shares, and hands the buffer on once it is the last view.
        let prefix = base.narrow(0, 0, 6)?.view(&[2, 3])?;
        prefix.fill_(-1.0)?;
        drop(base);
        let whole = prefix
            .into_whole_storage()
            .map_err(|_| Error::EmptyInput { op: "test" })?;
        assert_eq!(whole.shape(), &[12]);
        let mut expected = vec![-1.0f32; 6];
        expected.extend((6..12).map(|v| v as f32));
        assert_eq!(whole.to_vec::<f32>()?, expected);
        let buffer = whole
            .try_into_host_buffer()
            .map_err(|_| Error::EmptyInput { op: "test" })?;
        assert_eq!(buffer.len(), 48);
        // Not at offset 0, or not contiguous: the tensor comes back as it was.
        let base = Tensor::arange(12, DType::F32)?;
        let tail = base.narrow(0, 2, 4)?;
        let tail = tail
            .into_whole_storage()
            .expect_err("offset 2 is no prefix");
        assert_eq!(tail.to_vec::<f32>()?, vec![2.0, 3.0, 4.0, 5.0]);
        let columns = base.view(&[3, 4])?.narrow(1, 0, 2)?;
        assert!(columns.into_whole_storage().is_err());
        Ok(())
    }

    #[test]
    fn constructors_fill_values() -> Result<()> {
        for dtype in DType::ALL {
            let z = Tensor::zeros(&[2, 3], dtype)?;
            assert_eq!(z.dtype(), dtype);
            assert_eq!(z.to_f64_vec()?, vec![0.0; 6]);
            assert_eq!(Tensor::ones(&[3], dtype)?.to_f64_vec()?, vec![1.0; 3]);
            assert_eq!(
                Tensor::full(&[2], 2.0, dtype)?.to_f64_vec()?,
                vec![if dtype == DType::Bool { 1.0 } else { 2.0 }; 2]
            );
        }
        assert_eq!(
            Tensor::arange(3, DType::BF16)?.to_vec::<bf16>()?,
            vec![
                bf16::from_f32(0.0),
                bf16::from_f32(1.0),
                bf16::from_f32(2.0)
            ]
        );
        assert_eq!(Tensor::arange(300, DType::U8)?.to_vec::<u8>()?[299], 255);
        assert_eq!(Tensor::full(&[1], -1.5, DType::I64)?.item::<i64>()?, -1);
        assert_eq!(
            Tensor::full(&[1], 0.1, DType::F16)?.item::<f16>()?,
            f16::from_f64(0.1)
        );
        Ok(())
    }

    #[test]
    fn bad_constructor_input_is_an_error() {
        assert!(matches!(
            Tensor::from_vec(vec![1.0f32; 5], &[2, 3]),
            Err(Error::NumelMismatch {
                expected: 6,
                actual: 5,
                ..
            })
        ));
        assert!(matches!(
            Tensor::zeros(&[usize::MAX, 4], DType::F32),
            Err(Error::SizeOverflow { .. })
        ));
        assert!(matches!(
            Tensor::zeros(&[usize::MAX / 2], DType::F64),
            Err(Error::SizeOverflow { .. })
        ));
        assert!(matches!(
            Tensor::from_bools(&[true], &[2]),
            Err(Error::NumelMismatch { .. })
        ));
        assert!(matches!(
            Tensor::from_bytes(&[0; 7], &[2], DType::F32),
            Err(Error::NumelMismatch { .. })
        ));
    }

    #[test]
    fn accessors_and_typed_reads() -> Result<()> {
        let t = Tensor::from_vec((0..24).map(|i| i as f32).collect(), &[2, 3, 4])?;
        assert_eq!(t.ndim(), 3);
        assert_eq!(t.numel(), 24);
        assert_eq!(t.nbytes(), 96);
        assert_eq!(t.size(2)?, 4);
        assert!(matches!(
            t.size(3),
            Err(Error::DimOutOfRange {
                dim: 3,
                ndim: 3,
                ..
            })
        ));
        assert!(matches!(
            t.to_vec::<f64>(),
            Err(Error::DTypeMismatch {
                lhs: DType::F32,
                rhs: DType::F64,
                ..
            })
        ));
        assert!(matches!(t.item::<f32>(), Err(Error::NotScalar { .. })));
        assert_eq!(Tensor::scalar(7i32).item::<i32>()?, 7);
        assert_eq!(Tensor::scalar(7i32).shape(), &[] as &[usize]);
        assert_eq!(
            t.narrow(2, 3, 1)?
                .narrow(1, 2, 1)?
                .narrow(0, 1, 1)?
                .item::<f32>()?,
            23.0
        );
        assert!(matches!(
            t.narrow(0, 1, 1)?.item_f64(),
            Err(Error::NotScalar { .. })
        ));
        assert_eq!(t.with_data(|xs: &[f32]| xs.iter().sum::<f32>())?, 276.0);
        Ok(())
    }

    #[test]
    fn bools_and_bytes_round_trip() -> Result<()> {
        let b = Tensor::from_bools(&[true, false, true], &[3])?;
        assert_eq!(b.dtype(), DType::Bool);
        assert_eq!(b.to_bools()?, vec![true, false, true]);
        assert_eq!(b.to_bytes()?, vec![1, 0, 1]);
        let raw = Tensor::from_bytes(&[0, 5, 0], &[3], DType::Bool)?;
        assert_eq!(raw.to_bools()?, vec![false, true, false]);
        let f = Tensor::from_vec(vec![1.5f32, -2.0], &[2])?;
        let back = Tensor::from_bytes(&f.to_bytes()?, &[2], DType::F32)?;
        assert_eq!(back.to_vec::<f32>()?, vec![1.5, -2.0]);
        Ok(())
    }

    #[test]
    fn host_buffers_move_in_and_out_without_copy() -> Result<()> {
        let mut buf = HostBuffer::zeroed(8);
        buf.as_bytes_mut()
            .copy_from_slice(bytemuck::cast_slice(&[1.5f32, 2.5]));
        let t = Tensor::from_host_buffer(buf, &[2], DType::F32)?;
        assert_eq!(t.to_vec::<f32>()?, vec![1.5, 2.5]);
        assert!(matches!(
            Tensor::from_host_buffer(HostBuffer::zeroed(8), &[3], DType::F32),
            Err(Error::NumelMismatch { .. })
        ));
        let part = t.narrow(0, 1, 1)?;
        let part = match part.try_into_host_buffer() {
            Ok(_) => panic!("a partial view must not release the buffer"),
            Err(part) => part,
        };
        drop(part);
        let back = t.try_into_host_buffer();
        assert!(
            matches!(back, Ok(ref b) if b.as_bytes() == bytemuck::cast_slice::<f32, u8>(&[1.5, 2.5]))
        );
        Ok(())
    }

    #[test]
    fn with_data_needs_contiguous_and_matching_dtype() -> Result<()> {
        let t = Tensor::zeros(&[2, 3], DType::F32)?;
        let tt = t.transpose(0, 1)?;
        assert!(matches!(
            tt.with_data(|_: &[f32]| ()),
            Err(Error::NotContiguous { .. })
        ));
        assert!(matches!(
            t.with_data(|_: &[i32]| ()),
            Err(Error::DTypeMismatch { .. })
        ));
        t.narrow(0, 1, 1)?
            .with_data_mut(|xs: &mut [f32]| xs.copy_from_slice(&[1.0, 2.0, 3.0]))?;
        assert_eq!(tt.to_vec::<f32>()?, vec![0.0, 1.0, 0.0, 2.0, 0.0, 3.0]);
        Ok(())
    }
}
