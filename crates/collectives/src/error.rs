//! The crate's one error type.

use std::fmt;
use std::time::Duration;

use crate::dtype::DType;
use crate::location::BufferLocation;
use crate::op::{Argument, BufferRole, OpKind, ReduceOp};

mod device;

pub use device::{DeviceLibrary, Unavailable};

/// The result type of this crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can go wrong in a collective, a store or a launch.
///
/// Errors that come from comparing the ranks' arguments (`LengthMismatch` with a
/// [`BufferRole::Peer`], `DTypeMismatch`, `ArgumentMismatch`, `OpMismatch`) are raised on
/// *every* rank of the group, so no rank is left waiting for the others.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A buffer or count list has the wrong length.
    #[error("{op}: {role} has {got} elements, expected {expected}")]
    LengthMismatch {
        /// The op that checked.
        op: OpKind,
        /// Which buffer (or which peer's buffer) is wrong.
        role: BufferRole,
        /// The length the op required.
        expected: usize,
        /// The length it got.
        got: usize,
    },
    /// A buffer has the wrong dtype.
    #[error("{op}: {role} has dtype {got}, expected {expected}")]
    DTypeMismatch {
        /// The op that checked.
        op: OpKind,
        /// Which buffer (or which peer's buffer) is wrong.
        role: BufferRole,
        /// The dtype the op required.
        expected: DType,
        /// The dtype it got.
        got: DType,
    },
    /// A rank passed a scalar argument (root, reduce op, counts) that differs from the
    /// reference rank's.
    #[error("{op}: rank {peer} passed a different {argument} than rank {reference}")]
    ArgumentMismatch {
        /// The op.
        op: OpKind,
        /// The argument that differs.
        argument: Argument,
        /// The rank whose argument differs.
        peer: usize,
        /// The rank whose argument was taken as the reference (the lowest rank).
        reference: usize,
    },
    /// Two ranks issued different collectives at the same position of the stream.
    #[error("collective #{seq}: this rank issued {ours} but rank {peer} issued {theirs}")]
    OpMismatch {
        /// The position of the collective in the communicator's stream (0-based).
        seq: u64,
        /// What this rank issued.
        ours: OpKind,
        /// What the peer issued.
        theirs: OpKind,
        /// The peer.
        peer: usize,
    },
    /// A peer died, aborted, closed its connection or gave up on the op.
    #[error("{op}: peer rank {peer} was lost")]
    PeerLost {
        /// The op that noticed.
        op: OpKind,
        /// The lost peer.
        peer: usize,
    },
    /// The op's deadline passed.
    #[error("{op}: timed out after {after:?}{}", waiting_for(*peer))]
    Timeout {
        /// The op that timed out.
        op: OpKind,
        /// The deadline that passed.
        after: Duration,
        /// The first peer that had not shown up, when known.
        peer: Option<usize>,
    },
    /// A peer (or a stray client) broke the wire protocol.
    #[error("protocol violation{}: {violation}", from_peer(*peer))]
    Protocol {
        /// The peer, when known.
        peer: Option<usize>,
        /// What was wrong.
        violation: ProtocolViolation,
    },
    /// The communicator was aborted with [`Communicator::abort`](crate::Communicator::abort).
    #[error("{op}: the communicator was aborted")]
    Aborted {
        /// The op that was failed.
        op: OpKind,
    },
    /// A rank argument (root, peer) is not in `0..size`.
    #[error("{op}: rank {rank} is out of range for a group of {size}")]
    InvalidRank {
        /// The op.
        op: OpKind,
        /// The bad rank.
        rank: usize,
        /// The group size.
        size: usize,
    },
    /// A world or group of size zero was requested.
    #[error("a communicator needs at least one rank, got {size}")]
    InvalidWorldSize {
        /// The requested size.
        size: usize,
    },
    /// The reduce op is not defined for the dtype (`Avg` and `PreMulSum` on integers).
    #[error("reduce op {op} is not supported for dtype {dtype}")]
    UnsupportedOp {
        /// The reduce op.
        op: ReduceOp,
        /// The dtype.
        dtype: DType,
    },
    /// The backend cannot use buffers in this location (for example device memory on `local`).
    #[error("{op}: the {backend} backend does not accept {location} buffers")]
    UnsupportedBuffer {
        /// The op.
        op: OpKind,
        /// Where the buffer lives.
        location: BufferLocation,
        /// The backend's name.
        backend: &'static str,
    },
    /// Host access was asked of a buffer that does not live in host memory.
    #[error("the buffer lives in {location} memory, not host memory")]
    NotHost {
        /// Where the buffer lives.
        location: BufferLocation,
    },
    /// Typed access asked for a different element type than the buffer holds.
    #[error("the buffer holds {buffer} elements, but {requested} was requested")]
    ElementTypeMismatch {
        /// The buffer's dtype.
        buffer: DType,
        /// The requested dtype.
        requested: DType,
    },
    /// A byte length is not a whole number of elements.
    #[error("{bytes} bytes is not a whole number of {dtype} elements")]
    MisalignedBytes {
        /// The dtype.
        dtype: DType,
        /// The byte length.
        bytes: usize,
    },
    /// A required environment variable is not set.
    #[error("environment variable {variable} is not set")]
    MissingEnv {
        /// The variable.
        variable: &'static str,
    },
    /// An environment variable does not parse.
    #[error("environment variable {variable}={value:?} is not {expected}")]
    InvalidEnv {
        /// The variable.
        variable: &'static str,
        /// Its value.
        value: String,
        /// What it should have been.
        expected: EnvExpectation,
    },
    /// A rank variable is not below its size variable (`RANK` ≥ `WORLD_SIZE`, say).
    #[error("{rank_variable}={rank} is not below {size_variable}={size}")]
    InconsistentEnv {
        /// The rank variable.
        rank_variable: &'static str,
        /// Its value.
        rank: usize,
        /// The size variable.
        size_variable: &'static str,
        /// Its value.
        size: usize,
    },
    /// A store wait or get did not see its keys before the deadline.
    #[error("store: timed out after {after:?} waiting for keys {keys:?}")]
    StoreTimeout {
        /// The keys still missing.
        keys: Vec<String>,
        /// The deadline that passed.
        after: Duration,
    },
    /// The TCP mesh rendezvous did not hear from every peer before its deadline.
    #[error("rank {rank}: tcp rendezvous timed out after {after:?}; missing peers {missing:?}")]
    RendezvousTimeout {
        /// The rank that gave up.
        rank: usize,
        /// The peers that never completed a handshake.
        missing: Vec<usize>,
        /// The deadline that passed.
        after: Duration,
    },
    /// `Store::add` met a key whose value is not a decimal `i64`.
    #[error("store: key {key:?} does not hold a decimal counter")]
    StoreNotACounter {
        /// The key.
        key: String,
    },
    /// A progress thread could not be started.
    #[error("could not start the progress thread of group {group:?}")]
    SpawnFailed {
        /// The group's name.
        group: String,
        /// The operating system's error.
        #[source]
        source: std::io::Error,
    },
    /// The progress thread went away before finishing the op (it panicked or was shut down).
    #[error("{op}: the progress thread stopped before finishing the op")]
    EngineStopped {
        /// The op that was lost.
        op: OpKind,
    },
    /// The per-job secret (`HYPERSHARD_JOB_SECRET` / `HYPERSHARD_JOB_SECRET_FILE`) could not
    /// be loaded, or no randomness was available to make a nonce or a secret.
    #[error("job secret ({variable}): {problem}")]
    JobSecret {
        /// The variable that named the secret.
        variable: &'static str,
        /// What was wrong.
        problem: SecretProblem,
    },
    /// An MPI call returned an error code (the MPI backend sets `MPI_ERRORS_RETURN`, so MPI
    /// reports failures instead of killing the job).
    #[error("{}{call} failed with MPI error code {code}", op_prefix(*op))]
    Mpi {
        /// The op that made the call, when there is one (not for init or split setup).
        op: Option<OpKind>,
        /// The MPI function.
        call: &'static str,
        /// The error code it returned.
        code: i32,
    },
    /// MPI could not be set up the way the MPI backend needs it.
    #[error("MPI initialisation: {problem}")]
    MpiInit {
        /// What was wrong.
        problem: MpiInitProblem,
    },
    /// A count, displacement or tag does not fit the C `int` that MPI takes.
    #[error("{op}: {quantity} {value} exceeds MPI's limit of {limit}")]
    MpiLimit {
        /// The op.
        op: OpKind,
        /// What is too large.
        quantity: MpiQuantity,
        /// Its value.
        value: u64,
        /// The largest value MPI accepts.
        limit: u64,
    },
    /// `HYPERSHARD_BACKEND` names a backend this binary was built without.
    #[error("backend {backend} is not available: {reason}")]
    BackendNotBuilt {
        /// The backend asked for.
        backend: &'static str,
        /// Why it cannot be used.
        reason: &'static str,
    },
    /// A backend cannot run on this machine: its shared libraries or its devices are missing.
    /// Returned when a communicator is created (never a panic), so callers can fall back.
    #[error("the {backend} backend is unavailable: {reason}")]
    BackendUnavailable {
        /// The backend's name (`"nccl"`).
        backend: &'static str,
        /// What is missing.
        reason: Unavailable,
    },
    /// A CUDA driver or NCCL call failed.
    #[error("{}{library} call {call} failed with code {code}", during(*op))]
    DeviceCall {
        /// The op that made the call, when it was made by one.
        op: Option<OpKind>,
        /// Which library failed.
        library: DeviceLibrary,
        /// The function that failed (`"ncclAllReduce"`, `"cuMemcpyDtoHAsync"`, ...).
        call: &'static str,
        /// The library's error code (`CUresult` or `ncclResult_t`).
        code: i32,
    },
    /// An I/O error on a socket or file.
    #[error("{action}{} failed", from_peer(*peer))]
    Io {
        /// What was being done.
        action: IoAction,
        /// The peer, when known.
        peer: Option<usize>,
        /// The operating system's error.
        #[source]
        source: std::io::Error,
    },
}

