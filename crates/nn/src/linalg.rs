//! Matrix multiplication through the `matrixmultiply` GEMM kernels, in row or column blocks
//! spread over rayon's threads.
//!
//! `matrixmultiply` was measured against the `gemm` crate at 1024³ f32 on this project's
//! machine (docs/nn.md has the numbers) and was as fast or faster at 1 and 2 threads, with no
//! extra dependency. Its own threading is fixed per process by an environment variable, so
//! instead the rows of the output are split into one block per rayon thread, each block a
//! single-threaded GEMM: the caller's rayon pool (`ThreadPool::install`) decides the thread
//! count per call, as `torch.set_num_threads` does. Wide products of few rows split their
//! columns instead (`splits_columns`: whichever packs fewer operand elements).

use hypershard_tensor::Tensor;
use rayon::prelude::*;

use crate::kernels::{Float, RawGemm, add_row, load, same_device, store, with_float};
use crate::{Error, Result};

/// Which operands of [`matmul_with`] are used transposed.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct MatmulOptions {
    /// Use `aᵀ` instead of `a` (then `a` is `[k, m]`).
    pub transpose_a: bool,
    /// Use `bᵀ` instead of `b` (then `b` is `[n, k]`).
    pub transpose_b: bool,
}

/// The sizes and element strides of one GEMM `C[m, n] = A[m, k] · B[k, n]` over row-major
/// buffers (a transposed operand is the same buffer with its strides swapped).
#[derive(Debug, Clone, Copy)]
pub(crate) struct GemmShape {
    pub(crate) m: usize,
    pub(crate) k: usize,
    pub(crate) n: usize,
    pub(crate) a_row_stride: isize,
    pub(crate) a_col_stride: isize,
    pub(crate) b_row_stride: isize,
    pub(crate) b_col_stride: isize,
}

impl GemmShape {
    /// The shape of `op(A) · op(B)` where `A` is stored `[m, k]` (or `[k, m]` when
    /// `transpose_a`) and `B` `[k, n]` (or `[n, k]` when `transpose_b`), both row-major.
    pub(crate) fn new(m: usize, k: usize, n: usize, options: MatmulOptions) -> Result<Self> {
        let stride = |size: usize| {
            isize::try_from(size).map_err(|_| Error::SizeOverflow { op: "matmul", size })
        };
        let (a_row_stride, a_col_stride) = if options.transpose_a {
            (1, stride(m)?)
        } else {
            (stride(k)?, 1)
        };
        let (b_row_stride, b_col_stride) = if options.transpose_b {
            (1, stride(k)?)
        } else {
            (stride(n)?, 1)
        };
        Ok(GemmShape {
            m,
            k,
            n,
            a_row_stride,
            a_col_stride,
            b_row_stride,
            b_col_stride,
        })
    }
}

/// `a · b` for two 2-D tensors of one float dtype; see [`matmul_with`].
pub fn matmul(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    matmul_with(a, b, MatmulOptions::default())
}

