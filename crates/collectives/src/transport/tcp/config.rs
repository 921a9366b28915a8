//! [`TcpConfig`]: the knobs of the TCP backend.

use std::net::{IpAddr, Ipv4Addr};
use std::time::Duration;

use crate::env::parse_switch;
use crate::error::{EnvExpectation, Error, Result};
use crate::transport::shm::{DEFAULT_RING_BYTES, TransportPolicy};

/// The environment variable that overrides [`TcpConfig::frame_checksum`] in
/// `Mesh::establish` (and so in `TcpCommunicator::connect`,
/// `rendezvous_from_env` and `init_from_env`): `1`, `true`, `on` or `0`, `false`, `off`.
pub const CRC32C_VAR: &str = "HYPERSHARD_CRC32C";

/// The default [`TcpConfig::small_all_reduce_bytes`] (see docs/collectives.md, "Measured
/// defaults").
pub const DEFAULT_SMALL_ALL_REDUCE_BYTES: usize = 64 * 1024;

/// The default [`TcpConfig::halving_doubling_bytes`] (see docs/collectives.md, "Measured
/// defaults").
pub const DEFAULT_HALVING_DOUBLING_BYTES: usize = 4 << 20;

/// The default [`TcpConfig::tree_broadcast_bytes`] (see docs/collectives.md, "Measured
/// defaults").
pub const DEFAULT_TREE_BROADCAST_BYTES: usize = 4 << 20;

/// Which all-reduce algorithm runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum AllReduceAlgorithm {
    /// Recursive doubling up to [`TcpConfig::small_all_reduce_bytes`], the ring above.
    #[default]
    Auto,
    /// Always the ring (reduce-scatter then all-gather).
    Ring,
    /// Always recursive doubling: `log2 p` rounds that swap the whole vector (fewest rounds,
    /// most bytes; for tiny messages).
    RecursiveDoubling,
    /// Always recursive halving-doubling: a reduce-scatter by recursive halving then an
    /// all-gather by recursive doubling, `2 log2 p` rounds moving `2 (p-1)/p` of the vector
    /// like the ring (Rabenseifner's algorithm; non-power-of-two sizes fold in first).
    HalvingDoubling,
}

