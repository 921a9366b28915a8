//! The compute layer under the modules: a float trait over f32 and f64, conversion of
//! tensors into compute buffers and back, and fused loops written so the compiler vectorises
//! them.
//!
//! Every layer computes in one of two types: f64 when its tensors are f64 (the finite
//! difference tests need that precision) and f32 for f32, bf16 and f16 tensors. Half-precision
//! tensors are widened to f32 when loaded and rounded back once when the result is stored, so
//! a bf16 layer accumulates in f32 as torch's CPU kernels do.

#[cfg(feature = "cuda")]
pub(crate) mod cuda;
pub(crate) mod math;
pub(crate) mod packed_gemm;
pub(crate) mod recycle;
pub(crate) mod small_gemm;
pub(crate) mod vector_isa;

use std::iter::Sum;
use std::ops::{Add, AddAssign, Div, Mul, MulAssign, Neg, Sub, SubAssign};

use hypershard_tensor::{DType, Device, Element, Tensor};

use crate::{Error, Result};

/// The arithmetic a kernel needs, implemented for `f32` and `f64`.
pub(crate) trait Float:
    Element
    + Copy
    + Send
    + Sync
    + PartialOrd
    + Add<Output = Self>
    + Sub<Output = Self>
    + Mul<Output = Self>
    + Div<Output = Self>
    + Neg<Output = Self>
    + AddAssign
    + SubAssign
    + MulAssign
    + Sum
    + 'static
{
    /// The tensor dtype of this type.
    const COMPUTE_DTYPE: DType;
    /// Zero.
    const ZERO: Self;
    /// One.
    const ONE: Self;
    /// Converts from f64, rounding to nearest.
    fn of(value: f64) -> Self;
    /// Widens (or keeps) to f64.
    fn as_f64(self) -> f64;
    /// `eˣ`: exact to the last bit for f64 (the standard library), a vectorisable polynomial
    /// within 2 ulp for f32 (see [`math::exp_f32`]).
    fn exp(self) -> Self;
    /// The error function: [`crate::special::erf`] for f64, [`math::erf_f32`] for f32.
    fn erf(self) -> Self;
    /// `(1 + erf x, e^(−x²))`, GELU's two functions of `x/√2`; f32 computes the exponential
    /// once for both and the sum without cancelling ([`math::one_plus_erf_and_gauss_f32`]).
    #[inline]
    fn one_plus_erf_and_gauss(self) -> (Self, Self) {
        (Self::ONE + self.erf(), (-(self * self)).exp())
    }
    /// The hyperbolic tangent.
    fn tanh(self) -> Self;
    /// The square root.
    fn sqrt(self) -> Self;
    /// The natural logarithm (the standard library's, for both types: attention takes one
    /// per row, too few to be worth a vectorised version).
    fn ln(self) -> Self;
    /// The larger of two values (NaN-ignoring, as `f32::max`).
    fn max(self, other: Self) -> Self;

    /// `C[m, n] = A[m, k] · B[n, k]ᵀ` (row-major, `C` overwritten) by a packing-free kernel
    /// for few rows, if this type has one and it takes the shape; returns whether it ran (see
    /// [`small_gemm`]). The caller falls back to the general GEMM otherwise.
    fn small_gemm_nt(
        _a: &[Self],
        _b: &[Self],
        _m: usize,
        _k: usize,
        _n: usize,
        _c: &mut [Self],
    ) -> bool {
        false
    }

    /// `C[m, n] = A[m, k] · B[k, n]` by the same kernels (see [`Float::small_gemm_nt`]).
    fn small_gemm_nn(
        _a: &[Self],
        _b: &[Self],
        _m: usize,
        _k: usize,
        _n: usize,
        _c: &mut [Self],
    ) -> bool {
        false
    }

    /// `C[m, n] = A[k, m]ᵀ · B[k, n]` by the same kernels, for any `m` (see
    /// [`small_gemm::gemm_tn`]).
    fn small_gemm_tn(
        _a: &[Self],
        _b: &[Self],
        _m: usize,
        _k: usize,
        _n: usize,
        _c: &mut [Self],
    ) -> bool {
        false
    }

    /// The product `g` describes, `C = A · B + beta · C` then the bias added to every row
    /// (f32: [`packed_gemm`] on AVX-512 or AVX2, else matrixmultiply's `sgemm`; f64:
    /// matrixmultiply's `dgemm`). With `beta = 0` `C` is only written (its old contents may be
    /// anything).
    ///
    /// # Safety
    /// For `i < m`, `p < k`, `j < n`: `a + i*a_strides[0] + p*a_strides[1]` and
    /// `b + p*b_strides[0] + j*b_strides[1]` must be readable elements,
    /// `c + i*c_row_stride + j` writable (and, when `beta ≠ 0`, initialised) ones, `bias + j`
    /// readable when a bias is given, and the `C` range must not overlap `A`, `B` or the bias.
    unsafe fn gemm_raw(g: RawGemm<Self>);
}

