//! Elementwise arithmetic with broadcasting, out of place and in place.

use crate::dtype::sealed::Repr;
use crate::dtype::{Arith, with_arith};
use crate::layout::{StridedIndices, expand_strides};
use crate::lock::{read_pair, read_write};
use crate::storage::common_device;
use crate::{Error, Result, Tensor};

/// The four binary arithmetic operations.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum BinaryOp {
    Add,
    Sub,
    Mul,
    Div,
}

/// Strides reading `t` broadcast to `shape`.
fn broadcast_view_strides(op: &'static str, t: &Tensor, shape: &[usize]) -> Result<Vec<usize>> {
    expand_strides(&t.shape, &t.strides, shape).ok_or_else(|| Error::NotBroadcastable {
        op,
        lhs: t.shape.clone(),
        rhs: shape.to_vec(),
    })
}

/// `out[i] = f(a[i], b[i])` over the broadcast shape, into a new contiguous tensor.
fn zip_new<T: Arith>(
    op: &'static str,
    device: crate::Device,
    (a, da): (&Tensor, &[T]),
    (b, db): (&Tensor, &[T]),
    shape: &[usize],
    f: impl Fn(T, T) -> T,
) -> Result<Tensor> {
    if a.shape == shape && b.shape == shape && a.is_contiguous() && b.is_contiguous() {
        // The common case: plain slices that the compiler vectorises.
        let n = a.numel();
        let xs = &da[a.offset..a.offset + n];
        let ys = &db[b.offset..b.offset + n];
        return Tensor::build_on::<T>(op, device, shape, |out| {
            for ((o, &x), &y) in out.iter_mut().zip(xs).zip(ys) {
                *o = f(x, y);
            }
        });
    }
    let a_strides = broadcast_view_strides(op, a, shape)?;
    let b_strides = broadcast_view_strides(op, b, shape)?;
    let ai = StridedIndices::new(shape, &a_strides, a.offset);
    let bi = StridedIndices::new(shape, &b_strides, b.offset);
    Tensor::build_on::<T>(op, device, shape, |out| {
        for ((o, i), j) in out.iter_mut().zip(ai).zip(bi) {
            *o = f(da[i], db[j]);
        }
    })
}

/// Errors if an integer divisor has a zero element.
fn check_divisor<T: Arith>(op: &'static str, b: &Tensor, db: &[T]) -> Result<()> {
    if T::IS_INT && b.indices().any(|i| db[i].is_zero()) {
        return Err(Error::DivisionByZero { op });
    }
    Ok(())
}

fn binary_typed<T: Arith>(
    op_name: &'static str,
    a: &Tensor,
    b: &Tensor,
    shape: &[usize],
    op: BinaryOp,
) -> Result<Tensor> {
    let guards = read_pair(&a.storage, &b.storage);
    let (sa, sb) = guards.get();
    let device = common_device(op_name, sa, sb)?;
    let da = sa.data(op_name)?.typed::<T>();
    let db = sb.data(op_name)?.typed::<T>();
    let (lhs, rhs) = ((a, da), (b, db));
    match op {
        BinaryOp::Add => zip_new(op_name, device, lhs, rhs, shape, T::add),
        BinaryOp::Sub => zip_new(op_name, device, lhs, rhs, shape, T::sub),
        BinaryOp::Mul => zip_new(op_name, device, lhs, rhs, shape, T::mul),
        BinaryOp::Div => {
            check_divisor(op_name, b, db)?;
            zip_new(op_name, device, lhs, rhs, shape, T::div)
        }
    }
}

/// `dst[i] = f(dst[i], src[i])` with `src` broadcast to `dst`'s shape; distinct storages.
fn update_in_place<T: Repr>(
    dst: &Tensor,
    d: &mut [T],
    src: &Tensor,
    src_strides: &[usize],
    s: &[T],
    f: impl Fn(T, T) -> T,
) {
    if dst.is_contiguous() && src.is_contiguous() && src.shape == dst.shape {
        let n = dst.numel();
        for (x, &y) in d[dst.offset..dst.offset + n]
            .iter_mut()
            .zip(&s[src.offset..src.offset + n])
        {
            *x = f(*x, y);
        }
        return;
    }
    let si = StridedIndices::new(&dst.shape, src_strides, src.offset);
    for (i, j) in dst.indices().zip(si) {
        d[i] = f(d[i], s[j]);
    }
}