/// `op(a) · op(b)` where `op` transposes the operands named in `options`.
///
/// f32 and f64 run natively (sgemm / dgemm); bf16 and f16 are converted to f32, multiplied,
/// and the result is rounded back once, so the accumulation is in f32 as in torch's CPU
/// kernels. Any strided views are accepted (they are gathered first). The result is a new
/// contiguous tensor of the inputs' dtype.
pub fn matmul_with(a: &Tensor, b: &Tensor, options: MatmulOptions) -> Result<Tensor> {
    const OP: &str = "matmul";
    if a.ndim() != 2 {
        return Err(Error::BadShape {
            op: OP,
            expected: "a 2-D left operand".to_string(),
            actual: a.shape().to_vec(),
        });
    }
    if b.ndim() != 2 {
        return Err(Error::BadShape {
            op: OP,
            expected: "a 2-D right operand".to_string(),
            actual: b.shape().to_vec(),
        });
    }
    if a.dtype() != b.dtype() {
        return Err(Error::DTypeMismatch {
            op: OP,
            lhs: a.dtype(),
            rhs: b.dtype(),
        });
    }
    let (a_rows, a_cols) = (a.shape()[0], a.shape()[1]);
    let (b_rows, b_cols) = (b.shape()[0], b.shape()[1]);
    let (m, k) = if options.transpose_a {
        (a_cols, a_rows)
    } else {
        (a_rows, a_cols)
    };
    let (k_b, n) = if options.transpose_b {
        (b_cols, b_rows)
    } else {
        (b_rows, b_cols)
    };
    if k != k_b {
        return Err(Error::ShapeMismatch {
            op: OP,
            lhs: a.shape().to_vec(),
            rhs: b.shape().to_vec(),
        });
    }
    // Both operands are gathered row-major; a transpose is then only a swap of strides.
    let shape = GemmShape::new(m, k, n, options)?;
    let device = same_device(OP, &[a, b])?;
    #[cfg(feature = "cuda")]
    if device.is_cuda() {
        return crate::kernels::cuda::matmul(a, b, options, [m, n]);
    }
    // The operands are read where they live and the product is stored there, rounded back
    // once for bf16/f16 (`store`).
    with_float!(OP, a.dtype(), F => {
        let out = gemm(&load::<F>(a)?, &load::<F>(b)?, shape)?;
        store(out, &[m, n], a.dtype(), &device)
    })
}

/// `out = op(a) · op(b)` for row-major f32 buffers, in place: `a` holds `[m, k]` (or `[k, m]`
/// when `options.transpose_a`), `b` `[k, n]` (or `[n, k]`), `out` `[m, n]` (overwritten).
/// The GEMM a `Linear` runs, without a tensor around it (over the current thread pool; see
/// [`with_num_threads`](crate::with_num_threads)). A length that does not match `[m, k, n]`
/// is [`Error::ShapeMismatch`].
pub fn matmul_f32_into(
    a: &[f32],
    b: &[f32],
    [m, k, n]: [usize; 3],
    options: MatmulOptions,
    out: &mut [f32],
) -> Result<()> {
    gemm_into(a, b, GemmShape::new(m, k, n, options)?, out)
}

/// Checks that row-major buffers hold exactly the operands `shape` describes, so every index
/// the kernel forms from the strides is in bounds.
fn check_lengths(a_len: usize, b_len: usize, shape: GemmShape) -> Result<()> {
    let overflow = |size| Error::SizeOverflow { op: "matmul", size };
    let a_need = shape.m.checked_mul(shape.k).ok_or(overflow(shape.m))?;
    let b_need = shape.k.checked_mul(shape.n).ok_or(overflow(shape.k))?;
    shape.m.checked_mul(shape.n).ok_or(overflow(shape.m))?;
    if a_len != a_need || b_len != b_need {
        return Err(Error::ShapeMismatch {
            op: "matmul",
            lhs: vec![a_len, a_need],
            rhs: vec![b_len, b_need],
        });
    }
    Ok(())
}

/// Checks that `C` holds exactly the `m · n` elements of `shape`'s product.
fn check_output(c_len: usize, shape: GemmShape) -> Result<()> {
    if c_len != shape.m * shape.n {
        return Err(Error::ShapeMismatch {
            op: "matmul",
            lhs: vec![shape.m, shape.n],
            rhs: vec![c_len],
        });
    }
    Ok(())
}

/// Below this many multiply-adds a GEMM runs on the calling thread: spreading a small
/// product costs more in task hand-off and repeated packing of `B` than it saves.
const PARALLEL_MIN_MULADDS: usize = 1 << 21;
/// Each thread's block has at least this many rows (a multiple of the kernels' 8- and 16-row
/// micro-tiles, so blocks do not end in ragged tiles).
const MIN_BLOCK_ROWS: usize = 32;

/// `C = op(A) · op(B)` for row-major buffers described by `shape`, as a new `[m, n]` buffer.
///
/// The lengths are checked against `shape` first, so the kernel only ever addresses elements
/// inside the slices. With more than one rayon thread and a large enough product, the rows of
/// `C` are split into contiguous blocks computed in parallel.
pub(crate) fn gemm<F: Float>(a: &[F], b: &[F], shape: GemmShape) -> Result<Vec<F>> {
    let mut c = vec![F::ZERO; shape.m.saturating_mul(shape.n)];
    gemm_into(a, b, shape, &mut c)?;
    Ok(c)
}

