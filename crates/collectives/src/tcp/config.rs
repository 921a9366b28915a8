//! [`TcpConfig`]: the knobs of the TCP backend.

use std::net::{IpAddr, Ipv4Addr};
use std::time::Duration;

/// The default [`TcpConfig::segment_bytes`].
pub const DEFAULT_SEGMENT_BYTES: usize = 1 << 20;

/// How a rank joins the TCP mesh and how its collectives cut data into frames.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct TcpConfig {
    /// The address this rank's listener binds (port 0 is always used, so the OS picks a free
    /// port that is then published through the store). Defaults to `127.0.0.1`.
    pub bind_ip: IpAddr,
    /// A number every rank of one job shares; a connection presenting another token is refused,
    /// so two jobs that share a store or a port range cannot cross-connect.
    pub job_token: u64,
    /// How long the rendezvous may take in all (store lookups, connects, handshakes).
    pub rendezvous_timeout: Duration,
    /// The most payload bytes one data frame carries: collectives cut every block into
    /// segments of this size (rounded down to whole elements, at least one element), so a
    /// ring step forwards a segment while the next is still in flight. Defaults to 1 MiB.
    pub segment_bytes: usize,
}

impl Default for TcpConfig {
    fn default() -> Self {
        TcpConfig {
            bind_ip: IpAddr::V4(Ipv4Addr::LOCALHOST),
            job_token: 0,
            rendezvous_timeout: Duration::from_secs(300),
            segment_bytes: DEFAULT_SEGMENT_BYTES,
        }
    }
}

impl TcpConfig {
    /// The same config with another job token.
    pub fn with_job_token(mut self, token: u64) -> Self {
        self.job_token = token;
        self
    }

    /// The same config with another rendezvous deadline.
    pub fn with_rendezvous_timeout(mut self, timeout: Duration) -> Self {
        self.rendezvous_timeout = timeout;
        self
    }

    /// The same config with another segment size (zero is treated as one element).
    pub fn with_segment_bytes(mut self, bytes: usize) -> Self {
        self.segment_bytes = bytes;
        self
    }
}