/// `dst[i] = f(dst[i])` over a view.
fn map_in_place<T: Repr>(dst: &Tensor, d: &mut [T], f: impl Fn(T) -> T) {
    if dst.is_contiguous() {
        let n = dst.numel();
        for x in &mut d[dst.offset..dst.offset + n] {
            *x = f(*x);
        }
    } else {
        for i in dst.indices() {
            d[i] = f(d[i]);
        }
    }
}

impl Tensor {
    fn binary(&self, other: &Tensor, op_name: &'static str, op: BinaryOp) -> Result<Tensor> {
        let shape = self.broadcast_with(op_name, other)?;
        with_arith!(self.dtype, op_name, T => binary_typed::<T>(op_name, self, other, &shape, op))
    }

    /// `self + other` with numpy/torch broadcasting; both must have one dtype (no promotion).
    ///
    /// Floats round once per element (bf16/f16 compute in f32); integers wrap; bool is not
    /// supported.
    ///
    /// ```
    /// use hypershard_tensor::Tensor;
    /// let a = Tensor::from_vec(vec![1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0], &[2, 3])?;
    /// let b = Tensor::from_vec(vec![10.0f32, 20.0], &[2, 1])?;
    /// assert_eq!(a.add(&b)?.to_vec::<f32>()?, vec![11.0, 12.0, 13.0, 24.0, 25.0, 26.0]);
    /// assert!(a.add(&Tensor::zeros(&[3, 3], a.dtype())?).is_err());
    /// # Ok::<(), hypershard_tensor::Error>(())
    /// ```
    pub fn add(&self, other: &Tensor) -> Result<Tensor> {
        self.binary(other, "add", BinaryOp::Add)
    }

    /// `self - other` with broadcasting (see [`add`](Tensor::add)).
    pub fn sub(&self, other: &Tensor) -> Result<Tensor> {
        self.binary(other, "sub", BinaryOp::Sub)
    }

    /// `self * other` with broadcasting (see [`add`](Tensor::add)).
    pub fn mul(&self, other: &Tensor) -> Result<Tensor> {
        self.binary(other, "mul", BinaryOp::Mul)
    }

    /// `self / other` with broadcasting (see [`add`](Tensor::add)). Integer division truncates
    /// toward zero, and an integer zero divisor is [`Error::DivisionByZero`].
    pub fn div(&self, other: &Tensor) -> Result<Tensor> {
        self.binary(other, "div", BinaryOp::Div)
    }

    /// `self * alpha` as a new tensor (integers compute in f64 and truncate).
    pub fn scale(&self, alpha: f64) -> Result<Tensor> {
        let out = self.deep_copy()?;
        out.scale_(alpha)?;
        Ok(out)
    }

    /// `self *= alpha`, in place.
    pub fn scale_(&self, alpha: f64) -> Result<()> {
        self.check_writable("scale_")?;
        let mut guard = self.storage.write();
        #[cfg(feature = "cuda")]
        if guard.is_cuda() {
            drop(guard);
            return crate::cuda::elementwise_("scale_", "scale", self, Some(alpha), None);
        }
        let host = guard.data_mut("scale_")?;
        with_arith!(self.dtype, "scale_", T => {
            map_in_place::<T>(self, host.typed_mut::<T>(), |x| T::scale(x, alpha));
        });
        Ok(())
    }