/// One product for [`Float::gemm_raw`]: `C = A · B + beta · C` for `A` `[m, k]`, `B` `[k, n]`
/// (element strides `[row, col]`) and `C` `[m, n]` (row stride `c_row_stride`, column stride
/// 1), then `bias[j]` added to column `j` of every row when a bias is given (rounded after
/// the product, as a separate pass over `C` rounds it).
#[derive(Clone, Copy)]
pub(crate) struct RawGemm<F> {
    pub(crate) m: usize,
    pub(crate) k: usize,
    pub(crate) n: usize,
    pub(crate) a: *const F,
    pub(crate) a_strides: [isize; 2],
    pub(crate) b: *const F,
    pub(crate) b_strides: [isize; 2],
    pub(crate) beta: F,
    pub(crate) c: *mut F,
    pub(crate) c_row_stride: isize,
    /// `n` values: a `Linear`'s bias, or the columns of it this product computes.
    pub(crate) bias: Option<*const F>,
}

/// matrixmultiply's `sgemm` or `dgemm`: `(m, k, n, alpha, a, a_row, a_col, b, b_row, b_col,
/// beta, c, c_row, c_col)`.
type MatrixmultiplyGemm<F> = unsafe fn(
    usize,
    usize,
    usize,
    F,
    *const F,
    isize,
    isize,
    *const F,
    isize,
    isize,
    F,
    *mut F,
    isize,
    isize,
);

impl<F: Float> RawGemm<F> {
    /// The product on matrixmultiply's `gemm` (`sgemm` or `dgemm`), then the bias by a pass
    /// of its own.
    ///
    /// # Safety
    /// [`Float::gemm_raw`]'s contract.
    unsafe fn run_matrixmultiply(self, gemm: MatrixmultiplyGemm<F>) {
        let g = self;
        // SAFETY: the caller guarantees every addressed element of `a`, `b`, `c` and the bias
        // is valid (`c`'s initialised when `beta ≠ 0`) and that `c` overlaps none of them;
        // matrixmultiply then leaves every element of `C` initialised, as the pass needs.
        unsafe {
            gemm(
                g.m,
                g.k,
                g.n,
                F::ONE,
                g.a,
                g.a_strides[0],
                g.a_strides[1],
                g.b,
                g.b_strides[0],
                g.b_strides[1],
                g.beta,
                g.c,
                g.c_row_stride,
                1,
            );
            g.add_bias_pass();
        }
    }

