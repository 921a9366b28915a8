//! The general f32 GEMM on AVX-512: operands packed into panels, a 12 × 32 micro-tile.
//!
//! matrixmultiply's AVX-512 kernel keeps a 16 × 16 tile of `C` in 16 registers and, per step
//! along `k`, loads one vector of `B` and broadcasts 16 elements of `A`: 17 loads for 16
//! fused multiply-adds, so the two load ports, not the two FMA units, set its pace. This
//! kernel keeps a 12 × 32 tile in 24 registers: per step two vectors of `B` and 12
//! broadcasts, 14 loads for 24 multiply-adds, which leaves the FMA units the bottleneck. On
//! the AVX-512 Xeon the training tables come from, GPT-2's layer products run 1.10–1.37× as
//! fast as through matrixmultiply (`cargo run --release -p hypershard-benches --bin
//! bench-gemm` times both).
//!
//! Blocking, for one core's caches (48 KiB L1, 2 MiB L2):
//! - `k` in blocks of [`KC`]: one 12-row panel of packed `A` (18 KiB) stays in L1 while the
//!   packed `B` panels of the block pass under it;
//! - `B` packed [`NC`] columns at a time (720 KiB, in L2);
//! - `A` packed [`MC`] rows at a time, so the packed copy stays bounded for tall products
//!   (the loss head's weight gradient has 50 304 rows).
//!
//! Every element of `C` sums its `k` products in the same order whatever the split of `C`
//! over threads (block by block of `k`, in order within a block), so a product split by rows
//! or columns is bit for bit the single-thread one.
//!
//! The packed copies live in per-thread buffers that are reused from call to call: a fresh
//! 3 MiB allocation per GEMM would come from the kernel as new pages each time.

use std::cell::RefCell;

use super::small_gemm::available;

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::{
    __m512, __mmask16, _MM_HINT_T0, _mm_prefetch, _mm512_add_ps, _mm512_castpd_ps,
    _mm512_castps_pd, _mm512_fmadd_ps, _mm512_loadu_ps, _mm512_mask_storeu_ps,
    _mm512_maskz_loadu_ps, _mm512_set1_ps, _mm512_setzero_ps, _mm512_shuffle_f32x4,
    _mm512_storeu_ps, _mm512_unpackhi_pd, _mm512_unpackhi_ps, _mm512_unpacklo_pd,
    _mm512_unpacklo_ps,
};

/// Rows of a micro-tile (each a broadcast of one element of `A` per step along `k`).
const MR: usize = 12;
/// Columns of a micro-tile: two 16-lane vectors.
const NR: usize = 32;
/// Depth of a packed block along `k`.
const KC: usize = 384;
/// Columns of `B` packed at once (a multiple of [`NR`]).
const NC: usize = 480;
/// Rows of `A` packed at once (a multiple of [`MR`]).
const MC: usize = 1536;
/// How many steps ahead the micro-tile asks for the `B` panel's cache lines.
const PREFETCH_STEPS: usize = 8;
/// Steps along `k` that [`pack`] transposes at a time from an operand contiguous along `k`.
const TRANSPOSE_STEPS: usize = 16;

/// One 64-byte-aligned group of 16 floats: a `Vec` of these is aligned storage without
/// `unsafe`, so no packed panel straddles a cache line more than it must.
#[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
#[repr(C, align(64))]
struct Block([f32; 16]);

/// The packed copies of one thread's GEMMs.
#[derive(Default)]
struct Packs {
    a: Vec<Block>,
    b: Vec<Block>,
}

thread_local! {
    /// Reused by every GEMM this thread runs (see the module docs).
    static PACKS: RefCell<Packs> = RefCell::new(Packs::default());
}

/// `len` floats of `blocks`, grown (never shrunk) to hold them.
fn floats(blocks: &mut Vec<Block>, len: usize) -> &mut [f32] {
    let needed = len.div_ceil(16);
    if blocks.len() < needed {
        blocks.resize(needed, Block([0.0; 16]));
    }
    let all: &mut [f32] = bytemuck::cast_slice_mut(blocks.as_mut_slice());
    &mut all[..len]
}

/// A strided matrix operand: element `(i, p)` at `start + i·row + p·col`.
#[derive(Clone, Copy)]
pub(crate) struct Strided {
    pub(crate) start: *const f32,
    pub(crate) row: isize,
    pub(crate) col: isize,
}

