//! The packing-free kernels on AVX2 with FMA: 8-lane vectors, masked edges.

use std::arch::x86_64::{
    __m256, __m256i, _mm_add_ps, _mm_add_ss, _mm_cvtss_f32, _mm_movehl_ps, _mm_shuffle_ps,
    _mm256_castps256_ps128, _mm256_cmpgt_epi32, _mm256_extractf128_ps, _mm256_fmadd_ps,
    _mm256_loadu_ps, _mm256_maskload_ps, _mm256_maskstore_ps, _mm256_set1_epi32, _mm256_set1_ps,
    _mm256_setr_epi32, _mm256_setzero_ps, _mm256_storeu_ps,
};

use super::{AStrides, NnBlock};

/// The AVX-512 `nt` on AVX2: blocks of 3 rows of `A` by 3 rows of `B` (9 running sums, with
/// the loads 13 of the 16 registers), then the ragged edges one row at a time.
#[target_feature(enable = "avx2,fma")]
pub(super) fn nt(a: &[f32], b: &[f32], m: usize, k: usize, n: usize, c: &mut [f32]) {
    // As on AVX-512: a block of the weight's rows stays in L1 while every row block of
    // `A` passes over it.
    let mut j = 0;
    while j < n {
        let cols = (n - j).min(3);
        let mut i = 0;
        while i < m {
            let rows = (m - i).min(3);
            match (rows, cols) {
                (3, 3) => nt_block::<3, 3>(a, b, k, n, i, j, c),
                (3, _) => {
                    for jj in j..j + cols {
                        nt_block::<3, 1>(a, b, k, n, i, jj, c);
                    }
                }
                (_, 3) => {
                    for ii in i..i + rows {
                        nt_block::<1, 3>(a, b, k, n, ii, j, c);
                    }
                }
                _ => {
                    for ii in i..i + rows {
                        for jj in j..j + cols {
                            nt_block::<1, 1>(a, b, k, n, ii, jj, c);
                        }
                    }
                }
            }
            i += rows;
        }
        j += cols;
    }
}

/// `C[i..i+R, j..j+C]` as dot products of rows of `A` and `B` along `k`, 8 lanes at a time
/// with a masked tail, each summed across its lanes at the end.
#[target_feature(enable = "avx2,fma")]
#[allow(clippy::too_many_arguments)]
fn nt_block<const R: usize, const C: usize>(
    a: &[f32],
    b: &[f32],
    k: usize,
    ldc: usize,
    i: usize,
    j: usize,
    c: &mut [f32],
) {
    // Slicing checks the block's bounds once; the hot loop then reads through pointers at
    // offsets below `R * k` and `C * k`.
    let a_rows = &a[i * k..(i + R) * k];
    let b_rows = &b[j * k..(j + C) * k];
    let (ap, bp) = (a_rows.as_ptr(), b_rows.as_ptr());
    let mut acc = [[_mm256_setzero_ps(); C]; R];
    let full = k / 8 * 8;
    let mut p = 0;
    while p < full {
        let mut bv = [_mm256_setzero_ps(); C];
        for (cc, v) in bv.iter_mut().enumerate() {
            // SAFETY: `cc < C` and `p + 8 <= full <= k`, so the 8 elements from `cc * k + p`
            // lie inside `b_rows` (length `C * k`).
            *v = unsafe { _mm256_loadu_ps(bp.add(cc * k + p)) };
        }
        for (r, row_acc) in acc.iter_mut().enumerate() {
            // SAFETY: as above, inside `a_rows` (length `R * k`).
            let av = unsafe { _mm256_loadu_ps(ap.add(r * k + p)) };
            for (slot, &bvec) in row_acc.iter_mut().zip(&bv) {
                *slot = _mm256_fmadd_ps(av, bvec, *slot);
            }
        }
        p += 8;
    }
    if p < k {
        let len = k - p;
        let mask = lanes(len);
        let mut bv = [_mm256_setzero_ps(); C];
        for (cc, v) in bv.iter_mut().enumerate() {
            let start = cc * k + p;
            *v = load(&b_rows[start..start + len], mask);
        }
        for (r, row_acc) in acc.iter_mut().enumerate() {
            let start = r * k + p;
            let av = load(&a_rows[start..start + len], mask);
            for (slot, &bvec) in row_acc.iter_mut().zip(&bv) {
                *slot = _mm256_fmadd_ps(av, bvec, *slot);
            }
        }
    }
    for (r, row_acc) in acc.iter().enumerate() {
        let out = &mut c[(i + r) * ldc + j..(i + r) * ldc + j + C];
        for (o, &v) in out.iter_mut().zip(row_acc) {
            *o = sum_lanes(v);
        }
    }
}

