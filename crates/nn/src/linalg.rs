//! Matrix multiplication through the `matrixmultiply` GEMM kernels.

use hypershard_tensor::{DType, Tensor};

use crate::{Error, Result};

/// Which operands of [`matmul_with`] are used transposed.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct MatmulOptions {
    /// Use `aᵀ` instead of `a` (then `a` is `[k, m]`).
    pub transpose_a: bool,
    /// Use `bᵀ` instead of `b` (then `b` is `[n, k]`).
    pub transpose_b: bool,
}

/// The sizes and element strides of one GEMM `C[m, n] = A[m, k] · B[k, n]`.
#[derive(Debug, Clone, Copy)]
struct GemmShape {
    m: usize,
    k: usize,
    n: usize,
    a_row_stride: isize,
    a_col_stride: isize,
    b_row_stride: isize,
    b_col_stride: isize,
}

/// `a · b` for two 2-D tensors of one float dtype; see [`matmul_with`].
pub fn matmul(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    matmul_with(a, b, MatmulOptions::default())
}

/// `op(a) · op(b)` where `op` transposes the operands named in `options`.
///
/// f32 and f64 run natively (sgemm / dgemm); bf16 and f16 are converted to f32, multiplied,
/// and the result is rounded back once, so the accumulation is in f32 as in torch's CPU
/// kernels. Any strided views are accepted (they are gathered first). The result is a new
/// contiguous tensor of the inputs' dtype.
pub fn matmul_with(a: &Tensor, b: &Tensor, options: MatmulOptions) -> Result<Tensor> {
    const OP: &str = "matmul";
    if a.ndim() != 2 {
        return Err(Error::BadShape {
            op: OP,
            expected: "a 2-D left operand".to_string(),
            actual: a.shape().to_vec(),
        });
    }
    if b.ndim() != 2 {
        return Err(Error::BadShape {
            op: OP,
            expected: "a 2-D right operand".to_string(),
            actual: b.shape().to_vec(),
        });
    }
    if a.dtype() != b.dtype() {
        return Err(Error::DTypeMismatch {
            op: OP,
            lhs: a.dtype(),
            rhs: b.dtype(),
        });
    }
    let (a_rows, a_cols) = (a.shape()[0], a.shape()[1]);
    let (b_rows, b_cols) = (b.shape()[0], b.shape()[1]);
    let (m, k) = if options.transpose_a {
        (a_cols, a_rows)
    } else {
        (a_rows, a_cols)
    };
    let (k_b, n) = if options.transpose_b {
        (b_cols, b_rows)
    } else {
        (b_rows, b_cols)
    };
    if k != k_b {
        return Err(Error::ShapeMismatch {
            op: OP,
            lhs: a.shape().to_vec(),
            rhs: b.shape().to_vec(),
        });
    }
    // Both operands are gathered row-major; a transpose is then only a swap of strides.
    let stride =
        |size: usize| isize::try_from(size).map_err(|_| Error::SizeOverflow { op: OP, size });
    let (a_row_stride, a_col_stride) = if options.transpose_a {
        (1, stride(m)?)
    } else {
        (stride(k)?, 1)
    };
    let (b_row_stride, b_col_stride) = if options.transpose_b {
        (1, stride(k)?)
    } else {
        (stride(n)?, 1)
    };
    let shape = GemmShape {
        m,
        k,
        n,
        a_row_stride,
        a_col_stride,
        b_row_stride,
        b_col_stride,
    };
    match a.dtype() {
        DType::F32 => {
            let out = gemm_f32(&a.to_vec::<f32>()?, &b.to_vec::<f32>()?, shape)?;
            Ok(Tensor::from_vec(out, &[m, n])?)
        }
        DType::F64 => {
            let out = gemm_f64(&a.to_vec::<f64>()?, &b.to_vec::<f64>()?, shape)?;
            Ok(Tensor::from_vec(out, &[m, n])?)
        }
        DType::BF16 | DType::F16 => {
            let a32 = a.to_dtype(DType::F32)?.to_vec::<f32>()?;
            let b32 = b.to_dtype(DType::F32)?.to_vec::<f32>()?;
            let out = gemm_f32(&a32, &b32, shape)?;
            Ok(Tensor::from_vec(out, &[m, n])?.to_dtype(a.dtype())?)
        }
        dtype => Err(Error::UnsupportedDType { op: OP, dtype }),
    }
}

