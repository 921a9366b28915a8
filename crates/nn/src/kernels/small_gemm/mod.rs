//! Packing-free f32 GEMM kernels for products with few rows: a `Linear` layer on a small
//! batch (`[32, 1024] · [1024, 1024]ᵀ` in the FSDP benchmark).
//!
//! matrixmultiply copies ("packs") both operands into panel order before its micro-kernel
//! runs. That pays off when each packed panel is reused by many rows; with 32 rows and a
//! 1024 × 1024 weight it is not: a profile of the benchmark's single-rank step showed 25% of
//! the time in packing against 23% in the multiply itself. These kernels read both operands
//! where they lie, keep a block of results in registers (4 × 4 or 4 × 64 with AVX-512, 3 × 3
//! or 6 × 16 with AVX2) and touch every weight element once per block of rows.
//!
//! Three shapes, all over row-major, contiguous operands:
//! - [`gemm_nt`]: `C[m, n] = A[m, k] · B[n, k]ᵀ` (forward: `x · Wᵀ`), dot products along `k`;
//! - [`gemm_nn`]: `C[m, n] = A[m, k] · B[k, n]` (input gradient: `dy · W`), rows of `B` scaled
//!   and summed;
//! - [`gemm_tn`]: `C[m, n] = A[k, m]ᵀ · B[k, n]`, the same kernel reading `A` down its columns
//!   (each element of `A` is broadcast on its own, so no transposed copy is needed).
//!
//! With AVX-512F they run on 16-lane vectors, with AVX2 and FMA on 8-lane ones. Each entry
//! point returns `false`, doing nothing, when the CPU has neither, the shape is outside the
//! kernels' range (an empty dim, or for `nt` and `nn` `m` ≥ [`MAX_ROWS`]) or a slice length
//! does not match the shape; the caller then uses the general GEMM.

#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
mod avx512;

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
            unsafe { avx512::nt(a, b, m, k, n, c) };
            return true;
        }
        Kernels::Avx2 => {
            // SAFETY: AVX2 and FMA are present, as above.
            unsafe { avx2::nt(a, b, m, k, n, c) };
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
            unsafe { avx512::nn(a, a_strides, b, shape, c) };
            return true;
        }
        Kernels::Avx2 => {
            // SAFETY: AVX2 and FMA are present, as above.
            unsafe { avx2::nn(a, a_strides, b, shape, c) };
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

/// Which piece of `C` one block of an `nn` kernel updates: rows from `i`, columns `j..j+width`,
/// summing over `p0..p1`.
#[derive(Clone, Copy)]
struct NnBlock {
    i: usize,
    j: usize,
    width: usize,
    p0: usize,
    p1: usize,
}

/// Whether the kernels run on this CPU (what tests expect of them).
#[cfg(test)]
pub(crate) fn available() -> bool {
    Kernels::detect() != Kernels::None
}

#[cfg(test)]
mod tests;
