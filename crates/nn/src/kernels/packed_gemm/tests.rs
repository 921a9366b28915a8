//! The packed GEMM against an f64 reference, on every micro-kernel the CPU runs.

use super::*;

/// `value(seed, index)`: a deterministic spread of small values with both signs.
fn value(seed: usize, index: usize) -> f32 {
    let h = (index.wrapping_mul(2_654_435_761) ^ seed.wrapping_mul(40_503)) % 2001;
    (h as f32 - 1000.0) / 1000.0
}

/// The kernels this CPU runs, and `Baseline`, which every GEMM declines.
fn kernels() -> Vec<VectorIsa> {
    match widest() {
        VectorIsa::Avx512 => vec![VectorIsa::Avx512, VectorIsa::Avx2, VectorIsa::Baseline],
        VectorIsa::Avx2 => vec![VectorIsa::Avx2, VectorIsa::Baseline],
        VectorIsa::Baseline => vec![VectorIsa::Baseline],
    }
}

/// [`gemm_on`] `isa` on slices (dimensions at least 1, strides non-negative), after
/// asserting that the last element each operand's strides address lies inside its slice
/// (and that a bias holds `n` values).
#[allow(clippy::too_many_arguments)]
fn gemm_on_slices(
    isa: VectorIsa,
    (m, k, n): (usize, usize, usize),
    a: &[f32],
    (a_row, a_col): (usize, usize),
    b: &[f32],
    (b_row, b_col): (usize, usize),
    beta: f32,
    c: &mut [f32],
    c_row: usize,
    bias: Option<&[f32]>,
) -> bool {
    assert!((m - 1) * a_row + (k - 1) * a_col < a.len());
    assert!(bias.is_none_or(|bias| bias.len() == n));
    assert!((k - 1) * b_row + (n - 1) * b_col < b.len());
    assert!((m - 1) * c_row + n <= c.len() && c_row >= n);
    let strided = |x: &[f32], row: usize, col: usize| Strided {
        start: x.as_ptr(),
        row: row as isize,
        col: col as isize,
    };
    // SAFETY: with non-negative strides the largest offset addressed in each operand is
    // its last element's, checked above to lie inside the slice; rows of `C` of stride
    // `c_row ≥ n` do not overlap, and `c` is a `&mut` apart from `a` and `b`; `isa` is
    // one of `kernels()`, which the CPU runs.
    unsafe {
        gemm_on(
            isa,
            Product {
                m,
                k,
                n,
                a: strided(a, a_row, a_col),
                b: strided(b, b_row, b_col),
                beta,
                c: c.as_mut_ptr(),
                c_row_stride: c_row as isize,
                bias: bias.map(<[f32]>::as_ptr),
            },
        )
    }
}

/// One product through [`gemm`], `A` and `B` stored transposed or not, `C` a window of
/// a wider buffer whose other elements must stay untouched; checked against an f64 sum on
/// every kernel the CPU runs (`Baseline` must decline, leaving `C` as it was).
fn check(m: usize, k: usize, n: usize, a_t: bool, b_t: bool, beta: f32) {
    for isa in kernels() {
        check_on(isa, m, k, n, a_t, b_t, beta);
    }
}

fn check_on(isa: VectorIsa, m: usize, k: usize, n: usize, a_t: bool, b_t: bool, beta: f32) {
    let a: Vec<f32> = (0..m * k).map(|i| value(1, i)).collect();
    let b: Vec<f32> = (0..k * n).map(|i| value(2, i)).collect();
    let a_el = |i: usize, p: usize| if a_t { a[p * m + i] } else { a[i * k + p] };
    let b_el = |p: usize, j: usize| if b_t { b[j * k + p] } else { b[p * n + j] };
    let stride = n + 3;
    let sentinel = 7.5f32;
    let mut c: Vec<f32> = (0..m * stride)
        .map(|i| {
            if i % stride < n {
                value(3, i)
            } else {
                sentinel
            }
        })
        .collect();
    let old = c.clone();
    let a_strides = if a_t { (1, m) } else { (k, 1) };
    let b_strides = if b_t { (1, k) } else { (n, 1) };
    let ran = gemm_on_slices(
        isa,
        (m, k, n),
        &a,
        a_strides,
        &b,
        b_strides,
        beta,
        &mut c,
        stride,
        None,
    );
    assert_eq!(ran, isa != VectorIsa::Baseline, "{isa:?}");
    if !ran {
        assert_eq!(c, old, "a declined product wrote C");
        return;
    }
    for i in 0..m {
        for j in 0..stride {
            let got = c[i * stride + j];
            if j >= n {
                assert_eq!(got, sentinel, "({i}, {j}) outside C was written");
                continue;
            }
            let dot: f64 = (0..k)
                .map(|p| f64::from(a_el(i, p)) * f64::from(b_el(p, j)))
                .sum();
            let want = dot + f64::from(beta) * f64::from(old[i * stride + j]);
            let tol = 1e-5 * (k as f64).sqrt() * 4.0 + 1e-6;
            assert!(
                (f64::from(got) - want).abs() <= tol,
                "{isa:?} m {m} k {k} n {n} a_t {a_t} b_t {b_t} beta {beta}: ({i}, {j}) = {got}, \
                 want {want}"
            );
        }
    }
}

