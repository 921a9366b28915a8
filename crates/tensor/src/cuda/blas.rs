//! Matrix multiplication through cuBLAS (`cublasGemmEx`), with row-major conventions.
//!
//! # Row-major on a column-major library
//!
//! A row-major `r × c` matrix, read by cuBLAS (column-major) with leading dimension `c`, is
//! its transpose. So the row-major product `C = op(A) · op(B)` is computed as the
//! column-major `Cᵀ = op(B)ᵀ · op(A)ᵀ`: cuBLAS gets `B`'s memory as its first operand and
//! `A`'s as its second, with `m = N`, `n = M`, `k = K`, each operand's transpose flag equal
//! to ours, and every leading dimension equal to the stored row length (columns) of that
//! operand: no copies and no explicit transposes. `plan_gemm` does this mapping, and a unit
//! test checks it against a column-major reference GEMM on the CPU.
//!
//! The handle is cudarc's `result` layer wrapped in `BlasHandle` rather than cudarc's
//! `CudaBlas`, whose `Drop` unwraps the destroy call (a panic in `Drop`).

use std::sync::{Mutex, PoisonError};

use cudarc::cublas::result as blas;
use cudarc::cublas::sys;

use super::device::CudaDevice;
use super::error::{CudaError, CudaResult, Unavailable, cublas, driver};
use super::view::Dev;
use crate::{DType, Result, Tensor};

/// Whether an operand enters the product as stored or transposed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Transpose {
    /// As stored.
    No,
    /// Transposed.
    Yes,
}

/// The raw cuBLAS handle; only ever used under [`BlasHandle`]'s lock.
struct Handle(sys::cublasHandle_t);

// SAFETY: a cuBLAS handle may be used from any thread as long as no two threads use it at the
// same time; `BlasHandle` keeps it behind a mutex, so it is used by one thread at a time.
// Tested by the device tests (`gemm_*`), which use the handle from the test's thread after
// it was created there, and by the handle's reuse across calls.
unsafe impl Send for Handle {}

/// A cuBLAS handle bound to a device's stream.
pub(crate) struct BlasHandle {
    handle: Mutex<Handle>,
}

impl BlasHandle {
    /// Checks that libcublas is present, then creates a handle on `device`'s stream.
    pub(crate) fn new(op: &'static str, device: &CudaDevice) -> CudaResult<BlasHandle> {
        // SAFETY: `is_culib_present` only tries `dlopen` on cuBLAS's names and drops the
        // handles; it touches no CUDA state. Tested by the device tests (first matmul).
        if !unsafe { sys::is_culib_present() } {
            return Err(CudaError::Unavailable {
                reason: Unavailable::LibraryNotFound {
                    library: "libcublas",
                    tried: cudarc::get_lib_name_candidates("cublas"),
                },
            });
        }
        device
            .context()
            .bind_to_thread()
            .map_err(driver(op, "cuCtxSetCurrent"))?;
        let handle = Handle(blas::create_handle().map_err(cublas(op, "cublasCreate"))?);
        // SAFETY: `handle.0` was just created and the stream is alive (the device holds it, and
        // the device outlives its handle: the handle is stored in the device). Tested by the
        // device tests `gemm_*` (the first matmul makes the handle).
        let bound =
            unsafe { blas::set_stream(handle.0, device.stream().cu_stream() as sys::cudaStream_t) };
        let out = BlasHandle {
            handle: Mutex::new(handle),
        };
        // On failure `out` is dropped here, which destroys the handle.
        bound.map_err(cublas(op, "cublasSetStream"))?;
        Ok(out)
    }
}

impl Drop for BlasHandle {
    fn drop(&mut self) {
        let handle = self
            .handle
            .get_mut()
            .unwrap_or_else(PoisonError::into_inner);
        // SAFETY: the handle was created by `create_handle` and is destroyed only here; a
        // failure (a context already torn down at exit) is ignored rather than panicked on.
        // Exercised whenever a device that made a matmul is dropped (device tests).
        let _ = unsafe { blas::destroy_handle(handle.0) };
    }
}

