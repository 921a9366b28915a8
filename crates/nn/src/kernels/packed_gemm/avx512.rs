//! The AVX-512 micro-kernel of the packed GEMM: a 12 × 32 tile of `C` in 24 of the 32
//! vector registers (see the parent module), and the 16 × 16 transpose that packs operands
//! stored along `k`.

use std::arch::x86_64::{
    __m512, __mmask16, _MM_HINT_T0, _mm_prefetch, _mm512_add_ps, _mm512_castpd_ps,
    _mm512_castps_pd, _mm512_fmadd_ps, _mm512_loadu_ps, _mm512_mask_storeu_ps,
    _mm512_maskz_loadu_ps, _mm512_set1_ps, _mm512_setzero_ps, _mm512_shuffle_f32x4,
    _mm512_storeu_ps, _mm512_unpackhi_pd, _mm512_unpackhi_ps, _mm512_unpacklo_pd,
    _mm512_unpacklo_ps,
};

use super::{Epilogue, PREFETCH_STEPS, RowsOfA, Tile};

/// Rows of the micro-tile (each a broadcast of one element of `A` per step).
pub(super) const MR: usize = 12;
/// Columns of the micro-tile: two 16-lane vectors.
pub(super) const NR: usize = 32;

/// Writes 16 rows of 16 steps each (`rows[i][s]`) transposed into `steps`: step `s`'s 16
/// values go to `steps[s·width + offset..][..16]`. Four rounds of in-register shuffles, 64
/// in all for 256 values, where the element-by-element copy moves one value per cycle.
///
/// # Safety
/// AVX-512F must be present.
#[target_feature(enable = "avx512f")]
pub(super) unsafe fn transpose_16x16(
    rows: &[&[f32]],
    steps: &mut [f32],
    width: usize,
    offset: usize,
) {
    // Bounds, checked once: 16 rows of at least 16 values, 16 steps of `offset + 16` slots.
    assert!(rows.len() == 16 && rows.iter().all(|row| row.len() >= 16));
    assert!(offset + 16 <= width && steps.len() >= 15 * width + offset + 16);
    // SAFETY: each row holds at least 16 floats (asserted above).
    let r: [__m512; 16] = std::array::from_fn(|i| unsafe { _mm512_loadu_ps(rows[i].as_ptr()) });
    // Round 1: rows 2i and 2i + 1 interleaved within each 128-bit lane.
    let mut t = [_mm512_setzero_ps(); 16];
    for i in 0..8 {
        t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    // Round 2: lane `l` of `u[4g + j]` holds column `4l + j` of rows `4g..4g + 4`.
    let mut u = [_mm512_setzero_ps(); 16];
    for g in 0..4 {
        let a0 = _mm512_castps_pd(t[4 * g]);
        let a1 = _mm512_castps_pd(t[4 * g + 1]);
        let b0 = _mm512_castps_pd(t[4 * g + 2]);
        let b1 = _mm512_castps_pd(t[4 * g + 3]);
        u[4 * g] = _mm512_castpd_ps(_mm512_unpacklo_pd(a0, b0));
        u[4 * g + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a0, b0));
        u[4 * g + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(a1, b1));
        u[4 * g + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(a1, b1));
    }
    // Rounds 3 and 4 gather each column's four 4-row pieces into one vector.
    for j in 0..4 {
        let x_lo = _mm512_shuffle_f32x4::<0x88>(u[j], u[4 + j]);
        let x_hi = _mm512_shuffle_f32x4::<0xDD>(u[j], u[4 + j]);
        let y_lo = _mm512_shuffle_f32x4::<0x88>(u[8 + j], u[12 + j]);
        let y_hi = _mm512_shuffle_f32x4::<0xDD>(u[8 + j], u[12 + j]);
        let columns = [
            (j, _mm512_shuffle_f32x4::<0x88>(x_lo, y_lo)),
            (8 + j, _mm512_shuffle_f32x4::<0xDD>(x_lo, y_lo)),
            (4 + j, _mm512_shuffle_f32x4::<0x88>(x_hi, y_hi)),
            (12 + j, _mm512_shuffle_f32x4::<0xDD>(x_hi, y_hi)),
        ];
        for (step, value) in columns {
            // SAFETY: `step < 16`, so `step·width + offset + 16 ≤ steps.len()` (asserted).
            unsafe { _mm512_storeu_ps(steps.as_mut_ptr().add(step * width + offset), value) };
        }
    }
}

/// The mask of lanes `lo..lo + 16` that fall inside `cols` columns.
fn lanes(cols: usize, lo: usize) -> __mmask16 {
    if cols >= lo + 16 {
        0xFFFF
    } else if cols <= lo {
        0
    } else {
        ((1u32 << (cols - lo)) - 1) as __mmask16
    }
}

