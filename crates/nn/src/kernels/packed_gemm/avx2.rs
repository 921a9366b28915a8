//! The AVX2+FMA micro-kernel of the packed GEMM: a 6 × 16 tile of `C` in 12 of the 16 vector
//! registers (see the parent module), and the 8 × 16 transpose that packs operands stored
//! along `k`.

use std::arch::x86_64::{
    __m256, _MM_HINT_T0, _mm_prefetch, _mm256_add_ps, _mm256_fmadd_ps, _mm256_loadu_ps,
    _mm256_permute2f128_ps, _mm256_set1_ps, _mm256_setzero_ps, _mm256_shuffle_ps, _mm256_storeu_ps,
    _mm256_unpackhi_ps, _mm256_unpacklo_ps,
};

use super::{Epilogue, PREFETCH_STEPS, RowsOfA, Tile};

/// Rows of the micro-tile.
pub(super) const MR: usize = 6;
/// Columns of the micro-tile: two 8-lane vectors.
pub(super) const NR: usize = 16;

/// Writes 8 rows of 16 steps each (`rows[i][s]`) transposed into `steps`: step `s`'s 8
/// values go to `steps[s·width + offset..][..8]`. Two 8 × 8 transposes of three shuffle
/// rounds each.
///
/// # Safety
/// AVX2 must be present.
#[target_feature(enable = "avx2")]
pub(super) unsafe fn transpose_8x16(
    rows: &[&[f32]],
    steps: &mut [f32],
    width: usize,
    offset: usize,
) {
    // Bounds, checked once: 8 rows of at least 16 values, 16 steps of `offset + 8` slots.
    assert!(rows.len() == 8 && rows.iter().all(|row| row.len() >= 16));
    assert!(offset + 8 <= width && steps.len() >= 15 * width + offset + 8);
    for half in 0..2 {
        // SAFETY: each row holds at least 16 floats (asserted above), so `8·half + 8 ≤ 16`.
        let r: [__m256; 8] =
            std::array::from_fn(|i| unsafe { _mm256_loadu_ps(rows[i].as_ptr().add(8 * half)) });
        // Round 1: rows 2i and 2i + 1 interleaved within each 128-bit lane.
        let t: [__m256; 8] = std::array::from_fn(|i| {
            let (x, y) = (r[i & !1], r[i | 1]);
            if i % 2 == 0 {
                _mm256_unpacklo_ps(x, y)
            } else {
                _mm256_unpackhi_ps(x, y)
            }
        });
        // Round 2: lane `l` of `u[4g + j]` holds columns `j` and `4 + j` of rows `4g..4g + 4`
        // (the low and the high 128 bits).
        let mut u = [_mm256_setzero_ps(); 8];
        for g in 0..2 {
            let (lo, hi) = (4 * g, 4 * g + 1);
            u[4 * g] = _mm256_shuffle_ps::<0x44>(t[lo], t[lo + 2]);
            u[4 * g + 1] = _mm256_shuffle_ps::<0xEE>(t[lo], t[lo + 2]);
            u[4 * g + 2] = _mm256_shuffle_ps::<0x44>(t[hi], t[hi + 2]);
            u[4 * g + 3] = _mm256_shuffle_ps::<0xEE>(t[hi], t[hi + 2]);
        }
        // Round 3: each column's two 4-row halves into one vector.
        for j in 0..4 {
            let columns = [
                (j, _mm256_permute2f128_ps::<0x20>(u[j], u[4 + j])),
                (4 + j, _mm256_permute2f128_ps::<0x31>(u[j], u[4 + j])),
            ];
            for (column, value) in columns {
                let step = 8 * half + column;
                // SAFETY: `step < 16`, so `step·width + offset + 8 ≤ steps.len()` (asserted).
                unsafe { _mm256_storeu_ps(steps.as_mut_ptr().add(step * width + offset), value) };
            }
        }
    }
}