    /// Adds the bias, if any, to every row of `C`: the pass for the GEMMs that take no bias
    /// themselves (matrixmultiply's).
    ///
    /// # Safety
    /// [`Float::gemm_raw`]'s contract, with `C` initialised.
    unsafe fn add_bias_pass(self) {
        let Some(bias) = self.bias else { return };
        // SAFETY: `n` readable values (the contract), apart from `C`. The pass runs for f64
        // (and f32 without the packed GEMM), tested in f64 by
        // `a_fused_bias_is_bitwise_the_product_then_a_pass`.
        let bias = unsafe { std::slice::from_raw_parts(bias, self.n) };
        for i in 0..self.m {
            // SAFETY: row `i < m` of `C`: `n` initialised, writable elements.
            let row = unsafe {
                std::slice::from_raw_parts_mut(
                    self.c.offset(i as isize * self.c_row_stride),
                    self.n,
                )
            };
            add_assign(row, bias);
        }
    }
}

impl Float for f32 {
    const COMPUTE_DTYPE: DType = DType::F32;
    const ZERO: Self = 0.0;
    const ONE: Self = 1.0;
    #[inline]
    fn of(value: f64) -> Self {
        value as f32
    }
    #[inline]
    fn as_f64(self) -> f64 {
        f64::from(self)
    }
    #[inline]
    fn exp(self) -> Self {
        math::exp_f32(self)
    }
    #[inline]
    fn erf(self) -> Self {
        math::erf_f32(self)
    }
    #[inline]
    fn one_plus_erf_and_gauss(self) -> (Self, Self) {
        math::one_plus_erf_and_gauss_f32(self)
    }
    #[inline]
    fn tanh(self) -> Self {
        math::tanh_f32(self)
    }
    #[inline]
    fn sqrt(self) -> Self {
        f32::sqrt(self)
    }
    #[inline]
    fn ln(self) -> Self {
        f32::ln(self)
    }
    #[inline]
    fn max(self, other: Self) -> Self {
        f32::max(self, other)
    }
    fn small_gemm_nt(a: &[Self], b: &[Self], m: usize, k: usize, n: usize, c: &mut [Self]) -> bool {
        small_gemm::gemm_nt(a, b, m, k, n, c)
    }
    fn small_gemm_nn(a: &[Self], b: &[Self], m: usize, k: usize, n: usize, c: &mut [Self]) -> bool {
        small_gemm::gemm_nn(a, b, m, k, n, c)
    }
    fn small_gemm_tn(a: &[Self], b: &[Self], m: usize, k: usize, n: usize, c: &mut [Self]) -> bool {
        small_gemm::gemm_tn(a, b, m, k, n, c)
    }
    unsafe fn gemm_raw(g: RawGemm<Self>) {
        let strided = |start, [row, col]: [isize; 2]| packed_gemm::Strided { start, row, col };
        // SAFETY: the caller guarantees every addressed element of `a`, `b`, `c` and the bias
        // is valid (`c`'s initialised when `beta ≠ 0`) and that `c` overlaps none of them,
        // which is `packed_gemm::gemm`'s contract too.
        let packed = unsafe {
            packed_gemm::gemm(packed_gemm::Product {
                m: g.m,
                k: g.k,
                n: g.n,
                a: strided(g.a, g.a_strides),
                b: strided(g.b, g.b_strides),
                beta: g.beta,
                c: g.c,
                c_row_stride: g.c_row_stride,
                bias: g.bias,
            })
        };
        if packed {
            return;
        }
        // SAFETY: as above.
        unsafe { g.run_matrixmultiply(matrixmultiply::sgemm) };
    }
}

impl Float for f64 {
    const COMPUTE_DTYPE: DType = DType::F64;
    const ZERO: Self = 0.0;
    const ONE: Self = 1.0;
    #[inline]
    fn of(value: f64) -> Self {
        value
    }
    #[inline]
    fn as_f64(self) -> f64 {
        self
    }
    #[inline]
    fn exp(self) -> Self {
        f64::exp(self)
    }
    #[inline]
    fn erf(self) -> Self {
        crate::special::erf(self)
    }
    #[inline]
    fn tanh(self) -> Self {
        f64::tanh(self)
    }
    #[inline]
    fn sqrt(self) -> Self {
        f64::sqrt(self)
    }
    #[inline]
    fn ln(self) -> Self {
        f64::ln(self)
    }
    #[inline]
    fn max(self, other: Self) -> Self {
        f64::max(self, other)
    }
    unsafe fn gemm_raw(g: RawGemm<Self>) {
        // SAFETY: the caller's contract is `run_matrixmultiply`'s.
        unsafe { g.run_matrixmultiply(matrixmultiply::dgemm) };
    }
}