/// [`gemm`] writing into `c`, which must hold exactly `m · n` elements (overwritten, not
/// accumulated into).
pub(crate) fn gemm_into<F: Float>(a: &[F], b: &[F], shape: GemmShape, c: &mut [F]) -> Result<()> {
    gemm_beta_into(a, b, shape, F::ZERO, None, c)
}

/// `C = op(A) · op(B)` with `bias[j]` then added to column `j` of every row, into `c` (every
/// element overwritten): a `Linear`'s forward. The same bits as [`gemm_into`] followed by a
/// pass adding the bias; the packed f32 GEMM adds it to each tile while the tile is in L1.
pub(crate) fn gemm_bias_into<F: Float>(
    a: &[F],
    b: &[F],
    shape: GemmShape,
    bias: &[F],
    c: &mut [F],
) -> Result<()> {
    if bias.len() != shape.n {
        return Err(Error::ShapeMismatch {
            op: "matmul bias",
            lhs: vec![shape.m, shape.n],
            rhs: vec![bias.len()],
        });
    }
    gemm_beta_into(a, b, shape, F::ZERO, Some(bias), c)
}

/// `C += op(A) · op(B)` into `c`, which must hold exactly `m · n` elements: accumulating in
/// the kernel spares a temporary `[m, n]` product when a gradient is summed over chunks.
pub(crate) fn gemm_accumulate_into<F: Float>(
    a: &[F],
    b: &[F],
    shape: GemmShape,
    c: &mut [F],
) -> Result<()> {
    gemm_beta_into(a, b, shape, F::ONE, None, c)
}

/// `C = op(A) · op(B) + beta · C`, with `beta` zero (overwrite) or one (accumulate), then
/// `bias` (`n` values, checked by the caller) added to every row.
fn gemm_beta_into<F: Float>(
    a: &[F],
    b: &[F],
    shape: GemmShape,
    beta: F,
    bias: Option<&[F]>,
    c: &mut [F],
) -> Result<()> {
    check_lengths(a.len(), b.len(), shape)?;
    check_output(c.len(), shape)?;
    let GemmShape { m, k, n, .. } = shape;
    if m == 0 || n == 0 || k == 0 {
        if beta == F::ZERO {
            c.fill(F::ZERO);
        }
        if let Some(bias) = bias {
            add_row(c, bias);
        }
        return Ok(());
    }
    let threads = rayon::current_num_threads();
    let muladds = m.saturating_mul(k).saturating_mul(n);
    let rows = RowBlock { beta, bias };
    if threads > 1 && muladds >= PARALLEL_MIN_MULADDS && splits_columns(shape, threads) {
        gemm_column_blocks(a, b, shape, rows, c, threads)
    } else if threads > 1 && muladds >= PARALLEL_MIN_MULADDS && m >= 2 * MIN_BLOCK_ROWS {
        let block_rows = m.div_ceil(threads).max(MIN_BLOCK_ROWS);
        c.par_chunks_mut(block_rows * n)
            .enumerate()
            .try_for_each(|(index, block)| gemm_rows(a, b, shape, index * block_rows, rows, block))
    } else {
        gemm_rows(a, b, shape, 0, rows, c)
    }
}

/// What every block of one product does with its piece of `C` besides the product: scale
/// the old values by `beta` and add `bias` (all `n` columns of it) to each row.
#[derive(Clone, Copy)]
struct RowBlock<'a, F> {
    beta: F,
    bias: Option<&'a [F]>,
}

/// Columns of `B` in one block of the kernel's packing (matrixmultiply's f32 `NC`): a thread
/// packs its share of `A` once per such block of its columns.
const PACK_COLUMNS: usize = 1024;
/// Each thread's column block is a multiple of this (the widest micro-tile's columns), so
/// blocks do not end in ragged tiles.
const COLUMN_ALIGN: usize = 16;