fn waiting_for(peer: Option<usize>) -> String {
    peer.map(|p| format!(" waiting for rank {p}"))
        .unwrap_or_default()
}

fn op_prefix(op: Option<OpKind>) -> String {
    op.map(|op| format!("{op}: ")).unwrap_or_default()
}

/// Why MPI could not be initialised for the MPI backend.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum MpiInitProblem {
    /// MPI was already initialised (by this backend or by other code) and cannot be again.
    AlreadyInitialized,
    /// The MPI library does not provide `MPI_THREAD_MULTIPLE`, which the backend needs because
    /// every communicator (and every split) runs its ops on its own progress thread.
    ThreadLevel {
        /// The level the library provided (`single`, `funneled` or `serialized`).
        provided: &'static str,
    },
}

impl fmt::Display for MpiInitProblem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            MpiInitProblem::AlreadyInitialized => f.write_str("MPI is already initialised"),
            MpiInitProblem::ThreadLevel { provided } => write!(
                f,
                "the MPI library provides thread level {provided}, but MPI_THREAD_MULTIPLE is required"
            ),
        }
    }
}

/// Which quantity of an MPI call overflowed the C `int` MPI takes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum MpiQuantity {
    /// An element count.
    Count,
    /// A block displacement (the sum of the counts before a block).
    Displacement,
    /// A point-to-point tag (MPI's `MPI_TAG_UB`).
    Tag,
}