/// The compute type of a tensor dtype: f64 for f64, f32 for f32/bf16/f16.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Compute {
    /// Compute in f32.
    F32,
    /// Compute in f64.
    F64,
}

/// The compute type for `dtype`, or [`Error::UnsupportedDType`] for non-float dtypes.
pub(crate) fn compute_type(op: &'static str, dtype: DType) -> Result<Compute> {
    match dtype {
        DType::F64 => Ok(Compute::F64),
        DType::F32 | DType::BF16 | DType::F16 => Ok(Compute::F32),
        dtype => Err(Error::UnsupportedDType { op, dtype }),
    }
}

/// Runs `$body` with `$F` bound to the compute type of `$dtype` (a local type alias).
macro_rules! with_float {
    ($op:expr, $dtype:expr, $F:ident => $body:expr) => {
        match $crate::kernels::compute_type($op, $dtype)? {
            $crate::kernels::Compute::F64 => {
                type $F = f64;
                $body
            }
            $crate::kernels::Compute::F32 => {
                type $F = f32;
                $body
            }
        }
    };
}
pub(crate) use with_float;

/// The one device `tensors` are on: a layer checks its inputs and parameters with this once
/// per call, so that a host input fed to a layer whose parameters are on a device is
/// [`DeviceMismatch`](hypershard_tensor::Error::DeviceMismatch) naming the layer and both
/// devices, not a kernel reading two memories.
pub(crate) fn same_device(op: &'static str, tensors: &[&Tensor]) -> Result<Device> {
    let Some((first, rest)) = tensors.split_first() else {
        return Ok(Device::Cpu);
    };
    let device = first.device();
    for t in rest {
        let other = t.device();
        if other != device {
            return Err(hypershard_tensor::Error::DeviceMismatch {
                op,
                lhs: device,
                rhs: other,
            }
            .into());
        }
    }
    Ok(device)
}

/// [`DeviceUnsupported`](hypershard_tensor::Error::DeviceUnsupported) naming `op` when
/// `device` is a CUDA GPU: the check of the ops that have no CUDA kernel, so the error names
/// the layer rather than the helper that would have read the memory.
pub(crate) fn host_only(op: &'static str, device: &Device) -> Result<()> {
    if device.is_cuda() {
        return Err(hypershard_tensor::Error::DeviceUnsupported {
            op,
            device: *device,
        }
        .into());
    }
    Ok(())
}

/// Rows per piece of [`small_nn_rows`] (the packing-free kernel takes fewer than 64 rows).
pub(crate) const SMALL_NN_ROWS: usize = 32;

/// `c[m, n] = a[m, k] · b[k, n]` by the packing-free kernel in pieces of [`SMALL_NN_ROWS`] rows,
/// on the calling thread or, with `parallel`, spread over the kernel threads. Returns whether
/// it ran (f32 on a CPU with the kernels), else `c` is untouched. Every row is computed as one
/// call of the kernel computes it.
pub(crate) fn small_nn_rows<F: Float>(
    a: &[F],
    b: &[F],
    (m, k, n): (usize, usize, usize),
    c: &mut [F],
    parallel: bool,
) -> bool {
    use rayon::prelude::*;
    let fits = m > 0 && k > 0 && n > 0 && a.len() == m * k && c.len() == m * n;
    // Every piece takes the same path (the dtype and the CPU decide): the first one asks.
    let first = SMALL_NN_ROWS.min(m);
    if !fits || !F::small_gemm_nn(&a[..first * k], b, first, k, n, &mut c[..first * n]) {
        return false;
    }
    let pieces = |(a_rows, c_rows): (&[F], &mut [F])| {
        // The first piece ran, so every piece (the same kernel, no more rows) does.
        F::small_gemm_nn(a_rows, b, a_rows.len() / k, k, n, c_rows);
    };
    let (a_rest, c_rest) = (&a[first * k..], &mut c[first * n..]);
    if parallel {
        a_rest
            .par_chunks(SMALL_NN_ROWS * k)
            .zip(c_rest.par_chunks_mut(SMALL_NN_ROWS * n))
            .for_each(pieces);
    } else {
        a_rest
            .chunks(SMALL_NN_ROWS * k)
            .zip(c_rest.chunks_mut(SMALL_NN_ROWS * n))
            .for_each(pieces);
    }
    true
}