    fn binary_in_place(&self, other: &Tensor, op_name: &'static str, op: BinaryOp) -> Result<()> {
        let cuda = matches!(op, BinaryOp::Add).then_some(("add", None));
        self.update(
            other,
            op_name,
            cuda,
            |dtype, dst, d_bytes, src, src_strides, s_bytes| {
                with_arith!(dtype, op_name, T => {
                    let d = d_bytes.typed_mut::<T>();
                    let s = s_bytes.typed::<T>();
                    match op {
                        BinaryOp::Add => update_in_place(dst, d, src, src_strides, s, T::add),
                        BinaryOp::Sub => update_in_place(dst, d, src, src_strides, s, T::sub),
                        BinaryOp::Mul => update_in_place(dst, d, src, src_strides, s, T::mul),
                        BinaryOp::Div => {
                            check_divisor(op_name, src, s)?;
                            update_in_place(dst, d, src, src_strides, s, T::div)
                        }
                    }
                });
                Ok(())
            },
        )
    }

    /// Shared plumbing of the in-place binary updates: checks, aliasing, locks. `cuda` names
    /// the op's CUDA kernel (its stem and scalar), where it has one.
    // Without the `cuda` feature the kernel's name is only passed along.
    #[cfg_attr(not(feature = "cuda"), allow(clippy::only_used_in_recursion))]
    fn update(
        &self,
        src: &Tensor,
        op: &'static str,
        cuda: Option<(&'static str, Option<f64>)>,
        kernel: impl FnOnce(
            crate::DType,
            &Tensor,
            &mut crate::HostBuffer,
            &Tensor,
            &[usize],
            &crate::HostBuffer,
        ) -> Result<()>,
    ) -> Result<()> {
        self.check_writable(op)?;
        if self.dtype != src.dtype {
            return Err(Error::DTypeMismatch {
                op,
                lhs: self.dtype,
                rhs: src.dtype,
            });
        }
        let src_strides =
            expand_strides(&src.shape, &src.strides, &self.shape).ok_or_else(|| {
                Error::NotBroadcastable {
                    op,
                    lhs: self.shape.clone(),
                    rhs: src.shape.clone(),
                }
            })?;
        if self.shares_storage(src) {
            let detached = src.deep_copy()?;
            return self.update(&detached, op, cuda, kernel);
        }
        let mut guards = read_write(&src.storage, &self.storage);
        let _device = common_device(op, &guards.dst, &guards.src)?;
        #[cfg(feature = "cuda")]
        if let (true, Some((stem, alpha))) = (_device.is_cuda(), cuda) {
            drop(guards);
            return crate::cuda::elementwise_(op, stem, self, alpha, Some(src));
        }
        let s = guards.src.data(op)?;
        let d = guards.dst.data_mut(op)?;
        kernel(self.dtype, self, d, src, &src_strides, s)
    }

    /// `self += other`, in place; `other` broadcasts to `self`'s shape and has its dtype.
    ///
    /// ```
    /// use hypershard_tensor::Tensor;
    /// let acc = Tensor::from_vec(vec![1.0f32, 2.0], &[2])?;
    /// acc.add_(&Tensor::from_vec(vec![0.5f32, 0.5], &[2])?)?;
    /// assert_eq!(acc.to_vec::<f32>()?, vec![1.5, 2.5]);
    /// # Ok::<(), hypershard_tensor::Error>(())
    /// ```
    pub fn add_(&self, other: &Tensor) -> Result<()> {
        self.binary_in_place(other, "add_", BinaryOp::Add)
    }

    /// `self -= other`, in place (see [`add_`](Tensor::add_)).
    pub fn sub_(&self, other: &Tensor) -> Result<()> {
        self.binary_in_place(other, "sub_", BinaryOp::Sub)
    }

    /// `self *= other`, in place (see [`add_`](Tensor::add_)).
    pub fn mul_(&self, other: &Tensor) -> Result<()> {
        self.binary_in_place(other, "mul_", BinaryOp::Mul)
    }

    /// `self /= other`, in place (see [`add_`](Tensor::add_) and [`div`](Tensor::div)).
    pub fn div_(&self, other: &Tensor) -> Result<()> {
        self.binary_in_place(other, "div_", BinaryOp::Div)
    }

    /// `self += alpha * x`, in place, computed per element in the dtype's compute precision
    /// (f32 for f32/bf16/f16, f64 for f64) with one rounding; `x` broadcasts to `self`.
    ///
    /// ```
    /// use hypershard_tensor::Tensor;
    /// let y = Tensor::from_vec(vec![1.0f64, 1.0], &[2])?;
    /// y.axpy(-0.5, &Tensor::from_vec(vec![2.0f64, 4.0], &[2])?)?;
    /// assert_eq!(y.to_vec::<f64>()?, vec![0.0, -1.0]);
    /// # Ok::<(), hypershard_tensor::Error>(())
    /// ```
    pub fn axpy(&self, alpha: f64, x: &Tensor) -> Result<()> {
        self.update(x, "axpy", Some(("axpy", Some(alpha))), |dtype, dst, d_bytes, src, src_strides, s_bytes| {
            with_arith!(dtype, "axpy", T => {
                update_in_place(dst, d_bytes.typed_mut::<T>(), src, src_strides, s_bytes.typed::<T>(), |a, b| T::axpy(a, alpha, b));
            });
            Ok(())
        })
    }
}

#[cfg(test)]
mod tests {
    use half::{bf16, f16};

