//! Packing-free f32 GEMM kernels for products with few rows: a `Linear` layer on a small
//! batch (`[32, 1024] · [1024, 1024]ᵀ` in the FSDP benchmark).
//!
//! matrixmultiply copies ("packs") both operands into panel order before its micro-kernel
//! runs. That pays off when each packed panel is reused by many rows; with 32 rows and a
//! 1024 × 1024 weight it is not: a profile of the benchmark's single-rank step showed 25% of
//! the time in packing against 23% in the multiply itself. These kernels read both operands
//! where they lie, keep a block of 4 × 4 (or 4 × 64) results in AVX-512 registers and touch
//! every weight element once per block of 4 rows.
//!
//! Three shapes, all over row-major, contiguous operands:
//! - [`gemm_nt`]: `C[m, n] = A[m, k] · B[n, k]ᵀ` (forward: `x · Wᵀ`), dot products along `k`;
//! - [`gemm_nn`]: `C[m, n] = A[m, k] · B[k, n]` (input gradient: `dy · W`), rows of `B` scaled
//!   and summed;
//! - [`gemm_tn`]: `C[m, n] = A[k, m]ᵀ · B[k, n]`, the same kernel reading `A` down its columns
//!   (each element of `A` is broadcast on its own, so no transposed copy is needed).
//!
//! With AVX-512F they run on 16-lane vectors, with AVX2 and FMA on 8-lane ones. Each entry point
//! returns `false`, doing nothing, when the CPU lacks its kernel, the shape is outside the
//! kernels' range (an empty dim, or for `nt` and `nn` `m` ≥ [`MAX_ROWS`]) or a slice length
//! does not match the shape; the caller then uses the general GEMM.

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::{
    __m256, __m256i, __m512, __mmask16, _mm_add_ps, _mm_add_ss, _mm_cvtss_f32, _mm_movehl_ps,
    _mm_shuffle_ps, _mm256_castps256_ps128, _mm256_cmpgt_epi32, _mm256_extractf128_ps,
    _mm256_fmadd_ps, _mm256_loadu_ps, _mm256_maskload_ps, _mm256_maskstore_ps, _mm256_set1_epi32,
    _mm256_set1_ps, _mm256_setr_epi32, _mm256_setzero_ps, _mm256_storeu_ps, _mm512_fmadd_ps,
    _mm512_loadu_ps, _mm512_mask_storeu_ps, _mm512_maskz_loadu_ps, _mm512_reduce_add_ps,
    _mm512_set1_ps, _mm512_setzero_ps,
};

/// Products with at least this many rows go to the packing GEMM, whose packed panels are
/// reused often enough there to pay for themselves (and which splits rows over threads).
pub(crate) const MAX_ROWS: usize = 64;

/// The kernels a CPU runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kernels {
    /// AVX-512F: 16-lane vectors.
    Avx512,
    /// AVX2 with FMA: 8-lane vectors.
    Avx2,
    /// Neither: every product is declined.
    None,
}

impl Kernels {
    /// This CPU's (`std` caches the CPUID query).
    pub(crate) fn detect() -> Self {
        #[cfg(target_arch = "x86_64")]
        {
            use std::arch::is_x86_feature_detected as has;
            if has!("avx512f") {
                return Self::Avx512;
            }
            if has!("avx2") && has!("fma") {
                return Self::Avx2;
            }
        }
        Self::None
    }
}

/// Whether the kernels run on this CPU (what tests expect of them).
#[cfg(test)]
pub(crate) fn available() -> bool {
    Kernels::detect() != Kernels::None
}

/// Whether `(m, k, n)` with these slice lengths is a product the kernels take.
fn fits(m: usize, k: usize, n: usize, a: usize, b: usize, c: usize) -> bool {
    m < MAX_ROWS && fits_any_rows(m, k, n, a, b, c)
}