/// The elements of `t` (any float dtype, any layout) in the compute type `F`, row-major: a
/// kernel's scratch copy, read where `t` lives (see [`Tensor::with_kernel_data`]).
pub(crate) fn load<F: Float>(t: &Tensor) -> Result<Vec<F>> {
    let converted;
    let t = if t.dtype() == F::COMPUTE_DTYPE {
        t
    } else {
        converted = t.to_dtype(F::COMPUTE_DTYPE)?;
        &converted
    };
    read_all::<F>("load", t)
}

/// The elements of `t` (any float dtype, any layout) as f64, row-major: on the host the
/// tensor crate's one-pass widening read, elsewhere a kernel's read where `t` lives.
pub(crate) fn load_f64(t: &Tensor) -> Result<Vec<f64>> {
    if t.device().is_cpu() {
        Ok(t.to_f64_vec()?)
    } else {
        load::<f64>(t)
    }
}

/// The elements of `t` (any layout) in row-major order, read where `t` lives (see
/// [`Tensor::with_kernel_data`]); `op` names the kernel in errors.
pub(crate) fn read_all<T: Element>(op: &'static str, t: &Tensor) -> Result<Vec<T>> {
    if t.is_contiguous() {
        Ok(t.with_kernel_data::<T, _>(op, <[T]>::to_vec)?)
    } else if t.device().is_cpu() {
        // The host gathers a strided view in one pass.
        Ok(t.to_vec::<T>()?)
    } else {
        Ok(t.contiguous()?
            .with_kernel_data::<T, _>(op, <[T]>::to_vec)?)
    }
}

/// Runs `f` on the elements of `t` in the compute type `F`: borrowed in place (no copy, no
/// allocation) when `t` is contiguous and already of `F`'s dtype, converted into a temporary
/// buffer otherwise. The storage's read lock is held while `f` runs, so `f` must not write to
/// `t`'s storage. The elements are read where `t` lives ([`Tensor::with_kernel_data`]).
pub(crate) fn with_values<F: Float, R>(t: &Tensor, f: impl FnOnce(&[F]) -> R) -> Result<R> {
    if t.dtype() == F::COMPUTE_DTYPE && t.is_contiguous() {
        Ok(t.with_kernel_data::<F, R>("with_values", f)?)
    } else {
        let values = load::<F>(t)?;
        Ok(f(&values))
    }
}

/// [`with_values`] for two tensors at once. When both share one storage the second is copied
/// instead of borrowed, so the lock is never taken twice by one thread (a queued writer
/// between two reads of one lock could otherwise deadlock).
pub(crate) fn with_values2<F: Float, R>(
    a: &Tensor,
    b: &Tensor,
    f: impl FnOnce(&[F], &[F]) -> R,
) -> Result<R> {
    if a.shares_storage(b) {
        let b_values = load::<F>(b)?;
        with_values(a, |a_values| f(a_values, &b_values))
    } else {
        with_values(a, |a_values| {
            with_values(b, |b_values| f(a_values, b_values))
        })?
    }
}