/// The sum of the 8 lanes of `v`: the two halves added, then pairs within the half.
#[target_feature(enable = "avx2")]
#[inline]
fn sum_lanes(v: __m256) -> f32 {
    let half = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
    let pairs = _mm_add_ps(half, _mm_movehl_ps(half, half));
    _mm_cvtss_f32(_mm_add_ss(pairs, _mm_shuffle_ps::<0b01>(pairs, pairs)))
}

/// Rows of `B` per pass of [`nn`] (a `KC × 16` piece of a column panel, 8 KiB,
/// stays in L1 while every row block of `A` uses it).
const KC: usize = 128;

/// Rows of `A` per block of [`nn`]: 6 rows × 2 vectors are 12 running sums, with the
/// panel's 2 vectors and a broadcast 15 of the 16 registers.
const ROWS: usize = 6;

/// The AVX-512 `nn` on AVX2: column panels of 16 (then a masked remainder), `KC` rows of
/// `B` at a time, by blocks of 6 rows of `A`; the partial sums of `C` are stored and reloaded
/// between passes. Each element sums its products in the order of `p`, as every kernel here.
#[target_feature(enable = "avx2,fma")]
pub(super) fn nn(
    a: &[f32],
    a_strides: AStrides,
    b: &[f32],
    (m, k, n): (usize, usize, usize),
    c: &mut [f32],
) {
    let mut j = 0;
    while j < n {
        let width = (n - j).min(16);
        let mut p0 = 0;
        while p0 < k {
            let p1 = (p0 + KC).min(k);
            let mut i = 0;
            while i < m {
                let rows = (m - i).min(ROWS);
                let block = NnBlock {
                    i,
                    j,
                    width,
                    p0,
                    p1,
                };
                let a = (a, a_strides);
                // The last rows (4 of a 64-row attention tile) as one block too: one row at a
                // time keeps 2 running sums, too few to cover the multiply-add's latency.
                match rows {
                    ROWS => nn_block::<ROWS>(a, b, n, block, c),
                    5 => nn_block::<5>(a, b, n, block, c),
                    4 => nn_block::<4>(a, b, n, block, c),
                    3 => nn_block::<3>(a, b, n, block, c),
                    2 => nn_block::<2>(a, b, n, block, c),
                    _ => nn_block::<1>(a, b, n, block, c),
                }
                i += rows;
            }
            p0 = p1;
        }
        j += width;
    }
}

/// The AVX2 mask of the first `len` (at most 8) lanes: all bits set in each of them.
#[target_feature(enable = "avx2")]
fn lanes(len: usize) -> __m256i {
    let index = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    _mm256_cmpgt_epi32(_mm256_set1_epi32(len.min(8) as i32), index)
}

/// Loads `src` (1 to 8 elements; `mask` selects exactly that many low lanes), zeros in the
/// other lanes.
#[target_feature(enable = "avx2")]
#[inline]
fn load(src: &[f32], mask: __m256i) -> __m256 {
    if src.len() == 8 {
        // SAFETY: `src` holds 8 readable f32s; the load has no alignment requirement.
        unsafe { _mm256_loadu_ps(src.as_ptr()) }
    } else {
        // SAFETY: `mask` selects only the first `src.len()` lanes; masked-off lanes are
        // neither read nor allowed to fault, so only elements of `src` are touched.
        unsafe { _mm256_maskload_ps(src.as_ptr(), mask) }
    }
}

/// Stores the first `dst.len()` (1 to 8) lanes of `v` into `dst`; `mask` selects them.
#[target_feature(enable = "avx2")]
#[inline]
fn store(dst: &mut [f32], mask: __m256i, v: __m256) {
    if dst.len() == 8 {
        // SAFETY: `dst` holds 8 writable f32s.
        unsafe { _mm256_storeu_ps(dst.as_mut_ptr(), v) }
    } else {
        // SAFETY: the mask selects exactly the first `dst.len()` lanes, so only elements of
        // `dst` are written; masked-off lanes never fault.
        unsafe { _mm256_maskstore_ps(dst.as_mut_ptr(), mask, v) }
    }
}

