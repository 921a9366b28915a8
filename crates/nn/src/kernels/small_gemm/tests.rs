//! The packing-free kernels against an f64 reference, on every kernel set the CPU runs.

use super::*;

/// Deterministic values in [-1, 1).
fn values(len: usize, seed: u64) -> Vec<f32> {
    (0..len as u64)
        .map(|i| {
            let x =
                (i.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ seed).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            ((x >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect()
}

/// `A · op(B)` in f64, row-major.
fn reference(a: &[f32], b: &[f32], m: usize, k: usize, n: usize, b_transposed: bool) -> Vec<f64> {
    let mut c = vec![0.0f64; m * n];
    for i in 0..m {
        for j in 0..n {
            let mut sum = 0.0f64;
            for p in 0..k {
                let bv = if b_transposed {
                    b[j * k + p]
                } else {
                    b[p * n + j]
                };
                sum += f64::from(a[i * k + p]) * f64::from(bv);
            }
            c[i * n + j] = sum;
        }
    }
    c
}

fn assert_close(got: &[f32], want: &[f64], k: usize, what: &str) {
    assert_eq!(got.len(), want.len());
    // Each result is a sum of k products of magnitude < 1: f32 rounding stays far below
    // k · 2⁻²⁰.
    let tol = k as f64 * 1e-6;
    for (index, (&g, &w)) in got.iter().zip(want).enumerate() {
        assert!(
            (f64::from(g) - w).abs() <= tol,
            "{what}: [{index}] {g} vs {w}"
        );
    }
}

/// The kernel sets this CPU runs, widest first, and `None`, which declines.
fn kernel_sets() -> Vec<Kernels> {
    match Kernels::detect() {
        Kernels::Avx512 => vec![Kernels::Avx512, Kernels::Avx2, Kernels::None],
        Kernels::Avx2 => vec![Kernels::Avx2, Kernels::None],
        Kernels::None => vec![Kernels::None],
    }
}

#[test]
fn kernels_match_a_reference_on_ragged_shapes() {
    // Row counts around the 4-, 6- and 8-row blocks, inner sizes around the 8- and 16-lane
    // vectors and the passes over `B` (64 and 128 rows), column counts around the
    // 4-column (nt) and 16/32/64-column (nn) panels and the 8-lane halves of AVX2's.
    let shapes = [
        (7, 257, 17),
        (12, 129, 16),
        (13, 9, 8),
        (64, 64, 32),
        (13, 40, 32),
        (8, 70, 48),
        (21, 65, 100),
        (9, 3, 33),
        (40, 130, 31),
        (1, 1, 1),
        (3, 17, 5),
        (4, 16, 4),
        (5, 33, 67),
        (32, 1024, 130),
        (63, 7, 81),
        (8, 100, 64),
        (6, 200, 70),
    ];
    for &(m, k, n) in &shapes {
        let a = values(m * k, 1);
        let b = values(n * k, 2);
        let mut c = vec![f32::NAN; m * n];
        // 64 rows and more are the packing GEMM's (the transposed product takes them).
        let takes = available() && m < MAX_ROWS;
        let ran = gemm_nt(&a, &b, m, k, n, &mut c);
        assert_eq!(ran, takes, "nt {m}x{k}x{n}");
        if ran {
            assert_close(&c, &reference(&a, &b, m, k, n, true), k, "nt");
        }
        // The dispatching entry points take what the widest kernel set takes.
        let mut c = vec![f32::NAN; m * n];
        let nn_takes = available() && m < MAX_ROWS;
        assert_eq!(gemm_nn(&a, &b, m, k, n, &mut c), nn_takes, "nn {m}x{k}x{n}");
        // The same A given as its transpose `[k, m]`.
        let mut a_t = vec![0.0f32; k * m];
        for i in 0..m {
            for p in 0..k {
                a_t[p * m + i] = a[i * k + p];
            }
        }
        let mut c_t = vec![f32::NAN; m * n];
        let tn_ran = gemm_tn(&a_t, &b, m, k, n, &mut c_t);
        assert_eq!(tn_ran, available(), "tn {m}x{k}x{n}");
        // Every kernel set the CPU runs, on both layouts of A.
        for kernels in kernel_sets() {
            let want = reference(&a, &b, m, k, n, false);
            let mut c = vec![f32::NAN; m * n];
            let row_major = AStrides { row: k, col: 1 };
            let nn_ran = nn_on(kernels, &a, row_major, &b, (m, k, n), &mut c);
            assert_eq!(nn_ran, kernels != Kernels::None, "{kernels:?}");
            let mut c_t = vec![f32::NAN; m * n];
            let transposed = AStrides { row: 1, col: m };
            assert_eq!(
                nn_on(kernels, &a_t, transposed, &b, (m, k, n), &mut c_t),
                nn_ran
            );
            if !nn_ran {
                let mut c_nt = vec![f32::NAN; m * n];
                assert!(!nt_on(kernels, &a, &b, (m, k, n), &mut c_nt));
                let mut all = c.iter().chain(&c_t).chain(&c_nt);
                assert!(all.all(|v| v.is_nan()), "declined but wrote C");
                continue;
            }
            assert_close(&c, &want, k, &format!("{kernels:?} nn {m}x{k}x{n}"));
            // The same products summed in the same order: the same bits as `nn`.
            assert_eq!(c_t, c, "{kernels:?} tn vs nn {m}x{k}x{n}");
            let mut c_nt = vec![f32::NAN; m * n];
            assert!(nt_on(kernels, &a, &b, (m, k, n), &mut c_nt));
            let want_nt = reference(&a, &b, m, k, n, true);
            assert_close(&c_nt, &want_nt, k, &format!("{kernels:?} nt {m}x{k}x{n}"));
        }
    }
}

#[test]
fn out_of_range_shapes_are_declined_untouched() {
    let a = values(64 * 2, 3);
    let b = values(2 * 3, 4);
    let mut c = vec![7.0f32; 64 * 3];
    // 64 rows is the packing GEMM's job.
    assert!(!gemm_nt(&a, &b, 64, 2, 3, &mut c));
    assert!(!gemm_nn(&a, &b, 64, 2, 3, &mut c));
    // The transposed product takes any number of rows, but not mismatched lengths.
    assert!(!gemm_tn(&a[..10], &b[..5], 5, 2, 3, &mut c[..15]));
    // Lengths that do not match the shape, and an empty inner dim.
    assert!(!gemm_nt(&a[..10], &b[..5], 5, 2, 3, &mut c[..15]));
    assert!(!gemm_nn(&[], &[], 5, 0, 3, &mut c[..15]));
    assert!(c.iter().all(|&v| v == 7.0));
}
