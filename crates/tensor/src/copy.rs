//! Copies: `contiguous`, dtype casts, `copy_from` into a view, `fill_`, `cat`.

use crate::DeviceBuffer;
use crate::dtype::sealed::Repr;
use crate::dtype::{cast_bytes, with_bits, with_repr};
use crate::layout::{StridedIndices, broadcast_shapes, expand_strides, has_internal_overlap};
use crate::lock::read_write;
use crate::storage::{Storage, common_device};
use crate::{DType, Error, Result, Tensor};

impl Tensor {
    /// `self` if already contiguous (no copy), otherwise a contiguous copy.
    ///
    /// ```
    /// use hypershard_tensor::{DType, Tensor};
    /// let t = Tensor::zeros(&[2, 3], DType::F32)?;
    /// assert!(t.contiguous()?.shares_storage(&t));
    /// let tt = t.transpose(0, 1)?.contiguous()?;
    /// assert!(tt.is_contiguous() && !tt.shares_storage(&t));
    /// # Ok::<(), hypershard_tensor::Error>(())
    /// ```
    pub fn contiguous(&self) -> Result<Tensor> {
        if self.is_contiguous() {
            Ok(self.clone())
        } else {
            self.deep_copy()
        }
    }

    /// A contiguous copy in new storage (torch's `clone()`).
    pub fn deep_copy(&self) -> Result<Tensor> {
        let guard = self.storage.read();
        if let Storage::Device(buf) = &*guard
            && self.is_contiguous()
        {
            // One device-to-device copy through the backend, on any device (CUDA included).
            let mut out = DeviceBuffer::zeroed("deep_copy", &buf.device(), self.nbytes())?;
            let start = self.offset * self.dtype.size_of();
            out.copy_from_device("deep_copy", 0, buf, start, self.nbytes())?;
            return Ok(Tensor::from_storage(
                Storage::Device(out),
                self.dtype,
                self.shape.clone(),
            ));
        }
        let device = guard.device();
        let host = guard.data("deep_copy")?;
        with_bits!(self.dtype, T => {
            let data = self.gather(host.typed::<T>());
            Tensor::build_raw_on::<T>("deep_copy", device, &self.shape, self.dtype, |o| o.copy_from_slice(&data))
        })
    }

    /// The elements converted to `dtype`, in new contiguous storage; `self` (a view, no copy)
    /// when the dtype already matches, like torch's `.to(dtype)`.
    ///
    /// Floats round to nearest-even, float→int truncates toward zero and saturates (NaN → 0),
    /// int→int wraps like Rust's `as`, anything→bool is `x != 0`, bool→anything is 0 or 1.
    ///
    /// ```
    /// use hypershard_tensor::{DType, Tensor};
    /// let t = Tensor::from_vec(vec![1.5f32, -2.5, 1e10], &[3])?;
    /// assert_eq!(t.to_dtype(DType::I32)?.to_vec::<i32>()?, vec![1, -2, i32::MAX]);
    /// assert_eq!(t.to_dtype(DType::BF16)?.to_f64_vec()?[..2], [1.5, -2.5]);
    /// # Ok::<(), hypershard_tensor::Error>(())
    /// ```
    pub fn to_dtype(&self, dtype: DType) -> Result<Tensor> {
        if dtype == self.dtype {
            return Ok(self.clone());
        }
        if !self.is_contiguous() {
            // Gather first (one loop per element width), then cast a contiguous run: a
            // strided loop per pair of dtypes would be 64 more kernels to compile for a rare
            // case.
            return self.contiguous()?.to_dtype(dtype);
        }
        let guard = self.storage.read();
        let device = guard.device();
        #[cfg(feature = "cuda")]
        if device.is_cuda() {
            drop(guard);
            return crate::cuda::cast(self, dtype);
        }
        let host = guard.data("to_dtype")?;
        let size = self.dtype.size_of();
        let src = &host.as_bytes()[self.offset * size..(self.offset + self.numel()) * size];
        let from = self.dtype;
        with_bits!(dtype, D => Tensor::build_raw_on::<D>("to_dtype", device, &self.shape, dtype, |out| {
            cast_bytes(from, src, dtype, bytemuck::cast_slice_mut(out));
        }))
    }