/// Whether splitting the columns of `C` over `threads` packs fewer operand elements than
/// splitting its rows. Every thread packs the whole of the operand it does not split: split
/// by rows, each packs all of `B` (`k·n`) and `A`'s rows once per column block; split by
/// columns, each packs all of `A` once per block of its columns and `B` is packed once in
/// total. A product of few rows and many columns (the fused loss head's logits, `[166, 768]`
/// by a `[768, 50 304]` weight) packs its whole weight once per thread when split by rows.
fn splits_columns(shape: GemmShape, threads: usize) -> bool {
    let GemmShape { m, k, n, .. } = shape;
    if n < threads * COLUMN_ALIGN * 2 {
        return false;
    }
    let rows_split = threads
        .saturating_mul(k)
        .saturating_mul(n)
        .saturating_add(m.saturating_mul(k).saturating_mul(n.div_ceil(PACK_COLUMNS)));
    let columns_split = k.saturating_mul(n).saturating_add(
        threads
            .saturating_mul(m)
            .saturating_mul(k)
            .saturating_mul(n.div_ceil(threads).div_ceil(PACK_COLUMNS)),
    );
    columns_split < rows_split || m < 2 * MIN_BLOCK_ROWS
}

/// The raw start of `C` shared by the column blocks of one product.
#[derive(Clone, Copy)]
struct SharedOutput<F>(*mut F);

// SAFETY: the pointer is only dereferenced by `gemm_column_blocks`' tasks, each within its own
// column range of `C` (disjoint from every other task's), while the `&mut [F]` it came from is
// borrowed for the whole parallel loop; `F` is a plain float, so sending a pointer to it is
// sending access to those elements only.
unsafe impl<F: Send> Send for SharedOutput<F> {}
// SAFETY: as for `Send`: the tasks share the pointer but write disjoint elements through it.
unsafe impl<F: Send> Sync for SharedOutput<F> {}

impl<F> SharedOutput<F> {
    /// The address of column `first` of `C`'s first row (a method, so that a closure using
    /// it captures the whole `Send` wrapper, not its raw pointer field).
    ///
    /// # Safety
    /// `first` must be at most the number of elements `C` holds.
    unsafe fn column(self, first: usize) -> *mut F {
        // SAFETY: the caller keeps `first` within `C`'s allocation.
        unsafe { self.0.add(first) }
    }
}

/// `C = op(A) · op(B) + beta · C` with the columns of `C` split into one block per thread
/// (a multiple of [`COLUMN_ALIGN`] wide, the last block the remainder).
fn gemm_column_blocks<F: Float>(
    a: &[F],
    b: &[F],
    shape: GemmShape,
    RowBlock { beta, bias }: RowBlock<'_, F>,
    c: &mut [F],
    threads: usize,
) -> Result<()> {
    check_lengths(a.len(), b.len(), shape)?;
    check_output(c.len(), shape)?;
    let GemmShape { m, k, n, .. } = shape;
    let overflow = |size| Error::SizeOverflow { op: "matmul", size };
    let c_row_stride = isize::try_from(n).map_err(|_| overflow(n))?;
    let width = n.div_ceil(threads).div_ceil(COLUMN_ALIGN) * COLUMN_ALIGN;
    let blocks = n.div_ceil(width);
    // The blocks' column offsets into `B` are `first · b_col_stride` with `first < n`, inside
    // `B` by `check_lengths`.
    let b_col_stride = usize::try_from(shape.b_col_stride).map_err(|_| overflow(n))?;
    let output = SharedOutput(c.as_mut_ptr());
    (0..blocks).into_par_iter().for_each(|block| {
        let first = block * width;
        let cols = width.min(n - first);
        // SAFETY: `check_lengths` proved `a.len() == m·k` and `b.len() == k·n` for the
        // strides of row-major `[m, k]` / `[k, m]` and `[k, n]` / `[n, k]` buffers, so the
        // element `(p, j)` of `op(B)` is at `p·rs + j·cs < k·n`; starting at column `first`
        // (`first < n`, offset `first · b_col_stride`), the kernel addresses `(p, first + j)`
        // for `j < cols`, `first + cols ≤ n`: elements of `B`. `A` is addressed from its start
        // with its own strides. `C` holds `m·n` elements (checked above); this block writes
        // (and with `beta ≠ 0` reads) `(i, first + j)` for `i < m`, `j < cols` through row
        // stride `n`: inside `C`, and in no other block's columns, while the loop holds the
        // only borrow of `c`. `C` cannot alias `A` or `B` (a `&mut` beside two `&`). Tested by
        // `column_blocks_are_bitwise_the_single_thread_product`.
        // The block's bias is columns `first..first + cols` of the `n` the caller checked.
        unsafe {
            F::gemm_raw(RawGemm {
                m,
                k,
                n: cols,
                a: a.as_ptr(),
                a_strides: [shape.a_row_stride, shape.a_col_stride],
                b: b.as_ptr().add(first * b_col_stride),
                b_strides: [shape.b_row_stride, shape.b_col_stride],
                beta,
                c: output.column(first),
                c_row_stride,
                bias: bias.map(|bias| bias[first..first + cols].as_ptr()),
            });
        }
    });
    Ok(())
}

