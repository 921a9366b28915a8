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
mod avx2;
#[cfg(target_arch = "x86_64")]
mod avx512;
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
    /// One micro-tile (the contract of [`avx512::micro_tile`]).
    tile: unsafe fn(RowsOfA<'_>, &[f32], Tile, Epilogue),
    /// The vector transpose [`pack`] uses for operands stored along `k`.
    transposer: Transposer,
}

/// The AVX-512 kernel. A 12-row panel of `A` (18 KiB at `kc` 384) stays in a 48 KiB L1; the
/// `B` block (720 KiB) in a 2 MiB L2.
#[cfg(target_arch = "x86_64")]
const AVX512: Kernel = Kernel {
    kc: 384,
    nc: 480,
    mc: 1536,
    tile: avx512::micro_tile,
    transposer: Transposer {
        rows: 16,
        run: avx512::transpose_16x16,
    },
};

/// The AVX2 kernel. A 6-row panel of `A` (6 KiB at `kc` 256) and the 16 KiB `B` panel
/// passing under it share a 32 KiB L1; the `B` block (240 KiB) stays in a 512 KiB L2.
#[cfg(target_arch = "x86_64")]
const AVX2: Kernel = Kernel {
    kc: 256,
    nc: 240,
    mc: 1536,
    tile: avx2::micro_tile,
    transposer: Transposer {
        rows: 8,
        run: avx2::transpose_8x16,
    },
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

/// One product `C = A · B + beta · C`, then `bias` added to every row when given: `A`
/// `[m, k]`, `B` `[k, n]`, `C` `[m, n]` with row stride `c_row_stride` (column stride 1).
#[derive(Clone, Copy)]
pub(crate) struct Product {
    pub(crate) m: usize,
    pub(crate) k: usize,
    pub(crate) n: usize,
    pub(crate) a: Strided,
    pub(crate) b: Strided,
    pub(crate) beta: f32,
    pub(crate) c: *mut f32,
    pub(crate) c_row_stride: isize,
    /// `n` readable floats, element `j` added to column `j` of every row once the whole sum
    /// is in `C`: the rounding of a separate pass over `C`, without the pass (see
    /// [`add_bias`]).
    pub(crate) bias: Option<*const f32>,
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

/// The product `product` describes on the widest micro-kernel this CPU runs. Returns
/// `false`, doing nothing, when the CPU has neither AVX-512F nor AVX2 with FMA or a dimension
/// is zero; the caller then uses another GEMM.
///
/// # Safety
/// As [`Float::gemm_raw`](super::Float::gemm_raw): for `i < m`, `p < k`, `j < n` the elements
/// `(i, p)` of `a` and `(p, j)` of `b` must be readable, `c + i·c_row_stride + j` writable
/// (and initialised when `beta ≠ 0`), `bias + j` readable when a bias is given, and `C` must
/// not overlap `A`, `B` or the bias.
pub(crate) unsafe fn gemm(product: Product) -> bool {
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
    unsafe { blocked::<{ avx512::MR }, { avx512::NR }>(&AVX512, product, packs) }
}

/// [`blocked`] compiled for AVX2 with FMA.
///
/// # Safety
/// AVX2 and FMA must be present; otherwise as [`blocked`].
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn blocked_avx2(product: Product, packs: &mut Packs) {
    // SAFETY: the caller's contract, and the AVX2 kernel's tile is 6 × 16.
    unsafe { blocked::<{ avx2::MR }, { avx2::NR }>(&AVX2, product, packs) }
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
        bias,
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
    let transposer = kernel.transposer;
    let mut p0 = 0;
    while p0 < k {
        let kc = kernel.kc.min(k - p0);
        let epilogue = if p0 == 0 { first } else { Epilogue::Accumulate };
        // The bias goes on while the last block's tile is still in L1.
        let tile_bias = if p0 + kc == k { bias } else { None };
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
                        // On the last block the tile's elements are initialised (just
                        // stored), and columns `j..j + cols` of the bias are readable floats
                        // apart from `C` (the caller's contract). Tested by
                        // `a_fused_bias_is_bitwise_a_separate_pass`.
                        unsafe {
                            let tile = Tile {
                                c: c.offset(i as isize * c_row_stride + j),
                                row_stride: c_row_stride,
                                rows,
                                cols,
                            };
                            (kernel.tile)(rows_of_a, b_panel, tile, epilogue);
                            if let Some(bias) = tile_bias {
                                add_bias(tile, bias.offset(j));
                            }
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
    /// Rows of an operand turned into steps at once.
    rows: usize,
    /// Writes `rows` rows transposed into panel steps (the contract of
    /// [`avx512::transpose_16x16`]).
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

/// Adds `bias[j]` to column `j < cols` of each of the tile's rows, just after the tile's last
/// sums were stored: the tile is in L1, where a pass over `C` after the product would find
/// it in L3 or memory (a `Linear`'s bias add was about 3 % of a medium training step). The
/// element is rounded once more, as that pass would round it, so the results are the same
/// bits. `#[inline(always)]` into [`blocked`], so it runs on the kernel's vector width.
///
/// # Safety
/// The tile's `rows × cols` elements of `C` must be initialised and writable, `bias` must
/// address `cols` readable floats, and the two must not overlap.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn add_bias(tile: Tile, bias: *const f32) {
    // SAFETY: `cols` readable floats (this function's contract), not written while the slice
    // lives (they do not overlap `C`).
    let bias = unsafe { std::slice::from_raw_parts(bias, tile.cols) };
    for i in 0..tile.rows {
        // SAFETY: row `i < rows` of the tile: `cols` initialised, writable elements of `C`.
        let row = unsafe {
            std::slice::from_raw_parts_mut(tile.c.offset(i as isize * tile.row_stride), tile.cols)
        };
        for (x, &b) in row.iter_mut().zip(bias) {
            *x += b;
        }
    }
}

/// Where a micro-tile's results go: `rows × cols` of `C` from `c` with row stride
/// `row_stride` (column stride 1).
#[cfg(target_arch = "x86_64")]
#[derive(Clone, Copy)]
struct Tile {
    c: *mut f32,
    row_stride: isize,
    rows: usize,
    cols: usize,
}

/// Where a micro-tile reads its `MR` rows of `A` (the tile's rows).
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

#[cfg(test)]
mod tests;