/// What the first block of `k` does with the old `C`; later blocks always add to it.
#[derive(Clone, Copy, PartialEq)]
enum Epilogue {
    /// `C = A·B` (the old `C` is never read).
    Overwrite,
    /// `C = A·B + C`.
    Accumulate,
    /// `C = A·B + beta·C`.
    Scale(f32),
}

/// `C = A · B + beta · C` for `A` `[m, k]`, `B` `[k, n]` and `C` `[m, n]` with row stride
/// `c_row_stride` (column stride 1). Returns `false`, doing nothing, when the CPU lacks
/// AVX-512F or a dimension is zero; the caller then uses another GEMM.
///
/// # Safety
/// As [`Float::gemm_raw`](super::Float::gemm_raw): for `i < m`, `p < k`, `j < n` the elements
/// `(i, p)` of `a` and `(p, j)` of `b` must be readable, `c + i·c_row_stride + j` writable
/// (and initialised when `beta ≠ 0`), and `C` must not overlap `A` or `B`.
pub(crate) unsafe fn gemm(
    (m, k, n): (usize, usize, usize),
    a: Strided,
    b: Strided,
    beta: f32,
    c: *mut f32,
    c_row_stride: isize,
) -> bool {
    if m == 0 || k == 0 || n == 0 || !available() {
        return false;
    }
    #[cfg(target_arch = "x86_64")]
    {
        let run = |packs: &mut Packs| {
            // SAFETY: AVX-512F is present (checked above); the caller's contract covers every
            // element `blocked` addresses. Tested against an f64 reference on ragged shapes,
            // every layout and a window of a wider `C` by
            // `products_match_an_f64_reference_on_ragged_shapes_and_every_layout`, and by
            // `tall_products_cross_the_packed_row_block` and
            // `fully_strided_operands_take_the_general_packing_path`.
            unsafe { blocked((m, k, n), a, b, beta, c, c_row_stride, packs) }
        };
        PACKS.with(|cell| match cell.try_borrow_mut() {
            Ok(mut packs) => run(&mut packs),
            // Only a GEMM called from inside a GEMM on the same thread could find the buffers
            // taken, and none is; a private pair keeps even that case correct.
            Err(_) => run(&mut Packs::default()),
        });
        true
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (a, b, beta, c, c_row_stride);
        false
    }
}

