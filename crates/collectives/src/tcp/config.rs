//! [`TcpConfig`]: the knobs of the TCP backend.

use std::net::{IpAddr, Ipv4Addr};
use std::time::Duration;

/// The default [`TcpConfig::small_all_reduce_bytes`]: a guess sized so that the ring's
/// `2 (size - 1)` latency-bound steps dominate below it on loopback; not yet measured.
pub const DEFAULT_SMALL_ALL_REDUCE_BYTES: usize = 64 * 1024;

/// Which all-reduce algorithm runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum AllReduceAlgorithm {
    /// Recursive doubling up to [`TcpConfig::small_all_reduce_bytes`], the ring above.
    #[default]
    Auto,
    /// Always the ring (reduce-scatter then all-gather).
    Ring,
    /// Always recursive doubling.
    RecursiveDoubling,
}

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
    /// Which all-reduce algorithm runs. Every rank must choose alike (the choice is not
    /// checked across ranks; mixed choices fail the op with a timeout).
    pub all_reduce: AllReduceAlgorithm,
    /// Under [`AllReduceAlgorithm::Auto`], all-reduces of at most this many bytes use
    /// recursive doubling.
    pub small_all_reduce_bytes: usize,
}

impl Default for TcpConfig {
    fn default() -> Self {
        TcpConfig {
            bind_ip: IpAddr::V4(Ipv4Addr::LOCALHOST),
            job_token: 0,
            rendezvous_timeout: Duration::from_secs(300),
            segment_bytes: DEFAULT_SEGMENT_BYTES,
            all_reduce: AllReduceAlgorithm::Auto,
            small_all_reduce_bytes: DEFAULT_SMALL_ALL_REDUCE_BYTES,
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

    /// The same config with another all-reduce algorithm.
    pub fn with_all_reduce(mut self, algorithm: AllReduceAlgorithm) -> Self {
        self.all_reduce = algorithm;
        self
    }
}