impl fmt::Display for MpiQuantity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            MpiQuantity::Count => "element count",
            MpiQuantity::Displacement => "displacement",
            MpiQuantity::Tag => "tag",
        })
    }
}

fn during(op: Option<OpKind>) -> String {
    op.map(|op| format!("{op}: ")).unwrap_or_default()
}

fn from_peer(peer: Option<usize>) -> String {
    peer.map(|p| format!(" (peer rank {p})"))
        .unwrap_or_default()
}

/// What a wire message got wrong.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum ProtocolViolation {
    /// The first bytes were not the protocol's magic number.
    BadMagic {
        /// What arrived instead.
        got: u32,
    },
    /// The peer speaks another protocol version.
    VersionMismatch {
        /// Our version.
        ours: u32,
        /// Theirs.
        theirs: u32,
    },
    /// The peer presented the wrong job token.
    TokenMismatch,
    /// A frame announced more bytes than the op expects.
    FrameTooLarge {
        /// The most the op accepts.
        limit: u64,
        /// What the header announced.
        got: u64,
    },
    /// A frame of an unexpected kind arrived.
    UnexpectedFrame {
        /// The kind expected.
        expected: u8,
        /// The kind that arrived.
        got: u8,
    },
    /// A frame carried the wrong sequence number.
    SequenceMismatch {
        /// The sequence expected.
        expected: u64,
        /// The sequence that arrived.
        got: u64,
    },
    /// The connection closed in the middle of a frame.
    Truncated {
        /// Bytes expected.
        expected: usize,
        /// Bytes received.
        got: usize,
    },
    /// A peer claimed a rank that is out of range or already connected.
    BadRank {
        /// The claimed rank.
        rank: u64,
    },
    /// A field that must be UTF-8 text (a store key) was not.
    NotUtf8,
    /// A frame named a dtype code this build does not know.
    BadDType {
        /// The code that arrived.
        code: u8,
    },
    /// Bytes the protocol reserves (and sends as zero) were not zero.
    ReservedNotZero,
    /// A frame's header declared another payload length than the payload handed to send.
    PayloadLengthMismatch {
        /// What the header declared.
        declared: u64,
        /// The payload's actual length.
        actual: u64,
    },
    /// A phase-0 descriptor was malformed (truncated, an unknown code, trailing bytes).
    BadDescriptor {
        /// The byte offset at which decoding failed.
        at: usize,
    },
    /// The peer did not prove that it holds the job secret (its HMAC proof was wrong: it has
    /// another secret, or none while we have one, or the other way round).
    AuthenticationFailed,
    /// A frame failed its CRC32C check (per-frame checksums, `TcpConfig::frame_checksum`):
    /// the bytes that arrived are not the bytes the peer sent. (Feature `tcp`: it names a TCP
    /// frame.)
    #[cfg(feature = "tcp")]
    ChecksumFailed {
        /// The frame's kind, group, sequence number and tag, from its header (whose own
        /// checksum held); `None` when the header itself failed its checksum, so none of its
        /// fields can be trusted.
        frame: Option<crate::frame_key::FrameKey>,
        /// The checksum the sender put on the wire.
        sent: u32,
        /// The checksum of the bytes that arrived.
        computed: u32,
    },
    /// The two ends of a mesh connection disagree on per-frame CRC32C checksums
    /// (`TcpConfig::frame_checksum` / `HYPERSHARD_CRC32C`), so neither could read the other's
    /// frames; every rank must choose alike.
    ChecksumSettingMismatch {
        /// The rank that reports the error.
        rank: u64,
        /// Whether it has frame checksums on.
        ours: bool,
        /// The rank at the other end of the connection.
        peer: u64,
        /// Whether that rank has them on.
        theirs: bool,
    },
}