/// A tensor of `dtype` and `shape` on `device` from compute values, rounding once when
/// `dtype` is narrower than `F`.
pub(crate) fn store<F: Float>(
    values: Vec<F>,
    shape: &[usize],
    dtype: DType,
    device: &Device,
) -> Result<Tensor> {
    let t = Tensor::from_vec_on(values, shape, device)?;
    if dtype == F::COMPUTE_DTYPE {
        Ok(t)
    } else {
        Ok(t.to_dtype(dtype)?)
    }
}

/// A new tensor of `dtype` and `shape` on `device` whose every element `fill` writes in the
/// compute type `F`, where the tensor lives ([`Tensor::with_kernel_data_mut`]). On the host,
/// large outputs are written into recycled storage (see [`recycle`]) instead of a fresh zeroed
/// allocation; the values are rounded once to `dtype` afterwards when it is narrower than `F`.
pub(crate) fn build_overwrite<F: Float>(
    shape: &[usize],
    dtype: DType,
    device: &Device,
    fill: impl FnOnce(&mut [F]) -> Result<()>,
) -> Result<Tensor> {
    let t = overwrite_target::<F>(shape, device)?;
    t.with_kernel_data_mut::<F, _>("build_overwrite", fill)??;
    in_dtype(t, dtype)
}

/// A new compute-dtype (`F`) tensor of `shape` on `device` for a kernel that writes every
/// element of it: recycled storage on the host (see [`recycle`]), zeroed memory elsewhere.
/// For kernels with several outputs, which [`build_overwrite`] cannot give; finish with
/// [`in_dtype`].
pub(crate) fn overwrite_target<F: Float>(shape: &[usize], device: &Device) -> Result<Tensor> {
    if device.is_cpu() {
        recycle::tensor(shape, F::COMPUTE_DTYPE)
    } else {
        Ok(Tensor::zeros_on(shape, F::COMPUTE_DTYPE, device)?)
    }
}

/// `t` in `dtype`: itself when it already is, else rounded once.
pub(crate) fn in_dtype(t: Tensor, dtype: DType) -> Result<Tensor> {
    if t.dtype() == dtype {
        Ok(t)
    } else {
        Ok(t.to_dtype(dtype)?)
    }
}

/// Elements per task of a pointwise kernel over a large tensor: enough work that a task's
/// scheduling is noise, small enough that a layer's activations split over a rank's threads.
pub(crate) const POINTWISE_CHUNK: usize = 1 << 14;

/// Runs `f(start, chunk)` over consecutive chunks of `out` on the current rayon pool (inline
/// when `out` is one chunk). Every element is computed alone, so the values do not depend on
/// the number of threads.
pub(crate) fn in_parallel_chunks<F: Float>(out: &mut [F], f: impl Fn(usize, &mut [F]) + Sync) {
    if out.len() <= POINTWISE_CHUNK {
        f(0, out);
    } else {
        use rayon::prelude::*;
        out.par_chunks_mut(POINTWISE_CHUNK)
            .enumerate()
            .for_each(|(i, chunk)| f(i * POINTWISE_CHUNK, chunk));
    }
}

/// How many partial sums a row reduction keeps. A plain `iter().sum()` is one chain of
/// dependent adds, which the compiler may not reorder for floats: it runs at one add per add
/// latency and never uses the vector units. Independent partial sums, one per lane, compile to
/// vector adds; 16 fill one AVX-512 register of f32.
pub(crate) const REDUCTION_LANES: usize = 16;

/// The partial sums of a lane reduction added into one: pairwise, in a fixed order, so the
/// total does not depend on the vector width the loop was compiled for.
#[inline(always)]
pub(crate) fn lane_total<F: Float>(mut lanes: [F; REDUCTION_LANES]) -> F {
    let mut width = REDUCTION_LANES;
    while width > 1 {
        width /= 2;
        for k in 0..width {
            lanes[k] += lanes[k + width];
        }
    }
    lanes[0]
}