    use crate::{DType, Error, Result, Tensor};

    #[test]
    fn arithmetic_per_dtype() -> Result<()> {
        for dtype in [
            DType::F32,
            DType::F64,
            DType::BF16,
            DType::F16,
            DType::I32,
            DType::I64,
            DType::U8,
        ] {
            let a = Tensor::from_vec(vec![6.0, 8.0, 9.0], &[3])?.to_dtype(dtype)?;
            let b = Tensor::from_vec(vec![2.0, 4.0, 3.0], &[3])?.to_dtype(dtype)?;
            assert_eq!(a.add(&b)?.to_f64_vec()?, vec![8.0, 12.0, 12.0], "{dtype}");
            assert_eq!(a.sub(&b)?.to_f64_vec()?, vec![4.0, 4.0, 6.0], "{dtype}");
            assert_eq!(a.mul(&b)?.to_f64_vec()?, vec![12.0, 32.0, 27.0], "{dtype}");
            assert_eq!(a.div(&b)?.to_f64_vec()?, vec![3.0, 2.0, 3.0], "{dtype}");
            // Integers scale in f64 and truncate toward zero: 9 * 0.5 = 4.
            let half_of_nine = if dtype.is_float() { 4.5 } else { 4.0 };
            assert_eq!(
                a.scale(0.5)?.to_f64_vec()?,
                vec![3.0, 4.0, half_of_nine],
                "{dtype}"
            );
            assert_eq!(a.add(&b)?.dtype(), dtype);
        }
        Ok(())
    }

    #[test]
    fn broadcasting_and_strided_inputs() -> Result<()> {
        let a = Tensor::arange(6, DType::F32)?.view(&[2, 3])?;
        let row = Tensor::from_vec(vec![10.0f32, 20.0, 30.0], &[3])?;
        assert_eq!(
            a.add(&row)?.to_vec::<f32>()?,
            vec![10., 21., 32., 13., 24., 35.]
        );
        let col = Tensor::from_vec(vec![1.0f32, 2.0], &[2, 1])?;
        assert_eq!(col.mul(&row)?.shape(), &[2, 3]);
        assert_eq!(
            col.mul(&row)?.to_vec::<f32>()?,
            vec![10., 20., 30., 20., 40., 60.]
        );
        let at = a.transpose(0, 1)?;
        assert_eq!(at.sub(&at)?.to_vec::<f32>()?, vec![0.0; 6]);
        assert_eq!(
            at.add(&Tensor::scalar(1.0f32))?.to_vec::<f32>()?,
            vec![1., 4., 2., 5., 3., 6.]
        );
        assert!(matches!(
            a.add(&Tensor::zeros(&[2], DType::F32)?),
            Err(Error::NotBroadcastable { .. })
        ));
        assert!(matches!(
            a.add(&Tensor::zeros(&[3], DType::F64)?),
            Err(Error::DTypeMismatch { .. })
        ));
        let b = Tensor::from_bools(&[true], &[1])?;
        assert!(matches!(b.add(&b), Err(Error::UnsupportedDType { .. })));
        Ok(())
    }

