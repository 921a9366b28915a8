//! Vectorisable f32 versions of `exp`, `erf` and `tanh`.
//!
//! The standard library's `f32::exp` is a call into libm that the compiler cannot vectorise;
//! softmax, GELU and cross-entropy evaluate it millions of times per step. These versions use
//! only arithmetic, comparisons and bit casts, so loops over them compile to SIMD code. The
//! exponential's polynomial and erf's series are in fused multiply-adds (`mul_add`, one
//! rounding each, so the same bits on every path): the vector trampolines compile them to FMA
//! instructions, and a CPU without FMA gets a software `fmaf`, slower but exact. erf's
//! rational tail keeps a multiply and an add per term: fused, its rounding moved its error at
//! 0.53 past the 3e-7 the tests hold it to. f64 keeps the standard library (the finite
//! difference tests need its last bits).

/// `1.5 · 2²³`: adding it to a float of magnitude below 2²² rounds to an integer, and the low
/// mantissa bits of the sum are that integer (the classic round-by-addition trick).
const ROUND_MAGIC: f32 = 12_582_912.0;
const LOG2_E: f32 = std::f32::consts::LOG2_E;
/// ln 2 split into a part with few mantissa bits (exact products with small integers) and the
/// remainder (Cody and Waite's reduction).
const LN2_HI: f32 = 0.693_359_4;
const LN2_LO: f32 = -2.121_944_4e-4;
/// Beyond these the result is `+∞` or `0`; within them `2ⁿ` is a normal float.
const EXP_MAX: f32 = 88.0;
const EXP_MIN: f32 = -87.0;

/// `eˣ` within about 2 ulp for `x` in `[-87, 88]`; `+∞` above (and for `+∞`), `0` below
/// (and for `-∞`), NaN for NaN.
///
/// `x = n·ln2 + r` with `|r| ≤ ln2/2`; `eʳ` by a degree-6 minimax polynomial (Cephes'
/// coefficients) and `2ⁿ` built directly in the exponent bits.
#[inline]
pub(crate) fn exp_f32(x: f32) -> f32 {
    let value = exp_in_range(x.clamp(EXP_MIN, EXP_MAX));
    if x > EXP_MAX {
        f32::INFINITY
    } else if x < EXP_MIN {
        0.0
    } else if x.is_nan() {
        x
    } else {
        value
    }
}

/// [`exp_f32`] of an argument that is never positive, clamped at `EXP_MIN` (where `eˣ` is
/// about 2e-38) instead of flushed to zero below it: it cannot overflow, and a NaN stays NaN
/// through the clamp, so the checks for those are left out. For GELU's `e^(−x²)`.
#[inline]
fn exp_nonpositive_f32(x: f32) -> f32 {
    exp_in_range(x.clamp(EXP_MIN, 0.0))
}

/// `eˣ` for `x` in `[EXP_MIN, EXP_MAX]` (see [`exp_f32`]).
#[inline]
fn exp_in_range(clamped: f32) -> f32 {
    let shifted = clamped * LOG2_E + ROUND_MAGIC;
    let n = shifted - ROUND_MAGIC;
    // The low bits of `shifted` hold `n` (|n| ≤ 127) in two's complement relative to the magic.
    let n_int = shifted.to_bits().wrapping_sub(ROUND_MAGIC.to_bits()) as i32;
    let r = clamped - n * LN2_HI - n * LN2_LO;
    let mut p: f32 = 1.987_569_1e-4;
    p = p.mul_add(r, 1.398_199_9e-3);
    p = p.mul_add(r, 8.333_452e-3);
    p = p.mul_add(r, 4.166_579_6e-2);
    p = p.mul_add(r, 1.666_666_5e-1);
    p = p.mul_add(r, 0.5);
    let er = (p * r).mul_add(r, r) + 1.0;
    // n + 127 lies in [1, 254] after the clamp, a valid biased exponent.
    let scale = f32::from_bits(((n_int + 127) as u32) << 23);
    er * scale
}

/// The error function within 3e-7 absolute (1.5e-7 from the formula, the rest f32 rounding) (Abramowitz and Stegun 7.1.26, with the
/// vectorisable [`exp_f32`]); f32's own rounding is 6e-8 near 1.
///
/// Below `|x| = 0.5` the Maclaurin series is used instead: the formula's `1 − y` cancels there,
/// and the series (truncated after x¹¹, remainder below 1.3e-8) is accurate to f32 rounding.
#[inline]
pub(crate) fn erf_f32(x: f32) -> f32 {
    let a = x.abs();
    let tail = 1.0 - erfc_ratio(a) * exp_f32(-a * a);
    let value = if a < SERIES_BELOW {
        erf_series(a)
    } else {
        tail
    };
    value.copysign(x)
}

/// Below this `|x|` erf is summed from its Maclaurin series, where the tail formula cancels.
const SERIES_BELOW: f32 = 0.5;

/// `erf a` for `0 ≤ a < 0.5` by its Maclaurin series, truncated after a¹¹ (the remainder is
/// below 1.3e-8): `2/√π · (a − a³/3 + a⁵/10 − a⁷/42 + a⁹/216 − a¹¹/1320)`.
#[inline]
fn erf_series(a: f32) -> f32 {
    let x2 = a * a;
    let mut series: f32 = -1.0 / 1320.0;
    series = series.mul_add(x2, 1.0 / 216.0);
    series = series.mul_add(x2, -1.0 / 42.0);
    series = series.mul_add(x2, 0.1);
    series = series.mul_add(x2, -1.0 / 3.0);
    series = series.mul_add(x2, 1.0);
    std::f32::consts::FRAC_2_SQRT_PI * a * series
}

