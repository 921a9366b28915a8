//! Elementwise loops compiled for the widest vector unit the CPU has.
//!
//! The crate is built for the baseline x86-64 target (SSE2: 4 f32 lanes, no fused multiply-add),
//! so that one binary runs on every x86-64 machine. The loops of GELU, the norms, softmax,
//! cross-entropy and AdamW are written to vectorise, but at that baseline they use a quarter of
//! an AVX-512 core's lanes. [`vectorized!`] runs a closure through a trampoline compiled with
//! AVX-512 (or AVX2) enabled, chosen once at run time; the closure is inlined into the
//! trampoline, so its loops are compiled for those lanes.
//!
//! The values do not change: Rust never contracts `a * b + c` into a fused multiply-add nor
//! reorders float sums on its own, so the wider code computes every element with the same
//! operations in the same order (tested by `wide_and_baseline_loops_agree_bit_for_bit`).

/// The vector instruction sets a trampoline exists for, widest first.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum VectorIsa {
    /// AVX-512 F/BW/DQ/VL with AVX2 and FMA: 16 f32 lanes.
    Avx512,
    /// AVX2 with FMA: 8 f32 lanes.
    Avx2,
    /// What the binary was compiled for.
    Baseline,
}

impl VectorIsa {
    /// The widest this CPU runs.
    fn detect() -> Self {
        #[cfg(target_arch = "x86_64")]
        {
            use std::arch::is_x86_feature_detected as has;
            if has!("avx512f")
                && has!("avx512bw")
                && has!("avx512dq")
                && has!("avx512vl")
                && has!("avx2")
                && has!("fma")
            {
                return Self::Avx512;
            }
            if has!("avx2") && has!("fma") {
                return Self::Avx2;
            }
        }
        Self::Baseline
    }
}

/// The widest instruction set this CPU has. `std` caches the CPUID query, so a dispatch
/// costs a few atomic loads per kernel call (per chunk or row, never per element).
pub(crate) fn widest() -> VectorIsa {
    VectorIsa::detect()
}

/// Runs a closure `|| body`, compiled for the widest vector instruction set this CPU has (see
/// the module docs); `vectorized!(isa, || body)` runs it for `isa` instead (a set the CPU
/// lacks falls back to the baseline). Keep the closure at the leaf: one kernel's loop over a
/// chunk, inside any rayon split.
///
/// A macro, not a function taking the closure: each instruction set gets its own copy of the
/// closure, called from one place only, which LLVM always inlines into its trampoline. One
/// closure called from three trampolines would be a function of its own, compiled for the
/// baseline.
macro_rules! vectorized {
    ($f:expr) => {
        $crate::kernels::vector_isa::vectorized!($crate::kernels::vector_isa::widest(), $f)
    };
    ($isa:expr, $f:expr) => {{
        use $crate::kernels::vector_isa::{VectorIsa, widest};
        match ($isa, widest()) {
            #[cfg(target_arch = "x86_64")]
            (VectorIsa::Avx512, VectorIsa::Avx512) => {
                // SAFETY: the CPU has every feature `avx512` is compiled for (`detect`).
                // Tested by `wide_and_baseline_loops_agree_bit_for_bit`.
                unsafe { $crate::kernels::vector_isa::avx512($f) }
            }
            #[cfg(target_arch = "x86_64")]
            (VectorIsa::Avx2, VectorIsa::Avx512 | VectorIsa::Avx2) => {
                // SAFETY: the CPU has AVX2 and FMA (`detect` requires both for either wide
                // set). Tested by `wide_and_baseline_loops_agree_bit_for_bit`.
                unsafe { $crate::kernels::vector_isa::avx2($f) }
            }
            _ => ($f)(),
        }
    }};
}
pub(crate) use vectorized;

/// The AVX-512 trampoline: `f` inlined here is compiled with these features.
///
/// # Safety
/// The CPU must have every enabled feature ([`widest`] returned `Avx512`).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx2,fma")]
pub(crate) unsafe fn avx512<R>(f: impl FnOnce() -> R) -> R {
    f()
}

/// The AVX2 trampoline.
///
/// # Safety
/// The CPU must have AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
pub(crate) unsafe fn avx2<R>(f: impl FnOnce() -> R) -> R {
    f()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::math::{erf_f32, exp_f32, tanh_f32};

    #[inline(always)]
    fn loop_of(xs: &[f32], out: &mut [f32]) {
        for (o, &x) in out.iter_mut().zip(xs) {
            *o = 0.5 * x * (1.0 + erf_f32(x * std::f32::consts::FRAC_1_SQRT_2))
                + exp_f32(-x * x) * tanh_f32(x) / (1.0 + x.abs());
        }
    }

    #[test]
    fn wide_and_baseline_loops_agree_bit_for_bit() {
        let xs: Vec<f32> = (0..4099).map(|i| (i as f32 - 2049.0) * 0.004_7).collect();
        let mut baseline = vec![0.0; xs.len()];
        vectorized!(VectorIsa::Baseline, || loop_of(&xs, &mut baseline));
        for isa in [VectorIsa::Avx2, VectorIsa::Avx512] {
            let mut wide = vec![0.0; xs.len()];
            vectorized!(isa, || loop_of(&xs, &mut wide));
            for (i, (w, b)) in wide.iter().zip(&baseline).enumerate() {
                assert_eq!(
                    w.to_bits(),
                    b.to_bits(),
                    "{isa:?} element {i} (x = {})",
                    xs[i]
                );
            }
        }
        let mut detected = vec![0.0; xs.len()];
        let seven = vectorized!(|| {
            loop_of(&xs, &mut detected);
            7
        });
        assert_eq!(seven, 7);
        assert_eq!(detected, baseline);
        // A value the formula gives in closed form: gelu(0) = 0, e⁰·tanh 0 = 0.
        let mut zero = [1.0f32];
        vectorized!(|| loop_of(&[0.0], &mut zero));
        assert_eq!(zero, [0.0]);
    }
}