/// `Σ f(x)` over `xs` in [`REDUCTION_LANES`] partial sums (`lane k` sums the elements at
/// `k mod LANES` of the whole chunks), then the tail in order.
#[inline(always)]
pub(crate) fn lane_sum<F: Float>(xs: &[F], f: impl Fn(F) -> F) -> F {
    let mut lanes = [F::ZERO; REDUCTION_LANES];
    let chunks = xs.chunks_exact(REDUCTION_LANES);
    let tail = chunks.remainder();
    for chunk in chunks {
        for (lane, &x) in lanes.iter_mut().zip(chunk) {
            *lane += f(x);
        }
    }
    let mut total = lane_total(lanes);
    for &x in tail {
        total += f(x);
    }
    total
}

/// `dst[i] += src[i]`, a loop the compiler vectorises.
pub(crate) fn add_assign<F: Float>(dst: &mut [F], src: &[F]) {
    for (d, s) in dst.iter_mut().zip(src) {
        *d += *s;
    }
}

/// Adds `row` to every row of the row-major matrix `matrix` (a bias add).
pub(crate) fn add_row<F: Float>(matrix: &mut [F], row: &[F]) {
    if row.is_empty() {
        return;
    }
    let add_rows = |block: &mut [F]| {
        for chunk in block.chunks_exact_mut(row.len()) {
            add_assign(chunk, row);
        }
    };
    // A layer's bias add is a pass over its whole output: on every thread, whole rows each.
    if matrix.len() <= POINTWISE_CHUNK {
        add_rows(matrix);
    } else {
        use rayon::prelude::*;
        let rows_per_task = (POINTWISE_CHUNK / row.len()).max(1);
        matrix
            .par_chunks_mut(rows_per_task * row.len())
            .for_each(add_rows);
    }
}

/// The sum of the rows of a row-major `[rows, width]` matrix (a bias gradient).
pub(crate) fn sum_rows<F: Float>(matrix: &[F], width: usize) -> Vec<F> {
    let mut out = vec![F::ZERO; width];
    if width == 0 {
        return out;
    }
    // Columns are independent: spread blocks of columns over the threads, each summing its
    // columns down the rows in row order, so the values do not depend on the thread count.
    let column_block = (POINTWISE_CHUNK / (matrix.len() / width).max(1)).max(64);
    let sum_columns = |first: usize, out: &mut [F]| {
        for row in matrix.chunks_exact(width) {
            add_assign(out, &row[first..first + out.len()]);
        }
    };
    if matrix.len() <= POINTWISE_CHUNK || width <= column_block {
        sum_columns(0, &mut out);
    } else {
        use rayon::prelude::*;
        out.par_chunks_mut(column_block)
            .enumerate()
            .for_each(|(i, out)| sum_columns(i * column_block, out));
    }
    out
}