    /// Errors if writing into `self` would write one storage element twice.
    pub(crate) fn check_writable(&self, op: &'static str) -> Result<()> {
        if has_internal_overlap(&self.shape, &self.strides) {
            Err(Error::OverlappingWrite {
                op,
                shape: self.shape.clone(),
                strides: self.strides.clone(),
            })
        } else {
            Ok(())
        }
    }

    /// Copies `src` into this (possibly strided) view, in place in the shared storage.
    ///
    /// `src` is broadcast to `self`'s shape and converted to `self`'s dtype (the rules of
    /// [`to_dtype`](Tensor::to_dtype)); `src` may alias `self` (it is read in full before the
    /// write). This is how a shard lands in its slice of a flat buffer:
    ///
    /// ```
    /// use hypershard_tensor::{DType, Tensor};
    /// let flat = Tensor::zeros(&[6], DType::BF16)?;
    /// let shard = Tensor::from_vec(vec![1.0f32, 2.0, 3.0], &[3])?;
    /// flat.narrow(0, 3, 3)?.copy_from(&shard)?; // cast f32 -> bf16 on the way in
    /// assert_eq!(flat.to_f64_vec()?, vec![0.0, 0.0, 0.0, 1.0, 2.0, 3.0]);
    /// # Ok::<(), hypershard_tensor::Error>(())
    /// ```
    pub fn copy_from(&self, src: &Tensor) -> Result<()> {
        self.check_writable("copy_from")?;
        let Some(src_strides) = expand_strides(&src.shape, &src.strides, &self.shape) else {
            return Err(Error::ShapeMismatch {
                op: "copy_from",
                lhs: self.shape.clone(),
                rhs: src.shape.clone(),
            });
        };
        if self.shares_storage(src) {
            // Reading and writing one storage under one operation needs the bytes apart.
            let detached = src.deep_copy()?;
            return self.copy_from(&detached);
        }
        let mut guards = read_write(&src.storage, &self.storage);
        common_device("copy_from", &guards.dst, &guards.src)?;
        let contiguous_pair =
            self.is_contiguous() && src.is_contiguous() && src.shape == self.shape;
        if let (Storage::Device(to), Storage::Device(from)) = (&mut *guards.dst, &*guards.src)
            && contiguous_pair
            && self.dtype == src.dtype
        {
            // A plain byte copy: through the backend, on any device (CUDA included).
            let size = self.dtype.size_of();
            let (at, from_at) = (self.offset * size, src.offset * size);
            return to.copy_from_device("copy_from", at, from, from_at, self.nbytes());
        }
        if let (Storage::Device(_), Storage::Device(_)) = (&*guards.dst, &*guards.src)
            && contiguous_pair
        {
            // A cast between devices' contiguous tensors: `to_dtype` (a cast kernel on a GPU)
            // into a temporary, then the byte copy above, so no host kernel reads device
            // memory (mixed precision's copy-in and copy-out on a GPU).
            drop(guards);
            return self.copy_from(&src.to_dtype(self.dtype)?);
        }
        let src_host = guards.src.data("copy_from")?;
        let dst_host = guards.dst.data_mut("copy_from")?;
        let src_idx = StridedIndices::new(&self.shape, &src_strides, src.offset);
        if self.dtype == src.dtype {
            with_bits!(self.dtype, T => {
                let s = src_host.typed::<T>();
                let d = dst_host.typed_mut::<T>();
                if contiguous_pair {
                    let n = self.numel();
                    copy_elements(
                        &mut d[self.offset..self.offset + n],
                        &s[src.offset..src.offset + n],
                    );
                } else {
                    for (di, si) in self.indices().zip(src_idx) {
                        d[di] = s[si];
                    }
                }
            });
        } else if contiguous_pair {
            let (ss, ds) = (src.dtype.size_of(), self.dtype.size_of());
            let n = self.numel();
            cast_bytes(
                src.dtype,
                &src_host.as_bytes()[src.offset * ss..(src.offset + n) * ss],
                self.dtype,
                &mut dst_host.as_bytes_mut()[self.offset * ds..(self.offset + n) * ds],
            );
        } else {
            // Cast into a contiguous temporary, then copy it strided with one loop per
            // element width (see `to_dtype`).
            drop(guards);
            return self.copy_from(&src.expand(&self.shape)?.to_dtype(self.dtype)?);
        }
        Ok(())
    }