/// The arguments of one `cublasGemmEx` call for a row-major product (see the module docs).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct GemmPlan {
    /// Rows of the row-major result (`M`).
    pub(crate) rows: usize,
    /// Columns of the row-major result (`N`).
    pub(crate) cols: usize,
    /// The contracted dimension (`K`).
    pub(crate) inner: usize,
    /// cuBLAS's `m, n, k` (`N, M, K`).
    pub(crate) m: i32,
    pub(crate) n: i32,
    pub(crate) k: i32,
    /// cuBLAS's first operand is `B`'s memory, transposed when ours is.
    pub(crate) trans_first: bool,
    /// cuBLAS's second operand is `A`'s memory.
    pub(crate) trans_second: bool,
    /// Leading dimensions: the stored row lengths of `B`, `A` and `C` (at least 1).
    pub(crate) ld_first: i32,
    pub(crate) ld_second: i32,
    pub(crate) ld_out: i32,
}

/// `(rows, cols)` of a 2-D shape, or a shape error for `role`.
fn matrix(op: &'static str, shape: &[usize], other: &[usize]) -> CudaResult<(usize, usize)> {
    match shape {
        [r, c] => Ok((*r, *c)),
        _ => Err(CudaError::ShapeMismatch {
            op,
            lhs: shape.to_vec(),
            rhs: other.to_vec(),
        }),
    }
}

fn to_i32(op: &'static str, what: &'static str, value: usize) -> CudaResult<i32> {
    i32::try_from(value).map_err(|_| CudaError::TooLarge {
        op,
        what,
        value,
        max: i32::MAX as usize,
    })
}

/// Plans `C[M, N] = op(A) · op(B)` for row-major `A`, `B`, `C` of the given shapes.
pub(crate) fn plan_gemm(
    op: &'static str,
    a: &[usize],
    op_a: Transpose,
    b: &[usize],
    op_b: Transpose,
    c: &[usize],
) -> CudaResult<GemmPlan> {
    let (ar, ac) = matrix(op, a, b)?;
    let (br, bc) = matrix(op, b, a)?;
    let (rows, inner) = if op_a == Transpose::No {
        (ar, ac)
    } else {
        (ac, ar)
    };
    let (inner_b, cols) = if op_b == Transpose::No {
        (br, bc)
    } else {
        (bc, br)
    };
    if inner != inner_b {
        return Err(CudaError::ShapeMismatch {
            op,
            lhs: a.to_vec(),
            rhs: b.to_vec(),
        });
    }
    if c != [rows, cols] {
        return Err(CudaError::ShapeMismatch {
            op,
            lhs: vec![rows, cols],
            rhs: c.to_vec(),
        });
    }
    Ok(GemmPlan {
        rows,
        cols,
        inner,
        m: to_i32(op, "N", cols)?,
        n: to_i32(op, "M", rows)?,
        k: to_i32(op, "K", inner)?,
        trans_first: op_b == Transpose::Yes,
        trans_second: op_a == Transpose::Yes,
        ld_first: to_i32(op, "leading dimension of B", bc.max(1))?,
        ld_second: to_i32(op, "leading dimension of A", ac.max(1))?,
        ld_out: to_i32(op, "leading dimension of C", cols.max(1))?,
    })
}

/// The cuBLAS data type of a dtype with a GEMM.
fn data_type(dtype: DType) -> Option<sys::cudaDataType_t> {
    match dtype {
        DType::F32 => Some(sys::cudaDataType_t::CUDA_R_32F),
        DType::BF16 => Some(sys::cudaDataType_t::CUDA_R_16BF),
        DType::F16 => Some(sys::cudaDataType_t::CUDA_R_16F),
        _ => None,
    }
}

