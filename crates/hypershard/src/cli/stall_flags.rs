//! `train`'s deadline and stall-watchdog flags: `--timeout` (the op deadline, which
//! `HYPERSHARD_TIMEOUT` sets when the flag is absent), `--stall-timeout` and `--on-stall`.

use std::ffi::OsString;
use std::time::Duration;

use clap::Args;
use hypershard::Error;
use hypershard::collectives::watchdog::{DEFAULT_STALL_TIMEOUT, StallPolicy, WatchdogConfig};
use hypershard::collectives::{CommConfig, TIMEOUT_ENV};

/// What a stall does.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum OnStall {
    /// Print the report, then fail the job.
    Fail,
    /// Print the report, then keep waiting (up to --timeout).
    Wait,
    /// No watchdog.
    Off,
}

/// The op deadline and the stall watchdog.
#[derive(Debug, Args)]
pub struct StallArgs {
    /// Op deadline in seconds: a collective that has not finished by then fails on every rank
    /// with a timeout (default: HYPERSHARD_TIMEOUT when set, else 300).
    #[arg(long, value_name = "SECONDS")]
    timeout: Option<f64>,
    /// Seconds a collective may wait before the watchdog reports, on every rank and in the
    /// launcher, which ranks have not entered it and what each was last doing
    /// (default: 30, or half of --timeout when that is shorter).
    #[arg(long, value_name = "SECONDS")]
    stall_timeout: Option<f64>,
    /// What a stall does after the report: fail the job, wait on (up to --timeout), or
    /// off (no watchdog).
    #[arg(long, value_enum, default_value_t = OnStall::Fail)]
    on_stall: OnStall,
}

fn seconds(flag: &'static str, value: f64) -> Result<Duration, Error> {
    let invalid = || Error::InvalidFlag {
        flag,
        value: value.to_string(),
        reason: "must be a finite number of seconds above 0".to_string(),
    };
    if !(value.is_finite() && value > 0.0) {
        return Err(invalid());
    }
    Duration::try_from_secs_f64(value).map_err(|_| invalid())
}

impl StallArgs {
    /// The op deadline: `--timeout`, else `HYPERSHARD_TIMEOUT`, else the default.
    pub fn op_timeout(&self) -> Result<Duration, Error> {
        match self.timeout {
            Some(value) => seconds("--timeout", value),
            None => Ok(CommConfig::from_env()?.timeout),
        }
    }

    /// The watchdog's settings (`None` with `--on-stall off`). An explicit `--stall-timeout`
    /// must be below the op deadline, or the deadline would fire first and the report never.
    pub fn watchdog(&self) -> Result<Option<WatchdogConfig>, Error> {
        let deadline = self.op_timeout()?;
        let stall_timeout = match self.stall_timeout {
            Some(value) => {
                let stall = seconds("--stall-timeout", value)?;
                if stall >= deadline {
                    return Err(Error::InvalidFlag {
                        flag: "--stall-timeout",
                        value: value.to_string(),
                        reason: format!(
                            "must be below the op deadline ({}s; --timeout or {TIMEOUT_ENV})",
                            deadline.as_secs_f64()
                        ),
                    });
                }
                stall
            }
            None => DEFAULT_STALL_TIMEOUT.min(deadline / 2),
        };
        let policy = match self.on_stall {
            OnStall::Fail => StallPolicy::Fail,
            OnStall::Wait => StallPolicy::Wait,
            OnStall::Off => return Ok(None),
        };
        Ok(Some(WatchdogConfig {
            stall_timeout,
            policy,
        }))
    }

    /// The variables the ranks need: `--timeout` travels as `HYPERSHARD_TIMEOUT`, which the
    /// backend reads when it builds the world.
    pub fn rank_env(&self) -> Vec<(OsString, OsString)> {
        self.timeout
            .map(|value| vec![(TIMEOUT_ENV.into(), value.to_string().into())])
            .unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(timeout: Option<f64>, stall: Option<f64>, on_stall: OnStall) -> StallArgs {
        StallArgs {
            timeout,
            stall_timeout: stall,
            on_stall,
        }
    }

    #[test]
    fn defaults_and_explicit_values() {
        let config = args(Some(300.0), None, OnStall::Fail)
            .watchdog()
            .unwrap()
            .unwrap();
        assert_eq!(config.stall_timeout, Duration::from_secs(30));
        assert_eq!(config.policy, StallPolicy::Fail);
        // A short deadline halves into the default threshold.
        let config = args(Some(4.0), None, OnStall::Wait)
            .watchdog()
            .unwrap()
            .unwrap();
        assert_eq!(config.stall_timeout, Duration::from_secs(2));
        assert_eq!(config.policy, StallPolicy::Wait);
        let config = args(Some(10.0), Some(2.5), OnStall::Fail)
            .watchdog()
            .unwrap()
            .unwrap();
        assert_eq!(config.stall_timeout, Duration::from_millis(2500));
        assert_eq!(
            args(Some(10.0), Some(2.5), OnStall::Off)
                .watchdog()
                .unwrap(),
            None
        );
        assert_eq!(
            args(Some(7.5), None, OnStall::Fail).rank_env(),
            vec![(OsString::from(TIMEOUT_ENV), OsString::from("7.5"))]
        );
    }

    #[test]
    fn bad_values_name_the_flag() {
        for (timeout, stall, flag) in [
            (Some(f64::NAN), None, "--timeout"),
            (Some(0.0), None, "--timeout"),
            (Some(-1.0), None, "--timeout"),
            (Some(10.0), Some(f64::INFINITY), "--stall-timeout"),
            (Some(10.0), Some(0.0), "--stall-timeout"),
            (Some(10.0), Some(10.0), "--stall-timeout"),
            (Some(10.0), Some(20.0), "--stall-timeout"),
        ] {
            match args(timeout, stall, OnStall::Fail).watchdog() {
                Err(Error::InvalidFlag { flag: got, .. }) => assert_eq!(got, flag),
                other => panic!("{timeout:?} {stall:?}: {other:?}"),
            }
        }
    }
}