    /// Sets every element of this view to `value` (converted as in [`Tensor::full`]).
    pub fn fill_(&self, value: f64) -> Result<()> {
        self.check_writable("fill_")?;
        let mut guard = self.storage.write();
        if let Storage::Device(buf) = &mut *guard
            && self.is_contiguous()
            && value.to_bits() == 0
        {
            // +0.0 is all-zero bytes in every dtype: the backend's fill, on any device.
            let start = self.offset * self.dtype.size_of();
            return buf.fill("fill_", start, self.nbytes(), 0);
        }
        let host = guard.data_mut("fill_")?;
        with_repr!(self.dtype, T => {
            let v = T::from_f64(value);
            let d = host.typed_mut::<T>();
            if self.is_contiguous() {
                d[self.offset..self.offset + self.numel()].fill(v);
            } else {
                for i in self.indices() {
                    d[i] = v;
                }
            }
        });
        Ok(())
    }

    /// Sets every element of this view to zero.
    pub fn zero_(&self) -> Result<()> {
        self.fill_(0.0)
    }

    /// Concatenates tensors of one dtype along `dim`; all other dims must match.
    ///
    /// ```
    /// use hypershard_tensor::Tensor;
    /// let a = Tensor::from_vec(vec![1i32, 2], &[1, 2])?;
    /// let b = Tensor::from_vec(vec![3i32, 4, 5, 6], &[2, 2])?;
    /// let c = Tensor::cat(&[&a, &b], 0)?;
    /// assert_eq!(c.shape(), &[3, 2]);
    /// assert_eq!(c.to_vec::<i32>()?, vec![1, 2, 3, 4, 5, 6]);
    /// # Ok::<(), hypershard_tensor::Error>(())
    /// ```
    pub fn cat(tensors: &[&Tensor], dim: usize) -> Result<Tensor> {
        let Some(first) = tensors.first() else {
            return Err(Error::EmptyInput { op: "cat" });
        };
        first.check_dim("cat", dim)?;
        let mut shape = first.shape.clone();
        shape[dim] = 0;
        for t in tensors {
            if t.dtype != first.dtype {
                return Err(Error::DTypeMismatch {
                    op: "cat",
                    lhs: first.dtype,
                    rhs: t.dtype,
                });
            }
            let same_rest = t.ndim() == first.ndim()
                && t.shape
                    .iter()
                    .zip(&first.shape)
                    .enumerate()
                    .all(|(d, (a, b))| d == dim || a == b);
            if !same_rest {
                return Err(Error::ShapeMismatch {
                    op: "cat",
                    lhs: first.shape.clone(),
                    rhs: t.shape.clone(),
                });
            }
            shape[dim] =
                shape[dim]
                    .checked_add(t.shape[dim])
                    .ok_or_else(|| Error::SizeOverflow {
                        op: "cat",
                        shape: t.shape.clone(),
                    })?;
        }
        let out = Tensor::zeros_on(&shape, first.dtype, &first.device())?;
        let mut start = 0;
        for t in tensors {
            out.narrow(dim, start, t.shape[dim])?.copy_from(t)?;
            start += t.shape[dim];
        }
        Ok(out)
    }

    /// Checks that `self` and `other` have one dtype and returns their broadcast shape.
    pub(crate) fn broadcast_with(&self, op: &'static str, other: &Tensor) -> Result<Vec<usize>> {
        if self.dtype != other.dtype {
            return Err(Error::DTypeMismatch {
                op,
                lhs: self.dtype,
                rhs: other.dtype,
            });
        }
        broadcast_shapes(op, &self.shape, &other.shape)
    }
}