impl fmt::Display for ProtocolViolation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ProtocolViolation::BadMagic { got } => write!(f, "bad magic number {got:#010x}"),
            ProtocolViolation::VersionMismatch { ours, theirs } => {
                write!(f, "protocol version {theirs}, expected {ours}")
            }
            ProtocolViolation::TokenMismatch => f.write_str("wrong job token"),
            ProtocolViolation::FrameTooLarge { limit, got } => {
                write!(f, "frame of {got} bytes exceeds the limit of {limit}")
            }
            ProtocolViolation::UnexpectedFrame { expected, got } => {
                write!(f, "frame kind {got}, expected {expected}")
            }
            ProtocolViolation::SequenceMismatch { expected, got } => {
                write!(f, "sequence number {got}, expected {expected}")
            }
            ProtocolViolation::Truncated { expected, got } => {
                write!(f, "connection closed after {got} of {expected} bytes")
            }
            ProtocolViolation::BadRank { rank } => write!(f, "invalid peer rank {rank}"),
            ProtocolViolation::NotUtf8 => f.write_str("a text field was not valid UTF-8"),
            ProtocolViolation::BadDType { code } => write!(f, "unknown dtype code {code}"),
            ProtocolViolation::ReservedNotZero => {
                f.write_str("reserved header bytes were not zero")
            }
            ProtocolViolation::PayloadLengthMismatch { declared, actual } => write!(
                f,
                "frame header declares {declared} payload bytes but {actual} were given"
            ),
            ProtocolViolation::BadDescriptor { at } => {
                write!(f, "malformed op descriptor at byte {at}")
            }
            ProtocolViolation::AuthenticationFailed => {
                f.write_str("authentication failed (the peer does not hold this job's secret)")
            }
            #[cfg(feature = "tcp")]
            ProtocolViolation::ChecksumFailed {
                frame,
                sent,
                computed,
            } => {
                match frame {
                    Some(key) => write!(
                        f,
                        "CRC32C mismatch in a {:?} frame (group {}, seq {}, tag {})",
                        key.kind, key.group, key.seq, key.tag
                    )?,
                    None => f.write_str("CRC32C mismatch in a frame header")?,
                }
                write!(f, ": sent {sent:#010x}, computed {computed:#010x}")
            }
            ProtocolViolation::ChecksumSettingMismatch {
                rank,
                ours,
                peer,
                theirs,
            } => {
                let state = |on: bool| if on { "on" } else { "off" };
                write!(
                    f,
                    "rank {rank} has per-frame CRC32C checksums {} but rank {peer} has them {}; \
                     set TcpConfig::frame_checksum (or HYPERSHARD_CRC32C) alike on every rank",
                    state(*ours),
                    state(*theirs)
                )
            }
        }
    }
}