/// Checks the dtypes of a GEMM: `A` and `B` equal and one of f32, bf16, f16; `C` equal to them
/// or f32 (bf16/f16 inputs with an f32 result). Returns the cuBLAS types of inputs and output.
pub(crate) fn gemm_types(
    op: &'static str,
    a: DType,
    b: DType,
    c: DType,
) -> CudaResult<(sys::cudaDataType_t, sys::cudaDataType_t)> {
    if a != b {
        return Err(CudaError::DTypeMismatch { op, lhs: a, rhs: b });
    }
    let input = data_type(a).ok_or(CudaError::UnsupportedDType { op, from: a, to: c })?;
    if c != a && c != DType::F32 {
        return Err(CudaError::UnsupportedDType { op, from: a, to: c });
    }
    let output = data_type(c).ok_or(CudaError::UnsupportedDType { op, from: a, to: c })?;
    Ok((input, output))
}

fn operation(transposed: bool) -> sys::cublasOperation_t {
    if transposed {
        sys::cublasOperation_t::CUBLAS_OP_T
    } else {
        sys::cublasOperation_t::CUBLAS_OP_N
    }
}

/// The three operands of a product on one CUDA device, and their cuBLAS types.
fn operands(
    op: &'static str,
    a: &Tensor,
    b: &Tensor,
    c: &Tensor,
) -> Result<([Dev; 3], sys::cudaDataType_t, sys::cudaDataType_t)> {
    let (a, b, c) = (Dev::of(op, a)?, Dev::of(op, b)?, Dev::of(op, c)?);
    c.same_device(op, &a)?;
    c.same_device(op, &b)?;
    let (input, output) = gemm_types(op, a.dtype, b.dtype, c.dtype).map_err(c.error(op))?;
    Ok(([a, b, c], input, output))
}

/// `c = alpha · op(a) · op(b) + beta · c` for row-major, contiguous 2-D tensors on one CUDA
/// device, accumulated in f32 (`CUBLAS_COMPUTE_32F`, which never uses TF32); `c` is written
/// in place (it may be a view of a larger storage).
///
/// `a` and `b` are f32, bf16 or f16 (the same); `c` has their dtype or is f32. Shapes must
/// agree (`op(a)`: `[M, K]`, `op(b)`: `[K, N]`, `c`: `[M, N]`), else
/// [`Error::ShapeMismatch`](crate::Error::ShapeMismatch); sizes must fit cuBLAS's `int`.
#[allow(clippy::too_many_arguments)]
pub fn gemm(
    alpha: f32,
    a: &Tensor,
    op_a: Transpose,
    b: &Tensor,
    op_b: Transpose,
    beta: f32,
    c: &Tensor,
) -> Result<()> {
    let op = "cuda::gemm";
    c.check_writable(op)?;
    let ([a, b, c], input, output) = operands(op, a, b, c)?;
    let plan = plan_gemm(op, &a.shape, op_a, &b.shape, op_b, &c.shape).map_err(c.error(op))?;
    if plan.rows == 0 || plan.cols == 0 {
        return Ok(());
    }
    let handle = c.device.blas(op).map_err(c.error(op))?;
    let guard = handle.handle.lock().unwrap_or_else(PoisonError::into_inner);
    bind(op, &c.device).map_err(c.error(op))?;
    // SAFETY: the handle is live and bound to the device's stream (BlasHandle::new), used
    // under its lock; `alpha`/`beta` are host f32 (the default host pointer mode, and f32 is
    // the scale type of CUBLAS_COMPUTE_32F). The addresses are those of live, contiguous
    // tensors of this device (`Dev::of`), kept alive by the caller's borrows and ordered on
    // the one stream. Their sizes match the plan: `plan_gemm` checked that `b` is `[K, N]`
    // (or `[N, K]` transposed) with leading dimension its row length, likewise `a` and `c`,
    // and a contiguous tensor holds the product of its shape, so cuBLAS reads and writes only
    // inside them. Tested by the device tests `gemm_*` and, for the mapping, by the unit test
    // `plan_matches_a_column_major_reference`.
    unsafe {
        blas::gemm_ex(
            guard.0,
            operation(plan.trans_first),
            operation(plan.trans_second),
            plan.m,
            plan.n,
            plan.k,
            (&alpha as *const f32).cast(),
            b.ptr as *const std::ffi::c_void,
            input,
            plan.ld_first,
            a.ptr as *const std::ffi::c_void,
            input,
            plan.ld_second,
            (&beta as *const f32).cast(),
            c.ptr as *mut std::ffi::c_void,
            output,
            plan.ld_out,
            sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
            sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
        )
    }
    .map_err(cublas(op, "cublasGemmEx"))
    .map_err(c.error(op))
}