/// [`fits`] without the bound on the rows (the kernels take any number; the bound is where
/// the packing GEMM starts to pay for a `Linear`).
fn fits_any_rows(m: usize, k: usize, n: usize, a: usize, b: usize, c: usize) -> bool {
    let sizes_ok = m > 0 && k > 0 && n > 0;
    sizes_ok
        && m.checked_mul(k) == Some(a)
        && k.checked_mul(n) == Some(b)
        && m.checked_mul(n) == Some(c)
}

/// `C = A · Bᵀ` for row-major `A[m, k]`, `B[n, k]`, `C[m, n]` (overwritten). Returns whether
/// it ran (see the module docs for when it declines).
pub(crate) fn gemm_nt(a: &[f32], b: &[f32], m: usize, k: usize, n: usize, c: &mut [f32]) -> bool {
    if !fits(m, k, n, a.len(), b.len(), c.len()) {
        return false;
    }
    nt_on(Kernels::detect(), a, b, (m, k, n), c)
}

/// [`gemm_nt`] on `kernels` (which must be this CPU's or narrower); the lengths must match
/// the shape. Returns whether it ran.
#[cfg_attr(not(target_arch = "x86_64"), allow(unused_variables))]
fn nt_on(
    kernels: Kernels,
    a: &[f32],
    b: &[f32],
    shape: (usize, usize, usize),
    c: &mut [f32],
) -> bool {
    let (m, k, n) = shape;
    #[cfg(target_arch = "x86_64")]
    match kernels {
        Kernels::Avx512 => {
            // SAFETY: AVX-512F is present (`kernels` is this CPU's or narrower), which is
            // all the function's `target_feature` needs; the caller checked the lengths.
            unsafe { nt_avx512(a, b, m, k, n, c) };
            return true;
        }
        Kernels::Avx2 => {
            // SAFETY: AVX2 and FMA are present, as above.
            unsafe { nt_avx2(a, b, m, k, n, c) };
            return true;
        }
        Kernels::None => {}
    }
    false
}

/// `C = A · B` for row-major `A[m, k]`, `B[k, n]`, `C[m, n]` (overwritten). Returns whether it
/// ran (see the module docs for when it declines).
pub(crate) fn gemm_nn(a: &[f32], b: &[f32], m: usize, k: usize, n: usize, c: &mut [f32]) -> bool {
    if !fits(m, k, n, a.len(), b.len(), c.len()) {
        return false;
    }
    nn_on(
        Kernels::detect(),
        a,
        AStrides { row: k, col: 1 },
        b,
        (m, k, n),
        c,
    )
}

/// `C = Aᵀ · B` for row-major `A[k, m]`, `B[k, n]`, `C[m, n]` (overwritten), for any `m`
/// (the tiled attention's tiles: its caller knows the sizes). Returns whether it ran (see the
/// module docs for when it declines).
pub(crate) fn gemm_tn(a: &[f32], b: &[f32], m: usize, k: usize, n: usize, c: &mut [f32]) -> bool {
    // `fits_any_rows` checks `a.len() == m · k`, which is `k · m`.
    if !fits_any_rows(m, k, n, a.len(), b.len(), c.len()) {
        return false;
    }
    nn_on(
        Kernels::detect(),
        a,
        AStrides { row: 1, col: m },
        b,
        (m, k, n),
        c,
    )
}

/// `C = A · B` with `A` read through `a_strides`, on `kernels` (which must be this CPU's or
/// narrower); the lengths must match the shape. Returns whether it ran.
#[cfg_attr(not(target_arch = "x86_64"), allow(unused_variables))]
fn nn_on(
    kernels: Kernels,
    a: &[f32],
    a_strides: AStrides,
    b: &[f32],
    shape: (usize, usize, usize),
    c: &mut [f32],
) -> bool {
    #[cfg(target_arch = "x86_64")]
    match kernels {
        Kernels::Avx512 => {
            // SAFETY: AVX-512F is present (`kernels` is this CPU's or narrower), which is
            // all the function's `target_feature` needs; the caller checked the lengths.
            unsafe { nn_avx512(a, a_strides, b, shape, c) };
            return true;
        }
        Kernels::Avx2 => {
            // SAFETY: AVX2 and FMA are present, as above.
            unsafe { nn_avx2(a, a_strides, b, shape, c) };
            return true;
        }
        Kernels::None => {}
    }
    false
}