/// One 6 × 16 tile on AVX2 with FMA: `C[tile] ⟵ epilogue(rows of A · B-panel)`.
///
/// # Safety
/// AVX2 and FMA must be present; `b_panel` holds `kc · 16` floats; `a` is a packed panel of
/// `kc · 6` floats or 6 rows of `A` with `kc` readable steps each; the tile's `rows ≤ 6` rows
/// and `cols ≤ 16` columns are writable elements of `C` (initialised unless the epilogue is
/// [`Epilogue::Overwrite`]).
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn micro_tile(a: RowsOfA<'_>, b_panel: &[f32], tile: Tile, epilogue: Epilogue) {
    // As on AVX-512: ask for the tile's lines of `C` before the multiply.
    for i in 0..tile.rows {
        // SAFETY: row `i < rows` of the tile is inside `C`, and so is its column
        // `cols - 1`. A prefetch reads nothing architecturally.
        unsafe {
            let row = tile.c.offset(i as isize * tile.row_stride);
            _mm_prefetch::<_MM_HINT_T0>(row.cast());
            _mm_prefetch::<_MM_HINT_T0>(row.add(tile.cols - 1).cast());
        }
    }
    // SAFETY: the caller's contract on `a` and `b_panel` is `steps`' contract.
    let acc = unsafe {
        match a {
            RowsOfA::Packed(panel) => steps::<false>(panel.as_ptr(), 0, b_panel),
            RowsOfA::InPlace { start, row_stride } => steps::<true>(start, row_stride, b_panel),
        }
    };
    if tile.cols == NR {
        for (i, row) in acc.iter().enumerate().take(tile.rows) {
            for (half, &value) in row.iter().enumerate() {
                // SAFETY: row `i < rows` of the tile, columns `8·half..8·half + 8` < 16 =
                // `cols`: elements of `C`.
                unsafe {
                    let at = tile.c.offset(i as isize * tile.row_stride).add(8 * half);
                    let out = match epilogue {
                        Epilogue::Overwrite => value,
                        Epilogue::Accumulate => _mm256_add_ps(value, _mm256_loadu_ps(at)),
                        Epilogue::Scale(beta) => {
                            _mm256_fmadd_ps(_mm256_loadu_ps(at), _mm256_set1_ps(beta), value)
                        }
                    };
                    _mm256_storeu_ps(at, out);
                }
            }
        }
        return;
    }
    // A ragged tile (the last columns of `C`): the sums go through a buffer on the stack and
    // only the tile's own elements of `C` are touched, with the same rounding.
    let mut sums = [[0.0f32; NR]; MR];
    for (row, values) in sums.iter_mut().zip(&acc) {
        for (half, &value) in values.iter().enumerate() {
            // SAFETY: `8·half + 8 ≤ 16` floats of the row.
            unsafe { _mm256_storeu_ps(row.as_mut_ptr().add(8 * half), value) };
        }
    }
    for (i, row) in sums.iter().enumerate().take(tile.rows) {
        for (j, &value) in row.iter().enumerate().take(tile.cols) {
            // SAFETY: `(i, j)` with `i < rows`, `j < cols` is an element of `C`.
            unsafe {
                let at = tile.c.offset(i as isize * tile.row_stride).add(j);
                *at = epilogue.apply(value, || *at);
            }
        }
    }
}

/// The `kc` steps of one 6 × 16 tile in registers (as [`super::avx512`]'s, on 8-lane vectors).
///
/// # Safety
/// AVX2 and FMA must be present; `b_panel` holds `kc · 16` floats; `a` addresses `kc · 6`
/// readable floats of a packed panel, or 6 rows of `kc` readable floats each.
#[target_feature(enable = "avx2,fma")]
#[inline]
unsafe fn steps<const IN_PLACE: bool>(
    a: *const f32,
    a_row_stride: isize,
    b_panel: &[f32],
) -> [[__m256; 2]; MR] {
    let kc = b_panel.len() / NR;
    let bp = b_panel.as_ptr();
    let mut acc: [[__m256; 2]; MR] = [[_mm256_setzero_ps(); 2]; MR];
    // Opaque row pointers, as on AVX-512 (see there why).
    let rows: [*const f32; MR] = if IN_PLACE {
        std::hint::black_box(std::array::from_fn(|i| {
            a.wrapping_offset(i as isize * a_row_stride)
        }))
    } else {
        [a; MR]
    };
    for p in 0..kc {
        // SAFETY: `p < kc`, so `p·16 + 16 ≤ kc·16` is inside the `B` panel, and `(i, p)` for
        // `i < 6` is inside the rows of `A` the caller vouches for.
        unsafe {
            // One step of the panel is one cache line; the prefetch address may lie past
            // the panel's end (`wrapping_add`; a prefetch never faults).
            _mm_prefetch::<_MM_HINT_T0>(bp.wrapping_add((p + PREFETCH_STEPS) * NR).cast());
            let b0 = _mm256_loadu_ps(bp.add(p * NR));
            let b1 = _mm256_loadu_ps(bp.add(p * NR + 8));
            for (i, row) in acc.iter_mut().enumerate() {
                let value = if IN_PLACE {
                    *rows[i].add(p)
                } else {
                    *a.add(p * MR + i)
                };
                let a = _mm256_set1_ps(value);
                row[0] = _mm256_fmadd_ps(a, b0, row[0]);
                row[1] = _mm256_fmadd_ps(a, b1, row[1]);
            }
        }
    }
    acc
}