/// `dst.copy_from_slice(src)` (slices of one length), split over the current rayon pool when
/// at least 4 MiB. FSDP's copy-in and copy-out move whole layers' parameters and gradients
/// this way, often into memory touched for the first time: split, both the bytes and the page
/// faults of the fresh destination are spread over the rank's threads instead of one.
#[cfg(feature = "parallel")]
fn copy_elements<T: Copy + Send + Sync>(dst: &mut [T], src: &[T]) {
    use rayon::prelude::*;
    const PARALLEL_COPY_BYTES: usize = 4 << 20;
    const CHUNK_BYTES: usize = 1 << 20;
    // Only off the pool's own threads: a worker waiting on its chunks may run other tasks
    // meanwhile, and one of those could want the storage lock this copy holds.
    let split = std::mem::size_of_val(src) >= PARALLEL_COPY_BYTES
        && rayon::current_thread_index().is_none()
        && rayon::current_num_threads() >= 2;
    if !split {
        dst.copy_from_slice(src);
        return;
    }
    // invariant: the one caller slices both to the view's `n` elements (as `copy_from_slice`
    // needs too); zipped chunks of unequal slices would drop the tail silently.
    assert_eq!(
        dst.len(),
        src.len(),
        "invariant: copy_elements takes slices of one length"
    );
    let chunk = (CHUNK_BYTES / std::mem::size_of::<T>().max(1)).max(1);
    dst.par_chunks_mut(chunk)
        .zip(src.par_chunks(chunk))
        .for_each(|(d, s)| d.copy_from_slice(s));
}

/// Without the `parallel` feature: the plain copy.
#[cfg(not(feature = "parallel"))]
fn copy_elements<T: Copy>(dst: &mut [T], src: &[T]) {
    dst.copy_from_slice(src);
}

#[cfg(test)]
mod tests {
    use half::{bf16, f16};

    use crate::{DType, Error, Result, Tensor};

    #[cfg(feature = "parallel")]
    #[test]
    fn large_copies_split_over_threads_keep_every_element() -> Result<()> {
        // 6 MiB of f32 plus a ragged tail: several 1 MiB chunks and a short last one, copied
        // from the main test thread (the split path) into an offset view, and from inside a
        // pool (the one-thread path).
        let n = (6 << 20) / 4 + 77;
        let src = Tensor::from_vec((0..n).map(|i| i as f32 * 0.5 - 3.0).collect(), &[n])?;
        let whole = Tensor::zeros(&[n + 10], DType::F32)?;
        whole.narrow(0, 5, n)?.copy_from(&src)?;
        let got = whole.to_vec::<f32>()?;
        for (i, &v) in got.iter().enumerate() {
            let want = if (5..n + 5).contains(&i) {
                (i - 5) as f32 * 0.5 - 3.0
            } else {
                0.0
            };
            assert_eq!(v.to_bits(), want.to_bits(), "element {i}");
        }
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(2)
            .build()
            .expect("a 2-thread pool builds");
        let inside = Tensor::zeros(&[n], DType::F32)?;
        pool.install(|| inside.copy_from(&src))?;
        assert_eq!(inside.to_vec::<f32>()?, src.to_vec::<f32>()?);
        Ok(())
    }

    #[test]
    fn casts_between_all_dtypes() -> Result<()> {
        let values = [0.0, 1.0, 2.0, 3.0, 100.0];
        for from in DType::ALL {
            let src = Tensor::from_vec(values.to_vec(), &[5])?.to_dtype(from)?;
            for to in DType::ALL {
                let got = src.to_dtype(to)?.to_f64_vec()?;
                let expected: Vec<f64> = values
                    .iter()
                    .map(|&v| {
                        if from == DType::Bool || to == DType::Bool {
                            f64::from(u8::from(v != 0.0))
                        } else {
                            v
                        }
                    })
                    .collect();
                assert_eq!(got, expected, "{from} -> {to}");
            }
        }
        let h = Tensor::from_vec(vec![f16::from_f32(0.333)], &[1])?;
        assert_eq!(
            h.to_dtype(DType::BF16)?.item::<bf16>()?,
            bf16::from_f64(f16::from_f32(0.333).to_f64())
        );
        // A strided source casts element by element in row-major order.
        let m = Tensor::arange(6, DType::I32)?
            .view(&[2, 3])?
            .transpose(0, 1)?;
        assert_eq!(
            m.to_dtype(DType::F16)?.to_f64_vec()?,
            vec![0., 3., 1., 4., 2., 5.]
        );
        let same = h.to_dtype(DType::F16)?;
        assert!(same.shares_storage(&h));
        Ok(())
    }