/// Checks that row-major buffers hold exactly the operands `shape` describes, so every index
/// the kernel forms from the strides is in bounds.
fn check_lengths(a_len: usize, b_len: usize, shape: GemmShape) -> Result<()> {
    let overflow = |size| Error::SizeOverflow { op: "matmul", size };
    let a_need = shape.m.checked_mul(shape.k).ok_or(overflow(shape.m))?;
    let b_need = shape.k.checked_mul(shape.n).ok_or(overflow(shape.k))?;
    shape.m.checked_mul(shape.n).ok_or(overflow(shape.m))?;
    if a_len != a_need || b_len != b_need {
        return Err(Error::ShapeMismatch {
            op: "matmul",
            lhs: vec![a_len, a_need],
            rhs: vec![b_len, b_need],
        });
    }
    Ok(())
}

fn gemm_f32(a: &[f32], b: &[f32], shape: GemmShape) -> Result<Vec<f32>> {
    check_lengths(a.len(), b.len(), shape)?;
    let mut c = vec![0.0f32; shape.m * shape.n];
    let c_row_stride = isize::try_from(shape.n).map_err(|_| Error::SizeOverflow {
        op: "matmul",
        size: shape.n,
    })?;
    // SAFETY: `check_lengths` proved `a.len() == m*k`, `b.len() == k*n` and `c` has `m*n`
    // elements. The strides are those of a row-major `[m, k]` (or `[k, m]` read transposed)
    // buffer, a row-major `[k, n]` (or `[n, k]`) buffer and a row-major `[m, n]` buffer, so
    // every element the kernel addresses (`i*rs + j*cs` for `i < rows`, `j < cols`) lies
    // inside its slice. `c` is exclusively borrowed and does not alias `a` or `b`. With
    // `beta = 0` the kernel never reads `c` before writing it.
    unsafe {
        matrixmultiply::sgemm(
            shape.m,
            shape.k,
            shape.n,
            1.0,
            a.as_ptr(),
            shape.a_row_stride,
            shape.a_col_stride,
            b.as_ptr(),
            shape.b_row_stride,
            shape.b_col_stride,
            0.0,
            c.as_mut_ptr(),
            c_row_stride,
            1,
        );
    }
    Ok(c)
}

fn gemm_f64(a: &[f64], b: &[f64], shape: GemmShape) -> Result<Vec<f64>> {
    check_lengths(a.len(), b.len(), shape)?;
    let mut c = vec![0.0f64; shape.m * shape.n];
    let c_row_stride = isize::try_from(shape.n).map_err(|_| Error::SizeOverflow {
        op: "matmul",
        size: shape.n,
    })?;
    // SAFETY: as in `gemm_f32`: the lengths are checked against `m`, `k`, `n` above, the
    // strides describe row-major buffers of exactly those sizes, `c` is exclusively borrowed
    // and `beta = 0`.
    unsafe {
        matrixmultiply::dgemm(
            shape.m,
            shape.k,
            shape.n,
            1.0,
            a.as_ptr(),
            shape.a_row_stride,
            shape.a_col_stride,
            b.as_ptr(),
            shape.b_row_stride,
            shape.b_col_stride,
            0.0,
            c.as_mut_ptr(),
            c_row_stride,
            1,
        );
    }
    Ok(c)
}

#[cfg(test)]
mod tests {
    use hypershard_tensor::RandomInit;

    use super::*;

    /// The reference product by the definition, in f64.
    fn naive(a: &[f64], b: &[f64], m: usize, k: usize, n: usize) -> Vec<f64> {
        let mut c = vec![0.0; m * n];
        for i in 0..m {
            for j in 0..n {
                let mut acc = 0.0;
                for p in 0..k {
                    acc += a[i * k + p] * b[p * n + j];
                }
                c[i * n + j] = acc;
            }
        }
        c
    }