/// Makes the device's context current on this thread (cuBLAS calls need it).
fn bind(op: &'static str, device: &CudaDevice) -> CudaResult<()> {
    device
        .context()
        .bind_to_thread()
        .map_err(driver(op, "cuCtxSetCurrent"))
}

/// A batch of equal GEMMs over 3-D tensors `[batch, r, c]`: the plan of one product and the
/// element strides between consecutive matrices of `A`, `B` and `C`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct BatchedPlan {
    pub(crate) gemm: GemmPlan,
    pub(crate) batch: usize,
    pub(crate) count: i32,
    pub(crate) stride_a: i64,
    pub(crate) stride_b: i64,
    pub(crate) stride_c: i64,
}

/// `[batch, rows, cols]` of a 3-D shape, or a shape error.
fn batched(op: &'static str, shape: &[usize], other: &[usize]) -> CudaResult<(usize, [usize; 2])> {
    match shape {
        [b, r, c] => Ok((*b, [*r, *c])),
        _ => Err(CudaError::ShapeMismatch {
            op,
            lhs: shape.to_vec(),
            rhs: other.to_vec(),
        }),
    }
}

fn to_i64(op: &'static str, what: &'static str, value: usize) -> CudaResult<i64> {
    i64::try_from(value).map_err(|_| CudaError::TooLarge {
        op,
        what,
        value,
        max: i64::MAX as usize,
    })
}

/// Plans `C[i] = op(A[i]) · op(B[i])` for every `i` of the leading (batch) dim of row-major,
/// contiguous 3-D `A`, `B`, `C` with the same batch size.
pub(crate) fn plan_gemm_batched(
    op: &'static str,
    a: &[usize],
    op_a: Transpose,
    b: &[usize],
    op_b: Transpose,
    c: &[usize],
) -> CudaResult<BatchedPlan> {
    let (batch_a, a2) = batched(op, a, b)?;
    let (batch_b, b2) = batched(op, b, a)?;
    let (batch_c, c2) = batched(op, c, a)?;
    if batch_a != batch_b || batch_a != batch_c {
        return Err(CudaError::ShapeMismatch {
            op,
            lhs: a.to_vec(),
            rhs: if batch_a != batch_b { b } else { c }.to_vec(),
        });
    }
    let gemm = plan_gemm(op, &a2, op_a, &b2, op_b, &c2)?;
    Ok(BatchedPlan {
        gemm,
        batch: batch_a,
        count: to_i32(op, "batch count", batch_a)?,
        stride_a: to_i64(op, "stride of A", a2[0] * a2[1])?,
        stride_b: to_i64(op, "stride of B", b2[0] * b2[1])?,
        stride_c: to_i64(op, "stride of C", c2[0] * c2[1])?,
    })
}

