//! Communicator options: the per-op deadline.

use std::time::Duration;

use crate::error::{EnvExpectation, Error, Result};

/// The deadline of every op when nothing else is configured (PyTorch's default is 30 min for
/// NCCL and 30 s for gloo stores; 5 min suits training steps without hiding hangs for long).
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(300);

/// The environment variable that overrides [`DEFAULT_TIMEOUT`], in seconds (fractions allowed).
pub const TIMEOUT_ENV: &str = "HYPERSHARD_TIMEOUT";

/// Options every backend honours. Sub-communicators from
/// [`split`](crate::Communicator::split) inherit their parent's.
#[derive(Clone, Debug, PartialEq)]
#[non_exhaustive]
pub struct CommConfig {
    /// How long one op may take from the moment it starts executing (not from when it was
    /// issued: an op queued behind slow ones is not charged for their time). A peer that does
    /// not show up within it turns into [`Error::Timeout`] on this rank.
    pub timeout: Duration,
}

impl Default for CommConfig {
    fn default() -> Self {
        CommConfig {
            timeout: DEFAULT_TIMEOUT,
        }
    }
}

impl CommConfig {
    /// The defaults, with `HYPERSHARD_TIMEOUT` applied when it is set.
    pub fn from_env() -> Result<Self> {
        let value = std::env::var(TIMEOUT_ENV).ok();
        CommConfig::from_timeout_var(value.as_deref())
    }

    /// The defaults with the given value of `HYPERSHARD_TIMEOUT` (`None`: unset) applied; the
    /// pure half of [`CommConfig::from_env`].
    pub fn from_timeout_var(value: Option<&str>) -> Result<Self> {
        let mut config = CommConfig::default();
        if let Some(text) = value {
            config.timeout = parse_seconds(TIMEOUT_ENV, text)?;
        }
        Ok(config)
    }

    /// The same options with another deadline.
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }
}

/// Parses a positive, finite number of seconds such as `30` or `0.25`.
pub fn parse_seconds(variable: &'static str, text: &str) -> Result<Duration> {
    let invalid = || Error::InvalidEnv {
        variable,
        value: text.to_string(),
        expected: EnvExpectation::PositiveSeconds,
    };
    let seconds: f64 = text.trim().parse().map_err(|_| invalid())?;
    if !(seconds.is_finite() && seconds > 0.0) {
        return Err(invalid());
    }
    Duration::try_from_secs_f64(seconds).map_err(|_| invalid())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_and_override() {
        assert_eq!(
            CommConfig::from_timeout_var(None).unwrap().timeout,
            DEFAULT_TIMEOUT
        );
        assert_eq!(
            CommConfig::from_timeout_var(Some("2.5")).unwrap().timeout,
            Duration::from_millis(2500)
        );
    }

    #[test]
    fn garbage_is_a_typed_error() {
        for bad in ["", "soon", "-1", "0", "inf", "NaN"] {
            match CommConfig::from_timeout_var(Some(bad)) {
                Err(Error::InvalidEnv {
                    variable, value, ..
                }) => {
                    assert_eq!(variable, TIMEOUT_ENV);
                    assert_eq!(value, bad);
                }
                other => panic!("{bad:?} gave {other:?}"),
            }
        }
    }
}