/// The blocked product (see the module docs for the loop order).
///
/// # Safety
/// AVX-512F must be present; otherwise as [`gemm`], with `m`, `k`, `n` ≥ 1.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn blocked(
    (m, k, n): (usize, usize, usize),
    a: Strided,
    b: Strided,
    beta: f32,
    c: *mut f32,
    c_row_stride: isize,
    packs: &mut Packs,
) {
    let first = if beta == 0.0 {
        Epilogue::Overwrite
    } else if beta == 1.0 {
        Epilogue::Accumulate
    } else {
        Epilogue::Scale(beta)
    };
    let mut p0 = 0;
    while p0 < k {
        let kc = KC.min(k - p0);
        let epilogue = if p0 == 0 { first } else { Epilogue::Accumulate };
        let mut i0 = 0;
        while i0 < m {
            let mc = MC.min(m - i0);
            // A row-major `A` is read where it lies: a panel's 12 row pieces (18 KiB) stay
            // in L1 across the panels of `B` as well as a packed copy does, and packing it
            // is a transpose, which at `n` = 192 cost more than the multiply saved. Only a
            // last panel of fewer than `MR` rows is packed (zero rows pad it).
            let in_place = a.col == 1;
            let packed_rows = if in_place { mc % MR } else { mc };
            let packed_a = floats(&mut packs.a, packed_rows.div_ceil(MR) * MR * kc);
            let first_packed = if in_place { mc - packed_rows } else { 0 };
            if packed_rows > 0 {
                // SAFETY: rows `i0 + first_packed..i0 + mc` (< m, at least one) and depths
                // `p0..p0 + kc` (≤ k) of `A`, all readable by the caller's contract; the start
                // is the first of them.
                unsafe {
                    let row = (i0 + first_packed) as isize;
                    let start = a.start.offset(row * a.row + p0 as isize * a.col);
                    pack::<MR>(Strided { start, ..a }, packed_rows, kc, packed_a);
                }
            }
            let mut j0 = 0;
            while j0 < n {
                let nc = NC.min(n - j0);
                let packed_b = floats(&mut packs.b, nc.div_ceil(NR) * NR * kc);
                // SAFETY: columns `j0..j0 + nc` (≤ n) and depths `p0..p0 + kc` of `B`. A
                // column of `B` is a row of its panel: `B`'s column stride steps the panel's
                // rows, its row stride steps along `k`.
                unsafe {
                    let start = b.start.offset(p0 as isize * b.row + j0 as isize * b.col);
                    let columns = Strided {
                        start,
                        row: b.col,
                        col: b.row,
                    };
                    pack::<NR>(columns, nc, kc, packed_b);
                }
                for r in 0..mc.div_ceil(MR) {
                    let rows = MR.min(mc - r * MR);
                    let i = i0 + r * MR;
                    let rows_of_a = if r * MR < first_packed {
                        // SAFETY: row `i < m`, depth `p0 < k`: an element of `A`.
                        let start = unsafe { a.start.offset(i as isize * a.row + p0 as isize) };
                        RowsOfA::InPlace {
                            start,
                            row_stride: a.row,
                        }
                    } else {
                        let panel = (r * MR - first_packed) / MR;
                        RowsOfA::Packed(&packed_a[panel * MR * kc..(panel + 1) * MR * kc])
                    };
                    for (q, b_panel) in packed_b.chunks_exact(NR * kc).enumerate() {
                        let cols = NR.min(nc - q * NR);
                        let j = (j0 + q * NR) as isize;
                        // SAFETY: the tile's rows `i..i + rows` (≤ m) and columns
                        // `j..j + cols` (≤ n) are elements of `C` by the caller's contract;
                        // the `B` panel holds `kc` steps of `NR` floats; the rows of `A`
                        // are a packed panel of `kc` steps or `MR` full rows of `A` from
                        // depth `p0`, with `kc` readable steps each.
                        unsafe {
                            let tile = Tile {
                                c: c.offset(i as isize * c_row_stride + j),
                                row_stride: c_row_stride,
                                rows,
                                cols,
                            };
                            micro_tile(rows_of_a, b_panel, tile, epilogue);
                        }
                    }
                }
                j0 += nc;
            }
            i0 += mc;
        }
        p0 += kc;
    }
}