    #[test]
    fn copy_from_into_strided_views() -> Result<()> {
        let dst = Tensor::zeros(&[3, 4], DType::F32)?;
        let src = Tensor::from_vec(vec![1.0f64, 2.0, 3.0], &[3])?;
        // Column 2, written through a transposed view, with a cast from f64.
        dst.transpose(0, 1)?
            .narrow(0, 2, 1)?
            .copy_from(&src.unsqueeze(0)?)?;
        assert_eq!(
            dst.to_vec::<f32>()?,
            vec![0., 0., 1., 0., 0., 0., 2., 0., 0., 0., 3., 0.]
        );
        // Broadcast a row into every row of a narrowed block.
        let row = Tensor::from_vec(vec![7.0f32, 8.0], &[2])?;
        dst.narrow(1, 0, 2)?.copy_from(&row)?;
        assert_eq!(
            dst.narrow(1, 0, 2)?.to_vec::<f32>()?,
            vec![7., 8., 7., 8., 7., 8.]
        );
        assert!(matches!(
            dst.copy_from(&Tensor::zeros(&[2, 4], DType::F32)?),
            Err(Error::ShapeMismatch { .. })
        ));
        assert!(matches!(
            row.expand(&[3, 2])?.copy_from(&row),
            Err(Error::OverlappingWrite { .. })
        ));
        Ok(())
    }

    #[test]
    fn casts_of_strided_views_read_in_view_order() -> Result<()> {
        let t = Tensor::from_vec((0..12).map(|i| i as f32 * 0.5 - 2.0).collect(), &[3, 4])?;
        let tt = t.transpose(0, 1)?.narrow(0, 1, 2)?;
        for to in [DType::BF16, DType::I64, DType::F64] {
            let strided = tt.to_dtype(to)?;
            assert!(strided.is_contiguous());
            assert_eq!(strided.shape(), &[2, 3]);
            assert_eq!(
                strided.to_f64_vec()?,
                tt.contiguous()?.to_dtype(to)?.to_f64_vec()?
            );
        }
        assert_eq!(
            tt.to_dtype(DType::F64)?.to_f64_vec()?,
            vec![-1.5, 0.5, 2.5, -1.0, 1.0, 3.0]
        );
        Ok(())
    }

    #[test]
    fn copy_from_an_aliasing_source() -> Result<()> {
        let t = Tensor::arange(6, DType::I64)?;
        // Shift left by one inside one storage: the overlapping source is read before writing.
        t.narrow(0, 0, 5)?.copy_from(&t.narrow(0, 1, 5)?)?;
        assert_eq!(t.to_vec::<i64>()?, vec![1, 2, 3, 4, 5, 5]);
        let m = Tensor::arange(4, DType::F32)?.view(&[2, 2])?;
        m.copy_from(&m.transpose(0, 1)?)?;
        assert_eq!(m.to_vec::<f32>()?, vec![0.0, 2.0, 1.0, 3.0]);
        Ok(())
    }

    #[test]
    fn gather_buffer_views_see_writes() -> Result<()> {
        // The FSDP pattern: one flat buffer, parameters as views into it.
        let flat = Tensor::zeros(&[10], DType::F32)?;
        let w = flat.narrow(0, 0, 6)?.view(&[2, 3])?;
        let b = flat.narrow(0, 6, 4)?;
        flat.copy_from(&Tensor::arange(10, DType::F32)?)?;
        assert_eq!(w.to_vec::<f32>()?, vec![0., 1., 2., 3., 4., 5.]);
        assert_eq!(b.to_vec::<f32>()?, vec![6., 7., 8., 9.]);
        b.fill_(-1.0)?;
        w.narrow(1, 1, 1)?.zero_()?;
        assert_eq!(
            flat.to_vec::<f32>()?,
            vec![0., 0., 2., 3., 0., 5., -1., -1., -1., -1.]
        );
        Ok(())
    }