    #[test]
    fn integer_division_by_zero_is_an_error() -> Result<()> {
        let a = Tensor::from_vec(vec![1i32, 2], &[2])?;
        let z = Tensor::from_vec(vec![1i32, 0], &[2])?;
        assert!(matches!(a.div(&z), Err(Error::DivisionByZero { .. })));
        assert!(matches!(a.div_(&z), Err(Error::DivisionByZero { .. })));
        assert_eq!(a.to_vec::<i32>()?, vec![1, 2]);
        let f = Tensor::from_vec(vec![1.0f32], &[1])?;
        assert_eq!(
            f.div(&Tensor::zeros(&[1], DType::F32)?)?.item::<f32>()?,
            f32::INFINITY
        );
        Ok(())
    }

    #[test]
    fn half_precision_rounds_once() -> Result<()> {
        let a = Tensor::from_vec(vec![bf16::from_f32(1.0)], &[1])?;
        let b = Tensor::from_vec(vec![bf16::from_f32(1.0 / 512.0)], &[1])?;
        // 1 + 2^-9 is not representable in bf16 and rounds to even (1.0).
        assert_eq!(a.add(&b)?.item::<bf16>()?, bf16::from_f32(1.0));
        let h = Tensor::from_vec(vec![f16::from_f32(1.0)], &[1])?;
        assert_eq!(h.add(&h)?.item::<f16>()?, f16::from_f32(2.0));
        Ok(())
    }

    #[test]
    fn in_place_updates() -> Result<()> {
        let m = Tensor::zeros(&[2, 3], DType::F32)?;
        m.add_(&Tensor::from_vec(vec![1.0f32, 2.0, 3.0], &[3])?)?;
        m.transpose(0, 1)?
            .narrow(0, 0, 1)?
            .mul_(&Tensor::scalar(10.0f32))?;
        assert_eq!(m.to_vec::<f32>()?, vec![10., 2., 3., 10., 2., 3.]);
        m.sub_(&Tensor::ones(&[2, 1], DType::F32)?)?;
        m.div_(&Tensor::full(&[1], 2.0, DType::F32)?)?;
        assert_eq!(m.to_vec::<f32>()?, vec![4.5, 0.5, 1.0, 4.5, 0.5, 1.0]);
        m.scale_(2.0)?;
        m.axpy(2.0, &Tensor::ones(&[3], DType::F32)?)?;
        assert_eq!(m.to_vec::<f32>()?, vec![11., 3., 4., 11., 3., 4.]);
        // Aliasing source: m += m.
        m.add_(&m)?;
        assert_eq!(m.narrow(0, 0, 1)?.to_vec::<f32>()?, vec![22., 6., 8.]);
        assert!(matches!(
            m.add_(&Tensor::zeros(&[3, 3], DType::F32)?),
            Err(Error::NotBroadcastable { .. })
        ));
        assert!(matches!(
            m.axpy(1.0, &Tensor::zeros(&[3], DType::BF16)?),
            Err(Error::DTypeMismatch { .. })
        ));
        let e = Tensor::zeros(&[3], DType::F32)?.expand(&[2, 3])?;
        assert!(matches!(e.add_(&e), Err(Error::OverlappingWrite { .. })));
        // bf16 axpy accumulates in f32 and rounds once.
        let y = Tensor::from_vec(vec![bf16::from_f32(1.0)], &[1])?;
        y.axpy(0.5, &Tensor::from_vec(vec![bf16::from_f32(3.0)], &[1])?)?;
        assert_eq!(y.item::<bf16>()?, bf16::from_f32(2.5));
        Ok(())
    }
}
