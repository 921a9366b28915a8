//! The general f32 GEMM: operands packed into panels, a register micro-tile per vector unit.
//!
//! The micro-kernel is chosen once per call from the CPU's widest vector unit
//! ([`VectorIsa`]):
//! - **AVX-512**: a 12 × 32 tile of `C` in 24 registers. matrixmultiply's AVX-512 kernel keeps
//!   a 16 × 16 tile in 16 registers and, per step along `k`, loads one vector of `B` and
//!   broadcasts 16 elements of `A`: 17 loads for 16 fused multiply-adds, so the two load ports,
//!   not the two FMA units, set its pace. This kernel loads two vectors of `B` and broadcasts
//!   12 elements of `A` per step: 14 loads for 24 multiply-adds, which leaves the FMA units
//!   the bottleneck.
//! - **AVX2 with FMA**: a 6 × 16 tile in 12 of the 16 registers, two vectors of `B` and six
//!   broadcasts per step: 8 loads for 12 multiply-adds.
//!
//! `cargo run --release -p hypershard-benches --bin bench-gemm` times this GEMM against
//! matrixmultiply's on the products of a GPT training step (docs/nn.md gives the figures).
//! Without either vector unit [`gemm`] declines and the caller uses matrixmultiply.
//!
//! Blocking, per kernel ([`Kernel`]), for one core's caches:
//! - `k` in blocks of `kc`: one panel of packed `A` (`MR` rows) stays in L1 while the packed
//!   `B` panels of the block pass under it;
//! - `B` packed `nc` columns at a time, a block that stays in L2;
//! - `A` packed `mc` rows at a time, so the packed copy stays bounded for tall products
//!   (the loss head's weight gradient has 50 304 rows).
//!
//! Every element of `C` sums its `k` products in the same order whatever the split of `C`
//! over threads (block by block of `k`, in order within a block), so a product split by rows
//! or columns is bit for bit the single-thread one.
//!
//! The packed copies live in per-thread buffers that are reused from call to call: a fresh
//! 3 MiB allocation per GEMM would come from the kernel as new pages each time.

use std::cell::RefCell;

use super::vector_isa::{VectorIsa, widest};

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::{
    __m256, __m512, __mmask16, _MM_HINT_T0, _mm_prefetch, _mm256_add_ps, _mm256_fmadd_ps,
    _mm256_loadu_ps, _mm256_permute2f128_ps, _mm256_set1_ps, _mm256_setzero_ps, _mm256_shuffle_ps,
    _mm256_storeu_ps, _mm256_unpackhi_ps, _mm256_unpacklo_ps, _mm512_add_ps, _mm512_castpd_ps,
    _mm512_castps_pd, _mm512_fmadd_ps, _mm512_loadu_ps, _mm512_mask_storeu_ps,
    _mm512_maskz_loadu_ps, _mm512_set1_ps, _mm512_setzero_ps, _mm512_shuffle_f32x4,
    _mm512_storeu_ps, _mm512_unpackhi_pd, _mm512_unpackhi_ps, _mm512_unpacklo_pd,
    _mm512_unpacklo_ps,
};

/// Rows of the AVX-512 micro-tile (each a broadcast of one element of `A` per step).
const AVX512_MR: usize = 12;
/// Columns of the AVX-512 micro-tile: two 16-lane vectors.
const AVX512_NR: usize = 32;
/// Rows of the AVX2 micro-tile.
const AVX2_MR: usize = 6;
/// Columns of the AVX2 micro-tile: two 8-lane vectors.
const AVX2_NR: usize = 16;
/// How many steps ahead the micro-tile asks for the `B` panel's cache lines.
const PREFETCH_STEPS: usize = 8;
/// Steps along `k` that [`pack`] transposes at a time from an operand contiguous along `k`.
const TRANSPOSE_STEPS: usize = 16;

