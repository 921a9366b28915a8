//! The packing-free kernels on AVX-512: 16-lane vectors, masked edges.

use std::arch::x86_64::{
    __m512, __mmask16, _mm512_fmadd_ps, _mm512_loadu_ps, _mm512_mask_storeu_ps,
    _mm512_maskz_loadu_ps, _mm512_reduce_add_ps, _mm512_set1_ps, _mm512_setzero_ps,
};

use super::{AStrides, NnBlock};

/// The mask of the first `len` (< 16 is the interesting case) lanes.
fn lanes(len: usize) -> __mmask16 {
    if len >= 16 {
        0xFFFF
    } else {
        ((1u32 << len) - 1) as __mmask16
    }
}

/// Blocks of 4 rows of `A` by 4 rows of `B`, then the ragged edges one row at a time.
#[target_feature(enable = "avx512f")]
pub(super) fn nt(a: &[f32], b: &[f32], m: usize, k: usize, n: usize, c: &mut [f32]) {
    // Outer loop over `B`'s rows: a 4-row block of the weight (16 KiB at k = 1024) stays in
    // L1 while every row block of `A` (in L2) passes over it, so the weight streams from
    // memory once.
    let mut j = 0;
    while j < n {
        let cols = (n - j).min(4);
        let mut i = 0;
        while i < m {
            let rows = (m - i).min(4);
            match (rows, cols) {
                (4, 4) => nt_block::<4, 4>(a, b, k, n, i, j, c),
                (4, _) => {
                    for jj in j..j + cols {
                        nt_block::<4, 1>(a, b, k, n, i, jj, c);
                    }
                }
                (_, 4) => {
                    for ii in i..i + rows {
                        nt_block::<1, 4>(a, b, k, n, ii, j, c);
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

/// `C[i..i+R, j..j+C]` as dot products of rows of `A` and `B` along `k`, 16 lanes at a time
/// with a masked tail.
#[target_feature(enable = "avx512f")]
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
    let mut acc = [[_mm512_setzero_ps(); C]; R];
    let full = k / 16 * 16;
    let mut p = 0;
    while p < full {
        let mut bv = [_mm512_setzero_ps(); C];
        for (cc, v) in bv.iter_mut().enumerate() {
            // SAFETY: `cc < C` and `p + 16 <= full <= k`, so the 16 elements from
            // `cc * k + p` lie inside `b_rows` (length `C * k`).
            *v = unsafe { _mm512_loadu_ps(bp.add(cc * k + p)) };
        }
        for (r, row_acc) in acc.iter_mut().enumerate() {
            // SAFETY: as above, inside `a_rows` (length `R * k`).
            let av = unsafe { _mm512_loadu_ps(ap.add(r * k + p)) };
            for (slot, &bvec) in row_acc.iter_mut().zip(&bv) {
                *slot = _mm512_fmadd_ps(av, bvec, *slot);
            }
        }
        p += 16;
    }
    if p < k {
        let len = k - p;
        let mask = lanes(len);
        let mut bv = [_mm512_setzero_ps(); C];
        for (cc, v) in bv.iter_mut().enumerate() {
            let start = cc * k + p;
            *v = load(&b_rows[start..start + len], mask);
        }
        for (r, row_acc) in acc.iter_mut().enumerate() {
            let start = r * k + p;
            let av = load(&a_rows[start..start + len], mask);
            for (slot, &bvec) in row_acc.iter_mut().zip(&bv) {
                *slot = _mm512_fmadd_ps(av, bvec, *slot);
            }
        }
    }
    for (r, row_acc) in acc.iter().enumerate() {
        let out = &mut c[(i + r) * ldc + j..(i + r) * ldc + j + C];
        for (o, &v) in out.iter_mut().zip(row_acc) {
            *o = _mm512_reduce_add_ps(v);
        }
    }
}

/// Loads `src` (1 to 16 elements; `mask` has exactly that many low bits set) into a vector,
/// zeros in the other lanes.
#[target_feature(enable = "avx512f")]
#[inline]
fn load(src: &[f32], mask: __mmask16) -> __m512 {
    if src.len() == 16 {
        // SAFETY: `src` holds 16 readable f32s; the load has no alignment requirement.
        unsafe { _mm512_loadu_ps(src.as_ptr()) }
    } else {
        // SAFETY: `mask` selects only the first `src.len()` lanes, and masked-off lanes are
        // neither read nor allowed to fault, so only elements of `src` are touched.
        unsafe { _mm512_maskz_loadu_ps(mask, src.as_ptr()) }
    }
}

/// Stores the first `dst.len()` (1 to 16) lanes of `v` into `dst`.
#[target_feature(enable = "avx512f")]
#[inline]
fn store(dst: &mut [f32], v: __m512) {
    // SAFETY: the mask selects exactly the first `dst.len()` lanes (at most 16), so only
    // elements of `dst` are written; masked-off lanes never fault.
    unsafe { _mm512_mask_storeu_ps(dst.as_mut_ptr(), lanes(dst.len()), v) }
}

/// Rows of `B` per pass of [`nn`]: a `KC × 64` piece of a column panel (16 KiB at
/// `KC = 64`) stays in L2 while every row block of `A` uses it. Without this, the rows of a
/// panel, `n` floats apart (4 KiB for n = 1024), all map to the same few cache sets, and the
/// panel fell out of cache between row blocks.
const KC: usize = 64;

/// Column panels of 64 (then 32, then 16, then a masked remainder), `KC` rows of `B` at a
/// time, by blocks of 4 rows of `A` (8 for a 32-wide panel); the partial sums of `C` are
/// stored and reloaded between passes.
///
/// A 32-wide panel is a product with a head of width 32 on its output side (the attention's
/// `P·V` and the gradients `dS·K`, `dSᵀ·Q`, `Pᵀ·dO` at medium's `D = 32`). It takes 8 rows
/// at a time: 16 running sums, as the 64-wide panel's 4 rows keep, where 16-wide panels of 4
/// rows kept 4, too few to cover the multiply-add's latency, with a broadcast per
/// multiply-add.
#[target_feature(enable = "avx512f")]
pub(super) fn nn(
    a: &[f32],
    a_strides: AStrides,
    b: &[f32],
    (m, k, n): (usize, usize, usize),
    c: &mut [f32],
) {
    let mut j = 0;
    while j < n {
        let width = if n - j >= 64 {
            64
        } else if n - j >= 32 {
            32
        } else {
            (n - j).min(16)
        };
        let row_block = if width == 32 { 8 } else { 4 };
        let mut p0 = 0;
        while p0 < k {
            let p1 = (p0 + KC).min(k);
            let mut i = 0;
            while i < m {
                let rows = (m - i).min(row_block);
                let block = NnBlock {
                    i,
                    j,
                    width,
                    p0,
                    p1,
                };
                let a = (a, a_strides);
                match (rows, width) {
                    (8, 32) => nn_block::<8, 2>(a, b, n, block, c),
                    (_, 32) => {
                        for ii in i..i + rows {
                            nn_block::<1, 2>(a, b, n, NnBlock { i: ii, ..block }, c);
                        }
                    }
                    (4, 64) => nn_block::<4, 4>(a, b, n, block, c),
                    (4, _) => nn_block::<4, 1>(a, b, n, block, c),
                    (_, 64) => {
                        for ii in i..i + rows {
                            nn_block::<1, 4>(a, b, n, NnBlock { i: ii, ..block }, c);
                        }
                    }
                    _ => {
                        for ii in i..i + rows {
                            nn_block::<1, 1>(a, b, n, NnBlock { i: ii, ..block }, c);
                        }
                    }
                }
                i += rows;
            }
            p0 = p1;
        }
        j += width;
    }
}

/// `C[i..i+R, j..j+width]` (`width` = 16·V, or less than 16 with V = 1) plus (from the
/// second pass on) the sum over `p0..p1` of `A[i+r, p] · B[p, j..j+width]`.
#[target_feature(enable = "avx512f")]
fn nn_block<const R: usize, const V: usize>(
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
    let lane_count = |v: usize| width.saturating_sub(v * 16).min(16);
    let masks: [__mmask16; V] = std::array::from_fn(|v| lanes(lane_count(v)));
    // The first pass starts from zero, later ones from the partial sums in `C`.
    let mut acc = [[_mm512_setzero_ps(); V]; R];
    if p0 > 0 {
        for (r, row_acc) in acc.iter_mut().enumerate() {
            let row = (i + r) * n + j;
            for (v, slot) in row_acc.iter_mut().enumerate() {
                let len = lane_count(v);
                *slot = load(&c[row + v * 16..row + v * 16 + len], masks[v]);
            }
        }
    }
    // One bounds check per block: the elements `(i..i+R, p0..p1)` of `A`, the last of which
    // (the largest offset, as both strides are non-negative) is `(i+R-1, p1-1)`, and rows
    // `p0..p1` of the panel `[j, j+width)` of `B`, whose last element is at
    // `(p1-1)·n + j + width - 1`.
    let AStrides {
        row: a_row,
        col: a_col,
    } = a_strides;
    let a_block = &a[..=(i + R - 1) * a_row + (p1 - 1) * a_col];
    let b_panel = &b[p0 * n + j..(p1 - 1) * n + j + width];
    let (ap, bp) = (a_block.as_ptr(), b_panel.as_ptr());
    let full_vectors = width == 16 * V;
    for p in p0..p1 {
        let mut bv = [_mm512_setzero_ps(); V];
        for (v, slot) in bv.iter_mut().enumerate() {
            let offset = (p - p0) * n + v * 16;
            *slot = if full_vectors {
                // SAFETY: `offset + 16 <= (p1-1-p0)·n + 16·V = b_panel.len()` as `p < p1`
                // and `v < V`, so the 16 elements are inside `b_panel`.
                unsafe { _mm512_loadu_ps(bp.add(offset)) }
            } else {
                // SAFETY: the mask selects the first `width - 16v` (< 16) lanes, all inside
                // `b_panel` for row `p`; masked-off lanes are not read and cannot fault.
                unsafe { _mm512_maskz_loadu_ps(masks[v], bp.add(offset)) }
            };
        }
        for (r, row_acc) in acc.iter_mut().enumerate() {
            // SAFETY: `r < R` and `p < p1`, so the offset is at most that of `(i+R-1, p1-1)`,
            // the last element of `a_block`.
            let av = _mm512_set1_ps(unsafe { *ap.add((i + r) * a_row + p * a_col) });
            for (slot, &bvec) in row_acc.iter_mut().zip(&bv) {
                *slot = _mm512_fmadd_ps(av, bvec, *slot);
            }
        }
    }
    for (r, row_acc) in acc.iter().enumerate() {
        let row = (i + r) * n + j;
        for (v, &value) in row_acc.iter().enumerate() {
            let len = lane_count(v);
            store(&mut c[row + v * 16..row + v * 16 + len], value);
        }
    }
}