/// Copies `rows × kc` elements of `src` (element `(i, p)` at `i·row + p·col`) into panels
/// of `WIDTH` rows: panel `t` holds rows `t·WIDTH..`, step `p` of it the `WIDTH` values of
/// column `p` (rows past `rows` zero). `dst` holds `rows.div_ceil(WIDTH) · WIDTH · kc` floats.
/// The width is a constant so that a full step's copy is a few vector moves, not a call.
///
/// # Safety
/// AVX-512F must be present (as it is in [`blocked`], the only caller), and every element
/// `(i, p)`, `i < rows`, `p < kc`, of `src` must be readable.
#[cfg(target_arch = "x86_64")]
unsafe fn pack<const WIDTH: usize>(src: Strided, rows: usize, kc: usize, dst: &mut [f32]) {
    let width = WIDTH;
    for (t, panel) in dst.chunks_exact_mut(width * kc).enumerate() {
        let first = t * width;
        let height = width.min(rows - first);
        if height < width {
            panel.fill(0.0);
        }
        // SAFETY: rows `first..first + height` (≤ rows) of `src` are readable.
        let start = unsafe { src.start.offset(first as isize * src.row) };
        if src.row == 1 {
            // Each step's values are contiguous: one copy per step.
            for (p, step) in panel.chunks_exact_mut(width).enumerate() {
                // SAFETY: elements `(first..first + height, p)` are `height` consecutive
                // readable floats (row stride 1), not written while this slice lives.
                let values = unsafe {
                    std::slice::from_raw_parts(start.offset(p as isize * src.col), height)
                };
                if let (Ok(full), Ok(step)) = (
                    <&[f32; WIDTH]>::try_from(values),
                    <&mut [f32; WIDTH]>::try_from(&mut *step),
                ) {
                    *step = *full;
                } else {
                    step[..height].copy_from_slice(values);
                }
            }
        } else if src.col == 1 {
            // Each row is contiguous along `k`, so this is a transpose. It runs over blocks of
            // [`TRANSPOSE_STEPS`] steps: the block's piece of every row (one cache line) and
            // its part of the panel (2 KiB at width 32) stay in L1 while the panel is filled
            // step by step, with contiguous stores. Row by row over all `kc` steps, each row's
            // stores would sweep the whole panel (48 KiB); stored down the panel, a row's
            // values compile to a scatter, slower still.
            for (chunk, steps) in panel.chunks_mut(TRANSPOSE_STEPS * width).enumerate() {
                let p0 = chunk * TRANSPOSE_STEPS;
                let count = steps.len() / width;
                let mut rows = [[].as_slice(); WIDTH];
                for (i, row) in rows.iter_mut().enumerate().take(height) {
                    // SAFETY: elements `(first + i, p0..p0 + count)` are consecutive readable
                    // floats (`p0 + count ≤ kc`).
                    *row = unsafe {
                        let at = start.offset(i as isize * src.row + p0 as isize);
                        std::slice::from_raw_parts(at, count)
                    };
                }
                // Whole 16 × 16 blocks go through the vector transpose; the ragged rest (rows
                // past the last 16, the steps of a short last chunk) element by element.
                let vector_rows = if count == TRANSPOSE_STEPS {
                    height / 16 * 16
                } else {
                    0
                };
                for group in (0..vector_rows).step_by(16) {
                    // SAFETY: AVX-512F is present (this function's contract).
                    unsafe { transpose_16x16(&rows[group..group + 16], steps, width, group) };
                }
                for (s, step) in steps.chunks_exact_mut(width).enumerate() {
                    for (slot, row) in step[vector_rows..height]
                        .iter_mut()
                        .zip(&rows[vector_rows..])
                    {
                        *slot = row[s];
                    }
                }
            }
        } else {
            for (p, step) in panel.chunks_exact_mut(width).enumerate() {
                for (i, slot) in step[..height].iter_mut().enumerate() {
                    // SAFETY: element `(first + i, p)` is readable.
                    *slot = unsafe { *start.offset(i as isize * src.row + p as isize * src.col) };
                }
            }
        }
    }
}

/// Writes 16 rows of 16 steps each (`rows[i][s]`) transposed into `steps`: step `s`'s 16
/// values go to `steps[s·width + offset..][..16]`. Four rounds of in-register shuffles, 64
/// in all for 256 values, where the element-by-element copy moves one value per cycle.
///
/// # Safety
/// AVX-512F must be present.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn transpose_16x16(rows: &[&[f32]], steps: &mut [f32], width: usize, offset: usize) {
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

/// Where a micro-tile's results go: `rows × cols` of `C` from `c` with row stride
/// `row_stride` (column stride 1).
#[cfg(target_arch = "x86_64")]
struct Tile {
    c: *mut f32,
    row_stride: isize,
    rows: usize,
    cols: usize,
}

/// The mask of lanes `lo..lo + 16` that fall inside `cols` columns.
#[cfg(target_arch = "x86_64")]
fn lanes(cols: usize, lo: usize) -> __mmask16 {
    if cols >= lo + 16 {
        0xFFFF
    } else if cols <= lo {
        0
    } else {
        ((1u32 << (cols - lo)) - 1) as __mmask16
    }
}

/// Where a micro-tile reads its `MR` rows of `A`.
#[cfg(target_arch = "x86_64")]
#[derive(Clone, Copy)]
enum RowsOfA<'a> {
    /// A packed panel: step `p`'s `MR` values at `p·MR..`.
    Packed(&'a [f32]),
    /// `A` itself, row-major: row `i`'s step `p` at `start + i·row_stride + p`.
    InPlace {
        start: *const f32,
        row_stride: isize,
    },
}

/// One `MR × NR` tile: `C[tile] ⟵ epilogue(rows of A · B-panel)`.
///
/// # Safety
/// AVX-512F must be present; `b_panel` holds `kc · NR` floats; `a` is a packed panel of
/// `kc · MR` floats or `MR` rows of `A` with `kc` readable steps each; the tile's `rows ≤ MR`
/// rows and `cols ≤ NR` columns are writable elements of `C` (initialised unless the
/// epilogue is [`Epilogue::Overwrite`]).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn micro_tile(a: RowsOfA<'_>, b_panel: &[f32], tile: Tile, epilogue: Epilogue) {
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
#[cfg(target_arch = "x86_64")]
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