/// One vector unit's micro-kernel and the blocking that suits it.
#[cfg(target_arch = "x86_64")]
struct Kernel {
    /// Depth of a packed block along `k`.
    kc: usize,
    /// Columns of `B` packed at once (a multiple of the tile's columns).
    nc: usize,
    /// Rows of `A` packed at once (a multiple of the tile's rows).
    mc: usize,
    /// One micro-tile (the contract of [`micro_tile_avx512`]).
    tile: unsafe fn(RowsOfA<'_>, &[f32], Tile, Epilogue),
    /// Rows of an operand that [`Kernel::transpose`] turns into steps at once.
    transpose_rows: usize,
    /// Writes `transpose_rows` rows of [`TRANSPOSE_STEPS`] values transposed into panel
    /// steps (the contract of [`transpose_16x16`]).
    transpose: unsafe fn(&[&[f32]], &mut [f32], usize, usize),
}

/// The AVX-512 kernel. A 12-row panel of `A` (18 KiB at `kc` 384) stays in a 48 KiB L1; the
/// `B` block (720 KiB) in a 2 MiB L2.
#[cfg(target_arch = "x86_64")]
const AVX512: Kernel = Kernel {
    kc: 384,
    nc: 480,
    mc: 1536,
    tile: micro_tile_avx512,
    transpose_rows: 16,
    transpose: transpose_16x16,
};

/// The AVX2 kernel. A 6-row panel of `A` (6 KiB at `kc` 256) and the 16 KiB `B` panel
/// passing under it share a 32 KiB L1; the `B` block (240 KiB) stays in a 512 KiB L2.
#[cfg(target_arch = "x86_64")]
const AVX2: Kernel = Kernel {
    kc: 256,
    nc: 240,
    mc: 1536,
    tile: micro_tile_avx2,
    transpose_rows: 8,
    transpose: transpose_8x16,
};

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

/// One product `C = A · B + beta · C`: `A` `[m, k]`, `B` `[k, n]`, `C` `[m, n]` with row
/// stride `c_row_stride` (column stride 1).
#[derive(Clone, Copy)]
struct Product {
    m: usize,
    k: usize,
    n: usize,
    a: Strided,
    b: Strided,
    beta: f32,
    c: *mut f32,
    c_row_stride: isize,
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

impl Epilogue {
    /// One element: `value` the tile's sum, `old` the element of `C` (read only when the
    /// epilogue needs it). Rounds as the vector epilogues do: `Scale` is one fused
    /// multiply-add.
    fn apply(self, value: f32, old: impl FnOnce() -> f32) -> f32 {
        match self {
            Epilogue::Overwrite => value,
            Epilogue::Accumulate => value + old(),
            Epilogue::Scale(beta) => old().mul_add(beta, value),
        }
    }
}

/// `C = A · B + beta · C` for `A` `[m, k]`, `B` `[k, n]` and `C` `[m, n]` with row stride
/// `c_row_stride` (column stride 1), on the widest micro-kernel this CPU runs. Returns
/// `false`, doing nothing, when the CPU has neither AVX-512F nor AVX2 with FMA or a dimension
/// is zero; the caller then uses another GEMM.
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
    let product = Product {
        m,
        k,
        n,
        a,
        b,
        beta,
        c,
        c_row_stride,
    };
    // SAFETY: the caller's contract is `gemm_on`'s.
    unsafe { gemm_on(widest(), product) }
}

/// [`gemm`] on the micro-kernel of `isa` (`false` for [`VectorIsa::Baseline`]).
///
/// # Safety
/// The CPU must have `isa`'s instructions; otherwise as [`gemm`].
unsafe fn gemm_on(isa: VectorIsa, product: Product) -> bool {
    if product.m == 0 || product.k == 0 || product.n == 0 || isa == VectorIsa::Baseline {
        return false;
    }
    #[cfg(target_arch = "x86_64")]
    {
        let run = |packs: &mut Packs| match isa {
            // SAFETY: the CPU has the instructions of `isa` (this function's contract); the
            // caller's contract covers every element `blocked` addresses. Tested against an
            // f64 reference on ragged shapes, every layout and a window of a wider `C`, on
            // each kernel the CPU has, by
            // `products_match_an_f64_reference_on_ragged_shapes_and_every_layout`,
            // `tall_products_cross_the_packed_row_block` and
            // `fully_strided_operands_take_the_general_packing_path`.
            VectorIsa::Avx512 => unsafe { blocked_avx512(product, packs) },
            // SAFETY: as above, for AVX2 with FMA, by the same tests.
            VectorIsa::Avx2 => unsafe { blocked_avx2(product, packs) },
            VectorIsa::Baseline => {}
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
        false
    }
}

/// [`blocked`] compiled for AVX-512, so that its packing loops use the wide registers too.
///
/// # Safety
/// AVX-512F must be present; otherwise as [`blocked`].
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn blocked_avx512(product: Product, packs: &mut Packs) {
    // SAFETY: the caller's contract, and the AVX-512 kernel's tile is 12 × 32.
    unsafe { blocked::<AVX512_MR, AVX512_NR>(&AVX512, product, packs) }
}

/// [`blocked`] compiled for AVX2 with FMA.
///
/// # Safety
/// AVX2 and FMA must be present; otherwise as [`blocked`].
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn blocked_avx2(product: Product, packs: &mut Packs) {
    // SAFETY: the caller's contract, and the AVX2 kernel's tile is 6 × 16.
    unsafe { blocked::<AVX2_MR, AVX2_NR>(&AVX2, product, packs) }
}

/// The blocked product (see the module docs for the loop order) on `kernel`, whose tile is
/// `MR × NR`.
///
/// # Safety
/// The CPU must have `kernel`'s instructions and its tile must be `MR × NR`; otherwise as
/// [`gemm`], with `m`, `k`, `n` ≥ 1.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn blocked<const MR: usize, const NR: usize>(
    kernel: &Kernel,
    Product {
        m,
        k,
        n,
        a,
        b,
        beta,
        c,
        c_row_stride,
    }: Product,
    packs: &mut Packs,
) {
    let first = if beta == 0.0 {
        Epilogue::Overwrite
    } else if beta == 1.0 {
        Epilogue::Accumulate
    } else {
        Epilogue::Scale(beta)
    };
    let transposer = Transposer {
        rows: kernel.transpose_rows,
        run: kernel.transpose,
    };
    let mut p0 = 0;
    while p0 < k {
        let kc = kernel.kc.min(k - p0);
        let epilogue = if p0 == 0 { first } else { Epilogue::Accumulate };
        let mut i0 = 0;
        while i0 < m {
            let mc = kernel.mc.min(m - i0);
            // A row-major `A` is read where it lies: a panel's row pieces stay in L1 across
            // the panels of `B` as well as a packed copy does, and packing it is a
            // transpose, which at `n` = 192 cost more than the multiply saved. Only a last
            // panel of fewer than `MR` rows is packed (zero rows pad it).
            let in_place = a.col == 1;
            let packed_rows = if in_place { mc % MR } else { mc };
            let packed_a = floats(&mut packs.a, packed_rows.div_ceil(MR) * MR * kc);
            let first_packed = if in_place { mc - packed_rows } else { 0 };
            if packed_rows > 0 {
                // SAFETY: rows `i0 + first_packed..i0 + mc` (< m, at least one) and depths
                // `p0..p0 + kc` (≤ k) of `A`, all readable by the caller's contract; the start
                // is the first of them; the CPU runs the kernel's transposer.
                unsafe {
                    let row = (i0 + first_packed) as isize;
                    let start = a.start.offset(row * a.row + p0 as isize * a.col);
                    pack::<MR>(
                        Strided { start, ..a },
                        packed_rows,
                        kc,
                        packed_a,
                        transposer,
                    );
                }
            }
            let mut j0 = 0;
            while j0 < n {
                let nc = kernel.nc.min(n - j0);
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
                    pack::<NR>(columns, nc, kc, packed_b, transposer);
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
                        // depth `p0`, with `kc` readable steps each; the CPU runs the kernel.
                        unsafe {
                            let tile = Tile {
                                c: c.offset(i as isize * c_row_stride + j),
                                row_stride: c_row_stride,
                                rows,
                                cols,
                            };
                            (kernel.tile)(rows_of_a, b_panel, tile, epilogue);
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

/// A kernel's vector transpose for [`pack`]: `rows` rows of [`TRANSPOSE_STEPS`] values at
/// a time.
#[cfg(target_arch = "x86_64")]
#[derive(Clone, Copy)]
struct Transposer {
    rows: usize,
    run: unsafe fn(&[&[f32]], &mut [f32], usize, usize),
}

/// Copies `rows × kc` elements of `src` (element `(i, p)` at `i·row + p·col`) into panels
/// of `WIDTH` rows: panel `t` holds rows `t·WIDTH..`, step `p` of it the `WIDTH` values of
/// column `p` (rows past `rows` zero). `dst` holds `rows.div_ceil(WIDTH) · WIDTH · kc` floats.
/// The width is a constant so that a full step's copy is a few vector moves, not a call.
///
/// # Safety
/// The CPU must run `transposer`, and every element `(i, p)`, `i < rows`, `p < kc`, of `src`
/// must be readable. (A transposer wider than `WIDTH` is never called.)
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn pack<const WIDTH: usize>(
    src: Strided,
    rows: usize,
    kc: usize,
    dst: &mut [f32],
    transposer: Transposer,
) {
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
            // stores would sweep the whole panel; stored down the panel, a row's values
            // compile to a scatter, slower still.
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
                // Whole groups of rows go through the vector transpose; the ragged rest (rows
                // past the last group, the steps of a short last chunk) element by element.
                let group = transposer.rows;
                let vector_rows = if count == TRANSPOSE_STEPS {
                    height / group * group
                } else {
                    0
                };
                for first_row in (0..vector_rows).step_by(group) {
                    // SAFETY: the CPU runs the transposer (this function's contract).
                    unsafe {
                        (transposer.run)(
                            &rows[first_row..first_row + group],
                            steps,
                            width,
                            first_row,
                        )
                    };
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

/// Where a micro-tile reads its `AVX512_MR` rows of `A`.
#[cfg(target_arch = "x86_64")]
#[derive(Clone, Copy)]
enum RowsOfA<'a> {
    /// A packed panel: step `p`'s `MR` values (the tile's rows) at `p·MR..`.
    Packed(&'a [f32]),
    /// `A` itself, row-major: row `i`'s step `p` at `start + i·row_stride + p`.
    InPlace {
        start: *const f32,
        row_stride: isize,
    },
}

/// One 12 × 32 tile on AVX-512: `C[tile] ⟵ epilogue(rows of A · B-panel)`.
///
/// # Safety
/// AVX-512F must be present; `b_panel` holds `kc · AVX512_NR` floats; `a` is a packed panel of
/// `kc · AVX512_MR` floats or `AVX512_MR` rows of `A` with `kc` readable steps each; the tile's `rows ≤ AVX512_MR`
/// rows and `cols ≤ AVX512_NR` columns are writable elements of `C` (initialised unless the
/// epilogue is [`Epilogue::Overwrite`]).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn micro_tile_avx512(a: RowsOfA<'_>, b_panel: &[f32], tile: Tile, epilogue: Epilogue) {
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
    // SAFETY: the caller's contract on `a` and `b_panel` is `steps_avx512`' contract.
    let acc = unsafe {
        match a {
            RowsOfA::Packed(panel) => steps_avx512::<false>(panel.as_ptr(), 0, b_panel),
            RowsOfA::InPlace { start, row_stride } => {
                steps_avx512::<true>(start, row_stride, b_panel)
            }
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
/// `a + p·AVX512_MR + i`) or from `A` itself (`IN_PLACE` true: `a + i·a_row_stride + p`). A constant
/// parameter, so that each kind's loop is compiled with its own addressing.
///
/// # Safety
/// AVX-512F must be present; `b_panel` holds `kc · AVX512_NR` floats; `a` addresses `kc · AVX512_MR`
/// readable floats of a packed panel, or `AVX512_MR` rows of `kc` readable floats each.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn steps_avx512<const IN_PLACE: bool>(
    a: *const f32,
    a_row_stride: isize,
    b_panel: &[f32],
) -> [[__m512; 2]; AVX512_MR] {
    let kc = b_panel.len() / AVX512_NR;
    let bp = b_panel.as_ptr();
    let mut acc: [[__m512; 2]; AVX512_MR] = [[_mm512_setzero_ps(); 2]; AVX512_MR];
    // One pointer per row of `A`, so that each step's broadcasts address `row + p` with one
    // shared index. Left to itself the optimiser folds the rows back into `a + i·stride + p`
    // and recomputes them every step, a chain of a dozen integer adds that competes with the
    // FMAs for their ports; `black_box` keeps the pointers opaque (bench-gemm: forward and
    // input-gradient products 1–7 % faster).
    let rows: [*const f32; AVX512_MR] = if IN_PLACE {
        std::hint::black_box(std::array::from_fn(|i| {
            a.wrapping_offset(i as isize * a_row_stride)
        }))
    } else {
        [a; AVX512_MR]
    };
    for p in 0..kc {
        // SAFETY: `p < kc`, so `p·AVX512_NR + 32 ≤ kc·AVX512_NR` is inside the `B` panel, and `(i, p)` for
        // `i < AVX512_MR` is inside the rows of `A` the caller vouches for.
        unsafe {
            // The panel streams from L2; asking for the lines a few steps ahead keeps the
            // loads off the FMA's critical path (5–12 % faster in isolation). The address
            // may lie past the panel's end: `wrapping_add` forms it without a claim that it
            // is inside, and a prefetch never faults.
            let ahead = bp.wrapping_add((p + PREFETCH_STEPS) * AVX512_NR);
            _mm_prefetch::<_MM_HINT_T0>(ahead.cast());
            _mm_prefetch::<_MM_HINT_T0>(ahead.wrapping_add(16).cast());
            let b0 = _mm512_loadu_ps(bp.add(p * AVX512_NR));
            let b1 = _mm512_loadu_ps(bp.add(p * AVX512_NR + 16));
            for (i, row) in acc.iter_mut().enumerate() {
                let value = if IN_PLACE {
                    *rows[i].add(p)
                } else {
                    *a.add(p * AVX512_MR + i)
                };
                let a = _mm512_set1_ps(value);
                row[0] = _mm512_fmadd_ps(a, b0, row[0]);
                row[1] = _mm512_fmadd_ps(a, b1, row[1]);
            }
        }
    }
    acc
}

/// Writes 8 rows of 16 steps each (`rows[i][s]`) transposed into `steps`: step `s`'s 8
/// values go to `steps[s·width + offset..][..8]`. Two 8 × 8 transposes of three shuffle
/// rounds each.
///
/// # Safety
/// AVX2 must be present.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn transpose_8x16(rows: &[&[f32]], steps: &mut [f32], width: usize, offset: usize) {
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
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn micro_tile_avx2(a: RowsOfA<'_>, b_panel: &[f32], tile: Tile, epilogue: Epilogue) {
    // As in `micro_tile_avx512`: ask for the tile's lines of `C` before the multiply.
    for i in 0..tile.rows {
        // SAFETY: row `i < rows` of the tile is inside `C`, and so is its column
        // `cols - 1`. A prefetch reads nothing architecturally.
        unsafe {
            let row = tile.c.offset(i as isize * tile.row_stride);
            _mm_prefetch::<_MM_HINT_T0>(row.cast());
            _mm_prefetch::<_MM_HINT_T0>(row.add(tile.cols - 1).cast());
        }
    }
    // SAFETY: the caller's contract on `a` and `b_panel` is `steps_avx2`' contract.
    let acc = unsafe {
        match a {
            RowsOfA::Packed(panel) => steps_avx2::<false>(panel.as_ptr(), 0, b_panel),
            RowsOfA::InPlace { start, row_stride } => {
                steps_avx2::<true>(start, row_stride, b_panel)
            }
        }
    };
    if tile.cols == AVX2_NR {
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
    let mut sums = [[0.0f32; AVX2_NR]; AVX2_MR];
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

/// The `kc` steps of one 6 × 16 tile in registers (as [`steps_avx512`], on 8-lane vectors).
///
/// # Safety
/// AVX2 and FMA must be present; `b_panel` holds `kc · 16` floats; `a` addresses `kc · 6`
/// readable floats of a packed panel, or 6 rows of `kc` readable floats each.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
#[inline]
unsafe fn steps_avx2<const IN_PLACE: bool>(
    a: *const f32,
    a_row_stride: isize,
    b_panel: &[f32],
) -> [[__m256; 2]; AVX2_MR] {
    let kc = b_panel.len() / AVX2_NR;
    let bp = b_panel.as_ptr();
    let mut acc: [[__m256; 2]; AVX2_MR] = [[_mm256_setzero_ps(); 2]; AVX2_MR];
    // Opaque row pointers, as in `steps_avx512`.
    let rows: [*const f32; AVX2_MR] = if IN_PLACE {
        std::hint::black_box(std::array::from_fn(|i| {
            a.wrapping_offset(i as isize * a_row_stride)
        }))
    } else {
        [a; AVX2_MR]
    };
    for p in 0..kc {
        // SAFETY: `p < kc`, so `p·16 + 16 ≤ kc·16` is inside the `B` panel, and `(i, p)` for
        // `i < 6` is inside the rows of `A` the caller vouches for.
        unsafe {
            // One step of the panel is one cache line; the prefetch address may lie past
            // the panel's end (`wrapping_add`; a prefetch never faults).
            _mm_prefetch::<_MM_HINT_T0>(bp.wrapping_add((p + PREFETCH_STEPS) * AVX2_NR).cast());
            let b0 = _mm256_loadu_ps(bp.add(p * AVX2_NR));
            let b1 = _mm256_loadu_ps(bp.add(p * AVX2_NR + 8));
            for (i, row) in acc.iter_mut().enumerate() {
                let value = if IN_PLACE {
                    *rows[i].add(p)
                } else {
                    *a.add(p * AVX2_MR + i)
                };
                let a = _mm256_set1_ps(value);
                row[0] = _mm256_fmadd_ps(a, b0, row[0]);
                row[1] = _mm256_fmadd_ps(a, b1, row[1]);
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

    /// The kernels this CPU runs, and `Baseline`, which every GEMM declines.
    fn kernels() -> Vec<VectorIsa> {
        match widest() {
            VectorIsa::Avx512 => vec![VectorIsa::Avx512, VectorIsa::Avx2, VectorIsa::Baseline],
            VectorIsa::Avx2 => vec![VectorIsa::Avx2, VectorIsa::Baseline],
            VectorIsa::Baseline => vec![VectorIsa::Baseline],
        }
    }

    /// [`gemm_on`] `isa` on slices (dimensions at least 1, strides non-negative), after
    /// asserting that the last element each operand's strides address lies inside its slice.
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
            let ran = gemm_on_slices(isa, (m, k, n), &a, (2 * k, 2), &b, (n, 1), 0.0, &mut c, n);
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
        // SAFETY: nothing is addressed when a dimension is zero.
        let ran = unsafe { gemm((1, 0, 1), s, s, 0.0, c.as_mut_ptr(), 1) };
        assert!(!ran);
        assert_eq!(c[0], 0.0);
    }
}
