//! Range checks of numeric flags, run right after parsing and before anything is written:
//! a NaN learning rate or an overflowing step count would otherwise train to NaN and save it.

use hypershard::Error;

/// The largest step count a flag may give: step numbers become `f64` in the schedule, and
/// every integer up to 2⁵³ is exact there (and `+ 1` cannot overflow).
pub const MAX_STEPS: u64 = 1 << 53;

fn invalid(flag: &'static str, value: impl std::fmt::Display, reason: impl Into<String>) -> Error {
    Error::InvalidFlag {
        flag,
        value: value.to_string(),
        reason: reason.into(),
    }
}

/// A finite float in `[low, high]` (`high_open`: `[low, high)`).
pub fn float_in(
    flag: &'static str,
    value: f64,
    low: f64,
    high: f64,
    high_open: bool,
) -> Result<(), Error> {
    let inside = value.is_finite()
        && value >= low
        && if high_open {
            value < high
        } else {
            value <= high
        };
    if inside {
        return Ok(());
    }
    let upper = if high == f64::INFINITY {
        String::new()
    } else if high_open {
        format!(" and below {high}")
    } else {
        format!(" and at most {high}")
    };
    Err(invalid(
        flag,
        value,
        format!("must be a finite number of at least {low}{upper}"),
    ))
}

/// A finite float above zero.
pub fn positive_float(flag: &'static str, value: f64) -> Result<(), Error> {
    if value.is_finite() && value > 0.0 {
        Ok(())
    } else {
        Err(invalid(flag, value, "must be a finite number above 0"))
    }
}

/// An integer of at least `low`.
pub fn at_least(flag: &'static str, value: u64, low: u64) -> Result<(), Error> {
    if value >= low {
        Ok(())
    } else {
        Err(invalid(flag, value, format!("must be at least {low}")))
    }
}

/// A step count in `[low, MAX_STEPS]`.
pub fn steps(flag: &'static str, value: u64, low: u64) -> Result<(), Error> {
    if (low..=MAX_STEPS).contains(&value) {
        Ok(())
    } else {
        Err(invalid(
            flag,
            value,
            format!("must be a step count from {low} to {MAX_STEPS} (2^53)"),
        ))
    }
}

/// The product of `factors` (flag, value), or an error naming the first flag whose factor
/// overflows `usize`.
pub fn product(factors: &[(&'static str, usize)], what: &str) -> Result<usize, Error> {
    let mut total: usize = 1;
    for &(flag, value) in factors {
        total = total.checked_mul(value).ok_or_else(|| {
            invalid(
                flag,
                value,
                format!("{what} (the product with the flags before it) overflows"),
            )
        })?;
    }
    Ok(total)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn message(result: Result<impl std::fmt::Debug, Error>) -> String {
        result.unwrap_err().to_string()
    }

    #[test]
    fn floats_must_be_finite_and_in_range() {
        float_in("--beta1", 0.9, 0.0, 1.0, true).unwrap();
        float_in("--beta1", 0.0, 0.0, 1.0, true).unwrap();
        float_in("--grad-clip", 0.0, 0.0, f64::INFINITY, false).unwrap();
        assert_eq!(
            message(float_in("--beta1", 2.0, 0.0, 1.0, true)),
            "invalid --beta1 2: must be a finite number of at least 0 and below 1"
        );
        assert_eq!(
            message(float_in("--beta1", 1.0, 0.0, 1.0, true)),
            "invalid --beta1 1: must be a finite number of at least 0 and below 1"
        );
        assert_eq!(
            message(float_in("--grad-clip", f64::NAN, 0.0, f64::INFINITY, false)),
            "invalid --grad-clip NaN: must be a finite number of at least 0"
        );
        assert_eq!(
            message(float_in("--min-lr", 0.5, 0.0, 0.25, false)),
            "invalid --min-lr 0.5: must be a finite number of at least 0 and at most 0.25"
        );
        positive_float("--lr", 3e-3).unwrap();
        for bad in [0.0, -1.0, f64::NAN, f64::INFINITY, f64::NEG_INFINITY] {
            assert!(
                message(positive_float("--lr", bad)).starts_with(&format!("invalid --lr {bad}:")),
                "{bad}"
            );
        }
    }

    #[test]
    fn counts_and_products_are_bounded() {
        steps("--steps", 1, 1).unwrap();
        steps("--steps", MAX_STEPS, 1).unwrap();
        assert!(matches!(
            steps("--steps", 0, 1),
            Err(Error::InvalidFlag {
                flag: "--steps",
                ..
            })
        ));
        assert_eq!(
            message(steps("--warmup-steps", u64::MAX, 0)),
            "invalid --warmup-steps 18446744073709551615: must be a step count from 0 to 9007199254740992 (2^53)"
        );
        at_least("--nproc", 1, 1).unwrap();
        assert!(at_least("--nproc", 0, 1).is_err());
        assert_eq!(
            product(&[("--nproc", 4), ("--nnodes", 3)], "the world size").unwrap(),
            12
        );
        assert_eq!(
            message(product(
                &[("--nproc", 4), ("--nnodes", usize::MAX / 2)],
                "the world size"
            )),
            format!(
                "invalid --nnodes {}: the world size (the product with the flags before it) overflows",
                usize::MAX / 2
            )
        );
    }
}