#[cfg(test)]
mod tests {
    use super::*;

    /// `value(seed, index)`: a deterministic spread of small values with both signs.
    fn value(seed: usize, index: usize) -> f32 {
        let h = (index.wrapping_mul(2_654_435_761) ^ seed.wrapping_mul(40_503)) % 2001;
        (h as f32 - 1000.0) / 1000.0
    }

    /// [`gemm`] on slices (dimensions at least 1, strides non-negative), after asserting that
    /// the last element each operand's strides address lies inside its slice.
    #[allow(clippy::too_many_arguments)]
    fn gemm_on_slices(
        (m, k, n): (usize, usize, usize),
        a: &[f32],
        (a_row, a_col): (usize, usize),
        b: &[f32],
        (b_row, b_col): (usize, usize),
        beta: f32,
        c: &mut [f32],
        c_row: usize,
    ) -> bool {
        assert!((m - 1) * a_row + (k - 1) * a_col < a.len());
        assert!((k - 1) * b_row + (n - 1) * b_col < b.len());
        assert!((m - 1) * c_row + n <= c.len() && c_row >= n);
        let strided = |x: &[f32], row: usize, col: usize| Strided {
            start: x.as_ptr(),
            row: row as isize,
            col: col as isize,
        };
        // SAFETY: with non-negative strides the largest offset addressed in each operand is
        // its last element's, checked above to lie inside the slice; rows of `C` of stride
        // `c_row ≥ n` do not overlap, and `c` is a `&mut` apart from `a` and `b`.
        unsafe {
            gemm(
                (m, k, n),
                strided(a, a_row, a_col),
                strided(b, b_row, b_col),
                beta,
                c.as_mut_ptr(),
                c_row as isize,
            )
        }
    }

    /// One product through [`gemm`], `A` and `B` stored transposed or not, `C` a window of
    /// a wider buffer whose other elements must stay untouched; checked against an f64 sum.
    fn check(m: usize, k: usize, n: usize, a_t: bool, b_t: bool, beta: f32) {
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
            (m, k, n),
            &a,
            a_strides,
            &b,
            b_strides,
            beta,
            &mut c,
            stride,
        );
        assert_eq!(ran, available());
        if !ran {
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
                    "m {m} k {k} n {n} a_t {a_t} b_t {b_t} beta {beta}: ({i}, {j}) = {got}, want {want}"
                );
            }
        }
    }

    #[test]
    fn products_match_an_f64_reference_on_ragged_shapes_and_every_layout() {
        // Ragged against the tile (12 × 32), the k-block (384) and the packed column block
        // (480), and whole tiles over several k-blocks (24 × 800: a row-major A then has no
        // packed tail panel); every stored layout of A and B; the three epilogues.
        let shapes = [
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
    fn tall_products_cross_the_packed_row_block() {
        check(MC + 13, 5, 40, false, true, 0.0);
        check(MC + 13, 5, 40, true, false, 1.0);
    }

    #[test]
    fn fully_strided_operands_take_the_general_packing_path() {
        // A read through row stride 2·k and column stride 2 (every other element of a wider
        // buffer): neither stride is 1, so `pack`'s element-by-element branch runs.
        let (m, k, n) = (14, 9, 35);
        let a: Vec<f32> = (0..4 * m * k).map(|i| value(4, i)).collect();
        let b: Vec<f32> = (0..k * n).map(|i| value(5, i)).collect();
        let mut c = vec![0.0f32; m * n];
        let ran = gemm_on_slices((m, k, n), &a, (2 * k, 2), &b, (n, 1), 0.0, &mut c, n);
        assert_eq!(ran, available());
        if !ran {
            return;
        }
        for i in 0..m {
            for j in 0..n {
                let want: f64 = (0..k)
                    .map(|p| f64::from(a[i * 2 * k + 2 * p]) * f64::from(b[p * n + j]))
                    .sum();
                assert!((f64::from(c[i * n + j]) - want).abs() < 1e-5, "({i}, {j})");
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
        // SAFETY: nothing is addressed when a dimension is zero.
        let ran = unsafe { gemm((1, 0, 1), s, s, 0.0, c.as_mut_ptr(), 1) };
        assert!(!ran);
        assert_eq!(c[0], 0.0);
    }
}