/// `c[i] = alpha · op(a[i]) · op(b[i]) + beta · c[i]` for every matrix `i` of 3-D tensors
/// `[batch, r, c]` (row-major, contiguous, on one CUDA device), in one
/// `cublasGemmStridedBatchedEx` call with f32 accumulation (`CUBLAS_COMPUTE_32F`, never
/// TF32): attention's per-head products.
///
/// Dtypes as for [`gemm`]; the batch sizes must agree and each matrix's shapes as in [`gemm`],
/// else [`Error::ShapeMismatch`](crate::Error::ShapeMismatch); sizes and the batch count must
/// fit cuBLAS's `int`.
#[allow(clippy::too_many_arguments)]
pub fn gemm_strided_batched(
    alpha: f32,
    a: &Tensor,
    op_a: Transpose,
    b: &Tensor,
    op_b: Transpose,
    beta: f32,
    c: &Tensor,
) -> Result<()> {
    let op = "cuda::gemm_strided_batched";
    c.check_writable(op)?;
    let ([a, b, c], input, output) = operands(op, a, b, c)?;
    let plan =
        plan_gemm_batched(op, &a.shape, op_a, &b.shape, op_b, &c.shape).map_err(c.error(op))?;
    let g = plan.gemm;
    if plan.batch == 0 || g.rows == 0 || g.cols == 0 {
        return Ok(());
    }
    let handle = c.device.blas(op).map_err(c.error(op))?;
    let guard = handle.handle.lock().unwrap_or_else(PoisonError::into_inner);
    bind(op, &c.device).map_err(c.error(op))?;
    // SAFETY: as in `gemm`, per matrix: the handle is live, bound to the stream and used under
    // its lock; `alpha`/`beta` are host f32. `plan_gemm_batched` checked that `a`, `b`, `c`
    // are 3-D with one batch size and that each matrix's shapes agree as in `gemm`, with the
    // leading dimensions their row lengths; the strides are exactly each matrix's element
    // count, so matrix `i < batch` of each operand lies inside its contiguous tensor (which
    // holds `batch · rows · cols` elements). Tested by the device test
    // `batched_gemm_matches_the_cpu` and, for the mapping, by the unit test
    // `batched_plan_strides_and_errors`.
    unsafe {
        blas::gemm_strided_batched_ex(
            guard.0,
            operation(g.trans_first),
            operation(g.trans_second),
            g.m,
            g.n,
            g.k,
            (&alpha as *const f32).cast(),
            b.ptr as *const std::ffi::c_void,
            input,
            g.ld_first,
            plan.stride_b,
            a.ptr as *const std::ffi::c_void,
            input,
            g.ld_second,
            plan.stride_a,
            (&beta as *const f32).cast(),
            c.ptr as *mut std::ffi::c_void,
            output,
            g.ld_out,
            plan.stride_c,
            plan.count,
            sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
            sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
        )
    }
    .map_err(cublas(op, "cublasGemmStridedBatchedEx"))
    .map_err(c.error(op))
}

