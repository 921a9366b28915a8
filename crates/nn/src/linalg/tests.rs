//! The matmul entry points against f64 references, threaded splits and fused biases.

use hypershard_tensor::{DType, RandomInit};

use super::*;
use crate::kernels::add_assign;

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
fn accumulate_adds_the_product_to_c_in_parallel_blocks() {
    // 130 × 131 × 129 takes the parallel path with 3 threads (uneven row blocks); the
    // transposed A and B are the strides the fused loss head uses.
    let (m, k, n) = (130, 131, 129);
    let a = random(&[k, m], DType::F64, 11).to_f64_vec().expect("f64");
    let b = random(&[n, k], DType::F64, 12).to_f64_vec().expect("f64");
    let start: Vec<f64> = (0..m * n).map(|i| (i % 7) as f64 - 3.0).collect();
    let options = MatmulOptions {
        transpose_a: true,
        transpose_b: true,
    };
    let shape = GemmShape::new(m, k, n, options).expect("shape");
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(3)
        .build()
        .expect("pool");
    let mut c = start.clone();
    pool.install(|| gemm_accumulate_into(&a, &b, shape, &mut c))
        .expect("gemm");
    // The logical operands: Aᵀ stored [k, m] and Bᵀ stored [n, k].
    let at: Vec<f64> = (0..m * k).map(|i| a[(i % k) * m + i / k]).collect();
    let bt: Vec<f64> = (0..k * n).map(|i| b[(i % n) * k + i / n]).collect();
    let product = naive(&at, &bt, m, k, n);
    for ((got, s), p) in c.iter().zip(&start).zip(&product) {
        assert!(
            (got - (s + p)).abs() <= 1e-12 * (1.0 + p.abs()),
            "{got} vs {s} + {p}"
        );
    }
    // An empty inner dimension leaves an accumulated C as it was.
    let mut same = start[..6].to_vec();
    let empty = GemmShape::new(2, 0, 3, MatmulOptions::default()).expect("shape");
    gemm_accumulate_into::<f64>(&[], &[], empty, &mut same).expect("gemm");
    assert_eq!(same, start[..6]);
}

/// [`gemm_bias_into`] against [`gemm_into`] followed by a pass adding the bias, bit for
/// bit, in `F`.
fn check_bias<F: Float>(m: usize, k: usize, n: usize, threads: usize) {
    let options = MatmulOptions {
        transpose_a: false,
        transpose_b: true,
    };
    let shape = GemmShape::new(m, k, n, options).expect("shape");
    let a: Vec<F> = (0..m * k)
        .map(|i| F::of(((i * 37 % 101) as f64 - 50.0) / 7.0))
        .collect();
    let b: Vec<F> = (0..k * n)
        .map(|i| F::of(((i * 53 % 97) as f64 - 48.0) / 9.0))
        .collect();
    let bias: Vec<F> = (0..n).map(|j| F::of((j % 13) as f64 / 3.0 - 2.0)).collect();
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .expect("pool");
    // Start from values the overwrite must not keep.
    let (mut fused, mut separate) = (vec![F::of(9.0); m * n], vec![F::of(9.0); m * n]);
    pool.install(|| {
        gemm_bias_into(&a, &b, shape, &bias, &mut fused)?;
        gemm_into(&a, &b, shape, &mut separate)
    })
    .expect("gemm");
    for row in separate.chunks_exact_mut(n) {
        add_assign(row, &bias);
    }
    for (index, (got, want)) in fused.iter().zip(&separate).enumerate() {
        assert!(
            got.as_f64().to_bits() == want.as_f64().to_bits(),
            "{m}×{k}×{n} at {threads} threads, element {index}: {got:?} against {want:?}"
        );
    }
}

#[test]
fn a_fused_bias_is_bitwise_the_product_then_a_pass() {
    // One thread; split by rows (many rows); split by columns (few rows, many columns,
    // ragged last block); several k-blocks; f32 (the packed GEMM) and f64 (matrixmultiply
    // and the pass).
    for (m, k, n, threads) in [
        (50, 70, 90, 1),
        (300, 192, 200, 2),
        (9, 300, 1030, 3),
        (80, 800, 33, 2),
    ] {
        assert!(threads == 1 || m * k * n >= PARALLEL_MIN_MULADDS);
        let options = MatmulOptions {
            transpose_a: false,
            transpose_b: true,
        };
        let shape = GemmShape::new(m, k, n, options).expect("shape");
        let by_columns = (m, k, n) == (9, 300, 1030);
        assert!(threads == 1 || splits_columns(shape, threads) == by_columns);
        check_bias::<f32>(m, k, n, threads);
        check_bias::<f64>(m, k, n, threads);
    }
    let shape = GemmShape::new(2, 3, 4, MatmulOptions::default()).expect("shape");
    let mut c = [0.0f32; 8];
    let err = gemm_bias_into(&[0.0; 6], &[0.0; 12], shape, &[1.0; 3], &mut c)
        .expect_err("a bias of 3 values for 4 columns");
    assert!(err.to_string().contains("matmul bias"), "{err}");
}