    fn random(shape: &[usize], dtype: DType, seed: u64) -> Tensor {
        // invariant: shapes are small and the dtypes are floats, so creation cannot fail.
        Tensor::random(shape, dtype, RandomInit::uniform(seed, -1.0, 1.0)).expect("random")
    }

    fn check(m: usize, k: usize, n: usize, options: MatmulOptions, dtype: DType, tol: f64) {
        let a_stored = if options.transpose_a { [k, m] } else { [m, k] };
        let b_stored = if options.transpose_b { [n, k] } else { [k, n] };
        let a = random(&a_stored, dtype, 1 + m as u64);
        let b = random(&b_stored, dtype, 100 + n as u64);
        // invariant: the operands are 2-D with matching inner sizes.
        let c = matmul_with(&a, &b, options).expect("matmul");
        assert_eq!(c.shape(), &[m, n]);
        assert_eq!(c.dtype(), dtype);
        let logical = |t: &Tensor, transpose: bool| {
            let t = if transpose {
                t.transpose(0, 1).expect("2-D")
            } else {
                t.clone()
            };
            t.to_f64_vec().expect("float")
        };
        let expected = naive(
            &logical(&a, options.transpose_a),
            &logical(&b, options.transpose_b),
            m,
            k,
            n,
        );
        let got = c.to_f64_vec().expect("float");
        for (g, e) in got.iter().zip(&expected) {
            assert!((g - e).abs() <= tol * (1.0 + e.abs()), "{g} vs {e}");
        }
    }

    #[test]
    fn matches_naive_for_all_transposes_and_non_square_shapes() {
        for (m, k, n) in [(1, 1, 1), (3, 5, 7), (17, 4, 9), (8, 33, 2), (64, 31, 65)] {
            for transpose_a in [false, true] {
                for transpose_b in [false, true] {
                    let options = MatmulOptions {
                        transpose_a,
                        transpose_b,
                    };
                    check(m, k, n, options, DType::F64, 1e-12);
                    check(m, k, n, options, DType::F32, 1e-5);
                }
            }
        }
    }

    #[test]
    fn half_precision_inputs_accumulate_in_f32() {
        check(5, 12, 3, MatmulOptions::default(), DType::BF16, 2e-2);
        check(5, 12, 3, MatmulOptions::default(), DType::F16, 2e-3);
    }

    #[test]
    fn empty_inner_dimension_gives_zeros() {
        let a = Tensor::zeros(&[3, 0], DType::F32).expect("zeros");
        let b = Tensor::zeros(&[0, 2], DType::F32).expect("zeros");
        let c = matmul(&a, &b).expect("matmul");
        assert_eq!(c.to_vec::<f32>().expect("f32"), vec![0.0; 6]);
    }

    #[test]
    fn strided_views_are_accepted() {
        let base = random(&[6, 4], DType::F64, 7);
        let a = base.transpose(0, 1).expect("2-D"); // [4, 6], not contiguous
        let b = random(&[6, 3], DType::F64, 8);
        let c = matmul(&a, &b).expect("matmul");
        let expected = naive(
            &a.to_f64_vec().expect("f64"),
            &b.to_f64_vec().expect("f64"),
            4,
            6,
            3,
        );
        for (g, e) in c.to_f64_vec().expect("f64").iter().zip(&expected) {
            assert!((g - e).abs() < 1e-12);
        }
    }

    #[test]
    fn bad_inputs_are_typed_errors() {
        let a = random(&[2, 3], DType::F32, 1);
        let b = random(&[2, 3], DType::F32, 2);
        assert!(matches!(matmul(&a, &b), Err(Error::ShapeMismatch { .. })));
        let b64 = random(&[3, 2], DType::F64, 2);
        assert!(matches!(matmul(&a, &b64), Err(Error::DTypeMismatch { .. })));
        let v = random(&[3], DType::F32, 3);
        assert!(matches!(matmul(&a, &v), Err(Error::BadShape { .. })));
        let i = Tensor::zeros(&[3, 2], DType::I32).expect("zeros");
        let ai = Tensor::zeros(&[2, 3], DType::I32).expect("zeros");
        assert!(matches!(
            matmul(&ai, &i),
            Err(Error::UnsupportedDType { .. })
        ));
    }
}