/// Computes rows `first_row .. first_row + c_block.len() / n` of `C` into `c_block`.
fn gemm_rows<F: Float>(
    a: &[F],
    b: &[F],
    shape: GemmShape,
    first_row: usize,
    RowBlock { beta, bias }: RowBlock<'_, F>,
    c_block: &mut [F],
) -> Result<()> {
    check_lengths(a.len(), b.len(), shape)?;
    let rows = c_block.len() / shape.n.max(1);
    if rows * shape.n != c_block.len() || first_row + rows > shape.m {
        return Err(Error::ShapeMismatch {
            op: "matmul",
            lhs: vec![first_row, rows, shape.m],
            rhs: vec![c_block.len(), shape.n],
        });
    }
    let a_offset = isize::try_from(first_row)
        .ok()
        .and_then(|row| row.checked_mul(shape.a_row_stride))
        .and_then(|offset| usize::try_from(offset).ok())
        .ok_or(Error::SizeOverflow {
            op: "matmul",
            size: first_row,
        })?;
    let c_row_stride = isize::try_from(shape.n).map_err(|_| Error::SizeOverflow {
        op: "matmul",
        size: shape.n,
    })?;
    if rows == 0 || shape.k == 0 {
        if beta == F::ZERO {
            c_block.fill(F::ZERO);
        }
        if let Some(bias) = bias {
            add_row(c_block, bias);
        }
        return Ok(());
    }
    if a_offset >= a.len() {
        return Err(Error::SizeOverflow {
            op: "matmul",
            size: a_offset,
        });
    }
    // SAFETY: `check_lengths` proved `a.len() == m*k`, `b.len() == k*n`, and the strides are
    // those of row-major `[m, k]` / `[k, m]` and `[k, n]` / `[n, k]` buffers (see
    // `GemmShape::new`), so the element `(i, p)` of `op(A)` is at `i*rs + p*cs < m*k`. Starting
    // at `first_row * a_row_stride` (`a_offset`, in bounds because `first_row < m` as
    // `rows ≥ 1`, `k ≥ 1` and `a_offset < a.len()` are checked above), the kernel addresses
    // `(first_row + i)*rs + p*cs` for `i < rows`, `p < k`: elements of `A`. `B` is addressed
    // from its start with its own strides. `c_block` holds exactly `rows * n` elements
    // (checked above) with row stride `n`; it is exclusively borrowed and cannot alias `a`
    // or `b`. With `beta = 0` the kernel never reads `c_block` before writing it; otherwise
    // it reads the initialised elements of a `&mut [F]` (tested by
    // `accumulate_adds_the_product_to_c_in_parallel_blocks`).
    // The bias holds `n` values (checked by the caller).
    unsafe {
        F::gemm_raw(RawGemm {
            m: rows,
            k: shape.k,
            n: shape.n,
            a: a.as_ptr().add(a_offset),
            a_strides: [shape.a_row_stride, shape.a_col_stride],
            b: b.as_ptr(),
            b_strides: [shape.b_row_stride, shape.b_col_stride],
            beta,
            c: c_block.as_mut_ptr(),
            c_row_stride,
            bias: bias.map(<[F]>::as_ptr),
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests;