/// A product at `threads` threads against the single-thread one, bit for bit, for every
/// layout of the operands, overwriting and accumulating, and against an f64 dot product at
/// a few elements; `by_columns` is the split the shape must take.
fn check_split(m: usize, k: usize, n: usize, threads: usize, by_columns: bool) {
    for (transpose_a, transpose_b) in [(false, false), (false, true), (true, false), (true, true)] {
        let options = MatmulOptions {
            transpose_a,
            transpose_b,
        };
        let shape = GemmShape::new(m, k, n, options).expect("shape");
        assert_eq!(splits_columns(shape, threads), by_columns, "{m}×{k}×{n}");
        assert!(
            m * k * n >= PARALLEL_MIN_MULADDS,
            "{m}×{k}×{n} runs in parallel"
        );
        let a: Vec<f32> = (0..m * k)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) / 7.0)
            .collect();
        let b: Vec<f32> = (0..k * n)
            .map(|i| ((i * 53 % 97) as f32 - 48.0) / 9.0)
            .collect();
        let start: Vec<f32> = (0..m * n).map(|i| (i % 11) as f32 - 5.0).collect();
        for accumulate in [false, true] {
            let run = |threads: usize| {
                let pool = rayon::ThreadPoolBuilder::new()
                    .num_threads(threads)
                    .build()
                    .expect("pool");
                let mut c = start.clone();
                pool.install(|| {
                    if accumulate {
                        gemm_accumulate_into(&a, &b, shape, &mut c)
                    } else {
                        gemm_into(&a, &b, shape, &mut c)
                    }
                })
                .expect("gemm");
                c
            };
            let split = run(threads);
            let whole = run(1);
            assert!(
                split
                    .iter()
                    .zip(&whole)
                    .all(|(x, y)| x.to_bits() == y.to_bits()),
                "{m}×{k}×{n}, {options:?}, accumulate {accumulate}"
            );
            let at = |i: usize, p: usize| {
                if transpose_a {
                    a[p * m + i]
                } else {
                    a[i * k + p]
                }
            };
            let bt = |p: usize, j: usize| {
                if transpose_b {
                    b[j * k + p]
                } else {
                    b[p * n + j]
                }
            };
            for (i, j) in [(0, 0), (m - 1, n - 1), (m / 2, n / 2 + 1)] {
                let dot: f64 = (0..k)
                    .map(|p| f64::from(at(i, p)) * f64::from(bt(p, j)))
                    .sum();
                let want = dot
                    + if accumulate {
                        f64::from(start[i * n + j])
                    } else {
                        0.0
                    };
                let got = f64::from(split[i * n + j]);
                assert!(
                    (got - want).abs() <= 1e-4 * (1.0 + want.abs()),
                    "{got} vs {want}"
                );
            }
        }
    }
}

#[test]
fn row_blocks_are_bitwise_the_single_thread_product() {
    // Many rows: split by rows at 2 and 3 threads, a ragged last block of rows, several
    // blocks of `k` (300 > the AVX2 kernel's 256) and of packed columns (300 > 240).
    for (m, k, n, threads) in [(301, 300, 70, 2), (400, 64, 300, 3), (1000, 20, 129, 2)] {
        check_split(m, k, n, threads, false);
    }
}

#[test]
fn column_blocks_are_bitwise_the_single_thread_product() {
    // Few rows and many columns: split by columns at 2 and 3 threads (ragged last block).
    for (m, k, n, threads) in [(40, 70, 1000, 2), (9, 300, 1030, 3), (90, 20, 3000, 2)] {
        check_split(m, k, n, threads, true);
    }
    // The fused head's logits split by columns; a square layer's product by rows.
    let nt = MatmulOptions {
        transpose_a: false,
        transpose_b: true,
    };
    assert!(splits_columns(
        GemmShape::new(166, 768, 50_304, nt).expect("shape"),
        2
    ));
    assert!(!splits_columns(
        GemmShape::new(1024, 768, 768, nt).expect("shape"),
        2
    ));
}

#[test]
fn parallel_row_blocks_match_naive() {
    // 130³ multiply-adds exceed the parallel threshold; 3 threads give uneven blocks.
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(3)
        .build()
        .expect("pool");
    pool.install(|| {
        for transpose_a in [false, true] {
            let options = MatmulOptions {
                transpose_a,
                transpose_b: !transpose_a,
            };
            check(130, 131, 129, options, DType::F64, 1e-12);
        }
    });
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