    #[test]
    fn cat_and_errors() -> Result<()> {
        let a = Tensor::arange(6, DType::BF16)?.view(&[2, 3])?;
        let b = Tensor::arange(2, DType::BF16)?.view(&[2, 1])?;
        let c = Tensor::cat(&[&a, &b, &a.narrow(1, 0, 0)?], 1)?;
        assert_eq!(c.shape(), &[2, 4]);
        assert_eq!(c.to_f64_vec()?, vec![0., 1., 2., 0., 3., 4., 5., 1.]);
        assert!(matches!(Tensor::cat(&[], 0), Err(Error::EmptyInput { .. })));
        assert!(matches!(
            Tensor::cat(&[&a, &b], 0),
            Err(Error::ShapeMismatch { .. })
        ));
        let f = Tensor::zeros(&[2, 1], DType::F32)?;
        assert!(matches!(
            Tensor::cat(&[&a, &f], 1),
            Err(Error::DTypeMismatch { .. })
        ));
        assert!(matches!(
            Tensor::cat(&[&a], 2),
            Err(Error::DimOutOfRange { .. })
        ));
        Ok(())
    }

    #[test]
    fn threads_write_disjoint_views_of_one_buffer() -> Result<()> {
        let flat = Tensor::zeros(&[4, 100], DType::F32)?;
        std::thread::scope(|scope| {
            let handles: Vec<_> = (0..4)
                .map(|rank| {
                    let row = flat.narrow(0, rank, 1);
                    scope.spawn(move || -> Result<()> {
                        let row = row?;
                        let shard = Tensor::full(&[1, 100], rank as f64 + 1.0, DType::F64)?;
                        row.copy_from(&shard)?;
                        row.axpy(1.0, &shard.to_dtype(DType::F32)?)
                    })
                })
                .collect();
            handles
                .into_iter()
                .try_for_each(|h| h.join().unwrap_or(Err(Error::EmptyInput { op: "join" })))
        })?;
        let sums = flat.sum(1, false)?.to_vec::<f32>()?;
        assert_eq!(sums, vec![200.0, 400.0, 600.0, 800.0]);
        Ok(())
    }

    #[test]
    fn opposite_copies_do_not_deadlock() -> Result<()> {
        // Thread 1 copies a -> b while thread 2 copies b -> a: the locks are taken in address
        // order, so the two can never wait on each other.
        let a = Tensor::ones(&[64], DType::F32)?;
        let b = Tensor::zeros(&[64], DType::F32)?;
        std::thread::scope(|scope| {
            let (a1, b1) = (a.clone(), b.clone());
            let t1 = scope.spawn(move || (0..500).try_for_each(|_| b1.copy_from(&a1)));
            let (a2, b2) = (a.clone(), b.clone());
            let t2 = scope.spawn(move || (0..500).try_for_each(|_| a2.copy_from(&b2)));
            let r1 = t1.join().unwrap_or(Err(Error::EmptyInput { op: "join" }));
            let r2 = t2.join().unwrap_or(Err(Error::EmptyInput { op: "join" }));
            r1.and(r2)
        })?;
        // Whatever the interleaving, both end up holding one of the two original values.
        let (va, vb) = (a.to_vec::<f32>()?, b.to_vec::<f32>()?);
        assert!(va.iter().chain(&vb).all(|&x| x == 0.0 || x == 1.0));
        Ok(())
    }

    #[test]
    fn deep_copy_detaches() -> Result<()> {
        let b = Tensor::from_bools(&[true, false], &[2])?;
        let c = b.deep_copy()?;
        assert!(!c.shares_storage(&b));
        b.fill_(0.0)?;
        assert_eq!(c.to_bools()?, vec![true, false]);
        assert_eq!(c.dtype(), DType::Bool);
        Ok(())
    }
}
