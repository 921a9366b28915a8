//! [`TransportPolicy`]: which transport carries a pair's bulk data, and the
//! `HYPERSHARD_TRANSPORT` switch that overrides the configured one.

use std::fmt;

use crate::error::{EnvExpectation, Error, Result};

/// The environment variable that forces a transport for every rank that reads it:
/// `auto`, `tcp` or `shm`.
pub const TRANSPORT_ENV: &str = "HYPERSHARD_TRANSPORT";

/// Which transport moves the data of ops between two ranks. Control traffic (the phase-0
/// descriptors) and remote peers always use TCP.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum TransportPolicy {
    /// TCP for every peer (the default, so that a job opts in to shared memory).
    #[default]
    Tcp,
    /// Shared memory for peers on the same host (same host id in the store), TCP for the
    /// others; a pair whose segments cannot be set up falls back to TCP with a warning.
    Auto,
    /// Shared memory for peers on the same host, and a setup failure is an error rather than
    /// a fallback. Remote peers still use TCP.
    Shm,
}

impl TransportPolicy {
    /// The word `HYPERSHARD_TRANSPORT` uses for this policy.
    pub const fn name(self) -> &'static str {
        match self {
            TransportPolicy::Tcp => "tcp",
            TransportPolicy::Auto => "auto",
            TransportPolicy::Shm => "shm",
        }
    }

    /// Parses `auto`, `tcp` or `shm` (case-insensitive, surrounding blanks ignored).
    pub fn parse(text: &str) -> Option<TransportPolicy> {
        match text.trim().to_ascii_lowercase().as_str() {
            "tcp" => Some(TransportPolicy::Tcp),
            "auto" => Some(TransportPolicy::Auto),
            "shm" => Some(TransportPolicy::Shm),
            _ => None,
        }
    }

    /// `HYPERSHARD_TRANSPORT` when set, else `configured`. A value that is not one of the
    /// three words is an [`Error::InvalidEnv`].
    pub fn from_env_or(configured: TransportPolicy) -> Result<TransportPolicy> {
        match std::env::var(TRANSPORT_ENV) {
            Ok(value) => TransportPolicy::parse(&value).ok_or(Error::InvalidEnv {
                variable: TRANSPORT_ENV,
                value,
                expected: EnvExpectation::TransportName,
            }),
            Err(_) => Ok(configured),
        }
    }

    /// Whether this policy moves data through shared memory for co-located peers.
    pub const fn wants_shm(self) -> bool {
        matches!(self, TransportPolicy::Auto | TransportPolicy::Shm)
    }
}

impl fmt::Display for TransportPolicy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_policy_parses_from_its_name() {
        for policy in [
            TransportPolicy::Tcp,
            TransportPolicy::Auto,
            TransportPolicy::Shm,
        ] {
            assert_eq!(TransportPolicy::parse(policy.name()), Some(policy));
            let shouted = format!(" {} ", policy.name().to_uppercase());
            assert_eq!(TransportPolicy::parse(&shouted), Some(policy));
        }
        assert_eq!(TransportPolicy::parse("nccl"), None);
        assert!(TransportPolicy::Auto.wants_shm() && !TransportPolicy::Tcp.wants_shm());
    }
}