#[test]
fn products_match_an_f64_reference_on_ragged_shapes_and_every_layout() {
    // Ragged against the tiles (12 × 32, 6 × 16), the k-blocks (384, 256) and the packed
    // column blocks (480, 240), and whole tiles over several k-blocks (24 × 800: a
    // row-major A then has no packed tail panel); every stored layout of A and B; the
    // three epilogues.
    let shapes = [
        (7, 257, 241),
        (1, 1, 1),
        (11, 7, 15),
        (12, 384, 32),
        (13, 385, 33),
        (25, 800, 481),
        (24, 800, 64),
        (30, 3, 1000),
    ];
    for &(m, k, n) in &shapes {
        for (a_t, b_t) in [(false, false), (false, true), (true, false), (true, true)] {
            for beta in [0.0, 1.0, 0.5] {
                check(m, k, n, a_t, b_t, beta);
            }
        }
    }
}

#[test]
fn a_fused_bias_is_bitwise_a_separate_pass() {
    // Ragged tiles and column blocks, one and several k-blocks (the bias must go on after
    // the last), overwrite and accumulate, B stored either way (a `Linear` stores it
    // transposed).
    let shapes = [
        (7, 257, 241),
        (13, 800, 33),
        (24, 192, 64),
        (1, 1, 1),
        (30, 3, 1000),
    ];
    for isa in kernels() {
        for &(m, k, n) in &shapes {
            for (b_t, beta) in [(true, 0.0), (false, 0.0), (true, 1.0)] {
                let a: Vec<f32> = (0..m * k).map(|i| value(1, i)).collect();
                let b: Vec<f32> = (0..k * n).map(|i| value(2, i)).collect();
                let bias: Vec<f32> = (0..n).map(|j| value(4, j) * 3.0).collect();
                let b_strides = if b_t { (1, k) } else { (n, 1) };
                let stride = n + 2;
                let start: Vec<f32> = (0..m * stride).map(|i| value(3, i)).collect();
                let (mut fused, mut separate) = (start.clone(), start.clone());
                let run = |c: &mut [f32], bias: Option<&[f32]>| {
                    let shape = (m, k, n);
                    gemm_on_slices(isa, shape, &a, (k, 1), &b, b_strides, beta, c, stride, bias)
                };
                let ran = run(&mut fused, Some(&bias));
                assert_eq!(ran, isa != VectorIsa::Baseline, "{isa:?}");
                if !ran {
                    assert_eq!(fused, start, "a declined product wrote C");
                    continue;
                }
                assert!(run(&mut separate, None));
                for row in separate.chunks_exact_mut(stride) {
                    for (x, &add) in row.iter_mut().zip(&bias) {
                        *x += add;
                    }
                }
                for (index, (got, want)) in fused.iter().zip(&separate).enumerate() {
                    assert_eq!(
                        got.to_bits(),
                        want.to_bits(),
                        "{isa:?} m {m} k {k} n {n} b_t {b_t} beta {beta}: element {index}"
                    );
                }
            }
        }
    }
}

#[test]
fn tall_products_cross_the_packed_row_block() {
    let rows = AVX512.mc.max(AVX2.mc) + 13;
    check(rows, 5, 40, false, true, 0.0);
    check(rows, 5, 40, true, false, 1.0);
}

#[test]
fn fully_strided_operands_take_the_general_packing_path() {
    // A read through row stride 2·k and column stride 2 (every other element of a wider
    // buffer): neither stride is 1, so `pack`'s element-by-element branch runs.
    let (m, k, n) = (14, 9, 35);
    let a: Vec<f32> = (0..4 * m * k).map(|i| value(4, i)).collect();
    let b: Vec<f32> = (0..k * n).map(|i| value(5, i)).collect();
    for isa in kernels() {
        let mut c = vec![0.0f32; m * n];
        let ran = gemm_on_slices(
            isa,
            (m, k, n),
            &a,
            (2 * k, 2),
            &b,
            (n, 1),
            0.0,
            &mut c,
            n,
            None,
        );
        assert_eq!(ran, isa != VectorIsa::Baseline, "{isa:?}");
        if !ran {
            continue;
        }
        for i in 0..m {
            for j in 0..n {
                let want: f64 = (0..k)
                    .map(|p| f64::from(a[i * 2 * k + 2 * p]) * f64::from(b[p * n + j]))
                    .sum();
                assert!(
                    (f64::from(c[i * n + j]) - want).abs() < 1e-5,
                    "{isa:?} ({i}, {j})"
                );
            }
        }
    }
}

#[test]
fn an_empty_dimension_is_declined() {
    let mut c = [0.0f32; 1];
    let one = [1.0f32];
    let s = Strided {
        start: one.as_ptr(),
        row: 1,
        col: 1,
    };
    let product = Product {
        m: 1,
        k: 0,
        n: 1,
        a: s,
        b: s,
        beta: 0.0,
        c: c.as_mut_ptr(),
        c_row_stride: 1,
        bias: Some(one.as_ptr()),
    };
    // SAFETY: nothing is addressed when a dimension is zero.
    let ran = unsafe { gemm(product) };
    assert!(!ran);
    assert_eq!(c[0], 0.0);
}