/// `erfc(a) · e^(a²)` for `a ≥ 0`: Abramowitz and Stegun 7.1.26's rational function of
/// `t = 1 / (1 + p·a)`.
#[inline]
fn erfc_ratio(a: f32) -> f32 {
    let t = 1.0 / (1.0 + 0.327_591_1 * a);
    t * (0.254_829_6 + t * (-0.284_496_74 + t * (1.421_413_7 + t * (-1.453_152 + t * 1.061_405_4))))
}

/// `(1 + erf x, e^(−x²))`, what GELU's `Φ(z) = (1 + erf(z/√2)) / 2` and its density need.
///
/// The sum comes from `erfc |x|` directly (`1 −` the series near zero, the tail formula
/// beyond, as [`erf_f32`]): `erfc` itself below zero, `2 − erfc` above. Far below
/// zero, `1 + erf x` taken as a sum cancels (to nothing by −4); `erfc` keeps its leading
/// digits (the formula's relative error, under 1e-3 down to −3, grows to a few percent by
/// −9, where the sum is 1e-36). One exponential, with no overflow to guard against.
#[inline]
pub(crate) fn one_plus_erf_and_gauss_f32(x: f32) -> (f32, f32) {
    let a = x.abs();
    let gauss = exp_nonpositive_f32(-a * a);
    let erfc = if a < SERIES_BELOW {
        1.0 - erf_series(a)
    } else {
        erfc_ratio(a) * gauss
    };
    let sum = if x < 0.0 { erfc } else { 2.0 - erfc };
    (sum, gauss)
}

/// `tanh x = 1 − 2 / (e²ˣ + 1)`, with [`exp_f32`]; exact limits ±1 for large `|x|`. Near 0 the
/// cancellation costs a few ulp of absolute error (about 1e-7), below what bf16 or f32
/// activations resolve.
#[inline]
pub(crate) fn tanh_f32(x: f32) -> f32 {
    1.0 - 2.0 / (exp_f32(2.0 * x) + 1.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exp_matches_f64_within_two_ulp() {
        let mut x = -87.0f32;
        while x <= 88.0 {
            let got = f64::from(exp_f32(x));
            let want = f64::from(x).exp();
            let rel = (got - want).abs() / want;
            assert!(rel < 2.5e-7, "exp({x}) = {got}, want {want} (rel {rel})");
            x += 0.0137;
        }
        assert_eq!(exp_f32(0.0), 1.0);
        assert_eq!(exp_f32(100.0), f32::INFINITY);
        assert_eq!(exp_f32(f32::INFINITY), f32::INFINITY);
        assert_eq!(exp_f32(-100.0), 0.0);
        assert_eq!(exp_f32(f32::NEG_INFINITY), 0.0);
        assert!(exp_f32(f32::NAN).is_nan());
    }

    #[test]
    fn erf_and_tanh_match_f64_references() {
        let mut x = -6.0f32;
        while x <= 6.0 {
            let erf_err = (f64::from(erf_f32(x)) - crate::special::erf(f64::from(x))).abs();
            let bound = if x.abs() < 0.5 { 1e-7 } else { 3e-7 };
            assert!(erf_err < bound, "erf({x}) off by {erf_err}");
            let tanh_err = (f64::from(tanh_f32(x)) - f64::from(x).tanh()).abs();
            assert!(tanh_err < 2e-7, "tanh({x}) off by {tanh_err}");
            x += 0.0031;
        }
        assert_eq!(tanh_f32(50.0), 1.0);
        assert_eq!(tanh_f32(-50.0), -1.0);
        assert_eq!(erf_f32(0.0), 0.0);
    }

    #[test]
    fn one_plus_erf_keeps_its_accuracy_in_both_tails() {
        let mut x = -9.0f32;
        while x <= 9.0 {
            let (sum, gauss) = one_plus_erf_and_gauss_f32(x);
            let want = if x < -3.0 {
                // `erfc |x|` by its continued fraction: `1 + erf x` in f64 cancels out there.
                let a = f64::from(x).abs();
                let mut tail = a;
                for k in (1..=120).rev() {
                    tail = a + (f64::from(k) / 2.0) / tail;
                }
                (-a * a).exp() / (std::f64::consts::PI.sqrt() * tail)
            } else {
                1.0 + crate::special::erf(f64::from(x))
            };
            // Absolute within the tail formula's 1.5e-7 and f32 rounding (the series' near
            // zero). Relative where the sum is tiny (below zero), which a sum `1 + erf x`
            // loses entirely by −4: the formula's own relative error, 7e-4 down to −3, a few
            // percent by −9.
            let err = (f64::from(sum) - want).abs();
            let relative = if x >= -3.0 { 1e-3 } else { 4e-2 };
            assert!(
                err <= 3e-7 && err <= relative * want,
                "1 + erf({x}) = {sum}, want {want}"
            );
            let a = x.abs();
            let g = f64::from(-a * a).exp();
            assert!(
                (f64::from(gauss) - g).abs() <= 3e-7 * g + 2e-38,
                "e^-x² at {x}: {gauss}"
            );
            x += 0.0041;
        }
        let (sum, gauss) = one_plus_erf_and_gauss_f32(f32::NAN);
        assert!(sum.is_nan(), "{sum} {gauss}");
        assert_eq!(one_plus_erf_and_gauss_f32(30.0).0, 2.0);
        assert!(one_plus_erf_and_gauss_f32(-30.0).0 < 1e-37);
    }
}