/// `a + b` for two tensors of one shape and dtype, computed in the compute type (the residual
/// connections of a transformer block).
pub(crate) fn add_tensors(op: &'static str, a: &Tensor, b: &Tensor) -> Result<Tensor> {
    if a.shape() != b.shape() {
        return Err(Error::ShapeMismatch {
            op,
            lhs: a.shape().to_vec(),
            rhs: b.shape().to_vec(),
        });
    }
    if a.dtype() != b.dtype() {
        return Err(Error::DTypeMismatch {
            op,
            lhs: a.dtype(),
            rhs: b.dtype(),
        });
    }
    let device = same_device(op, &[a, b])?;
    #[cfg(feature = "cuda")]
    if device.is_cuda() {
        return cuda::add(a, b);
    }
    with_float!(op, a.dtype(), F => build_overwrite::<F>(a.shape(), a.dtype(), &device, |out| {
        with_values2::<F, _>(a, b, |xs, ys| {
            in_parallel_chunks(out, |start, out| {
                let end = start + out.len();
                for ((o, &x), &y) in out.iter_mut().zip(&xs[start..end]).zip(&ys[start..end]) {
                    *o = x + y;
                }
            })
        })
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bf16_tensor(values: Vec<f32>) -> Tensor {
        let n = values.len();
        // invariant: a 1-D f32 tensor converts to bf16.
        Tensor::from_vec(values, &[n])
            .and_then(|t| t.to_dtype(DType::BF16))
            .expect("tensor")
    }

    #[test]
    fn half_tensors_compute_in_f32_and_round_back() {
        let a = bf16_tensor(vec![1.5, -2.0]);
        let b = bf16_tensor(vec![0.25, 4.0]);
        let sum = add_tensors("test", &a, &b).expect("add");
        assert_eq!(sum.dtype(), DType::BF16);
        assert_eq!(sum.to_f64_vec().expect("f64"), vec![1.75, 2.0]);
        assert_eq!(load::<f32>(&a).expect("load"), vec![1.5, -2.0]);
        assert!(matches!(
            compute_type("test", DType::I64),
            Err(Error::UnsupportedDType { .. })
        ));
    }

    #[test]
    fn borrowed_and_converted_values_agree() {
        let base = Tensor::from_vec(vec![1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0], &[2, 3]).expect("t");
        let strided = base.transpose(0, 1).expect("view");
        let sum = |xs: &[f32]| xs.iter().sum::<f32>();
        assert_eq!(with_values::<f32, _>(&base, sum).expect("borrow"), 21.0);
        let firsts = with_values::<f32, _>(&strided, |xs| xs[..2].to_vec()).expect("copy");
        assert_eq!(firsts, vec![1.0, 4.0]);
        // Two views of one storage: the second is copied, so the read lock is taken once.
        let row = base.narrow(0, 1, 1).expect("view");
        let pair = with_values2::<f32, _>(&base, &row, |a, b| (a.len(), b.to_vec())).expect("2");
        assert_eq!(pair, (6, vec![4.0, 5.0, 6.0]));
        let f64s = with_values::<f64, _>(&base, |xs| xs[5]).expect("convert");
        assert_eq!(f64s, 6.0);
    }

    /// Past the parallel threshold, with a width that leaves a partial column block: every
    /// column is the row-order sum, bit for bit, on one thread and on two; and the residual
    /// add is elementwise exact.
    #[test]
    fn parallel_row_sums_and_adds_match_the_serial_definitions() {
        let (rows, width) = (300usize, 1000usize);
        let m: Vec<f32> = (0..rows * width)
            .map(|i| ((i * 7919 % 1009) as f32 - 504.0) * 1e-3)
            .collect();
        let mut want = vec![0.0f32; width];
        for row in m.chunks_exact(width) {
            for (w, &v) in want.iter_mut().zip(row) {
                *w += v;
            }
        }
        for threads in [1, 2] {
            let got = crate::with_num_threads(threads, || sum_rows(&m, width)).expect("pool");
            assert_eq!(got, want, "{threads} threads");
        }
        let a = Tensor::from_vec(m.clone(), &[rows, width]).expect("a");
        let b = Tensor::from_vec(
            m.iter().map(|v| v * 3.0).collect::<Vec<_>>(),
            &[rows, width],
        )
        .expect("b");
        let sum = crate::with_num_threads(2, || add_tensors("add", &a, &b))
            .expect("pool")
            .expect("add")
            .to_vec::<f32>()
            .expect("f32");
        let want_sum: Vec<f32> = m.iter().map(|v| v + v * 3.0).collect();
        assert_eq!(sum, want_sum);
    }

    #[test]
    fn row_helpers_match_definitions() {
        let mut m = vec![1.0f64, 2.0, 3.0, 4.0, 5.0, 6.0];
        add_row(&mut m, &[10.0, 20.0, 30.0]);
        assert_eq!(m, vec![11.0, 22.0, 33.0, 14.0, 25.0, 36.0]);
        assert_eq!(sum_rows(&m, 3), vec![25.0, 47.0, 69.0]);
    }
}
