//! Learning-rate schedule: linear warmup then cosine decay, as in nanoGPT's `get_lr`.

use std::f64::consts::PI;

use crate::{Error, Result};

/// Linear warmup to `max_lr` over `warmup_steps`, cosine decay to `min_lr` at `decay_steps`,
/// then `min_lr`.
///
/// At step `t` (0-based): `max_lr · (t + 1) / (warmup_steps + 1)` while `t < warmup_steps`;
/// `min_lr` once `t > decay_steps`; otherwise `min_lr + ½(1 + cos(π·r))·(max_lr − min_lr)` with
/// `r = (t − warmup_steps) / (decay_steps − warmup_steps)`. These are nanoGPT's formulas, so
/// a run reproduces its learning rates step for step.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct WarmupCosine {
    /// The peak learning rate, reached at the end of warmup.
    pub max_lr: f64,
    /// The floor reached at `decay_steps`.
    pub min_lr: f64,
    /// The number of warmup steps.
    pub warmup_steps: u64,
    /// The step at which the decay ends; at least `warmup_steps`.
    pub decay_steps: u64,
}

impl WarmupCosine {
    /// Validates the schedule.
    pub fn new(schedule: WarmupCosine) -> Result<Self> {
        const OP: &str = "WarmupCosine::new";
        super::check_non_negative(OP, "max_lr", schedule.max_lr)?;
        super::check_non_negative(OP, "min_lr", schedule.min_lr)?;
        if schedule.decay_steps < schedule.warmup_steps {
            return Err(Error::InvalidConfig {
                op: OP,
                field: "decay_steps",
                value: schedule.decay_steps as f64,
                reason: "must be at least warmup_steps",
            });
        }
        Ok(schedule)
    }

    /// The learning rate at 0-based step `step`.
    pub fn lr_at(&self, step: u64) -> f64 {
        if step < self.warmup_steps {
            return self.max_lr * (step + 1) as f64 / (self.warmup_steps + 1) as f64;
        }
        if step > self.decay_steps {
            return self.min_lr;
        }
        let span = self.decay_steps - self.warmup_steps;
        // With no decay span the only step left here is `step == decay_steps`: the peak.
        let ratio = if span == 0 {
            0.0
        } else {
            (step - self.warmup_steps) as f64 / span as f64
        };
        let coeff = 0.5 * (1.0 + (PI * ratio).cos());
        self.min_lr + coeff * (self.max_lr - self.min_lr)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn follows_warmup_then_cosine() {
        let schedule = WarmupCosine::new(WarmupCosine {
            max_lr: 1.0,
            min_lr: 0.1,
            warmup_steps: 4,
            decay_steps: 14,
        })
        .expect("valid");
        // Warmup: (t + 1) / 5.
        for t in 0..4 {
            assert!((schedule.lr_at(t) - (t + 1) as f64 / 5.0).abs() < 1e-15);
        }
        // Start of decay is the peak, the midpoint is halfway, the end is the floor.
        assert!((schedule.lr_at(4) - 1.0).abs() < 1e-15);
        assert!((schedule.lr_at(9) - 0.55).abs() < 1e-15);
        assert!((schedule.lr_at(14) - 0.1).abs() < 1e-15);
        assert_eq!(schedule.lr_at(15), 0.1);
        assert_eq!(schedule.lr_at(1_000_000), 0.1);
    }

    #[test]
    fn rejects_decay_before_warmup() {
        let bad = WarmupCosine {
            max_lr: 1.0,
            min_lr: 0.0,
            warmup_steps: 10,
            decay_steps: 5,
        };
        assert!(matches!(
            WarmupCosine::new(bad),
            Err(Error::InvalidConfig {
                field: "decay_steps",
                ..
            })
        ));
    }
}