/// Where element `(i, p)` of the left operand lies in its slice: at `i · row + p · col`
/// (`(k, 1)` for a row-major `A[m, k]`, `(1, m)` for `A` given as its transpose `[k, m]`).
#[derive(Clone, Copy)]
struct AStrides {
    row: usize,
    col: usize,
}

/// The mask of the first `len` (< 16 is the interesting case) lanes.
#[cfg(target_arch = "x86_64")]
fn lanes(len: usize) -> __mmask16 {
    if len >= 16 {
        0xFFFF
    } else {
        ((1u32 << len) - 1) as __mmask16
    }
}

/// Blocks of 4 rows of `A` by 4 rows of `B`, then the ragged edges one row at a time.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
fn nt_avx512(a: &[f32], b: &[f32], m: usize, k: usize, n: usize, c: &mut [f32]) {
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
#[cfg(target_arch = "x86_64")]
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
#[cfg(target_arch = "x86_64")]
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
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[inline]
fn store(dst: &mut [f32], v: __m512) {
    // SAFETY: the mask selects exactly the first `dst.len()` lanes (at most 16), so only
    // elements of `dst` are written; masked-off lanes never fault.
    unsafe { _mm512_mask_storeu_ps(dst.as_mut_ptr(), lanes(dst.len()), v) }
}

/// Rows of `B` per pass of [`nn_avx512`]: a `KC × 64` piece of a column panel (16 KiB at
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
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
fn nn_avx512(
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

/// Which piece of `C` one [`nn_block`] call updates: rows from `i`, columns `j..j+width`,
/// summing over `p0..p1`.
#[cfg(target_arch = "x86_64")]
#[derive(Clone, Copy)]
struct NnBlock {
    i: usize,
    j: usize,
    width: usize,
    p0: usize,
    p1: usize,
}

/// `C[i..i+R, j..j+width]` (`width` = 16·V, or less than 16 with V = 1) plus (from the
/// second pass on) the sum over `p0..p1` of `A[i+r, p] · B[p, j..j+width]`.
#[cfg(target_arch = "x86_64")]
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

/// [`nt_avx512`] on AVX2: blocks of 3 rows of `A` by 3 rows of `B` (9 running sums, with
/// the loads 13 of the 16 registers), then the ragged edges one row at a time.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn nt_avx2(a: &[f32], b: &[f32], m: usize, k: usize, n: usize, c: &mut [f32]) {
    // As in `nt_avx512`: a block of the weight's rows stays in L1 while every row block of
    // `A` passes over it.
    let mut j = 0;
    while j < n {
        let cols = (n - j).min(3);
        let mut i = 0;
        while i < m {
            let rows = (m - i).min(3);
            match (rows, cols) {
                (3, 3) => nt_block_avx2::<3, 3>(a, b, k, n, i, j, c),
                (3, _) => {
                    for jj in j..j + cols {
                        nt_block_avx2::<3, 1>(a, b, k, n, i, jj, c);
                    }
                }
                (_, 3) => {
                    for ii in i..i + rows {
                        nt_block_avx2::<1, 3>(a, b, k, n, ii, j, c);
                    }
                }
                _ => {
                    for ii in i..i + rows {
                        for jj in j..j + cols {
                            nt_block_avx2::<1, 1>(a, b, k, n, ii, jj, c);
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
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
#[allow(clippy::too_many_arguments)]
fn nt_block_avx2<const R: usize, const C: usize>(
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
        let mask = lanes_avx2(len);
        let mut bv = [_mm256_setzero_ps(); C];
        for (cc, v) in bv.iter_mut().enumerate() {
            let start = cc * k + p;
            *v = load_avx2(&b_rows[start..start + len], mask);
        }
        for (r, row_acc) in acc.iter_mut().enumerate() {
            let start = r * k + p;
            let av = load_avx2(&a_rows[start..start + len], mask);
            for (slot, &bvec) in row_acc.iter_mut().zip(&bv) {
                *slot = _mm256_fmadd_ps(av, bvec, *slot);
            }
        }
    }
    for (r, row_acc) in acc.iter().enumerate() {
        let out = &mut c[(i + r) * ldc + j..(i + r) * ldc + j + C];
        for (o, &v) in out.iter_mut().zip(row_acc) {
            *o = sum_lanes_avx2(v);
        }
    }
}

/// The sum of the 8 lanes of `v`: the two halves added, then pairs within the half.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
#[inline]
fn sum_lanes_avx2(v: __m256) -> f32 {
    let half = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
    let pairs = _mm_add_ps(half, _mm_movehl_ps(half, half));
    _mm_cvtss_f32(_mm_add_ss(pairs, _mm_shuffle_ps::<0b01>(pairs, pairs)))
}

/// Rows of `B` per pass of [`nn_avx2`] (a `KC_AVX2 × 16` piece of a column panel, 8 KiB,
/// stays in L1 while every row block of `A` uses it).
const KC_AVX2: usize = 128;

/// Rows of `A` per block of [`nn_avx2`]: 6 rows × 2 vectors are 12 running sums, with the
/// panel's 2 vectors and a broadcast 15 of the 16 registers.
const ROWS_AVX2: usize = 6;

/// [`nn_avx512`] on AVX2: column panels of 16 (then a masked remainder), `KC_AVX2` rows of
/// `B` at a time, by blocks of 6 rows of `A`; the partial sums of `C` are stored and reloaded
/// between passes. Each element sums its products in the order of `p`, as every kernel here.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn nn_avx2(
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
            let p1 = (p0 + KC_AVX2).min(k);
            let mut i = 0;
            while i < m {
                let rows = (m - i).min(ROWS_AVX2);
                let block = NnBlock {
                    i,
                    j,
                    width,
                    p0,
                    p1,
                };
                let a = (a, a_strides);
                if rows == ROWS_AVX2 {
                    nn_block_avx2::<ROWS_AVX2>(a, b, n, block, c);
                } else {
                    for ii in i..i + rows {
                        nn_block_avx2::<1>(a, b, n, NnBlock { i: ii, ..block }, c);
                    }
                }
                i += rows;
            }
            p0 = p1;
        }
        j += width;
    }
}

/// The AVX2 mask of the first `len` (at most 8) lanes: all bits set in each of them.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn lanes_avx2(len: usize) -> __m256i {
    let index = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    _mm256_cmpgt_epi32(_mm256_set1_epi32(len.min(8) as i32), index)
}

/// Loads `src` (1 to 8 elements; `mask` selects exactly that many low lanes), zeros in the
/// other lanes.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
#[inline]
fn load_avx2(src: &[f32], mask: __m256i) -> __m256 {
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
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
#[inline]
fn store_avx2(dst: &mut [f32], mask: __m256i, v: __m256) {
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
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn nn_block_avx2<const R: usize>(
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
    let masks = [lanes_avx2(counts[0]), lanes_avx2(counts[1])];
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
                *slot = load_avx2(&c[row + v * 8..row + v * 8 + counts[v]], masks[v]);
            }
        }
    }
    // One bounds check per block, as in `nn_block`: the last element of `A` the block reads
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
            store_avx2(
                &mut c[row + v * 8..row + v * 8 + counts[v]],
                masks[v],
                value,
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Deterministic values in [-1, 1).
    fn values(len: usize, seed: u64) -> Vec<f32> {
        (0..len as u64)
            .map(|i| {
                let x = (i.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ seed)
                    .wrapping_mul(0xBF58_476D_1CE4_E5B9);
                ((x >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
            })
            .collect()
    }

    /// `A · op(B)` in f64, row-major.
    fn reference(
        a: &[f32],
        b: &[f32],
        m: usize,
        k: usize,
        n: usize,
        b_transposed: bool,
    ) -> Vec<f64> {
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
}