/// `C[i..i+R, j..j+width]` (`width` ≤ 16: two 8-lane vectors, the second possibly partial or
/// empty) plus (from the second pass on) the sum over `p0..p1` of `A[i+r, p] · B[p, j..]`.
#[target_feature(enable = "avx2,fma")]
fn nn_block<const R: usize>(
    (a, a_strides): (&[f32], AStrides),
    b: &[f32],
    n: usize,
    block: NnBlock,
    c: &mut [f32],
) {
    let NnBlock {
        i,
        j,
        width,
        p0,
        p1,
    } = block;
    let lane_count = |v: usize| width.saturating_sub(v * 8).min(8);
    let counts = [lane_count(0), lane_count(1)];
    let masks = [lanes(counts[0]), lanes(counts[1])];
    // The first pass starts from zero, later ones from the partial sums in `C`.
    let mut acc = [[_mm256_setzero_ps(); 2]; R];
    if p0 > 0 {
        for (r, row_acc) in acc.iter_mut().enumerate() {
            let row = (i + r) * n + j;
            for (v, slot) in row_acc
                .iter_mut()
                .enumerate()
                .take_while(|&(v, _)| counts[v] > 0)
            {
                *slot = load(&c[row + v * 8..row + v * 8 + counts[v]], masks[v]);
            }
        }
    }
    // One bounds check per block, as on AVX-512: the last element of `A` the block reads
    // is `(i+R-1, p1-1)`, and rows `p0..p1` of the panel `[j, j+width)` of `B` end at
    // `(p1-1)·n + j + width - 1`.
    let AStrides {
        row: a_row,
        col: a_col,
    } = a_strides;
    let a_block = &a[..=(i + R - 1) * a_row + (p1 - 1) * a_col];
    let b_panel = &b[p0 * n + j..(p1 - 1) * n + j + width];
    let (ap, bp) = (a_block.as_ptr(), b_panel.as_ptr());
    if width == 16 {
        for p in p0..p1 {
            let offset = (p - p0) * n;
            // SAFETY: `offset + 16 <= (p1-1-p0)·n + 16 = b_panel.len()` as `p < p1`.
            let bv = unsafe {
                [
                    _mm256_loadu_ps(bp.add(offset)),
                    _mm256_loadu_ps(bp.add(offset + 8)),
                ]
            };
            for (r, row_acc) in acc.iter_mut().enumerate() {
                // SAFETY: `r < R` and `p < p1`: at most the offset of `(i+R-1, p1-1)`, the last
                // element of `a_block`.
                let av = _mm256_set1_ps(unsafe { *ap.add((i + r) * a_row + p * a_col) });
                row_acc[0] = _mm256_fmadd_ps(av, bv[0], row_acc[0]);
                row_acc[1] = _mm256_fmadd_ps(av, bv[1], row_acc[1]);
            }
        }
    } else {
        for p in p0..p1 {
            let offset = (p - p0) * n;
            let bv: [__m256; 2] = std::array::from_fn(|v| {
                if counts[v] == 0 {
                    return _mm256_setzero_ps();
                }
                // SAFETY: the mask selects the first `counts[v]` lanes from `offset + 8v`,
                // all inside row `p` of `b_panel` (`8v + counts[v] ≤ width`); masked-off
                // lanes are not read and cannot fault.
                unsafe { _mm256_maskload_ps(bp.add(offset + v * 8), masks[v]) }
            });
            for (r, row_acc) in acc.iter_mut().enumerate() {
                // SAFETY: as in the full-width loop.
                let av = _mm256_set1_ps(unsafe { *ap.add((i + r) * a_row + p * a_col) });
                row_acc[0] = _mm256_fmadd_ps(av, bv[0], row_acc[0]);
                row_acc[1] = _mm256_fmadd_ps(av, bv[1], row_acc[1]);
            }
        }
    }
    for (r, row_acc) in acc.iter().enumerate() {
        let row = (i + r) * n + j;
        for (v, &value) in row_acc
            .iter()
            .enumerate()
            .take_while(|&(v, _)| counts[v] > 0)
        {
            store(
                &mut c[row + v * 8..row + v * 8 + counts[v]],
                masks[v],
                value,
            );
        }
    }
}