/// One `MR × NR` tile on AVX-512: `C[tile] ⟵ epilogue(rows of A · B-panel)`.
///
/// # Safety
/// AVX-512F must be present; `b_panel` holds `kc · NR` floats; `a` is a packed panel of
/// `kc · MR` floats or `MR` rows of `A` with `kc` readable steps each; the tile's `rows ≤ MR`
/// rows and `cols ≤ NR` columns are writable elements of `C` (initialised unless the
/// epilogue is [`Epilogue::Overwrite`]).
#[target_feature(enable = "avx512f")]
pub(super) unsafe fn micro_tile(a: RowsOfA<'_>, b_panel: &[f32], tile: Tile, epilogue: Epilogue) {
    // The tile's rows of `C` are read (or written) only after the `kc` steps; asking for
    // their cache lines now hides the miss behind the multiply (`C` is megabytes, visited
    // once per block of `k`, so the lines are rarely still cached).
    for i in 0..tile.rows {
        // SAFETY: row `i < rows` of the tile is inside `C`; the second line is requested
        // only when the tile has columns in it. A prefetch reads nothing architecturally.
        unsafe {
            let row = tile.c.offset(i as isize * tile.row_stride);
            _mm_prefetch::<_MM_HINT_T0>(row.cast());
            if tile.cols > 16 {
                _mm_prefetch::<_MM_HINT_T0>(row.add(16).cast());
            }
        }
    }
    // SAFETY: the caller's contract on `a` and `b_panel` is `steps`' contract.
    let acc = unsafe {
        match a {
            RowsOfA::Packed(panel) => steps::<false>(panel.as_ptr(), 0, b_panel),
            RowsOfA::InPlace { start, row_stride } => steps::<true>(start, row_stride, b_panel),
        }
    };
    let masks = [lanes(tile.cols, 0), lanes(tile.cols, 16)];
    for (i, row) in acc.iter().enumerate().take(tile.rows) {
        for (half, &value) in row.iter().enumerate() {
            let mask = masks[half];
            if mask == 0 {
                // No column of this half is in the tile (its start may lie past `C`'s end).
                continue;
            }
            // SAFETY: row `i < rows` of the tile, and column `16·half < cols`; the mask keeps
            // lanes below `cols`, so every lane loaded or stored is an element of `C`
            // (masked lanes are not touched).
            unsafe {
                let at = tile.c.offset(i as isize * tile.row_stride).add(16 * half);
                let out = match epilogue {
                    Epilogue::Overwrite => value,
                    Epilogue::Accumulate => _mm512_add_ps(value, _mm512_maskz_loadu_ps(mask, at)),
                    Epilogue::Scale(beta) => _mm512_fmadd_ps(
                        _mm512_maskz_loadu_ps(mask, at),
                        _mm512_set1_ps(beta),
                        value,
                    ),
                };
                _mm512_mask_storeu_ps(at, mask, out);
            }
        }
    }
}

/// The `kc` steps of one tile in registers: per step two vectors of the `B` panel and a
/// broadcast of each row's element of `A`, read from a packed panel (`IN_PLACE` false:
/// `a + p·MR + i`) or from `A` itself (`IN_PLACE` true: `a + i·a_row_stride + p`). A constant
/// parameter, so that each kind's loop is compiled with its own addressing.
///
/// # Safety
/// AVX-512F must be present; `b_panel` holds `kc · NR` floats; `a` addresses `kc · MR`
/// readable floats of a packed panel, or `MR` rows of `kc` readable floats each.
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn steps<const IN_PLACE: bool>(
    a: *const f32,
    a_row_stride: isize,
    b_panel: &[f32],
) -> [[__m512; 2]; MR] {
    let kc = b_panel.len() / NR;
    let bp = b_panel.as_ptr();
    let mut acc: [[__m512; 2]; MR] = [[_mm512_setzero_ps(); 2]; MR];
    // One pointer per row of `A`, so that each step's broadcasts address `row + p` with one
    // shared index. Left to itself the optimiser folds the rows back into `a + i·stride + p`
    // and recomputes them every step, a chain of a dozen integer adds that competes with the
    // FMAs for their ports; `black_box` keeps the pointers opaque (bench-gemm: forward and
    // input-gradient products 1–7 % faster).
    let rows: [*const f32; MR] = if IN_PLACE {
        std::hint::black_box(std::array::from_fn(|i| {
            a.wrapping_offset(i as isize * a_row_stride)
        }))
    } else {
        [a; MR]
    };
    for p in 0..kc {
        // SAFETY: `p < kc`, so `p·NR + 32 ≤ kc·NR` is inside the `B` panel, and `(i, p)` for
        // `i < MR` is inside the rows of `A` the caller vouches for.
        unsafe {
            // The panel streams from L2; asking for the lines a few steps ahead keeps the
            // loads off the FMA's critical path (5–12 % faster in isolation). The address
            // may lie past the panel's end: `wrapping_add` forms it without a claim that it
            // is inside, and a prefetch never faults.
            let ahead = bp.wrapping_add((p + PREFETCH_STEPS) * NR);
            _mm_prefetch::<_MM_HINT_T0>(ahead.cast());
            _mm_prefetch::<_MM_HINT_T0>(ahead.wrapping_add(16).cast());
            let b0 = _mm512_loadu_ps(bp.add(p * NR));
            let b1 = _mm512_loadu_ps(bp.add(p * NR + 16));
            for (i, row) in acc.iter_mut().enumerate() {
                let value = if IN_PLACE {
                    *rows[i].add(p)
                } else {
                    *a.add(p * MR + i)
                };
                let a = _mm512_set1_ps(value);
                row[0] = _mm512_fmadd_ps(a, b0, row[0]);
                row[1] = _mm512_fmadd_ps(a, b1, row[1]);
            }
        }
    }
    acc
}