/// Why the job secret could not be loaded.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum SecretProblem {
    /// The secret is empty.
    Empty,
    /// The secret file could not be read.
    FileUnreadable {
        /// The file.
        path: std::path::PathBuf,
        /// What the operating system said.
        kind: std::io::ErrorKind,
    },
    /// The secret file is accessible to group or others.
    FileTooOpen {
        /// The file.
        path: std::path::PathBuf,
        /// Its permission bits.
        mode: u32,
    },
    /// The operating system's random source failed.
    NoRandomness {
        /// The OS error code (0 when there is none).
        code: i32,
    },
}

impl fmt::Display for SecretProblem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SecretProblem::Empty => f.write_str("the secret is empty"),
            SecretProblem::FileUnreadable { path, kind } => {
                write!(f, "cannot read {}: {kind}", path.display())
            }
            SecretProblem::FileTooOpen { path, mode } => write!(
                f,
                "{} has mode {mode:o}; it must not be accessible to group or others (chmod 600)",
                path.display()
            ),
            SecretProblem::NoRandomness { code } => {
                write!(f, "the OS random source failed (error {code})")
            }
        }
    }
}

/// What an environment variable should have held.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum EnvExpectation {
    /// A positive, finite number of seconds (fractions allowed).
    PositiveSeconds,
    /// A non-negative integer.
    NonNegativeInteger,
    /// A positive integer.
    PositiveInteger,
    /// A TCP port, 1–65535.
    Port,
    /// A non-empty string.
    NonEmpty,
    /// A transport name: `auto`, `tcp` or `shm`.
    TransportName,
    /// A backend name: `tcp`, `mpi` or `nccl` (`HYPERSHARD_BACKEND`).
    BackendName,
    /// A switch: `1`, `true`, `on`, `yes` or `0`, `false`, `off`, `no` (`HYPERSHARD_CRC32C`).
    Switch,
}

impl fmt::Display for EnvExpectation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            EnvExpectation::PositiveSeconds => "a positive number of seconds",
            EnvExpectation::NonNegativeInteger => "a non-negative integer",
            EnvExpectation::PositiveInteger => "a positive integer",
            EnvExpectation::Port => "a TCP port (1-65535)",
            EnvExpectation::NonEmpty => "a non-empty string",
            EnvExpectation::TransportName => "one of auto, tcp, shm",
            EnvExpectation::BackendName => "one of tcp, mpi, nccl",
            EnvExpectation::Switch => "one of 1, true, on, yes, 0, false, off, no",
        })
    }
}

/// What an I/O error interrupted.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum IoAction {
    /// Binding a listening socket.
    Bind,
    /// Accepting a connection.
    Accept,
    /// Connecting to a peer or store.
    Connect,
    /// Reading.
    Read,
    /// Writing.
    Write,
    /// Setting a socket option.
    SocketOption,
    /// Setting up shared memory (creating, sizing or mapping a segment).
    SharedMemory,
}

impl fmt::Display for IoAction {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            IoAction::Bind => "bind",
            IoAction::Accept => "accept",
            IoAction::Connect => "connect",
            IoAction::Read => "read",
            IoAction::Write => "write",
            IoAction::SocketOption => "setting a socket option",
            IoAction::SharedMemory => "setting up shared memory",
        })
    }
}

impl Error {
    /// Whether the error came from this rank's own arguments or a disagreement between ranks'
    /// arguments, after which the communicator is still usable (every rank saw the same error
    /// at the same point of the stream). Lost peers, timeouts, protocol errors and aborts leave
    /// the group out of step; the caller should [`abort`](crate::Communicator::abort) it.
    pub fn is_recoverable(&self) -> bool {
        matches!(
            self,
            Error::LengthMismatch { .. }
                | Error::DTypeMismatch { .. }
                | Error::ArgumentMismatch { .. }
                | Error::InvalidRank { .. }
                | Error::UnsupportedOp { .. }
                | Error::UnsupportedBuffer { .. }
                | Error::ElementTypeMismatch { .. }
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_name_the_op_and_the_peer() {
        let e = Error::Timeout {
            op: OpKind::AllReduce,
            after: Duration::from_secs(2),
            peer: Some(3),
        };
        assert_eq!(
            e.to_string(),
            "all_reduce: timed out after 2s waiting for rank 3"
        );
        let e = Error::LengthMismatch {
            op: OpKind::AllGather,
            role: BufferRole::Peer { rank: 1 },
            expected: 4,
            got: 5,
        };
        assert_eq!(
            e.to_string(),
            "all_gather: rank 1's buffer has 5 elements, expected 4"
        );
        assert!(e.is_recoverable());
        assert!(
            !Error::Aborted {
                op: OpKind::Barrier
            }
            .is_recoverable()
        );
    }
}