/// Which broadcast algorithm runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum BroadcastAlgorithm {
    /// A binomial tree up to [`TcpConfig::tree_broadcast_bytes`], the pipelined chain above.
    #[default]
    Auto,
    /// Always the chain: each segment is forwarded down `root, root+1, ...` as it arrives
    /// (`size - 1` hops of latency, but every link busy at once: bandwidth-optimal).
    Chain,
    /// Always a binomial tree: `ceil(log2 p)` rounds, the root sending the whole buffer
    /// `log2 p` times (latency-optimal).
    Tree,
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
    /// Which all-reduce algorithm runs. Every rank must choose alike: every op's descriptor
    /// carries this and the other algorithm knobs (including `segment_bytes` and the size
    /// thresholds), and ranks that differ fail every op on every rank with
    /// [`Error::ArgumentMismatch`](crate::Error::ArgumentMismatch) naming
    /// [`Argument::AlgorithmKnob`](crate::Argument::AlgorithmKnob).
    pub all_reduce: AllReduceAlgorithm,
    /// Under [`AllReduceAlgorithm::Auto`], all-reduces of at most this many bytes use
    /// recursive doubling.
    pub small_all_reduce_bytes: usize,
    /// Under [`AllReduceAlgorithm::Auto`], all-reduces above `small_all_reduce_bytes` and of
    /// at most this many bytes use recursive halving-doubling; larger ones use the ring.
    pub halving_doubling_bytes: usize,
    /// Which broadcast algorithm runs. Every rank must choose alike (checked like
    /// [`TcpConfig::all_reduce`]).
    pub broadcast: BroadcastAlgorithm,
    /// Under [`BroadcastAlgorithm::Auto`], broadcasts of at most this many bytes use the
    /// binomial tree.
    pub tree_broadcast_bytes: usize,
    /// Which transport moves op data between ranks on the same host ([`TransportPolicy`];
    /// default TCP). `HYPERSHARD_TRANSPORT=auto|tcp|shm` overrides it. It takes effect in
    /// the constructors that see the store (`TcpCommunicator::connect`,
    /// `TcpCommunicator::from_mesh_with_store`, `init_from_env`); see docs/shm.md.
    pub transport: TransportPolicy,
    /// The data capacity of each shared-memory ring (one per ordered pair of co-located
    /// ranks), rounded up to a multiple of 64 bytes, at least 256.
    pub shm_ring_bytes: usize,
    /// Whether every TCP frame carries CRC32C checksums: one of its header (checked before the
    /// header is trusted) and one of header and payload (checked before the frame is
    /// delivered); a mismatch fails the op with
    /// [`ProtocolViolation::ChecksumFailed`](crate::ProtocolViolation::ChecksumFailed). Off by
    /// default (TCP's own checksum and the link's CRC already catch most corruption; this
    /// catches what slips past them, at the cost measured in docs/benchmarks.md, "CRC32C
    /// cost"). The mesh handshake carries the setting and refuses a peer that differs with
    /// [`ProtocolViolation::ChecksumSettingMismatch`](crate::ProtocolViolation::ChecksumSettingMismatch).
    /// [`CRC32C_VAR`] (`HYPERSHARD_CRC32C`) overrides it. Shared-memory channels carry no
    /// checksums (docs/collectives.md, "Frame checksums").
    pub frame_checksum: bool,
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
            halving_doubling_bytes: DEFAULT_HALVING_DOUBLING_BYTES,
            broadcast: BroadcastAlgorithm::Auto,
            tree_broadcast_bytes: DEFAULT_TREE_BROADCAST_BYTES,
            transport: TransportPolicy::Tcp,
            shm_ring_bytes: DEFAULT_RING_BYTES,
            frame_checksum: false,
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

    /// The same config with another transport policy for co-located peers.
    pub fn with_transport(mut self, transport: TransportPolicy) -> Self {
        self.transport = transport;
        self
    }

    /// The same config with another shared-memory ring capacity.
    pub fn with_shm_ring_bytes(mut self, bytes: usize) -> Self {
        self.shm_ring_bytes = bytes;
        self
    }

    /// The same config with another broadcast algorithm.
    pub fn with_broadcast(mut self, algorithm: BroadcastAlgorithm) -> Self {
        self.broadcast = algorithm;
        self
    }

    /// The same config with per-frame CRC32C checksums on or off.
    pub fn with_frame_checksum(mut self, on: bool) -> Self {
        self.frame_checksum = on;
        self
    }

    /// [`TcpConfig::frame_checksum`] after the [`CRC32C_VAR`] override: the variable's value
    /// when it is set (an unparsable one is [`Error::InvalidEnv`]), the config's otherwise.
    pub fn frame_checksum_from_env(&self) -> Result<bool> {
        match std::env::var(CRC32C_VAR) {
            Ok(text) => parse_switch(&text).ok_or(Error::InvalidEnv {
                variable: CRC32C_VAR,
                value: text,
                expected: EnvExpectation::Switch,
            }),
            Err(std::env::VarError::NotPresent) => Ok(self.frame_checksum),
            Err(std::env::VarError::NotUnicode(raw)) => Err(Error::InvalidEnv {
                variable: CRC32C_VAR,
                value: raw.to_string_lossy().into_owned(),
                expected: EnvExpectation::Switch,
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn switches_parse_and_garbage_does_not() {
        for on in ["1", "true", "ON", " yes "] {
            assert_eq!(parse_switch(on), Some(true), "{on}");
        }
        for off in ["0", "False", "off", "no"] {
            assert_eq!(parse_switch(off), Some(false), "{off}");
        }
        for bad in ["", "2", "enable", "crc"] {
            assert_eq!(parse_switch(bad), None, "{bad}");
        }
        assert!(!TcpConfig::default().frame_checksum);
        assert!(
            TcpConfig::default()
                .with_frame_checksum(true)
                .frame_checksum
        );
    }
}