/// `a · b` for row-major `a: [M, K]` and `b: [K, N]` of one dtype (f32, bf16, f16) on a CUDA
/// device, as a new `[M, N]` tensor of that dtype there.
pub fn matmul(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    let op = "cuda::matmul";
    let da = Dev::of(op, a)?;
    let (m, n) = match (a.shape(), b.shape()) {
        ([m, _], [_, n]) => (*m, *n),
        _ => {
            return Err(crate::Error::ShapeMismatch {
                op,
                lhs: a.shape().to_vec(),
                rhs: b.shape().to_vec(),
            });
        }
    };
    let (c, _) = da.output(op, &[m, n], a.dtype())?;
    gemm(1.0, a, Transpose::No, b, Transpose::No, 0.0, &c)?;
    Ok(c)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// BLAS's column-major `C = alpha op(A) op(B) + beta C` on the CPU, as the reference
    /// semantics of `cublasGemmEx`.
    #[allow(clippy::too_many_arguments)]
    fn column_major_gemm(
        trans_a: bool,
        trans_b: bool,
        m: usize,
        n: usize,
        k: usize,
        a: &[f64],
        lda: usize,
        b: &[f64],
        ldb: usize,
        c: &mut [f64],
        ldc: usize,
    ) {
        for j in 0..n {
            for i in 0..m {
                let mut sum = 0.0;
                for l in 0..k {
                    let a_il = if trans_a {
                        a[l + i * lda]
                    } else {
                        a[i + l * lda]
                    };
                    let b_lj = if trans_b {
                        b[j + l * ldb]
                    } else {
                        b[l + j * ldb]
                    };
                    sum += a_il * b_lj;
                }
                c[i + j * ldc] = sum;
            }
        }
    }

    #[test]
    fn plan_matches_a_column_major_reference() {
        // Shapes that are not multiples of anything, all four transpose combinations.
        let (m, k, n) = (7usize, 5usize, 3usize);
        let f = |i: usize, salt: usize| ((i * 7 + salt) % 11) as f64 - 5.0;
        for op_a in [Transpose::No, Transpose::Yes] {
            for op_b in [Transpose::No, Transpose::Yes] {
                let a_shape = if op_a == Transpose::No {
                    [m, k]
                } else {
                    [k, m]
                };
                let b_shape = if op_b == Transpose::No {
                    [k, n]
                } else {
                    [n, k]
                };
                let a: Vec<f64> = (0..m * k).map(|i| f(i, 1)).collect();
                let b: Vec<f64> = (0..k * n).map(|i| f(i, 4)).collect();
                // Row-major reference: C[i][j] = sum_l opA[i][l] opB[l][j].
                let a_at = |i: usize, l: usize| {
                    if op_a == Transpose::No {
                        a[i * k + l]
                    } else {
                        a[l * m + i]
                    }
                };
                let b_at = |l: usize, j: usize| {
                    if op_b == Transpose::No {
                        b[l * n + j]
                    } else {
                        b[j * k + l]
                    }
                };
                let mut expected = vec![0.0; m * n];
                for i in 0..m {
                    for j in 0..n {
                        expected[i * n + j] = (0..k).map(|l| a_at(i, l) * b_at(l, j)).sum();
                    }
                }
                let plan = plan_gemm("t", &a_shape, op_a, &b_shape, op_b, &[m, n]).unwrap();
                assert_eq!((plan.rows, plan.cols, plan.inner), (m, n, k));
                let mut got = vec![f64::NAN; m * n];
                column_major_gemm(
                    plan.trans_first,
                    plan.trans_second,
                    plan.m as usize,
                    plan.n as usize,
                    plan.k as usize,
                    &b,
                    plan.ld_first as usize,
                    &a,
                    plan.ld_second as usize,
                    &mut got,
                    plan.ld_out as usize,
                );
                assert_eq!(got, expected, "op_a {op_a:?} op_b {op_b:?}");
            }
        }
    }

    #[test]
    fn plan_rejects_bad_shapes() {
        let no = Transpose::No;
        assert!(matches!(
            plan_gemm("t", &[2, 3], no, &[4, 5], no, &[2, 5]),
            Err(CudaError::ShapeMismatch { .. })
        ));
        assert!(matches!(
            plan_gemm("t", &[2, 3], no, &[3, 5], no, &[5, 2]),
            Err(CudaError::ShapeMismatch { lhs, rhs, .. }) if lhs == [2, 5] && rhs == [5, 2]
        ));
        assert!(matches!(
            plan_gemm("t", &[2, 3, 1], no, &[3, 5], no, &[2, 5]),
            Err(CudaError::ShapeMismatch { .. })
        ));
        assert!(matches!(
            plan_gemm("t", &[1, 1usize << 31], no, &[1usize << 31, 1], no, &[1, 1]),
            Err(CudaError::TooLarge { what: "K", .. })
        ));
        // Empty matrices plan fine (the call is skipped or computes beta·C).
        let empty = plan_gemm("t", &[0, 3], no, &[3, 4], no, &[0, 4]).unwrap();
        assert_eq!((empty.rows, empty.ld_second), (0, 3));
        let inner_empty = plan_gemm("t", &[2, 0], no, &[0, 4], no, &[2, 4]).unwrap();
        assert_eq!(
            (inner_empty.k, inner_empty.ld_first, inner_empty.ld_second),
            (0, 4, 1)
        );
    }

    #[test]
    fn batched_plan_strides_and_errors() {
        let (no, yes) = (Transpose::No, Transpose::Yes);
        // Attention's scores: Q [BH, T, D] · K[BH, T, D]ᵀ = S [BH, T, T].
        let plan = plan_gemm_batched("t", &[6, 5, 3], no, &[6, 5, 3], yes, &[6, 5, 5]).unwrap();
        assert_eq!((plan.batch, plan.count), (6, 6));
        assert_eq!((plan.stride_a, plan.stride_b, plan.stride_c), (15, 15, 25));
        assert_eq!(
            plan.gemm,
            plan_gemm("t", &[5, 3], no, &[5, 3], yes, &[5, 5]).unwrap()
        );
        // dV = Pᵀ · dY: P [BH, T, T] transposed, dY [BH, T, D].
        let dv = plan_gemm_batched("t", &[6, 5, 5], yes, &[6, 5, 3], no, &[6, 5, 3]).unwrap();
        assert_eq!((dv.stride_a, dv.stride_b, dv.stride_c), (25, 15, 15));
        assert!(matches!(
            plan_gemm_batched("t", &[6, 5, 3], no, &[5, 5, 3], yes, &[6, 5, 5]),
            Err(CudaError::ShapeMismatch { rhs, .. }) if rhs == [5, 5, 3]
        ));
        assert!(matches!(
            plan_gemm_batched("t", &[6, 5, 3], no, &[6, 5, 3], yes, &[7, 5, 5]),
            Err(CudaError::ShapeMismatch { rhs, .. }) if rhs == [7, 5, 5]
        ));
        assert!(matches!(
            plan_gemm_batched("t", &[5, 3], no, &[6, 5, 3], yes, &[6, 5, 5]),
            Err(CudaError::ShapeMismatch { .. })
        ));
        assert!(matches!(
            plan_gemm_batched("t", &[6, 5, 3], no, &[6, 4, 3], no, &[6, 5, 3]),
            Err(CudaError::ShapeMismatch { .. })
        ));
        let many = 1usize << 31;
        assert!(matches!(
            plan_gemm_batched("t", &[many, 1, 1], no, &[many, 1, 1], no, &[many, 1, 1]),
            Err(CudaError::TooLarge {
                what: "batch count",
                ..
            })
        ));
        let empty = plan_gemm_batched("t", &[0, 5, 3], no, &[0, 3, 2], no, &[0, 5, 2]).unwrap();
        assert_eq!(empty.batch, 0);
    }

    #[test]
    fn gemm_dtypes() {
        assert!(gemm_types("t", DType::F32, DType::F32, DType::F32).is_ok());
        assert!(gemm_types("t", DType::BF16, DType::BF16, DType::BF16).is_ok());
        assert!(gemm_types("t", DType::BF16, DType::BF16, DType::F32).is_ok());
        assert!(gemm_types("t", DType::F16, DType::F16, DType::F32).is_ok());
        assert!(matches!(
            gemm_types("t", DType::F32, DType::BF16, DType::F32),
            Err(CudaError::DTypeMismatch { .. })
        ));
        assert!(matches!(
            gemm_types("t", DType::F32, DType::F32, DType::BF16),
            Err(CudaError::UnsupportedDType { .. })
        ));
        assert!(matches!(
            gemm_types("t", DType::F64, DType::F64, DType::F64),
            Err(CudaError::UnsupportedDType { .. })
        ));
        assert!(matches!(
            gemm_types("t", DType::I32, DType::I32, DType::F32),
            Err(CudaError::UnsupportedDType { .. })
        ));
    }
}
